//! Escalations: opening one (ending the action or beside its outcome), deciding it, and the
//! operator's access decisions and status queries recorded against it.

use jiff::Timestamp;
use rusqlite::params;

use super::{require_text, WriteTx};
use crate::audit::{format_instant, EventKind};
use crate::error::StoreError;
use crate::model::{ActionId, ActionState, EscalationId, EscalationRecord, Outcome};
use crate::sqlite::rows::{self, ms};
use crate::store::{ACCESS_DECISION, STATUS_QUERY};

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
}
