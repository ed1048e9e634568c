//! An attempt keeps what its response said: the boundary it normalized to and its signal
//! headers (Retry-After, Date, quota headers), stored with the attempt and carried by its
//! `action_result` event, whose chain still verifies (offline, from an export too).

use backstop_store::audit::{parse_export, verify_events, write_export, BreakKind, Verdict};
use backstop_store::{AttemptResult, Boundary, Disposition, Finish, Outcome, SqliteStore, Store};

use crate::common::{open_task, record, t};

fn pairs(items: &[(&str, &str)]) -> Vec<(String, String)> {
    items
        .iter()
        .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
        .collect()
}

fn throttle_headers() -> Vec<(String, String)> {
    pairs(&[
        ("retry-after", "7"),
        ("date", "Sun, 15 Jun 2025 15:06:40 GMT"),
        ("x-ratelimit-remaining-requests", "0"),
        ("ratelimit", "\"default\";r=0;t=7"),
    ])
}

#[test]
fn a_throttled_attempt_keeps_its_boundary_and_headers_and_a_plain_success_keeps_none() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("s.db");
    let store = SqliteStore::open(&path).expect("open");
    open_task(&store, "task-1");
    let id = record(&store, "task-1", "k-1", b"x");
    store.mark_attempt_sent(id, t(10)).expect("sent");
    store
        .record_result(
            AttemptResult {
                action: id,
                attempt: 1,
                status: Some(429),
                disposition: Disposition::RateLimited,
                boundary: Some(Boundary::At(t(7_020))),
                source: Some("Retry-After".into()),
                provider_operation_id: None,
                signal_headers: throttle_headers(),
                finish: None,
            },
            t(20),
        )
        .expect("throttled result");
    store.mark_attempt_sent(id, t(7_100)).expect("retry sent");
    store
        .record_result(
            AttemptResult {
                action: id,
                attempt: 2,
                status: Some(200),
                disposition: Disposition::Success,
                boundary: Some(Boundary::Unknown),
                source: None,
                provider_operation_id: None,
                signal_headers: Vec::new(),
                finish: Some(Finish {
                    outcome: Outcome::Succeeded,
                    context: serde_json::json!({}),
                    response: None,
                }),
            },
            t(7_200),
        )
        .expect("success");

    let attempts = store.attempts(id).expect("attempts");
    assert_eq!(attempts[0].boundary, Some(Boundary::At(t(7_020))));
    assert_eq!(attempts[0].signal_headers, throttle_headers());
    assert_eq!(attempts[1].boundary, Some(Boundary::Unknown));
    assert!(attempts[1].signal_headers.is_empty());

    let events = store.audit_events(0, usize::MAX).expect("events");
    let results: Vec<_> = events
        .iter()
        .filter(|e| e.kind == "action_result")
        .collect();
    assert_eq!(results.len(), 2);
    assert_eq!(results[0].signal_headers, Some(throttle_headers()));
    assert_eq!(
        results[1].signal_headers, None,
        "a plain success carries none"
    );
    let line = results[0].export_line();
    assert!(
        line.contains(r#""signal_headers":[["retry-after","7"],["date","#),
        "{line}"
    );

    // The chain verifies in the database and from an export, and a changed header breaks it.
    assert!(matches!(
        store.verify_audit(None).expect("verify"),
        Verdict::Intact { .. }
    ));
    let mut export = Vec::new();
    write_export(&mut export, &events).expect("export");
    let text = String::from_utf8(export).expect("utf-8");
    let parsed = parse_export("export.ndjson", &text).expect("parse");
    assert_eq!(parsed, events);
    assert!(matches!(
        verify_events(&parsed, None),
        Verdict::Intact { .. }
    ));
    let tampered = text.replace(r#"["retry-after","7"]"#, r#"["retry-after","1"]"#);
    assert_ne!(tampered, text);
    let parsed = parse_export("export.ndjson", &tampered).expect("parse");
    match verify_events(&parsed, None) {
        Verdict::Broken(b) => {
            assert_eq!(b.kind, BreakKind::Altered);
            assert_eq!(Some(b.seq), Some(results[0].seq as i64));
        }
        other => panic!("a changed Retry-After must break the chain: {other:?}"),
    }
    drop(store);

    // Reopened, the attempt still says the same.
    let store = SqliteStore::open_existing(&path).expect("reopen");
    assert_eq!(
        store.attempts(id).expect("attempts")[0].signal_headers,
        throttle_headers()
    );
}

#[test]
fn an_event_without_signal_headers_encodes_as_before() {
    // The canonical encoding of an event that never had the member is unchanged, so logs
    // written before it existed keep their hashes.
    let mut event =
        backstop_store::audit::AuditEvent::new("action_result", "2025-01-01T00:00:00.000Z");
    event.status = Some(429);
    let before = String::from_utf8(event.canonical()).expect("utf-8");
    assert!(!before.contains("signal_headers"));
    event.signal_headers = Some(Vec::new());
    assert_eq!(
        String::from_utf8(event.canonical()).expect("utf-8"),
        before,
        "an empty list is omitted like an absent one"
    );
    event.signal_headers = Some(pairs(&[("retry-after", "a\"b")]));
    let with = String::from_utf8(event.canonical()).expect("utf-8");
    assert!(
        with.contains(r#""seq":0,"signal_headers":[["retry-after","a\"b"]],"status":429"#),
        "{with}"
    );
}
