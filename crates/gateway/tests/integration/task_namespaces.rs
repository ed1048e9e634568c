//! Task ids are namespaced per agent, end to end over real sockets: two agents use the same
//! task id independently, cancelling one agent's task leaves the other's running, and nothing
//! answered to one agent mentions the other.

use std::{path::Path, time::Duration};

use backstop_fake_api::{Fault, Handler, RouteConfig};
use backstop_gateway::server::{Running, ServeOptions};
use serde_json::{json, Value};

use crate::support::{self, client, fake_with as fake, json_of};

const ALICE: &str = "agent-token-alice";
const BOB: &str = "agent-token-bob";

fn env(name: &str) -> Option<String> {
    match name {
        "ALICE" => Some(ALICE.to_owned()),
        "BOB" => Some(BOB.to_owned()),
        "OPERATOR" => Some("operator-token".to_owned()),
        "FAKE_API_KEY" => Some("sk-provider".to_owned()),
        _ => None,
    }
}

async fn gateway(base_url: &str, dir: &Path) -> Running {
    let yaml = support::policy_yaml(
        base_url,
        r#"agents:
  alice: { token_env: ALICE }
  bob: { token_env: BOB }
operators:
  oncall: { token_env: OPERATOR }
"#,
        r#"    routes:
      "GET /v1/items/{id}": { class: read, scopes: [account] }
      "POST /v1/transfers": { class: idempotent_write, scopes: [account] }
"#,
    );
    let options = ServeOptions {
        store: Some(dir.join("b.db")),
        shutdown_grace: Duration::from_secs(1),
        ..support::serve_options(dir, 5)
    };
    support::start_gateway(&yaml, "tasks.yaml", &env, options).await
}

/// Status, headers and body of a response, as text for "mentions" checks.
async fn text_of(response: reqwest::Response) -> (u16, String) {
    let status = response.status().as_u16();
    let headers = format!("{:?}", response.headers());
    let body = response.text().await.expect("body");
    (status, format!("{headers}\n{body}"))
}

async fn read_item(base: &str, token: &str, item: u32) -> reqwest::Response {
    client()
        .get(format!("{base}/fake/v1/items/{item}"))
        .bearer_auth(token)
        .header("x-backstop-task", "shared-1")
        .send()
        .await
        .expect("read")
}

async fn transfer(base: &str, token: &str, amount: u32) -> reqwest::Response {
    client()
        .post(format!("{base}/fake/v1/transfers"))
        .bearer_auth(token)
        .header("x-backstop-task", "shared-1")
        .header("content-type", "application/json")
        .body(json!({ "amount": amount }).to_string())
        .send()
        .await
        .expect("transfer")
}

#[tokio::test]
async fn two_agents_share_a_task_id_independently_and_cancel_only_their_own() {
    let dir = tempfile::tempdir().expect("tempdir");
    let provider = fake(vec![
        RouteConfig::new("GET /v1/items/{id}", Handler::default()).with_script([Fault::Status {
            status: 503,
            retry_after: Some("2".into()),
            body: None,
        }]),
        RouteConfig::new("POST /v1/transfers", support::create("transfers", "tr_"))
            .with_idempotency(),
    ]);
    let gw = gateway(&provider.url(), dir.path()).await;
    let base = format!("http://{}", gw.addr);
    let mut to_bob = Vec::new();

    // Alice opens `shared-1` with a read that is throttled once (503, retry in 2 s): it waits
    // in her task while bob works.
    let r = client()
        .post(format!("{base}/v1/actions"))
        .bearer_auth(ALICE)
        .header("content-type", "application/json")
        .body(
            json!({
                "provider": "fake", "method": "GET", "path": "/v1/items/1",
                "task": "shared-1", "desired_outcome": "read item 1"
            })
            .to_string(),
        )
        .send()
        .await
        .expect("alice's action");
    let (status, body) = json_of(r).await;
    assert_eq!(status, 202, "{body}");
    let alice_action = body["id"].as_i64().expect("action id");
    for _ in 0..100 {
        if !provider.attempts().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        provider.attempts().len(),
        1,
        "alice's first attempt was throttled"
    );

    // Bob uses the same task id: a read and a write both succeed.
    let (status, text) = text_of(read_item(&base, BOB, 2).await).await;
    assert_eq!(status, 200, "{text}");
    to_bob.push(text);
    let (status, text) = text_of(transfer(&base, BOB, 7).await).await;
    assert_eq!(status, 201, "{text}");
    to_bob.push(text);
    // So does a write of alice in her `shared-1`.
    let r = transfer(&base, ALICE, 8).await;
    assert_eq!(r.status(), 201);

    // Bob cancels his `shared-1`: his actions had all ended, nothing of alice's is dropped.
    let r = client()
        .post(format!("{base}/v1/tasks/shared-1/cancel"))
        .bearer_auth(BOB)
        .send()
        .await
        .expect("cancel");
    let (status, text) = text_of(r).await;
    assert_eq!(status, 200, "{text}");
    let report: Value =
        serde_json::from_str(text.split_once('\n').expect("body").1).expect("json report");
    assert_eq!(report["task_id"], "shared-1");
    assert_eq!(report["waiting_dropped"], 0, "{report}");
    assert_eq!(report["retries_dropped"], 0, "{report}");
    assert_eq!(report["actions_cancelled"], 0, "{report}");
    to_bob.push(text);

    // Bob's task is cancelled: it takes no new action.
    let (status, text) = text_of(read_item(&base, BOB, 3).await).await;
    assert!(status >= 400, "{status} {text}");
    to_bob.push(text);

    // Alice's waiting read wakes and succeeds; her task takes new actions.
    let r = client()
        .get(format!("{base}/v1/actions/{alice_action}?wait=10s"))
        .bearer_auth(ALICE)
        .send()
        .await
        .expect("long poll");
    let (status, body) = json_of(r).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["outcome"], "succeeded", "{body}");
    assert_eq!(body["attempts"], 2, "{body}");
    let r = read_item(&base, ALICE, 4).await;
    assert_eq!(r.status(), 200, "alice's shared-1 was not cancelled");

    // Bob cannot see alice's action, and asking does not reveal her.
    let r = client()
        .get(format!("{base}/v1/actions/{alice_action}"))
        .bearer_auth(BOB)
        .send()
        .await
        .expect("peek");
    let (status, text) = text_of(r).await;
    assert_eq!(status, 404, "{text}");
    to_bob.push(text);

    // Run health is per agent too: alice's throttled read is in her `shared-1`, never in bob's.
    let health_of = |token: &'static str| {
        let base = base.clone();
        async move {
            let r = client()
                .get(format!("{base}/v1/runs/shared-1/health"))
                .bearer_auth(token)
                .send()
                .await
                .expect("run health");
            json_of(r).await
        }
    };
    let action_ids = |body: &Value| -> Vec<i64> {
        body["actions"]
            .as_array()
            .map(|a| a.iter().filter_map(|x| x["action_id"].as_i64()).collect())
            .unwrap_or_default()
    };
    let (status, alice_health) = health_of(ALICE).await;
    assert_eq!(status, 200, "{alice_health}");
    assert!(
        action_ids(&alice_health).contains(&alice_action),
        "alice's throttled read is in her run health: {alice_health}"
    );
    let (status, bob_health) = health_of(BOB).await;
    assert_eq!(status, 200, "{bob_health}");
    assert!(
        !action_ids(&bob_health).contains(&alice_action),
        "bob's run health shows none of alice's actions: {bob_health}"
    );
    to_bob.push(bob_health.to_string());

    for text in &to_bob {
        assert!(
            !text.to_ascii_lowercase().contains("alice"),
            "a response to bob mentions alice: {text}"
        );
    }
    gw.shutdown().await.expect("shutdown");
}
