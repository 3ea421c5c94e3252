//! What may happen to an item, from the moment it is looked at to the moment
//! its send's outcome is recorded: decide (and claim), finish, release,
//! abandon, fail — written once, for every engine.
//!
//! The transaction rules ([`decide`], [`finish`], [`release`], [`abandon`])
//! run inside one [`Txn`]. The first pieces written against
//! [`Engine`](crate::engine::Engine) for the PostgreSQL engine's batch drains
//! ([`claim_due`], [`finish_claimed`]) share their item transitions
//! ([`claim`], [`mark_sent`], [`mark_failed`], [`mark_maybe_sent`]) and their
//! cap rule (`rules::rate::capped`).
//!
//! # A claim lost while its send ran
//!
//! With session locks as liveness, a network cut or a server restart makes a
//! live send look dead: another handle fails its claim as
//! [`AMBIGUOUS_AFTER_RESTART`] (never resending it). When the send then
//! finishes, its commit finds the item changed ([`CommitError::Conflict`]);
//! [`finish_claimed`] reads the item again and records what really happened as
//! an audited correction:
//!
//! * still failed as ambiguous at the same attempt: a delivered send makes the
//!   item `sent` (with its transport ref, so replies correlate); a send that
//!   certainly did not deliver keeps the item failed with the real error code
//!   and no longer counts it as a possible send;
//! * anything else (an operator requeued or cancelled it meanwhile): the item
//!   is left alone, and a delivered send is still put on record.
//!
//! Nothing is ever resent by a correction.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sha2::{Digest, Sha256};

use crate::audit::{AuditEvent, AuditOutcome};
use crate::clock::{format_timestamp, later};
use crate::engine::{ChangeSet, CommitError, Engine, Expect, Put, Versioned};
use crate::error::{Error, Result};
use crate::item::{Claim, ItemState, OutboxItem};
use crate::message::limits;
use crate::order;
use crate::rate::RatePolicy;
use crate::receipt::{DeliveryReceipt, Outcome};
use crate::rules::Actor;
use crate::rules::codes::{
    AMBIGUOUS_AFTER_RESTART, ATTEMPTS_EXHAUSTED, GAVE_UP, SEND_PANICKED, sanitize,
};
use crate::rules::rate::{capped, learn_pace, rate_capped};
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

// ----- the rules written against `engine::Engine` (batch drains) ----------

/// The note on a correction's audit record.
pub(crate) const CORRECTION_NOTE: &str = "correction: this attempt's claim was declared \
     ambiguous after its owner's session ended; the send itself finished";

/// Claims up to `limit` due items for this handle, oldest first, one per
/// destination at a time, skipping those a cap holds back (they stay queued
/// and are tried again later). Caps hold across every handle of the outbox.
///
/// # Errors
/// The engine's errors.
#[allow(
    dead_code,
    reason = "an Engine-based rule: used by the PostgreSQL engine's tests until `Outbox` runs on PostgreSQL"
)]
pub(crate) fn claim_due(
    engine: &dyn Engine,
    policy: &RatePolicy,
    now: DateTime<Utc>,
    limit: usize,
) -> Result<Vec<Versioned>> {
    let owner = engine.owner().to_owned();
    engine.claim_batch(now, limit, policy.longest_window(), &mut |item, view| {
        if capped(policy, &item.destination, view, now).is_some() {
            return None;
        }
        Some(claim(item, &owner, now))
    })
}

/// A claimed item failed as ambiguous at `now`, as a new version (see
/// [`mark_maybe_sent`]).
#[allow(
    dead_code,
    reason = "an Engine-based rule: used by the PostgreSQL engine's tests until `Outbox` runs on PostgreSQL"
)]
pub(crate) fn failed_ambiguous(item: &OutboxItem, code: &str, now: DateTime<Utc>) -> OutboxItem {
    let mut failed = item.clone();
    mark_maybe_sent(&mut failed);
    mark_failed(&mut failed, code, FailureClass::Ambiguous);
    failed.updated_at = now;
    failed
}

/// The audit event reporting `item` as it now is, for an engine that seals
/// events itself. The id does not depend on the chain's head (which only the
/// engine knows when it seals): it hashes the owner, the key, the attempt, the
/// outcome and the moment.
#[allow(
    dead_code,
    reason = "an Engine-based rule: used by the PostgreSQL engine's tests until `Outbox` runs on PostgreSQL"
)]
pub(crate) fn event(
    item: &mut OutboxItem,
    owner: &str,
    outcome: AuditOutcome,
    note: Option<&str>,
    now: DateTime<Utc>,
) -> AuditEvent {
    let recorded_at_utc = format_timestamp(now);
    let audit_id = hex::encode(
        &Sha256::new()
            .chain_update(owner.as_bytes())
            .chain_update([0])
            .chain_update(item.idempotency_key.as_bytes())
            .chain_update(item.attempts.to_le_bytes())
            .chain_update(outcome.as_str().as_bytes())
            .chain_update(recorded_at_utc.as_bytes())
            .finalize()[..16],
    );
    item.last_audit_id = Some(audit_id.clone());
    AuditEvent::for_item(item, outcome, audit_id, note, false, recorded_at_utc)
}

/// Commits one item write with its audit record; returns the item as written.
#[allow(
    dead_code,
    reason = "an Engine-based rule: used by the PostgreSQL engine's tests until `Outbox` runs on PostgreSQL"
)]
pub(crate) fn commit_one(
    engine: &dyn Engine,
    mut item: OutboxItem,
    revision: u64,
    outcome: AuditOutcome,
    note: Option<&str>,
    now: DateTime<Utc>,
) -> Result<OutboxItem, CommitError> {
    let event = event(&mut item, engine.owner(), outcome, note, now);
    engine.commit(ChangeSet {
        puts: vec![Put {
            item: item.clone(),
            expect: Expect::Revision(revision),
        }],
        audit: vec![event],
        wake: false,
    })?;
    Ok(item)
}

/// What [`finish_claimed`] did.
#[allow(
    dead_code,
    reason = "an Engine-based rule: used by the PostgreSQL engine's tests until `Outbox` runs on PostgreSQL"
)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Finished {
    /// The outcome was recorded on the claim as usual.
    Recorded(OutboxItem),
    /// The claim had been declared ambiguous; the item now says what really happened.
    Corrected(OutboxItem),
    /// The item had moved on (an operator acted); it was left alone, and the
    /// outcome, if it was a delivery, was put on record.
    LeftAlone(OutboxItem),
}

/// Records a send's result on the item `claimed` (as this handle claimed it
/// through [`claim_due`]). A retryable failure is retried at `retry_at` (the
/// caller's backoff and caps decide it; `None`: no attempts left, the item
/// fails). Handles a lost claim as described in the module docs.
///
/// # Errors
/// The engine's errors; [`Error::NotFound`] if the item vanished.
#[allow(
    dead_code,
    reason = "an Engine-based rule: used by the PostgreSQL engine's tests until `Outbox` runs on PostgreSQL"
)]
pub(crate) fn finish_claimed(
    engine: &dyn Engine,
    claimed: &Versioned,
    result: &Result<Option<String>, SendError>,
    retry_at: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
) -> Result<Finished> {
    let mut item = claimed.item.clone();
    item.claim = None;
    item.updated_at = now;
    let outcome = match result {
        Ok(reference) => {
            mark_sent(&mut item, now, reference.as_deref());
            AuditOutcome::Sent
        }
        Err(error) => {
            let code = sanitize(error.code(), limits::TRANSPORT_REF);
            match (error.class(), retry_at) {
                (FailureClass::Ambiguous, _) => {
                    item = failed_ambiguous(&claimed.item, &code, now);
                    AuditOutcome::Failed
                }
                (FailureClass::Retryable, Some(at)) => {
                    item.error_code = Some(code);
                    item.failure_class = Some(FailureClass::Retryable);
                    item.next_attempt_at = Some(at);
                    // The platform's wait covers the whole destination.
                    item.cooldown_until = error.retry_after_hint().map(|hint| later(now, hint));
                    AuditOutcome::Retrying
                }
                (class, _) => {
                    mark_failed(&mut item, &code, class);
                    AuditOutcome::Failed
                }
            }
        }
    };
    match commit_one(engine, item, claimed.revision, outcome, None, now) {
        Ok(item) => return Ok(Finished::Recorded(item)),
        Err(CommitError::Failed(e)) => return Err(e),
        Err(CommitError::Conflict { .. }) => {}
    }
    let current = engine
        .get(&claimed.item.idempotency_key)?
        .ok_or_else(|| Error::NotFound {
            key: claimed.item.idempotency_key.clone(),
        })?;
    let declared_ambiguous = current.item.state == ItemState::Failed
        && current.item.error_code.as_deref() == Some(AMBIGUOUS_AFTER_RESTART)
        && current.item.attempts == claimed.item.attempts
        && current.item.claim.is_none();
    tracing::warn!(
        key = %claimed.item.idempotency_key,
        declared_ambiguous,
        "this send's claim was lost while it ran; recording its real outcome"
    );
    let ambiguous_again = matches!(result, Err(e) if e.class() == FailureClass::Ambiguous);
    if declared_ambiguous && !ambiguous_again {
        let mut corrected = current.item.clone();
        corrected.updated_at = now;
        let outcome = match result {
            Ok(reference) => {
                mark_sent(&mut corrected, now, reference.as_deref());
                AuditOutcome::Sent
            }
            Err(error) => {
                // Certainly not delivered: no longer a possible send.
                corrected.error_code = Some(sanitize(error.code(), limits::TRANSPORT_REF));
                corrected.failure_class = Some(error.class());
                corrected.maybe_sent_at = None;
                AuditOutcome::Failed
            }
        };
        return match commit_one(
            engine,
            corrected,
            current.revision,
            outcome,
            Some(CORRECTION_NOTE),
            now,
        ) {
            Ok(corrected) => Ok(Finished::Corrected(corrected)),
            Err(CommitError::Failed(e)) => Err(e),
            // Changed again in between: read once more and leave it alone.
            Err(CommitError::Conflict { .. }) => left_alone(engine, claimed, result, now),
        };
    }
    left_alone(engine, claimed, result, now)
}

/// The item moved on: a delivery is still put on record, the item untouched.
#[allow(
    dead_code,
    reason = "an Engine-based rule: used by the PostgreSQL engine's tests until `Outbox` runs on PostgreSQL"
)]
fn left_alone(
    engine: &dyn Engine,
    claimed: &Versioned,
    result: &Result<Option<String>, SendError>,
    now: DateTime<Utc>,
) -> Result<Finished> {
    loop {
        let current =
            engine
                .get(&claimed.item.idempotency_key)?
                .ok_or_else(|| Error::NotFound {
                    key: claimed.item.idempotency_key.clone(),
                })?;
        if result.is_err() {
            return Ok(Finished::LeftAlone(current.item));
        }
        // Only the audit record changes; the write re-asserts the same item so
        // the record is sealed against the state it describes.
        let mut on_record = claimed.item.clone();
        on_record.transport_ref = result
            .as_ref()
            .ok()
            .and_then(|r| r.as_deref().map(|r| sanitize(r, limits::TRANSPORT_REF)));
        let event = event(
            &mut on_record,
            engine.owner(),
            AuditOutcome::Sent,
            Some(
                "late outcome: this attempt's claim was lost and the item has moved on; the item was left as it is",
            ),
            now,
        );
        match engine.commit(ChangeSet {
            puts: vec![Put {
                item: current.item.clone(),
                expect: Expect::Revision(current.revision),
            }],
            audit: vec![event],
            wake: false,
        }) {
            Ok(_) => return Ok(Finished::LeftAlone(current.item)),
            Err(CommitError::Failed(e)) => return Err(e),
            Err(CommitError::Conflict { .. }) => {}
        }
    }
}
