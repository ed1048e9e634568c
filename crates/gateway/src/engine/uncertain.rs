//! An uncertain write during its attempt loop (SPEC §6): the facts a reconciliation lookup and
//! a case file go by, and the escalation when no lookup can settle it.
//!
//! Why apart: an attempt that got no answer may have been acted on; it is never retried as if
//! it had not. Whatever the lookup finds decides the next phase (see [`super::attempt`]).

use backstop_core::{
    budget::ActionBudget,
    clock::Clock,
    outcome::{NextSafe, Outcome, OutcomeContext},
};
use backstop_store::AttemptResult;
use jiff::Timestamp;

use super::{
    is_store_failure, wait_ms, writes, Answer, Attempt, Engine, Next, Run, Seen, Stopped,
    HELD_REQUESTS,
};
use crate::action::{ActionReceipt, Execution};

impl Engine {
    /// Reconcile: an uncertain write is looked up at the provider before anything else
    /// happens. Found: it succeeded and nothing is resent. Nothing found and the provider
    /// honours the key: it is resent under the same key (a retry to plan). Otherwise a human
    /// decides.
    pub(super) async fn reconcile(&self, cx: &mut Attempt<'_, '_>, answer: Answer) -> Next {
        let inner = &self.inner;
        let run = cx.run;
        let facts = self.write_facts(run, &cx.budget);
        let Ok(end) = Box::pin(inner.reconcile_uncertain(&facts, Some(&run.request.headers))).await
        else {
            // The gateway is stopping: no lookup left, so nothing is known of the write
            // and nothing is recorded for it. Its attempt stays `sent` without a result,
            // which the next start reconciles with its original key (SPEC §12); our own
            // stop is no reason to escalate it.
            cx.end(&inner.scheduler);
            tracing::info!(
                action = run.id.0,
                attempt = answer.result.attempt,
                "shutting down: the write's attempt was sent and its answer never came; it stays sent without a result, and the next start reconciles it with its original key"
            );
            return Next::Finish(self.stopped_after_sending(run, &cx.seen, Stopped::NotReconciled));
        };
        match end {
            writes::UncertainEnd::Found { operation_id } => {
                Next::Finish(self.reconciled(cx, answer, operation_id).await)
            }
            // The lookup is a read of the provider's state, not a resend: it never
            // spends the write's attempts. A resend does; when the class has none left
            // (an `uncertain_write` allows one), a human decides instead.
            writes::UncertainEnd::RetrySameKey if cx.budget.attempts_remaining() > 0 => {
                Next::Plan(answer)
            }
            end => {
                let reason = match end {
                    writes::UncertainEnd::Escalate { reason } => reason,
                    // `RetrySameKey` with no attempt left (`Found` returned above).
                    _ => format!(
                        "the provider honours the idempotency key, but the `{}` class allows no further attempt, so resending under the same key is an operator's decision",
                        run.spec.route.class
                    ),
                };
                cx.end(&inner.scheduler);
                cx.guard.so_far.in_flight = None;
                let escalated = self.record_then_escalate(
                    run,
                    (&cx.budget, &cx.seen),
                    (answer.result, answer.received_at),
                    &facts,
                    &reason,
                );
                Next::Finish(Box::pin(escalated).await)
            }
        }
    }

    /// The provider has the uncertain write (as `operation_id`, when it says): the action
    /// succeeded, with its result and the reconciliation recorded — once the store commits
    /// again if it cannot now.
    async fn reconciled(
        &self,
        cx: &mut Attempt<'_, '_>,
        answer: Answer,
        operation_id: Option<String>,
    ) -> Execution {
        let inner = &self.inner;
        let run = cx.run;
        let route = &run.spec.route;
        cx.guard.armed = false;
        self.breaker_success(run);
        inner.scheduler.deposit(&route.scopes, cx.spent.take());
        cx.refund_pending(&inner.scheduler);
        let (result, received_at) = (answer.result, answer.received_at);
        let kept = result.clone();
        let unrecorded = match inner
            .blocking(move |s| s.record_result(result, received_at))
            .await
        {
            Ok(()) => None,
            Err(e) => {
                tracing::warn!(action = run.id.0, task = %run.task(), agent = %run.spec.agent, route = %run.spec.route.template, error = %e, "could not record the result");
                is_store_failure(&e).then_some(kept)
            }
        };
        // The context the caller is answered with is the one stored, so that
        // the action's view and a same-key replay say the same (its
        // `total_wait_ms` is the budget's count, which the attempts alone
        // cannot rebuild: the waits before the first send are not in them).
        let context = self.context(&cx.budget, &cx.seen, None, Vec::new());
        let stored = serde_json::to_value(&context).unwrap_or_else(|_| serde_json::json!({}));
        let (id, op, at) = (run.id, operation_id.clone(), inner.clock.now());
        let kept_context = stored.clone();
        if let Err(e) = inner
            .blocking(move |s| s.record_reconciled_with_context(id, op, kept_context, at))
            .await
        {
            tracing::warn!(action = run.id.0, task = %run.task(), agent = %run.spec.agent, route = %run.spec.route.template, error = %e, "could not record the reconciliation");
            if is_store_failure(&e) {
                // The caller is told; the store is, once it commits again.
                inner.record_when_store_commits(writes::Deferred {
                    action: run.id,
                    result: unrecorded,
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
            .outcome(&route.provider, &route.class, Outcome::Succeeded);
        tracing::info!(
            action = run.id.0,
            task = %run.task(),
            route = %route.template,
            provider_operation_id = operation_id.as_deref().unwrap_or("-"),
            "reconciled: the provider has the write; nothing is resent"
        );
        // The id is told with the answer, whether or not the store has it yet.
        let receipt = ActionReceipt {
            provider_operation_id: operation_id.clone(),
            ..run.receipt(cx.seen.sent)
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
}

impl Engine {
    /// The facts of the running write for reconciliation and case files.
    pub(super) fn write_facts(&self, run: &Run<'_>, budget: &ActionBudget) -> writes::WriteFacts {
        let spec = run.spec;
        let route = &spec.route;
        let class = self.inner.policy.request_classes.get(&route.class);
        writes::WriteFacts {
            action: run.id,
            task_id: run.task().to_owned(),
            agent: spec.agent.clone(),
            priority: run.priority,
            provider: route.provider.clone(),
            method: route.method.clone(),
            route: route.template.clone(),
            class: route.class.clone(),
            scopes: route.scopes.clone(),
            payload_digest: spec.payload_digest.clone(),
            idempotency_key: run.key.clone(),
            upstream_key: run.upstream_key.clone(),
            external_reference: run.reference.clone(),
            provider_operation_id: run
                .operation_id
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .clone(),
            fingerprint: run.fingerprint.to_string(),
            desired_outcome: spec.desired_outcome.clone(),
            reconcile: route.reconcile.clone(),
            max_attempts: class.map_or(1, |c| c.max_attempts),
            max_wait: class.map_or(std::time::Duration::ZERO, |c| c.max_wait),
            deadline: budget.deadline(),
            wait_used_ms: wait_ms(budget),
        }
    }

    /// Records the last attempt's `result` (received at the instant given beside it; a store
    /// that cannot is logged, and the escalation still opens), then escalates the write as one
    /// whose side effect is unknown ([`Engine::escalate_uncertain`]) for `reason`.
    pub(super) async fn record_then_escalate(
        &self,
        run: &Run<'_>,
        (budget, seen): (&ActionBudget, &Seen),
        (result, received_at): (AttemptResult, Timestamp),
        facts: &writes::WriteFacts,
        reason: &str,
    ) -> Execution {
        if let Err(e) = self
            .inner
            .blocking(move |s| s.record_result(result, received_at))
            .await
        {
            tracing::warn!(action = run.id.0, task = %run.task(), agent = %run.spec.agent, route = %run.spec.route.template, error = %e, "could not record the result");
        }
        Box::pin(self.escalate_uncertain(run, budget, seen, facts, reason)).await
    }

    /// Escalates an uncertain write (its attempt result already recorded) and keeps its
    /// prepared request in memory so an operator's `retry_same_key` can resend it.
    pub(super) async fn escalate_uncertain(
        &self,
        run: &Run<'_>,
        budget: &ActionBudget,
        seen: &Seen,
        facts: &writes::WriteFacts,
        reason: &str,
    ) -> Execution {
        let inner = &self.inner;
        let mut held = run.spec.clone();
        held.request = run.request.as_ref().clone();
        held.idempotency_key = Some(run.key.clone());
        {
            let mut holding = inner
                .held
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if holding.len() < HELD_REQUESTS {
                holding.insert(run.id.0, held);
            } else {
                tracing::warn!(
                    action = run.id.0,
                    held = holding.len(),
                    "escalated request not held: the bound is reached; a retry_same_key or send_new needs the agent to resubmit"
                );
            }
        }
        // The answer's `next_safe` is the case file's safe options (set by `escalate`).
        let context = self.context(budget, seen, None, Vec::new());
        match inner
            .escalate(
                facts,
                backstop_core::escalation::EscalationReason::SideEffectUnknown,
                reason,
                None,
                Some(context.clone()),
            )
            .await
        {
            Ok((escalation, context)) => Execution::Outcome {
                receipt: run.receipt(seen.sent),
                outcome: Outcome::Escalated,
                context,
                detail: format!(
                    "the provider may have acted on this write and it cannot be decided safely ({reason}); escalation {} awaits an operator",
                    escalation.0
                ),
            },
            Err(e) => {
                tracing::error!(action = run.id.0, error = %e, "could not open the escalation");
                let mut next_safe = Vec::new();
                if facts.reconcile.is_some() {
                    next_safe.push(NextSafe::QueryStatus);
                }
                if inner.honours_key(&run.spec.route.provider) {
                    next_safe.push(NextSafe::ResendSameKey);
                }
                next_safe.push(NextSafe::Abort);
                let context = OutcomeContext {
                    next_safe,
                    ..context
                };
                Box::pin(self.finish(
                    run,
                    budget,
                    Outcome::ReconciliationRequired,
                    context,
                    format!("the provider may have acted on this write ({reason}); the escalation could not be opened, so it must be reconciled before anything is sent again"),
                    seen.sent,
                ))
                .await
            }
        }
    }
}
