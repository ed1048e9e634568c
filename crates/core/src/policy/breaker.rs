//! Circuit breaker parameters (`breaker`, SPEC §7).

use std::time::Duration;

use serde::Serialize;

use super::diagnostics::Ctx;
use super::raw::{RawBreaker, S};

/// The shortest `breaker.forget_after_seconds` a policy may set (1 s). A task's breaker is
/// forgotten that long after its last failure; the same request fails again no sooner than a
/// retry's delay (`backoff.min_delay_seconds`, 1 s by default) or the agent's next try, so a
/// shorter window (`1e-9`, `0.5`) forgets every failure before the next one and the circuit
/// never opens: the breaker would be off while the policy says it is on.
pub const MIN_FORGET_AFTER: Duration = Duration::from_secs(1);

/// Circuit breaker parameters (`breaker`, SPEC §7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BreakerPolicy {
    /// Identical failures that open the path for a task (default 3).
    pub threshold: u32,
    /// `forget_after_seconds`: a task's breaker without a failure for this long is forgotten,
    /// open paths included, so the same failure then needs `threshold` tries again to open
    /// (default 86,400 s, 24 h; at least [`MIN_FORGET_AFTER`]). See
    /// [`crate::breaker::TaskBreakers`].
    pub forget_after: Duration,
}

impl Default for BreakerPolicy {
    /// Threshold 3, forget after 24 h.
    fn default() -> Self {
        BreakerPolicy {
            threshold: 3,
            forget_after: Duration::from_secs(86_400),
        }
    }
}

pub(super) fn validate_breaker(raw: Option<&S<RawBreaker>>, ctx: &mut Ctx) -> BreakerPolicy {
    let defaults = BreakerPolicy::default();
    let Some(raw) = raw else {
        return defaults;
    };
    let b = &raw.value;
    let threshold = ctx.at_least_one(&b.threshold, "breaker.threshold", defaults.threshold);
    let forget_after = ctx.seconds(
        &b.forget_after_seconds,
        "breaker.forget_after_seconds",
        defaults.forget_after,
    );
    let too_short = forget_after < MIN_FORGET_AFTER;
    if let (Some(s), true) = (&b.forget_after_seconds, too_short) {
        ctx.err(
            &s.referenced,
            format!(
                "breaker.forget_after_seconds: must be at least {} second, got {} (a breaker \
                 forgotten sooner after a failure is forgotten before the same request can \
                 fail again, so its circuit would never open)",
                MIN_FORGET_AFTER.as_secs(),
                s.value
            ),
        );
    }
    BreakerPolicy {
        threshold,
        forget_after: if too_short {
            defaults.forget_after
        } else {
            forget_after
        },
    }
}
