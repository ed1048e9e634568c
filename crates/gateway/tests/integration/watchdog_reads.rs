//! The watchdog reads only what can concern a throttled action: through
//! `Store::watch_events`, the store leaves out the plain reads (answered at their first attempt
//! and finished `succeeded`), except their `action_sent`, which still moves the scheduler
//! heartbeat. Two paths answer it: the writer's in-memory feed for what this store committed,
//! and the database for what was committed before it was opened. Folding what either keeps gives
//! the same trails and heartbeat as folding every event, whatever the page size, and a check
//! commits nothing and leaves held reads held.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use backstop_core::diagnose::Diagnosis;
use backstop_gateway::health::Evidence;
use backstop_gateway::metrics::Metrics;
use backstop_gateway::watchdog::{Watchdog, WatchdogConfig};
use backstop_store::audit::AuditEvent;
use backstop_store::{
    ActionId, Admission, AttemptResult, Boundary, Completion, Disposition, Finish, NewAction,
    NewTask, Outcome, PayloadDigest, Priority, RouteTemplate, SqliteStore, Store, StoreError,
};
use jiff::{SignedDuration, Timestamp};

fn at(ms: i64) -> Timestamp {
    let t0: Timestamp = "2026-07-26T18:40:00Z".parse().expect("t0");
    t0 + SignedDuration::from_millis(ms)
}

fn store() -> (tempfile::TempDir, Arc<SqliteStore>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Arc::new(SqliteStore::open(dir.path().join("backstop.db")).expect("store"));
    (dir, store)
}

/// The same database opened again: everything in it was committed before this store opened,
/// so `watch_events` reads it from the database.
fn reopened(dir: &tempfile::TempDir, store: Arc<SqliteStore>) -> Arc<SqliteStore> {
    drop(Arc::into_inner(store).expect("the only handle"));
    Arc::new(SqliteStore::open(dir.path().join("backstop.db")).expect("reopened"))
}

fn task(id: &str) -> NewTask {
    NewTask {
        id: id.into(),
        agent: "agent-a".into(),
        priority: Priority::Normal,
        deadline: Some(at(600_000)),
    }
}

fn action(task: &str, method: &str, class: &str, key: &str) -> NewAction {
    NewAction {
        task_id: task.into(),
        agent: "agent-a".into(),
        provider: "llm".into(),
        method: method.into(),
        route: RouteTemplate::try_new("/v1/models").expect("route"),
        request_class: class.into(),
        payload_digest: PayloadDigest::of(b""),
        target_digest: None,
        idempotency_key: key.into(),
        external_reference: None,
        desired_outcome: None,
        fingerprint: None,
        request: None,
    }
}

fn completion<T: Send + 'static>() -> (Completion<T>, mpsc::Receiver<Result<T, StoreError>>) {
    let (tx, rx) = mpsc::channel();
    (
        Box::new(move |r| {
            let _ = tx.send(r);
        }),
        rx,
    )
}

fn wait<T>(rx: &mpsc::Receiver<Result<T, StoreError>>) -> T {
    rx.recv_timeout(Duration::from_secs(10))
        .expect("the completion was called")
        .expect("committed")
}

/// A read of `reads` sent at `ms` and answered 200 at `ms + 1`, through the one-operation path.
fn plain_read(store: &SqliteStore, ms: i64) -> ActionId {
    let (recorded, recorded_rx) = completion();
    let id = store
        .record_read(
            task("reads"),
            action("reads", "GET", "read", ""),
            at(ms),
            recorded,
        )
        .expect("read recorded");
    let (sent, sent_rx) = completion();
    store.submit_attempt_sent(id, at(ms), sent);
    let (done, done_rx) = completion();
    store.submit_result(
        AttemptResult {
            action: id,
            attempt: 1,
            status: Some(200),
            disposition: Disposition::Success,
            boundary: None,
            source: None,
            provider_operation_id: None,
            signal_headers: Vec::new(),
            finish: Some(Finish {
                outcome: Outcome::Succeeded,
                context: serde_json::json!({}),
                response: None,
            }),
        },
        at(ms + 1),
        done,
    );
    wait(&recorded_rx);
    wait(&sent_rx);
    wait(&done_rx);
    id
}

/// A write of `run-1` sent at `ms`, answered 429 with a boundary 10 s later, its retry
/// scheduled at the boundary and never claimed.
fn throttled_write(store: &SqliteStore, ms: i64) -> ActionId {
    store.open_task(task("run-1"), at(ms)).expect("task");
    let Admission::New(id) = store
        .record_action(action("run-1", "POST", "idempotent_write", "key-1"), at(ms))
        .expect("action")
    else {
        panic!("a fresh key was taken as existing");
    };
    let n = store.mark_attempt_sent(id, at(ms)).expect("sent");
    store
        .record_result(
            AttemptResult {
                action: id,
                attempt: n,
                status: Some(429),
                disposition: Disposition::RateLimited,
                boundary: Some(Boundary::At(at(ms + 10_000))),
                source: Some("Retry-After".into()),
                provider_operation_id: None,
                signal_headers: Vec::new(),
                finish: None,
            },
            at(ms),
        )
        .expect("result");
    store
        .schedule_retry(id, at(ms + 10_000), at(ms))
        .expect("job");
    id
}

/// Plain reads before and after one throttled write; returns (reads, write).
fn mixed_log(store: &SqliteStore) -> (Vec<ActionId>, ActionId) {
    let mut reads: Vec<ActionId> = (0..3).map(|i| plain_read(store, i * 10)).collect();
    let write = throttled_write(store, 50);
    reads.extend((0..3).map(|i| plain_read(store, 100 + i * 10)));
    store.flush().expect("flush");
    (reads, write)
}

fn fold_watched(store: &SqliteStore, limit: usize) -> Evidence {
    let mut evidence = Evidence::new();
    let mut cursor = 0;
    loop {
        let (page, last) = store.watch_events(cursor, limit).expect("watch events");
        let Some(last) = last else {
            return evidence;
        };
        assert!(page.len() <= limit);
        assert!(page.iter().all(|e| e.seq > cursor && e.seq <= last));
        for event in &page {
            evidence.ingest(event).expect("ingest");
        }
        cursor = last;
    }
}

/// The `seq`s the database path keeps: every event but `task_opened` and the reads' other
/// events.
fn kept_by_rule(all: &[AuditEvent], reads: &[ActionId]) -> Vec<u64> {
    let is_read = |a: Option<i64>| a.is_some_and(|a| reads.iter().any(|r| r.0 == a));
    all.iter()
        .filter(|e| e.kind != "task_opened")
        .filter(|e| !is_read(e.action) || e.kind == "action_sent")
        .map(|e| e.seq)
        .collect()
}

/// The `seq` of `action`'s `action_sent`.
fn sent_seq(all: &[AuditEvent], action: ActionId) -> u64 {
    all.iter()
        .find(|e| e.action == Some(action.0) && e.kind == "action_sent")
        .map(|e| e.seq)
        .expect("sent")
}

#[test]
fn from_the_database_plain_reads_are_left_out_but_their_sends_and_every_event_of_a_throttled_action_are_kept(
) {
    let (dir, store) = store();
    let (reads, write) = mixed_log(&store);
    let store = reopened(&dir, store);
    let all = store.audit_events(0, usize::MAX).expect("events");
    let (kept, last) = store.watch_events(0, 1_000).expect("watch events");
    assert_eq!(
        last,
        all.last().map(|e| e.seq),
        "the whole log was looked at"
    );
    assert_eq!(
        kept.iter().map(|e| e.seq).collect::<Vec<_>>(),
        kept_by_rule(&all, &reads)
    );
    // Every read's events were in the log, and only its send is kept.
    for read in &reads {
        let kinds = |events: &[AuditEvent]| -> Vec<String> {
            events
                .iter()
                .filter(|e| e.action == Some(read.0))
                .map(|e| e.kind.clone())
                .collect()
        };
        assert_eq!(
            kinds(&all),
            [
                "action_requested",
                "action_sent",
                "action_result",
                "action_finished"
            ]
        );
        assert_eq!(kinds(&kept), ["action_sent"]);
    }
    let write_events = |events: &[AuditEvent]| -> usize {
        events.iter().filter(|e| e.action == Some(write.0)).count()
    };
    assert_eq!(write_events(&kept), write_events(&all));
    assert!(
        write_events(&all) >= 4,
        "requested, sent, result, scheduled"
    );
}

#[test]
fn from_the_feed_a_run_of_plain_reads_leaves_only_its_latest_send_and_the_write_whole() {
    let (_dir, store) = store();
    let (reads, write) = mixed_log(&store);
    let all = store.audit_events(0, usize::MAX).expect("events");
    let (kept, last) = store.watch_events(0, 1_000).expect("watch events");
    assert_eq!(last, all.last().map(|e| e.seq));
    // The three reads before the write leave the third one's send, the three after it the
    // sixth one's; the write's events are all there, as sealed.
    let mut expected = vec![sent_seq(&all, reads[2])];
    expected.extend(
        all.iter()
            .filter(|e| e.action == Some(write.0))
            .map(|e| e.seq),
    );
    expected.push(sent_seq(&all, reads[5]));
    assert_eq!(kept.iter().map(|e| e.seq).collect::<Vec<_>>(), expected);
    for event in &kept {
        let sealed = all.iter().find(|e| e.seq == event.seq).expect("in the log");
        if event.action == Some(write.0) {
            assert_eq!(event, sealed, "the write's events as sealed");
        } else {
            // A plain read's send stands in with what a watcher takes from it.
            assert_eq!(
                (&event.at, &event.kind, event.action, event.attempt),
                (&sealed.at, &sealed.kind, sealed.action, sealed.attempt)
            );
        }
    }
    // Asked again from the start, the feed no longer holds it: the database answers, in full.
    let (again, _) = store.watch_events(0, 1_000).expect("watch events");
    assert_eq!(
        again.iter().map(|e| e.seq).collect::<Vec<_>>(),
        kept_by_rule(&all, &reads)
    );
}

#[test]
fn folding_the_kept_events_gives_every_trail_and_heartbeat_in_pages_of_any_size() {
    for limit in [1, 2, 3, 5, 7, 1_000] {
        let (dir, store) = store();
        let (_reads, write) = mixed_log(&store);
        let mut full = Evidence::new();
        full.catch_up(store.as_ref()).expect("full fold");
        full.forget_finished();
        assert!(full.heartbeat_at().is_some());
        let from_feed = fold_watched(&store, limit);
        let store = reopened(&dir, store);
        let from_database = fold_watched(&store, limit);
        for (path, mut watched) in [("feed", from_feed), ("database", from_database)] {
            assert_eq!(
                watched.heartbeat_at(),
                full.heartbeat_at(),
                "{path}, page size {limit}"
            );
            // The last plain read's send is the heartbeat.
            assert_eq!(
                watched.heartbeat_at(),
                Some(at(120)),
                "{path}, page size {limit}"
            );
            watched.forget_finished();
            let open: Vec<i64> = watched.trails().map(|t| t.action).collect();
            assert_eq!(
                open,
                [write.0],
                "{path}, page size {limit}: no read is left open"
            );
            assert_eq!(
                watched.trail(write.0),
                full.trail(write.0),
                "{path}, page size {limit}"
            );
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_stuck_wake_among_plain_reads_is_found_and_a_check_commits_nothing() {
    let (_dir, store) = store();
    let (_reads, write) = mixed_log(&store);
    let config = WatchdogConfig {
        interval: Duration::from_secs(5),
        grace: Duration::from_secs(30),
        escalate: false,
        ..WatchdogConfig::default()
    };
    let mut watchdog = Watchdog::new(store.clone(), Arc::new(Metrics::new()), config);
    // The first check looks up the task's deadline (a store read, which commits what is queued).
    assert_eq!(watchdog.check(at(40_000)).expect("check"), []);
    // A read held in the store (sent, not answered): a check neither queues it nor commits.
    let (recorded, _recorded_rx) = completion();
    let held = store
        .record_read(
            task("reads"),
            action("reads", "GET", "read", ""),
            at(200),
            recorded,
        )
        .expect("read recorded");
    let (sent, _sent_rx) = completion();
    store.submit_attempt_sent(held, at(200), sent);
    let before = store.writer_stats().operations;
    assert_eq!(watchdog.check(at(40_050)).expect("check"), []);
    assert_eq!(
        store.writer_stats().operations,
        before,
        "a check without findings commits nothing"
    );
    let raised = watchdog.check(at(40_051)).expect("check");
    assert_eq!(raised.len(), 1);
    assert_eq!(raised[0].action, write);
    assert_eq!(raised[0].diagnosis, Diagnosis::StuckMissedWake);
}
