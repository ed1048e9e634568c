//! The store failing and the gateway stopping are answered as what they are: `503
//! store_unavailable` / `503 shutting_down`, saying whether anything was sent, never `410
//! cancelled`; what the store could not record is not left waiting once it works again (a write
//! whose last attempt was uncertain reconciled, never cancelled, its lookup asked once), nor is
//! a write whose same-key resend took it over and lost its caller while reading it, and what it
//! lost is logged once. A store failing during a stop, after a write was sent, still tells the
//! caller what the next start does with it (`after_restart`), and that it cannot be known when
//! the store does not say what it kept; the restart then does what was said. Attempts are
//! measured at the scripted transport or at the fake provider, answers at the door where the
//! header or the JSON matters.

use std::{sync::Arc, time::Duration};

use backstop_core::{
    classify::TransportError, escalation::DecisionEffect, pacing::Priority, policy::Policy,
};
use backstop_fake_api::{FakeConfig, Fault, FaultRule, RouteConfig};
use backstop_gateway::{
    action::{ActionSpec, Execution},
    clock::TokioClock,
    engine::{Engine, STORE_FAILED_BEFORE_RETRY},
    metrics::Metrics,
    server,
    transport::AttemptRequest,
    upstream::{Upstream, UpstreamConfig},
    watchdog::{Watchdog, WatchdogConfig},
};
use backstop_store::{
    ActionId, ActionRecord, ActionState, Outcome, PayloadDigest, SqliteStore, Store,
};
use jiff::SignedDuration;
use serde_json::Value;

use crate::{
    engine_support::{
        advance, answer,
        failing_store::{FailingStore, FIRST_LOST_READ},
        held_ok, summary, until, Harness, Step,
    },
    support::{self, capture::Capture},
};

/// Status, `x-should-retry`, and the problem body of an answer made as a problem response.
async fn problem(execution: Execution) -> (u16, String, Value, u32) {
    match execution {
        Execution::Response { response, receipt } => {
            let status = response.status().as_u16();
            let retry = response
                .headers()
                .get("x-should-retry")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_owned();
            let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
                .await
                .unwrap();
            let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            (status, retry, body, receipt.attempts)
        }
        Execution::Outcome {
            outcome, detail, ..
        } => panic!("expected a problem response, got outcome {outcome}: {detail}"),
        Execution::InFlight { .. } => panic!("expected a problem response, got a key in flight"),
    }
}

fn write(h: &Harness, task: &str, key: &str) -> backstop_gateway::action::ActionSpec {
    let mut spec = h.spec(task, "POST", "/v1/transfers", r#"{"amount":5}"#);
    spec.idempotency_key = Some(key.to_owned());
    spec
}

#[tokio::test(start_paused = true)]
async fn a_failing_store_answers_503_store_unavailable_for_a_read_and_nothing_is_sent() {
    let (h, store) = Harness::with_failing_store();
    h.transport
        .script("/v1/items/1", vec![answer(200, &[], "ok")]);
    store.fail();
    let (status, retry, body, attempts) =
        problem(h.engine.execute(h.get("t", "/v1/items/1")).await).await;
    assert_eq!(status, 503);
    assert!(
        body["type"]
            .as_str()
            .unwrap_or("")
            .ends_with(":store_unavailable"),
        "{body}"
    );
    assert_eq!(body["sent"], false);
    assert_eq!(retry, "true", "nothing was sent: a retry is safe");
    assert_eq!(attempts, 0);
    let detail = body["detail"].as_str().unwrap_or("");
    assert!(
        !detail.contains("sqlite"),
        "internals leak into the detail: {detail}"
    );
    assert!(h.transport.sent().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_write_the_store_cannot_record_is_503_and_never_sent() {
    let (h, store) = Harness::with_failing_store();
    h.transport
        .script("/v1/transfers", vec![answer(201, &[], "{}")]);
    store.fail();
    let (status, retry, body, _) = problem(h.engine.execute(write(&h, "t", "k-1")).await).await;
    assert_eq!(status, 503);
    assert_eq!(body["sent"], false);
    assert_eq!(retry, "true");
    assert!(h.transport.sent().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_store_failure_after_an_attempt_was_sent_does_not_invite_a_retry() {
    let (h, store) = Harness::with_failing_store();
    h.transport.script(
        "/v1/transfers",
        vec![
            answer(503, &[("retry-after", "5")], ""),
            answer(201, &[], "{}"),
        ],
    );
    let running = h.spawn(write(&h, "t", "k-1"));
    assert!(
        until(|| h.transport.sent().len() == 1).await,
        "the first attempt left"
    );
    // The retry is scheduled durably before the store fails.
    assert!(until(|| h.store.scheduled_retries().is_ok_and(|r| r.len() == 1)).await);
    store.fail();
    advance(Duration::from_secs(30)).await;
    let (status, retry, body, attempts) = problem(running.await.unwrap()).await;
    assert_eq!(status, 503);
    assert_eq!(body["sent"], true);
    assert_eq!(
        retry, "false",
        "an attempt was sent: the agent must check first"
    );
    assert_eq!(attempts, 1);
    assert_eq!(
        h.transport.sent().len(),
        1,
        "the retry did not leave unrecorded"
    );
}

#[tokio::test(start_paused = true)]
async fn a_caller_waiting_before_its_first_attempt_gets_503_shutting_down_at_stop() {
    let h = Harness::new();
    // The one slot of `single` is held by the first read; the second waits for it.
    h.transport
        .script("/v1/slow/1", vec![held_ok(Duration::from_secs(60))]);
    h.transport
        .script("/v1/slow/2", vec![answer(200, &[], "ok")]);
    let _holding = h.spawn(h.get("t", "/v1/slow/1"));
    assert!(until(|| h.transport.sent_to("/v1/slow/1").len() == 1).await);
    let waiting = h.spawn(h.get("t", "/v1/slow/2"));
    // Give the second read time to reach the scheduler's queue (it cannot be sent meanwhile).
    let mut polls = 0;
    until(|| {
        polls += 1;
        polls > 50
    })
    .await;
    assert!(h.transport.sent_to("/v1/slow/2").is_empty());
    h.engine.shutdown().await;
    let (status, retry, body, attempts) = problem(waiting.await.unwrap()).await;
    assert_eq!(status, 503);
    assert!(
        body["type"]
            .as_str()
            .unwrap_or("")
            .ends_with("shutting_down"),
        "{body}"
    );
    assert_eq!(body["sent"], false);
    assert_eq!(retry, "true");
    assert_eq!(attempts, 0);
    // What identifies the request, as in every other answer for an action (a read has no key).
    assert_eq!(body["task"], "t", "{body}");
    assert!(
        body["action_id"].as_i64().is_some_and(|id| id > 0),
        "{body}"
    );
    assert!(body.get("idempotency_key").is_none(), "{body}");
    assert!(h.transport.sent_to("/v1/slow/2").is_empty());
    // New work after the stop is refused the same way.
    let (status, retry, _, _) = problem(h.engine.execute(h.get("t", "/v1/items/1")).await).await;
    assert_eq!((status, retry.as_str()), (503, "true"));
}

#[tokio::test(start_paused = true)]
async fn work_arriving_after_the_stop_is_answered_with_its_task_and_a_writes_key() {
    let h = Harness::new();
    h.engine.shutdown().await;

    // A write with the agent's key: the answer names the task and that key.
    let answered = h.engine.execute(write(&h, "t-late", "k-late")).await;
    assert_eq!(
        answered.receipt().idempotency_key.as_deref(),
        Some("k-late")
    );
    assert_eq!(answered.receipt().action_id, 0, "nothing was recorded");
    let (status, retry, body, attempts) = problem(answered).await;
    assert_eq!(status, 503);
    assert!(
        body["type"]
            .as_str()
            .unwrap_or("")
            .ends_with("shutting_down"),
        "{body}"
    );
    assert_eq!((retry.as_str(), attempts), ("true", 0));
    assert_eq!(body["sent"], false, "{body}");
    assert_eq!(body["task"], "t-late", "{body}");
    assert_eq!(body["idempotency_key"], "k-late", "{body}");
    assert!(
        body.get("action_id").is_none(),
        "nothing was recorded: {body}"
    );

    // A write without one: the key minted for it, the same in the receipt and the body.
    let answered = h
        .engine
        .execute(h.spec("t-late", "POST", "/v1/transfers", r#"{"amount":5}"#))
        .await;
    let minted = answered
        .receipt()
        .idempotency_key
        .clone()
        .expect("a write's answer carries a key");
    let (status, _, body, _) = problem(answered).await;
    assert_eq!(status, 503);
    assert_eq!(body["idempotency_key"], minted.as_str(), "{body}");
    assert_eq!(body["task"], "t-late", "{body}");

    // A read: the task, no key.
    let answered = h.engine.execute(h.get("t-read", "/v1/items/1")).await;
    assert_eq!(answered.receipt().idempotency_key, None);
    let (status, _, body, _) = problem(answered).await;
    assert_eq!(status, 503);
    assert_eq!(body["task"], "t-read", "{body}");
    assert!(body.get("idempotency_key").is_none(), "{body}");
    assert!(h.transport.sent().is_empty(), "nothing was sent");
    assert!(
        h.audit()
            .iter()
            .all(|e| e.task.as_deref() != Some("t-late")),
        "nothing was recorded"
    );
}

#[tokio::test(start_paused = true)]
async fn a_write_waiting_for_its_retry_at_stop_stays_recorded_and_is_not_invited_to_resend() {
    let h = Harness::new();
    h.transport.script(
        "/v1/transfers",
        vec![answer(503, &[("retry-after", "20")], "")],
    );
    let running = h.spawn(write(&h, "t", "k-9"));
    assert!(until(|| h.transport.sent().len() == 1).await);
    assert!(until(|| h.store.scheduled_retries().is_ok_and(|r| r.len() == 1)).await);
    let action = h.store.scheduled_retries().unwrap()[0].action;
    h.engine.shutdown().await;
    let answered = running.await.unwrap();
    assert_eq!(answered.receipt().idempotency_key.as_deref(), Some("k-9"));
    let (status, retry, body, attempts) = problem(answered).await;
    assert_eq!(status, 503);
    assert_eq!(body["sent"], true);
    assert_eq!(retry, "false");
    assert_eq!(attempts, 1);
    assert_eq!(body["task"], "t", "{body}");
    assert_eq!(body["idempotency_key"], "k-9", "{body}");
    assert_eq!(body["action_id"], action.0, "{body}");
    let scheduled = h.store.scheduled_retries().unwrap();
    assert_eq!(
        scheduled.len(),
        1,
        "the retry stays in the store for after the restart"
    );
}

/// A write whose retry was scheduled when the gateway stopped keeps its request in the store:
/// the next start re-arms the retry and, when it falls due, sends it under the SAME key from
/// the kept request — nobody waits for it, and it is finished all the same.
#[tokio::test(start_paused = true)]
async fn a_retry_re_armed_after_a_restart_is_sent_from_the_kept_request_under_its_key() {
    let h = Harness::new();
    h.transport.script(
        "/v1/transfers",
        vec![answer(503, &[("retry-after", "20")], "")],
    );
    let running = h.spawn(write(&h, "t", "k-r"));
    assert!(until(|| h.transport.sent().len() == 1).await);
    assert!(until(|| h.store.scheduled_retries().is_ok_and(|r| r.len() == 1)).await);
    let due = h.store.scheduled_retries().unwrap()[0].due_at;
    h.engine.shutdown().await;
    let action = running.await.unwrap().receipt().action_id;
    let restarted = h.restarted(7);
    advance(Duration::from_secs(30)).await;
    let stored = || {
        h.store
            .action(backstop_store::ActionId(action))
            .unwrap()
            .unwrap()
    };
    assert!(
        until(|| stored().outcome.is_some()).await,
        "the re-armed retry finished the write"
    );
    assert_eq!(stored().outcome, Some(backstop_store::Outcome::Succeeded));
    let sent = h.transport.sent();
    assert_eq!(sent.len(), 2, "the retry was sent once after the restart");
    assert_eq!(
        sent[0].idempotency_key, sent[1].idempotency_key,
        "under the same key"
    );
    assert!(sent[1].at >= due, "not before its retry fell due");
    assert_eq!(
        h.store
            .attempts(backstop_store::ActionId(action))
            .unwrap()
            .len(),
        2
    );
    assert!(h.store.scheduled_retries().unwrap().is_empty());
    assert_eq!(
        h.store
            .kept_request(backstop_store::ActionId(action))
            .unwrap(),
        None,
        "the kept request is gone with the write's end"
    );
    restarted.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_retry_re_armed_after_a_restart_while_the_store_fails_is_closed_once_it_commits_again() {
    let (h, store) = Harness::with_failing_store();
    h.transport.script(
        "/v1/transfers",
        vec![answer(503, &[("retry-after", "20")], "")],
    );
    let running = h.spawn(write(&h, "t", "k-rf"));
    assert!(until(|| h.transport.sent().len() == 1).await);
    assert!(until(|| h.store.scheduled_retries().is_ok_and(|r| r.len() == 1)).await);
    h.engine.shutdown().await;
    let action = running.await.unwrap().receipt().action_id;
    let stored = || {
        h.store
            .action(backstop_store::ActionId(action))
            .unwrap()
            .unwrap()
    };
    // The next run starts while the store cannot commit: the re-armed retry cannot be claimed.
    store.fail();
    let restarted = backstop_gateway::engine::Engine::new(
        h.policy.clone(),
        store.clone(),
        h.transport.clone(),
        h.clock,
        h.metrics.clone(),
        8,
    );
    advance(Duration::from_secs(30)).await;
    assert_eq!(stored().outcome, None, "nothing could be recorded yet");
    store.recover();
    advance(Duration::from_secs(120)).await;
    assert!(
        until(|| stored().outcome.is_some()).await,
        "the action is closed once the store commits again, not left waiting"
    );
    let record = stored();
    assert_eq!(record.outcome, Some(backstop_store::Outcome::Cancelled));
    let context = record.outcome_context.unwrap();
    assert_eq!(
        context["detail"],
        backstop_gateway::engine::RESTARTED_BEFORE_RETRY
    );
    assert_eq!(context["attempts"], 1);
    assert_eq!(context["sent"], true);
    assert_eq!(context["last_status"], 503, "{context}");
    assert!(h.store.scheduled_retries().unwrap().is_empty());
    // The store could not resume it from its kept request, so it was cancelled; a same-key
    // resend reopens it (nothing it was answered binds the key) and sends it, once.
    let again = restarted.execute(write(&h, "t", "k-rf")).await;
    assert_eq!(summary(&again), "200");
    assert_eq!(again.receipt().action_id, action);
    assert_eq!(h.transport.sent().len(), 2, "sent once more");
    restarted.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_retry_due_while_the_store_fails_is_closed_once_the_store_commits_again() {
    let (h, store) = Harness::with_failing_store();
    h.transport.script(
        "/v1/transfers",
        vec![
            answer(503, &[("retry-after", "5")], ""),
            answer(201, &[], "{}"),
        ],
    );
    let running = h.spawn(write(&h, "t", "k-1"));
    assert!(until(|| h.transport.sent().len() == 1).await);
    assert!(until(|| h.store.scheduled_retries().is_ok_and(|r| r.len() == 1)).await);
    let action = h.store.scheduled_retries().unwrap()[0].action;
    // The retry comes due while the store cannot commit: its start is not recorded, so it is
    // not sent, and the caller is told an earlier attempt was.
    store.fail();
    advance(Duration::from_secs(30)).await;
    let answered = running.await.unwrap();
    assert_eq!(answered.receipt().action_id, action.0);
    let (status, retry, body, attempts) = problem(answered).await;
    assert_eq!((status, retry.as_str(), attempts), (503, "false", 1));
    assert_eq!(body["sent"], true);
    let stored = || h.store.action(action).unwrap().unwrap();
    assert_eq!(stored().outcome, None, "nothing can be recorded yet");

    store.recover();
    advance(Duration::from_secs(120)).await;
    assert!(
        until(|| stored().outcome.is_some()).await,
        "the action is closed once the store commits again, not left waiting"
    );
    let record = stored();
    assert_eq!(record.outcome, Some(Outcome::Cancelled));
    let context = record.outcome_context.unwrap();
    assert_eq!(context["detail"], STORE_FAILED_BEFORE_RETRY);
    assert_eq!(context["attempts"], 1);
    assert_eq!(context["sent"], true);
    assert!(
        h.store.scheduled_retries().unwrap().is_empty(),
        "no retry job is left past due"
    );
    let mut watchdog = Watchdog::new(
        h.store.clone(),
        h.metrics.clone(),
        WatchdogConfig::default(),
    );
    let findings = watchdog.check(h.clock_now()).unwrap();
    assert!(findings.iter().all(|f| f.action != action), "{findings:?}");
    // A resend under the same key (not 409 in flight): the cancelled write bound nothing at
    // the provider, so the resend reopens the same action and sends it once.
    let again = h.engine.execute(write(&h, "t", "k-1")).await;
    assert_eq!(summary(&again), "201");
    assert_eq!(again.receipt().action_id, action.0);
    assert_eq!(h.transport.sent().len(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_write_whose_first_send_the_store_could_not_record_is_sent_by_its_same_key_resend() {
    let (h, store) = Harness::with_failing_store();
    h.transport
        .script("/v1/transfers", vec![answer(201, &[], "{}")]);
    store.fail_sends();
    let answered = h.engine.execute(write(&h, "t", "k-2")).await;
    let action = answered.receipt().action_id;
    assert_ne!(action, 0, "the write was recorded");
    let (status, retry, body, attempts) = problem(answered).await;
    assert_eq!((status, retry.as_str(), attempts), (503, "true", 0));
    assert_eq!(body["sent"], false);
    assert!(h.transport.sent().is_empty());

    store.recover();
    let again = h.engine.execute(write(&h, "t", "k-2")).await;
    assert_eq!(summary(&again), "201", "sent, not refused as in flight");
    assert_eq!(again.receipt().action_id, action, "as the same action");
    assert_eq!(h.transport.sent().len(), 1);
}

/// A same-key resend takes over a write whose first send the store could not record, and its
/// own caller goes away while the write's earlier attempts are read: nothing was sent, so the
/// write ends `cancelled` under its key as a write whose caller leaves before its first send
/// does — not left `requested`, its key answering `409 in flight` to every later resend.
#[tokio::test(start_paused = true)]
async fn a_resend_taking_over_an_unsent_write_whose_caller_leaves_while_it_reads_the_attempts_cancels_it(
) {
    let (h, store) = Harness::with_failing_store();
    store.fail_sends();
    let answered = h.engine.execute(write(&h, "t", "k-5")).await;
    let action = ActionId(answered.receipt().action_id);
    assert_ne!(action.0, 0, "the write was recorded");
    assert_eq!(summary(&answered), "503");
    store.recover();

    store.hold_attempts();
    let resend = tokio::spawn({
        let (engine, spec) = (h.engine.clone(), write(&h, "t", "k-5"));
        async move { engine.execute(spec).await }
    });
    assert!(
        until(|| store.attempts_held() == 1).await,
        "the resend takes the write over and reads its attempts"
    );
    resend.abort();
    let _ = resend.await;
    store.release_attempts();

    let outcome = || stored(&h, action).outcome;
    assert!(until(|| outcome().is_some()).await, "the write is closed");
    assert_eq!(outcome(), Some(Outcome::Cancelled));
    // Not 409 in flight: the resend reopens the cancelled write (nothing was sent for it) and
    // sends it, as the same action.
    let again = h.engine.execute(write(&h, "t", "k-5")).await;
    assert_eq!(summary(&again), "200", "reopened, not 409 in flight");
    assert_eq!(again.receipt().action_id, action.0);
    assert_eq!(h.transport.sent().len(), 1, "sent once");
}

/// The same window for a write an operator reopened (`retry_same_key` after a restart, so the
/// agent resubmits under the same key): its last attempt was uncertain, so when the
/// resubmission's caller goes away while the attempts are read the write is reconciled with its
/// original key — escalated again, never `cancelled` — as when its caller leaves later, before
/// the new send.
#[tokio::test(start_paused = true)]
async fn a_resubmission_taking_over_a_reopened_write_whose_caller_leaves_while_it_reads_the_attempts_reconciles_it(
) {
    let (h, store) = Harness::with_failing_store();
    h.transport.script(
        "/v1/transfers",
        vec![Step::Fail(TransportError::TimeoutAfterSend)],
    );
    let mut first = write(&h, "t", "k-6");
    first.single_attempt = true;
    let escalated = h.engine.execute(first).await;
    assert_eq!(summary(&escalated), "escalated", "{escalated:?}");
    let action = ActionId(escalated.receipt().action_id);
    h.engine.shutdown().await;
    let engine = Engine::new(
        h.policy.clone(),
        store.clone(),
        h.transport.clone(),
        h.clock,
        h.metrics.clone(),
        5,
    );
    let escalation = h.store.open_escalations().unwrap()[0].id;
    let at = h.clock_now();
    h.store
        .decide_escalation(escalation, "retry_same_key", "operator", None, at)
        .unwrap();
    let effect = DecisionEffect::RetrySameKey {
        idempotency_key: "k-6".to_owned(),
    };
    let applied = engine.apply_decision(action, &effect, "operator").await;
    assert!(applied.request_not_held, "{}", applied.detail);

    store.hold_attempts();
    let resubmitted = tokio::spawn({
        let (engine, spec) = (engine.clone(), write(&h, "t", "k-6"));
        async move { engine.execute(spec).await }
    });
    assert!(
        until(|| store.attempts_held() == 1).await,
        "the resubmission takes the write over and reads its attempts"
    );
    resubmitted.abort();
    let _ = resubmitted.await;
    store.release_attempts();

    let outcome = || stored(&h, action).outcome;
    assert!(until(|| outcome().is_some()).await, "the write is closed");
    assert_eq!(
        outcome(),
        Some(Outcome::Escalated),
        "reconciled, not cancelled"
    );
    let escalations = h.store.open_escalations().unwrap();
    let case = &escalations
        .iter()
        .find(|e| e.action == action)
        .expect("a new escalation for the write")
        .case_file;
    let detail = case["reason_detail"].as_str().unwrap_or("");
    assert!(detail.contains("client disconnected"), "{detail}");
    assert_eq!(
        h.transport.sent_to("/v1/transfers").len(),
        1,
        "the write was never sent again"
    );
    engine.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_503_store_unavailable_for_a_recorded_write_names_its_action_task_and_key() {
    let (h, store) = Harness::with_failing_store();
    store.fail_sends();
    let answered = h.engine.execute(write(&h, "run-recorded", "k-4")).await;
    let action = answered.receipt().action_id;
    assert_eq!(answered.receipt().idempotency_key.as_deref(), Some("k-4"));
    let (status, _, body, _) = problem(answered).await;
    assert_eq!(status, 503);
    assert_eq!(body["action_id"], action);
    assert_eq!(body["task"], "run-recorded");
    assert_eq!(body["idempotency_key"], "k-4");
}

#[tokio::test(start_paused = true)]
async fn a_write_the_store_cannot_record_is_answered_with_its_task_and_key_and_logged_without_an_action(
) {
    let (logs, _attached) = Capture::this_thread();
    let (h, store) = Harness::with_failing_store();
    store.fail();
    let execution = h.engine.execute(write(&h, "run-unrecorded", "k-3")).await;
    assert_eq!(execution.receipt().idempotency_key.as_deref(), Some("k-3"));
    let (status, _, body, _) = problem(execution).await;
    assert_eq!(status, 503);
    assert_eq!(body["task"], "run-unrecorded");
    assert_eq!(body["idempotency_key"], "k-3");
    assert!(body.get("action_id").is_none(), "no action exists: {body}");
    // A write without a key: the key minted for it is told, as for every other answer.
    let mut minted = write(&h, "run-unrecorded", "unused");
    minted.idempotency_key = None;
    let execution = h.engine.execute(minted).await;
    let key = execution
        .receipt()
        .idempotency_key
        .clone()
        .expect("the minted key");
    let (_, _, body, _) = problem(execution).await;
    assert_eq!(body["idempotency_key"], key.as_str());

    let lines: Vec<String> = logs
        .lines_at("ERROR")
        .into_iter()
        .filter(|l| l.contains("store_unavailable"))
        .collect();
    assert_eq!(lines.len(), 2, "{lines:#?}");
    for line in &lines {
        assert!(line.contains("task=run-unrecorded"), "{line}");
        assert!(!line.contains("action="), "no action to name: {line}");
        assert!(line.contains("no action exists"), "{line}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_read_whose_records_are_lost_is_logged_once_at_error_with_what_identifies_it() {
    let (logs, _attached) = Capture::this_thread();
    let (h, store) = Harness::with_failing_store();
    h.transport
        .script("/v1/items/4", vec![answer(200, &[], "ok")]);
    store.lose_reads();
    let execution = h
        .engine
        .execute(h.get("run-lost-read", "/v1/items/4"))
        .await;
    assert_eq!(
        summary(&execution),
        "200",
        "the read is answered all the same"
    );
    assert_eq!(execution.receipt().action_id, FIRST_LOST_READ);

    let errors = logs.lines_at("ERROR");
    assert_eq!(errors.len(), 1, "one loss, one error: {errors:#?}");
    let line = &errors[0];
    for field in [
        format!("action={FIRST_LOST_READ}"),
        "task=run-lost-read".to_owned(),
        "agent=agent-a".to_owned(),
        "route=/v1/items/{id}".to_owned(),
    ] {
        assert!(line.contains(&field), "{field} missing: {line}");
    }
    // The read's other records went with the same commit: told at DEBUG only.
    let further = logs
        .lines_at("DEBUG")
        .into_iter()
        .filter(|l| l.contains("task=run-lost-read") && l.contains("not committed"))
        .count();
    assert_eq!(further, 2, "{}", logs.text());
}

/// Reads action `id` from the real store beneath the failing one.
fn stored(h: &Harness, id: ActionId) -> ActionRecord {
    h.store.action(id).unwrap().unwrap()
}

/// Runs `write` while only scheduling a retry fails: its first attempt gets `first`, the retry
/// cannot be scheduled, and the caller is answered 503 with `sent: true`. Returns the action,
/// left `attempted` with no retry job.
async fn unscheduled_retry(h: &Harness, store: &FailingStore, first: Step, key: &str) -> ActionId {
    h.transport
        .script("/v1/transfers", vec![first, answer(201, &[], "{}")]);
    store.fail_schedules();
    let answered = h.engine.execute(write(h, "t", key)).await;
    let action = ActionId(answered.receipt().action_id);
    let (status, retry, body, attempts) = problem(answered).await;
    assert_eq!((status, retry.as_str(), attempts), (503, "false", 1));
    assert_eq!(body["sent"], true);
    assert_eq!(h.transport.sent().len(), 1, "the retry did not leave");
    assert_eq!(stored(h, action).state, ActionState::Attempted);
    assert!(h.store.scheduled_retries().unwrap().is_empty());
    action
}

#[tokio::test(start_paused = true)]
async fn a_result_the_store_could_not_record_before_a_retry_it_scheduled_is_recorded_and_the_retry_goes(
) {
    // The store fails once, on the first attempt's result, and works again when the retry is
    // scheduled: the result is recorded then, so the retry may send, instead of being refused
    // as "an attempt still in flight" and the write ending `cancelled`.
    let (h, store) = Harness::with_failing_store();
    h.transport.script(
        "/v1/transfers",
        vec![
            answer(503, &[("retry-after", "5")], ""),
            answer(201, &[], "{}"),
        ],
    );
    store.fail_next_result();
    let answered = h.engine.execute(write(&h, "t", "k-r1")).await;
    let action = ActionId(answered.receipt().action_id);
    assert_eq!(summary(&answered), "201");
    assert_eq!(h.transport.sent().len(), 2, "the retry left once");
    let record = stored(&h, action);
    assert_eq!(record.outcome, Some(Outcome::Succeeded));
    let attempts = h.store.attempts(action).unwrap();
    assert_eq!(attempts.len(), 2);
    assert_eq!(
        attempts[0].status,
        Some(503),
        "the first result is recorded"
    );
}

#[tokio::test(start_paused = true)]
async fn a_retry_the_store_could_not_schedule_is_closed_once_the_store_commits_again() {
    let (h, store) = Harness::with_failing_store();
    let first = answer(503, &[("retry-after", "5")], "");
    let action = unscheduled_retry(&h, &store, first, "k-s1").await;
    // Now nothing commits: the action cannot be closed yet.
    store.fail();
    advance(Duration::from_secs(30)).await;
    assert_eq!(stored(&h, action).outcome, None);

    store.recover();
    advance(Duration::from_secs(120)).await;
    assert!(
        until(|| stored(&h, action).outcome.is_some()).await,
        "the action is closed once the store commits again, not left attempted"
    );
    let record = stored(&h, action);
    assert_eq!(record.outcome, Some(Outcome::Cancelled));
    let context = record.outcome_context.unwrap();
    assert_eq!(context["detail"], STORE_FAILED_BEFORE_RETRY);
    assert_eq!(context["attempts"], 1);
    assert_eq!(context["sent"], true);
    assert_eq!(
        context["next_safe"],
        serde_json::json!([{"option": "abort"}])
    );
    // A resend under the same key, not 409 in flight: it reopens the same action and sends it.
    let again = h.engine.execute(write(&h, "t", "k-s1")).await;
    assert_eq!(summary(&again), "201");
    assert_eq!(again.receipt().action_id, action.0);
    assert_eq!(h.transport.sent().len(), 2);
}

#[tokio::test(start_paused = true)]
async fn an_uncertain_write_whose_retry_the_store_could_not_schedule_is_reconciled_not_resent() {
    let (h, store) = Harness::with_failing_store();
    // The provider honours keys and the route has no lookup: the running gateway would resend
    // under the same key, but the payload goes with the 503.
    let first = Step::Fail(TransportError::TimeoutAfterSend);
    let action = unscheduled_retry(&h, &store, first, "k-s2").await;
    store.fail();
    advance(Duration::from_secs(30)).await;
    assert_eq!(stored(&h, action).outcome, None);

    store.recover();
    advance(Duration::from_secs(120)).await;
    assert!(
        until(|| stored(&h, action).outcome.is_some()).await,
        "the write is reconciled once the store commits again"
    );
    assert_eq!(stored(&h, action).outcome, Some(Outcome::Escalated));
    let escalations = h.store.open_escalations().unwrap();
    let escalation = escalations
        .iter()
        .find(|e| e.action == action)
        .expect("an escalation for the write");
    assert_eq!(escalation.case_file["reason"], "side_effect_unknown");
    let detail = escalation.case_file["reason_detail"].as_str().unwrap_or("");
    assert!(detail.contains("503 store_unavailable"), "{detail}");
    assert_eq!(h.transport.sent().len(), 1, "the write was never resent");
    let again = h.engine.execute(write(&h, "t", "k-s2")).await;
    assert_eq!(summary(&again), "escalated");
    assert_eq!(h.transport.sent().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_retry_the_store_could_not_schedule_is_closed_by_the_next_start() {
    let (h, store) = Harness::with_failing_store();
    let first = answer(503, &[("retry-after", "5")], "");
    let action = unscheduled_retry(&h, &store, first, "k-s3").await;
    store.fail();
    h.engine.shutdown().await;
    advance(Duration::from_secs(5)).await;
    assert_eq!(stored(&h, action).outcome, None);

    // The next run over the same (working) store finds the action and finishes it from its
    // kept request, under its key.
    let restarted = h.restarted(5);
    assert!(
        until(|| stored(&h, action).outcome.is_some()).await,
        "the next start finishes the action"
    );
    assert_eq!(stored(&h, action).outcome, Some(Outcome::Succeeded));
    let sent = h.transport.sent();
    assert_eq!(sent.len(), 2);
    assert_eq!(sent[0].idempotency_key, sent[1].idempotency_key);
    let again = restarted.execute(write(&h, "t", "k-s3")).await;
    assert_eq!(summary(&again), "201", "a resend is the write's replay");
    assert_eq!(h.transport.sent().len(), 2);
    restarted.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn an_uncertain_write_whose_retry_the_store_could_not_schedule_is_reconciled_by_the_next_start(
) {
    let (h, store) = Harness::with_failing_store();
    let first = Step::Fail(TransportError::TimeoutAfterSend);
    let action = unscheduled_retry(&h, &store, first, "k-s4").await;
    store.fail();
    h.engine.shutdown().await;
    advance(Duration::from_secs(5)).await;

    // The route has no lookup and the provider honours keys: the SPEC §6 rule resends under
    // the same key, which the kept request now allows after a restart too.
    let restarted = h.restarted(5);
    assert!(
        until(|| stored(&h, action).outcome.is_some()).await,
        "the next start finishes the write"
    );
    assert_eq!(stored(&h, action).outcome, Some(Outcome::Succeeded));
    assert!(!h
        .store
        .open_escalations()
        .unwrap()
        .iter()
        .any(|e| e.action == action));
    let sent = h.transport.sent();
    assert_eq!(sent.len(), 2, "resent once, under its key");
    assert_eq!(sent[0].idempotency_key, sent[1].idempotency_key);
    restarted.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn an_outcome_the_store_could_not_record_is_logged_and_recorded_once_it_commits_again() {
    let (logs, _attached) = Capture::this_thread();
    let (h, store) = Harness::with_failing_store();
    store.fail_outcomes();
    // Past its deadline: refused before any attempt, with a gateway-made outcome.
    let mut late = write(&h, "t-late", "k-o1");
    late.deadline = Some(h.t0 - SignedDuration::from_secs(1));
    let answered = h.engine.execute(late.clone()).await;
    assert_eq!(summary(&answered), "deadline_exhausted");
    let action = ActionId(answered.receipt().action_id);
    assert_eq!(
        stored(&h, action).outcome,
        None,
        "nothing can be recorded yet"
    );
    let warned = logs
        .lines_at("WARN")
        .into_iter()
        .any(|l| l.contains(&format!("action={}", action.0)) && l.contains("outcome"));
    assert!(warned, "{}", logs.text());
    advance(Duration::from_secs(30)).await;
    assert_eq!(stored(&h, action).outcome, None);

    store.recover();
    advance(Duration::from_secs(120)).await;
    assert!(
        until(|| stored(&h, action).outcome.is_some()).await,
        "the outcome is recorded once the store commits again"
    );
    assert_eq!(stored(&h, action).outcome, Some(Outcome::DeadlineExhausted));
    let again = h.engine.execute(late).await;
    assert_eq!(
        summary(&again),
        "deadline_exhausted",
        "replayed, not in flight"
    );
    assert_eq!(again.receipt().action_id, action.0);
    assert!(h.transport.sent().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_final_provider_answer_the_store_could_not_record_is_recorded_once_it_commits_again() {
    let (h, store) = Harness::with_failing_store();
    h.transport.script(
        "/v1/transfers",
        vec![answer(422, &[], r#"{"error":{"code":"invalid_amount"}}"#)],
    );
    store.fail_outcomes();
    let answered = h.engine.execute(write(&h, "t", "k-o2")).await;
    assert_eq!(
        summary(&answered),
        "422",
        "the provider's answer is passed through"
    );
    let action = ActionId(answered.receipt().action_id);
    assert_eq!(stored(&h, action).outcome, None);

    store.recover();
    advance(Duration::from_secs(120)).await;
    assert!(
        until(|| stored(&h, action).outcome.is_some()).await,
        "the outcome is recorded once the store commits again"
    );
    assert_eq!(stored(&h, action).outcome, Some(Outcome::Rejected));
    let attempts = h.store.attempts(action).unwrap();
    assert_eq!(attempts.len(), 1);
    assert_eq!(attempts[0].status, Some(422), "with the attempt's result");
    let again = h.engine.execute(write(&h, "t", "k-o2")).await;
    assert_eq!(
        summary(&again),
        "422",
        "the provider's answer replayed, not in flight"
    );
    let Execution::Response { response, .. } = &again else {
        unreachable!("a response, as checked above")
    };
    assert_eq!(response.headers()["idempotent-replayed"], "true");
    assert_eq!(h.transport.sent().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_success_the_store_could_not_record_is_recorded_with_its_replay_once_it_commits_again() {
    let (h, store) = Harness::with_failing_store();
    h.transport
        .script("/v1/transfers", vec![answer(201, &[], r#"{"id":"tr_7"}"#)]);
    store.fail_outcomes();
    let answered = h.engine.execute(write(&h, "t", "k-o3")).await;
    assert_eq!(summary(&answered), "201");
    let action = ActionId(answered.receipt().action_id);
    assert_eq!(stored(&h, action).outcome, None);

    store.recover();
    advance(Duration::from_secs(120)).await;
    assert!(until(|| stored(&h, action).outcome.is_some()).await);
    assert_eq!(stored(&h, action).outcome, Some(Outcome::Succeeded));
    let Execution::Response { response, .. } = h.engine.execute(write(&h, "t", "k-o3")).await
    else {
        panic!("the kept response is replayed")
    };
    assert_eq!(response.status(), 201);
    assert_eq!(response.headers()["idempotent-replayed"], "true");
    let body = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    assert_eq!(&body[..], br#"{"id":"tr_7"}"#);
    assert_eq!(h.transport.sent().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_reconciliation_the_store_could_not_record_is_recorded_once_it_commits_again() {
    let policy = crate::engine_support::POLICY.replace(
        r#""POST /v1/transfers": { class: idempotent_write, scopes: [account], fingerprint_fields: [/amount] }"#,
        r#""POST /v1/transfers":
        class: idempotent_write
        scopes: [account]
        fingerprint_fields: [/amount]
        reconcile: { by: idempotency_key, lookup: "GET /v1/transfers?key={key}", found_pointer: /data/0/id }"#,
    );
    assert_ne!(policy, crate::engine_support::POLICY);
    let (h, store) = Harness::with_failing_store_and_policy(&policy);
    let upstream = backstop_core::reconcile::upstream_idempotency_key("agent-a", "k-o4");
    let lookup = format!("/v1/transfers?key={upstream}");
    h.transport.script(
        "/v1/transfers",
        vec![Step::Fail(TransportError::TimeoutAfterSend)],
    );
    h.transport.script(
        &lookup,
        vec![answer(200, &[], r#"{"data":[{"id":"tr_8"}]}"#)],
    );
    store.fail_outcomes();
    let answered = h.engine.execute(write(&h, "t", "k-o4")).await;
    assert_eq!(summary(&answered), "succeeded", "reconciled: {answered:?}");
    let action = ActionId(answered.receipt().action_id);
    assert_eq!(stored(&h, action).outcome, None);

    store.recover();
    advance(Duration::from_secs(120)).await;
    assert!(until(|| stored(&h, action).outcome.is_some()).await);
    let record = stored(&h, action);
    assert_eq!(record.outcome, Some(Outcome::Succeeded));
    assert_eq!(record.provider_operation_id.as_deref(), Some("tr_8"));
    assert_eq!(
        h.transport.sent_to("/v1/transfers").len(),
        1,
        "never resent"
    );
    assert_eq!(h.transport.sent_to(&lookup).len(), 1, "not looked up again");
}

const DOOR_AGENT_TOKEN: &str = "door-agent-token-5d1e";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_door_answers_a_write_the_store_cannot_record_with_its_idempotency_key() {
    let fake = support::fake_with(vec![RouteConfig::new(
        "POST /v1/transfers",
        support::create("transfers", "tr_"),
    )]);
    let yaml = support::policy_yaml(
        &fake.url(),
        "agents:\n  door-agent: { token_env: DOOR_AGENT_TOKEN }\n",
        "    routes:\n      \"POST /v1/transfers\": { class: idempotent_write, scopes: [account] }\n",
    );
    let env = |name: &str| match name {
        "DOOR_AGENT_TOKEN" => Some(DOOR_AGENT_TOKEN.to_owned()),
        "FAKE_API_KEY" => Some("provider-key".to_owned()),
        _ => None,
    };
    let dir = tempfile::tempdir().unwrap();
    let policy = Policy::from_yaml_str(&yaml, "door.yaml").expect("policy");
    let gateway = server::start(
        policy,
        support::serve_options(dir.path(), 7),
        &env,
        |mut parts| {
            let failing = FailingStore::new(parts.store.clone());
            failing.fail();
            parts.store = failing as Arc<dyn Store>;
            server::engine(parts)
        },
    )
    .await
    .expect("gateway starts");

    for key in [Some("k-door"), None] {
        let (header, body) = unrecorded_503(gateway.addr, "run-door", key).await;
        assert_eq!(body["sent"], false);
        assert_eq!(body["task"], "run-door");
        assert_eq!(body["idempotency_key"], header.as_str());
    }
    assert!(fake.attempts().is_empty(), "nothing was sent");
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}

/// Sends `POST /fake/v1/transfers` through the door at `addr` for task `task`, with `key` as
/// its `Idempotency-Key` when given; checks the answer is a 503 carrying an `Idempotency-Key`
/// header (the agent's key when one was sent) and returns that header and the problem body.
async fn unrecorded_503(
    addr: std::net::SocketAddr,
    task: &str,
    key: Option<&str>,
) -> (String, Value) {
    let mut request = support::client()
        .post(format!("http://{addr}/fake/v1/transfers"))
        .bearer_auth(DOOR_AGENT_TOKEN)
        .header("X-Backstop-Task", task)
        .header("content-type", "application/json")
        .body(r#"{"amount":5}"#);
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    let response = request.send().await.expect("request");
    assert_eq!(response.status(), 503);
    let header = response
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .expect("the Idempotency-Key header");
    if let Some(key) = key {
        assert_eq!(header, key);
    }
    let (_, body) = support::json_of(response).await;
    (header, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_door_answers_a_write_arriving_as_the_engine_stops_with_its_task_and_key() {
    let fake = support::fake_with(vec![RouteConfig::new(
        "POST /v1/transfers",
        support::create("transfers", "tr_"),
    )]);
    let yaml = support::policy_yaml(
        &fake.url(),
        "agents:\n  door-agent: { token_env: DOOR_AGENT_TOKEN }\n",
        "    routes:\n      \"POST /v1/transfers\": { class: idempotent_write, scopes: [account] }\n",
    );
    let env = |name: &str| match name {
        "DOOR_AGENT_TOKEN" => Some(DOOR_AGENT_TOKEN.to_owned()),
        "FAKE_API_KEY" => Some("provider-key".to_owned()),
        _ => None,
    };
    let dir = tempfile::tempdir().unwrap();
    let policy = Policy::from_yaml_str(&yaml, "door.yaml").expect("policy");
    let engine = Arc::new(std::sync::Mutex::new(None));
    let slot = Arc::clone(&engine);
    let gateway = server::start(
        policy,
        support::serve_options(dir.path(), 7),
        &env,
        move |parts| {
            let executor = server::engine(parts);
            *slot.lock().unwrap() = executor.engine();
            executor
        },
    )
    .await
    .expect("gateway starts");
    // The engine stops while the door still takes requests: the window between a request's
    // acceptance at the door and its hand-over to the engine.
    let stopped = engine.lock().unwrap().take().expect("the engine");
    stopped.shutdown().await;

    for key in [Some("k-late"), None] {
        let (header, body) = unrecorded_503(gateway.addr, "run-late", key).await;
        assert!(
            body["type"]
                .as_str()
                .unwrap_or("")
                .ends_with("shutting_down"),
            "{body}"
        );
        assert_eq!(body["sent"], false);
        assert_eq!(body["task"], "run-late");
        assert_eq!(body["idempotency_key"], header.as_str());
    }
    assert!(fake.attempts().is_empty(), "nothing was sent");
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_read_whose_retry_cannot_be_recorded_is_retried_from_memory_not_cancelled() {
    let (h, store) = Harness::with_failing_store();
    // As the SQLite store on a full disk: the read is handed an id, its records never commit.
    store.lose_reads();
    h.transport.script(
        "/v1/items/1",
        vec![answer(503, &[("retry-after", "1")], "")],
    );
    let running = h.spawn(h.get("t", "/v1/items/1"));
    advance(Duration::from_secs(5)).await;
    let execution = running.await.unwrap();
    assert_eq!(summary(&execution), "200");
    assert_eq!(h.transport.sent().len(), 2, "the retry was sent");
}

/// Runs a write under `key` until its first attempt timed out after its bytes left (uncertain)
/// and its same-key retry is scheduled: the provider honours keys and the route has no lookup.
/// Returns the running write and its action.
async fn uncertain_and_waiting(
    h: &Harness,
    key: &str,
) -> (tokio::task::JoinHandle<Execution>, ActionId) {
    h.transport.script(
        "/v1/transfers",
        vec![
            Step::Fail(TransportError::TimeoutAfterSend),
            answer(201, &[], "{}"),
        ],
    );
    let running = h.spawn(write(h, "t", key));
    assert!(
        until(|| h.store.scheduled_retries().is_ok_and(|r| r.len() == 1)).await,
        "the same-key retry is scheduled"
    );
    let action = h.store.scheduled_retries().unwrap()[0].action;
    assert_eq!(h.transport.sent().len(), 1);
    (running, action)
}

/// Asserts the stored `action` ended `escalated` as a side effect nobody knows — reconciled,
/// never `cancelled` — with `why` in the case file's reason.
fn assert_reconciled_into_an_escalation(h: &Harness, action: ActionId, why: &str) {
    assert_eq!(
        stored(h, action).outcome,
        Some(Outcome::Escalated),
        "reconciled, not cancelled"
    );
    let escalations = h.store.open_escalations().unwrap();
    let case = &escalations
        .iter()
        .find(|e| e.action == action)
        .expect("an escalation for the write")
        .case_file;
    assert_eq!(case["reason"], "side_effect_unknown");
    let detail = case["reason_detail"].as_str().unwrap_or("");
    assert!(detail.contains(why), "{detail}");
}

#[tokio::test(start_paused = true)]
async fn an_uncertain_write_whose_retry_start_the_store_could_not_record_is_reconciled_not_cancelled(
) {
    let (h, store) = Harness::with_failing_store();
    let (running, action) = uncertain_and_waiting(&h, "k-u1").await;
    // The retry comes due while the store cannot commit: its start is not recorded.
    store.fail();
    advance(Duration::from_secs(30)).await;
    let (status, retry, body, attempts) = problem(running.await.unwrap()).await;
    assert_eq!((status, retry.as_str(), attempts), (503, "false", 1));
    assert_eq!(body["sent"], true);
    assert_eq!(stored(&h, action).outcome, None);

    store.recover();
    advance(Duration::from_secs(120)).await;
    assert!(until(|| stored(&h, action).outcome.is_some()).await);
    assert_reconciled_into_an_escalation(&h, action, "503 store_unavailable");
    assert!(h.store.scheduled_retries().unwrap().is_empty());
    let again = h.engine.execute(write(&h, "t", "k-u1")).await;
    assert_eq!(summary(&again), "escalated");
    assert_eq!(h.transport.sent().len(), 1, "the write was never resent");
}

#[tokio::test(start_paused = true)]
async fn an_uncertain_write_whose_retry_is_re_armed_after_a_restart_is_reconciled_not_cancelled() {
    let h = Harness::new();
    let (running, action) = uncertain_and_waiting(&h, "k-u2").await;
    h.engine.shutdown().await;
    let _ = running.await.unwrap();
    let restarted = h.restarted(7);
    advance(Duration::from_secs(30)).await;
    assert!(
        until(|| stored(&h, action).outcome.is_some()).await,
        "the re-armed retry finished the action"
    );
    // Reconciled, not cancelled: no lookup and the provider honours keys, so the SPEC §6 rule
    // resends under the same key — from the request the store kept.
    assert_eq!(stored(&h, action).outcome, Some(Outcome::Succeeded));
    assert!(h.store.scheduled_retries().unwrap().is_empty());
    let sent = h.transport.sent();
    assert_eq!(sent.len(), 2, "resent once");
    assert_eq!(sent[0].idempotency_key, sent[1].idempotency_key);
    restarted.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn an_uncertain_write_re_armed_while_the_store_fails_is_reconciled_once_it_commits_again() {
    let (h, store) = Harness::with_failing_store();
    let (running, action) = uncertain_and_waiting(&h, "k-u3").await;
    h.engine.shutdown().await;
    let _ = running.await.unwrap();
    // The next run starts while the store cannot commit: the re-armed retry cannot be claimed.
    store.fail();
    let restarted = Engine::new(
        h.policy.clone(),
        store.clone(),
        h.transport.clone(),
        h.clock,
        h.metrics.clone(),
        8,
    );
    advance(Duration::from_secs(30)).await;
    assert_eq!(
        stored(&h, action).outcome,
        None,
        "nothing could be recorded yet"
    );
    store.recover();
    advance(Duration::from_secs(120)).await;
    assert!(until(|| stored(&h, action).outcome.is_some()).await);
    assert_reconciled_into_an_escalation(&h, action, "restarted");
    assert_eq!(h.transport.sent().len(), 1, "the write was never resent");
    restarted.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_same_key_resend_while_the_store_fails_is_told_the_actions_earlier_attempts_were_sent() {
    let (h, store) = Harness::with_failing_store();
    h.transport.script(
        "/v1/transfers",
        vec![
            answer(503, &[("retry-after", "5")], ""),
            answer(201, &[], "{}"),
        ],
    );
    let running = h.spawn(write(&h, "t", "k-again"));
    assert!(until(|| h.store.scheduled_retries().is_ok_and(|r| r.len() == 1)).await);
    let action = h.store.scheduled_retries().unwrap()[0].action;
    store.fail();
    advance(Duration::from_secs(30)).await;
    let (status, _, body, _) = problem(running.await.unwrap()).await;
    assert_eq!((status, &body["sent"]), (503, &Value::Bool(true)));

    // The agent sends the same key again while the store still cannot commit.
    let again = h.engine.execute(write(&h, "t", "k-again")).await;
    assert_eq!(again.receipt().action_id, action.0, "the key's action");
    let (status, retry, body, attempts) = problem(again).await;
    assert_eq!((status, retry.as_str(), attempts), (503, "false", 1));
    assert_eq!(
        body["sent"], true,
        "an attempt of the action was sent: {body}"
    );
    assert_eq!(body["action_id"], action.0, "{body}");
    assert_eq!(body["idempotency_key"], "k-again", "{body}");
    let detail = body["detail"].as_str().unwrap_or("");
    assert!(detail.contains("not sent again"), "{detail}");
    assert!(detail.contains("earlier attempts"), "{detail}");
    assert!(!detail.contains("nothing was sent"), "{detail}");
    assert_eq!(h.transport.sent().len(), 1, "nothing more was sent");
}

/// A write route that reconciles by idempotency key through `GET /v1/transfers`.
const RECONCILED_TRANSFERS: &str = r#"    routes:
      "POST /v1/transfers":
        class: idempotent_write
        scopes: [account]
        reconcile:
          by: idempotency_key
          lookup: "GET /v1/transfers?idempotency_key={key}"
          found_pointer: /data/0/id
      "GET /v1/transfers": { class: read, scopes: [account] }
"#;

/// The fake provider: transfers are created under their idempotency key, the first one's
/// connection dropped with `first`, and looked up by key.
fn transfers_fake(first: Fault) -> backstop_fake_api::RunningFake {
    support::start_fake(
        FakeConfig::default()
            .with_route(
                RouteConfig::new("POST /v1/transfers", support::create("transfers", "tr_"))
                    .with_idempotency()
                    .with_fault(FaultRule::on_calls([1], first)),
            )
            .with_route(RouteConfig::new(
                "GET /v1/transfers",
                support::lookup("transfers"),
            )),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_door_names_the_operation_id_of_a_reconciliation_the_store_could_not_record() {
    // The provider stores the transfer, then drops the connection: the lookup finds it.
    let fake = transfers_fake(Fault::StoreThenDrop { hold_ms: 0 });
    let yaml = support::policy_yaml(
        &fake.url(),
        "agents:\n  door-agent: { token_env: DOOR_AGENT_TOKEN }\n",
        RECONCILED_TRANSFERS,
    );
    let env = |name: &str| match name {
        "DOOR_AGENT_TOKEN" => Some(DOOR_AGENT_TOKEN.to_owned()),
        "FAKE_API_KEY" => Some("provider-key".to_owned()),
        _ => None,
    };
    let dir = tempfile::tempdir().unwrap();
    let policy = Policy::from_yaml_str(&yaml, "door.yaml").expect("policy");
    let gateway = server::start(
        policy,
        support::serve_options(dir.path(), 7),
        &env,
        |mut parts| {
            let failing = FailingStore::new(parts.store.clone());
            // What ends an action cannot be recorded: the reconciliation waits for the store.
            failing.fail_outcomes();
            parts.store = failing as Arc<dyn Store>;
            server::engine(parts)
        },
    )
    .await
    .expect("gateway starts");

    let response = support::client()
        .post(format!("http://{}/fake/v1/transfers", gateway.addr))
        .bearer_auth(DOOR_AGENT_TOKEN)
        .header("X-Backstop-Task", "run-door-reconciled")
        .header("Idempotency-Key", "k-door-reconciled")
        .header("content-type", "application/json")
        .body(r#"{"amount":5}"#)
        .send()
        .await
        .expect("request");
    let (status, body) = support::json_of(response).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["outcome"], "succeeded", "{body}");
    assert_eq!(body["reconciled"], true, "{body}");
    let id = body["provider_operation_id"]
        .as_str()
        .unwrap_or_else(|| panic!("the answer names the provider's id: {body}"));
    assert!(id.starts_with("tr_"), "{body}");
    let detail = body["detail"].as_str().unwrap_or("");
    assert!(detail.contains(id), "detail and id agree: {body}");
    let attempts = fake.attempts();
    assert_eq!(
        support::on_route(&attempts, "POST", "/v1/transfers").len(),
        1
    );
    assert_eq!(
        support::on_route(&attempts, "GET", "/v1/transfers").len(),
        1
    );
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_deferred_reconciliation_asks_the_provider_once_while_the_store_cannot_record_it() {
    let (logs, _attached) = Capture::this_thread();
    // The provider drops the connection before doing anything: the write is uncertain, and its
    // lookup finds nothing.
    let fake = transfers_fake(Fault::Drop);
    let yaml = support::policy_yaml(&fake.url(), "", RECONCILED_TRANSFERS);
    let policy = Arc::new(Policy::from_yaml_str(&yaml, "deferred.yaml").expect("policy"));
    let dir = tempfile::tempdir().unwrap();
    let sqlite = Arc::new(SqliteStore::open(dir.path().join("backstop.db")).unwrap());
    let store = FailingStore::new(sqlite.clone() as Arc<dyn Store>);
    let upstream = Upstream::new(UpstreamConfig::default()).expect("upstream client");
    let t0: jiff::Timestamp = crate::engine_support::T0.parse().unwrap();
    let engine = Engine::new(
        policy.clone(),
        store.clone(),
        Arc::new(upstream),
        TokioClock::anchored_at(t0),
        Arc::new(Metrics::new()),
        3,
    );
    let body = r#"{"amount":5}"#;
    let spec = ActionSpec {
        task_id: "t".to_owned(),
        task_given: true,
        agent: "agent-a".to_owned(),
        priority: Priority::Normal,
        deadline: None,
        max_wait: None,
        route: policy.route("fake", "POST", "/v1/transfers").unwrap(),
        request: AttemptRequest {
            method: http::Method::POST,
            url: format!("{}/v1/transfers", fake.url()),
            headers: http::HeaderMap::new(),
            body: bytes::Bytes::from_static(body.as_bytes()),
        },
        single_attempt: false,
        idempotency_key: Some("k-once".to_owned()),
        payload_digest: PayloadDigest::of(body.as_bytes()).as_str().to_owned(),
        target_digest: None,
        desired_outcome: None,
        resumed: false,
        holds_secret: false,
    };
    let lookups = || support::on_route(&fake.attempts(), "GET", "/v1/transfers").len();

    // The retry the provider's key would allow cannot be scheduled: the write is reconciled
    // once the store commits again. Polled, never slept: virtual time stands still while the
    // requests are on the loopback.
    store.fail_schedules();
    let running = tokio::spawn({
        let engine = engine.clone();
        async move { engine.execute(spec).await }
    });
    assert!(until(|| running.is_finished()).await);
    let (status, _, answered, attempts) = problem(running.await.unwrap()).await;
    assert_eq!((status, attempts), (503, 1), "{answered}");
    assert_eq!(answered["sent"], true);
    assert_eq!(lookups(), 1, "the running write asked once");
    let action = ActionId(answered["action_id"].as_i64().expect("the action"));

    // Nothing commits now. The store is tried after 1 s, then after 2, 4, 8 and 16 s.
    store.fail();
    let tries = || {
        logs.lines_at("DEBUG")
            .iter()
            .filter(|l| l.contains("is recorded later"))
            .count()
    };
    let mut wait = Duration::from_secs(1);
    for n in 1..=5 {
        advance(wait).await;
        assert!(until(|| tries() == n).await, "try {n}: {}", logs.text());
        wait *= 2;
    }
    assert_eq!(
        lookups(),
        2,
        "asked once for the deferred close, not at each try"
    );
    assert_eq!(sqlite.action(action).unwrap().unwrap().outcome, None);

    store.recover();
    advance(wait).await;
    assert!(until(|| sqlite.action(action).unwrap().unwrap().outcome.is_some()).await);
    assert_eq!(
        sqlite.action(action).unwrap().unwrap().outcome,
        Some(Outcome::Escalated)
    );
    assert_eq!(lookups(), 2, "the kept verdict is the one recorded");
    assert_eq!(
        support::on_route(&fake.attempts(), "POST", "/v1/transfers").len(),
        1,
        "never resent"
    );
    engine.shutdown().await;
    fake.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_write_sent_without_a_result_found_at_a_start_the_store_cannot_commit_is_reconciled_once_it_can(
) {
    let (h, store) = Harness::with_failing_store();
    // What the previous run left: a write's attempt recorded sent, and no result.
    let action = h.recorded_action("POST", "/v1/transfers", "idempotent_write", "k-start");
    h.store.mark_attempt_sent(action, h.t0).unwrap();

    // The next run starts while the store cannot commit.
    store.fail();
    let restarted = Engine::new(
        h.policy.clone(),
        store.clone(),
        h.transport.clone(),
        h.clock,
        h.metrics.clone(),
        9,
    );
    advance(Duration::from_secs(30)).await;
    assert_eq!(
        stored(&h, action).outcome,
        None,
        "nothing could be recorded yet"
    );

    // Once it commits again the write is reconciled, without another start.
    store.recover();
    advance(Duration::from_secs(120)).await;
    assert!(
        until(|| stored(&h, action).outcome.is_some()).await,
        "the write is reconciled once the store commits again, not left to the next start"
    );
    assert_reconciled_into_an_escalation(&h, action, "restarted");
    let attempts = h.store.attempts(action).unwrap();
    assert_eq!(
        attempts[0].disposition,
        Some(backstop_store::Disposition::Uncertain),
        "the attempt is recorded uncertain"
    );
    assert!(h.transport.sent().is_empty(), "nothing was sent");
    restarted.shutdown().await;
}

/// A write's first attempt answered `503` with `Retry-After: 5` after `hold` in flight.
fn held_503(hold: Duration) -> Step {
    Step::Status {
        status: 503,
        headers: vec![("retry-after", "5".to_owned())],
        body: "",
        hold,
    }
}

/// Runs a write under `key` whose first attempt is in flight (answered `503` after 10 s) while
/// the gateway begins to stop and the store fails as `fail` sets it; the caller's answer.
async fn answered_at_a_stop_while_the_store_fails(
    h: &Harness,
    key: &str,
    fail: impl FnOnce(),
) -> Execution {
    h.transport.script(
        "/v1/transfers",
        vec![held_503(Duration::from_secs(10)), answer(201, &[], "{}")],
    );
    let running = h.spawn(write(h, "t", key));
    assert!(
        until(|| h.transport.sent().len() == 1).await,
        "the first attempt left"
    );
    fail();
    h.engine.shutdown().await;
    running.await.unwrap()
}

/// Asserts `body` is a `503` of type `kind` for a write of which one attempt was sent, whose
/// provider answered `503`, with `after_restart` as `after` and `detail` containing `says`.
fn assert_told_after_restart(body: &Value, kind: &str, after: &str, says: &str) {
    assert!(
        body["type"].as_str().unwrap_or("").ends_with(kind),
        "{body}"
    );
    assert_eq!(body["sent"], true, "{body}");
    assert_eq!(body["after_restart"], after, "{body}");
    assert_eq!(body["last_status"], 503, "{body}");
    assert_eq!(body["last_signal"], "unavailable", "{body}");
    let detail = body["detail"].as_str().unwrap_or("");
    assert!(
        detail.starts_with("backstop is shutting down, and its store failed after an attempt of this write was sent"),
        "{detail}"
    );
    assert!(detail.contains(says), "{detail}");
}

#[tokio::test(start_paused = true)]
async fn a_write_whose_retry_the_store_cannot_schedule_at_a_stop_is_told_the_next_start_resumes_it()
{
    let (h, store) = Harness::with_failing_store();
    let answered =
        answered_at_a_stop_while_the_store_fails(&h, "k-stop-s", || store.fail_schedules()).await;
    let action = ActionId(answered.receipt().action_id);
    let (status, retry, body, attempts) = problem(answered).await;
    assert_eq!((status, retry.as_str(), attempts), (503, "false", 1));
    assert_told_after_restart(
        &body,
        "store_unavailable",
        "resume",
        "the next start sends the write again under its original Idempotency-Key",
    );
    assert_eq!(body["action_id"], action.0, "{body}");

    // What the answer said is what the next start does.
    store.recover();
    let restarted = h.restarted(5);
    advance(Duration::from_secs(30)).await;
    assert!(until(|| stored(&h, action).outcome.is_some()).await);
    assert_eq!(stored(&h, action).outcome, Some(Outcome::Succeeded));
    let sent = h.transport.sent();
    assert_eq!(sent.len(), 2, "sent again once, after the restart");
    assert_eq!(sent[0].idempotency_key, sent[1].idempotency_key);
    restarted.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_write_whose_answer_the_store_cannot_record_at_a_stop_is_told_the_next_start_reconciles_it(
) {
    // The provider answered 503, but the store has the attempt only as sent: the next start
    // cannot know the answer, and reconciles the write as one sent without a result.
    let (h, store) = Harness::with_failing_store();
    let answered = answered_at_a_stop_while_the_store_fails(&h, "k-stop-r", || store.fail()).await;
    let action = ActionId(answered.receipt().action_id);
    let (status, retry, body, attempts) = problem(answered).await;
    assert_eq!((status, retry.as_str(), attempts), (503, "false", 1));
    assert_told_after_restart(
        &body,
        "store_unavailable",
        "reconcile",
        "The next start reconciles the write with its original Idempotency-Key",
    );

    // Reconciled: no lookup, and the provider honours keys, so it is resent under its key
    // from the kept request.
    store.recover();
    let restarted = h.restarted(5);
    assert!(until(|| stored(&h, action).outcome.is_some()).await);
    assert_eq!(stored(&h, action).outcome, Some(Outcome::Succeeded));
    let sent = h.transport.sent();
    assert_eq!(sent.len(), 2, "resent once, under its key");
    assert_eq!(sent[0].idempotency_key, sent[1].idempotency_key);
    restarted.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_write_whose_answer_a_closing_store_may_or_may_not_have_kept_at_a_stop_is_told_that_is_unknown(
) {
    // A writer that went away does not say whether the result was committed: kept, the next
    // start cancels the write (its last attempt was answered); lost, it reconciles it.
    let (h, store) = Harness::with_failing_store();
    let answered = answered_at_a_stop_while_the_store_fails(&h, "k-stop-u", || {
        store.fail_as_gone();
        store.fail();
    })
    .await;
    let (status, retry, body, attempts) = problem(answered).await;
    assert_eq!((status, retry.as_str(), attempts), (503, "false", 1));
    assert_told_after_restart(
        &body,
        "shutting_down",
        "unknown",
        "does not tell whether that record was kept, so what the next start does with the write cannot be known here: if it was kept, the next start sends it again under its original Idempotency-Key from its kept request when its retry falls due; if not, it reconciles it with its original Idempotency-Key and sends it again under that key only when nothing is found and the provider honours the key",
    );
}

#[tokio::test(start_paused = true)]
async fn a_write_whose_retry_start_the_store_cannot_record_at_a_stop_is_told_the_next_start_resumes_it(
) {
    let (h, store) = Harness::with_failing_store();
    h.transport.script(
        "/v1/transfers",
        vec![
            answer(503, &[("retry-after", "5")], ""),
            answer(201, &[], "{}"),
        ],
    );
    let running = h.spawn(write(&h, "t", "k-stop-a"));
    assert!(until(|| h.store.scheduled_retries().is_ok_and(|r| r.len() == 1)).await);
    let action = h.store.scheduled_retries().unwrap()[0].action;
    // The retry comes due and goes to record its start, which the store holds.
    store.hold_sends();
    advance(Duration::from_secs(30)).await;
    assert!(until(|| store.sends_held() == 1).await);
    // The gateway begins to stop, then the store fails that record.
    tokio::join!(h.engine.shutdown(), async {
        tokio::task::yield_now().await;
        store.fail_held_sends();
    });
    let (status, retry, body, attempts) = problem(running.await.unwrap()).await;
    assert_eq!((status, retry.as_str(), attempts), (503, "false", 1));
    assert_told_after_restart(
        &body,
        "store_unavailable",
        "resume",
        "the start of its next attempt could not be recorded, so that attempt was not sent",
    );
    assert_eq!(h.transport.sent().len(), 1, "the retry did not leave");

    // The retry's job stays in the store: the next start re-arms it and sends it from the
    // kept request, under the same key.
    let restarted = h.restarted(5);
    advance(Duration::from_secs(30)).await;
    assert!(until(|| stored(&h, action).outcome.is_some()).await);
    assert_eq!(stored(&h, action).outcome, Some(Outcome::Succeeded));
    let sent = h.transport.sent();
    assert_eq!(sent.len(), 2, "the retry left once, after the restart");
    assert_eq!(sent[0].idempotency_key, sent[1].idempotency_key);
    restarted.shutdown().await;
}

/// A kept request edited or damaged at rest is never sent — not to another host with the
/// provider's credential, not with another body: restart recovery falls back to closing the
/// write as one whose request was not kept.
#[tokio::test(start_paused = true)]
async fn a_kept_request_edited_at_rest_is_never_sent_after_a_restart() {
    for (url, body) in [
        ("https://evil.test/steal", r#"{"amount":5}"#),
        ("https://billing.test/v1/transfers", r#"{"amount":500}"#),
    ] {
        let h = Harness::new();
        h.transport.script(
            "/v1/transfers",
            vec![answer(503, &[("retry-after", "20")], "")],
        );
        let running = h.spawn(write(&h, "t", "k-edit"));
        assert!(until(|| h.store.scheduled_retries().is_ok_and(|r| r.len() == 1)).await);
        let action = h.store.scheduled_retries().unwrap()[0].action;
        h.engine.shutdown().await;
        let _ = running.await.unwrap();
        let mut kept = h.store.kept_request(action).unwrap().expect("kept");
        kept.url = url.to_owned();
        kept.body = body.as_bytes().to_vec();
        h.store.keep_request(action, kept).unwrap();
        let restarted = h.restarted(9);
        advance(Duration::from_secs(30)).await;
        assert!(until(|| stored(&h, action).outcome.is_some()).await);
        assert_eq!(
            stored(&h, action).outcome,
            Some(Outcome::Cancelled),
            "{url}"
        );
        assert!(h.transport.sent_to("/steal").is_empty(), "{url}");
        assert_eq!(h.transport.sent().len(), 1, "{url}: nothing more was sent");
        restarted.shutdown().await;
    }
}
