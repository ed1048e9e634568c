//! # backstop-gateway — carrying out the core's decisions on real sockets
//!
//! Agents point their HTTP clients at the gateway instead of the provider. From then on one
//! deterministic layer owns every retry: the proxy door turns a request into an action, the
//! scheduler decides when each attempt may leave (SPEC §4.1), the executor sends attempts through
//! a [`transport::Transport`], asks `backstop-core` what each answer means, and records every
//! step in the store's audit chain.
//!
//! The crate in three layers; a module imports only its own layer and the ones below it:
//!
//! ```text
//!  faces     server ── mounts ──> door · actions_api · escalations · health (+ watchdog)
//!            (state: what they share; executor: the seam to the engine)
//!              │ an ActionSpec in, an Execution out
//!  engine    engine ── admit ─> send ─> classify ─> settle scope ─> decide ─> finish
//!              │        (scheduler: permits, pacing, scope boundaries; coalesce: shared reads)
//!  below     transport · upstream · wire · problem · action · metrics · clock
//!            auth · secrets · scrub · body_budget
//!                       └──> backstop-store (records, audit chain) · backstop-core (decisions)
//! ```
//!
//! One request, from the door to the audit log: [`door::proxy`] authenticates the agent,
//! resolves the route and builds an [`action::ActionSpec`]; [`executor::Executor::execute`]
//! hands it to [`engine::Engine`], which records the task and action, then runs its attempts
//! as phases — a permit from the [`scheduler`], `action_sent` made durable (for a write)
//! before the bytes leave through the [`transport::Transport`], the answer classified by
//! `backstop-core`, scope records updated first on a rate-limit signal, then retry,
//! reconcile or end — and every step lands in the store's hash-chained audit log. The
//! [`action::Execution`] it returns is what the door answers with.
//!
//! Module map:
//! - [`clock`]: the one place that reads real time (tokio-aware, so paused-time tests work).
//! - [`transport`]: the seam between the executor and the network (one attempt, no retries).
//! - [`action`]: what the proxy door hands the executor, and what comes back.
//! - [`metrics`]: Prometheus metrics (`GET /metrics`).
//! - [`wire`]: responses as passed on and kept for replay (hop-by-hop headers, replay records).
//! - [`executor`] and [`state`]: the seam between the faces and the engine, and what the faces
//!   share.
#![deny(missing_docs)]

pub mod action;
pub mod clock;
pub mod metrics;
pub mod transport;
pub mod wire;

// The engine: one scheduler for all work and the executor that owns every retry.
pub mod coalesce;
pub mod engine;
pub mod scheduler;

// The HTTP edge: `backstop serve`, the proxy door, the upstream client.
pub mod auth;
pub mod body_budget;
pub mod door;
pub mod executor;
pub mod problem;
pub mod scrub;
pub mod secrets;
pub mod server;
pub mod state;
pub mod upstream;

// Operators: escalation case files and decisions.
pub mod escalations;

// The action API: background actions, long-poll, task cancellation.
pub mod actions_api;

// Run health: snapshots from receipts, the health routes and the watchdog.
pub mod health;
pub mod watchdog;
