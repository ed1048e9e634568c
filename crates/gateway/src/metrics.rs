//! Prometheus metrics of the gateway (text exposition via `prometheus-client`).
//!
//! Why these: an operator must tell a 429 storm from an outage from a stuck queue at a glance.
//! Attempts are counted by the disposition the core gave them (so `unavailable` 503s stay apart
//! from `rate_limited` 429s, SPEC §2.1), outcomes by their SPEC §5 name, queue depth and in-flight
//! work per scope as gauges, the retry-after debt (time deliberately yielded to providers, SPEC
//! §10) per scope, layered retries that were joined (SPEC §4.3), breakers opened (SPEC §7) and
//! held, and the gateway's own overhead per attempt; escalations open for a human, requests
//! refused before they became actions (by problem type), and how long the provider took to
//! answer each attempt (by provider).

use std::sync::Mutex;

use backstop_core::{classify::Disposition, outcome::Outcome};
use prometheus_client::{
    encoding::{text::encode, EncodeLabelSet},
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{exponential_buckets, Histogram},
    },
    registry::{Metric, Registry},
};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AttemptLabels {
    provider: String,
    scope: String,
    class: String,
    disposition: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    provider: String,
    class: String,
    outcome: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LookupLabels {
    provider: String,
    verdict: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ScopeLabels {
    scope: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProviderLabels {
    provider: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResendLabels {
    provider: String,
    handling: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProblemLabels {
    problem: String,
}

/// The buckets of `backstop_upstream_attempt_seconds`: 5 ms doubling to ≈ 41 s (14 buckets),
/// past the default attempt timeout.
fn upstream_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.005, 2.0, 14))
}

/// Registers `metric` under `name` with its help text and returns it (the registry keeps a
/// handle to the same values).
fn registered<M: Metric + Clone>(registry: &mut Registry, name: &str, help: &str, metric: M) -> M {
    registry.register(name, help, metric.clone());
    metric
}

/// Actions and their attempts: attempts by disposition, terminal outcomes, reconciliation lookups.
#[derive(Debug)]
struct ActionMetrics {
    attempts: Family<AttemptLabels, Counter>,
    outcomes: Family<OutcomeLabels, Counter>,
    lookups: Family<LookupLabels, Counter>,
}

impl ActionMetrics {
    /// Registers the group's metrics, in exposition order.
    fn register(registry: &mut Registry) -> Self {
        Self {
            attempts: registered(
                registry,
                "attempts",
                "Attempts of actions that left the process, by provider, scope, request class and disposition (reconciliation lookups are counted in backstop_reconciliation_lookups_total). An attempt is counted once for each scope of its route: sum within one scope label, never across scopes",
                Family::<AttemptLabels, Counter>::default(),
            ),
            outcomes: registered(
                registry,
                "outcomes",
                "Terminal outcomes of actions (docs/concepts.md, outcomes)",
                Family::<OutcomeLabels, Counter>::default(),
            ),
            lookups: registered(
                registry,
                "reconciliation_lookups",
                "Reconciliation lookups of uncertain writes, by provider and verdict (found, not_found, inconclusive; an inconclusive one may not have been sent, e.g. when its scope stayed closed)",
                Family::<LookupLabels, Counter>::default(),
            ),
        }
    }
}

/// Scopes: the delayed queue, attempts in flight, and the time yielded to provider boundaries.
#[derive(Debug)]
struct ScopeMetrics {
    delayed: Family<ScopeLabels, Gauge>,
    in_flight: Family<ScopeLabels, Gauge>,
    retry_after_debt: Family<ScopeLabels, Counter<f64, std::sync::atomic::AtomicU64>>,
}

impl ScopeMetrics {
    /// Registers the group's metrics, in exposition order.
    fn register(registry: &mut Registry) -> Self {
        Self {
            delayed: registered(
                registry,
                "delayed_actions",
                "Actions waiting in the delayed queue, by scope",
                Family::<ScopeLabels, Gauge>::default(),
            ),
            in_flight: registered(
                registry,
                "in_flight_attempts",
                "Attempts in flight, by scope",
                Family::<ScopeLabels, Gauge>::default(),
            ),
            retry_after_debt: registered(
                registry,
                "retry_after_debt_seconds",
                "Time deliberately yielded to provider backpressure (retry_not_before - throttled_at), by scope",
                Family::<ScopeLabels, Counter<f64, std::sync::atomic::AtomicU64>>::default(),
            ),
        }
    }
}

/// Agents' own retries: joined to an action in flight, or answered without sending.
#[derive(Debug)]
struct ResendMetrics {
    layered_retries_joined: Family<ProviderLabels, Counter>,
    client_resends: Family<ResendLabels, Counter>,
}

impl ResendMetrics {
    /// Registers the group's metrics, in exposition order.
    fn register(registry: &mut Registry) -> Self {
        Self {
            layered_retries_joined: registered(
                registry,
                "layered_retries_joined",
                "Agent-side retries of an in-flight action that were joined instead of sent again",
                Family::<ProviderLabels, Counter>::default(),
            ),
            client_resends: registered(
                registry,
                "client_resends",
                "Client re-sends of a side-effect-free call (an SDK's own retry): `answered` after the call's final answer (nothing sent), `joined` to the call still in flight",
                Family::<ResendLabels, Counter>::default(),
            ),
        }
    }
}

/// Per-task circuit breakers: opened, and held in memory.
#[derive(Debug)]
struct BreakerMetrics {
    breakers_opened: Family<ProviderLabels, Counter>,
    task_breakers: Gauge,
}

impl BreakerMetrics {
    /// Registers the group's metrics, in exposition order.
    fn register(registry: &mut Registry) -> Self {
        Self {
            breakers_opened: registered(
                registry,
                "breakers_opened",
                "Per-task circuit breakers opened after repeated identical failures",
                Family::<ProviderLabels, Counter>::default(),
            ),
            task_breakers: registered(
                registry,
                "task_breakers",
                "Per-task circuit breakers held in memory: tasks with a failure streak not ended by a success, not cancelled and not yet forgotten (breaker.forget_after_seconds after their last failure)",
                Gauge::default(),
            ),
        }
    }
}

/// What the watchdog finds: missed wakes and early retries.
#[derive(Debug)]
struct WatchdogMetrics {
    missed_wakes: Counter,
    early_retries: Counter,
}

impl WatchdogMetrics {
    /// Registers the group's metrics, in exposition order.
    fn register(registry: &mut Registry) -> Self {
        Self {
            missed_wakes: registered(
                registry,
                "missed_wakes",
                "Scheduled retries that did not start within the wake grace (watchdog)",
                Counter::default(),
            ),
            early_retries: registered(
                registry,
                "early_retries",
                "Retries that started before the provider's boundary (watchdog)",
                Counter::default(),
            ),
        }
    }
}

/// The gateway's own service: its overhead per call, escalations open for a human, requests
/// refused before they became actions, and the upstream latency per provider.
#[derive(Debug)]
struct ServiceMetrics {
    overhead: Histogram,
    open_escalations: Gauge,
    refusals: Family<ProblemLabels, Counter>,
    upstream_attempts: Family<ProviderLabels, Histogram, fn() -> Histogram>,
}

impl ServiceMetrics {
    /// Registers the group's metrics, in exposition order.
    fn register(registry: &mut Registry) -> Self {
        Self {
            overhead: registered(
                registry,
                "gateway_overhead_seconds",
                "Time the proxy door spends per call: request head in to the hand-over to the engine, plus the engine's answer to the response head out (excludes queueing, waiting and the upstream call)",
                Histogram::new(exponential_buckets(0.000_025, 2.0, 14)),
            ),
            open_escalations: registered(
                registry,
                "open_escalations",
                "Escalations open for a human decision (counted in the store when /metrics is read)",
                Gauge::default(),
            ),
            refusals: registered(
                registry,
                "refusals",
                "Requests refused before they became actions, nothing sent, by problem type (the proxy door, POST /v1/actions, and the store refusing to record them: a reused idempotency key, a cancelled task); outcomes of recorded actions are in backstop_outcomes_total",
                Family::<ProblemLabels, Counter>::default(),
            ),
            upstream_attempts: registered(
                registry,
                "upstream_attempt_seconds",
                "Time from handing an attempt to the upstream client to its response head or transport error, by provider (reconciliation lookups not included)",
                Family::<ProviderLabels, Histogram, fn() -> Histogram>::new_with_constructor( upstream_histogram, ),
            ),
        }
    }
}

/// All gateway metrics, registered once; cheap to update from any task.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    actions: ActionMetrics,
    scopes: ScopeMetrics,
    resends: ResendMetrics,
    breakers: BreakerMetrics,
    watchdog: WatchdogMetrics,
    service: ServiceMetrics,
    // Serializes encoding; updates are lock-free.
    encode_lock: Mutex<()>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric under the `backstop_` prefix.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("backstop");
        let actions = ActionMetrics::register(&mut registry);
        let scopes = ScopeMetrics::register(&mut registry);
        let resends = ResendMetrics::register(&mut registry);
        let breakers = BreakerMetrics::register(&mut registry);
        let watchdog = WatchdogMetrics::register(&mut registry);
        let service = ServiceMetrics::register(&mut registry);
        Self {
            registry,
            actions,
            scopes,
            resends,
            breakers,
            watchdog,
            service,
            encode_lock: Mutex::new(()),
        }
    }

    /// Counts one attempt that left the process, with the disposition of its answer.
    pub fn attempt(&self, provider: &str, scope: &str, class: &str, disposition: Disposition) {
        self.actions
            .attempts
            .get_or_create(&AttemptLabels {
                provider: provider.to_owned(),
                scope: scope.to_owned(),
                class: class.to_owned(),
                disposition: disposition.as_str().to_owned(),
            })
            .inc();
    }

    /// Counts one reconciliation lookup with its verdict (`found`, `not_found`, `inconclusive`).
    pub fn lookup(&self, provider: &str, verdict: &str) {
        self.actions
            .lookups
            .get_or_create(&LookupLabels {
                provider: provider.to_owned(),
                verdict: verdict.to_owned(),
            })
            .inc();
    }

    /// Counts one terminal outcome.
    pub fn outcome(&self, provider: &str, class: &str, outcome: Outcome) {
        self.actions
            .outcomes
            .get_or_create(&OutcomeLabels {
                provider: provider.to_owned(),
                class: class.to_owned(),
                outcome: outcome.as_str().to_owned(),
            })
            .inc();
    }

    /// The gauge of actions waiting in the delayed queue of `scope`. Kept by its owner and set
    /// with [`Gauge::set`], it costs one atomic store per update instead of a label lookup.
    pub fn delayed_gauge(&self, scope: &str) -> Gauge {
        self.scopes
            .delayed
            .get_or_create(&ScopeLabels {
                scope: scope.to_owned(),
            })
            .clone()
    }

    /// The gauge of attempts of `scope` in flight (kept and set as [`Self::delayed_gauge`]).
    pub fn in_flight_gauge(&self, scope: &str) -> Gauge {
        self.scopes
            .in_flight
            .get_or_create(&ScopeLabels {
                scope: scope.to_owned(),
            })
            .clone()
    }

    /// Adds retry-after debt (seconds yielded to a provider boundary) to a scope.
    pub fn add_retry_after_debt(&self, scope: &str, seconds: f64) {
        if seconds.is_finite() && seconds > 0.0 {
            self.scopes
                .retry_after_debt
                .get_or_create(&ScopeLabels {
                    scope: scope.to_owned(),
                })
                .inc_by(seconds);
        }
    }

    /// Counts an agent retry joined to its in-flight action (or refused with 409).
    pub fn layered_retry_joined(&self, provider: &str) {
        self.resends
            .layered_retries_joined
            .get_or_create(&ProviderLabels {
                provider: provider.to_owned(),
            })
            .inc();
    }

    /// Counts a client's re-send of a side-effect-free call (SPEC §4.3): `handling` is
    /// `answered` (after the call's final answer: the same answer, nothing sent) or `joined`
    /// (to the call still in flight). Exported as `backstop_client_resends_total`.
    pub fn client_resend(&self, provider: &str, handling: &str) {
        self.resends
            .client_resends
            .get_or_create(&ResendLabels {
                provider: provider.to_owned(),
                handling: handling.to_owned(),
            })
            .inc();
    }

    /// Counts a circuit breaker opening.
    pub fn breaker_opened(&self, provider: &str) {
        self.breakers
            .breakers_opened
            .get_or_create(&ProviderLabels {
                provider: provider.to_owned(),
            })
            .inc();
    }

    /// The gauge of per-task circuit breakers held (`backstop_task_breakers`), kept by the
    /// engine and set with [`Gauge::set`] whenever the number changes.
    pub fn task_breakers_gauge(&self) -> Gauge {
        self.breakers.task_breakers.clone()
    }

    /// Counts a missed wake found by the watchdog.
    pub fn missed_wake(&self) {
        self.watchdog.missed_wakes.inc();
    }

    /// Counts a retry found started before its provider boundary (watchdog, SPEC §10
    /// `early_retry_loop`).
    pub fn early_retry(&self) {
        self.watchdog.early_retries.inc();
    }

    /// Observes the gateway's own overhead for one proxied call, in seconds: the door's time
    /// from the request head to handing the action to the engine (authentication, header
    /// parsing, body buffering, route resolution) plus from the engine's answer to the
    /// response head handed to the agent. Queue wait, `Retry-After` waits, the engine's
    /// scheduling and the upstream call are not included.
    pub fn observe_overhead(&self, seconds: f64) {
        self.service.overhead.observe(seconds);
    }

    /// Sets `backstop_open_escalations`: the escalations open in the store now.
    pub fn set_open_escalations(&self, open: u64) {
        self.service
            .open_escalations
            .set(i64::try_from(open).unwrap_or(i64::MAX));
    }

    /// Counts one request refused before it became an action (nothing sent), by its problem
    /// type's name (`unauthorized`, `bad_header`, `idempotency_key_reused`, `cancelled`, …; the
    /// last part of the problem's `type`).
    pub fn refusal(&self, problem: &str) {
        self.service
            .refusals
            .get_or_create(&ProblemLabels {
                problem: problem.to_owned(),
            })
            .inc();
    }

    /// Observes one attempt's upstream latency at `provider`, in seconds: from handing the
    /// request to the upstream client to its response head (or the transport error that ended
    /// it). Negative or non-finite values are not observed.
    pub fn observe_upstream_attempt(&self, provider: &str, seconds: f64) {
        if seconds.is_finite() && seconds >= 0.0 {
            self.service
                .upstream_attempts
                .get_or_create(&ProviderLabels {
                    provider: provider.to_owned(),
                })
                .observe(seconds);
        }
    }

    /// Renders the Prometheus text exposition format.
    pub fn render(&self) -> String {
        let _guard = self
            .encode_lock
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut out = String::new();
        // Encoding into a String cannot fail (fmt::Write on String is infallible).
        let _ = encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_labelled_attempts_and_outcomes() {
        let metrics = Metrics::new();
        metrics.attempt(
            "billing",
            "billing/account",
            "read",
            Disposition::RateLimited,
        );
        metrics.attempt(
            "billing",
            "billing/account",
            "read",
            Disposition::RateLimited,
        );
        metrics.outcome("billing", "read", Outcome::Succeeded);
        metrics.add_retry_after_debt("billing/account", 10.0);
        let text = metrics.render();
        assert!(
            text.contains("counted once for each scope of its route"),
            "the help text warns against summing across scopes: {text}"
        );
        assert!(text.contains(
            r#"backstop_attempts_total{provider="billing",scope="billing/account",class="read",disposition="rate_limited"} 2"#
        ), "{text}");
        assert!(text.contains(r#"outcome="succeeded"} 1"#), "{text}");
        assert!(
            text.contains(r#"backstop_retry_after_debt_seconds_total{scope="billing/account"} 10"#),
            "{text}"
        );
    }
}
