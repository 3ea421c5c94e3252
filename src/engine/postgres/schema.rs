//! Tables, and the versioned, forward-only migrations that create them.
//!
//! Every outbox lives in its own PostgreSQL schema (a name given on open), so
//! many outboxes can share one database. `outbox_meta` holds the version of the
//! tables; opening applies each migration above it in one transaction under a
//! transaction-level advisory lock (concurrent opens wait for each other), and
//! refuses a version newer than this release knows: an older binary must not
//! write to tables a newer one shaped.
//!
//! That refusal is why a handle that only looks (the operator's tool, opened
//! with `upgrade_schema(false)`) never migrates: the bots of the older
//! release go on running on the migrated tables, but each refuses them at
//! its next start. Such a handle is refused an older version instead, with
//! nothing written ([`Error::SchemaUpgradeNeeded`]).

use postgres::{Client, Transaction};

use super::{db, lock_key};
use crate::audit::GENESIS_HASH;
use crate::error::{Error, Result};

/// Migrations in order; version `n` is `MIGRATIONS[n - 1]`. Never edit one that
/// has shipped: add the next.
const MIGRATIONS: &[&str] = &[
    // 1: items, their cap-relevant times, destination cooldowns, owners, the
    // audit chain and its head.
    "CREATE TABLE {s}.items (
        idempotency_key text PRIMARY KEY,
        revision bigint NOT NULL,
        enqueue_order bigint GENERATED ALWAYS AS IDENTITY UNIQUE,
        destination text NOT NULL,
        state text NOT NULL CHECK (state IN ('queued', 'sent', 'failed')),
        claimed boolean NOT NULL,
        claim_owner text,
        next_attempt_at timestamptz,
        transport_ref text,
        doc text NOT NULL
     );
     CREATE INDEX ON {s}.items (destination, enqueue_order) WHERE state = 'queued';
     CREATE INDEX ON {s}.items (enqueue_order) WHERE state = 'queued' AND NOT claimed;
     CREATE INDEX ON {s}.items (claim_owner) WHERE claimed;
     CREATE INDEX ON {s}.items (transport_ref, enqueue_order) WHERE transport_ref IS NOT NULL;
     CREATE TABLE {s}.rate_times (
        idempotency_key text NOT NULL,
        destination text NOT NULL,
        at timestamptz NOT NULL,
        PRIMARY KEY (idempotency_key, at)
     );
     CREATE INDEX ON {s}.rate_times (destination, at);
     CREATE INDEX ON {s}.rate_times (at);
     CREATE TABLE {s}.cooldowns (
        destination text PRIMARY KEY,
        until timestamptz NOT NULL
     );
     CREATE TABLE {s}.owners (
        owner_id text PRIMARY KEY,
        opened_at timestamptz NOT NULL DEFAULT now()
     );
     CREATE TABLE {s}.audit (
        seq bigint PRIMARY KEY,
        hash text NOT NULL,
        line text NOT NULL
     );
     CREATE TABLE {s}.audit_head (
        id integer PRIMARY KEY CHECK (id = 1),
        seq bigint NOT NULL,
        hash text NOT NULL
     );
     INSERT INTO {s}.audit_head (id, seq, hash) VALUES (1, 0, '{genesis}');",
    // 2: what the whole lifecycle needs (`Outbox::postgres`). Items gain their
    // place in the destination's line (`seq`: enqueue order, a requeue moves
    // an item to the back, handed out by `enqueue_seq` so every host agrees),
    // `created_at` (the order's tie-break and a fresh item's due time) and
    // `updated_at` (when a terminal item counts as history, see `history`).
    // `settings` holds the stored settings: one row, the same JSON object
    // `outbox.json` stores under `"settings"`.
    "ALTER TABLE {s}.items ADD COLUMN seq bigint, ADD COLUMN created_at timestamptz,
        ADD COLUMN updated_at timestamptz;
     UPDATE {s}.items SET
        seq = COALESCE((doc::jsonb ->> 'enqueue_seq')::bigint, enqueue_order),
        created_at = (doc::jsonb ->> 'created_at_utc')::timestamptz,
        updated_at = (doc::jsonb ->> 'updated_at_utc')::timestamptz;
     ALTER TABLE {s}.items ALTER COLUMN seq SET NOT NULL,
        ALTER COLUMN created_at SET NOT NULL, ALTER COLUMN updated_at SET NOT NULL;
     CREATE SEQUENCE {s}.enqueue_seq;
     SELECT setval('{s}.enqueue_seq', COALESCE((SELECT max(seq) FROM {s}.items), 0) + 1, false);
     CREATE INDEX ON {s}.items (destination, seq, created_at, idempotency_key)
        WHERE state = 'queued';
     CREATE INDEX ON {s}.items (updated_at) WHERE state <> 'queued';
     CREATE TABLE {s}.settings (
        id integer PRIMARY KEY CHECK (id = 1),
        doc text NOT NULL
     );",
    // 3: deferred sealing (see `engine::postgres::sealing`). An
    // item transaction writes its audit events here, in its own commit, with
    // an id from the table's sequence; a short sealing transaction under the
    // head row moves them into `audit` in id order. `audit` keeps its meaning:
    // sealed records only.
    "CREATE TABLE {s}.audit_pending (
        id bigserial PRIMARY KEY,
        event text NOT NULL
     );",
    // 4: less written per item. No statement has named `enqueue_order`
    // (version 1's place in line) since version 2 gave items `seq`, yet
    // every row version wrote its unique index and, while queued, two
    // partial indexes on it (an item's insert, claim and finish are three
    // row versions, none of them HOT: each changes an indexed column). The
    // planner used two of them only for their predicates, as row sets: the
    // queued rows (`(destination, enqueue_order) WHERE state = 'queued'`: due
    // keys, due summary, fronts, queued counts) and the queued unclaimed ones
    // (the unordered fronts and due summary); `EXPLAIN` shows it takes the
    // queued index of version 2 for all of them now, filtering `claimed` (a
    // queued row is claimed only while its send runs). Dropping the column drops those three indexes, and
    // with them the transport reference's index, which is made again
    // without it, in the order a lookup reads (`find_by_transport_ref`: the
    // first key). A binary of
    // version 3 opening refuses version 4; one already running goes on
    // (none of its statements names the column or selects `*`).
    "ALTER TABLE {s}.items DROP COLUMN enqueue_order;
     CREATE INDEX ON {s}.items (transport_ref, idempotency_key)
        WHERE transport_ref IS NOT NULL;",
];

/// The schema version this release writes.
pub(crate) const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// What opening may do to the version of an outbox's tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Versioning {
    /// The version to migrate to: this release's, an older one only where
    /// tests build an outbox as an older release left it.
    pub(crate) target: i64,
    /// Whether an outbox at an older version may be migrated to `target`
    /// (`OutboxBuilder::upgrade_schema`). When not, it is refused with
    /// [`Error::SchemaUpgradeNeeded`] and nothing is written; a schema with
    /// no outbox yet is created at `target` either way (creation is
    /// `create_if_missing`'s to allow).
    pub(crate) upgrade: bool,
}

impl Versioning {
    /// A bot's open: creates or migrates to this release's version.
    #[cfg(test)]
    pub(crate) const CURRENT: Self = Self {
        target: SCHEMA_VERSION,
        upgrade: true,
    };
}

/// Creates or migrates the tables of `schema` up to version `target` (tests
/// build an older schema with it), in a transaction of its own; refuses a
/// version newer than this release.
#[cfg(test)]
pub(crate) fn migrate_to(client: &mut Client, schema: &str, target: i64) -> Result<()> {
    open_tables(
        client,
        schema,
        Versioning {
            target,
            upgrade: true,
        },
    )
}

/// Creates or migrates the tables of `schema` as `versioning` allows, in a
/// transaction of its own (rolled back when it refuses: nothing is written).
/// Refuses a version newer than this release, and an older one that
/// `versioning` may not upgrade.
pub(crate) fn open_tables(client: &mut Client, schema: &str, versioning: Versioning) -> Result<()> {
    let mut tx = client.transaction().map_err(db("begin migration"))?;
    migrate_as(&mut tx, schema, versioning)?;
    tx.commit().map_err(db("commit the migration"))
}

/// Creates or migrates the tables of `schema` up to version `target` inside
/// `tx`, which the caller commits: DDL is transactional in PostgreSQL, so a
/// caller that fails later in the same transaction (the import of a
/// migration) leaves the server as it was, without a schema or tables it
/// created. Holds the schema's migration lock until `tx` ends, so concurrent
/// opens wait for each other. Refuses a version newer than this release.
pub(crate) fn migrate_in(tx: &mut Transaction<'_>, schema: &str, target: i64) -> Result<()> {
    migrate_as(
        tx,
        schema,
        Versioning {
            target,
            upgrade: true,
        },
    )
}

/// [`migrate_in`] as `versioning` allows: an outbox at an older version
/// than `versioning.target` is refused unless `versioning.upgrade`, before
/// anything is written but what the caller's transaction then rolls back.
fn migrate_as(tx: &mut Transaction<'_>, schema: &str, versioning: Versioning) -> Result<()> {
    let Versioning { target, upgrade } = versioning;
    let s = quoted(schema);
    tx.execute(
        "SELECT pg_advisory_xact_lock($1)",
        &[&lock_key(schema, "migrate")],
    )
    .map_err(db("lock the schema for migration"))?;
    tx.batch_execute(&format!(
        "CREATE SCHEMA IF NOT EXISTS {s};
         CREATE TABLE IF NOT EXISTS {s}.outbox_meta (
            id integer PRIMARY KEY CHECK (id = 1),
            version bigint NOT NULL
         );
         INSERT INTO {s}.outbox_meta (id, version) VALUES (1, 0) ON CONFLICT (id) DO NOTHING;"
    ))
    .map_err(db("create the schema"))?;
    let row = tx
        .query_one(&format!("SELECT version FROM {s}.outbox_meta"), &[])
        .map_err(db("read the schema version"))?;
    let found: i64 = row.get(0);
    if found > SCHEMA_VERSION {
        return Err(Error::UnsupportedSchema {
            schema: schema.to_owned(),
            found,
            known: SCHEMA_VERSION,
        });
    }
    // Version 0 is no outbox yet: the statements above made its version
    // table in this transaction, and creating one is not an upgrade.
    if !upgrade && found > 0 && found < target {
        return Err(Error::SchemaUpgradeNeeded {
            schema: schema.to_owned(),
            found,
            known: SCHEMA_VERSION,
        });
    }
    let target = usize::try_from(target).unwrap_or(0).min(MIGRATIONS.len());
    for (index, migration) in MIGRATIONS
        .iter()
        .enumerate()
        .take(target)
        .skip(usize::try_from(found).unwrap_or(0))
    {
        let sql = migration
            .replace("{s}", &s)
            .replace("{genesis}", GENESIS_HASH);
        tx.batch_execute(&sql).map_err(db("apply a migration"))?;
        tracing::info!(
            schema,
            version = index + 1,
            "applied an outbox schema migration"
        );
    }
    let version = (target as i64).max(found);
    // Tables already at their version are left as they are: opening them
    // writes no new row version of `outbox_meta`.
    if version != found {
        tx.execute(
            &format!("UPDATE {s}.outbox_meta SET version = $1"),
            &[&version],
        )
        .map_err(db("record the schema version"))?;
    }
    Ok(())
}

/// Whether `schema` holds an outbox (its version table), whatever its
/// version: read without writing or locking anything.
pub(crate) fn holds_outbox(client: &mut Client, schema: &str) -> Result<bool> {
    let row = client
        .query_one(
            "SELECT to_regclass($1::text) IS NOT NULL",
            &[&format!("{}.outbox_meta", quoted(schema))],
        )
        .map_err(db("look for the outbox's tables"))?;
    Ok(row.get(0))
}

/// `"name"`: a schema name is checked to be a plain identifier, and quoted anyway.
pub(super) fn quoted(schema: &str) -> String {
    format!("\"{schema}\"")
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
