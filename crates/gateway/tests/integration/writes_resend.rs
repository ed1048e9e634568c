//! A same-key resend of a finished write that backstop's own answer told to come back (`429` +
//! `Retry-After`, with `x-should-retry: false` so that only the agent's explicit resend comes
//! back, not its client's own retry; or an operator's `wait` on the escalation opened
//! beside its outcome): replayed before the advised instant, reopened and sent as the same
//! action under the same key from it on — after the SPEC §6 rule when the last attempt is
//! uncertain — and replayed as before for every other outcome. Sends are counted at the scripted
//! transport (virtual time) and, over loopback, at the fake provider.

use std::{path::Path, sync::Arc, time::Duration};

use backstop_core::{
    outcome::{NextSafe, Outcome, OutcomeContext},
    policy::Policy,
    reconcile::upstream_idempotency_key,
};
use backstop_fake_api::{FakeConfig, Fault, FaultRule, RouteConfig};
use backstop_gateway::{
    action::ActionSpec,
    action::Execution,
    engine::{Engine, Submitted},
    problem::Problem,
};
use backstop_store::{ActionId, Store, ACTION_REOPENED, REOPENED_BY_RESEND};
use jiff::{SignedDuration, Timestamp};
use serde_json::json;

use crate::engine_support::{advance, answer, summary, until, Harness, Step, POLICY};
use crate::support::{self, client, create, json_of, lookup, on_route};

/// The transfer of task `t` under the agent key `key`, with `Prefer: wait=0`.
fn transfer(h: &Harness, key: &str) -> ActionSpec {
    let mut spec = h.spec("t", "POST", "/v1/transfers", r#"{"amount":5}"#);
    spec.idempotency_key = Some(key.to_owned());
    spec.max_wait = Some(Duration::ZERO);
    spec
}

/// The key the provider sees for `key` of the harness's agent.
fn upstream(key: &str) -> String {
    upstream_idempotency_key("agent-a", key)
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
        Execution::Response { response, .. } => {
            panic!("expected an outcome, got HTTP {}", response.status())
        }
        Execution::InFlight { .. } => panic!("expected an outcome, got a key in flight"),
    }
}

/// The `wait_until` among `context`'s safe options.
fn wait_until(context: &OutcomeContext) -> Option<Timestamp> {
    context.next_safe.iter().find_map(|o| match o {
        NextSafe::WaitUntil { at } => Some(*at),
        _ => None,
    })
}

/// The problem the door renders for `execution` at `now`.
fn problem(execution: &Execution, now: Timestamp) -> Problem {
    let (outcome, context, detail) = outcome_of(execution);
    Problem::from_outcome(outcome, &context, detail, now)
}

/// The status of a provider response passed through, and whether it is a replay.
fn response_of(execution: &Execution) -> (u16, bool) {
    match execution {
        Execution::Response { response, .. } => (
            response.status().as_u16(),
            response.headers().contains_key("idempotent-replayed"),
        ),
        other => panic!("expected a provider response, got {}", summary(other)),
    }
}

/// The `action_reopened` events of `action`.
fn reopens(h: &Harness, action: i64) -> Vec<backstop_store::audit::AuditEvent> {
    h.audit()
        .into_iter()
        .filter(|e| e.action == Some(action) && e.kind == ACTION_REOPENED)
        .collect()
}

#[tokio::test(start_paused = true)]
async fn a_write_told_to_wait_is_sent_again_under_its_key_once_the_instant_has_come() {
    let h = Harness::new();
    h.transport.script(
        "/v1/transfers",
        vec![
            answer(429, &[("retry-after", "11")], ""),
            answer(201, &[], r#"{"id":"tr_1"}"#),
        ],
    );
    let first = h.engine.execute(transfer(&h, "k-wait")).await;
    let id = first.receipt().action_id;
    let (outcome, context, _) = outcome_of(&first);
    assert_eq!(outcome, Outcome::BudgetExhausted);
    let advised = h.t0 + SignedDuration::from_secs(11);
    assert_eq!(wait_until(&context), Some(advised));
    let told = problem(&first, h.clock_now());
    assert_eq!(
        (
            told.status.as_u16(),
            told.retry_after_seconds,
            told.should_retry
        ),
        (429, Some(11), false)
    );

    // Before the instant: the outcome is replayed with the Retry-After left; nothing is sent.
    advance(Duration::from_secs(5)).await;
    let early = h.engine.execute(transfer(&h, "k-wait")).await;
    let (outcome, _, detail) = outcome_of(&early);
    assert_eq!(outcome, Outcome::BudgetExhausted);
    assert!(detail.starts_with("replayed"), "{detail}");
    let told = problem(&early, h.clock_now());
    assert_eq!(
        (told.status.as_u16(), told.retry_after_seconds),
        (429, Some(6))
    );
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 1);
    assert!(reopens(&h, id).is_empty());

    // From the instant on: sent once more, as the same action under the same key.
    advance(Duration::from_secs(7)).await;
    let resent = h.engine.execute(transfer(&h, "k-wait")).await;
    assert_eq!(response_of(&resent), (201, false));
    assert_eq!(resent.receipt().action_id, id, "the same action");
    assert_eq!(resent.receipt().attempts, 2, "its earlier attempt counts");
    let sent = h.transport.sent_to("/v1/transfers");
    assert_eq!(sent.len(), 2);
    assert!(
        sent.iter()
            .all(|s| s.idempotency_key.as_deref() == Some(upstream("k-wait").as_str())),
        "the same key upstream: {sent:?}"
    );
    let record = h.store.action(ActionId(id)).unwrap().unwrap();
    assert_eq!(record.outcome, Some(backstop_store::Outcome::Succeeded));

    // The reopen is audited: what was set aside, the advised instant, why; no person decided.
    let reopened = reopens(&h, id);
    assert_eq!(reopened.len(), 1, "{reopened:?}");
    let event = &reopened[0];
    assert_eq!(event.outcome.as_deref(), Some("budget_exhausted"));
    assert_eq!(event.decision.as_deref(), Some("retry_same_key"));
    assert_eq!(event.decided_by, None);
    assert_eq!(event.source.as_deref(), Some(REOPENED_BY_RESEND));
    assert_eq!(
        event
            .boundary
            .as_deref()
            .map(|b| b.parse::<Timestamp>().unwrap()),
        Some(advised)
    );
    let sends = h
        .audit()
        .into_iter()
        .filter(|e| e.action == Some(id) && e.kind == "action_sent")
        .count();
    assert_eq!(sends, 2, "every attempt audited");

    // A third resend replays the success; nothing is sent.
    let third = h.engine.execute(transfer(&h, "k-wait")).await;
    assert_eq!(response_of(&third), (201, true));
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_reopened_write_the_provider_refuses_is_replayed_as_the_providers_answer() {
    let h = Harness::new();
    h.transport.script(
        "/v1/transfers",
        vec![
            answer(429, &[("retry-after", "11")], ""),
            answer(
                404,
                &[
                    ("content-type", "application/json"),
                    ("x-request-id", "req_refused"),
                ],
                r#"{"error":{"code":"resource_missing"}}"#,
            ),
        ],
    );
    let first = h.engine.execute(transfer(&h, "k-refused")).await;
    let id = first.receipt().action_id;
    assert_eq!(outcome_of(&first).0, Outcome::BudgetExhausted);

    // Reopened by the resend at the advised instant; the provider refuses it.
    advance(Duration::from_secs(12)).await;
    let resent = h.engine.execute(transfer(&h, "k-refused")).await;
    assert_eq!(response_of(&resent), (404, false));
    assert_eq!(resent.receipt().action_id, id, "the same action");
    let record = h.store.action(ActionId(id)).unwrap().unwrap();
    assert_eq!(record.outcome, Some(backstop_store::Outcome::Rejected));

    // The next resend gets the provider's answer again — status, headers, body — not a
    // problem of backstop's; nothing is sent.
    let again = h.engine.execute(transfer(&h, "k-refused")).await;
    assert_eq!(response_of(&again), (404, true));
    assert_eq!(again.receipt().action_id, id);
    let Execution::Response { response, .. } = again else {
        unreachable!("a response, as checked above")
    };
    assert_eq!(response.headers()["x-request-id"], "req_refused");
    assert_eq!(response.headers()["content-type"], "application/json");
    let body = axum::body::to_bytes(response.into_body(), 1024)
        .await
        .expect("body");
    assert_eq!(&body[..], br#"{"error":{"code":"resource_missing"}}"#);
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 2);
}

#[tokio::test(start_paused = true)]
async fn resends_at_once_after_the_instant_send_the_write_once() {
    let h = Harness::new();
    h.transport.script(
        "/v1/transfers",
        vec![
            answer(429, &[("retry-after", "11")], ""),
            Step::Status {
                status: 201,
                headers: Vec::new(),
                body: r#"{"id":"tr_2"}"#,
                hold: Duration::from_secs(2),
            },
        ],
    );
    let first = h.engine.execute(transfer(&h, "k-twice")).await;
    let id = first.receipt().action_id;
    assert_eq!(summary(&first), "budget_exhausted");
    advance(Duration::from_secs(12)).await;

    let a = h.spawn(transfer(&h, "k-twice"));
    let b = h.spawn(transfer(&h, "k-twice"));
    advance(Duration::from_secs(3)).await;
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    for answered in [&a, &b] {
        assert_eq!(summary(answered), "201", "{answered:?}");
        assert_eq!(answered.receipt().action_id, id);
    }
    assert_eq!(
        h.transport.sent_to("/v1/transfers").len(),
        2,
        "one more send for both resends"
    );
    assert_eq!(reopens(&h, id).len(), 1);
    let joined = h.metrics.render();
    assert!(
        joined.lines().any(|l| l.contains("layered_retries_joined")
            && l.contains("billing")
            && l.ends_with(" 1")),
        "the second resend joined the first: {joined}"
    );
}

#[tokio::test(start_paused = true)]
async fn an_operators_abort_keeps_the_outcome_and_the_resend_is_not_told_to_come_back() {
    let h = Harness::new();
    h.transport.script(
        "/v1/transfers",
        vec![answer(429, &[("retry-after", "11")], "")],
    );
    let first = h.engine.execute(transfer(&h, "k-abort")).await;
    let id = first.receipt().action_id;
    assert_eq!(summary(&first), "budget_exhausted");
    // The provider's boundary lies beyond the wait budget: an escalation opened beside it.
    let open = h.store.open_escalations().unwrap();
    let escalation = open
        .iter()
        .find(|e| e.action == ActionId(id))
        .expect("an escalation beside the outcome")
        .id;
    h.store
        .decide_escalation(escalation, "abort", "oncall", None, h.clock_now())
        .unwrap();

    advance(Duration::from_secs(12)).await;
    let resent = h.engine.execute(transfer(&h, "k-abort")).await;
    let (outcome, context, _) = outcome_of(&resent);
    assert_eq!(outcome, Outcome::BudgetExhausted);
    assert_eq!(wait_until(&context), None, "{context:?}");
    // The provider's 429 is still the status, but without a Retry-After: no instant is promised.
    let told = problem(&resent, h.clock_now());
    assert_eq!(
        (
            told.status.as_u16(),
            told.retry_after_seconds,
            told.should_retry
        ),
        (429, None, false)
    );
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 1);
    assert!(reopens(&h, id).is_empty());
}

/// [`POLICY`] with a reconciliation lookup by key on `POST /v1/transfers`.
fn policy_with_lookup() -> String {
    let policy = POLICY.replace(
        r#""POST /v1/transfers": { class: idempotent_write, scopes: [account], fingerprint_fields: [/amount] }"#,
        r#""POST /v1/transfers":
        class: idempotent_write
        scopes: [account]
        fingerprint_fields: [/amount]
        reconcile: { by: idempotency_key, lookup: "GET /v1/transfers?key={key}", found_pointer: /data/0/id }"#,
    );
    assert_ne!(policy, POLICY);
    policy
}

/// Sends the transfer under `key` once: its attempt is uncertain, and the provider honours the
/// key, so its retry under the same key is planned — and refused by `Prefer: wait=0`. Returns
/// the action id and the instant its answer advised.
async fn uncertain_then_told_to_wait(h: &Harness, key: &str) -> (i64, Timestamp) {
    let first = h.engine.execute(transfer(h, key)).await;
    let (outcome, context, _) = outcome_of(&first);
    assert_eq!(outcome, Outcome::BudgetExhausted, "{first:?}");
    assert_eq!(context.last_signal.as_deref(), Some("uncertain"));
    let advised = wait_until(&context).expect("a retry under the same key was advised");
    let told = problem(&first, h.clock_now());
    assert_eq!((told.status.as_u16(), told.should_retry), (429, false));
    assert!(told.retry_after_seconds.is_some());
    (first.receipt().action_id, advised)
}

#[tokio::test(start_paused = true)]
async fn an_uncertain_write_is_looked_up_before_its_resend_and_found_is_not_sent_again() {
    let h = Harness::with_policy(&policy_with_lookup());
    let lookup = format!("/v1/transfers?key={}", upstream("k-found"));
    h.transport.script(
        "/v1/transfers",
        vec![Step::Fail(
            backstop_core::classify::TransportError::TimeoutAfterSend,
        )],
    );
    h.transport.script(
        &lookup,
        vec![
            answer(200, &[], r#"{"data":[]}"#),
            answer(200, &[], r#"{"data":[{"id":"tr_9"}]}"#),
        ],
    );
    let (id, advised) = uncertain_then_told_to_wait(&h, "k-found").await;
    assert_eq!(h.transport.sent_to(&lookup).len(), 1);

    advance(Duration::try_from(advised.duration_since(h.clock_now())).unwrap()).await;
    let resent = h.engine.execute(transfer(&h, "k-found")).await;
    let (outcome, _, detail) = outcome_of(&resent);
    assert_eq!(outcome, Outcome::Succeeded, "{detail}");
    assert_eq!(
        resent.receipt().provider_operation_id.as_deref(),
        Some("tr_9")
    );
    assert_eq!(
        h.transport.sent_to("/v1/transfers").len(),
        1,
        "found: not sent again"
    );
    assert_eq!(h.transport.sent_to(&lookup).len(), 2, "looked up first");
    let record = h.store.action(ActionId(id)).unwrap().unwrap();
    assert_eq!(record.outcome, Some(backstop_store::Outcome::Succeeded));
    assert_eq!(record.provider_operation_id.as_deref(), Some("tr_9"));
}

#[tokio::test(start_paused = true)]
async fn an_uncertain_write_not_found_is_resent_under_the_same_key() {
    let h = Harness::with_policy(&policy_with_lookup());
    let lookup = format!("/v1/transfers?key={}", upstream("k-absent"));
    h.transport.script(
        "/v1/transfers",
        vec![
            Step::Fail(backstop_core::classify::TransportError::TimeoutAfterSend),
            answer(201, &[], r#"{"id":"tr_3"}"#),
        ],
    );
    h.transport.script(
        &lookup,
        vec![
            answer(200, &[], r#"{"data":[]}"#),
            answer(200, &[], r#"{"data":[]}"#),
        ],
    );
    let (id, advised) = uncertain_then_told_to_wait(&h, "k-absent").await;
    advance(Duration::try_from(advised.duration_since(h.clock_now())).unwrap()).await;
    let resent = h.engine.execute(transfer(&h, "k-absent")).await;
    assert_eq!(response_of(&resent), (201, false));
    assert_eq!(resent.receipt().action_id, id);
    let sent = h.transport.sent_to("/v1/transfers");
    assert_eq!(sent.len(), 2);
    assert!(sent
        .iter()
        .all(|s| s.idempotency_key.as_deref() == Some(upstream("k-absent").as_str())));
    // Looked up before the resend, as the attempt loop does.
    let lookups = h.transport.sent_to(&lookup);
    assert_eq!(lookups.len(), 2);
    assert!(lookups[1].at <= sent[1].at);
}

#[tokio::test(start_paused = true)]
async fn an_uncertain_write_without_key_support_or_lookup_is_escalated_not_resent() {
    let h = Harness::new();
    h.transport.script(
        "/v1/transfers",
        vec![Step::Fail(
            backstop_core::classify::TransportError::TimeoutAfterSend,
        )],
    );
    let (id, advised) = uncertain_then_told_to_wait(&h, "k-nokey").await;

    // The next run's policy no longer sends the provider a key (so the route is an
    // `uncertain_write`), and it has no lookup.
    h.engine.shutdown().await;
    let without_keys = POLICY
        .replace("    idempotency_header: Idempotency-Key\n", "")
        .replace(
            r#""POST /v1/transfers": { class: idempotent_write"#,
            r#""POST /v1/transfers": { class: uncertain_write"#,
        );
    assert!(
        !without_keys.contains("idempotency_header")
            && without_keys.contains("uncertain_write, scopes")
    );
    let policy = Arc::new(Policy::from_yaml_str(&without_keys, "nokeys.yaml").unwrap());
    let engine = Engine::new(
        policy.clone(),
        h.store.clone(),
        h.transport.clone(),
        h.clock,
        h.metrics.clone(),
        7,
    );
    advance(Duration::try_from(advised.duration_since(h.clock_now())).unwrap()).await;
    let mut resend = transfer(&h, "k-nokey");
    resend.route = policy.route("billing", "POST", "/v1/transfers").unwrap();
    let answered = engine.execute(resend).await;
    let (outcome, context, detail) = outcome_of(&answered);
    assert_eq!(outcome, Outcome::Escalated, "{detail}");
    assert!(!context.next_safe.contains(&NextSafe::ResendSameKey));
    assert_eq!(
        h.transport.sent_to("/v1/transfers").len(),
        1,
        "never resent blindly"
    );
    let record = h.store.action(ActionId(id)).unwrap().unwrap();
    assert_eq!(record.outcome, Some(backstop_store::Outcome::Escalated));
    assert!(reopens(&h, id).is_empty(), "not reopened");
    let open = h.store.open_escalations().unwrap();
    let case = &open
        .iter()
        .find(|e| e.action == ActionId(id))
        .expect("an open escalation")
        .case_file;
    assert_eq!(case["reason"], "side_effect_unknown");
    // The next resend replays the escalation; still nothing is sent.
    let mut again = transfer(&h, "k-nokey");
    again.route = policy.route("billing", "POST", "/v1/transfers").unwrap();
    assert_eq!(summary(&engine.execute(again).await), "escalated");
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 1);
}

/// [`POLICY`] with a paced scope (one request per second, no headroom) and a write route in it.
fn paced_policy() -> String {
    let policy = POLICY
        .replace(
            "      single: { max_concurrent_requests: 1 }\n",
            "      single: { max_concurrent_requests: 1 }\n      paced: { limit: 1, window_seconds: 1, headroom: 1.0 }\n",
        )
        .replace(
            "    routes:\n",
            "    routes:\n      \"POST /v1/paced\": { class: idempotent_write, scopes: [paced] }\n",
        );
    assert!(policy.contains("paced: {") && policy.contains("POST /v1/paced"));
    policy
}

#[tokio::test(start_paused = true)]
async fn a_write_refused_by_pacing_alone_is_told_when_and_sent_by_its_resend_then() {
    let h = Harness::with_policy(&paced_policy());
    let paced = |key: &str| {
        let mut spec = h.spec("t", "POST", "/v1/paced", r#"{"amount":5}"#);
        spec.idempotency_key = Some(key.to_owned());
        spec.max_wait = Some(Duration::ZERO);
        spec
    };
    // Use up the pacer: writes under new keys until one is refused for want of waiting.
    let mut refused = None;
    for n in 0..5 {
        let key = format!("k-paced-{n}");
        let answered = h.engine.execute(paced(&key)).await;
        if let Execution::Outcome { .. } = answered {
            refused = Some((key, answered));
            break;
        }
    }
    let (key, answered) = refused.expect("pacing refused a write that may not wait");
    let sent_before = h.transport.sent_to("/v1/paced").len();
    let (outcome, context, detail) = outcome_of(&answered);
    assert_eq!(outcome, Outcome::BudgetExhausted, "{detail}");
    assert!(!context.sent, "nothing was sent");
    assert_eq!(context.boundary, None, "no provider boundary");
    let at = wait_until(&context).expect("the pacer's instant is known");
    assert!(at > h.clock_now());
    let told = problem(&answered, h.clock_now());
    assert_eq!((told.status.as_u16(), told.should_retry), (429, false));
    assert!(told.retry_after_seconds.is_some());

    advance(Duration::try_from(at.duration_since(h.clock_now())).unwrap()).await;
    let resent = h.engine.execute(paced(&key)).await;
    assert_eq!(summary(&resent), "200", "{resent:?}");
    assert_eq!(resent.receipt().action_id, answered.receipt().action_id);
    assert_eq!(h.transport.sent_to("/v1/paced").len(), sent_before + 1);
}

#[tokio::test(start_paused = true)]
async fn a_reopened_uncertain_write_whose_caller_leaves_before_the_send_is_reconciled() {
    let h = Harness::new();
    h.transport.script(
        "/v1/transfers",
        vec![Step::Fail(
            backstop_core::classify::TransportError::TimeoutAfterSend,
        )],
    );
    let (id, advised) = uncertain_then_told_to_wait(&h, "k-gone").await;
    advance(Duration::try_from(advised.duration_since(h.clock_now())).unwrap()).await;
    // A 429 on the scope holds the resend back before its send.
    h.transport.script(
        "/v1/items/1",
        vec![answer(429, &[("retry-after", "10")], "")],
    );
    let throttled = h.spawn(h.get("t-read", "/v1/items/1"));
    advance(Duration::from_millis(100)).await;
    let mut resend = transfer(&h, "k-gone");
    resend.max_wait = None;
    let resending = h.spawn(resend);
    assert!(
        until(|| h.store.action(ActionId(id)).unwrap().unwrap().state
            == backstop_store::ActionState::Reopened)
        .await,
        "reopened"
    );
    advance(Duration::from_millis(100)).await;
    assert_eq!(
        h.transport.sent_to("/v1/transfers").len(),
        1,
        "waiting for the scope"
    );
    // Its caller goes away before anything is sent.
    resending.abort();
    let _ = resending.await;
    assert!(
        until(|| h
            .store
            .action(ActionId(id))
            .unwrap()
            .unwrap()
            .outcome
            .is_some())
        .await,
        "the action is closed"
    );
    let record = h.store.action(ActionId(id)).unwrap().unwrap();
    assert_eq!(
        record.outcome,
        Some(backstop_store::Outcome::Escalated),
        "the last attempt was uncertain: reconciled (here escalated), never cancelled"
    );
    assert_eq!(
        h.transport.sent_to("/v1/transfers").len(),
        1,
        "nothing sent"
    );
    throttled.abort();
}

/// `engine.submit(spec)` run to its answer without moving virtual time: a write's record is
/// committed by the store's writer thread, and awaiting it here would let paused time jump to
/// the next timer (a held attempt's end, a retry's wake) meanwhile.
async fn submitted(engine: &Engine, spec: ActionSpec) -> Result<Submitted, Execution> {
    let engine = engine.clone();
    let submitting = tokio::spawn(async move { engine.submit(spec).await });
    assert!(until(|| submitting.is_finished()).await, "never answered");
    submitting.await.unwrap()
}

/// A same-key resend asking for a background answer (`Prefer: respond-async`, which the door
/// hands to `Engine::submit`) before the instant its answer advised runs nothing, so it is never
/// told it was accepted: it gets the replay a resend without the preference gets (`429` with the
/// `Retry-After` left). From the instant on it reopens the write and runs it in the background,
/// sent once more; after that, the success is replayed and nothing runs.
#[tokio::test(start_paused = true)]
async fn a_background_resend_runs_nothing_before_the_advised_instant_and_the_write_from_it_on() {
    let h = Harness::new();
    h.transport.script(
        "/v1/transfers",
        vec![
            answer(429, &[("retry-after", "11")], ""),
            answer(201, &[], r#"{"id":"tr_1"}"#),
        ],
    );
    let first = h.engine.execute(transfer(&h, "k-async")).await;
    let id = first.receipt().action_id;
    assert_eq!(summary(&first), "budget_exhausted");

    advance(Duration::from_secs(5)).await;
    let early = submitted(&h.engine, transfer(&h, "k-async"))
        .await
        .expect_err("nothing runs before the advised instant");
    let (outcome, _, detail) = outcome_of(&early);
    assert_eq!(outcome, Outcome::BudgetExhausted);
    assert!(detail.starts_with("replayed"), "{detail}");
    assert_eq!(early.receipt().action_id, id);
    let told = problem(&early, h.clock_now());
    assert_eq!(
        (
            told.status.as_u16(),
            told.retry_after_seconds,
            told.should_retry
        ),
        (429, Some(6), false),
        "as the resend without the preference is answered"
    );
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 1);
    assert!(reopens(&h, id).is_empty());

    advance(Duration::from_secs(7)).await;
    let accepted = submitted(&h.engine, transfer(&h, "k-async"))
        .await
        .expect("from the advised instant on, the resend runs the write");
    assert_eq!(accepted.receipt.action_id, id, "the same action");
    assert!(!accepted.joined);
    assert_eq!(accepted.receipt.attempts, 1, "its earlier attempt counts");
    assert_eq!(accepted.receipt.task.as_deref(), Some("t"));
    let completion = h.engine.completion(id).expect("kept for the action API");
    assert!(until(|| completion.borrow().is_some()).await, "it ran");
    let sent = h.transport.sent_to("/v1/transfers");
    assert_eq!(sent.len(), 2, "sent once more: {sent:?}");
    assert!(sent
        .iter()
        .all(|s| s.idempotency_key.as_deref() == Some(upstream("k-async").as_str())));
    let record = h.store.action(ActionId(id)).unwrap().unwrap();
    assert_eq!(record.outcome, Some(backstop_store::Outcome::Succeeded));
    assert_eq!(reopens(&h, id).len(), 1);

    // Finished for good: a background resend gets the success replayed; nothing runs.
    let again = submitted(&h.engine, transfer(&h, "k-async"))
        .await
        .expect_err("a replay runs nothing");
    assert_eq!(response_of(&again), (201, true));
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 2);
}

/// A background resend of a write still running joins it (told so: nothing new runs) and gets
/// its outcome; one of a write unfinished but not running (its retry waits across a restart)
/// runs nothing and is answered `409 idempotency_key_in_flight`, as without the preference.
#[tokio::test(start_paused = true)]
async fn a_background_resend_joins_a_running_write_and_is_refused_for_one_not_running() {
    let h = Harness::new();
    h.transport.script(
        "/v1/transfers",
        vec![Step::Status {
            status: 201,
            headers: Vec::new(),
            body: r#"{"id":"tr_5"}"#,
            hold: Duration::from_secs(5),
        }],
    );
    let mut spec = transfer(&h, "k-running");
    spec.max_wait = None;
    let running = h.spawn(spec);
    assert!(until(|| h.transport.sent_to("/v1/transfers").len() == 1).await);
    let joined = submitted(&h.engine, transfer(&h, "k-running"))
        .await
        .expect("joined to the running write");
    assert!(joined.joined, "nothing new runs for it");
    let id = joined.receipt.action_id;
    advance(Duration::from_secs(6)).await;
    let first = running.await.unwrap();
    assert_eq!(summary(&first), "201");
    assert_eq!(first.receipt().action_id, id);
    let completion = h.engine.completion(id).expect("kept");
    assert!(until(|| completion.borrow().is_some()).await);
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 1, "one send");

    // A write whose retry waits across a restart: unfinished, and nothing runs it.
    h.transport.script(
        "/v1/transfers",
        vec![answer(503, &[("retry-after", "30")], "")],
    );
    let mut waiting = transfer(&h, "k-waiting");
    waiting.max_wait = None;
    let waiting = h.spawn(waiting);
    assert!(until(|| h.transport.sent_to("/v1/transfers").len() == 2).await);
    advance(Duration::from_millis(100)).await;
    h.engine.shutdown().await;
    assert_eq!(summary(&waiting.await.unwrap()), "503");
    let engine = h.restarted(9);
    let refused = submitted(&engine, transfer(&h, "k-waiting"))
        .await
        .expect_err("nothing runs it");
    assert!(
        matches!(refused, Execution::InFlight { .. }),
        "{}",
        summary(&refused)
    );
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 2);
}

// ---- over loopback, counted at the fake provider ----

const AGENT_TOKEN: &str = "agent-token-resend-4e1f";
const OPERATOR_TOKEN: &str = "operator-token-resend-2b7c";

fn policy_yaml(base_url: &str) -> String {
    support::policy_yaml(
        base_url,
        &format!(
            "{}{}",
            support::RETRYING_CLASSES,
            support::TEST_AGENT_AND_ONCALL
        ),
        r#"    error_code_pointer: /error/code
    routes:
      "POST /v1/transfers": { class: idempotent_write, scopes: [account] }
      "POST /v1/orders": { class: idempotent_write, scopes: [account] }
"#,
    )
}

fn env(name: &str) -> Option<String> {
    support::agent_oncall_secret(name, AGENT_TOKEN, OPERATOR_TOKEN, "sk-fake-resend-5678")
}

async fn start_gateway(base_url: &str, dir: &Path) -> backstop_gateway::server::Running {
    let options = support::serve_options(dir, 61);
    support::start_gateway(&policy_yaml(base_url), "resend.yaml", &env, options).await
}

/// The fake: a transfer is stored and its connection dropped on the first call; an order meets
/// `429 insufficient_quota` on the first call. Both honour idempotency keys.
fn fake() -> backstop_fake_api::RunningFake {
    let config = FakeConfig::default()
        .with_route(
            RouteConfig::new("POST /v1/transfers", create("transfers", "tr_"))
                .with_idempotency()
                .with_fault(FaultRule::on_calls(
                    [1],
                    Fault::StoreThenDrop { hold_ms: 0 },
                )),
        )
        .with_route(RouteConfig::new("GET /v1/transfers", lookup("transfers")))
        .with_route(
            RouteConfig::new("POST /v1/orders", create("orders", "or_"))
                .with_idempotency()
                .with_fault(FaultRule::on_calls(
                    [1],
                    Fault::ErrorCode {
                        status: 429,
                        code: "insufficient_quota".into(),
                        message: "You exceeded your current quota".into(),
                    },
                )),
        );
    support::start_fake(config)
}

async fn post(
    gateway: &backstop_gateway::server::Running,
    path: &str,
    key: &str,
) -> reqwest::Response {
    client()
        .post(format!("http://{}/fake{path}", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("X-Backstop-Task", "run-resend")
        .header("Idempotency-Key", key)
        .header("Prefer", "wait=0")
        .header("content-type", "application/json")
        .body(r#"{"amount":100}"#)
        .send()
        .await
        .expect("request")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncertain_write_resent_after_the_advised_delay_goes_out_under_the_same_key() {
    let fake = fake();
    let dir = tempfile::tempdir().expect("tempdir");
    let gateway = start_gateway(&fake.url(), dir.path()).await;

    let first = post(&gateway, "/v1/transfers", "tr-same-1").await;
    assert_eq!(first.status(), 429);
    assert_eq!(first.headers()["x-should-retry"], "false");
    let wait: u64 = first.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let (_, body) = json_of(first).await;
    assert_eq!(body["outcome"], "budget_exhausted", "{body}");
    assert_eq!(body["last_signal"], "uncertain", "{body}");
    assert_eq!(on_route(&fake.attempts(), "POST", "/v1/transfers").len(), 1);

    // As an agent that resends explicitly does (its SDK does not, told `x-should-retry: false`):
    // wait the Retry-After, then send the same request under the same key.
    tokio::time::sleep(Duration::from_secs(wait)).await;
    let resent = post(&gateway, "/v1/transfers", "tr-same-1").await;
    assert_eq!(resent.status(), 201, "{:?}", resent.headers());
    let attempts = fake.attempts();
    let creates = on_route(&attempts, "POST", "/v1/transfers");
    assert_eq!(creates.len(), 2, "exactly one more send: {attempts:?}");
    let key = upstream_idempotency_key("test-agent", "tr-same-1");
    assert!(
        creates
            .iter()
            .all(|c| c.idempotency_key.as_deref() == Some(key.as_str())),
        "the SAME key: {creates:?}"
    );
    assert!(creates[1].replayed, "the provider deduplicated it");
    // One stored object at the provider.
    let (status, stored) = json_of(
        client()
            .get(format!("{}/v1/transfers?idempotency_key={key}", fake.url()))
            .bearer_auth("sk-fake-resend-5678")
            .send()
            .await
            .expect("lookup"),
    )
    .await;
    assert_eq!(status, 200, "{stored}");
    assert_eq!(stored["data"].as_array().map(Vec::len), Some(1), "{stored}");
    gateway.shutdown().await.expect("shutdown");
    fake.shutdown().await;
}

/// Over loopback, as an SDK asking for background answers does: a respond-async resend before
/// the advised instant is answered `429` with the `Retry-After` left — not `202` for a run that
/// never comes; after it, `202` for the same action, which is sent once more (counted at the
/// fake provider) and ends `succeeded`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_respond_async_resend_is_told_to_wait_then_accepted_and_really_sent() {
    let fake = fake();
    let dir = tempfile::tempdir().expect("tempdir");
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let send = |prefer: &'static str| {
        client()
            .post(format!("http://{}/fake/v1/transfers", gateway.addr))
            .bearer_auth(AGENT_TOKEN)
            .header("X-Backstop-Task", "run-resend")
            .header("Idempotency-Key", "tr-async-1")
            .header("Prefer", prefer)
            .header("content-type", "application/json")
            .body(r#"{"amount":100}"#)
            .send()
    };

    let first = send("wait=0").await.expect("first");
    assert_eq!(first.status(), 429);
    let id = support::action_id(&first);
    let wait: u64 = first.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();

    let early = send("wait=0, respond-async").await.expect("early");
    assert_eq!(early.status(), 429, "{:?}", early.headers());
    assert_eq!(early.headers()["x-should-retry"], "false");
    assert_eq!(early.headers()["idempotent-replayed"], "true");
    assert!(early.headers().contains_key("retry-after"));
    assert!(!early.headers().contains_key("location"));
    assert!(!early.headers().contains_key("preference-applied"));
    assert_eq!(support::action_id(&early), id);
    let (_, body) = json_of(early).await;
    assert_eq!(body["outcome"], "budget_exhausted", "{body}");
    assert_eq!(on_route(&fake.attempts(), "POST", "/v1/transfers").len(), 1);

    tokio::time::sleep(Duration::from_secs(wait)).await;
    let accepted = send("wait=0, respond-async").await.expect("accepted");
    assert_eq!(accepted.status(), 202);
    assert_eq!(accepted.headers()["preference-applied"], "respond-async");
    assert_eq!(accepted.headers()["backstop-attempts"], "1");
    let location = format!("/v1/actions/{id}");
    assert_eq!(accepted.headers()["location"], location.as_str());
    assert_eq!(support::action_id(&accepted), id);
    let (_, body) = json_of(accepted).await;
    assert_eq!(body["state"], "accepted", "{body}");
    assert_eq!(body["id"], id);

    let (status, view) = support::action_view(&gateway, AGENT_TOKEN, id, Some("10s")).await;
    assert_eq!(status, 200, "{view}");
    assert_eq!(view["outcome"], "succeeded", "{view}");
    assert_eq!(view["attempts"], 2, "{view}");
    let attempts = fake.attempts();
    let creates = on_route(&attempts, "POST", "/v1/transfers");
    assert_eq!(creates.len(), 2, "sent once more: {attempts:?}");
    let key = upstream_idempotency_key("test-agent", "tr-async-1");
    assert!(creates
        .iter()
        .all(|c| c.idempotency_key.as_deref() == Some(key.as_str())));
    gateway.shutdown().await.expect("shutdown");
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_wait_on_an_exhausted_quota_lets_the_same_key_resend_go_out() {
    let fake = fake();
    let dir = tempfile::tempdir().expect("tempdir");
    let gateway = start_gateway(&fake.url(), dir.path()).await;

    let first = post(&gateway, "/v1/orders", "order-wait-1").await;
    assert_eq!(first.status(), 429);
    let id = support::action_id(&first);
    let (_, body) = json_of(first).await;
    assert_eq!(body["outcome"], "quota_exhausted", "{body}");
    let escalation = support::open_escalation_of(&gateway, OPERATOR_TOKEN, id).await;
    assert_eq!(escalation["reason"], "shared_quota_exhausted");
    let escalation = escalation["id"].as_i64().expect("id");

    // Undecided: the resend replays the outcome, nothing is sent.
    let early = post(&gateway, "/v1/orders", "order-wait-1").await;
    assert_eq!(early.status(), 429);
    assert_eq!(on_route(&fake.attempts(), "POST", "/v1/orders").len(), 1);

    let (status, decided) = support::decide(
        &gateway,
        OPERATOR_TOKEN,
        escalation,
        json!({"option": "wait"}),
    )
    .await;
    assert_eq!(status, 200, "{decided}");

    // The case file said: resubmit under the same key. It is sent, as the same action.
    let resent = post(&gateway, "/v1/orders", "order-wait-1").await;
    assert_eq!(resent.status(), 201);
    assert_eq!(support::action_id(&resent), id);
    let attempts = fake.attempts();
    let creates = on_route(&attempts, "POST", "/v1/orders");
    assert_eq!(creates.len(), 2, "{attempts:?}");
    let key = upstream_idempotency_key("test-agent", "order-wait-1");
    assert!(creates
        .iter()
        .all(|c| c.idempotency_key.as_deref() == Some(key.as_str())));
    // The decision was used: the next resend replays the success.
    let again = post(&gateway, "/v1/orders", "order-wait-1").await;
    assert_eq!(again.status(), 201);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(on_route(&fake.attempts(), "POST", "/v1/orders").len(), 2);

    gateway.shutdown().await.expect("shutdown");
    let store =
        backstop_store::SqliteStore::open_existing(dir.path().join("backstop.db")).expect("store");
    let reopened: Vec<_> = store
        .audit_events(0, 10_000)
        .expect("audit")
        .into_iter()
        .filter(|e| e.action == Some(id) && e.kind == ACTION_REOPENED)
        .collect();
    assert_eq!(reopened.len(), 1);
    assert_eq!(reopened[0].escalation, Some(escalation));
    assert_eq!(reopened[0].outcome.as_deref(), Some("quota_exhausted"));
    fake.shutdown().await;
}

/// Many same-key resends at once after the operator's `wait`: one reopens and sends the write;
/// every other one joins it, is told it is in flight (`409`), or — once the send has ended —
/// gets its new outcome replayed. None gets the stale `429 quota_exhausted` of before the
/// decision: a resend that finds the decision used (an attempt after it) while it still holds
/// the outcome it read first answers as the action stands now, never with that old outcome
/// (an agent told `quota_exhausted` might send the write again under a new key). Six rounds,
/// since the race needs a resend to read the action before the reopen and its attempts after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_resends_after_a_decision_never_replay_the_outcome_it_set_aside() {
    const ROUNDS: usize = 6;
    const RESENDS: usize = 24;
    // Odd calls meet the quota; the one resend of each round that goes out is created.
    let fake = support::start_fake(
        FakeConfig::default().with_route(
            RouteConfig::new("POST /v1/orders", create("orders", "or_"))
                .with_idempotency()
                .with_fault(FaultRule::on_calls(
                    [1, 3, 5, 7, 9, 11],
                    Fault::ErrorCode {
                        status: 429,
                        code: "insufficient_quota".into(),
                        message: "You exceeded your current quota".into(),
                    },
                )),
        ),
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    for round in 0..ROUNDS {
        let key = format!("order-race-{round}");
        let first = post(&gateway, "/v1/orders", &key).await;
        assert_eq!(first.status(), 429, "round {round}");
        let id = support::action_id(&first);
        let escalation = support::open_escalation_of(&gateway, OPERATOR_TOKEN, id).await;
        let escalation = escalation["id"].as_i64().expect("id");
        let (status, decided) = support::decide(
            &gateway,
            OPERATOR_TOKEN,
            escalation,
            json!({"option": "wait"}),
        )
        .await;
        assert_eq!(status, 200, "{decided}");

        let resends: Vec<_> = (0..RESENDS)
            .map(|_| {
                let (addr, key) = (gateway.addr, key.clone());
                tokio::spawn(async move {
                    // The same request as `post`'s.
                    client()
                        .post(format!("http://{addr}/fake/v1/orders"))
                        .bearer_auth(AGENT_TOKEN)
                        .header("X-Backstop-Task", "run-resend")
                        .header("Idempotency-Key", key)
                        .header("Prefer", "wait=0")
                        .header("content-type", "application/json")
                        .body(r#"{"amount":100}"#)
                        .send()
                        .await
                        .expect("resend")
                        .status()
                        .as_u16()
                })
            })
            .collect();
        let mut statuses = Vec::new();
        for resend in resends {
            statuses.push(resend.await.expect("task"));
        }
        assert!(
            statuses.iter().all(|s| matches!(s, 201 | 409)),
            "round {round}: {statuses:?}"
        );
        assert!(statuses.contains(&201), "round {round}: {statuses:?}");
        let creates = on_route(&fake.attempts(), "POST", "/v1/orders").len();
        assert_eq!(
            creates,
            2 * (round + 1),
            "round {round}: one send per round"
        );
    }
    gateway.shutdown().await.expect("shutdown");
    fake.shutdown().await;
}

/// A reopened write refused again before its new send (its scope closed meanwhile, and the
/// resend allows no wait) answers with what its earlier attempt got from the provider, as
/// the outcome it set aside did — not with an empty context as if nothing had come back.
#[tokio::test(start_paused = true)]
async fn a_reopened_write_refused_before_its_new_send_still_names_the_providers_last_answer() {
    let h = Harness::new();
    h.transport.script(
        "/v1/transfers",
        vec![answer(429, &[("retry-after", "4")], "")],
    );
    let first = h.engine.execute(transfer(&h, "k-refused")).await;
    assert_eq!(outcome_of(&first).0, Outcome::BudgetExhausted);
    advance(Duration::from_secs(5)).await;
    // Another call of the scope meets a 429: the scope waits 3 s.
    h.transport.script(
        "/v1/items/0",
        vec![answer(429, &[("retry-after", "3")], "")],
    );
    let read = h.spawn(h.get("t", "/v1/items/0"));
    assert!(until(|| h.transport.sent_to("/v1/items/0").len() == 1).await);

    let again = h.engine.execute(transfer(&h, "k-refused")).await;
    let (outcome, context, detail) = outcome_of(&again);
    assert_eq!(outcome, Outcome::BudgetExhausted, "{detail}");
    assert!(
        !detail.starts_with("replayed"),
        "reopened, then refused: {detail}"
    );
    assert_eq!(
        h.transport.sent_to("/v1/transfers").len(),
        1,
        "not sent again"
    );
    assert!(context.sent, "{context:?}");
    assert_eq!(context.attempts, 1, "{context:?}");
    assert!(context.response_received, "{context:?}");
    assert_eq!(context.last_status, Some(429), "{context:?}");
    assert_eq!(
        context.last_signal.as_deref(),
        Some("rate_limited"),
        "{context:?}"
    );
    advance(Duration::from_secs(30)).await;
    let _ = read.await;
}

/// Two writes of one scope meet the exhausted quota: the first opens the scope's
/// `shared_quota_exhausted` escalation, the second ends beside it without one of its own. The
/// operator's `wait` on that one escalation answers both: each write's same-key resend is sent
/// as its own action, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_decision_on_the_scopes_quota_escalation_lets_every_write_of_the_scope_resend()
{
    let fake = support::start_fake(
        FakeConfig::default().with_route(
            RouteConfig::new("POST /v1/orders", create("orders", "or_"))
                .with_idempotency()
                .with_fault(FaultRule::on_calls(
                    [1, 2],
                    Fault::ErrorCode {
                        status: 429,
                        code: "insufficient_quota".into(),
                        message: "You exceeded your current quota".into(),
                    },
                )),
        ),
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let gateway = start_gateway(&fake.url(), dir.path()).await;

    let first = post(&gateway, "/v1/orders", "order-scope-1").await;
    assert_eq!(first.status(), 429);
    let first_id = support::action_id(&first);
    let second = post(&gateway, "/v1/orders", "order-scope-2").await;
    assert_eq!(second.status(), 429);
    let second_id = support::action_id(&second);
    let (_, body) = json_of(second).await;
    assert!(
        body["detail"]
            .as_str()
            .is_some_and(|d| d.contains("already open")),
        "{body}"
    );
    let escalation = support::open_escalation_of(&gateway, OPERATOR_TOKEN, first_id).await;
    let escalation = escalation["id"].as_i64().expect("id");

    // Undecided: the second write's resend replays, nothing is sent.
    let early = post(&gateway, "/v1/orders", "order-scope-2").await;
    assert_eq!(early.status(), 429);
    assert_eq!(on_route(&fake.attempts(), "POST", "/v1/orders").len(), 2);

    let (status, decided) = support::decide(
        &gateway,
        OPERATOR_TOKEN,
        escalation,
        json!({"option": "wait"}),
    )
    .await;
    assert_eq!(status, 200, "{decided}");
    for (key, id) in [("order-scope-2", second_id), ("order-scope-1", first_id)] {
        let resent = post(&gateway, "/v1/orders", key).await;
        assert_eq!(resent.status(), 201, "{key}");
        assert_eq!(support::action_id(&resent), id, "{key}: the same action");
    }
    assert_eq!(on_route(&fake.attempts(), "POST", "/v1/orders").len(), 4);
    // Each decision is used once per write: the next resends replay the successes.
    for key in ["order-scope-2", "order-scope-1"] {
        let again = post(&gateway, "/v1/orders", key).await;
        assert_eq!(again.status(), 201, "{key}");
        assert_eq!(again.headers()["idempotent-replayed"], "true", "{key}");
    }
    assert_eq!(on_route(&fake.attempts(), "POST", "/v1/orders").len(), 4);
    gateway.shutdown().await.expect("shutdown");
    fake.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_write_refused_scope_saturated_is_sent_once_when_resent_under_its_key() {
    let h = Harness::new();
    // The scope `account` has 4 concurrency slots and room for 3 delayed actions: four reads
    // held by the provider take the slots and three more wait for one, so the transfer finds
    // the scope full with no boundary to name (a full scope, not a provider's limit).
    let mut readers = Vec::new();
    for i in 0..7 {
        let path = format!("/v1/items/{i}");
        h.transport.hold(&path, Duration::from_secs(10));
        readers.push(h.spawn(h.get(&format!("reader-{i}"), &path)));
        advance(Duration::from_millis(10)).await;
    }
    h.transport
        .script("/v1/transfers", vec![answer(201, &[], r#"{"id":"tr_9"}"#)]);
    let mut spec = transfer(&h, "k-saturated");
    spec.max_wait = None;
    // Awaited without letting virtual time run: the boundary must not pass while the write's
    // record commits.
    let refused = h.spawn(spec.clone());
    assert!(until(|| refused.is_finished()).await);
    let refused = refused.await.unwrap();
    let id = refused.receipt().action_id;
    let (outcome, context, _) = outcome_of(&refused);
    assert_eq!(outcome, Outcome::ScopeSaturated);
    assert!(!context.sent);
    assert_eq!(wait_until(&context), None, "no instant is promised");
    assert!(h.transport.sent_to("/v1/transfers").is_empty());

    // Capacity comes back; the same request under the same key is a fresh try of the action.
    advance(Duration::from_secs(40)).await;
    for reader in readers {
        assert_eq!(summary(&reader.await.unwrap()), "200");
    }
    let resent = h.engine.execute(spec.clone()).await;
    assert_eq!(resent.receipt().action_id, id, "the same action");
    assert_eq!(response_of(&resent), (201, false));
    let sent = h.transport.sent_to("/v1/transfers");
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(
        sent[0].idempotency_key.as_deref(),
        Some(upstream("k-saturated").as_str())
    );
    let reopened = reopens(&h, id);
    assert_eq!(reopened.len(), 1, "{reopened:?}");
    assert_eq!(reopened[0].outcome.as_deref(), Some("scope_saturated"));
    assert_eq!(reopened[0].boundary, None);

    // Now it completed: a further resend replays the success, nothing more is sent.
    let again = h.engine.execute(spec).await;
    assert_eq!(response_of(&again), (201, true));
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 1);
    let stored = h.store.action(ActionId(id)).unwrap().expect("action");
    assert_eq!(stored.outcome, Some(backstop_store::Outcome::Succeeded));
}
