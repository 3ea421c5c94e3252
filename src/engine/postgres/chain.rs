//! Reads of the audit chain: its head, verification, one key's records and
//! the pages `Outbox::audit_records` streams. Each seals what is pending
//! first and waits for the head (see [`sealing`](super::sealing)), so what
//! it returns is durable.
//!
//! **Where the chain starts.** The `audit` table holds the chain from seq 1,
//! or, after an operator removed old records
//! ([`PgEngine::remove_old_audit_segments`], in `retention`), from the record
//! after the last removed one. No anchor is stored apart from the chain: the
//! removal's own `pruned` record (subject `audit-segments`), sealed into the
//! chain like every record before the rows went, names the last removed
//! record's seq and hash, and the first remaining row links to exactly that
//! (its `seq` one more, its `prev_hash` that hash). Verification starts at
//! the first row and requires that record (`audit::verify_lines`): rows
//! deleted from the front by hand, past a removal or without one, leave a
//! start that no record names ([`AuditFault::FrontCut`](crate::AuditFault::FrontCut)),
//! and the head row catches a cut tail. An export (`audit_records`, the
//! CLI's `export --audit`) is the same rows, so the offline verifier
//! ([`AuditLog::verify`](crate::AuditLog::verify), `fixtures/verify_audit.py`)
//! checks it the same way.

use std::path::PathBuf;

use super::conn::Row;
use super::{PgEngine, db};
use crate::audit::{AuditRecord, AuditReport, Head};
use crate::error::{Error, Result};

/// How many audit records one page of `Outbox::audit_records` reads.
pub(crate) const AUDIT_PAGE: i64 = 1_000;

/// How many audit rows `verify_audit` reads per statement.
const VERIFY_PAGE: i64 = 1_000;

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
        self.make_reads_durable(&mut client)?;
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
        self.make_reads_durable(&mut client)?;
        Ok(Head {
            seq: u64::try_from(row.get::<_, i64>(0)).unwrap_or(0),
            hash: row.get(1),
        })
    }

    /// Verifies the whole chain in the `audit` table, as the file verifier
    /// checks `audit.jsonl`, from its first row (seq 1, or the start a
    /// removal's record names: see the module docs), and against the head row
    /// (a cut-off tail is found). One consistent snapshot (a repeatable-read
    /// transaction), read in pages of [`VERIFY_PAGE`] rows keyed by seq:
    /// memory stays bounded however long the history.
    pub(crate) fn verify_audit(&self) -> Result<AuditReport> {
        self.verify_audit_in_pages(VERIFY_PAGE)
            .map(|(report, _)| report)
    }

    /// [`verify_audit`](Self::verify_audit) reading `page` rows at a time;
    /// also the most rows one statement returned.
    pub(super) fn verify_audit_in_pages(&self, page: i64) -> Result<(AuditReport, usize)> {
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
        // The first page from the lowest key, whatever it is: rows keyed 0
        // or below are not the chain's, and the verifier must see them to
        // call the chain broken, as a scan of the whole table does.
        let first = format!(
            "SELECT seq, line FROM {}.audit ORDER BY seq LIMIT $1",
            self.s
        );
        let next = format!(
            "SELECT seq, line FROM {}.audit WHERE seq > $1 ORDER BY seq LIMIT $2",
            self.s
        );
        let mut failed = None;
        let mut largest = 0;
        let mut ready = std::collections::VecDeque::new();
        let mut after: Option<i64> = None;
        let mut done = false;
        let lines = std::iter::from_fn(|| {
            loop {
                if let Some(line) = ready.pop_front() {
                    return Some(line);
                }
                if done {
                    return None;
                }
                let rows = match after {
                    None => tx.query(&first, &[&page]),
                    Some(after) => tx.query(&next, &[&after, &page]),
                };
                match rows {
                    Ok(rows) => {
                        largest = largest.max(rows.len());
                        done = i64::try_from(rows.len()).map_or(true, |n| n < page);
                        for row in rows {
                            after = Some(row.get(0));
                            ready.push_back(row.get::<_, String>(1));
                        }
                    }
                    Err(e) => {
                        failed = Some(db("read the audit log")(e));
                        return None;
                    }
                }
            }
        });
        let place = PathBuf::from(format!("postgres:{}.audit", self.schema));
        let report = crate::audit::verify_lines(&place, lines, &self.hasher, &expected);
        // A page that could not be read ends the lines early: that is the
        // answer, not the truncation the verifier would report.
        if let Some(e) = failed {
            return Err(e);
        }
        tx.commit().map_err(db("end verifying the audit log"))?;
        self.make_reads_durable(&mut client)?;
        report.map(|report| (report, largest))
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
        self.make_reads_durable(&mut client)?;
        rows.iter().map(|row| self.record_of_row(row)).collect()
    }
}

#[cfg(test)]
mod tests;
