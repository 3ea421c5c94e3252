//! A durable, at-most-once outbox for bots: in a directory on one host, or in
//! PostgreSQL (feature `postgres`) for bots on several hosts.
//!
//! A bot records each outbound message under a caller-owned idempotency key, then
//! hands it to its own transport through [`Outbox::process`]. The outbox promises,
//! in this order:
//!
//! 1. **Never send twice.** A dispatch claim is fsynced before `send` runs. A claim
//!    whose worker died (crash, `kill -9`) makes the item `failed` with
//!    [`AMBIGUOUS_AFTER_RESTART`]; it is never resent automatically. A claim held
//!    by a live worker makes other callers back off with [`Outcome::InFlight`].
//! 2. **Never lose a queued message.** [`Outbox::enqueue`] returns after the item's
//!    checksummed journal entry is fsynced; `outbox.json` snapshots are replaced
//!    atomically (temp file → fsync → rename → fsync directory).
//! 3. **Never corrupt or silently overwrite state.** Every read-modify-write runs
//!    under an advisory lock on `outbox.lock`; a damaged file is reported with its
//!    path and position and left untouched.
//! 4. **Prove what happened.** Every outcome appends a hash-chained record to
//!    `audit.jsonl` (content hashes only, never bodies); see [`AuditLog`].
//!
//! ```
//! # let dir = tempfile::tempdir()?;
//! use durable_outbox::{NewMessage, Outbox, Outcome, SendError};
//!
//! let outbox = Outbox::open(dir.path())?;
//! outbox.enqueue(NewMessage {
//!     idempotency_key: "order-17".into(),
//!     connector: "telegram".into(),
//!     grant_id: "bot-1".into(),
//!     destination: "chat-42".into(),
//!     content: "your order shipped".into(),
//!     ..Default::default()
//! })?;
//!
//! let receipt = outbox.process("order-17", |item| {
//!     // Call the platform here. Say which class of failure happened, if any:
//!     // SendError::retryable / permanent / ambiguous.
//!     let _ = item.content();
//!     Ok::<_, SendError>(Some("tg-981".into()))
//! })?;
//! assert_eq!(receipt.outcome, Outcome::Sent);
//!
//! // A reply in chat-42 quotes message id tg-981: which outbound item does it
//! // answer? Telegram numbers messages per chat, so look it up in that chat.
//! let original = outbox.find_by_transport_ref_in("chat-42", "tg-981")?.expect("known reply");
//! assert_eq!(original.idempotency_key(), "order-17");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Messages to one destination are handed to `send` in enqueue order, one at a
//! time, across threads and processes ([`Ordering`]; `Ordering::Unordered` for
//! broadcasts); a later one answers [`Outcome::Waiting`] until the earlier ones
//! are sent or failed. With the `tokio` feature, `Outbox::worker` runs the
//! delivery loop: woken by enqueues, asleep until the next due moment, stopping
//! gracefully. Without it, [`Outbox::next_due_at`] says when to call
//! [`Outbox::process_due`] again.
//!
//! # Features
//!
//! | feature | what it adds |
//! |---|---|
//! | `tokio` | the delivery worker (`Outbox::worker`) and async forms for tokio bots: `Outbox::process_async`, `Outbox::process_due_async`, and `_async` forms of `enqueue`, `get`, `find_*`, `list_items`, `requeue`, `cancel` and the bulk actions, all running file work on the blocking pool |
//! | `metrics` | counters per outcome and error code, an enqueue-to-sent latency histogram and queue gauges through the [`metrics`](https://docs.rs/metrics) facade (names in the README's "Observability" table) |
//! | `postgres` | `Outbox::postgres(url)`: the same `Outbox` in a PostgreSQL schema, shared by bots on several hosts (owner liveness by session advisory locks, one audit chain in a table, wake-ups by `LISTEN`/`NOTIFY`; see the README, "More than one host") |
//! | `matrix` | `MatrixClient`, a transport for the Matrix client-server API (stable `txnId`, classified failures, replies from `/sync`); implies `tokio`; plain HTTP unless the application enables a `reqwest` TLS feature (see the README, "A Matrix bot") |
//! | `cli` | the `durable-outbox` operator tool (a binary; no library items; with `postgres` it also takes `postgres://` URLs and migrates) |
//!
//! `tracing` spans (`outbox.enqueue`, `outbox.claim`, `outbox.send`,
//! `outbox.finish`, with key, destination, attempt and outcome) are always
//! emitted; they cost nothing without a subscriber. The `test-failpoints`
//! feature is for this crate's own crash tests and is not part of the API.
//!
//! # Replies, retries and operators
//!
//! - A reply names the platform's message id: match it with
//!   [`Outbox::find_by_transport_ref_in`] (Telegram and Slack ids are unique only
//!   within a chat) or [`Outbox::find_by_transport_ref`] (globally unique ids,
//!   such as Matrix event ids).
//! - A retryable failure is retried with the [`Backoff`] (default: exponential
//!   from 1 s to 10 min, 12 attempts); a platform's `retry_after` (HTTP 429)
//!   waits without using an attempt, bounded by
//!   [`give_up_after`](OutboxBuilder::give_up_after) (default 24 h, then [`GAVE_UP`]).
//! - Each failure's [`FailureClass`] is stored ([`OutboxItem::failure_class`]);
//!   [`FailureClass::Ambiguous`] means "may have been delivered": only an operator
//!   may send it again ([`Outbox::requeue`], or many at once with
//!   [`Outbox::requeue_where`] and an [`ItemFilter`]).
//!
//! Files in an outbox directory: `outbox.json` (snapshot), `outbox.journal`
//! (changes since the snapshot), `audit.jsonl` (audit log),
//! `outbox.lock` (the lock target, never replaced) and `owners/` (one locked file per
//! open handle, which is how a live claim is told from a dead one). Keep the
//! directory on a local filesystem: advisory locks are unreliable over the network.

#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "tokio")]
mod asynchronous;
mod audit;
mod builder;
mod clock;
mod commit;
mod engine;
mod error;
mod failpoint;
mod filter;
mod fsutil;
mod history;
mod item;
mod lock;
#[cfg(feature = "matrix")]
mod matrix;
mod message;
mod metrics;
#[cfg(feature = "postgres")]
mod migrate;
mod order;
mod outbox;
mod pacing;
mod profile;
mod rate;
mod receipt;
mod retry;
mod rules;
mod send;
mod settings;
mod store;
mod trust;
mod wake;
#[cfg(feature = "tokio")]
mod worker;

pub use crate::audit::{
    AuditChainRecords, AuditLog, AuditOutcome, AuditRecord, AuditRecords, AuditReport,
    GENESIS_HASH, Head,
};
pub use crate::builder::OutboxBuilder;
pub use crate::clock::{Clock, ManualClock, Sleeper, SystemClock, ThreadSleeper};
pub use crate::error::{AuditFault, Error, Result};
#[cfg(any(test, feature = "test-failpoints"))]
#[doc(hidden)]
pub use crate::failpoint::FailAction;
pub use crate::filter::{BulkReport, ItemFilter};
pub use crate::history::{HistoryItems, Retention};
pub use crate::item::{ItemState, OutboxItem};
#[cfg(feature = "matrix")]
pub use crate::matrix::{MatrixClient, MatrixReply, MatrixSession, SyncBatch};
pub use crate::message::{DEFAULT_DIRECTION, DEFAULT_LANE, NewMessage, limits};
#[cfg(feature = "postgres")]
pub use crate::migrate::{Migration, MigrationReport};
pub use crate::order::Ordering;
pub use crate::outbox::Outbox;
pub use crate::rate::{DestinationWindow, RateLimit};
pub use crate::receipt::{DeliveryReceipt, DrainReport, Outcome};
pub use crate::retry::Backoff;
pub use crate::rules::codes::{
    AMBIGUOUS_AFTER_RESTART, ATTEMPTS_EXHAUSTED, CANCELLED, DESTINATION_COOLDOWN,
    DESTINATION_PACED, GAVE_UP, GLOBAL_RATE_CAPPED, RATE_CAPPED, SEND_CANCELLED, SEND_PANICKED,
};
pub use crate::send::{FailureClass, SendError};
pub use crate::settings::Settings;
#[cfg(feature = "tokio")]
pub use crate::worker::{Worker, WorkerReport};
/// The timestamp types of the API (`DateTime<Utc>`), re-exported so a bot
/// names them without depending on `chrono` itself.
pub use chrono::{DateTime, Utc};

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
