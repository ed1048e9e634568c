//! # Run health diagnosis and retry-after debt (SPEC §10)
//!
//! ## Why
//! A run that got HTTP 429 and went quiet may be healthily yielding to the provider, retrying too
//! early, holding a wake that never fired, or already unable to finish before its deadline. Request
//! counts and process liveness cannot tell these apart; receipts can. A throttled run counts as
//! *waiting* only while four proofs hold:
//!
//! 1. **limit** — the provider's signal normalizes to a known `retry_not_before`
//!    (through [`crate::retry_after::normalize_value`], RFC 9110 §10.2.3);
//! 2. **wake** — a durable retry is scheduled at or after that boundary (and has not been missed);
//! 3. **authority** — the run still has an authorized attempt and wait budget left;
//! 4. **outcome** — `outcome_deadline − retry_not_before − completion_estimate` is not negative.
//!
//! Each proof is an `Option<bool>`: `None` when the snapshot does not let us evaluate it (never a
//! guess). When a proof fails, the operator gets a *different diagnosis* with one bounded action,
//! not a generic "retry".
//!
//! `retry_after_debt_ms` (`retry_not_before − throttled_at`, never negative, only for known
//! boundaries) measures the time deliberately yielded to provider backpressure. It is an
//! operational measure, not a score: it is always reported beside the diagnosis, and [`Totals`]
//! keep it broken down per run, per scope and per diagnosis.
//!
//! ## How
//! [`parse_snapshot`] reads one NDJSON line into a validated [`Snapshot`]; [`diagnose`] turns it into
//! a [`DiagnosisReport`] at a given `now` (this module never reads a clock); [`Totals::add`]
//! accumulates reports in memory bounded by the number of distinct runs, scopes and diagnoses —
//! never by the number of snapshots.
//!
//! ```
//! use backstop_core::diagnose::{diagnose, parse_snapshot, DiagnoseOptions, Diagnosis};
//!
//! let line = br#"{"run_id":"run-1","quota_scope":"llm/project:a","throttled_at":"2026-07-26T18:41:30Z",
//!   "status":429,"retry_after_raw":"60","scheduled_retry_at":"2026-07-26T18:42:30Z",
//!   "attempts_used":1,"max_attempts":4,"wait_budget_ms":120000,"wait_used_ms":0,
//!   "outcome_deadline":"2026-07-26T18:52:30Z","completion_estimate_ms":60000}"#;
//! let snapshot = parse_snapshot(line).unwrap();
//! let now = "2026-07-26T18:42:00Z".parse().unwrap();
//! let report = diagnose(&snapshot, now, &DiagnoseOptions::default());
//! assert_eq!(report.diagnosis, Diagnosis::WaitingBackpressure);
//! assert_eq!(report.retry_after_debt_ms, Some(60_000));
//! assert_eq!(report.headroom_ms, Some(540_000));
//! ```
//!
//! ## Decisions on the edges (each one is tested)
//! - **Order** (SPEC §10, first match wins): `recovered` / `retry_succeeded_unverified`, then
//!   `retry_budget_exhausted`, `deadline_exhausted`, `early_retry_loop`, `stuck_missed_wake` /
//!   `no_durable_wake`, `uncertain_boundary`, `waiting_backpressure`. The order is total: every
//!   snapshot gets exactly one diagnosis, and `waiting_backpressure` is returned only when all four
//!   proofs are `Some(true)`.
//! - **Recovered** needs `retry_status` in 200..=299 *and* `outcome_receipt.matches == true`. A 2xx
//!   without a receipt, or with `matches: false`, is `retry_succeeded_unverified`: a 200 is not the
//!   deliverable.
//! - **Authority, attempts**: `attempts_used` counts every attempt that has started, the throttled
//!   one and a retry in flight included. While the next retry is still pending (none started, or
//!   the last one finished without 2xx) one more attempt must be authorized:
//!   `attempts_used < max_attempts`. While a retry is in flight it was already authorized:
//!   `attempts_used <= max_attempts`.
//! - **Authority, wait**: "the remaining wait would exceed the wait budget" means
//!   `wait_used_ms + max(0, retry_not_before − now) > wait_budget_ms`. Once a retry has started
//!   there is no remaining wait (it is 0), so only `wait_used_ms > wait_budget_ms` counts. With an
//!   unknown boundary and no retry started, the remaining wait is unknown: the wait part is `None`
//!   unless `wait_used_ms` alone already exceeds the budget. Exactly at the budget is still inside.
//!   Cost budgets are not part of the snapshot and are not evaluated.
//! - **Outcome**: `headroom_ms = outcome_deadline − retry_not_before − completion_estimate_ms`
//!   (may be negative; `null` when the boundary or the deadline is unknown). A headroom of exactly
//!   0 still holds. A snapshot without `outcome_deadline` has no deadline to miss (SPEC §1: the
//!   deadline is optional): the outcome proof holds and `headroom_ms` is `null`.
//! - **Early retry**: `retry_started_at < retry_not_before`, strictly; a retry starting exactly at
//!   the boundary is on time.
//! - **Wake**: with no retry started, `scheduled_retry_at` absent means `no_durable_wake`; `now >
//!   scheduled_retry_at + wake_grace` (strictly greater: exactly at the grace edge is not stuck)
//!   means `stuck_missed_wake`; a wake scheduled *before* a known boundary is not a wake at or after
//!   the boundary, so it is `no_durable_wake` too (it would fire as an early retry). A retry that
//!   finished without 2xx consumed this snapshot's wake: a new throttle should arrive as a new
//!   snapshot, and until then this one is `no_durable_wake` (after the early-retry check, so an
//!   early retry that got 429 again is still `early_retry_loop`). The scheduler job id and heartbeat
//!   are carried as evidence but do not change the verdict.
//! - **Boundary**: an explicit `retry_not_before` wins over `retry_after_raw`; otherwise the raw
//!   value and `date_header` are normalized with `throttled_at` as the receive time. A missing or
//!   invalid value is an unknown boundary (`uncertain_boundary` once nothing above matched) with the
//!   reason kept; it never becomes a guessed boundary.
//! - **Debt** is `max(0, retry_not_before − throttled_at)` in milliseconds, `null` for an unknown
//!   boundary; totals add only known debts (saturating) and count known boundaries separately.
//!
//! ## Input validation
//! [`parse_snapshot`] rejects, with the field and the reason: malformed JSON, a missing required
//! field (`run_id`, `quota_scope`, `throttled_at`, `status`, `attempts_used`, `max_attempts`,
//! `wait_budget_ms`, `wait_used_ms`), a timestamp that is not RFC 3339, an empty `run_id` or
//! `quota_scope`, a status outside 100..=599, `retry_finished_at` without `retry_started_at` or
//! before it, `retry_status` without `retry_finished_at`, and an explicit `retry_not_before` earlier
//! than `throttled_at`. Unknown fields are ignored.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use serde::{Deserialize, Deserializer, Serialize};

use crate::retry_after::{normalize_value, Boundary, ClockSource, RetryAfterOptions};

/// Default `wake_grace`: how long past `scheduled_retry_at` a retry may take to start (30 s, SPEC §10).
pub const DEFAULT_WAKE_GRACE: Duration = Duration::from_secs(30);

/// One throttled action as seen by the operator: one JSON object per NDJSON line (SPEC §10).
///
/// Times are RFC 3339 (`2026-07-26T18:42:00Z`); durations are milliseconds. Fields not listed
/// here are ignored. Optional fields may be absent or `null`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    /// The task (run) the throttled action belongs to. Required, non-empty.
    pub run_id: String,
    /// The quota scope the provider's limit applies to (e.g. `billing-api/account:ops-team`).
    /// Required, non-empty.
    pub quota_scope: String,
    /// When the throttling response was received (the local receive time). Required.
    pub throttled_at: Timestamp,
    /// HTTP status of the throttling response (usually 429; 100..=599). Required.
    pub status: u16,
    /// The raw `Retry-After` value as received, or `null` when the response had none.
    #[serde(default)]
    pub retry_after_raw: Option<String>,
    /// The raw `Date` header of the same response, or `null`.
    #[serde(default)]
    pub date_header: Option<String>,
    /// The normalized boundary, when the producer already computed it; wins over
    /// `retry_after_raw`. Must not be earlier than `throttled_at`.
    #[serde(default)]
    pub retry_not_before: Option<Timestamp>,
    /// Scheduler receipt: when the durable retry is scheduled, or `null` when none is.
    #[serde(default)]
    pub scheduled_retry_at: Option<Timestamp>,
    /// Scheduler receipt: the job id of the durable retry (evidence only).
    #[serde(default)]
    pub scheduler_job_id: Option<String>,
    /// Scheduler receipt: the last confirmed scheduler heartbeat (evidence only).
    #[serde(default)]
    pub scheduler_heartbeat_at: Option<Timestamp>,
    /// Attempt receipt: when the retry actually started, or `null`.
    #[serde(default)]
    pub retry_started_at: Option<Timestamp>,
    /// Attempt receipt: when the retry's response arrived, or `null`. Requires `retry_started_at`.
    #[serde(default)]
    pub retry_finished_at: Option<Timestamp>,
    /// HTTP status of the retry's response, or `null`. Requires `retry_finished_at`.
    #[serde(default)]
    pub retry_status: Option<u16>,
    /// Attempts started so far, the throttled one and any retry in flight included. Required.
    pub attempts_used: u32,
    /// Attempts the run's budget authorizes for this action. Required.
    pub max_attempts: u32,
    /// Wait budget of the action, in milliseconds. Required.
    pub wait_budget_ms: u64,
    /// Time already waited, in milliseconds. Required.
    pub wait_used_ms: u64,
    /// The instant by which the intended outcome must be delivered and verified, or `null` for a
    /// run without a deadline.
    #[serde(default)]
    pub outcome_deadline: Option<Timestamp>,
    /// Time needed after the boundary to complete and verify the work, in milliseconds
    /// (absent or `null` → 0).
    #[serde(default, deserialize_with = "null_as_zero")]
    pub completion_estimate_ms: u64,
    /// Outcome receipt: whether the intended result was verified, or `null` when none exists.
    #[serde(default)]
    pub outcome_receipt: Option<OutcomeReceipt>,
}

/// An outcome receipt: a durable record that the intended result was checked (SPEC §1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutcomeReceipt {
    /// `true` when the receipt matches the original run and its expected deliverable.
    pub matches: bool,
}

fn null_as_zero<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    Ok(Option::<u64>::deserialize(deserializer)?.unwrap_or(0))
}

/// Why a snapshot line was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotError {
    /// The line is not a JSON object of the snapshot shape (malformed JSON, a missing required
    /// field, a wrong type, a timestamp that is not RFC 3339). `path` names the offending field
    /// when it is known (empty for the whole line, which is then not named). Displayed as
    /// `path: reason`, or `reason` alone for the whole line.
    #[error("{}{reason}", if path.is_empty() { String::new() } else { format!("{path}: ") })]
    Malformed {
        /// The JSON path of the offending field, e.g. `throttled_at`; empty for the whole line.
        path: String,
        /// What was wrong, from the JSON parser, with the position as `at column N` of the line
        /// (no position for a missing field: the parser can only point at the object's end).
        reason: String,
    },
    /// The snapshot parsed but contradicts itself.
    #[error("{field}: {reason}")]
    Invalid {
        /// The offending field.
        field: &'static str,
        /// Why it is rejected.
        reason: String,
    },
}

impl Snapshot {
    /// Checks the snapshot against the diagnosis instant: a snapshot cannot have been throttled
    /// after `now` (a clock mix-up or a wrong `--now`; its wait and debt would be meaningless).
    ///
    /// # Errors
    /// [`SnapshotError::Invalid`] naming `throttled_at` when it is after `now`.
    pub fn check_at(&self, now: Timestamp) -> Result<(), SnapshotError> {
        if self.throttled_at > now {
            return Err(SnapshotError::Invalid {
                field: "throttled_at",
                reason: format!("{} is after now ({now})", self.throttled_at),
            });
        }
        Ok(())
    }
}

/// Parses and validates one NDJSON line (without its line terminator; surrounding whitespace is
/// allowed) into a [`Snapshot`].
///
/// # Errors
/// [`SnapshotError::Malformed`] for bytes that are not a snapshot-shaped JSON object (the path of
/// the offending field is named when it can be); [`SnapshotError::Invalid`] for the consistency
/// rules listed in the module docs.
pub fn parse_snapshot(line: &[u8]) -> Result<Snapshot, SnapshotError> {
    // One UTF-8 check of the whole line lets the parser skip checking each string on its own; a
    // line that is not UTF-8 goes through the byte parser, which names where it breaks.
    let parsed = match std::str::from_utf8(line) {
        Ok(text) => serde_json::from_str(text),
        Err(_) => serde_json::from_slice(line),
    };
    let snapshot: Snapshot = match parsed {
        Ok(snapshot) => snapshot,
        Err(err) => return Err(locate_error(line, err)),
    };
    snapshot.validate()?;
    Ok(snapshot)
}

/// Re-parses a failing line with path tracking, only on the error path, so the happy path pays
/// nothing for naming the offending field.
fn locate_error(line: &[u8], fallback: serde_json::Error) -> SnapshotError {
    let mut de = serde_json::Deserializer::from_slice(line);
    let (path, err) = match serde_path_to_error::deserialize::<_, Snapshot>(&mut de) {
        Err(err) => {
            let path = err.path().to_string();
            (path, err.into_inner())
        }
        Ok(_) => (String::new(), fallback),
    };
    SnapshotError::Malformed {
        // serde_path_to_error names the root `.`: the whole line needs no name.
        path: if path == "." { String::new() } else { path },
        reason: json_reason(&err),
    }
}

/// The parser's message for one NDJSON line: serde_json says `at line 1 column N` of the line it
/// was given, which reads like a line of the file; this says `at column N`, and nothing for a
/// missing field (the parser can only point at the end of the object).
fn json_reason(err: &serde_json::Error) -> String {
    let full = err.to_string();
    let position = format!(" at line {} column {}", err.line(), err.column());
    let message = full.strip_suffix(&position).unwrap_or(&full);
    // The parser's words ("expected ident") name a token, not the problem: say first that the
    // line is not JSON at all, where that is what went wrong.
    let kind = match err.classify() {
        serde_json::error::Category::Syntax => "not valid JSON: ",
        serde_json::error::Category::Eof => "not valid JSON (it ends too early): ",
        serde_json::error::Category::Data | serde_json::error::Category::Io => "",
    };
    if err.line() == 0 || message.starts_with("missing field") {
        format!("{kind}{message}")
    } else {
        format!("{kind}{message} at column {}", err.column())
    }
}

fn invalid(field: &'static str, reason: impl Into<String>) -> SnapshotError {
    SnapshotError::Invalid {
        field,
        reason: reason.into(),
    }
}

impl Snapshot {
    /// Checks the consistency rules of the module docs.
    ///
    /// # Errors
    /// [`SnapshotError::Invalid`] naming the first offending field.
    pub fn validate(&self) -> Result<(), SnapshotError> {
        if self.run_id.trim().is_empty() {
            return Err(invalid("run_id", "must not be empty"));
        }
        if self.quota_scope.trim().is_empty() {
            return Err(invalid("quota_scope", "must not be empty"));
        }
        if !(100..=599).contains(&self.status) {
            return Err(invalid(
                "status",
                format!("{} is not an HTTP status (100..=599)", self.status),
            ));
        }
        if let Some(status) = self.retry_status {
            if !(100..=599).contains(&status) {
                return Err(invalid(
                    "retry_status",
                    format!("{status} is not an HTTP status (100..=599)"),
                ));
            }
            if self.retry_finished_at.is_none() {
                return Err(invalid("retry_status", "present without retry_finished_at"));
            }
        }
        if let Some(finished) = self.retry_finished_at {
            match self.retry_started_at {
                None => {
                    return Err(invalid(
                        "retry_finished_at",
                        "present without retry_started_at",
                    ))
                }
                Some(started) if finished < started => {
                    return Err(invalid(
                        "retry_finished_at",
                        format!("{finished} is before retry_started_at {started}"),
                    ))
                }
                Some(_) => {}
            }
        }
        if let Some(rnb) = self.retry_not_before {
            if rnb < self.throttled_at {
                return Err(invalid(
                    "retry_not_before",
                    format!("{rnb} is before throttled_at {}", self.throttled_at),
                ));
            }
        }
        Ok(())
    }

    /// The boundary of this snapshot: the explicit `retry_not_before` when present, else
    /// `retry_after_raw` (+ `date_header`) normalized with `throttled_at` as the receive time
    /// (SPEC §2.2), else unknown ("no Retry-After").
    pub fn boundary(&self, retry_after: &RetryAfterOptions) -> Boundary {
        if let Some(rnb) = self.retry_not_before {
            let delay_ms = millis_between(self.throttled_at, rnb).max(0);
            return Boundary::Known {
                retry_not_before: rnb,
                delay_ms: u64::try_from(delay_ms).unwrap_or(0),
                source: "retry_not_before".to_string(),
                raw: self.retry_after_raw.clone(),
                clock: None,
                reason: None,
            };
        }
        match &self.retry_after_raw {
            Some(raw) => normalize_value(
                raw,
                self.date_header.as_deref(),
                self.throttled_at,
                retry_after,
            ),
            None => Boundary::Unknown {
                raw: None,
                reason: "no Retry-After in the snapshot".to_string(),
                source: None,
            },
        }
    }
}

/// Options of [`diagnose`].
#[derive(Debug, Clone, Default)]
pub struct DiagnoseOptions {
    /// How long past `scheduled_retry_at` a retry may take to start before the wake counts as
    /// missed. Default [`DEFAULT_WAKE_GRACE`] (30 s).
    pub wake_grace: WakeGrace,
    /// Retry-After normalization options used when the boundary is derived from
    /// `retry_after_raw` (min delay 1 s, ceiling 24 h by default).
    pub retry_after: RetryAfterOptions,
}

/// The wake grace as a duration (newtype so that its default is the SPEC's 30 s).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WakeGrace(pub Duration);

impl Default for WakeGrace {
    fn default() -> Self {
        WakeGrace(DEFAULT_WAKE_GRACE)
    }
}

/// The diagnosis of one snapshot (SPEC §10). Serialized in snake_case; the declaration order is
/// the order in which states are checked (and the order of totals).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Diagnosis {
    /// A retry finished with 2xx and a matching outcome receipt exists.
    Recovered,
    /// A retry finished with 2xx but no matching outcome receipt exists.
    RetrySucceededUnverified,
    /// No authorized attempt is left, or the remaining wait would exceed the wait budget.
    RetryBudgetExhausted,
    /// The boundary plus the completion estimate lands after the outcome deadline.
    DeadlineExhausted,
    /// A retry started before the provider's boundary.
    EarlyRetryLoop,
    /// The scheduled retry time plus the wake grace has passed and no retry started.
    StuckMissedWake,
    /// No durable retry is scheduled at or after the boundary.
    NoDurableWake,
    /// The provider's boundary is unknown (missing or invalid Retry-After).
    UncertainBoundary,
    /// All four proofs hold: the run is healthily yielding to provider backpressure.
    WaitingBackpressure,
}

impl Diagnosis {
    /// Every diagnosis, in check order.
    pub const ALL: [Diagnosis; 9] = [
        Diagnosis::Recovered,
        Diagnosis::RetrySucceededUnverified,
        Diagnosis::RetryBudgetExhausted,
        Diagnosis::DeadlineExhausted,
        Diagnosis::EarlyRetryLoop,
        Diagnosis::StuckMissedWake,
        Diagnosis::NoDurableWake,
        Diagnosis::UncertainBoundary,
        Diagnosis::WaitingBackpressure,
    ];

    /// The stable snake_case name (`waiting_backpressure`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            Diagnosis::Recovered => "recovered",
            Diagnosis::RetrySucceededUnverified => "retry_succeeded_unverified",
            Diagnosis::RetryBudgetExhausted => "retry_budget_exhausted",
            Diagnosis::DeadlineExhausted => "deadline_exhausted",
            Diagnosis::EarlyRetryLoop => "early_retry_loop",
            Diagnosis::StuckMissedWake => "stuck_missed_wake",
            Diagnosis::NoDurableWake => "no_durable_wake",
            Diagnosis::UncertainBoundary => "uncertain_boundary",
            Diagnosis::WaitingBackpressure => "waiting_backpressure",
        }
    }

    /// The one bounded action for this diagnosis (SPEC §10).
    pub fn action(self) -> Action {
        match self {
            Diagnosis::Recovered | Diagnosis::RetrySucceededUnverified => Action::VerifyOutcome,
            Diagnosis::RetryBudgetExhausted => Action::StopAndHandOverEvidence,
            Diagnosis::DeadlineExhausted => Action::TellOwnerDeadline,
            Diagnosis::EarlyRetryLoop => Action::StopRetryPath,
            Diagnosis::StuckMissedWake | Diagnosis::NoDurableWake => Action::SchedulerCheckRearm,
            Diagnosis::UncertainBoundary => Action::CollectEvidence,
            Diagnosis::WaitingBackpressure => Action::LeaveAloneCheckWake,
        }
    }
}

impl fmt::Display for Diagnosis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A bounded operator action (SPEC §10's list). Serialized as its stable snake_case id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// `leave_alone_check_wake` — for `waiting_backpressure`.
    LeaveAloneCheckWake,
    /// `stop_retry_path` — for `early_retry_loop`.
    StopRetryPath,
    /// `scheduler_check_rearm` — for `stuck_missed_wake` and `no_durable_wake`.
    SchedulerCheckRearm,
    /// `tell_owner_deadline` — for `deadline_exhausted`.
    TellOwnerDeadline,
    /// `stop_and_hand_over_evidence` — for `retry_budget_exhausted`.
    StopAndHandOverEvidence,
    /// `verify_outcome` — for `recovered` and `retry_succeeded_unverified`.
    VerifyOutcome,
    /// `collect_evidence` — for `uncertain_boundary`.
    CollectEvidence,
}

impl Action {
    /// The stable snake_case id.
    pub fn id(self) -> &'static str {
        match self {
            Action::LeaveAloneCheckWake => "leave_alone_check_wake",
            Action::StopRetryPath => "stop_retry_path",
            Action::SchedulerCheckRearm => "scheduler_check_rearm",
            Action::TellOwnerDeadline => "tell_owner_deadline",
            Action::StopAndHandOverEvidence => "stop_and_hand_over_evidence",
            Action::VerifyOutcome => "verify_outcome",
            Action::CollectEvidence => "collect_evidence",
        }
    }

    /// One sentence telling the operator what to do.
    pub fn text(self) -> &'static str {
        match self {
            Action::LeaveAloneCheckWake => {
                "Leave the run alone and check that its durable wake still exists."
            }
            Action::StopRetryPath => {
                "Stop the retry path, keep the provider's last boundary and look for layered retries multiplying requests."
            }
            Action::SchedulerCheckRearm => {
                "Run a scheduler check and re-arm the retry at or after the boundary, only within the original authority and attempt budget."
            }
            Action::TellOwnerDeadline => {
                "Tell the owner the intended outcome cannot meet its deadline; do not hide the conflict behind a longer wait."
            }
            Action::StopAndHandOverEvidence => {
                "Stop and hand over the final provider evidence; a larger budget is a human policy decision."
            }
            Action::VerifyOutcome => {
                "Verify the intended outcome against the original run before closing the incident."
            }
            Action::CollectEvidence => {
                "Report the uncertainty and collect evidence; do not guess that the run is healthy or broken."
            }
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.id())
    }
}

/// The four proofs of SPEC §10: `Some(true)` holds, `Some(false)` fails, `None` cannot be
/// evaluated from the snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Proofs {
    /// The provider's signal normalizes to a known `retry_not_before` (always evaluable).
    pub limit: Option<bool>,
    /// A durable retry is scheduled at or after the boundary and has not been missed (or the retry
    /// started at or after it).
    pub wake: Option<bool>,
    /// An authorized attempt and wait budget remain.
    pub authority: Option<bool>,
    /// The headroom is not negative (or there is no deadline).
    pub outcome: Option<bool>,
}

impl Proofs {
    /// `true` when all four proofs are `Some(true)`.
    pub fn all_hold(&self) -> bool {
        [self.limit, self.wake, self.authority, self.outcome]
            .iter()
            .all(|p| *p == Some(true))
    }
}

/// The result of diagnosing one snapshot.
///
/// Serialized as `{"run_id", "quota_scope", "diagnosis", "action", "action_text",
/// "retry_not_before", "boundary_source", "boundary_clock", "boundary_reason", "headroom_ms",
/// "retry_after_debt_ms", "proofs": {"limit", "wake", "authority", "outcome"}}`; unknown values
/// are `null`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DiagnosisReport {
    /// The snapshot's run.
    pub run_id: String,
    /// The snapshot's quota scope.
    pub quota_scope: String,
    /// The diagnosis.
    pub diagnosis: Diagnosis,
    /// The bounded action (its id when serialized).
    pub action: Action,
    /// The action as one sentence.
    pub action_text: &'static str,
    /// The boundary, when known.
    pub retry_not_before: Option<Timestamp>,
    /// Where the boundary came from (`retry_not_before`, `Retry-After`, …), when known.
    pub boundary_source: Option<String>,
    /// Which clock an HTTP-date boundary was measured against (`server_date` or `local`).
    pub boundary_clock: Option<ClockSource>,
    /// Why the boundary is unknown (or a note on how it was adjusted), when there is one.
    pub boundary_reason: Option<String>,
    /// `outcome_deadline − retry_not_before − completion_estimate_ms` in milliseconds; may be
    /// negative; `None` when the boundary or the deadline is unknown.
    pub headroom_ms: Option<i64>,
    /// `max(0, retry_not_before − throttled_at)` in milliseconds; `None` for an unknown boundary.
    pub retry_after_debt_ms: Option<u64>,
    /// The four proofs.
    pub proofs: Proofs,
}

/// Milliseconds from `from` to `to` (negative when `to` is earlier), saturated to `i64`.
fn millis_between(from: Timestamp, to: Timestamp) -> i64 {
    let ms = to.duration_since(from).as_millis();
    i64::try_from(ms).unwrap_or(if ms < 0 { i64::MIN } else { i64::MAX })
}

/// Where the retry of a snapshot stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RetryState {
    /// No retry has started.
    Pending,
    /// A retry started and has not finished.
    InFlight(Timestamp),
    /// A retry finished with this status.
    Finished(Timestamp, u16),
}

fn retry_state(s: &Snapshot) -> RetryState {
    match (s.retry_started_at, s.retry_status) {
        (None, _) => RetryState::Pending,
        (Some(started), Some(status)) => RetryState::Finished(started, status),
        // Finished without a status recorded: treated as not 2xx (nothing proves success).
        (Some(started), None) if s.retry_finished_at.is_some() => RetryState::Finished(started, 0),
        (Some(started), None) => RetryState::InFlight(started),
    }
}

fn is_2xx(status: u16) -> bool {
    (200..=299).contains(&status)
}

/// Three-valued AND: `Some(false)` wins, then `None`, else `Some(true)`.
fn and3(a: Option<bool>, b: Option<bool>) -> Option<bool> {
    match (a, b) {
        (Some(false), _) | (_, Some(false)) => Some(false),
        (Some(true), Some(true)) => Some(true),
        _ => None,
    }
}

/// Diagnoses one snapshot at `now` (SPEC §10). Pure: `now` is given, nothing is read.
///
/// Returns the diagnosis (first match in the SPEC's order), its bounded action, the four proofs,
/// `headroom_ms` and `retry_after_debt_ms`. The edge-case decisions are listed in the module docs.
pub fn diagnose(snapshot: &Snapshot, now: Timestamp, opts: &DiagnoseOptions) -> DiagnosisReport {
    let mut report = evaluate(snapshot, now, opts);
    report.run_id.clone_from(&snapshot.run_id);
    report.quota_scope.clone_from(&snapshot.quota_scope);
    report
}

/// [`diagnose`], consuming the snapshot so its `run_id` and `quota_scope` move into the report
/// instead of being copied (the streaming path of `backstop diagnose`).
pub fn diagnose_owned(
    snapshot: Snapshot,
    now: Timestamp,
    opts: &DiagnoseOptions,
) -> DiagnosisReport {
    let mut report = evaluate(&snapshot, now, opts);
    report.run_id = snapshot.run_id;
    report.quota_scope = snapshot.quota_scope;
    report
}

/// Everything of the report but the run and scope names (left empty for the callers to fill).
fn evaluate(snapshot: &Snapshot, now: Timestamp, opts: &DiagnoseOptions) -> DiagnosisReport {
    let boundary = snapshot.boundary(&opts.retry_after);
    let rnb = boundary.retry_not_before();
    let (boundary_source, boundary_clock, boundary_reason) = match boundary {
        Boundary::Known {
            source,
            clock,
            reason,
            ..
        } => (Some(source), clock, reason),
        Boundary::Unknown { reason, source, .. } => (source, None, Some(reason)),
    };
    let retry = retry_state(snapshot);
    let grace = SignedDuration::try_from(opts.wake_grace.0).unwrap_or(SignedDuration::MAX);

    let debt_ms = rnb.map(|rnb| {
        millis_between(snapshot.throttled_at, rnb)
            .max(0)
            .unsigned_abs()
    });
    let headroom_ms = match (snapshot.outcome_deadline, rnb) {
        (Some(deadline), Some(rnb)) => {
            let completion = i64::try_from(snapshot.completion_estimate_ms).unwrap_or(i64::MAX);
            Some(millis_between(rnb, deadline).saturating_sub(completion))
        }
        _ => None,
    };

    // Proof 1: limit.
    let limit = Some(rnb.is_some());

    // Proof 2: wake.
    let missed = |scheduled: Timestamp| now.duration_since(scheduled) > grace;
    let wake = match retry {
        RetryState::Pending => match snapshot.scheduled_retry_at {
            None => Some(false),
            Some(scheduled) if missed(scheduled) => Some(false),
            Some(scheduled) => rnb.map(|rnb| scheduled >= rnb),
        },
        RetryState::InFlight(started) => rnb.map(|rnb| started >= rnb),
        RetryState::Finished(started, status) if is_2xx(status) => rnb.map(|rnb| started >= rnb),
        RetryState::Finished(..) => Some(false),
    };

    // Proof 3: authority (attempts and wait).
    let attempts_ok = match retry {
        RetryState::InFlight(_) => snapshot.attempts_used <= snapshot.max_attempts,
        _ => snapshot.attempts_used < snapshot.max_attempts,
    };
    let remaining_wait_ms: Option<u64> = match retry {
        RetryState::Pending => rnb.map(|rnb| millis_between(now, rnb).max(0).unsigned_abs()),
        _ => Some(0),
    };
    let wait_ok = if snapshot.wait_used_ms > snapshot.wait_budget_ms {
        Some(false)
    } else {
        remaining_wait_ms.map(|remaining| {
            snapshot.wait_used_ms.saturating_add(remaining) <= snapshot.wait_budget_ms
        })
    };
    let authority = and3(Some(attempts_ok), wait_ok);

    // Proof 4: outcome.
    let outcome = match (snapshot.outcome_deadline, headroom_ms) {
        (None, _) => Some(true),
        (Some(_), Some(headroom)) => Some(headroom >= 0),
        (Some(_), None) => None,
    };

    let proofs = Proofs {
        limit,
        wake,
        authority,
        outcome,
    };

    let diagnosis = decide(snapshot, now, grace, rnb, retry, &proofs);
    debug_assert!(diagnosis != Diagnosis::WaitingBackpressure || proofs.all_hold());
    let action = diagnosis.action();
    DiagnosisReport {
        run_id: String::new(),
        quota_scope: String::new(),
        diagnosis,
        action,
        action_text: action.text(),
        retry_not_before: rnb,
        boundary_source,
        boundary_clock,
        boundary_reason,
        headroom_ms,
        retry_after_debt_ms: debt_ms,
        proofs,
    }
}

/// The ordered checks of SPEC §10; first match wins.
fn decide(
    snapshot: &Snapshot,
    now: Timestamp,
    grace: SignedDuration,
    rnb: Option<Timestamp>,
    retry: RetryState,
    proofs: &Proofs,
) -> Diagnosis {
    // 1. recovered / retry_succeeded_unverified.
    if let RetryState::Finished(_, status) = retry {
        if is_2xx(status) {
            return match snapshot.outcome_receipt {
                Some(OutcomeReceipt { matches: true }) => Diagnosis::Recovered,
                _ => Diagnosis::RetrySucceededUnverified,
            };
        }
    }
    // 2. retry_budget_exhausted.
    if proofs.authority == Some(false) {
        return Diagnosis::RetryBudgetExhausted;
    }
    // 3. deadline_exhausted.
    if proofs.outcome == Some(false) {
        return Diagnosis::DeadlineExhausted;
    }
    // 4. early_retry_loop.
    if let (Some(started), Some(rnb)) = (snapshot.retry_started_at, rnb) {
        if started < rnb {
            return Diagnosis::EarlyRetryLoop;
        }
    }
    // 5. stuck_missed_wake / no_durable_wake.
    match retry {
        RetryState::Pending => match snapshot.scheduled_retry_at {
            None => return Diagnosis::NoDurableWake,
            Some(scheduled) if now.duration_since(scheduled) > grace => {
                return Diagnosis::StuckMissedWake
            }
            Some(_) => {}
        },
        // The retry finished without 2xx (2xx returned above): this snapshot's wake is spent.
        RetryState::Finished(..) => return Diagnosis::NoDurableWake,
        RetryState::InFlight(_) => {}
    }
    // 6. uncertain_boundary.
    let Some(rnb) = rnb else {
        return Diagnosis::UncertainBoundary;
    };
    // A pending wake scheduled before the boundary is no wake at or after it.
    if let (RetryState::Pending, Some(scheduled)) = (retry, snapshot.scheduled_retry_at) {
        if scheduled < rnb {
            return Diagnosis::NoDurableWake;
        }
    }
    // 7. waiting_backpressure: with a known boundary every proof is evaluable and none failed.
    Diagnosis::WaitingBackpressure
}

/// Counts and debt of one group (a run or a scope), broken down by diagnosis.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct GroupTotals {
    /// Snapshots in the group.
    pub snapshots: u64,
    /// Snapshots with a known boundary (the ones whose debt is counted).
    pub known_boundaries: u64,
    /// Sum of `retry_after_debt_ms` over known boundaries (saturating).
    pub retry_after_debt_ms: u64,
    /// Snapshots per diagnosis.
    pub by_diagnosis: DiagnosisCounts,
}

/// Snapshot counts per diagnosis: a fixed array (no allocation per group), serialized as a map
/// `{diagnosis: count}` of the non-zero entries in check order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DiagnosisCounts([u64; Diagnosis::ALL.len()]);

impl DiagnosisCounts {
    /// The count of one diagnosis.
    pub fn get(&self, diagnosis: Diagnosis) -> u64 {
        self.0[diagnosis as usize]
    }

    /// Adds one snapshot with this diagnosis.
    pub fn increment(&mut self, diagnosis: Diagnosis) {
        let slot = &mut self.0[diagnosis as usize];
        *slot = slot.saturating_add(1);
    }

    /// The non-zero counts, in check order.
    pub fn iter(&self) -> impl Iterator<Item = (Diagnosis, u64)> + '_ {
        Diagnosis::ALL
            .iter()
            .map(|d| (*d, self.get(*d)))
            .filter(|(_, n)| *n > 0)
    }
}

impl Serialize for DiagnosisCounts {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.iter())
    }
}

/// Counts and debt of one diagnosis.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct DiagnosisTotals {
    /// Snapshots with this diagnosis.
    pub snapshots: u64,
    /// Sum of their `retry_after_debt_ms` over known boundaries (saturating).
    pub retry_after_debt_ms: u64,
}

/// Group totals by name: per run or per quota scope.
///
/// Kept in a hash map while reports are added (one lookup per report; a name already present costs
/// no allocation) and read in name order (byte order of the UTF-8 names): [`GroupMap::iter`],
/// [`GroupMap::values`] and serialization sort the names at that point, so the output never
/// depends on the order reports were added in. Serialized as a map `{name: GroupTotals}`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupMap(hashbrown::HashMap<String, GroupTotals>);

impl GroupMap {
    /// The number of distinct names.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// `true` when no report was added.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The totals of one name, if any report had it.
    pub fn get(&self, name: &str) -> Option<&GroupTotals> {
        self.0.get(name)
    }

    /// Every name with its totals, in name order (sorted on each call: `O(n log n)`).
    pub fn iter(&self) -> impl Iterator<Item = (&str, &GroupTotals)> + '_ {
        let mut entries: Vec<(&str, &GroupTotals)> = self
            .0
            .iter()
            .map(|(name, group)| (name.as_str(), group))
            .collect();
        entries.sort_unstable_by_key(|(name, _)| *name);
        entries.into_iter()
    }

    /// Every group's totals, in name order.
    pub fn values(&self) -> impl Iterator<Item = &GroupTotals> + '_ {
        self.iter().map(|(_, group)| group)
    }

    /// The totals of `name`, created empty when missing: one hash and lookup either way, and the
    /// name is copied only when it is new.
    fn entry(&mut self, name: &str) -> &mut GroupTotals {
        self.0.entry_ref(name).or_default()
    }
}

impl std::ops::Index<&str> for GroupMap {
    type Output = GroupTotals;

    /// The totals of `name`.
    ///
    /// # Panics
    /// When no report had that name (use [`GroupMap::get`] to ask).
    fn index(&self, name: &str) -> &GroupTotals {
        self.get(name)
            .unwrap_or_else(|| panic!("no totals for {name:?}"))
    }
}

impl Serialize for GroupMap {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.iter())
    }
}

/// Totals over many reports: overall, by scope, by diagnosis and by run — never one number without
/// its breakdown (SPEC §10). Memory grows with distinct runs and scopes, not with snapshots.
///
/// Serialized as `{"snapshots", "known_boundaries", "retry_after_debt_ms", "by_scope": {scope:
/// GroupTotals}, "by_diagnosis": {diagnosis: DiagnosisTotals}, "by_run": {run: GroupTotals}}`, keys
/// sorted (diagnoses in check order).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Totals {
    /// Snapshots diagnosed.
    pub snapshots: u64,
    /// Snapshots with a known boundary.
    pub known_boundaries: u64,
    /// Sum of `retry_after_debt_ms` over all known boundaries (saturating).
    pub retry_after_debt_ms: u64,
    /// Per quota scope.
    pub by_scope: GroupMap,
    /// Per diagnosis.
    pub by_diagnosis: BTreeMap<Diagnosis, DiagnosisTotals>,
    /// Per run.
    pub by_run: GroupMap,
}

impl GroupTotals {
    fn add(&mut self, report: &DiagnosisReport) {
        self.snapshots += 1;
        if let Some(debt) = report.retry_after_debt_ms {
            self.known_boundaries += 1;
            self.retry_after_debt_ms = self.retry_after_debt_ms.saturating_add(debt);
        }
        self.by_diagnosis.increment(report.diagnosis);
    }
}

impl Totals {
    /// Adds one report to every breakdown.
    pub fn add(&mut self, report: &DiagnosisReport) {
        self.snapshots += 1;
        let debt = report.retry_after_debt_ms;
        if let Some(debt) = debt {
            self.known_boundaries += 1;
            self.retry_after_debt_ms = self.retry_after_debt_ms.saturating_add(debt);
        }
        let by_diagnosis = self.by_diagnosis.entry(report.diagnosis).or_default();
        by_diagnosis.snapshots += 1;
        by_diagnosis.retry_after_debt_ms = by_diagnosis
            .retry_after_debt_ms
            .saturating_add(debt.unwrap_or(0));
        self.by_scope.entry(&report.quota_scope).add(report);
        self.by_run.entry(&report.run_id).add(report);
    }
}

impl<'a> FromIterator<&'a DiagnosisReport> for Totals {
    fn from_iter<I: IntoIterator<Item = &'a DiagnosisReport>>(iter: I) -> Self {
        let mut totals = Totals::default();
        for report in iter {
            totals.add(report);
        }
        totals
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LINE: &str = r#"{"run_id":"run-1","quota_scope":"s","throttled_at":"2026-07-26T18:41:30Z","status":429,"retry_after_raw":"60","attempts_used":1,"max_attempts":4,"wait_budget_ms":120000,"wait_used_ms":0}"#;

    #[test]
    fn a_line_that_is_not_utf8_names_the_field_and_column() {
        let mut line = LINE.as_bytes().to_vec();
        // `run-1` → `run\xff1`.
        let at = LINE.find("run-1").expect("in the line") + 3;
        line[at] = 0xff;
        match parse_snapshot(&line) {
            Err(SnapshotError::Malformed { path, reason }) => {
                assert_eq!(path, "run_id");
                assert!(reason.contains("column"), "{reason}");
            }
            other => panic!("expected a malformed line, got {other:?}"),
        }
        assert!(parse_snapshot(LINE.as_bytes()).is_ok());
    }

    #[test]
    fn a_line_that_is_not_json_says_so_before_the_parser_s_words() {
        for (line, start) in [
            ("this is not json", "not valid JSON: "),
            (
                r#"{"run_id":"run-1""#,
                "not valid JSON (it ends too early): ",
            ),
        ] {
            match parse_snapshot(line.as_bytes()) {
                Err(SnapshotError::Malformed { reason, .. }) => {
                    assert!(reason.starts_with(start), "{line}: {reason}");
                }
                other => panic!("expected a malformed line, got {other:?}"),
            }
        }
        // A JSON value of the wrong shape is not called "not JSON".
        match parse_snapshot(br#"{"run_id":7}"#) {
            Err(SnapshotError::Malformed { reason, .. }) => {
                assert!(!reason.contains("not valid JSON"), "{reason}");
            }
            other => panic!("expected a malformed line, got {other:?}"),
        }
    }

    fn report(run: &str, scope: &str) -> DiagnosisReport {
        let line = LINE
            .replace("\"run-1\"", &format!("{run:?}"))
            .replace("\"s\"", &format!("{scope:?}"));
        let now = "2026-07-26T18:42:00Z".parse().expect("valid instant");
        diagnose_owned(
            parse_snapshot(line.as_bytes()).expect("valid line"),
            now,
            &DiagnoseOptions::default(),
        )
    }

    #[test]
    fn group_maps_read_and_serialize_in_name_order_whatever_the_adding_order() {
        let names = ["b", "a", "Z", "é", "a-2", "a", "10", "9", "b"];
        let reports: Vec<DiagnosisReport> = names
            .iter()
            .zip(names.iter().rev())
            .map(|(run, scope)| report(run, scope))
            .collect();
        let forward: Totals = reports.iter().collect();
        let backward: Totals = reports.iter().rev().collect();
        assert_eq!(forward, backward);
        let json = serde_json::to_string(&forward).expect("serializes");
        assert_eq!(json, serde_json::to_string(&backward).expect("serializes"));
        // Byte order of the names, as a sorted map of strings gives.
        let sorted = ["10", "9", "Z", "a", "a-2", "b", "é"];
        let runs: Vec<&str> = forward.by_run.iter().map(|(name, _)| name).collect();
        assert_eq!(runs, sorted);
        let scopes: Vec<&str> = forward.by_scope.iter().map(|(name, _)| name).collect();
        assert_eq!(scopes, sorted);
        // The same bytes as a sorted map of the same entries.
        for groups in [&forward.by_run, &forward.by_scope] {
            let reference: BTreeMap<String, GroupTotals> = groups
                .iter()
                .map(|(name, group)| (name.to_owned(), group.clone()))
                .collect();
            assert_eq!(
                serde_json::to_string(groups).expect("serializes"),
                serde_json::to_string(&reference).expect("serializes")
            );
        }
        for (name, count) in [("a", 2), ("b", 2), ("é", 1), ("10", 1)] {
            assert_eq!(forward.by_run[name].snapshots, count, "{name}");
            assert_eq!(forward.by_scope[name].snapshots, count, "{name}");
        }
        assert_eq!(forward.by_run.values().map(|g| g.snapshots).sum::<u64>(), 9);
        assert!(forward.by_run.get("absent").is_none());
    }
}
