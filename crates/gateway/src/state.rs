//! The state every HTTP face shares: the policy, the tokens, the engine behind its
//! [`Executor`], the body budget, and whether new work is still accepted.

use std::sync::{
    atomic::{AtomicBool, AtomicUsize, Ordering},
    Arc,
};

use backstop_core::policy::Policy;
use backstop_store::Store;
use tokio::sync::Notify;

use crate::{
    auth::Authenticator,
    body_budget::{BodyBudget, DoorConfig},
    clock::TokioClock,
    executor::Executor,
    metrics::Metrics,
    secrets::ProviderCredentials,
};

/// Shared state of the router.
pub struct AppState {
    /// The validated policy.
    pub policy: Arc<Policy>,
    /// Agent and operator token digests (shared with the escalation and health routes).
    pub auth: Arc<Authenticator>,
    /// Provider credential headers.
    pub credentials: ProviderCredentials,
    /// The engine.
    pub executor: Arc<dyn Executor>,
    /// The clock (for `Retry-After` in problems).
    pub clock: TokioClock,
    /// Metrics rendered at `/metrics`.
    pub metrics: Arc<Metrics>,
    /// Body limits of the door.
    pub door: DoorConfig,
    /// Whether `/metrics` is served without a token (loopback listener).
    pub metrics_open: bool,
    /// Request bodies held in memory, capped at [`DoorConfig::body_budget_bytes`] across
    /// connections (the door and `POST /v1/actions` read bodies through it).
    pub body_budget: BodyBudget,
    /// What free text kept with an action or a decision is scrubbed of (see [`crate::scrub`]).
    pub secrets: Arc<crate::scrub::HeldSecrets>,
    accepting: AtomicBool,
    /// Requests whose response has not been dropped yet (a streamed body counts until its end).
    pub(crate) in_flight: AtomicUsize,
    /// Woken when `in_flight` drops to zero.
    pub(crate) idle: Notify,
    /// The store whose writes `GET /v1/live` reports on, when one is set
    /// ([`AppState::with_store`]).
    pub(crate) store: Option<Arc<dyn Store>>,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("auth", &self.auth)
            .field("credentials", &self.credentials)
            .field("door", &self.door)
            .field("metrics_open", &self.metrics_open)
            .finish_non_exhaustive()
    }
}

impl AppState {
    /// Assembles the state; it accepts work until [`AppState::stop_accepting`].
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        policy: Arc<Policy>,
        auth: Authenticator,
        credentials: ProviderCredentials,
        executor: Arc<dyn Executor>,
        clock: TokioClock,
        metrics: Arc<Metrics>,
        door: DoorConfig,
        metrics_open: bool,
    ) -> AppState {
        let auth = Arc::new(auth);
        let secrets = Arc::new(crate::scrub::HeldSecrets::new(auth.clone(), &credentials));
        AppState {
            policy,
            auth,
            secrets,
            credentials,
            executor,
            clock,
            metrics,
            door,
            metrics_open,
            body_budget: BodyBudget::new(door.body_budget_bytes),
            accepting: AtomicBool::new(true),
            in_flight: AtomicUsize::new(0),
            idle: Notify::new(),
            store: None,
        }
    }

    /// The state with `store` as the one `GET /v1/live` reports on: while its last write
    /// transaction failed ([`Store::write_failure`]), the gateway is not serving.
    #[must_use]
    pub fn with_store(mut self, store: Arc<dyn Store>) -> AppState {
        self.store = Some(store);
        self
    }

    /// Requests being answered now (counted by the edge layer of [`crate::server::full_router`], until the
    /// response body ends or is dropped).
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Whether new work is accepted.
    pub fn accepting(&self) -> bool {
        self.accepting.load(Ordering::Acquire)
    }

    /// From now on the door answers 503 `shutting_down`.
    pub fn stop_accepting(&self) {
        self.accepting.store(false, Ordering::Release);
    }
}
