//! Shared in-flight calls: coalesced reads and joined layered retries (SPEC §4.3).
//!
//! Why: when several agents ask for the same safe read at once (same method, URL, relevant
//! headers and body digest) on a route marked `coalesce: true`, one upstream call is enough;
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

/// What identifies one shared call.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum FlightKey {
    /// A coalescable read: method, URL, relevant headers and body digest, joined.
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
