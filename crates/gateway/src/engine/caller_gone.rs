//! A write whose caller went away keeps the attempt it has out (SPEC §6, §4.3).
//!
//! Why: when an agent's connection drops while a write's attempt is at the provider, cutting
//! the attempt leaves its outcome unknown — the write must then be reconciled, or escalated to
//! a human where no lookup exists, although the provider's answer was only moments away. So a
//! write runs on a task of its own; its caller waits for the answer. A caller that goes away:
//!
//! - while an attempt is out: the attempt finishes (bounded by the attempt timeout) and its
//!   answer is recorded as for any write, so a same-key resend gets it replayed — or joins the
//!   write while it is still in flight;
//! - while no attempt is out (waiting for a permit, or for a retry): the write is closed at
//!   once as before — `cancelled`, or reconciled when an earlier attempt is unsettled — and
//!   nothing more is sent.
//!
//! The attempt loop says when an attempt is out through [`attempt_out`]; outside a write run
//! this way, that is a no-op.

use std::sync::Arc;

use tokio::sync::{oneshot, watch};

use super::Engine;
use crate::action::{ActionReceipt, ActionSpec, Execution};
use backstop_core::outcome::{NextSafe, Outcome, OutcomeContext};

/// What the task running a write knows of its caller and its attempt.
#[derive(Debug, Clone, Copy, Default)]
struct CallerState {
    /// The caller went away.
    gone: bool,
    /// An attempt of the write is at the provider.
    attempt_out: bool,
}

tokio::task_local! {
    static CALLER: Arc<watch::Sender<CallerState>>;
}

/// Tells the write's task whether an attempt is out (`true` from its send, `false` once its
/// result is recorded and the write waits for its retry). A no-op outside a write run by
/// [`Engine::execute_write_detached`].
pub(super) fn attempt_out(out: bool) {
    let _ = CALLER.try_with(|caller| caller.send_modify(|state| state.attempt_out = out));
}

/// Marks the caller gone when its request future is dropped.
struct GoneOnDrop(Arc<watch::Sender<CallerState>>);

impl Drop for GoneOnDrop {
    fn drop(&mut self) {
        self.0.send_modify(|state| state.gone = true);
    }
}

impl Engine {
    /// Carries out a write on a task of its own (see the module docs) and answers its caller.
    pub(super) async fn execute_write_detached(&self, spec: &ActionSpec) -> Execution {
        let caller = Arc::new(watch::Sender::new(CallerState::default()));
        let (tx, rx) = oneshot::channel();
        let (engine, spec, task_caller) = (self.clone(), spec.clone(), caller.clone());
        let mut idle_after_gone = caller.subscribe();
        tokio::spawn(CALLER.scope(task_caller, async move {
            tokio::select! {
                execution = Box::pin(engine.lead(&spec, None, None)) => {
                    let _ = tx.send(execution);
                }
                // Dropping the run closes the write as for any caller gone between attempts.
                _ = idle_after_gone.wait_for(|state| state.gone && !state.attempt_out) => {}
            }
        }));
        let _gone = GoneOnDrop(caller);
        rx.await.unwrap_or_else(|_| Execution::Outcome {
            // Not reached: the task answers unless its caller is gone.
            receipt: ActionReceipt {
                action_id: 0,
                attempts: 0,
                idempotency_key: None,
                provider_operation_id: None,
                task: None,
            },
            outcome: Outcome::Cancelled,
            context: OutcomeContext {
                next_safe: vec![NextSafe::QueryStatus, NextSafe::Abort],
                ..OutcomeContext::default()
            },
            detail: "the write's task ended without an answer".to_owned(),
        })
    }
}
