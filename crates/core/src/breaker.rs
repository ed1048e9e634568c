//! Sanitized fingerprints and the per-task circuit breaker (SPEC §7).
//!
//! Why: an agent that gets a 422 or a 401 tends to "fix" the request by varying something
//! irrelevant (whitespace, header order, a timestamp) and send it again. The breaker keys on
//! what makes a request *the same request* for the provider: method, route template (ids
//! replaced), the stable payload fields named by policy (`fingerprint_fields`, JSON pointers),
//! and, for a failure, the normalized provider error code. Nothing else goes in: no secrets, no
//! volatile headers, no raw body, so the fingerprint can be logged and audited.
//!
//! The fingerprint is SHA-256 (FIPS 180-4) over a length-prefixed encoding of those parts, in
//! lowercase hex. When the same request fingerprint fails with the same normalized error
//! `threshold` times (default 3) within one task, that path opens for the task: every further
//! call ends at once with `circuit_open` and the failure details ([`CircuitOpen`]).
//!
//! ```
//! use backstop_core::breaker::{RequestFingerprint, TaskBreaker};
//! use serde_json::json;
//!
//! let now: jiff::Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
//! let payload = json!({"amount": 100, "currency": "EUR", "note": "  try again "});
//! let fields = ["/amount".to_owned(), "/currency".to_owned()];
//! let fp = RequestFingerprint::compute("POST", "/v1/transfers", Some(&payload), &fields);
//! let mut breaker = TaskBreaker::new(3);
//! for _ in 0..3 {
//!     breaker.record_failure(&fp, "INVALID_IBAN", Some(422), now);
//! }
//! let open = breaker.check(&fp).unwrap_err();
//! assert_eq!(open.error_code, "invalid_iban");
//! assert_eq!(open.failures, 3);
//! ```
//!
//! ## Forgetting
//!
//! Why: a gateway runs for months, and every task that ever failed would otherwise keep its
//! breaker in memory. A call without `X-Backstop-Task` gets a task of its own, so a million
//! rejected calls would leave a million breakers. [`TaskBreakers`] holds the breakers of all
//! tasks and keeps their number bounded by what is still worth knowing:
//!
//! - a breaker whose streaks were all ended by successes holds nothing and is dropped;
//! - a cancelled task's breaker is dropped ([`TaskBreakers::forget_task`]): the task takes no
//!   new actions;
//! - a breaker whose task has had no failure for `forget_after` (policy
//!   `breaker.forget_after_seconds`, default 24 h) is forgotten, open paths included: the same
//!   failure then needs `threshold` more tries to open again. A forgotten breaker counts as
//!   absent from that instant on; its memory is reclaimed by a sweep, which runs when the number
//!   held has doubled since the last sweep (at least [`MIN_BREAKERS_SWEEP`]) or when a forget
//!   window has passed since it, on the next failure recorded — O(1) amortized per failure.
//!
//! ```
//! use std::time::Duration;
//! use backstop_core::breaker::{RequestFingerprint, TaskBreakers};
//!
//! let t0: jiff::Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
//! let day = jiff::SignedDuration::from_hours(24);
//! let fp = RequestFingerprint::compute("GET", "/v1/items/{id}", None, &[]);
//! let mut breakers = TaskBreakers::new(3, Duration::from_secs(86_400));
//! for _ in 0..3 {
//!     breakers.record_failure("agent-a", "run-1", &fp, "not_found", Some(404), t0);
//! }
//! assert!(breakers.check("agent-a", "run-1", &fp, t0).is_err());
//! // A day without a failure: forgotten, and swept at the next failure recorded.
//! assert!(breakers.check("agent-a", "run-1", &fp, t0 + day).is_ok());
//! breakers.record_failure("agent-a", "run-2", &fp, "not_found", Some(404), t0 + day);
//! assert_eq!(breakers.len(), 1);
//! ```

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::outcome::Outcome;

/// The sanitized fingerprint of a request (without any error): lowercase SHA-256 hex.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RequestFingerprint(String);

/// The fingerprint of a failure: request fingerprint + normalized error code, lowercase hex.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct FailureFingerprint(String);

fn feed(hasher: &mut Sha256, part: &[u8]) {
    hasher.update((part.len() as u64).to_be_bytes());
    hasher.update(part);
}

impl RequestFingerprint {
    /// Computes the fingerprint from the method (case-insensitive), the route template (ids
    /// already replaced, e.g. `/v1/transfers/{id}`), and the values at the JSON pointers
    /// `stable_fields` (RFC 6901) in `payload`. A missing field counts as absent, distinct from
    /// JSON `null`; field values are hashed in canonical JSON (object keys sorted), so key order
    /// and whitespace in the original body do not matter.
    pub fn compute(
        method: &str,
        route_template: &str,
        payload: Option<&serde_json::Value>,
        stable_fields: &[String],
    ) -> Self {
        let mut hasher = Sha256::new();
        feed(&mut hasher, b"backstop-fingerprint-v1");
        feed(&mut hasher, method.trim().to_ascii_uppercase().as_bytes());
        feed(&mut hasher, route_template.as_bytes());
        for pointer in stable_fields {
            feed(&mut hasher, pointer.as_bytes());
            match payload.and_then(|p| p.pointer(pointer)) {
                Some(value) => {
                    feed(&mut hasher, b"=");
                    feed(&mut hasher, value.to_string().as_bytes());
                }
                None => feed(&mut hasher, b"absent"),
            }
        }
        RequestFingerprint(hex::encode(hasher.finalize()))
    }

    /// The fingerprint as lowercase hex.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The failure fingerprint of this request with `error_code` (normalized, see
    /// [`normalize_error_code`]).
    pub fn with_error(&self, error_code: &str) -> FailureFingerprint {
        let mut hasher = Sha256::new();
        feed(&mut hasher, b"backstop-failure-v1");
        feed(&mut hasher, self.0.as_bytes());
        feed(&mut hasher, normalize_error_code(error_code).as_bytes());
        FailureFingerprint(hex::encode(hasher.finalize()))
    }
}

impl std::fmt::Display for RequestFingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::fmt::Display for FailureFingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl FailureFingerprint {
    /// The fingerprint as lowercase hex.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Normalizes a provider error code: trimmed, lowercase, runs of whitespace and `-` become `_`
/// (`"Invalid-IBAN "` → `invalid_iban`). An empty code is `unknown`.
pub fn normalize_error_code(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut pending_sep = false;
    for c in code.trim().chars() {
        if c.is_whitespace() || c == '-' || c == '_' {
            pending_sep = !out.is_empty();
        } else {
            if pending_sep {
                out.push('_');
                pending_sep = false;
            }
            out.extend(c.to_lowercase());
        }
    }
    if out.is_empty() {
        "unknown".to_owned()
    } else {
        out
    }
}

/// The path is open for this task: the call ends with `circuit_open` (SPEC §7).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("circuit open: request {fingerprint} failed {failures} times with `{error_code}`")]
pub struct CircuitOpen {
    /// The request fingerprint.
    pub fingerprint: RequestFingerprint,
    /// The failure fingerprint (request + error).
    pub failure: FailureFingerprint,
    /// The normalized error code that repeated.
    pub error_code: String,
    /// The last HTTP status of those failures.
    pub last_status: Option<u16>,
    /// How many times it failed that way.
    pub failures: u32,
}

impl CircuitOpen {
    /// Always [`Outcome::CircuitOpen`].
    pub const fn outcome(&self) -> Outcome {
        Outcome::CircuitOpen
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Streak {
    error_code: String,
    last_status: Option<u16>,
    failures: u32,
}

/// The circuit breaker of one task: consecutive identical failures per request fingerprint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskBreaker {
    threshold: u32,
    streaks: BTreeMap<RequestFingerprint, Streak>,
    /// When the last failure was recorded; `None` before the first.
    last_failure_at: Option<Timestamp>,
}

impl TaskBreaker {
    /// A breaker that opens after `threshold` identical failures (policy `breaker.threshold`,
    /// default 3; a threshold of 0 is treated as 1).
    pub fn new(threshold: u32) -> Self {
        TaskBreaker {
            threshold: threshold.max(1),
            streaks: BTreeMap::new(),
            last_failure_at: None,
        }
    }

    /// Whether a call with this fingerprint may go out.
    ///
    /// # Errors
    /// [`CircuitOpen`] with the failure details once the path is open.
    pub fn check(&self, fingerprint: &RequestFingerprint) -> Result<(), CircuitOpen> {
        match self.streaks.get(fingerprint) {
            Some(streak) if streak.failures >= self.threshold => Err(CircuitOpen {
                fingerprint: fingerprint.clone(),
                failure: fingerprint.with_error(&streak.error_code),
                error_code: streak.error_code.clone(),
                last_status: streak.last_status,
                failures: streak.failures,
            }),
            _ => Ok(()),
        }
    }

    /// Records a failure of `fingerprint` with the provider's `error_code` (normalized here)
    /// and the HTTP status, at `now`. A different error than the previous one starts a new
    /// streak. Returns [`CircuitOpen`] when this failure opened (or kept open) the path.
    pub fn record_failure(
        &mut self,
        fingerprint: &RequestFingerprint,
        error_code: &str,
        status: Option<u16>,
        now: Timestamp,
    ) -> Option<CircuitOpen> {
        let code = normalize_error_code(error_code);
        let streak = self
            .streaks
            .entry(fingerprint.clone())
            .or_insert_with(|| Streak {
                error_code: code.clone(),
                last_status: status,
                failures: 0,
            });
        if streak.error_code != code {
            streak.error_code = code;
            streak.failures = 0;
        }
        streak.failures = streak.failures.saturating_add(1);
        streak.last_status = status;
        self.last_failure_at = Some(self.last_failure_at.map_or(now, |last| last.max(now)));
        self.check(fingerprint).err()
    }

    /// Records a success: the streak of this fingerprint ends.
    pub fn record_success(&mut self, fingerprint: &RequestFingerprint) {
        self.streaks.remove(fingerprint);
    }

    /// Whether no streak is left (none recorded, or all ended by successes): the breaker holds
    /// nothing and may be dropped.
    pub fn is_clear(&self) -> bool {
        self.streaks.is_empty()
    }

    /// The instant of the last failure recorded, if any.
    pub fn last_failure_at(&self) -> Option<Timestamp> {
        self.last_failure_at
    }

    /// Whether no failure was recorded within `forget_after` before `now` (or none ever): the
    /// breaker is to be forgotten ([`TaskBreakers`]). A last failure later than `now` (a clock
    /// that stepped back) is recent.
    pub fn is_stale(&self, now: Timestamp, forget_after: Duration) -> bool {
        let window = SignedDuration::try_from(forget_after).unwrap_or(SignedDuration::MAX);
        self.last_failure_at
            .is_none_or(|last| now.duration_since(last) >= window)
    }
}

/// Breakers are swept no earlier than when this many are held (unless a forget window passed).
pub const MIN_BREAKERS_SWEEP: usize = 1024;

/// The circuit breakers of every task, by agent and task id (task ids are namespaced per agent),
/// and the rules that forget them (see the [module docs](self#forgetting)). Pure: every method
/// that needs the time is given `now`.
#[derive(Debug, Clone)]
pub struct TaskBreakers {
    threshold: u32,
    forget_after: Duration,
    /// By agent, then task id (looked up with `&str`, without copying either).
    by_agent: HashMap<String, HashMap<String, TaskBreaker>>,
    /// Task breakers held (the sum of the inner maps' lengths).
    held: usize,
    /// A failure recorded while this many are held sweeps first.
    sweep_at: usize,
    /// A failure recorded at or after this instant sweeps first: one forget window after the
    /// last sweep (or the first failure).
    sweep_by: Option<Timestamp>,
}

impl TaskBreakers {
    /// No breakers yet. Each task's breaker opens after `threshold` identical failures
    /// (policy `breaker.threshold`; 0 is treated as 1) and is forgotten `forget_after` after its
    /// last failure (`breaker.forget_after_seconds`).
    pub fn new(threshold: u32, forget_after: Duration) -> Self {
        TaskBreakers {
            threshold: threshold.max(1),
            forget_after,
            by_agent: HashMap::new(),
            held: 0,
            sweep_at: MIN_BREAKERS_SWEEP,
            sweep_by: None,
        }
    }

    /// The number of task breakers held in memory (forgotten ones not swept yet included): for
    /// metrics and diagnostics.
    pub fn len(&self) -> usize {
        self.held
    }

    /// Whether no task breaker is held.
    pub fn is_empty(&self) -> bool {
        self.held == 0
    }

    /// Whether a call of `agent`'s task `task` with this fingerprint may go out at `now`. A
    /// breaker forgotten by `now` lets every call go.
    ///
    /// # Errors
    /// [`CircuitOpen`] with the failure details while the path is open for the task.
    pub fn check(
        &self,
        agent: &str,
        task: &str,
        fingerprint: &RequestFingerprint,
        now: Timestamp,
    ) -> Result<(), CircuitOpen> {
        match self.by_agent.get(agent).and_then(|tasks| tasks.get(task)) {
            Some(breaker) if !breaker.is_stale(now, self.forget_after) => {
                breaker.check(fingerprint)
            }
            _ => Ok(()),
        }
    }

    /// Records a failure of `fingerprint` in `agent`'s task `task` at `now` (see
    /// [`TaskBreaker::record_failure`]); a forgotten breaker starts over. Sweeps first when a
    /// sweep is due. Returns [`CircuitOpen`] only when THIS failure opened the path (it was
    /// closed or forgotten before), so an opening is reported and audited once.
    pub fn record_failure(
        &mut self,
        agent: &str,
        task: &str,
        fingerprint: &RequestFingerprint,
        error_code: &str,
        status: Option<u16>,
        now: Timestamp,
    ) -> Option<CircuitOpen> {
        if self.held >= self.sweep_at || self.sweep_by.is_some_and(|by| now >= by) {
            self.sweep(now);
        }
        if self.sweep_by.is_none() {
            self.sweep_by = Some(self.window_after(now));
        }
        // Names are copied only for a breaker not held yet.
        if !self.by_agent.contains_key(agent) {
            self.by_agent.insert(agent.to_owned(), HashMap::new());
        }
        let tasks = self.by_agent.get_mut(agent)?;
        if !tasks.contains_key(task) {
            tasks.insert(task.to_owned(), TaskBreaker::new(self.threshold));
            self.held += 1;
        }
        let breaker = tasks.get_mut(task)?;
        if breaker.is_stale(now, self.forget_after) {
            *breaker = TaskBreaker::new(self.threshold);
        }
        let was_open = breaker.check(fingerprint).is_err();
        let open = breaker.record_failure(fingerprint, error_code, status, now);
        open.filter(|_| !was_open)
    }

    /// Records a success of `fingerprint` in `agent`'s task `task`: its streak ends, and a
    /// breaker left without streaks (or forgotten by `now`) is dropped.
    pub fn record_success(
        &mut self,
        agent: &str,
        task: &str,
        fingerprint: &RequestFingerprint,
        now: Timestamp,
    ) {
        let Some(tasks) = self.by_agent.get_mut(agent) else {
            return;
        };
        let Some(breaker) = tasks.get_mut(task) else {
            return;
        };
        breaker.record_success(fingerprint);
        if breaker.is_clear() || breaker.is_stale(now, self.forget_after) {
            self.forget_task(agent, task);
        }
    }

    /// Drops the breaker of `agent`'s task `task` (the task was cancelled: it takes no new
    /// actions). Returns whether one was held.
    pub fn forget_task(&mut self, agent: &str, task: &str) -> bool {
        let Some(tasks) = self.by_agent.get_mut(agent) else {
            return false;
        };
        let dropped = tasks.remove(task).is_some();
        if dropped {
            self.held -= 1;
        }
        if tasks.is_empty() {
            self.by_agent.remove(agent);
        }
        dropped
    }

    /// Drops every breaker forgotten by `now` (or left without streaks) and sets the next sweep
    /// points: twice the number still held (at least [`MIN_BREAKERS_SWEEP`]), and one forget
    /// window from `now`. Returns how many were dropped.
    fn sweep(&mut self, now: Timestamp) -> usize {
        let forget_after = self.forget_after;
        let before = self.held;
        self.by_agent.retain(|_, tasks| {
            tasks.retain(|_, breaker| !breaker.is_clear() && !breaker.is_stale(now, forget_after));
            !tasks.is_empty()
        });
        self.held = self.by_agent.values().map(HashMap::len).sum();
        self.sweep_at = (self.held * 2).max(MIN_BREAKERS_SWEEP);
        self.sweep_by = Some(self.window_after(now));
        before - self.held
    }

    /// `now` plus one forget window (saturating).
    fn window_after(&self, now: Timestamp) -> Timestamp {
        SignedDuration::try_from(self.forget_after)
            .ok()
            .and_then(|window| now.checked_add(window).ok())
            .unwrap_or(Timestamp::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WINDOW: Duration = Duration::from_secs(100);

    fn t(seconds: i64) -> Timestamp {
        let t0: Timestamp = "2026-01-01T00:00:00Z".parse().expect("instant");
        t0 + SignedDuration::from_secs(seconds)
    }

    fn fp() -> RequestFingerprint {
        RequestFingerprint::compute("POST", "/v1/transfers", None, &[])
    }

    fn fail(breakers: &mut TaskBreakers, task: &str, at: Timestamp) -> Option<CircuitOpen> {
        breakers.record_failure("agent", task, &fp(), "invalid_iban", Some(422), at)
    }

    #[test]
    fn an_opening_is_reported_once() {
        let mut breakers = TaskBreakers::new(3, WINDOW);
        assert!(fail(&mut breakers, "run", t(0)).is_none());
        assert!(fail(&mut breakers, "run", t(1)).is_none());
        let opened = fail(&mut breakers, "run", t(2)).expect("the third failure opens");
        assert_eq!(opened.failures, 3);
        assert!(
            fail(&mut breakers, "run", t(3)).is_none(),
            "kept open, not opened again"
        );
        assert_eq!(
            breakers
                .check("agent", "run", &fp(), t(3))
                .map_err(|o| o.failures),
            Err(4)
        );
        // Task ids are namespaced per agent.
        assert!(breakers.check("other", "run", &fp(), t(3)).is_ok());
    }

    #[test]
    fn a_breaker_whose_streaks_all_ended_in_success_is_dropped() {
        let mut breakers = TaskBreakers::new(3, WINDOW);
        let other = RequestFingerprint::compute("GET", "/v1/items/{id}", None, &[]);
        fail(&mut breakers, "run", t(0));
        breakers.record_failure("agent", "run", &other, "not_found", Some(404), t(0));
        assert_eq!(breakers.len(), 1);
        breakers.record_success("agent", "run", &fp(), t(1));
        assert_eq!(breakers.len(), 1, "one streak is left");
        breakers.record_success("agent", "run", &other, t(2));
        assert_eq!(breakers.len(), 0);
        assert!(breakers.by_agent.is_empty(), "no empty agent map is left");
        // A success of a task without a breaker changes nothing.
        breakers.record_success("agent", "never-failed", &fp(), t(3));
        assert!(breakers.is_empty());
    }

    #[test]
    fn a_cancelled_task_s_breaker_is_dropped() {
        let mut breakers = TaskBreakers::new(1, WINDOW);
        fail(&mut breakers, "run-1", t(0));
        fail(&mut breakers, "run-2", t(0));
        assert!(breakers.forget_task("agent", "run-1"));
        assert!(!breakers.forget_task("agent", "run-1"));
        assert!(!breakers.forget_task("nobody", "run-2"));
        assert_eq!(breakers.len(), 1);
        assert!(breakers.check("agent", "run-1", &fp(), t(1)).is_ok());
        assert!(breakers.check("agent", "run-2", &fp(), t(1)).is_err());
    }

    #[test]
    fn a_forgotten_breaker_lets_calls_go_and_opens_again_only_after_threshold_failures() {
        let mut breakers = TaskBreakers::new(3, WINDOW);
        for at in 0..3 {
            fail(&mut breakers, "run", t(at));
        }
        // Open until a whole window has passed since the LAST failure.
        assert!(breakers.check("agent", "run", &fp(), t(101)).is_err());
        assert!(breakers.check("agent", "run", &fp(), t(102)).is_ok());
        // The same failure starts a new streak: three more to open.
        assert!(fail(&mut breakers, "run", t(102)).is_none());
        assert!(fail(&mut breakers, "run", t(103)).is_none());
        assert!(breakers.check("agent", "run", &fp(), t(103)).is_ok());
        let opened = fail(&mut breakers, "run", t(104)).expect("opens again");
        assert_eq!(opened.failures, 3);
    }

    #[test]
    fn the_first_failure_a_forget_window_after_the_last_sweep_sweeps() {
        let mut breakers = TaskBreakers::new(3, WINDOW);
        fail(&mut breakers, "old", t(0));
        fail(&mut breakers, "warm", t(60));
        // Nothing is swept before the window has passed, whatever is forgotten by then.
        fail(&mut breakers, "new", t(99));
        assert_eq!(breakers.len(), 3);
        fail(&mut breakers, "new", t(100));
        assert_eq!(breakers.len(), 2, "`old` swept: no failure for 100 s");
        assert!(breakers.by_agent["agent"].contains_key("warm"));
        // The next time sweep is a window after this one.
        fail(&mut breakers, "new", t(199));
        assert_eq!(breakers.len(), 2, "`warm` is forgotten but not swept yet");
        assert!(breakers.check("agent", "warm", &fp(), t(199)).is_ok());
        fail(&mut breakers, "new", t(200));
        assert_eq!(breakers.len(), 1);
    }

    #[test]
    fn the_count_sweep_waits_until_the_number_held_doubled_and_drops_only_forgotten_ones() {
        let mut breakers = TaskBreakers::new(3, WINDOW);
        fail(&mut breakers, "old", t(0));
        fail(&mut breakers, "warm", t(60));
        fail(&mut breakers, "sweeper", t(100)); // the time sweep: `old` goes, `warm` stays
        assert_eq!(breakers.len(), 2);
        // At 170 s `warm` is forgotten; the next time sweep is due at 200 s. New tasks fail
        // until MIN_BREAKERS_SWEEP are held: no sweep yet (amortized, not one per failure).
        let mut n = 0;
        while breakers.len() < MIN_BREAKERS_SWEEP {
            fail(&mut breakers, &format!("fresh-{n}"), t(170));
            n += 1;
        }
        assert_eq!(breakers.len(), MIN_BREAKERS_SWEEP);
        assert!(breakers.by_agent["agent"].contains_key("warm"));
        // The next failure finds the sweep point reached: `warm` is dropped, nothing else.
        fail(&mut breakers, "one-more", t(170));
        assert_eq!(breakers.len(), MIN_BREAKERS_SWEEP);
        assert!(!breakers.by_agent["agent"].contains_key("warm"));
        assert!(breakers.by_agent["agent"].contains_key("sweeper"));
        // Everything left is recent: the next count sweep waits until twice as many are held.
        assert_eq!(breakers.sweep_at, 2 * (MIN_BREAKERS_SWEEP - 1));
    }

    #[test]
    fn a_clock_that_steps_back_keeps_a_breaker() {
        let mut breaker = TaskBreaker::new(1);
        breaker.record_failure(&fp(), "x", None, t(50));
        assert!(!breaker.is_stale(t(0), WINDOW));
        assert!(!breaker.is_stale(t(149), WINDOW));
        assert!(breaker.is_stale(t(150), WINDOW));
        assert!(TaskBreaker::new(1).is_stale(t(0), WINDOW), "never failed");
        // An earlier `now` never moves the last failure back.
        breaker.record_failure(&fp(), "x", None, t(10));
        assert_eq!(breaker.last_failure_at(), Some(t(50)));
    }
}
