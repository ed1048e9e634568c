//! Actions and their attempts: opening a task, recording an action (admitting a same-key
//! resend as the action its key bound), an attempt sent and its result, an action's finish and
//! its reconciliation.

use std::sync::atomic::Ordering;

use jiff::Timestamp;
use rusqlite::{params, OptionalExtension};

use super::{
    boundary_text, check_names_task, finish_columns, finish_event_kind, signal_headers_json,
    FinishColumns, WriteTx,
};
use crate::audit::{format_instant, AuditEvent, EventKind};
use crate::error::{BoundRequest, StoreError};
use crate::model::{
    ActionId, ActionState, Admission, AttemptResult, Finish, NewAction, NewTask, Outcome,
    PayloadDigest,
};
use crate::sqlite::rows::{self, ms};

impl WriteTx<'_> {
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
