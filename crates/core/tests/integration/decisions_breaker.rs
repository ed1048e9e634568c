//! Sanitized fingerprints and the per-task circuit breaker (SPEC §7).

use backstop_core::breaker::{normalize_error_code, RequestFingerprint, TaskBreaker};
use backstop_core::outcome::Outcome;
use serde_json::json;

fn now() -> jiff::Timestamp {
    "2026-01-01T00:00:00Z".parse().expect("instant")
}

fn fields() -> Vec<String> {
    vec!["/amount".into(), "/currency".into(), "/destination".into()]
}

#[test]
fn varying_whitespace_or_volatile_fields_keeps_the_fingerprint() {
    let a = json!({"amount": 100, "currency": "EUR", "destination": "DE89", "note": "first"});
    let b: serde_json::Value = serde_json::from_str(
        r#"{ "note" : "second try",   "destination":"DE89","currency":"EUR", "amount":100, "ts": 17 }"#,
    )
    .expect("json");
    let fa = RequestFingerprint::compute("POST", "/v1/transfers", Some(&a), &fields());
    let fb = RequestFingerprint::compute("post", "/v1/transfers", Some(&b), &fields());
    assert_eq!(fa, fb);
    assert_eq!(fa.as_str().len(), 64);
    assert!(fa.as_str().bytes().all(|c| c.is_ascii_hexdigit()));
}

#[test]
fn stable_fields_method_and_template_change_the_fingerprint() {
    let base = json!({"amount": 100, "currency": "EUR", "destination": "DE89"});
    let fp = |method: &str, template: &str, payload: &serde_json::Value| {
        RequestFingerprint::compute(method, template, Some(payload), &fields())
    };
    let reference = fp("POST", "/v1/transfers", &base);
    assert_ne!(
        reference,
        fp(
            "POST",
            "/v1/transfers",
            &json!({"amount": 101, "currency": "EUR", "destination": "DE89"})
        )
    );
    assert_ne!(reference, fp("PUT", "/v1/transfers", &base));
    assert_ne!(reference, fp("POST", "/v1/payouts", &base));
    // A missing field differs from an explicit null.
    let missing = json!({"amount": 100, "currency": "EUR"});
    let null = json!({"amount": 100, "currency": "EUR", "destination": null});
    assert_ne!(
        fp("POST", "/v1/transfers", &missing),
        fp("POST", "/v1/transfers", &null)
    );
}

#[test]
fn fingerprint_never_contains_payload_values() {
    let secretish = json!({"amount": 100, "card": "4242424242424242"});
    let fp = RequestFingerprint::compute(
        "POST",
        "/v1/charges",
        Some(&secretish),
        &["/card".to_owned()],
    );
    assert!(!fp.as_str().contains("4242424242424242"));
    let failure = fp.with_error("card_declined");
    assert!(!failure.as_str().contains("card_declined"));
    assert_ne!(failure.as_str(), fp.as_str());
}

#[test]
fn error_codes_are_normalized() {
    assert_eq!(normalize_error_code(" Invalid-IBAN "), "invalid_iban");
    assert_eq!(normalize_error_code("invalid_iban"), "invalid_iban");
    assert_eq!(normalize_error_code("INVALID  IBAN"), "invalid_iban");
    assert_eq!(normalize_error_code(""), "unknown");
}

#[test]
fn same_failure_three_times_opens_the_circuit() {
    let payload = json!({"amount": 100, "currency": "EUR", "destination": "DE89"});
    let fp = RequestFingerprint::compute("POST", "/v1/transfers", Some(&payload), &fields());
    let mut breaker = TaskBreaker::new(3);
    assert!(breaker
        .record_failure(&fp, "invalid_iban", Some(422), now())
        .is_none());
    assert!(breaker
        .record_failure(&fp, "Invalid-IBAN", Some(422), now())
        .is_none());
    breaker.check(&fp).expect("still closed after two");
    let opened = breaker
        .record_failure(&fp, "INVALID_IBAN", Some(422), now())
        .expect("third identical failure opens");
    assert_eq!(opened.failures, 3);
    assert_eq!(opened.last_status, Some(422));
    assert_eq!(opened.outcome(), Outcome::CircuitOpen);
    let refused = breaker.check(&fp).expect_err("open for the task");
    assert_eq!(refused.error_code, "invalid_iban");
    assert_eq!(refused.failure, fp.with_error("invalid_iban"));
    // Another request of the same task is not affected.
    let other = RequestFingerprint::compute("GET", "/v1/transfers/{id}", None, &[]);
    breaker.check(&other).expect("other path closed");
}

#[test]
fn a_different_error_or_a_success_restarts_the_count() {
    let fp = RequestFingerprint::compute("POST", "/v1/messages", None, &[]);
    let mut breaker = TaskBreaker::new(3);
    breaker.record_failure(&fp, "unauthorized", Some(401), now());
    breaker.record_failure(&fp, "unauthorized", Some(401), now());
    breaker.record_failure(&fp, "forbidden", Some(403), now());
    breaker
        .check(&fp)
        .expect("a different error restarts the streak");
    breaker.record_failure(&fp, "forbidden", Some(403), now());
    breaker.record_success(&fp);
    breaker.record_failure(&fp, "forbidden", Some(403), now());
    breaker.record_failure(&fp, "forbidden", Some(403), now());
    breaker.check(&fp).expect("success cleared the streak");
    assert!(breaker
        .record_failure(&fp, "forbidden", Some(403), now())
        .is_some());
}
