//! Cancelling a task whose write has an unsettled attempt (sent, no answer, nothing settled it
//! since): the write is not ended `cancelled` as if nothing had happened, but reconciled with
//! its original key, as every other close does (SPEC §6) — found → `succeeded`, otherwise
//! `escalated` — and nothing of it is sent again. Its waiting caller is told
//! `reconciliation_required`, naming the uncertain attempt, and so is the cancellation's answer.
//! A plain write waiting for its same-key retry, a write reopened by its same-key resend, and a
//! write whose attempt was out when the task was cancelled (virtual time, scripted transport).

use std::time::Duration;

use backstop_core::{
    classify::TransportError,
    outcome::{NextSafe, Outcome, OutcomeContext},
    reconcile::upstream_idempotency_key,
};
use backstop_gateway::{
    action::{ActionSpec, Execution},
    engine::Reconciling,
};
use backstop_store::{ActionId, ActionState, Store};

use crate::engine_support::{advance, answer, summary, until, Harness, Step, POLICY};

/// The transfer of task `t` under the agent key `key`, allowed to wait.
fn transfer(h: &Harness, key: &str) -> ActionSpec {
    let mut spec = h.spec("t", "POST", "/v1/transfers", r#"{"amount":5}"#);
    spec.idempotency_key = Some(key.to_owned());
    spec
}

/// The outcome, context and detail of a gateway-made answer; panics on anything else.
fn outcome_of(execution: &Execution) -> (Outcome, OutcomeContext, String) {
    match execution {
        Execution::Outcome {
            outcome,
            context,
            detail,
            ..
        } => (*outcome, context.clone(), detail.clone()),
        other => panic!("expected an outcome, got {}", summary(other)),
    }
}

/// Checks the answer of a caller whose write was reconciled when its task was cancelled: told
/// so, naming attempt `n`, never `cancelled`.
fn assert_told_reconciliation(answered: &Execution, n: u32) {
    let (outcome, context, detail) = outcome_of(answered);
    assert_eq!(outcome, Outcome::ReconciliationRequired, "{detail}");
    assert!(
        detail.contains(&format!("attempt {n} was sent")),
        "{detail}"
    );
    assert!(detail.contains("cancelled"), "{detail}");
    assert!(context.sent, "{context:?}");
    assert_eq!(
        context.next_safe,
        vec![NextSafe::QueryStatus, NextSafe::Abort]
    );
}

/// Waits until the store has an outcome for `id`, and returns it.
async fn ended(h: &Harness, id: ActionId) -> backstop_store::Outcome {
    assert!(
        until(|| h.store.action(id).unwrap().unwrap().outcome.is_some()).await,
        "action {} never ended",
        id.0
    );
    h.store.action(id).unwrap().unwrap().outcome.unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_write_waiting_for_its_same_key_retry_is_reconciled_when_its_task_is_cancelled() {
    let policy = POLICY.replace(
        r#""POST /v1/transfers": { class: idempotent_write, scopes: [account], fingerprint_fields: [/amount] }"#,
        r#""POST /v1/transfers":
        class: idempotent_write
        scopes: [account]
        reconcile: { by: idempotency_key, lookup: "GET /v1/transfers?key={key}", found_pointer: /data/0/id }"#,
    );
    assert_ne!(policy, POLICY);
    let h = Harness::with_policy(&policy);
    let lookup = format!(
        "/v1/transfers?key={}",
        upstream_idempotency_key("agent-a", "k-wait")
    );
    h.transport.script(
        "/v1/transfers",
        vec![Step::Fail(TransportError::TimeoutAfterSend)],
    );
    // Not found after the timeout (so its retry under the same key is planned); found when the
    // cancellation reconciles it.
    h.transport.script(
        &lookup,
        vec![
            answer(200, &[], r#"{"data":[]}"#),
            answer(200, &[], r#"{"data":[{"id":"tr_9"}]}"#),
        ],
    );
    let running = h.spawn(transfer(&h, "k-wait"));
    assert!(
        until(|| h
            .store
            .action_by_key("agent-a", "k-wait")
            .unwrap()
            .is_some_and(|a| a.state == ActionState::Waiting))
        .await,
        "its retry under the same key is scheduled"
    );
    assert!(
        until(|| h.engine.scopes().iter().any(|s| s.delayed == 1)).await,
        "and waits in the delayed queue"
    );
    let id = h
        .store
        .action_by_key("agent-a", "k-wait")
        .unwrap()
        .unwrap()
        .id;

    let report = h.engine.cancel_task("t", "agent-a").await.unwrap();
    assert_eq!(
        report.reconciling,
        vec![Reconciling {
            action_id: id.0,
            uncertain_attempt: 1
        }]
    );
    assert_eq!(report.actions_cancelled, 0, "{report:?}");
    assert_eq!(
        (report.waiting_dropped, report.retries_dropped),
        (1, 1),
        "{report:?}"
    );
    assert_told_reconciliation(&running.await.unwrap(), 1);

    assert_eq!(ended(&h, id).await, backstop_store::Outcome::Succeeded);
    let record = h.store.action(id).unwrap().unwrap();
    assert_eq!(record.provider_operation_id.as_deref(), Some("tr_9"));
    assert_eq!(h.transport.sent_to(&lookup).len(), 2, "looked up again");
    advance(Duration::from_secs(60)).await;
    assert_eq!(
        h.transport.sent_to("/v1/transfers").len(),
        1,
        "never sent again"
    );
}

#[tokio::test(start_paused = true)]
async fn a_write_reopened_by_its_resend_is_escalated_not_cancelled_when_its_task_is_cancelled() {
    let h = Harness::new();
    h.transport.script(
        "/v1/transfers",
        vec![Step::Fail(TransportError::TimeoutAfterSend)],
    );
    // Uncertain, and the provider honours the key: a resend under it is advised (`429`), since
    // `Prefer: wait=0` refuses the retry.
    let mut first = transfer(&h, "k-reopened");
    first.max_wait = Some(Duration::ZERO);
    let told = h.engine.execute(first).await;
    let (outcome, context, _) = outcome_of(&told);
    assert_eq!(outcome, Outcome::BudgetExhausted);
    let advised = context
        .next_safe
        .iter()
        .find_map(|o| match o {
            NextSafe::WaitUntil { at } => Some(*at),
            _ => None,
        })
        .expect("a resend was advised");
    let id = ActionId(told.receipt().action_id);
    advance(Duration::try_from(advised.duration_since(h.clock_now())).unwrap()).await;

    // A 429 on the scope holds the resend, which reopened the write, before its send.
    h.transport.script(
        "/v1/items/1",
        vec![answer(429, &[("retry-after", "30")], "")],
    );
    let throttled = h.spawn(h.get("t-read", "/v1/items/1"));
    advance(Duration::from_millis(100)).await;
    let resending = h.spawn(transfer(&h, "k-reopened"));
    assert!(
        until(|| h.store.action(id).unwrap().unwrap().state == ActionState::Reopened).await,
        "reopened"
    );
    advance(Duration::from_millis(100)).await;

    let report = h.engine.cancel_task("t", "agent-a").await.unwrap();
    assert_eq!(
        report.reconciling,
        vec![Reconciling {
            action_id: id.0,
            uncertain_attempt: 1
        }]
    );
    assert_eq!(report.actions_cancelled, 0, "{report:?}");
    assert_told_reconciliation(&resending.await.unwrap(), 1);

    // No lookup to ask: an operator decides, told why nothing is resent.
    assert_eq!(ended(&h, id).await, backstop_store::Outcome::Escalated);
    let open = h.store.open_escalations().unwrap();
    let case = &open
        .iter()
        .find(|e| e.action == id)
        .expect("an open escalation")
        .case_file;
    assert_eq!(case["reason"], "side_effect_unknown");
    assert!(case.to_string().contains("task was cancelled"), "{case}");
    advance(Duration::from_secs(60)).await;
    assert_eq!(
        h.transport.sent_to("/v1/transfers").len(),
        1,
        "never sent again"
    );
    let _ = throttled.await;
}

#[tokio::test(start_paused = true)]
async fn a_write_whose_attempt_was_out_when_its_task_was_cancelled_is_escalated_not_cancelled() {
    let h = Harness::new();
    h.transport.script(
        "/v1/transfers",
        vec![
            Step::Fail(TransportError::TimeoutAfterSend),
            Step::Status {
                status: 503,
                headers: Vec::new(),
                body: "",
                hold: Duration::from_secs(5),
            },
        ],
    );
    let running = h.spawn(transfer(&h, "k-out"));
    // The first attempt timed out; its retry under the same key leaves within 2 s.
    assert!(
        until(|| h
            .store
            .action_by_key("agent-a", "k-out")
            .unwrap()
            .is_some_and(|a| a.state == ActionState::Waiting))
        .await,
        "its retry under the same key is scheduled"
    );
    assert!(until(|| h.engine.scopes().iter().any(|s| s.delayed == 1)).await);
    advance(Duration::from_secs(3)).await;
    assert!(until(|| h.transport.sent_to("/v1/transfers").len() == 2).await);
    let id = h
        .store
        .action_by_key("agent-a", "k-out")
        .unwrap()
        .unwrap()
        .id;

    let report = h.engine.cancel_task("t", "agent-a").await.unwrap();
    assert!(report.reconciling.is_empty(), "in flight: {report:?}");
    assert_eq!(report.actions_cancelled, 0, "in flight: {report:?}");

    // The retry's 503 says nothing of the first attempt, which stays unsettled.
    advance(Duration::from_secs(6)).await;
    assert_told_reconciliation(&running.await.unwrap(), 1);
    assert_eq!(ended(&h, id).await, backstop_store::Outcome::Escalated);
    advance(Duration::from_secs(60)).await;
    assert_eq!(
        h.transport.sent_to("/v1/transfers").len(),
        2,
        "never sent again"
    );
}

#[tokio::test(start_paused = true)]
async fn a_write_the_provider_answered_is_still_cancelled_with_its_task() {
    let h = Harness::new();
    h.transport.script(
        "/v1/transfers",
        vec![answer(503, &[("retry-after", "10")], "")],
    );
    let waiting = h.spawn(transfer(&h, "k-answered"));
    assert!(
        until(|| h
            .store
            .action_by_key("agent-a", "k-answered")
            .unwrap()
            .is_some_and(|a| a.state == ActionState::Waiting))
        .await
    );
    let report = h.engine.cancel_task("t", "agent-a").await.unwrap();
    assert!(report.reconciling.is_empty(), "{report:?}");
    assert_eq!(report.actions_cancelled, 1, "{report:?}");
    assert_eq!(summary(&waiting.await.unwrap()), "cancelled");
    advance(Duration::from_secs(30)).await;
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 1);
}
