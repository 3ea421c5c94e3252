//! The delivery rules, written once for every engine.
//!
//! A rule runs inside one [`txn::Txn`] (one read-modify-write an engine
//! serves), reads and changes items through it, and seals the audit records
//! that report its changes; the engine commits it all in one durable step.
//! What a rule needs from the handle that runs it (its owner id, its sends in
//! flight, its learned pacing, its idempotent connectors) is an [`Actor`].

use std::collections::{BTreeMap, HashSet};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

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
    /// Keys this handle is sending right now. A claim naming our owner id but
    /// missing here was left by a call of ours that failed after claiming.
    pub(crate) in_flight: &'a Mutex<HashSet<String>>,
    /// Per destination, the spacing learned from the platform's `retry_after`s.
    pub(crate) pacing: &'a Pacing,
    /// Connectors whose platform deduplicates by transaction id, and for how long.
    pub(crate) idempotent: &'a BTreeMap<String, Duration>,
}

impl Actor<'_> {
    /// The in-flight set (a poisoned mutex is still a valid set).
    pub(crate) fn in_flight(&self) -> MutexGuard<'_, HashSet<String>> {
        self.in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests;
