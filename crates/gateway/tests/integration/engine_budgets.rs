//! Budgets, deadlines, outcomes and the breaker through the engine (SPEC §4.2, §5, §7), with
//! paused time; attempts are measured at the scripted transport.

use std::time::Duration;

use backstop_core::outcome::{NextSafe, Outcome};
use backstop_gateway::{action::Execution, problem::Problem};
use backstop_store::{ActionId, Store};
use jiff::SignedDuration;

use crate::engine_support::{self, advance, answer, attempts, summary, Harness, Step};

fn outcome_of(execution: &Execution) -> (Outcome, backstop_core::outcome::OutcomeContext, i64) {
    match execution {
        Execution::Outcome {
            outcome,
            context,
            receipt,
            ..
        } => (*outcome, context.clone(), receipt.action_id),
        Execution::Response { response, .. } => {
            panic!("expected an outcome, got HTTP {}", response.status())
        }
        Execution::InFlight { .. } => panic!("expected an outcome, got a key in flight"),
    }
}

#[tokio::test(start_paused = true)]
async fn a_boundary_beyond_the_deadline_ends_at_once_with_wait_until() {
    let h = Harness::new();
    h.transport.script(
        "/v1/items/1",
        vec![answer(429, &[("retry-after", "10")], "")],
    );
    let mut spec = h.get("t", "/v1/items/1");
    spec.deadline = Some(h.t0 + SignedDuration::from_secs(5));
    let execution = h.engine.execute(spec).await;
    let (outcome, context, id) = outcome_of(&execution);
    assert_eq!(outcome, Outcome::DeadlineExhausted);
    assert_eq!(h.clock_now(), h.t0, "no sleep into failure");
    let boundary = h.t0 + SignedDuration::from_secs(10);
    assert_eq!(context.next_safe[0], NextSafe::WaitUntil { at: boundary });
    assert_eq!(context.boundary, Some(boundary));
    assert!(context.sent && context.response_received);
    assert_eq!(context.last_status, Some(429));
    assert_eq!(context.attempts, 1);
    assert_eq!(h.transport.sent().len(), 1);
    let stored = h.store.action(ActionId(id)).unwrap().unwrap();
    assert_eq!(
        stored.outcome,
        Some(backstop_store::Outcome::DeadlineExhausted)
    );
    // Nothing more leaves later either.
    advance(Duration::from_secs(60)).await;
    assert_eq!(h.transport.sent().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn nothing_starts_after_the_deadline() {
    let h = Harness::new();
    h.transport.script(
        "/v1/items/1",
        vec![answer(503, &[], ""), answer(503, &[], "")],
    );
    let mut spec = h.get("t", "/v1/items/1");
    // Full jitter for retry 1 is up to 2 s; with a 1 ms deadline the retry cannot start.
    spec.deadline = Some(h.t0 + SignedDuration::from_millis(1));
    let execution = h.engine.execute(spec).await;
    let (outcome, _, _) = outcome_of(&execution);
    assert_eq!(outcome, Outcome::DeadlineExhausted);
    let deadline = h.t0 + SignedDuration::from_millis(1);
    for sent in h.transport.sent() {
        assert!(sent.at < deadline, "an attempt started after the deadline");
    }
}

#[tokio::test(start_paused = true)]
async fn retries_stop_with_budget_exhausted_after_max_attempts() {
    let h = Harness::new();
    h.transport
        .script("/v1/items/1", vec![answer(503, &[], "busy"); 6]);
    let execution = h.engine.execute(h.get("t", "/v1/items/1")).await;
    let (outcome, context, _) = outcome_of(&execution);
    assert_eq!(outcome, Outcome::BudgetExhausted);
    assert_eq!(attempts(&execution), 4, "the read class allows 4 attempts");
    assert_eq!(h.transport.sent().len(), 4);
    assert_eq!(context.last_status, Some(503));
    assert_eq!(context.last_signal.as_deref(), Some("unavailable"));
    assert!(context.total_wait_ms > 0, "waits are counted");
    // Each retry waited within the full-jitter cap min(60, 1 * 2^n) s.
    let sent = h.transport.sent();
    for (n, pair) in sent.windows(2).enumerate() {
        let gap = pair[1].at.duration_since(pair[0].at).as_secs_f64();
        let cap = f64::from(1u32 << (n + 1));
        assert!(
            gap <= cap + 0.001,
            "retry {} waited {gap} s > cap {cap}",
            n + 1
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_boundary_beyond_the_wait_budget_is_budget_exhausted_not_clamped() {
    let h = Harness::new();
    h.transport.script(
        "/v1/items/1",
        vec![answer(429, &[("retry-after", "120")], "")],
    );
    let execution = h.engine.execute(h.get("t", "/v1/items/1")).await;
    let (outcome, context, _) = outcome_of(&execution);
    assert_eq!(outcome, Outcome::BudgetExhausted);
    assert_eq!(h.clock_now(), h.t0);
    assert_eq!(
        context.next_safe[0],
        NextSafe::WaitUntil {
            at: h.t0 + SignedDuration::from_secs(120)
        }
    );
}

#[tokio::test(start_paused = true)]
async fn prefer_wait_caps_the_wait_budget() {
    let h = Harness::new();
    h.transport.script(
        "/v1/items/2",
        vec![answer(429, &[("retry-after", "10")], "")],
    );
    let mut spec = h.get("t", "/v1/items/2");
    spec.max_wait = Some(Duration::from_secs(5));
    let (outcome, context, _) = outcome_of(&h.engine.execute(spec).await);
    assert_eq!(outcome, Outcome::BudgetExhausted);
    assert_eq!(context.boundary, Some(h.t0 + SignedDuration::from_secs(10)));
    assert_eq!(h.transport.sent().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_breaker_opens_at_the_threshold_and_sends_nothing_more() {
    let h = Harness::new();
    let rejection = r#"{"error":{"code":"invalid_iban"}}"#;
    h.transport
        .script("/v1/transfers", vec![answer(422, &[], rejection); 3]);
    for i in 0..3 {
        // The agent "varies the whitespace": same amount, different bytes.
        let body = format!("{{\"amount\": 100, \"note\": \"{}\"}}", " ".repeat(i));
        let execution = h
            .engine
            .execute(h.spec("t", "POST", "/v1/transfers", &body))
            .await;
        let Execution::Response { response, .. } = execution else {
            panic!("a provider rejection passes through")
        };
        assert_eq!(response.status(), 422);
        let body = axum::body::to_bytes(response.into_body(), 1024)
            .await
            .unwrap();
        assert_eq!(
            &body[..],
            rejection.as_bytes(),
            "the error body is passed on"
        );
    }
    assert_eq!(h.transport.sent().len(), 3);
    let execution = h
        .engine
        .execute(h.spec("t", "POST", "/v1/transfers", "{\"amount\":100}"))
        .await;
    let (outcome, context, _) = outcome_of(&execution);
    assert_eq!(outcome, Outcome::CircuitOpen);
    assert_eq!(context.last_status, Some(422));
    assert!(context.next_safe.contains(&NextSafe::ChangeRequest));
    assert_eq!(
        h.transport.sent().len(),
        3,
        "0 new attempts once the circuit is open"
    );
    assert!(h.audit().iter().any(|e| e.kind == "circuit_opened"));
    assert!(h
        .metrics
        .render()
        .contains("backstop_breakers_opened_total{provider=\"billing\"} 1"));
    // Another task, or another request, is not affected.
    let other = h
        .engine
        .execute(h.spec("t2", "POST", "/v1/transfers", "{\"amount\":100}"))
        .await;
    assert_eq!(summary(&other), "200");
    let changed = h
        .engine
        .execute(h.spec("t", "POST", "/v1/transfers", "{\"amount\":101}"))
        .await;
    assert_eq!(summary(&changed), "200");
}

/// [`engine_support::POLICY`] with breakers forgotten after an hour without a failure.
fn forgetting_policy() -> String {
    engine_support::POLICY.replace(
        "breaker:\n  threshold: 3\n",
        "breaker:\n  threshold: 3\n  forget_after_seconds: 3600\n",
    )
}

/// The value of the unlabelled gauge `backstop_task_breakers` in the metrics text.
fn task_breakers_gauge(h: &Harness) -> Option<i64> {
    h.metrics
        .render()
        .lines()
        .find_map(|line| line.strip_prefix("backstop_task_breakers ")?.parse().ok())
}

/// Sends `POST /v1/transfers` `{"amount":100}` in `task`; the status or outcome name.
async fn transfer(h: &Harness, task: &str) -> String {
    let execution = h
        .engine
        .execute(h.spec(task, "POST", "/v1/transfers", "{\"amount\":100}"))
        .await;
    summary(&execution)
}

#[tokio::test(start_paused = true)]
async fn a_breaker_without_failures_for_the_forget_window_is_swept_and_opens_again_only_at_the_threshold(
) {
    let h = Harness::with_policy(&forgetting_policy());
    let rejection = r#"{"error":{"code":"invalid_iban"}}"#;
    h.transport
        .script("/v1/transfers", vec![answer(422, &[], rejection); 6]);
    for _ in 0..3 {
        assert_eq!(transfer(&h, "t").await, "422");
    }
    assert_eq!(transfer(&h, "t").await, "circuit_open");
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 3);
    // Five more tasks fail once each (404s of reads), as calls without a task header do.
    for n in 0..5 {
        let path = format!("/v1/items/{n}");
        h.transport.script(&path, vec![answer(404, &[], "")]);
        let execution = h.engine.execute(h.get(&format!("other-{n}"), &path)).await;
        assert_eq!(summary(&execution), "404");
    }
    assert_eq!(h.engine.breakers_held(), 6);
    assert_eq!(task_breakers_gauge(&h), Some(6));

    // Just under an hour after the last failure the circuit is still open.
    advance(Duration::from_secs(3599)).await;
    assert_eq!(transfer(&h, "t").await, "circuit_open");
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 3);

    // An hour without a failure: the next failure of another task sweeps the six.
    advance(Duration::from_secs(2)).await;
    h.transport
        .script("/v1/items/late", vec![answer(404, &[], "")]);
    let late = h.engine.execute(h.get("late", "/v1/items/late")).await;
    assert_eq!(summary(&late), "404");
    assert_eq!(h.engine.breakers_held(), 1, "only the new failure's task");
    assert_eq!(task_breakers_gauge(&h), Some(1));

    // The same failure in `t` needs the threshold again: three more reach the provider.
    for _ in 0..3 {
        assert_eq!(transfer(&h, "t").await, "422");
    }
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 6);
    assert_eq!(transfer(&h, "t").await, "circuit_open");
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 6);
    assert_eq!(
        h.audit()
            .iter()
            .filter(|e| e.kind == "circuit_opened")
            .count(),
        2,
        "opened, forgotten, opened again"
    );
}

#[tokio::test(start_paused = true)]
async fn cancelling_a_task_drops_its_breaker() {
    let h = Harness::new();
    let rejection = r#"{"error":{"code":"invalid_iban"}}"#;
    h.transport
        .script("/v1/transfers", vec![answer(422, &[], rejection); 4]);
    for _ in 0..3 {
        assert_eq!(transfer(&h, "doomed").await, "422");
    }
    assert_eq!(transfer(&h, "kept").await, "422");
    assert_eq!(h.engine.breakers_held(), 2);
    h.engine.cancel_task("doomed", "agent-a").await.unwrap();
    assert_eq!(h.engine.breakers_held(), 1, "`kept` is not cancelled");
    assert_eq!(task_breakers_gauge(&h), Some(1));
    // The cancelled task takes no new action: nothing reaches the provider.
    assert_eq!(transfer(&h, "doomed").await, "cancelled");
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 4);
    assert_eq!(h.engine.breakers_held(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_breaker_whose_failures_all_ended_in_success_is_dropped() {
    let h = Harness::new();
    let rejection = r#"{"error":{"code":"invalid_iban"}}"#;
    h.transport
        .script("/v1/transfers", vec![answer(422, &[], rejection); 2]);
    assert_eq!(transfer(&h, "t").await, "422");
    assert_eq!(transfer(&h, "t").await, "422");
    assert_eq!(h.engine.breakers_held(), 1);
    // The script is used up: the provider answers 200.
    assert_eq!(transfer(&h, "t").await, "200");
    assert_eq!(h.engine.breakers_held(), 0);
    assert_eq!(task_breakers_gauge(&h), Some(0));
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 3);
}

#[tokio::test(start_paused = true)]
async fn an_uncertain_write_without_lookup_is_resent_only_under_the_same_key() {
    // The provider honours `Idempotency-Key` and the route has no lookup: SPEC §6 allows a
    // resend with the SAME key (the provider deduplicates), never with a new one.
    let h = Harness::new();
    h.transport.script(
        "/v1/transfers",
        vec![Step::Fail(
            backstop_core::classify::TransportError::TimeoutAfterSend,
        )],
    );
    let execution = h
        .engine
        .execute(h.spec("t", "POST", "/v1/transfers", "{\"amount\":5}"))
        .await;
    assert_eq!(summary(&execution), "200");
    assert_eq!(h.transport.sent().len(), 2);
    let id = match &execution {
        Execution::Response { receipt, .. } => receipt.action_id,
        Execution::Outcome { .. } | Execution::InFlight { .. } => unreachable!("summary was 200"),
    };
    let stored = h.store.action(ActionId(id)).unwrap().unwrap();
    assert!(!stored.idempotency_key.is_empty());
    let events = h.store.audit_events(0, 1_000).unwrap();
    let sent_keys: Vec<_> = events
        .iter()
        .filter(|e| e.kind == "action_sent" && e.action == Some(id))
        .collect();
    assert_eq!(sent_keys.len(), 2, "two attempts of ONE action (one key)");
    advance(Duration::from_secs(300)).await;
    assert_eq!(h.transport.sent().len(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_not_sent_failure_is_retried_and_every_attempt_is_charged() {
    let h = Harness::new();
    h.transport.script(
        "/v1/items/1",
        vec![Step::Fail(backstop_core::classify::TransportError::Connect)],
    );
    let execution = h.engine.execute(h.get("t", "/v1/items/1")).await;
    assert_eq!(summary(&execution), "200");
    assert_eq!(attempts(&execution), 2);
    assert_eq!(h.transport.sent().len(), 2);
    let text = h.metrics.render();
    assert!(text.contains("disposition=\"not_sent\"} 1"), "{text}");
    assert!(text.contains("disposition=\"success\"} 1"), "{text}");
}

#[tokio::test(start_paused = true)]
async fn an_action_whose_every_attempt_was_not_sent_says_it_was_not_sent() {
    let h = Harness::new();
    h.transport.script(
        "/v1/items/1",
        vec![Step::Fail(backstop_core::classify::TransportError::Dns); 6],
    );
    let execution = h.engine.execute(h.get("t", "/v1/items/1")).await;
    let (outcome, context, _) = outcome_of(&execution);
    assert_eq!(outcome, Outcome::BudgetExhausted);
    assert_eq!(context.attempts, 4, "every attempt is charged");
    assert!(
        !context.sent,
        "no request bytes left the process: {context:?}"
    );
    assert!(!context.response_received);
    assert_eq!(context.last_signal.as_deref(), Some("not_sent"));
    // The answer says why nothing left, and where it could not go.
    let Execution::Outcome { detail, .. } = &execution else {
        unreachable!("outcome_of checked it")
    };
    assert!(
        detail.contains("(last: not_sent: could not resolve the host name (billing.test))"),
        "{detail}"
    );

    // One attempt that may have left is enough for `sent`.
    h.transport.script(
        "/v1/items/2",
        vec![
            Step::Fail(backstop_core::classify::TransportError::Dns),
            Step::Fail(backstop_core::classify::TransportError::TimeoutAfterSend),
            Step::Fail(backstop_core::classify::TransportError::Dns),
            Step::Fail(backstop_core::classify::TransportError::Dns),
        ],
    );
    let execution = h.engine.execute(h.get("t2", "/v1/items/2")).await;
    let (_, context, _) = outcome_of(&execution);
    assert!(context.sent, "{context:?}");
}

#[tokio::test(start_paused = true)]
async fn the_scope_retry_quota_is_shared_by_every_task_of_the_scope() {
    // Two retries' worth of tokens for the whole scope.
    let policy = engine_support::POLICY.replace(
        "breaker:\n  threshold: 3\n",
        "breaker:\n  threshold: 3\nretry_quota: { capacity: 10, retry_cost: 5, timeout_cost: 10, success_refund: 1 }\n",
    );
    let h = Harness::with_policy(&policy);
    h.transport
        .script("/v1/items/1", vec![answer(503, &[], ""); 4]);
    h.transport
        .script("/v1/items/2", vec![answer(503, &[], ""); 4]);
    let first = h.engine.execute(h.get("a", "/v1/items/1")).await;
    let (outcome, context, _) = outcome_of(&first);
    assert_eq!(outcome, Outcome::QuotaExhausted);
    assert_eq!(
        context.attempts, 3,
        "two retries fit in the quota, the third does not"
    );
    // Another task in the same scope finds the quota empty: no retry at all.
    let second = h.engine.execute(h.get("b", "/v1/items/2")).await;
    assert_eq!(outcome_of(&second).0, Outcome::QuotaExhausted);
    assert_eq!(attempts(&second), 1);
    assert_eq!(h.transport.sent().len(), 4);
}

#[tokio::test(start_paused = true)]
async fn a_zero_wait_never_retries_before_the_backoff_on_garbage_retry_after() {
    // `Prefer: wait=0` against a 429 whose Retry-After is unusable: the backoff's delay does not
    // fit the wait, so the action stops after one attempt instead of four within milliseconds.
    let h = Harness::new();
    h.transport.script(
        "/v1/items/1",
        vec![answer(429, &[("retry-after", "soon-ish")], ""); 6],
    );
    let mut spec = h.get("t", "/v1/items/1");
    spec.max_wait = Some(Duration::ZERO);
    let execution = h.engine.execute(spec).await;
    let (outcome, context, _) = outcome_of(&execution);
    assert_eq!(outcome, Outcome::BudgetExhausted);
    assert_eq!(
        h.transport.sent().len(),
        1,
        "no retry sooner than the backoff"
    );
    assert!(
        matches!(context.next_safe[0], NextSafe::WaitUntil { at } if at > h.t0),
        "the instant the backoff allows is given: {:?}",
        context.next_safe
    );
}

#[tokio::test(start_paused = true)]
async fn a_short_wait_never_retries_a_dropped_connection_before_the_backoff() {
    let h = Harness::new();
    h.transport.script(
        "/v1/items/1",
        vec![Step::Fail(backstop_core::classify::TransportError::ResetAfterSend); 6],
    );
    let mut spec = h.get("t", "/v1/items/1");
    spec.max_wait = Some(Duration::from_millis(1_500));
    let execution = h.engine.execute(spec).await;
    let (outcome, _, _) = outcome_of(&execution);
    assert_eq!(outcome, Outcome::BudgetExhausted);
    let sent = h.transport.sent();
    // Every retry waited at least a moment, and all of them within the caller's wait.
    for pair in sent.windows(2) {
        let gap = pair[1].at.duration_since(pair[0].at);
        assert!(gap > SignedDuration::from_millis(1), "retry after {gap:?}");
    }
    let total = sent[sent.len() - 1].at.duration_since(sent[0].at);
    assert!(total <= SignedDuration::from_millis(1_500));
}

/// [`engine_support::POLICY`] with a paced scope (one request per second, no headroom) and a
/// read route in it.
fn paced_reads_policy() -> String {
    let policy = engine_support::POLICY
        .replace(
            "      single: { max_concurrent_requests: 1 }\n",
            "      single: { max_concurrent_requests: 1 }\n      paced: { limit: 1, window_seconds: 1, headroom: 1.0 }\n",
        )
        .replace(
            "    routes:\n",
            "    routes:\n      \"GET /v1/paced/{id}\": { class: read, scopes: [paced] }\n",
        );
    assert!(policy.contains("paced: {") && policy.contains("GET /v1/paced/{id}"));
    policy
}

/// The problem the door renders for a gateway-made outcome, at `now`.
fn rendered(execution: &Execution, now: jiff::Timestamp) -> Problem {
    match execution {
        Execution::Outcome {
            outcome,
            context,
            detail,
            ..
        } => Problem::from_outcome(*outcome, context, detail.clone(), now),
        other => panic!("expected an outcome, got {}", summary(other)),
    }
}

#[tokio::test(start_paused = true)]
async fn a_first_send_held_by_pacing_past_its_wait_budget_says_nothing_was_sent_and_when() {
    let h = Harness::with_policy(&paced_reads_policy());
    let read = |n: u32| {
        let mut spec = h.get("t", &format!("/v1/paced/{n}"));
        spec.max_wait = Some(Duration::ZERO);
        spec
    };
    // The first read takes the scope's pace; the next one, allowed no wait, is refused.
    assert_eq!(summary(&h.engine.execute(read(1)).await), "200");
    let refused = h.engine.execute(read(2)).await;
    let (outcome, context, _) = outcome_of(&refused);
    assert_eq!(outcome, Outcome::BudgetExhausted);
    assert_eq!((context.attempts, context.sent), (0, false));
    let at = context
        .next_safe
        .iter()
        .find_map(|o| match o {
            NextSafe::WaitUntil { at } => Some(*at),
            _ => None,
        })
        .expect("the pacer's instant is the one to come back at");
    let problem = rendered(&refused, h.clock_now());
    assert_eq!(problem.name, "budget_exhausted", "the outcome stays");
    assert_eq!(
        (problem.status.as_u16(), problem.retry_after_seconds),
        (429, Some(1))
    );
    assert_eq!(
        problem.title,
        "Nothing was sent: the wait before sending is longer than the wait budget allows",
        "no retry budget was spent: nothing was tried"
    );
    let detail = &problem.detail;
    assert!(detail.starts_with("nothing was sent: "), "{detail}");
    assert!(
        detail.contains("pacing of scope `billing/paced`"),
        "{detail}"
    );
    assert!(detail.contains("0 ms its wait budget allows"), "{detail}");
    assert!(
        detail.contains(&format!("send it again from {at}")),
        "{detail}"
    );
    assert_eq!(h.transport.sent_to("/v1/paced/2").len(), 0);

    // A retry refused by its wait budget is still told so.
    h.transport.script(
        "/v1/items/1",
        vec![answer(503, &[("retry-after", "10")], "")],
    );
    let mut spec = h.get("t", "/v1/items/1");
    spec.max_wait = Some(Duration::from_secs(5));
    let retried = h.engine.execute(spec).await;
    let problem = rendered(&retried, h.clock_now());
    assert_eq!(problem.name, "budget_exhausted", "{}", problem.detail);
    assert_eq!(problem.title, "The retry budget is exhausted");
}
