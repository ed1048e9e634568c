//! Shared fixtures for the store's integration tests.
#![allow(dead_code)]

use backstop_store::{
    ActionId, Admission, NewAction, NewTask, PayloadDigest, Priority, RouteTemplate, SqliteStore,
    Store,
};
use jiff::Timestamp;

/// A fixed instant plus `ms` milliseconds (tests never read the clock).
pub fn t(ms: i64) -> Timestamp {
    Timestamp::from_millisecond(1_750_000_000_000 + ms).expect("valid test instant")
}

pub fn open_task(store: &SqliteStore, id: &str) {
    store
        .open_task(
            NewTask {
                id: id.into(),
                agent: "agent-a".into(),
                priority: Priority::Normal,
                deadline: None,
            },
            t(0),
        )
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
        idempotency_key: key.into(),
        external_reference: None,
        desired_outcome: None,
        fingerprint: None,
    }
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
