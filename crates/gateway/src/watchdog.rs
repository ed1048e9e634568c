//! The health watchdog: the gateway checks its own throttled actions for missed wakes and early
//! retries (SPEC §10) and raises each finding once.
//!
//! ## Why
//! The scheduler cannot report the wake it forgot: a lost worker, a dropped timer or a claim that
//! never turned into a send all look like a healthy wait from the inside. The watchdog looks at
//! the receipts instead ([`crate::health`]): every `interval` (default 5 s) it folds new audit
//! events, derives the snapshot of every *open* throttled action and diagnoses it with the wake
//! grace (default 30 s). It reads them through [`Store::watch_events`]: what has committed, no
//! queued operation waited for, and without the plain reads answered at their first attempt
//! (never throttled; only their `action_sent`, the heartbeat, is kept), so a busy gateway's
//! reads are not decoded back; what the gateway's own store committed comes from the writer's
//! in-memory feed, not from the database. Three diagnoses are findings:
//!
//! | diagnosis | metric | escalation reason (with `escalate`) |
//! |---|---|---|
//! | `stuck_missed_wake` — the scheduled retry did not start within `scheduled_retry_at + grace` | `backstop_missed_wakes_total` | `side_effect_unknown`: whether a lost worker still sends the retry is unknown, so the options start with `query_status` |
//! | `no_durable_wake` — no retry at or after the boundary is scheduled, and `throttled_at + grace` has passed (the executor records the result, then schedules: a just-throttled action is not a finding) | `backstop_missed_wakes_total` | `side_effect_unknown`, as above |
//! | `early_retry_loop` — a retry started before the provider's boundary | `backstop_early_retries_total` | `account_configuration`: repeated limits hit early point to layered retries or the account's configuration |
//!
//! Each finding is audited as a `watchdog_finding` event (`source` = the diagnosis, with the
//! scheduled job and its due time) through [`Store::record_watchdog_finding`], counted, and —
//! when [`WatchdogConfig::escalate`] is set — handed to a human as an escalation with a sanitized
//! case file ([`CaseFile::build`]). Opening an escalation ends the action `escalated` and drops
//! its unclaimed retry (the store's rule), so with `escalate` the watchdog also stops the path.
//!
//! **Once per action**: a finding already audited for an action (seen in the log, so this also
//! holds across restarts) is never raised again for that action; another finding kind for the
//! same action is raised once too. Finished actions are forgotten after each check.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use backstop_core::clock::Clock;
use backstop_core::diagnose::{diagnose, DiagnoseOptions, Diagnosis, Snapshot, WakeGrace};
use backstop_core::escalation::{
    BudgetConsumed, CaseAction, CaseAttempt, CaseFile, CaseInput, EscalationReason, ObservedHeader,
};
use backstop_core::signal_headers::retry_after_raw;
use backstop_store::{ActionId, EscalationId, JobId, Store};
use jiff::{SignedDuration, Timestamp};
use tokio::task::JoinHandle;

use crate::clock::TokioClock;
use crate::health::{
    derive_snapshot, ActionTrail, Evidence, HealthError, HealthPolicy, SnapshotContext, PAGE_EVENTS,
};
use crate::metrics::Metrics;

/// Default interval between checks (5 s).
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(5);

/// How the watchdog runs.
#[derive(Debug, Clone)]
pub struct WatchdogConfig {
    /// Time between checks (default [`DEFAULT_INTERVAL`], 5 s).
    pub interval: Duration,
    /// The wake grace (default 30 s, SPEC §10).
    pub grace: Duration,
    /// Whether a finding also opens an escalation (default `false`).
    pub escalate: bool,
    /// Class ceilings and route scopes for the snapshots.
    pub policy: Arc<HealthPolicy>,
}

impl Default for WatchdogConfig {
    fn default() -> Self {
        WatchdogConfig {
            interval: DEFAULT_INTERVAL,
            grace: backstop_core::diagnose::DEFAULT_WAKE_GRACE,
            escalate: false,
            policy: Arc::new(HealthPolicy::spec_defaults()),
        }
    }
}

/// One finding raised by [`Watchdog::check`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// The action.
    pub action: ActionId,
    /// Its run.
    pub run_id: String,
    /// `stuck_missed_wake`, `no_durable_wake` or `early_retry_loop`.
    pub diagnosis: Diagnosis,
    /// The escalation opened for it, when `escalate` is set and the case file could be built.
    pub escalation: Option<EscalationId>,
}

/// The watchdog's state between checks: the folded log and cached task deadlines.
pub struct Watchdog {
    store: Arc<dyn Store>,
    metrics: Arc<Metrics>,
    config: WatchdogConfig,
    evidence: Evidence,
    /// The `seq` of the last audit event looked at.
    cursor: u64,
    deadlines: HashMap<String, Option<Timestamp>>,
}

impl std::fmt::Debug for Watchdog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watchdog")
            .field("config", &self.config)
            .field("cursor", &self.cursor)
            .finish_non_exhaustive()
    }
}

/// Whether a diagnosis is a watchdog finding at `now` (see the module table).
fn is_finding(diagnosis: Diagnosis, snapshot: &Snapshot, now: Timestamp, grace: Duration) -> bool {
    match diagnosis {
        Diagnosis::StuckMissedWake | Diagnosis::EarlyRetryLoop => true,
        Diagnosis::NoDurableWake => {
            let grace = SignedDuration::try_from(grace).unwrap_or(SignedDuration::MAX);
            now.duration_since(snapshot.throttled_at) > grace
        }
        _ => false,
    }
}

impl Watchdog {
    /// A watchdog that has read nothing yet.
    pub fn new(store: Arc<dyn Store>, metrics: Arc<Metrics>, config: WatchdogConfig) -> Self {
        Watchdog {
            store,
            metrics,
            config,
            evidence: Evidence::new(),
            cursor: 0,
            deadlines: HashMap::new(),
        }
    }

    /// One check at `now` (blocking: reads and writes the store). Returns the findings raised
    /// now; findings raised before are not repeated.
    ///
    /// # Errors
    /// Storage errors while reading the log or a task. A failure to audit or escalate one finding
    /// is logged and does not stop the others (it is retried at the next check).
    pub fn check(&mut self, now: Timestamp) -> Result<Vec<Finding>, HealthError> {
        self.catch_up()?;
        let opts = DiagnoseOptions {
            wake_grace: WakeGrace(self.config.grace),
            ..DiagnoseOptions::default()
        };
        let heartbeat_at = self.evidence.heartbeat_at();
        let mut due = Vec::new();
        for trail in self.evidence.trails() {
            if trail.finished() || !trail.throttled() {
                continue;
            }
            let deadline = match self.deadlines.get(&trail.task) {
                Some(deadline) => *deadline,
                None => {
                    // The audit trail names the task id only; every agent's task with this
                    // id is considered, and the earliest deadline wins (warn soonest).
                    let deadline = self
                        .store
                        .tasks_of_every_agent(&trail.task)?
                        .into_iter()
                        .filter_map(|t| t.deadline)
                        .min();
                    self.deadlines.insert(trail.task.clone(), deadline);
                    deadline
                }
            };
            let ctx = SnapshotContext {
                deadline,
                policy: &self.config.policy,
                heartbeat_at,
                now,
            };
            let Some(snapshot) = derive_snapshot(trail, &ctx) else {
                continue;
            };
            let report = diagnose(&snapshot, now, &opts);
            if !is_finding(report.diagnosis, &snapshot, now, self.config.grace)
                || trail.findings.contains(report.diagnosis.as_str())
            {
                continue;
            }
            due.push((trail.clone(), snapshot, report.diagnosis));
        }
        let mut raised = Vec::new();
        for (trail, snapshot, diagnosis) in due {
            if let Some(finding) = self.raise(&trail, &snapshot, diagnosis, now) {
                self.evidence.note_finding(trail.action, diagnosis.as_str());
                raised.push(finding);
            }
        }
        self.evidence.forget_finished();
        Ok(raised)
    }

    /// Folds what was committed since the last check, through [`Store::watch_events`]: the
    /// finished plain successes (never throttled) are left out by the store, and nothing queued
    /// is waited for (an event not committed yet is folded at the next check).
    fn catch_up(&mut self) -> Result<(), HealthError> {
        loop {
            let (page, last) = self.store.watch_events(self.cursor, PAGE_EVENTS)?;
            let Some(last) = last else {
                return Ok(());
            };
            for event in &page {
                if let Err(e) = self.evidence.ingest(event) {
                    tracing::warn!(error = %e, "audit event skipped by the watchdog's fold");
                }
            }
            self.cursor = self.cursor.max(last);
        }
    }

    /// Audits, counts and (with `escalate`) escalates one finding. `None` when it could not be
    /// audited (it is tried again at the next check).
    fn raise(
        &self,
        trail: &ActionTrail,
        snapshot: &Snapshot,
        diagnosis: Diagnosis,
        now: Timestamp,
    ) -> Option<Finding> {
        let action = ActionId(trail.action);
        let job = snapshot
            .scheduler_job_id
            .as_deref()
            .and_then(|j| j.parse().ok())
            .map(JobId);
        if let Err(e) = self.store.record_watchdog_finding(
            action,
            diagnosis.as_str(),
            job,
            snapshot.scheduled_retry_at,
            now,
        ) {
            tracing::warn!(action = trail.action, error = %e, "could not audit a watchdog finding");
            return None;
        }
        match diagnosis {
            Diagnosis::EarlyRetryLoop => self.metrics.early_retry(),
            _ => self.metrics.missed_wake(),
        }
        tracing::warn!(
            task = %trail.task,
            action = trail.action,
            diagnosis = %diagnosis,
            scheduled_retry_at = ?snapshot.scheduled_retry_at,
            retry_not_before = ?snapshot.retry_not_before,
            "watchdog finding"
        );
        let escalation = if self.config.escalate {
            self.escalate(trail, snapshot, diagnosis, now)
        } else {
            None
        };
        Some(Finding {
            action,
            run_id: trail.task.clone(),
            diagnosis,
            escalation,
        })
    }

    fn escalate(
        &self,
        trail: &ActionTrail,
        snapshot: &Snapshot,
        diagnosis: Diagnosis,
        now: Timestamp,
    ) -> Option<EscalationId> {
        let input = case_input(trail, snapshot, diagnosis, self.config.grace, now);
        let case = match CaseFile::build(input) {
            Ok(case) => case,
            Err(e) => {
                tracing::warn!(action = trail.action, error = %e, "no case file for a watchdog finding");
                return None;
            }
        };
        let value = match serde_json::to_value(&case) {
            Ok(value) => value,
            Err(e) => {
                tracing::warn!(action = trail.action, error = %e, "case file not serializable");
                return None;
            }
        };
        match self
            .store
            .open_escalation(ActionId(trail.action), value, now)
        {
            Ok(id) => Some(id),
            Err(e) => {
                tracing::warn!(action = trail.action, error = %e, "could not open an escalation");
                None
            }
        }
    }
}

/// The case file inputs of a finding (SPEC §8): the action without its payload, its attempts
/// with statuses and boundaries, the budget consumed, and why.
fn case_input(
    trail: &ActionTrail,
    snapshot: &Snapshot,
    diagnosis: Diagnosis,
    grace: Duration,
    now: Timestamp,
) -> CaseInput {
    let (reason, detail) = finding_reason(snapshot, diagnosis, grace);
    let attempts = case_attempts(trail);
    CaseInput {
        opened_at: now,
        reason,
        reason_detail: detail,
        desired_outcome: None,
        action: CaseAction {
            task_id: trail.task.clone(),
            method: trail.method.clone(),
            route: trail.route.clone(),
            request_class: trail.request_class.clone(),
            payload_digest: trail.payload_digest.clone().unwrap_or_default(),
        },
        provider: trail.provider.clone(),
        scopes: vec![snapshot.quota_scope.clone()],
        fingerprint: format!("{} {}", trail.method, trail.route),
        attempts,
        budget: BudgetConsumed {
            attempts_used: snapshot.attempts_used,
            max_attempts: snapshot.max_attempts,
            wait_used_ms: snapshot.wait_used_ms,
            max_wait_ms: snapshot.wait_budget_ms,
            deadline: snapshot.outcome_deadline,
        },
        honours_key: false,
        idempotency_key: trail.idempotency_key.clone(),
        external_reference: None,
        provider_operation_id: None,
        reconciliation_query: None,
        retry_not_before: snapshot.retry_not_before,
    }
}

/// Why a finding escalates: the reason and its one-line detail.
fn finding_reason(
    snapshot: &Snapshot,
    diagnosis: Diagnosis,
    grace: Duration,
) -> (EscalationReason, String) {
    match diagnosis {
        Diagnosis::EarlyRetryLoop => (
            EscalationReason::AccountConfiguration,
            format!(
                "early_retry_loop: a retry started at {} before the provider's boundary {}; look for layered retries",
                fmt_opt(snapshot.retry_started_at),
                fmt_opt(snapshot.retry_not_before)
            ),
        ),
        Diagnosis::StuckMissedWake => (
            EscalationReason::SideEffectUnknown,
            format!(
                "stuck_missed_wake: the retry scheduled at {} (job {}) did not start within the {} ms wake grace",
                fmt_opt(snapshot.scheduled_retry_at),
                snapshot.scheduler_job_id.as_deref().unwrap_or("-"),
                grace.as_millis()
            ),
        ),
        _ => (
            EscalationReason::SideEffectUnknown,
            format!(
                "{diagnosis}: no retry at or after the boundary {} is scheduled",
                fmt_opt(snapshot.retry_not_before)
            ),
        ),
    }
}

/// The attempts of the trail as the case file lists them, with their statuses, boundaries and
/// signal headers.
fn case_attempts(trail: &ActionTrail) -> Vec<CaseAttempt> {
    trail
        .attempts
        .iter()
        .map(|(n, a)| CaseAttempt {
            n: *n,
            started_at: a.sent_at,
            finished_at: a.result.as_ref().map(|r| r.at),
            status: a.result.as_ref().and_then(|r| r.status),
            disposition: a.result.as_ref().map(|r| r.disposition.clone()),
            retry_after_raw: a
                .result
                .as_ref()
                .and_then(|r| retry_after_raw(&r.signal_headers)),
            retry_not_before: a.result.as_ref().and_then(|r| r.boundary.flatten()),
            quota_headers: a
                .result
                .iter()
                .flat_map(|r| &r.signal_headers)
                .map(|(name, value)| ObservedHeader {
                    name: name.clone(),
                    value: value.clone(),
                })
                .collect(),
        })
        .collect()
}

fn fmt_opt(at: Option<Timestamp>) -> String {
    at.map_or_else(|| "unknown".to_owned(), |t| t.to_string())
}

/// Starts the watchdog on the current tokio runtime: a check right away, then every
/// `config.interval` (a late tick delays the next one, never a burst). Each check runs on the
/// blocking pool. The task runs until aborted through the returned handle.
pub fn spawn_watchdog(
    store: Arc<dyn Store>,
    clock: TokioClock,
    metrics: Arc<Metrics>,
    config: WatchdogConfig,
) -> JoinHandle<()> {
    let interval = config.interval.max(Duration::from_millis(1));
    let mut watchdog = Some(Watchdog::new(store, metrics, config));
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            let Some(mut current) = watchdog.take() else {
                return;
            };
            let now = clock.now();
            let joined = tokio::task::spawn_blocking(move || {
                let result = current.check(now);
                (current, result)
            })
            .await;
            match joined {
                Ok((current, result)) => {
                    if let Err(e) = result {
                        tracing::warn!(error = %e, "watchdog check failed; retrying next interval");
                    }
                    watchdog = Some(current);
                }
                Err(e) => {
                    tracing::error!(error = %e, "watchdog check panicked; the watchdog stops");
                    return;
                }
            }
        }
    })
}
