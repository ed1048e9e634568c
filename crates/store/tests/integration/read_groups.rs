//! Groups of reads only: the writer lets them gather for a while before it commits, commits
//! them without an fsync (`synchronous=NORMAL`) unless the last fsync is too old, and any
//! other operation ends the wait at once and is fsync'd as always.

// The tests time how long the writer makes a caller wait.
#![allow(clippy::disallowed_methods)]

use std::sync::mpsc;
use std::time::{Duration, Instant};

use backstop_store::{ActionId, SqliteStore, Store, StoreError};

use crate::common::{completion, kinds, new_task, open_task, read_action_of, success, t, wait};

/// Records a read of `task` at `at_ms` and submits its send and answer; returns its id and the
/// receiver of its answer's completion (none of it awaited).
fn answered_read(
    store: &SqliteStore,
    task: &str,
    at_ms: i64,
) -> (ActionId, mpsc::Receiver<Result<(), StoreError>>) {
    let (recorded, _) = completion();
    let id = store
        .record_read(
            new_task(task, "agent-a"),
            read_action_of(task, "agent-a"),
            t(at_ms),
            recorded,
        )
        .expect("read recorded");
    let (sent, _) = completion::<u32>();
    store.submit_attempt_sent(id, t(at_ms), sent);
    let (done, done_rx) = completion();
    store.submit_result(success(id, 1), t(at_ms + 1), done);
    (id, done_rx)
}

/// Records `n` answered reads of `task-r`, 10 ms of instants apart, each awaited before the
/// next is recorded.
fn commit_reads_one_by_one(store: &SqliteStore, n: i64) {
    for i in 0..n {
        let (_, answer) = answered_read(store, "task-r", i * 10);
        wait(&answer).expect("read committed");
    }
}

#[test]
fn reads_alone_wait_for_more_and_a_write_ends_the_wait_at_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("b.db")).expect("open");
    // Long enough that only the write below can end it within the test.
    store.set_read_linger(Duration::from_secs(60));
    let before = store.writer_stats();
    let mut answers = Vec::new();
    for i in 0..3 {
        answers.push(answered_read(&store, "task-r", i * 10).1);
        std::thread::sleep(Duration::from_millis(30));
    }
    // 90 ms after the first read, none has committed: they are waiting for more.
    for answer in &answers {
        assert!(
            matches!(answer.try_recv(), Err(mpsc::TryRecvError::Empty)),
            "a read committed before the linger ended"
        );
    }
    assert_eq!(store.writer_stats().transactions, before.transactions);

    // A blocking operation that is not a read: it wakes the writer and commits with them.
    let started = Instant::now();
    open_task(&store, "task-w");
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_secs(10),
        "the write waited {waited:?} for the reads' linger"
    );
    for answer in &answers {
        wait(answer).expect("read committed with the write");
    }
    let after = store.writer_stats();
    assert_eq!(
        after.transactions - before.transactions,
        1,
        "three reads and the write share one commit"
    );
    assert_eq!(
        after.lazy_transactions, before.lazy_transactions,
        "a group holding a write is fsync'd"
    );
    assert_eq!(after.operations - before.operations, 4);
}

#[test]
fn a_group_of_reads_only_commits_without_an_fsync_and_the_next_write_with_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("b.db")).expect("open");
    store.set_read_linger(Duration::from_millis(20));
    store.set_read_sync_interval(Duration::from_secs(3600));
    let before = store.writer_stats();
    let (_, answer) = answered_read(&store, "task-r", 0);
    wait(&answer).expect("the read committed once the linger passed");
    let after_read = store.writer_stats();
    assert_eq!(after_read.transactions - before.transactions, 1);
    assert_eq!(
        after_read.lazy_transactions - before.lazy_transactions,
        1,
        "a group of reads only is committed with synchronous=NORMAL"
    );

    open_task(&store, "task-w");
    let after_write = store.writer_stats();
    assert_eq!(after_write.transactions - after_read.transactions, 1);
    assert_eq!(
        after_write.lazy_transactions, after_read.lazy_transactions,
        "a write's group is fsync'd again"
    );
    // And both are in the chain, in order.
    let found = kinds(&store);
    assert_eq!(found.first().map(String::as_str), Some("task_opened"));
    assert_eq!(found.last().map(String::as_str), Some("task_opened"));
    assert_eq!(found.len(), 6);
    assert!(matches!(
        store.verify_audit(None).expect("verify"),
        backstop_store::audit::Verdict::Intact { .. }
    ));
}

#[test]
fn without_a_linger_each_group_of_reads_commits_as_soon_as_it_is_taken() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("b.db")).expect("open");
    store.set_read_linger(Duration::ZERO);
    store.set_read_sync_interval(Duration::from_secs(3600));
    let before = store.writer_stats();
    // Each committed by itself, without anything else arriving.
    commit_reads_one_by_one(&store, 3);
    let after = store.writer_stats();
    assert_eq!(after.transactions - before.transactions, 3);
    assert_eq!(after.lazy_transactions - before.lazy_transactions, 3);
}

#[test]
fn closing_the_store_does_not_wait_for_the_linger_and_keeps_the_reads() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("b.db");
    let store = SqliteStore::open(&path).expect("open");
    store.set_read_linger(Duration::from_secs(60));
    let (id, answer) = answered_read(&store, "task-r", 0);
    // Make sure the writer took the read and is lingering over it before the store closes.
    std::thread::sleep(Duration::from_millis(50));
    let started = Instant::now();
    drop(store);
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_secs(10),
        "closing waited {waited:?} for the linger"
    );
    wait(&answer).expect("the read committed when the store closed");

    let store = SqliteStore::open(&path).expect("reopen");
    let action = store.action(id).expect("action").expect("the read is kept");
    assert_eq!(action.task_id, "task-r");
    assert_eq!(kinds(&store).len(), 5);
}

#[test]
fn a_group_of_reads_is_fsynced_once_the_last_fsync_is_older_than_the_interval() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("b.db")).expect("open");
    store.set_read_linger(Duration::ZERO);
    // Every group is past an interval of zero: each is fsync'd.
    store.set_read_sync_interval(Duration::ZERO);
    let before = store.writer_stats();
    commit_reads_one_by_one(&store, 3);
    let after = store.writer_stats();
    assert_eq!(after.transactions - before.transactions, 3);
    assert_eq!(
        after.lazy_transactions, before.lazy_transactions,
        "no group of reads went without an fsync"
    );

    // An interval of an hour: the next groups are not fsync'd, and one 60 ms after the last
    // fsync is still within it.
    store.set_read_sync_interval(Duration::from_secs(3600));
    for i in 0..2 {
        std::thread::sleep(Duration::from_millis(30));
        let (_, answer) = answered_read(&store, "task-s", 100 + i * 10);
        wait(&answer).expect("read committed");
    }
    let later = store.writer_stats();
    assert_eq!(later.transactions - after.transactions, 2);
    assert_eq!(later.lazy_transactions - after.lazy_transactions, 2);
}
