//! `backstop snapshots export` telling what it did not export: a `--task` with no action in the
//! database, a task whose actions were not throttled, a database that does not exist (named
//! once), and scopes named by their provider only when `--policy` is absent.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use backstop_store::{AttemptResult, Boundary, Disposition, SqliteStore, Store};
use serde_json::Value;

use crate::common::{at, sent_action, NOW};

/// Records one action of `run` on `GET /v1/chat/models` of provider `llm`; when `throttled`,
/// its only attempt got a 429 with no scope record written beside it (so the exported
/// `quota_scope` can only come from the policy).
fn action(store: &SqliteStore, run: &str, throttled: bool) {
    let (id, n) = sent_action(store, run, None, "GET", "/v1/models", "read");
    let (status, disposition, boundary) = if throttled {
        (
            429,
            Disposition::RateLimited,
            Some(Boundary::At(at(60_000))),
        )
    } else {
        (200, Disposition::Success, None)
    };
    store
        .record_result(
            AttemptResult {
                action: id,
                attempt: n,
                status: Some(status),
                disposition,
                boundary,
                source: None,
                provider_operation_id: None,
                signal_headers: Vec::new(),
                finish: None,
            },
            at(0),
        )
        .unwrap();
}

fn database(dir: &Path) -> PathBuf {
    let path = dir.join("backstop.db");
    let store = SqliteStore::open(&path).unwrap();
    action(&store, "run-throttled", true);
    action(&store, "run-fine", false);
    // Throttled, then its task was cancelled: a cancelled action has no snapshot.
    action(&store, "run-stopped", true);
    store
        .cancel_task("agent-a", "run-stopped", at(1_000))
        .unwrap();
    path
}

fn backstop(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_backstop"))
        .args(args)
        .output()
        .unwrap()
}

/// `backstop snapshots export --db {db} --task {task} --now NOW`.
fn export_task(db: &str, task: &str) -> Output {
    backstop(&[
        "snapshots",
        "export",
        "--db",
        db,
        "--task",
        task,
        "--now",
        NOW,
    ])
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn a_task_with_no_action_is_said_and_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let db = database(dir.path());
    let db = db.to_str().unwrap();
    let out = export_task(db, "nosuch");
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(out.stdout.is_empty());
    assert_eq!(
        stderr(&out),
        format!("backstop snapshots export: {db}: no action of task `nosuch` was found\n")
    );

    // A task that exists but was never throttled: nothing to export, said, exit 0.
    let out = export_task(db, "run-fine");
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(out.stdout.is_empty());
    assert!(
        stderr(&out).contains("task `run-fine` has 1 action, none throttled: nothing to export"),
        "{}",
        stderr(&out)
    );

    // A task whose only action was throttled and then cancelled: said as such, not "none
    // throttled".
    let out = export_task(db, "run-stopped");
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(out.stdout.is_empty());
    assert!(
        stderr(&out).contains(
            "task `run-stopped` has 1 action; 1 of them was throttled and then cancelled, and a cancelled action waits for nothing, so it has no snapshot: nothing to export"
        ),
        "{}",
        stderr(&out)
    );
    assert!(!stderr(&out).contains("none throttled"), "{}", stderr(&out));
}

#[test]
fn a_missing_database_is_named_once() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("nope.db");
    let db = db.to_str().unwrap();
    let out = backstop(&["snapshots", "export", "--db", db]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        stderr(&out),
        format!("backstop snapshots export: {db}: no such database file\n")
    );
}

#[test]
fn without_policy_a_note_says_scopes_are_named_by_provider_only() {
    let dir = tempfile::tempdir().unwrap();
    let db = database(dir.path());
    let db = db.to_str().unwrap();
    let out = backstop(&["snapshots", "export", "--db", db, "--now", NOW]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let snapshot: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(snapshot["quota_scope"], "llm");
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("backstop snapshots export: note: without --policy, 1 snapshot whose scope the gateway did not record is named by the provider only"),
        "{err}"
    );

    // With the policy the route's scope is named, and there is nothing to note.
    let policy = dir.path().join("policy.yaml");
    std::fs::write(
        &policy,
        "providers:\n  llm:\n    base_url: http://127.0.0.1:9\n    scopes:\n      project: { limit: 10 }\n    routes:\n      \"GET /v1/models\": { class: read, scopes: [project] }\n",
    )
    .unwrap();
    let out = backstop(&[
        "snapshots",
        "export",
        "--db",
        db,
        "--now",
        NOW,
        "--policy",
        policy.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let snapshot: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(snapshot["quota_scope"], "llm/project");
    assert!(stderr(&out).is_empty(), "{}", stderr(&out));
}

#[test]
fn a_policy_that_does_not_match_the_database_is_warned_about() {
    let dir = tempfile::tempdir().unwrap();
    let db = database(dir.path());
    let db = db.to_str().unwrap();
    // A policy without provider `llm` (the database's) and so without its route's scope.
    let policy = dir.path().join("other.yaml");
    std::fs::write(
        &policy,
        "providers:\n  fake:\n    base_url: http://127.0.0.1:9\n    scopes:\n      account: { limit: 10 }\n",
    )
    .unwrap();
    let policy = policy.to_str().unwrap();
    let out = backstop(&[
        "snapshots",
        "export",
        "--db",
        db,
        "--now",
        NOW,
        "--policy",
        policy,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let snapshot: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(snapshot["quota_scope"], "llm");
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with(&format!(
            "backstop snapshots export: warning: {policy}: the database's provider `llm` (1 snapshot) is not in this policy"
        )),
        "{err}"
    );

    // The provider is there but the route has no scope and the class is unknown: both named.
    std::fs::write(
        dir.path().join("other.yaml"),
        "providers:\n  llm:\n    base_url: http://127.0.0.1:9\n",
    )
    .unwrap();
    let out = backstop(&[
        "snapshots",
        "export",
        "--db",
        db,
        "--now",
        NOW,
        "--policy",
        policy,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("this policy names no scope (no route scope, no default scope) for `llm GET /v1/models`, so 1 snapshot is named by the provider only"),
        "{err}"
    );
}
