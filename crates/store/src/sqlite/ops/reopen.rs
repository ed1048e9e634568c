//! Sending an action again as the same action: reopening it for a retry or a resend, resuming
//! it after a restart, and the request kept for it.

use jiff::Timestamp;
use rusqlite::params;

use super::{ActionFacts, WriteTx};
use crate::audit::{format_instant, AuditEvent, EventKind};
use crate::error::StoreError;
use crate::model::{ActionId, ActionState, EscalationId, KeptRequest, Outcome};
use crate::sqlite::rows::ms;
use crate::store::{ACTION_REOPENED, REOPENED_BY_RESEND, RESUMED_AFTER_RESTART};

impl WriteTx<'_> {
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
    pub(super) fn insert_kept_request(
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
}

/// The refusal of a transition of `action`, saying why.
fn refused(action: ActionId, reason: String) -> StoreError {
    StoreError::InvalidTransition {
        what: format!("action {action}"),
        reason,
    }
}
