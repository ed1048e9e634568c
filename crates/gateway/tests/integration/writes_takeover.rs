//! A reopened write taken over by the agent's same-key resend, when an earlier attempt is
//! unsettled and the provider does not honour idempotency keys (any more: the policy changed
//! across a restart): the SPEC §6 rule runs instead of the send — here, without a lookup,
//! `escalated` — and nothing is sent (virtual time, scripted transport).

use std::{sync::Arc, time::Duration};

use backstop_core::{
    outcome::{NextSafe, Outcome, OutcomeContext},
    policy::Policy,
};
use backstop_gateway::{action::ActionSpec, action::Execution, engine::Engine};
use backstop_store::{ActionId, ActionState, Store};
use jiff::Timestamp;

use crate::engine_support::{advance, answer, summary, until, Harness, Step, POLICY};

/// The transfer of task `t` under the agent key `key`, with `Prefer: wait=0`.
fn transfer(h: &Harness, key: &str) -> ActionSpec {
    let mut spec = h.spec("t", "POST", "/v1/transfers", r#"{"amount":5}"#);
    spec.idempotency_key = Some(key.to_owned());
    spec.max_wait = Some(Duration::ZERO);
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

/// [`POLICY`] without the provider's idempotency header (its write route then an
/// `uncertain_write`, as a policy without key support must have it).
fn without_keys() -> String {
    let policy = POLICY
        .replace("    idempotency_header: Idempotency-Key\n", "")
        .replace(
            r#""POST /v1/transfers": { class: idempotent_write"#,
            r#""POST /v1/transfers": { class: uncertain_write"#,
        );
    assert!(!policy.contains("idempotency_header") && policy.contains("uncertain_write, scopes"));
    policy
}

/// The transfer under `key` is sent once and its attempt is uncertain (the provider honours the
/// key, so a resend under it is advised, refused by `Prefer: wait=0`: `429`); after the advised
/// instant its same-key resend reopens it and waits for the scope, which a `429` on a read holds
/// back; then the gateway stops. Returns the action id.
async fn reopened_then_stopped(h: &Harness, key: &str) -> i64 {
    h.transport.script(
        "/v1/transfers",
        vec![Step::Fail(
            backstop_core::classify::TransportError::TimeoutAfterSend,
        )],
    );
    let first = h.engine.execute(transfer(h, key)).await;
    let (outcome, context, _) = outcome_of(&first);
    assert_eq!(outcome, Outcome::BudgetExhausted, "{first:?}");
    assert_eq!(context.last_signal.as_deref(), Some("uncertain"));
    let advised: Timestamp = context
        .next_safe
        .iter()
        .find_map(|o| match o {
            NextSafe::WaitUntil { at } => Some(*at),
            _ => None,
        })
        .expect("a resend under the same key was advised");
    let id = first.receipt().action_id;
    advance(Duration::try_from(advised.duration_since(h.clock_now())).unwrap()).await;

    h.transport.script(
        "/v1/items/1",
        vec![answer(429, &[("retry-after", "30")], "")],
    );
    let throttled = h.spawn(h.get("t-read", "/v1/items/1"));
    advance(Duration::from_millis(100)).await;
    let mut resend = transfer(h, key);
    resend.max_wait = None;
    let resending = h.spawn(resend);
    assert!(
        until(|| h.store.action(ActionId(id)).unwrap().unwrap().state == ActionState::Reopened)
            .await,
        "reopened"
    );
    advance(Duration::from_millis(100)).await;
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 1, "waiting");

    h.engine.shutdown().await;
    let stopped = resending.await.unwrap();
    assert_eq!(summary(&stopped), "503", "{stopped:?}");
    let _ = throttled.await;
    assert_eq!(
        h.store.action(ActionId(id)).unwrap().unwrap().state,
        ActionState::Reopened,
        "the write stays reopened across the stop"
    );
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 1);
    id
}

/// The next run of the gateway under `yaml`.
fn restarted_with(h: &Harness, yaml: &str) -> (Engine, Arc<Policy>) {
    let policy = Arc::new(Policy::from_yaml_str(yaml, "restarted.yaml").unwrap());
    let engine = Engine::new(
        policy.clone(),
        h.store.clone(),
        h.transport.clone(),
        h.clock,
        h.metrics.clone(),
        9,
    );
    (engine, policy)
}

#[tokio::test(start_paused = true)]
async fn a_reopened_uncertain_write_is_escalated_not_sent_when_the_key_is_no_longer_honoured() {
    let h = Harness::new();
    let id = reopened_then_stopped(&h, "k-lost").await;

    let (engine, policy) = restarted_with(&h, &without_keys());
    let mut resend = transfer(&h, "k-lost");
    resend.route = policy.route("billing", "POST", "/v1/transfers").unwrap();
    let answered = engine.execute(resend).await;
    let (outcome, context, detail) = outcome_of(&answered);
    assert_eq!(outcome, Outcome::Escalated, "{detail}");
    assert!(!context.next_safe.contains(&NextSafe::ResendSameKey));
    assert_eq!(answered.receipt().action_id, id);
    assert_eq!(
        h.transport.sent_to("/v1/transfers").len(),
        1,
        "never resent without key support"
    );
    let record = h.store.action(ActionId(id)).unwrap().unwrap();
    assert_eq!(record.outcome, Some(backstop_store::Outcome::Escalated));
    let open = h.store.open_escalations().unwrap();
    let case = &open
        .iter()
        .find(|e| e.action == ActionId(id))
        .expect("an open escalation")
        .case_file;
    assert_eq!(case["reason"], "side_effect_unknown");
    assert_eq!(case["honours_key"], false);
}

#[tokio::test(start_paused = true)]
async fn a_reopened_uncertain_write_is_sent_again_while_the_provider_honours_the_key() {
    let h = Harness::new();
    let id = reopened_then_stopped(&h, "k-kept").await;
    let engine = h.restarted(9);
    h.transport
        .script("/v1/transfers", vec![answer(201, &[], r#"{"id":"tr_1"}"#)]);
    // The scope's boundary from before the stop still holds: this resend may wait for it.
    let mut resend = transfer(&h, "k-kept");
    resend.max_wait = None;
    let answered = engine.execute(resend).await;
    assert_eq!(summary(&answered), "201", "{answered:?}");
    assert_eq!(answered.receipt().task.as_deref(), Some("t"));
    assert_eq!(answered.receipt().action_id, id);
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 2);
}

/// A reopened write whose earlier attempt is unsettled, left by a stop before its resend sent
/// it: cancelling its task does not end it `cancelled` (the provider may have acted on it) but
/// reconciles it with its original key — here, without a lookup, `escalated` — and the
/// cancellation's answer names it with its uncertain attempt. Nothing is sent.
#[tokio::test(start_paused = true)]
async fn a_reopened_uncertain_write_is_escalated_not_cancelled_when_its_task_is_cancelled() {
    let h = Harness::new();
    let id = reopened_then_stopped(&h, "k-cancelled").await;
    let engine = h.restarted(9);
    let report = engine.cancel_task("t", "agent-a").await.unwrap();
    assert_eq!(
        report.reconciling,
        vec![backstop_gateway::engine::Reconciling {
            action_id: id,
            uncertain_attempt: 1
        }]
    );
    assert_eq!(report.actions_cancelled, 0, "{report:?}");
    assert!(
        until(|| h
            .store
            .action(ActionId(id))
            .unwrap()
            .unwrap()
            .outcome
            .is_some())
        .await
    );
    let record = h.store.action(ActionId(id)).unwrap().unwrap();
    assert_eq!(record.outcome, Some(backstop_store::Outcome::Escalated));
    let mut resend = transfer(&h, "k-cancelled");
    resend.max_wait = None;
    assert_eq!(summary(&engine.execute(resend).await), "escalated");
    assert_eq!(
        h.transport.sent_to("/v1/transfers").len(),
        1,
        "never sent again"
    );
}
