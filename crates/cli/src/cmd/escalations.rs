//! `backstop escalations list|show|decide`: read case files and record decisions on a running
//! gateway (SPEC §8, §11) through its escalation API (`/v1/escalations`).
//!
//! The gateway is reached at `--url` (default `http://127.0.0.1:8080`, or `BACKSTOP_URL`) with an
//! operator token from `--token` or, preferably, `BACKSTOP_OPERATOR_TOKEN` (a flag is visible in
//! the process list). Plain `http://` only: reach a remote gateway through a TLS-terminating
//! proxy or an SSH tunnel to its loopback port.
//!
//! Output: `list` prints a table (id, action, provider, route, reason, opened); `show` the
//! escalation with its case file as pretty JSON; `decide` one line with the recorded decision.
//! Exit codes: 0 success; 2 anything else (unreachable gateway naming the URL, missing token,
//! a problem answer from the gateway with its status, name and detail) on one stderr line.

use std::process::ExitCode;
use std::time::Duration;

use serde_json::{json, Value};

use crate::cmd::output::{self, errln};

/// Where the gateway is when neither `--url` nor `BACKSTOP_URL` says otherwise.
pub const DEFAULT_URL: &str = "http://127.0.0.1:8080";

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
    let base = args
        .url
        .or_else(|| std::env::var("BACKSTOP_URL").ok().filter(|u| !u.is_empty()))
        .unwrap_or_else(|| DEFAULT_URL.to_owned());
    let base = base.trim_end_matches('/').to_owned();
    if !base.starts_with("http://") {
        return Err(format!(
            "--url {base}: only http:// URLs are supported (reach a remote gateway through a TLS-terminating proxy or a tunnel)"
        ));
    }
    let token = args
        .token
        .or_else(|| {
            std::env::var("BACKSTOP_OPERATOR_TOKEN")
                .ok()
                .filter(|t| !t.is_empty())
        })
        .ok_or("no operator token: set BACKSTOP_OPERATOR_TOKEN (or pass --token)")?;
    let client = Client { base, token };
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

struct Client {
    base: String,
    token: String,
}

impl Client {
    fn agent() -> ureq::Agent {
        ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(30)))
            .build()
            .into()
    }

    fn get(&self, path: &str) -> Result<Value, String> {
        let url = format!("{}{path}", self.base);
        let response = Self::agent()
            .get(&url)
            .header("Authorization", &format!("Bearer {}", self.token))
            .header("Accept", "application/json")
            .call();
        self.answer(&url, response)
    }

    fn post(&self, path: &str, body: &Value) -> Result<Value, String> {
        let url = format!("{}{path}", self.base);
        let response = Self::agent()
            .post(&url)
            .header("Authorization", &format!("Bearer {}", self.token))
            .header("Accept", "application/json")
            .content_type("application/json")
            .send(body.to_string().as_bytes());
        self.answer(&url, response)
    }

    fn answer(
        &self,
        url: &str,
        response: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    ) -> Result<Value, String> {
        let mut response = response.map_err(|e| match e {
            ureq::Error::Io(io) => format!("cannot reach the gateway at {}: {io}", self.base),
            ureq::Error::ConnectionFailed | ureq::Error::HostNotFound => {
                format!("cannot reach the gateway at {}: {e}", self.base)
            }
            ureq::Error::Timeout(_) => {
                format!("the gateway at {} did not answer in time ({e})", self.base)
            }
            other => format!("{url}: {other}"),
        })?;
        let status = response.status().as_u16();
        let text = response
            .body_mut()
            .read_to_string()
            .map_err(|e| format!("{url}: HTTP {status}: cannot read the answer: {e}"))?;
        let value: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        if (200..300).contains(&status) {
            if value.is_null() {
                return Err(format!("{url}: HTTP {status}: the answer is not JSON"));
            }
            return Ok(value);
        }
        let name = value["type"]
            .as_str()
            .and_then(|t| t.rsplit(':').next())
            .unwrap_or("error");
        let detail = value["detail"]
            .as_str()
            .or_else(|| value["title"].as_str())
            .unwrap_or("no problem details in the answer");
        Err(format!("HTTP {status} {name}: {detail}"))
    }
}

fn pretty(value: &Value) -> String {
    serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string())
}

fn cell(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Null => "-".to_owned(),
        other => other.to_string(),
    }
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
    let rows: Vec<Vec<String>> = value["escalations"]
        .as_array()
        .map(|rows| {
            rows.iter()
                .map(|row| COLUMNS.iter().map(|(_, key)| cell(&row[*key])).collect())
                .collect()
        })
        .unwrap_or_default();
    let mut widths: Vec<usize> = COLUMNS.iter().map(|(title, _)| title.len()).collect();
    for row in &rows {
        for (width, text) in widths.iter_mut().zip(row) {
            *width = (*width).max(text.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &[String]| {
        let text: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(text.join("  ").trim_end());
        out.push('\n');
    };
    let titles: Vec<String> = COLUMNS.iter().map(|(t, _)| (*t).to_owned()).collect();
    line(&titles);
    for row in &rows {
        line(row);
    }
    out
}

fn decided_line(value: &Value) -> String {
    format!(
        "escalation {}: {} (action {}, decided by {} at {})\n",
        cell(&value["id"]),
        cell(&value["decision"]),
        cell(&value["action"]),
        cell(&value["decided_by"]),
        cell(&value["decided_at"]),
    )
}
