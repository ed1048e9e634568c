//! Write answers as a first-time user of `backstop serve` meets them, end to end over loopback:
//! the replay of a completed write is the provider's own response, an uncertain write of a
//! single-attempt class is reconciled or escalated (never `budget_exhausted`), and a reconciled
//! write names the provider's id in structured members. Counts are measured at the fake provider.

use std::path::Path;

use backstop_fake_api::{FakeConfig, Fault, FaultRule, RouteConfig};
use backstop_gateway::server::Running;

use crate::support::{self, client, create, on_route};

const AGENT_TOKEN: &str = "agent-token-first-use";
const PROVIDER_SECRET: &str = "sk-live-provider-secret-first-use";

fn policy_yaml(base_url: &str) -> String {
    support::policy_yaml(
        base_url,
        r#"agents:
  test-agent: { token_env: TEST_AGENT_TOKEN }
"#,
        r#"    routes:
      "POST /v1/refunds": { class: idempotent_write, scopes: [account] }
      "POST /v1/messages":
        class: uncertain_write
        scopes: [account]
        reconcile:
          by: idempotency_key
          lookup: "GET /v1/messages?idempotency_key={key}"
          found_pointer: /data/0/id
      "GET /v1/messages": { class: read, scopes: [account] }
      "POST /v1/notes": { class: uncertain_write, scopes: [account] }
"#,
    )
}

fn env(name: &str) -> Option<String> {
    match name {
        "TEST_AGENT_TOKEN" => Some(AGENT_TOKEN.to_owned()),
        "FAKE_API_KEY" => Some(PROVIDER_SECRET.to_owned()),
        _ => None,
    }
}

async fn start_gateway(base_url: &str, dir: &Path) -> Running {
    let options = support::serve_options(dir, 5);
    support::start_gateway(&policy_yaml(base_url), "first-use.yaml", &env, options).await
}

fn fake() -> backstop_fake_api::RunningFake {
    let drop_first = || FaultRule::on_calls([1], Fault::StoreThenDrop { hold_ms: 0 });
    let config = FakeConfig::default()
        .with_route(
            RouteConfig::new("POST /v1/refunds", create("refunds", "re_")).with_idempotency(),
        )
        .with_route(
            RouteConfig::new("POST /v1/messages", create("messages", "msg_"))
                .with_idempotency()
                .with_fault(drop_first()),
        )
        .with_route(RouteConfig::new(
            "GET /v1/messages",
            support::lookup("messages"),
        ))
        .with_route(
            RouteConfig::new("POST /v1/notes", create("notes", "no_"))
                .with_idempotency()
                .with_fault(drop_first()),
        );
    support::start_fake(config)
}

fn header<'a>(response: &'a reqwest::Response, name: &str) -> Option<&'a str> {
    response.headers().get(name).and_then(|v| v.to_str().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_write_answers_the_providers_stored_response() {
    let fake = fake();
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let url = format!("http://{}/fake/v1/refunds", gateway.addr);
    let send = || {
        client()
            .post(&url)
            .bearer_auth(AGENT_TOKEN)
            .header("X-Backstop-Task", "run-replay")
            .header("Idempotency-Key", "refund-42")
            .header("content-type", "application/json")
            .body(r#"{"amount":42}"#)
            .send()
    };

    let first = send().await.unwrap();
    assert_eq!(first.status(), 201);
    let first_id = header(&first, "backstop-action-id").map(str::to_owned);
    let first_type = header(&first, "content-type").map(str::to_owned);
    assert_eq!(header(&first, "idempotent-replayed"), None);
    let first_body = first.bytes().await.unwrap();

    let again = send().await.unwrap();
    assert_eq!(again.status(), 201, "the provider's status is replayed");
    assert_eq!(header(&again, "idempotent-replayed"), Some("true"));
    assert_eq!(
        header(&again, "backstop-action-id").map(str::to_owned),
        first_id
    );
    assert_eq!(header(&again, "idempotency-key"), Some("refund-42"));
    assert_eq!(
        header(&again, "content-type").map(str::to_owned),
        first_type
    );
    assert_eq!(header(&again, "backstop-replay-body-truncated"), None);
    let again_body = again.bytes().await.unwrap();
    assert_eq!(
        again_body, first_body,
        "the provider's body is replayed byte for byte"
    );

    let attempts = fake.attempts();
    assert_eq!(
        on_route(&attempts, "POST", "/v1/refunds").len(),
        1,
        "nothing is sent for the replay: {attempts:?}"
    );
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}

/// Sends `POST /fake/v1/nothing` — a path the fake provider has no route for, answered `404`
/// with its JSON error body — under the key `nothing-1`.
async fn send_refused_write(gateway: &Running) -> reqwest::Response {
    client()
        .post(format!("http://{}/fake/v1/nothing", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("X-Backstop-Task", "w-2")
        .header("Idempotency-Key", "nothing-1")
        .body("x")
        .send()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_rejected_write_answers_the_providers_stored_4xx() {
    let fake = fake();
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;

    let first = send_refused_write(&gateway).await;
    assert_eq!(first.status(), 404);
    assert_eq!(header(&first, "idempotent-replayed"), None);
    let first_id = header(&first, "backstop-action-id").map(str::to_owned);
    let first_type = header(&first, "content-type").map(str::to_owned);
    let first_body = first.bytes().await.unwrap();

    let again = send_refused_write(&gateway).await;
    assert_eq!(again.status(), 404, "the provider's status is replayed");
    assert_eq!(header(&again, "idempotent-replayed"), Some("true"));
    assert_eq!(
        header(&again, "backstop-action-id").map(str::to_owned),
        first_id
    );
    assert_eq!(header(&again, "idempotency-key"), Some("nothing-1"));
    assert_eq!(header(&again, "backstop-task"), Some("w-2"));
    assert_eq!(
        header(&again, "content-type").map(str::to_owned),
        first_type,
        "the provider's headers are replayed, not a problem of backstop's"
    );
    assert_eq!(header(&again, "backstop-replay-body-truncated"), None);
    assert_eq!(
        again.bytes().await.unwrap(),
        first_body,
        "the provider's body is replayed byte for byte"
    );

    let attempts = fake.attempts();
    assert_eq!(
        on_route(&attempts, "POST", "/v1/nothing").len(),
        1,
        "nothing is sent for the replay: {attempts:?}"
    );
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_write_whose_response_is_not_kept_says_so_with_the_providers_status() {
    let fake = fake();
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let first = send_refused_write(&gateway).await;
    assert_eq!(first.status(), 404);
    gateway.shutdown().await.unwrap();
    // The write as a store kept it before refused writes' responses were kept: no response.
    let cleared = rusqlite::Connection::open(dir.path().join("backstop.db"))
        .expect("open raw")
        .execute(
            "UPDATE actions SET response_status = NULL, response_headers = NULL, \
             response_body = NULL WHERE idempotency_key = 'nothing-1'",
            [],
        )
        .expect("clear the kept response");
    assert_eq!(cleared, 1);

    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let again = send_refused_write(&gateway).await;
    assert_eq!(
        again.status(),
        404,
        "the provider's status is kept, not turned into a 400"
    );
    assert_eq!(header(&again, "idempotent-replayed"), Some("true"));
    assert_eq!(
        header(&again, "content-type"),
        Some("application/problem+json")
    );
    assert_eq!(header(&again, "x-should-retry"), Some("false"));
    let (_, body) = support::json_of(again).await;
    assert_eq!(body["outcome"], "rejected", "{body}");
    assert_eq!(body["last_status"], 404, "{body}");
    assert_eq!(body["sent"], true, "{body}");
    assert_eq!(body["idempotency_key"], "nothing-1", "{body}");
    assert_eq!(body["task"], "w-2", "{body}");
    let detail = body["detail"].as_str().expect("detail");
    assert!(detail.contains("HTTP 404"), "{detail}");
    assert!(detail.contains("not kept"), "{detail}");
    assert!(detail.contains("nothing was sent"), "{detail}");

    let attempts = fake.attempts();
    assert_eq!(
        on_route(&attempts, "POST", "/v1/nothing").len(),
        1,
        "nothing is sent for the resend: {attempts:?}"
    );
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_single_attempt_write_with_a_lookup_is_reconciled_with_structured_members() {
    let fake = fake();
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;

    let response = client()
        .post(format!("http://{}/fake/v1/messages", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("Idempotency-Key", "msg-1")
        .header("content-type", "application/json")
        .body(r#"{"text":"hi"}"#)
        .send()
        .await
        .expect("request");
    let status = response.status();
    let body: serde_json::Value =
        serde_json::from_slice(&response.bytes().await.unwrap()).expect("json");
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["outcome"], "succeeded", "{body}");
    assert_eq!(body["reconciled"], true, "{body}");
    assert_eq!(body["idempotency_key"], "msg-1", "{body}");
    let op = body["provider_operation_id"]
        .as_str()
        .expect("the provider's id");
    assert!(op.starts_with("msg_"), "{body}");

    let attempts = fake.attempts();
    assert_eq!(
        on_route(&attempts, "POST", "/v1/messages").len(),
        1,
        "{attempts:?}"
    );
    assert_eq!(
        on_route(&attempts, "GET", "/v1/messages").len(),
        1,
        "{attempts:?}"
    );
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_single_attempt_write_without_a_lookup_is_escalated_not_budget_exhausted() {
    let fake = fake();
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;

    let response = client()
        .post(format!("http://{}/fake/v1/notes", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("content-type", "application/json")
        .body(r#"{"text":"hi"}"#)
        .send()
        .await
        .expect("request");
    let status = response.status();
    let body: serde_json::Value =
        serde_json::from_slice(&response.bytes().await.unwrap()).expect("json");
    assert_eq!(status, 424, "{body}");
    assert_eq!(body["outcome"], "escalated", "{body}");
    let options: Vec<&str> = body["next_safe"]
        .as_array()
        .expect("next_safe")
        .iter()
        .filter_map(|o| o["option"].as_str())
        .collect();
    assert!(options.contains(&"retry_same_key"), "{body}");

    let attempts = fake.attempts();
    assert_eq!(
        on_route(&attempts, "POST", "/v1/notes").len(),
        1,
        "never resent automatically: {attempts:?}"
    );
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}

async fn action_view(
    gateway: &Running,
    id: &str,
    query: &str,
) -> (reqwest::StatusCode, Option<String>, serde_json::Value) {
    let response = client()
        .get(format!("http://{}/v1/actions/{id}{query}", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .send()
        .await
        .expect("GET /v1/actions/{id}");
    let status = response.status();
    let action_id = header(&response, "backstop-action-id").map(str::to_owned);
    let body = serde_json::from_slice(&response.bytes().await.unwrap()).expect("json");
    (status, action_id, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn action_views_of_reconciled_and_escalated_writes_share_one_shape() {
    let fake = fake();
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let post = |path: &'static str| {
        client()
            .post(format!("http://{}/fake{path}", gateway.addr))
            .bearer_auth(AGENT_TOKEN)
            .header("content-type", "application/json")
            .body(r#"{"text":"hi"}"#)
            .send()
    };
    let reconciled = post("/v1/messages").await.unwrap();
    let reconciled_id = header(&reconciled, "backstop-action-id")
        .unwrap()
        .to_owned();
    let escalated = post("/v1/notes").await.unwrap();
    let escalated_id = header(&escalated, "backstop-action-id").unwrap().to_owned();

    let (status, header_id, view) = action_view(&gateway, &reconciled_id, "").await;
    assert_eq!(status, 200, "{view}");
    assert_eq!(header_id.as_deref(), Some(reconciled_id.as_str()));
    assert_eq!(view["state"], "completed", "{view}");
    assert_eq!(view["outcome"], "succeeded", "{view}");
    assert_eq!(view["reconciled"], true, "{view}");
    assert!(
        view["provider_operation_id"]
            .as_str()
            .is_some_and(|op| op.starts_with("msg_")),
        "{view}"
    );
    assert_eq!(view["context"]["sent"], true, "{view}");
    assert_eq!(view["context"]["response_received"], false, "{view}");
    assert_eq!(view["context"]["attempts"], 1, "{view}");
    assert_eq!(
        view["context"]["next_safe"],
        serde_json::json!([]),
        "{view}"
    );
    assert!(view["context"].get("reconciled").is_none(), "{view}");
    assert!(
        view.get("response").is_none(),
        "no provider response exists: {view}"
    );

    let (status, header_id, view) = action_view(&gateway, &escalated_id, "").await;
    assert_eq!(status, 200, "{view}");
    assert_eq!(header_id.as_deref(), Some(escalated_id.as_str()));
    assert_eq!(view["state"], "completed", "{view}");
    assert_eq!(view["outcome"], "escalated", "{view}");
    assert!(
        view["escalation_id"].as_i64().is_some_and(|e| e > 0),
        "{view}"
    );
    assert_eq!(view["context"]["sent"], true, "{view}");
    assert_eq!(view["context"]["last_signal"], "uncertain", "{view}");
    // The route has no lookup, so query_status is not offered by the case file, nor here.
    let options: Vec<&str> = view["context"]["next_safe"]
        .as_array()
        .expect("next_safe")
        .iter()
        .map(|o| {
            assert!(
                o["description"].as_str().is_some_and(|d| !d.is_empty()),
                "each option is described: {view}"
            );
            o["option"].as_str().expect("option")
        })
        .collect();
    assert_eq!(options, ["retry_same_key", "abort"], "{view}");
    assert!(view["context"].get("escalation").is_none(), "{view}");
    assert!(view.get("response").is_none(), "{view}");

    let (status, _, problem) = action_view(&gateway, &escalated_id, "?wait=abc").await;
    assert_eq!(status, 400, "{problem}");
    assert_eq!(
        problem["title"], "The action API request is malformed",
        "{problem}"
    );
    assert!(
        problem["detail"].as_str().unwrap().contains("wait"),
        "{problem}"
    );

    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_reused_with_another_body_gets_its_own_problem_naming_no_action() {
    let fake = fake();
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let send = |body: &'static str| {
        client()
            .post(format!("http://{}/fake/v1/refunds", gateway.addr))
            .bearer_auth(AGENT_TOKEN)
            .header("Idempotency-Key", "refund-reused")
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    assert_eq!(send(r#"{"amount":1}"#).await.unwrap().status(), 201);
    let changed = send(r#"{"amount":2}"#).await.unwrap();
    assert_eq!(changed.status(), 422);
    // As every answer to a write, it names the key in effect (the agent's).
    assert_eq!(changed.headers()["idempotency-key"], "refund-reused");
    assert_eq!(changed.headers()["backstop-action-id"], "0");
    let problem: serde_json::Value =
        serde_json::from_slice(&changed.bytes().await.unwrap()).unwrap();
    assert_eq!(
        problem["type"], "urn:backstop:problem:idempotency_key_reused",
        "{problem}"
    );
    assert_eq!(
        problem["title"],
        "This Idempotency-Key was already used with a different request body"
    );
    assert_eq!(problem["sent"], false, "{problem}");
    assert_eq!(problem["idempotency_key"], "refund-reused", "{problem}");
    assert!(problem.get("action_id").is_none(), "{problem}");
    assert!(problem.get("outcome").is_none(), "{problem}");
    let attempts = fake.attempts();
    assert_eq!(
        on_route(&attempts, "POST", "/v1/refunds").len(),
        1,
        "{attempts:?}"
    );
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scope_records_carry_the_full_scope_name() {
    let fake = fake();
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let created = client()
        .post(format!("http://{}/fake/v1/refunds", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("content-type", "application/json")
        .body(r#"{"amount":3}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 201);
    let scopes = client()
        .get(format!("http://{}/v1/scopes", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .send()
        .await
        .unwrap();
    let scopes: serde_json::Value =
        serde_json::from_slice(&scopes.bytes().await.unwrap()).expect("json");
    let account = scopes
        .as_array()
        .expect("array")
        .iter()
        .find(|s| s["scope"] == "account")
        .expect("the account scope");
    assert_eq!(account["provider"], "fake", "{account}");
    assert_eq!(account["name"], "fake/account", "{account}");
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconciled_answer_says_so_in_a_header_and_the_providers_own_answer_does_not() {
    let fake = fake();
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let send = |key: &'static str| {
        client()
            .post(format!("http://{}/fake/v1/messages", gateway.addr))
            .bearer_auth(AGENT_TOKEN)
            .header("Idempotency-Key", key)
            .header("content-type", "application/json")
            .body(r#"{"text":"hi"}"#)
            .send()
    };

    // The fake stores the first message, then drops the connection: found by the lookup.
    let reconciled = send("msg-header-1").await.expect("request");
    assert_eq!(reconciled.status(), 200);
    assert_eq!(header(&reconciled, "backstop-reconciled"), Some("true"));
    let body: serde_json::Value =
        serde_json::from_slice(&reconciled.bytes().await.unwrap()).expect("json");
    assert_eq!(body["reconciled"], true, "{body}");

    // The second is answered by the provider itself: its object, and no such header.
    let answered = send("msg-header-2").await.expect("request");
    assert_eq!(answered.status(), 201);
    assert_eq!(header(&answered, "backstop-reconciled"), None);
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}
