//! Every diagnosis state of SPEC §10 and the edges decided in `backstop_core::diagnose`.

use std::time::Duration;

use backstop_core::diagnose::{
    diagnose, parse_snapshot, DiagnoseOptions, Diagnosis, DiagnosisReport, SnapshotError, WakeGrace,
};
use backstop_core::retry_after::ClockSource;
use jiff::Timestamp;
use serde_json::{json, Value};

const NOW: &str = "2026-07-26T18:42:00Z";

fn ts(s: &str) -> Timestamp {
    s.parse().unwrap()
}

/// A healthy waiting snapshot: boundary 18:42:30 (60 s after the throttle), wake aligned,
/// three attempts left, nine minutes of headroom.
fn base() -> Value {
    json!({
        "run_id": "run-1",
        "quota_scope": "llm-api/project:research",
        "throttled_at": "2026-07-26T18:41:30Z",
        "status": 429,
        "retry_after_raw": "60",
        "date_header": null,
        "scheduled_retry_at": "2026-07-26T18:42:30Z",
        "scheduler_job_id": "job-1",
        "scheduler_heartbeat_at": "2026-07-26T18:41:55Z",
        "retry_started_at": null,
        "retry_finished_at": null,
        "retry_status": null,
        "attempts_used": 1,
        "max_attempts": 4,
        "wait_budget_ms": 120000,
        "wait_used_ms": 0,
        "outcome_deadline": "2026-07-26T18:52:30Z",
        "completion_estimate_ms": 60000,
        "outcome_receipt": null
    })
}

fn with(mut v: Value, patch: Value) -> Value {
    for (k, val) in patch.as_object().unwrap() {
        v[k] = val.clone();
    }
    v
}

fn run_at(v: &Value, now: &str, grace: Duration) -> DiagnosisReport {
    let snapshot = parse_snapshot(v.to_string().as_bytes()).unwrap();
    let opts = DiagnoseOptions {
        wake_grace: WakeGrace(grace),
        ..DiagnoseOptions::default()
    };
    diagnose(&snapshot, ts(now), &opts)
}

fn run(v: &Value) -> DiagnosisReport {
    run_at(v, NOW, Duration::from_secs(30))
}

fn retried(status: u16, started: &str, receipt: Value) -> Value {
    json!({
        "retry_started_at": started,
        "retry_finished_at": "2026-07-26T18:42:40Z",
        "retry_status": status,
        "outcome_receipt": receipt,
    })
}

#[test]
fn healthy_wait_is_waiting_backpressure_with_all_proofs() {
    let r = run(&base());
    assert_eq!(r.diagnosis, Diagnosis::WaitingBackpressure);
    assert!(r.proofs.all_hold());
    assert_eq!(r.retry_not_before, Some(ts("2026-07-26T18:42:30Z")));
    assert_eq!(r.retry_after_debt_ms, Some(60_000));
    assert_eq!(r.headroom_ms, Some(540_000));
    assert_eq!(r.action.id(), "leave_alone_check_wake");
}

#[test]
fn retry_2xx_with_matching_receipt_is_recovered() {
    let v = with(
        base(),
        retried(200, "2026-07-26T18:42:31Z", json!({"matches": true})),
    );
    let r = run_at(&v, "2026-07-26T18:43:00Z", Duration::from_secs(30));
    assert_eq!(r.diagnosis, Diagnosis::Recovered);
    assert_eq!(r.action.id(), "verify_outcome");
}

#[test]
fn retry_200_without_receipt_is_retry_succeeded_unverified() {
    let v = with(base(), retried(200, "2026-07-26T18:42:31Z", Value::Null));
    let r = run_at(&v, "2026-07-26T18:43:00Z", Duration::from_secs(30));
    assert_eq!(r.diagnosis, Diagnosis::RetrySucceededUnverified);
    assert_eq!(r.action.id(), "verify_outcome");
}

#[test]
fn retry_200_with_non_matching_receipt_is_retry_succeeded_unverified() {
    let v = with(
        base(),
        retried(204, "2026-07-26T18:42:31Z", json!({"matches": false})),
    );
    let r = run_at(&v, "2026-07-26T18:43:00Z", Duration::from_secs(30));
    assert_eq!(r.diagnosis, Diagnosis::RetrySucceededUnverified);
}

#[test]
fn recovered_is_checked_before_budget_exhaustion() {
    // All attempts used, but the last one succeeded and was verified.
    let v = with(
        with(
            base(),
            retried(200, "2026-07-26T18:42:31Z", json!({"matches": true})),
        ),
        json!({"attempts_used": 4}),
    );
    let r = run_at(&v, "2026-07-26T18:43:00Z", Duration::from_secs(30));
    assert_eq!(r.diagnosis, Diagnosis::Recovered);
}

#[test]
fn no_attempt_left_is_retry_budget_exhausted() {
    let r = run(&with(base(), json!({"attempts_used": 4})));
    assert_eq!(r.diagnosis, Diagnosis::RetryBudgetExhausted);
    assert_eq!(r.proofs.authority, Some(false));
    assert_eq!(r.action.id(), "stop_and_hand_over_evidence");
}

#[test]
fn in_flight_retry_using_the_last_attempt_is_still_authorized() {
    let v = with(
        base(),
        json!({"attempts_used": 4, "retry_started_at": "2026-07-26T18:42:30Z"}),
    );
    let r = run_at(&v, "2026-07-26T18:42:31Z", Duration::from_secs(30));
    assert_eq!(r.proofs.authority, Some(true));
    assert_eq!(r.diagnosis, Diagnosis::WaitingBackpressure);
}

#[test]
fn remaining_wait_exactly_at_the_budget_is_inside_and_1_ms_more_is_exhausted() {
    // Remaining wait at now = 30 000 ms; used 90 000 → 120 000 == budget.
    let at_edge = run(&with(base(), json!({"wait_used_ms": 90000})));
    assert_eq!(at_edge.proofs.authority, Some(true));
    assert_eq!(at_edge.diagnosis, Diagnosis::WaitingBackpressure);
    let over = run(&with(base(), json!({"wait_used_ms": 90001})));
    assert_eq!(over.proofs.authority, Some(false));
    assert_eq!(over.diagnosis, Diagnosis::RetryBudgetExhausted);
}

#[test]
fn remaining_wait_is_measured_from_now_not_from_the_throttle() {
    // At 18:42:29 only 1 s remains: 119 000 + 1 000 fits the 120 000 budget.
    let v = with(base(), json!({"wait_used_ms": 119000}));
    let r = run_at(&v, "2026-07-26T18:42:29Z", Duration::from_secs(30));
    assert_eq!(r.diagnosis, Diagnosis::WaitingBackpressure);
}

#[test]
fn negative_headroom_is_deadline_exhausted() {
    let r = run(&with(
        base(),
        json!({"outcome_deadline": "2026-07-26T18:43:00Z", "completion_estimate_ms": 0}),
    ));
    // 18:43:00 − 18:42:30 − 0 = 30 s: still fits.
    assert_eq!(r.headroom_ms, Some(30_000));
    assert_eq!(r.diagnosis, Diagnosis::WaitingBackpressure);
    // 18:43:00 − 18:42:30 − 60 s = −30 s.
    let r = run(&with(
        base(),
        json!({"outcome_deadline": "2026-07-26T18:43:00Z"}),
    ));
    assert_eq!(r.headroom_ms, Some(-30_000));
    assert_eq!(r.proofs.outcome, Some(false));
    assert_eq!(r.diagnosis, Diagnosis::DeadlineExhausted);
    assert_eq!(r.action.id(), "tell_owner_deadline");
}

#[test]
fn zero_headroom_still_holds() {
    let r = run(&with(
        base(),
        json!({"outcome_deadline": "2026-07-26T18:43:30Z"}),
    ));
    assert_eq!(r.headroom_ms, Some(0));
    assert_eq!(r.diagnosis, Diagnosis::WaitingBackpressure);
}

#[test]
fn no_deadline_means_no_headroom_and_nothing_to_miss() {
    let r = run(&with(base(), json!({"outcome_deadline": null})));
    assert_eq!(r.headroom_ms, None);
    assert_eq!(r.proofs.outcome, Some(true));
    assert_eq!(r.diagnosis, Diagnosis::WaitingBackpressure);
}

#[test]
fn retry_started_before_the_boundary_is_early_retry_loop() {
    let v = with(
        base(),
        json!({"retry_started_at": "2026-07-26T18:41:40Z", "attempts_used": 2}),
    );
    let r = run(&v);
    assert_eq!(r.diagnosis, Diagnosis::EarlyRetryLoop);
    assert_eq!(r.proofs.wake, Some(false));
    assert_eq!(r.action.id(), "stop_retry_path");
}

#[test]
fn early_retry_that_got_429_again_is_still_early_retry_loop() {
    let v = with(
        base(),
        json!({"retry_started_at": "2026-07-26T18:41:40Z", "retry_finished_at": "2026-07-26T18:41:41Z",
               "retry_status": 429, "attempts_used": 2}),
    );
    assert_eq!(run(&v).diagnosis, Diagnosis::EarlyRetryLoop);
}

#[test]
fn retry_started_exactly_at_the_boundary_is_not_early() {
    let v = with(
        base(),
        json!({"retry_started_at": "2026-07-26T18:42:30Z", "attempts_used": 2}),
    );
    let r = run_at(&v, "2026-07-26T18:42:31Z", Duration::from_secs(30));
    assert_eq!(r.diagnosis, Diagnosis::WaitingBackpressure);
    let v = with(
        base(),
        json!({"retry_started_at": "2026-07-26T18:42:29.999Z", "attempts_used": 2}),
    );
    let r = run_at(&v, "2026-07-26T18:42:31Z", Duration::from_secs(30));
    assert_eq!(r.diagnosis, Diagnosis::EarlyRetryLoop);
}

#[test]
fn exactly_at_the_grace_edge_is_not_stuck_and_1_ms_after_is() {
    // scheduled 18:42:30 + 30 s grace = 18:43:00.
    let at_edge = run_at(&base(), "2026-07-26T18:43:00Z", Duration::from_secs(30));
    assert_eq!(at_edge.diagnosis, Diagnosis::WaitingBackpressure);
    assert_eq!(at_edge.proofs.wake, Some(true));
    let after = run_at(&base(), "2026-07-26T18:43:00.001Z", Duration::from_secs(30));
    assert_eq!(after.diagnosis, Diagnosis::StuckMissedWake);
    assert_eq!(after.proofs.wake, Some(false));
    assert_eq!(after.action.id(), "scheduler_check_rearm");
}

#[test]
fn a_shorter_grace_makes_the_same_silence_stuck() {
    let r = run_at(&base(), "2026-07-26T18:42:40Z", Duration::from_secs(5));
    assert_eq!(r.diagnosis, Diagnosis::StuckMissedWake);
    let r = run_at(&base(), "2026-07-26T18:42:40Z", Duration::from_secs(30));
    assert_eq!(r.diagnosis, Diagnosis::WaitingBackpressure);
}

#[test]
fn no_scheduled_retry_is_no_durable_wake() {
    let r = run(&with(base(), json!({"scheduled_retry_at": null})));
    assert_eq!(r.diagnosis, Diagnosis::NoDurableWake);
    assert_eq!(r.proofs.wake, Some(false));
    assert_eq!(r.action.id(), "scheduler_check_rearm");
}

#[test]
fn wake_scheduled_before_the_boundary_is_no_durable_wake() {
    let r = run(&with(
        base(),
        json!({"scheduled_retry_at": "2026-07-26T18:42:10Z"}),
    ));
    assert_eq!(r.proofs.wake, Some(false));
    assert_eq!(r.diagnosis, Diagnosis::NoDurableWake);
}

#[test]
fn retry_after_the_boundary_that_failed_again_has_no_wake_left() {
    let v = with(
        base(),
        json!({"retry_started_at": "2026-07-26T18:42:30Z", "retry_finished_at": "2026-07-26T18:42:31Z",
               "retry_status": 503, "attempts_used": 2}),
    );
    let r = run_at(&v, "2026-07-26T18:42:40Z", Duration::from_secs(30));
    assert_eq!(r.diagnosis, Diagnosis::NoDurableWake);
}

#[test]
fn missing_retry_after_is_uncertain_boundary() {
    let r = run(&with(base(), json!({"retry_after_raw": null})));
    assert_eq!(r.diagnosis, Diagnosis::UncertainBoundary);
    assert_eq!(r.proofs.limit, Some(false));
    assert_eq!(r.retry_not_before, None);
    assert_eq!(r.retry_after_debt_ms, None);
    assert_eq!(r.headroom_ms, None);
    assert!(r.boundary_reason.is_some());
    assert_eq!(r.action.id(), "collect_evidence");
    // Absent instead of null: the same.
    let mut v = base();
    v.as_object_mut().unwrap().remove("retry_after_raw");
    assert_eq!(run(&v).diagnosis, Diagnosis::UncertainBoundary);
}

#[test]
fn invalid_retry_after_is_uncertain_boundary_never_a_guess() {
    for raw in ["soon", "-5", "", "+3", "0x10"] {
        let r = run(&with(base(), json!({ "retry_after_raw": raw })));
        assert_eq!(r.diagnosis, Diagnosis::UncertainBoundary, "raw {raw:?}");
        assert_eq!(r.proofs.limit, Some(false));
        assert_eq!(r.proofs.wake, None, "raw {raw:?}: wake cannot be judged");
        assert!(r.boundary_reason.is_some());
    }
}

#[test]
fn a_retry_after_over_the_ceiling_is_a_known_boundary_beyond_the_budget_not_uncertain() {
    let r = run(&with(base(), json!({ "retry_after_raw": "999999999" })));
    assert_ne!(r.diagnosis, Diagnosis::UncertainBoundary);
    assert_eq!(r.diagnosis, Diagnosis::RetryBudgetExhausted);
    assert!(
        r.retry_not_before.is_some(),
        "now + the ceiling, a lower bound"
    );
}

#[test]
fn unknown_boundary_does_not_hide_a_missing_wake_or_an_exhausted_budget() {
    let v = with(
        base(),
        json!({"retry_after_raw": null, "scheduled_retry_at": null}),
    );
    assert_eq!(run(&v).diagnosis, Diagnosis::NoDurableWake);
    let v = with(base(), json!({"retry_after_raw": null, "attempts_used": 4}));
    assert_eq!(run(&v).diagnosis, Diagnosis::RetryBudgetExhausted);
    let v = with(
        base(),
        json!({"retry_after_raw": "soon", "wait_used_ms": 120001}),
    );
    assert_eq!(run(&v).diagnosis, Diagnosis::RetryBudgetExhausted);
}

#[test]
fn http_date_with_date_header_uses_the_server_clock() {
    // The server's clock is 10 s behind: Retry-After − Date = 60 s, added to the receive time.
    let v = with(
        base(),
        json!({"retry_after_raw": "Sun, 26 Jul 2026 18:42:20 GMT",
               "date_header": "Sun, 26 Jul 2026 18:41:20 GMT"}),
    );
    let r = run(&v);
    assert_eq!(r.retry_not_before, Some(ts("2026-07-26T18:42:30Z")));
    assert_eq!(r.boundary_clock, Some(ClockSource::ServerDate));
    assert_eq!(r.retry_after_debt_ms, Some(60_000));
    assert_eq!(r.diagnosis, Diagnosis::WaitingBackpressure);
}

#[test]
fn http_date_without_date_header_uses_the_local_clock_and_says_so() {
    let v = with(
        base(),
        json!({"retry_after_raw": "Sun, 26 Jul 2026 18:42:20 GMT", "date_header": null}),
    );
    let r = run(&v);
    assert_eq!(r.retry_not_before, Some(ts("2026-07-26T18:42:20Z")));
    assert_eq!(r.boundary_clock, Some(ClockSource::Local));
    assert_eq!(r.retry_after_debt_ms, Some(50_000));
}

#[test]
fn explicit_retry_not_before_wins_over_the_raw_value() {
    let v = with(
        base(),
        json!({"retry_not_before": "2026-07-26T18:42:30Z", "retry_after_raw": "5"}),
    );
    let r = run(&v);
    assert_eq!(r.retry_not_before, Some(ts("2026-07-26T18:42:30Z")));
    assert_eq!(r.boundary_source.as_deref(), Some("retry_not_before"));
}

#[test]
fn unknown_fields_are_ignored_at_every_level() {
    let v = with(
        base(),
        json!({"provider": "openai", "tenant": {"id": 7}, "extra": [1, 2, 3]}),
    );
    assert_eq!(run(&v).diagnosis, Diagnosis::WaitingBackpressure);
    let v = with(
        base(),
        retried(
            200,
            "2026-07-26T18:42:31Z",
            json!({"matches": true, "receipt_id": "r-1"}),
        ),
    );
    let r = run_at(&v, "2026-07-26T18:43:00Z", Duration::from_secs(30));
    assert_eq!(r.diagnosis, Diagnosis::Recovered);
}

#[test]
fn completion_estimate_defaults_to_zero_when_absent_or_null() {
    let mut v = base();
    v.as_object_mut().unwrap().remove("completion_estimate_ms");
    assert_eq!(run(&v).headroom_ms, Some(600_000));
    let v = with(base(), json!({"completion_estimate_ms": null}));
    assert_eq!(run(&v).headroom_ms, Some(600_000));
}

fn parse_err(v: &Value) -> SnapshotError {
    parse_snapshot(v.to_string().as_bytes()).unwrap_err()
}

#[test]
fn missing_required_field_is_named() {
    for field in [
        "run_id",
        "quota_scope",
        "throttled_at",
        "status",
        "attempts_used",
        "max_attempts",
        "wait_budget_ms",
        "wait_used_ms",
    ] {
        let mut v = base();
        v.as_object_mut().unwrap().remove(field);
        let err = parse_err(&v).to_string();
        assert!(err.contains(field), "{field}: {err}");
    }
}

#[test]
fn bad_timestamp_is_named_with_its_field() {
    let err = parse_err(&with(base(), json!({"scheduled_retry_at": "yesterday"})));
    match &err {
        SnapshotError::Malformed { path, .. } => assert_eq!(path, "scheduled_retry_at"),
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn not_json_is_malformed() {
    assert!(matches!(
        parse_snapshot(b"{not json"),
        Err(SnapshotError::Malformed { .. })
    ));
    assert!(matches!(
        parse_snapshot(b"[1,2]"),
        Err(SnapshotError::Malformed { .. })
    ));
    assert!(matches!(
        parse_snapshot(&[0xff, 0xfe]),
        Err(SnapshotError::Malformed { .. })
    ));
}

#[test]
fn inconsistent_snapshots_are_rejected_with_the_field() {
    let cases = [
        (json!({"run_id": " "}), "run_id"),
        (json!({"quota_scope": ""}), "quota_scope"),
        (json!({"status": 42}), "status"),
        (
            json!({"retry_finished_at": "2026-07-26T18:42:40Z"}),
            "retry_finished_at",
        ),
        (
            json!({"retry_started_at": "2026-07-26T18:42:40Z", "retry_finished_at": "2026-07-26T18:42:39Z"}),
            "retry_finished_at",
        ),
        (
            json!({"retry_started_at": "2026-07-26T18:42:40Z", "retry_status": 200}),
            "retry_status",
        ),
        (
            json!({"retry_not_before": "2026-07-26T18:41:29Z"}),
            "retry_not_before",
        ),
    ];
    for (patch, field) in cases {
        match parse_err(&with(base(), patch.clone())) {
            SnapshotError::Invalid { field: f, .. } => assert_eq!(f, field, "{patch}"),
            other => panic!("{patch}: unexpected {other:?}"),
        }
    }
}

#[test]
fn report_serializes_proofs_as_booleans_or_null() {
    let r = run(&with(base(), json!({"retry_after_raw": null})));
    let v = serde_json::to_value(&r).unwrap();
    assert_eq!(v["diagnosis"], "uncertain_boundary");
    assert_eq!(v["action"], "collect_evidence");
    assert_eq!(v["proofs"]["limit"], false);
    assert_eq!(v["proofs"]["wake"], Value::Null);
    assert_eq!(v["headroom_ms"], Value::Null);
    assert_eq!(v["retry_after_debt_ms"], Value::Null);
}

#[test]
fn every_diagnosis_has_a_distinct_name_and_a_bounded_action() {
    let names: std::collections::BTreeSet<&str> =
        Diagnosis::ALL.iter().map(|d| d.as_str()).collect();
    assert_eq!(names.len(), Diagnosis::ALL.len());
    for (i, d) in Diagnosis::ALL.iter().enumerate() {
        assert_eq!(*d as usize, i, "ALL is in declaration (check) order");
    }
    for d in Diagnosis::ALL {
        let serialized = serde_json::to_value(d).unwrap();
        assert_eq!(serialized, d.as_str());
        assert!(d.action().text().ends_with('.'));
    }
}

#[test]
fn parse_errors_name_no_root_path_and_no_line_of_their_own() {
    let mut v = base();
    v.as_object_mut().unwrap().remove("attempts_used");
    let err = parse_err(&v).to_string();
    assert_eq!(err, "missing field `attempts_used`");
    let err = parse_snapshot(b"{\"run_id\": \"a\",}")
        .unwrap_err()
        .to_string();
    assert!(!err.starts_with(".:"), "{err}");
    assert!(!err.contains("line 1"), "{err}");
    assert!(err.ends_with("at column 16"), "{err}");
    let err = parse_err(&with(base(), json!({"scheduled_retry_at": "yesterday"}))).to_string();
    assert!(err.starts_with("scheduled_retry_at: "), "{err}");
    assert!(!err.contains("line 1"), "{err}");
}
