//! An operator's `query_status` over loopback sockets, measured at the fake provider: a lookup
//! that cannot answer (503) leaves the escalation open and listed, is audited as its own
//! `status_query` event, and a later `abort` is still accepted.

use std::path::Path;

use backstop_fake_api::{FakeConfig, Fault, FaultRule, RouteConfig};
use backstop_gateway::server::Running;
use backstop_store::{ActionId, SqliteStore, Store, STATUS_QUERY};
use serde_json::{json, Value};

use crate::support::{self, client, create, json_of, lookup};

const AGENT_TOKEN: &str = "agent-token-query-1a2b";
const OPERATOR_TOKEN: &str = "operator-token-query-3c4d";

fn policy_yaml(base_url: &str) -> String {
    support::policy_yaml(
        base_url,
        r#"agents:
  test-agent: { token_env: TEST_AGENT_TOKEN }
operators:
  oncall: { token_env: OPS_TOKEN }
"#,
        r#"    routes:
      "POST /v1/orders":
        class: idempotent_write
        scopes: [account]
        reconcile:
          by: idempotency_key
          lookup: "GET /v1/orders?idempotency_key={key}"
          found_pointer: /data/0/id
          operation_id_pointer: /id
      "GET /v1/orders": { class: read, scopes: [account] }
"#,
    )
}

fn env(name: &str) -> Option<String> {
    match name {
        "TEST_AGENT_TOKEN" => Some(AGENT_TOKEN.to_owned()),
        "OPS_TOKEN" => Some(OPERATOR_TOKEN.to_owned()),
        "FAKE_API_KEY" => Some("sk-fake-query".to_owned()),
        _ => None,
    }
}

async fn start_gateway(base_url: &str, dir: &Path) -> Running {
    let options = support::serve_options(dir, 29);
    support::start_gateway(&policy_yaml(base_url), "query.yaml", &env, options).await
}

/// The create stores the order and drops the connection; the lookup answers 503 on its first
/// `failing_lookups` calls (the engine's own lookup, then the operator's queries).
fn fake(failing_lookups: u64) -> backstop_fake_api::RunningFake {
    let config = FakeConfig::default()
        .with_route(
            RouteConfig::new("POST /v1/orders", create("orders", "or_"))
                .with_idempotency()
                .with_fault(FaultRule::on_calls(
                    [1],
                    Fault::StoreThenDrop { hold_ms: 0 },
                )),
        )
        .with_route(
            RouteConfig::new("GET /v1/orders", lookup("orders")).with_fault(FaultRule::on_calls(
                1..=failing_lookups,
                Fault::Status {
                    status: 503,
                    retry_after: None,
                    body: None,
                },
            )),
        );
    support::start_fake(config)
}

async fn escalated_order(gateway: &Running, key: &str) -> i64 {
    let response = client()
        .post(format!("http://{}/fake/v1/orders", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("X-Backstop-Task", "run-query")
        .header("Idempotency-Key", key)
        .header("content-type", "application/json")
        .body(r#"{"sku":"A-1"}"#)
        .send()
        .await
        .expect("request");
    let id: i64 = response.headers()["backstop-action-id"]
        .to_str()
        .expect("text")
        .parse()
        .expect("number");
    let (_, body) = json_of(response).await;
    assert_eq!(body["outcome"], "escalated", "{body}");
    id
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

fn lookups(fake: &backstop_fake_api::RunningFake) -> usize {
    fake.attempts()
        .iter()
        .filter(|a| a.method == "GET" && a.path == "/v1/orders")
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inconclusive_query_status_leaves_the_escalation_open_and_abort_still_decides() {
    let fake = fake(2);
    let dir = tempfile::tempdir().expect("tempdir");
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let action = escalated_order(&gateway, "order-query-1").await;
    let open = open_escalations(&gateway).await;
    let escalation = open
        .iter()
        .find(|e| e["action"] == action)
        .expect("escalated")["id"]
        .as_i64()
        .expect("id");
    assert_eq!(lookups(&fake), 1, "the engine's own lookup");

    let (status, answer) = decide(&gateway, escalation, "query_status").await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        lookups(&fake),
        2,
        "the operator's query asked the provider once"
    );
    assert_eq!(answer["escalation_state"], "open", "{answer}");
    assert_eq!(answer["effect_applied"], false, "{answer}");
    assert_eq!(answer["lookup"]["verdict"], "inconclusive", "{answer}");
    assert!(
        answer["lookup"]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("503")),
        "the answer says what the lookup returned: {answer}"
    );
    assert!(answer["action_outcome"].is_null(), "{answer}");

    // Still listed open, the action still escalated.
    let open = open_escalations(&gateway).await;
    assert!(
        open.iter()
            .any(|e| e["id"] == escalation && e["state"] == "open"),
        "still open: {open:?}"
    );

    // A later decision is accepted.
    let (status, answer) = decide(&gateway, escalation, "abort").await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["action_outcome"], "cancelled", "{answer}");
    assert_eq!(answer["escalation_state"], "decided", "{answer}");
    assert!(open_escalations(&gateway).await.is_empty());
    let creates = fake
        .attempts()
        .iter()
        .filter(|a| a.method == "POST")
        .count();
    assert_eq!(creates, 1, "nothing was created again");

    gateway.shutdown().await.expect("shutdown");
    let store = SqliteStore::open_existing(dir.path().join("backstop.db")).expect("store");
    let record = store
        .action(ActionId(action))
        .expect("read")
        .expect("action");
    assert_eq!(record.outcome.map(|o| o.as_str()), Some("cancelled"));
    let events = store.audit_events(0, 10_000).expect("audit");
    let query = events
        .iter()
        .find(|e| e.kind == STATUS_QUERY)
        .expect("the query is audited as its own event");
    assert_eq!(query.decided_by.as_deref(), Some("oncall"));
    assert_eq!(query.disposition.as_deref(), Some("inconclusive"));
    assert_eq!(query.escalation, Some(escalation));
    let decisions: Vec<_> = events
        .iter()
        .filter(|e| e.kind == "decision")
        .map(|e| e.decision.as_deref())
        .collect();
    assert_eq!(decisions, [Some("abort")], "one closing decision");
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_status_that_finds_the_write_reconciles_and_closes_the_escalation() {
    let fake = fake(1);
    let dir = tempfile::tempdir().expect("tempdir");
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let action = escalated_order(&gateway, "order-query-2").await;
    let escalation = open_escalations(&gateway).await[0]["id"]
        .as_i64()
        .expect("id");
    let (status, answer) = decide(&gateway, escalation, "query_status").await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["lookup"]["verdict"], "found", "{answer}");
    assert_eq!(answer["action_outcome"], "succeeded", "{answer}");
    assert_eq!(answer["escalation_state"], "decided", "{answer}");
    assert!(open_escalations(&gateway).await.is_empty());
    let (status, again) = decide(&gateway, escalation, "abort").await;
    assert_eq!(status, 409, "{again}");
    gateway.shutdown().await.expect("shutdown");
    let store = SqliteStore::open_existing(dir.path().join("backstop.db")).expect("store");
    let record = store
        .action(ActionId(action))
        .expect("read")
        .expect("action");
    assert_eq!(record.outcome.map(|o| o.as_str()), Some("succeeded"));
    fake.shutdown().await;
}
