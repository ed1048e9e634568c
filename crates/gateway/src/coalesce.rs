//! Shared in-flight calls: coalesced reads and joined layered retries (SPEC §4.3).
//!
//! Why: when one agent asks for the same safe read several times at once (same method, URL,
//! end-to-end headers and body digest) on a route marked `coalesce: true`, one upstream call is
//! enough;
//! and when an agent's SDK resends a write with the same idempotency key while backstop is still
//! working on it, the resend joins that action instead of becoming a second one.
//!
//! How: the first caller for a key becomes the *leader* and runs the action; later callers
//! subscribe as *followers*. When the leader finishes it removes the key (under the table's lock,
//! so no follower can subscribe afterwards) and, only if followers are waiting, shares one
//! `Shared` copy of the result. Sharing means buffering: a shared 2xx body is read fully into
//! memory (bounded by [`SHARED_BODY_LIMIT`]) and each waiter gets the same status, headers and a
//! copy of the bytes. Without followers nothing is buffered and 2xx bodies stream as usual. A
//! leader that disappears (its client disconnected) drops its entry; its followers then start
//! over, one of them becoming the new leader.
//!
//! What makes two reads "the same" (`read_key`): a response may depend on any request header
//! (`Cookie`, a tenant header, `Range`, `Accept-*`), and on who asks. So the key is built from
//! the agent, the method, the URL, *every* end-to-end request header except the short
//! [`COALESCE_IGNORED_HEADERS`] list (trace context and backstop's own control headers, which no
//! provider answers differently for) and the body digest. Reads of two agents are never shared:
//! the key starts with the agent. When in doubt, a header is in the key and the reads are not
//! coalesced. Followers are answered as joined to the leader's action: they get its response
//! and its receipt (the same action id and attempts — one upstream call was made for them all,
//! and all of them belong to the same agent).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use backstop_core::outcome::{Outcome, OutcomeContext};
use bytes::Bytes;
use tokio::sync::broadcast;

use crate::action::ActionReceipt;

/// Largest 2xx body buffered to share it between coalesced callers (8 MiB).
pub const SHARED_BODY_LIMIT: usize = 8 * 1024 * 1024;

/// Request headers left out of a coalescing key (lower case; `x-backstop-` is a prefix): W3C
/// Trace Context (`traceparent`, `tracestate`) differs per call and never changes a provider's
/// answer; backstop's control headers are removed before forwarding anyway. Every other
/// header, `Range` and `Cookie` included, is part of the key.
pub const COALESCE_IGNORED_HEADERS: [&str; 3] = ["traceparent", "tracestate", "x-backstop-"];

fn ignored_for_coalescing(name: &str) -> bool {
    COALESCE_IGNORED_HEADERS.iter().any(|ignored| {
        if ignored.ends_with('-') {
            name.starts_with(ignored)
        } else {
            name == *ignored
        }
    })
}

/// The coalescing key of a safe read: SHA-256 (hex) over the agent, the method, the URL, every
/// request header not in [`COALESCE_IGNORED_HEADERS`] (sorted by name, values in their order)
/// and the body digest, each field length-prefixed so no two different requests share a key.
/// Hashed so header values (credentials, cookies) are not held as map keys in clear.
pub(crate) fn read_key(
    agent: &str,
    method: &http::Method,
    url: &str,
    headers: &http::HeaderMap,
    payload_digest: &str,
) -> String {
    use sha2::{Digest, Sha256};
    fn field(hasher: &mut Sha256, bytes: &[u8]) {
        hasher.update((bytes.len() as u64).to_be_bytes());
        hasher.update(bytes);
    }
    let mut hasher = Sha256::new();
    field(&mut hasher, agent.as_bytes());
    field(&mut hasher, method.as_str().as_bytes());
    field(&mut hasher, url.as_bytes());
    let mut pairs: Vec<(&str, &[u8])> = headers
        .iter()
        .filter(|(name, _)| !ignored_for_coalescing(name.as_str()))
        .map(|(name, value)| (name.as_str(), value.as_bytes()))
        .collect();
    // Stable: the values of one name keep their order.
    pairs.sort_by(|a, b| a.0.cmp(b.0));
    hasher.update((pairs.len() as u64).to_be_bytes());
    for (name, value) in pairs {
        field(&mut hasher, name.as_bytes());
        field(&mut hasher, value);
    }
    field(&mut hasher, payload_digest.as_bytes());
    hex::encode(hasher.finalize())
}

/// What identifies one shared call.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum FlightKey {
    /// A coalescable read, by its `read_key`.
    Read(String),
    /// An action in flight, joined by its idempotency key (a layered retry).
    Action(i64),
}

/// A result every waiter can rebuild its answer from.
#[derive(Debug, Clone)]
pub(crate) enum Shared {
    /// A provider response with its fully buffered body.
    Response {
        receipt: ActionReceipt,
        status: http::StatusCode,
        headers: http::HeaderMap,
        body: Bytes,
        /// Made by backstop itself ([`crate::problem::OwnAnswer`]): every copy keeps the
        /// retry hint it was made with.
        own: bool,
    },
    /// A gateway-made outcome.
    Outcome {
        receipt: ActionReceipt,
        outcome: Outcome,
        context: OutcomeContext,
        detail: String,
    },
}

/// The table of shared calls.
#[derive(Debug, Default)]
pub(crate) struct Flights {
    map: Mutex<HashMap<FlightKey, broadcast::Sender<Shared>>>,
}

/// The caller's role for a key.
pub(crate) enum Role {
    /// Run the call and share its result.
    Leader(LeaderGuard),
    /// Wait for the leader's result.
    Follower(broadcast::Receiver<Shared>),
}

/// Held by the leader; dropping it without [`LeaderGuard::finish`] releases the key.
pub(crate) struct LeaderGuard {
    flights: Arc<Flights>,
    key: FlightKey,
    sender: Option<broadcast::Sender<Shared>>,
}

impl Flights {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<FlightKey, broadcast::Sender<Shared>>> {
        self.map
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Joins the call in flight for `key`, or becomes its leader.
    pub(crate) fn join_or_lead(self: &Arc<Self>, key: FlightKey) -> Role {
        let mut map = self.lock();
        if let Some(sender) = map.get(&key) {
            return Role::Follower(sender.subscribe());
        }
        let (sender, _) = broadcast::channel(1);
        map.insert(key.clone(), sender.clone());
        Role::Leader(LeaderGuard {
            flights: self.clone(),
            key,
            sender: Some(sender),
        })
    }

    /// Follows the call in flight for `key`, if there is one.
    pub(crate) fn follow(&self, key: &FlightKey) -> Option<broadcast::Receiver<Shared>> {
        self.lock().get(key).map(broadcast::Sender::subscribe)
    }
}

impl LeaderGuard {
    /// Ends the flight: no one can join any more. Returns the sender when followers wait.
    pub(crate) fn finish(mut self) -> Option<broadcast::Sender<Shared>> {
        self.release();
        self.sender.take().filter(|s| s.receiver_count() > 0)
    }

    fn release(&mut self) {
        let mut map = self.flights.lock();
        let ours = match (map.get(&self.key), &self.sender) {
            (Some(current), Some(mine)) => current.same_channel(mine),
            _ => false,
        };
        if ours {
            map.remove(&self.key);
        }
    }
}

impl Drop for LeaderGuard {
    fn drop(&mut self) {
        if self.sender.is_some() {
            self.release();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_caller_follows_and_a_dropped_leader_frees_the_key() {
        let flights = Arc::new(Flights::default());
        let key = FlightKey::Read("GET x".into());
        let Role::Leader(leader) = flights.join_or_lead(key.clone()) else {
            panic!("first caller must lead");
        };
        let Role::Follower(mut rx) = flights.join_or_lead(key.clone()) else {
            panic!("second caller must follow");
        };
        drop(leader);
        assert!(rx.try_recv().is_err());
        assert!(matches!(flights.join_or_lead(key), Role::Leader(_)));
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> http::HeaderMap {
        let mut map = http::HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, http::HeaderValue::from_static(value));
        }
        map
    }

    fn key(agent: &str, pairs: &[(&'static str, &'static str)]) -> String {
        read_key(
            agent,
            &http::Method::GET,
            "https://api.test/v1/me",
            &headers(pairs),
            "e3b0",
        )
    }

    #[test]
    fn reads_of_two_agents_never_share_a_key() {
        assert_ne!(key("alice", &[]), key("bob", &[]));
        assert_eq!(key("alice", &[]), key("alice", &[]));
    }

    #[test]
    fn every_end_to_end_header_is_in_the_key() {
        let base = key("alice", &[("accept", "application/json")]);
        for pair in [
            ("cookie", "session=a"),
            ("x-tenant", "t1"),
            ("range", "bytes=0-9"),
            ("user-agent", "sdk/1"),
            ("if-none-match", "\"v1\""),
        ] {
            assert_ne!(
                base,
                key("alice", &[("accept", "application/json"), pair]),
                "{} must be in the key",
                pair.0
            );
        }
        assert_ne!(
            key("alice", &[("x-tenant", "t1")]),
            key("alice", &[("x-tenant", "t2")])
        );
    }

    #[test]
    fn trace_context_and_order_of_names_do_not_split_the_key() {
        assert_eq!(
            key("alice", &[("accept", "a"), ("x-tenant", "t1")]),
            key(
                "alice",
                &[
                    ("x-tenant", "t1"),
                    ("traceparent", "00-abc-def-01"),
                    ("accept", "a")
                ]
            )
        );
        // The order of the values of one header matters.
        assert_ne!(
            key("alice", &[("accept", "a"), ("accept", "b")]),
            key("alice", &[("accept", "b"), ("accept", "a")])
        );
    }

    #[test]
    fn finish_shares_only_with_followers() {
        let flights = Arc::new(Flights::default());
        let key = FlightKey::Action(7);
        let Role::Leader(leader) = flights.join_or_lead(key.clone()) else {
            panic!("first caller must lead");
        };
        assert!(leader.finish().is_none());
        let Role::Leader(leader) = flights.join_or_lead(key.clone()) else {
            panic!("the key was released");
        };
        let _rx = flights.follow(&key).expect("in flight");
        assert!(leader.finish().is_some());
        assert!(flights.follow(&key).is_none());
    }
}
