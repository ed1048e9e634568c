//! The delayed queue's holding: waiting actions as compact slab entries with interned names,
//! and their count in their scopes' delayed queues.

use std::{collections::HashSet, sync::Arc};

use backstop_core::{budget::ActionBudget, pacing::Priority};
use jiff::Timestamp;
use tokio::sync::oneshot;

use super::{
    messages::Answer,
    scopes::{ScopeEntry, ScopeIds},
};

/// One waiting action, held in a slab slot until it is answered.
pub(super) struct Waiter {
    /// The handle's ticket: the key of `State::tickets`, and the arrival order (tickets are
    /// handed out in the order actions call `acquire`).
    pub(super) ticket: u64,
    /// `(agent, task id)`, shared by the task's waiting actions.
    pub(super) task: Arc<TaskKey>,
    pub(super) route: Arc<str>,
    pub(super) scopes: ScopeIds,
    pub(super) budget: ActionBudget,
    /// Waited time up to here is charged.
    pub(super) since: Timestamp,
    /// The wake instant, while `timed`.
    pub(super) wake: Timestamp,
    /// Taken when the answer is sent; a waiter dropped unanswered answers `Stopped`.
    pub(super) reply: Option<oneshot::Sender<Answer>>,
    pub(super) priority: Priority,
    /// Not examined yet since it arrived ready (the gap until the first look is processing,
    /// not waiting: a class with `max_wait_seconds: 0` must still get its first attempt).
    pub(super) fresh: bool,
    /// Counted in its scopes' delayed queues.
    pub(super) delayed: bool,
    /// Listed in `State::ready` for the next pump.
    pub(super) queued: bool,
    /// In the wake queue under `(wake, order)`.
    pub(super) timed: bool,
    /// A reconciliation lookup, which its task's cancellation does not hold back.
    pub(super) reconciliation: bool,
}

/// A task: `(agent, task id)`.
pub(super) type TaskKey = (String, String);

impl Drop for Waiter {
    fn drop(&mut self) {
        if let Some(reply) = self.reply.take() {
            let _ = reply.send(Answer::Stopped {
                budget: self.budget,
            });
        }
    }
}

impl Waiter {
    /// Examination order: higher priority first, then arrival.
    pub(super) fn order(&self) -> u64 {
        order_key(self.priority, self.ticket)
    }
}

/// Packs priority (highest first) and arrival into one ascending key; `seq` stays below 2^62.
pub(super) fn order_key(priority: Priority, seq: u64) -> u64 {
    let rank: u64 = match priority {
        Priority::Interactive => 0,
        Priority::Normal => 1,
        Priority::Background => 2,
    };
    (rank << 62) | (seq & ((1 << 62) - 1))
}

/// Interned names are swept (those no waiter holds any more are dropped) when the table grows
/// past twice its size after the last sweep, and never below this.
pub(super) const MIN_NAMES_SWEEP: usize = 1024;

/// Shared copies of names held by waiting actions (many actions name one task and one route).
pub(super) struct Interner<T: ?Sized> {
    set: HashSet<Arc<T>>,
    sweep_at: usize,
}

impl<T: ?Sized> Default for Interner<T> {
    fn default() -> Self {
        Interner {
            set: HashSet::new(),
            sweep_at: MIN_NAMES_SWEEP,
        }
    }
}

impl<T: ?Sized + Eq + std::hash::Hash> Interner<T> {
    /// The shared copy of `key`, when one is held.
    pub(super) fn get(&self, key: &T) -> Option<Arc<T>> {
        self.set.get(key).cloned()
    }

    /// Adds a copy not held yet; first drops the copies no one else holds when the table has
    /// doubled since the last sweep (so the sweeps cost O(1) per insert).
    pub(super) fn insert(&mut self, shared: Arc<T>) -> Arc<T> {
        if self.set.len() >= self.sweep_at {
            self.set.retain(|held| Arc::strong_count(held) > 1);
            self.sweep_at = (self.set.len() * 2).max(MIN_NAMES_SWEEP);
        }
        self.set.insert(shared.clone());
        shared
    }
}

/// Waiters per slab chunk: the slab grows by whole chunks, never by copying.
pub(super) const SLAB_CHUNK: usize = 1024;

/// Waiting actions by slot number; vacant slots are reused first.
#[derive(Default)]
pub(super) struct Slab {
    pub(super) chunks: Vec<Vec<Option<Waiter>>>,
    pub(super) free: Vec<u32>,
}

impl Slab {
    /// The waiter in `slot`, if the slot is taken.
    pub(super) fn get_mut(&mut self, slot: u32) -> Option<&mut Waiter> {
        let slot = slot as usize;
        self.chunks
            .get_mut(slot / SLAB_CHUNK)?
            .get_mut(slot % SLAB_CHUNK)?
            .as_mut()
    }

    /// Puts `waiter` into a vacant slot (or a new one) and returns the slot.
    pub(super) fn insert(&mut self, waiter: Waiter) -> u32 {
        if let Some(slot) = self.free.pop() {
            let index = slot as usize;
            if let Some(entry) = self
                .chunks
                .get_mut(index / SLAB_CHUNK)
                .and_then(|chunk| chunk.get_mut(index % SLAB_CHUNK))
            {
                *entry = Some(waiter);
                return slot;
            }
        }
        let full = self.chunks.len() * SLAB_CHUNK;
        let slot = match self.chunks.last_mut() {
            Some(chunk) if chunk.len() < SLAB_CHUNK => {
                let slot = full - SLAB_CHUNK + chunk.len();
                chunk.push(Some(waiter));
                slot
            }
            _ => {
                let mut chunk = Vec::with_capacity(SLAB_CHUNK);
                chunk.push(Some(waiter));
                self.chunks.push(chunk);
                full
            }
        };
        u32::try_from(slot).unwrap_or(u32::MAX)
    }

    /// Takes the waiter out of `slot`, which becomes vacant.
    pub(super) fn take(&mut self, slot: u32) -> Option<Waiter> {
        let index = slot as usize;
        let waiter = self
            .chunks
            .get_mut(index / SLAB_CHUNK)?
            .get_mut(index % SLAB_CHUNK)?
            .take()?;
        self.free.push(slot);
        Some(waiter)
    }

    /// Drops the waiter in `slot` where it lies.
    pub(super) fn vacate(&mut self, slot: u32) {
        let index = slot as usize;
        if let Some(entry) = self
            .chunks
            .get_mut(index / SLAB_CHUNK)
            .and_then(|chunk| chunk.get_mut(index % SLAB_CHUNK))
        {
            if entry.take().is_some() {
                self.free.push(slot);
            }
        }
    }

    /// Every waiter with its slot.
    pub(super) fn iter(&self) -> impl Iterator<Item = (u32, &Waiter)> {
        self.chunks
            .iter()
            .flatten()
            .enumerate()
            .filter_map(|(slot, w)| w.as_ref().map(|w| (slot as u32, w)))
    }
}

/// Counts the waiter in every scope's delayed queue.
///
/// # Errors
/// The `scope_saturated` detail when a scope's `max_delayed_requests` is reached; nothing stays
/// counted then.
pub(super) fn try_delay(scopes: &mut [ScopeEntry], waiter: &mut Waiter) -> Result<(), String> {
    if waiter.delayed {
        return Ok(());
    }
    let ids = waiter.scopes.as_slice();
    for (counted, &id) in ids.iter().enumerate() {
        if let Err(full) = scopes[id as usize].state.record.try_delay() {
            for &done in &ids[..counted] {
                scopes[done as usize].state.record.undelay();
            }
            tracing::info!(
                task = %waiter.task.1,
                route = %waiter.route,
                scope = %scopes[id as usize].state.record.name,
                "refused: the scope's delayed queue is full (scope_saturated)"
            );
            return Err(full.to_string());
        }
    }
    waiter.delayed = true;
    Ok(())
}

/// Takes the waiter out of its scopes' delayed queues, where [`try_delay`] counted it.
pub(super) fn undelay(scopes: &mut [ScopeEntry], waiter: &Waiter) {
    if waiter.delayed {
        for &id in waiter.scopes.as_slice() {
            scopes[id as usize].state.record.undelay();
        }
    }
}
