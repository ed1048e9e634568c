//! Side-effect-free calls (LLM completions, SPEC §4.2a): run like reads, retried after a
//! timeout, and one logical call whatever the client's own retries do (SPEC §4.3). Attempts
//! are counted at the transport.

use std::time::Duration;

use backstop_core::classify::TransportError;
use backstop_gateway::{action::Execution, engine::RESEND_WINDOW};

use crate::engine_support::{advance, answer, attempts, held_ok, summary, until, Harness, Step};

const POLICY: &str = r#"
request_classes:
  llm_call: { max_attempts: 3, max_wait_seconds: 60, retry_statuses: [429, 500, 502, 503, 529] }
backoff:
  base_seconds: 1
  max_seconds: 60
  boundary_spread_seconds: 0
providers:
  billing:
    base_url: https://billing.test
    scopes:
      llm: { max_concurrent_requests: 8, max_delayed_requests: 20 }
    routes:
      "POST /v1/chat/completions": { class: llm_call, scopes: [llm] }
"#;

const CHAT: &str = "/v1/chat/completions";
const BODY: &str = r#"{"model":"m","messages":[]}"#;

fn completion(h: &Harness) -> backstop_gateway::action::ActionSpec {
    h.spec("run-1", "POST", CHAT, BODY)
}

fn rate_limited() -> Step {
    answer(
        429,
        &[("retry-after", "1")],
        r#"{"error":{"code":"rate_limited"}}"#,
    )
}

#[tokio::test(start_paused = true)]
async fn a_completion_timed_out_after_its_send_is_retried_not_escalated() {
    let h = Harness::with_policy(POLICY);
    h.transport.script(
        CHAT,
        vec![
            Step::Fail(TransportError::TimeoutAfterSend),
            held_ok(Duration::ZERO),
        ],
    );
    let execution = h.engine.execute(completion(&h)).await;
    assert_eq!(summary(&execution), "200");
    assert_eq!(h.transport.sent_to(CHAT).len(), 2);
    // Carried out like a read: no idempotency key of backstop's reaches the provider.
    assert!(h
        .transport
        .sent_to(CHAT)
        .iter()
        .all(|s| s.idempotency_key.is_none()));
    assert!(!h.audit().iter().any(|e| e.kind == "escalated"));
}

#[tokio::test(start_paused = true)]
async fn a_resend_after_the_final_answer_is_answered_at_once_and_charged_to_the_same_call() {
    let h = Harness::with_policy(POLICY);
    h.transport.script(
        CHAT,
        vec![
            rate_limited(),
            rate_limited(),
            rate_limited(),
            held_ok(Duration::ZERO),
        ],
    );
    let first = h.engine.execute(completion(&h)).await;
    assert_eq!(summary(&first), "budget_exhausted");
    assert_eq!(attempts(&first), 3);
    assert_eq!(h.transport.sent_to(CHAT).len(), 3);
    // The SDK's own retries: the same call, nothing sent, the same receipt.
    for _ in 0..2 {
        let again = h.engine.execute(completion(&h)).await;
        assert_eq!(summary(&again), "budget_exhausted");
        assert_eq!(again.receipt().action_id, first.receipt().action_id);
    }
    assert_eq!(
        h.transport.sent_to(CHAT).len(),
        3,
        "a re-send never gets a fresh budget"
    );
    assert!(h
        .metrics
        .render()
        .contains(r#"backstop_client_resends_total{provider="billing",handling="answered"} 2"#));
    // Another payload is another call.
    let other = h
        .engine
        .execute(h.spec("run-1", "POST", CHAT, r#"{"model":"m","messages":[1]}"#))
        .await;
    assert_eq!(summary(&other), "200");
    // After the window the same call is a new one.
    advance(RESEND_WINDOW + Duration::from_secs(1)).await;
    let later = h.engine.execute(completion(&h)).await;
    assert_eq!(summary(&later), "200");
    assert_eq!(h.transport.sent_to(CHAT).len(), 5);
}

#[tokio::test(start_paused = true)]
async fn a_resend_after_the_callers_timeout_joins_the_completion_in_flight() {
    let h = Harness::with_policy(POLICY);
    h.transport
        .script(CHAT, vec![held_ok(Duration::from_secs(10))]);
    let first = h.spawn(completion(&h));
    assert!(until(|| h.transport.sent_to(CHAT).len() == 1).await);
    advance(Duration::from_secs(2)).await;
    // The client gives up on its own timeout and sends the same call again.
    first.abort();
    advance(Duration::from_secs(1)).await;
    let again = h.engine.execute(completion(&h)).await;
    assert_eq!(summary(&again), "200");
    assert_eq!(
        h.transport.sent_to(CHAT).len(),
        1,
        "one completion for both"
    );
    assert!(h
        .metrics
        .render()
        .contains(r#"backstop_client_resends_total{provider="billing",handling="joined"} 1"#));
}

#[tokio::test(start_paused = true)]
async fn a_caller_gone_without_a_resend_cancels_the_completion_after_the_grace() {
    let h = Harness::with_policy(POLICY);
    h.transport
        .script(CHAT, vec![held_ok(Duration::from_secs(60))]);
    let first = h.spawn(completion(&h));
    assert!(until(|| h.transport.sent_to(CHAT).len() == 1).await);
    first.abort();
    advance(Duration::from_secs(1)).await;
    assert!(
        !h.audit().iter().any(|e| e.kind == "cancelled"),
        "still running within the grace"
    );
    advance(Duration::from_secs(5)).await;
    assert!(until(|| h.audit().iter().any(|e| e.kind == "cancelled")).await);
    assert_eq!(h.transport.sent_to(CHAT).len(), 1);
    assert!(!h.audit().iter().any(|e| e.kind == "escalated"));
}

#[tokio::test(start_paused = true)]
async fn an_answer_that_arrived_while_nobody_waited_goes_to_the_resend() {
    let h = Harness::with_policy(POLICY);
    h.transport
        .script(CHAT, vec![held_ok(Duration::from_secs(2))]);
    let first = h.spawn(completion(&h));
    assert!(until(|| h.transport.sent_to(CHAT).len() == 1).await);
    advance(Duration::from_secs(1)).await;
    first.abort();
    // The completion ends at 2 s with nobody waiting; the client's re-send comes at 3 s.
    advance(Duration::from_secs(2)).await;
    let again = h.engine.execute(completion(&h)).await;
    assert_eq!(summary(&again), "200");
    assert_eq!(
        h.transport.sent_to(CHAT).len(),
        1,
        "the re-send got the unseen answer"
    );
    // Given once: the next call of the same payload is a new one.
    let next = h.engine.execute(completion(&h)).await;
    assert_eq!(summary(&next), "200");
    assert_eq!(h.transport.sent_to(CHAT).len(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_resend_that_joined_and_left_again_gets_its_own_grace() {
    let h = Harness::with_policy(POLICY);
    h.transport
        .script(CHAT, vec![held_ok(Duration::from_secs(20))]);
    let first = h.spawn(completion(&h));
    assert!(until(|| h.transport.sent_to(CHAT).len() == 1).await);
    advance(Duration::from_secs(1)).await;
    first.abort();
    advance(Duration::from_secs(1)).await;
    let second = h.spawn(completion(&h));
    advance(Duration::from_millis(3500)).await;
    second.abort();
    // The first caller's grace ends at 6 s, the second's at 10.5 s: a third re-send at 7 s
    // still joins the one completion.
    advance(Duration::from_millis(1500)).await;
    let third = h.engine.execute(completion(&h)).await;
    assert_eq!(summary(&third), "200");
    assert_eq!(
        h.transport.sent_to(CHAT).len(),
        1,
        "one completion for all three"
    );
}

#[tokio::test(start_paused = true)]
async fn a_resend_after_the_reported_boundary_is_a_new_call() {
    let h = Harness::with_policy(POLICY);
    h.transport.script(
        CHAT,
        vec![
            rate_limited(),
            rate_limited(),
            rate_limited(),
            held_ok(Duration::ZERO),
        ],
    );
    let first = h.engine.execute(completion(&h)).await;
    assert_eq!(summary(&first), "budget_exhausted");
    let Execution::Outcome { context, .. } = &first else {
        panic!("an outcome")
    };
    let boundary = context.boundary.expect("the provider's Retry-After");
    // The kept answer's Retry-After is honest: once its boundary passed, the call goes out.
    advance(Duration::from_secs(
        u64::try_from(boundary.duration_since(h.clock_now()).as_secs()).unwrap_or(0) + 1,
    ))
    .await;
    let again = h.engine.execute(completion(&h)).await;
    assert_eq!(summary(&again), "200");
    assert_eq!(h.transport.sent_to(CHAT).len(), 4);
}

#[tokio::test(start_paused = true)]
async fn a_large_provider_error_body_is_passed_on_not_turned_into_a_gateway_outcome() {
    let h = Harness::with_policy(POLICY);
    let body: &'static str = Box::leak("x".repeat(100_000).into_boxed_str());
    h.transport.script(CHAT, vec![answer(400, &[], body)]);
    let execution = h.engine.execute(completion(&h)).await;
    assert_eq!(summary(&execution), "400");
    let Execution::Response { response, .. } = execution else {
        panic!("the provider's answer")
    };
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    assert_eq!(bytes.len(), 100_000);
}
