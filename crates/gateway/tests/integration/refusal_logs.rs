//! Every refusal of a request to the proxy door or `POST /v1/actions` is logged at INFO with the
//! agent when it is known, the status, the problem type and the reason — and never a token or a
//! body. Read from the gateway's own log, captured for this test's runtime.

use std::path::Path;

use backstop_fake_api::{Handler, RouteConfig};
use backstop_gateway::server::Running;

use crate::support::{
    self,
    capture::{runtime_logging_into, Capture},
    client, fake_with as fake,
};

const AGENT_TOKEN: &str = "agent-token-refusals-5d1e";
const OPS_TOKEN: &str = "ops-token-refusals-8c2a";
const PROVIDER_SECRET: &str = "sk-live-provider-secret-refusals";
/// A token no agent or operator has.
const UNKNOWN_TOKEN: &str = "unknown-token-refusals-3b9f";
/// A word only the refused bodies carry.
const BODY_MARKER: &str = "body-marker-refusals-77";

async fn start_gateway(base_url: &str, dir: &Path) -> Running {
    let yaml = support::policy_yaml(
        base_url,
        support::TEST_AGENT_AND_ONCALL,
        r#"    routes:
      "GET /v1/items/{id}": { class: read, scopes: [account] }
      "POST /v1/transfers": { class: idempotent_write, scopes: [account] }
"#,
    );
    let env =
        |name: &str| support::agent_oncall_secret(name, AGENT_TOKEN, OPS_TOKEN, PROVIDER_SECRET);
    support::start_gateway(
        &yaml,
        "refusals.yaml",
        &env,
        support::serve_options(dir, 11),
    )
    .await
}

#[test]
fn every_refusal_is_logged_at_info_with_agent_status_type_and_reason_but_no_secret() {
    let logs = Capture::default();
    let runtime = runtime_logging_into(&logs);
    // `block_on` polls the test's future on this thread.
    logs.attach();
    runtime.block_on(refusals_are_logged(&logs));
    Capture::detach();
}

async fn refusals_are_logged(logs: &Capture) {
    let fake = fake(vec![
        RouteConfig::new("GET /v1/items/{id}", Handler::default()),
        RouteConfig::new("POST /v1/transfers", support::create("transfers", "tr_"))
            .with_idempotency(),
    ]);
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let base = format!("http://{}", gateway.addr);
    let send = |method: &str, path: &str, token: &str, headers: &[(&str, &str)], body: String| {
        let mut request = client()
            .request(method.parse().unwrap(), format!("{base}{path}"))
            .bearer_auth(token)
            .body(body);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        async move { request.send().await.expect("request").status().as_u16() }
    };
    let marked = |amount: u32| format!(r#"{{"amount":{amount},"note":"{BODY_MARKER}"}}"#);

    // (what, status, problem type, a word of the reason, whether the agent is known)
    let mut expected = Vec::new();
    for (header, value) in [
        ("X-Backstop-Task", "bad task"),
        ("X-Backstop-Priority", "urgent"),
        ("X-Backstop-Deadline", "tomorrow"),
    ] {
        let status = send(
            "GET",
            "/fake/v1/items/1",
            AGENT_TOKEN,
            &[(header, value)],
            String::new(),
        )
        .await;
        assert_eq!(status, 400, "{header}");
        expected.push((header, 400, "bad_header", header, true));
    }
    let status = send("GET", "/nope/v1/x", AGENT_TOKEN, &[], String::new()).await;
    assert_eq!(status, 404);
    expected.push(("unknown provider", 404, "unknown_provider", "nope", true));
    let status = send("GET", "/fake/v1/items/1", OPS_TOKEN, &[], String::new()).await;
    assert_eq!(status, 403);
    expected.push(("operator token", 403, "forbidden", "oncall", false));
    let status = send(
        "GET",
        "/fake/v1/items/a%2Fb",
        AGENT_TOKEN,
        &[],
        String::new(),
    )
    .await;
    assert_eq!(status, 400);
    expected.push(("encoded slash", 400, "bad_request", "%2F", true));
    let key = [
        ("Idempotency-Key", "refusal-key-1"),
        ("content-type", "application/json"),
    ];
    let status = send("POST", "/fake/v1/transfers", AGENT_TOKEN, &key, marked(1)).await;
    assert_eq!(status, 201);
    let status = send("POST", "/fake/v1/transfers", AGENT_TOKEN, &key, marked(2)).await;
    assert_eq!(status, 422);
    expected.push((
        "reused key",
        422,
        "idempotency_key_reused",
        "request body",
        true,
    ));
    let json = [("content-type", "application/json")];
    let status = send(
        "POST",
        "/v1/actions",
        AGENT_TOKEN,
        &json,
        format!("not json {BODY_MARKER}"),
    )
    .await;
    assert_eq!(status, 400);
    expected.push(("action API body", 400, "bad_request", "body", true));
    let unknown = r#"{"provider":"nope","method":"GET","path":"/v1/x"}"#.to_owned();
    let status = send("POST", "/v1/actions", AGENT_TOKEN, &json, unknown).await;
    assert_eq!(status, 404);
    expected.push(("action API provider", 404, "unknown_provider", "nope", true));
    // A submission naming a cancelled task: not accepted (410), logged with its task.
    let status = send(
        "GET",
        "/fake/v1/items/2",
        AGENT_TOKEN,
        &[("X-Backstop-Task", "run-gone")],
        String::new(),
    )
    .await;
    assert_eq!(status, 200);
    let status = send(
        "POST",
        "/v1/tasks/run-gone/cancel",
        AGENT_TOKEN,
        &[],
        String::new(),
    )
    .await;
    assert_eq!(status, 200);
    let gone = r#"{"provider":"fake","method":"GET","path":"/v1/items/3","task":"run-gone"}"#;
    let status = send("POST", "/v1/actions", AGENT_TOKEN, &json, gone.to_owned()).await;
    assert_eq!(status, 410);
    // An empty bearer token and one no agent has: the reason reads intact, the token never.
    let status = send("GET", "/fake/v1/items/1", "", &[], String::new()).await;
    assert_eq!(status, 401);
    let status = send("GET", "/fake/v1/items/1", UNKNOWN_TOKEN, &[], String::new()).await;
    assert_eq!(status, 401);
    let sent = fake.attempts().len();
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;

    let refusals: Vec<String> = logs
        .lines_at("INFO")
        .into_iter()
        .filter(|line| line.contains("refused: nothing was sent"))
        .collect();
    for (what, status, problem, word, agent_known) in expected {
        let found = refusals.iter().any(|line| {
            line.contains(&format!("status={status}"))
                && line.contains(&format!("problem={problem}"))
                && line.contains(word)
                && line.contains("test-agent") == agent_known
        });
        assert!(
            found,
            "no INFO line for the {what} refusal in {refusals:#?}"
        );
    }
    for reason in [
        "the bearer token is empty: the Authorization header is `Bearer` with no token after it (is the variable holding the backstop token unset or empty?)",
        "the bearer token matches no agent or operator of the policy",
    ] {
        assert!(
            refusals
                .iter()
                .any(|line| line.contains("status=401") && line.contains(reason)),
            "no INFO line with the reason `{reason}` in {refusals:#?}"
        );
    }
    let not_accepted: Vec<String> = logs
        .lines_at("INFO")
        .into_iter()
        .filter(|line| line.contains("door: action not accepted"))
        .collect();
    assert!(
        not_accepted
            .iter()
            .any(|line| line.contains("task=run-gone")
                && line.contains("outcome=cancelled")
                && line.contains("test-agent")),
        "{not_accepted:#?}"
    );
    assert_eq!(sent, 2, "only the first transfer and the read were sent");
    let text = logs.text();
    for secret in [
        AGENT_TOKEN,
        OPS_TOKEN,
        PROVIDER_SECRET,
        BODY_MARKER,
        UNKNOWN_TOKEN,
    ] {
        assert!(!text.contains(secret), "`{secret}` is in the log");
    }
}

#[test]
fn refusals_of_the_action_view_task_cancel_and_escalations_are_logged_on_the_same_line() {
    let logs = Capture::default();
    let runtime = runtime_logging_into(&logs);
    logs.attach();
    runtime.block_on(api_refusals_are_logged(&logs));
    Capture::detach();
}

async fn api_refusals_are_logged(logs: &Capture) {
    let fake = fake(vec![RouteConfig::new(
        "GET /v1/items/{id}",
        Handler::default(),
    )]);
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_gateway(&fake.url(), dir.path()).await;
    let base = format!("http://{}", gateway.addr);
    let send = |method: &str, path: &str, token: Option<&str>| {
        let mut request = client().request(method.parse().unwrap(), format!("{base}{path}"));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        async move { request.send().await.expect("request").status().as_u16() }
    };

    // (what, the route logged as `at`, status, problem type, the caller's field and name)
    let mut expected = Vec::new();
    let mut refused = |what, at, status, problem, who| {
        expected.push((what, at, status, problem, who));
    };
    assert_eq!(send("GET", "/v1/actions/999", Some(AGENT_TOKEN)).await, 404);
    refused(
        "unknown action",
        "GET /v1/actions/{id}",
        404,
        "action_not_found",
        Some(("agent", "test-agent")),
    );
    assert_eq!(send("GET", "/v1/actions/1", None).await, 401);
    refused(
        "action view without a token",
        "GET /v1/actions/{id}",
        401,
        "unauthorized",
        None,
    );
    assert_eq!(
        send("POST", "/v1/tasks/run-unknown/cancel", Some(OPS_TOKEN)).await,
        404
    );
    refused(
        "unknown task",
        "POST /v1/tasks/{id}/cancel",
        404,
        "task_not_found",
        Some(("operator", "oncall")),
    );
    assert_eq!(send("GET", "/v1/escalations", None).await, 401);
    refused(
        "escalations without a token",
        "GET /v1/escalations",
        401,
        "unauthorized",
        None,
    );
    assert_eq!(
        send("GET", "/v1/escalations/42", Some(OPS_TOKEN)).await,
        404
    );
    refused(
        "unknown escalation",
        "GET /v1/escalations/{id}",
        404,
        "escalation_not_found",
        Some(("operator", "oncall")),
    );
    assert_eq!(
        send("GET", "/v1/escalations/42", Some(AGENT_TOKEN)).await,
        403
    );
    refused(
        "agent token on escalations",
        "GET /v1/escalations/{id}",
        403,
        "forbidden",
        Some(("agent", "test-agent")),
    );
    gateway.shutdown().await.unwrap();
    fake.shutdown().await;

    let refusals: Vec<String> = logs
        .lines_at("INFO")
        .into_iter()
        .filter(|line| line.contains("refused: nothing was sent"))
        .collect();
    for (what, at, status, problem, who) in expected {
        let found = refusals.iter().any(|line| {
            line.contains(at)
                && line.contains(&format!("status={status}"))
                && line.contains(&format!("problem={problem}"))
                && match who {
                    Some((field, name)) => {
                        line.contains(&format!("{field}=")) && line.contains(name)
                    }
                    None => !line.contains("agent=") && !line.contains("operator="),
                }
        });
        assert!(
            found,
            "no INFO line for the {what} refusal in {refusals:#?}"
        );
    }
    let text = logs.text();
    for secret in [AGENT_TOKEN, OPS_TOKEN, PROVIDER_SECRET] {
        assert!(!text.contains(secret), "`{secret}` is in the log");
    }
}
