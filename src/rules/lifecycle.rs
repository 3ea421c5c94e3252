//! What may happen to an item, from the moment it is looked at to the moment
//! its send's outcome is recorded: decide (and claim), finish, release,
//! abandon, fail — written once, for every engine.
//!
//! The rules ([`decide`], [`finish`], [`release`], [`abandon`]) run inside
//! one [`Txn`], on either engine: the one way an item changes. They share
//! their item transitions ([`claim`], [`mark_sent`], [`mark_failed`],
//! [`mark_maybe_sent`]).
//!
//! # A claim lost while its send ran
//!
//! With session locks as liveness, a network cut or a server restart makes a
//! live send look dead: another handle fails its claim as
//! [`AMBIGUOUS_AFTER_RESTART`] (never resending it). When the send then
//! finishes, [`finish`] finds that the item no longer holds its claim and
//! accounts for what really happened, whatever the item became meanwhile (an
//! operator may have requeued or cancelled it, and a resend may have started
//! or ended, even one by the same handle: after a cut a handle takes its
//! owner id again, so "a claim naming our owner" is not "our claim"; a send
//! carries its [`ClaimId`]):
//!
//! * still failed as ambiguous and unclaimed: a delivered send makes the item
//!   `sent` (with its transport ref, so replies correlate); a send that
//!   certainly did not deliver keeps the item failed with the real error code
//!   and no longer counts it as a possible send (a correction,
//!   [`CORRECTION_NOTE`]);
//! * queued again and unclaimed (requeued, or put back for a resend under an
//!   idempotent transport, and not resent yet), and the send delivered: the
//!   item becomes `sent` with its transport ref, as a correction
//!   ([`REQUEUED_NOTE`]), so it is not sent a second time;
//! * claimed again by another attempt (of any handle, this one included),
//!   sent by one, cancelled or failed otherwise, and the send delivered: the
//!   item's state is left alone (a resend under way cannot be called back, a
//!   cancel or a recorded resend stays true), and a
//!   [`LateDelivery`](AuditOutcome::LateDelivery) record with this send's
//!   transport ref and attempt, and a note naming what the item had become
//!   ([`LATE_DELIVERY_NOTE`]), puts the message on the chain; the receipt
//!   says `Sent` with that ref;
//! * the send certainly failed (or its outcome is unknown) and the item had
//!   moved on: nothing is changed and nothing recorded — no message reached
//!   the chat to account for, the item's own records already say what it is,
//!   and a record of a non-event would only contradict them; the receipt is
//!   the item as it now stands (`Deferred` when queued, `InFlight` when
//!   claimed, its terminal outcome otherwise), never a `Failed` for an item
//!   that will still be sent, and never a retry that would put an item
//!   another send holds back in the queue.
//!
//! Every record written for a lost claim names it in its note ("this send:
//! attempt n, claimed at t").
//!
//! **Record shape.** A late delivery gets its own outcome, not `sent`, because
//! every record of an item except it says the item's state: `durable-outbox
//! verify` checks that an item's last record is the one it names
//! (`last_audit_id`) and that its last state-giving record agrees with its
//! state. The late-delivery record is stamped on the item as its latest (the
//! only change to the item: `last_audit_id` and `updated_at`), and the
//! verifier compares the state with the record before it. The chain's hashes,
//! `verify_audit`, the offline verifier of an export and `history` treat it as
//! any record.
//!
//! Nothing is ever resent by a correction.

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::audit::AuditOutcome;
use crate::clock::{format_timestamp, later};
use crate::error::{Error, Result};
use crate::item::{Claim, ClaimId, ItemState, OutboxItem};
use crate::message::limits;
use crate::order;
use crate::receipt::{DeliveryReceipt, Outcome};
use crate::rules::Actor;
use crate::rules::codes::{
    AMBIGUOUS_AFTER_RESTART, ATTEMPTS_EXHAUSTED, CANCELLED, GAVE_UP, SEND_PANICKED, sanitize,
};
use crate::rules::rate::{learn_pace, rate_capped};
use crate::rules::record::{record, record_reporting};
use crate::rules::repair::{claim_is_live, may_resend, resend_later, settle_dead_claim};
use crate::rules::txn::Txn;
use crate::send::{FailureClass, SendError};

/// What `send` produced, with panics caught.
pub(crate) type SendResult = std::thread::Result<std::result::Result<Option<String>, SendError>>;

/// What deciding about one item concluded.
pub(crate) enum Decision {
    /// No send now; here is why.
    Done(DeliveryReceipt),
    /// Claimed: the item as claimed, and as it was before (to release it unchanged).
    Send(Box<OutboxItem>, Box<OutboxItem>),
}

// ----- item transitions (shared by every rule and engine) -----------------

/// An item's claimed state: one more attempt, the claim naming `owner`.
pub(crate) fn claim(item: &OutboxItem, owner: &str, now: DateTime<Utc>) -> OutboxItem {
    let mut claimed = item.clone();
    claimed.attempts += 1;
    claimed.claim = Some(Claim {
        owner: Some(owner.to_owned()),
        at: Some(now),
    });
    claimed.next_attempt_at = None;
    claimed.error_code = None;
    claimed.failure_class = None;
    claimed.updated_at = now;
    claimed
}

/// A delivered item: `sent` at `now`, unclaimed, with the platform's reference
/// (made storable; a blank one is none).
pub(crate) fn mark_sent(item: &mut OutboxItem, now: DateTime<Utc>, transport_ref: Option<&str>) {
    item.state = ItemState::Sent;
    item.claim = None;
    item.sent_at = Some(now);
    item.error_code = None;
    item.failure_class = None;
    item.transport_ref = transport_ref
        .filter(|r| !r.trim().is_empty())
        .map(|r| sanitize(r, limits::TRANSPORT_REF));
}

/// A terminally failed item: `failed` with `code`, of class `class`, unclaimed,
/// never due again.
pub(crate) fn mark_failed(item: &mut OutboxItem, code: &str, class: FailureClass) {
    item.state = ItemState::Failed;
    item.claim = None;
    item.next_attempt_at = None;
    item.error_code = Some(code.to_owned());
    item.failure_class = Some(class);
}

/// Keeps a claimed item's claim time as `maybe_sent_at`: its send may have
/// reached the platform, so it counts against the destination's caps as a send
/// from then on, across restarts and whatever becomes of the item. A claim from
/// the reference design has no time: its last change is the claim.
pub(crate) fn mark_maybe_sent(item: &mut OutboxItem) {
    let claimed_at = item.claim.as_ref().and_then(|c| c.at);
    item.maybe_sent_at = Some(claimed_at.unwrap_or(item.updated_at));
}

// ----- the transaction rules ---------------------------------------------

/// Decides what to do with the item now, claiming it (for `actor`) if it is to
/// be sent, in an `outbox.claim` span:
///
/// - a terminal item (live or in history) gives its outcome (a missing terminal
///   audit record is sealed, marked reconciled);
/// - a live claim gives `InFlight`; a dead one is settled (`repair`);
/// - an item behind its destination's head gives `Waiting`;
/// - an item out of attempts fails; one not due gives `Deferred`;
/// - a cap or the pace defers it, on record, to the moment it allows the send;
/// - otherwise it is claimed and goes into `actor`'s in-flight set.
///
/// # Errors
/// [`Error::NotFound`] for an unknown key; the engine's errors.
pub(crate) fn decide<T: Txn + ?Sized>(
    actor: &Actor<'_>,
    txn: &mut T,
    key: &str,
) -> Result<Decision> {
    let span = tracing::info_span!(
        "outbox.claim",
        key,
        destination = tracing::field::Empty,
        attempt = tracing::field::Empty,
        outcome = tracing::field::Empty,
    );
    let _entered = span.enter();
    let decision = decide_inner(actor, txn, key)?;
    match &decision {
        Decision::Send(item, _) => {
            span.record("destination", item.destination.as_str());
            span.record("attempt", item.attempts);
            span.record("outcome", "claimed");
        }
        Decision::Done(receipt) => {
            span.record("destination", receipt.destination.as_str());
            span.record("attempt", receipt.attempts);
            span.record("outcome", receipt.outcome.as_str());
        }
    }
    Ok(decision)
}

fn decide_inner<T: Txn + ?Sized>(actor: &Actor<'_>, txn: &mut T, key: &str) -> Result<Decision> {
    let now = txn.now();
    let (ordering, max_attempts) = {
        let settings = txn.settings();
        (settings.ordering, settings.max_attempts)
    };
    let Some(item) = txn.item(key)? else {
        // Only terminal items move to history, each with its outcome on record.
        return match txn.archived(key)? {
            Some(old) => Ok(Decision::Done(DeliveryReceipt::for_item(
                &old,
                terminal_outcome(old.state),
                old.last_audit_id.clone(),
            ))),
            None => Err(Error::NotFound {
                key: key.to_owned(),
            }),
        };
    };
    if item.state.is_terminal() {
        let state = item.state;
        let outcome = terminal_outcome(state);
        let audit_id = match item.last_audit_id.clone() {
            Some(id) => id,
            None => record(
                txn,
                key,
                audit_outcome_of(state),
                Some("terminal outcome had no audit record"),
                true,
            )?,
        };
        return Ok(Decision::Done(receipt(txn, key, outcome, Some(audit_id))?));
    }
    if item.claim.is_some() {
        let claim = ClaimId::of(item);
        if claim_is_live(actor, txn, &claim)? {
            return Ok(Decision::Done(receipt(txn, key, Outcome::InFlight, None)?));
        }
        if let Some(failed) = settle_dead_claim(actor, txn, key)? {
            return Ok(failed);
        }
    }
    let item = txn.existing(key)?;
    let destination = item.destination.clone();
    if ordering == order::Ordering::PerDestination
        && txn
            .head_of(&destination)?
            .is_some_and(|head| head.key != key)
    {
        return Ok(Decision::Done(receipt(txn, key, Outcome::Waiting, None)?));
    }
    let item = txn.existing(key)?;
    if item.attempts >= max_attempts {
        return fail(txn, key, ATTEMPTS_EXHAUSTED, FailureClass::Retryable);
    }
    if item.next_attempt_at.is_some_and(|at| at > now) {
        return Ok(Decision::Done(receipt(txn, key, Outcome::Deferred, None)?));
    }
    if let Some((free_at, code)) = rate_capped(actor, txn, &destination)? {
        let item = txn.item_mut(key)?;
        item.next_attempt_at = Some(free_at);
        item.error_code = Some(code.to_owned());
        item.failure_class = None;
        let audit_id = record(txn, key, AuditOutcome::Deferred, None, false)?;
        return Ok(Decision::Done(receipt(
            txn,
            key,
            Outcome::Deferred,
            Some(audit_id),
        )?));
    }
    let before = Box::new(txn.existing(key)?.clone());
    let mut claimed = claim(&before, actor.owner, now);
    let id = apart_from_our_sends(actor, &mut claimed);
    txn.insert(claimed.clone())?;
    // Marked before the transaction ends, so no thread of ours mistakes the
    // claim for an orphan.
    actor.in_flight().insert(&id);
    Ok(Decision::Send(Box::new(claimed), before))
}

/// The identity of a new claim of `actor`'s, made a microsecond later while a
/// send of ours still runs under the same identity: a send whose claim was
/// lost (declared ambiguous after our session was cut) may still be running
/// when the item, requeued, is claimed again by us, and a requeue starts the
/// attempt count again and a clock may stand still. Each send then finishes
/// its own claim ([`ClaimId`]).
fn apart_from_our_sends(actor: &Actor<'_>, claimed: &mut OutboxItem) -> ClaimId {
    let in_flight = actor.in_flight();
    let mut id = ClaimId::of(claimed);
    while in_flight.contains(&id.key, id.stamp()) {
        let later = id
            .at
            .and_then(|at| at.checked_add_signed(chrono::TimeDelta::microseconds(1)));
        let (Some(claim), Some(later)) = (claimed.claim.as_mut(), later) else {
            break;
        };
        claim.at = Some(later);
        id = ClaimId::of(claimed);
    }
    id
}

/// Records what `send` did under `claim` (one `actor` took), in an
/// `outbox.finish` span. Returns the receipt and, for a retryable failure with
/// attempts left, how long to wait.
///
/// - delivered: `sent`, with the platform's reference;
/// - retryable with attempts and time left (a `retry_after` costs no attempt):
///   back in the queue after the backoff, the platform's wait and the learned
///   pace; past `give_up_after`: failed as [`GAVE_UP`];
/// - ambiguous: failed, counted as a possible send; or, for an idempotent
///   transport, queued for a resend under the same transaction id;
/// - permanent (or out of attempts): failed;
/// - a panic: failed as ambiguous with [`SEND_PANICKED`];
/// - the item no longer holds `claim` (lost while the send ran; the item
///   may meanwhile hold a newer claim, even one of ours): accounted for as
///   the module docs say ("A claim lost while its send ran").
///
/// # Errors
/// [`Error::NotFound`] if the item vanished; the engine's errors.
pub(crate) fn finish<T: Txn + ?Sized>(
    actor: &Actor<'_>,
    txn: &mut T,
    claim: &ClaimId,
    result: &SendResult,
) -> Result<(DeliveryReceipt, Option<Duration>)> {
    let key = claim.key();
    let span = tracing::info_span!(
        "outbox.finish",
        key,
        destination = tracing::field::Empty,
        attempt = tracing::field::Empty,
        outcome = tracing::field::Empty,
        error_code = tracing::field::Empty,
    );
    let _entered = span.enter();
    let (receipt, wait) = finish_inner(actor, txn, claim, result)?;
    span.record("destination", receipt.destination.as_str());
    span.record("attempt", receipt.attempts);
    span.record("outcome", receipt.outcome.as_str());
    if let Some(code) = &receipt.error_code {
        span.record("error_code", code.as_str());
    }
    Ok((receipt, wait))
}

fn finish_inner<T: Txn + ?Sized>(
    actor: &Actor<'_>,
    txn: &mut T,
    claim: &ClaimId,
    result: &SendResult,
) -> Result<(DeliveryReceipt, Option<Duration>)> {
    let now = txn.now();
    let key = claim.key();
    // The claim this send holds, not "a claim naming our owner id": after a
    // cut a handle takes its owner id again, and the item may hold a newer
    // claim of ours by now (requeued and claimed again).
    if claim.owner.as_deref() != Some(actor.owner) || !txn.existing(key)?.holds(claim) {
        // File engine: only possible if the state files were replaced behind
        // our back. PostgreSQL: the claim was lost while the send ran.
        return Ok((account_for_lost_claim(txn, claim, result)?, None));
    }
    let item = txn.existing(key)?;
    let attempts = item.attempts;
    let created_at = item.created_at;
    match result {
        Ok(Ok(transport_ref)) => {
            mark_sent(txn.item_mut(key)?, now, transport_ref.as_deref());
            let audit_id = record(txn, key, AuditOutcome::Sent, None, false)?;
            Ok((receipt(txn, key, Outcome::Sent, Some(audit_id))?, None))
        }
        Ok(Err(error)) => finish_failed(actor, txn, key, error, attempts, created_at),
        Err(_panic) => Ok((done(fail_ambiguous(txn, key, SEND_PANICKED)?), None)),
    }
}

/// What a lost claim's item had become when its send finished (see the module
/// docs, "A claim lost while its send ran").
enum Moved {
    /// Still failed as [`AMBIGUOUS_AFTER_RESTART`] and unclaimed: nobody
    /// touched it since the claim was declared ambiguous.
    DeclaredAmbiguous,
    /// Queued and unclaimed: requeued (or put back for a resend under an
    /// idempotent transport) and not sent again yet.
    Requeued,
    /// Claimed by another attempt, sent, cancelled, or failed otherwise; the
    /// text says which, for the audit note.
    Elsewhere(String),
}

impl Moved {
    fn of(item: &OutboxItem) -> Self {
        match (item.state, &item.claim) {
            (ItemState::Failed, None)
                if item.error_code.as_deref() == Some(AMBIGUOUS_AFTER_RESTART) =>
            {
                Self::DeclaredAmbiguous
            }
            (ItemState::Queued, None) => Self::Requeued,
            (ItemState::Queued, Some(claim)) => Self::Elsewhere(format!(
                "been claimed again (by owner {}, attempt {}, a resend under way)",
                claim.owner.as_deref().unwrap_or("-"),
                item.attempts
            )),
            (ItemState::Sent, _) => Self::Elsewhere(format!(
                "been sent by another attempt (transport ref {})",
                item.transport_ref.as_deref().unwrap_or("-")
            )),
            (ItemState::Failed, _) if item.error_code.as_deref() == Some(CANCELLED) => {
                Self::Elsewhere("been cancelled".to_owned())
            }
            (ItemState::Failed, _) => Self::Elsewhere(format!(
                "failed again ({})",
                item.error_code.as_deref().unwrap_or("-")
            )),
        }
    }
}

/// [`finish`] for a send whose claim is no longer ours: another handle
/// declared it ambiguous while the send ran (its owner's session ended under
/// it: a network cut, a server restart), and the item may have moved on since
/// (see the module docs). Nothing is ever resent from here.
///
/// - a delivery or a certain failure of an item still declared ambiguous:
///   its real outcome is recorded as a correction ([`CORRECTION_NOTE`]);
/// - a delivery of an item queued again and not resent yet: `sent`, as a
///   correction ([`REQUEUED_NOTE`]), so it is not sent a second time;
/// - a delivery of an item that moved on otherwise (claimed again, sent,
///   cancelled): the item is left as it is and a
///   [`LateDelivery`](AuditOutcome::LateDelivery) record with this send's
///   transport ref accounts for the message; the receipt says `Sent`, with
///   this send's ref;
/// - anything else (a certain failure after the item moved on, or an outcome
///   still unknown): nothing to correct and nothing delivered to account
///   for, so no record; the receipt is the item as it now stands.
///
/// Every record written here names this send's claim (its attempt and claim
/// time) in its note; a late delivery's record carries this send's attempt,
/// not the one the item has reached since.
fn account_for_lost_claim<T: Txn + ?Sized>(
    txn: &mut T,
    claim: &ClaimId,
    result: &SendResult,
) -> Result<DeliveryReceipt> {
    let now = txn.now();
    let key = claim.key();
    let this_send = format!(
        "this send: attempt {}, claimed at {}",
        claim.attempt,
        claim.at.map_or_else(|| "-".to_owned(), format_timestamp)
    );
    let moved = Moved::of(txn.existing(key)?);
    let known_failure = match result {
        Ok(Err(error)) => error.class() != FailureClass::Ambiguous,
        Ok(Ok(_)) | Err(_) => false,
    };
    match (result, moved) {
        (Ok(Ok(reference)), moved @ (Moved::DeclaredAmbiguous | Moved::Requeued)) => {
            let note = match moved {
                Moved::Requeued => REQUEUED_NOTE,
                _ => CORRECTION_NOTE,
            };
            let note = format!("{note} ({this_send})");
            tracing::warn!(
                key,
                "this send's claim was lost while it ran; recording its delivery as a correction"
            );
            let item = txn.item_mut(key)?;
            item.updated_at = now;
            // Ours was an attempt, whatever a requeue reset the count to.
            item.attempts = item.attempts.max(1);
            item.next_attempt_at = None;
            mark_sent(item, now, reference.as_deref());
            let audit_id = record(txn, key, AuditOutcome::Sent, Some(&note), false)?;
            receipt(txn, key, Outcome::Sent, Some(audit_id))
        }
        (Ok(Err(error)), Moved::DeclaredAmbiguous) if known_failure => {
            tracing::warn!(
                key,
                "this send's claim was lost while it ran; recording its failure as a correction"
            );
            let item = txn.item_mut(key)?;
            item.updated_at = now;
            item.error_code = Some(sanitize(error.code(), limits::TRANSPORT_REF));
            item.failure_class = Some(error.class());
            item.maybe_sent_at = None;
            let note = format!("{CORRECTION_NOTE} ({this_send})");
            let audit_id = record(txn, key, AuditOutcome::Failed, Some(&note), false)?;
            receipt(txn, key, Outcome::Failed, Some(audit_id))
        }
        (Ok(Ok(reference)), Moved::Elsewhere(what)) => {
            tracing::error!(
                key,
                "this send's claim was lost while it ran and it delivered after the item had \
                 {what}; recording the delivery, leaving the item as it is"
            );
            let reference = reference
                .as_deref()
                .filter(|r| !r.trim().is_empty())
                .map(|r| sanitize(r, limits::TRANSPORT_REF));
            let note = format!("{LATE_DELIVERY_NOTE} after the item had {what} ({this_send})");
            let reported = reference.clone();
            let attempt = claim.attempt;
            let audit_id = record_reporting(
                txn,
                key,
                AuditOutcome::LateDelivery,
                Some(&note),
                false,
                move |item| {
                    item.attempts = attempt;
                    item.transport_ref = reported;
                    item.error_code = None;
                    item.failure_class = None;
                },
            )?;
            let mut delivered = receipt(txn, key, Outcome::Sent, Some(audit_id))?;
            delivered.transport_ref = reference;
            delivered.error_code = None;
            delivered.next_attempt_at = None;
            Ok(delivered)
        }
        (_, moved) => {
            let what = match moved {
                Moved::DeclaredAmbiguous => "stayed failed as ambiguous".to_owned(),
                Moved::Requeued => "been queued again".to_owned(),
                Moved::Elsewhere(what) => what,
            };
            tracing::warn!(
                key,
                "this send's claim was lost while it ran; it did not deliver (or its outcome \
                 is unknown) and the item had {what}: leaving it as it is"
            );
            let item = txn.existing(key)?;
            let outcome = match (item.state, item.claim.is_some()) {
                (ItemState::Queued, true) => Outcome::InFlight,
                (ItemState::Queued, false) => Outcome::Deferred,
                (state, _) => terminal_outcome(state),
            };
            Ok(DeliveryReceipt::for_item(item, outcome, None))
        }
    }
}

/// [`finish`] for a send that reported an error.
fn finish_failed<T: Txn + ?Sized>(
    actor: &Actor<'_>,
    txn: &mut T,
    key: &str,
    error: &SendError,
    attempts: u32,
    created_at: DateTime<Utc>,
) -> Result<(DeliveryReceipt, Option<Duration>)> {
    let now = txn.now();
    let code = sanitize(error.code(), limits::TRANSPORT_REF);
    let (give_up_after, max_attempts, backoff) = {
        let settings = txn.settings();
        (
            settings.give_up_after,
            settings.max_attempts,
            settings.backoff.delay(attempts, key),
        )
    };
    // A `retry_after` is the platform pacing us (HTTP 429), not a failed
    // attempt: it does not count against `max_attempts`.
    let hint = error.retry_after_hint();
    let paced = hint.is_some();
    let retryable = error.class() == FailureClass::Retryable;
    let wait = hint.map_or(backoff, |hint| hint.max(backoff));
    let past_deadline = later(now, wait) > later(created_at, give_up_after);
    if retryable && past_deadline {
        Ok((
            done(fail(txn, key, GAVE_UP, FailureClass::Retryable)?),
            None,
        ))
    } else if retryable && (paced || attempts < max_attempts) {
        // Not before the learned pace allows either, so the items held back
        // for the destination do not overtake this one.
        let pace_free = match hint {
            Some(hint) => {
                let item = txn.existing(key)?;
                let started = item.claim.as_ref().and_then(|c| c.at).unwrap_or(now);
                let destination = item.destination.clone();
                learn_pace(actor, txn, &destination, started, hint)?
            }
            None => None,
        };
        let item = txn.item_mut(key)?;
        if paced {
            item.attempts = item.attempts.saturating_sub(1);
        }
        item.claim = None;
        item.error_code = Some(code);
        item.failure_class = Some(FailureClass::Retryable);
        item.next_attempt_at = Some(later(now, wait).max(pace_free.unwrap_or(now)));
        // The platform's wait covers the whole destination, not just this item.
        item.cooldown_until = hint.map(|hint| later(now, hint));
        let audit_id = record(txn, key, AuditOutcome::Retrying, None, false)?;
        Ok((
            receipt(txn, key, Outcome::Deferred, Some(audit_id))?,
            Some(wait),
        ))
    } else if error.class() == FailureClass::Ambiguous
        && may_resend(actor, txn.existing(key)?, max_attempts, now)
    {
        let wait = txn.settings().backoff.delay(attempts, key);
        let audit_id = resend_later(txn, key, &code, later(now, wait))?;
        Ok((
            receipt(txn, key, Outcome::Deferred, Some(audit_id))?,
            Some(wait),
        ))
    } else if error.class() == FailureClass::Ambiguous {
        Ok((done(fail_ambiguous(txn, key, &code)?), None))
    } else {
        Ok((done(fail(txn, key, &code, error.class())?), None))
    }
}

/// Gives up on a send of `actor`'s under `claim` whose outcome will never be
/// known (its future was dropped mid-flight): the item fails with `code`, as
/// ambiguous, or, for an idempotent transport, goes back to the queue for a
/// resend. Does nothing if the item no longer holds that claim (lost, and
/// perhaps claimed again since: a newer send is not this one's to abandon).
///
/// # Errors
/// The engine's errors.
pub(crate) fn abandon<T: Txn + ?Sized>(
    actor: &Actor<'_>,
    txn: &mut T,
    claim: &ClaimId,
    code: &str,
) -> Result<()> {
    let now = txn.now();
    let key = claim.key();
    let max_attempts = txn.settings().max_attempts;
    let Some(item) = txn
        .item(key)?
        .filter(|i| claim.owner.as_deref() == Some(actor.owner) && i.holds(claim))
    else {
        return Ok(());
    };
    if may_resend(actor, item, max_attempts, now) {
        resend_later(txn, key, code, now)?;
    } else {
        fail_ambiguous(txn, key, code)?;
    }
    Ok(())
}

/// Gives back `claim`, one of `actor`'s whose item was never handed to
/// `send`: the item is restored exactly as it was `before` the claim. Does
/// nothing if the item no longer holds that claim (restoring `before` over a
/// newer claim would undo what happened since).
///
/// # Errors
/// The engine's errors.
pub(crate) fn release<T: Txn + ?Sized>(
    actor: &Actor<'_>,
    txn: &mut T,
    claim: &ClaimId,
    before: &OutboxItem,
) -> Result<()> {
    let ours = txn
        .item(claim.key())?
        .is_some_and(|i| claim.owner.as_deref() == Some(actor.owner) && i.holds(claim));
    if ours {
        txn.insert(before.clone())?;
    }
    Ok(())
}

/// The receipt of a decision that is not a send.
pub(crate) fn done(decision: Decision) -> DeliveryReceipt {
    match decision {
        Decision::Done(receipt) => receipt,
        Decision::Send(..) => unreachable!("only `decide` claims"),
    }
}

/// The receipt for an item as the transaction now sees it.
///
/// # Errors
/// [`Error::NotFound`]; the engine's read errors.
pub(crate) fn receipt<T: Txn + ?Sized>(
    txn: &mut T,
    key: &str,
    outcome: Outcome,
    audit_id: Option<String>,
) -> Result<DeliveryReceipt> {
    Ok(DeliveryReceipt::for_item(
        txn.existing(key)?,
        outcome,
        audit_id,
    ))
}

/// Fails an item terminally with `code`, of failure class `class`, on record.
///
/// # Errors
/// [`Error::NotFound`]; the engine's errors.
pub(crate) fn fail<T: Txn + ?Sized>(
    txn: &mut T,
    key: &str,
    code: &str,
    class: FailureClass,
) -> Result<Decision> {
    mark_failed(txn.item_mut(key)?, code, class);
    let audit_id = record(txn, key, AuditOutcome::Failed, None, false)?;
    Ok(Decision::Done(receipt(
        txn,
        key,
        Outcome::Failed,
        Some(audit_id),
    )?))
}

/// Fails a claimed item whose send may have reached the platform
/// ([`mark_maybe_sent`]), on record.
///
/// # Errors
/// [`Error::NotFound`]; the engine's errors.
pub(crate) fn fail_ambiguous<T: Txn + ?Sized>(
    txn: &mut T,
    key: &str,
    code: &str,
) -> Result<Decision> {
    mark_maybe_sent(txn.item_mut(key)?);
    fail(txn, key, code, FailureClass::Ambiguous)
}

/// The receipt outcome of a terminal item.
pub(crate) fn terminal_outcome(state: ItemState) -> Outcome {
    match state {
        ItemState::Sent => Outcome::Sent,
        ItemState::Failed | ItemState::Queued => Outcome::Failed,
    }
}

/// The audit outcome that reports an item in `state`.
fn audit_outcome_of(state: ItemState) -> AuditOutcome {
    match state {
        ItemState::Sent => AuditOutcome::Sent,
        ItemState::Failed => AuditOutcome::Failed,
        ItemState::Queued => AuditOutcome::Queued,
    }
}

/// The note on a correction's audit record.
pub(crate) const CORRECTION_NOTE: &str = "correction: this attempt's claim was declared \
     ambiguous after its owner's session ended; the send itself finished";

/// The note on the correction of an item requeued (or put back for a resend)
/// while a send it had lost the claim of was still running, and delivered.
pub(crate) const REQUEUED_NOTE: &str = "correction: this attempt's claim was declared \
     ambiguous after its owner's session ended; the send itself finished and delivered \
     after the item was queued again (requeued), so it is sent and not sent again";

/// The start of a [`LateDelivery`](AuditOutcome::LateDelivery) record's note;
/// what the item had become follows.
pub(crate) const LATE_DELIVERY_NOTE: &str = "late delivery: this attempt's claim was \
     declared ambiguous after its owner's session ended; its send delivered";
