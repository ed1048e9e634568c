//! Pacing, scope records and the dispatch check (SPEC §4.1, §4.3).

use std::time::Duration;

use backstop_core::budget::{ActionBudget, ClassBudget};
use backstop_core::outcome::Outcome;
use backstop_core::pacing::{
    admit, Admission, AdmitRequest, Pacer, PacerConfig, Priority, ScopeFull, ScopeRecord,
    ScopeState, WaitReason,
};
use jiff::{SignedDuration, Timestamp};
use proptest::prelude::*;

fn t0() -> Timestamp {
    "2026-03-01T12:00:00Z".parse().expect("timestamp")
}

fn at_ms(ms: i64) -> Timestamp {
    t0().checked_add(SignedDuration::from_millis(ms))
        .expect("in range")
}

fn read_budget() -> ActionBudget {
    ActionBudget::new(
        ClassBudget {
            max_attempts: 4,
            max_wait: Duration::from_secs(90),
        },
        None,
    )
}

proptest! {
    /// Over any window of the published length, a pacer never lets more than the published
    /// limit through, whatever the arrival pattern.
    #[test]
    fn paced_rate_never_exceeds_the_published_limit(
        limit in 1u64..200,
        window_s in 1u64..120,
        headroom in 0.05f64..=1.0,
        gaps_ms in proptest::collection::vec(0i64..2_000, 1..400),
    ) {
        let config = PacerConfig::try_new(limit, Duration::from_secs(window_s), headroom, 0.0)
            .expect("valid");
        let mut pacer = Pacer::new(config);
        let mut now = 0i64;
        let mut sent = Vec::new();
        for gap in gaps_ms {
            now += gap;
            if pacer.test_and_update(at_ms(now), Priority::Interactive).is_ok() {
                sent.push(now);
            }
        }
        let window_ms = (window_s * 1_000) as i64;
        // Allowed in a window: burst + rate·window ≤ limit, +1 for the emission at the edge.
        let allowed = limit as usize + 1;
        for (i, start) in sent.iter().enumerate() {
            let in_window = sent[i..].iter().take_while(|t| **t < start + window_ms).count();
            prop_assert!(in_window <= allowed, "{in_window} sent in one window, limit {limit}");
        }
    }
}

#[test]
fn refusal_knows_its_earliest_instant() {
    // 60 requests per minute at 50 %: one every 2 s, burst 30.
    let config = PacerConfig::try_new(60, Duration::from_secs(60), 0.5, 0.0).expect("valid");
    assert_eq!(config.emission_interval, Duration::from_secs(2));
    assert_eq!(config.burst, 30);
    let mut pacer = Pacer::new(config);
    for _ in 0..30 {
        pacer
            .test_and_update(t0(), Priority::Normal)
            .expect("within the burst");
    }
    let refused = pacer
        .test_and_update(t0(), Priority::Normal)
        .expect_err("burst used");
    assert_eq!(refused.earliest(), at_ms(2_000));
    assert_eq!(
        refused.wait_time_from(at_ms(500)),
        Duration::from_millis(1_500)
    );
    // Asking at the earliest instant succeeds; the refusal charged nothing.
    pacer
        .test_and_update(refused.earliest(), Priority::Normal)
        .expect("conforms at its earliest instant");
}

#[test]
fn interactive_work_keeps_its_reserve() {
    // Burst 20 with 25 % reserved: normal work stops at 15, interactive gets the other 5.
    let config = PacerConfig::try_new(100, Duration::from_secs(60), 0.8, 0.25).expect("valid");
    assert_eq!(config.burst, 20);
    let mut pacer = Pacer::new(config);
    let mut normal = 0;
    while pacer.test_and_update(t0(), Priority::Normal).is_ok() {
        normal += 1;
    }
    assert_eq!(normal, 15);
    assert!(pacer.test_and_update(t0(), Priority::Background).is_err());
    let mut interactive = 0;
    while pacer.test_and_update(t0(), Priority::Interactive).is_ok() {
        interactive += 1;
    }
    assert_eq!(interactive, 5);
}

#[test]
fn priorities_are_ordered_and_snake_case() {
    assert!(Priority::Interactive > Priority::Normal);
    assert!(Priority::Normal > Priority::Background);
    assert_eq!(
        serde_json::to_string(&Priority::Interactive).expect("json"),
        "\"interactive\""
    );
}

fn scope(name: &str, pacer: Option<Pacer>) -> ScopeState {
    ScopeState {
        record: ScopeRecord::new(name, 2, 25),
        pacer,
    }
}

fn request() -> AdmitRequest {
    AdmitRequest {
        cancelled: false,
        priority: Priority::Normal,
    }
}

#[test]
fn a_429_delays_every_action_of_the_scope() {
    let mut account = scope("billing-api/account", None);
    // Three actions of three tasks in the same scope.
    let mut budgets = [read_budget(), read_budget(), read_budget()];
    assert_eq!(
        admit(request(), &mut budgets[0], &mut [&mut account], t0()),
        Admission::Go
    );
    account.record.release();
    // The first action gets a 429 with Retry-After: 10.
    account
        .record
        .observe_429(at_ms(10_000), "HTTP 429 Retry-After");
    assert_eq!(account.record.remaining, Some(0));
    assert_eq!(account.record.next_allowed_at, Some(at_ms(10_000)));
    for budget in &mut budgets[1..] {
        let admission = admit(request(), budget, &mut [&mut account], at_ms(1));
        assert_eq!(
            admission,
            Admission::WaitUntil {
                at: at_ms(10_000),
                reason: WaitReason::NextAllowedAt {
                    scope: "billing-api/account".into(),
                    source: Some("HTTP 429 Retry-After".into()),
                },
            }
        );
        assert_eq!(budget.attempts_used(), 0, "a wait charges nothing");
    }
    // A shorter signal later never pulls the boundary earlier.
    account
        .record
        .observe_429(at_ms(3_000), "HTTP 429 Retry-After");
    assert_eq!(account.record.next_allowed_at, Some(at_ms(10_000)));
    assert_eq!(
        admit(
            request(),
            &mut budgets[1],
            &mut [&mut account],
            at_ms(10_000)
        ),
        Admission::Go
    );
}

#[test]
fn admit_follows_the_dispatch_order() {
    let mut budget = read_budget();
    let mut s = scope("p/s", None);
    // (1) cancellation first, even when the scope would also make it wait.
    s.record.observe_429(at_ms(5_000), "HTTP 429 Retry-After");
    let cancelled = AdmitRequest {
        cancelled: true,
        ..request()
    };
    assert!(matches!(
        admit(cancelled, &mut budget, &mut [&mut s], t0()),
        Admission::Refuse {
            outcome: Outcome::Cancelled,
            ..
        }
    ));
    // (2) a boundary past the deadline ends the action now rather than sleeping into failure.
    let mut late = ActionBudget::new(
        ClassBudget {
            max_attempts: 4,
            max_wait: Duration::from_secs(90),
        },
        Some(at_ms(2_000)),
    );
    assert!(matches!(
        admit(request(), &mut late, &mut [&mut s], t0()),
        Admission::Refuse {
            outcome: Outcome::DeadlineExhausted,
            ..
        }
    ));
    // (2) a boundary past the wait budget: budget_exhausted.
    let mut short = ActionBudget::new(
        ClassBudget {
            max_attempts: 4,
            max_wait: Duration::from_secs(1),
        },
        None,
    );
    assert!(matches!(
        admit(request(), &mut short, &mut [&mut s], t0()),
        Admission::Refuse {
            outcome: Outcome::BudgetExhausted,
            ..
        }
    ));
}

#[test]
fn admission_is_all_or_nothing_across_scopes() {
    let slow = PacerConfig::try_new(1, Duration::from_secs(10), 1.0, 0.0).expect("valid");
    let mut account = scope("p/account", Some(Pacer::new(slow)));
    let mut endpoint = scope("p/endpoint", None);
    endpoint.record.max_concurrent_requests = 1;
    let mut budget = read_budget();
    assert_eq!(
        admit(
            request(),
            &mut budget,
            &mut [&mut account, &mut endpoint],
            t0()
        ),
        Admission::Go
    );
    assert_eq!(
        (account.record.in_flight, endpoint.record.in_flight),
        (1, 1)
    );
    // Pacing refuses in `account`: nothing is charged anywhere.
    let admission = admit(
        request(),
        &mut budget,
        &mut [&mut account, &mut endpoint],
        at_ms(1_000),
    );
    assert_eq!(
        admission,
        Admission::WaitUntil {
            at: at_ms(10_000),
            reason: WaitReason::Pacing {
                scope: "p/account".into()
            }
        }
    );
    assert_eq!(
        (account.record.in_flight, endpoint.record.in_flight),
        (1, 1)
    );
    assert_eq!(budget.attempts_used(), 1);
    // Pacing allows at 10 s, but `endpoint` has no free slot: wait for a release.
    assert_eq!(
        admit(
            request(),
            &mut budget,
            &mut [&mut account, &mut endpoint],
            at_ms(10_000),
        ),
        Admission::WaitForSlot {
            scope: "p/endpoint".into()
        }
    );
    endpoint.record.release();
    account.record.release();
    assert_eq!(
        admit(
            request(),
            &mut budget,
            &mut [&mut account, &mut endpoint],
            at_ms(10_000),
        ),
        Admission::Go
    );
}

#[test]
fn a_refusal_for_a_wait_beyond_the_budget_names_the_instant_waited_for() {
    // Local pacing: one request per 10 s, the second asked for at 1 s with no wait allowed.
    let slow = PacerConfig::try_new(1, Duration::from_secs(10), 1.0, 0.0).expect("valid");
    let mut paced = scope("p/paced", Some(Pacer::new(slow)));
    let no_wait = || {
        ActionBudget::new(
            ClassBudget {
                max_attempts: 4,
                max_wait: Duration::ZERO,
            },
            None,
        )
    };
    assert_eq!(
        admit(request(), &mut no_wait(), &mut [&mut paced], t0()),
        Admission::Go
    );
    paced.record.release();
    match admit(request(), &mut no_wait(), &mut [&mut paced], at_ms(1_000)) {
        Admission::Refuse {
            outcome: Outcome::BudgetExhausted,
            not_before,
            ..
        } => assert_eq!(not_before, Some(at_ms(10_000)), "the pacer's instant"),
        other => panic!("expected a budget refusal, got {other:?}"),
    }
    // A provider boundary beyond the deadline names the boundary.
    let mut limited = scope("p/limited", None);
    limited
        .record
        .observe_429(at_ms(5_000), "HTTP 429 Retry-After");
    let mut late = ActionBudget::new(
        ClassBudget {
            max_attempts: 4,
            max_wait: Duration::from_secs(90),
        },
        Some(at_ms(2_000)),
    );
    match admit(request(), &mut late, &mut [&mut limited], t0()) {
        Admission::Refuse {
            outcome: Outcome::DeadlineExhausted,
            not_before,
            ..
        } => assert_eq!(not_before, Some(at_ms(5_000))),
        other => panic!("expected a deadline refusal, got {other:?}"),
    }
    // A cancelled action is refused with no instant: none would lift it.
    let cancelled = AdmitRequest {
        cancelled: true,
        ..request()
    };
    assert!(matches!(
        admit(cancelled, &mut no_wait(), &mut [&mut limited], t0()),
        Admission::Refuse {
            not_before: None,
            ..
        }
    ));
}

#[test]
fn a_wait_beyond_the_budget_says_what_holds_the_request_and_whether_anything_was_sent() {
    let budget = |max_wait_ms: u64| {
        ActionBudget::new(
            ClassBudget {
                max_attempts: 4,
                max_wait: Duration::from_millis(max_wait_ms),
            },
            None,
        )
    };
    let detail = |admission: Admission| match admission {
        Admission::Refuse {
            outcome: Outcome::BudgetExhausted,
            detail,
            ..
        } => detail,
        other => panic!("expected a budget refusal, got {other:?}"),
    };
    // Before the first attempt, held by the provider's boundary: nothing was sent, come back then.
    let mut limited = scope("p/limited", None);
    limited
        .record
        .observe_429(at_ms(5_000), "HTTP 429 Retry-After");
    let first = detail(admit(
        request(),
        &mut budget(1_000),
        &mut [&mut limited],
        t0(),
    ));
    assert!(first.starts_with("nothing was sent: "), "{first}");
    assert!(
        first.contains("the provider's boundary for scope `p/limited` (from HTTP 429 Retry-After)"),
        "{first}"
    );
    assert!(first.contains("5000 ms"), "{first}");
    assert!(
        first.contains("longer than the 1000 ms its wait budget allows"),
        "{first}"
    );
    assert!(
        first.contains(&format!("send it again from {}", at_ms(5_000))),
        "{first}"
    );
    // Before a retry (an attempt was made): the next attempt is what waits.
    let mut retrying = budget(1_000);
    retrying.withdraw_attempt(t0()).expect("an attempt is left");
    let retry = detail(admit(request(), &mut retrying, &mut [&mut limited], t0()));
    assert!(
        retry.starts_with("the next attempt must wait 5000 ms"),
        "{retry}"
    );
    assert!(!retry.contains("nothing was sent"), "{retry}");
}

#[test]
fn delayed_queue_saturates_into_scope_saturated() {
    let mut record = ScopeRecord::new("p/s", 2, 2);
    record.try_delay().expect("first");
    record.try_delay().expect("second");
    assert_eq!(
        record.try_delay(),
        Err(ScopeFull::Saturated {
            scope: "p/s".into(),
            max: 2
        })
    );
    record.undelay();
    record.try_delay().expect("room again");
}

#[test]
fn concurrency_slots_are_counted() {
    let mut record = ScopeRecord::new("p/s", 1, 25);
    record.try_acquire().expect("one slot");
    assert!(matches!(
        record.try_acquire(),
        Err(ScopeFull::NoSlot { .. })
    ));
    record.release();
    record.release();
    assert_eq!(record.in_flight, 0, "release never goes below zero");
}

#[test]
fn quota_with_nothing_remaining_waits_for_the_reset() {
    let mut record = ScopeRecord::new("p/s", 2, 25);
    record.observe_quota(Some(7), Some(100), Some(at_ms(30_000)), "RateLimit");
    assert_eq!(record.next_allowed_at, None, "quota left: no wait");
    record.observe_quota(Some(0), None, Some(at_ms(31_000)), "RateLimit");
    assert_eq!(record.next_allowed_at, Some(at_ms(31_000)));
    assert_eq!(record.limit, Some(100));
    assert_eq!(record.source.as_deref(), Some("RateLimit"));
}
