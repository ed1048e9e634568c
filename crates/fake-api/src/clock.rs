//! The one place the fake provider reads the clock.
//!
//! The fake plays a real server: quotas refill and windows end in real time, and `Date`,
//! `Retry-After` and reset headers are stamped from the wall clock. Both readings are taken
//! together so one request sees one consistent "now".

use std::time::Instant;

use jiff::Timestamp;

/// One reading of the monotonic and the wall clock.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Now {
    /// Monotonic instant, for quota arithmetic.
    pub(crate) mono: Instant,
    /// Wall-clock instant (UTC), for headers and attempt records.
    pub(crate) wall: Timestamp,
}

/// Reads the clock.
// The fake provider is the test double of a remote server: it must live in real time. This is
// its only clock read.
#[allow(clippy::disallowed_methods)]
pub(crate) fn now() -> Now {
    let wall = Timestamp::try_from(std::time::SystemTime::now()).unwrap_or(Timestamp::UNIX_EPOCH);
    Now {
        mono: Instant::now(),
        wall,
    }
}
