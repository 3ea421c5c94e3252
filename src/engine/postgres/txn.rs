//! One read-modify-write of the delivery rules on PostgreSQL: one SQL
//! transaction.
//!
//! Locks, always in this order, so two transactions never wait for each other
//! in a cycle:
//!
//! 1. **The writers' gate** (`pg_advisory_xact_lock` on the schema's `writers`
//!    key), first. A transaction about one item ([`Scope::OneItem`],
//!    [`Scope::Enqueue`], [`Scope::Decide`], [`Scope::AfterSend`]: enqueue,
//!    decide, finish, release, abandon, requeue or cancel of one key) takes
//!    it *shared*, so any number of them run at
//!    once; every other writer (a drain step, `enqueue_many`, a bulk action,
//!    retention and stored settings) takes it *exclusive* and runs alone, so
//!    it may lock many rows in any order.
//! 2. **The item**: its row `FOR UPDATE` on first touch; for a key with no row
//!    yet (an enqueue), first a transaction advisory lock on the key, so two
//!    enqueues of one key run one after the other and the second sees the first.
//! 3. **The destination** (an advisory lock on `dest:<destination>`,
//!    one-item transactions only), in one of two modes ([`DestLock`]):
//!    *shared* to take an enqueue sequence for it ([`PgTxn::next_seq`]: an
//!    enqueue, a requeue), *exclusive* before its line is read
//!    ([`PgTxn::head_of`]) or its send times and cooldown are read (a
//!    claim's decision, a pace learned at a finish). Enqueues of one
//!    destination run side by side; a decision that reads the line waits
//!    until every sequence taken for it has committed or rolled back, and
//!    a sequence taken after it is larger than every one it read, so it never
//!    passes over a sequence taken but not yet committed; decisions run one
//!    at a time per destination, so its cap holds across hosts. A claim's
//!    decision ([`Scope::Decide`]) may take it exclusive in its opening,
//!    after the row, if its item is queued and unclaimed there (see
//!    `PgEngine::open_txn`); no other transaction does. (Why the
//!    shared mode is enough for what an enqueue writes: ARCHITECTURE.md,
//!    "the destination's lock".)
//! 4. **The caps lock** (`caps`, exclusive), before the send times of every
//!    destination are read (a global cap).
//! 5. **Dead owners**: probing an owner with
//!    `pg_try_advisory_xact_lock_shared` keeps a dead owner's key locked
//!    until the transaction ends (never waits). Shared, so the owner's own
//!    probe (shared too, see `PgEngine::open_txn`) still finds its lock free
//!    while other hosts settle its claims, and takes it again (waiting for
//!    them) before a claim names it; an exclusive probe made it fail, and
//!    the owner claimed with its lock free.
//!
//! A one-item transaction locks its one item, then at most its destination,
//! then the caps: a one-item transaction holding a later lock never waits for
//! an earlier one.
//!
//! **No audit head here.** A transaction does not touch the chain's head: the
//! events it seals are written to `audit_pending` in its `COMMIT` (durable
//! with the item change, atomically), ordered by the table's sequence, taken
//! at that write, after every row lock. Right after the commit the handle
//! seals them onto the chain in a short transaction of its own
//! ([`PgEngine::seal_pending`](super::PgEngine::seal_pending)); so the head row
//! is held only for sealing, never through an item transaction's `COMMIT`, and
//! PostgreSQL can group the commits of concurrent writers into one WAL flush.
//!
//! Changes go to an overlay; [`PgTxn::commit`] writes the overlay and the
//! pending events in the one `COMMIT`; once it succeeded, a commit that made
//! an item claimable requests a wake-up from the handle's sender thread,
//! which sends the `NOTIFY`s, coalesced, on a connection of its own (see
//! [`notify`](super::notify): a `NOTIFY` inside the transaction would
//! serialise every such commit on PostgreSQL's notify queue lock, held
//! through the commit's WAL flush, and one after it on the same connection
//! costs a transaction per commit). A failed statement or a dropped
//! connection ends the transaction with [`Error::Database`] and nothing of it
//! is visible; a connection lost during `COMMIT` itself may or may not have
//! committed, as the error says.

use std::collections::{BTreeMap, HashMap, HashSet};

use chrono::{DateTime, Utc};

use super::conn::{Done, Step};
use super::{ItemWrite, PgEngine, db, lock_key, pending_docs, run_named};
use crate::audit::AuditEvent;
use crate::engine::Expect;
use crate::error::{Error, Result};
use crate::item::{ItemState, OutboxItem};
use crate::order::{self, OrderKey};
pub(crate) use crate::rules::txn::Scope;
use crate::settings::Settings;
use crate::store::rate_times;

/// How many due fronts one look at the candidates takes from the table.
pub(crate) const CANDIDATE_WINDOW: i64 = 64;

/// Reads and locks one item's row (parameter: its key), in schema `s`.
pub(crate) fn select_for_update_sql(s: &str) -> String {
    format!(
        "SELECT idempotency_key, revision, doc, seq FROM {s}.items
         WHERE idempotency_key = $1 FOR UPDATE"
    )
}

/// Takes the next enqueue sequence (`nextval` in the projection), with
/// `locked` after the destination's lock, shared, in its `FROM` (parameter:
/// the lock's key), so the sequence is taken once the lock is granted (a
/// sequence does not depend on the statement's snapshot).
pub(crate) fn next_seq_sql(s: &str, locked: bool) -> String {
    if locked {
        format!(
            "SELECT nextval('{s}.enqueue_seq') FROM (SELECT pg_advisory_xact_lock_shared($1)) l"
        )
    } else {
        format!("SELECT nextval('{s}.enqueue_seq')")
    }
}

/// A row read by this transaction: the item and its revision (`None`: absent).
type Base = Option<(OutboxItem, u64)>;

/// One transaction of the rules on PostgreSQL.
pub(crate) struct PgTxn<'e, 'c> {
    pub(super) engine: &'e PgEngine,
    pub(super) tx: super::conn::Tx<'c>,
    /// Rows as committed, locked by this transaction when read (while
    /// speculating, the one item's as this handle committed it, not read).
    pub(super) base: HashMap<String, Base>,
    /// Items changed by this transaction (whole new versions).
    pub(super) overlay: BTreeMap<String, OutboxItem>,
    /// Events sealed by the rule, in order: written as pending at commit.
    pub(super) events: Vec<AuditEvent>,
    /// The line of a decision's destination, read when the transaction
    /// opened (see [`PgEngine::open_txn`]), until a line read takes it.
    prefetched: Option<Prefetched>,
    /// Whether this is a speculative run (see [`speculate`](super::speculate)),
    /// which reads nothing from the server: a rule that asks for a read is
    /// refused it, and the transaction runs again the usual way.
    speculation: Speculation,
    /// A one-item transaction (see [`Scope::OneItem`]).
    one_item: bool,
    now: DateTime<Utc>,
    settings: Settings,
    caps_locked: bool,
    /// Destinations this transaction holds the lock of, and in which mode.
    destinations: HashMap<String, DestLock>,
    /// Keys this transaction holds the enqueue lock of.
    key_locked: HashSet<String>,
    /// Keys whose row this transaction locked (`FOR UPDATE`), or whose absent
    /// row it holds the key's lock for: no one else can change them before
    /// it ends, so their writes cannot miss (see [`commit`](Self::commit)).
    locked: HashSet<String>,
    /// An enqueue's place in line taken when the transaction opened (see
    /// [`PgEngine::open_txn`]): its destination and sequence, handed out by
    /// the first [`next_seq`](Self::next_seq) for that destination.
    seq_taken: Option<(String, i64)>,
    /// Destinations whose newest committed send times (with their items'
    /// keys) in the cap's window, and cooldown, this transaction read under
    /// the destination's lock (one-item transactions): no other one-item
    /// transaction decides there until this one ends, so they are read once.
    lines: HashMap<String, Line>,
}

/// Whether a transaction is a speculative run (see
/// [`speculate`](super::speculate)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Speculation {
    /// The usual run: reads as it goes.
    Off,
    /// A speculative run that has read nothing.
    On,
    /// A speculative run whose rule asked for a read (refused).
    ReadRefused,
}

/// How many of its newest committed times a line read takes: the newest
/// (what a pace and a cap of one ask for) and the two one item can hold (a
/// send or claim, and a possible send), which leave the count when the one
/// item of a one-item transaction changes. A larger cap's answer is read
/// whole on the server (`Line::nth`).
const LINE_NEWEST: i64 = 3;

/// How a one-item transaction holds its destination's lock (see the module
/// docs, lock 3). Ordered: an exclusive hold covers what a shared one does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum DestLock {
    /// Taken to hand out an enqueue sequence: other enqueues of the
    /// destination go on, decisions about it wait.
    Shared,
    /// Taken to read the line, send times or cooldown and decide by them:
    /// alone on the destination.
    Exclusive,
}

impl DestLock {
    /// The statement taking the lock in this mode (parameter: its key).
    fn sql(self) -> &'static str {
        match self {
            Self::Shared => "SELECT pg_advisory_xact_lock_shared($1)",
            Self::Exclusive => "SELECT pg_advisory_xact_lock($1)",
        }
    }
}

/// A read of a destination's line (see [`PgTxn::read_line`]): its
/// statements and the parameters that depend on the settings and the moment
/// (the others: the destination, then the keys the transaction changed).
pub(crate) struct LineRead {
    /// The head's query alone (parameters `$1`, `$2`).
    head_sql: String,
    /// The line's query, with the head when asked (parameters `$1`–`$4`).
    pub(crate) line_sql: String,
    /// Whether `line_sql` reads the head too.
    head: bool,
    /// The start of the cap's window (`$3`).
    pub(crate) since: DateTime<Utc>,
    /// The cap's count less one (`$4`).
    pub(crate) offset: i64,
    /// The cap's count.
    count: usize,
}

impl LineRead {
    /// The read of `destination`'s line in schema `s` under `settings` at
    /// `now`, with its head if `head`.
    pub(crate) fn new(
        s: &str,
        destination: &str,
        settings: &Settings,
        now: DateTime<Utc>,
        head: bool,
    ) -> Self {
        let rate = settings.rates.for_destination(destination);
        // The window of send times a decision reads: its cap's (the rules
        // read no further back, except a learned pace longer than the
        // window, which reads again).
        let since = crate::clock::earlier(now, rate.window);
        let head_sql = format!(
            "SELECT idempotency_key, revision, doc, seq FROM {s}.items
             WHERE destination = $1 AND state = 'queued'
               AND NOT (idempotency_key = ANY($2))
             ORDER BY seq, created_at, idempotency_key LIMIT 1"
        );
        // The window's newest times with their keys (two arrays in one
        // order, newest first), the cap's answer, and the cooldown.
        let line_parts = format!(
            "(SELECT array_agg(idempotency_key ORDER BY at DESC, idempotency_key) AS keys,
                     array_agg(at ORDER BY at DESC, idempotency_key) AS ats
              FROM (SELECT idempotency_key, at FROM {s}.rate_times
                    WHERE destination = $1 AND at >= $3
                    ORDER BY at DESC LIMIT {LINE_NEWEST}) r) t"
        );
        let nth = format!(
            "(SELECT at FROM {s}.rate_times
              WHERE destination = $1 AND at > $3 AND NOT (idempotency_key = ANY($2))
              ORDER BY at DESC OFFSET $4 LIMIT 1)"
        );
        let cooldown = format!("(SELECT until FROM {s}.cooldowns WHERE destination = $1)");
        let line_sql = if head {
            format!(
                "SELECT h.idempotency_key, h.revision, h.doc, h.seq, t.keys, t.ats, {cooldown}, {nth}
                 FROM {line_parts} LEFT JOIN LATERAL ({head_sql}) h ON true"
            )
        } else {
            format!(
                "SELECT NULL::text, NULL::bigint, NULL::text, NULL::bigint, t.keys, t.ats, {cooldown},
                   {nth}
                 FROM {line_parts}"
            )
        };
        Self {
            head_sql,
            line_sql,
            head,
            since,
            offset: i64::from(rate.count) - 1,
            count: rate.count as usize,
        }
    }
}

/// A destination's line read when a decision's transaction opened (see
/// [`PgEngine::open_txn`]), under the destination's lock, exclusive.
pub(crate) struct Prefetched {
    /// The destination.
    pub(crate) destination: String,
    /// The window's start and the cap's offset it was read with.
    pub(crate) since: DateTime<Utc>,
    pub(crate) offset: i64,
    /// Its row, as [`LineRead::line_sql`] with the head returns it.
    pub(crate) row: super::conn::Row,
}

/// What a one-item transaction read about a destination under its lock.
struct Line {
    /// The start of the cap's window: the times read are at or after it.
    since: DateTime<Utc>,
    /// The newest committed send and claim times at or after `since`, newest
    /// first, with their keys: at most [`LINE_NEWEST`], however many sends
    /// the window holds.
    newest: Vec<(String, DateTime<Utc>)>,
    /// Whether `newest` is every committed time at or after `since` (the
    /// read returned fewer than it asked for).
    complete: bool,
    /// The cap's answer as the server found it: the `count`-th newest
    /// committed time later than `since` (`None`: fewer are). Kept
    /// (`nth_kept`) when read while the transaction had changed nothing, so
    /// right while it still has not.
    nth: Option<DateTime<Utc>>,
    /// Whether `nth` was read while the transaction had changed nothing.
    nth_kept: bool,
    /// The cap's count `nth` answers for.
    count: usize,
    /// The destination's committed cooldown.
    cooldown: Option<DateTime<Utc>>,
}

impl Line {
    /// The `n` newest of the committed times later than `after` whose items
    /// `changed` does not hold (fewer when fewer are), if this line's read
    /// decides them: `None` when it may have stopped short of them.
    fn newest_after(
        &self,
        after: DateTime<Utc>,
        n: usize,
        changed: impl Fn(&str) -> bool,
    ) -> Option<Vec<DateTime<Utc>>> {
        if after < self.since {
            return None;
        }
        let mut out = Vec::with_capacity(n.min(self.newest.len()));
        for (key, at) in &self.newest {
            if *at <= after || out.len() == n {
                // Newest first: every time from here on is older, or
                // `n` are found.
                return Some(out);
            }
            if !changed(key) {
                out.push(*at);
            }
        }
        (self.complete || out.len() == n).then_some(out)
    }
}

impl<'e, 'c> PgTxn<'e, 'c> {
    /// Begins, in one round trip ([`PgEngine::open_txn`]): passes the
    /// writers' gate (shared for one item, exclusive for [`Scope::Any`]),
    /// reads the stored settings (laid over `defaults`, this handle's own
    /// values) and, for one item, reads and locks its row. `None` (rolled
    /// back) when this handle's owner lock was found free: take it again
    /// before anything names the owner.
    pub(crate) fn begin(
        engine: &'e PgEngine,
        mut tx: super::conn::Tx<'c>,
        scope: Scope<'_>,
        now: DateTime<Utc>,
        defaults: &Settings,
    ) -> Result<Option<Self>> {
        let opened = engine.open_txn(&mut tx, scope, now, defaults)?;
        if !opened.owner_held {
            return Ok(None);
        }
        let mut txn = Self {
            engine,
            tx,
            base: HashMap::new(),
            overlay: BTreeMap::new(),
            events: Vec::new(),
            one_item: scope.item_key().is_some(),
            now,
            settings: defaults.with_stored(&opened.stored),
            caps_locked: false,
            destinations: HashMap::new(),
            key_locked: HashSet::new(),
            locked: HashSet::new(),
            lines: HashMap::new(),
            seq_taken: None,
            speculation: Speculation::Off,
            prefetched: None,
        };
        if let Some(prefetched) = opened.line {
            // Read under the destination's lock, exclusive, held to the end.
            txn.destinations
                .insert(prefetched.destination.clone(), DestLock::Exclusive);
            txn.prefetched = Some(prefetched);
        }
        if let Some((destination, seq)) = opened.seq {
            // Taken under the destination's lock, shared, held to the end.
            txn.destinations
                .insert(destination.clone(), DestLock::Shared);
            txn.seq_taken = Some((destination, seq));
        }
        if let Some(key) = scope.item_key() {
            // The gate's statement locked the item's key, and the next one
            // read its row `FOR UPDATE`.
            txn.key_locked.insert(key.to_owned());
            txn.locked.insert(key.to_owned());
            let base = opened
                .row
                .map(|row| engine.versioned(&row))
                .transpose()?
                .map(|v| (v.item, v.revision));
            txn.base.insert(key.to_owned(), base);
        }
        Ok(Some(txn))
    }

    /// A speculative transaction about `item` (see
    /// [`speculate`](super::speculate)): its base is `item` at `revision`,
    /// as this handle committed it; nothing is sent before its commit.
    pub(super) fn speculating(
        engine: &'e PgEngine,
        tx: super::conn::Tx<'c>,
        item: OutboxItem,
        revision: u64,
        now: DateTime<Utc>,
        settings: Settings,
    ) -> Self {
        let key = item.idempotency_key.clone();
        Self {
            engine,
            tx,
            base: HashMap::from([(key, Some((item, revision)))]),
            overlay: BTreeMap::new(),
            events: Vec::new(),
            one_item: true,
            now,
            settings,
            caps_locked: false,
            destinations: HashMap::new(),
            key_locked: HashSet::new(),
            locked: HashSet::new(),
            seq_taken: None,
            lines: HashMap::new(),
            speculation: Speculation::On,
            prefetched: None,
        }
    }

    /// Whether this speculative run's rule asked for a read of the server.
    pub(super) fn needed_reads(&self) -> bool {
        self.speculation == Speculation::ReadRefused
    }

    /// Refuses a read of the server to a speculative run (which then runs
    /// again the usual way); lets any other transaction read.
    fn reads(&mut self) -> Result<()> {
        if self.speculation != Speculation::Off {
            self.speculation = Speculation::ReadRefused;
            return Err(Error::Database {
                op: "decide from the version this handle committed",
                source: "the rule needs a read: it runs again, reading".into(),
            });
        }
        Ok(())
    }

    /// Reads (and locks) the committed row of `key`, once per transaction.
    /// A key with no row yet is locked with a transaction advisory lock on
    /// the key and read again (one-item transactions: two enqueues of one
    /// key run one after the other, and the second sees the first's row).
    fn load(&mut self, key: &str) -> Result<()> {
        if self.overlay.contains_key(key) || self.base.contains_key(key) {
            return Ok(());
        }
        self.reads()?;
        let mut row = self.select_for_update(key)?;
        if row.is_some() {
            self.locked.insert(key.to_owned());
        }
        if row.is_none() && self.one_item && self.key_locked.insert(key.to_owned()) {
            self.tx
                .execute(
                    "SELECT pg_advisory_xact_lock($1)",
                    &[&lock_key(&self.engine.schema, &format!("key:{key}"))],
                )
                .map_err(db("lock a new key"))?;
            row = self.select_for_update(key)?;
            // Locked either way: the row, or the key no row has yet.
            self.locked.insert(key.to_owned());
        }
        let base = row
            .map(|row| self.engine.versioned(&row))
            .transpose()?
            .map(|v| (v.item, v.revision));
        self.base.insert(key.to_owned(), base);
        Ok(())
    }

    /// The committed row of `key`, locked `FOR UPDATE`.
    fn select_for_update(&mut self, key: &str) -> Result<Option<super::conn::Row>> {
        self.tx
            .query_opt(&select_for_update_sql(&self.engine.s), &[&key])
            .map_err(db("read an item"))
    }

    /// Whether this transaction must still take `destination`'s lock in
    /// `mode`: a one-item transaction that holds it in no mode, or only in a
    /// weaker one (a transaction of [`Scope::Any`] runs alone among writers
    /// and needs none).
    ///
    /// A shared hold made exclusive waits for the other shared holders, and
    /// two transactions doing that at once deadlock (the server aborts one,
    /// and `transact` runs it again). No rule does it: an enqueue and a
    /// requeue take a sequence and read no line; a decision reads the line
    /// and takes no sequence.
    fn needs_destination_lock(&self, destination: &str, mode: DestLock) -> bool {
        self.one_item
            && self
                .destinations
                .get(destination)
                .is_none_or(|held| *held < mode)
    }

    /// Takes `destination`'s lock exclusive once (one-item transactions; see
    /// [`needs_destination_lock`](Self::needs_destination_lock)).
    fn lock_destination(&mut self, destination: &str) -> Result<()> {
        if self.needs_destination_lock(destination, DestLock::Exclusive) {
            self.tx
                .execute(
                    DestLock::Exclusive.sql(),
                    &[&lock_key(
                        &self.engine.schema,
                        &format!("dest:{destination}"),
                    )],
                )
                .map_err(db("lock a destination"))?;
            self.destinations
                .insert(destination.to_owned(), DestLock::Exclusive);
        }
        Ok(())
    }

    /// Runs `steps` in one round trip, after taking `destination`'s lock
    /// exclusive if this one-item transaction does not hold it so yet (a
    /// statement of its own, in front: the steps' snapshots are taken once
    /// it is granted).
    fn after_destination_lock(
        &mut self,
        destination: &str,
        steps: &[(Step<'_>, &'static str)],
    ) -> Result<Vec<Done>> {
        let lock = self.needs_destination_lock(destination, DestLock::Exclusive);
        let key = lock_key(&self.engine.schema, &format!("dest:{destination}"));
        let params: [&(dyn postgres::types::ToSql + Sync); 1] = [&key];
        let mut all: Vec<(Step<'_>, &'static str)> = Vec::with_capacity(steps.len() + 1);
        if lock {
            all.push((
                Step::Execute(DestLock::Exclusive.sql(), &params),
                "lock a destination",
            ));
        }
        all.extend_from_slice(steps);
        let mut done = run_named(&mut self.tx, &all)?;
        if lock {
            self.destinations
                .insert(destination.to_owned(), DestLock::Exclusive);
            done.remove(0);
        }
        Ok(done)
    }

    /// Reads `destination`'s line under its lock (one-item transactions), in
    /// one round trip: with `head`, its head row (as [`head_of`](Self::head_of)
    /// reads it; returned), and, once per transaction, what its cap decides
    /// by (the cap's `count`-th newest committed time in its window, found
    /// on the server by the `(destination, at)` index from its newest end,
    /// which walks at most `count` entries and sends one), its
    /// [`LINE_NEWEST`] newest times with their keys, and its cooldown, kept
    /// for [`nth_newest_time`](Self::nth_newest_time),
    /// [`destination_times`](Self::destination_times) and
    /// [`destination_cooldown`](Self::destination_cooldown).
    ///
    /// What is read is read by one statement (after the lock's, so its
    /// snapshot holds every decision committed before the lock was granted):
    /// the head, the times and the cooldown as one row, not three statements.
    fn read_line(&mut self, destination: &str, head: bool) -> Result<Vec<super::conn::Row>> {
        let fetch = self.one_item && !self.lines.contains_key(destination);
        if !fetch && !head {
            return Ok(Vec::new());
        }
        let changed = self.changed_keys();
        let read = LineRead::new(&self.engine.s, destination, &self.settings, self.now, head);
        let prefetched = if fetch {
            self.take_prefetched(destination, &read, &changed)
        } else {
            None
        };
        if let Some(row) = prefetched {
            return Ok(self.absorb_line(destination, &read, row));
        }
        let params: [&(dyn postgres::types::ToSql + Sync); 4] =
            [&destination, &changed, &read.since, &read.offset];
        let step = if fetch {
            (
                Step::QueryOne(&read.line_sql, &params),
                "read a destination's line",
            )
        } else {
            (
                Step::Query(&read.head_sql, &params[..2]),
                "read a destination's head",
            )
        };
        let mut done = self
            .after_destination_lock(destination, &[step])?
            .into_iter();
        let mut rows = done.next().map(|d| d.rows).unwrap_or_default();
        if !fetch {
            return Ok(rows);
        }
        Ok(match rows.pop() {
            Some(row) => self.absorb_line(destination, &read, row),
            None => Vec::new(),
        })
    }

    /// The line of `destination` read when this transaction opened (see
    /// [`PgEngine::open_txn`]), if it answers `read` as a read now would:
    /// read for the same destination, window and cap, with nothing changed
    /// by this transaction since (`changed` is empty). Taken once.
    fn take_prefetched(
        &mut self,
        destination: &str,
        read: &LineRead,
        changed: &[String],
    ) -> Option<super::conn::Row> {
        let prefetched = self.prefetched.take()?;
        (prefetched.destination == destination
            && prefetched.since == read.since
            && prefetched.offset == read.offset
            && changed.is_empty())
        .then_some(prefetched.row)
    }

    /// Keeps what a line read's `row` says of `destination` (see
    /// [`read_line`](Self::read_line)); returns the head row, if the line
    /// has one and `read` asked for it.
    fn absorb_line(
        &mut self,
        destination: &str,
        read: &LineRead,
        row: super::conn::Row,
    ) -> Vec<super::conn::Row> {
        let keys: Vec<String> = row.get::<_, Option<Vec<String>>>(4).unwrap_or_default();
        let ats: Vec<DateTime<Utc>> = row
            .get::<_, Option<Vec<DateTime<Utc>>>>(5)
            .unwrap_or_default();
        let cooldown: Option<DateTime<Utc>> = row.get(6);
        let nth: Option<DateTime<Utc>> = row.get(7);
        let complete = i64::try_from(ats.len()).is_ok_and(|read| read < LINE_NEWEST);
        self.lines.insert(
            destination.to_owned(),
            Line {
                since: read.since,
                newest: keys.into_iter().zip(ats).collect(),
                complete,
                nth,
                nth_kept: self.overlay.is_empty(),
                count: read.count,
                cooldown,
            },
        );
        let has_head = read.head && row.get::<_, Option<&str>>(0).is_some();
        if has_head { vec![row] } else { Vec::new() }
    }

    /// Remembers rows read by a query of this transaction (not locked: a
    /// transaction that reads many rows runs alone among writers, and a
    /// one-item transaction reads its destination's line under the
    /// destination's lock; a decision locks its item through
    /// [`item_mut`](Self::item_mut)).
    fn remember(&mut self, rows: &[super::conn::Row]) -> Result<Vec<String>> {
        let mut keys = Vec::with_capacity(rows.len());
        for row in rows {
            let v = self.engine.versioned(row)?;
            let key = v.item.idempotency_key.clone();
            self.base
                .entry(key.clone())
                .or_insert(Some((v.item, v.revision)));
            keys.push(key);
        }
        Ok(keys)
    }

    /// How many send times this transaction read with `destination`'s line.
    #[cfg(test)]
    pub(crate) fn line_times_read(&self, destination: &str) -> Option<usize> {
        self.lines.get(destination).map(|line| line.newest.len())
    }

    /// The item with this key as this transaction sees it.
    ///
    /// # Errors
    /// [`Error::Database`]; [`Error::InvalidRecord`] for a damaged row.
    pub(crate) fn item(&mut self, key: &str) -> Result<Option<&OutboxItem>> {
        self.load(key)?;
        Ok(self.peek(key))
    }

    /// The item as this transaction sees it, among the rows read already.
    fn peek(&self, key: &str) -> Option<&OutboxItem> {
        self.overlay.get(key).or_else(|| {
            self.base
                .get(key)
                .and_then(|b| b.as_ref().map(|(item, _)| item))
        })
    }

    /// The item, to change it in this transaction.
    ///
    /// # Errors
    /// [`Error::NotFound`]; as [`item`](Self::item).
    pub(crate) fn item_mut(&mut self, key: &str) -> Result<&mut OutboxItem> {
        self.load(key)?;
        if !self.overlay.contains_key(key) {
            let item = self.peek(key).cloned().ok_or_else(|| Error::NotFound {
                key: key.to_owned(),
            })?;
            self.overlay.insert(key.to_owned(), item);
        }
        match self.overlay.get_mut(key) {
            Some(item) => Ok(item),
            None => unreachable!("inserted above"),
        }
    }

    /// Puts a whole item into the transaction (a new one, or a replacement).
    pub(crate) fn insert(&mut self, item: OutboxItem) {
        self.overlay.insert(item.idempotency_key.clone(), item);
    }

    /// The next enqueue sequence, from the schema's sequence: one order for
    /// every host. Taken under `destination`'s lock held *shared* (or
    /// exclusive, if this transaction holds it so already) until this
    /// transaction ends: enqueues of the destination take sequences side by
    /// side, and no decision reads the line (it needs the lock exclusive)
    /// while a smaller sequence may still appear in it.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub(crate) fn next_seq(&mut self, destination: &str) -> Result<u64> {
        let seq = match self.seq_taken.take() {
            // Taken when the transaction opened, under the same lock.
            Some((taken_for, seq)) if taken_for == destination => seq,
            other => {
                self.seq_taken = other;
                let lock = self.needs_destination_lock(destination, DestLock::Shared);
                let key = lock_key(&self.engine.schema, &format!("dest:{destination}"));
                // With the lock, one statement (see `next_seq_sql`).
                let sql = next_seq_sql(&self.engine.s, lock);
                let row = if lock {
                    self.tx.query_one(&sql, &[&key])
                } else {
                    self.tx.query_one(&sql, &[])
                }
                .map_err(db("take an enqueue sequence"))?;
                if lock {
                    self.destinations
                        .insert(destination.to_owned(), DestLock::Shared);
                }
                let seq: i64 = row.get(0);
                seq
            }
        };
        // A test's stand-in for a slow enqueue: the sequence is taken and
        // its commit still to come.
        self.engine
            .faults
            .check("postgres.enqueue_seq_taken")
            .map_err(|e| Error::io(self.engine.place(), "take an enqueue sequence", e))?;
        Ok(u64::try_from(seq).unwrap_or(0))
    }

    /// The keys changed by this transaction.
    fn changed_keys(&self) -> Vec<String> {
        self.overlay.keys().cloned().collect()
    }

    /// The place of `destination`'s head: its earliest queued item, as this
    /// transaction sees it.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub(crate) fn head_of(&mut self, destination: &str) -> Result<Option<OrderKey>> {
        let rows = self.read_line(destination, true)?;
        let keys = self.remember(&rows)?;
        let committed = keys
            .first()
            .and_then(|key| self.peek(key))
            .map(OrderKey::of);
        let pending = self
            .overlay
            .values()
            .filter(|i| i.destination == destination && i.state == ItemState::Queued)
            .map(OrderKey::of)
            .min();
        Ok(committed.into_iter().chain(pending).min())
    }

    /// The items to decide next, as `Txn::candidates` chooses them in the file
    /// engine: at most one per destination, claimed items first (a claim may
    /// be dead), then the items this transaction changed or made head, then
    /// up to [`CANDIDATE_WINDOW`] fronts due by now, earliest due first.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub(crate) fn candidates(
        &mut self,
        ordering: order::Ordering,
        admits: &mut dyn FnMut(&OutboxItem) -> bool,
    ) -> Result<Vec<(String, OrderKey)>> {
        let s = self.engine.s.clone();
        let changed = self.changed_keys();
        let claimed_rows = self
            .tx
            .query(
                &format!(
                    "SELECT idempotency_key, revision, doc, seq FROM {s}.items
                     WHERE claimed AND state = 'queued' AND NOT (idempotency_key = ANY($1))
                     ORDER BY seq, created_at, idempotency_key"
                ),
                &[&changed],
            )
            .map_err(db("read the claimed items"))?;
        let claimed = self.remember(&claimed_rows)?;
        // Fronts: under per-destination order each line's head (if unclaimed
        // and due); unordered, each destination's earliest-due unclaimed item.
        let fronts_sql = match ordering {
            order::Ordering::PerDestination => format!(
                "SELECT idempotency_key, revision, doc, seq FROM (
                   SELECT DISTINCT ON (destination) idempotency_key, revision, doc, seq,
                     claimed, next_attempt_at, created_at
                   FROM {s}.items WHERE state = 'queued' AND NOT (idempotency_key = ANY($1))
                   ORDER BY destination, seq, created_at, idempotency_key) h
                 WHERE NOT h.claimed AND (h.next_attempt_at IS NULL OR h.next_attempt_at <= $2)
                 ORDER BY h.next_attempt_at IS NOT NULL, COALESCE(h.next_attempt_at, h.created_at),
                   h.seq
                 LIMIT $3"
            ),
            order::Ordering::Unordered => format!(
                "SELECT idempotency_key, revision, doc, seq FROM (
                   SELECT DISTINCT ON (destination) idempotency_key, revision, doc, seq,
                     next_attempt_at, created_at
                   FROM {s}.items
                   WHERE state = 'queued' AND NOT claimed AND NOT (idempotency_key = ANY($1))
                     AND (next_attempt_at IS NULL OR next_attempt_at <= $2)
                   ORDER BY destination, next_attempt_at IS NOT NULL,
                     COALESCE(next_attempt_at, created_at), seq) f
                 ORDER BY f.next_attempt_at IS NOT NULL, COALESCE(f.next_attempt_at, f.created_at),
                   f.seq
                 LIMIT $3"
            ),
        };
        let front_rows = self
            .tx
            .query(&fronts_sql, &[&changed, &self.now, &CANDIDATE_WINDOW])
            .map_err(db("read the due items"))?;
        let fronts = self.remember(&front_rows)?;

        let mut places: Vec<OrderKey> = Vec::new();
        for key in &claimed {
            places.extend(self.peek(key).map(OrderKey::of));
        }
        let overlay: Vec<OutboxItem> = self.overlay.values().cloned().collect();
        for item in &overlay {
            if item.state == ItemState::Queued {
                places.push(OrderKey::of(item));
            }
            if let Some(head) = self.head_of(&item.destination)? {
                places.push(head);
            }
        }
        for key in &fronts {
            places.extend(self.peek(key).map(OrderKey::of));
        }
        let mut out: Vec<(String, OrderKey)> = Vec::new();
        let mut destinations: HashSet<String> = HashSet::new();
        for place in places {
            let Some(item) = self.peek(&place.key).cloned() else {
                continue;
            };
            let ready = item.state == ItemState::Queued
                && (item.claim.is_some() || item.next_attempt_at.is_none_or(|at| at <= self.now));
            if !ready || destinations.contains(&item.destination) || !admits(&item) {
                continue;
            }
            let in_line = ordering == order::Ordering::Unordered
                || self
                    .head_of(&item.destination)?
                    .is_some_and(|head| head.key == place.key);
            if in_line {
                destinations.insert(item.destination.clone());
                out.push((item.destination.clone(), place));
            }
        }
        Ok(out)
    }

    /// Every item `filter` matches, sorted by key, as committed. On
    /// PostgreSQL terminal items stay in `items` (see the module docs of
    /// `engine::postgres`): the ones past `history_after` (and every rate
    /// window) are history and left out.
    ///
    /// # Errors
    /// [`Error::Database`]; [`Error::InvalidRecord`] for a damaged row.
    pub(crate) fn select(&mut self, filter: &crate::filter::ItemFilter) -> Result<Vec<OutboxItem>> {
        let cutoff = self.settings.history_cutoff(self.now);
        let rows = self
            .tx
            .query(
                &format!(
                    "SELECT idempotency_key, revision, doc, seq FROM {}.items
                     WHERE state = 'queued' OR updated_at > $1 ORDER BY idempotency_key",
                    self.engine.s
                ),
                &[&cutoff],
            )
            .map_err(db("select items"))?;
        let keys = self.remember(&rows)?;
        Ok(keys
            .iter()
            .filter_map(|key| self.peek(key))
            .filter(|item| filter.matches(item))
            .cloned()
            .collect())
    }

    /// Whether this transaction changed anything.
    pub(crate) fn changed(&self) -> bool {
        !self.overlay.is_empty() || !self.events.is_empty()
    }

    /// Takes the locks that keep caps whole before send times or cooldowns
    /// are read: `destination`'s lock for its own times and cooldown (a
    /// one-item transaction), the `caps` lock for every destination's (or in
    /// a transaction of [`Scope::Any`]). Times read after them include every
    /// decision committed on any host before they were granted.
    fn lock_caps(&mut self, destination: Option<&str>) -> Result<()> {
        if let (true, Some(destination)) = (self.one_item, destination) {
            return self.lock_destination(destination);
        }
        if !self.caps_locked {
            self.tx
                .execute(
                    "SELECT pg_advisory_xact_lock($1)",
                    &[&lock_key(&self.engine.schema, "caps")],
                )
                .map_err(db("lock the caps"))?;
            self.caps_locked = true;
        }
        Ok(())
    }

    /// The latest platform cooldown on `destination` still in force at `now`.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub(crate) fn destination_cooldown(
        &mut self,
        destination: &str,
    ) -> Result<Option<DateTime<Utc>>> {
        let now = self.now;
        if self.one_item {
            // Read with the line, under the destination's lock.
            self.read_line(destination, false)?;
        }
        self.lock_caps(Some(destination))?;
        let committed: Option<DateTime<Utc>> = if let Some(line) = self.lines.get(destination) {
            line.cooldown
        } else {
            self.tx
                .query_opt(
                    &format!(
                        "SELECT until FROM {}.cooldowns WHERE destination = $1",
                        self.engine.s
                    ),
                    &[&destination],
                )
                .map_err(db("read a destination's cooldown"))?
                .map(|row| row.get(0))
        };
        let pending = self
            .overlay
            .values()
            .filter(|i| i.destination == destination)
            .filter_map(|i| i.cooldown_until)
            .max();
        Ok(committed.max(pending).filter(|until| *until > now))
    }

    /// Send and claim times (see `store::rate_times`) at or after `since`,
    /// of one destination or of all, as this transaction sees them: every
    /// one of them (learning a pace, after a refusal); a cap asks
    /// [`nth_newest_time`](Self::nth_newest_time) instead.
    fn times(
        &mut self,
        destination: Option<&str>,
        since: DateTime<Utc>,
    ) -> Result<Vec<DateTime<Utc>>> {
        if let (true, Some(destination)) = (self.one_item, destination) {
            // Read with the line, under the destination's lock: enough when
            // the line read every time of the window.
            self.read_line(destination, false)?;
            if let Some(line) = self.lines.get(destination)
                && line.complete
                && since >= line.since
            {
                let mut times: Vec<DateTime<Utc>> = line
                    .newest
                    .iter()
                    .filter(|(key, at)| *at >= since && !self.overlay.contains_key(key))
                    .map(|(_, at)| *at)
                    .collect();
                times.extend(self.pending_times(Some(destination), |at| at >= since));
                return Ok(times);
            }
        }
        self.lock_caps(destination)?;
        let changed = self.changed_keys();
        let s = &self.engine.s;
        let rows = match destination {
            Some(destination) => self.tx.query(
                &format!(
                    "SELECT at FROM {s}.rate_times
                     WHERE destination = $1 AND at >= $2 AND NOT (idempotency_key = ANY($3))"
                ),
                &[&destination, &since, &changed],
            ),
            None => self.tx.query(
                &format!(
                    "SELECT at FROM {s}.rate_times
                     WHERE at >= $1 AND NOT (idempotency_key = ANY($2))"
                ),
                &[&since, &changed],
            ),
        }
        .map_err(db("read send times"))?;
        let mut times: Vec<DateTime<Utc>> = rows.iter().map(|row| row.get(0)).collect();
        times.extend(self.pending_times(destination, |at| at >= since));
        Ok(times)
    }

    /// The send and claim times of the items this transaction changed (of
    /// `destination`, or of all) that `keep` keeps: they replace those items'
    /// committed times.
    fn pending_times(
        &self,
        destination: Option<&str>,
        keep: impl Fn(DateTime<Utc>) -> bool,
    ) -> Vec<DateTime<Utc>> {
        self.overlay
            .values()
            .filter(|i| destination.is_none_or(|d| i.destination == d))
            .flat_map(rate_times)
            .filter(|at| keep(*at))
            .collect()
    }

    /// The `n`-th newest of the send and claim times later than `after`, of
    /// `destination` or of all, as this transaction sees them (see
    /// `Txn::nth_newest_time`): the committed times, less those of the items
    /// this transaction changed, and those items' own times. Found on the
    /// server, which walks at most `n` entries of the `(destination, at)` or
    /// `(at)` index from its newest end and sends one time back, or, in a
    /// one-item transaction, from its destination's line when the line
    /// holds the answer (a claim's cap and pace: no statement of their own).
    ///
    /// # Errors
    /// [`Error::Database`].
    pub(crate) fn nth_newest_time(
        &mut self,
        destination: Option<&str>,
        after: DateTime<Utc>,
        n: usize,
    ) -> Result<Option<DateTime<Utc>>> {
        if n == 0 {
            return Ok(None);
        }
        if let (true, Some(destination)) = (self.one_item, destination) {
            // Read with the line, under the destination's lock.
            self.read_line(destination, false)?;
            if let Some(line) = self.lines.get(destination) {
                if line.nth_kept
                    && self.overlay.is_empty()
                    && after == line.since
                    && n == line.count
                {
                    return Ok(line.nth);
                }
                if let Some(newest) =
                    line.newest_after(after, n, |key| self.overlay.contains_key(key))
                {
                    let pending = self.pending_times(Some(destination), |at| at > after);
                    return Ok(crate::rate::nth_newest(
                        newest.into_iter().chain(pending),
                        after,
                        n,
                    ));
                }
            }
        }
        self.lock_caps(destination)?;
        let changed = self.changed_keys();
        let pending = self.pending_times(destination, |at| at > after);
        let limit = i64::try_from(n).unwrap_or(i64::MAX);
        let offset = limit - 1;
        let s = &self.engine.s;
        // The `n` newest committed times (of the keys not changed) and the
        // changed items' own: the `n`-th newest of all is the `n`-th of them.
        let row = match destination {
            Some(destination) => self.tx.query_opt(
                &format!(
                    "SELECT at FROM (
                       (SELECT at FROM {s}.rate_times
                        WHERE destination = $1 AND at > $2 AND NOT (idempotency_key = ANY($3))
                        ORDER BY at DESC LIMIT $4)
                       UNION ALL SELECT p FROM unnest($5::timestamptz[]) AS p
                     ) u ORDER BY at DESC OFFSET $6 LIMIT 1"
                ),
                &[&destination, &after, &changed, &limit, &pending, &offset],
            ),
            None => self.tx.query_opt(
                &format!(
                    "SELECT at FROM (
                       (SELECT at FROM {s}.rate_times
                        WHERE at > $1 AND NOT (idempotency_key = ANY($2))
                        ORDER BY at DESC LIMIT $3)
                       UNION ALL SELECT p FROM unnest($4::timestamptz[]) AS p
                     ) u ORDER BY at DESC OFFSET $5 LIMIT 1"
                ),
                &[&after, &changed, &limit, &pending, &offset],
            ),
        }
        .map_err(db("read the newest send times"))?;
        Ok(row.map(|row| row.get(0)))
    }

    /// Send and claim times of every destination since `since`.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub(crate) fn all_times(&mut self, since: DateTime<Utc>) -> Result<Vec<DateTime<Utc>>> {
        self.times(None, since)
    }

    /// Send and claim times of `destination` since `since`.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub(crate) fn destination_times(
        &mut self,
        destination: &str,
        since: DateTime<Utc>,
    ) -> Result<Vec<DateTime<Utc>>> {
        self.times(Some(destination), since)
    }

    /// Whether the handle with owner id `owner` (another handle's) holds its
    /// lock. A dead owner's key stays locked (shared) by this transaction
    /// until it ends, so its claims cannot be revived meanwhile: the owner
    /// taking its lock again waits for this transaction. Shared, not
    /// exclusive: the owner's own probe must still find its lock free (an
    /// exclusive hold here made it fail, as if the owner session held it).
    ///
    /// # Errors
    /// [`Error::Database`].
    pub(crate) fn owner_is_alive(&mut self, owner: &str) -> Result<bool> {
        if owner == self.engine.owner {
            return self.engine.own_lock_held();
        }
        let free: bool = self
            .tx
            .query_one(
                "SELECT pg_try_advisory_xact_lock_shared($1)",
                &[&lock_key(&self.engine.schema, owner)],
            )
            .map_err(db("probe an owner lock"))?
            .get(0);
        Ok(!free)
    }

    /// Adds `event` to this transaction's events (sealed after the commit).
    pub(crate) fn seal(&mut self, event: &AuditEvent) {
        self.events.push(event.clone());
    }

    /// Writes the overlay and the events (as pending, in order) in one
    /// `COMMIT`, then, when an item became claimable, requests a wake-up
    /// (see [`notify`](super::notify); nothing is sent on this connection).
    /// Returns whether events were written (to be sealed now).
    ///
    /// One round trip when every row written is one this transaction locked
    /// (read `FOR UPDATE`, or absent under its key's lock: every rule's
    /// one-item transaction): no one else can change or add such a row before
    /// this transaction ends, so its conditional write cannot miss, and the
    /// writes, the pending events and the `COMMIT` go as one pipeline. (An insert then has no `ON CONFLICT` escape: a row that
    /// exists after all fails the statement, and the whole transaction rolls
    /// back.) Otherwise the writes go first, their row counts are checked,
    /// and the `COMMIT` follows.
    ///
    /// # Errors
    /// [`Error::Database`] (nothing of the transaction is visible, unless the
    /// connection was lost during `COMMIT` itself: then re-read).
    pub(crate) fn commit(mut self) -> Result<Committed> {
        if self.speculation != Speculation::Off {
            // `speculate` commits these; nothing may commit one unchecked.
            return Err(Error::Database {
                op: "commit",
                source: "a speculative transaction commits only through its guard".into(),
            });
        }
        if !self.changed() {
            self.tx.commit().map_err(db("end a transaction"))?;
            return Ok(Committed::default());
        }
        let overlay = std::mem::take(&mut self.overlay);
        let sure = overlay.keys().all(|key| self.locked.contains(key));
        let writes: Vec<(&String, ItemWrite<'_>)> = overlay
            .iter()
            .map(|(key, item)| {
                let (expect, before) = match self.base.get(key) {
                    Some(Some((before, revision))) => (Expect::Revision(*revision), Some(before)),
                    _ => (Expect::Absent, None),
                };
                (key, ItemWrite::new(item, expect, before))
            })
            .collect();
        // Each item's write is one statement; the last carries the pending
        // events (their ids are taken there, after every row lock).
        let docs = pending_docs(&self.events)?;
        let mut rows_at: Vec<(usize, &String)> = Vec::with_capacity(writes.len());
        let mut statements = Vec::with_capacity(writes.len());
        for (at, (key, write)) in writes.iter().enumerate() {
            rows_at.push((at, *key));
            let last = at + 1 == writes.len();
            statements.push(write.statement(&self.engine.s, sure, last.then_some(&docs)));
        }
        let pending_sql = self.engine.pending_sql();
        let pending_params: [&(dyn postgres::types::ToSql + Sync); 1] = [&docs];
        let mut steps: Vec<(Step<'_>, &'static str)> = statements
            .iter()
            .map(|(sql, params, op)| (Step::Execute(sql, params), *op))
            .collect();
        if !docs.is_empty() && writes.is_empty() {
            steps.push((
                Step::Execute(&pending_sql, &pending_params),
                "write pending audit events",
            ));
        }
        let written = if sure {
            steps.push((Step::Simple("COMMIT"), "commit"));
            let plain: Vec<Step<'_>> = steps.iter().map(|(step, _)| *step).collect();
            let results = self.tx.pipeline_each(&plain).map_err(db("commit"))?;
            self.tx.mark_ended();
            // Every statement, the `COMMIT` included, must have succeeded (a
            // `COMMIT` after a failed statement is skipped, "not run", and
            // the failed transaction is rolled back when `tx` drops: the
            // first error is the one to return).
            let mut done = Vec::with_capacity(steps.len());
            for (result, (_, op)) in results.into_iter().zip(&steps) {
                done.push(result.map_err(db(op))?);
            }
            done
        } else {
            let done = run_named(&mut self.tx, &steps)?;
            Self::check_written(&done, &rows_at)?;
            let results = self
                .tx
                .pipeline_each(&[Step::Simple("COMMIT")])
                .map_err(db("commit"))?;
            self.tx.mark_ended();
            if let Some(Err(e)) = results.into_iter().next() {
                return Err(db("commit")(e));
            }
            done
        };
        let revisions: Vec<(&String, u64)> = writes
            .iter()
            .map(|(key, _)| {
                let revision = match self.base.get(*key) {
                    Some(Some((_, revision))) => revision + 1,
                    _ => 1,
                };
                (*key, revision)
            })
            .collect();
        self.after_commit(&overlay, &revisions);
        Self::check_written(&written, &rows_at)?;
        Ok(Committed {
            pending: !docs.is_empty(),
        })
    }

    /// What follows a commit of `overlay` (each item now at the revision
    /// `revisions` gives): waiting workers are woken if an item became
    /// claimable (a request, sent by the handle's wake-up thread: see
    /// `notify`; only now, once the commit is visible), the handle keeps the
    /// versions of its claims (see [`speculate`](super::speculate)), and
    /// the metrics count the events.
    pub(super) fn after_commit(
        &self,
        overlay: &BTreeMap<String, OutboxItem>,
        revisions: &[(&String, u64)],
    ) {
        let wake = overlay
            .values()
            .any(|item| item.state == ItemState::Queued && item.claim.is_none());
        if wake {
            self.engine.wake.request();
        }
        for (key, revision) in revisions {
            if let Some(item) = overlay.get(*key) {
                self.engine
                    .known
                    .committed(item, *revision, &self.engine.owner);
            }
        }
        crate::metrics::committed(
            self.events.iter().map(|e| {
                (
                    e.outcome,
                    e.error_code.as_deref(),
                    e.failure_class,
                    e.idempotency_key.as_str(),
                )
            }),
            |key| overlay.get(key),
        );
    }

    /// Checks that each item's row write changed its one row.
    fn check_written(done: &[Done], rows_at: &[(usize, &String)]) -> Result<()> {
        for (at, key) in rows_at {
            if done.get(*at).is_none_or(|d| d.count != 1) {
                // Cannot happen for rows this transaction locked, and every
                // writer of `items` runs the rules.
                return Err(Error::Database {
                    op: "write an item",
                    source: format!("item {key:?} changed under this transaction").into(),
                });
            }
        }
        Ok(())
    }
}

/// What a committed transaction left to do.
#[derive(Debug, Default)]
pub(crate) struct Committed {
    /// It wrote pending audit events: seal them.
    pub(crate) pending: bool,
}

impl crate::rules::txn::Txn for PgTxn<'_, '_> {
    fn now(&self) -> DateTime<Utc> {
        self.now
    }

    fn settings(&self) -> &Settings {
        &self.settings
    }

    fn item(&mut self, key: &str) -> Result<Option<&OutboxItem>> {
        Self::item(self, key)
    }

    fn item_mut(&mut self, key: &str) -> Result<&mut OutboxItem> {
        Self::item_mut(self, key)
    }

    /// Terminal items never leave `items` on PostgreSQL (history is a view of
    /// them by age): nothing is ever archived away from [`item`](Self::item).
    fn archived(&mut self, _key: &str) -> Result<Option<OutboxItem>> {
        Ok(None)
    }

    fn insert(&mut self, item: OutboxItem) -> Result<()> {
        // Lock the row being replaced, if any, before the overlay hides it.
        self.load(&item.idempotency_key)?;
        Self::insert(self, item);
        Ok(())
    }

    fn next_seq(&mut self, destination: &str) -> Result<u64> {
        self.reads()?;
        Self::next_seq(self, destination)
    }

    fn head_of(&mut self, destination: &str) -> Result<Option<OrderKey>> {
        self.reads()?;
        Self::head_of(self, destination)
    }

    fn candidates(
        &mut self,
        ordering: order::Ordering,
        admits: &mut dyn FnMut(&OutboxItem) -> bool,
    ) -> Result<Vec<(String, OrderKey)>> {
        self.reads()?;
        Self::candidates(self, ordering, admits)
    }

    fn select(&mut self, filter: &crate::filter::ItemFilter) -> Result<Vec<OutboxItem>> {
        self.reads()?;
        Self::select(self, filter)
    }

    fn destination_cooldown(&mut self, destination: &str) -> Result<Option<DateTime<Utc>>> {
        self.reads()?;
        Self::destination_cooldown(self, destination)
    }

    fn all_times(&mut self, since: DateTime<Utc>) -> Result<Vec<DateTime<Utc>>> {
        self.reads()?;
        Self::all_times(self, since)
    }

    fn destination_times(
        &mut self,
        destination: &str,
        since: DateTime<Utc>,
    ) -> Result<Vec<DateTime<Utc>>> {
        self.reads()?;
        Self::destination_times(self, destination, since)
    }

    fn nth_newest_time(
        &mut self,
        destination: Option<&str>,
        after: DateTime<Utc>,
        n: usize,
    ) -> Result<Option<DateTime<Utc>>> {
        self.reads()?;
        Self::nth_newest_time(self, destination, after, n)
    }

    fn audit_id(&mut self, key: &str, now: DateTime<Utc>) -> Result<String> {
        Ok(self.engine.mint_audit_id(key, now))
    }

    fn seal(&mut self, event: &AuditEvent) -> Result<()> {
        Self::seal(self, event);
        Ok(())
    }

    fn owner_is_alive(&mut self, owner: &str) -> Result<bool> {
        self.reads()?;
        Self::owner_is_alive(self, owner)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests panic loudly")]

    use chrono::{DateTime, Utc};
    use proptest::prelude::*;

    use super::{LINE_NEWEST, Line};

    fn at(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000 + secs, 0).unwrap()
    }

    /// A line holding the `limit` newest of `all` (newest first).
    fn line(all: &[(String, DateTime<Utc>)], since: i64, limit: usize) -> Line {
        Line {
            since: at(since),
            newest: all.iter().take(limit).cloned().collect(),
            complete: all.len() < limit,
            nth: None,
            nth_kept: false,
            count: 1,
            cooldown: None,
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// What a line read of the `limit` newest times holds answers
        /// exactly when it answers at all, and always answers what a
        /// one-item claim asks of it (the newest time, for its pace or a cap
        /// of one, with the committed times of its one item left out).
        #[test]
        fn a_line_answers_exactly_or_not_at_all(
            rows in prop::collection::vec((0..5usize, 0..10i64), 0..24),
            changed in prop::collection::vec(0..6usize, 0..3),
            since in 0..10i64,
            after in 0..10i64,
            n in 1..8usize,
            limit in 1..8usize,
        ) {
            // Every committed time at or after `since`, newest first, as the
            // index reads them (ties in any order).
            let mut all: Vec<(String, DateTime<Utc>)> = rows
                .iter()
                .filter(|(_, secs)| *secs >= since)
                .map(|(key, secs)| (format!("k{key}"), at(*secs)))
                .collect();
            all.sort_by_key(|row| std::cmp::Reverse(row.1));
            all.dedup();
            let changed: Vec<String> = changed.iter().map(|k| format!("k{k}")).collect();
            let is_changed = |key: &str| changed.iter().any(|c| c == key);
            let naive = |after: i64, n: usize, left_out: &dyn Fn(&str) -> bool| {
                all.iter()
                    .filter(|(key, t)| *t > at(after) && !left_out(key))
                    .map(|(_, t)| *t)
                    .take(n)
                    .collect::<Vec<_>>()
            };
            if let Some(found) = line(&all, since, limit).newest_after(at(after), n, is_changed) {
                prop_assert!(after >= since, "answered for a window the line does not cover");
                prop_assert_eq!(found, naive(after, n, &is_changed));
            }
            // A claim's own question, when its item (`k0`) holds at most the
            // two times an item can hold.
            if all.iter().filter(|(key, _)| key == "k0").count() <= 2 {
                let own = |key: &str| key == "k0";
                let claim = line(&all, since, LINE_NEWEST as usize);
                prop_assert_eq!(
                    claim.newest_after(at(after.max(since)), 1, own),
                    Some(naive(after.max(since), 1, &own))
                );
            }
        }
    }
}
