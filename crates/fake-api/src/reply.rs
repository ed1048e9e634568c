//! What the provider does with a connection once it decided: a complete answer, an event
//! stream, or a dropped connection; and the JSON answers every handler builds.

use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, StatusCode};
use serde_json::json;

use crate::attempt::AttemptOutcome;

/// A complete answer.
#[derive(Debug, Clone)]
pub(crate) struct Reply {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

/// What the caller must do with the connection.
#[derive(Debug)]
pub(crate) enum Action {
    /// Send this answer.
    Reply(Reply),
    /// Send a 200 event stream: `chunks` in order, the first at once and each later one
    /// `interval` after the one before.
    Stream {
        headers: HeaderMap,
        chunks: Vec<Bytes>,
        interval: Duration,
    },
    /// Hold for `hold`, then close the connection without a response byte.
    Drop {
        hold: Duration,
        outcome: AttemptOutcome,
    },
}

impl Action {
    /// The headers of an answer (`Reply` or `Stream`); `None` for `Drop`, which sends none.
    pub(crate) fn headers_mut(&mut self) -> Option<&mut HeaderMap> {
        match self {
            Action::Reply(reply) => Some(&mut reply.headers),
            Action::Stream { headers, .. } => Some(headers),
            Action::Drop { .. } => None,
        }
    }

    /// The status this action answers with; `None` when it sends no answer.
    pub(crate) fn status(&self) -> Option<StatusCode> {
        match self {
            Action::Reply(reply) => Some(reply.status),
            Action::Stream { .. } => Some(StatusCode::OK),
            Action::Drop { .. } => None,
        }
    }
}

/// The JSON body of an error answer: `code` (also as its `type`) and `message`.
pub(crate) fn error_body(code: &str, message: &str) -> Bytes {
    Bytes::from(json!({"error": {"code": code, "type": code, "message": message}}).to_string())
}

/// An `application/json` answer.
pub(crate) fn json_reply(status: StatusCode, body: Bytes) -> Reply {
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Reply {
        status,
        headers,
        body,
    }
}

/// An error answer: `status`, with `code` and `message` in the body.
pub(crate) fn error_reply(status: StatusCode, code: &str, message: &str) -> Action {
    Action::Reply(json_reply(status, error_body(code, message)))
}

/// A `400 invalid_request` answer saying `message`.
pub(crate) fn invalid_request(message: &str) -> Action {
    error_reply(StatusCode::BAD_REQUEST, "invalid_request", message)
}

/// The status a config names (validated to be one); 500 if it is not.
pub(crate) fn status_code(status: u16) -> StatusCode {
    StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}
