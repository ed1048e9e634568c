//! Task ids are namespaced per agent: two agents may use the same task id independently.

use backstop_store::{
    Admission, NewAction, NewTask, Outcome, PayloadDigest, Priority, RouteTemplate, SqliteStore,
    Store,
};

use crate::common::t;

fn task(agent: &str, priority: Priority) -> NewTask {
    NewTask {
        id: "shared-1".into(),
        agent: agent.into(),
        priority,
        deadline: None,
    }
}

fn write(agent: &str, key: &str) -> NewAction {
    NewAction {
        task_id: "shared-1".into(),
        agent: agent.into(),
        provider: "billing-api".into(),
        method: "POST".into(),
        route: RouteTemplate::try_new("/v1/transfers").expect("template"),
        request_class: "idempotent_write".into(),
        payload_digest: PayloadDigest::of(key.as_bytes()),
        target_digest: None,
        idempotency_key: key.into(),
        external_reference: None,
        desired_outcome: None,
        fingerprint: None,
        request: None,
    }
}

fn record(store: &SqliteStore, agent: &str, key: &str) -> backstop_store::ActionId {
    match store
        .record_action(write(agent, key), t(1))
        .expect("record")
    {
        Admission::New(id) => id,
        Admission::Existing(r) => panic!("unexpected replay of {}", r.id),
    }
}

#[test]
fn two_agents_open_the_same_task_id_and_cancelling_one_leaves_the_other_untouched() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("s.db")).expect("open");
    store
        .open_task(task("alice", Priority::Interactive), t(0))
        .expect("alice opens shared-1");
    store
        .open_task(task("bob", Priority::Background), t(0))
        .expect("bob opens his own shared-1");

    let alice = store
        .task("alice", "shared-1")
        .expect("read")
        .expect("alice");
    let bob = store.task("bob", "shared-1").expect("read").expect("bob");
    assert_eq!(
        (alice.agent.as_str(), alice.priority),
        ("alice", Priority::Interactive)
    );
    assert_eq!(
        (bob.agent.as_str(), bob.priority),
        ("bob", Priority::Background)
    );
    assert_eq!(store.task("carol", "shared-1").expect("read"), None);
    assert_eq!(
        store.tasks_of_every_agent("shared-1").expect("read"),
        vec![alice.clone(), bob.clone()]
    );

    let a = record(&store, "alice", "k-a");
    let b = record(&store, "bob", "k-b");
    let a_job = store
        .schedule_retry(a, t(1_000), t(2))
        .expect("alice retry");

    let report = store.cancel_task("bob", "shared-1", t(3)).expect("cancel");
    assert_eq!(report.actions_cancelled, 1);
    assert_eq!(report.retries_dropped, 0);

    assert!(store
        .task("bob", "shared-1")
        .expect("read")
        .expect("bob")
        .cancelled_at
        .is_some());
    assert_eq!(
        store.task("alice", "shared-1").expect("read"),
        Some(alice),
        "alice's task is untouched"
    );
    assert_eq!(
        store.action(b).expect("read").expect("b").outcome,
        Some(Outcome::Cancelled)
    );
    let a_record = store.action(a).expect("read").expect("a");
    assert_eq!(a_record.outcome, None, "alice's action runs on");
    assert_eq!(
        store
            .scheduled_retries()
            .expect("read")
            .iter()
            .map(|r| r.job)
            .collect::<Vec<_>>(),
        [a_job],
        "alice's retry still waits"
    );
    store.mark_attempt_sent(a, t(4)).expect("alice still sends");
    assert!(
        store.mark_attempt_sent(b, t(4)).is_err(),
        "bob's never does"
    );
    assert!(store.record_action(write("bob", "k-b2"), t(5)).is_err());
    record(&store, "alice", "k-a2");
}

#[test]
fn cancelling_an_id_the_agent_never_opened_is_not_found_even_if_another_agent_did() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("s.db")).expect("open");
    store
        .open_task(task("alice", Priority::Normal), t(0))
        .expect("open");
    let err = store
        .cancel_task("bob", "shared-1", t(1))
        .expect_err("bob has no shared-1");
    assert!(
        matches!(err, backstop_store::StoreError::NotFound { .. }),
        "{err}"
    );
    assert!(!err.to_string().contains("alice"), "{err}");
    assert!(store
        .task("alice", "shared-1")
        .expect("read")
        .expect("alice")
        .cancelled_at
        .is_none());
    let err = store
        .record_action(write("bob", "k-b"), t(2))
        .expect_err("bob has no shared-1 to record under");
    assert!(!err.to_string().contains("alice"), "{err}");
}

#[test]
fn a_write_is_read_by_its_agent_and_key_and_reading_writes_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("s.db")).expect("open");
    for agent in ["alice", "bob"] {
        store
            .open_task(task(agent, Priority::Normal), t(0))
            .expect("open");
    }
    let alice = record(&store, "alice", "pay-1");
    let bob = record(&store, "bob", "pay-1");
    let events = store.audit_events(0, 100).expect("audit").len();

    // Keys are per agent: the same key names each agent's own write.
    let of = |agent: &str, key: &str| store.action_by_key(agent, key).expect("read").map(|a| a.id);
    assert_eq!(of("alice", "pay-1"), Some(alice));
    assert_eq!(of("bob", "pay-1"), Some(bob));
    assert_eq!(of("carol", "pay-1"), None);
    assert_eq!(of("alice", "pay-2"), None);
    // A read is stored without a key: the empty key names no action.
    store
        .record_action(
            NewAction {
                idempotency_key: String::new(),
                method: "GET".into(),
                request_class: "read".into(),
                ..write("alice", "")
            },
            t(2),
        )
        .expect("a read");
    assert_eq!(of("alice", ""), None);
    assert_eq!(
        store.audit_events(0, 100).expect("audit").len(),
        events + 1,
        "only the read's request was recorded; reading by key wrote nothing"
    );
}
