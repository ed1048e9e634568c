//! Loopback ports for processes the tests start, taken without a race. A port found by binding
//! port 0 and letting it go again may be taken by any other process before the one started on
//! it binds it; so `backstop serve` and `backstop fake-api` are started on `127.0.0.1:0`, bind a
//! port of the system's choice themselves, and the test reads which from the line they log once
//! bound. A port no one may answer on is held bound, never listening, for as long as it is
//! needed.

use std::{
    io::{BufRead, BufReader},
    net::SocketAddr,
    process::{Child, Command, Stdio},
    sync::{mpsc, Arc, Mutex},
    thread::JoinHandle,
    time::{Duration, Instant},
};

/// What `backstop serve` and `backstop fake-api` log on stderr once bound, before the address.
const LISTENING_ON: &str = "listening on http://";

/// A process listening on the address it logged; killed and reaped when dropped.
pub struct Listening {
    /// The process.
    pub child: Child,
    /// Where it listens, as it logged it.
    pub addr: SocketAddr,
    /// Everything it wrote on stderr so far, line by line.
    stderr: Arc<Mutex<String>>,
    /// Reads stderr to its end, so that the process never blocks on a full pipe.
    reader: Option<JoinHandle<()>>,
}

impl Listening {
    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Kills the process (SIGKILL), reaps it and returns all it wrote on stderr. Panics, with
    /// that, if it had already ended.
    pub fn kill(&mut self) -> String {
        let alive = self.child.try_wait().expect("wait").is_none();
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        let stderr = self.stderr.lock().unwrap().clone();
        assert!(
            alive,
            "the process had ended before it was killed: {stderr}"
        );
        stderr
    }
}

impl Drop for Listening {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Spawns `command` — a `backstop serve` or `backstop fake-api` given `--listen 127.0.0.1:0`
/// by the caller — with stderr piped, and waits at most `limit` for the line saying where it
/// listens. Panics, with what it wrote, if it ends or says nothing of the kind in time.
#[allow(clippy::disallowed_methods)] // a bound on waiting for another process, not the code's clock
pub fn spawn_listening(command: &mut Command, limit: Duration) -> Listening {
    let mut child = command
        .stderr(Stdio::piped())
        .spawn()
        .expect("the process starts");
    let pipe = child.stderr.take().expect("stderr is piped");
    let stderr = Arc::new(Mutex::new(String::new()));
    let (lines, read) = mpsc::channel();
    let kept = Arc::clone(&stderr);
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines() {
            let Ok(line) = line else { break };
            let mut all = kept.lock().unwrap();
            all.push_str(&line);
            all.push('\n');
            drop(all);
            let _ = lines.send(line);
        }
    });
    let deadline = Instant::now() + limit;
    let addr = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match read.recv_timeout(left) {
            Ok(line) => {
                let Some(rest) = line.split(LISTENING_ON).nth(1) else {
                    continue;
                };
                let addr = rest.split_whitespace().next().unwrap_or("");
                break addr
                    .parse::<SocketAddr>()
                    .unwrap_or_else(|e| panic!("`{addr}` in `{line}` is not an address: {e}"));
            }
            Err(why) => {
                let _ = child.kill();
                let _ = child.wait();
                let _ = reader.join();
                panic!(
                    "no `{LISTENING_ON}` line ({}): {}",
                    match why {
                        mpsc::RecvTimeoutError::Timeout => "timed out",
                        mpsc::RecvTimeoutError::Disconnected => "the process closed stderr",
                    },
                    stderr.lock().unwrap()
                );
            }
        }
    };
    Listening {
        child,
        addr,
        stderr,
        reader: Some(reader),
    }
}

/// A loopback port bound and not listening: a connection to it is refused, and no other
/// process can listen on it while the socket lives. Keep the socket as long as the port is used.
pub fn refusing_port() -> (tokio::net::TcpSocket, u16) {
    let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
    socket
        .bind("127.0.0.1:0".parse().expect("address"))
        .expect("bind a loopback port");
    let port = socket.local_addr().expect("its address").port();
    (socket, port)
}

#[test]
fn a_refusing_port_refuses_connections_and_no_listener_can_take_it_while_held() {
    let (held, port) = refusing_port();
    let refused = std::net::TcpStream::connect(("127.0.0.1", port)).expect_err("nothing answers");
    assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);
    // What a port found free and let go cannot promise: another process listening on it.
    let taken = std::net::TcpListener::bind(("127.0.0.1", port)).expect_err("the port is held");
    assert_eq!(taken.kind(), std::io::ErrorKind::AddrInUse);
    // Once let go, the port is anyone's again: another test's process may take it at once, so
    // nothing is asserted about it after the drop.
    drop(held);
}

#[test]
fn serve_on_port_zero_answers_on_the_address_it_names() {
    let dir = tempfile::tempdir().expect("tempdir");
    let policy = dir.path().join("policy.yaml");
    std::fs::write(
        &policy,
        "agents:\n  bot: { token_env: LISTENING_BOT_TOKEN }\nproviders:\n  p:\n    base_url: http://127.0.0.1:9\n",
    )
    .expect("write the policy");
    let mut serve = spawn_listening(
        Command::new(env!("CARGO_BIN_EXE_backstop"))
            .args(["serve", "--config"])
            .arg(&policy)
            .args(["--listen", "127.0.0.1:0", "--store"])
            .arg(dir.path().join("b.db"))
            .env_remove("RUST_LOG")
            .env("LISTENING_BOT_TOKEN", "t")
            .stdout(Stdio::null()),
        Duration::from_secs(20),
    );
    assert_ne!(
        serve.addr.port(),
        0,
        "the port bound, not the one asked for"
    );
    let mut socket = std::net::TcpStream::connect(serve.addr).expect("serve listens there");
    use std::io::{Read, Write};
    socket
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .expect("send");
    let mut answer = String::new();
    socket.read_to_string(&mut answer).expect("read");
    assert!(answer.starts_with("HTTP/1.1 "), "{answer}");
    assert!(answer.contains("backstop"), "{answer}");
    serve.kill();
}
