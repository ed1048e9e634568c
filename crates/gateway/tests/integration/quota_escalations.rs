//! An exhausted shared quota is handed to a person once per scope (SPEC §8), measured over
//! loopback at the fake provider: several tasks whose requests meet `429 insufficient_quota`
//! each end `quota_exhausted` after exactly one send, and the scope gets exactly one open
//! `shared_quota_exhausted` escalation, whose options are worded for actions that have ended. A
//! read in another scope gets its own, saying it carries no payload; once the first escalation is
//! decided, the next exhausted answer in its scope opens a new one.

use std::path::Path;

use backstop_fake_api::{FakeConfig, Fault, FaultRule, RouteConfig, RunningFake};
use backstop_gateway::server::Running;
use backstop_store::{SqliteStore, Store};
use serde_json::{json, Value};

use crate::support::{
    self, client, create, json_of, lookup, RETRYING_CLASSES, TEST_AGENT_AND_ONCALL,
};

const AGENT_TOKEN: &str = "agent-token-quota-9a8b";
const OPERATOR_TOKEN: &str = "operator-token-quota-7c6d";

fn policy_yaml(base_url: &str) -> String {
    // The first line continues the provider's `scopes:` map with a second scope.
    support::policy_yaml(
        base_url,
        &format!("{RETRYING_CLASSES}{TEST_AGENT_AND_ONCALL}"),
        r#"      reads: { limit: 1000, window_seconds: 60 }
    error_code_pointer: /error/code
    routes:
      "POST /v1/orders": { class: idempotent_write, scopes: [account] }
      "GET /v1/orders": { class: read, scopes: [account] }
      "GET /v1/items": { class: read, scopes: [reads] }
"#,
    )
}

fn env(name: &str) -> Option<String> {
    support::agent_oncall_secret(name, AGENT_TOKEN, OPERATOR_TOKEN, "sk-fake-quota-1234")
}

async fn start_gateway(base_url: &str, dir: &Path) -> Running {
    let options = support::serve_options(dir, 53);
    support::start_gateway(&policy_yaml(base_url), "quota.yaml", &env, options).await
}

/// Every call of every route answers OpenAI's `429 insufficient_quota` (no Retry-After).
fn fake() -> RunningFake {
    let exhausted = || {
        FaultRule::with_probability(
            1.0,
            Fault::ErrorCode {
                status: 429,
                code: "insufficient_quota".into(),
                message: "You exceeded your current quota".into(),
            },
        )
    };
    let config = FakeConfig::default()
        .with_route(
            RouteConfig::new("POST /v1/orders", create("orders", "or_"))
                .with_idempotency()
                .with_fault(exhausted()),
        )
        .with_route(RouteConfig::new("GET /v1/orders", lookup("orders")).with_fault(exhausted()))
        .with_route(RouteConfig::new("GET /v1/items", lookup("items")).with_fault(exhausted()));
    support::start_fake(config)
}

async fn write(gateway: &Running, task: &str, key: &str) -> Value {
    let response = client()
        .post(format!("http://{}/fake/v1/orders", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("X-Backstop-Task", task)
        .header("Idempotency-Key", key)
        .header("content-type", "application/json")
        .body(r#"{"sku":"A-1"}"#)
        .send()
        .await
        .expect("write");
    json_of(response).await.1
}

async fn read(gateway: &Running, task: &str, path: &str) -> Value {
    let response = client()
        .get(format!("http://{}/fake{path}", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("X-Backstop-Task", task)
        .send()
        .await
        .expect("read");
    json_of(response).await.1
}

/// The open `shared_quota_exhausted` escalations with their case files.
async fn quota_escalations(gateway: &Running) -> Vec<Value> {
    let mut out = Vec::new();
    for row in support::open_escalations(gateway, OPERATOR_TOKEN).await {
        if row["reason"] != "shared_quota_exhausted" {
            continue;
        }
        let id = row["id"].as_i64().expect("id");
        let (status, shown) = support::show_escalation(gateway, OPERATOR_TOKEN, id).await;
        assert_eq!(status, 200, "{shown}");
        out.push(shown);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_meeting_an_exhausted_quota_open_one_escalation_per_scope() {
    let fake = fake();
    let dir = tempfile::tempdir().expect("tempdir");
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let gateway = std::sync::Arc::new(gateway);

    // Four tasks at once in the `account` scope: three writes and a read.
    let mut handles = Vec::new();
    for i in 0..3 {
        let gateway = gateway.clone();
        handles.push(tokio::spawn(async move {
            write(&gateway, &format!("run-q{i}"), &format!("order-q{i}")).await
        }));
    }
    {
        let gateway = gateway.clone();
        handles.push(tokio::spawn(async move {
            read(&gateway, "run-q-read", "/v1/orders").await
        }));
    }
    for handle in handles {
        let body = handle.await.expect("task");
        assert_eq!(body["outcome"], "quota_exhausted", "{body}");
        // No reset was given: the detail says so instead of promising one.
        assert!(body["boundary"].is_null(), "{body}");
        let detail = body["detail"].as_str().expect("detail");
        assert!(
            detail.starts_with("the provider's quota is exhausted")
                && detail.contains("and the provider gave no reset instant"),
            "{detail}"
        );
        assert!(!detail.contains("until its reset"), "{detail}");
    }
    // Exactly one send each: no retry, no probe.
    let attempts = fake.attempts();
    assert_eq!(support::on_route(&attempts, "POST", "/v1/orders").len(), 3);
    assert_eq!(support::on_route(&attempts, "GET", "/v1/orders").len(), 1);
    assert_eq!(attempts.len(), 4, "nothing else was sent");

    let open = quota_escalations(&gateway).await;
    assert_eq!(open.len(), 1, "one escalation for the scope: {open:#?}");
    let case = &open[0]["case_file"];
    assert_eq!(case["reason"], "shared_quota_exhausted");
    assert_eq!(case["scopes"], json!(["fake/account"]));
    assert_eq!(case["ended_with"], "quota_exhausted");
    assert!(
        case["retry_not_before"].is_null(),
        "no reset was given: {case}"
    );
    assert!(
        case["reason_detail"]
            .as_str()
            .expect("detail")
            .contains("insufficient_quota"),
        "{case}"
    );
    let options = support::case_options(case);
    assert_eq!(options, ["wait", "raise_quota", "change_plan", "abort"]);
    for option in case["options"].as_array().expect("options") {
        let risk = option["risk"].as_str().expect("risk");
        assert!(
            !risk.contains("Hold the action") && !risk.contains("the action is sent"),
            "an ended action is never promised a later send: {risk}"
        );
    }
    let first = open[0]["id"].as_i64().expect("id");

    // A read in another scope opens its own escalation, saying it carries no payload.
    let body = read(&gateway, "run-items", "/v1/items").await;
    assert_eq!(body["outcome"], "quota_exhausted", "{body}");
    let open = quota_escalations(&gateway).await;
    assert_eq!(open.len(), 2, "{open:#?}");
    let items = open
        .iter()
        .find(|e| e["case_file"]["scopes"] == json!(["fake/reads"]))
        .expect("the reads scope's escalation");
    let detail = items["case_file"]["reason_detail"]
        .as_str()
        .expect("detail");
    assert!(detail.contains("carries no payload"), "{detail}");
    assert!(items["case_file"]["idempotency_key"].is_null());

    // Once the account escalation is decided, the next exhausted answer there opens a new one.
    let (status, answer) = support::decide(
        &gateway,
        OPERATOR_TOKEN,
        first,
        json!({ "option": "raise_quota" }),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    let body = write(&gateway, "run-q-after", "order-q-after").await;
    assert_eq!(body["outcome"], "quota_exhausted", "{body}");
    let open = quota_escalations(&gateway).await;
    let account: Vec<&Value> = open
        .iter()
        .filter(|e| e["case_file"]["scopes"] == json!(["fake/account"]))
        .collect();
    assert_eq!(account.len(), 1, "{open:#?}");
    assert_ne!(account[0]["id"].as_i64(), Some(first), "a new escalation");
    assert_eq!(
        support::on_route(&fake.attempts(), "POST", "/v1/orders").len(),
        4,
        "one more send, for the one more write"
    );

    let gateway = std::sync::Arc::try_unwrap(gateway)
        .unwrap_or_else(|_| panic!("the gateway is still shared"));
    gateway.shutdown().await.expect("shutdown");
    let store = SqliteStore::open_existing(dir.path().join("backstop.db")).expect("store");
    let escalated = store
        .audit_events(0, 10_000)
        .expect("audit")
        .into_iter()
        .filter(|e| e.kind == "escalated" && e.outcome.as_deref() == Some("quota_exhausted"))
        .count();
    assert_eq!(escalated, 3, "each escalation audited beside its outcome");
    fake.shutdown().await;
}

/// Every create answers `429 Retry-After: 1`: a plain rate limit, never a success.
fn always_limited() -> RunningFake {
    let limited = FaultRule::with_probability(
        1.0,
        Fault::Status {
            status: 429,
            retry_after: Some("1".into()),
            body: None,
        },
    );
    support::start_fake(
        FakeConfig::default().with_route(
            RouteConfig::new("POST /v1/orders", create("orders", "or_"))
                .with_idempotency()
                .with_fault(limited),
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_limits_in_a_scope_open_one_account_configuration_escalation() {
    let fake = always_limited();
    let dir = tempfile::tempdir().expect("tempdir");
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let streak = backstop_gateway::engine::ACCOUNT_CONFIGURATION_STREAK as usize;

    let account_escalations = |open: Vec<Value>| -> Vec<Value> {
        open.into_iter()
            .filter(|e| e["reason"] == "account_configuration")
            .collect()
    };
    // Each write is limited on all 3 attempts of its class and ends budget_exhausted. Until the
    // scope has seen the streak, none is escalated for the account.
    let mut sent = 0;
    let mut writes = 0;
    while sent < streak {
        let body = write(
            &gateway,
            &format!("run-l{writes}"),
            &format!("order-l{writes}"),
        )
        .await;
        assert_eq!(body["outcome"], "budget_exhausted", "{body}");
        writes += 1;
        sent += 3;
        let open = account_escalations(support::open_escalations(&gateway, OPERATOR_TOKEN).await);
        if sent < streak {
            assert!(
                open.is_empty(),
                "{sent} limits are not yet a streak: {open:?}"
            );
        } else {
            assert_eq!(open.len(), 1, "{open:?}");
        }
    }
    // One more write meeting the same limits opens no second escalation for the scope.
    let body = write(&gateway, "run-l-more", "order-l-more").await;
    assert_eq!(body["outcome"], "budget_exhausted", "{body}");
    let open = account_escalations(support::open_escalations(&gateway, OPERATOR_TOKEN).await);
    assert_eq!(open.len(), 1, "{open:?}");
    assert_eq!(
        support::on_route(&fake.attempts(), "POST", "/v1/orders").len(),
        3 * (writes + 1),
        "three sends per write, nothing more"
    );
    let id = open[0]["id"].as_i64().expect("id");
    let (_, shown) = support::show_escalation(&gateway, OPERATOR_TOKEN, id).await;
    let case = &shown["case_file"];
    assert_eq!(case["scopes"], json!(["fake/account"]));
    assert_eq!(case["ended_with"], "budget_exhausted");
    let options = support::case_options(case);
    assert_eq!(options, ["raise_quota", "change_plan", "wait", "abort"]);
    assert!(
        case["reason_detail"]
            .as_str()
            .expect("detail")
            .contains("rate_limited answers in a row"),
        "{case}"
    );
    gateway.shutdown().await.expect("shutdown");
    fake.shutdown().await;
}

/// An operator's decision note is free text that reaches the store and every later reader of
/// the escalation: it is scrubbed of every secret the gateway holds — the provider's credential
/// and the callers' tokens, however plain they look — before it is kept or answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_note_never_keeps_a_credential_or_token_the_gateway_holds() {
    const PLAIN_KEY: &str = "providerkeyplain9931";
    const PLAIN_OPERATOR: &str = "oncallplaintoken5521";
    let fake = fake();
    let dir = tempfile::tempdir().unwrap();
    let env =
        |name: &str| support::agent_oncall_secret(name, AGENT_TOKEN, PLAIN_OPERATOR, PLAIN_KEY);
    let options = support::serve_options(dir.path(), 54);
    let gateway =
        support::start_gateway(&policy_yaml(&fake.url()), "quota.yaml", &env, options).await;
    let answer = write(&gateway, "task-note", "note-1").await;
    assert_eq!(answer["outcome"], "quota_exhausted", "{answer}");
    let open = support::open_escalations(&gateway, PLAIN_OPERATOR).await;
    let escalation = open[0]["id"].as_i64().expect("an escalation");
    let note = format!(
        "provider key is {PLAIN_KEY}, my token {PLAIN_OPERATOR}, agent's {AGENT_TOKEN}; raise tomorrow"
    );
    let (status, decided) = support::decide(
        &gateway,
        PLAIN_OPERATOR,
        escalation,
        json!({ "option": "wait", "note": note }),
    )
    .await;
    assert_eq!(status, 200, "{decided}");
    let shown = client()
        .get(format!(
            "http://{}/v1/escalations/{escalation}",
            gateway.addr
        ))
        .bearer_auth(PLAIN_OPERATOR)
        .send()
        .await
        .expect("escalation");
    let (_, shown) = json_of(shown).await;
    gateway.shutdown().await.unwrap();
    let stored = SqliteStore::open_existing(dir.path().join("backstop.db"))
        .expect("store")
        .escalation(backstop_store::EscalationId(escalation))
        .unwrap()
        .expect("stored");
    for text in [
        decided["note"].to_string(),
        shown["note"].to_string(),
        stored.note.clone().unwrap_or_default(),
    ] {
        for secret in [PLAIN_KEY, PLAIN_OPERATOR, AGENT_TOKEN] {
            assert!(!text.contains(secret), "{secret} in {text}");
        }
        assert!(text.contains("raise tomorrow"), "{text}");
    }
    fake.shutdown().await;
}
