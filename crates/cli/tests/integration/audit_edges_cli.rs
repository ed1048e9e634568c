//! `backstop audit` on logs broken on purpose and on inputs in other shapes: what it says
//! about a damaged row in an export, a changed link, a row outside the chain, a head given as
//! JSON or with a byte-order mark, hex in upper case, and a database in a directory it cannot
//! write to.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use backstop_store::{SqliteStore, Store};

use crate::common::sent_action;

/// A closed backstop database in `dir` with three actions, 3 × 3 audit events (seq 1 to 9:
/// `task_opened`, `action_requested`, `action_sent` each).
fn make_db(dir: &Path) -> PathBuf {
    make_db_with_head(dir).0
}

/// [`make_db`] and its head as `backstop audit head` prints it (`SEQ HASH` and a newline).
fn make_db_with_head(dir: &Path) -> (PathBuf, String) {
    let path = dir.join("backstop.db");
    let store = SqliteStore::open(&path).expect("open store");
    for run in ["run-a", "run-b", "run-c"] {
        sent_action(
            &store,
            run,
            None,
            "POST",
            "/v1/transfers",
            "idempotent_write",
        );
    }
    let head = store.audit_head().expect("head").expect("events");
    assert_eq!(head.seq, 9);
    drop(store);
    (path, format!("{} {}\n", head.seq, head.hash))
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

fn tamper(path: &Path, sql: &str) {
    rusqlite::Connection::open(path)
        .expect("open raw")
        .execute_batch(sql)
        .expect("tamper");
}

#[test]
fn export_stopped_by_a_damaged_row_says_how_to_export_past_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = make_db(dir.path());
    tamper(&db, "UPDATE audit_events SET status = 'oops' WHERE seq = 4");
    let out = backstop(&["audit", "export", "--db", p(&db)]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout).lines().count(),
        3,
        "seq 1 to 3 were exported"
    );
    let stderr = text(&out.stderr);
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("seq 4"), "{stderr}");
    let hint = format!("backstop audit export --db {} --since 4", p(&db));
    assert!(stderr.contains(&hint), "{stderr}");
    // The hint does what it says.
    let rest = backstop(&["audit", "export", "--db", p(&db), "--since", "4"]);
    assert_eq!(rest.status.code(), Some(0), "{}", text(&rest.stderr));
    let rest = text(&rest.stdout);
    assert_eq!(rest.lines().count(), 5);
    assert!(rest.starts_with("{\"action\":2,"), "{rest}");
}

#[test]
fn expect_head_takes_the_json_audit_head_prints_and_a_byte_order_mark() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = make_db(dir.path());
    let json = backstop(&["audit", "head", "--db", p(&db), "--format", "json"]);
    assert_eq!(json.status.code(), Some(0), "{}", text(&json.stderr));
    let json = text(&json.stdout);
    let verify = backstop(&["audit", "verify", "--db", p(&db), "--expect-head", &json]);
    assert_eq!(verify.status.code(), Some(0), "{}", text(&verify.stderr));
    assert!(text(&verify.stdout).starts_with("ok: 9 events"));

    // A head saved by an editor that starts files with a byte-order mark, in either form.
    let line = text(&backstop(&["audit", "head", "--db", p(&db)]).stdout);
    for saved in [format!("\u{feff}{line}"), format!("\u{feff}{json}")] {
        let verify = backstop(&["audit", "verify", "--db", p(&db), "--expect-head", &saved]);
        assert_eq!(
            verify.status.code(),
            Some(0),
            "{saved:?}: {}",
            text(&verify.stderr)
        );
    }

    // A JSON head of another log is looked for, not refused as malformed.
    let other = format!("{{\"seq\":9,\"hash\":\"{}\"}}", "ab".repeat(32));
    let verify = backstop(&["audit", "verify", "--db", p(&db), "--expect-head", &other]);
    assert_eq!(verify.status.code(), Some(1), "{}", text(&verify.stderr));
    assert!(
        text(&verify.stdout).contains("truncated"),
        "{}",
        text(&verify.stdout)
    );
}

#[test]
fn an_export_and_a_head_in_upper_case_hex_verify() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = make_db(dir.path());
    let export = text(&backstop(&["audit", "export", "--db", p(&db)]).stdout);
    let line = text(&backstop(&["audit", "head", "--db", p(&db)]).stdout);
    // Every hex digest upper-cased, as a tool that normalizes hex might leave it.
    let upper: String = export
        .lines()
        .map(|l| {
            let mut e: serde_json::Value = serde_json::from_str(l).expect("json");
            for key in ["prev", "hash"] {
                let v = e[key].as_str().expect("hex").to_ascii_uppercase();
                e[key] = serde_json::Value::String(v);
            }
            format!("{e}\n")
        })
        .collect();
    let file = dir.path().join("upper.ndjson");
    std::fs::write(&file, upper).expect("write");
    let verify = backstop(&[
        "audit",
        "verify",
        p(&file),
        "--expect-head",
        &line.to_ascii_uppercase(),
    ]);
    assert_eq!(verify.status.code(), Some(0), "{}", text(&verify.stdout));
    assert_eq!(
        text(&verify.stdout),
        format!("ok: 9 events, head seq {}", line.replacen(' ', " hash ", 1))
    );
}

#[test]
fn verify_names_a_changed_link_and_a_row_outside_the_chain() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = make_db(dir.path());
    let export = text(&backstop(&["audit", "export", "--db", p(&db)]).stdout);
    let third: serde_json::Value =
        serde_json::from_str(export.lines().nth(2).expect("seq 3")).expect("json");
    let third_hash = third["hash"].as_str().expect("hash").to_owned();
    // seq 5 now links to seq 3; its content is untouched.
    tamper(
        &db,
        &format!("UPDATE audit_events SET prev = x'{third_hash}' WHERE seq = 5"),
    );
    let out = backstop(&["audit", "verify", "--db", p(&db)]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.starts_with("broken: seq 5: broken link: prev "),
        "{stdout}"
    );
    assert!(stdout.contains("is not the hash of seq 4"), "{stdout}");

    // A forged row before the chain is found before anything else.
    tamper(
        &db,
        "INSERT INTO audit_events (seq, at, kind, prev, hash)
         SELECT 0, at, kind, prev, hash FROM audit_events WHERE seq = 1",
    );
    let out = backstop(&["audit", "verify", "--db", p(&db)]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.starts_with("broken: seq 0: inserted: "), "{stdout}");
    assert!(stdout.contains("outside the chain"), "{stdout}");
}

/// Gives the directory its write bit back when the test ends, so that it can be removed.
struct Writable(PathBuf);

impl Drop for Writable {
    fn drop(&mut self) {
        let _ = std::fs::set_permissions(&self.0, std::fs::Permissions::from_mode(0o755));
    }
}

#[test]
fn head_and_verify_read_a_database_whose_directory_is_read_only() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("evidence");
    std::fs::create_dir(&dir).expect("mkdir");
    let (db, expected) = make_db_with_head(&dir);
    let _ = std::fs::remove_file(dir.join("backstop.db.lock"));
    // Closing the store checkpointed the WAL and removed `-wal` and `-shm`.
    assert!(!dir.join("backstop.db-shm").exists());
    let _writable = Writable(dir.clone());
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o555)).expect("chmod");
    if std::fs::write(dir.join("probe"), b"").is_ok() {
        // Root ignores the permission bits: make the -shm file impossible to create another
        // way, a dangling symbolic link in its place (SQLite opens it with O_NOFOLLOW).
        let _ = std::fs::remove_file(dir.join("probe"));
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        std::os::unix::fs::symlink(dir.join("no-such-dir/shm"), dir.join("backstop.db-shm"))
            .expect("symlink");
    }
    let head = backstop(&["audit", "head", "--db", p(&db)]);
    assert_eq!(head.status.code(), Some(0), "{}", text(&head.stderr));
    assert_eq!(text(&head.stdout), expected);
    let verify = backstop(&[
        "audit",
        "verify",
        "--db",
        p(&db),
        "--expect-head",
        &expected,
    ]);
    assert_eq!(verify.status.code(), Some(0), "{}", text(&verify.stderr));
    assert!(text(&verify.stdout).starts_with("ok: 9 events"));
}

#[test]
fn an_export_says_it_leaves_out_rows_outside_the_chain() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = make_db(dir.path());
    // A forged copy of the first event placed before the chain.
    tamper(
        &db,
        "CREATE TEMP TABLE forged AS SELECT * FROM audit_events WHERE seq = 1; \
         UPDATE forged SET seq = -1; \
         INSERT INTO audit_events SELECT * FROM forged",
    );
    let out = backstop(&["audit", "export", "--db", p(&db)]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(
        text(&out.stdout).lines().count(),
        9,
        "the chain's events are exported"
    );
    assert!(
        stderr.contains("1 row of audit_events lie outside the chain (seq -1)"),
        "{stderr}"
    );
    assert!(stderr.contains("backstop audit verify --db"), "{stderr}");
}

#[test]
fn a_row_with_a_value_of_the_wrong_type_is_named_by_seq_column_expected_and_found() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = make_db(dir.path());
    // Text where the store writes a JSON array of header pairs, as an editor might leave it.
    tamper(
        &db,
        "UPDATE audit_events SET signal_headers = '{\"retry-after\": \"5\"}' WHERE seq = 4",
    );
    let verify = backstop(&["audit", "verify", "--db", p(&db)]);
    assert_eq!(verify.status.code(), Some(1), "{}", text(&verify.stderr));
    let stdout = text(&verify.stdout);
    assert!(stdout.starts_with("broken: seq 4: altered: "), "{stdout}");
    for part in [
        "column signal_headers holds the text \"{\\\"retry-after\\\": \\\"5\\\"}\"",
        "expected NULL or JSON text: an array of [name, value] string pairs",
        "the row was changed or damaged after it was written",
    ] {
        assert!(stdout.contains(part), "missing {part:?} in {stdout}");
    }
    let export = backstop(&["audit", "export", "--db", p(&db)]);
    assert_eq!(export.status.code(), Some(2), "{}", text(&export.stderr));
    let stderr = text(&export.stderr);
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    for part in [
        "audit_events seq 4 cannot be decoded: column signal_headers holds the text",
        "expected NULL or JSON text",
        &format!(
            "`backstop audit verify --db {}` names the first broken event",
            p(&db)
        ),
        &format!("backstop audit export --db {} --since 4", p(&db)),
    ] {
        assert!(stderr.contains(part), "missing {part:?} in {stderr}");
    }
    // SQLite's and the JSON parser's own wording are not the message.
    for out in [&stdout, &stderr] {
        assert!(!out.contains("Conversion error"), "{out}");
        assert!(!out.contains("index: 27"), "{out}");
    }

    // An integer column holding text names the column and the range it must be in (seq 4
    // had no signal headers: NULL restores it).
    tamper(
        &db,
        "UPDATE audit_events SET signal_headers = NULL WHERE seq = 4;
         UPDATE audit_events SET status = 'oops' WHERE seq = 6",
    );
    let verify = backstop(&["audit", "verify", "--db", p(&db)]);
    assert_eq!(verify.status.code(), Some(1), "{}", text(&verify.stderr));
    assert_eq!(
        text(&verify.stdout),
        "broken: seq 6: altered: seq 6 cannot be decoded: column status holds the text \"oops\", \
         expected an integer from 0 to 65535, or NULL; the row was changed or damaged after it \
         was written\n"
    );
}

#[test]
fn a_truncated_database_is_called_damaged_or_truncated_not_foreign_to_sqlite() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = make_db(dir.path());
    let bytes = std::fs::read(&db).expect("read");
    let page = usize::from(u16::from_be_bytes([bytes[16], bytes[17]]));
    assert!(bytes.len() >= 3 * page, "the fixture has several pages");
    // The first 1000 bytes (inside the first page), and a cut in the middle of a later page.
    let cuts = [
        ("first-1000.db", 1000),
        ("mid-page.db", bytes.len() - page - page / 2),
    ];
    for (name, len) in cuts {
        let cut = dir.path().join(name);
        std::fs::write(&cut, &bytes[..len]).expect("write");
        for command in ["verify", "head", "export"] {
            let out = backstop(&["audit", command, "--db", p(&cut)]);
            assert_eq!(out.status.code(), Some(2), "{command} {name}");
            let stderr = text(&out.stderr);
            assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
            assert!(
                stderr.contains(&format!(
                    "{}: the file is damaged or truncated: it has {len} bytes, but its header \
                     gives {} pages of {page} bytes",
                    p(&cut),
                    bytes.len() / page
                )),
                "{command} {name}: {stderr}"
            );
            assert!(!stderr.contains("not a SQLite database"), "{stderr}");
        }
        assert_eq!(
            std::fs::read(&cut).expect("read").len(),
            len,
            "the audit commands left the file as it was"
        );
    }
    // A file that is no SQLite database at all is still called that.
    let other = dir.path().join("notes.db");
    std::fs::write(&other, "these are notes, not a database\n".repeat(40)).expect("write");
    let out = backstop(&["audit", "verify", "--db", p(&other)]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("notes.db: not a SQLite database"),
        "{stderr}"
    );
}

#[test]
fn head_of_a_damaged_last_event_points_to_audit_verify_and_prints_no_head() {
    let dir = tempfile::tempdir().unwrap();
    let db = make_db(dir.path());
    // The digest as hex text (the form before schema 8), as a hand edit could leave it.
    tamper(
        &db,
        "UPDATE audit_events SET hash = lower(hex(hash)) WHERE seq = 9",
    );
    let out = backstop(&["audit", "head", "--db", p(&db)]);
    assert_ne!(out.status.code(), Some(0));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains(
            "the audit log's last event, seq 9, cannot be decoded (hash is stored as text"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("`backstop audit verify --db {}`", p(&db))),
        "{stderr}"
    );
    assert!(out.stdout.is_empty(), "{}", text(&out.stdout));

    // A last event whose content was changed after it was sealed is not printed for
    // anchoring either.
    let dir = tempfile::tempdir().unwrap();
    let db = make_db(dir.path());
    tamper(&db, "UPDATE audit_events SET task = 'run-z' WHERE seq = 9");
    let out = backstop(&["audit", "head", "--db", p(&db)]);
    assert_ne!(out.status.code(), Some(0));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("seq 9, does not match its hash"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
}
