//! Properties of the diagnosis over arbitrary snapshots: it never panics; past the recovery check,
//! `waiting_backpressure` if and only if all four proofs hold; debt only for known boundaries.

use backstop_core::diagnose::{
    diagnose, diagnose_owned, parse_snapshot, DiagnoseOptions, Diagnosis, Totals,
};
use jiff::{SignedDuration, Timestamp};
use proptest::prelude::*;
use serde_json::{json, Value};

fn at(base: Timestamp, offset_s: i64) -> String {
    (base + SignedDuration::from_secs(offset_s)).to_string()
}

prop_compose! {
    fn snapshot_json()(
        throttle in -600i64..0,
        raw in prop_oneof![
            Just(Value::Null),
            (0u32..1200).prop_map(|s| json!(s.to_string())),
            Just(json!("garbage")),
        ],
        explicit in proptest::option::of(0i64..1200),
        scheduled in proptest::option::of(-700i64..1200),
        started in proptest::option::of(-700i64..60),
        finished_status in proptest::option::of(prop_oneof![Just(200u16), Just(429), Just(503)]),
        receipt in proptest::option::of(any::<bool>()),
        attempts_used in 0u32..6,
        max_attempts in 0u32..6,
        wait_budget_ms in 0u64..900_000,
        wait_used_ms in 0u64..900_000,
        deadline in proptest::option::of(-600i64..1800),
        completion_estimate_ms in 0u64..600_000,
    ) -> Value {
        let now: Timestamp = "2026-07-26T18:42:00Z".parse().unwrap();
        let throttled = now + SignedDuration::from_secs(throttle);
        let mut v = json!({
            "run_id": format!("run-{}", attempts_used),
            "quota_scope": "api/scope",
            "throttled_at": throttled.to_string(),
            "status": 429,
            "retry_after_raw": raw,
            "attempts_used": attempts_used,
            "max_attempts": max_attempts,
            "wait_budget_ms": wait_budget_ms,
            "wait_used_ms": wait_used_ms,
            "completion_estimate_ms": completion_estimate_ms,
        });
        if let Some(e) = explicit { v["retry_not_before"] = json!(at(throttled, e)); }
        if let Some(s) = scheduled { v["scheduled_retry_at"] = json!(at(throttled, s)); }
        if let Some(s) = started {
            v["retry_started_at"] = json!(at(now, s));
            if let Some(status) = finished_status {
                v["retry_finished_at"] = json!(at(now, s + 1));
                v["retry_status"] = json!(status);
            }
        }
        if let Some(m) = receipt { v["outcome_receipt"] = json!({"matches": m}); }
        if let Some(d) = deadline { v["outcome_deadline"] = json!(at(now, d)); }
        v
    }
}

proptest! {
    #[test]
    fn past_recovery_waiting_if_and_only_if_all_four_proofs_hold(v in snapshot_json()) {
        let snapshot = parse_snapshot(v.to_string().as_bytes()).unwrap();
        let now: Timestamp = "2026-07-26T18:42:00Z".parse().unwrap();
        let r = diagnose(&snapshot, now, &DiagnoseOptions::default());
        prop_assert_eq!(&diagnose_owned(snapshot.clone(), now, &DiagnoseOptions::default()), &r);
        prop_assert_eq!(&r.run_id, &snapshot.run_id);
        // Recovery is checked before the proofs; past it, waiting <=> all four proofs hold.
        if !matches!(r.diagnosis, Diagnosis::Recovered | Diagnosis::RetrySucceededUnverified) {
            prop_assert_eq!(r.diagnosis == Diagnosis::WaitingBackpressure, r.proofs.all_hold(), "{:?}", r);
        }
        prop_assert_eq!(r.retry_after_debt_ms.is_some(), r.retry_not_before.is_some());
        prop_assert_eq!(r.proofs.limit, Some(r.retry_not_before.is_some()));
        if r.diagnosis == Diagnosis::UncertainBoundary {
            prop_assert!(r.retry_not_before.is_none());
        }
        if let (Some(h), Some(false)) = (r.headroom_ms, r.proofs.outcome) {
            prop_assert!(h < 0);
        }
        let totals: Totals = std::iter::once(&r).collect();
        prop_assert_eq!(totals.retry_after_debt_ms, r.retry_after_debt_ms.unwrap_or(0));
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = parse_snapshot(&bytes);
    }
}
