//! An uncertain write during its attempt loop (SPEC §6): the facts a reconciliation lookup and
//! a case file go by, and the escalation when no lookup can settle it.
//!
//! Why apart: an attempt that got no answer may have been acted on; it is never retried as if
//! it had not. Whatever the lookup finds decides the next phase (see [`super::attempt`]).

use backstop_core::{
    budget::ActionBudget,
    outcome::{NextSafe, Outcome, OutcomeContext},
};
use backstop_store::AttemptResult;
use jiff::Timestamp;

use super::{wait_ms, writes, Engine, Run, Seen, HELD_REQUESTS};
use crate::action::Execution;

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
