//! The engine: the executor that owns every retry, on top of the one scheduler.
//!
//! Why one owner: retries layered in SDKs, frameworks and proxies multiply calls exactly when a
//! provider is already throttling. The engine is the single place that decides whether another
//! attempt leaves, and every decision is the core's (`classify`, `plan_retry`, `admit`, budgets,
//! breaker) — the engine only carries them out, in this order for each attempt:
//!
//! 1. ask the [scheduler](crate::scheduler) for a permit (SPEC §4.1: cancellation and deadline,
//!    every scope's `next_allowed_at`, pacing, concurrency slots);
//! 2. mark the attempt `sent` in the store — durable before the bytes leave (SPEC §9, §12);
//! 3. send it once through the [`Transport`];
//! 4. classify the answer with the route's `ClassifyRules` (a 2xx body is never read; a non-2xx
//!    body is buffered up to [`ERROR_BODY_LIMIT`] for the error-code pointer, then passed on);
//! 5. on a rate limit or quota signal update the scope record FIRST (scheduler, then
//!    `store.update_scope`), so no other action assumes the next slot is its own;
//! 6. record the result; then either pass the response through, plan the retry
//!    (`plan_retry`: full jitter, boundary precedence, stop instead of sleeping into failure),
//!    withdraw from the scope retry quota and schedule it durably, or end the action with an
//!    outcome carrying the SPEC §5 context and `next_safe`.
//!
//! Provider responses the agent must see (`rejected`, `conflict`) pass through unchanged;
//! outcomes the gateway makes (`budget_exhausted`, `deadline_exhausted`, `quota_exhausted`,
//! `scope_saturated`, `circuit_open`, `reconciliation_required`, `cancelled`) come back as
//! [`Execution::Outcome`]. Every answer carries the receipt (action id, attempts sent).
//!
//! Budgets (SPEC §5): the class budget (`max_attempts`, `max_wait_seconds`, capped further by
//! `Prefer: wait=N`), the task deadline, the scope retry quota, and the per-task circuit breaker
//! (SPEC §7) keyed by the sanitized fingerprint (method + route template + configured payload
//! fields) and the normalized provider error code.
//!
//! Cancellation: dropping the [`Engine::execute`] future before an attempt is sent (the client
//! disconnected) ends the action `cancelled` in the store — a write keeps an attempt already
//! out until its answer is recorded (`caller_gone`), a side-effect-free call runs on for a
//! short grace (`detached`); [`Engine::cancel_task`] drops a task's
//! delayed actions before they wake. A cancelled action never sends again: the scheduler refuses
//! it and the store refuses to mark another attempt sent.

use std::{
    collections::{HashMap, HashSet},
    pin::Pin,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    task::{Context, Poll},
};

use axum::{
    body::{Body, HttpBody},
    response::IntoResponse,
};
use backstop_core::{
    backoff::{plan_retry, RetryDecision, RetryInput},
    breaker::{RequestFingerprint, TaskBreakers},
    budget::{ActionBudget, ClassBudget, RetryCause},
    classify::{
        classify, ClassifyRules, Disposition, Observed, ResponseView, Signal, TransportError,
    },
    clock::Clock,
    escalation::sanitize_text,
    outcome::{NextSafe, Outcome, OutcomeContext},
    pacing::Priority,
    policy::{Policy, ReconcileBy, RouteMatch},
    quota::quota_boundary_with,
    reconcile::{
        ensure_external_reference, mint_idempotency_key, operation_id_from_response,
        upstream_idempotency_key, validate_idempotency_key,
    },
    signal_headers::{carries_retry_after, select_signal_headers},
};
use backstop_store::{
    ActionId, ActionRecord, ActionState, Admission as StoreAdmission, AttemptRecord, AttemptResult,
    Boundary as StoreBoundary, Completion as StoreCompletion, Finish, NewAction, NewTask,
    PayloadDigest, RouteTemplate, ScopeUpdate, Store, StoreError, StoredResponse,
};
use bytes::{Bytes, BytesMut};
use jiff::Timestamp;
use tokio::sync::oneshot;

use crate::{
    action::{is_safe_method, ActionReceipt, ActionSpec, Execution},
    clock::TokioClock,
    coalesce::{FlightKey, Flights, LeaderGuard, Role, Shared, SHARED_BODY_LIMIT},
    metrics::Metrics,
    problem::Problem,
    scheduler::{AcquireRequest, Acquired, RetryTokens, SchedulerHandle, ScopeSignal},
    transport::{AttemptReply, Transport},
};

pub use crate::scheduler::ScopeView;

mod actions;
mod caller_gone;
mod cancelled;
mod detached;
mod quota_escalations;
mod resend;
mod resume;
mod takeover;
mod writes;

pub use detached::{CALLER_GRACE, RESEND_WINDOW};
pub use quota_escalations::ACCOUNT_CONFIGURATION_STREAK;
pub use writes::{DEFERRED_RECORD_WINDOW, RESTARTED_BEFORE_RETRY, STORE_FAILED_BEFORE_RETRY};

/// The reason a read cut off by a crash is closed at the next start (its action ends
/// `cancelled`): its attempt was sent but no result was recorded, and nobody waits for it
/// any more. Nothing is sent again; resubmitting the read is safe.
pub const RESTARTED_DURING_READ: &str =
    "the gateway restarted while this read was in flight; the caller's request is gone — resubmit";

/// The `source` of an attempt result recorded `uncertain` when the client went away while the
/// attempt was in flight.
const DISCONNECTED_DURING_ATTEMPT: &str = "client disconnected during the attempt";

/// The `source` of an attempt result recorded `uncertain` at restart: the attempt was sent and
/// the previous run stopped before its result was recorded.
const RESTARTED_BEFORE_RESULT: &str = "the gateway restarted before the result was recorded";

/// The reason a read recorded but never sent is closed at the next start (its action ends
/// `cancelled`): the gateway stopped or crashed while it waited for its first attempt (its
/// caller was answered `503 shutting_down`, or went away with the crash). Nothing was sent;
/// resubmitting the read is safe.
pub const RESTARTED_BEFORE_READ_SENT: &str =
    "the gateway stopped before this read was sent; nothing was sent and the caller's request is gone — resubmit";

/// The reason a write recorded but never sent, whose request was not kept (its body over
/// `--retry-body-bytes`), is closed at the next start (its action ends `cancelled`): nothing
/// was sent, and a resend under the same key reopens and sends it.
pub const RESTARTED_BEFORE_WRITE_SENT: &str =
    "the gateway stopped before this write was sent and its request was too large to keep; nothing was sent — resend it under the same Idempotency-Key to have it sent";

use actions::Notify;
pub use actions::{
    Completion, DecisionApplied, KeptResponse, LookupAnswer, Submitted, DECISION_WAIT,
    KEPT_ACTIONS, KEPT_BODY_LIMIT,
};

/// Most requests of escalated writes held in memory for operator decisions (`retry_same_key`,
/// `send_new`); past it, a decision answers `request_not_held` and the agent resubmits.
pub const HELD_REQUESTS: usize = 1024;

/// Largest part of a non-2xx response body read for classification (64 KiB); the rest streams
/// on to the agent untouched.
pub const ERROR_BODY_LIMIT: usize = 64 * 1024;

/// Errors of the engine's management calls.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The caller has no task with this id (task ids are namespaced per agent, so another
    /// agent's task with the same id is not the caller's and is not mentioned).
    #[error("task {0:?} not found")]
    UnknownTask(String),
    /// The store failed.
    #[error("store: {0}")]
    Store(#[from] StoreError),
    /// A blocking store call could not run to completion.
    #[error("store call aborted: {0}")]
    Aborted(String),
    /// The gateway is shutting down: what needed the provider (a reconciliation lookup) was
    /// not sent, and the action is left as the store has it for the next start.
    #[error("the gateway is shutting down")]
    ShuttingDown,
}

/// What [`Engine::cancel_task`] changed.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct TaskCancelled {
    /// The task id.
    pub task_id: String,
    /// Actions that ended with `cancelled` in the store.
    pub actions_cancelled: u64,
    /// Durable scheduled retries dropped before they woke.
    pub retries_dropped: u64,
    /// Actions taken out of the scheduler's delayed queue.
    pub waiting_dropped: u64,
    /// The task's writes not cancelled because an attempt of theirs is unsettled (the provider
    /// may have acted on it): each is reconciled with its original key instead, found →
    /// `succeeded`, otherwise `escalated`; nothing is sent for it.
    pub reconciling: Vec<Reconciling>,
}

/// A write of a cancelled task that is reconciled, not cancelled (see [`TaskCancelled`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Reconciling {
    /// The write's action id.
    pub action_id: i64,
    /// Its attempt that was sent and never answered (`uncertain`), which no later answer under
    /// the same key settled.
    pub uncertain_attempt: u32,
}

/// The gateway's executor and scheduler: a cheap, cloneable handle.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").finish_non_exhaustive()
    }
}

struct Inner {
    policy: Arc<Policy>,
    store: Arc<dyn Store>,
    transport: Arc<dyn Transport>,
    clock: TokioClock,
    metrics: Arc<Metrics>,
    scheduler: SchedulerHandle,
    rng: Mutex<crate::scheduler::SplitMix64>,
    /// Circuit breakers per task, by agent, then task id (looked up without copying either);
    /// the core forgets those with nothing left to say (see [`TaskBreakers`]).
    breakers: Mutex<TaskBreakers>,
    /// `backstop_task_breakers`: the number of task breakers held, set on every change.
    breakers_gauge: prometheus_client::metrics::gauge::Gauge,
    flights: Arc<Flights>,
    shutting_down: AtomicBool,
    /// `true` once the stop's grace is running out ([`Engine::give_up_attempts`]): an attempt
    /// still out is no longer waited for.
    given_up: tokio::sync::watch::Sender<bool>,
    /// `true` once restart recovery has listed the attempts left unfinished by the previous
    /// run: no action records anything before, so an attempt of this run is never mistaken
    /// for one the restart interrupted.
    recovery_listed: tokio::sync::watch::Sender<bool>,
    /// Writes of cancelled tasks being reconciled, by action id: one closer at a time (see
    /// [`cancelled`]).
    closing: Mutex<HashSet<i64>>,
    /// Writes recorded and never sent, by action id: those the previous run left (see
    /// [`Store::unsent_writes`], listed with the unfinished attempts, before any action of this
    /// run), and those of this run whose first send the store could not record. The agent's
    /// resend under the same key takes one over and sends it as the same action.
    unsent: Mutex<HashSet<i64>>,
    /// Actions a restart-recovery path of this run has taken up, by action id: each is
    /// recovered once per run (see [`Inner::take_up`]), whichever of the lists read at start
    /// names it first.
    recovering: Mutex<HashSet<i64>>,
    /// Provider credential headers for lookups made without an agent request (after a restart).
    credentials: Mutex<HashMap<String, (http::HeaderName, http::HeaderValue)>>,
    /// Prepared requests of escalated writes (in memory only), for operator decisions.
    held: Mutex<HashMap<i64, ActionSpec>>,
    /// Side-effect-free calls in flight and their final answers kept for re-sends (see
    /// [`detached`]).
    detached: detached::Detached,
    /// Completions of background actions, kept for their agent (bounded, in memory only).
    kept: Mutex<actions::Kept>,
    /// Held while a `shared_quota_exhausted` escalation is looked for and opened, so that
    /// several actions meeting the same exhausted quota at once open one per scope.
    quota_escalations: tokio::sync::Mutex<()>,
    /// Runs of `rate_limited` answers per scope (in memory only), for `account_configuration`.
    limit_streaks: Mutex<quota_escalations::LimitStreaks>,
    /// The classification rules of every `(provider, class)` pair of the policy, built once:
    /// the policy does not change while the engine runs, and building the rules (the
    /// error-code table, the pointer lists) for every action cost more than classifying.
    rules: RuleTable,
    /// The request fingerprints of the configured routes that fingerprint no payload field, by
    /// template and method: each is the SHA-256 of the method and the template alone, the same
    /// for every action of its route (see [`Inner::fingerprint`]).
    route_fingerprints: HashMap<String, Vec<(String, RequestFingerprint)>>,
}

/// Classification rules by provider, then request class.
type RuleTable = HashMap<String, HashMap<String, Arc<ClassifyRules>>>;

/// The classification rules of every provider and request class of `policy`.
fn rule_table(policy: &Policy) -> RuleTable {
    policy
        .providers
        .keys()
        .map(|provider| {
            let by_class = policy
                .request_classes
                .iter()
                .filter_map(|(name, class)| {
                    let rules = policy.classify_rules(provider, class).ok()?;
                    Some((name.clone(), Arc::new(rules)))
                })
                .collect();
            (provider.clone(), by_class)
        })
        .collect()
}

/// The request fingerprint of an action on `route` with payload `body`, taken from `known` (see
/// [`route_fingerprints`]) for a configured route without payload fields, computed otherwise.
fn fingerprint_with(
    known: &HashMap<String, Vec<(String, RequestFingerprint)>>,
    route: &RouteMatch,
    body: &[u8],
) -> RequestFingerprint {
    if route.fingerprint_fields.is_empty() {
        let found = route
            .configured
            .then(|| known.get(&route.template))
            .flatten()
            .and_then(|methods| methods.iter().find(|(method, _)| *method == route.method));
        return match found {
            Some((_, fingerprint)) => fingerprint.clone(),
            None => RequestFingerprint::compute(&route.method, &route.template, None, &[]),
        };
    }
    let payload = serde_json::from_slice::<serde_json::Value>(body).ok();
    RequestFingerprint::compute(
        &route.method,
        &route.template,
        payload.as_ref(),
        &route.fingerprint_fields,
    )
}

/// The fingerprints of the configured routes of `policy` without payload fields, by template
/// and method.
fn route_fingerprints(policy: &Policy) -> HashMap<String, Vec<(String, RequestFingerprint)>> {
    let mut table: HashMap<String, Vec<(String, RequestFingerprint)>> = HashMap::new();
    let routes = policy.providers.values().flat_map(|p| p.routes.iter());
    for route in routes.filter(|r| r.fingerprint_fields.is_empty()) {
        let methods = table.entry(route.template.clone()).or_default();
        if methods.iter().all(|(method, _)| *method != route.method) {
            let fingerprint =
                RequestFingerprint::compute(&route.method, &route.template, None, &[]);
            methods.push((route.method.clone(), fingerprint));
        }
    }
    table
}

/// What has been seen of an action so far (for the SPEC §5 context).
#[derive(Debug, Default)]
struct Seen {
    sent: u32,
    /// Attempts whose request bytes may have left the process (every one not `not_sent`): what
    /// an outcome's `sent` reports.
    left: u32,
    response_received: bool,
    last_status: Option<u16>,
    /// The disposition of the last answer (`rate_limited`, `success`, …).
    last_signal: Option<&'static str>,
    /// Whether an attempt (this run's or an earlier one's) may have been acted on and no later
    /// answer settled it ([`writes::still_unsettled`]).
    unsettled: bool,
    /// How the last attempt failed when it got no complete answer (`None` after a response).
    last_failure: Option<TransportError>,
    boundary: Option<Timestamp>,
}

/// Which record of a retry the store could not commit (see `Engine::close_unrecorded_retry`).
enum UnrecordedRetry {
    /// Its start when it came due: the `action_sent` that claims its job.
    Start,
    /// Its schedule, after the last attempt's result; `result` is that result when the store
    /// could not record it either.
    Schedule { result: Option<Box<AttemptResult>> },
}

/// Everything fixed about one recorded action during its attempt loop.
struct Run<'a> {
    spec: &'a ActionSpec,
    id: ActionId,
    fingerprint: RequestFingerprint,
    rules: Arc<ClassifyRules>,
    /// The request every attempt sends: the agent's, with the idempotency key under the
    /// provider's header and the external reference written into the payload when configured
    /// (a read's is the agent's as it is, borrowed from the spec).
    request: std::borrow::Cow<'a, crate::transport::AttemptRequest>,
    /// The one idempotency key of this logical action, as the agent knows it.
    key: String,
    /// The key the provider is sent ([`upstream_idempotency_key`] of agent and key); empty for
    /// a read.
    upstream_key: String,
    /// The client-generated external reference, if the route reconciles by one.
    reference: Option<String>,
    /// The provider's operation id, once a response carried it.
    operation_id: Mutex<Option<String>>,
    /// What the action's attempts did before this run: nothing, except for a write taken over
    /// by a same-key resend (reopened, or recorded and never sent), which continues its count
    /// and whose last answer an answer given before this run sends (a refusal, a stop) reports.
    prior: SoFar,
    /// A read's records, which nobody awaits (`None` for a write).
    read_records: Option<Arc<ReadRecords>>,
    /// The action's task when this run took over a write recorded before (a same-key resend,
    /// which may name another task): its receipts name it. `None` for a new action.
    own_task: Option<String>,
    /// The priority its attempts are paced with: the request's for a new action, the action's
    /// own task's for one taken over.
    priority: Priority,
    /// Whether the store keeps this write's request until it ends (SPEC §6), so that the next
    /// start resumes it rather than cancelling it.
    kept: bool,
}

impl Run<'_> {
    /// The task the action belongs to: the request's for a new action, the action's own for a
    /// write taken over (see [`Run::own_task`]). Its attempts are scheduled under it (its
    /// cancellation stops them), its circuit breaker counts them, its case files name it.
    fn task(&self) -> &str {
        self.own_task.as_deref().unwrap_or(&self.spec.task_id)
    }

    /// The receipt of this action after `attempts` attempts.
    fn receipt(&self, attempts: u32) -> ActionReceipt {
        ActionReceipt {
            action_id: self.id.0,
            idempotency_key: self.agent_key(),
            attempts,
            provider_operation_id: None,
            task: self.own_task.clone(),
        }
    }

    /// The idempotency key in effect, as told to the agent: writes only.
    fn agent_key(&self) -> Option<String> {
        (self.spec.has_side_effect()).then(|| self.key.clone())
    }

    /// The completion of a read's record `what` that nobody awaits (see [`ReadRecords`]).
    fn read_completion<T: Send + 'static>(&self, what: &'static str) -> StoreCompletion<T> {
        match &self.read_records {
            Some(records) => records.completion(what),
            // A write's records are awaited; this is not reached for one.
            None => Box::new(|_| {}),
        }
    }
}

/// The `host:port` of an upstream URL (`http://api.example.com:8443/v1/x` →
/// `api.example.com:8443`), or the URL itself when it has no authority: for messages only.
fn upstream_authority(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or(rest);
    // Userinfo never belongs in a message.
    authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host)
}

/// `problem` (a `503 store_unavailable` or `503 shutting_down` for an accepted request) with
/// what identifies the request, as the gateway's other answers for an action carry it: `task`
/// (the action's own when the receipt names it, else the request's), the write's
/// `idempotency_key` (the receipt's, the agent's or the one minted for it, which the door also
/// answers as the `Idempotency-Key` header) and `action_id` when an action was recorded (a
/// receipt's id 0 means none was).
fn with_ids(problem: Problem, spec: &ActionSpec, receipt: &ActionReceipt) -> Problem {
    let task = receipt.task.as_deref().unwrap_or(&spec.task_id);
    let mut problem = problem.with_extension("task", task.into());
    if let Some(key) = &receipt.idempotency_key {
        problem = problem.with_extension("idempotency_key", key.as_str().into());
    }
    if receipt.action_id != 0 {
        problem = problem.with_extension("action_id", receipt.action_id.into());
    }
    problem
}

fn store_outcome(outcome: Outcome) -> backstop_store::Outcome {
    backstop_store::Outcome::parse(outcome.as_str()).unwrap_or(backstop_store::Outcome::Cancelled)
}

fn core_outcome(outcome: backstop_store::Outcome) -> Outcome {
    serde_json::from_value(serde_json::Value::String(outcome.as_str().to_owned()))
        .unwrap_or(Outcome::Cancelled)
}

fn store_disposition(d: Disposition) -> backstop_store::Disposition {
    backstop_store::Disposition::parse(d.as_str()).unwrap_or(backstop_store::Disposition::Uncertain)
}

fn store_priority(p: Priority) -> backstop_store::Priority {
    match p {
        Priority::Interactive => backstop_store::Priority::Interactive,
        Priority::Normal => backstop_store::Priority::Normal,
        Priority::Background => backstop_store::Priority::Background,
    }
}

/// A stored task's priority as the scheduler paces with it.
fn core_priority(p: backstop_store::Priority) -> Priority {
    match p {
        backstop_store::Priority::Interactive => Priority::Interactive,
        backstop_store::Priority::Normal => Priority::Normal,
        backstop_store::Priority::Background => Priority::Background,
    }
}

/// A count as a gauge value (saturating).
fn gauge_value(count: usize) -> i64 {
    i64::try_from(count).unwrap_or(i64::MAX)
}

fn wait_ms(budget: &ActionBudget) -> u64 {
    u64::try_from(budget.waited().as_millis()).unwrap_or(u64::MAX)
}

fn wait_then_abort(boundary: Option<Timestamp>) -> Vec<NextSafe> {
    match boundary {
        Some(at) => vec![NextSafe::WaitUntil { at }, NextSafe::Abort],
        None => vec![NextSafe::Abort],
    }
}

fn coalesce_key(spec: &ActionSpec) -> String {
    crate::coalesce::read_key(
        &spec.agent,
        &spec.request.method,
        &spec.request.url,
        &spec.request.headers,
        &spec.payload_digest,
    )
}

/// A body that yields an already read prefix, then the rest of the original body.
struct Prefixed {
    prefix: Option<Bytes>,
    rest: Body,
}

impl HttpBody for Prefixed {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        if let Some(prefix) = self.prefix.take() {
            return Poll::Ready(Some(Ok(http_body::Frame::data(prefix))));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }
}

/// A body that failed while it was read (the provider's response was cut), with the bytes
/// that had arrived before.
#[derive(Debug)]
struct CutBody {
    /// The bytes read before the failure (at most the limit read to, plus one frame).
    received: Bytes,
    /// Why the body failed.
    error: axum::Error,
}

/// Reads at most `limit` bytes of `body`. Returns the bytes read and, when the body is longer,
/// a body that replays them followed by the rest.
///
/// # Errors
/// The body failed while being read (the response was cut): [`CutBody`] with the bytes read.
async fn read_bounded(mut body: Body, limit: usize) -> Result<(Bytes, Body), CutBody> {
    let mut buf = BytesMut::new();
    loop {
        let frame = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await;
        match frame {
            None => {
                let bytes = buf.freeze();
                return Ok((bytes.clone(), Body::from(bytes)));
            }
            Some(Err(error)) => {
                return Err(CutBody {
                    received: buf.freeze(),
                    error,
                })
            }
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    buf.extend_from_slice(&data);
                    if buf.len() > limit {
                        let bytes = buf.freeze();
                        let rebuilt = Body::new(Prefixed {
                            prefix: Some(bytes.clone()),
                            rest: body,
                        });
                        return Ok((bytes, rebuilt));
                    }
                }
            }
        }
    }
}

/// A write's final response as kept for idempotent replay ([`crate::wire::replay_record`]):
/// at most [`crate::wire::REPLAY_BODY_LIMIT`] bytes of its body are read and kept. An event
/// stream's body is never kept (only its status and headers); it is read — at most
/// [`ERROR_BODY_LIMIT`] bytes, for an operation id — only when `read_stream`. Returns the
/// response to pass on (the bytes read, then the rest of the body), the record to store, and
/// the bytes read (empty when none were).
///
/// A body cut while it is read (the provider closed before its `Content-Length` was sent, or a
/// chunked body broke off) is passed on as the bytes received, with
/// [`crate::wire::BODY_TRUNCATED_HEADER`] giving their number and the provider's
/// `Content-Length` removed, and kept the same way (up to the replay limit; an event stream's
/// never), so its replay carries those bytes under [`crate::wire::REPLAY_TRUNCATED_HEADER`].
/// Nothing of it passes for complete.
async fn kept_for_replay(
    response: http::Response<Body>,
    action: ActionId,
    read_stream: bool,
) -> (http::Response<Body>, StoredResponse, Bytes) {
    let stream = crate::wire::is_event_stream(response.headers());
    if stream && !read_stream {
        let record = crate::wire::replay_record(response.status(), response.headers(), &[], false);
        return (response, record, Bytes::new());
    }
    let limit = if stream {
        ERROR_BODY_LIMIT
    } else {
        crate::wire::REPLAY_BODY_LIMIT
    };
    let (parts, body) = response.into_parts();
    match read_bounded(body, limit).await {
        Ok((bytes, body)) => {
            let complete = !stream && bytes.len() <= limit;
            let kept = if stream { &[][..] } else { &bytes[..] };
            let record = crate::wire::replay_record(parts.status, &parts.headers, kept, complete);
            (http::Response::from_parts(parts, body), record, bytes)
        }
        Err(cut) => {
            let received = cut.received;
            tracing::warn!(
                action = action.0,
                error = %cut.error,
                received = received.len(),
                "the write's response body was cut while it was read; the bytes received are passed on, marked incomplete"
            );
            let kept = if stream { &[][..] } else { &received[..] };
            let record = crate::wire::replay_record(parts.status, &parts.headers, kept, false);
            let mut parts = parts;
            parts.headers.remove(http::header::CONTENT_LENGTH);
            parts.headers.insert(
                crate::wire::BODY_TRUNCATED_HEADER,
                http::HeaderValue::from(received.len()),
            );
            (
                http::Response::from_parts(parts, Body::from(received.clone())),
                record,
                received,
            )
        }
    }
}

/// Closes an action (audited) when its `execute` future is dropped mid-way (the client
/// disconnected): as every action nothing sends again is closed (`writes::Closing`), a write
/// with an unsettled attempt — or one still in flight, so its answer is unknown — is
/// reconciled with its original key; any other action ends `cancelled`.
struct ActionGuard<'a> {
    inner: Arc<Inner>,
    id: ActionId,
    /// The route's provider and class, copied for the metrics only if the action is cancelled.
    provider: &'a str,
    class: &'a str,
    /// Whether the action is a read (safe method).
    read: bool,
    /// What its attempts did so far (for a write taken over by a same-key resend, from its
    /// stored attempts until this run sends): what closing it goes by.
    so_far: SoFar,
    armed: bool,
}

/// What an action's attempts did so far: what a close goes by when nothing more is sent for
/// it (its caller went away), and what its `cancelled` context then says.
#[derive(Debug, Default, Clone, Copy)]
struct SoFar {
    /// Attempts that left.
    sent: u32,
    /// The attempt whose answer has not come back yet, if one is out.
    in_flight: Option<u32>,
    /// The last response's status and the last attempt's disposition, once one came back.
    last_status: Option<u16>,
    last_signal: Option<&'static str>,
    /// Whether an attempt may have been acted on and no later answer settled it
    /// ([`writes::still_unsettled`]): such a write is reconciled, never `cancelled`.
    unsettled: bool,
}

impl SoFar {
    /// What the stored `attempts` of a write say it had done before this run took it over (a
    /// same-key resend of a reopened or never sent write): as [`writes::Closing::of_stored`]
    /// reads them, a last attempt sent without a result is `uncertain`.
    fn of_stored(attempts: &[AttemptRecord]) -> SoFar {
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
fn uncertain_result(
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
    fn close_for_gone_client(
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
}

impl Inner {
    /// Ends action `id` `cancelled` because its caller went away; `gone` says what it had done
    /// (an attempt in flight is recorded `uncertain` with the outcome). Store errors are logged;
    /// nothing is retried.
    async fn cancel_for_gone_client(&self, id: ActionId, gone: SoFar, provider: &str, class: &str) {
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

    /// `future`'s output, or `None` once the stop's grace is running out
    /// ([`Engine::give_up_attempts`]): an attempt or lookup still out is then not waited for.
    async fn unless_given_up<T>(&self, future: impl std::future::Future<Output = T>) -> Option<T> {
        let mut given_up = self.given_up.subscribe();
        tokio::select! {
            out = future => Some(out),
            _ = given_up.wait_for(|given_up| *given_up) => None,
        }
    }

    /// Runs a blocking store call off the async workers.
    async fn blocking<T, F>(&self, f: F) -> Result<T, EngineError>
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
    async fn blocking_or_else<T, F, O>(&self, f: F, orphaned: O) -> Result<T, EngineError>
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
    async fn queued<T, F>(&self, f: F) -> Result<T, EngineError>
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
    async fn queued_or_else<T, F, O>(&self, f: F, orphaned: O) -> Result<T, EngineError>
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
struct Awaiting<T, O: FnOnce(Result<T, StoreError>)> {
    rx: oneshot::Receiver<Result<T, StoreError>>,
    orphaned: Arc<Mutex<Option<O>>>,
    read: bool,
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
struct ReadRecords {
    /// The action id, known once the store handed it out (after the request completion was
    /// given to the store).
    action: std::sync::OnceLock<i64>,
    task: String,
    agent: String,
    provider: String,
    route: String,
    /// Whether a failure of this read was logged already.
    reported: AtomicBool,
}

impl ReadRecords {
    fn new(spec: &ActionSpec) -> Arc<ReadRecords> {
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
    fn completion<T: Send + 'static>(self: &Arc<Self>, what: &'static str) -> StoreCompletion<T> {
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
    fn not_recorded(&self, what: &str, e: &StoreError) {
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
    async fn cancel_interrupted_read(&self, action: ActionId, attempt: u32) {
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

impl Inner {
    /// 16 bytes for minting an idempotency key: the engine's generator mixed with the current
    /// instant, so a restarted gateway with the same seed never mints a key again.
    fn random_16(&self) -> [u8; 16] {
        let nanos = self.clock.now().as_nanosecond().to_le_bytes();
        let mut out = [0u8; 16];
        let mut rng = self
            .rng
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        for (i, chunk) in out.chunks_mut(4).enumerate() {
            let draw = (rng.unit() * f64::from(u32::MAX)) as u32;
            chunk.copy_from_slice(&draw.to_le_bytes());
            for (j, b) in chunk.iter_mut().enumerate() {
                *b ^= nanos[i * 4 + j];
            }
        }
        out
    }

    fn unit(&self) -> f64 {
        self.rng
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .unit()
    }

    /// The request fingerprint of an action on `route` with payload `body`: the method, the
    /// template and the route's stable payload fields (SPEC §7). A configured route without
    /// payload fields has one fingerprint, computed when the engine was built.
    fn fingerprint(&self, route: &RouteMatch, body: &[u8]) -> RequestFingerprint {
        fingerprint_with(&self.route_fingerprints, route, body)
    }

    /// The classification rules of `provider` for the request class `class` (named
    /// `class_name`), from the table built with the engine.
    ///
    /// # Errors
    /// [`backstop_core::policy::UnknownProvider`] for a provider the policy does not name.
    fn rules(
        &self,
        provider: &str,
        class_name: &str,
        class: &backstop_core::policy::RequestClass,
    ) -> Result<Arc<ClassifyRules>, backstop_core::policy::UnknownProvider> {
        match self.rules.get(provider).and_then(|c| c.get(class_name)) {
            Some(rules) => Ok(rules.clone()),
            None => self.policy.classify_rules(provider, class).map(Arc::new),
        }
    }
}

impl Engine {
    /// Builds the engine and spawns its scheduler task (call inside a tokio runtime). Scope
    /// records start from the policy and are then refreshed from the store, so boundaries
    /// recorded before a restart keep holding. `seed` seeds every jitter draw (deterministic
    /// tests); production passes a random seed.
    pub fn new(
        policy: Arc<Policy>,
        store: Arc<dyn Store>,
        transport: Arc<dyn Transport>,
        clock: TokioClock,
        metrics: Arc<Metrics>,
        seed: u64,
    ) -> Engine {
        Engine::with_credentials(policy, store, transport, clock, metrics, seed, Vec::new())
    }

    /// [`Engine::new`] with the provider credential headers (`(provider, name, value)`) that
    /// reconciliation lookups carry when no agent request is at hand. They are in place before
    /// restart recovery runs, so lookups of writes left unfinished by a crash are authenticated.
    #[allow(clippy::too_many_arguments)]
    pub fn with_credentials(
        policy: Arc<Policy>,
        store: Arc<dyn Store>,
        transport: Arc<dyn Transport>,
        clock: TokioClock,
        metrics: Arc<Metrics>,
        seed: u64,
        credentials: Vec<(String, http::HeaderName, http::HeaderValue)>,
    ) -> Engine {
        let credentials: HashMap<String, (http::HeaderName, http::HeaderValue)> = credentials
            .into_iter()
            .map(|(provider, name, value)| (provider, (name, value)))
            .collect();
        let scheduler = SchedulerHandle::spawn(&policy, clock, metrics.clone(), seed);
        let rules = rule_table(&policy);
        let fingerprints = route_fingerprints(&policy);
        let breakers = TaskBreakers::new(policy.breaker.threshold, policy.breaker.forget_after);
        let breakers_gauge = metrics.task_breakers_gauge();
        let inner = Arc::new(Inner {
            policy,
            store,
            transport,
            clock,
            metrics,
            scheduler,
            rng: Mutex::new(crate::scheduler::SplitMix64::new(
                seed ^ 0xA076_1D64_78BD_642F,
            )),
            breakers: Mutex::new(breakers),
            breakers_gauge,
            flights: Arc::new(Flights::default()),
            shutting_down: AtomicBool::new(false),
            given_up: tokio::sync::watch::Sender::new(false),
            recovery_listed: tokio::sync::watch::Sender::new(false),
            unsent: Mutex::new(HashSet::new()),
            recovering: Mutex::new(HashSet::new()),
            closing: Mutex::new(HashSet::new()),
            credentials: Mutex::new(credentials),
            held: Mutex::new(HashMap::new()),
            detached: detached::Detached::default(),
            kept: Mutex::new(actions::Kept::default()),
            quota_escalations: tokio::sync::Mutex::new(()),
            limit_streaks: Mutex::new(quota_escalations::LimitStreaks::default()),
            rules,
            route_fingerprints: fingerprints,
        });
        let restore = inner.clone();
        tokio::spawn(async move {
            // The previous run's unfinished attempts and scheduled retries, listed before any
            // action of this run is recorded (see `recovery_listed`): a retry this run schedules
            // is its own, never one to re-arm as if its caller were gone.
            let unfinished = restore.blocking(|s| s.unfinished_attempts()).await;
            let scheduled = restore.blocking(|s| s.scheduled_retries()).await;
            let between = restore.blocking(|s| s.actions_between_attempts()).await;
            let unsent_reads = restore.blocking(|s| s.unsent_reads()).await;
            let unsent_writes = match restore.blocking(|s| s.unsent_writes()).await {
                Ok(unsent) => {
                    if !unsent.is_empty() {
                        tracing::info!(
                            writes = unsent.len(),
                            "restart recovery: writes recorded but never sent are sent from their kept requests under their original keys"
                        );
                    }
                    restore
                        .unsent
                        .lock()
                        .unwrap_or_else(|poisoned| poisoned.into_inner())
                        .extend(unsent.iter().map(|id| id.0));
                    unsent
                }
                Err(e) => {
                    tracing::error!(error = %e, "restart recovery: cannot read the writes never sent");
                    Vec::new()
                }
            };
            restore.recovery_listed.send_replace(true);
            let scopes: Vec<(String, String)> = restore
                .policy
                .providers
                .iter()
                .flat_map(|(p, provider)| {
                    provider
                        .scopes
                        .values()
                        .map(move |s| (p.clone(), s.name.clone()))
                })
                .collect();
            for (provider, scope) in scopes {
                let (p, s) = (provider.clone(), scope.clone());
                match restore.blocking(move |st| st.scope(&p, &s)).await {
                    Ok(Some(record)) => {
                        restore
                            .scheduler
                            .signal(
                                std::slice::from_ref(&scope),
                                ScopeSignal::Restore {
                                    next_allowed_at: record.next_allowed_at,
                                    remaining: record.remaining,
                                    limit: record.limit,
                                    reset_at: record.reset_at,
                                    source: record.source,
                                },
                            )
                            .await;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!(scope = %scope, error = %e, "could not read the stored scope record")
                    }
                }
            }
            // Restart recovery (SPEC §12): writes sent without a result are reconciled with
            // their original key; actions left between two attempts are closed (an uncertain
            // write reconciled); scheduled retries are re-armed at their due instants.
            restore.recover_unfinished(unfinished).await;
            restore.recover_between_attempts(between).await;
            restore.close_unsent_reads(unsent_reads).await;
            restore.resume_unsent(unsent_writes).await;
            restore.rearm_scheduled(scheduled).await;
        });
        Engine { inner }
    }

    /// Registers the credential header (`name: value`) that reconciliation lookups of
    /// `provider` carry when no agent request is at hand (restart recovery). Lookups made for a
    /// running action reuse the credential header of that action's request instead.
    pub fn set_credential(&self, provider: &str, name: http::HeaderName, value: http::HeaderValue) {
        self.inner
            .credentials
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(provider.to_owned(), (name, value));
    }

    /// The scope records as the scheduler last published them (for `GET /v1/scopes`).
    pub fn scopes(&self) -> Vec<ScopeView> {
        self.inner.scheduler.scopes()
    }

    /// The number of per-task circuit breakers held in memory (SPEC §7), for metrics and
    /// diagnostics: tasks with a failure streak not yet ended by a success, not cancelled, and
    /// not forgotten (`breaker.forget_after_seconds`) — plus forgotten ones a sweep has not
    /// reclaimed yet. Also exported as `backstop_task_breakers`.
    pub fn breakers_held(&self) -> usize {
        self.inner
            .breakers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .len()
    }

    /// Stops taking new work: later [`Engine::execute`] calls are answered `503 shutting_down`
    /// without being recorded (with `sent: false`, the `task` and, for a write, the
    /// `idempotency_key`), waiting actions are released without a final outcome (their
    /// scheduled retries stay in the store, recoverable after a restart), and the scheduler
    /// task ends. A write whose answer never comes (`uncertain`) after this is not reconciled
    /// now — its lookup would need the stopped scheduler — but left sent without a result for
    /// the next start to reconcile with its original key (SPEC §12).
    pub async fn shutdown(&self) {
        self.inner.shutting_down.store(true, Ordering::SeqCst);
        self.inner.scheduler.shutdown().await;
        // Reads' records queued without waiting are committed before the gateway stops.
        if let Err(e) = self.inner.blocking(|s| s.flush()).await {
            tracing::warn!(error = %e, "could not commit the queued read records at shutdown");
        }
    }

    /// Gives up every attempt still out, once the stop's grace is running out (after
    /// [`Engine::shutdown`]; the provider is slower than the grace): its caller is answered
    /// `503 shutting_down` at once, with `after_restart` (`reconcile` for a write, `cancel` for a
    /// read), `last_signal` `uncertain` and `sent: true`, instead of having its connection cut
    /// when the grace ends. Nothing is recorded for the attempt: it stays sent without a result,
    /// which the next start reconciles with its original key for a write and closes `cancelled`
    /// for a read (SPEC §12). Attempts sent later are given up as soon as they leave. A
    /// reconciliation lookup still out is given up too (audited `inconclusive`, its status
    /// unknown), and its write left sent without a result.
    pub fn give_up_attempts(&self) {
        self.inner.given_up.send_replace(true);
    }

    /// Sets the `backstop_open_escalations` gauge to the number of escalations open in the
    /// store (read when `/metrics` is asked for, so escalations opened or decided by any path
    /// are counted). A store that cannot be read leaves the gauge as it was, with a warning.
    pub async fn refresh_open_escalations(&self) {
        match self.inner.blocking(|s| s.count_open_escalations()).await {
            Ok(open) => self.inner.metrics.set_open_escalations(open),
            Err(e) => tracing::warn!(error = %e, "could not count the open escalations"),
        }
    }

    /// Cancels the task `task_id` of `agent` (SPEC §4.3): its delayed actions are dropped
    /// before they wake, their slots and delayed counts freed, every unfinished action ends
    /// `cancelled` (audited) and no action of the task sends again — but a write with an
    /// unsettled attempt (the provider may have acted on it), which is reconciled with its
    /// original key instead (found → `succeeded`, otherwise `escalated`; nothing is sent) and
    /// listed in [`TaskCancelled::reconciling`].
    /// Task ids are namespaced per agent: another agent's task with the same id is neither
    /// touched nor revealed.
    ///
    /// # Errors
    /// [`EngineError::UnknownTask`] when `agent` has no such task (whether or not another agent
    /// has), or a store failure.
    pub async fn cancel_task(
        &self,
        task_id: &str,
        agent: &str,
    ) -> Result<TaskCancelled, EngineError> {
        self.cancel_task_as(task_id, Some(agent)).await
    }

    /// [`Engine::cancel_task`] for `agent`, or, when `agent` is `None` (an operator, who may
    /// see all), for EVERY agent's task with this id; the counts of the answer are then summed
    /// over those tasks.
    ///
    /// # Errors
    /// [`EngineError::UnknownTask`] when no task matches, or a store failure.
    pub async fn cancel_task_as(
        &self,
        task_id: &str,
        agent: Option<&str>,
    ) -> Result<TaskCancelled, EngineError> {
        let inner = &self.inner;
        let id = task_id.to_owned();
        let owners: Vec<String> = match agent {
            Some(agent) => {
                let agent = agent.to_owned();
                inner
                    .blocking(move |s| s.task(&agent, &id))
                    .await?
                    .into_iter()
                    .map(|t| t.agent)
                    .collect()
            }
            None => inner
                .blocking(move |s| s.tasks_of_every_agent(&id))
                .await?
                .into_iter()
                .map(|t| t.agent)
                .collect(),
        };
        if owners.is_empty() {
            return Err(EngineError::UnknownTask(task_id.to_owned()));
        }
        let mut total = TaskCancelled {
            task_id: task_id.to_owned(),
            actions_cancelled: 0,
            retries_dropped: 0,
            waiting_dropped: 0,
            reconciling: Vec::new(),
        };
        for owner in owners {
            let waiting_dropped = inner.scheduler.cancel_task(&owner, task_id).await;
            let (agent, id) = (owner.clone(), task_id.to_owned());
            let now = inner.clock.now();
            let report = inner
                .blocking(move |s| s.cancel_task(&agent, &id, now))
                .await?;
            // The task takes no new actions: its breaker has nothing left to refuse.
            {
                let mut breakers = inner
                    .breakers
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
                if breakers.forget_task(&owner, task_id) {
                    inner.breakers_gauge.set(gauge_value(breakers.len()));
                }
            }
            tracing::info!(
                task = %task_id,
                agent = %owner,
                actions = report.actions_cancelled,
                retries = report.retries_dropped,
                waiting = waiting_dropped,
                reconciling = report.unsettled.len(),
                "task cancelled"
            );
            total.actions_cancelled += report.actions_cancelled;
            total.retries_dropped += report.retries_dropped;
            total.waiting_dropped += waiting_dropped;
            for unsettled in report.unsettled {
                tracing::info!(
                    task = %task_id,
                    agent = %owner,
                    action = unsettled.action.0,
                    uncertain_attempt = unsettled.attempt,
                    "task cancelled: the write's attempt may have been acted on, so it is reconciled with its original key, not cancelled"
                );
                total.reconciling.push(Reconciling {
                    action_id: unsettled.action.0,
                    uncertain_attempt: unsettled.attempt,
                });
                let closer = inner.clone();
                tokio::spawn(async move { closer.close_cancelled_write(unsettled.action).await });
            }
        }
        Ok(total)
    }

    /// Carries out one action to its end (see the module docs). Dropping the future before an
    /// attempt was sent cancels the action (audited `cancelled`, slot and delayed count freed).
    ///
    /// Coalescing: on a `coalesce: true` route, identical safe reads of one agent in flight
    /// (same agent, method, URL, end-to-end headers and body digest; see
    /// `coalesce::read_key`) share one upstream call; the shared 2xx body is buffered
    /// (up to [`SHARED_BODY_LIMIT`]) and every caller gets a copy, joined to the leader's action
    /// (its receipt). Reads of different agents are never shared.
    pub async fn execute(&self, spec: ActionSpec) -> Execution {
        self.execute_notifying(&spec, None).await
    }

    /// [`Engine::execute`], telling `notify` as soon as this request runs an action — recorded
    /// new, or recorded before under the agent's key and taken over — or joined the one running
    /// under its key; a request answered otherwise (a replay, a refusal) leaves it untold.
    ///
    /// The action's spec is borrowed all the way down: each async fn that took it by value
    /// would keep a copy of its own (672 bytes) in the future every action holds while it waits.
    pub(crate) async fn execute_notifying(
        &self,
        spec: &ActionSpec,
        notify: Option<&Notify>,
    ) -> Execution {
        if self.inner.shutting_down.load(Ordering::SeqCst) {
            // Nothing is recorded: the answer names the task and, for a write, the key in
            // effect (the agent's, or one minted for it to send again with), as the other
            // `503 shutting_down` and `store_unavailable` answers do.
            let receipt = ActionReceipt {
                action_id: 0,
                attempts: 0,
                idempotency_key: self.unrecorded_key(spec),
                provider_operation_id: None,
                task: None,
            };
            let problem = with_ids(
                Problem::shutting_down_during(
                    false,
                    "backstop is shutting down and takes no new work; nothing was sent for this \
                     request, so sending it again is safe",
                ),
                spec,
                &receipt,
            );
            return problem_answer(receipt, problem);
        }
        if !*self.inner.recovery_listed.borrow() {
            // Only right after start: wait until restart recovery has listed what it owns.
            let mut listed = self.inner.recovery_listed.subscribe();
            let _ = listed.wait_for(|listed| *listed).await;
        }
        let mut read_guard = None;
        if spec.route.coalesce && is_safe_method(&spec.request.method) {
            let key = FlightKey::Read(coalesce_key(spec));
            loop {
                match self.inner.flights.join_or_lead(key.clone()) {
                    Role::Follower(mut rx) => match rx.recv().await {
                        Ok(shared) => {
                            tracing::debug!(route = %spec.route.template, "coalesced read answered by the shared call");
                            return from_shared(shared);
                        }
                        // The leader went away without a result: start over.
                        Err(_) => continue,
                    },
                    Role::Leader(guard) => {
                        read_guard = Some(guard);
                        break;
                    }
                }
            }
        }
        if read_guard.is_none() && notify.is_none() {
            if spec.is_side_effect_free_call() {
                return Box::pin(self.execute_detached(spec)).await;
            }
            if spec.has_side_effect() {
                return Box::pin(self.execute_write_detached(spec)).await;
            }
        }
        // One call site: each `.await` of the same future holds storage of its own in this
        // future, which every call boxes (about 12 KB more per action with two, in the release
        // build's layout).
        self.lead(spec, read_guard, notify).await
    }

    /// The idempotency key a write answered before anything is recorded carries: the agent's
    /// (when it is usable: a key the door would refuse is not echoed) or one minted for it,
    /// as [`Engine::run`] would have; `None` for a read.
    fn unrecorded_key(&self, spec: &ActionSpec) -> Option<String> {
        if !spec.has_side_effect() {
            return None;
        }
        match &spec.idempotency_key {
            Some(supplied) => validate_idempotency_key(supplied).ok().map(str::to_owned),
            None => Some(mint_idempotency_key(self.inner.random_16())),
        }
    }

    /// Runs the action and shares its result with whoever joined it.
    async fn lead(
        &self,
        spec: &ActionSpec,
        read_guard: Option<LeaderGuard>,
        notify: Option<&Notify>,
    ) -> Execution {
        let (execution, action_guard) = self.run(spec, notify).await;
        let senders: Vec<_> = [read_guard, action_guard]
            .into_iter()
            .flatten()
            .filter_map(LeaderGuard::finish)
            .collect();
        if senders.is_empty() {
            return execution;
        }
        let shared = into_shared(execution, &spec.route.template, SHARED_BODY_LIMIT).await;
        for sender in senders {
            let _ = sender.send(shared.clone());
        }
        from_shared(shared)
    }

    /// Records the action and runs its attempt loop.
    async fn run(
        &self,
        spec: &ActionSpec,
        notify: Option<&Notify>,
    ) -> (Execution, Option<LeaderGuard>) {
        let inner = &self.inner;
        let route = &spec.route;
        let Some(class) = inner.policy.request_classes.get(&route.class) else {
            return (
                unrecorded(
                    Outcome::Rejected,
                    format!("request class `{}` is not in the policy", route.class),
                ),
                None,
            );
        };
        let rules = match inner.rules(&route.provider, &route.class, class) {
            Ok(rules) => rules,
            Err(e) => return (unrecorded(Outcome::Rejected, e.to_string()), None),
        };
        let template = match RouteTemplate::try_new(&route.template) {
            Ok(t) => t,
            Err(e) => return (unrecorded(Outcome::Rejected, e.to_string()), None),
        };
        let digest = match PayloadDigest::try_new(&spec.payload_digest) {
            Ok(d) => d,
            Err(e) => return (unrecorded(Outcome::Rejected, e.to_string()), None),
        };
        let target_digest = match spec.target_digest.as_deref().map(PayloadDigest::try_new) {
            None => None,
            Some(Ok(d)) => Some(d),
            Some(Err(e)) => {
                return (
                    unrecorded(Outcome::Rejected, format!("target digest: {e}")),
                    None,
                )
            }
        };
        let fingerprint = inner.fingerprint(route, &spec.request.body);

        // One idempotency key per logical write: the agent's (validated) or minted once. A read
        // carries none: nothing is minted, stored or audited for it.
        // A read sends the agent's request as prepared by the door: borrowed, not copied.
        let mut request = std::borrow::Cow::Borrowed(&spec.request);
        let provider = inner.policy.providers.get(&route.provider);
        let is_write = spec.has_side_effect();
        let key = match &spec.idempotency_key {
            Some(supplied) => match validate_idempotency_key(supplied) {
                Ok(key) => key.to_owned(),
                Err(e) => return (unrecorded(Outcome::Rejected, e.to_string()), None),
            },
            None if is_write => mint_idempotency_key(inner.random_16()),
            None => String::new(),
        };
        // Keys are per agent inside backstop, one namespace at the provider: send a derived one.
        let upstream_key = if is_write {
            upstream_idempotency_key(&spec.agent, &key)
        } else {
            String::new()
        };
        let mut reference = None;
        if let (true, Some(rc)) = (is_write, route.reconcile.as_ref()) {
            if let (ReconcileBy::ExternalReference, Some(pointer)) =
                (rc.by, rc.external_reference_pointer.as_deref())
            {
                match ensure_external_reference(&request.body, pointer, &upstream_key) {
                    Ok((body, found)) => {
                        request.to_mut().body = Bytes::from(body);
                        reference = Some(found);
                    }
                    Err(e) => return (unrecorded(Outcome::Rejected, e.to_string()), None),
                }
            }
        }
        if let (true, Some(name)) = (
            is_write,
            provider.and_then(|p| p.idempotency_header.as_deref()),
        ) {
            match (
                http::HeaderName::from_bytes(name.as_bytes()),
                http::HeaderValue::from_str(&upstream_key),
            ) {
                (Ok(name), Ok(value)) => {
                    request.to_mut().headers.insert(name, value);
                }
                _ => {
                    return (
                        unrecorded(
                            Outcome::Rejected,
                            format!("the idempotency key cannot be sent under `{name}`"),
                        ),
                        None,
                    )
                }
            }
        }
        // Remember how to reach the provider for lookups made later without this request.
        {
            let mut known = inner
                .credentials
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if !known.contains_key(&route.provider) {
                if let Some(cred) = provider
                    .and_then(|p| p.credential.as_ref())
                    .and_then(|c| http::HeaderName::from_bytes(c.header.as_bytes()).ok())
                {
                    if let Some(value) = request.headers.get(&cred) {
                        let value = value.clone();
                        known.insert(route.provider.clone(), (cred, value));
                    }
                }
            }
        }

        // Record task and action before anything is sent.
        let now = inner.clock.now();
        let task = NewTask {
            id: spec.task_id.clone(),
            agent: spec.agent.clone(),
            priority: store_priority(spec.priority),
            deadline: spec.deadline,
        };
        let new_action = NewAction {
            task_id: spec.task_id.clone(),
            agent: spec.agent.clone(),
            provider: route.provider.clone(),
            method: route.method.clone(),
            route: template,
            request_class: route.class.clone(),
            payload_digest: digest,
            target_digest,
            idempotency_key: if is_write { key.clone() } else { String::new() },
            external_reference: reference.clone(),
            // Kept for case files built from the store later (beside an outcome, after a
            // restart): the agent's words without credentials, and the configured fingerprint.
            desired_outcome: spec
                .desired_outcome
                .as_deref()
                .map(|text| sanitize_text(text).text),
            fingerprint: Some(fingerprint.as_str().to_owned()),
            // A write's request is kept until it ends, so that restart recovery finishes it
            // (SPEC §6); a body too large to resend is sent once and never kept.
            request: (is_write && !spec.single_attempt && !spec.holds_secret)
                .then(|| {
                    resume::kept_request_of(&spec.request, inner.credential_header(&route.provider))
                })
                .flatten(),
        };
        let mut kept = new_action.request.is_some();
        // Task and action in one store operation. A write waits until both are durable; a
        // read gets its id at once and is recorded with the next group commit (SPEC §12).
        let read_records = (!is_write).then(|| ReadRecords::new(spec));
        let admission = match &read_records {
            None => {
                // The caller may go away while the write's record commits (its fsync). The
                // record is durable all the same, and nothing would close it: the new action
                // would stay `requested`, its key answering `409 in flight` to every resend.
                // So an admission nobody awaits any more cancels the action it created, as a
                // caller gone before the first send does.
                let orphaned = {
                    let (inner, runtime) = (inner.clone(), tokio::runtime::Handle::current());
                    let (provider, class) = (route.provider.clone(), route.class.clone());
                    move |admission: Result<StoreAdmission, StoreError>| {
                        if let Ok(StoreAdmission::New(id)) = admission {
                            tracing::info!(
                                action = id.0,
                                "client disconnected while the write was being recorded: the action is cancelled and never sends"
                            );
                            runtime.spawn(async move {
                                inner
                                    .cancel_for_gone_client(id, SoFar::default(), &provider, &class)
                                    .await
                            });
                        }
                    }
                };
                inner
                    .queued_or_else(
                        move |s, done| s.begin_action(task, new_action, now, done),
                        orphaned,
                    )
                    .await
            }
            Some(records) => {
                let read_id =
                    inner
                        .store
                        .record_read(task, new_action, now, records.completion("request"));
                if let Ok(id) = &read_id {
                    let _ = records.action.set(id.0);
                }
                read_id.map(StoreAdmission::New).map_err(EngineError::Store)
            }
        };
        // The task of an action recorded before, which this request may name differently, with
        // the priority and the deadline recorded for it.
        let mut own_task = None;
        let (mut own_priority, mut own_deadline) = (None, None);
        // What the action had done before this run: nothing, except for a write taken over by a
        // same-key resend (see below).
        let (id, action_guard, earlier) = match admission {
            Ok(StoreAdmission::New(id)) => {
                // A layered retry finds a write again under its key and joins it; a read has no
                // key, so nothing can follow it and it is not registered.
                let guard = if is_write {
                    match inner.flights.join_or_lead(FlightKey::Action(id.0)) {
                        Role::Leader(guard) => Some(guard),
                        Role::Follower(_) => None,
                    }
                } else {
                    None
                };
                (id, guard, SoFar::default())
            }
            Ok(StoreAdmission::Existing(record)) => {
                if record.agent != spec.agent {
                    return (
                        unrecorded(
                            Outcome::Rejected,
                            "the idempotency key belongs to another agent's action".to_owned(),
                        ),
                        None,
                    );
                }
                // An operator reopened this escalated write for a same-key retry: this request
                // (held by the gateway, or resubmitted by the agent under the same key) sends it
                // again as the SAME logical action, unless another one already does.
                // A write recorded and never sent (the previous run stopped while it waited for
                // its first send, or the store could not record that send): nothing left, so
                // this resend sends it, once.
                let never_sent = record.state == ActionState::Requested
                    && inner
                        .unsent
                        .lock()
                        .unwrap_or_else(|poisoned| poisoned.into_inner())
                        .remove(&record.id.0);
                let taken = if record.state == ActionState::Reopened || never_sent {
                    match inner.flights.join_or_lead(FlightKey::Action(record.id.0)) {
                        Role::Leader(guard) => Some(guard),
                        Role::Follower(_) => None,
                    }
                } else {
                    None
                };
                // A finished write whose answer said to send it again under this key, once that
                // is due (see `resend`): reopened and taken over here, or answered.
                let taken = match taken {
                    None if is_write && record.state == ActionState::Finished => {
                        match Box::pin(self.take_finished(spec, &request, &key, &record, notify))
                            .await
                        {
                            resend::Taken::Send(guard) => Some(guard),
                            // Nothing runs for this request (unless it joined the resend that
                            // reopened the action, which told `notify` so).
                            resend::Taken::Answer(execution, guard) => return (execution, guard),
                            resend::Taken::Replay => None,
                        }
                    }
                    taken => taken,
                };
                match taken {
                    Some(guard) => {
                        // Its earlier attempts count: receipts and the outcome's context number
                        // attempts like the store does, from the first one ever sent. And they
                        // decide how it is closed if its caller goes away before this run
                        // sends: a reopened write whose last attempt was `uncertain` may have
                        // been acted on, so it is reconciled, never `cancelled`.
                        let id = record.id;
                        // The caller may go away while they are read. Nothing would close the
                        // write then: a never sent one would stay `requested`, out of the
                        // resumable set, its key answering `409 in flight` to every resend.
                        // So a read nobody awaits any more closes the write as its caller
                        // going away does (never sent → `cancelled`; reopened after an
                        // `uncertain` attempt → reconciled); one that failed puts a never sent
                        // write back for the next resend, and leaves a reopened one reopened.
                        let orphaned = {
                            let (inner, runtime) =
                                (inner.clone(), tokio::runtime::Handle::current());
                            let (provider, class) = (route.provider.clone(), route.class.clone());
                            move |read: Result<(Vec<AttemptRecord>, _), StoreError>| match read {
                                Ok((attempts, _)) => {
                                    tracing::info!(
                                        action = id.0,
                                        "client disconnected while its same-key resend took the write over, before the resend sent anything"
                                    );
                                    inner.close_for_gone_client(
                                        &runtime,
                                        id,
                                        false,
                                        SoFar::of_stored(&attempts),
                                        (&provider, &class),
                                    );
                                }
                                Err(_) if never_sent => {
                                    inner
                                        .unsent
                                        .lock()
                                        .unwrap_or_else(|poisoned| poisoned.into_inner())
                                        .insert(id.0);
                                }
                                Err(_) => {}
                            }
                        };
                        // With the action's own task: its attempts are scheduled under it, not
                        // under the task this request names.
                        let (agent, task) = (record.agent.clone(), record.task_id.clone());
                        let (stored, task) = match inner
                            .blocking_or_else(
                                move |s| Ok((s.attempts(id)?, s.task(&agent, &task)?)),
                                orphaned,
                            )
                            .await
                        {
                            Ok(read) => read,
                            Err(e) => {
                                if never_sent {
                                    // Not taken over after all: the next resend may take it.
                                    inner
                                        .unsent
                                        .lock()
                                        .unwrap_or_else(|poisoned| poisoned.into_inner())
                                        .insert(id.0);
                                }
                                let refused = self.refused_by_store(e, spec, Some(&key), Some(id));
                                return (refused, None);
                            }
                        };
                        let earlier = SoFar::of_stored(&stored);
                        kept = Box::pin(inner.keep_for_takeover(spec, id)).await;
                        own_task = Some(record.task_id.clone());
                        if let Some(task) = task {
                            own_priority = Some(core_priority(task.priority));
                            own_deadline = task.deadline;
                        }
                        // SPEC §6: an attempt that may have been acted on and that no later
                        // answer settled is sent again under its key only where the provider
                        // honours the key — now, under the policy in force: it may have lost
                        // its `idempotency_header` since the write was reopened (a restart).
                        // Otherwise the rule for an uncertain write runs instead of the send.
                        if earlier.unsettled && !inner.honours_key(&record.provider) {
                            if let Some(answer) = Box::pin(
                                self.settle_before_takeover(spec, &request, &key, &record, &stored),
                            )
                            .await
                            {
                                return (answer, Some(guard));
                            }
                        }
                        if never_sent {
                            tracing::info!(
                                action = record.id.0,
                                "a write recorded but never sent (before a restart, or because the store could not record its first send) is sent now with its original idempotency key"
                            );
                        } else {
                            tracing::info!(
                                action = record.id.0,
                                prior_attempts = earlier.sent,
                                "reopened write sent again with its original idempotency key"
                            );
                        }
                        (record.id, Some(guard), earlier)
                    }
                    None => {
                        return (Box::pin(self.existing(*record, notify)).await, None);
                    }
                }
            }
            Err(e) if is_write && is_store_failure(&e) => {
                return (Box::pin(self.write_not_admitted(e, spec, &key)).await, None);
            }
            Err(e) => {
                let key = is_write.then_some(key.as_str());
                return (self.refused_by_store(e, spec, key, None), None);
            }
        };
        if let Some(notify) = notify {
            let receipt = ActionReceipt {
                action_id: id.0,
                attempts: earlier.sent,
                idempotency_key: is_write.then(|| key.clone()),
                provider_operation_id: None,
                task: own_task.clone(),
            };
            notify.runs(receipt, false);
        }
        let mut guard = ActionGuard {
            inner: inner.clone(),
            id,
            provider: &route.provider,
            class: &route.class,
            read: !is_write,
            so_far: earlier,
            armed: true,
        };
        let run = Run {
            spec,
            id,
            fingerprint,
            rules,
            request,
            key,
            upstream_key,
            reference,
            operation_id: Mutex::new(None),
            prior: earlier,
            read_records,
            own_task,
            priority: own_priority.unwrap_or(spec.priority),
            kept,
        };

        // The per-task circuit breaker (SPEC §7), as of `now`, read when the action was recorded.
        let open = inner
            .breakers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .check(&spec.agent, run.task(), &run.fingerprint, now)
            .err();
        if let Some(open) = open {
            guard.armed = false;
            let context = OutcomeContext {
                last_status: open.last_status,
                last_signal: Some(format!("rejected ({})", open.error_code)),
                next_safe: vec![NextSafe::ChangeRequest, NextSafe::Abort],
                ..OutcomeContext::default()
            };
            tracing::info!(
                task = %run.task(),
                route = %route.template,
                error_code = %open.error_code,
                failures = open.failures,
                "refused: the circuit is open for this request in this task"
            );
            let detail = format!(
                "this request failed {} times in this task with `{}`; the circuit is open",
                open.failures, open.error_code
            );
            let execution = Box::pin(self.finish(
                &run,
                &ActionBudget::new(class.budget(), None),
                Outcome::CircuitOpen,
                context,
                detail,
                0,
            ))
            .await;
            return (execution, action_guard);
        }

        let max_wait = match spec.max_wait {
            Some(prefer) => class.max_wait.min(prefer),
            None => class.max_wait,
        };
        let max_attempts = if spec.single_attempt {
            1
        } else if spec.resumed {
            // Resumed after a restart: the attempts made before it count (one is always left
            // for the resend its lookup judged safe).
            class.max_attempts.saturating_sub(run.prior.sent).max(1)
        } else {
            class.max_attempts
        };
        // The request's deadline, and for a write taken over its own task's too: nothing starts
        // after either.
        let deadline = match (spec.deadline, own_deadline) {
            (Some(asked), Some(own)) => Some(asked.min(own)),
            (asked, own) => asked.or(own),
        };
        let budget = ActionBudget::new(
            ClassBudget {
                max_attempts,
                max_wait,
            },
            deadline,
        );
        let execution = self.attempts(&run, budget, &mut guard).await;
        (execution, action_guard)
    }

    /// The attempt loop of one recorded action.
    async fn attempts(
        &self,
        run: &Run<'_>,
        mut budget: ActionBudget,
        guard: &mut ActionGuard<'_>,
    ) -> Execution {
        let inner = &self.inner;
        let spec = run.spec;
        let route = &spec.route;
        let provider = inner.policy.providers.get(&route.provider);
        let mut seen = Seen {
            sent: run.prior.sent,
            left: run.prior.sent,
            unsettled: run.prior.unsettled,
            response_received: run.prior.last_status.is_some(),
            last_status: run.prior.last_status,
            last_signal: run.prior.last_signal,
            ..Seen::default()
        };
        let mut not_before: Option<Timestamp> = None;
        // Tokens of retries that were sent (refunded if the action succeeds) and of the planned
        // retry not sent yet (refunded if it never leaves).
        let mut spent: Option<RetryTokens> = None;
        let mut pending: Option<RetryTokens> = None;
        // Whether this loop scheduled a retry job (then the only way round the loop again): the
        // next attempt's `action_sent` claims it (see `Store::mark_attempt_sent`).
        let mut retry_job = false;
        loop {
            let acquired = inner
                .scheduler
                .acquire(AcquireRequest {
                    task_id: run.task().to_owned(),
                    agent: spec.agent.clone(),
                    priority: run.priority,
                    scopes: route.scopes.clone(),
                    budget,
                    not_before,
                    route: route.template.clone(),
                    reconciliation: false,
                })
                .await;
            let permit = match acquired {
                Acquired::Go {
                    permit,
                    budget: charged,
                } => {
                    budget = charged;
                    if let Some(RetryTokens(tokens)) = pending.take() {
                        spent
                            .get_or_insert_with(RetryTokens::default)
                            .0
                            .extend(tokens);
                    }
                    permit
                }
                Acquired::Refused {
                    outcome,
                    detail,
                    budget: charged,
                    boundary,
                    not_before,
                } => {
                    budget = charged;
                    guard.armed = false;
                    if let Some(tokens) = pending.take() {
                        inner.scheduler.deposit(&route.scopes, Some(tokens));
                    }
                    let boundary = boundary.or(seen.boundary.filter(|b| *b > inner.clock.now()));
                    // Safe to send again from the later of the provider's boundary and the
                    // instant the dispatch check would have waited for (local pacing too).
                    let next_safe = match outcome {
                        Outcome::Cancelled => vec![NextSafe::Abort],
                        _ => wait_then_abort(boundary.max(not_before)),
                    };
                    if outcome == Outcome::Cancelled && seen.unsettled && run.spec.has_side_effect()
                    {
                        // The cancellation reconciles it: the store lists it, as it does every
                        // write with an unsettled attempt not in flight.
                        return Box::pin(
                            self.cancelled_while_unsettled(run, &budget, &seen, false),
                        )
                        .await;
                    }
                    let context = self.context(&budget, &seen, boundary, next_safe);
                    if outcome == Outcome::Cancelled {
                        // The scheduler refuses only for a cancelled task, and the task's
                        // cancellation ends this action in the store (with its retry job) in
                        // the same operation that reports what it dropped: ending it here too
                        // would race that report and leave it uncounted.
                        return self.ended(run, outcome, context, detail, seen.sent);
                    }
                    return Box::pin(
                        self.finish(run, &budget, outcome, context, detail, seen.sent),
                    )
                    .await;
                }
                Acquired::Stopped { .. } => {
                    guard.armed = false;
                    tracing::info!(
                        action = run.id.0,
                        attempts = seen.sent,
                        "shutting down: the waiting caller is answered 503"
                    );
                    if seen.sent > 0 {
                        return self.stopped_after_sending(run, &seen, Stopped::Waiting);
                    }
                    let detail = "backstop is shutting down; nothing was sent for this request, so sending it again is safe";
                    let receipt = run.receipt(seen.sent);
                    let problem =
                        with_ids(Problem::shutting_down_during(false, detail), spec, &receipt);
                    return problem_answer(receipt, problem);
                }
            };

            // A write's attempt is durable before the bytes leave. A read's is queued behind its
            // action's earlier records and goes without waiting (SPEC §12); its attempts are
            // numbered by this loop, the only one that sends a read's action.
            let (id, sent_at) = (run.id, inner.clock.now());
            let marked = if !run.spec.has_side_effect() {
                inner
                    .store
                    .submit_attempt_sent(id, sent_at, run.read_completion("attempt"));
                Ok(seen.sent + 1)
            } else {
                inner
                    .queued(move |s, done| s.submit_attempt_sent(id, sent_at, done))
                    .await
            };
            let attempt = match marked {
                Ok(n) => n,
                Err(e) => {
                    drop(permit);
                    guard.armed = false;
                    if is_store_failure(&e) {
                        // Nothing of this attempt left. A waiting retry keeps its job, unclaimed:
                        // the action is closed once the store commits again, never left waiting
                        // for a wake that nothing arms (at shutdown the next start re-arms it).
                        // A write's first send frees its key for the agent's resend under it,
                        // which sends it as this action.
                        let stopping = inner.shutting_down.load(Ordering::SeqCst);
                        if retry_job && !stopping {
                            self.close_unrecorded_retry(
                                run,
                                &budget,
                                &seen,
                                UnrecordedRetry::Start,
                            );
                        } else if seen.sent == 0 && run.spec.has_side_effect() {
                            inner
                                .unsent
                                .lock()
                                .unwrap_or_else(|poisoned| poisoned.into_inner())
                                .insert(run.id.0);
                        }
                        if stopping && seen.sent > 0 {
                            return self.stopped_by_store_after_sending(
                                run,
                                &seen,
                                &e,
                                Interrupted::Send,
                                may_have_committed(&e),
                            );
                        }
                        let receipt = run.receipt(seen.sent);
                        return self.store_unavailable(spec, receipt, seen.sent > 0, &e);
                    }
                    if seen.unsettled && run.spec.has_side_effect() {
                        // Its task was cancelled while it waited (the store refuses a send for
                        // nothing else of an open action), and the cancellation, which the store
                        // listed it to, reconciles it: never `cancelled`.
                        return Box::pin(
                            self.cancelled_while_unsettled(run, &budget, &seen, false),
                        )
                        .await;
                    }
                    let detail = match &e {
                        EngineError::Store(StoreError::InvalidTransition { reason, .. }) => {
                            format!("the action may not send again: {reason}")
                        }
                        _ => "the action may not send again".to_owned(),
                    };
                    let context = self.context(&budget, &seen, None, vec![NextSafe::Abort]);
                    return Box::pin(self.finish(
                        run,
                        &budget,
                        Outcome::Cancelled,
                        context,
                        detail,
                        seen.sent,
                    ))
                    .await;
                }
            };
            seen.sent += 1;
            guard.so_far.sent = seen.sent;
            guard.so_far.in_flight = Some(attempt);
            caller_gone::attempt_out(true);
            tracing::debug!(
                task = %run.task(),
                route = %route.template,
                attempt,
                "attempt sent"
            );
            let handed_at = inner.clock.now();
            let Some(reply) = inner
                .unless_given_up(inner.transport.send(run.request.as_ref().clone()))
                .await
            else {
                // The stop's grace is running out and the provider has not answered: the
                // caller is told what the next start does rather than have its connection cut.
                // The attempt stays sent without a result (SPEC §12).
                drop(permit);
                guard.armed = false;
                if let Some(tokens) = pending.take() {
                    inner.scheduler.deposit(&route.scopes, Some(tokens));
                }
                seen.left += 1;
                seen.last_signal = Some(Disposition::Uncertain.as_str());
                seen.unsettled = writes::still_unsettled(seen.unsettled, "uncertain");
                tracing::info!(
                    action = run.id.0,
                    attempt,
                    "shutting down: the grace ran out before the provider answered; the attempt stays sent without a result, and the caller is answered 503"
                );
                return self.stopped_after_sending(run, &seen, Stopped::GaveUp);
            };
            let reply = without_provider_replay_mark(reply);
            drop(permit);
            let received_at = inner.clock.now();
            inner.metrics.observe_upstream_attempt(
                &route.provider,
                received_at.duration_since(handed_at).as_secs_f64(),
            );

            // Classify (never read a 2xx body). The response's signal headers are kept as
            // evidence unless it is a plain success (a 2xx without a Retry-After).
            let (signal, response, signal_headers) = match reply {
                AttemptReply::Response(response) if response.status().is_success() => {
                    let signal = classify(
                        &Observed::Response(ResponseView {
                            status: response.status().as_u16(),
                            headers: response.headers(),
                            body: None,
                        }),
                        &run.rules,
                        received_at,
                    );
                    let kept = if carries_retry_after(response.headers()) {
                        select_signal_headers(response.headers())
                    } else {
                        Vec::new()
                    };
                    (signal, Some(response), kept)
                }
                AttemptReply::Response(response) => {
                    let (parts, body) = response.into_parts();
                    let kept = select_signal_headers(&parts.headers);
                    match read_bounded(body, ERROR_BODY_LIMIT).await {
                        Ok((bytes, body)) => {
                            let signal = classify(
                                &Observed::Response(ResponseView {
                                    status: parts.status.as_u16(),
                                    headers: &parts.headers,
                                    body: Some(&bytes),
                                }),
                                &run.rules,
                                received_at,
                            );
                            (signal, Some(http::Response::from_parts(parts, body)), kept)
                        }
                        Err(_) => {
                            seen.last_failure = Some(TransportError::ResponseCut);
                            (
                                classify(
                                    &Observed::Transport(TransportError::ResponseCut),
                                    &run.rules,
                                    received_at,
                                ),
                                None,
                                kept,
                            )
                        }
                    }
                }
                AttemptReply::Failed(e) => {
                    seen.last_failure = Some(e);
                    (
                        classify(&Observed::Transport(e), &run.rules, received_at),
                        None,
                        Vec::new(),
                    )
                }
            };
            let status = response.as_ref().map(|r| r.status().as_u16());
            if status.is_some() {
                seen.last_failure = None;
                seen.response_received = true;
                seen.last_status = status;
            }
            if signal.disposition != Disposition::NotSent {
                seen.left += 1;
            }
            seen.last_signal = Some(signal.disposition.as_str());
            seen.unsettled = writes::still_unsettled(seen.unsettled, signal.disposition.as_str());
            guard.so_far.last_signal = seen.last_signal;
            guard.so_far.unsettled = seen.unsettled;
            guard.so_far.last_status = seen.last_status;
            seen.boundary = signal.boundary.retry_not_before();
            // One count per scope of the route, or one under `-` for a route without scopes.
            let scope_labels = std::iter::once("-")
                .filter(|_| route.scopes.is_empty())
                .chain(route.scopes.iter().map(String::as_str));
            for scope in scope_labels {
                inner
                    .metrics
                    .attempt(&route.provider, scope, &route.class, signal.disposition);
            }
            {
                let mut streaks = inner
                    .limit_streaks
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
                if streaks.would_change(signal.disposition) {
                    streaks.note(
                        &quota_escalations::streak_keys(&route.provider, &route.scopes),
                        signal.disposition,
                    );
                }
            }

            // Scope records first: quota headers, then a rate limit's boundary.
            self.update_scopes(run, &signal, status, received_at).await;

            let store_boundary = Some(match seen.boundary {
                Some(at) => StoreBoundary::At(at),
                None => StoreBoundary::Unknown,
            });
            let source = match &signal.boundary {
                backstop_core::retry_after::Boundary::Known { source, .. } => Some(source.clone()),
                backstop_core::retry_after::Boundary::Unknown { source, .. } => source.clone(),
            };
            let mut result = AttemptResult {
                action: run.id,
                attempt,
                status,
                disposition: store_disposition(signal.disposition),
                boundary: store_boundary,
                source,
                provider_operation_id: None,
                signal_headers,
                finish: None,
            };

            // An uncertain write is reconciled before anything else happens (SPEC §6).
            let mut resend_same_key = false;
            if signal.disposition == Disposition::Uncertain && run.spec.has_side_effect() {
                let facts = self.write_facts(run, &budget);
                let Ok(end) =
                    Box::pin(inner.reconcile_uncertain(&facts, Some(&run.request.headers))).await
                else {
                    // The gateway is stopping: no lookup left, so nothing is known of the write
                    // and nothing is recorded for it. Its attempt stays `sent` without a result,
                    // which the next start reconciles with its original key (SPEC §12); our own
                    // stop is no reason to escalate it.
                    guard.armed = false;
                    if let Some(tokens) = pending.take() {
                        inner.scheduler.deposit(&route.scopes, Some(tokens));
                    }
                    tracing::info!(
                        action = run.id.0,
                        attempt,
                        "shutting down: the write's attempt was sent and its answer never came; it stays sent without a result, and the next start reconciles it with its original key"
                    );
                    return self.stopped_after_sending(run, &seen, Stopped::NotReconciled);
                };
                match end {
                    writes::UncertainEnd::Found { operation_id } => {
                        guard.armed = false;
                        self.breaker_success(run);
                        inner.scheduler.deposit(&route.scopes, spent.take());
                        if let Some(tokens) = pending.take() {
                            inner.scheduler.deposit(&route.scopes, Some(tokens));
                        }
                        let kept = result.clone();
                        let unrecorded = match inner
                            .blocking(move |s| s.record_result(result, received_at))
                            .await
                        {
                            Ok(()) => None,
                            Err(e) => {
                                tracing::warn!(action = run.id.0, task = %run.task(), agent = %run.spec.agent, route = %run.spec.route.template, error = %e, "could not record the result");
                                is_store_failure(&e).then_some(kept)
                            }
                        };
                        // The context the caller is answered with is the one stored, so that
                        // the action's view and a same-key replay say the same (its
                        // `total_wait_ms` is the budget's count, which the attempts alone
                        // cannot rebuild: the waits before the first send are not in them).
                        let context = self.context(&budget, &seen, None, Vec::new());
                        let stored = serde_json::to_value(&context)
                            .unwrap_or_else(|_| serde_json::json!({}));
                        let (id, op, at) = (run.id, operation_id.clone(), inner.clock.now());
                        let kept_context = stored.clone();
                        if let Err(e) = inner
                            .blocking(move |s| {
                                s.record_reconciled_with_context(id, op, kept_context, at)
                            })
                            .await
                        {
                            tracing::warn!(action = run.id.0, task = %run.task(), agent = %run.spec.agent, route = %run.spec.route.template, error = %e, "could not record the reconciliation");
                            if is_store_failure(&e) {
                                // The caller is told; the store is, once it commits again.
                                inner.record_when_store_commits(writes::Deferred {
                                    action: run.id,
                                    result: unrecorded,
                                    end: writes::DeferredEnd::Reconciled {
                                        operation_id: operation_id.clone(),
                                        context: stored,
                                    },
                                    count: None,
                                });
                            }
                        }
                        inner
                            .metrics
                            .outcome(&route.provider, &route.class, Outcome::Succeeded);
                        tracing::info!(
                            action = run.id.0,
                            task = %run.task(),
                            route = %route.template,
                            provider_operation_id = operation_id.as_deref().unwrap_or("-"),
                            "reconciled: the provider has the write; nothing is resent"
                        );
                        // The id is told with the answer, whether or not the store has it yet.
                        let receipt = ActionReceipt {
                            provider_operation_id: operation_id.clone(),
                            ..run.receipt(seen.sent)
                        };
                        return Execution::Outcome {
                            receipt,
                            outcome: Outcome::Succeeded,
                            context,
                            detail: match operation_id {
                                Some(op) => format!("reconciled: the provider has this write as `{op}`; it was not sent again"),
                                None => "reconciled: the provider has this write; it was not sent again".to_owned(),
                            },
                        };
                    }
                    // The lookup is a read of the provider's state, not a resend: it never
                    // spends the write's attempts. A resend does; when the class has none left
                    // (an `uncertain_write` allows one), a human decides instead.
                    writes::UncertainEnd::RetrySameKey if budget.attempts_remaining() > 0 => {
                        resend_same_key = true;
                    }
                    end => {
                        let reason = match end {
                            writes::UncertainEnd::Escalate { reason } => reason,
                            // `RetrySameKey` with no attempt left (`Found` returned above).
                            _ => format!(
                                "the provider honours the idempotency key, but the `{}` class allows no further attempt, so resending under the same key is an operator's decision",
                                route.class
                            ),
                        };
                        guard.armed = false;
                        if let Some(tokens) = pending.take() {
                            inner.scheduler.deposit(&route.scopes, Some(tokens));
                        }
                        guard.so_far.in_flight = None;
                        return Box::pin(self.record_then_escalate(
                            run,
                            (&budget, &seen),
                            (result, received_at),
                            &facts,
                            &reason,
                        ))
                        .await;
                    }
                }
            }

            if signal.disposition == Disposition::Success {
                guard.armed = false;
                let Some(mut response) = response else {
                    return unrecorded(
                        Outcome::Cancelled,
                        "internal: a success without a response".to_owned(),
                    );
                };
                // A write's final response is kept for idempotent replay (bounded, never
                // audited), and its operation id is read from the same bounded prefix. An
                // event stream is never buffered: only its status and headers are kept.
                let mut replay_record = None;
                if run.spec.has_side_effect() {
                    let rc = route.reconcile.as_ref();
                    let wants_id = rc.is_some_and(|rc| rc.operation_id_pointer.is_some());
                    let (passed_on, record, bytes) =
                        kept_for_replay(response, run.id, wants_id).await;
                    if let Some(rc) = rc {
                        result.provider_operation_id = operation_id_from_response(rc, &bytes);
                    }
                    replay_record = Some(record);
                    response = passed_on;
                }
                self.breaker_success(run);
                inner.scheduler.deposit(&route.scopes, spent.take());
                let context = self.context(&budget, &seen, None, Vec::new());
                result.finish = Some(Finish {
                    outcome: backstop_store::Outcome::Succeeded,
                    context: serde_json::to_value(&context).unwrap_or_default(),
                    response: replay_record,
                });
                if !run.spec.has_side_effect() {
                    // A read's result is recorded with the next group commit (SPEC §12).
                    inner
                        .store
                        .submit_result(result, received_at, run.read_completion("result"));
                } else {
                    let kept = result.clone();
                    if let Err(e) = inner
                        .queued(move |s, done| s.submit_result(result, received_at, done))
                        .await
                    {
                        self.final_result_not_recorded(run, kept, &e);
                    }
                }
                inner
                    .metrics
                    .outcome(&route.provider, &route.class, Outcome::Succeeded);
                return Execution::Response {
                    receipt: run.receipt(seen.sent),
                    response,
                };
            }

            // An uncertain READ changed nothing at the provider: it is retried within the read
            // class budget like any transient failure, never left `reconciliation_required`.
            let tried_again =
                backstop_core::classify::tried_again(&signal, run.spec.has_side_effect());
            if !tried_again && !resend_same_key {
                guard.armed = false;
                return Box::pin(
                    self.final_failure(
                        run,
                        &budget,
                        &seen,
                        signal,
                        response,
                        result,
                        provider
                            .and_then(|p| p.idempotency_header.as_ref())
                            .is_some(),
                    ),
                )
                .await;
            }

            // Retryable: attempts left, retry quota, then the core's plan.
            if budget.attempts_remaining() == 0
                && seen.unsettled
                && run.spec.has_side_effect()
                && route.reconcile.is_none()
            {
                // An earlier attempt may have been acted on, nothing settled it and no lookup can
                // tell (a route with one looked each uncertain attempt up when it came back and
                // found nothing): the write is not "not done", and no attempt is left to resend
                // it under its key — a human decides (the case file offers the same-key resend).
                guard.armed = false;
                if let Some(tokens) = pending.take() {
                    inner.scheduler.deposit(&route.scopes, Some(tokens));
                }
                guard.so_far.in_flight = None;
                let facts = self.write_facts(run, &budget);
                let reason = format!(
                    "all {} attempts of the `{}` budget are used, and an earlier attempt may have been acted on (it got no answer, and no later answer under the same key settled it)",
                    budget.attempts_used(),
                    route.class,
                );
                return Box::pin(self.record_then_escalate(
                    run,
                    (&budget, &seen),
                    (result, received_at),
                    &facts,
                    &reason,
                ))
                .await;
            }
            if budget.attempts_remaining() == 0 {
                guard.armed = false;
                let boundary = seen.boundary;
                let context = self.context(&budget, &seen, boundary, wait_then_abort(boundary));
                let last = match seen.last_failure {
                    Some(failure) => format!(
                        "{}: {} ({})",
                        signal.disposition,
                        failure.describe(),
                        upstream_authority(&run.request.url)
                    ),
                    None => signal.disposition.to_string(),
                };
                let detail = if spec.single_attempt {
                    format!(
                        "its body ({} bytes) is over --retry-body-bytes, so backstop sends it once and never retries it (last: {last}); raise --retry-body-bytes to have it retried",
                        spec.request.body.len(),
                    )
                } else {
                    format!(
                        "all {} attempts of the `{}` budget are used (last: {last})",
                        budget.attempts_used(),
                        route.class,
                    )
                };
                return Box::pin(self.finish_with_result(
                    run,
                    &budget,
                    result,
                    Outcome::BudgetExhausted,
                    context,
                    detail,
                    seen.sent,
                ))
                .await;
            }
            let cause = match signal.disposition {
                Disposition::NotSent | Disposition::Uncertain => RetryCause::Timeout,
                _ => RetryCause::ErrorResponse,
            };
            let withdrawn = match inner.scheduler.withdraw_retry(&route.scopes, cause).await {
                Ok(withdrawn) => withdrawn,
                Err(refused) => {
                    guard.armed = false;
                    let boundary = seen.boundary;
                    let context = self.context(&budget, &seen, boundary, wait_then_abort(boundary));
                    return Box::pin(self.finish_with_result(
                        run,
                        &budget,
                        result,
                        Outcome::QuotaExhausted,
                        context,
                        refused.to_string(),
                        seen.sent,
                    ))
                    .await;
                }
            };
            pending = Some(withdrawn);
            let plan_now = inner.clock.now();
            let decision = plan_retry(
                &RetryInput {
                    retry_number: budget.attempts_used(),
                    backoff: inner.policy.backoff.config(),
                    boundary: seen.boundary,
                    // A lower bound over the ceiling is never a retry instant: the real one is
                    // later, so it is beyond any wait and the action ends now.
                    wait_budget_remaining: if signal.boundary.is_lower_bound() {
                        std::time::Duration::ZERO
                    } else {
                        budget.wait_remaining()
                    },
                    deadline: budget.deadline(),
                },
                plan_now,
                inner.unit(),
            );
            match decision {
                RetryDecision::Stop {
                    outcome,
                    reason,
                    not_before: boundary,
                } => {
                    guard.armed = false;
                    if let Some(tokens) = pending.take() {
                        inner.scheduler.deposit(&route.scopes, Some(tokens));
                    }
                    // `boundary` is the provider's instant only: a stop by backstop's own backoff
                    // shows the provider's (if it gave one) there, and its own instant in
                    // `next_safe`'s `wait_until` and the detail.
                    let provider_boundary = if reason.is_provider_boundary() {
                        boundary
                    } else {
                        seen.boundary
                    };
                    let context =
                        self.context(&budget, &seen, provider_boundary, decision.next_safe());
                    let detail = match (boundary, reason.is_provider_boundary()) {
                        (Some(at), true) => format!("the provider allows a retry only at {at}: {}; not sleeping into failure", reason.describe()),
                        (Some(at), false) => {
                            let provider = match seen.boundary {
                                Some(b) => format!("the provider's boundary is {b}"),
                                None => "the provider gave no boundary".to_owned(),
                            };
                            format!("backstop's own backoff allows the next retry only at {at} ({provider}): {}; not retrying early", reason.describe())
                        }
                        (None, _) => format!("no retry: {}", reason.describe()),
                    };
                    tracing::info!(
                        task = %run.task(),
                        route = %route.template,
                        outcome = %outcome,
                        reason = reason.describe(),
                        "retry refused by the plan"
                    );
                    // One name per signal: a quota-exhausted answer ends `quota_exhausted`
                    // whatever its reset, beyond the budget or not, with the boundary and the
                    // scope's `shared_quota_exhausted` escalation (SPEC §8).
                    if signal.disposition == Disposition::QuotaExhausted {
                        return Box::pin(self.finish_quota_exhausted(
                            run,
                            &budget,
                            result,
                            context,
                            (boundary, signal.error_code.as_deref()),
                            seen.sent,
                        ))
                        .await;
                    }
                    let escalate = reason.is_provider_boundary() && route.class != "read";
                    let reason_detail = detail.clone();
                    let mut execution = Box::pin(self.finish_with_result(
                        run, &budget, result, outcome, context, detail, seen.sent,
                    ))
                    .await;
                    // SPEC §13 step 5 / §8: a write whose provider boundary lies beyond its
                    // remaining wait or deadline is also handed to a human; a read only ends.
                    if escalate {
                        Box::pin(self.escalate_stopped_write(
                            run.id,
                            &reason_detail,
                            boundary,
                            &mut execution,
                        ))
                        .await;
                    }
                    return execution;
                }
                RetryDecision::RetryAt { at, delay, cause } => {
                    // Kept while the store may fail: a result it could not record is recorded
                    // with the action's close (see `close_unrecorded_retry`).
                    let mut unrecorded = Some(result.clone());
                    // Whether the last failed record of the result may be kept all the same.
                    let mut result_maybe_kept = false;
                    match inner
                        .blocking(move |s| s.record_result(result, received_at))
                        .await
                    {
                        Ok(()) => unrecorded = None,
                        Err(e) => {
                            if !is_store_failure(&e) {
                                unrecorded = None;
                            }
                            result_maybe_kept = may_have_committed(&e);
                            tracing::warn!(action = run.id.0, task = %run.task(), agent = %run.spec.agent, route = %run.spec.route.template, error = %e, "could not record the result");
                        }
                    }
                    guard.so_far.in_flight = None;
                    caller_gone::attempt_out(false);
                    let id = run.id;
                    let scheduled = match inner
                        .blocking(move |s| s.schedule_retry(id, at, plan_now))
                        .await
                    {
                        // A read needs no durable wake (SPEC §12: reads may be recorded
                        // asynchronously, and nothing resumes a read after a restart): when its
                        // records could not be committed (a full disk), it waits in memory and
                        // is retried, as it is answered, rather than ended.
                        Err(e) if !run.spec.has_side_effect() => {
                            tracing::warn!(
                                action = run.id.0,
                                task = %run.task(),
                                route = %route.template,
                                error = %e,
                                "a read's retry could not be recorded; it is retried from memory"
                            );
                            Ok(())
                        }
                        other => other.map(drop),
                    };
                    // The store failed on the result and worked again for the schedule (a disk
                    // that hiccuped): the result is recorded now, before the retry may leave,
                    // so the attempt does not stay `sent` without a result (read as uncertain
                    // after a restart) and the log does not lack its `action_result`.
                    let scheduled = match (scheduled, &unrecorded) {
                        (Ok(()), Some(result)) => {
                            let result = result.clone();
                            match inner
                                .blocking(move |s| s.record_result(result, received_at))
                                .await
                            {
                                Ok(()) => {
                                    unrecorded = None;
                                    Ok(())
                                }
                                // A read is retried from memory all the same (as above).
                                Err(e) if !run.spec.has_side_effect() => {
                                    tracing::warn!(action = run.id.0, task = %run.task(), route = %route.template, error = %e, "a read's attempt result could not be recorded; it is retried from memory");
                                    Ok(())
                                }
                                Err(e) => {
                                    if !is_store_failure(&e) {
                                        unrecorded = None;
                                    }
                                    result_maybe_kept = may_have_committed(&e);
                                    Err(e)
                                }
                            }
                        }
                        (scheduled, _) => scheduled,
                    };
                    if let Err(e) = scheduled {
                        guard.armed = false;
                        if let Some(tokens) = pending.take() {
                            inner.scheduler.deposit(&route.scopes, Some(tokens));
                        }
                        if is_store_failure(&e) {
                            // Nothing of the retry left; the action is closed (an uncertain
                            // write reconciled) once the store commits again, never left open
                            // with no retry job (at shutdown the next start finds it).
                            if inner.shutting_down.load(Ordering::SeqCst) {
                                let interrupted = if unrecorded.is_some() {
                                    Interrupted::Result
                                } else {
                                    Interrupted::Schedule
                                };
                                return self.stopped_by_store_after_sending(
                                    run,
                                    &seen,
                                    &e,
                                    interrupted,
                                    result_maybe_kept,
                                );
                            }
                            let step = UnrecordedRetry::Schedule {
                                result: unrecorded.map(Box::new),
                            };
                            self.close_unrecorded_retry(run, &budget, &seen, step);
                            let receipt = run.receipt(seen.sent);
                            return self.store_unavailable(spec, receipt, seen.sent > 0, &e);
                        }
                        if seen.unsettled && run.spec.has_side_effect() {
                            // Its task was cancelled while this attempt was out (the store
                            // refuses a retry of an open action for nothing else): reconciled,
                            // never `cancelled`.
                            return Box::pin(
                                self.cancelled_while_unsettled(run, &budget, &seen, true),
                            )
                            .await;
                        }
                        tracing::warn!(action = run.id.0, error = %e, "the retry could not be scheduled");
                        let context =
                            self.context(&budget, &seen, seen.boundary, vec![NextSafe::Abort]);
                        // The store refuses a retry of an open action only for its task's
                        // cancellation: said in the agent's words, not the store's.
                        let detail = match &e {
                            EngineError::Store(StoreError::InvalidTransition { .. }) => format!(
                                "task `{}` was cancelled while this attempt was out, so no retry is sent; the provider's answer to it is in last_status",
                                run.task()
                            ),
                            _ => "the retry could not be scheduled, so no retry is sent".to_owned(),
                        };
                        return Box::pin(self.finish(
                            run,
                            &budget,
                            Outcome::Cancelled,
                            context,
                            detail,
                            seen.sent,
                        ))
                        .await;
                    }
                    tracing::info!(
                        action = run.id.0,
                        task = %run.task(),
                        route = %route.template,
                        disposition = %signal.disposition,
                        retry_at = %at,
                        delay_ms = delay.as_millis() as u64,
                        cause = ?cause,
                        attempts_left = budget.attempts_remaining(),
                        wait_left_ms = budget.wait_remaining().as_millis() as u64,
                        "retry scheduled"
                    );
                    retry_job = true;
                    not_before = Some(at);
                }
            }
        }
    }

    /// The `503 shutting_down` for the caller of an action of which an attempt was sent, when
    /// the gateway stops before the action ends — `stopped` says where it was (see
    /// [`Stopped`]). `sent` as the outcome context
    /// counts it, `x-should-retry: false` for a write (`true`, with `Retry-After: 1`, for a
    /// read, which is safe to send again), and what the next start does with the action — the `after_restart` member (see
    /// [`AfterRestart`]) and the `detail` — with the last attempt's `last_status` and
    /// `last_signal`.
    fn stopped_after_sending(&self, run: &Run<'_>, seen: &Seen, stopped: Stopped) -> Execution {
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
    fn stopped_by_store_after_sending(
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

    /// The facts of the running write for reconciliation and case files.
    fn write_facts(&self, run: &Run<'_>, budget: &ActionBudget) -> writes::WriteFacts {
        let spec = run.spec;
        let route = &spec.route;
        let class = self.inner.policy.request_classes.get(&route.class);
        writes::WriteFacts {
            action: run.id,
            task_id: run.task().to_owned(),
            agent: spec.agent.clone(),
            priority: run.priority,
            provider: route.provider.clone(),
            method: route.method.clone(),
            route: route.template.clone(),
            class: route.class.clone(),
            scopes: route.scopes.clone(),
            payload_digest: spec.payload_digest.clone(),
            idempotency_key: run.key.clone(),
            upstream_key: run.upstream_key.clone(),
            external_reference: run.reference.clone(),
            provider_operation_id: run
                .operation_id
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .clone(),
            fingerprint: run.fingerprint.to_string(),
            desired_outcome: spec.desired_outcome.clone(),
            reconcile: route.reconcile.clone(),
            max_attempts: class.map_or(1, |c| c.max_attempts),
            max_wait: class.map_or(std::time::Duration::ZERO, |c| c.max_wait),
            deadline: budget.deadline(),
            wait_used_ms: wait_ms(budget),
        }
    }

    /// Records the last attempt's `result` (received at the instant given beside it; a store
    /// that cannot is logged, and the escalation still opens), then escalates the write as one
    /// whose side effect is unknown ([`Engine::escalate_uncertain`]) for `reason`.
    async fn record_then_escalate(
        &self,
        run: &Run<'_>,
        (budget, seen): (&ActionBudget, &Seen),
        (result, received_at): (AttemptResult, Timestamp),
        facts: &writes::WriteFacts,
        reason: &str,
    ) -> Execution {
        if let Err(e) = self
            .inner
            .blocking(move |s| s.record_result(result, received_at))
            .await
        {
            tracing::warn!(action = run.id.0, task = %run.task(), agent = %run.spec.agent, route = %run.spec.route.template, error = %e, "could not record the result");
        }
        Box::pin(self.escalate_uncertain(run, budget, seen, facts, reason)).await
    }

    /// Escalates an uncertain write (its attempt result already recorded) and keeps its
    /// prepared request in memory so an operator's `retry_same_key` can resend it.
    async fn escalate_uncertain(
        &self,
        run: &Run<'_>,
        budget: &ActionBudget,
        seen: &Seen,
        facts: &writes::WriteFacts,
        reason: &str,
    ) -> Execution {
        let inner = &self.inner;
        let mut held = run.spec.clone();
        held.request = run.request.as_ref().clone();
        held.idempotency_key = Some(run.key.clone());
        {
            let mut holding = inner
                .held
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if holding.len() < HELD_REQUESTS {
                holding.insert(run.id.0, held);
            } else {
                tracing::warn!(
                    action = run.id.0,
                    held = holding.len(),
                    "escalated request not held: the bound is reached; a retry_same_key or send_new needs the agent to resubmit"
                );
            }
        }
        // The answer's `next_safe` is the case file's safe options (set by `escalate`).
        let context = self.context(budget, seen, None, Vec::new());
        match inner
            .escalate(
                facts,
                backstop_core::escalation::EscalationReason::SideEffectUnknown,
                reason,
                None,
                Some(context.clone()),
            )
            .await
        {
            Ok((escalation, context)) => Execution::Outcome {
                receipt: run.receipt(seen.sent),
                outcome: Outcome::Escalated,
                context,
                detail: format!(
                    "the provider may have acted on this write and it cannot be decided safely ({reason}); escalation {} awaits an operator",
                    escalation.0
                ),
            },
            Err(e) => {
                tracing::error!(action = run.id.0, error = %e, "could not open the escalation");
                let mut next_safe = Vec::new();
                if facts.reconcile.is_some() {
                    next_safe.push(NextSafe::QueryStatus);
                }
                if inner.honours_key(&run.spec.route.provider) {
                    next_safe.push(NextSafe::ResendSameKey);
                }
                next_safe.push(NextSafe::Abort);
                let context = OutcomeContext {
                    next_safe,
                    ..context
                };
                Box::pin(self.finish(
                    run,
                    budget,
                    Outcome::ReconciliationRequired,
                    context,
                    format!("the provider may have acted on this write ({reason}); the escalation could not be opened, so it must be reconciled before anything is sent again"),
                    seen.sent,
                ))
                .await
            }
        }
    }

    /// Applies quota headers and a rate limit's boundary to the route's scopes: in the
    /// scheduler first, then durably (`scope_updated`), before any retry is planned.
    async fn update_scopes(
        &self,
        run: &Run<'_>,
        signal: &Signal,
        status: Option<u16>,
        received_at: Timestamp,
    ) {
        let inner = &self.inner;
        let route = &run.spec.route;
        if route.scopes.is_empty() {
            return;
        }
        let mut updates: Vec<ScopeUpdate> = Vec::new();
        if let Some(obs) = signal
            .quota
            .iter()
            .filter(|o| o.remaining.is_some() || o.reset_at.is_some())
            .min_by_key(|o| o.remaining.unwrap_or(u64::MAX))
        {
            let exhausted = quota_boundary_with(&signal.quota, received_at, &run.rules.retry_after);
            let reset_at = match &exhausted {
                // Exhausted: the boundary as checked against the ceiling and `min_delay`; an
                // absurd reset (over the ceiling) is unknown, never a wait of centuries.
                Some(boundary) if obs.remaining == Some(0) => boundary.retry_not_before(),
                // Otherwise the reset is only shown, and only when it is not absurd either.
                _ => obs
                    .reset_at
                    .filter(|at| within_ceiling(*at, received_at, &run.rules.retry_after)),
            };
            let source = format!("{} quota headers", obs.dialect);
            inner
                .scheduler
                .signal(
                    &route.scopes,
                    ScopeSignal::Quota {
                        remaining: obs.remaining,
                        limit: obs.limit,
                        reset_at,
                        source: source.clone(),
                    },
                )
                .await;
            for scope in &route.scopes {
                updates.push(ScopeUpdate {
                    provider: route.provider.clone(),
                    scope: scope.clone(),
                    next_allowed_at: reset_at.filter(|_| obs.remaining == Some(0)),
                    remaining: obs.remaining,
                    limit: obs.limit,
                    reset_at,
                    source: source.clone(),
                });
            }
        }
        let limited = matches!(
            signal.disposition,
            Disposition::RateLimited | Disposition::QuotaExhausted
        );
        // The provider's boundary, or, when it gave none that can be used (no Retry-After, or a
        // negative, garbage or absurd one), a local pause: a 429 slows the whole scope even then
        // (SPEC §4.1), and never into a tight loop.
        // An exhausted quota without a known reset is not paused here: it is escalated, and an
        // operator's decision, not a local timer, says when the scope may send again.
        let limit_boundary = match (limited, signal.boundary.retry_not_before()) {
            (false, _) => None,
            (true, Some(boundary)) => Some((boundary, true)),
            (true, None) if signal.disposition != Disposition::RateLimited => None,
            (true, None) => jiff::SignedDuration::try_from(
                self.unknown_boundary_pause(&route.provider, &route.scopes),
            )
            .ok()
            .and_then(|pause| received_at.checked_add(pause).ok())
            .map(|at| (at, false)),
        };
        if let Some((boundary, given)) = limit_boundary {
            let source = match (&signal.boundary, status) {
                (backstop_core::retry_after::Boundary::Known { source, .. }, Some(status)) => {
                    format!("HTTP {status} {source}")
                }
                (backstop_core::retry_after::Boundary::Known { source, .. }, None) => {
                    source.clone()
                }
                (_, Some(status)) => format!(
                    "HTTP {status} without a usable boundary; local pause of {} ms",
                    boundary.duration_since(received_at).as_millis()
                ),
                (_, None) => format!(
                    "provider limit without a usable boundary; local pause of {} ms",
                    boundary.duration_since(received_at).as_millis()
                ),
            };
            inner
                .scheduler
                .signal(
                    &route.scopes,
                    ScopeSignal::RateLimited {
                        boundary,
                        source: source.clone(),
                    },
                )
                .await;
            // Retry-after debt is the provider's mandated delay (SPEC §10): a local pause is not.
            let debt = boundary.duration_since(received_at).as_secs_f64();
            for scope in &route.scopes {
                if given {
                    inner.metrics.add_retry_after_debt(scope, debt);
                }
                updates.push(ScopeUpdate {
                    provider: route.provider.clone(),
                    scope: scope.clone(),
                    next_allowed_at: Some(boundary),
                    remaining: Some(0),
                    limit: None,
                    reset_at: None,
                    source: source.clone(),
                });
            }
            tracing::info!(
                task = %run.task(),
                route = %route.template,
                source = %source,
                boundary = %boundary,
                "rate limited: every action of the route's scopes waits for the boundary"
            );
        }
        for update in updates {
            if let Err(e) = inner
                .blocking(move |s| s.update_scope(update, received_at).map(|_| ()))
                .await
            {
                tracing::warn!(error = %e, "could not persist the scope record");
            }
        }
    }

    /// How long a scope pauses after a rate limit whose boundary is unknown (a 429 without a
    /// usable `Retry-After`): the backoff cap for the scope's run of consecutive rate limits,
    /// `min(max_seconds, base_seconds · 2^n)` with `n` the run's length (SPEC §4.2), so a
    /// provider that keeps answering 429 without a boundary is probed ever more slowly.
    fn unknown_boundary_pause(&self, provider: &str, scopes: &[String]) -> std::time::Duration {
        let streak = self
            .inner
            .limit_streaks
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .longest(&quota_escalations::streak_keys(provider, scopes));
        let backoff = &self.inner.policy.backoff;
        backoff.config().cap(streak.max(1)).max(backoff.min_delay)
    }

    /// Ends an action whose last answer may not be retried.
    #[allow(clippy::too_many_arguments)]
    async fn final_failure(
        &self,
        run: &Run<'_>,
        budget: &ActionBudget,
        seen: &Seen,
        signal: Signal,
        response: Option<http::Response<Body>>,
        result: AttemptResult,
        key_honoured: bool,
    ) -> Execution {
        let inner = &self.inner;
        let route = &run.spec.route;
        match (signal.disposition, response) {
            (disposition @ (Disposition::Rejected | Disposition::Conflict), Some(response)) => {
                let outcome = if disposition == Disposition::Rejected {
                    Outcome::Rejected
                } else {
                    Outcome::Conflict
                };
                if disposition == Disposition::Rejected {
                    let code = signal
                        .error_code
                        .clone()
                        .unwrap_or_else(|| format!("http_{}", response.status().as_u16()));
                    self.breaker_failure(run, &code, seen.last_status).await;
                }
                let context = self.context(
                    budget,
                    seen,
                    None,
                    vec![NextSafe::ChangeRequest, NextSafe::Abort],
                );
                // A write's final answer is kept for idempotent replay, refused or not: a
                // same-key resend is answered as the first request was.
                let (response, kept) = if !run.spec.has_side_effect() {
                    (response, None)
                } else {
                    let (response, record, _) = kept_for_replay(response, run.id, false).await;
                    (response, Some(record))
                };
                let mut result = result;
                result.finish = Some(Finish {
                    outcome: store_outcome(outcome),
                    context: serde_json::to_value(&context).unwrap_or_default(),
                    response: kept,
                });
                self.record_final_result(run, result).await;
                inner
                    .metrics
                    .outcome(&route.provider, &route.class, outcome);
                tracing::info!(
                    task = %run.task(),
                    route = %route.template,
                    status = seen.last_status,
                    outcome = %outcome,
                    "final provider answer passed through"
                );
                Execution::Response {
                    receipt: run.receipt(seen.sent),
                    response,
                }
            }
            (Disposition::Uncertain, _) => {
                let mut next_safe = vec![NextSafe::QueryStatus];
                if key_honoured {
                    next_safe.push(NextSafe::ResendSameKey);
                }
                next_safe.push(NextSafe::Abort);
                let context = self.context(budget, seen, None, next_safe);
                let detail = "the provider may have acted on the request; reconcile before any further side effect".to_owned();
                Box::pin(self.finish_with_result(
                    run,
                    budget,
                    result,
                    Outcome::ReconciliationRequired,
                    context,
                    detail,
                    seen.sent,
                ))
                .await
            }
            (Disposition::QuotaExhausted, _) => {
                let boundary = seen.boundary;
                let context = self.context(budget, seen, boundary, wait_then_abort(boundary));
                Box::pin(self.finish_quota_exhausted(
                    run,
                    budget,
                    result,
                    context,
                    (boundary, signal.error_code.as_deref()),
                    seen.sent,
                ))
                .await
            }
            (disposition, _) => {
                let boundary = seen.boundary;
                let context = self.context(budget, seen, boundary, wait_then_abort(boundary));
                let detail = format!(
                    "`{}` answers are not retried for request class `{}`",
                    disposition, route.class
                );
                Box::pin(self.finish_with_result(
                    run,
                    budget,
                    result,
                    Outcome::BudgetExhausted,
                    context,
                    detail,
                    seen.sent,
                ))
                .await
            }
        }
    }

    fn breaker_success(&self, run: &Run<'_>) {
        let inner = &self.inner;
        let mut breakers = inner
            .breakers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if breakers.is_empty() {
            return;
        }
        let now = inner.clock.now();
        breakers.record_success(&run.spec.agent, run.task(), &run.fingerprint, now);
        inner.breakers_gauge.set(gauge_value(breakers.len()));
    }

    async fn breaker_failure(&self, run: &Run<'_>, code: &str, status: Option<u16>) {
        let inner = &self.inner;
        let at = inner.clock.now();
        let opened = {
            let mut breakers = inner
                .breakers
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            let opened = breakers.record_failure(
                &run.spec.agent,
                run.task(),
                &run.fingerprint,
                code,
                status,
                at,
            );
            inner.breakers_gauge.set(gauge_value(breakers.len()));
            opened
        };
        if let Some(open) = opened {
            let route = &run.spec.route;
            inner.metrics.breaker_opened(&route.provider);
            tracing::info!(
                task = %run.task(),
                route = %route.template,
                error_code = %open.error_code,
                failures = open.failures,
                "circuit opened for this request in this task"
            );
            let (agent, task, provider, method) = (
                run.spec.agent.clone(),
                run.task().to_owned(),
                route.provider.clone(),
                route.method.clone(),
            );
            if let Ok(template) = RouteTemplate::try_new(&route.template) {
                if let Err(e) = inner
                    .blocking(move |s| {
                        s.record_circuit_opened(&agent, &task, &provider, &method, &template, at)
                    })
                    .await
                {
                    tracing::warn!(error = %e, "could not audit the opened circuit");
                }
            }
        }
    }

    fn context(
        &self,
        budget: &ActionBudget,
        seen: &Seen,
        boundary: Option<Timestamp>,
        next_safe: Vec<NextSafe>,
    ) -> OutcomeContext {
        OutcomeContext {
            sent: seen.left > 0,
            response_received: seen.response_received,
            attempts: seen.sent,
            total_wait_ms: wait_ms(budget),
            last_status: seen.last_status,
            last_signal: seen.last_signal.map(str::to_owned),
            boundary,
            next_safe,
        }
    }

    /// The store could not record a retry of this action, and its caller is answered `503
    /// store_unavailable`; nothing of the retry left. `step` says which record failed: the
    /// retry's schedule (after the last attempt's result, which may have failed too) or its
    /// start when it came due (the `action_sent` that claims its job,
    /// [`Store::mark_attempt_sent`]). The action must not stay open for a step nothing takes
    /// any more (the watchdog's stuck findings, a `409` for every same-key resend, and for a
    /// retry never scheduled not even a restart would find it): as soon as the store commits
    /// again (see `Inner::record_when_store_commits`) it is closed as every action nothing
    /// sends again is (`writes::Closing`): a write one of whose attempts may have been acted on
    /// with nothing settling it since is reconciled with its original key, as a write sent
    /// without a result is at a restart
    /// (found → `succeeded`, otherwise `escalated`), and never resent; any other action ends
    /// `cancelled` with [`STORE_FAILED_BEFORE_RETRY`]. Either close also drops a retry job left
    /// waiting, as a retry re-armed at a restart does.
    fn close_unrecorded_retry(
        &self,
        run: &Run<'_>,
        budget: &ActionBudget,
        seen: &Seen,
        step: UnrecordedRetry,
    ) {
        let closing = writes::Closing::of(!run.spec.has_side_effect(), seen.unsettled);
        let (result, what) = match step {
            UnrecordedRetry::Start => (None, "the start of this action's retry when it came due"),
            UnrecordedRetry::Schedule { result: None } => {
                (None, "this action's retry when it was planned")
            }
            UnrecordedRetry::Schedule { result } => (
                result.map(|r| *r),
                "the result of this action's last attempt, nor its retry when it was planned",
            ),
        };
        let route = &run.spec.route;
        let then = match closing {
            writes::Closing::Reconcile => ", as soon as the store commits again, the write (its last attempt uncertain) is reconciled with its original key and closed; nothing is resent",
            writes::Closing::Cancel => " the action is closed `cancelled` as soon as the store commits again",
        };
        tracing::warn!(
            action = run.id.0,
            task = %run.task(),
            agent = %run.spec.agent,
            route = %route.template,
            attempts = seen.sent,
            "the store could not record {what}, so the retry was not sent; the caller is answered 503 store_unavailable and{then}"
        );
        let end = writes::DeferredEnd::closing(closing, writes::PayloadGone::StoreFailed, || {
            let context = self.context(budget, seen, seen.boundary, vec![NextSafe::Abort]);
            let mut context = serde_json::to_value(&context).unwrap_or_default();
            if let Some(members) = context.as_object_mut() {
                members.insert("detail".into(), STORE_FAILED_BEFORE_RETRY.into());
            }
            Finish {
                outcome: backstop_store::Outcome::Cancelled,
                context,
                response: None,
            }
        });
        self.inner.record_when_store_commits(writes::Deferred {
            action: run.id,
            result,
            end,
            count: Some((route.provider.clone(), route.class.clone())),
        });
    }

    /// Records the last attempt's `result` together with the outcome it carries (`finish`);
    /// when the store fails, see [`Self::final_result_not_recorded`].
    async fn record_final_result(&self, run: &Run<'_>, result: AttemptResult) {
        let (kept, at) = (result.clone(), self.inner.clock.now());
        if let Err(e) = self
            .inner
            .blocking(move |s| s.record_result(result, at))
            .await
        {
            self.final_result_not_recorded(run, kept, &e);
        }
    }

    /// The store could not record the last attempt's `result` and the outcome it carries: a
    /// store failure is recorded later ([`Self::outcome_not_recorded`]); any other refusal (the
    /// task was cancelled meanwhile) is logged at WARN as before.
    fn final_result_not_recorded(&self, run: &Run<'_>, mut result: AttemptResult, e: &EngineError) {
        match result.finish.take() {
            Some(finish) if is_store_failure(e) => {
                self.outcome_not_recorded(run, Some(result), finish, e);
            }
            _ => {
                tracing::warn!(action = run.id.0, task = %run.task(), agent = %run.spec.agent, route = %run.spec.route.template, error = %e, "could not record the result")
            }
        }
    }

    /// The store could not record how this action ended (`result`, the last attempt's result
    /// when it is recorded with the outcome, and `finish`): the caller has its answer already,
    /// but the action would stay open in the store — a `409` for every same-key resend. Logged
    /// at WARN with the action; the outcome is recorded as soon as the store commits again
    /// (see `Inner::record_when_store_commits`). The outcome was counted when the caller was
    /// answered.
    fn outcome_not_recorded(
        &self,
        run: &Run<'_>,
        result: Option<AttemptResult>,
        finish: Finish,
        e: &EngineError,
    ) {
        let route = &run.spec.route;
        tracing::warn!(
            action = run.id.0,
            task = %run.task(),
            agent = %run.spec.agent,
            route = %route.template,
            outcome = finish.outcome.as_str(),
            error = %e,
            "the store could not record this action's outcome; its caller has its answer, and the outcome is recorded as soon as the store commits again"
        );
        self.inner.record_when_store_commits(writes::Deferred {
            action: run.id,
            result,
            end: writes::DeferredEnd::Outcome(finish),
            count: None,
        });
    }

    /// Ends the action with a gateway-made outcome (no attempt result pending).
    async fn finish(
        &self,
        run: &Run<'_>,
        _budget: &ActionBudget,
        outcome: Outcome,
        context: OutcomeContext,
        detail: String,
        attempts: u32,
    ) -> Execution {
        let inner = &self.inner;
        let finish = Finish {
            outcome: store_outcome(outcome),
            context: serde_json::to_value(&context).unwrap_or_default(),
            response: None,
        };
        let (id, at, kept) = (run.id, inner.clock.now(), finish.clone());
        match inner
            .blocking(move |s| s.finish_action(id, finish, at))
            .await
        {
            Ok(()) => {}
            Err(e) if is_store_failure(&e) => self.outcome_not_recorded(run, None, kept, &e),
            // A cancelled task's actions were already ended by the store.
            Err(e) => tracing::debug!(action = id.0, error = %e, "action not finished again"),
        }
        self.ended(run, outcome, context, detail, attempts)
    }

    /// Ends the action `quota_exhausted` with the last attempt's `result` — the provider said
    /// its shared quota is exhausted (`signal`: the boundary it gave, if any, and its error
    /// code) — and hands the scope to a human once (SPEC §8: `shared_quota_exhausted`).
    async fn finish_quota_exhausted(
        &self,
        run: &Run<'_>,
        budget: &ActionBudget,
        result: AttemptResult,
        context: OutcomeContext,
        signal: (Option<Timestamp>, Option<&str>),
        attempts: u32,
    ) -> Execution {
        let (boundary, error_code) = signal;
        let detail = quota_escalations::exhausted_detail(boundary, error_code);
        let mut execution = Box::pin(self.finish_with_result(
            run,
            budget,
            result,
            Outcome::QuotaExhausted,
            context,
            detail,
            attempts,
        ))
        .await;
        let why = match error_code {
            Some(code) => format!("the provider answered `{code}`"),
            None => "the provider said the quota is exhausted".to_owned(),
        };
        self.escalate_exhausted_quota(run.id, &why, boundary, &mut execution)
            .await;
        execution
    }

    /// Ends the action with a gateway-made outcome together with the last attempt's result.
    #[allow(clippy::too_many_arguments)]
    async fn finish_with_result(
        &self,
        run: &Run<'_>,
        _budget: &ActionBudget,
        mut result: AttemptResult,
        outcome: Outcome,
        context: OutcomeContext,
        detail: String,
        attempts: u32,
    ) -> Execution {
        let inner = &self.inner;
        result.finish = Some(Finish {
            outcome: store_outcome(outcome),
            context: serde_json::to_value(&context).unwrap_or_default(),
            response: None,
        });
        self.record_final_result(run, result).await;
        let boundary = context.boundary;
        let mut execution = self.ended(run, outcome, context, detail, attempts);
        // SPEC §8: repeated limits in the scope, and this action still did not fit.
        if matches!(
            outcome,
            Outcome::BudgetExhausted | Outcome::DeadlineExhausted
        ) {
            let route = &run.spec.route;
            let streak = inner
                .limit_streaks
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .longest(&quota_escalations::streak_keys(
                    &route.provider,
                    &route.scopes,
                ));
            if streak >= quota_escalations::ACCOUNT_CONFIGURATION_STREAK {
                self.escalate_repeated_limits(run.id, streak, boundary, &mut execution)
                    .await;
            }
        }
        execution
    }

    /// Counts a gateway-made outcome in the metrics and returns it with the action's receipt
    /// (the store was already told, by [`Self::finish`] or [`Self::finish_with_result`]).
    fn ended(
        &self,
        run: &Run<'_>,
        outcome: Outcome,
        context: OutcomeContext,
        detail: String,
        attempts: u32,
    ) -> Execution {
        self.inner
            .metrics
            .outcome(&run.spec.route.provider, &run.spec.route.class, outcome);
        Execution::Outcome {
            receipt: ActionReceipt {
                action_id: run.id.0,
                idempotency_key: run.agent_key(),
                attempts,
                provider_operation_id: None,
                task: run.own_task.clone(),
            },
            outcome,
            context,
            detail,
        }
    }

    /// The store refused to record the action (a cancelled task, a key reused for another
    /// request, a task opened by another agent) or failed (nothing was sent either way). A
    /// reused key is answered `422 idempotency_key_reused` saying what differs. `key` is the
    /// idempotency key in effect for a write (the agent's, or the one minted for it), `action`
    /// the action when one is recorded; a store failure's answer carries both.
    fn refused_by_store(
        &self,
        e: EngineError,
        spec: &ActionSpec,
        key: Option<&str>,
        action: Option<ActionId>,
    ) -> Execution {
        if is_store_failure(&e) {
            let receipt = ActionReceipt {
                action_id: action.map_or(0, |a| a.0),
                attempts: 0,
                idempotency_key: key.map(str::to_owned),
                provider_operation_id: None,
                task: None,
            };
            return self.store_unavailable(spec, receipt, false, &e);
        }
        match e {
            EngineError::Store(StoreError::KeyReuse { differs, bound, .. }) => {
                let receipt = ActionReceipt {
                    action_id: 0,
                    attempts: 0,
                    idempotency_key: key.map(str::to_owned),
                    provider_operation_id: None,
                    task: None,
                };
                let problem = Problem::key_reused(
                    &differs,
                    (&bound.provider, &bound.method, &bound.route),
                    key,
                )
                .with_extension("task", spec.task_id.as_str().into());
                problem.log_refusal("admission", Some(&spec.agent), &self.inner.metrics);
                problem_answer(receipt, problem)
            }
            e => {
                self.inner.metrics.refusal(Outcome::Cancelled.as_str());
                match e {
                    // The record refusing it is named (`task "run-42" is cancelled; …`).
                    EngineError::Store(StoreError::InvalidTransition { what, reason }) => {
                        unrecorded(
                            Outcome::Cancelled,
                            format!("the action was not accepted: {what} is {reason}"),
                        )
                    }
                    _ => unrecorded(
                        Outcome::Cancelled,
                        "the action was not accepted by the store".to_owned(),
                    ),
                }
            }
        }
    }

    /// The store failed: `503 store_unavailable` saying whether an attempt was sent (a retry
    /// is invited only when nothing was), logged as an ERROR with the store's reason. While
    /// the gateway stops, a store whose writer is gone answers `503 shutting_down` instead.
    ///
    /// Like the other answers the gateway makes for an action, the problem carries `task`,
    /// the write's `idempotency_key` and `action_id` (see [`with_ids`]) — only when an action
    /// was recorded: a request the store could not record at all has none, and its log line
    /// says so instead of naming one.
    fn store_unavailable(
        &self,
        spec: &ActionSpec,
        receipt: ActionReceipt,
        sent: bool,
        e: &EngineError,
    ) -> Execution {
        let recorded = receipt.action_id != 0;
        let detail = match (sent, recorded) {
            (true, _) => "backstop's store failed after an attempt of this action was sent; check the action's status before sending it again",
            (false, true) if receipt.idempotency_key.is_some() => "backstop's store could not record this write's first send, so nothing was sent; sending it again later with the same Idempotency-Key sends it as this action",
            (false, _) => "backstop's store could not record this request durably, so nothing was sent; sending it again later is safe",
        };
        self.store_unavailable_saying(spec, receipt, sent, e, detail)
    }

    /// [`Self::store_unavailable`] with its `detail`.
    fn store_unavailable_saying(
        &self,
        spec: &ActionSpec,
        receipt: ActionReceipt,
        sent: bool,
        e: &EngineError,
        detail: &str,
    ) -> Execution {
        let action = (receipt.action_id != 0).then_some(receipt.action_id);
        if self.inner.shutting_down.load(Ordering::SeqCst)
            && matches!(e, EngineError::Store(StoreError::WriterGone))
        {
            let detail = if sent {
                "backstop is shutting down; an earlier attempt was sent, so the action stays recorded: check its status before sending it again"
            } else {
                "backstop is shutting down; nothing was sent for this request, so sending it again is safe"
            };
            let problem = with_ids(Problem::shutting_down_during(sent, detail), spec, &receipt);
            return problem_answer(receipt, problem);
        }
        let (task, agent, route) = (&spec.task_id, &spec.agent, &spec.route.template);
        match action {
            Some(action) => tracing::error!(
                action, %task, %agent, %route, sent, error = %e,
                "the store failed: the request is answered 503 store_unavailable"
            ),
            None => tracing::error!(
                %task, %agent, %route, sent, error = %e,
                "the store failed before the request was recorded (no action exists for it): the request is answered 503 store_unavailable"
            ),
        }
        let problem = with_ids(Problem::store_unavailable(sent, detail), spec, &receipt);
        problem_answer(receipt, problem)
    }

    /// A write whose admission the store could not commit (a damaged file, a full disk):
    /// `503 store_unavailable`. When the agent's own key already names its action for this
    /// same request (a same-key resend; the action is read, which needs no commit), this
    /// request was not sent again, but earlier attempts of the action may have been: the answer
    /// carries that action's id and attempts (the receipt), `sent` for the action as a whole,
    /// and says so instead of "nothing was sent". A new key, or an action that cannot be read,
    /// is answered as [`Self::refused_by_store`] answers.
    async fn write_not_admitted(&self, e: EngineError, spec: &ActionSpec, key: &str) -> Execution {
        if spec.idempotency_key.is_none() {
            // A key minted for this request names nothing yet.
            return self.refused_by_store(e, spec, Some(key), None);
        }
        let (agent, by) = (spec.agent.clone(), key.to_owned());
        let route = &spec.route;
        let record = match self
            .inner
            .blocking(move |s| s.action_by_key(&agent, &by))
            .await
        {
            Ok(Some(record))
                if record.provider == route.provider
                    && record.method == route.method
                    && record.route == route.template
                    && record.payload_digest == spec.payload_digest =>
            {
                record
            }
            _ => return self.refused_by_store(e, spec, Some(key), None),
        };
        let id = record.id;
        let Ok(attempts) = self.inner.blocking(move |s| s.attempts(id)).await else {
            return self.refused_by_store(e, spec, Some(key), None);
        };
        let facts = writes::recovered_context(&attempts, 0);
        let receipt = ActionReceipt {
            action_id: id.0,
            attempts: facts.attempts,
            idempotency_key: Some(key.to_owned()),
            task: Some(record.task_id.clone()),
            provider_operation_id: record.provider_operation_id,
        };
        let detail = if facts.sent {
            "backstop's store cannot commit, so this request was not sent again; earlier attempts of the action under this Idempotency-Key were sent (Backstop-Attempts counts them), so check the action's status before sending it again: it is never resent blindly"
        } else {
            "backstop's store cannot commit, so this request was not sent; nothing was sent for the action under this Idempotency-Key either, so sending it again later with the same key is safe"
        };
        self.store_unavailable_saying(spec, receipt, facts.sent, &e, detail)
    }

    /// The agent reused an idempotency key with the same payload: replay, join, or refuse.
    async fn existing(&self, record: ActionRecord, notify: Option<&Notify>) -> Execution {
        let inner = &self.inner;
        let id = record.id;
        let stored_attempts = inner
            .blocking(move |s| s.attempts(id))
            .await
            .unwrap_or_default();
        let attempts = u32::try_from(stored_attempts.len()).unwrap_or(u32::MAX);
        let receipt = ActionReceipt {
            action_id: id.0,
            attempts,
            idempotency_key: (!matches!(record.method.as_str(), "GET" | "HEAD" | "OPTIONS"))
                .then(|| record.idempotency_key.clone()),
            provider_operation_id: record.provider_operation_id.clone(),
            task: Some(record.task_id.clone()),
        };
        if record.state == ActionState::Finished {
            if let Some(stored) = record.response {
                return replay(receipt, stored);
            }
            let outcome = record.outcome.map_or(Outcome::Cancelled, core_outcome);
            // A context stored without every SPEC §5 member (a write reconciled by a lookup
            // keeps only `reconciled`; an action closed at a restart by an older build kept
            // `sent`, `attempts` and `next_safe`) is rebuilt from the stored attempts, as the
            // action view does, keeping a stored `next_safe`.
            let stored: Option<OutcomeContext> = record
                .outcome_context
                .clone()
                .and_then(|c| serde_json::from_value(c).ok());
            let context = stored.unwrap_or_else(|| {
                let waited = writes::recorded_wait_ms(&record, &stored_attempts);
                let mut rebuilt = writes::recovered_context(&stored_attempts, waited);
                if let Some(next_safe) = record
                    .outcome_context
                    .as_ref()
                    .and_then(|c| c.get("next_safe"))
                    .and_then(|n| serde_json::from_value(n.clone()).ok())
                {
                    rebuilt.next_safe = next_safe;
                }
                rebuilt
            });
            if matches!(outcome, Outcome::Rejected | Outcome::Conflict) && context.response_received
            {
                return unkept_replay(receipt, outcome, &context, inner.clock.now());
            }
            return Execution::Outcome {
                receipt,
                outcome,
                context,
                detail: crate::action::REPLAYED_OUTCOME.to_owned(),
            };
        }
        inner.metrics.layered_retry_joined(&record.provider);
        if let Some(mut rx) = inner.flights.follow(&FlightKey::Action(id.0)) {
            tracing::info!(
                action = id.0,
                "layered retry joined to the action in flight"
            );
            if let Some(notify) = notify {
                notify.runs(receipt.clone(), true);
            }
            if let Ok(shared) = rx.recv().await {
                return from_shared(shared);
            }
        }
        tracing::info!(
            action = id.0,
            "layered retry refused: the action is still in flight"
        );
        Execution::InFlight { receipt }
    }
}

/// Where an action was when the gateway stopped and its caller, one of whose attempts was sent,
/// is answered `503 shutting_down` ([`Engine::stopped_after_sending`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stopped {
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
enum AfterRestart {
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
    fn of(run: &Run<'_>, seen: &Seen) -> AfterRestart {
        if run.prior.sent > 0 && seen.sent == run.prior.sent {
            // Reopened by an operator for a same-key retry, and not sent again yet.
            AfterRestart::RetrySameKey
        } else {
            AfterRestart::closing(run, seen.unsettled)
        }
    }

    /// [`writes::Closing::of`] as the answer names it for the action of `run`: a write whose
    /// request the store keeps ([`Run::kept`]) is resumed, not cancelled.
    fn closing(run: &Run<'_>, unsettled: bool) -> AfterRestart {
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
    fn if_kept_or_not(
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
    fn after_store_failure(
        run: &Run<'_>,
        seen: &Seen,
        interrupted: Interrupted,
        maybe_kept: bool,
    ) -> Option<AfterRestart> {
        let (kept, undone) = AfterRestart::if_kept_or_not(run, seen, interrupted);
        (!maybe_kept || undone == kept).then_some(undone)
    }

    /// What the next start does, as the clause of a sentence whose subject is the next start.
    fn clause(self) -> &'static str {
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

    fn as_str(self) -> &'static str {
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
enum Interrupted {
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
    fn describe(self) -> &'static str {
        match self {
            Interrupted::Send => {
                "the start of its next attempt could not be recorded, so that attempt was not sent"
            }
            Interrupted::Result => "the answer to its last attempt could not be recorded",
            Interrupted::Schedule => "its retry could not be scheduled",
        }
    }
}

/// Whether a store operation that failed may have been committed all the same. A storage
/// error (SQLite's, a full disk) undid the operation's transaction; a writer that went away
/// ([`StoreError::WriterGone`]: the store closing, or its thread ended before it answered) or a
/// store call that did not return ([`EngineError::Aborted`]) gives no word either way.
fn may_have_committed(e: &EngineError) -> bool {
    matches!(
        e,
        EngineError::Aborted(_) | EngineError::Store(StoreError::WriterGone)
    )
}

/// How the last attempt ended, as a sentence of [`Engine::stopped_after_sending`]: the
/// provider's status, or that it never reached the provider.
fn last_attempt(seen: &Seen) -> String {
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

/// An outcome for a request that was never recorded (`action_id` 0, no attempts).
fn unrecorded(outcome: Outcome, detail: String) -> Execution {
    Execution::Outcome {
        receipt: ActionReceipt {
            action_id: 0,
            attempts: 0,
            idempotency_key: None,
            provider_operation_id: None,
            task: None,
        },
        outcome,
        context: OutcomeContext {
            next_safe: match outcome {
                Outcome::Rejected => vec![NextSafe::ChangeRequest, NextSafe::Abort],
                _ => vec![NextSafe::Abort],
            },
            ..OutcomeContext::default()
        },
        detail,
    }
}

/// An answer made as a problem response outside the outcome vocabulary (the store failed, the
/// gateway is stopping, a key reused for another request): carried as a response with the
/// receipt, rendered as it is.
fn problem_answer(receipt: ActionReceipt, problem: Problem) -> Execution {
    Execution::Response {
        receipt,
        response: problem.into_response(),
    }
}

/// Whether an engine error is a failure of the store itself (a damaged file, a full disk, the
/// writer gone) rather than the store refusing the operation (a cancelled task, a reused key).
fn is_store_failure(e: &EngineError) -> bool {
    match e {
        EngineError::Aborted(_) => true,
        EngineError::Store(e) => !matches!(
            e,
            StoreError::KeyReuse { .. }
                | StoreError::InvalidTransition { .. }
                | StoreError::NotFound { .. }
                | StoreError::Invalid { .. }
        ),
        EngineError::UnknownTask(_) | EngineError::ShuttingDown => false,
    }
}

/// A provider's answer without its own `Idempotent-Replayed` header. That header is backstop's
/// word to the agent: it says that backstop answered from its store and sent nothing. A
/// provider's own (its idempotency store replayed an earlier request under the same key) on an
/// answer backstop passes through fresh would tell the agent the opposite of what happened, so
/// it is removed as the answer arrives — before it is passed on, kept for replay or shared with
/// coalesced reads.
fn without_provider_replay_mark(reply: AttemptReply) -> AttemptReply {
    match reply {
        AttemptReply::Response(mut response) => {
            response.headers_mut().remove(crate::wire::REPLAYED_HEADER);
            AttemptReply::Response(response)
        }
        failed => failed,
    }
}

/// The stored final response of a completed write, answered again to the same agent with
/// `Idempotent-Replayed: true` (nothing is sent). A provider's own `Idempotent-Replayed` kept
/// before it was removed on arrival is not repeated: the header is backstop's, and once.
fn replay(receipt: ActionReceipt, stored: StoredResponse) -> Execution {
    let mut builder = http::Response::builder()
        .status(stored.status)
        .header(crate::wire::REPLAYED_HEADER, "true");
    for (name, value) in &stored.headers {
        if name.eq_ignore_ascii_case(crate::wire::REPLAYED_HEADER) {
            continue;
        }
        builder = builder.header(name, value);
    }
    match builder.body(Body::from(stored.body)) {
        Ok(response) => Execution::Response { receipt, response },
        Err(e) => Execution::Outcome {
            receipt,
            outcome: Outcome::Cancelled,
            context: OutcomeContext::default(),
            detail: format!("the stored response could not be replayed: {e}"),
        },
    }
}

/// The answer to a same-key resend of a write the provider refused (`rejected`, `conflict`)
/// whose response is not in the store — a write that ended before refused writes' responses
/// were kept: nothing is sent, and the problem says that the provider's response cannot be
/// replayed. It keeps the provider's status: as the HTTP status when it is a 4xx that SDKs do
/// not retry on their own (not 408, 409 or 429; those get the outcome's status, see
/// [`crate::problem`]), and always as `last_status` and in `detail`. Marked
/// `Idempotent-Replayed: true`, as every replay.
fn unkept_replay(
    receipt: ActionReceipt,
    outcome: Outcome,
    context: &OutcomeContext,
    now: Timestamp,
) -> Execution {
    let provider_status = context
        .last_status
        .and_then(|s| http::StatusCode::from_u16(s).ok());
    let said = match provider_status {
        Some(status) => format!("the provider's HTTP {}", status.as_u16()),
        None => "the provider's answer".to_owned(),
    };
    let detail = format!(
        "replayed: this idempotency key already ended `{outcome}` with {said}, but that response is not kept in backstop's store (the write ended before refused writes' responses were kept), so it cannot be replayed as it was sent; nothing was sent"
    );
    let mut problem = Problem::from_outcome(outcome, context, detail, now)
        .with_extension("action_id", receipt.action_id.into());
    if let Some(task) = &receipt.task {
        problem = problem.with_extension("task", task.as_str().into());
    }
    if let Some(key) = &receipt.idempotency_key {
        problem = problem.with_extension("idempotency_key", key.as_str().into());
    }
    if let Some(status) =
        provider_status.filter(|s| s.is_client_error() && !matches!(s.as_u16(), 408 | 409 | 429))
    {
        problem.status = status;
    }
    let mut response = problem.into_response();
    response.headers_mut().insert(
        crate::wire::REPLAYED_HEADER,
        http::HeaderValue::from_static("true"),
    );
    Execution::Response { receipt, response }
}

/// One copy of `execution` that every waiter can rebuild its answer from: a provider response
/// with its body buffered (up to `limit` bytes; a larger or unreadable one becomes a
/// `budget_exhausted` outcome saying why), or the gateway-made outcome. `route` names the
/// route in the log.
async fn into_shared(execution: Execution, route: &str, limit: usize) -> Shared {
    match execution {
        Execution::Response { receipt, response } => {
            let (parts, body) = response.into_parts();
            match Box::pin(axum::body::to_bytes(body, limit)).await {
                Ok(bytes) => Shared::Response {
                    receipt,
                    status: parts.status,
                    own: parts
                        .extensions
                        .get::<crate::problem::OwnAnswer>()
                        .is_some(),
                    headers: parts.headers,
                    body: bytes,
                },
                Err(e) => {
                    tracing::warn!(route = %route, error = %e, "shared response body could not be buffered");
                    Shared::Outcome {
                        context: OutcomeContext {
                            sent: true,
                            response_received: true,
                            attempts: receipt.attempts,
                            last_status: Some(parts.status.as_u16()),
                            next_safe: vec![NextSafe::Abort],
                            ..OutcomeContext::default()
                        },
                        receipt,
                        outcome: Outcome::BudgetExhausted,
                        detail: format!(
                            "the response body could not be buffered to share it between identical calls: {e}"
                        ),
                    }
                }
            }
        }
        Execution::Outcome {
            receipt,
            outcome,
            context,
            detail,
        } => Shared::Outcome {
            receipt,
            outcome,
            context,
            detail,
        },
        Execution::InFlight { receipt } => Shared::Outcome {
            context: OutcomeContext {
                attempts: receipt.attempts,
                next_safe: vec![NextSafe::QueryStatus, NextSafe::Abort],
                ..OutcomeContext::default()
            },
            receipt,
            outcome: Outcome::Conflict,
            detail: "an action with this idempotency key is still in flight".to_owned(),
        },
    }
}

fn from_shared(shared: Shared) -> Execution {
    match shared {
        Shared::Response {
            receipt,
            status,
            headers,
            body,
            own,
        } => {
            let mut response = http::Response::new(Body::from(body));
            *response.status_mut() = status;
            *response.headers_mut() = headers;
            if own {
                response.extensions_mut().insert(crate::problem::OwnAnswer);
            }
            Execution::Response { receipt, response }
        }
        Shared::Outcome {
            receipt,
            outcome,
            context,
            detail,
        } => Execution::Outcome {
            receipt,
            outcome,
            context,
            detail,
        },
    }
}

/// Whether `at` lies within the Retry-After ceiling of `received_at` (SPEC §2.2: a later instant
/// is absurd and read as unknown).
fn within_ceiling(
    at: Timestamp,
    received_at: Timestamp,
    opts: &backstop_core::retry_after::RetryAfterOptions,
) -> bool {
    let until = received_at.duration_until(at);
    until.is_negative() || until.unsigned_abs() <= opts.ceiling
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_shared_copy_of_backstops_own_answer_keeps_its_retry_hint() {
        let receipt = ActionReceipt {
            action_id: 1,
            attempts: 1,
            idempotency_key: None,
            provider_operation_id: None,
            task: None,
        };
        let own = problem_answer(
            receipt.clone(),
            Problem::shutting_down_during(true, "send it again once backstop is back"),
        );
        let copy = from_shared(into_shared(own, "/v1/x", SHARED_BODY_LIMIT).await);
        let Execution::Response { response, .. } = copy else {
            panic!("a response")
        };
        assert!(response
            .extensions()
            .get::<crate::problem::OwnAnswer>()
            .is_some());
        // A provider's answer stays the provider's.
        let provider = Execution::Response {
            receipt,
            response: http::Response::new(Body::from("busy")),
        };
        let copy = from_shared(into_shared(provider, "/v1/x", SHARED_BODY_LIMIT).await);
        let Execution::Response { response, .. } = copy else {
            panic!("a response")
        };
        assert!(response
            .extensions()
            .get::<crate::problem::OwnAnswer>()
            .is_none());
    }

    #[test]
    fn upstream_authority_is_host_and_port_without_userinfo() {
        assert_eq!(
            upstream_authority("http://127.0.0.1:9/v1/x?y=1"),
            "127.0.0.1:9"
        );
        assert_eq!(
            upstream_authority("https://user:secret@api.test/v1"),
            "api.test"
        );
        assert_eq!(upstream_authority("https://api.test?q#f"), "api.test");
        assert_eq!(upstream_authority("not a url"), "not a url");
    }

    const POLICY: &str = "
request_classes:
  read: { max_attempts: 2, max_wait_seconds: 10, retry_statuses: [429] }
  idempotent_write: { max_attempts: 3, max_wait_seconds: 10, retry_statuses: [429] }
providers:
  billing:
    base_url: http://127.0.0.1:9
    idempotency_header: Idempotency-Key
    routes:
      \"GET /v1/items/{id}\": { class: read }
      \"POST /v1/items/{id}\": { class: idempotent_write }
      \"POST /v1/transfers\": { class: idempotent_write, fingerprint_fields: [/amount] }
  other:
    base_url: http://127.0.0.1:9
";

    fn policy() -> Policy {
        Policy::from_yaml_str(POLICY, "p.yaml").expect("policy")
    }

    #[test]
    fn a_known_route_fingerprint_is_the_one_computed_for_the_request() {
        let policy = policy();
        let known = route_fingerprints(&policy);
        for (method, path, body) in [
            ("GET", "/v1/items/7", ""),
            ("POST", "/v1/items/7", r#"{"amount":5}"#),
            ("POST", "/v1/transfers", r#"{"amount":5}"#),
            ("POST", "/v1/transfers", r#"{"amount":6}"#),
            ("GET", "/v1/unconfigured/7", ""),
        ] {
            let route = policy.route("billing", method, path).expect("route");
            let payload = serde_json::from_slice::<serde_json::Value>(body.as_bytes()).ok();
            let expected = RequestFingerprint::compute(
                &route.method,
                &route.template,
                payload
                    .as_ref()
                    .filter(|_| !route.fingerprint_fields.is_empty()),
                &route.fingerprint_fields,
            );
            assert_eq!(
                fingerprint_with(&known, &route, body.as_bytes()),
                expected,
                "{method} {path}"
            );
        }
        assert!(
            !known.contains_key("/v1/transfers"),
            "a route with payload fields has no fixed fingerprint"
        );
        assert_eq!(known["/v1/items/{id}"].len(), 2, "one per method");
    }

    #[test]
    fn the_rule_table_holds_every_provider_and_class() {
        let policy = policy();
        let table = rule_table(&policy);
        for provider in ["billing", "other"] {
            for (name, class) in &policy.request_classes {
                let built = policy.classify_rules(provider, class).expect("rules");
                let kept = &table[provider][name];
                assert_eq!(
                    kept.retry_statuses, built.retry_statuses,
                    "{provider} {name}"
                );
                assert_eq!(kept.error_codes, built.error_codes, "{provider} {name}");
                assert_eq!(kept.dialect, built.dialect, "{provider} {name}");
            }
        }
    }
}
