//! Reconciliation by external reference when two actions carry the same reference, over
//! loopback and measured at the fake provider: a lookup that finds "a" write under a reference
//! another action of the provider also recorded proves nothing about this write. The write is
//! escalated (`side_effect_unknown`), nothing is resent, and the other write's provider id is
//! handed out neither to the agent nor to an operator's `query_status`. A reference no other
//! action shares still reconciles `succeeded`.

use std::path::Path;

use backstop_fake_api::{FakeConfig, Fault, FaultRule, Handler, RouteConfig};
use backstop_gateway::server::Running;
use backstop_store::{ActionId, SqliteStore, Store};
use serde_json::{json, Value};

use crate::support::{self, action_id, client, json_of, lookup, on_route};

const ALPHA_TOKEN: &str = "agent-token-shared-ref-alpha";
const BETA_TOKEN: &str = "agent-token-shared-ref-beta";
const OPERATOR_TOKEN: &str = "operator-token-shared-ref";

fn policy_yaml(base_url: &str) -> String {
    support::policy_yaml(
        base_url,
        r#"agents:
  alpha-agent: { token_env: ALPHA_TOKEN }
  beta-agent: { token_env: BETA_TOKEN }
operators:
  oncall: { token_env: OPS_TOKEN }
"#,
        r#"    routes:
      "POST /v1/tx2":
        class: idempotent_write
        scopes: [account]
        reconcile:
          by: external_reference
          lookup: "GET /v1/tx2?reference={ref}"
          external_reference_pointer: /reference
          found_pointer: /data/0/id
      "GET /v1/tx2": { class: read, scopes: [account] }
"#,
    )
}

fn env(name: &str) -> Option<String> {
    match name {
        "ALPHA_TOKEN" => Some(ALPHA_TOKEN.to_owned()),
        "BETA_TOKEN" => Some(BETA_TOKEN.to_owned()),
        "OPS_TOKEN" => Some(OPERATOR_TOKEN.to_owned()),
        "FAKE_API_KEY" => Some("sk-fake-shared-ref".to_owned()),
        _ => None,
    }
}

async fn start_gateway(base_url: &str, dir: &Path) -> Running {
    let options = support::serve_options(dir, 31);
    support::start_gateway(&policy_yaml(base_url), "shared-ref.yaml", &env, options).await
}

/// The provider's creates keep the payload's `reference`; `fault` is applied to the creates.
fn fake(fault: FaultRule) -> backstop_fake_api::RunningFake {
    fake_with([fault])
}

/// [`fake`] with every fault of `faults` applied to the creates.
fn fake_with(faults: impl IntoIterator<Item = FaultRule>) -> backstop_fake_api::RunningFake {
    let creates = RouteConfig::new(
        "POST /v1/tx2",
        Handler::Create {
            collection: "tx2".into(),
            id_prefix: "tx_".into(),
            reference_field: Some("reference".into()),
            unique_reference: false,
        },
    )
    .with_idempotency();
    let creates = faults
        .into_iter()
        .fold(creates, |route, fault| route.with_fault(fault));
    let config = FakeConfig::default()
        .with_route(creates)
        .with_route(RouteConfig::new("GET /v1/tx2", lookup("tx2")));
    support::start_fake(config)
}

async fn post(gateway: &Running, token: &str, key: &str, body: &str) -> (i64, u16, Value) {
    let response = client()
        .post(format!("http://{}/fake/v1/tx2", gateway.addr))
        .bearer_auth(token)
        .header("Idempotency-Key", key)
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .expect("request");
    let id = action_id(&response);
    let (status, body) = json_of(response).await;
    (id, status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_found_only_under_a_reference_another_action_shares_is_escalated_not_reconciled() {
    // The second create is dropped before the provider does anything: it never happened.
    let fake = fake(FaultRule::on_calls([2], Fault::Drop));
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;

    let (first, status, answer) = post(
        &gateway,
        ALPHA_TOKEN,
        "alpha-1",
        r#"{"amount":5,"reference":"shared-ref-1"}"#,
    )
    .await;
    assert_eq!(status, 201, "{answer}");
    let other_id = answer["id"].as_str().expect("the provider's id").to_owned();
    assert!(other_id.starts_with("tx_"), "{answer}");

    let (second, _, answer) = post(
        &gateway,
        BETA_TOKEN,
        "beta-1",
        r#"{"amount":7,"reference":"shared-ref-1"}"#,
    )
    .await;
    assert_eq!(answer["outcome"], "escalated", "{answer}");
    assert!(
        !answer.to_string().contains(&other_id),
        "the other write's id is not handed out: {answer}"
    );
    let attempts = fake.attempts();
    assert_eq!(
        on_route(&attempts, "POST", "/v1/tx2").len(),
        2,
        "{attempts:?}"
    );
    let lookups = on_route(&attempts, "GET", "/v1/tx2");
    assert_eq!(lookups.len(), 1, "{attempts:?}");
    assert_eq!(lookups[0].query.as_deref(), Some("reference=shared-ref-1"));

    // The operator asks again: still ambiguous, still escalated, the id still not handed out.
    let open = support::open_escalations(&gateway, OPERATOR_TOKEN).await;
    let escalation = open
        .iter()
        .find(|e| e["action"] == second)
        .and_then(|e| e["id"].as_i64())
        .expect("an open escalation");
    let (status, decided) = support::decide(
        &gateway,
        OPERATOR_TOKEN,
        escalation,
        json!({ "option": "query_status" }),
    )
    .await;
    assert_eq!(status, 200, "{decided}");
    assert_eq!(decided["lookup"]["verdict"], "inconclusive", "{decided}");
    assert!(
        !decided.to_string().contains(&other_id),
        "the other write's id is not handed out: {decided}"
    );
    assert_eq!(
        support::open_escalations(&gateway, OPERATOR_TOKEN)
            .await
            .len(),
        1
    );
    let attempts = fake.attempts();
    assert_eq!(
        on_route(&attempts, "POST", "/v1/tx2").len(),
        2,
        "nothing resent: {attempts:?}"
    );
    assert_eq!(on_route(&attempts, "GET", "/v1/tx2").len(), 2);

    gateway.shutdown().await.unwrap();
    let store = SqliteStore::open_existing(dir.path().join("backstop.db")).expect("store");
    let record = store.action(ActionId(second)).unwrap().expect("action");
    assert_eq!(record.outcome.map(|o| o.as_str()), Some("escalated"));
    assert_eq!(record.provider_operation_id, None);
    let open = store.open_escalations().unwrap();
    let case = &open
        .iter()
        .find(|e| e.action.0 == second)
        .expect("escalation of the second write")
        .case_file;
    assert_eq!(case["reason"], "side_effect_unknown", "{case}");
    let detail = case["reason_detail"].as_str().expect("detail");
    assert!(
        detail.contains(&format!("action {first} of provider `fake`")),
        "{detail}"
    );
    let text = case.to_string();
    assert!(!text.contains(&other_id), "{text}");
    assert!(!text.contains("alpha-agent"), "{text}");
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_found_under_a_reference_no_other_action_shares_is_reconciled() {
    // The first create is stored, then its connection dropped: it happened.
    let fake = fake(FaultRule::on_calls(
        [1],
        Fault::StoreThenDrop { hold_ms: 0 },
    ));
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let (id, _, answer) = post(
        &gateway,
        ALPHA_TOKEN,
        "alpha-solo",
        r#"{"amount":5,"reference":"solo-ref-1"}"#,
    )
    .await;
    assert_eq!(answer["outcome"], "succeeded", "{answer}");
    let attempts = fake.attempts();
    assert_eq!(
        on_route(&attempts, "POST", "/v1/tx2").len(),
        1,
        "{attempts:?}"
    );
    assert_eq!(
        on_route(&attempts, "GET", "/v1/tx2").len(),
        1,
        "{attempts:?}"
    );
    gateway.shutdown().await.unwrap();
    let store = SqliteStore::open_existing(dir.path().join("backstop.db")).expect("store");
    let record = store.action(ActionId(id)).unwrap().expect("action");
    assert!(record
        .provider_operation_id
        .is_some_and(|op| op.starts_with("tx_")));
    fake.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_external_reference_is_replaced_and_never_looked_up_as_an_empty_filter() {
    // The first create is dropped before the provider does anything. An earlier write is
    // stored, so a lookup with an empty filter (`?reference=`, "every record" to many list
    // APIs) would have something to "find".
    let fake = fake(FaultRule::on_calls([2], Fault::Drop));
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let (_, status, answer) = post(
        &gateway,
        ALPHA_TOKEN,
        "alpha-earlier",
        r#"{"amount":1,"reference":"earlier-ref"}"#,
    )
    .await;
    assert_eq!(status, 201, "{answer}");

    let (_, status, answer) = post(
        &gateway,
        ALPHA_TOKEN,
        "alpha-empty-ref",
        r#"{"amount":2,"reference":""}"#,
    )
    .await;
    let attempts = fake.attempts();
    let lookups = on_route(&attempts, "GET", "/v1/tx2");
    assert_eq!(lookups.len(), 1, "{attempts:?}");
    let query = lookups[0].query.as_deref().unwrap_or("");
    assert!(
        query.starts_with("reference=bk-") && query.len() > "reference=bk-".len(),
        "the lookup asks for the reference backstop wrote, not for an empty one: {query}"
    );
    // Not found under its own reference, and the provider honours the key: sent again under it.
    assert_eq!(status, 201, "{answer}");
    assert_eq!(answer["reference"], query["reference=".len()..], "{answer}");
    let creates = on_route(&attempts, "POST", "/v1/tx2");
    assert_eq!(creates.len(), 3, "{attempts:?}");
    assert_eq!(creates[1].idempotency_key, creates[2].idempotency_key);

    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}

/// An earlier action that provably created nothing (the provider rejected its only attempt)
/// does not make a lookup under the same reference ambiguous: the agent's second write under a
/// new key, whose create the provider committed and then dropped, is reconciled `succeeded`
/// from the lookup — no human is asked, nothing is sent twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reference_shared_only_with_a_write_that_created_nothing_still_reconciles() {
    let fake = fake_with([
        FaultRule::on_calls(
            [1],
            Fault::Status {
                status: 422,
                retry_after: None,
                body: None,
            },
        ),
        FaultRule::on_calls([2], Fault::StoreThenDrop { hold_ms: 0 }),
    ]);
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;

    let body = r#"{"amount":9,"reference":"shared-ref-3"}"#;
    let (first, status, answer) = post(&gateway, ALPHA_TOKEN, "alpha-3", body).await;
    assert_eq!(status, 422, "{answer}");
    let (second, status, answer) = post(&gateway, ALPHA_TOKEN, "alpha-3-again", body).await;
    assert_ne!(first, second);
    assert_eq!(status, 200, "reconciled from the lookup: {answer}");
    let attempts = fake.attempts();
    assert_eq!(
        on_route(&attempts, "POST", "/v1/tx2").len(),
        2,
        "{attempts:?}"
    );
    assert_eq!(
        on_route(&attempts, "GET", "/v1/tx2").len(),
        1,
        "{attempts:?}"
    );
    assert!(
        support::open_escalations(&gateway, OPERATOR_TOKEN)
            .await
            .is_empty(),
        "no human is asked"
    );
    gateway.shutdown().await.unwrap();
    let store = SqliteStore::open_existing(dir.path().join("backstop.db")).expect("store");
    let record = store.action(ActionId(second)).unwrap().expect("action");
    assert_eq!(record.outcome.map(|o| o.as_str()), Some("succeeded"));
    assert!(record
        .provider_operation_id
        .is_some_and(|id| id.starts_with("tx_")));
    fake.shutdown().await;
}
