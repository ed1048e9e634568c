//! `backstop policy …`.

use std::{path::PathBuf, process::ExitCode};

use backstop_core::policy::{Policy, Provider};

use crate::cmd::output::{self, errln};

/// Subcommands of `backstop policy`.
#[derive(Debug, clap::Subcommand)]
pub enum PolicyCommand {
    /// Validate a policy file; print a summary, or `FILE:LINE:COL: message` per problem (exit 2).
    ///
    /// Warnings (valid but probably unintended settings: no agents, a provider without scopes,
    /// an `idempotent_write` PUT/DELETE relying on `idempotent_put_delete` alone) are printed on
    /// stderr as `FILE:LINE:COL: warning: message`; they do not change the exit status (0).
    Check {
        /// The policy file (YAML).
        file: PathBuf,
    },
}

/// Runs `backstop policy …`.
pub fn run(command: PolicyCommand) -> ExitCode {
    match command {
        PolicyCommand::Check { file } => match Policy::load(&file) {
            Ok(policy) => {
                for w in &policy.warnings {
                    errln!(
                        "{}:{}:{}: warning: {}",
                        w.file,
                        w.line,
                        w.column,
                        output::terminal_safe(&w.message)
                    );
                }
                output::print("policy check", &summary(&policy), ExitCode::SUCCESS)
            }
            Err(errors) => {
                // A key or value quoted from the file is the operator's text: escaped, so it
                // can neither drive the terminal nor pass for other text.
                for error in &errors.0 {
                    errln!("{}", output::terminal_safe(&error.to_string()));
                }
                errln!(
                    "{}: {} problem{}",
                    file.display(),
                    errors.0.len(),
                    if errors.0.len() == 1 { "" } else { "s" }
                );
                ExitCode::from(2)
            }
        },
    }
}

/// `1 provider`, `2 providers`, `1 request class`, `3 request classes`.
fn count(n: usize, noun: &str) -> String {
    match n {
        1 => format!("1 {noun}"),
        _ if noun.ends_with("ss") => format!("{n} {noun}es"),
        _ => format!("{n} {noun}s"),
    }
}

/// The short summary printed for a valid policy: counts, then one line per class, the circuit
/// breaker's, backoff's, shared scope limits' and retry quota's settings, then one line per scope
/// and route.
fn summary(policy: &Policy) -> String {
    let mut out = counts(policy);
    for class in policy.request_classes.values() {
        out.push_str(&format!(
            "class {}: max_attempts {}, max_wait {} s, retry_statuses {:?}, side_effect {}\n",
            class.name,
            class.max_attempts,
            class.max_wait.as_secs_f64(),
            class.retry_statuses,
            class.side_effect.as_str()
        ));
    }
    out.push_str(&settings(policy));
    for scope in policy.scopes() {
        match scope.limit {
            Some(limit) => out.push_str(&format!(
                "scope {}: {} requests / {} s, paced at {} %, {} % reserved for interactive\n",
                scope.name,
                limit,
                scope.window.as_secs_f64(),
                scope.headroom * 100.0,
                scope.reserve_interactive * 100.0
            )),
            None => out.push_str(&format!(
                "scope {}: no published limit, {} concurrent, {} delayed\n",
                scope.name, scope.max_concurrent_requests, scope.max_delayed_requests
            )),
        }
    }
    for provider in policy.providers.values() {
        out.push_str(&routes(policy, provider));
    }
    out
}

/// The summary's first line: the file, `ok`, and how many of each thing it declares.
fn counts(policy: &Policy) -> String {
    let routes = policy
        .providers
        .values()
        .map(|p| p.routes.len())
        .sum::<usize>();
    let warnings = match policy.warnings.len() {
        0 => String::new(),
        n => format!(" ({})", count(n, "warning")),
    };
    format!(
        "{}: ok: {}, {}, {}, {}, {}, {}{warnings}\n",
        policy.file,
        count(policy.request_classes.len(), "request class"),
        count(policy.providers.len(), "provider"),
        count(policy.scopes().count(), "scope"),
        count(routes, "route"),
        count(policy.agents.len(), "agent"),
        count(policy.operators.len(), "operator"),
    )
}

/// The breaker, backoff, shared scope and retry quota lines.
fn settings(policy: &Policy) -> String {
    let b = &policy.backoff;
    let q = &policy.retry_quota;
    format!(
        "breaker: threshold {}, forget_after {} s\n\
         backoff: base {} s, max {} s, min_delay {} s, retry_after_ceiling {} s, boundary_spread {} s\n\
         shared_scope: max_concurrent_requests {}, max_delayed_requests {}\n\
         retry_quota: capacity {}, retry_cost {}, timeout_cost {}, success_refund {}\n",
        policy.breaker.threshold,
        policy.breaker.forget_after.as_secs_f64(),
        b.base.as_secs_f64(),
        b.max.as_secs_f64(),
        b.min_delay.as_secs_f64(),
        b.retry_after_ceiling.as_secs_f64(),
        b.boundary_spread.as_secs_f64(),
        policy.shared_scope.max_concurrent_requests,
        policy.shared_scope.max_delayed_requests,
        q.capacity,
        q.retry_cost,
        q.timeout_cost,
        q.success_refund
    )
}

/// One line per route of `provider`, then one for the completion routes its dialect implies
/// that it does not declare itself.
fn routes(policy: &Policy, provider: &Provider) -> String {
    let mut out = String::new();
    for route in &provider.routes {
        out.push_str(&format!(
            "route {} {} {} -> {} [{}]\n",
            provider.name,
            route.method,
            route.template,
            route.class,
            route.scopes.join(", ")
        ));
    }
    let implied: Vec<&str> = backstop_core::side_effect::completion_routes(provider.dialect)
        .filter(|path| {
            !provider
                .routes
                .iter()
                .any(|r| r.method == "POST" && r.template == *path)
        })
        .collect();
    if !implied.is_empty() {
        out.push_str(&format!(
            "route {} POST {} -> {} (dialect {}, side_effect {}) [{}]\n",
            provider.name,
            implied.join(" | "),
            backstop_core::side_effect::COMPLETION_CLASS,
            provider.dialect.as_str(),
            policy
                .side_effect_of(backstop_core::side_effect::COMPLETION_CLASS)
                .as_str(),
            provider.default_scopes.join(", ")
        ));
    }
    out
}
