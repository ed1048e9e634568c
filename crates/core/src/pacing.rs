//! Pacing, scope records and the dispatch check (SPEC §4.1).
//!
//! Why pace at all: the cheapest 429 is the one never provoked. Each scope with a published limit
//! (`limit` requests per `window_seconds`) is paced at `headroom × limit / window` by a GCRA
//! ([`Pacer`]), the algorithm of `governor`'s `gcra.rs`: one "theoretical arrival time" per scope,
//! `test_and_update(now, …)` is handed the time, and a refusal comes back as a [`NotUntil`] value
//! that knows its earliest instant: one source for a `Retry-After` header and for a queue's wake.
//!
//! Burst: the GCRA allows `burst = max(1, ⌊(1 − headroom) × limit⌋)` requests at once, so that a
//! full burst plus the sustained rate over one window stays within the published limit
//! (`burst + headroom × limit ≤ limit`). Interactive reserve: `normal` and `background` work may
//! only fill `(1 − reserve_interactive)` of that burst tolerance; the rest is kept for
//! `interactive` work. When the burst is a single request there is nothing to reserve.
//!
//! Why a [`ScopeRecord`] beside the pacer: the provider's own signals (a 429 with Retry-After, a
//! quota header with `remaining: 0`) override local pacing for the *whole* scope. The record is
//! updated before the retry is scheduled so no other worker assumes the next slot is theirs.
//!
//! [`admit`] is the one dispatch check, in SPEC §4.1 order: (1) cancellation, deadline, budget;
//! (2) every scope's `next_allowed_at`; (3) pacing; (4) a concurrency slot in every scope. It is
//! all-or-nothing: nothing is charged unless the answer is [`Admission::Go`].
//!
//! ```
//! use std::time::Duration;
//! use backstop_core::pacing::{Pacer, PacerConfig, Priority};
//!
//! // 10 requests per second published, 50 % headroom: one request every 200 ms.
//! let config = PacerConfig::try_new(10, Duration::from_secs(1), 0.5, 0.0).unwrap();
//! let mut pacer = Pacer::new(config);
//! let t0: jiff::Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
//! for _ in 0..5 {
//!     pacer.test_and_update(t0, Priority::Normal).unwrap(); // the burst of 5
//! }
//! let refused = pacer.test_and_update(t0, Priority::Normal).unwrap_err();
//! assert_eq!(refused.wait_time_from(t0), Duration::from_millis(200));
//! ```

use std::time::Duration;

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

use crate::backoff::{add, positive};
use crate::budget::ActionBudget;
use crate::outcome::Outcome;

/// Priority of a task's work (SPEC §4.3): `interactive > normal > background`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    /// Long listings, pagination, batch work.
    Background,
    /// The default.
    #[default]
    Normal,
    /// A human is waiting: may use the reserved share of the pacing capacity.
    Interactive,
}

/// Invalid pacing parameters (each message names the field).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvalidPacer {
    /// `limit` must be at least 1.
    #[error("limit must be at least 1 request per window")]
    ZeroLimit,
    /// `window_seconds` must be at least [`MIN_WINDOW`].
    #[error("window_seconds must be at least 1 second, got {} s", .0.as_secs_f64())]
    ShortWindow(Duration),
    /// `headroom` must be in `(0, 1]`.
    #[error("headroom must be in (0, 1], got {0}")]
    Headroom(f64),
    /// `window / (headroom × limit)` is not a representable duration.
    #[error("window_seconds / (headroom × limit) is not a representable interval")]
    IntervalOutOfRange,
    /// `reserve_interactive` must be in `[0, 1)`.
    #[error("reserve_interactive must be in [0, 1), got {0}")]
    Reserve(f64),
}

/// The shortest window of a published limit (1 s). Providers publish their windows in whole
/// seconds (the IETF `RateLimit-Policy` `w` parameter, `RateLimit-Reset`, `Retry-After`), and a
/// limit spread over a shorter one (`0.0001`: 10 requests per 100 µs is 100,000 a second) paces
/// at a rate so high that pacing holds nothing back while the policy says it paces.
pub const MIN_WINDOW: Duration = Duration::from_secs(1);

/// Validated pacing parameters of one scope.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PacerConfig {
    /// Time between two requests at the paced rate (`window / (headroom × limit)`).
    pub emission_interval: Duration,
    /// Requests allowed at once.
    pub burst: u32,
    /// Share of the burst tolerance kept for interactive work, in `[0, 1)`.
    pub reserve_interactive: f64,
}

impl PacerConfig {
    /// Builds the pacing of a scope with a published limit of `limit` requests per `window`,
    /// paced at `headroom` (0 < h ≤ 1) of it, keeping `reserve_interactive` (0 ≤ r < 1) of the
    /// burst for interactive work. `window` is at least [`MIN_WINDOW`].
    ///
    /// # Errors
    /// [`InvalidPacer`] naming the out-of-range parameter.
    pub fn try_new(
        limit: u64,
        window: Duration,
        headroom: f64,
        reserve_interactive: f64,
    ) -> Result<Self, InvalidPacer> {
        if limit == 0 {
            return Err(InvalidPacer::ZeroLimit);
        }
        if window < MIN_WINDOW {
            return Err(InvalidPacer::ShortWindow(window));
        }
        if !(headroom > 0.0 && headroom <= 1.0) {
            return Err(InvalidPacer::Headroom(headroom));
        }
        if !(0.0..1.0).contains(&reserve_interactive) {
            return Err(InvalidPacer::Reserve(reserve_interactive));
        }
        let paced = (limit as f64) * headroom;
        let emission_interval = Duration::try_from_secs_f64(window.as_secs_f64() / paced)
            .map_err(|_| InvalidPacer::IntervalOutOfRange)?;
        // The epsilon absorbs binary rounding: (1 − 0.8) × 100 is 19.999…, meant as 20.
        let burst =
            (((1.0 - headroom) * limit as f64 + 1e-9).floor() as u64).clamp(1, u32::MAX as u64);
        Ok(PacerConfig {
            emission_interval,
            burst: burst as u32,
            reserve_interactive,
        })
    }

    /// How far ahead of `now` the theoretical arrival time may run for this priority.
    fn tolerance(&self, priority: Priority) -> Duration {
        let full = self.emission_interval.saturating_mul(self.burst);
        match priority {
            Priority::Interactive => full,
            Priority::Normal | Priority::Background => full
                .mul_f64(1.0 - self.reserve_interactive)
                .max(self.emission_interval),
        }
    }
}

/// A pacing refusal: not before [`NotUntil::earliest`] (governor's `NotUntil`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NotUntil {
    earliest: Timestamp,
}

impl NotUntil {
    /// The earliest instant the same request would conform.
    pub const fn earliest(&self) -> Timestamp {
        self.earliest
    }

    /// The wait from `now` until [`NotUntil::earliest`] (zero if already past).
    pub fn wait_time_from(&self, now: Timestamp) -> Duration {
        positive(self.earliest.duration_since(now))
    }
}

/// GCRA pacing state of one scope. Pure: every call is given `now`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Pacer {
    config: PacerConfig,
    /// Theoretical arrival time of the next request; `None` before the first.
    tat: Option<Timestamp>,
}

impl Pacer {
    /// A pacer with an empty history (full burst available).
    pub const fn new(config: PacerConfig) -> Self {
        Pacer { config, tat: None }
    }

    /// The configuration.
    pub const fn config(&self) -> &PacerConfig {
        &self.config
    }

    /// Checks without charging: `Ok(new_tat)` if a request of `priority` conforms at `now`.
    fn test(&self, now: Timestamp, priority: Priority) -> Result<Timestamp, NotUntil> {
        let tat = match self.tat {
            Some(tat) if tat > now => tat,
            _ => now,
        };
        let new_tat = add(tat, self.config.emission_interval);
        let horizon = add(now, self.config.tolerance(priority));
        if new_tat <= horizon {
            Ok(new_tat)
        } else {
            let behind = positive(new_tat.duration_since(horizon));
            Err(NotUntil {
                earliest: add(now, behind),
            })
        }
    }

    /// Tests a request of `priority` at `now` and, if it conforms, charges it.
    ///
    /// # Errors
    /// [`NotUntil`] with the earliest conforming instant; nothing is charged.
    pub fn test_and_update(&mut self, now: Timestamp, priority: Priority) -> Result<(), NotUntil> {
        let new_tat = self.test(now, priority)?;
        self.tat = Some(new_tat);
        Ok(())
    }
}

/// The shared state of one scope (SPEC §1 "scope record").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScopeRecord {
    /// Full name, `provider/scope`.
    pub name: String,
    /// No request of this scope may be sent before this instant.
    pub next_allowed_at: Option<Timestamp>,
    /// Requests the provider says are left in the current window.
    pub remaining: Option<u64>,
    /// The provider's limit for the window.
    pub limit: Option<u64>,
    /// When the provider's window resets.
    pub reset_at: Option<Timestamp>,
    /// Where the last signal came from (e.g. `HTTP 429 Retry-After`).
    pub source: Option<String>,
    /// Requests of this scope currently in flight.
    pub in_flight: u32,
    /// Actions of this scope waiting in the delayed queue.
    pub delayed: u32,
    /// Concurrency limit (`max_concurrent_requests`).
    pub max_concurrent_requests: u32,
    /// Delayed queue limit (`max_delayed_requests`).
    pub max_delayed_requests: u32,
}

/// A concurrency slot or delayed-queue place could not be had.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum ScopeFull {
    /// Every concurrency slot is taken.
    #[error("scope {scope}: all {max} concurrency slots are in use")]
    NoSlot {
        /// The scope's full name.
        scope: String,
        /// `max_concurrent_requests`.
        max: u32,
    },
    /// The delayed queue is full: the action ends with `scope_saturated`.
    #[error("scope {scope}: {max} requests are already delayed")]
    Saturated {
        /// The scope's full name.
        scope: String,
        /// `max_delayed_requests`.
        max: u32,
    },
}

impl ScopeRecord {
    /// An empty record for scope `name` with its two queue limits.
    pub fn new(
        name: impl Into<String>,
        max_concurrent_requests: u32,
        max_delayed_requests: u32,
    ) -> Self {
        ScopeRecord {
            name: name.into(),
            next_allowed_at: None,
            remaining: None,
            limit: None,
            reset_at: None,
            source: None,
            in_flight: 0,
            delayed: 0,
            max_concurrent_requests,
            max_delayed_requests,
        }
    }

    /// Records a 429 (or a 403 rate limit) with its boundary: the whole scope waits until
    /// `boundary`. `next_allowed_at` only ever moves later, `remaining` becomes 0 and `source`
    /// is set (SPEC §4.1; use `"HTTP 429 Retry-After"` for a Retry-After boundary).
    pub fn observe_429(&mut self, boundary: Timestamp, source: impl Into<String>) {
        self.push_next_allowed(boundary);
        self.remaining = Some(0);
        self.source = Some(source.into());
    }

    /// Records quota headers (SPEC §2.3): `remaining`, `limit`, `reset_at`. When `remaining` is
    /// 0 and the reset is known, the scope waits until the reset (the caller adds the 1 s safety
    /// margin when it derives `reset_at`).
    pub fn observe_quota(
        &mut self,
        remaining: Option<u64>,
        limit: Option<u64>,
        reset_at: Option<Timestamp>,
        source: impl Into<String>,
    ) {
        if remaining.is_some() {
            self.remaining = remaining;
        }
        if limit.is_some() {
            self.limit = limit;
        }
        if reset_at.is_some() {
            self.reset_at = reset_at;
        }
        if remaining == Some(0) {
            if let Some(reset_at) = reset_at {
                self.push_next_allowed(reset_at);
            }
        }
        self.source = Some(source.into());
    }

    fn push_next_allowed(&mut self, at: Timestamp) {
        self.next_allowed_at = Some(match self.next_allowed_at {
            Some(current) if current > at => current,
            _ => at,
        });
    }

    /// Whether a concurrency slot is free.
    pub const fn has_free_slot(&self) -> bool {
        self.in_flight < self.max_concurrent_requests
    }

    /// Takes a concurrency slot.
    ///
    /// # Errors
    /// [`ScopeFull::NoSlot`] when all `max_concurrent_requests` slots are taken.
    pub fn try_acquire(&mut self) -> Result<(), ScopeFull> {
        if !self.has_free_slot() {
            return Err(ScopeFull::NoSlot {
                scope: self.name.clone(),
                max: self.max_concurrent_requests,
            });
        }
        self.in_flight += 1;
        Ok(())
    }

    /// Returns a concurrency slot (never below zero).
    pub fn release(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// Puts one action into the delayed queue.
    ///
    /// # Errors
    /// [`ScopeFull::Saturated`] when `max_delayed_requests` are already delayed: the action
    /// ends with [`Outcome::ScopeSaturated`] instead of queueing without bound.
    pub fn try_delay(&mut self) -> Result<(), ScopeFull> {
        if self.delayed >= self.max_delayed_requests {
            return Err(ScopeFull::Saturated {
                scope: self.name.clone(),
                max: self.max_delayed_requests,
            });
        }
        self.delayed += 1;
        Ok(())
    }

    /// Takes one action out of the delayed queue (it woke or was cancelled).
    pub fn undelay(&mut self) {
        self.delayed = self.delayed.saturating_sub(1);
    }
}

/// One scope as [`admit`] sees it: the shared record and, when the scope has a published rate,
/// its pacer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScopeState {
    /// The shared record.
    pub record: ScopeRecord,
    /// Local pacing; `None` when the scope has no published rate.
    pub pacer: Option<Pacer>,
}

/// What the action itself contributes to the dispatch check (besides its budget).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct AdmitRequest {
    /// The action or its task was cancelled.
    pub cancelled: bool,
    /// The task's priority.
    pub priority: Priority,
}

/// Why an action must wait.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum WaitReason {
    /// A scope's `next_allowed_at` (provider signal) is in the future.
    NextAllowedAt {
        /// The scope's full name.
        scope: String,
        /// The source of the scope's last signal.
        source: Option<String>,
    },
    /// Local pacing of a scope.
    Pacing {
        /// The scope's full name.
        scope: String,
    },
}

/// The answer of [`admit`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "admission", rename_all = "snake_case")]
pub enum Admission {
    /// Send now: one attempt, one pacing emission and one slot per scope were charged.
    Go,
    /// Wait in the delayed queue until `at` and ask again.
    WaitUntil {
        /// The instant to ask again.
        at: Timestamp,
        /// Why.
        reason: WaitReason,
    },
    /// Wait until a concurrency slot of `scope` is released (no instant is known).
    WaitForSlot {
        /// The scope's full name.
        scope: String,
    },
    /// Do not send; the action ends with `outcome`.
    Refuse {
        /// The terminal outcome.
        outcome: Outcome,
        /// A one-line reason.
        detail: String,
        /// The instant the action would have waited for — a scope's `next_allowed_at` or its
        /// local pacing — when that wait is what lies beyond the deadline or the remaining wait
        /// budget; `None` for a refusal no instant would lift (cancelled, attempts or deadline
        /// spent).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        not_before: Option<Timestamp>,
    },
}

/// The dispatch check before each attempt (SPEC §4.1), all-or-nothing.
///
/// Order: (1) cancelled → `Refuse(cancelled)`; attempts or deadline spent →
/// `Refuse(budget_exhausted | deadline_exhausted)`; (2) the latest `next_allowed_at` of all
/// scopes in the future → `WaitUntil` — or `Refuse` when that instant lies beyond the deadline
/// or the remaining wait budget (never sleep into failure), naming the instant as
/// `not_before`; (3) pacing of every scope → `WaitUntil` the latest [`NotUntil`] (same budget
/// rule, same `not_before`); (4) a concurrency slot in every scope
/// → `WaitForSlot`. Only on [`Admission::Go`] are the attempt, the pacing emissions and the
/// slots charged; the caller returns the slots with [`ScopeRecord::release`]. Putting a waiting
/// action into the delayed queue is the caller's step ([`ScopeRecord::try_delay`]).
pub fn admit(
    request: AdmitRequest,
    budget: &mut ActionBudget,
    scopes: &mut [&mut ScopeState],
    now: Timestamp,
) -> Admission {
    if request.cancelled {
        return Admission::Refuse {
            outcome: Outcome::Cancelled,
            detail: "the action or its task was cancelled".to_owned(),
            not_before: None,
        };
    }
    if let Err(refusal) = budget.check(now) {
        return Admission::Refuse {
            outcome: refusal.outcome(),
            detail: refusal.to_string(),
            not_before: None,
        };
    }

    let mut latest: Option<(Timestamp, WaitReason)> = None;
    for scope in scopes.iter() {
        if let Some(next) = scope.record.next_allowed_at {
            if next > now && latest.as_ref().is_none_or(|(at, _)| next > *at) {
                latest = Some((
                    next,
                    WaitReason::NextAllowedAt {
                        scope: scope.record.name.clone(),
                        source: scope.record.source.clone(),
                    },
                ));
            }
        }
    }
    if let Some((at, reason)) = latest {
        return wait_or_refuse(budget, now, at, reason);
    }

    let mut new_tats = Vec::with_capacity(scopes.len());
    let mut latest: Option<(Timestamp, WaitReason)> = None;
    for scope in scopes.iter() {
        match scope.pacer.as_ref().map(|p| p.test(now, request.priority)) {
            Some(Ok(tat)) => new_tats.push(Some(tat)),
            Some(Err(not_until)) => {
                new_tats.push(None);
                let at = not_until.earliest();
                if latest.as_ref().is_none_or(|(l, _)| at > *l) {
                    latest = Some((
                        at,
                        WaitReason::Pacing {
                            scope: scope.record.name.clone(),
                        },
                    ));
                }
            }
            None => new_tats.push(None),
        }
    }
    if let Some((at, reason)) = latest {
        return wait_or_refuse(budget, now, at, reason);
    }

    if let Some(full) = scopes.iter().find(|s| !s.record.has_free_slot()) {
        return Admission::WaitForSlot {
            scope: full.record.name.clone(),
        };
    }

    if let Err(refusal) = budget.withdraw_attempt(now) {
        return Admission::Refuse {
            outcome: refusal.outcome(),
            detail: refusal.to_string(),
            not_before: None,
        };
    }
    for (scope, tat) in scopes.iter_mut().zip(new_tats) {
        if let (Some(pacer), Some(tat)) = (scope.pacer.as_mut(), tat) {
            pacer.tat = Some(tat);
        }
        scope.record.in_flight += 1;
    }
    Admission::Go
}

fn wait_or_refuse(
    budget: &ActionBudget,
    now: Timestamp,
    at: Timestamp,
    reason: WaitReason,
) -> Admission {
    if let Some(deadline) = budget.deadline() {
        if at > deadline {
            return Admission::Refuse {
                outcome: Outcome::DeadlineExhausted,
                detail: format!("must wait until {at}, past the task deadline {deadline}"),
                not_before: Some(at),
            };
        }
    }
    let wait = positive(at.duration_since(now));
    if wait > budget.wait_remaining() {
        return Admission::Refuse {
            outcome: Outcome::BudgetExhausted,
            detail: wait_over_budget(budget, wait, at, &reason),
            not_before: Some(at),
        };
    }
    Admission::WaitUntil { at, reason }
}

/// The `detail` of a refusal because the wait `reason` asks for (`wait`, until `at`) is longer
/// than what is left of the action's wait budget. Before the action's first attempt it says
/// that nothing was sent, what holds the request, and from when to send it again; before a
/// retry, what holds the next attempt.
fn wait_over_budget(
    budget: &ActionBudget,
    wait: Duration,
    at: Timestamp,
    reason: &WaitReason,
) -> String {
    let held_by = match reason {
        WaitReason::Pacing { scope } => {
            format!("the pacing of scope `{scope}` (its request limit at the provider)")
        }
        WaitReason::NextAllowedAt {
            scope,
            source: Some(source),
        } => format!("the provider's boundary for scope `{scope}` (from {source})"),
        WaitReason::NextAllowedAt {
            scope,
            source: None,
        } => format!("the provider's boundary for scope `{scope}`"),
    };
    let (wait_ms, left_ms) = (wait.as_millis(), budget.wait_remaining().as_millis());
    if budget.attempts_used() == 0 {
        format!(
            "nothing was sent: {held_by} would hold this request {wait_ms} ms, until {at}, longer than the {left_ms} ms its wait budget allows (the class's max_wait_seconds, or a shorter `Prefer: wait`); send it again from {at}, or allow a longer wait"
        )
    } else {
        format!(
            "the next attempt must wait {wait_ms} ms, until {at}, for {held_by}; the wait budget has {left_ms} ms left"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_follows_headroom() {
        let c = PacerConfig::try_new(100, Duration::from_secs(60), 0.8, 0.2).expect("valid");
        assert_eq!(c.burst, 20);
        assert_eq!(c.emission_interval, Duration::from_millis(750));
    }

    #[test]
    fn invalid_parameters_are_named() {
        assert_eq!(
            PacerConfig::try_new(0, Duration::from_secs(1), 0.8, 0.2),
            Err(InvalidPacer::ZeroLimit)
        );
        assert_eq!(
            PacerConfig::try_new(10, Duration::from_micros(100), 0.8, 0.2),
            Err(InvalidPacer::ShortWindow(Duration::from_micros(100)))
        );
        assert_eq!(
            PacerConfig::try_new(10, Duration::ZERO, 0.8, 0.2),
            Err(InvalidPacer::ShortWindow(Duration::ZERO))
        );
        assert_eq!(
            InvalidPacer::ShortWindow(Duration::from_millis(500)).to_string(),
            "window_seconds must be at least 1 second, got 0.5 s"
        );
        assert!(PacerConfig::try_new(10, MIN_WINDOW, 0.8, 0.2).is_ok());
        assert_eq!(
            PacerConfig::try_new(1, Duration::from_secs(1), 1.5, 0.2),
            Err(InvalidPacer::Headroom(1.5))
        );
        assert_eq!(
            PacerConfig::try_new(1, Duration::from_secs(1), 0.8, 1.0),
            Err(InvalidPacer::Reserve(1.0))
        );
    }
}
