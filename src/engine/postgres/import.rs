//! Writing a whole outbox read from elsewhere (a file outbox, see
//! `crate::migrate`) into an empty schema, in one transaction that is
//! checked before it commits.
//!
//! One transaction does all of it, so a failed import leaves the server as
//! it was (DDL is transactional in PostgreSQL): it creates (or migrates) the
//! tables, as opening would, then passes the
//! writers' gate (exclusive) and locks the audit head, refuses a schema that
//! holds items or audit records (sealed or pending), writes the items
//! with their send times and the destinations' cooldowns, the stored settings
//! and every audit line as given, reads everything back and compares it, and
//! only then commits. Any error before `COMMIT` rolls all of it back.

use std::collections::HashMap;
use std::path::PathBuf;

use chrono::{DateTime, Utc};
use postgres::Transaction;

use super::rows::{COLUMNS, NewRow, column_disagreeing, insert_item_sql};
use super::{Connector, check_schema, db, lock_key, quoted, schema};
use crate::audit::{Hasher, Head};
use crate::error::{Error, Result};
use crate::item::OutboxItem;
use crate::settings::Stored;
use crate::store::{item_from_json, rate_times, settings_to_json};

/// What to write: a whole outbox.
pub(crate) struct Import<'a> {
    /// Every item, live and history, each with its place in line set.
    pub(crate) items: &'a [OutboxItem],
    /// The stored settings.
    pub(crate) settings: &'a Stored,
    /// Per destination, the latest `retry_after` cooldown.
    pub(crate) cooldowns: &'a HashMap<String, DateTime<Utc>>,
    /// Every audit line in chain order, without its newline, with the head it
    /// makes (its own seq and hash).
    pub(crate) audit: &'a [crate::audit::ChainLine],
    /// The chain's last record.
    pub(crate) head: &'a Head,
    /// How the chain's hashes are made (the key of a keyed chain).
    pub(crate) hasher: &'a Hasher,
}

/// Writes `import` into `schema` at `url`; see the module docs.
///
/// # Errors
/// [`Error::TargetNotEmpty`] when the schema holds items or audit records;
/// [`Error::Database`] for a failed statement or a lost connection;
/// [`Error::MigrationMismatch`] when what was written does not read back
/// equal; [`Error::AuditBroken`] when the written chain does not verify.
/// Nothing is committed in any of these cases.
pub(crate) fn import(url: &str, schema_name: &str, import: &Import<'_>) -> Result<()> {
    check_schema(schema_name)?;
    let connector = Connector::parse(url)?;
    let mut client = connector.connect()?;
    let s = quoted(schema_name);
    let mut tx = client.transaction().map_err(db("begin the migration"))?;
    // The tables are created in this transaction: a failure below takes
    // them back with everything else.
    schema::migrate_in(&mut tx, schema_name, schema::SCHEMA_VERSION)?;
    // The writers' gate, exclusive, as every writer that may touch many rows
    // takes it, then the head, as every sealer takes it: nobody writes to
    // this schema or seals onto its chain while the import runs.
    tx.execute(
        "SELECT pg_advisory_xact_lock($1)",
        &[&lock_key(schema_name, "writers")],
    )
    .map_err(db("pass the writers' gate"))?;
    let head = tx
        .query_one(
            &format!("SELECT seq FROM {s}.audit_head WHERE id = 1 FOR UPDATE"),
            &[],
        )
        .map_err(db("lock the audit head"))?;
    let head_seq: i64 = head.get(0);
    let items: i64 = tx
        .query_one(&format!("SELECT count(*) FROM {s}.items"), &[])
        .map_err(db("count the target's items"))?
        .get(0);
    // Sealed records and events committed but not sealed yet alike.
    let records: i64 = tx
        .query_one(
            &format!(
                "SELECT (SELECT count(*) FROM {s}.audit) + (SELECT count(*) FROM {s}.audit_pending)"
            ),
            &[],
        )
        .map_err(db("count the target's audit records"))?
        .get(0);
    if items != 0 || records != 0 || head_seq != 0 {
        return Err(Error::TargetNotEmpty {
            schema: schema_name.to_owned(),
            items: u64::try_from(items).unwrap_or(0),
            audit_records: u64::try_from(records.max(head_seq)).unwrap_or(0),
        });
    }
    write(&mut tx, &s, import)?;
    check(&mut tx, &s, schema_name, import)?;
    tx.commit().map_err(db("commit the migration"))
}

fn write(tx: &mut Transaction<'_>, s: &str, import: &Import<'_>) -> Result<()> {
    let mut max_seq = 0i64;
    for item in import.items {
        let seq = i64::try_from(item.seq.unwrap_or(0)).unwrap_or(i64::MAX);
        max_seq = max_seq.max(seq);
        // The rules' own INSERT (see `rows`); a key the source holds twice
        // writes no second row, which the read-back check reports.
        let row = NewRow::of(item);
        tx.execute(&insert_item_sql(s), &row.params())
            .map_err(db("insert an item"))?;
        for at in rate_times(item) {
            tx.execute(
                &format!(
                    "INSERT INTO {s}.rate_times (idempotency_key, destination, at)
                     VALUES ($1, $2, $3) ON CONFLICT DO NOTHING"
                ),
                &[&item.idempotency_key, &item.destination, &at],
            )
            .map_err(db("index an item's send times"))?;
        }
    }
    // The next enqueue goes behind every migrated item.
    tx.execute(
        &format!("SELECT setval('{s}.enqueue_seq', $1, false)"),
        &[&(max_seq + 1)],
    )
    .map_err(db("continue the enqueue sequence"))?;
    let mut cooldowns: HashMap<&str, DateTime<Utc>> = import
        .cooldowns
        .iter()
        .map(|(destination, until)| (destination.as_str(), *until))
        .collect();
    for item in import.items {
        if let Some(until) = item.cooldown_until {
            let entry = cooldowns.entry(item.destination.as_str()).or_insert(until);
            *entry = (*entry).max(until);
        }
    }
    for (destination, until) in &cooldowns {
        tx.execute(
            &format!("INSERT INTO {s}.cooldowns (destination, until) VALUES ($1, $2)"),
            &[destination, until],
        )
        .map_err(db("record a destination cooldown"))?;
    }
    tx.execute(
        &format!(
            "INSERT INTO {s}.settings (id, doc) VALUES (1, $1)
             ON CONFLICT (id) DO UPDATE SET doc = EXCLUDED.doc"
        ),
        &[&settings_to_json(import.settings)],
    )
    .map_err(db("store the settings"))?;
    for (head, line) in import.audit {
        let seq = i64::try_from(head.seq).unwrap_or(i64::MAX);
        tx.execute(
            &format!("INSERT INTO {s}.audit (seq, hash, line) VALUES ($1, $2, $3)"),
            &[&seq, &head.hash, &String::from_utf8_lossy(line).as_ref()],
        )
        .map_err(db("append an audit record"))?;
    }
    tx.execute(
        &format!("UPDATE {s}.audit_head SET seq = $1, hash = $2 WHERE id = 1"),
        &[
            &i64::try_from(import.head.seq).unwrap_or(i64::MAX),
            &import.head.hash,
        ],
    )
    .map_err(db("move the audit head"))?;
    Ok(())
}

/// Reads back what `write` wrote, inside the same transaction, and compares:
/// every item equal to its source (its document, its place in line and the
/// columns claims, lookups and history filter on), the audit lines byte for byte, the chain
/// verified by the file verifier and its head the source's.
fn check(tx: &mut Transaction<'_>, s: &str, schema_name: &str, import: &Import<'_>) -> Result<()> {
    let mismatch = |what: String| Error::MigrationMismatch { what };
    let place = PathBuf::from(format!("postgres:{schema_name}.items"));
    let rows = tx
        .query(
            &format!("SELECT idempotency_key, doc, seq, {COLUMNS} FROM {s}.items"),
            &[],
        )
        .map_err(db("read the migrated items"))?;
    let mut written = HashMap::with_capacity(rows.len());
    for row in &rows {
        let key: String = row.get(0);
        let doc: String = row.get(1);
        let seq: i64 = row.get(2);
        let mut item = item_from_json(&place, &format!("row {key:?}"), doc.as_bytes())?;
        item.seq = u64::try_from(seq).ok();
        // The columns the rules filter on, not only the document.
        if let Some(column) = column_disagreeing(row, &item) {
            return Err(mismatch(format!(
                "item {key:?} reads back with its {column} column not saying what its document says"
            )));
        }
        written.insert(key, item);
    }
    if written.len() != import.items.len() {
        return Err(mismatch(format!(
            "{} items written, {} in the source",
            written.len(),
            import.items.len()
        )));
    }
    for item in import.items {
        match written.get(&item.idempotency_key) {
            Some(back) if back == item => {}
            Some(_) => {
                return Err(mismatch(format!(
                    "item {:?} reads back different",
                    item.idempotency_key
                )));
            }
            None => {
                return Err(mismatch(format!(
                    "item {:?} is missing",
                    item.idempotency_key
                )));
            }
        }
    }
    let lines = tx
        .query(&format!("SELECT line FROM {s}.audit ORDER BY seq"), &[])
        .map_err(db("read the migrated audit log"))?;
    let lines: Vec<String> = lines.iter().map(|row| row.get(0)).collect();
    if lines.len() != import.audit.len() {
        return Err(mismatch(format!(
            "{} audit records written, {} in the source",
            lines.len(),
            import.audit.len()
        )));
    }
    for (back, (head, line)) in lines.iter().zip(import.audit) {
        if back.as_bytes() != line.as_slice() {
            return Err(mismatch(format!(
                "audit record {} reads back different",
                head.seq
            )));
        }
    }
    let row = tx
        .query_one(
            &format!("SELECT seq, hash FROM {s}.audit_head WHERE id = 1"),
            &[],
        )
        .map_err(db("read the audit head"))?;
    let recorded = Head {
        seq: u64::try_from(row.get::<_, i64>(0)).unwrap_or(0),
        hash: row.get(1),
    };
    let report = crate::audit::verify_lines(
        &PathBuf::from(format!("postgres:{schema_name}.audit")),
        lines.iter().map(String::as_bytes),
        import.hasher,
        &recorded,
    )?;
    if report.head_seq != import.head.seq || report.head_hash != import.head.hash {
        return Err(mismatch(format!(
            "the migrated audit head is {} {}, the source's {} {}",
            report.head_seq, report.head_hash, import.head.seq, import.head.hash
        )));
    }
    Ok(())
}
