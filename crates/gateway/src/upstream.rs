//! The upstream HTTP client: one attempt per call, never a silent re-send.
//!
//! Why this matters: backstop is the single owner of retries (SPEC §4.3). An HTTP client that
//! quietly re-sends a request on a fresh connection when a pooled one turns out dead would make
//! one counted attempt into two real ones — for a payment, a duplicate. [`Upstream`] is
//! hyper-util's legacy `Client` configured so that this cannot happen:
//!
//! - `retry_canceled_requests(false)`: hyper-util's only re-send path (a request queued on a
//!   reused connection that died before a byte was written) is off; such a request surfaces as
//!   an error here. Its `Canceled` kind means the request was handed back unwritten, so it is
//!   reported as [`TransportError::Connect`] (not sent). Checkout of a closed pooled connection
//!   is likewise reported, not retried.
//! - no redirect following, no decompression, no middleware: a 3xx is an answer, bodies pass
//!   through as bytes arrive.
//! - connection pooling stays on (idle connections are kept 90 s); HTTP/1.1 over TCP or TLS
//!   (rustls with the `ring` provider and the webpki roots).
//!
//! The end-to-end test `e2e_no_library_retry` proves the property at a raw socket: an upstream
//! that accepts a pooled connection and closes it without answering sees exactly one request per
//! attempt, and the attempt fails.
//!
//! Errors are split by whether the provider may have seen the request (SPEC §2.1):
//! DNS failure → [`TransportError::Dns`]; TLS failure during the handshake →
//! [`TransportError::Tls`]; any other connect failure → [`TransportError::Connect`] — all
//! `not_sent`. Once a connection was handed the request: no response head within the attempt
//! timeout → [`TransportError::TimeoutAfterSend`]; reset or EOF → [`TransportError::ResetAfterSend`]
//! — both `uncertain`. A timeout that fires while still connecting (only possible when the
//! attempt timeout is shorter than the connect timeout) is also reported as `uncertain`: when in
//! doubt, the conservative answer. The attempt timeout covers the response *head*; a streaming
//! body (SSE) may run as long as the provider keeps sending.

use std::{error::Error as StdError, future::Future, pin::Pin, sync::Arc, time::Duration};

use axum::body::Body;
use backstop_core::classify::TransportError;
use bytes::Bytes;
use http_body_util::Full;
use hyper_rustls::HttpsConnector;
use hyper_util::{
    client::legacy::{connect::HttpConnector, Client},
    rt::{TokioExecutor, TokioTimer},
};

use crate::transport::{AttemptReply, AttemptRequest, Transport};

/// Timeouts of the upstream client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UpstreamConfig {
    /// Most time from the start of an attempt to the response head (default 60 s).
    pub attempt_timeout: Duration,
    /// Most time to establish a TCP connection (default 10 s; never longer than the attempt
    /// timeout).
    pub connect_timeout: Duration,
    /// How long an idle pooled connection is kept (default 90 s).
    pub pool_idle_timeout: Duration,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        UpstreamConfig {
            attempt_timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(10),
            pool_idle_timeout: Duration::from_secs(90),
        }
    }
}

/// The upstream client could not be built.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// The TLS configuration (rustls, ring provider) was refused.
    #[error("cannot configure TLS for upstream connections: {0}")]
    Tls(#[from] rustls::Error),
}

/// The production [`Transport`]: hyper-util's pooled client over HTTP/1.1, TCP or rustls.
#[derive(Clone)]
pub struct Upstream {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    config: UpstreamConfig,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("config", &self.config)
            .finish()
    }
}

impl Upstream {
    /// Builds the client. Call inside a tokio runtime (the pool spawns its idle reaper).
    ///
    /// # Errors
    /// [`UpstreamError::Tls`] when rustls refuses the ring provider's protocol versions.
    pub fn new(config: UpstreamConfig) -> Result<Upstream, UpstreamError> {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(config.connect_timeout.min(config.attempt_timeout)));
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_provider_and_webpki_roots(Arc::new(rustls::crypto::ring::default_provider()))?
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let client = Client::builder(TokioExecutor::new())
            .retry_canceled_requests(false)
            .pool_idle_timeout(config.pool_idle_timeout)
            .pool_timer(TokioTimer::new())
            .build(https);
        Ok(Upstream { client, config })
    }

    /// The configured timeouts.
    pub fn config(&self) -> UpstreamConfig {
        self.config
    }

    async fn send_once(&self, request: AttemptRequest) -> AttemptReply {
        let empty_content = request.body.is_empty() && defines_content(&request.method);
        let mut builder = http::Request::builder()
            .method(request.method)
            .uri(request.url.as_str());
        if let Some(headers) = builder.headers_mut() {
            *headers = request.headers;
            if empty_content {
                // RFC 9110 §8.6: a user agent SHOULD send `Content-Length: 0` for a method that
                // defines content (POST, PUT, PATCH) when it sends none; hyper omits it.
                headers.insert(
                    http::header::CONTENT_LENGTH,
                    http::HeaderValue::from_static("0"),
                );
            }
        }
        let http_request = match builder.body(Full::new(request.body)) {
            Ok(r) => r,
            Err(error) => {
                // A URL the client cannot parse never leaves the process.
                tracing::warn!(url = %without_query(&request.url), %error, "upstream request could not be built");
                return AttemptReply::Failed(TransportError::Connect);
            }
        };
        match tokio::time::timeout(
            self.config.attempt_timeout,
            self.client.request(http_request),
        )
        .await
        {
            Err(_elapsed) => AttemptReply::Failed(TransportError::TimeoutAfterSend),
            Ok(Err(error)) => {
                let kind = classify_client_error(&error);
                // At info: the cause (a DNS name that does not resolve, a response hyper could
                // not parse, such as one with more than 100 headers) is what explains the
                // disposition the engine logs next.
                tracing::info!(url = %without_query(&request.url), error = %error_chain(&error), kind = %kind, "upstream attempt failed");
                AttemptReply::Failed(kind)
            }
            Ok(Ok(response)) => AttemptReply::Response(response.map(Body::new)),
        }
    }
}

impl Transport for Upstream {
    fn send(&self, request: AttemptRequest) -> Pin<Box<dyn Future<Output = AttemptReply> + Send>> {
        let this = self.clone();
        Box::pin(async move { this.send_once(request).await })
    }
}

/// `url` without its query, which may carry a credential (`?key=…`): what a log line names.
fn without_query(url: &str) -> &str {
    url.split_once('?').map_or(url, |(before, _)| before)
}

/// Maps a client error to its SPEC §2.1 transport kind (see the module docs).
pub fn classify_client_error(error: &hyper_util::client::legacy::Error) -> TransportError {
    if error.is_connect() {
        if chain(error).any(is_tls_error) {
            return TransportError::Tls;
        }
        if chain(error).any(|e| e.to_string() == "dns error") {
            return TransportError::Dns;
        }
        return TransportError::Connect;
    }
    // hyper-util hands an unwritten request back as `Canceled` (see `retry_canceled_requests`):
    // nothing of it reached the provider.
    if error.to_string() == "client error (Canceled)" {
        return TransportError::Connect;
    }
    let timed_out = chain(error).any(|e| {
        e.downcast_ref::<hyper::Error>()
            .is_some_and(|h| h.is_timeout())
            || e.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
    });
    if timed_out {
        TransportError::TimeoutAfterSend
    } else {
        TransportError::ResetAfterSend
    }
}

fn is_tls_error(e: &(dyn StdError + 'static)) -> bool {
    // io::Error::source() skips its own payload, and connectors nest io::Errors, so look inside
    // each layer explicitly.
    let mut current: Option<&(dyn StdError + 'static)> = Some(e);
    while let Some(e) = current {
        if e.downcast_ref::<rustls::Error>().is_some() {
            return true;
        }
        current = e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .map(|inner| inner as &(dyn StdError + 'static));
    }
    false
}

/// Methods whose requests define a meaning for enclosed content (RFC 9110 §9.3.3, §9.3.4,
/// RFC 5789).
fn defines_content(method: &http::Method) -> bool {
    matches!(
        *method,
        http::Method::POST | http::Method::PUT | http::Method::PATCH
    )
}

fn chain<'a>(
    error: &'a (dyn StdError + 'static),
) -> impl Iterator<Item = &'a (dyn StdError + 'static)> {
    std::iter::successors(Some(error), |e: &&'a (dyn StdError + 'static)| {
        (*e).source()
    })
}

/// `a: b: c` over an error's source chain (for logs; upstream errors never carry secrets).
pub fn error_chain(error: &(dyn StdError + 'static)) -> String {
    chain(error)
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::TcpListener,
    };

    fn request(url: String) -> AttemptRequest {
        AttemptRequest {
            method: http::Method::GET,
            url,
            headers: http::HeaderMap::new(),
            body: Bytes::new(),
        }
    }

    fn failed(reply: AttemptReply) -> TransportError {
        match reply {
            AttemptReply::Failed(kind) => kind,
            AttemptReply::Response(r) => panic!("expected a failure, got {}", r.status()),
        }
    }

    /// The request head an upstream receives for `request`, read raw.
    async fn head_seen(method: http::Method) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut buffer = vec![0u8; 4096];
            let mut seen = Vec::new();
            while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = socket.read(&mut buffer).await.unwrap();
                if n == 0 {
                    break;
                }
                seen.extend_from_slice(&buffer[..n]);
            }
            socket
                .write_all(b"HTTP/1.1 204 No Content\r\n\r\n")
                .await
                .unwrap();
            String::from_utf8_lossy(&seen).to_ascii_lowercase()
        });
        let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
        let mut attempt = request(format!("http://{addr}/x"));
        attempt.method = method;
        let _ = upstream.send(attempt).await;
        server.await.unwrap()
    }

    #[tokio::test]
    async fn an_empty_post_is_sent_with_content_length_zero() {
        for method in [http::Method::POST, http::Method::PUT, http::Method::PATCH] {
            let head = head_seen(method.clone()).await;
            assert!(
                head.contains("\r\ncontent-length: 0\r\n"),
                "{method}: {head}"
            );
        }
        let head = head_seen(http::Method::GET).await;
        assert!(!head.contains("content-length"), "{head}");
    }

    #[tokio::test]
    async fn refused_connection_is_not_sent() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
        let kind = failed(upstream.send(request(format!("http://{addr}/x"))).await);
        assert_eq!(kind, TransportError::Connect);
        assert!(!kind.maybe_delivered());
    }

    #[tokio::test]
    async fn unresolvable_name_is_a_dns_failure() {
        let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
        let kind = failed(
            upstream
                .send(request("http://backstop-test.invalid/x".into()))
                .await,
        );
        assert_eq!(kind, TransportError::Dns);
    }

    #[tokio::test]
    async fn tls_handshake_failure_is_not_sent() {
        // A plain-HTTP server answering a TLS ClientHello: the handshake fails before any
        // request byte is written.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 512];
            let _ = socket.read(&mut buf).await;
            let _ = socket
                .write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
                .await;
        });
        let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
        let kind = failed(
            upstream
                .send(request(format!("https://localhost:{}/x", addr.port())))
                .await,
        );
        assert_eq!(kind, TransportError::Tls);
    }

    #[tokio::test]
    async fn no_response_head_within_the_attempt_timeout_is_uncertain() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let held = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let n = socket.read(&mut buf).await.unwrap();
            tokio::time::sleep(Duration::from_secs(5)).await;
            n
        });
        let upstream = Upstream::new(UpstreamConfig {
            attempt_timeout: Duration::from_millis(300),
            ..UpstreamConfig::default()
        })
        .unwrap();
        let kind = failed(upstream.send(request(format!("http://{addr}/slow"))).await);
        assert_eq!(kind, TransportError::TimeoutAfterSend);
        assert!(kind.maybe_delivered());
        held.abort();
    }

    #[tokio::test]
    async fn close_after_reading_the_request_is_an_uncertain_reset() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let _ = socket.read(&mut buf).await;
            drop(socket);
        });
        let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
        let kind = failed(upstream.send(request(format!("http://{addr}/x"))).await);
        assert_eq!(kind, TransportError::ResetAfterSend);
    }
}
