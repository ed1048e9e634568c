//! Edges of the audit chain found by breaking it on purpose: a changed head the writer would
//! extend, rows outside the chain, a changed link told apart from changed content, hex in
//! either letter case, and the forms an expected head is given in.

use backstop_store::audit::{
    parse_expected_head, parse_export, verify_events, write_export, AuditEvent, ChainBreak, Verdict,
};
use backstop_store::{AuditReader, SqliteStore, Store};

use crate::common::populated;

fn break_of(v: Verdict) -> ChainBreak {
    match v {
        Verdict::Broken(b) => b,
        Verdict::Intact { count, .. } => panic!("expected a break, log of {count} verified"),
    }
}

/// Runs `sql` on the closed database at `path` behind the store's back.
fn tamper(path: &std::path::Path, sql: &str) {
    rusqlite::Connection::open(path)
        .expect("open raw")
        .execute_batch(sql)
        .expect("tamper");
}

fn rows(path: &std::path::Path) -> i64 {
    rusqlite::Connection::open(path)
        .expect("open raw")
        .query_row("SELECT count(*) FROM audit_events", [], |r| r.get(0))
        .expect("count")
}

/// The store is opened on a log whose last event was changed by `sql`: it must refuse, name
/// the head's seq and point at `audit verify`, and add nothing to the file.
fn assert_refused_after(sql: &str, what: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, path) = populated(dir.path(), 3);
    let last = store.audit_head().expect("head").expect("events").seq;
    drop(store);
    tamper(&path, &sql.replace("{last}", &last.to_string()));
    let before = rows(&path);
    let err = match SqliteStore::open(&path) {
        Ok(store) => {
            // What `serve` would have done next: seal a new event onto the changed head.
            store
                .open_task(
                    crate::common::new_task("task-2", "agent-a"),
                    crate::common::t(99),
                )
                .expect("open task");
            drop(store);
            panic!("{what}: the store opened on a changed head and extended the chain");
        }
        Err(e) => e.to_string(),
    };
    assert!(err.contains(&format!("seq {last}")), "{what}: {err}");
    assert!(
        err.contains(&format!("backstop audit verify --db {}", path.display())),
        "{what}: {err}"
    );
    assert_eq!(rows(&path), before, "{what}: nothing was appended");
}

#[test]
fn a_head_event_with_a_wrong_hash_of_the_right_length_is_refused_when_the_store_opens() {
    assert_refused_after(
        "UPDATE audit_events SET hash = zeroblob(32) WHERE seq = {last}",
        "wrong hash",
    );
}

#[test]
fn a_head_after_a_deleted_event_is_refused_when_the_store_opens() {
    assert_refused_after(
        "DELETE FROM audit_events WHERE seq = {last} - 1",
        "deleted event before the head",
    );
}

#[test]
fn a_head_after_an_event_whose_hash_cannot_be_read_is_refused_when_the_store_opens() {
    assert_refused_after(
        "UPDATE audit_events SET hash = hex(hash) WHERE seq = {last} - 1",
        "event before the head with a hash stored as text",
    );
}

#[test]
fn a_head_event_whose_own_hash_is_stored_as_text_is_refused_when_the_store_opens() {
    assert_refused_after(
        "UPDATE audit_events SET hash = lower(hex(hash)) WHERE seq = {last}",
        "head with its hash stored as text",
    );
}

#[test]
fn a_head_event_with_a_changed_column_is_refused_when_the_store_opens() {
    assert_refused_after(
        "UPDATE audit_events SET route = '/v1/refunds' WHERE seq = {last}",
        "changed route",
    );
}

#[test]
fn a_resealed_head_event_that_does_not_link_is_refused_when_the_store_opens() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, path) = populated(dir.path(), 3);
    let mut events = store.audit_events(0, usize::MAX).expect("events");
    drop(store);
    // A forger replaces the head with an event of their own whose hash is right for its
    // content, but whose prev is not the hash of the event before it.
    let mut head = events.pop().expect("events");
    head.method = Some("DELETE".into());
    head.prev = events[0].hash.clone();
    head.hash = head.compute_hash();
    tamper(
        &path,
        &format!(
            "UPDATE audit_events SET method = 'DELETE', prev = x'{}', hash = x'{}' WHERE seq = {}",
            head.prev, head.hash, head.seq
        ),
    );
    let err = SqliteStore::open(&path).expect_err("a head that does not link is refused");
    let text = err.to_string();
    assert!(text.contains(&format!("seq {}", head.seq)), "{text}");
    assert!(text.contains("does not link"), "{text}");
}

#[test]
fn an_untouched_head_opens_and_the_chain_goes_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, path) = populated(dir.path(), 2);
    drop(store);
    let store = SqliteStore::open(&path).expect("reopen an intact log");
    store
        .open_task(
            crate::common::new_task("task-2", "agent-a"),
            crate::common::t(99),
        )
        .expect("append");
    assert!(matches!(
        store.verify_audit(None).expect("verify"),
        Verdict::Intact { count: 6, .. }
    ));
}

#[test]
fn rows_with_seq_zero_or_below_are_breaks_named_by_their_seq() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, path) = populated(dir.path(), 2);
    drop(store);
    // A forged row before the chain's first event, self-consistent or not.
    tamper(
        &path,
        "INSERT INTO audit_events (seq, at, kind, prev, hash)
         SELECT 0, at, 'decision', prev, hash FROM audit_events WHERE seq = 1",
    );
    let found = break_of(
        AuditReader::open(&path)
            .expect("reader")
            .verify(None)
            .expect("verify"),
    );
    assert_eq!(found.kind.as_str(), "inserted", "{found}");
    assert!(
        found.to_string().starts_with("seq 0: inserted: "),
        "{found}"
    );
    assert!(found.detail.contains("outside the chain"), "{found}");

    tamper(
        &path,
        "INSERT INTO audit_events (seq, at, kind, prev, hash)
         SELECT -3, at, 'decision', prev, hash FROM audit_events WHERE seq = 1",
    );
    let found = break_of(
        AuditReader::open(&path)
            .expect("reader")
            .verify(None)
            .expect("verify"),
    );
    assert!(
        found.to_string().starts_with("seq -3: inserted: "),
        "{found}"
    );
    assert!(found.detail.contains("seq -3, 0"), "{found}");
}

#[test]
fn an_exported_event_with_seq_zero_is_outside_the_chain() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, _) = populated(dir.path(), 2);
    let mut events = store.audit_events(0, usize::MAX).expect("events");
    let mut forged = events[0].clone();
    forged.seq = 0;
    forged.hash = forged.compute_hash();
    events.insert(0, forged);
    let found = break_of(verify_events(&events, None));
    assert_eq!(found.kind.as_str(), "inserted", "{found}");
    assert_eq!(
        found.to_string(),
        "seq 0: inserted: seq 0 lies outside the chain, which starts at seq 1"
    );
}

#[test]
fn a_changed_prev_link_is_a_broken_link_not_altered_content() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, path) = populated(dir.path(), 4);
    let events = store.audit_events(0, usize::MAX).expect("events");
    drop(store);
    // seq 5's prev now names seq 3 instead of seq 4; nothing else changed.
    tamper(
        &path,
        &format!(
            "UPDATE audit_events SET prev = x'{}' WHERE seq = 5",
            events[2].hash
        ),
    );
    let found = break_of(
        AuditReader::open(&path)
            .expect("reader")
            .verify(None)
            .expect("verify"),
    );
    assert_eq!(found.kind.as_str(), "broken link", "{found}");
    assert!(
        found.to_string().starts_with("seq 5: broken link: prev "),
        "{found}"
    );
    assert!(found.detail.contains("is not the hash of seq 4"), "{found}");
    assert!(!found.detail.contains("content does not match"), "{found}");

    // The same in an export; a changed field is still altered content.
    let mut relinked = events.clone();
    relinked[0].prev = "ab".repeat(32);
    let found = break_of(verify_events(&relinked, None));
    assert_eq!(found.kind.as_str(), "broken link", "{found}");
    assert!(found.detail.contains("genesis"), "{found}");
    let mut changed = events.clone();
    changed[4].method = Some("PUT".into());
    assert_eq!(
        break_of(verify_events(&changed, None)).kind.as_str(),
        "altered"
    );
}

#[test]
fn an_export_with_upper_case_hex_verifies_as_the_same_digests() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, _) = populated(dir.path(), 3);
    let events = store.audit_events(0, usize::MAX).expect("events");
    let head = store.audit_head().expect("head").expect("events");
    let mut out = Vec::new();
    write_export(&mut out, &events).expect("write");
    let text = String::from_utf8(out).expect("utf-8");
    // A tool upper-cased every hash and prev.
    let upper: String = text
        .lines()
        .map(|line| {
            let mut e: serde_json::Value = serde_json::from_str(line).expect("json");
            for key in ["prev", "hash"] {
                let v = e[key].as_str().expect("hex").to_ascii_uppercase();
                e[key] = serde_json::Value::String(v);
            }
            format!("{e}\n")
        })
        .collect();
    assert_ne!(upper, text);
    let parsed = parse_export("upper.ndjson", &upper).expect("parse");
    assert_eq!(
        verify_events(&parsed, Some(&head.hash.to_ascii_uppercase())),
        Verdict::Intact {
            count: 7,
            head: Some(head)
        }
    );
}

#[test]
fn a_hash_that_differs_only_in_letter_case_is_said_to() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, _) = populated(dir.path(), 2);
    let mut events = store.audit_events(0, usize::MAX).expect("events");
    // Built in memory (an export is lower-cased when read): the recorded hash in upper case.
    events[1].hash = events[1].hash.to_ascii_uppercase();
    let found = break_of(verify_events(&events, None));
    assert_eq!(found.seq, 2);
    assert!(found.detail.contains("only in letter case"), "{found}");
}

#[test]
fn an_expected_head_may_be_the_json_of_audit_head_with_a_byte_order_mark() {
    let hash = "ab".repeat(32);
    let json = format!(
        "{{\"hash\":\"{}\",\"seq\":12}}\n",
        hash.to_ascii_uppercase()
    );
    assert_eq!(parse_expected_head(&json), Ok((Some(12), hash.clone())));
    assert_eq!(
        parse_expected_head(&format!("\u{feff}{json}")),
        Ok((Some(12), hash.clone()))
    );
    assert_eq!(
        parse_expected_head(&format!("\u{feff}12 {hash}\r\n")),
        Ok((Some(12), hash.clone()))
    );
    assert_eq!(
        parse_expected_head(&format!("\u{feff}{hash}")),
        Ok((None, hash.clone()))
    );
    let err = parse_expected_head("{\"seq\":3}").expect_err("no hash");
    assert!(err.contains("no \"hash\" member"), "{err}");
    let err = parse_expected_head("{\"seq\":3,").expect_err("broken JSON");
    assert!(err.contains("audit head --format json"), "{err}");
}

#[test]
fn an_expected_head_from_json_checks_the_log() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, _) = populated(dir.path(), 3);
    let events: Vec<AuditEvent> = store.audit_events(0, usize::MAX).expect("events");
    let head = store.audit_head().expect("head").expect("events");
    let json = serde_json::json!({ "seq": head.seq, "hash": head.hash }).to_string();
    assert!(matches!(
        verify_events(&events, Some(&json)),
        Verdict::Intact { count: 7, .. }
    ));
    let found = break_of(verify_events(&events[..5], Some(&json)));
    assert_eq!((found.seq, found.kind.as_str()), (6, "truncated"));
}
