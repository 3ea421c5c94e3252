//! Deferred sealing: pending audit events onto the chain.
//!
//! A transaction of the rules ([`PgTxn`](super::PgTxn)) writes its audit
//! events to `audit_pending` in its own `COMMIT`, each with an id from the table's
//! sequence taken at that write, and never touches the head. After it,
//! [`PgEngine::seal_pending`] runs a short transaction: lock the head row,
//! take every pending event it can see, seal them in id order onto the chain
//! (seq, previous hash, hash: the same canonical records as `audit.jsonl`),
//! insert them into `audit`, move the head, `COMMIT`. The committing handle
//! does this best effort: right after the commit when no other call of the
//! handle is running, otherwise the last of its running calls to end (or the
//! one that finds [`SEAL_EVERY`] commits waiting) seals for all of them (see
//! [`PgEngine::after_txn`]); it skips it when another sealer holds the head
//! (`SKIP LOCKED`); every reader of the chain (`verify_audit`, `history`,
//! the export, `audit_records`, `audit_head`), a handle opening, and a
//! waiting worker seal first and wait for the head. A crash between a commit
//! and its sealing leaves pending events, sealed by the next of those: nothing
//! committed is lost.
//!
//! The committing handle's sealing commits with `synchronous_commit = off`:
//! it does not wait for its own WAL flush, so sealing adds no flush to a
//! writer's call. That is safe because a sealing is one transaction: lost in
//! a server crash, it is lost whole (the `audit` rows, the head move *and*
//! the deletion from `audit_pending`), and the events are sealed again. What
//! must not happen is a reader seeing records that a crash then takes back:
//! so a reader's sealing commits synchronously, and when it had nothing to
//! seal but WAL is not flushed to its end, it commits anyway (it locked the
//! head row, so it has a transaction id), which waits for the flush of every
//! earlier sealing. Another handle's sealing may still commit between that
//! and the read, so every reader of the chain ends with
//! [`PgEngine::make_reads_durable`]: when WAL is not flushed to its end, a
//! synchronous commit that writes WAL flushes it, and with it every commit
//! the read could see. What a reader returns is durable.
//!
//! **Invariant (per-item order):** an item's records are in the chain in the
//! order of its changes. Two transactions that change one item are serialised
//! by its row lock (or, for a new key, the key's lock): the later one takes
//! its pending id after it got the lock, so after the earlier one committed,
//! and its id is larger. A sealer reads pending events in one statement,
//! whose snapshot holds every transaction committed when it began; so if it
//! sees the later event it sees the earlier one too (or that one was sealed
//! already, by a sealer that held the head before), and it seals in id order.
//! Changes of different items may reach the chain in another order than their
//! commits: the chain orders records, not commits of unrelated items.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use super::conn::{Conn, Row, Step, Tx};
use super::{PgEngine, db};
use crate::audit::{AuditEvent, AuditRecord, Head};
use crate::error::{Error, Result};

/// How many of a handle's commits may leave their events pending while
/// other transactions of the handle are still running, before one of them
/// seals (see [`PgEngine::after_txn`]).
const SEAL_EVERY: u64 = 32;

/// How many pending events one sealing transaction moves at most.
const SEAL_BATCH: i64 = 1_000;

/// A thread's turn to seal after its commit (`PgEngine::sealing` set), given
/// back when dropped: when the sealing ends, and also when a panic unwinds
/// through it. A turn never given back would stop every later sealing after
/// a commit of the handle, leaving each commit's events pending until a
/// reader of the chain sealed them.
struct Sealing<'a>(&'a AtomicBool);

impl Drop for Sealing<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// Sealed records to write and the head they end at.
struct SealedWrite {
    seqs: Vec<i64>,
    hashes: Vec<String>,
    lines: Vec<String>,
    head_seq: i64,
    head: Head,
}

impl SealedWrite {
    /// The parameters of [`PgEngine::append_sealed_sql`].
    fn params(&self) -> [&(dyn postgres::types::ToSql + Sync); 5] {
        [
            &self.seqs,
            &self.hashes,
            &self.lines,
            &self.head_seq,
            &self.head.hash,
        ]
    }
}

/// The documents `audit_pending` stores for `events`.
pub(super) fn pending_docs(events: &[AuditEvent]) -> Result<Vec<String>> {
    events
        .iter()
        .map(|event| {
            serde_json::to_string(event).map_err(|e| Error::Database {
                op: "write a pending audit event",
                source: Box::new(e),
            })
        })
        .collect()
}

/// Whether a sealer waits for the head row when another sealer holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Seal {
    /// Wait (a reader of the chain, a handle opening).
    Wait,
    /// Give up (the committing handle's best effort: the holder, or the next
    /// reader, seals what is left).
    IfFree,
}

/// The head from a row of `seq, hash`.
fn head_of_row(row: &Row) -> Head {
    Head {
        seq: u64::try_from(row.get::<_, i64>(0)).unwrap_or(0),
        hash: row.get(1),
    }
}

impl PgEngine {
    /// Inserts pending events (parameter: their documents, from
    /// [`pending_docs`]) in order: a transaction that wrote no item but
    /// sealed events (an item's write carries its transaction's events,
    /// see `rows::ItemWrite::statement`).
    pub(super) fn pending_sql(&self) -> String {
        super::rows::pending_insert_sql(&self.s, 1)
    }

    /// Seals the pending events onto the chain (see "Deferred sealing"), in
    /// transactions of at most [`SEAL_BATCH`] events, until none is left that
    /// this sealer can see. With [`Seal::IfFree`] it gives up at once when
    /// another sealer holds the head (that one, or the next reader, seals
    /// what is left). Returns the records sealed, with their pending ids.
    ///
    /// # Errors
    /// [`Error::Database`]; [`Error::InvalidRecord`] for a pending row that
    /// is not an event (nothing is sealed then).
    pub(crate) fn seal_pending(
        &self,
        client: &mut Conn,
        how: Seal,
    ) -> Result<Vec<(i64, AuditRecord)>> {
        let mut sealed = Vec::new();
        loop {
            // `BEGIN` goes with the head's statement: one round trip.
            let mut tx = client.begin();
            // The committing handle's sealing does not wait for its WAL
            // flush (see "Deferred sealing": a sealing lost in a crash is
            // undone whole, its events pending again, and no reader has seen
            // it, since a reader's sealing flushes first).
            let sql = match how {
                Seal::Wait => "SELECT seq, hash FROM {s}.audit_head WHERE id = 1 FOR UPDATE",
                Seal::IfFree => {
                    "SELECT seq, hash, set_config('synchronous_commit', 'off', true)
                     FROM {s}.audit_head WHERE id = 1 FOR UPDATE SKIP LOCKED"
                }
            };
            let Some(row) = tx
                .query_opt(&sql.replace("{s}", &self.s), &[])
                .map_err(db("lock the audit head"))?
            else {
                return Ok(sealed);
            };
            let head = head_of_row(&row);
            let rows = self.take_pending(&mut tx)?;
            if rows.is_empty() {
                if how == Seal::Wait && !Self::wal_flushed(&mut tx)? {
                    // A reader: a sealing committed without waiting for its
                    // WAL flush may be what it is about to read. This commit
                    // (it locked the head row: it has a transaction id)
                    // waits for the flush of every WAL record before it.
                    tx.commit().map_err(db("flush sealed audit records"))?;
                }
                // Otherwise nothing written: rolled back, no WAL flush.
                return Ok(sealed);
            }
            let full = rows.len() as i64 >= SEAL_BATCH;
            let (batch, write) = self.seal_rows(rows, head)?;
            // The records and the head's move go with the `COMMIT`.
            let params = write.params();
            let sql = self.append_sealed_sql();
            tx.pipeline(&[Step::Execute(&sql, &params), Step::Simple("COMMIT")])
                .map_err(db("commit sealed audit records"))?;
            tx.ended();
            sealed.extend(batch);
            if !full {
                return Ok(sealed);
            }
        }
    }

    /// Whether every WAL record written so far is flushed (so every sealing
    /// this transaction can see is durable).
    fn wal_flushed(tx: &mut Tx<'_>) -> Result<bool> {
        Ok(tx
            .query_one(
                "SELECT pg_current_wal_flush_lsn() >= pg_current_wal_insert_lsn()",
                &[],
            )
            .map_err(db("read the WAL position"))?
            .get(0))
    }

    /// Inside `tx`, which holds the head row at `head`: moves up to
    /// [`SEAL_BATCH`] pending events, in pending-id order, onto the chain
    /// and moves the head. Returns them sealed, and the new head.
    pub(super) fn seal_pending_in(
        &self,
        tx: &mut Tx<'_>,
        head: Head,
    ) -> Result<(Vec<(i64, AuditRecord)>, Head)> {
        let rows = self.take_pending(tx)?;
        if rows.is_empty() {
            return Ok((Vec::new(), head));
        }
        let (sealed, write) = self.seal_rows(rows, head)?;
        tx.execute(&self.append_sealed_sql(), &write.params())
            .map_err(db("append sealed audit records"))?;
        Ok((sealed, write.head))
    }

    /// Deletes up to [`SEAL_BATCH`] pending events (the oldest) in `tx`,
    /// which holds the head row; returns them in pending-id order.
    fn take_pending(&self, tx: &mut Tx<'_>) -> Result<Vec<(i64, String)>> {
        let s = &self.s;
        let mut rows: Vec<(i64, String)> = tx
            .query(
                &format!(
                    "DELETE FROM {s}.audit_pending WHERE id IN (
                       SELECT id FROM {s}.audit_pending ORDER BY id LIMIT $1)
                     RETURNING id, event"
                ),
                &[&SEAL_BATCH],
            )
            .map_err(db("take pending audit events"))?
            .iter()
            .map(|row| (row.get(0), row.get(1)))
            .collect();
        rows.sort_by_key(|(id, _)| *id);
        Ok(rows)
    }

    /// Seals pending events (in the order given) after `head`: the records,
    /// and what to write.
    fn seal_rows(
        &self,
        rows: Vec<(i64, String)>,
        head: Head,
    ) -> Result<(Vec<(i64, AuditRecord)>, SealedWrite)> {
        let mut seq = head.seq;
        let mut prev = head.hash;
        let mut sealed = Vec::with_capacity(rows.len());
        let (mut seqs, mut hashes, mut lines) = (Vec::new(), Vec::new(), Vec::new());
        for (id, doc) in rows {
            let event: AuditEvent =
                serde_json::from_str(&doc).map_err(|e| Error::InvalidRecord {
                    path: PathBuf::from(format!("postgres:{}.audit_pending", self.schema)),
                    location: format!("id {id}"),
                    reason: format!("not a pending audit event: {e}"),
                })?;
            seq += 1;
            let record = AuditRecord::seal(&event, seq, &prev, false, &self.hasher);
            let mut line = record.to_line();
            line.pop();
            seqs.push(i64::try_from(seq).unwrap_or(i64::MAX));
            hashes.push(record.hash.clone());
            lines.push(String::from_utf8_lossy(&line).into_owned());
            prev.clone_from(&record.hash);
            sealed.push((id, record));
        }
        let head = Head { seq, hash: prev };
        Ok((
            sealed,
            SealedWrite {
                seqs,
                hashes,
                lines,
                head_seq: i64::try_from(head.seq).unwrap_or(i64::MAX),
                head,
            },
        ))
    }

    /// Inserts sealed records and moves the head, in one statement
    /// (parameters: [`SealedWrite::params`]).
    fn append_sealed_sql(&self) -> String {
        let s = &self.s;
        format!(
            "WITH sealed AS (
               INSERT INTO {s}.audit (seq, hash, line)
               SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[]))
             UPDATE {s}.audit_head SET seq = $4, hash = $5 WHERE id = 1"
        )
    }

    /// Makes what a read on `client` just saw durable: every commit it could
    /// see wrote its commit record before the read, so WAL flushed to its
    /// current end covers them. When it is not flushed that far, a
    /// transaction that writes WAL (a key-share lock on the head row: a
    /// transaction id alone commits without a flush) commits synchronously,
    /// which waits for that flush. Called by every reader of the chain after
    /// its read (see the module docs: another handle's sealing commits
    /// without waiting for its flush, and could otherwise be returned, then
    /// taken back by a server crash).
    ///
    /// # Errors
    /// [`Error::Database`]: the caller must not return what it read.
    pub(super) fn make_reads_durable(&self, client: &mut Conn) -> Result<()> {
        let mut tx = client.begin();
        if Self::wal_flushed(&mut tx)? {
            return tx.commit().map_err(db("end a WAL position read"));
        }
        let lock = format!(
            "SELECT 1 FROM {}.audit_head WHERE id = 1 FOR KEY SHARE",
            self.s
        );
        tx.pipeline(&[
            Step::Simple("SELECT set_config('synchronous_commit', 'on', true)"),
            Step::Execute(&lock, &[]),
            Step::Simple("COMMIT"),
        ])
        .map_err(db("make the chain read durable"))?;
        tx.ended();
        Ok(())
    }

    /// Seals what is pending before a read of the chain (waits for the head).
    pub(super) fn seal_before_reading(&self, client: &mut Conn) -> Result<()> {
        self.seal_pending(client, Seal::Wait).map(|_| ())
    }

    /// After a transaction of the rules ended (committed or not; `pending`:
    /// it committed audit events, `others`: transactions of this handle still
    /// running): seals what this handle's commits left pending, best effort,
    /// when no other transaction of the handle is running (the last one out
    /// seals for all: one sealing for many commits) or when [`SEAL_EVERY`]
    /// commits are waiting. A handle running one call at a time seals right
    /// after each commit. Pending events are durable whatever happens here:
    /// every reader of the chain and every opening seals first.
    ///
    /// One thread of a handle seals at a time: a thread that finds another
    /// sealing leaves its events to that one, which goes round again when
    /// commits arrived during its sealing.
    pub(super) fn after_txn(&self, client: &mut Conn, pending: bool, others: u64) {
        if pending {
            self.unsealed.fetch_add(1, Ordering::SeqCst);
        }
        let waiting = self.unsealed.load(Ordering::SeqCst);
        if waiting == 0 || (others > 0 && waiting < SEAL_EVERY) {
            return;
        }
        while !self.sealing.swap(true, Ordering::SeqCst) {
            let held = Sealing(&self.sealing);
            let taken = self.unsealed.swap(0, Ordering::SeqCst);
            // A failpoint here stands for a crash (or a lost connection)
            // between the commit and its sealing.
            let sealed = self
                .faults
                .check("postgres.seal_after_commit")
                .map_err(|e| Error::io(self.place(), "seal after commit", e))
                .and_then(|()| self.seal_pending(client, Seal::IfFree));
            drop(held);
            if let Err(e) = sealed {
                // Still pending: the next sealer (or reader) takes them.
                self.unsealed.fetch_add(taken, Ordering::SeqCst);
                tracing::warn!(
                    schema = %self.schema,
                    error = %e,
                    "could not seal committed audit events now; the next reader or handle seals them"
                );
                break;
            }
            // Again only for what the rule above would seal now: a thread
            // does not seal for ever while others keep committing.
            let waiting = self.unsealed.load(Ordering::SeqCst);
            let running = self.in_txn.load(Ordering::SeqCst);
            if waiting == 0 || (running > 0 && waiting < SEAL_EVERY) {
                break;
            }
        }
    }

    /// Seals `event` after `head` (locked by `tx`) and moves the head.
    pub(super) fn append_system_record(
        &self,
        tx: &mut Tx<'_>,
        head: &Head,
        event: &AuditEvent,
    ) -> Result<()> {
        let s = &self.s;
        let record = AuditRecord::seal(event, head.seq + 1, &head.hash, false, &self.hasher);
        let mut line = record.to_line();
        line.pop();
        let seq = i64::try_from(record.seq).unwrap_or(i64::MAX);
        tx.execute(
            &format!("INSERT INTO {s}.audit (seq, hash, line) VALUES ($1, $2, $3)"),
            &[
                &seq,
                &record.hash,
                &String::from_utf8_lossy(&line).into_owned(),
            ],
        )
        .map_err(db("append an audit record"))?;
        tx.execute(
            &format!("UPDATE {s}.audit_head SET seq = $1, hash = $2 WHERE id = 1"),
            &[&seq, &record.hash],
        )
        .map_err(db("move the audit head"))?;
        Ok(())
    }

    /// Opens a writer that records an event about the outbox itself (stored
    /// settings, a retention prune) in `tx`: passes the writers' gate
    /// exclusively, locks the audit head and seals every pending event onto
    /// the chain first, so the writer's own record comes after them. Returns
    /// the head its record follows.
    pub(super) fn begin_outbox_write(&self, tx: &mut Tx<'_>) -> Result<Head> {
        self.pass_gate(tx, super::txn::Scope::Any)?;
        let head = self.lock_head(tx)?;
        let (_, head) = self.seal_pending_in(tx, head)?;
        Ok(head)
    }

    /// Locks the audit head row in `tx` (a sealer's lock) and returns it.
    pub(super) fn lock_head(&self, tx: &mut Tx<'_>) -> Result<Head> {
        let row = tx
            .query_one(
                &format!(
                    "SELECT seq, hash FROM {}.audit_head WHERE id = 1 FOR UPDATE",
                    self.s
                ),
                &[],
            )
            .map_err(db("lock the audit head"))?;
        Ok(head_of_row(&row))
    }
}
