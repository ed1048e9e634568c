//! Store operations for writes that never duplicate: one action's own retry claimed by job id,
//! the scheduled retries re-armed after a restart, and audited reconciliation lookups.

use backstop_store::{SqliteStore, Store};

use crate::common::{open_task, record, t};

#[test]
fn claim_job_claims_only_that_job_once_and_audits_retry_started() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("s.db")).expect("open");
    open_task(&store, "task-1");
    let a = record(&store, "task-1", "key-a", b"a");
    let b = record(&store, "task-1", "key-b", b"b");
    let job_a = store.schedule_retry(a, t(1_000), t(1)).expect("schedule a");
    let job_b = store.schedule_retry(b, t(500), t(1)).expect("schedule b");

    let claimed = store.claim_job(job_a, t(1_000), "w1").expect("claim a");
    let claimed = claimed.expect("job a is claimable");
    assert_eq!(
        (claimed.job, claimed.action, claimed.due_at),
        (job_a, a, t(1_000))
    );
    assert_eq!(store.claim_job(job_a, t(1_001), "w2").expect("again"), None);

    // Only job b is left to re-arm.
    let left = store.scheduled_retries().expect("scheduled");
    assert_eq!(left.len(), 1);
    assert_eq!((left[0].job, left[0].action), (job_b, b));

    let events = store.audit_events(0, 1_000).expect("events");
    let started: Vec<_> = events
        .iter()
        .filter(|e| e.kind == "retry_started")
        .collect();
    assert_eq!(started.len(), 1);
    assert_eq!(started[0].action, Some(a.0));
    assert_eq!(started[0].job, Some(job_a.0));
}

#[test]
fn a_cancelled_task_has_nothing_to_claim_or_re_arm() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("s.db")).expect("open");
    open_task(&store, "task-1");
    let a = record(&store, "task-1", "key-a", b"a");
    let job = store.schedule_retry(a, t(1_000), t(1)).expect("schedule");
    store
        .cancel_task("agent-a", "task-1", t(2))
        .expect("cancel");
    assert_eq!(store.claim_job(job, t(1_000), "w1").expect("claim"), None);
    assert!(store.scheduled_retries().expect("scheduled").is_empty());
}

#[test]
fn reconciliation_lookup_is_audited_with_template_status_and_verdict() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("s.db")).expect("open");
    open_task(&store, "task-1");
    let a = record(&store, "task-1", "key-a", b"a");
    store
        .record_reconciliation_lookup(
            a,
            "GET /v1/transfers?idempotency_key={key}",
            Some(200),
            "found",
            t(5),
        )
        .expect("audit lookup");
    let events = store.audit_events(0, 1_000).expect("events");
    let lookup = events
        .iter()
        .find(|e| e.kind == "reconciliation_lookup")
        .expect("lookup event");
    assert_eq!(lookup.action, Some(a.0));
    assert_eq!(lookup.status, Some(200));
    assert_eq!(lookup.disposition.as_deref(), Some("found"));
    assert_eq!(lookup.idempotency_key.as_deref(), Some("key-a"));
    assert_eq!(
        lookup.source.as_deref(),
        Some("GET /v1/transfers?idempotency_key={key}")
    );
    assert!(store
        .record_reconciliation_lookup(
            backstop_store::ActionId(999),
            "GET /x",
            None,
            "inconclusive",
            t(6)
        )
        .is_err());
}
