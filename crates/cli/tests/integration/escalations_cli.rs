//! `backstop escalations list|show|decide` as a process against the gateway's escalation router
//! served on a loopback port, over a temporary SQLite store.

use std::net::SocketAddr;
use std::process::{Command, Output};
use std::sync::Arc;

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

use crate::common::listening::refusing_port;

const TOKEN: &str = "op-token-cli-1";
const PAYLOAD: &[u8] = br#"{"amount":700,"note":"PAYLOAD-CANARY-CLI"}"#;

fn t(s: &str) -> Timestamp {
    s.parse().expect("timestamp")
}

struct Gateway {
    _dir: tempfile::TempDir,
    _runtime: tokio::runtime::Runtime,
    store: Arc<SqliteStore>,
    escalation: EscalationId,
    url: String,
}

fn open_escalation(store: &SqliteStore) -> EscalationId {
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
    let Admission::New(action) = store
        .record_action(
            NewAction {
                task_id: "run-1".into(),
                agent: "agent-a".into(),
                provider: "billing-api".into(),
                method: "POST".into(),
                route: RouteTemplate::try_new("/v1/transfers").expect("route"),
                request_class: "uncertain_write".into(),
                payload_digest: PayloadDigest::of(PAYLOAD),
                target_digest: None,
                idempotency_key: "0f1e2d3c-4b5a-4978-8877-665544332211".into(),
                external_reference: None,
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
        reason_detail: "no key support and no lookup".into(),
        desired_outcome: Some("pay invoice 7".into()),
        action: CaseAction {
            task_id: "run-1".into(),
            method: "POST".into(),
            route: "/v1/transfers".into(),
            request_class: "uncertain_write".into(),
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
            max_attempts: 1,
            ..BudgetConsumed::default()
        },
        honours_key: false,
        idempotency_key: Some("0f1e2d3c-4b5a-4978-8877-665544332211".into()),
        ..CaseInput::default()
    })
    .expect("case file");
    store
        .open_escalation(action, case.to_json(), t("2026-01-01T00:00:30Z"))
        .expect("escalation")
}

fn gateway() -> Gateway {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Arc::new(SqliteStore::open(dir.path().join("backstop.db")).expect("store"));
    let escalation = open_escalation(&store);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let state_store = store.clone();
    let addr: SocketAddr = runtime.block_on(async move {
        let app = router(EscalationsState {
            store: state_store,
            operators: Arc::new(|token: &str| (token == TOKEN).then(|| "alice".to_owned())),
            clock: TokioClock::anchored_at(t("2026-01-01T00:10:00Z")),
            secrets: Default::default(),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, app).await });
        addr
    });
    Gateway {
        _dir: dir,
        _runtime: runtime,
        store,
        escalation,
        url: format!("http://{addr}"),
    }
}

fn backstop(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_backstop"))
        .args(args)
        .env_remove("BACKSTOP_URL")
        .env_remove("BACKSTOP_OPERATOR_TOKEN")
        .output()
        .expect("run backstop")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn list_show_decide_round_trip() {
    let g = gateway();
    let id = g.escalation.0.to_string();

    let out = backstop(&["escalations", "list", "--url", &g.url, "--token", TOKEN]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    let header: Vec<&str> = lines[0].split_whitespace().collect();
    assert_eq!(
        header,
        ["ID", "ACTION", "PROVIDER", "ROUTE", "REASON", "OPENED"]
    );
    let row: Vec<&str> = lines[1].split_whitespace().collect();
    assert_eq!(row[0], id);
    assert_eq!(row[2], "billing-api");
    assert_eq!(row[3..5], ["POST", "/v1/transfers"]);
    assert_eq!(row[5], "side_effect_unknown");
    assert_eq!(row[6], "2026-01-01T00:00:30Z");

    let out = backstop(&[
        "escalations",
        "show",
        &id,
        "--url",
        &g.url,
        "--token",
        TOKEN,
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).expect("pretty JSON");
    assert_eq!(shown["case_file"]["endpoint"], "POST /v1/transfers");
    assert_eq!(shown["state"], "open");
    assert!(text(&out.stdout).contains("\n  \""), "not pretty-printed");
    assert!(!text(&out.stdout).contains("PAYLOAD-CANARY-CLI"));

    let out = backstop(&[
        "escalations",
        "decide",
        &id,
        "--option",
        "send_new",
        "--url",
        &g.url,
        "--token",
        TOKEN,
    ]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = text(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("backstop escalations decide: `send_new` sends the write again"),
        "{stderr}"
    );
    assert!(stderr.contains("second side effect"), "{stderr}");
    assert!(
        stderr.contains("add --confirm-second-side-effect to confirm"),
        "the refusal names the flag: {stderr}"
    );
    let record = g
        .store
        .escalation(g.escalation)
        .expect("read")
        .expect("exists");
    assert_eq!(record.decision, None);

    let out = backstop(&[
        "escalations",
        "decide",
        &id,
        "--option",
        "send_new",
        "--confirm-second-side-effect",
        "--note",
        "customer confirmed nothing arrived",
        "--url",
        &g.url,
        "--token",
        TOKEN,
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        format!(
            "escalation {id}: send_new (action 1, decided by alice at {})\n  \
             effect          send_new, not applied: recorded only: this gateway runs no engine\n  \
             action 1        unchanged\n  \
             escalation      decided\n  \
             note            customer confirmed nothing arrived\n",
            decided_at(&g)
        )
    );
    assert!(text(&out.stdout).contains(" at 2026-01-01T00:10:0"));
    let record = g
        .store
        .escalation(g.escalation)
        .expect("read")
        .expect("exists");
    assert_eq!(record.decision.as_deref(), Some("send_new"));
    assert_eq!(record.decided_by.as_deref(), Some("alice"));

    let out = backstop(&["escalations", "list", "--url", &g.url, "--token", TOKEN]);
    assert_eq!(
        text(&out.stdout),
        "no open escalations\n",
        "decided escalations are not listed"
    );
}

/// The instant the store recorded for the decision (the served clock runs in real time).
fn decided_at(g: &Gateway) -> String {
    let events = g.store.audit_events(0, 100).expect("audit");
    let decision = events
        .iter()
        .find(|e| e.kind == "decision")
        .expect("decision event");
    decision
        .at
        .parse::<Timestamp>()
        .expect("instant")
        .to_string()
}

#[test]
fn url_and_token_come_from_the_environment() {
    let g = gateway();
    let out = Command::new(env!("CARGO_BIN_EXE_backstop"))
        .args(["escalations", "list"])
        .env("BACKSTOP_URL", &g.url)
        .env("BACKSTOP_OPERATOR_TOKEN", TOKEN)
        .output()
        .expect("run backstop");
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("side_effect_unknown"));
}

#[test]
fn a_wrong_or_missing_token_is_one_line_and_exit_2() {
    let g = gateway();
    let out = backstop(&["escalations", "list", "--url", &g.url, "--token", "nope"]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        text(&out.stderr).lines().collect::<Vec<_>>(),
        ["backstop escalations list: HTTP 401 unauthorized: escalations are read and decided with an operator token in `Authorization: Bearer …`; this request carried none, or one that matches no operator"]
    );

    let out = backstop(&["escalations", "list", "--url", &g.url]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("no operator token"),
        "{}",
        text(&out.stderr)
    );

    let out = backstop(&[
        "escalations",
        "show",
        "999",
        "--url",
        &g.url,
        "--token",
        TOKEN,
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("HTTP 404 escalation_not_found"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn options_are_checked_before_anything_is_sent() {
    // No gateway listens here (nor can one, while `_held` lives): a refusal that names the
    // option proves nothing was sent.
    let (_held, port) = refusing_port();
    let url = format!("http://127.0.0.1:{port}");
    let out = backstop(&[
        "escalations",
        "decide",
        "1",
        "--option",
        "bogus",
        "--url",
        &url,
        "--token",
        TOKEN,
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        text(&out.stderr).lines().collect::<Vec<_>>(),
        ["backstop escalations decide: unknown option `bogus` (one of: query_status, retry_same_key, abort, send_new, wait, raise_quota, change_plan); nothing was sent"]
    );
    let out = backstop(&[
        "escalations",
        "decide",
        "1",
        "--option",
        "send_new",
        "--url",
        &url,
        "--token",
        TOKEN,
    ]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("--confirm-second-side-effect") && !stderr.contains("cannot reach"),
        "{stderr}"
    );
    // A known option goes to the gateway (here: unreachable, and said so).
    let out = backstop(&[
        "escalations",
        "decide",
        "1",
        "--option",
        "abort",
        "--url",
        &url,
        "--token",
        TOKEN,
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("cannot reach the gateway"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn an_unreachable_gateway_is_named() {
    let (_held, port) = refusing_port();
    let url = format!("http://127.0.0.1:{port}");
    let out = backstop(&["escalations", "list", "--url", &url, "--token", TOKEN]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = text(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with(&format!(
            "backstop escalations list: cannot reach the gateway at {url}"
        )),
        "{stderr}"
    );
}

/// Serves `answer` as the answer of `POST /v1/escalations/7/decision` (the shape the gateway
/// documents for a `query_status` whose lookup was inconclusive), for what the engine-less
/// router of [`gateway`] cannot produce.
fn canned_decision(answer: serde_json::Value) -> (tokio::runtime::Runtime, String) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let addr: SocketAddr = runtime.block_on(async move {
        let app = axum::Router::new().route(
            "/v1/escalations/7/decision",
            axum::routing::post(move || {
                let answer = answer.clone();
                async move { axum::Json(answer) }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, app).await });
        addr
    });
    (runtime, format!("http://{addr}"))
}

#[test]
fn decide_prints_the_effect_the_outcome_and_the_lookup() {
    let (_runtime, url) = canned_decision(serde_json::json!({
        "id": 7, "action": 12, "decision": "query_status", "decided_by": "alice",
        "decided_at": "2026-01-01T00:10:00Z",
        "effect": {"effect": "query_status"}, "effect_applied": false,
        "effect_detail": "the lookup was inconclusive; the action stays escalated",
        "action_outcome": null, "new_action": null,
        "lookup": {"verdict": "inconclusive", "reason": "the lookup failed with HTTP 503",
                   "provider_operation_id": null},
        "escalation_state": "open", "note": null
    }));
    let out = backstop(&[
        "escalations",
        "decide",
        "7",
        "--option",
        "query_status",
        "--url",
        &url,
        "--token",
        TOKEN,
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "escalation 7: query_status asked by alice at 2026-01-01T00:10:00Z (action 12); the escalation stays open\n  \
         effect          query_status, not applied: the lookup was inconclusive; the action stays escalated\n  \
         action 12       unchanged\n  \
         lookup          inconclusive: the lookup failed with HTTP 503\n  \
         escalation      open\n"
    );

    let (_runtime, url) = canned_decision(serde_json::json!({
        "id": 7, "action": 12, "decision": "retry_same_key", "decided_by": "alice",
        "decided_at": "2026-01-01T00:10:00Z",
        "effect": {"effect": "retry_same_key", "idempotency_key": "k-1"}, "effect_applied": true,
        "effect_detail": "sent again with the same key", "action_outcome": "succeeded",
        "new_action": null, "lookup": null, "escalation_state": "decided", "note": null
    }));
    let out = backstop(&[
        "escalations",
        "decide",
        "7",
        "--option",
        "retry_same_key",
        "--url",
        &url,
        "--token",
        TOKEN,
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("  effect          retry_same_key (idempotency_key k-1), applied: sent again with the same key\n"),
        "{stdout}"
    );
    assert!(stdout.contains("  action 12       succeeded\n"), "{stdout}");
    assert!(!stdout.contains("lookup"), "{stdout}");

    // `send_new`: the outcome is the new action's; the escalated one stays as it was.
    let (_runtime, url) = canned_decision(serde_json::json!({
        "id": 7, "action": 12, "decision": "send_new", "decided_by": "alice",
        "decided_at": "2026-01-01T00:10:00Z",
        "effect": {"effect": "send_new"}, "effect_applied": true,
        "effect_detail": "sent as the new action 13 with a new Idempotency-Key; escalated action 12 stays escalated; outcome `succeeded`",
        "action_outcome": "succeeded", "new_action": 13, "lookup": null,
        "escalation_state": "decided", "note": null
    }));
    let out = backstop(&[
        "escalations",
        "decide",
        "7",
        "--option",
        "send_new",
        "--confirm-second-side-effect",
        "--url",
        &url,
        "--token",
        TOKEN,
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains(
            "  action 12       unchanged (the request was sent as a new action)\n  \
             new action 13   succeeded\n"
        ),
        "{stdout}"
    );
    assert!(!stdout.contains("action outcome"), "{stdout}");
}

/// Serves `problem` as a `409` problem answer of `POST /v1/escalations/7/decision`.
fn canned_conflict(problem: serde_json::Value) -> (tokio::runtime::Runtime, String) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let addr: SocketAddr = runtime.block_on(async move {
        let app = axum::Router::new().route(
            "/v1/escalations/7/decision",
            axum::routing::post(move || {
                let problem = problem.clone();
                async move {
                    (
                        axum::http::StatusCode::CONFLICT,
                        [("content-type", "application/problem+json")],
                        problem.to_string(),
                    )
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, app).await });
        addr
    });
    (runtime, format!("http://{addr}"))
}

/// A gateway that restarted since the escalation records `retry_same_key` (and reopens the
/// action) or `send_new`, but no longer holds the request: `409 request_not_held` with
/// `decision_recorded: true`. The decision was made, so `decide` says so and exits 0, naming
/// what the agent resubmits.
#[test]
fn a_decision_recorded_without_the_request_is_reported_as_recorded_and_exits_0() {
    let detail = "the decision is recorded and action 12 is reopened, but backstop no longer holds its request (the gateway restarted since the escalation; payloads are never stored); the agent must resubmit the same payload with Idempotency-Key `order-7`: that request is sent as this same action, under this same key";
    let problem = serde_json::json!({
        "type": "urn:backstop:problem:request_not_held",
        "title": "Recorded; the agent must resubmit", "status": 409, "detail": detail,
        "escalation": 7, "action": 12, "decision": "retry_same_key", "decided_by": "alice",
        "decided_at": "2026-01-01T00:10:00Z", "decision_recorded": true,
        "idempotency_key": "order-7"
    });
    let (_runtime, url) = canned_conflict(problem.clone());
    let decide = |option: &str, extra: &[&str]| {
        let mut args = vec![
            "escalations",
            "decide",
            "7",
            "--option",
            option,
            "--url",
            &url,
            "--token",
            TOKEN,
        ];
        args.extend_from_slice(extra);
        backstop(&args)
    };
    let out = decide("retry_same_key", &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(out.stderr.is_empty(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        format!(
            "escalation 7: retry_same_key (action 12, decided by alice at 2026-01-01T00:10:00Z); recorded, but the gateway no longer holds the request\n  \
             effect          retry_same_key, not applied: {detail}\n  \
             resubmit        the same payload with Idempotency-Key order-7 (sent as action 12)\n  \
             escalation      decided\n"
        )
    );
    let out = decide("retry_same_key", &["--format", "json"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let printed: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(printed, problem);

    // `send_new`: no key to resubmit under; the payload goes as a new action.
    let (_runtime, url) = canned_conflict(serde_json::json!({
        "type": "urn:backstop:problem:request_not_held",
        "title": "Recorded; the agent must resubmit", "status": 409,
        "detail": "the decision is recorded, but backstop no longer holds the request of action 12",
        "escalation": 7, "action": 12, "decision": "send_new", "decided_by": "alice",
        "decided_at": "2026-01-01T00:10:00Z", "decision_recorded": true,
        "idempotency_key": null
    }));
    let out = backstop(&[
        "escalations",
        "decide",
        "7",
        "--option",
        "send_new",
        "--confirm-second-side-effect",
        "--url",
        &url,
        "--token",
        TOKEN,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout)
            .contains("  resubmit        the payload as a new action with a new Idempotency-Key\n"),
        "{}",
        text(&out.stdout)
    );

    // A problem about another decision is not taken for this one.
    let (_runtime, url) = canned_conflict(serde_json::json!({
        "type": "urn:backstop:problem:request_not_held", "title": "x", "status": 409,
        "detail": "x", "escalation": 7, "action": 12, "decision": "send_new",
        "decided_by": "alice", "decision_recorded": true, "idempotency_key": null
    }));
    let out = backstop(&[
        "escalations",
        "decide",
        "7",
        "--option",
        "retry_same_key",
        "--url",
        &url,
        "--token",
        TOKEN,
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stdout));
    assert!(out.stdout.is_empty());
}

#[test]
fn decide_format_json_prints_the_whole_answer() {
    let g = gateway();
    let id = g.escalation.0.to_string();
    let out = backstop(&[
        "escalations",
        "decide",
        &id,
        "--option",
        "abort",
        "--format",
        "json",
        "--url",
        &g.url,
        "--token",
        TOKEN,
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(answer["decision"], "abort");
    assert_eq!(answer["effect"]["effect"], "abort");
    assert_eq!(answer["effect_applied"], false);
    assert_eq!(answer["escalation_state"], "decided");
    assert!(text(&out.stdout).contains("\n  \""), "not pretty-printed");
}

#[test]
fn list_all_shows_decided_escalations_and_json_gives_the_rows() {
    let g = gateway();
    let id = g.escalation.0.to_string();
    let list = |extra: &[&str]| {
        let mut args = vec!["escalations", "list", "--url", &g.url, "--token", TOKEN];
        args.extend_from_slice(extra);
        let out = backstop(&args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout)
    };
    let json: serde_json::Value = serde_json::from_str(&list(&["--format", "json"])).unwrap();
    assert_eq!(json["escalations"][0]["id"], g.escalation.0);
    assert_eq!(json["escalations"][0]["state"], "open");

    let out = backstop(&[
        "escalations",
        "decide",
        &id,
        "--option",
        "abort",
        "--url",
        &g.url,
        "--token",
        TOKEN,
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(list(&[]), "no open escalations\n");
    let json: serde_json::Value = serde_json::from_str(&list(&["--format", "json"])).unwrap();
    assert_eq!(json["escalations"], serde_json::json!([]));

    let all = list(&["--all"]);
    let lines: Vec<Vec<&str>> = all
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(lines.len(), 2, "{all}");
    assert_eq!(
        lines[0],
        [
            "ID",
            "ACTION",
            "PROVIDER",
            "ROUTE",
            "REASON",
            "OPENED",
            "STATE",
            "DECISION",
            "DECIDED_BY"
        ]
    );
    assert_eq!(lines[1][0], id);
    assert_eq!(
        lines[1][2..],
        [
            "billing-api",
            "POST",
            "/v1/transfers",
            "side_effect_unknown",
            "2026-01-01T00:00:30Z",
            "decided",
            "abort",
            "alice"
        ]
    );
    let json: serde_json::Value =
        serde_json::from_str(&list(&["--all", "--format", "json"])).unwrap();
    let rows = json["escalations"].as_array().expect("rows");
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["decision"], "abort");
    assert_eq!(rows[0]["route"], "POST /v1/transfers");
}

#[test]
fn help_says_only_http_urls_are_accepted() {
    let out = backstop(&["escalations", "list", "--help"]);
    assert!(out.status.success());
    assert!(
        text(&out.stdout).contains("Only http:// URLs are accepted"),
        "{}",
        text(&out.stdout)
    );
}

/// Another server at the URL: `answer` with 200 to every method on every path.
fn answering_everything(answer: serde_json::Value) -> (tokio::runtime::Runtime, String) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let addr: SocketAddr = runtime.block_on(async move {
        let app = axum::Router::new().fallback(move || {
            let answer = answer.clone();
            async move { axum::Json(answer) }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, app).await });
        addr
    });
    (runtime, format!("http://{addr}"))
}

#[test]
fn a_server_answering_foreign_json_is_not_a_backstop_gateway() {
    let (_runtime, url) = answering_everything(serde_json::json!({"hostile": true}));
    let not_backstop = format!("{url} does not look like a backstop gateway: ");
    let cases: Vec<(Vec<&str>, String)> = vec![
        (
            vec!["list"],
            format!("backstop escalations list: {not_backstop}GET /v1/escalations answered JSON that is not an escalation list (missing field `escalations`)"),
        ),
        (
            vec!["list", "--format", "json"],
            format!("backstop escalations list: {not_backstop}GET /v1/escalations answered JSON that is not an escalation list (missing field `escalations`)"),
        ),
        (
            vec!["list", "--all"],
            format!("backstop escalations list: {not_backstop}GET /v1/escalations/1 answered JSON that is not an escalation (missing field `id`)"),
        ),
        (
            vec!["show", "1"],
            format!("backstop escalations show: {not_backstop}GET /v1/escalations/1 answered JSON that is not an escalation (missing field `id`)"),
        ),
        (
            vec!["decide", "1", "--option", "abort"],
            format!("backstop escalations decide: {not_backstop}POST /v1/escalations/1/decision answered JSON that is not a decision's answer (missing field `id`)"),
        ),
        (
            vec!["decide", "1", "--option", "abort", "--format", "json"],
            format!("backstop escalations decide: {not_backstop}POST /v1/escalations/1/decision answered JSON that is not a decision's answer (missing field `id`)"),
        ),
    ];
    for (args, expected) in cases {
        let mut all = vec!["escalations"];
        all.extend_from_slice(&args);
        all.extend_from_slice(&["--url", &url, "--token", TOKEN]);
        let out = backstop(&all);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stdout)
        );
        assert_eq!(text(&out.stderr), format!("{expected}\n"), "{args:?}");
        assert!(out.stdout.is_empty(), "{args:?}: {}", text(&out.stdout));
    }
}

#[test]
fn an_answer_about_another_escalation_or_decision_is_refused() {
    // Well-formed answers, but about escalation 5 and the decision `wait`.
    let (_runtime, url) = answering_everything(serde_json::json!({
        "id": 5, "action": 12, "state": "decided", "decision": "wait", "decided_by": "mallory",
        "decided_at": "2026-01-01T00:10:00Z", "note": null,
        "case_file": {"provider": "billing-api", "endpoint": "POST /v1/transfers",
                      "reason": "side_effect_unknown", "opened_at": "2026-01-01T00:00:30Z"},
        "effect": {"effect": "wait"}, "effect_applied": false, "effect_detail": null,
        "action_outcome": null, "new_action": null, "lookup": null, "escalation_state": "decided"
    }));
    let run = |args: &[&str]| {
        let mut all = vec!["escalations"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--url", &url, "--token", TOKEN]);
        let out = backstop(&all);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stdout)
        );
        assert!(out.stdout.is_empty(), "{args:?}");
        text(&out.stderr)
    };
    let not_backstop = format!("{url} does not look like a backstop gateway: ");
    assert_eq!(
        run(&["show", "1"]),
        format!("backstop escalations show: {not_backstop}GET /v1/escalations/1 answered escalation 5\n")
    );
    assert_eq!(
        run(&["list", "--all"]),
        format!("backstop escalations list: {not_backstop}GET /v1/escalations/1 answered escalation 5\n")
    );
    assert_eq!(
        run(&["decide", "1", "--option", "abort"]),
        format!("backstop escalations decide: {not_backstop}POST /v1/escalations/1/decision answered a decision wait on escalation 5 (asked: abort on escalation 1)\n")
    );
}
