//! A read's bookkeeping is queued as ONE writer operation once its answer is known: task and
//! action rows, `task_opened`, `action_requested`, `action_sent`, `action_result` and
//! `action_finished` in one savepoint. A read held until then is queued early whenever another
//! operation or a read of the store could need it, and a cancelled task is refused without a
//! query, also after a restart.

use std::path::Path;
use std::sync::mpsc;

use backstop_store::audit::{format_instant, Verdict};
use backstop_store::{
    ActionId, ActionState, Admission, AttemptResult, Boundary, Disposition, Finish, NewAction,
    NewTask, Outcome, SqliteStore, Store, StoreError, StoredResponse,
};

use crate::common::{
    completion, kinds, new_task, open_task, read_action_of, success, t, wait, ONE_ATTEMPT_EVENTS,
};

fn task(id: &str) -> NewTask {
    new_task(id, "agent-a")
}

fn read_action(task: &str) -> NewAction {
    NewAction {
        desired_outcome: Some("show the balance".into()),
        fingerprint: Some("GET /v1/balance".into()),
        ..read_action_of(task, "agent-a")
    }
}

/// A new store in `dir` with a read of `task-r` recorded at t(0) and its first attempt queued
/// as sent at t(1), neither awaited.
struct SentRead {
    store: SqliteStore,
    id: ActionId,
    recorded: mpsc::Receiver<Result<(), StoreError>>,
    sent: mpsc::Receiver<Result<u32, StoreError>>,
}

fn sent_read(dir: &Path) -> SentRead {
    let store = SqliteStore::open(dir.join("b.db")).expect("open");
    let (recorded, recorded_rx) = completion();
    let id = store
        .record_read(task("task-r"), read_action("task-r"), t(0), recorded)
        .expect("read recorded");
    let (sent, sent_rx) = completion();
    store.submit_attempt_sent(id, t(1), sent);
    SentRead {
        store,
        id,
        recorded: recorded_rx,
        sent: sent_rx,
    }
}

#[test]
fn a_read_answered_at_once_is_one_writer_operation_with_all_its_events() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("b.db")).expect("open");
    let before = store.writer_stats().operations;
    let (recorded, recorded_rx) = completion();
    let id = store
        .record_read(task("task-r"), read_action("task-r"), t(0), recorded)
        .expect("read recorded");
    let (sent, sent_rx) = completion();
    store.submit_attempt_sent(id, t(1), sent);
    let (done, done_rx) = completion();
    store.submit_result(success(id, 1), t(2), done);
    wait(&recorded_rx).expect("record committed");
    assert_eq!(wait(&sent_rx).expect("sent committed"), 1);
    wait(&done_rx).expect("result committed");
    // Counted before any read of the store (which may add an empty operation of its own).
    assert_eq!(store.writer_stats().operations - before, 1);
    assert_eq!(kinds(&store), ONE_ATTEMPT_EVENTS);
    let events = store.audit_events(0, 100).expect("events");
    // Each event keeps the instant of its own step.
    let times: Vec<&str> = events.iter().map(|e| e.at.as_str()).collect();
    let expected: Vec<String> = [0, 0, 1, 2, 2]
        .into_iter()
        .map(|ms| format_instant(t(ms)))
        .collect();
    assert_eq!(times, expected);
    let action = store.action(id).expect("read").expect("recorded");
    assert_eq!(action.state, ActionState::Finished);
    assert_eq!(action.outcome, Some(Outcome::Succeeded));
    let attempts = store.attempts(id).expect("attempts");
    assert_eq!(attempts.len(), 1);
    assert_eq!(attempts[0].status, Some(200));
    assert!(matches!(
        store.verify_audit(None).expect("verify"),
        Verdict::Intact { count: 5, .. }
    ));
}

#[test]
fn a_held_read_is_recorded_before_a_cancellation_of_its_task_and_then_cancelled() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("b.db")).expect("open");
    open_task(&store, "task-1");
    let (recorded, recorded_rx) = completion();
    let id = store
        .record_read(task("task-1"), read_action("task-1"), t(1), recorded)
        .expect("read recorded");
    let report = store
        .cancel_task("agent-a", "task-1", t(2))
        .expect("cancel");
    wait(&recorded_rx).expect("the held read was queued before the cancellation");
    assert_eq!(report.actions_cancelled, 1, "{report:?}");
    let action = store.action(id).expect("read").expect("recorded");
    assert_eq!(action.outcome, Some(Outcome::Cancelled));
}

#[test]
fn a_held_read_is_found_by_a_blocking_operation_on_its_action() {
    let dir = tempfile::tempdir().expect("tempdir");
    let SentRead {
        store,
        id,
        recorded: _recorded_rx,
        sent: sent_rx,
    } = sent_read(dir.path());
    // A failed attempt's result through the blocking method (as a retried read records it).
    let mut failed = success(id, 1);
    failed.status = Some(503);
    failed.disposition = Disposition::Transient;
    failed.finish = None;
    store
        .record_result(failed, t(2))
        .expect("the held read and its attempt were recorded first");
    assert_eq!(wait(&sent_rx).expect("sent committed"), 1);
    // The retry is an operation of its own; the read is no longer held.
    let (sent, sent_rx) = completion();
    store.submit_attempt_sent(id, t(3), sent);
    let (done, done_rx) = completion();
    store.submit_result(success(id, 2), t(4), done);
    assert_eq!(wait(&sent_rx).expect("second attempt committed"), 2);
    wait(&done_rx).expect("result committed");
    assert_eq!(
        kinds(&store),
        [
            "task_opened",
            "action_requested",
            "action_sent",
            "action_result",
            "action_sent",
            "action_result",
            "action_finished"
        ]
    );
}

#[test]
fn a_held_read_is_written_whole_or_not_at_all() {
    let dir = tempfile::tempdir().expect("tempdir");
    let SentRead {
        store,
        id,
        recorded: recorded_rx,
        sent: sent_rx,
    } = sent_read(dir.path());
    // A result for an attempt that was never sent fails the read's one operation.
    let (done, done_rx) = completion();
    store.submit_result(success(id, 2), t(2), done);
    for err in [
        wait(&recorded_rx).expect_err("undone"),
        wait(&done_rx).expect_err("undone"),
    ] {
        assert!(
            matches!(&err, StoreError::NotFound { what } if what.contains("attempt 2")),
            "{err}"
        );
    }
    assert!(wait(&sent_rx).is_err());
    assert!(kinds(&store).is_empty(), "nothing of the read was written");
    assert!(store.action(id).expect("read").is_none());
}

#[test]
fn a_cancelled_task_refuses_reads_after_a_restart_without_a_query() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("b.db");
    {
        let store = SqliteStore::open(&path).expect("open");
        open_task(&store, "task-1");
        store
            .cancel_task("agent-a", "task-1", t(1))
            .expect("cancel");
    }
    let store = SqliteStore::open(&path).expect("reopen");
    let before = store.writer_stats().operations;
    let (done, _rx) = completion();
    let err = store
        .record_read(task("task-1"), read_action("task-1"), t(2), done)
        .expect_err("cancelled before the restart");
    assert!(
        matches!(&err, StoreError::InvalidTransition { reason, .. } if reason.contains("cancelled")),
        "{err}"
    );
    // Another task of the same agent still takes reads.
    let (done, rx) = completion();
    store
        .record_read(task("task-2"), read_action("task-2"), t(3), done)
        .expect("another task");
    store.flush().expect("flush");
    wait(&rx).expect("recorded");
    assert_eq!(
        store.writer_stats().operations - before,
        2,
        "the read and the flush"
    );
}

/// A read's final answer with every field the records carry set.
fn full_answer(action: ActionId, outcome: Outcome) -> AttemptResult {
    AttemptResult {
        action,
        attempt: 1,
        status: Some(200),
        disposition: Disposition::Success,
        boundary: Some(Boundary::At(t(60_000))),
        source: Some("Retry-After header".into()),
        provider_operation_id: Some("op-7".into()),
        signal_headers: vec![("retry-after".into(), "60".into())],
        finish: Some(Finish {
            outcome,
            context: serde_json::json!({ "sent": true, "attempts": 1 }),
            response: Some(StoredResponse {
                status: 200,
                headers: vec![("content-type".into(), "application/json".into())],
                body: b"{\"ok\":true}".to_vec(),
            }),
        }),
    }
}

/// Everything a read left in a store: the action, its attempts and the whole audit log
/// (seq, prev and hash included).
fn trace(store: &SqliteStore, id: ActionId) -> String {
    format!(
        "{:?}\n{:?}\n{:?}",
        store.action(id).expect("read"),
        store.attempts(id).expect("attempts"),
        store.audit_events(0, 100).expect("events")
    )
}

#[test]
fn an_answered_read_leaves_the_same_rows_and_chain_as_the_separate_operations() {
    for (task_exists, outcome) in [
        (false, Outcome::Succeeded),
        (true, Outcome::BudgetExhausted),
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        // As one held read.
        let held = SqliteStore::open(dir.path().join("held.db")).expect("open");
        if task_exists {
            open_task(&held, "task-1");
        }
        let (recorded, _rx) = completion();
        let id = held
            .record_read(task("task-1"), read_action("task-1"), t(1), recorded)
            .expect("read recorded");
        let (sent, _rx) = completion();
        held.submit_attempt_sent(id, t(2), sent);
        let (done, done_rx) = completion();
        held.submit_result(full_answer(id, outcome), t(3), done);
        wait(&done_rx).expect("committed");
        // As the separate blocking operations.
        let separate = SqliteStore::open(dir.path().join("separate.db")).expect("open");
        if task_exists {
            open_task(&separate, "task-1");
        }
        separate.open_task(task("task-1"), t(1)).expect("task");
        let Admission::New(same) = separate
            .record_action(read_action("task-1"), t(1))
            .expect("action")
        else {
            panic!("a read is always a new action");
        };
        assert_eq!(same, id);
        assert_eq!(separate.mark_attempt_sent(id, t(2)).expect("sent"), 1);
        separate
            .record_result(full_answer(id, outcome), t(3))
            .expect("result");
        assert_eq!(
            trace(&held, id),
            trace(&separate, id),
            "task existed: {task_exists}"
        );
    }
}

#[test]
fn a_read_left_unanswered_is_recorded_by_the_writer_and_its_result_follows_alone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let SentRead {
        store,
        id,
        recorded: recorded_rx,
        sent: sent_rx,
    } = sent_read(dir.path());
    // Nothing else happens: the writer queues the held read itself after the hold limit.
    wait(&recorded_rx).expect("recorded without an answer");
    assert_eq!(wait(&sent_rx).expect("sent committed"), 1);
    let before = store.writer_stats().operations;
    let (done, done_rx) = completion();
    store.submit_result(success(id, 1), t(2), done);
    wait(&done_rx).expect("result committed");
    assert_eq!(store.writer_stats().operations - before, 1);
    assert_eq!(kinds(&store), ONE_ATTEMPT_EVENTS);
}
