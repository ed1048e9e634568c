//! The cap on request bodies held in memory across connections (`--buffered-body-bytes`), over
//! real sockets in front of the fake provider: a body that does not fit is answered `503
//! body_budget_exhausted` with `Retry-After` and never reaches the provider, the others go
//! through, the room comes back when their actions end; and a caller is authenticated before
//! its body is read.

use std::{path::Path, time::Duration};

use backstop_fake_api::{Fault, FaultRule, Handler, RouteConfig};
use backstop_gateway::{door::DoorConfig, server::Running};
use sha2::{Digest, Sha256};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

use crate::support::{self, client, fake_with as fake, on_route};

const AGENT_TOKEN: &str = "agent-token-bodies-5c1e";

/// Each upload's size: two fit under [`BUDGET`], a third does not. The fake provider keeps
/// bodies up to 1 MiB, so it records each one's digest.
const UPLOAD: usize = 400 * 1024;
/// The cap on buffered bodies of these tests.
const BUDGET: usize = 1024 * 1024;

fn env(name: &str) -> Option<String> {
    match name {
        "TEST_AGENT_TOKEN" => Some(AGENT_TOKEN.to_owned()),
        "FAKE_API_KEY" => Some("sk-bodies".to_owned()),
        _ => None,
    }
}

/// A provider that holds every upload's answer for `hold_ms`, so its body stays held in the
/// gateway meanwhile.
fn slow_provider(hold_ms: u64) -> backstop_fake_api::RunningFake {
    fake(vec![RouteConfig::new(
        "POST /v1/uploads",
        Handler::default(),
    )
    .with_fault(FaultRule::with_probability(
        1.0,
        Fault::Slow { hold_ms },
    ))])
}

async fn start_gateway(base_url: &str, dir: &Path, budget: usize) -> Running {
    let yaml = support::policy_yaml(
        base_url,
        "agents:\n  uploader: { token_env: TEST_AGENT_TOKEN }\n",
        r#"    routes:
      "POST /v1/uploads": { class: idempotent_write, scopes: [account] }
"#,
    );
    let mut options = support::serve_options(dir, 11);
    options.door = DoorConfig {
        max_body_bytes: 512 * 1024,
        body_budget_bytes: budget,
        ..DoorConfig::default()
    };
    support::start_gateway(&yaml, "bodies.yaml", &env, options).await
}

/// The head of a request to `path` declaring a body of `length` bytes, with `token`.
fn head(path: &str, token: &str, length: usize) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: backstop\r\nAuthorization: Bearer {token}\r\nContent-Type: application/octet-stream\r\nContent-Length: {length}\r\n\r\n"
    )
}

/// Reads one response (head and, with `Content-Length`, its body) from a raw connection.
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

/// The value of header `name` in a raw response head.
fn header<'a>(response: &'a str, name: &str) -> Option<&'a str> {
    response.lines().find_map(|line| {
        let (n, v) = line.split_once(':')?;
        n.eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// Waits until the gateway holds at least `bytes` of request bodies (so a test knows the
/// bodies it started are counted before it sends the next).
async fn until_held(gateway: &Running, bytes: usize) {
    for _ in 0..500 {
        if gateway.state().body_budget.held_bytes() >= bytes {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "the gateway holds {} bytes of bodies, not {bytes}",
        gateway.state().body_budget.held_bytes()
    );
}

/// Waits until the gateway holds no request body.
async fn until_released(gateway: &Running) {
    for _ in 0..500 {
        if gateway.state().body_budget.held_bytes() == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "the gateway still holds {} bytes of bodies after every action ended",
        gateway.state().body_budget.held_bytes()
    );
}

fn assert_budget_503(response: &str, what: &str) {
    assert!(response.starts_with("HTTP/1.1 503"), "{what}: {response}");
    assert!(
        response.contains("urn:backstop:problem:body_budget_exhausted"),
        "{what}: {response}"
    );
    assert_eq!(
        header(response, "retry-after"),
        Some("1"),
        "{what}: {response}"
    );
    assert_eq!(
        header(response, "x-should-retry"),
        Some("true"),
        "{what}: {response}"
    );
    assert_eq!(
        header(response, "backstop-action-id"),
        Some("0"),
        "{what}: {response}"
    );
    assert!(response.contains("\"sent\":false"), "{what}: {response}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_past_the_cap_gets_503_at_once_and_the_room_comes_back_when_actions_end() {
    let provider = slow_provider(0);
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&provider.url(), dir.path(), BUDGET).await;
    let body = vec![b'u'; UPLOAD];

    // Two uploads whose bodies are still arriving: their declared lengths are held already.
    let mut first = TcpStream::connect(gateway.addr).await.unwrap();
    first
        .write_all(head("/fake/v1/uploads", AGENT_TOKEN, UPLOAD).as_bytes())
        .await
        .unwrap();
    first.write_all(&body[..1024]).await.unwrap();
    until_held(&gateway, UPLOAD).await;
    let mut second = TcpStream::connect(gateway.addr).await.unwrap();
    second
        .write_all(head("/fake/v1/uploads", AGENT_TOKEN, UPLOAD).as_bytes())
        .await
        .unwrap();
    second.write_all(&body[..1024]).await.unwrap();
    until_held(&gateway, 2 * UPLOAD).await;

    // A third, on the door and on the action API, is refused before its body is sent at all.
    for path in ["/fake/v1/uploads", "/v1/actions"] {
        let mut third = TcpStream::connect(gateway.addr).await.unwrap();
        third
            .write_all(head(path, AGENT_TOKEN, UPLOAD).as_bytes())
            .await
            .unwrap();
        let refused = tokio::time::timeout(Duration::from_secs(5), read_response(&mut third))
            .await
            .expect("the refusal comes without the body");
        assert_budget_503(&refused, path);
    }

    // The two held bodies complete and go through.
    for stream in [&mut first, &mut second] {
        stream.write_all(&body[1024..]).await.unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(10), read_response(stream))
            .await
            .expect("an answer");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
    let uploads = provider.attempts();
    let uploads = on_route(&uploads, "POST", "/v1/uploads");
    assert_eq!(
        uploads.len(),
        2,
        "only the two held bodies were sent: {uploads:?}"
    );
    assert!(
        uploads.iter().all(|a| a.body_bytes == UPLOAD),
        "{uploads:?}"
    );

    // Their actions ended: the room is back, and the next upload goes through.
    until_released(&gateway).await;
    let response = client()
        .post(format!("http://{}/fake/v1/uploads", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .body(body.clone())
        .send()
        .await
        .expect("request");
    assert_eq!(response.status(), 200);
    assert_eq!(
        on_route(&provider.attempts(), "POST", "/v1/uploads").len(),
        3
    );
    gateway.shutdown().await.unwrap();
    provider.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_concurrent_uploads_those_past_the_cap_get_503_and_the_provider_sees_only_the_others() {
    // Each upload's answer is held 1.5 s at the provider, so its body stays held meanwhile.
    let provider = slow_provider(1500);
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&provider.url(), dir.path(), BUDGET).await;
    let uploads: Vec<_> = (0..6u8)
        .map(|n| {
            let url = format!("http://{}/fake/v1/uploads", gateway.addr);
            tokio::spawn(async move {
                let response = client()
                    .post(url)
                    .bearer_auth(AGENT_TOKEN)
                    .body(vec![n; UPLOAD])
                    .send()
                    .await
                    .expect("an answer");
                let status = response.status().as_u16();
                let retry = (
                    response
                        .headers()
                        .get("retry-after")
                        .map(|v| v.to_str().unwrap().to_owned()),
                    response
                        .headers()
                        .get("x-should-retry")
                        .map(|v| v.to_str().unwrap().to_owned()),
                );
                let text = response.text().await.unwrap();
                (n, status, retry, text)
            })
        })
        .collect();
    let mut passed = Vec::new();
    let mut refused = 0;
    for upload in uploads {
        let (n, status, retry, text) = upload.await.unwrap();
        match status {
            200 => passed.push(hex::encode(Sha256::digest(vec![n; UPLOAD]))),
            503 => {
                refused += 1;
                assert!(text.contains("body_budget_exhausted"), "{text}");
                assert_eq!(retry, (Some("1".into()), Some("true".into())), "{text}");
            }
            other => panic!("upload {n}: unexpected {other}: {text}"),
        }
    }
    // Two bodies of 400 KiB fit under 1 MiB; all six arrive within the 1.5 s the first two hold.
    assert_eq!((passed.len(), refused), (2, 4), "{passed:?}");
    let attempts = provider.attempts();
    let mut sent: Vec<String> = on_route(&attempts, "POST", "/v1/uploads")
        .iter()
        .map(|a| a.body_sha256.clone().expect("a body"))
        .collect();
    sent.sort();
    passed.sort();
    assert_eq!(
        sent, passed,
        "the provider saw exactly the uploads answered 200"
    );
    until_released(&gateway).await;
    gateway.shutdown().await.unwrap();
    provider.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_is_refused_before_its_large_body_is_read() {
    let provider = slow_provider(0);
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&provider.url(), dir.path(), 64 * 1024 * 1024).await;
    // A body declared at 20 MiB (under the cap, so only the token can refuse it) of which only
    // 64 KiB is sent: the 401 must come without waiting for the rest.
    for path in ["/fake/v1/uploads", "/v1/actions"] {
        let mut stream = TcpStream::connect(gateway.addr).await.unwrap();
        stream
            .write_all(head(path, "not-a-token", 20 * 1024 * 1024).as_bytes())
            .await
            .unwrap();
        stream.write_all(&vec![b'x'; 64 * 1024]).await.unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(3), read_response(&mut stream))
            .await
            .unwrap_or_else(|_| panic!("{path}: no 401 within 3 s: the body is being waited for"));
        assert!(answer.starts_with("HTTP/1.1 401"), "{path}: {answer}");
        assert!(
            answer.contains("urn:backstop:problem:unauthorized"),
            "{path}: {answer}"
        );
        assert_eq!(gateway.state().body_budget.held_bytes(), 0, "{path}");
    }
    assert!(on_route(&provider.attempts(), "POST", "/v1/uploads").is_empty());
    gateway.shutdown().await.unwrap();
    provider.shutdown().await;
}
