//! The attempt loop of one recorded action, as phases over one context.
//!
//! Why phases: "what happens after a 429" should be found in one place, not inside one long
//! loop. Each phase is a short method over the loop's context ([`Attempt`]) and returns what
//! happens next ([`Next`]); [`Engine::attempts`] only runs them in turn:
//!
//! ```text
//! Admit ─► Send ─► Classify ─► Settle ─► Decide ─┬─► Succeed ─────────────► Finish
//!   ▲                                            ├─► Fail ────────────────► Finish
//!   │                                            ├─► Reconcile ─┬─► Plan    (resend, same key)
//!   │                                            │              └─► Finish  (found, escalated)
//!   │                                            └─► Plan ─┬─► Schedule ─┬─► Admit
//!   └──────────────────────────────────────────────────────┴─────────────┘   (or Finish)
//! ```
//!
//! Every phase that ends the action returns [`Next::Finish`] with the caller's answer, after
//! disarming the close guard ([`ActionGuard`]) — so a path that does not disarm it is one where
//! the caller went away, and the guard closes the action as such. The retry planning and
//! scheduling phases are in [`super::retry`]; the reconciliation of an uncertain write in
//! [`super::uncertain`].

use std::sync::atomic::Ordering;

use axum::body::Body;
use backstop_core::{
    budget::ActionBudget,
    classify::{classify, Disposition, Observed, ResponseView, Signal, TransportError},
    clock::Clock,
    outcome::{NextSafe, Outcome},
    reconcile::operation_id_from_response,
    signal_headers::{carries_retry_after, select_signal_headers},
};
use backstop_store::{AttemptResult, Boundary as StoreBoundary, Finish, StoreError};
use jiff::Timestamp;

use super::{
    caller_gone, is_store_failure, kept_for_replay, may_have_committed, problem_answer,
    quota_escalations, read_bounded, store_disposition, unrecorded, wait_then_abort, with_ids,
    without_provider_replay_mark, writes, ActionGuard, Engine, EngineError, Interrupted, Run,
    Stopped, UnrecordedRetry, ERROR_BODY_LIMIT,
};
use crate::{
    action::Execution,
    problem::Problem,
    scheduler::{AcquireRequest, Acquired, Permit, RetryTokens, SchedulerHandle},
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

/// The context of one action's attempt loop: what every phase reads and updates.
pub(super) struct Attempt<'r, 'g> {
    /// What stays fixed about the action (its spec, route, key, request).
    pub(super) run: &'r Run<'r>,
    /// Closes the action if the caller goes away; kept up to date with what was sent.
    pub(super) guard: &'r mut ActionGuard<'g>,
    /// The class budget as charged so far (attempts, waited time, deadline).
    pub(super) budget: ActionBudget,
    /// What the attempts did so far (for the SPEC §5 context).
    pub(super) seen: Seen,
    /// The instant the planned retry is due: the next attempt does not leave before it.
    pub(super) not_before: Option<Timestamp>,
    /// Tokens of retries that were sent (refunded if the action succeeds).
    pub(super) spent: Option<RetryTokens>,
    /// Tokens of the planned retry not sent yet (refunded if it never leaves).
    pub(super) pending: Option<RetryTokens>,
    /// Whether this loop scheduled a retry job (then the only way round the loop again): the
    /// next attempt's `action_sent` claims it (see `Store::mark_attempt_sent`).
    pub(super) retry_job: bool,
}

impl<'r, 'g> Attempt<'r, 'g> {
    /// The context before the first attempt of this run: what the action's attempts did
    /// before it (a write taken over continues its count) is what has been seen.
    fn new(run: &'r Run<'r>, budget: ActionBudget, guard: &'r mut ActionGuard<'g>) -> Self {
        let seen = Seen {
            sent: run.prior.sent,
            left: run.prior.sent,
            unsettled: run.prior.unsettled,
            response_received: run.prior.last_status.is_some(),
            last_status: run.prior.last_status,
            last_signal: run.prior.last_signal,
            ..Seen::default()
        };
        Attempt {
            run,
            guard,
            budget,
            seen,
            not_before: None,
            spent: None,
            pending: None,
            retry_job: false,
        }
    }

    /// Whether the action is a write (its attempts are durable before they leave).
    pub(super) fn write(&self) -> bool {
        self.run.spec.has_side_effect()
    }

    /// Gives the planned retry's tokens back to the route's scopes: it never leaves.
    pub(super) fn refund_pending(&mut self, scheduler: &SchedulerHandle) {
        if let Some(tokens) = self.pending.take() {
            scheduler.deposit(&self.run.spec.route.scopes, Some(tokens));
        }
    }

    /// The caller is answered on this path: the guard does not close the action, and the
    /// planned retry's tokens go back.
    pub(super) fn end(&mut self, scheduler: &SchedulerHandle) {
        self.guard.armed = false;
        self.refund_pending(scheduler);
    }
}

/// What the attempt loop does next: each phase returns one.
pub(super) enum Next {
    /// Wait for the scheduler's permit for the next attempt.
    Admit,
    /// Send an attempt under the permit.
    Send(Permit),
    /// Classify the answer the attempt got.
    Classify(Sent),
    /// Apply the answer's quota and rate-limit signals to the route's scopes.
    Settle(Answer),
    /// Choose what the answer leads to.
    Decide(Answer),
    /// Look an uncertain write up at the provider before anything else (SPEC §6).
    Reconcile(Answer),
    /// Pass the provider's success through.
    Succeed(Answer),
    /// End the action with an answer that may not be retried.
    Fail(Answer),
    /// Plan a retry of the answer: attempts left, the retry quota, then the core's plan.
    Plan(Answer),
    /// Record the answer's result and schedule the planned retry durably.
    Schedule(Answer, super::retry::Retry),
    /// The action ended: the caller's answer.
    Finish(Execution),
}

/// An attempt that came back (or failed) after it was sent.
pub(super) struct Sent {
    attempt: u32,
    reply: AttemptReply,
    received_at: Timestamp,
}

/// A classified answer, with the result it is recorded as.
pub(super) struct Answer {
    pub(super) signal: Signal,
    /// The provider's response (its error body buffered), if one came back complete.
    pub(super) response: Option<http::Response<Body>>,
    pub(super) status: Option<u16>,
    pub(super) received_at: Timestamp,
    /// The attempt's result, as the store records it (with the outcome when it ends the action).
    pub(super) result: AttemptResult,
}

impl Engine {
    /// The attempt loop of one recorded action: the phases of [`Next`], in turn, until one
    /// finishes the action.
    pub(super) async fn attempts(
        &self,
        run: &Run<'_>,
        budget: ActionBudget,
        guard: &mut ActionGuard<'_>,
    ) -> Execution {
        let mut cx = Attempt::new(run, budget, guard);
        let mut next = Next::Admit;
        loop {
            next = match next {
                Next::Admit => self.admit(&mut cx).await,
                Next::Send(permit) => self.send(&mut cx, permit).await,
                Next::Classify(sent) => self.classify(&mut cx, sent).await,
                Next::Settle(answer) => self.settle(&cx, answer).await,
                Next::Decide(answer) => decide(&cx, answer),
                Next::Reconcile(answer) => Box::pin(self.reconcile(&mut cx, answer)).await,
                Next::Succeed(answer) => self.succeed(&mut cx, answer).await,
                Next::Fail(answer) => self.fail(&mut cx, answer).await,
                Next::Plan(answer) => self.plan(&mut cx, answer).await,
                Next::Schedule(answer, retry) => self.schedule(&mut cx, answer, retry).await,
                Next::Finish(execution) => return execution,
            };
        }
    }

    /// Admit: the scheduler's permit (SPEC §4.1: cancellation and deadline, every scope's
    /// `next_allowed_at`, pacing, concurrency slots), or the end it refuses with.
    async fn admit(&self, cx: &mut Attempt<'_, '_>) -> Next {
        let (run, route) = (cx.run, &cx.run.spec.route);
        let acquired = self
            .inner
            .scheduler
            .acquire(AcquireRequest {
                task_id: run.task().to_owned(),
                agent: run.spec.agent.clone(),
                priority: run.priority,
                scopes: route.scopes.clone(),
                budget: cx.budget,
                not_before: cx.not_before,
                route: route.template.clone(),
                reconciliation: false,
            })
            .await;
        match acquired {
            Acquired::Go { permit, budget } => {
                cx.budget = budget;
                if let Some(RetryTokens(tokens)) = cx.pending.take() {
                    cx.spent
                        .get_or_insert_with(RetryTokens::default)
                        .0
                        .extend(tokens);
                }
                Next::Send(permit)
            }
            Acquired::Refused {
                outcome,
                detail,
                budget,
                boundary,
                not_before,
            } => {
                cx.budget = budget;
                let refused = self.refused(cx, outcome, detail, (boundary, not_before));
                Next::Finish(refused.await)
            }
            Acquired::Stopped { .. } => Next::Finish(self.stopped_waiting(cx)),
        }
    }

    /// The scheduler refused the attempt (`outcome`): the action ends, safe to send again from
    /// the later of the provider's boundary and the instant the dispatch check would have
    /// waited for (local pacing too).
    async fn refused(
        &self,
        cx: &mut Attempt<'_, '_>,
        outcome: Outcome,
        detail: String,
        (boundary, not_before): (Option<Timestamp>, Option<Timestamp>),
    ) -> Execution {
        let inner = &self.inner;
        cx.end(&inner.scheduler);
        let (run, seen) = (cx.run, &cx.seen);
        let boundary = boundary.or(seen.boundary.filter(|b| *b > inner.clock.now()));
        let next_safe = match outcome {
            Outcome::Cancelled => vec![NextSafe::Abort],
            _ => wait_then_abort(boundary.max(not_before)),
        };
        if outcome == Outcome::Cancelled && seen.unsettled && cx.write() {
            // The cancellation reconciles it: the store lists it, as it does every
            // write with an unsettled attempt not in flight.
            return Box::pin(self.cancelled_while_unsettled(run, &cx.budget, seen, false)).await;
        }
        let context = self.context(&cx.budget, seen, boundary, next_safe);
        if outcome == Outcome::Cancelled {
            // The scheduler refuses only for a cancelled task, and the task's
            // cancellation ends this action in the store (with its retry job) in
            // the same operation that reports what it dropped: ending it here too
            // would race that report and leave it uncounted.
            return self.ended(run, outcome, context, detail, seen.sent);
        }
        Box::pin(self.finish(run, &cx.budget, outcome, context, detail, seen.sent)).await
    }

    /// The scheduler stopped (shutdown) while the action waited: its caller is answered 503.
    fn stopped_waiting(&self, cx: &mut Attempt<'_, '_>) -> Execution {
        cx.guard.armed = false;
        let (run, seen) = (cx.run, &cx.seen);
        tracing::info!(
            action = run.id.0,
            attempts = seen.sent,
            "shutting down: the waiting caller is answered 503"
        );
        if seen.sent > 0 {
            return self.stopped_after_sending(run, seen, Stopped::Waiting);
        }
        let detail = "backstop is shutting down; nothing was sent for this request, so sending it again is safe";
        let receipt = run.receipt(seen.sent);
        let problem = with_ids(
            Problem::shutting_down_during(false, detail),
            run.spec,
            &receipt,
        );
        problem_answer(receipt, problem)
    }

    /// Send: mark the attempt `sent` — a write's durable before the bytes leave (SPEC §9,
    /// §12) — then send it once through the transport, under `permit` until it answers.
    async fn send(&self, cx: &mut Attempt<'_, '_>, permit: Permit) -> Next {
        let inner = &self.inner;
        let attempt = match self.mark_sent(cx).await {
            Ok(n) => n,
            Err(e) => {
                drop(permit);
                return Next::Finish(self.not_marked_sent(cx, e).await);
            }
        };
        let run = cx.run;
        cx.seen.sent += 1;
        cx.guard.so_far.sent = cx.seen.sent;
        cx.guard.so_far.in_flight = Some(attempt);
        caller_gone::attempt_out(true);
        tracing::debug!(
            task = %run.task(),
            route = %run.spec.route.template,
            attempt,
            "attempt sent"
        );
        let handed_at = inner.clock.now();
        let Some(reply) = inner
            .unless_given_up(inner.transport.send(run.request.as_ref().clone()))
            .await
        else {
            drop(permit);
            return Next::Finish(self.gave_up_on_answer(cx, attempt));
        };
        let reply = without_provider_replay_mark(reply);
        drop(permit);
        let received_at = inner.clock.now();
        inner.metrics.observe_upstream_attempt(
            &run.spec.route.provider,
            received_at.duration_since(handed_at).as_secs_f64(),
        );
        Next::Classify(Sent {
            attempt,
            reply,
            received_at,
        })
    }

    /// Marks the next attempt sent: a write's is durable before the bytes leave. A read's is
    /// queued behind its action's earlier records and goes without waiting (SPEC §12); its
    /// attempts are numbered by this loop, the only one that sends a read's action.
    async fn mark_sent(&self, cx: &Attempt<'_, '_>) -> Result<u32, EngineError> {
        let inner = &self.inner;
        let (id, sent_at) = (cx.run.id, inner.clock.now());
        if !cx.write() {
            inner
                .store
                .submit_attempt_sent(id, sent_at, cx.run.read_completion("attempt"));
            Ok(cx.seen.sent + 1)
        } else {
            inner
                .queued(move |s, done| s.submit_attempt_sent(id, sent_at, done))
                .await
        }
    }

    /// The store did not mark the attempt sent: nothing of it left, and the action ends.
    async fn not_marked_sent(&self, cx: &mut Attempt<'_, '_>, e: EngineError) -> Execution {
        let inner = &self.inner;
        cx.guard.armed = false;
        let (run, seen) = (cx.run, &cx.seen);
        if is_store_failure(&e) {
            // Nothing of this attempt left. A waiting retry keeps its job, unclaimed:
            // the action is closed once the store commits again, never left waiting
            // for a wake that nothing arms (at shutdown the next start re-arms it).
            // A write's first send frees its key for the agent's resend under it,
            // which sends it as this action.
            let stopping = inner.shutting_down.load(Ordering::SeqCst);
            if cx.retry_job && !stopping {
                self.close_unrecorded_retry(run, &cx.budget, seen, UnrecordedRetry::Start);
            } else if seen.sent == 0 && cx.write() {
                inner
                    .unsent
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .insert(run.id.0);
            }
            if stopping && seen.sent > 0 {
                return self.stopped_by_store_after_sending(
                    run,
                    seen,
                    &e,
                    Interrupted::Send,
                    may_have_committed(&e),
                );
            }
            let receipt = run.receipt(seen.sent);
            return self.store_unavailable(run.spec, receipt, seen.sent > 0, &e);
        }
        if seen.unsettled && cx.write() {
            // Its task was cancelled while it waited (the store refuses a send for
            // nothing else of an open action), and the cancellation, which the store
            // listed it to, reconciles it: never `cancelled`.
            return Box::pin(self.cancelled_while_unsettled(run, &cx.budget, seen, false)).await;
        }
        let detail = match &e {
            EngineError::Store(StoreError::InvalidTransition { reason, .. }) => {
                format!("the action may not send again: {reason}")
            }
            _ => "the action may not send again".to_owned(),
        };
        let context = self.context(&cx.budget, seen, None, vec![NextSafe::Abort]);
        Box::pin(self.finish(
            run,
            &cx.budget,
            Outcome::Cancelled,
            context,
            detail,
            seen.sent,
        ))
        .await
    }

    /// The stop's grace ran out and the provider has not answered `attempt`: the caller is
    /// told what the next start does rather than have its connection cut. The attempt stays
    /// sent without a result (SPEC §12).
    fn gave_up_on_answer(&self, cx: &mut Attempt<'_, '_>, attempt: u32) -> Execution {
        cx.end(&self.inner.scheduler);
        let seen = &mut cx.seen;
        seen.left += 1;
        seen.last_signal = Some(Disposition::Uncertain.as_str());
        seen.unsettled = writes::still_unsettled(seen.unsettled, "uncertain");
        tracing::info!(
            action = cx.run.id.0,
            attempt,
            "shutting down: the grace ran out before the provider answered; the attempt stays sent without a result, and the caller is answered 503"
        );
        self.stopped_after_sending(cx.run, &cx.seen, Stopped::GaveUp)
    }

    /// Classify: the answer read with the route's `ClassifyRules` (a 2xx body is never read; a
    /// non-2xx body is buffered up to [`ERROR_BODY_LIMIT`] for the error-code pointer, then
    /// passed on), noted as seen and counted, with the result it is recorded as.
    async fn classify(&self, cx: &mut Attempt<'_, '_>, sent: Sent) -> Next {
        let Sent {
            attempt,
            reply,
            received_at,
        } = sent;
        let (signal, response, signal_headers) = classify_reply(cx, reply, received_at).await;
        let status = response.as_ref().map(|r| r.status().as_u16());
        note_answer(cx, &signal, status);
        self.count_attempt(cx.run, &signal);
        let seen = &cx.seen;
        let store_boundary = Some(match seen.boundary {
            Some(at) => StoreBoundary::At(at),
            None => StoreBoundary::Unknown,
        });
        let source = match &signal.boundary {
            backstop_core::retry_after::Boundary::Known { source, .. } => Some(source.clone()),
            backstop_core::retry_after::Boundary::Unknown { source, .. } => source.clone(),
        };
        let result = AttemptResult {
            action: cx.run.id,
            attempt,
            status,
            disposition: store_disposition(signal.disposition),
            boundary: store_boundary,
            source,
            provider_operation_id: None,
            signal_headers,
            finish: None,
        };
        Next::Settle(Answer {
            signal,
            response,
            status,
            received_at,
            result,
        })
    }

    /// Counts the attempt's disposition — one count per scope of the route, or one under `-`
    /// for a route without scopes — and its place in the scopes' run of limits.
    fn count_attempt(&self, run: &Run<'_>, signal: &Signal) {
        let inner = &self.inner;
        let route = &run.spec.route;
        let scope_labels = std::iter::once("-")
            .filter(|_| route.scopes.is_empty())
            .chain(route.scopes.iter().map(String::as_str));
        for scope in scope_labels {
            inner
                .metrics
                .attempt(&route.provider, scope, &route.class, signal.disposition);
        }
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

    /// Settle: scope records first — quota headers, then a rate limit's boundary — so no
    /// other action assumes the next slot is its own.
    async fn settle(&self, cx: &Attempt<'_, '_>, answer: Answer) -> Next {
        self.update_scopes(cx.run, &answer.signal, answer.status, answer.received_at)
            .await;
        Next::Decide(answer)
    }

    /// Succeed: the provider's success passes through. A write's final response is kept for
    /// idempotent replay (bounded, never audited), and its operation id is read from the same
    /// bounded prefix. An event stream is never buffered: only its status and headers are kept.
    async fn succeed(&self, cx: &mut Attempt<'_, '_>, answer: Answer) -> Next {
        let inner = &self.inner;
        cx.guard.armed = false;
        let (run, route) = (cx.run, &cx.run.spec.route);
        let Answer {
            response,
            received_at,
            mut result,
            ..
        } = answer;
        let Some(mut response) = response else {
            return Next::Finish(unrecorded(
                Outcome::Cancelled,
                "internal: a success without a response".to_owned(),
            ));
        };
        let mut replay_record = None;
        if cx.write() {
            let rc = route.reconcile.as_ref();
            let wants_id = rc.is_some_and(|rc| rc.operation_id_pointer.is_some());
            let (passed_on, record, bytes) = kept_for_replay(response, run.id, wants_id).await;
            if let Some(rc) = rc {
                result.provider_operation_id = operation_id_from_response(rc, &bytes);
            }
            replay_record = Some(record);
            response = passed_on;
        }
        self.breaker_success(run);
        inner.scheduler.deposit(&route.scopes, cx.spent.take());
        let context = self.context(&cx.budget, &cx.seen, None, Vec::new());
        result.finish = Some(Finish {
            outcome: backstop_store::Outcome::Succeeded,
            context: serde_json::to_value(&context).unwrap_or_default(),
            response: replay_record,
        });
        if !cx.write() {
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
        Next::Finish(Execution::Response {
            receipt: run.receipt(cx.seen.sent),
            response,
        })
    }

    /// Fail: the answer may not be retried, and the action ends with it.
    async fn fail(&self, cx: &mut Attempt<'_, '_>, answer: Answer) -> Next {
        cx.guard.armed = false;
        let key_honoured = self
            .inner
            .policy
            .providers
            .get(&cx.run.spec.route.provider)
            .and_then(|p| p.idempotency_header.as_ref())
            .is_some();
        let Answer {
            signal,
            response,
            result,
            ..
        } = answer;
        let failure = self.final_failure(
            cx.run,
            &cx.budget,
            &cx.seen,
            signal,
            response,
            result,
            key_honoured,
        );
        Next::Finish(Box::pin(failure).await)
    }
}

/// Decide: an uncertain write is reconciled before anything else happens (SPEC §6); a success
/// passes through; an answer the class does not try again ends the action; anything else is
/// a retry to plan. An uncertain READ changed nothing at the provider: it is retried within
/// the read class budget like any transient failure, never left `reconciliation_required`.
fn decide(cx: &Attempt<'_, '_>, answer: Answer) -> Next {
    let disposition = answer.signal.disposition;
    if disposition == Disposition::Uncertain && cx.write() {
        Next::Reconcile(answer)
    } else if disposition == Disposition::Success {
        Next::Succeed(answer)
    } else if !backstop_core::classify::tried_again(&answer.signal, cx.write()) {
        Next::Fail(answer)
    } else {
        Next::Plan(answer)
    }
}

/// The signal of the attempt's `reply`, the response passed on (a non-2xx body buffered for
/// the error-code pointer) and the signal headers kept as evidence — unless it is a plain
/// success (a 2xx without a Retry-After).
async fn classify_reply(
    cx: &mut Attempt<'_, '_>,
    reply: AttemptReply,
    received_at: Timestamp,
) -> (Signal, Option<http::Response<Body>>, Vec<(String, String)>) {
    let rules = &cx.run.rules;
    match reply {
        AttemptReply::Response(response) if response.status().is_success() => {
            let signal = classify(
                &Observed::Response(ResponseView {
                    status: response.status().as_u16(),
                    headers: response.headers(),
                    body: None,
                }),
                rules,
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
                        rules,
                        received_at,
                    );
                    (signal, Some(http::Response::from_parts(parts, body)), kept)
                }
                Err(_) => {
                    cx.seen.last_failure = Some(TransportError::ResponseCut);
                    (
                        classify(
                            &Observed::Transport(TransportError::ResponseCut),
                            rules,
                            received_at,
                        ),
                        None,
                        kept,
                    )
                }
            }
        }
        AttemptReply::Failed(e) => {
            cx.seen.last_failure = Some(e);
            (
                classify(&Observed::Transport(e), rules, received_at),
                None,
                Vec::new(),
            )
        }
    }
}

/// Notes the classified answer as seen, and in the guard: what a close goes by.
fn note_answer(cx: &mut Attempt<'_, '_>, signal: &Signal, status: Option<u16>) {
    let seen = &mut cx.seen;
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
    cx.guard.so_far.last_signal = seen.last_signal;
    cx.guard.so_far.unsettled = seen.unsettled;
    cx.guard.so_far.last_status = seen.last_status;
    seen.boundary = signal.boundary.retry_not_before();
}
