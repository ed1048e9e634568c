//! A same-key resend naming a cancelled task: the action recorded under the agent's key is found
//! first — its outcome replayed (SPEC §6), carrying the action's own task — and only a NEW
//! action in a cancelled task is refused. In the engine (virtual time) and over loopback.

use std::path::Path;

use backstop_core::outcome::Outcome;
use backstop_fake_api::{FakeConfig, RouteConfig};
use backstop_gateway::action::{ActionSpec, Execution};
use backstop_store::Store;
use serde_json::Value;

use crate::engine_support::{advance, answer, summary, until, Harness};
use crate::support::{self, client, create, json_of, on_route};

/// The transfer of task `task` under the agent key `key`.
fn transfer(h: &Harness, task: &str, key: &str) -> ActionSpec {
    let mut spec = h.spec(task, "POST", "/v1/transfers", r#"{"amount":5}"#);
    spec.idempotency_key = Some(key.to_owned());
    spec
}

/// Whether `execution` is a replayed provider response with `status`.
fn replayed(execution: &Execution, status: u16) -> bool {
    matches!(execution, Execution::Response { response, .. }
        if response.status().as_u16() == status
            && response.headers().contains_key("idempotent-replayed"))
}

#[tokio::test(start_paused = true)]
async fn a_finished_write_is_replayed_to_a_resend_naming_its_cancelled_task() {
    let h = Harness::new();
    h.transport.script(
        "/v1/transfers",
        vec![
            answer(201, &[], r#"{"id":"tr_1"}"#),
            answer(201, &[], r#"{"id":"tr_2"}"#),
        ],
    );
    let first = h.engine.execute(transfer(&h, "tc2", "ks1")).await;
    assert_eq!(summary(&first), "201");
    let id = first.receipt().action_id;
    h.engine.cancel_task("tc2", "agent-a").await.unwrap();

    let again = h.engine.execute(transfer(&h, "tc2", "ks1")).await;
    assert!(replayed(&again, 201), "{again:?}");
    assert_eq!(again.receipt().action_id, id);
    assert_eq!(again.receipt().idempotency_key.as_deref(), Some("ks1"));
    assert_eq!(again.receipt().task.as_deref(), Some("tc2"));
    assert_eq!(
        h.transport.sent_to("/v1/transfers").len(),
        1,
        "nothing sent"
    );

    // A new action in the cancelled task is still refused, and nothing is sent.
    let new = h.engine.execute(transfer(&h, "tc2", "ks-new")).await;
    match &new {
        Execution::Outcome {
            outcome, detail, ..
        } => {
            assert_eq!(*outcome, Outcome::Cancelled);
            assert!(detail.contains("not accepted"), "{detail}");
        }
        other => panic!("expected the refusal, got {}", summary(other)),
    }
    assert_eq!(new.receipt().action_id, 0);
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_new_action_refused_for_its_cancelled_task_names_the_task() {
    let h = Harness::new();
    let _ = h.engine.execute(h.get("tc-named", "/v1/items/1")).await;
    h.engine.cancel_task("tc-named", "agent-a").await.unwrap();
    for spec in [
        h.get("tc-named", "/v1/items/2"),
        transfer(&h, "tc-named", "ks-named"),
    ] {
        let refused = h.engine.execute(spec).await;
        match &refused {
            Execution::Outcome {
                outcome, detail, ..
            } => {
                assert_eq!(*outcome, Outcome::Cancelled);
                assert_eq!(
                    detail,
                    r#"the action was not accepted: task "tc-named" is cancelled; it takes no new actions"#
                );
            }
            other => panic!("expected the refusal, got {}", summary(other)),
        }
        assert_eq!(refused.receipt().action_id, 0);
    }
    assert_eq!(
        h.transport.sent().len(),
        1,
        "only the read before the cancel"
    );
}

#[tokio::test(start_paused = true)]
async fn a_resend_naming_a_cancelled_task_replays_the_action_of_another_task_with_its_task() {
    let h = Harness::new();
    h.transport
        .script("/v1/transfers", vec![answer(201, &[], r#"{"id":"tr_1"}"#)]);
    let first = h.engine.execute(transfer(&h, "ta", "ks2")).await;
    assert_eq!(summary(&first), "201");
    let id = first.receipt().action_id;
    // The other task exists and is cancelled.
    let _ = h.engine.execute(h.get("tc3", "/v1/items/1")).await;
    h.engine.cancel_task("tc3", "agent-a").await.unwrap();

    let again = h.engine.execute(transfer(&h, "tc3", "ks2")).await;
    assert!(replayed(&again, 201), "{again:?}");
    assert_eq!(again.receipt().action_id, id);
    assert_eq!(
        again.receipt().task.as_deref(),
        Some("ta"),
        "the action's own task, not the request's"
    );
    // Another payload under the key is refused as a reused key, not as a cancelled task.
    let mut other = h.spec("tc3", "POST", "/v1/transfers", r#"{"amount":6}"#);
    other.idempotency_key = Some("ks2".to_owned());
    let refused = h.engine.execute(other).await;
    match &refused {
        Execution::Response { response, .. } => assert_eq!(response.status().as_u16(), 422),
        other => panic!(
            "expected 422 idempotency_key_reused, got {}",
            summary(other)
        ),
    }
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 1);
}

// ---- over loopback: the headers and members that name the task ----

const AGENT_TOKEN: &str = "agent-token-cancelled-keys-7c1d";
const OPERATOR_TOKEN: &str = "operator-token-cancelled-keys-3a9e";

fn env(name: &str) -> Option<String> {
    support::agent_oncall_secret(name, AGENT_TOKEN, OPERATOR_TOKEN, "sk-fake-cancelled-1234")
}

async fn start_gateway(base_url: &str, dir: &Path) -> backstop_gateway::server::Running {
    let yaml = support::policy_yaml(
        base_url,
        &format!(
            "{}{}",
            support::RETRYING_CLASSES,
            support::TEST_AGENT_AND_ONCALL
        ),
        r#"    routes:
      "POST /v1/transfers": { class: idempotent_write, scopes: [account] }
"#,
    );
    support::start_gateway(
        &yaml,
        "cancelled.yaml",
        &env,
        support::serve_options(dir, 17),
    )
    .await
}

async fn post(
    gateway: &backstop_gateway::server::Running,
    task: &str,
    key: &str,
) -> reqwest::Response {
    client()
        .post(format!("http://{}/fake/v1/transfers", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("X-Backstop-Task", task)
        .header("Idempotency-Key", key)
        .header("content-type", "application/json")
        .body(r#"{"amount":100}"#)
        .send()
        .await
        .expect("request")
}

fn header<'a>(response: &'a reqwest::Response, name: &str) -> Option<&'a str> {
    response.headers().get(name).and_then(|v| v.to_str().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_http_a_same_key_resend_in_a_cancelled_task_replays_the_finished_write() {
    let fake = support::start_fake(FakeConfig::default().with_route(RouteConfig::new(
        "POST /v1/transfers",
        create("transfers", "tr_"),
    )));
    let dir = tempfile::tempdir().expect("tempdir");
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let base = format!("http://{}", gateway.addr);

    let first = post(&gateway, "tc2", "ks1").await;
    assert_eq!(first.status(), 201);
    let id = support::action_id(&first);
    let (_, created) = json_of(first).await;
    let other = post(&gateway, "ta", "ks2").await;
    assert_eq!(other.status(), 201);
    let other_id = support::action_id(&other);

    let cancelled = client()
        .post(format!("{base}/v1/tasks/tc2/cancel"))
        .bearer_auth(AGENT_TOKEN)
        .send()
        .await
        .expect("cancel");
    assert_eq!(cancelled.status(), 200);

    // The finished write of the cancelled task: replayed, not refused.
    let again = post(&gateway, "tc2", "ks1").await;
    assert_eq!(again.status(), 201);
    assert_eq!(header(&again, "idempotent-replayed"), Some("true"));
    assert_eq!(support::action_id(&again), id);
    assert_eq!(header(&again, "idempotency-key"), Some("ks1"));
    assert_eq!(header(&again, "backstop-task"), Some("tc2"));
    let (_, body) = json_of(again).await;
    assert_eq!(body, created, "the stored response");

    // A resend naming the cancelled task, of a write of another task: that write's task.
    let elsewhere = post(&gateway, "tc2", "ks2").await;
    assert_eq!(elsewhere.status(), 201);
    assert_eq!(header(&elsewhere, "idempotent-replayed"), Some("true"));
    assert_eq!(support::action_id(&elsewhere), other_id);
    assert_eq!(header(&elsewhere, "backstop-task"), Some("ta"));

    // A new action in the cancelled task is refused as before.
    let new = post(&gateway, "tc2", "ks-new").await;
    assert_eq!(new.status(), 410);
    assert_eq!(support::action_id(&new), 0);
    let (_, body): (u16, Value) = json_of(new).await;
    assert_eq!(body["sent"], false, "{body}");

    assert_eq!(
        on_route(&fake.attempts(), "POST", "/v1/transfers").len(),
        2,
        "nothing sent after the first two"
    );
    gateway.shutdown().await.expect("shutdown");
    fake.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_gateway_outcome_of_a_write_taken_over_from_another_task_names_the_writes_task() {
    let h = Harness::new();
    h.transport.script(
        "/v1/transfers",
        vec![answer(429, &[("retry-after", "11")], "")],
    );
    let mut first = transfer(&h, "ta", "ks4");
    first.max_wait = Some(std::time::Duration::ZERO);
    let told = h.engine.execute(first).await;
    assert_eq!(summary(&told), "budget_exhausted");
    let id = told.receipt().action_id;
    advance(std::time::Duration::from_secs(12)).await;
    // The resend's deadline has passed: it is refused before its send.
    let mut resend = transfer(&h, "tb", "ks4");
    resend.deadline = Some(h.clock_now() - jiff::SignedDuration::from_secs(1));
    let refused = h.engine.execute(resend).await;
    assert_ne!(summary(&refused), "200", "{refused:?}");
    assert!(matches!(refused, Execution::Outcome { .. }), "{refused:?}");
    assert_eq!(
        refused.receipt().action_id,
        id,
        "the same action, taken over"
    );
    assert_eq!(refused.receipt().task.as_deref(), Some("ta"));
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 1);
}

/// The write of task `ta` under `key`, told to come back (`429`, `Prefer: wait=0`), then taken
/// over after the advised instant by a same-key resend naming task `tb`, which waits for its
/// scope (a `429` on a read holds it). Returns the action id and the resend's handle.
async fn taken_over_from_ta_by_tb(
    h: &Harness,
    key: &str,
) -> (i64, tokio::task::JoinHandle<Execution>) {
    h.transport.script(
        "/v1/transfers",
        vec![
            answer(429, &[("retry-after", "11")], ""),
            answer(201, &[], r#"{"id":"tr_7"}"#),
        ],
    );
    // The task the resend names exists.
    let _ = h.engine.execute(h.get("tb", "/v1/items/2")).await;
    let mut first = transfer(h, "ta", key);
    first.max_wait = Some(std::time::Duration::ZERO);
    let told = h.engine.execute(first).await;
    assert_eq!(summary(&told), "budget_exhausted");
    let id = told.receipt().action_id;
    advance(std::time::Duration::from_secs(12)).await;
    h.transport.script(
        "/v1/items/1",
        vec![answer(429, &[("retry-after", "30")], "")],
    );
    let _throttled = h.spawn(h.get("t-read", "/v1/items/1"));
    advance(std::time::Duration::from_millis(100)).await;
    let resending = h.spawn(transfer(h, "tb", key));
    assert!(
        until(|| h
            .store
            .action(backstop_store::ActionId(id))
            .unwrap()
            .unwrap()
            .state
            == backstop_store::ActionState::Reopened)
        .await,
        "reopened by the resend"
    );
    advance(std::time::Duration::from_millis(100)).await;
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 1, "waiting");
    (id, resending)
}

#[tokio::test(start_paused = true)]
async fn cancelling_its_own_task_stops_a_write_a_resend_of_another_task_took_over() {
    let h = Harness::new();
    let (id, resending) = taken_over_from_ta_by_tb(&h, "ks5").await;
    let cancelled_at = h.clock_now();
    let report = h.engine.cancel_task("ta", "agent-a").await.unwrap();
    assert_eq!(
        report.waiting_dropped, 1,
        "its attempt waits under its own task: {report:?}"
    );
    assert_eq!(report.actions_cancelled, 1, "{report:?}");
    let answered = resending.await.unwrap();
    assert_eq!(summary(&answered), "cancelled", "{answered:?}");
    assert_eq!(answered.receipt().action_id, id);
    assert_eq!(answered.receipt().task.as_deref(), Some("ta"));
    assert_eq!(
        h.clock_now(),
        cancelled_at,
        "dropped at once, not when its scope opened"
    );
    advance(std::time::Duration::from_secs(60)).await;
    assert_eq!(
        h.transport.sent_to("/v1/transfers").len(),
        1,
        "never sent again"
    );
}

#[tokio::test(start_paused = true)]
async fn cancelling_the_task_a_resend_names_leaves_the_write_of_another_task_it_took_over() {
    let h = Harness::new();
    let (id, resending) = taken_over_from_ta_by_tb(&h, "ks6").await;
    let report = h.engine.cancel_task("tb", "agent-a").await.unwrap();
    assert_eq!(
        (report.waiting_dropped, report.actions_cancelled),
        (0, 0),
        "nothing of task tb waits: {report:?}"
    );
    // Its scope opens: the write is sent, under its own task.
    advance(std::time::Duration::from_secs(31)).await;
    let answered = resending.await.unwrap();
    assert_eq!(summary(&answered), "201", "{answered:?}");
    assert_eq!(answered.receipt().action_id, id);
    assert_eq!(answered.receipt().task.as_deref(), Some("ta"));
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 2);
    let record = h
        .store
        .action(backstop_store::ActionId(id))
        .unwrap()
        .unwrap();
    assert_eq!(record.outcome, Some(backstop_store::Outcome::Succeeded));
}
