//! The transaction the delivery rules run in: one read-modify-write of the
//! outbox, as an engine serves it.
//!
//! Every rule (decide, claim, finish, release, abandon, requeue, cancel,
//! enqueue) runs inside one [`Txn`] and sees only this trait. An engine opens
//! the transaction, lets the rule read and change items through it, and
//! commits everything the rule changed, with the audit records the rule
//! sealed, as one durable step — or nothing, if the rule returned an error.
//!
//! The trait is written so that both engines can serve it:
//!
//! * the file engine, whose transaction is an overlay over the in-memory state
//!   under the directory lock (reads cannot fail, except a history lookup);
//! * the PostgreSQL engine, whose transaction reads rows lazily with
//!   `SELECT … FOR UPDATE`, commits its audit events as pending (sealed onto
//!   the chain right after the commit), and may fail on any read.
//!
//! So every method that may read takes `&mut self` and returns a [`Result`];
//! a rule that gets an error returns it, and the engine writes nothing.
//!
//! **Invariant (isolation):** what a transaction reads is the committed state
//! plus its own changes; no other handle, thread or host changes an item this
//! transaction has read until it commits or aborts. (The file engine holds the
//! directory lock for the whole transaction; PostgreSQL locks each row it
//! reads for update.)
//!
//! **Invariant (atomicity):** the item versions put with [`Txn::item_mut`] and
//! [`Txn::insert`] and the records sealed with [`Txn::seal`] become durable
//! together, in one step, or not at all. Nothing is visible to anyone else
//! before that step, and the caller is told of success only after it.
//!
//! **Invariant (audit order):** records are sealed in the order the rule
//! calls [`Txn::seal`], each chained to the one before; two transactions never
//! seal onto the same head. The records of one item are in the chain in the
//! order of that item's changes. (The file engine seals inside the
//! transaction, onto the outbox's last committed record; PostgreSQL seals
//! right after the commit, see `engine::postgres`.)

use chrono::{DateTime, Utc};

use crate::audit::AuditEvent;
use crate::error::{Error, Result};
use crate::filter::ItemFilter;
use crate::item::OutboxItem;
use crate::order::{self, OrderKey};
use crate::settings::Settings;

/// What a transaction may touch, declared when it begins: an engine that runs
/// transactions side by side (PostgreSQL) runs one-item transactions at once
/// and every other alone among writers; the file engine runs every
/// transaction alone anyway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scope<'k> {
    /// It reads and changes the item with this key and reads no other item
    /// for change; it may read that item's destination line, times and
    /// cooldown.
    OneItem(&'k str),
    /// A [`Scope::OneItem`] transaction about the key (the first) that will
    /// take a place in the line of the destination (the second): an enqueue.
    /// An engine may take that place in the transaction's opening, before
    /// the rule asks for it ([`Txn::next_seq`]).
    Enqueue(&'k str, &'k str),
    /// A [`Scope::OneItem`] transaction about an item this handle claimed,
    /// after its send: the record of what the send did, or the claim given
    /// back or abandoned. An engine may decide it first from the version of
    /// the item its claim committed, and commit only if the item is still at
    /// that version (see `engine::postgres::speculate`).
    AfterSend(&'k str),
    /// A [`Scope::OneItem`] transaction deciding whether the item with this
    /// key is sent now, and claiming it if so (`lifecycle::decide`): it reads
    /// that item's destination line, times and cooldown. An engine may read
    /// that line in the transaction's opening, when it knows the item's
    /// destination (see `engine::postgres::PgEngine::open_txn`). A requeue
    /// or a cancel of one key is a [`Scope::OneItem`]: it reads no line.
    Decide(&'k str),
    /// Anything: a drain step, `enqueue_many`, a bulk action.
    Any,
}

impl<'k> Scope<'k> {
    /// The one item's key of a one-item transaction (`None`: [`Scope::Any`]).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn item_key(self) -> Option<&'k str> {
        match self {
            Self::OneItem(key)
            | Self::Enqueue(key, _)
            | Self::AfterSend(key)
            | Self::Decide(key) => Some(key),
            Self::Any => None,
        }
    }
}

/// How long a transaction may wait for a connection where the engine caps
/// them (a PostgreSQL handle's `max_connections`; the file engine has none
/// to wait for).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wait {
    /// At most the engine's bound, then `Error::PoolExhausted` with nothing
    /// done: the caller may try again.
    Bounded,
    /// As long as it takes: a transaction that records what a send did
    /// (or gives back a claim), after the send. Given up on, it would leave
    /// the claim for a later look to settle as an ambiguous failure (or, for
    /// an idempotent transport, a resend) though its outcome was known.
    UntilFree,
}

/// One read-modify-write of the outbox, as the delivery rules see it.
///
/// The rules are generic over this trait (monomorphised for the file engine);
/// it is also object-safe, so an engine may hand out `&mut dyn Txn`.
pub(crate) trait Txn {
    /// The moment this transaction decides at: read once from the handle's
    /// clock when the transaction began, the same for every rule inside it.
    fn now(&self) -> DateTime<Utc>;

    /// The settings in force for this transaction: the ones the outbox stores,
    /// over the opening handle's builder values. Fixed for its duration.
    fn settings(&self) -> &Settings;

    /// The live item with this key (queued, or terminal and not yet moved to
    /// history), as this transaction sees it: the committed version or this
    /// transaction's own change. `None` if there is no live item.
    ///
    /// Invariant: an item returned here stays as it is (for everyone else)
    /// until this transaction ends.
    ///
    /// # Errors
    /// The engine's read errors.
    fn item(&mut self, key: &str) -> Result<Option<&OutboxItem>>;

    /// The live item with this key, for changing: the change is part of this
    /// transaction and committed with it.
    ///
    /// # Errors
    /// [`Error::NotFound`] if there is no live item with this key (nothing is
    /// brought back from history: use [`live_item`](Self::live_item) first);
    /// the engine's read errors.
    fn item_mut(&mut self, key: &str) -> Result<&mut OutboxItem>;

    /// The terminal item with this key that moved to history, if any (read
    /// only; `None` for a key that is live or unknown).
    ///
    /// # Errors
    /// The engine's read errors (a damaged history segment).
    fn archived(&mut self, key: &str) -> Result<Option<OutboxItem>>;

    /// Puts a whole new version of an item into the transaction (a new item,
    /// or one replacing the live version or one brought back from history).
    /// The item is live from then on, as this transaction sees it.
    ///
    /// # Errors
    /// The engine's errors (PostgreSQL may lock the row).
    fn insert(&mut self, item: OutboxItem) -> Result<()>;

    /// The next enqueue sequence for an item of `destination`: larger than
    /// every live item's and than every sequence handed out before, across
    /// every handle and host of the outbox.
    ///
    /// Invariant: no other transaction reads `destination`'s line
    /// ([`head_of`](Self::head_of)) between this call and this transaction's
    /// end (a sequence taken but not yet committed must not be passed over).
    ///
    /// # Errors
    /// The engine's errors.
    fn next_seq(&mut self, destination: &str) -> Result<u64>;

    /// The place of `destination`'s head: its queued item (claimed or not)
    /// with the smallest [`OrderKey`], as this transaction sees it (its own
    /// changes included). `None` when nothing is queued for it.
    ///
    /// # Errors
    /// The engine's read errors.
    fn head_of(&mut self, destination: &str) -> Result<Option<OrderKey>>;

    /// The items to decide next in a drain step, at most one per destination:
    /// claimed items (a claim may be dead), the items this transaction changed
    /// or made head, then a bounded window of items due by [`now`](Self::now),
    /// earliest due first. Each is queued, and claimed or due; under
    /// [`order::Ordering::PerDestination`] each is its destination's head.
    /// `admits` filters further (it is called at most once per candidate).
    ///
    /// Invariant: the candidates returned can be read with
    /// [`item`](Self::item) and decided in this transaction without another
    /// claimer deciding them at the same moment.
    ///
    /// # Errors
    /// The engine's read errors.
    fn candidates(
        &mut self,
        ordering: order::Ordering,
        admits: &mut dyn FnMut(&OutboxItem) -> bool,
    ) -> Result<Vec<(String, OrderKey)>>;

    /// The live items `filter` matches, sorted by key, as committed (what an
    /// operator's bulk action looks at). Items in history are not included.
    ///
    /// # Errors
    /// The engine's read errors.
    fn select(&mut self, filter: &ItemFilter) -> Result<Vec<OutboxItem>>;

    /// The latest platform cooldown on `destination` still in force at
    /// [`now`](Self::now): the destination's own (whatever became of the items
    /// that received it), or one this transaction just set on an item.
    ///
    /// # Errors
    /// The engine's read errors.
    fn destination_cooldown(&mut self, destination: &str) -> Result<Option<DateTime<Utc>>>;

    /// Every time since `since` (inclusive) that counts against the global cap:
    /// sends, claims (sends that may be in progress) and possible sends of
    /// every destination (see `store::rate_times`), as this transaction sees
    /// them, in no particular order.
    ///
    /// Invariant: no other transaction can add a time before this one commits
    /// (caps hold across handles and hosts).
    ///
    /// # Errors
    /// The engine's read errors.
    fn all_times(&mut self, since: DateTime<Utc>) -> Result<Vec<DateTime<Utc>>>;

    /// As [`all_times`](Self::all_times), for `destination` only.
    ///
    /// # Errors
    /// The engine's read errors.
    fn destination_times(
        &mut self,
        destination: &str,
        since: DateTime<Utc>,
    ) -> Result<Vec<DateTime<Utc>>>;

    /// The `n`-th newest (1: the newest) of the times later than `after` that
    /// count against `destination`'s caps, or with `None` against the global
    /// cap (the times [`destination_times`](Self::destination_times) and
    /// [`all_times`](Self::all_times) give), or `None` when fewer than `n`
    /// are: what a cap of `n` per window decides by (`rate::nth_newest`).
    ///
    /// An engine that keeps the times ordered answers from the newest end
    /// and stops after `n`, or at once when it holds fewer than `n` times in
    /// all: a cap decision then costs at most its count, however many sends
    /// the window holds.
    ///
    /// # Errors
    /// The engine's read errors.
    fn nth_newest_time(
        &mut self,
        destination: Option<&str>,
        after: DateTime<Utc>,
        n: usize,
    ) -> Result<Option<DateTime<Utc>>> {
        let times = match destination {
            Some(destination) => self.destination_times(destination, after)?,
            None => self.all_times(after)?,
        };
        Ok(crate::rate::nth_newest(times, after, n))
    }

    /// A fresh audit id for the record about to be sealed for the item `key`
    /// at `now` (stamped on the item as its `last_audit_id`): unique within
    /// the chain and across chains. The file engine derives it from the head
    /// the record will chain to (byte-compatible with every earlier release);
    /// PostgreSQL, whose records get their place in the chain only after the
    /// commit (see `engine::postgres`), from this handle's unique owner id and
    /// a counter.
    ///
    /// # Errors
    /// The engine's errors.
    fn audit_id(&mut self, key: &str, now: DateTime<Utc>) -> Result<String>;

    /// Seals `event` as the next record of the chain (the file engine: after
    /// the head this transaction holds, with the outbox's hasher) and adds it
    /// to this transaction's records. PostgreSQL defers the sealing: the event
    /// is committed as pending, in the order of these calls, and sealed onto
    /// the chain right after the commit (see `engine::postgres`).
    ///
    /// # Errors
    /// The engine's errors.
    fn seal(&mut self, event: &AuditEvent) -> Result<()>;

    /// Whether the handle with owner id `owner` still holds its liveness token
    /// (a locked owner file; a session advisory lock). Never a clock: a slow
    /// send is never declared dead. The caller answers for its own handle.
    ///
    /// # Errors
    /// The engine's errors.
    fn owner_is_alive(&mut self, owner: &str) -> Result<bool>;

    /// The item with this key, brought back from history into this transaction
    /// if it had moved there (written back live only if the transaction commits).
    ///
    /// # Errors
    /// [`Error::NotFound`] for an unknown key; the engine's read errors.
    fn live_item(&mut self, key: &str) -> Result<&OutboxItem> {
        if self.item(key)?.is_none()
            && let Some(old) = self.archived(key)?
        {
            self.insert(old)?;
        }
        self.item(key)?.ok_or_else(|| Error::NotFound {
            key: key.to_owned(),
        })
    }

    /// The live item with this key, or [`Error::NotFound`].
    ///
    /// # Errors
    /// [`Error::NotFound`]; the engine's read errors.
    fn existing(&mut self, key: &str) -> Result<&OutboxItem> {
        self.item(key)?.ok_or_else(|| Error::NotFound {
            key: key.to_owned(),
        })
    }
}
