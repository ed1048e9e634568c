//! Retries and their jobs: scheduling an action's retry, and claiming the jobs that are due.

use jiff::Timestamp;
use rusqlite::{params, OptionalExtension};

use super::WriteTx;
use crate::audit::{format_instant, EventKind};
use crate::error::StoreError;
use crate::model::{ActionId, ActionState, DueRetry, JobId};
use crate::sqlite::rows::{self, ms};

impl WriteTx<'_> {
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
}
