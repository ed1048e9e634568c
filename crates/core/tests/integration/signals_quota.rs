//! Quota headers in every dialect (SPEC §2.3) and the boundary they imply.

use std::time::Duration;

use backstop_core::quota::{parse_quota, quota_boundary, Dialect, QuotaObservation};
use backstop_core::retry_after::Boundary;
use http::{HeaderMap, HeaderName, HeaderValue};
use jiff::Timestamp;

const NOW: &str = "2025-03-01T12:00:00Z";

fn ts(s: &str) -> Timestamp {
    s.parse().unwrap()
}

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.append(
            HeaderName::from_bytes(k.as_bytes()).unwrap(),
            HeaderValue::from_str(v).unwrap(),
        );
    }
    h
}

fn one(obs: &[QuotaObservation], policy: Option<&str>) -> QuotaObservation {
    obs.iter()
        .find(|o| o.policy.as_deref() == policy)
        .unwrap_or_else(|| panic!("no observation for {policy:?} in {obs:?}"))
        .clone()
}

#[test]
fn ietf_structured_fields_merge_policy_and_state() {
    let h = headers(&[
        (
            "ratelimit-policy",
            "\"default\";q=100;w=60, \"burst\";q=10;w=1",
        ),
        ("ratelimit", "\"default\";r=50;t=30"),
    ]);
    let obs = parse_quota(&h, Dialect::Ietf, ts(NOW));
    let d = one(&obs, Some("default"));
    assert_eq!(d.dialect, Dialect::Ietf);
    assert_eq!(d.limit, Some(100));
    assert_eq!(d.remaining, Some(50));
    assert_eq!(d.window, Some(Duration::from_secs(60)));
    assert_eq!(d.reset_at, Some(ts("2025-03-01T12:00:30Z")));
    let b = one(&obs, Some("burst"));
    assert_eq!((b.limit, b.remaining), (Some(10), None));
}

#[test]
fn ietf_legacy_separate_fields_are_read_as_seconds() {
    let h = headers(&[
        ("ratelimit-limit", "100"),
        ("ratelimit-remaining", "0"),
        ("ratelimit-reset", "42"),
    ]);
    let obs = parse_quota(&h, Dialect::Ietf, ts(NOW));
    let o = one(&obs, None);
    assert_eq!((o.limit, o.remaining), (Some(100), Some(0)));
    assert_eq!(o.reset_at, Some(ts("2025-03-01T12:00:42Z")));
}

#[test]
fn ietf_malformed_structured_field_is_ignored() {
    let h = headers(&[
        ("ratelimit", "\"default\";r=;t=30"),
        ("ratelimit-policy", "((("),
    ]);
    assert!(parse_quota(&h, Dialect::Ietf, ts(NOW)).is_empty());
}

#[test]
fn openai_resets_are_go_durations_per_policy() {
    let h = headers(&[
        ("x-ratelimit-limit-requests", "500"),
        ("x-ratelimit-remaining-requests", "499"),
        ("x-ratelimit-reset-requests", "120ms"),
        ("x-ratelimit-limit-tokens", "30000"),
        ("x-ratelimit-remaining-tokens", "0"),
        ("x-ratelimit-reset-tokens", "1m30.5s"),
    ]);
    let obs = parse_quota(&h, Dialect::Openai, ts(NOW));
    assert_eq!(obs.len(), 2);
    let r = one(&obs, Some("requests"));
    assert_eq!(r.reset_at, Some(ts("2025-03-01T12:00:00.12Z")));
    let t = one(&obs, Some("tokens"));
    assert_eq!((t.limit, t.remaining), (Some(30_000), Some(0)));
    assert_eq!(t.reset_at, Some(ts("2025-03-01T12:01:30.5Z")));
}

#[test]
fn anthropic_resets_are_rfc3339_and_skew_corrected_by_date() {
    // Server clock runs 10 minutes behind the local one.
    let h = headers(&[
        ("date", "Sat, 01 Mar 2025 11:50:00 GMT"),
        ("anthropic-ratelimit-requests-limit", "50"),
        ("anthropic-ratelimit-requests-remaining", "0"),
        ("anthropic-ratelimit-requests-reset", "2025-03-01T11:50:20Z"),
        ("anthropic-ratelimit-input-tokens-limit", "40000"),
        ("anthropic-ratelimit-input-tokens-remaining", "39000"),
        (
            "anthropic-ratelimit-output-tokens-remaining",
            "not-a-number",
        ),
    ]);
    let obs = parse_quota(&h, Dialect::Anthropic, ts(NOW));
    let r = one(&obs, Some("requests"));
    assert_eq!(r.dialect, Dialect::Anthropic);
    assert_eq!(r.reset_at, Some(ts("2025-03-01T12:00:20Z")));
    assert_eq!(one(&obs, Some("input-tokens")).remaining, Some(39_000));
    assert!(obs
        .iter()
        .all(|o| o.policy.as_deref() != Some("output-tokens")));
}

#[test]
fn github_reset_is_epoch_seconds_not_a_delay() {
    let reset = ts("2025-03-01T12:15:00Z").as_second();
    let h = headers(&[
        ("x-ratelimit-limit", "5000"),
        ("x-ratelimit-used", "5000"),
        ("x-ratelimit-reset", &reset.to_string()),
        ("x-ratelimit-resource", "core"),
    ]);
    let obs = parse_quota(&h, Dialect::Github, ts(NOW));
    let o = one(&obs, Some("core"));
    assert_eq!(o.remaining, Some(0), "remaining derived from limit − used");
    assert_eq!(o.reset_at, Some(ts("2025-03-01T12:15:00Z")));
    // In the github dialect a small value is still an epoch (long past), never a delay.
    let small = parse_quota(
        &headers(&[("x-ratelimit-reset", "30")]),
        Dialect::Github,
        ts(NOW),
    );
    assert_eq!(small[0].reset_at, Some(ts("1970-01-01T00:00:30Z")));
}

#[test]
fn generic_reset_magnitude_decides_epoch_ms_epoch_s_or_delay() {
    let cases = [
        ("30", "2025-03-01T12:00:30Z"),
        ("1740830700", "2025-03-01T12:05:00Z"),
        ("1740830700500", "2025-03-01T12:05:00.5Z"),
    ];
    for (raw, want) in cases {
        let h = headers(&[("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", raw)]);
        let obs = parse_quota(&h, Dialect::Generic, ts(NOW));
        assert_eq!(obs[0].reset_at, Some(ts(want)), "raw {raw}");
    }
}

#[test]
fn generic_small_reset_is_labelled_generic_and_explained() {
    let h = headers(&[("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", "12")]);
    let obs = parse_quota(&h, Dialect::Generic, ts(NOW));
    assert_eq!(obs[0].dialect, Dialect::Generic);
    assert_eq!(
        obs[0].interpretation.as_deref(),
        Some("x-ratelimit-reset 12 read as a delay in seconds (generic: ≤ 10^9)")
    );
    match quota_boundary(&obs, ts(NOW)).expect("exhausted quota gives a boundary") {
        Boundary::Known {
            delay_ms,
            source,
            reason,
            ..
        } => {
            assert_eq!(delay_ms, 13_000);
            assert_eq!(source, "generic quota reset");
            let reason = reason.unwrap_or_default();
            assert!(reason.contains("read as a delay in seconds"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    // Epoch seconds are GitHub's meaning and keep its label; epoch ms are not GitHub's.
    let h = headers(&[("x-ratelimit-reset", "1740830700")]);
    let obs = parse_quota(&h, Dialect::Generic, ts(NOW));
    assert_eq!(obs[0].dialect, Dialect::Github);
    assert!(obs[0]
        .interpretation
        .as_deref()
        .unwrap_or_default()
        .contains("epoch seconds"));
    let h = headers(&[("x-ratelimit-reset", "1740830700500")]);
    assert_eq!(
        parse_quota(&h, Dialect::Generic, ts(NOW))[0].dialect,
        Dialect::Generic
    );
    // The github dialect itself fixes the meaning: nothing to explain.
    let h = headers(&[("x-ratelimit-reset", "1740830700")]);
    assert_eq!(
        parse_quota(&h, Dialect::Github, ts(NOW))[0].interpretation,
        None
    );
}

#[test]
fn generic_tries_every_dialect_and_records_which_matched() {
    let h = headers(&[
        ("ratelimit", "\"default\";r=5;t=10"),
        ("x-ratelimit-remaining-tokens", "7"),
        ("anthropic-ratelimit-tokens-remaining", "8"),
        ("x-ratelimit-remaining", "9"),
    ]);
    let obs = parse_quota(&h, Dialect::Generic, ts(NOW));
    let dialects: Vec<Dialect> = obs.iter().map(|o| o.dialect).collect();
    assert_eq!(
        dialects,
        vec![
            Dialect::Ietf,
            Dialect::Openai,
            Dialect::Anthropic,
            Dialect::Github
        ]
    );
    // A specific dialect ignores the others.
    let only = parse_quota(&h, Dialect::Openai, ts(NOW));
    assert_eq!(only.len(), 1);
    assert_eq!(only[0].remaining, Some(7));
}

#[test]
fn quota_exhausted_boundary_adds_a_one_second_margin() {
    let h = headers(&[
        ("x-ratelimit-remaining-requests", "0"),
        ("x-ratelimit-reset-requests", "20s"),
        ("x-ratelimit-remaining-tokens", "0"),
        ("x-ratelimit-reset-tokens", "6m0s"),
    ]);
    let obs = parse_quota(&h, Dialect::Openai, ts(NOW));
    match quota_boundary(&obs, ts(NOW)).expect("exhausted quota gives a boundary") {
        Boundary::Known {
            retry_not_before,
            delay_ms,
            source,
            ..
        } => {
            assert_eq!(retry_not_before, ts("2025-03-01T12:06:01Z"));
            assert_eq!(delay_ms, 361_000);
            assert!(source.contains("tokens"));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn quota_reset_already_past_means_now_with_min_delay() {
    let past = ts("2025-03-01T11:00:00Z").as_second();
    let h = headers(&[
        ("x-ratelimit-remaining", "0"),
        ("x-ratelimit-reset", &past.to_string()),
    ]);
    let obs = parse_quota(&h, Dialect::Github, ts(NOW));
    let b = quota_boundary(&obs, ts(NOW)).unwrap();
    assert_eq!(b.retry_not_before(), Some(ts("2025-03-01T12:00:01Z")));
}

#[test]
fn quota_with_remaining_left_gives_no_boundary() {
    let h = headers(&[
        ("x-ratelimit-remaining", "3"),
        ("x-ratelimit-reset", "1740830700"),
    ]);
    let obs = parse_quota(&h, Dialect::Github, ts(NOW));
    assert_eq!(quota_boundary(&obs, ts(NOW)), None);
}

#[test]
fn observation_serializes_window_in_seconds() {
    let h = headers(&[("ratelimit-policy", "\"default\";q=100;w=60")]);
    let obs = parse_quota(&h, Dialect::Ietf, ts(NOW));
    let v = serde_json::to_value(&obs[0]).unwrap();
    assert_eq!(v["window_seconds"], 60);
    assert_eq!(v["dialect"], "ietf");
    assert_eq!(v["policy"], "default");
    assert!(v["reset_at"].is_null());
}

#[test]
fn dialect_names_parse() {
    for (s, d) in [
        ("generic", Dialect::Generic),
        ("IETF", Dialect::Ietf),
        ("openai", Dialect::Openai),
        ("anthropic", Dialect::Anthropic),
        ("github", Dialect::Github),
    ] {
        assert_eq!(s.parse::<Dialect>(), Ok(d));
    }
    assert!("modrinth".parse::<Dialect>().is_err());
}
