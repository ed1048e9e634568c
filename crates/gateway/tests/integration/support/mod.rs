//! Test support for the end-to-end gateway tests: backstop started by `server::start` on a
//! loopback port with a temp-dir SQLite store, in front of the controllable fake provider on
//! another loopback port, and the HTTP helpers the tests share.

pub mod capture;

use std::{path::Path, time::Duration};

use backstop_core::policy::Policy;
use backstop_fake_api::{
    AttemptRecord, FakeApi, FakeConfig, Fault, FaultRule, Handler, RouteConfig, RunningFake,
};
use backstop_gateway::server::{self, Running, ServeOptions};
use serde_json::Value;

/// A policy for one provider `fake` at `base_url`: backoff from 1 s to at most 2 s with no
/// boundary spread, then `top` (top-level YAML such as `agents:`, `operators:` and
/// `request_classes:`, each line ending in a newline), then the provider `fake` with the
/// `FAKE_API_KEY` credential, the `Idempotency-Key` header and an `account` scope of 1000
/// requests per 60 s, followed by `fake_rest` (its `routes:` and anything after, indented as
/// under `fake`).
pub fn policy_yaml(base_url: &str, top: &str, fake_rest: &str) -> String {
    format!(
        r#"
backoff:
  base_seconds: 1
  max_seconds: 2
  boundary_spread_seconds: 0
{top}providers:
  fake:
    base_url: {base_url}
    credential: {{ secret_env: FAKE_API_KEY }}
    idempotency_header: Idempotency-Key
    scopes:
      account: {{ limit: 1000, window_seconds: 60 }}
{fake_rest}"#
    )
}

/// Serve options on `127.0.0.1:0` with the store at `dir/backstop.db`, the given jitter `seed`
/// and a 2 s shutdown grace.
pub fn serve_options(dir: &Path, seed: u64) -> ServeOptions {
    ServeOptions {
        listen: Some("127.0.0.1:0".into()),
        store: Some(dir.join("backstop.db")),
        seed,
        shutdown_grace: Duration::from_secs(2),
        ..ServeOptions::default()
    }
}

/// Starts backstop with the policy `yaml` (named `file_name` in errors), the secrets of `env`
/// and `options`; panics when the policy or the start fails.
pub async fn start_gateway(
    yaml: &str,
    file_name: &str,
    env: &dyn Fn(&str) -> Option<String>,
    options: ServeOptions,
) -> Running {
    let policy = Policy::from_yaml_str(yaml, file_name).expect("policy");
    server::start(policy, options, env, server::engine)
        .await
        .expect("gateway starts")
}

/// A fault answering the calls numbered `calls` (from 1) with `status`, the `Retry-After`
/// value `retry_after` if any, and no body.
pub fn status_on_calls(
    calls: impl IntoIterator<Item = u64>,
    status: u16,
    retry_after: Option<&str>,
) -> FaultRule {
    FaultRule::on_calls(
        calls,
        Fault::Status {
            status,
            retry_after: retry_after.map(str::to_owned),
            body: None,
        },
    )
}

/// Starts the fake provider on a loopback port with `config`.
pub fn start_fake(config: FakeConfig) -> RunningFake {
    FakeApi::start(config, "127.0.0.1:0".parse().expect("addr")).expect("fake provider starts")
}

/// Starts the fake provider on a loopback port with these routes.
pub fn fake_with(routes: Vec<RouteConfig>) -> RunningFake {
    let mut config = FakeConfig::default();
    for route in routes {
        config = config.with_route(route);
    }
    start_fake(config)
}

/// A handler that creates objects in `collection` with ids starting `prefix` (no reference).
pub fn create(collection: &str, prefix: &str) -> Handler {
    Handler::Create {
        collection: collection.into(),
        id_prefix: prefix.into(),
        reference_field: None,
        unique_reference: false,
    }
}

/// A handler that looks objects of `collection` up by their query parameters.
pub fn lookup(collection: &str) -> Handler {
    Handler::Lookup {
        collection: collection.into(),
    }
}

/// An HTTP client that ignores proxy settings (every test talks to loopback).
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client")
}

/// The attempts the fake provider saw on `method path`.
pub fn on_route<'a>(
    attempts: &'a [AttemptRecord],
    method: &str,
    path: &str,
) -> Vec<&'a AttemptRecord> {
    attempts
        .iter()
        .filter(|a| a.method == method && a.path == path)
        .collect()
}

/// The `backstop-action-id` header of a response, as a number.
pub fn action_id(response: &reqwest::Response) -> i64 {
    response.headers()["backstop-action-id"]
        .to_str()
        .expect("text")
        .parse()
        .expect("number")
}

/// The status and JSON body of a response (a body that is not JSON becomes a JSON string).
pub async fn json_of(response: reqwest::Response) -> (u16, Value) {
    let status = response.status().as_u16();
    let bytes = response.bytes().await.expect("body");
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, body)
}

/// The open escalations listed by `GET /v1/escalations` for the operator `token`.
pub async fn open_escalations(gateway: &Running, token: &str) -> Vec<Value> {
    let (status, list) = json_of(
        client()
            .get(format!("http://{}/v1/escalations", gateway.addr))
            .bearer_auth(token)
            .send()
            .await
            .expect("list"),
    )
    .await;
    assert_eq!(status, 200, "{list}");
    list["escalations"].as_array().expect("array").clone()
}

/// Posts the decision `body` on `escalation` for the operator `token`; the status and body.
pub async fn decide(gateway: &Running, token: &str, escalation: i64, body: Value) -> (u16, Value) {
    json_of(
        client()
            .post(format!(
                "http://{}/v1/escalations/{escalation}/decision",
                gateway.addr
            ))
            .bearer_auth(token)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .expect("decision"),
    )
    .await
}

/// The `request_classes:` top-level YAML most escalation tests share: reads get up to 4
/// attempts and idempotent writes up to 3, each within 30 s of wait and retried on 429 and 503.
pub const RETRYING_CLASSES: &str = r#"request_classes:
  read: { max_attempts: 4, max_wait_seconds: 30, retry_statuses: [429, 503] }
  idempotent_write: { max_attempts: 3, max_wait_seconds: 30, retry_statuses: [429, 503] }
"#;

/// The top-level YAML for the agent `test-agent` (token in `TEST_AGENT_TOKEN`) and the operator
/// `oncall` (token in `OPS_TOKEN`).
pub const TEST_AGENT_AND_ONCALL: &str = r#"agents:
  test-agent: { token_env: TEST_AGENT_TOKEN }
operators:
  oncall: { token_env: OPS_TOKEN }
"#;

/// The secret of the environment variable `name` under [`TEST_AGENT_AND_ONCALL`] and the
/// provider credential `FAKE_API_KEY`: `agent_token`, `operator_token` or `api_key`, and
/// nothing for any other name.
pub fn agent_oncall_secret(
    name: &str,
    agent_token: &str,
    operator_token: &str,
    api_key: &str,
) -> Option<String> {
    match name {
        "TEST_AGENT_TOKEN" => Some(agent_token.to_owned()),
        "OPS_TOKEN" => Some(operator_token.to_owned()),
        "FAKE_API_KEY" => Some(api_key.to_owned()),
        _ => None,
    }
}

/// Submits the action `body` by `POST /v1/actions` as the agent `token`; the status and body.
pub async fn submit_action(gateway: &Running, token: &str, body: &Value) -> (u16, Value) {
    json_of(
        client()
            .post(format!("http://{}/v1/actions", gateway.addr))
            .bearer_auth(token)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .expect("submit"),
    )
    .await
}

/// The view of `action` by `GET /v1/actions/{action}` for `token`, long-polling with
/// `?wait={wait}` (a duration such as `10s`) when a wait is given; the status and body.
pub async fn action_view(
    gateway: &Running,
    token: &str,
    action: i64,
    wait: Option<&str>,
) -> (u16, Value) {
    let query = wait.map(|w| format!("?wait={w}")).unwrap_or_default();
    json_of(
        client()
            .get(format!(
                "http://{}/v1/actions/{action}{query}",
                gateway.addr
            ))
            .bearer_auth(token)
            .send()
            .await
            .expect("poll"),
    )
    .await
}

/// The open escalation listed for `action` (see [`open_escalations`]); panics naming the open
/// ones when there is none.
pub async fn open_escalation_of(gateway: &Running, token: &str, action: i64) -> Value {
    let open = open_escalations(gateway, token).await;
    open.iter()
        .find(|e| e["action"] == action)
        .cloned()
        .unwrap_or_else(|| panic!("an open escalation for action {action}: {open:?}"))
}

/// `GET /v1/escalations/{escalation}` for the operator `token`; the status and body (with the
/// case file).
pub async fn show_escalation(gateway: &Running, token: &str, escalation: i64) -> (u16, Value) {
    json_of(
        client()
            .get(format!(
                "http://{}/v1/escalations/{escalation}",
                gateway.addr
            ))
            .bearer_auth(token)
            .send()
            .await
            .expect("show"),
    )
    .await
}

/// The names of the options a case file offers, in its order.
pub fn case_options(case: &Value) -> Vec<&str> {
    case["options"]
        .as_array()
        .expect("options")
        .iter()
        .filter_map(|o| o["option"].as_str())
        .collect()
}
