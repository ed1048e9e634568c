//! An idempotency key binds the concrete target (normalized path and query) it was sent to,
//! not only the route template: the same key on another account or query string is another
//! request (SPEC §6). Actions recorded without a target (before schema version 7) compare
//! as before.

use backstop_store::{Admission, NewAction, PayloadDigest, SqliteStore, Store, StoreError};

use crate::common::{kinds, new_action, open_task, t};

fn store() -> (tempfile::TempDir, SqliteStore) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("s.db")).expect("open");
    (dir, store)
}

/// The write of `common::new_action` sent to `target` (path and query).
fn to_target(key: &str, target: Option<&str>) -> NewAction {
    NewAction {
        target_digest: target.map(|t| PayloadDigest::of(t.as_bytes())),
        ..new_action("task-1", key, br#"{"amount":100}"#)
    }
}

fn admitted(store: &SqliteStore, action: NewAction, at: i64) -> Admission {
    store.record_action(action, t(at)).expect("admitted")
}

#[test]
fn the_same_key_on_another_path_is_refused_naming_the_target() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    let Admission::New(id) = admitted(
        &store,
        to_target("pay-1", Some("/v1/accounts/acct_A/charges")),
        1,
    ) else {
        panic!("the first use of a key is a new action")
    };
    match store.record_action(
        to_target("pay-1", Some("/v1/accounts/acct_B/charges")),
        t(2),
    ) {
        Err(StoreError::KeyReuse {
            existing, differs, ..
        }) => {
            assert_eq!(existing, id.0);
            assert_eq!(differs, ["target"]);
        }
        other => panic!("expected KeyReuse, got {other:?}"),
    }
    // Only the first request was recorded and audited.
    assert_eq!(kinds(&store), ["task_opened", "action_requested"]);
}

#[test]
fn the_same_key_with_another_query_string_is_refused() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    admitted(&store, to_target("xfer-1", Some("/v1/transfers")), 1);
    match store.record_action(
        to_target("xfer-1", Some("/v1/transfers?currency=eur&dry_run=1")),
        t(2),
    ) {
        Err(StoreError::KeyReuse { differs, .. }) => assert_eq!(differs, ["target"]),
        other => panic!("expected KeyReuse, got {other:?}"),
    }
}

#[test]
fn target_is_named_beside_the_payload_in_order() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    admitted(&store, to_target("pay-1", Some("/v1/a")), 1);
    let mut other = to_target("pay-1", Some("/v1/b"));
    other.payload_digest = PayloadDigest::of(b"other body");
    match store.record_action(other, t(2)) {
        Err(StoreError::KeyReuse { differs, .. }) => assert_eq!(differs, ["target", "payload"]),
        other => panic!("expected KeyReuse, got {other:?}"),
    }
}

#[test]
fn the_same_key_on_the_same_target_is_the_existing_action() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    let Admission::New(id) = admitted(
        &store,
        to_target("pay-1", Some("/v1/accounts/acct_A/charges")),
        1,
    ) else {
        panic!("the first use of a key is a new action")
    };
    match admitted(
        &store,
        to_target("pay-1", Some("/v1/accounts/acct_A/charges")),
        2,
    ) {
        Admission::Existing(a) => assert_eq!(a.id, id),
        Admission::New(other) => panic!("a second action {other} for the same request"),
    }
}

#[test]
fn an_action_recorded_without_a_target_compares_as_before() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    // Recorded without a target (as before schema version 7): NULL in the store.
    let Admission::New(id) = admitted(&store, to_target("old-1", None), 1) else {
        panic!("the first use of a key is a new action")
    };
    match admitted(&store, to_target("old-1", Some("/v1/anything")), 2) {
        Admission::Existing(a) => assert_eq!(a.id, id),
        Admission::New(other) => panic!("a second action {other} for the same request"),
    }
}

#[test]
fn another_route_is_named_as_the_route_not_also_as_the_target() {
    let (_dir, store) = store();
    open_task(&store, "task-1");
    admitted(&store, to_target("pay-1", Some("/v1/transfers")), 1);
    let mut other = to_target("pay-1", Some("/v1/refunds"));
    other.route = backstop_store::RouteTemplate::try_new("/v1/refunds").expect("template");
    match store.record_action(other, t(2)) {
        Err(StoreError::KeyReuse { differs, .. }) => assert_eq!(differs, ["route"]),
        other => panic!("expected KeyReuse, got {other:?}"),
    }
}
