//! Claim, orphan repair, and finishing a send — including a send whose claim
//! was lost while it ran.
//!
//! With session locks as liveness, a network cut or a server restart makes a
//! live send look dead: another handle fails its claim as
//! [`AMBIGUOUS_AFTER_RESTART`] (never resending it). When the send then
//! finishes, its commit finds the item changed ([`CommitError::Conflict`]);
//! [`finish`] reads the item again and records what really happened as an
//! audited correction:
//!
//! * still failed as ambiguous at the same attempt: a delivered send makes the
//!   item `sent` (with its transport ref, so replies correlate); a send that
//!   certainly did not deliver keeps the item failed with the real error code
//!   and no longer counts it as a possible send;
//! * anything else (an operator requeued or cancelled it meanwhile): the item
//!   is left alone, and a delivered send is still put on record.
//!
//! Nothing is ever resent by a correction.

use chrono::{DateTime, Utc};
use sha2::{Digest, Sha256};

use crate::audit::{AuditEvent, AuditOutcome};
use crate::clock::format_timestamp;
use crate::engine::{ChangeSet, CommitError, Engine, Expect, Put, RateView, Versioned};
use crate::error::{Error, Result};
use crate::item::{Claim, ItemState, OutboxItem};
use crate::message::limits;
use crate::outbox::{
    AMBIGUOUS_AFTER_RESTART, DESTINATION_COOLDOWN, GLOBAL_RATE_CAPPED, RATE_CAPPED, sanitize,
};
use crate::rate::RatePolicy;
use crate::send::{FailureClass, SendError};

/// The note on a correction's audit record.
pub(crate) const CORRECTION_NOTE: &str = "correction: this attempt's claim was declared \
     ambiguous after its owner's session ended; the send itself finished";

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

/// When a send to `item`'s destination at `now` would break a cap (the
/// destination's, the global one, a platform's cooldown): the moment all allow
/// it, and which one binds last. The same rule as the file engine's.
pub(crate) fn capped(
    policy: &RatePolicy,
    item: &OutboxItem,
    view: &RateView,
    now: DateTime<Utc>,
) -> Option<(DateTime<Utc>, &'static str)> {
    let cap = policy.for_destination(&item.destination);
    let per_destination = cap
        .next_free_slot(now, view.destination_times.iter().copied())
        .map(|at| (at, RATE_CAPPED));
    let global = policy.global.and_then(|cap| {
        cap.next_free_slot(now, view.all_times.iter().copied())
            .map(|at| (at, GLOBAL_RATE_CAPPED))
    });
    let cooled = view
        .cooldown_until
        .filter(|until| *until > now)
        .map(|until| (until, DESTINATION_COOLDOWN));
    [per_destination, global, cooled]
        .into_iter()
        .flatten()
        .max_by_key(|(at, _)| *at)
}

/// Claims up to `limit` due items for this handle, oldest first, one per
/// destination at a time, skipping those a cap holds back (they stay queued
/// and are tried again later). Caps hold across every handle of the outbox.
///
/// # Errors
/// The engine's errors.
pub(crate) fn claim_due(
    engine: &dyn Engine,
    policy: &RatePolicy,
    now: DateTime<Utc>,
    limit: usize,
) -> Result<Vec<Versioned>> {
    let owner = engine.owner().to_owned();
    engine.claim_batch(now, limit, policy.longest_window(), &mut |item, view| {
        if capped(policy, item, view, now).is_some() {
            return None;
        }
        Some(claim(item, &owner, now))
    })
}

/// A claimed item failed as ambiguous: its claim time stays on as
/// `maybe_sent_at`, counted against the destination's caps.
pub(crate) fn fail_ambiguous(item: &OutboxItem, code: &str, now: DateTime<Utc>) -> OutboxItem {
    let mut failed = item.clone();
    failed.maybe_sent_at = Some(
        item.claim
            .as_ref()
            .and_then(|c| c.at)
            .unwrap_or(item.updated_at),
    );
    failed.state = ItemState::Failed;
    failed.claim = None;
    failed.next_attempt_at = None;
    failed.error_code = Some(code.to_owned());
    failed.failure_class = Some(FailureClass::Ambiguous);
    failed.updated_at = now;
    failed
}

/// The audit event reporting `item` as it now is. The id does not depend on
/// the chain's head (which only the engine knows when it seals): it hashes
/// the owner, the key, the attempt, the outcome and the moment.
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
fn commit_one(
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

/// Fails every orphaned claim (its owner is dead) as ambiguous, each with its
/// audit record. A claim another handle repaired first is skipped. Returns
/// the keys this call failed.
///
/// # Errors
/// The engine's errors.
pub(crate) fn repair_orphans(engine: &dyn Engine, now: DateTime<Utc>) -> Result<Vec<String>> {
    let mut repaired = Vec::new();
    for orphan in engine.orphaned_claims()? {
        let failed = fail_ambiguous(&orphan.item, AMBIGUOUS_AFTER_RESTART, now);
        match commit_one(
            engine,
            failed,
            orphan.revision,
            AuditOutcome::Failed,
            None,
            now,
        ) {
            Ok(_) => repaired.push(orphan.item.idempotency_key),
            Err(CommitError::Conflict { .. }) => {}
            Err(CommitError::Failed(e)) => return Err(e),
        }
    }
    Ok(repaired)
}

/// What [`finish`] did.
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

/// Records a send's result on the item `claimed` (as this handle claimed it).
/// A retryable failure is retried at `retry_at` (the caller's backoff and
/// caps decide it; `None`: no attempts left, the item fails). Handles a lost
/// claim as described in the module docs.
///
/// # Errors
/// The engine's errors; [`Error::NotFound`] if the item vanished.
pub(crate) fn finish(
    engine: &dyn Engine,
    claimed: &Versioned,
    result: &Result<Option<String>, SendError>,
    retry_at: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
) -> Result<Finished> {
    let transport_ref = |r: &Option<String>| {
        r.as_deref()
            .filter(|r| !r.trim().is_empty())
            .map(|r| sanitize(r, limits::TRANSPORT_REF))
    };
    let mut item = claimed.item.clone();
    item.claim = None;
    item.updated_at = now;
    let outcome = match result {
        Ok(reference) => {
            item.state = ItemState::Sent;
            item.sent_at = Some(now);
            item.error_code = None;
            item.failure_class = None;
            item.transport_ref = transport_ref(reference);
            AuditOutcome::Sent
        }
        Err(error) => {
            let code = sanitize(error.code(), limits::TRANSPORT_REF);
            match (error.class(), retry_at) {
                (FailureClass::Ambiguous, _) => {
                    item = fail_ambiguous(&claimed.item, &code, now);
                    AuditOutcome::Failed
                }
                (FailureClass::Retryable, Some(at)) => {
                    item.error_code = Some(code);
                    item.failure_class = Some(FailureClass::Retryable);
                    item.next_attempt_at = Some(at);
                    // The platform's wait covers the whole destination.
                    item.cooldown_until = error
                        .retry_after_hint()
                        .map(|hint| crate::clock::later(now, hint));
                    AuditOutcome::Retrying
                }
                (class, _) => {
                    item.state = ItemState::Failed;
                    item.error_code = Some(code);
                    item.failure_class = Some(class);
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
        let outcome = if result.is_ok() {
            AuditOutcome::Sent
        } else {
            AuditOutcome::Failed
        };
        match result {
            Ok(reference) => {
                corrected.state = ItemState::Sent;
                corrected.sent_at = Some(now);
                corrected.error_code = None;
                corrected.failure_class = None;
                corrected.transport_ref = transport_ref(reference);
            }
            Err(error) => {
                // Certainly not delivered: no longer a possible send.
                corrected.error_code = Some(sanitize(error.code(), limits::TRANSPORT_REF));
                corrected.failure_class = Some(error.class());
                corrected.maybe_sent_at = None;
            }
        }
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
