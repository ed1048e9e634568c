//! # Signal headers: what of a response is kept as evidence
//!
//! Why keep raw headers at all: the store records what a response *meant* (status, disposition,
//! the normalized boundary), but a person deciding an escalation (SPEC §8: "attempt times,
//! statuses, Retry-After and quota headers") and a health snapshot (SPEC §10: `retry_after_raw`,
//! `date_header`) need what the provider actually *said*, so the normalization can be checked
//! and recomputed offline. Why keep so few: a response's headers also carry cookies, session ids
//! and whatever a hostile upstream chooses to send; only the signal headers are evidence.
//!
//! [`select_signal_headers`] keeps, the timing headers first, then the quota headers, each group
//! in the order received:
//! - `retry-after` and `retry-after-ms` (SPEC §2.2);
//! - `date` (the skew-immune reference for HTTP-dates and absolute resets);
//! - the quota header families [`crate::quota`] reads (SPEC §2.3): IETF `ratelimit`,
//!   `ratelimit-policy` and `ratelimit-*`; every `x-ratelimit-*` (OpenAI, GitHub and their
//!   imitators); Anthropic `anthropic-ratelimit-*`.
//!
//! Nothing else — never `authorization`, `set-cookie`, API-key or any other header. Names are
//! lower case (as `http` stores them), values raw (lossily decoded as UTF-8).
//!
//! **Bounds** (a hostile upstream must not bloat the store): at most [`MAX_SIGNAL_HEADERS`]
//! (24) pairs per response; a name longer than [`MAX_SIGNAL_NAME_BYTES`] (64 bytes) is dropped;
//! a value longer than [`MAX_SIGNAL_VALUE_BYTES`] (256 bytes) is cut at a character boundary
//! within that length and ends with [`TRUNCATED_MARK`] (`…`), so a cut value is never mistaken
//! for a whole one. One response therefore keeps at most 24 × (64 + 259) bytes.
//!
//! ```
//! use backstop_core::signal_headers::{retry_after_raw, select_signal_headers};
//! use http::{HeaderMap, HeaderValue};
//!
//! let mut h = HeaderMap::new();
//! h.insert("retry-after", HeaderValue::from_static("7"));
//! h.insert("x-ratelimit-remaining-requests", HeaderValue::from_static("0"));
//! h.insert("set-cookie", HeaderValue::from_static("session=abc"));
//! let kept = select_signal_headers(&h);
//! assert_eq!(
//!     kept,
//!     vec![
//!         ("retry-after".to_owned(), "7".to_owned()),
//!         ("x-ratelimit-remaining-requests".to_owned(), "0".to_owned()),
//!     ]
//! );
//! assert_eq!(retry_after_raw(&kept).as_deref(), Some("7"));
//! ```

use http::HeaderMap;

/// Most signal headers kept from one response (24).
pub const MAX_SIGNAL_HEADERS: usize = 24;

/// Longest header name kept, in bytes (64); a longer name is dropped.
pub const MAX_SIGNAL_NAME_BYTES: usize = 64;

/// Longest header value kept, in bytes (256); a longer value is cut and marked.
pub const MAX_SIGNAL_VALUE_BYTES: usize = 256;

/// Appended to a value cut at [`MAX_SIGNAL_VALUE_BYTES`].
pub const TRUNCATED_MARK: &str = "…";

/// Whether a (lower-case) header name is a signal header (see the module docs).
pub fn is_signal_header(name: &str) -> bool {
    matches!(
        name,
        "retry-after" | "retry-after-ms" | "date" | "ratelimit"
    ) || name.starts_with("ratelimit-")
        || name.starts_with("x-ratelimit-")
        || name.starts_with("anthropic-ratelimit-")
}

/// Whether a response carries `Retry-After` or `retry-after-ms`: a 2xx that does is kept as
/// evidence too (two header lookups, no allocation).
pub fn carries_retry_after(headers: &HeaderMap) -> bool {
    headers.contains_key(http::header::RETRY_AFTER) || headers.contains_key("retry-after-ms")
}

/// Whether a (lower-case) header name is one of the timing headers kept before any quota
/// header: `retry-after`, `retry-after-ms`, `date`.
fn is_timing_header(name: &str) -> bool {
    matches!(name, "retry-after" | "retry-after-ms" | "date")
}

/// The signal headers of one response as `(lower-case name, raw value)` pairs, bounded as the
/// module docs say: the timing headers (`retry-after`, `retry-after-ms`, `date`) first, then
/// the quota headers, each group in the order received — so a flood of quota headers can never
/// push the Retry-After the boundary came from out of the evidence. Never fails and never
/// panics.
pub fn select_signal_headers(headers: &HeaderMap) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for timing in [true, false] {
        for (name, value) in headers {
            let name = name.as_str();
            if name.len() > MAX_SIGNAL_NAME_BYTES
                || !is_signal_header(name)
                || is_timing_header(name) != timing
            {
                continue;
            }
            if out.len() == MAX_SIGNAL_HEADERS {
                return out;
            }
            out.push((name.to_owned(), bounded_value(value.as_bytes())));
        }
    }
    out
}

/// A header value as text, cut at [`MAX_SIGNAL_VALUE_BYTES`] (on a character boundary) and
/// marked with [`TRUNCATED_MARK`] when longer.
fn bounded_value(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    if text.len() <= MAX_SIGNAL_VALUE_BYTES {
        return text.into_owned();
    }
    let mut end = MAX_SIGNAL_VALUE_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{TRUNCATED_MARK}", &text[..end])
}

/// Every value of `name` among kept pairs, joined with `, ` as one field line would carry them
/// (RFC 9110 §5.3); `None` when there is none. `name` is compared case-insensitively.
pub fn joined_value(pairs: &[(String, String)], name: &str) -> Option<String> {
    let values: Vec<&str> = pairs
        .iter()
        .filter(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
        .collect();
    (!values.is_empty()).then(|| values.join(", "))
}

/// The raw `Retry-After` among kept pairs (several instances joined with `, `, which the
/// Retry-After reader takes the largest valid value of, SPEC §2.2). `retry-after-ms` is not
/// folded in: its unit differs; it stays its own pair.
pub fn retry_after_raw(pairs: &[(String, String)]) -> Option<String> {
    joined_value(pairs, "retry-after")
}

/// The raw `Date` among kept pairs (the first, when a response carried several).
pub fn date_raw(pairs: &[(String, String)]) -> Option<String> {
    pairs
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case("date"))
        .map(|(_, v)| v.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (name, value) in pairs {
            h.append(
                http::header::HeaderName::from_bytes(name.as_bytes()).expect("name"),
                HeaderValue::from_str(value).expect("value"),
            );
        }
        h
    }

    #[test]
    fn every_quota_family_the_readers_know_is_kept() {
        let h = map(&[
            ("RateLimit", "\"default\";r=0;t=30"),
            ("RateLimit-Policy", "\"default\";q=100;w=60"),
            ("RateLimit-Reset", "30"),
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset", "1767225600"),
            ("anthropic-ratelimit-tokens-reset", "2026-01-01T00:00:00Z"),
            ("Retry-After", "30"),
            ("retry-after-ms", "1500"),
            ("Date", "Thu, 01 Jan 2026 00:00:00 GMT"),
        ]);
        let names: Vec<String> = select_signal_headers(&h)
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(names.len(), 9, "{names:?}");
        for expected in [
            "ratelimit",
            "ratelimit-policy",
            "ratelimit-reset",
            "x-ratelimit-remaining-requests",
            "x-ratelimit-reset",
            "anthropic-ratelimit-tokens-reset",
            "retry-after",
            "retry-after-ms",
            "date",
        ] {
            assert!(names.iter().any(|n| n == expected), "{expected}: {names:?}");
        }
    }

    #[test]
    fn credentials_cookies_and_other_headers_are_never_kept() {
        let h = map(&[
            ("authorization", "Bearer sk-live-abcdefghijkl"),
            ("set-cookie", "session=abc"),
            ("cookie", "a=b"),
            ("x-api-key", "sk-live-abcdefghijkl"),
            ("content-type", "application/json"),
            ("x-request-id", "req-1"),
            ("ratelimited", "1"),
            ("x-ratelimit", "1"),
            ("x-should-retry", "true"),
        ]);
        assert_eq!(select_signal_headers(&h), Vec::new());
    }

    #[test]
    fn repeated_retry_after_instances_are_kept_and_joined() {
        let h = map(&[("retry-after", "7"), ("retry-after", "20")]);
        let kept = select_signal_headers(&h);
        assert_eq!(kept.len(), 2);
        assert_eq!(retry_after_raw(&kept).as_deref(), Some("7, 20"));
        assert_eq!(date_raw(&kept), None);
    }

    #[test]
    fn retry_after_ms_is_not_folded_into_the_raw_retry_after() {
        let kept = select_signal_headers(&map(&[("retry-after-ms", "1500")]));
        assert_eq!(retry_after_raw(&kept), None);
        assert_eq!(
            joined_value(&kept, "Retry-After-Ms").as_deref(),
            Some("1500")
        );
    }

    #[test]
    fn a_hostile_response_is_bounded_in_count_name_and_value() {
        let mut h = HeaderMap::new();
        for i in 0..100 {
            h.insert(
                http::header::HeaderName::from_bytes(format!("x-ratelimit-n{i}").as_bytes())
                    .expect("name"),
                HeaderValue::from_static("1"),
            );
        }
        assert_eq!(select_signal_headers(&h).len(), MAX_SIGNAL_HEADERS);

        let long_name = format!("x-ratelimit-{}", "a".repeat(MAX_SIGNAL_NAME_BYTES));
        let long_value = "é".repeat(MAX_SIGNAL_VALUE_BYTES);
        let h = map(&[(&long_name, "1"), ("retry-after", &long_value)]);
        let kept = select_signal_headers(&h);
        assert_eq!(kept.len(), 1, "the long name is dropped");
        let (name, value) = &kept[0];
        assert_eq!(name, "retry-after");
        assert!(value.ends_with(TRUNCATED_MARK), "{value}");
        let body = value.strip_suffix(TRUNCATED_MARK).expect("marked");
        assert!(body.len() <= MAX_SIGNAL_VALUE_BYTES);
        assert!(
            body.len() > MAX_SIGNAL_VALUE_BYTES - 2,
            "cut on a char boundary"
        );
        assert!(body.chars().all(|c| c == 'é'));
    }

    #[test]
    fn a_flood_of_quota_headers_cannot_push_out_the_timing_headers() {
        let mut h = HeaderMap::new();
        for i in 0..90 {
            h.append(
                http::HeaderName::from_bytes(format!("x-ratelimit-j{i}").as_bytes()).unwrap(),
                HeaderValue::from_static("junk"),
            );
        }
        h.append("retry-after", HeaderValue::from_static("5"));
        h.append(
            "date",
            HeaderValue::from_static("Sun, 26 Jul 2026 18:39:00 GMT"),
        );
        let kept = select_signal_headers(&h);
        assert_eq!(kept.len(), MAX_SIGNAL_HEADERS);
        assert_eq!(retry_after_raw(&kept).as_deref(), Some("5"));
        assert_eq!(
            date_raw(&kept).as_deref(),
            Some("Sun, 26 Jul 2026 18:39:00 GMT")
        );
        assert_eq!(
            kept[2].0, "x-ratelimit-j0",
            "quota headers follow, in order"
        );
    }

    #[test]
    fn a_value_exactly_at_the_bound_is_kept_whole() {
        let value = "9".repeat(MAX_SIGNAL_VALUE_BYTES);
        let kept = select_signal_headers(&map(&[("retry-after", &value)]));
        assert_eq!(kept[0].1, value);
    }

    #[test]
    fn opaque_bytes_are_decoded_lossily_never_refused() {
        let mut h = HeaderMap::new();
        h.insert(
            "x-ratelimit-resource",
            HeaderValue::from_bytes(b"core\xff").expect("opaque value"),
        );
        let kept = select_signal_headers(&h);
        assert_eq!(kept[0].1, "core\u{fffd}");
    }

    #[test]
    fn retry_after_presence_is_seen_in_either_form() {
        assert!(carries_retry_after(&map(&[("retry-after", "1")])));
        assert!(carries_retry_after(&map(&[("retry-after-ms", "1")])));
        assert!(!carries_retry_after(&map(&[("date", "x")])));
    }
}
