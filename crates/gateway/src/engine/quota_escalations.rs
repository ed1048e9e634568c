//! Escalating an exhausted shared quota, once per scope (SPEC §8: "escalate when … the shared
//! quota is exhausted").
//!
//! Why once per scope: a `quota_exhausted` answer (OpenAI `insufficient_quota`, a billing hard
//! limit, a used-up daily quota) is about the account, not the request. Every task of the scope
//! meets it until someone raises the quota, changes the plan or the reset comes; a case file per
//! task would bury the one decision under copies of it. So the first action that ends
//! `quota_exhausted` because the provider said so opens a `shared_quota_exhausted` escalation
//! beside its outcome, and later ones in the same scope open none while that escalation is open
//! and its window (the case file's `retry_not_before`, the reset when the provider gave one) has
//! not passed. With an unknown reset, the open escalation covers the scope until it is decided.
//!
//! The options are the core's for the reason — `wait` (until the reset, when known),
//! `raise_quota`, `change_plan`, `abort` — worded for an action that has already ended: backstop
//! holds nothing and sends nothing more, the agent resubmits. A read is escalated the same way;
//! its case file names it by method, route template and the digest of its empty payload, and its
//! reason says it carries no payload. Nothing is sent for any of this: no probe, no retry.
//!
//! # Repeated limits: `account_configuration`
//! SPEC §8 also escalates when "repeated limits point to account configuration". The rule here:
//! [`ACCOUNT_CONFIGURATION_STREAK`] (5) `rate_limited` answers in a row in a scope, over all its
//! tasks, with no success between them (other answers neither count nor break the run), and then
//! an action of the scope ends `budget_exhausted` or `deadline_exhausted` after its own attempt.
//! Backoff and Retry-After were honoured and the work still did not fit, so the plan or tier the
//! account runs under is the likely cause, not a passing burst. That action opens one
//! `account_configuration` escalation beside its outcome; none more opens for the scope while it
//! is open. The run is counted in memory (a restart starts it again from zero).

use std::collections::HashMap;

use backstop_core::classify::Disposition;
use backstop_core::escalation::{CaseFile, EscalationReason};
use backstop_store::{ActionId, EscalationId};
use jiff::Timestamp;

use super::{Engine, EngineError, Inner};
use crate::action::Execution;

/// `rate_limited` answers in a row in a scope, with no success between them, after which an
/// action of the scope that ends `budget_exhausted` or `deadline_exhausted` opens an
/// `account_configuration` escalation (see the module docs).
pub const ACCOUNT_CONFIGURATION_STREAK: u32 = 5;

/// Runs of `rate_limited` answers per scope (key: the full scope name, or the provider's name
/// for a route without scopes).
#[derive(Debug, Default)]
pub(super) struct LimitStreaks {
    runs: HashMap<String, u32>,
}

impl LimitStreaks {
    /// Whether noting an answer with `disposition` can change any run: `rate_limited` always
    /// does, `success` only while some run is counted, anything else never. The common plain
    /// success of a scope without throttling then costs no key list.
    pub(super) fn would_change(&self, disposition: Disposition) -> bool {
        match disposition {
            Disposition::RateLimited => true,
            Disposition::Success => !self.runs.is_empty(),
            _ => false,
        }
    }

    /// Counts one answer in `keys`: `rate_limited` lengthens each run, `success` ends it, any
    /// other disposition leaves it.
    pub(super) fn note(&mut self, keys: &[String], disposition: Disposition) {
        match disposition {
            Disposition::RateLimited => {
                for key in keys {
                    let run = self.runs.entry(key.clone()).or_insert(0);
                    *run = run.saturating_add(1);
                }
            }
            Disposition::Success => {
                for key in keys {
                    self.runs.remove(key);
                }
            }
            _ => {}
        }
    }

    /// The longest current run among `keys`.
    pub(super) fn longest(&self, keys: &[String]) -> u32 {
        keys.iter()
            .filter_map(|k| self.runs.get(k))
            .copied()
            .max()
            .unwrap_or(0)
    }
}

/// The keys a route's answers are counted under: its scopes, or its provider without scopes.
pub(super) fn streak_keys(provider: &str, scopes: &[String]) -> Vec<String> {
    if scopes.is_empty() {
        vec![provider.to_owned()]
    } else {
        scopes.to_vec()
    }
}

/// The detail of an action ended `quota_exhausted` by the provider (SPEC §2.1): until which
/// reset, or — when the provider gave none (the boundary is unknown) — that no reset is known,
/// so no retry time can be named.
pub(super) fn exhausted_detail(reset: Option<Timestamp>, error_code: Option<&str>) -> String {
    // The provider's own code, as its SDKs and docs name the case (`insufficient_quota`): the
    // answer is backstop's problem document, not the provider's body.
    let code = error_code
        .map(|code| format!(" (the provider answered `{code}`)"))
        .unwrap_or_default();
    match reset {
        Some(at) => format!("the provider's quota is exhausted{code} until its reset at {at}"),
        None => format!("the provider's quota is exhausted{code} and the provider gave no reset instant, so there is no known time at which a retry would be allowed"),
    }
}

/// What [`Inner::escalate_scope_once`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum QuotaEscalation {
    /// A new `shared_quota_exhausted` escalation was opened.
    Opened(EscalationId),
    /// One for the same scope is open and its window has not passed: none was opened.
    AlreadyOpen(EscalationId),
}

/// Whether an open case file covers `scopes` of `provider` at `now` for `reason`: same reason,
/// a shared scope (or, for routes without scopes, the same provider with none), and — for an
/// exhausted quota — its reset not yet passed.
fn covers(
    case: &CaseFile,
    reason: EscalationReason,
    provider: &str,
    scopes: &[String],
    now: Timestamp,
) -> bool {
    let same_scope = if scopes.is_empty() {
        case.scopes.is_empty() && case.provider == provider
    } else {
        case.scopes.iter().any(|s| scopes.contains(s))
    };
    let in_window = reason != EscalationReason::SharedQuotaExhausted
        || case.retry_not_before.is_none_or(|reset| reset > now);
    case.reason == reason && same_scope && in_window
}

impl Inner {
    /// Opens a `reason` escalation beside the outcome `action` ended with, unless one for the
    /// same scope is open (and, for an exhausted quota, its window has not passed). `why` says
    /// what the provider answered; `reset` is the boundary the `wait` option waits for.
    ///
    /// # Errors
    /// The action is not in the store, the case file could not be built, or the store failed.
    pub(super) async fn escalate_scope_once(
        &self,
        action: ActionId,
        reason: EscalationReason,
        why: &str,
        reset: Option<Timestamp>,
    ) -> Result<QuotaEscalation, EngineError> {
        let (record, facts) = self.ended_action(action).await?;
        // One look-and-open at a time: actions meeting the quota together open one escalation.
        let _one_at_a_time = self.quota_escalations.lock().await;
        let now = backstop_core::clock::Clock::now(&self.clock);
        let open = self.blocking(|s| s.open_escalations()).await?;
        if let Some(existing) = open.iter().find(|e| {
            CaseFile::from_json(&e.case_file)
                .is_ok_and(|case| covers(&case, reason, &facts.provider, &facts.scopes, now))
        }) {
            return Ok(QuotaEscalation::AlreadyOpen(existing.id));
        }
        let read = record.key().is_none();
        let reset_words = match reset {
            Some(at) => format!("until its reset at {at}"),
            None => "and the provider gave no reset instant".to_owned(),
        };
        let scope_words = if facts.scopes.is_empty() {
            format!("provider `{}`", facts.provider)
        } else {
            format!("scope {}", facts.scopes.join(", "))
        };
        let read_words = if read {
            "; this action is a read: it carries no payload and no idempotency key"
        } else {
            ""
        };
        let detail = match reason {
            EscalationReason::SharedQuotaExhausted => format!(
                "the shared quota of {scope_words} is exhausted ({why}) {reset_words}; every \
                 request in the scope meets it until the quota is raised, the plan changes or \
                 the reset comes{read_words}"
            ),
            _ => format!("{scope_words}: {why}{read_words}"),
        };
        let idempotency_key = record.key().map(str::to_owned);
        let ended = record.outcome.map_or("ended", |o| o.as_str());
        let escalation = self
            .open_beside_outcome(&facts, ended, reason, &detail, reset, idempotency_key)
            .await?;
        tracing::warn!(
            action = action.0,
            escalation = escalation.0,
            provider = %facts.provider,
            scopes = %facts.scopes.join(","),
            reason = reason.as_str(),
            "escalated for the scope: a human must decide"
        );
        Ok(QuotaEscalation::Opened(escalation))
    }
}

impl Engine {
    /// After an action ended `quota_exhausted` because the provider said the quota itself is
    /// exhausted: opens (or finds open) the scope's `shared_quota_exhausted` escalation and names
    /// it in the outcome's detail. A failure is logged and said in the detail; the outcome
    /// stands either way.
    pub(super) async fn escalate_exhausted_quota(
        &self,
        action: ActionId,
        why: &str,
        reset: Option<Timestamp>,
        execution: &mut Execution,
    ) {
        let reason = EscalationReason::SharedQuotaExhausted;
        let opened = self
            .inner
            .escalate_scope_once(action, reason, why, reset)
            .await;
        note_escalation(action, reason, opened, execution);
    }

    /// After an action of a scope with [`ACCOUNT_CONFIGURATION_STREAK`] or more `rate_limited`
    /// answers in a row ended `budget_exhausted`/`deadline_exhausted`: opens (or finds open) the
    /// scope's `account_configuration` escalation and names it in the outcome's detail.
    pub(super) async fn escalate_repeated_limits(
        &self,
        action: ActionId,
        streak: u32,
        boundary: Option<Timestamp>,
        execution: &mut Execution,
    ) {
        let reason = EscalationReason::AccountConfiguration;
        let why = format!(
            "{streak} rate_limited answers in a row with no success between them, and this \
             action still ran out of budget although backoff and Retry-After were honoured: \
             repeated limits point to the account's plan, tier or configured limit"
        );
        let opened = self
            .inner
            .escalate_scope_once(action, reason, &why, boundary)
            .await;
        note_escalation(action, reason, opened, execution);
    }
}

/// Names the escalation (opened, already open, or why not) in the outcome's detail.
fn note_escalation(
    action: ActionId,
    reason: EscalationReason,
    opened: Result<QuotaEscalation, EngineError>,
    execution: &mut Execution,
) {
    let note = match opened {
        Ok(QuotaEscalation::Opened(id)) => format!(
            "; escalation {} is open for an operator ({})",
            id.0,
            reason.as_str()
        ),
        Ok(QuotaEscalation::AlreadyOpen(id)) => format!(
            "; escalation {} for this scope ({}) is already open for an operator",
            id.0,
            reason.as_str()
        ),
        Err(e) => {
            tracing::warn!(action = action.0, error = %e, "could not open the escalation");
            format!("; the escalation could not be opened: {e}")
        }
    };
    if let Execution::Outcome { detail, .. } = execution {
        detail.push_str(&note);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use backstop_core::escalation::{CaseAction, CaseInput};

    const Q: EscalationReason = EscalationReason::SharedQuotaExhausted;

    #[test]
    fn the_exhausted_detail_names_the_reset_only_when_one_is_known() {
        let reset: Timestamp = "2026-01-01T00:00:00Z".parse().expect("instant");
        assert_eq!(
            exhausted_detail(Some(reset), None),
            "the provider's quota is exhausted until its reset at 2026-01-01T00:00:00Z"
        );
        assert_eq!(
            exhausted_detail(Some(reset), Some("insufficient_quota")),
            "the provider's quota is exhausted (the provider answered `insufficient_quota`) \
             until its reset at 2026-01-01T00:00:00Z"
        );
        let unknown = exhausted_detail(None, None);
        assert!(unknown.contains("gave no reset instant"), "{unknown}");
        assert!(!unknown.contains("until its reset"), "{unknown}");
    }

    fn case(reason: EscalationReason, scopes: &[&str], reset: Option<&str>) -> CaseFile {
        CaseFile::build(CaseInput {
            opened_at: "2026-01-01T00:00:00Z".parse().expect("instant"),
            reason,
            action: CaseAction {
                task_id: "t".into(),
                method: "GET".into(),
                route: "/v1/x".into(),
                request_class: "read".into(),
                payload_digest: "0".repeat(64),
            },
            provider: "llm".into(),
            scopes: scopes.iter().map(|s| (*s).to_owned()).collect(),
            retry_not_before: reset.map(|r| r.parse().expect("instant")),
            ..CaseInput::default()
        })
        .expect("case")
    }

    #[test]
    fn an_open_quota_escalation_covers_its_scope_until_its_reset() {
        let now: Timestamp = "2026-01-01T00:10:00Z".parse().expect("instant");
        let scopes = vec!["llm/project:a".to_owned()];
        let open = case(
            EscalationReason::SharedQuotaExhausted,
            &["llm/project:a", "llm/org"],
            Some("2026-01-01T01:00:00Z"),
        );
        assert!(covers(&open, Q, "llm", &scopes, now));
        let unknown_reset = case(
            EscalationReason::SharedQuotaExhausted,
            &["llm/project:a"],
            None,
        );
        assert!(covers(&unknown_reset, Q, "llm", &scopes, now));
        let passed = case(
            EscalationReason::SharedQuotaExhausted,
            &["llm/project:a"],
            Some("2026-01-01T00:09:59Z"),
        );
        assert!(
            !covers(&passed, Q, "llm", &scopes, now),
            "its window has passed"
        );
        let other_scope = case(
            EscalationReason::SharedQuotaExhausted,
            &["llm/project:b"],
            None,
        );
        assert!(!covers(&other_scope, Q, "llm", &scopes, now));
        let other_reason = case(
            EscalationReason::RemainingWaitExceedsDeadline,
            &["llm/project:a"],
            None,
        );
        assert!(!covers(&other_reason, Q, "llm", &scopes, now));
        let unscoped = case(EscalationReason::SharedQuotaExhausted, &[], None);
        assert!(covers(&unscoped, Q, "llm", &[], now));
        assert!(!covers(&unscoped, Q, "other", &[], now));
    }

    #[test]
    fn an_account_configuration_escalation_covers_its_scope_while_open_whatever_its_boundary() {
        let now: Timestamp = "2026-01-01T00:10:00Z".parse().expect("instant");
        let a = EscalationReason::AccountConfiguration;
        let passed = case(a, &["llm/project:a"], Some("2026-01-01T00:00:01Z"));
        let scopes = vec!["llm/project:a".to_owned()];
        assert!(covers(&passed, a, "llm", &scopes, now));
        assert!(!covers(&passed, Q, "llm", &scopes, now), "another reason");
    }

    #[test]
    fn a_streak_counts_limits_in_a_row_and_ends_at_a_success() {
        let a = vec!["llm/a".to_owned()];
        let both = vec!["llm/a".to_owned(), "llm/b".to_owned()];
        let mut streaks = LimitStreaks::default();
        for _ in 0..3 {
            streaks.note(&a, Disposition::RateLimited);
        }
        streaks.note(&both, Disposition::Transient);
        streaks.note(&both, Disposition::RateLimited);
        assert_eq!(
            streaks.longest(&a),
            4,
            "a transient answer neither counts nor breaks it"
        );
        assert_eq!(streaks.longest(&["llm/b".to_owned()]), 1);
        assert_eq!(streaks.longest(&both), 4);
        streaks.note(&a, Disposition::Success);
        assert_eq!(streaks.longest(&a), 0);
        assert_eq!(streaks.longest(&both), 1);
        assert_eq!(streak_keys("llm", &[]), vec!["llm".to_owned()]);
        assert_eq!(streak_keys("llm", &both), both);
    }

    #[test]
    fn only_answers_that_can_change_a_run_are_noted() {
        let a = vec!["llm/a".to_owned()];
        let mut streaks = LimitStreaks::default();
        assert!(streaks.would_change(Disposition::RateLimited));
        assert!(
            !streaks.would_change(Disposition::Success),
            "no run to end yet"
        );
        assert!(!streaks.would_change(Disposition::Transient));
        streaks.note(&a, Disposition::RateLimited);
        assert!(streaks.would_change(Disposition::Success));
        assert!(!streaks.would_change(Disposition::Unavailable));
        streaks.note(&a, Disposition::Success);
        assert!(
            !streaks.would_change(Disposition::Success),
            "the only run has ended"
        );
    }
}
