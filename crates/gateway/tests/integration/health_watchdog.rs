//! The watchdog against a gateway run whose scheduled retry is never claimed (as after a lost
//! worker): the store holds what the executor writes (attempt sent, 429 with a boundary, the
//! scope record, the retry scheduled at T) and nothing ever starts the retry.

use std::sync::Arc;
use std::time::Duration;

use backstop_core::diagnose::Diagnosis;
use backstop_gateway::clock::TokioClock;
use backstop_gateway::metrics::Metrics;
use backstop_gateway::watchdog::{spawn_watchdog, Watchdog, WatchdogConfig};
use backstop_store::{
    ActionId, Admission, AttemptResult, Boundary, Disposition, NewAction, NewTask, PayloadDigest,
    Priority, RouteTemplate, ScopeUpdate, SqliteStore, Store,
};
use jiff::{SignedDuration, Timestamp};

fn t0() -> Timestamp {
    "2026-07-26T18:40:00Z".parse().expect("t0")
}

fn at(ms: i64) -> Timestamp {
    t0() + SignedDuration::from_millis(ms)
}

fn store() -> (tempfile::TempDir, Arc<SqliteStore>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Arc::new(SqliteStore::open(dir.path().join("backstop.db")).expect("store"));
    (dir, store)
}

/// One action of `run-1`, attempt 1 sent at 0 and answered 429 at 0 with `Retry-After: 10`.
fn throttled_action(store: &SqliteStore) -> ActionId {
    store
        .open_task(
            NewTask {
                id: "run-1".into(),
                agent: "agent-a".into(),
                priority: Priority::Normal,
                deadline: Some(at(600_000)),
            },
            at(0),
        )
        .expect("task");
    let Admission::New(id) = store
        .record_action(
            NewAction {
                task_id: "run-1".into(),
                agent: "agent-a".into(),
                provider: "llm".into(),
                method: "POST".into(),
                route: RouteTemplate::try_new("/v1/chat/completions").expect("route"),
                request_class: "idempotent_write".into(),
                payload_digest: PayloadDigest::of(b"{\"prompt\":\"hi\"}"),
                target_digest: None,
                idempotency_key: "key-1".into(),
                external_reference: None,
                desired_outcome: None,
                fingerprint: None,
                request: None,
            },
            at(0),
        )
        .expect("action")
    else {
        panic!("a fresh key was taken as existing");
    };
    let n = store.mark_attempt_sent(id, at(0)).expect("sent");
    store
        .update_scope(
            ScopeUpdate {
                provider: "llm".into(),
                scope: "llm/project:a".into(),
                next_allowed_at: Some(at(10_000)),
                remaining: Some(0),
                limit: None,
                reset_at: None,
                source: "HTTP 429 Retry-After".into(),
            },
            at(0),
        )
        .expect("scope");
    store
        .record_result(
            AttemptResult {
                action: id,
                attempt: n,
                status: Some(429),
                disposition: Disposition::RateLimited,
                boundary: Some(Boundary::At(at(10_000))),
                source: Some("Retry-After".into()),
                provider_operation_id: None,
                signal_headers: Vec::new(),
                finish: None,
            },
            at(0),
        )
        .expect("result");
    id
}

fn findings(store: &SqliteStore) -> Vec<(Option<i64>, Option<String>)> {
    store
        .audit_events(0, usize::MAX)
        .expect("events")
        .into_iter()
        .filter(|e| e.kind == "watchdog_finding")
        .map(|e| (e.action, e.source))
        .collect()
}

fn counter(metrics: &Metrics, name: &str) -> u64 {
    let text = metrics.render();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} not rendered:\n{text}"))
}

fn config(escalate: bool) -> WatchdogConfig {
    WatchdogConfig {
        interval: Duration::from_secs(5),
        grace: Duration::from_secs(30),
        escalate,
        ..WatchdogConfig::default()
    }
}

#[tokio::test(start_paused = true)]
async fn a_scheduled_retry_that_never_fires_is_a_stuck_missed_wake_within_the_grace() {
    let (_dir, store) = store();
    let id = throttled_action(&store);
    // The retry is due at T = 10 s; no worker ever claims or starts it.
    let job = store.schedule_retry(id, at(10_000), at(0)).expect("job");
    let metrics = Arc::new(Metrics::new());
    let clock = TokioClock::anchored_at(t0());
    let handle = spawn_watchdog(store.clone(), clock, metrics.clone(), config(true));

    // Checks run at 0, 5, …, 40 s. At 40 s (= T + grace exactly) the wake is not yet missed.
    tokio::time::sleep(Duration::from_millis(42_000)).await;
    assert_eq!(findings(&store), [], "nothing before T + grace");
    assert_eq!(counter(&metrics, "backstop_missed_wakes_total"), 0);
    assert!(store.open_escalations().expect("escalations").is_empty());

    // The check at 45 s is the first after T + grace.
    tokio::time::sleep(Duration::from_millis(5_000)).await;
    assert_eq!(
        findings(&store),
        [(Some(id.0), Some("stuck_missed_wake".to_owned()))]
    );
    assert_eq!(counter(&metrics, "backstop_missed_wakes_total"), 1);
    let event = store
        .audit_events(0, usize::MAX)
        .expect("events")
        .into_iter()
        .find(|e| e.kind == "watchdog_finding")
        .expect("finding event");
    assert_eq!(event.job, Some(job.0));
    assert_eq!(event.at, "2026-07-26T18:40:45.000Z");
    let open = store.open_escalations().expect("escalations");
    assert_eq!(open.len(), 1);
    assert_eq!(open[0].action, id);
    assert_eq!(open[0].case_file["reason"], "side_effect_unknown");
    assert!(open[0].case_file["reason_detail"]
        .as_str()
        .is_some_and(|d| d.starts_with("stuck_missed_wake")));

    // Raised once: later checks add nothing.
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(findings(&store).len(), 1);
    assert_eq!(counter(&metrics, "backstop_missed_wakes_total"), 1);
    handle.abort();
}

#[tokio::test(start_paused = true)]
async fn the_grace_edge_is_exact_and_a_finding_is_raised_once_per_action() {
    let (_dir, store) = store();
    let id = throttled_action(&store);
    store.schedule_retry(id, at(10_000), at(0)).expect("job");
    let metrics = Arc::new(Metrics::new());
    let mut watchdog = Watchdog::new(store.clone(), metrics.clone(), config(false));
    assert_eq!(watchdog.check(at(40_000)).expect("check"), []);
    let raised = watchdog.check(at(40_001)).expect("check");
    assert_eq!(raised.len(), 1);
    assert_eq!(raised[0].diagnosis, Diagnosis::StuckMissedWake);
    assert_eq!(raised[0].run_id, "run-1");
    assert_eq!(raised[0].escalation, None, "escalate is off");
    assert_eq!(watchdog.check(at(90_000)).expect("check"), []);
    // A restarted watchdog reads the finding from the log and does not raise it again.
    let mut restarted = Watchdog::new(store.clone(), metrics.clone(), config(false));
    assert_eq!(restarted.check(at(95_000)).expect("check"), []);
    assert_eq!(findings(&store).len(), 1);
    assert_eq!(counter(&metrics, "backstop_missed_wakes_total"), 1);
    assert!(store.open_escalations().expect("escalations").is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_throttle_without_any_scheduled_retry_is_no_durable_wake_after_the_grace() {
    let (_dir, store) = store();
    let id = throttled_action(&store);
    let metrics = Arc::new(Metrics::new());
    let mut watchdog = Watchdog::new(store.clone(), metrics.clone(), config(false));
    // The executor schedules right after recording the result: not a finding yet.
    assert_eq!(watchdog.check(at(30_000)).expect("check"), []);
    let raised = watchdog.check(at(30_001)).expect("check");
    assert_eq!(raised.len(), 1);
    assert_eq!(raised[0].diagnosis, Diagnosis::NoDurableWake);
    assert_eq!(
        findings(&store),
        [(Some(id.0), Some("no_durable_wake".to_owned()))]
    );
    assert_eq!(counter(&metrics, "backstop_missed_wakes_total"), 1);
}

#[tokio::test(start_paused = true)]
async fn a_retry_sent_before_the_boundary_is_an_early_retry_with_an_account_escalation() {
    let (_dir, store) = store();
    let id = throttled_action(&store);
    store.schedule_retry(id, at(10_000), at(0)).expect("job");
    // Something sends the retry 7 s before the provider's boundary.
    store.mark_attempt_sent(id, at(3_000)).expect("early send");
    let metrics = Arc::new(Metrics::new());
    let mut watchdog = Watchdog::new(store.clone(), metrics.clone(), config(true));
    let raised = watchdog.check(at(3_500)).expect("check");
    assert_eq!(raised.len(), 1, "{raised:?}");
    assert_eq!(raised[0].diagnosis, Diagnosis::EarlyRetryLoop);
    let escalation = raised[0].escalation.expect("escalated");
    let record = store
        .escalation(escalation)
        .expect("read")
        .expect("escalation");
    assert_eq!(record.case_file["reason"], "account_configuration");
    assert_eq!(counter(&metrics, "backstop_early_retries_total"), 1);
    assert_eq!(counter(&metrics, "backstop_missed_wakes_total"), 0);
    // The escalation ended the action: nothing more is watched or raised.
    assert_eq!(watchdog.check(at(60_000)).expect("check"), []);
}

#[tokio::test(start_paused = true)]
async fn a_healthy_wait_and_a_recovered_retry_raise_nothing() {
    let (_dir, store) = store();
    let id = throttled_action(&store);
    store.schedule_retry(id, at(10_000), at(0)).expect("job");
    let metrics = Arc::new(Metrics::new());
    let mut watchdog = Watchdog::new(store.clone(), metrics.clone(), config(false));
    assert_eq!(watchdog.check(at(5_000)).expect("check"), []);
    let n = store.mark_attempt_sent(id, at(10_100)).expect("retry");
    assert_eq!(watchdog.check(at(60_000)).expect("check"), [], "in flight");
    store
        .record_result(
            AttemptResult {
                action: id,
                attempt: n,
                status: Some(200),
                disposition: Disposition::Success,
                boundary: None,
                source: None,
                provider_operation_id: None,
                signal_headers: Vec::new(),
                finish: Some(backstop_store::Finish {
                    outcome: backstop_store::Outcome::Succeeded,
                    context: serde_json::json!({}),
                    response: None,
                }),
            },
            at(10_300),
        )
        .expect("success");
    assert_eq!(watchdog.check(at(120_000)).expect("check"), []);
    assert_eq!(findings(&store), []);
}
