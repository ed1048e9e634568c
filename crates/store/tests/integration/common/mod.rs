//! Shared fixtures for the store's integration tests.

use std::sync::mpsc;
use std::time::Duration;

use backstop_store::{
    ActionId, Admission, AttemptResult, Completion, Disposition, Finish, NewAction, NewTask,
    Outcome, PayloadDigest, Priority, RouteTemplate, SqliteStore, Store, StoreError,
};
use jiff::Timestamp;

/// A fixed instant plus `ms` milliseconds (tests never read the clock).
pub fn t(ms: i64) -> Timestamp {
    Timestamp::from_millisecond(1_750_000_000_000 + ms).expect("valid test instant")
}

/// A task `id` of `agent` at normal priority, without a deadline.
pub fn new_task(id: &str, agent: &str) -> NewTask {
    NewTask {
        id: id.into(),
        agent: agent.into(),
        priority: Priority::Normal,
        deadline: None,
    }
}

pub fn open_task(store: &SqliteStore, id: &str) {
    store
        .open_task(new_task(id, "agent-a"), t(0))
        .expect("open task");
}

pub fn new_action(task: &str, key: &str, payload: &[u8]) -> NewAction {
    NewAction {
        task_id: task.into(),
        agent: "agent-a".into(),
        provider: "billing-api".into(),
        method: "POST".into(),
        route: RouteTemplate::try_new("/v1/transfers").expect("template"),
        request_class: "idempotent_write".into(),
        payload_digest: PayloadDigest::of(payload),
        target_digest: None,
        idempotency_key: key.into(),
        external_reference: None,
        desired_outcome: None,
        fingerprint: None,
        request: None,
    }
}

/// A read of `agent`'s `task`: `GET /v1/balance` of `billing-api` in the `read` class, with
/// no payload, no idempotency key, desired outcome or fingerprint.
pub fn read_action_of(task: &str, agent: &str) -> NewAction {
    NewAction {
        task_id: task.into(),
        agent: agent.into(),
        provider: "billing-api".into(),
        method: "GET".into(),
        route: RouteTemplate::try_new("/v1/balance").expect("template"),
        request_class: "read".into(),
        payload_digest: PayloadDigest::of(b""),
        target_digest: None,
        idempotency_key: String::new(),
        external_reference: None,
        desired_outcome: None,
        fingerprint: None,
        request: None,
    }
}

/// Attempt `attempt` of `action` answered 200, finishing it `succeeded` (empty context, no
/// response kept, no boundary or signal headers).
pub fn success(action: ActionId, attempt: u32) -> AttemptResult {
    AttemptResult {
        action,
        attempt,
        status: Some(200),
        disposition: Disposition::Success,
        boundary: None,
        source: None,
        provider_operation_id: None,
        signal_headers: Vec::new(),
        finish: Some(Finish {
            outcome: Outcome::Succeeded,
            context: serde_json::json!({}),
            response: None,
        }),
    }
}

/// A completion that hands its result to the returned receiver.
pub fn completion<T: Send + 'static>() -> (Completion<T>, mpsc::Receiver<Result<T, StoreError>>) {
    let (tx, rx) = mpsc::channel();
    (
        Box::new(move |r| {
            let _ = tx.send(r);
        }),
        rx,
    )
}

/// What a completion received, waiting at most 10 s for it to be called.
pub fn wait<T>(rx: &mpsc::Receiver<Result<T, StoreError>>) -> Result<T, StoreError> {
    rx.recv_timeout(Duration::from_secs(10))
        .expect("the completion was called")
}

/// The audit event kinds, in order, of an action recorded in a task it opens and finished by
/// its first attempt.
pub const ONE_ATTEMPT_EVENTS: [&str; 5] = [
    "task_opened",
    "action_requested",
    "action_sent",
    "action_result",
    "action_finished",
];

/// The kinds of every audit event in the store, in order.
pub fn kinds(store: &SqliteStore) -> Vec<String> {
    store
        .audit_events(0, usize::MAX)
        .expect("events")
        .into_iter()
        .map(|e| e.kind)
        .collect()
}

pub fn record(store: &SqliteStore, task: &str, key: &str, payload: &[u8]) -> ActionId {
    match store
        .record_action(new_action(task, key, payload), t(1))
        .expect("record")
    {
        Admission::New(id) => id,
        Admission::Existing(a) => panic!("key {key} unexpectedly existed as {:?}", a.id),
    }
}

/// A store with a few actions sent: returns the store and the number of audit events.
pub fn populated(dir: &std::path::Path, actions: usize) -> (SqliteStore, std::path::PathBuf) {
    let path = dir.join("backstop.db");
    let store = SqliteStore::open(&path).expect("open store");
    open_task(&store, "task-1");
    for i in 0..actions {
        let id = record(
            &store,
            "task-1",
            &format!("key-{i}"),
            format!("payload {i}").as_bytes(),
        );
        store.mark_attempt_sent(id, t(10 + i as i64)).expect("sent");
    }
    (store, path)
}
