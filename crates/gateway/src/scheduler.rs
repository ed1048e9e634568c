//! The scheduler: ONE owner of all scope state that decides when each attempt may leave.
//!
//! Why one owner: a 429 on one action must slow down every action of its scope (SPEC §4.1), and
//! no two workers may both believe the next slot is theirs. If scope records, GCRA pacers,
//! concurrency slots and delayed counts lived behind many locks, "update the record, then
//! schedule the retry" would race with other workers reading the old record. Here they are one
//! state behind one mutex, driven by one tokio task; actions talk to the task through messages
//! and it answers in arrival order, so every decision sees every earlier signal.
//!
//! Decided in place when nobody waits ahead: most actions find their scopes open, and a message
//! to the task and an answer back cost two task wakes per request (≈ 7,000 instructions of
//! ≈ 101,000 on a proxied read, see BENCHMARKS.md). So [`SchedulerHandle::acquire`] first tries
//! the lock itself and, only when nothing could be decided before it — no `acquire` is on its
//! way to the task (an in-transit count taken before each send), no action is ready, due or
//! waiting for a concurrency slot, the action is not planned for later and its task is not
//! cancelled — runs the very dispatch check the task runs. It keeps only a `Go`, which charges
//! exactly what the task's `Go` charges; any other answer charged nothing and the request goes
//! to the task unchanged, where it queues behind everything that arrived before it. The lock is
//! only tried, never waited for: while the task holds it (a wave being released), callers send
//! messages as before. A signal is applied by the task under the same lock before
//! [`SchedulerHandle::signal`] returns, so an admission after it sees it. A [`Permit`] returns
//! its slots in place when no action waits for a slot (nobody to wake), otherwise through the
//! task, which re-examines the waiting actions; a first-try refund is deposited in place too.
//! What the task would admit at once, this admits at once: a newcomer is not let past any
//! action the task would have examined before it.
//!
//! How: an action asks for permission with [`SchedulerHandle::acquire`]. The scheduler runs the
//! core's dispatch check ([`backstop_core::pacing::admit`]) in SPEC §4.1 order — cancellation and
//! deadline, every scope's `next_allowed_at`, pacing (headroom × published rate, interactive
//! reserve), concurrency slots — and answers with a [`Permit`] (the slots come back when the
//! permit drops), a refusal with its outcome, or nothing yet: the action then waits in the
//! delayed queue, counted against each scope's `max_delayed_requests` (past it:
//! `scope_saturated` at once). The task sleeps with one `sleep_until` for the earliest wake; an
//! action waiting for a concurrency slot has no instant and is woken when a slot is released.
//! Nothing busy-loops and no worker is held while waiting.
//!
//! Held cheaply, released in batches: a 429 storm parks whole scopes, so the delayed queue must
//! hold 10^6 actions and release a wave of them that comes due at one instant without walking
//! the queue per action. Each waiting action is one compact entry in a slab (task, agent and
//! route names interned and shared, scopes as table indices); the wake queue is one ordered map
//! keyed by (wake instant, priority, arrival) pointing at slab slots, so everything due is taken
//! off its front in one pass, ordered by priority then arrival, and answered without moving the
//! entry. A ticket index finds an entry when its client goes away.
//!
//! Order among waiting actions: `interactive` > `normal` > `background`, then arrival order.
//! Actions held back by a scope's `next_allowed_at` wake at that boundary plus a jitter drawn
//! from the core's backoff spread (`min(cap(1), boundary_spread)`), so the work released by one
//! boundary does not arrive as one burst (SPEC §4.2); the jitter is trimmed to the deadline and
//! the wait budget, never below the boundary. The random draws come from a SplitMix64 generator
//! seeded from the engine's `seed`, so tests are deterministic.
//!
//! Time waited in the queue is charged to the action's wait budget when it is re-examined
//! (SPEC §5: budgets count all waited time); the budget travels with the request and comes back
//! with the answer.
//!
//! The scope retry quota ([`RetryQuota`], SPEC §5) is scope state too: retries withdraw from it
//! here, first-try successes deposit the refund.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    future::Future,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use backstop_core::{
    backoff::BackoffConfig,
    budget::{
        ActionBudget, ClassBudget, Deposit, RetryCause, RetryQuota, RetryQuotaConfig, RetryToken,
    },
    clock::Clock,
    outcome::Outcome,
    pacing::{
        admit, Admission, AdmitRequest, Pacer, Priority, ScopeRecord, ScopeState, WaitReason,
    },
    policy::Policy,
};
use jiff::{SignedDuration, Timestamp};
use prometheus_client::metrics::gauge::Gauge;
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};

use crate::{clock::TokioClock, metrics::Metrics};

/// One scope as `GET /v1/scopes` shows it: the seed's scope record shape (`provider`, `scope`,
/// `request_class`, `next_allowed_at`, `remaining`, `reset_after_seconds`, `source`) plus the
/// live `in_flight` and `delayed` counts. Times are RFC 3339 UTC.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ScopeView {
    /// Provider name (e.g. `billing-api`).
    pub provider: String,
    /// Scope name within the provider (e.g. `account:ops-team`).
    pub scope: String,
    /// The request class the record is about; `None`: scope records here cover every class.
    pub request_class: Option<String>,
    /// No attempt of this scope leaves before this instant.
    pub next_allowed_at: Option<Timestamp>,
    /// Requests the provider says are left in the current window; `None` when unknown, also
    /// once the window it was reported for has ended (its reset, or for a `0` the boundary the
    /// scope waited for, has passed).
    pub remaining: Option<u64>,
    /// Seconds until the provider's window resets (rounded up), when a future reset is known.
    pub reset_after_seconds: Option<u64>,
    /// Where the last signal came from (e.g. `HTTP 429 Retry-After`).
    pub source: Option<String>,
    /// Attempts of this scope in flight.
    pub in_flight: u32,
    /// Actions of this scope waiting in the delayed queue.
    pub delayed: u32,
}

/// A small deterministic generator (SplitMix64, Steele/Lea/Flood 2014) for jitter draws.
#[derive(Debug, Clone)]
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub(crate) const fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform sample in `[0, 1)`.
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

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

/// The scheduler's answer to [`SchedulerHandle::acquire`].
#[derive(Debug)]
pub enum Acquired {
    /// Send now. One attempt, the pacing emissions and one slot per scope were charged; the
    /// slots come back when the permit drops.
    Go {
        /// Holds the concurrency slots.
        permit: Permit,
        /// The budget after the attempt and the waited time were charged.
        budget: ActionBudget,
    },
    /// Do not send; the action ends with `outcome`.
    Refused {
        /// The terminal outcome (`cancelled`, `budget_exhausted`, `deadline_exhausted`,
        /// `scope_saturated`).
        outcome: Outcome,
        /// One line on why.
        detail: String,
        /// The budget as charged so far.
        budget: ActionBudget,
        /// The latest future `next_allowed_at` of the action's scopes, when one held it back.
        boundary: Option<Timestamp>,
        /// The instant the dispatch check would have waited for — a scope's `next_allowed_at`
        /// or its local pacing — when the action was refused because that wait lies beyond its
        /// deadline or remaining wait budget (see [`Admission::Refuse`]); `None` otherwise.
        not_before: Option<Timestamp>,
    },
    /// The scheduler has stopped (shutdown): no attempt was charged, the action stays as stored.
    Stopped {
        /// The budget as it was, with the time waited in the delayed queue charged.
        budget: ActionBudget,
    },
}

/// Concurrency slots of one admitted attempt; dropping it returns them to their scopes.
#[derive(Debug)]
pub struct Permit {
    scopes: ScopeIds,
    granted_at: Timestamp,
    tx: mpsc::UnboundedSender<Msg>,
    shared: Arc<Shared>,
}

impl Permit {
    /// When the scheduler admitted the attempt: its clock as it sent `Go`. The gap between this
    /// and the moment the action sees the answer is the runtime's wake-up of the waiting task,
    /// not waiting in the delayed queue.
    pub fn granted_at(&self) -> Timestamp {
        self.granted_at
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let scopes = std::mem::take(&mut self.scopes);
        // Returned in place when the state is free and no action waits for a slot (nobody to
        // wake); otherwise the task returns the slots and re-examines the waiting actions.
        if let Ok(mut state) = self.shared.state.try_lock() {
            if state.slot_waiters.is_empty() {
                state.release(&scopes);
                return;
            }
        }
        // A stopped scheduler has no slots to return.
        let _ = self.tx.send(Msg::Release { scopes });
    }
}

/// Index of a scope in the scheduler's table.
type ScopeId = u32;

/// The scopes of one action as indices into the scheduler's table, distinct and in name order
/// (the order the dispatch check sees them in). One scope, the common case, needs no allocation.
#[derive(Debug, Clone)]
enum ScopeIds {
    One(ScopeId),
    Many(Box<[ScopeId]>),
}

impl Default for ScopeIds {
    fn default() -> Self {
        ScopeIds::Many(Box::default())
    }
}

impl ScopeIds {
    fn as_slice(&self) -> &[ScopeId] {
        match self {
            ScopeIds::One(id) => std::slice::from_ref(id),
            ScopeIds::Many(ids) => ids,
        }
    }
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

/// The scheduler's answer as it travels back: [`Acquired`] without the permit's sender (the
/// waiting side owns one already and moves it into the [`Permit`]), the refusal boxed (rare).
#[derive(Debug)]
enum Answer {
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
struct Refusal {
    outcome: Outcome,
    detail: String,
    budget: ActionBudget,
    boundary: Option<Timestamp>,
    not_before: Option<Timestamp>,
}

/// An `acquire` on its way to the scheduler. Dropped unread (the scheduler stopped), it answers
/// [`Acquired::Stopped`] itself, so every `acquire` gets an answer.
#[derive(Debug)]
struct PendingAcquire {
    ticket: u64,
    request: AcquireRequest,
    reply: Option<oneshot::Sender<Answer>>,
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
enum Msg {
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

/// A cloneable handle to the scheduler task.
#[derive(Debug, Clone)]
pub struct SchedulerHandle {
    tx: mpsc::UnboundedSender<Msg>,
    shared: Arc<Shared>,
    views: Arc<Mutex<Arc<Vec<ScopeView>>>>,
    next_ticket: Arc<AtomicU64>,
}

/// The one scope state, shared by the scheduler task and the callers that decide in place.
struct Shared {
    state: Mutex<State>,
    /// `Acquire` messages sent and not yet taken into the state. While one is on its way, no
    /// newcomer is admitted in place: it would be decided before an earlier arrival.
    in_transit: AtomicU64,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("in_transit", &self.in_transit.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Shared {
    /// The state, waiting for the lock (a panic while it was held left it consistent: every
    /// step under the lock is a plain update of counters and queues).
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// How an `acquire` starts: decided in place, or waiting for the task's answer. The in-place
/// answer is boxed: the future of every WAITING action holds a `Start`, and 10^6 of them must
/// fit in ≤ 1 KiB each (an unboxed `Acquired` made the future 176 B instead of 48 B).
enum Start {
    Now(Box<Acquired>),
    Waiting {
        answer: oneshot::Receiver<Answer>,
        guard: AbandonGuard,
        shared: Arc<Shared>,
    },
    /// Answered; polled again, the future answers `Stopped` with nothing left to spend.
    Done,
}

/// The future [`SchedulerHandle::acquire`] returns: a plain struct rather than an `async`
/// block, so that a waiting action holds only what it waits with (the answer's receiver, the
/// abandon guard, the shared counters), not a second copy of it in the block's state.
struct AcquireFuture {
    start: Start,
}

impl Future for AcquireFuture {
    type Output = Acquired;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Acquired> {
        use std::task::Poll;
        let (answer, guard, shared) = match &mut self.start {
            Start::Waiting {
                answer,
                guard,
                shared,
            } => (answer, guard, shared),
            Start::Now(_) | Start::Done => {
                return match std::mem::replace(&mut self.start, Start::Done) {
                    Start::Now(acquired) => Poll::Ready(*acquired),
                    _ => Poll::Ready(Acquired::Stopped {
                        budget: spent_budget(),
                    }),
                };
            }
        };
        let answer = match std::pin::Pin::new(answer).poll(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(answer) => answer,
        };
        guard.disarm();
        Poll::Ready(match answer {
            Ok(Answer::Go {
                scopes,
                granted_at,
                budget,
            }) => match guard.tx.take() {
                Some(tx) => Acquired::Go {
                    permit: Permit {
                        scopes,
                        granted_at,
                        tx,
                        shared: shared.clone(),
                    },
                    budget,
                },
                // Taken only here, once.
                None => Acquired::Stopped { budget },
            },
            Ok(Answer::Refused(refusal)) => Acquired::Refused {
                outcome: refusal.outcome,
                detail: refusal.detail,
                budget: refusal.budget,
                boundary: refusal.boundary,
                not_before: refusal.not_before,
            },
            Ok(Answer::Stopped { budget }) => Acquired::Stopped { budget },
            // Every reply sender answers before it drops (`PendingAcquire` and `Waiter`
            // answer `Stopped` when the scheduler goes away), so this does not happen; were
            // it to, the action is stopped with no budget left to spend.
            Err(_) => Acquired::Stopped {
                budget: spent_budget(),
            },
        })
    }
}

/// A budget with nothing left: zero attempts, no wait.
fn spent_budget() -> ActionBudget {
    ActionBudget::new(
        ClassBudget {
            max_attempts: 0,
            max_wait: Duration::ZERO,
        },
        None,
    )
}

/// Sends `Abandon` if an `acquire` future is dropped before its answer arrived.
/// Its sender moves into the [`Permit`] once the answer is `Go`.
struct AbandonGuard {
    ticket: u64,
    tx: Option<mpsc::UnboundedSender<Msg>>,
    armed: bool,
}

impl AbandonGuard {
    /// The answer arrived: nothing to abandon.
    fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for AbandonGuard {
    fn drop(&mut self) {
        if let (true, Some(tx)) = (self.armed, &self.tx) {
            let _ = tx.send(Msg::Abandon {
                ticket: self.ticket,
            });
        }
    }
}

impl SchedulerHandle {
    /// Spawns the scheduler task with one record (and pacer, when the scope publishes a limit)
    /// per policy scope. Must be called inside a tokio runtime. `seed` seeds the jitter draws.
    pub fn spawn(policy: &Policy, clock: TokioClock, metrics: Arc<Metrics>, seed: u64) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let views = Arc::new(Mutex::new(Arc::new(Vec::new())));
        let mut state = State {
            scopes: Vec::new(),
            scope_ids: BTreeMap::new(),
            tasks: Interner::default(),
            routes: Interner::default(),
            slots: Slab::default(),
            tickets: BTreeMap::new(),
            timers: BTreeMap::new(),
            ready: Vec::new(),
            slot_waiters: Vec::new(),
            batch: Vec::new(),
            cancelled_tasks: HashMap::new(),
            rng: SplitMix64::new(seed),
            clock,
            metrics,
            backoff: policy.backoff.config(),
            default_max_concurrent: policy.shared_scope.max_concurrent_requests,
            default_max_delayed: policy.shared_scope.max_delayed_requests,
            retry_quota: policy.retry_quota,
            tx: tx.clone(),
            views: views.clone(),
            stopped: false,
        };
        for (provider_name, provider) in &policy.providers {
            for scope in provider.scopes.values() {
                state.add_scope(
                    provider_name.clone(),
                    ScopeState {
                        record: scope.record(),
                        pacer: scope.pacer_config().map(Pacer::new),
                    },
                );
            }
        }
        state.publish();
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
            in_transit: AtomicU64::new(0),
        });
        tokio::spawn(run(shared.clone(), rx));
        SchedulerHandle {
            tx,
            shared,
            views,
            next_ticket: Arc::new(AtomicU64::new(1)),
        }
    }

    /// Decides an action in place when it can go at once without passing anyone: the state is
    /// free, no `acquire` is on its way to the task, nothing is planned for later, and no action
    /// waits that the task would examine first (none ready, none due, none waiting for a
    /// slot). Then it runs the same dispatch check the task runs and, on `Go`, charges the same
    /// things. Anything else goes to the task unchanged (the check charged nothing).
    fn admit_now(&self, request: &AcquireRequest) -> Option<Acquired> {
        let Ok(mut guard) = self.shared.state.try_lock() else {
            return None;
        };
        let state = &mut *guard;
        if state.stopped {
            return Some(Acquired::Stopped {
                budget: request.budget,
            });
        }
        if self.shared.in_transit.load(Ordering::SeqCst) != 0 || !state.ready.is_empty() {
            return None;
        }
        let now = state.clock.now();
        let due = state
            .timers
            .first_key_value()
            .is_some_and(|((at, _), _)| *at <= now);
        if due
            || !state.slot_waiters.is_empty()
            || request.not_before.is_some_and(|at| at > now)
            || (!request.reconciliation
                && is_cancelled(&state.cancelled_tasks, &request.agent, &request.task_id))
        {
            return None;
        }
        let scopes = state.scope_set(&request.scopes);
        let mut budget = request.budget;
        let admitted = AdmitRequest {
            cancelled: false,
            priority: request.priority,
        };
        if admit_scopes(&mut state.scopes, &scopes, admitted, &mut budget, now) != Admission::Go {
            return None;
        }
        for &id in scopes.as_slice() {
            state.scopes[id as usize].sync_gauges();
        }
        tracing::debug!(
            task = %request.task_id,
            route = %request.route,
            priority = ?request.priority,
            attempt = budget.attempts_used(),
            "dispatch: attempt admitted at once"
        );
        drop(guard);
        Some(Acquired::Go {
            permit: Permit {
                scopes,
                granted_at: now,
                tx: self.tx.clone(),
                shared: self.shared.clone(),
            },
            budget,
        })
    }

    /// Asks for permission to send one attempt (SPEC §4.1). The request is handed to the
    /// scheduler when `acquire` is called; the returned future resolves when the action may go,
    /// is refused, or the scheduler stopped. Dropping the future while it waits takes the action
    /// out of the delayed queue and frees its delayed count (client disconnect).
    ///
    /// The future holds only the answer's receiving end and the budget (for
    /// [`Acquired::Stopped`]), not the request: a task parked on it stays small while the
    /// scheduler holds the action.
    pub fn acquire(
        &self,
        request: AcquireRequest,
    ) -> impl Future<Output = Acquired> + Send + 'static {
        let start = match self.admit_now(&request) {
            Some(acquired) => Start::Now(Box::new(acquired)),
            None => {
                let ticket = self.next_ticket.fetch_add(1, Ordering::Relaxed);
                let (reply, answer) = oneshot::channel();
                let pending = PendingAcquire {
                    ticket,
                    request,
                    reply: Some(reply),
                };
                // Counted before it is sent, so no newcomer is admitted in place ahead of it.
                self.shared.in_transit.fetch_add(1, Ordering::SeqCst);
                // Refused, the message comes back and answers `Stopped` as it drops.
                let sent = self.tx.send(Msg::Acquire(pending)).is_ok();
                if !sent {
                    self.shared.in_transit.fetch_sub(1, Ordering::SeqCst);
                }
                Start::Waiting {
                    answer,
                    guard: AbandonGuard {
                        ticket,
                        tx: Some(self.tx.clone()),
                        armed: sent,
                    },
                    shared: self.shared.clone(),
                }
            }
        };
        AcquireFuture { start }
    }

    /// Applies a provider signal to every scope in `scopes` and returns once the scheduler's
    /// records hold it, so that any retry scheduled afterwards already sees it (SPEC §4.1).
    pub async fn signal(&self, scopes: &[String], signal: ScopeSignal) {
        let (done, applied) = oneshot::channel();
        if self
            .tx
            .send(Msg::Signal {
                scopes: scopes.to_vec(),
                signal,
                done,
            })
            .is_ok()
        {
            let _ = applied.await;
        }
    }

    /// Withdraws the cost of one retry from the retry quota of every scope (SPEC §5).
    ///
    /// # Errors
    /// [`RetryQuotaRefused`] naming the first scope whose quota is empty; nothing is withdrawn
    /// then (earlier withdrawals are refunded).
    pub async fn withdraw_retry(
        &self,
        scopes: &[String],
        cause: RetryCause,
    ) -> Result<RetryTokens, RetryQuotaRefused> {
        let (reply, answer) = oneshot::channel();
        let sent = self.tx.send(Msg::Withdraw {
            scopes: scopes.to_vec(),
            cause,
            reply,
        });
        if sent.is_err() {
            return Ok(RetryTokens::default());
        }
        answer.await.unwrap_or_else(|_| Ok(RetryTokens::default()))
    }

    /// Deposits into the retry quotas: `None` for a first-try success (the refund), or the
    /// tokens of a retry that succeeded.
    pub fn deposit(&self, scopes: &[String], tokens: Option<RetryTokens>) {
        // Quota arithmetic needs no ordering with other messages: done in place when the state
        // is free.
        if let Ok(mut state) = self.shared.state.try_lock() {
            state.deposit(scopes, tokens);
            return;
        }
        let _ = self.tx.send(Msg::Deposit {
            scopes: scopes.to_vec(),
            tokens,
        });
    }

    /// Marks a task cancelled: its delayed actions are answered `cancelled` before they wake and
    /// their delayed counts are freed; it never gets a permit again. Returns how many waiting
    /// actions were dropped.
    pub async fn cancel_task(&self, agent: &str, task_id: &str) -> u64 {
        let (reply, answer) = oneshot::channel();
        let sent = self.tx.send(Msg::CancelTask {
            agent: agent.to_owned(),
            task_id: task_id.to_owned(),
            reply,
        });
        if sent.is_err() {
            return 0;
        }
        answer.await.unwrap_or(0)
    }

    /// The scope records: current when the state is free, else as the task last published them.
    pub fn scopes(&self) -> Vec<ScopeView> {
        // Current when the state is free (admissions decided in place are not published by the
        // task); otherwise as the task last published them.
        if let Ok(mut state) = self.shared.state.try_lock() {
            state.publish();
        }
        let views = self
            .views
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        views.as_ref().clone()
    }

    /// Stops the scheduler: waiting actions are answered [`Acquired::Stopped`].
    pub async fn shutdown(&self) {
        let (done, stopped) = oneshot::channel();
        if self.tx.send(Msg::Shutdown { done }).is_ok() {
            let _ = stopped.await;
        }
    }
}

struct ScopeEntry {
    provider: String,
    state: ScopeState,
    quota: RetryQuota,
    /// `(delayed, in_flight)` as last set on the gauges.
    published: Option<(u32, u32)>,
    /// The scope's `delayed` and `in_flight` gauges.
    delayed_gauge: Gauge,
    in_flight_gauge: Gauge,
}

impl ScopeEntry {
    /// Sets the gauges whose count moved since they were last set.
    fn sync_gauges(&mut self) {
        let record = &self.state.record;
        let counts = (record.delayed, record.in_flight);
        if self.published == Some(counts) {
            return;
        }
        if self
            .published
            .is_none_or(|(delayed, _)| delayed != counts.0)
        {
            self.delayed_gauge.set(i64::from(counts.0));
        }
        if self
            .published
            .is_none_or(|(_, in_flight)| in_flight != counts.1)
        {
            self.in_flight_gauge.set(i64::from(counts.1));
        }
        self.published = Some(counts);
    }
}

/// One waiting action, held in a slab slot until it is answered.
struct Waiter {
    /// The handle's ticket: the key of `State::tickets`, and the arrival order (tickets are
    /// handed out in the order actions call `acquire`).
    ticket: u64,
    /// `(agent, task id)`, shared by the task's waiting actions.
    task: Arc<TaskKey>,
    route: Arc<str>,
    scopes: ScopeIds,
    budget: ActionBudget,
    /// Waited time up to here is charged.
    since: Timestamp,
    /// The wake instant, while `timed`.
    wake: Timestamp,
    /// Taken when the answer is sent; a waiter dropped unanswered answers `Stopped`.
    reply: Option<oneshot::Sender<Answer>>,
    priority: Priority,
    /// Not examined yet since it arrived ready (the gap until the first look is processing,
    /// not waiting: a class with `max_wait_seconds: 0` must still get its first attempt).
    fresh: bool,
    /// Counted in its scopes' delayed queues.
    delayed: bool,
    /// Listed in `State::ready` for the next pump.
    queued: bool,
    /// In the wake queue under `(wake, order)`.
    timed: bool,
    /// A reconciliation lookup, which its task's cancellation does not hold back.
    reconciliation: bool,
}

/// A task: `(agent, task id)`.
type TaskKey = (String, String);

impl Drop for Waiter {
    fn drop(&mut self) {
        if let Some(reply) = self.reply.take() {
            let _ = reply.send(Answer::Stopped {
                budget: self.budget,
            });
        }
    }
}

impl Waiter {
    /// Examination order: higher priority first, then arrival.
    fn order(&self) -> u64 {
        order_key(self.priority, self.ticket)
    }
}

/// Packs priority (highest first) and arrival into one ascending key; `seq` stays below 2^62.
fn order_key(priority: Priority, seq: u64) -> u64 {
    let rank: u64 = match priority {
        Priority::Interactive => 0,
        Priority::Normal => 1,
        Priority::Background => 2,
    };
    (rank << 62) | (seq & ((1 << 62) - 1))
}

/// Interned names are swept (those no waiter holds any more are dropped) when the table grows
/// past twice its size after the last sweep, and never below this.
const MIN_NAMES_SWEEP: usize = 1024;

/// Shared copies of names held by waiting actions (many actions name one task and one route).
struct Interner<T: ?Sized> {
    set: HashSet<Arc<T>>,
    sweep_at: usize,
}

impl<T: ?Sized> Default for Interner<T> {
    fn default() -> Self {
        Interner {
            set: HashSet::new(),
            sweep_at: MIN_NAMES_SWEEP,
        }
    }
}

impl<T: ?Sized + Eq + std::hash::Hash> Interner<T> {
    fn get(&self, key: &T) -> Option<Arc<T>> {
        self.set.get(key).cloned()
    }

    /// Adds a copy not held yet; first drops the copies no one else holds when the table has
    /// doubled since the last sweep (so the sweeps cost O(1) per insert).
    fn insert(&mut self, shared: Arc<T>) -> Arc<T> {
        if self.set.len() >= self.sweep_at {
            self.set.retain(|held| Arc::strong_count(held) > 1);
            self.sweep_at = (self.set.len() * 2).max(MIN_NAMES_SWEEP);
        }
        self.set.insert(shared.clone());
        shared
    }
}

/// Waiters per slab chunk: the slab grows by whole chunks, never by copying.
const SLAB_CHUNK: usize = 1024;

/// Waiting actions by slot number; vacant slots are reused first.
#[derive(Default)]
struct Slab {
    chunks: Vec<Vec<Option<Waiter>>>,
    free: Vec<u32>,
}

impl Slab {
    fn get_mut(&mut self, slot: u32) -> Option<&mut Waiter> {
        let slot = slot as usize;
        self.chunks
            .get_mut(slot / SLAB_CHUNK)?
            .get_mut(slot % SLAB_CHUNK)?
            .as_mut()
    }

    fn insert(&mut self, waiter: Waiter) -> u32 {
        if let Some(slot) = self.free.pop() {
            let index = slot as usize;
            if let Some(entry) = self
                .chunks
                .get_mut(index / SLAB_CHUNK)
                .and_then(|chunk| chunk.get_mut(index % SLAB_CHUNK))
            {
                *entry = Some(waiter);
                return slot;
            }
        }
        let full = self.chunks.len() * SLAB_CHUNK;
        let slot = match self.chunks.last_mut() {
            Some(chunk) if chunk.len() < SLAB_CHUNK => {
                let slot = full - SLAB_CHUNK + chunk.len();
                chunk.push(Some(waiter));
                slot
            }
            _ => {
                let mut chunk = Vec::with_capacity(SLAB_CHUNK);
                chunk.push(Some(waiter));
                self.chunks.push(chunk);
                full
            }
        };
        u32::try_from(slot).unwrap_or(u32::MAX)
    }

    fn take(&mut self, slot: u32) -> Option<Waiter> {
        let index = slot as usize;
        let waiter = self
            .chunks
            .get_mut(index / SLAB_CHUNK)?
            .get_mut(index % SLAB_CHUNK)?
            .take()?;
        self.free.push(slot);
        Some(waiter)
    }

    /// Drops the waiter in `slot` where it lies.
    fn vacate(&mut self, slot: u32) {
        let index = slot as usize;
        if let Some(entry) = self
            .chunks
            .get_mut(index / SLAB_CHUNK)
            .and_then(|chunk| chunk.get_mut(index % SLAB_CHUNK))
        {
            if entry.take().is_some() {
                self.free.push(slot);
            }
        }
    }

    fn iter(&self) -> impl Iterator<Item = (u32, &Waiter)> {
        self.chunks
            .iter()
            .flatten()
            .enumerate()
            .filter_map(|(slot, w)| w.as_ref().map(|w| (slot as u32, w)))
    }
}

struct State {
    /// Scope table; a [`ScopeId`] indexes it.
    scopes: Vec<ScopeEntry>,
    /// Scope names to ids, in name order (the order views are published in).
    scope_ids: BTreeMap<String, ScopeId>,
    /// Tasks and routes, shared by the waiters that name them.
    tasks: Interner<TaskKey>,
    routes: Interner<str>,
    /// The waiting actions.
    slots: Slab,
    /// Ticket to slab slot, for `Abandon`. Ordered: tickets arrive and mostly leave in order,
    /// so inserts and removals touch the same few nodes.
    tickets: BTreeMap<u64, u32>,
    /// The wake queue: (wake, order) to slab slot; every entry is live.
    timers: BTreeMap<(Timestamp, u64), u32>,
    /// Slots to examine in the next pump (entries whose waiter is not `queued` are stale).
    ready: Vec<u32>,
    /// Slots waiting for a concurrency slot (stale entries are skipped when drained).
    slot_waiters: Vec<u32>,
    /// Reused buffer of one pump: (order, slot).
    batch: Vec<(u64, u32)>,
    /// Cancelled tasks, kept while the process runs (the SQLite store keeps its own list too).
    /// An entry is NOT done with once no waiter of its task is queued: an action of the task
    /// that was in flight when it was cancelled (or between its store record and its first
    /// `acquire`) still comes here for its next attempt, and for a read nothing else refuses it —
    /// a read's attempt is recorded without waiting, and a read's retry the store refuses to
    /// schedule is retried from memory. Dropping an entry safely needs every action to hold its
    /// task from before its store record to its end, which no one tracks yet.
    /// By agent, then task id: looked up from borrowed strings, so an admission checks it
    /// without copying the request's agent and task id.
    ///
    /// It starts empty at every start, and need not be rebuilt from the store: no action of a
    /// task cancelled before the start comes here except as a reconciliation lookup, which
    /// cancellation does not hold back. The store refuses a new action of such a task before it
    /// is recorded or queued (its tasks table says so), as does a same-key resend; and restart
    /// recovery sends nothing again for an earlier run's actions, it ends or reconciles them.
    cancelled_tasks: HashMap<String, HashSet<String>>,
    rng: SplitMix64,
    clock: TokioClock,
    metrics: Arc<Metrics>,
    backoff: BackoffConfig,
    default_max_concurrent: u32,
    default_max_delayed: u32,
    retry_quota: RetryQuotaConfig,
    tx: mpsc::UnboundedSender<Msg>,
    views: Arc<Mutex<Arc<Vec<ScopeView>>>>,
    /// Shut down: every `acquire` is answered `Stopped`.
    stopped: bool,
}

fn positive(d: SignedDuration) -> Duration {
    Duration::try_from(d).unwrap_or(Duration::ZERO)
}

fn add(ts: Timestamp, d: Duration) -> Timestamp {
    SignedDuration::try_from(d)
        .ok()
        .and_then(|d| ts.checked_add(d).ok())
        .unwrap_or(Timestamp::MAX)
}

/// Counts the waiter in every scope's delayed queue.
///
/// # Errors
/// The `scope_saturated` detail when a scope's `max_delayed_requests` is reached; nothing stays
/// counted then.
fn try_delay(scopes: &mut [ScopeEntry], waiter: &mut Waiter) -> Result<(), String> {
    if waiter.delayed {
        return Ok(());
    }
    let ids = waiter.scopes.as_slice();
    for (counted, &id) in ids.iter().enumerate() {
        if let Err(full) = scopes[id as usize].state.record.try_delay() {
            for &done in &ids[..counted] {
                scopes[done as usize].state.record.undelay();
            }
            tracing::info!(
                task = %waiter.task.1,
                route = %waiter.route,
                scope = %scopes[id as usize].state.record.name,
                "refused: the scope's delayed queue is full (scope_saturated)"
            );
            return Err(full.to_string());
        }
    }
    waiter.delayed = true;
    Ok(())
}

fn undelay(scopes: &mut [ScopeEntry], waiter: &Waiter) {
    if waiter.delayed {
        for &id in waiter.scopes.as_slice() {
            scopes[id as usize].state.record.undelay();
        }
    }
}

/// The latest future `next_allowed_at` among `ids`.
fn latest_boundary(scopes: &[ScopeEntry], ids: &ScopeIds, now: Timestamp) -> Option<Timestamp> {
    ids.as_slice()
        .iter()
        .filter_map(|&id| scopes[id as usize].state.record.next_allowed_at)
        .filter(|at| *at > now)
        .max()
}

/// The dispatch check ([`admit`]) of one action over its scopes, in name order.
fn admit_scopes(
    scopes: &mut [ScopeEntry],
    ids: &ScopeIds,
    request: AdmitRequest,
    budget: &mut ActionBudget,
    now: Timestamp,
) -> Admission {
    match ids {
        ScopeIds::One(id) => {
            let mut state = &mut scopes[*id as usize].state;
            admit(request, budget, std::slice::from_mut(&mut state), now)
        }
        ScopeIds::Many(ids) => {
            // Distinct indices: each entry is borrowed once; then in name order.
            let mut refs: Vec<&mut ScopeState> = scopes
                .iter_mut()
                .enumerate()
                .filter(|(id, _)| ids.iter().any(|want| *want as usize == *id))
                .map(|(_, entry)| &mut entry.state)
                .collect();
            refs.sort_by(|a, b| a.record.name.cmp(&b.record.name));
            admit(request, budget, &mut refs, now)
        }
    }
}

/// The scheduler task: sleeps until a message or the earliest wake, then takes the state,
/// handles everything queued, examines what is due and publishes.
async fn run(shared: Arc<Shared>, mut rx: mpsc::UnboundedReceiver<Msg>) {
    loop {
        let wake = {
            let state = shared.lock();
            state
                .timers
                .first_key_value()
                .map(|((at, _), _)| state.clock.instant_at(*at))
        };
        let msg = match wake {
            Some(at) => {
                let sleep = tokio::time::sleep_until(at);
                tokio::select! {
                    biased;
                    msg = rx.recv() => Some(msg),
                    () = sleep => None,
                }
            }
            None => Some(rx.recv().await),
        };
        let mut state = shared.lock();
        match msg {
            Some(None) => {
                state.stop();
                return;
            }
            Some(Some(msg)) => {
                if handle_counted(&shared, &mut state, msg) {
                    state.stop();
                    return;
                }
                // Take everything already queued before deciding, so priorities compare
                // across simultaneous arrivals.
                while let Ok(msg) = rx.try_recv() {
                    if handle_counted(&shared, &mut state, msg) {
                        state.stop();
                        return;
                    }
                }
            }
            None => {}
        }
        state.pump();
        state.publish();
    }
}

/// Handles one message; an `Acquire` leaves the in-transit count once it is in the state.
/// `true` to stop.
fn handle_counted(shared: &Shared, state: &mut State, msg: Msg) -> bool {
    let arrival = matches!(msg, Msg::Acquire(_));
    let stop = state.handle(msg);
    if arrival {
        shared.in_transit.fetch_sub(1, Ordering::SeqCst);
    }
    stop
}

/// Whether `agent`'s task `task_id` is among `cancelled` (a map lookup only once a task was
/// cancelled; nothing is copied).
fn is_cancelled(cancelled: &HashMap<String, HashSet<String>>, agent: &str, task_id: &str) -> bool {
    !cancelled.is_empty()
        && cancelled
            .get(agent)
            .is_some_and(|tasks| tasks.contains(task_id))
}

impl State {
    /// Stops for good: every waiting action is answered `Stopped` (its waiter drops) and every
    /// later `acquire` too.
    fn stop(&mut self) {
        self.stopped = true;
        self.timers.clear();
        self.tickets.clear();
        self.ready.clear();
        self.slot_waiters.clear();
        self.slots = Slab::default();
    }

    /// Returns one concurrency slot per scope; actions waiting for a slot are reconsidered in
    /// the next pump.
    fn release(&mut self, scopes: &ScopeIds) {
        for &id in scopes.as_slice() {
            if let Some(entry) = self.scopes.get_mut(id as usize) {
                entry.state.record.release();
                entry.sync_gauges();
            }
        }
        for slot in std::mem::take(&mut self.slot_waiters) {
            if let Some(waiter) = self.slots.get_mut(slot) {
                if !waiter.timed && !waiter.queued {
                    waiter.queued = true;
                    self.ready.push(slot);
                }
            }
        }
    }

    /// Deposits into the retry quotas (see [`SchedulerHandle::deposit`]).
    fn deposit(&mut self, scopes: &[String], tokens: Option<RetryTokens>) {
        match tokens {
            None => {
                for name in scopes {
                    if let Some(&id) = self.scope_ids.get(name) {
                        self.scopes[id as usize]
                            .quota
                            .deposit(Deposit::FirstTrySucceeded);
                    }
                }
            }
            Some(RetryTokens(tokens)) => {
                for (name, token) in tokens {
                    if let Some(&id) = self.scope_ids.get(&name) {
                        self.scopes[id as usize]
                            .quota
                            .deposit(Deposit::RetrySucceeded(token));
                    }
                }
            }
        }
    }

    /// Handles one message; `true` to stop.
    fn handle(&mut self, msg: Msg) -> bool {
        match msg {
            Msg::Acquire(pending) => self.enqueue(pending),
            Msg::Abandon { ticket } => self.abandon(ticket),
            Msg::Release { scopes } => self.release(&scopes),
            Msg::Signal {
                scopes,
                signal,
                done,
            } => {
                for name in &scopes {
                    self.apply_signal(name, &signal);
                }
                // Waiters whose wake is earlier re-check against the new record when they wake.
                let _ = done.send(());
            }
            Msg::Withdraw {
                scopes,
                cause,
                reply,
            } => {
                let answer = self.withdraw(&scopes, cause);
                let _ = reply.send(answer);
            }
            Msg::Deposit { scopes, tokens } => self.deposit(&scopes, tokens),
            Msg::CancelTask {
                agent,
                task_id,
                reply,
            } => {
                let dropped = self.cancel_task(agent, task_id);
                let _ = reply.send(dropped);
            }
            Msg::Shutdown { done } => {
                tracing::info!(
                    waiting = self.tickets.len(),
                    "scheduler stopping; waiting actions stay recoverable in the store"
                );
                self.stopped = true;
                let _ = done.send(());
                return true;
            }
        }
        false
    }

    /// Takes the waiting action of `ticket` out of the delayed queue: its client went away.
    fn abandon(&mut self, ticket: u64) {
        if let Some(slot) = self.tickets.get(&ticket).copied() {
            if let Some(waiter) = self.remove(slot) {
                tracing::info!(
                    task = %waiter.task.1,
                    route = %waiter.route,
                    "waiting action abandoned by its client before it was sent"
                );
                undelay(&mut self.scopes, &waiter);
            }
        }
    }

    /// Applies `signal` to the record of scope `name` (created when it is not known).
    fn apply_signal(&mut self, name: &str, signal: &ScopeSignal) {
        let id = self.ensure_scope(name);
        let record = &mut self.scopes[id as usize].state.record;
        match signal {
            ScopeSignal::RateLimited { boundary, source } => {
                record.observe_429(*boundary, source.clone());
                tracing::info!(
                    scope = %name,
                    source = %source,
                    boundary = %boundary,
                    "scope record updated: every action of the scope waits for the boundary"
                );
            }
            ScopeSignal::Quota {
                remaining,
                limit,
                reset_at,
                source,
            } => {
                record.observe_quota(*remaining, *limit, *reset_at, source.clone());
                tracing::debug!(scope = %name, source = %source, remaining = ?remaining, "quota observed");
            }
            ScopeSignal::Restore {
                next_allowed_at,
                remaining,
                limit,
                reset_at,
                source,
            } => {
                if let Some(at) = next_allowed_at {
                    record.observe_429(*at, source.clone());
                }
                record.remaining = remaining.or(record.remaining);
                record.limit = limit.or(record.limit);
                record.reset_at = reset_at.or(record.reset_at);
                record.source = Some(source.clone());
            }
        }
    }

    /// Marks `agent`'s task `task_id` cancelled and refuses its waiting actions (not its
    /// reconciliation lookups) `cancelled`; returns how many were dropped.
    fn cancel_task(&mut self, agent: String, task_id: String) -> u64 {
        let key: TaskKey = (agent, task_id);
        let task = self.tasks.get(&key).unwrap_or_else(|| Arc::new(key));
        self.cancelled_tasks
            .entry(task.0.clone())
            .or_default()
            .insert(task.1.clone());
        let slots: Vec<u32> = self
            .slots
            .iter()
            .filter(|(_, w)| Arc::ptr_eq(&w.task, &task) && !w.reconciliation)
            .map(|(slot, _)| slot)
            .collect();
        let mut dropped = 0;
        for slot in slots {
            if let Some(waiter) = self.remove(slot) {
                dropped += 1;
                self.refuse(
                    waiter,
                    Outcome::Cancelled,
                    "the task was cancelled; the action never sends again".to_owned(),
                    None,
                );
            }
        }
        tracing::info!(task = %task.1, dropped, "task cancelled: delayed actions dropped");
        dropped
    }

    /// Adds a scope to the table (or replaces the state of one with the same name).
    fn add_scope(&mut self, provider: String, state: ScopeState) -> ScopeId {
        let entry = ScopeEntry {
            provider,
            delayed_gauge: self.metrics.delayed_gauge(&state.record.name),
            in_flight_gauge: self.metrics.in_flight_gauge(&state.record.name),
            state,
            quota: RetryQuota::new(self.retry_quota),
            published: None,
        };
        if let Some(&id) = self.scope_ids.get(&entry.state.record.name) {
            self.scopes[id as usize] = entry;
            return id;
        }
        let id = ScopeId::try_from(self.scopes.len()).unwrap_or(ScopeId::MAX);
        self.scope_ids.insert(entry.state.record.name.clone(), id);
        self.scopes.push(entry);
        id
    }

    /// The id of scope `name`, created with the shared-scope limits when it is not known.
    fn ensure_scope(&mut self, name: &str) -> ScopeId {
        if let Some(&id) = self.scope_ids.get(name) {
            return id;
        }
        let provider = name.split_once('/').map_or(name, |(p, _)| p).to_owned();
        let state = ScopeState {
            record: ScopeRecord::new(name, self.default_max_concurrent, self.default_max_delayed),
            pacer: None,
        };
        self.add_scope(provider, state)
    }

    /// The distinct scopes of `names` in name order.
    fn scope_set(&mut self, names: &[String]) -> ScopeIds {
        if let [name] = names {
            return ScopeIds::One(self.ensure_scope(name));
        }
        let mut ids: Vec<ScopeId> = names.iter().map(|name| self.ensure_scope(name)).collect();
        let scopes = &self.scopes;
        ids.sort_by(|a, b| {
            scopes[*a as usize]
                .state
                .record
                .name
                .cmp(&scopes[*b as usize].state.record.name)
        });
        ids.dedup();
        match ids.as_slice() {
            [id] => ScopeIds::One(*id),
            _ => ScopeIds::Many(ids.into_boxed_slice()),
        }
    }

    fn withdraw(
        &mut self,
        scopes: &[String],
        cause: RetryCause,
    ) -> Result<RetryTokens, RetryQuotaRefused> {
        let mut taken: Vec<(String, RetryToken)> = Vec::new();
        for name in scopes {
            let id = self.ensure_scope(name);
            match self.scopes[id as usize].quota.withdraw(cause) {
                Ok(token) => taken.push((name.clone(), token)),
                Err(empty) => {
                    for (name, token) in taken {
                        if let Some(&id) = self.scope_ids.get(&name) {
                            self.scopes[id as usize]
                                .quota
                                .deposit(Deposit::RetrySucceeded(token));
                        }
                    }
                    tracing::info!(
                        scope = %name,
                        available = empty.available,
                        cost = empty.cost,
                        "retry refused: the scope retry quota is empty"
                    );
                    return Err(RetryQuotaRefused {
                        scope: name.clone(),
                        available: empty.available,
                        cost: empty.cost,
                    });
                }
            }
        }
        Ok(RetryTokens(taken))
    }

    fn enqueue(&mut self, mut pending: PendingAcquire) {
        let Some(reply) = pending.reply.take() else {
            return;
        };
        let ticket = pending.ticket;
        let request = &mut pending.request;
        let scopes = self.scope_set(&request.scopes);
        let key: TaskKey = (
            std::mem::take(&mut request.agent),
            std::mem::take(&mut request.task_id),
        );
        let task = match self.tasks.get(&key) {
            Some(task) => task,
            None => self.tasks.insert(Arc::new(key)),
        };
        let route = match self.routes.get(&request.route) {
            Some(route) => route,
            None => self
                .routes
                .insert(Arc::from(std::mem::take(&mut request.route))),
        };
        let now = self.clock.now();
        let planned = request.not_before.filter(|at| *at > now);
        let mut waiter = Waiter {
            ticket,
            task,
            route,
            scopes,
            budget: request.budget,
            since: now,
            wake: planned.unwrap_or(now),
            reply: Some(reply),
            priority: request.priority,
            fresh: planned.is_none(),
            delayed: false,
            queued: planned.is_none(),
            timed: planned.is_some(),
            reconciliation: request.reconciliation,
        };
        match planned {
            Some(at) => {
                // A planned retry: it waits in the delayed queue until its instant.
                if let Err(detail) = try_delay(&mut self.scopes, &mut waiter) {
                    let boundary = latest_boundary(&self.scopes, &waiter.scopes, now);
                    self.refuse(waiter, Outcome::ScopeSaturated, detail, boundary);
                    return;
                }
                let order = waiter.order();
                let slot = self.insert(waiter);
                self.timers.insert((at, order), slot);
            }
            None => {
                let slot = self.insert(waiter);
                self.ready.push(slot);
            }
        }
    }

    /// Puts a waiter into the slab and indexes its ticket.
    fn insert(&mut self, waiter: Waiter) -> u32 {
        let ticket = waiter.ticket;
        let slot = self.slots.insert(waiter);
        self.tickets.insert(ticket, slot);
        slot
    }

    /// Drops a waiter in its slot and takes it out of the ticket index and the wake queue.
    fn discard(&mut self, slot: u32) {
        let Some(waiter) = self.slots.get_mut(slot) else {
            return;
        };
        let ticket = waiter.ticket;
        let timer = waiter.timed.then(|| (waiter.wake, waiter.order()));
        self.slots.vacate(slot);
        self.tickets.remove(&ticket);
        if let Some(key) = timer {
            self.timers.remove(&key);
        }
    }

    /// Takes a waiter out of the slab, its ticket index and the wake queue.
    fn remove(&mut self, slot: u32) -> Option<Waiter> {
        let waiter = self.slots.take(slot)?;
        self.tickets.remove(&waiter.ticket);
        if waiter.timed {
            self.timers.remove(&(waiter.wake, waiter.order()));
        }
        Some(waiter)
    }

    fn refuse(
        &mut self,
        waiter: Waiter,
        outcome: Outcome,
        detail: String,
        boundary: Option<Timestamp>,
    ) {
        self.refuse_until(waiter, outcome, detail, boundary, None);
    }

    /// [`State::refuse`], naming the instant the waiter would have waited for (`not_before`).
    fn refuse_until(
        &mut self,
        mut waiter: Waiter,
        outcome: Outcome,
        detail: String,
        boundary: Option<Timestamp>,
        not_before: Option<Timestamp>,
    ) {
        undelay(&mut self.scopes, &waiter);
        tracing::info!(
            task = %waiter.task.1,
            route = %waiter.route,
            outcome = %outcome,
            attempts_left = waiter.budget.attempts_remaining(),
            wait_left_ms = waiter.budget.wait_remaining().as_millis() as u64,
            detail = %detail,
            "action refused by the scheduler"
        );
        if let Some(reply) = waiter.reply.take() {
            let _ = reply.send(Answer::Refused(Box::new(Refusal {
                outcome,
                detail,
                budget: waiter.budget,
                boundary,
                not_before,
            })));
        }
    }

    /// Takes every due waiter off the front of the wake queue and re-examines them with every
    /// ready one, highest priority first, then arrival.
    fn pump(&mut self) {
        let now = self.clock.now();
        let mut batch = std::mem::take(&mut self.batch);
        batch.clear();
        while let Some(entry) = self.timers.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let ((_, order), slot) = entry.remove_entry();
            if let Some(waiter) = self.slots.get_mut(slot) {
                waiter.timed = false;
                batch.push((order, slot));
            }
        }
        for slot in self.ready.drain(..) {
            if let Some(waiter) = self.slots.get_mut(slot) {
                if std::mem::take(&mut waiter.queued) {
                    batch.push((waiter.order(), slot));
                }
            }
        }
        if !batch.is_empty() {
            // Already in order when one instant released them all (pdqsort sees the run).
            batch.sort_unstable();
            for &(_, slot) in &batch {
                self.examine(slot, now);
            }
        }
        self.batch = batch;
    }

    /// Runs the dispatch check for the waiter in `slot` at `now`. It stays in its slot while it
    /// keeps waiting and leaves the slab when it is answered.
    fn examine(&mut self, slot: u32, now: Timestamp) {
        if !self.charge_wait(slot, now) {
            return;
        }
        let Some(waiter) = self.slots.get_mut(slot) else {
            return;
        };
        let cancelled = !waiter.reconciliation
            && is_cancelled(&self.cancelled_tasks, &waiter.task.0, &waiter.task.1);
        let request = AdmitRequest {
            cancelled,
            priority: waiter.priority,
        };
        let admission = admit_scopes(
            &mut self.scopes,
            &waiter.scopes,
            request,
            &mut waiter.budget,
            now,
        );
        match admission {
            Admission::Go => self.dispatch(slot),
            Admission::WaitUntil { at, reason } => self.wait_until(slot, at, &reason, now),
            Admission::WaitForSlot { scope } => self.wait_for_slot(slot, &scope, now),
            Admission::Refuse {
                outcome,
                detail,
                not_before,
            } => {
                let boundary = self
                    .slots
                    .get_mut(slot)
                    .and_then(|waiter| latest_boundary(&self.scopes, &waiter.scopes, now));
                if let Some(waiter) = self.remove(slot) {
                    self.refuse_until(waiter, outcome, detail, boundary, not_before);
                }
            }
        }
    }

    /// Charges the time the waiter in `slot` waited since it was last looked at to its wait
    /// budget. `false` when it is answered instead: its client is gone (it leaves quietly), or
    /// the wait exhausted its budget (refused).
    fn charge_wait(&mut self, slot: u32, now: Timestamp) -> bool {
        let Some(waiter) = self.slots.get_mut(slot) else {
            return false;
        };
        if waiter.reply.as_ref().is_none_or(oneshot::Sender::is_closed) {
            if let Some(waiter) = self.remove(slot) {
                undelay(&mut self.scopes, &waiter);
            }
            return false;
        }
        let waited = if std::mem::take(&mut waiter.fresh) {
            Duration::ZERO
        } else {
            positive(now.duration_since(waiter.since))
        };
        waiter.since = now;
        if !waited.is_zero() {
            if let Err(refusal) = waiter.budget.withdraw_wait(waited) {
                let boundary = latest_boundary(&self.scopes, &waiter.scopes, now);
                if let Some(waiter) = self.remove(slot) {
                    self.refuse(waiter, refusal.outcome(), refusal.to_string(), boundary);
                }
                return false;
            }
        }
        true
    }

    /// Answers the admitted waiter in `slot` `Go` and drops it from the slab.
    fn dispatch(&mut self, slot: u32) {
        let Some(waiter) = self.slots.get_mut(slot) else {
            return;
        };
        undelay(&mut self.scopes, waiter);
        tracing::debug!(
            task = %waiter.task.1,
            route = %waiter.route,
            priority = ?waiter.priority,
            attempt = waiter.budget.attempts_used(),
            "dispatch: attempt admitted"
        );
        let reply = waiter.reply.take();
        let answer = Answer::Go {
            scopes: std::mem::take(&mut waiter.scopes),
            granted_at: self.clock.now(),
            budget: waiter.budget,
        };
        // Dropped where it lies: the answer took what it needs.
        self.discard(slot);
        if let Some(reply) = reply {
            // The client is gone: its slots come back as a dropped permit's would.
            if let Err(Answer::Go { scopes, .. }) = reply.send(answer) {
                let _ = self.tx.send(Msg::Release { scopes });
            }
        }
    }

    /// Counts the waiter in `slot` in its scopes' delayed queues. `false` when a queue is full:
    /// the waiter is then refused `scope_saturated` and leaves the slab.
    fn delay_or_refuse(&mut self, slot: u32, now: Timestamp) -> bool {
        let Some(waiter) = self.slots.get_mut(slot) else {
            return false;
        };
        let Err(detail) = try_delay(&mut self.scopes, waiter) else {
            return true;
        };
        // The boundary, when a scope has one, tells the agent when to come back
        // (`Retry-After`); the queue it found full drains from then on.
        let boundary = latest_boundary(&self.scopes, &waiter.scopes, now);
        if let Some(waiter) = self.remove(slot) {
            self.refuse(waiter, Outcome::ScopeSaturated, detail, boundary);
        }
        false
    }

    /// Puts the waiter in `slot` in the wake queue for `at` — past a scope's `next_allowed_at`
    /// by a jitter ([`jittered`]), at a pacing instant exactly — counted as delayed.
    fn wait_until(&mut self, slot: u32, at: Timestamp, reason: &WaitReason, now: Timestamp) {
        if !self.delay_or_refuse(slot, now) {
            return;
        }
        let Some(waiter) = self.slots.get_mut(slot) else {
            return;
        };
        let wake = match reason {
            WaitReason::NextAllowedAt { .. } => {
                jittered(&mut self.rng, &self.backoff, at, &waiter.budget, now)
            }
            WaitReason::Pacing { .. } => at,
        };
        match reason {
            WaitReason::NextAllowedAt { scope, source } => tracing::info!(
                task = %waiter.task.1,
                route = %waiter.route,
                scope = %scope,
                source = source.as_deref().unwrap_or("unknown"),
                boundary = %at,
                wake = %wake,
                wait_left_ms = waiter.budget.wait_remaining().as_millis() as u64,
                "waiting: the scope's next_allowed_at is in the future"
            ),
            WaitReason::Pacing { scope } => tracing::info!(
                task = %waiter.task.1,
                route = %waiter.route,
                scope = %scope,
                wake = %wake,
                "waiting: local pacing of the scope"
            ),
        }
        waiter.wake = wake;
        waiter.timed = true;
        self.timers.insert((wake, waiter.order()), slot);
    }

    /// Lists the waiter in `slot` among those woken when a concurrency slot is released,
    /// counted as delayed.
    fn wait_for_slot(&mut self, slot: u32, scope: &str, now: Timestamp) {
        if !self.delay_or_refuse(slot, now) {
            return;
        }
        if let Some(waiter) = self.slots.get_mut(slot) {
            tracing::debug!(
                task = %waiter.task.1,
                route = %waiter.route,
                scope = %scope,
                "waiting for a concurrency slot"
            );
        }
        self.slot_waiters.push(slot);
    }

    /// Publishes the scope views and gauges. Cheap when little changed, as after most
    /// messages: gauges are set only when their count moved, and the views are updated in place
    /// (readers copy them out under the lock and keep no reference), rebuilt only when a scope
    /// was added.
    fn publish(&mut self) {
        let now = self.clock.now();
        for entry in &mut self.scopes {
            entry.sync_gauges();
        }
        let mut slot = self
            .views
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let views = Arc::make_mut(&mut slot);
        if views.len() != self.scope_ids.len() {
            *views = self
                .scope_ids
                .iter()
                .map(|(name, &id)| {
                    let entry = &self.scopes[id as usize];
                    let prefix = format!("{}/", entry.provider);
                    let mut view = ScopeView {
                        provider: entry.provider.clone(),
                        scope: name.strip_prefix(&prefix).unwrap_or(name).to_owned(),
                        request_class: None,
                        next_allowed_at: None,
                        remaining: None,
                        reset_after_seconds: None,
                        source: None,
                        in_flight: 0,
                        delayed: 0,
                    };
                    refresh(&mut view, &entry.state.record, now);
                    view
                })
                .collect();
        } else {
            for (view, &id) in views.iter_mut().zip(self.scope_ids.values()) {
                refresh(view, &self.scopes[id as usize].state.record, now);
            }
        }
    }
}

/// Copies a record's live fields into its view. `remaining` counts the provider's current
/// window only: once the window it was reported for has ended — the reported reset, or, for a
/// `0` (a 429, or an exhausted quota), the boundary the scope waited for, whichever is later —
/// the count is not known to hold any more and the view shows none (`null`) until the next
/// signal.
fn refresh(view: &mut ScopeView, record: &ScopeRecord, now: Timestamp) {
    view.next_allowed_at = record.next_allowed_at;
    let blocked_until = record
        .next_allowed_at
        .filter(|_| record.remaining == Some(0));
    let window_end = match (record.reset_at, blocked_until) {
        (Some(reset), Some(blocked)) => Some(reset.max(blocked)),
        (reset, blocked) => reset.or(blocked),
    };
    view.remaining = record
        .remaining
        .filter(|_| window_end.is_none_or(|end| end > now));
    view.reset_after_seconds = record.reset_at.filter(|r| *r > now).map(|r| {
        let d = positive(r.duration_since(now));
        d.as_secs() + u64::from(d.subsec_nanos() > 0)
    });
    if view.source != record.source {
        view.source.clone_from(&record.source);
    }
    view.in_flight = record.in_flight;
    view.delayed = record.delayed;
}

/// The boundary plus a jitter of up to `min(cap(1), boundary_spread)`, trimmed to the deadline
/// and the wait budget (never below the boundary).
fn jittered(
    rng: &mut SplitMix64,
    backoff: &BackoffConfig,
    at: Timestamp,
    budget: &ActionBudget,
    now: Timestamp,
) -> Timestamp {
    let spread = backoff.cap(1).min(backoff.boundary_spread);
    let mut extra = spread.mul_f64(rng.unit());
    let until = positive(at.duration_since(now));
    extra = extra.min(budget.wait_remaining().saturating_sub(until));
    if let Some(deadline) = budget.deadline() {
        extra = extra.min(positive(deadline.duration_since(at)));
    }
    add(at, extra)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view_of(record: &ScopeRecord, now: Timestamp) -> ScopeView {
        let mut view = ScopeView {
            provider: "billing".into(),
            scope: "account".into(),
            request_class: None,
            next_allowed_at: None,
            remaining: None,
            reset_after_seconds: None,
            source: None,
            in_flight: 0,
            delayed: 0,
        };
        refresh(&mut view, record, now);
        view
    }

    #[test]
    fn remaining_is_shown_only_until_the_window_it_was_reported_for_ends() {
        let t0: Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let at = |s: i64| t0 + SignedDuration::from_secs(s);
        let mut record = ScopeRecord::new("billing/account", 2, 25);
        record.observe_quota(Some(7), Some(10), Some(at(10)), "ietf quota headers");
        let before = view_of(&record, at(9));
        assert_eq!(
            (before.remaining, before.reset_after_seconds),
            (Some(7), Some(1))
        );
        // The reset passed: the old window's count is not known to hold in the new one.
        let after = view_of(&record, at(10));
        assert_eq!((after.remaining, after.reset_after_seconds), (None, None));
        // A report without a reset instant keeps its count.
        let mut unbounded = ScopeRecord::new("billing/account", 2, 25);
        unbounded.observe_quota(Some(3), None, None, "generic quota headers");
        assert_eq!(view_of(&unbounded, at(3600)).remaining, Some(3));

        // A 429 after that reset: 0 left until its boundary, even though the old reset passed.
        record.observe_429(at(20), "HTTP 429 Retry-After");
        assert_eq!(view_of(&record, at(19)).remaining, Some(0));
        assert_eq!(view_of(&record, at(20)).remaining, None);
        // A new window's report counts again.
        record.observe_quota(Some(9), Some(10), Some(at(30)), "ietf quota headers");
        assert_eq!(view_of(&record, at(21)).remaining, Some(9));
    }

    #[test]
    fn unit_samples_stay_in_range_and_follow_the_seed() {
        let mut a = SplitMix64::new(7);
        let mut b = SplitMix64::new(7);
        for _ in 0..1000 {
            let x = a.unit();
            assert!((0.0..1.0).contains(&x));
            assert_eq!(x.to_bits(), b.unit().to_bits());
        }
        assert_ne!(SplitMix64::new(8).unit(), SplitMix64::new(7).unit());
    }

    const POLICY: &str = r#"
shared_scope:
  max_delayed_requests: 100
  max_concurrent_requests: 100
providers:
  billing:
    base_url: http://127.0.0.1:9
    scopes:
      account: {}
    routes:
      "GET /v1/items/{id}": { class: read, scopes: [account] }
"#;

    fn class() -> ClassBudget {
        ClassBudget {
            max_attempts: 3,
            max_wait: Duration::from_secs(600),
        }
    }

    fn request(task: &str, not_before: Option<Timestamp>) -> AcquireRequest {
        AcquireRequest {
            task_id: task.to_owned(),
            agent: "agent-a".to_owned(),
            priority: Priority::Normal,
            scopes: vec!["billing/account".to_owned()],
            budget: ActionBudget::new(class(), None),
            not_before,
            route: "GET /v1/items/{id}".to_owned(),
            reconciliation: false,
        }
    }

    fn spawn() -> (SchedulerHandle, TokioClock) {
        spawn_with(POLICY)
    }

    fn spawn_with(policy: &str) -> (SchedulerHandle, TokioClock) {
        let policy = Policy::from_yaml_str(policy, "test.yaml").expect("the test policy parses");
        let clock = TokioClock::anchored_at("2026-01-01T00:00:00Z".parse().expect("a timestamp"));
        let handle = SchedulerHandle::spawn(&policy, clock, Arc::new(Metrics::new()), 1);
        (handle, clock)
    }

    /// One concurrency slot in the scope.
    fn spawn_one_slot() -> (SchedulerHandle, TokioClock) {
        spawn_with(&POLICY.replace("max_concurrent_requests: 100", "max_concurrent_requests: 1"))
    }

    /// Polls once with a waker that does nothing: what the action sees before any other task
    /// (the scheduler's included) has run.
    fn poll_once<F: Future + Unpin>(future: &mut F) -> std::task::Poll<F::Output> {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        std::pin::Pin::new(future).poll(&mut cx)
    }

    /// Waits for an answer the test expects to come; a lost wake fails the test instead of
    /// hanging it (the paused clock runs ahead to the timeout when nothing else can run).
    async fn answered(acquiring: impl Future<Output = Acquired>) -> Acquired {
        tokio::time::timeout(Duration::from_secs(3600), acquiring)
            .await
            .expect("the action is answered")
    }

    fn go(acquired: Acquired) -> (Permit, ActionBudget) {
        match acquired {
            Acquired::Go { permit, budget } => (permit, budget),
            other => panic!("expected Go, got {other:?}"),
        }
    }

    fn in_flight(handle: &SchedulerHandle) -> u32 {
        handle.scopes().iter().map(|view| view.in_flight).sum()
    }

    #[tokio::test(start_paused = true)]
    async fn an_uncontended_action_is_admitted_in_place_and_charged_as_by_the_task() {
        let (handle, clock) = spawn();
        let mut acquiring = Box::pin(handle.acquire(request("task-1", None)));
        let std::task::Poll::Ready(acquired) = poll_once(&mut acquiring) else {
            panic!("an action nobody waits ahead of is admitted without a round trip");
        };
        let (permit, budget) = go(acquired);
        assert_eq!(budget.attempts_used(), 1);
        assert_eq!(permit.granted_at(), clock.now());
        // Counted at once, and returned at once when the permit drops.
        assert_eq!(in_flight(&handle), 1);
        drop(permit);
        assert_eq!(in_flight(&handle), 0);
        // A planned retry still waits for its instant.
        let later = add(clock.now(), Duration::from_secs(5));
        let mut planned = Box::pin(handle.acquire(request("task-1", Some(later))));
        assert!(poll_once(&mut planned).is_pending());
        let (_, budget) = go(planned.await);
        assert_eq!(budget.attempts_used(), 1);
        assert!(clock.now() >= later);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiting_action_holds_a_small_future() {
        // 10^6 delayed actions must fit in ≤ 1 KiB each (BENCHMARKS.md, "Scheduler scale"): what
        // a waiting action's `acquire` holds is its receiver, its abandon guard and the shared
        // counters, not a copy of a decided answer or of the request.
        let (handle, clock) = spawn();
        let later = add(clock.now(), Duration::from_secs(5));
        let waiting = handle.acquire(request("task-1", Some(later)));
        assert!(
            std::mem::size_of_val(&waiting) <= 48,
            "acquire's future is {} bytes",
            std::mem::size_of_val(&waiting)
        );
        let (_, budget) = go(waiting.await);
        assert_eq!(budget.attempts_used(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_newcomer_does_not_take_the_slot_an_earlier_waiter_waits_for() {
        let (handle, _clock) = spawn_one_slot();
        let (first, _) = go(handle.acquire(request("task-a", None)).await);
        let waiting = tokio::spawn(handle.acquire(request("task-b", None)));
        while delayed(&handle) < 1 {
            tokio::task::yield_now().await;
        }
        // The slot comes back and a newcomer asks before the scheduler has run: the slot is
        // the waiting action's.
        drop(first);
        let mut newcomer = Box::pin(handle.acquire(request("task-c", None)));
        assert!(poll_once(&mut newcomer).is_pending());
        let (second, _) =
            go(answered(async { waiting.await.expect("the waiting task completes") }).await);
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(poll_once(&mut newcomer).is_pending());
        drop(second);
        let (_third, _) = go(answered(newcomer).await);
    }

    #[tokio::test(start_paused = true)]
    async fn an_arrival_on_its_way_to_the_scheduler_is_decided_before_a_later_newcomer() {
        let (handle, _clock) = spawn_one_slot();
        // The state is busy as `acquire` is called: the request goes to the scheduler.
        let state = handle.shared.lock();
        let mut earlier = Box::pin(handle.acquire(request("task-a", None)));
        drop(state);
        // The state is free now and the slot too, but the earlier arrival has not been taken
        // into the state yet: the newcomer is not admitted ahead of it.
        let mut later = Box::pin(handle.acquire(request("task-b", None)));
        assert!(poll_once(&mut later).is_pending());
        let (permit, _) = go(answered(earlier.as_mut()).await);
        assert!(poll_once(&mut later).is_pending());
        drop(permit);
        let (_permit, _) = go(answered(later).await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_429_recorded_just_before_an_admission_holds_it_back() {
        let (handle, clock) = spawn();
        let boundary = add(clock.now(), Duration::from_secs(30));
        let scopes = vec!["billing/account".to_owned()];
        handle
            .signal(
                &scopes,
                ScopeSignal::RateLimited {
                    boundary,
                    source: "HTTP 429 Retry-After".to_owned(),
                },
            )
            .await;
        let mut acquiring = Box::pin(handle.acquire(request("task-1", None)));
        assert!(poll_once(&mut acquiring).is_pending());
        let (permit, _) = go(acquiring.await);
        assert!(permit.granted_at() >= boundary);
    }

    #[tokio::test(start_paused = true)]
    async fn a_cancelled_task_is_refused_not_admitted_in_place() {
        let (handle, _clock) = spawn();
        assert_eq!(handle.cancel_task("agent-a", "task-1").await, 0);
        match handle.acquire(request("task-1", None)).await {
            Acquired::Refused { outcome, .. } => assert_eq!(outcome, Outcome::Cancelled),
            other => panic!("expected Refused, got {other:?}"),
        }
        let (_permit, _) = go(handle.acquire(request("task-2", None)).await);
    }

    fn delayed(handle: &SchedulerHandle) -> u32 {
        handle.scopes().iter().map(|view| view.delayed).sum()
    }

    #[test]
    fn order_puts_higher_priority_first_then_earlier_tickets() {
        let interactive = order_key(Priority::Interactive, 9);
        let normal_early = order_key(Priority::Normal, 1);
        let normal_late = order_key(Priority::Normal, 2);
        let background = order_key(Priority::Background, 0);
        assert!(interactive < normal_early);
        assert!(normal_early < normal_late);
        assert!(normal_late < background);
    }

    #[tokio::test(start_paused = true)]
    async fn delayed_actions_are_answered_stopped_with_their_budget_at_shutdown() {
        let (handle, clock) = spawn();
        let later = add(clock.now(), Duration::from_secs(60));
        let waiting: Vec<_> = (0..3)
            .map(|i| tokio::spawn(handle.acquire(request(&format!("task-{i}"), Some(later)))))
            .collect();
        while delayed(&handle) < 3 {
            tokio::task::yield_now().await;
        }
        handle.shutdown().await;
        for task in waiting {
            match task.await.expect("the waiting task completes") {
                Acquired::Stopped { budget } => {
                    assert_eq!(budget.attempts_used(), 0);
                    assert_eq!(budget.attempts_remaining(), 3);
                }
                other => panic!("expected Stopped, got {other:?}"),
            }
        }
        // Asked after the stop: answered at once, nothing charged.
        match handle.acquire(request("task-late", None)).await {
            Acquired::Stopped { budget } => assert_eq!(budget.attempts_used(), 0),
            other => panic!("expected Stopped, got {other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_wave_due_at_one_instant_goes_by_priority_then_arrival_and_frees_its_places() {
        let (handle, clock) = spawn();
        let due = add(clock.now(), Duration::from_secs(5));
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut waiting = Vec::new();
        for i in 0..50usize {
            let mut asked = request(&format!("task-{}", i % 7), Some(due));
            if i % 5 == 0 {
                asked.priority = Priority::Interactive;
            }
            let acquiring = handle.acquire(asked);
            let order = order.clone();
            waiting.push(tokio::spawn(async move {
                if let Acquired::Go { permit, .. } = acquiring.await {
                    let mut order = order.lock().unwrap_or_else(|p| p.into_inner());
                    order.push((i, permit.granted_at()));
                }
            }));
        }
        while delayed(&handle) < 50 {
            tokio::task::yield_now().await;
        }
        tokio::time::advance(Duration::from_secs(5)).await;
        for task in waiting {
            task.await.expect("the waiting task completes");
        }
        let order = order.lock().unwrap_or_else(|p| p.into_inner()).clone();
        assert!(order.iter().all(|(_, granted)| *granted >= due));
        // One thread: the woken tasks run in the order the scheduler answered them.
        let released: Vec<usize> = order.iter().map(|(i, _)| *i).collect();
        let expected: Vec<usize> = (0..50)
            .filter(|i| i % 5 == 0)
            .chain((0..50).filter(|i| i % 5 != 0))
            .collect();
        assert_eq!(released, expected);
        // Every permit dropped: slots and delayed places are all back.
        for _ in 0..100 {
            if handle.scopes().iter().all(|v| v.in_flight == 0) {
                break;
            }
            tokio::task::yield_now().await;
        }
        let views = handle.scopes();
        assert!(
            views.iter().all(|v| v.in_flight == 0 && v.delayed == 0),
            "{views:?}"
        );
    }

    #[test]
    fn slab_reuses_vacated_slots_and_grows_by_chunks() {
        let mut slab = Slab::default();
        let (reply, _answer) = oneshot::channel();
        let waiter = |ticket: u64, reply: oneshot::Sender<Answer>| Waiter {
            ticket,
            task: Arc::new(("agent".to_owned(), "task".to_owned())),
            route: Arc::from("GET /"),
            scopes: ScopeIds::One(0),
            budget: ActionBudget::new(class(), None),
            since: Timestamp::UNIX_EPOCH,
            wake: Timestamp::UNIX_EPOCH,
            reply: Some(reply),
            priority: Priority::Normal,
            fresh: true,
            delayed: false,
            queued: false,
            timed: false,
            reconciliation: false,
        };
        let mut slots = vec![slab.insert(waiter(0, reply))];
        for ticket in 1..(SLAB_CHUNK as u64 + 1) {
            let (reply, _) = oneshot::channel();
            slots.push(slab.insert(waiter(ticket, reply)));
        }
        assert_eq!(slab.chunks.len(), 2);
        assert_eq!(slots, (0..=SLAB_CHUNK as u32).collect::<Vec<_>>());
        assert_eq!(slab.take(7).map(|w| w.ticket), Some(7));
        assert!(slab.take(7).is_none());
        slab.vacate(9);
        assert!(slab.get_mut(9).is_none());
        let (reply, _) = oneshot::channel();
        let reused = slab.insert(waiter(100, reply));
        assert!(reused == 7 || reused == 9);
        assert_eq!(slab.get_mut(reused).map(|w| w.ticket), Some(100));
        assert_eq!(slab.iter().count(), SLAB_CHUNK);
    }
}
