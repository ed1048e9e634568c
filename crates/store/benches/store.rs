//! Store benchmarks: durable write-actions per second with group commit at 1, 16 and 256
//! concurrent writer threads, answered reads committed per second through the writer, and
//! audit-chain verification throughput in events per second.
//!
//! A "write action" is what the gateway does before a write's bytes may leave: record the
//! action with its key (`action_requested`) and mark its first attempt sent (`action_sent`),
//! each returning only after its group commit is fsync'd.
//!
//! An "answered read" is what the gateway records for a proxied GET: `record_read`, then
//! `submit_attempt_sent` and `submit_result` (status 200, finished `succeeded`), none of them
//! awaited — one writer operation per read (task and action rows, an attempt row, four audit
//! events). The callers never wait, so the writer thread is the bottleneck this measures.
//!
//! Run: `cargo bench -p backstop-store --bench store -- --warm-up-time 1 --measurement-time 5`
//!
//! One fixed run of answered reads without criterion, for instruction counts (the writer
//! thread's cost per read is the inclusive cost of `writer_loop` divided by the reads):
//! `STORE_BENCH_READS=20000 valgrind --tool=callgrind --toggle-collect='*writer_loop*'
//! target/release/deps/store-<hash> --bench`
#![allow(missing_docs)]

// The store tests' fixtures: a read's action and its plain answer (the rest is theirs alone).
#[path = "../tests/integration/common/mod.rs"]
#[allow(dead_code)]
mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use backstop_store::audit::{format_instant, verify_events, AuditEvent, Chain, Verdict};
use backstop_store::{
    ActionId, Admission, AttemptResult, NewAction, NewTask, PayloadDigest, Priority, RouteTemplate,
    SqliteStore, Store, StoreError,
};
use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};

fn at(ms: u64) -> jiff::Timestamp {
    jiff::Timestamp::from_millisecond(1_750_000_000_000 + ms as i64).expect("valid instant")
}

static KEYS: AtomicU64 = AtomicU64::new(0);

fn write_action(store: &SqliteStore, route: &RouteTemplate) {
    let k = KEYS.fetch_add(1, Ordering::Relaxed);
    let key = format!("bench-{k}");
    let action = NewAction {
        task_id: "bench".into(),
        agent: "bench-agent".into(),
        provider: "billing-api".into(),
        method: "POST".into(),
        route: route.clone(),
        request_class: "idempotent_write".into(),
        payload_digest: PayloadDigest::of(key.as_bytes()),
        target_digest: None,
        idempotency_key: key,
        external_reference: None,
        desired_outcome: None,
        fingerprint: None,
        request: None,
    };
    let Ok(Admission::New(id)) = store.record_action(action, at(k)) else {
        panic!("record_action failed in the benchmark");
    };
    store
        .mark_attempt_sent(id, at(k))
        .expect("mark_attempt_sent");
}

fn open_store(dir: &std::path::Path) -> Arc<SqliteStore> {
    let store = SqliteStore::open(dir.join("bench.db")).expect("open store");
    store
        .open_task(
            NewTask {
                id: "bench".into(),
                agent: "bench-agent".into(),
                priority: Priority::Normal,
                deadline: None,
            },
            at(0),
        )
        .expect("task");
    Arc::new(store)
}

/// Runs `total` write actions spread over `threads` threads; returns the wall time.
// The benchmark harness measures wall time itself; the ban on clock reads is for product code.
#[allow(clippy::disallowed_methods)]
fn run_writers(store: &Arc<SqliteStore>, threads: u64, total: u64) -> Duration {
    let route = RouteTemplate::try_new("/v1/transfers").expect("template");
    let barrier = Arc::new(std::sync::Barrier::new(threads as usize + 1));
    let handles: Vec<_> = (0..threads)
        .map(|w| {
            let n = total / threads + u64::from(w < total % threads);
            let (store, route, barrier) = (Arc::clone(store), route.clone(), Arc::clone(&barrier));
            std::thread::spawn(move || {
                barrier.wait();
                for _ in 0..n {
                    write_action(&store, &route);
                }
            })
        })
        .collect();
    barrier.wait();
    let start = std::time::Instant::now();
    for h in handles {
        h.join().expect("writer");
    }
    start.elapsed()
}

fn durable_writes(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open_store(dir.path());
    let mut group = c.benchmark_group("durable_write_actions");
    group.sample_size(10);
    group.throughput(Throughput::Elements(1));
    for threads in [1u64, 16, 256] {
        group.bench_with_input(BenchmarkId::from_parameter(threads), &threads, |b, &t| {
            b.iter_custom(|iters| run_writers(&store, t, iters.max(t)))
        });
    }
    group.finish();
}

/// The tasks the reading threads spread their reads over (the gateway sees many agents' tasks).
const READ_TASKS: u64 = 8;

/// A proxied GET as the gateway records it: no key, no payload, its fingerprint kept.
fn read_action(task: &str) -> NewAction {
    NewAction {
        fingerprint: Some("GET /v1/balance".into()),
        ..common::read_action_of(task, "bench-agent")
    }
}

/// A read's first attempt answered 200 and finished `succeeded`, with the outcome context the
/// gateway writes for it.
fn read_answer(action: ActionId) -> AttemptResult {
    let mut answer = common::success(action, 1);
    if let Some(finish) = answer.finish.as_mut() {
        finish.context = serde_json::json!({
            "sent": true,
            "response_received": true,
            "attempts": 1,
            "total_wait_ms": 0,
            "last_status": 200,
            "last_signal": "success",
            "boundary": null,
            "next_safe": [],
        });
    }
    answer
}

/// Records one answered read the way the gateway does, awaiting nothing; a failure of any of
/// its steps is counted in `failed`.
fn answered_read(store: &SqliteStore, task: &str, ms: u64, failed: &Arc<AtomicU64>) {
    let count = |failed: &Arc<AtomicU64>| {
        let failed = Arc::clone(failed);
        move |r: Result<(), StoreError>| {
            if r.is_err() {
                failed.fetch_add(1, Ordering::Relaxed);
            }
        }
    };
    let recorded = count(failed);
    let id = store
        .record_read(
            NewTask {
                id: task.into(),
                agent: "bench-agent".into(),
                priority: Priority::Normal,
                deadline: None,
            },
            read_action(task),
            at(ms),
            Box::new(recorded),
        )
        .expect("record_read");
    let sent = count(failed);
    store.submit_attempt_sent(id, at(ms), Box::new(move |r| sent(r.map(|_| ()))));
    store.submit_result(read_answer(id), at(ms + 1), Box::new(count(failed)));
}

/// Runs `total` answered reads spread over `threads` threads; returns the wall time until the
/// last of them committed.
#[allow(clippy::disallowed_methods)] // see run_writers
fn run_readers(store: &Arc<SqliteStore>, threads: u64, total: u64) -> Duration {
    let failed = Arc::new(AtomicU64::new(0));
    let barrier = Arc::new(std::sync::Barrier::new(threads as usize + 1));
    let handles: Vec<_> = (0..threads)
        .map(|w| {
            let n = total / threads + u64::from(w < total % threads);
            let (store, failed, barrier) =
                (Arc::clone(store), Arc::clone(&failed), Arc::clone(&barrier));
            std::thread::spawn(move || {
                let tasks: Vec<String> = (0..READ_TASKS).map(|t| format!("read-{t}")).collect();
                barrier.wait();
                for i in 0..n {
                    let k = KEYS.fetch_add(1, Ordering::Relaxed);
                    answered_read(&store, &tasks[((w + i) % READ_TASKS) as usize], k, &failed);
                }
            })
        })
        .collect();
    barrier.wait();
    let start = std::time::Instant::now();
    for h in handles {
        h.join().expect("reader");
    }
    // Commits after every read queued before it.
    store.flush().expect("flush");
    let elapsed = start.elapsed();
    assert_eq!(failed.load(Ordering::Relaxed), 0, "no read may fail");
    elapsed
}

fn answered_reads(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open_store(dir.path());
    let mut group = c.benchmark_group("answered_reads");
    group.sample_size(10);
    group.throughput(Throughput::Elements(1));
    for threads in [1u64, 32] {
        group.bench_with_input(BenchmarkId::from_parameter(threads), &threads, |b, &t| {
            b.iter_custom(|iters| run_readers(&store, t, iters.max(t)))
        });
    }
    group.finish();
}

/// How a write's latency changes when reads are recorded beside it: one write action (two
/// fsync'd commits, see [`write_action`]) while two threads record answered reads at a steady
/// pace (one every 250 µs each, about 7,000 a second together), with the writer grouping
/// reads as it does by default (`read_groups`: reads linger up to 5 ms and are not fsync'd
/// alone), with every group committed and fsync'd at once (`every_group_fsynced`: linger and
/// sync interval zero, the store before read groups), and with no reads at all (`no_reads`).
fn write_beside_reads(c: &mut Criterion) {
    let route = RouteTemplate::try_new("/v1/transfers").expect("template");
    let mut group = c.benchmark_group("write_beside_reads");
    group.sample_size(30);
    for setting in ["no_reads", "read_groups", "every_group_fsynced"] {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open_store(dir.path());
        if setting == "every_group_fsynced" {
            store.set_read_linger(Duration::ZERO);
            store.set_read_sync_interval(Duration::ZERO);
        }
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let failed = Arc::new(AtomicU64::new(0));
        let readers: Vec<_> = (0..if setting == "no_reads" { 0 } else { 2 })
            .map(|w| {
                let (store, stop, failed) =
                    (Arc::clone(&store), Arc::clone(&stop), Arc::clone(&failed));
                std::thread::spawn(move || {
                    let task = format!("read-{w}");
                    while !stop.load(Ordering::Relaxed) {
                        let k = KEYS.fetch_add(1, Ordering::Relaxed);
                        answered_read(&store, &task, k, &failed);
                        std::thread::sleep(Duration::from_micros(250));
                    }
                })
            })
            .collect();
        group.bench_function(setting, |b| b.iter(|| write_action(&store, &route)));
        stop.store(true, Ordering::Relaxed);
        for r in readers {
            r.join().expect("reader");
        }
        assert_eq!(failed.load(Ordering::Relaxed), 0, "no read may fail");
    }
    group.finish();
}

/// `STORE_BENCH_READS=n`: one run of `n` answered reads over 32 threads on a fresh store, with
/// the reads per second, the writer's transactions and (on Linux) the CPU time and the bytes
/// the writer thread spent per read printed (for callgrind, see the top). The bytes are the
/// writer thread's `wchar` from `/proc/self/task/<tid>/io`: what it handed to `write`/`pwrite`
/// (WAL frames, and database pages when a checkpoint ran), whether or not the disk was reached
/// yet; the database file's size after the store closed (checkpointed, WAL removed) is printed
/// per read too.
fn one_run_of_reads(n: u64) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open_store(dir.path());
    let before = store.writer_stats();
    let cpu_before = writer_cpu_ticks();
    let io_before = writer_written_bytes();
    let elapsed = run_readers(&store, 32, n);
    let cpu = writer_cpu_ticks().zip(cpu_before).map(|(a, b)| a - b);
    // The writer is idle once every read is committed; its bytes are counted before the
    // store closes (and checkpoints), which is not a per-read cost.
    let written = writer_written_bytes().zip(io_before).map(|(a, b)| a - b);
    let after = store.writer_stats();
    let events = store.audit_head().expect("head").map_or(0, |h| h.seq);
    drop(store);
    let db_bytes = std::fs::metadata(dir.path().join("bench.db")).map_or(0, |m| m.len());
    // Clock ticks are 10 ms on Linux (USER_HZ = 100).
    let per_read = cpu.map_or("n/a".to_owned(), |ticks| {
        format!("{:.1} µs", ticks as f64 * 10_000.0 / n as f64)
    });
    let written_per_read = written.map_or("n/a".to_owned(), |bytes| {
        format!("{:.0} B", bytes as f64 / n as f64)
    });
    println!(
        "{n} answered reads in {:.3} s: {:.0} reads/s; {} transactions, {} operations, \
         {events} events; writer CPU per read {per_read}; writer wrote per read \
         {written_per_read}; database after close {db_bytes} B ({:.0} B per read)",
        elapsed.as_secs_f64(),
        n as f64 / elapsed.as_secs_f64(),
        after.transactions - before.transactions,
        after.operations - before.operations,
        db_bytes as f64 / n as f64,
    );
}

/// The store writer thread of this process, as its `/proc/self/task/<tid>` directory (Linux).
fn writer_task() -> Option<std::path::PathBuf> {
    std::fs::read_dir("/proc/self/task")
        .ok()?
        .flatten()
        .map(|task| task.path())
        .find(|path| {
            std::fs::read_to_string(path.join("comm"))
                .is_ok_and(|comm| comm.starts_with("backstop-store-"))
        })
}

/// User + system clock ticks of this process's store writer thread, from /proc (Linux only).
fn writer_cpu_ticks() -> Option<u64> {
    let stat = std::fs::read_to_string(writer_task()?.join("stat")).ok()?;
    // `pid (comm) state ...`: comm may hold spaces, the fields after it do not.
    let (_, rest) = stat.rsplit_once(") ")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after `state`.
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
    Some(ticks(11)? + ticks(12)?)
}

/// Bytes the store writer thread passed to `write`-family calls (`wchar`), from /proc.
fn writer_written_bytes() -> Option<u64> {
    let io = std::fs::read_to_string(writer_task()?.join("io")).ok()?;
    io.lines()
        .find_map(|line| line.strip_prefix("wchar: "))
        .and_then(|v| v.trim().parse().ok())
}

fn chain_of(n: u64) -> Vec<AuditEvent> {
    let mut chain = Chain::genesis();
    (0..n)
        .map(|i| {
            let mut e = AuditEvent::new(
                if i % 2 == 0 {
                    "action_requested"
                } else {
                    "action_sent"
                },
                &format_instant(at(i)),
            );
            e.task = Some("task-1".into());
            e.action = Some((i / 2) as i64);
            e.provider = Some("billing-api".into());
            e.route = Some("/v1/transfers/{id}".into());
            e.method = Some("POST".into());
            e.request_class = Some("idempotent_write".into());
            e.idempotency_key = Some(format!("key-{}", i / 2));
            chain.seal(&mut e);
            e
        })
        .collect()
}

fn verify(c: &mut Criterion) {
    let mut group = c.benchmark_group("audit_verify");
    group.sample_size(10);

    let n = 100_000u64;
    let events = chain_of(n);
    group.throughput(Throughput::Elements(n));
    group.bench_function("in_memory_100k", |b| {
        b.iter(|| {
            let v = verify_events(&events, None);
            assert!(matches!(v, Verdict::Intact { count, .. } if count == n));
        })
    });

    // The same check reading from a database (what `backstop audit verify --db` does).
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open_store(dir.path());
    run_writers(&store, 64, 10_000);
    let events = store.audit_head().expect("head").map_or(0, |h| h.seq);
    drop(store);
    let reader = backstop_store::AuditReader::open(dir.path().join("bench.db")).expect("reader");
    group.throughput(Throughput::Elements(events));
    group.bench_function(format!("sqlite_{events}"), |b| {
        b.iter(|| {
            let v = reader.verify(None).expect("verify");
            assert!(matches!(v, Verdict::Intact { count, .. } if count == events));
        })
    });
    group.finish();
}

criterion_group!(
    benches,
    durable_writes,
    answered_reads,
    write_beside_reads,
    verify
);

fn main() {
    if let Some(n) = std::env::var("STORE_BENCH_READS")
        .ok()
        .and_then(|n| n.parse().ok())
    {
        return one_run_of_reads(n);
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
