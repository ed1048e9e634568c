//! Store benchmarks: durable write-actions per second with group commit at 1, 16 and 256
//! concurrent writer threads, and audit-chain verification throughput in events per second.
//!
//! A "write action" is what the gateway does before a write's bytes may leave: record the
//! action with its key (`action_requested`) and mark its first attempt sent (`action_sent`),
//! each returning only after its group commit is fsync'd.
//!
//! Run: `cargo bench -p backstop-store --bench store -- --warm-up-time 1 --measurement-time 5`
#![allow(missing_docs)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use backstop_store::audit::{format_instant, verify_events, AuditEvent, Chain, Verdict};
use backstop_store::{
    Admission, NewAction, NewTask, PayloadDigest, Priority, RouteTemplate, SqliteStore, Store,
};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

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

criterion_group!(benches, durable_writes, verify);
criterion_main!(benches);
