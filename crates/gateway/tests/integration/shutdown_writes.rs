//! Writes caught by a clean stop (`Running::shutdown`, what SIGTERM runs): a write whose attempt
//! is in flight when the gateway stops is left recorded as sent without a result — no lookup is
//! faked, nothing is escalated because of the stop — and the next start reconciles it with its
//! original key (SPEC §12); sends are counted at the fake provider. A write waiting for its
//! retry is told what the next start will really do with it — reconcile it when its last
//! attempt is uncertain, cancel it otherwise — and the restart then does just that (sends
//! counted at the scripted transport).

use std::{path::Path, time::Duration};

use backstop_core::{classify::TransportError, reconcile::upstream_idempotency_key};
use backstop_fake_api::{FakeConfig, Fault, FaultRule, RouteConfig};
use backstop_gateway::{
    action::{ActionSpec, Execution},
    server::Running,
};
use backstop_store::{ActionId, Outcome, SqliteStore, Store};
use serde_json::Value;

use crate::{
    engine_support::{advance, answer, summary, until, Harness, Step},
    support::{self, action_id, client, lookup, on_route},
};

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
    assert_eq!(body["after_restart"], "reconcile", "{body}");
    assert_eq!(body["last_signal"], "uncertain", "{body}");

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

/// A gateway over the provider at `base_url` whose transfers have no lookup, with a 1 s grace.
async fn start_gateway_without_lookup(base_url: &str, dir: &Path) -> Running {
    let yaml = support::policy_yaml(
        base_url,
        "agents:\n  test-agent: { token_env: TEST_AGENT_TOKEN }\n",
        r#"    routes:
      "POST /v1/transfers": { class: idempotent_write, scopes: [account] }
      "GET /v1/transfers/{id}": { class: read, scopes: [account] }
"#,
    );
    let options = backstop_gateway::server::ServeOptions {
        shutdown_grace: Duration::from_secs(1),
        ..support::serve_options(dir, 5)
    };
    support::start_gateway(&yaml, "shutdown-no-lookup.yaml", &env, options).await
}

/// The provider outlasts the grace (it holds the write for 30 s, the attempt timeout is 60 s):
/// when the grace runs out, the caller is still answered `503 shutting_down` — not an empty
/// reply — and the write, which has no lookup, is left sent without a result for the next start
/// to reconcile with its original key: nothing is escalated during the stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_whose_provider_outlasts_the_grace_is_answered_and_stays_sent_without_a_result() {
    let fake = support::start_fake(
        FakeConfig::default().with_route(
            RouteConfig::new("POST /v1/transfers", support::create("transfers", "tr_"))
                .with_idempotency()
                .with_fault(FaultRule::on_calls(
                    [1],
                    Fault::StoreThenDrop { hold_ms: 30_000 },
                )),
        ),
    );
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("backstop.db");
    let gateway = start_gateway_without_lookup(&fake.url(), dir.path()).await;
    let in_flight = tokio::spawn(transfer(gateway.addr));
    assert!(
        eventually(|| !on_route(&fake.attempts(), "POST", "/v1/transfers").is_empty()).await,
        "the create reached the provider"
    );

    gateway.shutdown().await.expect("clean stop");
    let answered = in_flight
        .await
        .unwrap()
        .expect("an answer, not an empty reply");
    assert_eq!(answered.status(), 503);
    assert_eq!(answered.headers()["x-should-retry"], "false");
    assert_eq!(answered.headers()["idempotency-key"], "order-stop-1");
    assert_eq!(answered.headers()["backstop-attempts"], "1");
    let id = action_id(&answered);
    let (_, body) = support::json_of(answered).await;
    assert_eq!(body["type"], "urn:backstop:problem:shutting_down", "{body}");
    assert_eq!(body["sent"], true, "{body}");
    assert_eq!(body["action_id"], id, "{body}");
    assert_eq!(body["after_restart"], "reconcile", "{body}");
    assert_eq!(body["last_signal"], "uncertain", "{body}");

    assert_eq!(
        on_route(&fake.attempts(), "POST", "/v1/transfers").len(),
        1,
        "sent once"
    );
    {
        let store = SqliteStore::open_existing(&db).expect("store");
        let action = store.action(ActionId(id)).unwrap().expect("the action");
        assert_eq!(action.outcome, None, "the stop decided nothing");
        let stored = store.attempts(ActionId(id)).unwrap();
        assert_eq!(stored.len(), 1);
        assert_eq!(stored[0].disposition, None, "sent, without a result");
        assert!(store.open_escalations().unwrap().is_empty());
        assert_eq!(store.unfinished_attempts().unwrap().len(), 1);
    }
    let kinds = audited(&db, id);
    for kind in ["escalated", "action_result"] {
        assert!(
            !kinds.iter().any(|k| k == kind),
            "{kind} audited at the stop: {kinds:?}"
        );
    }
    fake.shutdown().await;
}

/// The write's answer never came and its reconciliation lookup was sent just before the stop,
/// but the provider holds the lookup past the grace: the caller is still answered `503
/// shutting_down` (not an empty reply), and the write stays sent without a result for the next
/// start to reconcile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lookup_the_provider_holds_past_the_grace_leaves_the_write_for_the_next_start() {
    let fake = support::start_fake(
        FakeConfig::default()
            .with_route(
                RouteConfig::new("POST /v1/transfers", support::create("transfers", "tr_"))
                    .with_idempotency()
                    .with_fault(FaultRule::on_calls(
                        [1],
                        Fault::StoreThenDrop { hold_ms: 0 },
                    )),
            )
            .with_route(
                RouteConfig::new("GET /v1/transfers", lookup("transfers"))
                    .with_fault(FaultRule::on_calls([1], Fault::Timeout { hold_ms: 30_000 })),
            ),
    );
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("backstop.db");
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let in_flight = tokio::spawn(transfer(gateway.addr));
    assert!(
        eventually(|| !on_route(&fake.attempts(), "GET", "/v1/transfers").is_empty()).await,
        "the lookup reached the provider"
    );

    gateway.shutdown().await.expect("clean stop");
    let answered = in_flight
        .await
        .unwrap()
        .expect("an answer, not an empty reply");
    assert_eq!(answered.status(), 503);
    assert_eq!(answered.headers()["x-should-retry"], "false");
    let id = action_id(&answered);
    let (_, body) = support::json_of(answered).await;
    assert_eq!(body["type"], "urn:backstop:problem:shutting_down", "{body}");
    assert_eq!(body["after_restart"], "reconcile", "{body}");
    assert_eq!(body["last_signal"], "uncertain", "{body}");

    let store = SqliteStore::open_existing(&db).expect("store");
    let action = store.action(ActionId(id)).unwrap().expect("the action");
    assert_eq!(action.outcome, None, "the stop decided nothing");
    assert!(store.open_escalations().unwrap().is_empty());
    let stored = store.attempts(ActionId(id)).unwrap();
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].disposition, None, "sent, without a result");
    assert_eq!(on_route(&fake.attempts(), "POST", "/v1/transfers").len(), 1);
    fake.shutdown().await;
}

/// A write to a provider that honours no idempotency key, on a route without a lookup, whose
/// answer never comes (the connection drops) during the stop: the SPEC §6 rule would escalate
/// it, but our own stop is no evidence about it, so it stays sent without a result for the
/// next start (SPEC §12) — nothing is escalated during the stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncertain_write_without_a_lookup_is_not_escalated_during_the_stop() {
    let fake = support::start_fake(FakeConfig::default().with_route(
        RouteConfig::new("POST /v1/transfers", support::create("transfers", "tr_")).with_fault(
            FaultRule::on_calls([1], Fault::StoreThenDrop { hold_ms: 500 }),
        ),
    ));
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("backstop.db");
    let yaml = format!(
        r#"
agents:
  test-agent: {{ token_env: TEST_AGENT_TOKEN }}
providers:
  fake:
    base_url: {}
    credential: {{ secret_env: FAKE_API_KEY }}
    routes:
      "POST /v1/transfers": {{ class: uncertain_write }}
"#,
        fake.url()
    );
    let gateway = support::start_gateway(
        &yaml,
        "no-key.yaml",
        &env,
        support::serve_options(dir.path(), 5),
    )
    .await;
    let in_flight = tokio::spawn(transfer(gateway.addr));
    assert!(
        eventually(|| !on_route(&fake.attempts(), "POST", "/v1/transfers").is_empty()).await,
        "the create reached the provider"
    );

    // The 2 s grace outlasts the provider's hold: the drop comes back during the stop.
    gateway.shutdown().await.expect("clean stop");
    let answered = in_flight.await.unwrap().expect("an answer");
    assert_eq!(answered.status(), 503);
    assert_eq!(answered.headers()["x-should-retry"], "false");
    let id = action_id(&answered);
    let (_, body) = support::json_of(answered).await;
    assert_eq!(body["type"], "urn:backstop:problem:shutting_down", "{body}");
    assert_eq!(body["after_restart"], "reconcile", "{body}");
    assert_eq!(body["last_signal"], "uncertain", "{body}");

    let store = SqliteStore::open_existing(&db).expect("store");
    let action = store.action(ActionId(id)).unwrap().expect("the action");
    assert_eq!(action.outcome, None, "the stop decided nothing");
    assert!(store.open_escalations().unwrap().is_empty());
    let stored = store.attempts(ActionId(id)).unwrap();
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].disposition, None, "sent, without a result");
    drop(store);
    let kinds = audited(&db, id);
    assert!(
        !kinds.iter().any(|k| k == "escalated"),
        "escalated at the stop: {kinds:?}"
    );
    assert_eq!(on_route(&fake.attempts(), "POST", "/v1/transfers").len(), 1);
    fake.shutdown().await;
}

/// A read whose provider outlasts the grace is answered `503 shutting_down` that says it may be
/// sent again, not an empty reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_whose_provider_outlasts_the_grace_is_answered_it_may_be_sent_again() {
    let fake = support::start_fake(
        FakeConfig::default().with_route(
            RouteConfig::new("GET /v1/transfers/{id}", lookup("transfers"))
                .with_fault(FaultRule::on_calls([1], Fault::Timeout { hold_ms: 30_000 })),
        ),
    );
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway_without_lookup(&fake.url(), dir.path()).await;
    let read = client()
        .get(format!("http://{}/fake/v1/transfers/tr_1", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("X-Backstop-Task", "run-stop")
        .send();
    let in_flight = tokio::spawn(read);
    assert!(
        eventually(|| !on_route(&fake.attempts(), "GET", "/v1/transfers/tr_1").is_empty()).await,
        "the read reached the provider"
    );

    gateway.shutdown().await.expect("clean stop");
    let answered = in_flight
        .await
        .unwrap()
        .expect("an answer, not an empty reply");
    assert_eq!(answered.status(), 503);
    assert_eq!(answered.headers()["x-should-retry"], "true");
    assert_eq!(answered.headers()["retry-after"], "1");
    let (_, body) = support::json_of(answered).await;
    assert_eq!(body["type"], "urn:backstop:problem:shutting_down", "{body}");
    assert_eq!(body["after_restart"], "cancel", "{body}");
    assert_eq!(body["last_signal"], "uncertain", "{body}");
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

/// The transfer of task `t` under the agent's key `key`.
fn keyed_write(h: &Harness, key: &str) -> ActionSpec {
    let mut spec = h.spec("t", "POST", "/v1/transfers", r#"{"amount":5}"#);
    spec.idempotency_key = Some(key.to_owned());
    spec
}

/// Runs a write under `key` whose first attempt is answered `first`, stops the engine while the
/// write waits for its retry, and returns the action and the problem its caller got (with
/// `x-should-retry`).
async fn stopped_while_waiting_for_the_retry(h: &Harness, key: &str, first: Step) -> (i64, Value) {
    h.transport.script("/v1/transfers", vec![first]);
    let running = h.spawn(keyed_write(h, key));
    assert!(until(|| h.transport.sent().len() == 1).await);
    assert!(until(|| h.store.scheduled_retries().is_ok_and(|r| r.len() == 1)).await);
    h.engine.shutdown().await;
    let Execution::Response { receipt, response } = running.await.unwrap() else {
        panic!("a problem answer")
    };
    assert_eq!(response.status(), 503);
    assert_eq!(response.headers()["x-should-retry"], "false");
    assert_eq!(receipt.attempts, 1);
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    let body: Value = serde_json::from_slice(&bytes).expect("a problem document");
    assert_eq!(body["type"], "urn:backstop:problem:shutting_down", "{body}");
    assert_eq!(body["idempotency_key"], key, "{body}");
    assert_eq!(body["action_id"], receipt.action_id, "{body}");
    (receipt.action_id, body)
}

#[tokio::test(start_paused = true)]
async fn a_write_answered_by_the_provider_and_waiting_for_its_retry_is_told_the_restart_resumes_it()
{
    let h = Harness::new();
    let (action, body) = stopped_while_waiting_for_the_retry(
        &h,
        "k-answered",
        answer(503, &[("retry-after", "20")], ""),
    )
    .await;
    assert_eq!(body["sent"], true, "{body}");
    assert_eq!(body["after_restart"], "resume", "{body}");
    assert_eq!(body["last_status"], 503, "{body}");
    assert_eq!(body["last_signal"], "unavailable", "{body}");
    let detail = body["detail"].as_str().unwrap();
    for said in [
        "HTTP 503 (`unavailable`)",
        "nothing to reconcile",
        "its request is kept",
        "sent under its original Idempotency-Key when it falls due",
        "409 idempotency_key_in_flight",
        "never send it under a new key",
        &format!("GET /v1/actions/{action}"),
    ] {
        assert!(detail.contains(said), "`{said}` missing: {detail}");
    }
    assert!(!detail.contains("under a new Idempotency-Key"), "{detail}");

    // What the restart does is what the answer said: the same key is in flight until the retry
    // falls due, then the retry is sent from the kept request under the same key.
    let restarted = h.restarted(3);
    let early = restarted.execute(keyed_write(&h, "k-answered")).await;
    assert_eq!(summary(&early), "in_flight", "{early:?}");
    advance(Duration::from_secs(30)).await;
    let stored = || h.store.action(ActionId(action)).unwrap().unwrap();
    assert!(until(|| stored().outcome.is_some()).await);
    assert_eq!(stored().outcome, Some(Outcome::Succeeded));
    let sent = h.transport.sent_to("/v1/transfers");
    assert_eq!(sent.len(), 2);
    assert_eq!(sent[0].idempotency_key, sent[1].idempotency_key);
    let late = restarted.execute(keyed_write(&h, "k-answered")).await;
    assert_eq!(late.receipt().action_id, action, "{late:?}");
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 2, "replayed");
    restarted.shutdown().await;
}

/// A write whose only attempt never reached the provider (`not_sent`: the connection was
/// refused) and which waits for its retry when the gateway stops is told `sent: false` — as its
/// outcome context would say — and that the next start sends its retry from the kept request.
#[tokio::test(start_paused = true)]
async fn a_write_whose_attempt_never_left_and_waiting_for_its_retry_is_told_nothing_was_sent() {
    let h = Harness::new();
    let (_, body) =
        stopped_while_waiting_for_the_retry(&h, "k-not-sent", Step::Fail(TransportError::Connect))
            .await;
    assert_eq!(body["sent"], false, "{body}");
    assert_eq!(body["after_restart"], "resume", "{body}");
    assert_eq!(body["last_signal"], "not_sent", "{body}");
    let detail = body["detail"].as_str().unwrap();
    assert!(detail.contains("never reached the provider"), "{detail}");
    assert!(detail.contains("its request is kept"), "{detail}");
}

#[tokio::test(start_paused = true)]
async fn a_write_left_uncertain_and_waiting_for_its_retry_is_told_the_restart_reconciles_it() {
    // The provider honours the key and the route has no lookup: the uncertain attempt is
    // retried under the same key, and the stop comes while that retry waits.
    let h = Harness::new();
    let (action, body) = stopped_while_waiting_for_the_retry(
        &h,
        "k-uncertain",
        Step::Fail(TransportError::TimeoutAfterSend),
    )
    .await;
    assert_eq!(body["sent"], true, "{body}");
    assert_eq!(body["after_restart"], "reconcile", "{body}");
    assert_eq!(body["last_status"], Value::Null, "{body}");
    assert_eq!(body["last_signal"], "uncertain", "{body}");
    let detail = body["detail"].as_str().unwrap();
    for said in [
        "no answer came back (uncertain)",
        "reconciled with its original Idempotency-Key",
        "409 idempotency_key_in_flight",
        "never send it under a new key",
        &format!("GET /v1/actions/{action}"),
    ] {
        assert!(detail.contains(said), "`{said}` missing: {detail}");
    }
    assert!(!detail.contains("410"), "{detail}");
    assert!(!detail.contains("cancelled"), "{detail}");

    // The restart reconciles it when its retry falls due: without a lookup, the provider
    // honouring the key, it is resent under that key from the kept request — never cancelled.
    let restarted = h.restarted(3);
    let early = restarted.execute(keyed_write(&h, "k-uncertain")).await;
    assert_eq!(summary(&early), "in_flight", "{early:?}");
    advance(Duration::from_secs(30)).await;
    let stored = || h.store.action(ActionId(action)).unwrap().unwrap();
    assert!(until(|| stored().outcome.is_some()).await);
    assert_eq!(stored().outcome, Some(Outcome::Succeeded));
    let sent = h.transport.sent_to("/v1/transfers");
    assert_eq!(sent.len(), 2);
    assert_eq!(sent[0].idempotency_key, sent[1].idempotency_key);
    restarted.shutdown().await;
}

/// A read waiting for its retry when the gateway stops is told `503 shutting_down` with
/// `x-should-retry: true` and `Retry-After: 1`: whatever its attempt was answered, a read
/// changes nothing at the provider, so sending it again once backstop is back is safe.
#[tokio::test(start_paused = true)]
async fn a_read_waiting_for_its_retry_at_a_stop_is_told_it_may_be_sent_again() {
    let h = Harness::new();
    h.transport.script(
        "/v1/items/4",
        vec![answer(503, &[("retry-after", "20")], "")],
    );
    let running = h.spawn(h.get("t", "/v1/items/4"));
    assert!(until(|| h.transport.sent_to("/v1/items/4").len() == 1).await);
    advance(Duration::from_secs(1)).await;
    h.engine.shutdown().await;
    let Execution::Response { response, .. } = running.await.unwrap() else {
        panic!("a problem answer")
    };
    assert_eq!(response.status(), 503);
    assert_eq!(response.headers()["x-should-retry"], "true");
    assert_eq!(response.headers()["retry-after"], "1");
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    let body: Value = serde_json::from_slice(&bytes).expect("a problem document");
    assert_eq!(body["after_restart"], "cancel", "{body}");
    assert_eq!(body["sent"], true, "{body}");
    assert_eq!(body["last_status"], 503, "{body}");
}
