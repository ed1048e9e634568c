//! The write operations, each run inside the writer's transaction (one savepoint per
//! operation, many operations per group commit): the transaction's handle and what every
//! operation shares (appending events, an action's facts, the stored forms of a finish and of
//! an attempt's signal), with the operations themselves one concept per file.

mod actions;
mod cancel;
mod escalations;
mod guards;
mod read;
mod reopen;
mod retries;
mod scopes;

use std::sync::atomic::AtomicI64;

use jiff::Timestamp;
use rusqlite::{params, Connection, OptionalExtension, Statement};

use super::feed::Watched;
use super::rows::{self, ms};
use crate::audit::{format_instant, AuditEvent, Chain, EventKind};
use crate::error::StoreError;
use crate::model::{ActionId, ActionState, Boundary, Finish, NewAction, NewTask, Outcome};

pub(crate) use read::{ReadStatements, ReadStep};

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
