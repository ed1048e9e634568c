//! Writes of a cancelled task that may have been acted on (SPEC §4.3, §6).
//!
//! Cancelling a task drops its delayed actions and ends its unfinished actions `cancelled`:
//! nothing of them is sent again. A write with an unsettled attempt is the exception, as in
//! every other close — a caller gone, a restart, a shutdown, a store failure (see
//! [`writes::Closing`]): an attempt sent and never answered (`uncertain`), which no later
//! answer under the same key settled, may have been acted on by the provider, and ending the
//! write `cancelled` would hide that. Such a write is reconciled with its original key instead
//! — the route's lookup finds it → `succeeded`; otherwise `escalated` (`side_effect_unknown`)
//! for an operator — and nothing of it is sent again either way. The lookup is a read of the
//! provider's state, not an attempt of the action: the task's cancellation does not hold it
//! back.
//!
//! Who reconciles: the store leaves each such write open, between two attempts with no retry
//! ([`backstop_store::CancelReport::unsettled`]), and the cancellation reconciles it (after a
//! stop, the next start does, as for any write left between two attempts). That covers every
//! write whose caller was waiting (for a pace, a slot or its retry's wake): the scheduler
//! drops it before the store cancels, and its next send is refused after. A write whose
//! attempt was in flight is not listed — nothing is known of it yet — and its run reconciles
//! it once the attempt's answer leaves it unsettled and the store refuses its retry. When the
//! answer came just before the store cancelled, both do: one claim per action
//! ([`Inner::claim_close`]) lets one of them ask the provider and close the write, and the
//! other finds it closed. The waiting caller is answered at once with
//! `reconciliation_required`, naming the uncertain attempt: check the action's status.

use std::sync::Arc;

use backstop_core::{
    budget::ActionBudget,
    outcome::{NextSafe, Outcome},
};
use backstop_store::ActionId;

use super::{writes, Engine, Inner, Run, Seen};
use crate::action::Execution;

/// Held while one closer reconciles and closes a write ([`Inner::claim_close`]); dropping it
/// lets the next one look (it finds the write closed).
pub(super) struct CloseClaim {
    inner: Arc<Inner>,
    action: ActionId,
}

impl Drop for CloseClaim {
    fn drop(&mut self) {
        self.inner
            .closing
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(&self.action.0);
    }
}

impl Inner {
    /// The claim to reconcile and close `action`, unless another closer holds it.
    pub(super) fn claim_close(self: &Arc<Self>, action: ActionId) -> Option<CloseClaim> {
        let claimed = self
            .closing
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(action.0);
        claimed.then(|| CloseClaim {
            inner: self.clone(),
            action,
        })
    }

    /// Reconciles the write `action` of a cancelled task, one of whose attempts is unsettled,
    /// with its original key and closes it (found → `succeeded`, otherwise `escalated`);
    /// nothing is sent. Left to the closer holding the claim, if another one does; a write
    /// closed meanwhile is left as it is; what the store cannot record is recorded as soon as
    /// it commits again ([`Inner::record_or_defer`]).
    pub(super) async fn close_cancelled_write(self: &Arc<Self>, action: ActionId) {
        let Some(_claim) = self.claim_close(action) else {
            tracing::debug!(
                action = action.0,
                "the write of the cancelled task is being reconciled already"
            );
            return;
        };
        let close = writes::Deferred {
            action,
            result: None,
            end: writes::DeferredEnd::Reconcile {
                gone: writes::PayloadGone::TaskCancelled,
                verdict: None,
            },
            count: None,
        };
        self.record_or_defer(close).await;
    }
}

impl Engine {
    /// The answer to the caller of a write whose task was cancelled while one of its attempts
    /// is unsettled (`seen.unsettled`): the write is reconciled in the background — by this
    /// run when it `closes` it (an attempt was in flight at the cancellation), else by the
    /// cancellation, which the store listed it to (see the module docs) — and its caller is
    /// told `reconciliation_required`, naming the uncertain attempt, with the context of what
    /// was sent so far. Nothing is sent.
    pub(super) async fn cancelled_while_unsettled(
        &self,
        run: &Run<'_>,
        budget: &ActionBudget,
        seen: &Seen,
        closes: bool,
    ) -> Execution {
        let inner = self.inner.clone();
        let id = run.id;
        let attempt = match inner.blocking(move |s| s.attempts(id)).await {
            Ok(attempts) => backstop_store::unsettled_attempt(&attempts),
            Err(_) => None,
        };
        if closes {
            tokio::spawn(async move { inner.close_cancelled_write(id).await });
        }
        let which = match attempt {
            Some(n) => format!("its attempt {n}"),
            None => "an earlier attempt".to_owned(),
        };
        tracing::info!(
            action = id.0,
            uncertain_attempt = attempt,
            "task cancelled: the write has an attempt that may have been acted on; it is reconciled with its original key, not cancelled"
        );
        let context = self.context(
            budget,
            seen,
            None,
            vec![NextSafe::QueryStatus, NextSafe::Abort],
        );
        Execution::Outcome {
            receipt: run.receipt(seen.sent),
            outcome: Outcome::ReconciliationRequired,
            context,
            detail: format!(
                "the task was cancelled, so nothing more is sent for this write; but {which} was sent and its answer is unknown (`uncertain`), and no later answer settled it: the provider may have acted on it, so the write is not cancelled but reconciled with its original key (found → `succeeded`, otherwise `escalated` for an operator); check its status (GET /v1/actions/{}) before anything else",
                id.0
            ),
        }
    }
}
