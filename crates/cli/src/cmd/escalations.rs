//! `backstop escalations list|show|decide`: read case files and record decisions on a running
//! gateway (SPEC §8, §11) through its escalation API (`/v1/escalations`).
//!
//! The gateway is reached at `--url` (default `http://127.0.0.1:8080`, or `BACKSTOP_URL`) with an
//! operator token from `--token` or, preferably, `BACKSTOP_OPERATOR_TOKEN` (a flag is visible in
//! the process list). Plain `http://` only (the HTTP client is built without TLS): reach a
//! remote gateway through a TLS-terminating proxy or an SSH tunnel to its loopback port.
//!
//! `decide` checks the option before anything is sent: an unknown option is refused naming the
//! known ones, and `send_new` without `--confirm-second-side-effect` is refused naming that flag
//! (the gateway would refuse it too, SPEC §8).
//!
//! Output: `list` prints a table of the open escalations (id, action, provider, route, reason,
//! opened), or `no open escalations`; `list --all` every escalation with its state and decision
//! (the gateway lists only open ones, so each is read by id, from 1 up to the first id that does
//! not exist: one request per escalation); `show` the escalation with its case file as pretty
//! JSON; `decide` what the gateway answered: the decision, its effect and whether it was
//! applied, the escalated action's outcome (`action N`) — for `send_new` that it is unchanged,
//! and the new action with its own outcome (`new action M`) —, the lookup of `query_status`
//! and whether the escalation stays open. `--format json` prints the gateway's answer (for
//! `list --all`, the rows as `{"escalations": […]}`) as pretty JSON.
//!
//! A gateway that restarted since the escalation no longer holds the escalated request (payloads
//! are never stored): it records a `retry_same_key` (reopening the action) or `send_new` and
//! answers `409 request_not_held` with `decision_recorded: true`. That decision was made, so
//! `decide` prints it as recorded but not carried out — the detail, and what the agent must
//! resubmit (the same payload under the key it names, or the payload as a new action) — and
//! exits 0; `--format json` prints the problem document.
//!
//! Every answer is read into the shape the gateway documents for its route (the members listed
//! in `backstop_gateway::escalations`, with their types; `show` and `decide` also check that the
//! answer is about the escalation, and the decision, that was asked) before anything is
//! printed, in either format: anything else means the URL does not look like a backstop gateway,
//! and nothing is printed on stdout.
//! Exit codes: 0 success (for `decide`: the decision was recorded, whether or not its effect
//! could be applied); 2 anything else (unreachable gateway naming the URL, missing token, a
//! problem answer from the gateway with its status, name and detail, an answer that does not
//! look like a backstop gateway's naming the route and why) on one stderr line.

use std::process::ExitCode;

use backstop_core::escalation::{DecisionEffect, DecisionOption};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::cmd::client::{self, Client, Posted};
use crate::cmd::output::{self, errln};

/// Output formats of `backstop escalations list` and `decide`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Text for a person: a table (`list`), labelled lines (`decide`).
    Text,
    /// The gateway's JSON answer, pretty-printed.
    Json,
}

/// Arguments of `backstop escalations`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The gateway's base URL (default http://127.0.0.1:8080, or the BACKSTOP_URL variable).
    /// Only http:// URLs are accepted (no TLS in this client): reach a remote gateway through a
    /// TLS-terminating proxy or an SSH tunnel.
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
    List {
        /// Every escalation, decided ones too, with its state and decision (read one by one,
        /// by id).
        #[arg(long)]
        all: bool,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
    /// Print one escalation with its sanitized case file as pretty JSON.
    Show {
        /// The escalation id.
        id: u64,
    },
    /// Record a decision (query_status, retry_same_key, abort, send_new, wait, raise_quota,
    /// change_plan) and print what the gateway did: the effect, the action's outcome, the
    /// lookup's answer.
    Decide {
        /// The escalation id.
        id: u64,
        /// The chosen option, one of: query_status (ask the provider's lookup whether the write
        /// happened), retry_same_key (send it again with its original idempotency key), abort,
        /// send_new (a new write with a new key; needs --confirm-second-side-effect), wait,
        /// raise_quota, change_plan. The case file (`show`) lists the options its case offers.
        #[arg(long)]
        option: String,
        /// Confirm that `send_new` may create a second side effect (a second payment, message or
        /// deployment). Without it, `send_new` is refused.
        #[arg(long)]
        confirm_second_side_effect: bool,
        /// A note recorded with the decision's answer.
        #[arg(long)]
        note: Option<String>,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
}

/// Runs `backstop escalations`.
pub fn run(args: Args) -> ExitCode {
    let name = match &args.command {
        EscalationsCommand::List { .. } => "list",
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
        EscalationsCommand::List { all: false, format } => {
            let value = client.get(LIST)?;
            client.shaped::<OpenList>("GET", LIST, &value, "an escalation list")?;
            Ok(match format {
                Format::Json => format!("{}\n", pretty(&value)),
                Format::Text => table(&value, "no open escalations", &OPEN_COLUMNS),
            })
        }
        EscalationsCommand::List { all: true, format } => {
            let value = json!({ "escalations": every_escalation(&client)? });
            Ok(match format {
                Format::Json => format!("{}\n", pretty(&value)),
                Format::Text => table(&value, "no escalations", &ALL_COLUMNS),
            })
        }
        EscalationsCommand::Show { id } => {
            let path = format!("/v1/escalations/{id}");
            let value = client.get(&path)?;
            escalation(&client, &path, id, &value)?;
            Ok(format!("{}\n", pretty(&value)))
        }
        EscalationsCommand::Decide {
            id,
            option,
            confirm_second_side_effect,
            note,
            format,
        } => {
            let mut body = json!({
                "option": option,
                "confirm_second_side_effect": confirm_second_side_effect,
            });
            if let Some(note) = note {
                body["note"] = Value::String(note);
            }
            let path = format!("/v1/escalations/{id}/decision");
            let (answered_id, answered_decision, text) =
                match client.post_unless(&path, &body, NOT_HELD)? {
                    Posted::Value(value) => {
                        let answer: Decided =
                            client.shaped("POST", &path, &value, "a decision's answer")?;
                        let text = match format {
                            Format::Json => format!("{}\n", pretty(&value)),
                            Format::Text => decided(&value),
                        };
                        (answer.id, answer.decision, text)
                    }
                    Posted::Problem(value) => {
                        let answer: NotHeld = client.shaped(
                            "POST",
                            &path,
                            &value,
                            "a request_not_held problem naming the recorded decision",
                        )?;
                        if !answer.decision_recorded {
                            return Err(format!("HTTP 409 {NOT_HELD}: {}", answer.detail));
                        }
                        let text = match format {
                            Format::Json => format!("{}\n", pretty(&value)),
                            Format::Text => not_held(&value),
                        };
                        (answer.escalation, answer.decision, text)
                    }
                };
            if answered_id != id || answered_decision != option {
                return Err(client.not_backstop(
                    "POST",
                    &path,
                    &format!(
                        "a decision {answered_decision} on escalation {answered_id} (asked: {option} on escalation {id})"
                    ),
                ));
            }
            Ok(text)
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

/// The route that lists the open escalations.
const LIST: &str = "/v1/escalations";

/// The answer of `GET /v1/escalations`, as the gateway documents it: the open escalations.
#[derive(Debug, Deserialize)]
#[expect(dead_code, reason = "read only to check the answer's shape")]
struct OpenList {
    escalations: Vec<OpenRow>,
}

/// One row of [`OpenList`]: the members the table shows (`opened_at` comes from the case file
/// and may be `null`).
#[derive(Debug, Deserialize)]
#[expect(dead_code, reason = "read only to check the answer's shape")]
struct OpenRow {
    id: u64,
    action: u64,
    provider: String,
    route: String,
    reason: String,
    opened_at: Option<String>,
    state: State,
}

/// An escalation's state on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
enum State {
    Open,
    Decided,
}

/// The answer of `GET /v1/escalations/{id}`: `decision`, `decided_by`, `decided_at` and `note`
/// are `null` (or absent) while the escalation is open.
#[derive(Debug, Deserialize)]
#[expect(dead_code, reason = "read only to check the answer's shape")]
struct Escalation {
    id: u64,
    action: u64,
    state: State,
    decision: Option<String>,
    decided_by: Option<String>,
    decided_at: Option<String>,
    note: Option<String>,
    case_file: CaseSummary,
}

/// The members of a case file that `list --all` shows (SPEC §8 case file).
#[derive(Debug, Deserialize)]
#[expect(dead_code, reason = "read only to check the answer's shape")]
struct CaseSummary {
    provider: String,
    endpoint: String,
    reason: String,
    opened_at: Option<String>,
}

/// The answer of `POST /v1/escalations/{id}/decision`: the recorded decision and what it did.
/// `effect_detail`, `action_outcome`, `new_action`, `lookup` and `note` are `null` (or absent)
/// when there is nothing to say.
#[derive(Debug, Deserialize)]
#[expect(dead_code, reason = "read only to check the answer's shape")]
struct Decided {
    id: u64,
    action: u64,
    decision: String,
    decided_by: String,
    decided_at: String,
    effect: DecisionEffect,
    effect_applied: bool,
    effect_detail: Option<String>,
    action_outcome: Option<String>,
    new_action: Option<Value>,
    lookup: Option<Lookup>,
    escalation_state: State,
    note: Option<String>,
}

/// The problem a decision is answered with when the gateway recorded it but no longer holds
/// the escalated request (it restarted since the escalation): `retry_same_key` reopened the
/// action and the agent resubmits under its key; `send_new` needs the agent to submit the
/// payload as a new action.
const NOT_HELD: &str = "request_not_held";

/// The members of a `409 request_not_held` problem that say what was recorded.
#[derive(Debug, Deserialize)]
#[expect(dead_code, reason = "read only to check the answer's shape")]
struct NotHeld {
    detail: String,
    escalation: u64,
    action: u64,
    decision: String,
    decided_by: String,
    decision_recorded: bool,
    idempotency_key: Option<String>,
}

/// What a `query_status` lookup answered.
#[derive(Debug, Deserialize)]
#[expect(dead_code, reason = "read only to check the answer's shape")]
struct Lookup {
    verdict: String,
    reason: Option<String>,
    provider_operation_id: Option<String>,
}

/// Checks that `value`, the answer of `GET path`, is escalation `id`.
///
/// # Errors
/// The URL does not look like a backstop gateway: the answer is not an escalation, or is
/// another escalation than `id`.
fn escalation(client: &Client, path: &str, id: u64, value: &Value) -> Result<(), String> {
    let e: Escalation = client.shaped("GET", path, value, "an escalation")?;
    if e.id != id {
        return Err(client.not_backstop("GET", path, &format!("escalation {}", e.id)));
    }
    Ok(())
}

/// The columns of `list`: title and member of a row of `GET /v1/escalations`.
const OPEN_COLUMNS: [(&str, &str); 6] = [
    ("ID", "id"),
    ("ACTION", "action"),
    ("PROVIDER", "provider"),
    ("ROUTE", "route"),
    ("REASON", "reason"),
    ("OPENED", "opened_at"),
];

/// The columns of `list --all`: those of `list`, then the state and the decision.
const ALL_COLUMNS: [(&str, &str); 9] = [
    ("ID", "id"),
    ("ACTION", "action"),
    ("PROVIDER", "provider"),
    ("ROUTE", "route"),
    ("REASON", "reason"),
    ("OPENED", "opened_at"),
    ("STATE", "state"),
    ("DECISION", "decision"),
    ("DECIDED_BY", "decided_by"),
];

/// A table of `value["escalations"]` with a header, or `empty` on its own line when there is
/// no row.
fn table(value: &Value, empty: &str, columns: &[(&str, &str)]) -> String {
    match value["escalations"].as_array() {
        Some(rows) if !rows.is_empty() => client::table(columns, rows),
        _ => format!("{empty}\n"),
    }
}

/// Every escalation, open or decided, as rows of the list's shape plus `state`, `decision`,
/// `decided_by` and `decided_at`. The gateway lists only open ones, so each is read by id:
/// ids are given in order from 1 and never removed, so the first id that does not exist
/// (`escalation_not_found`) ends the list.
fn every_escalation(client: &Client) -> Result<Vec<Value>, String> {
    let mut rows = Vec::new();
    for id in 1u64.. {
        let path = format!("/v1/escalations/{id}");
        let Some(e) = client.get_unless(&path, "escalation_not_found")? else {
            break;
        };
        escalation(client, &path, id, &e)?;
        let case = &e["case_file"];
        rows.push(json!({
            "id": e["id"],
            "action": e["action"],
            "provider": case["provider"],
            "route": case["endpoint"],
            "reason": case["reason"],
            "opened_at": case["opened_at"],
            "state": e["state"],
            "decision": e["decision"],
            "decided_by": e["decided_by"],
            "decided_at": e["decided_at"],
        }));
    }
    Ok(rows)
}

/// What `decide` prints for a decision the gateway recorded without carrying it out, because it
/// no longer holds the request (`409 request_not_held`): the decision, what was not applied and
/// why, and what the agent resubmits.
fn not_held(value: &Value) -> String {
    let at = value["decided_at"]
        .as_str()
        .map(|at| format!(" at {at}"))
        .unwrap_or_default();
    let mut out = format!(
        "escalation {}: {} (action {}, decided by {}{at}); recorded, but the gateway no longer holds the request\n",
        client::cell(&value["escalation"]),
        client::cell(&value["decision"]),
        client::cell(&value["action"]),
        client::cell(&value["decided_by"]),
    );
    let mut line = |label: &str, text: String| {
        out.push_str(&format!("  {label:<15} {text}\n"));
    };
    line(
        "effect",
        format!(
            "{}, not applied: {}",
            client::cell(&value["decision"]),
            client::cell(&value["detail"])
        ),
    );
    match value["idempotency_key"].as_str() {
        Some(key) => line(
            "resubmit",
            format!(
                "the same payload with Idempotency-Key {key} (sent as action {})",
                client::cell(&value["action"])
            ),
        ),
        None => line(
            "resubmit",
            "the payload as a new action with a new Idempotency-Key".to_owned(),
        ),
    }
    line("escalation", "decided".to_owned());
    out
}

/// What `decide` prints: a first line with the decision, then one labelled line per member of
/// the answer that says what happened (members the answer does not carry are left out). The
/// outcome is printed on the line of the action it belongs to: `action N` for the escalated
/// action, and for `send_new` also `new action M`, whose outcome the answer's `action_outcome`
/// is (the escalated action stays as it was).
fn decided(value: &Value) -> String {
    let open = value["escalation_state"].as_str() == Some("open");
    let mut out = if open {
        format!(
            "escalation {}: {} asked by {} at {} (action {}); the escalation stays open\n",
            client::cell(&value["id"]),
            client::cell(&value["decision"]),
            client::cell(&value["decided_by"]),
            client::cell(&value["decided_at"]),
            client::cell(&value["action"]),
        )
    } else {
        format!(
            "escalation {}: {} (action {}, decided by {} at {})\n",
            client::cell(&value["id"]),
            client::cell(&value["decision"]),
            client::cell(&value["action"]),
            client::cell(&value["decided_by"]),
            client::cell(&value["decided_at"]),
        )
    };
    let mut line = |label: &str, text: String| {
        out.push_str(&format!("  {label:<15} {text}\n"));
    };
    if let Some(effect) = value["effect"].as_object() {
        let name = effect
            .get("effect")
            .map(client::cell)
            .unwrap_or_else(|| "-".to_owned());
        let details: Vec<String> = effect
            .iter()
            .filter(|(key, v)| key.as_str() != "effect" && !v.is_null())
            .map(|(key, v)| format!("{key} {}", client::cell(v)))
            .collect();
        let applied = match value["effect_applied"].as_bool() {
            Some(true) => "applied",
            Some(false) => "not applied",
            None => "applied: unknown",
        };
        let mut text = name;
        if !details.is_empty() {
            text.push_str(&format!(" ({})", details.join(", ")));
        }
        text.push_str(&format!(", {applied}"));
        if let Some(detail) = value["effect_detail"].as_str().filter(|d| !d.is_empty()) {
            text.push_str(&format!(": {detail}"));
        }
        line("effect", text);
    }
    // `action_outcome` is the outcome of the action the decision sent: the escalated action
    // itself, or for `send_new` the new action, while the escalated one stays as it was.
    let action = client::cell(&value["action"]);
    let outcome = value["action_outcome"].as_str().map(str::to_owned);
    if value["new_action"].is_null() {
        line(
            &format!("action {action}"),
            outcome.unwrap_or_else(|| "unchanged".to_owned()),
        );
    } else {
        line(
            &format!("action {action}"),
            "unchanged (the request was sent as a new action)".to_owned(),
        );
        line(
            &format!("new action {}", client::cell(&value["new_action"])),
            outcome.unwrap_or_else(|| "no outcome yet (still running)".to_owned()),
        );
    }
    if let Some(lookup) = value["lookup"].as_object() {
        let mut text = lookup
            .get("verdict")
            .map(client::cell)
            .unwrap_or_else(|| "-".to_owned());
        if let Some(id) = lookup.get("provider_operation_id").and_then(Value::as_str) {
            text.push_str(&format!(", provider operation {id}"));
        }
        if let Some(reason) = lookup.get("reason").and_then(Value::as_str) {
            text.push_str(&format!(": {reason}"));
        }
        line("lookup", text);
    }
    if let Some(state) = value["escalation_state"].as_str() {
        line("escalation", state.to_owned());
    }
    if let Some(note) = value["note"].as_str() {
        line("note", note.to_owned());
    }
    out
}
