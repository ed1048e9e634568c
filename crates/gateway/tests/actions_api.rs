//! The action API, `Prefer: respond-async`, task cancellation over HTTP and agent isolation,
//! end to end over real sockets; attempts are counted at the fake provider.

mod support;

use std::{path::Path, time::Duration};

use backstop_core::{policy::Policy, reconcile::upstream_idempotency_key};
use backstop_fake_api::{Fault, Handler, RouteConfig};
use backstop_gateway::server::{Running, ServeOptions};
use serde_json::{json, Value};
use support::{client, fake_with as fake};

const AGENT: &str = "agent-token-a1";
const OTHER: &str = "agent-token-b2";
const OPERATOR: &str = "operator-token-c3";

fn policy_yaml(base_url: &str) -> String {
    support::policy_yaml(
        base_url,
        r#"agents:
  agent-a: { token_env: AGENT_A }
  agent-b: { token_env: AGENT_B }
operators:
  oncall: { token_env: OPERATOR }
"#,
        r#"    routes:
      "GET /v1/items/{id}": { class: read, scopes: [account] }
      "POST /v1/transfers": { class: idempotent_write, scopes: [account] }
"#,
    )
}

fn env(name: &str) -> Option<String> {
    match name {
        "AGENT_A" => Some(AGENT.to_owned()),
        "AGENT_B" => Some(OTHER.to_owned()),
        "OPERATOR" => Some(OPERATOR.to_owned()),
        "FAKE_API_KEY" => Some("sk-provider".to_owned()),
        _ => None,
    }
}

async fn gateway(base_url: &str, dir: &Path) -> Running {
    let options = ServeOptions {
        store: Some(dir.join("b.db")),
        shutdown_grace: Duration::from_secs(1),
        ..support::serve_options(dir, 3)
    };
    support::start_gateway(&policy_yaml(base_url), "a.yaml", &env, options).await
}

async fn get_json(url: String, token: &str) -> (u16, Value) {
    let r = client().get(url).bearer_auth(token).send().await.unwrap();
    let status = r.status().as_u16();
    (
        status,
        serde_json::from_slice(&r.bytes().await.unwrap()).unwrap(),
    )
}

#[tokio::test]
async fn respond_async_answers_202_and_the_long_poll_returns_the_response_to_its_owner_only() {
    let dir = tempfile::tempdir().unwrap();
    let provider = fake(vec![RouteConfig::new(
        "POST /v1/transfers",
        Handler::Create {
            collection: "transfers".into(),
            id_prefix: "tr_".into(),
            reference_field: None,
            unique_reference: false,
        },
    )
    .with_idempotency()]);
    let gw = gateway(&provider.url(), dir.path()).await;
    let base = format!("http://{}", gw.addr);
    let r = client()
        .post(format!("{base}/fake/v1/transfers"))
        .bearer_auth(AGENT)
        .header("prefer", "respond-async")
        .header("x-backstop-task", "run-async")
        .body(r#"{"amount":5}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let location = r.headers()["location"].to_str().unwrap().to_owned();
    let key = r.headers()["idempotency-key"].to_str().unwrap().to_owned();
    assert!(location.starts_with("/v1/actions/"), "{location}");
    let (status, body) = get_json(format!("{base}{location}?wait=5s"), AGENT).await;
    assert_eq!(status, 200);
    assert_eq!(body["state"], "completed", "{body}");
    assert_eq!(body["outcome"], "succeeded");
    assert_eq!(body["attempts"], 1);
    assert_eq!(body["idempotency_key"], key.as_str());
    assert_eq!(body["response"]["status"], 201, "{body}");
    assert!(body["response"]["body"].as_str().unwrap().contains("tr_"));
    // Exactly one create, carrying the key answered to the agent.
    let creates = provider.attempts();
    assert_eq!(creates.len(), 1);
    // The provider sees the key derived from agent and key (one namespace per agent).
    assert_eq!(
        creates[0].idempotency_key.as_deref(),
        Some(upstream_idempotency_key("agent-a", &key).as_str())
    );

    // Another agent: not found, exactly like a missing action. An operator sees no body.
    let (status, body) = get_json(format!("{base}{location}"), OTHER).await;
    assert_eq!(status, 404);
    assert_eq!(body["type"], "urn:backstop:problem:action_not_found");
    let (status, body) = get_json(format!("{base}{location}"), OPERATOR).await;
    assert_eq!(status, 200);
    assert_eq!(body["outcome"], "succeeded");
    assert!(body["response"].is_null());
    let (status, _) = get_json(format!("{base}/v1/actions/999999"), AGENT).await;
    assert_eq!(status, 404);
    gw.shutdown().await.unwrap();
}

#[tokio::test]
async fn post_actions_accepts_json_and_cancel_over_http_stops_a_delayed_retry() {
    let dir = tempfile::tempdir().unwrap();
    let provider = fake(vec![RouteConfig::new(
        "GET /v1/items/{id}",
        Handler::default(),
    )
    .with_script([Fault::Status {
        status: 503,
        retry_after: Some("2".into()),
        body: None,
    }])]);
    let gw = gateway(&provider.url(), dir.path()).await;
    let base = format!("http://{}", gw.addr);
    let r = client()
        .post(format!("{base}/v1/actions"))
        .bearer_auth(AGENT)
        .header("content-type", "application/json")
        .body(
            json!({
                "provider": "fake", "method": "GET", "path": "/v1/items/7?x=1",
                "task": "run-cancel", "desired_outcome": "read item 7"
            })
            .to_string(),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    assert!(
        r.headers().get("idempotency-key").is_none(),
        "reads carry no key"
    );
    let body: Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
    let id = body["id"].as_i64().unwrap();
    // Wait for the first attempt (503, retry scheduled 2 s later).
    for _ in 0..50 {
        if !provider.attempts().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(provider.attempts().len(), 1);
    // Another agent cannot cancel it (404), the owner can.
    let r = client()
        .post(format!("{base}/v1/tasks/run-cancel/cancel"))
        .bearer_auth(OTHER)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = client()
        .post(format!("{base}/v1/tasks/run-cancel/cancel"))
        .bearer_auth(AGENT)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let report: Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
    assert_eq!(report["task_id"], "run-cancel");
    // The delayed action was taken out of the scheduler's queue before its wake.
    assert_eq!(report["waiting_dropped"], 1, "{report}");
    // Past the wake: nothing more reached the provider.
    tokio::time::sleep(Duration::from_millis(2600)).await;
    assert_eq!(provider.attempts().len(), 1, "no attempt after the cancel");
    let (_, body) = get_json(format!("{base}/v1/actions/{id}"), AGENT).await;
    assert_eq!(body["outcome"], "cancelled", "{body}");
    gw.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_dropped_read_is_retried_and_wait_zero_still_sends() {
    let dir = tempfile::tempdir().unwrap();
    let provider = fake(vec![RouteConfig::new(
        "GET /v1/items/{id}",
        Handler::default(),
    )
    .with_script([Fault::Drop])]);
    let gw = gateway(&provider.url(), dir.path()).await;
    let base = format!("http://{}", gw.addr);
    let r = client()
        .get(format!("{base}/fake/v1/items/1"))
        .bearer_auth(AGENT)
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        200,
        "an uncertain read is retried, not reconciled"
    );
    assert_eq!(r.headers()["backstop-attempts"], "2");
    assert!(r.headers().get("idempotency-key").is_none());
    assert_eq!(provider.attempts().len(), 2);
    assert!(provider
        .attempts()
        .iter()
        .all(|a| a.idempotency_key.is_none()));

    let r = client()
        .get(format!("{base}/fake/v1/items/2"))
        .bearer_auth(AGENT)
        .header("prefer", "wait=0")
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        200,
        "wait=0 caps waiting, it does not forbid sending"
    );
    assert_eq!(provider.attempts().len(), 3);
    gw.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_provider_named_like_a_backstop_route_is_refused_by_the_policy() {
    // The start-time check for policies built in code is covered in server.rs.
    let yaml = policy_yaml("http://127.0.0.1:9").replace("\n  fake:\n", "\n  v1:\n");
    let err = Policy::from_yaml_str(&yaml, "a.yaml").unwrap_err();
    let text = err.to_string();
    assert!(text.contains("providers.v1"), "{text}");
    assert!(text.contains("reserved"), "{text}");
}

#[tokio::test]
async fn two_agents_with_the_same_idempotency_key_make_two_creates_and_see_no_replay() {
    let dir = tempfile::tempdir().unwrap();
    let provider = fake(vec![RouteConfig::new(
        "POST /v1/transfers",
        Handler::Create {
            collection: "transfers".into(),
            id_prefix: "tr_".into(),
            reference_field: None,
            unique_reference: false,
        },
    )
    .with_idempotency()]);
    let gw = gateway(&provider.url(), dir.path()).await;
    let send = |token: &'static str, amount: u32| {
        let url = format!("http://{}/fake/v1/transfers", gw.addr);
        async move {
            let r = client()
                .post(url)
                .bearer_auth(token)
                .header("x-backstop-task", format!("run-pay-{amount}"))
                .header("idempotency-key", "pay-1")
                .header("content-type", "application/json")
                .body(format!(r#"{{"amount":{amount}}}"#))
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let key = r
                .headers()
                .get("idempotency-key")
                .map(|v| v.to_str().unwrap().to_owned());
            let body = r.text().await.unwrap();
            (status, key, body)
        }
    };
    let (status_a, key_a, body_a) = send(AGENT, 5).await;
    let (status_b, key_b, body_b) = send(OTHER, 7).await;
    assert_eq!((status_a, status_b), (201, 201), "{body_a} / {body_b}");
    // Each agent keeps seeing its own key.
    assert_eq!(
        (key_a.as_deref(), key_b.as_deref()),
        (Some("pay-1"), Some("pay-1")),
        "{body_a} / {body_b}"
    );
    let creates = provider.attempts();
    assert_eq!(creates.len(), 2, "two agents, two creates at the provider");
    assert_ne!(creates[0].idempotency_key, creates[1].idempotency_key);
    assert_ne!(body_a, body_b, "bob never gets alice's transfer replayed");
    assert!(body_b.contains("7"), "{body_b}");
    // The same agent resending the same key is still one logical action (no third create).
    let (status_again, _, body_again) = send(AGENT, 5).await;
    assert!((200..300).contains(&status_again), "{body_again}");
    assert_eq!(provider.attempts().len(), 2);
    gw.shutdown().await.unwrap();
}
