//! Restart recovery as processes (SPEC §12, §13): `backstop serve` sends a write that the fake
//! provider commits and then holds without answering; backstop is killed with SIGKILL while the
//! attempt is recorded `sent` without a result, started again on the same database, and must
//! reconcile the write through the lookup with its ORIGINAL key — zero duplicate creates,
//! measured at the fake provider. A write that cannot be reconciled after the restart is
//! escalated with a case file as complete as before it: desired outcome, deadline, configured
//! fingerprint and the wait already used.

use std::{
    io::Write,
    net::{SocketAddr, TcpStream},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use backstop_core::reconcile::upstream_idempotency_key;
use backstop_fake_api::{FakeApi, FakeConfig, Fault, FaultRule, Handler, RouteConfig, RunningFake};
use backstop_store::{ActionId, AuditReader, SqliteStore, Store};

use crate::common::listening::{spawn_listening, Listening};

const AGENT_TOKEN: &str = "agent-token-restart";

fn policy(base_url: &str) -> String {
    format!(
        r#"
agents:
  restart-agent: {{ token_env: RESTART_AGENT_TOKEN }}
providers:
  fake:
    base_url: {base_url}
    idempotency_header: Idempotency-Key
    routes:
      "POST /v1/transfers":
        class: idempotent_write
        reconcile:
          by: idempotency_key
          lookup: "GET /v1/transfers?idempotency_key={{key}}"
          found_pointer: /data/0/id
      "GET /v1/transfers": {{ class: read }}
      "POST /v1/invoices":
        class: idempotent_write
        fingerprint_fields: [/customer]
"#
    )
}

/// `backstop serve` of `config` with the database `store` on a loopback port of the system's
/// choice, once it says where it listens (at most `limit`).
fn serve(config: &Path, store: &Path, limit: Duration) -> Listening {
    let mut command = Command::new(env!("CARGO_BIN_EXE_backstop"));
    command
        .args(["serve", "--config"])
        .arg(config)
        .args(["--listen", "127.0.0.1:0", "--store"])
        .arg(store)
        .env_remove("RUST_LOG")
        .env("RESTART_AGENT_TOKEN", AGENT_TOKEN)
        .stdout(Stdio::null());
    spawn_listening(&mut command, limit)
}

/// A runtime of one worker thread for the fake provider.
pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime")
}

/// Starts the fake provider with `config` on a loopback port, inside `runtime`.
pub(crate) fn start_fake(runtime: &tokio::runtime::Runtime, config: FakeConfig) -> RunningFake {
    runtime.block_on(async {
        FakeApi::start(config, "127.0.0.1:0".parse().unwrap()).expect("fake starts")
    })
}

/// A handler that creates objects in `collection` with ids starting `prefix` (no reference).
pub(crate) fn create(collection: &str, prefix: &str) -> Handler {
    Handler::Create {
        collection: collection.into(),
        id_prefix: prefix.into(),
        reference_field: None,
        unique_reference: false,
    }
}

/// The first gateway of a test: its policy file, database, address and process.
struct FirstGateway {
    policy_file: PathBuf,
    db: PathBuf,
    addr: SocketAddr,
    process: Listening,
}

/// Writes the policy for the fake provider at `base_url` to `dir/policy.yaml` and serves it on a
/// loopback port with the database `dir/backstop.db`, once it listens (at most 20 s).
fn first_gateway(dir: &Path, base_url: &str) -> FirstGateway {
    let policy_file = dir.join("policy.yaml");
    std::fs::write(&policy_file, policy(base_url)).unwrap();
    let db = dir.join("backstop.db");
    let process = serve(&policy_file, &db, Duration::from_secs(20));
    FirstGateway {
        policy_file,
        db,
        addr: process.addr,
        process,
    }
}

/// Serves the same `(policy file, database)` again (on a port of its own: nothing connects to
/// it) until the audit log has the event `kind` for `action` (at most 30 s, `what` names the
/// wait), then kills that gateway.
fn restart_until_audited(
    (policy_file, db): (&Path, &Path),
    action: ActionId,
    kind: &str,
    what: &str,
) {
    let mut second = serve(policy_file, db, Duration::from_secs(20));
    wait_until(what, Duration::from_secs(30), || audited(db, action, kind));
    second.kill();
}

/// Polls `ready` every 50 ms, at most `limit` long (a bounded poll of another process, not a
/// sleep that waits for a race to settle).
pub(crate) fn wait_until(what: &str, limit: Duration, mut ready: impl FnMut() -> bool) {
    let step = Duration::from_millis(50);
    let mut polled = Duration::ZERO;
    while !ready() {
        assert!(polled < limit, "timed out waiting for {what}");
        std::thread::sleep(step);
        polled += step;
    }
}

/// Whether the audit log of `db` has an event `kind` for `action`, read through the read-only
/// audit reader (a running gateway holds the store's write lock, so the store is not opened).
fn audited(db: &Path, action: ActionId, kind: &str) -> bool {
    let Ok(reader) = AuditReader::open(db) else {
        return false;
    };
    let mut out = Vec::new();
    if reader.export(0, &mut out).is_err() {
        return false;
    }
    String::from_utf8_lossy(&out).lines().any(|line| {
        serde_json::from_str::<serde_json::Value>(line)
            .is_ok_and(|e| e["kind"] == kind && e["action"] == action.0)
    })
}

/// The one attempt left `sent` without a result, read once the gateway is dead (its write lock
/// went with it); the store is closed again before the next gateway starts.
fn the_unfinished_attempt(db: &Path) -> backstop_store::UnfinishedAttempt {
    let unfinished = SqliteStore::open_existing(db)
        .expect("store readable")
        .unfinished_attempts()
        .expect("unfinished attempts");
    assert_eq!(unfinished.len(), 1, "{unfinished:?}");
    unfinished.into_iter().next().expect("one")
}

#[test]
fn sigkill_after_an_uncertain_write_resumes_reconciliation_with_the_original_key() {
    let runtime = runtime();
    let config = FakeConfig::default()
        .with_route(
            RouteConfig::new("POST /v1/transfers", create("transfers", "tr_"))
                .with_idempotency()
                // Commit the write, then hold the connection long enough to kill backstop.
                .with_fault(FaultRule::on_calls(
                    [1],
                    Fault::StoreThenDrop { hold_ms: 30_000 },
                )),
        )
        .with_route(RouteConfig::new(
            "GET /v1/transfers",
            Handler::Lookup {
                collection: "transfers".into(),
            },
        ));
    let fake = start_fake(&runtime, config);

    let dir = tempfile::tempdir().unwrap();
    let FirstGateway {
        policy_file,
        db,
        addr,
        process: mut first,
    } = first_gateway(dir.path(), &fake.url());

    // The agent's write; its answer never comes (backstop dies first).
    let body = r#"{"amount":100,"currency":"EUR"}"#;
    let mut agent = TcpStream::connect(addr).expect("connect");
    write!(
        agent,
        "POST /fake/v1/transfers HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {AGENT_TOKEN}\r\nX-Backstop-Task: run-restart\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("write request");

    // Kill only once the attempt is durably `sent` and the fake has committed the create.
    wait_until(
        "the write to be committed upstream",
        Duration::from_secs(20),
        || fake.attempts().iter().any(|a| a.method == "POST"),
    );
    first.kill();
    drop(agent);
    let unfinished = the_unfinished_attempt(&db);
    let original_key = unfinished.idempotency_key.clone();
    let action = unfinished.action;

    restart_until_audited(
        (&policy_file, &db),
        action,
        "reconciled",
        "reconciliation after the restart",
    );

    let attempts = fake.attempts();
    let creates: Vec<_> = attempts.iter().filter(|a| a.method == "POST").collect();
    let lookups: Vec<_> = attempts.iter().filter(|a| a.method == "GET").collect();
    assert_eq!(creates.len(), 1, "zero duplicate creates: {attempts:?}");
    // The provider knows the key derived from the agent and its stored key, after a restart too.
    let upstream = upstream_idempotency_key("restart-agent", &original_key);
    assert_eq!(
        creates[0].idempotency_key.as_deref(),
        Some(upstream.as_str())
    );
    assert_eq!(lookups.len(), 1, "{attempts:?}");
    assert_eq!(
        lookups[0].query.as_deref(),
        Some(format!("idempotency_key={upstream}").as_str()),
        "the lookup uses the original key"
    );
    let store = SqliteStore::open_existing(&db).expect("store");
    let record = store.action(action).unwrap().expect("action");
    assert_eq!(record.outcome.map(|o| o.as_str()), Some("succeeded"));
    assert_eq!(record.idempotency_key, original_key);
    assert!(record
        .provider_operation_id
        .is_some_and(|op| op.starts_with("tr_")));
    assert!(store.unfinished_attempts().unwrap().is_empty());
    runtime.block_on(fake.shutdown());
}

/// A write submitted through the action API (`202 Accepted`), throttled once, whose second
/// attempt the provider commits and never answers when backstop is killed: the route has no
/// lookup and the provider honours keys, so the next start resends it under its original key
/// from the request the store kept — the provider replays its stored result, and one invoice
/// exists. Nobody had to resend it, and no human is asked.
#[test]
fn a_write_left_uncertain_by_a_crash_is_resent_from_its_kept_request_under_its_key_and_created_once(
) {
    let runtime = runtime();
    // The first call is throttled for 1 s; the second is committed and held until backstop dies.
    let config = FakeConfig::default().with_route(
        RouteConfig::new("POST /v1/invoices", create("invoices", "in_"))
            .with_idempotency()
            .with_fault(FaultRule::on_calls(
                [1],
                Fault::Status {
                    status: 429,
                    retry_after: Some("1".into()),
                    body: None,
                },
            ))
            .with_fault(FaultRule::on_calls(
                [2],
                Fault::StoreThenDrop { hold_ms: 30_000 },
            )),
    );
    let fake = start_fake(&runtime, config);

    let dir = tempfile::tempdir().unwrap();
    let FirstGateway {
        policy_file,
        db,
        addr,
        process: mut first,
    } = first_gateway(dir.path(), &fake.url());

    // Submitted through the action API, with a deadline and the desired outcome in words.
    let payload = r#"{"customer":"cus_7","amount":70}"#;
    let submit = serde_json::json!({
        "provider": "fake",
        "method": "POST",
        "path": "/v1/invoices",
        "task": "run-restart-case",
        "deadline": "2099-03-01T00:00:00Z",
        "idempotency_key": "invoice-restart-1",
        "headers": {"content-type": "application/json"},
        "body": payload,
        "desired_outcome": "invoice 7 issued exactly once"
    })
    .to_string();
    let mut agent = TcpStream::connect(addr).expect("connect");
    write!(
        agent,
        "POST /v1/actions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {AGENT_TOKEN}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{submit}",
        submit.len()
    )
    .expect("write request");

    wait_until(
        "the second attempt to be committed upstream",
        Duration::from_secs(20),
        || {
            fake.attempts()
                .iter()
                .filter(|a| a.method == "POST")
                .count()
                == 2
        },
    );
    first.kill();
    drop(agent);
    let action = the_unfinished_attempt(&db).action;

    restart_until_audited(
        (&policy_file, &db),
        action,
        "action_finished",
        "the write to be finished after the restart",
    );

    let store = SqliteStore::open_existing(&db).expect("store");
    let record = store.action(action).unwrap().expect("action");
    assert_eq!(
        record.outcome.map(|o| o.as_str()),
        Some("succeeded"),
        "{record:?}"
    );
    assert!(
        store.open_escalations().unwrap().is_empty(),
        "no human is asked"
    );
    assert_eq!(
        store.kept_request(action).unwrap(),
        None,
        "the kept request is gone"
    );
    let posts: Vec<_> = fake
        .attempts()
        .into_iter()
        .filter(|a| a.method == "POST")
        .collect();
    assert_eq!(posts.len(), 3, "{posts:?}");
    let upstream = upstream_idempotency_key("restart-agent", "invoice-restart-1");
    assert!(
        posts
            .iter()
            .all(|a| a.idempotency_key.as_deref() == Some(upstream.as_str())),
        "every attempt under the one key: {posts:?}"
    );
    assert!(
        posts[2].replayed,
        "the provider replayed what it had: {posts:?}"
    );
    assert_eq!(
        posts[2].body_sha256, posts[1].body_sha256,
        "the kept request is the one sent before"
    );
    runtime.block_on(fake.shutdown());
}
