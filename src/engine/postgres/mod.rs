//! The PostgreSQL engine: one outbox shared by handles on many hosts.
//!
//! Client: the synchronous `postgres` crate. The library's core API is
//! blocking (async forms wrap it), so a blocking client keeps one code path;
//! it runs its own small runtime internally and does not need the caller's.
//!
//! Connections per handle: a small pool for reads and commits (one per thread
//! calling at once, so the threads of one handle commit side by side; up to
//! [`IDLE_CONNECTIONS`] kept open between calls), one dedicated to the owner's
//! advisory lock ([`liveness`]), and one for `LISTEN` once a worker waits
//! ([`notify`]). A closed reads/commits connection is dropped and a fresh one
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
//! sealed (see "Deferred sealing" below).
//!
//! # Deferred sealing
//!
//! A transaction of the rules ([`PgTxn`]) writes its audit events to
//! `audit_pending` in its own `COMMIT`, each with an id from the table's
//! sequence taken at that write, and never touches the head. After it,
//! [`PgEngine::seal_pending`] runs a short transaction: lock the head row,
//! take every pending event it can see, seal them in id order onto the chain
//! (seq, previous hash, hash: the same canonical records as `audit.jsonl`),
//! insert them into `audit`, move the head, `COMMIT`. The committing handle
//! does this best effort: right after the commit when no other call of the
//! handle is running, otherwise the last of its running calls to end (or the
//! one that finds [`SEAL_EVERY`] commits waiting) seals for all of them (see
//! [`PgEngine::after_txn`]); it skips it when another sealer holds the head
//! (`SKIP LOCKED`); every reader of the chain (`verify_audit`, `history`,
//! the export, `audit_records`, `audit_head`), a handle opening, and a
//! waiting worker seal first and wait for the head. A crash between a commit
//! and its sealing leaves pending events, sealed by the next of those: nothing
//! committed is lost.
//!
//! The committing handle's sealing commits with `synchronous_commit = off`:
//! it does not wait for its own WAL flush, so sealing adds no flush to a
//! writer's call. That is safe because a sealing is one transaction: lost in
//! a server crash, it is lost whole (the `audit` rows, the head move *and*
//! the deletion from `audit_pending`), and the events are sealed again. What
//! must not happen is a reader seeing records that a crash then takes back:
//! so a reader's sealing commits synchronously, and when it had nothing to
//! seal but WAL is not flushed to its end, it commits anyway (it locked the
//! head row, so it has a transaction id), which waits for the flush of every
//! earlier sealing. What a reader returns is durable.
//!
//! **Invariant (per-item order):** an item's records are in the chain in the
//! order of its changes. Two transactions that change one item are serialised
//! by its row lock (or, for a new key, the key's lock): the later one takes
//! its pending id after it got the lock, so after the earlier one committed,
//! and its id is larger. A sealer reads pending events in one statement,
//! whose snapshot holds every transaction committed when it began; so if it
//! sees the later event it sees the earlier one too (or that one was sealed
//! already, by a sealer that held the head before), and it seals in id order.
//! Changes of different items may reach the chain in another order than their
//! commits: the chain orders records, not commits of unrelated items.
//!
//! The audit id stamped on an item can no longer hash the head the record
//! will chain to: PostgreSQL mints it from the handle's owner id (unique among
//! every handle that ever opened the schema: `owners` is keyed by it), a
//! counter of the handle, the key and the moment
//! ([`PgEngine::mint_audit_id`]).

mod backend;
mod conn;
mod import;
mod liveness;
mod notify;
mod retention;
mod retry;
mod rows;
mod schema;
mod txn;

pub(crate) use backend::{ENGINE, PgBackend};
use conn::{Conn, Step, Tx};
pub(crate) use import::{Import, import};
pub(crate) use txn::PgTxn;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use chrono::{DateTime, Utc};
use postgres::{Client, NoTls, Row};
use sha2::{Digest, Sha256};

use super::{Expect, Versioned};
use crate::audit::{AuditEvent, AuditOutcome, AuditRecord, AuditReport, Hasher, Head};
use crate::error::{Error, Result};
use crate::item::OutboxItem;
use crate::settings::{Settings, Stored};
use crate::store::{item_from_json, rate_times, settings_from_json, settings_to_json};

#[cfg(test)]
use schema::SCHEMA_VERSION;

/// The schema used when the caller names none.
pub(crate) const DEFAULT_SCHEMA: &str = "durable_outbox";

/// How many idle reads/commits connections a handle keeps open between calls.
pub(crate) const IDLE_CONNECTIONS: usize = 8;

/// How many audit records one page of `Outbox::audit_records` reads.
pub(crate) const AUDIT_PAGE: i64 = 1_000;

/// How many of a handle's commits may leave their events pending while
/// other transactions of the handle are still running, before one of them
/// seals (see [`PgEngine::after_txn`]).
const SEAL_EVERY: u64 = 32;

/// How many pending events one sealing transaction moves at most.
const SEAL_BATCH: i64 = 1_000;

/// How long opening a connection may take when the URL sets no `connect_timeout`.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs `f`, which uses the synchronous client, so that the client may block
/// the thread: on a worker thread of a multi-thread tokio runtime (a bot
/// calling `enqueue` from async code, a handle dropped there), through
/// `block_in_place`, since the client drives its own small runtime and must
/// not be started inside another. Elsewhere (plain threads, the blocking pool
/// the `_async` forms use) `f` just runs. On a current-thread runtime's own
/// thread the client cannot run at all: use the `_async` forms there.
pub(crate) fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

/// Turns a client error into the crate's error, naming the operation.
fn db(op: &'static str) -> impl Fn(postgres::Error) -> Error {
    move |source| Error::Database {
        op,
        source: Box::new(source),
    }
}

/// `"name"`: a schema name is checked to be a plain identifier, and quoted anyway.
fn quoted(schema: &str) -> String {
    format!("\"{schema}\"")
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

/// Checks a schema name: 1 to 48 lowercase ASCII letters, digits and `_`, not
/// starting with a digit (so the wake-up channel name fits PostgreSQL's 63 bytes).
pub(crate) fn check_schema(schema: &str) -> Result<()> {
    let first_ok = schema
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    let rest_ok = schema
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if schema.is_empty() || schema.len() > 48 || !first_ok || !rest_ok {
        return Err(Error::invalid_config(
            "schema",
            format!(
                "{schema:?} is not a schema name: use 1 to 48 lowercase letters, digits and '_', \
                 not starting with a digit"
            ),
        ));
    }
    Ok(())
}

/// An audit event about the outbox, not an item (`settings`, a retention
/// prune): the rules' one constructor, so both engines hash the same record.
fn system_event(
    outcome: AuditOutcome,
    head: &Head,
    subject: &str,
    note: String,
    now: DateTime<Utc>,
) -> AuditEvent {
    crate::rules::record::system_event_of(outcome, head, subject, note, now)
}

/// Opens connections to one server.
pub(crate) struct Connector {
    config: tokio_postgres::Config,
}

impl Connector {
    /// Parses a `postgres://` URL (or `key=value` string). The error never
    /// repeats the URL: it may hold a password.
    pub(crate) fn parse(url: &str) -> Result<Self> {
        let mut config: tokio_postgres::Config = url.parse().map_err(|e: postgres::Error| {
            Error::invalid_config(
                "url",
                format!("not a PostgreSQL connection URL ({e}); expected postgres://user@host:port/database"),
            )
        })?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        if config.get_application_name().is_none() {
            config.application_name("durable-outbox");
        }
        Ok(Self { config })
    }

    /// A synchronous client (owner lock, `LISTEN`, migrations).
    pub(crate) fn connect(&self) -> Result<Client> {
        postgres::Config::from(self.config.clone())
            .connect(NoTls)
            .map_err(db("connect"))
    }

    /// A reads/commits connection (see [`conn`]).
    fn conn(&self) -> Result<Conn> {
        Conn::connect(&self.config).map_err(|e| match e {
            conn::ConnectError::Postgres(e) => db("connect")(e),
            conn::ConnectError::Runtime(e) => Error::Database {
                op: "connect",
                source: Box::new(e),
            },
        })
    }
}

static OWNER_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A fresh owner id candidate: host, process, time and a counter.
fn owner_candidate() -> String {
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

/// An open PostgreSQL outbox: connections, the owner lock and the schema.
pub(crate) struct PgEngine {
    connector: Connector,
    schema: String,
    /// `"schema"`, ready to prefix table names.
    s: String,
    owner: String,
    hasher: Hasher,
    /// Idle reads/commits connections.
    clients: Mutex<Vec<Conn>>,
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
    pub(crate) fn open(url: &str, schema: &str, hasher: Hasher) -> Result<Self> {
        check_schema(schema)?;
        let connector = Connector::parse(url)?;
        let mut client = connector.connect()?;
        {
            let mut probe = connector.connect()?;
            liveness::refuse_transaction_pooling(&mut client, &mut probe)?;
        }
        schema::migrate(&mut client, schema)?;
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
        liveness.verify(&mut client)?;
        let engine = Self {
            connector,
            schema: schema.to_owned(),
            s,
            owner,
            hasher,
            clients: Mutex::new(Vec::new()),
            minted: AtomicU64::new(0),
            unsealed: AtomicU64::new(0),
            in_txn: AtomicU64::new(0),
            sealing: std::sync::atomic::AtomicBool::new(false),
            faults: crate::failpoint::Failpoints::from_env(),
            liveness: Mutex::new(liveness),
            listener: Mutex::new(None),
        };
        // Events a crashed handle committed and never sealed go on the chain now.
        drop(client);
        let mut conn = engine.connector.conn()?;
        engine.seal_pending(&mut conn, Seal::Wait)?;
        engine.give_back(conn);
        Ok(engine)
    }

    /// The schema this outbox lives in.
    pub(crate) fn schema(&self) -> &str {
        &self.schema
    }

    /// A reads/commits connection of its own for the caller: an idle one of
    /// the pool, or a new one (a closed one is dropped). Given back to the
    /// pool when the guard drops.
    fn client(&self) -> Result<Pooled<'_>> {
        let idle = {
            let mut idle = lock(&self.clients);
            idle.retain(|client| !client.is_closed());
            idle.pop()
        };
        let client = match idle {
            Some(client) => client,
            None => self.connector.conn()?,
        };
        Ok(Pooled {
            engine: self,
            client: Some(client),
        })
    }

    /// Keeps `client` for the next caller (up to [`IDLE_CONNECTIONS`]).
    fn give_back(&self, client: Conn) {
        if client.is_closed() {
            return;
        }
        let mut idle = lock(&self.clients);
        if idle.len() < IDLE_CONNECTIONS {
            idle.push(client);
        }
    }

    /// Passes the writers' gate in `tx` (see [`txn`]): shared for a one-item
    /// transaction, exclusive for every other writer.
    fn pass_gate(&self, tx: &mut Tx<'_>, scope: txn::Scope<'_>) -> Result<()> {
        let sql = match scope {
            txn::Scope::OneItem(_) => "SELECT pg_advisory_xact_lock_shared($1)",
            txn::Scope::Any => "SELECT pg_advisory_xact_lock($1)",
        };
        tx.execute(sql, &[&lock_key(&self.schema, "writers")])
            .map_err(db("pass the writers' gate"))?;
        Ok(())
    }

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

    /// Inserts pending events (parameter: their documents, from
    /// [`pending_docs`]) in order, returning their ids.
    fn pending_sql(&self) -> String {
        format!(
            "INSERT INTO {}.audit_pending (event)
             SELECT doc FROM unnest($1::text[]) WITH ORDINALITY AS t(doc, n) ORDER BY n
             RETURNING id",
            self.s
        )
    }

    /// Seals the pending events onto the chain (see "Deferred sealing"), in
    /// transactions of at most [`SEAL_BATCH`] events, until none is left that
    /// this sealer can see. With [`Seal::IfFree`] it gives up at once when
    /// another sealer holds the head (that one, or the next reader, seals
    /// what is left). Returns the records sealed, with their pending ids.
    ///
    /// # Errors
    /// [`Error::Database`]; [`Error::InvalidRecord`] for a pending row that
    /// is not an event (nothing is sealed then).
    pub(crate) fn seal_pending(
        &self,
        client: &mut Conn,
        how: Seal,
    ) -> Result<Vec<(i64, AuditRecord)>> {
        let mut sealed = Vec::new();
        loop {
            // `BEGIN` goes with the head's statement: one round trip.
            let mut tx = client.begin();
            // The committing handle's sealing does not wait for its WAL
            // flush (see "Deferred sealing": a sealing lost in a crash is
            // undone whole, its events pending again, and no reader has seen
            // it, since a reader's sealing flushes first).
            let sql = match how {
                Seal::Wait => "SELECT seq, hash FROM {s}.audit_head WHERE id = 1 FOR UPDATE",
                Seal::IfFree => {
                    "SELECT seq, hash, set_config('synchronous_commit', 'off', true)
                     FROM {s}.audit_head WHERE id = 1 FOR UPDATE SKIP LOCKED"
                }
            };
            let Some(row) = tx
                .query_opt(&sql.replace("{s}", &self.s), &[])
                .map_err(db("lock the audit head"))?
            else {
                return Ok(sealed);
            };
            let head = head_of_row(&row);
            let rows = self.take_pending(&mut tx)?;
            if rows.is_empty() {
                if how == Seal::Wait && !Self::wal_flushed(&mut tx)? {
                    // A reader: a sealing committed without waiting for its
                    // WAL flush may be what it is about to read. This commit
                    // (it locked the head row: it has a transaction id)
                    // waits for the flush of every WAL record before it.
                    tx.commit().map_err(db("flush sealed audit records"))?;
                }
                // Otherwise nothing written: rolled back, no WAL flush.
                return Ok(sealed);
            }
            let full = rows.len() as i64 >= SEAL_BATCH;
            let (batch, write) = self.seal_rows(rows, head)?;
            // The records and the head's move go with the `COMMIT`.
            let params = write.params();
            let sql = self.append_sealed_sql();
            tx.pipeline(&[Step::Execute(&sql, &params), Step::Simple("COMMIT")])
                .map_err(db("commit sealed audit records"))?;
            tx.ended();
            sealed.extend(batch);
            if !full {
                return Ok(sealed);
            }
        }
    }

    /// Whether every WAL record written so far is flushed (so every sealing
    /// this transaction can see is durable).
    fn wal_flushed(tx: &mut Tx<'_>) -> Result<bool> {
        Ok(tx
            .query_one(
                "SELECT pg_current_wal_flush_lsn() >= pg_current_wal_insert_lsn()",
                &[],
            )
            .map_err(db("read the WAL position"))?
            .get(0))
    }

    /// Inside `tx`, which holds the head row at `head`: moves up to
    /// [`SEAL_BATCH`] pending events, in pending-id order, onto the chain
    /// and moves the head. Returns them sealed, and the new head.
    fn seal_pending_in(
        &self,
        tx: &mut Tx<'_>,
        head: Head,
    ) -> Result<(Vec<(i64, AuditRecord)>, Head)> {
        let rows = self.take_pending(tx)?;
        if rows.is_empty() {
            return Ok((Vec::new(), head));
        }
        let (sealed, write) = self.seal_rows(rows, head)?;
        tx.execute(&self.append_sealed_sql(), &write.params())
            .map_err(db("append sealed audit records"))?;
        Ok((sealed, write.head))
    }

    /// Deletes up to [`SEAL_BATCH`] pending events (the oldest) in `tx`,
    /// which holds the head row; returns them in pending-id order.
    fn take_pending(&self, tx: &mut Tx<'_>) -> Result<Vec<(i64, String)>> {
        let s = &self.s;
        let mut rows: Vec<(i64, String)> = tx
            .query(
                &format!(
                    "DELETE FROM {s}.audit_pending WHERE id IN (
                       SELECT id FROM {s}.audit_pending ORDER BY id LIMIT $1)
                     RETURNING id, event"
                ),
                &[&SEAL_BATCH],
            )
            .map_err(db("take pending audit events"))?
            .iter()
            .map(|row| (row.get(0), row.get(1)))
            .collect();
        rows.sort_by_key(|(id, _)| *id);
        Ok(rows)
    }

    /// Seals pending events (in the order given) after `head`: the records,
    /// and what to write.
    fn seal_rows(
        &self,
        rows: Vec<(i64, String)>,
        head: Head,
    ) -> Result<(Vec<(i64, AuditRecord)>, SealedWrite)> {
        let mut seq = head.seq;
        let mut prev = head.hash;
        let mut sealed = Vec::with_capacity(rows.len());
        let (mut seqs, mut hashes, mut lines) = (Vec::new(), Vec::new(), Vec::new());
        for (id, doc) in rows {
            let event: AuditEvent =
                serde_json::from_str(&doc).map_err(|e| Error::InvalidRecord {
                    path: PathBuf::from(format!("postgres:{}.audit_pending", self.schema)),
                    location: format!("id {id}"),
                    reason: format!("not a pending audit event: {e}"),
                })?;
            seq += 1;
            let record = AuditRecord::seal(&event, seq, &prev, false, &self.hasher);
            let mut line = record.to_line();
            line.pop();
            seqs.push(i64::try_from(seq).unwrap_or(i64::MAX));
            hashes.push(record.hash.clone());
            lines.push(String::from_utf8_lossy(&line).into_owned());
            prev.clone_from(&record.hash);
            sealed.push((id, record));
        }
        let head = Head { seq, hash: prev };
        Ok((
            sealed,
            SealedWrite {
                seqs,
                hashes,
                lines,
                head_seq: i64::try_from(head.seq).unwrap_or(i64::MAX),
                head,
            },
        ))
    }

    /// Inserts sealed records and moves the head, in one statement
    /// (parameters: [`SealedWrite::params`]).
    fn append_sealed_sql(&self) -> String {
        let s = &self.s;
        format!(
            "WITH sealed AS (
               INSERT INTO {s}.audit (seq, hash, line)
               SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[]))
             UPDATE {s}.audit_head SET seq = $4, hash = $5 WHERE id = 1"
        )
    }

    /// Seals what is pending before a read of the chain (waits for the head).
    fn seal_before_reading(&self, client: &mut Conn) -> Result<()> {
        self.seal_pending(client, Seal::Wait).map(|_| ())
    }

    /// Makes sure this handle's owner lock is held before a claim names it:
    /// after a cut or a server restart it is taken again (same owner id: the
    /// handle's sends in progress are alive, whatever other handles concluded
    /// meanwhile) and verified.
    fn ensure_owner(&self) -> Result<()> {
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
        let Some(mut fresh) = liveness::Liveness::take(&self.connector, &self.schema, &self.owner)?
        else {
            return Err(Error::SessionLocksUnavailable {
                reason: format!(
                    "owner lock {} is held by another session after the original one ended",
                    self.owner
                ),
            });
        };
        fresh.verify(&mut self.connector.connect()?)?;
        *liveness = fresh;
        Ok(())
    }

    fn place(&self) -> PathBuf {
        PathBuf::from(format!("postgres:{}.items", self.schema))
    }

    /// An item from a row of `idempotency_key, revision, doc, seq`. The
    /// sequence is the row's: one sequence across every host.
    fn versioned(&self, row: &Row) -> Result<Versioned> {
        let key: String = row.get(0);
        let revision: i64 = row.get(1);
        let doc: String = row.get(2);
        let order: i64 = row.get(3);
        let mut item = item_from_json(&self.place(), &format!("row {key:?}"), doc.as_bytes())?;
        item.seq = Some(order as u64);
        Ok(Versioned {
            item,
            revision: revision as u64,
        })
    }

    /// Whether this handle's own owner lock is still held.
    #[expect(
        clippy::unnecessary_wraps,
        reason = "the same shape as probing another owner, which can fail"
    )]
    pub(crate) fn own_lock_held(&self) -> Result<bool> {
        let asked = std::time::Instant::now();
        Ok(lock(&self.liveness).held_since(asked))
    }

    fn settings_place(&self) -> PathBuf {
        PathBuf::from(format!("postgres:{}.settings", self.schema))
    }

    /// The stored settings, read inside `tx`.
    pub(crate) fn read_settings(&self, tx: &mut Tx<'_>) -> Result<Stored> {
        let row = tx
            .query_opt(
                &format!("SELECT doc FROM {}.settings WHERE id = 1", self.s),
                &[],
            )
            .map_err(db("read the stored settings"))?;
        self.stored_of(row.map(|row| row.get(0)))
    }

    /// The stored settings from the `settings` row's document, if any.
    fn stored_of(&self, doc: Option<String>) -> Result<Stored> {
        match doc {
            None => Ok(Stored::default()),
            Some(doc) => settings_from_json(&self.settings_place(), "row 1", &doc),
        }
    }

    /// Opens a transaction of the rules in `tx`, in one round trip (one
    /// pipeline: `BEGIN`, then the statements below, each after the one
    /// before and with its own snapshot):
    ///
    /// 1. pass the writers' gate (see [`pass_gate`](Self::pass_gate)); for a
    ///    one-item transaction also lock the item's key (no enqueue of it can
    ///    be under way unseen, see `txn`); read the stored settings (as of the
    ///    statement's start: a change committed while this transaction waited
    ///    at the gate is seen from its next transaction on); and probe this
    ///    handle's own owner lock: a shared try-lock on the owner's key fails
    ///    while the owner session holds it, and succeeds once that session
    ///    is gone (a cut, a server restart);
    /// 2. for a one-item transaction, read the item's row `FOR UPDATE`: a
    ///    statement of its own, so its snapshot is taken once the gate and
    ///    the key's lock were granted (a row an enqueue of the key committed
    ///    meanwhile is seen).
    ///
    /// Returns the stored settings, the item's row (one-item transactions),
    /// and whether the owner lock is held.
    pub(crate) fn open_txn(&self, tx: &mut Tx<'_>, scope: txn::Scope<'_>) -> Result<Opened> {
        let s = &self.s;
        let gate = lock_key(&self.schema, "writers");
        let owner = lock_key(&self.schema, &self.owner);
        let results = match scope {
            txn::Scope::OneItem(key) => {
                let key_lock = lock_key(&self.schema, &format!("key:{key}"));
                let gate_sql = format!(
                    "SELECT (SELECT doc FROM {s}.settings WHERE id = 1),
                       pg_try_advisory_xact_lock_shared($3)
                     FROM (SELECT pg_advisory_xact_lock_shared($1), pg_advisory_xact_lock($2)) gate"
                );
                let row_sql = txn::select_for_update_sql(s);
                tx.pipeline(&[
                    Step::QueryOne(&gate_sql, &[&gate, &key_lock, &owner]),
                    Step::QueryOpt(&row_sql, &[&key]),
                ])
            }
            txn::Scope::Any => {
                let gate_sql = format!(
                    "SELECT (SELECT doc FROM {s}.settings WHERE id = 1),
                       pg_try_advisory_xact_lock_shared($2)
                     FROM (SELECT pg_advisory_xact_lock($1)) gate"
                );
                tx.pipeline(&[Step::QueryOne(&gate_sql, &[&gate, &owner])])
            }
        }
        .map_err(db("pass the writers' gate"))?;
        let mut results = results.into_iter();
        let gate_row = results.next().and_then(|mut done| done.rows.pop());
        let Some(gate_row) = gate_row else {
            return Err(Error::Database {
                op: "pass the writers' gate",
                source: "the gate's statement returned no row".into(),
            });
        };
        let stored = self.stored_of(gate_row.get(0))?;
        let owner_free: bool = gate_row.get(1);
        let row = results.next().and_then(|mut done| done.rows.pop());
        Ok(Opened {
            stored,
            row,
            owner_held: !owner_free,
        })
    }

    /// The stored settings, as last committed.
    pub(crate) fn stored_settings(&self) -> Result<Stored> {
        let mut client = self.client()?;
        let mut tx = client.begin();
        let stored = self.read_settings(&mut tx)?;
        tx.commit().map_err(db("end a read"))?;
        Ok(stored)
    }

    /// Runs one read-modify-write of the rules (see [`PgTxn`]) and commits it.
    /// Returns `f`'s value once the commit is durable; on any error nothing
    /// of it is visible.
    ///
    /// A transaction the server aborts to break a deadlock or a serialization
    /// conflict is run again from the start, `f` included, up to
    /// [`retry::ATTEMPTS`] times, at the same `now` (see [`retry`]): `f` must
    /// undo, or be able to repeat, whatever it does outside the transaction.
    ///
    /// Then, best effort (a failure is logged: the next reader seals), it
    /// seals the events it committed, unless another sealer holds the head,
    /// and wakes waiting workers when an item became claimable.
    pub(crate) fn transact<T>(
        &self,
        now: DateTime<Utc>,
        defaults: &Settings,
        scope: txn::Scope<'_>,
        mut f: impl FnMut(&mut PgTxn<'_, '_>) -> Result<T>,
    ) -> Result<T> {
        retry::retrying("the rules' transaction", |_| {
            self.transact_once(now, defaults, scope, &mut f)
        })
    }

    /// One attempt of [`transact`](Self::transact).
    fn transact_once<T>(
        &self,
        now: DateTime<Utc>,
        defaults: &Settings,
        scope: txn::Scope<'_>,
        f: &mut impl FnMut(&mut PgTxn<'_, '_>) -> Result<T>,
    ) -> Result<T> {
        let mut client = self.client()?;
        self.in_txn.fetch_add(1, Ordering::SeqCst);
        let outcome = self.run_txn(&mut client, now, defaults, scope, f);
        let others = self.in_txn.fetch_sub(1, Ordering::SeqCst) - 1;
        let pending = matches!(outcome, Ok((_, true)));
        self.after_txn(&mut client, pending, others);
        outcome.map(|(value, _)| value)
    }

    /// [`transact`](Self::transact)'s transaction: `f`'s value, and whether
    /// the commit left audit events pending.
    fn run_txn<T>(
        &self,
        client: &mut Conn,
        now: DateTime<Utc>,
        defaults: &Settings,
        scope: txn::Scope<'_>,
        f: impl FnOnce(&mut PgTxn<'_, '_>) -> Result<T>,
    ) -> Result<(T, bool)> {
        // A claim must name an owner whose lock is held: the transaction's
        // first statement probes it (see `open_txn`); after a cut or a
        // restart it is taken again here, and the transaction begun anew.
        let mut retaken = false;
        let mut txn = loop {
            match PgTxn::begin(self, client.begin(), scope, now, defaults)? {
                Some(txn) => break txn,
                None if !retaken => {
                    self.ensure_owner()?;
                    retaken = true;
                }
                None => {
                    return Err(Error::SessionLocksUnavailable {
                        reason: format!(
                            "owner lock {} is not held by this handle's owner session after \
                             taking it again",
                            self.owner
                        ),
                    });
                }
            }
        };
        let value = f(&mut txn)?;
        let committed = txn.commit()?;
        Ok((value, committed.pending))
    }

    /// After a transaction of the rules ended (committed or not; `pending`:
    /// it committed audit events, `others`: transactions of this handle still
    /// running): seals what this handle's commits left pending, best effort,
    /// when no other transaction of the handle is running (the last one out
    /// seals for all: one sealing for many commits) or when [`SEAL_EVERY`]
    /// commits are waiting. A handle running one call at a time seals right
    /// after each commit. Pending events are durable whatever happens here:
    /// every reader of the chain and every opening seals first.
    ///
    /// One thread of a handle seals at a time: a thread that finds another
    /// sealing leaves its events to that one, which goes round again when
    /// commits arrived during its sealing.
    fn after_txn(&self, client: &mut Conn, pending: bool, others: u64) {
        if pending {
            self.unsealed.fetch_add(1, Ordering::SeqCst);
        }
        let waiting = self.unsealed.load(Ordering::SeqCst);
        if waiting == 0 || (others > 0 && waiting < SEAL_EVERY) {
            return;
        }
        while !self.sealing.swap(true, Ordering::SeqCst) {
            let taken = self.unsealed.swap(0, Ordering::SeqCst);
            // A failpoint here stands for a crash (or a lost connection)
            // between the commit and its sealing.
            let sealed = self
                .faults
                .check("postgres.seal_after_commit")
                .map_err(|e| Error::io(self.place(), "seal after commit", e))
                .and_then(|()| self.seal_pending(client, Seal::IfFree));
            self.sealing.store(false, Ordering::SeqCst);
            if let Err(e) = sealed {
                // Still pending: the next sealer (or reader) takes them.
                self.unsealed.fetch_add(taken, Ordering::SeqCst);
                tracing::warn!(
                    schema = %self.schema,
                    error = %e,
                    "could not seal committed audit events now; the next reader or handle seals them"
                );
                break;
            }
            // Again only for what the rule above would seal now: a thread
            // does not seal for ever while others keep committing.
            let waiting = self.unsealed.load(Ordering::SeqCst);
            let running = self.in_txn.load(Ordering::SeqCst);
            if waiting == 0 || (running > 0 && waiting < SEAL_EVERY) {
                break;
            }
        }
    }

    /// Applies the settings rules of `settings::plan` on open: a new outbox
    /// stores every value of the opening handle at once (no audit record: the
    /// first state, not a change); values set explicitly on an outbox that
    /// lacks them, or with `update_settings`, are stored with a `settings`
    /// audit record; a builder value a stored one overrides is logged.
    pub(crate) fn settle_settings(
        &self,
        defaults: &Settings,
        explicit: &Stored,
        update: bool,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let mut client = self.client()?;
        let mut tx = client.begin();
        let s = &self.s;
        self.pass_gate(&mut tx, txn::Scope::Any)?;
        // Pending events go on the chain first: this record comes after them.
        let head = self.lock_head(&mut tx)?;
        let (_, head) = self.seal_pending_in(&mut tx, head)?;
        let stored = self.read_settings(&mut tx)?;
        let items: i64 = tx
            .query_one(&format!("SELECT count(*) FROM {s}.items"), &[])
            .map_err(db("count items"))?
            .get(0);
        let new_outbox = items == 0 && head.seq == 0;
        let plan = crate::settings::plan(&stored, defaults, explicit, update, new_outbox);
        for ignored in &plan.ignored {
            tracing::warn!(
                schema = %self.schema,
                "{ignored}: the stored value is in force (open with `update_settings()` to change it)"
            );
        }
        let Some(next) = plan.store else {
            return tx.commit().map_err(db("end a read"));
        };
        tx.execute(
            &format!(
                "INSERT INTO {s}.settings (id, doc) VALUES (1, $1)
                 ON CONFLICT (id) DO UPDATE SET doc = EXCLUDED.doc"
            ),
            &[&settings_to_json(&next)],
        )
        .map_err(db("store the settings"))?;
        if let Some(note) = plan.note {
            let how = if update {
                "updated by a handle opened with update_settings"
            } else {
                "stored on first explicit use"
            };
            let event = system_event(
                AuditOutcome::Settings,
                &head,
                "settings",
                format!("{note} ({how})"),
                now,
            );
            self.append_system_record(&mut tx, &head, &event)?;
        }
        tx.commit().map_err(db("store the settings"))
    }

    /// Seals `event` after `head` (locked by `tx`) and moves the head.
    fn append_system_record(&self, tx: &mut Tx<'_>, head: &Head, event: &AuditEvent) -> Result<()> {
        let s = &self.s;
        let record = AuditRecord::seal(event, head.seq + 1, &head.hash, false, &self.hasher);
        let mut line = record.to_line();
        line.pop();
        let seq = i64::try_from(record.seq).unwrap_or(i64::MAX);
        tx.execute(
            &format!("INSERT INTO {s}.audit (seq, hash, line) VALUES ($1, $2, $3)"),
            &[
                &seq,
                &record.hash,
                &String::from_utf8_lossy(&line).into_owned(),
            ],
        )
        .map_err(db("append an audit record"))?;
        tx.execute(
            &format!("UPDATE {s}.audit_head SET seq = $1, hash = $2 WHERE id = 1"),
            &[&seq, &record.hash],
        )
        .map_err(db("move the audit head"))?;
        Ok(())
    }

    /// Applies `history_retention` at `now`: under `MaxAge(age)`, deletes the
    /// terminal items last changed longer ago than `age` (and than
    /// `history_after`, and outside every rate window, so nothing that still
    /// counts against a cap goes), with one `pruned` audit record saying how
    /// many and up to when, in one transaction. `KeepAll` keeps everything;
    /// `MaxSegments` counts files the PostgreSQL engine does not have, so it
    /// keeps everything too (logged). Returns how many items went.
    pub(crate) fn apply_retention(&self, settings: &Settings, now: DateTime<Utc>) -> Result<u64> {
        let age = match settings.retention {
            crate::history::Retention::MaxAge(age) => age,
            crate::history::Retention::MaxSegments(_) => {
                tracing::warn!(
                    schema = %self.schema,
                    "history_retention max_segments does not apply to a PostgreSQL outbox \
                     (it has no segment files); keeping all history: use max_age"
                );
                return Ok(0);
            }
            _ => return Ok(0),
        };
        let keep_for = age
            .max(settings.history_after)
            .max(settings.rates.longest_window());
        let cutoff = crate::clock::earlier(now, keep_for);
        let mut client = self.client()?;
        let mut tx = client.begin();
        let s = &self.s;
        self.pass_gate(&mut tx, txn::Scope::Any)?;
        // Pending events (the pruned items' last ones among them) go on the
        // chain first: the prune's record comes after them.
        let head = self.lock_head(&mut tx)?;
        let (_, head) = self.seal_pending_in(&mut tx, head)?;
        let gone: Vec<String> = tx
            .query(
                &format!(
                    "DELETE FROM {s}.items
                     WHERE state <> 'queued' AND NOT claimed AND updated_at <= $1
                     RETURNING idempotency_key"
                ),
                &[&cutoff],
            )
            .map_err(db("prune history"))?
            .iter()
            .map(|row| row.get(0))
            .collect();
        if gone.is_empty() {
            tx.commit().map_err(db("end a retention look"))?;
            return Ok(0);
        }
        tx.execute(
            &format!("DELETE FROM {s}.rate_times WHERE idempotency_key = ANY($1)"),
            &[&gone],
        )
        .map_err(db("prune history's send times"))?;
        let note = format!(
            "retention pruned {} history items last changed at or before {}",
            gone.len(),
            crate::clock::format_timestamp(cutoff)
        );
        let event = system_event(AuditOutcome::Pruned, &head, "history-retention", note, now);
        self.append_system_record(&mut tx, &head, &event)?;
        tx.commit().map_err(db("commit a retention prune"))?;
        Ok(gone.len() as u64)
    }

    fn items_where(
        &self,
        condition: &str,
        params: &[&(dyn postgres::types::ToSql + Sync)],
    ) -> Result<Vec<OutboxItem>> {
        let rows = self
            .client()?
            .query(
                &format!(
                    "SELECT idempotency_key, revision, doc, seq FROM {}.items WHERE {condition}",
                    self.s
                ),
                params,
            )
            .map_err(db("read items"))?;
        rows.iter()
            .map(|row| self.versioned(row).map(|v| v.item))
            .collect()
    }

    /// The item with this key, live or history.
    pub(crate) fn item(&self, key: &str) -> Result<Option<OutboxItem>> {
        Ok(self
            .items_where("idempotency_key = $1", &[&key])?
            .into_iter()
            .next())
    }

    /// Live items (queued, or terminal and changed after `cutoff`), by key.
    pub(crate) fn live_items(&self, cutoff: DateTime<Utc>) -> Result<Vec<OutboxItem>> {
        self.items_where(
            "state = 'queued' OR updated_at > $1 ORDER BY idempotency_key",
            &[&cutoff],
        )
    }

    /// History: terminal items last changed at or before `cutoff`, oldest first.
    pub(crate) fn history_items(&self, cutoff: DateTime<Utc>) -> Result<Vec<OutboxItem>> {
        self.items_where(
            "state <> 'queued' AND updated_at <= $1 ORDER BY updated_at, idempotency_key",
            &[&cutoff],
        )
    }

    /// The item whose send returned `transport_ref` (to `destination`, when
    /// given); the first by key when several share it.
    pub(crate) fn find_ref(
        &self,
        destination: Option<&str>,
        transport_ref: &str,
    ) -> Result<Option<OutboxItem>> {
        let found = match destination {
            Some(destination) => self.items_where(
                "transport_ref = $1 AND destination = $2 ORDER BY idempotency_key LIMIT 1",
                &[&transport_ref, &destination],
            )?,
            None => self.items_where(
                "transport_ref = $1 ORDER BY idempotency_key LIMIT 1",
                &[&transport_ref],
            )?,
        };
        Ok(found.into_iter().next())
    }

    /// The keys of the queued items due at `now`, oldest first.
    pub(crate) fn due_keys(&self, now: DateTime<Utc>) -> Result<Vec<String>> {
        let rows = self
            .client()?
            .query(
                &format!(
                    "SELECT idempotency_key FROM {}.items
                     WHERE state = 'queued' AND (next_attempt_at IS NULL OR next_attempt_at <= $1)
                     ORDER BY created_at, idempotency_key",
                    self.s
                ),
                &[&now],
            )
            .map_err(db("read the due items"))?;
        Ok(rows.iter().map(|row| row.get(0)).collect())
    }

    /// The earliest moment a queued, unclaimed item falls due (under
    /// per-destination order, only each destination's head), and whether a
    /// claim of another handle holds some line.
    pub(crate) fn due_summary(
        &self,
        ordering: crate::order::Ordering,
        now: DateTime<Utc>,
    ) -> Result<(Option<DateTime<Utc>>, bool)> {
        let s = &self.s;
        let scope = match ordering {
            crate::order::Ordering::PerDestination => format!(
                "(SELECT DISTINCT ON (destination) claimed, next_attempt_at, created_at
                  FROM {s}.items WHERE state = 'queued'
                  ORDER BY destination, seq, created_at, idempotency_key)"
            ),
            crate::order::Ordering::Unordered => {
                format!(
                    "(SELECT claimed, next_attempt_at, created_at FROM {s}.items WHERE state = 'queued')"
                )
            }
        };
        let mut client = self.client()?;
        let row = client
            .query_one(
                &format!(
                    "SELECT min(LEAST(COALESCE(next_attempt_at, $1), $1)) FILTER (WHERE next_attempt_at IS NULL),
                            min(next_attempt_at) FILTER (WHERE next_attempt_at IS NOT NULL)
                     FROM {scope} h WHERE NOT h.claimed"
                ),
                &[&now],
            )
            .map_err(db("read when the next item is due"))?;
        let fresh: Option<DateTime<Utc>> = row.get(0);
        let deferred: Option<DateTime<Utc>> = row.get(1);
        let foreign: bool = client
            .query_one(
                &format!(
                    "SELECT EXISTS (SELECT 1 FROM {s}.items WHERE state = 'queued' AND claimed
                       AND claim_owner IS DISTINCT FROM $1)"
                ),
                &[&self.owner],
            )
            .map_err(db("read the claims"))?
            .get(0);
        Ok((fresh.or(deferred), foreign))
    }

    /// What `rate_windows` measures, read in one snapshot: queued items per
    /// destination, send times since `since` per destination, and cooldowns
    /// still ahead of `now`.
    #[expect(
        clippy::type_complexity,
        reason = "three plain maps, named at the one caller"
    )]
    pub(crate) fn rate_inputs(
        &self,
        since: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Result<(
        std::collections::BTreeMap<String, usize>,
        std::collections::BTreeMap<String, Vec<DateTime<Utc>>>,
        std::collections::BTreeMap<String, DateTime<Utc>>,
    )> {
        let s = &self.s;
        let mut client = self.client()?;
        let mut tx = client.begin_snapshot();
        let queued = tx
            .query(
                &format!(
                    "SELECT destination, count(*) FROM {s}.items WHERE state = 'queued'
                     GROUP BY destination"
                ),
                &[],
            )
            .map_err(db("count queued items"))?
            .iter()
            .map(|row| {
                let count: i64 = row.get(1);
                (row.get(0), usize::try_from(count).unwrap_or(0))
            })
            .collect();
        let mut times: std::collections::BTreeMap<String, Vec<DateTime<Utc>>> =
            std::collections::BTreeMap::new();
        for row in tx
            .query(
                &format!("SELECT destination, at FROM {s}.rate_times WHERE at >= $1"),
                &[&since],
            )
            .map_err(db("read send times"))?
        {
            times.entry(row.get(0)).or_default().push(row.get(1));
        }
        let cooldowns = tx
            .query(
                &format!("SELECT destination, until FROM {s}.cooldowns WHERE until > $1"),
                &[&now],
            )
            .map_err(db("read cooldowns"))?
            .iter()
            .map(|row| (row.get(0), row.get(1)))
            .collect();
        tx.commit().map_err(db("end reading rate windows"))?;
        Ok((queued, times, cooldowns))
    }

    /// Every audit record about `key`, oldest first.
    pub(crate) fn records_of(&self, key: &str) -> Result<Vec<AuditRecord>> {
        let mut client = self.client()?;
        self.seal_before_reading(&mut client)?;
        let rows = client
            .query(
                &format!(
                    "SELECT seq, line FROM {}.audit
                     WHERE line::jsonb ->> 'idempotency_key' = $1 ORDER BY seq",
                    self.s
                ),
                &[&key],
            )
            .map_err(db("read the audit log"))?;
        rows.iter().map(|row| self.record_of_row(row)).collect()
    }

    fn record_of_row(&self, row: &Row) -> Result<AuditRecord> {
        let seq: i64 = row.get(0);
        let line: &str = row.get(1);
        serde_json::from_str(line).map_err(|e| Error::InvalidRecord {
            path: PathBuf::from(format!("postgres:{}.audit", self.schema)),
            location: format!("seq {seq}"),
            reason: format!("not an audit record: {e}"),
        })
    }

    /// The audit head as committed.
    pub(crate) fn audit_head(&self) -> Result<Head> {
        let mut client = self.client()?;
        self.seal_before_reading(&mut client)?;
        let row = client
            .query_one(
                &format!("SELECT seq, hash FROM {}.audit_head WHERE id = 1", self.s),
                &[],
            )
            .map_err(db("read the audit head"))?;
        Ok(Head {
            seq: u64::try_from(row.get::<_, i64>(0)).unwrap_or(0),
            hash: row.get(1),
        })
    }

    /// Verifies the whole chain in the `audit` table, as the file verifier
    /// checks `audit.jsonl`, and against the head row (a cut-off tail is
    /// found). One consistent snapshot: a repeatable-read transaction.
    pub(crate) fn verify_audit(&self) -> Result<AuditReport> {
        let mut client = self.client()?;
        self.seal_before_reading(&mut client)?;
        let mut tx = client.begin_snapshot();
        let row = tx
            .query_one(
                &format!("SELECT seq, hash FROM {}.audit_head WHERE id = 1", self.s),
                &[],
            )
            .map_err(db("read the audit head"))?;
        let expected = Head {
            seq: u64::try_from(row.get::<_, i64>(0)).unwrap_or(0),
            hash: row.get(1),
        };
        let rows = tx
            .query(
                &format!("SELECT line FROM {}.audit ORDER BY seq", self.s),
                &[],
            )
            .map_err(db("read the audit log"))?;
        tx.commit().map_err(db("end verifying the audit log"))?;
        let place = PathBuf::from(format!("postgres:{}.audit", self.schema));
        crate::audit::verify_lines(
            &place,
            rows.iter().map(|row| row.get::<_, &str>(0).as_bytes()),
            &self.hasher,
            &expected,
        )
    }

    /// Locks the audit head row in `tx` (a sealer's lock) and returns it.
    fn lock_head(&self, tx: &mut Tx<'_>) -> Result<Head> {
        let row = tx
            .query_one(
                &format!(
                    "SELECT seq, hash FROM {}.audit_head WHERE id = 1 FOR UPDATE",
                    self.s
                ),
                &[],
            )
            .map_err(db("lock the audit head"))?;
        Ok(head_of_row(&row))
    }
}

/// What a worker and a chain reader ask of the engine besides the rules'
/// transactions.
impl PgEngine {
    /// Blocks until a commit that made work due lands (on any handle of any
    /// host: `NOTIFY`) or `timeout` passes; `true` when woken. Waking is only
    /// a hint: a waiter reads again after it. A worker's tick also seals what
    /// a crashed handle or a skipped best-effort sealing left pending.
    pub(crate) fn wait_for_work(&self, timeout: Duration) -> Result<bool> {
        // A worker's tick: events a crashed handle or a skipped best-effort
        // sealing left pending go on the chain.
        {
            let mut client = self.client()?;
            self.seal_pending(&mut client, Seal::IfFree)?;
        }
        let mut listener = lock(&self.listener);
        if listener.as_ref().is_none_or(notify::Listener::is_closed) {
            *listener = Some(notify::Listener::start(&self.connector, &self.schema)?);
        }
        match listener.as_mut() {
            Some(listener) => listener.wait(timeout),
            None => Ok(false),
        }
    }

    /// Up to `limit` of the audit chain's records with `seq` above `after`,
    /// in order (sealing what is pending first): one page of a chain read in
    /// bounded memory, keyed by seq.
    pub(crate) fn audit_page(&self, after: u64, limit: i64) -> Result<Vec<AuditRecord>> {
        let mut client = self.client()?;
        self.seal_before_reading(&mut client)?;
        let rows = client
            .query(
                &format!(
                    "SELECT seq, line FROM {}.audit WHERE seq > $1 ORDER BY seq LIMIT $2",
                    self.s
                ),
                &[&i64::try_from(after).unwrap_or(i64::MAX), &limit],
            )
            .map_err(db("read the audit log"))?;
        rows.iter()
            .map(|row| {
                let seq: i64 = row.get(0);
                let line: &str = row.get(1);
                serde_json::from_str(line).map_err(|e| Error::InvalidRecord {
                    path: PathBuf::from(format!("postgres:{}.audit", self.schema)),
                    location: format!("seq {seq}"),
                    reason: format!("not an audit record: {e}"),
                })
            })
            .collect()
    }
}

/// Sealed records to write and the head they end at.
struct SealedWrite {
    seqs: Vec<i64>,
    hashes: Vec<String>,
    lines: Vec<String>,
    head_seq: i64,
    head: Head,
}

impl SealedWrite {
    /// The parameters of [`PgEngine::append_sealed_sql`].
    fn params(&self) -> [&(dyn postgres::types::ToSql + Sync); 5] {
        [
            &self.seqs,
            &self.hashes,
            &self.lines,
            &self.head_seq,
            &self.head.hash,
        ]
    }
}

/// What [`PgEngine::open_txn`] found.
pub(crate) struct Opened {
    /// The stored settings.
    pub(crate) stored: Stored,
    /// The item's row, locked (one-item transactions; `None`: no row).
    pub(crate) row: Option<Row>,
    /// Whether this handle's owner lock is held.
    pub(crate) owner_held: bool,
}

/// The documents `audit_pending` stores for `events`.
fn pending_docs(events: &[AuditEvent]) -> Result<Vec<String>> {
    events
        .iter()
        .map(|event| {
            serde_json::to_string(event).map_err(|e| Error::Database {
                op: "write a pending audit event",
                source: Box::new(e),
            })
        })
        .collect()
}

/// Runs `steps` as one pipeline in `tx`; the first error is named by its
/// step's operation.
fn run_named(tx: &mut Tx<'_>, steps: &[(Step<'_>, &'static str)]) -> Result<Vec<conn::Done>> {
    let plain: Vec<Step<'_>> = steps.iter().map(|(step, _)| *step).collect();
    let results = tx.pipeline_each(&plain).map_err(db("run statements"))?;
    let mut out = Vec::with_capacity(results.len());
    for (result, (_, op)) in results.into_iter().zip(steps) {
        out.push(result.map_err(db(op))?);
    }
    Ok(out)
}

/// One item's write, ready to run: its row (an `INSERT`, or an `UPDATE` of
/// the revision read; the statements of [`rows`]) and, when they changed since
/// `before`, its send times (`rate_times`) and its destination's cooldown
/// (`cooldowns`, only ever raised).
pub(crate) struct ItemWrite<'i> {
    item: &'i OutboxItem,
    row: rows::NewRow<'i>,
    /// `Some`: update the row at this revision; `None`: insert it.
    revision: Option<i64>,
    /// The item's send times, when they are to be written.
    times: Option<Vec<DateTime<Utc>>>,
    /// The cooldown to raise the destination's to, if any.
    cooldown: Option<DateTime<Utc>>,
}

/// A statement to run, its parameters and the operation it performs.
type Statement<'a> = (
    String,
    Vec<&'a (dyn postgres::types::ToSql + Sync)>,
    &'static str,
);

impl<'i> ItemWrite<'i> {
    pub(crate) fn new(item: &'i OutboxItem, expect: Expect, before: Option<&OutboxItem>) -> Self {
        let times: Vec<DateTime<Utc>> = rate_times(item).collect();
        let unchanged = before.is_some_and(|before| {
            before.destination == item.destination
                && rate_times(before).collect::<Vec<_>>() == times
        });
        let fresh = matches!(expect, Expect::Absent);
        let nothing_to_write = unchanged || (fresh && times.is_empty());
        let cooldown_unchanged =
            before.is_some_and(|before| before.cooldown_until == item.cooldown_until);
        Self {
            item,
            row: rows::NewRow::of(item),
            revision: match expect {
                Expect::Absent => None,
                Expect::Revision(revision) => Some(i64::try_from(revision).unwrap_or(i64::MAX)),
            },
            times: (!nothing_to_write).then_some(times),
            cooldown: item.cooldown_until.filter(|_| !cooldown_unchanged),
        }
    }

    /// The statements of this write in schema `s` (quoted), in order. An
    /// insert of a `strict` write fails on a row that exists (its
    /// transaction aborts) instead of inserting nothing.
    pub(crate) fn statements(&self, s: &str, strict: bool) -> Vec<Statement<'_>> {
        let item = self.item;
        let mut out: Vec<Statement<'_>> = Vec::with_capacity(3);
        match &self.revision {
            None => out.push((
                if strict {
                    rows::strict_insert_item_sql(s)
                } else {
                    rows::insert_item_sql(s)
                },
                self.row.params().to_vec(),
                "insert an item",
            )),
            Some(revision) => out.push((
                rows::update_item_sql(s),
                self.row.update_params(revision).to_vec(),
                "update an item",
            )),
        }
        if let Some(times) = &self.times {
            // One statement: drop the times the item no longer has, add the
            // new ones (the two never touch the same row).
            out.push((
                format!(
                    "WITH gone AS (
                       DELETE FROM {s}.rate_times
                       WHERE idempotency_key = $1 AND NOT (at = ANY($3) AND destination = $2))
                     INSERT INTO {s}.rate_times (idempotency_key, destination, at)
                     SELECT $1, $2, t FROM unnest($3::timestamptz[]) AS t
                     ON CONFLICT DO NOTHING"
                ),
                vec![&item.idempotency_key, &item.destination, times],
                "index an item's send times",
            ));
        }
        if let Some(until) = &self.cooldown {
            // The cooldown belongs to the destination: only ever raised.
            out.push((
                format!(
                    "INSERT INTO {s}.cooldowns (destination, until) VALUES ($1, $2)
                     ON CONFLICT (destination) DO UPDATE
                     SET until = GREATEST({s}.cooldowns.until, EXCLUDED.until)"
                ),
                vec![&item.destination, until],
                "record a destination cooldown",
            ));
        }
        out
    }
}

/// Whether a sealer waits for the head row when another sealer holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Seal {
    /// Wait (a reader of the chain, a handle opening).
    Wait,
    /// Give up (the committing handle's best effort: the holder, or the next
    /// reader, seals what is left).
    IfFree,
}

/// The head from a row of `seq, hash`.
fn head_of_row(row: &Row) -> Head {
    Head {
        seq: u64::try_from(row.get::<_, i64>(0)).unwrap_or(0),
        hash: row.get(1),
    }
}

/// A reads/commits connection lent by [`PgEngine::client`].
struct Pooled<'e> {
    engine: &'e PgEngine,
    client: Option<Conn>,
}

impl std::ops::Deref for Pooled<'_> {
    type Target = Conn;

    fn deref(&self) -> &Conn {
        match &self.client {
            Some(client) => client,
            None => unreachable!("taken only in drop"),
        }
    }
}

impl std::ops::DerefMut for Pooled<'_> {
    fn deref_mut(&mut self) -> &mut Conn {
        match &mut self.client {
            Some(client) => client,
            None => unreachable!("taken only in drop"),
        }
    }
}

impl Drop for Pooled<'_> {
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            self.engine.give_back(client);
        }
    }
}

#[cfg(test)]
#[path = "../../../tests/support/postgres.rs"]
mod test_server;

#[cfg(test)]
mod tests;
