//! Reads of the audit chain: its head, verification, one key's records and
//! the pages `Outbox::audit_records` streams. Each seals what is pending
//! first and waits for the head (see [`sealing`](super::sealing)), so what
//! it returns is durable.

use std::path::PathBuf;

use postgres::Row;

use super::{PgEngine, db};
use crate::audit::{AuditRecord, AuditReport, Head};
use crate::error::{Error, Result};

/// How many audit records one page of `Outbox::audit_records` reads.
pub(crate) const AUDIT_PAGE: i64 = 1_000;

impl PgEngine {
    /// Every audit record about `key`, oldest first.
    pub(crate) fn records_of(&self, key: &str) -> Result<Vec<AuditRecord>> {
        let mut client = self.sealed_client()?;
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
        let mut client = self.sealed_client()?;
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
        let mut client = self.sealed_client()?;
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

    /// Up to `limit` of the audit chain's records with `seq` above `after`,
    /// in order (sealing what is pending first): one page of a chain read in
    /// bounded memory, keyed by seq.
    pub(crate) fn audit_page(&self, after: u64, limit: i64) -> Result<Vec<AuditRecord>> {
        let mut client = self.sealed_client()?;
        let rows = client
            .query(
                &format!(
                    "SELECT seq, line FROM {}.audit WHERE seq > $1 ORDER BY seq LIMIT $2",
                    self.s
                ),
                &[&i64::try_from(after).unwrap_or(i64::MAX), &limit],
            )
            .map_err(db("read the audit log"))?;
        rows.iter().map(|row| self.record_of_row(row)).collect()
    }
}
