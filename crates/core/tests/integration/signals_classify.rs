//! Classification (SPEC §2.1): one test per row of the table, plus hints, codes and boundaries.

use backstop_core::classify::{
    classify, ClassifyRules, Disposition, Observed, ResponseView, Signal, TransportError,
};
use backstop_core::quota::Dialect;
use backstop_core::retry_after::Boundary;
use http::{HeaderMap, HeaderName, HeaderValue};
use jiff::Timestamp;

const NOW: &str = "2025-03-01T12:00:00Z";

fn ts(s: &str) -> Timestamp {
    s.parse().unwrap()
}

fn read() -> ClassifyRules {
    ClassifyRules::with_retry_statuses(vec![408, 429, 500, 502, 503, 504])
}

fn idempotent_write() -> ClassifyRules {
    ClassifyRules::with_retry_statuses(vec![408, 429, 502, 503, 504])
}

fn uncertain_write() -> ClassifyRules {
    ClassifyRules::with_retry_statuses(vec![])
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

fn respond(
    status: u16,
    pairs: &[(&str, &str)],
    body: Option<&str>,
    rules: &ClassifyRules,
) -> Signal {
    let h = headers(pairs);
    let view = ResponseView {
        status,
        headers: &h,
        body: body.map(str::as_bytes),
    };
    classify(&Observed::Response(view), rules, ts(NOW))
}

fn disposition(status: u16, pairs: &[(&str, &str)]) -> Disposition {
    respond(status, pairs, None, &read()).disposition
}

#[test]
fn success_2xx_is_success_and_not_retryable() {
    for status in [200, 201, 204, 299] {
        let s = respond(status, &[], None, &read());
        assert_eq!(s.disposition, Disposition::Success, "{status}");
        assert!(!s.retryable);
    }
}

#[test]
fn status_429_is_rate_limited_and_honours_the_boundary() {
    let s = respond(429, &[("retry-after", "10")], None, &read());
    assert_eq!(s.disposition, Disposition::RateLimited);
    assert!(s.retryable);
    assert_eq!(
        s.boundary.retry_not_before(),
        Some(ts("2025-03-01T12:00:10Z"))
    );
}

#[test]
fn quota_code_on_429_or_403_is_quota_exhausted() {
    let body =
        r#"{"error":{"code":"insufficient_quota","message":"You exceeded your current quota"}}"#;
    let rules = ClassifyRules {
        error_code_pointer: Some("/error/code".to_owned()),
        ..read()
    };
    for status in [429, 403] {
        let s = respond(status, &[], Some(body), &rules);
        assert_eq!(s.disposition, Disposition::QuotaExhausted, "{status}");
        assert_eq!(s.error_code.as_deref(), Some("insufficient_quota"));
        assert!(!s.retryable, "no reset known: never a short backoff loop");
    }
}

#[test]
fn google_resource_exhausted_per_day_is_quota_exhausted_not_a_short_429() {
    let body = r#"{"error":{"code":429,"status":"RESOURCE_EXHAUSTED","details":[
        {"@type":"type.googleapis.com/google.rpc.QuotaFailure",
         "violations":[{"quotaId":"GenerateRequestsPerDayPerProjectPerModel-FreeTier"}]},
        {"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"45.837906927s"}]}}"#;
    let rules = ClassifyRules {
        error_code_pointer: Some("/error/status".to_owned()),
        quota_id_pointers: vec!["/error/details/0/violations/0/quotaId".to_owned()],
        retry_delay_pointers: vec!["/error/details/1/retryDelay".to_owned()],
        ..read()
    };
    let s = respond(429, &[], Some(body), &rules);
    assert_eq!(s.disposition, Disposition::QuotaExhausted);
    assert_eq!(s.error_code.as_deref(), Some("RESOURCE_EXHAUSTED"));
    assert!(
        !s.boundary.is_known(),
        "a 45 s delay is not the daily reset"
    );
    assert!(!s.retryable);
}

#[test]
fn google_retry_info_delay_is_read_through_the_pointer() {
    let body = r#"{"error":{"status":"RESOURCE_EXHAUSTED","details":[
        {"@type":"type.googleapis.com/google.rpc.QuotaFailure",
         "violations":[{"quotaId":"GenerateRequestsPerMinutePerProjectPerModel"}]},
        {"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"45.837906927s"}]}}"#;
    let rules = ClassifyRules {
        error_code_pointer: Some("/error/status".to_owned()),
        quota_id_pointers: vec!["/error/details/0/violations/0/quotaId".to_owned()],
        retry_delay_pointers: vec![
            "/error/details/0/retryDelay".to_owned(),
            "/error/details/1/retryDelay".to_owned(),
        ],
        ..read()
    };
    let s = respond(429, &[], Some(body), &rules);
    assert_eq!(s.disposition, Disposition::RateLimited);
    match &s.boundary {
        Boundary::Known {
            delay_ms,
            source,
            raw,
            ..
        } => {
            assert_eq!(*delay_ms, 45_838);
            assert_eq!(source, "body /error/details/1/retryDelay");
            assert_eq!(raw.as_deref(), Some("45.837906927s"));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn usage_limit_reached_with_resets_in_seconds_is_quota_exhausted_with_that_boundary() {
    let body =
        r#"{"error":{"type":"usage_limit_reached","plan_type":"plus","resets_in_seconds":3600}}"#;
    let rules = ClassifyRules {
        error_code_pointer: Some("/error/type".to_owned()),
        resets_in_seconds_pointers: vec!["/error/resets_in_seconds".to_owned()],
        ..read()
    };
    let s = respond(429, &[], Some(body), &rules);
    assert_eq!(s.disposition, Disposition::QuotaExhausted);
    assert_eq!(
        s.boundary.retry_not_before(),
        Some(ts("2025-03-01T13:00:00Z"))
    );
    assert!(s.retryable, "known reset: the class may try again after it");
}

/// ChatGPT answers `usage_limit_reached` as `type` with no `code`: under the OpenAI dialect's
/// own pointer (`/error/code`) it is still read, since the rules know that code.
#[test]
fn usage_limit_reached_as_type_is_quota_exhausted_under_the_dialects_code_pointer() {
    let body =
        r#"{"error":{"type":"usage_limit_reached","plan_type":"plus","resets_in_seconds":1800}}"#;
    let rules = ClassifyRules {
        error_code_pointer: Some("/error/code".to_owned()),
        resets_in_seconds_pointers: vec!["/error/resets_in_seconds".to_owned()],
        ..read()
    };
    let s = respond(429, &[], Some(body), &rules);
    assert_eq!(s.disposition, Disposition::QuotaExhausted);
    assert_eq!(s.error_code.as_deref(), Some("usage_limit_reached"));
    // A `type` the rules do not know is no code.
    let other = r#"{"error":{"type":"requests","message":"slow down"}}"#;
    let s = respond(429, &[], Some(other), &rules);
    assert_eq!(s.disposition, Disposition::RateLimited);
    assert_eq!(s.error_code, None);
}

#[test]
fn status_503_and_529_are_unavailable() {
    assert_eq!(disposition(503, &[]), Disposition::Unavailable);
    let s = respond(529, &[("retry-after", "3")], None, &read());
    assert_eq!(s.disposition, Disposition::Unavailable);
    assert!(
        s.retryable,
        "529 retries like 503 for a class that retries 503"
    );
    assert!(s.boundary.is_known());
}

#[test]
fn envoy_ratelimited_marks_a_rate_limit_even_on_503() {
    assert_eq!(
        disposition(503, &[("x-envoy-ratelimited", "true")]),
        Disposition::RateLimited
    );
}

#[test]
fn statuses_408_500_502_504_are_transient() {
    for status in [408, 500, 502, 504] {
        let s = respond(status, &[], None, &read());
        assert_eq!(s.disposition, Disposition::Transient, "{status}");
        assert!(s.retryable, "{status}");
    }
    // The idempotent_write class does not retry 500.
    assert!(!respond(500, &[], None, &idempotent_write()).retryable);
}

#[test]
fn connect_dns_tls_failures_are_not_sent() {
    for e in [
        TransportError::Connect,
        TransportError::Dns,
        TransportError::Tls,
    ] {
        let s = classify(&Observed::Transport(e), &idempotent_write(), ts(NOW));
        assert_eq!(s.disposition, Disposition::NotSent, "{e}");
        assert!(s.retryable, "class has retries: safe to resend");
        let s = classify(&Observed::Transport(e), &uncertain_write(), ts(NOW));
        assert!(!s.retryable, "class without retries");
    }
}

#[test]
fn failures_after_send_are_uncertain_and_never_retryable() {
    for e in [
        TransportError::TimeoutAfterSend,
        TransportError::ResetAfterSend,
        TransportError::ResponseCut,
    ] {
        let s = classify(&Observed::Transport(e), &read(), ts(NOW));
        assert_eq!(s.disposition, Disposition::Uncertain, "{e}");
        assert!(!s.retryable);
        assert!(!s.boundary.is_known());
    }
}

#[test]
fn status_403_with_remaining_zero_or_retry_after_is_rate_limited() {
    assert_eq!(
        disposition(403, &[("x-ratelimit-remaining", "0")]),
        Disposition::RateLimited
    );
    let s = respond(403, &[("retry-after", "60")], None, &read());
    assert_eq!(s.disposition, Disposition::RateLimited);
    assert!(s.retryable, "as 429");
    assert_eq!(
        disposition(403, &[("x-ratelimit-remaining", "12")]),
        Disposition::Rejected
    );
}

#[test]
fn github_403_boundary_comes_from_the_exhausted_quota() {
    let reset = ts("2025-03-01T12:10:00Z").as_second().to_string();
    let rules = ClassifyRules {
        dialect: Dialect::Github,
        ..read()
    };
    let s = respond(
        403,
        &[
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", &reset),
            ("x-ratelimit-limit", "5000"),
        ],
        None,
        &rules,
    );
    assert_eq!(s.disposition, Disposition::RateLimited);
    assert_eq!(
        s.boundary.retry_not_before(),
        Some(ts("2025-03-01T12:10:01Z"))
    );
    assert_eq!(s.quota.len(), 1);
}

#[test]
fn status_409_is_conflict() {
    let s = respond(409, &[], None, &read());
    assert_eq!(s.disposition, Disposition::Conflict);
    assert!(!s.retryable);
}

#[test]
fn client_errors_are_rejected() {
    for status in [400, 401, 403, 404, 405, 410, 413, 422] {
        let s = respond(status, &[], None, &read());
        assert_eq!(s.disposition, Disposition::Rejected, "{status}");
        assert!(!s.retryable, "{status}");
    }
}

#[test]
fn other_statuses_are_rejected_unless_listed() {
    assert_eq!(disposition(418, &[]), Disposition::Rejected);
    assert_eq!(disposition(501, &[]), Disposition::Rejected);
    let rules = ClassifyRules::with_retry_statuses(vec![425, 429]);
    let s = respond(425, &[], None, &rules);
    assert_eq!(s.disposition, Disposition::Transient);
    assert!(s.retryable);
}

#[test]
fn should_retry_false_forbids_a_retry_and_is_recorded() {
    let s = respond(503, &[("x-should-retry", "false")], None, &read());
    assert_eq!(s.disposition, Disposition::Unavailable);
    assert!(!s.retryable);
    let hint = s.hint.expect("hint recorded");
    assert_eq!(hint.should_retry, Some(false));
    assert!(hint.applied);
}

#[test]
fn should_retry_true_overrides_the_table_when_the_class_retries() {
    let s = respond(409, &[("x-should-retry", "true")], None, &read());
    assert!(s.retryable);
    assert!(s.hint.unwrap().applied);
    // Never beyond a class without retries.
    let s = respond(409, &[("x-should-retry", "true")], None, &uncertain_write());
    assert!(!s.retryable);
    assert!(!s.hint.unwrap().applied);
}

#[test]
fn stripe_should_retry_is_a_hint_too() {
    let s = respond(500, &[("stripe-should-retry", "false")], None, &read());
    assert!(!s.retryable);
    assert_eq!(s.hint.unwrap().header, "stripe-should-retry");
}

#[test]
fn hints_are_ignored_when_policy_says_so() {
    let rules = ClassifyRules {
        honour_hints: false,
        ..read()
    };
    let s = respond(503, &[("x-should-retry", "false")], None, &rules);
    assert!(s.retryable);
    assert!(!s.hint.unwrap().applied);
}

#[test]
fn retry_after_wins_over_an_earlier_quota_boundary() {
    let s = respond(
        429,
        &[
            ("retry-after", "90"),
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "1m0s"),
        ],
        None,
        &read(),
    );
    match s.boundary {
        Boundary::Known {
            source,
            delay_ms,
            reason,
            ..
        } => {
            assert_eq!(source, "Retry-After");
            assert_eq!(delay_ms, 90_000);
            let reason = reason.expect("the quota boundary is recorded");
            assert!(reason.contains("openai quota (requests) reset"), "{reason}");
            assert!(reason.contains("61000 ms"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn exhausted_quota_reset_later_than_retry_after_wins() {
    // A retry at 7 s would hit the exhausted requests quota again: it resets at 20 s (+ 1 s).
    let s = respond(
        429,
        &[
            ("retry-after", "7"),
            ("anthropic-ratelimit-requests-remaining", "0"),
            ("anthropic-ratelimit-requests-reset", "2025-03-01T12:00:20Z"),
        ],
        None,
        &ClassifyRules {
            dialect: Dialect::Anthropic,
            ..read()
        },
    );
    match s.boundary {
        Boundary::Known {
            retry_not_before,
            delay_ms,
            source,
            reason,
            ..
        } => {
            assert_eq!(retry_not_before, ts("2025-03-01T12:00:21Z"));
            assert_eq!(delay_ms, 21_000);
            assert_eq!(source, "anthropic quota (requests) reset");
            let reason = reason.expect("both boundaries are recorded");
            assert!(reason.contains("reset + 1 s safety margin"), "{reason}");
            assert!(reason.contains("Retry-After \"7\""), "{reason}");
            assert!(reason.contains("7000 ms"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn quota_with_remaining_left_does_not_move_the_retry_after_boundary() {
    let s = respond(
        429,
        &[
            ("retry-after", "7"),
            ("anthropic-ratelimit-requests-remaining", "3"),
            ("anthropic-ratelimit-requests-reset", "2025-03-01T12:00:20Z"),
        ],
        None,
        &read(),
    );
    match s.boundary {
        Boundary::Known {
            delay_ms,
            source,
            reason,
            ..
        } => {
            assert_eq!(delay_ms, 7_000);
            assert_eq!(source, "Retry-After");
            assert_eq!(reason, None);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn invalid_retry_after_and_nothing_else_keeps_the_raw_value() {
    let s = respond(429, &[("retry-after", "0x10")], None, &read());
    match s.boundary {
        Boundary::Unknown { raw, .. } => assert_eq!(raw.as_deref(), Some("0x10")),
        other => panic!("{other:?}"),
    }
}

#[test]
fn unparseable_body_is_ignored() {
    let rules = ClassifyRules {
        error_code_pointer: Some("/error/code".to_owned()),
        ..read()
    };
    let s = respond(429, &[], Some("<html>busy</html>"), &rules);
    assert_eq!(s.disposition, Disposition::RateLimited);
    assert_eq!(s.error_code, None);
}

#[test]
fn transport_error_names_parse() {
    for (s, e) in [
        ("connect", TransportError::Connect),
        ("dns", TransportError::Dns),
        ("tls", TransportError::Tls),
        ("timeout-after-send", TransportError::TimeoutAfterSend),
        ("reset-after-send", TransportError::ResetAfterSend),
        ("response-cut", TransportError::ResponseCut),
    ] {
        assert_eq!(s.parse::<TransportError>(), Ok(e));
    }
    assert!("timeout".parse::<TransportError>().is_err());
}

#[test]
fn signal_serializes_with_snake_case_disposition() {
    let s = respond(429, &[("retry-after", "1")], None, &read());
    let v = serde_json::to_value(&s).unwrap();
    assert_eq!(v["disposition"], "rate_limited");
    assert_eq!(v["boundary"]["state"], "known");
    assert_eq!(v["retryable"], true);
}
