//! The record of every attempt the fake provider received.
//!
//! Tests measure what a real provider would see, so every request counts — answered, refused,
//! dropped or held — except the reserved `/__fake/` paths. Credentials are never kept: only
//! whether the credential header was present and a short SHA-256 prefix to tell credentials
//! apart. Bodies are kept only as a digest.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// How an attempt ended, from the provider's side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttemptOutcome {
    /// Still being processed (held, or a stream still sending).
    Pending,
    /// A response was sent; see [`AttemptRecord::status`].
    Answered,
    /// The connection was closed without any response byte (`drop` or `store_then_drop`).
    Dropped,
    /// The connection was held without an answer, then closed: a `timeout` fault, by the
    /// provider when the hold ended or by the client when it left first; or a `slow` answer
    /// whose client left before the hold ended (its work was done all the same).
    Timeout,
}

/// One attempt as received. Serialized as one JSON object of `GET /__fake/attempts`:
///
/// ```json
/// {"seq":1,"at":"2025-01-01T00:00:00.123Z","method":"POST","path":"/v1/transfers",
///  "query":null,"route":"POST /v1/transfers","call":1,"idempotency_key":"k1",
///  "body_sha256":"9f86…","body_bytes":42,"auth_present":true,"auth_sha256":"5e884898da280471",
///  "status":201,"outcome":"answered","fault":null,"replayed":false}
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttemptRecord {
    /// 1-based arrival number since start or the last reset.
    pub seq: u64,
    /// Arrival time, RFC 3339 UTC with milliseconds.
    pub at: String,
    /// Request method.
    pub method: String,
    /// Request path as received (percent-encoded).
    pub path: String,
    /// Raw query string, if any.
    pub query: Option<String>,
    /// Matched route template (`POST /v1/transfers`), `None` when no route matched.
    pub route: Option<String>,
    /// 1-based call number of the matched route.
    pub call: Option<u64>,
    /// Value of the idempotency header, if sent.
    pub idempotency_key: Option<String>,
    /// Hex SHA-256 of the request body; `None` for an empty body.
    pub body_sha256: Option<String>,
    /// Body length in bytes.
    pub body_bytes: usize,
    /// Whether the credential header was present.
    pub auth_present: bool,
    /// First 16 hex digits of the credential's SHA-256 — never the value.
    pub auth_sha256: Option<String>,
    /// Status sent, when one was.
    pub status: Option<u16>,
    /// How the attempt ended.
    pub outcome: AttemptOutcome,
    /// The scripted fault that applied (`status`, `error_code`, `timeout`, `drop`,
    /// `store_then_drop`), or the quota that refused (`quota:<name>`).
    pub fault: Option<String>,
    /// The answer was an idempotent replay of a stored result.
    pub replayed: bool,
}

/// Hex SHA-256 of `bytes`.
pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// First 16 hex digits of the SHA-256 of a credential.
pub(crate) fn credential_digest(value: &[u8]) -> String {
    let mut digest = sha256_hex(value);
    digest.truncate(16);
    digest
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credential_digest_is_a_prefix_not_the_value() {
        let digest = credential_digest(b"Bearer sk-secret");
        assert_eq!(digest.len(), 16);
        assert!(!digest.contains("secret"));
        assert_eq!(digest, sha256_hex(b"Bearer sk-secret")[..16]);
    }
}
