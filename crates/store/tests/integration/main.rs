//! backstop-store's integration tests, one module per subject, built as ONE test binary: every
//! test binary links the whole dependency graph, so a binary per file multiplied the build's
//! time and disk. One module alone: `cargo test -p backstop-store --test integration
//! audit_chain::`.

mod common;

mod audit_agents;
mod audit_chain;
mod audit_edges;
mod audit_snapshot;
mod canary;
mod canonical_encoding;
mod crash;
mod escalation_decisions;
mod foreign_db;
mod kept_requests;
mod key_target;
mod queued_operations;
mod read_groups;
mod read_only_dir;
mod read_records;
mod signal_headers;
mod store_lock;
mod store_ops;
mod task_namespaces;
mod writes_store;
