//! The storage engines under the delivery rules.
//!
//! The rules (decide, claim, finish, retry, rate and order policy, audit record
//! building, `crate::rules`) say *what* happens to an item; an engine makes it
//! durable. Every rule runs inside one transaction,
//! [`rules::txn::Txn`](crate::rules::txn::Txn), and that is the one way an
//! item changes on either engine: the file engine ([`file`]: `store`, `lock`,
//! `audit` under the directory lock) serves it with an overlay over its
//! in-memory state, and the PostgreSQL engine (`postgres`, feature
//! `postgres`) with `postgres::PgTxn` (rows read `FOR UPDATE`, one `COMMIT`).
//! Everything else an engine offers is reads, housekeeping and owner
//! liveness, behind the same calls (`FileEngine`, `postgres::PgBackend`).

use crate::item::OutboxItem;

#[cfg(feature = "postgres")]
pub(crate) mod postgres;

pub(crate) mod file;

/// An item as an engine stored it, with the revision a conditional write names.
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Versioned {
    /// The item as last committed.
    pub(crate) item: OutboxItem,
    /// Bumped by every committed write of this item; starts at 1.
    pub(crate) revision: u64,
}

/// What a write expects to replace.
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expect {
    /// No item with this key exists (an enqueue).
    Absent,
    /// The item is still at this revision (nobody changed it since it was read).
    Revision(u64),
}
