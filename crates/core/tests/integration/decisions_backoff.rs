//! Property tests for full-jitter backoff and budgets (SPEC §4.2, §5).

use std::time::Duration;

use backstop_core::backoff::{plan_retry, BackoffConfig, DelayCause, RetryDecision, RetryInput};
use backstop_core::budget::{
    ActionBudget, BudgetRefusal, ClassBudget, Deposit, RetryCause, RetryQuota, RetryQuotaConfig,
};
use backstop_core::outcome::Outcome;
use jiff::{SignedDuration, Timestamp};
use proptest::prelude::*;

fn now() -> Timestamp {
    "2026-03-01T12:00:00Z".parse().expect("timestamp")
}

fn at(offset_ms: i64) -> Timestamp {
    now()
        .checked_add(SignedDuration::from_millis(offset_ms))
        .expect("in range")
}

proptest! {
    #[test]
    fn delay_stays_between_boundary_and_cap_and_within_budget(
        retry_number in 0u32..=u32::MAX,
        base_ms in 1u64..5_000,
        max_ms in 1u64..120_000,
        spread_ms in 0u64..10_000,
        boundary_ms in proptest::option::of(-30_000i64..200_000),
        budget_ms in 0u64..300_000,
        deadline_ms in proptest::option::of(-1_000i64..300_000),
        u in 0.0f64..1.0,
    ) {
        let backoff = BackoffConfig {
            base: Duration::from_millis(base_ms),
            max: Duration::from_millis(max_ms),
            boundary_spread: Duration::from_millis(spread_ms),
        };
        let input = RetryInput {
            retry_number,
            backoff,
            boundary: boundary_ms.map(at),
            wait_budget_remaining: Duration::from_millis(budget_ms),
            deadline: deadline_ms.map(at),
        };
        let cap = backoff.cap(retry_number);
        prop_assert!(cap <= backoff.max);
        let until_boundary = Duration::from_millis(boundary_ms.unwrap_or(0).max(0) as u64);
        match plan_retry(&input, now(), u) {
            RetryDecision::RetryAt { at: when, delay, cause } => {
                prop_assert!(delay >= until_boundary, "retry before the boundary");
                prop_assert!(delay >= cap.mul_f64(u), "retry before the drawn backoff");
                let spread = if boundary_ms.is_some() { cap.min(backoff.boundary_spread) } else { Duration::ZERO };
                prop_assert!(delay <= until_boundary.max(cap) + spread, "delay {delay:?} above cap");
                prop_assert!(delay <= input.wait_budget_remaining, "delay beyond the wait budget");
                if let Some(deadline) = input.deadline {
                    prop_assert!(when <= deadline, "retry after the deadline");
                }
                if boundary_ms.is_none() {
                    prop_assert_eq!(cause, DelayCause::Jitter);
                }
            }
            RetryDecision::Stop { outcome, not_before, .. } => {
                prop_assert!(matches!(outcome, Outcome::BudgetExhausted | Outcome::DeadlineExhausted));
                // A stop is only allowed when the boundary (or the deadline) really leaves no room.
                let deadline_passed = deadline_ms.is_some_and(|d| d <= 0);
                let boundary_too_far = boundary_ms.is_some_and(|b| {
                    b > 0 && (b as u64 > budget_ms || deadline_ms.is_some_and(|d| b > d))
                });
                // The local backoff is never shortened to fit: a draw beyond the room left stops.
                let jitter = cap.mul_f64(u);
                let room = match deadline_ms {
                    Some(d) => Duration::from_millis(d.max(0) as u64).min(input.wait_budget_remaining),
                    None => input.wait_budget_remaining,
                };
                let backoff_too_long = jitter > room;
                prop_assert!(deadline_passed || boundary_too_far || backoff_too_long);
                if boundary_too_far && !deadline_passed {
                    prop_assert_eq!(not_before, boundary_ms.map(at));
                } else if backoff_too_long && !deadline_passed {
                    prop_assert_eq!(not_before, Some(now() + jitter));
                }
            }
        }
    }

    #[test]
    fn huge_retry_numbers_give_the_cap(retry_number in 64u32..=u32::MAX) {
        let backoff = BackoffConfig::default();
        prop_assert_eq!(backoff.cap(retry_number), Duration::from_secs(60));
        let input = RetryInput {
            retry_number,
            backoff,
            boundary: None,
            wait_budget_remaining: Duration::from_secs(3_600),
            deadline: None,
        };
        // u just below 1: the delay approaches the cap and never passes it.
        let RetryDecision::RetryAt { delay, .. } = plan_retry(&input, now(), 0.999_999) else {
            panic!("expected a retry");
        };
        prop_assert!(delay <= Duration::from_secs(60) && delay > Duration::from_secs(59));
    }

    #[test]
    fn retry_quota_never_exceeds_capacity_nor_goes_negative(
        ops in proptest::collection::vec(0u8..4, 0..400)
    ) {
        let config = RetryQuotaConfig::default();
        let mut quota = RetryQuota::new(config);
        let mut tokens = Vec::new();
        for op in ops {
            match op {
                0 => { if let Ok(t) = quota.withdraw(RetryCause::ErrorResponse) { tokens.push(t) } }
                1 => { if let Ok(t) = quota.withdraw(RetryCause::Timeout) { tokens.push(t) } }
                2 => quota.deposit(Deposit::FirstTrySucceeded),
                _ => { if let Some(t) = tokens.pop() { quota.deposit(Deposit::RetrySucceeded(t)) } }
            }
            prop_assert!(quota.available() <= config.capacity);
        }
    }
}

#[test]
fn thirty_retries_on_one_scope_are_bounded_by_the_retry_quota() {
    // A small bucket: ten tasks × three retries cannot all go out.
    let mut quota = RetryQuota::new(RetryQuotaConfig {
        capacity: 50,
        retry_cost: 5,
        timeout_cost: 10,
        success_refund: 1,
    });
    let granted = (0..30)
        .filter(|_| quota.withdraw(RetryCause::ErrorResponse).is_ok())
        .count();
    assert_eq!(granted, 10);
    let refused = quota
        .withdraw(RetryCause::ErrorResponse)
        .expect_err("bucket is empty");
    assert_eq!(refused.outcome(), Outcome::QuotaExhausted);
    assert_eq!(refused.available, 0);
    quota.deposit(Deposit::FirstTrySucceeded);
    assert_eq!(quota.available(), 1);
}

#[test]
fn timeout_retries_cost_more_and_successful_retries_refund_their_cost() {
    let mut quota = RetryQuota::new(RetryQuotaConfig::default());
    let timeout = quota.withdraw(RetryCause::Timeout).expect("tokens");
    let error = quota.withdraw(RetryCause::ErrorResponse).expect("tokens");
    assert_eq!(quota.available(), 485);
    quota.deposit(Deposit::RetrySucceeded(timeout));
    quota.deposit(Deposit::RetrySucceeded(error));
    quota.deposit(Deposit::FirstTrySucceeded);
    assert_eq!(quota.available(), 500, "deposits never exceed capacity");
}

#[test]
fn class_budget_counts_attempts_and_waited_time() {
    let class = ClassBudget {
        max_attempts: 3,
        max_wait: Duration::from_secs(120),
    };
    let deadline = at(60_000);
    let mut budget = ActionBudget::new(class, Some(deadline));
    for _ in 0..3 {
        budget.withdraw_attempt(now()).expect("attempt allowed");
    }
    assert_eq!(
        budget.withdraw_attempt(now()),
        Err(BudgetRefusal::AttemptsUsed { max_attempts: 3 })
    );
    assert_eq!(budget.attempts_used(), 3);

    let mut budget = ActionBudget::new(class, Some(deadline));
    budget
        .withdraw_wait(Duration::from_secs(100))
        .expect("within budget");
    assert_eq!(budget.wait_remaining(), Duration::from_secs(20));
    let refusal = budget
        .withdraw_wait(Duration::from_secs(30))
        .expect_err("over budget");
    assert_eq!(refusal.outcome(), Outcome::BudgetExhausted);
    assert_eq!(budget.wait_remaining(), Duration::ZERO);

    let late = at(60_000);
    let refusal = budget.check(late).expect_err("deadline passed");
    assert_eq!(refusal.outcome(), Outcome::DeadlineExhausted);
}

#[test]
fn uncertain_write_class_allows_exactly_one_attempt() {
    let mut budget = ActionBudget::new(
        ClassBudget {
            max_attempts: 1,
            max_wait: Duration::ZERO,
        },
        None,
    );
    budget.withdraw_attempt(now()).expect("first attempt");
    assert!(budget.check(now()).is_err());
}
