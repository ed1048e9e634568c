//! The `backstop` command's integration tests, one module per subject, built as ONE test
//! binary: every test binary links the whole dependency graph, so a binary per file multiplied
//! the build's time and disk. One module alone: `cargo test -p backstop --test integration
//! serve_cli::`.

mod common;

mod audit_cli;
mod audit_edges_cli;
mod classify_cli;
mod crash_fuzz;
mod demo_cli;
mod diagnose_cli;
mod escalations_cli;
mod fake_api_cli;
mod output_cli;
mod policy_cli;
mod restart_recovery;
mod restart_reproductions;
mod scopes_cli;
mod serve_cli;
mod serve_store_cli;
mod snapshots_cli;
mod snapshots_export_cli;
