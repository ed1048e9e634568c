//! Test support for the engine: a scripted in-memory transport that records every attempt with
//! its (virtual) time, a temp-dir SQLite store, and a small policy written here.

pub mod failing_store;

use std::{
    collections::{HashMap, VecDeque},
    future::Future,
    pin::Pin,
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::body::Body;
use backstop_core::{classify::TransportError, clock::Clock, pacing::Priority, policy::Policy};
use backstop_gateway::{
    action::{ActionSpec, Execution},
    clock::TokioClock,
    engine::Engine,
    metrics::Metrics,
    transport::{AttemptReply, AttemptRequest, Transport},
};
use backstop_store::{
    audit::AuditEvent, ActionId, Admission, NewAction, NewTask, PayloadDigest, RouteTemplate,
    SqliteStore, Store,
};
use bytes::Bytes;
use jiff::Timestamp;

/// The test policy: one provider, a 4-slot scope with room for 3 delayed actions, a 1-slot
/// scope, and routes for reads, a coalesced read and a write with a fingerprint field.
pub const POLICY: &str = r#"
request_classes:
  read:             { max_attempts: 4, max_wait_seconds: 90,  retry_statuses: [408, 429, 500, 502, 503, 504] }
  idempotent_write: { max_attempts: 3, max_wait_seconds: 120, retry_statuses: [408, 429, 502, 503, 504] }
  uncertain_write:  { max_attempts: 1, max_wait_seconds: 0,   retry_statuses: [] }
shared_scope:
  max_delayed_requests: 25
  max_concurrent_requests: 2
backoff:
  base_seconds: 1
  max_seconds: 60
  boundary_spread_seconds: 5
breaker:
  threshold: 3
providers:
  billing:
    base_url: https://billing.test
    idempotency_header: Idempotency-Key
    error_code_pointer: /error/code
    scopes:
      account: { max_concurrent_requests: 4, max_delayed_requests: 3 }
      single: { max_concurrent_requests: 1 }
    routes:
      "GET /v1/items/{id}": { class: read, scopes: [account] }
      "GET /v1/rates": { class: read, scopes: [account], coalesce: true }
      "POST /v1/transfers": { class: idempotent_write, scopes: [account], fingerprint_fields: [/amount] }
      "GET /v1/slow/{id}": { class: read, scopes: [single] }
"#;

/// The fixed wall-clock anchor of every test.
pub const T0: &str = "2026-03-01T12:00:00Z";

/// One scripted answer.
#[derive(Debug, Clone)]
pub enum Step {
    /// Answer with a status, headers and body, after holding the attempt for a while.
    Status {
        status: u16,
        headers: Vec<(&'static str, String)>,
        body: &'static str,
        hold: Duration,
    },
    /// Fail with a transport error.
    Fail(TransportError),
}

/// `status` with headers, answered at once.
pub fn answer(status: u16, headers: &[(&'static str, &str)], body: &'static str) -> Step {
    Step::Status {
        status,
        headers: headers.iter().map(|(n, v)| (*n, (*v).to_owned())).collect(),
        body,
        hold: Duration::ZERO,
    }
}

/// 200 after holding the attempt for `hold`.
pub fn held_ok(hold: Duration) -> Step {
    Step::Status {
        status: 200,
        headers: Vec::new(),
        body: "ok",
        hold,
    }
}

/// One attempt as the transport saw it.
#[derive(Debug, Clone)]
pub struct Sent {
    /// The request path (no host).
    pub path: String,
    /// Virtual time it arrived at the transport.
    pub at: Timestamp,
    /// The `Idempotency-Key` header it carried (the key the provider sees), if any.
    pub idempotency_key: Option<String>,
}

/// A transport answering from per-path scripts (200 "ok" when a script is empty) and recording
/// every attempt with its virtual time.
pub struct Scripted {
    clock: TokioClock,
    scripts: Mutex<HashMap<String, VecDeque<Step>>>,
    default_hold: Mutex<HashMap<String, Duration>>,
    log: Mutex<Vec<Sent>>,
}

impl Scripted {
    pub fn new(clock: TokioClock) -> Arc<Self> {
        Arc::new(Scripted {
            clock,
            scripts: Mutex::new(HashMap::new()),
            default_hold: Mutex::new(HashMap::new()),
            log: Mutex::new(Vec::new()),
        })
    }

    /// Queues answers for `path`.
    pub fn script(&self, path: &str, steps: Vec<Step>) {
        self.scripts
            .lock()
            .unwrap()
            .entry(path.to_owned())
            .or_default()
            .extend(steps);
    }

    /// Every unscripted 200 on `path` is held this long.
    pub fn hold(&self, path: &str, hold: Duration) {
        self.default_hold
            .lock()
            .unwrap()
            .insert(path.to_owned(), hold);
    }

    /// Every attempt so far.
    pub fn sent(&self) -> Vec<Sent> {
        self.log.lock().unwrap().clone()
    }

    /// Attempts on `path`.
    pub fn sent_to(&self, path: &str) -> Vec<Sent> {
        self.sent().into_iter().filter(|s| s.path == path).collect()
    }
}

impl Transport for Scripted {
    fn send(&self, request: AttemptRequest) -> Pin<Box<dyn Future<Output = AttemptReply> + Send>> {
        let path = request
            .url
            .strip_prefix("https://billing.test")
            .unwrap_or(&request.url)
            .to_owned();
        self.log.lock().unwrap().push(Sent {
            path: path.clone(),
            at: self.clock.now(),
            idempotency_key: request
                .headers
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned),
        });
        let step = self
            .scripts
            .lock()
            .unwrap()
            .get_mut(&path)
            .and_then(VecDeque::pop_front);
        let step = step.unwrap_or_else(|| {
            held_ok(
                self.default_hold
                    .lock()
                    .unwrap()
                    .get(&path)
                    .copied()
                    .unwrap_or_default(),
            )
        });
        Box::pin(async move {
            match step {
                Step::Fail(e) => AttemptReply::Failed(e),
                Step::Status {
                    status,
                    headers,
                    body,
                    hold,
                } => {
                    if !hold.is_zero() {
                        tokio::time::sleep(hold).await;
                    }
                    let mut response = http::Response::builder().status(status);
                    for (name, value) in headers {
                        response = response.header(name, value);
                    }
                    AttemptReply::Response(
                        response
                            .body(Body::from(Bytes::from_static(body.as_bytes())))
                            .unwrap(),
                    )
                }
            }
        })
    }
}

/// Everything one test needs.
pub struct Harness {
    pub engine: Engine,
    pub transport: Arc<Scripted>,
    pub store: Arc<SqliteStore>,
    pub policy: Arc<Policy>,
    pub metrics: Arc<Metrics>,
    pub clock: TokioClock,
    pub t0: Timestamp,
    _dir: tempfile::TempDir,
}

impl Harness {
    /// A fresh engine over [`POLICY`] (call with paused time).
    pub fn new() -> Harness {
        Harness::with_policy(POLICY)
    }

    /// A fresh engine over the given policy YAML (call with paused time).
    pub fn with_policy(yaml: &str) -> Harness {
        Harness::build(yaml, false).0
    }

    /// A fresh engine over [`POLICY`] whose store fails on demand (call with paused time).
    pub fn with_failing_store() -> (Harness, Arc<failing_store::FailingStore>) {
        Harness::with_failing_store_and_policy(POLICY)
    }

    /// A fresh engine over the given policy YAML whose store fails on demand (call with paused
    /// time).
    pub fn with_failing_store_and_policy(
        yaml: &str,
    ) -> (Harness, Arc<failing_store::FailingStore>) {
        let (harness, failing) = Harness::build(yaml, true);
        (harness, failing.unwrap())
    }

    fn build(yaml: &str, wrap: bool) -> (Harness, Option<Arc<failing_store::FailingStore>>) {
        let t0: Timestamp = T0.parse().unwrap();
        let clock = TokioClock::anchored_at(t0);
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(SqliteStore::open(dir.path().join("backstop.db")).unwrap());
        let failing =
            wrap.then(|| failing_store::FailingStore::new(store.clone() as Arc<dyn Store>));
        let engine_store: Arc<dyn Store> = match &failing {
            Some(f) => f.clone(),
            None => store.clone(),
        };
        let policy = Arc::new(Policy::from_yaml_str(yaml, "test.yaml").unwrap());
        let transport = Scripted::new(clock);
        let metrics = Arc::new(Metrics::new());
        let engine = Engine::new(
            policy.clone(),
            engine_store,
            transport.clone(),
            clock,
            metrics.clone(),
            42,
        );
        let harness = Harness {
            engine,
            transport,
            store,
            policy,
            metrics,
            clock,
            t0,
            _dir: dir,
        };
        (harness, failing)
    }

    /// An action of `task` for `METHOD path` with `body`.
    pub fn spec(&self, task: &str, method: &str, path: &str, body: &str) -> ActionSpec {
        let route = self.policy.route("billing", method, path).unwrap();
        ActionSpec {
            task_id: task.to_owned(),
            task_given: true,
            agent: "agent-a".to_owned(),
            priority: Priority::Normal,
            deadline: None,
            max_wait: None,
            route,
            request: AttemptRequest {
                method: method.parse().unwrap(),
                url: format!("https://billing.test{path}"),
                headers: http::HeaderMap::new(),
                body: Bytes::from(body.to_owned()),
            },
            single_attempt: false,
            idempotency_key: None,
            payload_digest: PayloadDigest::of(body.as_bytes()).as_str().to_owned(),
            target_digest: Some(PayloadDigest::of(path.as_bytes()).as_str().to_owned()),
            desired_outcome: None,
            resumed: false,
            holds_secret: false,
        }
    }

    /// Records an action of task `t` of `agent-a` at provider `billing` in the real store (a
    /// write when `key` is not empty) and nothing else, as a previous run left an action
    /// waiting for its first attempt; a test marks attempts on it to leave other states.
    pub fn recorded_action(&self, method: &str, route: &str, class: &str, key: &str) -> ActionId {
        self.store
            .open_task(
                NewTask {
                    id: "t".into(),
                    agent: "agent-a".into(),
                    priority: backstop_store::Priority::Normal,
                    deadline: None,
                },
                self.t0,
            )
            .unwrap();
        let admission = self
            .store
            .record_action(
                NewAction {
                    task_id: "t".into(),
                    agent: "agent-a".into(),
                    provider: "billing".into(),
                    method: method.into(),
                    route: RouteTemplate::try_new(route).unwrap(),
                    request_class: class.into(),
                    payload_digest: PayloadDigest::of(b""),
                    target_digest: Some(PayloadDigest::of(b"/v1/items/7")),
                    idempotency_key: key.into(),
                    external_reference: None,
                    desired_outcome: None,
                    fingerprint: None,
                    request: None,
                },
                self.t0,
            )
            .unwrap();
        let Admission::New(id) = admission else {
            panic!("a fresh action was taken as existing")
        };
        id
    }

    /// The next run of the gateway over the same store, transport, clock and metrics (after
    /// `self.engine` stopped), with jitter seed `seed`.
    pub fn restarted(&self, seed: u64) -> Engine {
        Engine::new(
            self.policy.clone(),
            self.store.clone(),
            self.transport.clone(),
            self.clock,
            self.metrics.clone(),
            seed,
        )
    }

    /// A GET of `path` in `task`.
    pub fn get(&self, task: &str, path: &str) -> ActionSpec {
        self.spec(task, "GET", path, "")
    }

    /// Runs `spec` on its own task, so the test can move time meanwhile.
    pub fn spawn(&self, spec: ActionSpec) -> tokio::task::JoinHandle<Execution> {
        let engine = self.engine.clone();
        tokio::spawn(async move { engine.execute(spec).await })
    }

    /// The engine's current (virtual) time.
    pub fn clock_now(&self) -> Timestamp {
        self.clock.now()
    }

    /// Seconds since the anchor.
    pub fn secs(&self, at: Timestamp) -> f64 {
        at.duration_since(self.t0).as_secs_f64()
    }

    /// The whole audit log.
    pub fn audit(&self) -> Vec<AuditEvent> {
        self.store.audit_events(0, 100_000).unwrap()
    }
}

/// Lets spawned work, blocking store calls and the store's writer thread run until `done()`
/// holds (polled for at most about 5 s of real time). Virtual time does not move meanwhile: the
/// runtime never parks, so paused time cannot auto-advance. Returns the last `done()`.
pub async fn until(mut done: impl FnMut() -> bool) -> bool {
    for _ in 0..5000 {
        if done() {
            return true;
        }
        tokio::task::yield_now().await;
        std::thread::sleep(Duration::from_millis(1));
    }
    done()
}

/// Advances virtual time by `d`, letting everything due run.
pub async fn advance(d: Duration) {
    tokio::time::sleep(d).await;
}

/// The status of a passed-through response, or the outcome name of a gateway outcome.
pub fn summary(execution: &Execution) -> String {
    match execution {
        Execution::Response { response, .. } => response.status().as_u16().to_string(),
        Execution::Outcome { outcome, .. } => outcome.as_str().to_owned(),
        Execution::InFlight { .. } => "in_flight".to_owned(),
    }
}

/// The receipt's attempts.
pub fn attempts(execution: &Execution) -> u32 {
    match execution {
        Execution::Response { receipt, .. }
        | Execution::Outcome { receipt, .. }
        | Execution::InFlight { receipt } => receipt.attempts,
    }
}
