//! The records the store keeps: tasks, actions, attempts, scheduled retries, scope records and
//! escalations (SPEC §1, §6, §8, §12).
//!
//! These are the store's own small types. They deliberately do not depend on `backstop-core`:
//! kinds, outcomes and states are spelled as the SPEC's snake_case words, so the decision crate
//! and the store can evolve separately and meet at these strings.

use jiff::Timestamp;
use sha2::{Digest, Sha256};

use crate::error::StoreError;

/// Declares a closed vocabulary enum with its snake_case spelling (as stored and audited).
macro_rules! vocabulary {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident => $text:literal,)+ }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vmeta])* $variant,)+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant,)+];

            /// The snake_case spelling used in the database and the audit log.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)+
                }
            }

            /// Parses the snake_case spelling.
            ///
            /// # Errors
            /// [`StoreError::Invalid`] naming the type when `text` is not one of its words.
            pub fn parse(text: &str) -> Result<Self, StoreError> {
                match text {
                    $($text => Ok($name::$variant),)+
                    other => Err(StoreError::Invalid {
                        field: stringify!($name),
                        reason: format!("unknown value {other:?}"),
                    }),
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

vocabulary! {
    /// Priority of a task (SPEC §4.3): `interactive` > `normal` > `background`.
    Priority {
        /// A human is waiting.
        Interactive => "interactive",
        /// The default.
        Normal => "normal",
        /// Bulk work, paced behind everything else.
        Background => "background",
    }
}

vocabulary! {
    /// The disposition of one provider response or transport error (SPEC §2.1).
    Disposition {
        /// 2xx.
        Success => "success",
        /// 429, or 403 with GitHub-style limit headers.
        RateLimited => "rate_limited",
        /// Quota or billing exhausted until a reset.
        QuotaExhausted => "quota_exhausted",
        /// 503/529 overloaded.
        Unavailable => "unavailable",
        /// 408/500/502/504.
        Transient => "transient",
        /// The provider never saw the request.
        NotSent => "not_sent",
        /// The provider may have acted.
        Uncertain => "uncertain",
        /// 409.
        Conflict => "conflict",
        /// The request must change.
        Rejected => "rejected",
    }
}

vocabulary! {
    /// The terminal outcome of an action (SPEC §5).
    Outcome {
        /// Done (possibly after reconciliation).
        Succeeded => "succeeded",
        /// The request must change.
        Rejected => "rejected",
        /// 409 from the provider.
        Conflict => "conflict",
        /// Attempts or waited time used up.
        BudgetExhausted => "budget_exhausted",
        /// The task deadline cannot be met.
        DeadlineExhausted => "deadline_exhausted",
        /// The provider's quota is exhausted until a reset.
        QuotaExhausted => "quota_exhausted",
        /// The scope's delayed queue is full.
        ScopeSaturated => "scope_saturated",
        /// The circuit breaker is open for this path.
        CircuitOpen => "circuit_open",
        /// A write may have happened; it must be reconciled first.
        ReconciliationRequired => "reconciliation_required",
        /// A human decides.
        Escalated => "escalated",
        /// The task was cancelled.
        Cancelled => "cancelled",
    }
}

vocabulary! {
    /// Where an action stands.
    ActionState {
        /// Recorded with its key; nothing sent yet.
        Requested => "requested",
        /// An attempt was sent and has no result yet.
        InFlight => "in_flight",
        /// The last attempt finished; the action awaits a decision or its next attempt.
        Attempted => "attempted",
        /// A retry is scheduled.
        Waiting => "waiting",
        /// An operator decided to send again with the same idempotency key after an escalation
        /// (`retry_same_key`): the action waits for its request, held in memory by the gateway or
        /// resubmitted by the agent under the same key, and then sends as the same logical
        /// action. Also a finished write the agent resent under its key when its answer said it
        /// may (`Store::reopen_for_resend`), while that resend takes it over.
        Reopened => "reopened",
        /// Ended with an outcome (see [`Outcome`]).
        Finished => "finished",
    }
}

vocabulary! {
    /// State of one attempt (an attempt receipt).
    AttemptState {
        /// Durably recorded before its bytes left; no result yet.
        Sent => "sent",
        /// A response or transport error was recorded.
        Finished => "finished",
    }
}

vocabulary! {
    /// State of an escalation.
    EscalationState {
        /// Waiting for a human.
        Open => "open",
        /// A human decided.
        Decided => "decided",
    }
}

/// Store-minted id of an action (a SQLite rowid; a `BIGSERIAL` in PostgreSQL).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ActionId(pub i64);

/// Store-minted id of a scheduled retry (the scheduler job id of SPEC §10).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobId(pub i64);

/// Store-minted id of an escalation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EscalationId(pub i64);

impl std::fmt::Display for ActionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// SHA-256 of a request payload, as 64 lowercase hex digits. The payload itself is never stored.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PayloadDigest(String);

impl PayloadDigest {
    /// Digests `payload` (SHA-256, FIPS 180-4).
    pub fn of(payload: &[u8]) -> Self {
        let mut digest = String::with_capacity(64);
        crate::audit::push_lower_hex(&mut digest, &Sha256::digest(payload));
        PayloadDigest(digest)
    }

    /// Accepts an already computed digest.
    ///
    /// # Errors
    /// [`StoreError::Invalid`] unless `hex` is exactly 64 lowercase hex digits.
    pub fn try_new(hex: &str) -> Result<Self, StoreError> {
        if hex.len() == 64
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            Ok(PayloadDigest(hex.to_owned()))
        } else {
            Err(StoreError::Invalid {
                field: "payload_digest",
                reason: format!(
                    "expected 64 lowercase hex digits, got {} characters",
                    hex.len()
                ),
            })
        }
    }

    /// The hex digits.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A route template such as `/v1/transfers/{id}` (SPEC §3: `METHOD /path/{param}`).
///
/// Only templates reach the store and the audit log, never concrete paths with ids or queries.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RouteTemplate(String);

impl RouteTemplate {
    /// Validates a template.
    ///
    /// # Errors
    /// [`StoreError::Invalid`] unless the template starts with `/` and has no query (`?`),
    /// fragment (`#`), whitespace or control characters.
    pub fn try_new(template: &str) -> Result<Self, StoreError> {
        let bad = |reason: &str| StoreError::Invalid {
            field: "route_template",
            reason: format!("{template:?}: {reason}"),
        };
        if !template.starts_with('/') {
            return Err(bad("must start with '/'"));
        }
        if template.contains(['?', '#']) {
            return Err(bad("must not carry a query or fragment"));
        }
        if template
            .chars()
            .any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(bad("must not contain whitespace or control characters"));
        }
        Ok(RouteTemplate(template.to_owned()))
    }

    /// The template text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A new task (run) to open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewTask {
    /// The task id (e.g. from `X-Backstop-Task`).
    pub id: String,
    /// The agent that owns the task.
    pub agent: String,
    /// Its priority.
    pub priority: Priority,
    /// Optional deadline (UTC).
    pub deadline: Option<Timestamp>,
}

/// A task as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskRecord {
    /// The task id.
    pub id: String,
    /// The owning agent.
    pub agent: String,
    /// Its priority.
    pub priority: Priority,
    /// Optional deadline.
    pub deadline: Option<Timestamp>,
    /// When the task was cancelled, if it was.
    pub cancelled_at: Option<Timestamp>,
}

/// A new logical action to record, with its idempotency key, before its first send (SPEC §6).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewAction {
    /// The task the action belongs to (must have been opened by `agent`).
    pub task_id: String,
    /// The agent whose task it is (task ids are namespaced per agent).
    pub agent: String,
    /// Provider name from the policy (e.g. `billing-api`).
    pub provider: String,
    /// HTTP method, upper case.
    pub method: String,
    /// The route template, never a concrete path.
    pub route: RouteTemplate,
    /// Request class name (`read`, `idempotent_write`, `uncertain_write`, or a configured one).
    pub request_class: String,
    /// SHA-256 of the request payload.
    pub payload_digest: PayloadDigest,
    /// SHA-256 (same 64-hex shape) of the concrete target sent: the normalized path and query,
    /// e.g. `/v1/accounts/acct_A/charges?expand=fee`. A key binds it (SPEC §6): the same key
    /// on another target is another request. `None` when not known; then the key is compared
    /// without it, as for actions recorded before schema version 7.
    pub target_digest: Option<PayloadDigest>,
    /// The stable idempotency key (agent-supplied or minted by the gateway) of a write. A read
    /// carries no key: pass an empty string, and nothing is stored (`NULL`) or audited for it;
    /// such an action is never found again by key.
    pub idempotency_key: String,
    /// A client-generated external reference placed in the payload, for reconciliation lookups.
    pub external_reference: Option<String>,
    /// The outcome the agent wants, in its own words (SPEC §8), already sanitized by the
    /// caller (no credentials). Kept for case files built later; never audited.
    pub desired_outcome: Option<String>,
    /// The request's sanitized fingerprint (SPEC §7: method, route template and the route's
    /// configured payload fields), kept for case files built later; never audited.
    pub fingerprint: Option<String>,
    /// A write's request as it is sent, kept from before its first send until the action ends
    /// (SPEC §6), so that restart recovery can finish the write itself; `None` for a read and
    /// for a payload too large to keep. Never audited.
    pub request: Option<KeptRequest>,
}

/// A write's request kept at rest while the write has not ended (SPEC §6: the token is stored
/// WITH the request content before the first send): what restart recovery sends again under
/// the same idempotency key. Credentials are never part of it — the gateway adds the
/// provider's credential when it sends — and it is deleted when the action ends. Never audited.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeptRequest {
    /// HTTP method, upper case.
    pub method: String,
    /// The absolute upstream URL (provider base URL, path and query).
    pub url: String,
    /// The end-to-end headers sent, as (name, value) pairs, without credentials.
    pub headers: Vec<(String, String)>,
    /// The request body, as the agent sent it.
    pub body: Vec<u8>,
}

/// A provider response kept for idempotent replay to the same agent (never audited).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// HTTP status.
    pub status: u16,
    /// Response headers as (name, value) pairs, in order.
    pub headers: Vec<(String, String)>,
    /// Response body bytes.
    pub body: Vec<u8>,
}

/// An action as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActionRecord {
    /// Store-minted id.
    pub id: ActionId,
    /// Owning task.
    pub task_id: String,
    /// Owning agent (the idempotency key is unique per agent).
    pub agent: String,
    /// Provider name.
    pub provider: String,
    /// HTTP method.
    pub method: String,
    /// Route template.
    pub route: String,
    /// Request class name.
    pub request_class: String,
    /// SHA-256 hex of the payload.
    pub payload_digest: String,
    /// The stable idempotency key; empty for a read, which carries none (see [`Self::key`]).
    pub idempotency_key: String,
    /// External reference, if any.
    pub external_reference: Option<String>,
    /// The provider's operation id, once known.
    pub provider_operation_id: Option<String>,
    /// Current state.
    pub state: ActionState,
    /// The outcome once finished.
    pub outcome: Option<Outcome>,
    /// The outcome's context (SPEC §5) as JSON, once finished.
    pub outcome_context: Option<serde_json::Value>,
    /// Response kept for replay, if any.
    pub response: Option<StoredResponse>,
    /// The agent's desired outcome as recorded (see [`NewAction::desired_outcome`]); `None`
    /// when none was given and for actions recorded before schema version 6.
    pub desired_outcome: Option<String>,
    /// The fingerprint as recorded (see [`NewAction::fingerprint`]); `None` for actions
    /// recorded before schema version 6.
    pub fingerprint: Option<String>,
}

impl ActionRecord {
    /// The idempotency key, `None` for an action that carries none (a read).
    pub fn key(&self) -> Option<&str> {
        (!self.idempotency_key.is_empty()).then_some(self.idempotency_key.as_str())
    }
}

/// Result of [`crate::Store::record_action`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// A new action was recorded (and `action_requested` audited).
    New(ActionId),
    /// The agent already used this key for the same request (provider, method, route template
    /// and payload): here is that action (replay it, or join it while it is in flight). Nothing
    /// was written.
    Existing(Box<ActionRecord>),
}

/// One attempt as stored (an attempt receipt).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptRecord {
    /// The action.
    pub action: ActionId,
    /// 1-based attempt number.
    pub n: u32,
    /// Sent or finished.
    pub state: AttemptState,
    /// HTTP status, when a response arrived.
    pub status: Option<u16>,
    /// Disposition, once finished.
    pub disposition: Option<Disposition>,
    /// When the attempt was durably recorded as sent.
    pub started_at: Timestamp,
    /// When its result was recorded.
    pub finished_at: Option<Timestamp>,
    /// The boundary its response normalized to, when one was recorded (schema version 5 on;
    /// `None` for attempts recorded before, and for attempts without a result).
    pub boundary: Option<Boundary>,
    /// The signal headers kept from its response (see [`AttemptResult::signal_headers`]); empty
    /// for a plain success and for attempts recorded before schema version 5.
    pub signal_headers: Vec<(String, String)>,
}

/// The provider's boundary (`retry_not_before`): an instant, or `unknown` (SPEC §1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Boundary {
    /// The provider gave no usable signal.
    Unknown,
    /// The earliest instant a retry may happen.
    At(Timestamp),
}

/// How an action ends, recorded together with an attempt result or on its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finish {
    /// The outcome.
    pub outcome: Outcome,
    /// Its context (SPEC §5: sent?, response?, attempts, total wait, last status and signal,
    /// boundary, `next_safe`) as JSON. Must not contain bodies or credentials.
    pub context: serde_json::Value,
    /// A response to keep for idempotent replay, if any (never audited).
    pub response: Option<StoredResponse>,
}

/// The result of one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptResult {
    /// The action.
    pub action: ActionId,
    /// The attempt number returned by [`crate::Store::mark_attempt_sent`].
    pub attempt: u32,
    /// HTTP status, if a response arrived.
    pub status: Option<u16>,
    /// The classified disposition.
    pub disposition: Disposition,
    /// The boundary read from the response, if any.
    pub boundary: Option<Boundary>,
    /// Where the signal came from (e.g. `HTTP 429 Retry-After`).
    pub source: Option<String>,
    /// The provider's operation id, if returned.
    pub provider_operation_id: Option<String>,
    /// The response's signal headers as `(lower-case name, raw value)` pairs, in the order
    /// received: `Retry-After`, `retry-after-ms`, `Date` and quota headers, bounded in count and
    /// length by the caller (`backstop_core::signal_headers`). Not secret: stored with the
    /// attempt and carried by its `action_result` event. Leave it empty for a plain success
    /// (2xx without a Retry-After), so the hot path of 200s stores nothing more.
    pub signal_headers: Vec<(String, String)>,
    /// End the action in the same transaction.
    pub finish: Option<Finish>,
}

/// A retry claimed by [`crate::Store::claim_due`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DueRetry {
    /// The scheduler job id.
    pub job: JobId,
    /// The action to try again.
    pub action: ActionId,
    /// When it was due.
    pub due_at: Timestamp,
}

/// An attempt that was sent but has no result: after a restart, a write in this state must be
/// reconciled with its original key (SPEC §12).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnfinishedAttempt {
    /// The action.
    pub action: ActionId,
    /// Its attempt number.
    pub attempt: u32,
    /// The request class of the action.
    pub request_class: String,
    /// The original idempotency key; empty for a read, which carries none.
    pub idempotency_key: String,
}

/// A new signal about one scope (SPEC §4.1: written before the retry is scheduled).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScopeUpdate {
    /// Provider name.
    pub provider: String,
    /// Scope name, e.g. `billing-api/account:ops-team`.
    pub scope: String,
    /// New `next_allowed_at`; the stored value only ever moves later (a newer signal cannot
    /// grant an earlier permission than one already recorded).
    pub next_allowed_at: Option<Timestamp>,
    /// Remaining requests in the window, if known.
    pub remaining: Option<u64>,
    /// The window's limit, if known.
    pub limit: Option<u64>,
    /// When the window resets, if known.
    pub reset_at: Option<Timestamp>,
    /// Where the signal came from, e.g. `HTTP 429 Retry-After`.
    pub source: String,
}

/// The shared state of one scope (SPEC §1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScopeRecord {
    /// Provider name.
    pub provider: String,
    /// Scope name.
    pub scope: String,
    /// No attempt in this scope before this instant.
    pub next_allowed_at: Option<Timestamp>,
    /// Remaining requests, if known.
    pub remaining: Option<u64>,
    /// Limit, if known.
    pub limit: Option<u64>,
    /// Reset instant, if known.
    pub reset_at: Option<Timestamp>,
    /// Source of the last signal.
    pub source: String,
}

/// An escalation as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EscalationRecord {
    /// Store-minted id.
    pub id: EscalationId,
    /// The action it is about.
    pub action: ActionId,
    /// The sanitized case file (SPEC §8) as JSON.
    pub case_file: serde_json::Value,
    /// Open or decided.
    pub state: EscalationState,
    /// The decision (e.g. `query_status`, `retry_same_key`, `abort`, `send_new`).
    pub decision: Option<String>,
    /// Who decided.
    pub decided_by: Option<String>,
    /// When it was decided.
    pub decided_at: Option<Timestamp>,
    /// The operator's note on the decision, as given (sanitizing is the caller's job).
    pub note: Option<String>,
}

/// What [`crate::Store::cancel_task`] changed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CancelReport {
    /// Actions that ended with `cancelled`.
    pub actions_cancelled: u64,
    /// Scheduled retries dropped before they woke.
    pub retries_dropped: u64,
    /// Writes of the task left open, not `cancelled`, because an attempt of theirs is
    /// unsettled: the provider may have acted on it, so the caller reconciles them with their
    /// original key (SPEC §6), in id order.
    pub unsettled: Vec<UnsettledWrite>,
}

/// A write that may have been acted on at the provider and that nothing has settled: what a
/// close must reconcile rather than end `cancelled` (SPEC §6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnsettledWrite {
    /// The write.
    pub action: ActionId,
    /// Its latest `uncertain` attempt (sent, no answer known), which no later answer under the
    /// same key settled (see [`unsettled_attempt`]).
    pub attempt: u32,
}

impl Disposition {
    /// Whether a write may have been acted on and nothing has settled it, after one more
    /// attempt ended with this disposition, given whether it was so before (`unsettled`).
    ///
    /// An `uncertain` attempt leaves the write unsettled: the provider may have acted on it.
    /// Only a definite answer to a later attempt under the same key settles it — `success` (the
    /// provider did it, once: a provider that honours the key answers a resend with the first
    /// request's result) or `rejected` (the request as such is refused). A `429`, a `5xx`, a
    /// `409` (a key whose first request is still being processed) or a `not_sent` says nothing
    /// about the earlier attempt: the write stays unsettled, so it is reconciled, never closed
    /// as if nothing had happened (SPEC §6), even when the last attempt's own answer was
    /// definite.
    pub fn leaves_unsettled(self, unsettled: bool) -> bool {
        match self {
            Disposition::Uncertain => true,
            Disposition::Success | Disposition::Rejected => false,
            _ => unsettled,
        }
    }
}

/// The number of the attempt that leaves a write unsettled ([`Disposition::leaves_unsettled`]
/// over its `attempts`, oldest first): its latest `uncertain` one, when no later answer settled
/// it; `None` when nothing is unsettled. An attempt sent without a result counts as
/// `uncertain` (SPEC §12).
pub fn unsettled_attempt(attempts: &[AttemptRecord]) -> Option<u32> {
    attempts.iter().fold(None, |unsettled, a| {
        let disposition = a.disposition.unwrap_or(Disposition::Uncertain);
        if disposition == Disposition::Uncertain {
            Some(a.n)
        } else if disposition.leaves_unsettled(unsettled.is_some()) {
            unsettled
        } else {
            None
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attempts(dispositions: &[Option<Disposition>]) -> Vec<AttemptRecord> {
        let at: Timestamp = "2026-01-01T00:00:00Z".parse().expect("instant");
        dispositions
            .iter()
            .zip(1..)
            .map(|(disposition, n)| AttemptRecord {
                action: ActionId(1),
                n,
                state: if disposition.is_some() {
                    AttemptState::Finished
                } else {
                    AttemptState::Sent
                },
                status: None,
                disposition: *disposition,
                started_at: at,
                finished_at: disposition.map(|_| at),
                boundary: None,
                signal_headers: Vec::new(),
            })
            .collect()
    }

    #[test]
    fn the_unsettled_attempt_is_the_latest_uncertain_one_no_definite_answer_followed() {
        use Disposition::*;
        assert_eq!(unsettled_attempt(&attempts(&[])), None);
        assert_eq!(unsettled_attempt(&attempts(&[Some(Transient)])), None);
        assert_eq!(unsettled_attempt(&attempts(&[Some(Uncertain)])), Some(1));
        // Answers that say nothing of it leave it open, naming the uncertain attempt.
        assert_eq!(
            unsettled_attempt(&attempts(&[
                Some(Uncertain),
                Some(RateLimited),
                Some(Unavailable)
            ])),
            Some(1)
        );
        // Sent without a result counts as uncertain.
        assert_eq!(
            unsettled_attempt(&attempts(&[Some(Transient), None])),
            Some(2)
        );
        // A success or a rejection settles it, until the next uncertain one.
        assert_eq!(
            unsettled_attempt(&attempts(&[Some(Uncertain), Some(Rejected)])),
            None
        );
        assert_eq!(
            unsettled_attempt(&attempts(&[
                Some(Uncertain),
                Some(Success),
                Some(Uncertain),
                Some(Conflict)
            ])),
            Some(3)
        );
    }
}
