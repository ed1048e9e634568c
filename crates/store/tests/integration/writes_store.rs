//! Store operations for writes that never duplicate: one action's own retry claimed by job id,
//! the scheduled retries re-armed after a restart, the actions left between two attempts, and
//! audited reconciliation lookups.

use backstop_store::{Disposition, SqliteStore, Store};

use crate::common::{open_task, record, success, t};

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

#[test]
fn actions_between_attempts_lists_an_attempted_action_without_a_waiting_retry() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("s.db")).expect("open");
    open_task(&store, "task-1");
    let unavailable = |action, attempt| {
        let mut result = success(action, attempt);
        result.status = Some(503);
        result.disposition = Disposition::Unavailable;
        result.finish = None;
        result
    };
    // Its result is recorded, its retry never scheduled: listed.
    let stalled = record(&store, "task-1", "key-a", b"a");
    store.mark_attempt_sent(stalled, t(2)).expect("sent");
    store
        .record_result(unavailable(stalled, 1), t(3))
        .expect("result");
    // Its retry waits: not listed.
    let waiting = record(&store, "task-1", "key-b", b"b");
    store.mark_attempt_sent(waiting, t(2)).expect("sent");
    store
        .record_result(unavailable(waiting, 1), t(3))
        .expect("result");
    store
        .schedule_retry(waiting, t(1_000), t(3))
        .expect("schedule");
    // Its retry was sent (the attempt took the job) and answered: listed again.
    let retried = record(&store, "task-1", "key-c", b"c");
    store.mark_attempt_sent(retried, t(2)).expect("sent");
    store
        .record_result(unavailable(retried, 1), t(3))
        .expect("result");
    store
        .schedule_retry(retried, t(10), t(3))
        .expect("schedule");
    store.mark_attempt_sent(retried, t(10)).expect("retry sent");
    store
        .record_result(unavailable(retried, 2), t(11))
        .expect("result");
    // In flight, finished, never sent: not listed.
    let in_flight = record(&store, "task-1", "key-d", b"d");
    store.mark_attempt_sent(in_flight, t(2)).expect("sent");
    let finished = record(&store, "task-1", "key-e", b"e");
    store.mark_attempt_sent(finished, t(2)).expect("sent");
    store
        .record_result(success(finished, 1), t(3))
        .expect("result");
    record(&store, "task-1", "key-f", b"f");

    assert_eq!(
        store.actions_between_attempts().expect("list"),
        vec![stalled, retried]
    );
}

#[test]
fn actions_sharing_a_reference_are_those_of_the_same_provider_except_the_one_asking() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("s.db")).expect("open");
    open_task(&store, "task-1");
    let with = |key: &str, provider: &str, reference: Option<&str>| {
        let mut action = crate::common::new_action("task-1", key, key.as_bytes());
        action.provider = provider.into();
        action.external_reference = reference.map(str::to_owned);
        match store.record_action(action, t(1)).expect("record") {
            backstop_store::Admission::New(id) => id,
            backstop_store::Admission::Existing(a) => panic!("{key} existed as {:?}", a.id),
        }
    };
    let a = with("key-a", "billing-api", Some("ref-1"));
    let b = with("key-b", "billing-api", Some("ref-1"));
    let c = with("key-c", "billing-api", Some("ref-1"));
    with("key-d", "mail-api", Some("ref-1"));
    with("key-e", "billing-api", Some("ref-2"));
    with("key-f", "billing-api", None);
    let shared = |except| {
        store
            .actions_sharing_reference("billing-api", "ref-1", except)
            .expect("query")
    };
    assert_eq!(shared(a), vec![b, c]);
    assert_eq!(shared(b), vec![a, c]);
    let alone = with("key-g", "billing-api", Some("ref-3"));
    assert!(store
        .actions_sharing_reference("billing-api", "ref-3", alone)
        .expect("query")
        .is_empty());
}
