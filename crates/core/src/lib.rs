//! # backstop-core — the decisions, and nothing else
//!
//! Every part of backstop (gateway, durable actions, diagnosis) asks this crate what a provider's
//! response means and what may happen next. It has no async runtime, performs no I/O and never
//! reads a clock: instants (`jiff::Timestamp`) and random samples are passed in, and decisions come
//! back as values. That keeps every rule testable to the millisecond and reusable offline.
//!
//! Modules, one concept each (vocabulary of SPEC §1):
//! - [`clock`]: the `Clock` trait and a manual clock for tests.
//! - [`classify`]: response / transport error → disposition (SPEC §2.1).
//! - [`retry_after`]: Retry-After normalization into a boundary (SPEC §2.2, RFC 9110 §10.2.3).
//! - [`quota`]: quota headers in every dialect → `QuotaObservation` (SPEC §2.3).
//! - [`duration`]: Go-style duration strings (`1m30.5s`) used by several providers.
//! - [`policy`]: the YAML policy file, validated with positions (SPEC §3).
//! - [`backoff`]: full-jitter backoff with boundary precedence (SPEC §4.2).
//! - [`budget`]: class budgets, task deadline, scope retry quota (SPEC §5).
//! - [`pacing`]: GCRA pacing with an interactive reserve, concurrency slots (SPEC §4.1).
//! - [`breaker`]: sanitized fingerprints and the per-task circuit breaker (SPEC §7).
//! - [`outcome`]: terminal outcomes with their context and `next_safe` options (SPEC §5).
//! - [`reconcile`]: reconciliation lookups for uncertain writes (SPEC §6).
//! - [`escalation`]: sanitized case files and decision options (SPEC §8).
//! - [`side_effect`]: what a request class changes at the provider; LLM completion routes (SPEC §4.2a).
//! - [`signal_headers`]: the bounded Retry-After, Date and quota headers kept as evidence.
//! - [`diagnose`]: run health diagnosis and retry-after debt (SPEC §10).
#![deny(missing_docs)]

pub mod backoff;
pub mod breaker;
pub mod budget;
pub mod classify;
pub mod clock;
pub mod diagnose;
pub mod duration;
pub mod escalation;
pub mod outcome;
pub mod pacing;
pub mod policy;
pub mod quota;
pub mod reconcile;
pub mod retry_after;
pub mod side_effect;
pub mod signal_headers;
