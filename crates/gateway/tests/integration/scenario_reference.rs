//! The reference scenario of SPEC §13, measured at the provider.
//!
//! Why this suite exists: a retry layer can look right from the inside — "it eventually got a
//! 200" — while the provider saw a burst, an early retry or a second create. Every assertion
//! here is about the fake provider's own attempt record (what a real provider would see): the
//! exact number of calls, that none came before the boundary it was given, that the retries
//! released by one boundary are spread rather than one burst, and that cancelled work never
//! reaches it. Backstop (door + engine + SQLite store + upstream client) and the fake provider
//! run as separate listeners on loopback. Boundaries are 1–3 s so the suite stays fast.
//!
//! Steps (SPEC §13): (1)–(3) three tasks share one quota, the first read gets
//! `429 Retry-After: 2`, the whole scope waits, the released retries are spread by jitter;
//! (4) a write with a stable key whose connection drops after the provider stored it;
//! (5) a time budget that cannot cover the provider's boundary ends at once, and a cancelled
//! task's delayed actions never wake. The restart case lives in
//! `crates/cli/tests/integration/restart_recovery.rs`.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use backstop_core::{policy::Policy, reconcile::upstream_idempotency_key};
use backstop_fake_api::{
    AttemptRecord, FakeApi, FakeConfig, Fault, Handler, QuotaConfig, RouteConfig, RunningFake,
};
use backstop_gateway::{
    engine::Engine,
    server::{self, Running, ServeOptions},
};
use backstop_store::{audit::AuditEvent, Store};
use jiff::{SignedDuration, Timestamp};
use serde_json::Value;

const AGENT: &str = "scenario-agent";
const AGENT_TOKEN: &str = "agent-token-scenario-41c2";
const PROVIDER_SECRET: &str = "sk-scenario-provider-secret";

/// The `Retry-After` of the shared-quota read (seconds).
const READ_RETRY_AFTER_SECONDS: i64 = 2;
/// Upper bound of the jitter added after a boundary (`boundary_spread_seconds`).
const SPREAD_SECONDS: i64 = 2;

// ---------------------------------------------------------------------------------------------
// Harness

fn policy_yaml(base_url: &str) -> String {
    format!(
        r#"
backoff:
  base_seconds: 1
  max_seconds: 2
  boundary_spread_seconds: {SPREAD_SECONDS}
agents:
  {AGENT}: {{ token_env: SCENARIO_AGENT_TOKEN }}
providers:
  fake:
    base_url: {base_url}
    credential: {{ secret_env: SCENARIO_PROVIDER_KEY }}
    idempotency_header: Idempotency-Key
    scopes:
      account: {{ limit: 1000, window_seconds: 60, max_concurrent_requests: 2 }}
    default_scopes: [fake/account]
    routes:
      "GET /v1/items/{{id}}": {{ class: read, scopes: [account] }}
      "GET /v1/reports/{{id}}": {{ class: read, scopes: [account] }}
      "GET /v1/exports/{{id}}": {{ class: read, scopes: [account] }}
      "GET /v1/transfers": {{ class: read, scopes: [account] }}
      "POST /v1/transfers":
        class: idempotent_write
        scopes: [account]
        reconcile:
          by: idempotency_key
          lookup: "GET /v1/transfers?idempotency_key={{key}}"
          found_pointer: /data/0/id
          operation_id_pointer: /id
"#
    )
}

fn env(name: &str) -> Option<String> {
    match name {
        "SCENARIO_AGENT_TOKEN" => Some(AGENT_TOKEN.to_owned()),
        "SCENARIO_PROVIDER_KEY" => Some(PROVIDER_SECRET.to_owned()),
        _ => None,
    }
}

/// The engine and the store the gateway was built with.
type Handles = (Engine, Arc<dyn Store>);

/// One backstop gateway and one fake provider on loopback, with handles on the engine (to
/// cancel tasks) and the store (to wait for receipts).
struct Scenario {
    fake: RunningFake,
    gateway: Running,
    engine: Engine,
    store: Arc<dyn Store>,
    _dir: tempfile::TempDir,
}

impl Scenario {
    async fn start(routes: Vec<RouteConfig>) -> Scenario {
        let mut config = FakeConfig::default()
            .with_seed(13)
            .with_quota(QuotaConfig::fixed_window("account", 100, 60_000));
        for route in routes {
            config = config.with_route(route);
        }
        let fake = FakeApi::start(config, "127.0.0.1:0".parse().expect("addr"))
            .expect("fake provider starts");
        let dir = tempfile::tempdir().expect("tempdir");
        let (gateway, engine, store) =
            start_backstop(&fake.url(), &dir.path().join("backstop.db")).await;
        Scenario {
            fake,
            gateway,
            engine,
            store,
            _dir: dir,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}/fake{path}", self.gateway.addr)
    }

    /// Every audit event so far.
    fn audit(&self) -> Vec<AuditEvent> {
        self.store.audit_events(0, 100_000).expect("audit events")
    }

    /// Waits (polling the store, at most 10 s) until an audit event of `kind` for `task`
    /// exists, and returns it.
    async fn receipt(&self, kind: &str, task: &str) -> AuditEvent {
        for _ in 0..500 {
            if let Some(event) = self
                .audit()
                .into_iter()
                .find(|e| e.kind == kind && e.task.as_deref() == Some(task))
            {
                return event;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!(
            "no `{kind}` receipt for task {task} within 10 s; audit: {:#?}",
            self.audit()
        );
    }

    /// Waits (polling the store, at most 10 s) until `count` audit events of `kind` for `task`
    /// exist.
    async fn receipts(&self, kind: &str, task: &str, count: usize) {
        for _ in 0..500 {
            let found = self
                .audit()
                .iter()
                .filter(|e| e.kind == kind && e.task.as_deref() == Some(task))
                .count();
            if found >= count {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("fewer than {count} `{kind}` receipts for task {task} within 10 s");
    }

    /// Waits (at most 10 s) until the fake provider has answered `count` attempts.
    async fn answered(&self, count: usize) -> Vec<AttemptRecord> {
        for _ in 0..500 {
            let attempts = self.fake.attempts();
            if attempts.iter().filter(|a| a.status.is_some()).count() >= count {
                return attempts;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!(
            "the provider did not answer {count} attempts within 10 s: {:#?}",
            self.fake.attempts()
        );
    }

    async fn stop(self) {
        self.gateway.shutdown().await.expect("gateway stops");
        self.fake.shutdown().await;
    }
}

/// Starts backstop in front of `fake_url` on the SQLite store at `store` (created when
/// missing, resumed when it exists) and returns the engine and store it was built with.
async fn start_backstop(
    fake_url: &str,
    store: &std::path::Path,
) -> (Running, Engine, Arc<dyn Store>) {
    let policy = Policy::from_yaml_str(&policy_yaml(fake_url), "scenario.yaml").expect("policy");
    let options = ServeOptions {
        listen: Some("127.0.0.1:0".into()),
        store: Some(store.to_path_buf()),
        seed: 11,
        shutdown_grace: Duration::from_millis(500),
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
        *keep.lock().expect("slot") = Some((engine.clone(), parts.store));
        Arc::new(engine)
    })
    .await
    .expect("gateway starts");
    let (engine, store) = slot
        .lock()
        .expect("slot")
        .take()
        .expect("the engine was built");
    (gateway, engine, store)
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client")
}

/// A GET through the door for `task`; returns status, headers and body.
async fn get(
    url: String,
    task: &str,
    prefer: Option<&str>,
) -> (u16, reqwest::header::HeaderMap, String) {
    let mut request = client()
        .get(url)
        .bearer_auth(AGENT_TOKEN)
        .header("X-Backstop-Task", task);
    if let Some(prefer) = prefer {
        request = request.header("Prefer", prefer);
    }
    let response = request.send().await.expect("request reaches backstop");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response.text().await.expect("body");
    (status, headers, body)
}

fn at(record: &AttemptRecord) -> Timestamp {
    record.at.parse().expect("attempt time")
}

fn instant(text: &str) -> Timestamp {
    text.parse().expect("an RFC 3339 instant")
}

fn on_route<'a>(attempts: &'a [AttemptRecord], route: &str) -> Vec<&'a AttemptRecord> {
    attempts
        .iter()
        .filter(|a| a.route.as_deref() == Some(route))
        .collect()
}

fn header(headers: &reqwest::header::HeaderMap, name: &str) -> String {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

fn problem(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not a problem document ({e}): {body}"))
}

// ---------------------------------------------------------------------------------------------
// (1)–(3): one shared quota, one 429, the whole scope waits, the release is spread

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_delays_every_task_of_the_scope_and_the_released_attempts_are_spread() {
    let scenario = Scenario::start(vec![RouteConfig::new(
        "GET /v1/items/{id}",
        Handler::default(),
    )
    .with_quota("account")
    .with_script([Fault::Status {
        status: 429,
        retry_after: Some(READ_RETRY_AFTER_SECONDS.to_string()),
        body: None,
    }])])
    .await;

    // Task A's read is the first call: the provider answers 429 with Retry-After: 2.
    let first = tokio::spawn(get(scenario.url("/v1/items/7"), "run-a", None));
    // Once backstop has scheduled A's retry (after updating the scope record, SPEC §4.1), tasks
    // B and C issue the same read on the same scope.
    let scheduled = scenario.receipt("retry_scheduled", "run-a").await;
    let second = tokio::spawn(get(scenario.url("/v1/items/7"), "run-b", None));
    let third = tokio::spawn(get(scenario.url("/v1/items/7"), "run-c", None));

    let (a, b, c) = (
        first.await.expect("task a"),
        second.await.expect("task b"),
        third.await.expect("task c"),
    );
    for (name, (status, headers, body)) in [("a", &a), ("b", &b), ("c", &c)] {
        assert_eq!(*status, 200, "task {name}: {body}");
        assert_eq!(header(headers, "backstop-task"), format!("run-{name}"));
    }
    assert_eq!(
        header(&a.1, "backstop-attempts"),
        "2",
        "A: the 429 and one retry"
    );
    assert_eq!(header(&b.1, "backstop-attempts"), "1", "B never saw a 429");
    assert_eq!(header(&c.1, "backstop-attempts"), "1", "C never saw a 429");

    // Exactly four calls reached the provider: the 429, then one each.
    let attempts = scenario.fake.attempts();
    assert_eq!(attempts.len(), 4, "{attempts:#?}");
    assert_eq!(attempts[0].status, Some(429));
    let throttled_at = at(&attempts[0]);
    let boundary = scenario
        .audit()
        .into_iter()
        .filter(|e| e.kind == "scope_updated")
        .find_map(|e| e.boundary)
        .map(|b| instant(&b))
        .expect("the scope record got the 429's boundary");
    assert!(
        boundary >= throttled_at + SignedDuration::from_secs(READ_RETRY_AFTER_SECONDS),
        "boundary {boundary} is earlier than Retry-After allows after {throttled_at}"
    );
    assert!(
        instant(scheduled.due_at.as_deref().expect("a wake time")) >= boundary,
        "A's retry was scheduled before the boundary"
    );

    // No call of any task in the scope before the boundary; every later call succeeded.
    let released: Vec<Timestamp> = attempts[1..].iter().map(at).collect();
    for (record, when) in attempts[1..].iter().zip(&released) {
        assert_eq!(record.status, Some(200), "{record:?}");
        assert!(
            *when >= boundary,
            "attempt {} at {when} came before the boundary {boundary}",
            record.seq
        );
        assert!(
            *when <= boundary + SignedDuration::from_secs(SPREAD_SECONDS + 1),
            "attempt {} at {when} waited far past the boundary {boundary} + spread",
            record.seq
        );
    }

    // Released by one boundary, they do not arrive as one burst.
    let mut sorted = released.clone();
    sorted.sort();
    for pair in sorted.windows(2) {
        assert!(
            pair[1].duration_since(pair[0]) >= SignedDuration::from_millis(10),
            "two released attempts within 10 ms of each other: {sorted:?}"
        );
    }
    let spread = sorted[2].duration_since(sorted[0]);
    assert!(
        spread >= SignedDuration::from_millis(100),
        "the three released attempts arrived within {spread:?}: a burst, not jitter ({sorted:?}, boundary {boundary}, audit {:#?})", scenario.audit().iter().map(|e| format!("{} {} {:?} {:?} {:?}", e.at, e.kind, e.task, e.boundary, e.due_at)).collect::<Vec<_>>()
    );
    scenario.stop().await;
}

// ---------------------------------------------------------------------------------------------
// (4): a write with a stable key, connection dropped after the provider stored it

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_write_is_reconciled_by_one_lookup_never_created_twice() {
    let scenario = Scenario::start(vec![
        RouteConfig::new(
            "POST /v1/transfers",
            Handler::Create {
                collection: "transfers".into(),
                id_prefix: "tr_".into(),
                reference_field: None,
                unique_reference: false,
            },
        )
        .with_idempotency()
        .with_script([Fault::StoreThenDrop { hold_ms: 0 }]),
        RouteConfig::new(
            "GET /v1/transfers",
            Handler::Lookup {
                collection: "transfers".into(),
            },
        ),
    ])
    .await;

    let key = "scenario-transfer-0007";
    let response = client()
        .post(scenario.url("/v1/transfers"))
        .bearer_auth(AGENT_TOKEN)
        .header("X-Backstop-Task", "run-pay")
        .header("Idempotency-Key", key)
        .header("content-type", "application/json")
        .body(r#"{"amount":1250,"currency":"eur","destination":"acct_9"}"#)
        .send()
        .await
        .expect("request reaches backstop");
    let status = response.status().as_u16();
    let body = response.text().await.expect("body");

    let attempts = scenario.fake.attempts();
    let creates = on_route(&attempts, "POST /v1/transfers");
    assert_eq!(creates.len(), 1, "exactly one create: {attempts:#?}");
    // The provider sees the key derived from the agent and its key.
    let upstream = upstream_idempotency_key(AGENT, key);
    assert_eq!(
        creates[0].idempotency_key.as_deref(),
        Some(upstream.as_str())
    );
    assert_eq!(creates[0].fault.as_deref(), Some("store_then_drop"));
    let lookups = on_route(&attempts, "GET /v1/transfers");
    assert_eq!(lookups.len(), 1, "exactly one status query: {attempts:#?}");
    assert_eq!(
        lookups[0].query.as_deref(),
        Some(format!("idempotency_key={upstream}").as_str()),
        "the lookup asks for the original key"
    );
    assert!(at(lookups[0]) >= at(creates[0]));
    assert_eq!(attempts.len(), 2, "{attempts:#?}");

    assert_eq!(
        status, 200,
        "the reconciled write is reported succeeded: {body}"
    );
    let audit = scenario.audit();
    let reconciled = audit
        .iter()
        .find(|e| e.kind == "reconciled" && e.task.as_deref() == Some("run-pay"))
        .unwrap_or_else(|| panic!("no `reconciled` receipt: {audit:#?}"));
    assert_eq!(reconciled.idempotency_key.as_deref(), Some(key));
    let lookup = audit
        .iter()
        .find(|e| e.kind == "reconciliation_lookup" && e.task.as_deref() == Some("run-pay"))
        .unwrap_or_else(|| panic!("no `reconciliation_lookup` receipt: {audit:#?}"));
    assert!(
        lookup.seq < reconciled.seq,
        "the outcome receipt follows the provider's evidence"
    );
    scenario.stop().await;
}

// ---------------------------------------------------------------------------------------------
// (5): the time budget runs out; cancelled work never wakes

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_boundary_beyond_the_wait_budget_ends_now_without_a_second_call() {
    let scenario = Scenario::start(vec![RouteConfig::new(
        "GET /v1/exports/{id}",
        Handler::default(),
    )
    .with_script([Fault::Status {
        status: 429,
        retry_after: Some("3".into()),
        body: None,
    }])])
    .await;

    // The agent will wait at most 1 s in total; the provider asks for 3 s.
    let started = tokio::time::Instant::now();
    let (status, headers, body) =
        get(scenario.url("/v1/exports/9"), "run-export", Some("wait=1")).await;
    let took = started.elapsed();

    assert!(
        took < Duration::from_millis(900),
        "backstop slept {took:?} into a failure it could foresee"
    );
    let attempts = scenario.answered(1).await;
    assert_eq!(attempts.len(), 1, "no second call: {attempts:#?}");
    assert_eq!(attempts[0].status, Some(429));

    let problem = problem(&body);
    assert_eq!(problem["outcome"], "budget_exhausted", "{problem:#}");
    assert_eq!(problem["sent"], true);
    assert_eq!(problem["attempts"], 1);
    assert_eq!(problem["last_status"], 429);
    let boundary = instant(
        problem["boundary"]
            .as_str()
            .expect("the boundary is reported"),
    );
    assert!(boundary >= at(&attempts[0]) + SignedDuration::from_secs(3));
    assert!(
        problem["next_safe"]
            .as_array()
            .expect("next_safe")
            .iter()
            .any(|o| o["option"] == "wait_until"),
        "the agent is told when it is safe: {problem:#}"
    );
    // A later retry is safe, so the answer is an honest 429 with Retry-After, not a 5xx.
    assert_eq!(status, 429, "{body}");
    let retry_after: i64 = header(&headers, "retry-after")
        .parse()
        .expect("Retry-After in seconds");
    assert!((2..=3).contains(&retry_after), "Retry-After {retry_after}");
    assert!(!body.contains(PROVIDER_SECRET) && !body.contains(AGENT_TOKEN));
    scenario.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_task_never_wakes_and_never_reaches_the_provider_again() {
    let scenario = Scenario::start(vec![RouteConfig::new(
        "GET /v1/reports/{id}",
        Handler::default(),
    )
    .with_script([Fault::Status {
        status: 429,
        retry_after: Some(READ_RETRY_AFTER_SECONDS.to_string()),
        body: None,
    }])])
    .await;

    // The task's first read is throttled and its retry scheduled; its second read waits for
    // the scope's boundary in the delayed queue.
    let throttled = tokio::spawn(get(scenario.url("/v1/reports/1"), "run-cancel", None));
    let scheduled = scenario.receipt("retry_scheduled", "run-cancel").await;
    let waiting = tokio::spawn(get(scenario.url("/v1/reports/2"), "run-cancel", None));
    scenario.receipts("action_requested", "run-cancel", 2).await;

    let cancelled = scenario
        .engine
        .cancel_task("run-cancel", AGENT)
        .await
        .expect("the task is cancelled");
    // Both delayed actions are dropped before they wake. The throttled one is counted where the
    // cancel found it — as a durable scheduled retry, in the delayed queue waiting for its
    // boundary, or both — so only the lower bound is exact; the provider's record below is the
    // measurement that matters.
    assert!(
        cancelled.waiting_dropped >= 1
            && cancelled.retries_dropped + cancelled.waiting_dropped >= 2,
        "both delayed actions were dropped before they woke: {cancelled:?}"
    );

    for (name, handle) in [("throttled", throttled), ("waiting", waiting)] {
        let (status, _, body) = handle.await.expect("request task");
        assert_eq!(status, 410, "the {name} action ends cancelled: {body}");
        assert_eq!(problem(&body)["outcome"], "cancelled");
    }

    // Wait past the wake time and the whole jitter window (measured from the throttled call,
    // which is earlier than now): nothing more reaches the provider.
    let throttled_at = at(&scenario.fake.attempts()[0]);
    let due = instant(scheduled.due_at.as_deref().expect("a wake time"));
    let past = due.duration_since(throttled_at)
        + SignedDuration::from_secs(SPREAD_SECONDS)
        + SignedDuration::from_millis(500);
    tokio::time::sleep(past.unsigned_abs()).await;
    let attempts = scenario.fake.attempts();
    assert_eq!(attempts.len(), 1, "only the throttled call: {attempts:#?}");
    assert_eq!(attempts[0].path, "/v1/reports/1");

    let audit = scenario.audit();
    assert!(
        audit
            .iter()
            .filter(|e| e.task.as_deref() == Some("run-cancel"))
            .all(|e| e.kind != "retry_started"),
        "a cancelled retry woke: {audit:#?}"
    );
    assert!(audit
        .iter()
        .any(|e| e.kind == "cancelled" && e.task.as_deref() == Some("run-cancel")));
    let sent = audit
        .iter()
        .filter(|e| e.kind == "action_sent" && e.task.as_deref() == Some("run-cancel"))
        .count();
    assert_eq!(sent, 1, "the store recorded one send for the task");
    scenario.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecidable_write_reaches_the_operator_as_a_sanitized_escalation() {
    let scenario = Scenario::start(vec![
        RouteConfig::new(
            "POST /v1/transfers",
            Handler::Create {
                collection: "transfers".into(),
                id_prefix: "tr_".into(),
                reference_field: None,
                unique_reference: false,
            },
        )
        .with_idempotency()
        .with_script([Fault::StoreThenDrop { hold_ms: 0 }]),
        // The status query itself fails: the evidence stays inconclusive.
        RouteConfig::new(
            "GET /v1/transfers",
            Handler::Lookup {
                collection: "transfers".into(),
            },
        )
        .with_script([Fault::Status {
            status: 503,
            retry_after: None,
            body: None,
        }]),
    ])
    .await;
    // The operator's view of the same store, as `backstop serve` exposes it.
    let operators =
        backstop_gateway::escalations::router(backstop_gateway::escalations::EscalationsState {
            store: scenario.store.clone(),
            operators: Arc::new(|token: &str| {
                (token == "operator-token-scenario").then(|| "ops".to_owned())
            }),
            clock: backstop_gateway::clock::TokioClock::system(),
            secrets: Default::default(),
        });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("operator listener");
    let operator_addr = listener.local_addr().expect("addr");
    let serving = tokio::spawn(async move { axum::serve(listener, operators).await });

    let key = "scenario-refund-0042";
    let payload = r#"{"amount":990,"currency":"eur","destination":"acct_PAYLOAD_CANARY"}"#;
    let response = client()
        .post(scenario.url("/v1/transfers"))
        .bearer_auth(AGENT_TOKEN)
        .header("X-Backstop-Task", "run-refund")
        .header("Idempotency-Key", key)
        .header("content-type", "application/json")
        .body(payload)
        .send()
        .await
        .expect("request reaches backstop");
    let status = response.status().as_u16();
    let body = response.text().await.expect("body");
    assert_eq!(status, 424, "{body}");
    assert_eq!(problem(&body)["outcome"], "escalated", "{body}");

    let attempts = scenario.fake.attempts();
    assert_eq!(
        on_route(&attempts, "POST /v1/transfers").len(),
        1,
        "never a second create while the effect is unknown: {attempts:#?}"
    );
    assert_eq!(on_route(&attempts, "GET /v1/transfers").len(), 1);

    let operator = |path: &str| {
        client()
            .get(format!("http://{operator_addr}{path}"))
            .bearer_auth("operator-token-scenario")
            .send()
    };
    let list: Value = serde_json::from_str(
        &operator("/v1/escalations")
            .await
            .expect("list")
            .text()
            .await
            .expect("body"),
    )
    .expect("json");
    let open = list["escalations"].as_array().expect("escalations");
    assert_eq!(open.len(), 1, "{list:#}");
    let id = open[0]["id"].as_i64().expect("id");
    let shown = operator(&format!("/v1/escalations/{id}"))
        .await
        .expect("show")
        .text()
        .await
        .expect("body");
    let case: Value = serde_json::from_str(&shown).expect("case json");
    let case_file = &case["case_file"];
    assert_eq!(case_file["idempotency_key"], key, "{case:#}");
    let options: Vec<&str> = case_file["options"]
        .as_array()
        .expect("options")
        .iter()
        .filter_map(|o| o["option"].as_str())
        .collect();
    for expected in ["query_status", "retry_same_key", "abort", "send_new"] {
        assert!(
            options.contains(&expected),
            "{expected} missing: {options:?}"
        );
    }
    // Sanitized: no payload, no credentials.
    for secret in ["PAYLOAD_CANARY", PROVIDER_SECRET, AGENT_TOKEN] {
        assert!(
            !shown.contains(secret),
            "{secret} leaked into the case file"
        );
    }
    serving.abort();
    scenario.stop().await;
}
