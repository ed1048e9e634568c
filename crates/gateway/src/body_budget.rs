//! The cap on request bodies held in memory at once, across all connections.
//!
//! Why: the proxy door and `POST /v1/actions` buffer a request's whole body before anything is
//! sent (every attempt resends the same bytes; a body over the retry limit is buffered too, for
//! its one attempt), and the buffered body lives as long as its action. The per-request hard
//! cap ([`crate::door::DoorConfig::max_body_bytes`]) bounds one body, not many at once: without
//! a shared cap, 20 concurrent 30 MiB uploads hold 600 MiB.
//!
//! [`BodyBudget`] is a semaphore whose permits are bytes. A body takes its bytes before they are
//! read — all of a declared `Content-Length` at once, else as each chunk arrives — and gives
//! them back when the last copy of the buffered body is dropped (the [`Bytes`] returned by
//! [`HeldBody::into_bytes`] own their permits). A body that does not fit is refused at once
//! ([`BodyError::Exhausted`], answered `503 body_budget_exhausted` by
//! [`crate::problem::Problem::body_budget_exhausted`]): nothing more of it is read, nothing is
//! sent. Nothing waits for room: a caller told to come back in a second is better served than
//! one whose connection hangs while other actions finish.

use std::{sync::Arc, time::Duration};

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The default of [`crate::door::DoorConfig::body_budget_bytes`]: 256 MiB, eight bodies at
/// the default hard cap of 32 MiB.
pub const DEFAULT_BODY_BUDGET_BYTES: usize = 256 * 1024 * 1024;

/// Bytes of request bodies that may be held in memory at once (see the module docs). Cheap to
/// share: every connection reads bodies through the same one in [`crate::server::AppState`].
#[derive(Debug)]
pub struct BodyBudget {
    permits: Arc<Semaphore>,
    total: usize,
}

/// Why a body was not read whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyError {
    /// The body is (or declares to be) larger than the request's own limit, in bytes.
    TooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// The body alone is larger than the whole budget: it could never be held.
    LargerThanBudget {
        /// The budget, in bytes.
        total: usize,
    },
    /// The budget has no room for the body now.
    Exhausted {
        /// Bytes the body needed (its `Content-Length`, or what had arrived so far).
        wanted: usize,
        /// Bytes held by other bodies when it was refused.
        held: usize,
        /// The budget, in bytes.
        total: usize,
    },
    /// The body could not be read (the connection failed, or the read timeout cut it).
    Unreadable(String),
}

impl BodyBudget {
    /// A budget of `total_bytes` (at most [`Semaphore::MAX_PERMITS`]; a larger value is that).
    pub fn new(total_bytes: usize) -> BodyBudget {
        let total = total_bytes.min(Semaphore::MAX_PERMITS);
        BodyBudget {
            permits: Arc::new(Semaphore::new(total)),
            total,
        }
    }

    /// The budget, in bytes.
    pub fn total_bytes(&self) -> usize {
        self.total
    }

    /// Bytes of request bodies held now.
    pub fn held_bytes(&self) -> usize {
        self.total - self.permits.available_permits().min(self.total)
    }

    /// Takes `bytes` permits at once, or none.
    fn take(&self, bytes: usize) -> Option<OwnedSemaphorePermit> {
        let mut left = bytes;
        let mut taken: Option<OwnedSemaphorePermit> = None;
        loop {
            let step = u32::try_from(left).unwrap_or(u32::MAX);
            // A failed step drops what was taken so far, giving it back.
            let permit = self.permits.clone().try_acquire_many_owned(step).ok()?;
            match taken.as_mut() {
                Some(all) => all.merge(permit),
                None => taken = Some(permit),
            }
            left -= step as usize;
            if left == 0 {
                return taken;
            }
        }
    }

    fn exhausted(&self, wanted: usize) -> BodyError {
        BodyError::Exhausted {
            wanted,
            held: self.held_bytes(),
            total: self.total,
        }
    }

    /// Reads `body` whole, at most `limit` bytes, holding its bytes from this budget: a
    /// `declared` length (the request's `Content-Length`) is taken before anything is read,
    /// a body without one takes its bytes chunk by chunk as they arrive.
    ///
    /// # Errors
    /// [`BodyError::TooLarge`] past `limit` (declared or read), [`BodyError::LargerThanBudget`]
    /// for a body the whole budget cannot hold, [`BodyError::Exhausted`] when the budget has no
    /// room for it now, [`BodyError::Unreadable`] when the body's stream fails. Whatever was
    /// taken is given back on every error.
    pub async fn read(
        &self,
        body: Body,
        declared: Option<u64>,
        limit: usize,
    ) -> Result<HeldBody, BodyError> {
        let mut held = HeldBody {
            data: BytesMut::new(),
            permit: None,
        };
        if let Some(length) = declared {
            let length = usize::try_from(length).unwrap_or(usize::MAX);
            if length > limit {
                return Err(BodyError::TooLarge { limit });
            }
            if length > self.total {
                return Err(BodyError::LargerThanBudget { total: self.total });
            }
            if length > 0 {
                held.permit = Some(self.take(length).ok_or_else(|| self.exhausted(length))?);
                held.data.reserve(length);
            }
        }
        let mut body = body;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| BodyError::Unreadable(e.to_string()))?;
            let Ok(chunk) = frame.into_data() else {
                continue;
            };
            let length = held.data.len() + chunk.len();
            if length > limit {
                return Err(BodyError::TooLarge { limit });
            }
            if length > self.total {
                return Err(BodyError::LargerThanBudget { total: self.total });
            }
            let covered = held.permit.as_ref().map_or(0, |p| p.num_permits());
            if length > covered {
                let more = self
                    .take(length - covered)
                    .ok_or_else(|| self.exhausted(length))?;
                match held.permit.as_mut() {
                    Some(permit) => permit.merge(more),
                    None => held.permit = Some(more),
                }
            }
            held.data.extend_from_slice(&chunk);
        }
        Ok(held)
    }
}

/// A body read whole under a [`BodyBudget`], holding its bytes from it until dropped.
#[derive(Debug)]
pub struct HeldBody {
    data: BytesMut,
    permit: Option<OwnedSemaphorePermit>,
}

impl HeldBody {
    /// The body's bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.data
    }

    /// The body's length, in bytes.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// Whether the body is empty.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The body as [`Bytes`] that keep holding its budget until the last clone is dropped.
    pub fn into_bytes(self) -> Bytes {
        let HeldBody { data, permit } = self;
        Owned::bytes(data, permit)
    }

    /// Bytes made from this body (a payload decoded from it) that take over its budget, as
    /// much of it as they have bytes; the rest is given back with this body's own bytes, here.
    /// Bytes longer than the body hold only what the body held.
    pub fn replace(self, data: Vec<u8>) -> Bytes {
        let HeldBody { data: old, permit } = self;
        drop(old);
        Owned::bytes(data, permit)
    }
}

/// Bytes that hold their budget: the owner behind [`Bytes::from_owner`].
struct Owned<T> {
    data: T,
    _permit: Option<OwnedSemaphorePermit>,
}

impl<T: AsRef<[u8]> + Send + 'static> Owned<T> {
    /// `data` as [`Bytes`] holding as much of `permit` as it has bytes (the rest is given back
    /// now); the empty body holds nothing.
    fn bytes(data: T, mut permit: Option<OwnedSemaphorePermit>) -> Bytes {
        let length = data.as_ref().len();
        if length == 0 {
            return Bytes::new();
        }
        if let Some(held) = permit.as_mut() {
            if held.num_permits() > length {
                drop(held.split(held.num_permits() - length));
            }
        }
        Bytes::from_owner(Owned {
            data,
            _permit: permit,
        })
    }
}

impl<T: AsRef<[u8]>> AsRef<[u8]> for Owned<T> {
    fn as_ref(&self) -> &[u8] {
        self.data.as_ref()
    }
}

/// Body limits of the door.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DoorConfig {
    /// Bodies up to this size may be resent on retries (default 1 MiB).
    pub max_buffered_body_bytes: usize,
    /// Hard cap: larger bodies are refused with 413 (default 32 MiB). Bodies between the two
    /// limits get exactly one attempt.
    pub max_body_bytes: usize,
    /// The whole request body must arrive within this time of the request head, on every
    /// route (default 30 s); a slower one is answered `408 request_timeout`, nothing sent.
    pub body_read_timeout: Duration,
    /// Request bodies held in memory at once, across every connection and action, total at
    /// most this many bytes (default [`DEFAULT_BODY_BUDGET_BYTES`], 256
    /// MiB); a body that does not fit is answered `503 body_budget_exhausted`, nothing sent
    /// (see [`crate::body_budget`]).
    pub body_budget_bytes: usize,
}

impl Default for DoorConfig {
    fn default() -> Self {
        DoorConfig {
            max_buffered_body_bytes: 1024 * 1024,
            max_body_bytes: 32 * 1024 * 1024,
            body_read_timeout: Duration::from_secs(30),
            body_budget_bytes: DEFAULT_BODY_BUDGET_BYTES,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A body of these chunks with no length known in advance.
    struct Chunks(std::collections::VecDeque<Bytes>);

    impl http_body::Body for Chunks {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            _cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
            std::task::Poll::Ready(self.0.pop_front().map(|b| Ok(http_body::Frame::data(b))))
        }
    }

    fn chunked(parts: &[&'static [u8]]) -> Body {
        Body::new(Chunks(
            parts.iter().map(|p| Bytes::from_static(p)).collect(),
        ))
    }

    #[tokio::test]
    async fn a_declared_body_holds_its_bytes_until_its_last_copy_is_dropped() {
        let budget = BodyBudget::new(10);
        let held = budget
            .read(Body::from("abcdef"), Some(6), 100)
            .await
            .unwrap();
        assert_eq!(budget.held_bytes(), 6);
        let bytes = held.into_bytes();
        let copy = bytes.clone();
        assert_eq!(&copy[..], b"abcdef");
        drop(bytes);
        assert_eq!(budget.held_bytes(), 6, "a clone still holds it");
        let refused = budget.read(Body::from("abcde"), Some(5), 100).await;
        assert_eq!(
            refused.unwrap_err(),
            BodyError::Exhausted {
                wanted: 5,
                held: 6,
                total: 10
            }
        );
        assert_eq!(budget.held_bytes(), 6, "a refused body holds nothing");
        drop(copy);
        assert_eq!(budget.held_bytes(), 0);
        assert!(budget.read(Body::from("abcde"), Some(5), 100).await.is_ok());
    }

    #[tokio::test]
    async fn a_body_without_a_length_takes_its_bytes_as_they_arrive() {
        let budget = BodyBudget::new(8);
        let first = budget
            .read(chunked(&[b"abc", b"def"]), None, 100)
            .await
            .unwrap()
            .into_bytes();
        assert_eq!((&first[..], budget.held_bytes()), (&b"abcdef"[..], 6));
        let refused = budget.read(chunked(&[b"a", b"bcd"]), None, 100).await;
        assert!(matches!(
            refused,
            Err(BodyError::Exhausted { wanted: 4, .. })
        ));
        assert_eq!(
            budget.held_bytes(),
            6,
            "the refused body's first chunk is given back"
        );
        drop(first);
        assert_eq!(budget.held_bytes(), 0);
    }

    #[tokio::test]
    async fn limits_come_before_the_budget() {
        let budget = BodyBudget::new(8);
        assert_eq!(
            budget
                .read(Body::from("abcdef"), Some(6), 5)
                .await
                .unwrap_err(),
            BodyError::TooLarge { limit: 5 }
        );
        assert_eq!(
            budget
                .read(chunked(&[b"abc", b"def"]), None, 5)
                .await
                .unwrap_err(),
            BodyError::TooLarge { limit: 5 }
        );
        assert_eq!(
            budget
                .read(Body::from("abcdefghi"), Some(9), 100)
                .await
                .unwrap_err(),
            BodyError::LargerThanBudget { total: 8 }
        );
        assert_eq!(budget.held_bytes(), 0);
        let empty = budget.read(Body::empty(), Some(0), 5).await.unwrap();
        assert!(empty.into_bytes().is_empty());
    }

    #[tokio::test]
    async fn a_payload_decoded_from_a_body_takes_over_as_much_as_it_has_bytes() {
        let budget = BodyBudget::new(100);
        let envelope = budget
            .read(Body::from("x".repeat(40)), Some(40), 100)
            .await
            .unwrap();
        assert_eq!(budget.held_bytes(), 40);
        let payload = envelope.replace(vec![7; 30]);
        assert_eq!((payload.len(), budget.held_bytes()), (30, 30));
        drop(payload);
        assert_eq!(budget.held_bytes(), 0);
    }
}
