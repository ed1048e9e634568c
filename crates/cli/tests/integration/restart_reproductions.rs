//! Two crashes that once left work no one moved forward, reproduced deterministically with
//! `backstop serve` processes on loopback, the fake provider and SIGKILL, and measured at the
//! fake provider and in the store (SPEC §6, §12):
//!
//! - a write whose restart recovery was itself killed during its reconciliation lookup stayed
//!   `waiting` with its retry job claimed by the dead run, and every same-key resend was
//!   answered `409 idempotency_key_in_flight`: now the next start finishes it;
//! - a write answered `202 Accepted` (`Prefer: respond-async`, `POST /v1/actions`) and killed
//!   before its first send was never sent after the restart: now it is, once.
//!
//! Every kill is taken at a point the test observes (an attempt recorded by the fake provider,
//! an event in the audit log), never after a sleep; the windows are held open by the provider
//! (a lookup held without an answer) or by a scope's boundary (a `Retry-After` of seconds).

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

use backstop_core::reconcile::upstream_idempotency_key;
use backstop_fake_api::{FakeConfig, Fault, FaultRule, Handler, RouteConfig};
use backstop_store::{ActionId, AuditReader, SqliteStore, Store};
use serde_json::Value;

use crate::{
    common::listening::{spawn_listening, Listening},
    restart_recovery::{create, runtime, start_fake, wait_until},
};

const AGENT: &str = "repro-agent";
const AGENT_TOKEN: &str = "agent-token-repro";

/// One provider with one scope: a write with a lookup by key, a write without one, and the
/// reads of both collections. No jitter after a boundary, so a retry scheduled by a
/// `Retry-After` is due at the boundary itself.
fn policy(base_url: &str) -> String {
    format!(
        r#"
agents:
  {AGENT}: {{ token_env: REPRO_AGENT_TOKEN }}
backoff:
  boundary_spread_seconds: 0
providers:
  fake:
    base_url: {base_url}
    idempotency_header: Idempotency-Key
    scopes:
      account: {{ limit: 1000 }}
    routes:
      "POST /v1/transfers":
        class: idempotent_write
        reconcile:
          by: idempotency_key
          lookup: "GET /v1/transfers?idempotency_key={{key}}"
          found_pointer: /data/0/id
          operation_id_pointer: /id
      "GET /v1/transfers": {{ class: read }}
      "POST /v1/invoices": {{ class: idempotent_write }}
      "GET /v1/invoices": {{ class: read }}
"#
    )
}

/// `backstop serve` of the policy `dir/policy.yaml` with the database `dir/backstop.db` on a
/// loopback port of the system's choice, once it says where it listens (at most 20 s).
fn serve(dir: &Path) -> Listening {
    let mut command = Command::new(env!("CARGO_BIN_EXE_backstop"));
    command
        .args(["serve", "--config"])
        .arg(dir.join("policy.yaml"))
        .args(["--listen", "127.0.0.1:0", "--store"])
        .arg(dir.join("backstop.db"))
        .env_remove("RUST_LOG")
        .env("REPRO_AGENT_TOKEN", AGENT_TOKEN)
        .stdout(Stdio::null());
    spawn_listening(&mut command, Duration::from_secs(20))
}

/// An HTTP answer read to its end.
struct Answer {
    status: u16,
    /// Header names lowercased, in order.
    headers: Vec<(String, String)>,
    body: String,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {} {}", self.status, self.body))
    }
}

/// One HTTP/1.1 exchange on a connection of its own (`Connection: close`) with the agent's
/// token and `headers`, read to its end (each read waits at most 40 s).
fn exchange(
    addr: SocketAddr,
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Answer {
    let mut socket = TcpStream::connect(addr).expect("connect");
    socket
        .set_read_timeout(Some(Duration::from_secs(40)))
        .expect("read timeout");
    let mut request = format!("{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nAuthorization: Bearer {AGENT_TOKEN}\r\n");
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    socket.write_all(request.as_bytes()).expect("send");
    let mut raw = Vec::new();
    socket.read_to_end(&mut raw).expect("read the answer");
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = raw
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no header end: {raw}"));
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {raw}"));
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_owned()
    };
    Answer {
        status,
        headers,
        body,
    }
}

/// The body of a `Transfer-Encoding: chunked` message (RFC 9112 §7.1), no trailers.
fn dechunk(mut rest: &str) -> String {
    let mut body = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let size = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16)
            .unwrap_or_else(|e| panic!("chunk size `{size}`: {e}"));
        if size == 0 {
            break;
        }
        body.push_str(&after[..size]);
        rest = after[size..].trim_start_matches("\r\n");
    }
    body
}

/// The audit events of `dir/backstop.db`, through the read-only reader (a running gateway
/// holds the store's write lock); none while the store cannot be read yet.
fn events(dir: &Path) -> Vec<Value> {
    let Ok(reader) = AuditReader::open(dir.join("backstop.db")) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    if reader.export(0, &mut out).is_err() {
        return Vec::new();
    }
    String::from_utf8_lossy(&out)
        .lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect()
}

/// How many audit events of `dir`'s store are `kind` for `action`.
fn count(dir: &Path, kind: &str, action: ActionId) -> usize {
    events(dir)
        .iter()
        .filter(|e| e["kind"] == kind && e["action"] == action.0)
        .count()
}

/// The action the first `action_requested` event of `dir`'s store names.
fn first_action(dir: &Path) -> Option<ActionId> {
    events(dir)
        .iter()
        .find(|e| e["kind"] == "action_requested")
        .and_then(|e| e["action"].as_i64())
        .map(ActionId)
}

/// What the stopped gateway's store holds of `action`: its state and outcome, its attempts and
/// its retry jobs with who claimed them — the words of a failure message.
fn stored_state(dir: &Path, action: ActionId) -> String {
    let db = dir.join("backstop.db");
    let record = SqliteStore::open_existing(&db)
        .expect("store")
        .action(action)
        .expect("readable")
        .expect("the action");
    let conn =
        rusqlite::Connection::open_with_flags(&db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .expect("open read-only");
    let mut jobs = conn
        .prepare("SELECT job_id, due_at_ms, claimed_at_ms, claimed_by FROM scheduled_retries WHERE action_id = ?1")
        .expect("prepare");
    let jobs: Vec<String> = jobs
        .query_map([action.0], |r| {
            Ok(format!(
                "job {} due {} claimed_at {:?} by {:?}",
                r.get::<_, i64>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, Option<i64>>(2)?,
                r.get::<_, Option<String>>(3)?
            ))
        })
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows");
    format!(
        "state {:?}, outcome {:?}, context {:?}, jobs {jobs:?}",
        record.state, record.outcome, record.outcome_context
    )
}

/// Polls `ready` every 50 ms until it is true or `limit` has passed, counting the time `ready`
/// itself takes (a long-poll); whether it became true. A bounded poll of another process, not
/// a sleep that waits for a race to settle.
#[allow(clippy::disallowed_methods)] // a bound on waiting for another process, not the code's clock
fn became(limit: Duration, mut ready: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + limit;
    loop {
        if ready() {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// uncertain write → kill before the retry → restart while the scope waits for a boundary →
/// kill during recovery's lookup → restart: the third run finishes the write (its lookup
/// proves absence, so it is resent under its original key), the provider creates it once, and
/// the agent's same-key resend gets the outcome, not `409 idempotency_key_in_flight`.
#[test]
fn a_write_whose_recovery_lookup_was_killed_is_finished_by_the_next_start_and_created_once() {
    let runtime = runtime();
    let config = FakeConfig::default()
        .with_route(
            RouteConfig::new("POST /v1/transfers", create("transfers", "tr_"))
                .with_idempotency()
                // Call 1 is dropped unanswered (nothing done: uncertain); call 2, the same-key
                // retry, is throttled for 6 s — the retry after it is due at that boundary.
                .with_fault(FaultRule::on_calls([1], Fault::Drop))
                .with_fault(FaultRule::on_calls(
                    [2],
                    Fault::Status {
                        status: 429,
                        retry_after: Some("6".into()),
                        body: None,
                    },
                )),
        )
        .with_route(
            RouteConfig::new(
                "GET /v1/transfers",
                Handler::Lookup {
                    collection: "transfers".into(),
                },
            )
            // Lookup 2 is the second run's recovery: held unanswered until that run is killed.
            .with_fault(FaultRule::on_calls([2], Fault::Timeout { hold_ms: 60_000 })),
        );
    let fake = start_fake(&runtime, config);
    let posts = || {
        fake.attempts()
            .into_iter()
            .filter(|a| a.method == "POST")
            .collect::<Vec<_>>()
    };
    let lookups = || {
        fake.attempts()
            .into_iter()
            .filter(|a| a.method == "GET")
            .count()
    };
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    std::fs::write(dir.join("policy.yaml"), policy(&fake.url())).unwrap();

    // Run 1: the write is dropped, looked up (nothing), retried under its key, throttled; its
    // next retry is scheduled for the boundary. Killed before it.
    let mut first = serve(dir);
    let body = r#"{"amount":100,"currency":"EUR"}"#;
    let mut agent = TcpStream::connect(first.addr).expect("connect");
    write!(
        agent,
        "POST /fake/v1/transfers HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {AGENT_TOKEN}\r\nX-Backstop-Task: run-stuck\r\nIdempotency-Key: transfer-stuck-1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("write request");
    wait_until("the write's action", Duration::from_secs(20), || {
        first_action(dir).is_some()
    });
    let action = first_action(dir).expect("the action");
    wait_until(
        "the retry after the 429 to be scheduled",
        Duration::from_secs(20),
        || count(dir, "retry_scheduled", action) == 2,
    );
    first.kill();
    drop(agent);
    assert_eq!(posts().len(), 2, "killed before the retry: {:?}", posts());
    assert_eq!(lookups(), 1);
    let scheduled = SqliteStore::open_existing(dir.join("backstop.db"))
        .expect("store")
        .scheduled_retries()
        .expect("scheduled retries");
    assert!(
        scheduled.len() == 1 && scheduled[0].action == action,
        "one retry waits for the boundary: {scheduled:?}"
    );

    // Run 2: the retry is re-armed; at the boundary recovery looks the write up, and the
    // provider holds the lookup. Killed while it is held.
    let mut second = serve(dir);
    wait_until(
        "the second run's recovery lookup at the provider",
        Duration::from_secs(30),
        || lookups() == 2,
    );
    let second_log = second.kill();
    assert_eq!(
        posts().len(),
        2,
        "nothing resent before the lookup answered"
    );
    let after_second = stored_state(dir, action);

    // Run 3: the write is finished without the agent.
    let mut third = serve(dir);
    let ended = became(Duration::from_secs(30), || {
        count(dir, "action_finished", action) > 0 || count(dir, "escalated", action) > 0
    });
    if !ended {
        let third_log = third.kill();
        panic!(
            "the write never ended after the third start: {}\nafter the second run: {after_second}\nsecond run:\n{second_log}\nthird run:\n{third_log}",
            stored_state(dir, action)
        );
    }
    // The agent's resend under the key, after the write ended: its outcome, never "in flight".
    let resend = exchange(
        third.addr,
        "POST",
        "/fake/v1/transfers",
        &[
            ("X-Backstop-Task", "run-stuck"),
            ("Idempotency-Key", "transfer-stuck-1"),
            ("Content-Type", "application/json"),
        ],
        body,
    );
    let third_log = third.kill();
    assert_ne!(resend.status, 409, "{}\n{third_log}", resend.body);
    assert!(
        (200..300).contains(&resend.status),
        "the stored outcome: {} {}\n{third_log}",
        resend.status,
        resend.body
    );

    let store = SqliteStore::open_existing(dir.join("backstop.db")).expect("store");
    let record = store.action(action).unwrap().expect("action");
    assert_eq!(
        record.outcome.map(|o| o.as_str()),
        Some("succeeded"),
        "{}\n{third_log}",
        stored_state(dir, action)
    );
    assert!(record
        .provider_operation_id
        .as_deref()
        .is_some_and(|op| op.starts_with("tr_")));
    assert!(store.scheduled_retries().unwrap().is_empty());
    assert!(store.open_escalations().unwrap().is_empty());
    drop(store);

    // At the provider: every attempt under the one key, one create, one transfer.
    let upstream = upstream_idempotency_key(AGENT, "transfer-stuck-1");
    let posts = posts();
    assert!(
        posts
            .iter()
            .all(|a| a.idempotency_key.as_deref() == Some(upstream.as_str())),
        "{posts:?}"
    );
    let created: Vec<_> = posts
        .iter()
        .filter(|a| a.status == Some(201) && !a.replayed)
        .collect();
    assert_eq!(created.len(), 1, "created once: {posts:?}");
    let listed = exchange(fake.addr(), "GET", "/v1/transfers", &[], "").json();
    assert_eq!(listed["data"].as_array().map(Vec::len), Some(1), "{listed}");
    runtime.block_on(fake.shutdown());
}

/// Two writes answered `202 Accepted` — one through the proxy door with `Prefer:
/// respond-async`, one through `POST /v1/actions` — wait for their scope's boundary (a 429 on
/// an earlier read); the gateway is killed before it. After the restart each reaches the
/// provider once, under its key, and its view says `succeeded`.
#[test]
fn writes_accepted_with_202_and_killed_before_their_first_send_are_sent_once_after_the_restart() {
    let runtime = runtime();
    let config = FakeConfig::default()
        .with_route(
            RouteConfig::new("POST /v1/invoices", create("invoices", "in_")).with_idempotency(),
        )
        .with_route(
            RouteConfig::new(
                "GET /v1/invoices",
                Handler::Lookup {
                    collection: "invoices".into(),
                },
            )
            // The first read is throttled for 8 s: the scope's boundary, stored.
            .with_fault(FaultRule::on_calls(
                [1],
                Fault::Status {
                    status: 429,
                    retry_after: Some("8".into()),
                    body: None,
                },
            )),
        );
    let fake = start_fake(&runtime, config);
    let posts = || {
        fake.attempts()
            .into_iter()
            .filter(|a| a.method == "POST")
            .collect::<Vec<_>>()
    };
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    std::fs::write(dir.join("policy.yaml"), policy(&fake.url())).unwrap();

    let mut first = serve(dir);
    // The read gets its 429 and is answered at once (no wait allowed): the boundary is set.
    let read = exchange(
        first.addr,
        "GET",
        "/fake/v1/invoices",
        &[("X-Backstop-Task", "run-async"), ("Prefer", "wait=0")],
        "",
    );
    assert_eq!(read.status, 429, "{}", read.body);
    wait_until("the scope's boundary", Duration::from_secs(20), || {
        events(dir).iter().any(|e| e["kind"] == "scope_updated")
    });

    let proxied_body = r#"{"customer":"cus_1","amount":10}"#;
    let proxied = exchange(
        first.addr,
        "POST",
        "/fake/v1/invoices",
        &[
            ("X-Backstop-Task", "run-async"),
            ("Idempotency-Key", "invoice-async-1"),
            ("Prefer", "respond-async"),
            ("Content-Type", "application/json"),
        ],
        proxied_body,
    );
    assert_eq!(proxied.status, 202, "{}", proxied.body);
    let location = proxied.header("location").expect("Location").to_owned();

    let submitted_body = r#"{"customer":"cus_2","amount":20}"#;
    let submit = serde_json::json!({
        "provider": "fake",
        "method": "POST",
        "path": "/v1/invoices",
        "task": "run-async",
        "idempotency_key": "invoice-async-2",
        "headers": {"content-type": "application/json"},
        "body": submitted_body,
    })
    .to_string();
    let submitted = exchange(
        first.addr,
        "POST",
        "/v1/actions",
        &[("Content-Type", "application/json")],
        &submit,
    );
    assert_eq!(submitted.status, 202, "{}", submitted.body);
    let submitted_id = submitted.json()["id"].as_i64().expect("id");
    assert_eq!(
        submitted.header("location"),
        Some(format!("/v1/actions/{submitted_id}").as_str())
    );
    let first_log = first.kill();
    assert!(
        posts().is_empty(),
        "killed before the first send: {:?}\n{first_log}",
        posts()
    );
    let store = SqliteStore::open_existing(dir.join("backstop.db")).expect("store");
    let proxied_id = location
        .strip_prefix("/v1/actions/")
        .and_then(|id| id.parse().ok())
        .map(ActionId)
        .expect("an action's location");
    for id in [proxied_id, ActionId(submitted_id)] {
        let record = store.action(id).unwrap().expect("recorded");
        assert_eq!(record.state.as_str(), "requested", "{record:?}");
        assert!(store.attempts(id).unwrap().is_empty());
    }
    drop(store);

    // After the restart both are sent at the boundary; their views say so.
    let mut second = serve(dir);
    for path in [location.clone(), format!("/v1/actions/{submitted_id}")] {
        let mut view = Value::Null;
        let succeeded = became(Duration::from_secs(40), || {
            view = exchange(second.addr, "GET", &format!("{path}?wait=5s"), &[], "").json();
            view["outcome"] == "succeeded"
        });
        if !succeeded {
            let log = second.kill();
            panic!("{path} never succeeded after the restart: {view}\n{first_log}\n{log}");
        }
        assert_eq!(view["state"], "completed", "{view}");
        assert_eq!(view["attempts"], 1, "{view}");
    }
    second.kill();

    // At the provider: each write once, under its own key, created, never replayed.
    let posts = posts();
    assert_eq!(posts.len(), 2, "{posts:?}");
    for (key, body) in [
        ("invoice-async-1", proxied_body),
        ("invoice-async-2", submitted_body),
    ] {
        let upstream = upstream_idempotency_key(AGENT, key);
        let sent: Vec<_> = posts
            .iter()
            .filter(|a| a.idempotency_key.as_deref() == Some(upstream.as_str()))
            .collect();
        assert_eq!(sent.len(), 1, "{key}: {posts:?}");
        assert_eq!(sent[0].status, Some(201), "{key}: {posts:?}");
        assert_eq!(sent[0].body_bytes, body.len(), "{key}: the kept body");
    }
    let listed = exchange(fake.addr(), "GET", "/v1/invoices", &[], "").json();
    assert_eq!(listed["data"].as_array().map(Vec::len), Some(2), "{listed}");
    runtime.block_on(fake.shutdown());
}
