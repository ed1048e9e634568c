//! `backstop serve`: one listener for the proxy door, `GET /v1/scopes` and `GET /metrics`.
//!
//! Why one listener and a careful start: agents, operators and Prometheus all reach backstop at
//! one address, and a gateway that starts with a missing secret or an unreadable store would
//! fail every call later, far from the cause. [`start`] therefore resolves everything first —
//! agent token digests, provider credentials, the store, the upstream client, the listening
//! socket — and fails with a [`StartError`] naming what is wrong before accepting any request.
//!
//! Who may read what:
//! - the proxy door: agent tokens (see [`crate::door`]);
//! - `GET /v1/scopes`: agent or operator tokens; the JSON array of the engine's scope views;
//! - `GET /v1/live`: no token; `200 {"status": "serving"}` while the gateway takes work;
//! - `GET /metrics`: open when the listener is on a loopback address (a local Prometheus or
//!   curl needs no token), otherwise an agent or operator token. Content type
//!   [`METRICS_CONTENT_TYPE`] (OpenMetrics 1.0 text).
//!
//! Connections are served by hyper (HTTP/1.1) with a header read timeout
//! ([`ServeOptions::header_read_timeout`]); every route sits under one edge layer (body read
//! timeout → 408, every error answer an RFC 9457 problem, requests counted in flight). Answers
//! hyper makes before a request exists (414 for a target over 65,534 bytes, 431 for too many or
//! too large headers, 400 for bytes that are not HTTP/1.1) have no body and no receipt headers:
//! hyper 1's HTTP/1 server writes them itself when the head fails to parse, before any service
//! is called, and has no hook to change them, so they cannot reach the router.
//!
//! Shutdown ([`Running::shutdown`], wired to SIGTERM and Ctrl-C by the CLI) is bounded by one
//! grace: new requests, on new or kept-alive connections, are answered 503 `shutting_down` with
//! `Connection: close` (nothing sent) while the engine's `shutdown` stops taking work and leaves
//! every accepted action recoverable in the store; an attempt the provider has not answered a
//! quarter of the grace (at most 1 s) before its end is given up, its caller answered 503
//! `shutting_down` with what the next start does ([`Executor::give_up_attempts`]); once nothing
//! is in flight the listener and idle connections close; a response still open when the grace
//! ends (a long SSE stream) is cut.

use std::{
    future::Future,
    net::SocketAddr,
    path::PathBuf,
    pin::Pin,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    task::{Context, Poll},
    time::Duration,
};

use axum::{
    body::{Body, Bytes},
    extract::State,
    http::{header, HeaderValue, Method, Request, Uri},
    middleware::Next,
    response::{IntoResponse, Response},
    routing::get,
    Router,
};
use backstop_core::policy::Policy;
use backstop_store::Store;
use http_body::{Body as HttpBody, Frame, SizeHint};
use tokio::{
    net::{TcpListener, TcpStream},
    sync::watch,
    task::{JoinHandle, JoinSet},
};

use crate::{
    auth::{Authenticator, Role},
    clock::TokioClock,
    door::{self, DoorConfig},
    escalations, health,
    metrics::Metrics,
    problem::Problem,
    secrets::{EnvLookup, ProviderCredentials, SecretError},
    transport::Transport,
    upstream::{Upstream, UpstreamConfig, UpstreamError},
    watchdog,
    wire::ProviderResponse,
};

pub use crate::{
    executor::{BoxFuture, Executor},
    state::AppState,
};

/// The production executor: `engine::Engine` over the given parts (pass to [`start`]).
pub fn engine(parts: Parts) -> Arc<dyn Executor> {
    Arc::new(crate::engine::Engine::with_credentials(
        parts.policy,
        parts.store,
        parts.transport,
        parts.clock,
        parts.metrics,
        parts.seed,
        parts.credentials,
    ))
}

/// The router: `GET /v1/scopes`, `GET /v1/live`, `GET /metrics`, and the proxy door for every
/// other path.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/scopes", get(scopes))
        .route("/v1/live", get(live))
        .route("/metrics", get(metrics))
        .fallback(door_handler)
        .with_state(state)
}

async fn door_handler(State(state): State<Arc<AppState>>, request: Request<Body>) -> Response {
    door::proxy(state, request).await
}

async fn scopes(State(state): State<Arc<AppState>>, request: Request<Body>) -> Response {
    if let Err(problem) = state.auth.authenticate(request.headers()) {
        return Problem::from(problem).into_response();
    }
    axum::Json(state.executor.scopes()).into_response()
}

/// `GET /v1/live`: `200 {"status": "serving"}` without a token, for a liveness or readiness
/// probe (a load balancer, an orchestrator). It says that this process answers and takes work,
/// and that its store makes writes durable: the gateway does not start on a store it cannot
/// write (`SqliteStore::open` checks it), and while the store's last write transaction failed
/// it is answered `503 store_unavailable` naming the store's error, until a write commits
/// again. Nothing about providers or tasks. During a stop it is answered `503 shutting_down`
/// like every other request.
async fn live(State(state): State<Arc<AppState>>) -> Response {
    if let Some(failure) = state.store.as_ref().and_then(|s| s.write_failure()) {
        return Problem::store_unavailable(
            false,
            format!(
                "the store's last write could not be made durable ({failure}); the gateway \
                 answers writes 503 until one commits again"
            ),
        )
        .into_response();
    }
    axum::Json(serde_json::json!({ "status": "serving" })).into_response()
}

/// The content type of `/metrics`: the exposition is OpenMetrics 1.0 text (`_total` counters,
/// the closing `# EOF`), served as such.
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

async fn metrics(State(state): State<Arc<AppState>>, request: Request<Body>) -> Response {
    if !state.metrics_open {
        if let Err(problem) = state.auth.authenticate(request.headers()) {
            return Problem::from(problem).into_response();
        }
    }
    if let Some(engine) = state.executor.engine() {
        engine.refresh_open_escalations().await;
    }
    let mut response = state.metrics.render().into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(METRICS_CONTENT_TYPE),
    );
    response
}

/// Options of `backstop serve` beyond the policy.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Listen address; overrides the policy's `listen` (default `127.0.0.1:8080`).
    pub listen: Option<String>,
    /// SQLite store path; overrides the policy's `store` (default `./backstop.db`).
    pub store: Option<PathBuf>,
    /// Body limits.
    pub door: DoorConfig,
    /// Upstream timeouts.
    pub upstream: UpstreamConfig,
    /// Seed of the engine's jitter.
    pub seed: u64,
    /// The one bound on the whole shutdown: engine stop plus draining (default 10 s).
    pub shutdown_grace: Duration,
    /// Longest time to receive a request's head (request line and headers) once its first
    /// byte arrived; a slower connection is closed without an answer (hyper's
    /// `header_read_timeout`; default [`DEFAULT_READ_TIMEOUT`]).
    pub header_read_timeout: Duration,
}

/// The default read timeouts: a request's head, and its whole body, must arrive within 30 s.
pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(30);

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            listen: None,
            store: None,
            door: DoorConfig::default(),
            upstream: UpstreamConfig::default(),
            seed: 0,
            shutdown_grace: Duration::from_secs(10),
            header_read_timeout: DEFAULT_READ_TIMEOUT,
        }
    }
}

/// The default listen address.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
/// The default store file.
pub const DEFAULT_STORE: &str = "./backstop.db";

/// Why `backstop serve` could not start. Each message names what to fix.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A token or secret could not be resolved (names the policy place and the variable/file).
    #[error("{0}")]
    Secret(#[from] SecretError),
    /// The store could not be opened.
    #[error("cannot open the store {}: {reason}", path.display())]
    Store {
        /// The store file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The listener could not be bound.
    #[error("cannot listen on {addr}: {reason}")]
    Listen {
        /// The address as given.
        addr: String,
        /// Why (`the address is already in use`, …).
        reason: String,
    },
    /// The upstream client could not be built.
    #[error("{0}")]
    Upstream(#[from] UpstreamError),
    /// The policy cannot be served as written (names the policy place and the reason).
    #[error("{0}")]
    Policy(String),
}

/// First path segments that belong to backstop itself (see
/// [`backstop_core::policy::RESERVED_PROVIDER_NAMES`]).
pub use backstop_core::policy::RESERVED_PROVIDER_NAMES;

/// Refuses a policy whose provider names collide with backstop's own routes or are dot
/// segments. The rule lives in one place, [`backstop_core::policy::check_provider_name`], which
/// policy validation applies too; this re-check covers policies built in code.
///
/// # Errors
/// [`StartError::Policy`] naming `providers.NAME` and the reason.
pub fn check_provider_names(policy: &Policy) -> Result<(), StartError> {
    for name in policy.providers.keys() {
        backstop_core::policy::check_provider_name(name)
            .map_err(|reason| StartError::Policy(format!("providers.{name}: {reason}")))?;
    }
    Ok(())
}

/// Everything an executor is built from.
#[derive(Clone)]
pub struct Parts {
    /// The policy.
    pub policy: Arc<Policy>,
    /// The opened store.
    pub store: Arc<dyn Store>,
    /// The upstream client.
    pub transport: Arc<dyn Transport>,
    /// The clock.
    pub clock: TokioClock,
    /// The metrics.
    pub metrics: Arc<Metrics>,
    /// Seed of the engine's jitter.
    pub seed: u64,
    /// Provider credential headers `(provider, name, value)` for reconciliation lookups made
    /// without an agent request (restart recovery).
    pub credentials: Vec<(String, http::HeaderName, HeaderValue)>,
}

/// How many 5 ms pauses [`Running::shutdown`] waits, at most, for the store's last user to let
/// go (2 s in all).
const STORE_RELEASE_POLLS: u32 = 400;

/// A started gateway.
pub struct Running {
    /// The bound address.
    pub addr: SocketAddr,
    /// The store file in use.
    pub store_path: PathBuf,
    state: Arc<AppState>,
    trigger: watch::Sender<bool>,
    task: JoinHandle<std::io::Result<()>>,
    watchdog: JoinHandle<()>,
    grace: Duration,
    /// The store: at shutdown, once every other user has let go, it is closed here (its writer
    /// finishes and its write lock is released) before [`Running::shutdown`] returns.
    store: Arc<dyn Store>,
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running")
            .field("addr", &self.addr)
            .field("store_path", &self.store_path)
            .field("grace", &self.grace)
            .finish_non_exhaustive()
    }
}

impl Running {
    /// The router state (tests inspect it).
    pub fn state(&self) -> &Arc<AppState> {
        &self.state
    }

    /// Stops the gateway within the grace period, one bound for the whole shutdown: new
    /// requests (on new or kept-alive connections) are answered `503 shutting_down` with
    /// `Connection: close`, the engine stops taking work, and as soon as no response is in
    /// flight the listener and idle connections are closed. Attempts still out a quarter of
    /// the grace (at most 1 s) before its end are given up ([`Executor::give_up_attempts`]):
    /// their callers are answered `503 shutting_down`. When the grace runs out first, the
    /// remaining connections (a long SSE stream) are cut. When it returns, the store is closed
    /// and its write lock released, unless background work still held it 2 s after the server
    /// stopped (a re-armed retry sleeping until its due instant).
    ///
    /// # Errors
    /// The server's I/O error, if it failed while running.
    pub async fn shutdown(self) -> std::io::Result<()> {
        let Running {
            state,
            trigger,
            mut task,
            watchdog,
            grace,
            store,
            ..
        } = self;
        let _ = trigger.send(true);
        watchdog.abort();
        // A cancelled watchdog answers at once; `Err` is its cancellation.
        let _ = watchdog.await;
        // The serving task bounds itself by the grace; the margin only covers a stuck task.
        let result = match tokio::time::timeout(grace + Duration::from_millis(500), &mut task).await
        {
            Ok(Ok(result)) => result,
            Ok(Err(join)) => Err(std::io::Error::other(join.to_string())),
            Err(_) => {
                tracing::warn!("shutdown: the server did not stop within the grace; aborting it");
                task.abort();
                Ok(())
            }
        };
        drop(state);
        // The store closes, and its write lock is released, when its last user lets go: a
        // store call still running on a blocking thread finishes first. Wait for that, within
        // STORE_RELEASE_POLLS × 5 ms, then close it here, so that a process may open the same
        // store as soon as this returns (its close joins the writer thread: a blocking call).
        for _ in 0..STORE_RELEASE_POLLS {
            if Arc::strong_count(&store) == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if Arc::strong_count(&store) == 1 {
            if let Err(e) = tokio::task::spawn_blocking(move || drop(store)).await {
                tracing::warn!(error = %e, "shutdown: closing the store failed");
            }
        } else {
            tracing::debug!("shutdown: background work still holds the store");
        }
        result
    }

    /// Waits until the server stops on its own (it only does on an I/O error).
    ///
    /// # Errors
    /// The server's I/O error.
    pub async fn wait(&mut self) -> std::io::Result<()> {
        match (&mut self.task).await {
            Ok(result) => result,
            Err(join) => Err(std::io::Error::other(join.to_string())),
        }
    }
}

/// Opens the SQLite store at `path` (blocking work, run off the async workers).
///
/// # Errors
/// [`StartError::Store`] naming the path.
pub async fn open_sqlite(path: PathBuf) -> Result<Arc<dyn Store>, StartError> {
    let for_error = path.clone();
    let opened = tokio::task::spawn_blocking(move || backstop_store::SqliteStore::open(&path))
        .await
        .map_err(|e| StartError::Store {
            path: for_error.clone(),
            reason: e.to_string(),
        })?;
    match opened {
        Ok(store) => Ok(Arc::new(store)),
        Err(e) => {
            // Most store errors begin with the file's path already: named once, not twice.
            let reason = e.to_string();
            let named = format!("{}: ", for_error.display());
            let reason = reason
                .strip_prefix(&named)
                .map(str::to_owned)
                .unwrap_or(reason);
            Err(StartError::Store {
                path: for_error,
                reason,
            })
        }
    }
}

/// Starts the gateway: resolves tokens and credentials, opens the store, builds the upstream
/// client and the executor (`build`), binds the listener and serves until
/// [`Running::shutdown`]. Logs one startup line with the address, the store and the providers.
///
/// # Errors
/// [`StartError`]: a missing or unreadable secret (named), a store that cannot be opened, an
/// address that cannot be bound (`the address is already in use`).
pub async fn start(
    policy: Policy,
    options: ServeOptions,
    env: EnvLookup<'_>,
    build: impl FnOnce(Parts) -> Arc<dyn Executor>,
) -> Result<Running, StartError> {
    check_provider_names(&policy)?;
    let auth = Authenticator::resolve(&policy, env)?;
    let credentials = ProviderCredentials::resolve(&policy, env)?;
    let listen = options
        .listen
        .clone()
        .or_else(|| policy.listen.clone())
        .unwrap_or_else(|| DEFAULT_LISTEN.to_owned());
    let store_path = options
        .store
        .clone()
        .or_else(|| policy.store.clone())
        .unwrap_or_else(|| PathBuf::from(DEFAULT_STORE));
    let (listener, addr) = bind(&listen).await?;
    let store = open_sqlite(store_path.clone()).await?;
    let transport: Arc<dyn Transport> = Arc::new(Upstream::new(options.upstream)?);
    let policy = Arc::new(policy);
    let clock = TokioClock::system();
    let metrics = Arc::new(Metrics::new());
    let executor = build(Parts {
        policy: policy.clone(),
        store: store.clone(),
        transport,
        clock,
        metrics: metrics.clone(),
        seed: options.seed,
        credentials: lookup_credentials(&policy, &credentials),
    });
    let state = AppState::new(
        policy.clone(),
        auth,
        credentials,
        executor,
        clock,
        metrics,
        options.door,
        addr.ip().is_loopback(),
    )
    .with_store(store.clone());
    let state = Arc::new(state);
    warn_unavailable_secrets(&state);
    log_listening(&state, addr, &store_path);
    let (trigger, signal) = watch::channel(false);
    let app = full_router(state.clone(), store.clone());
    let watchdog = spawn_watchdog(store.clone(), &state, &policy);
    let task = tokio::spawn(serve(
        listener,
        app,
        state.clone(),
        signal,
        options.shutdown_grace,
        options.header_read_timeout,
    ));
    Ok(Running {
        addr,
        store_path,
        state,
        trigger,
        task,
        watchdog,
        grace: options.shutdown_grace,
        store,
    })
}

/// Binds the listener to `listen` (`localhost:0` and other host names are resolved, every
/// address is tried in turn) and returns it with the address it got.
///
/// # Errors
/// [`StartError::Listen`] naming the address and why in words.
async fn bind(listen: &str) -> Result<(TcpListener, SocketAddr), StartError> {
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|e| StartError::Listen {
            addr: listen.to_owned(),
            reason: match e.kind() {
                std::io::ErrorKind::AddrInUse => "the address is already in use".to_owned(),
                std::io::ErrorKind::PermissionDenied => {
                    "permission denied (ports below 1024 need privileges)".to_owned()
                }
                _ => e.to_string(),
            },
        })?;
    let addr = listener.local_addr().map_err(|e| StartError::Listen {
        addr: listen.to_owned(),
        reason: e.to_string(),
    })?;
    Ok((listener, addr))
}

/// The credentials the executor's lookups send: `(provider, header name, value)` for every
/// provider whose credential resolved.
fn lookup_credentials(
    policy: &Policy,
    credentials: &ProviderCredentials,
) -> Vec<(String, http::HeaderName, HeaderValue)> {
    policy
        .providers
        .keys()
        .filter_map(|name| {
            credentials
                .get(name)
                .map(|c| (name.clone(), c.name.clone(), c.value.clone()))
        })
        .collect()
}

/// Warns once per token or provider credential whose file was missing at start.
fn warn_unavailable_secrets(state: &AppState) {
    for error in state.auth.unavailable() {
        tracing::warn!(
            "{error}; this caller cannot authenticate until the file exists and backstop restarts"
        );
    }
    for error in state.credentials.unavailable().values() {
        tracing::warn!("{error}; calls to this provider are refused (credential_unavailable) until the file exists and backstop restarts");
    }
}

/// The one startup line: the address, the store, the providers, the tokens and the worker
/// threads.
fn log_listening(state: &AppState, addr: SocketAddr, store_path: &std::path::Path) {
    let providers: Vec<&str> = state.policy.providers.keys().map(String::as_str).collect();
    // The runtime's own count: what `--worker-threads` (or one per core) gave.
    let workers = tokio::runtime::Handle::current().metrics().num_workers();
    tracing::info!(
        listen = %addr,
        store = %store_path.display(),
        providers = %providers.join(","),
        tokens = state.auth.len(),
        workers,
        "backstop serve: listening on http://{addr} (store {}, providers: {}, {workers} worker thread{})",
        store_path.display(),
        if providers.is_empty() { "none".to_owned() } else { providers.join(", ") },
        if workers == 1 { "" } else { "s" },
    );
}

/// The watchdog of a serving gateway: it watches the store with the policy's health
/// thresholds and opens no escalations.
fn spawn_watchdog(store: Arc<dyn Store>, state: &AppState, policy: &Policy) -> JoinHandle<()> {
    let health_policy = Arc::new(health::HealthPolicy::from_policy(policy));
    watchdog::spawn_watchdog(
        store,
        state.clock,
        state.metrics.clone(),
        watchdog::WatchdogConfig {
            policy: health_policy,
            escalate: false,
            ..watchdog::WatchdogConfig::default()
        },
    )
}

/// Accepts connections and serves `app` on each (HTTP/1.1, hyper), until `signal` turns true;
/// then shuts down within `grace` (see [`Running::shutdown`]).
async fn serve(
    listener: TcpListener,
    app: Router,
    state: Arc<AppState>,
    mut signal: watch::Receiver<bool>,
    grace: Duration,
    header_read_timeout: Duration,
) -> std::io::Result<()> {
    let (close, closing) = watch::channel(false);
    let mut connections = Connections {
        set: JoinSet::new(),
        app,
        state,
        closing,
        header_read_timeout,
    };
    loop {
        tokio::select! {
            _ = async { signal.wait_for(|stop| *stop).await.is_ok() } => break,
            accepted = listener.accept() => connections.accept(accepted).await,
            Some(_) = connections.set.join_next() => {}
        }
    }
    let deadline = tokio::time::Instant::now() + grace;
    let in_time = drain(&listener, &mut connections, grace, deadline).await;
    drop(listener);
    let _ = close.send(true);
    connections.close(deadline, in_time).await;
    Ok(())
}

/// The stop's grace: new requests get 503 while the engine stops and the requests in flight are
/// answered; attempts still out near the end are given up. `true` when everything was answered
/// before `deadline`.
async fn drain(
    listener: &TcpListener,
    connections: &mut Connections,
    grace: Duration,
    deadline: tokio::time::Instant,
) -> bool {
    let state = connections.state.clone();
    // Attempts still out this long before the deadline are given up, so that their callers
    // are answered within the grace rather than cut off at its end.
    let give_up_at = deadline - answer_margin(grace);
    let mut given_up = false;
    state.stop_accepting();
    tracing::info!(
        grace_ms = grace.as_millis() as u64,
        "backstop serve: shutting down; new requests get 503"
    );
    let engine_stop = state.executor.shutdown();
    tokio::pin!(engine_stop);
    let mut engine_stopped = false;
    loop {
        let idle = state.idle.notified();
        tokio::pin!(idle);
        idle.as_mut().enable();
        if engine_stopped && state.in_flight() == 0 {
            return true;
        }
        tokio::select! {
            _ = tokio::time::sleep_until(deadline) => return false,
            _ = tokio::time::sleep_until(give_up_at), if !given_up => {
                given_up = true;
                if state.in_flight() > 0 {
                    tracing::info!(
                        in_flight = state.in_flight(),
                        "backstop serve: the grace is running out; attempts still out are given up and their callers answered 503"
                    );
                }
                state.executor.give_up_attempts();
            }
            _ = &mut engine_stop, if !engine_stopped => {
                engine_stopped = true;
                tracing::info!("backstop serve: engine stopped; draining open responses");
            }
            _ = &mut idle => {}
            // Still listening: a new connection is answered 503 rather than refused.
            accepted = listener.accept() => connections.accept(accepted).await,
            Some(_) = connections.set.join_next() => {}
        }
    }
}

/// The connections being served, with what each new one is served with.
struct Connections {
    set: JoinSet<()>,
    app: Router,
    state: Arc<AppState>,
    /// Turns true when the connections are to close (gracefully: a response being written is
    /// finished).
    closing: watch::Receiver<bool>,
    header_read_timeout: Duration,
}

impl Connections {
    /// Starts serving one accepted connection (a failed `accept` is logged and, for a lack of
    /// resources, waited out briefly instead of spinning).
    async fn accept(&mut self, accepted: std::io::Result<(TcpStream, SocketAddr)>) {
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(error) => {
                tracing::debug!(%error, "backstop serve: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                return;
            }
        };
        let _ = stream.set_nodelay(true);
        let header_read_timeout = self.header_read_timeout;
        let service = ConnectionService {
            state: self.state.clone(),
            router: hyper_util::service::TowerToHyperService::new(self.app.clone()),
        };
        let mut closing = self.closing.clone();
        self.set.spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(header_read_timeout);
            let connection =
                builder.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            tokio::pin!(connection);
            tokio::select! {
                result = connection.as_mut() => {
                    if let Err(error) = result {
                        tracing::debug!(%error, "backstop serve: connection ended with an error");
                    }
                    return;
                }
                _ = async { closing.wait_for(|close| *close).await.is_ok() } => {
                    connection.as_mut().graceful_shutdown();
                }
            }
            let _ = connection.await;
        });
    }

    /// Waits until `deadline` for the connections to close once told to (only when the grace
    /// ended `in_time`), then closes those still open.
    async fn close(mut self, deadline: tokio::time::Instant, in_time: bool) {
        if in_time {
            // Idle keep-alive connections close now; a response being written is finished.
            while tokio::time::timeout_at(deadline, self.set.join_next())
                .await
                .is_ok_and(|next| next.is_some())
            {}
        }
        if !self.set.is_empty() {
            tracing::warn!(
                connections = self.set.len(),
                "shutdown: connections still open after the grace period; closing them"
            );
        }
        self.set.abort_all();
    }
}

/// The end of the stop's grace kept for answering callers whose attempt is given up
/// ([`Executor::give_up_attempts`]): a quarter of the grace, at most 1 s.
fn answer_margin(grace: Duration) -> Duration {
    (grace / 4).min(Duration::from_secs(1))
}

/// The service of one connection. A request whose first path segment names a provider of the
/// policy goes to the proxy door directly, under the same edge layer as every route
/// ([`edge_around`]); every other request goes through the router of [`full_router`]. Nothing
/// else could answer such a request: every route of backstop's own starts with a reserved
/// first segment (`v1`, `metrics`: [`RESERVED_PROVIDER_NAMES`], which no provider may be
/// named), so the door is the router's fallback for it anyway, and looking it up in the route
/// table (and the middleware plumbing around it) is work a proxied call need not do.
struct ConnectionService {
    state: Arc<AppState>,
    router: hyper_util::service::TowerToHyperService<Router>,
}

impl hyper::service::Service<Request<hyper::body::Incoming>> for ConnectionService {
    type Response = Response;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Result<Response, std::convert::Infallible>>;

    fn call(&self, request: Request<hyper::body::Incoming>) -> Self::Future {
        if !names_a_provider(&self.state.policy, request.uri().path()) {
            return Box::pin(hyper::service::Service::call(&self.router, request));
        }
        let state = self.state.clone();
        let request = request.map(Body::new);
        Box::pin(async move {
            let door_state = state.clone();
            let response = edge_around(
                state,
                request,
                |state, request| async move {
                    let (method, path) = (request.method(), request.uri().path());
                    door::draining(&state.policy, method, path, request.headers())
                },
                move |request| door::proxy(door_state, request),
            )
            .await;
            Ok(response)
        })
    }
}

/// Whether the first segment of `path` is, as written, the name of a provider of `policy`.
fn names_a_provider(policy: &Policy, path: &str) -> bool {
    path.strip_prefix('/')
        .map(|rest| rest.split('/').next().unwrap_or(rest))
        .is_some_and(|first| policy.providers.contains_key(first))
}

/// Counts one request in flight until dropped (held by the response body).
struct InFlight(Arc<AppState>);

impl InFlight {
    fn enter(state: Arc<AppState>) -> InFlight {
        state.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight(state)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// A response body that keeps its request counted in flight until it ends or is dropped.
struct Counted {
    inner: Body,
    _in_flight: InFlight,
}

impl HttpBody for Counted {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A request body that must be received within a deadline counted from the request head;
/// past it, the next read fails and `timed_out` is set (the edge layer then answers 408).
struct Timed {
    inner: Body,
    deadline: Pin<Box<tokio::time::Sleep>>,
    timed_out: Arc<AtomicBool>,
    limit: Duration,
}

impl HttpBody for Timed {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(frame);
        }
        if this.deadline.as_mut().poll(cx).is_ready() {
            this.timed_out.store(true, Ordering::Release);
            return Poll::Ready(Some(Err(axum::Error::new(format!(
                "the request body was not received within {} s",
                this.limit.as_secs_f64()
            )))));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The edge layer around every route of [`full_router`]:
/// - while shutting down, every request is answered `503 shutting_down` with
///   `Connection: close` (nothing sent); on the proxy door and `POST /v1/actions` naming its
///   task and a write's key ([`door::draining`], [`crate::actions_api::draining`]);
/// - each request is counted in flight until its response body ends (the drain waits on it);
/// - the request body must arrive within [`DoorConfig::body_read_timeout`] of the head, else
///   `408 request_timeout` with `Backstop-Action-Id: 0` and `Backstop-Attempts: 0` (nothing was
///   recorded or sent);
/// - an error answer that is not already `application/problem+json` (an extractor's
///   rejection, a bare status) becomes an RFC 9457 problem with the same status, the
///   rejection's text as `detail` and the `Allow` header kept; provider responses
///   ([`ProviderResponse`]) pass unchanged.
async fn edge(State(state): State<Arc<AppState>>, request: Request<Body>, next: Next) -> Response {
    edge_around(state, request, draining, |request| next.run(request)).await
}

/// The answer of a router's route while shutting down: `POST /v1/actions` names its task and a
/// write's key, read from its body ([`crate::actions_api::draining`], counted in flight while
/// the body is read); every other route gets the plain `503 shutting_down`.
async fn draining(state: Arc<AppState>, request: Request<Body>) -> Response {
    if request.method() == Method::POST && request.uri().path() == "/v1/actions" {
        let _in_flight = InFlight::enter(state.clone());
        let (parts, body) = request.into_parts();
        return crate::actions_api::draining(&state, &parts.headers, body).await;
    }
    Problem::shutting_down().into_response()
}

/// The edge layer (see `edge`) around `handler`: the router's middleware, and the proxy
/// door's when [`ConnectionService`] sends a request to it directly. While shutting down the
/// request is answered by `draining` instead (the door's and the action API's name the
/// request's task and key, see [`door::draining`] and [`draining`]).
async fn edge_around<D, DFut, F, Fut>(
    state: Arc<AppState>,
    request: Request<Body>,
    draining: D,
    handler: F,
) -> Response
where
    D: FnOnce(Arc<AppState>, Request<Body>) -> DFut,
    DFut: Future<Output = Response>,
    F: FnOnce(Request<Body>) -> Fut,
    Fut: Future<Output = Response>,
{
    if !state.accepting() {
        return closing(draining(state, request).await);
    }
    let in_flight = InFlight::enter(state.clone());
    let limit = state.door.body_read_timeout;
    let timed_out = Arc::new(AtomicBool::new(false));
    let flag = timed_out.clone();
    let request = request.map(|inner| {
        Body::new(Timed {
            inner,
            deadline: Box::pin(tokio::time::sleep(limit)),
            timed_out: flag,
            limit,
        })
    });
    let response = handler(request).await;
    let response = if timed_out.load(Ordering::Acquire) {
        // Nothing was recorded or sent for a request whose body never arrived: the receipt
        // headers every answer carries say so, as a door refusal's do.
        door::refusal(Problem::request_timeout(limit))
    } else {
        as_problem(response).await
    };
    let response = response.map(|inner| {
        Body::new(Counted {
            inner,
            _in_flight: in_flight,
        })
    });
    if state.accepting() {
        response
    } else {
        closing(response)
    }
}

fn closing(mut response: Response) -> Response {
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// Longest rejection text read into a problem's `detail`.
const REJECTION_TEXT_LIMIT: usize = 4096;

async fn as_problem(response: Response) -> Response {
    let status = response.status();
    let is_problem = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with(crate::problem::PROBLEM_JSON));
    if !(status.is_client_error() || status.is_server_error())
        || is_problem
        || response.extensions().get::<ProviderResponse>().is_some()
    {
        return response;
    }
    let (parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, REJECTION_TEXT_LIMIT)
        .await
        .ok()
        .and_then(|bytes| String::from_utf8(bytes.to_vec()).ok())
        .unwrap_or_default();
    let mut problem = Problem::from_status(status, &text).into_response();
    for name in [header::ALLOW, header::WWW_AUTHENTICATE] {
        if let Some(value) = parts.headers.get(&name) {
            problem.headers_mut().insert(name, value.clone());
        }
    }
    problem
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    Problem::method_not_allowed(method.as_str(), uri.path()).into_response()
}

/// Every route of one listener: [`router`] (the proxy door, scopes, metrics), the escalation
/// routes (operator tokens; decisions act through the engine), the health routes, the action
/// API and task cancellation — under the edge layer (see `edge`: 503 while shutting down,
/// the body read timeout, every error answer an RFC 9457 problem; 405 answers name the method
/// and carry `Allow`).
pub fn full_router(state: Arc<AppState>, store: Arc<dyn Store>) -> Router {
    let auth = state.auth.clone();
    let operators: Arc<escalations::OperatorLookup> = Arc::new(move |token: &str| {
        auth.identify(token)
            .filter(|caller| caller.role == Role::Operator)
            .map(|caller| caller.name)
    });
    let escalations_state = escalations::EscalationsState {
        store: store.clone(),
        operators,
        clock: state.clock,
        secrets: state.secrets.clone(),
    };
    let auth = state.auth.clone();
    let health_state = health::HealthState {
        store,
        callers: Arc::new(move |token: &str| auth.identify(token)),
        clock: state.clock,
        grace: backstop_core::diagnose::DEFAULT_WAKE_GRACE,
        policy: Arc::new(health::HealthPolicy::from_policy(&state.policy)),
    };
    let engine = state.executor.engine();
    let operators_only = axum::middleware::from_fn_with_state(state.clone(), operators_only);
    router(state.clone())
        .merge(escalations::acting_router(escalations_state, engine).route_layer(operators_only))
        .merge(health::router(health_state))
        .merge(crate::actions_api::router(state.clone()))
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(state, edge))
}

/// Before the escalation routes: a duplicated `Authorization` header is a 400, and an agent's
/// token a 403 (authenticated, but not an operator), each logged as a refusal
/// ([`Problem::log_refusal_to`]); the routes themselves answer 401 for anything else that is
/// not an operator token.
async fn operators_only(
    State(state): State<Arc<AppState>>,
    request: Request<Body>,
    next: Next,
) -> Response {
    let (problem, caller) = match state.auth.authenticate(request.headers()) {
        Err(error @ crate::auth::AuthError::Duplicate) => (Problem::from(error), None),
        Ok(caller) if caller.role == Role::Agent => (
            Problem::forbidden(format!(
                "`{}` is an agent; escalations are read and decided with operator tokens",
                caller.name
            )),
            Some(caller),
        ),
        _ => return next.run(request).await,
    };
    let at = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or("/v1/escalations", |path| path.as_str());
    problem.log_refusal_to(&format!("{} {at}", request.method()), caller.as_ref());
    problem.into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        action::{ActionReceipt, ActionSpec, Execution},
        auth::Role,
        transport::{AttemptReply, AttemptRequest},
    };
    use backstop_core::outcome::{Outcome, OutcomeContext};
    use http_body_util::BodyExt;
    use std::sync::Mutex;
    use tower::ServiceExt;

    /// Records the spec it was given and answers from a script.
    struct Scripted {
        seen: Mutex<Vec<ActionSpec>>,
        answer: fn() -> Execution,
    }

    impl Executor for Scripted {
        fn execute(&self, spec: ActionSpec) -> BoxFuture<Execution> {
            self.seen.lock().unwrap().push(spec);
            let answer = (self.answer)();
            Box::pin(async move { answer })
        }
        fn scopes(&self) -> serde_json::Value {
            serde_json::json!([{"provider": "billing", "scope": "billing/account", "in_flight": 0}])
        }
        fn shutdown(&self) -> BoxFuture<()> {
            Box::pin(async {})
        }
    }

    fn ok_answer() -> Execution {
        Execution::Response {
            receipt: ActionReceipt {
                action_id: 7,
                attempts: 2,
                idempotency_key: Some("k-7".into()),
                provider_operation_id: None,
                task: None,
            },
            response: http::Response::builder()
                .status(200)
                .header("connection", "x-hop")
                .header("x-hop", "1")
                .header("x-provider", "kept")
                .body(Body::from("hello"))
                .unwrap(),
        }
    }

    fn budget_answer() -> Execution {
        Execution::Outcome {
            receipt: ActionReceipt {
                action_id: 9,
                attempts: 4,
                idempotency_key: None,
                provider_operation_id: None,
                task: None,
            },
            outcome: Outcome::BudgetExhausted,
            context: OutcomeContext {
                sent: true,
                attempts: 4,
                ..OutcomeContext::default()
            },
            detail: "4 of 4 attempts used".into(),
        }
    }

    const POLICY: &str = "providers:\n  billing:\n    base_url: http://127.0.0.1:9/api\n    credential: { secret_env: BILL }\n    idempotency_header: Idempotency-Key\n    scopes:\n      account: { limit: 10 }\n    routes:\n      \"POST /v1/transfers\": { class: idempotent_write, scopes: [account] }\n";

    fn state(answer: fn() -> Execution, metrics_open: bool) -> (Arc<AppState>, Arc<Scripted>) {
        let policy = Policy::from_yaml_str(POLICY, "p.yaml").unwrap();
        let credentials =
            ProviderCredentials::resolve(&policy, &|_| Some("provider-secret".into())).unwrap();
        let auth = Authenticator::default()
            .with_token("invoice-agent", Role::Agent, "agent-token")
            .with_token("oncall", Role::Operator, "operator-token");
        let executor = Arc::new(Scripted {
            seen: Mutex::new(Vec::new()),
            answer,
        });
        let state = Arc::new(AppState::new(
            Arc::new(policy),
            auth,
            credentials,
            executor.clone(),
            TokioClock::anchored_at("2026-01-01T00:00:00Z".parse().unwrap()),
            Arc::new(Metrics::new()),
            DoorConfig::default(),
            metrics_open,
        ));
        (state, executor)
    }

    async fn call(
        state: Arc<AppState>,
        request: Request<Body>,
    ) -> (http::response::Parts, Vec<u8>) {
        let response = router(state).oneshot(request).await.unwrap();
        let (parts, body) = response.into_parts();
        let bytes = body.collect().await.unwrap().to_bytes().to_vec();
        (parts, bytes)
    }

    fn json(bytes: &[u8]) -> serde_json::Value {
        serde_json::from_slice(bytes).unwrap()
    }

    #[test]
    fn only_a_first_segment_naming_a_provider_skips_the_router() {
        let policy = Policy::from_yaml_str(
            "providers:\n  billing:\n    base_url: http://127.0.0.1:9\n",
            "p.yaml",
        )
        .unwrap();
        for path in [
            "/billing/v1/transfers",
            "/billing",
            "/billing/",
            "/billing?x=1",
        ] {
            let path = path.split('?').next().unwrap();
            assert!(names_a_provider(&policy, path), "{path}");
        }
        for path in [
            "/v1/scopes",
            "/metrics",
            "/v1/actions/7",
            "/Billing/v1",
            "/billing2/x",
            "//billing/x",
            "/%62illing/x",
            "/",
            "",
            "billing/x",
        ] {
            assert!(!names_a_provider(&policy, path), "{path}");
        }
    }
    #[tokio::test]
    async fn a_store_that_cannot_be_opened_is_named_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("not-sqlite.db");
        std::fs::write(
            &path,
            b"this is not a database, just some text of a few bytes",
        )
        .unwrap();
        let message = match open_sqlite(path.clone()).await {
            Err(e) => e.to_string(),
            Ok(_) => panic!("a text file opened as a store"),
        };
        let shown = path.display().to_string();
        assert_eq!(message.matches(&shown).count(), 1, "{message}");
        assert!(
            message.starts_with(&format!(
                "cannot open the store {shown}: not a SQLite database"
            )),
            "{message}"
        );
    }

    #[tokio::test]
    async fn door_builds_the_action_and_passes_the_response_through() {
        let (state, executor) = state(ok_answer, true);
        let request = Request::post("/billing/v1/transfers?dry=1")
            .header("authorization", "Bearer agent-token")
            .header("x-backstop-task", "run-1")
            .header("x-backstop-priority", "interactive")
            .header("prefer", "wait=20")
            .header("content-type", "application/json")
            .body(Body::from(r#"{"amount":5}"#))
            .unwrap();
        let (parts, body) = call(state, request).await;
        assert_eq!(parts.status, 200);
        assert_eq!(body, b"hello");
        assert_eq!(parts.headers["backstop-action-id"], "7");
        assert_eq!(parts.headers["backstop-attempts"], "2");
        assert_eq!(parts.headers["backstop-task"], "run-1");
        assert_eq!(parts.headers["x-provider"], "kept");
        assert!(parts.headers.get("x-hop").is_none());
        let seen = executor.seen.lock().unwrap();
        let spec = &seen[0];
        assert_eq!(spec.agent, "invoice-agent");
        assert_eq!(spec.task_id, "run-1");
        assert_eq!(spec.route.template, "/v1/transfers");
        assert_eq!(spec.route.class, "idempotent_write");
        assert_eq!(spec.route.scopes, ["billing/account"]);
        assert_eq!(spec.max_wait, Some(Duration::from_secs(20)));
        assert_eq!(
            spec.request.url,
            "http://127.0.0.1:9/api/v1/transfers?dry=1"
        );
        assert_eq!(
            spec.request.headers["authorization"],
            "Bearer provider-secret"
        );
        assert_eq!(&spec.request.body[..], br#"{"amount":5}"#);
        assert_eq!(
            spec.payload_digest,
            hex::encode(sha2::Sha256::digest(br#"{"amount":5}"#))
        );
        // The engine mints the key (one place); the door passes none.
        assert_eq!(spec.idempotency_key, None);
        assert_eq!(parts.headers["idempotency-key"], "k-7");
        assert!(!spec.single_attempt);
    }

    #[tokio::test]
    async fn each_proxied_call_observes_the_gateway_overhead() {
        let (state, _) = state(ok_answer, true);
        for _ in 0..2 {
            let request = Request::get("/billing/v1/balance")
                .header("authorization", "Bearer agent-token")
                .body(Body::empty())
                .unwrap();
            assert_eq!(call(state.clone(), request).await.0.status, 200);
        }
        let text = state.metrics.render();
        assert!(
            text.lines()
                .any(|l| l.ends_with("gateway_overhead_seconds_count 2")),
            "{text}"
        );
    }

    use sha2::Digest;

    #[tokio::test]
    async fn gateway_outcomes_are_problems_with_receipts() {
        let (state, _) = state(budget_answer, true);
        let request = Request::get("/billing/v1/balance")
            .header("authorization", "Bearer agent-token")
            .body(Body::empty())
            .unwrap();
        let (parts, body) = call(state, request).await;
        assert_eq!(parts.status, 429);
        assert_eq!(parts.headers["content-type"], "application/problem+json");
        assert_eq!(parts.headers["x-should-retry"], "false");
        assert!(parts.headers.get("retry-after").is_none());
        assert_eq!(parts.headers["backstop-action-id"], "9");
        assert_eq!(parts.headers["backstop-attempts"], "4");
        let body = json(&body);
        assert_eq!(body["outcome"], "budget_exhausted");
        assert_eq!(body["error"]["code"], "budget_exhausted");
        assert_eq!(body["error"]["message"], "4 of 4 attempts used");
        assert_eq!(body["attempts"], 4);
        assert_eq!(body["action_id"], 9);
    }

    #[tokio::test]
    async fn refusals_are_problems_and_never_reach_the_engine() {
        let (state, executor) = state(ok_answer, false);
        let cases: Vec<(Request<Body>, u16, &str)> = vec![
            (
                Request::get("/billing/x").body(Body::empty()).unwrap(),
                401,
                "unauthorized",
            ),
            (
                Request::get("/billing/x")
                    .header("authorization", "Bearer wrong")
                    .body(Body::empty())
                    .unwrap(),
                401,
                "unauthorized",
            ),
            (
                Request::get("/billing/x")
                    .header("authorization", "Bearer operator-token")
                    .body(Body::empty())
                    .unwrap(),
                403,
                "forbidden",
            ),
            (
                Request::get("/nope/x")
                    .header("authorization", "Bearer agent-token")
                    .body(Body::empty())
                    .unwrap(),
                404,
                "unknown_provider",
            ),
            (
                Request::get("/billing/x")
                    .header("authorization", "Bearer agent-token")
                    .header("x-backstop-deadline", "soon")
                    .body(Body::empty())
                    .unwrap(),
                400,
                "bad_header",
            ),
            (
                Request::get("/metrics").body(Body::empty()).unwrap(),
                401,
                "unauthorized",
            ),
            (
                Request::get("/v1/scopes").body(Body::empty()).unwrap(),
                401,
                "unauthorized",
            ),
        ];
        for (request, status, name) in cases {
            let uri = request.uri().clone();
            let (parts, body) = call(state.clone(), request).await;
            assert_eq!(parts.status, status, "{uri}");
            assert_eq!(parts.headers["content-type"], "application/problem+json");
            let body = json(&body);
            assert_eq!(
                body["type"],
                format!("urn:backstop:problem:{name}"),
                "{uri}"
            );
            assert_eq!(body["sent"], false);
        }
        assert!(executor.seen.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn odd_path_spellings_match_the_configured_route_and_forward_normalized() {
        for path in [
            "/billing/v1/./transfers",
            "/billing/v1/%74ransfers",
            "/billing/v1/x/../transfers",
            "/%62illing/v1/transfers",
        ] {
            let (state, executor) = state(ok_answer, true);
            let request = Request::post(path)
                .header("authorization", "Bearer agent-token")
                .body(Body::empty())
                .unwrap();
            let (parts, _) = call(state, request).await;
            assert_eq!(parts.status, 200, "{path}");
            let seen = executor.seen.lock().unwrap();
            assert_eq!(seen[0].route.template, "/v1/transfers", "{path}");
            assert_eq!(seen[0].route.scopes, ["billing/account"], "{path}");
            assert_eq!(
                seen[0].request.url, "http://127.0.0.1:9/api/v1/transfers",
                "{path}"
            );
        }
        // An encoded slash in the provider segment names no provider: 404, nothing sent.
        let (gateway, executor) = state(ok_answer, true);
        let request = Request::post("/billing%2Fv1/transfers")
            .header("authorization", "Bearer agent-token")
            .body(Body::empty())
            .unwrap();
        assert_eq!(call(gateway, request).await.0.status, 404);
        assert!(executor.seen.lock().unwrap().is_empty());
        for path in ["/billing/v1%2Ftransfers", "/billing/../../v1/transfers"] {
            let (state, executor) = state(ok_answer, true);
            let request = Request::post(path)
                .header("authorization", "Bearer agent-token")
                .body(Body::empty())
                .unwrap();
            let (parts, body) = call(state, request).await;
            assert_eq!(parts.status, 400, "{path}");
            let body = json(&body);
            assert_eq!(body["type"], "urn:backstop:problem:bad_request");
            if path.contains("%2F") {
                // The refusal names what each reading reaches.
                let detail = body["detail"].as_str().unwrap();
                assert!(
                    detail.contains(
                        "as written it reaches no configured route of provider `billing`"
                    ) && detail.contains(
                        "decoded it would reach route `POST /v1/transfers` of provider `billing`"
                    ),
                    "{detail}"
                );
            }
            assert!(executor.seen.lock().unwrap().is_empty());
        }
        // %2F inside an id segment matches the same route either way: forwarded as written.
        let (state, executor) = state(ok_answer, true);
        let request = Request::get("/billing/v1/accounts/a%2fb")
            .header("authorization", "Bearer agent-token")
            .body(Body::empty())
            .unwrap();
        let (parts, _) = call(state, request).await;
        assert_eq!(parts.status, 200);
        assert_eq!(
            executor.seen.lock().unwrap()[0].request.url,
            "http://127.0.0.1:9/api/v1/accounts/a%2Fb"
        );
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn live_says_the_store_fails_while_its_last_write_failed_and_serving_once_one_commits() {
        let (state, _) = state(ok_answer, true);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.db");
        let store = Arc::new(backstop_store::SqliteStore::open(&path).unwrap());
        let state = Arc::try_unwrap(state).expect("one owner");
        let state = Arc::new(state.with_store(store.clone()));
        let live = || Request::get("/v1/live").body(Body::empty()).unwrap();
        let open_task = |id: &str| {
            let (store, id) = (store.clone(), id.to_owned());
            tokio::task::spawn_blocking(move || {
                let task = backstop_store::NewTask {
                    id,
                    agent: "invoice-agent".into(),
                    priority: backstop_store::Priority::Normal,
                    deadline: None,
                };
                store.open_task(task, "2026-01-01T00:00:00Z".parse().unwrap())
            })
        };
        open_task("run-1")
            .await
            .unwrap()
            .expect("a first write commits");
        let (parts, body) = call(state.clone(), live()).await;
        assert_eq!(parts.status, 200, "{}", String::from_utf8_lossy(&body));

        // Another connection holds the write lock past the store's busy timeout (5 s): the
        // store's next transaction cannot begin.
        let other = rusqlite::Connection::open(&path).unwrap();
        other.execute_batch("BEGIN IMMEDIATE").unwrap();
        open_task("run-2")
            .await
            .unwrap()
            .expect_err("the write lock is held");
        let (parts, body) = call(state.clone(), live()).await;
        assert_eq!(parts.status, 503);
        let body = json(&body);
        assert!(
            body["type"]
                .as_str()
                .unwrap()
                .ends_with("store_unavailable"),
            "{body}"
        );
        let detail = body["detail"].as_str().unwrap();
        assert!(
            detail.contains("could not be made durable") && detail.contains("locked"),
            "{detail}"
        );

        other.execute_batch("ROLLBACK").unwrap();
        open_task("run-2")
            .await
            .unwrap()
            .expect("the lock is free again");
        let (parts, body) = call(state, live()).await;
        assert_eq!(parts.status, 200, "{}", String::from_utf8_lossy(&body));
    }

    /// The whole router over a fresh store (the store outlives the router through the guard).
    fn full(state: Arc<AppState>) -> (Router, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let store = backstop_store::SqliteStore::open(dir.path().join("b.db")).unwrap();
        (full_router(state, Arc::new(store)), dir)
    }

    async fn call_full(
        app: &Router,
        request: Request<Body>,
    ) -> (http::response::Parts, serde_json::Value) {
        let response = app.clone().oneshot(request).await.unwrap();
        let (parts, body) = response.into_parts();
        let bytes = body.collect().await.unwrap().to_bytes();
        assert_eq!(
            parts.headers["content-type"],
            crate::problem::PROBLEM_JSON,
            "{bytes:?}"
        );
        (parts, serde_json::from_slice(&bytes).unwrap())
    }

    #[tokio::test]
    async fn every_error_of_the_gateway_is_a_problem() {
        let (state, _) = state(ok_answer, true);
        let (app, _dir) = full(state);
        for (method, path, allow) in [
            ("GET", "/v1/actions", "POST"),
            ("DELETE", "/v1/actions/85", "GET,HEAD"),
            ("PUT", "/v1/escalations", "GET,HEAD"),
            ("GET", "/v1/escalations/1/decision", "POST"),
            ("POST", "/metrics", "GET,HEAD"),
        ] {
            let request = Request::builder()
                .method(method)
                .uri(path)
                .body(Body::empty())
                .unwrap();
            let (parts, body) = call_full(&app, request).await;
            assert_eq!(parts.status, 405, "{method} {path}");
            assert_eq!(parts.headers["allow"], allow, "{method} {path}");
            assert_eq!(body["type"], "urn:backstop:problem:method_not_allowed");
            assert!(body["detail"].as_str().unwrap().contains(method));
        }
        let request = Request::get("/v1/actions/%ff")
            .header("authorization", "Bearer agent-token")
            .body(Body::empty())
            .unwrap();
        let (parts, body) = call_full(&app, request).await;
        assert_eq!(parts.status, 400);
        assert_eq!(body["type"], "urn:backstop:problem:bad_request");
        assert!(body["detail"].as_str().unwrap().contains("UTF-8"), "{body}");
        let request = Request::post("/v1/escalations/1/decision")
            .header("authorization", "Bearer operator-token")
            .body(Body::from(vec![
                b' ';
                escalations::MAX_DECISION_BODY_BYTES + 1
            ]))
            .unwrap();
        let (parts, body) = call_full(&app, request).await;
        assert_eq!(parts.status, 413);
        assert_eq!(body["type"], "urn:backstop:problem:body_too_large");
        // The action API reads bodies up to the door's cap, not axum's default 2 MB.
        assert!(crate::actions_api::submit_body_limit(DoorConfig::default()) > 32 * 1024 * 1024);
        let request = Request::get("/v1/nothing")
            .header("authorization", "Bearer agent-token")
            .body(Body::empty())
            .unwrap();
        let (parts, body) = call_full(&app, request).await;
        assert_eq!(parts.status, 404);
        assert_eq!(body["type"], "urn:backstop:problem:not_found");
    }

    #[tokio::test]
    async fn duplicated_authorization_is_ambiguous_and_agents_are_not_operators() {
        let (state, executor) = state(ok_answer, true);
        let (app, _dir) = full(state);
        for path in ["/billing/v1/balance", "/v1/scopes", "/v1/escalations"] {
            let request = Request::get(path)
                .header("authorization", "Bearer agent-token")
                .header("authorization", "Bearer operator-token")
                .body(Body::empty())
                .unwrap();
            let (parts, body) = call_full(&app, request).await;
            assert_eq!(parts.status, 400, "{path}");
            assert_eq!(body["header"], "Authorization", "{path}");
        }
        assert!(executor.seen.lock().unwrap().is_empty());
        let request = Request::get("/v1/escalations")
            .header("authorization", "Bearer agent-token")
            .body(Body::empty())
            .unwrap();
        let (parts, body) = call_full(&app, request).await;
        assert_eq!(parts.status, 403);
        assert_eq!(body["type"], "urn:backstop:problem:forbidden");
        let request = Request::get("/v1/escalations")
            .header("authorization", "Bearer nobody")
            .body(Body::empty())
            .unwrap();
        let (parts, _) = call_full(&app, request).await;
        assert_eq!(parts.status, 401);
    }

    #[tokio::test]
    async fn scopes_and_metrics() {
        let (state, _) = state(ok_answer, true);
        let (parts, body) = call(
            state.clone(),
            Request::get("/v1/scopes")
                .header("authorization", "Bearer operator-token")
                .body(Body::empty())
                .unwrap(),
        )
        .await;
        assert_eq!(parts.status, 200);
        assert_eq!(json(&body)[0]["scope"], "billing/account");
        let (parts, body) = call(
            state.clone(),
            Request::get("/metrics").body(Body::empty()).unwrap(),
        )
        .await;
        assert_eq!(parts.status, 200);
        assert_eq!(parts.headers["content-type"], METRICS_CONTENT_TYPE);
        assert!(String::from_utf8(body).unwrap().contains("# EOF"));
    }

    #[tokio::test]
    async fn shutting_down_refuses_new_work() {
        let (state, executor) = state(ok_answer, true);
        state.stop_accepting();
        let (parts, _) = call(
            state,
            Request::get("/billing/x")
                .header("authorization", "Bearer agent-token")
                .body(Body::empty())
                .unwrap(),
        )
        .await;
        assert_eq!(parts.status, 503);
        assert_eq!(parts.headers["x-should-retry"], "true");
        assert!(executor.seen.lock().unwrap().is_empty());
    }

    /// A transport that must never be called (start wiring test).
    struct Unused;
    impl Transport for Unused {
        fn send(&self, _: AttemptRequest) -> BoxFuture<AttemptReply> {
            Box::pin(async {
                AttemptReply::Failed(backstop_core::classify::TransportError::Connect)
            })
        }
    }

    #[test]
    fn serve_refuses_reserved_provider_names_of_a_policy_built_in_code() {
        let mut policy = Policy::from_yaml_str(POLICY, "p.yaml").unwrap();
        assert!(check_provider_names(&policy).is_ok());
        let billing = policy.providers["billing"].clone();
        policy.providers.insert("Metrics".into(), billing);
        let err = check_provider_names(&policy).unwrap_err().to_string();
        assert!(
            err.starts_with("providers.Metrics: the name `Metrics` is reserved"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn start_names_missing_secrets_and_busy_ports() {
        let dir = tempfile::tempdir().unwrap();
        let policy = Policy::from_yaml_str(POLICY, "p.yaml").unwrap();
        let options = ServeOptions {
            listen: Some("127.0.0.1:0".into()),
            store: Some(dir.path().join("b.db")),
            ..ServeOptions::default()
        };
        let build = |_: Parts| -> Arc<dyn Executor> {
            Arc::new(Scripted {
                seen: Mutex::new(Vec::new()),
                answer: ok_answer,
            })
        };
        let err = start(policy.clone(), options.clone(), &|_| None, build)
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "providers.billing.credential: environment variable BILL is not set"
        );
        let running = start(
            policy.clone(),
            options.clone(),
            &|_| Some("s".into()),
            build,
        )
        .await
        .unwrap();
        let busy = ServeOptions {
            listen: Some(running.addr.to_string()),
            ..options
        };
        let err = start(policy, busy, &|_| Some("s".into()), build)
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "cannot listen on {}: the address is already in use",
                running.addr
            )
        );
        let _ = Unused;
        running.shutdown().await.unwrap();
    }
}
