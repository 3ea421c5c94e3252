//! The `Outbox` handle: the public API. Each method runs a delivery rule
//! (`rules`) inside one transaction of the engine behind the handle (today the
//! file engine, `engine::file`), or asks the engine a read.

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::audit::{AuditRecord, AuditReport, Head};
use crate::builder::OutboxBuilder;
use crate::clock::{Clock, Sleeper};
use crate::engine::file::FileEngine;
use crate::error::{Error, Result};
use crate::filter::{BulkReport, ItemFilter};
use crate::item::{ClaimId, OutboxItem};
use crate::message::{NewMessage, content_hash};
use crate::order::Picker;
use crate::pacing::Pacing;
use crate::rate::{DestinationWindow, RateLimit};
use crate::receipt::{DeliveryReceipt, DrainReport};
use crate::rules::bulk::{Bulk, operator_note};
use crate::rules::lifecycle::{self, Decision};
use crate::rules::txn::{Scope, Txn, Wait};
use crate::rules::{Actor, InFlight};
use crate::rules::{drain, enqueue};
use crate::send::SendError;
use crate::settings::Settings;
use crate::wake::Wakers;

pub(crate) use crate::engine::file::DueSummary;
#[allow(
    unused_imports,
    reason = "the names other modules and tools know them by"
)]
pub(crate) use crate::rules::codes::{
    AMBIGUOUS_AFTER_RESTART, CANCELLED, SEND_CANCELLED, SEND_PANICKED, sanitize,
};
pub(crate) use crate::rules::drain::{AsMember, Stepped};
pub(crate) use crate::rules::lifecycle::SendResult;

/// Runs `$body` with `$engine` bound to the engine behind `$outbox`: the one
/// place a second engine adds its arm.
macro_rules! on_engine {
    ($outbox:expr, $engine:ident => $body:expr) => {
        match &$outbox.inner.backend {
            Backend::File($engine) => $body,
            #[cfg(feature = "postgres")]
            Backend::Postgres($engine) => $body,
        }
    };
}

/// A durable, at-most-once outbox in one directory (or, with the `postgres`
/// feature, in one PostgreSQL schema: `Outbox::postgres`).
///
/// Cheap to clone (an `Arc` inside) and `Send + Sync`: share one across threads.
/// Any number of processes may open the same directory; every read-modify-write
/// of the state happens under the exclusive `outbox.lock`, which is never held
/// while `send` runs. Each handle keeps the state in memory and reads only what
/// other processes changed since it last looked.
///
/// ```
/// # let dir = tempfile::tempdir()?;
/// use durable_outbox::{NewMessage, Outbox, Outcome};
///
/// let outbox = Outbox::open(dir.path())?;
/// outbox.enqueue(NewMessage {
///     idempotency_key: "order-17".into(),
///     connector: "telegram".into(),
///     grant_id: "bot-1".into(),
///     destination: "chat-42".into(),
///     content: "your order shipped".into(),
///     ..Default::default()
/// })?;
/// let receipt = outbox.process("order-17", |_item| Ok(Some("tg-981".into())))?;
/// assert_eq!(receipt.outcome, Outcome::Sent);
/// // Telegram numbers messages per chat: look a reply's id up in its chat.
/// let original = outbox.find_by_transport_ref_in("chat-42", "tg-981")?.expect("correlated");
/// assert_eq!(original.idempotency_key(), "order-17");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct Outbox {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox")
            .field("location", &self.location())
            .field("owner", &on_engine!(self, engine => engine.owner_id()))
            .finish_non_exhaustive()
    }
}

/// The handle's own settings (the engine keeps those it needs for its
/// transactions).
struct Config {
    max_inline_wait: Duration,
    clock: Arc<dyn Clock>,
    sleeper: Arc<dyn Sleeper>,
    /// Connectors whose platform deduplicates by transaction id, and for how long.
    idempotent: std::collections::BTreeMap<String, Duration>,
}

/// The storage engine behind a handle.
#[cfg_attr(
    feature = "postgres",
    expect(
        clippy::large_enum_variant,
        reason = "one per handle, inside its Arc: the size never moves around"
    )
)]
enum Backend {
    /// One directory: journal, snapshot, audit log, history, owner files.
    File(FileEngine),
    /// A schema in a PostgreSQL database, shared by handles on many hosts.
    #[cfg(feature = "postgres")]
    Postgres(crate::engine::postgres::PgBackend),
}

struct Inner {
    backend: Backend,
    /// The claims this handle is sending right now. A claim naming our owner
    /// id but missing here was left by a call of ours that failed after
    /// claiming (or is a lost one of ours).
    in_flight: Mutex<InFlight>,
    /// Workers waiting for new items; called after every enqueue and requeue.
    wakers: Wakers,
    config: Config,
    /// Per destination, the spacing learned from the platform's `retry_after`s.
    pacing: Pacing,
}

/// What the claim step concluded, for callers outside this module.
pub(crate) enum Claimed {
    /// No send now; here is why.
    Done(DeliveryReceipt),
    /// Claimed durably: send it, then record the result. The second item is the
    /// item as it was before the claim, to release it unchanged if it is never sent.
    Send(
        Box<OutboxItem>,
        #[cfg_attr(not(feature = "tokio"), allow(dead_code))] Box<OutboxItem>,
    ),
}

impl Outbox {
    /// Opens (creating if needed) the outbox in `dir` with default settings.
    ///
    /// # Errors
    ///
    /// As [`OutboxBuilder::open`].
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        Self::builder(dir).open()
    }

    /// Starts configuring an outbox in `dir`.
    pub fn builder(dir: impl AsRef<Path>) -> OutboxBuilder {
        OutboxBuilder::new(dir.as_ref().to_path_buf())
    }

    /// Starts configuring an outbox that lives in PostgreSQL (feature
    /// `postgres`): one outbox shared by bots on several hosts. `url` is a
    /// `postgres://user:password@host:port/database` URL (or a `key=value`
    /// connection string); the tables live in the schema
    /// [`schema`](OutboxBuilder::schema) names (default `durable_outbox`),
    /// created or migrated on open. Every other knob means what it means for
    /// a directory, and `open` returns the same [`Outbox`].
    ///
    /// Connect directly or through a session-mode pool: opening refuses a
    /// transaction-mode pooler ([`Error::SessionLocksUnavailable`]), because
    /// each handle's liveness is a session-level advisory lock.
    ///
    /// On PostgreSQL, [`dir`](Self::dir) is `None`;
    /// [`remove_old_audit_segments`](Self::remove_old_audit_segments) counts
    /// segments of the one audit table by `audit_rotate_bytes`, as the file
    /// engine seals them; terminal items stay in the table (history is those past
    /// `history_after`); `history_retention` `MaxAge` deletes them on open
    /// and on [`compact`](Self::compact), audited, and `MaxSegments` keeps
    /// everything.
    ///
    /// ```no_run
    /// use durable_outbox::{NewMessage, Outbox};
    ///
    /// let outbox = Outbox::postgres("postgres://bot@db.internal/bot")
    ///     .schema("telegram_outbox")
    ///     .open()?;
    /// outbox.enqueue(NewMessage {
    ///     idempotency_key: "order-17".into(),
    ///     connector: "telegram".into(),
    ///     grant_id: "bot-1".into(),
    ///     destination: "chat-42".into(),
    ///     content: "your order shipped".into(),
    ///     ..Default::default()
    /// })?;
    /// outbox.process_due(|item| Ok(Some(format!("sent-{}", item.idempotency_key()))))?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[cfg(feature = "postgres")]
    pub fn postgres(url: &str) -> OutboxBuilder {
        OutboxBuilder::for_postgres(url.to_owned())
    }

    pub(crate) fn open_with(mut builder: OutboxBuilder) -> Result<Self> {
        #[cfg(feature = "postgres")]
        let backend = if builder.postgres.is_some() {
            Backend::Postgres(crate::engine::postgres::PgBackend::open(&mut builder)?)
        } else {
            Backend::File(FileEngine::open(&mut builder)?)
        };
        #[cfg(not(feature = "postgres"))]
        let backend = Backend::File(FileEngine::open(&mut builder)?);
        Ok(Self {
            inner: Arc::new(Inner {
                backend,
                in_flight: Mutex::new(InFlight::default()),
                pacing: Pacing::default(),
                wakers: Wakers::default(),
                config: Config {
                    max_inline_wait: builder.max_inline_wait,
                    clock: builder.clock,
                    sleeper: builder.sleeper,
                    idempotent: builder.idempotent,
                },
            }),
        })
    }

    /// The outbox directory, or `None` for an outbox in PostgreSQL, which
    /// lives in a database schema instead.
    #[must_use]
    pub fn dir(&self) -> Option<&Path> {
        match &self.inner.backend {
            Backend::File(engine) => Some(engine.dir()),
            #[cfg(feature = "postgres")]
            Backend::Postgres(_) => None,
        }
    }

    /// The directory, for the file engine's directory-only reads; a typed
    /// error naming the engine elsewhere.
    #[cfg_attr(
        not(feature = "postgres"),
        allow(clippy::unnecessary_wraps, unused_variables)
    )]
    fn file_dir(&self, operation: &'static str) -> Result<&Path> {
        match &self.inner.backend {
            Backend::File(engine) => Ok(engine.dir()),
            #[cfg(feature = "postgres")]
            Backend::Postgres(_) => Err(Error::NotSupported {
                engine: crate::engine::postgres::ENGINE,
                operation,
                why: "the outbox lives in a database schema, not a directory",
            }),
        }
    }

    /// Where the outbox lives, for logs: its directory, or `postgres:<schema>`.
    pub(crate) fn location(&self) -> String {
        match &self.inner.backend {
            Backend::File(engine) => engine.dir().display().to_string(),
            #[cfg(feature = "postgres")]
            Backend::Postgres(engine) => format!("postgres:{}", engine.schema()),
        }
    }

    /// The PostgreSQL engine behind this handle, if that is where it lives.
    #[cfg(feature = "postgres")]
    pub(crate) fn postgres_engine(&self) -> Option<&crate::engine::postgres::PgEngine> {
        match &self.inner.backend {
            Backend::Postgres(engine) => Some(engine.engine()),
            Backend::File(_) => None,
        }
    }

    /// Records a message, durably, under its idempotency key.
    ///
    /// Enqueueing the same key again with the same connector, grant, destination
    /// and content returns the existing item (in whatever state it is) and writes
    /// nothing.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidField`] for a blank, oversize or NUL-containing field;
    /// [`Error::IdempotencyConflict`] when the key names a different message (both
    /// with nothing written); the load and write errors of every operation
    /// ([`Error::Corrupt`], [`Error::Io`], [`Error::Poisoned`], …).
    ///
    /// # Durability
    ///
    /// Returns only after the journal entry holding the item and its sealed
    /// `queued` audit record is fsynced (the record is then in `audit.jsonl`, or is
    /// re-appended from the journal, byte for byte, after a crash).
    #[expect(
        clippy::needless_pass_by_value,
        reason = "the message is the caller's to give away (a stable signature);                   the transaction borrows it, since PostgreSQL may run it again"
    )]
    pub fn enqueue(&self, message: NewMessage) -> Result<OutboxItem> {
        let span = tracing::info_span!(
            "outbox.enqueue",
            key = %message.idempotency_key,
            destination = %message.destination,
            outcome = tracing::field::Empty,
        );
        let _entered = span.enter();
        message.validate()?;
        let hash = content_hash(&message.content);
        let key = message.idempotency_key.clone();
        let item = self.transact_in(Scope::Enqueue(&key, &message.destination), |_, txn| {
            enqueue::insert_message(txn, &message, &hash)
        })?;
        span.record("outcome", item.state.as_str());
        self.inner.wakers.wake();
        Ok(item)
    }

    /// Records several messages in one durable step (one journal entry, one fsync).
    ///
    /// All or nothing: every message is validated and checked for idempotency
    /// conflicts (against the outbox and against each other) before anything is
    /// written. Messages already present with the same content are returned as
    /// they are. The result is in the order of `messages`.
    ///
    /// # Errors
    ///
    /// As [`enqueue`](Self::enqueue), for the first offending message.
    ///
    /// # Durability
    ///
    /// As [`enqueue`](Self::enqueue), for all of them at once.
    pub fn enqueue_many(&self, messages: Vec<NewMessage>) -> Result<Vec<OutboxItem>> {
        let mut prepared = Vec::with_capacity(messages.len());
        for message in messages {
            message.validate()?;
            let hash = content_hash(&message.content);
            prepared.push((message, hash));
        }
        let items = self.transact(|_, txn| {
            prepared
                .iter()
                .map(|(message, hash)| enqueue::insert_message(txn, message, hash))
                .collect()
        })?;
        self.inner.wakers.wake();
        Ok(items)
    }

    /// The item with this key, if any, live or in history.
    ///
    /// # Errors
    ///
    /// The load errors: [`Error::Corrupt`], [`Error::InvalidRecord`],
    /// [`Error::UnsupportedVersion`], [`Error::Io`].
    pub fn get(&self, key: &str) -> Result<Option<OutboxItem>> {
        on_engine!(self, engine => engine.get(key))
    }

    /// Every live item (queued, and terminal items not yet moved to history),
    /// sorted by key.
    ///
    /// # Errors
    ///
    /// As [`get`](Self::get).
    pub fn list_items(&self) -> Result<Vec<OutboxItem>> {
        on_engine!(self, engine => engine.list(None))
    }

    /// Every item that has moved to history, oldest segment first, read from
    /// disk as you iterate (a million items never sit in memory). An item
    /// requeued out of history and moved back later appears once per move; `get`
    /// returns the live or newest copy.
    ///
    /// # Errors
    ///
    /// As [`get`](Self::get) for taking the listing; each item may be an
    /// [`Error::Io`] or [`Error::InvalidRecord`] for a damaged segment.
    pub fn history_items(&self) -> Result<crate::history::HistoryItems> {
        on_engine!(self, engine => engine.history_items())
    }

    /// How many items have moved to history.
    ///
    /// # Errors
    ///
    /// As [`get`](Self::get).
    pub fn history_len(&self) -> Result<usize> {
        on_engine!(self, engine => engine.history_len())
    }

    /// The item whose delivery returned this transport reference (the platform's
    /// message id), for correlating a reply with what it answers. A blank
    /// reference finds nothing. When several items share a reference, the first by
    /// key wins.
    ///
    /// Use this global lookup only when the platform's ids are unique across
    /// all chats, such as Matrix event ids (`$…`) or ids your connector makes
    /// unique itself. Telegram `message_id`s and Slack `ts` values are unique
    /// only within one chat: there, "7" names a message in every chat, so use
    /// [`find_by_transport_ref_in`](Self::find_by_transport_ref_in) with the
    /// chat the reply came from.
    ///
    /// # Errors
    ///
    /// As [`get`](Self::get).
    pub fn find_by_transport_ref(&self, transport_ref: &str) -> Result<Option<OutboxItem>> {
        if transport_ref.trim().is_empty() {
            return Ok(None);
        }
        on_engine!(self, engine => engine.find_by_transport_ref(None, transport_ref))
    }

    /// The item sent to `destination` whose delivery returned this transport
    /// reference: how a reply is matched on platforms whose message ids are
    /// unique only within a chat (Telegram, Slack). Indexed for live items and
    /// history alike. A blank reference finds nothing; when several items of the
    /// destination share the reference, the first by key wins among live items,
    /// then the newest in history.
    ///
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// use durable_outbox::{NewMessage, Outbox};
    ///
    /// let outbox = Outbox::open(dir.path())?;
    /// for (key, chat) in [("a", "chat-1"), ("b", "chat-2")] {
    ///     outbox.enqueue(NewMessage {
    ///         idempotency_key: key.into(),
    ///         connector: "telegram".into(),
    ///         grant_id: "bot-1".into(),
    ///         destination: chat.into(),
    ///         content: "hello".into(),
    ///         ..Default::default()
    ///     })?;
    ///     // Telegram numbers messages per chat: both are message 7.
    ///     outbox.process(key, |_| Ok(Some("7".into())))?;
    /// }
    /// let reply_to = outbox.find_by_transport_ref_in("chat-2", "7")?.expect("known");
    /// assert_eq!(reply_to.idempotency_key(), "b");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`get`](Self::get).
    pub fn find_by_transport_ref_in(
        &self,
        destination: &str,
        transport_ref: &str,
    ) -> Result<Option<OutboxItem>> {
        if transport_ref.trim().is_empty() {
            return Ok(None);
        }
        on_engine!(self, engine => engine.find_by_transport_ref(Some(destination), transport_ref))
    }

    /// Delivers one item at most once through `send`, the caller's transport call.
    ///
    /// - A terminal item is not sent again: its receipt is returned (and a missing
    ///   terminal audit record is appended, marked reconciled).
    /// - A claim left by a worker that died makes the item `failed` with
    ///   [`AMBIGUOUS_AFTER_RESTART`]; `send` is not called.
    /// - A claim held by a live worker (thread or process) gives
    ///   [`Outcome::InFlight`](crate::Outcome::InFlight) and changes nothing.
    /// - An item not yet due (backoff, `retry_after`, rate deferral) gives
    ///   [`Outcome::Deferred`](crate::Outcome::Deferred) without an attempt.
    /// - A full rate window defers the item to the exact moment a slot frees.
    /// - Otherwise the item is claimed (`attempts + 1`) durably, then `send` runs
    ///   without any lock held. `Ok(Some(id))` stores `id` as the transport ref.
    ///   A retryable error is retried with backoff up to `max_attempts`, sleeping
    ///   inline for waits up to `max_inline_wait` (a longer wait returns
    ///   `Deferred`); permanent and ambiguous errors fail the item at once.
    ///
    /// # Panics
    ///
    /// A panic inside `send` is recorded first (the item fails with
    /// [`SEND_PANICKED`], as an ambiguous delivery), then resumed in the caller.
    ///
    /// # Errors
    ///
    /// [`Error::NotFound`] for an unknown key; the load and write errors of every
    /// operation. If recording the result fails after `send` ran, the item keeps
    /// its claim and becomes ambiguous on the next `process`: it is never resent.
    ///
    /// # Durability
    ///
    /// The claim's journal entry is fsynced before `send` is called; the entry
    /// with the outcome and its audit record is fsynced before this returns.
    pub fn process<F>(&self, key: &str, mut send: F) -> Result<DeliveryReceipt>
    where
        F: FnMut(&OutboxItem) -> std::result::Result<Option<String>, SendError>,
    {
        self.process_one(key, &mut send)
    }

    /// Processes every queued item that is due now and returns a tally.
    /// Retryable failures are rescheduled (no inline sleeping) and counted as
    /// `retried`; rate-capped items are deferred.
    ///
    /// Order: under the default [`Ordering::PerDestination`](crate::Ordering),
    /// messages to one destination go in enqueue order, each only once the one
    /// before it is sent or failed; an item whose predecessor is deferred or
    /// retried stays queued and is reported as [`Outcome::Waiting`](crate::Outcome::Waiting). Across
    /// destinations the pass rotates (least recently served first), so one
    /// flooded destination does not hold the others back. Each item due when
    /// the pass starts is looked at most once; items enqueued meanwhile wait for
    /// the next pass.
    ///
    /// Each item is claimed right before its `send`, in the same durable step
    /// (one journal entry, one fsync) that records the previous item's outcome.
    /// If the process dies, only the item whose `send` had started becomes
    /// ambiguous; every other item is still queued, untouched.
    ///
    /// # Panics
    ///
    /// As [`process`](Self::process): a panic in `send` is recorded, then resumed.
    ///
    /// # Errors
    ///
    /// The first load or write error stops the pass; items already processed
    /// keep their recorded outcomes.
    pub fn process_due<F>(&self, mut send: F) -> Result<DrainReport>
    where
        F: FnMut(&OutboxItem) -> std::result::Result<Option<String>, SendError>,
    {
        let picker = Mutex::new(Picker::pass(self.due_keys()?));
        let mut report = DrainReport::default();
        let mut finished: Option<(ClaimId, SendResult)> = None;
        loop {
            let stepped = self.step(finished.as_ref().map(|(c, r)| (c, r)), Some(&picker))?;
            stepped.tally(&mut report);
            let Some((item, _)) = stepped.claimed else {
                break;
            };
            let claim = ClaimId::of(&item);
            let result: SendResult =
                send_span(&item).in_scope(|| catch_unwind(AssertUnwindSafe(|| send(&item))));
            if result.is_err() {
                if let Err(e) = self.step(Some((&claim, &result)), None) {
                    tracing::error!(error = %e, "could not record a panicked send");
                }
                if let Err(panic) = result {
                    resume_unwind(panic);
                }
            }
            finished = Some((claim, result));
        }
        let picker = picker.into_inner().unwrap_or_else(PoisonError::into_inner);
        self.report_waiting(&picker, &mut report)?;
        self.publish_gauges()?;
        Ok(report)
    }

    /// Adds a `Waiting` receipt for each key of a pass that was never looked
    /// at and is still queued (behind an earlier message to its destination).
    pub(crate) fn report_waiting(&self, picker: &Picker, report: &mut DrainReport) -> Result<()> {
        let unseen = picker.unseen();
        if unseen.is_empty() {
            return Ok(());
        }
        on_engine!(self, engine => engine.report_waiting(&unseen, report))
    }

    /// One durable step of a drain or worker: record `finished` (a send that
    /// ran, with the claim it held), then, if `pick` is given, look at candidates (fairest first) until
    /// one is claimed or none is left. Items looked at and not claimed
    /// (deferred by a cap, failed as ambiguous or exhausted) are reported in
    /// `looked`. All in one transaction: one journal entry, one fsync.
    ///
    /// The claim is in this handle's in-flight set until the next step
    /// records it, or [`release`](Self::release) or [`abandon`](Self::abandon).
    ///
    /// The picker is locked only inside the transaction, not across its sync:
    /// concurrent steps (a worker's slots) then share one commit group.
    pub(crate) fn step(
        &self,
        finished: Option<(&ClaimId, &SendResult)>,
        pick: Option<&Mutex<Picker>>,
    ) -> Result<Stepped> {
        if finished.is_some() {
            self.check_after_send().inspect_err(|_| {
                if let Some((claim, _)) = finished {
                    self.in_flight().remove(claim);
                }
            })?;
        }
        let mut claimed_here: Option<ClaimId> = None;
        let mut rerun = false;
        // A step that records a finished send waits for a connection as
        // long as it takes (see `Wait::UntilFree`).
        let wait = if finished.is_some() {
            Wait::UntilFree
        } else {
            Wait::Bounded
        };
        let stepped = self.transact_waiting(Scope::Any, wait, |actor, txn| {
            // Locked here, inside the transaction, never across its sync: a
            // worker's slots then share one commit group.
            let mut picker = pick.map(|p| p.lock().unwrap_or_else(PoisonError::into_inner));
            if std::mem::replace(&mut rerun, true) {
                // The server rolled back the previous attempt: so is what it
                // did outside the database.
                if let Some(claim) = claimed_here.take() {
                    actor.in_flight().remove(&claim);
                }
                if let Some(picker) = picker.as_deref_mut() {
                    picker.undo_attempt();
                }
            }
            if let Some(picker) = picker.as_deref_mut() {
                picker.begin_attempt();
            }
            let stepped = drain::step(actor, txn, finished, picker.as_deref_mut())?;
            claimed_here = stepped.claimed.as_ref().map(|(item, _)| ClaimId::of(item));
            Ok(stepped)
        });
        if let Some((claim, _)) = finished {
            self.in_flight().remove(claim);
        }
        if stepped.is_err()
            && let Some(claim) = claimed_here
        {
            // A claim that did not commit is not in flight.
            self.in_flight().remove(&claim);
        }
        stepped
    }

    /// The steps of several worker slots as one transaction (see `worker`):
    /// `collect` runs under the engine's lock and returns the members (so
    /// every slot that asked while the lock was busy joins), the rules of
    /// [`drain::step_batch`] run over them, then `ran` is called, still under
    /// the lock (again on each rerun of a transaction PostgreSQL rolled
    /// back). Returns the members and the batch's result; `ran` not called
    /// means the rules failed (or the transaction never began) and nothing
    /// was written. The members' finished claims stay in the in-flight set:
    /// each member takes its own out when it is dropped (the worker's
    /// `Finished`), since after a batch whose rules failed its caller records
    /// each member's send in a step of its own, and until then no look may
    /// take it for an orphan. Claims of a batch that did not commit leave
    /// the set here.
    ///
    /// A panic in the rules (or in `ran`) is caught once the transaction has
    /// unwound (nothing of it committed) and handed back with the members,
    /// so the caller can answer each of them: `Err(payload)`.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn step_batch<M: AsMember>(
        &self,
        collect: impl FnOnce() -> Vec<M>,
        pick: Option<&Mutex<Picker>>,
        mut ran: impl FnMut(&[M]) -> Result<()>,
    ) -> (Vec<M>, std::thread::Result<Result<drain::Batched>>) {
        let mut collect = Some(collect);
        let mut members: Vec<M> = Vec::new();
        let mut claimed_here: Vec<ClaimId> = Vec::new();
        let batched = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // Its members' finished sends are recorded here: it waits for a
            // connection as long as it takes (see `Wait::UntilFree`).
            self.transact_waiting(Scope::Any, Wait::UntilFree, |actor, txn| {
                // A rerun (the server rolled the attempt back) keeps the members
                // it took and undoes what the attempt did outside the database.
                let rerun = collect.is_none();
                if collect.is_some() {
                    // A fault on the way in, before the batch has members.
                    self.check_failpoint("step.collect", "batched step")?;
                }
                if let Some(collect) = collect.take() {
                    members = collect();
                }
                let mut picker = pick.map(|p| p.lock().unwrap_or_else(PoisonError::into_inner));
                if rerun {
                    let mut in_flight = actor.in_flight();
                    for claim in claimed_here.drain(..) {
                        in_flight.remove(&claim);
                    }
                    drop(in_flight);
                    if let Some(picker) = picker.as_deref_mut() {
                        picker.undo_attempt();
                    }
                }
                if let Some(picker) = picker.as_deref_mut() {
                    picker.begin_attempt();
                }
                let views: Vec<drain::Member<'_>> = members.iter().map(AsMember::member).collect();
                // When the rules fail part-way (an engine error in a read
                // after some claims were made), those claims' in-flight
                // marks stay: `claimed_here` learns claims only from a
                // result. Harmless: such a claim never committed, a mark is
                // matched against the claim an item carries (owner, attempt
                // and time: `Actor::is_sending`), and a later claim of ours
                // that would carry the same stamp is made a microsecond
                // later instead (`lifecycle::apart_from_our_sends`), so no
                // committed claim ever matches a leftover mark. What it
                // costs is a few bytes per claim of a failed attempt and, at
                // a clock that has not moved since, that microsecond.
                let batched = drain::step_batch(actor, txn, &views, picker.as_deref_mut())?;
                drop(picker);
                claimed_here.extend(
                    batched
                        .claimed
                        .iter()
                        .flatten()
                        .map(|(item, _)| ClaimId::of(item)),
                );
                ran(&members)?;
                Ok(batched)
            })
        }));
        if !matches!(batched, Ok(Ok(_))) {
            // A claim that did not commit is not in flight.
            let mut in_flight = self.in_flight();
            for claim in &claimed_here {
                in_flight.remove(claim);
            }
        }
        (members, batched)
    }

    /// The earliest moment an item may be claimed: at or before now when one
    /// is due already, `None` when nothing is queued that could go without
    /// another send finishing first. For bots that write their own loop around
    /// [`process_due`](Self::process_due): sleep until this moment (or until an
    /// enqueue), never on a fixed tick.
    ///
    /// Looks at the items a drain would pick: under per-destination order only
    /// each destination's head, and only if no worker is sending it (a
    /// destination whose head is in flight becomes due when that send
    /// finishes). An item deferred by a rate cap, a backoff or a platform's
    /// `retry_after` counts at its `next_attempt_at`; an item a rate cap will
    /// defer but has not been looked at yet counts as due (the drain then
    /// defers it to its exact moment).
    ///
    /// # Errors
    ///
    /// As [`get`](Self::get).
    pub fn next_due_at(&self) -> Result<Option<DateTime<Utc>>> {
        Ok(self.due_summary()?.next_due)
    }

    /// [`next_due_at`](Self::next_due_at), and whether some destination's line
    /// is held by another process's claim (which a crash could leave behind
    /// without any write to wake a worker).
    pub(crate) fn due_summary(&self) -> Result<DueSummary> {
        let now = self.inner.config.clock.now();
        on_engine!(self, engine => engine.due_summary(engine.owner_id(), now))
    }

    /// Registers a listener called after every enqueue and requeue on this
    /// handle or its clones.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn subscribe(&self, listener: crate::wake::Listener) -> u64 {
        self.inner.wakers.subscribe(listener)
    }

    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn unsubscribe(&self, id: u64) {
        self.inner.wakers.unsubscribe(id);
    }

    /// The configured clock.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn clock(&self) -> Arc<dyn Clock> {
        Arc::clone(&self.inner.config.clock)
    }

    /// An operator's decision to send a `failed` item again — the only way an
    /// ambiguous item is ever resent. The item goes back to `queued` with its
    /// attempts reset; a `requeued` audit record names `operator` and `reason`.
    ///
    /// # Errors
    ///
    /// [`Error::NotFound`]; [`Error::InvalidTransition`] for an item that is
    /// `sent` (it left already) or `queued` (nothing to requeue, or in flight);
    /// [`Error::InvalidField`] for a blank or oversize operator or reason; the
    /// load and write errors of every operation.
    ///
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// use durable_outbox::{FailureClass, ItemState, NewMessage, Outbox, SendError};
    ///
    /// let outbox = Outbox::open(dir.path())?;
    /// outbox.enqueue(NewMessage {
    ///     idempotency_key: "order-17".into(),
    ///     connector: "telegram".into(),
    ///     grant_id: "bot-1".into(),
    ///     destination: "chat-42".into(),
    ///     content: "your order shipped".into(),
    ///     ..Default::default()
    /// })?;
    /// // The request was written, then the connection dropped: maybe delivered.
    /// outbox.process("order-17", |_| Err(SendError::ambiguous("reset_after_write")))?;
    /// let failed = outbox.get("order-17")?.expect("exists");
    /// assert_eq!(failed.failure_class(), Some(FailureClass::Ambiguous));
    ///
    /// // The recipient says it never arrived: the operator sends it again.
    /// let item = outbox.requeue("order-17", "alice", "recipient confirmed it never arrived")?;
    /// assert_eq!((item.state(), item.attempts()), (ItemState::Queued, 0));
    /// let history = outbox.history("order-17")?;
    /// assert_eq!(history.last().and_then(|r| r.note.as_deref()),
    ///            Some("alice: recipient confirmed it never arrived"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Durability
    ///
    /// As [`enqueue`](Self::enqueue).
    pub fn requeue(&self, key: &str, operator: &str, reason: &str) -> Result<OutboxItem> {
        let note = operator_note(operator, reason)?;
        let requeued = self.transact_one(key, |_, txn| Bulk::Requeue.one(txn, key, &note))?;
        self.inner.wakers.wake();
        Ok(requeued)
    }

    /// An operator's decision not to send a `queued` item: it becomes `failed`
    /// with [`CANCELLED`], and a `cancelled` audit record names `operator` and
    /// `reason`.
    ///
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// use durable_outbox::{CANCELLED, ItemState, NewMessage, Outbox};
    ///
    /// let outbox = Outbox::open(dir.path())?;
    /// outbox.enqueue(NewMessage {
    ///     idempotency_key: "promo-9".into(),
    ///     connector: "telegram".into(),
    ///     grant_id: "bot-1".into(),
    ///     destination: "chat-42".into(),
    ///     content: "50% off, today only".into(),
    ///     ..Default::default()
    /// })?;
    /// let item = outbox.cancel("promo-9", "alice", "the promotion was withdrawn")?;
    /// assert_eq!((item.state(), item.error_code()), (ItemState::Failed, Some(CANCELLED)));
    /// // Cancelling it again is refused, and says why.
    /// let again = outbox.cancel("promo-9", "alice", "twice").unwrap_err();
    /// assert!(again.to_string().contains("cancelled already"), "{again}");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::NotFound`]; [`Error::InvalidTransition`] for an item that is not
    /// queued (including one cancelled already), or is in flight (claimed by a
    /// worker: it may be leaving right now); [`Error::InvalidField`] for a blank
    /// or oversize operator or reason; the load and write errors of every
    /// operation.
    ///
    /// # Durability
    ///
    /// As [`enqueue`](Self::enqueue).
    pub fn cancel(&self, key: &str, operator: &str, reason: &str) -> Result<OutboxItem> {
        let note = operator_note(operator, reason)?;
        self.transact_one(key, |_, txn| Bulk::Cancel.one(txn, key, &note))
    }

    /// The live items `filter` matches, sorted by key (what a bulk action
    /// would look at). Items moved to history are not included.
    ///
    /// # Errors
    ///
    /// As [`get`](Self::get).
    pub fn select(&self, filter: &ItemFilter) -> Result<Vec<OutboxItem>> {
        on_engine!(self, engine => engine.list(Some(filter)))
    }

    /// [`requeue`](Self::requeue) for every live item `filter` matches, in one
    /// durable step, with one `requeued` audit record per item naming
    /// `operator` and `reason`. Matching items that cannot be requeued (sent,
    /// queued, in flight) are skipped and listed with why. Items already moved
    /// to history are not included: requeue those one by one.
    ///
    /// After an outage, send again everything that failed as retryable:
    ///
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// use durable_outbox::{FailureClass, ItemFilter, ItemState, NewMessage, Outbox, SendError};
    ///
    /// let outbox = Outbox::builder(dir.path()).max_attempts(1).open()?;
    /// for key in ["a", "b"] {
    ///     outbox.enqueue(NewMessage {
    ///         idempotency_key: key.into(),
    ///         connector: "telegram".into(),
    ///         grant_id: "bot-1".into(),
    ///         destination: "chat-42".into(),
    ///         content: "hello".into(),
    ///         ..Default::default()
    ///     })?;
    /// }
    /// outbox.process_due(|_| Err(SendError::retryable("connection_refused")))?;
    ///
    /// let filter = ItemFilter::new()
    ///     .state(ItemState::Failed)
    ///     .class(FailureClass::Retryable);
    /// assert_eq!(outbox.preview_requeue_where(&filter)?.changed.len(), 2, "dry run");
    /// let report = outbox.requeue_where(&filter, "alice", "the platform is back")?;
    /// assert_eq!(report.changed.len(), 2);
    /// assert!(report.changed.iter().all(|i| i.state() == ItemState::Queued));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidField`] for an empty filter (use [`ItemFilter::all`] to
    /// mean every item) or a blank or oversize operator or reason; the load and
    /// write errors of every operation. Nothing is changed on error.
    ///
    /// # Durability
    ///
    /// As [`enqueue`](Self::enqueue), for all of them at once.
    pub fn requeue_where(
        &self,
        filter: &ItemFilter,
        operator: &str,
        reason: &str,
    ) -> Result<BulkReport> {
        self.bulk(
            Bulk::Requeue,
            filter,
            Some(operator_note(operator, reason)?),
        )
    }

    /// [`cancel`](Self::cancel) for every live queued item `filter` matches, in
    /// one durable step, with one `cancelled` audit record per item naming
    /// `operator` and `reason`. Matching items that cannot be cancelled (not
    /// queued, or in flight) are skipped and listed with why.
    ///
    /// # Errors
    ///
    /// As [`requeue_where`](Self::requeue_where).
    ///
    /// # Durability
    ///
    /// As [`enqueue`](Self::enqueue), for all of them at once.
    pub fn cancel_where(
        &self,
        filter: &ItemFilter,
        operator: &str,
        reason: &str,
    ) -> Result<BulkReport> {
        self.bulk(Bulk::Cancel, filter, Some(operator_note(operator, reason)?))
    }

    /// What [`requeue_where`](Self::requeue_where) would do now, without doing
    /// it (a dry run: nothing is written or recorded).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidField`] for an empty filter; the load errors.
    pub fn preview_requeue_where(&self, filter: &ItemFilter) -> Result<BulkReport> {
        self.bulk(Bulk::Requeue, filter, None)
    }

    /// What [`cancel_where`](Self::cancel_where) would do now, without doing it.
    ///
    /// # Errors
    ///
    /// As [`preview_requeue_where`](Self::preview_requeue_where).
    pub fn preview_cancel_where(&self, filter: &ItemFilter) -> Result<BulkReport> {
        self.bulk(Bulk::Cancel, filter, None)
    }

    /// A bulk action; `note` is `None` for a dry run.
    fn bulk(&self, action: Bulk, filter: &ItemFilter, note: Option<String>) -> Result<BulkReport> {
        if filter.is_empty() {
            return Err(Error::invalid_field(
                "filter",
                "an empty filter would match every item; add a criterion or use ItemFilter::all()",
            ));
        }
        let Some(note) = note else {
            let matched = self.select(filter)?;
            let now = self.inner.config.clock.now();
            let (todo, mut report) = action.plan(&matched);
            report.changed = todo
                .into_iter()
                .map(|item| action.preview(item, now))
                .collect();
            return Ok(report);
        };
        let report = self.transact(|_, txn| {
            let matched = txn.select(filter)?;
            action.many(txn, &matched, &note)
        })?;
        if action == Bulk::Requeue && !report.changed.is_empty() {
            self.inner.wakers.wake();
        }
        Ok(report)
    }

    /// An operator's decision to delete old audit history: removes all sealed
    /// audit segments but the newest `keep`, after a `pruned` audit record
    /// (key `audit-segments`) naming `operator`, `reason`, the range and where
    /// the chain now starts (`the chain now starts after seq S hash H`: the
    /// last removed record). The outbox never does this by itself. Returns
    /// how many segments were removed; with no more than `keep`, nothing is
    /// written and it returns 0. Items are not touched, only their records.
    ///
    /// **In a directory** the segments are the files `audit-<first
    /// seq>.jsonl` that compaction sealed once the active log passed
    /// [`audit_rotate_bytes`](crate::OutboxBuilder::audit_rotate_bytes).
    /// Verification then starts at `audit.anchor`, the last removed record.
    ///
    /// **On PostgreSQL** the chain is one table, so a segment is counted the
    /// way the file engine seals one, by this handle's `audit_rotate_bytes`:
    /// from the chain's first record, a segment ends at the first record that
    /// brings its lines (as `audit.jsonl` would hold them) to that size; the
    /// records after the last such one are the active part and always stay.
    /// One transaction takes the head of the chain as every sealer does,
    /// seals what is pending, appends the `pruned` record and deletes the
    /// removed rows; another host's commits meanwhile wait as pending events
    /// and are sealed after it, and a failure before the commit (a lost
    /// connection included) leaves the chain as it was; when the connection
    /// is lost during the commit itself, the removal may have happened: its
    /// `pruned` record at the head of [`audit_records`](Self::audit_records)
    /// says so (run it again only if it is not there). No anchor is kept outside the chain:
    /// verification starts at the first row, which must follow the last
    /// removed record exactly as a removal's record in the chain names it, so
    /// rows deleted from the front by hand are found ([`AuditFault::FrontCut`](crate::AuditFault::FrontCut)).
    ///
    /// On both engines, an export of what is left ([`audit_records`](Self::audit_records),
    /// the CLI's `export --audit`) verifies on its own with
    /// [`AuditLog::verify`](crate::AuditLog::verify) and `fixtures/verify_audit.py`.
    /// [`compact`](Self::compact) never removes audit records.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidField`] for a blank operator or reason; the load and
    /// write errors of every operation ([`Error::Database`] on PostgreSQL).
    ///
    /// # Durability
    ///
    /// In a directory the record is durable (journal, then log) before
    /// `audit.anchor` is written and the segments unlinked; a crash between
    /// leaves files the next removal finishes. On PostgreSQL the record and
    /// the deletion commit together or not at all (a connection lost during
    /// the commit may leave it unknown which: see above).
    pub fn remove_old_audit_segments(
        &self,
        keep: usize,
        operator: &str,
        reason: &str,
    ) -> Result<usize> {
        let note = operator_note(operator, reason)?;
        on_engine!(self, engine => engine.remove_old_audit_segments(keep, &note))
    }

    /// Verifies the whole audit chain (every sealed segment and the active log)
    /// and cross-checks it against the head the state recorded, so a truncated
    /// log is detected too. Like every call, it first re-appends records a crash
    /// kept out of the log (from the journal, byte for byte).
    ///
    /// # Errors
    ///
    /// [`Error::AuditBroken`] naming the first bad line and the fault, including
    /// [`AuditFault::Truncated`](crate::AuditFault::Truncated); the load errors of `outbox.json`.
    /// On PostgreSQL the `audit` table is checked the same way, row by row in
    /// `seq` order, against its head row ([`Error::AuditBroken`] names
    /// `postgres:<schema>.audit` and the position), from its first row: seq
    /// 1, or, after [`remove_old_audit_segments`](Self::remove_old_audit_segments),
    /// the row after the last removed record, which the removal's record names
    /// ([`AuditFault::FrontCut`](crate::AuditFault::FrontCut) when none does).
    pub fn verify_audit(&self) -> Result<AuditReport> {
        on_engine!(self, engine => engine.verify_audit())
    }

    /// Housekeeping now: the same pass every open runs, at a moment of your
    /// choosing. A bot that stays up for weeks calls it now and then (say,
    /// daily) to apply `history_retention` without reopening.
    ///
    /// In a directory it writes a fresh `outbox.json` snapshot and starts an
    /// empty journal (the outbox also does this by itself when the journal
    /// outgrows the snapshot; call it before copying `outbox.json` for a
    /// backup), moves terminal items past `history_after` to a history
    /// segment, seals a large audit log into a segment, and prunes history
    /// segments `history_retention` no longer keeps, each prune on record.
    ///
    /// On PostgreSQL (no journal or snapshot; history is a view of old
    /// terminal rows, so nothing moves) it seals every audit event committed
    /// and not yet on the chain, and applies `history_retention` `MaxAge`:
    /// terminal items changed longer ago than that age (and outside every
    /// rate window) are deleted, with one `pruned` audit record.
    ///
    /// Neither engine removes audit records here: that is an operator's
    /// decision ([`remove_old_audit_segments`](Self::remove_old_audit_segments),
    /// files only).
    ///
    /// # Errors
    ///
    /// The load and write errors of every operation; on PostgreSQL
    /// [`Error::Database`] (each step is one transaction: a failed one wrote
    /// nothing, and the steps before it stand).
    ///
    /// # Durability
    ///
    /// In a directory, returns after the audit log, the new snapshot and the
    /// new journal are fsynced; on PostgreSQL, after each step's `COMMIT`.
    pub fn compact(&self) -> Result<()> {
        on_engine!(self, engine => engine.compact())
    }

    /// Appends any audit records a crash left pending and re-checks the log's tail.
    /// Every write does this first; call it to repair without writing anything else.
    ///
    /// # Errors
    ///
    /// The load and write errors of every operation.
    pub fn reconcile(&self) -> Result<()> {
        self.transact(|_, _| Ok(()))
    }

    /// The audit log's current head (seq and hash).
    ///
    /// # Errors
    ///
    /// The errors of reading the audit log's new records.
    pub fn audit_head(&self) -> Result<Head> {
        on_engine!(self, engine => engine.audit_head())
    }

    /// The settings in force: what the outbox stores (see
    /// [`OutboxBuilder::update_settings`]), and this handle's builder values for
    /// anything it does not store.
    ///
    /// # Errors
    ///
    /// As [`get`](Self::get).
    pub fn settings(&self) -> Result<Settings> {
        on_engine!(self, engine => engine.settings())
    }

    /// Every destination with something in its rate window, something queued,
    /// or a platform cooldown, measured now against the cap in force for it (or
    /// against `what_if` instead), sorted by destination. Sends count as the
    /// outbox counts them: sends, sends in progress and sends that may have
    /// left (ambiguous failures), from their send or claim time.
    ///
    /// # Errors
    ///
    /// As [`get`](Self::get).
    pub fn rate_windows(&self, what_if: Option<RateLimit>) -> Result<Vec<DestinationWindow>> {
        let now = self.inner.config.clock.now();
        on_engine!(self, engine => engine.rate_windows(what_if, now))
    }

    /// Every audit record for one item, oldest first.
    ///
    /// # Errors
    ///
    /// The errors of [`AuditLog::read`](crate::AuditLog::read).
    pub fn history(&self, key: &str) -> Result<Vec<AuditRecord>> {
        #[cfg(feature = "postgres")]
        if let Backend::Postgres(engine) = &self.inner.backend {
            return engine.history(key);
        }
        let mut records = Vec::new();
        for record in crate::audit::AuditLog::records_dir(self.file_dir("history")?)? {
            let record = record?;
            if record.idempotency_key == key {
                records.push(record);
            }
        }
        Ok(records)
    }

    /// How often the armed test failpoint `name` was reached on this handle
    /// (feature `test-failpoints` only; the file engine's points, 0 elsewhere).
    #[cfg(any(test, feature = "test-failpoints"))]
    #[doc(hidden)]
    pub fn failpoint_hits(&self, name: &str) -> u32 {
        match &self.inner.backend {
            Backend::File(engine) => engine.failpoint_hits(name),
            #[cfg(feature = "postgres")]
            Backend::Postgres(engine) => engine.engine().faults.hits(name),
        }
    }

    /// The PostgreSQL audit records after `after`, one page.
    #[cfg(feature = "postgres")]
    fn audit_page(&self, after: u64) -> Result<Vec<AuditRecord>> {
        match &self.inner.backend {
            Backend::Postgres(engine) => crate::engine::postgres::blocking(|| {
                // Counts the pages read (tests: the stream is paged).
                engine
                    .engine()
                    .faults
                    .check("postgres.audit_page")
                    .map_err(|e| Error::io(self.location(), "read an audit page", e))?;
                engine
                    .engine()
                    .audit_page(after, crate::engine::postgres::AUDIT_PAGE)
            }),
            Backend::File(_) => Ok(Vec::new()),
        }
    }

    /// Every audit record, in chain order: on a directory, streamed from its
    /// audit files (sealed segments, then `audit.jsonl`, as
    /// [`AuditLog::records_dir`](crate::AuditLog::records_dir)); on
    /// PostgreSQL, read from the `audit` table a page of 1,000 records at a
    /// time, by seq (each page after sealing what is pending), so a long
    /// chain is streamed in bounded memory. For tools that read the whole log
    /// (the CLI's `verify` and `export --audit`) without knowing the engine.
    /// Records past [`audit_head`](Self::audit_head) may appear while a bot
    /// writes. Each record follows the one before: when a
    /// [`remove_old_audit_segments`](Self::remove_old_audit_segments) takes
    /// records this reader has not reached yet, it stops there with an error
    /// instead of handing out a chain with a hole (read it again).
    ///
    /// # Errors
    ///
    /// [`Error::Io`] when the directory cannot be listed, [`Error::Database`]
    /// when the table cannot be read; each item as
    /// [`AuditLog::records`](crate::AuditLog::records), and
    /// [`Error::AuditBroken`] with [`AuditFault::SeqGap`](crate::AuditFault::SeqGap)
    /// (the seq expected, the seq found) for the first record that does not
    /// follow the one before, after which the reader ends.
    pub fn audit_records(&self) -> Result<crate::audit::AuditChainRecords> {
        #[cfg(feature = "postgres")]
        if let Backend::Postgres(_) = &self.inner.backend {
            let outbox = self.clone();
            return Ok(crate::audit::AuditChainRecords::paged(
                std::path::PathBuf::from(format!("{}.audit", self.location())),
                Box::new(move |after| outbox.audit_page(after)),
            ));
        }
        let records = crate::audit::AuditLog::records_dir(self.file_dir("audit_records")?)?;
        #[cfg(any(test, feature = "test-failpoints"))]
        let records = {
            let outbox = self.clone();
            records.before_each_next_file(Box::new(move || {
                // Only pauses and delays are meant here: a failure has
                // nowhere to go.
                let _ = outbox.check_failpoint("audit.next_file", "read the audit log");
            }))
        };
        Ok(records)
    }

    /// Runs `f` (a rule, given this handle as its [`Actor`]) inside one
    /// transaction of the engine: everything it changes and every record it
    /// seals commit together, durably, or not at all.
    ///
    /// `f` may run more than once: PostgreSQL reruns a transaction it aborted
    /// to break a deadlock (`engine::postgres::retry`). What `f` does outside
    /// the transaction must be undone by its next run or be repeatable:
    /// `send` never runs inside it; a claim's mark in the in-flight set and a
    /// picker's notes are undone by [`step`](Self::step) and
    /// [`claim`](Self::claim); what pacing learns from a refusal is a
    /// maximum, the same when learnt twice at the same moment.
    fn transact<T>(&self, f: impl FnMut(&Actor<'_>, &mut dyn Txn) -> Result<T>) -> Result<T> {
        self.transact_in(Scope::Any, f)
    }

    /// Runs `f`, which reads and changes the one item `key` names (see
    /// [`Scope::OneItem`]), in one transaction of the engine.
    fn transact_one<T>(
        &self,
        key: &str,
        f: impl FnMut(&Actor<'_>, &mut dyn Txn) -> Result<T>,
    ) -> Result<T> {
        self.transact_in(Scope::OneItem(key), f)
    }

    fn transact_in<T>(
        &self,
        scope: Scope<'_>,
        f: impl FnMut(&Actor<'_>, &mut dyn Txn) -> Result<T>,
    ) -> Result<T> {
        self.transact_waiting(scope, Wait::Bounded, f)
    }

    /// Runs `f` as [`transact_in`](Self::transact_in) does, waiting for a
    /// connection as `wait` says (see [`Wait`]).
    fn transact_waiting<T>(
        &self,
        #[cfg_attr(not(feature = "postgres"), allow(unused_variables))] scope: Scope<'_>,
        #[cfg_attr(not(feature = "postgres"), allow(unused_variables))] wait: Wait,
        mut f: impl FnMut(&Actor<'_>, &mut dyn Txn) -> Result<T>,
    ) -> Result<T> {
        let inner = &*self.inner;
        match &inner.backend {
            Backend::File(engine) => {
                let actor = Actor {
                    owner: engine.owner_id(),
                    in_flight: &inner.in_flight,
                    pacing: &inner.pacing,
                    idempotent: &inner.config.idempotent,
                };
                engine.transact(|txn| f(&actor, txn))
            }
            #[cfg(feature = "postgres")]
            Backend::Postgres(engine) => {
                let actor = Actor {
                    owner: engine.owner_id(),
                    in_flight: &inner.in_flight,
                    pacing: &inner.pacing,
                    idempotent: &inner.config.idempotent,
                };
                engine.transact(scope, wait, |txn| f(&actor, txn))
            }
        }
    }

    pub(crate) fn in_flight(&self) -> std::sync::MutexGuard<'_, InFlight> {
        self.inner
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// One item through decide → send → record, looping for inline retries.
    fn process_one(
        &self,
        key: &str,
        send: &mut dyn FnMut(&OutboxItem) -> std::result::Result<Option<String>, SendError>,
    ) -> Result<DeliveryReceipt> {
        // Paced retries (a `retry_after`) consume no attempt, so the attempts
        // alone do not bound this loop: at most `max_attempts` sends per call.
        let mut sends = 0;
        loop {
            let item = match self.claim(key)? {
                Claimed::Done(receipt) => return Ok(receipt),
                Claimed::Send(item, _) => item,
            };
            let claim = ClaimId::of(&item);
            let result: SendResult =
                send_span(&item).in_scope(|| catch_unwind(AssertUnwindSafe(|| send(&item))));
            sends += 1;
            let (receipt, retry_wait) = self.record_result(&claim, result)?;
            match retry_wait {
                Some(wait)
                    if wait <= self.inner.config.max_inline_wait && sends < self.max_attempts() =>
                {
                    self.inner.config.sleeper.sleep(wait);
                }
                _ => return Ok(receipt),
            }
        }
    }

    /// Step one of a send: decide, and claim durably if the item is to go now.
    /// A claim is in this handle's in-flight set until
    /// [`record_result`](Self::record_result) or [`abandon`](Self::abandon).
    pub(crate) fn claim(&self, key: &str) -> Result<Claimed> {
        let mut claimed_here: Option<ClaimId> = None;
        // A decision: the engine may read the item's line as it opens.
        let decided = self.transact_in(Scope::Decide(key), |actor, txn| {
            if let Some(claim) = claimed_here.take() {
                // A rerun: the server rolled back the claim the previous
                // attempt marked in flight.
                actor.in_flight().remove(&claim);
            }
            let decision = lifecycle::decide(actor, txn, key)?;
            if let Decision::Send(item, _) = &decision {
                claimed_here = Some(ClaimId::of(item));
            }
            Ok(decision)
        });
        match decided {
            Ok(Decision::Done(receipt)) => Ok(Claimed::Done(receipt)),
            Ok(Decision::Send(item, before)) => Ok(Claimed::Send(item, before)),
            Err(e) => {
                // A claim that did not commit is not in flight. Only this call's:
                // another thread of this handle may be sending the same key.
                if let Some(claim) = claimed_here {
                    self.in_flight().remove(&claim);
                }
                Err(e)
            }
        }
    }

    /// Step two: record what `send` did under `claim` and take the claim out
    /// of the in-flight set. A panic is recorded, then resumed. Returns the
    /// receipt and, for a retryable failure with attempts left, how long to
    /// wait.
    pub(crate) fn record_result(
        &self,
        claim: &ClaimId,
        result: SendResult,
    ) -> Result<(DeliveryReceipt, Option<Duration>)> {
        let key = claim.key();
        let recorded = self.check_after_send().and_then(|()| {
            self.transact_waiting(Scope::AfterSend(key), Wait::UntilFree, |actor, txn| {
                lifecycle::finish(actor, txn, claim, &result)
            })
        });
        self.in_flight().remove(claim);
        match result {
            Err(panic) => {
                if let Err(e) = recorded {
                    tracing::error!(key, error = %e, "could not record a panicked send");
                }
                resume_unwind(panic)
            }
            Ok(_) => recorded,
        }
    }

    /// Gives up on a claimed send whose outcome will never be known (its future
    /// was dropped mid-flight): the item fails with `code`, as ambiguous, or,
    /// for an idempotent transport, goes back to the queue for a resend.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn abandon(&self, claim: &ClaimId, code: &str) -> Result<()> {
        let result = self.transact_waiting(
            Scope::AfterSend(claim.key()),
            Wait::UntilFree,
            |actor, txn| lifecycle::abandon(actor, txn, claim, code),
        );
        self.in_flight().remove(claim);
        result
    }

    /// Gives back a claim whose item was never handed to `send` (its async
    /// caller went away before the send started): the item is restored exactly
    /// as it was before the claim. Does nothing if the item no longer holds
    /// `claim`.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn release(&self, claim: &ClaimId, before: &OutboxItem) -> Result<()> {
        let result = self.transact_waiting(
            Scope::AfterSend(claim.key()),
            Wait::UntilFree,
            |actor, txn| lifecycle::release(actor, txn, claim, before),
        );
        self.in_flight().remove(claim);
        result
    }

    /// The keys of the items due now, oldest first.
    pub(crate) fn due_keys(&self) -> Result<Vec<String>> {
        let now = self.inner.config.clock.now();
        on_engine!(self, engine => engine.due_keys(now))
    }

    /// Sets the queue gauges (feature `metrics`; nothing without it).
    ///
    /// # Errors
    ///
    /// The load errors.
    #[cfg_attr(
        not(feature = "metrics"),
        allow(
            clippy::unused_self,
            clippy::unnecessary_wraps,
            reason = "a no-op without the metrics feature"
        )
    )]
    pub(crate) fn publish_gauges(&self) -> Result<()> {
        #[cfg(feature = "metrics")]
        {
            let now = self.inner.config.clock.now();
            on_engine!(self, engine => engine.publish_gauges(now))?;
        }
        Ok(())
    }

    /// The configured `max_attempts` (bounds inline retries per call).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn max_attempts(&self) -> u32 {
        self.settings().map_or(
            on_engine!(self, engine => engine.defaults().max_attempts),
            |s| s.max_attempts,
        )
    }

    /// The longest retry wait `process` sleeps through inline.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn max_inline_wait(&self) -> Duration {
        self.inner.config.max_inline_wait
    }

    /// The configured sleeper (for inline retry waits).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn sleeper(&self) -> Arc<dyn Sleeper> {
        Arc::clone(&self.inner.config.sleeper)
    }

    /// The test failpoint `name` of a file engine, reached as the I/O step
    /// `op` (nothing on PostgreSQL, or without the `test-failpoints` feature).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn check_failpoint(&self, name: &str, op: &'static str) -> Result<()> {
        match &self.inner.backend {
            Backend::File(engine) => engine.check_failpoint(name, op),
            #[cfg(feature = "postgres")]
            Backend::Postgres(engine) => engine
                .engine()
                .faults
                .check(name)
                .map_err(|e| Error::io(self.location(), op, e)),
        }
    }

    /// The fault point between a send and the transaction that records it.
    pub(crate) fn check_after_send(&self) -> Result<()> {
        on_engine!(self, engine => engine.check_after_send())
    }
}

/// The `outbox.send` span around one call of the caller's `send`.
pub(crate) fn send_span(item: &OutboxItem) -> tracing::Span {
    tracing::info_span!(
        "outbox.send",
        key = %item.idempotency_key,
        destination = %item.destination,
        attempt = item.attempts,
    )
}
