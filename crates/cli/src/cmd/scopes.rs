//! `backstop scopes`: the scope records of a running gateway (SPEC §11, `GET /v1/scopes`).
//!
//! Why: when agents stall, the first question is which quota scope holds them and until when.
//! Each row is one scope record as the scheduler last published it: `next_allowed_at` (no
//! attempt of the scope leaves before it), the provider's `remaining` requests and
//! `reset_after_seconds`, the `source` of the last signal, and the attempts `in_flight` and
//! actions `delayed` in the scope.
//!
//! The gateway is reached at `--url` (default `http://127.0.0.1:8080`, or `BACKSTOP_URL`) with an
//! agent or operator token from `--token` or, preferably, `BACKSTOP_TOKEN` (a flag is visible in
//! the process list). Output: a table, or the JSON array with `--format json`. Exit codes: 0
//! success; 2 anything else, on one stderr line.

use std::process::ExitCode;

use serde_json::Value;

use crate::cmd::client::{self, Client};
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
    #[arg(long)]
    pub url: Option<String>,
    /// Agent or operator token (default: the BACKSTOP_TOKEN variable, which is preferable).
    #[arg(long)]
    pub token: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

/// The table's columns: title and member of a scope record.
const COLUMNS: [(&str, &str); 8] = [
    ("PROVIDER", "provider"),
    ("SCOPE", "scope"),
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
    let token = args
        .token
        .or_else(|| {
            std::env::var("BACKSTOP_TOKEN")
                .ok()
                .filter(|t| !t.is_empty())
        })
        .ok_or("no token: set BACKSTOP_TOKEN to an agent or operator token (or pass --token)")?;
    let value = Client::new(base, token).get("/v1/scopes")?;
    let Value::Array(records) = &value else {
        return Err("GET /v1/scopes: the answer is not a JSON array of scope records".to_owned());
    };
    Ok(match args.format {
        Format::Json => format!(
            "{}\n",
            serde_json::to_string_pretty(&value).unwrap_or_else(|_| value.to_string())
        ),
        Format::Table => client::table(&COLUMNS, records),
    })
}
