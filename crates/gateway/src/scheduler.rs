//! The scheduler: ONE owner of all scope state that decides when each attempt may leave.
//!
//! Why one owner: a 429 on one action must slow down every action of its scope (SPEC §4.1), and
//! no two workers may both believe the next slot is theirs. If scope records, GCRA pacers,
//! concurrency slots and delayed counts lived behind many locks, "update the record, then
//! schedule the retry" would race with other workers reading the old record. Here they are one
//! state behind one mutex, driven by one tokio task; actions talk to the task through messages
//! and it answers in arrival order, so every decision sees every earlier signal.
//!
//! Decided in place when nobody waits ahead: most actions find their scopes open, and a message
//! to the task and an answer back cost two task wakes per request (≈ 7,000 instructions of
//! ≈ 101,000 on a proxied read, see BENCHMARKS.md). So [`SchedulerHandle::acquire`] first tries
//! the lock itself and, only when nothing could be decided before it — no `acquire` is on its
//! way to the task (an in-transit count taken before each send), no action is ready, due or
//! waiting for a concurrency slot, the action is not planned for later and its task is not
//! cancelled — runs the very dispatch check the task runs. It keeps only a `Go`, which charges
//! exactly what the task's `Go` charges; any other answer charged nothing and the request goes
//! to the task unchanged, where it queues behind everything that arrived before it. The lock is
//! only tried, never waited for: while the task holds it (a wave being released), callers send
//! messages as before. A signal is applied by the task under the same lock before
//! [`SchedulerHandle::signal`] returns, so an admission after it sees it. A [`Permit`] returns
//! its slots in place when no action waits for a slot (nobody to wake), otherwise through the
//! task, which re-examines the waiting actions; a first-try refund is deposited in place too.
//! What the task would admit at once, this admits at once: a newcomer is not let past any
//! action the task would have examined before it.
//!
//! How: an action asks for permission with [`SchedulerHandle::acquire`]. The scheduler runs the
//! core's dispatch check ([`backstop_core::pacing::admit`]) in SPEC §4.1 order — cancellation and
//! deadline, every scope's `next_allowed_at`, pacing (headroom × published rate, interactive
//! reserve), concurrency slots — and answers with a [`Permit`] (the slots come back when the
//! permit drops), a refusal with its outcome, or nothing yet: the action then waits in the
//! delayed queue, counted against each scope's `max_delayed_requests` (past it:
//! `scope_saturated` at once). The task sleeps with one `sleep_until` for the earliest wake; an
//! action waiting for a concurrency slot has no instant and is woken when a slot is released.
//! Nothing busy-loops and no worker is held while waiting.
//!
//! Held cheaply, released in batches: a 429 storm parks whole scopes, so the delayed queue must
//! hold 10^6 actions and release a wave of them that comes due at one instant without walking
//! the queue per action. Each waiting action is one compact entry in a slab (task, agent and
//! route names interned and shared, scopes as table indices); the wake queue is one ordered map
//! keyed by (wake instant, priority, arrival) pointing at slab slots, so everything due is taken
//! off its front in one pass, ordered by priority then arrival, and answered without moving the
//! entry. A ticket index finds an entry when its client goes away.
//!
//! Order among waiting actions: `interactive` > `normal` > `background`, then arrival order.
//! Actions held back by a scope's `next_allowed_at` wake at that boundary plus a jitter drawn
//! from the core's backoff spread (`min(cap(1), boundary_spread)`), so the work released by one
//! boundary does not arrive as one burst (SPEC §4.2); the jitter is trimmed to the deadline and
//! the wait budget, never below the boundary. The random draws come from a SplitMix64 generator
//! seeded from the engine's `seed`, so tests are deterministic.
//!
//! Time waited in the queue is charged to the action's wait budget when it is re-examined
//! (SPEC §5: budgets count all waited time); the budget travels with the request and comes back
//! with the answer.
//!
//! The scope retry quota ([`RetryQuota`](backstop_core::budget::RetryQuota), SPEC §5) is scope state too: retries withdraw from it
//! here, first-try successes deposit the refund.
//!
//! Layout: this module holds the callers' side ([`SchedulerHandle`], [`Permit`], the `acquire`
//! future); `task` the scheduler task and the one state it owns; `scopes` the scope table and
//! the dispatch check over one action's scopes; `waiting` the delayed queue's slab and interned
//! names; `messages` what travels between the two sides.

mod messages;
mod scopes;
mod task;
mod waiting;

use std::{
    future::Future,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use backstop_core::{
    budget::{ActionBudget, ClassBudget, RetryCause},
    clock::Clock,
    outcome::Outcome,
    pacing::{Admission, AdmitRequest},
    policy::Policy,
};
use jiff::Timestamp;
use tokio::sync::{mpsc, oneshot};

pub(crate) use self::task::SplitMix64;
pub use self::{
    messages::{AcquireRequest, RetryQuotaRefused, RetryTokens, ScopeSignal},
    scopes::ScopeView,
};
use self::{
    messages::{Answer, Msg, PendingAcquire},
    scopes::{admit_scopes, ScopeIds},
    task::{is_cancelled, run, Shared, State},
};
use crate::{clock::TokioClock, metrics::Metrics};

/// The scheduler's answer to [`SchedulerHandle::acquire`].
#[derive(Debug)]
pub enum Acquired {
    /// Send now. One attempt, the pacing emissions and one slot per scope were charged; the
    /// slots come back when the permit drops.
    Go {
        /// Holds the concurrency slots.
        permit: Permit,
        /// The budget after the attempt and the waited time were charged.
        budget: ActionBudget,
    },
    /// Do not send; the action ends with `outcome`.
    Refused {
        /// The terminal outcome (`cancelled`, `budget_exhausted`, `deadline_exhausted`,
        /// `scope_saturated`).
        outcome: Outcome,
        /// One line on why.
        detail: String,
        /// The budget as charged so far.
        budget: ActionBudget,
        /// The latest future `next_allowed_at` of the action's scopes, when one held it back.
        boundary: Option<Timestamp>,
        /// The instant the dispatch check would have waited for — a scope's `next_allowed_at`
        /// or its local pacing — when the action was refused because that wait lies beyond its
        /// deadline or remaining wait budget (see [`Admission::Refuse`]); `None` otherwise.
        not_before: Option<Timestamp>,
    },
    /// The scheduler has stopped (shutdown): no attempt was charged, the action stays as stored.
    Stopped {
        /// The budget as it was, with the time waited in the delayed queue charged.
        budget: ActionBudget,
    },
}

/// Concurrency slots of one admitted attempt; dropping it returns them to their scopes.
#[derive(Debug)]
pub struct Permit {
    scopes: ScopeIds,
    granted_at: Timestamp,
    tx: mpsc::UnboundedSender<Msg>,
    shared: Arc<Shared>,
}

impl Permit {
    /// When the scheduler admitted the attempt: its clock as it sent `Go`. The gap between this
    /// and the moment the action sees the answer is the runtime's wake-up of the waiting task,
    /// not waiting in the delayed queue.
    pub fn granted_at(&self) -> Timestamp {
        self.granted_at
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let scopes = std::mem::take(&mut self.scopes);
        // Returned in place when the state is free and no action waits for a slot (nobody to
        // wake); otherwise the task returns the slots and re-examines the waiting actions.
        if let Ok(mut state) = self.shared.state.try_lock() {
            if state.slot_waiters.is_empty() {
                state.release(&scopes);
                return;
            }
        }
        // A stopped scheduler has no slots to return.
        let _ = self.tx.send(Msg::Release { scopes });
    }
}

/// A cloneable handle to the scheduler task.
#[derive(Debug, Clone)]
pub struct SchedulerHandle {
    tx: mpsc::UnboundedSender<Msg>,
    shared: Arc<Shared>,
    views: Arc<Mutex<Arc<Vec<ScopeView>>>>,
    next_ticket: Arc<AtomicU64>,
}

/// How an `acquire` starts: decided in place, or waiting for the task's answer. The in-place
/// answer is boxed: the future of every WAITING action holds a `Start`, and 10^6 of them must
/// fit in ≤ 1 KiB each (an unboxed `Acquired` made the future 176 B instead of 48 B).
enum Start {
    Now(Box<Acquired>),
    Waiting {
        answer: oneshot::Receiver<Answer>,
        guard: AbandonGuard,
        shared: Arc<Shared>,
    },
    /// Answered; polled again, the future answers `Stopped` with nothing left to spend.
    Done,
}

/// The future [`SchedulerHandle::acquire`] returns: a plain struct rather than an `async`
/// block, so that a waiting action holds only what it waits with (the answer's receiver, the
/// abandon guard, the shared counters), not a second copy of it in the block's state.
struct AcquireFuture {
    start: Start,
}

impl Future for AcquireFuture {
    type Output = Acquired;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Acquired> {
        use std::task::Poll;
        let (answer, guard, shared) = match &mut self.start {
            Start::Waiting {
                answer,
                guard,
                shared,
            } => (answer, guard, shared),
            Start::Now(_) | Start::Done => {
                return match std::mem::replace(&mut self.start, Start::Done) {
                    Start::Now(acquired) => Poll::Ready(*acquired),
                    _ => Poll::Ready(Acquired::Stopped {
                        budget: spent_budget(),
                    }),
                };
            }
        };
        let answer = match std::pin::Pin::new(answer).poll(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(answer) => answer,
        };
        guard.disarm();
        Poll::Ready(match answer {
            Ok(Answer::Go {
                scopes,
                granted_at,
                budget,
            }) => match guard.tx.take() {
                Some(tx) => Acquired::Go {
                    permit: Permit {
                        scopes,
                        granted_at,
                        tx,
                        shared: shared.clone(),
                    },
                    budget,
                },
                // Taken only here, once.
                None => Acquired::Stopped { budget },
            },
            Ok(Answer::Refused(refusal)) => Acquired::Refused {
                outcome: refusal.outcome,
                detail: refusal.detail,
                budget: refusal.budget,
                boundary: refusal.boundary,
                not_before: refusal.not_before,
            },
            Ok(Answer::Stopped { budget }) => Acquired::Stopped { budget },
            // Every reply sender answers before it drops (`PendingAcquire` and `Waiter`
            // answer `Stopped` when the scheduler goes away), so this does not happen; were
            // it to, the action is stopped with no budget left to spend.
            Err(_) => Acquired::Stopped {
                budget: spent_budget(),
            },
        })
    }
}

/// A budget with nothing left: zero attempts, no wait.
fn spent_budget() -> ActionBudget {
    ActionBudget::new(
        ClassBudget {
            max_attempts: 0,
            max_wait: Duration::ZERO,
        },
        None,
    )
}

/// Sends `Abandon` if an `acquire` future is dropped before its answer arrived.
/// Its sender moves into the [`Permit`] once the answer is `Go`.
struct AbandonGuard {
    ticket: u64,
    tx: Option<mpsc::UnboundedSender<Msg>>,
    armed: bool,
}

impl AbandonGuard {
    /// The answer arrived: nothing to abandon.
    fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for AbandonGuard {
    fn drop(&mut self) {
        if let (true, Some(tx)) = (self.armed, &self.tx) {
            let _ = tx.send(Msg::Abandon {
                ticket: self.ticket,
            });
        }
    }
}

impl SchedulerHandle {
    /// Spawns the scheduler task with one record (and pacer, when the scope publishes a limit)
    /// per policy scope. Must be called inside a tokio runtime. `seed` seeds the jitter draws.
    pub fn spawn(policy: &Policy, clock: TokioClock, metrics: Arc<Metrics>, seed: u64) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let views = Arc::new(Mutex::new(Arc::new(Vec::new())));
        let state = State::new(policy, clock, metrics, seed, tx.clone(), views.clone());
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
            in_transit: AtomicU64::new(0),
        });
        tokio::spawn(run(shared.clone(), rx));
        SchedulerHandle {
            tx,
            shared,
            views,
            next_ticket: Arc::new(AtomicU64::new(1)),
        }
    }

    /// Decides an action in place when it can go at once without passing anyone: the state is
    /// free, no `acquire` is on its way to the task, nothing is planned for later, and no action
    /// waits that the task would examine first (none ready, none due, none waiting for a
    /// slot). Then it runs the same dispatch check the task runs and, on `Go`, charges the same
    /// things. Anything else goes to the task unchanged (the check charged nothing).
    fn admit_now(&self, request: &AcquireRequest) -> Option<Acquired> {
        let Ok(mut guard) = self.shared.state.try_lock() else {
            return None;
        };
        let state = &mut *guard;
        if state.stopped {
            return Some(Acquired::Stopped {
                budget: request.budget,
            });
        }
        if self.shared.in_transit.load(Ordering::SeqCst) != 0 || !state.ready.is_empty() {
            return None;
        }
        let now = state.clock.now();
        let due = state
            .timers
            .first_key_value()
            .is_some_and(|((at, _), _)| *at <= now);
        if due
            || !state.slot_waiters.is_empty()
            || request.not_before.is_some_and(|at| at > now)
            || (!request.reconciliation
                && is_cancelled(&state.cancelled_tasks, &request.agent, &request.task_id))
        {
            return None;
        }
        let scopes = state.scope_set(&request.scopes);
        let mut budget = request.budget;
        let admitted = AdmitRequest {
            cancelled: false,
            priority: request.priority,
        };
        if admit_scopes(&mut state.scopes, &scopes, admitted, &mut budget, now) != Admission::Go {
            return None;
        }
        for &id in scopes.as_slice() {
            state.scopes[id as usize].sync_gauges();
        }
        tracing::debug!(
            task = %request.task_id,
            route = %request.route,
            priority = ?request.priority,
            attempt = budget.attempts_used(),
            "dispatch: attempt admitted at once"
        );
        drop(guard);
        Some(Acquired::Go {
            permit: Permit {
                scopes,
                granted_at: now,
                tx: self.tx.clone(),
                shared: self.shared.clone(),
            },
            budget,
        })
    }

    /// Asks for permission to send one attempt (SPEC §4.1). The request is handed to the
    /// scheduler when `acquire` is called; the returned future resolves when the action may go,
    /// is refused, or the scheduler stopped. Dropping the future while it waits takes the action
    /// out of the delayed queue and frees its delayed count (client disconnect).
    ///
    /// The future holds only the answer's receiving end and the budget (for
    /// [`Acquired::Stopped`]), not the request: a task parked on it stays small while the
    /// scheduler holds the action.
    pub fn acquire(
        &self,
        request: AcquireRequest,
    ) -> impl Future<Output = Acquired> + Send + 'static {
        let start = match self.admit_now(&request) {
            Some(acquired) => Start::Now(Box::new(acquired)),
            None => {
                let ticket = self.next_ticket.fetch_add(1, Ordering::Relaxed);
                let (reply, answer) = oneshot::channel();
                let pending = PendingAcquire {
                    ticket,
                    request,
                    reply: Some(reply),
                };
                // Counted before it is sent, so no newcomer is admitted in place ahead of it.
                self.shared.in_transit.fetch_add(1, Ordering::SeqCst);
                // Refused, the message comes back and answers `Stopped` as it drops.
                let sent = self.tx.send(Msg::Acquire(pending)).is_ok();
                if !sent {
                    self.shared.in_transit.fetch_sub(1, Ordering::SeqCst);
                }
                Start::Waiting {
                    answer,
                    guard: AbandonGuard {
                        ticket,
                        tx: Some(self.tx.clone()),
                        armed: sent,
                    },
                    shared: self.shared.clone(),
                }
            }
        };
        AcquireFuture { start }
    }

    /// Applies a provider signal to every scope in `scopes` and returns once the scheduler's
    /// records hold it, so that any retry scheduled afterwards already sees it (SPEC §4.1).
    pub async fn signal(&self, scopes: &[String], signal: ScopeSignal) {
        let (done, applied) = oneshot::channel();
        if self
            .tx
            .send(Msg::Signal {
                scopes: scopes.to_vec(),
                signal,
                done,
            })
            .is_ok()
        {
            let _ = applied.await;
        }
    }

    /// Withdraws the cost of one retry from the retry quota of every scope (SPEC §5).
    ///
    /// # Errors
    /// [`RetryQuotaRefused`] naming the first scope whose quota is empty; nothing is withdrawn
    /// then (earlier withdrawals are refunded).
    pub async fn withdraw_retry(
        &self,
        scopes: &[String],
        cause: RetryCause,
    ) -> Result<RetryTokens, RetryQuotaRefused> {
        let (reply, answer) = oneshot::channel();
        let sent = self.tx.send(Msg::Withdraw {
            scopes: scopes.to_vec(),
            cause,
            reply,
        });
        if sent.is_err() {
            return Ok(RetryTokens::default());
        }
        answer.await.unwrap_or_else(|_| Ok(RetryTokens::default()))
    }

    /// Deposits into the retry quotas: `None` for a first-try success (the refund), or the
    /// tokens of a retry that succeeded.
    pub fn deposit(&self, scopes: &[String], tokens: Option<RetryTokens>) {
        // Quota arithmetic needs no ordering with other messages: done in place when the state
        // is free.
        if let Ok(mut state) = self.shared.state.try_lock() {
            state.deposit(scopes, tokens);
            return;
        }
        let _ = self.tx.send(Msg::Deposit {
            scopes: scopes.to_vec(),
            tokens,
        });
    }

    /// Marks a task cancelled: its delayed actions are answered `cancelled` before they wake and
    /// their delayed counts are freed; it never gets a permit again. Returns how many waiting
    /// actions were dropped.
    pub async fn cancel_task(&self, agent: &str, task_id: &str) -> u64 {
        let (reply, answer) = oneshot::channel();
        let sent = self.tx.send(Msg::CancelTask {
            agent: agent.to_owned(),
            task_id: task_id.to_owned(),
            reply,
        });
        if sent.is_err() {
            return 0;
        }
        answer.await.unwrap_or(0)
    }

    /// The scope records: current when the state is free, else as the task last published them.
    pub fn scopes(&self) -> Vec<ScopeView> {
        // Current when the state is free (admissions decided in place are not published by the
        // task); otherwise as the task last published them.
        if let Ok(mut state) = self.shared.state.try_lock() {
            state.publish();
        }
        let views = self
            .views
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        views.as_ref().clone()
    }

    /// Stops the scheduler: waiting actions are answered [`Acquired::Stopped`].
    pub async fn shutdown(&self) {
        let (done, stopped) = oneshot::channel();
        if self.tx.send(Msg::Shutdown { done }).is_ok() {
            let _ = stopped.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use backstop_core::pacing::{Priority, ScopeRecord};
    use jiff::SignedDuration;

    use super::{
        scopes::refresh,
        task::add,
        waiting::{order_key, Slab, Waiter, SLAB_CHUNK},
    };

    fn view_of(record: &ScopeRecord, now: Timestamp) -> ScopeView {
        let mut view = ScopeView::unfilled("billing".into(), "account".into());
        refresh(&mut view, record, now);
        view
    }

    #[test]
    fn remaining_is_shown_only_until_the_window_it_was_reported_for_ends() {
        let t0: Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let at = |s: i64| t0 + SignedDuration::from_secs(s);
        let mut record = ScopeRecord::new("billing/account", 2, 25);
        record.observe_quota(Some(7), Some(10), Some(at(10)), "ietf quota headers");
        let before = view_of(&record, at(9));
        assert_eq!(
            (before.remaining, before.reset_after_seconds),
            (Some(7), Some(1))
        );
        // The reset passed: the old window's count is not known to hold in the new one.
        let after = view_of(&record, at(10));
        assert_eq!((after.remaining, after.reset_after_seconds), (None, None));
        // A report without a reset instant keeps its count.
        let mut unbounded = ScopeRecord::new("billing/account", 2, 25);
        unbounded.observe_quota(Some(3), None, None, "generic quota headers");
        assert_eq!(view_of(&unbounded, at(3600)).remaining, Some(3));

        // A 429 after that reset: 0 left until its boundary, even though the old reset passed.
        record.observe_429(at(20), "HTTP 429 Retry-After");
        assert_eq!(view_of(&record, at(19)).remaining, Some(0));
        assert_eq!(view_of(&record, at(20)).remaining, None);
        // A new window's report counts again.
        record.observe_quota(Some(9), Some(10), Some(at(30)), "ietf quota headers");
        assert_eq!(view_of(&record, at(21)).remaining, Some(9));
    }

    #[test]
    fn unit_samples_stay_in_range_and_follow_the_seed() {
        let mut a = SplitMix64::new(7);
        let mut b = SplitMix64::new(7);
        for _ in 0..1000 {
            let x = a.unit();
            assert!((0.0..1.0).contains(&x));
            assert_eq!(x.to_bits(), b.unit().to_bits());
        }
        assert_ne!(SplitMix64::new(8).unit(), SplitMix64::new(7).unit());
    }

    const POLICY: &str = r#"
shared_scope:
  max_delayed_requests: 100
  max_concurrent_requests: 100
providers:
  billing:
    base_url: http://127.0.0.1:9
    scopes:
      account: {}
    routes:
      "GET /v1/items/{id}": { class: read, scopes: [account] }
"#;

    fn class() -> ClassBudget {
        ClassBudget {
            max_attempts: 3,
            max_wait: Duration::from_secs(600),
        }
    }

    fn request(task: &str, not_before: Option<Timestamp>) -> AcquireRequest {
        AcquireRequest {
            task_id: task.to_owned(),
            agent: "agent-a".to_owned(),
            priority: Priority::Normal,
            scopes: vec!["billing/account".to_owned()],
            budget: ActionBudget::new(class(), None),
            not_before,
            route: "GET /v1/items/{id}".to_owned(),
            reconciliation: false,
        }
    }

    fn spawn() -> (SchedulerHandle, TokioClock) {
        spawn_with(POLICY)
    }

    fn spawn_with(policy: &str) -> (SchedulerHandle, TokioClock) {
        let policy = Policy::from_yaml_str(policy, "test.yaml").expect("the test policy parses");
        let clock = TokioClock::anchored_at("2026-01-01T00:00:00Z".parse().expect("a timestamp"));
        let handle = SchedulerHandle::spawn(&policy, clock, Arc::new(Metrics::new()), 1);
        (handle, clock)
    }

    /// One concurrency slot in the scope.
    fn spawn_one_slot() -> (SchedulerHandle, TokioClock) {
        spawn_with(&POLICY.replace("max_concurrent_requests: 100", "max_concurrent_requests: 1"))
    }

    /// Polls once with a waker that does nothing: what the action sees before any other task
    /// (the scheduler's included) has run.
    fn poll_once<F: Future + Unpin>(future: &mut F) -> std::task::Poll<F::Output> {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        std::pin::Pin::new(future).poll(&mut cx)
    }

    /// Waits for an answer the test expects to come; a lost wake fails the test instead of
    /// hanging it (the paused clock runs ahead to the timeout when nothing else can run).
    async fn answered(acquiring: impl Future<Output = Acquired>) -> Acquired {
        tokio::time::timeout(Duration::from_secs(3600), acquiring)
            .await
            .expect("the action is answered")
    }

    fn go(acquired: Acquired) -> (Permit, ActionBudget) {
        match acquired {
            Acquired::Go { permit, budget } => (permit, budget),
            other => panic!("expected Go, got {other:?}"),
        }
    }

    fn in_flight(handle: &SchedulerHandle) -> u32 {
        handle.scopes().iter().map(|view| view.in_flight).sum()
    }

    #[tokio::test(start_paused = true)]
    async fn an_uncontended_action_is_admitted_in_place_and_charged_as_by_the_task() {
        let (handle, clock) = spawn();
        let mut acquiring = Box::pin(handle.acquire(request("task-1", None)));
        let std::task::Poll::Ready(acquired) = poll_once(&mut acquiring) else {
            panic!("an action nobody waits ahead of is admitted without a round trip");
        };
        let (permit, budget) = go(acquired);
        assert_eq!(budget.attempts_used(), 1);
        assert_eq!(permit.granted_at(), clock.now());
        // Counted at once, and returned at once when the permit drops.
        assert_eq!(in_flight(&handle), 1);
        drop(permit);
        assert_eq!(in_flight(&handle), 0);
        // A planned retry still waits for its instant.
        let later = add(clock.now(), Duration::from_secs(5));
        let mut planned = Box::pin(handle.acquire(request("task-1", Some(later))));
        assert!(poll_once(&mut planned).is_pending());
        let (_, budget) = go(planned.await);
        assert_eq!(budget.attempts_used(), 1);
        assert!(clock.now() >= later);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiting_action_holds_a_small_future() {
        // 10^6 delayed actions must fit in ≤ 1 KiB each (BENCHMARKS.md, "Scheduler scale"): what
        // a waiting action's `acquire` holds is its receiver, its abandon guard and the shared
        // counters, not a copy of a decided answer or of the request.
        let (handle, clock) = spawn();
        let later = add(clock.now(), Duration::from_secs(5));
        let waiting = handle.acquire(request("task-1", Some(later)));
        assert!(
            std::mem::size_of_val(&waiting) <= 48,
            "acquire's future is {} bytes",
            std::mem::size_of_val(&waiting)
        );
        let (_, budget) = go(waiting.await);
        assert_eq!(budget.attempts_used(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_newcomer_does_not_take_the_slot_an_earlier_waiter_waits_for() {
        let (handle, _clock) = spawn_one_slot();
        let (first, _) = go(handle.acquire(request("task-a", None)).await);
        let waiting = tokio::spawn(handle.acquire(request("task-b", None)));
        while delayed(&handle) < 1 {
            tokio::task::yield_now().await;
        }
        // The slot comes back and a newcomer asks before the scheduler has run: the slot is
        // the waiting action's.
        drop(first);
        let mut newcomer = Box::pin(handle.acquire(request("task-c", None)));
        assert!(poll_once(&mut newcomer).is_pending());
        let (second, _) =
            go(answered(async { waiting.await.expect("the waiting task completes") }).await);
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(poll_once(&mut newcomer).is_pending());
        drop(second);
        let (_third, _) = go(answered(newcomer).await);
    }

    #[tokio::test(start_paused = true)]
    async fn an_arrival_on_its_way_to_the_scheduler_is_decided_before_a_later_newcomer() {
        let (handle, _clock) = spawn_one_slot();
        // The state is busy as `acquire` is called: the request goes to the scheduler.
        let state = handle.shared.lock();
        let mut earlier = Box::pin(handle.acquire(request("task-a", None)));
        drop(state);
        // The state is free now and the slot too, but the earlier arrival has not been taken
        // into the state yet: the newcomer is not admitted ahead of it.
        let mut later = Box::pin(handle.acquire(request("task-b", None)));
        assert!(poll_once(&mut later).is_pending());
        let (permit, _) = go(answered(earlier.as_mut()).await);
        assert!(poll_once(&mut later).is_pending());
        drop(permit);
        let (_permit, _) = go(answered(later).await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_429_recorded_just_before_an_admission_holds_it_back() {
        let (handle, clock) = spawn();
        let boundary = add(clock.now(), Duration::from_secs(30));
        let scopes = vec!["billing/account".to_owned()];
        handle
            .signal(
                &scopes,
                ScopeSignal::RateLimited {
                    boundary,
                    source: "HTTP 429 Retry-After".to_owned(),
                },
            )
            .await;
        let mut acquiring = Box::pin(handle.acquire(request("task-1", None)));
        assert!(poll_once(&mut acquiring).is_pending());
        let (permit, _) = go(acquiring.await);
        assert!(permit.granted_at() >= boundary);
    }

    #[tokio::test(start_paused = true)]
    async fn a_cancelled_task_is_refused_not_admitted_in_place() {
        let (handle, _clock) = spawn();
        assert_eq!(handle.cancel_task("agent-a", "task-1").await, 0);
        match handle.acquire(request("task-1", None)).await {
            Acquired::Refused { outcome, .. } => assert_eq!(outcome, Outcome::Cancelled),
            other => panic!("expected Refused, got {other:?}"),
        }
        let (_permit, _) = go(handle.acquire(request("task-2", None)).await);
    }

    fn delayed(handle: &SchedulerHandle) -> u32 {
        handle.scopes().iter().map(|view| view.delayed).sum()
    }

    #[test]
    fn order_puts_higher_priority_first_then_earlier_tickets() {
        let interactive = order_key(Priority::Interactive, 9);
        let normal_early = order_key(Priority::Normal, 1);
        let normal_late = order_key(Priority::Normal, 2);
        let background = order_key(Priority::Background, 0);
        assert!(interactive < normal_early);
        assert!(normal_early < normal_late);
        assert!(normal_late < background);
    }

    #[tokio::test(start_paused = true)]
    async fn delayed_actions_are_answered_stopped_with_their_budget_at_shutdown() {
        let (handle, clock) = spawn();
        let later = add(clock.now(), Duration::from_secs(60));
        let waiting: Vec<_> = (0..3)
            .map(|i| tokio::spawn(handle.acquire(request(&format!("task-{i}"), Some(later)))))
            .collect();
        while delayed(&handle) < 3 {
            tokio::task::yield_now().await;
        }
        handle.shutdown().await;
        for task in waiting {
            match task.await.expect("the waiting task completes") {
                Acquired::Stopped { budget } => {
                    assert_eq!(budget.attempts_used(), 0);
                    assert_eq!(budget.attempts_remaining(), 3);
                }
                other => panic!("expected Stopped, got {other:?}"),
            }
        }
        // Asked after the stop: answered at once, nothing charged.
        match handle.acquire(request("task-late", None)).await {
            Acquired::Stopped { budget } => assert_eq!(budget.attempts_used(), 0),
            other => panic!("expected Stopped, got {other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_wave_due_at_one_instant_goes_by_priority_then_arrival_and_frees_its_places() {
        let (handle, clock) = spawn();
        let due = add(clock.now(), Duration::from_secs(5));
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut waiting = Vec::new();
        for i in 0..50usize {
            let mut asked = request(&format!("task-{}", i % 7), Some(due));
            if i % 5 == 0 {
                asked.priority = Priority::Interactive;
            }
            let acquiring = handle.acquire(asked);
            let order = order.clone();
            waiting.push(tokio::spawn(async move {
                if let Acquired::Go { permit, .. } = acquiring.await {
                    let mut order = order.lock().unwrap_or_else(|p| p.into_inner());
                    order.push((i, permit.granted_at()));
                }
            }));
        }
        while delayed(&handle) < 50 {
            tokio::task::yield_now().await;
        }
        tokio::time::advance(Duration::from_secs(5)).await;
        for task in waiting {
            task.await.expect("the waiting task completes");
        }
        let order = order.lock().unwrap_or_else(|p| p.into_inner()).clone();
        assert!(order.iter().all(|(_, granted)| *granted >= due));
        // One thread: the woken tasks run in the order the scheduler answered them.
        let released: Vec<usize> = order.iter().map(|(i, _)| *i).collect();
        let expected: Vec<usize> = (0..50)
            .filter(|i| i % 5 == 0)
            .chain((0..50).filter(|i| i % 5 != 0))
            .collect();
        assert_eq!(released, expected);
        // Every permit dropped: slots and delayed places are all back.
        for _ in 0..100 {
            if handle.scopes().iter().all(|v| v.in_flight == 0) {
                break;
            }
            tokio::task::yield_now().await;
        }
        let views = handle.scopes();
        assert!(
            views.iter().all(|v| v.in_flight == 0 && v.delayed == 0),
            "{views:?}"
        );
    }

    #[test]
    fn slab_reuses_vacated_slots_and_grows_by_chunks() {
        let mut slab = Slab::default();
        let (reply, _answer) = oneshot::channel();
        let waiter = |ticket: u64, reply: oneshot::Sender<Answer>| Waiter {
            ticket,
            task: Arc::new(("agent".to_owned(), "task".to_owned())),
            route: Arc::from("GET /"),
            scopes: ScopeIds::One(0),
            budget: ActionBudget::new(class(), None),
            since: Timestamp::UNIX_EPOCH,
            wake: Timestamp::UNIX_EPOCH,
            reply: Some(reply),
            priority: Priority::Normal,
            fresh: true,
            delayed: false,
            queued: false,
            timed: false,
            reconciliation: false,
        };
        let mut slots = vec![slab.insert(waiter(0, reply))];
        for ticket in 1..(SLAB_CHUNK as u64 + 1) {
            let (reply, _) = oneshot::channel();
            slots.push(slab.insert(waiter(ticket, reply)));
        }
        assert_eq!(slab.chunks.len(), 2);
        assert_eq!(slots, (0..=SLAB_CHUNK as u32).collect::<Vec<_>>());
        assert_eq!(slab.take(7).map(|w| w.ticket), Some(7));
        assert!(slab.take(7).is_none());
        slab.vacate(9);
        assert!(slab.get_mut(9).is_none());
        let (reply, _) = oneshot::channel();
        let reused = slab.insert(waiter(100, reply));
        assert!(reused == 7 || reused == 9);
        assert_eq!(slab.get_mut(reused).map(|w| w.ticket), Some(100));
        assert_eq!(slab.iter().count(), SLAB_CHUNK);
    }
}
