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

use backstop_core::escalation::{CaseFile, EscalationReason};
use backstop_store::{ActionId, EscalationId};
use jiff::Timestamp;

use super::{Engine, EngineError, Inner};
use crate::action::Execution;

/// What [`Inner::escalate_quota_once`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum QuotaEscalation {
    /// A new `shared_quota_exhausted` escalation was opened.
    Opened(EscalationId),
    /// One for the same scope is open and its window has not passed: none was opened.
    AlreadyOpen(EscalationId),
}

/// Whether an open case file covers `scopes` of `provider` at `now`: same reason, a shared scope
/// (or, for routes without scopes, the same provider with none), and its reset not yet passed.
fn covers(case: &CaseFile, provider: &str, scopes: &[String], now: Timestamp) -> bool {
    let same_scope = if scopes.is_empty() {
        case.scopes.is_empty() && case.provider == provider
    } else {
        case.scopes.iter().any(|s| scopes.contains(s))
    };
    case.reason == EscalationReason::SharedQuotaExhausted
        && same_scope
        && case.retry_not_before.is_none_or(|reset| reset > now)
}

impl Inner {
    /// Opens a `shared_quota_exhausted` escalation beside the `quota_exhausted` outcome of
    /// `action`, unless one for the same scope is open and its window has not passed.
    ///
    /// # Errors
    /// The action is not in the store, the case file could not be built, or the store failed.
    pub(super) async fn escalate_quota_once(
        &self,
        action: ActionId,
        why: &str,
        reset: Option<Timestamp>,
    ) -> Result<QuotaEscalation, EngineError> {
        let record = self
            .blocking(move |s| s.action(action))
            .await?
            .ok_or_else(|| {
                EngineError::Aborted(format!("action {} is not in the store", action.0))
            })?;
        let facts = self.facts_of(&record, backstop_core::pacing::Priority::Interactive);
        // One look-and-open at a time: actions meeting the quota together open one escalation.
        let _one_at_a_time = self.quota_escalations.lock().await;
        let now = backstop_core::clock::Clock::now(&self.clock);
        let open = self.blocking(|s| s.open_escalations()).await?;
        if let Some(existing) = open.iter().find(|e| {
            CaseFile::from_json(&e.case_file)
                .is_ok_and(|case| covers(&case, &facts.provider, &facts.scopes, now))
        }) {
            return Ok(QuotaEscalation::AlreadyOpen(existing.id));
        }
        let read = record.key().is_none();
        let reset_words = match reset {
            Some(at) => format!("until its reset at {at}"),
            None => "and the provider gave no reset instant".to_owned(),
        };
        let detail = format!(
            "the shared quota of {} is exhausted ({why}) {reset_words}; every request in the \
             scope meets it until the quota is raised, the plan changes or the reset comes{}",
            if facts.scopes.is_empty() {
                format!("provider `{}`", facts.provider)
            } else {
                format!("scope {}", facts.scopes.join(", "))
            },
            if read {
                "; this action is a read: it carries no payload and no idempotency key"
            } else {
                ""
            }
        );
        let idempotency_key = record.key().map(str::to_owned);
        let ended = record.outcome.map_or("ended", |o| o.as_str());
        let case = self
            .case_file(
                &facts,
                EscalationReason::SharedQuotaExhausted,
                &detail,
                reset,
                idempotency_key,
            )
            .await?
            .beside_outcome(ended);
        let at = case.opened_at;
        let json = case.to_json();
        let escalation = self
            .blocking(move |s| s.open_escalation_beside_outcome(action, json, at))
            .await?;
        tracing::warn!(
            action = action.0,
            escalation = escalation.0,
            provider = %facts.provider,
            scopes = %facts.scopes.join(","),
            "escalated: the shared quota is exhausted; a human must decide"
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
        let note = match self.inner.escalate_quota_once(action, why, reset).await {
            Ok(QuotaEscalation::Opened(id)) => format!(
                "; escalation {} is open for an operator (shared_quota_exhausted)",
                id.0
            ),
            Ok(QuotaEscalation::AlreadyOpen(id)) => format!(
                "; escalation {} for this scope's exhausted quota is already open for an operator",
                id.0
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use backstop_core::escalation::{CaseAction, CaseInput};

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
        assert!(covers(&open, "llm", &scopes, now));
        let unknown_reset = case(
            EscalationReason::SharedQuotaExhausted,
            &["llm/project:a"],
            None,
        );
        assert!(covers(&unknown_reset, "llm", &scopes, now));
        let passed = case(
            EscalationReason::SharedQuotaExhausted,
            &["llm/project:a"],
            Some("2026-01-01T00:09:59Z"),
        );
        assert!(
            !covers(&passed, "llm", &scopes, now),
            "its window has passed"
        );
        let other_scope = case(
            EscalationReason::SharedQuotaExhausted,
            &["llm/project:b"],
            None,
        );
        assert!(!covers(&other_scope, "llm", &scopes, now));
        let other_reason = case(
            EscalationReason::RemainingWaitExceedsDeadline,
            &["llm/project:a"],
            None,
        );
        assert!(!covers(&other_reason, "llm", &scopes, now));
        let unscoped = case(EscalationReason::SharedQuotaExhausted, &[], None);
        assert!(covers(&unscoped, "llm", &[], now));
        assert!(!covers(&unscoped, "other", &[], now));
    }
}
