//! Writes that never duplicate, end to end over loopback: backstop (door + engine + SQLite
//! store + upstream client) in front of the fake provider, which commits a write and then drops
//! the connection. Every count is measured at the fake provider's own attempt record.

use std::path::Path;

use backstop_core::reconcile::upstream_idempotency_key;
use backstop_fake_api::{FakeConfig, Fault, Handler, RouteConfig};
use backstop_gateway::server::Running;
use backstop_store::{ActionId, SqliteStore, Store};

use crate::support::{self, action_id, client, lookup, on_route};

const AGENT_TOKEN: &str = "agent-token-writes-1";
const OTHER_TOKEN: &str = "agent-token-writes-2";
const PROVIDER_SECRET: &str = "sk-live-provider-secret-writes";

fn policy_yaml(base_url: &str) -> String {
    support::policy_yaml(
        base_url,
        r#"agents:
  test-agent: { token_env: TEST_AGENT_TOKEN }
  other-agent: { token_env: OTHER_AGENT_TOKEN }
"#,
        &format!(
            r#"    routes:
      "POST /v1/transfers":
        class: idempotent_write
        scopes: [account]
        reconcile:
          by: idempotency_key
          lookup: "GET /v1/transfers?idempotency_key={{key}}"
          found_pointer: /data/0/id
          operation_id_pointer: /id
      "POST /v1/payouts":
        class: idempotent_write
        scopes: [account]
        reconcile:
          by: external_reference
          lookup: "GET /v1/payouts?reference={{ref}}"
          external_reference_pointer: /reference
          found_pointer: /data/0/id
      "GET /v1/transfers": {{ class: read, scopes: [account] }}
      "POST /v1/refunds": {{ class: idempotent_write, scopes: [account] }}
      "PUT /v1/refunds": {{ class: idempotent_write, scopes: [account] }}
      "GET /v1/payouts": {{ class: read, scopes: [account] }}
  nokeys:
    base_url: {base_url}
    routes:
      "POST /v1/messages": {{ class: uncertain_write }}
      "POST /v1/refunds": {{ class: uncertain_write }}
"#
        ),
    )
}

fn env(name: &str) -> Option<String> {
    match name {
        "TEST_AGENT_TOKEN" => Some(AGENT_TOKEN.to_owned()),
        "OTHER_AGENT_TOKEN" => Some(OTHER_TOKEN.to_owned()),
        "FAKE_API_KEY" => Some(PROVIDER_SECRET.to_owned()),
        _ => None,
    }
}

async fn start_gateway(base_url: &str, dir: &Path) -> Running {
    let options = support::serve_options(dir, 11);
    support::start_gateway(&policy_yaml(base_url), "writes.yaml", &env, options).await
}

fn create(collection: &str, prefix: &str, reference_field: Option<&str>) -> Handler {
    Handler::Create {
        collection: collection.into(),
        id_prefix: prefix.into(),
        reference_field: reference_field.map(str::to_owned),
        unique_reference: false,
    }
}

/// The fake: writes commit and then drop the connection on their first call.
fn fake() -> backstop_fake_api::RunningFake {
    let drop_first =
        || backstop_fake_api::FaultRule::on_calls([1], Fault::StoreThenDrop { hold_ms: 0 });
    let config = FakeConfig::default()
        .with_route(
            RouteConfig::new("POST /v1/transfers", create("transfers", "tr_", None))
                .with_idempotency()
                .with_fault(drop_first()),
        )
        .with_route(RouteConfig::new("GET /v1/transfers", lookup("transfers")))
        .with_route(
            RouteConfig::new(
                "POST /v1/payouts",
                create("payouts", "po_", Some("reference")),
            )
            .with_fault(drop_first()),
        )
        .with_route(RouteConfig::new("GET /v1/payouts", lookup("payouts")))
        .with_route(
            RouteConfig::new("POST /v1/refunds", create("refunds", "re_", None)).with_idempotency(),
        )
        .with_route(
            RouteConfig::new("POST /v1/messages", create("messages", "msg_", None))
                .with_fault(drop_first()),
        );
    support::start_fake(config)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_then_dropped_write_is_reconciled_by_key_with_one_create_and_one_lookup() {
    let fake = fake();
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;

    let response = client()
        .post(format!("http://{}/fake/v1/transfers", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("X-Backstop-Task", "run-reconcile")
        .header("content-type", "application/json")
        .body(r#"{"amount":100,"currency":"EUR"}"#)
        .send()
        .await
        .expect("request");
    let id = action_id(&response);
    let status = response.status();
    assert!(
        response.headers().get("idempotent-replayed").is_none(),
        "the reconciliation's own answer is not a replay"
    );
    let minted = response
        .headers()
        .get("idempotency-key")
        .expect("the minted key")
        .clone();
    let body: serde_json::Value =
        serde_json::from_slice(&response.bytes().await.expect("body")).expect("json");
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["outcome"], "succeeded", "{body}");

    // The agent's resend under the minted key replays the outcome with the same account of
    // what was sent, not an empty one, marked as a replay like every replay.
    let replayed = client()
        .post(format!("http://{}/fake/v1/transfers", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("X-Backstop-Task", "run-reconcile")
        .header("Idempotency-Key", minted)
        .header("content-type", "application/json")
        .body(r#"{"amount":100,"currency":"EUR"}"#)
        .send()
        .await
        .expect("replay");
    assert_eq!(action_id(&replayed), id);
    assert_eq!(replayed.status(), 200);
    assert_eq!(replayed.headers()["idempotent-replayed"], "true");
    let replayed: serde_json::Value =
        serde_json::from_slice(&replayed.bytes().await.expect("body")).expect("json");
    assert_eq!(replayed["outcome"], "succeeded", "{replayed}");
    assert_eq!(replayed["reconciled"], true, "{replayed}");
    assert_eq!(replayed["context"]["sent"], true, "{replayed}");
    assert_eq!(replayed["context"]["attempts"], 1, "{replayed}");
    assert_eq!(
        replayed["context"]["attempts"], body["context"]["attempts"],
        "{replayed} vs {body}"
    );

    let attempts = fake.attempts();
    let creates = on_route(&attempts, "POST", "/v1/transfers");
    let lookups = on_route(&attempts, "GET", "/v1/transfers");
    assert_eq!(creates.len(), 1, "exactly one create: {attempts:?}");
    assert_eq!(lookups.len(), 1, "exactly one lookup: {attempts:?}");
    let key = creates[0]
        .idempotency_key
        .clone()
        .expect("the write carried a key");
    assert_eq!(
        lookups[0].query.as_deref(),
        Some(format!("idempotency_key={key}").as_str())
    );
    assert!(
        lookups[0].auth_present,
        "the lookup carries the provider credential"
    );
    // The one lookup is counted, apart from the action's attempts.
    let metrics = client()
        .get(format!("http://{}/metrics", gateway.addr))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text");
    assert!(
        metrics.contains(
            r#"backstop_reconciliation_lookups_total{provider="fake",verdict="found"} 1"#
        ),
        "{metrics}"
    );

    gateway.shutdown().await.unwrap();
    let store = SqliteStore::open_existing(dir.path().join("backstop.db")).expect("store");
    let action = store.action(ActionId(id)).unwrap().expect("action");
    assert_eq!(action.outcome.map(|o| o.as_str()), Some("succeeded"));
    // The provider saw (and was asked for) the key derived from the agent and the stored key.
    assert_eq!(
        upstream_idempotency_key("test-agent", &action.idempotency_key),
        key
    );
    let op = action.provider_operation_id.expect("provider id stored");
    assert!(op.starts_with("tr_"), "{op}");
    let kinds: Vec<String> = store
        .audit_events(0, 10_000)
        .unwrap()
        .into_iter()
        .filter(|e| e.action == Some(id))
        .map(|e| e.kind)
        .collect();
    for kind in [
        "action_sent",
        "action_result",
        "reconciliation_lookup",
        "reconciled",
    ] {
        assert!(
            kinds.iter().any(|k| k == kind),
            "{kind} missing from {kinds:?}"
        );
    }
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_then_dropped_write_is_reconciled_by_its_external_reference() {
    let fake = fake();
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;

    let response = client()
        .post(format!("http://{}/fake/v1/payouts", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("content-type", "application/json")
        .body(r#"{"amount":5}"#)
        .send()
        .await
        .expect("request");
    let id = action_id(&response);
    let body: serde_json::Value =
        serde_json::from_slice(&response.bytes().await.expect("body")).expect("json");
    assert_eq!(body["outcome"], "succeeded", "{body}");

    let attempts = fake.attempts();
    assert_eq!(
        on_route(&attempts, "POST", "/v1/payouts").len(),
        1,
        "{attempts:?}"
    );
    let lookups = on_route(&attempts, "GET", "/v1/payouts");
    assert_eq!(lookups.len(), 1, "{attempts:?}");
    gateway.shutdown().await.unwrap();
    let store = SqliteStore::open_existing(dir.path().join("backstop.db")).expect("store");
    let action = store.action(ActionId(id)).unwrap().expect("action");
    let reference = action.external_reference.expect("reference recorded");
    assert_eq!(
        lookups[0].query.as_deref(),
        Some(format!("reference={reference}").as_str())
    );
    assert!(action
        .provider_operation_id
        .is_some_and(|op| op.starts_with("po_")));
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_without_key_support_or_lookup_is_never_resent_and_is_escalated() {
    let fake = fake();
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;

    let response = client()
        .post(format!("http://{}/nokeys/v1/messages", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("content-type", "application/json")
        .body(r#"{"text":"hello","api_key":"sk-live-should-never-appear"}"#)
        .send()
        .await
        .expect("request");
    let id = action_id(&response);
    let body: serde_json::Value =
        serde_json::from_slice(&response.bytes().await.expect("body")).expect("json");
    assert_eq!(body["outcome"], "escalated", "{body}");
    let attempts = fake.attempts();
    assert_eq!(
        on_route(&attempts, "POST", "/v1/messages").len(),
        1,
        "{attempts:?}"
    );
    let (status, view) = support::json_of(
        client()
            .get(format!("http://{}/v1/actions/{id}", gateway.addr))
            .bearer_auth(AGENT_TOKEN)
            .send()
            .await
            .expect("view"),
    )
    .await;
    assert_eq!(status, 200, "{view}");

    gateway.shutdown().await.unwrap();
    let store = SqliteStore::open_existing(dir.path().join("backstop.db")).expect("store");
    let open = store.open_escalations().unwrap();
    let escalation = open.iter().find(|e| e.action.0 == id).expect("escalation");
    let case = escalation.case_file.to_string();
    assert!(
        !case.contains("hello"),
        "no payload in the case file: {case}"
    );
    assert!(
        !case.contains("sk-live"),
        "no credential in the case file: {case}"
    );
    assert_eq!(escalation.case_file["reason"], "side_effect_unknown");
    // One source for what may be done next: the agent's answer and the action view offer the
    // case file's safe options — no lookup and no key support, so no query_status and no
    // retry_same_key, only abort (send_new is an operator's decision, not a safe step).
    let names = |list: &serde_json::Value| -> Vec<String> {
        list.as_array()
            .expect("a list of options")
            .iter()
            .map(|o| o["option"].as_str().expect("option").to_owned())
            .collect()
    };
    let offered = names(&escalation.case_file["options"]);
    assert_eq!(offered, ["abort", "send_new"], "{case}");
    assert_eq!(names(&body["next_safe"]), ["abort"], "{body}");
    assert_eq!(names(&view["context"]["next_safe"]), ["abort"], "{view}");
    assert_eq!(view["escalation_id"], escalation.id.0, "{view}");
    // The provider takes no idempotency header: no key was sent, so the case file names none
    // for the operator to quote to the provider.
    assert_eq!(
        attempts[0].idempotency_key, None,
        "no key reached the provider"
    );
    assert_eq!(escalation.case_file["honours_key"], false);
    // Named as `null`, the documented shape, not left out.
    assert_eq!(
        escalation.case_file.get("upstream_idempotency_key"),
        Some(&serde_json::Value::Null),
        "an upstream key that was never sent is not named: {case}"
    );
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_keys_replay_refuse_a_changed_payload_with_422_and_reject_a_bad_key_with_400() {
    let fake = fake();
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let url = format!("http://{}/fake/v1/refunds", gateway.addr);
    let send = |key: String, body: &'static str| {
        client()
            .post(&url)
            .bearer_auth(AGENT_TOKEN)
            .header("X-Backstop-Task", "run-keys")
            .header("Idempotency-Key", key)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };

    let first = send("refund-7".into(), r#"{"amount":7}"#).await.unwrap();
    assert_eq!(first.status(), 201);
    let id = action_id(&first);
    let first_body = first.bytes().await.unwrap();

    // Same key, same payload, after completion: replayed, nothing sent.
    let again = send("refund-7".into(), r#"{"amount":7}"#).await.unwrap();
    assert_eq!(action_id(&again), id);
    assert_eq!(
        again.status(),
        201,
        "the provider's stored response is replayed"
    );
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(
        again.bytes().await.unwrap(),
        first_body,
        "the replay is the original response body"
    );

    // Same key, another payload: 422, nothing sent.
    let changed = send("refund-7".into(), r#"{"amount":8}"#).await.unwrap();
    assert_eq!(changed.status(), 422);
    let problem: serde_json::Value =
        serde_json::from_slice(&changed.bytes().await.unwrap()).unwrap();
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("different request body"),
        "{problem}"
    );

    // A key that is not a valid Idempotency-Key: 400 naming the header, nothing sent.
    let bad = send("x".repeat(300), r#"{"amount":9}"#).await.unwrap();
    assert_eq!(bad.status(), 400);
    let problem: serde_json::Value = serde_json::from_slice(&bad.bytes().await.unwrap()).unwrap();
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("Idempotency-Key"),
        "{problem}"
    );

    let attempts = fake.attempts();
    let refunds = on_route(&attempts, "POST", "/v1/refunds");
    assert_eq!(refunds.len(), 1, "one create for the key: {attempts:?}");
    assert_eq!(
        refunds[0].idempotency_key,
        Some(upstream_idempotency_key("test-agent", "refund-7"))
    );
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}

/// A key binds one request: the same key and body on another route, method or provider is
/// another request, refused with 422 naming what differs, and nothing is sent for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_reused_on_another_route_method_or_provider_is_422_and_sends_nothing() {
    let fake = fake();
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let send = |method: reqwest::Method, path: &str| {
        client()
            .request(method, format!("http://{}{path}", gateway.addr))
            .bearer_auth(AGENT_TOKEN)
            .header("X-Backstop-Task", "run-key-binds")
            .header("Idempotency-Key", "xr-1")
            .header("content-type", "application/json")
            .body(r#"{"amount":31}"#)
            .send()
    };

    let first = send(reqwest::Method::POST, "/fake/v1/refunds")
        .await
        .unwrap();
    assert_eq!(first.status(), 201);
    let id = action_id(&first);
    let first_body = first.bytes().await.unwrap();

    for (method, path, differs) in [
        (reqwest::Method::POST, "/fake/v1/transfers", "route"),
        (reqwest::Method::PUT, "/fake/v1/refunds", "method"),
        (reqwest::Method::POST, "/nokeys/v1/refunds", "provider"),
    ] {
        let reused = send(method.clone(), path).await.unwrap();
        assert_eq!(reused.status(), 422, "{method} {path}");
        assert!(
            reused.headers().get("idempotent-replayed").is_none(),
            "{method} {path} is not a replay"
        );
        assert_eq!(reused.headers()["x-should-retry"], "false");
        let problem: serde_json::Value =
            serde_json::from_slice(&reused.bytes().await.unwrap()).unwrap();
        assert_eq!(
            problem["type"], "urn:backstop:problem:idempotency_key_reused",
            "{problem}"
        );
        assert_eq!(
            problem["differs"],
            serde_json::json!([differs]),
            "{problem}"
        );
        assert_eq!(
            problem["bound_to"],
            serde_json::json!({"provider": "fake", "method": "POST", "route": "/v1/refunds"}),
            "{problem}"
        );
        assert_eq!(problem["sent"], false, "{problem}");
        assert!(
            problem["detail"].as_str().unwrap().contains(differs),
            "{problem}"
        );
    }

    // The original request under its key is still the original action, replayed as it was.
    let again = send(reqwest::Method::POST, "/fake/v1/refunds")
        .await
        .unwrap();
    assert_eq!(action_id(&again), id);
    assert_eq!(again.status(), 201);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.bytes().await.unwrap(), first_body);

    let attempts = fake.attempts();
    assert_eq!(
        attempts.len(),
        1,
        "only the original request reached the provider: {attempts:?}"
    );
    assert_eq!(on_route(&attempts, "POST", "/v1/refunds").len(), 1);
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}

/// A reconciled write's `total_wait_ms` is its wait budget's count — here the wait for the
/// scope's boundary before its first send — in the caller's answer, in `GET /v1/actions/{id}`
/// and in a same-key replay alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconciled_write_reports_the_same_total_wait_to_its_caller_and_in_its_view() {
    let policy = support::policy_yaml(
        "BASE_URL",
        r#"agents:
  test-agent: { token_env: TEST_AGENT_TOKEN }
request_classes:
  one_shot: { max_attempts: 1, max_wait_seconds: 0, retry_statuses: [] }
"#,
        r#"    routes:
      "GET /v1/limits": { class: one_shot, scopes: [account] }
      "POST /v1/transfers":
        class: idempotent_write
        scopes: [account]
        reconcile:
          by: idempotency_key
          lookup: "GET /v1/transfers?idempotency_key={key}"
          found_pointer: /data/0/id
          operation_id_pointer: /id
      "GET /v1/transfers": { class: read, scopes: [account] }
"#,
    );
    let fake =
        support::fake_with(vec![
            RouteConfig::new("GET /v1/limits", lookup("limits"))
                .with_fault(support::status_on_calls([1], 429, Some("2"))),
            RouteConfig::new("POST /v1/transfers", create("transfers", "tr_", None))
                .with_idempotency()
                .with_fault(backstop_fake_api::FaultRule::on_calls(
                    [1],
                    Fault::StoreThenDrop { hold_ms: 0 },
                )),
            RouteConfig::new("GET /v1/transfers", lookup("transfers")),
        ]);
    let dir = tempfile::tempdir().unwrap();
    let gateway = support::start_gateway(
        &policy.replace("BASE_URL", &fake.url()),
        "wait.yaml",
        &env,
        support::serve_options(dir.path(), 5),
    )
    .await;

    // A 429 with `Retry-After: 2` holds the whole scope for two seconds.
    let limited = client()
        .get(format!("http://{}/fake/v1/limits", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("X-Backstop-Task", "run-wait")
        .send()
        .await
        .expect("limited read");
    assert_eq!(limited.status(), 429, "the provider's 429 is passed on");
    // The write waits for that boundary before its first send, is dropped after the provider
    // stored it, and is found by the lookup.
    let send = |key: Option<String>| {
        let mut request = client()
            .post(format!("http://{}/fake/v1/transfers", gateway.addr))
            .bearer_auth(AGENT_TOKEN)
            .header("X-Backstop-Task", "run-wait")
            .header("content-type", "application/json")
            .body(r#"{"amount":3}"#);
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        request.send()
    };
    let answer = send(None).await.expect("write");
    let id = action_id(&answer);
    let key = answer.headers()["idempotency-key"]
        .to_str()
        .unwrap()
        .to_owned();
    let (status, answer) = support::json_of(answer).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["reconciled"], true, "{answer}");
    let waited = answer["context"]["total_wait_ms"]
        .as_u64()
        .expect("a total wait");
    assert!(
        waited >= 1_500,
        "the wait for the scope's boundary is counted: {answer}"
    );

    let (status, view) = support::json_of(
        client()
            .get(format!("http://{}/v1/actions/{id}", gateway.addr))
            .bearer_auth(AGENT_TOKEN)
            .send()
            .await
            .expect("view"),
    )
    .await;
    assert_eq!(status, 200, "{view}");
    assert_eq!(view["reconciled"], true, "{view}");
    assert_eq!(view["context"], answer["context"], "{view} vs {answer}");

    // The same key and payload again: the recorded outcome is replayed, with the same context.
    let (status, replayed) = support::json_of(send(Some(key)).await.expect("replay")).await;
    assert_eq!(status, 200, "{replayed}");
    assert_eq!(
        replayed["context"], answer["context"],
        "{replayed} vs {answer}"
    );

    let attempts = fake.attempts();
    assert_eq!(on_route(&attempts, "POST", "/v1/transfers").len(), 1);
    assert_eq!(on_route(&attempts, "GET", "/v1/transfers").len(), 1);
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}
