//! Compaction orchestration: folding the journal into a fresh snapshot, moving
//! old terminal items to a history segment, pruning history the retention
//! policy no longer keeps (each prune on record first).

use std::collections::HashSet;

use chrono::{DateTime, Utc};

use crate::audit::{AuditRecord, AuditTail};
use crate::clock::format_timestamp;
use crate::error::Error;
use crate::failpoint::Failpoints;
use crate::history::{History, Retention};
use crate::item::OutboxItem;
use crate::rules::record::system_event;
use crate::settings::Settings;
use crate::store::{CommitFailure, Loaded, Store, rate_times};

/// Folds the journal into a fresh snapshot once every audit record is durable in the log.
///
/// Terminal items last changed before `cutoff` (and no longer counting against
/// any cap) are first written to a new history segment, durably, and left out
/// of the new snapshot.
pub(super) fn compact_locked(
    store: &Store,
    audit: &mut AuditTail,
    loaded: &mut Loaded,
    history: &mut History,
    keep: &Housekeeping,
    faults: &Failpoints,
) -> std::result::Result<(), (CommitFailure, Error)> {
    let cutoff = keep.cutoff;
    // A cooldown whose moment has passed holds nothing back: not worth keeping.
    loaded.state.cooldowns.retain(|_, until| *until > keep.now);
    audit
        .sync(faults)
        .map_err(|e| (CommitFailure::Uncertain, e))?;
    // Seal a large audit log before the snapshot records where it resumes.
    audit
        .rotate_if_over(keep.audit_rotate_bytes)
        .map_err(|e| (CommitFailure::Uncertain, e))?;
    let evictable: Vec<&OutboxItem> = loaded
        .state
        .items
        .values()
        .filter(|item| {
            item.state.is_terminal()
                && item.claim.is_none()
                // Only items whose outcome is on record: a seed item without its
                // terminal record stays live until `process` repairs it.
                && item.last_audit_id.is_some()
                && item.updated_at <= cutoff
                // Nothing that still counts against a cap leaves the live state.
                && rate_times(item).all(|at| at <= cutoff)
        })
        .collect();
    let evicted: HashSet<String> = evictable
        .iter()
        .map(|i| i.idempotency_key.clone())
        .collect();
    if !evictable.is_empty() {
        history.append_segment(&evictable, faults)?;
    }
    store.compact(
        loaded,
        audit.head().clone(),
        audit.verified_len(),
        audit.hasher(),
        &evicted,
        faults,
    )?;
    prune_history(store, audit, loaded, history, keep, faults)
}

/// What a compaction moves to history and what it prunes from it.
pub(super) struct Housekeeping {
    /// Terminal items last changed before this move to history.
    cutoff: DateTime<Utc>,
    retention: Retention,
    now: DateTime<Utc>,
    /// Seal the active audit file once it is this large.
    audit_rotate_bytes: u64,
}

impl Housekeeping {
    pub(super) fn new(now: DateTime<Utc>, settings: &Settings, audit_rotate_bytes: u64) -> Self {
        Self {
            cutoff: settings.history_cutoff(now),
            retention: settings.retention,
            now,
            audit_rotate_bytes,
        }
    }
}

/// Removes the history segments the retention policy no longer keeps, each
/// after a durable `pruned` audit record naming it (journal entry, then log).
fn prune_history(
    store: &Store,
    audit: &mut AuditTail,
    loaded: &mut Loaded,
    history: &mut History,
    keep: &Housekeeping,
    faults: &Failpoints,
) -> std::result::Result<(), (CommitFailure, Error)> {
    for segment in history.prunable(keep.retention, keep.now) {
        let head = audit.head().clone();
        let note = format!(
            "retention pruned history segment {} ({} items, newest changed {})",
            segment.number,
            segment.items,
            format_timestamp(segment.newest)
        );
        let subject = format!("history-segment-{}", segment.number);
        let event = system_event(&head, &subject, note, keep.now);
        let record = AuditRecord::seal(&event, head.seq + 1, &head.hash, false, audit.hasher());
        store.commit(loaded, Vec::new(), std::slice::from_ref(&record), faults)?;
        audit
            .append_records(std::slice::from_ref(&record), faults)
            .map_err(|e| (CommitFailure::Uncertain, e))?;
        faults.check("history.prune").map_err(|e| {
            (
                CommitFailure::Uncertain,
                Error::io(audit.path(), "prune", e),
            )
        })?;
        history
            .remove_segment(segment.number)
            .map_err(|e| (CommitFailure::Uncertain, e))?;
    }
    Ok(())
}
