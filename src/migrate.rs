//! Moving a file outbox into PostgreSQL (feature `postgres`): the library
//! call behind `durable-outbox migrate DIR URL`.
//!
//! The source directory is only read. While the migration runs it holds the
//! directory's `flock` on `outbox.lock` (opened read-only; the file's bytes
//! are not touched), so a bot that starts meanwhile waits in its open instead
//! of writing; it refuses outright when a handle is open on the directory.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File, TryLockError};
use std::io;
use std::path::{Path, PathBuf};

use crate::audit::{Hasher, Head};
use crate::error::{AuditFault, Error, Result};
use crate::history::History;
use crate::item::OutboxItem;
use crate::store::Store;

/// Copies a file outbox into an empty PostgreSQL schema, then checks the copy.
///
/// Everything an outbox holds moves: live items (a claim keeps naming its
/// file-engine owner, which never holds a lock on the server, so the first
/// PostgreSQL handle that touches the item fails it as
/// `ambiguous_delivery_after_restart`, never resending it), history items,
/// the stored settings, the destinations' cooldowns, and the audit chain
/// byte for byte (same `seq`, hashes and lines, so the head a operator kept
/// off the host still matches). A keyed chain (`audit_key`) is copied as it
/// is; give the same key here, to verify it, and to every handle that opens
/// the migrated outbox: the key is never stored.
///
/// ```no_run
/// # fn main() -> durable_outbox::Result<()> {
/// let report = durable_outbox::Migration::new("/var/lib/bot/outbox", "postgres://bot@db/bot")
///     .schema("bot_outbox")
///     .run()?;
/// println!("moved {} items, audit head {}", report.live_items + report.history_items, report.audit_head.seq);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Migration {
    dir: PathBuf,
    url: String,
    schema: String,
    audit_key: Option<Vec<u8>>,
}

impl std::fmt::Debug for Migration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The URL may hold a password and the key is a secret.
        f.debug_struct("Migration")
            .field("dir", &self.dir)
            .field("schema", &self.schema)
            .finish_non_exhaustive()
    }
}

/// What a [`Migration`] moved.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MigrationReport {
    /// Items of the live state (queued, claimed, and terminal ones not yet in history).
    pub live_items: u64,
    /// Of those, items that were claimed (their sends will be failed as ambiguous).
    pub claimed_items: u64,
    /// Items moved from the history segments.
    pub history_items: u64,
    /// Audit records copied.
    pub audit_records: u64,
    /// The audit chain's head, the same on both sides.
    pub audit_head: Head,
}

impl Migration {
    /// A migration of the outbox in `dir` into the PostgreSQL database at
    /// `url`, in the default schema (`durable_outbox`, as [`Outbox::postgres`](crate::Outbox::postgres)).
    pub fn new(dir: impl AsRef<Path>, url: &str) -> Self {
        Self {
            dir: dir.as_ref().to_path_buf(),
            url: url.to_owned(),
            schema: crate::engine::postgres::DEFAULT_SCHEMA.to_owned(),
            audit_key: None,
        }
    }

    /// The PostgreSQL schema to fill (it must hold no items or audit records).
    #[must_use]
    pub fn schema(mut self, name: &str) -> Self {
        name.clone_into(&mut self.schema);
        self
    }

    /// The HMAC key of a keyed audit chain (the bot's `audit_key`).
    #[must_use]
    pub fn audit_key(mut self, key: impl Into<Vec<u8>>) -> Self {
        self.audit_key = Some(key.into());
        self
    }

    /// Runs the migration: checks that nothing uses the directory, reads it,
    /// verifies its audit chain, and writes everything into the schema in one
    /// transaction, which commits only once what it wrote reads back equal
    /// (every item, every audit line) and the written chain verifies with
    /// the file verifier to the source's head.
    ///
    /// # Errors
    /// - [`Error::InvalidConfig`] (`dir`, `url` or `schema`) for a directory
    ///   that is not an outbox, a bad URL or schema name.
    /// - [`Error::InUse`] naming `outbox.lock` or an owner file when a process
    ///   holds the directory lock or has the outbox open.
    /// - [`Error::AuditBroken`] when the source chain does not verify (a keyed
    ///   chain without its key fails at line 1) or ends before the head the
    ///   state recorded. A chain whose oldest segments an operator removed
    ///   moves from its anchor (`audit.anchor`): the table then starts where
    ///   the removal's record says, as after a removal on PostgreSQL.
    /// - [`Error::TargetNotEmpty`] when the schema holds items or audit records.
    /// - [`Error::Database`], [`Error::MigrationMismatch`]: the server failed
    ///   or the copy did not read back equal.
    /// - The file engine's read errors ([`Error::Io`], [`Error::InvalidRecord`],
    ///   [`Error::Corrupt`]) for a damaged source.
    ///
    /// On any error nothing is committed to PostgreSQL (the schema's tables
    /// may have been created, empty) and the directory is unchanged.
    pub fn run(self) -> Result<MigrationReport> {
        let hasher = self.audit_key.clone().map_or(Hasher::Plain, Hasher::Keyed);
        crate::engine::postgres::check_schema(&self.schema)?;
        crate::engine::file::check_outbox_dir(&self.dir)?;
        let _held = hold_directory(&self.dir)?;
        refuse_open_handles(&self.dir)?;

        let mut loaded = None;
        let loaded = Store::new(&self.dir).refresh(&mut loaded)?;
        let (audit, head) = crate::audit::chain_lines(&self.dir, &hasher, &loaded.journal_audit)?;
        if let Some(recorded) = &loaded.state.audit_head
            && recorded.seq > head.seq
        {
            return Err(Error::AuditBroken {
                path: self.dir.join("audit.jsonl"),
                line: head.seq + 1,
                fault: AuditFault::Truncated {
                    expected_seq: recorded.seq,
                    found_seq: head.seq,
                },
            });
        }

        let mut items: Vec<OutboxItem> = loaded.state.items.values().cloned().collect();
        let live: HashSet<String> = items.iter().map(|i| i.idempotency_key.clone()).collect();
        let claimed_items = items.iter().filter(|i| i.claim.is_some()).count() as u64;
        let live_items = items.len() as u64;
        let mut history = History::new(&self.dir);
        history.refresh()?;
        // By key: an item requeued from history that went back there is in
        // two segments; segments come oldest first, so the later copy, the
        // one `get` returns, replaces the earlier (the CLI's history listing
        // keeps the same rule).
        let mut moved: HashMap<String, OutboxItem> = HashMap::new();
        for item in history.items() {
            let item = item?;
            // A crash between a move to history and the compaction that
            // drops the live copy leaves both: the live state is newer.
            if !live.contains(&item.idempotency_key) {
                moved.insert(item.idempotency_key.clone(), item);
            }
        }
        let history_items = moved.len() as u64;
        // Sorted into line order below.
        items.extend(moved.into_values());
        // Items written before enqueue sequences existed come first in their
        // line, as on the file engine.
        for item in &mut items {
            item.seq.get_or_insert(0);
        }
        items.sort_by(|a, b| {
            (a.seq, a.created_at, &a.idempotency_key).cmp(&(
                b.seq,
                b.created_at,
                &b.idempotency_key,
            ))
        });

        crate::engine::postgres::blocking(|| {
            crate::engine::postgres::import(
                &self.url,
                &self.schema,
                &crate::engine::postgres::Import {
                    items: &items,
                    settings: &loaded.state.settings,
                    cooldowns: &loaded.state.cooldowns,
                    audit: &audit,
                    head: &head,
                    hasher: &hasher,
                },
            )
        })?;
        tracing::info!(
            dir = %self.dir.display(),
            schema = %self.schema,
            items = items.len(),
            audit_records = audit.len(),
            "migrated a file outbox to PostgreSQL"
        );
        Ok(MigrationReport {
            live_items,
            claimed_items,
            history_items,
            audit_records: audit.len() as u64,
            audit_head: head,
        })
    }
}

/// Takes the directory lock without writing (the lock file opened read-only,
/// never created), or refuses when another process holds it. Held until the
/// returned file drops.
fn hold_directory(dir: &Path) -> Result<Option<File>> {
    let path = dir.join(crate::lock::LOCK_FILE);
    let file = match File::open(&path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(&path, "open", e)),
    };
    match file.try_lock() {
        Ok(()) => Ok(Some(file)),
        Err(TryLockError::WouldBlock) => Err(Error::InUse {
            path,
            reason: "another process holds the directory lock (a bot or the CLI is writing)".into(),
        }),
        Err(TryLockError::Error(e)) => Err(Error::io(&path, "lock", e)),
    }
}

/// Refuses when an open handle owns the directory: its owner file is locked.
fn refuse_open_handles(dir: &Path) -> Result<()> {
    let owners = dir.join(crate::lock::OWNERS_DIR);
    let entries = match fs::read_dir(&owners) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io(&owners, "read directory", e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(&owners, "read directory", e))?;
        let path = entry.path();
        let Some(id) = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".owner"))
            .map(str::to_owned)
        else {
            continue;
        };
        if crate::lock::owner_is_alive(dir, &id) {
            let pid = id.split('-').next().unwrap_or("?");
            return Err(Error::InUse {
                path,
                reason: format!(
                    "an outbox handle is open on it (process {pid}); stop the bot first"
                ),
            });
        }
    }
    Ok(())
}
