//! Escalation case files and decisions (SPEC §8): every listed item present, no payload, no
//! credential, and `send_new` refused without confirmation.

use backstop_core::escalation::{
    offered_options, sanitize_text, validate_decision, BudgetConsumed, CaseAction, CaseAttempt,
    CaseFile, CaseInput, Decision, DecisionEffect, DecisionError, DecisionOption, EscalationReason,
    ObservedHeader, REDACTED,
};
use jiff::Timestamp;

const PAYLOAD: &str = r#"{"amount":700,"iban":"DE02120300000000202051","note":"PAYLOAD-CANARY-1"}"#;
const CANARIES: [&str; 6] = [
    "sk-live-CANARY0123456789abcdef",
    "ghp_CANARY0123456789abcdefABCDEF",
    "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJjYW5hcnkifQ.c2lnbmF0dXJlQ0FOQVJZ",
    "AKIACANARY0123456789",
    "s3cretCANARYpassword",
    "dXNlcjpDQU5BUlk=",
];

fn ts(s: &str) -> Timestamp {
    s.parse().unwrap()
}

fn digest(payload: &str) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(payload.as_bytes()))
}

fn input(reason: EscalationReason) -> CaseInput {
    CaseInput {
        opened_at: ts("2026-01-01T00:00:30Z"),
        reason,
        reason_detail:
            "the write may have happened: connection reset after the request was written".into(),
        desired_outcome: Some(format!(
            "Pay invoice 7 to ACME. Use Authorization: Bearer {} if asked, basic {} , password={}",
            CANARIES[0], CANARIES[5], CANARIES[4]
        )),
        action: CaseAction {
            task_id: "run-42".into(),
            method: "post".into(),
            route: "/v1/accounts/8412/transfers".into(),
            request_class: "uncertain_write".into(),
            payload_digest: digest(PAYLOAD),
        },
        provider: "billing-api".into(),
        scopes: vec!["billing-api/account".into()],
        fingerprint: "POST /v1/accounts/{id}/transfers amount=700".into(),
        attempts: vec![
            CaseAttempt {
                n: 1,
                started_at: ts("2026-01-01T00:00:00Z"),
                finished_at: Some(ts("2026-01-01T00:00:01Z")),
                status: Some(429),
                disposition: Some("rate_limited".into()),
                retry_after_raw: Some("10".into()),
                retry_not_before: Some(ts("2026-01-01T00:00:11Z")),
                quota_headers: vec![
                    ObservedHeader {
                        name: "Retry-After".into(),
                        value: "10".into(),
                    },
                    ObservedHeader {
                        name: "x-ratelimit-remaining".into(),
                        value: "0".into(),
                    },
                    ObservedHeader {
                        name: "Authorization".into(),
                        value: format!("Bearer {}", CANARIES[1]),
                    },
                    ObservedHeader {
                        name: "x-api-key".into(),
                        value: CANARIES[3].into(),
                    },
                ],
            },
            CaseAttempt {
                n: 2,
                started_at: ts("2026-01-01T00:00:12Z"),
                finished_at: None,
                status: None,
                disposition: Some("uncertain".into()),
                retry_after_raw: None,
                retry_not_before: None,
                quota_headers: vec![],
            },
        ],
        budget: BudgetConsumed {
            attempts_used: 2,
            max_attempts: 3,
            wait_used_ms: 11_000,
            max_wait_ms: 120_000,
            deadline: Some(ts("2026-01-01T00:05:00Z")),
        },
        honours_key: true,
        idempotency_key: Some("0f1e2d3c-4b5a-4978-8877-665544332211".into()),
        external_reference: Some("inv-7".into()),
        provider_operation_id: None,
        reconciliation_query: Some("GET /v1/transfers?reference={ref}".into()),
        retry_not_before: None,
    }
}

#[test]
fn the_case_file_holds_every_spec_item() {
    let case = CaseFile::build(input(EscalationReason::SideEffectUnknown)).unwrap();
    let json = case.to_json();
    assert_eq!(json["reason"], "side_effect_unknown");
    assert!(json["desired_outcome"]
        .as_str()
        .unwrap()
        .starts_with("Pay invoice 7 to ACME."));
    assert_eq!(json["action"]["method"], "POST");
    assert_eq!(json["action"]["route"], "/v1/accounts/{id}/transfers");
    assert_eq!(json["action"]["request_class"], "uncertain_write");
    assert_eq!(json["action"]["payload_digest"], digest(PAYLOAD));
    assert_eq!(json["provider"], "billing-api");
    assert_eq!(json["endpoint"], "POST /v1/accounts/{id}/transfers");
    assert_eq!(json["scopes"][0], "billing-api/account");
    assert_eq!(
        json["fingerprint"],
        "POST /v1/accounts/{id}/transfers amount=700"
    );
    let first = &json["attempts"][0];
    assert_eq!(first["started_at"], "2026-01-01T00:00:00Z");
    assert_eq!(first["status"], 429);
    assert_eq!(first["disposition"], "rate_limited");
    assert_eq!(first["retry_after_raw"], "10");
    assert_eq!(first["retry_not_before"], "2026-01-01T00:00:11Z");
    let headers: Vec<&str> = first["quota_headers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["name"].as_str().unwrap())
        .collect();
    assert_eq!(headers, ["retry-after", "x-ratelimit-remaining"]);
    assert_eq!(json["attempts"][1]["disposition"], "uncertain");
    assert_eq!(json["budget"]["attempts_used"], 2);
    assert_eq!(json["budget"]["wait_used_ms"], 11_000);
    assert_eq!(
        json["idempotency_key"],
        "0f1e2d3c-4b5a-4978-8877-665544332211"
    );
    assert!(json["provider_operation_id"].is_null());
    assert_eq!(
        json["reconciliation_query"],
        "GET /v1/transfers?reference={ref}"
    );
    let options: Vec<&str> = json["options"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["option"].as_str().unwrap())
        .collect();
    assert_eq!(
        options,
        ["query_status", "retry_same_key", "abort", "send_new"]
    );
    for option in json["options"].as_array().unwrap() {
        assert!(option["risk"].as_str().unwrap().len() > 40, "{option}");
    }
    let send_new = case.offered(DecisionOption::SendNew).unwrap();
    assert!(send_new.requires_confirmation);
    assert!(send_new.risk.contains("SECOND SIDE EFFECT"));
    assert!(send_new.risk.contains("confirm_second_side_effect"));
}

#[test]
fn the_case_file_contains_no_payload_and_no_credential() {
    let case = CaseFile::build(input(EscalationReason::SideEffectUnknown)).unwrap();
    let text = serde_json::to_string(&case).unwrap();
    assert!(!text.contains("PAYLOAD-CANARY-1"), "{text}");
    assert!(!text.contains("DE02120300000000202051"), "{text}");
    for canary in CANARIES {
        assert!(!text.contains(canary), "{canary} leaked: {text}");
    }
    assert!(
        !text.to_ascii_lowercase().contains("authorization\":"),
        "{text}"
    );
    assert!(!text.contains("8412"), "a concrete path leaked: {text}");
    assert_eq!(case.redactions, ["desired_outcome"]);
    assert_eq!(
        case.desired_outcome.as_deref(),
        Some("Pay invoice 7 to ACME. Use Authorization: Bearer [redacted] if asked, basic [redacted] , password=[redacted]")
    );
}

#[test]
fn canaries_anywhere_in_the_inputs_are_redacted() {
    let mut raw = input(EscalationReason::SideEffectUnknown);
    raw.provider_operation_id = Some(CANARIES[2].into());
    raw.fingerprint = format!("POST /x token={}", CANARIES[4]);
    raw.attempts[0].quota_headers[1].value = CANARIES[1].into();
    raw.reason_detail = format!("upstream said: key {} is over quota", CANARIES[3]);
    let case = CaseFile::build(raw).unwrap();
    let text = serde_json::to_string(&case).unwrap();
    for canary in CANARIES {
        assert!(!text.contains(canary), "{canary} leaked: {text}");
    }
    for field in [
        "desired_outcome",
        "provider_operation_id",
        "fingerprint",
        "attempts[0].quota_headers[1].value",
        "reason_detail",
    ] {
        assert!(
            case.redactions.iter().any(|r| r == field),
            "{field}: {:?}",
            case.redactions
        );
    }
}

#[test]
fn ordinary_words_ids_and_keys_are_not_redacted() {
    for text in [
        "basic plan for task_id 42, risk_level low",
        "0f1e2d3c-4b5a-4978-8877-665544332211",
        "tr_8a7b6c5d",
        "GET /v1/transfers?reference={ref}",
        "the bearer of bad news",
    ] {
        let clean = sanitize_text(text);
        if text == "the bearer of bad news" {
            // A word after `bearer` is treated as a token: over-redaction is the safe side.
            assert!(clean.redacted);
            continue;
        }
        assert!(!clean.redacted, "{text} -> {}", clean.text);
        assert_eq!(clean.text, text);
    }
    assert_eq!(
        sanitize_text("key: sk-abcdef123456").text,
        format!("key: {REDACTED}")
    );
}

#[test]
fn a_bad_digest_or_route_is_refused() {
    let mut raw = input(EscalationReason::SideEffectUnknown);
    raw.action.payload_digest = PAYLOAD.into();
    let err = CaseFile::build(raw).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("case file: action.payload_digest:"),
        "{err}"
    );
    assert!(!err.to_string().contains("CANARY"), "{err}");

    let mut raw = input(EscalationReason::SideEffectUnknown);
    raw.action.route = "transfers".into();
    assert!(CaseFile::build(raw).is_err());
}

#[test]
fn options_follow_the_reason() {
    let words = |reason| {
        let mut raw = input(reason);
        raw.retry_not_before = Some(ts("2026-01-02T00:00:00Z"));
        CaseFile::build(raw)
            .unwrap()
            .options
            .iter()
            .map(|o| o.option.as_str())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        words(EscalationReason::RemainingWaitExceedsDeadline),
        ["wait", "change_plan", "abort"]
    );
    assert_eq!(
        words(EscalationReason::SharedQuotaExhausted),
        ["wait", "raise_quota", "change_plan", "abort"]
    );
    assert_eq!(
        words(EscalationReason::AccountConfiguration),
        ["raise_quota", "change_plan", "wait", "abort"]
    );
    let mut raw = input(EscalationReason::RemainingWaitExceedsDeadline);
    raw.retry_not_before = Some(ts("2026-01-02T00:00:00Z"));
    let case = CaseFile::build(raw).unwrap();
    let wait = case.offered(DecisionOption::Wait).unwrap();
    assert!(wait.risk.contains("2026-01-02T00:00:00Z"), "{}", wait.risk);
    // The action already ended beside this escalation: waiting means resubmitting, never a
    // promise that backstop will send it later.
    assert!(
        wait.risk.contains("backstop sends nothing more") && wait.risk.contains("Resubmit"),
        "{}",
        wait.risk
    );
    let quota = CaseFile::build(input(EscalationReason::SharedQuotaExhausted)).unwrap();
    assert!(
        quota
            .offered(DecisionOption::Wait)
            .unwrap()
            .risk
            .starts_with("Hold the action"),
        "other reasons keep the hold-then-send wording"
    );
    assert!(
        wait.risk
            .contains("deadline 2026-01-01T00:05:00Z will be missed"),
        "{}",
        wait.risk
    );

    // No key support and no lookup: only abort and send_new remain for an unknown side effect.
    let mut raw = input(EscalationReason::SideEffectUnknown);
    raw.honours_key = false;
    raw.reconciliation_query = None;
    let case = CaseFile::build(raw).unwrap();
    let offered: Vec<_> = offered_options(&case).iter().map(|o| o.option).collect();
    assert_eq!(offered, [DecisionOption::Abort, DecisionOption::SendNew]);
}

fn decide(option: &str, confirm: bool) -> Decision {
    Decision {
        option: option.into(),
        confirm_second_side_effect: confirm,
        note: None,
    }
}

#[test]
fn send_new_is_refused_without_confirmation() {
    let case = CaseFile::build(input(EscalationReason::SideEffectUnknown)).unwrap();
    let err = validate_decision(&case, &decide("send_new", false)).unwrap_err();
    assert_eq!(err, DecisionError::ConfirmationRequired);
    assert!(err.to_string().contains("second side effect"));
    assert_eq!(
        validate_decision(&case, &decide("send_new", true)),
        Ok(DecisionEffect::SendNew)
    );
}

#[test]
fn offered_options_give_their_effects() {
    let case = CaseFile::build(input(EscalationReason::SideEffectUnknown)).unwrap();
    assert_eq!(
        validate_decision(&case, &decide("retry_same_key", false)),
        Ok(DecisionEffect::RetrySameKey {
            idempotency_key: "0f1e2d3c-4b5a-4978-8877-665544332211".into()
        })
    );
    assert_eq!(
        validate_decision(&case, &decide("query_status", false)),
        Ok(DecisionEffect::QueryStatus)
    );
    assert_eq!(
        validate_decision(&case, &decide("abort", false)),
        Ok(DecisionEffect::Abort)
    );
}

#[test]
fn options_not_offered_unknown_or_reveal_are_refused() {
    let case = CaseFile::build(input(EscalationReason::SideEffectUnknown)).unwrap();
    let err = validate_decision(&case, &decide("wait", false)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "option: `wait` is not offered for this escalation; offered: query_status, retry_same_key, abort, send_new"
    );
    assert!(matches!(
        validate_decision(&case, &decide("launch", false)),
        Err(DecisionError::UnknownOption { .. })
    ));
    assert_eq!(
        validate_decision(&case, &decide("reveal_payload", true)),
        Err(DecisionError::RevealIsSeparate)
    );
    let long = Decision {
        note: Some("x".repeat(2_001)),
        ..decide("abort", false)
    };
    assert_eq!(
        validate_decision(&case, &long),
        Err(DecisionError::NoteTooLong { chars: 2_001 })
    );
}

#[test]
fn a_stored_case_file_reads_back() {
    let case = CaseFile::build(input(EscalationReason::SharedQuotaExhausted)).unwrap();
    let back = CaseFile::from_json(&case.to_json()).unwrap();
    assert_eq!(back, case);
}
