//! Operations queued without blocking: `begin_action`, `record_read`, `submit_attempt_sent`,
//! `submit_result`. Their completions come after the commit; the events of one action keep
//! their order; reads through the store see everything queued before them.

use backstop_store::audit::Verdict;
use backstop_store::{ActionState, Admission, NewAction, SqliteStore, Store, StoreError};

use crate::common::{
    completion, kinds, new_action, new_task as task, open_task, read_action_of, record, success, t,
    wait, ONE_ATTEMPT_EVENTS,
};

fn read_action(task: &str) -> NewAction {
    read_action_of(task, "agent-a")
}

#[test]
fn a_read_recorded_without_waiting_keeps_its_events_in_order_and_the_chain_intact() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("b.db")).expect("open");
    let (recorded, recorded_rx) = completion();
    let id = store
        .record_read(
            task("task-r", "agent-a"),
            read_action("task-r"),
            t(0),
            recorded,
        )
        .expect("read recorded");
    let (sent, sent_rx) = completion();
    store.submit_attempt_sent(id, t(1), sent);
    let (done, done_rx) = completion();
    store.submit_result(success(id, 1), t(2), done);
    wait(&recorded_rx).expect("record committed");
    assert_eq!(wait(&sent_rx).expect("sent committed"), 1);
    wait(&done_rx).expect("result committed");
    assert_eq!(kinds(&store), ONE_ATTEMPT_EVENTS);
    let action = store.action(id).expect("read").expect("recorded");
    assert_eq!(action.state, ActionState::Finished);
    assert_eq!(action.idempotency_key, "");
    assert!(matches!(
        store.verify_audit(None).expect("verify"),
        Verdict::Intact { count: 5, .. }
    ));
}

#[test]
fn reads_through_the_store_see_operations_queued_before_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("b.db")).expect("open");
    let (recorded, _rx) = completion();
    let id = store
        .record_read(
            task("task-r", "agent-a"),
            read_action("task-r"),
            t(0),
            recorded,
        )
        .expect("read recorded");
    let (sent, _sent_rx) = completion();
    store.submit_attempt_sent(id, t(1), sent);
    // No completion awaited: the read methods wait for the queue themselves.
    let attempts = store.attempts(id).expect("attempts");
    assert_eq!(attempts.len(), 1);
    assert_eq!(
        store.action(id).expect("read").map(|a| a.state),
        Some(ActionState::InFlight)
    );
}

#[test]
fn a_read_with_an_idempotency_key_is_refused_as_a_write() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("b.db")).expect("open");
    let (done, _rx) = completion();
    let err = store
        .record_read(
            task("task-w", "agent-a"),
            new_action("task-w", "key-1", b"{}"),
            t(0),
            done,
        )
        .expect_err("a keyed action is a write");
    assert!(matches!(
        err,
        StoreError::Invalid {
            field: "idempotency_key",
            ..
        }
    ));
    assert!(kinds(&store).is_empty(), "nothing was queued");
}

#[test]
fn a_read_for_a_cancelled_or_mismatched_task_is_refused_before_it_is_queued() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("b.db")).expect("open");
    open_task(&store, "task-1");
    store
        .cancel_task("agent-a", "task-1", t(1))
        .expect("cancel");
    let (done, _rx) = completion();
    let err = store
        .record_read(task("task-1", "agent-a"), read_action("task-1"), t(2), done)
        .expect_err("cancelled");
    assert!(
        matches!(&err, StoreError::InvalidTransition { reason, .. } if reason.contains("cancelled")),
        "{err}"
    );
    let (done, _rx) = completion();
    let err = store
        .record_read(task("task-1", "agent-b"), read_action("task-1"), t(2), done)
        .expect_err("the action names another agent than the task");
    assert!(
        matches!(
            &err,
            StoreError::Invalid {
                field: "task_id",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn a_read_under_another_agents_task_id_opens_its_own_task() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("b.db")).expect("open");
    open_task(&store, "task-1");
    store
        .cancel_task("agent-a", "task-1", t(1))
        .expect("cancel");
    let (done, rx) = completion();
    store
        .record_read(
            task("task-1", "agent-b"),
            read_action_of("task-1", "agent-b"),
            t(2),
            done,
        )
        .expect("agent-b's own task-1 is not agent-a's cancelled one");
    rx.recv().expect("reply").expect("recorded");
    let b = store
        .task("agent-b", "task-1")
        .expect("read")
        .expect("task");
    assert_eq!(b.cancelled_at, None);
    let a = store
        .task("agent-a", "task-1")
        .expect("read")
        .expect("task");
    assert!(a.cancelled_at.is_some());
}

#[test]
fn begin_action_opens_the_task_and_records_a_write_durably_in_one_operation() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("b.db")).expect("open");
    let before = store.writer_stats().operations;
    let (done, rx) = completion();
    store.begin_action(
        task("task-w", "agent-a"),
        new_action("task-w", "key-1", b"{}"),
        t(0),
        done,
    );
    let Admission::New(id) = wait(&rx).expect("begun") else {
        panic!("a new key is a new action");
    };
    assert_eq!(store.writer_stats().operations - before, 1);
    assert_eq!(kinds(&store), ["task_opened", "action_requested"]);
    // The same key again is the same action.
    let (again, rx) = completion();
    store.begin_action(
        task("task-w", "agent-a"),
        new_action("task-w", "key-1", b"{}"),
        t(1),
        again,
    );
    assert!(matches!(wait(&rx), Ok(Admission::Existing(a)) if a.id == id));
    let (sent, rx) = completion();
    store.submit_attempt_sent(id, t(2), sent);
    assert_eq!(wait(&rx).expect("sent durably"), 1);
}

#[test]
fn ids_handed_out_in_advance_never_collide_with_writes_or_after_a_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("b.db");
    let mut ids = Vec::new();
    {
        let store = SqliteStore::open(&path).expect("open");
        for i in 0..5 {
            let (done, _rx) = completion();
            ids.push(
                store
                    .record_read(task("task-1", "agent-a"), read_action("task-1"), t(i), done)
                    .expect("read"),
            );
            ids.push(record(
                &store,
                "task-1",
                &format!("key-{i}"),
                format!("payload {i}").as_bytes(),
            ));
        }
    }
    let store = SqliteStore::open(&path).expect("reopen");
    let (done, rx) = completion();
    ids.push(
        store
            .record_read(task("task-1", "agent-a"), read_action("task-1"), t(9), done)
            .expect("read"),
    );
    wait(&rx).expect("committed");
    let mut unique = ids.clone();
    unique.sort_by_key(|id| id.0);
    unique.dedup();
    assert_eq!(unique.len(), ids.len(), "{ids:?}");
    for id in &ids {
        assert!(
            store.action(*id).expect("read").is_some(),
            "action {id} recorded"
        );
    }
}
