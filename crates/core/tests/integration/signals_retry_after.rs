//! Retry-After normalization (SPEC §2.2, RFC 9110 §10.2.3): every accepted form and every edge.

use std::time::Duration;

use backstop_core::retry_after::{
    normalize, normalize_value, Boundary, ClockSource, RetryAfterOptions,
};
use http::{HeaderMap, HeaderValue};
use jiff::Timestamp;

fn ts(s: &str) -> Timestamp {
    s.parse().unwrap()
}

const NOW: &str = "2025-03-01T12:00:00Z";

fn opts() -> RetryAfterOptions {
    RetryAfterOptions::default()
}

fn known(b: &Boundary) -> (Timestamp, u64, Option<ClockSource>, Option<String>, String) {
    match b {
        Boundary::Known {
            retry_not_before,
            delay_ms,
            clock,
            reason,
            source,
            ..
        } => (
            *retry_not_before,
            *delay_ms,
            *clock,
            reason.clone(),
            source.clone(),
        ),
        other => panic!("expected a known boundary, got {other:?}"),
    }
}

fn unknown(b: &Boundary) -> (Option<String>, String) {
    match b {
        Boundary::Unknown { raw, reason, .. } => (raw.clone(), reason.clone()),
        other => panic!("expected an unknown boundary, got {other:?}"),
    }
}

fn delay_of(raw: &str) -> u64 {
    known(&normalize_value(raw, None, ts(NOW), &opts())).1
}

/// The delay read from `raw` with a 1 ms `min_delay`, to check parsing below the default floor.
fn parsed_delay_of(raw: &str) -> u64 {
    let opts = RetryAfterOptions {
        min_delay: Duration::from_millis(1),
        ..opts()
    };
    known(&normalize_value(raw, None, ts(NOW), &opts)).1
}

#[test]
fn retry_after_integer_seconds_is_honoured() {
    let b = normalize_value("120", None, ts(NOW), &opts());
    let (at, delay_ms, clock, reason, source) = known(&b);
    assert_eq!(at, ts("2025-03-01T12:02:00Z"));
    assert_eq!(delay_ms, 120_000);
    assert_eq!(clock, None);
    assert_eq!(reason, None);
    assert_eq!(source, "Retry-After");
}

#[test]
fn retry_after_decimal_seconds_is_honoured() {
    assert_eq!(delay_of("1.5"), 1_500);
    assert_eq!(parsed_delay_of("0.25"), 250);
    assert_eq!(delay_of("2.0001"), 2_001, "fractions round up, never early");
}

#[test]
fn retry_after_surrounding_whitespace_is_accepted() {
    assert_eq!(delay_of("  7\t"), 7_000);
}

#[test]
fn retry_after_go_style_duration_is_read_as_a_duration() {
    assert_eq!(delay_of("1m0s"), 60_000);
    assert_eq!(delay_of("1m30.5s"), 90_500);
    assert_eq!(parsed_delay_of("250ms"), 250);
}

#[test]
fn retry_after_imf_fixdate_with_date_header_uses_server_clock() {
    // Server clock is 1 h behind ours: the delay (30 s) comes from the server's own Date.
    let b = normalize_value(
        "Sat, 01 Mar 2025 11:00:30 GMT",
        Some("Sat, 01 Mar 2025 11:00:00 GMT"),
        ts(NOW),
        &opts(),
    );
    let (at, delay_ms, clock, _, _) = known(&b);
    assert_eq!(delay_ms, 30_000);
    assert_eq!(at, ts("2025-03-01T12:00:30Z"));
    assert_eq!(clock, Some(ClockSource::ServerDate));
}

#[test]
fn retry_after_http_date_without_date_header_uses_local_clock() {
    let b = normalize_value("Sat, 01 Mar 2025 12:00:45 GMT", None, ts(NOW), &opts());
    let (at, delay_ms, clock, _, _) = known(&b);
    assert_eq!(delay_ms, 45_000);
    assert_eq!(at, ts("2025-03-01T12:00:45Z"));
    assert_eq!(clock, Some(ClockSource::Local));
}

#[test]
fn retry_after_rfc850_date_is_accepted() {
    let b = normalize_value("Saturday, 01-Mar-25 12:01:00 GMT", None, ts(NOW), &opts());
    assert_eq!(known(&b).1, 60_000);
}

#[test]
fn retry_after_asctime_date_is_accepted() {
    let b = normalize_value("Sat Mar  1 12:02:00 2025", None, ts(NOW), &opts());
    assert_eq!(known(&b).1, 120_000);
}

#[test]
fn retry_after_numeric_offset_date_is_accepted() {
    let b = normalize_value("Sat, 01 Mar 2025 13:00:10 +0100", None, ts(NOW), &opts());
    assert_eq!(known(&b).1, 10_000);
}

#[test]
fn retry_after_unparseable_date_header_falls_back_to_local_clock() {
    let b = normalize_value(
        "Sat, 01 Mar 2025 12:00:05 GMT",
        Some("yesterday"),
        ts(NOW),
        &opts(),
    );
    let (_, delay_ms, clock, reason, _) = known(&b);
    assert_eq!(delay_ms, 5_000);
    assert_eq!(clock, Some(ClockSource::Local));
    assert!(reason.unwrap().contains("Date header unparseable"));
}

#[test]
fn retry_after_date_in_the_past_applies_min_delay() {
    let b = normalize_value("Sat, 01 Mar 2025 11:00:00 GMT", None, ts(NOW), &opts());
    let (at, delay_ms, _, reason, _) = known(&b);
    assert_eq!(delay_ms, 1_000);
    assert_eq!(at, ts("2025-03-01T12:00:01Z"));
    assert!(reason.unwrap().contains("min_delay"));
}

#[test]
fn retry_after_zero_applies_min_delay() {
    let custom = RetryAfterOptions {
        min_delay: Duration::from_millis(2_500),
        ..opts()
    };
    let b = normalize_value("0", None, ts(NOW), &custom);
    let (_, delay_ms, _, reason, _) = known(&b);
    assert_eq!(delay_ms, 2_500);
    assert!(reason.unwrap().contains("min_delay"));
}

#[test]
fn retry_after_invalid_values_are_unknown_with_raw_kept() {
    for raw in [
        "+3",
        "0x10",
        "-1",
        "",
        "   ",
        "soon",
        "1e3",
        "12abc",
        "Sun, 99 Foo 2025",
    ] {
        let b = normalize_value(raw, None, ts(NOW), &opts());
        let (kept, reason) = unknown(&b);
        assert_eq!(kept.as_deref(), Some(raw), "raw kept for {raw:?}");
        assert!(!reason.is_empty(), "reason for {raw:?}");
    }
}

#[test]
fn retry_after_over_the_ceiling_is_a_known_lower_bound_never_unknown() {
    // 86,401 s, 10^32 s, a date in 2100 or 9999: the provider forbade a retry for at least the
    // ceiling, so the boundary is now + 24 h, raw value kept — never unknown.
    let lower_bound = ts("2025-03-02T12:00:00Z");
    for raw in [
        "86401",
        "100000",
        "99999999999999999999999999999999",
        "Fri, 01 Jan 2100 00:00:00 GMT",
    ] {
        let b = normalize_value(raw, None, ts(NOW), &opts());
        let (at, delay_ms, _, reason, _) = known(&b);
        assert_eq!(at, lower_bound, "{raw}");
        assert_eq!(delay_ms, 86_400_000, "{raw}");
        let Boundary::Known { raw: kept, .. } = &b else {
            unreachable!("known above")
        };
        assert_eq!(kept.as_deref(), Some(raw), "{raw}");
        let reason = reason.unwrap_or_default();
        assert!(reason.contains("lower bound"), "{raw}: {reason}");
    }
    // Exactly the ceiling is counted as given.
    assert_eq!(delay_of("86400"), 86_400_000);
    let h = headers(&[("retry-after-ms", "99999999999999999999999999999")]);
    let (at, _, _, reason, source) = known(&normalize(&h, ts(NOW), &opts()));
    assert_eq!(at, lower_bound);
    assert_eq!(source, "retry-after-ms");
    assert!(reason.unwrap_or_default().contains("lower bound"));
}

#[test]
fn retry_after_joined_values_take_the_largest() {
    assert_eq!(delay_of("7, 7"), 7_000);
    assert_eq!(delay_of("10, 20"), 20_000);
    assert_eq!(delay_of("garbage, 5"), 5_000);
    let b = normalize_value("Sat, 01 Mar 2025 12:00:30 GMT, 10", None, ts(NOW), &opts());
    assert_eq!(known(&b).1, 30_000);
}

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.append(
            http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            HeaderValue::from_str(v).unwrap(),
        );
    }
    h
}

#[test]
fn retry_after_ms_wins_over_retry_after() {
    let h = headers(&[("retry-after", "20"), ("retry-after-ms", "1500")]);
    let (_, delay_ms, _, _, source) = known(&normalize(&h, ts(NOW), &opts()));
    assert_eq!(delay_ms, 1_500);
    assert_eq!(source, "retry-after-ms");
}

#[test]
fn invalid_retry_after_ms_falls_back_to_retry_after() {
    let h = headers(&[("retry-after", "20"), ("retry-after-ms", "-5")]);
    let (_, delay_ms, _, reason, source) = known(&normalize(&h, ts(NOW), &opts()));
    assert_eq!(delay_ms, 20_000);
    assert_eq!(source, "Retry-After");
    assert!(reason.unwrap().contains("retry-after-ms unusable"));
}

#[test]
fn multiple_retry_after_instances_take_the_largest_valid() {
    let h = headers(&[
        ("retry-after", "5"),
        ("retry-after", "bogus"),
        ("retry-after", "12"),
    ]);
    assert_eq!(known(&normalize(&h, ts(NOW), &opts())).1, 12_000);
}

#[test]
fn normalize_uses_the_responses_date_header() {
    let h = headers(&[
        ("date", "Sat, 01 Mar 2025 08:00:00 GMT"),
        ("retry-after", "Sat, 01 Mar 2025 08:01:00 GMT"),
    ]);
    let (_, delay_ms, clock, _, _) = known(&normalize(&h, ts(NOW), &opts()));
    assert_eq!(delay_ms, 60_000);
    assert_eq!(clock, Some(ClockSource::ServerDate));
}

#[test]
fn no_retry_after_is_unknown() {
    let b = normalize(&HeaderMap::new(), ts(NOW), &opts());
    assert_eq!(
        b,
        Boundary::Unknown {
            raw: None,
            reason: "no Retry-After".to_owned(),
            source: None
        }
    );
    assert_eq!(b.retry_not_before(), None);
}

#[test]
fn boundary_serializes_with_a_state_tag() {
    let b = normalize_value("2", None, ts(NOW), &opts());
    let v = serde_json::to_value(&b).unwrap();
    assert_eq!(v["state"], "known");
    assert_eq!(v["retry_not_before"], "2025-03-01T12:00:02Z");
    assert_eq!(v["delay_ms"], 2000);
    let u = serde_json::to_value(normalize_value("-1", None, ts(NOW), &opts())).unwrap();
    assert_eq!(u["state"], "unknown");
    assert_eq!(u["raw"], "-1");
}

#[test]
fn a_sub_second_delay_is_honoured_as_given_and_only_zero_gets_min_delay() {
    for (raw, ms) in [
        ("0.503", 503),
        ("0.25", 250),
        ("250ms", 250),
        ("0.0001", 1),
        ("1ms", 1),
    ] {
        let (_, delay_ms, _, reason, _) = known(&normalize_value(raw, None, ts(NOW), &opts()));
        assert_eq!(delay_ms, ms, "{raw}");
        assert_eq!(reason, None, "{raw}: nothing adjusted");
    }
    let h = headers(&[("retry-after-ms", "250")]);
    let (at, delay_ms, _, _, source) = known(&normalize(&h, ts(NOW), &opts()));
    assert_eq!(delay_ms, 250);
    assert_eq!(source, "retry-after-ms");
    assert_eq!(at, ts("2025-03-01T12:00:00.25Z"));
    // "Now" is never a tight loop.
    let (at, delay_ms, _, reason, _) = known(&normalize_value("0", None, ts(NOW), &opts()));
    assert_eq!(delay_ms, 1_000);
    assert_eq!(at, ts("2025-03-01T12:00:01Z"));
    assert!(reason.unwrap_or_default().contains("min_delay"));
}
