//! The seed article's six-case audit (SPEC §10): six snapshots, six different diagnoses, a total
//! retry-after debt of 1,230,000 ms, at now = 2026-07-26T18:42:00Z with a 30 s wake grace.

use std::time::Duration;

use backstop_core::diagnose::{
    diagnose, parse_snapshot, Action, DiagnoseOptions, Diagnosis, DiagnosisReport, Totals,
    WakeGrace,
};
use backstop_core::retry_after::ClockSource;
use jiff::Timestamp;

const FIXTURE: &str = include_str!("../fixtures/six_case_audit.ndjson");

fn now() -> Timestamp {
    "2026-07-26T18:42:00Z".parse().unwrap()
}

fn reports() -> Vec<DiagnosisReport> {
    let opts = DiagnoseOptions::default();
    FIXTURE
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| diagnose(&parse_snapshot(l.as_bytes()).unwrap(), now(), &opts))
        .collect()
}

#[test]
fn six_case_audit_yields_six_different_diagnoses_in_fixture_order() {
    let got: Vec<Diagnosis> = reports().iter().map(|r| r.diagnosis).collect();
    assert_eq!(
        got,
        vec![
            Diagnosis::WaitingBackpressure,
            Diagnosis::EarlyRetryLoop,
            Diagnosis::StuckMissedWake,
            Diagnosis::DeadlineExhausted,
            Diagnosis::RetryBudgetExhausted,
            Diagnosis::Recovered,
        ]
    );
}

#[test]
fn six_case_audit_expected_field_agrees_with_the_diagnosis() {
    // The fixture carries its expectation in an unknown field, which the parser ignores.
    for (line, report) in FIXTURE.lines().zip(reports()) {
        let value: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(value["expected"], report.diagnosis.as_str(), "{line}");
    }
}

#[test]
fn six_case_audit_debts_and_headrooms_match_the_article() {
    let reports = reports();
    let debts: Vec<Option<u64>> = reports.iter().map(|r| r.retry_after_debt_ms).collect();
    assert_eq!(
        debts,
        vec![
            Some(60_000),
            Some(120_000),
            Some(90_000),
            Some(900_000),
            Some(30_000),
            Some(30_000)
        ]
    );
    // Waiting: nine minutes of headroom. Deadline: the boundary lands five minutes late.
    assert_eq!(reports[0].headroom_ms, Some(540_000));
    assert_eq!(reports[3].headroom_ms, Some(-300_000));
    // Early: the retry started 105 s before the boundary, which came from an HTTP-date measured
    // against the response's own Date header.
    let early = &reports[1];
    assert_eq!(
        early.retry_not_before,
        Some("2026-07-26T18:40:05Z".parse().unwrap())
    );
    assert_eq!(early.boundary_clock, Some(ClockSource::ServerDate));
    // Deadline: an explicit retry_not_before.
    assert_eq!(
        reports[3].boundary_source.as_deref(),
        Some("retry_not_before")
    );
}

#[test]
fn six_case_audit_actions_are_the_bounded_ones() {
    let actions: Vec<Action> = reports().iter().map(|r| r.action).collect();
    assert_eq!(
        actions,
        vec![
            Action::LeaveAloneCheckWake,
            Action::StopRetryPath,
            Action::SchedulerCheckRearm,
            Action::TellOwnerDeadline,
            Action::StopAndHandOverEvidence,
            Action::VerifyOutcome,
        ]
    );
}

#[test]
fn six_case_audit_total_debt_is_1230000_ms_with_its_breakdown() {
    let reports = reports();
    let totals: Totals = reports.iter().collect();
    assert_eq!(totals.snapshots, 6);
    assert_eq!(totals.known_boundaries, 6);
    assert_eq!(totals.retry_after_debt_ms, 1_230_000);
    // By scope: billing carries the early retry and the deadline-blocked run.
    let billing = &totals.by_scope["billing-api/account:ops-team"];
    assert_eq!(billing.snapshots, 2);
    assert_eq!(billing.retry_after_debt_ms, 1_020_000);
    assert_eq!(billing.by_diagnosis.get(Diagnosis::EarlyRetryLoop), 1);
    assert_eq!(billing.by_diagnosis.get(Diagnosis::DeadlineExhausted), 1);
    assert_eq!(billing.by_diagnosis.get(Diagnosis::Recovered), 0);
    assert_eq!(
        serde_json::to_value(billing).unwrap()["by_diagnosis"],
        serde_json::json!({"deadline_exhausted": 1, "early_retry_loop": 1})
    );
    let research = &totals.by_scope["llm-api/project:research"];
    assert_eq!(research.retry_after_debt_ms, 90_000);
    assert_eq!(totals.by_scope.len(), 4);
    let scope_sum: u64 = totals
        .by_scope
        .values()
        .map(|g| g.retry_after_debt_ms)
        .sum();
    assert_eq!(scope_sum, 1_230_000);
    // By diagnosis: one each.
    assert_eq!(totals.by_diagnosis.len(), 6);
    assert!(totals.by_diagnosis.values().all(|d| d.snapshots == 1));
    assert_eq!(
        totals.by_diagnosis[&Diagnosis::DeadlineExhausted].retry_after_debt_ms,
        900_000
    );
    // By run.
    assert_eq!(totals.by_run.len(), 6);
    assert_eq!(totals.by_run["run-waiting"].retry_after_debt_ms, 60_000);
}

#[test]
fn six_case_audit_waiting_has_all_four_proofs_and_each_failure_breaks_one() {
    // Recovered is checked first and may well have held every proof on its way; every other
    // diagnosis of the audit is a failed proof.
    for report in reports() {
        if report.diagnosis == Diagnosis::Recovered {
            continue;
        }
        assert_eq!(
            report.proofs.all_hold(),
            report.diagnosis == Diagnosis::WaitingBackpressure,
            "{report:?}"
        );
    }
}

#[test]
fn a_longer_wake_grace_only_forgives_the_missed_wake() {
    // The grace only moves the missed-wake check: run-stuck's wake (18:40:30) is 90 s overdue at
    // 18:42:00, so it is stuck under a grace below 90 s and waiting under a longer one. No grace
    // changes any other run, and none turns a healthy run into "budget exhausted".
    for grace_seconds in [
        0,
        30,
        89,
        90,
        91,
        20 * 60,
        90 * 60,
        24 * 3600,
        10_000 * 3600,
    ] {
        let opts = DiagnoseOptions {
            wake_grace: WakeGrace(Duration::from_secs(grace_seconds)),
            ..DiagnoseOptions::default()
        };
        let got: Vec<Diagnosis> = FIXTURE
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| diagnose(&parse_snapshot(l.as_bytes()).unwrap(), now(), &opts).diagnosis)
            .collect();
        let stuck = if grace_seconds < 90 {
            Diagnosis::StuckMissedWake
        } else {
            Diagnosis::WaitingBackpressure
        };
        assert_eq!(
            got,
            vec![
                Diagnosis::WaitingBackpressure,
                Diagnosis::EarlyRetryLoop,
                stuck,
                Diagnosis::DeadlineExhausted,
                Diagnosis::RetryBudgetExhausted,
                Diagnosis::Recovered,
            ],
            "grace {grace_seconds} s"
        );
    }
}
