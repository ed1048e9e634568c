//! A store that fails on demand like a damaged file or a full disk. While [`FailingStore::fail`]
//! is in force every operation that writes answers SQLite's error; reads keep working.
//! [`FailingStore::fail_sends`] fails only the recording of an attempt sent (a write's
//! `action_sent`: the commit that lets its bytes leave, and claims a waiting retry job);
//! [`FailingStore::fail_schedules`] only the scheduling of a retry; [`FailingStore::fail_outcomes`]
//! only what ends an action (`finish_action`, `record_reconciled`, and an attempt result
//! carrying the outcome).
//! [`FailingStore::fail_next_result`] only the next attempt result that does not end its action
//! (then the store works again, as a disk that hiccups once).
//! [`FailingStore::lose_reads`] hands reads their ids but never commits their records, as when
//! the group commit of a held read fails. [`FailingStore::recover`] ends any of these.
//! [`FailingStore::hold_sends`] holds the recording of every attempt sent, neither committed
//! nor answered, until [`FailingStore::fail_held_sends`] fails them, so a test can act while a
//! send is being recorded. [`FailingStore::fail_as_gone`] makes these failures answer as a store whose writer has
//! stopped (`StoreError::WriterGone`, which does not tell whether an operation was committed)
//! instead of with SQLite's error.
//! [`FailingStore::hold_attempts`] holds every read of an action's attempts (on the thread that
//! reads) until [`FailingStore::release_attempts`], so a test can act while one is under way.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicBool, AtomicI64, AtomicU8, Ordering},
        Arc, Condvar, Mutex,
    },
};

use backstop_store::{
    audit::{AuditEvent, ChainHead},
    ActionId, ActionRecord, Admission, AttemptRecord, AttemptResult, CancelReport, Completion,
    DueRetry, EscalationId, EscalationRecord, Finish, JobId, NewAction, NewTask, RouteTemplate,
    ScopeRecord, ScopeUpdate, Store, StoreError, TaskRecord, UnfinishedAttempt,
};
use jiff::Timestamp;

/// SQLite's answer for a damaged file.
pub fn damaged() -> StoreError {
    StoreError::Sqlite("database disk image is malformed".to_owned())
}

/// The store works.
const WORKING: u8 = 0;
/// Every writing operation fails.
const FAILING: u8 = 1;
/// Only recording an attempt sent fails.
const FAILING_SENDS: u8 = 2;
/// Reads' records are never committed.
const LOSING_READS: u8 = 3;
/// Only scheduling a retry fails.
const FAILING_SCHEDULES: u8 = 4;
/// Only what ends an action fails.
const FAILING_OUTCOMES: u8 = 5;
/// Only the next attempt result that does not end its action fails, once.
const FAILING_NEXT_RESULT: u8 = 6;

/// The first action id handed to a read whose records are lost (far above the real store's).
pub const FIRST_LOST_READ: i64 = 1_000_000;

/// A completion of a lost read, waiting to be told its commit failed.
type Pending = Box<dyn FnOnce(StoreError) + Send>;

/// Delegates to a real store until told to fail.
pub struct FailingStore {
    pub inner: Arc<dyn Store>,
    mode: AtomicU8,
    /// Whether failures answer `StoreError::WriterGone` instead of SQLite's error.
    gone: AtomicBool,
    /// Whether recordings of an attempt sent are held, and the ones held so far.
    holding_sends: AtomicBool,
    held_sends: Mutex<Vec<Completion<u32>>>,
    /// Reads handed an id while their records are lost: their completions so far, in order.
    lost_reads: Mutex<HashMap<ActionId, Vec<Pending>>>,
    next_lost_read: AtomicI64,
    /// Whether reads of attempts are held, and how many are waiting now.
    attempts_gate: Mutex<Gate>,
    attempts_released: Condvar,
}

/// The state of [`FailingStore::hold_attempts`].
#[derive(Default)]
struct Gate {
    holding: bool,
    waiting: usize,
}

impl FailingStore {
    pub fn new(inner: Arc<dyn Store>) -> Arc<FailingStore> {
        Arc::new(FailingStore {
            inner,
            mode: AtomicU8::new(WORKING),
            gone: AtomicBool::new(false),
            holding_sends: AtomicBool::new(false),
            held_sends: Mutex::new(Vec::new()),
            lost_reads: Mutex::new(HashMap::new()),
            next_lost_read: AtomicI64::new(FIRST_LOST_READ),
            attempts_gate: Mutex::new(Gate::default()),
            attempts_released: Condvar::new(),
        })
    }

    /// From now on every read of an action's attempts (`attempts`) waits, blocking the thread
    /// that reads, until [`FailingStore::release_attempts`]; the store works otherwise.
    pub fn hold_attempts(&self) {
        self.attempts_gate.lock().unwrap().holding = true;
    }

    /// How many reads of attempts are held now.
    pub fn attempts_held(&self) -> usize {
        self.attempts_gate.lock().unwrap().waiting
    }

    /// Lets every held read of attempts, and every later one, go on.
    pub fn release_attempts(&self) {
        self.attempts_gate.lock().unwrap().holding = false;
        self.attempts_released.notify_all();
    }

    /// From now on every recording of an attempt sent (`submit_attempt_sent`) is held: neither
    /// committed nor answered until [`FailingStore::fail_held_sends`].
    pub fn hold_sends(&self) {
        self.holding_sends.store(true, Ordering::SeqCst);
    }

    /// How many recordings of an attempt sent are held now.
    pub fn sends_held(&self) -> usize {
        self.held_sends.lock().unwrap().len()
    }

    /// Answers every held recording of an attempt sent with the failure (see
    /// [`FailingStore::fail_as_gone`]), none of them committed, and holds no more.
    pub fn fail_held_sends(&self) {
        self.holding_sends.store(false, Ordering::SeqCst);
        let held = std::mem::take(&mut *self.held_sends.lock().unwrap());
        for done in held {
            done(Err(self.error()));
        }
    }

    /// From now on the operations that fail answer as a store whose writer has stopped
    /// (`StoreError::WriterGone`), as the gateway's store does once it is closing.
    pub fn fail_as_gone(&self) {
        self.gone.store(true, Ordering::SeqCst);
    }

    /// The error a failing operation answers.
    fn error(&self) -> StoreError {
        if self.gone.load(Ordering::SeqCst) {
            StoreError::WriterGone
        } else {
            damaged()
        }
    }

    /// From now on every writing operation fails.
    pub fn fail(&self) {
        self.mode.store(FAILING, Ordering::SeqCst);
    }

    /// From now on only recording an attempt sent fails (`submit_attempt_sent`,
    /// `mark_attempt_sent`).
    pub fn fail_sends(&self) {
        self.mode.store(FAILING_SENDS, Ordering::SeqCst);
    }

    /// From now on only scheduling a retry fails (`schedule_retry`): the attempt's result
    /// before it is recorded.
    pub fn fail_schedules(&self) {
        self.mode.store(FAILING_SCHEDULES, Ordering::SeqCst);
    }

    /// From now on only what ends an action fails: `finish_action`, `record_reconciled`, and
    /// recording an attempt result that carries the action's outcome (`record_result`,
    /// `submit_result`).
    pub fn fail_outcomes(&self) {
        self.mode.store(FAILING_OUTCOMES, Ordering::SeqCst);
    }

    /// The next attempt result that does not end its action (`record_result` of a result
    /// followed by a retry) fails; everything before and after it works.
    pub fn fail_next_result(&self) {
        self.mode.store(FAILING_NEXT_RESULT, Ordering::SeqCst);
    }

    /// From now on a read is handed an id (from [`FIRST_LOST_READ`] on) but none of its records
    /// is committed: when its result is submitted, every completion of the read — the request,
    /// each attempt sent, the result — is answered SQLite's error, in that order, as the real
    /// store answers a held read whose group commit failed.
    pub fn lose_reads(&self) {
        self.mode.store(LOSING_READS, Ordering::SeqCst);
    }

    /// From now on the store works again.
    pub fn recover(&self) {
        self.mode.store(WORKING, Ordering::SeqCst);
    }

    fn failing(&self) -> bool {
        self.mode.load(Ordering::SeqCst) == FAILING
    }

    fn failing_sends(&self) -> bool {
        matches!(self.mode.load(Ordering::SeqCst), FAILING | FAILING_SENDS)
    }

    fn failing_schedules(&self) -> bool {
        matches!(
            self.mode.load(Ordering::SeqCst),
            FAILING | FAILING_SCHEDULES
        )
    }

    /// Whether recording `finish` (an action's outcome, when `true`) fails now.
    fn failing_outcome(&self, ends: bool) -> bool {
        match self.mode.load(Ordering::SeqCst) {
            FAILING => true,
            FAILING_OUTCOMES => ends,
            _ => false,
        }
    }

    fn losing_reads(&self) -> bool {
        self.mode.load(Ordering::SeqCst) == LOSING_READS
    }

    /// Keeps `done` of a lost read; gives it back when `action` is not one.
    fn hold<T: 'static>(&self, action: ActionId, done: Completion<T>) -> Option<Completion<T>> {
        let mut lost = self.lost_reads.lock().unwrap();
        match lost.get_mut(&action) {
            Some(pending) => {
                pending.push(Box::new(move |e| done(Err(e))));
                None
            }
            None => Some(done),
        }
    }
}

impl Store for FailingStore {
    fn open_task(&self, task: NewTask, at: Timestamp) -> Result<(), StoreError> {
        self.inner.open_task(task, at)
    }
    fn record_action(&self, action: NewAction, at: Timestamp) -> Result<Admission, StoreError> {
        self.inner.record_action(action, at)
    }
    fn begin_action(
        &self,
        task: NewTask,
        action: NewAction,
        at: Timestamp,
        done: Completion<Admission>,
    ) {
        if self.failing() {
            return done(Err(self.error()));
        }
        self.inner.begin_action(task, action, at, done)
    }
    fn record_read(
        &self,
        task: NewTask,
        action: NewAction,
        at: Timestamp,
        done: Completion<()>,
    ) -> Result<ActionId, StoreError> {
        if self.failing() {
            return Err(self.error());
        }
        if self.losing_reads() {
            let id = ActionId(self.next_lost_read.fetch_add(1, Ordering::SeqCst));
            let pending: Vec<Pending> = vec![Box::new(move |e| done(Err(e)))];
            self.lost_reads.lock().unwrap().insert(id, pending);
            return Ok(id);
        }
        self.inner.record_read(task, action, at, done)
    }
    fn submit_attempt_sent(&self, action: ActionId, at: Timestamp, done: Completion<u32>) {
        let Some(done) = self.hold(action, done) else {
            return;
        };
        if self.holding_sends.load(Ordering::SeqCst) {
            self.held_sends.lock().unwrap().push(done);
            return;
        }
        if self.failing_sends() {
            return done(Err(self.error()));
        }
        self.inner.submit_attempt_sent(action, at, done)
    }
    fn submit_result(&self, result: AttemptResult, at: Timestamp, done: Completion<()>) {
        let lost = self.lost_reads.lock().unwrap().remove(&result.action);
        if let Some(pending) = lost {
            for earlier in pending {
                earlier(damaged());
            }
            return done(Err(damaged()));
        }
        if self.failing_outcome(result.finish.is_some()) {
            return done(Err(self.error()));
        }
        self.inner.submit_result(result, at, done)
    }
    fn flush(&self) -> Result<(), StoreError> {
        if self.failing() {
            return Err(self.error());
        }
        self.inner.flush()
    }
    fn mark_attempt_sent(&self, action: ActionId, at: Timestamp) -> Result<u32, StoreError> {
        if self.failing_sends() {
            return Err(self.error());
        }
        self.inner.mark_attempt_sent(action, at)
    }
    fn record_result(&self, result: AttemptResult, at: Timestamp) -> Result<(), StoreError> {
        if self.failing_outcome(result.finish.is_some()) {
            return Err(self.error());
        }
        if result.finish.is_none()
            && self
                .mode
                .compare_exchange(
                    FAILING_NEXT_RESULT,
                    WORKING,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                )
                .is_ok()
        {
            return Err(self.error());
        }
        self.inner.record_result(result, at)
    }
    fn finish_action(
        &self,
        action: ActionId,
        finish: Finish,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        if self.failing_outcome(true) {
            return Err(self.error());
        }
        self.inner.finish_action(action, finish, at)
    }
    fn record_reconciled(
        &self,
        action: ActionId,
        provider_operation_id: Option<String>,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        if self.failing_outcome(true) {
            return Err(self.error());
        }
        self.inner
            .record_reconciled(action, provider_operation_id, at)
    }
    fn record_reconciled_with_context(
        &self,
        action: ActionId,
        provider_operation_id: Option<String>,
        context: serde_json::Value,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        if self.failing_outcome(true) {
            return Err(self.error());
        }
        self.inner
            .record_reconciled_with_context(action, provider_operation_id, context, at)
    }
    fn schedule_retry(
        &self,
        action: ActionId,
        due_at: Timestamp,
        at: Timestamp,
    ) -> Result<JobId, StoreError> {
        if self.failing_schedules() {
            return Err(self.error());
        }
        self.inner.schedule_retry(action, due_at, at)
    }
    fn claim_due(
        &self,
        now: Timestamp,
        limit: usize,
        claimed_by: &str,
    ) -> Result<Vec<DueRetry>, StoreError> {
        self.inner.claim_due(now, limit, claimed_by)
    }
    fn claim_job(
        &self,
        job: JobId,
        now: Timestamp,
        claimed_by: &str,
    ) -> Result<Option<DueRetry>, StoreError> {
        if self.failing() {
            return Err(self.error());
        }
        self.inner.claim_job(job, now, claimed_by)
    }
    fn scheduled_retries(&self) -> Result<Vec<DueRetry>, StoreError> {
        self.inner.scheduled_retries()
    }
    fn record_reconciliation_lookup(
        &self,
        action: ActionId,
        lookup: &str,
        status: Option<u16>,
        verdict: &str,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        if self.failing() {
            return Err(self.error());
        }
        self.inner
            .record_reconciliation_lookup(action, lookup, status, verdict, at)
    }
    fn update_scope(&self, update: ScopeUpdate, at: Timestamp) -> Result<ScopeRecord, StoreError> {
        self.inner.update_scope(update, at)
    }
    fn open_escalation(
        &self,
        action: ActionId,
        case_file: serde_json::Value,
        at: Timestamp,
    ) -> Result<EscalationId, StoreError> {
        if self.failing() {
            return Err(self.error());
        }
        self.inner.open_escalation(action, case_file, at)
    }
    fn open_escalation_with_context(
        &self,
        action: ActionId,
        case_file: serde_json::Value,
        context: serde_json::Value,
        at: Timestamp,
    ) -> Result<EscalationId, StoreError> {
        if self.failing() {
            return Err(self.error());
        }
        self.inner
            .open_escalation_with_context(action, case_file, context, at)
    }
    fn open_escalation_beside_outcome(
        &self,
        action: ActionId,
        case_file: serde_json::Value,
        at: Timestamp,
    ) -> Result<EscalationId, StoreError> {
        if self.failing() {
            return Err(self.error());
        }
        self.inner
            .open_escalation_beside_outcome(action, case_file, at)
    }
    fn decide_escalation(
        &self,
        escalation: EscalationId,
        decision: &str,
        decided_by: &str,
        note: Option<&str>,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        self.inner
            .decide_escalation(escalation, decision, decided_by, note, at)
    }
    fn reopen_for_retry(
        &self,
        action: ActionId,
        decided_by: &str,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        self.inner.reopen_for_retry(action, decided_by, at)
    }
    fn reopen_for_resend(
        &self,
        action: ActionId,
        advised: Option<Timestamp>,
        escalation: Option<EscalationId>,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        if self.failing() {
            return Err(self.error());
        }
        self.inner
            .reopen_for_resend(action, advised, escalation, at)
    }

    fn keep_request(
        &self,
        action: ActionId,
        request: backstop_store::KeptRequest,
    ) -> Result<(), StoreError> {
        if self.failing() {
            return Err(self.error());
        }
        self.inner.keep_request(action, request)
    }

    fn kept_request(
        &self,
        action: ActionId,
    ) -> Result<Option<backstop_store::KeptRequest>, StoreError> {
        self.inner.kept_request(action)
    }

    fn resume_after_restart(&self, action: ActionId, at: Timestamp) -> Result<(), StoreError> {
        if self.failing() {
            return Err(self.error());
        }
        self.inner.resume_after_restart(action, at)
    }
    fn record_access_decision(
        &self,
        escalation: EscalationId,
        access: &str,
        decided_by: &str,
        outcome: &str,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        self.inner
            .record_access_decision(escalation, access, decided_by, outcome, at)
    }
    fn record_status_query(
        &self,
        escalation: EscalationId,
        decided_by: &str,
        verdict: &str,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        if self.failing() {
            return Err(self.error());
        }
        self.inner
            .record_status_query(escalation, decided_by, verdict, at)
    }
    fn cancel_task(
        &self,
        agent: &str,
        task: &str,
        at: Timestamp,
    ) -> Result<CancelReport, StoreError> {
        self.inner.cancel_task(agent, task, at)
    }
    fn record_circuit_opened(
        &self,
        agent: &str,
        task: &str,
        provider: &str,
        method: &str,
        route: &RouteTemplate,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        self.inner
            .record_circuit_opened(agent, task, provider, method, route, at)
    }
    fn record_watchdog_finding(
        &self,
        action: ActionId,
        finding: &str,
        job: Option<JobId>,
        due_at: Option<Timestamp>,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        self.inner
            .record_watchdog_finding(action, finding, job, due_at, at)
    }
    fn task(&self, agent: &str, id: &str) -> Result<Option<TaskRecord>, StoreError> {
        self.inner.task(agent, id)
    }
    fn tasks_of_every_agent(&self, id: &str) -> Result<Vec<TaskRecord>, StoreError> {
        self.inner.tasks_of_every_agent(id)
    }
    fn action(&self, id: ActionId) -> Result<Option<ActionRecord>, StoreError> {
        self.inner.action(id)
    }
    fn action_by_key(
        &self,
        agent: &str,
        idempotency_key: &str,
    ) -> Result<Option<ActionRecord>, StoreError> {
        self.inner.action_by_key(agent, idempotency_key)
    }
    fn actions_sharing_reference(
        &self,
        provider: &str,
        reference: &str,
        except: ActionId,
    ) -> Result<Vec<ActionId>, StoreError> {
        self.inner
            .actions_sharing_reference(provider, reference, except)
    }
    fn attempts(&self, action: ActionId) -> Result<Vec<AttemptRecord>, StoreError> {
        {
            let mut gate = self.attempts_gate.lock().unwrap();
            if gate.holding {
                gate.waiting += 1;
                while gate.holding {
                    gate = self.attempts_released.wait(gate).unwrap();
                }
                gate.waiting -= 1;
            }
        }
        self.inner.attempts(action)
    }
    fn unfinished_attempts(&self) -> Result<Vec<UnfinishedAttempt>, StoreError> {
        self.inner.unfinished_attempts()
    }
    fn unsent_writes(&self) -> Result<Vec<ActionId>, StoreError> {
        self.inner.unsent_writes()
    }
    fn unsent_reads(&self) -> Result<Vec<ActionId>, StoreError> {
        self.inner.unsent_reads()
    }
    fn actions_between_attempts(&self) -> Result<Vec<ActionId>, StoreError> {
        self.inner.actions_between_attempts()
    }
    fn scope(&self, provider: &str, scope: &str) -> Result<Option<ScopeRecord>, StoreError> {
        self.inner.scope(provider, scope)
    }
    fn escalation(&self, id: EscalationId) -> Result<Option<EscalationRecord>, StoreError> {
        self.inner.escalation(id)
    }
    fn open_escalations(&self) -> Result<Vec<EscalationRecord>, StoreError> {
        self.inner.open_escalations()
    }
    fn escalations_of_action(&self, action: ActionId) -> Result<Vec<EscalationRecord>, StoreError> {
        self.inner.escalations_of_action(action)
    }
    fn escalations_decided_since(
        &self,
        since: Timestamp,
    ) -> Result<Vec<EscalationRecord>, StoreError> {
        self.inner.escalations_decided_since(since)
    }
    fn audit_events(&self, since: u64, limit: usize) -> Result<Vec<AuditEvent>, StoreError> {
        self.inner.audit_events(since, limit)
    }
    fn audit_head(&self) -> Result<Option<ChainHead>, StoreError> {
        self.inner.audit_head()
    }
}
