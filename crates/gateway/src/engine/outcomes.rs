//! How an action ends with an outcome the gateway makes: the SPEC §5 context, the final
//! failure of an answer that may not be retried, and recording the outcome — with what happens
//! when the store cannot (recorded as soon as it commits again, never left open).

use axum::body::Body;
use backstop_core::clock::Clock;
use backstop_core::{
    budget::ActionBudget,
    classify::{Disposition, Signal},
    outcome::{NextSafe, Outcome, OutcomeContext},
};
use backstop_store::{AttemptResult, Finish};
use jiff::Timestamp;

use super::{
    is_store_failure, kept_for_replay, quota_escalations, store_outcome, writes, Engine,
    EngineError, Run, Seen, STORE_FAILED_BEFORE_RETRY,
};
use crate::action::{ActionReceipt, Execution};

/// Which record of a retry the store could not commit (see `Engine::close_unrecorded_retry`).
pub(super) enum UnrecordedRetry {
    /// Its start when it came due: the `action_sent` that claims its job.
    Start,
    /// Its schedule, after the last attempt's result; `result` is that result when the store
    /// could not record it either.
    Schedule { result: Option<Box<AttemptResult>> },
}

pub(super) fn wait_ms(budget: &ActionBudget) -> u64 {
    u64::try_from(budget.waited().as_millis()).unwrap_or(u64::MAX)
}

pub(super) fn wait_then_abort(boundary: Option<Timestamp>) -> Vec<NextSafe> {
    match boundary {
        Some(at) => vec![NextSafe::WaitUntil { at }, NextSafe::Abort],
        None => vec![NextSafe::Abort],
    }
}

impl Engine {
    /// Ends an action whose last answer may not be retried.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn final_failure(
        &self,
        run: &Run<'_>,
        budget: &ActionBudget,
        seen: &Seen,
        signal: Signal,
        response: Option<http::Response<Body>>,
        result: AttemptResult,
        key_honoured: bool,
    ) -> Execution {
        let route = &run.spec.route;
        match (signal.disposition, response) {
            (disposition @ (Disposition::Rejected | Disposition::Conflict), Some(response)) => {
                let answer = (disposition, signal, response, result);
                self.pass_final_answer(run, budget, seen, answer).await
            }
            (Disposition::Uncertain, _) => {
                let mut next_safe = vec![NextSafe::QueryStatus];
                if key_honoured {
                    next_safe.push(NextSafe::ResendSameKey);
                }
                next_safe.push(NextSafe::Abort);
                let context = self.context(budget, seen, None, next_safe);
                let detail = "the provider may have acted on the request; reconcile before any further side effect".to_owned();
                Box::pin(self.finish_with_result(
                    run,
                    budget,
                    result,
                    Outcome::ReconciliationRequired,
                    context,
                    detail,
                    seen.sent,
                ))
                .await
            }
            (Disposition::QuotaExhausted, _) => {
                let boundary = seen.boundary;
                let context = self.context(budget, seen, boundary, wait_then_abort(boundary));
                Box::pin(self.finish_quota_exhausted(
                    run,
                    budget,
                    result,
                    context,
                    (boundary, signal.error_code.as_deref()),
                    seen.sent,
                ))
                .await
            }
            (disposition, _) => {
                let boundary = seen.boundary;
                let context = self.context(budget, seen, boundary, wait_then_abort(boundary));
                let detail = format!(
                    "`{}` answers are not retried for request class `{}`",
                    disposition, route.class
                );
                Box::pin(self.finish_with_result(
                    run,
                    budget,
                    result,
                    Outcome::BudgetExhausted,
                    context,
                    detail,
                    seen.sent,
                ))
                .await
            }
        }
    }

    /// A refusal or a conflict the provider answered is the agent's to see: passed through
    /// unchanged, its rejection counted by the circuit breaker, the action ended with it.
    async fn pass_final_answer(
        &self,
        run: &Run<'_>,
        budget: &ActionBudget,
        seen: &Seen,
        (disposition, signal, response, result): (
            Disposition,
            Signal,
            http::Response<Body>,
            AttemptResult,
        ),
    ) -> Execution {
        let inner = &self.inner;
        let route = &run.spec.route;
        let outcome = if disposition == Disposition::Rejected {
            Outcome::Rejected
        } else {
            Outcome::Conflict
        };
        if disposition == Disposition::Rejected {
            let code = signal
                .error_code
                .clone()
                .unwrap_or_else(|| format!("http_{}", response.status().as_u16()));
            self.breaker_failure(run, &code, seen.last_status).await;
        }
        let context = self.context(
            budget,
            seen,
            None,
            vec![NextSafe::ChangeRequest, NextSafe::Abort],
        );
        // A write's final answer is kept for idempotent replay, refused or not: a
        // same-key resend is answered as the first request was.
        let (response, kept) = if !run.spec.has_side_effect() {
            (response, None)
        } else {
            let (response, record, _) = kept_for_replay(response, run.id, false).await;
            (response, Some(record))
        };
        let mut result = result;
        result.finish = Some(Finish {
            outcome: store_outcome(outcome),
            context: serde_json::to_value(&context).unwrap_or_default(),
            response: kept,
        });
        self.record_final_result(run, result).await;
        inner
            .metrics
            .outcome(&route.provider, &route.class, outcome);
        tracing::info!(
            task = %run.task(),
            route = %route.template,
            status = seen.last_status,
            outcome = %outcome,
            "final provider answer passed through"
        );
        Execution::Response {
            receipt: run.receipt(seen.sent),
            response,
        }
    }

    pub(super) fn context(
        &self,
        budget: &ActionBudget,
        seen: &Seen,
        boundary: Option<Timestamp>,
        next_safe: Vec<NextSafe>,
    ) -> OutcomeContext {
        OutcomeContext {
            sent: seen.left > 0,
            response_received: seen.response_received,
            attempts: seen.sent,
            total_wait_ms: wait_ms(budget),
            last_status: seen.last_status,
            last_signal: seen.last_signal.map(str::to_owned),
            boundary,
            next_safe,
        }
    }

    /// The store could not record a retry of this action, and its caller is answered `503
    /// store_unavailable`; nothing of the retry left. `step` says which record failed: the
    /// retry's schedule (after the last attempt's result, which may have failed too) or its
    /// start when it came due (the `action_sent` that claims its job,
    /// [`Store::mark_attempt_sent`]). The action must not stay open for a step nothing takes
    /// any more (the watchdog's stuck findings, a `409` for every same-key resend, and for a
    /// retry never scheduled not even a restart would find it): as soon as the store commits
    /// again (see `Inner::record_when_store_commits`) it is closed as every action nothing
    /// sends again is (`writes::Closing`): a write one of whose attempts may have been acted on
    /// with nothing settling it since is reconciled with its original key, as a write sent
    /// without a result is at a restart
    /// (found → `succeeded`, otherwise `escalated`), and never resent; any other action ends
    /// `cancelled` with [`STORE_FAILED_BEFORE_RETRY`]. Either close also drops a retry job left
    /// waiting, as a retry re-armed at a restart does.
    pub(super) fn close_unrecorded_retry(
        &self,
        run: &Run<'_>,
        budget: &ActionBudget,
        seen: &Seen,
        step: UnrecordedRetry,
    ) {
        let closing = writes::Closing::of(!run.spec.has_side_effect(), seen.unsettled);
        let (result, what) = match step {
            UnrecordedRetry::Start => (None, "the start of this action's retry when it came due"),
            UnrecordedRetry::Schedule { result: None } => {
                (None, "this action's retry when it was planned")
            }
            UnrecordedRetry::Schedule { result } => (
                result.map(|r| *r),
                "the result of this action's last attempt, nor its retry when it was planned",
            ),
        };
        let route = &run.spec.route;
        let then = match closing {
            writes::Closing::Reconcile => ", as soon as the store commits again, the write (its last attempt uncertain) is reconciled with its original key and closed; nothing is resent",
            writes::Closing::Cancel => " the action is closed `cancelled` as soon as the store commits again",
        };
        tracing::warn!(
            action = run.id.0,
            task = %run.task(),
            agent = %run.spec.agent,
            route = %route.template,
            attempts = seen.sent,
            "the store could not record {what}, so the retry was not sent; the caller is answered 503 store_unavailable and{then}"
        );
        let end = writes::DeferredEnd::closing(closing, writes::PayloadGone::StoreFailed, || {
            let context = self.context(budget, seen, seen.boundary, vec![NextSafe::Abort]);
            let mut context = serde_json::to_value(&context).unwrap_or_default();
            if let Some(members) = context.as_object_mut() {
                members.insert("detail".into(), STORE_FAILED_BEFORE_RETRY.into());
            }
            Finish {
                outcome: backstop_store::Outcome::Cancelled,
                context,
                response: None,
            }
        });
        self.inner.record_when_store_commits(writes::Deferred {
            action: run.id,
            result,
            end,
            count: Some((route.provider.clone(), route.class.clone())),
        });
    }

    /// Records the last attempt's `result` together with the outcome it carries (`finish`);
    /// when the store fails, see [`Self::final_result_not_recorded`].
    pub(super) async fn record_final_result(&self, run: &Run<'_>, result: AttemptResult) {
        let (kept, at) = (result.clone(), self.inner.clock.now());
        if let Err(e) = self
            .inner
            .blocking(move |s| s.record_result(result, at))
            .await
        {
            self.final_result_not_recorded(run, kept, &e);
        }
    }

    /// The store could not record the last attempt's `result` and the outcome it carries: a
    /// store failure is recorded later ([`Self::outcome_not_recorded`]); any other refusal (the
    /// task was cancelled meanwhile) is logged at WARN as before.
    pub(super) fn final_result_not_recorded(
        &self,
        run: &Run<'_>,
        mut result: AttemptResult,
        e: &EngineError,
    ) {
        match result.finish.take() {
            Some(finish) if is_store_failure(e) => {
                self.outcome_not_recorded(run, Some(result), finish, e);
            }
            _ => {
                tracing::warn!(action = run.id.0, task = %run.task(), agent = %run.spec.agent, route = %run.spec.route.template, error = %e, "could not record the result")
            }
        }
    }

    /// The store could not record how this action ended (`result`, the last attempt's result
    /// when it is recorded with the outcome, and `finish`): the caller has its answer already,
    /// but the action would stay open in the store — a `409` for every same-key resend. Logged
    /// at WARN with the action; the outcome is recorded as soon as the store commits again
    /// (see `Inner::record_when_store_commits`). The outcome was counted when the caller was
    /// answered.
    pub(super) fn outcome_not_recorded(
        &self,
        run: &Run<'_>,
        result: Option<AttemptResult>,
        finish: Finish,
        e: &EngineError,
    ) {
        let route = &run.spec.route;
        tracing::warn!(
            action = run.id.0,
            task = %run.task(),
            agent = %run.spec.agent,
            route = %route.template,
            outcome = finish.outcome.as_str(),
            error = %e,
            "the store could not record this action's outcome; its caller has its answer, and the outcome is recorded as soon as the store commits again"
        );
        self.inner.record_when_store_commits(writes::Deferred {
            action: run.id,
            result,
            end: writes::DeferredEnd::Outcome(finish),
            count: None,
        });
    }

    /// Ends the action with a gateway-made outcome (no attempt result pending).
    pub(super) async fn finish(
        &self,
        run: &Run<'_>,
        _budget: &ActionBudget,
        outcome: Outcome,
        context: OutcomeContext,
        detail: String,
        attempts: u32,
    ) -> Execution {
        let inner = &self.inner;
        let finish = Finish {
            outcome: store_outcome(outcome),
            context: serde_json::to_value(&context).unwrap_or_default(),
            response: None,
        };
        let (id, at, kept) = (run.id, inner.clock.now(), finish.clone());
        match inner
            .blocking(move |s| s.finish_action(id, finish, at))
            .await
        {
            Ok(()) => {}
            Err(e) if is_store_failure(&e) => self.outcome_not_recorded(run, None, kept, &e),
            // A cancelled task's actions were already ended by the store.
            Err(e) => tracing::debug!(action = id.0, error = %e, "action not finished again"),
        }
        self.ended(run, outcome, context, detail, attempts)
    }

    /// Ends the action `quota_exhausted` with the last attempt's `result` — the provider said
    /// its shared quota is exhausted (`signal`: the boundary it gave, if any, and its error
    /// code) — and hands the scope to a human once (SPEC §8: `shared_quota_exhausted`).
    pub(super) async fn finish_quota_exhausted(
        &self,
        run: &Run<'_>,
        budget: &ActionBudget,
        result: AttemptResult,
        context: OutcomeContext,
        signal: (Option<Timestamp>, Option<&str>),
        attempts: u32,
    ) -> Execution {
        let (boundary, error_code) = signal;
        let detail = quota_escalations::exhausted_detail(boundary, error_code);
        let mut execution = Box::pin(self.finish_with_result(
            run,
            budget,
            result,
            Outcome::QuotaExhausted,
            context,
            detail,
            attempts,
        ))
        .await;
        let why = match error_code {
            Some(code) => format!("the provider answered `{code}`"),
            None => "the provider said the quota is exhausted".to_owned(),
        };
        self.escalate_exhausted_quota(run.id, &why, boundary, &mut execution)
            .await;
        execution
    }

    /// Ends the action with a gateway-made outcome together with the last attempt's result.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn finish_with_result(
        &self,
        run: &Run<'_>,
        _budget: &ActionBudget,
        mut result: AttemptResult,
        outcome: Outcome,
        context: OutcomeContext,
        detail: String,
        attempts: u32,
    ) -> Execution {
        let inner = &self.inner;
        result.finish = Some(Finish {
            outcome: store_outcome(outcome),
            context: serde_json::to_value(&context).unwrap_or_default(),
            response: None,
        });
        self.record_final_result(run, result).await;
        let boundary = context.boundary;
        let mut execution = self.ended(run, outcome, context, detail, attempts);
        // SPEC §8: repeated limits in the scope, and this action still did not fit.
        if matches!(
            outcome,
            Outcome::BudgetExhausted | Outcome::DeadlineExhausted
        ) {
            let route = &run.spec.route;
            let streak = inner
                .limit_streaks
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .longest(&quota_escalations::streak_keys(
                    &route.provider,
                    &route.scopes,
                ));
            if streak >= quota_escalations::ACCOUNT_CONFIGURATION_STREAK {
                self.escalate_repeated_limits(run.id, streak, boundary, &mut execution)
                    .await;
            }
        }
        execution
    }

    /// Counts a gateway-made outcome in the metrics and returns it with the action's receipt
    /// (the store was already told, by [`Self::finish`] or [`Self::finish_with_result`]).
    pub(super) fn ended(
        &self,
        run: &Run<'_>,
        outcome: Outcome,
        context: OutcomeContext,
        detail: String,
        attempts: u32,
    ) -> Execution {
        self.inner
            .metrics
            .outcome(&run.spec.route.provider, &run.spec.route.class, outcome);
        Execution::Outcome {
            receipt: ActionReceipt {
                action_id: run.id.0,
                idempotency_key: run.agent_key(),
                attempts,
                provider_operation_id: None,
                task: run.own_task.clone(),
            },
            outcome,
            context,
            detail,
        }
    }
}
