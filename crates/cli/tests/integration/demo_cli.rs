//! `backstop demo` as a new user runs it: the binary, a fresh directory, no terminal. The
//! assertions are on the printed timeline and table — the numbers a reader takes away — and on
//! the evidence it leaves behind (a store whose audit chain verifies, an NDJSON export).

use std::{
    process::{Command, Stdio},
    time::Duration,
};

use crate::common::listening::spawn_listening;

fn backstop() -> Command {
    Command::new(env!("CARGO_BIN_EXE_backstop"))
}

/// Runs `command` and fails the test if it has not finished after 30 s (the demo's promise),
/// polling every 100 ms.
fn run_within_30_seconds(command: &mut Command) -> std::process::Output {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("backstop starts");
    for _ in 0..300 {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let output = child.wait_with_output().expect("output");
    panic!(
        "backstop demo did not finish within 30 s; stdout so far:\n{}",
        String::from_utf8_lossy(&output.stdout)
    );
}

#[test]
fn demo_prints_the_timeline_the_table_and_the_commands_and_exits_zero() {
    let dir = tempfile::tempdir().expect("tempdir");
    let run_dir = dir.path().join("demo");
    // Started where `cargo run` starts it: above `target/`, so the binary lies under the
    // working directory.
    let exe = std::fs::canonicalize(env!("CARGO_BIN_EXE_backstop")).expect("binary path");
    let workdir = exe
        .ancestors()
        .nth(3)
        .expect("the binary is in <dir>/target/<profile>/")
        .to_path_buf();
    let output = run_within_30_seconds(
        backstop()
            .args(["demo", "--dir"])
            .arg(&run_dir)
            .current_dir(&workdir),
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        output.status.code(),
        Some(0),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );

    // No colour when stdout is not a terminal.
    assert!(!stdout.contains('\u{1b}'), "ANSI escapes in piped output");

    // The header names every scope the calls fell under (the export call has its own).
    assert!(
        stdout.contains("Three agent tasks call one fake provider under the quota scopes fake/account and fake/exports;"),
        "{stdout}"
    );
    // Instants are on the relative clock only, never absolute.
    let year = "2026-";
    let timeline = stdout.split("Summary").next().unwrap_or_default();
    assert!(
        !timeline
            .lines()
            .any(|l| l.starts_with('+') && l.contains(year) && l.contains('T')),
        "an absolute instant in the timeline:\n{timeline}"
    );
    // A scope row says a boundary once, and not once it lies in the past; a scope row that
    // repeats the previous one of its scope is left out.
    let mut last: std::collections::BTreeMap<String, String> = std::collections::BTreeMap::new();
    for line in timeline.lines().filter(|l| l.contains("scope updated")) {
        let at: f64 = line[1..line.find('s').unwrap()]
            .parse()
            .expect("relative time");
        if let Some(i) = line.find("not before +") {
            let rest = &line[i + "not before +".len()..];
            let b: f64 = rest[..rest.find('s').unwrap()].parse().expect("boundary");
            assert!(b > at, "a boundary in the past: {line}");
        }
        let scope = line.split_whitespace().nth(5).unwrap().to_owned();
        let said = line
            .split_whitespace()
            .skip(6)
            .collect::<Vec<_>>()
            .join(" ");
        assert_ne!(
            last.insert(scope, said.clone()),
            Some(said),
            "repeated: {line}"
        );
    }

    // The timeline: the 429, the delayed release, the dropped write reconciled, the escalation,
    // the cancellation — with relative times.
    assert!(stdout.contains("Timeline"));
    assert!(stdout.contains("+0.000s"));
    let line_with = |needles: &[&str]| {
        stdout
            .lines()
            .any(|line| needles.iter().all(|n| line.contains(n)))
    };
    assert!(line_with(&[
        "research-a",
        "result",
        "GET /v1/items/{id}",
        "429",
        "rate_limited"
    ]));
    assert!(line_with(&[
        "research-a",
        "retry scheduled",
        "wakes at +2."
    ]));
    assert!(line_with(&[
        "provider saw",
        "POST /v1/transfers",
        "dropped",
        "the provider stored the write, then dropped the connection"
    ]));
    assert!(line_with(&["research-a", "status query", "found"]));
    // The internal names stay out: quota header dialects and fault names are said in words.
    for internal in ["store_then_drop", "ietf quota headers", "fault status"] {
        assert!(!stdout.contains(internal), "{internal} in:\n{stdout}");
    }
    assert!(line_with(&["scope updated", "quota headers (IETF draft"]));
    // Each write's status query follows the uncertain result that caused it, and the provider's
    // record of the query stands between them.
    for task in ["research-a", "research-b"] {
        let at = |needles: &[&str]| {
            timeline
                .lines()
                .position(|l| needles.iter().all(|n| l.contains(n)))
                .unwrap_or_else(|| panic!("no {needles:?} line:\n{timeline}"))
        };
        let result = at(&[task, "result", "uncertain"]);
        let query = at(&[task, "status query"]);
        assert!(
            result < query,
            "{task}: the status query before its cause:\n{timeline}"
        );
        let seen = timeline.lines().skip(result).take(query - result).any(|l| {
            l.contains("provider saw") && l.contains("GET /v1/transfers?idempotency_key=")
        });
        assert!(
            seen,
            "{task}: the provider's status query is not between:\n{timeline}"
        );
    }
    // The timeline names the action ids the summary's waits use.
    assert!(line_with(&["research-a", " 1 ", "retry scheduled"]));
    assert!(line_with(&[
        "research-c",
        " 3 ",
        "sent",
        "GET /v1/items/{id}"
    ]));
    assert!(line_with(&["research-c", "action 3", "waited"]));
    assert!(line_with(&[
        "research-a",
        "reconciled",
        "demo-transfer-0001"
    ]));
    assert!(line_with(&[
        "research-b",
        "budget exhausted",
        "GET /v1/exports/{id} (/v1/exports/9)"
    ]));
    // The outcome line says why, from the answer's detail.
    assert!(line_with(&[
        "budget exhausted",
        "outcome budget_exhausted: ",
        "wait budget"
    ]));
    assert!(line_with(&[
        "research-b",
        "escalated",
        "POST /v1/transfers"
    ]));
    // The concrete path stands beside the template: two reads of one route stay apart.
    for path in ["(/v1/reports/1)", "(/v1/reports/2)"] {
        assert!(line_with(&[
            "research-c",
            "cancelled",
            "GET /v1/reports/{id} ",
            path,
            "outcome cancelled: "
        ]));
    }
    // A path equal to its template is not repeated.
    assert!(!stdout.contains("POST /v1/transfers (/v1/transfers)"));
    assert!(
        !stdout.contains("SPEC"),
        "the output cites the specification"
    );

    // The table: logical actions vs calls the provider saw.
    assert!(line_with(&[
        "research-a",
        " 2 ",
        " 3 ",
        "GET /v1/items/42 → 200 (2 attempts)"
    ]));
    assert!(line_with(&[
        "research-c",
        "GET /v1/reports/2 → 410 cancelled (0 attempts)"
    ]));
    // logical actions, requests sent, status queries, calls: the calls add up to what the
    // provider saw; a status query is not an attempt of the write it reconciles.
    let total: Vec<&str> = stdout
        .lines()
        .find(|l| l.starts_with("total"))
        .map(|l| l.split_whitespace().collect())
        .unwrap_or_default();
    assert_eq!(total, ["total", "8", "8", "2", "10"], "{stdout}");
    assert!(stdout.contains(
        "The provider saw 10 calls (= 8 requests + 2 status queries above) for 8 logical actions"
    ));
    assert!(line_with(&[
        "GET /v1/items/{id}",
        "4 calls (1 answered 429)"
    ]));
    assert!(line_with(&["POST /v1/transfers", "2 calls"]));
    assert!(line_with(&[
        "GET /v1/reports/{id}",
        "  1 call (1 answered 429)"
    ]));
    assert!(
        !stdout.contains(" 1 attempts") && !stdout.contains(" 1 calls"),
        "{stdout}"
    );
    assert!(!stdout.contains("(s)"), "{stdout}");
    assert!(line_with(&["retry after 2.", "Retry-After"]));
    assert!(line_with(&[
        "waited 2.",
        "delayed queue",
        "HTTP 429 Retry-After"
    ]));

    // The cancellation, in the terms of its answer: the counts overlap, so they are said of
    // the same actions, never added up into "delayed wakes" that outnumber the actions.
    let cancelled = stdout
        .lines()
        .find(|l| l.starts_with("Cancelled research-c: "))
        .expect("the cancellation's sentence");
    assert!(
        cancelled.contains(" ended cancelled; ")
            && cancelled.contains(
                " of them were waiting in the delayed queue and were dropped before they woke"
            ),
        "{cancelled}"
    );
    for internal in ["actions_cancelled", "waiting_dropped", "retries_dropped"] {
        assert!(!cancelled.contains(internal), "{cancelled}");
    }
    assert!(!cancelled.contains("wakes dropped"), "{cancelled}");

    // The open escalation and its options.
    assert!(line_with(&["escalation 1", "side_effect_unknown"]));
    for option in ["query_status", "retry_same_key", "abort", "send_new"] {
        assert!(line_with(&[option]), "option {option} missing");
    }
    assert!(line_with(&["send_new", "needs explicit confirmation"]));

    // Where the evidence is, and the exact commands to inspect it: they start with how this
    // binary is reached from where the demo ran (`backstop` only when that is what PATH finds).
    let db = run_dir.join("backstop.db");
    let audit = run_dir.join("audit.ndjson");
    // The store was closed cleanly, and nothing opened it after: no WAL files are left beside
    // it (checked before any command below reads it).
    for leftover in ["backstop.db-wal", "backstop.db-shm"] {
        assert!(!run_dir.join(leftover).exists(), "{leftover} left behind");
    }
    let relative = exe
        .strip_prefix(&workdir)
        .expect("under the working directory");
    let program = if stdout.contains("\n  backstop audit verify") {
        "backstop".to_owned()
    } else {
        relative.display().to_string()
    };
    assert!(program.contains('/') || program == "backstop", "{program}");
    assert!(stdout.contains(&format!("{program} audit verify --db {}", db.display())));
    assert!(stdout.contains(&format!("{program} audit export --db {}", db.display())));
    let policy = run_dir.join("policy.yaml");
    assert!(stdout.contains(&format!(
        "{program} snapshots export --db {} --policy {} | {program} diagnose -",
        db.display(),
        policy.display()
    )));
    // Each command runs as printed, from where the demo was started.
    let commands: Vec<&str> = stdout
        .split("Where to look")
        .nth(1)
        .expect("the section")
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with(&program))
        .collect();
    assert_eq!(commands.len(), 4, "{stdout}");
    for command in commands {
        let ran = Command::new("sh")
            .args(["-c", command])
            .current_dir(&workdir)
            .output()
            .expect("sh runs");
        assert!(
            ran.status.success(),
            "{command}: {}",
            String::from_utf8_lossy(&ran.stderr)
        );
        assert!(!ran.stdout.is_empty(), "{command} printed nothing");
    }
    // The open escalation, on a gateway serving the demo's store as printed (on a free port
    // instead of 8080, which the escalation commands are pointed at with BACKSTOP_URL): the
    // policy has an operator, so the escalation shows and takes a decision.
    let printed = |needle: &str| -> String {
        stdout
            .lines()
            .map(str::trim)
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no `{needle}` line: {stdout}"))
            .to_owned()
    };
    let serve = printed(" serve --config ");
    let (secrets, command) = split_env(&serve);
    assert!(
        secrets
            .iter()
            .any(|(name, _)| *name == "DEMO_OPERATOR_TOKEN"),
        "{serve}"
    );
    // On a port serve binds itself and names (one found free and let go could be taken first).
    let mut gateway = spawn_listening(
        Command::new(command[0])
            .args(&command[1..])
            .args(["--listen", "127.0.0.1:0"])
            .envs(secrets.iter().copied())
            .env_remove("RUST_LOG")
            .current_dir(&workdir)
            .stdout(Stdio::null()),
        Duration::from_secs(10),
    );
    let url = gateway.url();
    let run = |line: &str| {
        let (env, command) = split_env(line);
        Command::new(command[0])
            .args(&command[1..])
            .envs(env.iter().copied())
            .env("BACKSTOP_URL", &url)
            .current_dir(&workdir)
            .output()
            .expect("runs")
    };
    let shown = run(&printed(" escalations show 1"));
    let decided = run(&printed(" escalations decide 1 --option query_status"));
    let served = gateway.kill();
    assert!(
        shown.status.success(),
        "{}\nserve: {served}",
        String::from_utf8_lossy(&shown.stderr)
    );
    assert!(String::from_utf8_lossy(&shown.stdout).contains("side_effect_unknown"));
    assert!(
        decided.status.success(),
        "{}\nserve: {served}",
        String::from_utf8_lossy(&decided.stderr)
    );
    assert!(
        String::from_utf8_lossy(&decided.stdout).contains("lookup          inconclusive"),
        "{}",
        String::from_utf8_lossy(&decided.stdout)
    );

    // The suggested policy file is really there and valid for `snapshots export --policy`.
    let checked = std::process::Command::new(env!("CARGO_BIN_EXE_backstop"))
        .args(["policy", "check"])
        .arg(&policy)
        .output()
        .expect("run policy check");
    assert!(checked.status.success(), "{checked:?}");
    let exported = std::fs::read_to_string(&audit).expect("the audit export exists");
    assert!(exported.lines().count() > 20);
    assert!(!exported.contains("demo-provider-key") && !exported.contains("demo-agent-token"));

    // The evidence verifies with the tool the demo points at.
    let verify = backstop()
        .args(["audit", "verify", "--db"])
        .arg(&db)
        .output()
        .expect("verify runs");
    assert_eq!(
        verify.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&verify.stderr)
    );
}

/// A printed command line `NAME=value … program args…` as its environment assignments and its
/// words (the demo's paths here need no quoting).
fn split_env(line: &str) -> (Vec<(&str, &str)>, Vec<&str>) {
    assert!(!line.contains('\''), "quoted words: {line}");
    let words: Vec<&str> = line.split_whitespace().collect();
    let assignments = words
        .iter()
        .take_while(|w| w.contains('=') && !w.contains('/'))
        .count();
    let env = words[..assignments]
        .iter()
        .map(|w| w.split_once('=').expect("NAME=value"))
        .collect();
    (env, words[assignments..].to_vec())
}

#[test]
fn demo_refuses_a_directory_that_already_holds_a_store() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("backstop.db"), b"").expect("file");
    let output = backstop()
        .args(["demo", "--dir"])
        .arg(dir.path())
        .output()
        .expect("backstop runs");
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("already holds a store"), "{stderr}");
}

#[test]
fn demo_refuses_a_directory_that_is_not_empty_and_touches_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("policy.yaml"), b"mine").expect("file");
    let output = backstop()
        .args(["demo", "--dir"])
        .arg(dir.path())
        .output()
        .expect("backstop runs");
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("is not empty (it holds policy.yaml)")
            && stderr.contains("choose a new or empty directory"),
        "{stderr}"
    );
    assert_eq!(
        std::fs::read(dir.path().join("policy.yaml")).expect("still there"),
        b"mine"
    );
    assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 1);
    // The help says the same.
    let help = backstop().args(["demo", "--help"]).output().expect("help");
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        help.contains("must be new") && help.contains("or empty"),
        "{help}"
    );
}
