//! Stored and shared answers: a same-key resend of an action recorded before is answered from
//! the store (replayed, SPEC §6); a write's final response is kept for that replay (bounded);
//! a coalesced read's answer is buffered and shared with whoever joined it.

use axum::body::{Body, HttpBody};
use axum::response::IntoResponse;
use backstop_core::clock::Clock;
use backstop_core::outcome::{NextSafe, Outcome, OutcomeContext};
use backstop_store::{ActionId, ActionRecord, ActionState, StoredResponse};
use bytes::{Bytes, BytesMut};
use jiff::Timestamp;
use std::{
    pin::Pin,
    task::{Context, Poll},
};

use super::{core_outcome, writes, Engine, Notify, ERROR_BODY_LIMIT};
use crate::{
    action::{ActionReceipt, Execution},
    coalesce::{FlightKey, Shared},
    problem::Problem,
    transport::AttemptReply,
};

/// A body that yields an already read prefix, then the rest of the original body.
pub(super) struct Prefixed {
    pub(super) prefix: Option<Bytes>,
    pub(super) rest: Body,
}

impl HttpBody for Prefixed {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        if let Some(prefix) = self.prefix.take() {
            return Poll::Ready(Some(Ok(http_body::Frame::data(prefix))));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }
}

/// A body that failed while it was read (the provider's response was cut), with the bytes
/// that had arrived before.
#[derive(Debug)]
pub(super) struct CutBody {
    /// The bytes read before the failure (at most the limit read to, plus one frame).
    pub(super) received: Bytes,
    /// Why the body failed.
    pub(super) error: axum::Error,
}

/// Reads at most `limit` bytes of `body`. Returns the bytes read and, when the body is longer,
/// a body that replays them followed by the rest.
///
/// # Errors
/// The body failed while being read (the response was cut): [`CutBody`] with the bytes read.
pub(super) async fn read_bounded(mut body: Body, limit: usize) -> Result<(Bytes, Body), CutBody> {
    let mut buf = BytesMut::new();
    loop {
        let frame = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await;
        match frame {
            None => {
                let bytes = buf.freeze();
                return Ok((bytes.clone(), Body::from(bytes)));
            }
            Some(Err(error)) => {
                return Err(CutBody {
                    received: buf.freeze(),
                    error,
                })
            }
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    buf.extend_from_slice(&data);
                    if buf.len() > limit {
                        let bytes = buf.freeze();
                        let rebuilt = Body::new(Prefixed {
                            prefix: Some(bytes.clone()),
                            rest: body,
                        });
                        return Ok((bytes, rebuilt));
                    }
                }
            }
        }
    }
}

/// A write's final response as kept for idempotent replay ([`crate::wire::replay_record`]):
/// at most [`crate::wire::REPLAY_BODY_LIMIT`] bytes of its body are read and kept. An event
/// stream's body is never kept (only its status and headers); it is read — at most
/// [`ERROR_BODY_LIMIT`] bytes, for an operation id — only when `read_stream`. Returns the
/// response to pass on (the bytes read, then the rest of the body), the record to store, and
/// the bytes read (empty when none were).
///
/// A body cut while it is read (the provider closed before its `Content-Length` was sent, or a
/// chunked body broke off) is passed on as the bytes received, with
/// [`crate::wire::BODY_TRUNCATED_HEADER`] giving their number and the provider's
/// `Content-Length` removed, and kept the same way (up to the replay limit; an event stream's
/// never), so its replay carries those bytes under [`crate::wire::REPLAY_TRUNCATED_HEADER`].
/// Nothing of it passes for complete.
pub(super) async fn kept_for_replay(
    response: http::Response<Body>,
    action: ActionId,
    read_stream: bool,
) -> (http::Response<Body>, StoredResponse, Bytes) {
    let stream = crate::wire::is_event_stream(response.headers());
    if stream && !read_stream {
        let record = crate::wire::replay_record(response.status(), response.headers(), &[], false);
        return (response, record, Bytes::new());
    }
    let limit = if stream {
        ERROR_BODY_LIMIT
    } else {
        crate::wire::REPLAY_BODY_LIMIT
    };
    let (parts, body) = response.into_parts();
    match read_bounded(body, limit).await {
        Ok((bytes, body)) => {
            let complete = !stream && bytes.len() <= limit;
            let kept = if stream { &[][..] } else { &bytes[..] };
            let record = crate::wire::replay_record(parts.status, &parts.headers, kept, complete);
            (http::Response::from_parts(parts, body), record, bytes)
        }
        Err(cut) => {
            let received = cut.received;
            tracing::warn!(
                action = action.0,
                error = %cut.error,
                received = received.len(),
                "the write's response body was cut while it was read; the bytes received are passed on, marked incomplete"
            );
            let kept = if stream { &[][..] } else { &received[..] };
            let record = crate::wire::replay_record(parts.status, &parts.headers, kept, false);
            let mut parts = parts;
            parts.headers.remove(http::header::CONTENT_LENGTH);
            parts.headers.insert(
                crate::wire::BODY_TRUNCATED_HEADER,
                http::HeaderValue::from(received.len()),
            );
            (
                http::Response::from_parts(parts, Body::from(received.clone())),
                record,
                received,
            )
        }
    }
}

impl Engine {
    /// The agent reused an idempotency key with the same payload: replay, join, or refuse.
    pub(super) async fn existing(
        &self,
        record: ActionRecord,
        notify: Option<&Notify>,
    ) -> Execution {
        let inner = &self.inner;
        let id = record.id;
        let stored_attempts = inner
            .blocking(move |s| s.attempts(id))
            .await
            .unwrap_or_default();
        let attempts = u32::try_from(stored_attempts.len()).unwrap_or(u32::MAX);
        let receipt = ActionReceipt {
            action_id: id.0,
            attempts,
            idempotency_key: (!matches!(record.method.as_str(), "GET" | "HEAD" | "OPTIONS"))
                .then(|| record.idempotency_key.clone()),
            provider_operation_id: record.provider_operation_id.clone(),
            task: Some(record.task_id.clone()),
        };
        if record.state == ActionState::Finished {
            if let Some(stored) = record.response {
                return replay(receipt, stored);
            }
            let outcome = record.outcome.map_or(Outcome::Cancelled, core_outcome);
            // A context stored without every SPEC §5 member (a write reconciled by a lookup
            // keeps only `reconciled`; an action closed at a restart by an older build kept
            // `sent`, `attempts` and `next_safe`) is rebuilt from the stored attempts, as the
            // action view does, keeping a stored `next_safe`.
            let stored: Option<OutcomeContext> = record
                .outcome_context
                .clone()
                .and_then(|c| serde_json::from_value(c).ok());
            let context = stored.unwrap_or_else(|| {
                let waited = writes::recorded_wait_ms(&record, &stored_attempts);
                let mut rebuilt = writes::recovered_context(&stored_attempts, waited);
                if let Some(next_safe) = record
                    .outcome_context
                    .as_ref()
                    .and_then(|c| c.get("next_safe"))
                    .and_then(|n| serde_json::from_value(n.clone()).ok())
                {
                    rebuilt.next_safe = next_safe;
                }
                rebuilt
            });
            if matches!(outcome, Outcome::Rejected | Outcome::Conflict) && context.response_received
            {
                return unkept_replay(receipt, outcome, &context, inner.clock.now());
            }
            return Execution::Outcome {
                receipt,
                outcome,
                context,
                detail: crate::action::REPLAYED_OUTCOME.to_owned(),
            };
        }
        inner.metrics.layered_retry_joined(&record.provider);
        if let Some(mut rx) = inner.flights.follow(&FlightKey::Action(id.0)) {
            tracing::info!(
                action = id.0,
                "layered retry joined to the action in flight"
            );
            if let Some(notify) = notify {
                notify.runs(receipt.clone(), true);
            }
            if let Ok(shared) = rx.recv().await {
                return from_shared(shared);
            }
        }
        tracing::info!(
            action = id.0,
            "layered retry refused: the action is still in flight"
        );
        Execution::InFlight { receipt }
    }
}

/// A provider's answer without its own `Idempotent-Replayed` header. That header is backstop's
/// word to the agent: it says that backstop answered from its store and sent nothing. A
/// provider's own (its idempotency store replayed an earlier request under the same key) on an
/// answer backstop passes through fresh would tell the agent the opposite of what happened, so
/// it is removed as the answer arrives — before it is passed on, kept for replay or shared with
/// coalesced reads.
pub(super) fn without_provider_replay_mark(reply: AttemptReply) -> AttemptReply {
    match reply {
        AttemptReply::Response(mut response) => {
            response.headers_mut().remove(crate::wire::REPLAYED_HEADER);
            AttemptReply::Response(response)
        }
        failed => failed,
    }
}

/// The stored final response of a completed write, answered again to the same agent with
/// `Idempotent-Replayed: true` (nothing is sent). A provider's own `Idempotent-Replayed` kept
/// before it was removed on arrival is not repeated: the header is backstop's, and once.
pub(super) fn replay(receipt: ActionReceipt, stored: StoredResponse) -> Execution {
    let mut builder = http::Response::builder()
        .status(stored.status)
        .header(crate::wire::REPLAYED_HEADER, "true");
    for (name, value) in &stored.headers {
        if name.eq_ignore_ascii_case(crate::wire::REPLAYED_HEADER) {
            continue;
        }
        builder = builder.header(name, value);
    }
    match builder.body(Body::from(stored.body)) {
        Ok(response) => Execution::Response { receipt, response },
        Err(e) => Execution::Outcome {
            receipt,
            outcome: Outcome::Cancelled,
            context: OutcomeContext::default(),
            detail: format!("the stored response could not be replayed: {e}"),
        },
    }
}

/// The answer to a same-key resend of a write the provider refused (`rejected`, `conflict`)
/// whose response is not in the store — a write that ended before refused writes' responses
/// were kept: nothing is sent, and the problem says that the provider's response cannot be
/// replayed. It keeps the provider's status: as the HTTP status when it is a 4xx that SDKs do
/// not retry on their own (not 408, 409 or 429; those get the outcome's status, see
/// [`crate::problem`]), and always as `last_status` and in `detail`. Marked
/// `Idempotent-Replayed: true`, as every replay.
pub(super) fn unkept_replay(
    receipt: ActionReceipt,
    outcome: Outcome,
    context: &OutcomeContext,
    now: Timestamp,
) -> Execution {
    let provider_status = context
        .last_status
        .and_then(|s| http::StatusCode::from_u16(s).ok());
    let said = match provider_status {
        Some(status) => format!("the provider's HTTP {}", status.as_u16()),
        None => "the provider's answer".to_owned(),
    };
    let detail = format!(
        "replayed: this idempotency key already ended `{outcome}` with {said}, but that response is not kept in backstop's store (the write ended before refused writes' responses were kept), so it cannot be replayed as it was sent; nothing was sent"
    );
    let mut problem = Problem::from_outcome(outcome, context, detail, now)
        .with_extension("action_id", receipt.action_id.into());
    if let Some(task) = &receipt.task {
        problem = problem.with_extension("task", task.as_str().into());
    }
    if let Some(key) = &receipt.idempotency_key {
        problem = problem.with_extension("idempotency_key", key.as_str().into());
    }
    if let Some(status) =
        provider_status.filter(|s| s.is_client_error() && !matches!(s.as_u16(), 408 | 409 | 429))
    {
        problem.status = status;
    }
    let mut response = problem.into_response();
    response.headers_mut().insert(
        crate::wire::REPLAYED_HEADER,
        http::HeaderValue::from_static("true"),
    );
    Execution::Response { receipt, response }
}

/// One copy of `execution` that every waiter can rebuild its answer from: a provider response
/// with its body buffered (up to `limit` bytes; a larger or unreadable one becomes a
/// `budget_exhausted` outcome saying why), or the gateway-made outcome. `route` names the
/// route in the log.
pub(super) async fn into_shared(execution: Execution, route: &str, limit: usize) -> Shared {
    match execution {
        Execution::Response { receipt, response } => {
            let (parts, body) = response.into_parts();
            match Box::pin(axum::body::to_bytes(body, limit)).await {
                Ok(bytes) => Shared::Response {
                    receipt,
                    status: parts.status,
                    own: parts
                        .extensions
                        .get::<crate::problem::OwnAnswer>()
                        .is_some(),
                    headers: parts.headers,
                    body: bytes,
                },
                Err(e) => {
                    tracing::warn!(route = %route, error = %e, "shared response body could not be buffered");
                    Shared::Outcome {
                        context: OutcomeContext {
                            sent: true,
                            response_received: true,
                            attempts: receipt.attempts,
                            last_status: Some(parts.status.as_u16()),
                            next_safe: vec![NextSafe::Abort],
                            ..OutcomeContext::default()
                        },
                        receipt,
                        outcome: Outcome::BudgetExhausted,
                        detail: format!(
                            "the response body could not be buffered to share it between identical calls: {e}"
                        ),
                    }
                }
            }
        }
        Execution::Outcome {
            receipt,
            outcome,
            context,
            detail,
        } => Shared::Outcome {
            receipt,
            outcome,
            context,
            detail,
        },
        Execution::InFlight { receipt } => Shared::Outcome {
            context: OutcomeContext {
                attempts: receipt.attempts,
                next_safe: vec![NextSafe::QueryStatus, NextSafe::Abort],
                ..OutcomeContext::default()
            },
            receipt,
            outcome: Outcome::Conflict,
            detail: "an action with this idempotency key is still in flight".to_owned(),
        },
    }
}

pub(super) fn from_shared(shared: Shared) -> Execution {
    match shared {
        Shared::Response {
            receipt,
            status,
            headers,
            body,
            own,
        } => {
            let mut response = http::Response::new(Body::from(body));
            *response.status_mut() = status;
            *response.headers_mut() = headers;
            if own {
                response.extensions_mut().insert(crate::problem::OwnAnswer);
            }
            Execution::Response { receipt, response }
        }
        Shared::Outcome {
            receipt,
            outcome,
            context,
            detail,
        } => Execution::Outcome {
            receipt,
            outcome,
            context,
            detail,
        },
    }
}
