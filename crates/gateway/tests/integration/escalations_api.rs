//! The escalation API in-process (`tower::ServiceExt::oneshot`) against a temporary SQLite store
//! with an escalation opened through the store API.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use axum::Router;
use backstop_core::escalation::{
    BudgetConsumed, CaseAction, CaseAttempt, CaseFile, CaseInput, EscalationReason,
};
use backstop_gateway::clock::TokioClock;
use backstop_gateway::escalations::{router, EscalationsState};
use backstop_store::{
    Admission, EscalationId, NewAction, NewTask, PayloadDigest, Priority, RouteTemplate,
    SqliteStore, Store,
};
use jiff::Timestamp;
use serde_json::{json, Value};
use tower::ServiceExt;

const OPERATOR_TOKEN: &str = "op-token-CANARY-7f3a";
const AGENT_TOKEN: &str = "agent-token-1";
const PAYLOAD: &[u8] = br#"{"amount":700,"note":"PAYLOAD-CANARY-1"}"#;

fn t(s: &str) -> Timestamp {
    s.parse().expect("timestamp")
}

struct Fixture {
    _dir: tempfile::TempDir,
    store: Arc<SqliteStore>,
    escalation: EscalationId,
    app: Router,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Arc::new(SqliteStore::open(dir.path().join("backstop.db")).expect("store"));
    store
        .open_task(
            NewTask {
                id: "run-1".into(),
                agent: "agent-a".into(),
                priority: Priority::Normal,
                deadline: None,
            },
            t("2026-01-01T00:00:00Z"),
        )
        .expect("task");
    let key = "0f1e2d3c-4b5a-4978-8877-665544332211";
    let Admission::New(action) = store
        .record_action(
            NewAction {
                task_id: "run-1".into(),
                agent: "agent-a".into(),
                provider: "billing-api".into(),
                method: "POST".into(),
                route: RouteTemplate::try_new("/v1/transfers").expect("route"),
                request_class: "idempotent_write".into(),
                payload_digest: PayloadDigest::of(PAYLOAD),
                target_digest: None,
                idempotency_key: key.into(),
                external_reference: Some("inv-7".into()),
                desired_outcome: None,
                fingerprint: None,
                request: None,
            },
            t("2026-01-01T00:00:00Z"),
        )
        .expect("action")
    else {
        panic!("the action existed already");
    };
    let case = CaseFile::build(CaseInput {
        opened_at: t("2026-01-01T00:00:30Z"),
        reason: EscalationReason::SideEffectUnknown,
        reason_detail: "the reconciliation lookup was inconclusive: HTTP 503".into(),
        desired_outcome: Some("pay invoice 7".into()),
        action: CaseAction {
            task_id: "run-1".into(),
            method: "POST".into(),
            route: "/v1/transfers".into(),
            request_class: "idempotent_write".into(),
            payload_digest: PayloadDigest::of(PAYLOAD).as_str().to_owned(),
        },
        provider: "billing-api".into(),
        scopes: vec!["billing-api/account".into()],
        fingerprint: "POST /v1/transfers".into(),
        attempts: vec![CaseAttempt {
            n: 1,
            started_at: t("2026-01-01T00:00:01Z"),
            finished_at: None,
            status: None,
            disposition: Some("uncertain".into()),
            retry_after_raw: None,
            retry_not_before: None,
            quota_headers: vec![],
        }],
        budget: BudgetConsumed {
            attempts_used: 1,
            max_attempts: 3,
            ..BudgetConsumed::default()
        },
        honours_key: true,
        idempotency_key: Some(key.into()),
        external_reference: Some("inv-7".into()),
        provider_operation_id: None,
        reconciliation_query: Some("GET /v1/transfers?reference={ref}".into()),
        retry_not_before: None,
    })
    .expect("case file");
    let escalation = store
        .open_escalation(action, case.to_json(), t("2026-01-01T00:00:30Z"))
        .expect("escalation");
    let app = router(EscalationsState {
        store: store.clone(),
        operators: Arc::new(|token: &str| (token == OPERATOR_TOKEN).then(|| "alice".to_owned())),
        clock: TokioClock::anchored_at(t("2026-01-01T00:10:00Z")),
        secrets: Default::default(),
    });
    Fixture {
        _dir: dir,
        store,
        escalation,
        app,
    }
}

async fn call(
    app: &Router,
    method: &str,
    uri: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> (StatusCode, String, Value) {
    let mut request = Request::builder().method(method).uri(uri);
    if let Some(token) = token {
        request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let body = match body {
        Some(v) => Body::from(v.to_string()),
        None => Body::empty(),
    };
    let response = app
        .clone()
        .oneshot(request.body(body).expect("request"))
        .await
        .expect("response");
    let status = response.status();
    let content_type = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .expect("body");
    let json = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, content_type, json)
}

#[tokio::test]
async fn every_route_needs_an_operator_token() {
    let f = fixture();
    let id = f.escalation.0;
    let decision = json!({"option": "abort"});
    for (method, uri, body) in [
        ("GET", "/v1/escalations".to_owned(), None),
        ("GET", format!("/v1/escalations/{id}"), None),
        (
            "POST",
            format!("/v1/escalations/{id}/decision"),
            Some(decision.clone()),
        ),
        ("POST", format!("/v1/escalations/{id}/reveal"), None),
    ] {
        for token in [None, Some(AGENT_TOKEN)] {
            let (status, content_type, problem) =
                call(&f.app, method, &uri, token, body.clone()).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{method} {uri} {token:?}");
            assert_eq!(content_type, "application/problem+json");
            assert_eq!(problem["type"], "urn:backstop:problem:unauthorized");
            assert_eq!(problem["status"], 401);
        }
    }
    let record = f
        .store
        .escalation(f.escalation)
        .expect("read")
        .expect("exists");
    assert_eq!(
        record.decision, None,
        "an unauthorized decision was recorded"
    );
}

#[tokio::test]
async fn operators_list_and_read_case_files_without_payload() {
    let f = fixture();
    let (status, _, list) =
        call(&f.app, "GET", "/v1/escalations", Some(OPERATOR_TOKEN), None).await;
    assert_eq!(status, StatusCode::OK);
    let rows = list["escalations"].as_array().expect("rows");
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["id"], f.escalation.0);
    assert_eq!(rows[0]["provider"], "billing-api");
    assert_eq!(rows[0]["route"], "POST /v1/transfers");
    assert_eq!(rows[0]["reason"], "side_effect_unknown");
    assert_eq!(rows[0]["opened_at"], "2026-01-01T00:00:30Z");

    let uri = format!("/v1/escalations/{}", f.escalation.0);
    let (status, _, shown) = call(&f.app, "GET", &uri, Some(OPERATOR_TOKEN), None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(shown["state"], "open");
    assert_eq!(
        shown["case_file"]["action"]["payload_digest"],
        PayloadDigest::of(PAYLOAD).as_str()
    );
    assert_eq!(shown["case_file"]["options"][3]["option"], "send_new");
    let text = shown.to_string();
    assert!(!text.contains("PAYLOAD-CANARY-1"), "{text}");
    assert!(!text.contains(OPERATOR_TOKEN), "{text}");
}

#[tokio::test]
async fn unknown_escalations_are_404_problems() {
    let f = fixture();
    for uri in ["/v1/escalations/999", "/v1/escalations/abc"] {
        let (status, content_type, problem) =
            call(&f.app, "GET", uri, Some(OPERATOR_TOKEN), None).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{uri}");
        assert_eq!(content_type, "application/problem+json");
        assert_eq!(problem["type"], "urn:backstop:problem:escalation_not_found");
    }
    let (status, _, _) = call(
        &f.app,
        "POST",
        "/v1/escalations/999/decision",
        Some(OPERATOR_TOKEN),
        Some(json!({"option": "abort"})),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn send_new_without_confirmation_is_refused_and_nothing_is_recorded() {
    let f = fixture();
    let uri = format!("/v1/escalations/{}/decision", f.escalation.0);
    for body in [
        json!({"option": "send_new"}),
        json!({"option": "send_new", "confirm_second_side_effect": false}),
    ] {
        let (status, content_type, problem) =
            call(&f.app, "POST", &uri, Some(OPERATOR_TOKEN), Some(body)).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(content_type, "application/problem+json");
        assert_eq!(problem["type"], "urn:backstop:problem:decision_refused");
        assert!(
            problem["detail"]
                .as_str()
                .unwrap_or("")
                .contains("second side effect"),
            "{problem}"
        );
    }
    let record = f
        .store
        .escalation(f.escalation)
        .expect("read")
        .expect("exists");
    assert_eq!(record.decision, None);

    let (status, _, body) = call(
        &f.app,
        "POST",
        &uri,
        Some(OPERATOR_TOKEN),
        Some(json!({"option": "send_new", "confirm_second_side_effect": true})),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["effect"], json!({"effect": "send_new"}));
    let record = f
        .store
        .escalation(f.escalation)
        .expect("read")
        .expect("exists");
    assert_eq!(record.decision.as_deref(), Some("send_new"));
}

#[tokio::test(start_paused = true)]
async fn a_decision_is_recorded_with_who_decided_and_only_once() {
    let f = fixture();
    let uri = format!("/v1/escalations/{}/decision", f.escalation.0);
    let (status, _, body) = call(
        &f.app,
        "POST",
        &uri,
        Some(OPERATOR_TOKEN),
        Some(json!({"option": "retry_same_key", "note": "provider confirmed key retention"})),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["decision"], "retry_same_key");
    assert_eq!(body["decided_by"], "alice");
    assert_eq!(body["decided_at"], "2026-01-01T00:10:00Z");
    assert_eq!(
        body["effect"]["idempotency_key"],
        "0f1e2d3c-4b5a-4978-8877-665544332211"
    );

    let record = f
        .store
        .escalation(f.escalation)
        .expect("read")
        .expect("exists");
    assert_eq!(record.decision.as_deref(), Some("retry_same_key"));
    assert_eq!(record.decided_by.as_deref(), Some("alice"));
    let events = f.store.audit_events(0, 100).expect("audit");
    let decision = events
        .iter()
        .find(|e| e.kind == "decision")
        .expect("decision event");
    assert_eq!(decision.decided_by.as_deref(), Some("alice"));
    assert_eq!(decision.decision.as_deref(), Some("retry_same_key"));

    let (status, _, problem) = call(
        &f.app,
        "POST",
        &uri,
        Some(OPERATOR_TOKEN),
        Some(json!({"option": "abort"})),
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(problem["type"], "urn:backstop:problem:already_decided");

    let (_, _, list) = call(&f.app, "GET", "/v1/escalations", Some(OPERATOR_TOKEN), None).await;
    assert_eq!(
        list["escalations"],
        json!([]),
        "a decided escalation is no longer open"
    );
}

#[tokio::test]
async fn options_not_offered_and_malformed_bodies_are_refused() {
    let f = fixture();
    let uri = format!("/v1/escalations/{}/decision", f.escalation.0);
    let (status, _, problem) = call(
        &f.app,
        "POST",
        &uri,
        Some(OPERATOR_TOKEN),
        Some(json!({"option": "wait"})),
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(
        problem["detail"]
            .as_str()
            .unwrap_or("")
            .contains("not offered"),
        "{problem}"
    );

    let (status, _, problem) = call(
        &f.app,
        "POST",
        &uri,
        Some(OPERATOR_TOKEN),
        Some(json!({"choice": "abort"})),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(problem["type"], "urn:backstop:problem:bad_decision");

    let (status, _, _) = call(
        &f.app,
        "POST",
        &uri,
        Some(OPERATOR_TOKEN),
        Some(json!({"option": "reveal_payload"})),
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    let record = f
        .store
        .escalation(f.escalation)
        .expect("read")
        .expect("exists");
    assert_eq!(record.decision, None);
}

#[tokio::test]
async fn reveal_is_refused_explicitly_and_does_not_decide_the_escalation() {
    let f = fixture();
    let uri = format!("/v1/escalations/{}/reveal", f.escalation.0);
    let (status, content_type, problem) =
        call(&f.app, "POST", &uri, Some(OPERATOR_TOKEN), None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(content_type, "application/problem+json");
    assert_eq!(problem["type"], "urn:backstop:problem:payload_not_stored");
    let detail = problem["detail"].as_str().unwrap_or("");
    assert!(
        detail.contains(PayloadDigest::of(PAYLOAD).as_str()),
        "{detail}"
    );
    assert!(!detail.contains("PAYLOAD-CANARY-1"), "{detail}");
    // Only advice an operator can follow: no setting that does not exist.
    assert!(!detail.contains("configure"), "{detail}");
    let record = f
        .store
        .escalation(f.escalation)
        .expect("read")
        .expect("exists");
    assert_eq!(
        record.decision, None,
        "a reveal must not approve or decide anything"
    );

    let (status, _, _) = call(
        &f.app,
        "POST",
        "/v1/escalations/999/reveal",
        Some(OPERATOR_TOKEN),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn a_decision_with_a_member_given_twice_is_refused_whichever_copy_comes_last() {
    let f = fixture();
    let id = f.escalation.0;
    for (body, member) in [
        (
            r#"{"option":"send_new","confirm_second_side_effect":true,"option":"wait"}"#,
            "option",
        ),
        (
            r#"{"option":"wait","confirm_second_side_effect":true,"option":"send_new"}"#,
            "option",
        ),
        (r#"{"option":"abort","option":"abort"}"#, "option"),
        (
            r#"{"option":"send_new","confirm_second_side_effect":false,"confirm_second_side_effect":true}"#,
            "confirm_second_side_effect",
        ),
    ] {
        let request = Request::builder()
            .method("POST")
            .uri(format!("/v1/escalations/{id}/decision"))
            .header(header::AUTHORIZATION, format!("Bearer {OPERATOR_TOKEN}"))
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body))
            .expect("request");
        let response = f.app.clone().oneshot(request).await.expect("response");
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{body}");
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .expect("body");
        let problem: Value = serde_json::from_slice(&bytes).expect("problem");
        assert_eq!(
            problem["type"], "urn:backstop:problem:bad_decision",
            "{body}"
        );
        let detail = problem["detail"].as_str().expect("detail");
        assert!(
            detail.contains(&format!("member `{member}` is given more than once")),
            "{body}: {detail}"
        );
    }
    let record = f
        .store
        .escalation(f.escalation)
        .expect("read")
        .expect("exists");
    assert_eq!(record.decision, None, "an ambiguous decision was recorded");
}
