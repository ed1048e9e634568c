//! Boundaries beyond the ceiling, one outcome name per quota signal, and sub-second boundaries
//! (SPEC §2.2, §8), measured over loopback at the fake provider: a `Retry-After` or a quota
//! reset over the 24 h ceiling is a known lower bound — zero attempts before it, the scope held —
//! never "unknown"; a quota-exhausted answer ends `quota_exhausted` whatever its reset; and a
//! `Retry-After: 0.503` is waited as given, not raised to a second.

use std::path::Path;

use backstop_fake_api::{FakeConfig, Fault, FaultRule, RouteConfig, RunningFake};
use backstop_gateway::server::Running;
use serde_json::Value;

use crate::support::{self, client, json_of, lookup, on_route, TEST_AGENT_AND_ONCALL};

const AGENT_TOKEN: &str = "agent-token-ceiling-51f2";
const OPERATOR_TOKEN: &str = "operator-token-ceiling-77aa";

fn policy_yaml(base_url: &str) -> String {
    let top = format!(
        "request_classes:\n  read: {{ max_attempts: 4, max_wait_seconds: 30, retry_statuses: [429, 503] }}\n{TEST_AGENT_AND_ONCALL}"
    );
    let yaml = support::policy_yaml(
        base_url,
        &top,
        r#"    error_code_pointer: /error/code
    resets_in_seconds_pointers: [/error/resets_in_seconds]
    routes:
      "GET /v1/items": { class: read, scopes: [account] }
      "GET /v1/other": { class: read, scopes: [account] }
"#,
    );
    // Sub-second boundaries are honoured only above the local backoff: keep it small here.
    yaml.replace(
        "base_seconds: 1\n  max_seconds: 2",
        "base_seconds: 0.1\n  max_seconds: 0.1",
    )
}

fn env(name: &str) -> Option<String> {
    support::agent_oncall_secret(name, AGENT_TOKEN, OPERATOR_TOKEN, "sk-fake-ceiling-1")
}

async fn start_gateway(base_url: &str, dir: &Path) -> Running {
    let options = support::serve_options(dir, 61);
    support::start_gateway(&policy_yaml(base_url), "ceiling.yaml", &env, options).await
}

/// `GET /v1/items` answers `fault` on its first call and 200 after; `GET /v1/other` always 200.
fn fake(fault: Fault) -> RunningFake {
    let config = FakeConfig::default()
        .with_route(
            RouteConfig::new("GET /v1/items", lookup("items"))
                .with_fault(FaultRule::on_calls([1], fault)),
        )
        .with_route(RouteConfig::new("GET /v1/other", lookup("other")));
    support::start_fake(config)
}

/// A `usage_limit_reached` answer (ChatGPT) whose quota resets in `seconds`.
fn usage_limit(seconds: u64) -> Fault {
    Fault::Status {
        status: 429,
        retry_after: None,
        body: Some(serde_json::json!({
            "error": {
                "code": "usage_limit_reached",
                "message": "usage limit",
                "resets_in_seconds": seconds,
            }
        })),
    }
}

async fn get(gateway: &Running, path: &str) -> (u16, Option<String>, Value) {
    let response = client()
        .get(format!("http://{}/fake{path}", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("X-Backstop-Task", "run-ceiling")
        .send()
        .await
        .expect("request");
    let retry_after = response
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let (status, body) = json_of(response).await;
    (status, retry_after, body)
}

async fn early_retries(gateway: &Running) -> f64 {
    let text = client()
        .get(format!("http://{}/metrics", gateway.addr))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    text.lines()
        .filter(|l| l.starts_with("backstop_early_retries_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_over_the_ceiling_is_a_lower_bound_with_zero_attempts_before_it() {
    let fake = fake(Fault::Status {
        status: 429,
        retry_after: Some("100000".into()),
        body: None,
    });
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;

    let (status, retry_after, body) = get(&gateway, "/v1/items").await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["outcome"], "budget_exhausted", "{body}");
    let seconds: u64 = retry_after.expect("Retry-After").parse().expect("seconds");
    assert!(
        (86_300..=86_400).contains(&seconds),
        "not before now + the 24 h ceiling: {seconds}"
    );
    assert!(!body["boundary"].is_null(), "a known boundary: {body}");
    assert_eq!(on_route(&fake.attempts(), "GET", "/v1/items").len(), 1);

    // The scope is held: the next call in it is not sent before the boundary either.
    let (status, _, body) = get(&gateway, "/v1/other").await;
    assert_eq!(status, 429, "{body}");
    assert!(on_route(&fake.attempts(), "GET", "/v1/other").is_empty());
    assert_eq!(early_retries(&gateway).await, 0.0);
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_reset_beyond_the_ceiling_ends_quota_exhausted_with_its_boundary_and_holds_the_scope(
) {
    let fake = fake(usage_limit(133_107));
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;

    let (status, _, body) = get(&gateway, "/v1/items").await;
    assert_eq!(body["outcome"], "quota_exhausted", "{status} {body}");
    assert!(
        !body["boundary"].is_null(),
        "the reset is a lower bound: {body}"
    );
    assert_eq!(on_route(&fake.attempts(), "GET", "/v1/items").len(), 1);
    let (_, _, body) = get(&gateway, "/v1/other").await;
    assert_ne!(body["outcome"], Value::Null, "refused, not sent: {body}");
    assert!(
        on_route(&fake.attempts(), "GET", "/v1/other").is_empty(),
        "the next call in the scope is held"
    );
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_signal_ends_quota_exhausted_for_resets_inside_and_beyond_the_budget() {
    for seconds in [3_600, 133_107] {
        let fake = fake(usage_limit(seconds));
        let dir = tempfile::tempdir().unwrap();
        let gateway = start_gateway(&fake.url(), dir.path()).await;
        let (_, _, body) = get(&gateway, "/v1/items").await;
        assert_eq!(
            body["outcome"], "quota_exhausted",
            "reset {seconds} s: {body}"
        );
        let open = support::open_escalations(&gateway, OPERATOR_TOKEN).await;
        assert!(
            open.iter().any(|e| e["reason"] == "shared_quota_exhausted"),
            "reset {seconds} s: {open:?}"
        );
        assert_eq!(on_route(&fake.attempts(), "GET", "/v1/items").len(), 1);
        gateway.shutdown().await.unwrap();
        fake.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sub_second_retry_after_is_waited_as_given_not_raised_to_a_second() {
    let fake = fake(Fault::Status {
        status: 429,
        retry_after: Some("0.503".into()),
        body: None,
    });
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let (status, _, body) = get(&gateway, "/v1/items").await;
    assert_eq!(status, 200, "{body}");
    let all = fake.attempts();
    let attempts = on_route(&all, "GET", "/v1/items");
    assert_eq!(attempts.len(), 2);
    let at = |i: usize| {
        jiff::Timestamp::strptime("%Y-%m-%dT%H:%M:%S%.fZ", &attempts[i].at)
            .or_else(|_| attempts[i].at.parse())
            .expect("attempt instant")
    };
    let gap = at(1).duration_since(at(0));
    assert!(
        gap >= jiff::SignedDuration::from_millis(503),
        "never before the boundary: {gap:?}"
    );
    assert!(
        gap < jiff::SignedDuration::from_millis(950),
        "not raised to a second: {gap:?}"
    );
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}
