//! `backstop fake-api` as a process, stopped with SIGINT (Ctrl-C): it does not wait for idle
//! kept-alive connections, lets a response in progress finish within its grace, closes one
//! that outlasts the grace, and says in one line that it stopped.
#![cfg(unix)]
#![allow(clippy::disallowed_methods)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A fake with one streaming route: `GET /v1/stream?n=N&interval_ms=MS` sends N events MS
/// apart, then `data: [DONE]`.
const CONFIG: &str = "routes:\n  - route: GET /v1/stream\n    handler: { kind: stream }\n";

/// A running `backstop fake-api`; its stderr lines arrive on `lines` (read on a thread, so the
/// process never blocks on a full pipe).
struct Fake {
    child: Child,
    addr: String,
    lines: mpsc::Receiver<String>,
    _dir: tempfile::TempDir,
}

impl Drop for Fake {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts the fake on a free loopback port with `--shutdown-grace-seconds grace`.
fn start(grace: u64) -> Fake {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("fake.yaml");
    std::fs::write(&config, CONFIG).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_backstop"))
        .args([
            "fake-api",
            "--listen",
            "127.0.0.1:0",
            "--shutdown-grace-seconds",
        ])
        .arg(grace.to_string())
        .arg("-c")
        .arg(&config)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let first = lines
        .recv_timeout(Duration::from_secs(30))
        .expect("the fake says where it listens");
    let addr = first
        .split("listening on http://")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no address in {first:?}"))
        .to_owned();
    Fake {
        child,
        addr,
        lines,
        _dir: dir,
    }
}

impl Fake {
    /// Sends SIGINT, as Ctrl-C in a terminal does.
    fn interrupt(&self) {
        let status = Command::new("kill")
            .args(["-INT", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Waits up to `bound` for the process to exit; its exit code and every stderr line after
    /// the first. Fails when it is still running then.
    fn exit_within(&mut self, bound: Duration) -> (Option<i32>, Vec<String>) {
        let deadline = Instant::now() + bound;
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "still running {bound:?} after SIGINT"
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        // The reader thread ends when stderr closes with the process.
        let rest = self.lines.iter().collect();
        (status.code(), rest)
    }

    /// A kept-alive connection that has been answered once and stays open, idle.
    fn idle_connection(&self) -> TcpStream {
        let mut stream = TcpStream::connect(&self.addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        stream
            .write_all(b"GET /v1/stream?n=0 HTTP/1.1\r\nhost: x\r\n\r\n")
            .unwrap();
        let mut answer = Vec::new();
        let mut buf = [0u8; 4096];
        while !answer.ends_with(b"0\r\n\r\n") {
            let n = stream.read(&mut buf).unwrap();
            assert!(n > 0, "closed before the answer ended");
            answer.extend_from_slice(&buf[..n]);
        }
        stream
    }

    /// Starts a stream of `events` events `interval_ms` apart and reads its first event.
    fn stream_in_progress(&self, events: u32, interval_ms: u32) -> (TcpStream, Vec<u8>) {
        let mut stream = TcpStream::connect(&self.addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        write!(
            stream,
            "GET /v1/stream?n={events}&interval_ms={interval_ms} HTTP/1.1\r\nhost: x\r\n\r\n"
        )
        .unwrap();
        let mut received = Vec::new();
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&received).contains("\n\n") {
            let n = stream.read(&mut buf).unwrap();
            assert!(n > 0, "closed before the first event");
            received.extend_from_slice(&buf[..n]);
        }
        (stream, received)
    }
}

/// Reads `stream` to its end (the peer closed it), appending to `received`.
fn read_to_close(stream: &mut TcpStream, received: &mut Vec<u8>) {
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => received.extend_from_slice(&buf[..n]),
            // A reset is a close too.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return,
            Err(e) => panic!("reading: {e}"),
        }
    }
}

#[test]
fn sigint_does_not_wait_for_an_idle_kept_alive_connection_and_says_it_stopped() {
    // A grace far longer than the bound below: waiting for the idle connection would show.
    let mut fake = start(120);
    let mut idle = fake.idle_connection();
    fake.interrupt();
    let (code, rest) = fake.exit_within(Duration::from_secs(30));
    assert_eq!(code, Some(0), "{rest:?}");
    assert_eq!(
        rest.last().map(String::as_str),
        Some("backstop fake-api: stopped"),
        "{rest:?}"
    );
    // The idle connection was closed, not left open.
    let mut buf = [0u8; 16];
    assert!(matches!(idle.read(&mut buf), Ok(0) | Err(_)));
}

#[test]
fn sigint_lets_a_response_in_progress_finish() {
    let mut fake = start(120);
    // Five events 200 ms apart: about a second still to go when the signal comes.
    let (mut stream, mut received) = fake.stream_in_progress(5, 200);
    fake.interrupt();
    read_to_close(&mut stream, &mut received);
    let text = String::from_utf8_lossy(&received);
    assert!(
        text.contains("data: [DONE]") && text.ends_with("0\r\n\r\n"),
        "the stream was cut: {text}"
    );
    for i in 0..5 {
        assert!(
            text.contains(&format!("\"token-{i} \"")),
            "event {i} missing: {text}"
        );
    }
    let (code, rest) = fake.exit_within(Duration::from_secs(30));
    assert_eq!(code, Some(0), "{rest:?}");
    assert_eq!(
        rest.last().map(String::as_str),
        Some("backstop fake-api: stopped"),
        "{rest:?}"
    );
}

#[test]
fn a_response_outlasting_the_grace_is_closed_and_the_stop_line_says_so() {
    let mut fake = start(1);
    // A thousand events 100 ms apart: far longer than the one-second grace.
    let (mut stream, mut received) = fake.stream_in_progress(1000, 100);
    fake.interrupt();
    read_to_close(&mut stream, &mut received);
    let text = String::from_utf8_lossy(&received);
    assert!(!text.contains("data: [DONE]"), "{text}");
    let (code, rest) = fake.exit_within(Duration::from_secs(30));
    assert_eq!(code, Some(0), "{rest:?}");
    assert_eq!(
        rest.last().map(String::as_str),
        Some(
            "backstop fake-api: stopped; closed 1 connection whose response had not ended \
             within the 1 s grace"
        ),
        "{rest:?}"
    );
}
