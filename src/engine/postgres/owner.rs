//! The handle's owner: its id, registered in `owners` and held by the
//! advisory lock of [`liveness`](super::liveness), taken again after a cut;
//! and the audit ids minted from it.
//!
//! The audit id stamped on an item can no longer hash the head the record
//! will chain to: PostgreSQL mints it from the handle's owner id (unique among
//! every handle that ever opened the schema: `owners` is keyed by it), a
//! counter of the handle, the key and the moment
//! ([`PgEngine::mint_audit_id`]).

use std::sync::atomic::{AtomicU64, Ordering};

use chrono::{DateTime, Utc};
use sha2::{Digest, Sha256};

use super::{PgEngine, liveness, lock};
use crate::error::Result;

static OWNER_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A fresh owner id candidate: host, process, time and a counter.
pub(super) fn owner_candidate() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "{host}-{}-{nanos:x}-{}",
        std::process::id(),
        OWNER_COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

impl PgEngine {
    /// A fresh audit id for a record about `key` at `now`: 128 bits of
    /// SHA-256 over this handle's owner id (unique in the schema's `owners`),
    /// a counter of this handle, the key and the moment.
    pub(crate) fn mint_audit_id(&self, key: &str, now: DateTime<Utc>) -> String {
        let n = self.minted.fetch_add(1, Ordering::Relaxed);
        hex::encode(
            &Sha256::new()
                .chain_update(b"durable-outbox postgres audit id\0")
                .chain_update(self.schema.as_bytes())
                .chain_update(b"\0")
                .chain_update(self.owner.as_bytes())
                .chain_update(b"\0")
                .chain_update(n.to_le_bytes())
                .chain_update(key.as_bytes())
                .chain_update(b"\0")
                .chain_update(crate::clock::format_timestamp(now).as_bytes())
                .finalize()[..16],
        )
    }

    /// Makes sure this handle's owner lock is held before a claim names it:
    /// after a cut or a server restart it is taken again (same owner id: the
    /// handle's sends in progress are alive, whatever other handles concluded
    /// meanwhile), once the other hosts' transactions that found it free
    /// have ended, and verified.
    pub(super) fn ensure_owner(&self) -> Result<()> {
        // The owner session is a synchronous client: off a current-thread
        // runtime's thread (see `connect::blocking`).
        super::blocking(|| self.ensure_owner_here())
    }

    fn ensure_owner_here(&self) -> Result<()> {
        let asked = std::time::Instant::now();
        let mut liveness = lock(&self.liveness);
        if liveness.held_since(asked) {
            return Ok(());
        }
        tracing::warn!(
            owner = %self.owner,
            "the owner lock's session is gone (network cut or server restart); \
             taking it again: claims in progress may have been declared ambiguous"
        );
        // Other hosts settling this owner's claims hold its key until their
        // transactions end: wait for them (bounded).
        let mut fresh = liveness::Liveness::retake(&self.connector, &self.schema, &self.owner)?;
        // A dedicated connection: after a cut the path to the server may
        // still be unwell, and the claim that asked must not wait for ever.
        fresh.verify(liveness::Other::Session(&mut self.connector.session()?))?;
        *liveness = fresh;
        Ok(())
    }

    /// Whether this handle's own owner lock is still held.
    #[expect(
        clippy::unnecessary_wraps,
        reason = "the same shape as probing another owner, which can fail"
    )]
    pub(crate) fn own_lock_held(&self) -> Result<bool> {
        let asked = std::time::Instant::now();
        Ok(super::blocking(|| lock(&self.liveness).held_since(asked)))
    }
}
