//! One full retry decision, measured against `governor`'s single `check()` as a reference.
//!
//! A "decision" is what backstop does for one 429 response: classify it (which normalizes its
//! Retry-After into a boundary and reads the quota headers), record the boundary on the scope,
//! ask the dispatch check (`admit`) whether the retry may go now, and plan the retry with full
//! jitter. governor's `check()` is one GCRA test-and-update on an in-memory limiter: the cheapest
//! decision a rate limiter can make, so the ratio says what backstop's richer decision costs.

use std::hint::black_box;
use std::num::NonZeroU32;
use std::time::Duration;

use backstop_core::backoff::{plan_retry, BackoffConfig, RetryInput};
use backstop_core::budget::{ActionBudget, ClassBudget};
use backstop_core::classify::{classify, ClassifyRules, Observed, ResponseView, Signal};
use backstop_core::pacing::{admit, AdmitRequest, Pacer, PacerConfig, ScopeRecord, ScopeState};
use criterion::{criterion_group, criterion_main, Criterion};
use jiff::Timestamp;

fn response_headers() -> http::HeaderMap {
    let mut headers = http::HeaderMap::new();
    headers.insert(
        http::header::RETRY_AFTER,
        http::HeaderValue::from_static("10"),
    );
    headers.insert(
        http::header::DATE,
        http::HeaderValue::from_static("Sun, 01 Mar 2026 12:00:00 GMT"),
    );
    headers.insert("x-ratelimit-remaining", http::HeaderValue::from_static("0"));
    headers
}

fn full_decision(c: &mut Criterion) {
    let now: Timestamp = "2026-03-01T12:00:00Z".parse().expect("timestamp");
    let headers = response_headers();
    let rules = ClassifyRules {
        retry_statuses: vec![408, 429, 500, 502, 503, 504],
        ..ClassifyRules::default()
    };
    let pacing = PacerConfig::try_new(100, Duration::from_secs(60), 0.8, 0.2).expect("valid");
    let class = ClassBudget {
        max_attempts: 4,
        max_wait: Duration::from_secs(90),
    };

    c.bench_function("decision/full", |b| {
        b.iter(|| {
            let observed = Observed::Response(ResponseView {
                status: black_box(429),
                headers: black_box(&headers),
                body: None,
            });
            let signal: Signal = classify(&observed, &rules, now);
            // classify() normalizes Retry-After (RFC 9110 §10.2.3) into the boundary.
            let boundary = &signal.boundary;
            let mut scope = ScopeState {
                record: ScopeRecord::new("billing-api/account", 2, 25),
                pacer: Some(Pacer::new(pacing)),
            };
            if let Some(at) = boundary.retry_not_before() {
                scope.record.observe_429(at, "HTTP 429 Retry-After");
            }
            let mut budget = ActionBudget::new(class, None);
            budget.withdraw_attempt(now).expect("first attempt");
            let admission = admit(AdmitRequest::default(), &mut budget, &mut [&mut scope], now);
            let plan = plan_retry(
                &RetryInput {
                    retry_number: 1,
                    backoff: BackoffConfig::default(),
                    boundary: boundary.retry_not_before(),
                    wait_budget_remaining: budget.wait_remaining(),
                    deadline: None,
                },
                now,
                black_box(0.37),
            );
            black_box((signal, admission, plan))
        })
    });

    // The parts, to see where the time goes.
    c.bench_function("decision/part_classify", |b| {
        b.iter(|| {
            let observed = Observed::Response(ResponseView {
                status: black_box(429),
                headers: black_box(&headers),
                body: None,
            });
            black_box(classify(&observed, &rules, now))
        })
    });
    let boundary = now
        .checked_add(jiff::SignedDuration::from_secs(10))
        .expect("in range");
    c.bench_function("decision/part_admit_and_backoff", |b| {
        b.iter(|| {
            let mut scope = ScopeState {
                record: ScopeRecord::new("billing-api/account", 2, 25),
                pacer: Some(Pacer::new(pacing)),
            };
            scope
                .record
                .observe_429(black_box(boundary), "HTTP 429 Retry-After");
            let mut budget = ActionBudget::new(class, None);
            let admission = admit(AdmitRequest::default(), &mut budget, &mut [&mut scope], now);
            let plan = plan_retry(
                &RetryInput {
                    retry_number: 1,
                    backoff: BackoffConfig::default(),
                    boundary: Some(boundary),
                    wait_budget_remaining: budget.wait_remaining(),
                    deadline: None,
                },
                now,
                black_box(0.37),
            );
            black_box((admission, plan))
        })
    });

    let limiter = governor::RateLimiter::direct(governor::Quota::per_second(
        NonZeroU32::new(u32::MAX).expect("non-zero"),
    ));
    c.bench_function("decision/governor_check", |b| {
        b.iter(|| black_box(limiter.check()))
    });
}

criterion_group!(benches, full_decision);
criterion_main!(benches);
