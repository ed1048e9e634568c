//! Backoff and Retry-After parameters (`backoff`, SPEC §4.2) and their lower bounds.

use std::time::Duration;

use serde::Serialize;

use super::diagnostics::Ctx;
use super::raw::{Num, RawBackoff, S};
use crate::backoff::BackoffConfig;

/// Backoff and Retry-After parameters (`backoff`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BackoffPolicy {
    /// `base_seconds` (default 1).
    pub base: Duration,
    /// `max_seconds` (default 60).
    pub max: Duration,
    /// `min_delay_seconds`: the floor of every known boundary delay (past, zero or smaller values
    /// are raised to it; default 1).
    pub min_delay: Duration,
    /// `retry_after_ceiling_seconds`: larger Retry-After values are absurd (default 86,400; at
    /// least [`MIN_RETRY_AFTER_CEILING`]).
    pub retry_after_ceiling: Duration,
    /// `boundary_spread_seconds`: jitter after a provider boundary (default 5). 0 turns the
    /// jitter off: every retry released by one boundary then leaves at the same instant, as
    /// one burst (SPEC §4.2 wants them spread), so 0 loads with a warning.
    pub boundary_spread: Duration,
}

impl BackoffPolicy {
    /// The parameters of [`crate::backoff::plan_retry`].
    pub fn config(&self) -> BackoffConfig {
        BackoffConfig {
            base: self.base,
            max: self.max,
            boundary_spread: self.boundary_spread,
        }
    }
}

/// The shortest `backoff.base_seconds` a policy may set (0.1 s). The first retry's delay is drawn
/// from `[0, 2 · base]` and each later cap doubles from there, so a smaller base (`1e-9`, `0.001`)
/// sends the retries of a failing request within microseconds or milliseconds of each other: a
/// tight retry loop against a provider that is already failing, which backoff exists to prevent.
pub const MIN_BACKOFF_BASE: Duration = Duration::from_millis(100);

/// The shortest `backoff.min_delay_seconds` a policy may set (0.1 s). It is the floor of every
/// provider boundary: a `Retry-After: 0`, a date or quota reset already past, or a shorter delay is
/// raised to it. A smaller floor (`1e-9`, `0.001`) lets a provider that keeps answering "retry
/// now" be called again within microseconds or milliseconds: a tight retry loop against a limit
/// that is already hit.
pub const MIN_RETRY_DELAY_FLOOR: Duration = Duration::from_millis(100);

/// The smallest `backoff.retry_after_ceiling_seconds` a policy may set (1 s). A `Retry-After`
/// above the ceiling is absurd and its boundary unknown (SPEC §2.2); providers give it in whole
/// seconds, so a ceiling under one second (`0.5`, `1e-9`) discards every delay a provider
/// actually sends: each throttled request is retried on local backoff alone, possibly before
/// the provider allows it.
pub const MIN_RETRY_AFTER_CEILING: Duration = Duration::from_secs(1);

/// The backoff of a policy without a `backoff` section, and the default of each field: base 1 s,
/// max 60 s, minimum delay 1 s, Retry-After ceiling 86,400 s, boundary spread 5 s.
const DEFAULT_BACKOFF: BackoffPolicy = BackoffPolicy {
    base: Duration::from_secs(1),
    max: Duration::from_secs(60),
    min_delay: Duration::from_secs(1),
    retry_after_ceiling: Duration::from_secs(86_400),
    boundary_spread: Duration::from_secs(5),
};

/// `backoff`: each duration read in seconds (absent: [`DEFAULT_BACKOFF`]), then checked
/// against its lower bound and against the others.
pub(super) fn validate_backoff(raw: Option<&S<RawBackoff>>, ctx: &mut Ctx) -> BackoffPolicy {
    let Some(raw) = raw else {
        return DEFAULT_BACKOFF;
    };
    let policy = read_backoff(&raw.value, ctx);
    warn_without_spread(&raw.value, &policy, ctx);
    check_lower_bounds(&raw.value, &policy, ctx);
    check_order(raw, &policy, ctx);
    policy
}

/// The durations of `b`, each defaulted when absent or invalid (reported).
fn read_backoff(b: &RawBackoff, ctx: &mut Ctx) -> BackoffPolicy {
    let defaults = DEFAULT_BACKOFF;
    BackoffPolicy {
        base: ctx.seconds(&b.base_seconds, "backoff.base_seconds", defaults.base),
        max: ctx.seconds(&b.max_seconds, "backoff.max_seconds", defaults.max),
        min_delay: ctx.seconds(
            &b.min_delay_seconds,
            "backoff.min_delay_seconds",
            defaults.min_delay,
        ),
        retry_after_ceiling: ctx.seconds(
            &b.retry_after_ceiling_seconds,
            "backoff.retry_after_ceiling_seconds",
            defaults.retry_after_ceiling,
        ),
        boundary_spread: ctx.seconds(
            &b.boundary_spread_seconds,
            "backoff.boundary_spread_seconds",
            defaults.boundary_spread,
        ),
    }
}

/// A `boundary_spread_seconds` of 0 loads, with a warning: it releases retries as one burst.
fn warn_without_spread(b: &RawBackoff, policy: &BackoffPolicy, ctx: &mut Ctx) {
    if let (Some(s), true) = (&b.boundary_spread_seconds, policy.boundary_spread.is_zero()) {
        ctx.warn(
            s.referenced.line(),
            s.referenced.column(),
            "backoff.boundary_spread_seconds: 0 turns off the jitter after a provider boundary, so every retry one boundary releases (one 429's Retry-After delays the whole scope) goes out in the same instant, as one burst that can hit the limit again (SPEC §4.2); keep it above 0 unless one agent's retries alone use the scope",
        );
    }
}

/// `base_seconds` and `min_delay_seconds` are at least [`MIN_BACKOFF_BASE`] and
/// [`MIN_RETRY_DELAY_FLOOR`]: smaller ones make a tight retry loop.
fn check_lower_bounds(b: &RawBackoff, policy: &BackoffPolicy, ctx: &mut Ctx) {
    if let (Some(s), true) = (&b.base_seconds, policy.base < MIN_BACKOFF_BASE) {
        ctx.err(
            &s.referenced,
            format!(
                "backoff.base_seconds: must be at least {} seconds, got {} (the first retry \
                 waits at most twice the base, so a smaller one retries a failing request \
                 within milliseconds, a tight retry loop)",
                MIN_BACKOFF_BASE.as_secs_f64(),
                s.value
            ),
        );
    }
    if let (Some(s), true) = (
        &b.min_delay_seconds,
        policy.min_delay < MIN_RETRY_DELAY_FLOOR,
    ) {
        ctx.err(
            &s.referenced,
            format!(
                "backoff.min_delay_seconds: must be at least {} seconds, got {} (it is the \
                 shortest wait after a Retry-After of 0 or a reset already past, so a smaller \
                 one retries a throttled request within milliseconds, a tight retry loop)",
                MIN_RETRY_DELAY_FLOOR.as_secs_f64(),
                s.value
            ),
        );
    }
}

/// `max_seconds` is at least `base_seconds`, and `retry_after_ceiling_seconds` at least
/// [`MIN_RETRY_AFTER_CEILING`] and `min_delay_seconds`. A bound the file leaves out is reported
/// at the `backoff` section.
fn check_order(raw: &S<RawBackoff>, policy: &BackoffPolicy, ctx: &mut Ctx) {
    let b = &raw.value;
    let at = |v: &Option<S<Num>>| v.as_ref().map(|s| s.referenced).unwrap_or(raw.referenced);
    if policy.max < policy.base {
        ctx.err(
            &at(&b.max_seconds),
            "backoff.max_seconds: must be at least backoff.base_seconds",
        );
    }
    let short_ceiling = policy.retry_after_ceiling < MIN_RETRY_AFTER_CEILING;
    if let (Some(s), true) = (&b.retry_after_ceiling_seconds, short_ceiling) {
        ctx.err(
            &s.referenced,
            format!(
                "backoff.retry_after_ceiling_seconds: must be at least {} second, got {} \
                 (providers give Retry-After in whole seconds, so a smaller ceiling treats \
                 every delay of a second or more as absurd: throttled requests are retried on \
                 local backoff alone, before the provider allows it)",
                MIN_RETRY_AFTER_CEILING.as_secs(),
                s.value
            ),
        );
    } else if policy.retry_after_ceiling < policy.min_delay {
        ctx.err(
            &at(&b.retry_after_ceiling_seconds),
            "backoff.retry_after_ceiling_seconds: must be at least backoff.min_delay_seconds",
        );
    }
}
