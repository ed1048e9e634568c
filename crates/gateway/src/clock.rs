//! The gateway's clock: wall-clock instants that follow tokio's (pausable) time.
//!
//! Why: the core takes `now` as a `jiff::Timestamp`, while the runtime sleeps on
//! `tokio::time::Instant`. [`TokioClock`] anchors one wall-clock reading to one tokio instant at
//! construction and derives every later `now()` from tokio's elapsed time. With
//! `tokio::time::pause()` the clock therefore advances exactly as far as the test advances time,
//! and the scheduler's deadlines (`Timestamp`) and its sleeps (`Instant`) never disagree.

use std::time::Duration;

use backstop_core::clock::Clock;
use jiff::{SignedDuration, Timestamp};

/// A clock anchored at one wall-clock reading and advanced by tokio's monotonic time.
#[derive(Debug, Clone, Copy)]
pub struct TokioClock {
    anchor_wall: Timestamp,
    anchor_tokio: tokio::time::Instant,
}

impl TokioClock {
    /// Anchors at the real current time. Call inside a tokio runtime (paused or not).
    #[allow(clippy::disallowed_methods)] // the one real clock read of the gateway
    pub fn system() -> Self {
        Self::anchored_at(Timestamp::now())
    }

    /// Anchors at a given wall-clock instant (tests use a fixed one).
    pub fn anchored_at(anchor_wall: Timestamp) -> Self {
        Self {
            anchor_wall,
            anchor_tokio: tokio::time::Instant::now(),
        }
    }

    /// The tokio instant that corresponds to a wall-clock `at` (for `sleep_until`). Instants
    /// before the anchor map to the anchor.
    pub fn instant_at(&self, at: Timestamp) -> tokio::time::Instant {
        let offset = at.duration_since(self.anchor_wall);
        let offset = Duration::try_from(offset).unwrap_or(Duration::ZERO);
        self.anchor_tokio + offset
    }
}

impl Clock for TokioClock {
    fn now(&self) -> Timestamp {
        let elapsed = self.anchor_tokio.elapsed();
        let elapsed = SignedDuration::try_from(elapsed).unwrap_or(SignedDuration::MAX);
        self.anchor_wall
            .checked_add(elapsed)
            .unwrap_or(Timestamp::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn clock_follows_paused_tokio_time() {
        let anchor: Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let clock = TokioClock::anchored_at(anchor);
        tokio::time::advance(Duration::from_millis(1500)).await;
        assert_eq!(clock.now(), "2026-01-01T00:00:01.5Z".parse().unwrap());
        let later: Timestamp = "2026-01-01T00:00:10Z".parse().unwrap();
        assert_eq!(
            clock.instant_at(later) - clock.instant_at(anchor),
            Duration::from_secs(10)
        );
    }
}
