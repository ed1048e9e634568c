//! The action API, `Prefer: respond-async`, task cancellation over HTTP and agent isolation,
//! end to end over real sockets; attempts are counted at the fake provider.

use std::{path::Path, time::Duration};

use backstop_core::{policy::Policy, reconcile::upstream_idempotency_key};
use backstop_fake_api::{Fault, Handler, RouteConfig};
use backstop_gateway::server::{Running, ServeOptions};
use serde_json::{json, Value};

use crate::support::{self, client, fake_with as fake};

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

/// Serve options with the store at `dir/b.db` and a 1 s shutdown grace.
fn options(dir: &Path) -> ServeOptions {
    ServeOptions {
        store: Some(dir.join("b.db")),
        shutdown_grace: Duration::from_secs(1),
        ..support::serve_options(dir, 3)
    }
}

async fn gateway(base_url: &str, dir: &Path) -> Running {
    support::start_gateway(&policy_yaml(base_url), "a.yaml", &env, options(dir)).await
}

/// `POST /v1/tasks/{task}/cancel` at `base` for `token`.
async fn cancel_task(base: &str, task: &str, token: &str) -> reqwest::Response {
    client()
        .post(format!("{base}/v1/tasks/{task}/cancel"))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
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
    let (provider, gw) = transfers_gateway(dir.path()).await;
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
    // Wait for the first attempt (503, retry scheduled 2 s later) and its durable retry: the
    // provider seeing the request is not enough, the 503 may still be on its way back.
    for _ in 0..100 {
        let (_, view) = get_json(format!("{base}/v1/actions/{id}"), AGENT).await;
        if view["state"] == "waiting" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(provider.attempts().len(), 1);
    // Another agent cannot cancel it (404), the owner can.
    let r = cancel_task(&base, "run-cancel", OTHER).await;
    assert_eq!(r.status(), 404);
    let r = cancel_task(&base, "run-cancel", AGENT).await;
    assert_eq!(r.status(), 200);
    let report: Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
    assert_eq!(report["task_id"], "run-cancel");
    // The delayed action was taken out of the scheduler's queue before its wake, its durable
    // retry dropped and the action ended by the cancellation.
    assert_eq!(report["waiting_dropped"], 1, "{report}");
    assert_eq!(report["retries_dropped"], 1, "{report}");
    assert_eq!(report["actions_cancelled"], 1, "{report}");
    // Past the wake: nothing more reached the provider.
    tokio::time::sleep(Duration::from_millis(2600)).await;
    assert_eq!(provider.attempts().len(), 1, "no attempt after the cancel");
    let (_, body) = get_json(format!("{base}/v1/actions/{id}"), AGENT).await;
    assert_eq!(body["outcome"], "cancelled", "{body}");
    gw.shutdown().await.unwrap();
}

/// A write waiting on a durable retry is counted like a read: taken out of the queue, its
/// retry job dropped, and the action ended by the cancellation — and it never sends again.
#[tokio::test]
async fn cancelling_a_write_waiting_on_a_durable_retry_reports_all_three_counts() {
    let dir = tempfile::tempdir().unwrap();
    let provider = fake(vec![RouteConfig::new(
        "POST /v1/transfers",
        support::create("transfers", "tr_"),
    )
    .with_idempotency()
    .with_script([Fault::Status {
        status: 503,
        retry_after: Some("2".into()),
        body: None,
    }])]);
    let gw = gateway(&provider.url(), dir.path()).await;
    let base = format!("http://{}", gw.addr);
    let (status, body) = post_action(
        &base,
        json!({
            "provider": "fake", "method": "POST", "path": "/v1/transfers",
            "task": "run-cancel-write", "idempotency_key": "transfer-cancel-1",
            "headers": {"content-type": "application/json"}, "body": "{\"amount\":3}"
        })
        .to_string(),
        None,
    )
    .await;
    assert_eq!(status, 202);
    let id = body["id"].as_i64().unwrap();
    // Wait for the first attempt (503, retry scheduled 2 s later) and its durable retry.
    for _ in 0..100 {
        let (_, view) = get_json(format!("{base}/v1/actions/{id}"), AGENT).await;
        if view["state"] == "waiting" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(provider.attempts().len(), 1);
    let r = cancel_task(&base, "run-cancel-write", AGENT).await;
    assert_eq!(r.status(), 200);
    let report: Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
    assert_eq!(
        (
            &report["actions_cancelled"],
            &report["retries_dropped"],
            &report["waiting_dropped"]
        ),
        (&json!(1), &json!(1), &json!(1)),
        "{report}"
    );
    // Cancelled again: nothing is left to cancel or drop.
    let r = cancel_task(&base, "run-cancel-write", AGENT).await;
    assert_eq!(r.status(), 200);
    let again: Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
    assert_eq!(
        (
            &again["actions_cancelled"],
            &again["retries_dropped"],
            &again["waiting_dropped"]
        ),
        (&json!(0), &json!(0), &json!(0)),
        "{again}"
    );
    // Past the wake: nothing more reached the provider.
    tokio::time::sleep(Duration::from_millis(2600)).await;
    assert_eq!(provider.attempts().len(), 1, "no attempt after the cancel");
    let (_, view) = get_json(format!("{base}/v1/actions/{id}"), AGENT).await;
    assert_eq!(view["outcome"], "cancelled", "{view}");
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
async fn an_agents_idempotency_key_on_a_read_never_reaches_the_provider() {
    let dir = tempfile::tempdir().unwrap();
    let provider = fake(vec![RouteConfig::new(
        "GET /v1/items/{id}",
        Handler::default(),
    )]);
    let gw = gateway(&provider.url(), dir.path()).await;
    let base = format!("http://{}", gw.addr);

    // The proxy door.
    let r = client()
        .get(format!("{base}/fake/v1/items/1"))
        .bearer_auth(AGENT)
        .header("idempotency-key", "read-key-1")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        r.headers().get("idempotency-key").is_none(),
        "reads carry no key"
    );

    // The action API: the key as this request's header, as the `idempotency_key` member, and
    // under the provider's key header inside `headers`.
    let submissions = [
        (
            json!({"provider": "fake", "method": "GET", "path": "/v1/items/2"}),
            Some("read-key-2"),
        ),
        (
            json!({"provider": "fake", "method": "GET", "path": "/v1/items/3",
                   "idempotency_key": "read-key-3"}),
            None,
        ),
        (
            json!({"provider": "fake", "method": "GET", "path": "/v1/items/4",
                   "headers": {"Idempotency-Key": "read-key-4"}}),
            None,
        ),
    ];
    for (body, key_header) in submissions {
        let (status, accepted) = post_action(&base, body.to_string(), key_header).await;
        assert_eq!(status, 202, "{accepted}");
        let id = accepted["id"].as_i64().expect("id");
        let (_, view) = get_json(format!("{base}/v1/actions/{id}?wait=10s"), AGENT).await;
        assert_eq!(view["outcome"], "succeeded", "{view}");
    }

    let attempts = provider.attempts();
    assert_eq!(attempts.len(), 4, "{attempts:?}");
    assert!(
        attempts.iter().all(|a| a.idempotency_key.is_none()),
        "the provider sees no idempotency key on a read: {attempts:?}"
    );
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
    let (provider, gw) = transfers_gateway(dir.path()).await;
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

/// The fake provider with a create route that counts every attempt, and a gateway before it.
async fn transfers_gateway(dir: &Path) -> (backstop_fake_api::RunningFake, Running) {
    let provider = fake(vec![RouteConfig::new(
        "POST /v1/transfers",
        support::create("transfers", "tr_"),
    )
    .with_idempotency()]);
    let gw = gateway(&provider.url(), dir).await;
    (provider, gw)
}

async fn post_action(base: &str, body: String, key_header: Option<&str>) -> (u16, Value) {
    let mut request = client()
        .post(format!("{base}/v1/actions"))
        .bearer_auth(AGENT)
        .header("content-type", "application/json")
        .body(body);
    if let Some(key) = key_header {
        request = request.header("idempotency-key", key);
    }
    support::json_of(request.send().await.unwrap()).await
}

#[tokio::test]
async fn an_unusable_idempotency_key_is_a_malformed_header_before_any_action_exists() {
    let dir = tempfile::tempdir().unwrap();
    let (provider, gw) = transfers_gateway(dir.path()).await;
    let base = format!("http://{}", gw.addr);
    for (key, reason) in [
        ("k".repeat(300), "300 bytes, at most 255 allowed"),
        ("k".repeat(70 * 1024), "71680 bytes, at most 255 allowed"),
        ("order\t7".to_owned(), "byte 6 is not printable ASCII"),
        ("\"\"".to_owned(), "must not be empty"),
    ] {
        // The proxy door.
        let r = client()
            .post(format!("{base}/fake/v1/transfers"))
            .bearer_auth(AGENT)
            .header("idempotency-key", key.as_str())
            .body(r#"{"amount":5}"#)
            .send()
            .await
            .unwrap();
        let (status, problem) = support::json_of(r).await;
        assert_eq!(status, 400, "{problem}");
        assert_eq!(
            problem["type"], "urn:backstop:problem:bad_header",
            "{problem}"
        );
        assert_eq!(problem["header"], "Idempotency-Key", "{problem}");
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.contains(reason), "{detail}");
        assert!(problem.get("action_id").is_none(), "{problem}");
        // The action API: this request's own header, the `headers` map, the member.
        let (status, problem) = post_action(
            &base,
            json!({"provider": "fake", "method": "POST", "path": "/v1/transfers", "body": "{}"})
                .to_string(),
            Some(&key),
        )
        .await;
        assert_eq!(status, 400, "{problem}");
        assert_eq!(
            problem["type"], "urn:backstop:problem:bad_header",
            "{problem}"
        );
        assert_eq!(problem["header"], "Idempotency-Key", "{problem}");
        assert!(problem.get("action_id").is_none(), "{problem}");
        let (status, problem) = post_action(
            &base,
            json!({"provider": "fake", "method": "POST", "path": "/v1/transfers",
                   "headers": {"Idempotency-Key": key}})
            .to_string(),
            None,
        )
        .await;
        assert_eq!(status, 400, "{problem}");
        assert_eq!(
            problem["type"], "urn:backstop:problem:bad_header",
            "{problem}"
        );
        assert!(
            problem["detail"].as_str().unwrap().contains(reason),
            "{problem}"
        );
        let (status, problem) = post_action(
            &base,
            json!({"provider": "fake", "method": "POST", "path": "/v1/transfers",
                   "idempotency_key": key})
            .to_string(),
            None,
        )
        .await;
        assert_eq!(status, 400, "{problem}");
        assert_eq!(problem["member"], "idempotency_key", "{problem}");
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.starts_with("idempotency_key: "), "{detail}");
        assert!(detail.contains(reason), "{detail}");
        assert!(problem.get("action_id").is_none(), "{problem}");
    }
    let (status, problem) = post_action(
        &base,
        json!({"provider": "fake", "method": "POST", "path": "/v1/transfers",
               "idempotency_key": ""})
        .to_string(),
        None,
    )
    .await;
    assert_eq!(status, 400, "{problem}");
    assert!(problem["detail"]
        .as_str()
        .unwrap()
        .contains("must not be empty"));
    assert!(
        provider.attempts().is_empty(),
        "nothing reached the provider"
    );
    gw.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_body_that_is_not_json_is_told_apart_from_a_json_body_of_the_wrong_shape() {
    let dir = tempfile::tempdir().unwrap();
    let (provider, gw) = transfers_gateway(dir.path()).await;
    let base = format!("http://{}", gw.addr);
    for (body, says) in [
        ("not json", "the body is not valid JSON"),
        (r#"{"provider": "fake""#, "the body is not valid JSON"),
        (
            r#"{"provider": "fake", "method": "GET", "path": "/v1/x", "max_wait_seconds": -1}"#,
            "the body is JSON, but not an action",
        ),
    ] {
        let (status, problem) = post_action(&base, body.to_owned(), None).await;
        assert_eq!(status, 400, "{body}: {problem}");
        let detail = problem["detail"].as_str().unwrap();
        assert!(
            detail.starts_with(&format!("body: {says}: ")),
            "{body}: {detail}"
        );
    }
    assert!(provider.attempts().is_empty());
}

#[tokio::test]
async fn two_places_giving_different_idempotency_keys_are_refused_naming_both() {
    let dir = tempfile::tempdir().unwrap();
    let (provider, gw) = transfers_gateway(dir.path()).await;
    let base = format!("http://{}", gw.addr);
    let body = |extra: Value| {
        let mut body = json!({"provider": "fake", "method": "POST", "path": "/v1/transfers",
                              "body": r#"{"amount":5}"#});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body.to_string()
    };
    for (extra, header, places) in [
        (
            json!({"idempotency_key": "zz-2"}),
            Some("zz-1"),
            ["the `Idempotency-Key` header", "`idempotency_key`"],
        ),
        (
            json!({"idempotency_key": "zz-2", "headers": {"Idempotency-Key": "zz-1"}}),
            None,
            ["`headers.Idempotency-Key`", "`idempotency_key`"],
        ),
        (
            json!({"headers": {"idempotency-key": "zz-2"}}),
            Some("zz-1"),
            ["the `Idempotency-Key` header", "`headers.idempotency-key`"],
        ),
    ] {
        let (status, problem) = post_action(&base, body(extra.clone()), header).await;
        assert_eq!(status, 400, "{extra} {problem}");
        assert_eq!(problem["title"], "The action API request is malformed");
        let detail = problem["detail"].as_str().unwrap();
        for place in places {
            assert!(detail.contains(place), "{place}: {detail}");
        }
        assert_eq!(problem["places"], json!(places), "{problem}");
        assert!(!detail.contains("zz-"), "keys are not echoed: {detail}");
    }
    assert!(
        provider.attempts().is_empty(),
        "nothing reached the provider"
    );

    // One key in two places agrees; this request's own header alone is the key too.
    let (status, accepted) = post_action(
        &base,
        body(json!({"idempotency_key": "zz-3", "headers": {"Idempotency-Key": "zz-3"}})),
        Some("zz-3"),
    )
    .await;
    assert_eq!(status, 202, "{accepted}");
    let (status, own) = post_action(&base, body(json!({"task": "run-own"})), Some("zz-4")).await;
    assert_eq!(status, 202, "{own}");
    let (_, view) = get_json(format!("{base}/v1/actions/{}?wait=5s", own["id"]), AGENT).await;
    assert_eq!(view["idempotency_key"], "zz-4", "{view}");
    gw.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_member_given_twice_in_an_action_body_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let (provider, gw) = transfers_gateway(dir.path()).await;
    let base = format!("http://{}", gw.addr);
    for (body, named) in [
        (
            r#"{"provider":"fake","method":"POST","path":"/v1/transfers","idempotency_key":"a-1","idempotency_key":"a-2"}"#,
            "duplicate field `idempotency_key`",
        ),
        (
            r#"{"provider":"fake","method":"POST","path":"/v1/transfers","headers":{"Idempotency-Key":"a-1","Idempotency-Key":"a-2"}}"#,
            "headers: member `Idempotency-Key` is given more than once",
        ),
        (
            r#"{"provider":"fake","method":"POST","path":"/v1/transfers","headers":{"x-note":"a","x-note":"b"}}"#,
            "headers: member `x-note` is given more than once",
        ),
    ] {
        let (status, problem) = post_action(&base, body.to_owned(), None).await;
        assert_eq!(status, 400, "{body}: {problem}");
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.contains(named), "{body}: {detail}");
    }
    assert!(
        provider.attempts().is_empty(),
        "nothing reached the provider"
    );
    gw.shutdown().await.unwrap();
}

#[tokio::test]
async fn backstop_headers_inside_headers_and_names_differing_in_case_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (provider, gw) = transfers_gateway(dir.path()).await;
    let base = format!("http://{}", gw.addr);
    for (headers, named) in [
        (
            r#"{"x-backstop-task":"zz"}"#,
            "headers: `x-backstop-task` is backstop's own header, not one for the provider; give it as the member `task`",
        ),
        (
            r#"{"X-Backstop-Priority":"bogus"}"#,
            "give it as the member `priority`",
        ),
        (r#"{"X-Backstop-Other":"1"}"#, "`X-Backstop-Other` is backstop's own header"),
        (r#"{"X-A":"1","x-a":"2"}"#, "headers: member `x-a` is given more than once"),
    ] {
        let body = format!(
            r#"{{"provider":"fake","method":"POST","path":"/v1/transfers","task":"a","headers":{headers}}}"#
        );
        let (status, problem) = post_action(&base, body.clone(), None).await;
        assert_eq!(status, 400, "{body}: {problem}");
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.contains(named), "{body}: {detail}");
    }
    assert!(
        provider.attempts().is_empty(),
        "nothing reached the provider"
    );
    gw.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_desired_outcome_longer_than_the_limit_is_refused_naming_the_member_and_limit() {
    let dir = tempfile::tempdir().unwrap();
    let (provider, gw) = transfers_gateway(dir.path()).await;
    let base = format!("http://{}", gw.addr);
    let limit = backstop_gateway::actions_api::MAX_DESIRED_OUTCOME_CHARS;
    let submit = |text: String, key: &'static str| {
        json!({"provider": "fake", "method": "POST", "path": "/v1/transfers",
               "body": "{}", "idempotency_key": key, "desired_outcome": text})
        .to_string()
    };
    for text in ["x".repeat(60 * 1024), "é".repeat(limit + 1)] {
        let chars = text.chars().count();
        let (status, problem) = post_action(&base, submit(text, "long-1"), None).await;
        assert_eq!(status, 400, "{problem}");
        assert_eq!(problem["member"], "desired_outcome");
        assert_eq!(problem["limit"], limit);
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.starts_with("desired_outcome: "), "{detail}");
        assert!(detail.contains(&format!("{chars} characters")), "{detail}");
        assert!(detail.contains(&format!("at most {limit}")), "{detail}");
    }
    assert!(
        provider.attempts().is_empty(),
        "nothing reached the provider"
    );
    let (status, accepted) = post_action(&base, submit("é".repeat(limit), "long-2"), None).await;
    assert_eq!(status, 202, "{accepted}");
    gw.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_repeated_wait_parameter_is_the_action_apis_own_problem() {
    let dir = tempfile::tempdir().unwrap();
    let (_provider, gw) = transfers_gateway(dir.path()).await;
    let base = format!("http://{}", gw.addr);
    let (status, accepted) = post_action(
        &base,
        json!({"provider": "fake", "method": "POST", "path": "/v1/transfers", "body": "{}"})
            .to_string(),
        None,
    )
    .await;
    assert_eq!(status, 202, "{accepted}");
    let id = accepted["id"].as_i64().unwrap();
    for query in ["wait=30s&wait=1", "wait=1&x=2&wait=1"] {
        let (status, problem) = get_json(format!("{base}/v1/actions/{id}?{query}"), AGENT).await;
        assert_eq!(status, 400, "{query}: {problem}");
        assert_eq!(problem["title"], "The action API request is malformed");
        assert_eq!(problem["parameter"], "wait");
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.starts_with("wait: "), "{detail}");
        assert!(detail.contains("repeated"), "{detail}");
    }
    let (status, problem) = get_json(format!("{base}/v1/actions/{id}?wait=soon"), AGENT).await;
    assert_eq!(status, 400);
    assert_eq!(problem["parameter"], "wait", "{problem}");
    let (status, view) = get_json(format!("{base}/v1/actions/{id}?wait=5s&x=1"), AGENT).await;
    assert_eq!(status, 200, "{view}");
    gw.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_wait_preference_too_large_to_read_is_called_too_large() {
    let dir = tempfile::tempdir().unwrap();
    let (provider, gw) = transfers_gateway(dir.path()).await;
    let r = client()
        .post(format!("http://{}/fake/v1/transfers", gw.addr))
        .bearer_auth(AGENT)
        .header("prefer", "wait=99999999999999999999999")
        .body("{}")
        .send()
        .await
        .unwrap();
    let (status, problem) = support::json_of(r).await;
    assert_eq!(status, 400, "{problem}");
    assert_eq!(problem["header"], "Prefer");
    let detail = problem["detail"].as_str().unwrap();
    assert!(detail.contains("too large"), "{detail}");
    assert!(detail.contains(&u64::MAX.to_string()), "{detail}");
    assert!(!detail.contains("whole number"), "{detail}");
    assert!(provider.attempts().is_empty());
    gw.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_desired_outcome_cleaned_on_intake_is_listed_in_the_case_files_redactions() {
    use backstop_fake_api::{FakeConfig, FaultRule};
    let dir = tempfile::tempdir().unwrap();
    // The write is stored and its connection dropped; the lookup fails: escalated.
    let provider = support::start_fake(
        FakeConfig::default()
            .with_route(
                RouteConfig::new("POST /v1/orders", support::create("orders", "or_"))
                    .with_idempotency()
                    .with_fault(FaultRule::on_calls(
                        [1],
                        Fault::StoreThenDrop { hold_ms: 0 },
                    )),
            )
            .with_route(
                RouteConfig::new("GET /v1/orders", support::lookup("orders"))
                    .with_fault(support::status_on_calls([1], 500, None)),
            ),
    );
    let yaml = policy_yaml(&provider.url()).replace(
        "    routes:\n",
        r#"    routes:
      "POST /v1/orders":
        class: idempotent_write
        scopes: [account]
        reconcile:
          by: idempotency_key
          lookup: "GET /v1/orders?idempotency_key={key}"
          found_pointer: /data/0/id
          operation_id_pointer: /id
"#,
    );
    let gw = support::start_gateway(&yaml, "a.yaml", &env, options(dir.path())).await;
    let base = format!("http://{}", gw.addr);
    let secret = "sk-live-abc123def456ghi789";
    let (status, accepted) = post_action(
        &base,
        json!({"provider": "fake", "method": "POST", "path": "/v1/orders", "body": "{}",
               "idempotency_key": "order-redact-1",
               "desired_outcome": format!("order placed once; the key is {secret}")})
        .to_string(),
        None,
    )
    .await;
    assert_eq!(status, 202, "{accepted}");
    let id = accepted["id"].as_i64().unwrap();
    let (_, view) = get_json(format!("{base}/v1/actions/{id}?wait=10s"), AGENT).await;
    assert_eq!(view["outcome"], "escalated", "{view}");
    let escalation = support::open_escalation_of(&gw, OPERATOR, id).await;
    let escalation = escalation["id"].as_i64().unwrap();
    let (status, shown) = support::show_escalation(&gw, OPERATOR, escalation).await;
    assert_eq!(status, 200, "{shown}");
    let case = &shown["case_file"];
    assert!(!shown.to_string().contains(secret), "{shown}");
    assert_eq!(
        case["desired_outcome"], "order placed once; the key is [redacted]",
        "{case}"
    );
    assert_eq!(case["redactions"], json!(["desired_outcome"]), "{case}");
    gw.shutdown().await.unwrap();
}

/// Two providers, each with its own credential: `fake` at `fake_url` and `nokey` at
/// `nokey_url`.
async fn two_provider_gateway(fake_url: &str, nokey_url: &str, dir: &Path) -> Running {
    let yaml = support::policy_yaml(
        fake_url,
        "agents:\n  agent-a: { token_env: AGENT_A }\n",
        &format!(
            r#"    routes:
      "GET /v1/items/{{id}}": {{ class: read, scopes: [account] }}
  nokey:
    base_url: {nokey_url}
    credential: {{ secret_env: NOKEY_API_KEY }}
    routes:
      "GET /v1/nokey": {{ class: read }}
"#
        ),
    );
    let env = |name: &str| match name {
        "NOKEY_API_KEY" => Some("sk-nokey".to_owned()),
        other => env(other),
    };
    support::start_gateway(&yaml, "two.yaml", &env, options(dir)).await
}

#[tokio::test]
async fn a_path_climbing_out_of_its_provider_is_refused_and_reaches_no_other_provider() {
    let dir = tempfile::tempdir().unwrap();
    let fake_provider = fake(vec![RouteConfig::new(
        "GET /v1/items/{id}",
        Handler::default(),
    )]);
    let other = fake(vec![RouteConfig::new("GET /v1/nokey", Handler::default())]);
    let gw = two_provider_gateway(&fake_provider.url(), &other.url(), dir.path()).await;
    let base = format!("http://{}", gw.addr);
    let submit = |path: &str| {
        json!({"provider": "fake", "method": "GET", "path": path, "task": "climb"}).to_string()
    };
    for (path, reading) in [
        ("/../nokey/v1/nokey", "it climbs"),
        ("/%2e%2e/nokey/v1/nokey", "it climbs"),
        ("/%2E%2E/nokey/v1/nokey?x=1", "it climbs"),
        ("/.%2e/nokey/v1/nokey", "it climbs"),
        ("/v1/../../nokey/v1/nokey", "it climbs"),
        ("/v1/items/../../../nokey/v1/nokey", "it climbs"),
        (
            "/v1/..%2F..%2Fnokey/v1/nokey",
            "read with `%2F` as `/`, it climbs",
        ),
    ] {
        let (status, problem) = post_action(&base, submit(path), None).await;
        assert_eq!(status, 400, "{path}: {problem}");
        assert_eq!(problem["member"], "path", "{path}: {problem}");
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.starts_with("path: `"), "{path}: {detail}");
        assert!(
            detail.contains(&format!("{reading} above its root with `..`")),
            "{path}: {detail}"
        );
        assert!(detail.contains("`fake`"), "{path}: {detail}");
    }
    assert!(other.attempts().is_empty(), "nothing reached `nokey`");
    assert!(fake_provider.attempts().is_empty(), "nothing was sent");
    // A `..` that stays below the path's root is only a spelling of a path of `fake`.
    let (status, accepted) = post_action(&base, submit("/v1/x/../items/7"), None).await;
    assert_eq!(status, 202, "{accepted}");
    let id = accepted["id"].as_i64().unwrap();
    let (_, view) = get_json(format!("{base}/v1/actions/{id}?wait=5s"), AGENT).await;
    assert_eq!(view["provider"], "fake", "{view}");
    assert_eq!(view["route"], "/v1/items/{id}", "{view}");
    assert!(other.attempts().is_empty(), "nothing reached `nokey`");
    // A provider member that is not a provider name is an unknown provider, not a path.
    let (status, problem) = post_action(
        &base,
        json!({"provider": "fake/../nokey", "method": "GET", "path": "/v1/nokey"}).to_string(),
        None,
    )
    .await;
    assert_eq!(status, 404, "{problem}");
    assert_eq!(problem["type"], "urn:backstop:problem:unknown_provider");
    assert!(other.attempts().is_empty(), "nothing reached `nokey`");
    gw.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_path_with_characters_a_url_cannot_carry_is_refused_naming_path_and_reason() {
    let dir = tempfile::tempdir().unwrap();
    let (provider, gw) = transfers_gateway(dir.path()).await;
    let base = format!("http://{}", gw.addr);
    for (path, reason) in [
        ("/v1/trans\0fers", "character 10 is a NUL character"),
        ("/v1/trans fers", "character 10 is a space"),
        ("/v1/transfers?note=a b", "character 21 is a space"),
        ("/v1/trans\tfers", "character 10 is the character U+0009"),
        (
            "/v1/trans\u{7f}fers",
            "character 10 is the character U+007F",
        ),
        ("/v1/transfers#top", "character 14 is `#`"),
        ("/v1/<transfers>", "character 5 is `<`"),
        (
            "/v1/trans%zzfers",
            "a `%` must be followed by two hex digits",
        ),
        ("v1/transfers", "must start with `/`"),
    ] {
        let body = json!({"provider": "fake", "method": "POST", "path": path, "body": "{}"});
        let (status, problem) = post_action(&base, body.to_string(), None).await;
        assert_eq!(status, 400, "{path:?}: {problem}");
        assert_eq!(problem["member"], "path", "{path:?}: {problem}");
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.starts_with("path: `"), "{path:?}: {detail}");
        assert!(detail.contains(reason), "{path:?}: {detail}");
        assert!(!detail.contains("route_template"), "{path:?}: {detail}");
        assert!(!detail.contains('\0'), "the detail shows the NUL escaped");
    }
    assert!(provider.attempts().is_empty(), "nothing was sent");
    gw.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_deadline_later_than_the_store_keeps_is_refused_at_both_entry_points() {
    let dir = tempfile::tempdir().unwrap();
    let (provider, gw) = transfers_gateway(dir.path()).await;
    let base = format!("http://{}", gw.addr);
    let latest = backstop_gateway::door::LATEST_INSTANT;
    for later in ["9999-12-30T22:00:00.001Z", "9999-12-30T22:00:00.999999999Z"] {
        let body = json!({"provider": "fake", "method": "POST", "path": "/v1/transfers",
                          "body": "{}", "idempotency_key": "late-1", "deadline": later});
        let (status, problem) = post_action(&base, body.to_string(), None).await;
        assert_eq!(status, 400, "{later}: {problem}");
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.starts_with("deadline: "), "{detail}");
        assert!(detail.contains(latest), "{detail}");

        let (status, problem) = support::json_of(
            client()
                .post(format!("{base}/fake/v1/transfers"))
                .bearer_auth(AGENT)
                .header("content-type", "application/json")
                .header("Idempotency-Key", "late-2")
                .header("X-Backstop-Deadline", later)
                .body("{}")
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(status, 400, "{later}: {problem}");
        assert_eq!(problem["header"], "X-Backstop-Deadline", "{problem}");
        assert!(
            problem["detail"].as_str().unwrap().contains(latest),
            "{problem}"
        );
    }
    assert!(
        provider.attempts().is_empty(),
        "nothing reached the provider"
    );
    // The latest instant itself is kept: the write is answered, the action can be read.
    let body = json!({"provider": "fake", "method": "POST", "path": "/v1/transfers",
                      "body": "{}", "idempotency_key": "late-3", "deadline": latest});
    let (status, accepted) = post_action(&base, body.to_string(), None).await;
    assert_eq!(status, 202, "{accepted}");
    let id = accepted["id"].as_i64().unwrap();
    let mut view = Value::Null;
    for _ in 0..200 {
        let (status, seen) = get_json(format!("{base}/v1/actions/{id}"), AGENT).await;
        assert_eq!(status, 200, "{seen}");
        view = seen;
        if view["outcome"] == "succeeded" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(view["outcome"], "succeeded", "{view}");
    let response = client()
        .post(format!("{base}/fake/v1/transfers"))
        .bearer_auth(AGENT)
        .header("content-type", "application/json")
        .header("Idempotency-Key", "late-4")
        .header("X-Backstop-Deadline", latest)
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    assert_eq!(provider.attempts().len(), 2);
    gw.shutdown().await.unwrap();
}
