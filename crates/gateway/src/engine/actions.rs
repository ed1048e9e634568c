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
                // A write whose provider cut the body: the bytes received, marked as such.
                Ok((bytes, _)) => (
                    bytes,
                    parts
                        .headers
                        .contains_key(crate::wire::BODY_TRUNCATED_HEADER),
                ),
                Err(_) => (Bytes::new(), true),
            };
            // As the door would have passed them on: not the provider's hop-by-hop headers.
            let headers = crate::wire::end_to_end_pairs(&parts.headers);
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

/// What [`Engine::submit`] started for a request: the action it runs in the background, or the
/// action already running under its idempotency key that it joined.
#[derive(Debug, Clone)]
pub struct Submitted {
    /// The action: its id, the task it belongs to when it was recorded before (a same-key
    /// resend may name another task), the attempts it made before this request and the
    /// idempotency key in effect for a write (the agent's, or the one minted for it).
    pub receipt: ActionReceipt,
    /// Whether this request joined an action already running under its key: nothing new runs
    /// for it, and the running action's outcome is its outcome.
    pub joined: bool,
}

/// What a background submission learns of its request: that it runs (or joined) an action, or
/// the answer it got without either.
pub(crate) enum Told {
    /// The request runs an action, or joined one running.
    Runs(Submitted),
    /// The request was answered without a run of its own: a replayed outcome, a write the SPEC
    /// §6 rule settled or escalated, `409` for an action unfinished but not running, a refusal.
    Answered(Execution),
}

/// Tells a background submission ([`Engine::submit`]) that its request runs an action (or
/// joined one running) as soon as that is known. A request answered otherwise leaves it untold,
/// and the submission is answered as a request without `Prefer: respond-async` would be: a
/// resend that finds its key's action and runs nothing is never told it was accepted.
pub(crate) struct Notify(std::sync::Mutex<Option<oneshot::Sender<Told>>>);

impl Notify {
    fn new(tx: oneshot::Sender<Told>) -> Notify {
        Notify(std::sync::Mutex::new(Some(tx)))
    }

    fn take(&self) -> Option<oneshot::Sender<Told>> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take()
    }

    /// The request runs the action of `receipt` (`joined`: it joined that action, running).
    pub(super) fn runs(&self, receipt: ActionReceipt, joined: bool) {
        if let Some(tx) = self.take() {
            let _ = tx.send(Told::Runs(Submitted { receipt, joined }));
        }
    }

    /// Hands `execution` to the submission when it was told nothing yet (`None`); gives it
    /// back otherwise: it is the outcome of the run the submission was told of.
    fn answer(&self, execution: Execution) -> Option<Execution> {
        match self.take() {
            Some(tx) => {
                let _ = tx.send(Told::Answered(execution));
                None
            }
            None => Some(execution),
        }
    }
}

impl Engine {
    /// Starts an action in the background and returns as soon as this request runs it — a new
    /// action recorded, or one recorded before under the agent's key taken over (a write
    /// reopened, or recorded and never sent) — or joined the action running under its key.
    /// Its completion is kept for [`Engine::completion`] within the bounds of the module docs.
    ///
    /// # Errors
    /// The [`Execution`] of a request that runs nothing, answered as without the background:
    /// refused before it was recorded (an invalid key, a cancelled task, a key reused with
    /// another payload, the gateway shutting down), or answered about the action found under
    /// its key — a finished action's outcome replayed (a `429` with the `Retry-After` left
    /// before the instant its answer named), a write the SPEC §6 rule settled or escalated,
    /// `409` for an action unfinished but not running.
    pub async fn submit(&self, spec: ActionSpec) -> Result<Submitted, Execution> {
        let (tx, rx) = oneshot::channel();
        let engine = self.clone();
        tokio::spawn(async move {
            let notify = Notify::new(tx);
            let execution = engine.execute_notifying(&spec, Some(&notify)).await;
            let Some(execution) = notify.answer(execution) else {
                return;
            };
            let slot = engine.inner.kept_slot(execution.receipt().action_id);
            let completion = keep(execution).await;
            slot.send_replace(Some(Arc::new(completion)));
        });
        match rx.await {
            Ok(Told::Runs(submitted)) => {
                // Make the slot exist before the caller can ask for it.
                let _ = self.inner.kept_slot(submitted.receipt.action_id);
                Ok(submitted)
            }
            Ok(Told::Answered(execution)) => Err(execution),
            Err(_) => Err(super::unrecorded(
                Outcome::Cancelled,
                "the action ended before it was recorded".to_owned(),
            )),
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
    /// `retry_same_key` or `send_new` needs the request, and the gateway no longer holds it
    /// (it restarted since the escalation): the agent must resubmit (answered `409`).
    pub request_not_held: bool,
    /// The new action `send_new` created, if any.
    pub new_action: Option<i64>,
    /// What the provider's lookup answered to a `query_status`, `None` for other decisions.
    pub lookup: Option<LookupAnswer>,
}

/// What a `query_status` lookup answered (SPEC §6 reconciliation, asked by an operator).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LookupAnswer {
    /// `found`, `not_found` or `inconclusive` (or `not_run` when no engine could ask).
    pub verdict: String,
    /// Why the lookup was inconclusive (e.g. the provider answered 503), in words.
    pub reason: Option<String>,
    /// The provider's operation id when found and named.
    pub provider_operation_id: Option<String>,
}

impl LookupAnswer {
    fn found(provider_operation_id: Option<String>) -> Self {
        LookupAnswer {
            verdict: "found".to_owned(),
            reason: None,
            provider_operation_id,
        }
    }

    /// Whether the lookup found the write (only then does a `query_status` close its escalation).
    pub fn is_found(&self) -> bool {
        self.verdict == "found"
    }
}

/// How long an operator's `retry_same_key` or `send_new` waits for the resent write's outcome
/// before answering that it is still running (10 s).
pub const DECISION_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

impl DecisionApplied {
    fn not(detail: &str) -> Self {
        DecisionApplied {
            applied: false,
            detail: detail.to_owned(),
            outcome: None,
            request_not_held: false,
            new_action: None,
            lookup: None,
        }
    }
}

impl Engine {
    /// Carries out an operator's decision on an escalated action (SPEC §8):
    /// `query_status` runs the reconciliation lookup now (audited as `reconciliation_lookup`) and
    /// answers what it returned in [`DecisionApplied::lookup`]; only `found` changes the action
    /// (`succeeded`, reconciled, audited) — `not_found` and `inconclusive` leave it escalated, and
    /// the caller keeps the escalation open (see [`crate::escalations`]); `abort` ends the action `cancelled`; `wait`,
    /// `raise_quota` and `change_plan` leave it as it is.
    ///
    /// `retry_same_key` reopens the action in the store ([`backstop_store::Store::reopen_for_retry`],
    /// audited with `decided_by`) and sends the held request again as the SAME action with the
    /// SAME key. `send_new` (validated before: the second side effect was confirmed) submits the
    /// held request as a NEW action with a newly minted key (and a new external reference when
    /// the route reconciles by one). Both wait up to [`DECISION_WAIT`] for the outcome. The
    /// request is held in memory only: after a restart both answer `request_not_held`, and the
    /// agent resubmits — with the same `Idempotency-Key` for `retry_same_key` (the reopened
    /// action then sends again under it), with a new key for `send_new`.
    pub async fn apply_decision(
        &self,
        action: backstop_store::ActionId,
        effect: &backstop_core::escalation::DecisionEffect,
        decided_by: &str,
    ) -> DecisionApplied {
        use backstop_core::escalation::DecisionEffect;
        let inner = &self.inner;
        let not = DecisionApplied::not;
        let record = match inner.blocking(move |s| s.action(action)).await {
            Ok(Some(record)) => record,
            Ok(None) => return not("the escalated action is not in the store"),
            Err(e) => return not(&format!("the action could not be read: {e}")),
        };
        match effect {
            DecisionEffect::QueryStatus => self.query_status_decided(action, &record).await,
            DecisionEffect::Abort
                if record.outcome.is_some_and(|o| {
                    !matches!(
                        o,
                        backstop_store::Outcome::Escalated
                            | backstop_store::Outcome::ReconciliationRequired
                    )
                }) =>
            {
                // An escalation opened beside an outcome (a provider boundary beyond the
                // budget): the action already ended and nothing more is sent.
                inner
                    .held
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .remove(&action.0);
                DecisionApplied {
                    applied: true,
                    ..not(&format!(
                        "the action already ended `{}`; nothing more is sent",
                        record.outcome.map_or("unknown", |o| o.as_str())
                    ))
                }
            }
            DecisionEffect::Abort => self.abort_decided(action, &record).await,
            DecisionEffect::RetrySameKey { idempotency_key } => {
                self.retry_same_key(action, idempotency_key, decided_by)
                    .await
            }
            DecisionEffect::SendNew => self.send_new(action).await,
            DecisionEffect::Wait { .. }
            | DecisionEffect::RaiseQuota
            | DecisionEffect::ChangePlan => match record.outcome {
                // An escalation opened beside an outcome: nothing is held to send later.
                Some(outcome)
                    if !matches!(
                        outcome,
                        backstop_store::Outcome::Escalated
                            | backstop_store::Outcome::ReconciliationRequired
                    ) =>
                {
                    not(&format!(
                        "the action already ended `{}`; backstop sends nothing more for it: the agent resubmits when the decision allows",
                        outcome.as_str()
                    ))
                }
                _ => not("the action stays open as decided"),
            },
        }
    }

    /// `query_status`: the escalated write `record` (`action`) is looked up at the provider;
    /// found, it is reconciled `succeeded`; otherwise it stays escalated.
    async fn query_status_decided(
        &self,
        action: backstop_store::ActionId,
        record: &backstop_store::ActionRecord,
    ) -> DecisionApplied {
        let inner = &self.inner;
        let not = DecisionApplied::not;
        let facts = inner
            .stored_facts(record, Some(backstop_core::pacing::Priority::Interactive))
            .await;
        let Ok(verdict) = inner.lookup(&facts, None).await else {
            // Nothing was asked: the status query is recorded as not run.
            return DecisionApplied {
                lookup: Some(LookupAnswer {
                    verdict: "not_run".to_owned(),
                    reason: Some(
                        "backstop is shutting down; no lookup was sent".to_owned(),
                    ),
                    provider_operation_id: None,
                }),
                ..not("backstop is shutting down: no lookup was sent; the action stays escalated and the escalation stays open")
            };
        };
        match verdict {
            backstop_core::reconcile::LookupVerdict::Found { operation_id } => {
                let now = backstop_core::clock::Clock::now(&inner.clock);
                let op = operation_id.clone();
                let lookup = LookupAnswer::found(operation_id.clone());
                match inner
                    .blocking(move |s| s.record_reconciled(action, op, now))
                    .await
                {
                    Ok(()) => DecisionApplied {
                        applied: true,
                        outcome: Some("succeeded".to_owned()),
                        lookup: Some(lookup),
                        ..not(&match operation_id {
                            Some(op) => format!("the provider has this write as `{op}`; the action is succeeded (reconciled)"),
                            None => "the provider has this write; the action is succeeded (reconciled)".to_owned(),
                        })
                    },
                    Err(e) => DecisionApplied {
                        lookup: Some(lookup),
                        ..not(&format!("found, but the reconciliation could not be recorded: {e}; the escalation stays open"))
                    },
                }
            }
            backstop_core::reconcile::LookupVerdict::NotFound => DecisionApplied {
                lookup: Some(LookupAnswer {
                    verdict: "not_found".to_owned(),
                    reason: None,
                    provider_operation_id: None,
                }),
                ..not("the lookup did not find the write; the action stays escalated and the escalation stays open")
            },
            backstop_core::reconcile::LookupVerdict::Inconclusive { reason } => {
                DecisionApplied {
                    lookup: Some(LookupAnswer {
                        verdict: "inconclusive".to_owned(),
                        reason: Some(reason.clone()),
                        provider_operation_id: None,
                    }),
                    ..not(&format!("the lookup was inconclusive ({reason}); the action stays escalated and the escalation stays open"))
                }
            }
        }
    }

    /// `abort` of the open action `record` (`action`): it ends `cancelled`, its held request
    /// dropped; nothing more is sent.
    async fn abort_decided(
        &self,
        action: backstop_store::ActionId,
        record: &backstop_store::ActionRecord,
    ) -> DecisionApplied {
        let inner = &self.inner;
        let not = DecisionApplied::not;
        inner
            .held
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(&action.0);
        // The context says what the action's attempts did, as every outcome's does.
        let attempts = inner.blocking(move |s| s.attempts(action)).await;
        let mut context = match &attempts {
            Ok(attempts) => {
                let waited = super::writes::recorded_wait_ms(record, attempts);
                serde_json::to_value(super::writes::recovered_context(attempts, waited))
                    .unwrap_or_default()
            }
            Err(_) => serde_json::json!({ "sent": true }),
        };
        if let Some(members) = context.as_object_mut() {
            members.insert(
                "next_safe".to_owned(),
                serde_json::json!([{"option": "abort"}]),
            );
            members.insert(
                "detail".to_owned(),
                "aborted by an operator's decision; nothing more is sent".into(),
            );
        }
        let finish = super::Finish {
            outcome: backstop_store::Outcome::Cancelled,
            context,
            response: None,
        };
        let now = backstop_core::clock::Clock::now(&inner.clock);
        match inner
            .blocking(move |s| s.finish_action(action, finish, now))
            .await
        {
            Ok(()) => DecisionApplied {
                applied: true,
                outcome: Some("cancelled".to_owned()),
                ..not("the action is cancelled; nothing more is sent")
            },
            Err(e) => not(&format!("the action could not be ended: {e}")),
        }
    }
}

impl Engine {
    /// The held request of an escalated write, taken out of memory.
    fn take_held(&self, action: backstop_store::ActionId) -> Option<ActionSpec> {
        self.inner
            .held
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(&action.0)
    }

    /// `retry_same_key`: reopen, then send the held request again under its original key.
    async fn retry_same_key(
        &self,
        action: backstop_store::ActionId,
        key: &str,
        decided_by: &str,
    ) -> DecisionApplied {
        let inner = &self.inner;
        let (who, now) = (
            decided_by.to_owned(),
            backstop_core::clock::Clock::now(&inner.clock),
        );
        if let Err(e) = inner
            .blocking(move |s| s.reopen_for_retry(action, &who, now))
            .await
        {
            return DecisionApplied::not(&format!("the action could not be reopened: {e}"));
        }
        let Some(held) = self.take_held(action) else {
            return DecisionApplied {
                request_not_held: true,
                ..DecisionApplied::not(&format!(
                    "the decision is recorded and action {} is reopened, but backstop no longer holds its request (the gateway restarted since the escalation, and a write's request is kept only until the write ends); the agent must resubmit the same payload with Idempotency-Key `{key}`: that request is sent as this same action, under this same key",
                    action.0
                ))
            };
        };
        match self.submit(held).await {
            Ok(submitted) => {
                let id = submitted.receipt.action_id;
                self.await_decided(
                    id,
                    None,
                    &format!("sent again as the same action {id} with Idempotency-Key `{key}`"),
                )
                .await
            }
            // The reopened action answered without a send (the SPEC §6 rule settled it).
            Err(execution) if execution.receipt().action_id == action.0 => {
                self.await_decided(
                    action.0,
                    None,
                    &format!("not sent again: {}", refusal(&execution)),
                )
                .await
            }
            Err(execution) => DecisionApplied::not(&format!(
                "the held request could not be sent again: {}",
                refusal(&execution)
            )),
        }
    }

    /// `send_new`: submit the held request as a new action with a new key (and reference).
    async fn send_new(&self, action: backstop_store::ActionId) -> DecisionApplied {
        let Some(mut spec) = self.take_held(action) else {
            return DecisionApplied {
                request_not_held: true,
                ..DecisionApplied::not(&format!(
                    "the decision is recorded, but backstop no longer holds the request of action {} (the gateway restarted since the escalation, and a write's request is kept only until the write ends); the agent must submit the payload as a new action with a new Idempotency-Key",
                    action.0
                ))
            };
        };
        let route = &spec.route;
        if let Some(name) = self
            .inner
            .policy
            .providers
            .get(&route.provider)
            .and_then(|p| p.idempotency_header.as_deref())
        {
            spec.request.headers.remove(name);
        }
        if let Some(pointer) = route
            .reconcile
            .as_ref()
            .filter(|rc| rc.by == backstop_core::policy::ReconcileBy::ExternalReference)
            .and_then(|rc| rc.external_reference_pointer.as_deref())
        {
            match clear_reference(&spec.request.body, pointer) {
                Ok(body) => spec.request.body = body,
                Err(reason) => {
                    return DecisionApplied::not(&format!(
                        "the held payload's external reference at `{pointer}` could not be replaced: {reason}"
                    ))
                }
            }
        }
        spec.idempotency_key = None;
        match self.submit(spec).await {
            Ok(submitted) => {
                let id = submitted.receipt.action_id;
                self.await_decided(
                    id,
                    Some(id),
                    &format!("sent as the new action {id} with a new Idempotency-Key; escalated action {} stays escalated", action.0),
                )
                .await
            }
            Err(execution) => DecisionApplied::not(&format!(
                "the new action was not accepted: {}",
                refusal(&execution)
            )),
        }
    }

    /// Waits up to [`DECISION_WAIT`] for action `id` to complete, then reports its outcome.
    async fn await_decided(&self, id: i64, new_action: Option<i64>, what: &str) -> DecisionApplied {
        if let Some(mut rx) = self.completion(id) {
            let _ = tokio::time::timeout(DECISION_WAIT, rx.wait_for(Option::is_some)).await;
        }
        let action = backstop_store::ActionId(id);
        let outcome = match self.inner.blocking(move |s| s.action(action)).await {
            Ok(Some(record)) => record.outcome.map(|o| o.as_str().to_owned()),
            _ => None,
        };
        let detail = match &outcome {
            Some(outcome) => format!("{what}; outcome `{outcome}`"),
            None => format!("{what}; still running (see GET /v1/actions/{id})"),
        };
        DecisionApplied {
            applied: true,
            detail,
            outcome,
            request_not_held: false,
            new_action,
            lookup: None,
        }
    }
}

/// One sentence on why a submitted request was answered without a run: refused before being
/// recorded, or answered about the action found under its key.
fn refusal(execution: &Execution) -> String {
    match execution {
        Execution::Outcome {
            outcome, detail, ..
        } => format!("{outcome}: {detail}"),
        Execution::Response { response, .. } => format!("HTTP {}", response.status()),
        Execution::InFlight { .. } => "an action with this key is in flight".to_owned(),
    }
}

/// The payload with the value at `pointer` (RFC 6901) set to `null`, so that a new external
/// reference is written there for a new action.
fn clear_reference(body: &Bytes, pointer: &str) -> Result<Bytes, String> {
    let mut doc: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("the payload is not JSON: {e}"))?;
    if let Some(value) = doc.pointer_mut(pointer) {
        *value = serde_json::Value::Null;
    }
    serde_json::to_vec(&doc)
        .map(Bytes::from)
        .map_err(|e| format!("the payload could not be written back: {e}"))
}

impl Inner {
    /// Opens an escalation for a write that already ended with an outcome (SPEC §8, §13 step 5):
    /// a provider boundary beyond the remaining wait or deadline (`remaining_wait_exceeds_deadline`)
    /// hands the write to a human with the boundary as `retry_not_before`, while the action keeps
    /// its `budget_exhausted`/`deadline_exhausted` outcome. The case file is built from the stored
    /// action and attempts (sanitized by [`backstop_core::escalation::CaseFile::build`]); the
    /// options are those the core offers for the reason (`wait`, `change_plan`, `abort`).
    ///
    /// # Errors
    /// The action is not in the store, the case file could not be built, or the store failed.
    pub(super) async fn escalate_beside_outcome(
        &self,
        action: backstop_store::ActionId,
        reason: backstop_core::escalation::EscalationReason,
        detail: &str,
        retry_not_before: Option<jiff::Timestamp>,
    ) -> Result<backstop_store::EscalationId, EngineError> {
        let (record, facts) = self.ended_action(action).await?;
        let idempotency_key =
            (!facts.idempotency_key.is_empty()).then(|| facts.idempotency_key.clone());
        let ended = record.outcome.map_or("ended", |o| o.as_str());
        let escalation = self
            .open_beside_outcome(
                &facts,
                ended,
                reason,
                detail,
                retry_not_before,
                idempotency_key,
            )
            .await?;
        tracing::warn!(
            action = action.0,
            escalation = escalation.0,
            task = %facts.task_id,
            reason = reason.as_str(),
            "escalated beside the outcome: a human must decide"
        );
        Ok(escalation)
    }

    /// The stored record of `action`, which has ended, and its facts for a case file (at
    /// interactive priority: a person reads it).
    ///
    /// # Errors
    /// The action is not in the store, or the store failed.
    pub(super) async fn ended_action(
        &self,
        action: backstop_store::ActionId,
    ) -> Result<(backstop_store::ActionRecord, super::writes::WriteFacts), EngineError> {
        let record = self
            .blocking(move |s| s.action(action))
            .await?
            .ok_or_else(|| {
                EngineError::Aborted(format!("action {} is not in the store", action.0))
            })?;
        let facts = self
            .stored_facts(&record, Some(backstop_core::pacing::Priority::Interactive))
            .await;
        Ok((record, facts))
    }

    /// Builds the case file of the write `facts` describes for `reason` (with `detail`,
    /// `retry_not_before` and the agent `idempotency_key` it names), marks it opened beside the
    /// outcome named `ended`, and opens it as an escalation beside that outcome, at the case
    /// file's opening instant.
    ///
    /// # Errors
    /// The case file could not be built, or the store failed.
    pub(super) async fn open_beside_outcome(
        &self,
        facts: &super::writes::WriteFacts,
        ended: &str,
        reason: backstop_core::escalation::EscalationReason,
        detail: &str,
        retry_not_before: Option<jiff::Timestamp>,
        idempotency_key: Option<String>,
    ) -> Result<backstop_store::EscalationId, EngineError> {
        let action = facts.action;
        let case = self
            .case_file(facts, reason, detail, retry_not_before, idempotency_key)
            .await?
            .beside_outcome(ended);
        let at = case.opened_at;
        let json = case.to_json();
        self.blocking(move |s| s.open_escalation_beside_outcome(action, json, at))
            .await
    }
}

impl Engine {
    /// After a write ended `budget_exhausted`/`deadline_exhausted` because the provider's
    /// boundary lies beyond its remaining wait or deadline: opens a
    /// `remaining_wait_exceeds_deadline` escalation beside the outcome (with the boundary as
    /// `retry_not_before`) and names it in the outcome's detail. A failure to open it is logged
    /// and said in the detail; the outcome stands either way.
    pub(super) async fn escalate_stopped_write(
        &self,
        action: backstop_store::ActionId,
        detail: &str,
        boundary: Option<jiff::Timestamp>,
        execution: &mut Execution,
    ) {
        let opened = self
            .inner
            .escalate_beside_outcome(
                action,
                backstop_core::escalation::EscalationReason::RemainingWaitExceedsDeadline,
                detail,
                boundary,
            )
            .await;
        let note = match opened {
            Ok(escalation) => format!(
                "; escalation {} is open for an operator (remaining_wait_exceeds_deadline)",
                escalation.0
            ),
            Err(e) => {
                tracing::warn!(action = action.0, error = %e, "could not open the escalation");
                format!("; the escalation could not be opened: {e}")
            }
        };
        if let Execution::Outcome { detail, .. } = execution {
            detail.push_str(&note);
        }
    }
}
