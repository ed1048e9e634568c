//! Terminal outcomes of an action, with the context an agent or operator needs (SPEC §5).
//!
//! Why one closed set: an agent that receives "it failed" cannot tell whether to wait, ask, fix
//! the request or give up, and typically retries, which is exactly the layered retry backstop
//! exists to prevent. Every action therefore ends in exactly one [`Outcome`], and every outcome
//! that is not [`Outcome::Succeeded`] carries an [`OutcomeContext`]: was the request sent, was a
//! response received, how many attempts and how much waiting it cost, the last status and signal,
//! the provider's boundary if known, and the [`NextSafe`] options that are safe from here.
//!
//! ```
//! use backstop_core::outcome::{NextSafe, Outcome, OutcomeContext};
//!
//! let at: jiff::Timestamp = "2026-01-01T00:01:30Z".parse().unwrap();
//! let context = OutcomeContext {
//!     sent: true,
//!     response_received: true,
//!     attempts: 2,
//!     total_wait_ms: 4_000,
//!     last_status: Some(429),
//!     last_signal: Some("rate_limited".into()),
//!     boundary: Some(at),
//!     next_safe: vec![NextSafe::WaitUntil { at }, NextSafe::Abort],
//! };
//! assert_eq!(Outcome::BudgetExhausted.to_string(), "budget_exhausted");
//! assert_eq!(
//!     context.next_safe[0].description(),
//!     "wait until 2026-01-01T00:01:30Z, then send again"
//! );
//! ```

use std::fmt;

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

/// The terminal state of an action (SPEC §5). Serialized in `snake_case` (`budget_exhausted`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The intended result happened (and was verified where an outcome receipt is required).
    Succeeded,
    /// The provider rejected the request; it must change (or permissions must) before trying again.
    Rejected,
    /// The provider reported a conflict (HTTP 409): duplicate, version conflict or lock.
    Conflict,
    /// The class budget (attempts or waited time) is spent, or the provider's boundary lies
    /// beyond what the budget still allows.
    BudgetExhausted,
    /// The task deadline has passed, or the provider's boundary lies beyond it.
    DeadlineExhausted,
    /// The provider's quota (billing or daily) is exhausted, or the scope retry quota is empty.
    QuotaExhausted,
    /// The scope's delayed queue is full (`max_delayed_requests`): backpressure to the agent.
    ScopeSaturated,
    /// The per-task circuit breaker for this fingerprint is open (SPEC §7).
    CircuitOpen,
    /// The request may have been acted upon (uncertain); it must be reconciled before any
    /// further side effect.
    ReconciliationRequired,
    /// A human must decide; an escalation case file was opened (SPEC §8).
    Escalated,
    /// The task or action was cancelled; it never sends again.
    Cancelled,
}

impl Outcome {
    /// Every outcome, in SPEC §5 order.
    pub const ALL: [Outcome; 11] = [
        Outcome::Succeeded,
        Outcome::Rejected,
        Outcome::Conflict,
        Outcome::BudgetExhausted,
        Outcome::DeadlineExhausted,
        Outcome::QuotaExhausted,
        Outcome::ScopeSaturated,
        Outcome::CircuitOpen,
        Outcome::ReconciliationRequired,
        Outcome::Escalated,
        Outcome::Cancelled,
    ];

    /// The `snake_case` wire name, identical to the serde form.
    pub const fn as_str(self) -> &'static str {
        match self {
            Outcome::Succeeded => "succeeded",
            Outcome::Rejected => "rejected",
            Outcome::Conflict => "conflict",
            Outcome::BudgetExhausted => "budget_exhausted",
            Outcome::DeadlineExhausted => "deadline_exhausted",
            Outcome::QuotaExhausted => "quota_exhausted",
            Outcome::ScopeSaturated => "scope_saturated",
            Outcome::CircuitOpen => "circuit_open",
            Outcome::ReconciliationRequired => "reconciliation_required",
            Outcome::Escalated => "escalated",
            Outcome::Cancelled => "cancelled",
        }
    }

    /// `true` only for [`Outcome::Succeeded`]; every other outcome must carry an [`OutcomeContext`].
    pub const fn is_success(self) -> bool {
        matches!(self, Outcome::Succeeded)
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What is known about an action when it ends (SPEC §5). Times are RFC 3339 UTC in JSON.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutcomeContext {
    /// Whether any attempt's request bytes left the process.
    pub sent: bool,
    /// Whether any response (even an error status) was received.
    pub response_received: bool,
    /// Attempts made (every attempt that left the process counts).
    pub attempts: u32,
    /// Total time the action waited, in milliseconds: what its wait budget was charged, before
    /// its first attempt (pacing, a scope's boundary) and between attempts.
    pub total_wait_ms: u64,
    /// The last HTTP status received, if any.
    pub last_status: Option<u16>,
    /// The last classified signal (e.g. `rate_limited`, `uncertain`), if any.
    pub last_signal: Option<String>,
    /// The provider's boundary (`retry_not_before`), when it gave a usable one.
    pub boundary: Option<Timestamp>,
    /// The options that are safe from here, most conservative first.
    pub next_safe: Vec<NextSafe>,
}

/// One option that is safe after an outcome (SPEC §5). Serialized as
/// `{"option": "wait_until", "at": "…"}`, `{"option": "query_status"}`, and so on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "option", rename_all = "snake_case")]
pub enum NextSafe {
    /// Sending again is safe no earlier than `at` (the provider's boundary).
    WaitUntil {
        /// The earliest safe instant.
        at: Timestamp,
    },
    /// Ask the provider whether the operation happened (reconciliation lookup).
    QueryStatus,
    /// Send again with the same idempotency key: the provider deduplicates. Serialized as
    /// `retry_same_key`, the name of the escalation decision option with the same effect (SPEC
    /// §8); the former name `resend_same_key` is still read.
    #[serde(rename = "retry_same_key", alias = "resend_same_key")]
    ResendSameKey,
    /// The request itself must change (payload, permissions, route) before it can succeed.
    ChangeRequest,
    /// Give up on this action.
    Abort,
}

impl NextSafe {
    /// A one-line human description of the option and what it implies.
    pub fn description(&self) -> String {
        match self {
            NextSafe::WaitUntil { at } => format!("wait until {at}, then send again"),
            NextSafe::QueryStatus => {
                "query the provider for the operation's status before any further side effect"
                    .to_owned()
            }
            NextSafe::ResendSameKey => {
                "send again with the same idempotency key; the provider deduplicates".to_owned()
            }
            NextSafe::ChangeRequest => {
                "change the request (payload, permissions or route); sending it unchanged will fail again"
                    .to_owned()
            }
            NextSafe::Abort => "abort this action".to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcome_serde_matches_display() {
        for outcome in Outcome::ALL {
            let json = serde_json::to_string(&outcome).expect("serialize");
            assert_eq!(json, format!("\"{outcome}\""));
            let back: Outcome = serde_json::from_str(&json).expect("deserialize");
            assert_eq!(back, outcome);
        }
    }

    #[test]
    fn next_safe_is_tagged() {
        let at: Timestamp = "2026-01-01T00:00:10Z".parse().expect("timestamp");
        let json = serde_json::to_value(NextSafe::WaitUntil { at }).expect("serialize");
        assert_eq!(
            json,
            serde_json::json!({"option": "wait_until", "at": "2026-01-01T00:00:10Z"})
        );
        let json = serde_json::to_value(NextSafe::QueryStatus).expect("serialize");
        assert_eq!(json, serde_json::json!({"option": "query_status"}));
    }

    #[test]
    fn resend_with_the_same_key_is_named_like_the_decision_option() {
        let json = serde_json::to_value(NextSafe::ResendSameKey).expect("serialize");
        assert_eq!(json, serde_json::json!({"option": "retry_same_key"}));
        for name in ["retry_same_key", "resend_same_key"] {
            let back: NextSafe =
                serde_json::from_value(serde_json::json!({ "option": name })).expect("read");
            assert_eq!(back, NextSafe::ResendSameKey);
        }
    }
}
