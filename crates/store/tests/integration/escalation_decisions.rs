//! Operator decisions that act: reopening an escalated write for a same-key retry, notes kept
//! with decisions, access decisions audited apart from action decisions, and reads that carry
//! no idempotency key.

use backstop_store::{
    ActionState, Admission, AttemptResult, Disposition, Outcome, SqliteStore, Store, StoreError,
    ACCESS_DECISION, ACTION_REOPENED, REOPENED_BY_RESEND, STATUS_QUERY,
};

use crate::common::{new_action, open_task, record, t};

fn store() -> (tempfile::TempDir, SqliteStore) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("backstop.db")).expect("open");
    (dir, store)
}

/// An action whose one attempt ended uncertain and that was escalated.
fn escalated(
    store: &SqliteStore,
    key: &str,
) -> (backstop_store::ActionId, backstop_store::EscalationId) {
    let a = record(store, "task-1", key, b"{\"amount\":1}");
    let n = store.mark_attempt_sent(a, t(2)).expect("sent");
    store
        .record_result(
            AttemptResult {
                action: a,
                attempt: n,
                status: None,
                disposition: Disposition::Uncertain,
                boundary: None,
                source: None,
                provider_operation_id: None,
                signal_headers: Vec::new(),
                finish: None,
            },
            t(3),
        )
        .expect("result");
    let e = store
        .open_escalation(
            a,
            serde_json::json!({"reason": "side_effect_unknown"}),
            t(4),
        )
        .expect("escalate");
    (a, e)
}

#[test]
fn reopened_write_sends_again_with_the_same_key_and_is_audited_with_who_decided() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    let (a, e) = escalated(&store, "key-retry");
    // Escalated: no further attempt may be marked sent.
    assert!(store.mark_attempt_sent(a, t(5)).is_err());
    store
        .decide_escalation(
            e,
            "retry_same_key",
            "alice",
            Some("checked the ledger"),
            t(6),
        )
        .expect("decide");
    store.reopen_for_retry(a, "alice", t(7)).expect("reopen");
    let record = store.action(a).expect("read").expect("exists");
    assert_eq!(record.state, ActionState::Reopened);
    assert_eq!(record.outcome, None);
    assert_eq!(record.idempotency_key, "key-retry");

    // The agent resubmitting the same key and payload finds the same action, reopened.
    match store
        .record_action(new_action("task-1", "key-retry", b"{\"amount\":1}"), t(8))
        .expect("admission")
    {
        Admission::Existing(found) => {
            assert_eq!(found.id, a);
            assert_eq!(found.state, ActionState::Reopened);
        }
        Admission::New(id) => panic!("a second action {id:?} for the same key"),
    }
    assert_eq!(store.mark_attempt_sent(a, t(9)).expect("second attempt"), 2);

    let events = store.audit_events(0, 1000).expect("audit");
    let reopened = events
        .iter()
        .find(|e| e.kind == ACTION_REOPENED)
        .expect("reopen audited");
    assert_eq!(reopened.action, Some(a.0));
    assert_eq!(reopened.decided_by.as_deref(), Some("alice"));
    assert_eq!(reopened.idempotency_key.as_deref(), Some("key-retry"));
    let sent: Vec<_> = events
        .iter()
        .filter(|e| e.kind == "action_sent" && e.action == Some(a.0))
        .collect();
    assert_eq!(sent.len(), 2);
    assert!(sent
        .iter()
        .all(|e| e.idempotency_key.as_deref() == Some("key-retry")));
    let escalation = store.escalation(e).expect("read").expect("exists");
    assert_eq!(escalation.note.as_deref(), Some("checked the ledger"));
    assert_eq!(escalation.decided_at, Some(t(6)));
    assert!(matches!(
        store.verify_audit(None).expect("verify"),
        backstop_store::audit::Verdict::Intact { .. }
    ));
}

#[test]
fn only_escalated_actions_of_live_tasks_can_be_reopened() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    let running = record(&store, "task-1", "key-running", b"x");
    let err = store
        .reopen_for_retry(running, "alice", t(5))
        .expect_err("not escalated");
    assert!(
        err.to_string().contains("only an escalated action"),
        "{err}"
    );
    assert!(matches!(
        store.reopen_for_retry(backstop_store::ActionId(999), "alice", t(5)),
        Err(StoreError::NotFound { .. })
    ));
    let (a, _) = escalated(&store, "key-cancel");
    assert!(matches!(
        store.reopen_for_retry(a, " ", t(5)),
        Err(StoreError::Invalid {
            field: "decided_by",
            ..
        })
    ));
    store
        .cancel_task("agent-a", "task-1", t(6))
        .expect("cancel");
    let err = store
        .reopen_for_retry(a, "alice", t(7))
        .expect_err("cancelled task");
    assert!(err.to_string().contains("cancelled"), "{err}");
    assert_eq!(
        store.action(a).expect("read").expect("a").outcome,
        Some(Outcome::Escalated)
    );
}

/// A write whose one attempt was answered 429 and that ended `outcome` with `context`.
fn ended(
    store: &SqliteStore,
    key: &str,
    outcome: Outcome,
    context: serde_json::Value,
) -> backstop_store::ActionId {
    let a = record(store, "task-1", key, b"{\"amount\":1}");
    let n = store.mark_attempt_sent(a, t(2)).expect("sent");
    store
        .record_result(
            AttemptResult {
                action: a,
                attempt: n,
                status: Some(429),
                disposition: Disposition::RateLimited,
                boundary: None,
                source: None,
                provider_operation_id: None,
                signal_headers: Vec::new(),
                finish: Some(backstop_store::Finish {
                    outcome,
                    context,
                    response: None,
                }),
            },
            t(3),
        )
        .expect("result");
    a
}

#[test]
fn a_write_told_to_come_back_is_reopened_by_its_resend_and_audited_as_such() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    let context = serde_json::json!({"sent": true, "next_safe": [{"option": "wait_until", "at": "2026-01-01T00:00:11Z"}]});
    let a = ended(&store, "key-wait", Outcome::BudgetExhausted, context);
    let e = store
        .open_escalation_beside_outcome(
            a,
            serde_json::json!({"reason": "remaining_wait_exceeds_deadline"}),
            t(4),
        )
        .expect("beside");
    assert_eq!(
        store
            .escalations_of_action(a)
            .expect("read")
            .iter()
            .map(|x| x.id)
            .collect::<Vec<_>>(),
        vec![e]
    );
    store
        .reopen_for_resend(a, Some(t(11)), Some(e), t(12))
        .expect("reopen");
    let record = store.action(a).expect("read").expect("exists");
    assert_eq!(record.state, ActionState::Reopened);
    assert_eq!((record.outcome, record.outcome_context), (None, None));
    assert_eq!(
        store.mark_attempt_sent(a, t(13)).expect("second attempt"),
        2
    );

    let events = store.audit_events(0, 1000).expect("audit");
    let reopened = events
        .iter()
        .find(|e| e.kind == ACTION_REOPENED)
        .expect("reopen audited");
    assert_eq!(reopened.action, Some(a.0));
    assert_eq!(reopened.decided_by, None, "no person decided");
    assert_eq!(reopened.decision.as_deref(), Some("retry_same_key"));
    assert_eq!(reopened.outcome.as_deref(), Some("budget_exhausted"));
    assert_eq!(reopened.escalation, Some(e.0));
    assert_eq!(reopened.source.as_deref(), Some(REOPENED_BY_RESEND));
    assert_eq!(
        reopened.boundary.as_deref(),
        Some(backstop_store::audit::format_instant(t(11)).as_str())
    );
    assert_eq!(reopened.idempotency_key.as_deref(), Some("key-wait"));
    assert!(matches!(
        store.verify_audit(None).expect("verify"),
        backstop_store::audit::Verdict::Intact { .. }
    ));
}

#[test]
fn a_resend_reopens_only_a_write_that_ended_waiting_in_a_live_task() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    let running = record(&store, "task-1", "key-running", b"x");
    assert!(store.reopen_for_resend(running, None, None, t(5)).is_err());
    let done = ended(
        &store,
        "key-done",
        Outcome::Succeeded,
        serde_json::json!({}),
    );
    let err = store
        .reopen_for_resend(done, None, None, t(5))
        .expect_err("succeeded");
    assert!(err.to_string().contains("budget_exhausted"), "{err}");
    for outcome in [Outcome::Rejected, Outcome::Escalated] {
        let a = ended(
            &store,
            &format!("key-{}", outcome.as_str()),
            outcome,
            serde_json::json!({}),
        );
        assert!(matches!(
            store.reopen_for_resend(a, None, None, t(5)),
            Err(StoreError::InvalidTransition { .. })
        ));
    }
    // A write cancelled while its task lives (its caller went away, a restart closed it)
    // binds nothing at the provider: its resend reopens it.
    let cancelled = ended(
        &store,
        "key-cancelled",
        Outcome::Cancelled,
        serde_json::json!({}),
    );
    store
        .reopen_for_resend(cancelled, None, None, t(5))
        .expect("a cancelled write of a live task is reopened");
    assert!(matches!(
        store.reopen_for_resend(backstop_store::ActionId(999), None, None, t(5)),
        Err(StoreError::NotFound { .. })
    ));
    let quota = ended(
        &store,
        "key-quota",
        Outcome::QuotaExhausted,
        serde_json::json!({}),
    );
    store
        .cancel_task("agent-a", "task-1", t(6))
        .expect("cancel");
    let err = store
        .reopen_for_resend(quota, None, None, t(7))
        .expect_err("cancelled task");
    assert!(err.to_string().contains("cancelled"), "{err}");
    assert_eq!(
        store.action(quota).expect("read").expect("a").outcome,
        Some(Outcome::QuotaExhausted)
    );
}

#[test]
fn an_access_decision_is_its_own_event_and_leaves_the_escalation_open() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    let (a, e) = escalated(&store, "key-reveal");
    store
        .record_access_decision(e, "reveal_payload", "bob", "refused_not_stored", t(5))
        .expect("audited");
    let rec = store.escalation(e).expect("read").expect("exists");
    assert_eq!(rec.decision, None, "access approves nothing");
    assert_eq!(store.open_escalations().expect("open").len(), 1);
    let events = store.audit_events(0, 1000).expect("audit");
    let access = events
        .iter()
        .find(|e| e.kind == ACCESS_DECISION)
        .expect("access audited");
    assert_eq!(access.escalation, Some(e.0));
    assert_eq!(access.action, Some(a.0));
    assert_eq!(access.decision.as_deref(), Some("reveal_payload"));
    assert_eq!(access.decided_by.as_deref(), Some("bob"));
    assert_eq!(access.outcome.as_deref(), Some("refused_not_stored"));
    assert!(!events.iter().any(|e| e.kind == "decision"));
    assert!(matches!(
        store.record_access_decision(e, "", "bob", "refused", t(6)),
        Err(StoreError::Invalid {
            field: "access",
            ..
        })
    ));
    assert!(matches!(
        store.record_access_decision(
            backstop_store::EscalationId(77),
            "reveal_payload",
            "bob",
            "refused",
            t(6)
        ),
        Err(StoreError::NotFound { .. })
    ));
}

#[test]
fn a_status_query_is_its_own_event_and_leaves_the_escalation_open_for_a_decision() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    let (a, e) = escalated(&store, "key-query");
    store
        .record_status_query(e, "carol", "inconclusive", t(5))
        .expect("audited");
    let rec = store.escalation(e).expect("read").expect("exists");
    assert_eq!(
        rec.decision, None,
        "a query that found nothing decides nothing"
    );
    assert_eq!(store.open_escalations().expect("open").len(), 1);
    let events = store.audit_events(0, 1000).expect("audit");
    let query = events
        .iter()
        .find(|e| e.kind == STATUS_QUERY)
        .expect("query audited");
    assert_eq!(query.escalation, Some(e.0));
    assert_eq!(query.action, Some(a.0));
    assert_eq!(query.decided_by.as_deref(), Some("carol"));
    assert_eq!(query.disposition.as_deref(), Some("inconclusive"));
    assert!(!events.iter().any(|e| e.kind == "decision"));
    // A later decision is still accepted; a query after it is refused.
    store
        .decide_escalation(e, "abort", "carol", None, t(6))
        .expect("decided after the query");
    assert!(matches!(
        store.record_status_query(e, "carol", "not_found", t(7)),
        Err(StoreError::InvalidTransition { .. })
    ));
    assert!(matches!(
        store.record_status_query(e, " ", "not_found", t(7)),
        Err(StoreError::Invalid {
            field: "decided_by",
            ..
        })
    ));
}

#[test]
fn an_escalation_beside_an_outcome_keeps_the_outcome_and_needs_one() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    let a = record(&store, "task-1", "key-beside", b"{\"amount\":2}");
    let refused = store
        .open_escalation_beside_outcome(a, serde_json::json!({"reason": "x"}), t(2))
        .expect_err("not ended yet");
    assert!(
        matches!(refused, StoreError::InvalidTransition { .. }),
        "{refused}"
    );
    store
        .finish_action(
            a,
            backstop_store::Finish {
                outcome: Outcome::BudgetExhausted,
                context: serde_json::json!({"sent": true}),
                response: None,
            },
            t(3),
        )
        .expect("ended");
    let e = store
        .open_escalation_beside_outcome(
            a,
            serde_json::json!({"reason": "remaining_wait_exceeds_deadline"}),
            t(4),
        )
        .expect("opened");
    let record = store.action(a).expect("read").expect("action");
    assert_eq!(
        record.outcome,
        Some(Outcome::BudgetExhausted),
        "the outcome stands"
    );
    let open = store.open_escalations().expect("open");
    assert_eq!(open.len(), 1);
    assert_eq!((open[0].id, open[0].action), (e, a));
    let escalated = store
        .audit_events(0, 1000)
        .expect("audit")
        .into_iter()
        .find(|ev| ev.kind == "escalated")
        .expect("audited");
    assert_eq!(escalated.escalation, Some(e.0));
    assert_eq!(escalated.outcome.as_deref(), Some("budget_exhausted"));
}

#[test]
fn reads_carry_no_key_in_the_store_or_the_audit_log() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    let mut read = new_action("task-1", "", b"");
    read.method = "GET".into();
    read.request_class = "read".into();
    let first = match store.record_action(read.clone(), t(1)).expect("first") {
        Admission::New(id) => id,
        Admission::Existing(a) => panic!("a read was found by key: {:?}", a.id),
    };
    // A second identical read is a new action: reads are never found again by key.
    let second = match store.record_action(read, t(2)).expect("second") {
        Admission::New(id) => id,
        Admission::Existing(a) => panic!("a read was found by key: {:?}", a.id),
    };
    assert_ne!(first, second);
    let n = store.mark_attempt_sent(first, t(3)).expect("sent");
    assert_eq!(n, 1);
    let stored = store.action(first).expect("read").expect("exists");
    assert_eq!(stored.key(), None);
    let unfinished = store.unfinished_attempts().expect("unfinished");
    assert_eq!(unfinished.len(), 1);
    assert!(unfinished[0].idempotency_key.is_empty());
    let events = store.audit_events(0, 1000).expect("audit");
    assert!(
        events.iter().all(|e| e.idempotency_key.is_none()),
        "{events:#?}"
    );
    // Writes still have unique keys per agent.
    let w = record(&store, "task-1", "key-w", b"w");
    assert_eq!(
        store.action(w).expect("read").expect("w").key(),
        Some("key-w")
    );
    assert!(matches!(
        store.record_action(new_action("task-1", "key-w", b"other"), t(4)),
        Err(StoreError::KeyReuse { .. })
    ));
}

#[test]
fn escalations_decided_since_an_instant_are_listed_by_decision_whatever_their_action() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    let (_, early) = escalated(&store, "k-early");
    let (_, late) = escalated(&store, "k-late");
    let (_, undecided) = escalated(&store, "k-undecided");
    store
        .decide_escalation(late, "abort", "operator", None, t(10))
        .expect("decide late first");
    store
        .decide_escalation(early, "abort", "operator", None, t(20))
        .expect("decide early");
    let ids = |since| -> Vec<_> {
        store
            .escalations_decided_since(since)
            .expect("read")
            .into_iter()
            .map(|e| e.id)
            .collect()
    };
    // Oldest decision first; an undecided escalation is never listed.
    assert_eq!(ids(t(5)), [late, early]);
    assert_eq!(ids(t(10)), [late, early], "at the instant counts");
    assert_eq!(ids(t(11)), [early]);
    assert!(ids(t(21)).is_empty());
    assert!(!ids(t(0)).contains(&undecided));
}
