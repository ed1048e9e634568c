//! The write operations, each run inside the writer's transaction (one savepoint per
//! operation, many operations per group commit).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicI64, Ordering};

use jiff::Timestamp;
use rusqlite::{params, Connection, OptionalExtension, Statement};

use super::feed::{throttled, Heartbeat, Watched};
use super::rows::{self, ms};
use crate::audit::{format_instant, format_instant_into, AuditEvent, Chain, EventKind};
use crate::error::{BoundRequest, StoreError};
use crate::model::{
    unsettled_attempt, ActionId, ActionState, Admission, AttemptResult, Boundary, CancelReport,
    DueRetry, EscalationId, EscalationRecord, Finish, JobId, KeptRequest, NewAction, NewTask,
    Outcome, PayloadDigest, RouteTemplate, ScopeRecord, ScopeUpdate, UnsettledWrite,
};
use crate::store::{
    ACCESS_DECISION, ACTION_REOPENED, REOPENED_BY_RESEND, RESUMED_AFTER_RESTART, STATUS_QUERY,
};

/// What happened to a read after it was recorded, in order (see [`WriteTx::record_held_read`]).
#[allow(clippy::large_enum_variant)] // a held read has two steps, each moved once
pub(crate) enum ReadStep {
    /// An attempt was sent at this instant.
    Sent(Timestamp),
    /// An attempt's result arrived at this instant.
    Result(AttemptResult, Timestamp),
}

/// The writer's connection inside an open transaction, plus the chain it appends to.
pub(crate) struct WriteTx<'a> {
    pub(crate) conn: &'a Connection,
    pub(crate) chain: &'a mut Chain,
    /// The next free action id (shared with callers that record reads without waiting, so an
    /// id handed out before its operation ran is never taken by another action).
    pub(crate) next_action_id: &'a AtomicI64,
    /// What this transaction sealed so far, for the watch feed; the writer undoes what an undone
    /// operation noted and hands the rest to the feed at commit.
    pub(crate) watched: &'a mut Watched,
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

/// The descriptive fields of an action copied into its events.
struct ActionFacts {
    task: String,
    agent: String,
    provider: String,
    method: String,
    route: String,
    request_class: String,
    idempotency_key: Option<String>,
    state: ActionState,
    outcome: Option<Outcome>,
    cancelled: bool,
}

/// Checks that `action` belongs to `task`, the task opened with it (same agent, same id).
pub(crate) fn check_names_task(task: &NewTask, action: &NewAction) -> Result<(), StoreError> {
    if task.agent != action.agent || task.id != action.task_id {
        return Err(StoreError::Invalid {
            field: "task_id",
            reason: format!(
                "the action names task {:?} of agent {:?}, not the task {:?} of agent {:?} \
                 being opened",
                action.task_id, action.agent, task.id, task.agent
            ),
        });
    }
    Ok(())
}

/// Checks that each `(field, value)` holds more than whitespace; the first that does not is
/// [`StoreError::Invalid`] naming that field.
fn require_text(fields: &[(&'static str, &str)]) -> Result<(), StoreError> {
    match fields.iter().find(|(_, value)| value.trim().is_empty()) {
        Some(&(field, _)) => Err(StoreError::Invalid {
            field,
            reason: "must not be empty".into(),
        }),
        None => Ok(()),
    }
}

impl WriteTx<'_> {
    /// The stored escalation `id`; [`StoreError::NotFound`] when there is none.
    fn stored_escalation(&self, id: EscalationId) -> Result<EscalationRecord, StoreError> {
        rows::escalation(self.conn, id)?.ok_or_else(|| StoreError::NotFound {
            what: format!("escalation {}", id.0),
        })
    }

    /// The stored escalation `id` while it awaits a decision; [`StoreError::InvalidTransition`]
    /// once decided.
    fn undecided_escalation(&self, id: EscalationId) -> Result<EscalationRecord, StoreError> {
        let record = self.stored_escalation(id)?;
        if record.decision.is_some() {
            return Err(StoreError::InvalidTransition {
                what: format!("escalation {}", id.0),
                reason: "already decided".into(),
            });
        }
        Ok(record)
    }

    fn append(&mut self, mut event: AuditEvent) -> Result<(), StoreError> {
        let conn = self.conn;
        self.append_with(&mut *conn.prepare_cached(&rows::INSERT_EVENT)?, &mut event)?;
        self.watched.event(event);
        Ok(())
    }

    /// Seals `event` onto the chain and inserts it with `insert` (a statement of
    /// [`rows::INSERT_EVENT`]). Every event goes through here.
    fn append_with(
        &mut self,
        insert: &mut Statement<'_>,
        event: &mut AuditEvent,
    ) -> Result<(), StoreError> {
        let digests = self.chain.seal_digests(event);
        rows::insert_event(insert, event, &digests)
    }

    fn facts(&self, action: ActionId) -> Result<ActionFacts, StoreError> {
        let row = self
            .conn
            .prepare_cached(
                "SELECT a.task_id, a.provider, a.method, a.route, a.request_class, \
                 a.idempotency_key, a.state, a.outcome, t.cancelled_at_ms IS NOT NULL, a.agent \
                 FROM actions a JOIN tasks t ON t.agent = a.agent AND t.id = a.task_id WHERE a.id = ?1",
            )?
            .query_row(params![action.0], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                    r.get::<_, String>(3)?,
                    r.get::<_, String>(4)?,
                    r.get::<_, Option<String>>(5)?,
                    r.get::<_, String>(6)?,
                    r.get::<_, Option<String>>(7)?,
                    r.get::<_, bool>(8)?,
                    r.get::<_, String>(9)?,
                ))
            })
            .optional()?;
        let Some((
            task,
            provider,
            method,
            route,
            request_class,
            idempotency_key,
            state,
            outcome,
            cancelled,
            agent,
        )) = row
        else {
            return Err(StoreError::NotFound {
                what: format!("action {action}"),
            });
        };
        let corrupt = |e: StoreError| StoreError::Corrupt {
            table: "actions",
            reason: format!("action {action}: {e}"),
        };
        Ok(ActionFacts {
            task,
            agent,
            provider,
            method,
            route,
            request_class,
            idempotency_key,
            state: ActionState::parse(&state).map_err(corrupt)?,
            outcome: outcome
                .as_deref()
                .map(Outcome::parse)
                .transpose()
                .map_err(corrupt)?,
            cancelled,
        })
    }

    fn action_event(kind: EventKind, at: &str, action: ActionId, f: &ActionFacts) -> AuditEvent {
        let mut e = AuditEvent::new(kind.as_str(), at);
        e.task = Some(f.task.clone());
        e.agent = Some(f.agent.clone());
        e.action = Some(action.0);
        e.provider = Some(f.provider.clone());
        e.route = Some(f.route.clone());
        e.method = Some(f.method.clone());
        e
    }

    pub(crate) fn open_task(&mut self, task: NewTask, at: Timestamp) -> Result<(), StoreError> {
        if rows::task(self.conn, &task.agent, &task.id)?.is_some() {
            return Ok(());
        }
        self.conn
            .prepare_cached(
                "INSERT INTO tasks (id, agent, priority, deadline_ms, created_at_ms) \
                 VALUES (?1, ?2, ?3, ?4, ?5)",
            )?
            .execute(params![
                task.id,
                task.agent,
                task.priority.as_str(),
                task.deadline.map(ms),
                ms(at)
            ])?;
        let mut e = AuditEvent::new(EventKind::TaskOpened.as_str(), &format_instant(at));
        e.task = Some(task.id);
        e.agent = Some(task.agent);
        self.append(e)
    }

    pub(crate) fn record_action(
        &mut self,
        new: NewAction,
        at: Timestamp,
    ) -> Result<Admission, StoreError> {
        self.record_action_as(new, None, at)
    }

    /// Opens the task (if new) and records the action, in one operation.
    pub(crate) fn open_and_record(
        &mut self,
        task: NewTask,
        new: NewAction,
        id: Option<ActionId>,
        at: Timestamp,
    ) -> Result<Admission, StoreError> {
        check_names_task(&task, &new)?;
        self.open_task(task, at)?;
        self.record_action_as(new, id, at)
    }

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

    /// Records an action under `id` when one was handed out in advance, else under the next
    /// free id.
    fn record_action_as(
        &mut self,
        new: NewAction,
        id: Option<ActionId>,
        at: Timestamp,
    ) -> Result<Admission, StoreError> {
        let task = rows::task(self.conn, &new.agent, &new.task_id)?.ok_or_else(|| {
            StoreError::NotFound {
                what: format!("task {:?}", new.task_id),
            }
        })?;
        // A read carries no key (empty): nothing to find, nothing stored or audited.
        let key = (!new.idempotency_key.is_empty()).then_some(new.idempotency_key.as_str());
        if let Some(key) = key {
            if let Some(bound) = self.action_under_key(&task.agent, key)? {
                return self.admit_same_key(task.agent, new, bound);
            }
        }
        // A cancelled task takes no NEW action. The key of one recorded before (in this task
        // or another of the agent's) is found above all the same: its outcome is replayed,
        // its run joined, another request under it refused, as for any same-key resend.
        if task.cancelled_at.is_some() {
            return Err(StoreError::InvalidTransition {
                what: format!("task {:?}", task.id),
                reason: "cancelled; it takes no new actions".into(),
            });
        }
        let id = match id {
            Some(id) => id,
            None => ActionId(self.next_action_id.fetch_add(1, Ordering::Relaxed)),
        };
        self.insert_action(&new, &task.agent, id, at)?;
        if let Some(request) = &new.request {
            self.insert_kept_request(id, request)?;
        }
        self.append(requested_event(new, id, at))?;
        Ok(Admission::New(id))
    }

    /// The action `agent` recorded under idempotency `key` before, as the key bound it.
    fn action_under_key(&self, agent: &str, key: &str) -> Result<Option<KeyBinding>, StoreError> {
        Ok(self
            .conn
            .prepare_cached(
                "SELECT id, provider, method, route, payload_digest, target_digest \
                 FROM actions WHERE agent = ?1 AND idempotency_key = ?2",
            )?
            .query_row(params![agent, key], |r| {
                Ok(KeyBinding {
                    id: r.get::<_, i64>(0)?,
                    request: BoundRequest {
                        provider: r.get(1)?,
                        method: r.get(2)?,
                        route: r.get(3)?,
                    },
                    payload_digest: r.get::<_, String>(4)?,
                    target_digest: r.get::<_, Option<String>>(5)?,
                })
            })
            .optional()?)
    }

    /// `new` under a key already `bound` to an action of `agent`: that action, when `new` is
    /// the request the key bound, else the key's reuse refused.
    fn admit_same_key(
        &self,
        agent: String,
        new: NewAction,
        bound: KeyBinding,
    ) -> Result<Admission, StoreError> {
        let differs = bound.differences(&new);
        if !differs.is_empty() {
            return Err(StoreError::KeyReuse {
                agent,
                key: new.idempotency_key,
                existing: bound.id,
                differs,
                bound: Box::new(bound.request),
            });
        }
        let id = bound.id;
        let record =
            rows::action(self.conn, ActionId(id))?.ok_or_else(|| StoreError::NotFound {
                what: format!("action {id}"),
            })?;
        Ok(Admission::Existing(Box::new(record)))
    }

    /// Inserts the row of the new action `id` of `agent`, requested at `at`.
    fn insert_action(
        &self,
        new: &NewAction,
        agent: &str,
        id: ActionId,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        let key = (!new.idempotency_key.is_empty()).then_some(new.idempotency_key.as_str());
        self.conn
            .prepare_cached(
                "INSERT INTO actions (task_id, agent, provider, method, route, request_class, \
                 payload_digest, idempotency_key, external_reference, state, created_at_ms, \
                 updated_at_ms, id, desired_outcome, fingerprint, target_digest) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?11, ?12, ?13, ?14, ?15)",
            )?
            .execute(params![
                new.task_id,
                agent,
                new.provider,
                new.method,
                new.route.as_str(),
                new.request_class,
                new.payload_digest.as_str(),
                key,
                new.external_reference,
                ActionState::Requested.as_str(),
                ms(at),
                id.0,
                new.desired_outcome,
                new.fingerprint,
                new.target_digest.as_ref().map(PayloadDigest::as_str),
            ])?;
        Ok(())
    }

    pub(crate) fn mark_attempt_sent(
        &mut self,
        action: ActionId,
        at: Timestamp,
    ) -> Result<u32, StoreError> {
        let f = self.facts(action)?;
        let refuse = |reason: String| StoreError::InvalidTransition {
            what: format!("action {action}"),
            reason,
        };
        if f.cancelled {
            return Err(refuse(format!(
                "task {:?} is cancelled; it never sends again",
                f.task
            )));
        }
        match f.state {
            ActionState::Finished => {
                let outcome = f.outcome.map_or("none", |o| o.as_str());
                return Err(refuse(format!("already finished with outcome {outcome}")));
            }
            ActionState::InFlight => {
                return Err(refuse(
                    "an attempt is still in flight without a result".into(),
                ))
            }
            _ => {}
        }
        let n: i64 = self
            .conn
            .prepare_cached("SELECT COALESCE(MAX(n), 0) + 1 FROM attempts WHERE action_id = ?1")?
            .query_row(params![action.0], |r| r.get(0))?;
        self.conn
            .prepare_cached(
                "INSERT INTO attempts (action_id, n, state, started_at_ms) VALUES (?1, ?2, 'sent', ?3)",
            )?
            .execute(params![action.0, n, ms(at)])?;
        // The attempt takes the action's waiting retry job, if any (the live engine's own
        // timer woke it): the job is done and is not re-armed after a restart.
        self.conn
            .prepare_cached(
                "UPDATE scheduled_retries SET claimed_at_ms = ?2, claimed_by = 'attempt' \
                 WHERE action_id = ?1 AND claimed_at_ms IS NULL",
            )?
            .execute(params![action.0, ms(at)])?;
        self.set_state(action, ActionState::InFlight, at)?;
        let n = u32::try_from(n).map_err(|_| refuse(format!("attempt number {n} out of range")))?;
        let mut e = Self::action_event(EventKind::ActionSent, &format_instant(at), action, &f);
        e.attempt = Some(n);
        e.request_class = Some(f.request_class);
        e.idempotency_key = f.idempotency_key;
        self.append(e)?;
        Ok(n)
    }

    fn set_state(
        &self,
        action: ActionId,
        state: ActionState,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        self.conn
            .prepare_cached("UPDATE actions SET state = ?2, updated_at_ms = ?3 WHERE id = ?1")?
            .execute(params![action.0, state.as_str(), ms(at)])?;
        Ok(())
    }

    pub(crate) fn record_result(
        &mut self,
        result: AttemptResult,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        let action = result.action;
        let f = self.facts(action)?;
        let state: Option<String> = self
            .conn
            .prepare_cached("SELECT state FROM attempts WHERE action_id = ?1 AND n = ?2")?
            .query_row(params![action.0, result.attempt], |r| r.get(0))
            .optional()?;
        match state.as_deref() {
            None => {
                return Err(StoreError::NotFound {
                    what: format!("attempt {} of action {action}", result.attempt),
                })
            }
            Some("sent") => {}
            Some(_) => {
                return Err(StoreError::InvalidTransition {
                    what: format!("attempt {} of action {action}", result.attempt),
                    reason: "already has a result".into(),
                })
            }
        }
        let boundary = boundary_text(result.boundary);
        let headers = signal_headers_json(&result.signal_headers)?;
        self.conn
            .prepare_cached(
                "UPDATE attempts SET state = 'finished', status = ?3, disposition = ?4, \
                 finished_at_ms = ?5, boundary = ?6, signal_headers = ?7 \
                 WHERE action_id = ?1 AND n = ?2",
            )?
            .execute(params![
                action.0,
                result.attempt,
                result.status,
                result.disposition.as_str(),
                ms(at),
                boundary,
                headers
            ])?;
        self.conn
            .prepare_cached(
                "UPDATE actions SET provider_operation_id = COALESCE(?2, provider_operation_id), \
                 state = CASE WHEN state = 'finished' THEN state ELSE 'attempted' END, \
                 updated_at_ms = ?3 WHERE id = ?1",
            )?
            .execute(params![action.0, result.provider_operation_id, ms(at)])?;
        let at_text = format_instant(at);
        let mut e = Self::action_event(EventKind::ActionResult, &at_text, action, &f);
        e.attempt = Some(result.attempt);
        e.status = result.status;
        e.disposition = Some(result.disposition.as_str().to_owned());
        e.boundary = boundary;
        e.source = result.source;
        e.signal_headers = (!result.signal_headers.is_empty()).then_some(result.signal_headers);
        self.append(e)?;
        if let Some(finish) = result.finish {
            self.finish_action(action, finish, at)?;
        }
        Ok(())
    }

    pub(crate) fn finish_action(
        &mut self,
        action: ActionId,
        finish: Finish,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        let f = self.facts(action)?;
        if f.state == ActionState::Finished
            && !matches!(
                f.outcome,
                Some(Outcome::ReconciliationRequired) | Some(Outcome::Escalated)
            )
        {
            return Err(StoreError::InvalidTransition {
                what: format!("action {action}"),
                reason: format!(
                    "already finished with outcome {}",
                    f.outcome.map_or("none", |o| o.as_str())
                ),
            });
        }
        let FinishColumns {
            context,
            status,
            headers,
            body,
        } = finish_columns(&finish)?;
        self.conn
            .prepare_cached(
                "UPDATE actions SET state = 'finished', outcome = ?2, outcome_context = ?3, \
                 response_status = COALESCE(?4, response_status), \
                 response_headers = COALESCE(?5, response_headers), \
                 response_body = COALESCE(?6, response_body), updated_at_ms = ?7 WHERE id = ?1",
            )?
            .execute(params![
                action.0,
                finish.outcome.as_str(),
                context,
                status,
                headers,
                body,
                ms(at)
            ])?;
        self.conn
            .prepare_cached(
                "DELETE FROM scheduled_retries WHERE action_id = ?1 AND claimed_at_ms IS NULL",
            )?
            .execute(params![action.0])?;
        let kind = finish_event_kind(finish.outcome);
        let mut e = Self::action_event(kind, &format_instant(at), action, &f);
        e.outcome = Some(finish.outcome.as_str().to_owned());
        self.append(e)
    }

    /// Ends `action` `succeeded` as reconciled. Its outcome context becomes `context` with
    /// `reconciled: true` added when one is given; otherwise a context already stored (an
    /// escalation's, when an operator's status query found the write) is kept, and an action
    /// without one gets only the marker `{"reconciled": true}`.
    pub(crate) fn record_reconciled(
        &mut self,
        action: ActionId,
        provider_operation_id: Option<String>,
        context: Option<serde_json::Value>,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        let f = self.facts(action)?;
        let context = match context {
            Some(serde_json::Value::Object(mut map)) => {
                map.insert("reconciled".into(), serde_json::Value::Bool(true));
                Some(serde_json::Value::Object(map).to_string())
            }
            _ => None,
        };
        self.conn
            .prepare_cached(
                "UPDATE actions SET state = 'finished', outcome = 'succeeded', \
                 provider_operation_id = COALESCE(?2, provider_operation_id), \
                 outcome_context = COALESCE(?4, outcome_context, '{\"reconciled\":true}'), \
                 updated_at_ms = ?3 WHERE id = ?1",
            )?
            .execute(params![action.0, provider_operation_id, ms(at), context])?;
        let mut e = Self::action_event(EventKind::Reconciled, &format_instant(at), action, &f);
        e.outcome = Some(Outcome::Succeeded.as_str().to_owned());
        e.idempotency_key = f.idempotency_key;
        self.append(e)
    }

    pub(crate) fn schedule_retry(
        &mut self,
        action: ActionId,
        due_at: Timestamp,
        at: Timestamp,
    ) -> Result<JobId, StoreError> {
        let f = self.facts(action)?;
        if f.cancelled || f.state == ActionState::Finished {
            return Err(StoreError::InvalidTransition {
                what: format!("action {action}"),
                reason: if f.cancelled {
                    format!("task {:?} is cancelled", f.task)
                } else {
                    "already finished".into()
                },
            });
        }
        // At most one waiting retry per action (a unique index says so too): a new plan
        // supersedes a job not taken yet.
        self.conn
            .prepare_cached(
                "UPDATE scheduled_retries SET claimed_at_ms = ?2, claimed_by = 'superseded' \
                 WHERE action_id = ?1 AND claimed_at_ms IS NULL",
            )?
            .execute(params![action.0, ms(at)])?;
        self.conn
            .prepare_cached("INSERT INTO scheduled_retries (action_id, due_at_ms) VALUES (?1, ?2)")?
            .execute(params![action.0, ms(due_at)])?;
        let job = JobId(self.conn.last_insert_rowid());
        self.set_state(action, ActionState::Waiting, at)?;
        let mut e = Self::action_event(EventKind::RetryScheduled, &format_instant(at), action, &f);
        e.job = Some(job.0);
        e.due_at = Some(format_instant(due_at));
        self.append(e)?;
        Ok(job)
    }

    pub(crate) fn claim_due(
        &mut self,
        now: Timestamp,
        limit: usize,
        claimed_by: &str,
    ) -> Result<Vec<DueRetry>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let due: Vec<(i64, i64, i64)> = {
            let mut stmt = self.conn.prepare_cached(
                "SELECT r.job_id, r.action_id, r.due_at_ms FROM scheduled_retries r \
                 JOIN actions a ON a.id = r.action_id JOIN tasks t ON t.agent = a.agent AND t.id = a.task_id \
                 WHERE r.claimed_at_ms IS NULL AND r.due_at_ms <= ?1 \
                 AND t.cancelled_at_ms IS NULL AND a.state != 'finished' \
                 ORDER BY r.due_at_ms, r.job_id LIMIT ?2",
            )?;
            let rows = stmt.query_map(params![ms(now), limit], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?))
            })?;
            rows.collect::<Result<_, _>>()?
        };
        let at_text = format_instant(now);
        let mut out = Vec::with_capacity(due.len());
        for (job, action, due_at_ms) in due {
            self.conn
                .prepare_cached(
                    "UPDATE scheduled_retries SET claimed_at_ms = ?2, claimed_by = ?3 WHERE job_id = ?1",
                )?
                .execute(params![job, ms(now), claimed_by])?;
            let action = ActionId(action);
            let due_at = rows::from_ms("scheduled_retries", due_at_ms)?;
            let f = self.facts(action)?;
            let mut e = Self::action_event(EventKind::RetryStarted, &at_text, action, &f);
            e.job = Some(job);
            e.due_at = Some(format_instant(due_at));
            self.append(e)?;
            out.push(DueRetry {
                job: JobId(job),
                action,
                due_at,
            });
        }
        Ok(out)
    }

    pub(crate) fn claim_job(
        &mut self,
        job: JobId,
        now: Timestamp,
        claimed_by: &str,
    ) -> Result<Option<DueRetry>, StoreError> {
        let row: Option<(i64, i64)> = self
            .conn
            .prepare_cached(
                "SELECT r.action_id, r.due_at_ms FROM scheduled_retries r \
                 JOIN actions a ON a.id = r.action_id JOIN tasks t ON t.agent = a.agent AND t.id = a.task_id \
                 WHERE r.job_id = ?1 AND r.claimed_at_ms IS NULL \
                 AND t.cancelled_at_ms IS NULL AND a.state != 'finished'",
            )?
            .query_row(params![job.0], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?;
        let Some((action, due_at_ms)) = row else {
            return Ok(None);
        };
        self.conn
            .prepare_cached(
                "UPDATE scheduled_retries SET claimed_at_ms = ?2, claimed_by = ?3 WHERE job_id = ?1",
            )?
            .execute(params![job.0, ms(now), claimed_by])?;
        let action = ActionId(action);
        let due_at = rows::from_ms("scheduled_retries", due_at_ms)?;
        let f = self.facts(action)?;
        let mut e = Self::action_event(EventKind::RetryStarted, &format_instant(now), action, &f);
        e.job = Some(job.0);
        e.due_at = Some(format_instant(due_at));
        self.append(e)?;
        Ok(Some(DueRetry {
            job,
            action,
            due_at,
        }))
    }

    pub(crate) fn record_reconciliation_lookup(
        &mut self,
        action: ActionId,
        lookup: &str,
        status: Option<u16>,
        verdict: &str,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        let f = self.facts(action)?;
        let mut e = Self::action_event(
            EventKind::ReconciliationLookup,
            &format_instant(at),
            action,
            &f,
        );
        e.idempotency_key = f.idempotency_key;
        e.status = status;
        e.disposition = Some(verdict.to_owned());
        e.source = Some(lookup.to_owned());
        self.append(e)
    }

    pub(crate) fn update_scope(
        &mut self,
        update: ScopeUpdate,
        at: Timestamp,
    ) -> Result<ScopeRecord, StoreError> {
        let old = rows::scope(self.conn, &update.provider, &update.scope)?;
        let next_allowed_at = match (
            old.as_ref().and_then(|o| o.next_allowed_at),
            update.next_allowed_at,
        ) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        let to_i64 = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.conn
            .prepare_cached(
                "INSERT INTO scope_records (provider, scope, next_allowed_at_ms, remaining, limit_, \
                 reset_at_ms, source, updated_at_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8) \
                 ON CONFLICT (provider, scope) DO UPDATE SET \
                 next_allowed_at_ms = excluded.next_allowed_at_ms, remaining = excluded.remaining, \
                 limit_ = excluded.limit_, reset_at_ms = excluded.reset_at_ms, \
                 source = excluded.source, updated_at_ms = excluded.updated_at_ms",
            )?
            .execute(params![
                update.provider,
                update.scope,
                next_allowed_at.map(ms),
                update.remaining.map(to_i64),
                update.limit.map(to_i64),
                update.reset_at.map(ms),
                update.source,
                ms(at)
            ])?;
        let record = ScopeRecord {
            provider: update.provider,
            scope: update.scope,
            next_allowed_at,
            remaining: update.remaining,
            limit: update.limit,
            reset_at: update.reset_at,
            source: update.source,
        };
        let mut e = AuditEvent::new(EventKind::ScopeUpdated.as_str(), &format_instant(at));
        e.provider = Some(record.provider.clone());
        e.scope = Some(record.scope.clone());
        e.boundary = record.next_allowed_at.map(format_instant);
        e.remaining = record.remaining;
        e.limit = record.limit;
        e.source = Some(record.source.clone());
        self.append(e)?;
        Ok(record)
    }

    /// Inserts an open escalation row for `action` with its case file (stored as JSON text),
    /// opened at `at`; returns its id. Nothing else about the action changes here.
    fn insert_escalation(
        &mut self,
        action: ActionId,
        case_file: &serde_json::Value,
        at: Timestamp,
    ) -> Result<EscalationId, StoreError> {
        let case_text = serde_json::to_string(case_file).map_err(|e| StoreError::Invalid {
            field: "case_file",
            reason: e.to_string(),
        })?;
        self.conn
            .prepare_cached(
                "INSERT INTO escalations (action_id, case_file, state, opened_at_ms) \
                 VALUES (?1, ?2, 'open', ?3)",
            )?
            .execute(params![action.0, case_text, ms(at)])?;
        let id = EscalationId(self.conn.last_insert_rowid());
        Ok(id)
    }

    /// Opens an escalation and ends the action `escalated`; its outcome context is `context`
    /// (a JSON object) with `escalation` set to the new id, or only `{"escalation": id}`.
    pub(crate) fn open_escalation(
        &mut self,
        action: ActionId,
        case_file: serde_json::Value,
        context: Option<serde_json::Value>,
        at: Timestamp,
    ) -> Result<EscalationId, StoreError> {
        let f = self.facts(action)?;
        let id = self.insert_escalation(action, &case_file, at)?;
        let mut context = match context {
            Some(serde_json::Value::Object(map)) => map,
            _ => serde_json::Map::new(),
        };
        context.insert("escalation".into(), serde_json::json!(id.0));
        self.conn
            .prepare_cached(
                "UPDATE actions SET state = 'finished', outcome = 'escalated', \
                 outcome_context = ?2, updated_at_ms = ?3 WHERE id = ?1",
            )?
            .execute(params![
                action.0,
                serde_json::Value::Object(context).to_string(),
                ms(at)
            ])?;
        self.conn
            .prepare_cached(
                "DELETE FROM scheduled_retries WHERE action_id = ?1 AND claimed_at_ms IS NULL",
            )?
            .execute(params![action.0])?;
        let mut e = Self::action_event(EventKind::Escalated, &format_instant(at), action, &f);
        e.escalation = Some(id.0);
        e.outcome = Some(Outcome::Escalated.as_str().to_owned());
        self.append(e)?;
        Ok(id)
    }

    pub(crate) fn open_escalation_beside_outcome(
        &mut self,
        action: ActionId,
        case_file: serde_json::Value,
        at: Timestamp,
    ) -> Result<EscalationId, StoreError> {
        let f = self.facts(action)?;
        let Some(outcome) = f.outcome.filter(|_| f.state == ActionState::Finished) else {
            return Err(StoreError::InvalidTransition {
                what: format!("action {action}"),
                reason: "it has not ended; an escalation beside an outcome needs the outcome"
                    .into(),
            });
        };
        let id = self.insert_escalation(action, &case_file, at)?;
        let mut e = Self::action_event(EventKind::Escalated, &format_instant(at), action, &f);
        e.escalation = Some(id.0);
        e.outcome = Some(outcome.as_str().to_owned());
        self.append(e)?;
        Ok(id)
    }

    pub(crate) fn decide_escalation(
        &mut self,
        escalation: EscalationId,
        decision: &str,
        decided_by: &str,
        note: Option<&str>,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        let record = self.undecided_escalation(escalation)?;
        self.conn
            .prepare_cached(
                "UPDATE escalations SET state = 'decided', decision = ?2, decided_by = ?3, \
                 decided_at_ms = ?4, note = ?5 WHERE id = ?1",
            )?
            .execute(params![escalation.0, decision, decided_by, ms(at), note])?;
        let f = self.facts(record.action)?;
        let mut e = Self::action_event(EventKind::Decision, &format_instant(at), record.action, &f);
        e.escalation = Some(escalation.0);
        e.decision = Some(decision.to_owned());
        e.decided_by = Some(decided_by.to_owned());
        self.append(e)
    }

    pub(crate) fn reopen_for_retry(
        &mut self,
        action: ActionId,
        decided_by: &str,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        if decided_by.trim().is_empty() {
            return Err(StoreError::Invalid {
                field: "decided_by",
                reason: "must name who decided".into(),
            });
        }
        let f = self.reopenable(action)?;
        let refuse = |reason: String| refused(action, reason);
        let escalated = matches!(
            f.outcome,
            Some(Outcome::Escalated) | Some(Outcome::ReconciliationRequired)
        );
        if f.state != ActionState::Finished || !escalated {
            return Err(refuse(format!(
                "only an escalated action may be reopened (state {}, outcome {})",
                f.state,
                f.outcome.map_or("none", |o| o.as_str())
            )));
        }
        let mut e = self.reopen(action, f, at)?;
        e.decided_by = Some(decided_by.to_owned());
        self.append(e)
    }

    /// Keeps `request` as the request of `action` (replacing one kept before), unless the
    /// action has ended: its row goes with the action's end (the schema's trigger).
    fn insert_kept_request(
        &mut self,
        action: ActionId,
        request: &KeptRequest,
    ) -> Result<(), StoreError> {
        let headers = serde_json::to_string(&request.headers).map_err(|e| StoreError::Invalid {
            field: "request.headers",
            reason: e.to_string(),
        })?;
        self.conn
            .prepare_cached(
                "INSERT OR REPLACE INTO kept_requests (action_id, method, url, headers, body) \
                 SELECT id, ?2, ?3, ?4, ?5 FROM actions WHERE id = ?1 AND state != 'finished'",
            )?
            .execute(params![
                action.0,
                request.method,
                request.url,
                headers,
                request.body
            ])?;
        Ok(())
    }

    pub(crate) fn keep_request(
        &mut self,
        action: ActionId,
        request: &KeptRequest,
    ) -> Result<(), StoreError> {
        self.facts(action)?;
        self.insert_kept_request(action, request)
    }

    pub(crate) fn resume_after_restart(
        &mut self,
        action: ActionId,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        let f = self.reopenable(action)?;
        if matches!(f.state, ActionState::Finished | ActionState::InFlight) {
            return Err(refused(
                action,
                format!(
                    "only an unfinished action with no attempt out may be resumed (state {})",
                    f.state
                ),
            ));
        }
        // Its waiting retry, if any, is this resume's: not re-armed at a later start.
        self.conn
            .prepare_cached(
                "UPDATE scheduled_retries SET claimed_at_ms = ?2, claimed_by = 'resumed' \
                 WHERE action_id = ?1 AND claimed_at_ms IS NULL",
            )?
            .execute(params![action.0, ms(at)])?;
        let mut e = self.reopen(action, f, at)?;
        e.source = Some(RESUMED_AFTER_RESTART.to_owned());
        self.append(e)
    }

    pub(crate) fn reopen_for_resend(
        &mut self,
        action: ActionId,
        advised: Option<Timestamp>,
        escalation: Option<EscalationId>,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        let f = self.reopenable(action)?;
        let refuse = |reason: String| refused(action, reason);
        let resendable = matches!(
            f.outcome,
            Some(
                Outcome::BudgetExhausted
                    | Outcome::DeadlineExhausted
                    | Outcome::QuotaExhausted
                    | Outcome::ScopeSaturated
                    | Outcome::Cancelled
            )
        );
        if f.state != ActionState::Finished || !resendable {
            return Err(refuse(format!(
                "only a write that ended budget_exhausted, deadline_exhausted, quota_exhausted, scope_saturated or cancelled (its task not cancelled) may be reopened by a resend (state {}, outcome {})",
                f.state,
                f.outcome.map_or("none", |o| o.as_str())
            )));
        }
        let set_aside = f.outcome.map(|o| o.as_str().to_owned());
        let mut e = self.reopen(action, f, at)?;
        e.outcome = set_aside;
        e.boundary = advised.map(format_instant);
        e.escalation = escalation.map(|id| id.0);
        e.source = Some(REOPENED_BY_RESEND.to_owned());
        self.append(e)
    }

    /// The facts of `action` when it may be sent again as the same action — its task is not
    /// cancelled and it carries an idempotency key — else the refusal saying which.
    fn reopenable(&self, action: ActionId) -> Result<ActionFacts, StoreError> {
        let f = self.facts(action)?;
        if f.cancelled {
            return Err(refused(
                action,
                format!("task {:?} is cancelled; it never sends again", f.task),
            ));
        }
        if f.idempotency_key.is_none() {
            return Err(refused(
                action,
                "it carries no idempotency key, so it cannot be sent again as the same action"
                    .into(),
            ));
        }
        Ok(f)
    }

    /// Moves a finished `action` (its facts `f`) to `reopened`, its outcome and context cleared,
    /// and returns its [`ACTION_REOPENED`] event (class, key, `decision: retry_same_key`) for
    /// the caller to complete and append.
    fn reopen(
        &mut self,
        action: ActionId,
        f: ActionFacts,
        at: Timestamp,
    ) -> Result<AuditEvent, StoreError> {
        self.conn
            .prepare_cached(
                "UPDATE actions SET state = 'reopened', outcome = NULL, outcome_context = NULL, \
                 updated_at_ms = ?2 WHERE id = ?1",
            )?
            .execute(params![action.0, ms(at)])?;
        let mut e = Self::action_event(EventKind::ActionRequested, &format_instant(at), action, &f);
        e.kind = ACTION_REOPENED.to_owned();
        e.request_class = Some(f.request_class);
        e.idempotency_key = f.idempotency_key;
        e.decision = Some("retry_same_key".to_owned());
        Ok(e)
    }

    pub(crate) fn record_access_decision(
        &mut self,
        escalation: EscalationId,
        access: &str,
        decided_by: &str,
        outcome: &str,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        require_text(&[
            ("access", access),
            ("decided_by", decided_by),
            ("outcome", outcome),
        ])?;
        let record = self.stored_escalation(escalation)?;
        let f = self.facts(record.action)?;
        let mut e = Self::action_event(EventKind::Decision, &format_instant(at), record.action, &f);
        e.kind = ACCESS_DECISION.to_owned();
        e.escalation = Some(escalation.0);
        e.decision = Some(access.to_owned());
        e.decided_by = Some(decided_by.to_owned());
        e.outcome = Some(outcome.to_owned());
        self.append(e)
    }

    pub(crate) fn record_status_query(
        &mut self,
        escalation: EscalationId,
        decided_by: &str,
        verdict: &str,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        require_text(&[("decided_by", decided_by), ("verdict", verdict)])?;
        let record = self.undecided_escalation(escalation)?;
        let f = self.facts(record.action)?;
        let mut e = Self::action_event(EventKind::Decision, &format_instant(at), record.action, &f);
        e.kind = STATUS_QUERY.to_owned();
        e.escalation = Some(escalation.0);
        e.decision = Some("query_status".to_owned());
        e.decided_by = Some(decided_by.to_owned());
        e.disposition = Some(verdict.to_owned());
        self.append(e)
    }

    pub(crate) fn cancel_task(
        &mut self,
        agent: &str,
        task: &str,
        at: Timestamp,
    ) -> Result<CancelReport, StoreError> {
        let record = rows::task(self.conn, agent, task)?.ok_or_else(|| StoreError::NotFound {
            what: format!("task {task:?}"),
        })?;
        if record.cancelled_at.is_some() {
            return Ok(CancelReport::default());
        }
        self.conn
            .prepare_cached("UPDATE tasks SET cancelled_at_ms = ?3 WHERE agent = ?1 AND id = ?2")?
            .execute(params![agent, task, ms(at)])?;
        let retries_dropped = self
            .conn
            .prepare_cached(
                "DELETE FROM scheduled_retries WHERE claimed_at_ms IS NULL AND action_id IN \
                 (SELECT id FROM actions WHERE agent = ?1 AND task_id = ?2)",
            )?
            .execute(params![agent, task])? as u64;
        let at_text = format_instant(at);
        let mut e = AuditEvent::new(EventKind::Cancelled.as_str(), &at_text);
        e.task = Some(task.to_owned());
        e.agent = Some(agent.to_owned());
        self.append(e)?;
        // In-flight actions keep their state: their result (or reconciliation) must still be
        // recorded, since the provider may have acted.
        let open: Vec<(i64, bool)> = {
            let mut stmt = self.conn.prepare_cached(
                "SELECT id, COALESCE(idempotency_key, '') != '' FROM actions \
                 WHERE agent = ?1 AND task_id = ?2 \
                 AND state IN ('requested', 'attempted', 'waiting', 'reopened') ORDER BY id",
            )?;
            let rows = stmt.query_map(params![agent, task], |r| Ok((r.get(0)?, r.get(1)?)))?;
            rows.collect::<Result<_, _>>()?
        };
        let mut actions_cancelled = 0;
        let mut unsettled = Vec::new();
        for (id, write) in open {
            let id = ActionId(id);
            // A write that may have been acted on is not ended as if nothing had happened: it
            // stays open between two attempts, with no retry, for the caller to reconcile (and
            // for the next start to, should the gateway stop first).
            if write {
                if let Some(attempt) = unsettled_attempt(&rows::attempts(self.conn, id)?) {
                    self.set_state(id, ActionState::Attempted, at)?;
                    unsettled.push(UnsettledWrite {
                        action: id,
                        attempt,
                    });
                    continue;
                }
            }
            self.finish_action(
                id,
                Finish {
                    outcome: Outcome::Cancelled,
                    context: serde_json::json!({ "cancelled_with_task": task }),
                    response: None,
                },
                at,
            )?;
            actions_cancelled += 1;
        }
        Ok(CancelReport {
            actions_cancelled,
            retries_dropped,
            unsettled,
        })
    }

    pub(crate) fn record_circuit_opened(
        &mut self,
        agent: &str,
        task: &str,
        provider: &str,
        method: &str,
        route: &RouteTemplate,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        let mut e = AuditEvent::new(EventKind::CircuitOpened.as_str(), &format_instant(at));
        e.task = Some(task.to_owned());
        e.agent = Some(agent.to_owned());
        e.provider = Some(provider.to_owned());
        e.method = Some(method.to_owned());
        e.route = Some(route.as_str().to_owned());
        self.append(e)
    }

    pub(crate) fn record_watchdog_finding(
        &mut self,
        action: ActionId,
        finding: &str,
        job: Option<JobId>,
        due_at: Option<Timestamp>,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        require_text(&[("finding", finding)])?;
        let f = self.facts(action)?;
        let mut e = Self::action_event(EventKind::WatchdogFinding, &format_instant(at), action, &f);
        e.source = Some(finding.to_owned());
        e.job = job.map(|j| j.0);
        e.due_at = due_at.map(format_instant);
        self.append(e)
    }
}

/// A finish as stored in an action's row: the outcome context as JSON text and, when a
/// response is kept for replay, its status, headers (a JSON array of `[name, value]` pairs)
/// and body.
struct FinishColumns<'a> {
    context: String,
    status: Option<u16>,
    headers: Option<String>,
    body: Option<&'a [u8]>,
}

/// Encodes `finish` for the actions table.
///
/// # Errors
/// [`StoreError::Invalid`] naming `outcome context` or `response headers` if either cannot
/// be encoded as JSON.
/// The refusal of a transition of `action`, saying why.
fn refused(action: ActionId, reason: String) -> StoreError {
    StoreError::InvalidTransition {
        what: format!("action {action}"),
        reason,
    }
}

fn finish_columns(finish: &Finish) -> Result<FinishColumns<'_>, StoreError> {
    let context = serde_json::to_string(&finish.context).map_err(|e| StoreError::Invalid {
        field: "outcome context",
        reason: e.to_string(),
    })?;
    let (status, headers, body) = match &finish.response {
        Some(r) => (
            Some(r.status),
            Some(
                serde_json::to_string(&r.headers).map_err(|e| StoreError::Invalid {
                    field: "response headers",
                    reason: e.to_string(),
                })?,
            ),
            Some(r.body.as_slice()),
        ),
        None => (None, None, None),
    };
    Ok(FinishColumns {
        context,
        status,
        headers,
        body,
    })
}

/// Replaces the text in `s` with `text`, in the room `s` has.
fn refill(s: &mut String, text: &str) {
    s.clear();
    s.push_str(text);
}

/// The audit event that records an action finishing with `outcome`: the outcomes that need
/// attention have their own kinds, every other outcome is `ActionFinished`.
fn finish_event_kind(outcome: Outcome) -> EventKind {
    match outcome {
        Outcome::BudgetExhausted => EventKind::BudgetExhausted,
        Outcome::DeadlineExhausted => EventKind::DeadlineExhausted,
        Outcome::ReconciliationRequired => EventKind::ReconciliationRequired,
        Outcome::Escalated => EventKind::Escalated,
        Outcome::Cancelled => EventKind::Cancelled,
        _ => EventKind::ActionFinished,
    }
}

/// The stored text of a boundary: an RFC 3339 instant, `unknown`, or nothing when the response
/// gave no signal.
fn boundary_text(boundary: Option<Boundary>) -> Option<String> {
    boundary.map(|b| match b {
        Boundary::Unknown => "unknown".to_owned(),
        Boundary::At(t) => format_instant(t),
    })
}

/// The kept signal headers as stored: a JSON array of `[name, value]` pairs, or nothing when
/// none were kept.
///
/// # Errors
/// [`StoreError::Invalid`] if they cannot be encoded.
fn signal_headers_json(headers: &[(String, String)]) -> Result<Option<String>, StoreError> {
    if headers.is_empty() {
        return Ok(None);
    }
    serde_json::to_string(headers)
        .map(Some)
        .map_err(|e| StoreError::Invalid {
            field: "signal_headers",
            reason: e.to_string(),
        })
}

/// What an idempotency key bound when it was first used: the action and its request.
struct KeyBinding {
    id: i64,
    request: BoundRequest,
    payload_digest: String,
    /// `None` when recorded before schema version 7.
    target_digest: Option<String>,
}

impl KeyBinding {
    /// What of `new` differs from the request the key bound, by name.
    ///
    /// A key binds one request (SPEC §6): the same provider, method, route template, concrete
    /// target (path and query) and payload; anything else under it is another request. The
    /// target refines the route: it is named only when the route template is the same
    /// (another template is another target anyway). A target not known on either side
    /// (recorded before schema version 7) is not compared.
    fn differences(&self, new: &NewAction) -> Vec<&'static str> {
        let bound = &self.request;
        let route_differs = bound.route != new.route.as_str();
        let target_differs = match (self.target_digest.as_deref(), new.target_digest.as_ref()) {
            (Some(bound), Some(new)) => !route_differs && bound != new.as_str(),
            _ => false,
        };
        [
            ("provider", bound.provider != new.provider),
            ("method", bound.method != new.method),
            ("route", route_differs),
            ("target", target_differs),
            (
                "payload",
                self.payload_digest != new.payload_digest.as_str(),
            ),
        ]
        .into_iter()
        .filter_map(|(what, differs)| differs.then_some(what))
        .collect()
    }
}

/// The `action_requested` event of the new action `id`, requested at `at`.
fn requested_event(new: NewAction, id: ActionId, at: Timestamp) -> AuditEvent {
    let key = (!new.idempotency_key.is_empty()).then_some(new.idempotency_key);
    let mut e = AuditEvent::new(EventKind::ActionRequested.as_str(), &format_instant(at));
    e.task = Some(new.task_id);
    e.agent = Some(new.agent);
    e.action = Some(id.0);
    e.provider = Some(new.provider);
    e.route = Some(new.route.as_str().to_owned());
    e.method = Some(new.method);
    e.request_class = Some(new.request_class);
    e.idempotency_key = key;
    e.payload_digest = Some(new.payload_digest.as_str().to_owned());
    e
}
