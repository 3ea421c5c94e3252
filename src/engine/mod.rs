//! The seam between the delivery rules and the storage engines.
//!
//! The rules (decide, claim, finish, retry, rate and order policy, audit record
//! building) say *what* happens to an item; an engine makes it durable. An
//! engine offers only the primitives below, each with an invariant the rules
//! rely on:
//!
//! * **Read** ([`Engine::get`], [`Engine::list`], [`Engine::find_by_transport_ref`]):
//!   the item as last committed, with its [`Versioned::revision`]. A read never
//!   returns a change that is not durable.
//! * **Commit a change set atomically** ([`Engine::commit`]): every item write
//!   and every audit record of one [`ChangeSet`] become durable together or not
//!   at all. Each write names what it expects to replace ([`Expect`]); if any
//!   expectation fails, nothing is written and [`CommitError::Conflict`] names
//!   the key, so two handles (or hosts) can never both act on one state of an
//!   item. The engine seals the audit events onto its chain inside the same
//!   commit: the chain has one total order and the same canonical records and
//!   hashes as `audit.jsonl` ([`AuditRecord::seal`]).
//! * **Claim with owner liveness** ([`Engine::claim_batch`], [`Engine::owner`],
//!   [`Engine::owner_is_alive`], [`Engine::orphaned_claims`]): a claim names the
//!   owner id of the handle that took it; an owner is alive exactly while its
//!   handle's liveness token (a locked owner file, a session-level advisory
//!   lock) is held. There is no clock-based lease: a slow send is never
//!   declared dead. A batch claim hands the rules only items that no other
//!   claimer is deciding about at the same moment, oldest first, each the
//!   oldest queued item of its destination.
//! * **Wake-ups** ([`Engine::wait_for_work`]): a commit that makes work due
//!   ([`ChangeSet::wake`]) wakes waiting workers on every host; waking is only a
//!   hint, so a waiter re-reads after it.
//!
//! The rules themselves run inside a transaction, [`rules::txn::Txn`](crate::rules::txn::Txn):
//! the file engine ([`file`]: `store`, `lock`, `audit` under the directory
//! lock) serves it with an overlay over its in-memory state; the PostgreSQL
//! engine serves it with `postgres::PgTxn` (the audit head row locked first,
//! rows read `FOR UPDATE`, one `COMMIT`), and that is what `Outbox::postgres`
//! runs on. The primitives above are the PostgreSQL engine's batch path
//! (`rules::lifecycle::claim_due`, `finish_claimed`), tested on its own; the
//! handle does not use it yet (see ARCHITECTURE.md, "Two engines").

#![allow(
    dead_code,
    reason = "the batch primitives are tested on their own; `Outbox` runs the \
              `Txn` rules (ARCHITECTURE.md, \"Two engines\")"
)]

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::audit::{AuditEvent, AuditRecord};
use crate::error::{Error, Result};
use crate::item::OutboxItem;

#[cfg(feature = "postgres")]
pub(crate) mod postgres;

pub(crate) mod file;

/// An item as an engine stored it, with the revision a conditional write names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Versioned {
    /// The item as last committed.
    pub(crate) item: OutboxItem,
    /// Bumped by every committed write of this item; starts at 1.
    pub(crate) revision: u64,
}

/// What a write expects to replace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expect {
    /// No item with this key exists (an enqueue).
    Absent,
    /// The item is still at this revision (nobody changed it since it was read).
    Revision(u64),
}

/// One item write of a change set.
#[derive(Debug, Clone)]
pub(crate) struct Put {
    /// The item's whole new state.
    pub(crate) item: OutboxItem,
    /// What the write replaces.
    pub(crate) expect: Expect,
}

/// Everything one rule decision writes: item states and the audit events that
/// report them, committed together.
#[derive(Debug, Clone, Default)]
pub(crate) struct ChangeSet {
    /// Item writes, applied in order.
    pub(crate) puts: Vec<Put>,
    /// Audit events, sealed onto the chain in order.
    pub(crate) audit: Vec<AuditEvent>,
    /// Whether the change makes work due (an enqueue, a requeue, a retry):
    /// waiting workers are woken when it commits.
    pub(crate) wake: bool,
}

/// Why a commit wrote nothing.
#[derive(Debug)]
pub(crate) enum CommitError {
    /// An item was not in the state the write expected: another handle acted
    /// first. Re-read and decide again.
    Conflict {
        /// The item's key.
        key: String,
    },
    /// The engine failed; nothing of the change set is visible.
    Failed(Error),
}

impl From<Error> for CommitError {
    fn from(error: Error) -> Self {
        Self::Failed(error)
    }
}

/// What the rules decide about one candidate of a batch claim.
pub(crate) type ClaimDecision = Option<OutboxItem>;

/// What a claim decision may look at besides the item: the times that count
/// against caps (sends, sends in progress, possible sends; see
/// `store::rate_times`) since the lookback the rules asked for, and the
/// destination's cooldown. Read after every earlier claim decision, on any
/// host, has committed, and including this batch's own claims so far: caps
/// hold across hosts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct RateView {
    /// The candidate's destination's times.
    pub(crate) destination_times: Vec<DateTime<Utc>>,
    /// Every destination's times (for the global cap).
    pub(crate) all_times: Vec<DateTime<Utc>>,
    /// Until when the platform asked not to send to the destination, if ever.
    pub(crate) cooldown_until: Option<DateTime<Utc>>,
}

/// The durable primitives the delivery rules need. See the module docs for
/// each primitive's invariant.
pub(crate) trait Engine: Send + Sync {
    /// The owner id that this handle's claims carry.
    fn owner(&self) -> &str;

    /// The item with this key, as last committed.
    fn get(&self, key: &str) -> Result<Option<Versioned>>;

    /// Every item, in enqueue order.
    fn list(&self) -> Result<Vec<Versioned>>;

    /// The item whose `transport_ref` this is (the earliest enqueued, when a
    /// platform reused one).
    fn find_by_transport_ref(&self, transport_ref: &str) -> Result<Option<Versioned>>;

    /// Commits `change` atomically and returns the audit records it sealed.
    fn commit(&self, change: ChangeSet) -> Result<Vec<AuditRecord>, CommitError>;

    /// Locks up to `limit` due candidates (queued, unclaimed, `next_attempt_at`
    /// not after `now`, oldest queued item of their destination) that no other
    /// claimer holds at this moment, lets `decide` turn each into its claimed
    /// state (or skip it with `None`) seeing its [`RateView`] (times since
    /// `now - lookback`), and commits the claimed ones, naming
    /// [`owner`](Self::owner). Returns them as committed.
    fn claim_batch(
        &self,
        now: DateTime<Utc>,
        limit: usize,
        lookback: Duration,
        decide: &mut dyn FnMut(&OutboxItem, &RateView) -> ClaimDecision,
    ) -> Result<Vec<Versioned>>;

    /// Whether the handle with owner id `owner` still holds its liveness token.
    fn owner_is_alive(&self, owner: &str) -> Result<bool>;

    /// Claimed items whose owner is dead (or unnamed): sends that may or may
    /// not have happened. The rules turn them into ambiguous failures.
    fn orphaned_claims(&self) -> Result<Vec<Versioned>>;

    /// Blocks until a commit with [`ChangeSet::wake`] lands (on any handle) or
    /// `timeout` passes; `true` when woken.
    fn wait_for_work(&self, timeout: Duration) -> Result<bool>;

    /// The audit chain's records with `seq` above `after`, in order.
    fn audit_records(&self, after: u64) -> Result<Vec<AuditRecord>>;
}
