//! The narrow storage trait: a few atomic operations, each its own transaction.
//!
//! Why a trait: the embedded default is one SQLite file, but several gateway instances on
//! several machines will share one PostgreSQL database (SPEC §12). Callers see only these
//! operations and plain record types; they never hold a connection or a transaction, so a second
//! implementation can follow without changing them. Every state-changing operation appends its
//! audit event(s) in the same transaction and returns only after that transaction is durable
//! (committed and fsync'd), which is what lets the gateway send a write's bytes only after
//! [`Store::mark_attempt_sent`] returned. Times are passed in by the caller (the store never
//! reads the clock).
//!
//! # Waiting, and not waiting
//! The `submit_*` operations and [`Store::begin_action`] queue the same operations without
//! blocking the caller: their [`Completion`] is called once the transaction holding the
//! operation is durable, or with the error that undid it. An async caller awaits it through a
//! one-shot channel instead of parking a thread. Operations run and commit in the order they
//! were queued, so the events of one action keep their order. A write awaits the completion of
//! [`Store::submit_attempt_sent`] before its bytes leave (SPEC §12). A read need not await
//! anything: [`Store::record_read`] hands out the action id at once, and its bookkeeping may
//! be held until its result is submitted and then queued as one operation, left to commit with
//! the next group (SPEC §12: reads may be recorded asynchronously). Every event is still
//! written, in the same transaction as its state change. **What a crash can lose:** only read
//! bookkeeping whose group had not committed yet — reads held or queued, never a write's
//! `action_requested`/`action_sent`, and never a gap in the chain (an operation and its event
//! commit together or not at all). Every other operation, and every read through the trait's
//! read methods, first finds whatever was recorded or queued before it, so a caller always
//! reads its own writes.

use jiff::Timestamp;

use crate::audit::{AuditEvent, ChainHead};
use crate::error::StoreError;
use crate::model::{
    ActionId, ActionRecord, Admission, AttemptRecord, AttemptResult, CancelReport, DueRetry,
    EscalationId, EscalationRecord, Finish, JobId, KeptRequest, NewAction, NewTask, RouteTemplate,
    ScopeRecord, ScopeUpdate, TaskRecord, UnfinishedAttempt,
};

/// Audit event kind of [`Store::reopen_for_retry`] (an operator's `retry_same_key` decision let
/// an escalated write send again under its original key) and of [`Store::reopen_for_resend`]
/// (the agent resent a finished write under its key when its answer said it may).
pub const ACTION_REOPENED: &str = "action_reopened";

/// The `source` of an [`ACTION_REOPENED`] event written by [`Store::reopen_for_resend`].
pub const REOPENED_BY_RESEND: &str =
    "the agent resent the write under the same idempotency key when its answer said it may";

/// The `source` of an [`ACTION_REOPENED`] event written by [`Store::resume_after_restart`].
pub const RESUMED_AFTER_RESTART: &str =
    "restart recovery resumes the write under the same idempotency key with its kept request";

/// Audit event kind of [`Store::record_access_decision`]: an operator's decision about access to
/// an escalation's evidence (e.g. `reveal_payload`), recorded apart from decisions on the action
/// (SPEC §8: approving access and approving an action are separate decisions).
pub const ACCESS_DECISION: &str = "access_decision";

/// Audit event kind of [`Store::record_status_query`]: an operator asked the provider about an
/// escalated write (`query_status`) and the lookup did not find it. The escalation stays open:
/// a query is evidence, not the closing `decision` (SPEC §8).
pub const STATUS_QUERY: &str = "status_query";

/// Called once with an operation's result after the transaction holding it committed (or with
/// the error that undid it). Runs on the store's writer thread: it must only hand the result on
/// (e.g. send it through a one-shot channel), never block.
pub type Completion<T> = Box<dyn FnOnce(Result<T, StoreError>) + Send>;

/// Durable state of backstop. Implementations are `Send + Sync` and safe to call from many
/// threads; each method is one atomic transaction.
pub trait Store: Send + Sync {
    /// Opens the task `(task.agent, task.id)` if it does not exist yet (audits `task_opened`
    /// once). Opening an existing task is a no-op. Task ids are namespaced per agent: another
    /// agent's task with the same id is a different task and is neither consulted nor touched.
    ///
    /// # Errors
    /// Storage errors only.
    fn open_task(&self, task: NewTask, at: Timestamp) -> Result<(), StoreError>;

    /// Records a new logical action with its idempotency key before its first send
    /// (audits `action_requested`). A key the agent already used for the same request (provider,
    /// method, route template, concrete target and payload digest) returns [`Admission::Existing`] and writes nothing (IETF Idempotency-Key draft); the
    /// caller replays it when finished, joins it while it runs, and sends it again when it is
    /// [`crate::model::ActionState::Reopened`]. A read passes an empty key: it is stored without
    /// one and never found again by key.
    ///
    /// # Errors
    /// [`StoreError::KeyReuse`] for the same key with another provider, method, route template,
    /// concrete target or payload (answer 422, saying what differs);
    /// [`StoreError::NotFound`] when `action.agent` has no task `action.task_id`;
    /// [`StoreError::InvalidTransition`] when the task is cancelled and the action would be new
    /// (an idempotency key already recorded for the agent is found first: its action, or
    /// [`StoreError::KeyReuse`]).
    fn record_action(&self, action: NewAction, at: Timestamp) -> Result<Admission, StoreError>;

    /// [`Store::open_task`] then [`Store::record_action`] as ONE operation (one savepoint, one
    /// share of a group commit), queued without blocking: `done` receives the admission once it
    /// is durable. A write awaits it before anything else happens to the action.
    ///
    /// # Errors (through `done`)
    /// As [`Store::open_task`] and [`Store::record_action`]; [`StoreError::Invalid`] when
    /// `action` names another task or agent than `task`; [`StoreError::WriterGone`] when
    /// the store is closing.
    fn begin_action(
        &self,
        task: NewTask,
        action: NewAction,
        at: Timestamp,
        done: Completion<Admission>,
    );

    /// Records a read (an action without idempotency key) without waiting for the writer: the
    /// action id is handed out at once; the task is opened if new and the action recorded
    /// (`task_opened`, `action_requested`), and `done` is told when that is durable (SPEC §12:
    /// reads may be recorded asynchronously). An implementation may hold these records until
    /// the read's result is submitted ([`Store::submit_result`]) and queue the whole read —
    /// records, attempt and result — as one operation; it queues a held read earlier whenever
    /// another operation or a read of the store could need it. The task (of the same agent:
    /// task ids are namespaced per agent) is checked first: a cancelled task is refused at once,
    /// as [`Store::record_action`] would. A crash before the group commit loses this record and
    /// everything submitted for the action after it.
    ///
    /// # Errors
    /// [`StoreError::Invalid`] when the action carries an idempotency key (a write must be
    /// recorded durably with [`Store::begin_action`] or [`Store::record_action`]);
    /// [`StoreError::Invalid`] when `action` names another task or agent than `task`;
    /// [`StoreError::InvalidTransition`] for a cancelled task; storage
    /// errors of the lookup. Errors of the queued operation itself go to `done`.
    fn record_read(
        &self,
        task: NewTask,
        action: NewAction,
        at: Timestamp,
        done: Completion<()>,
    ) -> Result<ActionId, StoreError>;

    /// [`Store::mark_attempt_sent`], queued without blocking: `done` receives the attempt
    /// number once the `action_sent` event is committed and fsync'd. A write's bytes leave only
    /// after `done` was called with `Ok`; a read may go without waiting (and a held read's
    /// attempt is held with it, see [`Store::record_read`]).
    ///
    /// # Errors (through `done`)
    /// As [`Store::mark_attempt_sent`]; [`StoreError::WriterGone`] when the store is closing.
    fn submit_attempt_sent(&self, action: ActionId, at: Timestamp, done: Completion<u32>);

    /// [`Store::record_result`], queued without blocking; `done` is called once it is durable.
    /// The result of a held read queues the whole read as one operation (see
    /// [`Store::record_read`]).
    ///
    /// # Errors (through `done`)
    /// As [`Store::record_result`]; [`StoreError::WriterGone`] when the store is closing.
    fn submit_result(&self, result: AttemptResult, at: Timestamp, done: Completion<()>);

    /// Waits until every operation queued before this call is committed and fsync'd (the
    /// read records nobody awaited included). Called when the gateway stops, so a clean stop
    /// loses nothing.
    ///
    /// # Errors
    /// [`StoreError::WriterGone`] when the store is closed; the commit's storage error.
    fn flush(&self) -> Result<(), StoreError>;

    /// Durably records that attempt *n* (the returned number, 1-based) is about to be sent and
    /// audits `action_sent`. Returns only after commit + fsync: the request's bytes may leave
    /// only after this returns `Ok`.
    ///
    /// # Errors
    /// [`StoreError::InvalidTransition`] when the action is finished, its task is cancelled,
    /// or a previous attempt is still `sent` without a result (never two attempts in flight).
    fn mark_attempt_sent(&self, action: ActionId, at: Timestamp) -> Result<u32, StoreError>;

    /// Records an attempt's result (audits `action_result`), stores the provider operation id
    /// when given, and, with `result.finish`, ends the action in the same transaction.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown attempt; [`StoreError::InvalidTransition`] when
    /// the attempt already has a result.
    fn record_result(&self, result: AttemptResult, at: Timestamp) -> Result<(), StoreError>;

    /// Ends an action with an outcome (audits `budget_exhausted`, `deadline_exhausted`,
    /// `reconciliation_required`, `escalated`, `cancelled` or `action_finished`). An action in
    /// `reconciliation_required` may later be finished again by [`Store::record_reconciled`].
    ///
    /// # Errors
    /// [`StoreError::InvalidTransition`] when the action already ended (other than
    /// `reconciliation_required`/`escalated`).
    fn finish_action(
        &self,
        action: ActionId,
        finish: Finish,
        at: Timestamp,
    ) -> Result<(), StoreError>;

    /// Records that reconciliation found the action's effect at the provider: outcome
    /// `succeeded`, provider operation id stored (audits `reconciled`).
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown action.
    fn record_reconciled(
        &self,
        action: ActionId,
        provider_operation_id: Option<String>,
        at: Timestamp,
    ) -> Result<(), StoreError>;

    /// [`Store::record_reconciled`] keeping the outcome's SPEC §5 context with the action:
    /// `context` (a JSON object: `sent`, `attempts`, `total_wait_ms`, `next_safe`, …; no bodies
    /// or credentials) is stored as the action's outcome context with the member `reconciled`
    /// (`true`) added, so whoever reads the action later (its view, a same-key replay, a case
    /// file) sees the context its caller was answered with, not one rebuilt from the attempts.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown action; [`StoreError::Invalid`] when `context`
    /// is not a JSON object.
    fn record_reconciled_with_context(
        &self,
        action: ActionId,
        provider_operation_id: Option<String>,
        context: serde_json::Value,
        at: Timestamp,
    ) -> Result<(), StoreError>;

    /// Schedules a retry of an action at `due_at` (a scheduler receipt; audits
    /// `retry_scheduled`). Returns the job id. An action has at most one waiting job: one not
    /// taken yet is superseded (marked claimed by `superseded`), and the next attempt of the
    /// action ([`Store::mark_attempt_sent`]) takes the waiting job (claimed by `attempt`).
    ///
    /// # Errors
    /// [`StoreError::InvalidTransition`] when the action ended or its task is cancelled.
    fn schedule_retry(
        &self,
        action: ActionId,
        due_at: Timestamp,
        at: Timestamp,
    ) -> Result<JobId, StoreError>;

    /// Claims up to `limit` retries due at `now` (oldest first) whose task is not cancelled,
    /// so that no other worker or instance claims them too, and audits `retry_started` for each.
    /// (PostgreSQL: `SELECT … FOR UPDATE SKIP LOCKED LIMIT n` inside the same transaction.)
    ///
    /// # Errors
    /// Storage errors only.
    fn claim_due(
        &self,
        now: Timestamp,
        limit: usize,
        claimed_by: &str,
    ) -> Result<Vec<DueRetry>, StoreError>;

    /// Claims one scheduled retry by its job id (the wake of one action's own timer), so that no
    /// other worker claims it too, and audits `retry_started`. Returns `None` when the job was
    /// already claimed, its action finished, or its task was cancelled (nothing is audited then).
    ///
    /// # Errors
    /// Storage errors only.
    fn claim_job(
        &self,
        job: JobId,
        now: Timestamp,
        claimed_by: &str,
    ) -> Result<Option<DueRetry>, StoreError>;

    /// Every scheduled retry not claimed yet whose action is unfinished and whose task is not
    /// cancelled, soonest first (re-armed after a restart, SPEC §12).
    ///
    /// # Errors
    /// Storage errors only.
    fn scheduled_retries(&self) -> Result<Vec<DueRetry>, StoreError>;

    /// Audits one reconciliation lookup of an uncertain write (`reconciliation_lookup`): the
    /// lookup in template form (`GET /v1/transfers?reference={ref}`, never the filled URL), the
    /// provider's status when it answered, and the verdict (`found`, `not_found`,
    /// `inconclusive`) as the event's disposition. The action's state does not change.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown action.
    fn record_reconciliation_lookup(
        &self,
        action: ActionId,
        lookup: &str,
        status: Option<u16>,
        verdict: &str,
        at: Timestamp,
    ) -> Result<(), StoreError>;

    /// Updates a scope record (audits `scope_updated`); `next_allowed_at` only moves later.
    /// Returns the record after the update.
    ///
    /// # Errors
    /// Storage errors only.
    fn update_scope(&self, update: ScopeUpdate, at: Timestamp) -> Result<ScopeRecord, StoreError>;

    /// Opens an escalation with a sanitized case file (SPEC §8); the action ends with outcome
    /// `escalated` (audits `escalated`).
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown action.
    fn open_escalation(
        &self,
        action: ActionId,
        case_file: serde_json::Value,
        at: Timestamp,
    ) -> Result<EscalationId, StoreError>;

    /// [`Store::open_escalation`] keeping the outcome's SPEC §5 context with the action:
    /// `context` (a JSON object: `sent`, `attempts`, `next_safe`, …; no bodies or credentials)
    /// is stored as the action's outcome context with the member `escalation` (the new id)
    /// added, so whoever reads the action later sees the same `next_safe` as the answer given
    /// when it ended.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown action; [`StoreError::Invalid`] when `context`
    /// is not a JSON object.
    fn open_escalation_with_context(
        &self,
        action: ActionId,
        case_file: serde_json::Value,
        context: serde_json::Value,
        at: Timestamp,
    ) -> Result<EscalationId, StoreError>;

    /// Opens an escalation beside an outcome the action already ended with (SPEC §8 / §13 step 5:
    /// a provider boundary beyond the remaining wait or deadline ends a write
    /// `budget_exhausted`/`deadline_exhausted` AND hands it to a human). The action keeps its
    /// outcome and context; the escalation is stored open with the sanitized case file and
    /// audited as `escalated` naming the escalation and the action's outcome.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown action; [`StoreError::InvalidTransition`] when the
    /// action has not ended yet.
    fn open_escalation_beside_outcome(
        &self,
        action: ActionId,
        case_file: serde_json::Value,
        at: Timestamp,
    ) -> Result<EscalationId, StoreError>;

    /// Records a human's decision on an open escalation with the operator's optional note
    /// (audits `decision`; the note is kept with the escalation, never audited, since it is
    /// free text).
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown escalation; [`StoreError::InvalidTransition`]
    /// when it was already decided.
    fn decide_escalation(
        &self,
        escalation: EscalationId,
        decision: &str,
        decided_by: &str,
        note: Option<&str>,
        at: Timestamp,
    ) -> Result<(), StoreError>;

    /// Lets an escalated write send again as the SAME logical action (an operator's
    /// `retry_same_key`, SPEC §8): the action leaves `escalated` for [`ActionState::Reopened`]
    /// (outcome cleared), keeps its idempotency key, and its next attempt is marked sent as
    /// usual. Audits [`ACTION_REOPENED`] with who decided.
    ///
    /// [`ActionState::Reopened`]: crate::model::ActionState::Reopened
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown action; [`StoreError::InvalidTransition`] unless
    /// the action ended `escalated` or `reconciliation_required`, carries a key and its task is
    /// not cancelled; [`StoreError::Invalid`] for an empty `decided_by`.
    fn reopen_for_retry(
        &self,
        action: ActionId,
        decided_by: &str,
        at: Timestamp,
    ) -> Result<(), StoreError>;

    /// Lets a finished write send again as the SAME logical action because its agent resent it
    /// under its key when backstop's own answer said it may (SPEC §5, §6): the outcome's
    /// `next_safe` advised `wait_until` and that instant has come (`advised`), or an operator
    /// decided `wait`, `raise_quota` or `change_plan` on the escalation opened beside the
    /// outcome (`escalation`). The caller judges that; the store checks the action ended with an
    /// outcome such a resend can follow (`budget_exhausted`, `deadline_exhausted`,
    /// `quota_exhausted`, `scope_saturated`), carries a key and its task is not cancelled. The
    /// action leaves `finished` for [`ActionState::Reopened`] (outcome and context cleared) as
    /// with [`Store::reopen_for_retry`]. Audits [`ACTION_REOPENED`] with `decision`
    /// `retry_same_key`, no `decided_by` (no person decided), `outcome` the outcome set aside,
    /// `boundary` the advised instant and `escalation` the decided escalation when given, and
    /// `source` saying it was the agent's resend.
    ///
    /// [`ActionState::Reopened`]: crate::model::ActionState::Reopened
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown action; [`StoreError::InvalidTransition`] for an
    /// action that is not finished with one of those outcomes, carries no key, or whose task is
    /// cancelled.
    fn reopen_for_resend(
        &self,
        action: ActionId,
        advised: Option<Timestamp>,
        escalation: Option<EscalationId>,
        at: Timestamp,
    ) -> Result<(), StoreError>;

    /// Keeps `request` as the request of the unfinished write `action` (replacing one kept
    /// before; nothing for an action that has ended), committed before this returns: a write
    /// taken over by a same-key resend keeps the resend's request until it ends (SPEC §6).
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown action.
    fn keep_request(&self, action: ActionId, request: KeptRequest) -> Result<(), StoreError>;

    /// The request kept for the unfinished write `action` ([`NewAction::request`],
    /// [`Store::keep_request`]), if any: `None` for a read, an action that has ended, or a
    /// payload too large to keep.
    fn kept_request(&self, action: ActionId) -> Result<Option<KeptRequest>, StoreError>;

    /// Lets restart recovery send an unfinished write again as the SAME logical action with its
    /// kept request (SPEC §12): the action moves to [`ActionState::Reopened`], its waiting retry
    /// job (if any) is claimed (`resumed`), and [`ACTION_REOPENED`] is audited with
    /// [`RESUMED_AFTER_RESTART`] as its `source`. The caller judged it safe: the write's last
    /// attempt, if any, was settled or reconciled (nothing found, and the provider honours the
    /// key).
    ///
    /// [`ActionState::Reopened`]: crate::model::ActionState::Reopened
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown action; [`StoreError::InvalidTransition`] for an
    /// action that has ended or has an attempt sent without a result, carries no key, or whose
    /// task is cancelled.
    fn resume_after_restart(&self, action: ActionId, at: Timestamp) -> Result<(), StoreError>;

    /// Audits an operator's access decision about an escalation's evidence as its own event
    /// ([`ACCESS_DECISION`]): `access` names what was asked (`reveal_payload`), `outcome` what
    /// came of it (e.g. `refused_not_stored`). The escalation stays as it is: access is never an
    /// approval of the action (SPEC §8).
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown escalation; [`StoreError::Invalid`] for an empty
    /// `access`, `decided_by` or `outcome`.
    fn record_access_decision(
        &self,
        escalation: EscalationId,
        access: &str,
        decided_by: &str,
        outcome: &str,
        at: Timestamp,
    ) -> Result<(), StoreError>;

    /// Audits an operator's `query_status` on an open escalation whose lookup did not find the
    /// write ([`STATUS_QUERY`]: the escalation, who asked, when, and the lookup's verdict —
    /// `not_found`, `inconclusive`, or `not_run` when no engine could ask). The escalation stays
    /// open and undecided, so the operator may still decide (e.g. `abort`, `retry_same_key`).
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown escalation; [`StoreError::InvalidTransition`]
    /// when it was already decided; [`StoreError::Invalid`] for an empty `decided_by` or
    /// `verdict`.
    fn record_status_query(
        &self,
        escalation: EscalationId,
        decided_by: &str,
        verdict: &str,
        at: Timestamp,
    ) -> Result<(), StoreError>;

    /// Cancels the task `task` of `agent` (another agent's task with the same id is left
    /// untouched): drops its unclaimed scheduled retries before they wake and ends every
    /// unfinished action not in flight with `cancelled` (audits `cancelled` for the task and
    /// each action) — but a write with an unsettled attempt ([`crate::unsettled_attempt`]: the
    /// provider may have acted on it), which is left open between two attempts (`attempted`,
    /// no retry) and listed in [`CancelReport::unsettled`] for the caller to reconcile with its
    /// original key (SPEC §6). Cancelling twice changes nothing the second time.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] when `agent` has no task `task`.
    fn cancel_task(
        &self,
        agent: &str,
        task: &str,
        at: Timestamp,
    ) -> Result<CancelReport, StoreError>;

    /// Audits that the circuit breaker opened a path (method + route template) for the task
    /// `task` of `agent`.
    ///
    /// # Errors
    /// Storage errors only.
    fn record_circuit_opened(
        &self,
        agent: &str,
        task: &str,
        provider: &str,
        method: &str,
        route: &RouteTemplate,
        at: Timestamp,
    ) -> Result<(), StoreError>;

    /// Audits a health finding about an action (`watchdog_finding`, SPEC §10): `finding` is the
    /// diagnosis (`stuck_missed_wake`, `no_durable_wake`, `early_retry_loop`), recorded in the
    /// event's `source`; `job` and `due_at` name the scheduled retry it concerns, if any. Changes
    /// no state: the finding is evidence for the operator.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown action; [`StoreError::Invalid`] for an empty
    /// finding.
    fn record_watchdog_finding(
        &self,
        action: ActionId,
        finding: &str,
        job: Option<JobId>,
        due_at: Option<Timestamp>,
        at: Timestamp,
    ) -> Result<(), StoreError>;

    /// Reads the task `id` of `agent`. Task ids are namespaced per agent: another agent's task
    /// with the same id is never returned.
    ///
    /// # Errors
    /// Storage errors only.
    fn task(&self, agent: &str, id: &str) -> Result<Option<TaskRecord>, StoreError>;

    /// Reads every agent's task with this id, ordered by agent: an operator's lookup, which
    /// may see all agents. Never use it to answer an agent.
    ///
    /// # Errors
    /// Storage errors only.
    fn tasks_of_every_agent(&self, id: &str) -> Result<Vec<TaskRecord>, StoreError>;

    /// Reads an action (with its stored response, if any).
    ///
    /// # Errors
    /// Storage errors only.
    fn action(&self, id: ActionId) -> Result<Option<ActionRecord>, StoreError>;

    /// Reads the write `agent` recorded under `idempotency_key` (keys are namespaced per agent,
    /// SPEC §6), without writing anything: what a same-key request names when the store cannot
    /// commit its admission ([`Store::begin_action`]). An empty key names no action (reads are
    /// stored without one).
    ///
    /// # Errors
    /// Storage errors only.
    fn action_by_key(
        &self,
        agent: &str,
        idempotency_key: &str,
    ) -> Result<Option<ActionRecord>, StoreError>;

    /// The other actions of `provider` that recorded `reference` as their external reference,
    /// every action except `except`, in id order. A reconciliation lookup by external reference
    /// proves a write only when no other action shares the reference (SPEC §6): a write the
    /// lookup finds may be another action's.
    ///
    /// # Errors
    /// Storage errors only.
    fn actions_sharing_reference(
        &self,
        provider: &str,
        reference: &str,
        except: ActionId,
    ) -> Result<Vec<ActionId>, StoreError>;

    /// Reads the attempts of an action, in order.
    ///
    /// # Errors
    /// Storage errors only.
    fn attempts(&self, action: ActionId) -> Result<Vec<AttemptRecord>, StoreError>;

    /// Attempts recorded as sent without a result (after a restart: writes to reconcile with
    /// their original key, SPEC §12).
    ///
    /// # Errors
    /// Storage errors only.
    fn unfinished_attempts(&self) -> Result<Vec<UnfinishedAttempt>, StoreError>;

    /// Writes that were recorded with their idempotency key and never sent: state
    /// `requested`, no attempt and no scheduled retry, in id order. After a restart these are
    /// writes a stopped or crashed gateway was holding before their first send (pacing, a full
    /// scope); nothing of them left, so the agent's resend under the same key may send them as
    /// the same action. Scans the actions table: meant for start-up only.
    ///
    /// # Errors
    /// Storage errors only.
    fn unsent_writes(&self) -> Result<Vec<ActionId>, StoreError>;

    /// Reads (actions without idempotency key) that were recorded and never sent: state
    /// `requested`, no attempt and no scheduled retry, in id order. After a restart these are
    /// reads a stopped or crashed gateway held before their first send (pacing, a full scope,
    /// a stop answered `503 shutting_down`); nothing resumes a read after a restart, so the
    /// gateway closes them. Reads the `actions_open` index, not the whole table: meant for
    /// start-up only.
    ///
    /// # Errors
    /// Storage errors only.
    fn unsent_reads(&self) -> Result<Vec<ActionId>, StoreError>;

    /// Actions left between two attempts: the last attempt has a result, but the action
    /// neither ended nor has a waiting retry — state `attempted`, `waiting` or `reopened`, no unclaimed
    /// scheduled retry — in id order. After a restart these are actions whose run stopped (or
    /// whose store could not commit) after recording an attempt's result and before recording
    /// what came next (the retry's schedule or the outcome), and actions whose retry an earlier
    /// start claimed to recover them and then stopped before recording how, and writes
    /// `reopened` for a send under their key that no send followed. Nothing waits for them any
    /// more. Scans the actions
    /// table: meant for start-up only.
    ///
    /// # Errors
    /// Storage errors only.
    fn actions_between_attempts(&self) -> Result<Vec<ActionId>, StoreError>;

    /// Reads a scope record.
    ///
    /// # Errors
    /// Storage errors only.
    fn scope(&self, provider: &str, scope: &str) -> Result<Option<ScopeRecord>, StoreError>;

    /// Reads an escalation.
    ///
    /// # Errors
    /// Storage errors only.
    fn escalation(&self, id: EscalationId) -> Result<Option<EscalationRecord>, StoreError>;

    /// Open escalations, oldest first.
    ///
    /// # Errors
    /// Storage errors only.
    fn open_escalations(&self) -> Result<Vec<EscalationRecord>, StoreError>;

    /// How many escalations are open (as many as [`Store::open_escalations`] lists, without
    /// reading them).
    ///
    /// # Errors
    /// Storage errors only.
    fn count_open_escalations(&self) -> Result<u64, StoreError> {
        Ok(self.open_escalations()?.len() as u64)
    }

    /// Every escalation of `action`, open or decided, oldest first.
    ///
    /// # Errors
    /// Storage errors only.
    fn escalations_of_action(&self, action: ActionId) -> Result<Vec<EscalationRecord>, StoreError>;

    /// Every escalation decided at or after `since`, whatever its action, oldest decision
    /// first: what a same-key resend of a write that ended beside a scope's escalation (one
    /// `shared_quota_exhausted` case covers every task of the scope) looks up to learn whether
    /// an operator decided it since. Escalations are few (one per scope and event), so this
    /// reads them without an index.
    ///
    /// # Errors
    /// Storage errors only.
    fn escalations_decided_since(
        &self,
        since: Timestamp,
    ) -> Result<Vec<EscalationRecord>, StoreError>;

    /// Audit events with `seq > since`, in order, at most `limit`.
    ///
    /// # Errors
    /// Storage errors only.
    fn audit_events(&self, since: u64, limit: usize) -> Result<Vec<AuditEvent>, StoreError>;

    /// The audit events a health watcher needs from the next `limit` events with `seq > since`
    /// (in order), as far as committed: no queued operation is waited for. Left out are
    /// `task_opened` and the events of every action whose whole life lies in those `limit`
    /// events and is one plain success — `action_requested`, one `action_sent`, one
    /// `action_result` that is not `rate_limited`/`quota_exhausted`/`unavailable`, and
    /// `action_finished` with outcome `succeeded`, nothing else — except that action's
    /// `action_sent` (it still tells when work last moved). Such an action was never throttled.
    /// Returns the events kept and the `seq` of the last event looked at (`None` when there was
    /// none), from which the next call continues. An implementation may leave out more of the
    /// plain actions' `action_sent` events as long as the latest `at` among them stays, and may
    /// hand such a send with only its `seq`, `at`, `kind`, `action` and `attempt`: the SQLite
    /// store answers what it committed itself from memory, where a run of plain actions leaves
    /// only its latest send (see `SqliteStore`). The default reads [`Store::audit_events`] and
    /// leaves nothing out. The SQLite store also leaves out an event it cannot decode (an
    /// altered row) with a warning, still counted in the `seq` returned, so a watcher moves
    /// past it rather than fail on it at every call; `audit verify` reports it.
    ///
    /// # Errors
    /// Storage errors only.
    fn watch_events(
        &self,
        since: u64,
        limit: usize,
    ) -> Result<(Vec<AuditEvent>, Option<u64>), StoreError> {
        let page = self.audit_events(since, limit)?;
        let last = page.last().map(|e| e.seq);
        Ok((page, last))
    }

    /// The chain head (last `seq` and `hash`), or `None` for an empty log.
    ///
    /// # Errors
    /// Storage errors only.
    fn audit_head(&self) -> Result<Option<ChainHead>, StoreError>;

    /// Why the store's last write transaction could not begin or commit (a file system turned
    /// read-only, a full disk), or `None` while writes commit, and before the first one. Set
    /// by a failed transaction and cleared by the next one that commits; `GET /v1/live`
    /// reports it. Stores that cannot tell answer `None`.
    fn write_failure(&self) -> Option<String> {
        None
    }
}
