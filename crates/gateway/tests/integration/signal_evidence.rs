//! What the provider said is kept as evidence, measured end to end over loopback against the
//! fake provider: a write throttled with `Retry-After` and quota headers and escalated shows the
//! raw values per attempt in its case file (and still no payload or credential); a throttled
//! action's health snapshot carries the raw `Retry-After` and `Date`, from which `backstop
//! diagnose` computes the same boundary the gateway recorded.

use std::path::Path;

use backstop_core::diagnose::{DiagnoseOptions, Snapshot};
use backstop_core::retry_after::parse_http_date;
use backstop_fake_api::{
    Dialect, FakeConfig, QuotaConfig, RetryAfterForm, RouteConfig, RunningFake,
};
use backstop_gateway::server::Running;
use backstop_store::audit::Verdict;
use backstop_store::{ActionId, SqliteStore, Store};
use jiff::Timestamp;
use serde_json::Value;

use crate::support::{
    self, client, create, json_of, lookup, RETRYING_CLASSES, TEST_AGENT_AND_ONCALL,
};

const AGENT_TOKEN: &str = "agent-token-signals-1c2d";
const OPERATOR_TOKEN: &str = "operator-token-signals-3e4f";
const API_KEY: &str = "sk-fake-signals-5a6b7c8d9e";
const PAYLOAD: &str = r#"{"sku":"SKU-SECRET-PAYLOAD-77"}"#;

fn policy_yaml(base_url: &str) -> String {
    support::policy_yaml(
        base_url,
        &format!("{RETRYING_CLASSES}{TEST_AGENT_AND_ONCALL}"),
        r#"    routes:
      "POST /v1/orders": { class: idempotent_write, scopes: [account] }
      "GET /v1/orders": { class: read, scopes: [account] }
"#,
    )
}

fn env(name: &str) -> Option<String> {
    support::agent_oncall_secret(name, AGENT_TOKEN, OPERATOR_TOKEN, API_KEY)
}

async fn start_gateway(base_url: &str, dir: &Path) -> Running {
    let options = support::serve_options(dir, 47);
    support::start_gateway(&policy_yaml(base_url), "signals.yaml", &env, options).await
}

/// Both routes charge one quota of one request per `window_ms`.
fn fake(quota: QuotaConfig) -> RunningFake {
    let name = quota.name.clone();
    let config = FakeConfig::default()
        .with_quota(quota)
        .with_route(
            RouteConfig::new("POST /v1/orders", create("orders", "or_"))
                .with_idempotency()
                .with_quota(&name),
        )
        .with_route(RouteConfig::new("GET /v1/orders", lookup("orders")).with_quota(&name));
    support::start_fake(config)
}

/// A read that takes the quota's only request of the window.
async fn use_up_the_quota(gateway: &Running, task: &str) {
    let response = client()
        .get(format!("http://{}/fake/v1/orders", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("X-Backstop-Task", task)
        .send()
        .await
        .expect("warm-up read");
    assert_eq!(response.status(), 200, "the first request fits the quota");
}

/// The agent's create of [`PAYLOAD`] through the proxy door for `task` under the key `key`.
async fn post_order(gateway: &Running, task: &str, key: &str) -> reqwest::Response {
    client()
        .post(format!("http://{}/fake/v1/orders", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("X-Backstop-Task", task)
        .header("Idempotency-Key", key)
        .header("content-type", "application/json")
        .body(PAYLOAD)
        .send()
        .await
        .expect("request")
}

/// The header `name` among a case file attempt's `quota_headers`.
fn header<'a>(attempt: &'a Value, name: &str) -> Option<&'a str> {
    attempt["quota_headers"]
        .as_array()?
        .iter()
        .find(|h| h["name"] == name)
        .and_then(|h| h["value"].as_str())
}

/// The fake's arrival time of its `seq`-th attempt, floored to the second (its `Date`).
fn fake_date(fake: &RunningFake, seq: usize) -> Timestamp {
    let attempts = fake.attempts();
    let at: Timestamp = attempts[seq].at.parse().expect("fake attempt time");
    Timestamp::from_second(at.as_second()).expect("second")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_escalated_write_shows_the_raw_retry_after_and_quota_headers_of_each_attempt() {
    let fake = fake(
        QuotaConfig::fixed_window("orders", 1, 600_000)
            .with_dialect(Dialect::Openai)
            .with_retry_after(RetryAfterForm::Seconds),
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    // Another client of the same account takes the window's only request, straight at the
    // provider: backstop has seen no quota headers yet, so its write is sent and refused.
    let direct = client()
        .get(format!("{}/v1/orders", fake.url()))
        .send()
        .await
        .expect("direct read");
    assert_eq!(direct.status(), 200, "the first request fits the quota");

    let response = post_order(&gateway, "run-signals", "order-signals-1").await;
    let action = support::action_id(&response);
    let (_, body) = json_of(response).await;
    assert_eq!(body["outcome"], "budget_exhausted", "{body}");
    let posts = support::on_route(&fake.attempts(), "POST", "/v1/orders").len();
    assert_eq!(posts, 1, "the provider saw one create");

    let row = support::open_escalation_of(&gateway, OPERATOR_TOKEN, action).await;
    let escalation = row["id"].as_i64().expect("id");
    let (status, shown) = support::show_escalation(&gateway, OPERATOR_TOKEN, escalation).await;
    assert_eq!(status, 200, "{shown}");
    let case = &shown["case_file"];
    let attempts = case["attempts"].as_array().expect("attempts");
    assert_eq!(attempts.len(), 1, "{case}");
    let first = &attempts[0];
    assert_eq!(first["status"], 429, "{first}");

    // The raw Retry-After: whole seconds of the ten-minute window, as the fake wrote it.
    let raw = first["retry_after_raw"].as_str().expect("raw Retry-After");
    let seconds: u64 = raw.parse().expect("delay-seconds");
    assert!((590..=600).contains(&seconds), "{raw}");
    assert_eq!(header(first, "retry-after"), Some(raw), "{first}");
    // The quota headers, raw, as the fake's OpenAI dialect writes them.
    assert_eq!(header(first, "x-ratelimit-limit-requests"), Some("1"));
    assert_eq!(header(first, "x-ratelimit-remaining-requests"), Some("0"));
    let reset = header(first, "x-ratelimit-reset-requests").expect("reset header");
    assert!(
        reset.ends_with('s') && reset.contains('m'),
        "a Go duration: {reset}"
    );
    // The Date is the fake's own clock at the POST's arrival (its second attempt overall).
    let date = header(first, "date").expect("date header");
    assert_eq!(parse_http_date(date), Some(fake_date(&fake, 1)), "{date}");
    // The attempt's own boundary: at least the Retry-After past the result.
    let finished: Timestamp = first["finished_at"]
        .as_str()
        .expect("finished")
        .parse()
        .expect("instant");
    let boundary: Timestamp = first["retry_not_before"]
        .as_str()
        .expect("attempt boundary")
        .parse()
        .expect("instant");
    let lead = boundary.duration_since(finished).as_secs();
    assert!(lead >= 589, "boundary {boundary} vs result {finished}");
    // Nothing else of the response, and never the payload or the credential.
    for h in first["quota_headers"].as_array().expect("headers") {
        let name = h["name"].as_str().expect("name");
        assert!(
            name == "retry-after" || name == "date" || name.starts_with("x-ratelimit-"),
            "{name}"
        );
    }
    let text = case.to_string();
    for secret in [API_KEY, "SKU-SECRET-PAYLOAD-77", "sku"] {
        assert!(!text.contains(secret), "{secret} in the case file: {text}");
    }
    assert!(
        !text.to_ascii_lowercase().contains("authorization"),
        "{text}"
    );

    gateway.shutdown().await.expect("shutdown");
    let store = SqliteStore::open_existing(dir.path().join("backstop.db")).expect("store");
    let stored = store.attempts(ActionId(action)).expect("attempts");
    assert_eq!(
        backstop_core::signal_headers::retry_after_raw(&stored[0].signal_headers).as_deref(),
        Some(raw)
    );
    let events = store.audit_events(0, 10_000).expect("audit");
    let result = events
        .iter()
        .find(|e| e.kind == "action_result" && e.action == Some(action))
        .expect("the write's result event");
    let audited = result.signal_headers.as_ref().expect("audited headers");
    assert!(
        audited.contains(&("retry-after".to_owned(), raw.to_owned())),
        "{audited:?}"
    );
    assert!(matches!(
        store.verify_audit(None).expect("verify"),
        Verdict::Intact { .. }
    ));
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttled_actions_snapshot_carries_retry_after_and_date_and_diagnose_agrees() {
    // HTTP-date Retry-After with the response's Date; no quota headers, so the boundary is the
    // Retry-After's alone.
    let fake = fake(
        QuotaConfig::fixed_window("orders", 1, 2_000)
            .with_dialect(Dialect::None)
            .with_retry_after(RetryAfterForm::HttpDate),
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    use_up_the_quota(&gateway, "run-health-signals").await;

    // Throttled once, retried at the boundary, then served.
    let response = post_order(&gateway, "run-health-signals", "order-health-1").await;
    let action = support::action_id(&response);
    assert_eq!(response.status(), 201, "served after the boundary");
    let seen = fake.attempts();
    let posts = support::on_route(&seen, "POST", "/v1/orders");
    assert_eq!(posts.len(), 2, "one throttled create, one retry");
    assert_eq!(posts[0].status, Some(429));

    let (status, health) = json_of(
        client()
            .get(format!(
                "http://{}/v1/runs/run-health-signals/health",
                gateway.addr
            ))
            .bearer_auth(AGENT_TOKEN)
            .send()
            .await
            .expect("health"),
    )
    .await;
    assert_eq!(status, 200, "{health}");
    let entry = health["actions"]
        .as_array()
        .expect("actions")
        .iter()
        .find(|a| a["action_id"] == action)
        .unwrap_or_else(|| panic!("the throttled write: {health}"));
    let snapshot: Snapshot =
        serde_json::from_value(entry["snapshot"].clone()).expect("SPEC §10 snapshot");
    assert_eq!(snapshot.status, 429);
    let raw = snapshot.retry_after_raw.clone().expect("retry_after_raw");
    let date = snapshot.date_header.clone().expect("date_header");
    // Both are the fake's own values: Date is its clock at the throttled POST, Retry-After an
    // HTTP-date at most the window later.
    let served_date = fake_date(&fake, 1);
    assert_eq!(parse_http_date(&date), Some(served_date), "{date}");
    let until = parse_http_date(&raw).expect("an HTTP-date Retry-After");
    let delay = until.duration_since(served_date).as_secs();
    assert!((1..=3).contains(&delay), "{raw} vs {date}");

    // `backstop diagnose` without the gateway's boundary recomputes the same one from them.
    let recorded = snapshot.retry_not_before.expect("recorded boundary");
    let from_raw = Snapshot {
        retry_not_before: None,
        ..snapshot.clone()
    }
    .boundary(&DiagnoseOptions::default().retry_after);
    assert_eq!(from_raw.retry_not_before(), Some(recorded));
    let line = serde_json::to_vec(&Snapshot {
        retry_not_before: None,
        ..snapshot.clone()
    })
    .expect("json");
    let reparsed = backstop_core::diagnose::parse_snapshot(&line).expect("diagnose reads it");
    let report = backstop_core::diagnose::diagnose(
        &reparsed,
        snapshot.throttled_at,
        &DiagnoseOptions::default(),
    );
    assert_eq!(
        report.retry_after_debt_ms,
        Some(
            u64::try_from(recorded.duration_since(snapshot.throttled_at).as_millis()).expect("ms")
        ),
    );

    gateway.shutdown().await.expect("shutdown");
    fake.shutdown().await;
}
