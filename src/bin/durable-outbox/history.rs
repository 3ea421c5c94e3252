//! Items the library has moved out of the live state into `history/`.
//!
//! After `history_after` (a day by default) sent and failed items leave the
//! live state: `Outbox::list_items` no longer lists them, `Outbox::history_items`
//! streams them from the history segments, and `get` still finds each one by key.

use std::collections::HashSet;

use durable_outbox::{AuditRecord, Head, Outbox, OutboxItem, Result};

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
    /// The seq of the first record read (0 before the first): more than 1
    /// when an operator removed old audit records.
    pub first_seq: u64,
}

impl LogReader {
    pub fn open(outbox: &Outbox) -> Result<Self> {
        Ok(Self {
            records: outbox.audit_records()?,
            seq: 0,
            first_seq: 0,
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
            if self.first_seq == 0 {
                self.first_seq = record.seq;
            }
            each(record);
        }
        Ok(())
    }
}

/// Every item that has left the live state, in key order. `live` are the live
/// items (their keys are skipped: the live copy is the current one). An item that
/// moved to history more than once (requeued in between) is listed as its newest copy.
pub fn items(outbox: &Outbox, live: &[OutboxItem]) -> Result<Vec<OutboxItem>> {
    let live: HashSet<&str> = live.iter().map(OutboxItem::idempotency_key).collect();
    let mut newest: std::collections::BTreeMap<String, OutboxItem> =
        std::collections::BTreeMap::new();
    for item in outbox.history_items()? {
        let item = item?;
        if !live.contains(item.idempotency_key()) {
            // Segments come oldest first: a later copy replaces an earlier one.
            newest.insert(item.idempotency_key().to_owned(), item);
        }
    }
    Ok(newest.into_values().collect())
}
