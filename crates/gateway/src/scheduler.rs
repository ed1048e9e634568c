//! The scheduler: ONE task that owns all scope state and decides when each attempt may leave.
//!
//! Why one owner: a 429 on one action must slow down every action of its scope (SPEC §4.1), and
//! no two workers may both believe the next slot is theirs. If scope records, GCRA pacers,
//! concurrency slots and delayed counts lived behind many locks, "update the record, then
//! schedule the retry" would race with other workers reading the old record. Here they live in
//! one tokio task; actions talk to it through messages and it answers in arrival order, so every
//! decision sees every earlier signal.
//!
//! How: an action asks for permission with [`SchedulerHandle::acquire`]. The scheduler runs the
//! core's dispatch check ([`backstop_core::pacing::admit`]) in SPEC §4.1 order — cancellation and
//! deadline, every scope's `next_allowed_at`, pacing (headroom × published rate, interactive
//! reserve), concurrency slots — and answers with a [`Permit`] (the slots come back when the
//! permit drops), a refusal with its outcome, or nothing yet: the action then waits in the
//! delayed queue, a [`BinaryHeap`] keyed by wake instant and priority, counted against each
//! scope's `max_delayed_requests` (past it: `scope_saturated` at once). The task sleeps with one
//! `sleep_until` for the earliest wake; an action waiting for a concurrency slot has no instant
//! and is woken when a slot is released. Nothing busy-loops and no worker is held while waiting.
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
    cmp::Reverse,
    collections::{BTreeMap, BinaryHeap, HashMap, HashSet},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use backstop_core::{
    backoff::BackoffConfig,
    budget::{ActionBudget, Deposit, RetryCause, RetryQuota, RetryQuotaConfig, RetryToken},
    clock::Clock,
    outcome::Outcome,
    pacing::{
        admit, Admission, AdmitRequest, Pacer, Priority, ScopeRecord, ScopeState, WaitReason,
    },
    policy::Policy,
};
use jiff::{SignedDuration, Timestamp};
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
    /// Requests the provider says are left in the current window.
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
    },
    /// The scheduler has stopped (shutdown): nothing was charged, the action stays as stored.
    Stopped {
        /// The budget as it was.
        budget: ActionBudget,
    },
}

/// Concurrency slots of one admitted attempt; dropping it returns them to their scopes.
#[derive(Debug)]
pub struct Permit {
    scopes: Vec<String>,
    tx: mpsc::UnboundedSender<Msg>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let scopes = std::mem::take(&mut self.scopes);
        // A stopped scheduler has no slots to return.
        let _ = self.tx.send(Msg::Release { scopes });
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

#[derive(Debug)]
enum Msg {
    Acquire {
        ticket: u64,
        request: AcquireRequest,
        reply: oneshot::Sender<Acquired>,
    },
    Abandon {
        ticket: u64,
    },
    Release {
        scopes: Vec<String>,
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
    views: Arc<Mutex<Arc<Vec<ScopeView>>>>,
    next_ticket: Arc<AtomicU64>,
}

/// Sends `Abandon` if an `acquire` future is dropped before its answer arrived.
struct AbandonGuard {
    ticket: u64,
    tx: mpsc::UnboundedSender<Msg>,
    armed: bool,
}

impl Drop for AbandonGuard {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.tx.send(Msg::Abandon {
                ticket: self.ticket,
            });
        }
    }
}

impl SchedulerHandle {
    /// Spawns the scheduler task with one record (and pacer, when the scope publishes a limit)
    /// per policy scope. Must be called inside a tokio runtime. `seed` seeds the jitter draws.
    pub fn spawn(policy: &Policy, clock: TokioClock, metrics: Arc<Metrics>, seed: u64) -> Self {
        let mut scopes = BTreeMap::new();
        for (provider_name, provider) in &policy.providers {
            for scope in provider.scopes.values() {
                scopes.insert(
                    scope.name.clone(),
                    ScopeEntry {
                        provider: provider_name.clone(),
                        state: ScopeState {
                            record: scope.record(),
                            pacer: scope.pacer_config().map(Pacer::new),
                        },
                        quota: RetryQuota::new(policy.retry_quota),
                    },
                );
            }
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let views = Arc::new(Mutex::new(Arc::new(Vec::new())));
        let mut state = State {
            scopes,
            waiters: HashMap::new(),
            heap: BinaryHeap::new(),
            ready: Vec::new(),
            slot_waiters: HashSet::new(),
            cancelled_tasks: HashSet::new(),
            rng: SplitMix64::new(seed),
            clock,
            metrics,
            backoff: policy.backoff.config(),
            default_max_concurrent: policy.shared_scope.max_concurrent_requests,
            default_max_delayed: policy.shared_scope.max_delayed_requests,
            retry_quota: policy.retry_quota,
            tx: tx.clone(),
            views: views.clone(),
            next_seq: 0,
        };
        state.publish();
        tokio::spawn(state.run(rx));
        SchedulerHandle {
            tx,
            views,
            next_ticket: Arc::new(AtomicU64::new(1)),
        }
    }

    /// Asks for permission to send one attempt (SPEC §4.1). Resolves when the action may go, is
    /// refused, or the scheduler stopped. Dropping the future while it waits takes the action
    /// out of the delayed queue and frees its delayed count (client disconnect).
    pub async fn acquire(&self, request: AcquireRequest) -> Acquired {
        let budget = request.budget;
        let ticket = self.next_ticket.fetch_add(1, Ordering::Relaxed);
        let (reply, answer) = oneshot::channel();
        if self
            .tx
            .send(Msg::Acquire {
                ticket,
                request,
                reply,
            })
            .is_err()
        {
            return Acquired::Stopped { budget };
        }
        let mut guard = AbandonGuard {
            ticket,
            tx: self.tx.clone(),
            armed: true,
        };
        let answer = answer.await;
        guard.armed = false;
        // The scheduler answers only `Go` or `Refused`; a dropped sender means it stopped.
        answer.unwrap_or(Acquired::Stopped { budget })
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

    /// The scope records as last published by the scheduler.
    pub fn scopes(&self) -> Vec<ScopeView> {
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
}

struct Waiter {
    task_id: String,
    agent: String,
    priority: Priority,
    scopes: Vec<String>,
    budget: ActionBudget,
    /// Waited time up to here is charged.
    since: Timestamp,
    /// Not examined yet since it arrived ready (the gap until the first look is processing,
    /// not waiting: a class with `max_wait_seconds: 0` must still get its first attempt).
    fresh: bool,
    seq: u64,
    wake: Option<Timestamp>,
    delayed: bool,
    route: String,
    reply: oneshot::Sender<Acquired>,
}

/// Heap key: earliest wake first, then higher priority, then arrival.
type HeapKey = Reverse<(Timestamp, Reverse<Priority>, u64, u64)>;

struct State {
    scopes: BTreeMap<String, ScopeEntry>,
    waiters: HashMap<u64, Waiter>,
    heap: BinaryHeap<HeapKey>,
    ready: Vec<u64>,
    slot_waiters: HashSet<u64>,
    /// Cancelled tasks as `(agent, task id)`.
    cancelled_tasks: HashSet<(String, String)>,
    rng: SplitMix64,
    clock: TokioClock,
    metrics: Arc<Metrics>,
    backoff: BackoffConfig,
    default_max_concurrent: u32,
    default_max_delayed: u32,
    retry_quota: RetryQuotaConfig,
    tx: mpsc::UnboundedSender<Msg>,
    views: Arc<Mutex<Arc<Vec<ScopeView>>>>,
    next_seq: u64,
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

impl State {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Msg>) {
        loop {
            let wake = self.heap.peek().map(|Reverse((at, ..))| *at);
            let msg = match wake {
                Some(at) => {
                    let sleep = tokio::time::sleep_until(self.clock.instant_at(at));
                    tokio::select! {
                        biased;
                        msg = rx.recv() => Some(msg),
                        () = sleep => None,
                    }
                }
                None => Some(rx.recv().await),
            };
            match msg {
                Some(None) => return,
                Some(Some(msg)) => {
                    if self.handle(msg) {
                        return;
                    }
                    // Take everything already queued before deciding, so priorities compare
                    // across simultaneous arrivals.
                    while let Ok(msg) = rx.try_recv() {
                        if self.handle(msg) {
                            return;
                        }
                    }
                }
                None => {}
            }
            self.pump();
            self.publish();
        }
    }

    /// Handles one message; `true` to stop.
    fn handle(&mut self, msg: Msg) -> bool {
        match msg {
            Msg::Acquire {
                ticket,
                request,
                reply,
            } => self.enqueue(ticket, request, reply),
            Msg::Abandon { ticket } => {
                if let Some(waiter) = self.remove_waiter(ticket) {
                    tracing::info!(
                        task = %waiter.task_id,
                        route = %waiter.route,
                        "waiting action abandoned by its client before it was sent"
                    );
                    self.undelay(&waiter);
                }
            }
            Msg::Release { scopes } => {
                for name in &scopes {
                    if let Some(entry) = self.scopes.get_mut(name) {
                        entry.state.record.release();
                    }
                }
                // Actions waiting for a slot are reconsidered in the next pump.
                self.ready.extend(self.slot_waiters.iter().copied());
            }
            Msg::Signal {
                scopes,
                signal,
                done,
            } => {
                for name in &scopes {
                    self.ensure_scope(name);
                    if let Some(entry) = self.scopes.get_mut(name) {
                        let record = &mut entry.state.record;
                        match &signal {
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
            Msg::Deposit { scopes, tokens } => match tokens {
                None => {
                    for name in &scopes {
                        if let Some(entry) = self.scopes.get_mut(name) {
                            entry.quota.deposit(Deposit::FirstTrySucceeded);
                        }
                    }
                }
                Some(RetryTokens(tokens)) => {
                    for (name, token) in tokens {
                        if let Some(entry) = self.scopes.get_mut(&name) {
                            entry.quota.deposit(Deposit::RetrySucceeded(token));
                        }
                    }
                }
            },
            Msg::CancelTask {
                agent,
                task_id,
                reply,
            } => {
                self.cancelled_tasks
                    .insert((agent.clone(), task_id.clone()));
                let tickets: Vec<u64> = self
                    .waiters
                    .iter()
                    .filter(|(_, w)| w.agent == agent && w.task_id == task_id)
                    .map(|(t, _)| *t)
                    .collect();
                let mut dropped = 0;
                for ticket in tickets {
                    if let Some(waiter) = self.remove_waiter(ticket) {
                        dropped += 1;
                        self.refuse(
                            waiter,
                            Outcome::Cancelled,
                            "the task was cancelled; the action never sends again".to_owned(),
                            None,
                        );
                    }
                }
                tracing::info!(task = %task_id, dropped, "task cancelled: delayed actions dropped");
                let _ = reply.send(dropped);
            }
            Msg::Shutdown { done } => {
                tracing::info!(
                    waiting = self.waiters.len(),
                    "scheduler stopping; waiting actions stay recoverable in the store"
                );
                let _ = done.send(());
                return true;
            }
        }
        false
    }

    fn ensure_scope(&mut self, name: &str) {
        if !self.scopes.contains_key(name) {
            let provider = name.split_once('/').map_or(name, |(p, _)| p).to_owned();
            self.scopes.insert(
                name.to_owned(),
                ScopeEntry {
                    provider,
                    state: ScopeState {
                        record: ScopeRecord::new(
                            name,
                            self.default_max_concurrent,
                            self.default_max_delayed,
                        ),
                        pacer: None,
                    },
                    quota: RetryQuota::new(self.retry_quota),
                },
            );
        }
    }

    fn withdraw(
        &mut self,
        scopes: &[String],
        cause: RetryCause,
    ) -> Result<RetryTokens, RetryQuotaRefused> {
        let mut taken = Vec::new();
        for name in scopes {
            self.ensure_scope(name);
            let Some(entry) = self.scopes.get_mut(name) else {
                continue;
            };
            match entry.quota.withdraw(cause) {
                Ok(token) => taken.push((name.clone(), token)),
                Err(empty) => {
                    for (name, token) in taken {
                        if let Some(entry) = self.scopes.get_mut(&name) {
                            entry.quota.deposit(Deposit::RetrySucceeded(token));
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

    fn enqueue(&mut self, ticket: u64, request: AcquireRequest, reply: oneshot::Sender<Acquired>) {
        for name in &request.scopes {
            self.ensure_scope(name);
        }
        let now = self.clock.now();
        let seq = self.next_seq;
        self.next_seq += 1;
        let planned = request.not_before.is_some_and(|at| at > now);
        let mut waiter = Waiter {
            task_id: request.task_id,
            agent: request.agent,
            priority: request.priority,
            scopes: request.scopes,
            budget: request.budget,
            since: now,
            fresh: !planned,
            seq,
            wake: None,
            delayed: false,
            route: request.route,
            reply,
        };
        match request.not_before.filter(|at| *at > now) {
            Some(at) => {
                // A planned retry: it waits in the delayed queue until its instant.
                if let Err(detail) = self.delay(&mut waiter) {
                    self.refuse(waiter, Outcome::ScopeSaturated, detail, None);
                    return;
                }
                waiter.wake = Some(at);
                self.heap
                    .push(Reverse((at, Reverse(waiter.priority), seq, ticket)));
                self.waiters.insert(ticket, waiter);
            }
            None => {
                self.waiters.insert(ticket, waiter);
                self.ready.push(ticket);
            }
        }
    }

    fn remove_waiter(&mut self, ticket: u64) -> Option<Waiter> {
        self.slot_waiters.remove(&ticket);
        self.waiters.remove(&ticket)
    }

    /// Counts the waiter in every scope's delayed queue.
    ///
    /// # Errors
    /// The `scope_saturated` detail when a scope's `max_delayed_requests` is reached; nothing
    /// stays counted then.
    fn delay(&mut self, waiter: &mut Waiter) -> Result<(), String> {
        if waiter.delayed {
            return Ok(());
        }
        let mut counted: Vec<&str> = Vec::new();
        for name in &waiter.scopes {
            let Some(entry) = self.scopes.get_mut(name) else {
                continue;
            };
            if let Err(full) = entry.state.record.try_delay() {
                for done in counted {
                    if let Some(entry) = self.scopes.get_mut(done) {
                        entry.state.record.undelay();
                    }
                }
                tracing::info!(
                    task = %waiter.task_id,
                    route = %waiter.route,
                    scope = %name,
                    "refused: the scope's delayed queue is full (scope_saturated)"
                );
                return Err(full.to_string());
            }
            counted.push(name);
        }
        waiter.delayed = true;
        Ok(())
    }

    fn undelay(&mut self, waiter: &Waiter) {
        if waiter.delayed {
            for name in &waiter.scopes {
                if let Some(entry) = self.scopes.get_mut(name) {
                    entry.state.record.undelay();
                }
            }
        }
    }

    fn refuse(
        &mut self,
        waiter: Waiter,
        outcome: Outcome,
        detail: String,
        boundary: Option<Timestamp>,
    ) {
        self.undelay(&waiter);
        tracing::info!(
            task = %waiter.task_id,
            route = %waiter.route,
            outcome = %outcome,
            attempts_left = waiter.budget.attempts_remaining(),
            wait_left_ms = waiter.budget.wait_remaining().as_millis() as u64,
            detail = %detail,
            "action refused by the scheduler"
        );
        let _ = waiter.reply.send(Acquired::Refused {
            outcome,
            detail,
            budget: waiter.budget,
            boundary,
        });
    }

    /// Wakes due waiters and re-examines every ready one, highest priority first.
    fn pump(&mut self) {
        let now = self.clock.now();
        while let Some(Reverse((at, _, _, ticket))) = self.heap.peek().copied() {
            if at > now {
                break;
            }
            self.heap.pop();
            if let Some(waiter) = self.waiters.get_mut(&ticket) {
                if waiter.wake == Some(at) {
                    waiter.wake = None;
                    self.ready.push(ticket);
                }
            }
        }
        if self.ready.is_empty() {
            return;
        }
        let mut ready: Vec<(Reverse<Priority>, u64, u64)> = std::mem::take(&mut self.ready)
            .into_iter()
            .collect::<HashSet<u64>>()
            .into_iter()
            .filter_map(|t| {
                self.waiters
                    .get(&t)
                    .filter(|w| w.wake.is_none())
                    .map(|w| (Reverse(w.priority), w.seq, t))
            })
            .collect();
        ready.sort_unstable();
        for (_, _, ticket) in ready {
            self.examine(ticket, now);
        }
    }

    /// Runs the dispatch check for one waiter at `now`.
    fn examine(&mut self, ticket: u64, now: Timestamp) {
        let Some(mut waiter) = self.remove_waiter(ticket) else {
            return;
        };
        if waiter.reply.is_closed() {
            self.undelay(&waiter);
            return;
        }
        let waited = if std::mem::take(&mut waiter.fresh) {
            Duration::ZERO
        } else {
            positive(now.duration_since(waiter.since))
        };
        waiter.since = now;
        if !waited.is_zero() {
            if let Err(refusal) = waiter.budget.withdraw_wait(waited) {
                let boundary = self.latest_boundary(&waiter.scopes, now);
                self.refuse(waiter, refusal.outcome(), refusal.to_string(), boundary);
                return;
            }
        }
        let cancelled = self
            .cancelled_tasks
            .contains(&(waiter.agent.clone(), waiter.task_id.clone()));
        let admission = {
            let mut refs: Vec<&mut ScopeState> = self
                .scopes
                .iter_mut()
                .filter(|(name, _)| waiter.scopes.contains(name))
                .map(|(_, entry)| &mut entry.state)
                .collect();
            admit(
                AdmitRequest {
                    cancelled,
                    priority: waiter.priority,
                },
                &mut waiter.budget,
                &mut refs,
                now,
            )
        };
        match admission {
            Admission::Go => {
                self.undelay(&waiter);
                tracing::debug!(
                    task = %waiter.task_id,
                    route = %waiter.route,
                    priority = ?waiter.priority,
                    attempt = waiter.budget.attempts_used(),
                    "dispatch: attempt admitted"
                );
                let permit = Permit {
                    scopes: waiter.scopes.clone(),
                    tx: self.tx.clone(),
                };
                // If the client is gone the permit drops here and returns the slots.
                let _ = waiter.reply.send(Acquired::Go {
                    permit,
                    budget: waiter.budget,
                });
            }
            Admission::WaitUntil { at, reason } => {
                if let Err(detail) = self.delay(&mut waiter) {
                    self.refuse(waiter, Outcome::ScopeSaturated, detail, None);
                    return;
                }
                let wake = match &reason {
                    WaitReason::NextAllowedAt { .. } => self.jittered(at, &waiter, now),
                    WaitReason::Pacing { .. } => at,
                };
                match &reason {
                    WaitReason::NextAllowedAt { scope, source } => tracing::info!(
                        task = %waiter.task_id,
                        route = %waiter.route,
                        scope = %scope,
                        source = source.as_deref().unwrap_or("unknown"),
                        boundary = %at,
                        wake = %wake,
                        wait_left_ms = waiter.budget.wait_remaining().as_millis() as u64,
                        "waiting: the scope's next_allowed_at is in the future"
                    ),
                    WaitReason::Pacing { scope } => tracing::info!(
                        task = %waiter.task_id,
                        route = %waiter.route,
                        scope = %scope,
                        wake = %wake,
                        "waiting: local pacing of the scope"
                    ),
                }
                waiter.wake = Some(wake);
                self.heap.push(Reverse((
                    wake,
                    Reverse(waiter.priority),
                    waiter.seq,
                    ticket,
                )));
                self.waiters.insert(ticket, waiter);
            }
            Admission::WaitForSlot { scope } => {
                if let Err(detail) = self.delay(&mut waiter) {
                    self.refuse(waiter, Outcome::ScopeSaturated, detail, None);
                    return;
                }
                tracing::debug!(
                    task = %waiter.task_id,
                    route = %waiter.route,
                    scope = %scope,
                    "waiting for a concurrency slot"
                );
                self.slot_waiters.insert(ticket);
                self.waiters.insert(ticket, waiter);
            }
            Admission::Refuse { outcome, detail } => {
                let boundary = self.latest_boundary(&waiter.scopes, now);
                self.refuse(waiter, outcome, detail, boundary);
            }
        }
    }

    /// The boundary plus a jitter of up to `min(cap(1), boundary_spread)`, trimmed to the
    /// deadline and the wait budget (never below the boundary).
    fn jittered(&mut self, at: Timestamp, waiter: &Waiter, now: Timestamp) -> Timestamp {
        let spread = self.backoff.cap(1).min(self.backoff.boundary_spread);
        let mut extra = spread.mul_f64(self.rng.unit());
        let until = positive(at.duration_since(now));
        extra = extra.min(waiter.budget.wait_remaining().saturating_sub(until));
        if let Some(deadline) = waiter.budget.deadline() {
            extra = extra.min(positive(deadline.duration_since(at)));
        }
        add(at, extra)
    }

    fn latest_boundary(&self, scopes: &[String], now: Timestamp) -> Option<Timestamp> {
        scopes
            .iter()
            .filter_map(|name| self.scopes.get(name))
            .filter_map(|entry| entry.state.record.next_allowed_at)
            .filter(|at| *at > now)
            .max()
    }

    fn publish(&mut self) {
        let now = self.clock.now();
        let views: Vec<ScopeView> = self
            .scopes
            .iter()
            .map(|(name, entry)| {
                let record = &entry.state.record;
                let prefix = format!("{}/", entry.provider);
                ScopeView {
                    provider: entry.provider.clone(),
                    scope: name.strip_prefix(&prefix).unwrap_or(name).to_owned(),
                    request_class: None,
                    next_allowed_at: record.next_allowed_at,
                    remaining: record.remaining,
                    reset_after_seconds: record.reset_at.filter(|r| *r > now).map(|r| {
                        let d = positive(r.duration_since(now));
                        d.as_secs() + u64::from(d.subsec_nanos() > 0)
                    }),
                    source: record.source.clone(),
                    in_flight: record.in_flight,
                    delayed: record.delayed,
                }
            })
            .collect();
        for (name, entry) in &self.scopes {
            self.metrics
                .set_delayed(name, i64::from(entry.state.record.delayed));
            self.metrics
                .set_in_flight(name, i64::from(entry.state.record.in_flight));
        }
        let mut slot = self
            .views
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        *slot = Arc::new(views);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
