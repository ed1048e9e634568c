//! # backstop-gateway — carrying out the core's decisions on real sockets
//!
//! Agents point their HTTP clients at the gateway instead of the provider. From then on one
//! deterministic layer owns every retry: the proxy door turns a request into an action, the
//! scheduler decides when each attempt may leave (SPEC §4.1), the executor sends attempts through
//! a [`transport::Transport`], asks `backstop-core` what each answer means, and records every
//! step in the store's audit chain.
//!
//! Module map:
//! - [`clock`]: the one place that reads real time (tokio-aware, so paused-time tests work).
//! - [`transport`]: the seam between the executor and the network (one attempt, no retries).
//! - [`action`]: what the proxy door hands the executor, and what comes back.
//! - [`metrics`]: Prometheus metrics (`GET /metrics`).
//! - [`wire`]: responses as passed on and kept for replay (hop-by-hop headers, replay records).
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
