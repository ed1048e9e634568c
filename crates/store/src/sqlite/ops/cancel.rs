//! Cancelling a task: its retries dropped, its open actions ended `cancelled`, its unsettled
//! writes left for reconciliation.

use jiff::Timestamp;
use rusqlite::params;

use super::WriteTx;
use crate::audit::{format_instant, AuditEvent, EventKind};
use crate::error::StoreError;
use crate::model::{
    unsettled_attempt, ActionId, ActionState, CancelReport, Finish, Outcome, UnsettledWrite,
};
use crate::sqlite::rows::{self, ms};

impl WriteTx<'_> {
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
}
