//! The `Outbox` handle: enqueue, process, correlate, audit.

use std::collections::{BTreeMap, HashSet};
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use chrono::{DateTime, Utc};
use sha2::{Digest, Sha256};

use crate::audit::{AuditEvent, AuditOutcome, AuditRecord, AuditReport, AuditTail, Hasher, Head};
use crate::builder::OutboxBuilder;
use crate::clock::{Clock, Sleeper, earlier, format_timestamp, later};
use crate::commit::{Group, Synced};
use crate::error::{AuditFault, Error, Result};
use crate::failpoint::Failpoints;
use crate::filter::{BulkReport, ItemFilter};
use crate::fsutil;
use crate::history::{History, Retention};
use crate::item::{Claim, ItemState, OutboxItem};
use crate::lock::{self, DirLock, OwnerLease};
use crate::message::{DEFAULT_DIRECTION, DEFAULT_LANE, NewMessage, content_hash, limits};
use crate::order::{self, OrderKey, Picker};
use crate::pacing::{self, Pacing};
use crate::rate::{DestinationWindow, RateLimit, RatePolicy};
use crate::receipt::{DeliveryReceipt, DrainReport, Outcome};
use crate::send::{FailureClass, SendError};
use crate::settings::{self, Settings};
use crate::store::{CommitFailure, Loaded, Store, rate_times};
use crate::wake::Wakers;

/// How many due fronts one step looks at (beyond claimed and just-changed
/// items): enough for fair rotation, small enough that a step costs the same
/// with fifty thousand destinations as with five.
const CANDIDATE_WINDOW: usize = 64;

/// The error code of an item whose claimant died mid-send: it may or may not have left.
pub const AMBIGUOUS_AFTER_RESTART: &str = "ambiguous_delivery_after_restart";
/// The error code of an item whose `send` panicked (treated as ambiguous).
pub const SEND_PANICKED: &str = "send_panicked";
/// The error code of an item whose async send future was dropped before it
/// finished (treated as ambiguous: it may have been delivered). Set by the
/// `tokio` feature's `process_async`; defined always so tools can recognise it.
pub const SEND_CANCELLED: &str = "send_cancelled";
/// The error code of an item an operator cancelled.
pub const CANCELLED: &str = "cancelled_by_operator";
/// The error code on a deferral because the platform asked (with `retry_after`)
/// not to send to the destination until a moment that has not come yet.
pub const DESTINATION_COOLDOWN: &str = "destination_cooldown";
/// The error code on a deferral because sends to the destination are spaced
/// by the interval learned from its `retry_after`s (adaptive pacing: after a
/// 429, one send per learned interval instead of a herd when the cooldown ends).
pub const DESTINATION_PACED: &str = "destination_paced";
/// The error code on a deferral caused by the cap across all destinations.
pub const GLOBAL_RATE_CAPPED: &str = "global_rate_cap";
/// The error code on a deferral caused by the destination's rate cap.
pub const RATE_CAPPED: &str = "destination_rate_cap";
/// The error code of an item still failing (retryably) when its
/// [`give_up_after`](crate::OutboxBuilder::give_up_after) age ran out: it was
/// never delivered, and the outbox stopped trying.
pub const GAVE_UP: &str = "gave_up_after_deadline";
/// The error code of a queued item that already used up its attempts (e.g. after
/// `max_attempts` was lowered).
pub const ATTEMPTS_EXHAUSTED: &str = "max_attempts_exhausted";

/// A durable, at-most-once outbox in one directory.
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
/// let original = outbox.find_by_transport_ref("tg-981")?.expect("correlated");
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
            .field("dir", &self.inner.dir)
            .field("owner", &self.inner.owner.id())
            .finish_non_exhaustive()
    }
}

struct Config {
    /// This handle's builder values of the stored settings: what a setting the
    /// outbox does not store falls back to (see `settings`).
    defaults: Settings,
    max_inline_wait: Duration,
    audit_rotate_bytes: u64,
    clock: Arc<dyn Clock>,
    sleeper: Arc<dyn Sleeper>,
    /// Connectors whose platform deduplicates by transaction id, and for how long.
    idempotent: BTreeMap<String, Duration>,
}

struct Inner {
    dir: PathBuf,
    store: Store,
    /// Held only for read-modify-write; never across `send`. Guards the audit tail.
    lock: DirLock<Locked>,
    /// This handle's liveness token; claims name its id.
    owner: OwnerLease,
    /// Keys this handle is sending right now. A claim naming our owner id but
    /// missing here was left by a call of ours that failed after claiming.
    in_flight: Mutex<HashSet<String>>,
    /// Set after a durability failure whose outcome on disk is unknown.
    poisoned: AtomicBool,
    /// The commit group: transactions waiting for their journal entry's sync.
    group: Group,
    /// The settings this handle stores with its first change, when it opened a
    /// new outbox (unless another handle stored its own first).
    initial_settings: Option<crate::settings::Stored>,
    /// Workers waiting for new items; called after every enqueue and requeue.
    wakers: Wakers,
    config: Config,
    faults: Failpoints,
    /// Per destination, the spacing learned from the platform's `retry_after`s.
    pacing: Pacing,
}

/// What this process knows that is only touched under the directory lock.
struct Locked {
    audit: AuditTail,
    /// The state, loaded on first use and kept current (see `store`).
    loaded: Option<Loaded>,
    /// The history segments' indexes, loaded as far as `history_generation`.
    history: History,
    /// The snapshot generation the history was last refreshed for: segments
    /// only ever appear with a compaction, which bumps the generation.
    history_generation: Option<u64>,
    /// Journal entries this handle has written: the last commit ticket handed out.
    written: u64,
    /// Syncs since this process last took the `flock`.
    hold_syncs: u32,
    /// When this process's current commit group took the `flock`.
    hold_since: Option<std::time::Instant>,
}

impl Locked {
    /// Catches up on the audit log, the state and (after a compaction elsewhere)
    /// the history. Returns the pieces, borrowed separately.
    fn refresh<'a>(
        &'a mut self,
        store: &Store,
    ) -> Result<(&'a mut AuditTail, &'a mut Loaded, &'a mut History)> {
        self.refresh_with(store, true)
    }

    /// As [`refresh`](Self::refresh); `with_audit: false` skips the audit log,
    /// for reads that do not look at it (open has read it once already).
    fn refresh_with<'a>(
        &'a mut self,
        store: &Store,
        with_audit: bool,
    ) -> Result<(&'a mut AuditTail, &'a mut Loaded, &'a mut History)> {
        let Self {
            audit,
            loaded,
            history,
            history_generation,
            ..
        } = self;
        let loaded = store.refresh(loaded)?;
        if with_audit {
            let state = &loaded.state;
            if audit.is_fresh() {
                // First look: start after the sealed segments, and resume the
                // active log where the last compaction verified it, so opening
                // costs the recent records, not the whole history.
                audit.load_base()?;
                if let (Some(head), Some(offset)) = (&state.audit_head, state.audit_offset)
                    && !audit.resume_at(head, offset)?
                {
                    tracing::warn!(
                        "the audit log does not match the resume point in outbox.json; verifying it from the start"
                    );
                }
            }
            // The snapshot's head was fsynced before the snapshot was written:
            // past it, the log may hold whatever a power cut left.
            audit.note_durable(state.audit_head.as_ref().map_or(0, |h| h.seq));
            audit.catch_up()?;
        }
        if *history_generation != Some(loaded.state.generation) {
            history.refresh()?;
            *history_generation = Some(loaded.state.generation);
        }
        Ok((audit, loaded, history))
    }

    /// The pieces as they are, for a caller whose cached state is current.
    fn parts(&mut self, store: &Store) -> Result<(&mut AuditTail, &mut Loaded, &mut History)> {
        if self.loaded.is_none() {
            return self.refresh(store);
        }
        let Self {
            audit,
            loaded,
            history,
            ..
        } = self;
        let Some(loaded) = loaded.as_mut() else {
            unreachable!("loaded above")
        };
        Ok((audit, loaded, history))
    }
}

/// The head the next audit record chains to: the last record journalled, which
/// is ahead of the log while a commit group waits for its sync.
fn sealing_head(audit: &AuditTail, loaded: &Loaded) -> Head {
    match loaded.journal_audit.last() {
        Some(last) if last.seq > audit.head().seq => Head {
            seq: last.seq,
            hash: last.hash.clone(),
        },
        _ => audit.head().clone(),
    }
}

/// One read-modify-write: reads see the committed state plus this transaction's
/// own changes; nothing is visible to anyone else until it commits.
struct Txn<'a> {
    base: &'a Loaded,
    /// Terminal items that left the live state; read only.
    history: &'a History,
    /// Items changed by this transaction (whole new versions).
    overlay: BTreeMap<String, OutboxItem>,
    /// Audit records this transaction produces, sealed in order after `head`.
    records: Vec<AuditRecord>,
    head: Head,
    hasher: &'a Hasher,
    now: DateTime<Utc>,
    /// The settings in force: stored ones over this handle's.
    settings: Settings,
    /// The last enqueue sequence handed out (starts at the largest live one).
    last_seq: u64,
}

impl Txn<'_> {
    fn item(&self, key: &str) -> Option<&OutboxItem> {
        self.overlay
            .get(key)
            .or_else(|| self.base.state.items.get(key))
    }

    fn item_mut(&mut self, key: &str) -> Result<&mut OutboxItem> {
        if !self.overlay.contains_key(key) {
            let item = self
                .base
                .state
                .items
                .get(key)
                .ok_or_else(|| Error::NotFound {
                    key: key.to_owned(),
                })?;
            self.overlay.insert(key.to_owned(), item.clone());
        }
        match self.overlay.get_mut(key) {
            Some(item) => Ok(item),
            None => unreachable!("inserted above"),
        }
    }

    /// The item with this key, brought back from history into this transaction
    /// if it had moved there (it is written back only if the transaction commits).
    fn live_item(&mut self, key: &str) -> Result<&OutboxItem> {
        if self.item(key).is_none()
            && let Some(old) = self.history.get(key)?
        {
            self.insert(old);
        }
        self.item(key).ok_or_else(|| Error::NotFound {
            key: key.to_owned(),
        })
    }

    fn insert(&mut self, item: OutboxItem) {
        self.overlay.insert(item.idempotency_key.clone(), item);
    }

    /// The next enqueue sequence: larger than every live item's.
    fn next_seq(&mut self) -> u64 {
        self.last_seq += 1;
        self.last_seq
    }

    /// The place of `destination`'s head: its earliest queued item, as this
    /// transaction sees it.
    fn head_of(&self, destination: &str) -> Option<OrderKey> {
        let committed = self
            .base
            .index
            .lines
            .line(destination)
            .find(|place| !self.overlay.contains_key(&place.key))
            .cloned();
        let pending = self
            .overlay
            .values()
            .filter(|i| i.destination == destination && i.state == ItemState::Queued)
            .map(OrderKey::of)
            .min();
        committed.into_iter().chain(pending).min()
    }

    /// The items to decide next, at most one per destination and at most
    /// [`CANDIDATE_WINDOW`] from the committed state: claimed items (a claim may
    /// be dead, and deciding fails it as ambiguous), the items this transaction
    /// changed or made head, then the fronts due by now, earliest due first.
    /// Under per-destination order only heads qualify. `admits` filters further.
    fn candidates(
        &self,
        ordering: order::Ordering,
        admits: impl Fn(&OutboxItem) -> bool,
    ) -> Vec<(String, OrderKey)> {
        let mut out: Vec<(String, OrderKey)> = Vec::new();
        let mut destinations: HashSet<String> = HashSet::new();
        let mut consider = |place: &OrderKey| {
            let Some(item) = self.item(&place.key) else {
                return;
            };
            let ready = item.state == ItemState::Queued
                && (item.claim.is_some() || item.next_attempt_at.is_none_or(|at| at <= self.now));
            let in_line = ordering == order::Ordering::Unordered
                || self
                    .head_of(&item.destination)
                    .is_some_and(|head| head.key == place.key);
            if ready && in_line && admits(item) && destinations.insert(item.destination.clone()) {
                out.push((item.destination.clone(), place.clone()));
            }
        };
        let lines = &self.base.index.lines;
        for place in lines.claimed() {
            if !self.overlay.contains_key(&place.key) {
                consider(place);
            }
        }
        for item in self.overlay.values() {
            if item.state == ItemState::Queued {
                consider(&OrderKey::of(item));
            }
            if let Some(head) = self.head_of(&item.destination) {
                consider(&head);
            }
        }
        for place in lines
            .due_fronts(ordering, self.now)
            .filter(|place| !self.overlay.contains_key(&place.key))
            .take(CANDIDATE_WINDOW)
        {
            consider(place);
        }
        out
    }

    fn changed(&self) -> bool {
        !self.overlay.is_empty() || !self.records.is_empty()
    }

    /// The latest platform cooldown on `destination` still in force at `now`:
    /// the destination's own (whatever became of the items that received it),
    /// or one this transaction just received.
    fn destination_cooldown(&self, destination: &str, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let committed = self.base.state.cooldowns.get(destination).copied();
        let pending = self
            .overlay
            .values()
            .filter(|i| i.destination == destination)
            .filter_map(|i| i.cooldown_until)
            .max();
        committed.max(pending).filter(|until| *until > now)
    }

    /// Send and claim times of every destination since `since`.
    fn all_times(&self, since: DateTime<Utc>) -> Vec<DateTime<Utc>> {
        let mut times: Vec<DateTime<Utc>> = self
            .base
            .index
            .all_rate_times_since(since)
            .filter(|(_, key)| !self.overlay.contains_key(*key))
            .map(|(at, _)| at)
            .collect();
        times.extend(self.overlay.values().flat_map(rate_times));
        times
    }

    /// Send and claim times of `destination` since `since` (claims count: they
    /// may be sending now), as this transaction sees them.
    fn destination_times(&self, destination: &str, since: DateTime<Utc>) -> Vec<DateTime<Utc>> {
        let mut times: Vec<DateTime<Utc>> = self
            .base
            .index
            .rate_times_since(destination, since)
            .filter(|(_, key)| !self.overlay.contains_key(*key))
            .map(|(at, _)| at)
            .collect();
        times.extend(
            self.overlay
                .values()
                .filter(|i| i.destination == destination)
                .flat_map(rate_times),
        );
        times
    }
}

/// What the decision step of `process` concluded.
enum Decision {
    Done(DeliveryReceipt),
    /// Claimed: the item as claimed, and as it was before (to release it unchanged).
    Send(Box<OutboxItem>, Box<OutboxItem>),
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

/// What one [`Outbox::step`] did.
#[derive(Default)]
pub(crate) struct Stepped {
    /// The recorded outcome of the send that finished, and its retry wait.
    pub(crate) finished: Option<(DeliveryReceipt, Option<Duration>)>,
    /// Items looked at and not claimed: deferred, or failed (ambiguous, exhausted).
    pub(crate) looked: Vec<DeliveryReceipt>,
    /// The item claimed for the next send, as claimed and as it was before.
    pub(crate) claimed: Option<(Box<OutboxItem>, Box<OutboxItem>)>,
}

impl Stepped {
    /// Adds the finished send and the items looked at to a drain's tally.
    pub(crate) fn tally(&self, report: &mut DrainReport) {
        if let Some((receipt, wait)) = &self.finished {
            report.add(receipt.clone(), wait.is_some());
        }
        for receipt in &self.looked {
            report.add(receipt.clone(), false);
        }
    }
}

/// When the next item is due, for a worker's sleep.
#[derive(Debug, Default)]
pub(crate) struct DueSummary {
    /// The earliest due moment of a claimable item.
    pub(crate) next_due: Option<DateTime<Utc>>,
    /// Some line is held by a claim of another handle.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) foreign_claim: bool,
}

/// What `send` produced, with panics caught.
pub(crate) type SendResult = std::thread::Result<std::result::Result<Option<String>, SendError>>;

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

    pub(crate) fn open_with(mut builder: OutboxBuilder) -> Result<Self> {
        let dir = builder.dir.clone();
        lock::create_private_dir(&dir)?;
        crate::trust::check_outbox_dir(&dir, builder.trust)?;
        let hasher = builder
            .audit_key
            .take()
            .map_or(Hasher::Plain, Hasher::Keyed);
        let lock = DirLock::open(
            &dir,
            Locked {
                audit: AuditTail::new(&dir, hasher),
                loaded: None,
                history: History::new(&dir),
                history_generation: None,
                written: 0,
                hold_syncs: 0,
                hold_since: None,
            },
        )?;
        #[cfg_attr(not(feature = "test-failpoints"), allow(unused_mut))]
        let mut faults = Failpoints::from_env();
        #[cfg(feature = "test-failpoints")]
        for (name, action) in &builder.failpoints {
            faults.arm(name, *action);
        }
        let _ = &mut faults;
        let store = Store::new(&dir);
        let defaults = Settings {
            rates: builder.rates.clone(),
            history_after: builder.history_after,
            retention: builder.retention,
            max_attempts: builder.max_attempts,
            backoff: builder.backoff.clone(),
            give_up_after: builder.give_up_after,
            ordering: builder.ordering,
            stored: Vec::new(),
        };
        let (owner, initial_settings) = {
            let mut guard = lock.lock()?;
            guard.mark_writing()?;
            for stale in fsutil::sweep_temp_files(&dir)? {
                tracing::info!(path = %stale.display(), "removed a temp file left by a crashed writer");
            }
            lock::sweep_dead_owners(&dir, &guard)?;
            let owner = OwnerLease::acquire(&dir, &guard)?;
            let (audit, loaded, history) = guard.refresh(&store)?;
            reconcile_audit(audit, loaded, &faults)?;
            store.settle_torn(loaded)?;
            let compact = builder.compact_on_open && loaded.has_journal_entries();
            let initial = settle_settings(&store, audit, loaded, &defaults, &builder, &faults)?;
            if compact {
                // Start from a fresh snapshot: outbox.json is current after every open.
                let keep = Housekeeping::new(
                    builder.clock.now(),
                    &defaults.with_stored(&loaded.state.settings),
                    builder.audit_rotate_bytes,
                );
                compact_locked(&store, audit, loaded, history, &keep, &faults)
                    .map_err(|(_, e)| e)?;
            }
            guard.mark_current();
            (owner, initial)
        };
        Ok(Self {
            inner: Arc::new(Inner {
                dir,
                store,
                lock,
                owner,
                in_flight: Mutex::new(HashSet::new()),
                pacing: Pacing::default(),
                poisoned: AtomicBool::new(false),
                group: Group::default(),
                initial_settings,
                wakers: Wakers::default(),
                config: Config {
                    defaults,
                    max_inline_wait: builder.max_inline_wait,
                    audit_rotate_bytes: builder.audit_rotate_bytes,
                    clock: builder.clock,
                    sleeper: builder.sleeper,
                    idempotent: builder.idempotent,
                },
                faults,
            }),
        })
    }

    /// The outbox directory.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
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
        let item = self.transact(move |txn| Self::insert_message(txn, message, hash))?;
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
        let items = self.transact(move |txn| {
            prepared
                .into_iter()
                .map(|(message, hash)| Self::insert_message(txn, message, hash))
                .collect()
        })?;
        self.inner.wakers.wake();
        Ok(items)
    }

    /// Adds one validated message to a transaction, or returns its existing twin.
    fn insert_message(txn: &mut Txn<'_>, message: NewMessage, hash: String) -> Result<OutboxItem> {
        if let Some(existing) = txn.item(&message.idempotency_key) {
            return same_message(existing, &message, &hash).map(|()| existing.clone());
        }
        // A key whose item moved to history is still taken: same answer.
        if let Some(old) = txn.history.get(&message.idempotency_key)? {
            return same_message(&old, &message, &hash).map(|()| old);
        }
        let key = message.idempotency_key;
        let seq = txn.next_seq();
        txn.insert(OutboxItem {
            idempotency_key: key.clone(),
            connector: message.connector,
            grant_id: message.grant_id,
            destination: message.destination,
            content: message.content,
            content_hash: hash,
            state: ItemState::Queued,
            attempts: 0,
            claim: None,
            created_at: txn.now,
            updated_at: txn.now,
            next_attempt_at: None,
            sent_at: None,
            error_code: None,
            lane: message.lane.unwrap_or_else(|| DEFAULT_LANE.to_owned()),
            direction: message
                .direction
                .unwrap_or_else(|| DEFAULT_DIRECTION.to_owned()),
            risk_class: message.risk_class,
            transport_ref: None,
            last_audit_id: None,
            cooldown_until: None,
            maybe_sent_at: None,
            failure_class: None,
            seq: Some(seq),
        });
        record(txn, &key, AuditOutcome::Queued, None, false)?;
        txn.item(&key).cloned().ok_or(Error::NotFound { key })
    }

    /// The item with this key, if any, live or in history.
    ///
    /// # Errors
    ///
    /// The load errors: [`Error::Corrupt`], [`Error::InvalidRecord`],
    /// [`Error::UnsupportedVersion`], [`Error::Io`].
    pub fn get(&self, key: &str) -> Result<Option<OutboxItem>> {
        self.read(|loaded, history| match loaded.state.items.get(key) {
            Some(item) => Ok(Some(item.clone())),
            None => history.get(key),
        })
    }

    /// Every live item (queued, and terminal items not yet moved to history),
    /// sorted by key.
    ///
    /// # Errors
    ///
    /// As [`get`](Self::get).
    pub fn list_items(&self) -> Result<Vec<OutboxItem>> {
        self.read(|loaded, _| {
            let mut items: Vec<OutboxItem> = loaded.state.items.values().cloned().collect();
            items.sort_unstable_by(|a, b| a.idempotency_key.cmp(&b.idempotency_key));
            Ok(items)
        })
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
        self.read(|_, history| Ok(history.items()))
    }

    /// How many items have moved to history.
    ///
    /// # Errors
    ///
    /// As [`get`](Self::get).
    pub fn history_len(&self) -> Result<usize> {
        self.read(|_, history| Ok(history.len()))
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
        self.read(|loaded, history| {
            let live = loaded
                .index
                .key_for_transport_ref(transport_ref)
                .and_then(|key| loaded.state.items.get(key));
            match live {
                Some(item) => Ok(Some(item.clone())),
                None => history.find_by_transport_ref(transport_ref),
            }
        })
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
        self.read(|loaded, history| {
            let live = loaded
                .index
                .key_for_destination_ref(destination, transport_ref)
                .and_then(|key| loaded.state.items.get(key));
            match live {
                Some(item) => Ok(Some(item.clone())),
                None => history.find_by_destination_ref(destination, transport_ref),
            }
        })
    }

    /// Delivers one item at most once through `send`, the caller's transport call.
    ///
    /// - A terminal item is not sent again: its receipt is returned (and a missing
    ///   terminal audit record is appended, marked reconciled).
    /// - A claim left by a worker that died makes the item `failed` with
    ///   [`AMBIGUOUS_AFTER_RESTART`]; `send` is not called.
    /// - A claim held by a live worker (thread or process) gives
    ///   [`Outcome::InFlight`] and changes nothing.
    /// - An item not yet due (backoff, `retry_after`, rate deferral) gives
    ///   [`Outcome::Deferred`] without an attempt.
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
    /// retried stays queued and is reported as [`Outcome::Waiting`]. Across
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
        let mut picker = Picker::pass(self.due_keys()?);
        let mut report = DrainReport::default();
        let mut finished: Option<(String, SendResult)> = None;
        loop {
            let stepped = self.step(
                finished.as_ref().map(|(k, r)| (k.as_str(), r)),
                Some(&mut picker),
            )?;
            stepped.tally(&mut report);
            let Some((item, _)) = stepped.claimed else {
                break;
            };
            let result: SendResult =
                send_span(&item).in_scope(|| catch_unwind(AssertUnwindSafe(|| send(&item))));
            if result.is_err() {
                if let Err(e) = self.step(Some((&item.idempotency_key, &result)), None) {
                    tracing::error!(error = %e, "could not record a panicked send");
                }
                if let Err(panic) = result {
                    resume_unwind(panic);
                }
            }
            finished = Some((item.idempotency_key.clone(), result));
        }
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
        self.read(|loaded, _| {
            for key in &unseen {
                if let Some(item) = loaded.state.items.get(key)
                    && item.state == ItemState::Queued
                    && item.claim.is_none()
                {
                    report.add(
                        DeliveryReceipt::for_item(item, Outcome::Waiting, None),
                        false,
                    );
                }
            }
            Ok(())
        })
    }

    /// One durable step of a drain or worker: record `finished` (a send that
    /// ran), then, if `pick` is given, look at candidates (fairest first) until
    /// one is claimed or none is left. Items looked at and not claimed
    /// (deferred by a cap, failed as ambiguous or exhausted) are reported in
    /// `looked`. All in one transaction: one journal entry, one fsync.
    ///
    /// The claimed key is in this handle's in-flight set until the next step
    /// records it, or [`release`](Self::release) or [`abandon`](Self::abandon).
    pub(crate) fn step(
        &self,
        finished: Option<(&str, &SendResult)>,
        pick: Option<&mut Picker>,
    ) -> Result<Stepped> {
        if finished.is_some() {
            self.inner
                .faults
                .check("process.after_send")
                .map_err(|e| Error::io(self.inner.store.path(), "process", e))
                .inspect_err(|_| {
                    if let Some((key, _)) = finished {
                        self.in_flight().remove(key);
                    }
                })?;
        }
        let mut claimed_here: Option<String> = None;
        let stepped = self.transact(|txn| {
            let mut stepped = Stepped::default();
            if let Some((key, result)) = finished {
                stepped.finished = Some(self.finish(txn, key, result)?);
            }
            let Some(picker) = pick else {
                return Ok(stepped);
            };
            let mut tried = HashSet::new();
            let own = self.inner.owner.id();
            loop {
                let ordering = txn.settings.ordering;
                let mut candidates = txn.candidates(ordering, |item| {
                    let key = item.idempotency_key.as_str();
                    // Our own sends in progress need no look.
                    let ours = item.claim_owner() == Some(own) && self.in_flight().contains(key);
                    !ours && picker.admits(key) && !tried.contains(key)
                });
                if candidates.is_empty() {
                    return Ok(stepped);
                }
                picker.rank(&mut candidates);
                for (destination, place) in candidates {
                    let key = place.key;
                    picker.looked_at(&key);
                    match self.decide(txn, &key)? {
                        Decision::Done(receipt) => stepped.looked.push(receipt),
                        Decision::Send(item, before) => {
                            picker.served(&destination);
                            claimed_here = Some(key);
                            stepped.claimed = Some((item, before));
                            return Ok(stepped);
                        }
                    }
                    tried.insert(key);
                }
            }
        });
        if let Some((key, _)) = finished {
            self.in_flight().remove(key);
        }
        if stepped.is_err()
            && let Some(key) = claimed_here
        {
            // A claim that did not commit is not in flight.
            self.in_flight().remove(&key);
        }
        stepped
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
        let own = self.inner.owner.id().to_owned();
        let now = self.inner.config.clock.now();
        self.read(|loaded, _| {
            let ordering = loaded
                .state
                .settings
                .ordering
                .unwrap_or(self.inner.config.defaults.ordering);
            let lines = &loaded.index.lines;
            let foreign_claim = lines.claimed().any(|place| {
                loaded
                    .state
                    .items
                    .get(&place.key)
                    .is_some_and(|item| item.claim_owner() != Some(own.as_str()))
            });
            Ok(DueSummary {
                next_due: lines.next_due(ordering, now),
                foreign_claim,
            })
        })
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
        let requeued = self.transact(|txn| {
            let item = txn.live_item(key)?;
            if let Some(why) = Bulk::Requeue.refusal(item) {
                return Err(Bulk::Requeue.refused(key, why));
            }
            Bulk::Requeue.apply(txn, key, &note)
        })?;
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
        self.transact(|txn| {
            let item = txn.live_item(key)?;
            if let Some(why) = Bulk::Cancel.refusal(item) {
                return Err(Bulk::Cancel.refused(key, why));
            }
            Bulk::Cancel.apply(txn, key, &note)
        })
    }

    /// The live items `filter` matches, sorted by key (what a bulk action
    /// would look at). Items moved to history are not included.
    ///
    /// # Errors
    ///
    /// As [`get`](Self::get).
    pub fn select(&self, filter: &ItemFilter) -> Result<Vec<OutboxItem>> {
        self.read(|loaded, _| {
            let mut items: Vec<OutboxItem> = loaded
                .state
                .items
                .values()
                .filter(|item| filter.matches(item))
                .cloned()
                .collect();
            items.sort_unstable_by(|a, b| a.idempotency_key.cmp(&b.idempotency_key));
            Ok(items)
        })
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
        let plan = |items: &std::collections::HashMap<String, OutboxItem>| {
            let mut keys: Vec<&OutboxItem> =
                items.values().filter(|item| filter.matches(item)).collect();
            keys.sort_unstable_by(|a, b| a.idempotency_key.cmp(&b.idempotency_key));
            let mut todo = Vec::new();
            let mut report = BulkReport::default();
            for item in keys {
                match action.refusal(item) {
                    Some(why) => report
                        .skipped
                        .push((item.idempotency_key.clone(), why.into_owned())),
                    None => todo.push(item.idempotency_key.clone()),
                }
            }
            (todo, report)
        };
        let Some(note) = note else {
            return self.read(|loaded, _| {
                let (todo, mut report) = plan(&loaded.state.items);
                for key in todo {
                    if let Some(item) = loaded.state.items.get(&key) {
                        report
                            .changed
                            .push(action.preview(item, self.inner.config.clock.now()));
                    }
                }
                Ok(report)
            });
        };
        let report = self.transact(|txn| {
            let (todo, mut report) = plan(&txn.base.state.items);
            for key in todo {
                report.changed.push(action.apply(txn, &key, &note)?);
            }
            Ok(report)
        })?;
        if action == Bulk::Requeue && !report.changed.is_empty() {
            self.inner.wakers.wake();
        }
        Ok(report)
    }

    /// An operator's decision to delete old audit history: removes all sealed
    /// audit segments but the newest `keep`, after a `pruned` audit record naming
    /// `operator`, `reason` and the range. The outbox never does this by itself.
    /// Verification then starts at `audit.anchor`, the last removed record.
    /// Returns how many segments were removed.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidField`] for a blank operator or reason; the load and write
    /// errors of every operation.
    pub fn remove_old_audit_segments(
        &self,
        keep: usize,
        operator: &str,
        reason: &str,
    ) -> Result<usize> {
        let note = operator_note(operator, reason)?;
        let inner = &*self.inner;
        let mut guard = self.lock_quiet()?;
        guard.mark_writing()?;
        let (audit, loaded, _) = guard.refresh(&inner.store)?;
        self.guard_poison(reconcile_audit(audit, loaded, &inner.faults))?;
        let sealed = crate::audit::sealed_segments(&inner.dir)?;
        let remove = sealed.len().saturating_sub(keep);
        if remove == 0 {
            return Ok(0);
        }
        let range = format!(
            "{} to {}",
            sealed[0].1.display(),
            sealed[remove - 1].1.display()
        );
        // The anchor the removal leaves, named in its (keyed) record so that in
        // keyed mode the anchor is only accepted with this record in the chain.
        let anchor = crate::audit::last_head(&sealed[remove - 1].1)?;
        let head = audit.head().clone();
        let event = system_event(
            &head,
            crate::audit::REMOVAL_SUBJECT,
            format!(
                "{note} (removed {remove} sealed audit segments: {range}; {})",
                crate::audit::removal_note(&anchor)
            ),
            inner.config.clock.now(),
        );
        let record = AuditRecord::seal(&event, head.seq + 1, &head.hash, false, audit.hasher());
        self.settle(inner.store.commit(
            loaded,
            Vec::new(),
            std::slice::from_ref(&record),
            &inner.faults,
        ))?;
        self.guard_poison(audit.append_records(std::slice::from_ref(&record), &inner.faults))?;
        let removed = self.guard_poison(audit.remove_sealed(keep, &inner.faults))?;
        Ok(removed.len())
    }

    /// Verifies the whole audit chain (every sealed segment and the active log)
    /// and cross-checks it against the head the state recorded, so a truncated
    /// log is detected too. Like every call, it first re-appends records a crash
    /// kept out of the log (from the journal, byte for byte).
    ///
    /// # Errors
    ///
    /// [`Error::AuditBroken`] naming the first bad line and the fault, including
    /// [`AuditFault::Truncated`]; the load errors of `outbox.json`.
    pub fn verify_audit(&self) -> Result<AuditReport> {
        self.transact(|_| Ok(()))?;
        let mut guard = self.lock_quiet()?;
        let (audit, loaded, _) = guard.refresh(&self.inner.store)?;
        let expected = loaded
            .journal_audit
            .last()
            .map(|r| Head {
                seq: r.seq,
                hash: r.hash.clone(),
            })
            .or_else(|| loaded.state.audit_head.clone());
        audit.verify_whole(expected.as_ref())
    }

    /// Writes a fresh `outbox.json` snapshot now and starts an empty journal.
    ///
    /// The outbox compacts by itself when the journal outgrows the snapshot and on
    /// open; call this to checkpoint at a moment of your choosing (e.g. before
    /// copying `outbox.json` for a backup).
    ///
    /// # Errors
    ///
    /// The load and write errors of every operation.
    ///
    /// # Durability
    ///
    /// Returns after the audit log, the new snapshot and the new journal are fsynced.
    pub fn compact(&self) -> Result<()> {
        let inner = &*self.inner;
        let mut guard = self.lock_quiet()?;
        guard.mark_writing()?;
        let (audit, loaded, history) = guard.refresh(&inner.store)?;
        self.guard_poison(reconcile_audit(audit, loaded, &inner.faults))?;
        let keep = self.housekeeping(loaded);
        self.settle(compact_locked(
            &inner.store,
            audit,
            loaded,
            history,
            &keep,
            &inner.faults,
        ))
    }

    /// Appends any audit records a crash left pending and re-checks the log's tail.
    /// Every write does this first; call it to repair without writing anything else.
    ///
    /// # Errors
    ///
    /// The load and write errors of every operation.
    pub fn reconcile(&self) -> Result<()> {
        self.transact(|_| Ok(()))
    }

    /// The audit log's current head (seq and hash).
    ///
    /// # Errors
    ///
    /// The errors of reading the audit log's new records.
    pub fn audit_head(&self) -> Result<Head> {
        let mut guard = self.inner.lock.lock()?;
        guard.audit.catch_up()?;
        Ok(guard.audit.head().clone())
    }

    /// The settings in force: what the outbox stores (see
    /// [`OutboxBuilder::update_settings`]), and this handle's builder values for
    /// anything it does not store.
    ///
    /// # Errors
    ///
    /// As [`get`](Self::get).
    pub fn settings(&self) -> Result<Settings> {
        self.read(|loaded, _| {
            Ok(self
                .inner
                .config
                .defaults
                .with_stored(&loaded.state.settings))
        })
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
        self.read(|loaded, _| {
            let settings = self
                .inner
                .config
                .defaults
                .with_stored(&loaded.state.settings);
            let longest = what_if.map_or_else(|| settings.rates.longest_window(), |cap| cap.window);
            let mut queued: BTreeMap<&str, usize> = BTreeMap::new();
            for item in loaded.state.items.values() {
                if item.state == ItemState::Queued {
                    *queued.entry(item.destination.as_str()).or_default() += 1;
                }
            }
            for destination in loaded.index.destinations_since(earlier(now, longest)) {
                queued.entry(destination).or_default();
            }
            for (destination, until) in &loaded.state.cooldowns {
                if *until > now {
                    queued.entry(destination.as_str()).or_default();
                }
            }
            Ok(queued
                .into_iter()
                .filter_map(|(destination, queued)| {
                    let cap = what_if.unwrap_or_else(|| settings.rate_limit_for(destination));
                    let cutoff = earlier(now, cap.window);
                    let times: Vec<DateTime<Utc>> = loaded
                        .index
                        .rate_times_since(destination, cutoff)
                        .map(|(at, _)| at)
                        .filter(|at| *at > cutoff)
                        .collect();
                    let cooldown_until = loaded
                        .state
                        .cooldowns
                        .get(destination)
                        .copied()
                        .filter(|until| *until > now);
                    (queued > 0 || !times.is_empty() || cooldown_until.is_some()).then(|| {
                        DestinationWindow {
                            destination: destination.to_owned(),
                            cap,
                            sends_in_window: times.len(),
                            next_free_slot: cap.next_free_slot(now, times.iter().copied()),
                            queued,
                            cooldown_until,
                        }
                    })
                })
                .collect())
        })
    }

    /// Every audit record for one item, oldest first.
    ///
    /// # Errors
    ///
    /// The errors of [`AuditLog::read`](crate::AuditLog::read).
    pub fn history(&self, key: &str) -> Result<Vec<AuditRecord>> {
        let mut records = Vec::new();
        for record in crate::audit::AuditLog::records_dir(&self.inner.dir)? {
            let record = record?;
            if record.idempotency_key == key {
                records.push(record);
            }
        }
        Ok(records)
    }

    // ----- internals -----------------------------------------------------

    /// Runs `f` on the current state under the lock (no audit repair, no write).
    fn read<T>(&self, f: impl FnOnce(&Loaded, &History) -> Result<T>) -> Result<T> {
        let inner = &*self.inner;
        if self.is_poisoned() {
            return Err(Error::Poisoned);
        }
        let mut guard = inner.lock.lock()?;
        // Another process wrote: catch up (but leave the audit log and its
        // repair to the next transaction, which sees the counter still moved).
        let stale = self.is_stale(&guard)?;
        let (locked, _) = guard.split();
        let (_, loaded, history) = if stale {
            locked.refresh_with(&inner.store, false)?
        } else {
            locked.parts(&inner.store)?
        };
        let value = f(loaded, history);
        // The answer may rest on entries of a commit group not yet durable.
        let ticket = locked.written;
        drop(guard);
        self.wait_durable(ticket)?;
        value
    }

    /// Whether the cached state must be re-read from the files: another
    /// process announced a write (the change counter moved), or `outbox.json`
    /// was changed behind the outbox's back (one `stat`). Never while this
    /// process's commit group holds the lock: nobody else can have written.
    fn is_stale(&self, guard: &crate::lock::DirGuard<'_, Locked>) -> Result<bool> {
        if guard.is_pending() {
            return Ok(false);
        }
        Ok(guard.is_stale() || self.inner.store.snapshot_changed(guard.loaded.as_ref())?)
    }

    /// Whether a durability failure poisoned this handle.
    fn is_poisoned(&self) -> bool {
        self.inner.poisoned.load(Ordering::Acquire) || self.inner.group.failed()
    }

    /// Returns once this handle's journal entry `ticket` (and every earlier
    /// one) is durable, syncing the journal if no other thread is.
    fn wait_durable(&self, ticket: u64) -> Result<()> {
        let result = self.inner.group.wait_durable(ticket, || self.sync_group());
        if result.is_err() {
            self.inner.poisoned.store(true, Ordering::Release);
            // Nothing of this handle's will be synced any more: never keep
            // other processes out for entries nobody will finish.
            if let Ok(mut guard) = self.inner.lock.lock() {
                guard.set_pending(false);
            }
        }
        result
    }

    /// The lock with no commit group open: every entry this handle wrote is
    /// durable and in the audit log. For operations that look at the log or
    /// replace files.
    fn lock_quiet(&self) -> Result<crate::lock::DirGuard<'_, Locked>> {
        loop {
            if self.is_poisoned() {
                return Err(Error::Poisoned);
            }
            let guard = self.inner.lock.lock()?;
            if !guard.is_pending() {
                return Ok(guard);
            }
            let ticket = guard.written;
            drop(guard);
            self.wait_durable(ticket)?;
        }
    }

    /// A commit group's leader: fsyncs every journal entry written so far
    /// (without the lock, so the next group can form meanwhile), then appends
    /// their audit records in journal order, and lets the `flock` go once
    /// nothing is left unsynced (compacting first if the journal grew enough).
    fn sync_group(&self) -> Synced {
        let inner = &*self.inner;
        let failed = |e| Synced {
            cover: u64::MAX,
            result: Err(e),
        };
        let (cover, file, last_record) = {
            let mut guard = match inner.lock.lock() {
                Ok(guard) => guard,
                Err(e) => return failed(e),
            };
            guard.hold_syncs += 1;
            if guard.hold_syncs >= crate::commit::MIN_SYNCS_PER_HOLD
                && guard
                    .hold_since
                    .is_some_and(|since| since.elapsed() >= crate::commit::MAX_HOLD)
            {
                // Let this group drain, so other processes get the lock.
                inner.group.set_closing(true);
            }
            let loaded = guard.loaded.as_ref();
            (
                guard.written,
                loaded.and_then(Loaded::journal_file),
                loaded.and_then(|l| l.journal_audit.last().map(|r| r.seq)),
            )
        };
        let synced = file.map_or(Ok(()), |file| {
            crate::store::sync_journal(&file, &inner.faults)
                .map_err(|e| Error::io(inner.store.journal_path(), "fsync", e))
        });
        let mut guard = match inner.lock.lock() {
            Ok(guard) => guard,
            Err(e) => return failed(e),
        };
        let result = synced.and_then(|()| {
            inner
                .faults
                .check("commit.before_audit")
                .map_err(|e| Error::io(inner.store.path(), "append", e))?;
            let (audit, loaded, _) = guard.parts(&inner.store)?;
            let durable = loaded.journal_audit_after(audit.head().seq);
            let upto = durable
                .iter()
                .take_while(|r| last_record.is_some_and(|last| r.seq <= last))
                .count();
            audit.append_records(&durable[..upto], &inner.faults)?;
            crate::metrics::committed(&durable[..upto], &loaded.state.items);
            Ok(())
        });
        if let Err(e) = result {
            // Nothing after the last good sync is reported durable; let other
            // processes in to recover what is really on disk.
            inner.poisoned.store(true, Ordering::Release);
            guard.set_pending(false);
            inner.group.set_closing(false);
            return Synced {
                cover,
                result: Err(e),
            };
        }
        if guard.written == cover {
            self.compact_if_grown(&mut guard);
            guard.hold_syncs = 0;
            guard.hold_since = None;
            guard.set_pending(false);
            inner.group.set_closing(false);
        }
        Synced {
            cover,
            result: Ok(()),
        }
    }

    /// After a group drained: compact if the journal outgrew the snapshot. The
    /// group's changes are durable whatever happens here: a clean failure is
    /// retried at a later commit; an uncertain one poisons the handle for the
    /// calls that follow.
    fn compact_if_grown(&self, guard: &mut crate::lock::DirGuard<'_, Locked>) {
        let inner = &*self.inner;
        let Ok((audit, loaded, history)) = guard.parts(&inner.store) else {
            return;
        };
        if !loaded.wants_compaction() {
            return;
        }
        let keep = self.housekeeping(loaded);
        let compacted = compact_locked(&inner.store, audit, loaded, history, &keep, &inner.faults);
        if let Err(e) = self.settle(compacted) {
            tracing::warn!(error = %e, "compaction after a commit failed; the commit stands");
            loaded.defer_compaction();
        }
    }

    /// What the next compaction moves to history and prunes from it, by the
    /// settings the outbox stores (whatever this handle was opened with).
    fn housekeeping(&self, loaded: &Loaded) -> Housekeeping {
        let config = &self.inner.config;
        Housekeeping::new(
            config.clock.now(),
            &config.defaults.with_stored(&loaded.state.settings),
            config.audit_rotate_bytes,
        )
    }

    /// Runs one locked read-modify-write: catch up on the audit log and the state,
    /// repair audit records a crash left behind, apply `f`, then (if anything
    /// changed) journal the change durably and append its audit records.
    fn transact<T>(&self, f: impl FnOnce(&mut Txn<'_>) -> Result<T>) -> Result<T> {
        let inner = &*self.inner;
        if self.is_poisoned() {
            return Err(Error::Poisoned);
        }
        inner.group.wait_open();
        let mut guard = inner.lock.lock()?;
        // Again under the lock: a group that failed meanwhile has let the
        // `flock` go, and nothing may be written after it.
        if self.is_poisoned() {
            return Err(Error::Poisoned);
        }
        let stale = self.is_stale(&guard)?;
        let (locked, mut writes) = guard.split();
        let (audit, loaded, history) = if stale {
            // Another process wrote since we last looked (or never looked):
            // catch up, and announce the repairs this may write.
            writes.mark_writing()?;
            let (audit, loaded, history) = locked.refresh(&inner.store)?;
            self.guard_poison(reconcile_audit(audit, loaded, &inner.faults))?;
            self.guard_poison(inner.store.settle_torn(loaded))?;
            writes.mark_current();
            (audit, loaded, history)
        } else {
            locked.parts(&inner.store)?
        };
        let mut txn = Txn {
            base: loaded,
            history,
            overlay: BTreeMap::new(),
            records: Vec::new(),
            head: sealing_head(audit, loaded),
            hasher: audit.hasher(),
            now: inner.config.clock.now(),
            settings: inner.config.defaults.with_stored(&loaded.state.settings),
            last_seq: loaded.index.lines.max_seq(),
        };
        let value = f(&mut txn);
        let wrote = match value {
            Ok(_) if txn.changed() => {
                let Txn {
                    overlay, records, ..
                } = txn;
                // The first change to a new outbox also stores its initial settings.
                let initial = inner
                    .initial_settings
                    .clone()
                    .filter(|_| loaded.state.settings.is_empty());
                writes.mark_writing()?;
                self.settle(inner.store.append_unsynced(
                    loaded,
                    initial,
                    overlay.into_values().collect(),
                    &records,
                    &inner.faults,
                ))?;
                locked.written += 1;
                locked
                    .hold_since
                    .get_or_insert_with(std::time::Instant::now);
                true
            }
            _ => false,
        };
        // A change waits for its own sync; a read or a refusal waits for the
        // entries it saw, which may not be durable yet either.
        let ticket = locked.written;
        if wrote {
            guard.set_pending(true);
        }
        drop(guard);
        self.wait_durable(ticket)?;
        value
    }

    /// Turns a commit failure into an error, poisoning the handle when the
    /// on-disk outcome is uncertain.
    fn settle(&self, result: std::result::Result<(), (CommitFailure, Error)>) -> Result<()> {
        match result {
            Ok(()) => Ok(()),
            Err((CommitFailure::Clean, e)) => Err(e),
            Err((CommitFailure::Uncertain, e)) => {
                self.inner.poisoned.store(true, Ordering::Release);
                Err(e)
            }
        }
    }

    /// Poisons the handle when a durability step failed after data may have reached the disk.
    fn guard_poison<T>(&self, result: Result<T>) -> Result<T> {
        if result.is_err() {
            self.inner.poisoned.store(true, Ordering::Release);
        }
        result
    }

    fn in_flight(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
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
            let result: SendResult =
                send_span(&item).in_scope(|| catch_unwind(AssertUnwindSafe(|| send(&item))));
            sends += 1;
            let (receipt, retry_wait) = self.record_result(key, result)?;
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
    /// A claimed key is in this handle's in-flight set until
    /// [`record_result`](Self::record_result) or [`abandon`](Self::abandon).
    pub(crate) fn claim(&self, key: &str) -> Result<Claimed> {
        let mut claimed_here = false;
        let decided = self.transact(|txn| {
            let decision = self.decide(txn, key)?;
            claimed_here = matches!(decision, Decision::Send(..));
            Ok(decision)
        });
        match decided {
            Ok(Decision::Done(receipt)) => Ok(Claimed::Done(receipt)),
            Ok(Decision::Send(item, before)) => Ok(Claimed::Send(item, before)),
            Err(e) => {
                // A claim that did not commit is not in flight. Only this call's:
                // another thread of this handle may be sending the same key.
                if claimed_here {
                    self.in_flight().remove(key);
                }
                Err(e)
            }
        }
    }

    /// Step two: record what `send` did and take the key out of the in-flight
    /// set. A panic is recorded, then resumed. Returns the receipt and, for a
    /// retryable failure with attempts left, how long to wait.
    pub(crate) fn record_result(
        &self,
        key: &str,
        result: SendResult,
    ) -> Result<(DeliveryReceipt, Option<Duration>)> {
        let recorded = self
            .inner
            .faults
            .check("process.after_send")
            .map_err(|e| Error::io(self.inner.store.path(), "process", e))
            .and_then(|()| self.transact(|txn| self.finish(txn, key, &result)));
        self.in_flight().remove(key);
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
    pub(crate) fn abandon(&self, key: &str, code: &str) -> Result<()> {
        let result = self.transact(|txn| {
            let now = txn.now;
            let Some(item) = txn.item(key).filter(|i| {
                i.state == ItemState::Queued && i.claim_owner() == Some(self.inner.owner.id())
            }) else {
                return Ok(());
            };
            if self.may_resend(txn, item, now) {
                resend_later(txn, key, code, now)?;
            } else {
                fail_ambiguous(txn, key, code)?;
            }
            Ok(())
        });
        self.in_flight().remove(key);
        result
    }

    /// Gives back a claim whose item was never handed to `send` (its async
    /// caller went away before the send started): the item is restored exactly
    /// as it was before the claim. Does nothing if the claim is no longer ours.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn release(&self, key: &str, before: &OutboxItem) -> Result<()> {
        let result = self.transact(|txn| {
            let ours = txn.item(key).is_some_and(|i| {
                i.state == ItemState::Queued && i.claim_owner() == Some(self.inner.owner.id())
            });
            if ours {
                txn.insert(before.clone());
            }
            Ok(())
        });
        self.in_flight().remove(key);
        result
    }

    /// The keys of the items due now, oldest first.
    pub(crate) fn due_keys(&self) -> Result<Vec<String>> {
        let now = self.inner.config.clock.now();
        let mut due: Vec<(DateTime<Utc>, String)> = self.read(|loaded, _| {
            Ok(loaded
                .state
                .items
                .values()
                .filter(|item| item.state == ItemState::Queued)
                .filter(|item| item.next_attempt_at.is_none_or(|at| at <= now))
                .map(|item| (item.created_at, item.idempotency_key.clone()))
                .collect())
        })?;
        due.sort();
        Ok(due.into_iter().map(|(_, key)| key).collect())
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
            self.read(|loaded, _| {
                crate::metrics::gauges(loaded.state.items.values(), now);
                Ok(())
            })?;
        }
        Ok(())
    }

    /// The configured `max_attempts` (bounds inline retries per call).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn max_attempts(&self) -> u32 {
        self.settings()
            .map_or(self.inner.config.defaults.max_attempts, |s| s.max_attempts)
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

    /// Under the lock: decide what to do with the item, claiming it if it is to be
    /// sent, in an `outbox.claim` span.
    fn decide(&self, txn: &mut Txn<'_>, key: &str) -> Result<Decision> {
        let span = tracing::info_span!(
            "outbox.claim",
            key,
            destination = tracing::field::Empty,
            attempt = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        let _entered = span.enter();
        let decision = self.decide_inner(txn, key)?;
        match &decision {
            Decision::Send(item, _) => {
                span.record("destination", item.destination.as_str());
                span.record("attempt", item.attempts);
                span.record("outcome", "claimed");
            }
            Decision::Done(receipt) => {
                span.record("destination", receipt.destination.as_str());
                span.record("attempt", receipt.attempts);
                span.record("outcome", receipt.outcome.as_str());
            }
        }
        Ok(decision)
    }

    fn decide_inner(&self, txn: &mut Txn<'_>, key: &str) -> Result<Decision> {
        let now = txn.now;
        let Some(item) = txn.item(key) else {
            // Only terminal items move to history, each with its outcome on record.
            return match txn.history.get(key)? {
                Some(old) => Ok(Decision::Done(DeliveryReceipt::for_item(
                    &old,
                    terminal_outcome(old.state),
                    old.last_audit_id.clone(),
                ))),
                None => Err(Error::NotFound {
                    key: key.to_owned(),
                }),
            };
        };
        if item.state.is_terminal() {
            let outcome = terminal_outcome(item.state);
            let audit_id = if let Some(id) = item.last_audit_id.clone() {
                id
            } else {
                let outcome = audit_outcome_of(item.state);
                record(
                    txn,
                    key,
                    outcome,
                    Some("terminal outcome had no audit record"),
                    true,
                )?
            };
            return Ok(Decision::Done(receipt(txn, key, outcome, Some(audit_id))?));
        }
        if let Some(claim) = &item.claim {
            if self.claim_is_live(key, claim) {
                return Ok(Decision::Done(DeliveryReceipt::for_item(
                    item,
                    Outcome::InFlight,
                    None,
                )));
            }
            if let Some(failed) = self.settle_dead_claim(txn, key, now)? {
                return Ok(failed);
            }
        }
        let item = txn.item(key).ok_or_else(|| Error::NotFound {
            key: key.to_owned(),
        })?;
        if txn.settings.ordering == order::Ordering::PerDestination
            && txn
                .head_of(&item.destination)
                .is_some_and(|head| head.key != key)
        {
            return Ok(Decision::Done(DeliveryReceipt::for_item(
                item,
                Outcome::Waiting,
                None,
            )));
        }
        if item.attempts >= txn.settings.max_attempts {
            return fail(txn, key, ATTEMPTS_EXHAUSTED, FailureClass::Retryable);
        }
        if let Some(at) = item.next_attempt_at
            && at > now
        {
            return Ok(Decision::Done(DeliveryReceipt::for_item(
                item,
                Outcome::Deferred,
                None,
            )));
        }
        if let Some((free_at, code)) = self.rate_capped(txn, &item.destination, now) {
            let item = txn.item_mut(key)?;
            item.next_attempt_at = Some(free_at);
            item.error_code = Some(code.to_owned());
            item.failure_class = None;
            let audit_id = record(txn, key, AuditOutcome::Deferred, None, false)?;
            return Ok(Decision::Done(receipt(
                txn,
                key,
                Outcome::Deferred,
                Some(audit_id),
            )?));
        }
        let item = txn.item(key).ok_or_else(|| Error::NotFound {
            key: key.to_owned(),
        })?;
        let before = Box::new(item.clone());
        let owner = self.inner.owner.id().to_owned();
        let item = txn.item_mut(key)?;
        item.attempts += 1;
        item.claim = Some(Claim {
            owner: Some(owner),
            at: Some(now),
        });
        item.next_attempt_at = None;
        item.error_code = None;
        item.failure_class = None;
        item.updated_at = now;
        let claimed = item.clone();
        // Marked before the lock is released, so no thread of ours mistakes the
        // claim for an orphan.
        self.in_flight().insert(key.to_owned());
        Ok(Decision::Send(Box::new(claimed), before))
    }

    /// When a send to `destination` at `now` would exceed a cap: the moment the
    /// binding cap frees a slot, and which cap it is.
    fn rate_capped(
        &self,
        txn: &Txn<'_>,
        destination: &str,
        now: DateTime<Utc>,
    ) -> Option<(DateTime<Utc>, &'static str)> {
        let rates = &txn.settings.rates;
        let cap = rates.for_destination(destination);
        let times = txn.destination_times(destination, earlier(now, cap.window));
        let per_destination = cap.next_free_slot(now, times).map(|at| (at, RATE_CAPPED));
        let global = rates.global.and_then(|cap| {
            let times = txn.all_times(earlier(now, cap.window));
            cap.next_free_slot(now, times)
                .map(|at| (at, GLOBAL_RATE_CAPPED))
        });
        let cooled = txn
            .destination_cooldown(destination, now)
            .map(|until| (until, DESTINATION_COOLDOWN));
        let paced = self
            .inner
            .pacing
            .interval(destination, now)
            .and_then(|pace| {
                txn.destination_times(destination, earlier(now, pace))
                    .into_iter()
                    .max()
                    .map(|last| (later(last, pace), DESTINATION_PACED))
            })
            .filter(|(at, _)| *at > now);
        // Every limit must allow the send; the latest moment is when all do.
        [per_destination, global, cooled, paced]
            .into_iter()
            .flatten()
            .max_by_key(|(at, _)| *at)
    }

    /// A claim whose worker is gone: fails the item as ambiguous, or, under an
    /// idempotent transport, puts it back for a resend under its transaction
    /// id (`None`: the caller goes on deciding the now unclaimed item).
    fn settle_dead_claim(
        &self,
        txn: &mut Txn<'_>,
        key: &str,
        now: DateTime<Utc>,
    ) -> Result<Option<Decision>> {
        let item = txn.item(key).ok_or_else(|| Error::NotFound {
            key: key.to_owned(),
        })?;
        if !self.may_resend(txn, item, now) {
            tracing::warn!(
                key,
                "found a claim whose worker is gone; failing it as ambiguous"
            );
            return fail_ambiguous(txn, key, AMBIGUOUS_AFTER_RESTART).map(Some);
        }
        tracing::warn!(
            key,
            "found a claim whose worker is gone; resending it under its transaction id"
        );
        resend_later(txn, key, AMBIGUOUS_AFTER_RESTART, now)?;
        Ok(None)
    }

    /// Learns the destination's pace from a `retry_after` of `hint` on the
    /// send `item` (still claimed) just made; see `pacing`. Returns when the
    /// pace next allows a send there (after the destination's previous send).
    fn learn_pace(
        &self,
        txn: &Txn<'_>,
        item: &OutboxItem,
        hint: Duration,
        now: DateTime<Utc>,
    ) -> Option<DateTime<Utc>> {
        let started = item.claim.as_ref().and_then(|c| c.at).unwrap_or(now);
        let previous = txn
            .destination_times(&item.destination, earlier(started, pacing::MEMORY))
            .into_iter()
            .filter(|at| *at < started)
            .max();
        let gap = previous.and_then(|at| started.signed_duration_since(at).to_std().ok());
        // Sends accepted since the moment the previous refusal named refilled
        // the server's bucket up to this refusal's moment.
        let since_last = self
            .inner
            .pacing
            .last_allowed(&item.destination, now)
            .and_then(|last| {
                let accepted = txn
                    .destination_times(&item.destination, last)
                    .into_iter()
                    .filter(|at| *at < started)
                    .count();
                let span = later(started, hint)
                    .signed_duration_since(last)
                    .to_std()
                    .ok()?;
                let per = span.as_micros() / u128::try_from(accepted).ok().filter(|k| *k > 0)?;
                Some(Duration::from_micros(u64::try_from(per).ok()?))
            });
        let refusal = pacing::Refusal {
            gap,
            hint,
            started,
            since_last,
        };
        self.inner.pacing.learn(&item.destination, refusal, now);
        let pace = self.inner.pacing.interval(&item.destination, now)?;
        previous.map(|at| later(at, pace))
    }

    /// Whether an item whose send may have left can be sent again under its
    /// transaction id: its connector is declared idempotent, it was enqueued
    /// within the platform's dedup window (every earlier attempt came later),
    /// and attempts are left.
    fn may_resend(&self, txn: &Txn<'_>, item: &OutboxItem, now: DateTime<Utc>) -> bool {
        self.inner
            .config
            .idempotent
            .get(&item.connector)
            .is_some_and(|window| {
                now.signed_duration_since(item.created_at)
                    .to_std()
                    .is_ok_and(|age| age < *window)
            })
            && item.attempts < txn.settings.max_attempts
    }

    /// Whether a claim belongs to a worker that is still alive.
    fn claim_is_live(&self, key: &str, claim: &Claim) -> bool {
        match claim.owner.as_deref() {
            // The reference design records no owner: such a claim survived a crash.
            None => false,
            Some(owner) if owner == self.inner.owner.id() => self.in_flight().contains(key),
            Some(owner) => lock::owner_is_alive(&self.inner.dir, owner),
        }
    }

    /// Under the lock: record what `send` did, in an `outbox.finish` span.
    /// Returns the receipt and, for a retryable failure with attempts left, how
    /// long to wait.
    fn finish(
        &self,
        txn: &mut Txn<'_>,
        key: &str,
        result: &SendResult,
    ) -> Result<(DeliveryReceipt, Option<Duration>)> {
        let span = tracing::info_span!(
            "outbox.finish",
            key,
            destination = tracing::field::Empty,
            attempt = tracing::field::Empty,
            outcome = tracing::field::Empty,
            error_code = tracing::field::Empty,
        );
        let _entered = span.enter();
        let (receipt, wait) = self.finish_inner(txn, key, result)?;
        span.record("destination", receipt.destination.as_str());
        span.record("attempt", receipt.attempts);
        span.record("outcome", receipt.outcome.as_str());
        if let Some(code) = &receipt.error_code {
            span.record("error_code", code.as_str());
        }
        Ok((receipt, wait))
    }

    fn finish_inner(
        &self,
        txn: &mut Txn<'_>,
        key: &str,
        result: &SendResult,
    ) -> Result<(DeliveryReceipt, Option<Duration>)> {
        let now = txn.now;
        let item = txn.item(key).ok_or_else(|| Error::NotFound {
            key: key.to_owned(),
        })?;
        if item.claim_owner() != Some(self.inner.owner.id()) {
            // Only possible if the state files were replaced behind our back.
            tracing::error!(
                key,
                "our claim vanished while sending; leaving the item as it is"
            );
            return Ok((
                DeliveryReceipt::for_item(item, Outcome::InFlight, None),
                None,
            ));
        }
        let attempts = item.attempts;
        match result {
            Ok(Ok(transport_ref)) => {
                let item = txn.item_mut(key)?;
                item.state = ItemState::Sent;
                item.claim = None;
                item.sent_at = Some(now);
                item.error_code = None;
                item.failure_class = None;
                item.transport_ref = transport_ref
                    .as_deref()
                    .filter(|r| !r.trim().is_empty())
                    .map(|r| sanitize(r, limits::TRANSPORT_REF));
                let audit_id = record(txn, key, AuditOutcome::Sent, None, false)?;
                Ok((receipt(txn, key, Outcome::Sent, Some(audit_id))?, None))
            }
            Ok(Err(error)) => {
                let code = sanitize(error.code(), limits::TRANSPORT_REF);
                let give_up_after = txn.settings.give_up_after;
                // A `retry_after` is the platform pacing us (HTTP 429), not a
                // failed attempt: it does not count against `max_attempts`.
                let paced = error.retry_after_hint().is_some();
                let retryable = error.class() == FailureClass::Retryable;
                let backoff = txn.settings.backoff.delay(attempts, key);
                let wait = error
                    .retry_after_hint()
                    .map_or(backoff, |hint| hint.max(backoff));
                let created_at = item.created_at;
                let past_deadline = later(now, wait) > later(created_at, give_up_after);
                if retryable && past_deadline {
                    Ok((
                        done(fail(txn, key, GAVE_UP, FailureClass::Retryable)?),
                        None,
                    ))
                } else if retryable && (paced || attempts < txn.settings.max_attempts) {
                    // Not before the learned pace allows either, so the items
                    // held back for the destination do not overtake this one.
                    let pace_free = error
                        .retry_after_hint()
                        .and_then(|hint| self.learn_pace(txn, item, hint, now));
                    let item = txn.item_mut(key)?;
                    if paced {
                        item.attempts = item.attempts.saturating_sub(1);
                    }
                    item.claim = None;
                    item.error_code = Some(code);
                    item.failure_class = Some(FailureClass::Retryable);
                    item.next_attempt_at = Some(later(now, wait).max(pace_free.unwrap_or(now)));
                    // The platform's wait covers the whole destination, not just this item.
                    item.cooldown_until = error.retry_after_hint().map(|hint| later(now, hint));
                    let audit_id = record(txn, key, AuditOutcome::Retrying, None, false)?;
                    Ok((
                        receipt(txn, key, Outcome::Deferred, Some(audit_id))?,
                        Some(wait),
                    ))
                } else if error.class() == FailureClass::Ambiguous
                    && self.may_resend(txn, item, now)
                {
                    let wait = txn.settings.backoff.delay(attempts, key);
                    let audit_id = resend_later(txn, key, &code, later(now, wait))?;
                    Ok((
                        receipt(txn, key, Outcome::Deferred, Some(audit_id))?,
                        Some(wait),
                    ))
                } else if error.class() == FailureClass::Ambiguous {
                    Ok((done(fail_ambiguous(txn, key, &code)?), None))
                } else {
                    Ok((done(fail(txn, key, &code, error.class())?), None))
                }
            }
            Err(_panic) => Ok((done(fail_ambiguous(txn, key, SEND_PANICKED)?), None)),
        }
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

/// Puts an item whose send may have left back in the queue, unclaimed, for a
/// resend under the same transaction id at `at` (only for connectors declared
/// with `idempotent_transport`). The audit record says why.
fn resend_later(txn: &mut Txn<'_>, key: &str, code: &str, at: DateTime<Utc>) -> Result<String> {
    let item = txn.item_mut(key)?;
    // The send may have reached the platform: it counts against the rate caps.
    let claimed_at = item.claim.as_ref().and_then(|c| c.at);
    item.maybe_sent_at = Some(claimed_at.unwrap_or(item.updated_at));
    item.claim = None;
    item.error_code = Some(code.to_owned());
    item.failure_class = Some(FailureClass::Ambiguous);
    item.next_attempt_at = Some(at);
    let note = format!("idempotent transport: {code}; resending with the same transaction id");
    record(txn, key, AuditOutcome::Retrying, Some(&note), false)
}

/// The receipt of a decision that is not a send.
fn done(decision: Decision) -> DeliveryReceipt {
    match decision {
        Decision::Done(receipt) => receipt,
        Decision::Send(..) => unreachable!("only `decide` claims"),
    }
}

/// The receipt for an item as the transaction now sees it.
fn receipt(
    txn: &Txn<'_>,
    key: &str,
    outcome: Outcome,
    audit_id: Option<String>,
) -> Result<DeliveryReceipt> {
    let item = txn.item(key).ok_or_else(|| Error::NotFound {
        key: key.to_owned(),
    })?;
    Ok(DeliveryReceipt::for_item(item, outcome, audit_id))
}

/// Fails an item terminally with `code`, of failure class `class`.
fn fail(txn: &mut Txn<'_>, key: &str, code: &str, class: FailureClass) -> Result<Decision> {
    let item = txn.item_mut(key)?;
    item.state = ItemState::Failed;
    item.claim = None;
    item.next_attempt_at = None;
    item.error_code = Some(code.to_owned());
    item.failure_class = Some(class);
    let audit_id = record(txn, key, AuditOutcome::Failed, None, false)?;
    Ok(Decision::Done(receipt(
        txn,
        key,
        Outcome::Failed,
        Some(audit_id),
    )?))
}

/// Fails a claimed item whose send may have reached the platform: its claim
/// time is kept as `maybe_sent_at`, so it counts against the destination's caps
/// as a send from then on, across restarts and whatever becomes of the item.
fn fail_ambiguous(txn: &mut Txn<'_>, key: &str, code: &str) -> Result<Decision> {
    let item = txn.item_mut(key)?;
    let claimed_at = item.claim.as_ref().and_then(|c| c.at);
    // A claim from the reference design has no time: its last change is the claim.
    item.maybe_sent_at = Some(claimed_at.unwrap_or(item.updated_at));
    fail(txn, key, code, FailureClass::Ambiguous)
}

/// The two operator actions on items, one by key or many by filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bulk {
    Requeue,
    Cancel,
}

impl Bulk {
    /// Why this action does not apply to `item`, if it does not.
    fn refusal(self, item: &OutboxItem) -> Option<std::borrow::Cow<'static, str>> {
        let claimed = item.claim.is_some();
        let why: std::borrow::Cow<'static, str> = match (self, item.state) {
            (Self::Requeue, ItemState::Sent) => "it was sent already".into(),
            (_, ItemState::Queued) if claimed => "it is in flight (claimed by a worker)".into(),
            (Self::Requeue, ItemState::Queued) => "it is queued already".into(),
            (Self::Requeue, ItemState::Failed) | (Self::Cancel, ItemState::Queued) => return None,
            (Self::Cancel, ItemState::Failed) if item.error_code.as_deref() == Some(CANCELLED) => {
                "it was cancelled already".into()
            }
            (Self::Cancel, state) => format!("it is {state} already").into(),
        };
        Some(why)
    }

    fn refused(self, key: &str, why: std::borrow::Cow<'static, str>) -> Error {
        Error::InvalidTransition {
            key: key.to_owned(),
            action: match self {
                Self::Requeue => "requeued",
                Self::Cancel => "cancelled",
            },
            reason: why.into_owned(),
        }
    }

    /// The item as the action leaves it, without its audit stamp.
    fn preview(self, item: &OutboxItem, now: DateTime<Utc>) -> OutboxItem {
        let mut item = item.clone();
        match self {
            Self::Requeue => {
                item.state = ItemState::Queued;
                item.attempts = 0;
                item.error_code = None;
                item.failure_class = None;
                item.next_attempt_at = None;
                item.cooldown_until = None;
            }
            Self::Cancel => {
                item.state = ItemState::Failed;
                item.error_code = Some(CANCELLED.to_owned());
                item.failure_class = None;
                item.next_attempt_at = None;
            }
        }
        item.updated_at = item.updated_at.max(now);
        item
    }

    /// Applies the action to an item it applies to, with its audit record.
    fn apply(self, txn: &mut Txn<'_>, key: &str, note: &str) -> Result<OutboxItem> {
        let now = txn.now;
        let mut changed = self.preview(txn.live_item(key)?, now);
        let outcome = match self {
            Self::Requeue => AuditOutcome::Requeued,
            Self::Cancel => AuditOutcome::Cancelled,
        };
        if self == Self::Requeue {
            // A requeue is a new turn: the back of the destination's line.
            changed.seq = Some(txn.next_seq());
        }
        txn.insert(changed);
        record(txn, key, outcome, Some(note), false)?;
        txn.item(key).cloned().ok_or_else(|| Error::NotFound {
            key: key.to_owned(),
        })
    }
}

/// Checks an operator's name and reason and joins them into an audit note.
fn operator_note(operator: &str, reason: &str) -> Result<String> {
    use crate::message::{TextRule, check_text};
    check_text("operator", operator, limits::LABEL, TextRule::Identifier)?;
    check_text(
        "reason",
        reason,
        limits::TRANSPORT_REF,
        TextRule::Identifier,
    )?;
    Ok(format!("{operator}: {reason}"))
}

/// Seals an audit record for the item's current state into the transaction and
/// stamps its id on the item. Returns the id. `note` is free text for the
/// record; `reconciled` marks a late repair.
fn record(
    txn: &mut Txn<'_>,
    key: &str,
    outcome: AuditOutcome,
    note: Option<&str>,
    reconciled: bool,
) -> Result<String> {
    let now = txn.now;
    let (seq, prev_hash) = (txn.head.seq + 1, txn.head.hash.clone());
    // Unique within the chain (seq) and across chains (prev_hash, key, time).
    let audit_id = hex::encode(
        &Sha256::new()
            .chain_update(prev_hash.as_bytes())
            .chain_update(seq.to_le_bytes())
            .chain_update(key.as_bytes())
            .chain_update(format_timestamp(now).as_bytes())
            .finalize()[..16],
    );
    let item = txn.item_mut(key)?;
    item.last_audit_id = Some(audit_id.clone());
    item.updated_at = item.updated_at.max(now);
    let event = AuditEvent::for_item(
        item,
        outcome,
        audit_id.clone(),
        note,
        reconciled,
        format_timestamp(now),
    );
    let sealed = AuditRecord::seal(&event, seq, &prev_hash, false, txn.hasher);
    txn.head = Head {
        seq: sealed.seq,
        hash: sealed.hash.clone(),
    };
    txn.records.push(sealed);
    Ok(audit_id)
}

/// Folds the journal into a fresh snapshot once every audit record is durable in the log.
///
/// Terminal items last changed before `cutoff` (and no longer counting against
/// any cap) are first written to a new history segment, durably, and left out
/// of the new snapshot.
fn compact_locked(
    store: &Store,
    audit: &mut AuditTail,
    loaded: &mut Loaded,
    history: &mut History,
    keep: &Housekeeping,
    faults: &Failpoints,
) -> std::result::Result<(), (CommitFailure, Error)> {
    let cutoff = keep.cutoff;
    // A cooldown whose moment has passed holds nothing back: not worth keeping.
    loaded.state.cooldowns.retain(|_, until| *until > keep.now);
    audit
        .sync(faults)
        .map_err(|e| (CommitFailure::Uncertain, e))?;
    // Seal a large audit log before the snapshot records where it resumes.
    audit
        .rotate_if_over(keep.audit_rotate_bytes)
        .map_err(|e| (CommitFailure::Uncertain, e))?;
    let evictable: Vec<&OutboxItem> = loaded
        .state
        .items
        .values()
        .filter(|item| {
            item.state.is_terminal()
                && item.claim.is_none()
                // Only items whose outcome is on record: a seed item without its
                // terminal record stays live until `process` repairs it.
                && item.last_audit_id.is_some()
                && item.updated_at <= cutoff
                // Nothing that still counts against a cap leaves the live state.
                && rate_times(item).all(|at| at <= cutoff)
        })
        .collect();
    let evicted: HashSet<String> = evictable
        .iter()
        .map(|i| i.idempotency_key.clone())
        .collect();
    if !evictable.is_empty() {
        history.append_segment(&evictable, faults)?;
    }
    store.compact(
        loaded,
        audit.head().clone(),
        audit.verified_len(),
        audit.hasher(),
        &evicted,
        faults,
    )?;
    prune_history(store, audit, loaded, history, keep, faults)
}

/// An audit event about the outbox itself rather than one message (a prune):
/// `subject` stands where an item's key would, item fields are `-`.
fn system_event(head: &Head, subject: &str, note: String, now: DateTime<Utc>) -> AuditEvent {
    system_event_of(AuditOutcome::Pruned, head, subject, note, now)
}

/// An audit event about the outbox itself with this outcome.
fn system_event_of(
    outcome: AuditOutcome,
    head: &Head,
    subject: &str,
    note: String,
    now: DateTime<Utc>,
) -> AuditEvent {
    AuditEvent {
        attempts: 0,
        audit_id: hex::encode(&Sha256::digest(format!("{}{subject}", head.hash).as_bytes())[..16]),
        connector: "-".into(),
        content_hash: "-".into(),
        destination: "-".into(),
        direction: "-".into(),
        error_code: None,
        failure_class: None,
        grant_id: "-".into(),
        idempotency_key: subject.to_owned(),
        lane: "-".into(),
        outcome,
        note: Some(note),
        reconciled: false,
        recorded_at_utc: format_timestamp(now),
        risk_class: None,
        transport_ref: None,
    }
}

/// What a compaction moves to history and what it prunes from it.
struct Housekeeping {
    /// Terminal items last changed before this move to history.
    cutoff: DateTime<Utc>,
    retention: Retention,
    now: DateTime<Utc>,
    /// Seal the active audit file once it is this large.
    audit_rotate_bytes: u64,
}

impl Housekeeping {
    fn new(now: DateTime<Utc>, settings: &Settings, audit_rotate_bytes: u64) -> Self {
        Self {
            cutoff: eviction_cutoff(now, settings.history_after, &settings.rates),
            retention: settings.retention,
            now,
            audit_rotate_bytes,
        }
    }
}

/// Removes the history segments the retention policy no longer keeps, each
/// after a durable `pruned` audit record naming it (journal entry, then log).
fn prune_history(
    store: &Store,
    audit: &mut AuditTail,
    loaded: &mut Loaded,
    history: &mut History,
    keep: &Housekeeping,
    faults: &Failpoints,
) -> std::result::Result<(), (CommitFailure, Error)> {
    for segment in history.prunable(keep.retention, keep.now) {
        let head = audit.head().clone();
        let note = format!(
            "retention pruned history segment {} ({} items, newest changed {})",
            segment.number,
            segment.items,
            format_timestamp(segment.newest)
        );
        let subject = format!("history-segment-{}", segment.number);
        let event = system_event(&head, &subject, note, keep.now);
        let record = AuditRecord::seal(&event, head.seq + 1, &head.hash, false, audit.hasher());
        store.commit(loaded, Vec::new(), std::slice::from_ref(&record), faults)?;
        audit
            .append_records(std::slice::from_ref(&record), faults)
            .map_err(|e| (CommitFailure::Uncertain, e))?;
        faults.check("history.prune").map_err(|e| {
            (
                CommitFailure::Uncertain,
                Error::io(audit.path(), "prune", e),
            )
        })?;
        history
            .remove_segment(segment.number)
            .map_err(|e| (CommitFailure::Uncertain, e))?;
    }
    Ok(())
}

/// The moment before which terminal items may leave the live state: at least
/// `history_after` ago, and never inside the longest rate window.
fn eviction_cutoff(
    now: DateTime<Utc>,
    history_after: Duration,
    rates: &RatePolicy,
) -> DateTime<Utc> {
    earlier(now, history_after.max(rates.longest_window()))
}

/// Checks that an existing item is the same message as `message`.
fn same_message(existing: &OutboxItem, message: &NewMessage, hash: &str) -> Result<()> {
    let differs = if existing.connector != message.connector {
        Some("connector")
    } else if existing.grant_id != message.grant_id {
        Some("grant_id")
    } else if existing.destination != message.destination {
        Some("destination")
    } else if existing.content_hash != hash {
        Some("content")
    } else {
        None
    };
    match differs {
        None => Ok(()),
        Some(field) => Err(Error::IdempotencyConflict {
            key: message.idempotency_key.clone(),
            field,
        }),
    }
}

fn terminal_outcome(state: ItemState) -> Outcome {
    match state {
        ItemState::Sent => Outcome::Sent,
        ItemState::Failed | ItemState::Queued => Outcome::Failed,
    }
}

fn audit_outcome_of(state: ItemState) -> AuditOutcome {
    match state {
        ItemState::Sent => AuditOutcome::Sent,
        ItemState::Failed => AuditOutcome::Failed,
        ItemState::Queued => AuditOutcome::Queued,
    }
}

/// Makes a caller-supplied code or reference storable: no NUL or control
/// characters, not blank, at most `max` bytes (cut on a character boundary).
pub(crate) fn sanitize(text: &str, max: usize) -> String {
    let mut clean: String = text
        .chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect();
    if clean.trim().is_empty() {
        "unspecified".clone_into(&mut clean);
    }
    if clean.len() > max {
        let mut cut = max;
        while !clean.is_char_boundary(cut) {
            cut -= 1;
        }
        clean.truncate(cut);
    }
    clean
}

/// Applies the settings rules (see `settings`) for a handle opening with
/// `builder`: stores or updates what the caller set explicitly (with a
/// `settings` audit record), and warns about builder values the stored ones
/// override. For a new outbox, returns the initial settings, which go with the
/// handle's first change (opening writes nothing more than it did).
fn settle_settings(
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
fn reconcile_audit(audit: &mut AuditTail, loaded: &Loaded, faults: &Failpoints) -> Result<()> {
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
