//! The engine: the executor that owns every retry, on top of the one scheduler.
//!
//! Why one owner: retries layered in SDKs, frameworks and proxies multiply calls exactly when a
//! provider is already throttling. The engine is the single place that decides whether another
//! attempt leaves, and every decision is the core's (`classify`, `plan_retry`, `admit`, budgets,
//! breaker) — the engine only carries them out. One request, from the door to the audit log:
//!
//! ```text
//! Engine::execute ─► Engine::run (record.rs): prepare ─► admit_action ─► [found_under_key ─►
//!   take_over] ─► circuit_open ─► budget_of ─► Engine::attempts
//! Engine::attempts (attempt.rs), one `Next` at a time over an `Attempt` context:
//!   Admit ─► Send ─► Classify ─► Settle ─► Decide ─┬─► Succeed | Fail ─────────────► Finish
//!     ▲                                            ├─► Reconcile (uncertain.rs) ─► Plan | Finish
//!     │                                            └─► Plan ─► Schedule (retry.rs) ─► Finish
//!     └───────────────────────────────────────────────────────────┘ (retry due)
//! ```
//!
//! For each attempt, in this order:
//!
//! 1. `admit`: ask the [scheduler](crate::scheduler) for a permit (SPEC §4.1: cancellation and
//!    deadline, every scope's `next_allowed_at`, pacing, concurrency slots);
//! 2. `send`: mark the attempt `sent` in the store — durable before the bytes leave (SPEC §9,
//!    §12) — then send it once through the [`Transport`];
//! 3. `classify`: the answer with the route's `ClassifyRules` (a 2xx body is never read; a
//!    non-2xx body is buffered up to [`ERROR_BODY_LIMIT`] for the error-code pointer, then
//!    passed on);
//! 4. `settle`: on a rate limit or quota signal update the scope record FIRST (scheduler, then
//!    `store.update_scope`), so no other action assumes the next slot is its own;
//! 5. `decide`: reconcile an uncertain write (SPEC §6), pass the response through, end with
//!    the final failure (`outcomes.rs`), or `plan` the retry (`plan_retry`: full jitter,
//!    boundary precedence, stop instead of sleeping into failure), withdraw from the scope
//!    retry quota and `schedule` it durably; an end carries the SPEC §5 context and
//!    `next_safe`, and is recorded with the attempt's result (the hash-chained audit is the
//!    store's).
//!
//! Provider responses the agent must see (`rejected`, `conflict`) pass through unchanged;
//! outcomes the gateway makes (`budget_exhausted`, `deadline_exhausted`, `quota_exhausted`,
//! `scope_saturated`, `circuit_open`, `reconciliation_required`, `cancelled`) come back as
//! [`Execution::Outcome`]. Every answer carries the receipt (action id, attempts sent).
//!
//! Budgets (SPEC §5): the class budget (`max_attempts`, `max_wait_seconds`, capped further by
//! `Prefer: wait=N`), the task deadline, the scope retry quota, and the per-task circuit breaker
//! (SPEC §7) keyed by the sanitized fingerprint (method + route template + configured payload
//! fields) and the normalized provider error code.
//!
//! Cancellation: dropping the [`Engine::execute`] future before an attempt is sent (the client
//! disconnected) ends the action `cancelled` in the store — a write keeps an attempt already
//! out until its answer is recorded (`caller_gone`), a side-effect-free call runs on for a
//! short grace (`detached`); [`Engine::cancel_task`] drops a task's
//! delayed actions before they wake. A cancelled action never sends again: the scheduler refuses
//! it and the store refuses to mark another attempt sent.

use std::{
    collections::{HashMap, HashSet},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
};

use backstop_core::{
    breaker::{RequestFingerprint, TaskBreakers},
    classify::Disposition,
    clock::Clock,
    outcome::Outcome,
    pacing::Priority,
    policy::Policy,
    reconcile::{mint_idempotency_key, validate_idempotency_key},
};
use backstop_store::{Finish, Store, StoreError};

use crate::{
    action::{is_safe_method, ActionReceipt, ActionSpec, Execution},
    clock::TokioClock,
    coalesce::{FlightKey, Flights, LeaderGuard, Role, SHARED_BODY_LIMIT},
    metrics::Metrics,
    problem::Problem,
    scheduler::SchedulerHandle,
    transport::Transport,
};

pub use crate::scheduler::ScopeView;

mod actions;
mod attempt;
mod breaker;
mod build;
mod caller_gone;
mod cancelled;
mod detached;
mod guard;
mod outcomes;
mod quota_escalations;
mod record;
mod refusals;
mod replay;
mod resend;
mod resume;
mod retry;
mod scopes;
mod stopped;
mod store_calls;
mod takeover;
mod uncertain;
mod writes;

use attempt::{Answer, Attempt, Next, Seen};
use build::RuleTable;
use guard::{uncertain_result, ActionGuard, SoFar};
use outcomes::{wait_ms, wait_then_abort, UnrecordedRetry};
use record::Run;
use refusals::{is_store_failure, may_have_committed, problem_answer, unrecorded, with_ids};
use replay::{
    from_shared, into_shared, kept_for_replay, read_bounded, without_provider_replay_mark,
};
use stopped::{Interrupted, Stopped};
use store_calls::ReadRecords;

pub use detached::{CALLER_GRACE, RESEND_WINDOW};
pub use quota_escalations::ACCOUNT_CONFIGURATION_STREAK;
pub use writes::{DEFERRED_RECORD_WINDOW, RESTARTED_BEFORE_RETRY, STORE_FAILED_BEFORE_RETRY};

/// The reason a read cut off by a crash is closed at the next start (its action ends
/// `cancelled`): its attempt was sent but no result was recorded, and nobody waits for it
/// any more. Nothing is sent again; resubmitting the read is safe.
pub const RESTARTED_DURING_READ: &str =
    "the gateway restarted while this read was in flight; the caller's request is gone — resubmit";

/// The `source` of an attempt result recorded `uncertain` when the client went away while the
/// attempt was in flight.
const DISCONNECTED_DURING_ATTEMPT: &str = "client disconnected during the attempt";

/// The `source` of an attempt result recorded `uncertain` at restart: the attempt was sent and
/// the previous run stopped before its result was recorded.
const RESTARTED_BEFORE_RESULT: &str = "the gateway restarted before the result was recorded";

/// The reason a read recorded but never sent is closed at the next start (its action ends
/// `cancelled`): the gateway stopped or crashed while it waited for its first attempt (its
/// caller was answered `503 shutting_down`, or went away with the crash). Nothing was sent;
/// resubmitting the read is safe.
pub const RESTARTED_BEFORE_READ_SENT: &str =
    "the gateway stopped before this read was sent; nothing was sent and the caller's request is gone — resubmit";

/// The reason a write recorded but never sent, whose request was not kept (its body over
/// `--retry-body-bytes`), is closed at the next start (its action ends `cancelled`): nothing
/// was sent, and a resend under the same key reopens and sends it.
pub const RESTARTED_BEFORE_WRITE_SENT: &str =
    "the gateway stopped before this write was sent and its request was too large to keep; nothing was sent — resend it under the same Idempotency-Key to have it sent";

use actions::Notify;
pub use actions::{
    Completion, DecisionApplied, KeptResponse, LookupAnswer, Submitted, DECISION_WAIT,
    KEPT_ACTIONS, KEPT_BODY_LIMIT,
};

/// Most requests of escalated writes held in memory for operator decisions (`retry_same_key`,
/// `send_new`); past it, a decision answers `request_not_held` and the agent resubmits.
pub const HELD_REQUESTS: usize = 1024;

/// Largest part of a non-2xx response body read for classification (64 KiB); the rest streams
/// on to the agent untouched.
pub const ERROR_BODY_LIMIT: usize = 64 * 1024;

/// Errors of the engine's management calls.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The caller has no task with this id (task ids are namespaced per agent, so another
    /// agent's task with the same id is not the caller's and is not mentioned).
    #[error("task {0:?} not found")]
    UnknownTask(String),
    /// The store failed.
    #[error("store: {0}")]
    Store(#[from] StoreError),
    /// A blocking store call could not run to completion.
    #[error("store call aborted: {0}")]
    Aborted(String),
    /// The gateway is shutting down: what needed the provider (a reconciliation lookup) was
    /// not sent, and the action is left as the store has it for the next start.
    #[error("the gateway is shutting down")]
    ShuttingDown,
}

/// What [`Engine::cancel_task`] changed.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct TaskCancelled {
    /// The task id.
    pub task_id: String,
    /// Actions that ended with `cancelled` in the store.
    pub actions_cancelled: u64,
    /// Durable scheduled retries dropped before they woke.
    pub retries_dropped: u64,
    /// Actions taken out of the scheduler's delayed queue.
    pub waiting_dropped: u64,
    /// The task's writes not cancelled because an attempt of theirs is unsettled (the provider
    /// may have acted on it): each is reconciled with its original key instead, found →
    /// `succeeded`, otherwise `escalated`; nothing is sent for it.
    pub reconciling: Vec<Reconciling>,
}

/// A write of a cancelled task that is reconciled, not cancelled (see [`TaskCancelled`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Reconciling {
    /// The write's action id.
    pub action_id: i64,
    /// Its attempt that was sent and never answered (`uncertain`), which no later answer under
    /// the same key settled.
    pub uncertain_attempt: u32,
}

/// The gateway's executor and scheduler: a cheap, cloneable handle.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").finish_non_exhaustive()
    }
}

struct Inner {
    policy: Arc<Policy>,
    store: Arc<dyn Store>,
    transport: Arc<dyn Transport>,
    clock: TokioClock,
    metrics: Arc<Metrics>,
    scheduler: SchedulerHandle,
    rng: Mutex<crate::scheduler::SplitMix64>,
    /// Circuit breakers per task, by agent, then task id (looked up without copying either);
    /// the core forgets those with nothing left to say (see [`TaskBreakers`]).
    breakers: Mutex<TaskBreakers>,
    /// `backstop_task_breakers`: the number of task breakers held, set on every change.
    breakers_gauge: prometheus_client::metrics::gauge::Gauge,
    flights: Arc<Flights>,
    shutting_down: AtomicBool,
    /// `true` once the stop's grace is running out ([`Engine::give_up_attempts`]): an attempt
    /// still out is no longer waited for.
    given_up: tokio::sync::watch::Sender<bool>,
    /// `true` once restart recovery has listed the attempts left unfinished by the previous
    /// run: no action records anything before, so an attempt of this run is never mistaken
    /// for one the restart interrupted.
    recovery_listed: tokio::sync::watch::Sender<bool>,
    /// Writes of cancelled tasks being reconciled, by action id: one closer at a time (see
    /// [`cancelled`]).
    closing: Mutex<HashSet<i64>>,
    /// Writes recorded and never sent, by action id: those the previous run left (see
    /// [`Store::unsent_writes`], listed with the unfinished attempts, before any action of this
    /// run), and those of this run whose first send the store could not record. The agent's
    /// resend under the same key takes one over and sends it as the same action.
    unsent: Mutex<HashSet<i64>>,
    /// Actions a restart-recovery path of this run has taken up, by action id: each is
    /// recovered once per run (see [`Inner::take_up`]), whichever of the lists read at start
    /// names it first.
    recovering: Mutex<HashSet<i64>>,
    /// Provider credential headers for lookups made without an agent request (after a restart).
    credentials: Mutex<HashMap<String, (http::HeaderName, http::HeaderValue)>>,
    /// Prepared requests of escalated writes (in memory only), for operator decisions.
    held: Mutex<HashMap<i64, ActionSpec>>,
    /// Side-effect-free calls in flight and their final answers kept for re-sends (see
    /// [`detached`]).
    detached: detached::Detached,
    /// Completions of background actions, kept for their agent (bounded, in memory only).
    kept: Mutex<actions::Kept>,
    /// Held while a `shared_quota_exhausted` escalation is looked for and opened, so that
    /// several actions meeting the same exhausted quota at once open one per scope.
    quota_escalations: tokio::sync::Mutex<()>,
    /// Runs of `rate_limited` answers per scope (in memory only), for `account_configuration`.
    limit_streaks: Mutex<quota_escalations::LimitStreaks>,
    /// The classification rules of every `(provider, class)` pair of the policy, built once:
    /// the policy does not change while the engine runs, and building the rules (the
    /// error-code table, the pointer lists) for every action cost more than classifying.
    rules: RuleTable,
    /// The request fingerprints of the configured routes that fingerprint no payload field, by
    /// template and method: each is the SHA-256 of the method and the template alone, the same
    /// for every action of its route (see [`Inner::fingerprint`]).
    route_fingerprints: HashMap<String, Vec<(String, RequestFingerprint)>>,
}

/// The `host:port` of an upstream URL (`http://api.example.com:8443/v1/x` →
/// `api.example.com:8443`), or the URL itself when it has no authority: for messages only.
fn upstream_authority(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or(rest);
    // Userinfo never belongs in a message.
    authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host)
}

fn store_outcome(outcome: Outcome) -> backstop_store::Outcome {
    backstop_store::Outcome::parse(outcome.as_str()).unwrap_or(backstop_store::Outcome::Cancelled)
}

fn core_outcome(outcome: backstop_store::Outcome) -> Outcome {
    serde_json::from_value(serde_json::Value::String(outcome.as_str().to_owned()))
        .unwrap_or(Outcome::Cancelled)
}

fn store_disposition(d: Disposition) -> backstop_store::Disposition {
    backstop_store::Disposition::parse(d.as_str()).unwrap_or(backstop_store::Disposition::Uncertain)
}

fn store_priority(p: Priority) -> backstop_store::Priority {
    match p {
        Priority::Interactive => backstop_store::Priority::Interactive,
        Priority::Normal => backstop_store::Priority::Normal,
        Priority::Background => backstop_store::Priority::Background,
    }
}

/// A stored task's priority as the scheduler paces with it.
fn core_priority(p: backstop_store::Priority) -> Priority {
    match p {
        backstop_store::Priority::Interactive => Priority::Interactive,
        backstop_store::Priority::Normal => Priority::Normal,
        backstop_store::Priority::Background => Priority::Background,
    }
}

/// A count as a gauge value (saturating).
fn gauge_value(count: usize) -> i64 {
    i64::try_from(count).unwrap_or(i64::MAX)
}

fn coalesce_key(spec: &ActionSpec) -> String {
    crate::coalesce::read_key(
        &spec.agent,
        &spec.request.method,
        &spec.request.url,
        &spec.request.headers,
        &spec.payload_digest,
    )
}

impl Engine {
    /// Registers the credential header (`name: value`) that reconciliation lookups of
    /// `provider` carry when no agent request is at hand (restart recovery). Lookups made for a
    /// running action reuse the credential header of that action's request instead.
    pub fn set_credential(&self, provider: &str, name: http::HeaderName, value: http::HeaderValue) {
        self.inner
            .credentials
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(provider.to_owned(), (name, value));
    }

    /// The scope records as the scheduler last published them (for `GET /v1/scopes`).
    pub fn scopes(&self) -> Vec<ScopeView> {
        self.inner.scheduler.scopes()
    }

    /// The number of per-task circuit breakers held in memory (SPEC §7), for metrics and
    /// diagnostics: tasks with a failure streak not yet ended by a success, not cancelled, and
    /// not forgotten (`breaker.forget_after_seconds`) — plus forgotten ones a sweep has not
    /// reclaimed yet. Also exported as `backstop_task_breakers`.
    pub fn breakers_held(&self) -> usize {
        self.inner
            .breakers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .len()
    }

    /// Stops taking new work: later [`Engine::execute`] calls are answered `503 shutting_down`
    /// without being recorded (with `sent: false`, the `task` and, for a write, the
    /// `idempotency_key`), waiting actions are released without a final outcome (their
    /// scheduled retries stay in the store, recoverable after a restart), and the scheduler
    /// task ends. A write whose answer never comes (`uncertain`) after this is not reconciled
    /// now — its lookup would need the stopped scheduler — but left sent without a result for
    /// the next start to reconcile with its original key (SPEC §12).
    pub async fn shutdown(&self) {
        self.inner.shutting_down.store(true, Ordering::SeqCst);
        self.inner.scheduler.shutdown().await;
        // Reads' records queued without waiting are committed before the gateway stops.
        if let Err(e) = self.inner.blocking(|s| s.flush()).await {
            tracing::warn!(error = %e, "could not commit the queued read records at shutdown");
        }
    }

    /// Gives up every attempt still out, once the stop's grace is running out (after
    /// [`Engine::shutdown`]; the provider is slower than the grace): its caller is answered
    /// `503 shutting_down` at once, with `after_restart` (`reconcile` for a write, `cancel` for a
    /// read), `last_signal` `uncertain` and `sent: true`, instead of having its connection cut
    /// when the grace ends. Nothing is recorded for the attempt: it stays sent without a result,
    /// which the next start reconciles with its original key for a write and closes `cancelled`
    /// for a read (SPEC §12). Attempts sent later are given up as soon as they leave. A
    /// reconciliation lookup still out is given up too (audited `inconclusive`, its status
    /// unknown), and its write left sent without a result.
    pub fn give_up_attempts(&self) {
        self.inner.given_up.send_replace(true);
    }

    /// Sets the `backstop_open_escalations` gauge to the number of escalations open in the
    /// store (read when `/metrics` is asked for, so escalations opened or decided by any path
    /// are counted). A store that cannot be read leaves the gauge as it was, with a warning.
    pub async fn refresh_open_escalations(&self) {
        match self.inner.blocking(|s| s.count_open_escalations()).await {
            Ok(open) => self.inner.metrics.set_open_escalations(open),
            Err(e) => tracing::warn!(error = %e, "could not count the open escalations"),
        }
    }

    /// Cancels the task `task_id` of `agent` (SPEC §4.3): its delayed actions are dropped
    /// before they wake, their slots and delayed counts freed, every unfinished action ends
    /// `cancelled` (audited) and no action of the task sends again — but a write with an
    /// unsettled attempt (the provider may have acted on it), which is reconciled with its
    /// original key instead (found → `succeeded`, otherwise `escalated`; nothing is sent) and
    /// listed in [`TaskCancelled::reconciling`].
    /// Task ids are namespaced per agent: another agent's task with the same id is neither
    /// touched nor revealed.
    ///
    /// # Errors
    /// [`EngineError::UnknownTask`] when `agent` has no such task (whether or not another agent
    /// has), or a store failure.
    pub async fn cancel_task(
        &self,
        task_id: &str,
        agent: &str,
    ) -> Result<TaskCancelled, EngineError> {
        self.cancel_task_as(task_id, Some(agent)).await
    }

    /// [`Engine::cancel_task`] for `agent`, or, when `agent` is `None` (an operator, who may
    /// see all), for EVERY agent's task with this id; the counts of the answer are then summed
    /// over those tasks.
    ///
    /// # Errors
    /// [`EngineError::UnknownTask`] when no task matches, or a store failure.
    pub async fn cancel_task_as(
        &self,
        task_id: &str,
        agent: Option<&str>,
    ) -> Result<TaskCancelled, EngineError> {
        let inner = &self.inner;
        let id = task_id.to_owned();
        let owners: Vec<String> = match agent {
            Some(agent) => {
                let agent = agent.to_owned();
                inner
                    .blocking(move |s| s.task(&agent, &id))
                    .await?
                    .into_iter()
                    .map(|t| t.agent)
                    .collect()
            }
            None => inner
                .blocking(move |s| s.tasks_of_every_agent(&id))
                .await?
                .into_iter()
                .map(|t| t.agent)
                .collect(),
        };
        if owners.is_empty() {
            return Err(EngineError::UnknownTask(task_id.to_owned()));
        }
        let mut total = TaskCancelled {
            task_id: task_id.to_owned(),
            actions_cancelled: 0,
            retries_dropped: 0,
            waiting_dropped: 0,
            reconciling: Vec::new(),
        };
        for owner in owners {
            let waiting_dropped = inner.scheduler.cancel_task(&owner, task_id).await;
            let (agent, id) = (owner.clone(), task_id.to_owned());
            let now = inner.clock.now();
            let report = inner
                .blocking(move |s| s.cancel_task(&agent, &id, now))
                .await?;
            // The task takes no new actions: its breaker has nothing left to refuse.
            {
                let mut breakers = inner
                    .breakers
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
                if breakers.forget_task(&owner, task_id) {
                    inner.breakers_gauge.set(gauge_value(breakers.len()));
                }
            }
            tracing::info!(
                task = %task_id,
                agent = %owner,
                actions = report.actions_cancelled,
                retries = report.retries_dropped,
                waiting = waiting_dropped,
                reconciling = report.unsettled.len(),
                "task cancelled"
            );
            total.actions_cancelled += report.actions_cancelled;
            total.retries_dropped += report.retries_dropped;
            total.waiting_dropped += waiting_dropped;
            for unsettled in report.unsettled {
                tracing::info!(
                    task = %task_id,
                    agent = %owner,
                    action = unsettled.action.0,
                    uncertain_attempt = unsettled.attempt,
                    "task cancelled: the write's attempt may have been acted on, so it is reconciled with its original key, not cancelled"
                );
                total.reconciling.push(Reconciling {
                    action_id: unsettled.action.0,
                    uncertain_attempt: unsettled.attempt,
                });
                let closer = inner.clone();
                tokio::spawn(async move { closer.close_cancelled_write(unsettled.action).await });
            }
        }
        Ok(total)
    }

    /// Carries out one action to its end (see the module docs). Dropping the future before an
    /// attempt was sent cancels the action (audited `cancelled`, slot and delayed count freed).
    ///
    /// Coalescing: on a `coalesce: true` route, identical safe reads of one agent in flight
    /// (same agent, method, URL, end-to-end headers and body digest; see
    /// `coalesce::read_key`) share one upstream call; the shared 2xx body is buffered
    /// (up to [`SHARED_BODY_LIMIT`]) and every caller gets a copy, joined to the leader's action
    /// (its receipt). Reads of different agents are never shared.
    pub async fn execute(&self, spec: ActionSpec) -> Execution {
        self.execute_notifying(&spec, None).await
    }

    /// [`Engine::execute`], telling `notify` as soon as this request runs an action — recorded
    /// new, or recorded before under the agent's key and taken over — or joined the one running
    /// under its key; a request answered otherwise (a replay, a refusal) leaves it untold.
    ///
    /// The action's spec is borrowed all the way down: each async fn that took it by value
    /// would keep a copy of its own (672 bytes) in the future every action holds while it waits.
    pub(crate) async fn execute_notifying(
        &self,
        spec: &ActionSpec,
        notify: Option<&Notify>,
    ) -> Execution {
        if self.inner.shutting_down.load(Ordering::SeqCst) {
            // Nothing is recorded: the answer names the task and, for a write, the key in
            // effect (the agent's, or one minted for it to send again with), as the other
            // `503 shutting_down` and `store_unavailable` answers do.
            let receipt = ActionReceipt {
                action_id: 0,
                attempts: 0,
                idempotency_key: self.unrecorded_key(spec),
                provider_operation_id: None,
                task: None,
            };
            let problem = with_ids(
                Problem::shutting_down_during(
                    false,
                    "backstop is shutting down and takes no new work; nothing was sent for this \
                     request, so sending it again is safe",
                ),
                spec,
                &receipt,
            );
            return problem_answer(receipt, problem);
        }
        if !*self.inner.recovery_listed.borrow() {
            // Only right after start: wait until restart recovery has listed what it owns.
            let mut listed = self.inner.recovery_listed.subscribe();
            let _ = listed.wait_for(|listed| *listed).await;
        }
        let mut read_guard = None;
        if spec.route.coalesce && is_safe_method(&spec.request.method) {
            let key = FlightKey::Read(coalesce_key(spec));
            loop {
                match self.inner.flights.join_or_lead(key.clone()) {
                    Role::Follower(mut rx) => match rx.recv().await {
                        Ok(shared) => {
                            tracing::debug!(route = %spec.route.template, "coalesced read answered by the shared call");
                            return from_shared(shared);
                        }
                        // The leader went away without a result: start over.
                        Err(_) => continue,
                    },
                    Role::Leader(guard) => {
                        read_guard = Some(guard);
                        break;
                    }
                }
            }
        }
        if read_guard.is_none() && notify.is_none() {
            if spec.is_side_effect_free_call() {
                return Box::pin(self.execute_detached(spec)).await;
            }
            if spec.has_side_effect() {
                return Box::pin(self.execute_write_detached(spec)).await;
            }
        }
        // One call site: each `.await` of the same future holds storage of its own in this
        // future, which every call boxes (about 12 KB more per action with two, in the release
        // build's layout).
        self.lead(spec, read_guard, notify).await
    }

    /// The idempotency key a write answered before anything is recorded carries: the agent's
    /// (when it is usable: a key the door would refuse is not echoed) or one minted for it,
    /// as [`Engine::run`] would have; `None` for a read.
    fn unrecorded_key(&self, spec: &ActionSpec) -> Option<String> {
        if !spec.has_side_effect() {
            return None;
        }
        match &spec.idempotency_key {
            Some(supplied) => validate_idempotency_key(supplied).ok().map(str::to_owned),
            None => Some(mint_idempotency_key(self.inner.random_16())),
        }
    }

    /// Runs the action and shares its result with whoever joined it.
    async fn lead(
        &self,
        spec: &ActionSpec,
        read_guard: Option<LeaderGuard>,
        notify: Option<&Notify>,
    ) -> Execution {
        let (execution, action_guard) = self.run(spec, notify).await;
        let senders: Vec<_> = [read_guard, action_guard]
            .into_iter()
            .flatten()
            .filter_map(LeaderGuard::finish)
            .collect();
        if senders.is_empty() {
            return execution;
        }
        let shared = into_shared(execution, &spec.route.template, SHARED_BODY_LIMIT).await;
        for sender in senders {
            let _ = sender.send(shared.clone());
        }
        from_shared(shared)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;

    use super::build::{fingerprint_with, route_fingerprints, rule_table};

    #[tokio::test]
    async fn a_shared_copy_of_backstops_own_answer_keeps_its_retry_hint() {
        let receipt = ActionReceipt {
            action_id: 1,
            attempts: 1,
            idempotency_key: None,
            provider_operation_id: None,
            task: None,
        };
        let own = problem_answer(
            receipt.clone(),
            Problem::shutting_down_during(true, "send it again once backstop is back"),
        );
        let copy = from_shared(into_shared(own, "/v1/x", SHARED_BODY_LIMIT).await);
        let Execution::Response { response, .. } = copy else {
            panic!("a response")
        };
        assert!(response
            .extensions()
            .get::<crate::problem::OwnAnswer>()
            .is_some());
        // A provider's answer stays the provider's.
        let provider = Execution::Response {
            receipt,
            response: http::Response::new(Body::from("busy")),
        };
        let copy = from_shared(into_shared(provider, "/v1/x", SHARED_BODY_LIMIT).await);
        let Execution::Response { response, .. } = copy else {
            panic!("a response")
        };
        assert!(response
            .extensions()
            .get::<crate::problem::OwnAnswer>()
            .is_none());
    }

    #[test]
    fn upstream_authority_is_host_and_port_without_userinfo() {
        assert_eq!(
            upstream_authority("http://127.0.0.1:9/v1/x?y=1"),
            "127.0.0.1:9"
        );
        assert_eq!(
            upstream_authority("https://user:secret@api.test/v1"),
            "api.test"
        );
        assert_eq!(upstream_authority("https://api.test?q#f"), "api.test");
        assert_eq!(upstream_authority("not a url"), "not a url");
    }

    const POLICY: &str = "
request_classes:
  read: { max_attempts: 2, max_wait_seconds: 10, retry_statuses: [429] }
  idempotent_write: { max_attempts: 3, max_wait_seconds: 10, retry_statuses: [429] }
providers:
  billing:
    base_url: http://127.0.0.1:9
    idempotency_header: Idempotency-Key
    routes:
      \"GET /v1/items/{id}\": { class: read }
      \"POST /v1/items/{id}\": { class: idempotent_write }
      \"POST /v1/transfers\": { class: idempotent_write, fingerprint_fields: [/amount] }
  other:
    base_url: http://127.0.0.1:9
";

    fn policy() -> Policy {
        Policy::from_yaml_str(POLICY, "p.yaml").expect("policy")
    }

    #[test]
    fn a_known_route_fingerprint_is_the_one_computed_for_the_request() {
        let policy = policy();
        let known = route_fingerprints(&policy);
        for (method, path, body) in [
            ("GET", "/v1/items/7", ""),
            ("POST", "/v1/items/7", r#"{"amount":5}"#),
            ("POST", "/v1/transfers", r#"{"amount":5}"#),
            ("POST", "/v1/transfers", r#"{"amount":6}"#),
            ("GET", "/v1/unconfigured/7", ""),
        ] {
            let route = policy.route("billing", method, path).expect("route");
            let payload = serde_json::from_slice::<serde_json::Value>(body.as_bytes()).ok();
            let expected = RequestFingerprint::compute(
                &route.method,
                &route.template,
                payload
                    .as_ref()
                    .filter(|_| !route.fingerprint_fields.is_empty()),
                &route.fingerprint_fields,
            );
            assert_eq!(
                fingerprint_with(&known, &route, body.as_bytes()),
                expected,
                "{method} {path}"
            );
        }
        assert!(
            !known.contains_key("/v1/transfers"),
            "a route with payload fields has no fixed fingerprint"
        );
        assert_eq!(known["/v1/items/{id}"].len(), 2, "one per method");
    }

    #[test]
    fn the_rule_table_holds_every_provider_and_class() {
        let policy = policy();
        let table = rule_table(&policy);
        for provider in ["billing", "other"] {
            for (name, class) in &policy.request_classes {
                let built = policy.classify_rules(provider, class).expect("rules");
                let kept = &table[provider][name];
                assert_eq!(
                    kept.retry_statuses, built.retry_statuses,
                    "{provider} {name}"
                );
                assert_eq!(kept.error_codes, built.error_codes, "{provider} {name}");
                assert_eq!(kept.dialect, built.dialect, "{provider} {name}");
            }
        }
    }
}
