//! A crash fuzz of restart recovery (SPEC §6, §12, §13), measured at the fake provider.
//!
//! Why: restart recovery is a promise about every instant a gateway can die at, and a test that
//! kills it at one chosen instant checks one of them. Here agents keep sending writes — through
//! the proxy door with their `Idempotency-Key`, as `Prefer: respond-async`, and through
//! `POST /v1/actions` — to an in-process fake provider that drops connections before and after
//! committing, answers `429` with `Retry-After`, `503`, and answers late; meanwhile
//! `backstop serve` is killed with SIGKILL at instants drawn from a seeded generator and started
//! again on the same store, over and over. Agents resend under their keys whatever was cut off.
//! After a last start and a bounded wait for recovery to finish, the provider's objects and the
//! store are counted: no logical write created twice, none lost (it exists at the provider, or
//! its outcome says it was not done and why), none left unfinished, and every escalation one a
//! human must decide (a lookup that could not settle it, a route with neither key support nor
//! lookup, or an unknown side effect on a route without lookup whose attempts are used up).
//!
//! The plan (which write goes where, how long each gateway lives) comes from [`SEED`]; the
//! instants themselves are real time, so two runs differ in detail and the seed is printed with
//! the figures. Run it alone: `cargo test -p backstop --test integration crash_fuzz -- --nocapture`.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::Path,
    process::{Command, Stdio},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Condvar, Mutex,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use backstop_core::reconcile::upstream_idempotency_key;
use backstop_fake_api::{FakeApi, FakeConfig, Fault, FaultRule, Handler, RouteConfig, RunningFake};
use backstop_store::{SqliteStore, Store};
use serde_json::Value;

use crate::common::listening::{spawn_listening, Listening};

/// The seed of the plan: the writes each agent sends, the life of each gateway, the fake's
/// faults. `CRASH_FUZZ_SEED` (decimal or `0x` hex) runs another plan.
const SEED: u64 = 0x00c0_ffee_5eed_0021;

/// [`SEED`], or the one `CRASH_FUZZ_SEED` names.
fn seed() -> u64 {
    let Ok(text) = std::env::var("CRASH_FUZZ_SEED") else {
        return SEED;
    };
    let parsed = match text.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => text.parse(),
    };
    parsed.unwrap_or_else(|e| panic!("CRASH_FUZZ_SEED={text}: {e}"))
}
/// How many times a running gateway is killed with SIGKILL.
const KILL_POINTS: usize = 110;
/// Agents sending writes at once, each one write at a time.
const AGENTS: usize = 6;
/// The agent all writes are sent as.
const AGENT: &str = "fuzz-agent";
const AGENT_TOKEN: &str = "agent-token-crash-fuzz";
/// How long one agent keeps resending one write before it gives up on it.
const PER_WRITE_LIMIT: Duration = Duration::from_secs(120);
/// How long recovery may take after the last start before what is left counts as stuck.
const SETTLE_LIMIT: Duration = Duration::from_secs(120);

/// SplitMix64 (Steele, Lea, Flood 2014): small, fast and enough to draw a plan from a seed.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `[low, high)`.
    fn between(&mut self, low: u64, high: u64) -> u64 {
        low + self.next() % (high - low)
    }
}

/// The write routes of the fuzz, as the agents call them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Route {
    /// A provider that honours keys, with a lookup by key: uncertain writes are looked up.
    Transfers,
    /// A provider that honours keys, no lookup: uncertain writes are resent under the key.
    Invoices,
    /// A provider with neither key support nor lookup: an uncertain write is a human's call.
    Notes,
}

impl Route {
    const ALL: [Route; 3] = [Route::Transfers, Route::Invoices, Route::Notes];

    fn provider(self) -> &'static str {
        match self {
            Route::Transfers | Route::Invoices => "fake",
            Route::Notes => "plain",
        }
    }

    fn collection(self) -> &'static str {
        match self {
            Route::Transfers => "transfers",
            Route::Invoices => "invoices",
            Route::Notes => "notes",
        }
    }

    fn path(self) -> String {
        format!("/v1/{}", self.collection())
    }
}

/// How an agent hands a write to backstop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Way {
    /// The proxy door, waiting for the provider's answer.
    Sync,
    /// The proxy door with `Prefer: respond-async` (`202 Accepted`).
    RespondAsync,
    /// `POST /v1/actions` (`202 Accepted`).
    ActionsApi,
}

/// One logical write: what the agent asked for, under one key.
#[derive(Debug, Clone)]
struct Write {
    key: String,
    reference: String,
    route: Route,
    way: Way,
    body: String,
}

/// How the agent's last send of a write was answered.
#[derive(Debug, Clone, PartialEq, Eq)]
enum AgentEnd {
    /// The provider's success passed through (`2xx` but `202`).
    Done(u16),
    /// `202 Accepted`: backstop owns the write from here.
    Accepted,
    /// A final answer other than a success: the status and the problem's type.
    Final(u16, String),
    /// Still no final answer after [`PER_WRITE_LIMIT`].
    GaveUp,
}

/// A write and how it ended for its agent.
#[derive(Debug, Clone)]
struct Sent {
    write: Write,
    end: AgentEnd,
    sends: u32,
}

/// The address agents send to: `None` while no gateway is up.
#[derive(Default)]
struct Door {
    addr: Mutex<Option<SocketAddr>>,
    opened: Condvar,
}

impl Door {
    fn open(&self, addr: SocketAddr) {
        *self.addr.lock().unwrap() = Some(addr);
        self.opened.notify_all();
    }

    fn close(&self) {
        *self.addr.lock().unwrap() = None;
    }

    /// The gateway's address once one is up (at most 1 s of waiting, then `None`).
    fn wait_open(&self) -> Option<SocketAddr> {
        let guard = self.addr.lock().unwrap();
        let (guard, _) = self
            .opened
            .wait_timeout_while(guard, Duration::from_secs(1), |addr| addr.is_none())
            .unwrap();
        *guard
    }
}

fn policy(base_url: &str) -> String {
    format!(
        r#"
agents:
  {AGENT}: {{ token_env: CRASH_FUZZ_AGENT_TOKEN }}
request_classes:
  idempotent_write: {{ max_attempts: 5, max_wait_seconds: 60 }}
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
      "POST /v1/invoices": {{ class: idempotent_write }}
  plain:
    base_url: {base_url}
    routes:
      "POST /v1/notes": {{ class: uncertain_write }}
"#
    )
}

/// The fake provider: each write route creates objects carrying the agent's `reference`, so a
/// write created twice shows as two objects; its faults drawn from the fake's seeded generator.
fn fake_config(seed: u64) -> FakeConfig {
    let status = |status: u16, retry_after: Option<&str>| Fault::Status {
        status,
        retry_after: retry_after.map(str::to_owned),
        body: None,
    };
    let faults = [
        // Drops after the commit, at once and held long enough for kills to land meanwhile.
        (0.06, Fault::StoreThenDrop { hold_ms: 0 }),
        (0.04, Fault::StoreThenDrop { hold_ms: 300 }),
        // Drops before any commit, at once and after a wait.
        (0.06, Fault::Drop),
        (0.03, Fault::Timeout { hold_ms: 300 }),
        (0.06, status(429, Some("1"))),
        (0.05, status(503, None)),
        // A late answer: the work is done at once, the answer follows.
        (0.06, Fault::Slow { hold_ms: 200 }),
    ];
    let mut config = FakeConfig::default().with_seed(seed);
    for route in Route::ALL {
        let mut write = RouteConfig::new(
            &format!("POST {}", route.path()),
            Handler::Create {
                collection: route.collection().into(),
                id_prefix: format!("{}_", &route.collection()[..2]),
                reference_field: Some("reference".into()),
                unique_reference: false,
            },
        );
        if route != Route::Notes {
            write = write.with_idempotency();
        }
        for (p, fault) in &faults {
            write = write.with_fault(FaultRule::with_probability(*p, fault.clone()));
        }
        config = config.with_route(write).with_route(RouteConfig::new(
            &format!("GET {}", route.path()),
            Handler::Lookup {
                collection: route.collection().into(),
            },
        ));
    }
    config
}

/// `backstop serve` of `config` on `store`, once it says where it listens: one worker thread
/// (the machine has two cores and the store's writer wants one), attempts given up after 2 s.
fn serve(config: &Path, store: &Path, seed: u64) -> Listening {
    let mut command = Command::new(env!("CARGO_BIN_EXE_backstop"));
    command
        .args(["serve", "--config"])
        .arg(config)
        .args(["--listen", "127.0.0.1:0", "--store"])
        .arg(store)
        .args(["--worker-threads", "1", "--attempt-timeout-seconds", "2"])
        .args(["--seed", &seed.to_string()])
        .env_remove("RUST_LOG")
        .env("CRASH_FUZZ_AGENT_TOKEN", AGENT_TOKEN)
        .stdout(Stdio::null());
    spawn_listening(&mut command, Duration::from_secs(30))
}

/// An answer as an agent reads it.
struct Answer {
    status: u16,
    should_retry: bool,
    problem: String,
}

/// Sends `write` once to the gateway at `addr`.
fn send(http: &ureq::Agent, addr: SocketAddr, write: &Write) -> Result<Answer, ureq::Error> {
    let auth = format!("Bearer {AGENT_TOKEN}");
    let task = format!("task-{}", write.key);
    let response = match write.way {
        Way::Sync | Way::RespondAsync => {
            let url = format!(
                "http://{addr}/{}{}",
                write.route.provider(),
                write.route.path()
            );
            let mut request = http
                .post(&url)
                .header("Authorization", &auth)
                .header("X-Backstop-Task", &task)
                .header("Idempotency-Key", &write.key);
            if write.way == Way::RespondAsync {
                request = request.header("Prefer", "respond-async");
            }
            request
                .content_type("application/json")
                .send(write.body.as_bytes())?
        }
        Way::ActionsApi => {
            let submit = serde_json::json!({
                "provider": write.route.provider(),
                "method": "POST",
                "path": write.route.path(),
                "task": task,
                "idempotency_key": write.key,
                "headers": {"content-type": "application/json"},
                "body": write.body,
                "desired_outcome": format!("{} created once", write.reference),
            })
            .to_string();
            http.post(&format!("http://{addr}/v1/actions"))
                .header("Authorization", &auth)
                .content_type("application/json")
                .send(submit.as_bytes())?
        }
    };
    let mut response = response;
    let status = response.status().as_u16();
    let should_retry = response
        .headers()
        .get("x-should-retry")
        .is_some_and(|v| v.as_bytes() == b"true");
    let text = response.body_mut().read_to_string()?;
    let problem = serde_json::from_str::<Value>(&text)
        .ok()
        .and_then(|v| v["type"].as_str().map(str::to_owned))
        .unwrap_or_default();
    Ok(Answer {
        status,
        should_retry,
        problem,
    })
}

/// Sends `write` until it gets a final answer, resending it under its key after every cut
/// connection, every `409 idempotency_key_in_flight` and every answer that says to retry.
#[allow(clippy::disallowed_methods)] // the agent's own patience, not the gateway's clock
fn send_until_answered(http: &ureq::Agent, door: &Door, write: &Write) -> Sent {
    let began = Instant::now();
    let mut sends = 0;
    let end = loop {
        if began.elapsed() > PER_WRITE_LIMIT {
            break AgentEnd::GaveUp;
        }
        let Some(addr) = door.wait_open() else {
            continue;
        };
        sends += 1;
        let answer = match send(http, addr, write) {
            Ok(answer) => answer,
            Err(_) => {
                // Cut off, or a gateway gone: the next one is awaited by `wait_open`.
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        match answer.status {
            202 => break AgentEnd::Accepted,
            200..=299 => break AgentEnd::Done(answer.status),
            409 if answer.problem.ends_with("idempotency_key_in_flight") => {
                std::thread::sleep(Duration::from_millis(50));
            }
            _ if answer.should_retry => std::thread::sleep(Duration::from_millis(20)),
            status => break AgentEnd::Final(status, answer.problem),
        }
    };
    Sent {
        write: write.clone(),
        end,
        sends,
    }
}

/// Agent `n`: writes drawn from `seed` — 55 % transfers, 30 % invoices, 15 % notes; 60 % sync,
/// 20 % respond-async, 20 % the action API — one at a time until `stop` (then the last one
/// still gets its answer).
fn agent(n: usize, seed: u64, door: Arc<Door>, stop: Arc<AtomicBool>) -> Vec<Sent> {
    let mut draw = SplitMix64(seed);
    let http: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(90)))
        .build()
        .into();
    let mut sent = Vec::new();
    for i in 0.. {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let route = match draw.between(0, 100) {
            0..55 => Route::Transfers,
            55..85 => Route::Invoices,
            _ => Route::Notes,
        };
        let way = match draw.between(0, 100) {
            0..60 => Way::Sync,
            60..80 => Way::RespondAsync,
            _ => Way::ActionsApi,
        };
        let reference = format!("w-{n}-{i}");
        let body = serde_json::json!({"reference": reference, "amount": draw.between(1, 10_000)})
            .to_string();
        let write = Write {
            key: format!("fz-{n}-{i}"),
            reference,
            route,
            way,
            body,
        };
        sent.push(send_until_answered(&http, &door, &write));
    }
    sent
}

/// A runtime of one worker thread for the fake provider.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime")
}

fn start_fake(runtime: &tokio::runtime::Runtime, seed: u64) -> RunningFake {
    runtime.block_on(async {
        FakeApi::start(fake_config(seed), "127.0.0.1:0".parse().unwrap()).expect("fake starts")
    })
}

/// Writes of the store not ended yet, read beside the running gateway (a read-only connection;
/// SQLite's WAL lets it read while the gateway writes). `None` when it cannot be read now.
fn unfinished_writes(db: &Path) -> Option<i64> {
    let connection =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .ok()?;
    connection
        .query_row(
            "SELECT COUNT(*) FROM actions WHERE method <> 'GET' AND outcome IS NULL",
            [],
            |row| row.get(0),
        )
        .ok()
}

/// Polls `ready` every 100 ms for at most `limit`: whether it became true (a bounded poll of
/// another process, not a sleep that waits for a race to settle).
fn poll_until(limit: Duration, mut ready: impl FnMut() -> bool) -> bool {
    let step = Duration::from_millis(100);
    let mut polled = Duration::ZERO;
    while !ready() {
        if polled >= limit {
            return false;
        }
        std::thread::sleep(step);
        polled += step;
    }
    true
}

/// The objects the fake provider holds, by `(route, reference)`: their ids. Read through the
/// fake's own list routes, which backstop's policy does not all name.
fn provider_objects(fake: &RunningFake) -> BTreeMap<(Route, String), Vec<String>> {
    let http: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let mut objects: BTreeMap<(Route, String), Vec<String>> = BTreeMap::new();
    for route in Route::ALL {
        let text = http
            .get(&format!("{}{}", fake.url(), route.path()))
            .call()
            .expect("the fake lists its objects")
            .body_mut()
            .read_to_string()
            .expect("the list");
        let list: Value = serde_json::from_str(&text).expect("JSON");
        for object in list["data"].as_array().expect("a list") {
            let reference = object["reference"].as_str().unwrap_or("").to_owned();
            let id = object["id"].as_str().unwrap_or("").to_owned();
            objects.entry((route, reference)).or_default().push(id);
        }
    }
    objects
}

/// Why a human was asked, read from an escalation's case file: one of the reasons a human
/// must decide, or `needless`.
///
/// - no key and no lookup: nothing can tell whether the write happened, nor resend it safely;
/// - an inconclusive lookup: the provider was asked and its answer settled nothing;
/// - no lookup, and the class's attempts all used with an attempt left uncertain: whether the
///   write happened is unknown, and sending it again needs an authority the policy did not
///   give (a route with a lookup asks it instead, and must not land here).
fn escalation_kind(case_file: &Value) -> &'static str {
    let no_key = case_file["honours_key"] == Value::Bool(false);
    let no_lookup = case_file["reconciliation_query"].is_null();
    let detail = case_file["reason_detail"].as_str().unwrap_or("");
    let budget = &case_file["budget"];
    // A write resumed after a restart may use one attempt over its class's, the resend its
    // recovery judged safe (the provider honours the key): used up either way.
    let used_up = match (
        budget["attempts_used"].as_u64(),
        budget["max_attempts"].as_u64(),
    ) {
        (Some(used), Some(max)) => used >= max,
        _ => false,
    };
    let last_uncertain = case_file["attempts"]
        .as_array()
        .and_then(|a| a.last())
        .is_some_and(|a| a["disposition"] == "uncertain");
    if no_key && no_lookup {
        "no key and no lookup"
    } else if detail.contains("inconclusive") {
        "inconclusive lookup"
    } else if no_lookup && used_up && (last_uncertain || detail.contains("may have been acted on"))
    {
        "no lookup, attempts used up, an attempt left uncertain"
    } else {
        "needless"
    }
}

/// What went wrong with one write, for the report.
struct Finding {
    what: &'static str,
    sent: Sent,
    action: Option<backstop_store::ActionRecord>,
    created: usize,
}

/// What recovery did, from the audit log: attempts a kill cut off (their result recorded by
/// the next start), writes resumed under their key, lookups, and the agents' same-key resends
/// that reopened a write.
fn recovery_figures(store: &SqliteStore) -> String {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    let mut since = 0;
    loop {
        let page = store
            .audit_events(since, 1000)
            .expect("the audit log reads");
        let Some(last) = page.last() else { break };
        since = last.seq;
        for e in &page {
            let source = e.source.as_deref().unwrap_or("");
            let figure = match e.kind.as_str() {
                "action_result" if source.contains("restarted") => "attempts cut by a kill",
                "action_reopened" if source == backstop_store::RESUMED_AFTER_RESTART => {
                    "writes resumed after a restart"
                }
                "action_reopened" => "writes reopened by a same-key resend",
                "reconciliation_lookup" => "lookups",
                "reconciled" => "reconciled",
                _ => continue,
            };
            *counts.entry(figure).or_default() += 1;
        }
    }
    counts
        .iter()
        .map(|(figure, n)| format!("{figure} {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The store's story of `action` for a report: its attempts and its audit events.
fn story(store: &SqliteStore, action: &backstop_store::ActionRecord) -> String {
    let attempts = store.attempts(action.id).unwrap_or_default();
    let attempts: Vec<String> = attempts
        .iter()
        .map(|a| format!("{}:{:?}:{:?}:{:?}", a.n, a.state, a.status, a.disposition))
        .collect();
    let mut events = Vec::new();
    let mut since = 0;
    loop {
        let page = store.audit_events(since, 1000).unwrap_or_default();
        let Some(last) = page.last() else { break };
        since = last.seq;
        events.extend(
            page.into_iter()
                .filter(|e| e.action == Some(action.id.0))
                .map(|e| {
                    format!(
                        "{}{}{}{}{}",
                        e.kind,
                        e.attempt.map(|n| format!(" #{n}")).unwrap_or_default(),
                        e.status.map(|s| format!(" {s}")).unwrap_or_default(),
                        e.outcome.map(|o| format!(" {o}")).unwrap_or_default(),
                        e.source.map(|s| format!(" ({s})")).unwrap_or_default(),
                    )
                }),
        );
    }
    format!(
        "state {} outcome {:?} context {}; attempts [{}]; audit [{}]",
        action.state.as_str(),
        action.outcome.map(|o| o.as_str()),
        action
            .outcome_context
            .as_ref()
            .map_or("none".to_owned(), Value::to_string),
        attempts.join(", "),
        events.join(", ")
    )
}

#[test]
#[allow(clippy::disallowed_methods)] // the run time is reported, not used to decide anything
fn crash_fuzz_sigkills_at_seeded_instants_leave_no_duplicate_no_lost_and_no_stuck_write() {
    let began = Instant::now();
    let seed = seed();
    println!("crash fuzz: seed {seed:#018x}, {KILL_POINTS} kill points, {AGENTS} agents");
    let runtime = runtime();
    let fake = start_fake(&runtime, seed);
    let dir = tempfile::tempdir().unwrap();
    let policy_file = dir.path().join("policy.yaml");
    std::fs::write(&policy_file, policy(&fake.url())).unwrap();
    let db = dir.path().join("backstop.db");

    let mut plan = SplitMix64(seed);
    let door = Arc::new(Door::default());
    let stop = Arc::new(AtomicBool::new(false));
    let agents: Vec<JoinHandle<Vec<Sent>>> = (0..AGENTS)
        .map(|n| {
            let (seed, door, stop) = (plan.next(), door.clone(), stop.clone());
            std::thread::spawn(move || agent(n, seed, door, stop))
        })
        .collect();

    // Each gateway lives for a drawn while after it listens: a quarter of them die within
    // 40 ms (while recovery of the last crash runs), the others within 40–300 ms.
    let mut logs = Vec::with_capacity(KILL_POINTS + 1);
    for _ in 0..KILL_POINTS {
        let mut gateway = serve(&policy_file, &db, plan.next());
        door.open(gateway.addr);
        let life = if plan.between(0, 4) == 0 {
            plan.between(2, 40)
        } else {
            plan.between(40, 300)
        };
        std::thread::sleep(Duration::from_millis(life));
        door.close();
        logs.push(gateway.kill());
    }

    // The last start: agents finish the write they hold, and recovery finishes the rest.
    let mut last = serve(&policy_file, &db, plan.next());
    door.open(last.addr);
    stop.store(true, Ordering::SeqCst);
    let sent: Vec<Sent> = agents
        .into_iter()
        .flat_map(|a| a.join().expect("agent"))
        .collect();
    let settled = poll_until(SETTLE_LIMIT, || unfinished_writes(&db) == Some(0));
    door.close();
    logs.push(last.kill());

    // Counted at the provider, then in the store the last gateway left.
    let objects = provider_objects(&fake);
    let attempts = fake.attempts();
    let posts = attempts.iter().filter(|a| a.method == "POST").count();
    let replayed = attempts.iter().filter(|a| a.replayed).count();
    let store = SqliteStore::open_existing(&db).expect("the store opens");

    let mut findings: Vec<Finding> = Vec::new();
    let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
    let mut ways: BTreeMap<Way, usize> = BTreeMap::new();
    let mut escalations: Vec<(i64, Route, &'static str, String)> = Vec::new();
    let mut created_writes = 0;
    for s in &sent {
        *ways.entry(s.write.way).or_default() += 1;
        let created = objects
            .get(&(s.write.route, s.write.reference.clone()))
            .map_or(0, Vec::len);
        created_writes += usize::from(created > 0);
        let action = store.action_by_key(AGENT, &s.write.key).expect("store");
        let finding = |what| Finding {
            what,
            sent: s.clone(),
            action: action.clone(),
            created,
        };
        if created > 1 {
            findings.push(finding("duplicate"));
        }
        if matches!(s.end, AgentEnd::Done(_)) && created == 0 {
            findings.push(finding("lost: answered a success, nothing at the provider"));
        }
        if s.end == AgentEnd::GaveUp {
            findings.push(finding("stuck: its agent never got a final answer"));
        }
        let Some(record) = &action else {
            if created > 0 {
                findings.push(finding("created at the provider without an action"));
            } else if !matches!(s.end, AgentEnd::Final(..)) {
                findings.push(finding("lost: no action recorded"));
            }
            continue;
        };
        let Some(outcome) = record.outcome else {
            findings.push(finding("stuck: no outcome"));
            continue;
        };
        *outcomes.entry(outcome.as_str().to_owned()).or_default() += 1;
        match outcome.as_str() {
            "succeeded" if created == 0 => {
                findings.push(finding("lost: succeeded, nothing at the provider"))
            }
            "succeeded" => {}
            "escalated" => {
                let opened = store.escalations_of_action(record.id).expect("store");
                if opened.is_empty() {
                    findings.push(finding("escalated without an escalation"));
                }
                for e in opened {
                    let kind = escalation_kind(&e.case_file);
                    let detail = e.case_file["reason_detail"]
                        .as_str()
                        .unwrap_or("")
                        .to_owned();
                    if kind == "needless" {
                        findings.push(finding("needless escalation"));
                    }
                    escalations.push((record.id.0, s.write.route, kind, detail));
                }
            }
            // Not done: it must not have been, and its context must say why.
            _ if created > 0 => findings.push(finding("misreported: created, outcome says not")),
            _ if record.outcome_context.is_none() => {
                findings.push(finding("lost: not done and no reason recorded"))
            }
            _ => {}
        }
        if store.kept_request(record.id).expect("store").is_some() {
            findings.push(finding("stuck: its kept request is still there"));
        }
    }
    // What recovery still holds anywhere in the store.
    let unfinished = store.unfinished_attempts().expect("store").len();
    let unsent = store.unsent_writes().expect("store").len();
    let between = store.actions_between_attempts().expect("store").len();
    let retries = store.scheduled_retries().expect("store").len();
    let leftovers = unfinished + unsent + between + retries;
    let known: std::collections::BTreeSet<(Route, String)> = sent
        .iter()
        .map(|s| (s.write.route, s.write.reference.clone()))
        .collect();
    let strangers = objects.keys().filter(|k| !known.contains(k)).count();
    let audit = store.verify_audit(None).expect("the audit log reads");
    let recovery = recovery_figures(&store);

    let count = |prefix: &str| {
        findings
            .iter()
            .filter(|f| f.what.starts_with(prefix))
            .count()
    };
    let (duplicates, lost, stuck) = (count("duplicate"), count("lost"), count("stuck"));
    let mut why: BTreeMap<&str, usize> = BTreeMap::new();
    for (_, _, kind, _) in &escalations {
        *why.entry(kind).or_default() += 1;
    }
    for (action, route, kind, detail) in &escalations {
        println!("escalated: action {action} ({route:?}), {kind}: {detail}");
    }
    println!(
        "crash fuzz: seed {seed:#018x}: {KILL_POINTS} kill points, {} logical writes ({} sync, {} respond-async, {} action API; {} created at the provider, {posts} POSTs received, {replayed} replayed), duplicates {duplicates}, lost {lost}, stuck {stuck} (+{leftovers} left in the store), escalated {} ({}), outcomes {:?}; recovery: {recovery}; settled {settled}, {:.0} s",
        sent.len(),
        ways.get(&Way::Sync).unwrap_or(&0),
        ways.get(&Way::RespondAsync).unwrap_or(&0),
        ways.get(&Way::ActionsApi).unwrap_or(&0),
        created_writes,
        escalations.len(),
        why.iter()
            .map(|(k, n)| format!("{k}: {n}"))
            .collect::<Vec<_>>()
            .join(", "),
        outcomes,
        began.elapsed().as_secs_f64(),
    );
    for f in &findings {
        let id = f.action.as_ref().map(|a| a.id.0);
        println!(
            "finding: {} — {:?} via {:?}, key {}, reference {}, agent end {:?} after {} sends, created {}, action {:?}: {}",
            f.what,
            f.sent.write.route,
            f.sent.write.way,
            f.sent.write.key,
            f.sent.write.reference,
            f.sent.end,
            f.sent.sends,
            f.created,
            id,
            f.action.as_ref().map_or("no action".to_owned(), |a| story(&store, a)),
        );
        let upstream = upstream_idempotency_key(AGENT, &f.sent.write.key);
        for a in attempts
            .iter()
            .filter(|a| a.idempotency_key.as_deref() == Some(upstream.as_str()))
        {
            println!(
                "  at the provider: #{} {} {} call {:?} status {:?} {:?} fault {:?} replayed {}",
                a.seq, a.at, a.method, a.call, a.status, a.outcome, a.fault, a.replayed
            );
        }
        if let Some(id) = id {
            let needle = format!("action={id} ");
            for (run, log) in logs.iter().enumerate() {
                let lines: Vec<&str> = log.lines().filter(|l| l.contains(&needle)).collect();
                if !lines.is_empty() {
                    println!("  gateway run {run}:");
                }
                for line in lines {
                    println!("  log: {line}");
                }
            }
        }
    }
    assert!(
        findings.is_empty(),
        "{} findings (above): duplicates {duplicates}, lost {lost}, stuck {stuck}",
        findings.len()
    );
    assert_eq!(leftovers, 0, "unfinished attempts {unfinished}, unsent writes {unsent}, actions between attempts {between}, scheduled retries {retries}");
    assert!(settled, "recovery did not finish within {SETTLE_LIMIT:?}");
    assert_eq!(strangers, 0, "objects at the provider no agent asked for");
    assert!(
        matches!(audit, backstop_store::audit::Verdict::Intact { .. }),
        "the audit chain after {KILL_POINTS} kills: {audit:?}"
    );
    assert!(
        escalations
            .iter()
            .all(|(_, _, kind, _)| *kind != "needless"),
        "needless escalations"
    );
    assert!(
        sent.len() >= 100,
        "a write-heavy run: {} writes",
        sent.len()
    );
    runtime.block_on(fake.shutdown());
}

/// Found by the fuzz, reproduced without a crash: a write whose attempt the provider committed
/// and never answered (`uncertain`), on a route that honours keys and has no lookup, is resent
/// under its key; when those resends are only throttled (`429`, which says nothing of the
/// earlier attempt) until the class's attempts are used, the write must not end as if it had
/// not been done — its side effect is unknown (it did happen: the provider holds the invoice).
#[test]
fn a_write_left_uncertain_then_throttled_to_the_end_of_its_budget_is_not_reported_as_not_done() {
    let runtime = runtime();
    let throttled = Fault::Status {
        status: 429,
        retry_after: Some("1".into()),
        body: None,
    };
    let config = FakeConfig::default().with_route(
        RouteConfig::new(
            "POST /v1/invoices",
            Handler::Create {
                collection: "invoices".into(),
                id_prefix: "in_".into(),
                reference_field: Some("reference".into()),
                unique_reference: false,
            },
        )
        .with_idempotency()
        .with_script([
            Fault::StoreThenDrop { hold_ms: 0 },
            throttled.clone(),
            throttled,
        ]),
    );
    // The fake's list routes, which the count at the provider reads.
    let config = Route::ALL.iter().fold(config, |config, route| {
        config.with_route(RouteConfig::new(
            &format!("GET {}", route.path()),
            Handler::Lookup {
                collection: route.collection().into(),
            },
        ))
    });
    let fake = runtime.block_on(async {
        FakeApi::start(config, "127.0.0.1:0".parse().unwrap()).expect("fake starts")
    });
    let dir = tempfile::tempdir().unwrap();
    let policy_file = dir.path().join("policy.yaml");
    let policy = policy(&fake.url()).replace("max_attempts: 5", "max_attempts: 3");
    std::fs::write(&policy_file, policy).unwrap();
    let db = dir.path().join("backstop.db");
    let mut gateway = serve(&policy_file, &db, 7);

    let http: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(60)))
        .build()
        .into();
    let write = Write {
        key: "invoice-once".into(),
        reference: "w-once".into(),
        route: Route::Invoices,
        way: Way::Sync,
        body: r#"{"reference":"w-once","amount":70}"#.into(),
    };
    let answer = send(&http, gateway.addr, &write).expect("answered");
    gateway.kill();

    let posts: Vec<_> = fake
        .attempts()
        .into_iter()
        .filter(|a| a.method == "POST")
        .collect();
    assert_eq!(posts.len(), 3, "{posts:?}");
    let objects = provider_objects(&fake);
    assert_eq!(
        objects
            .get(&(Route::Invoices, "w-once".to_owned()))
            .map(Vec::len),
        Some(1),
        "the first attempt created the invoice"
    );
    let store = SqliteStore::open_existing(&db).expect("store");
    let record = store
        .action_by_key(AGENT, "invoice-once")
        .unwrap()
        .expect("the action");
    let outcome = record.outcome.map(|o| o.as_str());
    assert!(
        matches!(outcome, Some("escalated" | "succeeded")),
        "answered {} {}; the store says {outcome:?} with {:?}",
        answer.status,
        answer.problem,
        record.outcome_context
    );
    runtime.block_on(fake.shutdown());
}

/// Found by the fuzz: restart recovery resumes a write between two attempts by moving it to
/// `reopened` (audited `action_reopened`, its retry job claimed as `resumed`) and then sends
/// it; a gateway killed between the two leaves the write in exactly the state built here,
/// through the store, before `serve` starts on it. Nothing of it is left to send it but the
/// next start — a `202`-accepted write has no agent resending it.
#[test]
fn a_write_resumed_by_recovery_and_killed_before_its_resend_is_sent_at_the_next_start() {
    use crate::common::at;
    use backstop_store::{
        Admission, AttemptResult, Disposition, KeptRequest, NewAction, NewTask, PayloadDigest,
        Priority, RouteTemplate,
    };

    let runtime = runtime();
    let config = FakeConfig::default().with_route(
        RouteConfig::new(
            "POST /v1/invoices",
            Handler::Create {
                collection: "invoices".into(),
                id_prefix: "in_".into(),
                reference_field: Some("reference".into()),
                unique_reference: false,
            },
        )
        .with_idempotency(),
    );
    let fake = runtime.block_on(async {
        FakeApi::start(config, "127.0.0.1:0".parse().unwrap()).expect("fake starts")
    });
    let dir = tempfile::tempdir().unwrap();
    let policy_file = dir.path().join("policy.yaml");
    std::fs::write(&policy_file, policy(&fake.url())).unwrap();
    let db = dir.path().join("backstop.db");

    let body = r#"{"reference":"w-resumed","amount":5}"#;
    let id = {
        let store = SqliteStore::open(&db).expect("store");
        store
            .open_task(
                NewTask {
                    id: "task-resumed".into(),
                    agent: AGENT.into(),
                    priority: Priority::Normal,
                    deadline: None,
                },
                at(0),
            )
            .unwrap();
        let Admission::New(id) = store
            .record_action(
                NewAction {
                    task_id: "task-resumed".into(),
                    agent: AGENT.into(),
                    provider: "fake".into(),
                    method: "POST".into(),
                    route: RouteTemplate::try_new("/v1/invoices").unwrap(),
                    request_class: "idempotent_write".into(),
                    payload_digest: PayloadDigest::of(body.as_bytes()),
                    target_digest: None,
                    idempotency_key: "resumed-once".into(),
                    external_reference: None,
                    desired_outcome: None,
                    fingerprint: None,
                    request: Some(KeptRequest {
                        method: "POST".into(),
                        url: format!("{}/v1/invoices", fake.url()),
                        headers: vec![("content-type".into(), "application/json".into())],
                        body: body.as_bytes().to_vec(),
                    }),
                },
                at(0),
            )
            .unwrap()
        else {
            panic!("a new action");
        };
        let attempt = store.mark_attempt_sent(id, at(1)).unwrap();
        store
            .record_result(
                AttemptResult {
                    action: id,
                    attempt,
                    status: Some(503),
                    disposition: Disposition::Unavailable,
                    boundary: None,
                    source: None,
                    provider_operation_id: None,
                    signal_headers: Vec::new(),
                    finish: None,
                },
                at(2),
            )
            .unwrap();
        // What recovery records before it sends the resumed write; the kill comes next.
        store.resume_after_restart(id, at(3)).unwrap();
        id
    };

    let mut gateway = serve(&policy_file, &db, 11);
    let sent = poll_until(Duration::from_secs(20), || {
        fake.attempts().iter().any(|a| a.method == "POST")
    });
    gateway.kill();
    let store = SqliteStore::open_existing(&db).expect("store");
    let record = store.action(id).unwrap().expect("the action");
    assert!(
        sent,
        "the resumed write was never sent: state {}, outcome {:?}, attempts {:?}",
        record.state.as_str(),
        record.outcome.map(|o| o.as_str()),
        store.attempts(id).unwrap()
    );
    assert_eq!(record.outcome.map(|o| o.as_str()), Some("succeeded"));
    runtime.block_on(fake.shutdown());
}
