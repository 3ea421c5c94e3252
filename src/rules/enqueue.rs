//! Enqueueing: a new item under its idempotency key, or the existing twin.

use crate::audit::AuditOutcome;
use crate::error::{Error, Result};
use crate::item::{ItemState, OutboxItem};
use crate::message::{DEFAULT_DIRECTION, DEFAULT_LANE, NewMessage};
use crate::rules::record::record;
use crate::rules::txn::Txn;

/// Adds one validated message (whose content hashes to `hash`) to the
/// transaction, with its `queued` audit record, or returns its existing twin
/// (live or in history: a key stays taken) and writes nothing. Borrows the
/// message: a transaction that is run again reads it again.
///
/// # Errors
/// [`Error::IdempotencyConflict`] when the key names a different message; the
/// engine's errors.
pub(crate) fn insert_message<T: Txn + ?Sized>(
    txn: &mut T,
    message: &NewMessage,
    hash: &str,
) -> Result<OutboxItem> {
    if let Some(existing) = txn.item(&message.idempotency_key)? {
        return same_message(existing, message, hash).map(|()| existing.clone());
    }
    // A key whose item moved to history is still taken: same answer.
    if let Some(old) = txn.archived(&message.idempotency_key)? {
        return same_message(&old, message, hash).map(|()| old);
    }
    let now = txn.now();
    let key = message.idempotency_key.clone();
    let seq = txn.next_seq(&message.destination)?;
    txn.insert(OutboxItem {
        idempotency_key: key.clone(),
        connector: message.connector.clone(),
        grant_id: message.grant_id.clone(),
        destination: message.destination.clone(),
        content: message.content.clone(),
        content_hash: hash.to_owned(),
        state: ItemState::Queued,
        attempts: 0,
        claim: None,
        created_at: now,
        updated_at: now,
        next_attempt_at: None,
        sent_at: None,
        error_code: None,
        lane: message
            .lane
            .clone()
            .unwrap_or_else(|| DEFAULT_LANE.to_owned()),
        direction: message
            .direction
            .clone()
            .unwrap_or_else(|| DEFAULT_DIRECTION.to_owned()),
        risk_class: message.risk_class.clone(),
        transport_ref: None,
        last_audit_id: None,
        cooldown_until: None,
        maybe_sent_at: None,
        failure_class: None,
        seq: Some(seq),
    })?;
    record(txn, &key, AuditOutcome::Queued, None, false)?;
    txn.item(&key)?.cloned().ok_or(Error::NotFound { key })
}

/// Checks that an existing item is the same message as `message`.
fn same_message(existing: &OutboxItem, message: &NewMessage, hash: &str) -> Result<()> {
    let differs = if existing.connector != message.connector {
        Some("connector")
    } else if existing.grant_id != message.grant_id {
        Some("grant_id")
    } else if existing.destination != message.destination {
        Some("destination")
    } else if existing.content_hash != hash {
        Some("content")
    } else {
        None
    };
    match differs {
        None => Ok(()),
        Some(field) => Err(Error::IdempotencyConflict {
            key: message.idempotency_key.clone(),
            field,
        }),
    }
}
