//! Reconciliation of uncertain writes through configured lookups (SPEC §6).
//!
//! Why reconcile instead of resending: a write whose request bytes left but whose answer never
//! arrived (`uncertain`, SPEC §2.1) may already have moved money, sent a message or started a
//! deployment. Resending it blind is how agents pay twice. backstop therefore keeps one stable
//! idempotency key per logical action ([`mint_idempotency_key`], [`validate_idempotency_key`]),
//! optionally places a client-generated external reference into the payload
//! ([`ensure_external_reference`]), and after an uncertain attempt asks the provider through the
//! route's configured lookup ([`lookup_request`], [`interpret_lookup`]) before anything else may
//! happen. [`next_step_after_uncertain`] is the whole SPEC §6 rule in one function:
//!
//! | key honoured | lookup | verdict | next step |
//! |---|---|---|---|
//! | any | yes | not asked yet | [`UncertainNextStep::Lookup`] |
//! | any | yes | found | [`UncertainNextStep::Succeeded`] (reconciled, provider id stored) |
//! | yes | yes | not found | [`UncertainNextStep::RetrySameKey`] |
//! | no | yes | not found | [`UncertainNextStep::Escalate`] |
//! | any | yes | inconclusive | [`UncertainNextStep::Escalate`] |
//! | yes | no | — | [`UncertainNextStep::RetrySameKey`] (the provider deduplicates) |
//! | no | no | — | [`UncertainNextStep::Escalate`]: never resent automatically |
//!
//! Everything here is pure: the caller supplies randomness, payload bytes and lookup responses.
//!
//! ```
//! use backstop_core::policy::{Reconcile, ReconcileBy};
//! use backstop_core::reconcile::{
//!     interpret_lookup, lookup_request, next_step_after_uncertain, LookupVerdict,
//!     UncertainNextStep,
//! };
//!
//! let reconcile = Reconcile {
//!     by: ReconcileBy::ExternalReference,
//!     lookup_method: "GET".into(),
//!     lookup_path: "/v1/transfers?reference={ref}".into(),
//!     external_reference_pointer: Some("/metadata/reference".into()),
//!     found_pointer: Some("/data/0".into()),
//!     operation_id_pointer: Some("/data/0/id".into()),
//! };
//! let request = lookup_request(&reconcile, None, Some("ref 7/a"), None).unwrap();
//! assert_eq!(request.path_and_query, "/v1/transfers?reference=ref%207%2Fa");
//!
//! let verdict = interpret_lookup(&reconcile, 200, br#"{"data":[{"id":"tr_1"}]}"#);
//! assert_eq!(verdict, LookupVerdict::Found { operation_id: Some("tr_1".into()) });
//! assert_eq!(
//!     next_step_after_uncertain(false, true, Some(&verdict)),
//!     UncertainNextStep::Succeeded { operation_id: Some("tr_1".into()) }
//! );
//! ```

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::policy::{Reconcile, ReconcileBy};

/// Longest idempotency key accepted from an agent, in bytes (Stripe's documented limit; the IETF
/// Idempotency-Key draft leaves the length to the resource).
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 255;

/// Why a reconciliation input was refused. Each variant names the place and the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReconcileError {
    /// The agent's `Idempotency-Key` is unusable.
    #[error("Idempotency-Key: {reason}")]
    InvalidIdempotencyKey {
        /// What is wrong with it (the key itself is not echoed).
        reason: String,
    },
    /// The payload must be a JSON document to carry an external reference.
    #[error("payload: not JSON, so no external reference can be read or placed at `{pointer}`: {reason}")]
    PayloadNotJson {
        /// The configured pointer.
        pointer: String,
        /// The parser's complaint.
        reason: String,
    },
    /// The configured JSON pointer cannot hold an external reference in this payload.
    #[error("external_reference_pointer `{pointer}`: {reason}")]
    PointerNotWritable {
        /// The configured pointer.
        pointer: String,
        /// Why (e.g. the parent is an array, or the value there is an object).
        reason: String,
    },
    /// The lookup template needs a value the caller does not have.
    #[error("reconcile lookup `{lookup}`: no value for `{placeholder}`")]
    MissingLookupValue {
        /// The lookup template (`METHOD path`).
        lookup: String,
        /// The placeholder without a value (`{key}`, `{ref}` or `{operation_id}`).
        placeholder: &'static str,
    },
    /// The lookup template holds a placeholder backstop cannot fill.
    #[error("reconcile lookup `{lookup}`: unknown placeholder `{placeholder}` (use {{key}}, {{ref}} or {{operation_id}})")]
    UnknownPlaceholder {
        /// The lookup template (`METHOD path`).
        lookup: String,
        /// The unknown placeholder, braces included.
        placeholder: String,
    },
}

// ---------------------------------------------------------------------------------------------
// Idempotency keys

/// Mints the idempotency key of one logical write from 16 random bytes supplied by the caller,
/// formatted as a version-4 UUID (RFC 9562 §5.4: the version and variant bits are set), e.g.
/// `0f1e2d3c-4b5a-4978-8877-665544332211`.
///
/// The key is minted once, persisted with the action before the first send, and reused on every
/// attempt and after a restart (SPEC §6); it is never regenerated.
pub fn mint_idempotency_key(random: [u8; 16]) -> String {
    let mut b = random;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = hex::encode(b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// Prefix of every idempotency key backstop sends to a provider ([`upstream_idempotency_key`]).
pub const UPSTREAM_KEY_PREFIX: &str = "bk-";

/// The idempotency key sent to the provider for the key `key` of agent `agent`:
/// `bk-` followed by the first 32 hex digits (128 bits) of SHA-256(`agent` ‖ 0x00 ‖ `key`),
/// 35 ASCII characters in all — shorter than a UUID, so any provider that accepts UUID keys
/// accepts it (Stripe allows 255, the IETF draft sets no limit).
///
/// Why: inside backstop keys are namespaced per agent, but every agent's writes reach the
/// provider under one shared credential, where keys are one namespace. Sent unchanged, agent
/// bob reusing agent alice's key would get alice's result replayed. Derived, the two keys differ
/// at the provider, and the same (agent, key) always gives the same upstream key — after a
/// restart too, since nothing but the stored agent and key is needed. Minted keys are derived
/// the same way: a minted key told to the agent may come back as the agent's own key, and must
/// then name the same upstream key. The agent keeps seeing its own key; reconciliation
/// lookups and case files use this one, because it is the one the provider knows.
///
/// ```
/// use backstop_core::reconcile::upstream_idempotency_key;
/// let alice = upstream_idempotency_key("alice", "k1");
/// assert!(alice.starts_with("bk-") && alice.len() == 35);
/// assert_eq!(alice, upstream_idempotency_key("alice", "k1"));
/// assert_ne!(alice, upstream_idempotency_key("bob", "k1"));
/// ```
pub fn upstream_idempotency_key(agent: &str, key: &str) -> String {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    hasher.update(agent.as_bytes());
    hasher.update([0u8]);
    hasher.update(key.as_bytes());
    let digest = hasher.finalize();
    format!("{UPSTREAM_KEY_PREFIX}{}", hex::encode(&digest[..16]))
}

/// Checks an agent-supplied `Idempotency-Key` (IETF `draft-ietf-httpapi-idempotency-key-header`):
/// 1 to [`MAX_IDEMPOTENCY_KEY_LEN`] bytes of printable ASCII (`0x20`–`0x7E`), without leading or
/// trailing spaces. One surrounding pair of double quotes (the draft's structured-field string
/// form, `"abc"`) is removed; a key still quoted after that (`""abc""`) is refused, so that
/// checking a checked key again returns it unchanged (the door checks it, and so does the
/// engine). Returns the key as it will be stored and sent.
///
/// # Errors
/// [`ReconcileError::InvalidIdempotencyKey`] naming the rule that failed; the key is not echoed
/// (an agent may have pasted a secret into it).
///
/// ```
/// use backstop_core::reconcile::validate_idempotency_key;
/// assert_eq!(validate_idempotency_key("\"order-7\""), Ok("order-7"));
/// let tab = validate_idempotency_key("order\t7").unwrap_err().to_string();
/// assert_eq!(tab, "Idempotency-Key: byte 6 is not printable ASCII (0x20-0x7E)");
/// ```
pub fn validate_idempotency_key(key: &str) -> Result<&str, ReconcileError> {
    let bad = |reason: String| Err(ReconcileError::InvalidIdempotencyKey { reason });
    let key = key
        .strip_prefix('"')
        .and_then(|k| k.strip_suffix('"'))
        .unwrap_or(key);
    if key.is_empty() {
        return bad("must not be empty".to_owned());
    }
    if key.len() >= 2 && key.starts_with('"') && key.ends_with('"') {
        return bad("quoted twice; send the key bare or in one pair of double quotes".to_owned());
    }
    if key.len() > MAX_IDEMPOTENCY_KEY_LEN {
        return bad(format!(
            "{} bytes, at most {MAX_IDEMPOTENCY_KEY_LEN} allowed",
            key.len()
        ));
    }
    if let Some(pos) = key.bytes().position(|b| !(0x20..=0x7e).contains(&b)) {
        return bad(format!(
            "byte {} is not printable ASCII (0x20-0x7E)",
            pos + 1
        ));
    }
    if key.starts_with(' ') || key.ends_with(' ') {
        return bad("must not start or end with a space".to_owned());
    }
    Ok(key)
}

// ---------------------------------------------------------------------------------------------
// External reference

/// Reads the client-generated external reference at `pointer` (RFC 6901) in a JSON payload, or
/// writes `minted` there when the payload has none. Returns the payload to send and the
/// reference that the reconciliation lookup will use.
///
/// - A string at the pointer is the reference; a number is used in its JSON text form; in both
///   cases the payload is returned byte for byte unchanged.
/// - A missing value, `null`, or an empty or whitespace-only string is replaced by `minted`
///   (an empty reference names no write: a lookup filtering on it, `?reference=`, is taken by
///   many list APIs as no filter at all and would "find" any write); missing parent objects
///   are created.
///   The payload is then re-serialized (compact JSON, key order may change); digest the agent's
///   original payload for backstop's own idempotency, and send the returned one.
///
/// # Errors
/// [`ReconcileError::PayloadNotJson`] when the payload is not JSON (or empty);
/// [`ReconcileError::PointerNotWritable`] when the pointer is not a valid non-root pointer, a
/// parent on its path is not an object, or the value there is a boolean, object or array.
pub fn ensure_external_reference(
    payload: &[u8],
    pointer: &str,
    minted: &str,
) -> Result<(Vec<u8>, String), ReconcileError> {
    let not_writable = |reason: &str| ReconcileError::PointerNotWritable {
        pointer: pointer.to_owned(),
        reason: reason.to_owned(),
    };
    if !pointer.starts_with('/') {
        return Err(not_writable(
            "a JSON pointer to a field starts with `/` (RFC 6901)",
        ));
    }
    let mut doc: Value =
        serde_json::from_slice(payload).map_err(|e| ReconcileError::PayloadNotJson {
            pointer: pointer.to_owned(),
            reason: e.to_string(),
        })?;
    match doc.pointer(pointer) {
        // An empty or blank reference names nothing: as a filter, `?reference=` asks many list
        // APIs for every record, so a lookup with it would "find" any write. It is missing.
        Some(Value::String(s)) if !s.trim().is_empty() => return Ok((payload.to_vec(), s.clone())),
        Some(Value::Number(n)) => return Ok((payload.to_vec(), n.to_string())),
        Some(Value::String(_) | Value::Null) | None => {}
        Some(Value::Bool(_) | Value::Object(_) | Value::Array(_)) => {
            return Err(not_writable(
                "the payload holds a boolean, object or array there, not a reference",
            ))
        }
    }
    let tokens: Vec<String> = pointer[1..]
        .split('/')
        .map(|t| t.replace("~1", "/").replace("~0", "~"))
        .collect();
    let Some((last, parents)) = tokens.split_last() else {
        return Err(not_writable("empty pointer"));
    };
    let mut node = &mut doc;
    for token in parents {
        let Value::Object(map) = node else {
            return Err(not_writable(&format!(
                "the parent of `{token}` is not a JSON object"
            )));
        };
        node = map
            .entry(token.clone())
            .or_insert_with(|| Value::Object(serde_json::Map::new()));
        if node.is_null() {
            *node = Value::Object(serde_json::Map::new());
        }
    }
    let Value::Object(map) = node else {
        return Err(not_writable(&format!(
            "the parent of `{last}` is not a JSON object"
        )));
    };
    map.insert(last.clone(), Value::String(minted.to_owned()));
    let bytes = serde_json::to_vec(&doc).map_err(|e| not_writable(&e.to_string()))?;
    Ok((bytes, minted.to_owned()))
}

// ---------------------------------------------------------------------------------------------
// Lookup

/// A filled reconciliation lookup, ready to send to the provider's base URL (a safe read).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LookupRequest {
    /// `GET` or `HEAD`.
    pub method: String,
    /// Path and query with every placeholder filled, percent-encoded (RFC 3986 §2.1).
    pub path_and_query: String,
}

/// Fills the route's lookup template (`routes.R.reconcile.lookup`) with the action's
/// idempotency key (`{key}`), external reference (`{ref}`) and provider operation id
/// (`{operation_id}`). Every byte outside RFC 3986's unreserved set (`A-Z a-z 0-9 - . _ ~`) is
/// percent-encoded, so a value cannot add a path segment or a query parameter.
///
/// # Errors
/// [`ReconcileError::MissingLookupValue`] when the template uses a placeholder whose value is
/// `None`; [`ReconcileError::UnknownPlaceholder`] for any other `{…}` in the template.
pub fn lookup_request(
    reconcile: &Reconcile,
    key: Option<&str>,
    reference: Option<&str>,
    operation_id: Option<&str>,
) -> Result<LookupRequest, ReconcileError> {
    let lookup = format!("{} {}", reconcile.lookup_method, reconcile.lookup_path);
    let mut out = String::with_capacity(reconcile.lookup_path.len() + 32);
    let mut rest = reconcile.lookup_path.as_str();
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let after = &rest[open..];
        let close = after.find('}').map(|c| c + 1).unwrap_or(after.len());
        let placeholder = &after[..close];
        let (name, value) = match placeholder {
            "{key}" => ("{key}", key),
            "{ref}" => ("{ref}", reference),
            "{operation_id}" => ("{operation_id}", operation_id),
            other => {
                return Err(ReconcileError::UnknownPlaceholder {
                    lookup,
                    placeholder: other.to_owned(),
                })
            }
        };
        let value = value.ok_or_else(|| ReconcileError::MissingLookupValue {
            lookup: lookup.clone(),
            placeholder: name,
        })?;
        percent_encode_into(value, &mut out);
        rest = &after[close..];
    }
    out.push_str(rest);
    Ok(LookupRequest {
        method: reconcile.lookup_method.clone(),
        path_and_query: out,
    })
}

fn percent_encode_into(value: &str, out: &mut String) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push('%');
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0x0f)]));
        }
    }
}

/// What a reconciliation lookup says about the uncertain write.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum LookupVerdict {
    /// The provider has the operation: the write happened.
    Found {
        /// The provider's operation id, when the lookup response carries it.
        operation_id: Option<String>,
    },
    /// The provider says it has no such operation.
    NotFound,
    /// The answer proves nothing either way (throttled, provider error, unreadable body).
    Inconclusive {
        /// Why, in plain words (the body is never quoted).
        reason: String,
    },
}

/// Interprets the provider's answer to a lookup made with [`lookup_request`].
///
/// - `404` → [`LookupVerdict::NotFound`].
/// - `429`, `5xx`, redirects and other `4xx` (a lookup that is throttled, failing, or not
///   permitted proves nothing) → [`LookupVerdict::Inconclusive`].
/// - `2xx` with a configured `found_pointer`: the value there decides — missing, `null`,
///   `false`, `""`, `[]` or `{}` → not found; anything else → found. A body that is not JSON →
///   inconclusive.
/// - `2xx` without `found_pointer`: a JSON array decides by emptiness; a non-empty JSON object
///   without array members is the resource itself → found; an object with array members is a
///   list whose emptiness cannot be told apart from its metadata → inconclusive (configure
///   `found_pointer`); an empty body is found for `HEAD` and inconclusive for `GET`.
///
/// When found, the operation id is read at `operation_id_pointer` (strings and numbers).
pub fn interpret_lookup(reconcile: &Reconcile, status: u16, body: &[u8]) -> LookupVerdict {
    let inconclusive = |reason: String| LookupVerdict::Inconclusive { reason };
    match status {
        404 => return LookupVerdict::NotFound,
        200..=299 => {}
        429 => return inconclusive("the lookup was rate limited (HTTP 429)".to_owned()),
        500..=599 => return inconclusive(format!("the lookup failed with HTTP {status}")),
        _ => {
            return inconclusive(format!(
                "the lookup was answered with HTTP {status}, which says nothing about the write"
            ))
        }
    }
    let found = |doc: Option<&Value>| LookupVerdict::Found {
        operation_id: doc
            .and_then(|d| operation_id_in(reconcile.operation_id_pointer.as_deref(), d)),
    };
    let is_blank = body.iter().all(u8::is_ascii_whitespace);
    if is_blank && reconcile.found_pointer.is_none() {
        return if reconcile.lookup_method == "HEAD" {
            found(None)
        } else {
            inconclusive(format!(
                "the lookup answered HTTP {status} with an empty body and no found_pointer is configured"
            ))
        };
    }
    let doc: Value = match serde_json::from_slice(body) {
        Ok(doc) => doc,
        Err(_) => {
            return inconclusive(format!(
                "the lookup answered HTTP {status} with a body that is not JSON"
            ))
        }
    };
    if let Some(pointer) = &reconcile.found_pointer {
        return match doc.pointer(pointer) {
            None | Some(Value::Null) | Some(Value::Bool(false)) => LookupVerdict::NotFound,
            Some(Value::String(s)) if s.is_empty() => LookupVerdict::NotFound,
            Some(Value::Array(a)) if a.is_empty() => LookupVerdict::NotFound,
            Some(Value::Object(o)) if o.is_empty() => LookupVerdict::NotFound,
            Some(_) => found(Some(&doc)),
        };
    }
    match &doc {
        Value::Array(a) if a.is_empty() => LookupVerdict::NotFound,
        Value::Array(_) => found(Some(&doc)),
        Value::Object(o) if o.is_empty() => LookupVerdict::NotFound,
        Value::Object(o) if o.values().any(Value::is_array) => inconclusive(
            "the lookup answered with a list object; configure found_pointer to tell found from not found"
                .to_owned(),
        ),
        Value::Object(_) => found(Some(&doc)),
        _ => inconclusive(format!(
            "the lookup answered HTTP {status} with a JSON scalar, not a resource or a list"
        )),
    }
}

/// Reads the provider's operation id from a write's (or lookup's) response body at the route's
/// `operation_id_pointer`. Strings are returned as they are, numbers in their JSON text form;
/// `None` when no pointer is configured, the body is not JSON, or nothing usable is there.
pub fn operation_id_from_response(reconcile: &Reconcile, body: &[u8]) -> Option<String> {
    operation_id_at(reconcile.operation_id_pointer.as_deref()?, body)
}

/// Reads an operation id at any JSON pointer (RFC 6901) of a response body; see
/// [`operation_id_from_response`].
pub fn operation_id_at(pointer: &str, body: &[u8]) -> Option<String> {
    let doc: Value = serde_json::from_slice(body).ok()?;
    operation_id_in(Some(pointer), &doc)
}

fn operation_id_in(pointer: Option<&str>, doc: &Value) -> Option<String> {
    match doc.pointer(pointer?)? {
        Value::String(s) if !s.is_empty() => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

// ---------------------------------------------------------------------------------------------
// The SPEC §6 rule

/// What happens next to a write whose last attempt was `uncertain` (SPEC §6).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "step", rename_all = "snake_case")]
pub enum UncertainNextStep {
    /// Ask the provider through the route's lookup ([`lookup_request`]), then call
    /// [`next_step_after_uncertain`] again with the verdict.
    Lookup,
    /// The write happened: outcome `succeeded` (reconciled); store the operation id.
    Succeeded {
        /// The provider's operation id, when known.
        operation_id: Option<String>,
    },
    /// Send again with the SAME idempotency key; the provider deduplicates.
    RetrySameKey,
    /// A human must decide: open an escalation (reason `side_effect_unknown`).
    Escalate {
        /// Why, in plain words.
        reason: String,
    },
}

/// The SPEC §6 rule for an uncertain write.
///
/// `honours_key`: the provider honours an idempotency header for this route (a key is sent).
/// `has_lookup`: the route has a `reconcile` lookup. `verdict`: the lookup's answer, `None` when
/// it has not been asked yet.
///
/// Found → succeeded (reconciled). Not found and the key is honoured → retry with the same key.
/// Not found without key support, or an inconclusive lookup → escalate. Without a lookup, a
/// route that honours keys is retried with the same key (the provider deduplicates, so the
/// resend is not a second side effect); a write with neither key support nor a lookup is never
/// resent automatically → escalate.
pub fn next_step_after_uncertain(
    honours_key: bool,
    has_lookup: bool,
    verdict: Option<&LookupVerdict>,
) -> UncertainNextStep {
    match verdict {
        Some(LookupVerdict::Found { operation_id }) => UncertainNextStep::Succeeded {
            operation_id: operation_id.clone(),
        },
        Some(LookupVerdict::NotFound) if honours_key => UncertainNextStep::RetrySameKey,
        Some(LookupVerdict::NotFound) => UncertainNextStep::Escalate {
            reason: "the lookup did not find the write, but the provider does not honour idempotency keys on this route, so a resend could still duplicate it".to_owned(),
        },
        Some(LookupVerdict::Inconclusive { reason }) => UncertainNextStep::Escalate {
            reason: format!("the reconciliation lookup was inconclusive: {reason}"),
        },
        None if has_lookup => UncertainNextStep::Lookup,
        None if honours_key => UncertainNextStep::RetrySameKey,
        None => UncertainNextStep::Escalate {
            reason: "the write may have happened, and the route has neither idempotency-key support nor a reconciliation lookup; it is never resent automatically".to_owned(),
        },
    }
}

/// The lookup template in its configured form (`GET /v1/transfers?reference={ref}`), as shown in
/// case files and audit records (never a filled, concrete URL).
pub fn lookup_template(reconcile: &Reconcile) -> String {
    format!("{} {}", reconcile.lookup_method, reconcile.lookup_path)
}

/// The value a lookup of `reconcile.by` needs, for callers choosing among key, reference and
/// operation id.
pub fn placeholder_for(by: ReconcileBy) -> &'static str {
    match by {
        ReconcileBy::IdempotencyKey => "{key}",
        ReconcileBy::ExternalReference => "{ref}",
        ReconcileBy::OperationId => "{operation_id}",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checking_a_checked_key_returns_it_unchanged() {
        for raw in ["order-7", "\"order-7\"", "a \"quoted\" word", "\"", "x\""] {
            let Ok(once) = validate_idempotency_key(raw) else {
                continue;
            };
            assert_eq!(validate_idempotency_key(once), Ok(once), "{raw}");
        }
        let twice = validate_idempotency_key("\"\"order-7\"\"").unwrap_err();
        assert!(twice.to_string().contains("quoted twice"), "{twice}");
        let empty = validate_idempotency_key("\"\"").unwrap_err();
        assert!(empty.to_string().contains("must not be empty"), "{empty}");
    }
}
