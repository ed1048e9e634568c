//! The `503` answers of a stop after an attempt was sent: what the next start does with the
//! action ([`AfterRestart`]), said in `after_restart` and in the detail, so the caller knows
//! whether to wait, check or send again (SPEC §12).

use backstop_store::StoreError;

use super::{problem_answer, with_ids, writes, Engine, EngineError, Run, Seen};
use crate::{action::Execution, problem::Problem};

impl Engine {
    /// The `503 shutting_down` for the caller of an action of which an attempt was sent, when
    /// the gateway stops before the action ends — `stopped` says where it was (see
    /// [`Stopped`]). `sent` as the outcome context
    /// counts it, `x-should-retry: false` for a write (`true`, with `Retry-After: 1`, for a
    /// read, which is safe to send again), and what the next start does with the action — the `after_restart` member (see
    /// [`AfterRestart`]) and the `detail` — with the last attempt's `last_status` and
    /// `last_signal`.
    pub(super) fn stopped_after_sending(
        &self,
        run: &Run<'_>,
        seen: &Seen,
        stopped: Stopped,
    ) -> Execution {
        let is_read = !run.spec.has_side_effect();
        let after = AfterRestart::of(run, seen);
        let id = run.id.0;
        let detail = match after {
            AfterRestart::Reconcile if stopped == Stopped::GaveUp => format!(
                "backstop is shutting down: this write was sent and the provider had not answered when the grace for the stop ran out, so its answer is not waited for and it stays recorded as sent without a result. The next start reconciles it with its original Idempotency-Key: found at the provider, it succeeded; nothing found and the provider honours the key, it is sent again under that key from its kept request; otherwise it is escalated to an operator. Check its status (GET /v1/actions/{id}) instead of sending it again, and never send it under a new key — the provider may have acted on it"
            ),
            AfterRestart::Cancel if is_read && stopped == Stopped::GaveUp => format!(
                "backstop is shutting down: this read was sent and the provider had not answered when the grace for the stop ran out, so its answer is not waited for: after the restart its action (GET /v1/actions/{id}) ends cancelled and nothing more is sent for it. A read changes nothing at the provider, so send it again once backstop is back"
            ),
            AfterRestart::Reconcile if stopped == Stopped::NotReconciled => format!(
                "backstop is shutting down: this write was sent and no answer came back (uncertain), and no reconciliation lookup can be sent or waited for any more, so it stays recorded as sent without a result. The next start reconciles it with its original Idempotency-Key: found at the provider, it succeeded; nothing found and the provider honours the key, it is sent again under that key from its kept request; otherwise it is escalated to an operator. Check its status (GET /v1/actions/{id}) instead of sending it again, and never send it under a new key — the provider may have acted on it"
            ),
            AfterRestart::Reconcile => format!(
                "backstop is shutting down while this write waited for its next attempt. An attempt of it was sent and no answer came back (uncertain), and no later answer settled it, so it stays recorded: after the restart, when its retry falls due, it is reconciled with its original Idempotency-Key (found at the provider: succeeded; nothing found and the provider honours the key: sent again under that key from its kept request; otherwise escalated to an operator). Until then this Idempotency-Key is answered 409 idempotency_key_in_flight, then with that outcome: check its status (GET /v1/actions/{id}) instead of sending it again, and never send it under a new key — the provider may have acted on it"
            ),
            AfterRestart::Cancel if is_read => format!(
                "backstop is shutting down while this read waited for its retry, and nothing more is sent for it: after the restart its action (GET /v1/actions/{id}) ends cancelled when the retry falls due. A read changes nothing at the provider, so send it again once backstop is back"
            ),
            AfterRestart::Cancel => format!(
                "backstop is shutting down while this write waited for its retry. {}, so there is nothing to reconcile, but its request was too large to keep across a restart: after the restart its retry is not sent, and the action ends cancelled when the retry falls due. Until then this Idempotency-Key is answered 409 idempotency_key_in_flight; after that, sending the same request again under the same Idempotency-Key reopens the action and sends it (GET /v1/actions/{id} shows its status)",
                last_attempt(seen)
            ),
            AfterRestart::Resume => format!(
                "backstop is shutting down while this write waited for its retry. {}, so there is nothing to reconcile, and its request is kept: after the restart its retry is sent under its original Idempotency-Key when it falls due. Until then this Idempotency-Key is answered 409 idempotency_key_in_flight; check its status (GET /v1/actions/{id}) instead of sending it again, and never send it under a new key",
                last_attempt(seen)
            ),
            AfterRestart::RetrySameKey => format!(
                "backstop is shutting down before this write was sent again: it was reopened for a retry under its same Idempotency-Key (by an operator's decision, or by a same-key resend its earlier answer allowed), and nothing more was sent now. It stays reopened across the restart, and the next start sends it under that key from its kept request; a resend with the same Idempotency-Key and payload joins it or, when its request could not be kept, sends it as this action (GET /v1/actions/{id}); never send it under a new key — an earlier attempt may have been acted on"
            ),
        };
        let receipt = run.receipt(seen.sent);
        // `sent` as the outcome context counts it: an attempt that may have reached the
        // provider. When none did (every one `not_sent`), a retry is still not safe under this
        // key unless the action stays reopened: the next start cancels it.
        let left = seen.left > 0;
        let mut problem = with_ids(
            Problem::shutting_down_during(left, detail),
            run.spec,
            &receipt,
        );
        if !left && after != AfterRestart::RetrySameKey {
            problem.should_retry = false;
            problem.retry_after_seconds = None;
        }
        if is_read {
            // A read changes nothing at the provider: sending it again is safe, whatever it
            // was answered.
            problem.should_retry = true;
            problem.retry_after_seconds = Some(1);
        }
        let problem = problem
            .with_extension("after_restart", after.as_str().into())
            .with_extension("last_status", serde_json::json!(seen.last_status))
            .with_extension("last_signal", serde_json::json!(seen.last_signal));
        problem_answer(receipt, problem)
    }

    /// The `503` for the caller of an action of which an attempt was sent, when the store
    /// failed on the record `interrupted` while the gateway was stopping: `503 shutting_down`
    /// when the store's writer is gone, `503 store_unavailable` for a storage error, with
    /// `sent: true` and `x-should-retry: false` as any store failure after a send, and — as
    /// every answer of a stop after a send — what the next start does with the action
    /// (`after_restart`, also said in `detail`), with the last attempt's `last_status` and
    /// `last_signal`. `maybe_kept` is whether the failed record may have been committed all
    /// the same ([`may_have_committed`]); when that changes what the next start does, the
    /// answer says `after_restart: unknown` and names both cases instead of guessing.
    pub(super) fn stopped_by_store_after_sending(
        &self,
        run: &Run<'_>,
        seen: &Seen,
        e: &EngineError,
        interrupted: Interrupted,
        maybe_kept: bool,
    ) -> Execution {
        let spec = run.spec;
        let receipt = run.receipt(seen.sent);
        let after = AfterRestart::after_store_failure(run, seen, interrupted, maybe_kept);
        let id = run.id.0;
        let what = if !run.spec.has_side_effect() {
            "read"
        } else {
            "write"
        };
        let failed = format!(
            "backstop is shutting down, and its store failed after an attempt of this {what} was sent: {}",
            interrupted.describe()
        );
        let next = match after {
            Some(AfterRestart::Reconcile) => format!(
                "The next start reconciles the {what} with its original Idempotency-Key (found at the provider: succeeded; otherwise escalated to an operator) and resends nothing automatically: check its status (GET /v1/actions/{id}) instead of sending it again, and never send it under a new key — the provider may have acted on it"
            ),
            Some(AfterRestart::Cancel) => format!(
                "{}, so there is nothing to reconcile, but its request was too large to keep across a restart: the next start sends nothing more for it and ends the action cancelled. Until then this Idempotency-Key is answered 409 idempotency_key_in_flight; after that, sending the same request again under the same Idempotency-Key reopens the {what} and sends it (GET /v1/actions/{id} shows its status)",
                last_attempt(seen)
            ),
            Some(AfterRestart::Resume) => format!(
                "{}, so there is nothing to reconcile, and its request is kept: the next start sends the {what} again under its original Idempotency-Key when its retry falls due. Check its status (GET /v1/actions/{id}) instead of sending it again, and never send it under a new key",
                last_attempt(seen)
            ),
            Some(AfterRestart::RetrySameKey) => format!(
                "The {what} stays reopened for a send under its same Idempotency-Key across the restart: the next start sends it from its kept request, and a resend with the same Idempotency-Key and payload joins it or sends it as this action (GET /v1/actions/{id}); never send it under a new key — an earlier attempt may have been acted on"
            ),
            None => {
                let (kept, undone) = AfterRestart::if_kept_or_not(run, seen, interrupted);
                format!(
                    "The store's failure does not tell whether that record was kept, so what the next start does with the {what} cannot be known here: if it was kept, the next start {}; if not, it {}. Check its status (GET /v1/actions/{id}) after the restart before sending it again, and never send it under a new key while it is open — an attempt of it was sent and may have been acted on",
                    kept.clause(),
                    undone.clause()
                )
            }
        };
        let detail = format!("{failed}. {next}");
        let gone = matches!(e, EngineError::Store(StoreError::WriterGone));
        let problem = if gone {
            Problem::shutting_down_during(true, detail)
        } else {
            let (task, agent, route) = (&spec.task_id, &spec.agent, &spec.route.template);
            tracing::error!(
                action = id, %task, %agent, %route, sent = true, error = %e,
                after_restart = after.map_or("unknown", AfterRestart::as_str),
                "the store failed at shutdown: the request is answered 503 store_unavailable"
            );
            Problem::store_unavailable(true, detail)
        };
        let problem = with_ids(problem, spec, &receipt)
            .with_extension(
                "after_restart",
                after.map_or("unknown", AfterRestart::as_str).into(),
            )
            .with_extension("last_status", serde_json::json!(seen.last_status))
            .with_extension("last_signal", serde_json::json!(seen.last_signal));
        problem_answer(receipt, problem)
    }
}

/// Where an action was when the gateway stopped and its caller, one of whose attempts was sent,
/// is answered `503 shutting_down` ([`Engine::stopped_after_sending`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stopped {
    /// Waiting for its next attempt (a slot, pacing, its retry).
    Waiting,
    /// A write whose attempt got no answer (`uncertain`), not reconciled during the stop (no
    /// lookup can be sent; nothing is escalated): left sent without a result.
    NotReconciled,
    /// Its attempt was still out when the stop's grace ran out ([`Engine::give_up_attempts`]):
    /// left sent without a result.
    GaveUp,
}

/// What the next start does with an action whose caller was answered `503 shutting_down` (or,
/// the store failing during the stop, `503 store_unavailable`) after an attempt of it was sent:
/// the answer's `after_restart` member, which is `unknown` when it cannot be told
/// ([`AfterRestart::after_store_failure`] is `None`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum AfterRestart {
    /// `reconcile`: a write whose last attempt is `uncertain` is reconciled with its original
    /// key — at start when it was left sent without a result, else when its retry falls due
    /// (found → `succeeded`; nothing found and the provider honours the key → sent again under
    /// it from its kept request; otherwise `escalated`).
    Reconcile,
    /// `cancel`: its retry is not sent (the request did not survive the restart) and the action
    /// ends `cancelled` when the retry falls due — a read, or a write whose last attempt got the
    /// provider's answer or never reached it and whose request was too large to keep.
    Cancel,
    /// `resume`: a write whose last attempt got the provider's answer or never reached it, and
    /// whose request the store keeps: the next start sends its retry under its original key
    /// when it falls due.
    Resume,
    /// `retry_same_key`: a write reopened by an operator for a same-key retry stays reopened;
    /// the agent's resend under the same key sends it as the same action.
    RetrySameKey,
}

impl AfterRestart {
    /// What the next start does with the action of `run` as the store holds it after the
    /// attempts `seen`: its last attempt's result recorded (or, reopened, nothing sent again).
    pub(super) fn of(run: &Run<'_>, seen: &Seen) -> AfterRestart {
        if run.prior.sent > 0 && seen.sent == run.prior.sent {
            // Reopened by an operator for a same-key retry, and not sent again yet.
            AfterRestart::RetrySameKey
        } else {
            AfterRestart::closing(run, seen.unsettled)
        }
    }

    /// [`writes::Closing::of`] as the answer names it for the action of `run`: a write whose
    /// request the store keeps ([`Run::kept`]) is resumed, not cancelled.
    pub(super) fn closing(run: &Run<'_>, unsettled: bool) -> AfterRestart {
        let is_read = !run.spec.has_side_effect();
        match writes::Closing::of(is_read, unsettled) {
            writes::Closing::Reconcile => AfterRestart::Reconcile,
            writes::Closing::Cancel if !is_read && run.kept => AfterRestart::Resume,
            writes::Closing::Cancel => AfterRestart::Cancel,
        }
    }

    /// What the next start does with the action of `run` (after the attempts `seen`) when the
    /// store failed at shutdown on the record `interrupted`: `(kept, undone)`, when the failed
    /// record was committed all the same and when it was not.
    pub(super) fn if_kept_or_not(
        run: &Run<'_>,
        seen: &Seen,
        interrupted: Interrupted,
    ) -> (AfterRestart, AfterRestart) {
        // An attempt the store holds as sent without a result is uncertain (SPEC §12).
        let sent_without_result = AfterRestart::closing(run, true);
        let as_recorded = AfterRestart::of(run, seen);
        match interrupted {
            Interrupted::Send => (sent_without_result, as_recorded),
            Interrupted::Result => (as_recorded, sent_without_result),
            Interrupted::Schedule => (as_recorded, as_recorded),
        }
    }

    /// [`AfterRestart::if_kept_or_not`] as the answer tells it: `None` when it cannot be known,
    /// because the failure does not tell whether the record was kept (`maybe_kept`, see
    /// [`may_have_committed`]) and the next start treats the two cases differently.
    pub(super) fn after_store_failure(
        run: &Run<'_>,
        seen: &Seen,
        interrupted: Interrupted,
        maybe_kept: bool,
    ) -> Option<AfterRestart> {
        let (kept, undone) = AfterRestart::if_kept_or_not(run, seen, interrupted);
        (!maybe_kept || undone == kept).then_some(undone)
    }

    /// What the next start does, as the clause of a sentence whose subject is the next start.
    pub(super) fn clause(self) -> &'static str {
        match self {
            AfterRestart::Reconcile => {
                "reconciles it with its original Idempotency-Key and sends it again under that key only when nothing is found and the provider honours the key"
            }
            AfterRestart::Cancel => "ends it cancelled and sends nothing more for it",
            AfterRestart::Resume => {
                "sends it again under its original Idempotency-Key from its kept request when its retry falls due"
            }
            AfterRestart::RetrySameKey => {
                "keeps it reopened for a send under its same Idempotency-Key"
            }
        }
    }

    pub(super) fn as_str(self) -> &'static str {
        match self {
            AfterRestart::Reconcile => "reconcile",
            AfterRestart::Cancel => "cancel",
            AfterRestart::Resume => "resume",
            AfterRestart::RetrySameKey => "retry_same_key",
        }
    }
}

/// The record of an action's attempt loop the store failed on at shutdown, for the answer's
/// `after_restart` ([`AfterRestart::after_store_failure`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Interrupted {
    /// The start of its next attempt (`action_sent`, which claims the retry's job): nothing of
    /// that attempt left.
    Send,
    /// Its last attempt's result (whether or not its retry was scheduled after it).
    Result,
    /// The schedule of its retry, after the last attempt's result was recorded.
    Schedule,
}

impl Interrupted {
    /// What could not be recorded, as a clause.
    pub(super) fn describe(self) -> &'static str {
        match self {
            Interrupted::Send => {
                "the start of its next attempt could not be recorded, so that attempt was not sent"
            }
            Interrupted::Result => "the answer to its last attempt could not be recorded",
            Interrupted::Schedule => "its retry could not be scheduled",
        }
    }
}

/// How the last attempt ended, as a sentence of [`Engine::stopped_after_sending`]: the
/// provider's status, or that it never reached the provider.
pub(super) fn last_attempt(seen: &Seen) -> String {
    match (seen.last_signal, seen.last_failure, seen.last_status) {
        (Some("not_sent"), _, _) => {
            "Its last attempt could not be sent (`not_sent`): it never reached the provider"
                .to_owned()
        }
        (Some(signal), None, Some(status)) => {
            format!("The provider answered its last attempt with HTTP {status} (`{signal}`)")
        }
        (Some(signal), _, _) => format!("Its last attempt ended `{signal}`"),
        (None, _, _) => "Its last attempt's result is recorded".to_owned(),
    }
}
