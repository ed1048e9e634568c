//! Every subcommand survives an unwritable stdout or stderr: a reader that closed the pipe
//! (`| head`) ends quietly with the command's own status, a full device exits 2 with one line
//! on stderr, a closed stderr is ignored — never a panic (exit 101).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use backstop_store::{NewTask, Priority, SqliteStore, Store};

/// A pipe whose reading end is already closed: every write to it fails with EPIPE.
fn closed_pipe() -> Stdio {
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    Stdio::from(writer)
}

fn dev_full() -> Stdio {
    Stdio::from(File::create("/dev/full").expect("/dev/full exists on Linux"))
}

fn backstop(args: &[&str], stdout: Stdio, stderr: Stdio) -> Output {
    Command::new(env!("CARGO_BIN_EXE_backstop"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .output()
        .expect("run backstop")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A backstop database whose audit log holds one event (a task opened).
fn one_event_db(dir: &Path) -> PathBuf {
    let path = dir.join("backstop.db");
    let store = SqliteStore::open(&path).expect("open store");
    let at = jiff::Timestamp::from_millisecond(1_750_000_000_000).expect("valid instant");
    store
        .open_task(
            NewTask {
                id: "task-1".into(),
                agent: "agent-a".into(),
                priority: Priority::Normal,
                deadline: None,
            },
            at,
        )
        .expect("task");
    drop(store);
    path
}

fn example_policy() -> String {
    concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/backstop.yaml").to_owned()
}

/// The commands under test with their exit status on a writable stdout.
fn commands(db: &str) -> Vec<(Vec<String>, i32)> {
    let owned = |args: &[&str]| args.iter().map(|a| (*a).to_owned()).collect::<Vec<_>>();
    vec![
        (owned(&["classify", "--status", "429"]), 0),
        (owned(&["policy", "check", &example_policy()]), 0),
        (owned(&["audit", "head", "--db", db]), 0),
        (owned(&["audit", "verify", "--db", db]), 0),
        (owned(&["audit", "export", "--db", db]), 0),
    ]
}

#[test]
fn stdout_broken_pipe_exits_quietly_with_the_command_status() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = one_event_db(dir.path());
    for (args, status) in commands(db.to_str().expect("utf-8 path")) {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = backstop(&args, closed_pipe(), Stdio::piped());
        assert_eq!(
            out.status.code(),
            Some(status),
            "{args:?}: {}",
            text(&out.stderr)
        );
        assert!(
            !text(&out.stderr).contains("panicked"),
            "{args:?}: {}",
            text(&out.stderr)
        );
        assert!(
            out.stderr.is_empty(),
            "{args:?}: quiet, got {}",
            text(&out.stderr)
        );
    }
}

#[test]
fn stdout_write_error_exits_2_without_panic() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = one_event_db(dir.path());
    for (args, _) in commands(db.to_str().expect("utf-8 path")) {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = backstop(&args, dev_full(), Stdio::piped());
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stderr)
        );
        let err = text(&out.stderr);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: one line, got {err}");
        assert!(err.contains("stdout"), "{args:?}: names stdout: {err}");
    }
}

#[test]
fn closed_stderr_keeps_the_error_exit_status_without_panic() {
    // A bad argument: the message cannot be written, the status is still the command's 2.
    let out = backstop(
        &["classify", "--status", "42"],
        Stdio::piped(),
        closed_pipe(),
    );
    assert_eq!(out.status.code(), Some(2));
    let out = backstop(
        &["policy", "check", "/nonexistent/policy.yaml"],
        Stdio::piped(),
        closed_pipe(),
    );
    assert_eq!(out.status.code(), Some(2));
    let out = backstop(
        &["audit", "head", "--db", "/nonexistent/backstop.db"],
        Stdio::piped(),
        closed_pipe(),
    );
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn diagnose_bad_line_with_closed_stderr_exits_1_without_panic() {
    let dir = tempfile::tempdir().expect("tempdir");
    let input = dir.path().join("snapshots.ndjson");
    std::fs::write(&input, "not json\n").expect("write input");
    let out = backstop(
        &["diagnose", input.to_str().expect("utf-8 path")],
        Stdio::piped(),
        closed_pipe(),
    );
    assert_eq!(out.status.code(), Some(1));
}
