//! A task cancelled before a restart stays cancelled after it, with the same answer: the store
//! rebuilds its list of cancelled tasks when it opens and refuses a new action of such a task
//! before the action is recorded or queued, so the answer comes at once even while the scope
//! is held back, and nothing is sent. Sends are counted at the scripted transport.

use std::time::Duration;

use backstop_gateway::action::Execution;
use backstop_gateway::engine::Engine;

use crate::engine_support::{advance, answer, summary, Harness};

/// Runs a new read of the cancelled task `doomed` on `engine` and returns its answer (outcome,
/// detail, context and receipt, printed), checking that it came without virtual time passing.
async fn refused_at_once(h: &Harness, engine: &Engine, path: &str) -> String {
    let asked = h.clock_now();
    let execution = engine.execute(h.get("doomed", path)).await;
    assert_eq!(
        h.clock_now(),
        asked,
        "answered without waiting in the queue"
    );
    let Execution::Outcome {
        outcome,
        detail,
        context,
        receipt,
    } = &execution
    else {
        panic!("refused, not {}", summary(&execution));
    };
    assert_eq!(outcome.as_str(), "cancelled");
    assert_eq!(receipt.action_id, 0, "refused before it was recorded");
    format!("{outcome:?} {detail:?} {context:?} {receipt:?}")
}

#[tokio::test(start_paused = true)]
async fn a_task_cancelled_before_a_restart_is_refused_the_same_way_after_it() {
    let h = Harness::new();
    assert_eq!(
        summary(&h.engine.execute(h.get("doomed", "/v1/items/1")).await),
        "200"
    );
    h.engine.cancel_task("doomed", "agent-a").await.unwrap();
    // A 429 holds the scope back for 30 s: an action let into the queue would wait there.
    h.transport.script(
        "/v1/items/0",
        vec![answer(429, &[("retry-after", "30")], "")],
    );
    let held = h.spawn(h.get("t0", "/v1/items/0"));
    advance(Duration::from_secs(1)).await;

    let before = refused_at_once(&h, &h.engine, "/v1/items/2").await;
    h.engine.shutdown().await;
    let _ = held.await;

    let restarted = h.restarted(7);
    advance(Duration::from_secs(1)).await;
    let after = refused_at_once(&h, &restarted, "/v1/items/3").await;
    assert_eq!(after, before);
    assert!(h.transport.sent_to("/v1/items/2").is_empty());
    assert!(h.transport.sent_to("/v1/items/3").is_empty());
    restarted.shutdown().await;
}
