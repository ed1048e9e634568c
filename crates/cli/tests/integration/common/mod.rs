//! Shared fixtures for the command-line integration tests: gateway databases populated through
//! the store API at fixed instants (tests never read the clock), and loopback ports taken
//! without a race ([`listening`]).

pub mod listening;

use backstop_store::{
    ActionId, Admission, NewAction, NewTask, PayloadDigest, Priority, RouteTemplate, SqliteStore,
    Store,
};
use jiff::{SignedDuration, Timestamp};

/// The `--now` the snapshot tests pass: 45 s after [`at`]`(0)`.
pub const NOW: &str = "2026-07-26T18:40:45Z";

/// 2026-07-26T18:40:00Z plus `ms` milliseconds.
pub fn at(ms: i64) -> Timestamp {
    "2026-07-26T18:40:00Z".parse::<Timestamp>().unwrap() + SignedDuration::from_millis(ms)
}

/// Opens task `run` of `agent-a` (normal priority, `deadline`) at [`at`]`(0)`, records its one
/// action `method route` of provider `llm` in `request_class` (key `key-{run}`, the run's name
/// as payload) and marks its first attempt sent, all at [`at`]`(0)`; the action and the
/// attempt number. Panics if the key already existed.
pub fn sent_action(
    store: &SqliteStore,
    run: &str,
    deadline: Option<Timestamp>,
    method: &str,
    route: &str,
    request_class: &str,
) -> (ActionId, u32) {
    store
        .open_task(
            NewTask {
                id: run.into(),
                agent: "agent-a".into(),
                priority: Priority::Normal,
                deadline,
            },
            at(0),
        )
        .unwrap();
    let Admission::New(id) = store
        .record_action(
            NewAction {
                task_id: run.into(),
                agent: "agent-a".into(),
                provider: "llm".into(),
                method: method.into(),
                route: RouteTemplate::try_new(route).unwrap(),
                request_class: request_class.into(),
                payload_digest: PayloadDigest::of(run.as_bytes()),
                target_digest: None,
                idempotency_key: format!("key-{run}"),
                external_reference: None,
                desired_outcome: None,
                fingerprint: None,
                request: None,
            },
            at(0),
        )
        .unwrap()
    else {
        panic!("existing action");
    };
    let n = store.mark_attempt_sent(id, at(0)).unwrap();
    (id, n)
}
