//! Snapshots derived from the gateway's receipts (a temporary SQLite store populated through the
//! `Store` API exactly as the executor writes them), their diagnoses, and the health routes
//! in-process (`tower::ServiceExt::oneshot`).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use backstop_core::diagnose::{diagnose, parse_snapshot, DiagnoseOptions, Diagnosis, Snapshot};
use backstop_gateway::auth::{Caller, Role};
use backstop_gateway::clock::TokioClock;
use backstop_gateway::health::{
    derive_snapshot, router, Evidence, HealthPolicy, HealthState, SnapshotContext,
};
use backstop_store::{
    ActionId, Admission, AttemptResult, Boundary, Disposition, Finish, JobId, NewAction, NewTask,
    Outcome, PayloadDigest, Priority, RouteTemplate, ScopeUpdate, SqliteStore, Store,
};
use jiff::{SignedDuration, Timestamp};
use serde_json::Value;
use tower::ServiceExt;

const SCOPE: &str = "llm/project:a";

/// The fixed origin of every test instant.
fn t0() -> Timestamp {
    "2026-07-26T18:40:00Z".parse().expect("t0")
}

/// `t0 + ms`.
fn at(ms: i64) -> Timestamp {
    t0() + SignedDuration::from_millis(ms)
}

fn store() -> (tempfile::TempDir, Arc<SqliteStore>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Arc::new(SqliteStore::open(dir.path().join("backstop.db")).expect("store"));
    (dir, store)
}

/// Opens a task (deadline `t0 + 10 min`) and records one `idempotent_write` action.
fn action(store: &SqliteStore, task: &str, agent: &str, key: &str) -> ActionId {
    store
        .open_task(
            NewTask {
                id: task.into(),
                agent: agent.into(),
                priority: Priority::Normal,
                deadline: Some(at(600_000)),
            },
            at(0),
        )
        .expect("task");
    match store
        .record_action(
            NewAction {
                task_id: task.into(),
                agent: agent.into(),
                provider: "llm".into(),
                method: "POST".into(),
                route: RouteTemplate::try_new("/v1/chat/completions").expect("route"),
                request_class: "idempotent_write".into(),
                payload_digest: PayloadDigest::of(key.as_bytes()),
                target_digest: None,
                idempotency_key: key.into(),
                external_reference: None,
                desired_outcome: None,
                fingerprint: None,
                request: None,
            },
            at(0),
        )
        .expect("action")
    {
        Admission::New(id) => id,
        Admission::Existing(_) => panic!("a fresh key was taken as existing"),
    }
}

/// The `Date` header a provider stamps on a response sent at `ms` (IMF-fixdate, whole seconds).
fn date_header(ms: i64) -> String {
    let at = at(ms);
    let floored = Timestamp::from_second(at.as_second()).expect("second");
    floored.strftime("%a, %d %b %Y %H:%M:%S GMT").to_string()
}

/// Attempt `n` sent at `sent_ms`, answered 429 at `result_ms` with a boundary `boundary_ms`
/// (`None` = unknown), the scope record updated first, as the executor does. A known boundary
/// came from `Retry-After: <whole seconds>` with the response's `Date`; both are kept as the
/// attempt's signal headers.
fn throttled(
    store: &SqliteStore,
    id: ActionId,
    sent_ms: i64,
    result_ms: i64,
    boundary_ms: Option<i64>,
) -> u32 {
    let n = store.mark_attempt_sent(id, at(sent_ms)).expect("sent");
    if let Some(b) = boundary_ms {
        store
            .update_scope(
                ScopeUpdate {
                    provider: "llm".into(),
                    scope: SCOPE.into(),
                    next_allowed_at: Some(at(b)),
                    remaining: Some(0),
                    limit: None,
                    reset_at: None,
                    source: "HTTP 429 Retry-After".into(),
                },
                at(result_ms),
            )
            .expect("scope");
    }
    store
        .record_result(
            AttemptResult {
                action: id,
                attempt: n,
                status: Some(429),
                disposition: Disposition::RateLimited,
                boundary: Some(boundary_ms.map_or(Boundary::Unknown, |b| Boundary::At(at(b)))),
                source: boundary_ms.map(|_| "Retry-After".to_owned()),
                provider_operation_id: None,
                signal_headers: boundary_ms.map_or_else(Vec::new, |b| {
                    vec![
                        (
                            "retry-after".to_owned(),
                            ((b - result_ms) / 1_000).to_string(),
                        ),
                        ("date".to_owned(), date_header(result_ms)),
                    ]
                }),
                finish: None,
            },
            at(result_ms),
        )
        .expect("result");
    n
}

fn succeeded(store: &SqliteStore, id: ActionId, n: u32, ms: i64, finish: bool) {
    store
        .record_result(
            AttemptResult {
                action: id,
                attempt: n,
                status: Some(200),
                disposition: Disposition::Success,
                boundary: Some(Boundary::Unknown),
                source: None,
                provider_operation_id: None,
                signal_headers: Vec::new(),
                finish: finish.then(|| Finish {
                    outcome: Outcome::Succeeded,
                    context: serde_json::json!({}),
                    response: None,
                }),
            },
            at(ms),
        )
        .expect("success");
}

/// Folds the store's log and derives the snapshot of `id` at `now_ms`.
fn snapshot(store: &SqliteStore, id: ActionId, now_ms: i64) -> Option<Snapshot> {
    let mut evidence = Evidence::new();
    evidence.catch_up(store).expect("fold");
    let trail = evidence.trail(id.0).expect("trail");
    let agent = store.action(id).expect("action").expect("action row").agent;
    let task = store
        .task(&agent, &trail.task)
        .expect("task")
        .expect("task row");
    let policy = HealthPolicy::spec_defaults();
    derive_snapshot(
        trail,
        &SnapshotContext {
            deadline: task.deadline,
            policy: &policy,
            heartbeat_at: evidence.heartbeat_at(),
            now: at(now_ms),
        },
    )
}

fn diagnosis(s: &Snapshot, now_ms: i64) -> Diagnosis {
    diagnose(s, at(now_ms), &DiagnoseOptions::default()).diagnosis
}

fn ended(store: &SqliteStore, id: ActionId, outcome: Outcome, ms: i64) {
    store
        .finish_action(
            id,
            Finish {
                outcome,
                context: serde_json::json!({"sent": true}),
                response: None,
            },
            at(ms),
        )
        .expect("ended");
}

#[test]
fn a_finished_budget_exhausted_action_is_retry_budget_exhausted_not_a_missing_wake() {
    let (_dir, store) = store();
    let id = action(&store, "run-be", "agent-a", "k-be");
    // A boundary 20 s out: within the class wait, beyond the action's (unrecorded) cap.
    throttled(&store, id, 0, 200, Some(20_200));
    ended(&store, id, Outcome::BudgetExhausted, 200);
    let s = snapshot(&store, id, 5_000).expect("throttled");
    assert_eq!(
        s.max_attempts, s.attempts_used,
        "no authorized attempt left"
    );
    assert_eq!(diagnosis(&s, 5_000), Diagnosis::RetryBudgetExhausted);
}

/// An action the gateway ended at its throttle on purpose (the quota is spent, the scope is
/// saturated, an operator holds it) is not missing a wake: nothing may wake it, so the advice
/// is to hand over the evidence, not to re-arm a retry the gateway decided against.
#[test]
fn an_action_the_gateway_ended_at_its_throttle_is_retry_budget_exhausted_not_a_missing_wake() {
    for (n, outcome) in [
        Outcome::QuotaExhausted,
        Outcome::ScopeSaturated,
        Outcome::Escalated,
        Outcome::ReconciliationRequired,
        Outcome::Rejected,
        Outcome::CircuitOpen,
    ]
    .into_iter()
    .enumerate()
    {
        let (_dir, store) = store();
        let id = action(&store, &format!("run-q{n}"), "agent-a", &format!("k-q{n}"));
        throttled(&store, id, 0, 200, Some(10_200));
        ended(&store, id, outcome, 200);
        // Long after the boundary and any wake grace: nothing was ever scheduled.
        let s = snapshot(&store, id, 100_000).expect("throttled");
        assert_eq!(s.scheduled_retry_at, None);
        assert_eq!(
            (s.max_attempts, diagnosis(&s, 100_000)),
            (s.attempts_used, Diagnosis::RetryBudgetExhausted),
            "{outcome:?}"
        );
    }
}

/// A write that ended `budget_exhausted` and was then reopened by its same-key resend (its
/// answer said to come back) runs again: its snapshot no longer treats it as ended with no
/// attempt left.
#[test]
fn a_reopened_action_is_diagnosed_as_running_again_not_by_the_outcome_it_set_aside() {
    let (_dir, store) = store();
    let id = action(&store, "run-ro", "agent-a", "k-ro");
    throttled(&store, id, 0, 200, Some(20_200));
    ended(&store, id, Outcome::BudgetExhausted, 200);
    let before = snapshot(&store, id, 5_000).expect("throttled");
    assert_eq!(diagnosis(&before, 5_000), Diagnosis::RetryBudgetExhausted);

    store
        .reopen_for_resend(id, Some(at(20_200)), None, at(21_000))
        .expect("reopened");
    let after = snapshot(&store, id, 21_500).expect("throttled");
    assert!(
        after.max_attempts > after.attempts_used,
        "a fresh budget for the resend: {after:?}"
    );
    assert_ne!(diagnosis(&after, 21_500), Diagnosis::RetryBudgetExhausted);
}

#[test]
fn a_cancelled_action_has_no_snapshot() {
    let (_dir, store) = store();
    let id = action(&store, "run-c", "agent-a", "k-c");
    throttled(&store, id, 0, 200, Some(10_200));
    store.schedule_retry(id, at(10_700), at(200)).expect("job");
    store
        .cancel_task("agent-a", "run-c", at(1_000))
        .expect("cancel");
    assert!(
        snapshot(&store, id, 5_000).is_none(),
        "a cancelled action is not waiting"
    );
}

#[test]
fn a_429_with_retry_after_and_a_scheduled_retry_is_waiting_backpressure() {
    let (_dir, store) = store();
    let id = action(&store, "run-1", "agent-a", "k-1");
    throttled(&store, id, 0, 200, Some(10_200));
    let job = store.schedule_retry(id, at(10_700), at(200)).expect("job");

    let s = snapshot(&store, id, 5_200).expect("throttled");
    assert_eq!(s.run_id, "run-1");
    assert_eq!(
        s.quota_scope, SCOPE,
        "the scope_updated receipt names the scope"
    );
    assert_eq!(s.throttled_at, at(200));
    assert_eq!(s.status, 429);
    assert_eq!(s.retry_after_raw.as_deref(), Some("10"), "the raw value");
    assert_eq!(s.date_header, Some(date_header(200)));
    assert_eq!(s.retry_not_before, Some(at(10_200)));
    // `backstop diagnose` without the recorded boundary computes the same one from the raw
    // values.
    let from_raw = Snapshot {
        retry_not_before: None,
        ..s.clone()
    }
    .boundary(&DiagnoseOptions::default().retry_after);
    assert_eq!(from_raw.retry_not_before(), Some(at(10_200)));
    assert_eq!(s.scheduled_retry_at, Some(at(10_700)));
    assert_eq!(s.scheduler_job_id, Some(job.0.to_string()));
    assert_eq!(s.scheduler_heartbeat_at, Some(at(0)), "the last send");
    assert_eq!(s.retry_started_at, None);
    assert_eq!((s.attempts_used, s.max_attempts), (1, 3));
    assert_eq!((s.wait_used_ms, s.wait_budget_ms), (5_000, 120_000));
    assert_eq!(s.outcome_deadline, Some(at(600_000)));
    assert_eq!(s.outcome_receipt, None);
    assert_eq!(diagnosis(&s, 5_200), Diagnosis::WaitingBackpressure);
    let report = diagnose(&s, at(5_200), &DiagnoseOptions::default());
    assert_eq!(report.retry_after_debt_ms, Some(10_000));

    // The snapshot is SPEC §10 NDJSON that `backstop diagnose` reads back unchanged.
    let line = serde_json::to_vec(&s).expect("json");
    assert_eq!(parse_snapshot(&line).expect("parses"), s);
}

#[test]
fn the_retry_started_then_finished_with_success_is_recovered() {
    let (_dir, store) = store();
    let id = action(&store, "run-1", "agent-a", "k-1");
    throttled(&store, id, 0, 200, Some(10_200));
    store.schedule_retry(id, at(10_700), at(200)).expect("job");
    let n = store.mark_attempt_sent(id, at(10_750)).expect("retry sent");
    assert_eq!(n, 2);

    let s = snapshot(&store, id, 11_000).expect("in flight");
    assert_eq!(s.retry_started_at, Some(at(10_750)));
    assert_eq!(s.retry_finished_at, None);
    assert_eq!(s.attempts_used, 2);
    assert_eq!(
        s.wait_used_ms, 10_550,
        "waited from the 429 until the retry left"
    );
    assert_eq!(s.scheduler_heartbeat_at, Some(at(10_750)));
    assert_eq!(diagnosis(&s, 11_000), Diagnosis::WaitingBackpressure);

    succeeded(&store, id, n, 11_300, true);
    let s = snapshot(&store, id, 12_000).expect("finished");
    assert_eq!(s.retry_finished_at, Some(at(11_300)));
    assert_eq!(s.retry_status, Some(200));
    assert_eq!(s.outcome_receipt.map(|r| r.matches), Some(true));
    assert_eq!(diagnosis(&s, 12_000), Diagnosis::Recovered);
}

#[test]
fn a_2xx_without_a_succeeded_outcome_is_unverified() {
    let (_dir, store) = store();
    let id = action(&store, "run-1", "agent-a", "k-1");
    throttled(&store, id, 0, 200, Some(10_200));
    store.schedule_retry(id, at(10_700), at(200)).expect("job");
    let n = store.mark_attempt_sent(id, at(10_750)).expect("retry sent");
    succeeded(&store, id, n, 11_300, false);
    let s = snapshot(&store, id, 12_000).expect("snapshot");
    assert_eq!(s.outcome_receipt, None);
    assert_eq!(diagnosis(&s, 12_000), Diagnosis::RetrySucceededUnverified);
}

#[test]
fn a_retry_sent_before_the_boundary_stays_an_early_retry_loop_after_its_own_429() {
    let (_dir, store) = store();
    let id = action(&store, "run-1", "agent-a", "k-1");
    throttled(&store, id, 0, 200, Some(10_200));
    store.schedule_retry(id, at(10_700), at(200)).expect("job");
    // Sent 7 s early, and throttled again.
    throttled(&store, id, 3_200, 3_400, Some(13_400));
    let s = snapshot(&store, id, 4_000).expect("snapshot");
    assert_eq!(
        s.throttled_at,
        at(200),
        "the first throttle, whose retry was early"
    );
    assert_eq!(s.retry_started_at, Some(at(3_200)));
    assert_eq!(diagnosis(&s, 4_000), Diagnosis::EarlyRetryLoop);
}

#[test]
fn an_unknown_boundary_is_uncertain_and_a_missing_wake_is_no_durable_wake() {
    let (_dir, store) = store();
    let id = action(&store, "run-1", "agent-a", "k-1");
    throttled(&store, id, 0, 200, None);
    let s = snapshot(&store, id, 1_000).expect("snapshot");
    assert_eq!(s.retry_not_before, None);
    assert_eq!(
        s.quota_scope, "llm",
        "no scope receipt and no policy: the provider"
    );
    assert_eq!(diagnosis(&s, 1_000), Diagnosis::NoDurableWake);
    store.schedule_retry(id, at(5_000), at(300)).expect("job");
    let s = snapshot(&store, id, 1_000).expect("snapshot");
    assert_eq!(diagnosis(&s, 1_000), Diagnosis::UncertainBoundary);
}

#[test]
fn an_action_that_was_never_throttled_has_no_snapshot() {
    let (_dir, store) = store();
    let id = action(&store, "run-1", "agent-a", "k-1");
    let n = store.mark_attempt_sent(id, at(0)).expect("sent");
    succeeded(&store, id, n, 100, true);
    assert_eq!(snapshot(&store, id, 1_000), None);
}

// ---- the routes ----

fn state(store: Arc<SqliteStore>, now: Timestamp) -> HealthState {
    HealthState {
        store,
        callers: Arc::new(|token: &str| {
            let (name, role) = match token {
                "op-token" => ("ops", Role::Operator),
                "agent-a-token" => ("agent-a", Role::Agent),
                "agent-b-token" => ("agent-b", Role::Agent),
                _ => return None,
            };
            Some(Caller {
                name: name.into(),
                role,
            })
        }),
        clock: TokioClock::anchored_at(now),
        grace: Duration::from_secs(30),
        policy: Arc::new(HealthPolicy::spec_defaults()),
    }
}

async fn get(state: &HealthState, uri: &str, token: Option<&str>) -> (StatusCode, Value) {
    let mut request = Request::get(uri);
    if let Some(token) = token {
        request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let response = router(state.clone())
        .oneshot(request.body(Body::empty()).expect("request"))
        .await
        .expect("response");
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .expect("body");
    (status, serde_json::from_slice(&bytes).expect("json body"))
}

/// run-1 (agent-a): waiting; run-2 (agent-b): its wake at 10.7 s never started.
fn two_runs() -> (tempfile::TempDir, Arc<SqliteStore>, JobId) {
    let (dir, store) = store();
    let a = action(&store, "run-1", "agent-a", "k-1");
    throttled(&store, a, 0, 200, Some(60_200));
    store.schedule_retry(a, at(60_500), at(200)).expect("job a");
    let b = action(&store, "run-2", "agent-b", "k-2");
    throttled(&store, b, 0, 200, Some(10_200));
    let job = store.schedule_retry(b, at(10_700), at(200)).expect("job b");
    (dir, store, job)
}

#[tokio::test]
async fn run_health_reports_each_throttled_action_with_its_debt() {
    let (_dir, store, _) = two_runs();
    let state = state(store, at(45_000));
    let (status, body) = get(&state, "/v1/runs/run-1/health", Some("op-token")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["run_id"], "run-1");
    assert_eq!(body["healthy"], true);
    assert_eq!(
        body["actions"][0]["report"]["diagnosis"],
        "waiting_backpressure"
    );
    assert_eq!(body["actions"][0]["snapshot"]["quota_scope"], SCOPE);
    assert_eq!(body["totals"]["retry_after_debt_ms"], 60_000);

    let (status, body) = get(&state, "/v1/runs/run-2/health", Some("op-token")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["healthy"], false);
    assert_eq!(
        body["actions"][0]["report"]["diagnosis"],
        "stuck_missed_wake"
    );
    assert_eq!(
        body["actions"][0]["report"]["action"],
        "scheduler_check_rearm"
    );
}

#[tokio::test]
async fn agents_see_only_their_own_runs() {
    let (_dir, store, _) = two_runs();
    let state = state(store, at(45_000));
    let (status, _) = get(&state, "/v1/runs/run-1/health", Some("agent-a-token")).await;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = get(&state, "/v1/runs/run-2/health", Some("agent-a-token")).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    assert_eq!(body["type"], "urn:backstop:problem:run_not_found");
    // Made as every other backstop problem: a title of its own, `sent: false`.
    assert_eq!(body["title"], "Not found", "{body}");
    assert_eq!(body["sent"], false, "{body}");
    assert_eq!(body["detail"], "no run `run-2` for this caller", "{body}");
    let (status, unknown) = get(&state, "/v1/runs/no-such-run/health", Some("op-token")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(unknown["title"], body["title"], "{unknown}");
    // agent-a's gateway view lists nothing unhealthy and counts only its own run.
    let (status, body) = get(&state, "/v1/health", Some("agent-a-token")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["runs"].as_array().map(Vec::len), Some(0), "{body}");
    assert_eq!(body["totals"]["snapshots"], 1);
}

#[tokio::test]
async fn health_routes_need_a_known_token() {
    let (_dir, store, _) = two_runs();
    let state = state(store, at(45_000));
    for uri in ["/v1/health", "/v1/runs/run-1/health"] {
        let (status, body) = get(&state, uri, None).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{uri}");
        assert_eq!(body["type"], "urn:backstop:problem:unauthorized");
        // The door's problem: its title, `sent: false`, and what was wrong with the token.
        assert_eq!(body["title"], "Missing or unknown backstop token", "{body}");
        assert_eq!(body["sent"], false, "{body}");
        assert!(
            body["detail"].as_str().unwrap().contains("missing"),
            "{body}"
        );
        let (status, body) = get(&state, uri, Some("nobody")).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{uri}");
        assert!(
            body["detail"]
                .as_str()
                .unwrap()
                .contains("matches no agent or operator"),
            "{body}"
        );
    }
}

/// Two `Authorization` headers are ambiguous credentials, refused on health routes as on every
/// route: `400 bad_header`, neither token used.
#[tokio::test]
async fn two_authorization_headers_are_a_bad_header() {
    let (_dir, store, _) = two_runs();
    let state = state(store, at(45_000));
    let request = Request::get("/v1/health")
        .header(header::AUTHORIZATION, "Bearer op-token")
        .header(header::AUTHORIZATION, "Bearer agent-a-token")
        .body(Body::empty())
        .expect("request");
    let response = router(state).oneshot(request).await.expect("response");
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .expect("body");
    let body: Value = serde_json::from_slice(&bytes).expect("json");
    assert_eq!(body["type"], "urn:backstop:problem:bad_header", "{body}");
    assert_eq!(body["header"], "Authorization", "{body}");
}

#[tokio::test]
async fn gateway_health_lists_only_unhealthy_runs_with_totals_by_scope_and_diagnosis() {
    let (_dir, store, job) = two_runs();
    let state = state(store, at(45_000));
    let (status, body) = get(&state, "/v1/health", Some("op-token")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let runs = body["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 1, "{body}");
    assert_eq!(runs[0]["run_id"], "run-2");
    assert_eq!(
        runs[0]["actions"][0]["snapshot"]["scheduler_job_id"],
        job.0.to_string()
    );
    assert_eq!(body["totals"]["retry_after_debt_ms"], 70_000);
    assert_eq!(body["totals"]["by_scope"][SCOPE]["snapshots"], 2);
    assert_eq!(
        body["totals"]["by_diagnosis"]["stuck_missed_wake"]["snapshots"],
        1
    );
    assert_eq!(
        body["totals"]["by_diagnosis"]["waiting_backpressure"]["snapshots"],
        1
    );
    assert_eq!(body["wake_grace_ms"], 30_000);
}

// ---- budgets and waits, measured at the fake provider ----

mod at_the_provider {
    use std::path::Path;

    use backstop_core::clock::Clock;
    use backstop_core::diagnose::{diagnose, DiagnoseOptions, Diagnosis, Snapshot};
    use backstop_core::policy::Policy;
    use backstop_fake_api::RouteConfig;
    use backstop_gateway::clock::TokioClock;
    use backstop_gateway::health::{derive_snapshot, Evidence, HealthPolicy, SnapshotContext};
    use backstop_gateway::server::Running;
    use backstop_store::{SqliteStore, Store};
    use jiff::{SignedDuration, Timestamp};
    use serde_json::Value;

    use crate::support::{self, client, json_of, on_route};

    const AGENT_TOKEN: &str = "agent-token-health-3c1d";
    const OPERATOR_TOKEN: &str = "operator-token-health-9e2f";

    /// The example's classes: `uncertain_write` 1 attempt / 0 s, `read` 4 / 90 s.
    fn policy_yaml(base_url: &str) -> String {
        support::policy_yaml(
            base_url,
            &format!(
                r#"request_classes:
  read: {{ max_attempts: 4, max_wait_seconds: 90, retry_statuses: [429, 503] }}
  uncertain_write: {{ max_attempts: 1, max_wait_seconds: 0, retry_statuses: [] }}
{}"#,
                support::TEST_AGENT_AND_ONCALL
            ),
            r#"    routes:
      "POST /v1/chat/completions": { class: uncertain_write, scopes: [account] }
      "GET /v1/exports/{id}": { class: read, scopes: [account] }
"#,
        )
    }

    fn env(name: &str) -> Option<String> {
        support::agent_oncall_secret(name, AGENT_TOKEN, OPERATOR_TOKEN, "sk-fake-health")
    }

    /// Both routes answer their first call `429` with `retry_after` (seconds).
    fn fake(retry_after: &str) -> backstop_fake_api::RunningFake {
        let throttle = || support::status_on_calls([1], 429, Some(retry_after));
        support::fake_with(vec![
            RouteConfig::new(
                "POST /v1/chat/completions",
                support::create("completions", "cmpl_"),
            )
            .with_fault(throttle()),
            RouteConfig::new("GET /v1/exports/{id}", support::lookup("exports"))
                .with_fault(throttle()),
        ])
    }

    /// The wall clock, read as the gateway reads it, `secs` from now.
    fn in_secs(secs: i64) -> Timestamp {
        TokioClock::system().now() + SignedDuration::from_secs(secs)
    }

    async fn start(base_url: &str, dir: &Path) -> (Running, Policy) {
        let yaml = policy_yaml(base_url);
        let policy = Policy::from_yaml_str(&yaml, "health.yaml").expect("policy");
        let gateway =
            support::start_gateway(&yaml, "health.yaml", &env, support::serve_options(dir, 17))
                .await;
        (gateway, policy)
    }

    /// The snapshot of `action` derived from the store after the gateway stopped, at `now`.
    fn snapshot_at(dir: &Path, policy: &Policy, action: i64, now: Timestamp) -> Snapshot {
        let store = SqliteStore::open_existing(dir.join("backstop.db")).expect("store");
        let mut evidence = Evidence::new();
        evidence.catch_up(&store).expect("fold");
        let trail = evidence.trail(action).expect("trail");
        let deadline = store
            .tasks_of_every_agent(&trail.task)
            .expect("tasks")
            .into_iter()
            .filter_map(|t| t.deadline)
            .min();
        let policy = HealthPolicy::from_policy(policy);
        derive_snapshot(
            trail,
            &SnapshotContext {
                deadline,
                policy: &policy,
                heartbeat_at: evidence.heartbeat_at(),
                now,
            },
        )
        .expect("a throttled action has a snapshot")
    }

    /// The run's health as `GET /v1/runs/{task}/health` answers it (one throttled action).
    async fn run_health(gateway: &Running, task: &str) -> Value {
        let (status, body) = json_of(
            client()
                .get(format!("http://{}/v1/runs/{task}/health", gateway.addr))
                .bearer_auth(OPERATOR_TOKEN)
                .send()
                .await
                .expect("health"),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["actions"].as_array().map(Vec::len), Some(1), "{body}");
        body["actions"][0].clone()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_uncertain_write_ended_at_its_429_used_no_wait_of_its_zero_budget() {
        let fake = fake("2");
        let dir = tempfile::tempdir().expect("tempdir");
        let (gateway, policy) = start(&fake.url(), dir.path()).await;
        let response = client()
            .post(format!("http://{}/fake/v1/chat/completions", gateway.addr))
            .bearer_auth(AGENT_TOKEN)
            .header("X-Backstop-Task", "chat-2")
            .header("content-type", "application/json")
            .body(r#"{"model":"m","messages":[]}"#)
            .send()
            .await
            .expect("request");
        let action = support::action_id(&response);
        let (_, answer) = json_of(response).await;
        assert_eq!(answer["total_wait_ms"], 0, "{answer}");
        assert_eq!(answer["attempts"], 1, "{answer}");

        let live = run_health(&gateway, "chat-2").await;
        assert_eq!(live["snapshot"]["wait_used_ms"], answer["total_wait_ms"]);
        assert_eq!(live["snapshot"]["wait_budget_ms"], 0, "{live}");
        gateway.shutdown().await.expect("shutdown");
        assert_eq!(
            on_route(&fake.attempts(), "POST", "/v1/chat/completions").len(),
            1,
            "one attempt reached the provider"
        );

        // However late the snapshot is taken (here well past the 2 s boundary), the action
        // ended at its 429 and waited nothing.
        let s = snapshot_at(dir.path(), &policy, action, in_secs(60));
        assert_eq!(s.status, 429);
        assert_eq!(
            s.retry_not_before
                .map(|b| b.duration_since(s.throttled_at).as_millis() > 1_000),
            Some(true),
            "the 2 s boundary is recorded: {s:?}"
        );
        assert_eq!((s.attempts_used, s.max_attempts), (1, 1));
        assert_eq!((s.wait_used_ms, s.wait_budget_ms), (0, 0));
        let report = diagnose(
            &s,
            s.throttled_at + SignedDuration::from_secs(60),
            &DiagnoseOptions::default(),
        );
        assert_eq!(report.diagnosis, Diagnosis::RetryBudgetExhausted);
        fake.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_read_capped_by_prefer_wait_ended_at_its_429_used_no_wait() {
        let fake = fake("3");
        let dir = tempfile::tempdir().expect("tempdir");
        let (gateway, policy) = start(&fake.url(), dir.path()).await;
        let response = client()
            .get(format!("http://{}/fake/v1/exports/9", gateway.addr))
            .bearer_auth(AGENT_TOKEN)
            .header("X-Backstop-Task", "research-b")
            .header("Prefer", "wait=1")
            .send()
            .await
            .expect("request");
        let action = support::action_id(&response);
        let (status, answer) = json_of(response).await;
        assert_eq!(status, 429, "{answer}");
        assert_eq!(answer["outcome"], "budget_exhausted", "{answer}");
        assert_eq!(answer["total_wait_ms"], 0, "{answer}");

        let live = run_health(&gateway, "research-b").await;
        assert_eq!(live["snapshot"]["wait_used_ms"], answer["total_wait_ms"]);
        gateway.shutdown().await.expect("shutdown");
        assert_eq!(
            on_route(&fake.attempts(), "GET", "/v1/exports/9").len(),
            1,
            "no retry reached the provider"
        );

        let later = in_secs(60);
        let s = snapshot_at(dir.path(), &policy, action, later);
        assert_eq!(s.wait_used_ms, 0, "it never waited: {s:?}");
        // The `Prefer: wait=1` cap is not recorded: the class's budget is stated.
        assert_eq!(s.wait_budget_ms, 90_000);
        // The gateway ended it: no authorized attempt is left.
        assert_eq!((s.attempts_used, s.max_attempts), (1, 1));
        let report = diagnose(&s, later, &DiagnoseOptions::default());
        assert_eq!(report.diagnosis, Diagnosis::RetryBudgetExhausted);
        fake.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_read_whose_boundary_lies_beyond_its_deadline_diagnoses_deadline_exhausted() {
        let fake = fake("30");
        let dir = tempfile::tempdir().expect("tempdir");
        let (gateway, policy) = start(&fake.url(), dir.path()).await;
        let deadline = in_secs(20);
        let response = client()
            .get(format!("http://{}/fake/v1/exports/9", gateway.addr))
            .bearer_auth(AGENT_TOKEN)
            .header("X-Backstop-Task", "research-d")
            .header("X-Backstop-Deadline", deadline.to_string())
            .send()
            .await
            .expect("request");
        let action = support::action_id(&response);
        let (_, answer) = json_of(response).await;
        assert_eq!(answer["outcome"], "deadline_exhausted", "{answer}");

        let live = run_health(&gateway, "research-d").await;
        assert_eq!(live["report"]["diagnosis"], "deadline_exhausted", "{live}");
        gateway.shutdown().await.expect("shutdown");
        assert_eq!(on_route(&fake.attempts(), "GET", "/v1/exports/9").len(), 1);

        let later = in_secs(60);
        let s = snapshot_at(dir.path(), &policy, action, later);
        assert_eq!(s.wait_used_ms, 0, "{s:?}");
        assert_eq!((s.attempts_used, s.max_attempts), (1, 4));
        let report = diagnose(&s, later, &DiagnoseOptions::default());
        assert_eq!(report.diagnosis, Diagnosis::DeadlineExhausted);
        fake.shutdown().await;
    }
}

#[test]
fn an_audit_row_that_cannot_be_decoded_is_passed_over_and_later_runs_are_still_diagnosed() {
    let (dir, store) = store();
    let damaged = action(&store, "run-damaged", "agent-a", "k-damaged");
    throttled(&store, damaged, 0, 200, Some(20_200));
    let later = action(&store, "run-later", "agent-a", "k-later");
    throttled(&store, later, 1_000, 1_200, Some(21_200));
    let path = dir.path().join("backstop.db");
    drop(store);
    // One event of the first action altered behind the store's back (not the head).
    rusqlite::Connection::open(&path)
        .expect("open raw")
        .execute(
            "UPDATE audit_events SET prev = x'0102' WHERE seq = \
             (SELECT MIN(seq) FROM audit_events WHERE action = ?1)",
            [damaged.0],
        )
        .expect("tamper");
    let store = SqliteStore::open(&path).expect("reopen");
    let mut evidence = Evidence::new();
    evidence
        .catch_up(&store)
        .expect("the fold passes over the altered row instead of failing");
    assert!(evidence.trail(later.0).is_some(), "the later run is folded");
    let s = snapshot(&store, later, 5_000).expect("the later run has a snapshot");
    assert_eq!(diagnosis(&s, 5_000), Diagnosis::NoDurableWake);
}
