//! A provider boundary beyond the remaining wait (SPEC §13 step 5, §8), over loopback sockets and
//! measured at the fake provider: a write answered `429 Retry-After` far beyond its wait budget
//! ends `budget_exhausted` AND opens a `remaining_wait_exceeds_deadline` escalation carrying the
//! boundary, with zero further attempts; a read under the same answer only ends.

use std::path::Path;

use backstop_fake_api::{FakeConfig, RouteConfig};
use backstop_gateway::server::Running;
use backstop_store::{ActionId, SqliteStore, Store};
use serde_json::{json, Value};

use crate::support::{
    self, client, create, json_of, lookup, RETRYING_CLASSES, TEST_AGENT_AND_ONCALL,
};

const AGENT_TOKEN: &str = "agent-token-boundary-5e6f";
const OPERATOR_TOKEN: &str = "operator-token-boundary-7a8b";

fn policy_yaml(base_url: &str) -> String {
    support::policy_yaml(
        base_url,
        &format!("{RETRYING_CLASSES}{TEST_AGENT_AND_ONCALL}"),
        r#"    routes:
      "POST /v1/orders": { class: idempotent_write, scopes: [account] }
      "POST /v1/invoices":
        class: idempotent_write
        scopes: [account]
        fingerprint_fields: [/customer]
      "GET /v1/orders": { class: read, scopes: [account] }
"#,
    )
}

fn env(name: &str) -> Option<String> {
    support::agent_oncall_secret(name, AGENT_TOKEN, OPERATOR_TOKEN, "sk-fake-boundary")
}

async fn start_gateway(base_url: &str, dir: &Path) -> Running {
    let options = support::serve_options(dir, 31);
    support::start_gateway(&policy_yaml(base_url), "boundary.yaml", &env, options).await
}

/// Both order routes answer their first call `429 Retry-After: 600` (ten minutes; the budget is
/// 30 s); `POST /v1/invoices` answers `429 Retry-After: 1`, then `429 Retry-After: 600`.
fn fake() -> backstop_fake_api::RunningFake {
    let throttled = || support::status_on_calls([1], 429, Some("600"));
    let config = FakeConfig::default()
        .with_route(
            RouteConfig::new("POST /v1/orders", create("orders", "or_"))
                .with_idempotency()
                .with_fault(throttled()),
        )
        .with_route(RouteConfig::new("GET /v1/orders", lookup("orders")).with_fault(throttled()))
        .with_route(
            RouteConfig::new("POST /v1/invoices", create("invoices", "in_"))
                .with_idempotency()
                .with_fault(support::status_on_calls([1], 429, Some("1")))
                .with_fault(support::status_on_calls([2], 429, Some("600"))),
        );
    support::start_fake(config)
}

async fn open_escalations(gateway: &Running) -> Vec<Value> {
    support::open_escalations(gateway, OPERATOR_TOKEN).await
}

async fn decide(gateway: &Running, escalation: i64, option: &str) -> (u16, Value) {
    support::decide(
        gateway,
        OPERATOR_TOKEN,
        escalation,
        json!({ "option": option }),
    )
    .await
}

/// The open escalation of `action`, checked to be `remaining_wait_exceeds_deadline` and shown
/// to the operator: its id and case file.
async fn boundary_escalation(gateway: &Running, action: i64) -> (i64, Value) {
    let row = support::open_escalation_of(gateway, OPERATOR_TOKEN, action).await;
    assert_eq!(row["reason"], "remaining_wait_exceeds_deadline", "{row}");
    let escalation = row["id"].as_i64().expect("id");
    let (status, shown) = support::show_escalation(gateway, OPERATOR_TOKEN, escalation).await;
    assert_eq!(status, 200, "{shown}");
    (escalation, shown["case_file"].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_throttled_beyond_its_wait_budget_ends_budget_exhausted_and_is_escalated() {
    let fake = fake();
    let dir = tempfile::tempdir().expect("tempdir");
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let response = client()
        .post(format!("http://{}/fake/v1/orders", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("X-Backstop-Task", "run-boundary")
        .header("Idempotency-Key", "order-boundary-1")
        .header("content-type", "application/json")
        .body(r#"{"sku":"A-1"}"#)
        .send()
        .await
        .expect("request");
    let action = support::action_id(&response);
    let (_, body) = json_of(response).await;
    assert_eq!(body["outcome"], "budget_exhausted", "{body}");

    let (escalation, case) = boundary_escalation(&gateway, action).await;
    assert!(
        case["retry_not_before"].is_string(),
        "the boundary is in the case file: {case}"
    );
    let options = support::case_options(&case);
    for expected in ["wait", "change_plan", "abort"] {
        assert!(
            options.contains(&expected),
            "{expected} offered: {options:?}"
        );
    }
    assert!(!options.contains(&"send_new"), "{options:?}");

    // Zero further attempts: the provider saw exactly one create.
    let posts = fake
        .attempts()
        .iter()
        .filter(|a| a.method == "POST")
        .count();
    assert_eq!(posts, 1, "no attempt after the refused plan");

    // The operator may abort: the action keeps its outcome and nothing is sent.
    let (status, answer) = decide(&gateway, escalation, "abort").await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["effect_applied"], true, "{answer}");
    assert!(open_escalations(&gateway).await.is_empty());

    gateway.shutdown().await.expect("shutdown");
    let store = SqliteStore::open_existing(dir.path().join("backstop.db")).expect("store");
    let record = store
        .action(ActionId(action))
        .expect("read")
        .expect("action");
    assert_eq!(record.outcome.map(|o| o.as_str()), Some("budget_exhausted"));
    assert_eq!(
        fake.attempts()
            .iter()
            .filter(|a| a.method == "POST")
            .count(),
        1
    );
    let kinds: Vec<String> = store
        .audit_events(0, 10_000)
        .expect("audit")
        .into_iter()
        .filter(|e| e.action == Some(action))
        .map(|e| e.kind)
        .collect();
    assert!(kinds.iter().any(|k| k == "escalated"), "{kinds:?}");
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_throttled_beyond_its_wait_budget_only_ends_budget_exhausted() {
    let fake = fake();
    let dir = tempfile::tempdir().expect("tempdir");
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let response = client()
        .get(format!("http://{}/fake/v1/orders", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("X-Backstop-Task", "run-boundary-read")
        .send()
        .await
        .expect("request");
    let (_, body) = json_of(response).await;
    assert_eq!(body["outcome"], "budget_exhausted", "{body}");
    assert!(
        open_escalations(&gateway).await.is_empty(),
        "reads are not escalated"
    );
    assert_eq!(
        fake.attempts().iter().filter(|a| a.method == "GET").count(),
        1
    );
    gateway.shutdown().await.expect("shutdown");
    fake.shutdown().await;
}

/// A case file opened beside an outcome is built from the stored action: it still carries the
/// agent's desired outcome, the task's deadline, the fingerprint with the route's configured
/// payload fields, and the wait the action used before its last attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_escalation_beside_an_outcome_carries_the_desired_outcome_deadline_fingerprint_and_wait()
{
    let fake = fake();
    let dir = tempfile::tempdir().expect("tempdir");
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let payload = r#"{"customer":"cus_42","amount":12}"#;
    let (status, accepted) = support::submit_action(
        &gateway,
        AGENT_TOKEN,
        &json!({
            "provider": "fake",
            "method": "POST",
            "path": "/v1/invoices",
            "task": "run-beside",
            "deadline": "2099-01-01T00:00:00Z",
            "idempotency_key": "invoice-beside-1",
            "headers": {"content-type": "application/json"},
            "body": payload,
            "desired_outcome": "invoice 42 issued exactly once"
        }),
    )
    .await;
    assert_eq!(status, 202, "{accepted}");
    let action = accepted["id"].as_i64().expect("id");
    let (_, view) = support::action_view(&gateway, AGENT_TOKEN, action, Some("20s")).await;
    assert_eq!(view["outcome"], "budget_exhausted", "{view}");

    let (_, case) = boundary_escalation(&gateway, action).await;
    assert_eq!(
        case["desired_outcome"], "invoice 42 issued exactly once",
        "{case:#}"
    );
    assert_eq!(
        case["budget"]["deadline"], "2099-01-01T00:00:00Z",
        "{case:#}"
    );
    let expected = backstop_core::breaker::RequestFingerprint::compute(
        "POST",
        "/v1/invoices",
        Some(&serde_json::from_str(payload).expect("payload json")),
        &["/customer".to_owned()],
    );
    assert_eq!(case["fingerprint"], expected.as_str(), "{case:#}");
    let attempts = case["attempts"].as_array().expect("attempts");
    assert_eq!(attempts.len(), 2, "{case:#}");
    assert_eq!(attempts[0]["status"], 429);
    assert_eq!(attempts[0]["retry_after_raw"], "1");
    assert_eq!(attempts[1]["retry_after_raw"], "600");
    let wait_used = case["budget"]["wait_used_ms"].as_u64().expect("wait used");
    assert!(
        (900..30_000).contains(&wait_used),
        "the 1 s Retry-After wait before the second attempt is counted: {wait_used} ms"
    );
    assert_eq!(case["budget"]["attempts_used"], 2, "{case:#}");
    assert_eq!(
        fake.attempts()
            .iter()
            .filter(|a| a.method == "POST")
            .count(),
        2,
        "no attempt after the refused plan"
    );
    gateway.shutdown().await.expect("shutdown");
    fake.shutdown().await;
}
