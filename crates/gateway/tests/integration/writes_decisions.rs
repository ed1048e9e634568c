//! Writes that never duplicate, the last gaps, over loopback sockets: backstop (door + engine +
//! SQLite store + upstream client) in front of the fake provider. Every count is measured at the
//! fake provider's own attempt record.
//!
//! - agent idempotency keys: join while in flight (one create), 409 for a key unfinished in the
//!   store but not running (after a restart);
//! - operator decisions that act: `retry_same_key` sends exactly one more create with the SAME
//!   key; `send_new` is refused without confirmation (422, nothing sent) and sends exactly one
//!   new create with a NEW key with it; after a restart both answer `409 request_not_held`, and
//!   the agent's same-key resubmission is sent as the same action;
//! - the case file read over HTTP has every SPEC §8 item and no payload or credential.

use std::{path::Path, time::Duration};

use backstop_core::reconcile::upstream_idempotency_key;
use backstop_fake_api::{FakeConfig, Fault, FaultRule, RouteConfig};
use backstop_gateway::server::Running;
use backstop_store::{ActionId, SqliteStore, Store};
use serde_json::{json, Value};

use crate::support::{self, action_id, client, create, json_of, lookup, on_route};

const AGENT_TOKEN: &str = "agent-token-canary-7f3a";
const OPERATOR_TOKEN: &str = "operator-token-canary-91bc";
const PROVIDER_SECRET: &str = "sk-live-provider-canary-55de";
/// Appears only inside request payloads: must never reach a case file.
const PAYLOAD_CANARY: &str = "payload-canary-c0ffee";

fn policy_yaml(base_url: &str) -> String {
    support::policy_yaml(
        base_url,
        support::TEST_AGENT_AND_ONCALL,
        r#"    routes:
      "POST /v1/orders":
        class: idempotent_write
        scopes: [account]
        fingerprint_fields: [/sku]
        reconcile:
          by: idempotency_key
          lookup: "GET /v1/orders?idempotency_key={key}"
          found_pointer: /data/0/id
          operation_id_pointer: /id
      "GET /v1/orders": { class: read, scopes: [account] }
      "POST /v1/transfers":
        class: idempotent_write
        scopes: [account]
        reconcile:
          by: idempotency_key
          lookup: "GET /v1/transfers?idempotency_key={key}"
          found_pointer: /data/0/id
          operation_id_pointer: /id
      "GET /v1/transfers": { class: read, scopes: [account] }
      "POST /v1/refunds": { class: idempotent_write, scopes: [account] }
"#,
    )
}

fn env(name: &str) -> Option<String> {
    support::agent_oncall_secret(name, AGENT_TOKEN, OPERATOR_TOKEN, PROVIDER_SECRET)
}

async fn start_gateway(base_url: &str, dir: &Path) -> Running {
    let options = support::serve_options(dir, 23);
    support::start_gateway(&policy_yaml(base_url), "decisions.yaml", &env, options).await
}

/// The fake provider:
/// - `POST /v1/orders` stores the first write and drops the connection; its lookup fails with
///   500 the first time, so the write cannot be decided and is escalated;
/// - `POST /v1/transfers` stores the first write, holds the connection 1.5 s, then drops it; its
///   lookup finds it;
/// - `POST /v1/refunds` answers the first call 503 with `Retry-After: 90`.
fn fake() -> backstop_fake_api::RunningFake {
    let config = FakeConfig::default()
        .with_route(
            RouteConfig::new("POST /v1/orders", create("orders", "or_"))
                .with_idempotency()
                .with_fault(FaultRule::on_calls(
                    [1],
                    Fault::StoreThenDrop { hold_ms: 0 },
                )),
        )
        .with_route(
            RouteConfig::new("GET /v1/orders", lookup("orders"))
                .with_fault(support::status_on_calls([1], 500, None)),
        )
        .with_route(
            RouteConfig::new("POST /v1/transfers", create("transfers", "tr_"))
                .with_idempotency()
                .with_fault(FaultRule::on_calls(
                    [1],
                    Fault::StoreThenDrop { hold_ms: 1500 },
                )),
        )
        .with_route(RouteConfig::new("GET /v1/transfers", lookup("transfers")))
        .with_route(
            RouteConfig::new("POST /v1/refunds", create("refunds", "re_"))
                .with_idempotency()
                .with_fault(support::status_on_calls([1], 503, Some("90"))),
        );
    support::start_fake(config)
}

/// Sends the escalating order through the proxy door: the provider stores it, drops the
/// connection, and its lookup fails, so the write is escalated. Returns the action id and key.
async fn escalated_order(gateway: &Running, key: &str) -> i64 {
    let response = client()
        .post(format!("http://{}/fake/v1/orders", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("X-Backstop-Task", "run-orders")
        .header("Idempotency-Key", key)
        .header("content-type", "application/json")
        .body(format!(r#"{{"sku":"A-1","note":"{PAYLOAD_CANARY}"}}"#))
        .send()
        .await
        .expect("request");
    let id = action_id(&response);
    let (_, body) = json_of(response).await;
    assert_eq!(body["outcome"], "escalated", "{body}");
    id
}

async fn escalation_of(gateway: &Running, action: i64) -> i64 {
    support::open_escalation_of(gateway, OPERATOR_TOKEN, action).await["id"]
        .as_i64()
        .expect("id")
}

async fn decide(gateway: &Running, escalation: i64, body: Value) -> (u16, Value) {
    support::decide(gateway, OPERATOR_TOKEN, escalation, body).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_same_key_sends_exactly_one_more_create_with_the_same_key() {
    let fake = fake();
    let dir = tempfile::tempdir().expect("tempdir");
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let id = escalated_order(&gateway, "order-same-1").await;
    let escalation = escalation_of(&gateway, id).await;
    assert_eq!(on_route(&fake.attempts(), "POST", "/v1/orders").len(), 1);

    let (status, answer) = decide(
        &gateway,
        escalation,
        json!({"option": "retry_same_key", "note": "ledger shows nothing; token sk-live-abc123"}),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["effect_applied"], true, "{answer}");
    assert_eq!(answer["action_outcome"], "succeeded", "{answer}");
    assert_eq!(answer["decided_by"], "oncall");

    let attempts = fake.attempts();
    let creates = on_route(&attempts, "POST", "/v1/orders");
    assert_eq!(creates.len(), 2, "exactly one more create: {attempts:?}");
    assert!(
        creates.iter().all(|c| c.idempotency_key.as_deref()
            == Some(upstream_idempotency_key("test-agent", "order-same-1").as_str())),
        "the SAME key on both: {creates:?}"
    );

    // The note is kept (sanitized) and returned with the decision.
    let (status, shown) = support::show_escalation(&gateway, OPERATOR_TOKEN, escalation).await;
    assert_eq!(status, 200);
    assert_eq!(shown["decision"], "retry_same_key");
    let note = shown["note"].as_str().expect("note kept");
    assert!(note.starts_with("ledger shows nothing"), "{note}");
    assert!(!note.contains("sk-live-abc123"), "secrets masked: {note}");
    assert!(shown["decided_at"].is_string(), "{shown}");

    gateway.shutdown().await.expect("shutdown");
    let store = SqliteStore::open_existing(dir.path().join("backstop.db")).expect("store");
    let record = store.action(ActionId(id)).expect("read").expect("action");
    assert_eq!(record.outcome.map(|o| o.as_str()), Some("succeeded"));
    assert_eq!(record.idempotency_key, "order-same-1");
    let events: Vec<_> = store
        .audit_events(0, 10_000)
        .expect("audit")
        .into_iter()
        .filter(|e| e.action == Some(id))
        .collect();
    let kinds: Vec<&str> = events.iter().map(|e| e.kind.as_str()).collect();
    let reopened = kinds
        .iter()
        .position(|k| *k == backstop_store::ACTION_REOPENED)
        .unwrap_or_else(|| panic!("reopen audited: {kinds:?}"));
    assert!(kinds[..reopened].contains(&"decision"), "{kinds:?}");
    assert_eq!(
        events[reopened].decided_by.as_deref(),
        Some("oncall"),
        "who decided"
    );
    assert_eq!(
        kinds.iter().filter(|k| **k == "action_sent").count(),
        2,
        "{kinds:?}"
    );
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_new_is_refused_without_confirmation_and_sends_one_new_create_with_a_new_key_with_it()
{
    let fake = fake();
    let dir = tempfile::tempdir().expect("tempdir");
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let id = escalated_order(&gateway, "order-new-1").await;
    let escalation = escalation_of(&gateway, id).await;

    let (status, problem) = decide(&gateway, escalation, json!({"option": "send_new"})).await;
    assert_eq!(status, 422, "{problem}");
    assert_eq!(problem["type"], "urn:backstop:problem:decision_refused");
    let (status, problem) = decide(
        &gateway,
        escalation,
        json!({"option": "send_new", "confirm_second_side_effect": false}),
    )
    .await;
    assert_eq!(status, 422, "{problem}");
    assert_eq!(
        on_route(&fake.attempts(), "POST", "/v1/orders").len(),
        1,
        "nothing sent when refused"
    );

    let (status, answer) = decide(
        &gateway,
        escalation,
        json!({"option": "send_new", "confirm_second_side_effect": true}),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["effect_applied"], true, "{answer}");
    assert_eq!(answer["action_outcome"], "succeeded", "{answer}");
    let new_action = answer["new_action"].as_i64().expect("new action id");
    assert_ne!(new_action, id);

    let attempts = fake.attempts();
    let creates = on_route(&attempts, "POST", "/v1/orders");
    assert_eq!(creates.len(), 2, "exactly one new create: {attempts:?}");
    let new_key = creates[1].idempotency_key.clone().expect("a key");
    assert_ne!(new_key, "order-new-1", "a NEW key");

    gateway.shutdown().await.expect("shutdown");
    let store = SqliteStore::open_existing(dir.path().join("backstop.db")).expect("store");
    let old = store.action(ActionId(id)).expect("read").expect("old");
    assert_eq!(old.outcome.map(|o| o.as_str()), Some("escalated"));
    let new = store
        .action(ActionId(new_action))
        .expect("read")
        .expect("new");
    assert_eq!(
        upstream_idempotency_key("test-agent", &new.idempotency_key),
        new_key
    );
    assert_eq!(new.outcome.map(|o| o.as_str()), Some("succeeded"));
    assert_eq!(new.task_id, old.task_id);
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restart_retry_same_key_is_409_and_the_agents_same_key_resubmission_is_the_same_action(
) {
    let fake = fake();
    let dir = tempfile::tempdir().expect("tempdir");
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let id = escalated_order(&gateway, "order-restart-1").await;
    gateway.shutdown().await.expect("shutdown");

    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let escalation = escalation_of(&gateway, id).await;
    let (status, problem) = decide(&gateway, escalation, json!({"option": "retry_same_key"})).await;
    assert_eq!(status, 409, "{problem}");
    assert_eq!(problem["type"], "urn:backstop:problem:request_not_held");
    assert_eq!(problem["decision_recorded"], true);
    assert_eq!(problem["decision"], "retry_same_key");
    assert_eq!(problem["escalation"], escalation);
    assert!(problem["decided_at"].is_string(), "{problem}");
    assert_eq!(problem["idempotency_key"], "order-restart-1");
    assert!(
        problem["detail"]
            .as_str()
            .expect("detail")
            .contains("resubmit the same payload with Idempotency-Key `order-restart-1`"),
        "{problem}"
    );
    assert_eq!(
        on_route(&fake.attempts(), "POST", "/v1/orders").len(),
        1,
        "nothing sent by the decision"
    );

    // The agent resubmits the same payload under the same key: sent as the same action.
    let response = client()
        .post(format!("http://{}/fake/v1/orders", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("X-Backstop-Task", "run-orders")
        .header("Idempotency-Key", "order-restart-1")
        .header("content-type", "application/json")
        .body(format!(r#"{{"sku":"A-1","note":"{PAYLOAD_CANARY}"}}"#))
        .send()
        .await
        .expect("resubmission");
    assert_eq!(action_id(&response), id, "the SAME logical action");
    assert_eq!(response.status(), 201);
    let attempts = fake.attempts();
    let creates = on_route(&attempts, "POST", "/v1/orders");
    assert_eq!(creates.len(), 2, "exactly one more create: {attempts:?}");
    // The attempts are counted as the store counts them, from the first one ever sent: the
    // answer, the action view and its context agree with the provider's two creates.
    assert_eq!(response.headers()["backstop-attempts"], "2");
    let (status, view) = support::action_view(&gateway, AGENT_TOKEN, id, None).await;
    assert_eq!(status, 200, "{view}");
    assert_eq!(view["attempts"], 2, "{view}");
    assert_eq!(view["context"]["attempts"], 2, "{view}");
    assert_eq!(
        creates[1].idempotency_key,
        Some(upstream_idempotency_key("test-agent", "order-restart-1"))
    );

    // Once done, the same key replays the stored outcome: no third create.
    let again = client()
        .post(format!("http://{}/fake/v1/orders", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("X-Backstop-Task", "run-orders")
        .header("Idempotency-Key", "order-restart-1")
        .header("content-type", "application/json")
        .body(format!(r#"{{"sku":"A-1","note":"{PAYLOAD_CANARY}"}}"#))
        .send()
        .await
        .expect("replay");
    assert_eq!(action_id(&again), id);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    let (status, body) = json_of(again).await;
    assert_eq!(status, 201, "the provider's stored response: {body}");
    assert_eq!(body["sku"], "A-1", "{body}");
    assert_eq!(on_route(&fake.attempts(), "POST", "/v1/orders").len(), 2);

    gateway.shutdown().await.expect("shutdown");
    let store = SqliteStore::open_existing(dir.path().join("backstop.db")).expect("store");
    let record = store.action(ActionId(id)).expect("read").expect("action");
    assert_eq!(record.outcome.map(|o| o.as_str()), Some("succeeded"));
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restart_send_new_is_409_and_nothing_is_sent() {
    let fake = fake();
    let dir = tempfile::tempdir().expect("tempdir");
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let id = escalated_order(&gateway, "order-restart-2").await;
    gateway.shutdown().await.expect("shutdown");

    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let escalation = escalation_of(&gateway, id).await;
    let (status, problem) = decide(
        &gateway,
        escalation,
        json!({"option": "send_new", "confirm_second_side_effect": true}),
    )
    .await;
    assert_eq!(status, 409, "{problem}");
    assert_eq!(problem["type"], "urn:backstop:problem:request_not_held");
    assert!(problem["idempotency_key"].is_null(), "{problem}");
    assert_eq!(on_route(&fake.attempts(), "POST", "/v1/orders").len(), 1);
    gateway.shutdown().await.expect("shutdown");
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_case_file_has_every_spec_item_and_no_payload_or_credential() {
    let fake = fake();
    let dir = tempfile::tempdir().expect("tempdir");
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let base = format!("http://{}", gateway.addr);
    // Submitted through the action API, with the desired outcome in words.
    let (status, accepted) = support::submit_action(
        &gateway,
        AGENT_TOKEN,
        &json!({
            "provider": "fake",
            "method": "POST",
            "path": "/v1/orders",
            "task": "run-case",
            "deadline": "2099-06-30T12:00:00Z",
            "idempotency_key": "order-case-1",
            "headers": {"content-type": "application/json"},
            "body": format!(r#"{{"sku":"C-3","note":"{PAYLOAD_CANARY}"}}"#),
            "desired_outcome": "order B-2 placed exactly once"
        }),
    )
    .await;
    assert_eq!(status, 202, "{accepted}");
    let id = accepted["id"].as_i64().expect("id");
    let (_, view) = support::action_view(&gateway, AGENT_TOKEN, id, Some("10s")).await;
    assert_eq!(view["outcome"], "escalated", "{view}");
    let escalation = escalation_of(&gateway, id).await;
    let response = client()
        .get(format!("{base}/v1/escalations/{escalation}"))
        .bearer_auth(OPERATOR_TOKEN)
        .send()
        .await
        .expect("show");
    assert_eq!(response.status(), 200);
    let text = response.text().await.expect("text");
    for canary in [
        PAYLOAD_CANARY,
        AGENT_TOKEN,
        OPERATOR_TOKEN,
        PROVIDER_SECRET,
        "C-3",
    ] {
        assert!(!text.contains(canary), "`{canary}` leaked: {text}");
    }
    let shown: Value = serde_json::from_str(&text).expect("json");
    let case = &shown["case_file"];
    // SPEC §8, item by item.
    assert_eq!(
        case["desired_outcome"], "order B-2 placed exactly once",
        "{case:#}"
    );
    assert_eq!(case["action"]["method"], "POST");
    assert_eq!(case["action"]["route"], "/v1/orders");
    assert_eq!(case["action"]["task_id"], "run-case");
    let digest = case["action"]["payload_digest"].as_str().expect("digest");
    assert_eq!(
        digest.len(),
        64,
        "the payload only as its SHA-256: {digest}"
    );
    assert_eq!(case["provider"], "fake");
    assert!(case["endpoint"]
        .as_str()
        .expect("endpoint")
        .contains("/v1/orders"));
    assert_eq!(case["scopes"], json!(["fake/account"]));
    // The fingerprint of SPEC §7 with the route's configured payload field (a hash: the
    // field's value does not appear).
    let fingerprint = backstop_core::breaker::RequestFingerprint::compute(
        "POST",
        "/v1/orders",
        Some(&json!({"sku": "C-3", "note": PAYLOAD_CANARY})),
        &["/sku".to_owned()],
    );
    assert_eq!(case["fingerprint"], fingerprint.as_str(), "{case:#}");
    let attempts = case["attempts"].as_array().expect("attempts");
    assert_eq!(attempts.len(), 1, "{case:#}");
    let attempt = &attempts[0];
    assert_eq!(attempt["n"], 1, "{attempt}");
    assert!(attempt["started_at"].is_string(), "{attempt}");
    assert!(attempt["finished_at"].is_string(), "{attempt}");
    assert_eq!(attempt["disposition"], "uncertain");
    // The provider stored the write and dropped the connection: no status, no signal.
    for field in ["status", "retry_after_raw", "retry_not_before"] {
        assert!(
            attempt.get(field).is_some_and(Value::is_null),
            "attempt `{field}` is present and null (no response): {attempt}"
        );
    }
    assert_eq!(attempt["quota_headers"], json!([]), "{attempt}");
    let budget = &case["budget"];
    assert_eq!(budget["attempts_used"], 1, "{budget}");
    assert_eq!(budget["wait_used_ms"], 0, "nothing was waited: {budget}");
    assert_eq!(budget["deadline"], "2099-06-30T12:00:00Z", "{budget}");
    for field in ["max_attempts", "max_wait_ms"] {
        assert!(
            budget[field].as_u64().is_some_and(|v| v > 0),
            "budget `{field}`: {budget}"
        );
    }
    assert_eq!(case["idempotency_key"], "order-case-1");
    assert_eq!(
        case["upstream_idempotency_key"],
        upstream_idempotency_key("test-agent", "order-case-1"),
        "the key the provider saw: {case:#}"
    );
    assert!(
        case.get("provider_operation_id")
            .is_some_and(Value::is_null),
        "the lookup failed, so no provider id is known: {case:#}"
    );
    assert_eq!(
        case["reconciliation_query"],
        "GET /v1/orders?idempotency_key={key}"
    );
    let options = case["options"].as_array().expect("options");
    let offered: Vec<&str> = options
        .iter()
        .map(|o| o["option"].as_str().expect("option"))
        .collect();
    for option in ["query_status", "retry_same_key", "abort", "send_new"] {
        assert!(
            offered.contains(&option),
            "`{option}` not offered: {offered:?}"
        );
    }
    for option in options {
        assert!(
            !option["risk"].as_str().expect("risk").is_empty(),
            "{option}"
        );
    }
    let send_new = options
        .iter()
        .find(|o| o["option"] == "send_new")
        .expect("send_new");
    assert!(
        send_new["risk"].as_str().expect("risk").contains("second"),
        "send_new states the second side effect: {send_new}"
    );

    // Revealing the payload is refused and audited as its own access decision.
    let (status, problem) = json_of(
        client()
            .post(format!("{base}/v1/escalations/{escalation}/reveal"))
            .bearer_auth(OPERATOR_TOKEN)
            .send()
            .await
            .expect("reveal"),
    )
    .await;
    assert_eq!(status, 404, "{problem}");
    assert_eq!(problem["type"], "urn:backstop:problem:payload_not_stored");
    gateway.shutdown().await.expect("shutdown");
    let store = SqliteStore::open_existing(dir.path().join("backstop.db")).expect("store");
    let events = store.audit_events(0, 10_000).expect("audit");
    let access = events
        .iter()
        .find(|e| e.kind == backstop_store::ACCESS_DECISION)
        .expect("the reveal request is audited");
    assert_eq!(access.escalation, Some(escalation));
    assert_eq!(access.decision.as_deref(), Some("reveal_payload"));
    assert_eq!(access.decided_by.as_deref(), Some("oncall"));
    assert!(
        !events.iter().any(|e| e.kind == "decision"),
        "access is not a decision on the action"
    );
    assert_eq!(store.open_escalations().expect("open").len(), 1);
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_while_in_flight_joins_the_running_action_with_one_create() {
    let fake = fake();
    let dir = tempfile::tempdir().expect("tempdir");
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let url = format!("http://{}/fake/v1/transfers", gateway.addr);
    let send = || {
        client()
            .post(&url)
            .bearer_auth(AGENT_TOKEN)
            .header("X-Backstop-Task", "run-join")
            .header("Idempotency-Key", "transfer-join-1")
            .header("content-type", "application/json")
            .body(r#"{"amount":42}"#)
            .send()
    };
    let first = tokio::spawn(send());
    // The fake holds the first create for 1.5 s after storing it; join while it does.
    let mut polls = 0;
    while on_route(&fake.attempts(), "POST", "/v1/transfers").is_empty() {
        polls += 1;
        assert!(polls < 500, "the first create never arrived");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let second = send().await.expect("second");
    let first = first.await.expect("joined task").expect("first");
    assert_eq!(action_id(&first), action_id(&second), "one logical action");
    let (_, a) = json_of(first).await;
    let (_, b) = json_of(second).await;
    assert_eq!(a["outcome"], "succeeded", "{a}");
    assert_eq!(
        b["outcome"], "succeeded",
        "the join gets the same outcome: {b}"
    );
    let attempts = fake.attempts();
    assert_eq!(
        on_route(&attempts, "POST", "/v1/transfers").len(),
        1,
        "one create: {attempts:?}"
    );
    assert_eq!(on_route(&attempts, "GET", "/v1/transfers").len(), 1);
    gateway.shutdown().await.expect("shutdown");
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_unfinished_in_the_store_but_not_running_after_a_restart_is_409() {
    let fake = fake();
    let dir = tempfile::tempdir().expect("tempdir");
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let url = format!("http://{}/fake/v1/refunds", gateway.addr);
    let send = |prefer: Option<&'static str>| {
        let mut request = client()
            .post(&url)
            .bearer_auth(AGENT_TOKEN)
            .header("X-Backstop-Task", "run-refund")
            .header("Idempotency-Key", "refund-waiting-1")
            .header("content-type", "application/json")
            .body(r#"{"amount":3}"#);
        if let Some(prefer) = prefer {
            request = request.header("prefer", prefer);
        }
        request.send()
    };
    // 503 with Retry-After: 90 → a durable retry in 90 s; the gateway then stops.
    let accepted = send(Some("respond-async")).await.expect("submit");
    assert_eq!(accepted.status(), 202);
    let id = action_id(&accepted);
    // The running gateway holds the store's write lock: watch the action's state over HTTP
    // until its retry is scheduled (`waiting`), then check the durable job after the stop.
    let mut polls = 0;
    loop {
        let (_, view) = support::action_view(&gateway, AGENT_TOKEN, id, None).await;
        if view["state"] == "waiting" {
            break;
        }
        polls += 1;
        assert!(polls < 500, "no retry was scheduled: {view}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    gateway.shutdown().await.expect("shutdown");
    {
        let store = SqliteStore::open_existing(dir.path().join("backstop.db")).expect("store");
        assert_eq!(
            store.scheduled_retries().expect("retries").len(),
            1,
            "the retry is durable"
        );
    }

    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let url2 = format!("http://{}/fake/v1/refunds", gateway.addr);
    let response = client()
        .post(&url2)
        .bearer_auth(AGENT_TOKEN)
        .header("X-Backstop-Task", "run-refund")
        .header("Idempotency-Key", "refund-waiting-1")
        .header("content-type", "application/json")
        .body(r#"{"amount":3}"#)
        .send()
        .await
        .expect("resubmission");
    assert_eq!(response.status(), 409);
    assert_eq!(response.headers()["x-should-retry"], "false");
    let (_, problem) = json_of(response).await;
    assert_eq!(
        problem["type"], "urn:backstop:problem:idempotency_key_in_flight",
        "{problem}"
    );
    assert_eq!(problem["action_id"], id);
    let attempts = fake.attempts();
    assert_eq!(
        on_route(&attempts, "POST", "/v1/refunds").len(),
        1,
        "nothing sent for the refused request: {attempts:?}"
    );
    gateway.shutdown().await.expect("shutdown");
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_carry_no_idempotency_key_in_the_store_or_the_audit_log() {
    let fake = fake();
    let dir = tempfile::tempdir().expect("tempdir");
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let read = || {
        client()
            .get(format!(
                "http://{}/fake/v1/transfers?idempotency_key=none",
                gateway.addr
            ))
            .bearer_auth(AGENT_TOKEN)
            .header("X-Backstop-Task", "run-reads")
            .send()
    };
    let first = read().await.expect("first read");
    assert_eq!(first.status(), 200);
    assert!(first.headers().get("idempotency-key").is_none());
    let second = read().await.expect("second read");
    assert_ne!(
        action_id(&first),
        action_id(&second),
        "each read is its own action"
    );
    let ids = [action_id(&first), action_id(&second)];
    let attempts = fake.attempts();
    let reads = on_route(&attempts, "GET", "/v1/transfers");
    assert_eq!(reads.len(), 2, "{attempts:?}");
    assert!(reads.iter().all(|r| r.idempotency_key.is_none()));
    gateway.shutdown().await.expect("shutdown");
    let store = SqliteStore::open_existing(dir.path().join("backstop.db")).expect("store");
    for id in ids {
        let record = store.action(ActionId(id)).expect("read").expect("action");
        assert_eq!(record.key(), None, "{record:?}");
    }
    let events: Vec<_> = store
        .audit_events(0, 10_000)
        .expect("audit")
        .into_iter()
        .filter(|e| e.action.is_some_and(|a| ids.contains(&a)))
        .collect();
    assert!(!events.is_empty());
    assert!(
        events.iter().all(|e| e.idempotency_key.is_none()),
        "{events:#?}"
    );
    fake.shutdown().await;
}

/// The value of the sample `name` (with its labels, as exposed) on `/metrics`, if listed.
async fn sample(gateway: &Running, name: &str) -> Option<f64> {
    let text = client()
        .get(format!("http://{}/metrics", gateway.addr))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text");
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
        .map(|value| value.trim().parse().expect("a number"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_open_escalations_refusals_and_upstream_attempts() {
    let fake = fake();
    let dir = tempfile::tempdir().expect("tempdir");
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    const OPEN: &str = "backstop_open_escalations";
    const UNAUTHORIZED: &str = r#"backstop_refusals_total{problem="unauthorized"}"#;
    const BAD_HEADER: &str = r#"backstop_refusals_total{problem="bad_header"}"#;
    const UPSTREAM: &str = r#"backstop_upstream_attempt_seconds_count{provider="fake"}"#;
    const UPSTREAM_SUM: &str = r#"backstop_upstream_attempt_seconds_sum{provider="fake"}"#;
    assert_eq!(sample(&gateway, OPEN).await, Some(0.0));
    assert_eq!(sample(&gateway, UNAUTHORIZED).await, None);
    assert_eq!(sample(&gateway, UPSTREAM).await, None);

    // Two refusals at the door, each under its problem type; nothing reaches the provider.
    let url = format!("http://{}/fake/v1/orders", gateway.addr);
    let r = client().post(&url).send().await.expect("no token");
    assert_eq!(r.status(), 401);
    let r = client()
        .post(&url)
        .bearer_auth(AGENT_TOKEN)
        .header("X-Backstop-Priority", "urgent-please")
        .send()
        .await
        .expect("bad header");
    assert_eq!(r.status(), 400);
    assert_eq!(sample(&gateway, UNAUTHORIZED).await, Some(1.0));
    assert_eq!(sample(&gateway, BAD_HEADER).await, Some(1.0));
    assert!(fake.attempts().is_empty());

    // An escalated write: one create sent (its lookup is not an attempt of the action).
    let id = escalated_order(&gateway, "order-metrics-1").await;
    assert_eq!(sample(&gateway, OPEN).await, Some(1.0));
    let creates = || on_route(&fake.attempts(), "POST", "/v1/orders").len() as f64;
    assert_eq!(creates(), 1.0);
    assert_eq!(sample(&gateway, UPSTREAM).await, Some(creates()));
    assert!(sample(&gateway, UPSTREAM_SUM).await.expect("sum") > 0.0);

    // Decided: the escalation closes, and its same-key retry is one more attempt.
    let escalation = escalation_of(&gateway, id).await;
    let (status, answer) = decide(&gateway, escalation, json!({"option": "retry_same_key"})).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(sample(&gateway, OPEN).await, Some(0.0));
    assert_eq!(creates(), 2.0);
    assert_eq!(sample(&gateway, UPSTREAM).await, Some(creates()));
    gateway.shutdown().await.expect("shutdown");
}
