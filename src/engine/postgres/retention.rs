//! Housekeeping on PostgreSQL: what `Outbox::compact` does there.
//!
//! The file engine's compaction folds its journal into a snapshot and, on the
//! way, seals the audit log, moves old terminal items to history, prunes the
//! history the retention policy no longer keeps (each prune on record), and
//! drops cooldowns whose moment has passed. PostgreSQL has no journal or
//! snapshot, and history is a view of old terminal rows (nothing moves), so
//! its compaction is:
//!
//! 1. seal every audit event committed and not yet on the chain (waiting for
//!    the head, as a reader does, so what it sealed is durable when it
//!    returns);
//! 2. apply `history_retention` ([`PgEngine::apply_retention`]: under
//!    `MaxAge`, the terminal items past it, outside every rate window, with
//!    one `pruned` audit record; the same pass an open runs);
//! 3. drop the destination cooldowns that ended at `now`
//!    ([`PgEngine::drop_ended_cooldowns`]), as the file engine's compaction
//!    does: a bot that talked to many chats would otherwise carry a row for
//!    each for ever.
//!
//! A cooldown ended when its moment is at or before `now`, the compacting
//! handle's clock: the comparison the rules make (a cooldown holds while
//! `until > now`), so one still in force for this handle is never dropped,
//! and one dropped stays dropped whatever a clock does later. A handle on
//! another host whose clock runs behind by `d` may see a cooldown end up to
//! `d` early; an upsert that raises a cooldown meanwhile is re-checked by
//! the server before the delete touches it, so a raised one is kept.
//!
//! Neither engine's compaction removes audit records: the chain is kept
//! whole, and on PostgreSQL it always starts at genesis (there are no sealed
//! segments for `remove_old_audit_segments` to remove).

use chrono::{DateTime, Utc};

use super::{PgEngine, Seal, db};
use crate::audit::AuditOutcome;
use crate::error::Result;
use crate::rules::record::system_event_of;
use crate::settings::Settings;

/// What one compaction did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Compacted {
    /// Audit events it sealed onto the chain.
    pub(crate) sealed: usize,
    /// History items retention deleted.
    pub(crate) pruned: u64,
    /// Ended destination cooldowns it dropped.
    pub(crate) cooldowns: u64,
}

impl PgEngine {
    /// Seals pending audit events, then applies retention under `settings`
    /// (the stored ones) at `now`; see the module docs. Each step is its own
    /// transaction, and each leaves a consistent outbox: a failure part-way
    /// leaves the rest for the next compaction (or open).
    ///
    /// # Errors
    /// [`Error::Database`](crate::Error::Database); the errors of sealing
    /// (a pending row that is not an event).
    pub(crate) fn compact(&self, settings: &Settings, now: DateTime<Utc>) -> Result<Compacted> {
        let sealed = {
            let mut client = self.client()?;
            self.seal_pending(&mut client, Seal::Wait)?.len()
        };
        let pruned =
            super::retry::retrying("a retention prune", |_| self.apply_retention(settings, now))?;
        let cooldowns = super::retry::retrying("dropping ended cooldowns", |_| {
            self.drop_ended_cooldowns(now)
        })?;
        Ok(Compacted {
            sealed,
            pruned,
            cooldowns,
        })
    }

    /// Deletes the destination cooldowns that ended at or before `now` (see
    /// the module docs); how many went. One statement: the server re-checks
    /// each row it deletes against a concurrent raise.
    ///
    /// # Errors
    /// [`Error::Database`](crate::Error::Database).
    pub(crate) fn drop_ended_cooldowns(&self, now: DateTime<Utc>) -> Result<u64> {
        let sql = format!(
            "DELETE FROM {}.cooldowns WHERE until <= $1 RETURNING destination",
            self.s
        );
        // Safe to run again on another connection (see `PgEngine::read`):
        // a second run finds nothing more to delete.
        self.read(|client| {
            client
                .query(&sql, &[&now])
                .map(|rows| rows.len() as u64)
                .map_err(db("drop ended cooldowns"))
        })
    }
}

impl PgEngine {
    /// Applies `history_retention` at `now`: under `MaxAge(age)`, deletes the
    /// terminal items last changed longer ago than `age` (and than
    /// `history_after`, and outside every rate window, so nothing that still
    /// counts against a cap goes), with one `pruned` audit record saying how
    /// many and up to when, in one transaction. `KeepAll` keeps everything;
    /// `MaxSegments` counts files the PostgreSQL engine does not have, so it
    /// keeps everything too (logged). Returns how many items went.
    pub(crate) fn apply_retention(&self, settings: &Settings, now: DateTime<Utc>) -> Result<u64> {
        let age = match settings.retention {
            crate::history::Retention::MaxAge(age) => age,
            crate::history::Retention::MaxSegments(_) => {
                tracing::warn!(
                    schema = %self.schema,
                    "history_retention max_segments does not apply to a PostgreSQL outbox \
                     (it has no segment files); keeping all history: use max_age"
                );
                return Ok(0);
            }
            _ => return Ok(0),
        };
        let keep_for = age
            .max(settings.history_after)
            .max(settings.rates.longest_window());
        let cutoff = crate::clock::earlier(now, keep_for);
        let mut client = self.client()?;
        let mut tx = client.begin();
        let s = &self.s;
        // Pending events (the pruned items' last ones among them) go on the
        // chain first: the prune's record comes after them.
        let head = self.begin_outbox_write(&mut tx)?;
        let gone: Vec<String> = tx
            .query(
                &format!(
                    "DELETE FROM {s}.items
                     WHERE state <> 'queued' AND NOT claimed AND updated_at <= $1
                     RETURNING idempotency_key"
                ),
                &[&cutoff],
            )
            .map_err(db("prune history"))?
            .iter()
            .map(|row| row.get(0))
            .collect();
        if gone.is_empty() {
            tx.commit().map_err(db("end a retention look"))?;
            return Ok(0);
        }
        tx.execute(
            &format!("DELETE FROM {s}.rate_times WHERE idempotency_key = ANY($1)"),
            &[&gone],
        )
        .map_err(db("prune history's send times"))?;
        let note = format!(
            "retention pruned {} history items last changed at or before {}",
            gone.len(),
            crate::clock::format_timestamp(cutoff)
        );
        let event = system_event_of(AuditOutcome::Pruned, &head, "history-retention", note, now);
        self.append_system_record(&mut tx, &head, &event)?;
        tx.commit().map_err(db("commit a retention prune"))?;
        Ok(gone.len() as u64)
    }
}
