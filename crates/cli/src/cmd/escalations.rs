//! `backstop escalations list|show|decide`: read case files and record decisions on a running
//! gateway (SPEC §8, §11) through its escalation API (`/v1/escalations`).
//!
//! The gateway is reached at `--url` (default `http://127.0.0.1:8080`, or `BACKSTOP_URL`) with an
//! operator token from `--token` or, preferably, `BACKSTOP_OPERATOR_TOKEN` (a flag is visible in
//! the process list). Plain `http://` only: reach a remote gateway through a TLS-terminating
//! proxy or an SSH tunnel to its loopback port.
//!
//! `decide` checks the option before anything is sent: an unknown option is refused naming the
//! known ones, and `send_new` without `--confirm-second-side-effect` is refused naming that flag
//! (the gateway would refuse it too, SPEC §8).
//!
//! Output: `list` prints a table (id, action, provider, route, reason, opened); `show` the
//! escalation with its case file as pretty JSON; `decide` one line with the recorded decision.
//! Exit codes: 0 success; 2 anything else (unreachable gateway naming the URL, missing token,
//! a problem answer from the gateway with its status, name and detail) on one stderr line.

use std::process::ExitCode;

use backstop_core::escalation::DecisionOption;
use serde_json::{json, Value};

use crate::cmd::client::{self, Client};
use crate::cmd::output::{self, errln};

/// Arguments of `backstop escalations`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The gateway's base URL (default http://127.0.0.1:8080, or the BACKSTOP_URL variable).
    #[arg(long, global = true)]
    pub url: Option<String>,
    /// Operator token (default: the BACKSTOP_OPERATOR_TOKEN variable, which is preferable).
    #[arg(long, global = true)]
    pub token: Option<String>,
    /// What to do.
    #[command(subcommand)]
    pub command: EscalationsCommand,
}

/// The `backstop escalations` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum EscalationsCommand {
    /// List open escalations as a table: id, action, provider, route, reason, opened.
    List,
    /// Print one escalation with its sanitized case file as pretty JSON.
    Show {
        /// The escalation id.
        id: u64,
    },
    /// Record a decision (query_status, retry_same_key, abort, send_new, wait, raise_quota,
    /// change_plan).
    Decide {
        /// The escalation id.
        id: u64,
        /// The chosen option.
        #[arg(long)]
        option: String,
        /// Confirm that `send_new` may create a second side effect (a second payment, message or
        /// deployment). Without it, `send_new` is refused.
        #[arg(long)]
        confirm_second_side_effect: bool,
        /// A note recorded with the decision's answer.
        #[arg(long)]
        note: Option<String>,
    },
}

/// Runs `backstop escalations`.
pub fn run(args: Args) -> ExitCode {
    let name = match &args.command {
        EscalationsCommand::List => "list",
        EscalationsCommand::Show { .. } => "show",
        EscalationsCommand::Decide { .. } => "decide",
    };
    match execute(args) {
        Ok(text) => output::print(&format!("escalations {name}"), &text, ExitCode::SUCCESS),
        Err(message) => {
            errln!("backstop escalations {name}: {message}");
            ExitCode::from(2)
        }
    }
}

fn execute(args: Args) -> Result<String, String> {
    if let EscalationsCommand::Decide {
        option,
        confirm_second_side_effect,
        ..
    } = &args.command
    {
        check_option(option, *confirm_second_side_effect)?;
    }
    let base = client::base_url(args.url)?;
    let token = args
        .token
        .or_else(|| {
            std::env::var("BACKSTOP_OPERATOR_TOKEN")
                .ok()
                .filter(|t| !t.is_empty())
        })
        .ok_or("no operator token: set BACKSTOP_OPERATOR_TOKEN (or pass --token)")?;
    let client = Client::new(base, token);
    match args.command {
        EscalationsCommand::List => client.get("/v1/escalations").map(|v| table(&v)),
        EscalationsCommand::Show { id } => client
            .get(&format!("/v1/escalations/{id}"))
            .map(|v| format!("{}\n", pretty(&v))),
        EscalationsCommand::Decide {
            id,
            option,
            confirm_second_side_effect,
            note,
        } => {
            let mut body = json!({
                "option": option,
                "confirm_second_side_effect": confirm_second_side_effect,
            });
            if let Some(note) = note {
                body["note"] = Value::String(note);
            }
            client
                .post(&format!("/v1/escalations/{id}/decision"), &body)
                .map(|v| decided_line(&v))
        }
    }
}

/// Checks a `decide` option before any request: a known wire name, and `send_new` only with
/// its confirmation.
///
/// # Errors
/// A sentence naming the unknown option and the known ones, or naming the
/// `--confirm-second-side-effect` flag that `send_new` needs.
fn check_option(option: &str, confirm_second_side_effect: bool) -> Result<(), String> {
    match DecisionOption::parse(option) {
        None => {
            let known: Vec<&str> = DecisionOption::ALL.iter().map(|o| o.as_str()).collect();
            Err(format!(
                "unknown option `{option}` (one of: {}); nothing was sent",
                known.join(", ")
            ))
        }
        Some(DecisionOption::SendNew) if !confirm_second_side_effect => Err(
            "`send_new` sends the write again as a new operation and may create a second side effect (a second payment, message or deployment): add --confirm-second-side-effect to confirm; nothing was sent"
                .to_owned(),
        ),
        Some(_) => Ok(()),
    }
}

fn pretty(value: &Value) -> String {
    serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string())
}

/// The `list` table: a header and one row per open escalation, columns padded to width.
fn table(value: &Value) -> String {
    const COLUMNS: [(&str, &str); 6] = [
        ("ID", "id"),
        ("ACTION", "action"),
        ("PROVIDER", "provider"),
        ("ROUTE", "route"),
        ("REASON", "reason"),
        ("OPENED", "opened_at"),
    ];
    let empty = Vec::new();
    client::table(&COLUMNS, value["escalations"].as_array().unwrap_or(&empty))
}

fn decided_line(value: &Value) -> String {
    format!(
        "escalation {}: {} (action {}, decided by {} at {})\n",
        client::cell(&value["id"]),
        client::cell(&value["decision"]),
        client::cell(&value["action"]),
        client::cell(&value["decided_by"]),
        client::cell(&value["decided_at"]),
    )
}
