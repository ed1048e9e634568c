//! Every audit event about an agent's work names the agent (store schema 10): task ids are the
//! agent's own, so two agents' `shared-1` are told apart in the log, in its export and in
//! what `audit verify` checks. Events about no agent's work (`scope_updated`) name none.

use backstop_store::audit::{parse_export, AuditEvent, Verdict};
use backstop_store::{
    Admission, AuditReader, NewTask, Priority, RouteTemplate, SqliteStore, Store,
};

use crate::common::{completion, read_action_of, success, t, wait};

fn task(agent: &str) -> NewTask {
    NewTask {
        id: "shared-1".into(),
        agent: agent.into(),
        priority: Priority::Normal,
        deadline: None,
    }
}

/// The agent each event of the log names, as `(kind, agent)`.
fn agents(events: &[AuditEvent]) -> Vec<(String, Option<String>)> {
    events
        .iter()
        .map(|e| (e.kind.clone(), e.agent.clone()))
        .collect()
}

#[test]
fn two_agents_with_one_task_id_are_told_apart_in_every_event_and_in_the_export() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("s.db");
    {
        let store = SqliteStore::open(&path).expect("open");
        // alice: a write sent and answered (the generic path).
        store.open_task(task("alice"), t(0)).expect("alice's task");
        let write = backstop_store::NewAction {
            idempotency_key: "k-1".into(),
            method: "POST".into(),
            request_class: "idempotent_write".into(),
            ..read_action_of("shared-1", "alice")
        };
        let Admission::New(a) = store.record_action(write, t(1)).expect("record") else {
            panic!("a new key is a new action");
        };
        store.mark_attempt_sent(a, t(2)).expect("sent");
        store.record_result(success(a, 1), t(3)).expect("result");
        // bob: a read answered at once (the one-operation path), then his task cancelled and a
        // circuit opened for it.
        let (recorded, recorded_rx) = completion();
        let b = store
            .record_read(
                task("bob"),
                read_action_of("shared-1", "bob"),
                t(4),
                recorded,
            )
            .expect("read");
        let (sent, sent_rx) = completion();
        store.submit_attempt_sent(b, t(5), sent);
        let (done, done_rx) = completion();
        store.submit_result(success(b, 1), t(6), done);
        wait(&recorded_rx).expect("recorded");
        wait(&sent_rx).expect("sent");
        wait(&done_rx).expect("answered");
        store
            .record_circuit_opened(
                "bob",
                "shared-1",
                "billing-api",
                "GET",
                &RouteTemplate::try_new("/v1/balance").expect("template"),
                t(7),
            )
            .expect("circuit");
        store.cancel_task("bob", "shared-1", t(8)).expect("cancel");
        let expected: Vec<(String, Option<String>)> = [
            ("task_opened", "alice"),
            ("action_requested", "alice"),
            ("action_sent", "alice"),
            ("action_result", "alice"),
            ("action_finished", "alice"),
            ("task_opened", "bob"),
            ("action_requested", "bob"),
            ("action_sent", "bob"),
            ("action_result", "bob"),
            ("action_finished", "bob"),
            ("circuit_opened", "bob"),
            ("cancelled", "bob"),
        ]
        .into_iter()
        .map(|(kind, agent)| (kind.to_owned(), Some(agent.to_owned())))
        .collect();
        assert_eq!(
            agents(&store.audit_events(0, 100).expect("events")),
            expected
        );
    }
    // The export carries the agent, and the hash covers it: the chain verifies as written and
    // breaks where an agent is changed.
    let reader = AuditReader::open(&path).expect("reader");
    assert!(matches!(
        reader.verify(None).expect("verify"),
        Verdict::Intact { count: 12, .. }
    ));
    let mut export = Vec::new();
    reader.export(0, &mut export).expect("export");
    let text = String::from_utf8(export).expect("utf-8");
    let line = text.lines().nth(6).expect("bob's action_requested");
    assert!(line.contains(r#""agent":"bob""#), "{line}");
    let events = parse_export("export", &text).expect("parse");
    assert_eq!(events[6].agent.as_deref(), Some("bob"));
    let mut forged = events[6].clone();
    forged.agent = Some("alice".into());
    assert_ne!(forged.compute_hash(), events[6].hash);
}
