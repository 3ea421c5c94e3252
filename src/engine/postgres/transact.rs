//! Running a transaction of the rules ([`PgTxn`](super::PgTxn)): the
//! writers' gate, the opening pipeline (gate, key lock, settings, owner
//! probe, the item's row), retries of aborted attempts, and the best-effort
//! sealing after the commit.

use std::sync::atomic::{AtomicU64, Ordering};

use chrono::{DateTime, Utc};
use postgres::types::ToSql;

use super::conn::{self, Conn, Row, Step, Tx};
use super::connect::STALE_RERUNS;
use super::speculate::{Known, Lost, Settled, Speculated};
use super::{PgEngine, PgTxn, db, lock_key, retry, txn};
use crate::error::{Error, Result};
use crate::rules::txn::Wait;
use crate::settings::{Settings, Stored};

/// What [`PgEngine::open_txn`] found.
pub(crate) struct Opened {
    /// The stored settings.
    pub(crate) stored: Stored,
    /// The item's row, locked (one-item transactions; `None`: no row).
    pub(crate) row: Option<Row>,
    /// Whether this handle's owner lock is held.
    pub(crate) owner_held: bool,
    /// For an enqueue ([`txn::Scope::Enqueue`]): its destination, and the
    /// place in its line taken under the destination's lock (shared).
    pub(crate) seq: Option<(String, i64)>,
    /// For a decision about an item whose destination this handle knows:
    /// that destination's line, read under its lock (exclusive).
    pub(crate) line: Option<txn::Prefetched>,
}

/// Takes a destination's lock exclusive (parameter `$1`: its key), as
/// `txn::DestLock::Exclusive` does, only if the item (`$2`) is queued,
/// unclaimed and in that destination (`$3`), in schema `s`: what the handle
/// remembers of the item may be stale (another host claimed, sent or
/// cancelled it; retention removed it and the key came back for another
/// destination), and a decision takes no destination's lock but its
/// item's, in the lock order's place, nor one its rule will not read. The
/// item's row is locked by the statement before: it cannot change meanwhile.
fn dest_lock_if_sql(s: &str) -> String {
    format!(
        "SELECT pg_advisory_xact_lock($1) FROM {s}.items
         WHERE idempotency_key = $2 AND destination = $3 AND state = 'queued' AND NOT claimed"
    )
}

/// The operation a failure of the gate's statement is named by.
const GATE: &str = "pass the writers' gate";

/// The gate's statement of a transaction that runs alone among writers
/// (parameters: the writers' gate, the owner's lock; see
/// [`PgEngine::open_txn`]).
fn exclusive_gate_sql(s: &str) -> String {
    format!(
        "SELECT (SELECT doc FROM {s}.settings WHERE id = 1),
           pg_try_advisory_xact_lock_shared($2)
         FROM (SELECT pg_advisory_xact_lock($1)) gate"
    )
}

/// A decision's line read ahead (see [`PgEngine::open_txn`]).
struct Ahead {
    /// The item's key.
    key: String,
    destination: String,
    /// The destination's lock key.
    lock: i64,
    read: txn::LineRead,
}

impl Ahead {
    /// The line read, from the opening pipeline's `results` after the
    /// enqueue's: the lock's statement, then the line's row. `None` when the
    /// lock was not taken (the item is not queued and unclaimed in that
    /// destination): the line's row, read without it, is dropped, and what
    /// `known` remembered of the item forgotten.
    fn read_from(
        self,
        results: &mut impl Iterator<Item = conn::Done>,
        known: &Known,
    ) -> Result<Option<txn::Prefetched>> {
        let locked = results.next().is_some_and(|done| done.count == 1);
        let line = results.next().and_then(|mut done| done.rows.pop());
        if !locked {
            // Stale: the next decision about the item opens without it.
            known.forget_destination(&self.key);
            return Ok(None);
        }
        let Some(row) = line else {
            return Err(Error::Database {
                op: "read a destination's line",
                source: "the line's statement returned no row".into(),
            });
        };
        Ok(Some(txn::Prefetched {
            destination: self.destination,
            since: self.read.since,
            offset: self.read.offset,
            row,
        }))
    }
}

/// Runs `steps` as one pipeline in `tx`; the first error is named by its
/// step's operation.
pub(super) fn run_named(
    tx: &mut Tx<'_>,
    steps: &[(Step<'_>, &'static str)],
) -> Result<Vec<conn::Done>> {
    let plain: Vec<Step<'_>> = steps.iter().map(|(step, _)| *step).collect();
    let results = tx.pipeline_each(&plain).map_err(db("run statements"))?;
    let mut out = Vec::with_capacity(results.len());
    for (result, (_, op)) in results.into_iter().zip(steps) {
        out.push(result.map_err(db(op))?);
    }
    Ok(out)
}

impl PgEngine {
    /// Passes the writers' gate in `tx` (see [`txn`]): shared for a one-item
    /// transaction, exclusive for every other writer.
    pub(super) fn pass_gate(&self, tx: &mut Tx<'_>, scope: txn::Scope<'_>) -> Result<()> {
        let sql = match scope {
            txn::Scope::OneItem(_)
            | txn::Scope::Enqueue(..)
            | txn::Scope::AfterSend(_)
            | txn::Scope::Decide(_) => "SELECT pg_advisory_xact_lock_shared($1)",
            txn::Scope::Any => "SELECT pg_advisory_xact_lock($1)",
        };
        tx.execute(sql, &[&lock_key(&self.schema, "writers")])
            .map_err(db("pass the writers' gate"))?;
        Ok(())
    }

    /// Opens a transaction of the rules in `tx`, in one round trip (one
    /// pipeline: `BEGIN`, then the statements below, each after the one
    /// before and with its own snapshot):
    ///
    /// 1. pass the writers' gate (see [`pass_gate`](Self::pass_gate)); for a
    ///    one-item transaction also lock the item's key (no enqueue of it can
    ///    be under way unseen, see `txn`); read the stored settings (as of the
    ///    statement's start: a change committed while this transaction waited
    ///    at the gate is seen from its next transaction on); and probe this
    ///    handle's own owner lock: a shared try-lock on the owner's key fails
    ///    while the owner session holds it, and succeeds once that session
    ///    is gone (a cut, a server restart);
    /// 2. for a one-item transaction, read the item's row `FOR UPDATE`: a
    ///    statement of its own, so its snapshot is taken once the gate and
    ///    the key's lock were granted (a row an enqueue of the key committed
    ///    meanwhile is seen);
    /// 3. for an enqueue, take the destination's lock shared and a place in
    ///    its line, as `PgTxn::next_seq` would, one round trip earlier (in
    ///    the lock order: after the item's row). An enqueue that finds its
    ///    key taken leaves the place unused, a gap the line skips.
    ///
    /// 4. for a decision ([`txn::Scope::Decide`]) about an item this
    ///    handle knows the destination of (one it enqueued, see
    ///    [`speculate::Known`](super::speculate::Known)), take that
    ///    destination's lock exclusive and read its line, head included, as
    ///    the decision's first line read would, one round trip earlier (in
    ///    the lock order: after the item's row). The lock is taken only if
    ///    the item is queued and unclaimed in that destination (a statement
    ///    that also reads the row, locked by the one before): else what the
    ///    handle knew is stale, forgotten, and the line's row dropped, so a
    ///    decision never holds another destination's lock than its item's
    ///    (two, taken in any order, could wait for each other in a cycle),
    ///    nor one its rule does not need. The read is made with the
    ///    settings the handle's last transaction read, at `now`; the
    ///    decision uses it only if it would read the same (see
    ///    `PgTxn::read_line`), and reads again otherwise, the lock held.
    ///
    /// Returns the stored settings, the item's row (one-item transactions),
    /// whether the owner lock is held, the enqueue's place in line and the
    /// line read ahead.
    pub(crate) fn open_txn(
        &self,
        tx: &mut Tx<'_>,
        scope: txn::Scope<'_>,
        now: DateTime<Utc>,
        defaults: &Settings,
    ) -> Result<Opened> {
        let s = &self.s;
        let gate = lock_key(&self.schema, "writers");
        let owner = lock_key(&self.schema, &self.owner);
        let enqueue_to = match scope {
            txn::Scope::Enqueue(_, destination) => Some(destination),
            _ => None,
        };
        // A decision's line, read ahead when the destination is known (a
        // requeue or cancel, `Scope::OneItem`, reads no line: it takes no
        // destination lock, or the shared one of its sequence).
        let ahead = match scope {
            txn::Scope::Decide(key) => self.line_ahead(key, now, defaults),
            _ => None,
        };
        let results = if let Some(key) = scope.item_key() {
            let key_lock = lock_key(&self.schema, &format!("key:{key}"));
            let gate_sql = format!(
                    "SELECT (SELECT doc FROM {s}.settings WHERE id = 1),
                       pg_try_advisory_xact_lock_shared($3)
                     FROM (SELECT pg_advisory_xact_lock_shared($1), pg_advisory_xact_lock($2)) gate"
                );
            let row_sql = txn::select_for_update_sql(s);
            let dest_lock = enqueue_to
                .map(|destination| lock_key(&self.schema, &format!("dest:{destination}")));
            let seq_sql = txn::next_seq_sql(s, true);
            let gate_params: [&(dyn ToSql + Sync); 3] = [&gate, &key_lock, &owner];
            let row_params: [&(dyn ToSql + Sync); 1] = [&key];
            let mut steps = vec![
                (Step::QueryOne(&gate_sql, &gate_params), GATE),
                (Step::QueryOpt(&row_sql, &row_params), "read an item"),
            ];
            let seq_params: Vec<&(dyn ToSql + Sync)> =
                dest_lock.iter().map(|l| l as &(dyn ToSql + Sync)).collect();
            if dest_lock.is_some() {
                steps.push((
                    Step::QueryOne(&seq_sql, &seq_params),
                    "take an enqueue sequence",
                ));
            }
            let no_keys: Vec<String> = Vec::new();
            let line_params: Vec<&(dyn ToSql + Sync)>;
            let line_lock: [&(dyn ToSql + Sync); 3];
            let line_lock_sql: String;
            if let Some(ahead) = &ahead {
                line_lock_sql = dest_lock_if_sql(s);
                line_lock = [&ahead.lock, &key, &ahead.destination];
                line_params = vec![
                    &ahead.destination,
                    &no_keys,
                    &ahead.read.since,
                    &ahead.read.offset,
                ];
                steps.push((
                    Step::Execute(&line_lock_sql, &line_lock),
                    "lock a destination",
                ));
                steps.push((
                    Step::QueryOne(&ahead.read.line_sql, &line_params),
                    "read a destination's line",
                ));
            }
            run_named(tx, &steps)?
        } else {
            let gate_sql = exclusive_gate_sql(s);
            tx.pipeline(&[Step::QueryOne(&gate_sql, &[&gate, &owner])])
                .map_err(db(GATE))?
        };
        let mut results = results.into_iter();
        let gate_row = results.next().and_then(|mut done| done.rows.pop());
        let Some(gate_row) = gate_row else {
            return Err(Error::Database {
                op: "pass the writers' gate",
                source: "the gate's statement returned no row".into(),
            });
        };
        let stored = self
            .known
            .stored_settings(gate_row.get(0), |doc| self.stored_of(doc))?;
        let owner_free: bool = gate_row.get(1);
        let row = results.next().and_then(|mut done| done.rows.pop());
        let seq = match enqueue_to {
            Some(destination) => {
                let Some(seq_row) = results.next().and_then(|mut done| done.rows.pop()) else {
                    return Err(Error::Database {
                        op: "take an enqueue sequence",
                        source: "the sequence's statement returned no row".into(),
                    });
                };
                Some((destination.to_owned(), seq_row.get(0)))
            }
            None => None,
        };
        let line = ahead
            .map(|ahead| ahead.read_from(&mut results, &self.known))
            .transpose()?
            .flatten();
        Ok(Opened {
            stored,
            row,
            owner_held: !owner_free,
            seq,
            line,
        })
    }

    /// The line read a decision about `key` may make as it opens: when this
    /// handle knows the item's destination and the stored settings, the read
    /// its first line read would make with them at `now`.
    fn line_ahead(&self, key: &str, now: DateTime<Utc>, defaults: &Settings) -> Option<Ahead> {
        let destination = self.known.destination_of(key)?;
        let settings = defaults.with_stored(&self.known.seen_stored()?);
        Some(Ahead {
            key: key.to_owned(),
            lock: lock_key(&self.schema, &format!("dest:{destination}")),
            read: txn::LineRead::new(&self.s, &destination, &settings, now, true),
            destination,
        })
    }

    /// Runs one read-modify-write of the rules (see [`PgTxn`]) and commits it,
    /// on a connection of the cap waited for as `wait` says (see
    /// [`PgEngine::client_waiting`]). Returns `f`'s value once the commit is
    /// durable; on any error nothing of it is visible.
    ///
    /// A transaction the server aborts to break a deadlock or a serialization
    /// conflict is run again from the start, `f` included, up to
    /// [`retry::ATTEMPTS`] times, at the same `now` (see [`retry`]): `f` must
    /// undo, or be able to repeat, whatever it does outside the transaction.
    ///
    /// Then, best effort (a failure is logged: the next reader seals), it
    /// seals the events it committed, unless another sealer holds the head,
    /// and wakes waiting workers when an item became claimable.
    pub(crate) fn transact_waiting<T>(
        &self,
        now: DateTime<Utc>,
        defaults: &Settings,
        scope: txn::Scope<'_>,
        wait: Wait,
        mut f: impl FnMut(&mut PgTxn<'_, '_>) -> Result<T>,
    ) -> Result<T> {
        // A speculative commit whose connection was lost, with `f`'s value:
        // every attempt settles it before it decides (a retried one too: its
        // late `COMMIT` may still land while an aborted attempt waits).
        let mut lost = None;
        retry::retrying("the rules' transaction", |_| {
            self.transact_once(now, defaults, scope, wait, &mut f, &mut lost)
        })
    }

    /// [`transact_waiting`](Self::transact_waiting) with the bounded wait
    /// of any call ([`Wait::Bounded`]).
    #[cfg(test)]
    pub(crate) fn transact<T>(
        &self,
        now: DateTime<Utc>,
        defaults: &Settings,
        scope: txn::Scope<'_>,
        f: impl FnMut(&mut PgTxn<'_, '_>) -> Result<T>,
    ) -> Result<T> {
        self.transact_waiting(now, defaults, scope, Wait::Bounded, f)
    }

    /// One attempt of [`transact_waiting`](Self::transact_waiting).
    fn transact_once<T>(
        &self,
        now: DateTime<Utc>,
        defaults: &Settings,
        scope: txn::Scope<'_>,
        wait: Wait,
        f: &mut impl FnMut(&mut PgTxn<'_, '_>) -> Result<T>,
        lost: &mut Option<(T, Lost)>,
    ) -> Result<T> {
        let mut client = self.client_waiting(wait)?;
        let running = Running::enter(&self.in_txn);
        if let (txn::Scope::AfterSend(key), None) = (scope, &lost) {
            match self.speculate(&mut client, now, defaults, key, f) {
                Ok(Speculated::Committed(value, pending)) => {
                    let others = running.leave();
                    self.after_txn(&mut client, pending, others);
                    return Ok(value);
                }
                Ok(Speculated::Usual) => {}
                Ok(Speculated::Lost(value, gone)) => {
                    // Settled by the usual run, on a fresh connection (see
                    // `PgEngine::settle`); the dead one's slot is freed
                    // first (see the stale reruns below).
                    *lost = Some((value, gone));
                    drop(client);
                    client = self.client_waiting(wait)?;
                }
                Err(e) => {
                    // Nothing committed; sealing goes on as after any
                    // transaction (other calls' events may be waiting).
                    let others = running.leave();
                    self.after_txn(&mut client, false, others);
                    return Err(e);
                }
            }
        }
        let settling = lost.as_ref().map(|(_, gone)| gone);
        // A pooled connection found dead by the opening pipeline (nothing of
        // the transaction can have committed, `f` has not run): run it again
        // on the next one (see `connect`).
        let mut reruns = 0;
        let outcome = loop {
            let mut opened = false;
            match self.run_txn(
                &mut client,
                now,
                defaults,
                scope,
                settling,
                &mut opened,
                &mut *f,
            ) {
                Err(e) if !opened && client.is_closed() && reruns < STALE_RERUNS => {
                    reruns += 1;
                    tracing::info!(
                        schema = %self.schema,
                        error = %e,
                        "a pooled connection was closed before the transaction began \
                         (server restart or terminated session); running it on another"
                    );
                    // The dead connection's slot is freed before the next
                    // is taken: under the cap, callers each holding a dead
                    // one while waiting for a fresh one could wait for ever.
                    drop(client);
                    client = self.client_waiting(wait)?;
                }
                done => break done,
            }
        };
        let others = running.leave();
        let pending = match &outcome {
            Ok(Ran::Done(_, pending) | Ran::Settled(Settled::Committed { pending, .. })) => {
                *pending
            }
            _ => false,
        };
        self.after_txn(&mut client, pending, others);
        match outcome? {
            Ran::Done(value, _) => Ok(value),
            Ran::Settled(settled) => {
                let Some((value, gone)) = lost.take() else {
                    unreachable!("only a lost commit is settled")
                };
                match settled {
                    Settled::Committed { wake, .. } => {
                        // As the commit's own answer would have.
                        if wake {
                            self.wake.request();
                        }
                        Ok(value)
                    }
                    Settled::NotCommitted | Settled::Unknown => Err(gone.into_error()),
                }
            }
        }
    }

    /// [`transact_waiting`](Self::transact_waiting)'s transaction: `f`'s value, and whether
    /// the commit left audit events pending. `opened` is set once the
    /// transaction's opening pipeline succeeded, before `f` runs.
    ///
    /// With `settling`, a speculative commit whose connection was lost, the
    /// item is read again first, under the opening's locks (see
    /// [`PgEngine::settle`]): unless it tells that nothing was committed,
    /// the transaction is rolled back and what it told returned.
    #[allow(
        clippy::too_many_arguments,
        reason = "one attempt's inputs, all passed on from `transact_once`"
    )]
    fn run_txn<T>(
        &self,
        client: &mut Conn,
        now: DateTime<Utc>,
        defaults: &Settings,
        scope: txn::Scope<'_>,
        settling: Option<&Lost>,
        opened: &mut bool,
        f: impl FnOnce(&mut PgTxn<'_, '_>) -> Result<T>,
    ) -> Result<Ran<T>> {
        // A claim must name an owner whose lock is held: the transaction's
        // first statement probes it (see `open_txn`); after a cut or a
        // restart it is taken again here, and the transaction begun anew.
        let mut retaken = false;
        let mut txn = loop {
            match PgTxn::begin(self, client.begin(), scope, now, defaults)? {
                Some(txn) => break txn,
                None if !retaken => {
                    self.ensure_owner()?;
                    retaken = true;
                }
                None => {
                    return Err(Error::SessionLocksUnavailable {
                        reason: format!(
                            "owner lock {} is not held by this handle's owner session after \
                             taking it again",
                            self.owner
                        ),
                    });
                }
            }
        };
        *opened = true;
        if let Some(lost) = settling {
            match self.settle(&mut txn, lost)? {
                Settled::NotCommitted => {}
                // Rolled back as `txn` drops.
                settled => return Ok(Ran::Settled(settled)),
            }
        }
        let value = f(&mut txn)?;
        let committed = txn.commit()?;
        Ok(Ran::Done(value, committed.pending))
    }
}

/// How [`PgEngine::run_txn`] ended.
enum Ran<T> {
    /// Committed (or nothing to commit): `f`'s value, and whether events
    /// were left pending.
    Done(T, bool),
    /// A lost speculative commit was settled as committed, or found
    /// impossible to tell, before `f` ran (rolled back).
    Settled(Settled),
}

/// One transaction of the rules counted among the handle's running ones
/// (`PgEngine::in_txn`) for as long as this lives: it leaves the count when
/// the transaction ends, and also when a panic (a bug in a rule, or in code it
/// calls) unwinds through it. A count left raised would make the handle
/// believe a transaction still runs for ever, so each later call would leave
/// its commit's events pending for another call to seal, until `SEAL_EVERY`
/// of them wait (see `PgEngine::after_txn`).
struct Running<'a> {
    count: &'a AtomicU64,
    left: bool,
}

impl<'a> Running<'a> {
    fn enter(count: &'a AtomicU64) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Self { count, left: false }
    }

    /// Leaves the count; returns how many other transactions of the handle
    /// are still running.
    fn leave(mut self) -> u64 {
        self.left = true;
        self.count.fetch_sub(1, Ordering::SeqCst) - 1
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        if !self.left {
            self.count.fetch_sub(1, Ordering::SeqCst);
        }
    }
}
