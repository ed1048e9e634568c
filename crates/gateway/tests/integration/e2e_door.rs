//! End-to-end tests of the proxy door over real sockets on loopback: backstop (door + engine +
//! SQLite store + upstream client) and the controllable fake provider run as separate
//! listeners, and every assertion about attempts is measured at the provider's own record.

use std::{
    path::Path,
    sync::{Arc, Mutex},
    time::Duration,
};

use crate::support::{
    self,
    capture::{runtime_logging_into, Capture},
    client, fake_with as fake,
};
use backstop_fake_api::{AttemptRecord, Fault, Handler, RouteConfig};
use backstop_gateway::server::Running;
use backstop_store::Store;
use sha2::{Digest, Sha256};

const AGENT_TOKEN: &str = "agent-token-7f3a9c";
const PROVIDER_SECRET: &str = "sk-live-provider-secret-42b1";

// ---------------------------------------------------------------------------------------------
// Harness

fn policy_yaml(base_url: &str) -> String {
    support::policy_yaml(
        base_url,
        r#"agents:
  test-agent: { token_env: TEST_AGENT_TOKEN }
"#,
        r#"    default_scopes: [fake/account]
    routes:
      "GET /v1/items/{id}": { class: read, scopes: [account] }
      "POST /v1/transfers": { class: idempotent_write, scopes: [account] }
      "GET /v1/stream": { class: read, scopes: [account] }
"#,
    )
}

fn env(name: &str) -> Option<String> {
    match name {
        "TEST_AGENT_TOKEN" => Some(AGENT_TOKEN.to_owned()),
        "FAKE_API_KEY" => Some(PROVIDER_SECRET.to_owned()),
        _ => None,
    }
}

async fn start_gateway(base_url: &str, dir: &Path) -> Running {
    let options = support::serve_options(dir, 7);
    support::start_gateway(&policy_yaml(base_url), "e2e.yaml", &env, options).await
}

fn at(record: &AttemptRecord) -> jiff::Timestamp {
    record.at.parse().expect("attempt time")
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// All audit events of the store as export lines.
fn audit_export(path: &Path) -> String {
    let store = backstop_store::SqliteStore::open_existing(path).expect("store");
    store
        .audit_events(0, 100_000)
        .expect("audit events")
        .iter()
        .map(|event| event.export_line())
        .collect::<Vec<_>>()
        .join("\n")
}

// ---------------------------------------------------------------------------------------------
// Tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_answered_429_then_200_takes_two_attempts_spaced_by_retry_after() {
    let fake = fake(vec![RouteConfig::new(
        "GET /v1/items/{id}",
        Handler::default(),
    )
    .with_script([
        Fault::Status {
            status: 429,
            retry_after: Some("1".into()),
            body: None,
        },
        Fault::Pass,
    ])]);
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;

    let response = client()
        .get(format!("http://{}/fake/v1/items/7", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("X-Backstop-Task", "run-429")
        .send()
        .await
        .expect("request");
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["backstop-attempts"], "2");
    assert!(response.headers().contains_key("backstop-action-id"));
    assert_eq!(response.headers()["backstop-task"], "run-429");

    let attempts = fake.attempts();
    assert_eq!(attempts.len(), 2, "{attempts:?}");
    assert_eq!(attempts[0].status, Some(429));
    assert_eq!(attempts[1].status, Some(200));
    let spacing = at(&attempts[1]).duration_since(at(&attempts[0]));
    assert!(
        spacing >= jiff::SignedDuration::from_secs(1),
        "second attempt only {spacing:?} after the 429"
    );
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_is_resent_byte_identical_with_the_same_key() {
    let fake = fake(vec![RouteConfig::new(
        "POST /v1/transfers",
        Handler::Create {
            collection: "transfers".into(),
            id_prefix: "tr_".into(),
            reference_field: None,
            unique_reference: false,
        },
    )
    .with_idempotency()
    .with_script([
        Fault::Status {
            status: 429,
            retry_after: Some("1".into()),
            body: None,
        },
        Fault::Pass,
    ])]);
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;

    let body = r#"{"amount": 1250, "currency": "eur", "destination": "acct_9", "note": "ünïcode"}"#
        .as_bytes();
    let response = client()
        .post(format!("http://{}/fake/v1/transfers", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("content-type", "application/json")
        .body(body.to_vec())
        .send()
        .await
        .expect("request");
    assert_eq!(response.status(), 201);
    assert_eq!(response.headers()["backstop-attempts"], "2");

    let attempts = fake.attempts();
    assert_eq!(attempts.len(), 2, "{attempts:?}");
    let digest = sha256_hex(body);
    for attempt in &attempts {
        assert_eq!(attempt.body_sha256.as_deref(), Some(digest.as_str()));
        assert_eq!(attempt.body_bytes, body.len());
    }
    let key = attempts[0].idempotency_key.clone().expect("a minted key");
    assert_eq!(attempts[1].idempotency_key.as_deref(), Some(key.as_str()));
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_providers_own_replay_mark_does_not_reach_the_agent_as_backstops() {
    // The first send is stored and its connection dropped (uncertain); backstop resends under
    // the same key and the provider answers from its idempotency store, marking the answer
    // `Idempotent-Replayed: true`. That is a fresh answer to the agent: backstop sent it.
    let fake = fake(vec![RouteConfig::new(
        "POST /v1/transfers",
        Handler::Create {
            collection: "transfers".into(),
            id_prefix: "tr_".into(),
            reference_field: None,
            unique_reference: false,
        },
    )
    .with_idempotency()
    .with_script([Fault::StoreThenDrop { hold_ms: 0 }, Fault::Pass])]);
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let send = || {
        client()
            .post(format!("http://{}/fake/v1/transfers", gateway.addr))
            .bearer_auth(AGENT_TOKEN)
            .header("content-type", "application/json")
            .header("idempotency-key", "transfer-replay-mark-1")
            .body(r#"{"amount": 7}"#)
            .send()
    };

    let fresh = send().await.expect("request");
    assert_eq!(fresh.status(), 201);
    assert_eq!(fresh.headers()["backstop-attempts"], "2");
    let attempts = fake.attempts();
    assert_eq!(attempts.len(), 2, "{attempts:?}");
    assert!(attempts[1].replayed, "the provider replayed: {attempts:?}");
    assert!(
        fresh.headers().get("idempotent-replayed").is_none(),
        "{:?}",
        fresh.headers()
    );

    // backstop's own replay of the finished write says so, once, and sends nothing.
    let replayed = send().await.expect("request");
    assert_eq!(replayed.status(), 201);
    let marks: Vec<_> = replayed
        .headers()
        .get_all("idempotent-replayed")
        .iter()
        .collect();
    assert_eq!(marks, ["true"], "{:?}", replayed.headers());
    assert_eq!(fake.attempts().len(), 2);
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_streams_through_chunk_by_chunk() {
    let fake = fake(vec![RouteConfig::new(
        "GET /v1/stream",
        Handler::Stream {
            events: 3,
            interval_ms: 300,
        },
    )]);
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;

    let started = tokio::time::Instant::now();
    let mut response = client()
        .get(format!("http://{}/fake/v1/stream", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("accept", "text/event-stream")
        .send()
        .await
        .expect("request");
    assert_eq!(response.status(), 200);
    let mut arrivals = Vec::new();
    let mut text = String::new();
    while let Some(chunk) = response.chunk().await.expect("chunk") {
        let chunk = String::from_utf8_lossy(&chunk).into_owned();
        for _ in chunk.matches("data:") {
            arrivals.push(started.elapsed());
        }
        text.push_str(&chunk);
    }
    let total = started.elapsed();
    assert!(text.contains("data: [DONE]"), "{text}");
    assert_eq!(arrivals.len(), 4, "3 events and [DONE]: {text}");
    // The first event reached the agent long before the provider finished the stream.
    assert!(
        total - arrivals[0] >= Duration::from_millis(500),
        "first event at {:?}, stream ended at {total:?}",
        arrivals[0]
    );
    // Events arrived at distinct times, about one interval apart.
    for pair in arrivals.windows(2) {
        assert!(
            pair[1] - pair[0] >= Duration::from_millis(150),
            "events bunched: {arrivals:?}"
        );
    }
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}

#[test]
fn agent_token_never_reaches_the_provider_and_the_secret_never_leaks() {
    let logs = Capture::default();
    let runtime = runtime_logging_into(&logs);
    // `block_on` polls the test's future on this thread.
    logs.attach();
    runtime.block_on(secrets_stay_out_of_requests_logs_audit_and_answers(&logs));
    Capture::detach();
}

/// `GET /v1/live` answers a probe without a token, and says nothing but that the gateway
/// serves; nothing reaches a provider.
#[tokio::test]
async fn the_liveness_probe_needs_no_token_and_reaches_no_provider() {
    let fake = fake(Vec::new());
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let response = client()
        .get(format!("http://{}/v1/live", gateway.addr))
        .send()
        .await
        .expect("live");
    assert_eq!(response.status(), 200);
    let body: serde_json::Value =
        serde_json::from_str(&response.text().await.expect("body")).expect("json");
    assert_eq!(body, serde_json::json!({"status": "serving"}));
    assert!(fake.attempts().is_empty());
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}

/// Requests with the agent's token as bearer and as `x-api-key` (a read retried after a 503, a
/// refused write, an unknown provider), the scopes and metrics: the provider sees backstop's
/// credential only, and neither secret is in `logs`, the audit log or any answer.
async fn secrets_stay_out_of_requests_logs_audit_and_answers(logs: &Capture) {
    let fake = fake(vec![
        RouteConfig::new("GET /v1/items/{id}", Handler::default()).with_script([
            Fault::Status {
                status: 503,
                retry_after: Some("1".into()),
                body: None,
            },
            Fault::Pass,
        ]),
        RouteConfig::new("POST /v1/transfers", Handler::default()).with_script([Fault::Status {
            status: 422,
            retry_after: None,
            body: None,
        }]),
    ]);
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let store_path = gateway.store_path.clone();
    let client = client();

    let mut answers = String::new();
    for (method, path) in [
        ("GET", "/fake/v1/items/1"),
        ("POST", "/fake/v1/transfers"),
        ("GET", "/nope/v1/x"),
    ] {
        let response = client
            .request(
                method.parse().unwrap(),
                format!("http://{}{path}", gateway.addr),
            )
            .bearer_auth(AGENT_TOKEN)
            .header("x-api-key", AGENT_TOKEN)
            .body("{}")
            .send()
            .await
            .expect("request");
        answers.push_str(&format!("{:?}\n", response.headers()));
        answers.push_str(&response.text().await.expect("body"));
    }
    let scopes = client
        .get(format!("http://{}/v1/scopes", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .send()
        .await
        .expect("scopes");
    assert_eq!(scopes.status(), 200);
    answers.push_str(&scopes.text().await.unwrap());
    let metrics = client
        .get(format!("http://{}/metrics", gateway.addr))
        .send()
        .await
        .expect("metrics");
    assert_eq!(metrics.status(), 200);
    answers.push_str(&metrics.text().await.unwrap());

    let attempts = fake.attempts();
    assert_eq!(attempts.len(), 3, "{attempts:?}");
    let provider_digest = &sha256_hex(format!("Bearer {PROVIDER_SECRET}").as_bytes())[..16];
    for attempt in &attempts {
        assert!(attempt.auth_present);
        // The provider saw backstop's credential, never the agent's token.
        assert_eq!(attempt.auth_sha256.as_deref(), Some(provider_digest));
    }
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;

    let audit = audit_export(&store_path);
    assert!(!audit.is_empty());
    assert!(logs
        .text()
        .contains("door: provider response passed through"));
    for (place, text) in [
        ("logs", logs.text()),
        ("audit", audit),
        ("responses", answers),
    ] {
        assert!(
            !text.contains(PROVIDER_SECRET),
            "the provider secret is in the {place}"
        );
        assert!(
            !text.contains(AGENT_TOKEN),
            "the agent token is in the {place}"
        );
    }
}

/// The request the provider sees, recorded by a minimal upstream that keeps every header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_sees_no_agent_token_no_backstop_headers_and_no_hop_by_hop_headers() {
    use axum::{http::HeaderMap, routing::any, Router};
    let seen: Arc<Mutex<Vec<HeaderMap>>> = Arc::default();
    let record = seen.clone();
    let app = Router::new().route(
        "/{*rest}",
        any(move |headers: HeaderMap| {
            let record = record.clone();
            async move {
                record.lock().unwrap().push(headers);
                ([("x-upstream", "yes"), ("keep-alive", "timeout=5")], "ok")
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&format!("http://{upstream}"), dir.path()).await;

    let response = client()
        .get(format!("http://{}/fake/v1/items/3?x=1", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("X-Backstop-Task", "t-9")
        .header("X-Backstop-Priority", "background")
        .header("Prefer", "wait=30")
        .header("Connection", "x-secret-hop")
        .header("X-Secret-Hop", "1")
        .header("Accept", "application/json")
        .send()
        .await
        .expect("request");
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-upstream"], "yes");
    assert!(response.headers().get("keep-alive").is_none());

    let seen: Vec<HeaderMap> = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    let headers = &seen[0];
    assert_eq!(
        headers["authorization"],
        format!("Bearer {PROVIDER_SECRET}")
    );
    assert_eq!(headers["host"], upstream.to_string());
    assert_eq!(headers["accept"], "application/json");
    for (name, value) in headers {
        assert!(
            !name.as_str().starts_with("x-backstop-"),
            "{name} forwarded"
        );
        assert_ne!(name, "x-secret-hop");
        assert_ne!(name, "prefer");
        assert!(!value.to_str().unwrap_or("").contains(AGENT_TOKEN));
    }
    gateway.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_problems_and_nothing_is_sent() {
    let fake = fake(vec![RouteConfig::new(
        "GET /v1/items/{id}",
        Handler::default(),
    )]);
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let client = client();
    let url = format!("http://{}/fake/v1/items/1", gateway.addr);
    let cases = [
        (client.get(&url), 401, "unauthorized", None),
        (
            client.get(&url).bearer_auth("wrong"),
            401,
            "unauthorized",
            None,
        ),
        (
            client
                .get(&url)
                .bearer_auth(AGENT_TOKEN)
                .header("X-Backstop-Priority", "asap"),
            400,
            "bad_header",
            Some("X-Backstop-Priority"),
        ),
        (
            client
                .get(&url)
                .bearer_auth(AGENT_TOKEN)
                .header("X-Backstop-Deadline", "next friday"),
            400,
            "bad_header",
            Some("X-Backstop-Deadline"),
        ),
        (
            client
                .get(&url)
                .bearer_auth(AGENT_TOKEN)
                .header("Prefer", "wait=forever"),
            400,
            "bad_header",
            Some("Prefer"),
        ),
        (
            client
                .get(format!("http://{}/unknown/v1/items/1", gateway.addr))
                .bearer_auth(AGENT_TOKEN),
            404,
            "unknown_provider",
            None,
        ),
    ];
    for (request, status, name, header) in cases {
        let response = request.send().await.expect("request");
        assert_eq!(response.status(), status, "{name}");
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json"
        );
        assert_eq!(response.headers()["x-should-retry"], "false");
        assert_eq!(response.headers()["backstop-attempts"], "0");
        let body: serde_json::Value =
            serde_json::from_str(&response.text().await.expect("body")).expect("problem json");
        assert_eq!(body["type"], format!("urn:backstop:problem:{name}"));
        assert_eq!(body["status"], status);
        assert_eq!(body["sent"], false);
        if let Some(header) = header {
            assert_eq!(body["header"], header);
            assert!(body["detail"].as_str().unwrap().contains(header));
        }
    }
    assert!(fake.attempts().is_empty());
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}

/// The answer's status, `x-should-retry` and JSON body.
async fn answered(response: reqwest::Response) -> (u16, Option<String>, serde_json::Value) {
    let status = response.status().as_u16();
    let hint = response
        .headers()
        .get("x-should-retry")
        .map(|v| v.to_str().expect("ascii").to_owned());
    let text = response.text().await.expect("body");
    (
        status,
        hint,
        serde_json::from_str(&text).expect("json body"),
    )
}

/// A provider's 409 ends the write (`conflict`) and is passed on as the provider sent it, with
/// `x-should-retry: false`: an SDK that retries 409 by its status obeys the header first, so the
/// provider sees the call once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_providers_409_is_passed_on_with_no_retry() {
    let fake = fake(vec![RouteConfig::new(
        "POST /v1/transfers",
        Handler::default(),
    )
    .with_script([Fault::Status {
        status: 409,
        retry_after: None,
        body: Some(serde_json::json!({"error": {"code": "conflict", "message": "locked"}})),
    }])]);
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let response = client()
        .post(format!("http://{}/fake/v1/transfers", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("content-type", "application/json")
        .body(r#"{"amount":5}"#)
        .send()
        .await
        .expect("request");
    assert_eq!(response.headers()["backstop-attempts"], "1");
    let (status, hint, body) = answered(response).await;
    assert_eq!((status, hint.as_deref()), (409, Some("false")), "{body}");
    assert_eq!(
        body["error"]["message"], "locked",
        "the provider's own body"
    );
    assert_eq!(fake.attempts().len(), 1);
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}

/// A read answered 503 on every attempt ends `budget_exhausted` after the class's attempts; the
/// answer keeps the provider's 503 (the SDKs' `InternalServerError`/`ServiceUnavailableError`),
/// says `x-should-retry: false`, and its error envelope reads backstop's reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_503_keeps_its_status_and_says_no_retry() {
    let unavailable = || Fault::Status {
        status: 503,
        retry_after: None,
        body: None,
    };
    let fake = fake(vec![RouteConfig::new(
        "GET /v1/items/{id}",
        Handler::default(),
    )
    .with_script([unavailable(), unavailable(), unavailable(), unavailable()])]);
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let response = client()
        .get(format!("http://{}/fake/v1/items/7", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .send()
        .await
        .expect("request");
    assert_eq!(response.headers()["backstop-attempts"], "4");
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json"
    );
    let (status, hint, body) = answered(response).await;
    assert_eq!((status, hint.as_deref()), (503, Some("false")), "{body}");
    assert_eq!(body["outcome"], "budget_exhausted", "{body}");
    assert_eq!(body["last_status"], 503, "{body}");
    assert_eq!(body["status"], 503, "{body}");
    assert_eq!(body["error"]["code"], "budget_exhausted", "{body}");
    assert_eq!(body["error"]["type"], "api_error", "{body}");
    assert_eq!(body["error"]["message"], body["detail"], "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("attempts")),
        "{body}"
    );
    assert_eq!(fake.attempts().len(), 4);
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}

/// Anthropic's 529 (overloaded) answered to the last attempt stays a 529 when the action ends
/// `budget_exhausted` — the SDK's `OverloadedError`, not a `RateLimitError` — with
/// `x-should-retry: false` and the `overloaded_error` envelope type.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn budget_exhausted_after_a_529_answers_529() {
    let overloaded = || Fault::Status {
        status: 529,
        retry_after: None,
        body: Some(
            serde_json::json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
        ),
    };
    let fake = fake(vec![RouteConfig::new(
        "GET /v1/items/{id}",
        Handler::default(),
    )
    .with_script([overloaded(), overloaded()])]);
    let policy = support::policy_yaml(
        &fake.url(),
        "agents:\n  test-agent: { token_env: TEST_AGENT_TOKEN }\nrequest_classes:\n  read: { max_attempts: 2, max_wait_seconds: 30, retry_statuses: [529] }\n",
        "    routes:\n      \"GET /v1/items/{id}\": { class: read, scopes: [account] }\n",
    );
    let dir = tempfile::tempdir().unwrap();
    let gateway = support::start_gateway(
        &policy,
        "e2e-529.yaml",
        &env,
        support::serve_options(dir.path(), 7),
    )
    .await;
    let response = client()
        .get(format!("http://{}/fake/v1/items/7", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .send()
        .await
        .expect("request");
    assert_eq!(response.headers()["backstop-attempts"], "2");
    let (status, hint, body) = answered(response).await;
    assert_eq!((status, hint.as_deref()), (529, Some("false")), "{body}");
    assert_eq!(body["outcome"], "budget_exhausted", "{body}");
    assert_eq!(body["last_status"], 529, "{body}");
    assert_eq!(body["error"]["type"], "overloaded_error", "{body}");
    assert_eq!(body["error"]["code"], "budget_exhausted", "{body}");
    assert_eq!(fake.attempts().len(), 2);
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}

/// The curl command of docs/calling.md (its opening example), verbatim.
const DOCUMENTED_CURL: &str = r#"curl -sS -i http://127.0.0.1:8080/fake/v1/items/7 -H "Authorization: Bearer $BACKSTOP_TOKEN" -H "X-Backstop-Task: run-42""#;

/// The curl command of docs/calling.md (its opening example), run as documented.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn documented_curl_command_works() {
    let fake = fake(vec![RouteConfig::new(
        "GET /v1/items/{id}",
        Handler::default(),
    )]);
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let base = format!("http://{}", gateway.addr);
    let curl_found = std::process::Command::new("curl")
        .arg("--version")
        .output()
        .is_ok();
    let (status, headers, body) = if curl_found {
        // The documented command, with the documented address replaced by this test's.
        let command = DOCUMENTED_CURL.replace("127.0.0.1:8080", &gateway.addr.to_string());
        let output = tokio::process::Command::new("sh")
            .args(["-c", &command])
            .env("BACKSTOP_TOKEN", AGENT_TOKEN)
            .output()
            .await
            .expect("sh -c curl");
        let text = String::from_utf8_lossy(&output.stdout).into_owned();
        let (head, body) = text.split_once("\r\n\r\n").expect("head and body");
        let status: u16 = head[9..12].parse().expect("status");
        (status, head.to_ascii_lowercase(), body.to_owned())
    } else {
        let response = client()
            .get(format!("{base}/fake/v1/items/7"))
            .header("Authorization", format!("Bearer {AGENT_TOKEN}"))
            .header("X-Backstop-Task", "run-42")
            .send()
            .await
            .expect("request");
        let status = response.status().as_u16();
        let headers = format!("{:?}", response.headers()).to_ascii_lowercase();
        (status, headers, response.text().await.unwrap())
    };
    assert_eq!(status, 200, "{headers}{body}");
    assert!(
        headers.contains("backstop-attempts: 1")
            || headers.contains("\"backstop-attempts\": \"1\""),
        "{headers}"
    );
    assert!(headers.contains("backstop-task"), "{headers}");
    let body: serde_json::Value = serde_json::from_str(&body).expect("json body");
    assert_eq!(body["ok"], true);
    assert_eq!(fake.attempts().len(), 1);
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}

/// A provider on a raw socket that answers every request `201` announcing `content-length:
/// 100`, sends `sent` (fewer bytes), and closes. Returns its address and a count of requests.
async fn cutting_provider(
    sent: &'static [u8],
) -> (std::net::SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let requests = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = requests.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let counted = counted.clone();
            tokio::spawn(async move {
                // Read the whole request (head and body) so that closing sends no reset.
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                let head_end = loop {
                    if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        break at + 4;
                    }
                    match socket.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                };
                let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|line| line.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                while buf.len() < head_end + length {
                    match socket.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let mut answer = b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n".to_vec();
                answer.extend_from_slice(sent);
                let _ = socket.write_all(&answer).await;
                let _ = socket.shutdown().await;
            });
        }
    });
    (addr, requests)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_whose_body_the_provider_cut_is_passed_on_marked_incomplete() {
    const RECEIVED: &[u8] = br#"{"id":"tr"#;
    let (upstream, requests) = cutting_provider(RECEIVED).await;
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&format!("http://{upstream}"), dir.path()).await;
    let send = || {
        client()
            .post(format!("http://{}/fake/v1/transfers", gateway.addr))
            .bearer_auth(AGENT_TOKEN)
            .header("Idempotency-Key", "k-cut-body")
            .header("content-type", "application/json")
            .body(r#"{"amount":5}"#)
            .send()
    };

    let first = send().await.expect("an answer, not an aborted connection");
    assert_eq!(first.status(), 201);
    let headers = first.headers().clone();
    assert_eq!(
        headers
            .get("backstop-body-truncated")
            .and_then(|v| v.to_str().ok()),
        Some("9"),
        "{headers:?}"
    );
    assert_ne!(
        headers.get("content-length").and_then(|v| v.to_str().ok()),
        Some("100"),
        "the provider's length is not passed on"
    );
    let action = headers["backstop-action-id"]
        .to_str()
        .unwrap()
        .parse::<i64>()
        .unwrap();
    let body = first.bytes().await.expect("the body as received");
    assert_eq!(&body[..], RECEIVED);
    assert_eq!(requests.load(std::sync::atomic::Ordering::SeqCst), 1);

    // The replay carries the same bytes, marked the way replays are; nothing more is sent.
    let replay = send().await.expect("replayed");
    assert_eq!(replay.status(), 201);
    let headers = replay.headers().clone();
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(
        headers["backstop-replay-body-truncated"], "9",
        "{headers:?}"
    );
    assert_eq!(&replay.bytes().await.unwrap()[..], RECEIVED);
    assert_eq!(requests.load(std::sync::atomic::Ordering::SeqCst), 1);

    gateway.shutdown().await.unwrap();
    let store =
        backstop_store::SqliteStore::open_existing(dir.path().join("backstop.db")).expect("store");
    let record = store
        .action(backstop_store::ActionId(action))
        .unwrap()
        .expect("action");
    assert_eq!(
        record.outcome,
        Some(backstop_store::Outcome::Succeeded),
        "the provider did answer 201"
    );
}
