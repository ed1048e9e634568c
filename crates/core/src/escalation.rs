//! Sanitized escalation case files and decision options (SPEC §8).
//!
//! Why a case file: when backstop cannot decide safely — a write may or may not have happened,
//! the provider's boundary lies beyond the deadline, the shared quota is gone, or repeated limits
//! point at the account's configuration — a person must decide. That person needs, on one page,
//! what the agent wanted, what was sent where and when, what the provider answered, what it cost,
//! and which options exist with their real risks. They must not need (nor be shown) the payload
//! or any credential: the case file names the action by its route template and payload digest,
//! and every string in it passes a credential sanitizer before it is stored.
//!
//! Decisions are validated here ([`validate_decision`]): an option that was not offered is
//! refused, and `send_new` — which may create a second payment, message or deployment — is
//! refused unless the request explicitly confirms that risk. Revealing a stored payload is not an
//! action decision at all: it is a separate, audited access decision ([`REVEAL_PAYLOAD`]),
//! recorded apart from approving an action.
//!
//! ```
//! use backstop_core::escalation::{
//!     validate_decision, CaseAction, CaseFile, CaseInput, Decision, DecisionError,
//!     EscalationReason,
//! };
//!
//! let input = CaseInput {
//!     opened_at: "2026-01-01T00:00:00Z".parse().unwrap(),
//!     reason: EscalationReason::SideEffectUnknown,
//!     reason_detail: "connection reset after the request was written".into(),
//!     desired_outcome: Some("pay invoice 7 (key sk-live-abc123def456ghi789)".into()),
//!     action: CaseAction {
//!         task_id: "run-1".into(),
//!         method: "POST".into(),
//!         route: "/v1/transfers".into(),
//!         request_class: "uncertain_write".into(),
//!         payload_digest: "ab".repeat(32),
//!     },
//!     provider: "billing-api".into(),
//!     ..CaseInput::default()
//! };
//! let case = CaseFile::build(input).unwrap();
//! assert_eq!(case.desired_outcome.as_deref(), Some("pay invoice 7 (key [redacted])"));
//! let send_new = Decision { option: "send_new".into(), confirm_second_side_effect: false, note: None };
//! assert!(matches!(
//!     validate_decision(&case, &send_new),
//!     Err(DecisionError::ConfirmationRequired)
//! ));
//! ```

use std::fmt;

use jiff::Timestamp;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::policy::template_for_path;

/// The version of the case file layout written by [`CaseFile::build`].
pub const CASE_FILE_VERSION: u32 = 1;

/// The decision word of the separate access decision that reveals a stored payload. It is never
/// one of an escalation's action options and never approves an action.
pub const REVEAL_PAYLOAD: &str = "reveal_payload";

/// Longest operator note accepted with a decision, in characters.
pub const MAX_NOTE_CHARS: usize = 2_000;

/// What replaces a credential-looking value.
pub const REDACTED: &str = "[redacted]";

/// Why an escalation was opened (SPEC §8). Serialized in `snake_case`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EscalationReason {
    /// A write may or may not have happened and reconciliation could not tell.
    #[default]
    SideEffectUnknown,
    /// The provider's boundary (or the remaining wait) lies beyond the task deadline.
    RemainingWaitExceedsDeadline,
    /// The shared quota of a scope is exhausted (billing or daily quota).
    SharedQuotaExhausted,
    /// Repeated limits point to the account's configuration (plan, tier, permissions).
    AccountConfiguration,
}

impl EscalationReason {
    /// The `snake_case` wire name.
    pub const fn as_str(self) -> &'static str {
        match self {
            EscalationReason::SideEffectUnknown => "side_effect_unknown",
            EscalationReason::RemainingWaitExceedsDeadline => "remaining_wait_exceeds_deadline",
            EscalationReason::SharedQuotaExhausted => "shared_quota_exhausted",
            EscalationReason::AccountConfiguration => "account_configuration",
        }
    }
}

impl fmt::Display for EscalationReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One option a person may choose (SPEC §8). Serialized in `snake_case`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DecisionOption {
    /// Ask the provider whether the operation happened (the reconciliation lookup).
    QueryStatus,
    /// Send again with the same idempotency key (the provider deduplicates).
    RetrySameKey,
    /// Give up on the action.
    Abort,
    /// Send as a new operation with a new key: may create a second side effect.
    SendNew,
    /// Wait until the provider's boundary or quota reset, then send.
    Wait,
    /// Raise the provider quota or plan for the scope, then send.
    RaiseQuota,
    /// Change the plan: the deadline, the request, or the account it runs under.
    ChangePlan,
}

impl DecisionOption {
    /// Every option, in SPEC §8 order.
    pub const ALL: [DecisionOption; 7] = [
        DecisionOption::QueryStatus,
        DecisionOption::RetrySameKey,
        DecisionOption::Abort,
        DecisionOption::SendNew,
        DecisionOption::Wait,
        DecisionOption::RaiseQuota,
        DecisionOption::ChangePlan,
    ];

    /// The `snake_case` wire name (also the decision word recorded in the store and audit log).
    pub const fn as_str(self) -> &'static str {
        match self {
            DecisionOption::QueryStatus => "query_status",
            DecisionOption::RetrySameKey => "retry_same_key",
            DecisionOption::Abort => "abort",
            DecisionOption::SendNew => "send_new",
            DecisionOption::Wait => "wait",
            DecisionOption::RaiseQuota => "raise_quota",
            DecisionOption::ChangePlan => "change_plan",
        }
    }

    /// Parses the wire name.
    pub fn parse(text: &str) -> Option<DecisionOption> {
        DecisionOption::ALL.into_iter().find(|o| o.as_str() == text)
    }
}

impl fmt::Display for DecisionOption {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An option offered in a case file, with its real risk in plain words.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OfferedOption {
    /// The option.
    pub option: DecisionOption,
    /// What choosing it does and what can go wrong.
    pub risk: String,
    /// Whether choosing it needs `confirm_second_side_effect: true` (only `send_new`).
    pub requires_confirmation: bool,
}

/// The logical action, named without its payload.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CaseAction {
    /// The task (run) it belongs to.
    pub task_id: String,
    /// HTTP method, upper case.
    pub method: String,
    /// The route template (`/v1/transfers/{id}`); a concrete path given here is reduced to its
    /// template by [`CaseFile::build`].
    pub route: String,
    /// Request class (`read`, `idempotent_write`, `uncertain_write`, …).
    pub request_class: String,
    /// SHA-256 of the payload as 64 lowercase hex digits (never the payload).
    pub payload_digest: String,
}

/// A header observed on an attempt's response (only Retry-After and quota headers are kept).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObservedHeader {
    /// Lower-case header name.
    pub name: String,
    /// The raw value (sanitized).
    pub value: String,
}

/// One attempt as the person needs to see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CaseAttempt {
    /// 1-based attempt number.
    pub n: u32,
    /// When it was durably recorded as sent (RFC 3339 UTC).
    pub started_at: Timestamp,
    /// When its result was recorded, if it has one.
    pub finished_at: Option<Timestamp>,
    /// HTTP status, when a response arrived.
    pub status: Option<u16>,
    /// Disposition (SPEC §2.1), e.g. `uncertain`, `rate_limited`.
    pub disposition: Option<String>,
    /// The raw `Retry-After` value, if any (several instances joined with `, `); a
    /// `retry-after-ms` (milliseconds) is listed among `quota_headers` under its own name.
    pub retry_after_raw: Option<String>,
    /// The boundary the attempt's response normalized to (`retry_not_before`), if usable.
    pub retry_not_before: Option<Timestamp>,
    /// Retry-After, `Date` and quota headers observed on the response, raw, in the order
    /// received (other headers are dropped).
    pub quota_headers: Vec<ObservedHeader>,
}

/// Budget consumed by the action so far (SPEC §5).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetConsumed {
    /// Attempts made (every attempt that left the process).
    pub attempts_used: u32,
    /// The class's attempt ceiling.
    pub max_attempts: u32,
    /// Time waited between attempts, in milliseconds.
    pub wait_used_ms: u64,
    /// The class's wait ceiling, in milliseconds.
    pub max_wait_ms: u64,
    /// The task deadline, if any.
    pub deadline: Option<Timestamp>,
}

/// Plain inputs of [`CaseFile::build`]. Strings may be raw: the builder sanitizes them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CaseInput {
    /// When the escalation opens.
    pub opened_at: Timestamp,
    /// Why.
    pub reason: EscalationReason,
    /// Why, in plain words (e.g. the reconciliation step's reason).
    pub reason_detail: String,
    /// The text the agent supplied as its desired outcome.
    pub desired_outcome: Option<String>,
    /// The logical action.
    pub action: CaseAction,
    /// Provider name.
    pub provider: String,
    /// Full scope names the request falls under.
    pub scopes: Vec<String>,
    /// The sanitized fingerprint (SPEC §7).
    pub fingerprint: String,
    /// Attempts, in order.
    pub attempts: Vec<CaseAttempt>,
    /// Budget consumed.
    pub budget: BudgetConsumed,
    /// Whether the provider honours the idempotency key on this route.
    pub honours_key: bool,
    /// The action's idempotency key.
    pub idempotency_key: Option<String>,
    /// The client-generated external reference, if any.
    pub external_reference: Option<String>,
    /// The provider's operation id, if known.
    pub provider_operation_id: Option<String>,
    /// The reconciliation lookup in template form (`GET /v1/transfers?reference={ref}`).
    pub reconciliation_query: Option<String>,
    /// The provider's boundary (or quota reset), if known: the `wait` option waits until it.
    pub retry_not_before: Option<Timestamp>,
}

/// A sanitized escalation case file (SPEC §8). Stored as JSON with the escalation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CaseFile {
    /// Layout version ([`CASE_FILE_VERSION`]).
    pub version: u32,
    /// When the escalation opened (RFC 3339 UTC, to the millisecond like every recorded
    /// instant).
    pub opened_at: Timestamp,
    /// Why it was opened.
    pub reason: EscalationReason,
    /// Why, in plain words.
    pub reason_detail: String,
    /// The agent's desired outcome text.
    pub desired_outcome: Option<String>,
    /// The logical action (route template and payload digest, never the payload).
    pub action: CaseAction,
    /// Provider name.
    pub provider: String,
    /// `METHOD /route/{template}`: never a concrete path.
    pub endpoint: String,
    /// Full scope names.
    pub scopes: Vec<String>,
    /// The sanitized fingerprint.
    pub fingerprint: String,
    /// Attempts with times, statuses, dispositions, Retry-After (raw and normalized) and quota
    /// headers.
    pub attempts: Vec<CaseAttempt>,
    /// Budget consumed.
    pub budget: BudgetConsumed,
    /// Whether the provider honours the idempotency key on this route.
    pub honours_key: bool,
    /// The action's idempotency key, as the agent knows it (the one `retry_same_key` reuses).
    pub idempotency_key: Option<String>,
    /// The key the provider was sent for it (`reconcile::upstream_idempotency_key` of agent and
    /// key): the one to search for at the provider. Set by the gateway after
    /// [`CaseFile::build`]; `null` when no key was sent (a provider that does not honour keys,
    /// `honours_key: false`, or a read); absent in case files written before keys were derived.
    #[serde(default)]
    pub upstream_idempotency_key: Option<String>,
    /// The external reference, if any.
    pub external_reference: Option<String>,
    /// The provider's operation id, if known.
    pub provider_operation_id: Option<String>,
    /// The reconciliation lookup in template form.
    pub reconciliation_query: Option<String>,
    /// The provider's boundary or quota reset, if known.
    pub retry_not_before: Option<Timestamp>,
    /// The outcome the action already ended with when the escalation was opened beside it
    /// (e.g. `quota_exhausted`): backstop holds nothing for it, so the options speak of
    /// resubmitting, never of sending it later. Set with [`CaseFile::beside_outcome`]; absent
    /// when the escalation itself ends the action (`escalated`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_with: Option<String>,
    /// The options, each with its real risk.
    pub options: Vec<OfferedOption>,
    /// Where something credential-like was removed (`desired_outcome`, `attempts[0].quota_headers`),
    /// never what.
    pub redactions: Vec<String>,
}

/// [`CaseFile::build`] was given something that cannot name an action.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("case file: {field}: {reason}")]
pub struct CaseFileError {
    /// The input field.
    pub field: &'static str,
    /// What is wrong.
    pub reason: String,
}

impl CaseFile {
    /// Builds a sanitized case file from plain inputs.
    ///
    /// - The route is reduced to its template ([`template_for_path`]); `endpoint` is
    ///   `METHOD /template`.
    /// - Attempt headers other than `Retry-After`, `retry-after-ms` and rate-limit/quota headers
    ///   are dropped (`Authorization`, cookies and API-key headers never appear).
    /// - Every string passes [`sanitize_text`]: bearer/basic tokens, `Authorization` values,
    ///   `sk-…`-style API keys, GitHub/Slack/GitLab tokens, AWS access key ids, Google API keys,
    ///   JWTs and `password=`/`token=`-style assignments become [`REDACTED`]; the path of each
    ///   redacted field is listed in `redactions`.
    /// - The options follow the reason (see [`offered_options`]).
    ///
    /// # Errors
    /// [`CaseFileError`] for an empty method, provider or route, or a payload digest that is not
    /// 64 lowercase hex digits.
    pub fn build(input: CaseInput) -> Result<CaseFile, CaseFileError> {
        let a = &input.action;
        if a.method.trim().is_empty() {
            return Err(CaseFileError {
                field: "action.method",
                reason: "must not be empty".into(),
            });
        }
        if input.provider.trim().is_empty() {
            return Err(CaseFileError {
                field: "provider",
                reason: "must not be empty".into(),
            });
        }
        if !a.route.starts_with('/') {
            return Err(CaseFileError {
                field: "action.route",
                reason: "a route template starts with `/`".into(),
            });
        }
        let digest_ok = a.payload_digest.len() == 64
            && a.payload_digest
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if !digest_ok {
            return Err(CaseFileError {
                field: "action.payload_digest",
                reason: format!(
                    "expected 64 lowercase hex digits (SHA-256), got {} characters",
                    a.payload_digest.len()
                ),
            });
        }
        let method = a.method.trim().to_ascii_uppercase();
        let route = template_for_path(&a.route);
        let attempts = input
            .attempts
            .into_iter()
            .map(|mut attempt| {
                attempt.quota_headers.retain(|h| is_quota_header(&h.name));
                for h in &mut attempt.quota_headers {
                    h.name = h.name.to_ascii_lowercase();
                }
                attempt
            })
            .collect();
        let mut case = CaseFile {
            version: CASE_FILE_VERSION,
            // Milliseconds, as the store and the audit log keep every instant: the case file
            // shows the instant its escalation's records show.
            opened_at: Timestamp::from_millisecond(input.opened_at.as_millisecond())
                .unwrap_or(input.opened_at),
            reason: input.reason,
            reason_detail: input.reason_detail,
            desired_outcome: input.desired_outcome,
            endpoint: format!("{method} {route}"),
            action: CaseAction {
                task_id: input.action.task_id,
                method,
                route,
                request_class: input.action.request_class,
                payload_digest: input.action.payload_digest,
            },
            provider: input.provider,
            scopes: input.scopes,
            fingerprint: input.fingerprint,
            attempts,
            budget: input.budget,
            honours_key: input.honours_key,
            idempotency_key: input.idempotency_key,
            upstream_idempotency_key: None,
            external_reference: input.external_reference,
            provider_operation_id: input.provider_operation_id,
            reconciliation_query: input.reconciliation_query,
            retry_not_before: input.retry_not_before,
            ended_with: None,
            options: Vec::new(),
            redactions: Vec::new(),
        };
        let mut value = serde_json::to_value(&case).map_err(|e| CaseFileError {
            field: "case_file",
            reason: e.to_string(),
        })?;
        let mut redactions = Vec::new();
        sanitize_value(&mut value, "", &mut redactions);
        if !redactions.is_empty() {
            case = serde_json::from_value(value).map_err(|e| CaseFileError {
                field: "case_file",
                reason: e.to_string(),
            })?;
        }
        case.redactions = redactions;
        case.options = offered_options(&case);
        Ok(case)
    }

    /// The case file as the JSON value the store keeps ([`CaseFile::build`]'s output is already
    /// sanitized).
    pub fn to_json(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }

    /// Reads a stored case file.
    ///
    /// # Errors
    /// The `serde_json` error naming the field when the value is not a case file.
    pub fn from_json(value: &Value) -> Result<CaseFile, serde_json::Error> {
        CaseFile::deserialize(value)
    }

    /// Marks the case file as opened beside an outcome the action already ended with (its
    /// snake_case word, e.g. `quota_exhausted`) and words the options for that: backstop holds
    /// nothing, so `wait` and `raise_quota` mean resubmitting, and `abort` leaves the outcome as
    /// it is. `remaining_wait_exceeds_deadline` is always worded so.
    pub fn beside_outcome(mut self, outcome: &str) -> CaseFile {
        self.ended_with = Some(sanitize_text(outcome).text);
        self.options = offered_options(&self);
        self
    }

    /// Whether the action ended before (beside) this escalation: backstop holds nothing for it.
    fn action_ended(&self) -> bool {
        self.ended_with.is_some() || self.reason == EscalationReason::RemainingWaitExceedsDeadline
    }

    /// The offered option for `option`, if it was offered.
    pub fn offered(&self, option: DecisionOption) -> Option<&OfferedOption> {
        self.options.iter().find(|o| o.option == option)
    }
}

fn is_quota_header(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    n == "retry-after"
        || n == "retry-after-ms"
        || n == "date"
        || n.contains("ratelimit")
        || n.contains("rate-limit")
        || n.contains("quota")
}

/// The options of a case file, each with its risk, by reason (SPEC §8):
///
/// - `side_effect_unknown`: `query_status` (when a reconciliation query or operation id
///   exists), `retry_same_key` (when the provider honours the key and there is one), `abort`,
///   `send_new` (needs confirmation).
/// - `remaining_wait_exceeds_deadline`: `wait`, `change_plan`, `abort`.
/// - `shared_quota_exhausted`: `wait`, `raise_quota`, `change_plan`, `abort`.
/// - `account_configuration`: `raise_quota`, `change_plan`, `wait`, `abort`.
///
/// When the action already ended beside the escalation (`remaining_wait_exceeds_deadline`, or
/// [`CaseFile::beside_outcome`]), `wait` and `raise_quota` say that backstop holds nothing and
/// the agent resubmits, and `abort` that the action keeps its outcome.
pub fn offered_options(case: &CaseFile) -> Vec<OfferedOption> {
    match case.reason {
        EscalationReason::SideEffectUnknown => side_effect_unknown_options(case),
        EscalationReason::RemainingWaitExceedsDeadline => {
            vec![wait_option(case), change_plan_option(), abort_option(case)]
        }
        EscalationReason::SharedQuotaExhausted => vec![
            wait_option(case),
            raise_quota_option(case),
            change_plan_option(),
            abort_option(case),
        ],
        EscalationReason::AccountConfiguration => vec![
            raise_quota_option(case),
            change_plan_option(),
            wait_option(case),
            abort_option(case),
        ],
    }
}

/// `option` with its `risk`; only `send_new` requires confirmation.
fn offer(option: DecisionOption, risk: String) -> OfferedOption {
    OfferedOption {
        option,
        risk,
        requires_confirmation: option == DecisionOption::SendNew,
    }
}

/// The options of a write whose side effect is unknown: `query_status` (with a reconciliation
/// query or operation id), `retry_same_key` (when the provider honours the key and there is
/// one), `abort`, `send_new`.
fn side_effect_unknown_options(case: &CaseFile) -> Vec<OfferedOption> {
    let mut options = Vec::new();
    if case.reconciliation_query.is_some() || case.provider_operation_id.is_some() {
        let how = case
            .reconciliation_query
            .as_deref()
            .unwrap_or("the provider's operation id");
        options.push(offer(
            DecisionOption::QueryStatus,
            format!(
                "Ask the provider whether the write happened ({how}). No side effect; \
                 if the operation is found the action ends `succeeded`, otherwise it \
                 comes back here."
            ),
        ));
    }
    if case.honours_key {
        if let Some(key) = &case.idempotency_key {
            options.push(offer(
                DecisionOption::RetrySameKey,
                format!(
                    "Send again with the same idempotency key `{key}`. The provider \
                     deduplicates it, so a write that already happened is not repeated, \
                     as long as the provider still remembers the key (often 24 hours)."
                ),
            ));
        }
    }
    options.push(abort_option(case));
    options.push(offer(
        DecisionOption::SendNew,
        "Send the request as a NEW operation with a new idempotency key. If the first \
         write did happen, this CREATES A SECOND SIDE EFFECT (a second payment, message \
         or deployment). Requires explicit confirmation: \
         `confirm_second_side_effect: true`."
            .to_owned(),
    ));
    options
}

/// `wait`: hold the action until the boundary, or, when the action already ended, resubmit it
/// once at the boundary; with the deadline that will be missed, if that is the reason.
fn wait_option(case: &CaseFile) -> OfferedOption {
    let deadline = match (case.budget.deadline, case.reason) {
        (Some(d), EscalationReason::RemainingWaitExceedsDeadline) => {
            format!(" The task deadline {d} will be missed.")
        }
        _ => String::new(),
    };
    let risk = if case.action_ended() {
        resubmit_risk(case, &deadline)
    } else {
        let until = match case.retry_not_before {
            Some(at) => format!("until {at}"),
            None => "until the provider's limit resets (the instant is not known)".to_owned(),
        };
        format!("Hold the action {until}, then send it; nothing is sent before then.{deadline}")
    };
    offer(DecisionOption::Wait, risk)
}

/// The risk of `wait` for an escalation opened beside an outcome that already ended the
/// action: backstop holds nothing, so waiting means the agent resubmits after the boundary.
fn resubmit_risk(case: &CaseFile, deadline: &str) -> String {
    let resubmit = if case.idempotency_key.is_some() {
        "Resubmit it with the same Idempotency-Key"
    } else {
        "Resubmit it"
    };
    // Once, at the boundary: "resubmit until …" would read as "keep resubmitting".
    let when = match case.retry_not_before {
        Some(at) => format!("once, at or after {at}"),
        None => "once, after the provider's limit resets (the instant is not known)".to_owned(),
    };
    format!(
        "The action has ended and backstop sends nothing more. {resubmit} {when}; \
         anything sent earlier meets the same limit.{deadline}"
    )
}

/// `abort`: send nothing more; what happens to a write already done or to an ended action.
fn abort_option(case: &CaseFile) -> OfferedOption {
    let risk = if case.reason == EscalationReason::SideEffectUnknown {
        "Stop here and send nothing more. If the first write did happen, it stays done and \
         nobody is told automatically: check with the provider."
    } else if case.action_ended() {
        "Close this escalation and send nothing more. The action keeps the outcome it ended \
         with; the work is not done."
    } else {
        "Stop here and send nothing more. The agent gets the outcome `escalated` with this \
         decision; the work is not done."
    };
    offer(DecisionOption::Abort, risk.to_owned())
}

/// `raise_quota`: raise the quota at the provider first; then resubmit (action ended) or the
/// action is sent once the quota allows it.
fn raise_quota_option(case: &CaseFile) -> OfferedOption {
    let risk = if case.action_ended() {
        "Raise the provider quota or plan for the scope at the provider first (may cost \
         money; backstop does not change it). The action has ended and backstop sends \
         nothing more: resubmit it once the quota is raised. Until then every request in the \
         scope meets the same exhausted quota."
    } else {
        "Raise the provider quota or plan for the scope first (may cost money). Until it is \
         raised, every task in the scope stays delayed; the action is sent once the quota \
         allows it."
    };
    offer(DecisionOption::RaiseQuota, risk.to_owned())
}

/// `change_plan`: nothing is sent; the agent submits changed work.
fn change_plan_option() -> OfferedOption {
    offer(
        DecisionOption::ChangePlan,
        "Change the plan: extend the deadline, reduce or reschedule the work, or move it to \
         another account. Nothing is sent for this action; the agent must submit the changed \
         work."
            .to_owned(),
    )
}

// ---------------------------------------------------------------------------------------------
// Sanitizer

/// Text after [`sanitize_text`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sanitized {
    /// The text with every credential-looking word replaced by [`REDACTED`].
    pub text: String,
    /// Whether anything was replaced.
    pub redacted: bool,
}

const SECRET_PREFIXES: [&str; 17] = [
    "sk-",
    "sk_",
    "rk_",
    "pk_live_",
    "whsec_",
    "ghp_",
    "gho_",
    "ghu_",
    "ghs_",
    "ghr_",
    "github_pat_",
    "glpat-",
    "xoxb-",
    "xoxp-",
    "xoxa-",
    "xapp-",
    "AIza",
];

const SECRET_ASSIGNMENTS: [&str; 16] = [
    "password",
    "passwd",
    "pwd",
    "pass",
    "passphrase",
    "cookie",
    "private_key",
    "privatekey",
    "secret",
    "token",
    "api_key",
    "apikey",
    "api-key",
    "access_key",
    "client_secret",
    "authorization",
];

/// Replaces credential-looking words in free text by [`REDACTED`]:
/// - the word after `Bearer` or `Authorization:` (and `Authorization: Bearer`), and base64
///   credentials after `Basic`. Backstop's own words there are kept, so its messages read
///   intact in logs: a placeholder in angle brackets (`Bearer <backstop token>`); `is`, `with`,
///   `or`, `and`; and a noun naming the credential (`token`, `header`, `value`, and their
///   plurals), after which the next word is redacted only when it looks like a token (a digit,
///   an upper-case letter or one of `-_.~+/=`, or 20 characters or more): `the bearer token
///   is empty` stays as it is, `bearer token tok-a1` becomes `bearer token [redacted]`;
/// - words starting with a provider key prefix (`sk-`, `sk_`, `rk_`, `whsec_`, `ghp_`,
///   `github_pat_`, `glpat-`, `xoxb-`, `AIza`, …), AWS access key ids (`AKIA`/`ASIA` + 16),
///   and JWTs (`eyJ…` with two dots);
/// - a PEM private-key block (`-----BEGIN RSA PRIVATE KEY-----` … `-----END RSA PRIVATE
///   KEY-----`), as a whole: markers, base64 lines and all;
/// - the password in a URL's userinfo (`https://user:[redacted]@host`);
/// - the value assigned to a secret-ish name (`password`, `passwd`, `pwd`, `pass`,
///   `passphrase`, `cookie`, `private_key`, `privatekey`, `secret`, `token`, `api_key`,
///   `apikey`, `api-key`, `access_key`, `client_secret`, `authorization`, also as
///   the end of a longer name such as `access_token`), in every usual spelling: `key=value`,
///   `key: value`, `key = value`, `"key": "value"` and `{"key":"value"}`. A quoted value is
///   redacted up to its closing quote, word by word.
///
/// Idempotency keys, UUIDs and route templates are left alone. Sanitizing is idempotent: text
/// that was already sanitized comes back unchanged (`Bearer [redacted]` stays as it is) and with
/// `redacted: false`.
///
/// ```
/// use backstop_core::escalation::sanitize_text;
/// let once = sanitize_text(r#"api_key: abcd1234efgh, {"password": "two words"}"#);
/// assert_eq!(once.text, r#"api_key: [redacted], {"password": "[redacted] [redacted]"}"#);
/// let twice = sanitize_text(&once.text);
/// assert_eq!((twice.text.as_str(), twice.redacted), (once.text.as_str(), false));
/// ```
pub fn sanitize_text(text: &str) -> Sanitized {
    let (text, mut redacted) = match redact_pem_private_keys(text) {
        Some(clean) => (std::borrow::Cow::Owned(clean), true),
        None => (std::borrow::Cow::Borrowed(text), false),
    };
    let mut out = String::with_capacity(text.len());
    let mut state = Pending::Nothing;
    let mut rest = &*text;
    while !rest.is_empty() {
        let ws_end = rest
            .find(|c: char| !c.is_whitespace())
            .unwrap_or(rest.len());
        out.push_str(&rest[..ws_end]);
        rest = &rest[ws_end..];
        if rest.is_empty() {
            break;
        }
        let word_end = rest.find(char::is_whitespace).unwrap_or(rest.len());
        let word = &rest[..word_end];
        rest = &rest[word_end..];
        let (clean, next) = sanitize_word(word, state);
        redacted |= clean != word;
        out.push_str(&clean);
        state = next;
    }
    Sanitized {
        text: out,
        redacted,
    }
}

/// `text` with every PEM private-key block (RFC 7468: `-----BEGIN … PRIVATE KEY-----`, the
/// base64 lines, `-----END … PRIVATE KEY-----`; any label ending in `PRIVATE KEY`, such as
/// `RSA`, `EC`, `ENCRYPTED` or `OPENSSH`) replaced as a whole by [`REDACTED`], or `None` when
/// it holds none. A block without its END line (text cut short) is redacted to the end of the
/// text. The lines may be separated by real line breaks or by escaped ones (`\n` in JSON
/// text): the block is found by its markers, not by words.
fn redact_pem_private_keys(text: &str) -> Option<String> {
    const BEGIN: &str = "-----BEGIN ";
    const END: &str = "-----END ";
    const DASHES: &str = "-----";
    // The end of the marker line starting at `at` (after its closing dashes) when its label
    // ends in `PRIVATE KEY`.
    let private_key_marker = |at: usize, open: &str| -> Option<usize> {
        let label_start = at + open.len();
        let label_len = text[label_start..].find(DASHES)?;
        let label = &text[label_start..label_start + label_len];
        (label.ends_with("PRIVATE KEY") && !label.contains(['\n', '\r']))
            .then_some(label_start + label_len + DASHES.len())
    };
    let mut out = String::new();
    let mut copied = 0;
    let mut search = 0;
    while let Some(found) = text[search..].find(BEGIN) {
        let begin = search + found;
        let Some(body_start) = private_key_marker(begin, BEGIN) else {
            search = begin + BEGIN.len();
            continue;
        };
        let mut end = text.len();
        let mut look = body_start;
        while let Some(found) = text[look..].find(END) {
            let at = look + found;
            if let Some(after) = private_key_marker(at, END) {
                end = after;
                break;
            }
            look = at + END.len();
        }
        out.push_str(&text[copied..begin]);
        out.push_str(REDACTED);
        copied = end;
        search = end;
    }
    if copied == 0 {
        return None;
    }
    out.push_str(&text[copied..]);
    Some(out)
}

/// Words naming the credential itself, which backstop's own messages put after `bearer` or
/// `Authorization` (`the bearer token is empty`, `the Authorization header is missing`): kept,
/// and the word after them is redacted when it looks like a token ([`looks_like_token`]).
const CREDENTIAL_NOUNS: [&str; 6] = ["token", "tokens", "header", "headers", "value", "values"];

/// Words of backstop's own messages that follow `bearer` or `Authorization` directly and are
/// never a credential (`` `Bearer` with no token after it ``, `` `Authorization` or ``,
/// `` `Authorization`: given more than once ``): kept. The list is short on purpose: any other
/// word there is redacted, since over-redaction is the safe side (`the bearer of bad news`
/// loses `of`).
const AFTER_KEYWORD_WORDS: [&str; 5] = ["is", "with", "or", "and", "given"];

/// Whether the word after a credential noun (`bearer token XYZ`) looks like a token rather than
/// prose: it holds a digit, an upper-case letter or one of `-_.~+/=`, or is 20 characters or
/// longer. An all-lower-case word shorter than that (`is`, `matches`) is prose.
fn looks_like_token(core: &str) -> bool {
    core.len() >= 20
        || core.bytes().any(|b| {
            b.is_ascii_digit()
                || b.is_ascii_uppercase()
                || matches!(b, b'-' | b'_' | b'.' | b'~' | b'+' | b'/' | b'=')
        })
}

/// What the previous word asks of the next one in [`sanitize_text`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pending {
    /// Nothing.
    Nothing,
    /// A token follows (`Bearer`, `Authorization:`).
    Token,
    /// A word naming the credential followed the keyword (`bearer token`, `Authorization
    /// header`): a token may still follow, and is redacted if it looks like one
    /// ([`looks_like_token`]).
    NamedToken,
    /// Base64 credentials may follow (`Basic`).
    Basic,
    /// A secret-ish name was given bare (`api_key`): `=`/`:` may follow.
    Separator,
    /// A value follows (`api_key:`, `"password":`, `token =`).
    Value,
    /// Inside a quoted value, closed by this quote character.
    Quoted(char),
}

/// One word of [`sanitize_text`] given what the previous word asked; returns the word to write
/// and what it asks of the next one.
fn sanitize_word(word: &str, state: Pending) -> (String, Pending) {
    // The word without surrounding quotes, brackets and separators; base64 padding, dots and
    // slashes stay (they belong to tokens).
    let core = word.trim_matches(|c: char| {
        !c.is_ascii_alphanumeric() && !matches!(c, '-' | '_' | '=' | '+' | '/' | '.' | '~')
    });
    match state {
        Pending::Quoted(quote) => return quoted_rest(word, quote),
        Pending::Value => return redact_value(word),
        Pending::Separator => {
            if word == "=" || word == ":" {
                return (word.to_owned(), Pending::Value);
            }
            if let Some(value) = word.strip_prefix(['=', ':']) {
                let (clean, next) = redact_value(value);
                return (format!("{}{clean}", &word[..1]), next);
            }
        }
        Pending::Token | Pending::NamedToken | Pending::Basic if word.contains(REDACTED) => {
            // Already redacted by an earlier pass.
            return (word.to_owned(), Pending::Nothing);
        }
        Pending::Token if core.is_empty() || core.eq_ignore_ascii_case("bearer") => {
            // `Authorization: Bearer xyz`: the token is still to come.
            return (word.to_owned(), Pending::Token);
        }
        Pending::Token
            if word
                .trim_start_matches(['`', '(', '"', '\''])
                .starts_with('<') =>
        {
            // A placeholder (`Bearer <backstop token>`), not a value.
            return (word.to_owned(), Pending::Nothing);
        }
        Pending::Token if CREDENTIAL_NOUNS.contains(&core.to_ascii_lowercase().as_str()) => {
            return (word.to_owned(), Pending::NamedToken);
        }
        Pending::Token if AFTER_KEYWORD_WORDS.contains(&core.to_ascii_lowercase().as_str()) => {
            return (word.to_owned(), Pending::Nothing);
        }
        Pending::Token => {
            return (replace_core(word, core), Pending::Nothing);
        }
        Pending::NamedToken if core.eq_ignore_ascii_case("bearer") => {
            // `Authorization header: Bearer xyz`: the token is still to come.
            return (word.to_owned(), Pending::Token);
        }
        Pending::NamedToken if looks_like_token(core) => {
            return (replace_core(word, core), Pending::Nothing);
        }
        Pending::NamedToken => {}
        Pending::Basic if looks_like_basic_credentials(core) => {
            return (replace_core(word, core), Pending::Nothing);
        }
        Pending::Nothing | Pending::Basic => {}
    }
    let lower = core.to_ascii_lowercase();
    if lower == "bearer" || lower == "authorization" {
        // `Bearer xyz`, `Authorization: xyz`, `Authorization: Bearer xyz`.
        return (word.to_owned(), Pending::Token);
    }
    if lower == "basic" {
        return (word.to_owned(), Pending::Basic);
    }
    if let Some(clean) = redact_url_password(word) {
        return (clean, Pending::Nothing);
    }
    if let Some(assigned) = redact_assignment(word) {
        return assigned;
    }
    if is_secret_name(word) {
        return (word.to_owned(), Pending::Separator);
    }
    if looks_like_secret(core) {
        return (replace_core(word, core), Pending::Nothing);
    }
    (word.to_owned(), Pending::Nothing)
}

/// `word` with the password of a URL's userinfo (`https://user:password@host`, RFC 3986
/// §3.2.1, which calls that form deprecated for this reason) redacted, or `None` when it holds
/// no such URL.
fn redact_url_password(word: &str) -> Option<String> {
    let scheme_end = word.find("://")? + 3;
    let authority_len = word[scheme_end..]
        .find(['/', '?', '#'])
        .unwrap_or(word.len() - scheme_end);
    let authority = &word[scheme_end..scheme_end + authority_len];
    let at = authority.rfind('@')?;
    let colon = authority[..at].find(':')?;
    let password = &authority[colon + 1..at];
    if password.is_empty() || password == REDACTED {
        return None;
    }
    let start = scheme_end + colon + 1;
    Some(format!(
        "{}{REDACTED}{}",
        &word[..start],
        &word[start + password.len()..]
    ))
}

/// Whether `name` (lower case) is a secret-ish name or ends in one after `_`/`-`/`.`
/// (`access_token`, `x-api-key`).
fn names_a_secret(name: &str) -> bool {
    SECRET_ASSIGNMENTS.iter().any(|secret| {
        name.strip_suffix(secret).is_some_and(|head| {
            head.is_empty() || head.ends_with(|c: char| !c.is_ascii_alphanumeric())
        })
    })
}

/// A bare secret-ish name, possibly quoted (`api_key`, `"password"`), with nothing after it.
fn is_secret_name(word: &str) -> bool {
    let name = word.trim_matches(|c: char| matches!(c, '"' | '\'' | '{' | ',' | '('));
    !name.is_empty() && names_a_secret(&name.to_ascii_lowercase())
}

/// The characters that end an unquoted value.
const VALUE_END: [char; 7] = [',', ';', '&', ')', '}', ']', '"'];

/// Redacts the value at the start of `word` (after a secret-ish name and its separator):
/// quoted (`"abc",`) up to the closing quote, which may lie in a later word; unquoted up to
/// [`VALUE_END`]. An empty `word` leaves the value to the next word.
fn redact_value(word: &str) -> (String, Pending) {
    if word.is_empty() {
        return (String::new(), Pending::Value);
    }
    if let Some(quote) = word.chars().next().filter(|c| matches!(c, '"' | '\'')) {
        let (clean, next) = quoted_rest(&word[1..], quote);
        return (format!("{quote}{clean}"), next);
    }
    if word.starts_with(REDACTED) {
        return (word.to_owned(), Pending::Nothing);
    }
    let end = word.find(VALUE_END).unwrap_or(word.len());
    if end == 0 {
        return (word.to_owned(), Pending::Nothing);
    }
    (format!("{REDACTED}{}", &word[end..]), Pending::Nothing)
}

/// The part of a quoted value in `word` up to the closing `quote` becomes [`REDACTED`] (what
/// follows the quote is kept); without a closing quote the value goes on in the next word.
fn quoted_rest(word: &str, quote: char) -> (String, Pending) {
    match word.find(quote) {
        Some(0) => (word.to_owned(), Pending::Nothing),
        Some(end) => (format!("{REDACTED}{}", &word[end..]), Pending::Nothing),
        None if word.is_empty() => (String::new(), Pending::Quoted(quote)),
        None => (REDACTED.to_owned(), Pending::Quoted(quote)),
    }
}

/// `Basic` credentials are base64 (RFC 7617): at least 8 characters of the base64 alphabet with
/// an upper-case letter, a digit or padding, so that prose like "basic plan" is left alone.
fn looks_like_basic_credentials(core: &str) -> bool {
    core.len() >= 8
        && core
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'='))
        && core
            .bytes()
            .any(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'=')
}

fn replace_core(word: &str, core: &str) -> String {
    word.replacen(core, REDACTED, 1)
}

/// A secret-ish name and its separator inside one word (`password=hunter2`, `api_key:`,
/// `{"token":"abc"}`): the word with the value redacted, and what the next word is (the value,
/// when the word ends at the separator; the rest of a quoted value).
fn redact_assignment(word: &str) -> Option<(String, Pending)> {
    let lower = word.to_ascii_lowercase();
    for (sep_at, _) in lower.match_indices(['=', ':']) {
        // The name before the separator, without a closing quote.
        let name_end = if lower[..sep_at].ends_with(['"', '\'']) {
            sep_at - 1
        } else {
            sep_at
        };
        let name_start = lower[..name_end]
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')))
            .map_or(0, |i| i + 1);
        if !names_a_secret(&lower[name_start..name_end]) || name_start == name_end {
            continue;
        }
        let (clean, next) = redact_value(&word[sep_at + 1..]);
        return Some((format!("{}{clean}", &word[..=sep_at]), next));
    }
    None
}

fn looks_like_secret(core: &str) -> bool {
    if core.len() < 8 {
        return false;
    }
    let starts_at_boundary = |prefix: &str| {
        core.match_indices(prefix)
            .any(|(i, _)| i == 0 || !core.as_bytes()[i - 1].is_ascii_alphanumeric())
            && core.len() >= prefix.len() + 6
    };
    if SECRET_PREFIXES.iter().any(|p| starts_at_boundary(p)) {
        return true;
    }
    let aws = |p: &str| {
        core.starts_with(p)
            && core.len() == 20
            && core[4..]
                .bytes()
                .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit())
    };
    if aws("AKIA") || aws("ASIA") {
        return true;
    }
    core.starts_with("eyJ") && core.matches('.').count() >= 2
}

/// Sanitizes every string in a JSON value (keys are kept), appending to `redactions` the JSON
/// path of each string that holds a redaction: one made now, or one made before (the text
/// already holds [`REDACTED`], e.g. a `desired_outcome` sanitized when it was received). So a
/// case file built from sanitized inputs still says where something was removed.
pub fn sanitize_value(value: &mut Value, path: &str, redactions: &mut Vec<String>) {
    match value {
        Value::String(s) => {
            let clean = sanitize_text(s);
            if clean.redacted || clean.text.contains(REDACTED) {
                *s = clean.text;
                redactions.push(if path.is_empty() {
                    "$".to_owned()
                } else {
                    path.to_owned()
                });
            }
        }
        Value::Array(items) => {
            for (i, item) in items.iter_mut().enumerate() {
                sanitize_value(item, &format!("{path}[{i}]"), redactions);
            }
        }
        Value::Object(map) => {
            for (key, item) in map.iter_mut() {
                let child = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                sanitize_value(item, &child, redactions);
            }
        }
        _ => {}
    }
}

// ---------------------------------------------------------------------------------------------
// Decisions

/// A person's decision on an escalation, as posted to `POST /v1/escalations/{id}/decision`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    /// The chosen option's wire name (`query_status`, `retry_same_key`, `abort`, `send_new`,
    /// `wait`, `raise_quota`, `change_plan`).
    pub option: String,
    /// Explicit confirmation that `send_new` may create a second side effect.
    #[serde(default)]
    pub confirm_second_side_effect: bool,
    /// A free-text note (sanitized, at most [`MAX_NOTE_CHARS`] characters).
    #[serde(default)]
    pub note: Option<String>,
}

/// What the engine must do after a valid decision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "effect", rename_all = "snake_case")]
pub enum DecisionEffect {
    /// Run the reconciliation lookup again.
    QueryStatus,
    /// Send again with the action's original key.
    RetrySameKey {
        /// The original key.
        idempotency_key: String,
    },
    /// End the action; nothing more is sent.
    Abort,
    /// Send as a new operation under a newly minted key; the second side effect was confirmed.
    SendNew,
    /// Hold the action until `until` (or the quota reset), then send.
    Wait {
        /// The instant to wait for, when known.
        until: Option<Timestamp>,
    },
    /// Hold the action until the quota was raised by the operator.
    RaiseQuota,
    /// Nothing is sent; the agent must submit changed work.
    ChangePlan,
}

impl DecisionEffect {
    /// The option this effect carries out.
    pub fn option(&self) -> DecisionOption {
        match self {
            DecisionEffect::QueryStatus => DecisionOption::QueryStatus,
            DecisionEffect::RetrySameKey { .. } => DecisionOption::RetrySameKey,
            DecisionEffect::Abort => DecisionOption::Abort,
            DecisionEffect::SendNew => DecisionOption::SendNew,
            DecisionEffect::Wait { .. } => DecisionOption::Wait,
            DecisionEffect::RaiseQuota => DecisionOption::RaiseQuota,
            DecisionEffect::ChangePlan => DecisionOption::ChangePlan,
        }
    }
}

/// Why a decision was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecisionError {
    /// The option word is not an option at all.
    #[error("option: `{option}` is not one of query_status, retry_same_key, abort, send_new, wait, raise_quota, change_plan")]
    UnknownOption {
        /// The word given (sanitized).
        option: String,
    },
    /// `reveal_payload` was posted as an action decision.
    #[error("option: `reveal_payload` is a separate access decision (POST /v1/escalations/{{id}}/reveal), not an action decision")]
    RevealIsSeparate,
    /// The option exists but this case file does not offer it.
    #[error("option: `{option}` is not offered for this escalation; offered: {offered}")]
    NotOffered {
        /// The option.
        option: DecisionOption,
        /// The offered options, comma-separated.
        offered: String,
    },
    /// `send_new` without `confirm_second_side_effect: true`.
    #[error("confirm_second_side_effect: `send_new` may create a second side effect (a second payment, message or deployment) and is refused without `confirm_second_side_effect: true`")]
    ConfirmationRequired,
    /// The note is too long.
    #[error("note: {chars} characters, at most {MAX_NOTE_CHARS} allowed")]
    NoteTooLong {
        /// Its length in characters.
        chars: usize,
    },
}

/// Validates a decision against a case file and says what the engine must do.
///
/// # Errors
/// [`DecisionError::UnknownOption`], [`DecisionError::RevealIsSeparate`],
/// [`DecisionError::NotOffered`] (the option exists but was not offered),
/// [`DecisionError::ConfirmationRequired`] (`send_new` without confirmation),
/// [`DecisionError::NoteTooLong`].
pub fn validate_decision(
    case: &CaseFile,
    decision: &Decision,
) -> Result<DecisionEffect, DecisionError> {
    let word = decision.option.trim();
    if word == REVEAL_PAYLOAD {
        return Err(DecisionError::RevealIsSeparate);
    }
    let Some(option) = DecisionOption::parse(word) else {
        return Err(DecisionError::UnknownOption {
            option: sanitize_text(word).text.chars().take(64).collect(),
        });
    };
    if let Some(note) = &decision.note {
        let chars = note.chars().count();
        if chars > MAX_NOTE_CHARS {
            return Err(DecisionError::NoteTooLong { chars });
        }
    }
    if case.offered(option).is_none() {
        return Err(DecisionError::NotOffered {
            option,
            offered: case
                .options
                .iter()
                .map(|o| o.option.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        });
    }
    Ok(match option {
        DecisionOption::QueryStatus => DecisionEffect::QueryStatus,
        DecisionOption::RetrySameKey => match &case.idempotency_key {
            Some(key) => DecisionEffect::RetrySameKey {
                idempotency_key: key.clone(),
            },
            None => {
                return Err(DecisionError::NotOffered {
                    option,
                    offered: "the case file has no idempotency key".to_owned(),
                })
            }
        },
        DecisionOption::Abort => DecisionEffect::Abort,
        DecisionOption::SendNew if !decision.confirm_second_side_effect => {
            return Err(DecisionError::ConfirmationRequired)
        }
        DecisionOption::SendNew => DecisionEffect::SendNew,
        DecisionOption::Wait => DecisionEffect::Wait {
            until: case.retry_not_before,
        },
        DecisionOption::RaiseQuota => DecisionEffect::RaiseQuota,
        DecisionOption::ChangePlan => DecisionEffect::ChangePlan,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quota_case_input() -> CaseInput {
        CaseInput {
            opened_at: "2026-01-01T00:00:00Z".parse().expect("instant"),
            reason: EscalationReason::SharedQuotaExhausted,
            reason_detail: "insufficient_quota".into(),
            action: CaseAction {
                task_id: "run-1".into(),
                method: "GET".into(),
                route: "/v1/orders".into(),
                request_class: "read".into(),
                payload_digest: "0".repeat(64),
            },
            provider: "llm".into(),
            ..CaseInput::default()
        }
    }

    fn quota_case(key: Option<&str>) -> CaseFile {
        CaseFile::build(CaseInput {
            idempotency_key: key.map(str::to_owned),
            retry_not_before: Some("2026-01-02T00:00:00Z".parse().expect("instant")),
            ..quota_case_input()
        })
        .expect("case file")
    }

    #[test]
    fn the_case_file_opens_at_the_millisecond_its_records_keep() {
        let case = CaseFile::build(CaseInput {
            opened_at: "2026-01-01T00:00:00.123456789Z".parse().expect("instant"),
            ..quota_case_input()
        })
        .expect("case file");
        assert_eq!(case.opened_at.to_string(), "2026-01-01T00:00:00.123Z");
        assert_eq!(
            serde_json::to_value(&case).expect("json")["opened_at"],
            "2026-01-01T00:00:00.123Z"
        );
    }

    #[test]
    fn sanitizing_twice_changes_nothing_more() {
        for text in [
            "Bearer tok-a1",
            "Authorization: Bearer tok-a1",
            "authorization: tok-a1 and Basic dXNlcjpwYXNz",
            "key sk-live-abc123def456ghi789 and password=hunter2",
            r#"{"api_key":"abcd1234efgh","note":"x"}"#,
            r#""password": "correct horse battery staple","#,
            "api_key: abcd1234efgh",
        ] {
            let once = sanitize_text(text);
            assert!(once.redacted, "{text}");
            let twice = sanitize_text(&once.text);
            assert_eq!(twice.text, once.text, "{text}");
            assert!(!twice.redacted, "{text} -> {}", twice.text);
        }
        assert_eq!(sanitize_text("Bearer tok-a1").text, "Bearer [redacted]");
        assert_eq!(
            sanitize_text("Authorization: Bearer tok-a1").text,
            "Authorization: Bearer [redacted]"
        );
    }

    #[test]
    fn a_case_file_built_from_sanitized_text_still_lists_the_redaction() {
        let received = sanitize_text("pay invoice 7 with key sk-live-abc123def456ghi789");
        assert!(received.redacted);
        let mut input = CaseInput {
            opened_at: "2026-01-01T00:00:00Z".parse().expect("instant"),
            desired_outcome: Some(received.text.clone()),
            action: CaseAction {
                method: "POST".into(),
                route: "/v1/transfers".into(),
                payload_digest: "0".repeat(64),
                ..CaseAction::default()
            },
            provider: "billing".into(),
            ..CaseInput::default()
        };
        let case = CaseFile::build(input.clone()).expect("case file");
        assert_eq!(case.redactions, ["desired_outcome"]);
        assert_eq!(case.desired_outcome, Some(received.text));
        input.desired_outcome = Some("pay invoice 7".into());
        assert!(CaseFile::build(input)
            .expect("case file")
            .redactions
            .is_empty());
    }

    #[test]
    fn backstops_own_words_after_bearer_or_authorization_read_intact() {
        for text in [
            "the bearer token is empty: the Authorization header is `Bearer` with no token after it (is the variable holding the backstop token unset or empty?)",
            "the Authorization header is missing; send `Authorization: Bearer <backstop token>`",
            "the bearer token matches no agent or operator of the policy",
            "the Authorization header is not a bearer token",
            "the Authorization header is given more than once, so the credentials are ambiguous; send exactly one",
            "header `Authorization`: given more than once, so the credentials are ambiguous; send exactly one",
        ] {
            let clean = sanitize_text(text);
            assert_eq!(clean.text, text);
            assert!(!clean.redacted, "{text}");
        }
        // A token after the keyword, or after a word naming it, is still redacted.
        for (text, expected) in [
            ("Bearer tok-a1", "Bearer [redacted]"),
            (
                "Authorization: Bearer agent-token-7f3a9c",
                "Authorization: Bearer [redacted]",
            ),
            ("bearer token tok-a1 here", "bearer token [redacted] here"),
            (
                "the Authorization header Bearer abcdefgh",
                "the Authorization header Bearer [redacted]",
            ),
            (
                "Authorization header: 3f9a0c77e1",
                "Authorization header: [redacted]",
            ),
            (
                "bearer token abcdefghijklmnopqrstuvwxyz",
                "bearer token [redacted]",
            ),
            ("Bearer token", "Bearer token"),
            ("Bearer with", "Bearer with"),
            ("Bearer mytoken", "Bearer [redacted]"),
        ] {
            assert_eq!(sanitize_text(text).text, expected, "{text}");
        }
    }

    #[test]
    fn a_pem_private_key_block_is_redacted_whole() {
        let body = "MIIEowIBAAKCAQEAq7BFUpkGp3+XQ\nZ9yBkN2Pq0Lw8c5sJQ1mXw==";
        for label in [
            "RSA PRIVATE KEY",
            "PRIVATE KEY",
            "ENCRYPTED PRIVATE KEY",
            "OPENSSH PRIVATE KEY",
        ] {
            let block = format!("-----BEGIN {label}-----\n{body}\n-----END {label}-----");
            let text = format!("the key was\n{block}\nand then it failed");
            let clean = sanitize_text(&text);
            assert_eq!(
                clean.text, "the key was\n[redacted]\nand then it failed",
                "{label}"
            );
            assert!(clean.redacted);
            // The same block with escaped line breaks, as inside JSON text.
            let escaped = format!("key: \"{}\" end", block.replace('\n', "\\n"));
            let clean = sanitize_text(&escaped);
            assert_eq!(clean.text, "key: \"[redacted]\" end", "{label}");
            assert!(!clean.text.contains("MIIE"), "{label}");
            // Idempotent.
            let again = sanitize_text(&clean.text);
            assert_eq!(
                (again.text.as_str(), again.redacted),
                (clean.text.as_str(), false)
            );
        }
        // Cut short before its END line: redacted to the end of the text.
        let cut = sanitize_text(&format!("x -----BEGIN EC PRIVATE KEY-----\n{body}"));
        assert_eq!(cut.text, "x [redacted]");
        // Two blocks, text between them kept.
        let two = sanitize_text(&format!(
            "-----BEGIN PRIVATE KEY-----\n{body}\n-----END PRIVATE KEY----- and -----BEGIN PRIVATE KEY-----\n{body}\n-----END PRIVATE KEY-----"
        ));
        assert_eq!(two.text, "[redacted] and [redacted]");
        // A certificate or public key is not a secret.
        let cert = format!("-----BEGIN CERTIFICATE-----\n{body}\n-----END CERTIFICATE-----");
        assert_eq!(sanitize_text(&cert).text, cert);
    }

    #[test]
    fn every_usual_spelling_of_a_secret_assignment_is_redacted() {
        for (text, expected) in [
            ("api_key: abcd1234efgh", "api_key: [redacted]"),
            ("api_key=abcd1234efgh", "api_key=[redacted]"),
            ("api_key = abcd1234efgh", "api_key = [redacted]"),
            ("API_KEY:abcd1234efgh", "API_KEY:[redacted]"),
            (r#""api_key": "abcd1234efgh""#, r#""api_key": "[redacted]""#),
            (
                r#"{"api_key":"abcd1234efgh"}"#,
                r#"{"api_key":"[redacted]"}"#,
            ),
            ("password: hunter2, then", "password: [redacted], then"),
            ("token = 'abc def' ok", "token = '[redacted] [redacted]' ok"),
            ("access_token: abc", "access_token: [redacted]"),
            ("x-api-key: abc", "x-api-key: [redacted]"),
            ("client_secret=abc;x=1", "client_secret=[redacted];x=1"),
            (
                "https://h/?a=1&apikey=abc",
                "https://h/?a=1&apikey=[redacted]",
            ),
            ("secret : abc", "secret : [redacted]"),
            (
                "https://admin:hunter2@db.internal/x",
                "https://admin:[redacted]@db.internal/x",
            ),
            ("pwd: hunter3", "pwd: [redacted]"),
            ("passphrase=hunter4", "passphrase=[redacted]"),
            ("Cookie: session=abc", "Cookie: [redacted]"),
            (r#""pass": "hunter5""#, r#""pass": "[redacted]""#),
            ("private_key=abc", "private_key=[redacted]"),
        ] {
            let clean = sanitize_text(text);
            assert_eq!(clean.text, expected, "{text}");
            assert!(clean.redacted, "{text}");
        }
        for text in [
            "the secret is out",
            "tokens: 5 left",
            "monkey: banana",
            "at 2026-01-01T00:00:00Z",
            "task_id: 42",
            "bypass: true",
            "compass: north",
            "https://user@host/x",
        ] {
            let clean = sanitize_text(text);
            assert_eq!(clean.text, text);
            assert!(!clean.redacted, "{text}");
        }
    }

    #[test]
    fn an_escalation_beside_an_ended_action_never_promises_a_later_send() {
        let held = quota_case(None);
        assert_eq!(held.ended_with, None);
        let risk = |case: &CaseFile, option| case.offered(option).expect("offered").risk.clone();
        assert!(risk(&held, DecisionOption::Wait).starts_with("Hold the action"));

        let ended = quota_case(None).beside_outcome("quota_exhausted");
        assert_eq!(ended.ended_with.as_deref(), Some("quota_exhausted"));
        let words: Vec<&str> = ended.options.iter().map(|o| o.option.as_str()).collect();
        assert_eq!(words, ["wait", "raise_quota", "change_plan", "abort"]);
        let wait = risk(&ended, DecisionOption::Wait);
        assert!(wait.contains("backstop sends nothing more"), "{wait}");
        assert!(
            wait.contains("Resubmit it once, at or after 2026-01-02T00:00:00Z"),
            "{wait}"
        );
        assert!(
            !wait.contains("Idempotency-Key"),
            "a read has no key: {wait}"
        );
        let raise = risk(&ended, DecisionOption::RaiseQuota);
        assert!(
            raise.contains("resubmit it once the quota is raised"),
            "{raise}"
        );
        assert!(!raise.contains("the action is sent"), "{raise}");
        let abort = risk(&ended, DecisionOption::Abort);
        assert!(abort.contains("keeps the outcome"), "{abort}");

        let write = quota_case(Some("k-1")).beside_outcome("quota_exhausted");
        assert!(risk(&write, DecisionOption::Wait).contains("same Idempotency-Key"));
        // Stored and read back with the mark.
        assert_eq!(CaseFile::from_json(&write.to_json()).expect("reads"), write);
    }
}
