//! An operator's `query_status` over loopback sockets, measured at the fake provider: a lookup
//! that cannot answer (503) leaves the escalation open and listed, is audited as its own
//! `status_query` event, and a later `abort` is still accepted.

use std::{path::Path, time::Duration};

use backstop_core::policy::Policy;
use backstop_fake_api::{FakeApi, FakeConfig, Fault, FaultRule, Handler, RouteConfig};
use backstop_gateway::server::{self, Running, ServeOptions};
use backstop_store::{ActionId, SqliteStore, Store, STATUS_QUERY};
use serde_json::{json, Value};

const AGENT_TOKEN: &str = "agent-token-query-1a2b";
const OPERATOR_TOKEN: &str = "operator-token-query-3c4d";

fn policy_yaml(base_url: &str) -> String {
    format!(
        r#"
backoff:
  base_seconds: 1
  max_seconds: 2
  boundary_spread_seconds: 0
agents:
  test-agent: {{ token_env: TEST_AGENT_TOKEN }}
operators:
  oncall: {{ token_env: OPS_TOKEN }}
providers:
  fake:
    base_url: {base_url}
    credential: {{ secret_env: FAKE_API_KEY }}
    idempotency_header: Idempotency-Key
    scopes:
      account: {{ limit: 1000, window_seconds: 60 }}
    routes:
      "POST /v1/orders":
        class: idempotent_write
        scopes: [account]
        reconcile:
          by: idempotency_key
          lookup: "GET /v1/orders?idempotency_key={{key}}"
          found_pointer: /data/0/id
          operation_id_pointer: /id
      "GET /v1/orders": {{ class: read, scopes: [account] }}
"#
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
    let policy = Policy::from_yaml_str(&policy_yaml(base_url), "query.yaml").expect("policy");
    let options = ServeOptions {
        listen: Some("127.0.0.1:0".into()),
        store: Some(dir.join("backstop.db")),
        seed: 29,
        shutdown_grace: Duration::from_secs(2),
        ..ServeOptions::default()
    };
    server::start(policy, options, &env, server::engine)
        .await
        .expect("gateway starts")
}

/// The create stores the order and drops the connection; the lookup answers 503 on its first
/// `failing_lookups` calls (the engine's own lookup, then the operator's queries).
fn fake(failing_lookups: u64) -> backstop_fake_api::RunningFake {
    let config = FakeConfig::default()
        .with_route(
            RouteConfig::new(
                "POST /v1/orders",
                Handler::Create {
                    collection: "orders".into(),
                    id_prefix: "or_".into(),
                    reference_field: None,
                    unique_reference: false,
                },
            )
            .with_idempotency()
            .with_fault(FaultRule::on_calls(
                [1],
                Fault::StoreThenDrop { hold_ms: 0 },
            )),
        )
        .with_route(
            RouteConfig::new(
                "GET /v1/orders",
                Handler::Lookup {
                    collection: "orders".into(),
                },
            )
            .with_fault(FaultRule::on_calls(
                1..=failing_lookups,
                Fault::Status {
                    status: 503,
                    retry_after: None,
                    body: None,
                },
            )),
        );
    FakeApi::start(config, "127.0.0.1:0".parse().expect("addr")).expect("fake provider starts")
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client")
}

async fn json_of(response: reqwest::Response) -> (u16, Value) {
    let status = response.status().as_u16();
    let bytes = response.bytes().await.expect("body");
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, body)
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
    let (status, list) = json_of(
        client()
            .get(format!("http://{}/v1/escalations", gateway.addr))
            .bearer_auth(OPERATOR_TOKEN)
            .send()
            .await
            .expect("list"),
    )
    .await;
    assert_eq!(status, 200, "{list}");
    list["escalations"].as_array().expect("array").clone()
}

async fn decide(gateway: &Running, escalation: i64, option: &str) -> (u16, Value) {
    json_of(
        client()
            .post(format!(
                "http://{}/v1/escalations/{escalation}/decision",
                gateway.addr
            ))
            .bearer_auth(OPERATOR_TOKEN)
            .header("content-type", "application/json")
            .body(json!({ "option": option }).to_string())
            .send()
            .await
            .expect("decision"),
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
