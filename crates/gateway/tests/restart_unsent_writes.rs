//! A write the gateway recorded and was still holding before its first send when it stopped
//! (here: its scope waits out a 429) was answered "nothing was sent, sending it again is
//! safe". After the restart, the agent's resend under the same key sends it — once, as the same
//! action — instead of being refused as "still in flight" forever. Sends are counted at the
//! scripted transport.

mod engine_support;

use std::time::Duration;

use backstop_gateway::{action::Execution, engine::Engine};
use backstop_store::{ActionId, Outcome, Store};
use engine_support::{advance, answer, summary, until, Harness};

#[tokio::test(start_paused = true)]
async fn a_write_held_before_its_first_send_at_shutdown_is_sent_by_the_resend_after_restart() {
    let h = Harness::new();
    // A 429 on the shared scope holds every later action of it for 10 s.
    h.transport.script(
        "/v1/items/1",
        vec![answer(429, &[("retry-after", "10")], "")],
    );
    h.transport
        .script("/v1/transfers", vec![answer(201, &[], r#"{"id":"tr_1"}"#)]);
    let throttled = h.spawn(h.get("task-a", "/v1/items/1"));
    advance(Duration::from_millis(100)).await;
    let write = || {
        let mut spec = h.spec("task-w", "POST", "/v1/transfers", r#"{"amount":5}"#);
        spec.idempotency_key = Some("order-21".to_owned());
        spec
    };
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
    let restarted = Engine::new(
        h.policy.clone(),
        h.store.clone(),
        h.transport.clone(),
        h.clock,
        h.metrics.clone(),
        11,
    );
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
    h.transport.script(
        "/v1/items/1",
        vec![answer(429, &[("retry-after", "10")], "")],
    );
    h.transport
        .script("/v1/transfers", vec![answer(201, &[], r#"{"id":"tr_1"}"#)]);
    let throttled = h.spawn(h.get("task-a", "/v1/items/1"));
    advance(Duration::from_millis(100)).await;
    let write = || {
        let mut spec = h.spec("task-w", "POST", "/v1/transfers", r#"{"amount":5}"#);
        spec.idempotency_key = Some("order-22".to_owned());
        spec
    };
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
