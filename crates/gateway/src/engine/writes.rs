//! Writes that never duplicate: reconciling uncertain writes, escalating what cannot be decided,
//! and resuming both after a restart (SPEC §6, §8, §12).
//!
//! Why a separate path: after a timeout, reset or EOF once the request's bytes left, the provider
//! may or may not have acted. A blind resend could create a second payment, message or
//! deployment. The engine therefore never treats an `uncertain` write like any other retryable
//! failure; it follows [`next_step_after_uncertain`]:
//!
//! 1. with a configured lookup, ask the provider (a safe read, sent through the same scopes and
//!    the same transport, audited as `reconciliation_lookup`);
//! 2. found → `succeeded` (reconciled, the provider's operation id stored, audited `reconciled`);
//! 3. not found and the provider honours the idempotency key → resend with the SAME key;
//! 4. otherwise (not found without key support, an inconclusive lookup, or neither a key nor a
//!    lookup) → `escalated` with a sanitized [`CaseFile`].
//!
//! The same rule runs at start-up for every write attempt the store recorded as `sent` without a
//! result (the gateway died while the request was in flight): the attempt is recorded
//! `uncertain`, then reconciled with its ORIGINAL key; a write that must be resent is resent from
//! its kept request (see [`super::resume`]), and one whose request was not kept is escalated
//! instead (an operator or the agent resubmitting the same key and payload decides). So is every
//! other write whose last attempt was
//! `uncertain` and that nothing will send again (`Closing`, the one decision for all of them):
//! left between two attempts by the previous run, a retry re-armed after a restart, a retry whose
//! schedule or start the store could not record (once the store commits again, see
//! [`Inner::record_when_store_commits`]), one whose caller disconnected, or one whose task was
//! cancelled (see [`super::cancelled`]). Such a write never
//! ends `cancelled`: the provider may have acted on it.

use std::time::Duration;

use backstop_core::{
    budget::{ActionBudget, ClassBudget},
    clock::Clock,
    escalation::ObservedHeader,
    escalation::{
        BudgetConsumed, CaseAction, CaseAttempt, CaseFile, CaseInput, DecisionOption,
        EscalationReason,
    },
    outcome::{NextSafe, OutcomeContext},
    pacing::Priority,
    policy::{Reconcile, ReconcileBy},
    reconcile::{
        interpret_lookup, lookup_request, lookup_template, next_step_after_uncertain,
        operation_id_at, upstream_idempotency_key, LookupVerdict, UncertainNextStep,
    },
    signal_headers::retry_after_raw,
};
use backstop_store::{
    ActionId, ActionRecord, AttemptRecord, AttemptResult, Disposition as StoreDisposition,
    EscalationId,
};
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method};

use super::{read_bounded, EngineError, Inner, ERROR_BODY_LIMIT};
use crate::{
    scheduler::{AcquireRequest, Acquired},
    transport::{AttemptReply, AttemptRequest},
};

/// The reason a re-armed retry, or an action left between two attempts, is closed after a
/// restart (its action ends `cancelled`): any action but a write whose last attempt was
/// `uncertain`, which is reconciled instead (`Closing`).
pub const RESTARTED_BEFORE_RETRY: &str =
    "the gateway restarted before the retry; the caller's request is gone — resubmit";

/// The reason an action whose retry the store could not record is closed (it ends
/// `cancelled`): the store failed when the retry was planned (its schedule) or when it came due
/// (its start, the `action_sent` that claims its job), so nothing of the retry was sent and its
/// caller was answered `503 store_unavailable`. A write whose last attempt was `uncertain` is
/// reconciled instead (`Closing`).
pub const STORE_FAILED_BEFORE_RETRY: &str = "the store could not record this action's retry (its schedule, or its start when it came due), so the retry was not sent and its caller was answered 503 store_unavailable; the action is closed and nothing more is sent for it";

/// How long the gateway keeps trying to record what the store could not commit for an action
/// (its outcome, its last attempt's result, the close of a retry that could not be recorded):
/// 1 h, the store being tried again after 1 s, then after twice the previous wait, at most
/// every `STORE_RETRY_MAX_WAIT`. Past it the action is left as the store has it, and the next
/// start recovers it (SPEC §12).
pub const DEFERRED_RECORD_WINDOW: Duration = Duration::from_secs(3600);

/// The first wait before the store is tried again for what it could not record.
const STORE_RETRY_FIRST_WAIT: Duration = Duration::from_secs(1);

/// The longest wait between two tries of the store for what it could not record.
const STORE_RETRY_MAX_WAIT: Duration = Duration::from_secs(60);

/// The longest a reconciliation lookup may wait for its scopes (pacing, `next_allowed_at`).
pub(super) const LOOKUP_MAX_WAIT: Duration = Duration::from_secs(60);

/// A reconciliation that was not run because the gateway is shutting down: its lookup was never
/// sent (the scheduler takes no more work), and a write without one is not escalated or resent
/// either. Nothing is audited or counted for it, and the write it was
/// for is left as the store has it — an attempt sent without a result, or one recorded
/// `uncertain` — for the next start to reconcile with its original key (SPEC §12): our own stop
/// is no evidence about the write, so it never escalates one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct LookupNotSent;

/// A reconciliation lookup handed to the transport, until its answer is read. When the future
/// that sent it is dropped first (the write's caller went away), the lookup may still have
/// reached the provider, so it is counted (`inconclusive`) and audited as a
/// `reconciliation_lookup` with an unknown status and the verdict `inconclusive`, as every
/// lookup that leaves is.
struct LookupInFlight {
    store: std::sync::Arc<dyn backstop_store::Store>,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
    provider: String,
    action: ActionId,
    task: String,
    lookup: String,
    /// When it was sent: the audited instant.
    at: jiff::Timestamp,
    /// Cleared once the answer was read (`Inner::lookup` counts and audits it then).
    armed: bool,
}

impl Drop for LookupInFlight {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let word = "inconclusive";
        self.metrics.lookup(&self.provider, word);
        tracing::info!(
            action = self.action.0,
            task = %self.task,
            lookup = %self.lookup,
            verdict = word,
            "reconciliation lookup abandoned: its caller went away (or the stop's grace ran out) after it was sent, so its answer is unknown; counted and audited as inconclusive"
        );
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (store, action, lookup, at) = (
            self.store.clone(),
            self.action,
            std::mem::take(&mut self.lookup),
            self.at,
        );
        runtime.spawn_blocking(move || {
            if let Err(e) = store.record_reconciliation_lookup(action, &lookup, None, word, at) {
                tracing::warn!(action = action.0, error = %e, "could not audit the abandoned reconciliation lookup");
            }
        });
    }
}

/// Everything about one write that reconciliation and a case file need (no payload).
#[derive(Debug, Clone)]
pub(super) struct WriteFacts {
    pub(super) action: ActionId,
    pub(super) task_id: String,
    /// The agent whose task it is (task ids are namespaced per agent).
    pub(super) agent: String,
    pub(super) priority: Priority,
    pub(super) provider: String,
    pub(super) method: String,
    pub(super) route: String,
    pub(super) class: String,
    pub(super) scopes: Vec<String>,
    pub(super) payload_digest: String,
    /// The idempotency key as the agent knows it (reused by `retry_same_key`).
    pub(super) idempotency_key: String,
    /// The key the provider knows (derived from agent and key): lookups ask with this one.
    pub(super) upstream_key: String,
    pub(super) external_reference: Option<String>,
    pub(super) provider_operation_id: Option<String>,
    pub(super) fingerprint: String,
    pub(super) desired_outcome: Option<String>,
    pub(super) reconcile: Option<Reconcile>,
    pub(super) max_attempts: u32,
    pub(super) max_wait: Duration,
    pub(super) deadline: Option<jiff::Timestamp>,
    pub(super) wait_used_ms: u64,
}

/// Where the SPEC §6 rule ended for one uncertain write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum UncertainEnd {
    /// The lookup found the write (`operation_id` when known).
    Found {
        /// The provider's operation id.
        operation_id: Option<String>,
    },
    /// Resend with the same key.
    RetrySameKey,
    /// A human decides; the reason in plain words.
    Escalate {
        /// Why.
        reason: String,
    },
}

/// Why the payload of a write recovered from the store is gone, so that not even a resend
/// under its same key can be made automatically (the agent or an operator decides).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PayloadGone {
    /// The gateway restarted, and the write's request was not kept (its body over
    /// `--retry-body-bytes`, or a header that is not text) or could not be resumed (its store
    /// failed at the restart).
    Restart,
    /// The store could not record the write's retry: its caller was answered
    /// `503 store_unavailable`, and the payload went with that request.
    StoreFailed,
    /// The write's caller disconnected before its outcome was known, and the payload went with
    /// its request.
    CallerGone,
    /// The write's task was cancelled: nothing of it is sent again, not even under its key.
    TaskCancelled,
}

impl PayloadGone {
    /// The words for it in an escalation's reason.
    fn words(self) -> &'static str {
        match self {
            PayloadGone::Restart => {
                "the gateway restarted and the write's request is not kept (its body was over --retry-body-bytes) or could not be resumed from the store"
            }
            PayloadGone::StoreFailed => {
                "the payload went with its caller's request, answered 503 store_unavailable when the store could not record the retry"
            }
            PayloadGone::CallerGone => {
                "the payload went with its caller's request, which was dropped (the client disconnected) before the write's outcome was known"
            }
            PayloadGone::TaskCancelled => {
                "its task was cancelled, so nothing of it is sent again, not even under its key"
            }
        }
    }
}

/// How an action is closed when nothing more will be sent for it and no caller waits for its
/// outcome: a retry re-armed after a restart, an action the previous run left between two
/// attempts, a retry whose schedule or start the store could not record, an action whose caller
/// disconnected, an action of a cancelled task (see [`super::cancelled`]). Every one of these
/// paths takes this one decision (SPEC §6, §12): a write with
/// an unsettled attempt — sent, no answer known, and no later answer under the same key that
/// settles it ([`still_unsettled`]) — may have been acted on by the provider, so it is reconciled with its original key (found → `succeeded`, otherwise
/// `escalated`), never ended `cancelled` as if nothing had happened; any other action ends
/// `cancelled` with the path's reason. Nothing is sent either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Closing {
    /// Reconcile the write with its original key, then close it.
    Reconcile,
    /// End the action `cancelled`, with a reason.
    Cancel,
}

impl Closing {
    /// The closing of a read (`is_read`) or a write, `unsettled` when one of its attempts may
    /// have been acted on and no later answer settled it (see [`still_unsettled`]).
    pub(super) fn of(is_read: bool, unsettled: bool) -> Closing {
        if !is_read && unsettled {
            Closing::Reconcile
        } else {
            Closing::Cancel
        }
    }

    /// The closing of a stored action from its stored `attempts`: an attempt recorded as sent
    /// without a result is `uncertain` (SPEC §12).
    pub(super) fn of_stored(
        policy: &backstop_core::policy::Policy,
        record: &ActionRecord,
        attempts: &[AttemptRecord],
    ) -> Closing {
        Closing::of(
            stored_read(policy, &record.request_class, &record.method),
            unsettled_in(attempts),
        )
    }
}

/// Whether a write may have been acted on and nothing has settled it, after one more attempt
/// ended with the disposition `answer` (`uncertain`, `rate_limited`, …), given whether it was
/// so before (`unsettled`): the store's one rule, [`StoreDisposition::leaves_unsettled`] —
/// only a `success` or a `rejected` answer to a later attempt under the same key settles an
/// `uncertain` one (SPEC §6).
pub(super) fn still_unsettled(unsettled: bool, answer: &str) -> bool {
    StoreDisposition::parse(answer).map_or(unsettled, |d| d.leaves_unsettled(unsettled))
}

/// [`still_unsettled`] over stored `attempts`, oldest first (one sent without a result is
/// `uncertain`): [`backstop_store::unsettled_attempt`] names the attempt.
pub(super) fn unsettled_in(attempts: &[AttemptRecord]) -> bool {
    backstop_store::unsettled_attempt(attempts).is_some()
}

/// Whether the write `record` provably created nothing at the provider: it ended without
/// succeeding, and each of its `attempts` was refused by the provider or never reached it — a
/// 429, a quota signal, a 503/529, a `not_sent` failure, a 4xx rejection. A `transient` 5xx,
/// a `409` or an `uncertain` attempt may have been acted on, so such a write proves nothing.
pub(super) fn created_nothing(record: &ActionRecord, attempts: &[AttemptRecord]) -> bool {
    use backstop_store::Disposition as D;
    let ended = record.state == backstop_store::ActionState::Finished
        && record.outcome != Some(backstop_store::Outcome::Succeeded);
    ended
        && attempts.iter().all(|a| {
            matches!(
                a.disposition,
                Some(
                    D::RateLimited | D::QuotaExhausted | D::Unavailable | D::NotSent | D::Rejected
                )
            )
        })
}

/// What the store could not commit for one action, recorded by
/// [`Inner::record_when_store_commits`] as soon as it commits again.
#[derive(Debug)]
pub(super) struct Deferred {
    pub(super) action: ActionId,
    /// The last attempt's result, when the store could not record it either: recorded first,
    /// in the same commit as a [`DeferredEnd::Outcome`].
    pub(super) result: Option<AttemptResult>,
    /// How the action ends.
    pub(super) end: DeferredEnd,
    /// The route's provider and class when the outcome is counted in the metrics only once it
    /// is recorded (its caller was answered `503`, not the outcome); `None` when it was counted
    /// when the caller was answered.
    pub(super) count: Option<(String, String)>,
}

/// How an action whose records the store could not commit ends once it commits again.
#[derive(Debug)]
pub(super) enum DeferredEnd {
    /// With this outcome (`finish_action`, or with the deferred result).
    Outcome(backstop_store::Finish),
    /// A write that reconciliation found at the provider (`record_reconciled_with_context`):
    /// `succeeded`, with the provider's operation id when known and the outcome context its
    /// caller was answered with.
    Reconciled {
        /// The provider's operation id.
        operation_id: Option<String>,
        /// The SPEC §5 context of the answer (a JSON object).
        context: serde_json::Value,
    },
    /// A write whose last attempt is `uncertain` ([`Closing::Reconcile`]): reconciled with its
    /// original key and closed as a write sent without a result is after a restart (see
    /// [`Inner::close_after_recovery`]): found → `succeeded`, otherwise `escalated`. Nothing is
    /// resent.
    Reconcile {
        /// Why its payload is gone (words of the escalation's reason).
        gone: PayloadGone,
        /// Where the SPEC §6 rule ended, once a try got that far: kept, so that a try whose
        /// recording fails does not ask the provider's lookup again — only the recording is
        /// tried again.
        verdict: Option<UncertainEnd>,
    },
}

impl DeferredEnd {
    /// How an action ends as `closing` decides: reconciled (a write whose payload is `gone`),
    /// or with the `cancelled` outcome that `cancelled` builds (its reason in the context).
    pub(super) fn closing(
        closing: Closing,
        gone: PayloadGone,
        cancelled: impl FnOnce() -> backstop_store::Finish,
    ) -> DeferredEnd {
        match closing {
            Closing::Reconcile => DeferredEnd::Reconcile {
                gone,
                verdict: None,
            },
            Closing::Cancel => DeferredEnd::Outcome(cancelled()),
        }
    }
}

/// Kept signal headers as a case file lists them (names and raw values; the case file builder
/// drops anything that is not a Retry-After, `Date` or quota header and sanitizes the values).
fn observed_headers(pairs: &[(String, String)]) -> Vec<ObservedHeader> {
    pairs
        .iter()
        .map(|(name, value)| ObservedHeader {
            name: name.clone(),
            value: value.clone(),
        })
        .collect()
}

/// The verdict's one-word name, as audited.
fn verdict_word(verdict: &LookupVerdict) -> &'static str {
    match verdict {
        LookupVerdict::Found { .. } => "found",
        LookupVerdict::NotFound => "not_found",
        LookupVerdict::Inconclusive { .. } => "inconclusive",
    }
}

/// The wait a stored action used, in milliseconds (SPEC §5: budgets count all waited time):
/// the `total_wait_ms` of its outcome context when it ended with one (the budget's own count),
/// else the time between each recorded attempt result and the next attempt's send (the waits
/// before retries), which is what the store records of an action still open.
pub(super) fn recorded_wait_ms(record: &ActionRecord, attempts: &[AttemptRecord]) -> u64 {
    let from_outcome = record
        .outcome_context
        .as_ref()
        .and_then(|c| c.get("total_wait_ms"))
        .and_then(serde_json::Value::as_u64);
    from_outcome.unwrap_or_else(|| waits_between(attempts))
}

/// The time between each recorded attempt result and the next attempt's send (the waits before
/// retries), in milliseconds.
fn waits_between(attempts: &[AttemptRecord]) -> u64 {
    attempts
        .windows(2)
        .filter_map(|pair| {
            let result_at = pair[0].finished_at?;
            let waited = pair[1].started_at.duration_since(result_at);
            u64::try_from(waited.as_millis()).ok()
        })
        .fold(0u64, u64::saturating_add)
}

/// The SPEC §5 `next_safe` of an escalated action: the case file's offered options that are
/// safe to take from here, in the case file's order — `query_status`, `retry_same_key`, `abort`,
/// and `wait` as `wait_until` when the case file names the boundary. `send_new` (a possible
/// second side effect), `raise_quota` and `change_plan` are decisions, not safe steps.
pub(super) fn next_safe_offered(case: &CaseFile) -> Vec<NextSafe> {
    case.options
        .iter()
        .filter_map(|offered| match offered.option {
            DecisionOption::QueryStatus => Some(NextSafe::QueryStatus),
            DecisionOption::RetrySameKey => Some(NextSafe::ResendSameKey),
            DecisionOption::Abort => Some(NextSafe::Abort),
            DecisionOption::Wait => case.retry_not_before.map(|at| NextSafe::WaitUntil { at }),
            DecisionOption::SendNew | DecisionOption::RaiseQuota | DecisionOption::ChangePlan => {
                None
            }
        })
        .collect()
}

/// The outcome context of an action rebuilt from its stored attempts alone: a write escalated
/// after a restart (the last attempt was sent and its result is unknown), or the replay of one
/// whose stored context has no SPEC §5 members (reconciled by a lookup); `next_safe` is left
/// empty (for [`next_safe_offered`]).
pub(super) fn recovered_context(attempts: &[AttemptRecord], wait_used_ms: u64) -> OutcomeContext {
    OutcomeContext {
        // Every attempt but one that could not connect may have reached the provider.
        sent: attempts
            .iter()
            .any(|a| a.disposition.is_none_or(|d| d.as_str() != "not_sent")),
        response_received: attempts.iter().any(|a| a.status.is_some()),
        attempts: u32::try_from(attempts.len()).unwrap_or(u32::MAX),
        total_wait_ms: wait_used_ms,
        last_status: attempts.last().and_then(|a| a.status),
        last_signal: attempts
            .last()
            .and_then(|a| a.disposition)
            .map(|d| d.as_str().to_owned()),
        boundary: None,
        next_safe: Vec::new(),
    }
}

impl Inner {
    /// Whether the provider honours an idempotency header (a key is sent with every write).
    pub(super) fn honours_key(&self, provider: &str) -> bool {
        self.policy
            .providers
            .get(provider)
            .is_some_and(|p| p.idempotency_header.is_some())
    }

    /// The provider credential header for lookups: the one the action's request carried, else
    /// the one registered with [`super::Engine::set_credential`] (after a restart).
    fn lookup_headers(&self, provider: &str, request_headers: Option<&HeaderMap>) -> HeaderMap {
        let mut out = HeaderMap::new();
        let name = self
            .policy
            .providers
            .get(provider)
            .and_then(|p| p.credential.as_ref())
            .and_then(|c| HeaderName::from_bytes(c.header.as_bytes()).ok());
        if let (Some(name), Some(headers)) = (&name, request_headers) {
            if let Some(value) = headers.get(name) {
                out.insert(name.clone(), value.clone());
                return out;
            }
        }
        let known = self
            .credentials
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(provider)
            .cloned();
        if let Some((name, value)) = known {
            out.insert(name, value);
        }
        out.insert(
            http::header::ACCEPT,
            HeaderValue::from_static("application/json"),
        );
        out
    }

    /// Sends the route's lookup once (a safe read in the write's scopes) and interprets it.
    /// A transport failure, a refused permit or an unusable template is `inconclusive`.
    /// Audits `reconciliation_lookup` with the template, the status and the verdict.
    ///
    /// # Errors
    /// [`LookupNotSent`] when the gateway is shutting down: nothing was sent, audited or
    /// counted — or, when the stop's grace ran out before a lookup sent earlier was answered,
    /// that lookup is audited with an unknown status.
    pub(super) async fn lookup(
        &self,
        facts: &WriteFacts,
        request_headers: Option<&HeaderMap>,
    ) -> Result<LookupVerdict, LookupNotSent> {
        let Some(rc) = facts.reconcile.as_ref() else {
            return Ok(LookupVerdict::Inconclusive {
                reason: "the route has no reconciliation lookup".to_owned(),
            });
        };
        let template = lookup_template(rc);
        let (verdict, status) = match self.lookup_once(facts, rc, request_headers).await {
            Ok(answered) => answered,
            Err(LookupNotSent) => {
                tracing::info!(
                    action = facts.action.0,
                    task = %facts.task_id,
                    lookup = %template,
                    "shutting down: the reconciliation lookup was not sent, or its answer not waited for; the write is left for the next start to reconcile"
                );
                return Err(LookupNotSent);
            }
        };
        let verdict = self.unshared_or_ambiguous(facts, rc, verdict).await;
        let (id, word, at) = (facts.action, verdict_word(&verdict), self.clock.now());
        self.metrics.lookup(&facts.provider, word);
        let audited = template.clone();
        if let Err(e) = self
            .blocking(move |s| s.record_reconciliation_lookup(id, &audited, status, word, at))
            .await
        {
            tracing::warn!(action = id.0, error = %e, "could not audit the reconciliation lookup");
        }
        tracing::info!(
            action = facts.action.0,
            task = %facts.task_id,
            lookup = %template,
            status,
            verdict = word,
            "reconciliation lookup answered"
        );
        Ok(verdict)
    }

    /// A lookup by external reference proves the write only when no other action of the same
    /// provider recorded the same reference (SPEC §6): otherwise the write it finds may be the
    /// other action's, so `found` becomes `inconclusive` (the write is escalated, nothing is
    /// resent, and the found operation id is not handed out). The reason names the other action
    /// by its id only. A store that cannot answer leaves the lookup unproven too.
    async fn unshared_or_ambiguous(
        &self,
        facts: &WriteFacts,
        rc: &Reconcile,
        verdict: LookupVerdict,
    ) -> LookupVerdict {
        if rc.by != ReconcileBy::ExternalReference
            || !matches!(verdict, LookupVerdict::Found { .. })
        {
            return verdict;
        }
        let Some(reference) = facts.external_reference.clone() else {
            return verdict;
        };
        let (id, provider) = (facts.action, facts.provider.clone());
        // An earlier action that provably created nothing (it ended, and the provider refused
        // or never saw every attempt) cannot be what the lookup found.
        let shared = self
            .blocking(move |s| {
                let mut others = s.actions_sharing_reference(&provider, &reference, id)?;
                let mut kept = Vec::with_capacity(others.len());
                for other in others.drain(..) {
                    let record = s.action(other)?;
                    let attempts = s.attempts(other)?;
                    if !record.is_some_and(|r| created_nothing(&r, &attempts)) {
                        kept.push(other);
                    }
                }
                Ok(kept)
            })
            .await;
        let reason = match shared {
            Ok(others) if others.is_empty() => return verdict,
            Ok(others) => {
                let named: Vec<String> = others.iter().map(|a| a.0.to_string()).collect();
                let (noun, verb) = if others.len() == 1 {
                    ("action", "shares")
                } else {
                    ("actions", "share")
                };
                format!(
                    "the lookup by external reference found a write, but {noun} {} of provider `{}` {verb} this write's external reference, so the write found may be theirs and not this one",
                    named.join(", "),
                    facts.provider
                )
            }
            Err(e) => format!(
                "the lookup by external reference found a write, but the store could not tell whether another action shares the reference ({e})"
            ),
        };
        tracing::warn!(
            action = facts.action.0,
            task = %facts.task_id,
            "reconciliation lookup found a write under an external reference another action shares; not taken as proof"
        );
        LookupVerdict::Inconclusive { reason }
    }

    /// One lookup of [`Inner::lookup`]: its verdict and the provider's status, or
    /// [`LookupNotSent`] when the scheduler has stopped, or when the lookup was sent but the
    /// stop's grace ran out before its answer ([`super::Engine::give_up_attempts`]; it is then
    /// counted and audited as `inconclusive`, its status unknown).
    async fn lookup_once(
        &self,
        facts: &WriteFacts,
        rc: &Reconcile,
        request_headers: Option<&HeaderMap>,
    ) -> Result<(LookupVerdict, Option<u16>), LookupNotSent> {
        let inconclusive = |reason: String| Ok((LookupVerdict::Inconclusive { reason }, None));
        let filled = match lookup_request(
            rc,
            Some(&facts.upstream_key),
            facts.external_reference.as_deref(),
            facts.provider_operation_id.as_deref(),
        ) {
            Ok(filled) => filled,
            Err(e) => return inconclusive(e.to_string()),
        };
        let Some(provider) = self.policy.providers.get(&facts.provider) else {
            return inconclusive(format!(
                "provider `{}` is not in the policy",
                facts.provider
            ));
        };
        let Ok(method) = Method::from_bytes(filled.method.as_bytes()) else {
            return inconclusive(format!("lookup method `{}` is not a method", filled.method));
        };
        let request = AttemptRequest {
            method,
            url: format!(
                "{}{}",
                provider.base_url.trim_end_matches('/'),
                filled.path_and_query
            ),
            headers: self.lookup_headers(&facts.provider, request_headers),
            body: Bytes::new(),
        };
        let budget = ActionBudget::new(
            ClassBudget {
                max_attempts: 1,
                max_wait: LOOKUP_MAX_WAIT,
            },
            None,
        );
        let acquired = self
            .scheduler
            .acquire(AcquireRequest {
                task_id: facts.task_id.clone(),
                agent: facts.agent.clone(),
                priority: facts.priority,
                scopes: facts.scopes.clone(),
                budget,
                not_before: None,
                route: lookup_template(rc),
                reconciliation: true,
            })
            .await;
        let permit = match acquired {
            Acquired::Go { permit, .. } => permit,
            Acquired::Refused { detail, .. } => {
                return inconclusive(format!("the lookup could not be sent: {detail}"))
            }
            Acquired::Stopped { .. } => return Err(LookupNotSent),
        };
        // From here the lookup may reach the provider: if its caller goes away before the
        // answer is read, it is still counted and audited (see `LookupInFlight`).
        let mut in_flight = LookupInFlight {
            store: self.store.clone(),
            metrics: self.metrics.clone(),
            provider: facts.provider.clone(),
            action: facts.action,
            task: facts.task_id.clone(),
            lookup: lookup_template(rc),
            at: self.clock.now(),
            armed: true,
        };
        let Some(reply) = self.unless_given_up(self.transport.send(request)).await else {
            // The stop's grace is running out and the provider has not answered: the lookup is
            // counted and audited as one whose answer is unknown (`in_flight`, dropped armed),
            // and the write is left for the next start.
            tracing::info!(
                action = facts.action.0,
                lookup = %lookup_template(rc),
                "shutting down: the grace ran out before the reconciliation lookup was answered"
            );
            return Err(LookupNotSent);
        };
        drop(permit);
        let answered = self.read_lookup(rc, reply).await;
        in_flight.armed = false;
        answered
    }

    /// The verdict of a lookup's `reply` under the route's `rc`, and the provider's status.
    async fn read_lookup(
        &self,
        rc: &Reconcile,
        reply: AttemptReply,
    ) -> Result<(LookupVerdict, Option<u16>), LookupNotSent> {
        let inconclusive = |reason: String| Ok((LookupVerdict::Inconclusive { reason }, None));
        match reply {
            AttemptReply::Failed(e) => {
                inconclusive(format!("the lookup failed in transport ({})", e.as_str()))
            }
            AttemptReply::Response(response) => {
                let status = response.status().as_u16();
                let body = match read_bounded(response.into_body(), ERROR_BODY_LIMIT).await {
                    Ok((bytes, _)) => bytes,
                    Err(_) => return inconclusive("the lookup answer was cut short".to_owned()),
                };
                let mut verdict = interpret_lookup(rc, status, &body);
                // A found pointer that names the id itself (`/data/0/id`) carries it too.
                if let LookupVerdict::Found { operation_id: None } = &verdict {
                    if let Some(id) = rc
                        .found_pointer
                        .as_deref()
                        .and_then(|p| operation_id_at(p, &body))
                    {
                        verdict = LookupVerdict::Found {
                            operation_id: Some(id),
                        };
                    }
                }
                Ok((verdict, Some(status)))
            }
        }
    }

    /// Runs the SPEC §6 rule to its end for an uncertain write: lookup when configured, then
    /// found / resend with the same key / escalate.
    ///
    /// # Errors
    /// [`LookupNotSent`] when the gateway is shutting down: the rule is not run — no lookup
    /// can be sent, and a write the rule would escalate or resend without one is no more known
    /// to need it than before the stop — and the write is left for the next start to reconcile
    /// with its original key (SPEC §12).
    pub(super) async fn reconcile_uncertain(
        &self,
        facts: &WriteFacts,
        request_headers: Option<&HeaderMap>,
    ) -> Result<UncertainEnd, LookupNotSent> {
        if self.shutting_down.load(std::sync::atomic::Ordering::SeqCst) {
            tracing::info!(
                action = facts.action.0,
                task = %facts.task_id,
                "shutting down: the uncertain write is not reconciled now; the next start reconciles it with its original key"
            );
            return Err(LookupNotSent);
        }
        let honours = self.honours_key(&facts.provider);
        let has_lookup = facts.reconcile.is_some();
        let mut step = next_step_after_uncertain(honours, has_lookup, None);
        if step == UncertainNextStep::Lookup {
            let verdict = self.lookup(facts, request_headers).await?;
            step = next_step_after_uncertain(honours, has_lookup, Some(&verdict));
        }
        Ok(match step {
            UncertainNextStep::Succeeded { operation_id } => UncertainEnd::Found { operation_id },
            UncertainNextStep::RetrySameKey => UncertainEnd::RetrySameKey,
            UncertainNextStep::Escalate { reason } => UncertainEnd::Escalate { reason },
            UncertainNextStep::Lookup => UncertainEnd::Escalate {
                reason: "the reconciliation rule asked for a second lookup".to_owned(),
            },
        })
    }

    /// Escalates a write whose attempt result is already recorded: builds its sanitized case
    /// file, ends the action `escalated` and keeps `context` (SPEC §5) with it, its
    /// `next_safe` taken from the options the case file offers ([`next_safe_offered`]) — one
    /// source for the agent's answer, the action view and the operator's choices. `context`
    /// `None` is derived from the stored attempts (after a restart). Returns the escalation
    /// and the context as stored.
    ///
    /// # Errors
    /// The store failed, or the case file could not be built.
    pub(super) async fn escalate(
        &self,
        facts: &WriteFacts,
        reason: EscalationReason,
        detail: &str,
        retry_not_before: Option<jiff::Timestamp>,
        context: Option<OutcomeContext>,
    ) -> Result<(EscalationId, OutcomeContext), EngineError> {
        let id = facts.action;
        let idempotency_key = Some(facts.idempotency_key.clone());
        let case = self
            .case_file(facts, reason, detail, retry_not_before, idempotency_key)
            .await?;
        let mut context = match context {
            Some(context) => context,
            None => {
                let attempts = self.blocking(move |s| s.attempts(id)).await?;
                recovered_context(&attempts, facts.wait_used_ms)
            }
        };
        context.next_safe = next_safe_offered(&case);
        let now = case.opened_at;
        let json = case.to_json();
        let stored = serde_json::to_value(&context)
            .map_err(|e| EngineError::Aborted(format!("outcome context: {e}")))?;
        let escalation = self
            .blocking(move |s| s.open_escalation_with_context(id, json, stored, now))
            .await?;
        self.metrics.outcome(
            &facts.provider,
            &facts.class,
            backstop_core::outcome::Outcome::Escalated,
        );
        tracing::warn!(
            action = id.0,
            escalation = escalation.0,
            task = %facts.task_id,
            reason = %detail,
            "escalated: a human must decide"
        );
        Ok((escalation, context))
    }

    /// Builds the sanitized case file of a write (SPEC §8) from its facts and its stored
    /// attempts, opened now (read from the clock after the attempts); `idempotency_key` is the
    /// agent key the case file names, and the upstream key is set beside it when one was sent
    /// (the provider has an idempotency header), else left `null`.
    ///
    /// # Errors
    /// The store failed to read the attempts, or the case file could not be built.
    pub(super) async fn case_file(
        &self,
        facts: &WriteFacts,
        reason: EscalationReason,
        detail: &str,
        retry_not_before: Option<jiff::Timestamp>,
        idempotency_key: Option<String>,
    ) -> Result<CaseFile, EngineError> {
        let id = facts.action;
        let stored = self.blocking(move |s| s.attempts(id)).await?;
        let attempts: Vec<CaseAttempt> = stored
            .iter()
            .map(|a| CaseAttempt {
                n: a.n,
                started_at: a.started_at,
                finished_at: a.finished_at,
                status: a.status,
                disposition: a.disposition.map(|d| d.as_str().to_owned()),
                retry_after_raw: retry_after_raw(&a.signal_headers),
                retry_not_before: match a.boundary {
                    Some(backstop_store::Boundary::At(at)) => Some(at),
                    _ => None,
                },
                quota_headers: observed_headers(&a.signal_headers),
            })
            .collect();
        let now = self.clock.now();
        let honours_key = self.honours_key(&facts.provider);
        let mut case = CaseFile::build(CaseInput {
            opened_at: now,
            reason,
            reason_detail: detail.to_owned(),
            desired_outcome: facts.desired_outcome.clone(),
            action: CaseAction {
                task_id: facts.task_id.clone(),
                method: facts.method.clone(),
                route: facts.route.clone(),
                request_class: facts.class.clone(),
                payload_digest: facts.payload_digest.clone(),
            },
            provider: facts.provider.clone(),
            scopes: facts.scopes.clone(),
            fingerprint: facts.fingerprint.clone(),
            budget: BudgetConsumed {
                attempts_used: u32::try_from(attempts.len()).unwrap_or(u32::MAX),
                max_attempts: facts.max_attempts,
                wait_used_ms: facts.wait_used_ms,
                max_wait_ms: u64::try_from(facts.max_wait.as_millis()).unwrap_or(u64::MAX),
                deadline: facts.deadline,
            },
            attempts,
            honours_key,
            idempotency_key,
            external_reference: facts.external_reference.clone(),
            provider_operation_id: facts.provider_operation_id.clone(),
            reconciliation_query: facts.reconcile.as_ref().map(lookup_template),
            retry_not_before,
        })
        .map_err(|e| EngineError::Aborted(e.to_string()))?;
        // The derived key is named only when it was sent: a provider without an idempotency
        // header never saw it, so quoting it to the provider would mislead.
        case.upstream_idempotency_key =
            (honours_key && !facts.upstream_key.is_empty()).then(|| facts.upstream_key.clone());
        Ok(case)
    }

    /// The facts of a stored action (after a restart, beside an outcome, or for an operator
    /// decision), as complete as the store keeps them: the desired outcome and fingerprint
    /// recorded with the action (schema version 6; `METHOD route` for an older action), the
    /// deadline and priority of its task (`priority` overrides the task's), and the wait used
    /// (see [`recorded_wait_ms`]). A task that cannot be read leaves priority `normal` and no
    /// deadline, and attempts that cannot be read count no wait; both are logged.
    pub(super) async fn stored_facts(
        &self,
        record: &ActionRecord,
        priority: Option<Priority>,
    ) -> WriteFacts {
        let (agent, task_id, id) = (record.agent.clone(), record.task_id.clone(), record.id);
        let task = match self.blocking(move |s| s.task(&agent, &task_id)).await {
            Ok(task) => task,
            Err(e) => {
                tracing::warn!(action = id.0, error = %e, "the action's task could not be read");
                None
            }
        };
        let attempts = match self.blocking(move |s| s.attempts(id)).await {
            Ok(attempts) => attempts,
            Err(e) => {
                tracing::warn!(action = id.0, error = %e, "the action's attempts could not be read");
                Vec::new()
            }
        };
        let priority = priority.unwrap_or_else(|| {
            task.as_ref()
                .map_or(Priority::Normal, |t| super::core_priority(t.priority))
        });
        let route = self
            .policy
            .route(&record.provider, &record.method, &record.route)
            .ok();
        let class = self.policy.request_classes.get(&record.request_class);
        WriteFacts {
            action: record.id,
            task_id: record.task_id.clone(),
            agent: record.agent.clone(),
            priority,
            provider: record.provider.clone(),
            method: record.method.clone(),
            route: record.route.clone(),
            class: record.request_class.clone(),
            scopes: route.as_ref().map(|r| r.scopes.clone()).unwrap_or_default(),
            payload_digest: record.payload_digest.clone(),
            idempotency_key: record.idempotency_key.clone(),
            upstream_key: if record.idempotency_key.is_empty() {
                String::new()
            } else {
                upstream_idempotency_key(&record.agent, &record.idempotency_key)
            },
            external_reference: record.external_reference.clone(),
            provider_operation_id: record.provider_operation_id.clone(),
            fingerprint: record
                .fingerprint
                .clone()
                .unwrap_or_else(|| format!("{} {}", record.method, record.route)),
            desired_outcome: record.desired_outcome.clone(),
            reconcile: route.and_then(|r| r.reconcile),
            max_attempts: class.map_or(1, |c| c.max_attempts),
            max_wait: class.map_or(Duration::ZERO, |c| c.max_wait),
            deadline: task.and_then(|t| t.deadline),
            wait_used_ms: recorded_wait_ms(record, &attempts),
        }
    }

    /// Restart recovery (SPEC §12): every write attempt recorded as sent without a result is
    /// recorded `uncertain` and reconciled with its original key; reads in that state are
    /// recorded `uncertain` and end `cancelled` (nobody waits for them any more, see
    /// [`super::RESTARTED_DURING_READ`]).
    ///
    /// `unfinished` is the list taken at start, before any action of this run was recorded.
    pub(super) async fn recover_unfinished(
        self: &std::sync::Arc<Self>,
        unfinished: Result<Vec<backstop_store::UnfinishedAttempt>, EngineError>,
    ) {
        let Some(unfinished) = listed_at_start(unfinished, "unfinished attempts") else {
            return;
        };
        for attempt in unfinished {
            let id = attempt.action;
            if !self.take_up(id) {
                continue;
            }
            let Some(record) = self.recovered_action(id).await else {
                continue;
            };
            if stored_read(&self.policy, &attempt.request_class, &record.method) {
                self.cancel_interrupted_read(id, attempt.attempt).await;
                continue;
            }
            tracing::info!(
                action = id.0,
                attempt = attempt.attempt,
                idempotency_key = %attempt.idempotency_key,
                "restart recovery: an attempt was sent without a recorded result"
            );
            let now = self.clock.now();
            let result =
                super::uncertain_result(id, attempt.attempt, super::RESTARTED_BEFORE_RESULT, None);
            let kept = result.clone();
            if let Err(e) = self.blocking(move |s| s.record_result(result, now)).await {
                // A store that cannot commit (a full disk) at start: the uncertain attempt and
                // the write's reconciliation are recorded as soon as it commits again, not
                // left to the next start.
                tracing::warn!(action = id.0, error = %e, "restart recovery: cannot record the uncertain attempt yet");
                let deferred = Deferred {
                    action: id,
                    result: Some(kept),
                    end: DeferredEnd::Reconcile {
                        gone: PayloadGone::Restart,
                        verdict: None,
                    },
                    count: None,
                };
                if super::is_store_failure(&e) {
                    self.record_when_store_commits(deferred);
                }
                continue;
            }
            match self.reconcile_then_resume(&record).await {
                Ok(()) => {}
                Err(EngineError::ShuttingDown) => tracing::info!(
                    action = id.0,
                    "restart recovery: the gateway is shutting down before the write was reconciled; the next start reconciles it"
                ),
                Err(e) => {
                    tracing::warn!(action = id.0, error = %e, "restart recovery: cannot end the recovered write");
                }
            }
        }
    }

    /// Restart recovery of the actions the previous run left between two attempts (see
    /// [`backstop_store::Store::actions_between_attempts`]: an attempt's result was recorded,
    /// then the run stopped, or its store failed, before the retry was scheduled or the outcome
    /// recorded). Nothing waits for them any more and nothing is sent for them: each is closed
    /// as [`restarted_end`] decides — a write whose last attempt is `uncertain` reconciled with
    /// its original key, as a write sent without a result is (found → `succeeded`, otherwise
    /// `escalated`); any other action `cancelled` with [`RESTARTED_BEFORE_RETRY`], as a
    /// re-armed retry is.
    ///
    /// `listed` is the list taken at start, before any action of this run was recorded.
    pub(super) async fn recover_between_attempts(
        self: &std::sync::Arc<Self>,
        listed: Result<Vec<ActionId>, EngineError>,
    ) {
        let Some(listed) = listed_at_start(listed, "the actions left between two attempts") else {
            return;
        };
        for id in listed {
            if !self.take_up(id) {
                continue;
            }
            let Some(record) = self.recovered_action(id).await else {
                continue;
            };
            if record.state == backstop_store::ActionState::Reopened {
                // Reopened for a send under its key and stopped before it: sent from its kept
                // request; without one it waits for the agent's resend under the same key,
                // which sends it (an operator's `retry_same_key` after a restart).
                self.resume_reopened(&record).await;
                continue;
            }
            let attempts = match self.blocking(move |s| s.attempts(id)).await {
                Ok(attempts) => attempts,
                Err(e) => {
                    tracing::warn!(action = id.0, error = %e, "restart recovery: cannot read the action's attempts");
                    continue;
                }
            };
            if self.resume_between_attempts(&record, &attempts).await {
                continue;
            }
            let end = restarted_end(&self.policy, &record, &attempts);
            if matches!(end, DeferredEnd::Reconcile { .. }) {
                tracing::info!(
                    action = id.0,
                    attempts = attempts.len(),
                    "restart recovery: a write's last attempt was uncertain and nothing followed it; it is reconciled with its original key"
                );
            } else {
                tracing::info!(
                    action = id.0,
                    attempts = attempts.len(),
                    "restart recovery: an action was left between two attempts; its caller is gone, the action is cancelled"
                );
            }
            // Recorded at once, or as soon as the store commits again (a full disk at start).
            self.record_or_defer(Deferred {
                action: id,
                result: None,
                end,
                count: None,
            })
            .await;
        }
    }

    /// Restart recovery of the reads the previous run recorded and never sent (see
    /// [`backstop_store::Store::unsent_reads`]): nothing resumes a read after a restart, so
    /// each ends `cancelled` with [`super::RESTARTED_BEFORE_READ_SENT`] — at once, or as soon as
    /// the store commits again.
    ///
    /// `listed` is the list taken at start, before any action of this run was recorded.
    pub(super) async fn close_unsent_reads(
        self: &std::sync::Arc<Self>,
        listed: Result<Vec<ActionId>, EngineError>,
    ) {
        let Some(listed) = listed_at_start(listed, "the reads never sent") else {
            return;
        };
        if !listed.is_empty() {
            tracing::info!(
                reads = listed.len(),
                "restart recovery: reads recorded but never sent before the stop are cancelled; nothing was sent for them"
            );
        }
        for id in listed {
            let context = serde_json::json!({
                "sent": false, "response_received": false, "attempts": 0,
                "next_safe": [{"option": "abort"}],
                "detail": super::RESTARTED_BEFORE_READ_SENT,
            });
            self.record_or_defer(Deferred {
                action: id,
                result: None,
                end: DeferredEnd::Outcome(super::Finish {
                    outcome: backstop_store::Outcome::Cancelled,
                    context,
                    response: None,
                }),
                count: None,
            })
            .await;
        }
    }

    /// The stored action `id` for restart recovery; `None` (logged) when it is gone or cannot
    /// be read.
    pub(super) async fn recovered_action(&self, id: ActionId) -> Option<ActionRecord> {
        match self.blocking(move |s| s.action(id)).await {
            Ok(record) => record,
            Err(e) => {
                tracing::warn!(action = id.0, error = %e, "restart recovery: cannot read the action");
                None
            }
        }
    }

    /// Ends a recovered write: found → reconciled; otherwise escalated (the payload is `gone`,
    /// so even a same-key resend needs the agent or an operator).
    ///
    /// # Errors
    /// The store failed to record the reconciliation or the escalation.
    pub(super) async fn close_after_recovery(
        &self,
        facts: &WriteFacts,
        end: UncertainEnd,
        gone: PayloadGone,
    ) -> Result<(), EngineError> {
        let id = facts.action;
        let reason = match end {
            UncertainEnd::Found { operation_id } => {
                let at = self.clock.now();
                let op = operation_id.clone();
                self.blocking(move |s| s.record_reconciled(id, op, at))
                    .await?;
                self.metrics.outcome(
                    &facts.provider,
                    &facts.class,
                    backstop_core::outcome::Outcome::Succeeded,
                );
                tracing::info!(
                    action = id.0,
                    provider_operation_id = operation_id.as_deref().unwrap_or("-"),
                    "reconciled: the provider has the write; nothing is resent"
                );
                return Ok(());
            }
            UncertainEnd::RetrySameKey => same_key_needs_operator(facts.reconcile.is_some(), gone),
            UncertainEnd::Escalate { reason } => reason,
        };
        self.escalate(
            facts,
            EscalationReason::SideEffectUnknown,
            &reason,
            None,
            None,
        )
        .await?;
        Ok(())
    }

    /// Re-arms every scheduled retry found in the store (SPEC §12): each wakes at its due
    /// instant, is claimed by its job id (audited `retry_started`) and, because the caller's
    /// request (and its payload) did not survive the restart, is closed without sending, as
    /// [`restarted_end`] decides from the action's stored attempts, read before the claim: a
    /// write whose last attempt was `uncertain` is reconciled with its original key (found →
    /// `succeeded`, otherwise `escalated`); any other action ends `cancelled` with the reason
    /// [`RESTARTED_BEFORE_RETRY`] in its context (the budget was not used up, the caller went
    /// away). A retry of a cancelled task or a finished action is not claimed. When the store
    /// cannot commit the claim or the close (a full disk), the close is recorded as soon as it
    /// commits again ([`Inner::record_when_store_commits`]); when the action cannot be read, its
    /// retry is left unclaimed for the next start.
    ///
    /// `scheduled` is the list read at start, before this run recorded anything.
    pub(super) async fn rearm_scheduled(
        self: &std::sync::Arc<Self>,
        scheduled: Result<Vec<backstop_store::DueRetry>, EngineError>,
    ) {
        let due = match scheduled {
            Ok(due) => due,
            Err(e) => {
                tracing::error!(error = %e, "restart recovery: cannot read scheduled retries");
                return;
            }
        };
        for retry in due {
            let inner = self.clone();
            tracing::info!(
                action = retry.action.0,
                job = retry.job.0,
                due_at = %retry.due_at,
                "restart recovery: scheduled retry re-armed"
            );
            tokio::spawn(async move {
                tokio::time::sleep_until(inner.clock.instant_at(retry.due_at)).await;
                let id = retry.action;
                if !inner.take_up(id) {
                    return;
                }
                let Some(record) = inner.recovered_action(id).await else {
                    return;
                };
                let attempts = match inner.blocking(move |s| s.attempts(id)).await {
                    Ok(attempts) => attempts,
                    Err(e) => {
                        tracing::warn!(action = id.0, error = %e, "restart recovery: cannot read the re-armed action's attempts; its retry is left for the next start");
                        return;
                    }
                };
                if record.state != backstop_store::ActionState::Finished
                    && inner.resume_between_attempts(&record, &attempts).await
                {
                    return;
                }
                let close = Deferred {
                    action: id,
                    result: None,
                    end: restarted_end(&inner.policy, &record, &attempts),
                    count: None,
                };
                let (job, now) = (retry.job, inner.clock.now());
                match inner
                    .blocking(move |s| s.claim_job(job, now, "backstop-restart"))
                    .await
                {
                    Ok(Some(_)) => {
                        if matches!(close.end, DeferredEnd::Reconcile { .. }) {
                            tracing::info!(
                                action = id.0,
                                job = job.0,
                                "restart recovery: the re-armed retry's caller is gone and the write's last attempt was uncertain; it is reconciled with its original key"
                            );
                        } else {
                            tracing::info!(
                                action = id.0,
                                job = job.0,
                                "restart recovery: the re-armed retry's caller is gone; the action is cancelled"
                            );
                        }
                        inner.record_or_defer(close).await;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!(action = id.0, job = job.0, error = %e, "could not claim the re-armed retry");
                        // Closing the action drops its job too: done once the store commits
                        // again, rather than leaving the action waiting for a wake nobody arms.
                        if super::is_store_failure(&e)
                            && !inner
                                .shutting_down
                                .load(std::sync::atomic::Ordering::SeqCst)
                        {
                            inner.record_when_store_commits(close);
                        }
                    }
                }
            });
        }
    }
}

/// Whether a stored action of `class` sent with `method` is read-like (nothing of it needs
/// reconciling after a restart): a safe method, or a class of `policy` with `side_effect: none`
/// (`read`, `llm_call`, SPEC §4.2a). A class the policy no longer holds counts as a write.
fn stored_read(policy: &backstop_core::policy::Policy, class: &str, method: &str) -> bool {
    matches!(method, "GET" | "HEAD" | "OPTIONS")
        || policy.side_effect_of(class) == backstop_core::side_effect::SideEffect::None
}

/// A list restart recovery took at start, or `None` when it could not be read (logged at ERROR
/// naming `what`: that recovery step is skipped, and the next start tries again).
fn listed_at_start<T>(listed: Result<Vec<T>, EngineError>, what: &str) -> Option<Vec<T>> {
    listed
        .inspect_err(|e| tracing::error!(error = %e, "restart recovery: cannot read {what}"))
        .ok()
}

/// How an action whose caller is gone after a restart (a re-armed retry, an action left between
/// two attempts) is closed, as [`Closing::of_stored`] decides from its stored `attempts`:
/// reconciled (its payload gone with the restart), or `cancelled` with [`restarted_context`].
fn restarted_end(
    policy: &backstop_core::policy::Policy,
    record: &ActionRecord,
    attempts: &[AttemptRecord],
) -> DeferredEnd {
    DeferredEnd::closing(
        Closing::of_stored(policy, record, attempts),
        PayloadGone::Restart,
        || super::Finish {
            outcome: backstop_store::Outcome::Cancelled,
            context: restarted_context(attempts, recorded_wait_ms(record, attempts)),
            response: None,
        },
    )
}

/// The outcome context of an action whose caller is gone after a restart (a re-armed retry, an
/// action left between two attempts): the SPEC §5 members rebuilt from its stored `attempts`
/// with `wait_used_ms`, `next_safe` `abort`, and [`RESTARTED_BEFORE_RETRY`] as its `detail`.
fn restarted_context(attempts: &[AttemptRecord], wait_used_ms: u64) -> serde_json::Value {
    let mut context = recovered_context(attempts, wait_used_ms);
    context.next_safe = vec![NextSafe::Abort];
    let mut value = serde_json::to_value(&context).unwrap_or_default();
    if let Some(map) = value.as_object_mut() {
        map.insert("detail".to_owned(), RESTARTED_BEFORE_RETRY.into());
    }
    value
}

impl Inner {
    /// Records `deferred`, what the store could not commit for one action, as soon as the store
    /// commits again, so that the action never stays open in the store for a step nothing
    /// takes any more (a `409 idempotency_key_in_flight` for every same-key resend, the
    /// watchdog's stuck findings). The store is tried after [`STORE_RETRY_FIRST_WAIT`], then
    /// after doubling waits of at most `STORE_RETRY_MAX_WAIT`, for [`DEFERRED_RECORD_WINDOW`];
    /// the first try that commits ends the action (see [`DeferredEnd`]), and each outcome is
    /// logged. An action that ended meanwhile (its task cancelled) is left as it is. At
    /// shutdown, or past the window, the action is left as the store has it, and the next start
    /// recovers it: a retry job still waiting is re-armed, an attempt `sent` without a result is
    /// reconciled, an action left between two attempts is closed (SPEC §12).
    pub(super) fn record_when_store_commits(self: &std::sync::Arc<Self>, mut deferred: Deferred) {
        let inner = self.clone();
        tokio::spawn(async move {
            let action = deferred.action.0;
            let mut wait = STORE_RETRY_FIRST_WAIT;
            let mut waited = Duration::ZERO;
            loop {
                tokio::time::sleep(wait).await;
                waited += wait;
                if inner
                    .shutting_down
                    .load(std::sync::atomic::Ordering::SeqCst)
                {
                    tracing::info!(
                        action,
                        "shutting down: what the store could not record for this action stays unrecorded; the next start recovers the action"
                    );
                    return;
                }
                match inner.record_deferred(&mut deferred).await {
                    Ok(()) => {
                        tracing::info!(
                            action,
                            "the store commits again: what it could not record for this action is recorded, and the action is closed"
                        );
                        return;
                    }
                    Err(EngineError::ShuttingDown) => {
                        tracing::info!(
                            action,
                            "shutting down: the write's reconciliation lookup was not sent, or its answer not waited for; the next start recovers the action"
                        );
                        return;
                    }
                    Err(e) if !super::is_store_failure(&e) => {
                        tracing::debug!(action, error = %e, "the action had ended meanwhile");
                        return;
                    }
                    Err(e) if waited >= DEFERRED_RECORD_WINDOW => {
                        tracing::error!(
                            action,
                            error = %e,
                            "the store still fails: what it could not record for this action stays unrecorded; the next start recovers the action"
                        );
                        return;
                    }
                    Err(e) => {
                        wait = (wait * 2).min(STORE_RETRY_MAX_WAIT);
                        tracing::debug!(
                            action,
                            error = %e,
                            next_try_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
                            "the store still fails: what it could not record for this action is recorded later"
                        );
                    }
                }
            }
        });
    }

    /// Records `close`, how an action nothing will send again ends, at once; when the store
    /// cannot commit it, as soon as it commits again ([`Inner::record_when_store_commits`]),
    /// unless the gateway is stopping (the next start recovers the action then). An action that
    /// ended meanwhile is left as it is.
    pub(super) async fn record_or_defer(self: &std::sync::Arc<Self>, mut close: Deferred) {
        let action = close.action.0;
        match self.record_deferred(&mut close).await {
            Ok(()) => {}
            Err(EngineError::ShuttingDown) => tracing::info!(
                action,
                "shutting down: the write's reconciliation lookup was not sent, or its answer not waited for; the next start recovers the action"
            ),
            Err(e)
                if super::is_store_failure(&e)
                    && !self.shutting_down.load(std::sync::atomic::Ordering::SeqCst) =>
            {
                tracing::warn!(action, error = %e, "the store could not record how this action ends; it is recorded as soon as the store commits again");
                self.record_when_store_commits(close);
            }
            Err(e) if super::is_store_failure(&e) => {
                tracing::warn!(action, error = %e, "the store could not record how this action ends; the next start recovers the action");
            }
            Err(e) => tracing::debug!(action, error = %e, "the action had ended meanwhile"),
        }
    }

    /// One try of [`Inner::record_when_store_commits`]: the deferred result first (with the
    /// outcome in the same commit), then the end. A result that commits is not recorded again
    /// by the next try, and a reconciliation's verdict, once obtained, is kept: a later try
    /// records it without asking the provider's lookup again.
    ///
    /// # Errors
    /// The store failed (tried again later), or refused because the action ended meanwhile,
    /// or [`EngineError::ShuttingDown`]: a reconciliation's lookup was not sent, and the action
    /// is left (with the deferred result, when it was recorded) for the next start.
    pub(super) async fn record_deferred(&self, deferred: &mut Deferred) -> Result<(), EngineError> {
        let action = deferred.action;
        if let Some(result) = &deferred.result {
            let mut result = result.clone();
            if let DeferredEnd::Outcome(finish) = &deferred.end {
                result.finish = Some(finish.clone());
            }
            let at = self.clock.now();
            self.blocking(move |s| s.record_result(result, at)).await?;
            deferred.result = None;
            if let DeferredEnd::Outcome(finish) = &deferred.end {
                self.count_deferred(&deferred.count, finish);
                return Ok(());
            }
        }
        match &mut deferred.end {
            DeferredEnd::Outcome(finish) => {
                let (finish_now, at) = (finish.clone(), self.clock.now());
                self.blocking(move |s| s.finish_action(action, finish_now, at))
                    .await?;
                self.count_deferred(&deferred.count, finish);
                Ok(())
            }
            DeferredEnd::Reconciled {
                operation_id,
                context,
            } => {
                let (op, context, at) = (operation_id.clone(), context.clone(), self.clock.now());
                self.blocking(move |s| s.record_reconciled_with_context(action, op, context, at))
                    .await
            }
            DeferredEnd::Reconcile { gone, verdict } => {
                let record = match self.blocking(move |s| s.action(action)).await? {
                    Some(record) if record.state != backstop_store::ActionState::Finished => record,
                    _ => {
                        return Err(EngineError::Store(
                            backstop_store::StoreError::InvalidTransition {
                                what: format!("action {action}"),
                                reason: "already finished".into(),
                            },
                        ))
                    }
                };
                let facts = self.stored_facts(&record, None).await;
                // The provider is asked once; a try whose recording fails keeps the verdict.
                let end = match verdict {
                    Some(end) => end.clone(),
                    None => {
                        let end = self
                            .reconcile_uncertain(&facts, None)
                            .await
                            .map_err(|LookupNotSent| EngineError::ShuttingDown)?;
                        verdict.insert(end).clone()
                    }
                };
                self.close_after_recovery(&facts, end, *gone).await
            }
        }
    }

    /// Counts a deferred outcome in the metrics once it is recorded, when its caller was not
    /// told it (see [`Deferred::count`]).
    fn count_deferred(&self, count: &Option<(String, String)>, finish: &backstop_store::Finish) {
        if let Some((provider, class)) = count {
            self.metrics
                .outcome(provider, class, super::core_outcome(finish.outcome));
        }
    }
}

/// Why a recovered write, which the provider would deduplicate under its key, is handed to an
/// operator: what the gateway learned about it (`looked_up`: a lookup of the route ran and did
/// not find it; otherwise the route has none, so nothing is known), and that its payload is
/// `gone`, so nothing can be resent automatically.
fn same_key_needs_operator(looked_up: bool, gone: PayloadGone) -> String {
    let gone = gone.words();
    if looked_up {
        format!("the lookup did not find the write; a resend with the same key would be deduplicated by the provider, but {gone}, so nothing can be resent automatically; an operator decides")
    } else {
        format!("whether the write happened is unknown: the route has no lookup to ask the provider; a resend with the same key would be deduplicated by the provider, but {gone}, so nothing can be resent automatically; an operator decides")
    }
}

#[cfg(test)]
mod tests {
    use super::{same_key_needs_operator, still_unsettled, PayloadGone};

    /// Folds `answers` (dispositions, oldest first) as the engine does after each attempt.
    fn unsettled_after(answers: &[&str]) -> bool {
        answers.iter().fold(false, |u, a| still_unsettled(u, a))
    }

    #[test]
    fn only_a_definite_answer_to_a_later_attempt_settles_an_uncertain_one() {
        assert!(!unsettled_after(&[]));
        assert!(!unsettled_after(&["rate_limited", "transient"]));
        assert!(unsettled_after(&["uncertain"]));
        // Answers that say nothing of the earlier attempt leave it open.
        for answer in [
            "rate_limited",
            "quota_exhausted",
            "unavailable",
            "transient",
            "not_sent",
            "conflict",
        ] {
            assert!(unsettled_after(&["uncertain", answer]), "{answer}");
        }
        // A success or a rejection under the same key settles it, until the next uncertain one.
        assert!(!unsettled_after(&["uncertain", "success"]));
        assert!(!unsettled_after(&["uncertain", "rate_limited", "rejected"]));
        assert!(unsettled_after(&[
            "uncertain",
            "success",
            "uncertain",
            "transient"
        ]));
    }

    #[test]
    fn a_recovered_write_says_a_lookup_ran_only_when_one_did() {
        let looked_up = same_key_needs_operator(true, PayloadGone::Restart);
        assert!(looked_up.starts_with("the lookup did not find the write"));
        let without = same_key_needs_operator(false, PayloadGone::Restart);
        assert!(!without.contains("did not find"), "{without}");
        assert!(without.contains("has no lookup"), "{without}");
        assert!(without.contains("an operator decides"), "{without}");
    }

    #[test]
    fn a_recovered_write_says_why_its_payload_is_gone() {
        let restart = same_key_needs_operator(false, PayloadGone::Restart);
        assert!(restart.contains("restarted"), "{restart}");
        let store = same_key_needs_operator(true, PayloadGone::StoreFailed);
        assert!(store.contains("503 store_unavailable"), "{store}");
        assert!(!store.contains("restart"), "{store}");
    }
}
