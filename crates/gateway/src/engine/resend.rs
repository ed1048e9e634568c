//! A same-key resend of a finished write that backstop's own answer told to come back
//! (SPEC §5, §6, §8).
//!
//! Why: toward agents backstop is idempotent — a same-key, same-payload resend of a completed
//! action replays its stored outcome (SPEC §6). But some of backstop's own outcomes are not
//! completions the agent must live with; they are advice to send the same request again later:
//!
//! - an honest `Retry-After` (with `x-should-retry: false`, so the resend is the agent's
//!   explicit choice): a `budget_exhausted`, `quota_exhausted` or `scope_saturated` outcome
//!   whose `next_safe` holds `wait_until` (see [`crate::problem::resend_advised_at`]). An agent
//!   resends exactly that request, under exactly that key, once the delay is over;
//! - an escalation opened beside the outcome (`remaining_wait_exceeds_deadline`,
//!   `shared_quota_exhausted`, `account_configuration`) that an operator decided `wait`,
//!   `raise_quota` or `change_plan`: its case file tells the agent to resubmit under the same
//!   key.
//!
//! Replaying such an outcome forever (`retry-after: 1`, nothing ever sent) would break that
//! promise — Stripe does not keep 429 results for its keys either. So [`verdict`] decides, for
//! a same-key, same-payload resend of a FINISHED write:
//!
//! 1. the latest escalation of the action was decided `abort`: the outcome stays — replayed,
//!    without its `wait_until` (so no `Retry-After`): nothing is sent for the
//!    action any more;
//! 2. the outcome advised `wait_until` T: before T it is replayed (with the `Retry-After` left
//!    until T); from T on the action is reopened;
//! 3. the outcome is backpressure met before anything was sent — `scope_saturated` (the
//!    scope's delayed queue was full), `budget_exhausted` or `quota_exhausted` with no attempt
//!    at all (e.g. the wait for a concurrency slot outlasted the wait budget) — advising no
//!    instant, and the action has no escalation: the action is reopened at once. Nothing
//!    reached the provider, so the refusal says nothing final about the action; the resend is
//!    a fresh try of it under the same key (refused again if the scope is still full);
//! 4. its latest escalation was opened beside the outcome and decided `wait`, `raise_quota` or
//!    `change_plan`, and no attempt was sent since the decision: the action is reopened — for
//!    `wait` not before the case file's `retry_not_before` when it names one (replayed until
//!    then). A decision reopens the action once: a later resend needs a new advice or decision;
//! 5. the write ended `cancelled` while no attempt of it was left unsettled and it has no
//!    escalation (its caller went away before a send, a restart closed it), and its task is not
//!    cancelled: the action is reopened at once — nothing at the provider binds the key to an
//!    outcome, so the agent never needs a new key for it (a cancelled task's writes stay
//!    cancelled: replayed);
//! 6. anything else — `succeeded`, `rejected`, `conflict`, `escalated`,
//!    `reconciliation_required`, `circuit_open`, an outcome without advice — is replayed exactly
//!    as before, with no extra store read.
//!
//! Reopening is what an operator's `retry_same_key` does, not a second mechanism: the store
//! moves the action to `reopened` ([`backstop_store::Store::reopen_for_resend`], audited
//! `action_reopened` with the outcome set aside, the advised instant as `boundary`, the decided
//! escalation, and [`backstop_store::REOPENED_BY_RESEND`] as `source`), and the engine sends
//! this request as the SAME action under the SAME key (`Engine::run` takes a `reopened` action
//! over): its earlier attempts keep counting, the class budget (attempts, wait — capped by this
//! request's `Prefer: wait`) is fresh for this request, and the task's deadline, the scope retry
//! quota and the circuit breaker are charged as for any attempt.
//!
//! Safety (SPEC §6: `uncertain` must be reconciled first). When an attempt of the action is
//! unsettled (`uncertain` — sent, no definite answer — and no later answer under the same key
//! settled it: [`writes::unsettled_in`]), the rule an uncertain write follows runs BEFORE the
//! action is reopened, as the attempt loop runs it ([`Inner::reconcile_uncertain`]): with a
//! lookup the provider is asked — found → the action ends `succeeded` (reconciled) and nothing
//! is sent; not found (or no lookup) and the provider honours the key → reopened and sent under
//! the same key; otherwise → not reopened: the action is escalated (`side_effect_unknown`),
//! this request is held for the operator's decision, and nothing is sent. So a resend is sent
//! only where the engine itself would have judged a same-key resend safe.
//!
//! Concurrency: the resend that reopens first leads the action's flight, then reads the action
//! again and judges afresh; concurrent resends of the same action join it (its answer is
//! theirs), as layered retries of any action in flight do.

use backstop_core::{
    clock::Clock,
    escalation::{CaseFile, DecisionOption, EscalationReason},
    outcome::{NextSafe, Outcome, OutcomeContext},
};
use backstop_store::{
    ActionId, ActionRecord, ActionState, AttemptRecord, EscalationId, EscalationRecord,
};
use jiff::Timestamp;

use super::{core_outcome, from_shared, is_store_failure, writes, Engine, Notify, HELD_REQUESTS};
use crate::{
    action::{ActionReceipt, ActionSpec, Execution},
    coalesce::{FlightKey, LeaderGuard, Role, Shared},
    transport::AttemptRequest,
};

/// What a same-key, same-payload resend of a finished write does (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Replay the stored outcome as it is.
    Replay,
    /// Replay the stored outcome without its `wait_until`: an operator's `abort` (or the store:
    /// a cancelled task) closed the action, and nothing is sent for it any more.
    ReplayClosed,
    /// Reopen the action under its key and send this request as it.
    Reopen {
        /// The instant the outcome (or the decided `wait`) named, if any.
        advised: Option<Timestamp>,
        /// The decided escalation the reopen follows, if any.
        escalation: Option<EscalationId>,
    },
}

/// Whether a finished action's outcome is one a resend can follow (the outcomes an escalation
/// opens beside, those answered `429` with a `wait_until`, and `cancelled`): anything else is replayed
/// without reading more of the store.
pub(super) fn may_follow(record: &ActionRecord) -> bool {
    matches!(
        record.outcome,
        Some(
            backstop_store::Outcome::BudgetExhausted
                | backstop_store::Outcome::DeadlineExhausted
                | backstop_store::Outcome::QuotaExhausted
                | backstop_store::Outcome::ScopeSaturated
                | backstop_store::Outcome::Cancelled
        )
    )
}

/// The instant the stored outcome of `record` told the agent to send again from (its
/// `next_safe`'s `wait_until` for an outcome answered `429`), if any.
fn advised_at(record: &ActionRecord) -> Option<Timestamp> {
    let outcome = core_outcome(record.outcome?);
    let next_safe: Vec<NextSafe> = record
        .outcome_context
        .as_ref()
        .and_then(|c| c.get("next_safe"))
        .and_then(|n| serde_json::from_value(n.clone()).ok())?;
    let context = OutcomeContext {
        next_safe,
        ..OutcomeContext::default()
    };
    crate::problem::resend_advised_at(outcome, &context)
}

/// Whether the finished write `record` ended by backpressure before anything was sent: no
/// attempt at all, an outcome of the scheduler's refusals a later try can change
/// (`scope_saturated`, `budget_exhausted`, `quota_exhausted` — not `deadline_exhausted`: the
/// task's time is over), and no escalation of its own, whose decision an operator owns. Such an
/// outcome binds nothing to the key: the action never reached the provider.
fn refused_before_any_send(
    record: &ActionRecord,
    attempts: &[AttemptRecord],
    escalations: &[EscalationRecord],
) -> bool {
    let backpressure = matches!(
        record.outcome,
        Some(
            backstop_store::Outcome::ScopeSaturated
                | backstop_store::Outcome::BudgetExhausted
                | backstop_store::Outcome::QuotaExhausted
        )
    );
    backpressure && attempts.is_empty() && escalations.is_empty()
}

/// The rule of the module docs for a same-key resend at `now` of the finished write `record`,
/// with its stored `attempts` and `escalations` (oldest first).
pub(super) fn verdict(
    record: &ActionRecord,
    attempts: &[AttemptRecord],
    escalations: &[EscalationRecord],
    now: Timestamp,
) -> Verdict {
    if record.state != ActionState::Finished || record.key().is_none() || !may_follow(record) {
        return Verdict::Replay;
    }
    let advised = advised_at(record);
    let latest = escalations.last();
    let decided = latest.and_then(|e| e.decision.as_deref());
    if decided == Some(DecisionOption::Abort.as_str()) {
        return if advised.is_some() {
            Verdict::ReplayClosed
        } else {
            Verdict::Replay
        };
    }
    if record.outcome == Some(backstop_store::Outcome::Cancelled) {
        // Ended without anything settled at the provider left open (its caller went away, a
        // restart): nothing binds the key to an outcome, so the resend sends it. The store
        // refuses the reopen when the task itself was cancelled (then it is replayed).
        return if writes::unsettled_in(attempts) || !escalations.is_empty() {
            Verdict::Replay
        } else {
            Verdict::Reopen {
                advised: None,
                escalation: None,
            }
        };
    }
    if let Some(at) = advised {
        return if now < at {
            Verdict::Replay
        } else {
            Verdict::Reopen {
                advised: Some(at),
                escalation: None,
            }
        };
    }
    if refused_before_any_send(record, attempts, escalations) {
        return Verdict::Reopen {
            advised: None,
            escalation: None,
        };
    }
    let Some(escalation) = latest else {
        return Verdict::Replay;
    };
    let resubmit = [
        DecisionOption::Wait,
        DecisionOption::RaiseQuota,
        DecisionOption::ChangePlan,
    ];
    let Some(decision) = decided.filter(|d| resubmit.iter().any(|o| o.as_str() == *d)) else {
        return Verdict::Replay;
    };
    let Ok(case) = CaseFile::from_json(&escalation.case_file) else {
        return Verdict::Replay;
    };
    let beside =
        case.ended_with.is_some() || case.reason == EscalationReason::RemainingWaitExceedsDeadline;
    // A decision reopens the action once: an attempt sent after it was that reopen's.
    let unused = match (escalation.decided_at, attempts.last()) {
        (Some(decided_at), Some(last)) => last.started_at < decided_at,
        (Some(_), None) => true,
        (None, _) => false,
    };
    if !beside || !unused {
        return Verdict::Replay;
    }
    let until = case
        .retry_not_before
        .filter(|_| decision == DecisionOption::Wait.as_str());
    match until {
        Some(at) if now < at => Verdict::Replay,
        _ => Verdict::Reopen {
            advised: until,
            escalation: Some(escalation.id),
        },
    }
}

/// Of the `decided` escalations, those of a scope's kind (`shared_quota_exhausted` for a
/// `quota_exhausted` write, `account_configuration` for one that ended `budget_exhausted` or
/// `deadline_exhausted`) of `record`'s provider covering one of `scopes` (every task of a scope
/// meets the same account): what answers a resend of a write that opened no escalation itself.
fn scope_escalations(
    record: &ActionRecord,
    scopes: &[String],
    decided: Vec<EscalationRecord>,
) -> Vec<EscalationRecord> {
    let kind = match record.outcome {
        Some(backstop_store::Outcome::QuotaExhausted) => EscalationReason::SharedQuotaExhausted,
        Some(
            backstop_store::Outcome::BudgetExhausted | backstop_store::Outcome::DeadlineExhausted,
        ) => EscalationReason::AccountConfiguration,
        _ => return Vec::new(),
    };
    decided
        .into_iter()
        .filter(|e| {
            CaseFile::from_json(&e.case_file).is_ok_and(|case| {
                case.reason == kind
                    && case.provider == record.provider
                    && case.scopes.iter().any(|s| scopes.contains(s))
            })
        })
        .collect()
}

/// `execution` (a replayed outcome) without `wait_until` among its safe options: no
/// `Retry-After`.
fn without_wait(mut execution: Execution) -> Execution {
    if let Execution::Outcome { context, .. } = &mut execution {
        context
            .next_safe
            .retain(|option| !matches!(option, NextSafe::WaitUntil { .. }));
    }
    execution
}

/// What became of a same-key resend of a finished write ([`Engine::take_finished`]).
// Returned once and taken apart at once: an answer is not boxed only to be moved out again.
#[allow(clippy::large_enum_variant)]
pub(super) enum Taken {
    /// Replay the stored outcome, as for any finished action.
    Replay,
    /// The answer to give: joined to the resend that reopened the action, reconciled, escalated,
    /// replayed without `wait_until`, or refused by the store — with the action's flight when
    /// this request led it, so that resends joined meanwhile get the same answer.
    Answer(Execution, Option<LeaderGuard>),
    /// The action is reopened and this request leads it: send it as the same action.
    Send(LeaderGuard),
}

impl Engine {
    /// A same-key, same-payload resend (`spec`, its prepared `request` and agent `key`) of the
    /// finished write `record`: replayed, answered, or reopened and taken over (see the module
    /// docs). `notify` (a background submission) is told when the resend joins the one that
    /// reopened the action; every other answer leaves it untold.
    pub(super) async fn take_finished(
        &self,
        spec: &ActionSpec,
        request: &AttemptRequest,
        key: &str,
        record: &ActionRecord,
        notify: Option<&Notify>,
    ) -> Taken {
        if !may_follow(record) || record.key().is_none() {
            return Taken::Replay;
        }
        let inner = &self.inner;
        let id = record.id;
        let Ok((attempts, escalations)) = self.resend_facts(record, spec).await else {
            return Taken::Replay;
        };
        let now = inner.clock.now();
        match verdict(record, &attempts, &escalations, now) {
            Verdict::Replay => {
                // `record` was read before `attempts`: a concurrent resend may have reopened
                // the action and sent it since (which is why its decision reads as used). Then
                // the stored outcome is stale: answer as the action stands now (joined, `409`
                // in flight, or its new outcome replayed), never with the old one.
                return match inner.blocking(move |s| s.action(id)).await {
                    Ok(Some(fresh))
                        if fresh.state != record.state || fresh.outcome != record.outcome =>
                    {
                        Taken::Answer(Box::pin(self.existing(fresh, notify)).await, None)
                    }
                    _ => Taken::Replay,
                };
            }
            Verdict::ReplayClosed => {
                let replayed = Box::pin(self.existing(record.clone(), None)).await;
                return Taken::Answer(without_wait(replayed), None);
            }
            Verdict::Reopen { .. } => {}
        }
        let guard = match inner.flights.join_or_lead(FlightKey::Action(id.0)) {
            Role::Leader(guard) => guard,
            // Another resend of this action reopened it and runs it: its answer is ours.
            Role::Follower(rx) => return self.join_reopening(record, &attempts, rx, notify).await,
        };
        Box::pin(self.lead_resend(spec, (request, key), id, notify, guard)).await
    }
    /// Leading the resend of the finished write `id` (`guard` registers it): nothing else of
    /// this process reopens the action now, so it is judged afresh — reopened and sent
    /// (`Taken::Send`), or answered.
    async fn lead_resend(
        &self,
        spec: &ActionSpec,
        (request, key): (&AttemptRequest, &str),
        id: ActionId,
        notify: Option<&Notify>,
        guard: LeaderGuard,
    ) -> Taken {
        let inner = &self.inner;
        let fresh = match inner.blocking(move |s| s.action(id)).await {
            Ok(Some(fresh)) => fresh,
            _ => return Taken::Replay,
        };
        if fresh.state != ActionState::Finished {
            drop(guard);
            return Taken::Answer(Box::pin(self.existing(fresh, notify)).await, None);
        }
        let Ok((attempts, escalations)) = self.resend_facts(&fresh, spec).await else {
            return Taken::Replay;
        };
        let now = inner.clock.now();
        let (advised, escalation) = match verdict(&fresh, &attempts, &escalations, now) {
            Verdict::Reopen {
                advised,
                escalation,
            } => (advised, escalation),
            Verdict::Replay => {
                return Taken::Answer(Box::pin(self.existing(fresh, None)).await, Some(guard));
            }
            Verdict::ReplayClosed => {
                let replayed = Box::pin(self.existing(fresh, None)).await;
                return Taken::Answer(without_wait(replayed), Some(guard));
            }
        };
        // An attempt that may have been acted on, and no later answer settled it (the last
        // one `uncertain`, or a `429`/`5xx` to a same-key resend after one).
        if writes::unsettled_in(&attempts) {
            // SPEC §6 before anything is sent: the rule the attempt loop follows.
            let facts = inner.stored_facts(&fresh, None).await;
            let Ok(end) = Box::pin(inner.reconcile_uncertain(&facts, Some(&request.headers))).await
            else {
                // The gateway is stopping: no lookup was sent, the action stays finished as it
                // was, and this request is not sent.
                let answer = Self::not_reconciled_at_stop(spec, &fresh, &attempts);
                return Taken::Answer(answer, Some(guard));
            };
            match end {
                writes::UncertainEnd::RetrySameKey => {}
                writes::UncertainEnd::Found { operation_id } => {
                    if let Err(answer) = self
                        .reopen(spec, &fresh, &attempts, advised, escalation)
                        .await
                    {
                        return Taken::Answer(answer, Some(guard));
                    }
                    let answer = self
                        .reconciled_on_resend(&fresh, &attempts, &facts, operation_id)
                        .await;
                    return Taken::Answer(answer, Some(guard));
                }
                writes::UncertainEnd::Escalate { reason } => {
                    let answer = self
                        .escalated_on_resend(spec, request, key, &fresh, &attempts, &facts, &reason)
                        .await;
                    return Taken::Answer(answer, Some(guard));
                }
            }
        }
        match self
            .reopen(spec, &fresh, &attempts, advised, escalation)
            .await
        {
            Ok(()) => Taken::Send(guard),
            Err(answer) => Taken::Answer(answer, Some(guard)),
        }
    }

    /// Joins the resend of `record` that reopened the action and runs it (`rx` hears its
    /// answer), as a layered retry joins a running write.
    async fn join_reopening(
        &self,
        record: &ActionRecord,
        attempts: &[AttemptRecord],
        mut rx: tokio::sync::broadcast::Receiver<Shared>,
        notify: Option<&Notify>,
    ) -> Taken {
        let id = record.id;
        self.inner.metrics.layered_retry_joined(&record.provider);
        // Another resend of this action reopened it and runs it: its answer is ours.
        tracing::info!(
            action = id.0,
            "same-key resend joined to the resend that reopened the action"
        );
        if let Some(notify) = notify {
            notify.runs(Self::stored_receipt(record, attempts), true);
        }
        if let Ok(shared) = rx.recv().await {
            return Taken::Answer(from_shared(shared), None);
        }
        return self.answer_as_stored(id, notify).await;
    }

    /// The stored attempts and escalations of `record`, for [`verdict`]; `Err` (logged) when
    /// the store cannot read them (the outcome is then replayed as before).
    ///
    /// A write that opened no escalation of its own but ended `quota_exhausted` (or after
    /// repeated limits) while its scope's escalation was open — one case covers every task of
    /// the scope, see `quota_escalations` — is answered by that escalation's decision: its
    /// escalations are then the scope's ones of the same kind, covering one of `spec`'s
    /// scopes, decided since the write's last attempt.
    async fn resend_facts(
        &self,
        record: &ActionRecord,
        spec: &ActionSpec,
    ) -> Result<(Vec<AttemptRecord>, Vec<EscalationRecord>), ()> {
        let id = record.id;
        let read = self
            .inner
            .blocking(move |s| Ok((s.attempts(id)?, s.escalations_of_action(id)?)))
            .await;
        let (attempts, own) = read.map_err(|e| {
            tracing::warn!(action = id.0, error = %e, "a same-key resend could not read the action's attempts and escalations; its outcome is replayed");
        })?;
        let Some(last) = attempts.last().filter(|_| own.is_empty()) else {
            return Ok((attempts, own));
        };
        let since = last.started_at;
        let decided = self
            .inner
            .blocking(move |s| s.escalations_decided_since(since))
            .await
            .map_err(|e| {
                tracing::warn!(action = id.0, error = %e, "a same-key resend could not read the escalations decided since; its outcome is replayed");
            })?;
        let scope = scope_escalations(record, &spec.route.scopes, decided);
        Ok((attempts, scope))
    }

    /// The answer for action `id` as the store has it now (replayed, joined or `409`);
    /// `notify` is told of a join.
    async fn answer_as_stored(
        &self,
        id: backstop_store::ActionId,
        notify: Option<&Notify>,
    ) -> Taken {
        match self.inner.blocking(move |s| s.action(id)).await {
            Ok(Some(record)) => Taken::Answer(Box::pin(self.existing(record, notify)).await, None),
            _ => Taken::Replay,
        }
    }

    /// Reopens the finished write `record` (its stored `attempts`) for this resend (audited).
    /// `Err` is the answer instead: the store refused (a cancelled task: the outcome is replayed
    /// without `wait_until`, nothing is ever sent again) or failed (`503 store_unavailable`,
    /// `sent` as for the action's earlier attempts).
    async fn reopen(
        &self,
        spec: &ActionSpec,
        record: &ActionRecord,
        attempts: &[AttemptRecord],
        advised: Option<Timestamp>,
        escalation: Option<EscalationId>,
    ) -> Result<(), Execution> {
        let inner = &self.inner;
        let (id, now) = (record.id, inner.clock.now());
        match inner
            .blocking(move |s| s.reopen_for_resend(id, advised, escalation, now))
            .await
        {
            Ok(()) => {
                tracing::info!(
                    action = id.0,
                    outcome = record.outcome.map_or("-", |o| o.as_str()),
                    advised = advised.map(|at| at.to_string()).as_deref().unwrap_or("-"),
                    escalation = escalation.map(|e| e.0),
                    "same-key resend of a finished write whose answer said it may: reopened under its original idempotency key"
                );
                Ok(())
            }
            Err(e) if is_store_failure(&e) => {
                let sent = writes::recovered_context(attempts, 0).sent;
                let detail = if sent {
                    "backstop's store could not record that this write is sent again, so this request was not sent; earlier attempts of the action under this Idempotency-Key were sent (Backstop-Attempts counts them), so check the action's status before sending it again: it is never resent blindly"
                } else {
                    "backstop's store could not record that this write is sent again, so this request was not sent; nothing was sent for the action under this Idempotency-Key either, so sending it again later with the same key is safe"
                };
                let receipt = Self::stored_receipt(record, attempts);
                Err(self.store_unavailable_saying(spec, receipt, sent, &e, detail))
            }
            Err(e) => {
                tracing::info!(action = id.0, error = %e, "same-key resend: the action may not be reopened; its outcome is replayed");
                let stored = match inner.blocking(move |s| s.action(id)).await {
                    Ok(Some(stored)) => stored,
                    _ => record.clone(),
                };
                Err(without_wait(Box::pin(self.existing(stored, None)).await))
            }
        }
    }

    /// The `503 shutting_down` for a same-key resend of the write `record` (its stored
    /// `attempts`, one of them unsettled) when the gateway stops before the lookup SPEC §6 asks
    /// for could be sent: nothing was sent, the write stays as stored, and the resend may come
    /// again once backstop is back (it is reconciled first).
    pub(super) fn not_reconciled_at_stop(
        spec: &ActionSpec,
        record: &ActionRecord,
        attempts: &[AttemptRecord],
    ) -> Execution {
        tracing::info!(
            action = record.id.0,
            "shutting down: a same-key resend of a write with an unsettled attempt is not reconciled now; nothing was sent"
        );
        let receipt = Self::stored_receipt(record, attempts);
        let problem = super::with_ids(
            crate::problem::Problem::shutting_down_during(
                true,
                "backstop is shutting down: an earlier attempt of this write was sent and its answer is unknown, and no reconciliation lookup can be sent or waited for any more, so this resend was not sent. Send it again with the same Idempotency-Key once backstop is back: it is reconciled first, never resent blindly",
            ),
            spec,
            &receipt,
        );
        super::problem_answer(receipt, problem)
    }

    /// The receipt of the finished write `record` with its stored `attempts`.
    fn stored_receipt(record: &ActionRecord, attempts: &[AttemptRecord]) -> ActionReceipt {
        ActionReceipt {
            action_id: record.id.0,
            attempts: u32::try_from(attempts.len()).unwrap_or(u32::MAX),
            idempotency_key: Some(record.idempotency_key.clone()),
            provider_operation_id: record.provider_operation_id.clone(),
            task: Some(record.task_id.clone()),
        }
    }

    /// The reopened write `record`, whose uncertain last attempt the lookup found at the
    /// provider: ended `succeeded` (reconciled, audited); nothing is sent.
    pub(super) async fn reconciled_on_resend(
        &self,
        record: &ActionRecord,
        attempts: &[AttemptRecord],
        facts: &writes::WriteFacts,
        operation_id: Option<String>,
    ) -> Execution {
        let inner = &self.inner;
        // The context the caller is answered with is the one stored, so the action's view and
        // a later replay say the same.
        let context = writes::recovered_context(attempts, facts.wait_used_ms);
        let stored = serde_json::to_value(&context).unwrap_or_default();
        let (id, op, now) = (record.id, operation_id.clone(), inner.clock.now());
        let kept = stored.clone();
        if let Err(e) = inner
            .blocking(move |s| s.record_reconciled_with_context(id, op, kept, now))
            .await
        {
            tracing::warn!(action = id.0, error = %e, "could not record the reconciliation");
            if is_store_failure(&e) {
                inner.record_when_store_commits(writes::Deferred {
                    action: id,
                    result: None,
                    end: writes::DeferredEnd::Reconciled {
                        operation_id: operation_id.clone(),
                        context: stored,
                    },
                    count: None,
                });
            }
        }
        inner
            .metrics
            .outcome(&facts.provider, &facts.class, Outcome::Succeeded);
        tracing::info!(
            action = id.0,
            provider_operation_id = operation_id.as_deref().unwrap_or("-"),
            "reconciled on a same-key resend: the provider has the write; nothing is resent"
        );
        let receipt = ActionReceipt {
            provider_operation_id: operation_id
                .clone()
                .or(record.provider_operation_id.clone()),
            ..Self::stored_receipt(record, attempts)
        };
        Execution::Outcome {
            receipt,
            outcome: Outcome::Succeeded,
            context,
            detail: match operation_id {
                Some(op) => format!(
                    "reconciled: the provider has this write as `{op}`; it was not sent again"
                ),
                None => "reconciled: the provider has this write; it was not sent again".to_owned(),
            },
        }
    }

    /// The finished write `record`, whose uncertain last attempt the SPEC §6 rule cannot settle
    /// (`reason`): escalated (`side_effect_unknown`) as it stands, not reopened, this resent
    /// request held for the operator's `retry_same_key`/`send_new`; nothing is sent.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn escalated_on_resend(
        &self,
        spec: &ActionSpec,
        request: &AttemptRequest,
        key: &str,
        record: &ActionRecord,
        attempts: &[AttemptRecord],
        facts: &writes::WriteFacts,
        reason: &str,
    ) -> Execution {
        let inner = &self.inner;
        let id = record.id;
        {
            let mut held = spec.clone();
            held.request = request.clone();
            held.idempotency_key = Some(key.to_owned());
            let mut holding = inner
                .held
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if holding.len() < HELD_REQUESTS {
                holding.insert(id.0, held);
            } else {
                tracing::warn!(
                    action = id.0,
                    held = holding.len(),
                    "escalated request not held: the bound is reached; a retry_same_key or send_new needs the agent to resubmit"
                );
            }
        }
        let receipt = Self::stored_receipt(record, attempts);
        match inner
            .escalate(facts, EscalationReason::SideEffectUnknown, reason, None, None)
            .await
        {
            Ok((escalation, context)) => Execution::Outcome {
                receipt,
                outcome: Outcome::Escalated,
                context,
                detail: format!(
                    "the provider may have acted on this write and it cannot be decided safely ({reason}); nothing was sent for this resend; escalation {} awaits an operator",
                    escalation.0
                ),
            },
            Err(e) => {
                tracing::error!(action = id.0, error = %e, "could not open the escalation");
                let mut context = writes::recovered_context(attempts, facts.wait_used_ms);
                context.next_safe = vec![NextSafe::QueryStatus, NextSafe::Abort];
                Execution::Outcome {
                    receipt,
                    outcome: Outcome::ReconciliationRequired,
                    context,
                    detail: format!("the provider may have acted on this write ({reason}); nothing was sent for this resend, and the escalation could not be opened: reconcile before anything is sent again"),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use backstop_store::{ActionId, EscalationState};
    use serde_json::json;

    fn at(s: &str) -> Timestamp {
        s.parse().expect("instant")
    }

    fn finished(outcome: backstop_store::Outcome, context: serde_json::Value) -> ActionRecord {
        ActionRecord {
            id: ActionId(7),
            task_id: "t".into(),
            agent: "a".into(),
            provider: "p".into(),
            method: "POST".into(),
            route: "/v1/x".into(),
            request_class: "idempotent_write".into(),
            payload_digest: "0".repeat(64),
            idempotency_key: "k-1".into(),
            external_reference: None,
            provider_operation_id: None,
            state: ActionState::Finished,
            outcome: Some(outcome),
            outcome_context: Some(context),
            response: None,
            desired_outcome: None,
            fingerprint: None,
        }
    }

    fn waits_until(t: &str) -> serde_json::Value {
        json!({"sent": true, "next_safe": [{"option": "wait_until", "at": t}, {"option": "abort"}]})
    }

    fn attempt(started: &str) -> AttemptRecord {
        AttemptRecord {
            action: ActionId(7),
            n: 1,
            state: backstop_store::AttemptState::Finished,
            status: Some(429),
            disposition: Some(backstop_store::Disposition::QuotaExhausted),
            started_at: at(started),
            finished_at: Some(at(started)),
            boundary: None,
            signal_headers: Vec::new(),
        }
    }

    fn escalation(
        ended_with: Option<&str>,
        decision: Option<&str>,
        decided: &str,
    ) -> EscalationRecord {
        let case = CaseFile::build(backstop_core::escalation::CaseInput {
            opened_at: at("2026-01-01T00:00:00Z"),
            reason: EscalationReason::SharedQuotaExhausted,
            action: backstop_core::escalation::CaseAction {
                task_id: "t".into(),
                method: "POST".into(),
                route: "/v1/x".into(),
                request_class: "idempotent_write".into(),
                payload_digest: "0".repeat(64),
            },
            provider: "p".into(),
            idempotency_key: Some("k-1".into()),
            retry_not_before: Some(at("2026-01-01T01:00:00Z")),
            ..backstop_core::escalation::CaseInput::default()
        })
        .expect("case");
        let case = match ended_with {
            Some(outcome) => case.beside_outcome(outcome),
            None => case,
        };
        EscalationRecord {
            id: EscalationId(3),
            action: ActionId(7),
            case_file: case.to_json(),
            state: if decision.is_some() {
                EscalationState::Decided
            } else {
                EscalationState::Open
            },
            decision: decision.map(str::to_owned),
            decided_by: decision.map(|_| "oncall".to_owned()),
            decided_at: decision.map(|_| at(decided)),
            note: None,
        }
    }

    #[test]
    fn an_advised_instant_replays_before_and_reopens_from_it() {
        let record = finished(
            backstop_store::Outcome::BudgetExhausted,
            waits_until("2026-01-01T00:00:11Z"),
        );
        assert_eq!(
            verdict(&record, &[], &[], at("2026-01-01T00:00:10.999Z")),
            Verdict::Replay
        );
        let reopen = Verdict::Reopen {
            advised: Some(at("2026-01-01T00:00:11Z")),
            escalation: None,
        };
        assert_eq!(
            verdict(&record, &[], &[], at("2026-01-01T00:00:11Z")),
            reopen
        );
        assert_eq!(
            verdict(&record, &[], &[], at("2026-01-02T00:00:00Z")),
            reopen
        );
    }

    #[test]
    fn outcomes_that_are_not_answered_429_never_reopen_on_their_own() {
        for outcome in [
            backstop_store::Outcome::DeadlineExhausted,
            backstop_store::Outcome::Succeeded,
            backstop_store::Outcome::Rejected,
            backstop_store::Outcome::Escalated,
            backstop_store::Outcome::ReconciliationRequired,
        ] {
            let record = finished(outcome, waits_until("2026-01-01T00:00:11Z"));
            assert_eq!(
                verdict(&record, &[], &[], at("2026-01-02T00:00:00Z")),
                Verdict::Replay,
                "{outcome:?}"
            );
        }
        // `cancelled` reopens at once while nothing of it is unsettled (rule 5).
        let cancelled = finished(backstop_store::Outcome::Cancelled, serde_json::json!({}));
        assert_eq!(
            verdict(&cancelled, &[], &[], at("2026-01-02T00:00:00Z")),
            Verdict::Reopen {
                advised: None,
                escalation: None
            }
        );
        let read = ActionRecord {
            idempotency_key: String::new(),
            ..finished(
                backstop_store::Outcome::BudgetExhausted,
                waits_until("2026-01-01T00:00:11Z"),
            )
        };
        assert_eq!(
            verdict(&read, &[], &[], at("2026-01-02T00:00:00Z")),
            Verdict::Replay
        );
    }

    #[test]
    fn a_decision_beside_the_outcome_reopens_once_and_abort_closes() {
        let record = finished(
            backstop_store::Outcome::QuotaExhausted,
            json!({"sent": true, "next_safe": [{"option": "abort"}]}),
        );
        let sent = [attempt("2026-01-01T00:00:00Z")];
        let after_reset = at("2026-01-01T01:00:00Z");
        // Open: nothing decided yet.
        let open = escalation(Some("quota_exhausted"), None, "");
        assert_eq!(
            verdict(&record, &sent, &[open], after_reset),
            Verdict::Replay
        );
        // `raise_quota`: at once.
        let raised = escalation(
            Some("quota_exhausted"),
            Some("raise_quota"),
            "2026-01-01T00:10:00Z",
        );
        assert_eq!(
            verdict(
                &record,
                &sent,
                std::slice::from_ref(&raised),
                at("2026-01-01T00:10:00Z")
            ),
            Verdict::Reopen {
                advised: None,
                escalation: Some(EscalationId(3))
            }
        );
        // … once: an attempt sent after the decision used it.
        let resent = [
            attempt("2026-01-01T00:00:00Z"),
            attempt("2026-01-01T00:11:00Z"),
        ];
        assert_eq!(
            verdict(&record, &resent, &[raised], after_reset),
            Verdict::Replay
        );
        // `wait`: not before the case file's reset.
        let waited = escalation(
            Some("quota_exhausted"),
            Some("wait"),
            "2026-01-01T00:10:00Z",
        );
        assert_eq!(
            verdict(
                &record,
                &sent,
                std::slice::from_ref(&waited),
                at("2026-01-01T00:30:00Z")
            ),
            Verdict::Replay
        );
        assert_eq!(
            verdict(&record, &sent, &[waited], after_reset),
            Verdict::Reopen {
                advised: Some(after_reset),
                escalation: Some(EscalationId(3))
            }
        );
        // A decision on an escalation that did not open beside an outcome does not count.
        let not_beside = escalation(None, Some("wait"), "2026-01-01T00:10:00Z");
        assert_eq!(
            verdict(&record, &sent, &[not_beside], after_reset),
            Verdict::Replay
        );
        // `abort` keeps the outcome; with an advised instant it is replayed without it.
        let aborted = escalation(
            Some("budget_exhausted"),
            Some("abort"),
            "2026-01-01T00:10:00Z",
        );
        assert_eq!(
            verdict(&record, &sent, std::slice::from_ref(&aborted), after_reset),
            Verdict::Replay
        );
        let advised = finished(
            backstop_store::Outcome::BudgetExhausted,
            waits_until("2026-01-01T00:00:11Z"),
        );
        assert_eq!(
            verdict(&advised, &sent, &[aborted], after_reset),
            Verdict::ReplayClosed
        );
    }
}
