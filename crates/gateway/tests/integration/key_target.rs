//! An agent's `Idempotency-Key` binds the concrete target it was sent to, end to end over
//! loopback: the same key on another account (same route template) or with another query
//! string is refused 422 `idempotency_key_reused` naming `target`, and nothing is sent; the
//! same key on the same target still replays. Sends are counted at the fake provider.

use std::path::Path;

use backstop_fake_api::{FakeConfig, RouteConfig};
use backstop_gateway::server::Running;

use crate::support::{self, client, create, json_of, on_route};

const AGENT_TOKEN: &str = "agent-token-key-target";
const PROVIDER_SECRET: &str = "sk-live-provider-secret-key-target";

fn policy_yaml(base_url: &str) -> String {
    support::policy_yaml(
        base_url,
        r#"agents:
  test-agent: { token_env: TEST_AGENT_TOKEN }
"#,
        r#"    routes:
      "POST /v1/accounts/{acct}/charges": { class: idempotent_write, scopes: [account] }
      "POST /v1/transfers": { class: idempotent_write, scopes: [account] }
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
    let options = support::serve_options(dir, 7);
    support::start_gateway(&policy_yaml(base_url), "key-target.yaml", &env, options).await
}

fn fake() -> backstop_fake_api::RunningFake {
    let config = FakeConfig::default()
        .with_route(
            RouteConfig::new("POST /v1/accounts/{acct}/charges", create("charges", "ch_"))
                .with_idempotency(),
        )
        .with_route(
            RouteConfig::new("POST /v1/transfers", create("transfers", "tr_")).with_idempotency(),
        );
    support::start_fake(config)
}

/// POSTs `{"amount":100}` to `/fake{target}` under `key`.
async fn post(gateway: &Running, target: &str, key: &str) -> reqwest::Response {
    client()
        .post(format!("http://{}/fake{target}", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("Idempotency-Key", key)
        .header("content-type", "application/json")
        .body(r#"{"amount":100}"#)
        .send()
        .await
        .unwrap()
}

fn replayed(response: &reqwest::Response) -> Option<&str> {
    response
        .headers()
        .get("idempotent-replayed")
        .and_then(|v| v.to_str().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_on_another_account_is_refused_and_nothing_is_sent() {
    let fake = fake();
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;

    let first = post(&gateway, "/v1/accounts/acct_A/charges", "pay-1").await;
    assert_eq!(first.status(), 201);
    let (_, charge) = json_of(first).await;

    let other = post(&gateway, "/v1/accounts/acct_B/charges", "pay-1").await;
    assert_eq!(replayed(&other), None, "another account's answer replayed");
    let (status, problem) = json_of(other).await;
    assert_eq!(status, 422, "{problem}");
    assert_eq!(
        problem["type"], "urn:backstop:problem:idempotency_key_reused",
        "{problem}"
    );
    assert_eq!(
        problem["differs"],
        serde_json::json!(["target"]),
        "{problem}"
    );
    assert_eq!(problem["sent"], false, "{problem}");
    let attempts = fake.attempts();
    assert_eq!(
        on_route(&attempts, "POST", "/v1/accounts/acct_B/charges").len(),
        0,
        "{attempts:?}"
    );

    // The same key on the same account is still the first charge, replayed unsent.
    let again = post(&gateway, "/v1/accounts/acct_A/charges", "pay-1").await;
    assert_eq!(again.status(), 201);
    assert_eq!(replayed(&again), Some("true"));
    let (_, replay) = json_of(again).await;
    assert_eq!(replay["id"], charge["id"], "{replay} vs {charge}");
    let attempts = fake.attempts();
    assert_eq!(
        on_route(&attempts, "POST", "/v1/accounts/acct_A/charges").len(),
        1,
        "{attempts:?}"
    );
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_with_another_query_string_is_refused_and_nothing_is_sent() {
    let fake = fake();
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;

    let first = post(&gateway, "/v1/transfers", "xfer-1").await;
    assert_eq!(first.status(), 201);
    let other = post(&gateway, "/v1/transfers?currency=eur&dry_run=1", "xfer-1").await;
    assert_eq!(
        replayed(&other),
        None,
        "the first transfer's answer replayed"
    );
    let (status, problem) = json_of(other).await;
    assert_eq!(status, 422, "{problem}");
    assert_eq!(
        problem["differs"],
        serde_json::json!(["target"]),
        "{problem}"
    );
    let attempts = fake.attempts();
    let sent: Vec<_> = on_route(&attempts, "POST", "/v1/transfers");
    assert_eq!(sent.len(), 1, "{attempts:?}");
    assert_eq!(sent[0].query, None, "only the first transfer was sent");
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_action_api_binds_the_key_to_the_path_it_names() {
    let fake = fake();
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let submit = |path: &str| {
        serde_json::json!({
            "provider": "fake", "method": "POST", "path": path,
            "headers": {"content-type": "application/json"},
            "body": r#"{"amount":100}"#, "idempotency_key": "api-pay-1",
        })
    };
    let (status, accepted) = support::submit_action(
        &gateway,
        AGENT_TOKEN,
        &submit("/v1/accounts/acct_A/charges"),
    )
    .await;
    assert_eq!(status, 202, "{accepted}");
    let (status, problem) = support::submit_action(
        &gateway,
        AGENT_TOKEN,
        &submit("/v1/accounts/acct_B/charges"),
    )
    .await;
    assert_eq!(status, 422, "{problem}");
    assert_eq!(
        problem["differs"],
        serde_json::json!(["target"]),
        "{problem}"
    );
    let attempts = fake.attempts();
    assert!(
        on_route(&attempts, "POST", "/v1/accounts/acct_B/charges").is_empty(),
        "{attempts:?}"
    );
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}
