//! The delivery rules, written once for every engine.
//!
//! A rule runs inside one [`txn::Txn`] (one read-modify-write an engine
//! serves), reads and changes items through it, and seals the audit records
//! that report its changes; the engine commits it all in one durable step.
//! What a rule needs from the handle that runs it (its owner id, its sends in
//! flight, its learned pacing, its idempotent connectors) is an [`Actor`].

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crate::item::{ClaimId, ClaimStamp, OutboxItem};
use crate::pacing::Pacing;

pub(crate) mod bulk;
pub(crate) mod codes;
pub(crate) mod drain;
pub(crate) mod enqueue;
pub(crate) mod lifecycle;
pub(crate) mod rate;
pub(crate) mod record;
pub(crate) mod repair;
pub(crate) mod txn;

/// What the rules need from the handle that runs them.
pub(crate) struct Actor<'a> {
    /// This handle's owner id: the claims it takes name it.
    pub(crate) owner: &'a str,
    /// The claims this handle is sending right now. A claim naming our owner
    /// id but missing here was left by a call of ours that failed after
    /// claiming (or was lost, and this is a newer one's look).
    pub(crate) in_flight: &'a Mutex<InFlight>,
    /// Per destination, the spacing learned from the platform's `retry_after`s.
    pub(crate) pacing: &'a Pacing,
    /// Connectors whose platform deduplicates by transaction id, and for how long.
    pub(crate) idempotent: &'a BTreeMap<String, Duration>,
}

impl Actor<'_> {
    /// The in-flight set (a poisoned mutex is still a valid set).
    pub(crate) fn in_flight(&self) -> MutexGuard<'_, InFlight> {
        self.in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether `item`'s claim is one this handle is sending right now: it
    /// names our owner id and is the very claim a send of ours holds (not an
    /// older one of ours that was lost, nor a newer one).
    pub(crate) fn is_sending(&self, item: &OutboxItem) -> bool {
        item.claim_owner() == Some(self.owner)
            && item
                .claim_stamp()
                .is_some_and(|stamp| self.in_flight().contains(&item.idempotency_key, stamp))
    }
}

/// The claims a handle is sending right now, by key. Almost always one per
/// key; two when a send of ours whose claim was lost still runs while the
/// item, requeued, is sent again by this handle under a newer claim.
#[derive(Default)]
pub(crate) struct InFlight(HashMap<String, Vec<ClaimStamp>>);

impl InFlight {
    /// Marks `claim` as being sent; `false` if it already was (the caller
    /// must then make a claim with another identity).
    pub(crate) fn insert(&mut self, claim: &ClaimId) -> bool {
        let stamps = self.0.entry(claim.key.clone()).or_default();
        if stamps.contains(&claim.stamp()) {
            return false;
        }
        stamps.push(claim.stamp());
        true
    }

    /// Whether a claim of `key` with this attempt and time is being sent.
    pub(crate) fn contains(&self, key: &str, stamp: ClaimStamp) -> bool {
        self.0
            .get(key)
            .is_some_and(|stamps| stamps.contains(&stamp))
    }

    /// The send of `claim` is over (recorded, given back, or its record
    /// failed). Another send of the same key stays marked.
    pub(crate) fn remove(&mut self, claim: &ClaimId) {
        if let Some(stamps) = self.0.get_mut(&claim.key) {
            stamps.retain(|stamp| *stamp != claim.stamp());
            if stamps.is_empty() {
                self.0.remove(&claim.key);
            }
        }
    }

    /// Nothing is being sent.
    #[cfg(all(test, feature = "tokio"))]
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[cfg(test)]
mod tests;
