//! The store's atomic operations: idempotency, attempt receipts, retries, scopes,
//! escalations, cancellation, and group commit under concurrency.

use std::sync::Arc;

use backstop_store::audit::Verdict;
use backstop_store::{
    Admission, AttemptResult, AttemptState, Boundary, Disposition, EscalationState, Finish,
    Outcome, RouteTemplate, ScopeUpdate, SqliteStore, Store, StoreError, StoredResponse,
};

use crate::common::{kinds, new_action, open_task, record, t, ONE_ATTEMPT_EVENTS};

fn store() -> (tempfile::TempDir, SqliteStore) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("s.db")).expect("open");
    (dir, store)
}

#[test]
fn same_key_same_payload_is_the_existing_action_and_different_payload_is_refused() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    let id = record(&store, "task-1", "k-1", b"amount=10");
    match store
        .record_action(new_action("task-1", "k-1", b"amount=10"), t(5))
        .expect("replay")
    {
        Admission::Existing(a) => assert_eq!(a.id, id),
        Admission::New(other) => panic!("a second action {other} for the same key"),
    }
    let err = store
        .record_action(new_action("task-1", "k-1", b"amount=99"), t(6))
        .expect_err("different payload");
    assert!(
        matches!(err, StoreError::KeyReuse { existing, .. } if existing == id.0),
        "{err}"
    );
    // Only the first request was audited.
    assert_eq!(kinds(&store), ["task_opened", "action_requested"]);
}

#[test]
fn a_key_binds_provider_method_and_route_too_not_only_the_payload() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    let id = record(&store, "task-1", "xr-1", br#"{"amount":31}"#);
    let same_body = || new_action("task-1", "xr-1", br#"{"amount":31}"#);
    let refused = |action, at| match store.record_action(action, t(at)) {
        Err(StoreError::KeyReuse {
            existing,
            differs,
            bound,
            ..
        }) => {
            assert_eq!(existing, id.0);
            assert_eq!(
                (
                    bound.provider.as_str(),
                    bound.method.as_str(),
                    bound.route.as_str()
                ),
                ("billing-api", "POST", "/v1/transfers"),
                "the bound request is named"
            );
            differs
        }
        other => panic!("expected KeyReuse, got {other:?}"),
    };

    let mut other_route = same_body();
    other_route.route = RouteTemplate::try_new("/v1/refunds").expect("template");
    assert_eq!(refused(other_route, 2), ["route"]);

    let mut other_method = same_body();
    other_method.method = "PUT".into();
    assert_eq!(refused(other_method, 3), ["method"]);

    let mut other_provider = same_body();
    other_provider.provider = "payments-api".into();
    assert_eq!(refused(other_provider, 4), ["provider"]);

    let mut everything = new_action("task-1", "xr-1", br#"{"amount":32}"#);
    everything.provider = "payments-api".into();
    everything.method = "PUT".into();
    everything.route = RouteTemplate::try_new("/v1/refunds").expect("template");
    assert_eq!(
        refused(everything, 5),
        ["provider", "method", "route", "payload"]
    );

    // The very same request is still the existing action, and nothing else was recorded.
    match store.record_action(same_body(), t(6)).expect("replay") {
        Admission::Existing(a) => assert_eq!(a.id, id),
        Admission::New(other) => panic!("a second action {other} for the same key"),
    }
    assert_eq!(kinds(&store), ["task_opened", "action_requested"]);
}

#[test]
fn an_action_keeps_its_desired_outcome_and_fingerprint_without_auditing_them() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    let mut described = new_action("task-1", "k-desc", b"amount=10");
    described.desired_outcome = Some("pay invoice 7 once".into());
    described.fingerprint = Some("f".repeat(64));
    let id = match store.record_action(described, t(1)).expect("record") {
        Admission::New(id) => id,
        Admission::Existing(a) => panic!("unexpected existing {:?}", a.id),
    };
    let plain = record(&store, "task-1", "k-plain", b"amount=11");
    let kept = store.action(id).expect("read").expect("action");
    assert_eq!(kept.desired_outcome.as_deref(), Some("pay invoice 7 once"));
    assert_eq!(kept.fingerprint.as_deref(), Some("f".repeat(64).as_str()));
    let bare = store.action(plain).expect("read").expect("action");
    assert_eq!((bare.desired_outcome, bare.fingerprint), (None, None));
    let events = store.audit_events(0, 100).expect("events");
    let encoded = format!("{events:?}");
    assert!(
        !encoded.contains("pay invoice 7"),
        "the agent's words are not audited: {encoded}"
    );
}

#[test]
fn an_escalation_can_keep_the_outcome_context_it_was_answered_with() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    let id = record(&store, "task-1", "k-esc", b"x");
    store.mark_attempt_sent(id, t(2)).expect("sent");
    let context =
        serde_json::json!({"sent": true, "attempts": 1, "next_safe": [{"option": "abort"}]});
    let escalation = store
        .open_escalation_with_context(
            id,
            serde_json::json!({"reason": "side_effect_unknown"}),
            context,
            t(3),
        )
        .expect("escalated");
    let action = store.action(id).expect("read").expect("action");
    assert_eq!(action.outcome, Some(Outcome::Escalated));
    assert_eq!(
        action.outcome_context,
        Some(serde_json::json!({
            "sent": true, "attempts": 1, "next_safe": [{"option": "abort"}],
            "escalation": escalation.0
        }))
    );
    let other = record(&store, "task-1", "k-esc-2", b"y");
    let err = store
        .open_escalation_with_context(other, serde_json::json!({}), serde_json::json!([1]), t(4))
        .expect_err("a context must be an object");
    assert!(matches!(err, StoreError::Invalid { .. }), "{err}");
    assert!(store
        .open_escalations()
        .expect("open")
        .iter()
        .all(|e| e.action != other));
}

#[test]
fn attempts_are_numbered_and_never_two_in_flight() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    let id = record(&store, "task-1", "k-1", b"x");
    assert_eq!(store.mark_attempt_sent(id, t(10)).expect("first"), 1);
    let err = store
        .mark_attempt_sent(id, t(11))
        .expect_err("second while in flight");
    assert!(matches!(err, StoreError::InvalidTransition { .. }), "{err}");
    assert_eq!(store.unfinished_attempts().expect("unfinished").len(), 1);
    store
        .record_result(
            AttemptResult {
                action: id,
                attempt: 1,
                status: Some(429),
                disposition: Disposition::RateLimited,
                boundary: Some(Boundary::At(t(10_000))),
                source: Some("HTTP 429 Retry-After".into()),
                provider_operation_id: None,
                signal_headers: Vec::new(),
                finish: None,
            },
            t(20),
        )
        .expect("result");
    assert!(store.unfinished_attempts().expect("unfinished").is_empty());
    assert_eq!(store.mark_attempt_sent(id, t(30)).expect("second"), 2);
    let attempts = store.attempts(id).expect("attempts");
    assert_eq!(attempts.len(), 2);
    assert_eq!(attempts[0].status, Some(429));
    assert_eq!(attempts[0].state, AttemptState::Finished);
    assert_eq!(attempts[1].state, AttemptState::Sent);
    let result = store.audit_events(0, usize::MAX).expect("events");
    let r = result
        .iter()
        .find(|e| e.kind == "action_result")
        .expect("result event");
    assert_eq!(r.boundary.as_deref(), Some("2025-06-15T15:06:50.000Z"));
    assert_eq!(r.disposition.as_deref(), Some("rate_limited"));
}

#[test]
fn a_result_can_finish_the_action_and_keep_the_response_for_replay() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    let id = record(&store, "task-1", "k-1", b"x");
    store.mark_attempt_sent(id, t(1)).expect("sent");
    let response = StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "application/json".into())],
        body: b"{\"id\":\"tr_1\"}".to_vec(),
    };
    store
        .record_result(
            AttemptResult {
                action: id,
                attempt: 1,
                status: Some(201),
                disposition: Disposition::Success,
                boundary: None,
                source: None,
                provider_operation_id: Some("tr_1".into()),
                signal_headers: Vec::new(),
                finish: Some(Finish {
                    outcome: Outcome::Succeeded,
                    context: serde_json::json!({"attempts": 1}),
                    response: Some(response.clone()),
                }),
            },
            t(2),
        )
        .expect("result");
    let a = store.action(id).expect("read").expect("exists");
    assert_eq!(a.outcome, Some(Outcome::Succeeded));
    assert_eq!(a.provider_operation_id.as_deref(), Some("tr_1"));
    assert_eq!(a.response, Some(response));
    let err = store.mark_attempt_sent(id, t(3)).expect_err("finished");
    assert!(
        err.to_string()
            .contains("already finished with outcome succeeded"),
        "{err}"
    );
    // The failed operation wrote nothing.
    assert_eq!(kinds(&store), ONE_ATTEMPT_EVENTS);
}

#[test]
fn due_retries_are_claimed_once_and_cancelled_tasks_never_wake() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    open_task(&store, "task-2");
    let a = record(&store, "task-1", "k-a", b"a");
    let b = record(&store, "task-2", "k-b", b"b");
    let c = record(&store, "task-1", "k-c", b"c");
    let job_a = store.schedule_retry(a, t(1_000), t(1)).expect("schedule a");
    store.schedule_retry(b, t(2_000), t(1)).expect("schedule b");
    store.schedule_retry(c, t(9_000), t(1)).expect("schedule c");
    assert!(store.claim_due(t(999), 10, "w1").expect("claim").is_empty());
    let due = store.claim_due(t(1_500), 10, "w1").expect("claim");
    assert_eq!(due.len(), 1);
    assert_eq!(
        (due[0].job, due[0].action, due[0].due_at),
        (job_a, a, t(1_000))
    );
    assert!(store
        .claim_due(t(1_500), 10, "w2")
        .expect("again")
        .is_empty());

    let report = store
        .cancel_task("agent-a", "task-1", t(1_600))
        .expect("cancel");
    assert_eq!(report.retries_dropped, 1); // c's retry; a's was already claimed
    assert_eq!(report.actions_cancelled, 2);
    assert_eq!(
        store
            .cancel_task("agent-a", "task-1", t(1_700))
            .expect("twice"),
        Default::default()
    );
    let due = store.claim_due(t(10_000), 10, "w1").expect("claim");
    assert_eq!(due.iter().map(|d| d.action).collect::<Vec<_>>(), [b]);
    let err = store
        .mark_attempt_sent(a, t(10_001))
        .expect_err("cancelled");
    assert!(err.to_string().contains("cancelled"), "{err}");
    assert_eq!(
        store.action(c).expect("read").expect("c").outcome,
        Some(Outcome::Cancelled)
    );
    assert!(store
        .task("agent-a", "task-1")
        .expect("task")
        .expect("t")
        .cancelled_at
        .is_some());
}

#[test]
fn next_allowed_at_only_moves_later() {
    let (_dir, store) = store();
    let update = |next: i64, source: &str| ScopeUpdate {
        provider: "billing-api".into(),
        scope: "billing-api/account:ops-team".into(),
        next_allowed_at: Some(t(next)),
        remaining: Some(0),
        limit: Some(100),
        reset_at: None,
        source: source.into(),
    };
    store
        .update_scope(update(10_000, "HTTP 429 Retry-After"), t(0))
        .expect("first");
    let after = store
        .update_scope(update(5_000, "x-ratelimit-reset"), t(1))
        .expect("second");
    assert_eq!(after.next_allowed_at, Some(t(10_000)));
    assert_eq!(after.source, "x-ratelimit-reset");
    let read = store
        .scope("billing-api", "billing-api/account:ops-team")
        .expect("read")
        .expect("exists");
    assert_eq!(read, after);
    assert_eq!(kinds(&store), ["scope_updated", "scope_updated"]);
}

#[test]
fn escalations_open_and_are_decided_once() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    let a = record(&store, "task-1", "k-a", b"a");
    let case = serde_json::json!({"desired_outcome": "transfer sent once", "options": ["query_status", "abort"]});
    let e = store.open_escalation(a, case.clone(), t(1)).expect("open");
    assert_eq!(store.open_escalations().expect("list").len(), 1);
    store
        .decide_escalation(e, "query_status", "ops@example", None, t(2))
        .expect("decide");
    let err = store
        .decide_escalation(e, "abort", "ops@example", None, t(3))
        .expect_err("twice");
    assert!(err.to_string().contains("already decided"), "{err}");
    let rec = store.escalation(e).expect("read").expect("exists");
    assert_eq!(rec.state, EscalationState::Decided);
    assert_eq!(rec.case_file, case);
    assert_eq!(rec.decided_by.as_deref(), Some("ops@example"));
    assert!(store.open_escalations().expect("list").is_empty());
    assert_eq!(
        store.action(a).expect("read").expect("a").outcome,
        Some(Outcome::Escalated)
    );
    let ks = kinds(&store);
    assert_eq!(&ks[ks.len() - 2..], ["escalated", "decision"]);
}

#[test]
fn a_reconciliation_keeps_the_context_its_caller_was_answered_with() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    let a = record(&store, "task-1", "k-a", b"a");
    store.mark_attempt_sent(a, t(1)).expect("sent");
    let context = serde_json::json!({
        "sent": true, "response_received": false, "attempts": 1, "total_wait_ms": 1985,
        "last_status": null, "last_signal": "uncertain", "boundary": null, "next_safe": []
    });
    store
        .record_reconciled_with_context(a, Some("op-1".into()), context.clone(), t(2))
        .expect("reconciled");
    let rec = store.action(a).expect("read").expect("a");
    assert_eq!(rec.outcome, Some(Outcome::Succeeded));
    assert_eq!(rec.provider_operation_id.as_deref(), Some("op-1"));
    let mut expected = context;
    expected["reconciled"] = serde_json::Value::Bool(true);
    assert_eq!(rec.outcome_context, Some(expected));
    assert_eq!(kinds(&store).last().map(String::as_str), Some("reconciled"));

    // Without a context, only the marker (an action that had none before).
    let b = record(&store, "task-1", "k-b", b"b");
    store
        .record_reconciled(b, None, t(3))
        .expect("reconciled without a context");
    let rec = store.action(b).expect("read").expect("b");
    assert_eq!(
        rec.outcome_context,
        Some(serde_json::json!({"reconciled": true}))
    );

    let c = record(&store, "task-1", "k-c", b"c");
    let err = store
        .record_reconciled_with_context(c, None, serde_json::json!([1]), t(4))
        .expect_err("not an object");
    assert!(matches!(err, StoreError::Invalid { .. }), "{err}");
    assert_eq!(store.action(c).expect("read").expect("c").outcome, None);
}

#[test]
fn outcomes_choose_their_event_kind_and_reconciliation_can_follow() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    let a = record(&store, "task-1", "k-a", b"a");
    let finish = |o| Finish {
        outcome: o,
        context: serde_json::json!({"sent": true}),
        response: None,
    };
    store
        .finish_action(a, finish(Outcome::ReconciliationRequired), t(1))
        .expect("rr");
    store
        .record_reconciled(a, Some("op-7".into()), t(2))
        .expect("reconciled");
    let rec = store.action(a).expect("read").expect("a");
    assert_eq!(rec.outcome, Some(Outcome::Succeeded));
    assert_eq!(rec.provider_operation_id.as_deref(), Some("op-7"));
    let b = record(&store, "task-1", "k-b", b"b");
    store
        .finish_action(b, finish(Outcome::BudgetExhausted), t(3))
        .expect("budget");
    let err = store
        .finish_action(b, finish(Outcome::Succeeded), t(4))
        .expect_err("ended");
    assert!(matches!(err, StoreError::InvalidTransition { .. }));
    store
        .record_circuit_opened(
            "agent-1",
            "task-1",
            "billing-api",
            "POST",
            &RouteTemplate::try_new("/v1/transfers").expect("t"),
            t(5),
        )
        .expect("circuit");
    let ks = kinds(&store);
    assert_eq!(
        &ks[2..],
        [
            "reconciliation_required",
            "reconciled",
            "action_requested",
            "budget_exhausted",
            "circuit_opened"
        ]
    );
}

#[test]
fn invalid_inputs_are_refused_before_touching_the_database() {
    assert!(RouteTemplate::try_new("/v1/transfers/tr_123?expand=all").is_err());
    assert!(RouteTemplate::try_new("v1/transfers").is_err());
    assert!(backstop_store::PayloadDigest::try_new("ABC").is_err());
    let (_dir, store) = store();
    let err = store
        .record_action(new_action("no-such-task", "k", b"x"), t(0))
        .expect_err("unknown task");
    assert_eq!(err.to_string(), "task \"no-such-task\" not found");
}

#[test]
fn concurrent_writers_share_commits_and_the_chain_stays_intact() {
    let (dir, store) = store();
    let store = Arc::new(store);
    open_task(&store, "task-1");
    let threads: u64 = 32;
    let per_thread: u64 = 20;
    let handles: Vec<_> = (0..threads)
        .map(|w| {
            let store = Arc::clone(&store);
            std::thread::spawn(move || {
                let mut ids = Vec::new();
                for i in 0..per_thread {
                    let key = format!("w{w}-{i}");
                    let id = match store
                        .record_action(new_action("task-1", &key, key.as_bytes()), t(1))
                        .expect("record")
                    {
                        Admission::New(id) => id,
                        Admission::Existing(_) => panic!("fresh key existed"),
                    };
                    store.mark_attempt_sent(id, t(2)).expect("sent");
                    ids.push(id);
                }
                ids
            })
        })
        .collect();
    let mut all: Vec<_> = handles
        .into_iter()
        .flat_map(|h| h.join().expect("writer thread"))
        .collect();
    all.sort();
    all.dedup();
    assert_eq!(all.len() as u64, threads * per_thread);
    let stats = store.writer_stats();
    assert_eq!(stats.operations, 1 + 2 * threads * per_thread);
    assert!(
        stats.transactions < stats.operations,
        "no grouping: {stats:?}"
    );
    let events = 1 + 2 * threads * per_thread;
    assert!(matches!(
        store.verify_audit(None).expect("verify"),
        Verdict::Intact { count, .. } if count == events
    ));
    // Reopening continues the same chain.
    drop(Arc::into_inner(store).expect("sole owner"));
    let store = SqliteStore::open(dir.path().join("s.db")).expect("reopen");
    open_task(&store, "task-2");
    assert!(matches!(
        store.verify_audit(None).expect("verify"),
        Verdict::Intact { count, .. } if count == events + 1
    ));
}

#[test]
fn a_failing_operation_in_a_group_commit_leaves_the_others_and_the_chain_intact() {
    let (_dir, store) = store();
    let store = Arc::new(store);
    open_task(&store, "task-1");
    record(&store, "task-1", "taken", b"original");
    let handles: Vec<_> = (0..16)
        .map(|w| {
            let store = Arc::clone(&store);
            std::thread::spawn(move || {
                let mut refused = 0;
                for i in 0..10 {
                    // Every other operation reuses a key with another payload and must fail.
                    let (key, payload) = if i % 2 == 0 {
                        ("taken".to_owned(), format!("other {w} {i}"))
                    } else {
                        (format!("w{w}-{i}"), format!("p{w}-{i}"))
                    };
                    match store.record_action(new_action("task-1", &key, payload.as_bytes()), t(i))
                    {
                        Err(StoreError::KeyReuse { .. }) => refused += 1,
                        Ok(Admission::New(_)) => {}
                        other => panic!("unexpected {other:?}"),
                    }
                }
                refused
            })
        })
        .collect();
    let refused: u64 = handles.into_iter().map(|h| h.join().expect("thread")).sum();
    assert_eq!(refused, 80);
    // task_opened + the first record + 80 successful records; nothing from the refused ones.
    assert!(matches!(
        store.verify_audit(None).expect("verify"),
        Verdict::Intact { count: 82, .. }
    ));
}

#[test]
fn a_watchdog_finding_is_audited_with_its_job_and_changes_no_state() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    let a = record(&store, "task-1", "k-w", b"w");
    let job = store.schedule_retry(a, t(40), t(10)).expect("schedule");
    let before = store.action(a).expect("read").expect("a");
    store
        .record_watchdog_finding(a, "stuck_missed_wake", Some(job), Some(t(40)), t(71))
        .expect("finding");
    assert_eq!(store.action(a).expect("read").expect("a"), before);
    let events = store.audit_events(0, usize::MAX).expect("events");
    let last = events.last().expect("one event");
    assert_eq!(last.kind, "watchdog_finding");
    assert_eq!(last.source.as_deref(), Some("stuck_missed_wake"));
    assert_eq!(last.job, Some(job.0));
    assert_eq!(last.action, Some(a.0));
    assert!(matches!(
        store.record_watchdog_finding(a, " ", None, None, t(72)),
        Err(StoreError::Invalid { .. })
    ));
    assert!(matches!(
        store.record_watchdog_finding(backstop_store::ActionId(999), "x", None, None, t(72)),
        Err(StoreError::NotFound { .. })
    ));
    assert!(matches!(
        store.verify_audit(None).expect("verify"),
        Verdict::Intact { .. }
    ));
}

#[test]
fn an_action_has_at_most_one_waiting_retry() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    let a = record(&store, "task-1", "k-r", b"r");
    // The live loop: attempt 1, retry planned, attempt 2 woken by its own timer, retry again.
    store.mark_attempt_sent(a, t(1)).expect("sent 1");
    store
        .record_result(unavailable(a, 1), t(2))
        .expect("result 1");
    store.schedule_retry(a, t(1_000), t(3)).expect("schedule 1");
    store.mark_attempt_sent(a, t(1_000)).expect("sent 2");
    assert!(
        store.scheduled_retries().expect("list").is_empty(),
        "the attempt took its retry job: nothing is left to re-arm after a restart"
    );
    store
        .record_result(unavailable(a, 2), t(1_001))
        .expect("result 2");
    let second = store
        .schedule_retry(a, t(3_000), t(1_002))
        .expect("schedule 2");
    let waiting = store.scheduled_retries().expect("list");
    assert_eq!(waiting.len(), 1, "{waiting:?}");
    assert_eq!(waiting[0].job, second);
    // Planning again supersedes the job not taken yet.
    let third = store
        .schedule_retry(a, t(4_000), t(1_003))
        .expect("schedule 3");
    let waiting = store.scheduled_retries().expect("list");
    assert_eq!(waiting.len(), 1, "{waiting:?}");
    assert_eq!(waiting[0].job, third);
}

fn unavailable(action: backstop_store::ActionId, attempt: u32) -> AttemptResult {
    AttemptResult {
        action,
        attempt,
        status: Some(503),
        disposition: Disposition::Unavailable,
        boundary: None,
        source: None,
        provider_operation_id: None,
        signal_headers: Vec::new(),
        finish: None,
    }
}
