//! The retry phases of the attempt loop: planning a retry of an answer the class tries again
//! (attempts left, the scope retry quota, then the core's `plan_retry`: full jitter, boundary
//! precedence, stop instead of sleeping into failure), and scheduling it durably.
//!
//! Why apart: this is where "the provider said wait" meets the budget. A plan that stops ends
//! the action with the SPEC §5 context and `next_safe`; a plan that retries records the
//! attempt's result and the retry job before the loop admits the next attempt — a write's
//! retry is never only in memory (SPEC §12).

use std::sync::atomic::Ordering;

use backstop_core::{
    backoff::{plan_retry, DelayCause, RetryDecision, RetryInput, StopReason},
    budget::RetryCause,
    classify::Disposition,
    clock::Clock,
    outcome::{NextSafe, Outcome},
};
use backstop_store::StoreError;
use jiff::Timestamp;

use super::{
    caller_gone, is_store_failure, may_have_committed, upstream_authority, wait_then_abort, Answer,
    Attempt, Engine, EngineError, Interrupted, Next, UnrecordedRetry,
};
use crate::action::Execution;

/// A retry the core planned: sent at `at`, `delay` after the plan was made (`planned_at`).
pub(super) struct Retry {
    at: Timestamp,
    delay: std::time::Duration,
    cause: DelayCause,
    planned_at: Timestamp,
}

/// How a retry's records went: which one the store could not commit, if any.
struct Recorded {
    /// The result, kept while the store may fail: a result it could not record is recorded
    /// with the action's close (see `close_unrecorded_retry`).
    unrecorded: Option<backstop_store::AttemptResult>,
    /// Whether the last failed record of the result may be kept all the same.
    result_maybe_kept: bool,
}

impl Engine {
    /// Plan: attempts left, the scope retry quota, then the core's plan — a retry to schedule,
    /// or the end it stops with.
    pub(super) async fn plan(&self, cx: &mut Attempt<'_, '_>, answer: Answer) -> Next {
        if cx.budget.attempts_remaining() == 0 {
            return Next::Finish(self.out_of_attempts(cx, answer).await);
        }
        let cause = match answer.signal.disposition {
            Disposition::NotSent | Disposition::Uncertain => RetryCause::Timeout,
            _ => RetryCause::ErrorResponse,
        };
        let route = &cx.run.spec.route;
        let withdrawn = match self
            .inner
            .scheduler
            .withdraw_retry(&route.scopes, cause)
            .await
        {
            Ok(withdrawn) => withdrawn,
            Err(refused) => {
                cx.guard.armed = false;
                let boundary = cx.seen.boundary;
                let context =
                    self.context(&cx.budget, &cx.seen, boundary, wait_then_abort(boundary));
                return Next::Finish(
                    Box::pin(self.finish_with_result(
                        cx.run,
                        &cx.budget,
                        answer.result,
                        Outcome::QuotaExhausted,
                        context,
                        refused.to_string(),
                        cx.seen.sent,
                    ))
                    .await,
                );
            }
        };
        cx.pending = Some(withdrawn);
        let inner = &self.inner;
        let planned_at = inner.clock.now();
        let decision = plan_retry(
            &RetryInput {
                retry_number: cx.budget.attempts_used(),
                backoff: inner.policy.backoff.config(),
                boundary: cx.seen.boundary,
                // A lower bound over the ceiling is never a retry instant: the real one is
                // later, so it is beyond any wait and the action ends now.
                wait_budget_remaining: if answer.signal.boundary.is_lower_bound() {
                    std::time::Duration::ZERO
                } else {
                    cx.budget.wait_remaining()
                },
                deadline: cx.budget.deadline(),
            },
            planned_at,
            inner.unit(),
        );
        match decision {
            RetryDecision::Stop {
                outcome,
                reason,
                not_before,
            } => {
                let next_safe = decision.next_safe();
                let stop = self.stop(cx, answer, (outcome, reason, not_before), next_safe);
                Next::Finish(stop.await)
            }
            RetryDecision::RetryAt { at, delay, cause } => Next::Schedule(
                answer,
                Retry {
                    at,
                    delay,
                    cause,
                    planned_at,
                },
            ),
        }
    }

    /// No attempt is left of the class budget: a write one of whose attempts may have been
    /// acted on with nothing settling it is escalated; anything else ends `budget_exhausted`.
    async fn out_of_attempts(&self, cx: &mut Attempt<'_, '_>, answer: Answer) -> Execution {
        let (run, route) = (cx.run, &cx.run.spec.route);
        if cx.seen.unsettled && cx.write() && route.reconcile.is_none() {
            // An earlier attempt may have been acted on, nothing settled it and no lookup can
            // tell (a route with one looked each uncertain attempt up when it came back and
            // found nothing): the write is not "not done", and no attempt is left to resend
            // it under its key — a human decides (the case file offers the same-key resend).
            cx.end(&self.inner.scheduler);
            cx.guard.so_far.in_flight = None;
            let facts = self.write_facts(run, &cx.budget);
            let reason = format!(
                "all {} attempts of the `{}` budget are used, and an earlier attempt may have been acted on (it got no answer, and no later answer under the same key settled it)",
                cx.budget.attempts_used(),
                route.class,
            );
            return Box::pin(self.record_then_escalate(
                run,
                (&cx.budget, &cx.seen),
                (answer.result, answer.received_at),
                &facts,
                &reason,
            ))
            .await;
        }
        cx.guard.armed = false;
        let (budget, seen) = (&cx.budget, &cx.seen);
        let boundary = seen.boundary;
        let context = self.context(budget, seen, boundary, wait_then_abort(boundary));
        let last = match seen.last_failure {
            Some(failure) => format!(
                "{}: {} ({})",
                answer.signal.disposition,
                failure.describe(),
                upstream_authority(&run.request.url)
            ),
            None => answer.signal.disposition.to_string(),
        };
        let detail = if run.spec.single_attempt {
            format!(
                "its body ({} bytes) is over --retry-body-bytes, so backstop sends it once and never retries it (last: {last}); raise --retry-body-bytes to have it retried",
                run.spec.request.body.len(),
            )
        } else {
            format!(
                "all {} attempts of the `{}` budget are used (last: {last})",
                budget.attempts_used(),
                route.class,
            )
        };
        Box::pin(self.finish_with_result(
            run,
            budget,
            answer.result,
            Outcome::BudgetExhausted,
            context,
            detail,
            seen.sent,
        ))
        .await
    }

    /// The core's plan stopped (`outcome`, for `reason`, safe again from `boundary` when it
    /// names one): the action ends — a write whose provider boundary lies beyond its wait is
    /// also handed to a human.
    async fn stop(
        &self,
        cx: &mut Attempt<'_, '_>,
        answer: Answer,
        (outcome, reason, boundary): (Outcome, StopReason, Option<Timestamp>),
        next_safe: Vec<NextSafe>,
    ) -> Execution {
        cx.end(&self.inner.scheduler);
        let (run, route, seen) = (cx.run, &cx.run.spec.route, &cx.seen);
        // `boundary` is the provider's instant only: a stop by backstop's own backoff
        // shows the provider's (if it gave one) there, and its own instant in
        // `next_safe`'s `wait_until` and the detail.
        let provider_boundary = if reason.is_provider_boundary() {
            boundary
        } else {
            seen.boundary
        };
        let context = self.context(&cx.budget, seen, provider_boundary, next_safe);
        let detail = match (boundary, reason.is_provider_boundary()) {
            (Some(at), true) => format!(
                "the provider allows a retry only at {at}: {}; not sleeping into failure",
                reason.describe()
            ),
            (Some(at), false) => {
                let provider = match seen.boundary {
                    Some(b) => format!("the provider's boundary is {b}"),
                    None => "the provider gave no boundary".to_owned(),
                };
                format!("backstop's own backoff allows the next retry only at {at} ({provider}): {}; not retrying early", reason.describe())
            }
            (None, _) => format!("no retry: {}", reason.describe()),
        };
        tracing::info!(
            task = %run.task(),
            route = %route.template,
            outcome = %outcome,
            reason = reason.describe(),
            "retry refused by the plan"
        );
        let Answer { signal, result, .. } = answer;
        // One name per signal: a quota-exhausted answer ends `quota_exhausted`
        // whatever its reset, beyond the budget or not, with the boundary and the
        // scope's `shared_quota_exhausted` escalation (SPEC §8).
        if signal.disposition == Disposition::QuotaExhausted {
            return Box::pin(self.finish_quota_exhausted(
                run,
                &cx.budget,
                result,
                context,
                (boundary, signal.error_code.as_deref()),
                seen.sent,
            ))
            .await;
        }
        let escalate = reason.is_provider_boundary() && route.class != "read";
        let reason_detail = detail.clone();
        let mut execution = Box::pin(
            self.finish_with_result(run, &cx.budget, result, outcome, context, detail, seen.sent),
        )
        .await;
        // SPEC §13 step 5 / §8: a write whose provider boundary lies beyond its
        // remaining wait or deadline is also handed to a human; a read only ends.
        if escalate {
            Box::pin(self.escalate_stopped_write(run.id, &reason_detail, boundary, &mut execution))
                .await;
        }
        execution
    }

    /// Schedule: the attempt's result and the retry job are recorded before the loop admits
    /// the next attempt at `retry.at`.
    pub(super) async fn schedule(
        &self,
        cx: &mut Attempt<'_, '_>,
        answer: Answer,
        retry: Retry,
    ) -> Next {
        let inner = &self.inner;
        let (run, route) = (cx.run, &cx.run.spec.route);
        let received_at = answer.received_at;
        let mut recorded = Recorded {
            unrecorded: Some(answer.result.clone()),
            result_maybe_kept: false,
        };
        let result = answer.result;
        match inner
            .blocking(move |s| s.record_result(result, received_at))
            .await
        {
            Ok(()) => recorded.unrecorded = None,
            Err(e) => {
                recorded.failed(&e);
                tracing::warn!(action = run.id.0, task = %run.task(), agent = %run.spec.agent, route = %run.spec.route.template, error = %e, "could not record the result");
            }
        }
        cx.guard.so_far.in_flight = None;
        caller_gone::attempt_out(false);
        let scheduled = self.schedule_retry(cx, &retry).await;
        let scheduled = self
            .record_before_retry(cx, scheduled, &mut recorded, received_at)
            .await;
        if let Err(e) = scheduled {
            return Next::Finish(self.not_scheduled(cx, e, recorded).await);
        }
        let (
            signal,
            Retry {
                at, delay, cause, ..
            },
        ) = (&answer.signal, retry);
        tracing::info!(
            action = run.id.0,
            task = %run.task(),
            route = %route.template,
            disposition = %signal.disposition,
            retry_at = %at,
            delay_ms = delay.as_millis() as u64,
            cause = ?cause,
            attempts_left = cx.budget.attempts_remaining(),
            wait_left_ms = cx.budget.wait_remaining().as_millis() as u64,
            "retry scheduled"
        );
        cx.retry_job = true;
        cx.not_before = Some(at);
        Next::Admit
    }

    /// Records the retry job. A read needs no durable wake (SPEC §12: reads may be recorded
    /// asynchronously, and nothing resumes a read after a restart): when its records could not
    /// be committed (a full disk), it waits in memory and is retried, as it is answered,
    /// rather than ended.
    async fn schedule_retry(&self, cx: &Attempt<'_, '_>, retry: &Retry) -> Result<(), EngineError> {
        let run = cx.run;
        let (id, at, planned_at) = (run.id, retry.at, retry.planned_at);
        match self
            .inner
            .blocking(move |s| s.schedule_retry(id, at, planned_at))
            .await
        {
            Err(e) if !cx.write() => {
                tracing::warn!(
                    action = run.id.0,
                    task = %run.task(),
                    route = %run.spec.route.template,
                    error = %e,
                    "a read's retry could not be recorded; it is retried from memory"
                );
                Ok(())
            }
            other => other.map(drop),
        }
    }

    /// The store failed on the result and worked again for the schedule (a disk that
    /// hiccuped): the result is recorded now, before the retry may leave, so the attempt does
    /// not stay `sent` without a result (read as uncertain after a restart) and the log does
    /// not lack its `action_result`.
    async fn record_before_retry(
        &self,
        cx: &Attempt<'_, '_>,
        scheduled: Result<(), EngineError>,
        recorded: &mut Recorded,
        received_at: Timestamp,
    ) -> Result<(), EngineError> {
        let run = cx.run;
        let Some(result) = recorded.unrecorded.as_ref().filter(|_| scheduled.is_ok()) else {
            return scheduled;
        };
        let result = result.clone();
        match self
            .inner
            .blocking(move |s| s.record_result(result, received_at))
            .await
        {
            Ok(()) => {
                recorded.unrecorded = None;
                Ok(())
            }
            // A read is retried from memory all the same (as above).
            Err(e) if !cx.write() => {
                tracing::warn!(action = run.id.0, task = %run.task(), route = %run.spec.route.template, error = %e, "a read's attempt result could not be recorded; it is retried from memory");
                Ok(())
            }
            Err(e) => {
                recorded.failed(&e);
                Err(e)
            }
        }
    }

    /// The store did not record the retry (`e`): nothing of it leaves, and the action ends.
    async fn not_scheduled(
        &self,
        cx: &mut Attempt<'_, '_>,
        e: EngineError,
        recorded: Recorded,
    ) -> Execution {
        let inner = &self.inner;
        cx.end(&inner.scheduler);
        let (run, budget, seen) = (cx.run, &cx.budget, &cx.seen);
        if is_store_failure(&e) {
            // Nothing of the retry left; the action is closed (an uncertain
            // write reconciled) once the store commits again, never left open
            // with no retry job (at shutdown the next start finds it).
            if inner.shutting_down.load(Ordering::SeqCst) {
                let interrupted = if recorded.unrecorded.is_some() {
                    Interrupted::Result
                } else {
                    Interrupted::Schedule
                };
                return self.stopped_by_store_after_sending(
                    run,
                    seen,
                    &e,
                    interrupted,
                    recorded.result_maybe_kept,
                );
            }
            let step = UnrecordedRetry::Schedule {
                result: recorded.unrecorded.map(Box::new),
            };
            self.close_unrecorded_retry(run, budget, seen, step);
            let receipt = run.receipt(seen.sent);
            return self.store_unavailable(run.spec, receipt, seen.sent > 0, &e);
        }
        if seen.unsettled && cx.write() {
            // Its task was cancelled while this attempt was out (the store
            // refuses a retry of an open action for nothing else): reconciled,
            // never `cancelled`.
            return Box::pin(self.cancelled_while_unsettled(run, budget, seen, true)).await;
        }
        tracing::warn!(action = run.id.0, error = %e, "the retry could not be scheduled");
        let context = self.context(budget, seen, seen.boundary, vec![NextSafe::Abort]);
        // The store refuses a retry of an open action only for its task's
        // cancellation: said in the agent's words, not the store's.
        let detail = match &e {
            EngineError::Store(StoreError::InvalidTransition { .. }) => format!(
                "task `{}` was cancelled while this attempt was out, so no retry is sent; the provider's answer to it is in last_status",
                run.task()
            ),
            _ => "the retry could not be scheduled, so no retry is sent".to_owned(),
        };
        Box::pin(self.finish(run, budget, Outcome::Cancelled, context, detail, seen.sent)).await
    }
}

impl Recorded {
    /// The store failed on the result with `e`: a refusal that is no store failure is not
    /// recorded later; whether it may have been committed all the same is kept.
    fn failed(&mut self, e: &EngineError) {
        if !is_store_failure(e) {
            self.unrecorded = None;
        }
        self.result_maybe_kept = may_have_committed(e);
    }
}
