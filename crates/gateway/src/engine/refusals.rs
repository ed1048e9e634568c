//! Answers given when the store or the request refuses the action: `store_unavailable`,
//! `shutting_down`, a write not admitted, a request rejected before anything is recorded — and
//! the store errors' reading ([`is_store_failure`], [`may_have_committed`]) they go by.

use axum::response::IntoResponse;
use backstop_core::outcome::{NextSafe, Outcome, OutcomeContext};
use backstop_store::{ActionId, StoreError};
use std::sync::atomic::Ordering;

use super::{writes, Engine, EngineError};
use crate::{
    action::{ActionReceipt, ActionSpec, Execution},
    problem::Problem,
};

/// `problem` (a `503 store_unavailable` or `503 shutting_down` for an accepted request) with
/// what identifies the request, as the gateway's other answers for an action carry it: `task`
/// (the action's own when the receipt names it, else the request's), the write's
/// `idempotency_key` (the receipt's, the agent's or the one minted for it, which the door also
/// answers as the `Idempotency-Key` header) and `action_id` when an action was recorded (a
/// receipt's id 0 means none was).
pub(super) fn with_ids(problem: Problem, spec: &ActionSpec, receipt: &ActionReceipt) -> Problem {
    let task = receipt.task.as_deref().unwrap_or(&spec.task_id);
    let mut problem = problem.with_extension("task", task.into());
    if let Some(key) = &receipt.idempotency_key {
        problem = problem.with_extension("idempotency_key", key.as_str().into());
    }
    if receipt.action_id != 0 {
        problem = problem.with_extension("action_id", receipt.action_id.into());
    }
    problem
}

impl Engine {
    /// The store refused to record the action (a cancelled task, a key reused for another
    /// request, a task opened by another agent) or failed (nothing was sent either way). A
    /// reused key is answered `422 idempotency_key_reused` saying what differs. `key` is the
    /// idempotency key in effect for a write (the agent's, or the one minted for it), `action`
    /// the action when one is recorded; a store failure's answer carries both.
    pub(super) fn refused_by_store(
        &self,
        e: EngineError,
        spec: &ActionSpec,
        key: Option<&str>,
        action: Option<ActionId>,
    ) -> Execution {
        if is_store_failure(&e) {
            let receipt = ActionReceipt {
                action_id: action.map_or(0, |a| a.0),
                attempts: 0,
                idempotency_key: key.map(str::to_owned),
                provider_operation_id: None,
                task: None,
            };
            return self.store_unavailable(spec, receipt, false, &e);
        }
        match e {
            EngineError::Store(StoreError::KeyReuse { differs, bound, .. }) => {
                let receipt = ActionReceipt {
                    action_id: 0,
                    attempts: 0,
                    idempotency_key: key.map(str::to_owned),
                    provider_operation_id: None,
                    task: None,
                };
                let problem = Problem::key_reused(
                    &differs,
                    (&bound.provider, &bound.method, &bound.route),
                    key,
                )
                .with_extension("task", spec.task_id.as_str().into());
                problem.log_refusal("admission", Some(&spec.agent), &self.inner.metrics);
                problem_answer(receipt, problem)
            }
            e => {
                self.inner.metrics.refusal(Outcome::Cancelled.as_str());
                match e {
                    // The record refusing it is named (`task "run-42" is cancelled; …`).
                    EngineError::Store(StoreError::InvalidTransition { what, reason }) => {
                        unrecorded(
                            Outcome::Cancelled,
                            format!("the action was not accepted: {what} is {reason}"),
                        )
                    }
                    _ => unrecorded(
                        Outcome::Cancelled,
                        "the action was not accepted by the store".to_owned(),
                    ),
                }
            }
        }
    }

    /// The store failed: `503 store_unavailable` saying whether an attempt was sent (a retry
    /// is invited only when nothing was), logged as an ERROR with the store's reason. While
    /// the gateway stops, a store whose writer is gone answers `503 shutting_down` instead.
    ///
    /// Like the other answers the gateway makes for an action, the problem carries `task`,
    /// the write's `idempotency_key` and `action_id` (see [`with_ids`]) — only when an action
    /// was recorded: a request the store could not record at all has none, and its log line
    /// says so instead of naming one.
    pub(super) fn store_unavailable(
        &self,
        spec: &ActionSpec,
        receipt: ActionReceipt,
        sent: bool,
        e: &EngineError,
    ) -> Execution {
        let recorded = receipt.action_id != 0;
        let detail = match (sent, recorded) {
            (true, _) => "backstop's store failed after an attempt of this action was sent; check the action's status before sending it again",
            (false, true) if receipt.idempotency_key.is_some() => "backstop's store could not record this write's first send, so nothing was sent; sending it again later with the same Idempotency-Key sends it as this action",
            (false, _) => "backstop's store could not record this request durably, so nothing was sent; sending it again later is safe",
        };
        self.store_unavailable_saying(spec, receipt, sent, e, detail)
    }

    /// [`Self::store_unavailable`] with its `detail`.
    pub(super) fn store_unavailable_saying(
        &self,
        spec: &ActionSpec,
        receipt: ActionReceipt,
        sent: bool,
        e: &EngineError,
        detail: &str,
    ) -> Execution {
        let action = (receipt.action_id != 0).then_some(receipt.action_id);
        if self.inner.shutting_down.load(Ordering::SeqCst)
            && matches!(e, EngineError::Store(StoreError::WriterGone))
        {
            let detail = if sent {
                "backstop is shutting down; an earlier attempt was sent, so the action stays recorded: check its status before sending it again"
            } else {
                "backstop is shutting down; nothing was sent for this request, so sending it again is safe"
            };
            let problem = with_ids(Problem::shutting_down_during(sent, detail), spec, &receipt);
            return problem_answer(receipt, problem);
        }
        let (task, agent, route) = (&spec.task_id, &spec.agent, &spec.route.template);
        match action {
            Some(action) => tracing::error!(
                action, %task, %agent, %route, sent, error = %e,
                "the store failed: the request is answered 503 store_unavailable"
            ),
            None => tracing::error!(
                %task, %agent, %route, sent, error = %e,
                "the store failed before the request was recorded (no action exists for it): the request is answered 503 store_unavailable"
            ),
        }
        let problem = with_ids(Problem::store_unavailable(sent, detail), spec, &receipt);
        problem_answer(receipt, problem)
    }

    /// A write whose admission the store could not commit (a damaged file, a full disk):
    /// `503 store_unavailable`. When the agent's own key already names its action for this
    /// same request (a same-key resend; the action is read, which needs no commit), this
    /// request was not sent again, but earlier attempts of the action may have been: the answer
    /// carries that action's id and attempts (the receipt), `sent` for the action as a whole,
    /// and says so instead of "nothing was sent". A new key, or an action that cannot be read,
    /// is answered as [`Self::refused_by_store`] answers.
    pub(super) async fn write_not_admitted(
        &self,
        e: EngineError,
        spec: &ActionSpec,
        key: &str,
    ) -> Execution {
        if spec.idempotency_key.is_none() {
            // A key minted for this request names nothing yet.
            return self.refused_by_store(e, spec, Some(key), None);
        }
        let (agent, by) = (spec.agent.clone(), key.to_owned());
        let route = &spec.route;
        let record = match self
            .inner
            .blocking(move |s| s.action_by_key(&agent, &by))
            .await
        {
            Ok(Some(record))
                if record.provider == route.provider
                    && record.method == route.method
                    && record.route == route.template
                    && record.payload_digest == spec.payload_digest =>
            {
                record
            }
            _ => return self.refused_by_store(e, spec, Some(key), None),
        };
        let id = record.id;
        let Ok(attempts) = self.inner.blocking(move |s| s.attempts(id)).await else {
            return self.refused_by_store(e, spec, Some(key), None);
        };
        let facts = writes::recovered_context(&attempts, 0);
        let receipt = ActionReceipt {
            action_id: id.0,
            attempts: facts.attempts,
            idempotency_key: Some(key.to_owned()),
            task: Some(record.task_id.clone()),
            provider_operation_id: record.provider_operation_id,
        };
        let detail = if facts.sent {
            "backstop's store cannot commit, so this request was not sent again; earlier attempts of the action under this Idempotency-Key were sent (Backstop-Attempts counts them), so check the action's status before sending it again: it is never resent blindly"
        } else {
            "backstop's store cannot commit, so this request was not sent; nothing was sent for the action under this Idempotency-Key either, so sending it again later with the same key is safe"
        };
        self.store_unavailable_saying(spec, receipt, facts.sent, &e, detail)
    }
}

/// Whether a store operation that failed may have been committed all the same. A storage
/// error (SQLite's, a full disk) undid the operation's transaction; a writer that went away
/// ([`StoreError::WriterGone`]: the store closing, or its thread ended before it answered) or a
/// store call that did not return ([`EngineError::Aborted`]) gives no word either way.
pub(super) fn may_have_committed(e: &EngineError) -> bool {
    matches!(
        e,
        EngineError::Aborted(_) | EngineError::Store(StoreError::WriterGone)
    )
}

/// An outcome for a request that was never recorded (`action_id` 0, no attempts).
pub(super) fn unrecorded(outcome: Outcome, detail: String) -> Execution {
    Execution::Outcome {
        receipt: ActionReceipt {
            action_id: 0,
            attempts: 0,
            idempotency_key: None,
            provider_operation_id: None,
            task: None,
        },
        outcome,
        context: OutcomeContext {
            next_safe: match outcome {
                Outcome::Rejected => vec![NextSafe::ChangeRequest, NextSafe::Abort],
                _ => vec![NextSafe::Abort],
            },
            ..OutcomeContext::default()
        },
        detail,
    }
}

/// An answer made as a problem response outside the outcome vocabulary (the store failed, the
/// gateway is stopping, a key reused for another request): carried as a response with the
/// receipt, rendered as it is.
pub(super) fn problem_answer(receipt: ActionReceipt, problem: Problem) -> Execution {
    Execution::Response {
        receipt,
        response: problem.into_response(),
    }
}

/// Whether an engine error is a failure of the store itself (a damaged file, a full disk, the
/// writer gone) rather than the store refusing the operation (a cancelled task, a reused key).
pub(super) fn is_store_failure(e: &EngineError) -> bool {
    match e {
        EngineError::Aborted(_) => true,
        EngineError::Store(e) => !matches!(
            e,
            StoreError::KeyReuse { .. }
                | StoreError::InvalidTransition { .. }
                | StoreError::NotFound { .. }
                | StoreError::Invalid { .. }
        ),
        EngineError::UnknownTask(_) | EngineError::ShuttingDown => false,
    }
}
