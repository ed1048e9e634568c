//! A same-key resend taking over a reopened write whose earlier attempts are unsettled, when
//! the provider does not honour idempotency keys (SPEC §6).
//!
//! A write is reopened — by an operator's `retry_same_key`, or by a same-key resend its answer
//! invited (see [`super::resend`]) — only where a resend under the same key was judged safe: the
//! provider deduplicates the key. The resend that takes the write over may come much later, after
//! a restart under another policy, and the provider may not honour the key any more (its
//! `idempotency_header` removed). Sending then could create a second side effect at the provider
//! when an earlier attempt was acted on. So when an attempt is left unsettled
//! ([`writes::unsettled_in`]) and the provider does not honour the key now, the rule for an
//! uncertain write runs instead of the send ([`Inner::reconcile_uncertain`]): a lookup when the
//! route has one — found → `succeeded` (reconciled), nothing sent; otherwise the write is
//! escalated (`side_effect_unknown`, this request held for the operator) and nothing is sent.
//!
//! [`Inner::reconcile_uncertain`]: super::Inner::reconcile_uncertain

use backstop_store::{ActionRecord, AttemptRecord};

use super::{writes, Engine};
use crate::{
    action::{ActionSpec, Execution},
    transport::AttemptRequest,
};

impl Engine {
    /// The reopened write `record` (its stored `attempts`, one of them unsettled), taken over by
    /// `spec` (its prepared `request`, agent `key`) while its provider does not honour the key:
    /// the answer of the SPEC §6 rule, nothing sent; `None` when the rule says to resend under
    /// the same key after all (the provider honours it), so the takeover sends.
    pub(super) async fn settle_before_takeover(
        &self,
        spec: &ActionSpec,
        request: &AttemptRequest,
        key: &str,
        record: &ActionRecord,
        attempts: &[AttemptRecord],
    ) -> Option<Execution> {
        let inner = &self.inner;
        let id = record.id;
        tracing::info!(
            action = id.0,
            provider = %record.provider,
            "a reopened write with an attempt that may have been acted on is resent under its key, but the provider does not honour idempotency keys: it is reconciled first, not sent"
        );
        let facts = inner.stored_facts(record, None).await;
        let Ok(end) = Box::pin(inner.reconcile_uncertain(&facts, Some(&request.headers))).await
        else {
            // The gateway is stopping: no lookup was sent, the write stays reopened.
            return Some(Self::not_reconciled_at_stop(spec, record, attempts));
        };
        match end {
            writes::UncertainEnd::RetrySameKey => None,
            writes::UncertainEnd::Found { operation_id } => Some(
                self.reconciled_on_resend(record, attempts, &facts, operation_id)
                    .await,
            ),
            writes::UncertainEnd::Escalate { reason } => Some(
                self.escalated_on_resend(spec, request, key, record, attempts, &facts, &reason)
                    .await,
            ),
        }
    }
}
