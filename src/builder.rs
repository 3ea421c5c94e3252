//! `Outbox::builder(dir)`: every knob, with its default, validated in one place.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::{Clock, Sleeper, SystemClock, ThreadSleeper};
use crate::error::{Error, Result};
use crate::outbox::Outbox;
use crate::rate::{RateLimit, RatePolicy};
use crate::retry::Backoff;
use crate::settings::Stored;

/// Configures and opens an [`Outbox`].
///
/// ```
/// # let dir = tempfile::tempdir()?;
/// use durable_outbox::{Backoff, Outbox};
/// use std::time::Duration;
///
/// let outbox = Outbox::builder(dir.path())
///     .max_attempts(5)
///     .backoff(Backoff::Exponential {
///         base: Duration::from_millis(200),
///         cap: Duration::from_secs(30),
///         jitter: true,
///     })
///     .rate_limit(1, Duration::from_secs(1)) // Telegram: about 1 message/s per chat
///     .open()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[must_use = "a builder does nothing until `open` is called"]
pub struct OutboxBuilder {
    pub(crate) dir: PathBuf,
    pub(crate) max_attempts: u32,
    pub(crate) backoff: Backoff,
    pub(crate) give_up_after: Duration,
    pub(crate) rates: RatePolicy,
    pub(crate) max_inline_wait: Duration,
    pub(crate) drain_batch: usize,
    pub(crate) ordering: crate::order::Ordering,
    pub(crate) compact_on_open: bool,
    /// Whether opening may create the outbox (see [`create_if_missing`](Self::create_if_missing)).
    pub(crate) create: Create,
    pub(crate) history_after: Duration,
    pub(crate) retention: crate::history::Retention,
    pub(crate) audit_rotate_bytes: u64,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) sleeper: Arc<dyn Sleeper>,
    pub(crate) audit_key: Option<Vec<u8>>,
    pub(crate) trust: crate::trust::Trust,
    /// The shared settings the caller set explicitly (the rest are defaults).
    pub(crate) explicit: Stored,
    /// Whether `explicit` replaces what the outbox stores.
    pub(crate) update_settings: bool,
    /// Connectors whose platform deduplicates by transaction id, with the
    /// window within which it does.
    pub(crate) idempotent: std::collections::BTreeMap<String, Duration>,
    #[cfg(any(test, feature = "test-failpoints"))]
    pub(crate) failpoints: Vec<(String, crate::failpoint::FailAction)>,
    /// Where the outbox lives when it is not a directory: a PostgreSQL URL
    /// and schema ([`Outbox::postgres`]).
    #[cfg(feature = "postgres")]
    pub(crate) postgres: Option<PostgresTarget>,
    /// A schema named with [`schema`](Self::schema): refused on a directory.
    #[cfg(feature = "postgres")]
    pub(crate) schema_named: bool,
    /// [`max_connections`](Self::max_connections), if set: refused on a
    /// directory, and when 0.
    #[cfg(feature = "postgres")]
    pub(crate) max_connections: Option<usize>,
    /// [`upgrade_schema`](Self::upgrade_schema): `None` unless set (then
    /// refused on a directory); unset means upgrade.
    #[cfg(feature = "postgres")]
    pub(crate) upgrade_schema: Option<bool>,
    /// The schema version a test's open migrates to instead of this
    /// release's ([`schema_version_for_tests`](Self::schema_version_for_tests)).
    #[cfg(all(feature = "postgres", any(test, feature = "test-failpoints")))]
    pub(crate) schema_version_for_tests: Option<i64>,
}

/// Whether opening may create a new outbox ([`OutboxBuilder::create_if_missing`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Create {
    /// A bot's open: makes the directory or the schema's tables if missing.
    IfMissing,
    /// Only an existing outbox is opened; nothing is created.
    Never,
}

/// A PostgreSQL outbox's place: the server and the schema.
#[cfg(feature = "postgres")]
#[derive(Clone)]
pub(crate) struct PostgresTarget {
    /// The connection URL (may hold a password: never logged or shown).
    pub(crate) url: String,
    /// The schema holding the outbox's tables.
    pub(crate) schema: String,
}

impl std::fmt::Debug for OutboxBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutboxBuilder")
            .field("dir", &self.dir)
            .field("postgres", &self.postgres_schema())
            .field("max_attempts", &self.max_attempts)
            .field("backoff", &self.backoff)
            .field("give_up_after", &self.give_up_after)
            .field("rates", &self.rates)
            .field("max_inline_wait", &self.max_inline_wait)
            .field("drain_batch", &self.drain_batch)
            .field("ordering", &self.ordering)
            .field("compact_on_open", &self.compact_on_open)
            .field("create", &self.create)
            .field("history_after", &self.history_after)
            .field("retention", &self.retention)
            .field("audit_rotate_bytes", &self.audit_rotate_bytes)
            .field("clock", &"<clock>")
            .field("audit_key", &self.audit_key.as_ref().map(|_| "<secret>"))
            .field("shared_group", &self.trust.shared_group)
            .field("idempotent_transport", &self.idempotent)
            .finish_non_exhaustive()
    }
}

impl OutboxBuilder {
    /// The schema of a PostgreSQL outbox (the URL is never shown: it may hold a password).
    #[cfg_attr(
        not(feature = "postgres"),
        expect(
            clippy::unused_self,
            reason = "no PostgreSQL target without the feature"
        )
    )]
    fn postgres_schema(&self) -> Option<&str> {
        #[cfg(feature = "postgres")]
        {
            self.postgres.as_ref().map(|t| t.schema.as_str())
        }
        #[cfg(not(feature = "postgres"))]
        {
            None
        }
    }

    /// This handle's builder values of the stored settings: what a setting
    /// the outbox does not store falls back to (see `settings`). One place,
    /// so every engine reads the same knobs.
    pub(crate) fn handle_settings(&self) -> crate::settings::Settings {
        crate::settings::Settings {
            rates: self.rates.clone(),
            history_after: self.history_after,
            retention: self.retention,
            max_attempts: self.max_attempts,
            backoff: self.backoff.clone(),
            give_up_after: self.give_up_after,
            ordering: self.ordering,
            stored: Vec::new(),
        }
    }

    pub(crate) fn new(dir: PathBuf) -> Self {
        Self {
            dir,
            max_attempts: 12,
            backoff: Backoff::default(),
            give_up_after: Duration::from_secs(24 * 60 * 60),
            rates: RatePolicy::default(),
            max_inline_wait: Duration::from_secs(5),
            drain_batch: 16,
            ordering: crate::order::Ordering::PerDestination,
            compact_on_open: true,
            create: Create::IfMissing,
            history_after: Duration::from_secs(24 * 60 * 60),
            retention: crate::history::Retention::KeepAll,
            audit_rotate_bytes: 64 * 1024 * 1024,
            clock: Arc::new(SystemClock),
            sleeper: Arc::new(ThreadSleeper),
            audit_key: None,
            trust: crate::trust::Trust::default(),
            explicit: Stored::default(),
            update_settings: false,
            idempotent: std::collections::BTreeMap::new(),
            #[cfg(any(test, feature = "test-failpoints"))]
            failpoints: Vec::new(),
            #[cfg(feature = "postgres")]
            postgres: None,
            #[cfg(feature = "postgres")]
            schema_named: false,
            #[cfg(feature = "postgres")]
            max_connections: None,
            #[cfg(feature = "postgres")]
            upgrade_schema: None,
            #[cfg(all(feature = "postgres", any(test, feature = "test-failpoints")))]
            schema_version_for_tests: None,
        }
    }

    /// A builder for an outbox in PostgreSQL (see [`Outbox::postgres`]).
    #[cfg(feature = "postgres")]
    pub(crate) fn for_postgres(url: String) -> Self {
        let mut builder = Self::new(PathBuf::new());
        builder.postgres = Some(PostgresTarget {
            url,
            schema: crate::engine::postgres::DEFAULT_SCHEMA.to_owned(),
        });
        builder
    }

    /// The PostgreSQL schema that holds this outbox's tables (default
    /// `durable_outbox`): many outboxes can share one database, each in its own
    /// schema. 1 to 48 lowercase letters, digits and `_`, not starting with a
    /// digit. Only for [`Outbox::postgres`]: opening a directory with a schema
    /// named is refused.
    #[cfg(feature = "postgres")]
    pub fn schema(mut self, name: &str) -> Self {
        self.schema_named = true;
        if let Some(target) = &mut self.postgres {
            name.clone_into(&mut target.schema);
        }
        self
    }

    /// The most connections for reads and commits this PostgreSQL handle
    /// opens at once (default 10), so that a bot running many calls at once
    /// (threads, or tasks calling the `_async` forms) does not take the
    /// server's `max_connections` from its other users. A call that finds
    /// them all in use waits for one to come free, at most as long as
    /// opening a connection may take (the URL's `connect_timeout` plus its
    /// `tcp_user_timeout`: 10 s + 30 s by default; a `tcp_user_timeout` of
    /// 0, which the sockets take as "never", counts as its 30 s default
    /// here), then fails with
    /// [`Error::PoolExhausted`], having done nothing; except recording what
    /// a send did, which waits as long as it takes (the send happened).
    ///
    /// In all a handle uses at most `n` + 3 connections: these, one holding
    /// its owner lock, one listening for wake-ups while a worker waits, and
    /// one sending wake-ups; briefly one or two more while it opens, takes
    /// its owner lock again after a cut, or asks the server about a
    /// connection that went silent. At least 1; only for
    /// [`Outbox::postgres`] (refused on a directory).
    #[cfg(feature = "postgres")]
    pub fn max_connections(mut self, n: usize) -> Self {
        self.max_connections = Some(n);
        self
    }

    /// Whether opening may migrate a PostgreSQL outbox whose tables are at
    /// an older schema version to this release's. Default `true`: a bot's
    /// open upgrades the outbox it starts on, as the bots of one release
    /// expect. A tool that only looks (the operator's `durable-outbox`, a
    /// monitoring probe) turns it off: migrating is a decision for whoever
    /// upgrades the bots, because a bot of the older release refuses the
    /// migrated tables ([`Error::UnsupportedSchema`]) at its next start.
    /// With it off, opening an outbox at an older version is refused with
    /// [`Error::SchemaUpgradeNeeded`], nothing written; one at this
    /// release's version opens as usual, and creating a new outbox (see
    /// [`create_if_missing`](Self::create_if_missing)) is not an upgrade.
    /// Only for [`Outbox::postgres`] (refused on a directory: opening one
    /// rewrites no file in a newer format unless it compacts, see
    /// [`compact_on_open`](Self::compact_on_open)).
    #[cfg(feature = "postgres")]
    pub fn upgrade_schema(mut self, upgrade: bool) -> Self {
        self.upgrade_schema = Some(upgrade);
        self
    }

    /// Migrates a PostgreSQL outbox only up to `version` on open, as an
    /// older release would have (tests build an older schema with it;
    /// feature `test-failpoints` only).
    #[cfg(all(feature = "postgres", any(test, feature = "test-failpoints")))]
    #[doc(hidden)]
    pub fn schema_version_for_tests(mut self, version: i64) -> Self {
        self.schema_version_for_tests = Some(version);
        self
    }

    /// Attempts (claims) allowed per item before a retryable failure becomes
    /// terminal. Default 12: with the default [`Backoff`], 14 to 27 minutes of
    /// retrying. A `retry_after` (platform pacing) uses no attempt. Must be at
    /// least 1. A stored setting (see [`update_settings`](Self::update_settings)).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self.explicit.max_attempts = Some(attempts);
        self
    }

    /// The wait after a retryable failure. Default: exponential from 1 s up to
    /// 10 min, jittered (see [`Backoff`]'s `Default`). A stored setting (see
    /// [`update_settings`](Self::update_settings)).
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.explicit.backoff = Some(backoff.clone());
        self.backoff = backoff;
        self
    }

    /// How long after it was enqueued an item is still retried. A retryable
    /// failure whose next attempt would start later fails the item with
    /// [`GAVE_UP`](crate::GAVE_UP) instead. This is what bounds platform pacing:
    /// a failure with a `retry_after` (an HTTP 429) does not consume
    /// [`max_attempts`](Self::max_attempts), so without a deadline a platform
    /// that keeps answering 429 would keep the item forever. Default 24 h;
    /// must be positive.
    pub fn give_up_after(mut self, age: Duration) -> Self {
        self.give_up_after = age;
        self.explicit.give_up_after = Some(age);
        self
    }

    /// At most `count` sends per destination in any sliding `window`, for
    /// destinations no [`rate_limit_for`](Self::rate_limit_for) pattern matches.
    /// Default: 1 per second, the per-chat rate Telegram and Slack publish (see
    /// [`RateLimit::default`]). Both must be positive. A stored setting (see
    /// [`update_settings`](Self::update_settings)): an outbox keeps the cap it
    /// was created with.
    pub fn rate_limit(mut self, count: u32, window: Duration) -> Self {
        self.rates.per_destination = RateLimit { count, window };
        self.explicit.rate_limit = Some(self.rates.per_destination);
        self
    }

    /// A different per-destination cap for destinations matching `pattern`, where
    /// `*` matches any run of characters: e.g. Telegram group chats have negative
    /// ids, and a group takes at most 20 messages a minute
    /// (`.rate_limit_for("-*", 20, Duration::from_secs(60))`). The first matching
    /// pattern, in the order given, wins. Default: none. A stored setting: the
    /// whole list is one (see [`update_settings`](Self::update_settings)).
    pub fn rate_limit_for(mut self, pattern: &str, count: u32, window: Duration) -> Self {
        self.rates
            .overrides
            .push((pattern.to_owned(), RateLimit { count, window }));
        self.explicit.rate_limit_for = Some(self.rates.overrides.clone());
        self
    }

    /// Declares that `connector`'s platform deduplicates sends by
    /// [`OutboxItem::transaction_id`](crate::OutboxItem::transaction_id) for at
    /// least `dedup_window`: a repeated request with the same transaction id
    /// returns the first request's answer and creates nothing new. Default:
    /// no connector.
    ///
    /// Under it, an outcome that would otherwise fail the item as ambiguous is
    /// retried instead, with the same transaction id, as long as attempts are
    /// left and the item was enqueued less than `dedup_window` ago: a send that
    /// reported [`FailureClass::Ambiguous`](crate::FailureClass::Ambiguous), a
    /// claim whose worker died mid-send ([`AMBIGUOUS_AFTER_RESTART`](crate::AMBIGUOUS_AFTER_RESTART)),
    /// and an async send dropped mid-flight ([`SEND_CANCELLED`](crate::SEND_CANCELLED)).
    /// Each such retry is audited as `retrying` with a note naming the
    /// ambiguous cause. Outside the window, or with no attempts left, the item
    /// fails as before. A panicking `send` still fails the item: a panic is a
    /// bug, not a network outcome. Items of other connectors keep the
    /// at-most-once rules unchanged.
    ///
    /// # Safety of the promise
    ///
    /// This is exactly-once delivery only if all of these hold, and only the
    /// caller can know that they do:
    /// - `send` passes `item.transaction_id()` as the platform's transaction id,
    ///   for every item of this connector;
    /// - every attempt is made under the same platform identity the platform
    ///   scopes deduplication to (Matrix: the same user *and* the same device,
    ///   so log in with a fixed `device_id` and never log that device out);
    /// - `dedup_window` is no longer than the platform keeps transaction ids
    ///   (Synapse keeps them for about a day, across restarts; declare less);
    /// - the platform answers a repeat with the original result rather than an
    ///   error, so the item records the original message id.
    ///
    /// `dedup_window` must be positive; `connector` must not be empty.
    ///
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// use durable_outbox::Outbox;
    /// use std::time::Duration;
    ///
    /// let outbox = Outbox::builder(dir.path())
    ///     .idempotent_transport("matrix", Duration::from_secs(60 * 60))
    ///     .open()?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn idempotent_transport(mut self, connector: &str, dedup_window: Duration) -> Self {
        self.idempotent.insert(connector.to_owned(), dedup_window);
        self
    }

    /// At most `count` sends across all destinations in any sliding `window`
    /// (Telegram: about 30 a second for a bot). An item held back by it is
    /// deferred with [`GLOBAL_RATE_CAPPED`](crate::GLOBAL_RATE_CAPPED). Default: none.
    /// A stored setting (see [`update_settings`](Self::update_settings)).
    pub fn global_rate_limit(mut self, count: u32, window: Duration) -> Self {
        self.rates.global = Some(RateLimit { count, window });
        self.explicit.global_rate_limit = self.rates.global;
        self
    }

    /// The longest wait [`Outbox::process`] sleeps inline before retrying. A
    /// longer wait (a long backoff or a platform's `retry_after`) ends the call
    /// with [`Outcome::Deferred`](crate::Outcome::Deferred) instead, and
    /// [`Outbox::process_due`] picks the item up when it is due. Default 5 s.
    pub fn max_inline_wait(mut self, wait: Duration) -> Self {
        self.max_inline_wait = wait;
        self
    }

    /// Formerly how many items [`Outbox::process_due`] claimed per durable
    /// step. Still validated (1 to 4,096) but no longer used: every drain now
    /// claims one item right before its send, in the same durable step that
    /// records the previous outcome, so a crash leaves at most the sends that had
    /// started ambiguous.
    #[deprecated(
        since = "0.2.0",
        note = "process_due claims one item per send; the batch size has no effect"
    )]
    pub fn drain_batch(mut self, items: usize) -> Self {
        self.drain_batch = items;
        self
    }

    /// Whether messages to one destination leave in enqueue order. Default
    /// [`Ordering::PerDestination`](crate::Ordering::PerDestination): one at a
    /// time, oldest first (see [`Ordering`](crate::Ordering) for the rule);
    /// [`Ordering::Unordered`](crate::Ordering::Unordered) for broadcasts. It is
    /// a stored setting (see [`update_settings`](Self::update_settings)): the
    /// outbox keeps the rule it was created with, whatever another handle asks.
    pub fn ordering(mut self, ordering: crate::order::Ordering) -> Self {
        self.ordering = ordering;
        self.explicit.ordering = Some(ordering);
        self
    }

    /// Whether opening folds the journal into a fresh `outbox.json`. Default
    /// `true`, so the snapshot is current after every start. Tools that only
    /// look (an operator's `status`, a monitoring probe) turn it off so opening
    /// writes as little as possible; the journal is compacted later anyway.
    /// On PostgreSQL (no journal) it marks such a tool too: opening then
    /// applies no `history_retention` (no prune, no `pruned` record), and
    /// opening a schema that holds no outbox yet stores none of the handle's
    /// settings: the first handle opened with it on (the bot) stores its own.
    pub fn compact_on_open(mut self, compact: bool) -> Self {
        self.compact_on_open = compact;
        self
    }

    /// Whether opening may create a new, empty outbox where none is. Default
    /// `true`: a bot's first start makes its outbox. A tool that only looks
    /// at an existing one turns it off, so a mistyped directory or schema is
    /// an error instead of a fresh empty outbox that "verifies". With it off,
    /// opening refuses, creating nothing, with [`Error::InvalidConfig`]:
    /// setting `dir` for a directory that holds none of `outbox.json`,
    /// `outbox.journal`, `audit.jsonl` and `outbox.lock` ([`Error::Io`] when
    /// it does not exist), setting `schema` for a PostgreSQL schema without the outbox's
    /// tables.
    pub fn create_if_missing(mut self, create: bool) -> Self {
        self.create = if create {
            Create::IfMissing
        } else {
            Create::Never
        };
        self
    }

    /// How long a sent or failed item stays in the live state before a
    /// compaction moves it to `history/`. Default 24 h. Never less than the
    /// longest rate window: an item that still counts against a cap stays live.
    /// History items are still found by `get`, `find_by_transport_ref` and
    /// idempotent `enqueue`, and a failed one can still be requeued;
    /// [`Outbox::list_items`] lists only the live ones. A stored setting (see
    /// [`update_settings`](Self::update_settings)).
    pub fn history_after(mut self, age: Duration) -> Self {
        self.history_after = age;
        self.explicit.history_after = Some(age);
        self
    }

    /// How much history to keep. Default [`Retention::KeepAll`](crate::Retention::KeepAll).
    /// Pruning removes whole segments at compaction, newest segment excepted,
    /// each with a `pruned` audit record naming it.
    ///
    /// # Idempotency after pruning
    ///
    /// A pruned item is forgotten: enqueueing its key again creates a new item,
    /// which will be sent. Keep history at least as long as your callers may
    /// retry an enqueue with the same key.
    ///
    /// A stored setting (see [`update_settings`](Self::update_settings)).
    pub fn history_retention(mut self, retention: crate::history::Retention) -> Self {
        self.retention = retention;
        self.explicit.history_retention = Some(retention);
        self
    }

    /// Seal the active `audit.jsonl` as `audit-<first seq>.jsonl` at the first
    /// compaction after it grows past this many bytes; the chain continues in a
    /// new `audit.jsonl`. Default 64 MiB; at least 1 KiB. Sealed segments are
    /// never deleted by the outbox: removing old audit history is an operator's
    /// decision. [`AuditLog::verify_dir`](crate::AuditLog::verify_dir) and
    /// [`Outbox::verify_audit`] verify across all segments.
    pub fn audit_rotate_bytes(mut self, bytes: u64) -> Self {
        self.audit_rotate_bytes = bytes;
        self
    }

    /// Makes the stored settings set on this builder replace the ones the outbox
    /// stores, with a `settings` audit record naming each change. Default: off.
    ///
    /// # Stored settings
    ///
    /// The settings that shape state every process shares — [`rate_limit`](Self::rate_limit),
    /// [`rate_limit_for`](Self::rate_limit_for), [`global_rate_limit`](Self::global_rate_limit),
    /// [`history_after`](Self::history_after), [`history_retention`](Self::history_retention),
    /// [`max_attempts`](Self::max_attempts), [`backoff`](Self::backoff),
    /// [`give_up_after`](Self::give_up_after) and [`ordering`](Self::ordering) — live in the
    /// outbox directory, so every handle, the operator CLI and a maintenance job
    /// opened with defaults work with the same caps:
    ///
    /// - The handle that creates an outbox stores all of its values.
    /// - Opening an existing outbox uses what it stores. A value set on the builder
    ///   that differs is ignored with a warning (it must never silently weaken a
    ///   cap another process relies on), unless this flag is set.
    /// - An outbox created by an older release stores nothing at first: each
    ///   setting is stored, with an audit record, the first time a handle sets it
    ///   explicitly; until then every handle uses its own value.
    ///
    /// Only the values set on this builder are written; the others stay as stored.
    /// [`Outbox::settings`] shows what is in force.
    pub fn update_settings(mut self) -> Self {
        self.update_settings = true;
        self
    }

    /// Where "now" comes from. Default: the system clock.
    pub fn clock(mut self, clock: impl Clock + 'static) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// How inline retries wait. Default: `std::thread::sleep`.
    pub fn sleeper(mut self, sleeper: impl Sleeper + 'static) -> Self {
        self.sleeper = Arc::new(sleeper);
        self
    }

    /// Keys the audit chain: record hashes become HMAC-SHA-256 under `key`, so
    /// someone who can edit the files but does not know the key cannot forge a
    /// valid chain. Every process writing the outbox must use the same key, and
    /// an existing log must have been written with it. Default: unkeyed SHA-256.
    pub fn audit_key(mut self, key: impl Into<Vec<u8>>) -> Self {
        self.audit_key = Some(key.into());
        self
    }

    /// Trusts the members of group `gid` with this outbox, for deployments that
    /// share the directory with a group on purpose (say a deploy tool made it
    /// `2770 bot:outbox`).
    ///
    /// By default opening refuses ([`Error::Untrusted`]) an outbox directory, or
    /// any state file in it, that is owned by someone other than the effective
    /// user or root, or that group or others can write: whoever can write them
    /// can read every message body and have their own messages sent as yours.
    /// With this setting a directory or file whose group is `gid` may also be
    /// group-writable and owned by another member of the group. Writable by
    /// others is still refused, a symlink in place of a state file is still
    /// refused, and the outbox still creates its own files readable by their
    /// owner only. Default: no group is trusted.
    ///
    /// # Security
    ///
    /// Every member of the group can then plant messages and read bodies: trust
    /// the group as you trust the bot's own user.
    pub fn shared_group(mut self, gid: u32) -> Self {
        self.trust.shared_group = Some(gid);
        self
    }

    /// Arms a test failpoint on this outbox (feature `test-failpoints` only).
    #[cfg(any(test, feature = "test-failpoints"))]
    #[doc(hidden)]
    pub fn failpoint(mut self, name: &str, action: crate::failpoint::FailAction) -> Self {
        self.failpoints.push((name.to_owned(), action));
        self
    }

    /// Validates the settings, creates the directory if needed and opens the outbox.
    ///
    /// Opening sweeps temp files left by crashed writers, verifies the audit
    /// records written since the last compaction (moving a torn last line aside;
    /// see the `audit` module for when the whole chain is verified), loads
    /// `outbox.json` and the history indexes, replays
    /// `outbox.journal` (moving a torn, unacknowledged last entry aside), re-appends
    /// audit records a crash kept out of the log, and compacts the journal into a
    /// fresh snapshot.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a bad setting; [`Error::Corrupt`],
    /// [`Error::InvalidRecord`] or [`Error::UnsupportedVersion`] for a damaged
    /// `outbox.json` or `outbox.journal`; [`Error::AuditBroken`] for a damaged audit
    /// log (no damaged file is modified); [`Error::Untrusted`] when the directory
    /// or a state file in it is another user's, writable by group or others, or a
    /// symlink (see [`shared_group`](Self::shared_group)); [`Error::Io`] when the
    /// directory or files are inaccessible.
    ///
    /// For `Outbox::postgres` (feature `postgres`): connects, creates or
    /// migrates the schema's tables (refusing a newer schema with
    /// [`Error::UnsupportedSchema`], and an older one with
    /// [`Error::SchemaUpgradeNeeded`] under `upgrade_schema(false)`), stores
    /// or reconciles the settings, and
    /// takes this handle's owner lock; [`Error::InvalidConfig`] for a bad URL
    /// or schema name, [`Error::Database`] when the server cannot be reached
    /// or fails, [`Error::SessionLocksUnavailable`] behind a transaction-mode
    /// pooler.
    pub fn open(self) -> Result<Outbox> {
        if self.max_attempts == 0 {
            return Err(Error::invalid_config("max_attempts", "must be at least 1"));
        }
        if self.give_up_after.is_zero() {
            return Err(Error::invalid_config("give_up_after", "must be positive"));
        }
        if self.audit_rotate_bytes < 1024 {
            return Err(Error::invalid_config(
                "audit_rotate_bytes",
                "must be at least 1024",
            ));
        }
        if !(1..=4096).contains(&self.drain_batch) {
            return Err(Error::invalid_config("drain_batch", "must be 1 to 4096"));
        }
        self.backoff.validate()?;
        self.rates.validate()?;
        for (connector, window) in &self.idempotent {
            if connector.trim().is_empty() {
                return Err(Error::invalid_config(
                    "idempotent_transport",
                    "connector must not be empty",
                ));
            }
            if window.is_zero() {
                return Err(Error::invalid_config(
                    "idempotent_transport",
                    "dedup_window must be positive",
                ));
            }
        }
        if matches!(&self.audit_key, Some(key) if key.is_empty()) {
            return Err(Error::invalid_config("audit_key", "must not be empty"));
        }
        #[cfg(feature = "postgres")]
        if self.schema_named && self.postgres.is_none() {
            return Err(Error::invalid_config(
                "schema",
                "a schema names where a PostgreSQL outbox lives; this builder opens a directory",
            ));
        }
        #[cfg(feature = "postgres")]
        if let Some(n) = self.max_connections {
            if n == 0 {
                return Err(Error::invalid_config(
                    "max_connections",
                    "must be at least 1",
                ));
            }
            if self.postgres.is_none() {
                return Err(Error::invalid_config(
                    "max_connections",
                    "caps a PostgreSQL handle's connections; this builder opens a directory",
                ));
            }
        }
        #[cfg(feature = "postgres")]
        if self.upgrade_schema.is_some() && self.postgres.is_none() {
            return Err(Error::invalid_config(
                "upgrade_schema",
                "is about a PostgreSQL outbox's tables; this builder opens a directory",
            ));
        }
        Outbox::open_with(self)
    }
}
