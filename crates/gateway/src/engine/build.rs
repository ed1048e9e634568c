//! Construction: the engine built from the policy, the store, the transport and the clock,
//! and the per-route lookups made once from the policy (classification rules, request
//! fingerprints) and the jitter source every retry plan draws from.
//!
//! Why apart: everything here happens before the first request (or is a pure lookup of what
//! was built then); nothing in it sends, records or waits for an action.

use backstop_core::clock::Clock;
use backstop_core::{
    breaker::{RequestFingerprint, TaskBreakers},
    classify::ClassifyRules,
    policy::{Policy, RouteMatch},
};
use backstop_store::{ActionId, Store};
use std::{
    collections::{HashMap, HashSet},
    sync::{atomic::AtomicBool, Arc, Mutex},
};

use super::{actions, detached, quota_escalations, Engine, EngineError, Inner};
use crate::{
    clock::TokioClock,
    coalesce::Flights,
    metrics::Metrics,
    scheduler::{SchedulerHandle, ScopeSignal},
    transport::Transport,
};

/// Classification rules by provider, then request class.
pub(super) type RuleTable = HashMap<String, HashMap<String, Arc<ClassifyRules>>>;

/// The classification rules of every provider and request class of `policy`.
pub(super) fn rule_table(policy: &Policy) -> RuleTable {
    policy
        .providers
        .keys()
        .map(|provider| {
            let by_class = policy
                .request_classes
                .iter()
                .filter_map(|(name, class)| {
                    let rules = policy.classify_rules(provider, class).ok()?;
                    Some((name.clone(), Arc::new(rules)))
                })
                .collect();
            (provider.clone(), by_class)
        })
        .collect()
}

/// The request fingerprint of an action on `route` with payload `body`, taken from `known` (see
/// [`route_fingerprints`]) for a configured route without payload fields, computed otherwise.
pub(super) fn fingerprint_with(
    known: &HashMap<String, Vec<(String, RequestFingerprint)>>,
    route: &RouteMatch,
    body: &[u8],
) -> RequestFingerprint {
    if route.fingerprint_fields.is_empty() {
        let found = route
            .configured
            .then(|| known.get(&route.template))
            .flatten()
            .and_then(|methods| methods.iter().find(|(method, _)| *method == route.method));
        return match found {
            Some((_, fingerprint)) => fingerprint.clone(),
            None => RequestFingerprint::compute(&route.method, &route.template, None, &[]),
        };
    }
    let payload = serde_json::from_slice::<serde_json::Value>(body).ok();
    RequestFingerprint::compute(
        &route.method,
        &route.template,
        payload.as_ref(),
        &route.fingerprint_fields,
    )
}

/// The fingerprints of the configured routes of `policy` without payload fields, by template
/// and method.
pub(super) fn route_fingerprints(
    policy: &Policy,
) -> HashMap<String, Vec<(String, RequestFingerprint)>> {
    let mut table: HashMap<String, Vec<(String, RequestFingerprint)>> = HashMap::new();
    let routes = policy.providers.values().flat_map(|p| p.routes.iter());
    for route in routes.filter(|r| r.fingerprint_fields.is_empty()) {
        let methods = table.entry(route.template.clone()).or_default();
        if methods.iter().all(|(method, _)| *method != route.method) {
            let fingerprint =
                RequestFingerprint::compute(&route.method, &route.template, None, &[]);
            methods.push((route.method.clone(), fingerprint));
        }
    }
    table
}

impl Inner {
    /// 16 bytes for minting an idempotency key: the engine's generator mixed with the current
    /// instant, so a restarted gateway with the same seed never mints a key again.
    pub(super) fn random_16(&self) -> [u8; 16] {
        let nanos = self.clock.now().as_nanosecond().to_le_bytes();
        let mut out = [0u8; 16];
        let mut rng = self
            .rng
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        for (i, chunk) in out.chunks_mut(4).enumerate() {
            let draw = (rng.unit() * f64::from(u32::MAX)) as u32;
            chunk.copy_from_slice(&draw.to_le_bytes());
            for (j, b) in chunk.iter_mut().enumerate() {
                *b ^= nanos[i * 4 + j];
            }
        }
        out
    }

    pub(super) fn unit(&self) -> f64 {
        self.rng
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .unit()
    }

    /// The request fingerprint of an action on `route` with payload `body`: the method, the
    /// template and the route's stable payload fields (SPEC §7). A configured route without
    /// payload fields has one fingerprint, computed when the engine was built.
    pub(super) fn fingerprint(&self, route: &RouteMatch, body: &[u8]) -> RequestFingerprint {
        fingerprint_with(&self.route_fingerprints, route, body)
    }

    /// The classification rules of `provider` for the request class `class` (named
    /// `class_name`), from the table built with the engine.
    ///
    /// # Errors
    /// [`backstop_core::policy::UnknownProvider`] for a provider the policy does not name.
    pub(super) fn rules(
        &self,
        provider: &str,
        class_name: &str,
        class: &backstop_core::policy::RequestClass,
    ) -> Result<Arc<ClassifyRules>, backstop_core::policy::UnknownProvider> {
        match self.rules.get(provider).and_then(|c| c.get(class_name)) {
            Some(rules) => Ok(rules.clone()),
            None => self.policy.classify_rules(provider, class).map(Arc::new),
        }
    }
}

impl Engine {
    /// Builds the engine and spawns its scheduler task (call inside a tokio runtime). Scope
    /// records start from the policy and are then refreshed from the store, so boundaries
    /// recorded before a restart keep holding. `seed` seeds every jitter draw (deterministic
    /// tests); production passes a random seed.
    pub fn new(
        policy: Arc<Policy>,
        store: Arc<dyn Store>,
        transport: Arc<dyn Transport>,
        clock: TokioClock,
        metrics: Arc<Metrics>,
        seed: u64,
    ) -> Engine {
        Engine::with_credentials(policy, store, transport, clock, metrics, seed, Vec::new())
    }

    /// [`Engine::new`] with the provider credential headers (`(provider, name, value)`) that
    /// reconciliation lookups carry when no agent request is at hand. They are in place before
    /// restart recovery runs, so lookups of writes left unfinished by a crash are authenticated.
    #[allow(clippy::too_many_arguments)]
    pub fn with_credentials(
        policy: Arc<Policy>,
        store: Arc<dyn Store>,
        transport: Arc<dyn Transport>,
        clock: TokioClock,
        metrics: Arc<Metrics>,
        seed: u64,
        credentials: Vec<(String, http::HeaderName, http::HeaderValue)>,
    ) -> Engine {
        let credentials: HashMap<String, (http::HeaderName, http::HeaderValue)> = credentials
            .into_iter()
            .map(|(provider, name, value)| (provider, (name, value)))
            .collect();
        let scheduler = SchedulerHandle::spawn(&policy, clock, metrics.clone(), seed);
        let rules = rule_table(&policy);
        let fingerprints = route_fingerprints(&policy);
        let breakers = TaskBreakers::new(policy.breaker.threshold, policy.breaker.forget_after);
        let breakers_gauge = metrics.task_breakers_gauge();
        let inner = Arc::new(Inner {
            policy,
            store,
            transport,
            clock,
            metrics,
            scheduler,
            rng: Mutex::new(crate::scheduler::SplitMix64::new(
                seed ^ 0xA076_1D64_78BD_642F,
            )),
            breakers: Mutex::new(breakers),
            breakers_gauge,
            flights: Arc::new(Flights::default()),
            shutting_down: AtomicBool::new(false),
            given_up: tokio::sync::watch::Sender::new(false),
            recovery_listed: tokio::sync::watch::Sender::new(false),
            unsent: Mutex::new(HashSet::new()),
            recovering: Mutex::new(HashSet::new()),
            closing: Mutex::new(HashSet::new()),
            credentials: Mutex::new(credentials),
            held: Mutex::new(HashMap::new()),
            detached: detached::Detached::default(),
            kept: Mutex::new(actions::Kept::default()),
            quota_escalations: tokio::sync::Mutex::new(()),
            limit_streaks: Mutex::new(quota_escalations::LimitStreaks::default()),
            rules,
            route_fingerprints: fingerprints,
        });
        let restore = inner.clone();
        tokio::spawn(async move { restore.recover_at_start().await });
        Engine { inner }
    }
}

/// What the previous run left unfinished, as listed at start (each list read on its own: one
/// that cannot be read is logged by the recovery step it feeds).
struct Unfinished {
    unfinished: Result<Vec<backstop_store::UnfinishedAttempt>, EngineError>,
    scheduled: Result<Vec<backstop_store::DueRetry>, EngineError>,
    between: Result<Vec<ActionId>, EngineError>,
    unsent_reads: Result<Vec<ActionId>, EngineError>,
    unsent_writes: Vec<ActionId>,
}

impl Inner {
    /// What every start does before and beside its first action: list the previous run's
    /// unfinished work, restore the scope records, then recover (SPEC §12).
    async fn recover_at_start(self: &Arc<Self>) {
        let Unfinished {
            unfinished,
            scheduled,
            between,
            unsent_reads,
            unsent_writes,
        } = self.list_unfinished().await;
        self.restore_scopes().await;
        // Restart recovery (SPEC §12): writes sent without a result are reconciled with
        // their original key; actions left between two attempts are closed (an uncertain
        // write reconciled); scheduled retries are re-armed at their due instants.
        self.recover_unfinished(unfinished).await;
        self.recover_between_attempts(between).await;
        self.close_unsent_reads(unsent_reads).await;
        self.resume_unsent(unsent_writes).await;
        self.rearm_scheduled(scheduled).await;
    }

    /// The previous run's unfinished attempts and scheduled retries, listed before any
    /// action of this run is recorded (`recovery_listed` is told once they are): a retry this
    /// run schedules is its own, never one to re-arm as if its caller were gone.
    async fn list_unfinished(&self) -> Unfinished {
        let unfinished = self.blocking(|s| s.unfinished_attempts()).await;
        let scheduled = self.blocking(|s| s.scheduled_retries()).await;
        let between = self.blocking(|s| s.actions_between_attempts()).await;
        let unsent_reads = self.blocking(|s| s.unsent_reads()).await;
        let unsent_writes = match self.blocking(|s| s.unsent_writes()).await {
            Ok(unsent) => {
                if !unsent.is_empty() {
                    tracing::info!(
                        writes = unsent.len(),
                        "restart recovery: writes recorded but never sent are sent from their kept requests under their original keys"
                    );
                }
                self.unsent
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .extend(unsent.iter().map(|id| id.0));
                unsent
            }
            Err(e) => {
                tracing::error!(error = %e, "restart recovery: cannot read the writes never sent");
                Vec::new()
            }
        };
        self.recovery_listed.send_replace(true);
        Unfinished {
            unfinished,
            scheduled,
            between,
            unsent_reads,
            unsent_writes,
        }
    }

    /// The scope records as stored before the restart, so boundaries recorded then keep
    /// holding.
    async fn restore_scopes(&self) {
        let scopes: Vec<(String, String)> = self
            .policy
            .providers
            .iter()
            .flat_map(|(p, provider)| {
                provider
                    .scopes
                    .values()
                    .map(move |s| (p.clone(), s.name.clone()))
            })
            .collect();
        for (provider, scope) in scopes {
            let (p, s) = (provider.clone(), scope.clone());
            match self.blocking(move |st| st.scope(&p, &s)).await {
                Ok(Some(record)) => {
                    self.scheduler
                        .signal(
                            std::slice::from_ref(&scope),
                            ScopeSignal::Restore {
                                next_allowed_at: record.next_allowed_at,
                                remaining: record.remaining,
                                limit: record.limit,
                                reset_at: record.reset_at,
                                source: record.source,
                            },
                        )
                        .await;
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(scope = %scope, error = %e, "could not read the stored scope record")
                }
            }
        }
    }
}
