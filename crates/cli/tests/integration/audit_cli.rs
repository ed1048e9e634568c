//! `backstop audit verify|export|head` as a process: exit codes, messages, and never creating
//! a database.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use backstop_store::{
    Admission, NewAction, NewTask, PayloadDigest, Priority, RouteTemplate, SqliteStore, Store,
};

fn t(ms: i64) -> jiff::Timestamp {
    jiff::Timestamp::from_millisecond(1_750_000_000_000 + ms).expect("valid instant")
}

/// A closed backstop database with 1 + 2 × `actions` audit events.
fn make_db(dir: &Path, actions: usize) -> PathBuf {
    let path = dir.join("backstop.db");
    let store = SqliteStore::open(&path).expect("open store");
    store
        .open_task(
            NewTask {
                id: "task-1".into(),
                agent: "agent-a".into(),
                priority: Priority::Normal,
                deadline: None,
            },
            t(0),
        )
        .expect("task");
    for i in 0..actions {
        let action = NewAction {
            task_id: "task-1".into(),
            agent: "agent-a".into(),
            provider: "billing-api".into(),
            method: "POST".into(),
            route: RouteTemplate::try_new("/v1/transfers").expect("template"),
            request_class: "idempotent_write".into(),
            payload_digest: PayloadDigest::of(format!("payload {i}").as_bytes()),
            target_digest: None,
            idempotency_key: format!("key-{i}"),
            external_reference: None,
            desired_outcome: None,
            fingerprint: None,
            request: None,
        };
        let Admission::New(id) = store.record_action(action, t(1)).expect("record") else {
            panic!("key reused");
        };
        store.mark_attempt_sent(id, t(2)).expect("sent");
    }
    drop(store);
    path
}

fn backstop(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_backstop"))
        .args(args)
        .output()
        .expect("run backstop")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn p(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

#[test]
fn head_export_and_verify_agree_on_an_untouched_log() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = make_db(dir.path(), 3);
    let head = backstop(&["audit", "head", "--db", p(&db)]);
    assert_eq!(head.status.code(), Some(0), "{}", text(&head.stderr));
    let head = text(&head.stdout);
    let (seq, hash) = head.trim().split_once(' ').expect("SEQ HASH");
    assert_eq!(seq, "7");
    assert_eq!(hash.len(), 64);

    let verify = backstop(&["audit", "verify", "--db", p(&db), "--expect-head", hash]);
    assert_eq!(verify.status.code(), Some(0), "{}", text(&verify.stderr));
    assert_eq!(
        text(&verify.stdout).trim(),
        format!("ok: 7 events, head seq 7 hash {hash}")
    );

    let export = backstop(&["audit", "export", "--db", p(&db)]);
    assert_eq!(export.status.code(), Some(0), "{}", text(&export.stderr));
    let lines = text(&export.stdout);
    assert_eq!(lines.lines().count(), 7);
    let file = dir.path().join("export.ndjson");
    std::fs::write(&file, &lines).expect("write export");
    let verify = backstop(&["audit", "verify", p(&file), "--expect-head", hash]);
    assert_eq!(verify.status.code(), Some(0), "{}", text(&verify.stdout));

    let since = backstop(&["audit", "export", "--db", p(&db), "--since", "5"]);
    let since = text(&since.stdout);
    assert_eq!(since.lines().count(), 2);
    assert!(since.lines().next().expect("line").contains("\"seq\":6"));
}

#[test]
fn verify_names_the_first_bad_seq_and_exits_1() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = make_db(dir.path(), 3);
    let export = text(&backstop(&["audit", "export", "--db", p(&db)]).stdout);
    let head = text(&backstop(&["audit", "head", "--db", p(&db)]).stdout);
    let hash = head.trim().split_once(' ').expect("SEQ HASH").1.to_owned();
    let lines: Vec<&str> = export.lines().collect();

    let check = |name: &str, lines: Vec<String>, extra: &[&str], expected: &str| {
        let file = dir.path().join(name);
        std::fs::write(&file, lines.join("\n") + "\n").expect("write");
        let mut args = vec!["audit", "verify", p(&file)];
        args.extend_from_slice(extra);
        let out = backstop(&args);
        assert_eq!(out.status.code(), Some(1), "{name}: {}", text(&out.stdout));
        let stdout = text(&out.stdout);
        assert!(stdout.starts_with(expected), "{name}: {stdout}");
    };
    let owned = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();

    let mut altered = owned(&lines);
    altered[3] = altered[3].replace("\"method\":\"POST\"", "\"method\":\"PUT\"");
    check("altered.ndjson", altered, &[], "broken: seq 4: altered:");

    let mut missing = owned(&lines);
    missing.remove(2);
    check("missing.ndjson", missing, &[], "broken: seq 3: missing:");

    let mut swapped = owned(&lines);
    swapped.swap(4, 5);
    check("swapped.ndjson", swapped, &[], "broken: seq 6: reordered:");

    let mut inserted = owned(&lines);
    inserted.insert(3, lines[4].to_owned());
    check("inserted.ndjson", inserted, &[], "broken: seq 5: inserted:");

    let truncated = owned(&lines[..5]);
    check(
        "truncated.ndjson",
        truncated,
        &["--expect-head", &hash],
        "broken: seq 6: truncated:",
    );
}

#[test]
fn unreadable_inputs_exit_2_with_one_line_naming_the_place() {
    let dir = tempfile::tempdir().expect("tempdir");
    let expect_2 = |args: &[&str], needle: &str| {
        let out = backstop(args);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stdout)
        );
        let stderr = text(&out.stderr);
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    };

    let missing = dir.path().join("nope.db");
    expect_2(
        &["audit", "verify", "--db", p(&missing)],
        "nope.db: no such database file",
    );
    expect_2(
        &["audit", "head", "--db", p(&missing)],
        "no such database file",
    );
    expect_2(
        &["audit", "export", "--db", p(&missing)],
        "no such database file",
    );
    assert!(!missing.exists(), "an audit command created a database");

    let random = dir.path().join("random.db");
    let bytes: Vec<u8> = (0..8192u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&random, bytes).expect("write");
    expect_2(
        &["audit", "verify", "--db", p(&random)],
        "random.db: not a SQLite database",
    );

    // A valid SQLite file from another application: patch the application id (header offset 68).
    let db = make_db(dir.path(), 1);
    let mut header = std::fs::read(&db).expect("read");
    let foreign = dir.path().join("foreign.db");
    header[68..72].copy_from_slice(&0x1234_5678u32.to_be_bytes());
    std::fs::write(&foreign, &header).expect("write");
    expect_2(
        &["audit", "head", "--db", p(&foreign)],
        "foreign.db: not a backstop database",
    );

    // A newer schema version (user_version at header offset 60).
    let mut newer = std::fs::read(&db).expect("read");
    newer[60..64].copy_from_slice(&99u32.to_be_bytes());
    let newer_path = dir.path().join("newer.db");
    std::fs::write(&newer_path, &newer).expect("write");
    expect_2(
        &["audit", "verify", "--db", p(&newer_path)],
        "schema version 99 is newer",
    );

    let bad = dir.path().join("bad.ndjson");
    let export = text(&backstop(&["audit", "export", "--db", p(&db)]).stdout);
    std::fs::write(&bad, format!("{export}{{\"seq\": 4, \"at\"\n")).expect("write");
    expect_2(&["audit", "verify", p(&bad)], "bad.ndjson: line 4:");

    expect_2(
        &["audit", "verify", "--db", p(&db), "--expect-head", "xyz"],
        "--expect-head",
    );
    let missing_export = dir.path().join("gone.ndjson");
    expect_2(&["audit", "verify", p(&missing_export)], "gone.ndjson");
}

#[test]
fn expect_head_accepts_the_line_audit_head_prints_and_checks_its_seq() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = make_db(dir.path(), 3);
    let printed = text(&backstop(&["audit", "head", "--db", p(&db)]).stdout);
    let verify = backstop(&["audit", "verify", "--db", p(&db), "--expect-head", &printed]);
    assert_eq!(verify.status.code(), Some(0), "{}", text(&verify.stderr));
    let (_, hash) = printed.trim().split_once(' ').expect("SEQ HASH");
    let wrong_seq = format!("6 {hash}");
    let verify = backstop(&[
        "audit",
        "verify",
        "--db",
        p(&db),
        "--expect-head",
        &wrong_seq,
    ]);
    assert_eq!(verify.status.code(), Some(1));
    let out = text(&verify.stdout);
    assert!(out.contains("is at seq 7, not seq 6"), "{out}");
    let bad = backstop(&["audit", "verify", "--db", p(&db), "--expect-head", "x7 abc"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(text(&bad.stderr).contains("--expect-head"));
    let help = text(&backstop(&["audit", "verify", "--help"]).stdout);
    assert!(help.contains("SEQ HASH"), "{help}");
}

#[test]
fn audit_head_as_json() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = make_db(dir.path(), 3);
    let printed = text(&backstop(&["audit", "head", "--db", p(&db)]).stdout);
    let (seq, hash) = printed.trim().split_once(' ').expect("SEQ HASH");
    let json = backstop(&["audit", "head", "--db", p(&db), "--format", "json"]);
    assert_eq!(json.status.code(), Some(0), "{}", text(&json.stderr));
    let v: serde_json::Value = serde_json::from_str(&text(&json.stdout)).expect("JSON");
    assert_eq!(v["seq"].to_string(), seq);
    assert_eq!(v["hash"], hash);
}

#[test]
fn a_database_given_without_db_is_named_as_a_database() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = make_db(dir.path(), 1);
    let out = backstop(&["audit", "verify", p(&db)]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stdout));
    assert_eq!(
        text(&out.stderr),
        format!(
            "backstop audit verify: {}: a SQLite database, not an NDJSON export: give a database as --db FILE\n",
            p(&db)
        )
    );
    assert!(out.stdout.is_empty());
}

/// `path` taken back to schema version `version` as the previous build left it: version 9 only
/// added the `actions_open` index, so without it (and with the older number) the file is what a
/// version-8 build wrote.
fn at_version(path: &Path, version: i64) {
    let conn = rusqlite::Connection::open(path).expect("open raw");
    conn.execute_batch("DROP INDEX actions_open;")
        .expect("drop the version 9 index");
    conn.pragma_update(None, "user_version", version)
        .expect("version");
}

#[test]
fn a_version_8_store_is_read_without_migrating_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = make_db(dir.path(), 3);
    let head = backstop(&["audit", "head", "--db", p(&db)]);
    assert_eq!(head.status.code(), Some(0), "{}", text(&head.stderr));
    let export = backstop(&["audit", "export", "--db", p(&db)]);
    assert_eq!(export.status.code(), Some(0), "{}", text(&export.stderr));
    at_version(&db, 8);

    let verify = backstop(&["audit", "verify", "--db", p(&db)]);
    assert_eq!(verify.status.code(), Some(0), "{}", text(&verify.stderr));
    assert!(
        text(&verify.stdout).starts_with("ok: 7 events"),
        "{}",
        text(&verify.stdout)
    );
    let head_8 = backstop(&["audit", "head", "--db", p(&db)]);
    assert_eq!(head_8.status.code(), Some(0), "{}", text(&head_8.stderr));
    assert_eq!(text(&head_8.stdout), text(&head.stdout));
    let export_8 = backstop(&["audit", "export", "--db", p(&db)]);
    assert_eq!(
        export_8.status.code(),
        Some(0),
        "{}",
        text(&export_8.stderr)
    );
    assert_eq!(export_8.stdout, export.stdout);

    let conn = rusqlite::Connection::open(&db).expect("open raw");
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .expect("version");
    assert_eq!(version, 8, "the read-only commands do not migrate");
}

#[test]
fn an_older_store_is_refused_with_the_command_that_upgrades_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = make_db(dir.path(), 1);
    at_version(&db, 7);
    for command in ["verify", "head", "export"] {
        let out = backstop(&["audit", command, "--db", p(&db)]);
        assert_eq!(out.status.code(), Some(2), "{command}");
        let stderr = text(&out.stderr);
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        assert!(
            stderr.contains("schema version 7 is older than version 8")
                && stderr.contains(&format!(
                    "`backstop serve --config POLICY --store {}`",
                    db.display()
                )),
            "{command}: {stderr}"
        );
        assert!(out.stdout.is_empty(), "{command}: {}", text(&out.stdout));
    }
}

/// An export cut mid-line (a copy stopped early) ends in an unterminated line whose JSON ends
/// early: `truncated`, exit 1, naming the line and the last whole event. A bad line anywhere
/// else, or a terminated one, is still unreadable input (exit 2).
#[test]
fn an_export_cut_mid_line_is_truncated_but_a_bad_line_elsewhere_is_unreadable() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = make_db(dir.path(), 3);
    let export = text(&backstop(&["audit", "export", "--db", p(&db)]).stdout);
    assert_eq!(export.lines().count(), 7);

    let cut = dir.path().join("cut.ndjson");
    std::fs::write(&cut, &export[..export.len() - 37]).expect("write");
    let out = backstop(&["audit", "verify", p(&cut)]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.starts_with(
            "broken: seq 7: truncated: line 7 ends without a newline and is not a whole event \
             (EOF while parsing"
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains("the export was cut after seq 6, its last whole event"),
        "{stdout}"
    );

    // With the head anchored at seq 7: the cut explains why it is missing.
    let head = text(&backstop(&["audit", "head", "--db", p(&db)]).stdout);
    let out = backstop(&["audit", "verify", p(&cut), "--expect-head", head.trim()]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.starts_with("broken: seq 7: truncated: line 7"),
        "{stdout}"
    );
    assert!(
        stdout.contains("the expected head is not among the whole events"),
        "{stdout}"
    );

    // Cut inside the first line: no whole event.
    let first = dir.path().join("first.ndjson");
    std::fs::write(&first, &export[..20]).expect("write");
    let out = backstop(&["audit", "verify", p(&first)]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("line 1 ends without a newline")
            && text(&out.stdout).contains("cut before its first event"),
        "{}",
        text(&out.stdout)
    );

    let expect_2 = |name: &str, content: String, needle: &str| {
        let file = dir.path().join(name);
        std::fs::write(&file, content).expect("write");
        let out = backstop(&["audit", "verify", p(&file)]);
        assert_eq!(out.status.code(), Some(2), "{name}: {}", text(&out.stdout));
        let stderr = text(&out.stderr);
        assert!(stderr.contains(needle), "{name}: {stderr}");
    };
    let lines: Vec<&str> = export.lines().collect();
    // The same cut line, but in the middle of the file.
    let cut_line = &lines[6][..lines[6].len() - 37];
    let mut middle = lines.clone();
    middle.insert(3, cut_line);
    expect_2(
        "middle.ndjson",
        middle.join("\n") + "\n",
        "middle.ndjson: line 4: EOF while parsing",
    );
    // Unterminated last line that is whole JSON but not an event: not a cut.
    expect_2(
        "whole.ndjson",
        format!("{export}{{\"seq\":8}}"),
        "whole.ndjson: line 8:",
    );
}

/// An export cut inside a multi-byte character is a cut export too, not text that is not
/// UTF-8; bytes that are not UTF-8 before the end still are.
#[test]
fn an_export_cut_inside_a_character_is_truncated() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = make_db(dir.path(), 3);
    let export = text(&backstop(&["audit", "export", "--db", p(&db)]).stdout);
    let (whole, last) = export
        .trim_end()
        .rsplit_once('\n')
        .expect("more than one line");
    let last = last.replace("billing-api", "billing-\u{e4}pi");
    let at = last.find('\u{e4}').expect("the character") + 1;
    let mut bytes = format!("{whole}\n").into_bytes();
    bytes.extend_from_slice(&last.as_bytes()[..at]);
    let cut = dir.path().join("cut.ndjson");
    std::fs::write(&cut, &bytes).expect("write");
    let out = backstop(&["audit", "verify", p(&cut)]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.starts_with("broken: seq 7: truncated: line 7 ends without a newline")
            && stdout.contains("cut after seq 6"),
        "{stdout}"
    );

    // Cut just after a newline, inside the next line's first character.
    let mut bytes = export.clone().into_bytes();
    bytes.push(0xc3);
    std::fs::write(&cut, &bytes).expect("write");
    let out = backstop(&["audit", "verify", p(&cut)]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.starts_with("broken: seq 8: truncated: line 8 ends without a newline")
            && stdout.contains("the file ends inside a UTF-8 character")
            && stdout.contains("cut after seq 7"),
        "{stdout}"
    );

    // A byte that is not UTF-8 in the middle is still unreadable input.
    let mut bytes = export.into_bytes();
    bytes.insert(10, 0xff);
    std::fs::write(&cut, &bytes).expect("write");
    let out = backstop(&["audit", "verify", p(&cut)]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stdout));
    assert!(
        text(&out.stderr).contains("not UTF-8 text (byte 10)"),
        "{}",
        text(&out.stderr)
    );
}
