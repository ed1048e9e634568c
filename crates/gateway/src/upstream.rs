//! The upstream HTTP client: one attempt per call, never a silent re-send.
//!
//! Why this matters: backstop is the single owner of retries (SPEC §4.3). An HTTP client that
//! quietly re-sends a request on a fresh connection when a pooled one turns out dead would make
//! one counted attempt into two real ones — for a payment, a duplicate. [`Upstream`] is a small
//! client of its own over hyper's HTTP/1.1 connection API (`hyper::client::conn::http1`), so
//! there is no re-send path to switch off:
//!
//! - one attempt hands its request to exactly one connection, once, with
//!   `SendRequest::try_send_request`. If hyper hands the request back unwritten (the connection
//!   failed while the request was still queued), the attempt is reported as
//!   [`TransportError::Connect`] (not sent) — it is never offered to another connection.
//! - a pooled connection is checked *before* a request is handed to it: one poll of its
//!   connection future (a closed or failed connection is then finished) and the sender's
//!   `is_closed` / `is_ready`. A connection that fails the check is dropped and the next idle one
//!   (or a new one) is taken; no request was involved yet, so this is not a re-send.
//! - no redirect following, no decompression, no middleware: a 3xx is an answer, bodies pass
//!   through as bytes arrive.
//!
//! Connections are driven inline, by whoever waits on them, never by a task of their own. While
//! an attempt waits for the response head, it polls the connection future and the response
//! future together; the response body handed back ([`AttemptReply::Response`]) owns the
//! connection and polls it before hyper's body channel, so a streaming body (SSE) keeps flowing
//! with only its reader polling it. When the body reaches its end and the connection is ready for
//! another request, the connection goes back to the pool; a body dropped before its end, or a
//! connection that cannot be reused, closes the socket.
//!
//! The pool is keyed by (scheme, host, port) and holds idle connections with the instant they
//! became idle (HTTP/1.1 over TCP or TLS: rustls with the `ring` provider and the webpki roots).
//! Checkout takes the most recently idle connection and discards those idle longer than
//! `pool_idle_timeout` (default 90 s). A sweep every `pool_idle_timeout` drops expired idle
//! connections, so a host no longer called does not keep sockets open.
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

use std::{
    collections::HashMap,
    error::Error as StdError,
    future::{poll_fn, Future},
    pin::{pin, Pin},
    sync::{Arc, Mutex, MutexGuard, Weak},
    task::{Context, Poll, Waker},
    time::Duration,
};

use axum::body::Body;
use backstop_core::classify::TransportError;
use bytes::Bytes;
use http::uri::{Authority, Scheme, Uri};
use http_body::{Body as _, Frame, SizeHint};
use http_body_util::Full;
use hyper::{
    body::Incoming,
    client::conn::{http1, TrySendError},
};
use hyper_rustls::{HttpsConnector, MaybeHttpsStream};
use hyper_util::{client::legacy::connect::HttpConnector, rt::TokioIo};
use tokio::{net::TcpStream, time::Instant};
use tower_service::Service;

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

/// The socket of one upstream connection: TCP, or TLS over TCP.
type Io = MaybeHttpsStream<TokioIo<TcpStream>>;
/// The request side of one HTTP/1.1 connection.
type Sender = http1::SendRequest<Full<Bytes>>;
/// The state machine of one HTTP/1.1 connection: reads, writes, and notices hang-ups only while
/// polled.
type Connection = http1::Connection<Io, Full<Bytes>>;

/// The production [`Transport`]: HTTP/1.1 over TCP or rustls, with a pool of connections that
/// are driven inline by the attempt and the response body using them (see the module docs).
#[derive(Clone)]
pub struct Upstream {
    connector: HttpsConnector<HttpConnector>,
    handshake: http1::Builder,
    pool: Arc<Pool>,
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
    /// Builds the client. Call inside a tokio runtime (the pool spawns its idle sweep).
    ///
    /// # Errors
    /// [`UpstreamError::Tls`] when rustls refuses the ring provider's protocol versions.
    pub fn new(config: UpstreamConfig) -> Result<Upstream, UpstreamError> {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(config.connect_timeout.min(config.attempt_timeout)));
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_provider_and_webpki_roots(Arc::new(rustls::crypto::ring::default_provider()))?
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let pool = Arc::new(Pool::new(config.pool_idle_timeout));
        Pool::spawn_sweep(&pool);
        Ok(Upstream {
            connector,
            handshake: http1::Builder::new(),
            pool,
            config,
        })
    }

    /// The configured timeouts.
    pub fn config(&self) -> UpstreamConfig {
        self.config
    }

    async fn send_once(&self, request: AttemptRequest) -> AttemptReply {
        let url = without_query(&request.url);
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
        let prepared = builder
            .body(Full::new(request.body))
            .map_err(|error| error.to_string())
            .and_then(|mut http_request| {
                let destination = Destination::of(http_request.uri())?;
                to_origin_form(&mut http_request)?;
                Ok((destination, http_request))
            });
        let (destination, http_request) = match prepared {
            Ok(prepared) => prepared,
            Err(error) => {
                // A URL the client cannot use never leaves the process.
                tracing::warn!(%url, %error, "upstream request could not be built");
                return AttemptReply::Failed(TransportError::Connect);
            }
        };
        let attempt = self.exchange(destination, http_request);
        match tokio::time::timeout(self.config.attempt_timeout, attempt).await {
            Err(_elapsed) => AttemptReply::Failed(TransportError::TimeoutAfterSend),
            Ok(Ok(response)) => AttemptReply::Response(response),
            Ok(Err(failure)) => {
                // At info: the cause (a DNS name that does not resolve, a response hyper could
                // not parse, such as one with more than 100 headers) is what explains the
                // disposition the engine logs next.
                tracing::info!(%url, error = %failure.chain, kind = %failure.kind, "upstream attempt failed");
                AttemptReply::Failed(failure.kind)
            }
        }
    }

    /// Hands `request` to one connection (pooled or new) and waits for the response head,
    /// driving the connection meanwhile.
    async fn exchange(
        &self,
        destination: Destination,
        request: http::Request<Full<Bytes>>,
    ) -> Result<http::Response<Body>, Failure> {
        let (mut sender, connection) = match self.pool.checkout(&destination.key) {
            Some(pair) => pair,
            None => self.connect(destination.connect_to()?).await?,
        };
        let mut connection = Some(connection);
        let mut response = pin!(sender.try_send_request(request));
        let result = poll_fn(|cx| {
            // The connection first: it writes the request and reads the response head.
            if let Some(polled) = connection.as_mut() {
                if let Poll::Ready(outcome) = Pin::new(polled).poll(cx) {
                    if let Err(error) = outcome {
                        tracing::debug!(error = %error_chain(&error), "upstream connection failed");
                    }
                    // Finished: dropping it fails whatever request it still holds, which
                    // completes the response future below.
                    connection = None;
                }
            }
            response.as_mut().poll(cx)
        })
        .await;
        match result {
            Ok(response) => {
                let held = connection.map(|connection| Held {
                    sender,
                    connection,
                    key: destination.key,
                    pool: Arc::downgrade(&self.pool),
                });
                Ok(response.map(|incoming| Body::new(UpstreamBody { incoming, held })))
            }
            Err(error) => Err(Failure {
                kind: classify_send_error(&error),
                chain: error_chain(error.error()),
            }),
        }
    }

    /// Opens a new connection: TCP (and TLS) through the connector, then the HTTP/1.1 handshake.
    async fn connect(&self, connect_to: Uri) -> Result<(Sender, Connection), Failure> {
        let mut connector = self.connector.clone();
        let io = async {
            poll_fn(|cx| connector.poll_ready(cx)).await?;
            connector.call(connect_to).await
        }
        .await
        .map_err(|error| Failure {
            kind: classify_connect_error(&*error),
            chain: error_chain(&*error),
        })?;
        self.handshake.handshake(io).await.map_err(|error| Failure {
            kind: TransportError::Connect,
            chain: error_chain(&error),
        })
    }
}

impl Transport for Upstream {
    fn send(&self, request: AttemptRequest) -> Pin<Box<dyn Future<Output = AttemptReply> + Send>> {
        let this = self.clone();
        Box::pin(async move { this.send_once(request).await })
    }
}

/// Why an attempt failed: its SPEC §2.1 kind and the error chain for the log line.
struct Failure {
    kind: TransportError,
    chain: String,
}

/// Where a request goes: its pool key, and the authority a new connection opens.
struct Destination {
    key: PoolKey,
    authority: Authority,
}

impl Destination {
    fn of(uri: &Uri) -> Result<Destination, String> {
        let (Some(scheme), Some(authority)) = (uri.scheme(), uri.authority()) else {
            return Err("the upstream URL is not absolute".to_owned());
        };
        let key = PoolKey {
            scheme: scheme.clone(),
            host: authority.host().to_ascii_lowercase(),
            port: authority
                .port_u16()
                .unwrap_or(if is_secure(scheme) { 443 } else { 80 }),
        };
        Ok(Destination {
            key,
            authority: authority.clone(),
        })
    }

    /// `scheme://authority/`: what the connector resolves, connects to and names in TLS. Built
    /// only when no pooled connection serves the request.
    fn connect_to(&self) -> Result<Uri, Failure> {
        Uri::builder()
            .scheme(self.key.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query("/")
            .build()
            .map_err(|error| Failure {
                kind: TransportError::Connect,
                chain: error.to_string(),
            })
    }
}

fn is_secure(scheme: &Scheme) -> bool {
    *scheme == Scheme::HTTPS || scheme.as_str().eq_ignore_ascii_case("wss")
}

/// Rewrites an absolute-form request for an origin server (RFC 9112 §3.2): `Host` from the
/// authority (with the port when it is not the scheme's default), the target in origin form.
fn to_origin_form(request: &mut http::Request<Full<Bytes>>) -> Result<(), String> {
    let uri = request.uri().clone();
    if !request.headers().contains_key(http::header::HOST) {
        let host = uri.host().unwrap_or_default();
        let default_port = if uri.scheme().is_some_and(is_secure) {
            443
        } else {
            80
        };
        let value = match uri.port_u16() {
            Some(port) if port != default_port => format!("{host}:{port}"),
            _ => host.to_owned(),
        };
        let value = http::HeaderValue::try_from(value).map_err(|error| error.to_string())?;
        request.headers_mut().insert(http::header::HOST, value);
    }
    let origin = match uri.path_and_query() {
        Some(path) if path.as_str() != "/" => {
            let mut parts = http::uri::Parts::default();
            parts.path_and_query = Some(path.clone());
            Uri::from_parts(parts).map_err(|error| error.to_string())?
        }
        _ => Uri::from_static("/"),
    };
    *request.uri_mut() = origin;
    Ok(())
}

/// Which connections may serve a request.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct PoolKey {
    scheme: Scheme,
    /// Lower-cased.
    host: String,
    /// Explicit, or the scheme's default.
    port: u16,
}

/// A connection nobody uses, and since when.
struct Idle {
    sender: Sender,
    connection: Connection,
    since: Instant,
}

/// Idle connections by destination. Each list is in the order the connections became idle.
struct Pool {
    idle: Mutex<HashMap<PoolKey, Vec<Idle>>>,
    idle_timeout: Duration,
}

impl Pool {
    fn new(idle_timeout: Duration) -> Pool {
        Pool {
            idle: Mutex::new(HashMap::new()),
            idle_timeout,
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<PoolKey, Vec<Idle>>> {
        self.idle
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Drops expired idle connections every `idle_timeout`, for as long as the pool lives.
    fn spawn_sweep(pool: &Arc<Pool>) {
        let period = pool.idle_timeout;
        if period.is_zero() {
            return; // nothing is ever pooled
        }
        let pool = Arc::downgrade(pool);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(period).await;
                let Some(pool) = pool.upgrade() else {
                    return;
                };
                pool.sweep();
            }
        });
    }

    fn expired(&self, idle: &Idle, now: Instant) -> bool {
        now.saturating_duration_since(idle.since) > self.idle_timeout
    }

    fn sweep(&self) {
        let now = Instant::now();
        let mut expired = Vec::new();
        {
            let mut map = self.lock();
            map.retain(|_, list| {
                // Oldest first: the expired ones are a prefix.
                let keep_from = list.partition_point(|idle| self.expired(idle, now));
                expired.extend(list.drain(..keep_from));
                !list.is_empty()
            });
        }
        // Closes the sockets outside the lock.
        drop(expired);
    }

    /// The most recently idle connection to `key` that is still usable, if any. Expired and
    /// closed connections met on the way are dropped.
    fn checkout(&self, key: &PoolKey) -> Option<(Sender, Connection)> {
        loop {
            let now = Instant::now();
            let mut discarded = Vec::new();
            let found = {
                let mut map = self.lock();
                let list = map.get_mut(key)?;
                let found = list.pop();
                if found.as_ref().is_some_and(|idle| self.expired(idle, now)) {
                    // The most recent is expired, so all are.
                    discarded.append(list);
                }
                if list.is_empty() {
                    map.remove(key);
                }
                found
            };
            drop(discarded);
            let mut idle = found?;
            if self.expired(&idle, now) {
                return None;
            }
            if usable(&idle.sender, &mut idle.connection) {
                return Some((idle.sender, idle.connection));
            }
        }
    }

    /// Keeps a connection whose last exchange is complete for the next request to `key`.
    fn put(&self, key: PoolKey, sender: Sender, connection: Connection) {
        if self.idle_timeout.is_zero() {
            return;
        }
        let mut map = self.lock();
        let since = Instant::now();
        map.entry(key).or_default().push(Idle {
            sender,
            connection,
            since,
        });
    }
}

/// Whether an idle connection can take a request: one poll of its connection future (without a
/// waker: nobody waits on an idle connection) lets it notice a close or an error from the peer.
fn usable(sender: &Sender, connection: &mut Connection) -> bool {
    let mut cx = Context::from_waker(Waker::noop());
    if Pin::new(connection).poll(&mut cx).is_ready() {
        return false;
    }
    !sender.is_closed() && sender.is_ready()
}

/// A connection lent to one response body.
struct Held {
    sender: Sender,
    connection: Connection,
    key: PoolKey,
    pool: Weak<Pool>,
}

impl Held {
    /// Polls the connection: `false` once it has finished (closed, failed).
    fn drive(&mut self, cx: &mut Context<'_>) -> bool {
        match Pin::new(&mut self.connection).poll(cx) {
            Poll::Pending => true,
            Poll::Ready(outcome) => {
                if let Err(error) = outcome {
                    tracing::debug!(error = %error_chain(&error), "upstream connection failed");
                }
                false
            }
        }
    }

    /// The exchange is over: back to the pool if the connection is ready for another request,
    /// otherwise closed (dropped). The last poll registers no waker: the reader is done with the
    /// connection and must not be woken by what happens to it while idle.
    fn release(mut self) {
        let mut cx = Context::from_waker(Waker::noop());
        if self.drive(&mut cx) && !self.sender.is_closed() && self.sender.is_ready() {
            if let Some(pool) = self.pool.upgrade() {
                pool.put(self.key, self.sender, self.connection);
            }
        }
    }
}

/// A response body that drives its own connection: each poll polls the connection first, then
/// hyper's body channel, so no other task is needed for the bytes to arrive.
struct UpstreamBody {
    incoming: Incoming,
    /// `None` once the connection finished or was released.
    held: Option<Held>,
}

impl UpstreamBody {
    fn release(&mut self) {
        if let Some(held) = self.held.take() {
            held.release();
        }
    }
}

impl http_body::Body for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        if let Some(held) = this.held.as_mut() {
            if !held.drive(cx) {
                // Finished: what it read is in the body channel already.
                this.held = None;
            }
        }
        let frame = match Pin::new(&mut this.incoming).poll_frame(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(frame) => frame,
        };
        match &frame {
            None => this.release(),
            Some(Ok(_)) if this.incoming.is_end_stream() => this.release(),
            Some(Ok(_)) => {}
            // A broken body: the connection is not reused.
            Some(Err(_)) => this.held = None,
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.incoming.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.incoming.size_hint()
    }
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        // A reader may stop at `is_end_stream` (an empty body, or the last chunk of a
        // `Content-Length` body) without polling for the end: the exchange is complete all the
        // same. Any other body dropped early takes its connection with it (the socket closes).
        if self.held.is_some() && self.incoming.is_end_stream() {
            self.release();
        }
    }
}

/// `url` without its query, which may carry a credential (`?key=…`): what a log line names.
fn without_query(url: &str) -> &str {
    url.split_once('?').map_or(url, |(before, _)| before)
}

/// Maps a failure to open a connection (the connector's error: DNS, TCP, TLS) to its SPEC §2.1
/// transport kind; all are `not_sent`.
pub fn classify_connect_error(error: &(dyn StdError + 'static)) -> TransportError {
    if chain(error).any(is_tls_error) {
        return TransportError::Tls;
    }
    if chain(error).any(|e| e.to_string() == "dns error") {
        return TransportError::Dns;
    }
    TransportError::Connect
}

/// Maps a failure of `SendRequest::try_send_request` to its SPEC §2.1 transport kind: a request
/// hyper hands back unwritten → [`TransportError::Connect`] (not sent); otherwise the connection
/// had the request → [`TransportError::TimeoutAfterSend`] for a timeout,
/// [`TransportError::ResetAfterSend`] for anything else (both uncertain).
pub fn classify_send_error<T>(error: &TrySendError<T>) -> TransportError {
    if error.message().is_some() {
        return TransportError::Connect;
    }
    let timed_out = chain(error.error()).any(|e| {
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

    /// What a counting upstream answers to request `request` (0-based) on connection
    /// `connection` (0-based), and whether (after how long) it then closes the connection.
    type Script = fn(connection: usize, request: usize) -> (&'static [u8], Option<Duration>);

    const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";

    /// What a counting upstream saw, per connection in accept order.
    #[derive(Default)]
    struct Seen {
        /// Requests read on each connection.
        requests: Vec<usize>,
        /// Whether each connection has been closed (by either side).
        closed: Vec<bool>,
    }

    /// A raw HTTP/1.1 upstream that counts connections and the requests read on each.
    async fn counting_upstream(script: Script) -> (String, Arc<Mutex<Seen>>) {
        paced_upstream(script, usize::MAX, Duration::ZERO).await
    }

    /// [`counting_upstream`] writing each answer in writes of at most `piece` bytes, `pause`
    /// apart.
    async fn paced_upstream(
        script: Script,
        piece: usize,
        pause: Duration,
    ) -> (String, Arc<Mutex<Seen>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Seen::default()));
        let shared = seen.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut socket, _)) = listener.accept().await else {
                    return;
                };
                let connection = {
                    let mut seen = shared.lock().unwrap();
                    seen.requests.push(0);
                    seen.closed.push(false);
                    seen.requests.len() - 1
                };
                let seen = shared.clone();
                tokio::spawn(async move {
                    let mut request = 0;
                    while read_request_head(&mut socket).await {
                        seen.lock().unwrap().requests[connection] += 1;
                        let (answer, close) = script(connection, request);
                        for (i, bytes) in answer.chunks(piece).enumerate() {
                            if i > 0 {
                                tokio::time::sleep(pause).await;
                            }
                            let _ = socket.write_all(bytes).await;
                        }
                        request += 1;
                        if let Some(after) = close {
                            tokio::time::sleep(after).await;
                            break;
                        }
                    }
                    drop(socket);
                    seen.lock().unwrap().closed[connection] = true;
                });
            }
        });
        (format!("http://{addr}"), seen)
    }

    /// Reads one request head (the test requests have no body). `false` on EOF or error.
    async fn read_request_head(socket: &mut tokio::net::TcpStream) -> bool {
        let mut seen = Vec::new();
        let mut buf = [0u8; 1024];
        loop {
            match socket.read(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => {
                    seen.extend_from_slice(&buf[..n]);
                    if seen.windows(4).any(|w| w == b"\r\n\r\n") {
                        return true;
                    }
                }
            }
        }
    }

    /// Sends a GET and reads the whole answer, which must be a 200.
    async fn answered(upstream: &Upstream, url: &str) -> Bytes {
        let response = response_to(upstream, http::Method::GET, url).await;
        assert_eq!(response.status(), 200);
        read_body(response).await.unwrap()
    }

    /// Waits (up to 3 s) until `done` holds for what the upstream saw.
    async fn until(seen: &Mutex<Seen>, done: impl Fn(&Seen) -> bool) {
        for _ in 0..300 {
            if done(&seen.lock().unwrap()) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn sequential_requests_to_one_host_reuse_one_connection() {
        let (url, seen) = counting_upstream(|_, _| (OK, None)).await;
        let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
        assert_eq!(&answered(&upstream, &url).await[..], b"ok");
        assert_eq!(&answered(&upstream, &url).await[..], b"ok");
        let seen = seen.lock().unwrap();
        assert_eq!(seen.requests, vec![2], "two requests on one connection");
    }

    #[tokio::test]
    async fn a_body_dropped_before_its_end_closes_its_connection() {
        // The first connection's answer promises 1000 bytes and sends 5.
        let (url, seen) = counting_upstream(|connection, _| match connection {
            0 => (
                b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\nhello",
                None,
            ),
            _ => (OK, None),
        })
        .await;
        let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
        match upstream.send(request(format!("{url}/x"))).await {
            AttemptReply::Response(response) => {
                assert_eq!(response.status(), 200);
                drop(response);
            }
            AttemptReply::Failed(kind) => panic!("the attempt failed: {kind}"),
        }
        until(&seen, |seen| seen.closed == [true]).await;
        assert_eq!(
            seen.lock().unwrap().closed,
            vec![true],
            "the upstream saw the connection close"
        );
        assert_eq!(&answered(&upstream, &url).await[..], b"ok");
        let seen = seen.lock().unwrap();
        assert_eq!(
            seen.requests,
            vec![1, 1],
            "the second request on a new connection"
        );
    }

    #[tokio::test]
    async fn a_pooled_connection_closed_while_idle_is_noticed_at_checkout() {
        // Every connection is closed by the upstream 100 ms after its first answer: by then the
        // connection is idle in the pool.
        let (url, seen) = counting_upstream(|_, _| (OK, Some(Duration::from_millis(100)))).await;
        let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
        assert_eq!(&answered(&upstream, &url).await[..], b"ok");
        until(&seen, |seen| seen.closed == [true]).await;
        // Let the runtime's I/O driver see the FIN.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(&answered(&upstream, &url).await[..], b"ok");
        tokio::time::sleep(Duration::from_millis(50)).await;
        let seen = seen.lock().unwrap();
        assert_eq!(
            seen.requests,
            vec![1, 1],
            "the second request went out once, on a new connection"
        );
    }

    #[tokio::test]
    async fn a_streaming_body_flows_chunk_by_chunk_with_only_its_reader_polling() {
        use http_body_util::BodyExt;
        // A blocking upstream on a thread of its own (none of its work is a task of this
        // runtime): it sends each chunk only after the reader got the previous one.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (got, got_rx) = std::sync::mpsc::channel::<()>();
        let server = std::thread::spawn(move || {
            use std::io::{Read, Write};
            let (mut socket, _) = listener.accept().unwrap();
            let mut seen = Vec::new();
            let mut buf = [0u8; 1024];
            while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = socket.read(&mut buf).unwrap();
                assert!(n > 0);
                seen.extend_from_slice(&buf[..n]);
            }
            socket
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                .unwrap();
            for chunk in ["data: 1\n\n", "data: 2\n\n", "data: 3\n\n"] {
                std::thread::sleep(Duration::from_millis(100));
                write!(socket, "{:x}\r\n{chunk}\r\n", chunk.len()).unwrap();
                socket.flush().unwrap();
                got_rx
                    .recv_timeout(Duration::from_secs(5))
                    .expect("the reader got the chunk");
            }
            socket.write_all(b"0\r\n\r\n").unwrap();
        });
        let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
        let tasks = tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks();
        let mut body = match upstream
            .send(request(format!("http://{addr}/events")))
            .await
        {
            AttemptReply::Response(response) => response.into_body(),
            AttemptReply::Failed(kind) => panic!("the attempt failed: {kind}"),
        };
        for expected in ["data: 1\n\n", "data: 2\n\n", "data: 3\n\n"] {
            let frame = tokio::time::timeout(Duration::from_secs(5), body.frame())
                .await
                .expect("the chunk arrived")
                .expect("a frame")
                .unwrap();
            assert_eq!(frame.into_data().unwrap(), expected.as_bytes());
            assert_eq!(
                tokio::runtime::Handle::current()
                    .metrics()
                    .num_alive_tasks(),
                tasks,
                "no task drives the connection"
            );
            got.send(()).unwrap();
        }
        let end = tokio::time::timeout(Duration::from_secs(5), body.frame())
            .await
            .expect("the end arrived");
        assert!(end.is_none());
        server.join().unwrap();
    }

    #[tokio::test]
    async fn an_idle_connection_older_than_the_idle_timeout_is_not_reused() {
        let (url, seen) = counting_upstream(|_, _| (OK, None)).await;
        let config = UpstreamConfig::default();
        let upstream = Upstream::new(config).unwrap();
        assert_eq!(&answered(&upstream, &url).await[..], b"ok");
        // Age the pooled connection past the idle timeout (the sweep runs only every 90 s).
        {
            let mut pool = upstream.pool.lock();
            let idle: Vec<&mut Idle> = pool.values_mut().flatten().collect();
            assert_eq!(idle.len(), 1);
            for idle in idle {
                idle.since -= config.pool_idle_timeout + Duration::from_secs(1);
            }
        }
        assert_eq!(&answered(&upstream, &url).await[..], b"ok");
        until(&seen, |seen| seen.closed.first() == Some(&true)).await;
        let seen = seen.lock().unwrap();
        assert_eq!(
            seen.requests,
            vec![1, 1],
            "the second request on a new connection"
        );
        assert_eq!(seen.closed, vec![true, false], "the expired one was closed");
    }

    #[tokio::test]
    async fn the_sweep_closes_connections_idle_past_the_timeout() {
        let (url, seen) = counting_upstream(|_, _| (OK, None)).await;
        let upstream = Upstream::new(UpstreamConfig {
            pool_idle_timeout: Duration::from_millis(100),
            ..UpstreamConfig::default()
        })
        .unwrap();
        assert_eq!(&answered(&upstream, &url).await[..], b"ok");
        until(&seen, |seen| seen.closed == [true]).await;
        let seen = seen.lock().unwrap();
        assert_eq!(seen.requests, vec![1]);
        assert_eq!(
            seen.closed,
            vec![true],
            "the idle connection was closed with no request"
        );
    }

    // Unusual upstream behaviour: what the upstream saw (connections, requests on each) and what
    // the caller got.

    /// The response to `method url/x`, which must not be a transport failure.
    async fn response_to(
        upstream: &Upstream,
        method: http::Method,
        url: &str,
    ) -> http::Response<Body> {
        let mut attempt = request(format!("{url}/x"));
        attempt.method = method;
        match tokio::time::timeout(Duration::from_secs(5), upstream.send(attempt)).await {
            Ok(AttemptReply::Response(response)) => response,
            Ok(AttemptReply::Failed(kind)) => panic!("the attempt failed: {kind}"),
            Err(_) => panic!("no answer within 5 s"),
        }
    }

    /// The whole body, or its error; within 5 s.
    async fn read_body(response: http::Response<Body>) -> Result<Bytes, axum::Error> {
        tokio::time::timeout(
            Duration::from_secs(5),
            axum::body::to_bytes(response.into_body(), 1 << 20),
        )
        .await
        .expect("the body ended within 5 s")
    }

    #[tokio::test]
    async fn a_head_answer_with_a_content_length_has_no_body_and_its_connection_is_reused() {
        let (url, seen) = counting_upstream(|_, request| match request {
            0 | 1 => (b"HTTP/1.1 200 OK\r\ncontent-length: 1234\r\n\r\n", None),
            _ => (OK, None),
        })
        .await;
        let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
        let head = response_to(&upstream, http::Method::HEAD, &url).await;
        assert_eq!(head.status(), 200);
        assert_eq!(&read_body(head).await.unwrap()[..], b"");
        // Dropped unread: an empty body is a complete exchange all the same.
        drop(response_to(&upstream, http::Method::HEAD, &url).await);
        assert_eq!(&answered(&upstream, &url).await[..], b"ok");
        assert_eq!(seen.lock().unwrap().requests, vec![3], "one connection");
    }

    #[tokio::test]
    async fn answers_204_and_304_have_no_body_and_their_connection_is_reused() {
        let (url, seen) = counting_upstream(|_, request| match request {
            0 => (b"HTTP/1.1 204 No Content\r\n\r\n", None),
            // The length of the representation that was not sent (RFC 9110 §8.6).
            1 => (
                b"HTTP/1.1 304 Not Modified\r\netag: \"a\"\r\ncontent-length: 50\r\n\r\n",
                None,
            ),
            _ => (OK, None),
        })
        .await;
        let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
        let no_content = response_to(&upstream, http::Method::GET, &url).await;
        assert_eq!(no_content.status(), 204);
        assert_eq!(&read_body(no_content).await.unwrap()[..], b"");
        let not_modified = response_to(&upstream, http::Method::GET, &url).await;
        assert_eq!(not_modified.status(), 304);
        assert_eq!(&read_body(not_modified).await.unwrap()[..], b"");
        assert_eq!(&answered(&upstream, &url).await[..], b"ok");
        assert_eq!(seen.lock().unwrap().requests, vec![3], "one connection");
    }

    #[tokio::test]
    async fn a_connection_close_answer_is_read_whole_and_its_connection_is_not_reused() {
        // The upstream says `connection: close` but keeps reading: a request it then read on
        // the first connection would be counted there.
        let (url, seen) = counting_upstream(|connection, _| match connection {
            0 => (
                b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 5\r\n\r\nhello",
                None,
            ),
            _ => (OK, None),
        })
        .await;
        let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
        assert_eq!(&answered(&upstream, &url).await[..], b"hello");
        assert_eq!(&answered(&upstream, &url).await[..], b"ok");
        until(&seen, |seen| seen.closed.first() == Some(&true)).await;
        let seen = seen.lock().unwrap();
        assert_eq!(
            seen.requests,
            vec![1, 1],
            "the second request on a new connection"
        );
        assert_eq!(
            seen.closed,
            vec![true, false],
            "the client closed the first"
        );
    }

    #[tokio::test]
    async fn a_body_delimited_by_the_close_is_read_whole() {
        let (url, seen) = counting_upstream(|connection, _| match connection {
            0 => (
                b"HTTP/1.1 200 OK\r\n\r\nuntil the end",
                Some(Duration::ZERO),
            ),
            _ => (OK, None),
        })
        .await;
        let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
        assert_eq!(&answered(&upstream, &url).await[..], b"until the end");
        assert_eq!(&answered(&upstream, &url).await[..], b"ok");
        assert_eq!(seen.lock().unwrap().requests, vec![1, 1]);
    }

    const CHUNKED_WITH_TRAILERS: &[u8] = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntrailer: x-sum\r\n\r\n5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nx-sum: 42\r\n\r\n";

    #[tokio::test]
    async fn a_chunked_body_with_trailers_is_read_whole_and_its_connection_is_reused() {
        use http_body_util::BodyExt;
        let (url, seen) = counting_upstream(|_, _| (CHUNKED_WITH_TRAILERS, None)).await;
        let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
        for _ in 0..2 {
            let response = response_to(&upstream, http::Method::GET, &url).await;
            let collected =
                tokio::time::timeout(Duration::from_secs(5), response.into_body().collect())
                    .await
                    .unwrap()
                    .unwrap();
            assert_eq!(
                collected
                    .trailers()
                    .and_then(|t| t.get("x-sum"))
                    .map(|v| v.as_bytes()),
                Some(&b"42"[..])
            );
            assert_eq!(&collected.to_bytes()[..], b"hello world");
        }
        assert_eq!(seen.lock().unwrap().requests, vec![2], "one connection");
    }

    #[tokio::test]
    async fn an_answer_in_one_byte_writes_is_read_whole_and_its_connection_is_reused() {
        let (url, seen) = paced_upstream(
            |_, _| (CHUNKED_WITH_TRAILERS, None),
            1,
            Duration::from_millis(1),
        )
        .await;
        let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
        assert_eq!(&answered(&upstream, &url).await[..], b"hello world");
        assert_eq!(&answered(&upstream, &url).await[..], b"hello world");
        assert_eq!(seen.lock().unwrap().requests, vec![2], "one connection");
    }

    #[tokio::test]
    async fn a_close_in_the_middle_of_a_body_is_an_error_and_the_next_request_goes_once() {
        let (url, seen) = counting_upstream(|connection, _| match connection {
            0 => (
                b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\nhello",
                Some(Duration::ZERO),
            ),
            1 => (
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n",
                Some(Duration::ZERO),
            ),
            _ => (OK, None),
        })
        .await;
        let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
        for _ in 0..2 {
            let response = response_to(&upstream, http::Method::GET, &url).await;
            assert_eq!(response.status(), 200);
            assert!(
                read_body(response).await.is_err(),
                "not a silent truncation"
            );
        }
        assert_eq!(&answered(&upstream, &url).await[..], b"ok");
        assert_eq!(seen.lock().unwrap().requests, vec![1, 1, 1]);
    }

    const INTERIM_THEN_OK: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a.css>; rel=preload\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";

    #[tokio::test]
    async fn interim_answers_are_skipped_and_the_connection_is_reused() {
        for piece in [usize::MAX, 7] {
            let (url, seen) = paced_upstream(
                |_, _| (INTERIM_THEN_OK, None),
                piece,
                Duration::from_millis(5),
            )
            .await;
            let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
            assert_eq!(&answered(&upstream, &url).await[..], b"ok");
            assert_eq!(&answered(&upstream, &url).await[..], b"ok");
            assert_eq!(seen.lock().unwrap().requests, vec![2], "one connection");
        }
    }

    #[tokio::test]
    async fn bytes_after_an_answer_never_answer_the_next_request() {
        // Right behind the first answer, in the same write: a second, unasked-for answer.
        let (url, seen) = counting_upstream(|connection, _| match connection {
            0 => (
                b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokHTTP/1.1 200 OK\r\ncontent-length: 7\r\n\r\ngarbage",
                None,
            ),
            _ => (OK, None),
        })
        .await;
        let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
        assert_eq!(&answered(&upstream, &url).await[..], b"ok");
        assert_eq!(&answered(&upstream, &url).await[..], b"ok");
        let seen = seen.lock().unwrap();
        assert_eq!(
            seen.requests,
            vec![1, 1],
            "the second request on a new connection"
        );
    }

    #[tokio::test]
    async fn a_body_sent_with_a_204_never_answers_the_next_request() {
        // A 204 has no body (RFC 9110 §15.3.5), whatever its Content-Length says: the bytes
        // after its head are not a response to anything.
        let (url, seen) = counting_upstream(|connection, _| match connection {
            0 => (
                b"HTTP/1.1 204 No Content\r\ncontent-length: 40\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nno",
                None,
            ),
            _ => (OK, None),
        })
        .await;
        let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
        let no_content = response_to(&upstream, http::Method::GET, &url).await;
        assert_eq!(no_content.status(), 204);
        assert_eq!(&read_body(no_content).await.unwrap()[..], b"");
        assert_eq!(&answered(&upstream, &url).await[..], b"ok");
        let seen = seen.lock().unwrap();
        assert_eq!(
            seen.requests,
            vec![1, 1],
            "the second request on a new connection"
        );
    }

    #[tokio::test]
    async fn bytes_that_arrive_while_idle_close_the_connection() {
        // The unasked-for answer comes 50 ms after the first, while the connection is idle.
        let (url, seen) = paced_upstream(
            |connection, _| match connection {
                0 => (
                    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokHTTP/1.1 200 OK\r\ncontent-length: 7\r\n\r\ngarbage",
                    None,
                ),
                _ => (OK, None),
            },
            40,
            Duration::from_millis(50),
        )
        .await;
        let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
        assert_eq!(&answered(&upstream, &url).await[..], b"ok");
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(&answered(&upstream, &url).await[..], b"ok");
        let seen = seen.lock().unwrap();
        assert_eq!(
            seen.requests,
            vec![1, 1],
            "the second request on a new connection"
        );
    }

    #[tokio::test]
    async fn a_held_body_keeps_its_connection_while_other_requests_use_others() {
        let (url, seen) = counting_upstream(|connection, _| match connection {
            // Half of its body, and the connection stays open.
            0 => (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhello", None),
            // Its whole body, never read until the end of the test.
            1 => (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nwhole", None),
            _ => (OK, None),
        })
        .await;
        let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
        let half = response_to(&upstream, http::Method::GET, &url).await;
        let whole = response_to(&upstream, http::Method::GET, &url).await;
        for _ in 0..3 {
            assert_eq!(&answered(&upstream, &url).await[..], b"ok");
        }
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..4 {
            let upstream = upstream.clone();
            let url = url.clone();
            tasks.spawn(async move { answered(&upstream, &url).await });
        }
        while let Some(body) = tasks.join_next().await {
            assert_eq!(&body.unwrap()[..], b"ok");
        }
        {
            let seen = seen.lock().unwrap();
            assert_eq!(
                seen.requests[..2],
                [1, 1],
                "the held ones took no other request"
            );
            assert_eq!(seen.requests.iter().sum::<usize>(), 9);
        }
        // Read at last, the whole body hands its connection back to the pool; the half body,
        // dropped, closes its own.
        assert_eq!(&read_body(whole).await.unwrap()[..], b"whole");
        drop(half);
        until(&seen, |seen| seen.closed[0]).await;
        let seen = seen.lock().unwrap();
        assert!(seen.closed[0]);
        assert!(!seen.closed[1]);
    }

    /// Two waves of fifty concurrent requests to one host: the server saw each request once,
    /// on at most fifty connections. On one thread, where no request ends before all fifty of
    /// its wave started, the first wave opens a connection each and the second reuses them all.
    async fn fifty_at_once_twice(one_thread: bool) {
        let (url, seen) = counting_upstream(|_, _| (OK, None)).await;
        let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
        for wave in 1..=2 {
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..50 {
                let upstream = upstream.clone();
                let url = url.clone();
                tasks.spawn(async move { answered(&upstream, &url).await });
            }
            while let Some(body) = tasks.join_next().await {
                assert_eq!(&body.unwrap()[..], b"ok");
            }
            let seen = seen.lock().unwrap();
            assert_eq!(seen.requests.iter().sum::<usize>(), 50 * wave);
            assert!(seen.requests.len() <= 50, "{:?}", seen.requests);
            if one_thread {
                assert_eq!(seen.requests, vec![wave; 50]);
            }
        }
    }

    #[tokio::test]
    async fn fifty_concurrent_requests_are_each_sent_once() {
        fifty_at_once_twice(true).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn fifty_concurrent_requests_on_two_threads_are_each_sent_once() {
        fifty_at_once_twice(false).await;
    }

    #[tokio::test]
    async fn an_answer_before_the_whole_request_body_is_read_goes_out_once() {
        // The upstream reads the request head only, answers 413 and closes, with most of a
        // 4 MiB body unread.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(Mutex::new(0usize));
        let accepted = connections.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut socket, _)) = listener.accept().await else {
                    return;
                };
                *accepted.lock().unwrap() += 1;
                tokio::spawn(async move {
                    if read_request_head(&mut socket).await {
                        let _ = socket
                            .write_all(b"HTTP/1.1 413 Content Too Large\r\nconnection: close\r\ncontent-length: 0\r\n\r\n")
                            .await;
                    }
                });
            }
        });
        let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
        for _ in 0..2 {
            let mut attempt = request(format!("http://{addr}/upload"));
            attempt.method = http::Method::POST;
            attempt.body = Bytes::from(vec![b'x'; 4 << 20]);
            let reply = tokio::time::timeout(Duration::from_secs(5), upstream.send(attempt))
                .await
                .expect("an answer within 5 s");
            match reply {
                AttemptReply::Response(response) => {
                    assert_eq!(response.status(), 413);
                    let _ = read_body(response).await;
                }
                // The head went out: if anything fails now, it is uncertain.
                AttemptReply::Failed(kind) => assert_eq!(kind, TransportError::ResetAfterSend),
            }
        }
        assert_eq!(
            *connections.lock().unwrap(),
            2,
            "one connection per attempt"
        );
    }

    #[tokio::test]
    async fn an_http_1_0_answer_without_keep_alive_is_not_reused() {
        let (url, seen) = counting_upstream(|connection, _| match connection {
            0 => (b"HTTP/1.0 200 OK\r\ncontent-length: 5\r\n\r\nhello", None),
            _ => (OK, None),
        })
        .await;
        let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
        assert_eq!(&answered(&upstream, &url).await[..], b"hello");
        assert_eq!(&answered(&upstream, &url).await[..], b"ok");
        assert_eq!(seen.lock().unwrap().requests, vec![1, 1]);
    }

    #[tokio::test]
    async fn a_switching_protocols_answer_to_a_plain_request_is_not_reused() {
        let (url, seen) = counting_upstream(|connection, _| match connection {
            0 => (
                b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\n",
                None,
            ),
            _ => (OK, None),
        })
        .await;
        let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
        let mut attempt = request(format!("{url}/x"));
        attempt.method = http::Method::GET;
        let reply = tokio::time::timeout(Duration::from_secs(5), upstream.send(attempt))
            .await
            .expect("an answer within 5 s");
        match reply {
            AttemptReply::Response(response) => {
                assert_eq!(response.status(), 101);
                let _ = read_body(response).await;
            }
            AttemptReply::Failed(kind) => assert!(kind.maybe_delivered(), "{kind}"),
        }
        assert_eq!(&answered(&upstream, &url).await[..], b"ok");
        assert_eq!(seen.lock().unwrap().requests, vec![1, 1]);
    }

    #[tokio::test]
    async fn an_echo_that_answers_while_the_request_body_is_still_on_its_way_flows_both_ways() {
        // The upstream answers the head at once, then echoes the request body as it reads it:
        // the rest of the request goes out only while the reader of the answer drives the
        // connection. 8 MiB is more than the socket buffers hold.
        const LEN: usize = 8 << 20;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let requests = Arc::new(Mutex::new(Vec::<usize>::new()));
        let seen = requests.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut socket, _)) = listener.accept().await else {
                    return;
                };
                let connection = {
                    let mut seen = seen.lock().unwrap();
                    seen.push(0);
                    seen.len() - 1
                };
                let seen = seen.clone();
                tokio::spawn(async move {
                    loop {
                        let mut head = Vec::new();
                        let mut byte = [0u8; 1];
                        while !head.ends_with(b"\r\n\r\n") {
                            match socket.read(&mut byte).await {
                                Ok(1) => head.push(byte[0]),
                                _ => return,
                            }
                        }
                        seen.lock().unwrap()[connection] += 1;
                        let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
                        let length: usize = head
                            .split("\r\n")
                            .find_map(|line| line.strip_prefix("content-length: "))
                            .map_or(0, |n| n.parse().unwrap());
                        let answer = format!("HTTP/1.1 200 OK\r\ncontent-length: {length}\r\n\r\n");
                        socket.write_all(answer.as_bytes()).await.unwrap();
                        let mut left = length;
                        let mut buf = vec![0u8; 64 << 10];
                        while left > 0 {
                            let n = socket.read(&mut buf[..left.min(64 << 10)]).await.unwrap();
                            assert!(n > 0, "the request body ended early");
                            socket.write_all(&buf[..n]).await.unwrap();
                            left -= n;
                        }
                    }
                });
            }
        });
        let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
        for _ in 0..2 {
            let mut attempt = request(format!("http://{addr}/echo"));
            attempt.method = http::Method::POST;
            attempt.body = Bytes::from(vec![b'e'; LEN]);
            let response =
                match tokio::time::timeout(Duration::from_secs(5), upstream.send(attempt)).await {
                    Ok(AttemptReply::Response(response)) => response,
                    Ok(AttemptReply::Failed(kind)) => panic!("the attempt failed: {kind}"),
                    Err(_) => panic!("no answer within 5 s"),
                };
            let body = tokio::time::timeout(
                Duration::from_secs(10),
                axum::body::to_bytes(response.into_body(), LEN),
            )
            .await
            .expect("the echo ended within 10 s")
            .unwrap();
            assert_eq!(body.len(), LEN);
        }
        assert_eq!(*requests.lock().unwrap(), vec![2], "one connection");
    }

    #[tokio::test]
    async fn a_dead_idle_connection_is_passed_over_for_the_next_idle_one() {
        // The first connection is closed by the upstream 100 ms after its answer.
        let (url, seen) = counting_upstream(|connection, _| match connection {
            0 => (OK, Some(Duration::from_millis(100))),
            _ => (OK, None),
        })
        .await;
        let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
        // The first answer is held while the second is read: the second connection becomes
        // idle first, the first one last (the one checkout tries first).
        let first = response_to(&upstream, http::Method::GET, &url).await;
        assert_eq!(&answered(&upstream, &url).await[..], b"ok");
        assert_eq!(&read_body(first).await.unwrap()[..], b"ok");
        until(&seen, |seen| seen.closed.first() == Some(&true)).await;
        // Let the runtime's I/O driver see the FIN.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(&answered(&upstream, &url).await[..], b"ok");
        let seen = seen.lock().unwrap();
        assert_eq!(
            seen.requests,
            vec![1, 2],
            "the third request on the second connection"
        );
    }

    #[tokio::test]
    async fn an_answer_that_is_not_http_is_an_uncertain_reset() {
        let (url, seen) = counting_upstream(|connection, _| match connection {
            0 => (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", None),
            _ => (OK, None),
        })
        .await;
        let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
        let kind = failed(upstream.send(request(format!("{url}/x"))).await);
        assert_eq!(kind, TransportError::ResetAfterSend);
        assert_eq!(&answered(&upstream, &url).await[..], b"ok");
        assert_eq!(seen.lock().unwrap().requests, vec![1, 1]);
    }

    #[tokio::test]
    async fn a_long_body_delimited_by_the_close_is_read_whole() {
        // 4 MiB and then the close: the end of the body is the end of the connection, which
        // finishes while the last bytes may still wait in the body channel for the reader.
        const LEN: usize = 4 << 20;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            assert!(read_request_head(&mut socket).await);
            socket.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.unwrap();
            socket.write_all(&vec![b'b'; LEN]).await.unwrap();
        });
        let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
        let response = response_to(&upstream, http::Method::GET, &format!("http://{addr}")).await;
        // The reader starts late: as much as the socket buffers hold is already there.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let body = tokio::time::timeout(
            Duration::from_secs(10),
            axum::body::to_bytes(response.into_body(), LEN),
        )
        .await
        .expect("the body ended within 10 s")
        .unwrap();
        assert_eq!(body.len(), LEN);
    }
}
