//! What a response looks like as backstop passes it on and keeps it for replay: the
//! hop-by-hop headers of RFC 9110 §7.6.1 that never travel, headers as stored pairs, the replay
//! record of a completed write, and the names of backstop's own headers on such answers.
//!
//! It sits below both the faces (the proxy door, the action API) and the engine: the engine
//! keeps replay records and the door answers with them, and neither imports the other for it.

use axum::http::{header, HeaderMap, HeaderName, StatusCode};

/// Whether `name` is one of the fixed hop-by-hop headers of RFC 9110 §7.6.1: `Connection`,
/// `Keep-Alive`, `TE`, `Trailer`, `Transfer-Encoding`, `Upgrade` and every `Proxy-*` header
/// (`Proxy-Authenticate`, `Proxy-Authorization`, the legacy `Proxy-Connection`).
pub(crate) fn is_hop_by_hop(name: &HeaderName) -> bool {
    let name = name.as_str();
    matches!(
        name,
        "connection" | "keep-alive" | "te" | "trailer" | "transfer-encoding" | "upgrade"
    ) || name.starts_with("proxy-")
}

/// The header names a `Connection` header lists (RFC 9110 §7.6.1): hop-by-hop too. Empty, and
/// nothing allocated, when there is no such header.
pub(crate) fn connection_listed(headers: &HeaderMap) -> Vec<HeaderName> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect()
}

/// Removes the hop-by-hop headers of RFC 9110 §7.6.1: `Connection` and every header it lists,
/// `Keep-Alive`, `Proxy-*`, `TE`, `Trailer`, `Transfer-Encoding`, `Upgrade`. One pass over the
/// names; a map without any (the usual response) is left untouched and nothing is allocated.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let mut doomed = connection_listed(headers);
    doomed.extend(headers.keys().filter(|k| is_hop_by_hop(k)).cloned());
    for name in doomed {
        headers.remove(name);
    }
}

/// Most bytes of a completed write's response body kept in the store for idempotent replay to
/// the same agent (1 MiB). A longer body is kept cut at this length and the replay says so in
/// [`REPLAY_TRUNCATED_HEADER`].
pub const REPLAY_BODY_LIMIT: usize = 1024 * 1024;

/// Header on a replayed write whose stored body is not the whole original body: its value is
/// the number of body bytes kept (`0` for an event stream, whose body is never kept; the bytes
/// received for a body the provider cut, see [`BODY_TRUNCATED_HEADER`]).
pub const REPLAY_TRUNCATED_HEADER: &str = "backstop-replay-body-truncated";

/// Header on a write's first answer whose body the provider cut while it was sent (the
/// connection closed before the `Content-Length` announced was reached, or a chunked body broke
/// off): its value is the number of body bytes received and passed on, which is all of the
/// body the agent gets. The provider's `Content-Length` is not passed on with it. The action
/// stays `succeeded` (the provider did answer its status); a same-key replay of it carries the
/// same bytes under [`REPLAY_TRUNCATED_HEADER`].
pub const BODY_TRUNCATED_HEADER: &str = "backstop-body-truncated";

/// Header on every replayed write (IETF Idempotency-Key draft practice): `Idempotent-Replayed:
/// true` — nothing was sent, this is the provider's stored response.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// Whether a response is a Server-Sent Events stream (`text/event-stream`), whose body is
/// passed through unbuffered and never kept for replay.
pub fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.trim()
                .to_ascii_lowercase()
                .starts_with("text/event-stream")
        })
}

/// Headers as `(lower-case name, value)` pairs, as stored and replayed; a value that is not
/// visible ASCII (RFC 9110 §5.5 obs-text) is left out.
pub(crate) fn header_pairs(headers: &HeaderMap) -> Vec<(String, String)> {
    pairs_of(headers, |_| true)
}

/// [`header_pairs`] of the headers whose name `keep` accepts.
fn pairs_of(headers: &HeaderMap, keep: impl Fn(&HeaderName) -> bool) -> Vec<(String, String)> {
    headers
        .iter()
        .filter(|(n, _)| keep(n))
        .filter_map(|(n, v)| {
            v.to_str()
                .ok()
                .map(|v| (n.as_str().to_owned(), v.to_owned()))
        })
        .collect()
}

/// The end-to-end headers of `headers` as stored pairs ([`header_pairs`]), in their order: what
/// the door would pass on, without the hop-by-hop headers of RFC 9110 §7.6.1 (see
/// [`strip_hop_by_hop`]), which describe the provider's connection, not the answer.
pub(crate) fn end_to_end_pairs(headers: &HeaderMap) -> Vec<(String, String)> {
    let listed = connection_listed(headers);
    pairs_of(headers, |name| {
        !is_hop_by_hop(name) && !listed.contains(name)
    })
}

/// The provider's final response to a completed write, as kept for replay: the status, the
/// end-to-end headers (hop-by-hop headers of RFC 9110 §7.6.1, `Set-Cookie`, `Content-Length`
/// and header values that are not visible ASCII are left out), and at most
/// [`REPLAY_BODY_LIMIT`] bytes of `body`. `complete` says whether `body` is the whole body;
/// when it is not (or `body` is longer than the limit), [`REPLAY_TRUNCATED_HEADER`] is added
/// with the number of bytes kept.
pub fn replay_record(
    status: StatusCode,
    headers: &HeaderMap,
    body: &[u8],
    complete: bool,
) -> backstop_store::StoredResponse {
    let mut kept = headers.clone();
    strip_hop_by_hop(&mut kept);
    kept.remove(header::SET_COOKIE);
    kept.remove(header::CONTENT_LENGTH);
    let cut = body.len().min(REPLAY_BODY_LIMIT);
    let truncated = !complete || cut < body.len();
    let mut pairs = header_pairs(&kept);
    if truncated {
        pairs.push((REPLAY_TRUNCATED_HEADER.to_owned(), cut.to_string()));
    }
    backstop_store::StoredResponse {
        status: status.as_u16(),
        headers: pairs,
        body: body[..cut].to_vec(),
    }
}

/// Marks a response that is the provider's, passed through by the door: the edge layer never
/// rewrites it, whatever its status and content type.
#[derive(Debug, Clone, Copy)]
pub struct ProviderResponse;
