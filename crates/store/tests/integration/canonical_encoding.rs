//! The canonical encoding of an audit event, byte for byte: it is what every hash of every log
//! covers, so it must never change. Checked against an encoding of the same members by
//! `serde_json` (sorted object keys, no whitespace, its minimal string escaping), and against
//! the hash of a fixed event written by earlier builds.

use backstop_store::audit::{AuditEvent, Chain, GENESIS_PREV};
use sha2::{Digest, Sha256};

/// Every character class the encoding treats differently: each control character, the two
/// escaped ASCII characters, DEL, and multi-byte UTF-8.
fn awkward_text() -> String {
    let mut text: String = (0u8..0x20).map(char::from).collect();
    text.push_str("\"quoted\" back\\slash / \u{7f} é ✓ 🦀 plain");
    text
}

/// An event with every member set, its text members from `text`, its integers from `n`.
fn full_event(text: &str, n: u64) -> AuditEvent {
    let signed = i64::try_from(n).unwrap_or(i64::MAX);
    let mut e = AuditEvent::new(&format!("kind {text}"), &format!("at {text}"));
    e.task = Some(format!("task {text}"));
    e.action = Some(signed);
    e.agent = Some(format!("agent {text}"));
    e.attempt = Some(u32::try_from(n).unwrap_or(u32::MAX));
    e.escalation = Some(-signed);
    e.provider = Some(format!("provider {text}"));
    e.scope = Some(format!("scope {text}"));
    e.route = Some(format!("/route/{text}"));
    e.method = Some(text.to_owned());
    e.request_class = Some(String::new());
    e.idempotency_key = Some(format!("key {text}"));
    e.payload_digest = Some(format!("digest {text}"));
    e.status = Some(u16::try_from(n).unwrap_or(u16::MAX));
    e.disposition = Some(format!("disposition {text}"));
    e.boundary = Some(format!("boundary {text}"));
    e.source = Some(format!("source {text}"));
    e.outcome = Some(format!("outcome {text}"));
    e.job = Some(signed);
    e.due_at = Some(format!("due {text}"));
    e.remaining = Some(n);
    e.limit = Some(n / 3);
    e.decision = Some(format!("decision {text}"));
    e.decided_by = Some(format!("decided by {text}"));
    e.signal_headers = Some(vec![
        (format!("name {text}"), format!("value {text}")),
        ("retry-after".into(), "7".into()),
    ]);
    e.seq = n;
    e.prev = format!("prev {text}");
    e
}

/// The canonical encoding as `serde_json` writes the same members: a map with sorted keys.
fn reference(e: &AuditEvent) -> Vec<u8> {
    let mut value = serde_json::to_value(ExportShape(e)).expect("encodable");
    let members = value.as_object_mut().expect("an object");
    members.retain(|_, v| !v.is_null());
    if members
        .get("signal_headers")
        .is_some_and(|h| h.as_array().is_some_and(Vec::is_empty))
    {
        members.remove("signal_headers");
    }
    serde_json::to_vec(&value).expect("encodable")
}

/// The members of an event without `hash`, for `serde_json`.
struct ExportShape<'a>(&'a AuditEvent);

impl serde::Serialize for ExportShape<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let e = self.0;
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("seq", &e.seq)?;
        m.serialize_entry("at", &e.at)?;
        m.serialize_entry("kind", &e.kind)?;
        m.serialize_entry("task", &e.task)?;
        m.serialize_entry("action", &e.action)?;
        m.serialize_entry("agent", &e.agent)?;
        m.serialize_entry("attempt", &e.attempt)?;
        m.serialize_entry("escalation", &e.escalation)?;
        m.serialize_entry("provider", &e.provider)?;
        m.serialize_entry("scope", &e.scope)?;
        m.serialize_entry("route", &e.route)?;
        m.serialize_entry("method", &e.method)?;
        m.serialize_entry("request_class", &e.request_class)?;
        m.serialize_entry("idempotency_key", &e.idempotency_key)?;
        m.serialize_entry("payload_digest", &e.payload_digest)?;
        m.serialize_entry("status", &e.status)?;
        m.serialize_entry("disposition", &e.disposition)?;
        m.serialize_entry("boundary", &e.boundary)?;
        m.serialize_entry("source", &e.source)?;
        m.serialize_entry("outcome", &e.outcome)?;
        m.serialize_entry("job", &e.job)?;
        m.serialize_entry("due_at", &e.due_at)?;
        m.serialize_entry("remaining", &e.remaining)?;
        m.serialize_entry("limit", &e.limit)?;
        m.serialize_entry("decision", &e.decision)?;
        m.serialize_entry("decided_by", &e.decided_by)?;
        m.serialize_entry("signal_headers", &e.signal_headers)?;
        m.serialize_entry("prev", &e.prev)?;
        m.end()
    }
}

#[test]
fn every_member_encodes_as_serde_json_writes_it_sorted_and_without_whitespace() {
    let text = awkward_text();
    for n in [0, 1, 9, 10, 99, 65_535, 4_294_967_295, u64::MAX] {
        for text in [text.as_str(), "", "plain ascii"] {
            let e = full_event(text, n);
            let canonical = e.canonical();
            assert_eq!(
                String::from_utf8_lossy(&canonical),
                String::from_utf8_lossy(&reference(&e)),
                "n = {n}, text {text:?}"
            );
            let digest = Sha256::digest(&canonical);
            let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
            assert_eq!(e.compute_hash(), hex);
        }
    }
}

#[test]
fn one_character_to_escape_is_escaped_wherever_it_stands() {
    for c in ['\0', '\n', '\u{1f}', '"', '\\'] {
        for len in [1, 15, 16, 17, 33] {
            for at in 0..len {
                let text: String = (0..len).map(|i| if i == at { c } else { 'a' }).collect();
                let mut e = AuditEvent::new("kind", "at");
                e.task = Some(text.clone());
                e.signal_headers = Some(vec![(text.clone(), text.clone())]);
                assert_eq!(e.canonical(), reference(&e), "{text:?}");
            }
        }
    }
}

#[test]
fn a_sparse_event_leaves_out_what_is_not_set() {
    let mut e = AuditEvent::new("task_opened", "2025-01-01T00:00:00.000Z");
    e.task = Some("t".into());
    e.signal_headers = Some(Vec::new());
    Chain::genesis().seal(&mut e);
    assert_eq!(
        String::from_utf8_lossy(&e.canonical()),
        format!(
            r#"{{"at":"2025-01-01T00:00:00.000Z","kind":"task_opened","prev":"{GENESIS_PREV}","seq":1,"task":"t"}}"#
        )
    );
    assert_eq!(e.canonical(), reference(&e));
}

#[test]
fn the_hashes_of_a_fixed_chain_are_those_earlier_builds_wrote() {
    let mut chain = Chain::genesis();
    let mut hashes = Vec::new();
    for n in [1, 4_294_967_295] {
        let mut e = full_event(&awkward_text(), n);
        // Earlier builds had no `agent` member: an event without one hashes as they wrote it.
        e.agent = None;
        chain.seal(&mut e);
        hashes.push(e.hash);
    }
    assert_eq!(hashes, GOLDEN);
}

/// The hashes the chain of `the_hashes_of_a_fixed_chain_are_those_earlier_builds_wrote` had
/// when written by the build before the encoder was rewritten (commit 89ad1bc).
const GOLDEN: [&str; 2] = [
    "c3efc00e94c53b43cfc79d6a7d46e7f8351e22bac2070cbc60f3e88e6245d372",
    "dadba8e89a1693bc59583adb81232b162a623d3338543ffec22942754a7feefe",
];
