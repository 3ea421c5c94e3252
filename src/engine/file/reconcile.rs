//! What the file engine does on open and after another process wrote: store
//! the settings a handle opens with (see `settings`), and reconcile the audit
//! log with the state (re-append what a crash left only in the journal).

use std::path::PathBuf;

use crate::audit::{AuditOutcome, AuditRecord, AuditTail, Head};
use crate::builder::OutboxBuilder;
use crate::error::{AuditFault, Error, Result};
use crate::failpoint::Failpoints;
use crate::rules::record::system_event_of;
use crate::settings::{self, Settings};
use crate::store::{Loaded, Store};

/// Applies the settings rules (see `settings`) for a handle opening with
/// `builder`: stores or updates what the caller set explicitly (with a
/// `settings` audit record), and warns about builder values the stored ones
/// override. For a new outbox, returns the initial settings, which go with the
/// handle's first change (opening writes nothing more than it did).
pub(super) fn settle_settings(
    store: &Store,
    audit: &mut AuditTail,
    loaded: &mut Loaded,
    defaults: &Settings,
    builder: &OutboxBuilder,
    faults: &Failpoints,
) -> Result<Option<crate::settings::Stored>> {
    let new_outbox = loaded.state.items.is_empty()
        && !loaded.has_journal_entries()
        && loaded.state.generation == 0
        && audit.head().seq == 0;
    let plan = settings::plan(
        &loaded.state.settings,
        defaults,
        &builder.explicit,
        builder.update_settings,
        new_outbox,
    );
    for ignored in &plan.ignored {
        tracing::warn!(
            dir = %builder.dir.display(),
            "{ignored}: the stored value is in force (open with `update_settings()` to change it)"
        );
    }
    let Some(next) = plan.store else {
        return Ok(None);
    };
    let records = match plan.note {
        None => return Ok(Some(next)),
        Some(note) => {
            let head = audit.head().clone();
            let how = if builder.update_settings {
                "updated by a handle opened with update_settings"
            } else {
                "stored on first explicit use"
            };
            let event = system_event_of(
                AuditOutcome::Settings,
                &head,
                "settings",
                format!("{note} ({how})"),
                builder.clock.now(),
            );
            vec![AuditRecord::seal(
                &event,
                head.seq + 1,
                &head.hash,
                false,
                audit.hasher(),
            )]
        }
    };
    store
        .commit_settings(loaded, Some(next), Vec::new(), &records, faults)
        .map_err(|(_, e)| e)?;
    audit.append_records(&records, faults)?;
    Ok(None)
}

/// Cross-checks the audit log against the state and appends the records the
/// journal committed but the log does not have yet (after a crash, or when another
/// process died between its journal fsync and its audit append). The records are
/// re-appended byte for byte, so the log ends up exactly as if nothing had happened.
pub(super) fn reconcile_audit(
    audit: &mut AuditTail,
    loaded: &Loaded,
    faults: &Failpoints,
) -> Result<()> {
    // In keyed mode the recorded head is authenticated: without the key it
    // cannot be moved back over a cut-off tail.
    if let Some(recorded) = &loaded.state.audit_head {
        crate::audit::check_head_mac(
            audit.hasher(),
            recorded,
            loaded.state.generation,
            loaded.state.audit_mac.as_deref(),
            &loaded_path(audit),
        )?;
    }
    let head = audit.head().clone();
    let snapshot = loaded
        .state
        .audit_head
        .clone()
        .unwrap_or_else(Head::genesis);
    let broken = |line: u64, fault: AuditFault| Error::AuditBroken {
        path: audit.path().to_path_buf(),
        line,
        fault,
    };
    if head.seq < snapshot.seq {
        return Err(broken(
            head.seq + 1,
            AuditFault::Truncated {
                expected_seq: snapshot.seq,
                found_seq: head.seq,
            },
        ));
    }
    if audit
        .hash_at(snapshot.seq)
        .is_some_and(|hash| hash != snapshot.hash)
    {
        return Err(broken(
            snapshot.seq,
            AuditFault::HeadMismatch { seq: snapshot.seq },
        ));
    }
    let expected_last = loaded.journal_audit.last().map_or(snapshot.seq, |r| r.seq);
    if head.seq > expected_last
        && let Some(at) = loaded.torn_at()
    {
        // A journal write's records are logged only after its sync: a record
        // past the last whole entry means the bytes judged a torn, unsynced
        // write there were synced. They are damage, and the entries they
        // held were acknowledged: refuse, naming where they start.
        return Err(Error::InvalidRecord {
            path: audit.path().with_file_name(crate::store::JOURNAL_FILE),
            location: format!("byte {at}"),
            reason: format!(
                "the line here is not whole, as if a power cut had torn an unsynced write, but \
                 the audit log holds records up to seq {} (past the journal's {expected_last}), \
                 which are logged only after their entry was synced: the journal is damaged",
                head.seq
            ),
        });
    }
    if head.seq > expected_last {
        return Err(Error::InvalidRecord {
            path: loaded_path(audit),
            location: "audit_head".into(),
            reason: format!(
                "the state knows audit records up to seq {expected_last} but the log is at seq {}: \
                 outbox.json or outbox.journal was replaced or rolled back",
                head.seq
            ),
        });
    }
    if let Some(known) = loaded.journal_audit_at(head.seq)
        && known.hash != head.hash
    {
        return Err(broken(head.seq, AuditFault::HeadMismatch { seq: head.seq }));
    }
    // Everything checks out: only now may a torn tail be cut from the log.
    audit.settle_torn_tail()?;
    let missing = loaded.journal_audit_after(head.seq);
    if !missing.is_empty() {
        tracing::warn!(
            records = missing.len(),
            "re-appending audit records a crash left out of the log"
        );
        audit.append_records(missing, faults)?;
    }
    Ok(())
}

/// The state file's path, for errors about the state as a whole.
fn loaded_path(audit: &AuditTail) -> PathBuf {
    audit.path().with_file_name(crate::store::STATE_FILE)
}
