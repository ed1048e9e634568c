//! Side-effect-free calls (LLM completions) as one logical call per client, whatever the
//! client's own retries do (SPEC §4.2a, §4.3).
//!
//! Why: an SDK at its defaults retries on its own — after its own timeout, and after an answer
//! it believes retryable. Each such re-send would otherwise be a new action with a fresh
//! budget, and after its timeout the first completion would be cancelled and started again,
//! billed twice. So a call of a `side_effect: none` class runs detached from its caller:
//!
//! - **Re-send after the final answer.** Backstop's final non-success answer is kept for its
//!   call's fingerprint (agent, the task when the agent named one, method, URL, payload digest)
//!   until the boundary it reported (so its `Retry-After` stays honest), or for
//!   [`RESEND_WINDOW`] when it reported none: the same call arriving again meanwhile gets the
//!   same answer at once (nothing sent, the same receipt), never a fresh budget.
//! - **Re-send while in flight.** The same call arriving while the first is still running
//!   joins it: one upstream completion, its answer given to whoever waits for it (streamed to a
//!   single waiter, buffered and copied when several wait).
//! - **Caller gone.** A caller that goes away leaves the call running for [`CALLER_GRACE`], so a
//!   re-send after the client's own timeout can join it; with nobody joining within the grace
//!   the call is dropped, which cancels its attempt (the provider stops spending tokens). An
//!   answer that arrives while nobody waits is kept for [`CALLER_GRACE`] and given to the first
//!   re-send of the same call.
//!
//! Both kinds of re-send are counted in `backstop_client_resends_total{handling}`. Headers such
//! as `x-stainless-retry-count` are not read: the fingerprint is the mechanism.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use axum::body::HttpBody;
use backstop_core::{clock::Clock, outcome::NextSafe};
use jiff::Timestamp;
use tokio::sync::oneshot;

use super::{into_shared, Engine};
use crate::{
    action::{ActionSpec, Execution},
    coalesce::{Shared, SHARED_BODY_LIMIT},
};

/// How long a caller's side-effect-free call keeps running after the caller went away, for a
/// re-send to join it (5 s: an SDK retries after its own timeout within about a second).
pub const CALLER_GRACE: Duration = Duration::from_secs(5);

/// How long a side-effect-free call's final non-success answer is given again to the same call,
/// at least (30 s; longer while the boundary it reported still holds).
pub const RESEND_WINDOW: Duration = Duration::from_secs(30);

/// The longest error body kept to answer a re-send with (64 KiB): larger ones are not kept.
const KEPT_BODY_LIMIT: usize = 64 * 1024;

/// The side-effect-free calls in flight and the final answers kept, by fingerprint.
#[derive(Default)]
pub(super) struct Detached {
    in_flight: Mutex<HashMap<String, Arc<Flight>>>,
    finals: Mutex<HashMap<String, Kept>>,
}

/// A final answer kept for re-sends until `until`; `once`: an answer nobody received, given
/// to the first re-send only.
struct Kept {
    until: Timestamp,
    answer: Shared,
    once: bool,
}

/// One call in flight: who waits for it, and the task running it.
struct Flight {
    waiters: Mutex<Vec<oneshot::Sender<Execution>>>,
    task: Mutex<Option<tokio::task::AbortHandle>>,
    /// Counts the times the last waiter went away: a grace only ends the call when no waiter
    /// joined and left again after it began.
    emptied: AtomicU64,
    /// The answer was handed on: no grace is started any more.
    done: AtomicBool,
    /// The call's task, provider and route, for the log.
    task_id: String,
    provider: String,
    route: String,
}

impl Flight {
    fn has_waiters(&self) -> bool {
        lock(&self.waiters).iter().any(|w| !w.is_closed())
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The fingerprint of a side-effect-free call: SHA-256 over the agent, the task when the agent
/// named it, the method, the URL and the payload digest.
fn call_key(spec: &ActionSpec) -> String {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    let task = if spec.task_given {
        spec.task_id.as_str()
    } else {
        ""
    };
    for field in [
        spec.agent.as_str(),
        task,
        spec.request.method.as_str(),
        spec.request.url.as_str(),
        spec.payload_digest.as_str(),
    ] {
        hasher.update((field.len() as u64).to_be_bytes());
        hasher.update(field.as_bytes());
    }
    hex::encode(hasher.finalize())
}

/// Removes the waiter's place when its caller goes away, and starts the grace.
struct Waiting {
    engine: Engine,
    key: String,
    flight: Arc<Flight>,
    rx: oneshot::Receiver<Execution>,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        // Closed first, so that the flight sees this waiter gone.
        self.rx.close();
        if self.flight.done.load(Ordering::SeqCst) || self.flight.has_waiters() {
            return;
        }
        let emptied = self.flight.emptied.fetch_add(1, Ordering::SeqCst) + 1;
        let (engine, key, flight) = (self.engine.clone(), self.key.clone(), self.flight.clone());
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { engine.after_grace(key, flight, emptied).await });
        }
    }
}

impl Engine {
    /// Carries out a side-effect-free call (see the module docs): the kept final answer of the
    /// same call, the same call in flight joined, or a new call run detached from its caller.
    pub(super) async fn execute_detached(&self, spec: &ActionSpec) -> Execution {
        let key = call_key(spec);
        if let Some(answer) = self.kept_final(&key) {
            self.inner
                .metrics
                .client_resend(&spec.route.provider, "answered");
            tracing::info!(provider = %spec.route.provider, route = %spec.route.template, task = %spec.task_id, "client re-send of a call already answered: the same answer, nothing sent");
            return super::from_shared(answer);
        }
        let (tx, rx) = oneshot::channel();
        let (flight, joined) = self.join_or_start(&key, spec, tx);
        if joined {
            self.inner
                .metrics
                .client_resend(&spec.route.provider, "joined");
            tracing::info!(provider = %spec.route.provider, route = %spec.route.template, task = %spec.task_id, "client re-send joined the same call in flight");
        }
        let mut waiting = Waiting {
            engine: self.clone(),
            key,
            flight,
            rx,
        };
        match (&mut waiting.rx).await {
            Ok(execution) => execution,
            // The run went away without an answer (aborted after a grace that this waiter
            // outlived: not reached in practice); answer as a cancelled call.
            Err(_) => Execution::Outcome {
                receipt: crate::action::ActionReceipt {
                    action_id: 0,
                    attempts: 0,
                    idempotency_key: None,
                    provider_operation_id: None,
                    task: None,
                },
                outcome: backstop_core::outcome::Outcome::Cancelled,
                context: backstop_core::outcome::OutcomeContext {
                    next_safe: vec![NextSafe::Abort],
                    ..Default::default()
                },
                detail: "the call was cancelled before it answered".to_owned(),
            },
        }
    }

    /// The kept final answer of call `key`, while it holds (one lookup: expired answers of
    /// other calls are dropped when an answer is kept, not on every call).
    fn kept_final(&self, key: &str) -> Option<Shared> {
        let now = self.inner.clock.now();
        let mut finals = lock(&self.inner.detached.finals);
        let kept = finals.get(key)?;
        if kept.until <= now || kept.once {
            let kept = finals.remove(key)?;
            return (kept.until > now).then_some(kept.answer);
        }
        Some(kept.answer.clone())
    }

    /// Joins call `key` in flight (`true`), or starts it on a task of its own (`false`).
    fn join_or_start(
        &self,
        key: &str,
        spec: &ActionSpec,
        tx: oneshot::Sender<Execution>,
    ) -> (Arc<Flight>, bool) {
        let mut in_flight = lock(&self.inner.detached.in_flight);
        if let Some(flight) = in_flight.get(key) {
            lock(&flight.waiters).push(tx);
            return (flight.clone(), true);
        }
        let flight = Arc::new(Flight {
            waiters: Mutex::new(vec![tx]),
            task: Mutex::new(None),
            emptied: AtomicU64::new(0),
            done: AtomicBool::new(false),
            task_id: spec.task_id.clone(),
            provider: spec.route.provider.clone(),
            route: spec.route.template.clone(),
        });
        in_flight.insert(key.to_owned(), flight.clone());
        let (engine, spec, key_owned, run) =
            (self.clone(), spec.clone(), key.to_owned(), flight.clone());
        let task = tokio::spawn(async move {
            let execution = Box::pin(engine.lead(&spec, None, None)).await;
            engine.deliver(&key_owned, &run, execution).await;
        });
        *lock(&flight.task) = Some(task.abort_handle());
        (flight, false)
    }

    /// Ends call `key`: no one joins it any more; its final non-success answer is kept for
    /// re-sends; the answer goes to the one waiter (streamed), or a copy to each of several.
    async fn deliver(&self, key: &str, flight: &Arc<Flight>, execution: Execution) {
        lock(&self.inner.detached.in_flight).remove(key);
        flight.done.store(true, Ordering::SeqCst);
        // A provider answer is kept for re-sends only when its body is known to be small: a
        // larger one goes to its waiters as for a success, and is not kept.
        let final_failure = match &execution {
            Execution::Response { response, .. } => {
                !response.status().is_success()
                    && response
                        .body()
                        .size_hint()
                        .upper()
                        .is_some_and(|bytes| bytes <= KEPT_BODY_LIMIT as u64)
            }
            Execution::Outcome { outcome, .. } => {
                *outcome != backstop_core::outcome::Outcome::Succeeded
            }
            Execution::InFlight { .. } => false,
        };
        let mut waiters: Vec<_> = std::mem::take(&mut *lock(&flight.waiters))
            .into_iter()
            .filter(|w| !w.is_closed())
            .collect();
        if !final_failure && waiters.len() == 1 {
            if let Some(waiter) = waiters.pop() {
                let _ = waiter.send(execution);
            }
            return;
        }
        if !final_failure && waiters.is_empty() {
            // Nobody took it (the caller's own timeout): kept for the re-send that follows.
            let unseen = into_shared(execution, "side-effect-free call", SHARED_BODY_LIMIT).await;
            let unseen = with_task(unseen, &flight.task_id);
            self.keep(key, unseen, self.inner.clock.now() + CALLER_GRACE, true);
            return;
        }
        let limit = if final_failure {
            KEPT_BODY_LIMIT
        } else {
            SHARED_BODY_LIMIT
        };
        let shared = into_shared(execution, "side-effect-free call", limit).await;
        if final_failure {
            self.keep_final(key, &shared, &flight.task_id);
        }
        for waiter in waiters {
            let _ = waiter.send(super::from_shared(shared.clone()));
        }
    }

    /// Keeps a final answer of call `key` (of task `task`) until the boundary it reported, so
    /// that its `Retry-After` stays honest; without a boundary for [`RESEND_WINDOW`].
    fn keep_final(&self, key: &str, answer: &Shared, task: &str) {
        let now = self.inner.clock.now();
        let boundary = match answer {
            Shared::Outcome { context, .. } => context.next_safe.iter().find_map(|o| match o {
                NextSafe::WaitUntil { at } => Some(*at),
                _ => None,
            }),
            Shared::Response { .. } => None,
        };
        let until = boundary.unwrap_or(now + RESEND_WINDOW);
        self.keep(key, with_task(answer.clone(), task), until, false);
    }

    fn keep(&self, key: &str, answer: Shared, until: Timestamp, once: bool) {
        let now = self.inner.clock.now();
        let mut finals = lock(&self.inner.detached.finals);
        finals.retain(|_, kept| kept.until > now);
        finals.insert(
            key.to_owned(),
            Kept {
                until,
                answer,
                once,
            },
        );
    }

    /// After [`CALLER_GRACE`], drops call `key` when still nobody waits for it: its attempt is
    /// cancelled (a read's "client disconnected" path).
    async fn after_grace(&self, key: String, flight: Arc<Flight>, emptied: u64) {
        tokio::time::sleep(CALLER_GRACE).await;
        // A waiter that joined and left after this grace began started a grace of its own.
        if flight.has_waiters() || flight.emptied.load(Ordering::SeqCst) != emptied {
            return;
        }
        let removed = {
            let mut in_flight = lock(&self.inner.detached.in_flight);
            match in_flight.get(&key) {
                Some(current) if Arc::ptr_eq(current, &flight) && !flight.has_waiters() => {
                    in_flight.remove(&key);
                    true
                }
                _ => false,
            }
        };
        if removed {
            if let Some(task) = lock(&flight.task).take() {
                tracing::info!(
                    task = %flight.task_id,
                    provider = %flight.provider,
                    route = %flight.route,
                    grace_ms = CALLER_GRACE.as_millis() as u64,
                    "caller gone and no re-send joined within the grace: the side-effect-free call is cancelled"
                );
                task.abort();
            }
        }
    }
}

/// `answer` naming the task of the call it answered: a re-send that named no task (its own is
/// minted) is told the call's.
fn with_task(mut answer: Shared, task: &str) -> Shared {
    let receipt = match &mut answer {
        Shared::Response { receipt, .. } | Shared::Outcome { receipt, .. } => receipt,
    };
    receipt.task.get_or_insert_with(|| task.to_owned());
    answer
}
