//! What an outcome's words say, measured on the engine's answer with a scripted provider: why a
//! large body is not retried, a cancelled task named in the agent's words (never the store's),
//! and which instants are the provider's and which are backstop's own.

use std::time::Duration;

use backstop_core::outcome::{NextSafe, Outcome};
use backstop_gateway::action::Execution;

use backstop_store::Store;

use crate::engine_support::{advance, answer, until, Harness, Step};

fn outcome_of(execution: &Execution) -> (Outcome, backstop_core::outcome::OutcomeContext, String) {
    match execution {
        Execution::Outcome {
            outcome,
            context,
            detail,
            ..
        } => (*outcome, context.clone(), detail.clone()),
        other => panic!("expected an outcome, got {other:?}"),
    }
}

fn write(h: &Harness, task: &str, key: &str) -> backstop_gateway::action::ActionSpec {
    let mut spec = h.spec(task, "POST", "/v1/transfers", r#"{"amount":5}"#);
    spec.idempotency_key = Some(key.to_owned());
    spec
}

#[tokio::test(start_paused = true)]
async fn a_body_over_retry_body_bytes_says_why_it_is_sent_once() {
    let h = Harness::new();
    h.transport
        .script("/v1/transfers", vec![answer(503, &[], "")]);
    let mut spec = write(&h, "t", "k-big");
    spec.single_attempt = true;
    let (outcome, _, detail) = outcome_of(&h.engine.execute(spec).await);
    assert_eq!(outcome, Outcome::BudgetExhausted);
    assert!(detail.contains("--retry-body-bytes"), "{detail}");
    assert!(detail.contains("sends it once"), "{detail}");
    assert!(!detail.contains("all 1 attempts"), "{detail}");
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_write_whose_task_is_cancelled_while_its_attempt_is_out_names_the_task_not_the_store() {
    let h = Harness::new();
    h.transport.script(
        "/v1/transfers",
        vec![Step::Status {
            status: 503,
            headers: Vec::new(),
            body: "",
            hold: Duration::from_secs(2),
        }],
    );
    let running = h.spawn(write(&h, "run-cancel", "k-out"));
    let agent = write(&h, "run-cancel", "k-out").agent;
    let out = || {
        h.store
            .action_by_key(&agent, "k-out")
            .unwrap()
            .is_some_and(|a| a.state == backstop_store::ActionState::InFlight)
    };
    assert!(until(out).await, "the attempt is out");
    h.engine
        .cancel_task("run-cancel", &agent)
        .await
        .expect("cancelled");
    advance(Duration::from_secs(5)).await;
    let (outcome, _, detail) = outcome_of(&running.await.unwrap());
    assert_eq!(outcome, Outcome::Cancelled, "{detail}");
    assert!(!detail.contains("store:"), "{detail}");
    assert!(!detail.contains("action "), "{detail}");
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_backoff_past_the_deadline_shows_no_provider_boundary_and_names_backstops_instant() {
    let h = Harness::new();
    h.transport
        .script("/v1/items/1", vec![answer(503, &[], "")]);
    let mut spec = h.get("t", "/v1/items/1");
    spec.deadline = Some(h.clock_now() + jiff::SignedDuration::from_millis(50));
    let (outcome, context, detail) = outcome_of(&h.engine.execute(spec).await);
    assert_eq!(outcome, Outcome::DeadlineExhausted, "{detail}");
    assert_eq!(
        context.boundary, None,
        "the provider gave none: {context:?}"
    );
    let waits = context
        .next_safe
        .iter()
        .any(|o| matches!(o, NextSafe::WaitUntil { .. }));
    assert!(waits, "backstop's own instant is in next_safe: {context:?}");
    assert!(detail.contains("backstop's own backoff"), "{detail}");
    assert!(detail.contains("the provider gave no boundary"), "{detail}");
}

/// A `Retry-After` over the ceiling is only the lower bound now + 24 h: even a class patient
/// enough to wait that long is never retried at it (the provider's instant is later); the
/// action ends at once with the boundary.
#[tokio::test(start_paused = true)]
async fn a_retry_after_over_the_ceiling_is_never_retried_at_its_lower_bound_even_by_a_patient_class(
) {
    let policy = crate::engine_support::POLICY.replace(
        "read:             { max_attempts: 4, max_wait_seconds: 90,",
        "read:             { max_attempts: 4, max_wait_seconds: 200000,",
    );
    assert_ne!(
        policy,
        crate::engine_support::POLICY,
        "the class is patient"
    );
    let h = Harness::with_policy(&policy);
    h.transport.script(
        "/v1/items/1",
        vec![answer(429, &[("retry-after", "90000")], "")],
    );
    let running = h.spawn(h.get("t", "/v1/items/1"));
    advance(Duration::from_secs(90_000)).await;
    let (outcome, context, detail) = outcome_of(&running.await.unwrap());
    assert_eq!(outcome, Outcome::BudgetExhausted, "{detail}");
    assert!(context.boundary.is_some(), "{context:?}");
    assert_eq!(
        h.transport.sent_to("/v1/items/1").len(),
        1,
        "never retried early"
    );
}
