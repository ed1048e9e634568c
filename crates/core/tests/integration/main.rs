//! backstop-core's integration tests, one module per subject, built as ONE test binary: every
//! test binary links the whole dependency graph, so a binary per file multiplied the build's
//! time and disk. One module alone: `cargo test -p backstop-core --test integration
//! signals_quota::`.

mod decisions_backoff;
mod decisions_breaker;
mod decisions_pacing;
mod decisions_policy;
mod diagnose_props;
mod diagnose_six_case;
mod diagnose_states;
mod signals_classify;
mod signals_props;
mod signals_quota;
mod signals_retry_after;
mod writes_escalation;
mod writes_reconcile;
