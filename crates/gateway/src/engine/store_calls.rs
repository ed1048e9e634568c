//! How the engine talks to the store: every store operation runs off the async threads
//! ([`Inner::blocking`]) or through the group-commit queue ([`Inner::queued`]), and each has
//! an `_or_else` form whose completion still runs when nobody awaits it any more (the caller
//! went away) — so a record that commits after its caller left is never forgotten.
//!
//! A read's records are not awaited at all (SPEC §12): [`ReadRecords`] logs what the store
//! could not record for one, and [`Inner::cancel_interrupted_read`] closes a read cut off
//! mid-attempt.

use backstop_core::clock::Clock;
use backstop_store::{ActionId, Completion as StoreCompletion, Finish, Store, StoreError};
use std::sync::{
    atomic::{AtomicBool, Ordering},
    Arc, Mutex,
};
use tokio::sync::oneshot;

use super::{uncertain_result, EngineError, Inner, RESTARTED_BEFORE_RESULT, RESTARTED_DURING_READ};
use crate::action::ActionSpec;

impl Inner {
    /// `future`'s output, or `None` once the stop's grace is running out
    /// ([`Engine::give_up_attempts`]): an attempt or lookup still out is then not waited for.
    pub(super) async fn unless_given_up<T>(
        &self,
        future: impl std::future::Future<Output = T>,
    ) -> Option<T> {
        let mut given_up = self.given_up.subscribe();
        tokio::select! {
            out = future => Some(out),
            _ = given_up.wait_for(|given_up| *given_up) => None,
        }
    }

    /// Runs a blocking store call off the async workers.
    pub(super) async fn blocking<T, F>(&self, f: F) -> Result<T, EngineError>
    where
        T: Send + 'static,
        F: FnOnce(&dyn Store) -> Result<T, StoreError> + Send + 'static,
    {
        let store = self.store.clone();
        match tokio::task::spawn_blocking(move || f(store.as_ref())).await {
            Ok(result) => result.map_err(EngineError::Store),
            Err(e) => Err(EngineError::Aborted(e.to_string())),
        }
    }

    /// [`Inner::blocking`], handing the result to `orphaned` instead when nobody takes it (the
    /// awaiting future was dropped before the result was read), as [`Inner::queued_or_else`]
    /// does: exactly one of the two gets the result. `orphaned` runs on the blocking thread or
    /// where the future is dropped: it must not block. A call that never completes (the
    /// runtime stopping before it ran) is answered as the writer's absence is.
    pub(super) async fn blocking_or_else<T, F, O>(
        &self,
        f: F,
        orphaned: O,
    ) -> Result<T, EngineError>
    where
        T: Send + 'static,
        F: FnOnce(&dyn Store) -> Result<T, StoreError> + Send + 'static,
        O: FnOnce(Result<T, StoreError>) + Send + 'static,
    {
        let store = self.store.clone();
        self.queued_or_else(
            move |_, done| {
                tokio::task::spawn_blocking(move || done(f(store.as_ref())));
            },
            orphaned,
        )
        .await
    }

    /// Queues a store operation and awaits its completion (called after its commit is
    /// durable) through a one-shot channel: no thread is parked while the writer works.
    pub(super) async fn queued<T, F>(&self, f: F) -> Result<T, EngineError>
    where
        T: Send + 'static,
        F: FnOnce(&dyn Store, StoreCompletion<T>),
    {
        self.queued_or_else(f, |_| ()).await
    }

    /// [`Inner::queued`], handing the operation's result to `orphaned` instead when nobody
    /// takes it (the awaiting future was dropped before the result was read: before the
    /// commit, or after it but before it was polled again). Exactly one of the two gets the
    /// result. `orphaned` runs on the store's writer thread or where the future is dropped: it
    /// must not block.
    pub(super) async fn queued_or_else<T, F, O>(&self, f: F, orphaned: O) -> Result<T, EngineError>
    where
        T: Send + 'static,
        F: FnOnce(&dyn Store, StoreCompletion<T>),
        O: FnOnce(Result<T, StoreError>) + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let orphaned = Arc::new(Mutex::new(Some(orphaned)));
        let unread = orphaned.clone();
        f(
            self.store.as_ref(),
            Box::new(move |result| {
                if let Err(unawaited) = tx.send(result) {
                    if let Some(orphaned) = unread
                        .lock()
                        .unwrap_or_else(|poisoned| poisoned.into_inner())
                        .take()
                    {
                        orphaned(unawaited);
                    }
                }
            }),
        );
        let mut awaiting = Awaiting {
            rx,
            orphaned,
            read: false,
        };
        let result = (&mut awaiting.rx).await;
        awaiting.read = true;
        match result {
            Ok(result) => result.map_err(EngineError::Store),
            Err(_) => Err(EngineError::Store(StoreError::WriterGone)),
        }
    }
}

/// The receiving end of [`Inner::queued_or_else`]: dropped before its result was read, it
/// closes the channel (a later send fails, and the sender hands the result to `orphaned`) and
/// hands over a result already sent.
pub(super) struct Awaiting<T, O: FnOnce(Result<T, StoreError>)> {
    pub(super) rx: oneshot::Receiver<Result<T, StoreError>>,
    pub(super) orphaned: Arc<Mutex<Option<O>>>,
    pub(super) read: bool,
}

impl<T, O: FnOnce(Result<T, StoreError>)> Drop for Awaiting<T, O> {
    fn drop(&mut self) {
        if self.read {
            return;
        }
        self.rx.close();
        if let Ok(result) = self.rx.try_recv() {
            if let Some(orphaned) = self
                .orphaned
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .take()
            {
                orphaned(result);
            }
        }
    }
}

/// The records of one read, which nobody awaits (SPEC §12: reads may be recorded
/// asynchronously): the request, each attempt sent and the result. A held read's records are
/// committed as ONE operation, so when that commit fails every completion of the read gets the
/// same error; the loss is logged once, at ERROR, with what identifies the read (action, task,
/// agent, provider, route) — its other steps at DEBUG. See [`ReadRecords::not_recorded`].
pub(super) struct ReadRecords {
    /// The action id, known once the store handed it out (after the request completion was
    /// given to the store).
    pub(super) action: std::sync::OnceLock<i64>,
    pub(super) task: String,
    pub(super) agent: String,
    pub(super) provider: String,
    pub(super) route: String,
    /// Whether a failure of this read was logged already.
    pub(super) reported: AtomicBool,
}

impl ReadRecords {
    pub(super) fn new(spec: &ActionSpec) -> Arc<ReadRecords> {
        Arc::new(ReadRecords {
            action: std::sync::OnceLock::new(),
            task: spec.task_id.clone(),
            agent: spec.agent.clone(),
            provider: spec.route.provider.clone(),
            route: spec.route.template.clone(),
            reported: AtomicBool::new(false),
        })
    }

    /// The completion of the read's step `what` (`request`, `attempt`, `result`): a failure is
    /// logged by [`ReadRecords::not_recorded`].
    pub(super) fn completion<T: Send + 'static>(
        self: &Arc<Self>,
        what: &'static str,
    ) -> StoreCompletion<T> {
        let records = Arc::clone(self);
        Box::new(move |result: Result<T, StoreError>| {
            if let Err(e) = result {
                records.not_recorded(what, &e);
            }
        })
    }

    /// Logs a step of the read that could not be committed after the read went on. The first
    /// failure of the read is logged at INFO when its task was cancelled meanwhile (the
    /// cancellation is audited, the read ends there), else at ERROR — the read is not refused
    /// for it, and the audit log will not show it. Every later failure of the same read (the
    /// same lost commit, as a rule) is logged at DEBUG only.
    pub(super) fn not_recorded(&self, what: &str, e: &StoreError) {
        let action = self.action.get().copied();
        let (task, agent, provider, route) = (&self.task, &self.agent, &self.provider, &self.route);
        if self.reported.swap(true, Ordering::AcqRel) {
            tracing::debug!(action, %task, %agent, %provider, %route, step = what, error = %e, "a further record of the same read was not committed either");
        } else if matches!(e, StoreError::InvalidTransition { .. }) {
            tracing::info!(action, %task, %agent, %provider, %route, step = what, error = %e, "a read's records were not committed: its task changed meanwhile");
        } else {
            tracing::error!(action, %task, %agent, %provider, %route, step = what, error = %e, "a read's records could not be committed; the read is not refused for it, but the audit log will not show it");
        }
    }
}

impl Inner {
    /// Restart recovery of a read whose attempt `attempt` was sent without a recorded result
    /// (SPEC §12): the attempt is recorded `uncertain` and the action ends `cancelled` with
    /// [`RESTARTED_DURING_READ`] — its caller went away with the crash, and its budget was not
    /// used up. Nothing is sent.
    pub(super) async fn cancel_interrupted_read(&self, action: ActionId, attempt: u32) {
        tracing::info!(
            action = action.0,
            attempt,
            "restart recovery: a read was sent without a recorded result; its caller is gone, the read is cancelled"
        );
        let result = uncertain_result(
            action,
            attempt,
            RESTARTED_BEFORE_RESULT,
            Some(Finish {
                outcome: backstop_store::Outcome::Cancelled,
                context: serde_json::json!({
                    "sent": true, "response_received": false, "attempts": attempt,
                    "last_signal": "uncertain", "next_safe": [{"option": "abort"}],
                    "detail": RESTARTED_DURING_READ,
                }),
                response: None,
            }),
        );
        let now = self.clock.now();
        if let Err(e) = self.blocking(move |s| s.record_result(result, now)).await {
            tracing::warn!(action = action.0, error = %e, "restart recovery: cannot end the interrupted read");
        }
    }
}
