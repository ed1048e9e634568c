//! `backstop audit verify|export|head --db` beside a running gateway: each reads one snapshot
//! of the store, however many queries it makes, while another writer commits.
//!
//! Without one read transaction, verify read the log, then counted the `attempts` rows after a
//! commit that had added an attempt and its `action_sent` event, and reported an untampered
//! store as cut (`the store records X attempts, but the log has X-1 action_sent events`).

// The test bounds its rounds by wall time on a slow machine.
#![allow(clippy::disallowed_methods)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use backstop_store::audit::Verdict;
use backstop_store::{Admission, AuditReader, SqliteStore, Store};

use crate::common::{new_action, new_task, success, t};

/// Actions each writer records at most: a log small enough to verify hundreds of times.
const ACTIONS_PER_WRITER: u64 = 200;

/// Writers that keep committing actions, attempts, results and new tasks until `stop` or
/// [`ACTIONS_PER_WRITER`].
fn busy_writers(
    store: &Arc<SqliteStore>,
    stop: &Arc<AtomicBool>,
) -> Vec<std::thread::JoinHandle<u64>> {
    (0..3)
        .map(|w| {
            let (store, stop) = (Arc::clone(store), Arc::clone(stop));
            std::thread::spawn(move || {
                let mut written = 0u64;
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) && i < ACTIONS_PER_WRITER {
                    // A new task now and then: `task_opened` events and task rows too.
                    let task = format!("task-{w}-{}", i / 8);
                    if i.is_multiple_of(8) {
                        store
                            .open_task(new_task(&task, "agent-a"), t(0))
                            .expect("open task");
                    }
                    let key = format!("w{w}-{i}");
                    let action = new_action(&task, &key, key.as_bytes());
                    let Admission::New(id) = store.record_action(action, t(1)).expect("record")
                    else {
                        panic!("key {key} existed");
                    };
                    store.mark_attempt_sent(id, t(2)).expect("sent");
                    if i.is_multiple_of(2) {
                        store.record_result(success(id, 1), t(3)).expect("result");
                    }
                    written += 1;
                    i += 1;
                    // Spread over the reader's rounds.
                    std::thread::sleep(Duration::from_millis(2));
                }
                written
            })
        })
        .collect()
}

#[test]
fn verify_export_and_head_each_read_one_snapshot_while_a_writer_commits() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("backstop.db");
    let store = Arc::new(SqliteStore::open(&path).expect("open store"));
    let stop = Arc::new(AtomicBool::new(false));
    let writers = busy_writers(&store, &stop);

    let started = Instant::now();
    let mut rounds = 0u32;
    let mut failures = Vec::new();
    // While the writers write, and at least 200 rounds (without one snapshot, several rounds
    // in a hundred saw two states of the store); at most 20 s on a slow machine.
    while (writers.iter().any(|w| !w.is_finished()) || rounds < 200)
        && started.elapsed() < Duration::from_secs(20)
    {
        rounds += 1;
        let reader = AuditReader::open(&path).expect("open reader");
        match reader.verify(None).expect("verify") {
            Verdict::Intact { .. } => {}
            Verdict::Broken(b) => failures.push(format!("round {rounds}: verify: {b}")),
        }
        // Several calls grouped in one snapshot: the head is the last event exported.
        let mut out = Vec::new();
        let (head, exported) = reader
            .in_snapshot(|r| (r.head(), r.export(0, &mut out)))
            .expect("snapshot");
        let head = head.expect("head").map_or(0, |h| h.seq);
        let exported = exported.expect("export");
        if head != exported {
            failures.push(format!(
                "round {rounds}: head seq {head}, but {exported} events exported"
            ));
        }
    }
    stop.store(true, Ordering::Relaxed);
    let written: u64 = writers.into_iter().map(|w| w.join().expect("writer")).sum();
    assert!(written > 0, "the writers committed nothing");
    assert!(
        failures.is_empty(),
        "{} of {rounds} rounds saw a store that was not one snapshot ({written} actions \
         written meanwhile):\n{}",
        failures.len(),
        failures.join("\n")
    );
    // What the writers left verifies once they stopped.
    let reader = AuditReader::open(&path).expect("open reader");
    assert!(matches!(
        reader.verify(None).expect("verify"),
        Verdict::Intact { .. }
    ));
}
