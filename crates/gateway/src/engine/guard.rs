//! The guard that closes an action when its `execute` future is dropped (the caller went
//! away), and what it goes by: [`SoFar`], what the action's attempts did so far.
//!
//! Why a guard: the only thing that runs when a future is dropped is `Drop`. So the attempt
//! loop keeps an armed [`ActionGuard`] up to date, disarms it on every path that answers the
//! caller, and a drop anywhere else closes the action — `cancelled` before any send, reconciled
//! when a write's attempt may have been acted on (SPEC §6).

use backstop_core::clock::Clock;
use backstop_core::{
    classify::Disposition,
    outcome::{NextSafe, Outcome, OutcomeContext},
};
use backstop_store::{ActionId, AttemptRecord, AttemptResult, Finish};
use std::sync::Arc;

use super::{writes, Inner, DISCONNECTED_DURING_ATTEMPT};

/// Closes an action (audited) when its `execute` future is dropped mid-way (the client
/// disconnected): as every action nothing sends again is closed (`writes::Closing`), a write
/// with an unsettled attempt — or one still in flight, so its answer is unknown — is
/// reconciled with its original key; any other action ends `cancelled`.
pub(super) struct ActionGuard<'a> {
    pub(super) inner: Arc<Inner>,
    pub(super) id: ActionId,
    /// The route's provider and class, copied for the metrics only if the action is cancelled.
    pub(super) provider: &'a str,
    pub(super) class: &'a str,
    /// Whether the action is a read (safe method).
    pub(super) read: bool,
    /// What its attempts did so far (for a write taken over by a same-key resend, from its
    /// stored attempts until this run sends): what closing it goes by.
    pub(super) so_far: SoFar,
    pub(super) armed: bool,
}

/// What an action's attempts did so far: what a close goes by when nothing more is sent for
/// it (its caller went away), and what its `cancelled` context then says.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct SoFar {
    /// Attempts that left.
    pub(super) sent: u32,
    /// The attempt whose answer has not come back yet, if one is out.
    pub(super) in_flight: Option<u32>,
    /// The last response's status and the last attempt's disposition, once one came back.
    pub(super) last_status: Option<u16>,
    pub(super) last_signal: Option<&'static str>,
    /// Whether an attempt may have been acted on and no later answer settled it
    /// ([`writes::still_unsettled`]): such a write is reconciled, never `cancelled`.
    pub(super) unsettled: bool,
}

impl SoFar {
    /// What the stored `attempts` of a write say it had done before this run took it over (a
    /// same-key resend of a reopened or never sent write): as [`writes::Closing::of_stored`]
    /// reads them, a last attempt sent without a result is `uncertain`.
    pub(super) fn of_stored(attempts: &[AttemptRecord]) -> SoFar {
        let last = attempts.last();
        SoFar {
            sent: u32::try_from(attempts.len()).unwrap_or(u32::MAX),
            in_flight: None,
            last_status: last.and_then(|a| a.status),
            last_signal: last.map(|a| {
                a.disposition
                    .unwrap_or(backstop_store::Disposition::Uncertain)
                    .as_str()
            }),
            unsettled: writes::unsettled_in(attempts),
        }
    }
}

/// The result of attempt `attempt` of `action` whose answer is not known (sent, no response
/// recorded): `uncertain`, with `source` saying why, and `finish` when it also ends the action.
pub(super) fn uncertain_result(
    action: ActionId,
    attempt: u32,
    source: &str,
    finish: Option<Finish>,
) -> AttemptResult {
    AttemptResult {
        action,
        attempt,
        status: None,
        disposition: backstop_store::Disposition::Uncertain,
        boundary: None,
        source: Some(source.to_owned()),
        provider_operation_id: None,
        signal_headers: Vec::new(),
        finish,
    }
}

impl Drop for ActionGuard<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        self.inner.close_for_gone_client(
            &runtime,
            self.id,
            self.read,
            self.so_far,
            (self.provider, self.class),
        );
    }
}

impl Inner {
    /// Closes action `id` (a read when `read`) because its caller went away, on `runtime`; `gone`
    /// says what its attempts had done. As every action nothing sends again is closed
    /// ([`writes::Closing`]): a write with an unsettled attempt — or one still in flight, so its
    /// answer is unknown — is reconciled with its original key; any other action ends
    /// `cancelled` ([`Inner::cancel_for_gone_client`]). `provider` and `class` are the route's,
    /// for the metrics. Nothing is sent either way.
    pub(super) fn close_for_gone_client(
        self: &Arc<Self>,
        runtime: &tokio::runtime::Handle,
        id: ActionId,
        read: bool,
        gone: SoFar,
        (provider, class): (&str, &str),
    ) {
        let inner = self.clone();
        let (in_flight, sent) = (gone.in_flight, gone.sent);
        // An attempt in flight has no answer: it may have been acted on.
        let unsettled = in_flight.is_some() || gone.unsettled;
        if writes::Closing::of(read, unsettled) == writes::Closing::Reconcile {
            tracing::info!(
                action = id.0,
                sent,
                "client disconnected: an attempt of the write may have been acted on and nothing settled it, so it is reconciled with its original key; it never sends again"
            );
            let result = in_flight
                .map(|attempt| uncertain_result(id, attempt, DISCONNECTED_DURING_ATTEMPT, None));
            let close = writes::Deferred {
                action: id,
                result,
                end: writes::DeferredEnd::Reconcile {
                    gone: writes::PayloadGone::CallerGone,
                    verdict: None,
                },
                count: None,
            };
            runtime.spawn(async move { inner.record_or_defer(close).await });
            return;
        }
        let (provider, class) = (provider.to_owned(), class.to_owned());
        tracing::info!(
            action = id.0,
            sent,
            "client disconnected: the action is cancelled and never sends again"
        );
        runtime.spawn(async move {
            inner
                .cancel_for_gone_client(id, gone, &provider, &class)
                .await
        });
    }

    /// Ends action `id` `cancelled` because its caller went away; `gone` says what it had done
    /// (an attempt in flight is recorded `uncertain` with the outcome). Store errors are logged;
    /// nothing is retried.
    pub(super) async fn cancel_for_gone_client(
        &self,
        id: ActionId,
        gone: SoFar,
        provider: &str,
        class: &str,
    ) {
        let SoFar {
            sent,
            in_flight,
            last_status,
            last_signal,
            unsettled: _,
        } = gone;
        let context = OutcomeContext {
            sent: sent > 0,
            attempts: sent,
            response_received: last_status.is_some(),
            last_status,
            last_signal: match in_flight {
                Some(_) => Some(Disposition::Uncertain.as_str().to_owned()),
                None => last_signal.map(str::to_owned),
            },
            next_safe: if in_flight.is_some() {
                vec![NextSafe::QueryStatus, NextSafe::Abort]
            } else {
                vec![NextSafe::Abort]
            },
            ..OutcomeContext::default()
        };
        let finish = Finish {
            outcome: backstop_store::Outcome::Cancelled,
            context: serde_json::to_value(&context).unwrap_or_default(),
            response: None,
        };
        let now = self.clock.now();
        let result = match in_flight {
            Some(attempt) => {
                let result =
                    uncertain_result(id, attempt, DISCONNECTED_DURING_ATTEMPT, Some(finish));
                self.blocking(move |s| s.record_result(result, now)).await
            }
            None => {
                self.blocking(move |s| s.finish_action(id, finish, now))
                    .await
            }
        };
        if let Err(e) = result {
            tracing::warn!(action = id.0, error = %e, "could not record the cancellation");
        }
        self.metrics.outcome(provider, class, Outcome::Cancelled);
    }
}
