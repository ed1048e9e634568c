//! `backstop demo`: the reference scenario (SPEC §13) run end to end on this machine.
//!
//! Why a demo and not a slide: the claims "a 429 slows the whole scope", "a dropped write is
//! never created twice" and "cancelled work never wakes" are only believable when measured
//! where a provider would see them. The demo starts the controllable fake provider and a real
//! gateway on free loopback ports (`127.0.0.1:0`) with a throwaway SQLite store, runs three
//! simulated agent tasks through the scenario, and reports from two independent records: the
//! store's hash-chained audit log and the fake provider's own attempt record.
//!
//! The scenario ([`run`]):
//! 1. `research-a` reads `GET /v1/items/42`; the provider answers `429 Retry-After: 2`;
//! 2. `research-b` and `research-c` issue the same read on the same scope: they wait for the
//!    boundary instead of calling at full speed;
//! 3. the retry and the two waiting reads are released after the boundary, spread by jitter;
//! 4. `research-a` creates a transfer with a stable `Idempotency-Key`; the provider stores it
//!    and drops the connection; backstop asks for its status (one lookup) instead of creating
//!    again;
//! 5. `research-b`'s refund write is dropped too and the status query fails, so it goes to an
//!    operator as a sanitized escalation; its export (a separate scope) will wait at most 1 s
//!    while the provider wants 3 s: the action ends at once with `budget_exhausted`;
//!    `research-c` is cancelled with two delayed reads, which never reach the provider.

mod render;

use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::Duration,
};

use backstop_core::policy::Policy;
use backstop_fake_api::{
    AttemptRecord, FakeApi, FakeConfig, Fault, Handler, QuotaConfig, RouteConfig, RunningFake,
};
use backstop_gateway::{
    engine::{Engine, TaskCancelled},
    server::{self, Running, ServeOptions},
};
use backstop_store::{audit::AuditEvent, EscalationRecord, Store};

pub use render::{render, shell_word};

/// The agent token the simulated tasks use (a throwaway value, only valid for the demo).
const AGENT_TOKEN: &str = "demo-agent-token";
/// The provider credential backstop adds (the fake only records a digest of it).
const PROVIDER_KEY: &str = "demo-provider-key";
/// The operator token of the demo policy's operator, to show and decide the open escalation
/// on a gateway serving the demo's store (a throwaway value, only valid for the demo).
const OPERATOR_TOKEN: &str = "demo-operator-token";
/// The demo policy's file name inside the demo directory.
pub const POLICY_FILE: &str = "policy.yaml";

/// The policy agent name.
const AGENT: &str = "demo-agent";

/// Everything the demo observed, for the report.
#[derive(Debug)]
pub struct Report {
    /// The directory kept for inspection.
    pub dir: PathBuf,
    /// The SQLite store the gateway used.
    pub store_path: PathBuf,
    /// The exported audit log (NDJSON), or why it could not be written.
    pub audit_path: Result<PathBuf, String>,
    /// Every audit event, in chain order.
    pub events: Vec<AuditEvent>,
    /// Every attempt the fake provider received, in arrival order.
    pub attempts: Vec<AttemptRecord>,
    /// What each simulated agent call got back.
    pub answers: Vec<Answer>,
    /// Escalations still open at the end.
    pub escalations: Vec<EscalationRecord>,
    /// What cancelling `research-c` changed.
    pub cancelled: Option<TaskCancelled>,
    /// Steps whose expectation was not met (empty when the scenario ran as designed).
    pub failures: Vec<String>,
}

/// One agent call and the answer it got.
#[derive(Debug, Clone)]
pub struct Answer {
    /// The task.
    pub task: String,
    /// `METHOD /path`.
    pub request: String,
    /// HTTP status the agent saw.
    pub status: u16,
    /// `outcome` of a problem answer, when the gateway made the answer itself.
    pub outcome: Option<String>,
    /// `Backstop-Attempts` of the answer.
    pub attempts: Option<String>,
    /// `Backstop-Action-Id` of the answer (absent or 0 when refused before an action existed).
    pub action: Option<i64>,
    /// The problem's `detail` (why the gateway ended the action), when it made the answer.
    pub detail: Option<String>,
}

fn policy_yaml(base_url: &str, dir: &Path) -> String {
    format!(
        r#"
store: {store}
backoff:
  base_seconds: 1
  max_seconds: 2
  boundary_spread_seconds: 1
agents:
  {AGENT}: {{ token_env: DEMO_AGENT_TOKEN }}
operators:
  demo-operator: {{ token_env: DEMO_OPERATOR_TOKEN }}
providers:
  fake:
    base_url: {base_url}
    credential: {{ secret_env: DEMO_PROVIDER_KEY }}
    idempotency_header: Idempotency-Key
    scopes:
      account: {{ limit: 1000, window_seconds: 60, max_concurrent_requests: 2 }}
      exports: {{ limit: 100, window_seconds: 60 }}
    default_scopes: [fake/account]
    routes:
      "GET /v1/items/{{id}}": {{ class: read, scopes: [account] }}
      "GET /v1/reports/{{id}}": {{ class: read, scopes: [account] }}
      "GET /v1/exports/{{id}}": {{ class: read, scopes: [exports] }}
      "GET /v1/transfers": {{ class: read, scopes: [account] }}
      "POST /v1/transfers":
        class: idempotent_write
        scopes: [account]
        reconcile:
          by: idempotency_key
          lookup: "GET /v1/transfers?idempotency_key={{key}}"
          found_pointer: /data/0/id
          operation_id_pointer: /id
"#,
        store = serde_json::Value::String(dir.join("backstop.db").display().to_string()),
    )
}

fn fake_config() -> FakeConfig {
    let throttle = |seconds: &str| Fault::Status {
        status: 429,
        retry_after: Some(seconds.to_owned()),
        body: None,
    };
    FakeConfig::default()
        .with_seed(7)
        .with_quota(QuotaConfig::fixed_window("account", 100, 60_000))
        .with_route(
            RouteConfig::new("GET /v1/items/{id}", Handler::default())
                .with_quota("account")
                .with_script([throttle("2")]),
        )
        .with_route(
            RouteConfig::new("GET /v1/reports/{id}", Handler::default())
                .with_quota("account")
                .with_script([throttle("2")]),
        )
        .with_route(
            RouteConfig::new("GET /v1/exports/{id}", Handler::default())
                .with_script([throttle("3")]),
        )
        .with_route(
            RouteConfig::new(
                "POST /v1/transfers",
                Handler::Create {
                    collection: "transfers".into(),
                    id_prefix: "tr_".into(),
                    reference_field: None,
                    unique_reference: false,
                },
            )
            .with_quota("account")
            .with_idempotency()
            .with_script([
                Fault::StoreThenDrop { hold_ms: 0 },
                Fault::StoreThenDrop { hold_ms: 0 },
            ]),
        )
        .with_route(
            RouteConfig::new(
                "GET /v1/transfers",
                Handler::Lookup {
                    collection: "transfers".into(),
                },
            )
            .with_quota("account")
            .with_script([
                Fault::Pass,
                Fault::Status {
                    status: 503,
                    retry_after: None,
                    body: None,
                },
            ]),
        )
}

fn env(name: &str) -> Option<String> {
    match name {
        "DEMO_AGENT_TOKEN" => Some(AGENT_TOKEN.to_owned()),
        "DEMO_PROVIDER_KEY" => Some(PROVIDER_KEY.to_owned()),
        "DEMO_OPERATOR_TOKEN" => Some(OPERATOR_TOKEN.to_owned()),
        _ => None,
    }
}

/// A fresh directory under the system temp dir (`backstop-demo-<pid>[-n]`), kept afterwards.
///
/// # Errors
/// The directory cannot be created.
pub fn fresh_dir() -> Result<PathBuf, String> {
    let base = std::env::temp_dir();
    let pid = std::process::id();
    for n in 0..1000u32 {
        let name = if n == 0 {
            format!("backstop-demo-{pid}")
        } else {
            format!("backstop-demo-{pid}-{n}")
        };
        let dir = base.join(name);
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(format!("cannot create {}: {e}", dir.display())),
        }
    }
    Err(format!(
        "cannot create a fresh backstop-demo directory in {}",
        base.display()
    ))
}

/// Runs the scenario with its store in `dir` (which must exist) and reports what happened.
///
/// # Errors
/// Set-up failures (runtime, listeners, store) as one message naming what failed. A step whose
/// expectation is not met is not an error: it is listed in [`Report::failures`].
pub fn run(dir: &Path) -> Result<Report, String> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    runtime.block_on(scenario(dir))
}

struct Live {
    fake: RunningFake,
    gateway: Running,
    engine: Engine,
    store: Arc<dyn Store>,
}

type Handles = (Engine, Arc<dyn Store>);

async fn start(dir: &Path) -> Result<Live, String> {
    let fake = FakeApi::start(fake_config(), ([127, 0, 0, 1], 0).into())
        .map_err(|e| format!("cannot start the fake provider: {e}"))?;
    let policy_text = policy_yaml(&fake.url(), dir);
    let policy_path = dir.join(POLICY_FILE);
    let policy = Policy::from_yaml_str(&policy_text, &policy_path.display().to_string())
        .map_err(|e| format!("the demo policy is invalid: {e}"))?;
    // Kept beside the store so `snapshots export --policy` can read the same classes and scopes.
    std::fs::write(&policy_path, &policy_text)
        .map_err(|e| format!("cannot write {}: {e}", policy_path.display()))?;
    let options = ServeOptions {
        listen: Some("127.0.0.1:0".into()),
        store: Some(dir.join("backstop.db")),
        seed: 2026,
        shutdown_grace: Duration::from_secs(2),
        ..ServeOptions::default()
    };
    let slot: Arc<Mutex<Option<Handles>>> = Arc::default();
    let keep = slot.clone();
    let gateway = server::start(policy, options, &env, move |parts| {
        let engine = Engine::new(
            parts.policy,
            parts.store.clone(),
            parts.transport,
            parts.clock,
            parts.metrics,
            parts.seed,
        );
        if let Ok(mut slot) = keep.lock() {
            *slot = Some((engine.clone(), parts.store));
        }
        Arc::new(engine)
    })
    .await
    .map_err(|e| format!("cannot start the gateway: {e}"))?;
    let (engine, store) = slot
        .lock()
        .ok()
        .and_then(|mut s| s.take())
        .ok_or("the gateway started without an engine")?;
    Ok(Live {
        fake,
        gateway,
        engine,
        store,
    })
}

/// What one agent call got back: status, `outcome`, `Backstop-Attempts`, `Backstop-Action-Id`
/// and `detail` (see [`Answer`]).
type Got = (
    u16,
    Option<String>,
    Option<String>,
    Option<i64>,
    Option<String>,
);

/// One agent call through the proxy door (blocking HTTP on a worker thread).
async fn call(
    base: String,
    task: &'static str,
    method: &'static str,
    path: &'static str,
    extra: Vec<(&'static str, &'static str)>,
    body: Option<&'static str>,
) -> Answer {
    let request = format!("{method} {path}");
    let outcome =
        tokio::task::spawn_blocking(
            move || match send(&base, task, method, path, &extra, body) {
                Ok(response) => read_answer(response),
                Err(e) => (0, Some(format!("transport error: {e}")), None, None, None),
            },
        )
        .await
        .unwrap_or((
            0,
            Some("the agent call panicked".to_owned()),
            None,
            None,
            None,
        ));
    Answer {
        task: task.to_owned(),
        request,
        status: outcome.0,
        outcome: outcome.1,
        attempts: outcome.2,
        action: outcome.3,
        detail: outcome.4,
    }
}

/// Sends one agent request (as `task`, with the demo agent's token and `extra` headers).
fn send(
    base: &str,
    task: &str,
    method: &str,
    path: &str,
    extra: &[(&str, &str)],
    body: Option<&str>,
) -> Result<ureq::http::Response<ureq::Body>, ureq::Error> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(20)))
        .build()
        .into();
    let url = format!("{base}/fake{path}");
    let auth = format!("Bearer {AGENT_TOKEN}");
    if method == "POST" {
        let mut builder = agent
            .post(&url)
            .header("Authorization", &auth)
            .header("X-Backstop-Task", task);
        for (name, value) in extra {
            builder = builder.header(*name, *value);
        }
        builder
            .content_type("application/json")
            .send(body.unwrap_or("{}").as_bytes())
    } else {
        let mut builder = agent
            .get(&url)
            .header("Authorization", &auth)
            .header("X-Backstop-Task", task);
        for (name, value) in extra {
            builder = builder.header(*name, *value);
        }
        builder.call()
    }
}

/// What the agent reads off an answer: its status, headers and, for a problem, its members.
fn read_answer(mut response: ureq::http::Response<ureq::Body>) -> Got {
    let status = response.status().as_u16();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let attempts = header("backstop-attempts");
    let action = header("backstop-action-id")
        .and_then(|id| id.parse::<i64>().ok())
        .filter(|id| *id > 0);
    let text = response.body_mut().read_to_string().unwrap_or_default();
    let problem = serde_json::from_str::<serde_json::Value>(&text).ok();
    let member = |name: &str| {
        problem
            .as_ref()
            .and_then(|v| v[name].as_str().map(str::to_owned))
    };
    (
        status,
        member("outcome"),
        attempts,
        action,
        member("detail"),
    )
}

/// Polls the store (every 20 ms, at most 10 s) until `count` events of `kind` exist for `task`.
async fn receipts(store: &Arc<dyn Store>, kind: &str, task: &str, count: usize) -> bool {
    for _ in 0..500 {
        let found = store
            .audit_events(0, 100_000)
            .map(|events| {
                events
                    .iter()
                    .filter(|e| e.kind == kind && e.task.as_deref() == Some(task))
                    .count()
            })
            .unwrap_or(0);
        if found >= count {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

fn expect(
    failures: &mut Vec<String>,
    step: &str,
    answer: &Answer,
    status: u16,
    outcome: Option<&str>,
) {
    let outcome_ok = outcome.is_none_or(|o| answer.outcome.as_deref() == Some(o));
    if answer.status != status || !outcome_ok {
        failures.push(format!(
            "step {step}: {} {} got HTTP {} ({}), expected HTTP {status}{}",
            answer.task,
            answer.request,
            answer.status,
            answer.outcome.as_deref().unwrap_or("provider answer"),
            outcome.map(|o| format!(" ({o})")).unwrap_or_default()
        ));
    }
}

/// What the scenario's steps collected so far: the agents' answers and the unmet expectations.
struct Steps {
    /// The gateway's base URL (`http://ADDR`).
    base: String,
    failures: Vec<String>,
    answers: Vec<Answer>,
}

impl Steps {
    /// Starts one agent read through the proxy door on its own task.
    fn spawn_get(&self, task: &'static str, path: &'static str) -> tokio::task::JoinHandle<Answer> {
        tokio::spawn(call(self.base.clone(), task, "GET", path, vec![], None))
    }

    /// Waits for a spawned agent call and checks its answer against step `step`'s expectation.
    async fn join(
        &mut self,
        handle: tokio::task::JoinHandle<Answer>,
        step: &str,
        status: u16,
        outcome: Option<&str>,
    ) -> Result<(), String> {
        let answer = handle
            .await
            .map_err(|e| format!("an agent task failed: {e}"))?;
        self.check(step, answer, status, outcome);
        Ok(())
    }

    /// Keeps `answer`, noting a failure of step `step` when it is not what was expected.
    fn check(&mut self, step: &str, answer: Answer, status: u16, outcome: Option<&str>) {
        expect(&mut self.failures, step, &answer, status, outcome);
        self.answers.push(answer);
    }

    /// Notes `failure` unless `ok`.
    fn require(&mut self, ok: bool, failure: &str) {
        if !ok {
            self.failures.push(failure.to_owned());
        }
    }

    /// (1)–(3): one shared quota, one 429, the whole scope waits, the release is spread.
    async fn shared_boundary(&mut self, store: &Arc<dyn Store>) -> Result<(), String> {
        let first = self.spawn_get("research-a", "/v1/items/42");
        let scheduled = receipts(store, "retry_scheduled", "research-a", 1).await;
        self.require(scheduled, "step 2: no retry was scheduled after the 429");
        let second = self.spawn_get("research-b", "/v1/items/42");
        // One after the other, so that the action ids (and the timeline) are the same in
        // every run.
        let requested = receipts(store, "action_requested", "research-b", 1).await;
        self.require(requested, "step 2: research-b's read was not recorded");
        let third = self.spawn_get("research-c", "/v1/items/42");
        for handle in [first, second, third] {
            self.join(handle, "3", 200, None).await?;
        }
        Ok(())
    }

    /// Creates a transfer as `task` under the idempotency key `key`.
    async fn transfer(&self, task: &'static str, key: &'static str, body: &'static str) -> Answer {
        let key = vec![("Idempotency-Key", key)];
        call(
            self.base.clone(),
            task,
            "POST",
            "/v1/transfers",
            key,
            Some(body),
        )
        .await
    }

    /// (4) a write with a stable key that the provider stores and drops the connection of;
    /// (5b) a dropped write whose status query fails: a human decides.
    async fn dropped_writes(&mut self) {
        let writes = [
            (
                "4",
                "research-a",
                "demo-transfer-0001",
                r#"{"amount":1250,"currency":"eur","destination":"acct_9"}"#,
                200,
                None,
            ),
            (
                "5",
                "research-b",
                "demo-refund-0002",
                r#"{"amount":990,"currency":"eur","destination":"acct_4"}"#,
                424,
                Some("escalated"),
            ),
        ];
        for (step, task, key, body, status, outcome) in writes {
            let answer = self.transfer(task, key, body).await;
            self.check(step, answer, status, outcome);
        }
    }

    /// (5a): a boundary beyond the wait budget ends the action at once.
    async fn beyond_budget(&mut self) {
        let export = call(
            self.base.clone(),
            "research-b",
            "GET",
            "/v1/exports/9",
            vec![("Prefer", "wait=1")],
            None,
        )
        .await;
        self.check("5", export, 429, Some("budget_exhausted"));
    }

    /// (5c): research-c is cancelled while two of its reads wait for a boundary.
    async fn cancelled_task(&mut self, live: &Live) -> Result<Option<TaskCancelled>, String> {
        let throttled = self.spawn_get("research-c", "/v1/reports/1");
        let scheduled = receipts(&live.store, "retry_scheduled", "research-c", 1).await;
        self.require(scheduled, "step 5: the report read was not throttled");
        let waiting = self.spawn_get("research-c", "/v1/reports/2");
        let recorded = receipts(&live.store, "action_requested", "research-c", 3).await;
        self.require(recorded, "step 5: the second report read was not recorded");
        let cancelled = match live.engine.cancel_task("research-c", AGENT).await {
            Ok(report) => Some(report),
            Err(e) => {
                self.failures
                    .push(format!("step 5: cancelling research-c failed: {e}"));
                None
            }
        };
        for handle in [throttled, waiting] {
            self.join(handle, "5", 410, Some("cancelled")).await?;
        }
        // Wait past the cancelled retry's wake (2 s boundary + up to 1 s jitter).
        tokio::time::sleep(Duration::from_millis(3_500)).await;
        Ok(cancelled)
    }

    /// Checks the provider's own record: cancelled work never reached it, and two logical
    /// writes were created once each.
    fn check_provider(&mut self, attempts: &[AttemptRecord]) {
        let calls_to = |route: &str| {
            attempts
                .iter()
                .filter(|a| a.route.as_deref() == Some(route))
                .count()
        };
        let reports = calls_to("GET /v1/reports/{id}");
        if reports != 1 {
            self.failures.push(format!(
                "step 5: the provider saw {reports} report reads; cancelled work must never reach it (expected 1)"
            ));
        }
        let creates = calls_to("POST /v1/transfers");
        if creates != 2 {
            self.failures.push(format!(
                "step 4: the provider saw {creates} creates for two logical writes (expected 2)"
            ));
        }
    }
}

async fn scenario(dir: &Path) -> Result<Report, String> {
    let live = start(dir).await?;
    let mut steps = Steps {
        base: format!("http://{}", live.gateway.addr),
        failures: Vec::new(),
        answers: Vec::new(),
    };
    steps.shared_boundary(&live.store).await?;
    steps.dropped_writes().await;
    steps.beyond_budget().await;
    let cancelled = steps.cancelled_task(&live).await?;
    let attempts = live.fake.attempts();
    steps.check_provider(&attempts);
    let escalations = live
        .store
        .open_escalations()
        .map_err(|e| format!("cannot read the escalations: {e}"))?;
    steps.require(!escalations.is_empty(), "step 5: no escalation is open");
    let (store_path, events) = stop(live).await?;
    let audit_path = export_audit(&events, &dir.join("audit.ndjson"));
    Ok(Report {
        dir: dir.to_path_buf(),
        store_path,
        audit_path,
        events,
        attempts,
        answers: steps.answers,
        escalations,
        cancelled,
        failures: steps.failures,
    })
}

/// Stops the gateway and the fake provider; returns the store's path and every audit event.
async fn stop(live: Live) -> Result<(PathBuf, Vec<AuditEvent>), String> {
    let store_path = live.gateway.store_path.clone();
    live.gateway
        .shutdown()
        .await
        .map_err(|e| format!("the gateway did not stop cleanly: {e}"))?;
    live.fake.shutdown().await;
    // Read through the gateway's own store, after its stop wrote what it writes: a second,
    // read-only opener would leave the WAL files behind (only the last writer removes them).
    let events = live
        .store
        .audit_events(0, 1_000_000)
        .map_err(|e| format!("cannot read the audit log: {e}"))?;
    drop(live.engine);
    drop(live.store);
    Ok((store_path, events))
}

/// Writes `events` to `out` as `backstop audit export` prints them (NDJSON).
fn export_audit(events: &[AuditEvent], out: &Path) -> Result<PathBuf, String> {
    let mut file = std::io::BufWriter::new(
        std::fs::File::create(out).map_err(|e| format!("cannot create {}: {e}", out.display()))?,
    );
    backstop_store::audit::write_export(&mut file, events)
        .map_err(|e| format!("cannot write {}: {e}", out.display()))?;
    std::io::Write::flush(&mut file).map_err(|e| format!("cannot write {}: {e}", out.display()))?;
    Ok(out.to_path_buf())
}
