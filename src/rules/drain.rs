//! One step of a drain or worker: record the send that finished, then pick
//! the next item (fairest destination first) and decide about candidates
//! until one is claimed or none is left — all in one transaction, so a drain
//! costs one durable step per message.
//!
//! A worker's slots that are ready to step at the same moment share one
//! *batched* step ([`step_batch`]): every member's outcome is recorded, then
//! one candidate scan hands out the claims they asked for, all in one
//! transaction (one lock hold, one journal entry, one audit append).

use std::collections::HashSet;
use std::time::Duration;

use crate::error::Result;
use crate::item::{ClaimId, OutboxItem};
use crate::order::Picker;
use crate::receipt::{DeliveryReceipt, DrainReport};
use crate::rules::Actor;
use crate::rules::lifecycle::{Decision, SendResult, decide, finish};
use crate::rules::txn::Txn;

/// An item claimed for a send: as claimed, and as it was before.
pub(crate) type Claim = (Box<OutboxItem>, Box<OutboxItem>);

/// What one step did.
#[derive(Default)]
pub(crate) struct Stepped {
    /// The recorded outcome of the send that finished, and its retry wait.
    pub(crate) finished: Option<(DeliveryReceipt, Option<Duration>)>,
    /// Items looked at and not claimed: deferred, or failed (ambiguous, exhausted).
    pub(crate) looked: Vec<DeliveryReceipt>,
    /// The item claimed for the next send, as claimed and as it was before.
    pub(crate) claimed: Option<Claim>,
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

/// One member of a batched step: the send it finished (if any, with the claim
/// it held), and how many
/// items it wants claimed (a slot: one, none when stopping; a worker filling
/// its free slots: one per free slot).
#[cfg_attr(not(feature = "tokio"), allow(dead_code))]
pub(crate) struct Member<'a> {
    pub(crate) finished: Option<(&'a ClaimId, &'a SendResult)>,
    pub(crate) claims: usize,
}

/// What a batched step did.
#[derive(Default)]
#[cfg_attr(not(feature = "tokio"), allow(dead_code))]
pub(crate) struct Batched {
    /// Per member, in order: the recorded outcome of its finished send.
    pub(crate) finished: Vec<Option<(DeliveryReceipt, Option<Duration>)>>,
    /// Items looked at and not claimed (for the whole batch).
    pub(crate) looked: Vec<DeliveryReceipt>,
    /// Per member, in order: the items claimed for it (at most its `claims`).
    pub(crate) claimed: Vec<Vec<Claim>>,
}

/// Records `finished` (a send of `actor`'s that ran, with its claim), then, if `pick` is
/// given, looks at candidates (fairest first, never `actor`'s own sends in
/// progress) until one is claimed or none is left. Items looked at and not
/// claimed are reported in `looked`.
///
/// # Errors
/// The engine's errors; the errors of [`finish`] and [`decide`].
pub(crate) fn step<T: Txn + ?Sized>(
    actor: &Actor<'_>,
    txn: &mut T,
    finished: Option<(&ClaimId, &SendResult)>,
    pick: Option<&mut Picker>,
) -> Result<Stepped> {
    let mut stepped = Stepped::default();
    if let Some((claim, result)) = finished {
        stepped.finished = Some(finish(actor, txn, claim, result)?);
    }
    let Some(picker) = pick else {
        return Ok(stepped);
    };
    stepped.claimed = claim_up_to(actor, txn, picker, 1, &mut stepped.looked)?.pop();
    Ok(stepped)
}

/// The steps of several slots as one: records every member's finished send,
/// in member order, then (if `pick` is given) claims up to the sum of the
/// members' `claims` with the same rules as [`step`], and hands them out in
/// member order. Each claim is for a slot that sends it right away, so a
/// batch claims no more than its members can send.
///
/// Per-destination order, caps and fairness are those of one step that
/// claims several items: each claim is decided against everything the batch
/// recorded and claimed before it.
///
/// # Errors
/// As [`step`]: one member's error fails the whole batch, and the engine
/// writes nothing (the caller reruns the members one by one).
#[cfg_attr(not(feature = "tokio"), allow(dead_code))]
pub(crate) fn step_batch<T: Txn + ?Sized>(
    actor: &Actor<'_>,
    txn: &mut T,
    members: &[Member<'_>],
    pick: Option<&mut Picker>,
) -> Result<Batched> {
    let mut batched = Batched::default();
    for member in members {
        batched.finished.push(match member.finished {
            Some((claim, result)) => Some(finish(actor, txn, claim, result)?),
            None => None,
        });
    }
    let mut claims = match pick {
        Some(picker) => {
            let wanted = members.iter().map(|m| m.claims).sum();
            claim_up_to(actor, txn, picker, wanted, &mut batched.looked)?
        }
        None => Vec::new(),
    }
    .into_iter();
    batched.claimed = members
        .iter()
        .map(|member| claims.by_ref().take(member.claims).collect())
        .collect();
    Ok(batched)
}

/// Looks at candidates, fairest first, until `wanted` are claimed or none is
/// left. One scan serves several claims: candidates are one per destination,
/// so claiming one never changes whether another may go (caps are checked
/// by [`decide`] against the claims made before it). Items looked at and not
/// claimed go to `looked`.
fn claim_up_to<T: Txn + ?Sized>(
    actor: &Actor<'_>,
    txn: &mut T,
    picker: &mut Picker,
    wanted: usize,
    looked: &mut Vec<DeliveryReceipt>,
) -> Result<Vec<Claim>> {
    let mut claimed = Vec::new();
    if wanted == 0 {
        return Ok(claimed);
    }
    let mut tried = HashSet::new();
    loop {
        let ordering = txn.settings().ordering;
        let mut candidates = txn.candidates(ordering, &mut |item| {
            let key = item.idempotency_key.as_str();
            // Our own sends in progress need no look (a lost claim of ours
            // that is not the one a send holds does).
            !actor.is_sending(item) && picker.admits(key) && !tried.contains(key)
        })?;
        if candidates.is_empty() {
            return Ok(claimed);
        }
        picker.rank(&mut candidates);
        for (destination, place) in candidates {
            let key = place.key;
            picker.looked_at(&key);
            match decide(actor, txn, &key)? {
                Decision::Done(receipt) => looked.push(receipt),
                Decision::Send(item, before) => {
                    picker.served(&destination);
                    claimed.push((item, before));
                    if claimed.len() == wanted {
                        return Ok(claimed);
                    }
                }
            }
            tried.insert(key);
        }
    }
}

/// A batched step's member as the rules see it (a worker's request).
#[cfg_attr(not(feature = "tokio"), allow(dead_code))]
pub(crate) trait AsMember {
    /// The finished send and the claims asked for.
    fn member(&self) -> Member<'_>;
}
