//! Recording what a send did in one round trip: a transaction run first
//! against the version of the item this handle's own claim committed, and
//! committed only if the server finds that version, the stored settings and
//! this handle's owner lock still as the run assumed.
//!
//! A transaction after a send ([`Scope::AfterSend`]: the record of what the
//! send did, giving a claim back, abandoning it) reads one row, the item its
//! handle claimed a moment ago, and almost always finds it exactly as the
//! claim left it. The usual way spends a round trip reading it (`BEGIN`, the
//! gate, the row `FOR UPDATE`) before the rule decides and a second one
//! writing and committing. Here the rule decides first, from the version the
//! claim committed (kept in [`Known`]), and the whole transaction goes in one
//! pipeline:
//!
//! 1. `BEGIN`, then the gate's statement of the usual opening (the writers'
//!    gate shared, the key's lock), which also fails the transaction unless
//!    the stored settings are the ones the run decided with ([`guard_sql`]);
//! 2. the item's write as the usual commit sends it, but as an `UPDATE … WHERE
//!    revision = <the claim's> AND seq = <its>` that fails the transaction
//!    when it finds no such row (someone changed the item meanwhile, or
//!    replaced it with another item of the key: see
//!    [`ItemWrite::guarded_statement`]), with its send times, cooldown and
//!    pending audit events in the same statement;
//! 3. `COMMIT`.
//!
//! The locks are the usual ones in the usual order (gate, key, row), so the
//! lock order of `txn` holds. A guard that fails ends the transaction with
//! nothing written (division by zero, SQLSTATE `22012`, which no other
//! statement of ours can raise), and the transaction runs again the usual
//! way, reading the row. So does a run whose rule asked for anything but the
//! one item (a destination's line, a pace, another row: [`PgTxn`] refuses
//! every read of the server while speculating) or changed nothing.
//!
//! **Invariant:** a speculative commit writes exactly what the usual run
//! would have written had it read the row at that moment: the guards prove
//! the row and the settings are what the rule decided by, under the same
//! locks the usual run holds, before anything is committed. (The usual run
//! also probes this handle's owner lock, and takes it again if it was lost;
//! that is for the claims a transaction makes, and one after a send makes
//! none: see [`guard_sql`].)
//!
//! **A lost connection.** Without an answer the commit may or may not have
//! happened. The usual way, a connection found dead before anything ran is
//! replaced and the transaction run again; here the `COMMIT` went with the
//! first statement, so the usual run, on a fresh connection, reads the item
//! again once its opening holds the key's lock and the row ([`Settled`]; a
//! session of the lost connection the server has not noticed yet holds the
//! key's lock until it ends, so what it does is seen, never overtaken):
//! still at the claim's revision, nothing was committed, nor can be (the
//! usual run's write moves the revision past the one the lost write
//! expects), and the usual run goes on; at the next revision holding
//! exactly the document written, it was, and the usual run is rolled back;
//! anything else is reported as the usual commit reports a lost connection.

use std::collections::HashMap;
use std::sync::Mutex;

use chrono::{DateTime, Utc};

use super::conn::{Conn, Step};
use super::rows::ItemWrite;
use super::{PgEngine, PgTxn, db, lock, lock_key};
use crate::engine::Expect;
use crate::error::{Error, Result};
use crate::item::{ItemState, OutboxItem};
use crate::settings::{Settings, Stored};

/// How many claimed items a handle keeps the committed version of (its
/// sends in flight, normally far fewer): past it, a claim is not kept and its
/// record takes the usual two round trips.
pub(super) const KNOWN_MAX: usize = 4096;

/// The SQLSTATE of a guard that failed (`division_by_zero`).
const REFUSED: &str = "22012";

/// What a handle knows of its own commits: the version of each item it
/// claimed, as committed; the destination of each item it left queued and
/// unclaimed (an enqueue, a retry: what a decision about it may read ahead,
/// see `PgEngine::open_txn`); and the stored settings its last transaction
/// read. Each map keeps at most [`KNOWN_MAX`] entries, and starts afresh
/// when full: what it forgets only costs a round trip.
#[derive(Default)]
pub(crate) struct Known {
    rows: Mutex<HashMap<String, (OutboxItem, u64)>>,
    destinations: Mutex<HashMap<String, String>>,
    settings: Mutex<Option<Seen>>,
}

/// Keeps `value` under `key` in `map`, which holds at most [`KNOWN_MAX`]
/// entries: a full map starts afresh.
fn keep<V>(map: &mut HashMap<String, V>, key: &str, value: V) {
    if map.len() >= KNOWN_MAX && !map.contains_key(key) {
        map.clear();
    }
    map.insert(key.to_owned(), value);
}

/// The stored settings as a transaction read them: the row's text (what the
/// guard compares) and what it says.
#[derive(Clone)]
struct Seen {
    doc: Option<String>,
    stored: Stored,
}

impl Known {
    /// `item` was committed at `revision` by this handle (whose owner id is
    /// `owner`): kept if it holds a claim of `owner`'s, forgotten otherwise.
    pub(crate) fn committed(&self, item: &OutboxItem, revision: u64, owner: &str) {
        let key = &item.idempotency_key;
        let queued = item.state == ItemState::Queued;
        {
            let mut rows = lock(&self.rows);
            if queued && item.claim_owner() == Some(owner) {
                keep(&mut rows, key, (item.clone(), revision));
            } else {
                rows.remove(key);
            }
        }
        let mut destinations = lock(&self.destinations);
        if queued && item.claim.is_none() {
            if destinations.get(key) != Some(&item.destination) {
                keep(&mut destinations, key, item.destination.clone());
            }
        } else {
            destinations.remove(key);
        }
    }

    /// The destination of `key`, if this handle left it queued and
    /// unclaimed last it wrote it.
    pub(crate) fn destination_of(&self, key: &str) -> Option<String> {
        lock(&self.destinations).get(key).cloned()
    }

    /// Forgets the destination of `key` (what was remembered no longer
    /// holds: the item is not queued and unclaimed there).
    pub(crate) fn forget_destination(&self, key: &str) {
        lock(&self.destinations).remove(key);
    }

    /// The stored settings the handle's last transaction read, if any has.
    pub(crate) fn seen_stored(&self) -> Option<Stored> {
        lock(&self.settings)
            .as_ref()
            .map(|seen| seen.stored.clone())
    }

    /// Takes the version of `key` this handle committed last, if kept.
    pub(super) fn take(&self, key: &str) -> Option<(OutboxItem, u64)> {
        lock(&self.rows).remove(key)
    }

    /// The stored settings a transaction read as the row's text `doc`:
    /// what the last one read means, if it read the same, else `parse`d
    /// (and kept for the next).
    ///
    /// # Errors
    /// `parse`'s (a damaged row).
    pub(crate) fn stored_settings(
        &self,
        doc: Option<String>,
        parse: impl FnOnce(Option<String>) -> Result<Stored>,
    ) -> Result<Stored> {
        let mut seen = lock(&self.settings);
        if let Some(seen) = seen.as_ref().filter(|seen| seen.doc == doc) {
            return Ok(seen.stored.clone());
        }
        let stored = parse(doc.clone())?;
        *seen = Some(Seen {
            doc,
            stored: stored.clone(),
        });
        Ok(stored)
    }

    fn seen(&self) -> Option<Seen> {
        lock(&self.settings).clone()
    }

    /// How many claimed items are kept (tests).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        lock(&self.rows).len()
    }
}

/// The gate's statement of a speculative transaction (parameters: the
/// writers' gate, the key's lock, the stored settings' text the run decided
/// with): the opening's locks, then a division by zero unless the settings
/// are those.
///
/// Unlike the usual opening it does not probe this handle's owner lock: a
/// transaction after a send makes no claim (it records, gives back or
/// abandons one), so nothing it writes needs the lock held; a claim of ours
/// another host settled meanwhile, because the lock was lost, has moved the
/// item's revision, which the write checks.
pub(super) fn guard_sql(s: &str) -> String {
    format!(
        "SELECT 1 / (CASE WHEN (SELECT doc FROM {s}.settings WHERE id = 1) IS NOT DISTINCT FROM $3::text
                       THEN 1 ELSE 0 END)
         FROM (SELECT pg_advisory_xact_lock_shared($1), pg_advisory_xact_lock($2)) gate"
    )
}

/// How a speculative run of a transaction ended.
pub(super) enum Speculated<T> {
    /// Committed: the rule's value, and whether events were left pending.
    Committed(T, bool),
    /// Nothing committed, nothing else to report: run it the usual way.
    Usual,
    /// The connection was lost with the commit sent: settle it with
    /// [`PgEngine::settle`] in the usual run, on another connection.
    Lost(T, Lost),
}

/// A speculative commit whose answer was lost with its connection.
pub(super) struct Lost {
    error: Error,
    key: String,
    /// The revision the write expected: the row is at `revision + 1`,
    /// holding `doc`, if the commit happened.
    revision: u64,
    doc: String,
    pending: bool,
    /// The write made the item claimable (waiting workers are to be woken).
    wake: bool,
}

/// What reading the item again told of a [`Lost`] commit.
pub(super) enum Settled {
    /// It committed: whether events were left pending, and whether waiting
    /// workers are to be woken (as the commit's own answer would have).
    Committed { pending: bool, wake: bool },
    /// It did not: run the transaction the usual way.
    NotCommitted,
    /// The row cannot tell (it is gone, or changed again since): the lost
    /// connection's error is the answer.
    Unknown,
}

/// Why a speculative commit wrote nothing.
pub(super) enum Refusal {
    /// The server refused it (a guard) or the run needs reads: the usual way.
    Usual,
    /// A statement failed: nothing committed; the usual error.
    Failed(Error),
    /// The connection was lost: it may have committed.
    Lost(Box<Lost>),
}

impl PgEngine {
    /// Runs `f` speculatively for the one item `key` (see the module docs), on
    /// `client`, if this handle kept the version its claim committed.
    pub(super) fn speculate<T>(
        &self,
        client: &mut Conn,
        now: DateTime<Utc>,
        defaults: &Settings,
        key: &str,
        f: &mut impl FnMut(&mut PgTxn<'_, '_>) -> Result<T>,
    ) -> Result<Speculated<T>> {
        let Some((item, revision)) = self.known.take(key) else {
            return Ok(Speculated::Usual);
        };
        let Some(seen) = self.known.seen() else {
            return Ok(Speculated::Usual);
        };
        let settings = defaults.with_stored(&seen.stored);
        let mut txn = PgTxn::speculating(self, client.begin(), item, revision, now, settings);
        // An error of the rule's may come of the version it was given (or of
        // a read refused): the usual run decides with the row it reads.
        let Ok(value) = f(&mut txn) else {
            return Ok(Speculated::Usual);
        };
        if txn.needed_reads() || !txn.changed() {
            return Ok(Speculated::Usual);
        }
        match txn.commit_speculating(seen.doc.as_deref()) {
            Ok(pending) => Ok(Speculated::Committed(value, pending)),
            Err(Refusal::Usual) => Ok(Speculated::Usual),
            Err(Refusal::Failed(e)) => Err(e),
            Err(Refusal::Lost(lost)) => Ok(Speculated::Lost(value, *lost)),
        }
    }

    /// Settles a speculative commit whose connection was lost, by reading its
    /// item in `txn`, the usual run of the same transaction on another
    /// connection, once it is open: under the writers' gate and the key's
    /// lock, with the row locked. Only there can the answer be trusted: the
    /// server may not have noticed the loss yet, and a session of the lost
    /// connection may still be waiting on a lock with the whole pipeline,
    /// its `COMMIT` included, in hand. That session holds the key's lock
    /// from its first statement to its end, so the usual run reads the row
    /// after it committed or rolled back; and a pipeline the server has yet
    /// to run finds the row the usual run leaves, past the revision its
    /// write expects, and commits nothing. Read on a connection of its own,
    /// without the locks, the row was found at the claim's revision and
    /// the late commit then landed before the usual run locked it, which
    /// took its own record for a lost claim's and recorded the send twice
    /// (as sent, then as a late delivery).
    ///
    /// Committed, not committed (the usual run goes on, in `txn`), or
    /// [`Settled::Unknown`] when the row cannot tell (it changed again
    /// since).
    ///
    /// # Errors
    /// [`Error::Database`] (the read failed).
    pub(super) fn settle(&self, txn: &mut PgTxn<'_, '_>, lost: &Lost) -> Result<Settled> {
        let row = txn
            .tx
            .query_opt(
                &format!(
                    "SELECT revision, doc FROM {}.items WHERE idempotency_key = $1",
                    self.s
                ),
                &[&lost.key],
            )
            .map_err(db("read an item again after a lost commit"))?;
        let Some(row) = row else {
            return Ok(Settled::Unknown);
        };
        let revision: i64 = row.get(0);
        let doc: &str = row.get(1);
        let revision = u64::try_from(revision).unwrap_or(0);
        Ok(if revision == lost.revision {
            Settled::NotCommitted
        } else if revision == lost.revision + 1 && doc == lost.doc {
            Settled::Committed {
                pending: lost.pending,
                wake: lost.wake,
            }
        } else if revision == lost.revision + 1 {
            // Someone else's write followed the claim's version: ours, which
            // expected that version, cannot have committed.
            Settled::NotCommitted
        } else {
            Settled::Unknown
        })
    }
}

impl Lost {
    /// The error the lost connection gave (what a commit whose outcome
    /// cannot be told reports).
    pub(super) fn into_error(self) -> Error {
        self.error
    }
}

impl PgTxn<'_, '_> {
    /// Commits a speculative run in one round trip (see the module docs):
    /// whether events were left pending, or why nothing was written.
    pub(super) fn commit_speculating(
        mut self,
        settings_doc: Option<&str>,
    ) -> std::result::Result<bool, Refusal> {
        let failed = |e: Error| Refusal::Failed(e);
        // Exactly the one item, changed.
        let (Some((key, item)), 1) = (self.overlay.iter().next(), self.overlay.len()) else {
            return Err(Refusal::Usual);
        };
        let (key, item) = (key.clone(), item.clone());
        let Some(Some((before, revision))) = self.base.get(&key).cloned() else {
            return Err(Refusal::Usual);
        };
        let engine = self.engine;
        let docs = super::pending_docs(&self.events).map_err(failed)?;
        let write = ItemWrite::new(&item, Expect::Revision(revision), Some(&before));
        // The version's place in line: with the revision, what names it.
        let Some(seq) = before.seq.and_then(|seq| i64::try_from(seq).ok()) else {
            return Err(Refusal::Usual);
        };
        let (write_sql, write_params, op) = write.guarded_statement(&engine.s, &docs, &seq);
        let guard = guard_sql(&engine.s);
        let gate = lock_key(&engine.schema, "writers");
        let key_lock = lock_key(&engine.schema, &format!("key:{key}"));
        let guard_params: [&(dyn postgres::types::ToSql + Sync); 3] =
            [&gate, &key_lock, &settings_doc];
        let steps = [
            Step::QueryOne(&guard, &guard_params),
            Step::QueryOne(&write_sql, &write_params),
            Step::Simple("COMMIT"),
        ];
        let ops = ["pass the writers' gate", op, "commit"];
        let lost = |error: Error| Lost {
            error,
            key: key.clone(),
            revision,
            doc: write.doc().to_owned(),
            pending: !docs.is_empty(),
            wake: item.state == ItemState::Queued && item.claim.is_none(),
        };
        // A test's stand-in for a connection lost before anything was sent.
        if let Err(e) = engine.faults.check("postgres.speculation_lost_unsent") {
            return Err(Refusal::Lost(Box::new(lost(Error::io(
                engine.place(),
                "commit",
                e,
            )))));
        }
        let results = match self.tx.pipeline_each(&steps) {
            Ok(results) => results,
            Err(e) => {
                let closed = self.tx.is_closed();
                let error = db("commit")(e);
                return Err(if closed {
                    Refusal::Lost(Box::new(lost(error)))
                } else {
                    Refusal::Failed(error)
                });
            }
        };
        for (result, op) in results.into_iter().zip(ops) {
            if let Err(e) = result {
                if self.tx.is_closed() {
                    return Err(Refusal::Lost(Box::new(lost(db(op)(e)))));
                }
                let error = db(op)(e);
                // A failed guard: the transaction is aborted (the `COMMIT`
                // was skipped) and rolled back as this run's `PgTxn` drops.
                if error.sqlstate() == Some(REFUSED) {
                    return Err(Refusal::Usual);
                }
                return Err(Refusal::Failed(error));
            }
        }
        self.tx.mark_ended();
        // A test's stand-in for a connection lost with the answer to a
        // `COMMIT` the server carried out.
        if let Err(e) = engine.faults.check("postgres.speculation_lost_committed") {
            return Err(Refusal::Lost(Box::new(lost(Error::io(
                engine.place(),
                "commit",
                e,
            )))));
        }
        let overlay = std::mem::take(&mut self.overlay);
        self.after_commit(&overlay, &[(&key, revision + 1)]);
        Ok(!docs.is_empty())
    }
}
