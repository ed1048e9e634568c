//! End-to-end tests: a real fake provider on loopback, a real HTTP client, and the attempt record
//! read back from the provider.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, SystemTime};

use backstop_fake_api::{
    AttemptOutcome, CompletionApi, Dialect, FakeApi, FakeConfig, Fault, FaultRule, Handler,
    QuotaConfig, RetryAfterForm, RouteConfig, RunningFake, ScopeKey,
};
use reqwest::header::HeaderMap;
use serde_json::{json, Value};

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .retry(reqwest::retry::never())
        .build()
        .expect("client")
}

fn start(config: FakeConfig) -> RunningFake {
    FakeApi::start(config, "127.0.0.1:0".parse().expect("addr")).expect("fake starts")
}

fn header<'h>(headers: &'h HeaderMap, name: &str) -> &'h str {
    headers
        .get(name)
        .unwrap_or_else(|| panic!("missing header {name}: {headers:?}"))
        .to_str()
        .expect("ascii header")
}

fn http_date(headers: &HeaderMap, name: &str) -> SystemTime {
    httpdate::parse_http_date(header(headers, name)).expect("IMF-fixdate")
}

fn transfers_config() -> FakeConfig {
    FakeConfig::default()
        .with_seed(42)
        .with_route(
            RouteConfig::new(
                "POST /v1/transfers",
                Handler::Create {
                    collection: "transfers".into(),
                    id_prefix: "tr_".into(),
                    reference_field: Some("reference".into()),
                    unique_reference: false,
                },
            )
            .with_idempotency(),
        )
        .with_route(RouteConfig::new(
            "GET /v1/transfers",
            Handler::Lookup {
                collection: "transfers".into(),
            },
        ))
        .with_route(RouteConfig::new(
            "GET /v1/transfers/{id}",
            Handler::Get {
                collection: "transfers".into(),
                id_param: "id".into(),
            },
        ))
}

/// Sends one raw HTTP/1.1 request and returns every byte received until the server closes
/// (on a blocking thread, so the provider keeps running).
async fn raw_exchange(addr: std::net::SocketAddr, request: String) -> Vec<u8> {
    tokio::task::spawn_blocking(move || {
        let mut stream = TcpStream::connect(addr).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        stream.write_all(request.as_bytes()).expect("write");
        let mut received = Vec::new();
        let mut buf = [0u8; 1024];
        loop {
            match stream.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => received.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
                Err(e) => panic!("read failed (server neither answered nor closed): {e}"),
            }
        }
        received
    })
    .await
    .expect("join")
}

#[tokio::test]
async fn exceeded_fixed_window_answers_429_with_retry_after_seconds() {
    let fake = start(
        FakeConfig::default()
            .with_quota(QuotaConfig::fixed_window("default", 2, 2_000))
            .with_route(
                RouteConfig::new("GET /v1/items", Handler::default()).with_quota("default"),
            ),
    );
    let c = client();
    let url = format!("{}/v1/items", fake.url());
    for _ in 0..2 {
        assert_eq!(c.get(&url).send().await.expect("send").status(), 200);
    }
    let refused = c.get(&url).send().await.expect("send");
    assert_eq!(refused.status(), 429);
    let seconds: u64 = header(refused.headers(), "retry-after")
        .parse()
        .expect("delay-seconds");
    assert!((1..=2).contains(&seconds), "Retry-After {seconds}");
    let body: Value = refused.json().await.expect("json");
    assert_eq!(body["error"]["code"], "rate_limit_exceeded");

    let attempts = fake.attempts();
    let statuses: Vec<_> = attempts.iter().map(|a| a.status).collect();
    assert_eq!(statuses, [Some(200), Some(200), Some(429)]);
    assert_eq!(attempts[2].fault.as_deref(), Some("quota:default"));
}

#[tokio::test]
async fn exceeded_quota_answers_http_date_retry_after_with_a_matching_date() {
    let fake = start(
        FakeConfig::default()
            .with_quota(
                QuotaConfig::fixed_window("default", 1, 2_000)
                    .with_retry_after(RetryAfterForm::HttpDate),
            )
            .with_route(
                RouteConfig::new("GET /v1/items", Handler::default()).with_quota("default"),
            ),
    );
    let c = client();
    let url = format!("{}/v1/items", fake.url());
    assert_eq!(c.get(&url).send().await.expect("send").status(), 200);
    let refused = c.get(&url).send().await.expect("send");
    assert_eq!(refused.status(), 429);
    let date = http_date(refused.headers(), "date");
    let retry_at = http_date(refused.headers(), "retry-after");
    let delay = retry_at
        .duration_since(date)
        .expect("Retry-After after Date");
    // The window has at most 2 s left; with whole-second rounding up, 1..=3 s.
    assert!(
        (Duration::from_secs(1)..=Duration::from_secs(3)).contains(&delay),
        "{delay:?}"
    );
    // `Date` is the provider's receive time, truncated to the second.
    let at = fake.attempts()[1].at.clone();
    let at: jiff::Timestamp = at.parse().expect("RFC 3339");
    let date_ts = jiff::Timestamp::try_from(date).expect("date");
    assert_eq!(date_ts.as_second(), at.as_second());
}

#[tokio::test]
async fn token_bucket_refills_and_reports_honest_wait() {
    let fake = start(
        FakeConfig::default()
            .with_quota(QuotaConfig::token_bucket("bucket", 2.0, 2))
            .with_route(RouteConfig::new("GET /v1/items", Handler::default()).with_quota("bucket")),
    );
    let c = client();
    let url = format!("{}/v1/items", fake.url());
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(c.get(&url).send().await.expect("send").status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 429]);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(c.get(&url).send().await.expect("send").status(), 200);
}

#[tokio::test]
async fn credential_scope_counts_each_credential_separately() {
    let fake = start(
        FakeConfig::default()
            .with_quota(
                QuotaConfig::fixed_window("per-key", 1, 60_000).with_scope(ScopeKey::Credential),
            )
            .with_route(
                RouteConfig::new("GET /v1/items", Handler::default()).with_quota("per-key"),
            ),
    );
    let c = client();
    let url = format!("{}/v1/items", fake.url());
    let send = |token: &'static str| c.get(&url).bearer_auth(token).send();
    assert_eq!(send("alpha").await.expect("send").status(), 200);
    assert_eq!(send("alpha").await.expect("send").status(), 429);
    assert_eq!(send("beta").await.expect("send").status(), 200);

    let attempts = fake.attempts();
    assert!(attempts.iter().all(|a| a.auth_present));
    assert_eq!(attempts[0].auth_sha256, attempts[1].auth_sha256);
    assert_ne!(attempts[0].auth_sha256, attempts[2].auth_sha256);
    let record = serde_json::to_string(&attempts).expect("json");
    assert!(
        !record.contains("alpha") && !record.contains("beta"),
        "{record}"
    );
}

async fn headers_for(dialect: Dialect) -> HeaderMap {
    let fake = start(
        FakeConfig::default()
            .with_quota(QuotaConfig::fixed_window("default", 5, 60_000).with_dialect(dialect))
            .with_route(
                RouteConfig::new("GET /v1/items", Handler::default()).with_quota("default"),
            ),
    );
    let response = client()
        .get(format!("{}/v1/items", fake.url()))
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), 200);
    response.headers().clone()
}

fn seconds_after_date(headers: &HeaderMap, instant: SystemTime) -> u64 {
    instant
        .duration_since(http_date(headers, "date"))
        .expect("after Date")
        .as_secs()
}

#[tokio::test]
async fn ietf_dialect_headers() {
    let h = headers_for(Dialect::Ietf).await;
    assert_eq!(header(&h, "ratelimit"), "\"default\";r=4;t=60");
    assert_eq!(header(&h, "ratelimit-policy"), "\"default\";q=5;w=60");
}

#[tokio::test]
async fn openai_dialect_headers() {
    let h = headers_for(Dialect::Openai).await;
    assert_eq!(header(&h, "x-ratelimit-limit-requests"), "5");
    assert_eq!(header(&h, "x-ratelimit-remaining-requests"), "4");
    assert_eq!(header(&h, "x-ratelimit-reset-requests"), "1m0s");
}

#[tokio::test]
async fn anthropic_dialect_headers() {
    let h = headers_for(Dialect::Anthropic).await;
    assert_eq!(header(&h, "anthropic-ratelimit-requests-limit"), "5");
    assert_eq!(header(&h, "anthropic-ratelimit-requests-remaining"), "4");
    let reset: jiff::Timestamp = header(&h, "anthropic-ratelimit-requests-reset")
        .parse()
        .expect("RFC 3339");
    let reset = SystemTime::UNIX_EPOCH + Duration::from_secs(reset.as_second().unsigned_abs());
    assert!((60..=61).contains(&seconds_after_date(&h, reset)));
}

#[tokio::test]
async fn github_dialect_headers() {
    let h = headers_for(Dialect::Github).await;
    assert_eq!(header(&h, "x-ratelimit-limit"), "5");
    assert_eq!(header(&h, "x-ratelimit-remaining"), "4");
    assert_eq!(header(&h, "x-ratelimit-used"), "1");
    assert_eq!(header(&h, "x-ratelimit-resource"), "default");
    let epoch: u64 = header(&h, "x-ratelimit-reset").parse().expect("epoch s");
    let reset = SystemTime::UNIX_EPOCH + Duration::from_secs(epoch);
    assert!((60..=61).contains(&seconds_after_date(&h, reset)));
}

#[tokio::test]
async fn scripted_503_then_200() {
    let fake = start(FakeConfig::default().with_route(
        RouteConfig::new("GET /v1/items/{id}", Handler::default()).with_script([Fault::Status {
            status: 503,
            retry_after: Some("1".into()),
            body: None,
        }]),
    ));
    let c = client();
    let url = format!("{}/v1/items/7", fake.url());
    let first = c.get(&url).send().await.expect("send");
    assert_eq!(first.status(), 503);
    assert_eq!(header(first.headers(), "retry-after"), "1");
    let second = c.get(&url).send().await.expect("send");
    assert_eq!(second.status(), 200);
    let body: Value = second.json().await.expect("json");
    assert_eq!(body["params"]["id"], "7");
    let attempts = fake.attempts();
    assert_eq!(attempts.len(), 2);
    assert_eq!(attempts[0].fault.as_deref(), Some("status"));
    assert_eq!(attempts[1].call, Some(2));
}

#[tokio::test]
async fn error_code_fault_names_the_provider_code() {
    let fake = start(FakeConfig::default().with_route(
        RouteConfig::new("POST /v1/chat/completions", Handler::default()).with_fault(
            FaultRule::on_calls(
                [1],
                Fault::ErrorCode {
                    status: 429,
                    code: "insufficient_quota".into(),
                    message: "You exceeded your current quota".into(),
                },
            ),
        ),
    ));
    let response = client()
        .post(format!("{}/v1/chat/completions", fake.url()))
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), 429);
    let body: Value = response.json().await.expect("json");
    assert_eq!(body["error"]["code"], "insufficient_quota");
    assert_eq!(body["error"]["message"], "You exceeded your current quota");
}

#[tokio::test]
async fn store_then_drop_commits_the_write_and_sends_no_response() {
    let mut config = transfers_config();
    config.routes[0] = config.routes[0]
        .clone()
        .with_script([Fault::StoreThenDrop { hold_ms: 0 }]);
    let fake = start(config);
    let body = r#"{"reference":"order-7","amount":1200}"#;
    let request = format!(
        "POST /v1/transfers HTTP/1.1\r\nHost: fake\r\nContent-Type: application/json\r\n\
         Idempotency-Key: key-7\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let received = raw_exchange(fake.addr(), request).await;
    assert!(
        received.is_empty(),
        "expected no response byte, got {:?}",
        String::from_utf8_lossy(&received)
    );

    let c = client();
    let by_key: Value = c
        .get(format!("{}/v1/transfers?idempotency_key=key-7", fake.url()))
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    let data = by_key["data"].as_array().expect("list");
    assert_eq!(data.len(), 1, "{by_key}");
    assert_eq!(data[0]["reference"], "order-7");
    assert_eq!(data[0]["amount"], 1200);
    let id = data[0]["id"].as_str().expect("id").to_owned();
    assert!(id.starts_with("tr_"), "{id}");

    let by_reference: Value = c
        .get(format!("{}/v1/transfers?reference=order-7", fake.url()))
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    assert_eq!(by_reference["data"][0]["id"], id.as_str());
    let missing: Value = c
        .get(format!("{}/v1/transfers?reference=nope", fake.url()))
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    assert_eq!(missing, json!({"object": "list", "data": []}));
    let by_id = c
        .get(format!("{}/v1/transfers/{id}", fake.url()))
        .send()
        .await
        .expect("send");
    assert_eq!(by_id.status(), 200);
    let unknown = c
        .get(format!("{}/v1/transfers/tr_unknown", fake.url()))
        .send()
        .await
        .expect("send");
    assert_eq!(unknown.status(), 404);

    // A retry with the same key replays the committed result instead of creating again.
    let retry = c
        .post(format!("{}/v1/transfers", fake.url()))
        .header("Idempotency-Key", "key-7")
        .header("Content-Type", "application/json")
        .body(body)
        .send()
        .await
        .expect("send");
    assert_eq!(retry.status(), 201);
    assert_eq!(header(retry.headers(), "idempotent-replayed"), "true");
    let replayed: Value = retry.json().await.expect("json");
    assert_eq!(replayed["id"], id.as_str());

    let attempts = fake.attempts();
    assert_eq!(attempts[0].outcome, AttemptOutcome::Dropped);
    assert_eq!(attempts[0].status, None);
    assert_eq!(attempts[0].fault.as_deref(), Some("store_then_drop"));
    assert_eq!(attempts[0].idempotency_key.as_deref(), Some("key-7"));
    assert!(attempts.last().expect("retry").replayed);
}

#[tokio::test]
async fn timeout_holds_then_closes_without_answer() {
    let fake = start(
        FakeConfig::default().with_route(
            RouteConfig::new("GET /v1/slow", Handler::default())
                .with_script([Fault::Timeout { hold_ms: 300 }]),
        ),
    );
    let started = tokio::time::Instant::now();
    let received = raw_exchange(
        fake.addr(),
        "GET /v1/slow HTTP/1.1\r\nHost: fake\r\n\r\n".into(),
    )
    .await;
    assert!(received.is_empty());
    assert!(started.elapsed() >= Duration::from_millis(300));
    let attempts = fake.attempts();
    assert_eq!(attempts.len(), 1);
    assert_eq!(attempts[0].outcome, AttemptOutcome::Timeout);
}

/// A client that leaves during a long hold does not leave the attempt `pending` for ever: the
/// provider closed the connection without an answer, as a `timeout` does.
#[tokio::test]
async fn a_client_leaving_during_a_hold_ends_the_attempt() {
    let fake = start(
        FakeConfig::default().with_route(
            RouteConfig::new("GET /v1/slow", Handler::default())
                .with_script([Fault::Timeout { hold_ms: 60_000 }]),
        ),
    );
    let addr = fake.addr();
    tokio::task::spawn_blocking(move || {
        let mut stream = TcpStream::connect(addr).expect("connect");
        stream
            .write_all(b"GET /v1/slow HTTP/1.1\r\nHost: fake\r\n\r\n")
            .expect("write");
        std::thread::sleep(Duration::from_millis(200));
        // Dropped: the client leaves long before the hold ends.
    })
    .await
    .expect("client");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let attempts = loop {
        let attempts = fake.attempts();
        let ended = attempts
            .first()
            .is_some_and(|a| a.outcome != AttemptOutcome::Pending);
        if ended || tokio::time::Instant::now() >= deadline {
            break attempts;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(attempts.len(), 1, "{attempts:?}");
    assert_eq!(attempts[0].outcome, AttemptOutcome::Timeout, "{attempts:?}");
    assert_eq!(attempts[0].status, None);
}

#[tokio::test]
async fn idempotency_replays_same_request_and_refuses_a_different_one() {
    let fake = start(transfers_config());
    let c = client();
    let url = format!("{}/v1/transfers", fake.url());
    let post = |key: &'static str, body: Value| {
        c.post(&url)
            .header("Idempotency-Key", key)
            .json(&body)
            .send()
    };
    let first = post("k1", json!({"reference": "r1", "amount": 5}))
        .await
        .expect("send");
    assert_eq!(first.status(), 201);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let first: Value = first.json().await.expect("json");

    let again = post("k1", json!({"reference": "r1", "amount": 5}))
        .await
        .expect("send");
    assert_eq!(again.status(), 201);
    assert_eq!(header(again.headers(), "idempotent-replayed"), "true");
    assert_eq!(again.json::<Value>().await.expect("json"), first);

    let conflict = post("k1", json!({"reference": "r1", "amount": 6}))
        .await
        .expect("send");
    assert_eq!(conflict.status(), 422);
    let body: Value = conflict.json().await.expect("json");
    assert_eq!(body["error"]["code"], "idempotency_key_reused");

    let list: Value = c
        .get(&url)
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    assert_eq!(list["data"].as_array().map(Vec::len), Some(1));
}

#[tokio::test]
async fn sse_events_arrive_spaced_in_time() {
    let fake = start(FakeConfig::default().with_route(RouteConfig::new(
        "GET /v1/stream",
        Handler::Stream {
            events: 5,
            interval_ms: 100,
        },
    )));
    let mut response = client()
        .get(format!("{}/v1/stream?n=3&interval_ms=120", fake.url()))
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), 200);
    assert_eq!(
        header(response.headers(), "content-type"),
        "text/event-stream"
    );
    let mut arrivals = Vec::new();
    let mut text = String::new();
    while let Some(chunk) = response.chunk().await.expect("chunk") {
        arrivals.push(tokio::time::Instant::now());
        text.push_str(std::str::from_utf8(&chunk).expect("utf-8"));
    }
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 4, "{text}");
    assert!(events[..3].iter().all(|e| e.starts_with("data: {")));
    assert_eq!(events[3], "data: [DONE]");
    let first = arrivals.first().copied().expect("a chunk");
    let last = arrivals.last().copied().expect("a chunk");
    assert!(arrivals.len() >= 2, "events arrived in one chunk");
    assert!(
        last - first >= Duration::from_millis(200),
        "{:?}",
        last - first
    );
}

#[tokio::test]
async fn attempt_record_counts_every_attempt_but_not_reserved_paths() {
    let fake =
        start(transfers_config().with_route(RouteConfig::new("GET /v1/fast", Handler::Fast)));
    let c = client();
    for _ in 0..3 {
        assert_eq!(
            c.get(format!("{}/v1/fast", fake.url()))
                .send()
                .await
                .expect("send")
                .status(),
            200
        );
    }
    let unknown = c
        .get(format!("{}/v1/unknown", fake.url()))
        .send()
        .await
        .expect("send");
    assert_eq!(unknown.status(), 404);
    let wrong_method = c
        .delete(format!("{}/v1/transfers", fake.url()))
        .send()
        .await
        .expect("send");
    assert_eq!(wrong_method.status(), 405);

    let over_http: Vec<Value> = c
        .get(format!("{}/__fake/attempts", fake.url()))
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    assert_eq!(over_http.len(), 5);
    assert_eq!(over_http[0]["route"], "GET /v1/fast");
    assert_eq!(over_http[3]["route"], Value::Null);
    assert_eq!(over_http[4]["status"], 405);
    let seqs: Vec<u64> = fake.attempts().iter().map(|a| a.seq).collect();
    assert_eq!(seqs, [1, 2, 3, 4, 5]);
    // The reserved GET above was not recorded.
    assert_eq!(fake.attempts().len(), 5);

    let reset = c
        .post(format!("{}/__fake/reset", fake.url()))
        .send()
        .await
        .expect("send");
    assert_eq!(reset.status(), 204);
    assert!(fake.attempts().is_empty());
    c.get(format!("{}/v1/fast", fake.url()))
        .send()
        .await
        .expect("send");
    assert_eq!(fake.attempts()[0].call, Some(1));
}

async fn run_seeded(seed: u64) -> (Vec<u16>, Vec<String>) {
    let mut config = transfers_config().with_seed(seed);
    config.routes[0] = config.routes[0]
        .clone()
        .with_fault(FaultRule::with_probability(
            0.5,
            Fault::Status {
                status: 500,
                retry_after: None,
                body: None,
            },
        ));
    let fake = start(config);
    let c = client();
    let mut statuses = Vec::new();
    let mut ids = Vec::new();
    for i in 0..16 {
        let response = c
            .post(format!("{}/v1/transfers", fake.url()))
            .json(&json!({"reference": format!("r{i}"), "amount": i}))
            .send()
            .await
            .expect("send");
        statuses.push(response.status().as_u16());
        let body: Value = response.json().await.expect("json");
        if let Some(id) = body["id"].as_str() {
            ids.push(id.to_owned());
        }
    }
    (statuses, ids)
}

#[tokio::test]
async fn same_seed_gives_the_same_faults_and_ids() {
    let a = run_seeded(7).await;
    let b = run_seeded(7).await;
    let c = run_seeded(8).await;
    assert_eq!(a, b);
    assert!(a.0.contains(&500) && a.0.contains(&201), "{:?}", a.0);
    assert_ne!(a, c);
}

#[tokio::test]
async fn example_config_parses_and_serves() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/fake-api.yaml");
    let config = FakeConfig::from_yaml_file(&path).expect("example config is valid");
    assert!(config.routes.len() >= 5);
    let fake = start(config);
    let response = client()
        .get(format!("{}/v1/fast", fake.url()))
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), 200);
}

#[test]
fn invalid_yaml_config_names_the_place() {
    let err = FakeConfig::from_yaml_str(
        "quotas:\n  - name: q\n    fixed_window: { limit: 0, window_ms: 1000 }\n",
    )
    .expect_err("limit 0 is invalid");
    let text = err.to_string();
    assert!(text.contains("quotas[0].fixed_window.limit"), "{text}");

    let err = FakeConfig::from_yaml_str("routes:\n  - route: GET /x\n    colour: red\n")
        .expect_err("unknown field");
    let text = err.to_string();
    assert!(text.contains("3:5: unknown field `colour`"), "{text}");
}

#[test]
fn a_collection_spelled_like_a_yaml_1_1_boolean_is_read_as_written() {
    for word in ["n", "y", "no", "yes", "on", "off"] {
        let config = FakeConfig::from_yaml_str(&format!(
            "routes:\n  - route: POST /v1/x\n    handler: {{ kind: create, collection: {word} }}\n  - route: GET /v1/x\n    handler:\n      kind: lookup\n      collection: {word}\n"
        ))
        .unwrap_or_else(|e| panic!("{word}: {e}"));
        for (i, route) in config.routes.iter().enumerate() {
            match &route.handler {
                Handler::Create { collection, .. } | Handler::Lookup { collection } => {
                    assert_eq!(collection, word, "routes[{i}]")
                }
                other => panic!("routes[{i}]: {other:?}"),
            }
        }
    }
    // A real boolean where a string belongs is still refused.
    let err = FakeConfig::from_yaml_str(
        "routes:\n  - route: POST /v1/x\n    handler: { kind: create, collection: false }\n",
    )
    .expect_err("a boolean is no collection name");
    assert!(err.to_string().contains("expected a string"), "{err}");
}

#[test]
fn duplicate_routes_are_a_config_error() {
    let err = FakeConfig::from_yaml_str(
        "routes:\n  - route: GET /v1/x/{id}\n  - route: POST /v1/x/{id}\n  - route: GET /v1/x/{ref}\n",
    )
    .expect_err("the third route repeats the first");
    let text = err.to_string();
    assert!(
        text.contains("routes[2].route") && text.contains("duplicates routes[0]"),
        "{text}"
    );
}

#[test]
fn yaml_config_errors_carry_file_line_and_column() {
    let dir = std::env::temp_dir().join(format!("fake-api-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("fake.yaml");
    std::fs::write(&path, "seed: 1\nseed: 2\n").expect("write");
    let err = FakeConfig::from_yaml_file(&path).expect_err("duplicate key");
    std::fs::remove_dir_all(&dir).ok();
    let text = err.to_string();
    assert!(
        text.contains(&format!("{}:2:1: duplicate key `seed`", path.display())),
        "{text}"
    );
}

#[test]
fn start_outside_a_runtime_is_an_error() {
    let err = FakeApi::start(FakeConfig::default(), "127.0.0.1:0".parse().expect("addr"))
        .expect_err("no runtime");
    assert!(err.to_string().contains("tokio runtime"), "{err}");
}

#[tokio::test]
async fn github_quota_exhausted_answers_403_with_remaining_zero() {
    let mut quota = QuotaConfig::fixed_window("core", 1, 60_000).with_dialect(Dialect::Github);
    quota.exceeded_status = 403;
    let fake = start(FakeConfig::default().with_quota(quota).with_route(
        RouteConfig::new("GET /repos/{owner}/{repo}", Handler::default()).with_quota("core"),
    ));
    let c = client();
    let url = format!("{}/repos/o/r", fake.url());
    assert_eq!(c.get(&url).send().await.expect("send").status(), 200);
    let refused = c.get(&url).send().await.expect("send");
    assert_eq!(refused.status(), 403);
    assert_eq!(header(refused.headers(), "x-ratelimit-remaining"), "0");
    assert_eq!(header(refused.headers(), "x-ratelimit-used"), "1");
    assert!(refused.headers().get("retry-after").is_some());
}

#[tokio::test]
async fn every_nth_and_drop_faults_follow_the_call_count() {
    let fake = start(
        FakeConfig::default().with_route(
            RouteConfig::new("GET /v1/items", Handler::default())
                .with_script([Fault::Pass, Fault::Drop])
                .with_fault(FaultRule {
                    on_calls: Vec::new(),
                    every_nth: Some(3),
                    probability: None,
                    fault: Fault::Status {
                        status: 500,
                        retry_after: None,
                        body: None,
                    },
                }),
        ),
    );
    let mut outcomes = Vec::new();
    for _ in 0..6 {
        let received = raw_exchange(
            fake.addr(),
            "GET /v1/items HTTP/1.1\r\nHost: fake\r\nConnection: close\r\n\r\n".into(),
        )
        .await;
        let text = String::from_utf8_lossy(&received).into_owned();
        outcomes.push(text.split("\r\n").next().unwrap_or("").to_owned());
    }
    assert_eq!(
        outcomes,
        [
            "HTTP/1.1 200 OK",
            "",
            "HTTP/1.1 500 Internal Server Error",
            "HTTP/1.1 200 OK",
            "HTTP/1.1 200 OK",
            "HTTP/1.1 500 Internal Server Error",
        ]
    );
    let attempts = fake.attempts();
    assert_eq!(attempts.len(), 6);
    assert_eq!(attempts[1].outcome, AttemptOutcome::Dropped);
}

#[tokio::test]
async fn unique_reference_refuses_a_second_object() {
    let mut config = transfers_config();
    if let Handler::Create {
        unique_reference, ..
    } = &mut config.routes[0].handler
    {
        *unique_reference = true;
    }
    let fake = start(config);
    let c = client();
    let url = format!("{}/v1/transfers", fake.url());
    let body = json!({"reference": "order-1", "amount": 1});
    let first = c.post(&url).json(&body).send().await.expect("send");
    assert_eq!(first.status(), 201);
    let first: Value = first.json().await.expect("json");
    let second = c.post(&url).json(&body).send().await.expect("send");
    assert_eq!(second.status(), 409);
    let second: Value = second.json().await.expect("json");
    assert_eq!(second["error"]["code"], "duplicate_reference");
    assert_eq!(second["error"]["existing_id"], first["id"]);
}

#[tokio::test]
async fn chat_completion_without_stream_is_one_json_answer() {
    let fake = start(FakeConfig::default().with_route(RouteConfig::new(
        "POST /v1/chat/completions",
        Handler::Stream {
            events: 3,
            interval_ms: 10,
        },
    )));
    let response = client()
        .post(format!("{}/v1/chat/completions", fake.url()))
        .json(&json!({"stream": false}))
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.expect("json");
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(
        body["choices"][0]["message"]["content"],
        "token-0 token-1 token-2 "
    );
}

/// A `slow` answer does the work at once, holds, then answers as the call would have been
/// answered: the attempt is `pending` during the hold and `answered` after it; the next call is
/// fast again.
#[tokio::test]
async fn slow_holds_then_answers_normally() {
    let fake = start(
        FakeConfig::default().with_route(
            RouteConfig::new(
                "POST /v1/chat/completions",
                Handler::Completion {
                    api: CompletionApi::Openai,
                    events: 2,
                    interval_ms: 0,
                },
            )
            .with_script([Fault::Slow { hold_ms: 400 }]),
        ),
    );
    let url = format!("{}/v1/chat/completions", fake.url());
    let started = tokio::time::Instant::now();
    let call = tokio::spawn({
        let url = url.clone();
        async move {
            client()
                .post(url)
                .json(&json!({"model": "m"}))
                .send()
                .await
                .expect("send")
        }
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let during = fake.attempts();
    assert_eq!(during.len(), 1, "{during:?}");
    assert_eq!(during[0].outcome, AttemptOutcome::Pending, "{during:?}");
    assert_eq!(during[0].fault.as_deref(), Some("slow"));

    let response = call.await.expect("call");
    assert!(started.elapsed() >= Duration::from_millis(400));
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.expect("json");
    assert_eq!(body["choices"][0]["message"]["content"], "token-0 token-1 ");
    let after = fake.attempts();
    assert_eq!(after[0].outcome, AttemptOutcome::Answered, "{after:?}");
    assert_eq!(after[0].status, Some(200));

    let started = tokio::time::Instant::now();
    let second = client()
        .post(&url)
        .json(&json!({"model": "m"}))
        .send()
        .await
        .expect("send");
    assert_eq!(second.status(), 200);
    assert!(started.elapsed() < Duration::from_millis(300));
    assert_eq!(fake.attempts().len(), 2);
}

/// A client that leaves during a `slow` hold finds the work done (the object is stored) and the
/// attempt ended `timeout` with no status: nothing was sent.
#[tokio::test]
async fn a_client_leaving_a_slow_answer_leaves_the_work_done() {
    let fake = start(
        transfers_config().with_route(
            RouteConfig::new(
                "POST /v1/slow-transfers",
                Handler::Create {
                    collection: "transfers".into(),
                    id_prefix: "tr_".into(),
                    reference_field: Some("reference".into()),
                    unique_reference: false,
                },
            )
            .with_script([Fault::Slow { hold_ms: 60_000 }]),
        ),
    );
    let result = reqwest::Client::builder()
        .retry(reqwest::retry::never())
        .timeout(Duration::from_millis(200))
        .build()
        .expect("client")
        .post(format!("{}/v1/slow-transfers", fake.url()))
        .json(&json!({"reference": "r-slow"}))
        .send()
        .await;
    assert!(result.is_err(), "answered during the hold: {result:?}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let attempt = loop {
        let attempt = fake.attempts().remove(0);
        if attempt.outcome != AttemptOutcome::Pending || tokio::time::Instant::now() >= deadline {
            break attempt;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(attempt.outcome, AttemptOutcome::Timeout, "{attempt:?}");
    assert_eq!(attempt.status, None);
    let list: Value = client()
        .get(format!("{}/v1/transfers?reference=r-slow", fake.url()))
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    assert_eq!(list["data"].as_array().map(Vec::len), Some(1), "{list}");
}

fn completion_fake(api: CompletionApi, route: &str) -> RunningFake {
    start(FakeConfig::default().with_route(RouteConfig::new(
        route,
        Handler::Completion {
            api,
            events: 3,
            interval_ms: 50,
        },
    )))
}

/// The `data:` payloads (and `event:` names) of a whole event stream, with the arrival time of
/// each network chunk.
async fn read_events(
    mut response: reqwest::Response,
) -> (Vec<(Option<String>, String)>, Vec<tokio::time::Instant>) {
    assert_eq!(response.status(), 200);
    assert_eq!(
        header(response.headers(), "content-type"),
        "text/event-stream"
    );
    let mut arrivals = Vec::new();
    let mut text = String::new();
    while let Some(chunk) = response.chunk().await.expect("chunk") {
        arrivals.push(tokio::time::Instant::now());
        text.push_str(std::str::from_utf8(&chunk).expect("utf-8"));
    }
    assert!(text.ends_with("\n\n"), "{text:?}");
    let events = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|event| {
            let mut name = None;
            let mut data = String::new();
            for line in event.lines() {
                if let Some(v) = line.strip_prefix("event: ") {
                    name = Some(v.to_owned());
                } else if let Some(v) = line.strip_prefix("data: ") {
                    data = v.to_owned();
                } else {
                    panic!("unexpected line {line:?} in {text:?}");
                }
            }
            (name, data)
        })
        .collect();
    (events, arrivals)
}

#[tokio::test]
async fn openai_completion_is_one_json_object_unless_the_body_asks_to_stream() {
    let fake = completion_fake(CompletionApi::Openai, "POST /v1/chat/completions");
    let url = format!("{}/v1/chat/completions", fake.url());
    // The official SDK leaves `stream` out of a non-streaming call.
    let response = client()
        .post(&url)
        .json(&json!({"model": "gpt-fake", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), 200);
    assert_eq!(
        header(response.headers(), "content-type"),
        "application/json"
    );
    let body: Value = response.json().await.expect("json");
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "gpt-fake");
    assert!(body["created"].is_i64(), "{body}");
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    assert_eq!(
        body["choices"][0]["message"]["content"],
        "token-0 token-1 token-2 "
    );
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert_eq!(body["usage"]["completion_tokens"], 3);

    let response = client()
        .post(&url)
        .json(&json!({"model": "gpt-fake", "stream": true, "messages": []}))
        .send()
        .await
        .expect("send");
    let (events, arrivals) = read_events(response).await;
    assert_eq!(events.len(), 5, "{events:?}");
    assert!(events.iter().all(|(name, _)| name.is_none()));
    assert_eq!(events[4].1, "[DONE]");
    let chunks: Vec<Value> = events[..4]
        .iter()
        .map(|(_, data)| serde_json::from_str(data).expect("json chunk"))
        .collect();
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, "token-0 token-1 token-2 ");
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"
        && c["model"] == "gpt-fake"
        && c["id"] == chunks[0]["id"]));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[3]["choices"][0]["finish_reason"], "stop");
    assert!(chunks[..3]
        .iter()
        .all(|c| c["choices"][0]["finish_reason"].is_null()));
    let spread = *arrivals.last().expect("chunk") - arrivals[0];
    assert!(spread >= Duration::from_millis(100), "{spread:?}");
    assert_eq!(fake.attempts().len(), 2);
}

#[tokio::test]
async fn anthropic_completion_is_a_message_or_the_messages_streaming_protocol() {
    let fake = completion_fake(CompletionApi::Anthropic, "POST /v1/messages");
    let url = format!("{}/v1/messages", fake.url());
    let body: Value = client()
        .post(&url)
        .json(&json!({"model": "claude-fake", "max_tokens": 16, "messages": []}))
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    assert_eq!(body["type"], "message");
    assert_eq!(body["role"], "assistant");
    assert_eq!(body["model"], "claude-fake");
    assert_eq!(body["content"][0]["type"], "text");
    assert_eq!(body["content"][0]["text"], "token-0 token-1 token-2 ");
    assert_eq!(body["stop_reason"], "end_turn");
    assert_eq!(body["usage"]["output_tokens"], 3);

    let response = client()
        .post(&url)
        .json(&json!({"model": "claude-fake", "max_tokens": 16, "stream": true, "messages": []}))
        .send()
        .await
        .expect("send");
    let (events, _) = read_events(response).await;
    let names: Vec<&str> = events
        .iter()
        .map(|(name, _)| name.as_deref().expect("every event is named"))
        .collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    let data: Vec<Value> = events
        .iter()
        .map(|(_, data)| serde_json::from_str(data).expect("json data"))
        .collect();
    for (name, value) in names.iter().zip(&data) {
        assert_eq!(value["type"], *name, "{value}");
    }
    assert_eq!(data[0]["message"]["model"], "claude-fake");
    let text: String = data
        .iter()
        .filter_map(|d| d["delta"]["text"].as_str())
        .collect();
    assert_eq!(text, "token-0 token-1 token-2 ");
    assert_eq!(data[6]["delta"]["stop_reason"], "end_turn");
}

#[tokio::test]
async fn a_completion_body_that_is_not_a_json_object_is_a_400() {
    let fake = completion_fake(CompletionApi::Openai, "POST /v1/chat/completions");
    let response = client()
        .post(format!("{}/v1/chat/completions", fake.url()))
        .body("[1, 2]")
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), 400);
    let body: Value = response.json().await.expect("json");
    assert_eq!(body["error"]["code"], "invalid_request");
}

/// The answers an SDK test needs from the `status` fault: a provider's 409 with its own body
/// and Anthropic's 529 with `Retry-After`, kept as scripted.
#[tokio::test]
async fn status_faults_keep_a_409_body_and_a_529_retry_after() {
    let fake = start(FakeConfig::from_yaml_str(
        "routes:\n  - route: POST /v1/messages\n    handler: { kind: completion, api: anthropic }\n    script:\n      - { kind: status, status: 529, retry_after: \"1\", body: { type: error, error: { type: overloaded_error, message: Overloaded } } }\n      - { kind: status, status: 409, body: { error: { type: conflict, message: busy } } }\n      - { kind: slow, hold_ms: 10 }\n",
    ).expect("config"));
    let url = format!("{}/v1/messages", fake.url());
    let send = || client().post(&url).json(&json!({"model": "m"})).send();
    let overloaded = send().await.expect("send");
    assert_eq!(overloaded.status().as_u16(), 529);
    assert_eq!(header(overloaded.headers(), "retry-after"), "1");
    let body: Value = overloaded.json().await.expect("json");
    assert_eq!(body["error"]["type"], "overloaded_error");
    let conflict = send().await.expect("send");
    assert_eq!(conflict.status(), 409);
    let body: Value = conflict.json().await.expect("json");
    assert_eq!(body["error"]["message"], "busy");
    let slow = send().await.expect("send");
    assert_eq!(slow.status(), 200);
    let body: Value = slow.json().await.expect("json");
    assert_eq!(body["type"], "message");
    let faults: Vec<Option<String>> = fake.attempts().into_iter().map(|a| a.fault).collect();
    assert_eq!(
        faults,
        [
            Some("status".into()),
            Some("status".into()),
            Some("slow".into())
        ]
    );
}

#[test]
fn completion_and_slow_limits_name_the_place() {
    let err = FakeConfig::from_yaml_str(
        "routes:\n  - route: POST /v1/messages\n    handler: { kind: completion, api: anthropic, events: 10001 }\n",
    )
    .expect_err("too many events");
    assert!(
        err.to_string().contains("routes[0].handler.events"),
        "{err}"
    );
    let err = FakeConfig::from_yaml_str(
        "routes:\n  - route: POST /v1/messages\n    handler: { kind: completion, api: palm }\n",
    )
    .expect_err("unknown api");
    assert!(err.to_string().contains("palm"), "{err}");
    let err = FakeConfig::from_yaml_str(
        "routes:\n  - route: POST /v1/messages\n    script: [ { kind: slow, hold_ms: 3600001 } ]\n",
    )
    .expect_err("hold over the ceiling");
    assert!(
        err.to_string().contains("routes[0].script[0].hold_ms"),
        "{err}"
    );
}
