//! The crate's one error type.

use std::io;
use std::path::PathBuf;

/// Everything that can go wrong in the outbox, with the context needed to act on it.
///
/// Messages are lowercase and name the field, key, file and position involved. The
/// enum is `#[non_exhaustive]`: match the variants you handle and keep a catch-all.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A caller-supplied field is blank, too long or contains a forbidden character.
    /// Nothing was written.
    #[error("invalid {field}: {reason}")]
    InvalidField {
        /// The field's name as in [`NewMessage`](crate::NewMessage), e.g. `destination`.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },

    /// A builder setting is out of range. Nothing was opened.
    #[error("invalid outbox setting {setting}: {reason}")]
    InvalidConfig {
        /// The builder method's name, e.g. `max_attempts`.
        setting: &'static str,
        /// What is wrong with it.
        reason: String,
    },

    /// The idempotency key already names a message that differs in `field`.
    /// Nothing was written.
    #[error("idempotency key {key:?} already names a different message ({field} differs)")]
    IdempotencyConflict {
        /// The reused key.
        key: String,
        /// The first field that differs: `connector`, `grant_id`, `destination` or `content`.
        field: &'static str,
    },

    /// No item has this idempotency key.
    #[error("no outbox item has idempotency key {key:?}")]
    NotFound {
        /// The key that was looked up.
        key: String,
    },

    /// An operator action was refused because of the item's current state.
    #[error("item {key:?} cannot be {action}: {reason}")]
    InvalidTransition {
        /// The item's key.
        key: String,
        /// The refused action, e.g. `requeued`.
        action: &'static str,
        /// Why it was refused.
        reason: String,
    },

    /// A file is not valid JSON (or JSON lines). The file was left untouched.
    #[error("{path}: invalid JSON at line {line}, column {column}")]
    Corrupt {
        /// The damaged file.
        path: PathBuf,
        /// 1-based line of the first error.
        line: usize,
        /// 1-based column of the first error.
        column: usize,
        /// The parser's description.
        #[source]
        source: serde_json::Error,
    },

    /// A file parses as JSON but a value in it is not allowed. The file was left untouched.
    #[error("{path}: {location}: {reason}")]
    InvalidRecord {
        /// The damaged file.
        path: PathBuf,
        /// Where in the file: an item's key and field, or a line number.
        location: String,
        /// What is wrong.
        reason: String,
    },

    /// `outbox.json` declares a format version this release does not know.
    #[error("{path}: unsupported outbox format version {version} (this release reads 1 and 2)")]
    UnsupportedVersion {
        /// The file.
        path: PathBuf,
        /// The version it declares.
        version: u64,
    },

    /// The audit log failed verification. The file was left untouched.
    #[error("{path}: line {line}: {fault}")]
    AuditBroken {
        /// The audit file.
        path: PathBuf,
        /// 1-based line number of the first bad record.
        line: u64,
        /// What is wrong with it.
        fault: AuditFault,
    },

    /// An I/O operation failed. When it happened while writing, the previous
    /// durable state is intact unless the handle was also poisoned.
    #[error("{path}: {op} failed")]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// The operation, e.g. `fsync`, `rename`, `open`.
        op: &'static str,
        /// The underlying error.
        #[source]
        source: io::Error,
    },

    /// The outbox directory or one of its state files could have been prepared or
    /// changed by another user: it is owned by someone other than the effective
    /// user (or root), writable by group or others, or a symlink. Nothing was
    /// read from it or written to it. See the README's "Security model".
    #[error(
        "{path}: refusing to use it: {reason} (owner uid {owner}, mode {mode:04o}); to fix: {fix}"
    )]
    Untrusted {
        /// The directory or file.
        path: PathBuf,
        /// Its owner's uid.
        owner: u32,
        /// Its permission bits.
        mode: u32,
        /// What is wrong, e.g. `writable by others`.
        reason: String,
        /// What to do about it, e.g. a `chmod` or `chown` command.
        fix: String,
    },

    /// A PostgreSQL operation failed: the server is unreachable, refused the
    /// login, or a statement failed. A failed commit wrote nothing, except
    /// when the connection was lost while the server committed: then read the
    /// item again before acting on it.
    ///
    /// A transaction the server aborted to break a deadlock (SQLSTATE
    /// `40P01`) or a serialization conflict (`40001`) is run again first, up
    /// to 5 times in all, with a short pause between; this error is returned
    /// only when the last run failed too ([`Error::sqlstate`] gives the code).
    #[error("postgres: {op} failed")]
    Database {
        /// What was being done, e.g. `connect`, `commit`.
        op: &'static str,
        /// The client's error (the server's message and SQLSTATE, when it sent one).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// A PostgreSQL outbox's tables are at a schema version newer than this
    /// release knows (a newer release migrated them). Nothing was written.
    #[error(
        "postgres schema {schema:?} is at outbox schema version {found}; this release knows up to {known}: upgrade the crate"
    )]
    UnsupportedSchema {
        /// The PostgreSQL schema the outbox lives in.
        schema: String,
        /// The version the tables declare.
        found: i64,
        /// The newest version this release knows.
        known: i64,
    },

    /// A PostgreSQL outbox's tables are at an older schema version than this
    /// release's, and the handle was opened with
    /// `OutboxBuilder::upgrade_schema(false)` (as the operator's tool is):
    /// migrating them is left to an open that means to. Nothing was written.
    ///
    /// Upgrade when the bots on the outbox are upgraded too: a bot of the
    /// older release goes on running on migrated tables, but refuses them
    /// ([`Error::UnsupportedSchema`]) at its next start. Open the outbox with
    /// a handle that may upgrade (the default), or run
    /// `durable-outbox upgrade-schema URL`.
    #[error(
        "postgres schema {schema:?} is at outbox schema version {found}, older than this release's {known}; \
         nothing was written: a handle opened with upgrade_schema(false) does not migrate it (the default open does)"
    )]
    SchemaUpgradeNeeded {
        /// The PostgreSQL schema the outbox lives in.
        schema: String,
        /// The version the tables declare.
        found: i64,
        /// This release's version.
        known: i64,
    },

    /// Session-level advisory locks do not work on this connection, so owner
    /// liveness (and with it at-most-once) cannot be guaranteed: typically a
    /// transaction-mode pooler such as pgbouncer sits between the outbox and
    /// the server. Connect directly or through a session-mode pool.
    #[error("postgres: session locks are unusable here: {reason}")]
    SessionLocksUnavailable {
        /// What was observed.
        reason: String,
    },

    /// Every reads/commits connection a PostgreSQL handle may open
    /// (`OutboxBuilder::max_connections`, feature `postgres`)
    /// stayed lent out to its other calls for as long as this call could
    /// wait (the URL's `connect_timeout` plus its `tcp_user_timeout`: 40 s
    /// by default; a `tcp_user_timeout` of 0 counts as its 30 s default here). Nothing of this call was done; try again later, or
    /// allow the handle more connections if the server has them to spare.
    /// Never the error of recording a send that already happened (the
    /// record after `send`, a worker's step, giving a claim back): those
    /// wait for a connection as long as it takes, so a call that returns
    /// this sent nothing.
    #[error(
        "postgres: the connection pool is exhausted: all {max_connections} connections \
         (max_connections) stayed in use for {waited:?}"
    )]
    PoolExhausted {
        /// The handle's cap on its reads/commits connections.
        max_connections: usize,
        /// How long the call waited for one.
        waited: std::time::Duration,
    },

    /// The operation does not exist on this outbox's storage engine (e.g.
    /// `compact` or `dir` on a PostgreSQL outbox, which has no directory,
    /// journal or audit segment files). Nothing was done.
    #[error("{operation} is not available on the {engine} engine: {why}")]
    NotSupported {
        /// The engine: `"postgres"`.
        engine: &'static str,
        /// The method called.
        operation: &'static str,
        /// Why it does not apply.
        why: &'static str,
    },

    /// The outbox directory is in use: another process holds its directory
    /// lock, or an open handle holds an owner file (`owners/<pid>-….owner`).
    /// Nothing was read or written; stop the bots using it and try again.
    #[error("{path}: the outbox is in use: {reason}")]
    InUse {
        /// The lock or owner file found held.
        path: PathBuf,
        /// Who holds it, as far as it is known.
        reason: String,
    },

    /// A migration's target PostgreSQL schema already holds items or audit
    /// records: a migration only fills an empty outbox. Nothing was written.
    #[error(
        "postgres schema {schema:?} is not empty ({items} items, {audit_records} audit records): \
         a migration needs an empty schema"
    )]
    TargetNotEmpty {
        /// The PostgreSQL schema.
        schema: String,
        /// Items found there.
        items: u64,
        /// Audit records found there.
        audit_records: u64,
    },

    /// What a migration wrote did not read back equal to its source, so it was
    /// rolled back. Nothing was written.
    #[error("migration check failed, nothing was committed: {what}")]
    MigrationMismatch {
        /// The first difference found.
        what: String,
    },

    /// An earlier durability failure (a failed fsync after data reached the kernel)
    /// left the on-disk state uncertain; this handle refuses further writes.
    /// Open the outbox again to re-read what is really on disk.
    #[error("outbox handle is poisoned by an earlier durability failure; reopen it")]
    Poisoned,

    /// A Matrix homeserver refused or failed a request that is not a send
    /// (login, join, sync; feature `matrix`). Sends report a
    /// [`SendError`](crate::SendError) instead.
    #[cfg(feature = "matrix")]
    #[error("matrix {operation} at {url}: {detail}")]
    Matrix {
        /// What was attempted: `login`, `join` or `sync`.
        operation: &'static str,
        /// The endpoint, without query string or credentials.
        url: String,
        /// The HTTP status, when the server answered.
        status: Option<u16>,
        /// The Matrix `errcode` (e.g. `M_FORBIDDEN`), when the server gave one.
        errcode: Option<String>,
        /// What went wrong, in words.
        detail: String,
    },
}

/// Why an audit record failed verification.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum AuditFault {
    /// The line is not a valid audit record.
    Malformed(String),
    /// The record's `hash` does not match its contents: the record was edited.
    HashMismatch,
    /// The record's `prev_hash` is not the previous record's hash: a record was
    /// deleted, inserted or moved.
    BrokenLink,
    /// The record's `seq` is not one more than the previous record's.
    SeqGap {
        /// The sequence number verification expected.
        expected: u64,
        /// The sequence number the record carries.
        found: u64,
    },
    /// The log ends before the head recorded in `outbox.json`: its tail was cut off.
    Truncated {
        /// The head sequence number `outbox.json` recorded.
        expected_seq: u64,
        /// The last sequence number actually in the log.
        found_seq: u64,
    },
    /// The log's record at the recorded head has a different hash than `outbox.json`
    /// recorded: the log was rewritten.
    HeadMismatch {
        /// The sequence number of the recorded head.
        seq: u64,
    },
    /// A chain read on its own (an export, the PostgreSQL `audit` table)
    /// starts after seq 1, and no removal record in it
    /// ([`Outbox::remove_old_audit_segments`](crate::Outbox::remove_old_audit_segments))
    /// names that start: records were deleted from its front.
    FrontCut {
        /// The sequence number of the chain's first record.
        first_seq: u64,
    },
}

impl std::fmt::Display for AuditFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Malformed(why) => write!(f, "malformed audit record: {why}"),
            Self::HashMismatch => f.write_str("hash mismatch: the record was altered"),
            Self::BrokenLink => f.write_str(
                "prev_hash does not match the previous record: a record was deleted, inserted or reordered",
            ),
            Self::SeqGap { expected, found } => {
                write!(f, "sequence gap: expected seq {expected}, found {found}")
            }
            Self::Truncated {
                expected_seq,
                found_seq,
            } => write!(
                f,
                "audit log truncated: outbox.json recorded head seq {expected_seq}, the log ends at seq {found_seq}"
            ),
            Self::HeadMismatch { seq } => write!(
                f,
                "record seq {seq} does not match the audit head recorded in outbox.json"
            ),
            Self::FrontCut { first_seq } => write!(
                f,
                "the chain starts at seq {first_seq} and no removal record in it names that \
                 start: records were deleted from its front"
            ),
        }
    }
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, op: &'static str, source: io::Error) -> Self {
        Self::Io {
            path: path.into(),
            op,
            source,
        }
    }

    pub(crate) fn invalid_field(field: &'static str, reason: impl Into<String>) -> Self {
        Self::InvalidField {
            field,
            reason: reason.into(),
        }
    }

    pub(crate) fn invalid_config(setting: &'static str, reason: impl Into<String>) -> Self {
        Self::InvalidConfig {
            setting,
            reason: reason.into(),
        }
    }

    pub(crate) fn corrupt(path: impl Into<PathBuf>, source: serde_json::Error) -> Self {
        Self::Corrupt {
            path: path.into(),
            line: source.line(),
            column: source.column(),
            source,
        }
    }

    /// The SQLSTATE a PostgreSQL server reported for an
    /// [`Error::Database`], e.g. `"40001"` (a serialization failure) or
    /// `"28P01"` (a wrong password); `None` for every other error, and for a
    /// database error no server reported (an unreachable server, a lost
    /// connection). Whichever of the engine's connections failed.
    pub fn sqlstate(&self) -> Option<&str> {
        #[cfg(feature = "postgres")]
        if let Self::Database { source, .. } = self {
            return crate::engine::postgres::sqlstate(source.as_ref());
        }
        None
    }
}

/// Shorthand used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
