//! Live run health from the gateway's own receipts (SPEC §10): snapshots, `GET
//! /v1/runs/{task_id}/health` and `GET /v1/health`.
//!
//! ## Why receipts
//! A throttled run that went quiet may be healthily yielding to the provider or forgotten by its
//! scheduler; process liveness cannot tell. The hash-chained audit log (SPEC §9) already holds
//! every receipt the diagnosis needs, written in the same transaction as the state change it
//! describes, so a snapshot derived from it is evidence rather than a guess. [`Evidence`] folds the
//! log into one [`ActionTrail`] per action; [`derive_snapshot`] turns a trail into the SPEC §10
//! [`Snapshot`] that [`backstop_core::diagnose::diagnose`] judges. Both are pure (no clock, no
//! store), so they are unit-tested on records; the routes and the
//! [watchdog](crate::watchdog) only fetch the records and carry the verdicts out.
//!
//! ## Where each snapshot field comes from
//! | field | receipt |
//! |---|---|
//! | `run_id` | the action's task (`action_requested.task`) |
//! | `quota_scope` | the `scope_updated` event the gateway wrote for the same provider at the same instant just before the throttling `action_result` (SPEC §4.1: the scope record is updated first); else the policy route's first scope ([`HealthPolicy`]); else the provider's name |
//! | `throttled_at`, `status` | the throttling attempt's `action_result` (`at`, `status`) |
//! | `retry_not_before` | that result's `boundary` (the normalized Retry-After); `unknown` → absent |
//! | `retry_after_raw`, `date_header` | that result's `signal_headers`: the raw `Retry-After` (several instances joined with `, `) and the raw `Date`; `null` when the response carried none (or the event predates schema 5) |
//! | `scheduled_retry_at`, `scheduler_job_id` | the last `retry_scheduled` (`due_at`, `job`) after that result and before the next attempt |
//! | `scheduler_heartbeat_at` | the latest `action_sent` or `retry_started` of *any* action in the log: the last instant the executor demonstrably moved work (engine-independent, read from the store) |
//! | `retry_started_at` | the next attempt's `action_sent`; else a `retry_started` claim of the scheduled job |
//! | `retry_finished_at`, `retry_status` | the next attempt's `action_result` |
//! | `attempts_used` | attempts sent up to and including the retry |
//! | `max_attempts`, `wait_budget_ms` | the request class in [`HealthPolicy`] (see *Budgets* below) |
//! | `wait_used_ms` | the time the action actually waited: gaps between earlier results and the next sends, plus this throttle's wait — until the retry started; else, when the action ended without one, until its outcome event (an action ended at its throttle waited 0 ms, as its outcome's `total_wait_ms` says); else (still waiting) until `min(now, boundary or scheduled wake)` — a missed wake is the scheduler's fault and never drifts into a budget verdict |
//! | `outcome_deadline` | the task's deadline ([`backstop_store::Store::task`]) |
//! | `outcome_receipt` | `{"matches": true}` only when the action finished `succeeded` (a 2xx the gateway recorded, or a reconciliation); otherwise `null` |
//!
//! ## Budgets
//! `max_attempts` and `wait_budget_ms` are the action's request class's (`max_attempts`,
//! `max_wait_seconds`). An agent's `Prefer: wait=N` lowers an action's wait budget below its
//! class's, but no receipt records that cap: neither the audit events nor the outcome context
//! (whose `total_wait_ms` is the wait used, not the budget). A snapshot therefore states the
//! class's wait budget, which is the real one for every action sent without `Prefer: wait` and
//! an upper bound otherwise.
//!
//! ## Finished actions
//! A `cancelled` action is not waiting: it gets no snapshot, so it appears neither in exports nor
//! in `/v1/health`'s unhealthy runs. A finished action waits no more: its wait ends at its
//! outcome (see `wait_used_ms`), so an action the gateway ended at its throttle, without waiting,
//! shows 0 ms used however late the snapshot is taken. An action the gateway ended without
//! success has no authorized attempt left, and nothing will wake it: a `budget_exhausted`
//! action because its attempts ran out or because the provider's boundary lay beyond its
//! remaining wait (which may be the unrecorded `Prefer: wait` cap); a `quota_exhausted`,
//! `scope_saturated`, `escalated`, `reconciliation_required`, `rejected` or `circuit_open` one
//! because the gateway decided not to send it again (an operator's decision, or the agent's
//! own same-key resend, reopens it and it is judged as running again). Its `max_attempts` is
//! the attempts it used (never more than the class's), so the authority proof fails and it
//! diagnoses `retry_budget_exhausted` ("stop and hand over the evidence") rather than
//! `no_durable_wake`, whose advice — re-arm the retry — would contradict the gateway's own
//! decision. A finished `deadline_exhausted` action diagnoses `deadline_exhausted` from the
//! receipts alone when its boundary lies beyond the task deadline (the headroom is negative),
//! unless the boundary is also beyond the class's wait budget (SPEC §10 checks the budget
//! first).
//!
//! A *throttling* attempt is one whose disposition is `rate_limited` or `quota_exhausted`, or
//! `unavailable` with a known boundary or a scheduled retry after it. One snapshot per throttled
//! action: the latest throttle, unless an earlier throttle of the same action was answered by an
//! early retry (sent before its boundary) — then the first such throttle, so an early retry loop
//! is not hidden by the 429 it provoked.
//!
//! ## Routes
//! | route | answer |
//! |---|---|
//! | `GET /v1/runs/{task_id}/health` | [`RunHealth`]: `{run_id, now, wake_grace_ms, healthy, actions: [{action_id, open, snapshot, report}], totals}` |
//! | `GET /v1/health` | [`GatewayHealth`]: `{now, wake_grace_ms, runs: [RunHealth…], totals}` — only runs with a diagnosis other than `waiting_backpressure`/`recovered`; `totals` cover every visible throttled action (by scope, by diagnosis, by run) |
//!
//! Auth: `Authorization: Bearer <token>` resolved by [`HealthState::callers`]. Operators see every
//! run; an agent sees only its own tasks (another agent's task answers 404, as an unknown one).
//! Errors are RFC 9457 problems made as every other backstop problem ([`Problem`]: a title, and
//! `sent: false`): 401 `unauthorized` (saying what was wrong with the token), 400 `bad_header`
//! (two `Authorization` headers), 404 `run_not_found`, 500 `store_error`.
//! Each request reads the whole audit log (paged); a store-side index is the step after this one
//! if logs grow large.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use axum::{
    extract::{Path, State},
    http::HeaderMap,
    routing::get,
    Json, Router,
};
use backstop_core::clock::Clock;
use backstop_core::diagnose::{
    diagnose, DiagnoseOptions, Diagnosis, DiagnosisReport, OutcomeReceipt, Snapshot, Totals,
    WakeGrace,
};
use backstop_core::policy::Policy;
use backstop_core::signal_headers::{date_raw, retry_after_raw};
use backstop_store::audit::AuditEvent;
use backstop_store::{ActionId, Store, StoreError, TaskRecord};
use jiff::Timestamp;
use serde::Serialize;

use crate::auth::{AuthError, Caller, Role};
use crate::clock::TokioClock;
use crate::problem::Problem;

/// Audit events read per page when scanning the log.
pub const PAGE_EVENTS: usize = 1_000;

/// The audit event kind the watchdog appends for a finding (`source` names the diagnosis).
pub const WATCHDOG_FINDING: &str = "watchdog_finding";

/// Why evidence could not be read.
#[derive(Debug, thiserror::Error)]
pub enum HealthError {
    /// An audit event carries a time that is not RFC 3339.
    #[error("audit event {seq} ({kind}): `{field}` {value:?} is not an RFC 3339 instant")]
    BadInstant {
        /// The event's `seq`.
        seq: u64,
        /// The event's kind.
        kind: String,
        /// The field (`at`, `boundary`, `due_at`).
        field: &'static str,
        /// The offending text.
        value: String,
    },
    /// The store failed.
    #[error("store: {0}")]
    Store(#[from] StoreError),
}

/// The attempt and wait ceilings of one request class (SPEC §3, §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClassLimits {
    /// Attempts in total, the first included.
    pub max_attempts: u32,
    /// Total wait between attempts, in milliseconds.
    pub max_wait_ms: u64,
}

/// What the health derivation needs from the policy: class ceilings and route scopes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthPolicy {
    classes: BTreeMap<String, ClassLimits>,
    /// (provider, METHOD, template) → first scope of the route.
    routes: BTreeMap<(String, String, String), String>,
    /// provider → first default scope.
    default_scopes: BTreeMap<String, String>,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        Self::spec_defaults()
    }
}

impl HealthPolicy {
    /// The SPEC §3 classes (`read` 4 attempts / 90 s, `idempotent_write` 3 / 120 s,
    /// `uncertain_write` 1 / 0 s) and no routes.
    pub fn spec_defaults() -> Self {
        let classes = [
            ("read", 4, 90),
            ("idempotent_write", 3, 120),
            ("uncertain_write", 1, 0),
        ]
        .into_iter()
        .map(|(name, max_attempts, seconds)| {
            (
                name.to_owned(),
                ClassLimits {
                    max_attempts,
                    max_wait_ms: seconds * 1_000,
                },
            )
        })
        .collect();
        HealthPolicy {
            classes,
            routes: BTreeMap::new(),
            default_scopes: BTreeMap::new(),
        }
    }

    /// The classes, routes and default scopes of a loaded policy.
    pub fn from_policy(policy: &Policy) -> Self {
        let classes = policy
            .request_classes
            .iter()
            .map(|(name, class)| {
                (
                    name.clone(),
                    ClassLimits {
                        max_attempts: class.max_attempts,
                        max_wait_ms: u64::try_from(class.max_wait.as_millis()).unwrap_or(u64::MAX),
                    },
                )
            })
            .collect();
        let mut routes = BTreeMap::new();
        let mut default_scopes = BTreeMap::new();
        for (name, provider) in &policy.providers {
            if let Some(first) = provider.default_scopes.first() {
                default_scopes.insert(name.clone(), first.clone());
            }
            for route in &provider.routes {
                if let Some(first) = route.scopes.first() {
                    routes.insert(
                        (name.clone(), route.method.clone(), route.template.clone()),
                        first.clone(),
                    );
                }
            }
        }
        HealthPolicy {
            classes,
            routes,
            default_scopes,
        }
    }

    /// The ceilings of a class. An unknown class gets the most conservative ceilings
    /// (1 attempt, no wait), so an unknown class is never reported as having authority left.
    pub fn class(&self, name: &str) -> ClassLimits {
        self.classes.get(name).copied().unwrap_or(ClassLimits {
            max_attempts: 1,
            max_wait_ms: 0,
        })
    }

    /// The scope a route falls under by policy (its first scope, else the provider's first
    /// default scope), `None` when the policy names none.
    pub fn scope(&self, provider: &str, method: &str, route: &str) -> Option<&str> {
        self.routes
            .get(&(provider.to_owned(), method.to_owned(), route.to_owned()))
            .or_else(|| self.default_scopes.get(provider))
            .map(String::as_str)
    }
}

/// The result of one attempt, as audited (`action_result`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrailResult {
    /// The event's `seq`.
    pub seq: u64,
    /// When the result was recorded.
    pub at: Timestamp,
    /// HTTP status, when a response arrived.
    pub status: Option<u16>,
    /// The disposition (SPEC §2.1), e.g. `rate_limited`.
    pub disposition: String,
    /// The normalized boundary: `Some(None)` for `unknown`, `None` when none was recorded.
    pub boundary: Option<Option<Timestamp>>,
    /// The scope the gateway updated for this result (the `scope_updated` evidence), if any.
    pub scope: Option<String>,
    /// The response's signal headers as audited (`Retry-After`, `Date`, quota headers); empty
    /// when none were kept.
    pub signal_headers: Vec<(String, String)>,
}

/// One attempt as audited.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrailAttempt {
    /// The `action_sent` event's `seq`.
    pub sent_seq: u64,
    /// When the attempt was durably recorded as sent.
    pub sent_at: Timestamp,
    /// Its result, once recorded.
    pub result: Option<TrailResult>,
}

/// A scheduler receipt (`retry_scheduled`) or a claim (`retry_started`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrailWake {
    /// The event's `seq`.
    pub seq: u64,
    /// When it was written.
    pub at: Timestamp,
    /// The scheduler job id.
    pub job: Option<i64>,
    /// When the retry is (was) due.
    pub due_at: Option<Timestamp>,
}

/// Everything the audit log says about one action.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActionTrail {
    /// Store id of the action.
    pub action: i64,
    /// The task (run).
    pub task: String,
    /// Provider name.
    pub provider: String,
    /// HTTP method.
    pub method: String,
    /// Route template.
    pub route: String,
    /// Request class.
    pub request_class: String,
    /// Idempotency key.
    pub idempotency_key: Option<String>,
    /// Payload digest (SHA-256 hex).
    pub payload_digest: Option<String>,
    /// Attempts by number.
    pub attempts: BTreeMap<u32, TrailAttempt>,
    /// Scheduled retries, in order.
    pub scheduled: Vec<TrailWake>,
    /// Claims of scheduled retries, in order.
    pub claimed: Vec<TrailWake>,
    /// The outcome once the action ended (SPEC §5 word).
    pub outcome: Option<String>,
    /// The `at` of each outcome event (an escalation beside an outcome adds a second), in
    /// order.
    pub ended_at: Vec<Timestamp>,
    /// Findings the watchdog already raised (diagnosis names).
    pub findings: BTreeSet<String>,
}

impl ActionTrail {
    /// The trail an `action_requested` event starts.
    fn requested(action: i64, e: &AuditEvent) -> Self {
        ActionTrail {
            action,
            task: e.task.clone().unwrap_or_default(),
            provider: e.provider.clone().unwrap_or_default(),
            method: e.method.clone().unwrap_or_default(),
            route: e.route.clone().unwrap_or_default(),
            request_class: e.request_class.clone().unwrap_or_default(),
            idempotency_key: e.idempotency_key.clone(),
            payload_digest: e.payload_digest.clone(),
            attempts: BTreeMap::new(),
            scheduled: Vec::new(),
            claimed: Vec::new(),
            outcome: None,
            ended_at: Vec::new(),
            findings: BTreeSet::new(),
        }
    }

    /// Folds one later event of the action in, its times and scope already read.
    fn fold(
        &mut self,
        e: &AuditEvent,
        at: Timestamp,
        boundary: Option<Option<Timestamp>>,
        due_at: Option<Timestamp>,
        scope: Option<String>,
    ) {
        match e.kind.as_str() {
            "action_sent" => {
                if let Some(n) = e.attempt {
                    self.attempts.insert(
                        n,
                        TrailAttempt {
                            sent_seq: e.seq,
                            sent_at: at,
                            result: None,
                        },
                    );
                }
            }
            "action_result" => {
                if let Some(attempt) = e.attempt.and_then(|n| self.attempts.get_mut(&n)) {
                    attempt.result = Some(TrailResult {
                        seq: e.seq,
                        at,
                        status: e.status,
                        disposition: e.disposition.clone().unwrap_or_default(),
                        boundary,
                        scope,
                        signal_headers: e.signal_headers.clone().unwrap_or_default(),
                    });
                }
            }
            "retry_scheduled" | "retry_started" => {
                let wake = TrailWake {
                    seq: e.seq,
                    at,
                    job: e.job,
                    due_at,
                };
                if e.kind == "retry_scheduled" {
                    self.scheduled.push(wake);
                } else {
                    self.claimed.push(wake);
                }
            }
            "action_finished"
            | "budget_exhausted"
            | "deadline_exhausted"
            | "reconciliation_required"
            | "escalated"
            | "cancelled"
            | "reconciled" => {
                self.outcome = Some(e.outcome.clone().unwrap_or_else(|| e.kind.clone()));
                self.ended_at.push(at);
            }
            // Reopened for a same-key send (an operator's `retry_same_key`, or a resend its
            // answer invited): the action runs again, and its outcome is the next one.
            backstop_store::ACTION_REOPENED => {
                self.outcome = None;
            }
            WATCHDOG_FINDING => {
                if let Some(finding) = &e.source {
                    self.findings.insert(finding.clone());
                }
            }
            _ => {}
        }
    }

    /// Whether the action ended (any outcome).
    pub fn finished(&self) -> bool {
        self.outcome.is_some()
    }

    /// Whether any attempt of this action was throttled (see the module docs).
    pub fn throttled(&self) -> bool {
        self.attempts.keys().any(|n| self.is_throttle(*n).is_some())
    }

    /// The result of attempt `n` when it is a throttle.
    fn is_throttle(&self, n: u32) -> Option<&TrailResult> {
        let result = self.attempts.get(&n)?.result.as_ref()?;
        match result.disposition.as_str() {
            "rate_limited" | "quota_exhausted" => Some(result),
            "unavailable"
                if matches!(result.boundary, Some(Some(_)))
                    || self.wake_after(n, result.seq).is_some() =>
            {
                Some(result)
            }
            _ => None,
        }
    }

    /// The last `retry_scheduled` after attempt `n`'s result and before attempt `n + 1`.
    fn wake_after(&self, n: u32, result_seq: u64) -> Option<&TrailWake> {
        let until = self.attempts.get(&(n + 1)).map_or(u64::MAX, |a| a.sent_seq);
        self.scheduled
            .iter()
            .rev()
            .find(|w| w.seq > result_seq && w.seq < until)
    }

    /// Whether the action was throttled (an attempt got a 429 or another limit signal) and then
    /// ended `cancelled`: [`derive_snapshot`] gives it no snapshot, since a cancelled action waits
    /// for nothing; an export says so rather than "none throttled".
    pub fn throttled_then_cancelled(&self) -> bool {
        self.outcome.as_deref() == Some("cancelled") && self.chosen_throttle().is_some()
    }

    /// The throttle a snapshot is built from (see the module docs).
    fn chosen_throttle(&self) -> Option<u32> {
        let throttles: Vec<u32> = self
            .attempts
            .keys()
            .copied()
            .filter(|n| self.is_throttle(*n).is_some())
            .collect();
        let early = throttles.iter().copied().find(|n| {
            let boundary = self.is_throttle(*n).and_then(|r| r.boundary.flatten());
            let next = self.attempts.get(&(n + 1)).map(|a| a.sent_at);
            matches!((boundary, next), (Some(b), Some(sent)) if sent < b)
        });
        early.or_else(|| throttles.last().copied())
    }
}

/// The audit log folded per action, plus the scheduler heartbeat.
#[derive(Debug, Default, Clone)]
pub struct Evidence {
    trails: BTreeMap<i64, ActionTrail>,
    heartbeat_at: Option<Timestamp>,
    last_seq: u64,
    /// Recent `scope_updated` events: (provider, at, scope).
    recent_scopes: VecDeque<(String, Timestamp, String)>,
}

/// How many recent `scope_updated` events are kept to attribute a throttle to its scope.
const RECENT_SCOPES: usize = 64;

fn instant(event: &AuditEvent, field: &'static str, text: &str) -> Result<Timestamp, HealthError> {
    text.parse().map_err(|_| HealthError::BadInstant {
        seq: event.seq,
        kind: event.kind.clone(),
        field,
        value: text.to_owned(),
    })
}

/// The event's `boundary`: `None` when it has none, `Some(None)` when it is `unknown`.
fn event_boundary(event: &AuditEvent) -> Result<Option<Option<Timestamp>>, HealthError> {
    Ok(match event.boundary.as_deref() {
        None => None,
        Some("unknown") => Some(None),
        Some(text) => Some(Some(instant(event, "boundary", text)?)),
    })
}

impl Evidence {
    /// An empty fold.
    pub fn new() -> Self {
        Self::default()
    }

    /// The `seq` of the last event folded in (0 before any).
    pub fn last_seq(&self) -> u64 {
        self.last_seq
    }

    /// The scheduler heartbeat: the latest `action_sent` or `retry_started` of any action.
    pub fn heartbeat_at(&self) -> Option<Timestamp> {
        self.heartbeat_at
    }

    /// The trail of one action.
    pub fn trail(&self, action: i64) -> Option<&ActionTrail> {
        self.trails.get(&action)
    }

    /// Every trail, by action id.
    pub fn trails(&self) -> impl Iterator<Item = &ActionTrail> {
        self.trails.values()
    }

    /// Marks a finding as raised for an action (its `watchdog_finding` event, folded in later,
    /// says the same).
    pub fn note_finding(&mut self, action: i64, finding: &str) {
        if let Some(trail) = self.trails.get_mut(&action) {
            trail.findings.insert(finding.to_owned());
        }
    }

    /// Forgets finished actions (the watchdog only watches open ones). Later events about a
    /// forgotten action are ignored.
    pub fn forget_finished(&mut self) {
        self.trails.retain(|_, t| !t.finished());
    }

    /// Folds one event in. Events must arrive in `seq` order; events about actions whose
    /// `action_requested` was not seen are ignored.
    ///
    /// # Errors
    /// [`HealthError::BadInstant`] for a time that is not RFC 3339 (the event is skipped).
    pub fn ingest(&mut self, e: &AuditEvent) -> Result<(), HealthError> {
        self.last_seq = self.last_seq.max(e.seq);
        let at = instant(e, "at", &e.at)?;
        if matches!(e.kind.as_str(), "action_sent" | "retry_started") {
            self.heartbeat_at = Some(self.heartbeat_at.map_or(at, |h| h.max(at)));
        }
        if e.kind == "scope_updated" {
            self.note_scope_update(e, at);
            return Ok(());
        }
        let Some(action) = e.action else {
            return Ok(());
        };
        if e.kind == "action_requested" {
            self.trails
                .insert(action, ActionTrail::requested(action, e));
            return Ok(());
        }
        // Parse before borrowing the trail, so a bad event changes nothing.
        let boundary = event_boundary(e)?;
        let due_at = e
            .due_at
            .as_deref()
            .map(|t| instant(e, "due_at", t))
            .transpose()?;
        let scope = self.scope_updated_with(e, at);
        let Some(trail) = self.trails.get_mut(&action) else {
            return Ok(());
        };
        trail.fold(e, at, boundary, due_at, scope);
        Ok(())
    }

    /// Keeps a `scope_updated` event among the recent ones (the oldest is dropped past
    /// [`RECENT_SCOPES`]).
    fn note_scope_update(&mut self, e: &AuditEvent, at: Timestamp) {
        if let (Some(provider), Some(scope)) = (&e.provider, &e.scope) {
            if self.recent_scopes.len() == RECENT_SCOPES {
                self.recent_scopes.pop_front();
            }
            self.recent_scopes
                .push_back((provider.clone(), at, scope.clone()));
        }
    }

    /// The scope a recent `scope_updated` event of `e`'s provider at the same instant names:
    /// the scope a throttle is attributed to.
    fn scope_updated_with(&self, e: &AuditEvent, at: Timestamp) -> Option<String> {
        self.recent_scopes
            .iter()
            .find(|(provider, when, _)| Some(provider) == e.provider.as_ref() && *when == at)
            .map(|(_, _, scope)| scope.clone())
    }

    /// Folds every event after [`Evidence::last_seq`] from the store, in pages of
    /// [`PAGE_EVENTS`]. A malformed event is skipped with a warning (it cannot stop the fold),
    /// and so is a stored row that cannot be decoded at all (an altered row, which `audit
    /// verify` reports): the events around it are still folded.
    ///
    /// # Errors
    /// Storage errors.
    pub fn catch_up(&mut self, store: &dyn Store) -> Result<u64, HealthError> {
        let mut read = 0u64;
        loop {
            // An altered row at `seq`: the events before it are folded first (a page at a time),
            // then it is passed over with a warning, so one damaged event does not fail every
            // diagnosis.
            let (page, altered) = match store.audit_events(self.last_seq, PAGE_EVENTS) {
                Ok(page) => (page, None),
                Err(StoreError::UndecodableEvent { seq, reason }) if seq > self.last_seq => {
                    let before = usize::try_from(seq - self.last_seq - 1).unwrap_or(usize::MAX);
                    let page = if before == 0 {
                        Vec::new()
                    } else {
                        store.audit_events(self.last_seq, before.min(PAGE_EVENTS))?
                    };
                    (page, (before <= PAGE_EVENTS).then_some((seq, reason)))
                }
                Err(e) => return Err(e.into()),
            };
            for event in &page {
                if let Err(e) = self.ingest(event) {
                    tracing::warn!(error = %e, "audit event skipped by the health fold");
                }
            }
            read += page.len() as u64;
            if let Some((seq, reason)) = altered {
                tracing::warn!(seq, %reason, "audit event skipped by the health fold: it cannot be decoded (run `backstop audit verify`)");
                self.last_seq = seq;
                continue;
            }
            let Some(last) = page.last().map(|e| e.seq) else {
                return Ok(read);
            };
            self.last_seq = self.last_seq.max(last);
            if page.len() < PAGE_EVENTS {
                return Ok(read);
            }
        }
    }
}

/// Inputs of [`derive_snapshot`] besides the trail.
#[derive(Debug, Clone, Copy)]
pub struct SnapshotContext<'a> {
    /// The task's deadline (`outcome_deadline`), if any.
    pub deadline: Option<Timestamp>,
    /// The policy (class ceilings, route scopes).
    pub policy: &'a HealthPolicy,
    /// The scheduler heartbeat ([`Evidence::heartbeat_at`]).
    pub heartbeat_at: Option<Timestamp>,
    /// The instant the snapshot describes (only `wait_used_ms` of a pending wait depends on it).
    pub now: Timestamp,
}

fn ms_between(from: Timestamp, to: Timestamp) -> u64 {
    u64::try_from(to.duration_since(from).as_millis().max(0)).unwrap_or(u64::MAX)
}

/// Derives the SPEC §10 snapshot of one throttled action from its trail (field sources in the
/// module docs). Pure: nothing is read, `ctx.now` is given. `None` when the action was never
/// throttled (or its throttling answer carried no status).
pub fn derive_snapshot(trail: &ActionTrail, ctx: &SnapshotContext<'_>) -> Option<Snapshot> {
    // A cancelled action is not waiting for anything: no snapshot (module docs).
    if trail.outcome.as_deref() == Some("cancelled") {
        return None;
    }
    let k = trail.chosen_throttle()?;
    let throttle = trail.is_throttle(k)?;
    let status = throttle.status?;
    let throttled_at = throttle.at;
    let boundary = throttle.boundary.flatten();
    let wake = trail.wake_after(k, throttle.seq);
    let retry = trail.attempts.get(&(k + 1));
    let claim = wake.and_then(|w| trail.claim_of(w));
    let retry_started_at = retry.map(|a| a.sent_at).or(claim.map(|c| c.at));
    let retry_result = retry.and_then(|a| a.result.as_ref());
    // Validation requires finished ≥ started: a finish without a start time cannot exist here.
    let retry_finished_at = retry_result.map(|r| r.at);
    let retry_status = retry_result.and_then(|r| r.status);

    let limits = ctx.policy.class(&trail.request_class);
    let attempts_used =
        u32::try_from(trail.attempts.keys().filter(|n| **n <= k + 1).count()).unwrap_or(u32::MAX);
    let wait_end = match retry_started_at {
        Some(started) => started,
        None => trail.unretried_wait_end(throttled_at, boundary, wake, ctx.now),
    };
    let wait_used_ms = trail
        .waited_before(k)
        .saturating_add(ms_between(throttled_at, wait_end));
    let outcome_receipt = match trail.outcome.as_deref() {
        Some("succeeded") => Some(OutcomeReceipt { matches: true }),
        _ => None,
    };
    Some(Snapshot {
        run_id: trail.task.clone(),
        quota_scope: trail.throttle_scope(throttle, ctx.policy),
        throttled_at,
        status,
        retry_after_raw: retry_after_raw(&throttle.signal_headers),
        date_header: date_raw(&throttle.signal_headers),
        retry_not_before: boundary.filter(|b| *b >= throttled_at),
        scheduled_retry_at: wake.and_then(|w| w.due_at),
        scheduler_job_id: wake.and_then(|w| w.job).map(|j| j.to_string()),
        scheduler_heartbeat_at: ctx.heartbeat_at,
        retry_started_at,
        retry_finished_at: retry_finished_at.filter(|_| retry_started_at.is_some()),
        retry_status: retry_status.filter(|_| retry_started_at.is_some()),
        attempts_used,
        max_attempts: trail.authorized_attempts(attempts_used, limits.max_attempts),
        wait_budget_ms: limits.max_wait_ms,
        wait_used_ms,
        outcome_deadline: ctx.deadline,
        completion_estimate_ms: 0,
        outcome_receipt,
    })
}

impl ActionTrail {
    /// The claim (`retry_started`) of the scheduled wake `wake`: the first later one of its job.
    fn claim_of(&self, wake: &TrailWake) -> Option<&TrailWake> {
        self.claimed
            .iter()
            .find(|c| c.seq > wake.seq && (wake.job.is_none() || c.job == wake.job))
    }

    /// Milliseconds of the waits that finished before throttle `k`: the result of attempt `i`
    /// to the send of attempt `i + 1`.
    fn waited_before(&self, k: u32) -> u64 {
        let mut waited: u64 = 0;
        for i in 1..k {
            let finished = self.attempts.get(&i).and_then(|a| a.result.as_ref());
            let next = self.attempts.get(&(i + 1));
            if let (Some(r), Some(n)) = (finished, next) {
                waited = waited.saturating_add(ms_between(r.at, n.sent_at));
            }
        }
        waited
    }

    /// Where the wait after a throttle at `throttled_at` that no retry followed ends: at the
    /// planned instant (the boundary, else the wake's due time) or `now`, whichever is first —
    /// and no later than the action's first outcome after the throttle, where it stopped
    /// (module docs).
    fn unretried_wait_end(
        &self,
        throttled_at: Timestamp,
        boundary: Option<Timestamp>,
        wake: Option<&TrailWake>,
        now: Timestamp,
    ) -> Timestamp {
        let ended = self.ended_at.iter().copied().find(|e| *e >= throttled_at);
        let planned = boundary.or(wake.and_then(|w| w.due_at));
        let until = ended.map_or(now, |e| e.min(now));
        planned.map_or(until, |p| p.min(until))
    }

    /// The quota scope of `throttle`: the one its `scope_updated` named, else the route's
    /// scope in the policy, else the provider.
    fn throttle_scope(&self, throttle: &TrailResult, policy: &HealthPolicy) -> String {
        throttle
            .scope
            .clone()
            .or_else(|| {
                policy
                    .scope(&self.provider, &self.method, &self.route)
                    .map(str::to_owned)
            })
            .unwrap_or_else(|| self.provider.clone())
    }

    /// The attempts the action is authorized for: the class's `max_attempts`, except that an
    /// action the gateway ended without success (other than at its deadline) has no authorized
    /// attempt left — nothing will wake it, so its authority is the attempts it used (module
    /// docs).
    fn authorized_attempts(&self, attempts_used: u32, max_attempts: u32) -> u32 {
        if self.outcome.as_deref().is_some_and(ended_without_authority) {
            attempts_used.min(max_attempts)
        } else {
            max_attempts
        }
    }
}

/// Whether an action that ended with `outcome` has no authorized attempt left: every outcome
/// but `succeeded` (its receipt is the proof), `cancelled` (no snapshot at all) and
/// `deadline_exhausted` (diagnosed from its boundary against the deadline, which
/// `retry_budget_exhausted`, checked first, would hide).
fn ended_without_authority(outcome: &str) -> bool {
    !matches!(outcome, "succeeded" | "cancelled" | "deadline_exhausted")
}

/// `true` for the diagnoses that need no operator: `waiting_backpressure` and `recovered`.
pub fn is_healthy(diagnosis: Diagnosis) -> bool {
    matches!(
        diagnosis,
        Diagnosis::WaitingBackpressure | Diagnosis::Recovered
    )
}

/// One throttled action of a run with its snapshot and diagnosis.
#[derive(Debug, Clone, Serialize)]
pub struct ActionHealth {
    /// Store id of the action.
    pub action_id: i64,
    /// Whether the action has not ended yet.
    pub open: bool,
    /// The derived snapshot (SPEC §10 shape).
    pub snapshot: Snapshot,
    /// Its diagnosis.
    pub report: DiagnosisReport,
}

/// The health of one run: `GET /v1/runs/{task_id}/health`.
#[derive(Debug, Clone, Serialize)]
pub struct RunHealth {
    /// The task id.
    pub run_id: String,
    /// The instant diagnosed at.
    pub now: Timestamp,
    /// The wake grace, in milliseconds.
    pub wake_grace_ms: u64,
    /// `true` when every throttled action is `waiting_backpressure` or `recovered` (or there is
    /// none).
    pub healthy: bool,
    /// Whether any throttled action is still open.
    pub open: bool,
    /// The throttled actions, by action id.
    pub actions: Vec<ActionHealth>,
    /// Totals of this run: `retry_after_debt_ms`, by scope, by diagnosis.
    pub totals: Totals,
}

/// The gateway's unhealthy runs: `GET /v1/health`.
#[derive(Debug, Clone, Serialize)]
pub struct GatewayHealth {
    /// The instant diagnosed at.
    pub now: Timestamp,
    /// The wake grace, in milliseconds.
    pub wake_grace_ms: u64,
    /// Runs with at least one diagnosis other than `waiting_backpressure`/`recovered`.
    pub runs: Vec<RunHealth>,
    /// Totals over every visible throttled action (healthy ones included), by scope, diagnosis
    /// and run.
    pub totals: Totals,
}

/// Diagnoses the throttled actions of `trails` (all of one run) at `now`.
pub fn run_health<'a>(
    run_id: &str,
    trails: impl IntoIterator<Item = &'a ActionTrail>,
    ctx: &SnapshotContext<'_>,
    opts: &DiagnoseOptions,
) -> RunHealth {
    let mut actions = Vec::new();
    let mut totals = Totals::default();
    for trail in trails {
        let Some(snapshot) = derive_snapshot(trail, ctx) else {
            continue;
        };
        let report = diagnose(&snapshot, ctx.now, opts);
        totals.add(&report);
        actions.push(ActionHealth {
            action_id: trail.action,
            open: !trail.finished(),
            snapshot,
            report,
        });
    }
    RunHealth {
        run_id: run_id.to_owned(),
        now: ctx.now,
        wake_grace_ms: u64::try_from(opts.wake_grace.0.as_millis()).unwrap_or(u64::MAX),
        healthy: actions.iter().all(|a| is_healthy(a.report.diagnosis)),
        open: actions.iter().any(|a| a.open),
        actions,
        totals,
    }
}

/// Resolves a bearer token to its caller (agent or operator), `None` for an unknown token. The
/// server passes [`crate::auth::Authenticator::identify`].
pub type CallerLookup = dyn Fn(&str) -> Option<Caller> + Send + Sync;

/// What the health routes need.
#[derive(Clone)]
pub struct HealthState {
    /// The store whose audit log and tasks are read.
    pub store: Arc<dyn Store>,
    /// Bearer token → caller.
    pub callers: Arc<CallerLookup>,
    /// The clock giving `now`.
    pub clock: TokioClock,
    /// The wake grace (SPEC §10 default 30 s).
    pub grace: Duration,
    /// Class ceilings and route scopes.
    pub policy: Arc<HealthPolicy>,
}

impl std::fmt::Debug for HealthState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HealthState")
            .field("clock", &self.clock)
            .field("grace", &self.grace)
            .finish_non_exhaustive()
    }
}

/// The health routes (see the module table), ready to merge into the gateway's router.
pub fn router(state: HealthState) -> Router {
    Router::new()
        .route("/v1/runs/{task_id}/health", get(one_run))
        .route("/v1/health", get(all_runs))
        .with_state(state)
}

/// The caller of a health request, as every route authenticates one: one `Authorization:
/// Bearer` header (two are `400 bad_header`) with an agent's or an operator's token (anything
/// else is `401 unauthorized`, saying what was wrong).
fn caller(state: &HealthState, headers: &HeaderMap) -> Result<Caller, Problem> {
    let token = crate::auth::bearer_token(headers).map_err(Problem::from)?;
    (state.callers)(token).ok_or_else(|| Problem::from(AuthError::Unknown))
}

/// The task `id` as `caller` may see it. Task ids are namespaced per agent: an agent gets its
/// own task or nothing (another agent's task with the same id is not revealed); an operator,
/// who may see all, gets every agent's task with the id, of which the one with the earliest
/// deadline stands for the run (its snapshots then warn soonest).
fn visible_task(
    store: &dyn Store,
    caller: &Caller,
    id: &str,
) -> Result<Option<TaskRecord>, StoreError> {
    if caller.role == Role::Operator {
        let tasks = store.tasks_of_every_agent(id)?;
        return Ok(tasks
            .into_iter()
            .min_by_key(|t| (t.deadline.is_none(), t.deadline)));
    }
    store.task(&caller.name, id)
}

/// Reads the whole log and the tasks of every throttled run; keeps the runs `caller` may see.
/// What `caller` may see: the evidence, the visible tasks by id, and the visible action ids.
///
/// Audit events name the task id but not its agent, and task ids are namespaced per agent, so
/// two agents' tasks with the same id share trails in the evidence. An agent therefore sees only
/// the trails of actions recorded as its own (looked up in the store); an operator sees all.
/// The evidence, the visible tasks by id, and the visible action ids.
type Visible = (Evidence, BTreeMap<String, TaskRecord>, BTreeSet<i64>);

fn gather(
    store: &dyn Store,
    only_task: Option<&str>,
    caller: &Caller,
) -> Result<Visible, HealthError> {
    let mut evidence = Evidence::new();
    evidence.catch_up(store)?;
    let mut tasks = BTreeMap::new();
    let mut visible = BTreeSet::new();
    for trail in evidence.trails() {
        if only_task.is_some_and(|t| t != trail.task) {
            continue;
        }
        if !tasks.contains_key(&trail.task) {
            match visible_task(store, caller, &trail.task)? {
                Some(task) => {
                    tasks.insert(trail.task.clone(), task);
                }
                None => continue,
            }
        }
        let own = match caller.role {
            Role::Operator => true,
            Role::Agent => store
                .action(ActionId(trail.action))?
                .is_some_and(|record| record.agent == caller.name),
        };
        if own {
            visible.insert(trail.action);
        }
    }
    Ok((evidence, tasks, visible))
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, HealthError> + Send + 'static,
) -> Result<T, Problem> {
    match tokio::task::spawn_blocking(f).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(Problem::store_error(e.to_string())),
        Err(e) => Err(Problem::store_error(format!("store task ended: {e}"))),
    }
}

fn options(state: &HealthState) -> DiagnoseOptions {
    DiagnoseOptions {
        wake_grace: WakeGrace(state.grace),
        ..DiagnoseOptions::default()
    }
}

async fn one_run(
    State(state): State<HealthState>,
    Path(task_id): Path<String>,
    headers: HeaderMap,
) -> Result<Json<RunHealth>, Problem> {
    let caller = caller(&state, &headers)?;
    let store = state.store.clone();
    let found = {
        let task_id = task_id.clone();
        blocking(move || {
            let Some(task) = visible_task(store.as_ref(), &caller, &task_id)? else {
                return Ok(None);
            };
            let seen = gather(store.as_ref(), Some(&task.id), &caller)?;
            Ok(Some((task, seen)))
        })
        .await?
    };
    let Some((task, (evidence, _, visible))) = found else {
        return Err(Problem::not_yours("run", &task_id));
    };
    let ctx = SnapshotContext {
        deadline: task.deadline,
        policy: &state.policy,
        heartbeat_at: evidence.heartbeat_at(),
        now: state.clock.now(),
    };
    let trails = evidence
        .trails()
        .filter(|t| t.task == task.id && visible.contains(&t.action));
    Ok(Json(run_health(&task.id, trails, &ctx, &options(&state))))
}

async fn all_runs(
    State(state): State<HealthState>,
    headers: HeaderMap,
) -> Result<Json<GatewayHealth>, Problem> {
    let caller = caller(&state, &headers)?;
    let store = state.store.clone();
    let (evidence, tasks, visible) =
        blocking(move || gather(store.as_ref(), None, &caller)).await?;
    let now = state.clock.now();
    let opts = options(&state);
    let mut runs = Vec::new();
    let mut totals = Totals::default();
    // The visible trails grouped by task once (not every trail filtered once per task).
    let mut by_task: std::collections::HashMap<&str, Vec<&ActionTrail>> =
        std::collections::HashMap::new();
    for trail in evidence.trails().filter(|t| visible.contains(&t.action)) {
        by_task.entry(trail.task.as_str()).or_default().push(trail);
    }
    for task in tasks.values() {
        let ctx = SnapshotContext {
            deadline: task.deadline,
            policy: &state.policy,
            heartbeat_at: evidence.heartbeat_at(),
            now,
        };
        let health = run_health(
            &task.id,
            by_task.get(task.id.as_str()).into_iter().flatten().copied(),
            &ctx,
            &opts,
        );
        for action in &health.actions {
            totals.add(&action.report);
        }
        if !health.healthy {
            runs.push(health);
        }
    }
    Ok(Json(GatewayHealth {
        now,
        wake_grace_ms: u64::try_from(state.grace.as_millis()).unwrap_or(u64::MAX),
        runs,
        totals,
    }))
}
