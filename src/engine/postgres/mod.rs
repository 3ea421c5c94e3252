//! The PostgreSQL engine: one outbox shared by handles on many hosts.
//!
//! Clients: the library's core API is blocking (async forms wrap it), so a
//! blocking client keeps one code path. The reads and commits run on the
//! engine's own protocol client ([`wire`], under [`conn`]): blocking sockets,
//! a transaction's statements pipelined under one `Sync`. The owner lock,
//! `LISTEN`, `NOTIFY` and migrations use the synchronous `postgres` crate,
//! which runs its own small runtime internally.
//!
//! Connections per handle: a small pool for reads and commits (one per thread
//! calling at once, so the threads of one handle commit side by side, up to
//! the handle's `max_connections`, beyond which callers wait; up to
//! [`IDLE_CONNECTIONS`] kept open between calls), one dedicated to the owner's
//! advisory lock ([`liveness`]), one for `LISTEN` once a worker waits, and
//! one for the handle's wake-up sender thread, opened on the first commit
//! that makes work due ([`notify`]). A closed reads/commits connection is dropped and a fresh one
//! opened on the next call; a lost owner lock is taken again before the next
//! claim.
//!
//! Tables (in the schema named on open, see [`schema`]): `items` (the item as
//! the same JSON object `outbox.json` stores, plus the columns claims and
//! lookups filter on, and a `revision` for conditional writes), `owners`,
//! `audit` (one row per record: `seq`, `hash` and the canonical line, the same
//! bytes as a line of `audit.jsonl`: sealed records only) and `audit_head`,
//! whose single row every sealer locks: that is the chain's one total order.
//! `audit_pending` holds events committed with their item change and not yet
//! sealed (see [`sealing`]).
//!
//! # Files
//!
//! This file is the engine handle ([`PgEngine`]): its fields, opening, and
//! the helpers every file uses. One concept per file besides:
//!
//! - `connect`: the URL, connections, the pool of reads/commits connections;
//! - `conn`: one reads/commits connection: prepared statements, pipelines;
//! - `wire`: the protocol client under `conn` (one `Sync` per pipeline);
//! - `schema`: schema names, tables and their forward-only migrations;
//! - `owner`: the handle's owner id, taking its lock again, audit ids;
//! - `liveness`: the owner's advisory lock, the transaction-pooler check;
//! - `transact`: running a transaction of the rules (gate, open, retry);
//! - `txn`: the transaction of the rules itself ([`PgTxn`]);
//! - `rows`: how an item is written to its row (and its send times);
//! - `sealing`: deferred sealing, pending audit events onto the chain;
//! - `chain`: reads of the audit chain (head, verify, pages);
//! - `reads`: reads of items (get, list, history, due, rate inputs);
//! - `settings`: the stored settings row;
//! - `retention`: compaction and history retention;
//! - `notify`: wake-ups (`LISTEN`/`NOTIFY`);
//! - `retry`: rerunning aborted transactions;
//! - `import`: copying a file outbox in (`migrate`);
//! - `backend`: the engine as the rules' backend.

mod backend;
mod chain;
mod conn;
mod connect;
mod import;
mod liveness;
mod notify;
mod owner;
mod reads;
mod retention;
mod retry;
mod rows;
mod schema;
mod sealing;
mod session;
mod settings;
mod speculate;
mod transact;
mod txn;
mod wire;

pub(crate) use backend::{ENGINE, PgBackend};
pub(crate) use chain::AUDIT_PAGE;
pub(crate) use connect::{Connector, MAX_CONNECTIONS, blocking};
pub(crate) use import::{Import, import};
use owner::owner_candidate;
use rows::ItemWrite;
pub(crate) use schema::check_schema;
use schema::quoted;
use sealing::{Seal, pending_docs};
use transact::run_named;
pub(crate) use txn::PgTxn;

use std::sync::atomic::AtomicU64;
use std::sync::{Mutex, MutexGuard, PoisonError};

use sha2::{Digest, Sha256};

use crate::audit::Hasher;
use crate::builder::Create;
use crate::error::{Error, Result};

pub(crate) use schema::{SCHEMA_VERSION, Versioning};

/// The schema used when the caller names none.
pub(crate) const DEFAULT_SCHEMA: &str = "durable_outbox";

/// Turns a client error (the `postgres` client's, or a reads/commits
/// connection's [`wire::WireError`]) into the crate's error, naming the
/// operation.
fn db<E>(op: &'static str) -> impl Fn(E) -> Error
where
    E: std::error::Error + Send + Sync + 'static,
{
    move |source| Error::Database {
        op,
        source: Box::new(source),
    }
}

/// The SQLSTATE in `source`, the source of an [`Error::Database`]: a
/// reads/commits connection's error or the `postgres` client's.
pub(crate) fn sqlstate<'a>(
    source: &'a (dyn std::error::Error + Send + Sync + 'static),
) -> Option<&'a str> {
    match source.downcast_ref::<wire::WireError>() {
        Some(wire) => wire.code(),
        None => source
            .downcast_ref::<postgres::Error>()
            .and_then(postgres::Error::code),
    }
    .map(postgres::error::SqlState::code)
}

/// The advisory lock key for `name` in `schema`: 64 bits of SHA-256, so
/// outboxes in different schemas never share a lock.
fn lock_key(schema: &str, name: &str) -> i64 {
    let digest = Sha256::new()
        .chain_update(b"durable-outbox\0")
        .chain_update(schema.as_bytes())
        .chain_update(b"\0")
        .chain_update(name.as_bytes())
        .finalize();
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(bytes)
}

/// An open PostgreSQL outbox: connections, the owner lock and the schema.
pub(crate) struct PgEngine {
    connector: Connector,
    schema: String,
    /// `"schema"`, ready to prefix table names.
    s: String,
    owner: String,
    hasher: Hasher,
    /// The reads/commits connections: idle ones, and the cap on all of them.
    pool: connect::Pool,
    /// Audit ids minted by this handle so far.
    minted: AtomicU64,
    /// Commits of this handle whose events no sealing has taken up yet (see
    /// `after_txn`).
    unsealed: AtomicU64,
    /// Transactions of the rules this handle is running.
    in_txn: AtomicU64,
    /// Whether a thread of this handle is sealing after its commit.
    sealing: std::sync::atomic::AtomicBool,
    /// Test failpoints (`postgres.seal_after_commit`); nothing without the
    /// `test-failpoints` feature.
    pub(crate) faults: crate::failpoint::Failpoints,
    liveness: Mutex<liveness::Liveness>,
    listener: Mutex<Option<notify::Listener>>,
    /// Workers of this handle listening for wake-ups (see
    /// [`PgEngine::stop_listening`]).
    listeners: AtomicU64,
    /// The versions of its claims this handle committed, and the stored
    /// settings it last read: what a record of a send decides from before
    /// reading (see [`speculate`]).
    known: speculate::Known,
    /// Sends the `NOTIFY`s that commits of this handle request, coalesced
    /// (see [`notify`]); dropped with the handle, it sends what is pending.
    wake: notify::Sender,
}

impl std::fmt::Debug for PgEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgEngine")
            .field("schema", &self.schema)
            .field("owner", &self.owner)
            .finish_non_exhaustive()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a connection leaves nothing half-written in it:
    // an open transaction is rolled back when its guard drops.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl PgEngine {
    /// Connects, creates or migrates the schema's tables, and registers and
    /// locks a fresh owner id.
    #[cfg(test)]
    pub(crate) fn open(url: &str, schema: &str, hasher: Hasher) -> Result<Self> {
        Self::open_with(
            url,
            schema,
            hasher,
            notify::COALESCE,
            Create::IfMissing,
            Versioning::CURRENT,
            MAX_CONNECTIONS,
        )
    }

    /// [`open`](Self::open) with at most `max_connections` reads/commits
    /// connections (see [`PgEngine::client`]); with [`Create::Never`]
    /// (`create_if_missing(false)`) it refuses a schema without the
    /// outbox's tables, creating nothing; it migrates the tables as
    /// `versioning` allows.
    ///
    /// # Errors
    /// As [`open`](Self::open); [`Error::InvalidConfig`] (`schema`) when
    /// the schema must hold an outbox and holds none;
    /// [`Error::SchemaUpgradeNeeded`] when the tables are older and
    /// `versioning` may not upgrade them.
    pub(crate) fn open_capped(
        url: &str,
        schema: &str,
        hasher: Hasher,
        create: Create,
        versioning: Versioning,
        max_connections: usize,
    ) -> Result<Self> {
        Self::open_with(
            url,
            schema,
            hasher,
            notify::COALESCE,
            create,
            versioning,
            max_connections,
        )
    }

    /// [`open`](Self::open), with `wake_interval` between coalesced
    /// wake-ups (tests use a longer one than [`notify::COALESCE`]), the
    /// tables migrated as `versioning` allows, and at most
    /// `max_connections` reads/commits connections.
    fn open_with(
        url: &str,
        schema: &str,
        hasher: Hasher,
        wake_interval: std::time::Duration,
        create: Create,
        versioning: Versioning,
        max_connections: usize,
    ) -> Result<Self> {
        check_schema(schema)?;
        let connector = Connector::parse(url)?;
        let mut client = connector.connect()?;
        {
            let mut probe = connector.connect()?;
            liveness::refuse_transaction_pooling(&mut client, &mut probe)?;
        }
        if create == Create::Never && !schema::holds_outbox(&mut client, schema)? {
            return Err(Error::invalid_config(
                "schema",
                format!("schema {schema:?} holds no outbox in this database (nothing was created)"),
            ));
        }
        schema::open_tables(&mut client, schema, versioning)?;
        let s = quoted(schema);
        let (owner, mut liveness) = loop {
            let candidate = owner_candidate();
            let fresh = client
                .execute(
                    &format!(
                        "INSERT INTO {s}.owners (owner_id) VALUES ($1) ON CONFLICT DO NOTHING"
                    ),
                    &[&candidate],
                )
                .map_err(db("register the owner"))?;
            if fresh == 0 {
                continue;
            }
            if let Some(liveness) = liveness::Liveness::take(&connector, schema, &candidate)? {
                break (candidate, liveness);
            }
        };
        liveness.verify(liveness::Other::Client(&mut client))?;
        let wake = notify::Sender::start(&connector, schema, wake_interval)?;
        let engine = Self {
            connector,
            schema: schema.to_owned(),
            s,
            owner,
            hasher,
            pool: connect::Pool::new(max_connections),
            minted: AtomicU64::new(0),
            unsealed: AtomicU64::new(0),
            in_txn: AtomicU64::new(0),
            sealing: std::sync::atomic::AtomicBool::new(false),
            faults: crate::failpoint::Failpoints::from_env(),
            liveness: Mutex::new(liveness),
            listener: Mutex::new(None),
            listeners: AtomicU64::new(0),
            known: speculate::Known::default(),
            wake,
        };
        // Events a crashed handle committed and never sealed go on the chain now.
        drop(client);
        // Through the pool, so its slot is counted and freed like any other.
        {
            let mut conn = engine.client()?;
            engine.seal_pending(&mut conn, Seal::Wait)?;
        }
        Ok(engine)
    }

    /// The schema this outbox lives in.
    pub(crate) fn schema(&self) -> &str {
        &self.schema
    }
}

#[cfg(test)]
#[path = "../../../tests/support/postgres.rs"]
mod test_server;

#[cfg(test)]
mod tests;
