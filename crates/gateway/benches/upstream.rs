//! The fast upstream of `bench/proxy.sh`: answers every HTTP/1.1 request on loopback with
//! `200 {"ok":true}` and keeps the connection open.
//!
//! Why not the fake provider: it records every attempt in memory and logs one line per attempt,
//! which is right for tests and wrong for a proxy benchmark, where the upstream must cost as
//! little as possible so that the three measured paths (direct, nginx, backstop) differ only by
//! the proxy in between. This server parses nothing but the end of the request head (and a
//! `Content-Length` body, if any) and writes one fixed response.
//!
//! Usage: `upstream --listen 127.0.0.1:PORT [--threads N]` (default 1 runtime thread). Run by
//! `cargo bench` without `--listen`, it prints how to use it and exits, so that `cargo bench -p
//! backstop-gateway` never blocks on it.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const RESPONSE: &[u8] =
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{\"ok\":true}";

/// Most bytes a request head may take before the connection is closed.
const MAX_HEAD_BYTES: usize = 64 * 1024;

struct Args {
    listen: SocketAddr,
    threads: usize,
}

fn parse_args() -> Result<Option<Args>, String> {
    let mut listen = None;
    let mut threads = 1usize;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--listen" => {
                let value = args.next().ok_or("--listen needs an address")?;
                listen = Some(
                    value
                        .parse()
                        .map_err(|e| format!("--listen {value}: not a socket address: {e}"))?,
                );
            }
            "--threads" => {
                let value = args.next().ok_or("--threads needs a number")?;
                threads = value
                    .parse()
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or(format!("--threads {value}: not a positive number"))?;
            }
            // Flags cargo bench passes (`--bench`, filters): not a server run.
            _ => {}
        }
    }
    Ok(listen.map(|listen| Args { listen, threads }))
}

/// Position just past the first `\r\n\r\n`, if the head is complete.
fn head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4)
}

/// The `Content-Length` of a request head (0 when absent or unreadable).
fn content_length(head: &[u8]) -> usize {
    let text = String::from_utf8_lossy(head);
    text.lines()
        .filter_map(|line| line.split_once(':'))
        .find(|(name, _)| name.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, value)| value.trim().parse().ok())
        .unwrap_or(0)
}

async fn serve(mut stream: TcpStream) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let mut buf: Vec<u8> = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    loop {
        // Answer every complete request already buffered (pipelining included).
        while let Some(end) = head_end(&buf) {
            let total = end + content_length(&buf[..end]);
            if buf.len() < total {
                break;
            }
            buf.drain(..total);
            stream.write_all(RESPONSE).await?;
        }
        if buf.len() > MAX_HEAD_BYTES {
            return Ok(());
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn main() {
    let args = match parse_args() {
        Ok(Some(args)) => args,
        Ok(None) => {
            println!("upstream: the fast upstream of bench/proxy.sh; run with --listen ADDR");
            return;
        }
        Err(message) => {
            eprintln!("upstream: {message}");
            std::process::exit(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads)
        .enable_io()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("upstream: cannot build the runtime: {e}");
            std::process::exit(2);
        }
    };
    runtime.block_on(async move {
        let listener = match TcpListener::bind(args.listen).await {
            Ok(listener) => listener,
            Err(e) => {
                eprintln!("upstream: cannot listen on {}: {e}", args.listen);
                std::process::exit(2);
            }
        };
        println!("upstream: listening on http://{}", args.listen);
        loop {
            match listener.accept().await {
                Ok((stream, _)) => {
                    tokio::spawn(async move {
                        let _ = serve(stream).await;
                    });
                }
                Err(e) => eprintln!("upstream: accept failed: {e}"),
            }
        }
    });
}
