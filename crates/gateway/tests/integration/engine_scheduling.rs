//! Scheduling through the engine with paused time: dispatch order, one 429 delaying a whole
//! scope, no attempt before a boundary, jittered release, `scope_saturated`, priorities,
//! coalescing, cancellation before send, and a write whose client disconnects after an
//! uncertain attempt — in this run, or before a reopened write's new send (reconciled, never
//! cancelled). Attempts are measured at the scripted transport.

use std::time::Duration;

use backstop_core::{classify::TransportError, escalation::DecisionEffect, pacing::Priority};
use backstop_gateway::action::Execution;
use backstop_store::{ActionId, ActionState, Disposition, Outcome, Store};

use crate::engine_support::{
    self, advance, answer, attempts, held_ok, summary, until, Harness, Step,
};

const SEC: Duration = Duration::from_secs(1);

#[tokio::test(start_paused = true)]
async fn dispatch_follows_arrival_order_when_one_slot_is_free() {
    let h = Harness::new();
    h.transport.hold("/v1/slow/1", SEC);
    h.transport.hold("/v1/slow/2", SEC);
    h.transport.hold("/v1/slow/3", SEC);
    let mut handles = Vec::new();
    for (i, task) in ["a", "b", "c"].iter().enumerate() {
        handles.push(h.spawn(h.get(task, &format!("/v1/slow/{}", i + 1))));
        advance(Duration::from_millis(10)).await;
    }
    for handle in handles {
        assert_eq!(summary(&handle.await.unwrap()), "200");
    }
    let sent = h.transport.sent();
    let order: Vec<&str> = sent.iter().map(|s| s.path.as_str()).collect();
    assert_eq!(order, ["/v1/slow/1", "/v1/slow/2", "/v1/slow/3"]);
    // One slot: each attempt leaves only when the previous one released it.
    for pair in sent.windows(2) {
        let gap = pair[1].at.duration_since(pair[0].at).as_secs_f64();
        assert!(gap >= 0.99, "attempts overlapped: {gap} s apart");
    }
}

#[tokio::test(start_paused = true)]
async fn deadline_is_checked_before_the_scope_boundary_and_refuses_at_once() {
    let h = Harness::new();
    h.transport.script(
        "/v1/items/1",
        vec![answer(429, &[("retry-after", "10")], "")],
    );
    let first = h.spawn(h.get("a", "/v1/items/1"));
    advance(Duration::from_millis(100)).await;
    // Task b's deadline (t+5 s) lies before the scope's boundary (t+10 s): SPEC §4.1 rule 1-2.
    let mut spec = h.get("b", "/v1/items/2");
    spec.deadline = Some(h.t0 + jiff::SignedDuration::from_secs(5));
    let before = h.clock_now();
    let execution = h.engine.execute(spec).await;
    assert_eq!(summary(&execution), "deadline_exhausted");
    assert_eq!(h.clock_now(), before, "it must not sleep into failure");
    assert_eq!(attempts(&execution), 0);
    let Execution::Outcome { context, .. } = &execution else {
        panic!("an outcome")
    };
    assert_eq!(
        context.boundary,
        Some(h.t0 + jiff::SignedDuration::from_secs(10))
    );
    assert!(h.transport.sent_to("/v1/items/2").is_empty());
    first.abort();
}

#[tokio::test(start_paused = true)]
async fn one_429_delays_all_work_of_its_scope_including_other_tasks() {
    let h = Harness::new();
    h.transport.script(
        "/v1/items/1",
        vec![answer(429, &[("retry-after", "10")], "")],
    );
    let a = h.spawn(h.get("task-a", "/v1/items/1"));
    advance(SEC).await;
    // The scope record carries the boundary before the retry is scheduled.
    let view = h
        .engine
        .scopes()
        .into_iter()
        .find(|v| v.scope == "account")
        .expect("scope account");
    assert_eq!(
        view.next_allowed_at,
        Some(h.t0 + jiff::SignedDuration::from_secs(10))
    );
    assert_eq!(view.source.as_deref(), Some("HTTP 429 Retry-After"));
    assert_eq!(view.remaining, Some(0));
    // Another task, another item, same scope: it has not started yet and must wait too.
    let b = h.spawn(h.get("task-b", "/v1/items/2"));
    let c = h.spawn(h.get("task-c", "/v1/items/3"));
    advance(SEC).await;
    assert_eq!(
        h.transport.sent().len(),
        1,
        "nothing may leave before the boundary"
    );
    let delayed = h
        .engine
        .scopes()
        .into_iter()
        .find(|v| v.scope == "account")
        .unwrap()
        .delayed;
    assert_eq!(
        delayed, 3,
        "the retry and the two new actions wait in the delayed queue"
    );
    for handle in [a, b, c] {
        let execution = handle.await.unwrap();
        assert_eq!(summary(&execution), "200");
    }
    let boundary = h.t0 + jiff::SignedDuration::from_secs(10);
    let sent = h.transport.sent();
    assert_eq!(
        sent.len(),
        4,
        "exactly one retry plus the two reads: {sent:?}"
    );
    for s in &sent[1..] {
        assert!(
            s.at >= boundary,
            "{} sent at {} before the boundary",
            s.path,
            s.at
        );
    }
    // The scope update is audited before the retry is scheduled.
    let audit = h.audit();
    let updated = audit
        .iter()
        .position(|e| e.kind == "scope_updated")
        .unwrap();
    let scheduled = audit
        .iter()
        .position(|e| e.kind == "retry_scheduled")
        .unwrap();
    assert!(
        updated < scheduled,
        "scope_updated must precede retry_scheduled"
    );
    // The stored record survives for a restart.
    let stored = h
        .store
        .scope("billing", "billing/account")
        .unwrap()
        .unwrap();
    assert_eq!(stored.next_allowed_at, Some(boundary));
    assert!(h
        .metrics
        .render()
        .contains("retry_after_debt_seconds_total{scope=\"billing/account\"} 10"));
}

#[tokio::test(start_paused = true)]
async fn actions_released_by_one_boundary_are_spread_by_jitter() {
    let h = Harness::new();
    h.transport.script(
        "/v1/items/0",
        vec![answer(429, &[("retry-after", "10")], "")],
    );
    let first = h.spawn(h.get("t0", "/v1/items/0"));
    advance(SEC).await;
    let mut handles = vec![first];
    for i in 1..=2 {
        handles.push(h.spawn(h.get(&format!("t{i}"), &format!("/v1/items/{i}"))));
    }
    for handle in handles {
        assert_eq!(summary(&handle.await.unwrap()), "200");
    }
    let boundary = h.t0 + jiff::SignedDuration::from_secs(10);
    let released: Vec<f64> = h.transport.sent()[1..]
        .iter()
        .map(|s| {
            assert!(s.at >= boundary, "no attempt before the boundary");
            h.secs(s.at)
        })
        .collect();
    assert_eq!(released.len(), 3);
    let mut distinct = released.clone();
    distinct.sort_by(f64::total_cmp);
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        3,
        "released together as one burst: {released:?}"
    );
    // Spread over at most the core's spread for the first retry (min(2 s, 5 s)).
    assert!(distinct[2] <= 12.0, "{released:?}");
}

#[tokio::test(start_paused = true)]
async fn scope_saturated_past_max_delayed_requests() {
    let h = Harness::new();
    h.transport.script(
        "/v1/items/0",
        vec![answer(429, &[("retry-after", "30")], "")],
    );
    let first = h.spawn(h.get("t0", "/v1/items/0"));
    advance(SEC).await;
    // The retry of t0 holds one of the 3 delayed places; two more fit.
    let b = h.spawn(h.get("t1", "/v1/items/1"));
    let c = h.spawn(h.get("t2", "/v1/items/2"));
    advance(SEC).await;
    let before = h.clock_now();
    let refused = h.engine.execute(h.get("t3", "/v1/items/3")).await;
    assert_eq!(summary(&refused), "scope_saturated");
    assert_eq!(h.clock_now(), before, "refused at once, not queued");
    assert_eq!(attempts(&refused), 0);
    let Execution::Outcome { receipt, .. } = &refused else {
        panic!("an outcome")
    };
    let action = h
        .store
        .action(backstop_store::ActionId(receipt.action_id))
        .unwrap()
        .unwrap();
    assert_eq!(
        action.outcome,
        Some(backstop_store::Outcome::ScopeSaturated)
    );
    for handle in [first, b, c] {
        assert_eq!(summary(&handle.await.unwrap()), "200");
    }
    assert!(h.transport.sent_to("/v1/items/3").is_empty());
}

#[tokio::test(start_paused = true)]
async fn scope_saturated_tells_the_agent_to_come_back_at_the_scope_boundary() {
    let h = Harness::new();
    h.transport.script(
        "/v1/items/0",
        vec![answer(429, &[("retry-after", "30")], "")],
    );
    let first = h.spawn(h.get("t0", "/v1/items/0"));
    advance(SEC).await;
    let b = h.spawn(h.get("t1", "/v1/items/1"));
    let c = h.spawn(h.get("t2", "/v1/items/2"));
    advance(Duration::from_millis(1500)).await;
    let refused = h.engine.execute(h.get("t3", "/v1/items/3")).await;
    assert_eq!(summary(&refused), "scope_saturated");
    let Execution::Outcome {
        outcome, context, ..
    } = &refused
    else {
        panic!("an outcome")
    };
    // The scope's boundary from the 429 is known: it is where the queue starts to drain.
    let boundary = h.t0 + jiff::SignedDuration::from_secs(30);
    assert_eq!(context.boundary, Some(boundary));
    assert!(
        context
            .next_safe
            .contains(&backstop_core::outcome::NextSafe::WaitUntil { at: boundary }),
        "{:?}",
        context.next_safe
    );
    // Answered 429 with Retry-After in whole seconds, rounded up: 30 s − 2.5 s → 28, and
    // `x-should-retry: false`: the agent's client does not send it again by itself.
    let problem = backstop_gateway::problem::Problem::from_outcome(
        *outcome,
        context,
        "the scope's delayed queue is full",
        h.clock_now(),
    );
    assert_eq!(problem.status.as_u16(), 429);
    assert_eq!(problem.retry_after_seconds, Some(28));
    assert!(!problem.should_retry);
    for handle in [first, b, c] {
        assert_eq!(summary(&handle.await.unwrap()), "200");
    }
    assert!(h.transport.sent_to("/v1/items/3").is_empty());
}

#[tokio::test(start_paused = true)]
async fn interactive_overtakes_background_under_one_slot() {
    let h = Harness::new();
    for i in 0..=4 {
        h.transport.hold(&format!("/v1/slow/{i}"), SEC);
    }
    let holder = h.spawn(h.get("holder", "/v1/slow/0"));
    advance(Duration::from_millis(100)).await;
    let mut handles = vec![holder];
    for i in 1..=3 {
        let mut spec = h.get(&format!("bg{i}"), &format!("/v1/slow/{i}"));
        spec.priority = Priority::Background;
        handles.push(h.spawn(spec));
        advance(Duration::from_millis(10)).await;
    }
    let mut urgent = h.get("human", "/v1/slow/4");
    urgent.priority = Priority::Interactive;
    handles.push(h.spawn(urgent));
    for handle in handles {
        assert_eq!(summary(&handle.await.unwrap()), "200");
    }
    let order: Vec<String> = h.transport.sent().into_iter().map(|s| s.path).collect();
    assert_eq!(
        order,
        [
            "/v1/slow/0",
            "/v1/slow/4",
            "/v1/slow/1",
            "/v1/slow/2",
            "/v1/slow/3"
        ],
        "the interactive action must take the next free slot"
    );
}

#[tokio::test(start_paused = true)]
async fn identical_coalesced_reads_share_one_upstream_call() {
    let h = Harness::new();
    h.transport.script(
        "/v1/rates",
        vec![engine_support::Step::Status {
            status: 200,
            headers: vec![("x-rate", "1.08".to_owned())],
            body: "{\"eur_usd\":1.08}",
            hold: SEC,
        }],
    );
    let handles: Vec<_> = (0..5)
        .map(|i| h.spawn(h.get(&format!("t{i}"), "/v1/rates")))
        .collect();
    let mut ids = Vec::new();
    for handle in handles {
        let Execution::Response { receipt, response } = handle.await.unwrap() else {
            panic!("a response")
        };
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["x-rate"], "1.08");
        let body = axum::body::to_bytes(response.into_body(), 1024)
            .await
            .unwrap();
        assert_eq!(&body[..], b"{\"eur_usd\":1.08}");
        ids.push(receipt.action_id);
    }
    assert_eq!(
        h.transport.sent().len(),
        1,
        "five identical reads, one upstream call"
    );
    ids.dedup();
    assert_eq!(
        ids.len(),
        1,
        "every caller carries the shared action's receipt"
    );
    // A read of a route without coalescing is not shared.
    let a = h.spawn(h.get("x", "/v1/items/9"));
    let b = h.spawn(h.get("y", "/v1/items/9"));
    a.await.unwrap();
    b.await.unwrap();
    assert_eq!(h.transport.sent_to("/v1/items/9").len(), 2);
}

#[tokio::test(start_paused = true)]
async fn coalesced_reads_are_never_shared_across_agents_or_differing_headers() {
    let h = Harness::new();
    h.transport.hold("/v1/rates", SEC);
    let with = |agent: &str, headers: &[(&'static str, &'static str)]| {
        // Each agent its own task: task ids are not namespaced per agent yet, so bob naming
        // alice's task would be refused once her `task_opened` committed (a race, not the
        // coalescing under test).
        let mut spec = h.get(&format!("t-{agent}"), "/v1/rates");
        spec.agent = agent.to_owned();
        for (name, value) in headers {
            spec.request
                .headers
                .append(*name, http::HeaderValue::from_static(value));
        }
        spec
    };
    let calls = vec![
        // alice and bob with identical requests: never one shared call.
        with("alice", &[("cookie", "session=a")]),
        with("bob", &[("cookie", "session=a")]),
        // alice with another tenant, another cookie, a range: each its own call.
        with("alice", &[("cookie", "session=a"), ("x-tenant", "t2")]),
        with("alice", &[("cookie", "session=b")]),
        with("alice", &[("cookie", "session=a"), ("range", "bytes=0-9")]),
        // alice again, differing only in trace context: joins her first call.
        with(
            "alice",
            &[("cookie", "session=a"), ("traceparent", "00-4bf9-00f0-01")],
        ),
    ];
    let handles: Vec<_> = calls.into_iter().map(|spec| h.spawn(spec)).collect();
    let mut ids = Vec::new();
    for handle in handles {
        let execution = handle.await.unwrap();
        assert_eq!(summary(&execution), "200");
        ids.push(execution.receipt().action_id);
    }
    assert_eq!(
        h.transport.sent_to("/v1/rates").len(),
        5,
        "one call per agent and header set"
    );
    assert_ne!(ids[0], ids[1], "bob never carries alice's action id");
    assert_eq!(ids[0], ids[5], "alice's trace-only twin joined her call");
}

#[tokio::test(start_paused = true)]
async fn a_client_disconnecting_before_send_cancels_its_action() {
    let h = Harness::new();
    h.transport.script(
        "/v1/items/0",
        vec![answer(429, &[("retry-after", "10")], "")],
    );
    let first = h.spawn(h.get("t0", "/v1/items/0"));
    advance(SEC).await;
    let waiting = h.spawn(h.get("t1", "/v1/items/1"));
    advance(SEC).await;
    waiting.abort();
    let _ = waiting.await;
    advance(Duration::from_millis(10)).await;
    let view = h
        .engine
        .scopes()
        .into_iter()
        .find(|v| v.scope == "account")
        .unwrap();
    assert_eq!(
        view.delayed, 1,
        "only the 429'd retry still waits; the abandoned place is freed at once"
    );
    advance(Duration::from_secs(30)).await;
    assert_eq!(summary(&first.await.unwrap()), "200");
    assert!(
        h.transport.sent_to("/v1/items/1").is_empty(),
        "a cancelled action never sends"
    );
    let view = h
        .engine
        .scopes()
        .into_iter()
        .find(|v| v.scope == "account")
        .unwrap();
    assert_eq!(
        (view.delayed, view.in_flight),
        (0, 0),
        "slots and delayed places freed"
    );
    let audit = h.audit();
    assert!(
        audit
            .iter()
            .any(|e| e.kind == "cancelled" && e.task.as_deref() == Some("t1")),
        "the cancellation is audited: {:?}",
        audit.iter().map(|e| &e.kind).collect::<Vec<_>>()
    );
}

/// A caller that goes away while its action waits for a retry leaves a `cancelled` context that
/// still says what the provider last answered.
#[tokio::test(start_paused = true)]
async fn a_client_gone_while_its_retry_waits_leaves_the_last_answer_in_the_context() {
    let h = Harness::new();
    h.transport.script(
        "/v1/items/1",
        vec![answer(429, &[("retry-after", "10")], "")],
    );
    let waiting = h.spawn(h.get("t1", "/v1/items/1"));
    advance(SEC).await;
    assert_eq!(h.transport.sent_to("/v1/items/1").len(), 1);
    waiting.abort();
    let _ = waiting.await;
    let id = ActionId(1);
    let outcome = || h.store.action(id).unwrap().unwrap().outcome;
    assert!(until(|| outcome().is_some()).await, "the action is closed");
    assert_eq!(outcome(), Some(Outcome::Cancelled));
    let context = h
        .store
        .action(id)
        .unwrap()
        .unwrap()
        .outcome_context
        .unwrap();
    assert_eq!(context["sent"], true, "{context}");
    assert_eq!(context["attempts"], 1, "{context}");
    assert_eq!(context["response_received"], true, "{context}");
    assert_eq!(context["last_status"], 429, "{context}");
    assert_eq!(context["last_signal"], "rate_limited", "{context}");
    advance(Duration::from_secs(30)).await;
    assert_eq!(
        h.transport.sent_to("/v1/items/1").len(),
        1,
        "never sent again"
    );
}

#[tokio::test(start_paused = true)]
async fn cancel_task_drops_its_delayed_actions_before_they_wake() {
    let h = Harness::new();
    h.transport.script(
        "/v1/items/0",
        vec![answer(429, &[("retry-after", "10")], "")],
    );
    let first = h.spawn(h.get("t0", "/v1/items/0"));
    advance(SEC).await;
    let a = h.spawn(h.get("doomed", "/v1/items/1"));
    let b = h.spawn(h.get("doomed", "/v1/items/2"));
    advance(SEC).await;
    let report = h.engine.cancel_task("doomed", "agent-a").await.unwrap();
    assert_eq!(report.waiting_dropped, 2);
    for handle in [a, b] {
        let execution = handle.await.unwrap();
        assert_eq!(summary(&execution), "cancelled");
        assert_eq!(attempts(&execution), 0);
    }
    assert!(
        h.clock_now() < h.t0 + jiff::SignedDuration::from_secs(10),
        "dropped before the wake"
    );
    assert_eq!(summary(&first.await.unwrap()), "200");
    advance(Duration::from_secs(60)).await;
    assert!(h.transport.sent_to("/v1/items/1").is_empty());
    assert!(h.transport.sent_to("/v1/items/2").is_empty());
    // A new action of the cancelled task is refused too.
    let late = h.engine.execute(h.get("doomed", "/v1/items/3")).await;
    assert_eq!(summary(&late), "cancelled");
    assert!(h.transport.sent_to("/v1/items/3").is_empty());
    // It never became an action: counted as a refusal, under its problem type.
    assert!(
        h.metrics
            .render()
            .contains(r#"backstop_refusals_total{problem="cancelled"} 1"#),
        "{}",
        h.metrics.render()
    );
    // Only the owner may cancel.
    assert!(h.engine.cancel_task("t0", "someone-else").await.is_err());
}

/// A write of `task` under `key`, as the agent sends it.
fn write(h: &Harness, key: &str) -> backstop_gateway::action::ActionSpec {
    let mut spec = h.spec("t", "POST", "/v1/transfers", r#"{"amount":5}"#);
    spec.idempotency_key = Some(key.to_owned());
    spec
}

/// Sends the write under `key` once (single attempt): its attempt times out after its bytes
/// left, so it is escalated as a side effect nobody knows. Returns its action.
async fn escalated_write(h: &Harness, key: &str) -> ActionId {
    h.transport.script(
        "/v1/transfers",
        vec![Step::Fail(TransportError::TimeoutAfterSend)],
    );
    let mut first = write(h, key);
    first.single_attempt = true;
    let escalated = h.engine.execute(first).await;
    assert_eq!(summary(&escalated), "escalated", "{escalated:?}");
    ActionId(escalated.receipt().action_id)
}

/// Waits until the stored action `id` ended, then asserts it was escalated as a side effect
/// nobody knows (never `cancelled`), its reason naming the client that went away.
async fn assert_escalated_for_the_gone_client(h: &Harness, id: ActionId) {
    let outcome = || h.store.action(id).unwrap().unwrap().outcome;
    assert!(until(|| outcome().is_some()).await, "the action is closed");
    assert_eq!(
        outcome(),
        Some(Outcome::Escalated),
        "reconciled, not cancelled"
    );
    let escalations = h.store.open_escalations().unwrap();
    let case = &escalations
        .iter()
        .find(|e| e.action == id)
        .expect("an escalation for the write")
        .case_file;
    assert_eq!(case["reason"], "side_effect_unknown");
    let detail = case["reason_detail"].as_str().unwrap_or("");
    assert!(detail.contains("client disconnected"), "{detail}");
}

/// A write whose caller goes away while it waits for its first send is cancelled: nothing was
/// sent. Nothing at the provider binds its key to that outcome, so a same-key resend reopens
/// the SAME action and sends it, once — the agent never needs a new key for it.
#[tokio::test(start_paused = true)]
async fn a_write_whose_client_disconnects_before_its_first_send_is_cancelled_under_its_key() {
    let h = Harness::new();
    h.transport.script(
        "/v1/items/0",
        vec![answer(429, &[("retry-after", "10")], "")],
    );
    let first = h.spawn(h.get("t0", "/v1/items/0"));
    advance(SEC).await;
    let waiting = h.spawn(write(&h, "key-gone"));
    advance(SEC).await;
    waiting.abort();
    let _ = waiting.await;
    advance(Duration::from_secs(30)).await;
    assert_eq!(summary(&first.await.unwrap()), "200");
    assert!(
        h.transport.sent_to("/v1/transfers").is_empty(),
        "nothing was sent"
    );

    let agent = write(&h, "key-gone").agent;
    let closed = || {
        h.store
            .action_by_key(&agent, "key-gone")
            .unwrap()
            .is_some_and(|a| a.outcome == Some(Outcome::Cancelled))
    };
    assert!(until(closed).await, "the write is closed `cancelled`");
    let cancelled = h
        .store
        .action_by_key(&agent, "key-gone")
        .unwrap()
        .expect("recorded")
        .id;
    let again = h.engine.execute(write(&h, "key-gone")).await;
    assert_eq!(summary(&again), "200", "the same-key resend sends it");
    assert_eq!(again.receipt().action_id, cancelled.0, "as the same action");
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 1);
    let replay = h.engine.execute(write(&h, "key-gone")).await;
    assert_eq!(summary(&replay), "200");
    assert_eq!(
        h.transport.sent_to("/v1/transfers").len(),
        1,
        "a later resend is a replay: nothing more is sent"
    );
}

#[tokio::test(start_paused = true)]
async fn a_write_whose_client_disconnects_after_an_uncertain_attempt_is_reconciled_not_cancelled() {
    let h = Harness::new();
    // The provider honours keys and the route has no lookup: the running write waits for its
    // same-key retry when its caller goes away.
    h.transport.script(
        "/v1/transfers",
        vec![
            Step::Fail(TransportError::TimeoutAfterSend),
            answer(201, &[], "{}"),
        ],
    );
    let waiting = h.spawn(write(&h, "k-gone-1"));
    assert!(until(|| h.store.scheduled_retries().is_ok_and(|r| r.len() == 1)).await);
    let id = h.store.scheduled_retries().unwrap()[0].action;
    waiting.abort();
    let _ = waiting.await;
    assert_escalated_for_the_gone_client(&h, id).await;
    advance(Duration::from_secs(30)).await;
    assert_eq!(h.transport.sent().len(), 1, "the write was never resent");
    let again = h.engine.execute(write(&h, "k-gone-1")).await;
    assert_eq!(summary(&again), "escalated");
    assert_eq!(h.transport.sent().len(), 1);
}

/// A write whose caller goes away while its attempt is at the provider keeps that attempt: the
/// provider's answer is recorded, nothing is escalated, and a same-key resend replays it.
#[tokio::test(start_paused = true)]
async fn a_write_whose_client_disconnects_during_its_attempt_keeps_the_attempt_and_its_answer() {
    let h = Harness::new();
    h.transport
        .script("/v1/transfers", vec![held_ok(Duration::from_secs(60))]);
    let sending = h.spawn(write(&h, "k-gone-2"));
    assert!(until(|| h.transport.sent().len() == 1).await);
    let id = ActionId(
        h.audit()
            .iter()
            .find(|e| e.kind == "action_sent")
            .and_then(|e| e.action)
            .expect("the attempt was recorded sent"),
    );
    sending.abort();
    let _ = sending.await;
    advance(Duration::from_secs(61)).await;
    assert!(until(|| h.store.action(id).unwrap().unwrap().state == ActionState::Finished).await);
    let recorded = h.store.attempts(id).unwrap();
    assert_eq!(recorded.len(), 1);
    assert_eq!(recorded[0].status, Some(200));
    assert!(!h.audit().iter().any(|e| e.kind == "escalated"));
    let resend = h.engine.execute(write(&h, "k-gone-2")).await;
    assert_eq!(summary(&resend), "200");
    let Execution::Response { response, .. } = &resend else {
        panic!("a replayed response")
    };
    assert!(response.headers().contains_key("idempotent-replayed"));
    assert_eq!(h.transport.sent().len(), 1, "the write was never resent");
}

/// A write whose caller goes away while it waits for its retry (no attempt out) is closed at
/// once as before: its first attempt was answered (a definite 503), so it ends `cancelled`,
/// and it never sends again.
#[tokio::test(start_paused = true)]
async fn a_write_whose_client_disconnects_while_it_waits_for_its_retry_is_closed_at_once() {
    let h = Harness::new();
    h.transport.script(
        "/v1/transfers",
        vec![answer(503, &[("retry-after", "30")], "busy")],
    );
    let sending = h.spawn(write(&h, "k-gone-3"));
    assert!(until(|| h.audit().iter().any(|e| e.kind == "retry_scheduled")).await);
    sending.abort();
    let _ = sending.await;
    assert!(until(|| h.audit().iter().any(|e| e.kind == "cancelled")).await);
    advance(Duration::from_secs(90)).await;
    assert_eq!(h.transport.sent().len(), 1, "the write was never resent");
}

/// A write escalated after an uncertain attempt and reopened by an operator's `retry_same_key`
/// (after a restart, so the agent resubmits under the same key) whose caller goes away before
/// the new send: its first attempt may have taken effect, so it is reconciled with its original
/// key as any write whose last attempt is uncertain — escalated again, never `cancelled`.
#[tokio::test(start_paused = true)]
async fn a_reopened_write_whose_client_disconnects_before_its_new_send_is_reconciled_not_cancelled()
{
    let h = Harness::new();
    let id = escalated_write(&h, "k-reopened").await;
    h.engine.shutdown().await;

    // The next run: the operator decides `retry_same_key`; the request is not held any more,
    // so the action is reopened and waits for the agent's resubmission under the same key.
    let engine = h.restarted(5);
    let escalation = h.store.open_escalations().unwrap()[0].id;
    let at = h.clock_now();
    h.store
        .decide_escalation(escalation, "retry_same_key", "operator", None, at)
        .unwrap();
    let applied = engine
        .apply_decision(
            id,
            &DecisionEffect::RetrySameKey {
                idempotency_key: "k-reopened".to_owned(),
            },
            "operator",
        )
        .await;
    assert!(applied.request_not_held, "{}", applied.detail);
    assert_eq!(
        h.store.action(id).unwrap().unwrap().state,
        ActionState::Reopened
    );

    // The scope waits out a 429, so the resubmission waits before its send; its caller leaves.
    h.transport.script(
        "/v1/items/0",
        vec![answer(429, &[("retry-after", "10")], "")],
    );
    let throttled = {
        let engine = engine.clone();
        let read = h.get("t0", "/v1/items/0");
        tokio::spawn(async move { engine.execute(read).await })
    };
    assert!(until(|| h.transport.sent_to("/v1/items/0").len() == 1).await);
    let resubmitted = {
        let engine = engine.clone();
        let again = write(&h, "k-reopened");
        tokio::spawn(async move { engine.execute(again).await })
    };
    let waiting = || {
        engine
            .scopes()
            .into_iter()
            .any(|v| v.scope == "account" && v.delayed == 2)
    };
    assert!(until(waiting).await, "the resubmission waits for the scope");
    resubmitted.abort();
    let _ = resubmitted.await;

    assert_escalated_for_the_gone_client(&h, id).await;
    advance(Duration::from_secs(30)).await;
    assert_eq!(summary(&throttled.await.unwrap()), "200");
    assert_eq!(
        h.transport.sent_to("/v1/transfers").len(),
        1,
        "the write was never sent again"
    );
    let again = engine.execute(write(&h, "k-reopened")).await;
    assert_eq!(summary(&again), "escalated");
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 1);
    engine.shutdown().await;
}

/// A write whose first attempt timed out after its bytes left (`uncertain`) is resent under its
/// key (the provider honours it); that resend is answered `429`, which says nothing about the
/// first attempt. Its caller leaving while the retry waits must not close it `cancelled` as if
/// nothing had happened: the first attempt may have been acted on, so it is reconciled.
#[tokio::test(start_paused = true)]
async fn a_write_whose_same_key_resend_got_a_429_after_an_uncertain_attempt_is_reconciled_when_its_client_leaves(
) {
    let h = Harness::new();
    h.transport.script(
        "/v1/transfers",
        vec![
            Step::Fail(TransportError::TimeoutAfterSend),
            answer(429, &[("retry-after", "10")], ""),
        ],
    );
    let waiting = h.spawn(write(&h, "k-unsettled"));
    let agent = write(&h, "k-unsettled").agent;
    let recorded = || h.store.action_by_key(&agent, "k-unsettled").unwrap();
    assert!(
        until(|| recorded().is_some()).await,
        "the write is recorded"
    );
    let id = recorded().unwrap().id;
    let dispositions = || -> Vec<Option<Disposition>> {
        let attempts = h.store.attempts(id).unwrap();
        attempts.iter().map(|a| a.disposition).collect()
    };
    // The resend follows the timeout after a short backoff, and is answered 429.
    for _ in 0..20 {
        if dispositions().len() == 2 && dispositions()[1].is_some() {
            break;
        }
        advance(Duration::from_millis(250)).await;
    }
    assert_eq!(
        dispositions(),
        [Some(Disposition::Uncertain), Some(Disposition::RateLimited)],
        "an uncertain attempt, then a same-key resend answered 429 whose retry waits"
    );
    let sent = h.transport.sent().len();
    waiting.abort();
    let _ = waiting.await;

    assert_escalated_for_the_gone_client(&h, id).await;
    advance(Duration::from_secs(30)).await;
    assert_eq!(
        h.transport.sent().len(),
        sent,
        "nothing is sent after the caller left"
    );
}

/// An operator's `abort` on an escalated write ends it `cancelled` with a context that says what
/// its attempts did (how many, whether one left, the provider's last answer), as every outcome's
/// context does — not a bare `sent: true`.
#[tokio::test(start_paused = true)]
async fn an_aborted_write_keeps_what_its_attempts_did_in_its_context() {
    let h = Harness::new();
    let id = escalated_write(&h, "k-aborted").await;
    let escalation = h.store.open_escalations().unwrap()[0].id;
    let at = h.clock_now();
    h.store
        .decide_escalation(escalation, "abort", "operator", None, at)
        .unwrap();
    let applied = h
        .engine
        .apply_decision(id, &DecisionEffect::Abort, "operator")
        .await;
    assert!(applied.applied, "{}", applied.detail);
    let stored = h.store.action(id).unwrap().unwrap();
    assert_eq!(stored.outcome, Some(Outcome::Cancelled));
    let context = stored.outcome_context.expect("a context");
    assert_eq!(context["attempts"], 1, "{context}");
    assert_eq!(context["sent"], true, "{context}");
    assert_eq!(context["last_signal"], "uncertain", "{context}");
    assert_eq!(
        context["next_safe"],
        serde_json::json!([{"option": "abort"}]),
        "{context}"
    );
    assert!(
        context["detail"]
            .as_str()
            .is_some_and(|d| d.contains("aborted")),
        "{context}"
    );
}

/// A reconciliation lookup already sent when the write's caller goes away may have reached the
/// provider: it is audited (`reconciliation_lookup`) like every lookup that leaves, even though
/// its answer is never read. Every lookup the provider saw has its event.
#[tokio::test(start_paused = true)]
async fn a_lookup_abandoned_by_a_caller_that_left_is_still_audited() {
    let policy = engine_support::POLICY.replace(
        r#""POST /v1/transfers": { class: idempotent_write, scopes: [account], fingerprint_fields: [/amount] }"#,
        r#""POST /v1/transfers":
        class: idempotent_write
        scopes: [account]
        fingerprint_fields: [/amount]
        reconcile: { by: idempotency_key, lookup: "GET /v1/transfers?key={key}", found_pointer: /data/0/id }"#,
    );
    assert_ne!(policy, engine_support::POLICY);
    let h = Harness::with_policy(&policy);
    let upstream = backstop_core::reconcile::upstream_idempotency_key("agent-a", "k-lookup-left");
    let lookup = format!("/v1/transfers?key={upstream}");
    h.transport.script(
        "/v1/transfers",
        vec![Step::Fail(TransportError::TimeoutAfterSend)],
    );
    h.transport
        .script(&lookup, vec![held_ok(Duration::from_secs(5))]);
    let waiting = h.spawn(write(&h, "k-lookup-left"));
    assert!(
        until(|| h.transport.sent_to(&lookup).len() == 1).await,
        "the lookup left"
    );
    waiting.abort();
    let _ = waiting.await;
    advance(Duration::from_secs(60)).await;

    let audited = || {
        h.audit()
            .into_iter()
            .filter(|e| e.kind == "reconciliation_lookup")
            .count()
    };
    let sent = h.transport.sent_to(&lookup).len();
    assert!(until(|| audited() >= sent).await);
    assert_eq!(audited(), sent, "one event per lookup the provider saw");
}

#[tokio::test(start_paused = true)]
async fn a_read_in_flight_when_its_task_is_cancelled_is_not_retried_after_its_answer() {
    // While the attempt is out, nothing of the task waits in the scheduler, and a read's retry
    // is not held back by the store (it is retried from memory when its job cannot be
    // recorded): the scheduler's record of the cancelled task is what stops the retry.
    let h = Harness::new();
    h.transport.script(
        "/v1/items/1",
        vec![
            engine_support::Step::Status {
                status: 503,
                headers: Vec::new(),
                body: "busy",
                hold: 5 * SEC,
            },
            answer(200, &[], "ok"),
        ],
    );
    let read = h.spawn(h.get("doomed", "/v1/items/1"));
    assert!(engine_support::until(|| h.transport.sent_to("/v1/items/1").len() == 1).await);
    let report = h.engine.cancel_task("doomed", "agent-a").await.unwrap();
    assert_eq!(
        report.waiting_dropped, 0,
        "the read is in flight, not waiting"
    );
    advance(Duration::from_secs(120)).await;
    let execution = read.await.unwrap();
    assert_eq!(summary(&execution), "cancelled");
    assert_eq!(attempts(&execution), 1);
    assert_eq!(
        h.transport.sent_to("/v1/items/1").len(),
        1,
        "the 503 is not retried for a cancelled task"
    );
}

#[tokio::test(start_paused = true)]
async fn the_retry_scheduled_line_names_its_action() {
    let (logs, _attached) = crate::support::capture::Capture::this_thread();
    let h = Harness::new();
    h.transport.script(
        "/v1/items/1",
        vec![
            answer(503, &[("retry-after", "1")], ""),
            answer(200, &[], "{}"),
        ],
    );
    let execution = h.engine.execute(h.get("t-retry-log", "/v1/items/1")).await;
    assert_eq!(summary(&execution), "200");
    let id = execution.receipt().action_id;
    let lines: Vec<String> = logs
        .lines_at("INFO")
        .into_iter()
        .filter(|line| line.contains("retry scheduled"))
        .collect();
    assert_eq!(lines.len(), 1, "{lines:#?}");
    assert!(lines[0].contains(&format!("action={id} ")), "{}", lines[0]);
    assert!(lines[0].contains("task=t-retry-log"), "{}", lines[0]);
}

/// SPEC §4.1: a 429 slows the whole scope even when its boundary is unknown (no `Retry-After`
/// here). The scope pauses for the backoff cap of its run of rate limits (base 1 s · 2¹ = 2 s
/// for the first), never at full speed, and the pause is not counted as retry-after debt.
#[tokio::test(start_paused = true)]
async fn a_429_without_a_usable_retry_after_still_pauses_its_whole_scope() {
    let h = Harness::new();
    h.transport.script(
        "/v1/items/1",
        vec![answer(429, &[("retry-after", "soon")], "")],
    );
    let a = h.spawn(h.get("task-a", "/v1/items/1"));
    advance(Duration::from_millis(100)).await;
    let pause_end = h.t0 + jiff::SignedDuration::from_secs(2);
    let view = h
        .engine
        .scopes()
        .into_iter()
        .find(|v| v.scope == "account")
        .expect("scope account");
    assert_eq!(view.next_allowed_at, Some(pause_end));
    let source = view.source.unwrap_or_default();
    assert!(
        source.contains("without a usable boundary"),
        "source: {source}"
    );
    // Another task on the same scope waits for the pause as well.
    let b = h.spawn(h.get("task-b", "/v1/items/2"));
    advance(Duration::from_millis(500)).await;
    assert_eq!(
        h.transport.sent().len(),
        1,
        "nothing may leave during the pause"
    );
    for handle in [a, b] {
        assert_eq!(summary(&handle.await.unwrap()), "200");
    }
    let sent = h.transport.sent();
    assert_eq!(sent.len(), 3, "{sent:?}");
    for s in &sent[1..] {
        assert!(
            s.at >= pause_end,
            "{} sent at {} during the pause",
            s.path,
            s.at
        );
    }
    assert!(
        !h.metrics
            .render()
            .contains("retry_after_debt_seconds_total{scope=\"billing/account\"} 2"),
        "a local pause is not the provider's mandated delay"
    );
}

/// SPEC §2.2/§2.3: one answer whose quota reset lies centuries ahead (`remaining: 0`) is over
/// the ceiling: a known lower bound, now + the ceiling — it holds the scope that long, never
/// for centuries, and nothing is sent before it.
#[tokio::test(start_paused = true)]
async fn an_absurd_quota_reset_never_blocks_its_scope_for_centuries() {
    let h = Harness::new();
    h.transport.script(
        "/v1/items/1",
        vec![answer(
            200,
            &[
                ("x-ratelimit-remaining", "0"),
                ("x-ratelimit-reset", "99999999999"),
            ],
            "{}",
        )],
    );
    assert_eq!(
        summary(&h.engine.execute(h.get("task-a", "/v1/items/1")).await),
        "200"
    );
    let view = h
        .engine
        .scopes()
        .into_iter()
        .find(|v| v.scope == "account")
        .expect("scope account");
    let ceiling = h.t0 + jiff::SignedDuration::from_secs(24 * 3600);
    assert!(
        view.next_allowed_at.is_none_or(|at| at <= ceiling),
        "{:?}",
        view.next_allowed_at
    );
    assert!(
        view.reset_after_seconds.is_none_or(|s| s <= 24 * 3600),
        "{:?}",
        view.reset_after_seconds
    );
    let stored = h
        .store
        .scope("billing", "billing/account")
        .unwrap()
        .unwrap();
    assert!(
        stored.next_allowed_at.is_none_or(|at| at <= ceiling),
        "{stored:?}"
    );
    // The next read is not sent before the lower bound: it ends at once, told to wait until
    // then — not for 3,000 years.
    assert!(
        view.next_allowed_at.is_some(),
        "the lower bound holds the scope"
    );
    let next = h.spawn(h.get("task-b", "/v1/items/2"));
    advance(Duration::from_secs(5)).await;
    let next = next.await.unwrap();
    assert_eq!(summary(&next), "budget_exhausted");
    let Execution::Outcome { context, .. } = &next else {
        panic!("an outcome: {next:?}")
    };
    assert!(
        context.boundary.is_some_and(|at| at <= ceiling),
        "{context:?}"
    );
    assert!(h.transport.sent_to("/v1/items/2").is_empty());
}
