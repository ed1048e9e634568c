//! The hash chain: canonical encoding, and `verify` naming the first broken event for each
//! kind of tampering.

use backstop_store::audit::{
    format_instant, parse_expected_head, parse_export, verify_events, write_export, AuditEvent,
    BreakKind, Chain, Verdict, GENESIS_PREV,
};
use backstop_store::Store;

use crate::common::{open_task, populated, t};

fn export(store: &backstop_store::SqliteStore) -> Vec<AuditEvent> {
    store.audit_events(0, usize::MAX).expect("events")
}

/// The details of a break, for checking what `audit verify` says about it.
fn break_of(v: Verdict) -> backstop_store::audit::ChainBreak {
    match v {
        Verdict::Broken(b) => b,
        Verdict::Intact { count, .. } => panic!("expected a break, log of {count} verified"),
    }
}

fn broken(v: Verdict) -> (i64, BreakKind) {
    let b = break_of(v);
    (b.seq, b.kind)
}

#[test]
fn canonical_encoding_has_sorted_keys_no_whitespace_and_no_hash() {
    let mut e = AuditEvent::new("action_result", &format_instant(t(0)));
    e.task = Some("task \"1\"\n".into());
    e.status = Some(429);
    e.action = Some(7);
    e.boundary = Some("unknown".into());
    Chain::genesis().seal(&mut e);
    let text = String::from_utf8(e.canonical()).expect("utf-8");
    assert_eq!(
        text,
        format!(
            r#"{{"action":7,"at":"2025-06-15T15:06:40.000Z","boundary":"unknown","kind":"action_result","prev":"{GENESIS_PREV}","seq":1,"status":429,"task":"task \"1\"\n"}}"#
        )
    );
    let value: serde_json::Value = serde_json::from_str(&e.export_line()).expect("json");
    let keys: Vec<&String> = value.as_object().expect("object").keys().collect();
    assert_eq!(keys.len(), 9);
    assert!(keys.contains(&&"hash".to_owned()));
    // The export line round-trips to the same event.
    assert_eq!(
        AuditEvent::from_export_line(&e.export_line()).expect("parse"),
        e
    );
}

#[test]
fn instants_are_rfc3339_utc_with_milliseconds() {
    let at = jiff::Timestamp::from_millisecond(1_700_000_000_123).expect("instant");
    assert_eq!(format_instant(at), "2023-11-14T22:13:20.123Z");
    let whole = jiff::Timestamp::from_second(1_700_000_000).expect("instant");
    assert_eq!(format_instant(whole), "2023-11-14T22:13:20.000Z");
}

#[test]
fn untouched_log_verifies_with_count_and_head() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, _) = populated(dir.path(), 5);
    let events = export(&store);
    // task_opened + 5 × (action_requested, action_sent)
    assert_eq!(events.len(), 11);
    let head = store.audit_head().expect("head").expect("non-empty");
    assert_eq!(head.seq, 11);
    assert_eq!(
        verify_events(&events, Some(&head.hash)),
        Verdict::Intact {
            count: 11,
            head: Some(head.clone())
        }
    );
    assert_eq!(
        store.verify_audit(Some(&head.hash)).expect("verify db"),
        Verdict::Intact {
            count: 11,
            head: Some(head)
        }
    );
}

#[test]
fn one_changed_field_is_altered_at_its_seq() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, _) = populated(dir.path(), 5);
    let mut events = export(&store);
    events[6].method = Some("PUT".into());
    assert_eq!(
        broken(verify_events(&events, None)),
        (7, BreakKind::Altered)
    );
}

#[test]
fn a_deleted_event_is_missing_at_its_seq() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, _) = populated(dir.path(), 5);
    let mut events = export(&store);
    events.remove(4); // seq 5
    assert_eq!(
        broken(verify_events(&events, None)),
        (5, BreakKind::Missing)
    );
}

#[test]
fn two_swapped_events_are_reordered() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, _) = populated(dir.path(), 5);
    let mut events = export(&store);
    events.swap(3, 4); // seq 4 and 5
    assert_eq!(
        broken(verify_events(&events, None)),
        (5, BreakKind::Reordered)
    );
}

#[test]
fn an_inserted_event_with_a_valid_own_hash_is_inserted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, _) = populated(dir.path(), 5);
    let mut events = export(&store);
    // A forger copies seq 4, changes it, and re-seals it so its own hash is valid and it links
    // to seq 3; the genuine seq 4 follows.
    let mut forged = events[3].clone();
    forged.method = Some("DELETE".into());
    let mut chain = Chain::after(Some(&backstop_store::audit::ChainHead {
        seq: 3,
        hash: events[2].hash.clone(),
    }));
    chain.seal(&mut forged);
    events.insert(3, forged);
    assert_eq!(
        broken(verify_events(&events, None)),
        (4, BreakKind::Inserted)
    );
}

#[test]
fn a_renumbered_insertion_breaks_the_prev_link() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, _) = populated(dir.path(), 3);
    let mut events = export(&store);
    // Insert a self-consistent event at seq 3 and renumber the rest without re-chaining them.
    let mut forged = AuditEvent::new("decision", &events[2].at);
    forged.seq = 3;
    forged.prev = events[1].hash.clone();
    forged.hash = forged.compute_hash();
    for e in events.iter_mut().skip(2) {
        e.seq += 1;
        e.hash = e.compute_hash();
    }
    events.insert(2, forged);
    // seq 3 (forged) links fine; seq 4's prev still points at the old seq 2.
    assert_eq!(
        broken(verify_events(&events, None)),
        (4, BreakKind::Inserted)
    );
}

#[test]
fn a_cut_tail_is_truncated_against_the_previous_head() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, _) = populated(dir.path(), 5);
    let events = export(&store);
    let head = store.audit_head().expect("head").expect("non-empty");
    let cut = &events[..8];
    // Without the anchor the shorter log is self-consistent …
    assert!(matches!(
        verify_events(cut, None),
        Verdict::Intact { count: 8, .. }
    ));
    // … with it, the cut is found.
    assert_eq!(
        broken(verify_events(cut, Some(&head.hash))),
        (9, BreakKind::Truncated)
    );
    // A log that grew past the anchored head is fine.
    let older_head = events[5].hash.clone();
    assert!(matches!(
        verify_events(&events, Some(&older_head)),
        Verdict::Intact { count: 11, .. }
    ));
}

/// A database's log wiped whole, or cut at its end, is found without an anchored head: every
/// action row is written with its `action_requested` event, so an action newer than every
/// audited one proves the cut.
#[test]
fn a_wiped_or_cut_log_in_a_database_is_truncated_even_without_a_head() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, path) = populated(dir.path(), 4);
    let count = store.audit_events(0, 1_000).expect("events").len() as i64;
    assert!(matches!(
        store.verify_audit(None).expect("verify"),
        Verdict::Intact { .. }
    ));
    drop(store);
    // The newest action's events cut off: a shorter chain, whole in itself.
    let newest_requested: i64 = rusqlite::Connection::open(&path)
        .expect("open")
        .query_row(
            "SELECT MAX(seq) FROM audit_events WHERE kind = 'action_requested'",
            [],
            |r| r.get(0),
        )
        .expect("seq");
    let reader = tamper(
        &path,
        &format!("DELETE FROM audit_events WHERE seq >= {newest_requested}"),
    );
    assert_eq!(
        broken(reader.verify(None).expect("verify")),
        (newest_requested, BreakKind::Truncated)
    );
    assert!(count > newest_requested);
    let reader = tamper(&path, "DELETE FROM audit_events");
    assert_eq!(
        broken(reader.verify(None).expect("verify")),
        (1, BreakKind::Truncated)
    );
}

/// A log cut just after an action's `action_requested` (its `action_sent` and later events
/// gone) still has every action's request, but the store's attempt, escalation and decision
/// rows, each written with its event, prove the cut.
#[test]
fn a_log_cut_after_an_action_requested_is_truncated_by_the_rows_it_lost() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, path) = populated(dir.path(), 3);
    let newest_requested: i64 = rusqlite::Connection::open(&path)
        .expect("open")
        .query_row(
            "SELECT MAX(seq) FROM audit_events WHERE kind = 'action_requested'",
            [],
            |r| r.get(0),
        )
        .expect("seq");
    let escalation = store
        .open_escalation(
            backstop_store::ActionId(1),
            serde_json::json!({"case": 1}),
            t(20),
        )
        .expect("escalate");
    store
        .decide_escalation(escalation, "send_new", "alice", None, t(21))
        .expect("decide");
    assert!(matches!(
        store.verify_audit(None).expect("verify"),
        Verdict::Intact { .. }
    ));
    drop(store);
    let seq_of = |kind: &str| -> i64 {
        rusqlite::Connection::open(&path)
            .expect("open")
            .query_row(
                "SELECT seq FROM audit_events WHERE kind = ?1",
                [kind],
                |r| r.get(0),
            )
            .expect("seq")
    };
    let (escalated, decision) = (seq_of("escalated"), seq_of("decision"));

    // The decision's event cut off: the escalation row says it was decided.
    let b = break_of(
        tamper(
            &path,
            &format!("DELETE FROM audit_events WHERE seq >= {decision}"),
        )
        .verify(None)
        .expect("verify"),
    );
    assert_eq!((b.seq, b.kind), (decision, BreakKind::Truncated));
    assert!(
        b.detail
            .contains("1 decided escalations, but the log has a `decision` event for 0"),
        "{}",
        b.detail
    );

    // The escalation's event cut off too: the escalation row is newer than every `escalated`.
    let b = break_of(
        tamper(
            &path,
            &format!("DELETE FROM audit_events WHERE seq >= {escalated}"),
        )
        .verify(None)
        .expect("verify"),
    );
    assert_eq!((b.seq, b.kind), (escalated, BreakKind::Truncated));
    assert!(b.detail.contains("the store records escalation 1, but the log's newest `escalated` event is for escalation 0"), "{}", b.detail);

    // Cut just after the newest action's `action_requested`: its attempt row has no event.
    let b = break_of(
        tamper(
            &path,
            &format!("DELETE FROM audit_events WHERE seq > {newest_requested}"),
        )
        .verify(None)
        .expect("verify"),
    );
    assert_eq!(
        (b.seq, b.kind),
        (newest_requested + 1, BreakKind::Truncated)
    );
    assert!(
        b.detail
            .contains("the store records 3 attempts, but the log has 2 `action_sent` events"),
        "{}",
        b.detail
    );
}

/// A task opened with no action yet has only its `task_opened` event: a log cut just before
/// it, or a log wiped whole while the store holds tasks but no action, still has every action's
/// events, but the store's task rows, each written with its event, prove the cut.
#[test]
fn a_log_cut_before_a_task_opened_is_truncated_by_the_task_rows_it_lost() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, path) = populated(dir.path(), 2);
    open_task(&store, "task-2");
    assert!(matches!(
        store.verify_audit(None).expect("verify"),
        Verdict::Intact { .. }
    ));
    drop(store);
    let opened: i64 = rusqlite::Connection::open(&path)
        .expect("open")
        .query_row(
            "SELECT MAX(seq) FROM audit_events WHERE kind = 'task_opened'",
            [],
            |r| r.get(0),
        )
        .expect("seq");
    let b = break_of(
        tamper(
            &path,
            &format!("DELETE FROM audit_events WHERE seq >= {opened}"),
        )
        .verify(None)
        .expect("verify"),
    );
    assert_eq!((b.seq, b.kind), (opened, BreakKind::Truncated));
    assert!(
        b.detail
            .contains("the store records 2 tasks, but the log has 1 `task_opened` events"),
        "{}",
        b.detail
    );

    // Tasks but no action at all: a wiped log is an empty chain, the task row proves the cut.
    let only_tasks = tempfile::tempdir().expect("tempdir");
    let (store, path) = populated(only_tasks.path(), 0);
    drop(store);
    let b = break_of(
        tamper(&path, "DELETE FROM audit_events")
            .verify(None)
            .expect("verify"),
    );
    assert_eq!((b.seq, b.kind), (1, BreakKind::Truncated));
    assert!(
        b.detail
            .contains("the store records 1 tasks, but the log has 0 `task_opened` events"),
        "{}",
        b.detail
    );
}

#[test]
fn export_round_trips_through_ndjson() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, _) = populated(dir.path(), 3);
    let events = export(&store);
    let mut out = Vec::new();
    write_export(&mut out, &events).expect("write");
    let text = String::from_utf8(out).expect("utf-8");
    assert_eq!(text.lines().count(), events.len());
    assert_eq!(parse_export("x.ndjson", &text).expect("parse"), events);
    let err = parse_export("x.ndjson", &format!("{text}{{\"seq\":\n")).expect_err("bad line");
    assert!(
        err.to_string()
            .starts_with(&format!("x.ndjson: line {}:", events.len() + 1)),
        "{err}"
    );
}

#[test]
fn editing_the_database_is_found_by_verify() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, path) = populated(dir.path(), 4);
    drop(store);
    let reader = tamper(
        &path,
        "UPDATE audit_events SET route = '/v1/refunds' WHERE seq = 3",
    );
    assert_eq!(
        broken(reader.verify(None).expect("verify")),
        (3, BreakKind::Altered)
    );
    let reader = tamper(&path, "DELETE FROM audit_events WHERE seq = 6");
    assert_eq!(
        broken(reader.verify(None).expect("verify")),
        (3, BreakKind::Altered)
    );
    let reader = tamper(&path, "DELETE FROM audit_events WHERE seq = 3");
    assert_eq!(
        broken(reader.verify(None).expect("verify")),
        (3, BreakKind::Missing)
    );
}

/// Runs `sql` on the closed database at `path` behind the store's back, then opens a reader.
fn tamper(path: &std::path::Path, sql: &str) -> backstop_store::AuditReader {
    rusqlite::Connection::open(path)
        .expect("open raw")
        .execute(sql, [])
        .expect("tamper");
    backstop_store::AuditReader::open(path).expect("reader")
}

#[test]
fn undecodable_column_is_an_altered_event_named_by_seq() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, path) = populated(dir.path(), 4);
    drop(store);
    // A status that does not fit the u16 column type, and a text where a number belongs.
    let reader = tamper(
        &path,
        "UPDATE audit_events SET status = 99999999999 WHERE seq = 7",
    );
    let verdict = reader
        .verify(None)
        .expect("verify reports a break, not an error");
    assert_eq!(broken(verdict), (7, BreakKind::Altered));
    let mut out = Vec::new();
    let err = reader.export(0, &mut out).expect_err("export stops");
    assert!(err.to_string().contains("seq 7"), "{err}");

    let reader = tamper(
        &path,
        "UPDATE audit_events SET status = 'oops' WHERE seq = 5",
    );
    assert_eq!(
        broken(reader.verify(None).expect("verify")),
        (5, BreakKind::Altered)
    );
}

#[test]
fn export_with_bom_and_blank_lines_still_parses() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, _) = populated(dir.path(), 2);
    let events = export(&store);
    let mut out = Vec::new();
    write_export(&mut out, &events).expect("write");
    let text = String::from_utf8(out).expect("utf-8");
    let edited = format!("\u{feff}\n{}\n\n  \n", text.replace('\n', "\n\n"));
    assert_eq!(parse_export("x.ndjson", &edited).expect("parse"), events);
}

#[test]
fn expected_head_not_in_the_log_says_truncated_or_another_log() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, _) = populated(dir.path(), 2);
    let events = export(&store);
    let foreign = "ab".repeat(32);
    match verify_events(&events, Some(&foreign)) {
        Verdict::Broken(b) => {
            assert_eq!(b.kind, BreakKind::Truncated);
            assert!(
                b.detail
                    .starts_with(&format!("expected head {foreign} not found: ")),
                "{}",
                b.detail
            );
            assert!(
                b.detail
                    .ends_with("was truncated before it, or the head belongs to another log"),
                "{}",
                b.detail
            );
        }
        other => panic!("expected a break, got {other:?}"),
    }
}

#[test]
fn a_directory_is_not_a_database() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Err(err) = backstop_store::AuditReader::open(dir.path()) else {
        panic!("a directory is refused");
    };
    assert!(
        err.to_string()
            .ends_with("is a directory, not a database file"),
        "{err}"
    );
}

#[test]
fn expected_head_in_the_seq_hash_form_of_audit_head_checks_the_seq_too() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, _) = populated(dir.path(), 5);
    let events = export(&store);
    let sixth = &events[5];
    assert_eq!(sixth.seq, 6);
    let line = |seq: u64| format!("{seq} {}", sixth.hash);
    assert!(matches!(
        verify_events(&events, Some(&line(6))),
        Verdict::Intact { count: 11, .. }
    ));
    // The printed line of `audit head`, trailing newline and upper case included.
    let printed = format!("6 {}\n", sixth.hash.to_ascii_uppercase());
    assert!(matches!(
        verify_events(&events, Some(&printed)),
        Verdict::Intact { .. }
    ));
    // The hash sits later than anchored: events were added before it.
    assert_eq!(
        broken(verify_events(&events, Some(&line(5)))),
        (5, BreakKind::Inserted)
    );
    // Earlier than anchored: events were removed before it.
    assert_eq!(
        broken(verify_events(&events, Some(&line(7)))),
        (6, BreakKind::Missing)
    );
    // A cut tail is still truncated.
    let head = store.audit_head().expect("head").expect("non-empty");
    let anchored = format!("{} {}", head.seq, head.hash);
    assert_eq!(
        broken(verify_events(&events[..8], Some(&anchored))),
        (9, BreakKind::Truncated)
    );
    // The empty log's head `0 000…0` is part of every log.
    assert!(matches!(
        verify_events(&events, Some(&format!("0 {GENESIS_PREV}"))),
        Verdict::Intact { .. }
    ));
}

#[test]
fn expected_head_parses_the_hash_alone_or_seq_and_hash() {
    let hash = "ab".repeat(32);
    assert_eq!(parse_expected_head(&hash), Ok((None, hash.clone())));
    assert_eq!(
        parse_expected_head(&format!(" 12\t{} \n", hash.to_ascii_uppercase())),
        Ok((Some(12), hash.clone()))
    );
    for bad in [
        String::new(),
        "xyz".to_owned(),
        format!("+3 {hash}"),
        format!("-1 {hash}"),
        format!("1 {hash} extra"),
        format!("1 {}", &hash[..63]),
    ] {
        let err = parse_expected_head(&bad).expect_err(&bad);
        assert!(!err.is_empty());
    }
}

#[test]
fn a_stored_digest_that_is_not_32_bytes_is_an_altered_event_named_by_seq() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, path) = populated(dir.path(), 4);
    drop(store);
    let reader = tamper(
        &path,
        "UPDATE audit_events SET prev = x'0102' WHERE seq = 4",
    );
    let found = break_of(
        reader
            .verify(None)
            .expect("verify reports a break, not an error"),
    );
    assert_eq!((found.seq, found.kind), (4, BreakKind::Altered));
    assert!(
        found
            .detail
            .contains("prev is 2 bytes, not the 32 of a SHA-256 digest"),
        "{}",
        found.detail
    );
    let mut out = Vec::new();
    let err = reader.export(0, &mut out).expect_err("export stops");
    assert!(err.to_string().contains("seq 4"), "{err}");

    // The digest as hex text (the form before schema 8) is not taken for the digest either.
    let reader = tamper(
        &path,
        "UPDATE audit_events SET hash = lower(hex(hash)) WHERE seq = 2",
    );
    let found = break_of(reader.verify(None).expect("verify"));
    assert_eq!((found.seq, found.kind), (2, BreakKind::Altered));
    assert!(
        found
            .detail
            .contains("hash is stored as text, not as a 32-byte BLOB"),
        "{}",
        found.detail
    );
}

#[test]
fn a_damaged_head_digest_is_refused_naming_its_seq() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, path) = populated(dir.path(), 2);
    let last = store.audit_head().expect("head").expect("events").seq;
    drop(store);
    let reader = tamper(
        &path,
        &format!("UPDATE audit_events SET hash = zeroblob(31) WHERE seq = {last}"),
    );
    let err = reader.head().expect_err("no head from a damaged digest");
    assert!(
        err.to_string().contains(&format!(
            "seq {last}, cannot be decoded (hash is 31 bytes, not the 32"
        )),
        "{err}"
    );
    assert!(
        err.to_string().contains("backstop audit verify --db"),
        "{err}"
    );
    drop(reader);
    // The writer does not continue a chain from it.
    let Err(err) = backstop_store::SqliteStore::open_existing(&path) else {
        panic!("the store opened on a damaged head");
    };
    assert!(err.to_string().contains(&format!("seq {last}")), "{err}");
}

#[test]
fn stored_digests_are_32_byte_blobs_printed_as_lower_case_hex() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, path) = populated(dir.path(), 2);
    let events = export(&store);
    let head = store.audit_head().expect("head").expect("events");
    drop(store);
    let conn = rusqlite::Connection::open(&path).expect("open raw");
    let (prev, hash): (Vec<u8>, Vec<u8>) = conn
        .query_row(
            "SELECT prev, hash FROM audit_events WHERE seq = ?1",
            [head.seq as i64],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .expect("raw row");
    assert_eq!(hex::encode(&hash), head.hash);
    assert_eq!(head.hash.len(), 64);
    assert!(head
        .hash
        .bytes()
        .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')));
    let last = events.last().expect("events");
    assert_eq!(hex::encode(&prev), last.prev);
    assert_eq!(last.hash, head.hash);
    assert_eq!(last.hash, last.compute_hash());
}

#[test]
fn a_watcher_passes_over_an_undecodable_event_instead_of_failing_on_it_forever() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, path) = populated(dir.path(), 4);
    let all = export(&store);
    drop(store);
    // A middle event altered behind the store's back; the head stays intact, so it opens.
    tamper(
        &path,
        "UPDATE audit_events SET prev = x'0102' WHERE seq = 4",
    );
    let store = backstop_store::SqliteStore::open(&path).expect("reopen");
    let (page, last) = store.watch_events(0, 1000).expect("the page is served");
    assert_eq!(
        last,
        all.last().map(|e| e.seq),
        "the page ends past the altered event"
    );
    assert!(
        page.iter().all(|e| e.seq != 4),
        "the altered event is left out"
    );
    assert!(
        page.iter().any(|e| e.seq > 4),
        "events after it are still handed over: {page:?}"
    );
    // Continuing from the returned seq: nothing is served twice and nothing fails.
    let (rest, after) = store.watch_events(last.expect("last"), 1000).expect("next");
    assert!(rest.is_empty() && after.is_none(), "{rest:?} {after:?}");
}
