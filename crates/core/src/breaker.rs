//! Sanitized fingerprints and the per-task circuit breaker (SPEC §7).
//!
//! Why: an agent that gets a 422 or a 401 tends to "fix" the request by varying something
//! irrelevant (whitespace, header order, a timestamp) and send it again. The breaker keys on
//! what makes a request *the same request* for the provider: method, route template (ids
//! replaced), the stable payload fields named by policy (`fingerprint_fields`, JSON pointers),
//! and, for a failure, the normalized provider error code. Nothing else goes in: no secrets, no
//! volatile headers, no raw body, so the fingerprint can be logged and audited.
//!
//! The fingerprint is SHA-256 (FIPS 180-4) over a length-prefixed encoding of those parts, in
//! lowercase hex. When the same request fingerprint fails with the same normalized error
//! `threshold` times (default 3) within one task, that path opens for the task: every further
//! call ends at once with `circuit_open` and the failure details ([`CircuitOpen`]).
//!
//! ```
//! use backstop_core::breaker::{RequestFingerprint, TaskBreaker};
//! use serde_json::json;
//!
//! let payload = json!({"amount": 100, "currency": "EUR", "note": "  try again "});
//! let fields = ["/amount".to_owned(), "/currency".to_owned()];
//! let fp = RequestFingerprint::compute("POST", "/v1/transfers", Some(&payload), &fields);
//! let mut breaker = TaskBreaker::new(3);
//! for _ in 0..3 {
//!     breaker.record_failure(&fp, "INVALID_IBAN", Some(422));
//! }
//! let open = breaker.check(&fp).unwrap_err();
//! assert_eq!(open.error_code, "invalid_iban");
//! assert_eq!(open.failures, 3);
//! ```

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::outcome::Outcome;

/// The sanitized fingerprint of a request (without any error): lowercase SHA-256 hex.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RequestFingerprint(String);

/// The fingerprint of a failure: request fingerprint + normalized error code, lowercase hex.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct FailureFingerprint(String);

fn feed(hasher: &mut Sha256, part: &[u8]) {
    hasher.update((part.len() as u64).to_be_bytes());
    hasher.update(part);
}

impl RequestFingerprint {
    /// Computes the fingerprint from the method (case-insensitive), the route template (ids
    /// already replaced, e.g. `/v1/transfers/{id}`), and the values at the JSON pointers
    /// `stable_fields` (RFC 6901) in `payload`. A missing field counts as absent, distinct from
    /// JSON `null`; field values are hashed in canonical JSON (object keys sorted), so key order
    /// and whitespace in the original body do not matter.
    pub fn compute(
        method: &str,
        route_template: &str,
        payload: Option<&serde_json::Value>,
        stable_fields: &[String],
    ) -> Self {
        let mut hasher = Sha256::new();
        feed(&mut hasher, b"backstop-fingerprint-v1");
        feed(&mut hasher, method.trim().to_ascii_uppercase().as_bytes());
        feed(&mut hasher, route_template.as_bytes());
        for pointer in stable_fields {
            feed(&mut hasher, pointer.as_bytes());
            match payload.and_then(|p| p.pointer(pointer)) {
                Some(value) => {
                    feed(&mut hasher, b"=");
                    feed(&mut hasher, value.to_string().as_bytes());
                }
                None => feed(&mut hasher, b"absent"),
            }
        }
        RequestFingerprint(hex::encode(hasher.finalize()))
    }

    /// The fingerprint as lowercase hex.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The failure fingerprint of this request with `error_code` (normalized, see
    /// [`normalize_error_code`]).
    pub fn with_error(&self, error_code: &str) -> FailureFingerprint {
        let mut hasher = Sha256::new();
        feed(&mut hasher, b"backstop-failure-v1");
        feed(&mut hasher, self.0.as_bytes());
        feed(&mut hasher, normalize_error_code(error_code).as_bytes());
        FailureFingerprint(hex::encode(hasher.finalize()))
    }
}

impl std::fmt::Display for RequestFingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::fmt::Display for FailureFingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl FailureFingerprint {
    /// The fingerprint as lowercase hex.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Normalizes a provider error code: trimmed, lowercase, runs of whitespace and `-` become `_`
/// (`"Invalid-IBAN "` → `invalid_iban`). An empty code is `unknown`.
pub fn normalize_error_code(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut pending_sep = false;
    for c in code.trim().chars() {
        if c.is_whitespace() || c == '-' || c == '_' {
            pending_sep = !out.is_empty();
        } else {
            if pending_sep {
                out.push('_');
                pending_sep = false;
            }
            out.extend(c.to_lowercase());
        }
    }
    if out.is_empty() {
        "unknown".to_owned()
    } else {
        out
    }
}

/// The path is open for this task: the call ends with `circuit_open` (SPEC §7).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("circuit open: request {fingerprint} failed {failures} times with `{error_code}`")]
pub struct CircuitOpen {
    /// The request fingerprint.
    pub fingerprint: RequestFingerprint,
    /// The failure fingerprint (request + error).
    pub failure: FailureFingerprint,
    /// The normalized error code that repeated.
    pub error_code: String,
    /// The last HTTP status of those failures.
    pub last_status: Option<u16>,
    /// How many times it failed that way.
    pub failures: u32,
}

impl CircuitOpen {
    /// Always [`Outcome::CircuitOpen`].
    pub const fn outcome(&self) -> Outcome {
        Outcome::CircuitOpen
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Streak {
    error_code: String,
    last_status: Option<u16>,
    failures: u32,
}

/// The circuit breaker of one task: consecutive identical failures per request fingerprint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskBreaker {
    threshold: u32,
    streaks: BTreeMap<RequestFingerprint, Streak>,
}

impl TaskBreaker {
    /// A breaker that opens after `threshold` identical failures (policy `breaker.threshold`,
    /// default 3; a threshold of 0 is treated as 1).
    pub fn new(threshold: u32) -> Self {
        TaskBreaker {
            threshold: threshold.max(1),
            streaks: BTreeMap::new(),
        }
    }

    /// Whether a call with this fingerprint may go out.
    ///
    /// # Errors
    /// [`CircuitOpen`] with the failure details once the path is open.
    pub fn check(&self, fingerprint: &RequestFingerprint) -> Result<(), CircuitOpen> {
        match self.streaks.get(fingerprint) {
            Some(streak) if streak.failures >= self.threshold => Err(CircuitOpen {
                fingerprint: fingerprint.clone(),
                failure: fingerprint.with_error(&streak.error_code),
                error_code: streak.error_code.clone(),
                last_status: streak.last_status,
                failures: streak.failures,
            }),
            _ => Ok(()),
        }
    }

    /// Records a failure of `fingerprint` with the provider's `error_code` (normalized here)
    /// and the HTTP status. A different error than the previous one starts a new streak.
    /// Returns [`CircuitOpen`] when this failure opened (or kept open) the path.
    pub fn record_failure(
        &mut self,
        fingerprint: &RequestFingerprint,
        error_code: &str,
        status: Option<u16>,
    ) -> Option<CircuitOpen> {
        let code = normalize_error_code(error_code);
        let streak = self
            .streaks
            .entry(fingerprint.clone())
            .or_insert_with(|| Streak {
                error_code: code.clone(),
                last_status: status,
                failures: 0,
            });
        if streak.error_code != code {
            streak.error_code = code;
            streak.failures = 0;
        }
        streak.failures = streak.failures.saturating_add(1);
        streak.last_status = status;
        self.check(fingerprint).err()
    }

    /// Records a success: the streak of this fingerprint ends.
    pub fn record_success(&mut self, fingerprint: &RequestFingerprint) {
        self.streaks.remove(fingerprint);
    }
}
