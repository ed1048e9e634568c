//! A controllable fake provider for testing agents and backstop itself (SPEC §13).
//!
//! Why a fake: the hard cases of calling rate-limited, credentialed APIs — a 429 storm on a
//! shared account, a 503 followed by success, a write that was committed just before the
//! connection died — are rare and unrepeatable against a real provider. This crate plays that
//! provider on purpose and deterministically, and it counts every attempt it receives, so a test
//! measures what the provider saw rather than what the client believes it sent.
//!
//! What it does, per route (`METHOD /path/{param}`), all from a [`FakeConfig`]:
//! - quotas per scope (account, or per credential): fixed window or token bucket; an exceeded
//!   quota answers 429 with an honest `Retry-After` (delay-seconds, or an HTTP-date with `Date`);
//! - quota headers on every answer in one dialect: IETF `RateLimit`/`RateLimit-Policy`, OpenAI,
//!   Anthropic or GitHub;
//! - scripted faults: 5xx/429 answers, provider error codes in the body, held connections
//!   (timeouts), slow answers, dropped connections, and "commit the write, then drop the
//!   connection";
//! - an idempotency-key store (replay with `Idempotent-Replayed: true`; 422 or 409 for a key
//!   reused with a different request);
//! - a resource store with lookups by idempotency key and by external reference;
//! - server-sent events spaced in time; LLM completions in the OpenAI chat-completions and
//!   Anthropic messages shapes (one JSON answer, or streamed), as their official SDKs parse
//!   them; a fast path for benchmarks;
//! - the attempt record, as JSON at `GET /__fake/attempts`; `POST /__fake/reset` forgets all.
//!
//! ```
//! use backstop_fake_api::{FakeApi, FakeConfig, Handler, QuotaConfig, RouteConfig};
//!
//! # let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
//! # rt.block_on(async {
//! let config = FakeConfig::default()
//!     .with_quota(QuotaConfig::fixed_window("default", 10, 60_000))
//!     .with_route(RouteConfig::new("GET /v1/items/{id}", Handler::default()).with_quota("default"));
//! let fake = FakeApi::start(config, "127.0.0.1:0".parse().unwrap()).unwrap();
//! assert!(fake.url().starts_with("http://127.0.0.1:"));
//! assert_eq!(fake.attempts().len(), 0);
//! fake.shutdown().await;
//! # });
//! ```
#![deny(missing_docs)]

mod attempt;
mod clock;
mod compiled;
mod completion;
mod config;
mod provider;
mod quota;
mod reply;
mod rng;
mod server;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use attempt::{AttemptOutcome, AttemptRecord};
pub use config::{
    CompletionApi, Dialect, FakeConfig, Fault, FaultRule, FixedWindow, Handler, QuotaConfig,
    RetryAfterForm, RouteConfig, ScopeKey, TokenBucket,
};
pub use server::Observer;

use compiled::Compiled;
use provider::ProviderState;
use server::{Shared, Stop};

/// Everything that can go wrong starting or configuring the fake provider.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The config is well-formed but invalid at `place` (e.g. `routes[1].quotas[0]`).
    #[error("invalid fake-api config at {place}: {reason}")]
    Config {
        /// Where in the config.
        place: String,
        /// Why it is refused.
        reason: String,
    },
    /// The YAML could not be parsed (the message carries line and column).
    #[error("invalid fake-api config: {0}")]
    Yaml(String),
    /// The config file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The requested address.
        addr: SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// [`FakeApi::start`] was called outside a tokio runtime.
    #[error("the fake provider must be started inside a tokio runtime")]
    NoRuntime,
    /// The runtime or the signal handler of [`run_until_signal`] could not be set up.
    #[error("cannot set up the runtime: {0}")]
    Runtime(std::io::Error),
}

/// Entry point: starts fake providers.
#[derive(Debug, Clone, Copy)]
pub struct FakeApi;

impl FakeApi {
    /// Validates `config`, binds `addr` (port 0 picks a free port) and serves on the current
    /// tokio runtime until [`RunningFake::shutdown`] or drop.
    ///
    /// # Errors
    /// [`Error::Config`] for an invalid config, [`Error::Bind`] when the address cannot be
    /// bound, [`Error::NoRuntime`] outside a tokio runtime.
    pub fn start(config: FakeConfig, addr: SocketAddr) -> Result<RunningFake, Error> {
        FakeApi::start_inner(config, addr, None)
    }

    /// As [`FakeApi::start`], and calls `observer` once per attempt when its outcome is known
    /// (used by `backstop fake-api` to log one line per attempt).
    ///
    /// # Errors
    /// As [`FakeApi::start`].
    pub fn start_with_observer(
        config: FakeConfig,
        addr: SocketAddr,
        observer: Observer,
    ) -> Result<RunningFake, Error> {
        FakeApi::start_inner(config, addr, Some(observer))
    }

    fn start_inner(
        config: FakeConfig,
        addr: SocketAddr,
        observer: Option<Observer>,
    ) -> Result<RunningFake, Error> {
        let compiled = Compiled::new(&config)?;
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| Error::NoRuntime)?;
        let listener = std::net::TcpListener::bind(addr)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|source| Error::Bind { addr, source })?;
        let local = listener
            .local_addr()
            .map_err(|source| Error::Bind { addr, source })?;
        let listener = {
            let _guard = runtime.enter();
            tokio::net::TcpListener::from_std(listener)
                .map_err(|source| Error::Bind { addr, source })?
        };
        let state = ProviderState::new(&compiled, 0);
        let shared = Arc::new(Shared {
            compiled,
            state: Mutex::new(state),
            observer,
        });
        let (shutdown, shutdown_rx) = watch::channel(Stop::Running);
        let task = runtime.spawn(server::accept_loop(
            listener,
            server::router(Arc::clone(&shared)),
            shutdown_rx,
        ));
        Ok(RunningFake {
            addr: local,
            shared,
            shutdown,
            task: Some(task),
        })
    }
}

/// A running fake provider. Dropping it stops it (open connections are closed).
pub struct RunningFake {
    addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: watch::Sender<Stop>,
    /// The listener task; it ends with the number of connections it closed at once.
    task: Option<JoinHandle<usize>>,
}

/// How a graceful stop ([`RunningFake::shutdown_gracefully`]) ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stopped {
    /// Connections still answering a request when the grace ended, closed without finishing
    /// their response; 0 when every response in progress finished.
    pub cut: usize,
}

impl std::fmt::Debug for RunningFake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunningFake")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl RunningFake {
    /// The bound address (the real port when started on port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Base URL, e.g. `http://127.0.0.1:40123` (no trailing slash).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every attempt received since start or the last reset, in arrival order.
    pub fn attempts(&self) -> Vec<AttemptRecord> {
        self.shared.lock().attempts().to_vec()
    }

    /// Forgets attempts, call counters, quota counters and stored objects and keys, and
    /// reseeds the generator — as `POST /__fake/reset`.
    pub fn reset(&self) {
        self.shared.lock().reset(&self.shared.compiled);
    }

    /// Stops accepting, closes open connections (responses in progress included) and waits
    /// for the listener task to end.
    pub async fn shutdown(mut self) {
        let _ = self.shutdown.send(Stop::Now);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }

    /// Stops gracefully: accepts no new connection, closes idle (kept-alive) connections at
    /// once, and lets every response in progress finish, for at most `grace`; whatever is
    /// still answering then is closed ([`Stopped::cut`]). Resolves when the listener and every
    /// connection are gone.
    pub async fn shutdown_gracefully(self, grace: Duration) -> Stopped {
        self.shutdown_gracefully_until(tokio::time::sleep(grace))
            .await
    }

    /// [`RunningFake::shutdown_gracefully`], with the grace ending when `cut` resolves.
    async fn shutdown_gracefully_until(mut self, cut: impl Future<Output = ()>) -> Stopped {
        let _ = self.shutdown.send(Stop::Graceful);
        let Some(mut task) = self.task.take() else {
            return Stopped { cut: 0 };
        };
        tokio::select! {
            done = &mut task => return Stopped { cut: done.unwrap_or(0) },
            () = cut => {}
        }
        let _ = self.shutdown.send(Stop::Now);
        Stopped {
            cut: task.await.unwrap_or(0),
        }
    }
}

impl Drop for RunningFake {
    fn drop(&mut self) {
        let _ = self.shutdown.send(Stop::Now);
    }
}

/// Runs a fake provider on its own tokio runtime until Ctrl-C or SIGTERM (for
/// `backstop fake-api`), then stops gracefully (see [`RunningFake::shutdown_gracefully`]):
/// idle connections are closed at once, responses in progress may finish for up to `grace`,
/// or until a second Ctrl-C or SIGTERM. `on_ready` gets the bound address once listening and
/// the signals are handled (a signal sent after it stops the fake as described, never the
/// process at once); `observer` is called once per attempt.
///
/// # Errors
/// As [`FakeApi::start`], plus [`Error::Runtime`] when the runtime or the signal handler
/// cannot be set up.
pub fn run_until_signal(
    config: FakeConfig,
    addr: SocketAddr,
    observer: Observer,
    grace: Duration,
    on_ready: impl FnOnce(SocketAddr),
) -> Result<Stopped, Error> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(Error::Runtime)?;
    runtime.block_on(async move {
        let fake = FakeApi::start_with_observer(config, addr, observer)?;
        // Handled from here on: a signal sent once the address is known is never lost.
        let mut signals = Signals::register()?;
        on_ready(fake.addr());
        signals.recv().await;
        let cut = async {
            tokio::select! {
                () = tokio::time::sleep(grace) => {}
                // A second signal: stop now.
                () = signals.recv() => {}
            }
        };
        Ok(fake.shutdown_gracefully_until(cut).await)
    })
}

/// The stop signals of [`run_until_signal`], handled from [`Signals::register`] on.
#[cfg(unix)]
struct Signals {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
}

#[cfg(unix)]
impl Signals {
    /// Installs the handlers of SIGINT (Ctrl-C) and SIGTERM.
    fn register() -> Result<Signals, Error> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            interrupt: signal(SignalKind::interrupt()).map_err(Error::Runtime)?,
            terminate: signal(SignalKind::terminate()).map_err(Error::Runtime)?,
        })
    }

    /// Resolves at the next SIGINT or SIGTERM received since the last call.
    async fn recv(&mut self) {
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.terminate.recv() => {}
        }
    }
}

/// The stop signal of [`run_until_signal`]: Ctrl-C.
#[cfg(not(unix))]
struct Signals;

#[cfg(not(unix))]
impl Signals {
    fn register() -> Result<Signals, Error> {
        Ok(Signals)
    }

    /// Resolves at the next Ctrl-C; never, when it cannot be listened for.
    async fn recv(&mut self) {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}
