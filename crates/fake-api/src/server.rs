//! The listener: one hyper HTTP/1.1 connection task per accepted socket, serving an axum router.
//!
//! Why not `axum::serve`: the fake must be able to close a connection *without sending a single
//! response byte* (a provider that committed a write and then lost the connection). Owning the
//! connection task makes that exact: the handler signals the task, which drops the connection
//! before hyper has written anything. `axum::serve` offers no such handle.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};

use crate::attempt::{AttemptOutcome, AttemptRecord};
use crate::compiled::Compiled;
use crate::provider::{self, Incoming, ProviderState, Ticket};
use crate::reply::Action;

/// Request bodies above this many bytes are answered 413.
const MAX_BODY_BYTES: usize = 1 << 20;

/// Called once per attempt when its outcome is known.
pub type Observer = Arc<dyn Fn(&AttemptRecord) + Send + Sync>;

/// State shared by all connections.
pub(crate) struct Shared {
    pub(crate) compiled: Compiled,
    pub(crate) state: Mutex<ProviderState>,
    pub(crate) observer: Option<Observer>,
}

impl Shared {
    /// The provider state; a poisoned lock is recovered (the state stays usable for tests).
    pub(crate) fn lock(&self) -> MutexGuard<'_, ProviderState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn notify(&self, record: Option<AttemptRecord>) {
        if let (Some(observer), Some(record)) = (&self.observer, record) {
            observer(&record);
        }
    }
}

/// Per-connection handle that lets a handler drop its own connection.
#[derive(Clone)]
struct ConnControl {
    abort: Arc<Notify>,
}

/// Builds the router: reserved `/__fake/` paths, everything else to the provider.
pub(crate) fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/__fake/attempts", get(attempts))
        .route("/__fake/reset", post(reset))
        .fallback(handle)
        .with_state(shared)
}

async fn attempts(State(shared): State<Arc<Shared>>) -> Response {
    let body = serde_json::to_vec(shared.lock().attempts()).unwrap_or_default();
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response()
}

async fn reset(State(shared): State<Arc<Shared>>) -> StatusCode {
    shared.lock().reset(&shared.compiled);
    StatusCode::NO_CONTENT
}

async fn handle(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    let control = request.extensions().get::<ConnControl>().cloned();
    let (parts, body) = request.into_parts();
    if parts.uri.path().starts_with("/__fake/") {
        return (StatusCode::NOT_FOUND, "unknown reserved path\n").into_response();
    }
    let body = axum::body::to_bytes(body, MAX_BODY_BYTES).await.ok();
    let now = crate::clock::now();
    let provider::Decision {
        mut action,
        hold,
        ticket,
        finished,
    } = {
        let mut state = shared.lock();
        provider::decide(
            &shared.compiled,
            &mut state,
            &Incoming {
                method: &parts.method,
                path: parts.uri.path(),
                query: parts.uri.query(),
                headers: &parts.headers,
                body: body.as_ref(),
            },
            now,
        )
    };
    shared.notify(finished);
    if let Some(hold) = hold {
        // A slow answer. The client may leave during the hold (hyper then drops this
        // handler): the attempt ends `timeout` with no status, nothing having been sent.
        let mut ending = Ending {
            shared: &shared,
            ticket,
            outcome: AttemptOutcome::Timeout,
            status: None,
        };
        tokio::time::sleep(hold).await;
        if let Some(headers) = action.headers_mut() {
            provider::stamp_date(headers, crate::clock::now());
        }
        ending.outcome = AttemptOutcome::Answered;
        ending.status = action.status().map(|s| s.as_u16());
        drop(ending);
    }
    match action {
        Action::Reply(reply) => (reply.status, reply.headers, reply.body).into_response(),
        Action::Stream {
            headers,
            chunks,
            interval,
        } => {
            let stream = futures_util::stream::unfold(
                (chunks.into_iter(), true),
                move |(mut rest, first)| async move {
                    let chunk = rest.next()?;
                    if !first {
                        tokio::time::sleep(interval).await;
                    }
                    Some((Ok::<_, Infallible>(chunk), (rest, false)))
                },
            );
            (StatusCode::OK, headers, Body::from_stream(stream)).into_response()
        }
        Action::Drop { hold, outcome } => {
            // Ends the record even when the client leaves during the hold: hyper drops this
            // handler then, and the attempt would stay `pending` for ever.
            let ending = Ending {
                shared: &shared,
                ticket,
                outcome,
                status: None,
            };
            if !hold.is_zero() {
                tokio::time::sleep(hold).await;
            }
            drop(ending);
            drop_connection(control).await
        }
    }
}

/// The end of a held attempt (`drop`, `timeout`, `slow`): written when the hold is over or when
/// the handler is dropped first (the client left, or the server stopped). `outcome` and
/// `status` are what is recorded then: a connection closed with no response byte, unless a
/// `slow` hold ended and its answer is about to be sent.
struct Ending<'a> {
    shared: &'a Shared,
    ticket: Ticket,
    outcome: AttemptOutcome,
    status: Option<u16>,
}

impl Drop for Ending<'_> {
    fn drop(&mut self) {
        let finished = self
            .shared
            .lock()
            .finish(self.ticket, self.outcome, self.status);
        self.shared.notify(finished);
    }
}

/// Closes the connection without a response byte. Outside a connection task of ours (e.g. the
/// router called in-process) the best available is a body that fails at once.
async fn drop_connection(control: Option<ConnControl>) -> Response {
    match control {
        Some(control) => {
            control.abort.notify_one();
            std::future::pending::<Response>().await
        }
        None => {
            let failing = futures_util::stream::once(async {
                Err::<Bytes, std::io::Error>(std::io::Error::other("connection dropped"))
            });
            Body::from_stream(failing).into_response()
        }
    }
}

/// What the listener is told to do: keep serving, stop gracefully, or stop at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    /// Serve.
    Running,
    /// Accept nothing more, close idle (kept-alive) connections now, and let every response
    /// in progress finish before its connection closes.
    Graceful,
    /// Close every connection now, responses in progress included.
    Now,
}

/// Accepts connections until `stop` leaves [`Stop::Running`] (or its sender is dropped), then
/// waits for the open connections: with [`Stop::Graceful`] each idle one is closed at once and
/// each one answering a request is closed after its response (hyper's graceful shutdown of an
/// HTTP/1.1 connection); [`Stop::Now`] (or the sender dropped) closes them all at once.
///
/// Returns how many connections were still open (answering) when they were closed at once.
pub(crate) async fn accept_loop(
    listener: TcpListener,
    router: Router,
    mut stop: watch::Receiver<Stop>,
) -> usize {
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            changed = stop.changed() => {
                if changed.is_err() || *stop.borrow() != Stop::Running {
                    break;
                }
                continue;
            }
            // Reap finished connection tasks as they end.
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            accepted = listener.accept() => accepted,
        };
        let (stream, _peer): (_, SocketAddr) = match accepted {
            Ok(pair) => pair,
            Err(_) => {
                // Out of descriptors or a connection reset before accept: back off briefly.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        connections.spawn(serve_connection(stream, router.clone(), stop.clone()));
    }
    // Nothing more is accepted.
    drop(listener);
    // Each connection ends by itself (gracefully, or at once on `Stop::Now`) and says whether it
    // was closed with a response still in progress.
    let mut cut = 0;
    while let Some(joined) = connections.join_next().await {
        if matches!(joined, Ok(true)) {
            cut += 1;
        }
    }
    cut
}

/// Serves one accepted connection until it ends, a handler drops it, or `stop` says so (see
/// [`accept_loop`]); `true` when it was closed by [`Stop::Now`] (or the sender dropped) while
/// still open.
async fn serve_connection(
    stream: tokio::net::TcpStream,
    router: Router,
    mut stop: watch::Receiver<Stop>,
) -> bool {
    let abort = Arc::new(Notify::new());
    let control = ConnControl {
        abort: Arc::clone(&abort),
    };
    let service = hyper::service::service_fn(move |mut request: Request<_>| {
        request.extensions_mut().insert(control.clone());
        let mut router = router.clone();
        async move { tower_service::Service::call(&mut router, request.map(Body::new)).await }
    });
    let connection = http1::Builder::new().serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    // A stop that came before this connection's first poll is seen too.
    let mut graceful = false;
    loop {
        let current = *stop.borrow_and_update();
        match current {
            Stop::Now => return true,
            Stop::Graceful if !graceful => {
                graceful = true;
                connection.as_mut().graceful_shutdown();
            }
            _ => {}
        }
        tokio::select! {
            _ = connection.as_mut() => return false,
            _ = abort.notified() => return false,
            changed = stop.changed() => {
                if changed.is_err() {
                    return true;
                }
            }
        }
    }
}
