//! `backstop scopes` as a process against the gateway's router served on a loopback port, with
//! an executor that publishes two fixed scope records.

use std::net::SocketAddr;
use std::process::{Command, Output};
use std::sync::Arc;

use backstop_core::policy::Policy;
use backstop_gateway::{
    action::{ActionSpec, Execution},
    auth::{Authenticator, Role},
    clock::TokioClock,
    door::DoorConfig,
    metrics::Metrics,
    secrets::ProviderCredentials,
    server::{router, AppState, BoxFuture, Executor},
};
use serde_json::json;

use crate::common::listening::refusing_port;

const AGENT: &str = "agent-token-scopes";
const OPERATOR: &str = "operator-token-scopes";

/// Publishes fixed scope records; never executes anything.
struct Records;

impl Executor for Records {
    fn execute(&self, _: ActionSpec) -> BoxFuture<Execution> {
        panic!("`backstop scopes` must not send calls through the door")
    }
    fn scopes(&self) -> serde_json::Value {
        json!([
            {
                "provider": "billing-api", "scope": "account", "name": "billing-api/account",
                "request_class": null,
                "next_allowed_at": "2026-01-01T00:00:10Z", "remaining": 0,
                "reset_after_seconds": 10, "source": "HTTP 429 Retry-After",
                "in_flight": 1, "delayed": 2
            },
            {
                "provider": "search", "scope": "global", "request_class": null,
                "next_allowed_at": null, "remaining": null, "reset_after_seconds": null,
                "source": null, "in_flight": 0, "delayed": 0
            }
        ])
    }
    fn shutdown(&self) -> BoxFuture<()> {
        Box::pin(async {})
    }
}

struct Gateway {
    _runtime: tokio::runtime::Runtime,
    url: String,
}

fn gateway() -> Gateway {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let addr: SocketAddr = runtime.block_on(async {
        let policy = Policy::from_yaml_str(
            "providers:\n  billing-api:\n    base_url: http://127.0.0.1:9\n",
            "p.yaml",
        )
        .expect("policy");
        let credentials = ProviderCredentials::resolve(&policy, &|_| None).expect("credentials");
        let auth = Authenticator::default()
            .with_token("agent-a", Role::Agent, AGENT)
            .with_token("alice", Role::Operator, OPERATOR);
        let state = Arc::new(AppState::new(
            Arc::new(policy),
            auth,
            credentials,
            Arc::new(Records),
            TokioClock::anchored_at("2026-01-01T00:00:00Z".parse().expect("instant")),
            Arc::new(Metrics::new()),
            DoorConfig::default(),
            true,
        ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let app = router(state);
        tokio::spawn(async move { axum::serve(listener, app).await });
        addr
    });
    Gateway {
        _runtime: runtime,
        url: format!("http://{addr}"),
    }
}

fn backstop(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_backstop"));
    command
        .args(args)
        .env_remove("BACKSTOP_URL")
        .env_remove("BACKSTOP_TOKEN")
        .env_remove("BACKSTOP_OPERATOR_TOKEN");
    for (name, value) in env {
        command.env(name, value);
    }
    command.output().expect("run backstop")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn table_has_one_row_per_scope_record() {
    let g = gateway();
    let out = backstop(
        &[
            "scopes",
            "--url",
            &g.url,
            "--token",
            OPERATOR,
            "--now",
            "2026-01-01T00:00:00Z",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let lines: Vec<Vec<&str>> = stdout
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(lines.len(), 3, "{stdout}");
    assert_eq!(
        lines[0],
        [
            "SCOPE",
            "NEXT_ALLOWED_AT",
            "REMAINING",
            "RESET_AFTER_S",
            "SOURCE",
            "IN_FLIGHT",
            "DELAYED"
        ]
    );
    assert_eq!(
        lines[1],
        [
            "billing-api/account",
            "2026-01-01T00:00:10Z",
            "0",
            "10",
            "HTTP",
            "429",
            "Retry-After",
            "1",
            "2"
        ]
    );
    // A record without `name` (an older gateway) shows `provider/scope`.
    assert_eq!(lines[2], ["search/global", "-", "-", "-", "-", "0", "0"]);
}

#[test]
fn json_format_and_environment_variables() {
    let g = gateway();
    let out = backstop(
        &["scopes", "--format", "json"],
        &[("BACKSTOP_URL", &g.url), ("BACKSTOP_TOKEN", AGENT)],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let value: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(value[0]["scope"], "account");
    assert_eq!(value[0]["delayed"], 2);
    assert_eq!(value.as_array().map(Vec::len), Some(2));
}

#[test]
fn operator_token_variable_is_used_when_backstop_token_is_unset() {
    let g = gateway();
    let out = backstop(
        &["scopes", "--url", &g.url, "--format", "json"],
        &[("BACKSTOP_OPERATOR_TOKEN", OPERATOR)],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let value: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(value[0]["name"], "billing-api/account");
    // BACKSTOP_TOKEN comes first: a wrong one is used even when the operator variable is right.
    let out = backstop(
        &["scopes", "--url", &g.url],
        &[
            ("BACKSTOP_TOKEN", "wrong"),
            ("BACKSTOP_OPERATOR_TOKEN", OPERATOR),
        ],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("HTTP 401 unauthorized"));
    // An empty BACKSTOP_TOKEN counts as unset.
    let out = backstop(
        &["scopes", "--url", &g.url],
        &[
            ("BACKSTOP_TOKEN", ""),
            ("BACKSTOP_OPERATOR_TOKEN", OPERATOR),
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn errors_are_one_line_and_exit_2() {
    let g = gateway();
    let (_held, port) = refusing_port();
    let unreachable = format!("http://127.0.0.1:{port}");
    let cannot_reach = format!("cannot reach the gateway at {unreachable}");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["scopes", "--url", &g.url],
            "no token: set BACKSTOP_TOKEN (an agent or operator token) or BACKSTOP_OPERATOR_TOKEN",
        ),
        (
            vec!["scopes", "--url", &g.url, "--token", "wrong"],
            "HTTP 401 unauthorized",
        ),
        (
            vec!["scopes", "--url", "https://gw.example", "--token", AGENT],
            "only http:// URLs",
        ),
        (
            vec!["scopes", "--url", &unreachable, "--token", AGENT],
            &cannot_reach,
        ),
    ];
    for (args, expected) in cases {
        let out = backstop(&args, &[]);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = text(&out.stderr);
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.starts_with("backstop scopes: "), "{stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty());
    }
}

#[test]
fn a_next_allowed_at_that_has_passed_shows_now() {
    let g = gateway();
    let row = |now: &str| {
        let out = backstop(
            &["scopes", "--url", &g.url, "--token", OPERATOR, "--now", now],
            &[],
        );
        assert!(out.status.success(), "{}", text(&out.stderr));
        let stdout = text(&out.stdout);
        stdout
            .lines()
            .nth(1)
            .expect("a row")
            .split_whitespace()
            .nth(1)
            .unwrap()
            .to_owned()
    };
    assert_eq!(row("2026-01-01T00:00:09.999Z"), "2026-01-01T00:00:10Z");
    assert_eq!(row("2026-01-01T00:00:10Z"), "now");
    assert_eq!(row("2026-01-02T00:00:00Z"), "now");
    // Without --now the current time is used: the 2026-01-01 boundary has long passed.
    let out = backstop(&["scopes", "--url", &g.url, "--token", OPERATOR], &[]);
    assert!(
        text(&out.stdout).lines().nth(1).unwrap().contains(" now "),
        "{}",
        text(&out.stdout)
    );
    // The JSON stays the gateway's own.
    let out = backstop(
        &[
            "scopes", "--url", &g.url, "--token", OPERATOR, "--format", "json",
        ],
        &[],
    );
    let value: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(value[0]["next_allowed_at"], "2026-01-01T00:00:10Z");
}

#[test]
fn a_url_that_is_not_a_backstop_gateway_is_said_so() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    // Another web server: no /v1/scopes (a bare 404), and a page that is not JSON.
    let addr: SocketAddr = runtime.block_on(async {
        let app = axum::Router::new().route(
            "/page/v1/scopes",
            axum::routing::get(|| async { "<html>hello</html>" }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, app).await });
        addr
    });
    let url = format!("http://{addr}");
    let out = backstop(&["scopes", "--url", &url, "--token", AGENT], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        text(&out.stderr),
        format!("backstop scopes: {url} does not look like a backstop gateway: GET /v1/scopes answered HTTP 404 without a backstop problem document (is --url the gateway's base URL, without a path?)\n")
    );
    let page = format!("{url}/page");
    let out = backstop(&["scopes", "--url", &page, "--token", AGENT], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        text(&out.stderr),
        format!("backstop scopes: {page} does not look like a backstop gateway: GET /v1/scopes answered HTTP 200 with a body that is not JSON\n")
    );
}

#[test]
fn json_that_is_not_scope_records_is_not_a_backstop_gateway() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    // Another server answering foreign JSON with 200 on every path: an object at the root, an
    // array of objects under /list.
    let addr: SocketAddr = runtime.block_on(async {
        let app = axum::Router::new()
            .route(
                "/list/v1/scopes",
                axum::routing::get(|| async { axum::Json(json!([{"hostile": true}])) }),
            )
            .fallback(|| async { axum::Json(json!({"hostile": true})) });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, app).await });
        addr
    });
    let url = format!("http://{addr}");
    let list = format!("{url}/list");
    for (base, reason) in [
        (&url, "invalid type: map, expected a sequence"),
        (&list, "missing field `provider`"),
    ] {
        for format in ["table", "json"] {
            let out = backstop(
                &[
                    "scopes", "--url", base, "--token", AGENT, "--format", format,
                ],
                &[],
            );
            assert_eq!(out.status.code(), Some(2), "{base} {format}");
            assert_eq!(
                text(&out.stderr),
                format!("backstop scopes: {base} does not look like a backstop gateway: GET /v1/scopes answered JSON that is not a JSON array of scope records ({reason})\n")
            );
            assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
        }
    }
}
