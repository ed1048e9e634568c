//! A write's kept request (SPEC §6, §12): stored with the action before its first send, gone
//! when the action ends, never in the audit chain; and the start-up scans that find every
//! unfinished write an earlier run left behind.

use backstop_store::{
    audit::Verdict, ActionState, AttemptResult, Disposition, Finish, KeptRequest, Outcome,
    SqliteStore, Store, StoreError, ACTION_REOPENED, RESUMED_AFTER_RESTART,
};

use crate::common::{new_action, open_task, success, t};

fn store() -> (tempfile::TempDir, SqliteStore) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("s.db")).expect("open");
    (dir, store)
}

fn request(body: &str) -> KeptRequest {
    KeptRequest {
        method: "POST".into(),
        url: "http://127.0.0.1:9/v1/transfers".into(),
        headers: vec![
            ("content-type".into(), "application/json".into()),
            ("idempotency-key".into(), "key-1".into()),
        ],
        body: body.as_bytes().to_vec(),
    }
}

/// A write of `task-1` under `key` recorded with its request kept.
fn kept_write(store: &SqliteStore, key: &str, body: &str) -> backstop_store::ActionId {
    let mut action = new_action("task-1", key, body.as_bytes());
    action.request = Some(request(body));
    match store.record_action(action, t(1)).expect("recorded") {
        backstop_store::Admission::New(id) => id,
        other => panic!("expected a new action, got {other:?}"),
    }
}

fn answered_503(action: backstop_store::ActionId, attempt: u32) -> AttemptResult {
    AttemptResult {
        action,
        attempt,
        status: Some(503),
        disposition: Disposition::Unavailable,
        boundary: None,
        source: None,
        provider_operation_id: None,
        signal_headers: Vec::new(),
        finish: None,
    }
}

#[test]
fn a_write_keeps_its_request_until_it_ends_and_the_audit_log_never_holds_it() {
    let (dir, store) = store();
    open_task(&store, "task-1");
    let body = r#"{"amount":4217,"memo":"kept-body-marker"}"#;
    let a = kept_write(&store, "key-1", body);
    assert_eq!(store.kept_request(a).expect("read"), Some(request(body)));
    let n = store.mark_attempt_sent(a, t(2)).expect("sent");
    assert!(
        store.kept_request(a).expect("read").is_some(),
        "kept while the write has not ended"
    );
    store.record_result(success(a, n), t(3)).expect("result");
    assert_eq!(
        store.kept_request(a).expect("read"),
        None,
        "gone with the action's end"
    );
    store.flush().expect("flush");
    drop(store);
    // Neither the audit chain nor any other table holds the body once the write ended.
    let raw = rusqlite::Connection::open(dir.path().join("s.db")).expect("raw");
    let left: i64 = raw
        .query_row("SELECT COUNT(*) FROM kept_requests", [], |r| r.get(0))
        .expect("count");
    assert_eq!(left, 0);
    let in_audit: i64 = raw
        .query_row(
            "SELECT COUNT(*) FROM audit_events WHERE CAST(audit_events.source AS TEXT) LIKE '%kept-body-marker%' \
             OR CAST(signal_headers AS TEXT) LIKE '%kept-body-marker%'",
            [],
            |r| r.get(0),
        )
        .expect("count");
    assert_eq!(in_audit, 0);
}

#[test]
fn keep_request_replaces_the_kept_one_and_keeps_nothing_for_an_ended_action() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    let a = crate::common::record(&store, "task-1", "key-1", b"{}");
    assert_eq!(store.kept_request(a).expect("read"), None);
    store.keep_request(a, request("{}")).expect("kept");
    store.keep_request(a, request("{\"v\":2}")).expect("kept");
    assert_eq!(
        store.kept_request(a).expect("read"),
        Some(request("{\"v\":2}"))
    );
    let n = store.mark_attempt_sent(a, t(2)).expect("sent");
    store.record_result(success(a, n), t(3)).expect("result");
    store
        .keep_request(a, request("{}"))
        .expect("nothing to keep");
    assert_eq!(store.kept_request(a).expect("read"), None);
    assert!(matches!(
        store.keep_request(backstop_store::ActionId(999), request("{}")),
        Err(StoreError::NotFound { .. })
    ));
}

#[test]
fn resume_after_restart_reopens_a_write_between_attempts_and_claims_its_retry() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    let a = kept_write(&store, "key-1", "{}");
    let n = store.mark_attempt_sent(a, t(2)).expect("sent");
    store
        .record_result(answered_503(a, n), t(3))
        .expect("result");
    store.schedule_retry(a, t(10), t(3)).expect("scheduled");
    store.resume_after_restart(a, t(4)).expect("resumed");
    let record = store.action(a).expect("read").expect("exists");
    assert_eq!(record.state, ActionState::Reopened);
    assert!(
        store.scheduled_retries().expect("read").is_empty(),
        "the resume took its retry"
    );
    assert!(store.kept_request(a).expect("read").is_some());
    let events = store.audit_events(0, 100).expect("events");
    let reopened = events
        .iter()
        .find(|e| e.kind == ACTION_REOPENED)
        .expect("audited");
    assert_eq!(reopened.source.as_deref(), Some(RESUMED_AFTER_RESTART));
    assert_eq!(reopened.idempotency_key.as_deref(), Some("key-1"));
    assert!(matches!(
        store.verify_audit(None).expect("verify"),
        Verdict::Intact { .. }
    ));
}

#[test]
fn resume_after_restart_refuses_an_attempt_out_an_ended_write_and_a_cancelled_task() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    let out = kept_write(&store, "key-out", "{}");
    store.mark_attempt_sent(out, t(2)).expect("sent");
    assert!(matches!(
        store.resume_after_restart(out, t(3)),
        Err(StoreError::InvalidTransition { .. })
    ));
    let ended = kept_write(&store, "key-ended", "{}");
    let n = store.mark_attempt_sent(ended, t(2)).expect("sent");
    store.record_result(success(ended, n), t(3)).expect("ended");
    assert!(matches!(
        store.resume_after_restart(ended, t(4)),
        Err(StoreError::InvalidTransition { .. })
    ));
    let waiting = kept_write(&store, "key-waiting", "{}");
    let n = store.mark_attempt_sent(waiting, t(2)).expect("sent");
    store
        .record_result(answered_503(waiting, n), t(3))
        .expect("result");
    store
        .cancel_task("agent-a", "task-1", t(4))
        .expect("cancelled");
    assert!(matches!(
        store.resume_after_restart(waiting, t(5)),
        Err(StoreError::InvalidTransition { .. })
    ));
}

#[test]
fn a_retry_claimed_by_a_run_that_is_gone_is_listed_again_at_the_next_start() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    let a = kept_write(&store, "key-1", "{}");
    let n = store.mark_attempt_sent(a, t(2)).expect("sent");
    store
        .record_result(
            AttemptResult {
                disposition: Disposition::Uncertain,
                status: None,
                ..answered_503(a, n)
            },
            t(3),
        )
        .expect("uncertain");
    let job = store.schedule_retry(a, t(10), t(3)).expect("scheduled");
    assert_eq!(
        store.action(a).expect("read").expect("exists").state,
        ActionState::Waiting
    );
    // An earlier start claimed the retry to reconcile the write, then stopped before recording
    // how: nothing else lists the write, so this scan must.
    store
        .claim_job(job, t(11), "backstop-restart")
        .expect("claim")
        .expect("claimed");
    assert!(store.scheduled_retries().expect("read").is_empty());
    assert_eq!(store.actions_between_attempts().expect("scan"), vec![a]);
    // A finished action is never listed.
    store
        .finish_action(
            a,
            Finish {
                outcome: Outcome::Escalated,
                context: serde_json::json!({}),
                response: None,
            },
            t(12),
        )
        .expect("finished");
    assert!(store.actions_between_attempts().expect("scan").is_empty());
    assert_eq!(store.kept_request(a).expect("read"), None);
}
