//! A write the gateway recorded and was still holding before its first send when it stopped
//! (here: its scope waits out a 429) was answered "nothing was sent, sending it again is
//! safe". After the restart, the agent's resend under the same key sends it — once, as the same
//! action — instead of being refused as "still in flight" forever. Sends are counted at the
//! scripted transport.

use std::time::Duration;

use backstop_gateway::action::{ActionSpec, Execution};
use backstop_store::{ActionId, Outcome, Store};

use crate::engine_support::{advance, answer, summary, until, Harness};

/// Scripts a 429 with `Retry-After: 10` on the shared scope (answered to a read started here,
/// whose task is returned) and a 201 for the next transfer: every later action of the scope
/// waits 10 s before its first send.
async fn throttle_the_scope(h: &Harness) -> tokio::task::JoinHandle<Execution> {
    h.transport.script(
        "/v1/items/1",
        vec![answer(429, &[("retry-after", "10")], "")],
    );
    h.transport
        .script("/v1/transfers", vec![answer(201, &[], r#"{"id":"tr_1"}"#)]);
    let throttled = h.spawn(h.get("task-a", "/v1/items/1"));
    advance(Duration::from_millis(100)).await;
    throttled
}

/// The same transfer of task `task-w`, under idempotency key `key`.
fn write_with_key(h: &Harness, key: &str) -> ActionSpec {
    let mut spec = h.spec("task-w", "POST", "/v1/transfers", r#"{"amount":5}"#);
    spec.idempotency_key = Some(key.to_owned());
    spec
}

#[tokio::test(start_paused = true)]
async fn a_write_held_before_its_first_send_at_shutdown_is_sent_by_the_resend_after_restart() {
    let h = Harness::new();
    let throttled = throttle_the_scope(&h).await;
    let write = || write_with_key(&h, "order-21");
    let held = h.spawn(write());
    assert!(
        until(|| h.store.unsent_writes().unwrap().len() == 1).await,
        "the write is recorded and waits for the scope"
    );
    let unsent: Vec<ActionId> = h.store.unsent_writes().unwrap();
    let id = unsent[0];

    // The gateway stops while the write waits: nothing of it was sent.
    h.engine.shutdown().await;
    let answered = held.await.unwrap();
    // 503 shutting_down: "nothing was sent for this request, so sending it again is safe".
    assert_eq!(summary(&answered), "503", "{answered:?}");
    let Execution::Response { response, .. } = &answered else {
        panic!("a problem answer")
    };
    assert_eq!(response.headers()["x-should-retry"], "true");
    throttled.abort();
    assert!(h.transport.sent_to("/v1/transfers").is_empty());

    // The next run over the same store: the agent resends under the same key.
    let restarted = h.restarted(11);
    let resent = restarted.execute(write()).await;
    assert_eq!(summary(&resent), "201", "{resent:?}");
    let Execution::Response { receipt, .. } = &resent else {
        panic!("the provider's answer")
    };
    assert_eq!(receipt.action_id, id.0, "sent as the same action");
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 1);
    let record = h.store.action(id).unwrap().unwrap();
    assert_eq!(record.outcome, Some(Outcome::Succeeded));
    assert!(h.store.unsent_writes().unwrap().is_empty());

    // A later resend replays the outcome; it never sends again.
    let again = restarted.execute(write()).await;
    assert_eq!(summary(&again), "201", "{again:?}");
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 1);
    restarted.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_write_of_this_run_still_waiting_is_joined_not_taken_over() {
    let h = Harness::new();
    let throttled = throttle_the_scope(&h).await;
    let write = || write_with_key(&h, "order-22");
    let first = h.spawn(write());
    assert!(until(|| h.store.unsent_writes().unwrap().len() == 1).await);
    // The same key again while the first waits in this run: never a second send.
    let second = h.spawn(write());
    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    assert_eq!(summary(&first), "201", "{first:?}");
    assert_ne!(summary(&second), "cancelled", "{second:?}");
    assert_eq!(h.transport.sent_to("/v1/transfers").len(), 1);
    throttled.abort();
    h.engine.shutdown().await;
}
