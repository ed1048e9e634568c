//! `backstop scopes`: the scope records of a running gateway (SPEC §11, `GET /v1/scopes`).
//!
//! Why: when agents stall, the first question is which quota scope holds them and until when.
//! Each row is one scope record as the scheduler last published it: the scope's full `name`
//! (`provider/scope`, as `/metrics` and `backstop diagnose` spell it), `next_allowed_at` (no
//! attempt of the scope leaves before it; `now` in the table once it has passed — the record
//! keeps the last boundary until the next signal — and `-` when there is none), the provider's
//! `remaining` requests (`-` when unknown, also once the window they were reported for has
//! ended: the gateway does not carry an old window's count into the next) and
//! `reset_after_seconds`, the `source` of the last signal, and the attempts `in_flight` and
//! actions `delayed` in the scope.
//!
//! The gateway is reached at `--url` (default `http://127.0.0.1:8080`, or `BACKSTOP_URL`) with an
//! agent or operator token from `--token`, else `BACKSTOP_TOKEN`, else `BACKSTOP_OPERATOR_TOKEN`
//! (the variables are preferable: a flag is visible in the process list). Only `http://` URLs
//! (the HTTP client is built without TLS). A URL that answers without a backstop problem
//! document, or with JSON that is not an array of scope records (each with `provider`,
//! `scope`, `in_flight` and `delayed`), is said not to look like a backstop gateway. Output: a table, or the gateway's JSON
//! array as is with `--format json`. Exit codes: 0 success; 2 anything else, on one stderr line.

use std::process::ExitCode;

use jiff::Timestamp;
use serde_json::Value;

use crate::cmd::client::{self, Client};
use crate::cmd::clock::{current_time, parse_now};
use crate::cmd::output::{self, errln};

/// Output formats of `backstop scopes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// An aligned table, one scope per row.
    Table,
    /// The gateway's JSON array, pretty-printed.
    Json,
}

/// Arguments of `backstop scopes`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The gateway's base URL (default http://127.0.0.1:8080, or the BACKSTOP_URL variable).
    /// Only http:// URLs are accepted (no TLS in this client): reach a remote gateway through a
    /// TLS-terminating proxy or an SSH tunnel.
    #[arg(long)]
    pub url: Option<String>,
    /// Agent or operator token. Default: the BACKSTOP_TOKEN variable, else (when it is unset or
    /// empty) BACKSTOP_OPERATOR_TOKEN; the variables are preferable to the flag.
    #[arg(long)]
    pub token: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// The instant a NEXT_ALLOWED_AT is compared with: one not after it shows as `now` in the
    /// table (RFC 3339). Default: the current time.
    #[arg(long, value_parser = parse_now)]
    pub now: Option<Timestamp>,
}

/// The route of the scope records.
const SCOPES: &str = "/v1/scopes";

/// The members every scope record of `GET /v1/scopes` carries (`name` only from newer gateways,
/// the others may be `null`).
#[derive(Debug, serde::Deserialize)]
#[expect(dead_code, reason = "read only to check the answer's shape")]
struct ScopeRecord {
    provider: String,
    scope: String,
    in_flight: u64,
    delayed: u64,
}

/// The table's columns: title and member of a scope record (`name` is the full scope name
/// `provider/scope`).
const COLUMNS: [(&str, &str); 7] = [
    ("SCOPE", "name"),
    ("NEXT_ALLOWED_AT", "next_allowed_at"),
    ("REMAINING", "remaining"),
    ("RESET_AFTER_S", "reset_after_seconds"),
    ("SOURCE", "source"),
    ("IN_FLIGHT", "in_flight"),
    ("DELAYED", "delayed"),
];

/// Runs `backstop scopes`.
pub fn run(args: Args) -> ExitCode {
    match execute(args) {
        Ok(text) => output::print("scopes", &text, ExitCode::SUCCESS),
        Err(message) => {
            errln!("backstop scopes: {message}");
            ExitCode::from(2)
        }
    }
}

fn execute(args: Args) -> Result<String, String> {
    let base = client::base_url(args.url)?;
    let token = args.token.or_else(token_from_env).ok_or(
        "no token: set BACKSTOP_TOKEN (an agent or operator token) or BACKSTOP_OPERATOR_TOKEN, or pass --token",
    )?;
    let client = Client::new(base, token);
    let value = client.get(SCOPES)?;
    client.shaped::<Vec<ScopeRecord>>("GET", SCOPES, &value, "a JSON array of scope records")?;
    let records: &[Value] = value.as_array().map_or(&[], Vec::as_slice);
    Ok(match args.format {
        Format::Json => format!(
            "{}\n",
            serde_json::to_string_pretty(&value).unwrap_or_else(|_| value.to_string())
        ),
        Format::Table => {
            let now = args.now.unwrap_or_else(current_time);
            let rows: Vec<Value> = records
                .iter()
                .map(|record| passed_as_now(with_name(record), now))
                .collect();
            client::table(&COLUMNS, &rows)
        }
    })
}

/// The token from the environment: `BACKSTOP_TOKEN`, else `BACKSTOP_OPERATOR_TOKEN` (empty values
/// count as unset).
fn token_from_env() -> Option<String> {
    ["BACKSTOP_TOKEN", "BACKSTOP_OPERATOR_TOKEN"]
        .iter()
        .find_map(|name| std::env::var(name).ok().filter(|t| !t.is_empty()))
}

/// A scope record with its full `name`: the gateway's own, else `provider/scope` built from the
/// two members (a gateway from before the member existed).
fn with_name(record: &Value) -> Value {
    let mut record = record.clone();
    if record["name"].is_null() {
        if let (Some(provider), Some(scope)) =
            (record["provider"].as_str(), record["scope"].as_str())
        {
            let name = format!("{provider}/{scope}");
            if let Value::Object(members) = &mut record {
                members.insert("name".to_owned(), Value::String(name));
            }
        }
    }
    record
}

/// A record whose `next_allowed_at` is not after `now` shows `now` there: the boundary has
/// passed and an attempt may leave (the record keeps the instant until the next signal).
fn passed_as_now(mut record: Value, now: Timestamp) -> Value {
    let passed = record["next_allowed_at"]
        .as_str()
        .and_then(|at| at.parse::<Timestamp>().ok())
        .is_some_and(|at| at <= now);
    if passed {
        record["next_allowed_at"] = Value::String("now".to_owned());
    }
    record
}
