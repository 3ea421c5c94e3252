//! Items the library has moved out of the live state into `history/`.
//!
//! After `history_after` (a day by default) sent and failed items leave the
//! live state: `Outbox::list_items` no longer lists them, though `get` still
//! finds each one by key. The library has no call that lists them, so the tool
//! learns their keys from the audit log, where every item that was ever touched
//! has a record, and fetches each with `get`. An item the Python reference wrote
//! and nobody touched since has no record, so it cannot be listed this way.

use std::collections::HashSet;

use durable_outbox::{AuditLog, AuditRecord, Head, Outbox, OutboxItem, Result};

/// Reads the audit log in order, up to a given sequence number and no further.
///
/// Records up to the head the outbox reported are complete on disk (they are
/// appended under the lock before the head moves), while a line past it may be
/// half-written by a running bot, so reading stops exactly at the target and can
/// later continue to a newer one.
pub struct LogReader {
    records: durable_outbox::AuditChainRecords,
    /// The seq of the last record read (0 before the first).
    pub seq: u64,
}

impl LogReader {
    pub fn open(outbox: &Outbox) -> Result<Self> {
        Ok(Self {
            records: AuditLog::records_dir(outbox.dir())?,
            seq: 0,
        })
    }

    /// Calls `each` with every record after the last one read, up to `head.seq`.
    pub fn read_to(&mut self, head: &Head, mut each: impl FnMut(AuditRecord)) -> Result<()> {
        while self.seq < head.seq {
            let Some(record) = self.records.next() else {
                break; // shorter than the head said: verification reports it
            };
            let record = record?;
            self.seq = record.seq;
            each(record);
        }
        Ok(())
    }
}

/// Every item that has left the live state and has an audit record, in key order.
/// `live` are the live items (their keys are skipped).
pub fn items(outbox: &Outbox, live: &[OutboxItem]) -> Result<Vec<OutboxItem>> {
    if outbox.history_len()? == 0 {
        return Ok(Vec::new());
    }
    let live: HashSet<&str> = live.iter().map(OutboxItem::idempotency_key).collect();
    let mut keys: HashSet<String> = HashSet::new();
    let head = outbox.audit_head()?;
    LogReader::open(outbox)?.read_to(&head, |record| {
        if !live.contains(record.idempotency_key.as_str()) {
            keys.insert(record.idempotency_key);
        }
    })?;
    let mut keys: Vec<String> = keys.into_iter().collect();
    keys.sort_unstable();
    let mut items = Vec::with_capacity(keys.len());
    for key in keys {
        if let Some(item) = outbox.get(&key)? {
            items.push(item);
        }
    }
    Ok(items)
}
