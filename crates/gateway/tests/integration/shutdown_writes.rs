//! Writes caught by a clean stop (`Running::shutdown`, what SIGTERM runs): a write whose attempt
//! is in flight when the gateway stops is left recorded as sent without a result — no lookup is
//! faked, nothing is escalated because of the stop — and the next start reconciles it with its
//! original key (SPEC §12). Sends are counted at the fake provider.

use std::{path::Path, time::Duration};

use backstop_core::reconcile::upstream_idempotency_key;
use backstop_fake_api::{FakeConfig, Fault, FaultRule, RouteConfig};
use backstop_gateway::server::Running;
use backstop_store::{ActionId, SqliteStore, Store};

use crate::support::{self, action_id, client, lookup, on_route};

const AGENT_TOKEN: &str = "agent-token-shutdown-writes";

fn env(name: &str) -> Option<String> {
    match name {
        "TEST_AGENT_TOKEN" => Some(AGENT_TOKEN.to_owned()),
        "FAKE_API_KEY" => Some("sk-provider-shutdown".to_owned()),
        _ => None,
    }
}

async fn start_gateway(base_url: &str, dir: &Path) -> Running {
    let yaml = support::policy_yaml(
        base_url,
        "agents:\n  test-agent: { token_env: TEST_AGENT_TOKEN }\n",
        r#"    routes:
      "POST /v1/transfers":
        class: idempotent_write
        scopes: [account]
        reconcile:
          by: idempotency_key
          lookup: "GET /v1/transfers?idempotency_key={key}"
          found_pointer: /data/0/id
          operation_id_pointer: /id
      "GET /v1/transfers": { class: read, scopes: [account] }
"#,
    );
    // A 2 s grace: longer than the fake holds the write before dropping it.
    support::start_gateway(&yaml, "shutdown.yaml", &env, support::serve_options(dir, 5)).await
}

/// Polls `done` every 10 ms for at most 10 s; returns its last answer.
async fn eventually(mut done: impl FnMut() -> bool) -> bool {
    for _ in 0..1000 {
        if done() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    done()
}

/// The kinds of the audit events of `action` in the store at `db` (opened after the gateway
/// stopped).
fn audited(db: &Path, action: i64) -> Vec<String> {
    let store = SqliteStore::open_existing(db).expect("store");
    store
        .audit_events(0, 10_000)
        .unwrap()
        .into_iter()
        .filter(|e| e.action == Some(action))
        .map(|e| e.kind)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_in_flight_at_a_clean_stop_stays_sent_and_the_next_start_reconciles_it_by_key() {
    // The provider stores the first create, holds the connection for 1 s, then drops it.
    let fake = support::start_fake(
        FakeConfig::default()
            .with_route(
                RouteConfig::new("POST /v1/transfers", support::create("transfers", "tr_"))
                    .with_idempotency()
                    .with_fault(FaultRule::on_calls(
                        [1],
                        Fault::StoreThenDrop { hold_ms: 1000 },
                    )),
            )
            .with_route(RouteConfig::new("GET /v1/transfers", lookup("transfers"))),
    );
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("backstop.db");
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let in_flight = tokio::spawn(transfer(gateway.addr));
    assert!(
        eventually(|| !on_route(&fake.attempts(), "POST", "/v1/transfers").is_empty()).await,
        "the create reached the provider"
    );

    // The clean stop while the provider still holds the write: the drain waits for its answer.
    gateway.shutdown().await.expect("clean stop");
    let answered = in_flight.await.unwrap().expect("an answer");
    assert_eq!(answered.status(), 503);
    assert_eq!(answered.headers()["x-should-retry"], "false");
    assert_eq!(answered.headers()["idempotency-key"], "order-stop-1");
    let id = action_id(&answered);
    let (_, body) = support::json_of(answered).await;
    assert_eq!(body["type"], "urn:backstop:problem:shutting_down", "{body}");
    assert_eq!(body["sent"], true, "{body}");
    assert_eq!(body["action_id"], id, "{body}");

    // Nothing was asked of the provider and nothing was decided: the attempt is sent without a
    // result, the action open, no lookup audited, nothing escalated.
    let attempts = fake.attempts();
    assert_eq!(on_route(&attempts, "POST", "/v1/transfers").len(), 1);
    assert!(
        on_route(&attempts, "GET", "/v1/transfers").is_empty(),
        "no lookup left: {attempts:?}"
    );
    {
        let store = SqliteStore::open_existing(&db).expect("store");
        let action = store.action(ActionId(id)).unwrap().expect("the action");
        assert_eq!(action.outcome, None, "the stop decided nothing");
        let stored = store.attempts(ActionId(id)).unwrap();
        assert_eq!(stored.len(), 1);
        assert_eq!(stored[0].disposition, None, "sent, without a result");
        assert_eq!(stored[0].finished_at, None);
        assert!(store.open_escalations().unwrap().is_empty());
        assert_eq!(store.unfinished_attempts().unwrap().len(), 1);
    }
    let kinds = audited(&db, id);
    for kind in ["reconciliation_lookup", "escalated", "action_result"] {
        assert!(
            !kinds.iter().any(|k| k == kind),
            "{kind} audited at the stop: {kinds:?}"
        );
    }

    // The next start reconciles it with its original key: one lookup, no second create.
    let restarted = start_gateway(&fake.url(), dir.path()).await;
    assert!(
        eventually(|| on_route(&fake.attempts(), "GET", "/v1/transfers").len() == 1).await,
        "the next start looks the write up"
    );
    let mut view = serde_json::Value::Null;
    for _ in 0..500 {
        let (status, seen) = support::action_view(&restarted, AGENT_TOKEN, id, None).await;
        assert_eq!(status, 200, "{seen}");
        view = seen;
        if !view["outcome"].is_null() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(view["outcome"], "succeeded", "{view}");
    // The agent's resend under its key replays the reconciled outcome; nothing is sent.
    let replayed = transfer(restarted.addr).await.expect("resend");
    assert_eq!(action_id(&replayed), id);
    assert_eq!(replayed.status(), 200);
    restarted.shutdown().await.expect("stop");

    let attempts = fake.attempts();
    let creates = on_route(&attempts, "POST", "/v1/transfers");
    let lookups = on_route(&attempts, "GET", "/v1/transfers");
    assert_eq!(creates.len(), 1, "never a second create: {attempts:?}");
    assert_eq!(lookups.len(), 1, "{attempts:?}");
    let key = upstream_idempotency_key("test-agent", "order-stop-1");
    assert_eq!(creates[0].idempotency_key.as_deref(), Some(key.as_str()));
    assert_eq!(
        lookups[0].query.as_deref(),
        Some(format!("idempotency_key={key}").as_str()),
        "looked up with the original key"
    );
    let store = SqliteStore::open_existing(&db).expect("store");
    let action = store.action(ActionId(id)).unwrap().expect("the action");
    assert_eq!(action.outcome.map(|o| o.as_str()), Some("succeeded"));
    assert!(action
        .provider_operation_id
        .is_some_and(|op| op.starts_with("tr_")));
    assert!(store.open_escalations().unwrap().is_empty());
    drop(store);
    let kinds = audited(&db, id);
    assert_eq!(
        kinds
            .iter()
            .filter(|k| *k == "reconciliation_lookup")
            .count(),
        1,
        "{kinds:?}"
    );
    assert!(kinds.iter().any(|k| k == "reconciled"), "{kinds:?}");
    assert!(!kinds.iter().any(|k| k == "escalated"), "{kinds:?}");
    fake.shutdown().await;
}

/// The transfer of task `run-stop` under the key `order-stop-1`, sent through the door at `addr`.
fn transfer(
    addr: std::net::SocketAddr,
) -> impl std::future::Future<Output = reqwest::Result<reqwest::Response>> {
    client()
        .post(format!("http://{addr}/fake/v1/transfers"))
        .bearer_auth(AGENT_TOKEN)
        .header("X-Backstop-Task", "run-stop")
        .header("Idempotency-Key", "order-stop-1")
        .header("content-type", "application/json")
        .body(r#"{"amount":40}"#)
        .send()
}
