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
//! Neither engine's compaction removes audit records: that is an operator's
//! decision, `Outbox::remove_old_audit_segments`, here
//! [`PgEngine::remove_old_audit_segments`]. The chain is one table, so its
//! segments are counted as the file engine seals them, by the handle's
//! `audit_rotate_bytes` ([`Segments`]: a segment ends at the first record
//! that brings its lines to that size; what follows the last one is the
//! active part and stays). One transaction, under a removal lock of its own
//! (one removal at a time, so the rows it measures stay) and then the
//! chain's head lock (as every sealer takes it): it seals what is pending,
//! appends the `pruned` record (key `audit-segments`; the note names the
//! operator, the reason, the range and `the chain now starts after seq S
//! hash H`, the last removed record) through the sealing path, and deletes
//! the rows up to S. Nothing is stored beside the chain: the first remaining
//! row links to S and H, and verification (see `chain`) requires the record
//! that names them. Another host's commits meanwhile go on (the writers'
//! gate is not taken) and wait as pending events; its readers wait for the
//! head. A failure before the `COMMIT`, a lost connection included, rolls
//! all of it back; a connection lost during the `COMMIT` leaves it unknown
//! whether the removal committed (the error says so; its record at the head
//! tells).

use chrono::{DateTime, Utc};

use super::{PgEngine, Seal, db};
use crate::audit::{AuditOutcome, Head, REMOVAL_SUBJECT, removal_note};
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

/// How many rows one page of the segment scan reads.
const SEGMENT_PAGE: i64 = 10_000;

/// The oldest audit records an operator's removal takes: the chain's first
/// seq up to `last` (which becomes the anchor), in `segments` whole segments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Removal {
    first: u64,
    last: u64,
    segments: usize,
}

/// Cuts a chain into the segments the file engine would have sealed with
/// `segment_bytes` as its `audit_rotate_bytes`: from the chain's first
/// record, a segment ends at the first record that brings its lines (each
/// with its newline, as in `audit.jsonl`) to `segment_bytes` or more. What
/// follows the last such record is the active part, never removed (the
/// file engine's `audit.jsonl`). Fed the rows in seq order, one at a time.
#[derive(Debug)]
struct Segments {
    segment_bytes: u64,
    keep: usize,
    /// The chain's first seq (0 before the first row).
    first: u64,
    /// Bytes of the segment being filled.
    filling: u64,
    /// How many segments ended so far.
    ended: usize,
    /// The last seq of the newest `keep + 1` segments that ended, oldest
    /// first: the anchor is the oldest of them once the scan is over.
    ends: std::collections::VecDeque<u64>,
}

impl Segments {
    fn new(segment_bytes: u64, keep: usize) -> Self {
        Self {
            segment_bytes,
            keep,
            first: 0,
            filling: 0,
            ended: 0,
            ends: std::collections::VecDeque::new(),
        }
    }

    /// The next row: its seq and the length of its line.
    fn push(&mut self, seq: u64, line_bytes: u64) {
        if self.first == 0 {
            self.first = seq;
        }
        self.filling += line_bytes + 1;
        if self.filling >= self.segment_bytes {
            self.filling = 0;
            self.ended += 1;
            self.ends.push_back(seq);
            if self.ends.len() > self.keep.saturating_add(1) {
                self.ends.pop_front();
            }
        }
    }

    /// What removing all sealed segments but the newest `keep` takes
    /// (`None`: nothing, there are no more than `keep`).
    fn removal(&self) -> Option<Removal> {
        let segments = self.ended.checked_sub(self.keep).filter(|n| *n > 0)?;
        // `ends` holds the last `keep + 1` ends (or all, when fewer ended):
        // the newest removed segment's end is the one before the kept ones.
        let last = *self
            .ends
            .get(self.ends.len().checked_sub(self.keep.saturating_add(1))?)?;
        Some(Removal {
            first: self.first,
            last,
            segments,
        })
    }
}

impl PgEngine {
    /// Removes the oldest audit records, all but the newest `keep` of the
    /// segments `segment_bytes` cuts the chain into (see [`Segments`]),
    /// after a `pruned` record naming `note`, the range and the anchor;
    /// returns how many segments went. One transaction: it takes the
    /// schema's removal lock (one removal at a time, so the rows it scans
    /// stay), cuts the chain up to the head it read into segments, then
    /// locks the head as every sealer does, seals what is pending, appends
    /// the removal's record through the sealing path and deletes the rows up
    /// to the anchor. A failure before the `COMMIT` (a lost connection
    /// included) rolls all of it back: the chain is as it was. A connection
    /// lost during the `COMMIT` may have committed it.
    ///
    /// # Errors
    /// [`Error::Database`](crate::Error::Database); the errors of sealing.
    pub(crate) fn remove_old_audit_segments(
        &self,
        keep: usize,
        note: &str,
        segment_bytes: u64,
        now: DateTime<Utc>,
    ) -> Result<usize> {
        let s = &self.s;
        let mut client = self.client()?;
        let mut tx = client.begin();
        tx.execute(
            "SELECT pg_advisory_xact_lock($1)",
            &[&super::lock_key(&self.schema, "audit-removal")],
        )
        .map_err(db("take the audit removal lock"))?;
        // Rows up to the head are sealed and stay while this lock is held:
        // only a removal deletes them, and sealers only append after it.
        let upto: i64 = tx
            .query_one(&format!("SELECT seq FROM {s}.audit_head WHERE id = 1"), &[])
            .map_err(db("read the audit head"))?
            .get(0);
        let mut segments = Segments::new(segment_bytes, keep);
        let mut after = 0i64;
        loop {
            let rows = tx
                .query(
                    &format!(
                        "SELECT seq, octet_length(line) FROM {s}.audit
                         WHERE seq > $1 AND seq <= $2 ORDER BY seq LIMIT $3"
                    ),
                    &[&after, &upto, &SEGMENT_PAGE],
                )
                .map_err(db("read the audit log's line lengths"))?;
            for row in &rows {
                let seq: i64 = row.get(0);
                let bytes: i32 = row.get(1);
                segments.push(
                    u64::try_from(seq).unwrap_or(0),
                    u64::try_from(bytes).unwrap_or(0),
                );
                after = seq;
            }
            if (rows.len() as i64) < SEGMENT_PAGE {
                break;
            }
        }
        let Some(removal) = segments.removal() else {
            tx.commit().map_err(db("end an audit removal look"))?;
            return Ok(0);
        };
        let last = i64::try_from(removal.last).unwrap_or(i64::MAX);
        let anchor = Head {
            seq: removal.last,
            hash: tx
                .query_one(
                    &format!("SELECT hash FROM {s}.audit WHERE seq = $1"),
                    &[&last],
                )
                .map_err(db("read the last removed audit record"))?
                .get(0),
        };
        let head = self.lock_head(&mut tx)?;
        let (_, head) = self.seal_pending_in(&mut tx, head)?;
        let note = format!(
            "{note} (removed {} audit segments of {segment_bytes} bytes: records seq {} to {}; {})",
            removal.segments,
            removal.first,
            removal.last,
            removal_note(&anchor)
        );
        let event = system_event_of(AuditOutcome::Pruned, &head, REMOVAL_SUBJECT, note, now);
        self.append_system_record(&mut tx, &head, &event)?;
        tx.execute(&format!("DELETE FROM {s}.audit WHERE seq <= $1"), &[&last])
            .map_err(db("remove old audit records"))?;
        // A failure here stands for a crash or a lost connection before
        // the commit: the server rolls all of it back.
        self.faults
            .check("postgres.audit_removal")
            .map_err(|e| crate::error::Error::io(self.place(), "remove old audit records", e))?;
        tx.commit().map_err(db("commit an audit removal"))?;
        Ok(removal.segments)
    }
}

#[cfg(test)]
mod tests {
    use super::{Removal, Segments};

    /// The removal `keep` leaves over rows of `lines` bytes each (seq from
    /// `first`), cut at `segment` bytes.
    fn removal(first: u64, lines: &[u64], segment: u64, keep: usize) -> Option<Removal> {
        let mut segments = Segments::new(segment, keep);
        for (i, bytes) in lines.iter().enumerate() {
            segments.push(first + i as u64, *bytes);
        }
        segments.removal()
    }

    #[test]
    fn a_segment_ends_at_the_record_that_brings_it_to_the_size() {
        // Lines of 99 bytes and their newlines: 100 each; segments of 250
        // bytes end at every third record; the last two are the active part.
        let lines = [99; 11];
        assert_eq!(
            removal(1, &lines, 250, 1),
            Some(Removal {
                first: 1,
                last: 6,
                segments: 2
            })
        );
        assert_eq!(
            removal(1, &lines, 250, 0),
            Some(Removal {
                first: 1,
                last: 9,
                segments: 3
            }),
            "keep 0: every whole segment, never the active part"
        );
        assert_eq!(
            removal(1, &lines, 250, 3),
            None,
            "three segments, keep three"
        );
        assert_eq!(removal(1, &lines, 250, usize::MAX), None);
        // Exactly the size ends a segment too.
        assert_eq!(
            removal(41, &[99, 99], 200, 0),
            Some(Removal {
                first: 41,
                last: 42,
                segments: 1
            }),
            "a chain that starts after a removal counts from its first row"
        );
    }

    #[test]
    fn a_line_larger_than_a_segment_is_a_segment_of_its_own() {
        assert_eq!(
            removal(1, &[5_000, 10, 5_000, 10], 1_000, 1),
            Some(Removal {
                first: 1,
                last: 1,
                segments: 1
            })
        );
    }
}
