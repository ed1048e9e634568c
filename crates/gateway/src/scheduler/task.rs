//! The scheduler task and the one state it owns: it takes the messages, examines the waiting
//! actions when they are due, and publishes the scope views.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
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
    pacing::{Admission, AdmitRequest, Pacer, ScopeRecord, ScopeState, WaitReason},
    policy::Policy,
};
use jiff::{SignedDuration, Timestamp};
use tokio::sync::{mpsc, oneshot};

use super::{
    messages::{Answer, Msg, PendingAcquire, Refusal, RetryQuotaRefused, RetryTokens, ScopeSignal},
    scopes::{
        admit_scopes, latest_boundary, positive, refresh, ScopeEntry, ScopeId, ScopeIds, ScopeView,
    },
    waiting::{try_delay, undelay, Interner, Slab, TaskKey, Waiter},
};
use crate::{clock::TokioClock, metrics::Metrics};

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

/// The one scope state, shared by the scheduler task and the callers that decide in place.
pub(super) struct Shared {
    pub(super) state: Mutex<State>,
    /// `Acquire` messages sent and not yet taken into the state. While one is on its way, no
    /// newcomer is admitted in place: it would be decided before an earlier arrival.
    pub(super) in_transit: AtomicU64,
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
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// All scope state and every waiting action, behind the one lock ([`Shared`]).
pub(super) struct State {
    /// Scope table; a [`ScopeId`] indexes it.
    pub(super) scopes: Vec<ScopeEntry>,
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
    pub(super) timers: BTreeMap<(Timestamp, u64), u32>,
    /// Slots to examine in the next pump (entries whose waiter is not `queued` are stale).
    pub(super) ready: Vec<u32>,
    /// Slots waiting for a concurrency slot (stale entries are skipped when drained).
    pub(super) slot_waiters: Vec<u32>,
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
    pub(super) cancelled_tasks: HashMap<String, HashSet<String>>,
    rng: SplitMix64,
    pub(super) clock: TokioClock,
    metrics: Arc<Metrics>,
    backoff: BackoffConfig,
    default_max_concurrent: u32,
    default_max_delayed: u32,
    retry_quota: RetryQuotaConfig,
    tx: mpsc::UnboundedSender<Msg>,
    views: Arc<Mutex<Arc<Vec<ScopeView>>>>,
    /// Shut down: every `acquire` is answered `Stopped`.
    pub(super) stopped: bool,
}

/// `ts` plus `d`, saturating at [`Timestamp::MAX`].
pub(super) fn add(ts: Timestamp, d: Duration) -> Timestamp {
    SignedDuration::try_from(d)
        .ok()
        .and_then(|d| ts.checked_add(d).ok())
        .unwrap_or(Timestamp::MAX)
}

/// The scheduler task: sleeps until a message or the earliest wake, then takes the state,
/// handles everything queued, examines what is due and publishes.
pub(super) async fn run(shared: Arc<Shared>, mut rx: mpsc::UnboundedReceiver<Msg>) {
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
pub(super) fn handle_counted(shared: &Shared, state: &mut State, msg: Msg) -> bool {
    let arrival = matches!(msg, Msg::Acquire(_));
    let stop = state.handle(msg);
    if arrival {
        shared.in_transit.fetch_sub(1, Ordering::SeqCst);
    }
    stop
}

/// Whether `agent`'s task `task_id` is among `cancelled` (a map lookup only once a task was
/// cancelled; nothing is copied).
pub(super) fn is_cancelled(
    cancelled: &HashMap<String, HashSet<String>>,
    agent: &str,
    task_id: &str,
) -> bool {
    !cancelled.is_empty()
        && cancelled
            .get(agent)
            .is_some_and(|tasks| tasks.contains(task_id))
}

impl State {
    /// The state of a new scheduler: one record (and pacer, when the scope publishes a limit)
    /// per policy scope, published once. `tx` reaches the scheduler task, `views` is where the
    /// scope views are published.
    pub(super) fn new(
        policy: &Policy,
        clock: TokioClock,
        metrics: Arc<Metrics>,
        seed: u64,
        tx: mpsc::UnboundedSender<Msg>,
        views: Arc<Mutex<Arc<Vec<ScopeView>>>>,
    ) -> Self {
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
            tx,
            views,
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
        state
    }

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
    pub(super) fn release(&mut self, scopes: &ScopeIds) {
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

    /// Deposits into the retry quotas (see [`SchedulerHandle::deposit`](super::SchedulerHandle::deposit)).
    pub(super) fn deposit(&mut self, scopes: &[String], tokens: Option<RetryTokens>) {
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
    pub(super) fn scope_set(&mut self, names: &[String]) -> ScopeIds {
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
    pub(super) fn publish(&mut self) {
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
                    let mut view = ScopeView::unfilled(
                        entry.provider.clone(),
                        name.strip_prefix(&prefix).unwrap_or(name).to_owned(),
                    );
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

/// The boundary plus a jitter of up to `min(cap(1), boundary_spread)`, trimmed to the deadline
/// and the wait budget (never below the boundary).
pub(super) fn jittered(
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
