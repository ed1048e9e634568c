//! # Time is passed in, never read
//!
//! Every decision in backstop depends on "now": whether a boundary has passed, how long a wait
//! still is, when a reset happens. Reading the system clock inside a decision makes it untestable
//! and non-deterministic, so decisions take a `jiff::Timestamp` argument instead, and the
//! components that *do* need to ask for the time (the gateway's scheduler) ask through the
//! [`Clock`] trait. This module holds the trait and [`ManualClock`], a clock that only moves when a
//! test moves it. The real clock lives in the gateway (the only place allowed to read the system
//! time, see `clippy.toml`).
//!
//! ```
//! use backstop_core::clock::{Clock, ManualClock};
//! use std::time::Duration;
//!
//! let start: jiff::Timestamp = "2025-01-01T00:00:00Z".parse().unwrap();
//! let clock = ManualClock::new(start);
//! clock.advance(Duration::from_millis(1500));
//! assert_eq!(clock.now().to_string(), "2025-01-01T00:00:01.5Z");
//! ```

use std::sync::Mutex;
use std::time::Duration;

use jiff::{SignedDuration, Timestamp};

/// A source of the current instant (UTC, nanosecond resolution).
///
/// Implementations must be cheap and thread-safe; callers may ask for the time on every decision.
pub trait Clock: Send + Sync {
    /// The current instant.
    fn now(&self) -> Timestamp;
}

/// A clock that stands still until told to move: for tests and offline replays.
///
/// Interior mutability (a mutex) lets a test share one `ManualClock` (e.g. behind an `Arc`) with
/// the component under test and move it from outside. Moving past `Timestamp::MAX` saturates at
/// `Timestamp::MAX` rather than panicking.
#[derive(Debug)]
pub struct ManualClock {
    now: Mutex<Timestamp>,
}

impl ManualClock {
    /// A clock that reads `start` until moved.
    pub fn new(start: Timestamp) -> Self {
        Self {
            now: Mutex::new(start),
        }
    }

    /// Moves the clock forward by `by` (saturating at `Timestamp::MAX`).
    pub fn advance(&self, by: Duration) {
        let mut now = self.lock();
        let by = SignedDuration::try_from(by).unwrap_or(SignedDuration::MAX);
        *now = now.saturating_add(by).unwrap_or(Timestamp::MAX);
    }

    /// Sets the clock to `to` (which may be earlier than the current reading).
    pub fn set(&self, to: Timestamp) {
        *self.lock() = to;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Timestamp> {
        // A poisoned lock only means another thread panicked while holding a plain `Timestamp`,
        // which is always a valid value: keep using it.
        self.now.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        *self.lock()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_told() {
        let start: Timestamp = "2025-01-01T00:00:00Z".parse().unwrap();
        let clock = ManualClock::new(start);
        assert_eq!(clock.now(), start);
        clock.advance(Duration::from_secs(90));
        assert_eq!(clock.now().to_string(), "2025-01-01T00:01:30Z");
        clock.set(start);
        assert_eq!(clock.now(), start);
    }

    #[test]
    fn manual_clock_saturates_instead_of_overflowing() {
        let clock = ManualClock::new(Timestamp::MAX);
        clock.advance(Duration::from_secs(u64::MAX));
        assert_eq!(clock.now(), Timestamp::MAX);
    }
}
