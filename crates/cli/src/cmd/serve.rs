//! `backstop serve`: run the gateway (proxy door, `/v1/scopes`, `/metrics`) on one listener.
//!
//! Start-up is all-or-nothing: the policy is validated (errors as `FILE:LINE:COL: message`),
//! every agent token and provider secret is resolved (every missing one is named at once, each
//! with the policy place that references it, e.g.
//! `backstop.yaml: agents.invoice-agent: environment variable … is not set`), the store is
//! opened and the address bound (`already in use` is said plainly) before any request is
//! accepted; any failure exits 2. SIGTERM or Ctrl-C stops taking new work (503 shutting_down),
//! shuts the engine down (accepted actions stay recoverable in the store) and drains open
//! responses, all within `--shutdown-grace-seconds`.
//! Logs go to stderr through `tracing` (`RUST_LOG`, default `info`).

use std::{
    collections::hash_map::RandomState, hash::BuildHasher, path::PathBuf, process::ExitCode,
    time::Duration,
};

use backstop_core::policy::Policy;
use backstop_gateway::{
    auth::Authenticator,
    door::DoorConfig,
    secrets::{process_env, ProviderCredentials, SecretError},
    server::{self, ServeOptions},
    upstream::UpstreamConfig,
};

use crate::cmd::output::{self, errln};

/// Where serve's secrets come from, shown by `backstop serve --help` after the options.
const SECRETS_HELP: &str = "\
SECRETS (agent tokens and provider keys):
  Neither the policy nor the command line holds a secret: the policy names the environment
  variable or the file that serve reads each one from at start-up (a file's trailing newline is
  dropped). A missing environment variable stops the start, naming the policy key; a secret file
  that cannot be read only makes its agent or provider unavailable (a warning).
    agents.NAME.token_env                  environment variable with the token the agent sends
                                           (Authorization: Bearer TOKEN)
    agents.NAME.token_file                 file with that token
    agents.NAME.token_sha256               or the token's lowercase hex SHA-256 (nothing to set)
    operators.NAME.token_env | token_file | token_sha256
                                           the same for an operator (`backstop escalations`)
    providers.NAME.credential.secret_env   environment variable with the provider key backstop
                                           adds to every call it forwards
    providers.NAME.credential.secret_file  file with that key

EXAMPLES:
  Against the bundled fake provider (`backstop fake-api --config examples/fake-api.yaml
  --listen 127.0.0.1:8081` in another terminal); its policy reads the agent's token from
  BACKSTOP_TOKEN (agents.local-agent.token_env) and the provider key from FAKE_API_KEY
  (providers.fake.credential.secret_env):
    BACKSTOP_TOKEN=local-agent-token FAKE_API_KEY=local-provider-key \\
      backstop serve --config examples/backstop-fake.yaml
  `backstop demo` prints the serve command for the store it leaves behind, with its policy's
  variables set (DEMO_AGENT_TOKEN, DEMO_PROVIDER_KEY, DEMO_OPERATOR_TOKEN).";

/// Arguments of `backstop serve`.
#[derive(Debug, clap::Args)]
#[command(after_long_help = SECRETS_HELP)]
pub struct Args {
    /// The policy file (YAML).
    #[arg(
        long,
        short = 'c',
        value_name = "FILE",
        default_value = "backstop.yaml"
    )]
    pub config: PathBuf,
    /// Listen address, e.g. 127.0.0.1:8080 (overrides the policy's `listen`).
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<String>,
    /// SQLite store file (overrides the policy's `store`; default ./backstop.db).
    #[arg(long, value_name = "PATH")]
    pub store: Option<PathBuf>,
    /// Request bodies up to this many bytes may be resent on retries; larger ones get exactly
    /// one attempt.
    #[arg(long, value_name = "BYTES", default_value_t = 1024 * 1024)]
    pub retry_body_bytes: usize,
    /// Hard cap on request bodies; larger ones are refused with 413.
    #[arg(long, value_name = "BYTES", default_value_t = 32 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Most bytes of request bodies held in memory at once, across all connections (a body is
    /// held from its first byte until its action ends); a request whose body does not fit gets
    /// 503 body_budget_exhausted with Retry-After: 1, nothing sent. At least --max-body-bytes.
    #[arg(long, value_name = "BYTES", default_value_t = 256 * 1024 * 1024)]
    pub buffered_body_bytes: usize,
    /// Most seconds from the start of an attempt to the provider's response head.
    #[arg(long, value_name = "SECONDS", default_value_t = 60)]
    pub attempt_timeout_seconds: u64,
    /// Most seconds the whole shutdown takes (engine stop and draining); requests arriving
    /// meanwhile get 503 shutting_down, an attempt the provider has not answered a quarter of
    /// the grace (at most 1 s) before its end is given up and its caller answered 503
    /// shutting_down, and streams still open at the end are cut. At least 1.
    #[arg(long, value_name = "SECONDS", default_value_t = 10)]
    pub shutdown_grace_seconds: u64,
    /// Most seconds to receive a request's head (then the connection is closed), and its whole
    /// body (then 408 request_timeout, nothing sent).
    #[arg(long, value_name = "SECONDS", default_value_t = 30)]
    pub read_timeout_seconds: u64,
    /// Seed of the retry jitter (default: random).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Threads that serve requests (the async runtime's workers); default: one per CPU core.
    /// The store's writer runs on a thread of its own beside them, so on a small machine one
    /// worker fewer than the cores can leave it a core (bench/HISTORY.md, "Where the added
    /// latency goes, and worker threads").
    #[arg(long, value_name = "N")]
    pub worker_threads: Option<usize>,
}

/// Runs `backstop serve` until SIGTERM or Ctrl-C. Exit 0 after a clean shutdown, 2 when it
/// cannot start.
pub fn run(args: Args) -> ExitCode {
    init_logging();
    let Some(policy) = load_policy(&args) else {
        return ExitCode::from(2);
    };
    if let Err(problem) = check_limits(&args) {
        errln!("backstop serve: {problem}");
        return ExitCode::from(2);
    }
    if !secrets_resolve(&policy) {
        return ExitCode::from(2);
    }
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = args.worker_threads {
        builder.worker_threads(threads);
    }
    let runtime = match builder.enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            errln!("backstop serve: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    runtime.block_on(serve(policy, serve_options(args)))
}

/// The policy of `--config`, or `None` after saying why it cannot be used.
fn load_policy(args: &Args) -> Option<Policy> {
    if !args.config.exists() {
        errln!(
            "backstop serve: no policy file at {} (pass one with --config FILE; examples/backstop-fake.yaml runs against the bundled fake provider)",
            args.config.display()
        );
        return None;
    }
    match Policy::load(&args.config) {
        Ok(policy) => Some(policy),
        Err(errors) => {
            for error in &errors.0 {
                errln!("{}", output::terminal_safe(&error.to_string()));
            }
            errln!(
                "backstop serve: the policy {} is invalid",
                args.config.display()
            );
            None
        }
    }
}

/// Checks the size and time limits against each other and their minimums.
fn check_limits(args: &Args) -> Result<(), String> {
    if args.retry_body_bytes > args.max_body_bytes {
        return Err(format!(
            "--retry-body-bytes ({}) must not exceed --max-body-bytes ({})",
            args.retry_body_bytes, args.max_body_bytes
        ));
    }
    if args.buffered_body_bytes < args.max_body_bytes {
        return Err(format!(
            "--buffered-body-bytes ({}) must be at least --max-body-bytes ({})",
            args.buffered_body_bytes, args.max_body_bytes
        ));
    }
    if args.attempt_timeout_seconds == 0 {
        return Err("--attempt-timeout-seconds must be at least 1".to_owned());
    }
    if args.shutdown_grace_seconds == 0 {
        // With no grace, an attempt still out could not be answered 503 shutting_down: its
        // caller would get an empty reply.
        return Err(
            "--shutdown-grace-seconds must be at least 1 (the stop answers every caller within it)"
                .to_owned(),
        );
    }
    if args.read_timeout_seconds == 0 {
        return Err("--read-timeout-seconds must be at least 1".to_owned());
    }
    if args.worker_threads == Some(0) {
        return Err("--worker-threads must be at least 1".to_owned());
    }
    Ok(())
}

/// The server's options from the command line.
fn serve_options(args: Args) -> ServeOptions {
    let read_timeout = Duration::from_secs(args.read_timeout_seconds);
    ServeOptions {
        listen: args.listen,
        store: args.store,
        door: DoorConfig {
            max_buffered_body_bytes: args.retry_body_bytes,
            max_body_bytes: args.max_body_bytes,
            body_read_timeout: read_timeout,
            body_budget_bytes: args.buffered_body_bytes,
        },
        upstream: UpstreamConfig {
            attempt_timeout: Duration::from_secs(args.attempt_timeout_seconds),
            ..UpstreamConfig::default()
        },
        seed: args
            .seed
            .unwrap_or_else(|| RandomState::new().hash_one(std::process::id())),
        shutdown_grace: Duration::from_secs(args.shutdown_grace_seconds),
        header_read_timeout: read_timeout,
    }
}

/// Starts the gateway and serves until a stop signal (exit 0 after a clean stop) or until the
/// server stops by itself (exit 1); exit 2 when it cannot start.
async fn serve(policy: Policy, options: ServeOptions) -> ExitCode {
    // Registered before anything listens: a SIGTERM that arrives as soon as the listening line
    // is printed is a stop, not the signal's default action (killing the process before the
    // store is closed).
    let stop = stop_signal();
    let mut running = match server::start(policy, options, &process_env, server::engine).await {
        Ok(running) => running,
        Err(e) => {
            errln!("backstop serve: {e}");
            return ExitCode::from(2);
        }
    };
    tokio::select! {
        () = stop => {}
        result = running.wait() => {
            if let Err(e) = result {
                errln!("backstop serve: the server stopped: {e}");
            }
            return ExitCode::from(1);
        }
    }
    tracing::info!("backstop serve: stop signal received");
    match running.shutdown().await {
        Ok(()) => {
            tracing::info!("backstop serve: stopped");
            ExitCode::SUCCESS
        }
        Err(e) => {
            errln!("backstop serve: error while stopping: {e}");
            ExitCode::from(1)
        }
    }
}

/// Resolves every agent token and provider secret of `policy` once, before anything starts, so
/// that all the missing ones are named together (the server itself stops at the first). Prints
/// one line per secret that stops the start, then the unreadable secret files (which alone
/// would not stop it) as warnings, and a summary line; `false` when the start must stop.
fn secrets_resolve(policy: &Policy) -> bool {
    let (auth, mut errors) = Authenticator::resolve_each(policy, &process_env);
    let (credentials, provider_errors) = ProviderCredentials::resolve_each(policy, &process_env);
    errors.extend(provider_errors);
    if errors.is_empty() {
        return true;
    }
    let file = &policy.file;
    for error in &errors {
        errln!("backstop serve: {file}: {error}");
    }
    for error in auth.unavailable() {
        errln!("backstop serve: warning: {file}: {error} (this caller could not authenticate)");
    }
    for error in credentials.unavailable().values() {
        errln!(
            "backstop serve: warning: {file}: {error} (calls to this provider would be refused)"
        );
    }
    let shared = errors
        .iter()
        .filter(|e| matches!(e, SecretError::SharedToken { .. }))
        .count();
    let count = errors.len() - shared;
    if count > 0 {
        errln!(
            "backstop serve: {count} secret{} referenced by {file} cannot be resolved; nothing was started",
            if count == 1 { "" } else { "s" }
        );
    }
    if shared > 0 {
        errln!(
            "backstop serve: {shared} token{} of {file} {} another caller's, so callers could not be told apart; nothing was started",
            if shared == 1 { "" } else { "s" },
            if shared == 1 { "is" } else { "are" },
        );
    }
    false
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// A future that resolves on Ctrl-C (SIGINT) or, on Unix, SIGTERM. On Unix both handlers are
/// installed when this is called, not when the future is first polled, so a signal sent at any
/// time after the call is seen; must be called inside the runtime. A handler that cannot be
/// installed never resolves (the other still can).
fn stop_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, Signal, SignalKind};
        let term = signal(SignalKind::terminate()).ok();
        let interrupt = signal(SignalKind::interrupt()).ok();
        async fn received(signal: Option<Signal>) {
            match signal {
                Some(mut signal) => {
                    signal.recv().await;
                }
                None => std::future::pending::<()>().await,
            }
        }
        async move {
            tokio::select! {
                () = received(term) => {}
                () = received(interrupt) => {}
            }
        }
    }
    #[cfg(not(unix))]
    async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}
