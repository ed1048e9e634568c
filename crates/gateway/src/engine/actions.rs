//! Actions run in the background for the action API and `Prefer: respond-async` (SPEC §11),
//! and the views an agent or operator reads of them.
//!
//! Why keep results in memory: the store never keeps a request or response body (SPEC §9), but
//! an agent that submitted work asynchronously must be able to fetch the provider's answer. The
//! engine therefore keeps the *completion* of each background action in memory, for the owning
//! agent only and within fixed bounds: at most [`KEPT_ACTIONS`] completions (the oldest is
//! forgotten first) and at most [`KEPT_BODY_LIMIT`] bytes of each response body (a longer body is
//! cut there and marked `body_truncated`). Nothing of it reaches the audit log. After a restart
//! the completions are gone; the stored state, outcome and context remain readable.

use std::{
    collections::{HashMap, VecDeque},
    sync::Arc,
};

use backstop_core::outcome::{Outcome, OutcomeContext};
use bytes::Bytes;
use tokio::sync::{oneshot, watch};

use super::{Engine, EngineError, Inner};
use crate::action::{ActionReceipt, ActionSpec, Execution};

/// Most background completions kept in memory (the oldest is forgotten first).
pub const KEPT_ACTIONS: usize = 1024;
/// Most bytes of one response body kept for the owning agent (256 KiB).
pub const KEPT_BODY_LIMIT: usize = 256 * 1024;

/// A provider response kept for the owning agent's retrieval (never audited).
#[derive(Debug, Clone)]
pub struct KeptResponse {
    /// HTTP status.
    pub status: u16,
    /// Response headers as (name, value) pairs (values that are not text are left out).
    pub headers: Vec<(String, String)>,
    /// The body, at most [`KEPT_BODY_LIMIT`] bytes.
    pub body: Bytes,
    /// Whether the body was longer than [`KEPT_BODY_LIMIT`] and was cut.
    pub body_truncated: bool,
}

/// How a background action ended.
#[derive(Debug, Clone)]
pub enum Completion {
    /// The provider's response.
    Response {
        /// Identity and accounting.
        receipt: ActionReceipt,
        /// The kept response.
        response: KeptResponse,
    },
    /// A gateway-made outcome.
    Outcome {
        /// Identity and accounting.
        receipt: ActionReceipt,
        /// The outcome.
        outcome: Outcome,
        /// Its SPEC §5 context.
        context: OutcomeContext,
        /// One sentence on why.
        detail: String,
    },
}

type Slot = watch::Sender<Option<Arc<Completion>>>;

/// The bounded registry of background completions.
#[derive(Default)]
pub(super) struct Kept {
    slots: HashMap<i64, Slot>,
    order: VecDeque<i64>,
}

impl Kept {
    fn slot(&mut self, id: i64) -> Slot {
        if let Some(slot) = self.slots.get(&id) {
            return slot.clone();
        }
        let (tx, _) = watch::channel(None);
        self.slots.insert(id, tx.clone());
        self.order.push_back(id);
        while self.order.len() > KEPT_ACTIONS {
            if let Some(old) = self.order.pop_front() {
                self.slots.remove(&old);
            }
        }
        tx
    }
}

impl Inner {
    fn kept_slot(&self, id: i64) -> Slot {
        self.kept
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .slot(id)
    }
}

async fn keep(execution: Execution) -> Completion {
    match execution {
        Execution::Response { receipt, response } => {
            let (parts, body) = response.into_parts();
            let (body, body_truncated) = match super::read_bounded(body, KEPT_BODY_LIMIT).await {
                Ok((bytes, _)) if bytes.len() > KEPT_BODY_LIMIT => {
                    (bytes.slice(..KEPT_BODY_LIMIT), true)
                }
                Ok((bytes, _)) => (bytes, false),
                Err(_) => (Bytes::new(), true),
            };
            let headers = parts
                .headers
                .iter()
                .filter_map(|(n, v)| {
                    v.to_str()
                        .ok()
                        .map(|v| (n.as_str().to_owned(), v.to_owned()))
                })
                .collect();
            Completion::Response {
                receipt,
                response: KeptResponse {
                    status: parts.status.as_u16(),
                    headers,
                    body,
                    body_truncated,
                },
            }
        }
        Execution::Outcome {
            receipt,
            outcome,
            context,
            detail,
        } => Completion::Outcome {
            receipt,
            outcome,
            context,
            detail,
        },
        Execution::InFlight { receipt } => Completion::Outcome {
            receipt,
            outcome: Outcome::Conflict,
            context: OutcomeContext::default(),
            detail: "an action with this idempotency key is still in flight".to_owned(),
        },
    }
}

impl Engine {
    /// Starts an action in the background and returns its store id as soon as it is recorded
    /// (or found under the agent's idempotency key). Its completion is kept for
    /// [`Engine::completion`] within the bounds of the module docs.
    ///
    /// # Errors
    /// The [`Execution`] of an action refused before it was recorded (an invalid key, a
    /// cancelled task, a key reused with another payload, the gateway shutting down).
    pub async fn submit(&self, spec: ActionSpec) -> Result<i64, Execution> {
        let (id_tx, id_rx) = oneshot::channel();
        let (refused_tx, refused_rx) = oneshot::channel();
        let engine = self.clone();
        tokio::spawn(async move {
            let execution = engine.execute_notifying(spec, Some(id_tx)).await;
            let id = execution.receipt().action_id;
            if id == 0 {
                let _ = refused_tx.send(execution);
                return;
            }
            let slot = engine.inner.kept_slot(id);
            let completion = keep(execution).await;
            slot.send_replace(Some(Arc::new(completion)));
        });
        match id_rx.await {
            Ok(id) => {
                // Make the slot exist before the caller can ask for it.
                let _ = self.inner.kept_slot(id);
                Ok(id)
            }
            Err(_) => match refused_rx.await {
                Ok(execution) => Err(execution),
                Err(_) => Err(super::unrecorded(
                    Outcome::Cancelled,
                    "the action ended before it was recorded".to_owned(),
                )),
            },
        }
    }

    /// The kept completion of a background action: `None` when it was not run in the background
    /// (a proxied call) or was forgotten (bounds, restart); otherwise a receiver whose value
    /// becomes `Some` when the action completes.
    pub fn completion(&self, id: i64) -> Option<watch::Receiver<Option<Arc<Completion>>>> {
        self.inner
            .kept
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .slots
            .get(&id)
            .map(watch::Sender::subscribe)
    }

    /// Reads an action, its attempts and its task from the store.
    ///
    /// # Errors
    /// A store failure.
    pub async fn action_view(
        &self,
        id: i64,
    ) -> Result<
        Option<(
            backstop_store::ActionRecord,
            Vec<backstop_store::AttemptRecord>,
        )>,
        EngineError,
    > {
        let action = backstop_store::ActionId(id);
        let record = self.inner.blocking(move |s| s.action(action)).await?;
        let Some(record) = record else {
            return Ok(None);
        };
        let attempts = self.inner.blocking(move |s| s.attempts(action)).await?;
        Ok(Some((record, attempts)))
    }
}

/// What [`Engine::apply_decision`] did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DecisionApplied {
    /// Whether the decision changed anything beyond being recorded.
    pub applied: bool,
    /// One sentence on what happened (or why nothing did).
    pub detail: String,
    /// The action's outcome afterwards, when it changed.
    pub outcome: Option<String>,
}

impl Engine {
    /// Carries out an operator's recorded decision on an escalated action (SPEC §8):
    /// `query_status` runs the reconciliation lookup now and records the verdict (found →
    /// `succeeded`, reconciled, audited); `abort` ends the action `cancelled`; `wait`,
    /// `raise_quota` and `change_plan` leave it as it is. `retry_same_key` and `send_new` are not
    /// carried out: the payload is never stored, so the agent must resubmit (with the same
    /// `Idempotency-Key` for `retry_same_key`, with a new one for `send_new`).
    pub async fn apply_decision(
        &self,
        action: backstop_store::ActionId,
        effect: &backstop_core::escalation::DecisionEffect,
    ) -> DecisionApplied {
        use backstop_core::escalation::DecisionEffect;
        let inner = &self.inner;
        let not = |detail: &str| DecisionApplied {
            applied: false,
            detail: detail.to_owned(),
            outcome: None,
        };
        let record = match inner.blocking(move |s| s.action(action)).await {
            Ok(Some(record)) => record,
            Ok(None) => return not("the escalated action is not in the store"),
            Err(e) => return not(&format!("the action could not be read: {e}")),
        };
        match effect {
            DecisionEffect::QueryStatus => {
                let facts = inner.facts_of(&record, backstop_core::pacing::Priority::Interactive);
                let verdict = inner.lookup(&facts, None).await;
                match verdict {
                    backstop_core::reconcile::LookupVerdict::Found { operation_id } => {
                        let now = backstop_core::clock::Clock::now(&inner.clock);
                        let op = operation_id.clone();
                        match inner
                            .blocking(move |s| s.record_reconciled(action, op, now))
                            .await
                        {
                            Ok(()) => DecisionApplied {
                                applied: true,
                                detail: match operation_id {
                                    Some(op) => format!("the provider has this write as `{op}`; the action is succeeded (reconciled)"),
                                    None => "the provider has this write; the action is succeeded (reconciled)".to_owned(),
                                },
                                outcome: Some("succeeded".to_owned()),
                            },
                            Err(e) => not(&format!("found, but the reconciliation could not be recorded: {e}")),
                        }
                    }
                    backstop_core::reconcile::LookupVerdict::NotFound => DecisionApplied {
                        applied: true,
                        detail: "the lookup did not find the write; the action stays escalated".to_owned(),
                        outcome: None,
                    },
                    backstop_core::reconcile::LookupVerdict::Inconclusive { reason } => {
                        DecisionApplied {
                            applied: true,
                            detail: format!("the lookup was inconclusive ({reason}); the action stays escalated"),
                            outcome: None,
                        }
                    }
                }
            }
            DecisionEffect::Abort => {
                inner
                    .held
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .remove(&action.0);
                let finish = super::Finish {
                    outcome: backstop_store::Outcome::Cancelled,
                    context: serde_json::json!({
                        "sent": true,
                        "next_safe": [{"option": "abort"}],
                        "detail": "aborted by an operator's decision; nothing more is sent"
                    }),
                    response: None,
                };
                let now = backstop_core::clock::Clock::now(&inner.clock);
                match inner
                    .blocking(move |s| s.finish_action(action, finish, now))
                    .await
                {
                    Ok(()) => DecisionApplied {
                        applied: true,
                        detail: "the action is cancelled; nothing more is sent".to_owned(),
                        outcome: Some("cancelled".to_owned()),
                    },
                    Err(e) => not(&format!("the action could not be ended: {e}")),
                }
            }
            DecisionEffect::RetrySameKey { idempotency_key } => not(&format!(
                "not carried out: backstop does not keep payloads, so it cannot resend; the agent must resubmit the same payload with Idempotency-Key `{idempotency_key}`"
            )),
            DecisionEffect::SendNew => not(
                "not carried out: backstop does not keep payloads; the agent must submit the payload as a new action with a new Idempotency-Key",
            ),
            DecisionEffect::Wait { .. } | DecisionEffect::RaiseQuota | DecisionEffect::ChangePlan => {
                not("the action stays open as decided")
            }
        }
    }
}
