//! Scope state: the table of scope records with their retry quotas and gauges, the dispatch
//! check over one action's scopes, and the views `GET /v1/scopes` shows.

use std::time::Duration;

use backstop_core::{
    budget::{ActionBudget, RetryQuota},
    pacing::{admit, Admission, AdmitRequest, ScopeRecord, ScopeState},
};
use jiff::{SignedDuration, Timestamp};
use prometheus_client::metrics::gauge::Gauge;
use serde::Serialize;

/// One scope as `GET /v1/scopes` shows it: the seed's scope record shape (`provider`, `scope`,
/// `request_class`, `next_allowed_at`, `remaining`, `reset_after_seconds`, `source`) plus the
/// live `in_flight` and `delayed` counts. Times are RFC 3339 UTC.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ScopeView {
    /// Provider name (e.g. `billing-api`).
    pub provider: String,
    /// Scope name within the provider (e.g. `account:ops-team`).
    pub scope: String,
    /// The request class the record is about; `None`: scope records here cover every class.
    pub request_class: Option<String>,
    /// No attempt of this scope leaves before this instant.
    pub next_allowed_at: Option<Timestamp>,
    /// Requests the provider says are left in the current window; `None` when unknown, also
    /// once the window it was reported for has ended (its reset, or for a `0` the boundary the
    /// scope waited for, has passed).
    pub remaining: Option<u64>,
    /// Seconds until the provider's window resets (rounded up), when a future reset is known.
    pub reset_after_seconds: Option<u64>,
    /// Where the last signal came from (e.g. `HTTP 429 Retry-After`).
    pub source: Option<String>,
    /// Attempts of this scope in flight.
    pub in_flight: u32,
    /// Actions of this scope waiting in the delayed queue.
    pub delayed: u32,
}

impl ScopeView {
    /// The view of `provider`'s scope `scope` before any record is copied in ([`refresh`]).
    pub(super) fn unfilled(provider: String, scope: String) -> Self {
        ScopeView {
            provider,
            scope,
            request_class: None,
            next_allowed_at: None,
            remaining: None,
            reset_after_seconds: None,
            source: None,
            in_flight: 0,
            delayed: 0,
        }
    }
}

/// Index of a scope in the scheduler's table.
pub(super) type ScopeId = u32;

/// The scopes of one action as indices into the scheduler's table, distinct and in name order
/// (the order the dispatch check sees them in). One scope, the common case, needs no allocation.
#[derive(Debug, Clone)]
pub(super) enum ScopeIds {
    One(ScopeId),
    Many(Box<[ScopeId]>),
}

impl Default for ScopeIds {
    fn default() -> Self {
        ScopeIds::Many(Box::default())
    }
}

impl ScopeIds {
    /// The ids, one or many alike.
    pub(super) fn as_slice(&self) -> &[ScopeId] {
        match self {
            ScopeIds::One(id) => std::slice::from_ref(id),
            ScopeIds::Many(ids) => ids,
        }
    }
}

/// One scope of the table: its record and pacer, its retry quota and its gauges.
pub(super) struct ScopeEntry {
    pub(super) provider: String,
    pub(super) state: ScopeState,
    pub(super) quota: RetryQuota,
    /// `(delayed, in_flight)` as last set on the gauges.
    pub(super) published: Option<(u32, u32)>,
    /// The scope's `delayed` and `in_flight` gauges.
    pub(super) delayed_gauge: Gauge,
    pub(super) in_flight_gauge: Gauge,
}

impl ScopeEntry {
    /// Sets the gauges whose count moved since they were last set.
    pub(super) fn sync_gauges(&mut self) {
        let record = &self.state.record;
        let counts = (record.delayed, record.in_flight);
        if self.published == Some(counts) {
            return;
        }
        if self
            .published
            .is_none_or(|(delayed, _)| delayed != counts.0)
        {
            self.delayed_gauge.set(i64::from(counts.0));
        }
        if self
            .published
            .is_none_or(|(_, in_flight)| in_flight != counts.1)
        {
            self.in_flight_gauge.set(i64::from(counts.1));
        }
        self.published = Some(counts);
    }
}

/// The latest future `next_allowed_at` among `ids`.
pub(super) fn latest_boundary(
    scopes: &[ScopeEntry],
    ids: &ScopeIds,
    now: Timestamp,
) -> Option<Timestamp> {
    ids.as_slice()
        .iter()
        .filter_map(|&id| scopes[id as usize].state.record.next_allowed_at)
        .filter(|at| *at > now)
        .max()
}

/// The dispatch check ([`admit`]) of one action over its scopes, in name order.
pub(super) fn admit_scopes(
    scopes: &mut [ScopeEntry],
    ids: &ScopeIds,
    request: AdmitRequest,
    budget: &mut ActionBudget,
    now: Timestamp,
) -> Admission {
    match ids {
        ScopeIds::One(id) => {
            let mut state = &mut scopes[*id as usize].state;
            admit(request, budget, std::slice::from_mut(&mut state), now)
        }
        ScopeIds::Many(ids) => {
            // Distinct indices: each entry is borrowed once; then in name order.
            let mut refs: Vec<&mut ScopeState> = scopes
                .iter_mut()
                .enumerate()
                .filter(|(id, _)| ids.iter().any(|want| *want as usize == *id))
                .map(|(_, entry)| &mut entry.state)
                .collect();
            refs.sort_by(|a, b| a.record.name.cmp(&b.record.name));
            admit(request, budget, &mut refs, now)
        }
    }
}

/// Copies a record's live fields into its view. `remaining` counts the provider's current
/// window only: once the window it was reported for has ended — the reported reset, or, for a
/// `0` (a 429, or an exhausted quota), the boundary the scope waited for, whichever is later —
/// the count is not known to hold any more and the view shows none (`null`) until the next
/// signal.
pub(super) fn refresh(view: &mut ScopeView, record: &ScopeRecord, now: Timestamp) {
    view.next_allowed_at = record.next_allowed_at;
    let blocked_until = record
        .next_allowed_at
        .filter(|_| record.remaining == Some(0));
    let window_end = match (record.reset_at, blocked_until) {
        (Some(reset), Some(blocked)) => Some(reset.max(blocked)),
        (reset, blocked) => reset.or(blocked),
    };
    view.remaining = record
        .remaining
        .filter(|_| window_end.is_none_or(|end| end > now));
    view.reset_after_seconds = record.reset_at.filter(|r| *r > now).map(|r| {
        let d = positive(r.duration_since(now));
        d.as_secs() + u64::from(d.subsec_nanos() > 0)
    });
    if view.source != record.source {
        view.source.clone_from(&record.source);
    }
    view.in_flight = record.in_flight;
    view.delayed = record.delayed;
}

/// `d`, or zero when it is negative.
pub(super) fn positive(d: SignedDuration) -> Duration {
    Duration::try_from(d).unwrap_or(Duration::ZERO)
}
