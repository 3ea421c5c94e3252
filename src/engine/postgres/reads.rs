//! Reads of items outside the rules' transactions: one item, the live list,
//! history, lookups by transport reference, what is due, and the inputs of
//! the rate windows.

use std::path::PathBuf;

use chrono::{DateTime, Utc};

use super::super::Versioned;
use super::conn::Row;
use super::{PgEngine, db};
use crate::error::Result;
use crate::item::OutboxItem;
use crate::store::item_from_json;

impl PgEngine {
    pub(super) fn place(&self) -> PathBuf {
        PathBuf::from(format!("postgres:{}.items", self.schema))
    }

    /// An item from a row of `idempotency_key, revision, doc, seq`. The
    /// sequence is the row's: one sequence across every host.
    pub(super) fn versioned(&self, row: &Row) -> Result<Versioned> {
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

    fn items_where(
        &self,
        condition: &str,
        params: &[&(dyn postgres::types::ToSql + Sync)],
    ) -> Result<Vec<OutboxItem>> {
        let sql = format!(
            "SELECT idempotency_key, revision, doc, seq FROM {}.items WHERE {condition}",
            self.s
        );
        let rows = self.read(|client| client.query(&sql, params).map_err(db("read items")))?;
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
        let sql = format!(
            "SELECT idempotency_key FROM {}.items
             WHERE state = 'queued' AND (next_attempt_at IS NULL OR next_attempt_at <= $1)
             ORDER BY created_at, idempotency_key",
            self.s
        );
        let rows = self.read(|client| {
            client
                .query(&sql, &[&now])
                .map_err(db("read the due items"))
        })?;
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
        let first = format!(
            "SELECT min(LEAST(COALESCE(next_attempt_at, $1), $1)) FILTER (WHERE next_attempt_at IS NULL),
                    min(next_attempt_at) FILTER (WHERE next_attempt_at IS NOT NULL)
             FROM {scope} h WHERE NOT h.claimed"
        );
        let claims = format!(
            "SELECT EXISTS (SELECT 1 FROM {s}.items WHERE state = 'queued' AND claimed
               AND claim_owner IS DISTINCT FROM $1)"
        );
        let (fresh, deferred, foreign) = self.read(|client| {
            let row = client
                .query_one(&first, &[&now])
                .map_err(db("read when the next item is due"))?;
            let fresh: Option<DateTime<Utc>> = row.get(0);
            let deferred: Option<DateTime<Utc>> = row.get(1);
            let foreign: bool = client
                .query_one(&claims, &[&self.owner])
                .map_err(db("read the claims"))?
                .get(0);
            Ok((fresh, deferred, foreign))
        })?;
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
}
