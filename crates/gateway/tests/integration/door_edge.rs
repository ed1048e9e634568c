//! The HTTP edge over real sockets: slow clients are timed out (request head and body), and a
//! shutdown is bounded by its grace while requests arriving during the drain get
//! `503 shutting_down`. The executor is a stand-in (no provider): these tests are about the
//! listener, not the engine.

use std::{
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use axum::body::{Body, Bytes};
use backstop_core::policy::Policy;
use backstop_gateway::{
    action::{ActionReceipt, ActionSpec, Execution},
    door::DoorConfig,
    server::{self, BoxFuture, Executor, Parts, Running, ServeOptions},
};
use http_body::Frame;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

const AGENT_TOKEN: &str = "agent-token-edge";

/// A response body that sends one event and then never ends (an open SSE stream).
struct EndlessStream {
    sent: bool,
}

impl http_body::Body for EndlessStream {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.sent {
            return Poll::Pending;
        }
        self.sent = true;
        Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"data: 1\n\n")))))
    }
}

/// Answers `/p/stream` with an endless stream and everything else with `200 ok`.
struct Stand;

impl Executor for Stand {
    fn execute(&self, spec: ActionSpec) -> BoxFuture<Execution> {
        let endless = spec.request.url.ends_with("/stream");
        Box::pin(async move {
            let body = if endless {
                Body::new(EndlessStream { sent: false })
            } else {
                Body::from("ok")
            };
            Execution::Response {
                receipt: ActionReceipt {
                    action_id: 1,
                    attempts: 1,
                    idempotency_key: None,
                    provider_operation_id: None,
                    task: None,
                },
                response: http::Response::builder()
                    .status(200)
                    .header("content-type", "text/event-stream")
                    .body(body)
                    .expect("response"),
            }
        })
    }
    fn scopes(&self) -> serde_json::Value {
        serde_json::json!([])
    }
    fn shutdown(&self) -> BoxFuture<()> {
        Box::pin(async {})
    }
}

/// An event stream of the gateway at `addr`, started and held open: it keeps a drain going
/// until its grace ends.
async fn stream_held_open(addr: std::net::SocketAddr) -> TcpStream {
    let mut sse = TcpStream::connect(addr).await.unwrap();
    sse.write_all(get("/p/stream").as_bytes()).await.unwrap();
    let mut first = [0u8; 512];
    let n = sse.read(&mut first).await.unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));
    sse
}

async fn start(dir: &std::path::Path, options: ServeOptions) -> Running {
    let policy = Policy::from_yaml_str(
        "agents:\n  a: { token_env: AGENT }\nproviders:\n  p:\n    base_url: http://127.0.0.1:9\n",
        "edge.yaml",
    )
    .expect("policy");
    let options = ServeOptions {
        listen: Some("127.0.0.1:0".into()),
        store: Some(dir.join("edge.db")),
        ..options
    };
    let env = |name: &str| (name == "AGENT").then(|| AGENT_TOKEN.to_owned());
    server::start(policy, options, &env, |_: Parts| -> Arc<dyn Executor> {
        Arc::new(Stand)
    })
    .await
    .expect("gateway starts")
}

/// Reads one response head (and, with `Content-Length`, its body) from a raw connection.
async fn read_response(stream: &mut TcpStream) -> String {
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&buffer).into_owned();
        if let Some(end) = text.find("\r\n\r\n") {
            let length = text[..end]
                .lines()
                .find_map(|l| {
                    let (name, value) = l.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length")
                        .then(|| value.trim().parse::<usize>().ok())?
                })
                .unwrap_or(0);
            if buffer.len() >= end + 4 + length {
                return text;
            }
        }
        let n = stream.read(&mut chunk).await.expect("read");
        if n == 0 {
            return String::from_utf8_lossy(&buffer).into_owned();
        }
        buffer.extend_from_slice(&chunk[..n]);
    }
}

fn get(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: backstop\r\nAuthorization: Bearer {AGENT_TOKEN}\r\n\r\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_head_that_never_completes_is_closed_after_the_header_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let gateway = start(
        dir.path(),
        ServeOptions {
            header_read_timeout: Duration::from_millis(500),
            ..ServeOptions::default()
        },
    )
    .await;
    let mut stream = TcpStream::connect(gateway.addr).await.unwrap();
    stream
        .write_all(b"GET /p/x HTTP/1.1\r\nHost: backstop\r\nX-Slow: ")
        .await
        .unwrap();
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut rest)).await;
    assert!(
        closed.is_ok(),
        "the connection with a partial head is still open after 5 s"
    );
    gateway.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_trickling_past_the_read_timeout_gets_408_and_nothing_is_sent() {
    let dir = tempfile::tempdir().unwrap();
    let gateway = start(
        dir.path(),
        ServeOptions {
            door: DoorConfig {
                body_read_timeout: Duration::from_millis(500),
                ..DoorConfig::default()
            },
            ..ServeOptions::default()
        },
    )
    .await;
    for path in ["/p/v1/things", "/v1/actions"] {
        let mut stream = TcpStream::connect(gateway.addr).await.unwrap();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: backstop\r\nAuthorization: Bearer {AGENT_TOKEN}\r\nContent-Type: application/json\r\nContent-Length: 10\r\n\r\n{{"
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        let response = tokio::time::timeout(Duration::from_secs(5), read_response(&mut stream))
            .await
            .expect("an answer within 5 s");
        assert!(response.starts_with("HTTP/1.1 408"), "{path}: {response}");
        assert!(
            response.contains("application/problem+json"),
            "{path}: {response}"
        );
        assert!(
            response.contains("urn:backstop:problem:request_timeout"),
            "{path}: {response}"
        );
        // The receipt headers every answer carries: no action, no attempt.
        let head = response.to_ascii_lowercase();
        assert!(
            head.contains("backstop-action-id: 0\r\n") && head.contains("backstop-attempts: 0\r\n"),
            "{path}: {response}"
        );
    }
    gateway.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_is_bounded_by_one_grace_and_the_drain_answers_503() {
    let dir = tempfile::tempdir().unwrap();
    let grace = Duration::from_secs(1);
    let gateway = start(
        dir.path(),
        ServeOptions {
            shutdown_grace: grace,
            ..ServeOptions::default()
        },
    )
    .await;
    let addr = gateway.addr;
    // An open stream keeps the drain busy until the grace ends.
    let _sse = stream_held_open(addr).await;
    // A kept-alive connection, used once before the shutdown.
    let mut kept = TcpStream::connect(addr).await.unwrap();
    kept.write_all(get("/p/x").as_bytes()).await.unwrap();
    assert!(read_response(&mut kept).await.starts_with("HTTP/1.1 200"));

    let started = tokio::time::Instant::now();
    let stopping = tokio::spawn(gateway.shutdown());
    tokio::time::sleep(Duration::from_millis(200)).await;
    kept.write_all(get("/p/x").as_bytes()).await.unwrap();
    let during = read_response(&mut kept).await;
    assert!(during.starts_with("HTTP/1.1 503"), "{during}");
    assert!(
        during.contains("urn:backstop:problem:shutting_down"),
        "{during}"
    );
    assert!(
        during.to_ascii_lowercase().contains("connection: close"),
        "{during}"
    );
    // A new connection during the drain is answered too.
    let mut late = TcpStream::connect(addr).await.unwrap();
    late.write_all(get("/v1/scopes").as_bytes()).await.unwrap();
    assert!(read_response(&mut late).await.starts_with("HTTP/1.1 503"));

    stopping.await.unwrap().unwrap();
    let took = started.elapsed();
    assert!(
        took >= grace,
        "the open stream was cut before the grace: {took:?}"
    );
    assert!(
        took < grace + Duration::from_millis(600),
        "shutdown took {took:?} with a grace of {grace:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_without_open_responses_does_not_wait_for_the_grace() {
    let dir = tempfile::tempdir().unwrap();
    let gateway = start(
        dir.path(),
        ServeOptions {
            shutdown_grace: Duration::from_secs(10),
            ..ServeOptions::default()
        },
    )
    .await;
    // An idle kept-alive connection does not hold the shutdown.
    let mut kept = TcpStream::connect(gateway.addr).await.unwrap();
    kept.write_all(get("/p/x").as_bytes()).await.unwrap();
    assert!(read_response(&mut kept).await.starts_with("HTTP/1.1 200"));
    let started = tokio::time::Instant::now();
    gateway.shutdown().await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
}

/// A request to the door during the drain, with the given headers; the status, headers and
/// problem body of its answer.
async fn during_the_drain(
    addr: std::net::SocketAddr,
    method: reqwest::Method,
    headers: &[(&str, &str)],
) -> (u16, reqwest::header::HeaderMap, serde_json::Value) {
    let mut request = crate::support::client()
        .request(method, format!("http://{addr}/p/v1/things"))
        .bearer_auth(AGENT_TOKEN);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.expect("an answer during the drain");
    let (status, head) = (response.status().as_u16(), response.headers().clone());
    let (_, body) = crate::support::json_of(response).await;
    (status, head, body)
}

/// The text of header `name`, or `None`.
fn text(headers: &reqwest::header::HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .map(|v| v.to_str().expect("text").to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_answers_a_door_request_with_its_task_and_key_and_says_no_action_exists() {
    let dir = tempfile::tempdir().unwrap();
    let gateway = start(
        dir.path(),
        ServeOptions {
            shutdown_grace: Duration::from_secs(2),
            ..ServeOptions::default()
        },
    )
    .await;
    let addr = gateway.addr;
    // An open stream keeps the drain going while the requests below arrive.
    let _sse = stream_held_open(addr).await;
    let stopping = tokio::spawn(gateway.shutdown());
    tokio::time::sleep(Duration::from_millis(200)).await;

    // A write with its task and key: both answered, as headers and members, and no action.
    let (status, head, body) = during_the_drain(
        addr,
        reqwest::Method::POST,
        &[
            ("X-Backstop-Task", "run-drain"),
            ("Idempotency-Key", "k-drain"),
        ],
    )
    .await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["type"], "urn:backstop:problem:shutting_down", "{body}");
    assert_eq!(body["sent"], false, "{body}");
    assert_eq!(body["task"], "run-drain", "{body}");
    assert_eq!(body["idempotency_key"], "k-drain", "{body}");
    assert!(body.get("action_id").is_none(), "no action exists: {body}");
    assert_eq!(text(&head, "backstop-task").as_deref(), Some("run-drain"));
    assert_eq!(text(&head, "idempotency-key").as_deref(), Some("k-drain"));
    assert_eq!(text(&head, "backstop-action-id").as_deref(), Some("0"));
    assert_eq!(text(&head, "backstop-attempts").as_deref(), Some("0"));
    assert_eq!(text(&head, "x-should-retry").as_deref(), Some("true"));
    assert_eq!(text(&head, "retry-after").as_deref(), Some("1"));
    assert_eq!(text(&head, "connection").as_deref(), Some("close"));

    // A write without either: the task and key minted for it, the same in headers and body.
    let (status, head, body) = during_the_drain(addr, reqwest::Method::POST, &[]).await;
    assert_eq!(status, 503, "{body}");
    let task = text(&head, "backstop-task").expect("a minted task");
    assert!(task.starts_with("task-"), "{task}");
    assert_eq!(body["task"], task.as_str(), "{body}");
    let key = text(&head, "idempotency-key").expect("a minted key");
    assert_eq!(body["idempotency_key"], key.as_str(), "{body}");
    assert_eq!(text(&head, "backstop-action-id").as_deref(), Some("0"));

    // A read: its task, no key.
    let (status, head, body) = during_the_drain(
        addr,
        reqwest::Method::GET,
        &[("X-Backstop-Task", "run-drain-read")],
    )
    .await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(
        text(&head, "backstop-task").as_deref(),
        Some("run-drain-read")
    );
    assert_eq!(body["task"], "run-drain-read", "{body}");
    assert_eq!(text(&head, "idempotency-key"), None);
    assert!(body.get("idempotency_key").is_none(), "{body}");

    // Headers the door would refuse as malformed are not echoed, nor replaced.
    let (status, head, body) = during_the_drain(
        addr,
        reqwest::Method::POST,
        &[("X-Backstop-Task", "two words"), ("Idempotency-Key", "")],
    )
    .await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(text(&head, "backstop-task"), None);
    assert!(body.get("task").is_none(), "{body}");
    assert_eq!(text(&head, "idempotency-key"), None);
    assert!(body.get("idempotency_key").is_none(), "{body}");
    assert_eq!(text(&head, "backstop-action-id").as_deref(), Some("0"));

    stopping.await.unwrap().unwrap();
}

/// A `POST /v1/actions` during the drain with the given headers and raw body; the status,
/// headers and problem body of its answer.
async fn submitted_during_the_drain(
    addr: std::net::SocketAddr,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, reqwest::header::HeaderMap, serde_json::Value) {
    let mut request = crate::support::client()
        .post(format!("http://{addr}/v1/actions"))
        .bearer_auth(AGENT_TOKEN)
        .header("content-type", "application/json")
        .body(body.to_owned());
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.expect("an answer during the drain");
    let (status, head) = (response.status().as_u16(), response.headers().clone());
    let (_, body) = crate::support::json_of(response).await;
    (status, head, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_answers_an_action_submission_with_its_task_and_key_and_says_no_action_exists() {
    let dir = tempfile::tempdir().unwrap();
    let gateway = start(
        dir.path(),
        ServeOptions {
            shutdown_grace: Duration::from_secs(2),
            ..ServeOptions::default()
        },
    )
    .await;
    let addr = gateway.addr;
    // An open stream keeps the drain going while the requests below arrive.
    let _sse = stream_held_open(addr).await;
    let stopping = tokio::spawn(gateway.shutdown());
    tokio::time::sleep(Duration::from_millis(200)).await;

    // A write with its task and key members: both answered, as headers and members, no action.
    let (status, head, body) = submitted_during_the_drain(
        addr,
        &[],
        r#"{"provider": "p", "method": "POST", "path": "/v1/things", "task": "run-drain", "idempotency_key": "k-drain"}"#,
    )
    .await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["type"], "urn:backstop:problem:shutting_down", "{body}");
    assert_eq!(body["sent"], false, "{body}");
    assert_eq!(body["task"], "run-drain", "{body}");
    assert_eq!(body["idempotency_key"], "k-drain", "{body}");
    assert!(body.get("action_id").is_none(), "no action exists: {body}");
    assert_eq!(text(&head, "backstop-task").as_deref(), Some("run-drain"));
    assert_eq!(text(&head, "idempotency-key").as_deref(), Some("k-drain"));
    assert_eq!(text(&head, "backstop-action-id").as_deref(), Some("0"));
    assert_eq!(text(&head, "backstop-attempts").as_deref(), Some("0"));
    assert_eq!(text(&head, "x-should-retry").as_deref(), Some("true"));
    assert_eq!(text(&head, "retry-after").as_deref(), Some("1"));
    assert_eq!(text(&head, "connection").as_deref(), Some("close"));

    // The key in this request's own Idempotency-Key header, as the action API reads it.
    let (status, head, body) = submitted_during_the_drain(
        addr,
        &[("Idempotency-Key", "k-header")],
        r#"{"provider": "p", "method": "post", "path": "/v1/things", "task": "run-drain"}"#,
    )
    .await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["idempotency_key"], "k-header", "{body}");
    assert_eq!(text(&head, "idempotency-key").as_deref(), Some("k-header"));

    // A write without either: the task and key minted for it, the same in headers and body.
    let (status, head, body) = submitted_during_the_drain(
        addr,
        &[],
        r#"{"provider": "p", "method": "POST", "path": "/v1/things"}"#,
    )
    .await;
    assert_eq!(status, 503, "{body}");
    let task = text(&head, "backstop-task").expect("a minted task");
    assert!(task.starts_with("task-"), "{task}");
    assert_eq!(body["task"], task.as_str(), "{body}");
    let key = text(&head, "idempotency-key").expect("a minted key");
    assert_eq!(body["idempotency_key"], key.as_str(), "{body}");
    assert_eq!(text(&head, "backstop-action-id").as_deref(), Some("0"));

    // A read: its task, no key.
    let (status, head, body) = submitted_during_the_drain(
        addr,
        &[],
        r#"{"provider": "p", "method": "GET", "path": "/v1/things", "task": "run-drain-read"}"#,
    )
    .await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(
        text(&head, "backstop-task").as_deref(),
        Some("run-drain-read")
    );
    assert_eq!(body["task"], "run-drain-read", "{body}");
    assert_eq!(text(&head, "idempotency-key"), None);
    assert!(body.get("idempotency_key").is_none(), "{body}");

    // A task or key a submission would refuse is not echoed, nor replaced; two different keys
    // (header and member) are refused by a submission, so neither is echoed.
    let (status, head, body) = submitted_during_the_drain(
        addr,
        &[("Idempotency-Key", "k-one")],
        r#"{"provider": "p", "method": "POST", "path": "/v1/things", "task": "two words", "idempotency_key": "k-two"}"#,
    )
    .await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(text(&head, "backstop-task"), None);
    assert!(body.get("task").is_none(), "{body}");
    assert_eq!(text(&head, "idempotency-key"), None);
    assert!(body.get("idempotency_key").is_none(), "{body}");
    assert_eq!(text(&head, "backstop-action-id").as_deref(), Some("0"));

    // A body that cannot be parsed: the plain 503.
    let (status, head, body) = submitted_during_the_drain(
        addr,
        &[("Idempotency-Key", "k-plain")],
        r#"{"provider": "p", "method": "POST""#,
    )
    .await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["type"], "urn:backstop:problem:shutting_down", "{body}");
    assert!(body.get("task").is_none(), "{body}");
    assert!(body.get("idempotency_key").is_none(), "{body}");
    assert_eq!(text(&head, "backstop-task"), None);
    assert_eq!(text(&head, "idempotency-key"), None);
    assert_eq!(text(&head, "backstop-action-id"), None);
    assert_eq!(text(&head, "connection").as_deref(), Some("close"));

    stopping.await.unwrap().unwrap();
}
