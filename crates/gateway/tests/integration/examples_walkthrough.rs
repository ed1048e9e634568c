//! The README's "Try it on one machine" (and the `insufficient_quota` case of
//! docs/escalations.md): `examples/backstop-fake.yaml` in front of the bundled fake provider
//! configured by `examples/fake-api.yaml`, both read from the repository as shipped (only the
//! fake's address, the store and the listener are this test's own).

use backstop_fake_api::FakeConfig;

use crate::support::{self, client, json_of, on_route};

const AGENT_TOKEN: &str = "local-agent-token";

fn example(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples")
        .join(name)
}

fn env(name: &str) -> Option<String> {
    match name {
        "BACKSTOP_TOKEN" => Some(AGENT_TOKEN.to_owned()),
        "FAKE_API_KEY" => Some("local-provider-key".to_owned()),
        _ => None,
    }
}

/// The fake's chat route answers its first call `429` with the body code `insufficient_quota`
/// (a billing limit). The example policy reads that code through its `error_code_pointer`, so
/// the call is `quota_exhausted` at once — one attempt, never retried as a short rate limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fakes_insufficient_quota_is_quota_exhausted_not_a_retried_rate_limit() {
    let fake_config = FakeConfig::from_yaml_file(&example("fake-api.yaml")).expect("fake config");
    let fake = support::start_fake(fake_config);
    let policy = std::fs::read_to_string(example("backstop-fake.yaml")).expect("policy");
    assert!(policy.contains("base_url: http://127.0.0.1:8081\n"));
    let policy = policy.replace(
        "base_url: http://127.0.0.1:8081\n",
        &format!("base_url: {}\n", fake.url()),
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let gateway = support::start_gateway(
        &policy,
        "examples/backstop-fake.yaml",
        &env,
        support::serve_options(dir.path(), 42),
    )
    .await;

    let response = client()
        .post(format!("http://{}/fake/v1/chat/completions", gateway.addr))
        .bearer_auth(AGENT_TOKEN)
        .header("X-Backstop-Task", "run-42")
        .header("content-type", "application/json")
        .body(r#"{"model":"fake-1","stream":false,"messages":[{"role":"user","content":"hi"}]}"#)
        .send()
        .await
        .expect("chat call");
    assert_eq!(response.headers()["backstop-attempts"], "1");
    // The provider's own 429 is kept, with `x-should-retry: false`: the SDK does not send it
    // again, and its exception reads backstop's reason.
    assert_eq!(response.headers()["x-should-retry"], "false");
    let (status, problem) = json_of(response).await;
    assert_eq!(status, 429, "{problem}");
    assert_eq!(problem["outcome"], "quota_exhausted", "{problem}");
    assert_eq!(problem["error"]["code"], "quota_exhausted", "{problem}");
    assert_eq!(problem["error"]["type"], "rate_limit_error", "{problem}");
    assert_eq!(problem["error"]["message"], problem["detail"], "{problem}");
    assert_eq!(problem["last_status"], 429, "{problem}");
    assert_eq!(problem["last_signal"], "quota_exhausted", "{problem}");
    assert_eq!(
        on_route(&fake.attempts(), "POST", "/v1/chat/completions").len(),
        1,
        "sent once, not retried"
    );
    gateway.shutdown().await.expect("shutdown");
    fake.shutdown().await;
}
