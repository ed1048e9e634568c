//! `backstop serve` as a process: start-up errors exit 2 and name the cause; the shipped example
//! starts when its environment is set, logs where it listens, and stops cleanly on SIGTERM.

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    time::Duration,
};

fn backstop() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_backstop"));
    command.env_remove("RUST_LOG");
    command
}

const EXAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/backstop.yaml");

/// `backstop serve` of the example policy on a free loopback port with its store at
/// `dir/b.db` (environment not set here).
fn serve_example(dir: &std::path::Path) -> Command {
    let mut command = backstop();
    command
        .args([
            "serve",
            "--config",
            EXAMPLE,
            "--listen",
            "127.0.0.1:0",
            "--store",
        ])
        .arg(dir.join("b.db"));
    command
}

/// [`serve_example`] run to its end with the example's two environment secrets unset.
fn serve_example_without_secrets(dir: &std::path::Path) -> std::process::Output {
    serve_example(dir)
        .env_remove("BACKSTOP_AGENT_INVOICE_TOKEN")
        .env_remove("BILLING_API_KEY")
        .output()
        .unwrap()
}

/// [`serve_example`] with the example's two environment secrets set.
fn serve_example_with_secrets(dir: &std::path::Path) -> Command {
    let mut command = serve_example(dir);
    command
        .env("BACKSTOP_AGENT_INVOICE_TOKEN", "invoice-token")
        .env("BILLING_API_KEY", "billing-secret-value");
    command
}

/// [`serve_example_with_secrets`], spawned with stderr piped.
#[cfg(unix)]
fn spawn_example(dir: &std::path::Path) -> std::process::Child {
    serve_example_with_secrets(dir)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Reads serve's stderr `lines` up to the one saying where it listens, appending each line
/// read (and a newline) to `seen`; the `host:port` it listens on.
#[cfg(unix)]
fn listening_addr(
    lines: &mut std::io::Lines<BufReader<std::process::ChildStderr>>,
    seen: &mut String,
) -> String {
    loop {
        let line = lines
            .next()
            .expect("serve exited before listening")
            .unwrap();
        seen.push_str(&line);
        seen.push('\n');
        if let Some(rest) = line.split("listening on http://").nth(1) {
            return rest.split_whitespace().next().unwrap().to_owned();
        }
    }
}

/// Sends the raw HTTP/1.1 `request` to `addr` and reads the whole answer (5 s read timeout).
#[cfg(unix)]
fn exchange(addr: &str, request: &[u8]) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    stream.write_all(request).unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    answer
}

/// Runs `command` to its end (stdout and stderr captured), killing it and failing when it is
/// still running after 60 s (a serve that should have refused to start but serves).
#[allow(clippy::disallowed_methods)]
fn run_to_exit(command: &mut Command) -> std::process::Output {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "still running after 60 s:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// A closed backstop database at `dir/b.db` (where [`serve_example`] keeps its store) with
/// one action: its last audit event has seq 3.
fn store_with_one_action(dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join("b.db");
    let store = backstop_store::SqliteStore::open(&path).unwrap();
    crate::common::sent_action(
        &store,
        "run-a",
        None,
        "POST",
        "/v1/transfers",
        "idempotent_write",
    );
    drop(store);
    path
}

/// Sends SIGTERM to `child` with `kill -TERM`; the exit status of `kill`.
#[cfg(unix)]
fn sigterm(child: &std::process::Child) -> std::io::Result<std::process::ExitStatus> {
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
}

#[test]
fn invalid_policy_exits_2_with_file_line_column() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.yaml");
    std::fs::write(&file, "breaker:\n  threshold: 0\n").unwrap();
    let out = backstop()
        .args(["serve", "--config"])
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("bad.yaml:2:14: breaker.threshold: must be at least 1"),
        "{stderr}"
    );
}

#[test]
fn a_missing_policy_file_is_called_missing_not_invalid() {
    let dir = tempfile::tempdir().unwrap();
    let out = backstop()
        .current_dir(dir.path())
        .arg("serve")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no policy file at backstop.yaml") && stderr.contains("--config"),
        "{stderr}"
    );
    assert!(!stderr.contains("invalid"), "{stderr}");
}

#[test]
fn long_help_says_where_tokens_and_provider_keys_come_from() {
    let out = backstop().args(["serve", "--help"]).output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for key in [
        "agents.NAME.token_env",
        "agents.NAME.token_file",
        "providers.NAME.credential.secret_env",
        "providers.NAME.credential.secret_file",
        "BACKSTOP_TOKEN=local-agent-token FAKE_API_KEY=local-provider-key",
        "examples/backstop-fake.yaml",
    ] {
        assert!(help.contains(key), "{key} missing from:\n{help}");
    }
}

#[test]
fn missing_secret_env_var_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let out = serve_example_without_secrets(dir.path());
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("environment variable BACKSTOP_AGENT_INVOICE_TOKEN is not set"),
        "{stderr}"
    );
}

#[test]
fn port_in_use_is_said_plainly() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let out = backstop()
        .args(["serve", "--config", EXAMPLE, "--listen", &addr, "--store"])
        .arg(dir.path().join("b.db"))
        .env("BACKSTOP_AGENT_INVOICE_TOKEN", "t")
        .env("BILLING_API_KEY", "k")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "cannot listen on {addr}: the address is already in use"
        )),
        "{stderr}"
    );
}

#[cfg(unix)]
#[test]
fn example_starts_logs_its_address_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = spawn_example(dir.path());
    let stderr = child.stderr.take().unwrap();
    let mut lines = BufReader::new(stderr).lines();
    let mut seen = String::new();
    let addr = listening_addr(&mut lines, &mut seen);
    assert!(seen.contains("billing-api, openai"), "{seen}");
    assert!(seen.contains("b.db"), "{seen}");

    // The door answers: an unauthenticated call gets a 401 problem.
    let answer = exchange(
        &addr,
        b"GET /billing-api/v1/balance HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
    );
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    assert!(answer.contains("application/problem+json"), "{answer}");

    assert!(sigterm(&child).unwrap().success());
    let exit = child.wait().unwrap();
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let all = format!("{seen}{}", rest.join("\n"));
    assert_eq!(exit.code(), Some(0), "{all}");
    assert!(all.contains("stopped"), "{all}");
    assert!(!all.contains("billing-secret-value"), "{all}");
    assert!(!all.contains("invoice-token"), "{all}");
}

#[test]
fn every_missing_secret_is_named_at_once_with_its_policy_place() {
    let dir = tempfile::tempdir().unwrap();
    let out = serve_example_without_secrets(dir.path());
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    for line in [
        format!("backstop serve: {EXAMPLE}: agents.invoice-agent: environment variable BACKSTOP_AGENT_INVOICE_TOKEN is not set"),
        format!("backstop serve: {EXAMPLE}: providers.billing-api.credential: environment variable BILLING_API_KEY is not set"),
        format!("backstop serve: 2 secrets referenced by {EXAMPLE} cannot be resolved; nothing was started"),
    ] {
        assert!(stderr.lines().any(|l| l == line), "missing {line:?} in:\n{stderr}");
    }
    // The secret files of the example are not on this host: named too, as warnings.
    assert!(
        stderr.contains("warning: ")
            && stderr.contains(
                "agents.research-agent: cannot read secret file /run/secrets/research-agent-token"
            ),
        "{stderr}"
    );
    assert!(!dir.path().join("b.db").exists(), "nothing was started");
}

/// Starts the example policy on a free loopback port; the child and its address.
#[cfg(unix)]
fn start_example(dir: &std::path::Path) -> (std::process::Child, String) {
    let mut child = spawn_example(dir);
    let stderr = child.stderr.take().unwrap();
    let mut lines = BufReader::new(stderr).lines();
    let addr = listening_addr(&mut lines, &mut String::new());
    // Keep draining stderr so the server never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
    (child, addr)
}

#[cfg(unix)]
#[test]
fn an_empty_bearer_token_is_called_empty() {
    let dir = tempfile::tempdir().unwrap();
    let (mut child, addr) = start_example(dir.path());
    // What `curl -H "Authorization: Bearer $TOKEN"` sends when TOKEN is unset.
    let answer = exchange(
        &addr,
        b"GET /billing-api/v1/balance HTTP/1.1\r\nhost: x\r\nauthorization: Bearer \r\nconnection: close\r\n\r\n",
    );
    let _ = sigterm(&child);
    let _ = child.wait();
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    assert!(answer.contains("the bearer token is empty"), "{answer}");
    assert!(!answer.contains("not a bearer token"), "{answer}");
}

#[cfg(unix)]
#[test]
fn a_second_serve_on_a_store_in_use_exits_naming_the_lock() {
    let dir = tempfile::tempdir().unwrap();
    let (mut first, _) = start_example(dir.path());
    let mut second = spawn_example(dir.path());
    // Read until the second one exits (stderr closes) or says it listens (the refusal failed).
    let mut stderr = String::new();
    for line in BufReader::new(second.stderr.take().unwrap()).lines() {
        let line = line.unwrap();
        stderr.push_str(&line);
        stderr.push('\n');
        if line.contains("listening on") {
            break;
        }
    }
    let started = stderr.contains("listening on");
    if started {
        let _ = second.kill();
    }
    let second_exit = second.wait().unwrap();
    let _ = sigterm(&first);
    let first_exit = first.wait().unwrap();
    assert!(
        !started,
        "a second gateway served the same store:\n{stderr}"
    );
    assert_eq!(second_exit.code(), Some(2), "{stderr}");
    let holder = if cfg!(target_os = "linux") {
        // Linux shows the holder's pid (`/proc/locks`).
        format!("another process (pid {})", first.id())
    } else {
        "another process".to_owned()
    };
    assert!(
        stderr.contains(&format!(
            "cannot open the store {}: {holder} holds this database's write lock",
            dir.path().join("b.db").display()
        )),
        "{stderr}"
    );
    assert_eq!(first_exit.code(), Some(0), "the first gateway kept serving");
}

#[test]
fn zero_worker_threads_is_refused_before_anything_starts() {
    let dir = tempfile::tempdir().unwrap();
    let out = serve_example_with_secrets(dir.path())
        .args(["--worker-threads", "0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("backstop serve: --worker-threads must be at least 1"),
        "{stderr}"
    );
    assert!(!dir.path().join("b.db").exists(), "nothing was started");
}

#[test]
fn a_zero_shutdown_grace_is_refused_before_anything_starts() {
    let dir = tempfile::tempdir().unwrap();
    let out = serve_example_with_secrets(dir.path())
        .args(["--shutdown-grace-seconds", "0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("backstop serve: --shutdown-grace-seconds must be at least 1"),
        "{stderr}"
    );
    assert!(!dir.path().join("b.db").exists(), "nothing was started");
}

#[cfg(unix)]
#[test]
fn worker_threads_sets_how_many_threads_serve_requests() {
    for workers in [1usize, 3] {
        let dir = tempfile::tempdir().unwrap();
        let mut child = serve_example_with_secrets(dir.path())
            .args(["--worker-threads", &workers.to_string()])
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let mut lines = BufReader::new(stderr).lines();
        let mut seen = String::new();
        let addr = listening_addr(&mut lines, &mut seen);
        std::thread::spawn(move || lines.for_each(drop));
        let answer = exchange(
            &addr,
            b"GET /billing-api/v1/balance HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        );
        let stopped = sigterm(&child).unwrap().success() && child.wait().unwrap().success();
        assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
        // The runtime's own worker count, as serve logs it when it listens.
        let plural = if workers == 1 { "" } else { "s" };
        assert!(
            seen.contains(&format!(", {workers} worker thread{plural})")),
            "{seen}"
        );
        assert!(stopped, "{seen}");
    }
}

/// A SIGTERM sent the instant serve prints that it listens is a clean stop (exit 0), not the
/// signal's default action: the handlers are installed before anything listens.
#[cfg(unix)]
#[test]
fn a_sigterm_right_after_the_listening_line_stops_serve_cleanly() {
    for round in 0..10 {
        let dir = tempfile::tempdir().unwrap();
        let mut child = spawn_example(dir.path());
        let stderr = child.stderr.take().unwrap();
        let mut lines = BufReader::new(stderr).lines();
        let mut seen = String::new();
        listening_addr(&mut lines, &mut seen);
        let pid = libc::pid_t::try_from(child.id()).unwrap();
        // SAFETY: `kill` with a valid signal number on the child's own pid has no memory effects.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
        let rest: Vec<String> = lines.map_while(Result::ok).collect();
        let status = child.wait().unwrap();
        assert!(
            status.success(),
            "round {round}: {status:?}\n{seen}{}",
            rest.join("\n")
        );
        assert!(
            rest.iter().any(|l| l.contains("backstop serve: stopped")),
            "round {round}: {}",
            rest.join("\n")
        );
    }
}

#[test]
fn fake_api_takes_its_config_as_c_like_serve() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.yaml");
    let out = backstop()
        .args(["fake-api", "-c"])
        .arg(&missing)
        .args(["--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "backstop fake-api: cannot read {}",
            missing.display()
        )),
        "{stderr}"
    );
}

#[test]
fn a_truncated_store_is_refused_as_damaged_or_truncated_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = store_with_one_action(dir.path());
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..1000]).unwrap();
    let out = run_to_exit(&mut serve_example_with_secrets(dir.path()));
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "{}: the file is damaged or truncated: it has 1000 bytes",
            path.display()
        )),
        "{stderr}"
    );
    assert!(!stderr.contains("not a SQLite database"), "{stderr}");
    assert_eq!(
        std::fs::read(&path).unwrap(),
        &bytes[..1000],
        "left as it was"
    );
}

#[test]
fn a_store_whose_last_event_keeps_its_hash_as_text_is_refused_pointing_to_audit_verify() {
    let dir = tempfile::tempdir().unwrap();
    let path = store_with_one_action(dir.path());
    // The digest as hex text (the form before schema 8), as a hand edit could leave it.
    rusqlite::Connection::open(&path)
        .unwrap()
        .execute_batch("UPDATE audit_events SET hash = lower(hex(hash)) WHERE seq = 3")
        .unwrap();
    let out = run_to_exit(&mut serve_example_with_secrets(dir.path()));
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            "the audit log's last event, seq 3, cannot be decoded (hash is stored as text"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!(
            "run `backstop audit verify --db {}`",
            path.display()
        )),
        "{stderr}"
    );
    assert!(!stderr.contains("corrupt record"), "{stderr}");
}

#[test]
fn a_buffered_body_cap_below_the_body_cap_is_refused_before_anything_starts() {
    let dir = tempfile::tempdir().unwrap();
    let out = serve_example_with_secrets(dir.path())
        .args([
            "--buffered-body-bytes",
            "1000",
            "--max-body-bytes",
            "2000",
            "--retry-body-bytes",
            "1000",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            "backstop serve: --buffered-body-bytes (1000) must be at least --max-body-bytes (2000)"
        ),
        "{stderr}"
    );
    assert!(!dir.path().join("b.db").exists(), "nothing was started");
}

#[cfg(unix)]
#[test]
fn buffered_body_bytes_caps_the_bodies_held_at_once() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let mut child = serve_example_with_secrets(dir.path())
        .args([
            "--buffered-body-bytes",
            "3000",
            "--max-body-bytes",
            "2000",
            "--retry-body-bytes",
            "1000",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut lines = BufReader::new(stderr).lines();
    let mut seen = String::new();
    let addr = listening_addr(&mut lines, &mut seen);
    std::thread::spawn(move || lines.for_each(drop));
    let upload = |length: usize| {
        format!(
            "POST /billing-api/v1/invoices HTTP/1.1\r\nhost: x\r\nauthorization: Bearer invoice-token\r\ncontent-length: {length}\r\nconnection: close\r\n\r\n"
        )
    };
    // A body of 2000 bytes still arriving holds 2000 of the 3000.
    let mut held = std::net::TcpStream::connect(&addr).unwrap();
    held.write_all(upload(2000).as_bytes()).unwrap();
    held.write_all(b"0123456789").unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let refused = exchange(&addr, upload(2000).as_bytes());
    drop(held);
    let stopped = sigterm(&child).unwrap().success() && child.wait().unwrap().success();
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
    assert!(refused.contains("body_budget_exhausted"), "{refused}");
    assert!(
        refused.to_ascii_lowercase().contains("retry-after: 1\r\n"),
        "{refused}"
    );
    assert!(stopped, "serve stopped cleanly");
}
