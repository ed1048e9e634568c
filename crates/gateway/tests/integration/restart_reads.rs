//! A read cut off by a crash (its attempt recorded as sent, no result) is closed at the next
//! start as what it is: `cancelled` because the gateway restarted and its caller is gone —
//! not `budget_exhausted`, whose budget it never used up. Nothing is sent again; sends are
//! counted at the scripted transport.

use backstop_gateway::engine::{RESTARTED_BEFORE_READ_SENT, RESTARTED_DURING_READ};
use backstop_store::{ActionId, AttemptState, Disposition, Outcome, Store};

use crate::engine_support::{until, Harness};

/// Records a read of `/v1/items/7` in task `t` and its first attempt as sent, as a gateway
/// that crashed before the answer would have left the store.
fn interrupted_read(h: &Harness) -> ActionId {
    let id = h.recorded_action("GET", "/v1/items/{id}", "read", "");
    assert_eq!(h.store.mark_attempt_sent(id, h.t0).unwrap(), 1);
    id
}

#[tokio::test(start_paused = true)]
async fn a_read_recorded_but_never_sent_before_a_stop_is_cancelled_at_restart() {
    let h = Harness::new();
    // The stop answered its caller `503 shutting_down` while it waited for its first attempt.
    let read = h.recorded_action("GET", "/v1/items/{id}", "read", "");
    // A write in the same state waits for its agent's resend under its key instead.
    let write = h.recorded_action("POST", "/v1/transfers", "idempotent_write", "k-wait");
    let restarted = h.restarted(7);
    let stored = |id| h.store.action(id).unwrap().unwrap();
    assert!(
        until(|| stored(read).outcome.is_some()).await,
        "restart recovery ended the read"
    );
    let record = stored(read);
    assert_eq!(record.outcome, Some(Outcome::Cancelled));
    let context = record.outcome_context.clone().unwrap();
    assert_eq!(context["detail"], RESTARTED_BEFORE_READ_SENT, "{context}");
    assert_eq!(context["sent"], false, "{context}");
    assert_eq!(context["attempts"], 0, "{context}");
    assert!(h.store.attempts(read).unwrap().is_empty());
    // The action view has every member of the context, says why it ended, and describes its
    // options as a problem answer does.
    let view = backstop_gateway::actions_api::action_view(&record, &[], false);
    for member in [
        "sent",
        "response_received",
        "attempts",
        "total_wait_ms",
        "last_status",
        "last_signal",
        "boundary",
        "next_safe",
    ] {
        assert!(view["context"].get(member).is_some(), "{member}: {view}");
    }
    assert_eq!(view["detail"], RESTARTED_BEFORE_READ_SENT, "{view}");
    assert!(
        view["context"]["next_safe"][0]["description"]
            .as_str()
            .is_some_and(|d| !d.is_empty()),
        "{view}"
    );
    assert_eq!(
        stored(write).outcome,
        None,
        "the write waits for its resend"
    );
    assert!(h.transport.sent().is_empty(), "{:?}", h.transport.sent());
    restarted.shutdown().await;
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
