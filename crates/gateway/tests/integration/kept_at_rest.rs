//! What a write leaves at rest while it is unfinished (SPEC §6), read from the store file over
//! loopback: its request without credentials — and nothing at all when the request carries a
//! secret the gateway holds in its URL or in a header other than the provider's credential.

use std::path::Path;

use backstop_fake_api::{FakeConfig, Fault, FaultRule, RouteConfig};
use backstop_gateway::server::Running;

use crate::support::{self, client, create, TEST_AGENT_AND_ONCALL};

const AGENT_TOKEN: &str = "agent-token-at-rest-4411";
const OPERATOR_TOKEN: &str = "operator-token-at-rest-8822";
const PROVIDER_KEY: &str = "providerkey-at-rest-1357";

fn env(name: &str) -> Option<String> {
    support::agent_oncall_secret(name, AGENT_TOKEN, OPERATOR_TOKEN, PROVIDER_KEY)
}

async fn start_gateway(base_url: &str, dir: &Path) -> Running {
    let yaml = support::policy_yaml(
        base_url,
        &format!("request_classes:\n  idempotent_write: {{ max_attempts: 3, max_wait_seconds: 120, retry_statuses: [429] }}\n{TEST_AGENT_AND_ONCALL}"),
        "    routes:\n      \"POST /v1/orders\": { class: idempotent_write, scopes: [account] }\n",
    );
    support::start_gateway(&yaml, "at-rest.yaml", &env, support::serve_options(dir, 71)).await
}

/// The kept rows (action id, url, headers as stored) of the store file in `dir`.
fn kept_rows(dir: &Path) -> Vec<(i64, String, String)> {
    let conn = rusqlite::Connection::open_with_flags(
        dir.join("backstop.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )
    .expect("read the store");
    let mut stmt = conn
        .prepare("SELECT action_id, url, headers FROM kept_requests ORDER BY action_id")
        .expect("query");
    stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .expect("rows")
        .map(|r| r.expect("row"))
        .collect()
}

async fn submit(gateway: &Running, key: &str, extra: Option<(&str, &str)>, query: &str) -> i64 {
    let mut request = client()
        .post(format!("http://{}/fake/v1/orders{query}", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("Idempotency-Key", key)
        .header("Prefer", "respond-async")
        .header("content-type", "application/json")
        .header("x-request-note", "kept");
    if let Some((name, value)) = extra {
        request = request.header(name, value);
    }
    let response = request
        .body(r#"{"sku":"A-1"}"#)
        .send()
        .await
        .expect("submit");
    assert_eq!(response.status(), 202);
    support::action_id(&response)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfinished_write_keeps_its_request_without_credentials_and_nothing_that_holds_a_secret()
{
    // Every create is throttled for a while: the writes stay unfinished.
    let fake = support::start_fake(FakeConfig::default().with_route(
        RouteConfig::new("POST /v1/orders", create("orders", "or_")).with_fault(
            FaultRule::with_probability(
                1.0,
                Fault::Status {
                    status: 429,
                    retry_after: Some("30".into()),
                    body: None,
                },
            ),
        ),
    ));
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;

    let plain = submit(&gateway, "plain-1", None, "").await;
    let in_header = submit(&gateway, "hdr-1", Some(("x-copied-key", PROVIDER_KEY)), "").await;
    let in_query = submit(&gateway, "qry-1", None, &format!("?tok={AGENT_TOKEN}")).await;
    // A `202` is answered once the write is recorded, its request kept with it; the creates'
    // 429s hold the scope, so all three stay unfinished.
    let rows = kept_rows(dir.path());
    let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
    assert_eq!(
        ids,
        vec![plain],
        "only the write without a held secret is kept: {rows:?}"
    );
    assert!(!ids.contains(&in_header) && !ids.contains(&in_query));
    let (_, url, headers) = &rows[0];
    assert!(url.ends_with("/v1/orders"), "{url}");
    assert!(headers.contains("x-request-note"), "{headers}");
    for secret in [PROVIDER_KEY, AGENT_TOKEN, "authorization"] {
        assert!(
            !headers.to_lowercase().contains(&secret.to_lowercase()),
            "{secret} in {headers}"
        );
        assert!(!url.contains(secret), "{secret} in {url}");
    }
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;
}
