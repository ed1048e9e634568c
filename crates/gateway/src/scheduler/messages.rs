//! What travels between the scheduler's handles and its task: the requests and signals callers
//! send, and the answers that come back.

use backstop_core::{
    budget::{ActionBudget, RetryCause, RetryToken},
    outcome::Outcome,
    pacing::Priority,
};
use jiff::Timestamp;
use tokio::sync::oneshot;

use super::scopes::ScopeIds;

/// What an action asks the scheduler for before one attempt.
#[derive(Debug, Clone)]
pub struct AcquireRequest {
    /// The task the action belongs to (cancellation is per task).
    pub task_id: String,
    /// The agent whose task it is: task ids are namespaced per agent, so a task is
    /// `(agent, task_id)`.
    pub agent: String,
    /// The task's priority.
    pub priority: Priority,
    /// Full scope names (`provider/scope`) the request falls under.
    pub scopes: Vec<String>,
    /// The action's budget (class attempts and wait, task deadline); charged here and returned.
    pub budget: ActionBudget,
    /// Do not admit before this instant (a planned retry's `at`), if any.
    pub not_before: Option<Timestamp>,
    /// The route template, for logs only (never a concrete path).
    pub route: String,
    /// A reconciliation lookup (SPEC §6): a read of the provider's state for a write already
    /// sent, not an attempt of an action. Its task's cancellation does not hold it back (a
    /// write of a cancelled task that may have been acted on is still reconciled); scopes,
    /// pacing and slots apply as to any request.
    pub reconciliation: bool,
}

/// A scope's retry quota was empty: the retry is refused with `quota_exhausted`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("scope {scope}: retry quota has {available} tokens, a retry costs {cost}")]
pub struct RetryQuotaRefused {
    /// The scope whose quota was empty.
    pub scope: String,
    /// Tokens left.
    pub available: u32,
    /// Tokens the retry would have cost.
    pub cost: u32,
}

/// Retry tokens withdrawn from each scope, to refund when the retry succeeds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RetryTokens(pub Vec<(String, RetryToken)>);

/// A signal about a scope, applied to its record before anything else is decided.
#[derive(Debug, Clone)]
pub enum ScopeSignal {
    /// A 429 (or 403 rate limit) with a known boundary: the whole scope waits until it.
    RateLimited {
        /// The provider's boundary.
        boundary: Timestamp,
        /// Where it came from (`HTTP 429 Retry-After`).
        source: String,
    },
    /// Quota headers: `remaining`, `limit`, `reset_at` (with the 1 s safety margin added by the
    /// caller when `remaining` is 0).
    Quota {
        /// Requests left.
        remaining: Option<u64>,
        /// The window's limit.
        limit: Option<u64>,
        /// When the window resets.
        reset_at: Option<Timestamp>,
        /// Where it came from.
        source: String,
    },
    /// A record read back from the store at start (a restart keeps honouring boundaries).
    Restore {
        /// The stored `next_allowed_at`.
        next_allowed_at: Option<Timestamp>,
        /// The stored `remaining`.
        remaining: Option<u64>,
        /// The stored `limit`.
        limit: Option<u64>,
        /// The stored `reset_at`.
        reset_at: Option<Timestamp>,
        /// The stored source of the last signal.
        source: String,
    },
}

/// The scheduler's answer as it travels back: [`Acquired`](super::Acquired) without the
/// permit's sender (the waiting side owns one already and moves it into the
/// [`Permit`](super::Permit)), the refusal boxed (rare).
#[derive(Debug)]
pub(super) enum Answer {
    Go {
        scopes: ScopeIds,
        granted_at: Timestamp,
        budget: ActionBudget,
    },
    Refused(Box<Refusal>),
    Stopped {
        budget: ActionBudget,
    },
}

#[derive(Debug)]
pub(super) struct Refusal {
    pub(super) outcome: Outcome,
    pub(super) detail: String,
    pub(super) budget: ActionBudget,
    pub(super) boundary: Option<Timestamp>,
    pub(super) not_before: Option<Timestamp>,
}

/// An `acquire` on its way to the scheduler. Dropped unread (the scheduler stopped), it answers
/// [`Acquired::Stopped`](super::Acquired::Stopped) itself, so every `acquire` gets an answer.
#[derive(Debug)]
pub(super) struct PendingAcquire {
    pub(super) ticket: u64,
    pub(super) request: AcquireRequest,
    pub(super) reply: Option<oneshot::Sender<Answer>>,
}

impl Drop for PendingAcquire {
    fn drop(&mut self) {
        if let Some(reply) = self.reply.take() {
            let _ = reply.send(Answer::Stopped {
                budget: self.request.budget,
            });
        }
    }
}

#[derive(Debug)]
pub(super) enum Msg {
    Acquire(PendingAcquire),
    Abandon {
        ticket: u64,
    },
    Release {
        scopes: ScopeIds,
    },
    Signal {
        scopes: Vec<String>,
        signal: ScopeSignal,
        done: oneshot::Sender<()>,
    },
    Withdraw {
        scopes: Vec<String>,
        cause: RetryCause,
        reply: oneshot::Sender<Result<RetryTokens, RetryQuotaRefused>>,
    },
    Deposit {
        scopes: Vec<String>,
        tokens: Option<RetryTokens>,
    },
    CancelTask {
        agent: String,
        task_id: String,
        reply: oneshot::Sender<u64>,
    },
    Shutdown {
        done: oneshot::Sender<()>,
    },
}
