//! The seam between the executor and the network: one attempt, never a retry.
//!
//! The executor owns every retry (SPEC §4.3: library retries are off). A [`Transport`] sends one
//! fully prepared request and reports either the provider's response (its body still streaming)
//! or a transport failure split into `not_sent` / `uncertain` kinds (SPEC §2.1) through
//! [`backstop_core::classify::TransportError`]. Tests plug in a scripted transport; production
//! uses the HTTP client in the `upstream` module.

use std::{future::Future, pin::Pin};

use axum::body::Body;
use backstop_core::classify::TransportError;
use bytes::Bytes;

/// One prepared attempt. Built once per action by the proxy door and cloned per attempt, so every
/// attempt resends byte-identical bytes.
#[derive(Debug, Clone)]
pub struct AttemptRequest {
    /// The HTTP method.
    pub method: http::Method,
    /// The absolute upstream URL (provider base URL + path + query).
    pub url: String,
    /// Headers to send: agent token removed, provider credential injected, hop-by-hop headers
    /// removed (RFC 9110 §7.6.1), idempotency key set for writes.
    pub headers: http::HeaderMap,
    /// The buffered request body.
    pub body: Bytes,
}

/// What one attempt produced.
#[derive(Debug)]
pub enum AttemptReply {
    /// The provider answered; the body may still be streaming.
    Response(http::Response<Body>),
    /// No (complete) answer: the kind says whether the request may have been delivered.
    Failed(TransportError),
}

/// Sends one attempt. Implementations must not retry or re-send on their own (a pooled
/// connection that turns out dead must surface as a failure, not be retried silently).
pub trait Transport: Send + Sync + 'static {
    /// Sends `request` once.
    fn send(&self, request: AttemptRequest) -> Pin<Box<dyn Future<Output = AttemptReply> + Send>>;
}
