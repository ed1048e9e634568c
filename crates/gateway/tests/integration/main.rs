//! backstop-gateway's integration tests, one module per subject, built as ONE test binary:
//! every test binary links the whole dependency graph, so a binary per file multiplied the
//! build's time and disk. One module alone: `cargo test -p backstop-gateway --test integration
//! e2e_door::`.

mod engine_support;
mod support;

mod actions_api;
mod body_budget;
mod cancelled_task_keys;
mod cancelled_writes;
mod door_edge;
mod e2e_door;
mod e2e_no_library_retry;
mod engine_budgets;
mod engine_scheduling;
mod engine_store_failures;
mod escalation_boundary;
mod escalation_query_status;
mod escalations_api;
mod examples_walkthrough;
mod health_snapshots;
mod health_watchdog;
mod kept_at_rest;
mod key_target;
mod llm_calls;
mod outcome_wording;
mod quota_escalations;
mod refusal_logs;
mod restart_cancelled;
mod restart_reads;
mod restart_unsent_writes;
mod scenario_reference;
mod shutdown_writes;
mod signal_evidence;
mod signals_beyond_the_ceiling;
mod task_namespaces;
mod watchdog_reads;
mod writes_decisions;
mod writes_first_use;
mod writes_reconcile;
mod writes_resend;
mod writes_shared_reference;
mod writes_takeover;
