//! Claims whose worker is gone: a send that may or may not have left. Never
//! resent, except under an idempotent transport, where the resend carries the
//! same transaction id and the platform deduplicates it.

use chrono::{DateTime, Utc};

use crate::audit::AuditOutcome;
use crate::error::Result;
use crate::item::{ClaimId, OutboxItem};
use crate::rules::Actor;
use crate::rules::codes::AMBIGUOUS_AFTER_RESTART;
use crate::rules::lifecycle::{Decision, fail_ambiguous, mark_maybe_sent};
use crate::rules::record::record;
use crate::rules::txn::Txn;
use crate::send::FailureClass;

/// Whether a claim belongs to a worker that is still alive: ours while a
/// send of ours holds that very claim (in `actor`'s in-flight set; a lost
/// claim of ours that a newer one replaced is not it), another handle's while
/// its liveness token is held. A claim naming no owner (the reference
/// design's) survived a crash.
///
/// # Errors
/// The engine's errors.
pub(crate) fn claim_is_live<T: Txn + ?Sized>(
    actor: &Actor<'_>,
    txn: &mut T,
    claim: &ClaimId,
) -> Result<bool> {
    match claim.owner.as_deref() {
        None => Ok(false),
        Some(owner) if owner == actor.owner => {
            Ok(actor.in_flight().contains(claim.key(), claim.stamp()))
        }
        Some(owner) => txn.owner_is_alive(owner),
    }
}

/// A claim whose worker is gone: fails the item as ambiguous, or, under an
/// idempotent transport, puts it back for a resend under its transaction id
/// (`None`: the caller goes on deciding the now unclaimed item).
///
/// # Errors
/// The engine's errors.
pub(crate) fn settle_dead_claim<T: Txn + ?Sized>(
    actor: &Actor<'_>,
    txn: &mut T,
    key: &str,
) -> Result<Option<Decision>> {
    let now = txn.now();
    let max_attempts = txn.settings().max_attempts;
    if !may_resend(actor, txn.existing(key)?, max_attempts, now) {
        tracing::warn!(
            key,
            "found a claim whose worker is gone; failing it as ambiguous"
        );
        return fail_ambiguous(txn, key, AMBIGUOUS_AFTER_RESTART).map(Some);
    }
    tracing::warn!(
        key,
        "found a claim whose worker is gone; resending it under its transaction id"
    );
    resend_later(txn, key, AMBIGUOUS_AFTER_RESTART, now)?;
    Ok(None)
}

/// Whether an item whose send may have left can be sent again under its
/// transaction id: its connector is declared idempotent, it was enqueued
/// within the platform's dedup window (every earlier attempt came later),
/// and attempts are left.
pub(crate) fn may_resend(
    actor: &Actor<'_>,
    item: &OutboxItem,
    max_attempts: u32,
    now: DateTime<Utc>,
) -> bool {
    actor.idempotent.get(&item.connector).is_some_and(|window| {
        now.signed_duration_since(item.created_at)
            .to_std()
            .is_ok_and(|age| age < *window)
    }) && item.attempts < max_attempts
}

/// Puts an item whose send may have left back in the queue, unclaimed, for a
/// resend under the same transaction id at `at` (only for connectors declared
/// with `idempotent_transport`). The audit record says why.
///
/// # Errors
/// The engine's errors.
pub(crate) fn resend_later<T: Txn + ?Sized>(
    txn: &mut T,
    key: &str,
    code: &str,
    at: DateTime<Utc>,
) -> Result<String> {
    let item = txn.item_mut(key)?;
    // The send may have reached the platform: it counts against the rate caps.
    mark_maybe_sent(item);
    item.claim = None;
    item.error_code = Some(code.to_owned());
    item.failure_class = Some(FailureClass::Ambiguous);
    item.next_attempt_at = Some(at);
    let note = format!("idempotent transport: {code}; resending with the same transaction id");
    record(txn, key, AuditOutcome::Retrying, Some(&note), false)
}
