//! The embedded SQLite implementation of [`Store`], and the read-only [`AuditReader`].
//!
//! # Durability and group commit
//! One writer thread owns the only write connection (WAL, `synchronous=FULL`, so every commit
//! is fsync'd before it returns; a group holding only reads is the one exception, see "Groups
//! of reads only"). Callers hand it operations over a channel and block on their
//! own reply. The writer takes the first waiting operation, drains whatever else is queued (up to
//! [`MAX_BATCH`]), runs each inside its own savepoint of one `BEGIN IMMEDIATE` transaction and
//! commits once: many concurrent actions share one fsync. An operation that fails is rolled back
//! to its savepoint and answered with its error; the others still commit. Consecutive held reads
//! share one savepoint (SQLite copies each page into a savepoint's journal once per savepoint)
//! and are run again one by one only when one of them fails, with the same result as if each
//! had had its own. Replies are sent only
//! after `COMMIT` returned, so when [`Store::mark_attempt_sent`] returns `Ok`, its `action_sent`
//! event is on disk and the request's bytes may leave.
//!
//! Every statement, including `BEGIN`/`SAVEPOINT`/`RELEASE`/`COMMIT`, goes through the
//! connection's statement cache, so the writer parses SQL once per connection, not per call.
//!
//! # Queued operations and what a crash can lose
//! [`Store::begin_action`], [`Store::submit_attempt_sent`] and [`Store::submit_result`] queue
//! the operation and return at once; the completion is called on the writer thread after the
//! commit (so awaiting it gives exactly the durability of the blocking methods — a write awaits
//! `submit_attempt_sent` before its bytes leave). One queue, one writer: the operations of an
//! action run and commit in the order they were queued, and each event commits with its state
//! change.
//!
//! # Reads: one operation per read, once its answer is known
//! [`Store::record_read`] hands out the action id itself (from a counter the writer shares,
//! started at `MAX(id) + 1` when the store opens) and queues nothing yet: the read is *held* in
//! memory, and its [`Store::submit_attempt_sent`] is added to it. Its
//! [`Store::submit_result`] queues the whole read as ONE operation (task and action rows,
//! `task_opened`, `action_requested`, `action_sent`, `action_result`, `action_finished`: the
//! same rows and events the separate operations write, in one savepoint), so a proxied read
//! costs the writer one queue entry instead of three, and never waits for it or an fsync. A
//! held read is queued early, as far as it got, whenever something may need to see it: before
//! any blocking operation (a retry's result, a cancellation, an escalation, …), before any
//! read through the [`Store`], on [`Store::flush`] and when the store is closed. So every
//! operation still finds what was recorded before it, and a caller reads its own writes. A
//! read still unanswered is queued by the writer itself, as far as it got, once it is
//! [`HOLD_LIMIT`] old by the latest instant a read brought to the store (the store never reads
//! the clock), or when the writer saw nothing at all for [`HOLD_LIMIT`]. So a slow call is in
//! the log about a second after it started and its `done` is called even if nothing else
//! happens; its result is then an operation of its own.
//!
//! The refusal of a read for a cancelled task needs no query either: the cancelled tasks are
//! kept in memory (read once when the store opens, added to by [`Store::cancel_task`]).
//!
//! On a crash (power loss, SIGKILL) what is lost is exactly the reads still held or queued
//! but not yet in a committed group (SPEC §12: reads may be recorded asynchronously): a read
//! in flight, or answered just before the crash, may be missing from the log from
//! `task_opened` on. The chain stays intact, since a group commits whole or not at all.
//! Writes lose nothing they were sent under: their records were awaited. The store assumes it
//! is the only process that adds actions to the file or cancels tasks in it (the id counter
//! and the cancelled tasks live in this process).
//!
//! # Groups of reads only
//! Nobody waits for a group that holds only reads, so the writer lets it gather: when every
//! operation it took is a read, it waits up to [`READ_LINGER`] (5 ms) for more before it
//! begins the transaction, and commits it with `synchronous=NORMAL`, without an fsync, unless
//! the last fsync'd commit is [`READ_SYNC_INTERVAL`] (100 ms) old. Any other operation ends
//! the wait at once (its caller wakes the writer), and its group is fsync'd as always, with
//! `synchronous=FULL` set again before it begins. Fewer, larger commits rewrite the same hot
//! pages (the log's right edge, the indexes' last leaves) into the WAL far less often per read,
//! and reads pay for one fsync per 100 ms instead of one per group. This widens what a power
//! loss can lose to the read groups committed since the last fsync (about the last 100 ms of
//! reads), never a write's records: WAL frames are appended in order, so the fsync of a later
//! commit makes every earlier frame durable too, and recovery stops at the first incomplete
//! commit — the chain can lose its tail, never a link in its middle. A process crash (SIGKILL)
//! loses none of them: the frames are in the file once `COMMIT` returned.
//!
//! Readers use separate connections from a small pool and never wait for the writer (WAL),
//! except that a read through the [`Store`] first waits for operations queued without being
//! awaited (one empty group commit), so a caller reads its own writes.
//!
//! # The watch feed
//! [`Store::watch_events`] is answered from memory for what this store committed: after each
//! commit the writer hands what it sealed to a bounded feed that keeps only what a health
//! watcher needs (see `feed`; a plain answered read is noted as its send alone, without a
//! copy of the event), and a watcher's call takes it out. What was committed before the store
//! opened, or dropped from a full feed, is read from the database as before.

mod durable;
mod feed;
mod lock;
mod ops;
mod rows;
mod schema;
mod verify;
mod writer;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::mpsc::{self, SyncSender};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::thread::{JoinHandle, Thread};
use std::time::Duration;

use jiff::Timestamp;
use rusqlite::Connection;

pub use schema::{APPLICATION_ID, OLDEST_READABLE_VERSION, SCHEMA_VERSION};

use crate::audit::{AuditEvent, Chain, ChainHead, Verdict};
use crate::error::StoreError;
use crate::model::{
    ActionId, ActionRecord, Admission, AttemptRecord, AttemptResult, CancelReport, DueRetry,
    EscalationId, EscalationRecord, Finish, JobId, KeptRequest, NewAction, NewTask, RouteTemplate,
    ScopeRecord, ScopeUpdate, TaskRecord, UnfinishedAttempt,
};
use crate::store::{Completion, Store};
use ops::{ReadStep, WriteTx};
use verify::{checked_head, verify_connection, OUTSIDE_SHOWN};
use writer::{
    job, read_job, unawaited, writer_loop, Counters, HeldRead, HeldReads, Job, Linger, StepDone,
};

pub use writer::{HOLD_LIMIT, MAX_BATCH, READ_LINGER, READ_SYNC_INTERVAL};

/// backstop's state in one SQLite file. See the module docs for durability.
pub struct SqliteStore {
    path: PathBuf,
    jobs: Mutex<Option<SyncSender<Job>>>,
    writer: Mutex<Option<JoinHandle<()>>>,
    /// The writer thread, woken when an operation that is not a read arrives while the writer
    /// lingers over a group of reads.
    writer_thread: Thread,
    linger: Arc<Linger>,
    readers: Mutex<Vec<Connection>>,
    counters: Arc<Counters>,
    /// Reads recorded by [`Store::record_read`] whose bookkeeping is not queued yet (shared
    /// with the writer, which queues those held too long).
    held: HeldReads,
    /// Cancelled tasks: agent → task ids.
    cancelled: RwLock<HashMap<String, HashSet<String>>>,
    /// Committed events for [`Store::watch_events`], filled by the writer (see `feed`).
    feed: Arc<Mutex<feed::WatchFeed>>,
    /// The file's exclusive write lock (see `lock`), released last, when the store is dropped.
    _lock: lock::StoreLock,
}

/// How the writer grouped operations into commits since the store was opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriterStats {
    /// Transactions committed.
    pub transactions: u64,
    /// Of those, the transactions that held only reads and were committed without waiting for
    /// the disk (`synchronous=NORMAL`; every other transaction is fsync'd before its
    /// completions run).
    pub lazy_transactions: u64,
    /// Operations those transactions carried (including ones that failed and were rolled back
    /// to their savepoint).
    pub operations: u64,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl SqliteStore {
    /// Opens (creating if missing) and migrates a store at `path`, and starts its writer thread.
    ///
    /// # Errors
    /// [`StoreError::NotSqlite`], [`StoreError::DamagedFile`] (a SQLite file cut short or
    /// damaged), [`StoreError::Foreign`] or [`StoreError::TooNew`] when the file is not a
    /// backstop database this build can use (it is then left untouched);
    /// [`StoreError::Locked`] when another open store holds the file's write lock (an
    /// advisory lock on the database file itself on Linux, held until this store is dropped;
    /// see the `lock` module); [`StoreError::BrokenHead`] when the
    /// audit log's last event does not match its hash, cannot be decoded (its hash included)
    /// or does not link to the event before it (new events would extend a broken chain);
    /// [`StoreError::NotDurable`] when writes cannot be made durable there (a read-only file or
    /// file system, a directory that takes no new file, a test commit that fails; see the
    /// `durable` module); [`StoreError::Sqlite`] for I/O problems.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        Self::start(path.as_ref(), true)
    }

    /// Like [`SqliteStore::open`], but never creates a file.
    ///
    /// # Errors
    /// [`StoreError::Missing`] when the file does not exist; otherwise as [`SqliteStore::open`].
    pub fn open_existing(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        Self::start(path.as_ref(), false)
    }

    fn start(path: &Path, create: bool) -> Result<Self, StoreError> {
        // One writer per file: refused before the file is opened or migrated.
        durable::check_place(path)?;
        let lock = lock::StoreLock::acquire(path, create)?;
        let conn = schema::open_writer(path, create)?;
        durable::check_commit(&conn, path)?;
        let head = checked_head(&conn, path)?;
        let chain = Chain::after(head.as_ref());
        let next_id: i64 = conn
            .prepare_cached("SELECT COALESCE(MAX(id), 0) + 1 FROM actions")?
            .query_row([], |r| r.get(0))?;
        let mut cancelled: HashMap<String, HashSet<String>> = HashMap::new();
        for (agent, task) in rows::cancelled_tasks(&conn)? {
            cancelled.entry(agent).or_default().insert(task);
        }
        let (tx, rx) = mpsc::sync_channel::<Job>(4 * MAX_BATCH);
        let counters = Arc::new(Counters {
            next_action_id: AtomicI64::new(next_id),
            ..Counters::default()
        });
        let writer_counters = Arc::clone(&counters);
        let held: HeldReads = Arc::new(Mutex::new(HashMap::new()));
        let writer_held = Arc::clone(&held);
        let feed = Arc::new(Mutex::new(feed::WatchFeed::after(chain.last_seq())));
        let writer_feed = Arc::clone(&feed);
        let linger = Arc::new(Linger::new(READ_LINGER, READ_SYNC_INTERVAL));
        let writer_linger = Arc::clone(&linger);
        let writer = std::thread::Builder::new()
            .name("backstop-store-writer".into())
            .spawn(move || {
                writer_loop(
                    conn,
                    chain,
                    rx,
                    &writer_counters,
                    &writer_held,
                    &writer_feed,
                    &writer_linger,
                )
            })
            .map_err(|e| StoreError::Sqlite(format!("cannot start the writer thread: {e}")))?;
        Ok(SqliteStore {
            path: path.to_owned(),
            jobs: Mutex::new(Some(tx)),
            writer_thread: writer.thread().clone(),
            writer: Mutex::new(Some(writer)),
            linger,
            readers: Mutex::new(Vec::new()),
            counters,
            held,
            cancelled: RwLock::new(cancelled),
            feed,
            _lock: lock,
        })
    }

    /// How many transactions and operations the writer committed so far.
    pub fn writer_stats(&self) -> WriterStats {
        WriterStats {
            transactions: self.counters.transactions.load(Ordering::Relaxed),
            lazy_transactions: self.counters.lazy_transactions.load(Ordering::Relaxed),
            operations: self.counters.operations.load(Ordering::Relaxed),
        }
    }

    /// Sets how long a group holding only reads waits for more operations before it commits
    /// (default [`READ_LINGER`]; zero commits each group as soon as it is taken). Takes effect
    /// from the writer's next group.
    pub fn set_read_linger(&self, linger: Duration) {
        self.linger.set(linger);
    }

    /// Sets how long after an fsync'd commit groups of reads only are committed without an
    /// fsync (default [`READ_SYNC_INTERVAL`]; zero fsyncs every group). Takes effect from the
    /// writer's next group.
    pub fn set_read_sync_interval(&self, interval: Duration) {
        self.linger.set_sync_every(interval);
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `op` in the next group commit (after every held read, queued first) and waits
    /// until that commit is durable.
    fn submit<T, F>(&self, op: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut WriteTx<'_>) -> Result<T, StoreError> + Send + 'static,
    {
        self.queue_held_reads();
        let (reply_tx, reply_rx) = mpsc::sync_channel::<Result<T, StoreError>>(1);
        self.enqueue(
            op,
            Box::new(move |reply| {
                // The caller may have given up; nobody to tell then.
                let _ = reply_tx.send(reply);
            }),
        );
        reply_rx.recv().map_err(|_| StoreError::WriterGone)?
    }

    /// Queues `op` for the next group commit without waiting; `done` is called on the writer
    /// thread once the transaction holding it is durable (or with the error that undid it).
    /// Operations run in the order they were queued.
    fn enqueue<T, F>(&self, op: F, done: Completion<T>)
    where
        T: Send + 'static,
        F: FnOnce(&mut WriteTx<'_>) -> Result<T, StoreError> + Send + 'static,
    {
        self.send(job(op, done));
    }

    /// Hands a job to the writer (or fails it when the writer is gone).
    fn send(&self, job: Job) {
        let sender = self
            .jobs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let Some(sender) = sender else {
            return job.fail(StoreError::WriterGone);
        };
        let read = matches!(job, Job::Read(_));
        if let Err(mpsc::SendError(job)) = sender.send(job) {
            return job.fail(StoreError::WriterGone);
        }
        // Sent before the flag is read: a writer that raised it after this send finds the job
        // when it drains the queue, one that raised it before is woken here.
        if !read && self.linger.lingering.load(Ordering::SeqCst) {
            self.writer_thread.unpark();
        }
    }

    /// Like [`SqliteStore::enqueue`] for a caller that will not wait: counted in
    /// `unawaited` until its commit, so that reads through the store see it.
    fn enqueue_unawaited<T, F>(&self, op: F, done: Completion<T>)
    where
        T: Send + 'static,
        F: FnOnce(&mut WriteTx<'_>) -> Result<T, StoreError> + Send + 'static,
    {
        self.enqueue(op, unawaited(&self.counters, done));
    }

    /// Notes the instant an operation brought (how old held reads are, see the module docs).
    fn saw(&self, at: Timestamp) {
        self.counters
            .latest_ms
            .fetch_max(at.as_millisecond(), Ordering::Relaxed);
    }

    fn held_reads(&self) -> MutexGuard<'_, HashMap<ActionId, HeldRead>> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues every held read as far as it got (oldest first), so that what is queued after
    /// finds it.
    fn queue_held_reads(&self) {
        let mut held = self.held_reads();
        if held.is_empty() {
            return;
        }
        let mut reads: Vec<(ActionId, HeldRead)> = held.drain().collect();
        reads.sort_by_key(|(id, _)| *id);
        // Queued under the lock: a step submitted meanwhile cannot overtake its read.
        for (id, read) in reads {
            self.send(read_job(id, read, &self.counters));
        }
    }

    /// Runs `f` on a pooled read connection.
    fn read<T>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        self.queue_held_reads();
        if self.counters.unawaited.load(Ordering::Acquire) > 0 {
            // Read your own writes: an empty operation commits after everything queued before.
            self.submit(|_| Ok(()))?;
        }
        self.read_now(f)
    }

    /// Runs `f` on a pooled read connection without waiting for queued operations: it sees
    /// what has committed.
    fn read_now<T>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let pooled = self
            .readers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        let conn = match pooled {
            Some(c) => c,
            None => schema::open_reader(&self.path, false)?,
        };
        let result = f(&conn);
        self.readers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(conn);
        result
    }

    /// Verifies the whole audit chain in this database. See `verify_chain`.
    ///
    /// # Errors
    /// Storage errors; a chain break is a [`Verdict::Broken`], not an error.
    pub fn verify_audit(&self, expect_head: Option<&str>) -> Result<Verdict, StoreError> {
        self.read(|conn| verify_connection(conn, expect_head))
    }
}

impl Drop for SqliteStore {
    fn drop(&mut self) {
        self.queue_held_reads();
        // Closing the channel ends the writer loop after it finished the queued operations.
        self.jobs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        // A writer lingering over reads finds the channel closed now, not when it times out.
        self.writer_thread.unpark();
        if let Some(handle) = self
            .writer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            let _ = handle.join();
        }
    }
}

impl Store for SqliteStore {
    fn open_task(&self, task: NewTask, at: Timestamp) -> Result<(), StoreError> {
        self.submit(move |tx| tx.open_task(task, at))
    }

    fn record_action(&self, action: NewAction, at: Timestamp) -> Result<Admission, StoreError> {
        self.submit(move |tx| tx.record_action(action, at))
    }

    fn mark_attempt_sent(&self, action: ActionId, at: Timestamp) -> Result<u32, StoreError> {
        self.submit(move |tx| tx.mark_attempt_sent(action, at))
    }

    fn begin_action(
        &self,
        task: NewTask,
        action: NewAction,
        at: Timestamp,
        done: Completion<Admission>,
    ) {
        self.enqueue(move |tx| tx.open_and_record(task, action, None, at), done);
    }

    fn record_read(
        &self,
        task: NewTask,
        action: NewAction,
        at: Timestamp,
        done: Completion<()>,
    ) -> Result<ActionId, StoreError> {
        if !action.idempotency_key.is_empty() {
            return Err(StoreError::Invalid {
                field: "idempotency_key",
                reason: "an action with an idempotency key is a write; it must be recorded \
                         durably before it is sent"
                    .into(),
            });
        }
        ops::check_names_task(&task, &action)?;
        let cancelled = self
            .cancelled
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&task.agent)
            .is_some_and(|ids| ids.contains(&task.id));
        if cancelled {
            return Err(StoreError::InvalidTransition {
                what: format!("task {:?}", task.id),
                reason: "cancelled; it takes no new actions".into(),
            });
        }
        let id = ActionId(self.counters.next_action_id.fetch_add(1, Ordering::Relaxed));
        self.saw(at);
        // Held until its answer is known (see the module docs).
        self.held_reads().insert(
            id,
            HeldRead {
                task,
                action,
                at,
                recorded: done,
                steps: Vec::new(),
            },
        );
        Ok(id)
    }

    fn flush(&self) -> Result<(), StoreError> {
        // An empty operation commits after everything queued before it.
        self.submit(|_| Ok(()))
    }

    fn submit_attempt_sent(&self, action: ActionId, at: Timestamp, done: Completion<u32>) {
        self.saw(at);
        if let Some(read) = self.held_reads().get_mut(&action) {
            read.steps.push((ReadStep::Sent(at), StepDone::Sent(done)));
            return;
        }
        self.enqueue_unawaited(move |tx| tx.mark_attempt_sent(action, at), done);
    }

    fn submit_result(&self, result: AttemptResult, at: Timestamp, done: Completion<()>) {
        self.saw(at);
        let mut held = self.held_reads();
        if let Some(mut read) = held.remove(&result.action) {
            // The read's answer is known: the whole read is queued as one operation (under the
            // lock, so a flush of the held reads cannot queue anything of it ahead).
            let id = result.action;
            read.steps
                .push((ReadStep::Result(result, at), StepDone::Result(done)));
            self.send(read_job(id, read, &self.counters));
            return;
        }
        drop(held);
        self.enqueue_unawaited(move |tx| tx.record_result(result, at), done);
    }

    fn record_result(&self, result: AttemptResult, at: Timestamp) -> Result<(), StoreError> {
        self.submit(move |tx| tx.record_result(result, at))
    }

    fn finish_action(
        &self,
        action: ActionId,
        finish: Finish,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        self.submit(move |tx| tx.finish_action(action, finish, at))
    }

    fn record_reconciled(
        &self,
        action: ActionId,
        provider_operation_id: Option<String>,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        self.submit(move |tx| tx.record_reconciled(action, provider_operation_id, None, at))
    }

    fn record_reconciled_with_context(
        &self,
        action: ActionId,
        provider_operation_id: Option<String>,
        context: serde_json::Value,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        if !context.is_object() {
            return Err(StoreError::Invalid {
                field: "outcome_context",
                reason: "a reconciled action's outcome context must be a JSON object".into(),
            });
        }
        self.submit(move |tx| {
            tx.record_reconciled(action, provider_operation_id, Some(context), at)
        })
    }

    fn schedule_retry(
        &self,
        action: ActionId,
        due_at: Timestamp,
        at: Timestamp,
    ) -> Result<JobId, StoreError> {
        self.submit(move |tx| tx.schedule_retry(action, due_at, at))
    }

    fn claim_due(
        &self,
        now: Timestamp,
        limit: usize,
        claimed_by: &str,
    ) -> Result<Vec<DueRetry>, StoreError> {
        let claimed_by = claimed_by.to_owned();
        self.submit(move |tx| tx.claim_due(now, limit, &claimed_by))
    }

    fn claim_job(
        &self,
        job: JobId,
        now: Timestamp,
        claimed_by: &str,
    ) -> Result<Option<DueRetry>, StoreError> {
        let claimed_by = claimed_by.to_owned();
        self.submit(move |tx| tx.claim_job(job, now, &claimed_by))
    }

    fn record_reconciliation_lookup(
        &self,
        action: ActionId,
        lookup: &str,
        status: Option<u16>,
        verdict: &str,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        let (lookup, verdict) = (lookup.to_owned(), verdict.to_owned());
        self.submit(move |tx| {
            tx.record_reconciliation_lookup(action, &lookup, status, &verdict, at)
        })
    }

    fn scheduled_retries(&self) -> Result<Vec<DueRetry>, StoreError> {
        self.read(rows::scheduled_retries)
    }

    fn update_scope(&self, update: ScopeUpdate, at: Timestamp) -> Result<ScopeRecord, StoreError> {
        self.submit(move |tx| tx.update_scope(update, at))
    }

    fn open_escalation(
        &self,
        action: ActionId,
        case_file: serde_json::Value,
        at: Timestamp,
    ) -> Result<EscalationId, StoreError> {
        self.submit(move |tx| tx.open_escalation(action, case_file, None, at))
    }

    fn open_escalation_with_context(
        &self,
        action: ActionId,
        case_file: serde_json::Value,
        context: serde_json::Value,
        at: Timestamp,
    ) -> Result<EscalationId, StoreError> {
        if !context.is_object() {
            return Err(StoreError::Invalid {
                field: "outcome_context",
                reason: "an escalation's outcome context must be a JSON object".into(),
            });
        }
        self.submit(move |tx| tx.open_escalation(action, case_file, Some(context), at))
    }

    fn open_escalation_beside_outcome(
        &self,
        action: ActionId,
        case_file: serde_json::Value,
        at: Timestamp,
    ) -> Result<EscalationId, StoreError> {
        self.submit(move |tx| tx.open_escalation_beside_outcome(action, case_file, at))
    }

    fn decide_escalation(
        &self,
        escalation: EscalationId,
        decision: &str,
        decided_by: &str,
        note: Option<&str>,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        let (decision, decided_by) = (decision.to_owned(), decided_by.to_owned());
        let note = note.map(str::to_owned);
        self.submit(move |tx| {
            tx.decide_escalation(escalation, &decision, &decided_by, note.as_deref(), at)
        })
    }

    fn reopen_for_retry(
        &self,
        action: ActionId,
        decided_by: &str,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        let decided_by = decided_by.to_owned();
        self.submit(move |tx| tx.reopen_for_retry(action, &decided_by, at))
    }

    fn reopen_for_resend(
        &self,
        action: ActionId,
        advised: Option<Timestamp>,
        escalation: Option<EscalationId>,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        self.submit(move |tx| tx.reopen_for_resend(action, advised, escalation, at))
    }

    fn keep_request(&self, action: ActionId, request: KeptRequest) -> Result<(), StoreError> {
        self.submit(move |tx| tx.keep_request(action, &request))
    }

    fn kept_request(&self, action: ActionId) -> Result<Option<KeptRequest>, StoreError> {
        self.read(|c| rows::kept_request(c, action))
    }

    fn resume_after_restart(&self, action: ActionId, at: Timestamp) -> Result<(), StoreError> {
        self.submit(move |tx| tx.resume_after_restart(action, at))
    }

    fn record_access_decision(
        &self,
        escalation: EscalationId,
        access: &str,
        decided_by: &str,
        outcome: &str,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        let (access, decided_by, outcome) =
            (access.to_owned(), decided_by.to_owned(), outcome.to_owned());
        self.submit(move |tx| {
            tx.record_access_decision(escalation, &access, &decided_by, &outcome, at)
        })
    }

    fn record_status_query(
        &self,
        escalation: EscalationId,
        decided_by: &str,
        verdict: &str,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        let (decided_by, verdict) = (decided_by.to_owned(), verdict.to_owned());
        self.submit(move |tx| tx.record_status_query(escalation, &decided_by, &verdict, at))
    }

    fn cancel_task(
        &self,
        agent: &str,
        task: &str,
        at: Timestamp,
    ) -> Result<CancelReport, StoreError> {
        let (agent, task) = (agent.to_owned(), task.to_owned());
        let (owner, id) = (agent.clone(), task.clone());
        let report = self.submit(move |tx| tx.cancel_task(&agent, &task, at))?;
        // Committed: reads for the task are refused from now on without a query.
        self.cancelled
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(owner)
            .or_default()
            .insert(id);
        Ok(report)
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
        let (agent, task, provider, method, route) = (
            agent.to_owned(),
            task.to_owned(),
            provider.to_owned(),
            method.to_owned(),
            route.clone(),
        );
        self.submit(move |tx| {
            tx.record_circuit_opened(&agent, &task, &provider, &method, &route, at)
        })
    }

    fn record_watchdog_finding(
        &self,
        action: ActionId,
        finding: &str,
        job: Option<JobId>,
        due_at: Option<Timestamp>,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        let finding = finding.to_owned();
        self.submit(move |tx| tx.record_watchdog_finding(action, &finding, job, due_at, at))
    }

    fn task(&self, agent: &str, id: &str) -> Result<Option<TaskRecord>, StoreError> {
        self.read(|c| rows::task(c, agent, id))
    }

    fn tasks_of_every_agent(&self, id: &str) -> Result<Vec<TaskRecord>, StoreError> {
        self.read(|c| rows::tasks_with_id(c, id))
    }

    fn action(&self, id: ActionId) -> Result<Option<ActionRecord>, StoreError> {
        self.read(|c| rows::action(c, id))
    }

    fn action_by_key(
        &self,
        agent: &str,
        idempotency_key: &str,
    ) -> Result<Option<ActionRecord>, StoreError> {
        self.read(|c| rows::action_by_key(c, agent, idempotency_key))
    }

    fn actions_sharing_reference(
        &self,
        provider: &str,
        reference: &str,
        except: ActionId,
    ) -> Result<Vec<ActionId>, StoreError> {
        self.read(|c| rows::actions_sharing_reference(c, provider, reference, except))
    }

    fn attempts(&self, action: ActionId) -> Result<Vec<AttemptRecord>, StoreError> {
        self.read(|c| rows::attempts(c, action))
    }

    fn unfinished_attempts(&self) -> Result<Vec<UnfinishedAttempt>, StoreError> {
        self.read(rows::unfinished_attempts)
    }

    fn unsent_writes(&self) -> Result<Vec<ActionId>, StoreError> {
        self.read(rows::unsent_writes)
    }

    fn unsent_reads(&self) -> Result<Vec<ActionId>, StoreError> {
        self.read(rows::unsent_reads)
    }

    fn actions_between_attempts(&self) -> Result<Vec<ActionId>, StoreError> {
        self.read(rows::actions_between_attempts)
    }

    fn scope(&self, provider: &str, scope: &str) -> Result<Option<ScopeRecord>, StoreError> {
        self.read(|c| rows::scope(c, provider, scope))
    }

    fn escalation(&self, id: EscalationId) -> Result<Option<EscalationRecord>, StoreError> {
        self.read(|c| rows::escalation(c, id))
    }

    fn open_escalations(&self) -> Result<Vec<EscalationRecord>, StoreError> {
        self.read(rows::open_escalations)
    }

    fn count_open_escalations(&self) -> Result<u64, StoreError> {
        self.read(rows::count_open_escalations)
    }

    fn escalations_of_action(&self, action: ActionId) -> Result<Vec<EscalationRecord>, StoreError> {
        self.read(|c| rows::escalations_of_action(c, action))
    }

    fn escalations_decided_since(
        &self,
        since: Timestamp,
    ) -> Result<Vec<EscalationRecord>, StoreError> {
        self.read(|c| rows::escalations_decided_since(c, since))
    }

    fn audit_events(&self, since: u64, limit: usize) -> Result<Vec<AuditEvent>, StoreError> {
        self.read(|c| rows::audit_events(c, since, limit))
    }

    fn watch_events(
        &self,
        since: u64,
        limit: usize,
    ) -> Result<(Vec<AuditEvent>, Option<u64>), StoreError> {
        // What has committed only: a watcher needs no read-your-writes (no empty group commit,
        // held reads stay held). From memory when the feed holds everything after `since`;
        // from the database for what was committed before this store was opened or dropped
        // from the feed (see `feed`).
        let from_feed = self
            .feed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .page(since, limit);
        match from_feed {
            Some(page) => Ok(page),
            None => self.read_now(|c| rows::watch_events(c, since, limit)),
        }
    }

    fn audit_head(&self) -> Result<Option<ChainHead>, StoreError> {
        self.read(rows::audit_head)
    }

    fn write_failure(&self) -> Option<String> {
        self.counters
            .write_failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// Read-only access to the audit log of an existing backstop database, for
/// `backstop audit verify|export|head`. Opening never creates or migrates a file.
#[derive(Debug)]
pub struct AuditReader {
    conn: Connection,
    /// The database file, named in errors.
    path: std::path::PathBuf,
}

impl AuditReader {
    /// Opens `path` read-only and checks it is a backstop database this build reads: of this
    /// schema version, or of an older one from [`OLDEST_READABLE_VERSION`] on (the audit log
    /// reads the same; the file is left at its version). Where SQLite cannot create the `-shm` file beside it (a read-only directory or file
    /// system) and no `-wal` file holds changes, the file is read as `immutable=1` instead
    /// (every commit is then in the database file).
    ///
    /// # Errors
    /// [`StoreError::Missing`], [`StoreError::NotSqlite`], [`StoreError::DamagedFile`],
    /// [`StoreError::Foreign`], [`StoreError::TooNew`], [`StoreError::TooOld`] (saying what to
    /// run to upgrade it), [`StoreError::ReadOnlyWal`] (no `-shm` file can be had and the `-wal`
    /// file is not empty), or [`StoreError::Sqlite`] naming the file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        Ok(AuditReader {
            conn: schema::open_reader(path.as_ref(), true)?,
            path: path.as_ref().to_owned(),
        })
    }

    /// The chain head, or `None` for an empty log.
    ///
    /// # Errors
    /// [`StoreError::BrokenHead`] (with the pointer to `backstop audit verify`) when the last
    /// event lies outside the chain, cannot be decoded (a hash stored as text, say), does not
    /// match its hash or does not link to the event before it: the same checks as the store
    /// makes before it continues the chain, so a damaged head is never printed for anchoring;
    /// storage errors.
    pub fn head(&self) -> Result<Option<ChainHead>, StoreError> {
        self.snapshot(|conn| checked_head(conn, &self.path))
    }

    /// Writes every event with `seq > since` as NDJSON to `out`; returns how many.
    ///
    /// # Errors
    /// Storage errors, or [`StoreError::Io`] when `out` fails.
    pub fn export<W: std::io::Write>(&self, since: u64, out: &mut W) -> Result<u64, StoreError> {
        let mut count = 0u64;
        let mut failure = None;
        self.snapshot(|conn| {
            rows::for_each_event(conn, since, None, |e| match e {
                Ok(e) => match crate::audit::write_export(out, [&e]) {
                    Ok(()) => {
                        count += 1;
                        true
                    }
                    Err(io) => {
                        failure = Some(StoreError::Io {
                            place: "stdout".into(),
                            reason: io.to_string(),
                        });
                        false
                    }
                },
                Err(e) => {
                    failure = Some(e);
                    false
                }
            })
        })?;
        match failure {
            Some(e) => Err(e),
            None => Ok(count),
        }
    }

    /// Verifies the chain. See `verify_chain`.
    ///
    /// # Errors
    /// Storage errors; a chain break is a [`Verdict::Broken`], not an error.
    pub fn verify(&self, expect_head: Option<&str>) -> Result<Verdict, StoreError> {
        self.snapshot(|conn| verify_connection(conn, expect_head))
    }

    /// Rows outside the chain (`seq` 0 or below, which the store never writes and
    /// [`AuditReader::export`] does not read): how many, and the lowest `seq`s of them, up to
    /// five.
    ///
    /// # Errors
    /// Storage errors.
    pub fn outside_chain(&self) -> Result<(u64, Vec<i64>), StoreError> {
        self.snapshot(|conn| rows::seqs_outside_chain(conn, OUTSIDE_SHOWN))
    }

    /// Runs `f` on this reader inside one read transaction: every call it makes ([`verify`],
    /// [`export`], [`head`], [`outside_chain`]) reads the same committed state of the
    /// database, whatever a gateway commits meanwhile (SQLite's WAL gives the transaction the
    /// snapshot current at its first read and keeps it to its end). Each of those calls alone
    /// already reads one snapshot; this groups several.
    ///
    /// [`verify`]: AuditReader::verify
    /// [`export`]: AuditReader::export
    /// [`head`]: AuditReader::head
    /// [`outside_chain`]: AuditReader::outside_chain
    ///
    /// # Errors
    /// [`StoreError::Sqlite`] naming the file when the read transaction cannot begin or its
    /// first read fails.
    pub fn in_snapshot<T>(&self, f: impl FnOnce(&Self) -> T) -> Result<T, StoreError> {
        self.snapshot(|_| Ok(f(self)))
    }

    /// Runs `f` in one read transaction (see [`AuditReader::in_snapshot`]); inside one
    /// already, `f` joins it.
    fn snapshot<T>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        if !self.conn.is_autocommit() {
            return f(&self.conn);
        }
        let named =
            |e: rusqlite::Error| StoreError::Sqlite(format!("{}: {e}", self.path.display()));
        self.conn.execute_batch("BEGIN DEFERRED").map_err(named)?;
        // A deferred transaction takes its snapshot at its first read: taken here, before `f`.
        let began = self
            .conn
            .query_row("SELECT count(*) FROM sqlite_schema", [], |r| {
                r.get::<_, i64>(0)
            })
            .map_err(named);
        let result = began.and_then(|_| f(&self.conn));
        // Nothing was written: ending the read transaction cannot lose anything.
        let _ = self.conn.execute_batch("ROLLBACK");
        result
    }
}

#[cfg(test)]
mod tests {
    use super::writer::{control, Group, ReadJob};
    use super::*;
    use crate::model::{
        Disposition, Finish, Outcome, PayloadDigest, Priority, RouteTemplate, StoredResponse,
    };

    fn t(ms: i64) -> Timestamp {
        Timestamp::from_millisecond(1_750_000_000_000 + ms).expect("valid test instant")
    }

    /// A held read of `task-1`, sent and answered; its result names attempt 2 (never sent, so
    /// the read fails with `NotFound`) when `fails`.
    fn answered_read(id: i64, fails: bool) -> Box<ReadJob> {
        read_of("task-1", id, if fails { 2 } else { 1 })
    }

    /// A held read of `task` under action `id`, sent once and answered for attempt `attempt`.
    fn read_of(task_id: &str, id: i64, attempt: u32) -> Box<ReadJob> {
        let task = NewTask {
            id: task_id.into(),
            agent: "agent-a".into(),
            priority: Priority::Normal,
            deadline: None,
        };
        let action = NewAction {
            task_id: task_id.into(),
            agent: "agent-a".into(),
            provider: "billing-api".into(),
            method: "GET".into(),
            route: RouteTemplate::try_new("/v1/balance").expect("template"),
            request_class: "read".into(),
            payload_digest: PayloadDigest::of(b""),
            target_digest: None,
            idempotency_key: String::new(),
            external_reference: None,
            desired_outcome: Some("show the balance".into()),
            fingerprint: Some("GET /v1/balance".into()),
            request: None,
        };
        let result = AttemptResult {
            action: ActionId(id),
            attempt,
            status: Some(200),
            disposition: Disposition::Success,
            boundary: None,
            source: None,
            provider_operation_id: None,
            signal_headers: vec![("retry-after".into(), "1".into())],
            finish: Some(Finish {
                outcome: Outcome::Succeeded,
                context: serde_json::json!({ "sent": true }),
                response: Some(StoredResponse {
                    status: 200,
                    headers: Vec::new(),
                    body: b"{}".to_vec(),
                }),
            }),
        };
        Box::new(ReadJob {
            id: ActionId(id),
            task,
            action,
            at: t(id * 10),
            steps: vec![
                ReadStep::Sent(t(id * 10 + 1)),
                ReadStep::Result(result, t(id * 10 + 2)),
            ],
            done: Box::new(|_| {}),
        })
    }

    /// Each read's result (errors as text), the audit log and the ids of the actions kept.
    type RunLeft = (Vec<Result<Vec<u32>, String>>, Vec<AuditEvent>, Vec<i64>);

    /// Runs `reads` in one transaction of a new store at `path`, as a run (`together`) or each
    /// in a savepoint of its own; returns each read's result (errors as text), the audit log
    /// and the actions left, after checking the chain in memory continues the one on disk.
    fn run(path: &Path, reads: &[Box<ReadJob>], together: bool) -> RunLeft {
        let conn = schema::open_writer(path, true).expect("open");
        let counters = Counters::default();
        let mut group = Group::new(&conn, Chain::genesis(), &counters.next_action_id);
        control(&conn, "BEGIN IMMEDIATE").expect("begin");
        let mut results = Vec::new();
        if together {
            group.run_reads(reads, &mut results);
        } else {
            for read in reads {
                results.push(group.run_read_alone(read));
            }
        }
        control(&conn, "COMMIT").expect("commit");
        let head = rows::audit_head(&conn).expect("head");
        assert_eq!(
            group.chain,
            Chain::after(head.as_ref()),
            "the chain follows the log"
        );
        assert!(matches!(
            verify_connection(&conn, None).expect("verify"),
            Verdict::Intact { .. }
        ));
        let events = rows::audit_events(&conn, 0, 1000).expect("events");
        let actions = (1..=reads.len() as i64)
            .filter(|&id| rows::action(&conn, ActionId(id)).expect("action").is_some())
            .collect();
        let results = results
            .into_iter()
            .map(|r| r.map_err(|e| e.to_string()))
            .collect();
        (results, events, actions)
    }

    #[test]
    fn a_run_of_reads_leaves_what_each_read_in_its_own_savepoint_leaves() {
        for failing in [&[][..], &[1], &[3], &[5], &[2, 4], &[1, 2, 3, 4, 5]] {
            let reads: Vec<Box<ReadJob>> = (1..=5)
                .map(|id| answered_read(id, failing.contains(&id)))
                .collect();
            let dir = tempfile::tempdir().expect("tempdir");
            let together = run(&dir.path().join("run.db"), &reads, true);
            let alone = run(&dir.path().join("alone.db"), &reads, false);
            assert_eq!(together, alone, "failing reads {failing:?}");
            let (results, events, actions) = together;
            for (id, result) in (1..=5).zip(&results) {
                if failing.contains(&id) {
                    assert!(
                        matches!(result, Err(e) if e.contains("attempt 2")),
                        "read {id}: {result:?}"
                    );
                } else {
                    assert_eq!(result, &Ok(vec![1]), "read {id}");
                }
            }
            let kept: Vec<i64> = (1..=5).filter(|id| !failing.contains(id)).collect();
            assert_eq!(actions, kept, "failing reads {failing:?}");
            let opened = usize::from(!kept.is_empty());
            assert_eq!(events.len(), opened + 4 * kept.len());
        }
    }

    #[test]
    fn the_writer_keeps_draining_while_a_sender_holds_the_held_reads() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(SqliteStore::open(dir.path().join("b.db")).expect("open"));
        let sender = Arc::clone(&store);
        let (handed, handed_rx) = mpsc::channel();
        std::thread::spawn(move || {
            // As `submit_result` does: jobs handed over under the held reads' lock, here more
            // than the channel holds, so this thread waits for room while holding the lock.
            let _held = sender.held_reads();
            for _ in 0..8 * MAX_BATCH {
                sender.enqueue(|_| Ok(()), Box::new(|_: Result<(), StoreError>| {}));
            }
            let _ = handed.send(());
        });
        handed_rx
            .recv_timeout(Duration::from_secs(60))
            .expect("every job was handed over: the writer did not wait for the lock");
        store.flush().expect("flush");
        assert!(store.writer_stats().operations > 8 * MAX_BATCH as u64);
    }

    #[test]
    fn a_task_opened_by_a_read_that_was_undone_is_opened_again_by_the_next() {
        // The second read opens task-2 and fails (its id is taken): the third must open it.
        let reads = vec![
            read_of("task-1", 1, 1),
            read_of("task-2", 1, 1),
            read_of("task-2", 2, 1),
        ];
        let dir = tempfile::tempdir().expect("tempdir");
        for (together, file) in [(true, "run.db"), (false, "alone.db")] {
            let (results, events, actions) = run(&dir.path().join(file), &reads, together);
            assert!(results[0].is_ok() && results[2].is_ok(), "{results:?}");
            assert!(
                matches!(&results[1], Err(e) if e.contains("UNIQUE")),
                "{results:?}"
            );
            assert_eq!(actions, [1, 2]);
            let opened: Vec<Option<&str>> = events
                .iter()
                .filter(|e| e.kind == "task_opened")
                .map(|e| e.task.as_deref())
                .collect();
            assert_eq!(opened, [Some("task-1"), Some("task-2")]);
            assert_eq!(events.len(), 10);
        }
    }

    #[test]
    fn a_read_after_an_operation_that_cancelled_its_task_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let conn = schema::open_writer(&dir.path().join("b.db"), true).expect("open");
        let counters = Counters::default();
        let mut group = Group::new(&conn, Chain::genesis(), &counters.next_action_id);
        control(&conn, "BEGIN IMMEDIATE").expect("begin");
        let mut results = Vec::new();
        group.run_reads(&[read_of("task-1", 1, 1)], &mut results);
        let Job::Op(cancel) = job(
            |tx| tx.cancel_task("agent-a", "task-1", t(5)),
            Box::new(|_| {}),
        ) else {
            panic!("an operation's job");
        };
        let _ = group.run_op(cancel);
        group.run_reads(&[read_of("task-1", 2, 1)], &mut results);
        control(&conn, "COMMIT").expect("commit");
        assert!(results[0].is_ok(), "{results:?}");
        assert!(
            matches!(&results[1], Err(StoreError::InvalidTransition { reason, .. }) if reason.contains("cancelled")),
            "{results:?}"
        );
        assert!(rows::action(&conn, ActionId(2)).expect("read").is_none());
    }
}
