//! The hash-chained audit log (SPEC §9).
//!
//! Why a chain: the log is evidence ("why were two POSTs sent?" — "same key, provider-mandated
//! delay"). Each event carries the hash of the one before it, so editing, dropping, reordering or
//! inserting an event anywhere breaks every hash after it, and `backstop audit verify` can name
//! the first broken event offline, without any secret. Exporting the head (`seq` + `hash`) and
//! keeping it elsewhere also makes a cut tail detectable.
//!
//! # What an event can hold
//! [`AuditEvent`] has fields for ids (the agent's name among them), provider, scope, route
//! *template*, method, request class,
//! idempotency key, payload *digest*, status and signal (disposition, boundary, source), outcome,
//! scheduler job and due time, scope numbers, escalation decisions, and an attempt's signal
//! headers (Retry-After, `Date` and quota headers only, names and raw values). It has no field for
//! credentials, prompts, request or response bodies, or concrete paths: they cannot be audited by
//! mistake because there is nowhere to put them.
//!
//! # Canonical encoding (exact)
//! The canonical encoding of an event is one JSON object (RFC 8259) in UTF-8:
//! - members are the event's fields **except `hash`**, including `seq` and `prev`;
//! - absent (`None`) fields are omitted; there are no `null`s;
//! - members appear in ascending byte order of their names;
//! - no whitespace anywhere;
//! - integers are plain decimal (no sign for non-negative values, no exponent, no leading zeros);
//! - strings escape only `"` and `\` (as `\"`, `\\`) and U+0000–U+001F (as `\b`, `\f`, `\n`,
//!   `\r`, `\t`, or `\u00XX` with lowercase hex); all other characters are written as UTF-8.
//! - `signal_headers` (the only non-scalar member) is an array of two-string arrays
//!   `[["retry-after","7"],["date","…"]]`, in recorded order, strings as above; it is omitted
//!   when there are none, so events written before it existed encode (and verify) unchanged.
//!   `agent` likewise: events written before store schema 10 have none.
//!
//! `hash` = lowercase hex of SHA-256 (FIPS 180-4) over those bytes. Because `prev` is a member,
//! the hash covers `prev` and the event. The first event has `seq` 1 and `prev` = 64 zeros
//! ([`GENESIS_PREV`]); each later event has `seq` one higher and `prev` = the hash of the event
//! before it. An export line is the same object with `"hash"` added at its sorted position.
//!
//! ```
//! use backstop_store::audit::{AuditEvent, Chain, GENESIS_PREV};
//!
//! let mut chain = Chain::genesis();
//! let mut event = AuditEvent::new("action_requested", "2025-01-01T00:00:00.000Z");
//! event.method = Some("POST".into());
//! chain.seal(&mut event);
//! assert_eq!(event.seq, 1);
//! assert_eq!(event.prev, GENESIS_PREV);
//! assert_eq!(
//!     String::from_utf8(event.canonical()).unwrap(),
//!     format!(r#"{{"at":"2025-01-01T00:00:00.000Z","kind":"action_requested","method":"POST","prev":"{GENESIS_PREV}","seq":1}}"#),
//! );
//! assert_eq!(event.hash, event.compute_hash());
//! ```

use std::borrow::Borrow;

use jiff::Timestamp;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::error::StoreError;

/// `prev` of the first event: 64 ASCII zeros.
pub const GENESIS_PREV: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// The kinds of events the store writes (SPEC §9 plus `task_opened`, `action_finished`,
/// `deadline_exhausted`). The log itself stores the kind as text so that a verifier does not
/// need to know every kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// A task was opened.
    TaskOpened,
    /// An action was recorded with its idempotency key, before any send.
    ActionRequested,
    /// An attempt was durably recorded; its bytes may now leave.
    ActionSent,
    /// An attempt's result (status and signal).
    ActionResult,
    /// An action ended with an outcome not covered by a more specific kind.
    ActionFinished,
    /// A retry was scheduled (scheduler receipt).
    RetryScheduled,
    /// A scheduled retry woke and was claimed.
    RetryStarted,
    /// A scope record changed.
    ScopeUpdated,
    /// An action's side effect is uncertain; reconciliation is required.
    ReconciliationRequired,
    /// Reconciliation found the effect (outcome receipt).
    Reconciled,
    /// A reconciliation lookup was sent to the provider and answered (or failed).
    ReconciliationLookup,
    /// A case file went to a human.
    Escalated,
    /// A human decided an escalation.
    Decision,
    /// A task or action was cancelled.
    Cancelled,
    /// An action ended because its budget ran out.
    BudgetExhausted,
    /// An action ended because its deadline cannot be met.
    DeadlineExhausted,
    /// The circuit breaker opened a path for a task.
    CircuitOpened,
    /// The health watchdog found a throttled action that needs an operator (SPEC §10:
    /// `stuck_missed_wake`, `no_durable_wake`, `early_retry_loop`); `source` names the finding.
    WatchdogFinding,
}

impl EventKind {
    /// The snake_case name written into the log.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::TaskOpened => "task_opened",
            EventKind::ActionRequested => "action_requested",
            EventKind::ActionSent => "action_sent",
            EventKind::ActionResult => "action_result",
            EventKind::ActionFinished => "action_finished",
            EventKind::RetryScheduled => "retry_scheduled",
            EventKind::RetryStarted => "retry_started",
            EventKind::ScopeUpdated => "scope_updated",
            EventKind::ReconciliationRequired => "reconciliation_required",
            EventKind::Reconciled => "reconciled",
            EventKind::ReconciliationLookup => "reconciliation_lookup",
            EventKind::Escalated => "escalated",
            EventKind::Decision => "decision",
            EventKind::Cancelled => "cancelled",
            EventKind::BudgetExhausted => "budget_exhausted",
            EventKind::DeadlineExhausted => "deadline_exhausted",
            EventKind::CircuitOpened => "circuit_opened",
            EventKind::WatchdogFinding => "watchdog_finding",
        }
    }
}

/// Formats an instant as the log writes `at` and other times: RFC 3339, UTC, millisecond
/// precision, e.g. `2025-01-01T00:00:00.000Z` (sub-millisecond digits are truncated).
pub fn format_instant(at: Timestamp) -> String {
    let mut out = String::with_capacity(24);
    format_instant_into(at, &mut out);
    out
}

/// [`format_instant`] into `out`, replacing what it held (and reusing its room).
pub(crate) fn format_instant_into(at: Timestamp, out: &mut String) {
    const PRINTER: jiff::fmt::temporal::DateTimePrinter =
        jiff::fmt::temporal::DateTimePrinter::new().precision(Some(3));
    out.clear();
    // Writing into a String cannot fail.
    let _ = PRINTER.print_timestamp(&at, out);
}

/// One audit event. See the module docs for the canonical encoding and the hash.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditEvent {
    /// Position in the log, from 1, without gaps.
    pub seq: u64,
    /// When the change happened: RFC 3339 UTC with milliseconds.
    pub at: String,
    /// The event kind (see [`EventKind`]).
    pub kind: String,
    /// Task id.
    #[serde(default)]
    pub task: Option<String>,
    /// Action id.
    #[serde(default)]
    pub action: Option<i64>,
    /// The agent whose task or action the event is about (the name its token authenticated
    /// as; task ids are the agent's own, so `task` alone does not say whose). `None` for events
    /// about no agent's work (`scope_updated`) and for events written before store schema 10.
    #[serde(default)]
    pub agent: Option<String>,
    /// Attempt number (1-based).
    #[serde(default)]
    pub attempt: Option<u32>,
    /// Escalation id.
    #[serde(default)]
    pub escalation: Option<i64>,
    /// Provider name.
    #[serde(default)]
    pub provider: Option<String>,
    /// Scope name.
    #[serde(default)]
    pub scope: Option<String>,
    /// Route template (never a concrete path).
    #[serde(default)]
    pub route: Option<String>,
    /// HTTP method.
    #[serde(default)]
    pub method: Option<String>,
    /// Request class.
    #[serde(default)]
    pub request_class: Option<String>,
    /// Idempotency key of the action.
    #[serde(default)]
    pub idempotency_key: Option<String>,
    /// SHA-256 hex of the request payload (never the payload).
    #[serde(default)]
    pub payload_digest: Option<String>,
    /// HTTP status.
    #[serde(default)]
    pub status: Option<u16>,
    /// Disposition of the response (SPEC §2.1).
    #[serde(default)]
    pub disposition: Option<String>,
    /// Boundary: an RFC 3339 instant, or `unknown`.
    #[serde(default)]
    pub boundary: Option<String>,
    /// Source of the signal, e.g. `HTTP 429 Retry-After`.
    #[serde(default)]
    pub source: Option<String>,
    /// Outcome of the action (SPEC §5).
    #[serde(default)]
    pub outcome: Option<String>,
    /// Scheduler job id.
    #[serde(default)]
    pub job: Option<i64>,
    /// When a scheduled retry is due (RFC 3339).
    #[serde(default)]
    pub due_at: Option<String>,
    /// Scope: remaining requests.
    #[serde(default)]
    pub remaining: Option<u64>,
    /// Scope: limit.
    #[serde(default)]
    pub limit: Option<u64>,
    /// Escalation decision.
    #[serde(default)]
    pub decision: Option<String>,
    /// Who decided.
    #[serde(default)]
    pub decided_by: Option<String>,
    /// `action_result`: the response's signal headers as `(lower-case name, raw value)` pairs
    /// (Retry-After, `retry-after-ms`, `Date`, quota headers; never anything else). `None` when
    /// none were kept (a plain success, a transport fault, an event from before schema 5).
    #[serde(default)]
    pub signal_headers: Option<Vec<(String, String)>>,
    /// Hash of the previous event (64 zeros for the first).
    pub prev: String,
    /// SHA-256 hex of the canonical encoding.
    pub hash: String,
}

fn put_str(out: &mut Vec<u8>, first: &mut bool, name: &str, value: Option<&str>) {
    if let Some(v) = value {
        put_key(out, first, name);
        put_json_str(out, v);
    }
}

/// Whether `bytes` hold a byte the encoding escapes (a control character, `"` or `\\`).
/// Looks at 16 bytes at a time without stopping inside a block, which the compiler turns into
/// vector compares.
fn needs_escape(bytes: &[u8]) -> bool {
    bytes.chunks(16).any(|block| {
        block.iter().fold(false, |found, &b| {
            found | (b < 0x20) | (b == b'"') | (b == b'\\')
        })
    })
}

/// Writes `s` as a JSON string with the escaping documented above. A string with nothing to
/// escape (almost every one) is copied as it is; any other goes through serde_json, which
/// writes RFC 8259 strings with exactly that minimal escaping.
fn put_json_str(out: &mut Vec<u8>, s: &str) {
    if needs_escape(s.as_bytes()) {
        let _ = serde_json::to_writer(&mut *out, s);
        return;
    }
    out.reserve(s.len() + 2);
    out.push(b'"');
    out.extend_from_slice(s.as_bytes());
    out.push(b'"');
}

/// An array of `[name, value]` string pairs; omitted when `None` or empty.
fn put_pairs(out: &mut Vec<u8>, first: &mut bool, name: &str, value: Option<&[(String, String)]>) {
    let Some(pairs) = value.filter(|p| !p.is_empty()) else {
        return;
    };
    put_key(out, first, name);
    out.push(b'[');
    for (i, (k, v)) in pairs.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.push(b'[');
        put_json_str(out, k);
        out.push(b',');
        put_json_str(out, v);
        out.push(b']');
    }
    out.push(b']');
}

fn put_int<T: itoa::Integer>(out: &mut Vec<u8>, first: &mut bool, name: &str, value: Option<T>) {
    if let Some(v) = value {
        put_key(out, first, name);
        out.extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
    }
}

fn put_key(out: &mut Vec<u8>, first: &mut bool, name: &str) {
    if !*first {
        out.push(b',');
    }
    *first = false;
    out.push(b'"');
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b"\":");
}

impl AuditEvent {
    /// A draft event of `kind` at `at` (an RFC 3339 string, see [`format_instant`]); `seq`,
    /// `prev` and `hash` are filled in by [`Chain::seal`].
    pub fn new(kind: &str, at: &str) -> Self {
        AuditEvent {
            kind: kind.to_owned(),
            at: at.to_owned(),
            ..AuditEvent::default()
        }
    }

    /// Writes the canonical encoding (or, with `with_hash`, the export line without newline).
    pub fn encode_into(&self, out: &mut Vec<u8>, with_hash: bool) {
        let mut first = true;
        let f = &mut first;
        out.push(b'{');
        put_int(out, f, "action", self.action);
        put_str(out, f, "agent", self.agent.as_deref());
        put_str(out, f, "at", Some(&self.at));
        put_int(out, f, "attempt", self.attempt);
        put_str(out, f, "boundary", self.boundary.as_deref());
        put_str(out, f, "decided_by", self.decided_by.as_deref());
        put_str(out, f, "decision", self.decision.as_deref());
        put_str(out, f, "disposition", self.disposition.as_deref());
        put_str(out, f, "due_at", self.due_at.as_deref());
        put_int(out, f, "escalation", self.escalation);
        if with_hash {
            put_str(out, f, "hash", Some(&self.hash));
        }
        put_str(out, f, "idempotency_key", self.idempotency_key.as_deref());
        put_int(out, f, "job", self.job);
        put_str(out, f, "kind", Some(&self.kind));
        put_int(out, f, "limit", self.limit);
        put_str(out, f, "method", self.method.as_deref());
        put_str(out, f, "outcome", self.outcome.as_deref());
        put_str(out, f, "payload_digest", self.payload_digest.as_deref());
        put_str(out, f, "prev", Some(&self.prev));
        put_str(out, f, "provider", self.provider.as_deref());
        put_int(out, f, "remaining", self.remaining);
        put_str(out, f, "request_class", self.request_class.as_deref());
        put_str(out, f, "route", self.route.as_deref());
        put_str(out, f, "scope", self.scope.as_deref());
        put_int(out, f, "seq", Some(self.seq));
        put_pairs(out, f, "signal_headers", self.signal_headers.as_deref());
        put_str(out, f, "source", self.source.as_deref());
        put_int(out, f, "status", self.status);
        put_str(out, f, "task", self.task.as_deref());
        out.push(b'}');
    }

    /// The canonical encoding (without `hash`).
    pub fn canonical(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(ENCODED_CAPACITY);
        self.encode_into(&mut out, false);
        out
    }

    /// One NDJSON export line (canonical members plus `hash`, no trailing newline).
    pub fn export_line(&self) -> String {
        let mut out = Vec::with_capacity(320);
        self.encode_into(&mut out, true);
        // The encoder only writes UTF-8.
        String::from_utf8_lossy(&out).into_owned()
    }

    /// SHA-256 hex over the canonical encoding (what `hash` must be).
    pub fn compute_hash(&self) -> String {
        let mut buf = Vec::with_capacity(ENCODED_CAPACITY);
        self.hash_with(&mut buf)
    }

    fn hash_with(&self, buf: &mut Vec<u8>) -> String {
        let mut hash = String::with_capacity(64);
        self.hash_into(buf, &mut hash);
        hash
    }

    /// Writes the hash into `hash`, replacing what it held, and returns its bytes; `buf` is
    /// room for the encoding.
    fn hash_into(&self, buf: &mut Vec<u8>, hash: &mut String) -> [u8; DIGEST_BYTES] {
        buf.clear();
        self.encode_into(buf, false);
        let digest: [u8; DIGEST_BYTES] = Sha256::digest(buf.as_slice()).into();
        hash.clear();
        push_lower_hex(hash, &digest);
        digest
    }

    /// Parses one export line. A `prev` or `hash` of 64 hex digits is read in either letter
    /// case and kept lower-cased, as the chain writes it: the digest is the same, so an export
    /// whose hex a tool upper-cased still verifies (anything else is kept as it is, and
    /// verification reports it).
    ///
    /// # Errors
    /// The `serde_json` message when the line is not an audit event object (unknown members
    /// are refused: an added member is a change to the event).
    pub fn from_export_line(line: &str) -> Result<Self, String> {
        let mut event: AuditEvent = serde_json::from_str(line).map_err(|e| e.to_string())?;
        for digest in [&mut event.prev, &mut event.hash] {
            if digest.len() == 2 * DIGEST_BYTES && digest.bytes().all(|b| b.is_ascii_hexdigit()) {
                digest.make_ascii_lowercase();
            }
        }
        Ok(event)
    }
}

/// Room for the canonical encoding of an action's event (≈ 350 bytes with `prev`), so that
/// encoding it does not grow the buffer.
const ENCODED_CAPACITY: usize = 512;

/// Appends `bytes` to `out` as lower-case hex, two digits a byte, through the `hex` crate's
/// slice encoder (no allocation besides `out`'s own growth). Used for the chain's hashes and,
/// by the gateway, for payload digests and minted ids.
pub fn push_lower_hex(out: &mut String, bytes: &[u8]) {
    let mut digits = [0u8; 64];
    out.reserve(bytes.len() * 2);
    for chunk in bytes.chunks(digits.len() / 2) {
        let digits = &mut digits[..chunk.len() * 2];
        // The slice is exactly twice the chunk, and hex digits are ASCII.
        if hex::encode_to_slice(chunk, digits).is_ok() {
            out.push_str(std::str::from_utf8(digits).unwrap_or_default());
        }
    }
}

/// The head of a chain: the last event's `seq` and `hash`, for anchoring elsewhere.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainHead {
    /// Sequence number of the last event.
    pub seq: u64,
    /// Its hash.
    pub hash: String,
}

/// Bytes of a SHA-256 digest: an event's `hash` and `prev` are their lower-case hex.
pub(crate) const DIGEST_BYTES: usize = 32;

/// The bytes whose lower-case hex is `text`, when `text` is exactly 64 lower-case hex digits
/// (the only form the chain writes); `None` otherwise, upper case included, so that bytes
/// turned back into hex always give `text` again.
pub(crate) fn digest_of_hex(text: &str) -> Option<[u8; DIGEST_BYTES]> {
    let lower = text.len() == 2 * DIGEST_BYTES
        && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    let mut digest = [0; DIGEST_BYTES];
    (lower && hex::decode_to_slice(text, &mut digest).is_ok()).then_some(digest)
}

/// The bytes of a sealed event's `prev` and `hash`, as a store keeps them (the event itself
/// holds their hex).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SealedDigests {
    /// `prev`'s bytes; `None` when `prev` is not 64 hex digits (only after a hand-made
    /// [`ChainHead`], see [`Chain::after`]).
    pub(crate) prev: Option<[u8; DIGEST_BYTES]>,
    /// `hash`'s bytes.
    pub(crate) hash: [u8; DIGEST_BYTES],
}

/// The writer's view of the chain: the next `seq` and the hash to use as `prev` (as hex, and as
/// its bytes when it is 64 hex digits).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chain {
    next_seq: u64,
    prev: String,
    prev_digest: Option<[u8; DIGEST_BYTES]>,
}

impl Chain {
    /// An empty log.
    pub fn genesis() -> Self {
        Chain {
            next_seq: 1,
            prev: GENESIS_PREV.to_owned(),
            prev_digest: Some([0; DIGEST_BYTES]),
        }
    }

    /// Continues after `head` (or from genesis when the log is empty).
    pub fn after(head: Option<&ChainHead>) -> Self {
        match head {
            None => Chain::genesis(),
            Some(h) => Chain {
                next_seq: h.seq + 1,
                prev: h.hash.clone(),
                prev_digest: digest_of_hex(&h.hash),
            },
        }
    }

    /// Assigns `seq`, `prev` and `hash` to a draft event and advances the chain. An event
    /// sealed before (refilled for the next one) keeps the room of its `prev` and `hash`.
    pub fn seal(&mut self, event: &mut AuditEvent) {
        self.seal_digests(event);
    }

    /// [`Chain::seal`], returning the bytes of the event's `prev` and `hash` (so that a store
    /// keeping them as bytes need not decode the hex it was just given).
    pub(crate) fn seal_digests(&mut self, event: &mut AuditEvent) -> SealedDigests {
        event.seq = self.next_seq;
        event.prev.clone_from(&self.prev);
        let mut buf = Vec::with_capacity(ENCODED_CAPACITY);
        let mut hash = std::mem::take(&mut event.hash);
        let digest = event.hash_into(&mut buf, &mut hash);
        event.hash = hash;
        self.prev.clone_from(&event.hash);
        let sealed = SealedDigests {
            prev: self.prev_digest,
            hash: digest,
        };
        self.prev_digest = Some(digest);
        self.next_seq += 1;
        sealed
    }

    /// The `seq` of the last sealed event (0 for an empty log).
    pub fn last_seq(&self) -> u64 {
        self.next_seq - 1
    }
}

/// How a log is broken, in the words `backstop audit verify` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakKind {
    /// The event's own hash does not match its content.
    Altered,
    /// A `seq` is absent from the log.
    Missing,
    /// Events appear out of `seq` order.
    Reordered,
    /// A duplicate or extra event, an event outside the chain (`seq` 0 or below), or an event
    /// whose own hash is valid but which does not link to its predecessor.
    Inserted,
    /// The event's `prev` is not the hash of the event before it, while the rest of the event
    /// matches its hash with the right `prev`: only the link was changed.
    BrokenLink,
    /// The log ends before the expected head.
    Truncated,
}

impl BreakKind {
    /// The word printed for this break.
    pub fn as_str(self) -> &'static str {
        match self {
            BreakKind::Altered => "altered",
            BreakKind::Missing => "missing",
            BreakKind::Reordered => "reordered",
            BreakKind::Inserted => "inserted",
            BreakKind::BrokenLink => "broken link",
            BreakKind::Truncated => "truncated",
        }
    }
}

/// The first broken place in a log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainBreak {
    /// The first bad `seq`. Signed: a row a database holds outside the chain may have a `seq`
    /// of 0 or below.
    pub seq: i64,
    /// What is wrong there.
    pub kind: BreakKind,
    /// One-line explanation.
    pub detail: String,
}

impl std::fmt::Display for ChainBreak {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "seq {}: {}: {}",
            self.seq,
            self.kind.as_str(),
            self.detail
        )
    }
}

/// The result of verifying a readable log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Every event checks out.
    Intact {
        /// Number of events.
        count: u64,
        /// The last event, or `None` for an empty log.
        head: Option<ChainHead>,
    },
    /// The first break found.
    Broken(ChainBreak),
}

/// Verifies a complete log (from `seq` 1) offline.
///
/// `seqs` are the `seq` values of all events in source order (a cheap first pass over the
/// source); they let a gap be told apart from a reordering. `events` yields the same events in
/// the same order. `expect_head` is a previously exported head, as printed by `backstop audit
/// head` (`SEQ HASH`) or the hash alone (see [`parse_expected_head`]): the log must contain that
/// hash (at that `seq`, when given), else its tail was cut (`truncated`) or events before it
/// were removed (`missing`) or added (`inserted`). An `expect_head` that does not parse is
/// never found (`truncated`); callers validate it first with [`parse_expected_head`].
///
/// Rules, checked per event in order: a `seq` that occurs more than once → `inserted`; a `seq`
/// lower than expected → `reordered`; higher than expected → `reordered` when the expected
/// `seq` appears later (`inserted` when the `seq` is beyond the log's length), else `missing`;
/// `seq` 0 → `inserted` (the chain starts at 1); own hash wrong → `broken link` when the event
/// matches its hash once its `prev` is the previous hash (only the link was changed), else
/// `altered`; own hash right but `prev` not the previous hash → `inserted`. An event the source
/// cannot decode ([`StoreError::UndecodableEvent`]) → `altered` at its `seq`. Hashes compare as
/// lower-case hex (what the chain writes); a recorded hash that differs from the computed one
/// only in letter case is said to.
///
/// # Errors
/// Whatever `events` yields as an error (an unreadable source) is passed through.
pub fn verify_chain<I, B>(
    seqs: &[u64],
    events: I,
    expect_head: Option<&str>,
) -> Result<Verdict, StoreError>
where
    I: IntoIterator<Item = Result<B, StoreError>>,
    B: Borrow<AuditEvent>,
{
    let mut expected: u64 = 1;
    let mut prev = GENESIS_PREV.to_owned();
    let mut head_search = HeadSearch::new(expect_head);
    let mut buf = Vec::with_capacity(320);
    let mut count: u64 = 0;
    for (position, event) in events.into_iter().enumerate() {
        let event = match event {
            Ok(event) => event,
            // A row that cannot even be decoded was changed after it was written.
            Err(StoreError::UndecodableEvent { seq, reason }) => {
                return Ok(Verdict::Broken(ChainBreak {
                    seq: signed(seq),
                    kind: BreakKind::Altered,
                    detail: format!(
                        "seq {seq} cannot be decoded: {reason}; the row was changed or damaged \
                         after it was written"
                    ),
                }))
            }
            Err(e) => return Err(e),
        };
        let event: &AuditEvent = event.borrow();
        let found = out_of_place(seqs, position, event, expected)
            .or_else(|| misfit(event, &prev, expected, &mut buf));
        if let Some(found) = found {
            return Ok(Verdict::Broken(found));
        }
        head_search.observe(event);
        prev.clear();
        prev.push_str(&event.hash);
        expected += 1;
        count += 1;
    }
    if let Some(found) = head_search.not_found(expected, expect_head) {
        return Ok(Verdict::Broken(found));
    }
    let head = (count > 0).then(|| ChainHead {
        seq: expected - 1,
        hash: prev,
    });
    Ok(Verdict::Intact { count, head })
}

/// The break when `event`, at `position` in the source, is not the `expected` one (see
/// [`verify_chain`] for the rules), or `None`.
fn out_of_place(
    seqs: &[u64],
    position: usize,
    event: &AuditEvent,
    expected: u64,
) -> Option<ChainBreak> {
    let broken = |kind, detail| {
        Some(ChainBreak {
            seq: signed(event.seq),
            kind,
            detail,
        })
    };
    if event.seq == 0 {
        return broken(
            BreakKind::Inserted,
            "seq 0 lies outside the chain, which starts at seq 1".to_owned(),
        );
    }
    if event.seq == expected {
        return None;
    }
    let occurrences = seqs.iter().filter(|&&s| s == event.seq).count();
    if occurrences > 1 {
        return broken(
            BreakKind::Inserted,
            format!("seq {} occurs {occurrences} times", event.seq),
        );
    }
    if event.seq < expected {
        return broken(
            BreakKind::Reordered,
            format!("seq {} comes after seq {}", event.seq, expected - 1),
        );
    }
    let later = seqs.get(position + 1..).unwrap_or(&[]);
    if later.contains(&expected) {
        if event.seq > seqs.len() as u64 {
            return broken(
                BreakKind::Inserted,
                format!(
                    "seq {} is beyond the log's {} events",
                    event.seq,
                    seqs.len()
                ),
            );
        }
        return broken(
            BreakKind::Reordered,
            format!("seq {} appears before seq {expected}", event.seq),
        );
    }
    Some(ChainBreak {
        seq: signed(expected),
        kind: BreakKind::Missing,
        detail: format!(
            "seq {expected} is absent (the next event is seq {})",
            event.seq
        ),
    })
}

/// The break when `event` (the `expected` seq) does not match its own hash or does not link to
/// `prev`, the hash before it; or `None`. `buf` is room for the encoding.
fn misfit(event: &AuditEvent, prev: &str, expected: u64, buf: &mut Vec<u8>) -> Option<ChainBreak> {
    let hash = event.hash_with(buf);
    let linked = event.prev == prev;
    let (kind, detail) = if hash != event.hash {
        unmatched_hash(event, prev, &hash, expected, buf)
    } else if !linked {
        let (recorded, expected_prev) = distinct(&event.prev, prev);
        (
            BreakKind::Inserted,
            format!(
                "prev {recorded} does not link to {} ({expected_prev}); an event was \
                 inserted or replaced here",
                link_target(expected),
            ),
        )
    } else {
        return None;
    };
    Some(ChainBreak {
        seq: signed(event.seq),
        kind,
        detail,
    })
}

/// What is wrong with `event`, whose content does not match its recorded hash (`hash` is the
/// computed one): only its link (`broken link`), or its content (`altered`).
fn unmatched_hash(
    event: &AuditEvent,
    prev: &str,
    hash: &str,
    expected: u64,
    buf: &mut Vec<u8>,
) -> (BreakKind, String) {
    let linked = event.prev == prev;
    if !linked {
        // Put the right link back: when the event then matches its hash, only its `prev` was
        // changed, not its content.
        let relinked = AuditEvent {
            prev: prev.to_owned(),
            ..event.clone()
        };
        if relinked.hash_with(buf) == event.hash {
            let (recorded, expected_prev) = distinct(&event.prev, prev);
            return (
                BreakKind::BrokenLink,
                format!(
                    "prev {recorded} is not {} ({expected_prev}); with that prev the event \
                     matches its hash, so its link was changed, not its content",
                    link_target(expected),
                ),
            );
        }
    }
    let (recorded, computed) = distinct(&event.hash, hash);
    let detail = if hash.eq_ignore_ascii_case(&event.hash) {
        format!(
            "hash {recorded} differs from the computed {computed} only in letter case; the chain \
             writes lower-case hex"
        )
    } else if linked {
        format!("content does not match its hash ({recorded} recorded, {computed} computed)")
    } else {
        format!(
            "content does not match its hash ({recorded} recorded, {computed} computed), and its \
             prev is not {} either",
            link_target(expected),
        )
    };
    (BreakKind::Altered, detail)
}

/// The search along a log for the head it is expected to contain (`--expect-head`).
struct HeadSearch {
    /// The expected head: its `seq` when given, and its hash.
    wanted: Option<(Option<u64>, String)>,
    /// Whether it was found (at its `seq`, when given).
    seen: bool,
    /// The seq at which the expected hash was found when it is not the expected seq.
    elsewhere: Option<u64>,
}

impl HeadSearch {
    /// The search for `expect_head` (see [`verify_chain`]).
    fn new(expect_head: Option<&str>) -> Self {
        let wanted = expect_head.map(|h| parse_expected_head(h).unwrap_or((None, h.to_owned())));
        // The genesis value is the head of an empty log (seq 0), and so is part of every log.
        let seen = wanted
            .as_ref()
            .is_none_or(|(seq, hash)| hash == GENESIS_PREV && seq.is_none_or(|s| s == 0));
        HeadSearch {
            wanted,
            seen,
            elsewhere: None,
        }
    }

    /// Looks for the head at `event`, the next event of an intact chain.
    fn observe(&mut self, event: &AuditEvent) {
        if let Some((seq, hash)) = self.wanted.as_ref().filter(|_| !self.seen) {
            if *hash == event.hash {
                match seq {
                    Some(seq) if *seq != event.seq => self.elsewhere = Some(event.seq),
                    _ => self.seen = true,
                }
            }
        }
    }

    /// The break when the head was not found in the intact chain that ends before `expected`,
    /// or `None`; `expect_head` as given to [`verify_chain`].
    fn not_found(&self, expected: u64, expect_head: Option<&str>) -> Option<ChainBreak> {
        if self.seen {
            return None;
        }
        if let (Some(found), Some((Some(seq), hash))) = (self.elsewhere, &self.wanted) {
            let (kind, what) = if found > *seq {
                (BreakKind::Inserted, "added")
            } else {
                (BreakKind::Missing, "removed")
            };
            return Some(ChainBreak {
                seq: signed(found.min(*seq)),
                kind,
                detail: format!(
                    "expected head {} is at seq {found}, not seq {seq}: events before it were \
                     {what}",
                    short(hash)
                ),
            });
        }
        Some(ChainBreak {
            seq: signed(expected),
            kind: BreakKind::Truncated,
            detail: format!(
                "expected head {} not found: the log (ending at seq {}) was truncated before it, \
                 or the head belongs to another log",
                self.wanted
                    .as_ref()
                    .map_or(expect_head.unwrap_or_default(), |(_, hash)| hash),
                expected - 1,
            ),
        })
    }
}

/// Reads an expected chain head for `backstop audit verify --expect-head`: the hash alone (64
/// hex digits), the `SEQ HASH` line `backstop audit head` prints (a decimal `seq`, whitespace,
/// the hash), or the object `backstop audit head --format json` prints (`{"seq":N,"hash":"…"}`;
/// `seq` may be left out). A leading UTF-8 byte-order mark and surrounding whitespace are
/// ignored, and hex digits are read in either case (the hash is returned lower-cased).
///
/// # Errors
/// A one-line reason when the text is none of these forms.
pub fn parse_expected_head(text: &str) -> Result<(Option<u64>, String), String> {
    let text = text.trim_start_matches('\u{feff}').trim();
    if text.starts_with('{') {
        return parse_head_json(text);
    }
    let parts: Vec<&str> = text.split_whitespace().collect();
    let (seq, hash) = match parts.as_slice() {
        [hash] => (None, *hash),
        [seq, hash] => {
            let seq = seq
                .parse::<u64>()
                .ok()
                .filter(|_| seq.bytes().all(|b| b.is_ascii_digit()))
                .ok_or_else(|| format!("seq {seq:?} is not a decimal number"))?;
            (Some(seq), *hash)
        }
        _ => {
            return Err(format!(
                "expected 64 hex digits, `SEQ HASH` as printed by `audit head`, or its \
                 `--format json` object, got {text:?}"
            ))
        }
    };
    Ok((seq, head_hash(hash)?))
}

/// The hash of an expected head, lower-cased.
fn head_hash(hash: &str) -> Result<String, String> {
    if hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!("hash: expected 64 hex digits, got {hash:?}"));
    }
    Ok(hash.to_ascii_lowercase())
}

/// The `{"seq":N,"hash":"…"}` form of [`parse_expected_head`] (other members are ignored).
fn parse_head_json(text: &str) -> Result<(Option<u64>, String), String> {
    #[derive(Deserialize)]
    struct Head {
        #[serde(default)]
        seq: Option<u64>,
        hash: Option<String>,
    }
    let head: Head = serde_json::from_str(text).map_err(|e| {
        format!("not the JSON object `audit head --format json` prints ({e}), got {text:?}")
    })?;
    let Some(hash) = head.hash else {
        return Err(format!(
            "the JSON object has no \"hash\" member (as `audit head --format json` prints), got {text:?}"
        ));
    };
    Ok((head.seq, head_hash(&hash)?))
}

/// A chain position as [`ChainBreak::seq`] holds it.
fn signed(seq: u64) -> i64 {
    i64::try_from(seq).unwrap_or(i64::MAX)
}

/// What the `prev` of the event at `seq` must be, in words: the hash of the event before it,
/// or the genesis value for the first.
fn link_target(seq: u64) -> String {
    match seq {
        0 | 1 => "the genesis value (64 zeros)".to_owned(),
        _ => format!("the hash of seq {}", seq - 1),
    }
}

fn short(hash: &str) -> &str {
    hash.get(..12).unwrap_or(hash)
}

/// Two digests that differ, each cut to the same length that still tells them apart: 12 hex
/// characters, or up to the first that differs and 3 more when they share a longer prefix
/// (whole when shorter).
pub(crate) fn distinct<'a>(a: &'a str, b: &'a str) -> (&'a str, &'a str) {
    let common = a
        .char_indices()
        .zip(b.chars())
        .find(|((_, x), y)| x != y)
        .map_or(a.len().min(b.len()), |((i, _), _)| i);
    let keep = (common + 4).max(12);
    let cut = |s: &'a str| s.get(..keep).unwrap_or(s);
    (cut(a), cut(b))
}

/// Reads an NDJSON export (one event per line) into events. A leading UTF-8 byte-order mark and
/// blank lines (e.g. a trailing empty line added by an editor) are skipped; line numbers in
/// errors still count them. An export cut mid-line is an error here, as any other bad line; see
/// [`read_export`] to tell it apart.
///
/// `place` names the source in errors (a file name).
///
/// # Errors
/// [`StoreError::BadExportLine`] naming the 1-based line when a line is not UTF-8 JSON of an
/// audit event.
pub fn parse_export(place: &str, text: &str) -> Result<Vec<AuditEvent>, StoreError> {
    let export = read_export(place, text)?;
    match export.cut {
        Some(cut) => Err(StoreError::BadExportLine {
            place: place.to_owned(),
            line: cut.line,
            reason: cut.reason,
        }),
        None => Ok(export.events),
    }
}

/// The last line of an NDJSON export when it ends without its newline and its JSON ends early
/// (`serde_json` reports an end of input inside it): the export was cut while it was written
/// or copied, not edited.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CutLine {
    /// 1-based line number (blank lines count).
    pub line: usize,
    /// Why it does not parse, e.g. `EOF while parsing a string at line 1 column 80`.
    pub reason: String,
}

/// An NDJSON export read by [`read_export`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Export {
    /// The whole events, in file order.
    pub events: Vec<AuditEvent>,
    /// The cut last line, when the export ends in one.
    pub cut: Option<CutLine>,
}

/// Reads an NDJSON export as [`parse_export`] does, except that a last line which lacks its
/// terminating newline and whose JSON ends early is returned as [`Export::cut`] rather than
/// as an error: that is what an export cut mid-line looks like, and [`verify_export`] reports
/// it as `truncated`. An unterminated last line that is whole JSON is read as any other line.
///
/// # Errors
/// [`StoreError::BadExportLine`] naming the 1-based line when any other line is not UTF-8 JSON
/// of an audit event.
pub fn read_export(place: &str, text: &str) -> Result<Export, StoreError> {
    let mut events = Vec::new();
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let terminated = text.ends_with('\n');
    let mut lines = text.lines().enumerate().peekable();
    while let Some((i, line)) = lines.next() {
        if line.trim().is_empty() {
            continue;
        }
        match AuditEvent::from_export_line(line) {
            Ok(event) => events.push(event),
            Err(reason) => {
                let last = lines.peek().is_none() && !terminated;
                if last
                    && serde_json::from_str::<serde_json::Value>(line).is_err_and(|e| e.is_eof())
                {
                    return Ok(Export {
                        events,
                        cut: Some(CutLine {
                            line: i + 1,
                            reason,
                        }),
                    });
                }
                return Err(StoreError::BadExportLine {
                    place: place.to_owned(),
                    line: i + 1,
                    reason,
                });
            }
        }
    }
    Ok(Export { events, cut: None })
}

/// Verifies an export read by [`read_export`]: its whole events as [`verify_events`] does and,
/// when it ends in a cut line, a [`BreakKind::Truncated`] break at the seq after the last whole
/// event, naming the line. A break among the whole events comes first (it is the first bad
/// seq); an expected head not among them is reported as the cut, which explains it.
pub fn verify_export(export: &Export, expect_head: Option<&str>) -> Verdict {
    let verdict = verify_events(&export.events, expect_head);
    let Some(cut) = &export.cut else {
        return verdict;
    };
    let head_missing = match verdict {
        Verdict::Broken(b) if b.kind != BreakKind::Truncated => return Verdict::Broken(b),
        Verdict::Broken(_) => "; the expected head is not among the whole events",
        Verdict::Intact { .. } => "",
    };
    let last = export.events.last().map_or(0, |e| e.seq);
    let after = match last {
        0 => "before its first event".to_owned(),
        seq => format!("after seq {seq}, its last whole event"),
    };
    Verdict::Broken(ChainBreak {
        seq: signed(last.saturating_add(1)),
        kind: BreakKind::Truncated,
        detail: format!(
            "line {} ends without a newline and is not a whole event ({}): the export was cut \
             {after}{head_missing}",
            cut.line, cut.reason
        ),
    })
}

/// Verifies events already in memory (e.g. a parsed export). See [`verify_chain`].
pub fn verify_events(events: &[AuditEvent], expect_head: Option<&str>) -> Verdict {
    let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
    match verify_chain(&seqs, events.iter().map(Ok), expect_head) {
        Ok(v) => v,
        // The iterator above never yields an error.
        Err(e) => Verdict::Broken(ChainBreak {
            seq: 0,
            kind: BreakKind::Altered,
            detail: e.to_string(),
        }),
    }
}

/// Writes events as NDJSON (one [`AuditEvent::export_line`] per line).
///
/// # Errors
/// The writer's I/O error.
pub fn write_export<'a, W: std::io::Write>(
    out: &mut W,
    events: impl IntoIterator<Item = &'a AuditEvent>,
) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(512);
    for e in events {
        buf.clear();
        e.encode_into(&mut buf, true);
        buf.push(b'\n');
        out.write_all(&buf)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{distinct, push_lower_hex, AuditEvent, Chain, ChainHead, DIGEST_BYTES};

    #[test]
    fn two_digests_are_shown_long_enough_to_differ() {
        let a = "0123456789abcdef0123456789abcdef";
        // Differing early: the usual 12 characters.
        assert_eq!(
            distinct(a, "f123456789abcdef"),
            ("0123456789ab", "f123456789ab")
        );
        // Sharing 20 characters: the first that differs and 3 more (or to the end).
        assert_eq!(
            distinct(a, "0123456789abcdef0123X"),
            ("0123456789abcdef01234567", "0123456789abcdef0123X")
        );
        // One a prefix of the other: the shorter whole.
        assert_eq!(
            distinct(a, "0123456789abcdef"),
            (&a[..20], "0123456789abcdef")
        );
    }

    #[test]
    fn sealed_digests_are_the_bytes_of_the_hex_the_event_holds() {
        let mut chain = Chain::genesis();
        let mut first = AuditEvent::new("task_opened", "2025-01-01T00:00:00.000Z");
        let sealed = chain.seal_digests(&mut first);
        assert_eq!(sealed.prev, Some([0; DIGEST_BYTES]));
        assert_eq!(hex::encode(sealed.prev.unwrap_or_default()), first.prev);
        assert_eq!(hex::encode(sealed.hash), first.hash);
        let mut second = AuditEvent::new("action_requested", "2025-01-01T00:00:00.001Z");
        let next = chain.seal_digests(&mut second);
        assert_eq!(next.prev, Some(sealed.hash));
        assert_eq!(hex::encode(next.hash), second.hash);
        // A chain continued from its head gives the same bytes as the one that sealed it.
        let head = ChainHead {
            seq: 2,
            hash: second.hash.clone(),
        };
        assert_eq!(Chain::after(Some(&head)), chain);
        // A hand-made head that is not lower-case hex has no bytes: they would read back as
        // another text.
        let upper = ChainHead {
            seq: 2,
            hash: second.hash.to_ascii_uppercase(),
        };
        let mut third = AuditEvent::new("action_sent", "2025-01-01T00:00:00.002Z");
        assert_eq!(
            Chain::after(Some(&upper)).seal_digests(&mut third).prev,
            None
        );
    }

    #[test]
    fn lower_hex_of_any_length_is_what_the_hex_crate_encodes() {
        for len in [0usize, 1, 8, 31, 32, 33, 40, 64, 65] {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 37 + 11) as u8).collect();
            let mut out = String::from("prefix-");
            push_lower_hex(&mut out, &bytes);
            assert_eq!(
                out,
                format!("prefix-{}", hex::encode(&bytes)),
                "{len} bytes"
            );
        }
    }
}
