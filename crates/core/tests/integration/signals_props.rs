//! Property tests: no header bytes make the signal readers panic, and huge values never overflow.

use backstop_core::classify::{classify, ClassifyRules, Observed, ResponseView};
use backstop_core::duration::parse_go_duration;
use backstop_core::quota::{parse_quota, quota_boundary, Dialect};
use backstop_core::retry_after::{normalize, normalize_value, RetryAfterOptions};
use http::{HeaderMap, HeaderName, HeaderValue};
use jiff::Timestamp;
use proptest::prelude::*;

const NAMES: [&str; 20] = [
    "retry-after",
    "retry-after-ms",
    "date",
    "ratelimit",
    "ratelimit-policy",
    "ratelimit-limit",
    "ratelimit-remaining",
    "ratelimit-reset",
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
    "x-ratelimit-used",
    "x-ratelimit-resource",
    "x-ratelimit-reset-requests",
    "x-ratelimit-remaining-tokens",
    "anthropic-ratelimit-requests-reset",
    "anthropic-ratelimit-tokens-remaining",
    "x-should-retry",
    "stripe-should-retry",
    "x-envoy-ratelimited",
];

fn header_map(entries: &[(usize, Vec<u8>)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (i, bytes) in entries {
        if let Ok(v) = HeaderValue::from_bytes(bytes) {
            h.append(HeaderName::from_static(NAMES[i % NAMES.len()]), v);
        }
    }
    h
}

fn now() -> Timestamp {
    "2025-03-01T12:00:00Z".parse().unwrap()
}

fn value_strategy() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..40),
        "[0-9a-zA-Z ,.:;=\"+-]{0,40}".prop_map(String::into_bytes),
        "[0-9]{1,40}(\\.[0-9]{1,30})?(ns|us|ms|s|m|h)?".prop_map(String::into_bytes),
    ]
}

proptest! {
    #[test]
    fn no_header_bytes_make_the_readers_panic(
        entries in proptest::collection::vec((0usize..NAMES.len(), value_strategy()), 0..8),
        status in 100u16..1000,
        body in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        let h = header_map(&entries);
        let opts = RetryAfterOptions::default();
        let b = normalize(&h, now(), &opts);
        if let Some(at) = b.retry_not_before() {
            prop_assert!(at > now(), "a known boundary is never in the past");
        }
        for d in [Dialect::Generic, Dialect::Ietf, Dialect::Openai, Dialect::Anthropic, Dialect::Github] {
            let obs = parse_quota(&h, d, now());
            if let Some(qb) = quota_boundary(&obs, now()) {
                if let Some(at) = qb.retry_not_before() {
                    prop_assert!(at > now());
                }
            }
        }
        let rules = ClassifyRules {
            error_code_pointer: Some("/error/code".to_owned()),
            retry_delay_pointers: vec!["/error/details/0/retryDelay".to_owned()],
            resets_in_seconds_pointers: vec!["/error/resets_in_seconds".to_owned()],
            ..ClassifyRules::with_retry_statuses(vec![429, 503])
        };
        let view = ResponseView { status, headers: &h, body: Some(&body) };
        let s = classify(&Observed::Response(view), &rules, now());
        prop_assert!(!(s.retryable && s.disposition == backstop_core::classify::Disposition::Uncertain));
    }

    #[test]
    fn arbitrary_retry_after_strings_never_panic_and_respect_the_ceiling(raw in "\\PC{0,60}") {
        let opts = RetryAfterOptions::default();
        let b = normalize_value(&raw, Some(&raw), now(), &opts);
        if let backstop_core::retry_after::Boundary::Known { delay_ms, .. } = b {
            prop_assert!(u128::from(delay_ms) <= opts.ceiling.as_millis());
            prop_assert!(u128::from(delay_ms) >= opts.min_delay.as_millis().min(1));
        }
    }

    #[test]
    fn exponent_like_huge_values_never_overflow(digits in "[1-9][0-9]{15,60}", exp in "(e|E)[0-9]{1,4}") {
        let opts = RetryAfterOptions::default();
        for raw in [digits.clone(), format!("{digits}{exp}"), format!("{digits}.{digits}"), format!("{digits}h{digits}m")] {
            // Unusable, or the known lower bound now + ceiling (SPEC §2.2): never a count.
            if let backstop_core::retry_after::Boundary::Known { delay_ms, .. } = normalize_value(&raw, None, now(), &opts) {
                prop_assert_eq!(u128::from(delay_ms), opts.ceiling.as_millis(), "{}", raw);
            }
            let _ = parse_go_duration(&raw);
            let mut h = HeaderMap::new();
            h.insert("x-ratelimit-reset", HeaderValue::from_str(&raw).unwrap());
            h.insert("retry-after-ms", HeaderValue::from_str(&raw).unwrap());
            h.insert("ratelimit", HeaderValue::from_str(&format!("\"d\";r=0;t={digits}")).unwrap());
            let obs = parse_quota(&h, Dialect::Generic, now());
            let _ = quota_boundary(&obs, now());
            if let backstop_core::retry_after::Boundary::Known { delay_ms, .. } = normalize(&h, now(), &opts) {
                prop_assert_eq!(u128::from(delay_ms), opts.ceiling.as_millis());
            }
        }
    }
}
