//! `backstop classify --status N [-H 'Name: value']… [--now RFC3339] [--class CLASS]
//! [--dialect DIALECT] [--body-file F] [--error-pointer /error/code] [--transport-error KIND]
//! [--pretty]`
//!
//! The tool to debug a provider (SPEC §11): give it what came back — a status with headers (and
//! optionally the error body), or a transport error instead — and it prints the normalized signal
//! as ONE JSON object (one line; indented with `--pretty`): `disposition`, `retryable` (whether the gateway tries it again, for the request class), `boundary` (`state`,
//! `retry_not_before`, `delay_ms`, `source`, `raw`, `clock`, `reason`, every key present, `null`
//! when not applicable), `quota` (array of `dialect`, `policy`, `limit`, `remaining`, `reset_at`,
//! `window_seconds`, `interpretation` — how an ambiguous reset was read in the generic dialect),
//! `hint`, `error_code` and `error_code_reason` (why no code was read through
//! `--error-pointer`: no body, body is not JSON, nothing at the pointer, not a scalar, longer
//! than 256 characters; `null` otherwise).
//!
//! Retry statuses per class are the SPEC §3 defaults (read: 408, 429, 500, 502, 503, 504;
//! idempotent_write: 408, 429, 502, 503, 504; uncertain_write: none). Bad arguments (a header
//! line without `:`, an invalid header name or value, a `--status` outside 100..=599, a bad
//! `--now`, both or neither of `--status` and `--transport-error`, an unreadable body file, an
//! `--error-pointer` that is not an RFC 6901 pointer or is given without `--body-file`) print
//! one line naming the argument on stderr and exit 2.

use std::path::PathBuf;
use std::process::ExitCode;

use backstop_core::classify::{
    classify, ClassifyRules, HeaderMap, HeaderName, HeaderValue, Observed, ResponseView,
    TransportError,
};
use backstop_core::policy::{builtin_class, is_json_pointer};
use backstop_core::quota::Dialect;
use jiff::Timestamp;
use serde_json::Value;

use crate::cmd::clock::current_time;
use crate::cmd::output::{self, errln};

/// Request class whose retry statuses decide `retryable` (the built-in classes' defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
#[clap(rename_all = "snake_case")]
pub enum Class {
    /// Safe reads: 408, 429, 500, 502, 503, 504.
    Read,
    /// Writes with an honoured idempotency key: 408, 429, 502, 503, 504.
    IdempotentWrite,
    /// Writes without one: no automatic retry.
    UncertainWrite,
    /// LLM completions (`side_effect: none`): 408, 429, 500, 502, 503, 504, 529.
    LlmCall,
}

impl Class {
    /// The class name, as in the policy (`read`, `idempotent_write`, `uncertain_write`,
    /// `llm_call`).
    pub fn name(self) -> &'static str {
        match self {
            Class::Read => "read",
            Class::IdempotentWrite => "idempotent_write",
            Class::UncertainWrite => "uncertain_write",
            Class::LlmCall => "llm_call",
        }
    }

    /// Whether a request of the class has side effects to protect (its built-in
    /// `side_effect`): `false` for `read` and `llm_call`.
    pub fn has_side_effect(self) -> bool {
        builtin_class(self.name())
            .is_none_or(|class| class.side_effect == backstop_core::side_effect::SideEffect::Write)
    }

    /// The default `retry_statuses` of the class, from core's built-in classes.
    pub fn retry_statuses(self) -> Vec<u16> {
        builtin_class(self.name())
            .map(|class| class.retry_statuses)
            .unwrap_or_default()
    }
}

/// Arguments of `backstop classify`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// HTTP status of the response, 100-599 (omit when --transport-error is given).
    // Text, checked by `parse_status`: any value outside 100..=599 (negative, too large, not a
    // number) gets the same one-line refusal.
    #[arg(long, allow_hyphen_values = true)]
    pub status: Option<String>,
    /// A response header, `Name: value`; repeat for several (order and repeats are kept).
    #[arg(short = 'H', long = "header", value_name = "NAME: VALUE")]
    pub headers: Vec<String>,
    /// The local receive instant (RFC 3339, e.g. 2025-03-01T12:00:00Z). Default: the current time.
    #[arg(long)]
    pub now: Option<String>,
    /// Request class deciding `retryable`.
    #[arg(long, value_enum, default_value = "read")]
    pub class: Class,
    /// Quota header dialect: generic, ietf, openai, anthropic or github.
    #[arg(long, default_value = "generic")]
    pub dialect: String,
    /// File holding the error body (only its error code is read, through --error-pointer or
    /// the dialect's documented place — openai: /error/code; never printed).
    #[arg(long, value_name = "FILE")]
    pub body_file: Option<PathBuf>,
    /// RFC 6901 JSON pointer to the provider error code in the body, e.g. /error/code
    /// (default: the dialect's documented place, /error/code for openai; none for the others).
    #[arg(long, value_name = "POINTER")]
    pub error_pointer: Option<String>,
    /// Instead of a response: connect, dns, tls, timeout-after-send, reset-after-send or
    /// response-cut.
    #[arg(long, value_name = "KIND")]
    pub transport_error: Option<String>,
    /// Print the JSON indented over several lines instead of one line.
    #[arg(long)]
    pub pretty: bool,
}

/// Parses one `-H 'Name: value'` line into the map.
fn add_header(headers: &mut HeaderMap, line: &str) -> Result<(), String> {
    let Some((name, value)) = line.split_once(':') else {
        return Err(format!("--header {line:?}: expected 'Name: value'"));
    };
    let name = HeaderName::from_bytes(name.trim().as_bytes())
        .map_err(|_| format!("--header {line:?}: invalid header name {:?}", name.trim()))?;
    let value = HeaderValue::from_str(value.trim())
        .map_err(|_| format!("--header {line:?}: invalid header value"))?;
    headers.append(name, value);
    Ok(())
}

/// Every `boundary` key present: an unknown boundary gets `null` for the instant, delay and clock.
fn complete_boundary(v: &mut Value) {
    if let Some(b) = v.get_mut("boundary").and_then(Value::as_object_mut) {
        for key in [
            "retry_not_before",
            "delay_ms",
            "source",
            "raw",
            "clock",
            "reason",
        ] {
            b.entry(key).or_insert(Value::Null);
        }
    }
}

/// The `--status` argument as an HTTP status code.
///
/// # Errors
/// `--status TEXT: not an HTTP status (100..=599, RFC 9110 §15)` for anything else: a number
/// outside the range (negative or too large included) or text that is not a number.
fn parse_status(text: &str) -> Result<u16, String> {
    text.trim()
        .parse::<u16>()
        .ok()
        .filter(|status| (100..=599).contains(status))
        .ok_or_else(|| format!("--status {text}: not an HTTP status (100..=599, RFC 9110 §15)"))
}

fn build(args: Args) -> Result<Value, String> {
    let received_at = match &args.now {
        Some(s) => s
            .parse::<Timestamp>()
            .map_err(|e| format!("--now {s:?}: not an RFC 3339 instant ({e})"))?,
        None => current_time(),
    };
    let dialect: Dialect = args
        .dialect
        .parse()
        .map_err(|e| format!("--dialect: {e}"))?;
    let mut headers = HeaderMap::new();
    for line in &args.headers {
        add_header(&mut headers, line)?;
    }
    if let Some(pointer) = &args.error_pointer {
        if !is_json_pointer(pointer) {
            return Err(format!(
                "--error-pointer {pointer:?}: not a JSON pointer (RFC 6901: `/` followed by \
                 tokens, `~` only as `~0` or `~1`, e.g. /error/code)"
            ));
        }
        if args.body_file.is_none() {
            return Err(
                "--error-pointer needs --body-file: the code is read from the error body"
                    .to_owned(),
            );
        }
    }
    // Without --error-pointer, the dialect's documented place (openai: /error/code), as the
    // policy does; a body with no pointer at all would be read for nothing.
    let error_code_pointer = args
        .error_pointer
        .clone()
        .or_else(|| dialect.error_code_pointer().map(str::to_owned));
    if args.body_file.is_some() && error_code_pointer.is_none() {
        return Err(format!(
            "--body-file needs --error-pointer: only the error code is read from the body, and \
             the {dialect} dialect has no documented place for it (e.g. --error-pointer \
             /error/code; --dialect openai reads /error/code)"
        ));
    }
    let body = match &args.body_file {
        Some(path) => Some(
            std::fs::read(path)
                .map_err(|e| format!("--body-file {}: cannot read ({e})", path.display()))?,
        ),
        None => None,
    };
    let rules = ClassifyRules {
        error_code_pointer,
        dialect,
        ..ClassifyRules::with_retry_statuses(args.class.retry_statuses())
    };
    let observed = match (args.status, &args.transport_error) {
        (Some(_), Some(_)) => {
            return Err("--status and --transport-error: give exactly one, not both".to_owned())
        }
        (None, None) => {
            return Err("--status or --transport-error: one of them is required".to_owned())
        }
        (None, Some(kind)) => Observed::Transport(
            kind.parse::<TransportError>()
                .map_err(|e| format!("--transport-error: {e}"))?,
        ),
        (Some(text), None) => {
            let status = parse_status(&text)?;
            Observed::Response(ResponseView {
                status,
                headers: &headers,
                body: body.as_deref(),
            })
        }
    };
    let mut signal = classify(&observed, &rules, received_at);
    // What the gateway does with it, from the same rule (an `uncertain` read is retried).
    signal.retryable = backstop_core::classify::tried_again(&signal, args.class.has_side_effect());
    let mut v = serde_json::to_value(&signal).map_err(|e| format!("cannot encode signal: {e}"))?;
    complete_boundary(&mut v);
    Ok(v)
}

/// Runs `backstop classify`: prints the signal as one JSON object and exits 0, or prints a
/// one-line error naming the bad argument and exits 2.
pub fn run(args: Args) -> ExitCode {
    let pretty = args.pretty;
    match build(args) {
        Ok(v) if pretty => match serde_json::to_string_pretty(&v) {
            Ok(text) => output::print("classify", &format!("{text}\n"), ExitCode::SUCCESS),
            Err(e) => {
                errln!("backstop classify: cannot encode signal: {e}");
                ExitCode::from(2)
            }
        },
        Ok(v) => output::print("classify", &format!("{v}\n"), ExitCode::SUCCESS),
        Err(e) => {
            errln!("backstop classify: {e}");
            ExitCode::from(2)
        }
    }
}
