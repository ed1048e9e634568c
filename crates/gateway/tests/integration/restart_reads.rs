//! A read cut off by a crash (its attempt recorded as sent, no result) is closed at the next
//! start as what it is: `cancelled` because the gateway restarted and its caller is gone —
//! not `budget_exhausted`, whose budget it never used up. Nothing is sent again; sends are
//! counted at the scripted transport.

use backstop_gateway::engine::RESTARTED_DURING_READ;
use backstop_store::{
    ActionId, Admission, AttemptState, Disposition, NewAction, NewTask, Outcome, PayloadDigest,
    Priority, RouteTemplate, Store,
};

use crate::engine_support::{until, Harness};

/// Records a read of `/v1/items/7` in task `t` and its first attempt as sent, as a gateway
/// that crashed before the answer would have left the store.
fn interrupted_read(h: &Harness) -> ActionId {
    let at = h.t0;
    h.store
        .open_task(
            NewTask {
                id: "t".into(),
                agent: "agent-a".into(),
                priority: Priority::Normal,
                deadline: None,
            },
            at,
        )
        .unwrap();
    let admission = h
        .store
        .record_action(
            NewAction {
                task_id: "t".into(),
                agent: "agent-a".into(),
                provider: "billing".into(),
                method: "GET".into(),
                route: RouteTemplate::try_new("/v1/items/{id}").unwrap(),
                request_class: "read".into(),
                payload_digest: PayloadDigest::of(b""),
                target_digest: Some(PayloadDigest::of(b"/v1/items/7")),
                idempotency_key: String::new(),
                external_reference: None,
                desired_outcome: None,
                fingerprint: None,
            },
            at,
        )
        .unwrap();
    let Admission::New(id) = admission else {
        panic!("a read is always a new action")
    };
    assert_eq!(h.store.mark_attempt_sent(id, at).unwrap(), 1);
    id
}

#[tokio::test(start_paused = true)]
async fn a_read_cut_off_by_a_crash_is_cancelled_at_restart_and_not_sent_again() {
    let h = Harness::new();
    let id = interrupted_read(&h);
    // The next run over the same store finds the unfinished attempt.
    let restarted = h.restarted(7);
    let stored = || h.store.action(id).unwrap().unwrap();
    assert!(
        until(|| stored().outcome.is_some()).await,
        "restart recovery ended the read"
    );
    let record = stored();
    assert_eq!(record.outcome, Some(Outcome::Cancelled));
    let context = record.outcome_context.unwrap();
    assert_eq!(context["detail"], RESTARTED_DURING_READ, "{context}");
    assert_eq!(context["sent"], true, "{context}");
    assert_eq!(context["attempts"], 1, "{context}");
    let attempts = h.store.attempts(id).unwrap();
    assert_eq!(attempts.len(), 1, "{attempts:?}");
    assert_eq!(attempts[0].state, AttemptState::Finished);
    assert_eq!(attempts[0].disposition, Some(Disposition::Uncertain));
    assert!(
        h.transport.sent().is_empty(),
        "nothing is sent for the gone caller: {:?}",
        h.transport.sent()
    );
    restarted.shutdown().await;
}
