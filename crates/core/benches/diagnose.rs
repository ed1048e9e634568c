//! Diagnose throughput: parse + validate + diagnose + totals of NDJSON snapshot lines, in
//! snapshots per second. Target from the roadmap: ≥ 500,000 snapshots/s.
//!
//! Run: `cargo bench -p backstop-core --bench diagnose -- --warm-up-time 1 --measurement-time 5`

use std::hint::black_box;

use backstop_core::diagnose::{diagnose_owned, parse_snapshot, DiagnoseOptions, Totals};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

const FIXTURE: &str = include_str!("../tests/fixtures/six_case_audit.ndjson");

/// `n` lines cycling through the six-case audit, each with its own run id (so the per-run totals
/// grow like a real fleet's) and one of 50 scopes.
fn lines(n: usize) -> Vec<String> {
    let base: Vec<serde_json::Value> = FIXTURE
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (0..n)
        .map(|i| {
            let mut v = base[i % base.len()].clone();
            v["run_id"] = format!("run-{i}").into();
            v["quota_scope"] = format!("api-{}/account:ops", i % 50).into();
            v.to_string()
        })
        .collect()
}

fn bench_diagnose(c: &mut Criterion) {
    let now = "2026-07-26T18:42:00Z".parse().unwrap();
    let opts = DiagnoseOptions::default();
    let input = lines(10_000);
    let mut group = c.benchmark_group("diagnose");
    group.throughput(Throughput::Elements(input.len() as u64));
    group.bench_function("parse_diagnose_totals_10k_lines", |b| {
        b.iter(|| {
            let mut totals = Totals::default();
            for line in &input {
                let snapshot = parse_snapshot(black_box(line.as_bytes())).unwrap();
                let report = diagnose_owned(snapshot, now, &opts);
                totals.add(&report);
            }
            black_box(totals.retry_after_debt_ms)
        })
    });
    group.bench_function("parse_diagnose_10k_lines", |b| {
        b.iter(|| {
            let mut debt = 0u64;
            for line in &input {
                let snapshot = parse_snapshot(black_box(line.as_bytes())).unwrap();
                debt += diagnose_owned(snapshot, now, &opts)
                    .retry_after_debt_ms
                    .unwrap_or(0);
            }
            black_box(debt)
        })
    });
    let reports: Vec<_> = input
        .iter()
        .map(|line| diagnose_owned(parse_snapshot(line.as_bytes()).unwrap(), now, &opts))
        .collect();
    group.bench_function("totals_only_10k_reports", |b| {
        b.iter(|| {
            let mut totals = Totals::default();
            for report in &reports {
                totals.add(black_box(report));
            }
            black_box(totals.retry_after_debt_ms)
        })
    });
    group.finish();
}

criterion_group!(benches, bench_diagnose);
criterion_main!(benches);
