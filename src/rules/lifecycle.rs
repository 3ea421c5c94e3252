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
//! finishes, [`finish`] finds the claim gone and records what really happened
//! as an audited correction ([`CORRECTION_NOTE`]):
//!
//! * still failed as ambiguous and unclaimed: a delivered send makes the item
//!   `sent` (with its transport ref, so replies correlate); a send that
//!   certainly did not deliver keeps the item failed with the real error code
//!   and no longer counts it as a possible send;
//! * anything else (an operator requeued or cancelled it meanwhile, or the
//!   send is ambiguous again): the item is left alone (logged).
//!
//! Nothing is ever resent by a correction.

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::audit::AuditOutcome;
use crate::clock::later;
use crate::error::{Error, Result};
use crate::item::{Claim, ItemState, OutboxItem};
use crate::message::limits;
use crate::order;
use crate::receipt::{DeliveryReceipt, Outcome};
use crate::rules::Actor;
use crate::rules::codes::{
    AMBIGUOUS_AFTER_RESTART, ATTEMPTS_EXHAUSTED, GAVE_UP, SEND_PANICKED, sanitize,
};
use crate::rules::rate::{learn_pace, rate_capped};
use crate::rules::record::record;
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
    if let Some(claim) = item.claim.clone() {
        if claim_is_live(actor, txn, key, &claim)? {
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
    let claimed = claim(&before, actor.owner, now);
    txn.insert(claimed.clone())?;
    // Marked before the transaction ends, so no thread of ours mistakes the
    // claim for an orphan.
    actor.in_flight().insert(key.to_owned());
    Ok(Decision::Send(Box::new(claimed), before))
}

/// Records what `send` did with the item `actor` claimed, in an
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
/// - a panic: failed as ambiguous with [`SEND_PANICKED`].
///
/// # Errors
/// [`Error::NotFound`] if the item vanished; the engine's errors.
pub(crate) fn finish<T: Txn + ?Sized>(
    actor: &Actor<'_>,
    txn: &mut T,
    key: &str,
    result: &SendResult,
) -> Result<(DeliveryReceipt, Option<Duration>)> {
    let span = tracing::info_span!(
        "outbox.finish",
        key,
        destination = tracing::field::Empty,
        attempt = tracing::field::Empty,
        outcome = tracing::field::Empty,
        error_code = tracing::field::Empty,
    );
    let _entered = span.enter();
    let (receipt, wait) = finish_inner(actor, txn, key, result)?;
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
    key: &str,
    result: &SendResult,
) -> Result<(DeliveryReceipt, Option<Duration>)> {
    let now = txn.now();
    if txn.existing(key)?.claim_owner() != Some(actor.owner)
        && let Some(corrected) = correct_lost_claim(txn, key, result)?
    {
        return Ok((corrected, None));
    }
    let item = txn.existing(key)?;
    if item.claim_owner() != Some(actor.owner) {
        // File engine: only possible if the state files were replaced behind
        // our back. PostgreSQL: the claim was lost and the item moved on.
        tracing::error!(
            key,
            "our claim vanished while sending; leaving the item as it is"
        );
        return Ok((
            DeliveryReceipt::for_item(item, Outcome::InFlight, None),
            None,
        ));
    }
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

/// [`finish`] for a send whose claim another handle declared ambiguous while
/// it ran (its owner's session ended under it: a network cut, a server
/// restart; see the module docs). If the item is still failed as
/// [`AMBIGUOUS_AFTER_RESTART`] and unclaimed, what really happened is
/// recorded as a correction (a note saying so on the audit record): a
/// delivery makes it `sent` with its transport ref; a failure that certainly
/// did not deliver keeps it failed with the real error and no longer counts
/// it as a possible send. Nothing is resent. `None`: left alone (the item
/// moved on, or the send is ambiguous again or panicked).
fn correct_lost_claim<T: Txn + ?Sized>(
    txn: &mut T,
    key: &str,
    result: &SendResult,
) -> Result<Option<DeliveryReceipt>> {
    let now = txn.now();
    let item = txn.existing(key)?;
    let declared_ambiguous = item.state == ItemState::Failed
        && item.error_code.as_deref() == Some(AMBIGUOUS_AFTER_RESTART)
        && item.claim.is_none();
    let known = match result {
        Ok(Ok(_)) => true,
        Ok(Err(error)) => error.class() != FailureClass::Ambiguous,
        Err(_panic) => false,
    };
    if !declared_ambiguous || !known {
        return Ok(None);
    }
    tracing::warn!(
        key,
        "this send's claim was declared ambiguous while it ran; recording its real outcome"
    );
    let item = txn.item_mut(key)?;
    item.updated_at = now;
    let (outcome, receipt_outcome) = match result {
        Ok(Ok(reference)) => {
            mark_sent(item, now, reference.as_deref());
            (AuditOutcome::Sent, Outcome::Sent)
        }
        Ok(Err(error)) => {
            item.error_code = Some(sanitize(error.code(), limits::TRANSPORT_REF));
            item.failure_class = Some(error.class());
            item.maybe_sent_at = None;
            (AuditOutcome::Failed, Outcome::Failed)
        }
        Err(_) => return Ok(None),
    };
    let audit_id = record(txn, key, outcome, Some(CORRECTION_NOTE), false)?;
    Ok(Some(receipt(txn, key, receipt_outcome, Some(audit_id))?))
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

/// Gives up on a claimed send of `actor`'s whose outcome will never be known
/// (its future was dropped mid-flight): the item fails with `code`, as
/// ambiguous, or, for an idempotent transport, goes back to the queue for a
/// resend. Does nothing if the claim is no longer `actor`'s.
///
/// # Errors
/// The engine's errors.
pub(crate) fn abandon<T: Txn + ?Sized>(
    actor: &Actor<'_>,
    txn: &mut T,
    key: &str,
    code: &str,
) -> Result<()> {
    let now = txn.now();
    let max_attempts = txn.settings().max_attempts;
    let Some(item) = txn
        .item(key)?
        .filter(|i| i.state == ItemState::Queued && i.claim_owner() == Some(actor.owner))
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

/// Gives back a claim of `actor`'s whose item was never handed to `send`: the
/// item is restored exactly as it was `before` the claim. Does nothing if the
/// claim is no longer `actor`'s.
///
/// # Errors
/// The engine's errors.
pub(crate) fn release<T: Txn + ?Sized>(
    actor: &Actor<'_>,
    txn: &mut T,
    key: &str,
    before: &OutboxItem,
) -> Result<()> {
    let ours = txn
        .item(key)?
        .is_some_and(|i| i.state == ItemState::Queued && i.claim_owner() == Some(actor.owner));
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
