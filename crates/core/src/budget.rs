//! Budgets: hard ceilings on extra work (SPEC §5).
//!
//! Why budgets and not only "max retries": a retry limit per call does not bound the work of many
//! calls. Ten tasks each allowed three retries can send thirty extra calls to one account within
//! seconds, exactly when the provider is already throttling. backstop therefore keeps three
//! ceilings, each with two verbs and no scattered counters:
//!
//! - [`ActionBudget`]: the class budget of one action, attempts *and* waited time
//!   (`max_attempts`, `max_wait_seconds` of its request class), checked together with the task
//!   deadline;
//! - [`RetryQuota`]: the scope retry quota, a token bucket shared by every task in a scope
//!   ([`RetryQuota::withdraw`] before a retry, [`RetryQuota::deposit`] on success), modelled on
//!   the AWS SDKs' "standard" retry mode (capacity 500, retry cost 5, timeout cost 10,
//!   no-retry increment 1);
//! - `max_delayed_requests` / `max_concurrent_requests` per scope, kept by
//!   [`crate::pacing::ScopeRecord`].
//!
//! ```
//! use backstop_core::budget::{RetryCause, RetryQuota, RetryQuotaConfig};
//!
//! let mut quota = RetryQuota::new(RetryQuotaConfig::default());
//! let token = quota.withdraw(RetryCause::Timeout).unwrap();
//! assert_eq!(quota.available(), 490);
//! quota.deposit(backstop_core::budget::Deposit::RetrySucceeded(token));
//! assert_eq!(quota.available(), 500);
//! ```

use std::time::Duration;

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

use crate::outcome::Outcome;

/// The class budget of one request class (SPEC §3 `request_classes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClassBudget {
    /// Attempts allowed in total, the first one included (`max_attempts`, ≥ 1).
    pub max_attempts: u32,
    /// Total time the action may spend waiting between attempts (`max_wait_seconds`).
    pub max_wait: Duration,
}

/// Why an action may not make another attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum BudgetRefusal {
    /// All `max_attempts` are used.
    #[error("all {max_attempts} attempts of the class budget are used")]
    AttemptsUsed {
        /// The class limit.
        max_attempts: u32,
    },
    /// The wait budget is spent.
    #[error("the wait budget of {max_wait_ms} ms is spent")]
    WaitSpent {
        /// The class limit in milliseconds.
        max_wait_ms: u64,
    },
    /// The task deadline has passed.
    #[error("the task deadline {deadline} has passed")]
    DeadlinePassed {
        /// The deadline.
        deadline: Timestamp,
    },
}

impl BudgetRefusal {
    /// The outcome this refusal ends the action with.
    pub const fn outcome(&self) -> Outcome {
        match self {
            BudgetRefusal::AttemptsUsed { .. } | BudgetRefusal::WaitSpent { .. } => {
                Outcome::BudgetExhausted
            }
            BudgetRefusal::DeadlinePassed { .. } => Outcome::DeadlineExhausted,
        }
    }
}

/// What one action has consumed of its class budget, plus its task's deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActionBudget {
    class: ClassBudget,
    deadline: Option<Timestamp>,
    attempts_used: u32,
    waited: Duration,
}

impl ActionBudget {
    /// A fresh budget for an action of `class` in a task with `deadline`.
    pub const fn new(class: ClassBudget, deadline: Option<Timestamp>) -> Self {
        ActionBudget {
            class,
            deadline,
            attempts_used: 0,
            waited: Duration::ZERO,
        }
    }

    /// Attempts made so far.
    pub const fn attempts_used(&self) -> u32 {
        self.attempts_used
    }

    /// Attempts still allowed.
    pub const fn attempts_remaining(&self) -> u32 {
        self.class.max_attempts.saturating_sub(self.attempts_used)
    }

    /// Time waited so far: before the first attempt and between attempts (whatever
    /// [`ActionBudget::withdraw_wait`] was charged).
    pub const fn waited(&self) -> Duration {
        self.waited
    }

    /// Wait the class still allows.
    pub fn wait_remaining(&self) -> Duration {
        self.class.max_wait.saturating_sub(self.waited)
    }

    /// The task deadline.
    pub const fn deadline(&self) -> Option<Timestamp> {
        self.deadline
    }

    /// Whether another attempt may start at `now`: attempts left and deadline not passed.
    ///
    /// # Errors
    /// [`BudgetRefusal::DeadlinePassed`] when `now ≥ deadline`, [`BudgetRefusal::AttemptsUsed`]
    /// when no attempt is left.
    pub fn check(&self, now: Timestamp) -> Result<(), BudgetRefusal> {
        if let Some(deadline) = self.deadline {
            if now >= deadline {
                return Err(BudgetRefusal::DeadlinePassed { deadline });
            }
        }
        if self.attempts_remaining() == 0 {
            return Err(BudgetRefusal::AttemptsUsed {
                max_attempts: self.class.max_attempts,
            });
        }
        Ok(())
    }

    /// Withdraws one attempt, at `now`, after [`ActionBudget::check`] passes.
    ///
    /// # Errors
    /// As [`ActionBudget::check`]; nothing is withdrawn then.
    pub fn withdraw_attempt(&mut self, now: Timestamp) -> Result<(), BudgetRefusal> {
        self.check(now)?;
        self.attempts_used += 1;
        Ok(())
    }

    /// Withdraws `waited` of wait budget (time spent waiting before an attempt: the first, for
    /// pacing or a scope's boundary, or a retry).
    ///
    /// # Errors
    /// [`BudgetRefusal::WaitSpent`] if the wait exceeds what is left; the wait is still recorded
    /// (it happened), so the budget reads as spent afterwards.
    pub fn withdraw_wait(&mut self, waited: Duration) -> Result<(), BudgetRefusal> {
        let over = waited > self.wait_remaining();
        self.waited = self.waited.saturating_add(waited);
        if over {
            Err(BudgetRefusal::WaitSpent {
                max_wait_ms: duration_ms(self.class.max_wait),
            })
        } else {
            Ok(())
        }
    }
}

/// Parameters of the scope retry quota (policy `retry_quota`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetryQuotaConfig {
    /// Tokens the bucket holds when full (default 500).
    pub capacity: u32,
    /// Tokens a retry after an error response costs (default 5).
    pub retry_cost: u32,
    /// Tokens a retry after a timeout or transport error costs (default 10).
    pub timeout_cost: u32,
    /// Tokens a first-try success refunds (default 1).
    pub success_refund: u32,
}

impl Default for RetryQuotaConfig {
    fn default() -> Self {
        RetryQuotaConfig {
            capacity: 500,
            retry_cost: 5,
            timeout_cost: 10,
            success_refund: 1,
        }
    }
}

/// What the retry is recovering from; decides its cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RetryCause {
    /// An error response (429, 5xx…): `retry_cost`.
    ErrorResponse,
    /// A timeout or transport error: `timeout_cost`.
    Timeout,
}

/// Proof of a withdrawal: handed back with [`Deposit::RetrySucceeded`] to refund its cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetryToken {
    /// Tokens withdrawn.
    pub cost: u32,
}

/// A deposit into the retry quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Deposit {
    /// A request succeeded on its first attempt: refunds `success_refund`.
    FirstTrySucceeded,
    /// A retry succeeded: refunds what that retry cost.
    RetrySucceeded(RetryToken),
}

/// The retry quota of a scope is empty: no retry may be sent now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("scope retry quota empty: a retry costs {cost} tokens, {available} are left")]
pub struct RetryQuotaEmpty {
    /// The cost that was asked for.
    pub cost: u32,
    /// Tokens left.
    pub available: u32,
}

impl RetryQuotaEmpty {
    /// The outcome an action refused by the retry quota ends with.
    pub const fn outcome(&self) -> Outcome {
        Outcome::QuotaExhausted
    }
}

/// The scope retry quota: a token bucket of retry tokens shared by all tasks of one scope.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetryQuota {
    config: RetryQuotaConfig,
    available: u32,
}

impl RetryQuota {
    /// A full bucket.
    pub const fn new(config: RetryQuotaConfig) -> Self {
        RetryQuota {
            config,
            available: config.capacity,
        }
    }

    /// Tokens left.
    pub const fn available(&self) -> u32 {
        self.available
    }

    /// Withdraws the cost of one retry.
    ///
    /// # Errors
    /// [`RetryQuotaEmpty`] when fewer tokens than the cost are left; nothing is withdrawn.
    pub fn withdraw(&mut self, cause: RetryCause) -> Result<RetryToken, RetryQuotaEmpty> {
        let cost = match cause {
            RetryCause::ErrorResponse => self.config.retry_cost,
            RetryCause::Timeout => self.config.timeout_cost,
        };
        if cost > self.available {
            return Err(RetryQuotaEmpty {
                cost,
                available: self.available,
            });
        }
        self.available -= cost;
        Ok(RetryToken { cost })
    }

    /// Deposits tokens back, never beyond capacity.
    pub fn deposit(&mut self, deposit: Deposit) {
        let amount = match deposit {
            Deposit::FirstTrySucceeded => self.config.success_refund,
            Deposit::RetrySucceeded(token) => token.cost,
        };
        self.available = self
            .available
            .saturating_add(amount)
            .min(self.config.capacity);
    }
}

fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
