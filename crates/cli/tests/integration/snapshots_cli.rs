//! `backstop snapshots export` end to end: snapshots derived from a gateway database populated
//! through the store API, piped into `backstop diagnose` (the round trip), the `--task` filter,
//! and a missing database that is reported and never created.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use backstop_store::{AttemptResult, Boundary, Disposition, ScopeUpdate, SqliteStore, Store};
use serde_json::Value;

use crate::common::{at, sent_action, NOW};

/// A run whose action got 429 (`Retry-After` → `boundary_ms`) at 0 and whose retry is scheduled
/// at `due_ms` and never started.
fn throttled_run(store: &SqliteStore, run: &str, boundary_ms: i64, due_ms: i64) {
    let (id, n) = sent_action(
        store,
        run,
        Some(at(600_000)),
        "POST",
        "/v1/chat/completions",
        "idempotent_write",
    );
    store
        .update_scope(
            ScopeUpdate {
                provider: "llm".into(),
                scope: "llm/project:a".into(),
                next_allowed_at: Some(at(boundary_ms)),
                remaining: Some(0),
                limit: None,
                reset_at: None,
                source: "HTTP 429 Retry-After".into(),
            },
            at(0),
        )
        .unwrap();
    store
        .record_result(
            AttemptResult {
                action: id,
                attempt: n,
                status: Some(429),
                disposition: Disposition::RateLimited,
                boundary: Some(Boundary::At(at(boundary_ms))),
                source: Some("Retry-After".into()),
                provider_operation_id: None,
                signal_headers: Vec::new(),
                finish: None,
            },
            at(0),
        )
        .unwrap();
    store.schedule_retry(id, at(due_ms), at(0)).unwrap();
}

fn database(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("backstop.db");
    let store = SqliteStore::open(&path).unwrap();
    throttled_run(&store, "run-waiting", 60_000, 60_500);
    throttled_run(&store, "run-stuck", 10_000, 10_000);
    path
}

fn backstop(args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_backstop"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut pipe = child.stdin.take().unwrap();
    if let Some(bytes) = stdin {
        pipe.write_all(bytes).unwrap();
    }
    drop(pipe);
    child.wait_with_output().unwrap()
}

fn lines(o: &Output) -> Vec<Value> {
    String::from_utf8(o.stdout.clone())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn export_piped_into_diagnose_gives_each_runs_verdict_and_debt() {
    let dir = tempfile::tempdir().unwrap();
    let db = database(dir.path());
    let db = db.to_str().unwrap();
    let export = backstop(&["snapshots", "export", "--db", db, "--now", NOW], None);
    assert!(export.status.success(), "{:?}", export);
    let snapshots = lines(&export);
    assert_eq!(snapshots.len(), 2);
    assert_eq!(snapshots[0]["run_id"], "run-waiting");
    assert_eq!(snapshots[0]["quota_scope"], "llm/project:a");
    assert_eq!(snapshots[0]["status"], 429);
    assert_eq!(snapshots[1]["scheduled_retry_at"], "2026-07-26T18:40:10Z");

    let diagnosed = backstop(
        &["diagnose", "--now", NOW, "--format", "ndjson"],
        Some(&export.stdout),
    );
    assert!(
        diagnosed.status.success(),
        "{}",
        String::from_utf8_lossy(&diagnosed.stderr)
    );
    let results = lines(&diagnosed);
    assert_eq!(results.len(), 3, "two results and the totals line");
    assert_eq!(results[0]["run_id"], "run-waiting");
    assert_eq!(results[0]["diagnosis"], "waiting_backpressure");
    assert_eq!(results[0]["retry_after_debt_ms"], 60_000);
    assert_eq!(results[1]["run_id"], "run-stuck");
    assert_eq!(results[1]["diagnosis"], "stuck_missed_wake");
    assert_eq!(results[2]["totals"]["retry_after_debt_ms"], 70_000);
}

#[test]
fn task_filter_exports_one_run() {
    let dir = tempfile::tempdir().unwrap();
    let db = database(dir.path());
    let export = backstop(
        &[
            "snapshots",
            "export",
            "--db",
            db.to_str().unwrap(),
            "--task",
            "run-stuck",
            "--now",
            NOW,
        ],
        None,
    );
    assert!(export.status.success());
    let snapshots = lines(&export);
    assert_eq!(snapshots.len(), 1);
    assert_eq!(snapshots[0]["run_id"], "run-stuck");
}

#[test]
fn a_missing_database_is_an_error_and_is_not_created() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("nope.db");
    let export = backstop(&["snapshots", "export", "--db", db.to_str().unwrap()], None);
    assert_eq!(export.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&export.stderr).contains("nope.db"));
    assert!(!db.exists());
}
