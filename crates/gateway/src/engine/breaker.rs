//! The per-task circuit breaker (SPEC §7) as the attempt loop feeds it: a success closes the
//! request's streak, a rejection counts toward opening it (audited `circuit_opened`).

use backstop_core::clock::Clock;
use backstop_store::RouteTemplate;

use super::{gauge_value, Engine, Run};

impl Engine {
    pub(super) fn breaker_success(&self, run: &Run<'_>) {
        let inner = &self.inner;
        let mut breakers = inner
            .breakers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if breakers.is_empty() {
            return;
        }
        let now = inner.clock.now();
        breakers.record_success(&run.spec.agent, run.task(), &run.fingerprint, now);
        inner.breakers_gauge.set(gauge_value(breakers.len()));
    }

    pub(super) async fn breaker_failure(&self, run: &Run<'_>, code: &str, status: Option<u16>) {
        let inner = &self.inner;
        let at = inner.clock.now();
        let opened = {
            let mut breakers = inner
                .breakers
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            let opened = breakers.record_failure(
                &run.spec.agent,
                run.task(),
                &run.fingerprint,
                code,
                status,
                at,
            );
            inner.breakers_gauge.set(gauge_value(breakers.len()));
            opened
        };
        if let Some(open) = opened {
            let route = &run.spec.route;
            inner.metrics.breaker_opened(&route.provider);
            tracing::info!(
                task = %run.task(),
                route = %route.template,
                error_code = %open.error_code,
                failures = open.failures,
                "circuit opened for this request in this task"
            );
            let (agent, task, provider, method) = (
                run.spec.agent.clone(),
                run.task().to_owned(),
                route.provider.clone(),
                route.method.clone(),
            );
            if let Ok(template) = RouteTemplate::try_new(&route.template) {
                if let Err(e) = inner
                    .blocking(move |s| {
                        s.record_circuit_opened(&agent, &task, &provider, &method, &template, at)
                    })
                    .await
                {
                    tracing::warn!(error = %e, "could not audit the opened circuit");
                }
            }
        }
    }
}
