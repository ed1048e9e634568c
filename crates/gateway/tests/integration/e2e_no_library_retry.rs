//! Proof that the upstream client never re-sends on its own (SPEC §4.3: library retries are off).
//!
//! A raw TCP upstream counts connections and requests. It answers the first request on a
//! connection with a keep-alive 200, so the client pools the connection, and then misbehaves on
//! the pooled connection. Whatever the client does, the upstream must see exactly one request
//! per `Transport::send`, and a failed attempt must come back as a failure — never as a silent
//! second send on a fresh connection.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use backstop_core::classify::TransportError;
use backstop_gateway::{
    transport::{AttemptReply, AttemptRequest, Transport},
    upstream::{Upstream, UpstreamConfig},
};
use bytes::Bytes;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};

#[derive(Default)]
struct Counts {
    connections: AtomicUsize,
    requests: AtomicUsize,
}

/// How the upstream treats a pooled connection after answering its first request.
#[derive(Clone, Copy)]
enum Misbehaviour {
    /// Read the second request completely, then close without answering.
    CloseAfterReading,
    /// Close the connection right after the first answer (an idle pooled connection dies).
    CloseWhenIdle,
}

const OK: &[u8] =
    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: keep-alive\r\nkeep-alive: timeout=60\r\n\r\nok";

/// Reads one request head (the test requests have no body). `false` on EOF.
async fn read_request(socket: &mut TcpStream) -> bool {
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

async fn upstream(behaviour: Misbehaviour) -> (String, Arc<Counts>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let counts = Arc::new(Counts::default());
    let shared = counts.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            shared.connections.fetch_add(1, Ordering::SeqCst);
            let counts = shared.clone();
            tokio::spawn(async move {
                // First request on this connection: answer with keep-alive.
                if !read_request(&mut socket).await {
                    return;
                }
                counts.requests.fetch_add(1, Ordering::SeqCst);
                let _ = socket.write_all(OK).await;
                match behaviour {
                    Misbehaviour::CloseWhenIdle => drop(socket),
                    Misbehaviour::CloseAfterReading => {
                        if read_request(&mut socket).await {
                            counts.requests.fetch_add(1, Ordering::SeqCst);
                        }
                        drop(socket);
                    }
                }
            });
        }
    });
    (format!("http://{addr}"), counts)
}

fn get(url: &str) -> AttemptRequest {
    AttemptRequest {
        method: http::Method::GET,
        url: format!("{url}/v1/items/1"),
        headers: http::HeaderMap::new(),
        body: Bytes::new(),
    }
}

async fn ok_once(upstream: &Upstream, url: &str) {
    match upstream.send(get(url)).await {
        AttemptReply::Response(response) => {
            assert_eq!(response.status(), 200);
            // Read the body so the connection goes back to the pool.
            let body = axum::body::to_bytes(response.into_body(), 1024)
                .await
                .unwrap();
            assert_eq!(&body[..], b"ok");
        }
        AttemptReply::Failed(kind) => panic!("first attempt failed: {kind}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_connection_closed_without_answer_is_one_attempt_and_a_failure() {
    let (url, counts) = upstream(Misbehaviour::CloseAfterReading).await;
    let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
    ok_once(&upstream, &url).await;
    // Let the pool take the connection back.
    tokio::time::sleep(Duration::from_millis(50)).await;

    let reply = upstream.send(get(&url)).await;
    let kind = match reply {
        AttemptReply::Failed(kind) => kind,
        AttemptReply::Response(r) => panic!("expected a failure, got {}", r.status()),
    };
    assert_eq!(kind, TransportError::ResetAfterSend);
    assert!(kind.maybe_delivered());

    // Give a hidden re-send every chance to show up at the upstream.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        counts.requests.load(Ordering::SeqCst),
        2,
        "one request per send"
    );
    assert_eq!(
        counts.connections.load(Ordering::SeqCst),
        1,
        "the second send reused the pooled connection and was not re-sent on a new one"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_pooled_connection_closed_by_the_upstream_never_doubles_a_request() {
    let (url, counts) = upstream(Misbehaviour::CloseWhenIdle).await;
    let upstream = Upstream::new(UpstreamConfig::default()).unwrap();
    let sends = 5;
    let mut answered = 0;
    for _ in 0..sends {
        // Each send either reaches the upstream once (on a fresh connection once the pool
        // noticed the close) or fails; it never arrives twice.
        if let AttemptReply::Response(response) = upstream.send(get(&url)).await {
            assert_eq!(response.status(), 200);
            let _ = axum::body::to_bytes(response.into_body(), 1024).await;
            answered += 1;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let requests = counts.requests.load(Ordering::SeqCst);
    assert!(answered >= 1);
    assert!(
        requests >= answered && requests <= sends,
        "{sends} sends, {answered} answered, {requests} requests at the upstream"
    );
    assert!(counts.connections.load(Ordering::SeqCst) <= sends);
}
