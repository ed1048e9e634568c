//! The attempt loop of one recorded action, as phases over one context.

use backstop_core::clock::Clock;
use backstop_core::{
    backoff::{plan_retry, RetryDecision, RetryInput},
    budget::{ActionBudget, RetryCause},
    classify::{classify, Disposition, Observed, ResponseView, TransportError},
    outcome::{NextSafe, Outcome},
    reconcile::operation_id_from_response,
    signal_headers::{carries_retry_after, select_signal_headers},
};
use backstop_store::{AttemptResult, Boundary as StoreBoundary, Finish, StoreError};
use jiff::Timestamp;
use std::sync::atomic::Ordering;

use super::{
    caller_gone, is_store_failure, kept_for_replay, may_have_committed, problem_answer,
    quota_escalations, read_bounded, store_disposition, unrecorded, upstream_authority,
    wait_then_abort, with_ids, without_provider_replay_mark, writes, ActionGuard, Engine,
    EngineError, Interrupted, Run, Stopped, UnrecordedRetry, ERROR_BODY_LIMIT,
};
use crate::{
    action::{ActionReceipt, Execution},
    problem::Problem,
    scheduler::{AcquireRequest, Acquired, RetryTokens},
    transport::AttemptReply,
};

/// What has been seen of an action so far (for the SPEC §5 context).
#[derive(Debug, Default)]
pub(super) struct Seen {
    pub(super) sent: u32,
    /// Attempts whose request bytes may have left the process (every one not `not_sent`): what
    /// an outcome's `sent` reports.
    pub(super) left: u32,
    pub(super) response_received: bool,
    pub(super) last_status: Option<u16>,
    /// The disposition of the last answer (`rate_limited`, `success`, …).
    pub(super) last_signal: Option<&'static str>,
    /// Whether an attempt (this run's or an earlier one's) may have been acted on and no later
    /// answer settled it ([`writes::still_unsettled`]).
    pub(super) unsettled: bool,
    /// How the last attempt failed when it got no complete answer (`None` after a response).
    pub(super) last_failure: Option<TransportError>,
    pub(super) boundary: Option<Timestamp>,
}

impl Engine {
    /// The attempt loop of one recorded action.
    pub(super) async fn attempts(
        &self,
        run: &Run<'_>,
        mut budget: ActionBudget,
        guard: &mut ActionGuard<'_>,
    ) -> Execution {
        let inner = &self.inner;
        let spec = run.spec;
        let route = &spec.route;
        let provider = inner.policy.providers.get(&route.provider);
        let mut seen = Seen {
            sent: run.prior.sent,
            left: run.prior.sent,
            unsettled: run.prior.unsettled,
            response_received: run.prior.last_status.is_some(),
            last_status: run.prior.last_status,
            last_signal: run.prior.last_signal,
            ..Seen::default()
        };
        let mut not_before: Option<Timestamp> = None;
        // Tokens of retries that were sent (refunded if the action succeeds) and of the planned
        // retry not sent yet (refunded if it never leaves).
        let mut spent: Option<RetryTokens> = None;
        let mut pending: Option<RetryTokens> = None;
        // Whether this loop scheduled a retry job (then the only way round the loop again): the
        // next attempt's `action_sent` claims it (see `Store::mark_attempt_sent`).
        let mut retry_job = false;
        loop {
            let acquired = inner
                .scheduler
                .acquire(AcquireRequest {
                    task_id: run.task().to_owned(),
                    agent: spec.agent.clone(),
                    priority: run.priority,
                    scopes: route.scopes.clone(),
                    budget,
                    not_before,
                    route: route.template.clone(),
                    reconciliation: false,
                })
                .await;
            let permit = match acquired {
                Acquired::Go {
                    permit,
                    budget: charged,
                } => {
                    budget = charged;
                    if let Some(RetryTokens(tokens)) = pending.take() {
                        spent
                            .get_or_insert_with(RetryTokens::default)
                            .0
                            .extend(tokens);
                    }
                    permit
                }
                Acquired::Refused {
                    outcome,
                    detail,
                    budget: charged,
                    boundary,
                    not_before,
                } => {
                    budget = charged;
                    guard.armed = false;
                    if let Some(tokens) = pending.take() {
                        inner.scheduler.deposit(&route.scopes, Some(tokens));
                    }
                    let boundary = boundary.or(seen.boundary.filter(|b| *b > inner.clock.now()));
                    // Safe to send again from the later of the provider's boundary and the
                    // instant the dispatch check would have waited for (local pacing too).
                    let next_safe = match outcome {
                        Outcome::Cancelled => vec![NextSafe::Abort],
                        _ => wait_then_abort(boundary.max(not_before)),
                    };
                    if outcome == Outcome::Cancelled && seen.unsettled && run.spec.has_side_effect()
                    {
                        // The cancellation reconciles it: the store lists it, as it does every
                        // write with an unsettled attempt not in flight.
                        return Box::pin(
                            self.cancelled_while_unsettled(run, &budget, &seen, false),
                        )
                        .await;
                    }
                    let context = self.context(&budget, &seen, boundary, next_safe);
                    if outcome == Outcome::Cancelled {
                        // The scheduler refuses only for a cancelled task, and the task's
                        // cancellation ends this action in the store (with its retry job) in
                        // the same operation that reports what it dropped: ending it here too
                        // would race that report and leave it uncounted.
                        return self.ended(run, outcome, context, detail, seen.sent);
                    }
                    return Box::pin(
                        self.finish(run, &budget, outcome, context, detail, seen.sent),
                    )
                    .await;
                }
                Acquired::Stopped { .. } => {
                    guard.armed = false;
                    tracing::info!(
                        action = run.id.0,
                        attempts = seen.sent,
                        "shutting down: the waiting caller is answered 503"
                    );
                    if seen.sent > 0 {
                        return self.stopped_after_sending(run, &seen, Stopped::Waiting);
                    }
                    let detail = "backstop is shutting down; nothing was sent for this request, so sending it again is safe";
                    let receipt = run.receipt(seen.sent);
                    let problem =
                        with_ids(Problem::shutting_down_during(false, detail), spec, &receipt);
                    return problem_answer(receipt, problem);
                }
            };

            // A write's attempt is durable before the bytes leave. A read's is queued behind its
            // action's earlier records and goes without waiting (SPEC §12); its attempts are
            // numbered by this loop, the only one that sends a read's action.
            let (id, sent_at) = (run.id, inner.clock.now());
            let marked = if !run.spec.has_side_effect() {
                inner
                    .store
                    .submit_attempt_sent(id, sent_at, run.read_completion("attempt"));
                Ok(seen.sent + 1)
            } else {
                inner
                    .queued(move |s, done| s.submit_attempt_sent(id, sent_at, done))
                    .await
            };
            let attempt = match marked {
                Ok(n) => n,
                Err(e) => {
                    drop(permit);
                    guard.armed = false;
                    if is_store_failure(&e) {
                        // Nothing of this attempt left. A waiting retry keeps its job, unclaimed:
                        // the action is closed once the store commits again, never left waiting
                        // for a wake that nothing arms (at shutdown the next start re-arms it).
                        // A write's first send frees its key for the agent's resend under it,
                        // which sends it as this action.
                        let stopping = inner.shutting_down.load(Ordering::SeqCst);
                        if retry_job && !stopping {
                            self.close_unrecorded_retry(
                                run,
                                &budget,
                                &seen,
                                UnrecordedRetry::Start,
                            );
                        } else if seen.sent == 0 && run.spec.has_side_effect() {
                            inner
                                .unsent
                                .lock()
                                .unwrap_or_else(|poisoned| poisoned.into_inner())
                                .insert(run.id.0);
                        }
                        if stopping && seen.sent > 0 {
                            return self.stopped_by_store_after_sending(
                                run,
                                &seen,
                                &e,
                                Interrupted::Send,
                                may_have_committed(&e),
                            );
                        }
                        let receipt = run.receipt(seen.sent);
                        return self.store_unavailable(spec, receipt, seen.sent > 0, &e);
                    }
                    if seen.unsettled && run.spec.has_side_effect() {
                        // Its task was cancelled while it waited (the store refuses a send for
                        // nothing else of an open action), and the cancellation, which the store
                        // listed it to, reconciles it: never `cancelled`.
                        return Box::pin(
                            self.cancelled_while_unsettled(run, &budget, &seen, false),
                        )
                        .await;
                    }
                    let detail = match &e {
                        EngineError::Store(StoreError::InvalidTransition { reason, .. }) => {
                            format!("the action may not send again: {reason}")
                        }
                        _ => "the action may not send again".to_owned(),
                    };
                    let context = self.context(&budget, &seen, None, vec![NextSafe::Abort]);
                    return Box::pin(self.finish(
                        run,
                        &budget,
                        Outcome::Cancelled,
                        context,
                        detail,
                        seen.sent,
                    ))
                    .await;
                }
            };
            seen.sent += 1;
            guard.so_far.sent = seen.sent;
            guard.so_far.in_flight = Some(attempt);
            caller_gone::attempt_out(true);
            tracing::debug!(
                task = %run.task(),
                route = %route.template,
                attempt,
                "attempt sent"
            );
            let handed_at = inner.clock.now();
            let Some(reply) = inner
                .unless_given_up(inner.transport.send(run.request.as_ref().clone()))
                .await
            else {
                // The stop's grace is running out and the provider has not answered: the
                // caller is told what the next start does rather than have its connection cut.
                // The attempt stays sent without a result (SPEC §12).
                drop(permit);
                guard.armed = false;
                if let Some(tokens) = pending.take() {
                    inner.scheduler.deposit(&route.scopes, Some(tokens));
                }
                seen.left += 1;
                seen.last_signal = Some(Disposition::Uncertain.as_str());
                seen.unsettled = writes::still_unsettled(seen.unsettled, "uncertain");
                tracing::info!(
                    action = run.id.0,
                    attempt,
                    "shutting down: the grace ran out before the provider answered; the attempt stays sent without a result, and the caller is answered 503"
                );
                return self.stopped_after_sending(run, &seen, Stopped::GaveUp);
            };
            let reply = without_provider_replay_mark(reply);
            drop(permit);
            let received_at = inner.clock.now();
            inner.metrics.observe_upstream_attempt(
                &route.provider,
                received_at.duration_since(handed_at).as_secs_f64(),
            );

            // Classify (never read a 2xx body). The response's signal headers are kept as
            // evidence unless it is a plain success (a 2xx without a Retry-After).
            let (signal, response, signal_headers) = match reply {
                AttemptReply::Response(response) if response.status().is_success() => {
                    let signal = classify(
                        &Observed::Response(ResponseView {
                            status: response.status().as_u16(),
                            headers: response.headers(),
                            body: None,
                        }),
                        &run.rules,
                        received_at,
                    );
                    let kept = if carries_retry_after(response.headers()) {
                        select_signal_headers(response.headers())
                    } else {
                        Vec::new()
                    };
                    (signal, Some(response), kept)
                }
                AttemptReply::Response(response) => {
                    let (parts, body) = response.into_parts();
                    let kept = select_signal_headers(&parts.headers);
                    match read_bounded(body, ERROR_BODY_LIMIT).await {
                        Ok((bytes, body)) => {
                            let signal = classify(
                                &Observed::Response(ResponseView {
                                    status: parts.status.as_u16(),
                                    headers: &parts.headers,
                                    body: Some(&bytes),
                                }),
                                &run.rules,
                                received_at,
                            );
                            (signal, Some(http::Response::from_parts(parts, body)), kept)
                        }
                        Err(_) => {
                            seen.last_failure = Some(TransportError::ResponseCut);
                            (
                                classify(
                                    &Observed::Transport(TransportError::ResponseCut),
                                    &run.rules,
                                    received_at,
                                ),
                                None,
                                kept,
                            )
                        }
                    }
                }
                AttemptReply::Failed(e) => {
                    seen.last_failure = Some(e);
                    (
                        classify(&Observed::Transport(e), &run.rules, received_at),
                        None,
                        Vec::new(),
                    )
                }
            };
            let status = response.as_ref().map(|r| r.status().as_u16());
            if status.is_some() {
                seen.last_failure = None;
                seen.response_received = true;
                seen.last_status = status;
            }
            if signal.disposition != Disposition::NotSent {
                seen.left += 1;
            }
            seen.last_signal = Some(signal.disposition.as_str());
            seen.unsettled = writes::still_unsettled(seen.unsettled, signal.disposition.as_str());
            guard.so_far.last_signal = seen.last_signal;
            guard.so_far.unsettled = seen.unsettled;
            guard.so_far.last_status = seen.last_status;
            seen.boundary = signal.boundary.retry_not_before();
            // One count per scope of the route, or one under `-` for a route without scopes.
            let scope_labels = std::iter::once("-")
                .filter(|_| route.scopes.is_empty())
                .chain(route.scopes.iter().map(String::as_str));
            for scope in scope_labels {
                inner
                    .metrics
                    .attempt(&route.provider, scope, &route.class, signal.disposition);
            }
            {
                let mut streaks = inner
                    .limit_streaks
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
                if streaks.would_change(signal.disposition) {
                    streaks.note(
                        &quota_escalations::streak_keys(&route.provider, &route.scopes),
                        signal.disposition,
                    );
                }
            }

            // Scope records first: quota headers, then a rate limit's boundary.
            self.update_scopes(run, &signal, status, received_at).await;

            let store_boundary = Some(match seen.boundary {
                Some(at) => StoreBoundary::At(at),
                None => StoreBoundary::Unknown,
            });
            let source = match &signal.boundary {
                backstop_core::retry_after::Boundary::Known { source, .. } => Some(source.clone()),
                backstop_core::retry_after::Boundary::Unknown { source, .. } => source.clone(),
            };
            let mut result = AttemptResult {
                action: run.id,
                attempt,
                status,
                disposition: store_disposition(signal.disposition),
                boundary: store_boundary,
                source,
                provider_operation_id: None,
                signal_headers,
                finish: None,
            };

            // An uncertain write is reconciled before anything else happens (SPEC §6).
            let mut resend_same_key = false;
            if signal.disposition == Disposition::Uncertain && run.spec.has_side_effect() {
                let facts = self.write_facts(run, &budget);
                let Ok(end) =
                    Box::pin(inner.reconcile_uncertain(&facts, Some(&run.request.headers))).await
                else {
                    // The gateway is stopping: no lookup left, so nothing is known of the write
                    // and nothing is recorded for it. Its attempt stays `sent` without a result,
                    // which the next start reconciles with its original key (SPEC §12); our own
                    // stop is no reason to escalate it.
                    guard.armed = false;
                    if let Some(tokens) = pending.take() {
                        inner.scheduler.deposit(&route.scopes, Some(tokens));
                    }
                    tracing::info!(
                        action = run.id.0,
                        attempt,
                        "shutting down: the write's attempt was sent and its answer never came; it stays sent without a result, and the next start reconciles it with its original key"
                    );
                    return self.stopped_after_sending(run, &seen, Stopped::NotReconciled);
                };
                match end {
                    writes::UncertainEnd::Found { operation_id } => {
                        guard.armed = false;
                        self.breaker_success(run);
                        inner.scheduler.deposit(&route.scopes, spent.take());
                        if let Some(tokens) = pending.take() {
                            inner.scheduler.deposit(&route.scopes, Some(tokens));
                        }
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
                        let context = self.context(&budget, &seen, None, Vec::new());
                        let stored = serde_json::to_value(&context)
                            .unwrap_or_else(|_| serde_json::json!({}));
                        let (id, op, at) = (run.id, operation_id.clone(), inner.clock.now());
                        let kept_context = stored.clone();
                        if let Err(e) = inner
                            .blocking(move |s| {
                                s.record_reconciled_with_context(id, op, kept_context, at)
                            })
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
                            ..run.receipt(seen.sent)
                        };
                        return Execution::Outcome {
                            receipt,
                            outcome: Outcome::Succeeded,
                            context,
                            detail: match operation_id {
                                Some(op) => format!("reconciled: the provider has this write as `{op}`; it was not sent again"),
                                None => "reconciled: the provider has this write; it was not sent again".to_owned(),
                            },
                        };
                    }
                    // The lookup is a read of the provider's state, not a resend: it never
                    // spends the write's attempts. A resend does; when the class has none left
                    // (an `uncertain_write` allows one), a human decides instead.
                    writes::UncertainEnd::RetrySameKey if budget.attempts_remaining() > 0 => {
                        resend_same_key = true;
                    }
                    end => {
                        let reason = match end {
                            writes::UncertainEnd::Escalate { reason } => reason,
                            // `RetrySameKey` with no attempt left (`Found` returned above).
                            _ => format!(
                                "the provider honours the idempotency key, but the `{}` class allows no further attempt, so resending under the same key is an operator's decision",
                                route.class
                            ),
                        };
                        guard.armed = false;
                        if let Some(tokens) = pending.take() {
                            inner.scheduler.deposit(&route.scopes, Some(tokens));
                        }
                        guard.so_far.in_flight = None;
                        return Box::pin(self.record_then_escalate(
                            run,
                            (&budget, &seen),
                            (result, received_at),
                            &facts,
                            &reason,
                        ))
                        .await;
                    }
                }
            }

            if signal.disposition == Disposition::Success {
                guard.armed = false;
                let Some(mut response) = response else {
                    return unrecorded(
                        Outcome::Cancelled,
                        "internal: a success without a response".to_owned(),
                    );
                };
                // A write's final response is kept for idempotent replay (bounded, never
                // audited), and its operation id is read from the same bounded prefix. An
                // event stream is never buffered: only its status and headers are kept.
                let mut replay_record = None;
                if run.spec.has_side_effect() {
                    let rc = route.reconcile.as_ref();
                    let wants_id = rc.is_some_and(|rc| rc.operation_id_pointer.is_some());
                    let (passed_on, record, bytes) =
                        kept_for_replay(response, run.id, wants_id).await;
                    if let Some(rc) = rc {
                        result.provider_operation_id = operation_id_from_response(rc, &bytes);
                    }
                    replay_record = Some(record);
                    response = passed_on;
                }
                self.breaker_success(run);
                inner.scheduler.deposit(&route.scopes, spent.take());
                let context = self.context(&budget, &seen, None, Vec::new());
                result.finish = Some(Finish {
                    outcome: backstop_store::Outcome::Succeeded,
                    context: serde_json::to_value(&context).unwrap_or_default(),
                    response: replay_record,
                });
                if !run.spec.has_side_effect() {
                    // A read's result is recorded with the next group commit (SPEC §12).
                    inner
                        .store
                        .submit_result(result, received_at, run.read_completion("result"));
                } else {
                    let kept = result.clone();
                    if let Err(e) = inner
                        .queued(move |s, done| s.submit_result(result, received_at, done))
                        .await
                    {
                        self.final_result_not_recorded(run, kept, &e);
                    }
                }
                inner
                    .metrics
                    .outcome(&route.provider, &route.class, Outcome::Succeeded);
                return Execution::Response {
                    receipt: run.receipt(seen.sent),
                    response,
                };
            }

            // An uncertain READ changed nothing at the provider: it is retried within the read
            // class budget like any transient failure, never left `reconciliation_required`.
            let tried_again =
                backstop_core::classify::tried_again(&signal, run.spec.has_side_effect());
            if !tried_again && !resend_same_key {
                guard.armed = false;
                return Box::pin(
                    self.final_failure(
                        run,
                        &budget,
                        &seen,
                        signal,
                        response,
                        result,
                        provider
                            .and_then(|p| p.idempotency_header.as_ref())
                            .is_some(),
                    ),
                )
                .await;
            }

            // Retryable: attempts left, retry quota, then the core's plan.
            if budget.attempts_remaining() == 0
                && seen.unsettled
                && run.spec.has_side_effect()
                && route.reconcile.is_none()
            {
                // An earlier attempt may have been acted on, nothing settled it and no lookup can
                // tell (a route with one looked each uncertain attempt up when it came back and
                // found nothing): the write is not "not done", and no attempt is left to resend
                // it under its key — a human decides (the case file offers the same-key resend).
                guard.armed = false;
                if let Some(tokens) = pending.take() {
                    inner.scheduler.deposit(&route.scopes, Some(tokens));
                }
                guard.so_far.in_flight = None;
                let facts = self.write_facts(run, &budget);
                let reason = format!(
                    "all {} attempts of the `{}` budget are used, and an earlier attempt may have been acted on (it got no answer, and no later answer under the same key settled it)",
                    budget.attempts_used(),
                    route.class,
                );
                return Box::pin(self.record_then_escalate(
                    run,
                    (&budget, &seen),
                    (result, received_at),
                    &facts,
                    &reason,
                ))
                .await;
            }
            if budget.attempts_remaining() == 0 {
                guard.armed = false;
                let boundary = seen.boundary;
                let context = self.context(&budget, &seen, boundary, wait_then_abort(boundary));
                let last = match seen.last_failure {
                    Some(failure) => format!(
                        "{}: {} ({})",
                        signal.disposition,
                        failure.describe(),
                        upstream_authority(&run.request.url)
                    ),
                    None => signal.disposition.to_string(),
                };
                let detail = if spec.single_attempt {
                    format!(
                        "its body ({} bytes) is over --retry-body-bytes, so backstop sends it once and never retries it (last: {last}); raise --retry-body-bytes to have it retried",
                        spec.request.body.len(),
                    )
                } else {
                    format!(
                        "all {} attempts of the `{}` budget are used (last: {last})",
                        budget.attempts_used(),
                        route.class,
                    )
                };
                return Box::pin(self.finish_with_result(
                    run,
                    &budget,
                    result,
                    Outcome::BudgetExhausted,
                    context,
                    detail,
                    seen.sent,
                ))
                .await;
            }
            let cause = match signal.disposition {
                Disposition::NotSent | Disposition::Uncertain => RetryCause::Timeout,
                _ => RetryCause::ErrorResponse,
            };
            let withdrawn = match inner.scheduler.withdraw_retry(&route.scopes, cause).await {
                Ok(withdrawn) => withdrawn,
                Err(refused) => {
                    guard.armed = false;
                    let boundary = seen.boundary;
                    let context = self.context(&budget, &seen, boundary, wait_then_abort(boundary));
                    return Box::pin(self.finish_with_result(
                        run,
                        &budget,
                        result,
                        Outcome::QuotaExhausted,
                        context,
                        refused.to_string(),
                        seen.sent,
                    ))
                    .await;
                }
            };
            pending = Some(withdrawn);
            let plan_now = inner.clock.now();
            let decision = plan_retry(
                &RetryInput {
                    retry_number: budget.attempts_used(),
                    backoff: inner.policy.backoff.config(),
                    boundary: seen.boundary,
                    // A lower bound over the ceiling is never a retry instant: the real one is
                    // later, so it is beyond any wait and the action ends now.
                    wait_budget_remaining: if signal.boundary.is_lower_bound() {
                        std::time::Duration::ZERO
                    } else {
                        budget.wait_remaining()
                    },
                    deadline: budget.deadline(),
                },
                plan_now,
                inner.unit(),
            );
            match decision {
                RetryDecision::Stop {
                    outcome,
                    reason,
                    not_before: boundary,
                } => {
                    guard.armed = false;
                    if let Some(tokens) = pending.take() {
                        inner.scheduler.deposit(&route.scopes, Some(tokens));
                    }
                    // `boundary` is the provider's instant only: a stop by backstop's own backoff
                    // shows the provider's (if it gave one) there, and its own instant in
                    // `next_safe`'s `wait_until` and the detail.
                    let provider_boundary = if reason.is_provider_boundary() {
                        boundary
                    } else {
                        seen.boundary
                    };
                    let context =
                        self.context(&budget, &seen, provider_boundary, decision.next_safe());
                    let detail = match (boundary, reason.is_provider_boundary()) {
                        (Some(at), true) => format!("the provider allows a retry only at {at}: {}; not sleeping into failure", reason.describe()),
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
                    // One name per signal: a quota-exhausted answer ends `quota_exhausted`
                    // whatever its reset, beyond the budget or not, with the boundary and the
                    // scope's `shared_quota_exhausted` escalation (SPEC §8).
                    if signal.disposition == Disposition::QuotaExhausted {
                        return Box::pin(self.finish_quota_exhausted(
                            run,
                            &budget,
                            result,
                            context,
                            (boundary, signal.error_code.as_deref()),
                            seen.sent,
                        ))
                        .await;
                    }
                    let escalate = reason.is_provider_boundary() && route.class != "read";
                    let reason_detail = detail.clone();
                    let mut execution = Box::pin(self.finish_with_result(
                        run, &budget, result, outcome, context, detail, seen.sent,
                    ))
                    .await;
                    // SPEC §13 step 5 / §8: a write whose provider boundary lies beyond its
                    // remaining wait or deadline is also handed to a human; a read only ends.
                    if escalate {
                        Box::pin(self.escalate_stopped_write(
                            run.id,
                            &reason_detail,
                            boundary,
                            &mut execution,
                        ))
                        .await;
                    }
                    return execution;
                }
                RetryDecision::RetryAt { at, delay, cause } => {
                    // Kept while the store may fail: a result it could not record is recorded
                    // with the action's close (see `close_unrecorded_retry`).
                    let mut unrecorded = Some(result.clone());
                    // Whether the last failed record of the result may be kept all the same.
                    let mut result_maybe_kept = false;
                    match inner
                        .blocking(move |s| s.record_result(result, received_at))
                        .await
                    {
                        Ok(()) => unrecorded = None,
                        Err(e) => {
                            if !is_store_failure(&e) {
                                unrecorded = None;
                            }
                            result_maybe_kept = may_have_committed(&e);
                            tracing::warn!(action = run.id.0, task = %run.task(), agent = %run.spec.agent, route = %run.spec.route.template, error = %e, "could not record the result");
                        }
                    }
                    guard.so_far.in_flight = None;
                    caller_gone::attempt_out(false);
                    let id = run.id;
                    let scheduled = match inner
                        .blocking(move |s| s.schedule_retry(id, at, plan_now))
                        .await
                    {
                        // A read needs no durable wake (SPEC §12: reads may be recorded
                        // asynchronously, and nothing resumes a read after a restart): when its
                        // records could not be committed (a full disk), it waits in memory and
                        // is retried, as it is answered, rather than ended.
                        Err(e) if !run.spec.has_side_effect() => {
                            tracing::warn!(
                                action = run.id.0,
                                task = %run.task(),
                                route = %route.template,
                                error = %e,
                                "a read's retry could not be recorded; it is retried from memory"
                            );
                            Ok(())
                        }
                        other => other.map(drop),
                    };
                    // The store failed on the result and worked again for the schedule (a disk
                    // that hiccuped): the result is recorded now, before the retry may leave,
                    // so the attempt does not stay `sent` without a result (read as uncertain
                    // after a restart) and the log does not lack its `action_result`.
                    let scheduled = match (scheduled, &unrecorded) {
                        (Ok(()), Some(result)) => {
                            let result = result.clone();
                            match inner
                                .blocking(move |s| s.record_result(result, received_at))
                                .await
                            {
                                Ok(()) => {
                                    unrecorded = None;
                                    Ok(())
                                }
                                // A read is retried from memory all the same (as above).
                                Err(e) if !run.spec.has_side_effect() => {
                                    tracing::warn!(action = run.id.0, task = %run.task(), route = %route.template, error = %e, "a read's attempt result could not be recorded; it is retried from memory");
                                    Ok(())
                                }
                                Err(e) => {
                                    if !is_store_failure(&e) {
                                        unrecorded = None;
                                    }
                                    result_maybe_kept = may_have_committed(&e);
                                    Err(e)
                                }
                            }
                        }
                        (scheduled, _) => scheduled,
                    };
                    if let Err(e) = scheduled {
                        guard.armed = false;
                        if let Some(tokens) = pending.take() {
                            inner.scheduler.deposit(&route.scopes, Some(tokens));
                        }
                        if is_store_failure(&e) {
                            // Nothing of the retry left; the action is closed (an uncertain
                            // write reconciled) once the store commits again, never left open
                            // with no retry job (at shutdown the next start finds it).
                            if inner.shutting_down.load(Ordering::SeqCst) {
                                let interrupted = if unrecorded.is_some() {
                                    Interrupted::Result
                                } else {
                                    Interrupted::Schedule
                                };
                                return self.stopped_by_store_after_sending(
                                    run,
                                    &seen,
                                    &e,
                                    interrupted,
                                    result_maybe_kept,
                                );
                            }
                            let step = UnrecordedRetry::Schedule {
                                result: unrecorded.map(Box::new),
                            };
                            self.close_unrecorded_retry(run, &budget, &seen, step);
                            let receipt = run.receipt(seen.sent);
                            return self.store_unavailable(spec, receipt, seen.sent > 0, &e);
                        }
                        if seen.unsettled && run.spec.has_side_effect() {
                            // Its task was cancelled while this attempt was out (the store
                            // refuses a retry of an open action for nothing else): reconciled,
                            // never `cancelled`.
                            return Box::pin(
                                self.cancelled_while_unsettled(run, &budget, &seen, true),
                            )
                            .await;
                        }
                        tracing::warn!(action = run.id.0, error = %e, "the retry could not be scheduled");
                        let context =
                            self.context(&budget, &seen, seen.boundary, vec![NextSafe::Abort]);
                        // The store refuses a retry of an open action only for its task's
                        // cancellation: said in the agent's words, not the store's.
                        let detail = match &e {
                            EngineError::Store(StoreError::InvalidTransition { .. }) => format!(
                                "task `{}` was cancelled while this attempt was out, so no retry is sent; the provider's answer to it is in last_status",
                                run.task()
                            ),
                            _ => "the retry could not be scheduled, so no retry is sent".to_owned(),
                        };
                        return Box::pin(self.finish(
                            run,
                            &budget,
                            Outcome::Cancelled,
                            context,
                            detail,
                            seen.sent,
                        ))
                        .await;
                    }
                    tracing::info!(
                        action = run.id.0,
                        task = %run.task(),
                        route = %route.template,
                        disposition = %signal.disposition,
                        retry_at = %at,
                        delay_ms = delay.as_millis() as u64,
                        cause = ?cause,
                        attempts_left = budget.attempts_remaining(),
                        wait_left_ms = budget.wait_remaining().as_millis() as u64,
                        "retry scheduled"
                    );
                    retry_job = true;
                    not_before = Some(at);
                }
            }
        }
    }
}
