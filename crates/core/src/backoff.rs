//! Full-jitter backoff with boundary precedence (SPEC §4.2).
//!
//! Why full jitter: when many actions fail together, exponential backoff without jitter sends
//! their retries together again. Drawing the delay uniformly from `[0, cap]` spreads them (the
//! "full jitter" of the AWS Architecture Blog, *Exponential Backoff And Jitter*, 2015).
//!
//! Why the boundary wins: a provider's Retry-After (RFC 9110 §10.2.3) or quota reset says when a
//! retry may happen at the earliest. A locally computed shorter delay would be an early retry, so
//! `delay = max(jitter, boundary − now)`. A longer local delay is kept.
//!
//! Why jitter *after* the boundary too: every action throttled by one 429 learns the same
//! boundary; sending them all at that instant is a burst. So when a boundary applies, the delay is
//! `boundary − now + u · spread` with `spread = min(cap, boundary_spread)`: the retries released
//! by one boundary arrive spread over `[boundary, boundary + spread]`, never before it.
//!
//! Why stop instead of clamp: if the boundary lies beyond the remaining wait budget or the task
//! deadline, waiting less would be an early retry and waiting the full time would sleep into
//! failure. The decision is [`RetryDecision::Stop`] *now*, with `budget_exhausted` or
//! `deadline_exhausted` and the boundary as `next_safe: wait until T`.
//!
//! The same holds for the local backoff: a short budget (`Prefer: wait=0`, a near deadline) is
//! never a reason to retry sooner than the jittered delay says — that would turn a 429 with an
//! unusable Retry-After, or a dropped connection, into a burst of attempts within milliseconds.
//! If the drawn delay does not fit, the decision is [`RetryDecision::Stop`] now
//! ([`StopReason::BackoffBeyondBudget`] / [`StopReason::BackoffBeyondDeadline`], with the instant
//! the backoff would have allowed as `not_before`). The one trim that stays is safe: the
//! post-boundary spread may be shortened to fit, never below the boundary itself.
//!
//! No randomness and no clock inside: the caller passes `now` and a uniform sample `u ∈ [0, 1)`.
//!
//! ```
//! use std::time::Duration;
//! use backstop_core::backoff::{plan_retry, BackoffConfig, RetryDecision, RetryInput};
//!
//! let now: jiff::Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
//! let input = RetryInput {
//!     retry_number: 1,
//!     backoff: BackoffConfig::default(),
//!     boundary: Some("2026-01-01T00:00:10Z".parse().unwrap()),
//!     wait_budget_remaining: Duration::from_secs(90),
//!     deadline: None,
//! };
//! // u = 0: no jitter, the retry goes exactly at the boundary.
//! let RetryDecision::RetryAt { delay, .. } = plan_retry(&input, now, 0.0) else { panic!() };
//! assert_eq!(delay, Duration::from_secs(10));
//! ```

use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use serde::{Deserialize, Serialize};

use crate::outcome::{NextSafe, Outcome};

/// Backoff parameters (policy `backoff`, SPEC §3/§4.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackoffConfig {
    /// `base_seconds`: the cap for retry 0 (doubling per retry number). Default 1 s.
    pub base: Duration,
    /// `max_seconds`: the largest cap. Default 60 s.
    pub max: Duration,
    /// Upper bound of the jitter added after a provider boundary. Default 5 s; the spread
    /// actually used is `min(cap, boundary_spread)`.
    pub boundary_spread: Duration,
}

impl Default for BackoffConfig {
    fn default() -> Self {
        BackoffConfig {
            base: Duration::from_secs(1),
            max: Duration::from_secs(60),
            boundary_spread: Duration::from_secs(5),
        }
    }
}

impl BackoffConfig {
    /// The jitter cap for retry number `n`: `min(max, base · 2^n)`. The exponent is clamped
    /// before the power is computed, so any `n` (1,025, 4 billion) gives at most `max`, never an
    /// overflow or a panic.
    pub fn cap(&self, retry_number: u32) -> Duration {
        // 2^63 ns is ~292 years: any larger exponent is already past every sensible max.
        let exponent = retry_number.min(63);
        let factor = 1u128 << exponent;
        let base_ns = self.base.as_nanos();
        let capped_ns = base_ns.saturating_mul(factor).min(self.max.as_nanos());
        duration_from_nanos(capped_ns)
    }
}

/// Everything [`plan_retry`] needs about one action about to be retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryInput {
    /// The retry number `n`: the first retry (second attempt) is 1.
    pub retry_number: u32,
    /// Backoff parameters.
    pub backoff: BackoffConfig,
    /// The provider's boundary (`retry_not_before`), if it gave a usable one.
    pub boundary: Option<Timestamp>,
    /// Wait budget the action's class still allows (class `max_wait_seconds` minus time waited).
    pub wait_budget_remaining: Duration,
    /// The task deadline, if any.
    pub deadline: Option<Timestamp>,
}

/// What made the chosen delay as long as it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DelayCause {
    /// The full-jitter draw (no boundary, or the boundary was shorter).
    Jitter,
    /// The provider's boundary plus the post-boundary spread.
    Boundary,
}

/// Why a retry is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The provider's boundary lies beyond the remaining wait budget.
    BoundaryBeyondBudget,
    /// The provider's boundary lies beyond the task deadline.
    BoundaryBeyondDeadline,
    /// The deadline has already passed.
    DeadlinePassed,
    /// The local backoff delay (full jitter, no provider boundary behind it) is longer than the
    /// remaining wait budget.
    BackoffBeyondBudget,
    /// The local backoff delay is longer than the time left until the task deadline.
    BackoffBeyondDeadline,
}

impl StopReason {
    /// `true` when the stop is caused by a provider boundary (Retry-After, quota reset) lying
    /// beyond the remaining wait or deadline: the case SPEC §13 step 5 / §8 escalate
    /// (`remaining_wait_exceeds_deadline`).
    pub fn is_provider_boundary(self) -> bool {
        matches!(
            self,
            StopReason::BoundaryBeyondBudget | StopReason::BoundaryBeyondDeadline
        )
    }

    /// One human sentence fragment for problem details and logs (no type names).
    ///
    /// ```
    /// use backstop_core::backoff::StopReason;
    /// assert_eq!(
    ///     StopReason::BoundaryBeyondBudget.describe(),
    ///     "the provider's retry boundary lies beyond the remaining wait budget"
    /// );
    /// ```
    pub fn describe(self) -> &'static str {
        match self {
            StopReason::BoundaryBeyondBudget => {
                "the provider's retry boundary lies beyond the remaining wait budget"
            }
            StopReason::BoundaryBeyondDeadline => {
                "the provider's retry boundary lies beyond the task deadline"
            }
            StopReason::DeadlinePassed => "the task deadline has passed",
            StopReason::BackoffBeyondBudget => {
                "the backoff delay is longer than the remaining wait budget"
            }
            StopReason::BackoffBeyondDeadline => {
                "the backoff delay is longer than the time left until the task deadline"
            }
        }
    }
}

/// The decision of [`plan_retry`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum RetryDecision {
    /// Retry at `at` (= `now + delay`).
    RetryAt {
        /// The instant the retry may be sent.
        at: Timestamp,
        /// The delay from `now`.
        delay: Duration,
        /// What determined the delay.
        cause: DelayCause,
    },
    /// Do not retry: the action ends now with `outcome`.
    Stop {
        /// `budget_exhausted` or `deadline_exhausted`.
        outcome: Outcome,
        /// Why.
        reason: StopReason,
        /// The earliest instant a retry would have been allowed, if known: the provider's
        /// boundary, or for a backoff stop the instant the drawn delay would have ended.
        not_before: Option<Timestamp>,
    },
}

impl RetryDecision {
    /// The `next_safe` options for a [`RetryDecision::Stop`]: wait until the boundary when it is
    /// known, otherwise abort. Empty for [`RetryDecision::RetryAt`].
    pub fn next_safe(&self) -> Vec<NextSafe> {
        match self {
            RetryDecision::RetryAt { .. } => Vec::new(),
            RetryDecision::Stop { not_before, .. } => match not_before {
                Some(at) => vec![NextSafe::WaitUntil { at: *at }, NextSafe::Abort],
                None => vec![NextSafe::Abort],
            },
        }
    }
}

/// Plans the retry of one action (SPEC §4.2).
///
/// `u` is a uniform sample in `[0, 1)` supplied by the caller (values outside, or NaN, are
/// clamped into range; they never panic). Rules, in order:
/// 1. deadline already passed → `Stop(deadline_exhausted)`;
/// 2. boundary beyond the deadline → `Stop(deadline_exhausted, not_before: boundary)`;
///    boundary beyond the remaining wait budget → `Stop(budget_exhausted, not_before: boundary)`;
/// 3. `jitter = u · cap(n)`; with a boundary `b`, `delay = max(jitter, (b − now) + u · spread)`;
/// 4. when the jitter draw exceeds `limit = min(wait_budget_remaining, deadline − now)` →
///    `Stop(budget_exhausted | deadline_exhausted, not_before: now + jitter)`: never an earlier
///    retry because the budget is short;
/// 5. when the boundary decides it, only the post-boundary spread is trimmed to fit the budget
///    and deadline, never below `b − now`.
pub fn plan_retry(input: &RetryInput, now: Timestamp, u: f64) -> RetryDecision {
    let u = if u.is_nan() { 0.0 } else { u.clamp(0.0, 1.0) };
    let until_deadline = match input.deadline {
        Some(deadline) => {
            let left = positive(deadline.duration_since(now));
            if deadline <= now {
                return RetryDecision::Stop {
                    outcome: Outcome::DeadlineExhausted,
                    reason: StopReason::DeadlinePassed,
                    not_before: input.boundary.filter(|b| *b > now),
                };
            }
            Some(left)
        }
        None => None,
    };
    let limit = match until_deadline {
        Some(left) => left.min(input.wait_budget_remaining),
        None => input.wait_budget_remaining,
    };

    let until_boundary = input
        .boundary
        .map(|b| positive(b.duration_since(now)))
        .unwrap_or(Duration::ZERO);
    if let Some(boundary) = input.boundary {
        if let (Some(deadline), Some(left)) = (input.deadline, until_deadline) {
            if until_boundary > left || boundary > deadline {
                return RetryDecision::Stop {
                    outcome: Outcome::DeadlineExhausted,
                    reason: StopReason::BoundaryBeyondDeadline,
                    not_before: Some(boundary),
                };
            }
        }
        if until_boundary > input.wait_budget_remaining {
            return RetryDecision::Stop {
                outcome: Outcome::BudgetExhausted,
                reason: StopReason::BoundaryBeyondBudget,
                not_before: Some(boundary),
            };
        }
    }

    let cap = input.backoff.cap(input.retry_number);
    let jitter = cap.mul_f64(u);
    let (mut delay, cause) = if input.boundary.is_some() {
        let spread = cap.min(input.backoff.boundary_spread);
        let after_boundary = until_boundary.saturating_add(spread.mul_f64(u));
        if after_boundary >= jitter {
            (after_boundary, DelayCause::Boundary)
        } else {
            (jitter, DelayCause::Jitter)
        }
    } else {
        (jitter, DelayCause::Jitter)
    };
    if delay > limit {
        if jitter > limit {
            // The backoff is not shortened to fit: stop now (SPEC §4.2).
            let by_deadline = until_deadline
                .is_some_and(|left| left < jitter && left <= input.wait_budget_remaining);
            let (outcome, reason) = if by_deadline {
                (
                    Outcome::DeadlineExhausted,
                    StopReason::BackoffBeyondDeadline,
                )
            } else {
                (Outcome::BudgetExhausted, StopReason::BackoffBeyondBudget)
            };
            return RetryDecision::Stop {
                outcome,
                reason,
                not_before: Some(add(now, jitter)),
            };
        }
        // Only the spread after the boundary is trimmed, never below the boundary (which fits,
        // checked above) nor below the jitter draw (which fits too).
        delay = limit.max(until_boundary);
    }
    RetryDecision::RetryAt {
        at: add(now, delay),
        delay,
        cause,
    }
}

/// `ts + d`, saturating at [`Timestamp::MAX`].
pub(crate) fn add(ts: Timestamp, d: Duration) -> Timestamp {
    SignedDuration::try_from(d)
        .ok()
        .and_then(|d| ts.checked_add(d).ok())
        .unwrap_or(Timestamp::MAX)
}

/// A signed duration as a non-negative [`Duration`] (negative → zero).
pub(crate) fn positive(d: SignedDuration) -> Duration {
    Duration::try_from(d).unwrap_or(Duration::ZERO)
}

fn duration_from_nanos(ns: u128) -> Duration {
    let secs = ns / 1_000_000_000;
    let nanos = (ns % 1_000_000_000) as u32; // < 1e9, always fits
    match u64::try_from(secs) {
        Ok(secs) => Duration::new(secs, nanos),
        Err(_) => Duration::MAX,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(s: &str) -> Timestamp {
        s.parse().expect("timestamp")
    }

    #[test]
    fn cap_doubles_then_saturates() {
        let config = BackoffConfig::default();
        assert_eq!(config.cap(0), Duration::from_secs(1));
        assert_eq!(config.cap(1), Duration::from_secs(2));
        assert_eq!(config.cap(5), Duration::from_secs(32));
        assert_eq!(config.cap(6), Duration::from_secs(60));
        assert_eq!(config.cap(1_025), Duration::from_secs(60));
        assert_eq!(config.cap(4_000_000_000), Duration::from_secs(60));
        assert_eq!(config.cap(u32::MAX), Duration::from_secs(60));
    }

    #[test]
    fn boundary_beyond_budget_stops_without_clamping() {
        let now = ts("2026-01-01T00:00:00Z");
        let input = RetryInput {
            retry_number: 1,
            backoff: BackoffConfig::default(),
            boundary: Some(ts("2026-01-01T00:02:00Z")),
            wait_budget_remaining: Duration::from_secs(90),
            deadline: None,
        };
        let decision = plan_retry(&input, now, 0.5);
        assert_eq!(
            decision,
            RetryDecision::Stop {
                outcome: Outcome::BudgetExhausted,
                reason: StopReason::BoundaryBeyondBudget,
                not_before: Some(ts("2026-01-01T00:02:00Z")),
            }
        );
        assert_eq!(
            decision.next_safe(),
            vec![
                NextSafe::WaitUntil {
                    at: ts("2026-01-01T00:02:00Z")
                },
                NextSafe::Abort
            ]
        );
    }

    #[test]
    fn boundary_beyond_deadline_is_deadline_exhausted() {
        let now = ts("2026-01-01T00:00:00Z");
        let input = RetryInput {
            retry_number: 1,
            backoff: BackoffConfig::default(),
            boundary: Some(ts("2026-01-01T00:00:30Z")),
            wait_budget_remaining: Duration::from_secs(90),
            deadline: Some(ts("2026-01-01T00:00:20Z")),
        };
        assert!(matches!(
            plan_retry(&input, now, 0.1),
            RetryDecision::Stop {
                outcome: Outcome::DeadlineExhausted,
                reason: StopReason::BoundaryBeyondDeadline,
                ..
            }
        ));
    }

    #[test]
    fn retries_released_by_one_boundary_are_spread() {
        let now = ts("2026-01-01T00:00:00Z");
        let input = RetryInput {
            retry_number: 1,
            backoff: BackoffConfig::default(),
            boundary: Some(ts("2026-01-01T00:00:10Z")),
            wait_budget_remaining: Duration::from_secs(90),
            deadline: None,
        };
        let delays: Vec<Duration> = [0.0, 0.5, 0.99]
            .iter()
            .map(|u| match plan_retry(&input, now, *u) {
                RetryDecision::RetryAt { delay, cause, .. } => {
                    assert_eq!(cause, DelayCause::Boundary);
                    delay
                }
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(delays[0], Duration::from_secs(10));
        assert_eq!(delays[1], Duration::from_secs(11));
        assert!(delays[2] > delays[1] && delays[2] < Duration::from_secs(12));
    }

    #[test]
    fn short_wait_stops_instead_of_retrying_before_the_backoff() {
        // `Prefer: wait=0` against a 429 with an unusable Retry-After: the drawn delay (1 s)
        // does not fit, so the plan stops now instead of retrying at once.
        let now = ts("2026-01-01T00:00:00Z");
        let input = RetryInput {
            retry_number: 1,
            backoff: BackoffConfig::default(),
            boundary: None,
            wait_budget_remaining: Duration::ZERO,
            deadline: None,
        };
        let decision = plan_retry(&input, now, 0.5);
        assert_eq!(
            decision,
            RetryDecision::Stop {
                outcome: Outcome::BudgetExhausted,
                reason: StopReason::BackoffBeyondBudget,
                not_before: Some(ts("2026-01-01T00:00:01Z")),
            }
        );
        assert_eq!(
            decision.next_safe()[0],
            NextSafe::WaitUntil {
                at: ts("2026-01-01T00:00:01Z")
            }
        );
    }

    #[test]
    fn near_deadline_stops_instead_of_retrying_before_the_backoff() {
        let now = ts("2026-01-01T00:00:00Z");
        let input = RetryInput {
            retry_number: 2,
            backoff: BackoffConfig::default(),
            boundary: None,
            wait_budget_remaining: Duration::from_secs(90),
            deadline: Some(ts("2026-01-01T00:00:00.500Z")),
        };
        // cap(2) = 4 s, u = 0.5 → 2 s > 0.5 s left.
        assert!(matches!(
            plan_retry(&input, now, 0.5),
            RetryDecision::Stop {
                outcome: Outcome::DeadlineExhausted,
                reason: StopReason::BackoffBeyondDeadline,
                ..
            }
        ));
        // A draw that fits is kept as drawn.
        let RetryDecision::RetryAt { delay, .. } = plan_retry(&input, now, 0.1) else {
            panic!("expected a retry");
        };
        assert_eq!(delay, Duration::from_millis(400));
    }

    #[test]
    fn post_boundary_spread_is_trimmed_to_the_budget_but_not_below_the_boundary() {
        let now = ts("2026-01-01T00:00:00Z");
        let input = RetryInput {
            retry_number: 1,
            backoff: BackoffConfig::default(),
            boundary: Some(ts("2026-01-01T00:00:10Z")),
            wait_budget_remaining: Duration::from_millis(10_300),
            deadline: None,
        };
        // Boundary 10 s + 0.9 · 2 s spread = 11.8 s > 10.3 s: the spread is trimmed.
        let RetryDecision::RetryAt { delay, cause, .. } = plan_retry(&input, now, 0.9) else {
            panic!("expected a retry");
        };
        assert_eq!(cause, DelayCause::Boundary);
        assert_eq!(delay, Duration::from_millis(10_300));
    }

    #[test]
    fn out_of_range_samples_do_not_panic() {
        let now = ts("2026-01-01T00:00:00Z");
        let input = RetryInput {
            retry_number: 3,
            backoff: BackoffConfig::default(),
            boundary: None,
            wait_budget_remaining: Duration::from_secs(90),
            deadline: None,
        };
        for u in [f64::NAN, -1.0, 2.0, f64::INFINITY] {
            let RetryDecision::RetryAt { delay, .. } = plan_retry(&input, now, u) else {
                panic!("expected a retry");
            };
            assert!(delay <= Duration::from_secs(8));
        }
    }
}
