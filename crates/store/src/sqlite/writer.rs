//! The writer thread and what it shares with the store: the jobs it runs, the reads held for
//! their answers, its counters and its lingering over groups of reads (see the `sqlite`
//! module docs, "Durability and group commit").

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex, PoisonError, TryLockError};
use std::time::{Duration, Instant};

use jiff::Timestamp;
use rusqlite::Connection;

use super::feed::{self, Mark, Watched};
use super::ops::{ReadStatements, ReadStep, WriteTx};
use crate::audit::Chain;
use crate::error::StoreError;
use crate::model::{ActionId, NewAction, NewTask};
use crate::store::Completion;

/// Most operations committed in one transaction.
pub const MAX_BATCH: usize = 1024;

/// Longest a read's records are held waiting for its answer before the writer queues them as
/// far as they got (its result is then an operation of its own): measured from the read's own
/// instant to the latest instant a read brought, or as this long without any operation.
pub const HOLD_LIMIT: Duration = Duration::from_secs(1);

/// How long a group holding only reads waits for more operations before it commits (see the
/// module docs, "Groups of reads only"): 5 ms. Changed per store with
/// [`SqliteStore::set_read_linger`](super::SqliteStore::set_read_linger).
pub const READ_LINGER: Duration = Duration::from_millis(5);

/// Longest time a group of reads only is committed without an fsync after the last fsync'd
/// commit: 100 ms. The first group of reads after that is fsync'd, which bounds what a power
/// loss can take (and how much unsynced WAL a checkpoint must flush at once). Changed per store
/// with [`SqliteStore::set_read_sync_interval`](super::SqliteStore::set_read_sync_interval).
pub const READ_SYNC_INTERVAL: Duration = Duration::from_millis(100);

/// How long the writer waits for an operation before it counts an idle tick.
const HOLD_TICK: Duration = Duration::from_millis(100);

/// Idle ticks in a row, while reads are held, after which the writer queues every held read.
const HOLD_IDLE_TICKS: u32 = 10;

/// What the writer calls with the commit's result once the transaction holding an operation
/// ended.
pub(super) type AfterCommit = Box<dyn FnOnce(Result<(), StoreError>) + Send>;
/// An operation run once: in the open transaction (`Some`), or, when the transaction could
/// not begin (`None`), only producing its completion.
pub(super) type OpJob = Box<dyn FnOnce(Option<&mut WriteTx<'_>>) -> (bool, AfterCommit) + Send>;

/// An operation for the writer.
pub(super) enum Job {
    /// Any operation, run once in a savepoint of its own.
    Op(OpJob),
    /// A held read, kept as data so that it can run again: consecutive reads share one
    /// savepoint, and run one by one only when one of them fails (see [`run_reads`]).
    Read(Box<ReadJob>),
}

impl Job {
    /// Answers the job with `e` without running it.
    pub(super) fn fail(self, e: StoreError) {
        match self {
            Job::Op(op) => op(None).1(Err(e)),
            Job::Read(read) => (read.done)(Err(e)),
        }
    }
}

/// A held read's one operation (see [`WriteTx::record_held_read`]) and its completion.
pub(super) struct ReadJob {
    pub(super) id: ActionId,
    pub(super) task: NewTask,
    pub(super) action: NewAction,
    pub(super) at: Timestamp,
    pub(super) steps: Vec<ReadStep>,
    /// Called after the commit with the attempt numbers of the `Sent` steps.
    pub(super) done: Completion<Vec<u32>>,
}

impl ReadJob {
    /// Writes the read in the open transaction; it borrows its inputs, so it can run again
    /// after a rollback.
    pub(super) fn run(
        &self,
        tx: &mut WriteTx<'_>,
        stmts: &mut ReadStatements<'_>,
    ) -> Result<Vec<u32>, StoreError> {
        tx.record_held_read(
            stmts,
            &self.task,
            &self.action,
            self.id,
            self.at,
            &self.steps,
        )
    }

    /// Its completion for `result`, to be called with the commit's result.
    pub(super) fn after(self, result: Result<Vec<u32>, StoreError>) -> AfterCommit {
        let done = self.done;
        Box::new(move |commit: Result<(), StoreError>| done(commit.and(result)))
    }
}

/// The held reads by action id.
pub(super) type HeldReads = Arc<Mutex<HashMap<ActionId, HeldRead>>>;

/// A read handed its id whose operation waits for its answer (see the module docs).
pub(super) struct HeldRead {
    pub(super) task: NewTask,
    pub(super) action: NewAction,
    pub(super) at: Timestamp,
    pub(super) recorded: Completion<()>,
    pub(super) steps: Vec<(ReadStep, StepDone)>,
}

/// The completion of one step of a held read.
pub(super) enum StepDone {
    Sent(Completion<u32>),
    Result(Completion<()>),
}

#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) transactions: AtomicU64,
    /// Transactions of reads only, committed with `synchronous=NORMAL`.
    pub(super) lazy_transactions: AtomicU64,
    pub(super) operations: AtomicU64,
    /// The next free action id: handed out by the writer, or in advance by
    /// [`Store::record_read`] so a read need not wait for the writer.
    pub(super) next_action_id: AtomicI64,
    /// Operations submitted without their caller waiting that have not committed yet; reads
    /// through the [`Store`] wait for them first (read your own writes).
    pub(super) unawaited: AtomicU64,
    /// The latest instant (ms since the epoch) a read's operation brought: how old a held read
    /// is, without reading the clock.
    pub(super) latest_ms: AtomicI64,
    /// Why the writer's last transaction could not begin or commit; `None` once one commits
    /// (see [`Store::write_failure`]).
    pub(super) write_failure: Mutex<Option<String>>,
}

impl Counters {
    /// Keeps what a transaction's begin or commit came to: its error, or none after a commit.
    pub(super) fn note_write(&self, result: &Result<(), StoreError>) {
        *self
            .write_failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner) =
            result.as_ref().err().map(ToString::to_string);
    }
}

/// How long the writer lingers over a group of reads only, and whether it is lingering now
/// (shared between the writer and the callers that wake it).
#[derive(Debug)]
pub(super) struct Linger {
    /// Microseconds; zero: no lingering.
    micros: AtomicU64,
    /// Raised by the writer while it waits for more reads; a caller that queues any other
    /// operation then unparks it.
    pub(super) lingering: AtomicBool,
    /// Microseconds after an fsync'd commit during which groups of reads only are not fsync'd.
    sync_every_micros: AtomicU64,
}

/// The monotonic instant the writer paces its commits by (how long a group of reads has
/// waited, how old the last fsync is). It only spaces out I/O: it is never recorded, and no
/// decision about an action reads it — those instants are passed in by the caller.
#[allow(clippy::disallowed_methods)]
pub(super) fn pacing_now() -> Instant {
    Instant::now()
}

fn micros(span: Duration) -> u64 {
    u64::try_from(span.as_micros()).unwrap_or(u64::MAX)
}

impl Linger {
    pub(super) fn new(span: Duration, sync_every: Duration) -> Self {
        Linger {
            micros: AtomicU64::new(micros(span)),
            lingering: AtomicBool::new(false),
            sync_every_micros: AtomicU64::new(micros(sync_every)),
        }
    }

    pub(super) fn set(&self, span: Duration) {
        self.micros.store(micros(span), Ordering::Relaxed);
    }

    fn span(&self) -> Duration {
        Duration::from_micros(self.micros.load(Ordering::Relaxed))
    }

    pub(super) fn set_sync_every(&self, span: Duration) {
        self.sync_every_micros
            .store(micros(span), Ordering::Relaxed);
    }

    /// Whether a group of reads only, taken `since_sync` after the last fsync'd commit, is
    /// fsync'd too.
    fn due_for_sync(&self, since_sync: Duration) -> bool {
        micros(since_sync) >= self.sync_every_micros.load(Ordering::Relaxed)
    }

    /// Adds to `batch`, which holds only reads, what arrives until the linger has passed, the
    /// batch holds [`MAX_BATCH`] jobs, an operation that is not a read arrives (its caller
    /// unparks this thread, see [`SqliteStore::send`]) or the channel closes. Returns whether
    /// the batch still holds only reads.
    fn wait_for_more(&self, rx: &Receiver<Job>, batch: &mut Vec<Job>) -> bool {
        let span = self.span();
        if span.is_zero() {
            return true;
        }
        let until = pacing_now().checked_add(span);
        self.lingering.store(true, Ordering::SeqCst);
        let mut only_reads = true;
        loop {
            // Raised before this drain: what was sent before a caller could see the flag is
            // found here.
            let taken = batch.len();
            let open = take_queued(rx, batch);
            only_reads &= batch[taken..].iter().all(|job| matches!(job, Job::Read(_)));
            if !open || !only_reads || batch.len() >= MAX_BATCH {
                break;
            }
            let now = pacing_now();
            match until {
                Some(until) if now < until => std::thread::park_timeout(until - now),
                Some(_) => break,
                // A linger too long for the clock: wait until woken.
                None => std::thread::park(),
            }
        }
        self.lingering.store(false, Ordering::SeqCst);
        only_reads
    }
}

/// The writer's job for `op`: run it in the open transaction, then call `done` with its
/// result once the transaction ended.
pub(super) fn job<T, F>(op: F, done: Completion<T>) -> Job
where
    T: Send + 'static,
    F: FnOnce(&mut WriteTx<'_>) -> Result<T, StoreError> + Send + 'static,
{
    Job::Op(Box::new(move |tx: Option<&mut WriteTx<'_>>| {
        let result = match tx {
            Some(tx) => op(tx),
            // Replaced by the commit error the completion receives.
            None => Err(StoreError::WriterGone),
        };
        let ok = result.is_ok();
        let after: AfterCommit = Box::new(move |commit: Result<(), StoreError>| {
            done(match (result, commit) {
                (_, Err(e)) => Err(e),
                (Err(e), Ok(())) => Err(e),
                (Ok(v), Ok(())) => Ok(v),
            })
        });
        (ok, after)
    }))
}

/// `done` for an operation nobody waits for: counted in `unawaited` until its commit, so that
/// reads through the store wait for it.
pub(super) fn unawaited<T: Send + 'static>(
    counters: &Arc<Counters>,
    done: Completion<T>,
) -> Completion<T> {
    counters.unawaited.fetch_add(1, Ordering::AcqRel);
    let counters = Arc::clone(counters);
    Box::new(move |result| {
        counters.unawaited.fetch_sub(1, Ordering::AcqRel);
        done(result);
    })
}

/// A held read as one writer job; its completions are called after the commit, in the order
/// of its steps (each with the error, when the operation was undone).
pub(super) fn read_job(id: ActionId, read: HeldRead, counters: &Arc<Counters>) -> Job {
    let HeldRead {
        task,
        action,
        at,
        recorded,
        steps,
        ..
    } = read;
    let (steps, dones): (Vec<ReadStep>, Vec<StepDone>) = steps.into_iter().unzip();
    let done: Completion<Vec<u32>> = Box::new(move |result| match result {
        Ok(sent) => {
            recorded(Ok(()));
            let mut sent = sent.into_iter();
            for done in dones {
                match done {
                    StepDone::Sent(done) => done(sent.next().ok_or(StoreError::WriterGone)),
                    StepDone::Result(done) => done(Ok(())),
                }
            }
        }
        Err(e) => {
            recorded(Err(e.clone()));
            for done in dones {
                match done {
                    StepDone::Sent(done) => done(Err(e.clone())),
                    StepDone::Result(done) => done(Err(e.clone())),
                }
            }
        }
    });
    Job::Read(Box::new(ReadJob {
        id,
        task,
        action,
        at,
        steps,
        done: unawaited(counters, done),
    }))
}

/// Moves into `batch`, oldest first, the reads held [`HOLD_LIMIT`] by the latest instant a read
/// brought, or every held read when `all` (the writer was idle for that long). Returns whether
/// any read was held, or `None` when the held reads were busy and nothing was looked at.
///
/// Never waits for the held reads' lock: its holder may be waiting for room in the full job
/// channel (jobs are queued under the lock, so a step cannot overtake its read), and only this
/// thread makes room. The overdue reads are then taken at the next round.
fn take_overdue(
    held: &HeldReads,
    counters: &Arc<Counters>,
    batch: &mut Vec<Job>,
    all: bool,
) -> Option<bool> {
    let mut held = match held.try_lock() {
        Ok(held) => held,
        Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
        Err(TryLockError::WouldBlock) => return None,
    };
    if held.is_empty() {
        return Some(false);
    }
    let limit_ms = i64::try_from(HOLD_LIMIT.as_millis()).unwrap_or(i64::MAX);
    let latest = counters.latest_ms.load(Ordering::Relaxed);
    let mut overdue: Vec<ActionId> = held
        .iter()
        .filter(|(_, read)| all || latest.saturating_sub(read.at.as_millisecond()) >= limit_ms)
        .map(|(id, _)| *id)
        .collect();
    overdue.sort();
    for id in overdue {
        if let Some(read) = held.remove(&id) {
            batch.push(read_job(id, read, counters));
        }
    }
    Some(true)
}

/// Moves the jobs already queued into `batch`, until it holds [`MAX_BATCH`]. Returns `false`
/// when the channel is closed and empty: nothing more will come.
fn take_queued(rx: &Receiver<Job>, batch: &mut Vec<Job>) -> bool {
    while batch.len() < MAX_BATCH {
        match rx.try_recv() {
            Ok(job) => batch.push(job),
            Err(TryRecvError::Empty) => return true,
            Err(TryRecvError::Disconnected) => return false,
        }
    }
    true
}

/// Switches the writer connection between `synchronous=FULL` (every commit fsync'd before it
/// returns) and `NORMAL` (WAL: no fsync at commit; the frames become durable with the next
/// fsync, a later FULL commit's or a checkpoint's), only when `full` differs from `current`.
/// SQLite refuses the switch inside a transaction, so it runs before `BEGIN`.
///
/// # Errors
/// The statement's error; `current` then still tells the connection's setting.
fn set_synchronous(conn: &Connection, current: &mut bool, full: bool) -> Result<(), StoreError> {
    if *current != full {
        let sql = if full {
            "PRAGMA synchronous = FULL"
        } else {
            "PRAGMA synchronous = NORMAL"
        };
        control(conn, sql)?;
        *current = full;
    }
    Ok(())
}

/// Runs one transaction-control statement through the statement cache, so the writer does not
/// parse `BEGIN`, `SAVEPOINT`, `RELEASE` and `COMMIT` again for every operation.
pub(super) fn control(conn: &Connection, sql: &str) -> Result<(), StoreError> {
    conn.prepare_cached(sql)?.execute([])?;
    Ok(())
}

/// What the writer's operations run against: its connection, the reads' prepared statements,
/// the chain it appends to, what the open transaction noted for the watch feed, and the next
/// free action id.
pub(super) struct Group<'c> {
    conn: &'c Connection,
    stmts: ReadStatements<'c>,
    pub(super) chain: Chain,
    watched: Watched,
    next_action_id: &'c AtomicI64,
}

impl<'c> Group<'c> {
    pub(super) fn new(conn: &'c Connection, chain: Chain, next_action_id: &'c AtomicI64) -> Self {
        Group {
            conn,
            stmts: ReadStatements::new(conn),
            chain,
            watched: Watched::default(),
            next_action_id,
        }
    }

    /// The open transaction as operations write to it, and the reads' statements beside it.
    fn tx(&mut self) -> (WriteTx<'_>, &mut ReadStatements<'c>) {
        (
            WriteTx {
                conn: self.conn,
                chain: &mut self.chain,
                next_action_id: self.next_action_id,
                watched: &mut self.watched,
            },
            &mut self.stmts,
        )
    }

    /// Opens the savepoint an operation runs in; returns the chain and the feed's notes as they
    /// were, to put back when the operation is undone.
    fn savepoint(&self) -> Result<(Chain, Mark), StoreError> {
        control(self.conn, "SAVEPOINT op")?;
        Ok((self.chain.clone(), self.watched.mark()))
    }

    /// Ends the savepoint opened by [`Group::savepoint`]: keeps what ran in it when `ok`, else
    /// (or when it cannot be released) undoes it and puts chain and notes back to `before`.
    ///
    /// # Errors
    /// The savepoint could not be released (what ran in it is undone).
    fn end_savepoint(&mut self, before: (Chain, Mark), ok: bool) -> Result<(), StoreError> {
        let released = if ok {
            control(self.conn, "RELEASE op")
        } else {
            Ok(())
        };
        if !ok || released.is_err() {
            let _ = control(self.conn, "ROLLBACK TO op");
            let _ = control(self.conn, "RELEASE op");
            self.chain = before.0;
            self.watched.undo(before.1);
        }
        released
    }

    /// Runs one operation in a savepoint of its own; returns its completion. The reads' open
    /// tasks are forgotten (the operation may have cancelled one).
    pub(super) fn run_op(&mut self, op: OpJob) -> AfterCommit {
        self.stmts.forget_tasks();
        let before = match self.savepoint() {
            Ok(before) => before,
            Err(e) => {
                // Without a savepoint the operation could not be undone alone: do not run it.
                let (_, done) = op(None);
                return Box::new(move |_| done(Err(e)));
            }
        };
        let (ok, done) = op(Some(&mut self.tx().0));
        match self.end_savepoint(before, ok) {
            Ok(()) => done,
            Err(e) => Box::new(move |_| done(Err(e))),
        }
    }

    /// Runs consecutive held reads and appends each one's result to `results`, in order, with
    /// the outcome of running each in a savepoint of its own — but under one savepoint for all
    /// while none fails, so that SQLite copies each page they touch into its savepoint journal
    /// once, not once per read. When one fails (or the savepoint cannot be released), all of
    /// them are undone and the chain put back; the reads before the failing one run again
    /// together, the failing one alone (it gets its error, nothing of it is kept), and the rest
    /// as a run of their own.
    pub(super) fn run_reads(
        &mut self,
        reads: &[Box<ReadJob>],
        results: &mut Vec<Result<Vec<u32>, StoreError>>,
    ) {
        let mut rest = reads;
        while let Some((first, after_first)) = rest.split_first() {
            if after_first.is_empty() {
                results.push(self.run_read_alone(first));
                return;
            }
            let Ok(before) = self.savepoint() else {
                // Each alone then, each answered with its own savepoint's error if that fails.
                for read in rest {
                    results.push(self.run_read_alone(read));
                }
                return;
            };
            let start = results.len();
            let mut failed = None;
            let (mut tx, stmts) = self.tx();
            for (i, read) in rest.iter().enumerate() {
                match read.run(&mut tx, stmts) {
                    Ok(sent) => results.push(Ok(sent)),
                    Err(_) => {
                        failed = Some(i);
                        break;
                    }
                }
            }
            let released = self.end_savepoint(before, failed.is_none());
            if failed.is_none() && released.is_ok() {
                return;
            }
            // Undone, with any task a read opened.
            self.stmts.forget_tasks();
            // Undone: run again as if each had had its own savepoint.
            results.truncate(start);
            let Some(k) = failed else {
                for read in rest {
                    results.push(self.run_read_alone(read));
                }
                return;
            };
            self.run_reads(&rest[..k], results);
            results.push(self.run_read_alone(&rest[k]));
            rest = &rest[k + 1..];
        }
    }

    /// Runs one held read in a savepoint of its own.
    pub(super) fn run_read_alone(&mut self, read: &ReadJob) -> Result<Vec<u32>, StoreError> {
        let before = self.savepoint()?;
        let result = {
            let (mut tx, stmts) = self.tx();
            read.run(&mut tx, stmts)
        };
        let result = self.end_savepoint(before, result.is_ok()).and(result);
        if result.is_err() {
            // Undone, with any task it opened.
            self.stmts.forget_tasks();
        }
        result
    }
}

/// The writer thread: takes the queued jobs in groups and commits each group as one
/// transaction, answering its jobs only after its `COMMIT` returned.
pub(super) fn writer_loop(
    conn: Connection,
    chain: Chain,
    rx: Receiver<Job>,
    counters: &Arc<Counters>,
    held: &HeldReads,
    feed: &Mutex<feed::WatchFeed>,
    linger: &Linger,
) {
    // Room for every statement the operations and these control statements use.
    conn.set_prepared_statement_cache_capacity(64);
    let mut writer = Writer {
        group: Group::new(&conn, chain, &counters.next_action_id),
        rx,
        counters,
        held,
        feed,
        linger,
        synchronous_full: true,
        last_sync: pacing_now(),
        idle_ticks: 0,
        batch: Vec::with_capacity(MAX_BATCH),
        completions: Vec::with_capacity(MAX_BATCH),
        reads: Vec::with_capacity(MAX_BATCH),
        results: Vec::with_capacity(MAX_BATCH),
    };
    while writer.gather() {
        if !writer.batch.is_empty() {
            writer.commit_batch();
        }
    }
}

/// The writer thread's state between groups.
struct Writer<'c> {
    group: Group<'c>,
    rx: Receiver<Job>,
    counters: &'c Arc<Counters>,
    held: &'c HeldReads,
    feed: &'c Mutex<feed::WatchFeed>,
    linger: &'c Linger,
    /// Whether the connection runs with `synchronous=FULL` (as opened) or NORMAL.
    synchronous_full: bool,
    /// When the last fsync'd commit returned (the migrations' commits count as one).
    last_sync: Instant,
    /// Rounds without a job, counted only while a read is held, from the first that sees one.
    idle_ticks: u32,
    /// The jobs of the next group.
    batch: Vec<Job>,
    /// The open group's completions, called once it committed or failed.
    completions: Vec<AfterCommit>,
    /// A run of consecutive reads of the open group, and their results.
    #[allow(clippy::vec_box)] // each read arrives boxed in its job and is moved, never copied
    reads: Vec<Box<ReadJob>>,
    results: Vec<Result<Vec<u32>, StoreError>>,
}

impl Writer<'_> {
    /// Moves into the batch the next job (waiting at most [`HOLD_TICK`]), every job queued
    /// behind it and the reads held too long. Returns `false` when the channel is closed and
    /// empty: nothing more will come.
    fn gather(&mut self) -> bool {
        // Wake at least every HOLD_TICK to queue reads held too long.
        match self.rx.recv_timeout(HOLD_TICK) {
            Ok(job) => {
                self.idle_ticks = 0;
                self.batch.push(job);
            }
            Err(RecvTimeoutError::Timeout) => self.idle_ticks = self.idle_ticks.saturating_add(1),
            Err(RecvTimeoutError::Disconnected) => return false,
        }
        // A closed channel is seen by the next `recv_timeout`, after this batch committed.
        take_queued(&self.rx, &mut self.batch);
        // After what was queued: nothing queued so far concerns a read still held.
        // Idle ticks count only while a read is held, from the first tick that sees one.
        let all = self.idle_ticks >= HOLD_IDLE_TICKS;
        match take_overdue(self.held, self.counters, &mut self.batch, all) {
            Some(false) => self.idle_ticks = 0,
            Some(true) if all => self.idle_ticks = 0,
            // Still held, or not looked at (busy: someone is queuing).
            Some(true) | None => {}
        }
        true
    }

    /// Runs the batch as one transaction and commits it; then calls every job's completion
    /// with the commit's result.
    fn commit_batch(&mut self) {
        let full = self.linger_for_reads();
        if let Err(e) = set_synchronous(self.group.conn, &mut self.synchronous_full, full) {
            self.fail_batch(e);
            return;
        }
        let before = self.group.chain.clone();
        // A group before may have been rolled back, with tasks its reads opened.
        self.group.stmts.forget_tasks();
        if let Err(e) = control(self.group.conn, "BEGIN IMMEDIATE") {
            self.fail_batch(e);
            return;
        }
        self.run_batch();
        let committed = control(self.group.conn, "COMMIT");
        self.counters.note_write(&committed);
        if committed.is_err() {
            let _ = control(self.group.conn, "ROLLBACK");
            self.group.chain = before;
            self.group.watched.clear();
        } else {
            self.note_commit();
        }
        for done in self.completions.drain(..) {
            done(committed.clone());
        }
    }

    /// Reads only: nobody waits for this commit, so let more reads join it, and do not wait
    /// for the disk (a later fsync'd commit makes these frames durable too). Returns whether
    /// the group's commit is to be fsync'd (`synchronous=FULL`).
    fn linger_for_reads(&mut self) -> bool {
        let mut only_reads = self.batch.iter().all(|job| matches!(job, Job::Read(_)));
        if only_reads && self.batch.len() < MAX_BATCH {
            only_reads = self.linger.wait_for_more(&self.rx, &mut self.batch);
        }
        !only_reads || self.linger.due_for_sync(self.last_sync.elapsed())
    }

    /// Answers every job of the batch with `e`, the error that kept its group from beginning.
    fn fail_batch(&mut self, e: StoreError) {
        self.counters.note_write(&Err(e.clone()));
        for job in self.batch.drain(..) {
            job.fail(e.clone());
        }
    }

    /// Runs the batch's jobs in the open transaction, in order: each operation in a savepoint
    /// of its own, each run of consecutive reads together ([`Group::run_reads`]).
    fn run_batch(&mut self) {
        let mut jobs = self.batch.drain(..).peekable();
        while let Some(job) = jobs.next() {
            let read = match job {
                Job::Op(op) => {
                    self.completions.push(self.group.run_op(op));
                    continue;
                }
                Job::Read(read) => read,
            };
            // A run of consecutive reads.
            self.reads.push(read);
            while let Some(Job::Read(read)) = jobs.next_if(|j| matches!(j, Job::Read(_))) {
                self.reads.push(read);
            }
            self.group.run_reads(&self.reads, &mut self.results);
            for (read, result) in self.reads.drain(..).zip(self.results.drain(..)) {
                self.completions.push(read.after(result));
            }
        }
    }

    /// After a commit: hands what it sealed to the watch feed and counts it.
    fn note_commit(&mut self) {
        self.feed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .committed(&mut self.group.watched, self.group.chain.last_seq());
        let counters = &self.counters;
        counters.transactions.fetch_add(1, Ordering::Relaxed);
        if self.synchronous_full {
            self.last_sync = pacing_now();
        } else {
            counters.lazy_transactions.fetch_add(1, Ordering::Relaxed);
        }
        counters
            .operations
            .fetch_add(self.completions.len() as u64, Ordering::Relaxed);
    }
}
