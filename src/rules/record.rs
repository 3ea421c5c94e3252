//! Audit records: how a rule puts an item's new state on record, and the
//! records about the outbox itself (a prune, stored settings).
//!
//! An item's record is sealed inside the rule's transaction; its audit id is
//! minted by the engine ([`Txn::audit_id`]): from the chain's head on the file
//! engine, from the handle's owner id and a counter on PostgreSQL, which
//! gives records their place in the chain only after the commit.

use std::borrow::Cow;

use chrono::{DateTime, Utc};
use sha2::{Digest, Sha256};

use crate::audit::{AuditEvent, AuditOutcome, Head};
use crate::clock::format_timestamp;
use crate::error::Result;
use crate::item::OutboxItem;
use crate::rules::txn::Txn;

/// Seals an audit record for the item's current state into the transaction and
/// stamps its id on the item (and moves its `updated_at` up to now). Returns
/// the id. `note` is free text for the record; `reconciled` marks a late repair.
///
/// The id is unique within the chain and across chains (see
/// [`Txn::audit_id`]).
///
/// # Errors
/// [`Error::NotFound`](crate::Error::NotFound) if the item is not live; the
/// engine's errors.
pub(crate) fn record<T: Txn + ?Sized>(
    txn: &mut T,
    key: &str,
    outcome: AuditOutcome,
    note: Option<&str>,
    reconciled: bool,
) -> Result<String> {
    seal_item_record(
        txn,
        key,
        outcome,
        note,
        reconciled,
        None::<fn(&mut OutboxItem)>,
    )
}

/// [`record`] for an event that reports something other than the item's own
/// fields: `report` adjusts a copy of the item before the event is built from
/// it (a late delivery's transport ref and attempt, which the item does not
/// take). The item itself only gets the audit id (and `updated_at`), so its
/// latest record stays the one it names.
///
/// # Errors
/// As [`record`].
pub(crate) fn record_reporting<T: Txn + ?Sized>(
    txn: &mut T,
    key: &str,
    outcome: AuditOutcome,
    note: Option<&str>,
    reconciled: bool,
    report: impl FnOnce(&mut OutboxItem),
) -> Result<String> {
    seal_item_record(txn, key, outcome, note, reconciled, Some(report))
}

/// The one way an item's record is sealed: mint its id, stamp it on the item,
/// build the event from the item (or, with `report`, from an adjusted copy,
/// so the common path copies nothing) and seal it.
fn seal_item_record<T: Txn + ?Sized>(
    txn: &mut T,
    key: &str,
    outcome: AuditOutcome,
    note: Option<&str>,
    reconciled: bool,
    report: Option<impl FnOnce(&mut OutboxItem)>,
) -> Result<String> {
    let now = txn.now();
    let audit_id = txn.audit_id(key, now)?;
    let item = txn.item_mut(key)?;
    item.last_audit_id = Some(audit_id.clone());
    item.updated_at = item.updated_at.max(now);
    let reported = match report {
        Some(report) => {
            let mut copy = item.clone();
            report(&mut copy);
            Cow::Owned(copy)
        }
        None => Cow::Borrowed(&*item),
    };
    let event = AuditEvent::for_item(
        &reported,
        outcome,
        audit_id.clone(),
        note,
        reconciled,
        format_timestamp(now),
    );
    txn.seal(&event)?;
    Ok(audit_id)
}

/// The audit id of the record sealed after `head` for the item `key` at `now`
/// (the file engine's [`Txn::audit_id`]).
pub(crate) fn item_audit_id(head: &Head, key: &str, now: DateTime<Utc>) -> String {
    hex::encode(
        &Sha256::new()
            .chain_update(head.hash.as_bytes())
            .chain_update((head.seq + 1).to_le_bytes())
            .chain_update(key.as_bytes())
            .chain_update(format_timestamp(now).as_bytes())
            .finalize()[..16],
    )
}

/// An audit event about the outbox itself rather than one message (a prune):
/// `subject` stands where an item's key would, item fields are `-`.
pub(crate) fn system_event(
    head: &Head,
    subject: &str,
    note: String,
    now: DateTime<Utc>,
) -> AuditEvent {
    system_event_of(AuditOutcome::Pruned, head, subject, note, now)
}

/// An audit event about the outbox itself with this outcome.
pub(crate) fn system_event_of(
    outcome: AuditOutcome,
    head: &Head,
    subject: &str,
    note: String,
    now: DateTime<Utc>,
) -> AuditEvent {
    AuditEvent {
        attempts: 0,
        audit_id: hex::encode(&Sha256::digest(format!("{}{subject}", head.hash).as_bytes())[..16]),
        connector: "-".into(),
        content_hash: "-".into(),
        destination: "-".into(),
        direction: "-".into(),
        error_code: None,
        failure_class: None,
        grant_id: "-".into(),
        idempotency_key: subject.to_owned(),
        lane: "-".into(),
        outcome,
        note: Some(note),
        reconciled: false,
        recorded_at_utc: format_timestamp(now),
        risk_class: None,
        transport_ref: None,
    }
}
