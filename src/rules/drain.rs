//! One step of a drain or worker: record the send that finished, then pick
//! the next item (fairest destination first) and decide about candidates
//! until one is claimed or none is left — all in one transaction, so a drain
//! costs one durable step per message.

use std::collections::HashSet;
use std::time::Duration;

use crate::error::Result;
use crate::item::OutboxItem;
use crate::order::Picker;
use crate::receipt::{DeliveryReceipt, DrainReport};
use crate::rules::Actor;
use crate::rules::lifecycle::{Decision, SendResult, decide, finish};
use crate::rules::txn::Txn;

/// What one step did.
#[derive(Default)]
pub(crate) struct Stepped {
    /// The recorded outcome of the send that finished, and its retry wait.
    pub(crate) finished: Option<(DeliveryReceipt, Option<Duration>)>,
    /// Items looked at and not claimed: deferred, or failed (ambiguous, exhausted).
    pub(crate) looked: Vec<DeliveryReceipt>,
    /// The item claimed for the next send, as claimed and as it was before.
    pub(crate) claimed: Option<(Box<OutboxItem>, Box<OutboxItem>)>,
}

impl Stepped {
    /// Adds the finished send and the items looked at to a drain's tally.
    pub(crate) fn tally(&self, report: &mut DrainReport) {
        if let Some((receipt, wait)) = &self.finished {
            report.add(receipt.clone(), wait.is_some());
        }
        for receipt in &self.looked {
            report.add(receipt.clone(), false);
        }
    }
}

/// Records `finished` (a send of `actor`'s that ran), then, if `pick` is
/// given, looks at candidates (fairest first, never `actor`'s own sends in
/// progress) until one is claimed or none is left. Items looked at and not
/// claimed are reported in `looked`.
///
/// # Errors
/// The engine's errors; the errors of [`finish`] and [`decide`].
pub(crate) fn step<T: Txn + ?Sized>(
    actor: &Actor<'_>,
    txn: &mut T,
    finished: Option<(&str, &SendResult)>,
    pick: Option<&mut Picker>,
) -> Result<Stepped> {
    let mut stepped = Stepped::default();
    if let Some((key, result)) = finished {
        stepped.finished = Some(finish(actor, txn, key, result)?);
    }
    let Some(picker) = pick else {
        return Ok(stepped);
    };
    let mut tried = HashSet::new();
    loop {
        let ordering = txn.settings().ordering;
        let mut candidates = txn.candidates(ordering, &mut |item| {
            let key = item.idempotency_key.as_str();
            // Our own sends in progress need no look.
            let ours = item.claim_owner() == Some(actor.owner) && actor.in_flight().contains(key);
            !ours && picker.admits(key) && !tried.contains(key)
        })?;
        if candidates.is_empty() {
            return Ok(stepped);
        }
        picker.rank(&mut candidates);
        for (destination, place) in candidates {
            let key = place.key;
            picker.looked_at(&key);
            match decide(actor, txn, &key)? {
                Decision::Done(receipt) => stepped.looked.push(receipt),
                Decision::Send(item, before) => {
                    picker.served(&destination);
                    stepped.claimed = Some((item, before));
                    return Ok(stepped);
                }
            }
            tried.insert(key);
        }
    }
}
