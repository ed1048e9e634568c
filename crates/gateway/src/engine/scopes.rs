//! Settling a scope after an answer: quota headers and a rate limit's boundary are applied to
//! the route's scopes — in the scheduler first, then durably (`scope_updated`) — before any
//! retry of this action is planned, so no other action assumes the next slot is its own
//! (SPEC §4.1, §4.2).

use backstop_core::{
    classify::{Disposition, Signal},
    quota::quota_boundary_with,
};
use backstop_store::ScopeUpdate;
use jiff::Timestamp;

use super::{quota_escalations, Engine, Run};
use crate::scheduler::ScopeSignal;

impl Engine {
    /// Applies quota headers and a rate limit's boundary to the route's scopes: in the
    /// scheduler first, then durably (`scope_updated`), before any retry is planned.
    pub(super) async fn update_scopes(
        &self,
        run: &Run<'_>,
        signal: &Signal,
        status: Option<u16>,
        received_at: Timestamp,
    ) {
        let inner = &self.inner;
        let route = &run.spec.route;
        if route.scopes.is_empty() {
            return;
        }
        let mut updates: Vec<ScopeUpdate> = Vec::new();
        self.apply_quota(run, signal, received_at, &mut updates)
            .await;
        self.apply_rate_limit(run, signal, status, received_at, &mut updates)
            .await;
        for update in updates {
            if let Err(e) = inner
                .blocking(move |s| s.update_scope(update, received_at).map(|_| ()))
                .await
            {
                tracing::warn!(error = %e, "could not persist the scope record");
            }
        }
    }

    /// Quota headers (the observation with the least remaining): the scheduler is told at
    /// once; the scope records to persist are added to `updates`.
    async fn apply_quota(
        &self,
        run: &Run<'_>,
        signal: &Signal,
        received_at: Timestamp,
        updates: &mut Vec<ScopeUpdate>,
    ) {
        let inner = &self.inner;
        let route = &run.spec.route;
        if let Some(obs) = signal
            .quota
            .iter()
            .filter(|o| o.remaining.is_some() || o.reset_at.is_some())
            .min_by_key(|o| o.remaining.unwrap_or(u64::MAX))
        {
            let exhausted = quota_boundary_with(&signal.quota, received_at, &run.rules.retry_after);
            let reset_at = match &exhausted {
                // Exhausted: the boundary as checked against the ceiling and `min_delay`; an
                // absurd reset (over the ceiling) is unknown, never a wait of centuries.
                Some(boundary) if obs.remaining == Some(0) => boundary.retry_not_before(),
                // Otherwise the reset is only shown, and only when it is not absurd either.
                _ => obs
                    .reset_at
                    .filter(|at| within_ceiling(*at, received_at, &run.rules.retry_after)),
            };
            let source = format!("{} quota headers", obs.dialect);
            inner
                .scheduler
                .signal(
                    &route.scopes,
                    ScopeSignal::Quota {
                        remaining: obs.remaining,
                        limit: obs.limit,
                        reset_at,
                        source: source.clone(),
                    },
                )
                .await;
            for scope in &route.scopes {
                updates.push(ScopeUpdate {
                    provider: route.provider.clone(),
                    scope: scope.clone(),
                    next_allowed_at: reset_at.filter(|_| obs.remaining == Some(0)),
                    remaining: obs.remaining,
                    limit: obs.limit,
                    reset_at,
                    source: source.clone(),
                });
            }
        }
    }

    /// A rate limit's or an exhausted quota's boundary: every action of the route's scopes
    /// waits for it; the scheduler is told at once, the scope records to persist are added to
    /// `updates`.
    async fn apply_rate_limit(
        &self,
        run: &Run<'_>,
        signal: &Signal,
        status: Option<u16>,
        received_at: Timestamp,
        updates: &mut Vec<ScopeUpdate>,
    ) {
        let inner = &self.inner;
        let route = &run.spec.route;
        let limited = matches!(
            signal.disposition,
            Disposition::RateLimited | Disposition::QuotaExhausted
        );
        // The provider's boundary, or, when it gave none that can be used (no Retry-After, or a
        // negative, garbage or absurd one), a local pause: a 429 slows the whole scope even then
        // (SPEC §4.1), and never into a tight loop.
        // An exhausted quota without a known reset is not paused here: it is escalated, and an
        // operator's decision, not a local timer, says when the scope may send again.
        let limit_boundary = match (limited, signal.boundary.retry_not_before()) {
            (false, _) => None,
            (true, Some(boundary)) => Some((boundary, true)),
            (true, None) if signal.disposition != Disposition::RateLimited => None,
            (true, None) => jiff::SignedDuration::try_from(
                self.unknown_boundary_pause(&route.provider, &route.scopes),
            )
            .ok()
            .and_then(|pause| received_at.checked_add(pause).ok())
            .map(|at| (at, false)),
        };
        if let Some((boundary, given)) = limit_boundary {
            let source = match (&signal.boundary, status) {
                (backstop_core::retry_after::Boundary::Known { source, .. }, Some(status)) => {
                    format!("HTTP {status} {source}")
                }
                (backstop_core::retry_after::Boundary::Known { source, .. }, None) => {
                    source.clone()
                }
                (_, Some(status)) => format!(
                    "HTTP {status} without a usable boundary; local pause of {} ms",
                    boundary.duration_since(received_at).as_millis()
                ),
                (_, None) => format!(
                    "provider limit without a usable boundary; local pause of {} ms",
                    boundary.duration_since(received_at).as_millis()
                ),
            };
            inner
                .scheduler
                .signal(
                    &route.scopes,
                    ScopeSignal::RateLimited {
                        boundary,
                        source: source.clone(),
                    },
                )
                .await;
            // Retry-after debt is the provider's mandated delay (SPEC §10): a local pause is not.
            let debt = boundary.duration_since(received_at).as_secs_f64();
            for scope in &route.scopes {
                if given {
                    inner.metrics.add_retry_after_debt(scope, debt);
                }
                updates.push(ScopeUpdate {
                    provider: route.provider.clone(),
                    scope: scope.clone(),
                    next_allowed_at: Some(boundary),
                    remaining: Some(0),
                    limit: None,
                    reset_at: None,
                    source: source.clone(),
                });
            }
            tracing::info!(
                task = %run.task(),
                route = %route.template,
                source = %source,
                boundary = %boundary,
                "rate limited: every action of the route's scopes waits for the boundary"
            );
        }
    }

    /// How long a scope pauses after a rate limit whose boundary is unknown (a 429 without a
    /// usable `Retry-After`): the backoff cap for the scope's run of consecutive rate limits,
    /// `min(max_seconds, base_seconds · 2^n)` with `n` the run's length (SPEC §4.2), so a
    /// provider that keeps answering 429 without a boundary is probed ever more slowly.
    pub(super) fn unknown_boundary_pause(
        &self,
        provider: &str,
        scopes: &[String],
    ) -> std::time::Duration {
        let streak = self
            .inner
            .limit_streaks
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .longest(&quota_escalations::streak_keys(provider, scopes));
        let backoff = &self.inner.policy.backoff;
        backoff.config().cap(streak.max(1)).max(backoff.min_delay)
    }
}

/// Whether `at` lies within the Retry-After ceiling of `received_at` (SPEC §2.2: a later instant
/// is absurd and read as unknown).
pub(super) fn within_ceiling(
    at: Timestamp,
    received_at: Timestamp,
    opts: &backstop_core::retry_after::RetryAfterOptions,
) -> bool {
    let until = received_at.duration_until(at);
    until.is_negative() || until.unsigned_abs() <= opts.ceiling
}
