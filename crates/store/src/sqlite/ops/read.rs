//! Reads: a held read's bookkeeping as one operation, and an answered read written in its final
//! form at once with statements kept for the writer's connection.

use std::collections::{HashMap, HashSet};

use jiff::Timestamp;
use rusqlite::{params, Connection, Statement};

use super::{
    boundary_text, check_names_task, finish_columns, finish_event_kind, signal_headers_json,
    FinishColumns, WriteTx,
};
use crate::audit::{format_instant, format_instant_into, AuditEvent, EventKind};
use crate::error::StoreError;
use crate::model::{ActionId, AttemptResult, NewAction, NewTask, Outcome, PayloadDigest};
use crate::sqlite::feed::{throttled, Heartbeat};
use crate::sqlite::rows::{self, ms};

/// What happened to a read after it was recorded, in order (see [`WriteTx::record_held_read`]).
#[allow(clippy::large_enum_variant)] // a held read has two steps, each moved once
pub(crate) enum ReadStep {
    /// An attempt was sent at this instant.
    Sent(Timestamp),
    /// An attempt's result arrived at this instant.
    Result(AttemptResult, Timestamp),
}

/// The statements every answered read runs, prepared on first use and kept for the writer's
/// connection, so that a read does not look each one up in the connection's statement cache
/// (hashing its text, moving it out and back in) every time. Made for the connection the
/// reads' transactions run on.
///
/// It also remembers the tasks answered reads found open (present and not cancelled), so the
/// next read of the same task need not look it up. That holds only while nothing else can
/// change a task: the writer calls [`ReadStatements::forget_tasks`] when a transaction begins,
/// after every other operation and whenever a savepoint is undone.
pub(crate) struct ReadStatements<'c> {
    conn: &'c Connection,
    task: Option<Statement<'c>>,
    action: Option<Statement<'c>>,
    attempt: Option<Statement<'c>>,
    event: Option<Statement<'c>>,
    /// Open tasks: agent → task ids.
    open_tasks: HashMap<String, HashSet<String>>,
}

/// The action row of an answered read, in its final form.
const INSERT_ANSWERED_ACTION: &str = "INSERT INTO actions (task_id, agent, provider, method, \
     route, request_class, payload_digest, idempotency_key, external_reference, \
     provider_operation_id, state, outcome, outcome_context, response_status, response_headers, \
     response_body, created_at_ms, updated_at_ms, id, desired_outcome, fingerprint, \
     target_digest) \
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, 'finished', ?11, ?12, ?13, ?14, ?15, ?16, \
     ?17, ?18, ?19, ?20, ?21)";

/// The one attempt row of an answered read.
const INSERT_ANSWERED_ATTEMPT: &str = "INSERT INTO attempts (action_id, n, state, status, \
     disposition, started_at_ms, finished_at_ms, boundary, signal_headers) \
     VALUES (?1, 1, 'finished', ?2, ?3, ?4, ?5, ?6, ?7)";

impl<'c> ReadStatements<'c> {
    /// None prepared yet, for `conn`.
    pub(crate) fn new(conn: &'c Connection) -> Self {
        ReadStatements {
            conn,
            task: None,
            action: None,
            attempt: None,
            event: None,
            open_tasks: HashMap::new(),
        }
    }

    /// Forgets the tasks found open (see the type's docs).
    pub(crate) fn forget_tasks(&mut self) {
        self.open_tasks.clear();
    }

    fn knows_open(&self, task: &NewTask) -> bool {
        self.open_tasks
            .get(&task.agent)
            .is_some_and(|ids| ids.contains(&task.id))
    }

    fn note_open(&mut self, task: &NewTask) {
        self.open_tasks
            .entry(task.agent.clone())
            .or_default()
            .insert(task.id.clone());
    }

    /// [`rows::TASK`].
    fn task(&mut self) -> Result<&mut Statement<'c>, StoreError> {
        prepared(&mut self.task, self.conn, rows::TASK)
    }

    /// [`INSERT_ANSWERED_ACTION`].
    fn action(&mut self) -> Result<&mut Statement<'c>, StoreError> {
        prepared(&mut self.action, self.conn, INSERT_ANSWERED_ACTION)
    }

    /// [`INSERT_ANSWERED_ATTEMPT`].
    fn attempt(&mut self) -> Result<&mut Statement<'c>, StoreError> {
        prepared(&mut self.attempt, self.conn, INSERT_ANSWERED_ATTEMPT)
    }

    /// [`rows::INSERT_EVENT`].
    fn event(&mut self) -> Result<&mut Statement<'c>, StoreError> {
        prepared(&mut self.event, self.conn, &rows::INSERT_EVENT)
    }
}

/// The statement in `slot`, prepared from `sql` first if it is empty.
fn prepared<'s, 'c>(
    slot: &'s mut Option<Statement<'c>>,
    conn: &'c Connection,
    sql: &str,
) -> Result<&'s mut Statement<'c>, StoreError> {
    let stmt = match slot.take() {
        Some(stmt) => stmt,
        None => conn.prepare(sql)?,
    };
    Ok(slot.insert(stmt))
}

/// The instants of an answered read: recorded, its attempt sent, its answer received.
#[derive(Clone, Copy)]
struct ReadTimes {
    at: Timestamp,
    sent_at: Timestamp,
    done_at: Timestamp,
}

impl WriteTx<'_> {
    /// A read's whole bookkeeping as ONE operation: the task (if new) and the action under the
    /// id handed out in advance, then each step in order, exactly as the separate operations
    /// would write them (same rows, same events, same order of events). Returns the attempt
    /// numbers of the `Sent` steps, in order. Borrows its inputs, so the writer can run it
    /// again after undoing it.
    pub(crate) fn record_held_read(
        &mut self,
        stmts: &mut ReadStatements<'_>,
        task: &NewTask,
        new: &NewAction,
        id: ActionId,
        at: Timestamp,
        steps: &[ReadStep],
    ) -> Result<Vec<u32>, StoreError> {
        // The common read: sent once, then its final answer.
        if let [ReadStep::Sent(sent_at), ReadStep::Result(result, done_at)] = steps {
            if result.action == id && result.attempt == 1 && result.finish.is_some() {
                let times = ReadTimes {
                    at,
                    sent_at: *sent_at,
                    done_at: *done_at,
                };
                self.record_answered_read(stmts, task, new, id, times, result)?;
                return Ok(vec![1]);
            }
        }
        self.open_and_record(task.clone(), new.clone(), Some(id), at)?;
        let mut sent = Vec::with_capacity(1);
        for step in steps {
            match step {
                ReadStep::Sent(at) => sent.push(self.mark_attempt_sent(id, *at)?),
                ReadStep::Result(result, at) => self.record_result(result.clone(), *at)?,
            }
        }
        Ok(sent)
    }

    /// A read sent once and answered with its final result, written in its final form at once:
    /// the same rows and the same events, in the same order, as `open_and_record`,
    /// `mark_attempt_sent` and `record_result` write them one after another (the store's tests
    /// compare the two), with half the statements — no state written only to be overwritten,
    /// nothing re-read that this operation just wrote. `result.finish` must be set.
    fn record_answered_read(
        &mut self,
        stmts: &mut ReadStatements<'_>,
        task: &NewTask,
        new: &NewAction,
        id: ActionId,
        ReadTimes {
            at,
            sent_at,
            done_at,
        }: ReadTimes,
        result: &AttemptResult,
    ) -> Result<(), StoreError> {
        check_names_task(task, new)?;
        if !stmts.knows_open(task) {
            match rows::task_with(stmts.task()?, &task.agent, &task.id)? {
                Some(existing) if existing.cancelled_at.is_some() => {
                    return Err(StoreError::InvalidTransition {
                        what: format!("task {:?}", existing.id),
                        reason: "cancelled; it takes no new actions".into(),
                    })
                }
                Some(_) => {}
                None => self.open_task(task.clone(), at)?,
            }
            stmts.note_open(task);
        }
        let Some(finish) = &result.finish else {
            return Err(StoreError::Invalid {
                field: "finish",
                reason: "an answered read ends with its result".into(),
            });
        };
        let FinishColumns {
            context,
            status,
            headers,
            body,
        } = finish_columns(finish)?;
        // A read carries no key (empty): nothing stored or audited for it.
        let key = (!new.idempotency_key.is_empty()).then_some(new.idempotency_key.as_str());
        stmts.action()?.execute(params![
            new.task_id,
            new.agent,
            new.provider,
            new.method,
            new.route.as_str(),
            new.request_class,
            new.payload_digest.as_str(),
            key,
            new.external_reference,
            result.provider_operation_id,
            finish.outcome.as_str(),
            context,
            status,
            headers,
            body,
            ms(at),
            ms(done_at),
            id.0,
            new.desired_outcome,
            new.fingerprint,
            new.target_digest.as_ref().map(PayloadDigest::as_str),
        ])?;
        let boundary = boundary_text(result.boundary);
        let signal_headers = signal_headers_json(&result.signal_headers)?;
        stmts.attempt()?.execute(params![
            id.0,
            result.status,
            result.disposition.as_str(),
            ms(sent_at),
            ms(done_at),
            boundary,
            signal_headers
        ])?;
        // A plain success (not throttled, finished `succeeded`) leaves the watch feed only its
        // send, noted without a copy; any other read leaves every event.
        let plain = !throttled(result.disposition.as_str()) && finish.outcome == Outcome::Succeeded;
        // The events exactly as record_action_as, mark_attempt_sent and record_result (with
        // finish_action) build them. One event is refilled for each of them, so what they share
        // (task, action, provider, route, method) is copied once and their strings' room is
        // reused.
        let mut e = AuditEvent::new(EventKind::ActionRequested.as_str(), &format_instant(at));
        e.task = Some(new.task_id.clone());
        e.agent = Some(new.agent.clone());
        e.action = Some(id.0);
        e.provider = Some(new.provider.clone());
        e.route = Some(new.route.as_str().to_owned());
        e.method = Some(new.method.clone());
        e.request_class = Some(new.request_class.clone());
        e.idempotency_key = key.map(str::to_owned);
        e.payload_digest = Some(new.payload_digest.as_str().to_owned());
        self.append_with(stmts.event()?, &mut e)?;
        self.watch_unless(plain, &e);
        // action_sent: its own instant and attempt, no payload digest.
        refill(&mut e.kind, EventKind::ActionSent.as_str());
        format_instant_into(sent_at, &mut e.at);
        e.attempt = Some(1);
        e.payload_digest = None;
        self.append_with(stmts.event()?, &mut e)?;
        if plain {
            self.watched.heartbeat(Heartbeat {
                seq: e.seq,
                action: id.0,
                attempt: 1,
                at: sent_at,
            });
        } else {
            self.watched.event(e.clone());
        }
        // action_result: its instant, status and signal; no request class or key.
        refill(&mut e.kind, EventKind::ActionResult.as_str());
        format_instant_into(done_at, &mut e.at);
        e.request_class = None;
        e.idempotency_key = None;
        e.status = result.status;
        e.disposition = Some(result.disposition.as_str().to_owned());
        e.boundary = boundary;
        e.source = result.source.clone();
        e.signal_headers =
            (!result.signal_headers.is_empty()).then(|| result.signal_headers.clone());
        self.append_with(stmts.event()?, &mut e)?;
        self.watch_unless(plain, &e);
        // The finish, at the same instant: its outcome, nothing of the attempt.
        refill(&mut e.kind, finish_event_kind(finish.outcome).as_str());
        e.attempt = None;
        e.status = None;
        e.disposition = None;
        e.boundary = None;
        e.source = None;
        e.signal_headers = None;
        e.outcome = Some(finish.outcome.as_str().to_owned());
        self.append_with(stmts.event()?, &mut e)?;
        self.watch_unless(plain, &e);
        Ok(())
    }

    /// Notes a copy of `event` for the watch feed, unless it belongs to a plain read.
    fn watch_unless(&mut self, plain: bool, event: &AuditEvent) {
        if !plain {
            self.watched.event(event.clone());
        }
    }
}

/// Replaces the text in `s` with `text`, in the room `s` has.
fn refill(s: &mut String, text: &str) {
    s.clear();
    s.push_str(text);
}
