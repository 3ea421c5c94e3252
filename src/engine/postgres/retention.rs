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
//!    one `pruned` audit record; the same pass an open runs).
//!
//! Ended cooldowns are kept: readers compare them with their own clock, and
//! with handles on several hosts, one whose clock runs ahead must not delete
//! a cooldown another still honours. Each is one small row per destination.
//!
//! Neither engine's compaction removes audit records: the chain is kept
//! whole, and on PostgreSQL it always starts at genesis (there are no sealed
//! segments for `remove_old_audit_segments` to remove).

use chrono::{DateTime, Utc};

use super::{PgEngine, Seal};
use crate::error::Result;
use crate::settings::Settings;

/// What one compaction did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Compacted {
    /// Audit events it sealed onto the chain.
    pub(crate) sealed: usize,
    /// History items retention deleted.
    pub(crate) pruned: u64,
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
        Ok(Compacted { sealed, pruned })
    }
}
