//! How an item is written to a row of `items`: the statement texts and their
//! parameters, shared by every writer (`PgEngine::put` for the rules'
//! inserts and updates, the migration's import for its inserts), so a column
//! added to the table is written by all of them or by none.

use chrono::{DateTime, Utc};
use postgres::Row;
use postgres::types::ToSql;

use crate::item::OutboxItem;
use crate::store::item_to_json;

/// `INSERT INTO <s>.items …` for one item, with the parameters of
/// [`NewRow::params`]. The place in line (`seq`) is the item's own when it
/// has one (a migrated item, a requeue keeps its key's row), else the next of
/// the schema's `enqueue_seq`. An existing row with the same key is left as
/// it is: the statement then writes no row, and the caller decides what that
/// means (a conflict for `put`, a failed copy for the import).
pub(super) fn insert_item_sql(s: &str) -> String {
    format!(
        "{}\n         ON CONFLICT (idempotency_key) DO NOTHING",
        strict_insert_item_sql(s)
    )
}

/// As [`insert_item_sql`], but an existing row with the same key fails the
/// statement (and so its transaction): for a writer that sends its `COMMIT`
/// with the insert, before it could see a row count.
pub(super) fn strict_insert_item_sql(s: &str) -> String {
    format!(
        "INSERT INTO {s}.items (idempotency_key, revision, destination, state,
           claimed, claim_owner, next_attempt_at, transport_ref, doc, seq,
           created_at, updated_at)
         VALUES ($1, 1, $2, $3, $4, $5, $6, $7, $8,
           COALESCE($9, nextval('{s}.enqueue_seq')), $10, $11)"
    )
}

/// `UPDATE <s>.items …` of one item's row, if it is still at the revision
/// the writer read, with the parameters of [`NewRow::update_params`]: the
/// same columns as [`insert_item_sql`], and the revision bumped. A row at
/// another revision is left as it is (no row written: a conflict). An item
/// without a place in line keeps the row's.
pub(super) fn update_item_sql(s: &str) -> String {
    format!(
        "UPDATE {s}.items SET revision = revision + 1, destination = $2,
           state = $3, claimed = $4, claim_owner = $5, next_attempt_at = $6,
           transport_ref = $7, doc = $8, seq = COALESCE($9, seq),
           created_at = $10, updated_at = $11
         WHERE idempotency_key = $1 AND revision = $12"
    )
}

/// The column values of one item's row.
pub(super) struct NewRow<'a> {
    item: &'a OutboxItem,
    state: &'static str,
    claimed: bool,
    owner: Option<&'a str>,
    doc: String,
    seq: Option<i64>,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
}

impl<'a> NewRow<'a> {
    /// The row `item` is stored as: its JSON document and the columns that
    /// claims, lookups and history filter on.
    pub(super) fn of(item: &'a OutboxItem) -> Self {
        Self {
            item,
            state: item.state.as_str(),
            claimed: item.claim.is_some(),
            owner: item.claim_owner(),
            doc: String::from_utf8_lossy(&item_to_json(item)).into_owned(),
            seq: item.seq.and_then(|seq| i64::try_from(seq).ok()),
            created_at: item.created_at,
            updated_at: item.updated_at,
        }
    }

    /// The parameters of [`update_item_sql`]: those of the insert, then the
    /// revision the writer read.
    pub(super) fn update_params<'p>(&'p self, revision: &'p i64) -> [&'p (dyn ToSql + Sync); 12] {
        let mut params: [&(dyn ToSql + Sync); 12] = [revision; 12];
        params[..11].copy_from_slice(&self.params());
        params
    }

    /// The parameters of [`insert_item_sql`], in its order.
    pub(super) fn params(&self) -> [&(dyn ToSql + Sync); 11] {
        [
            &self.item.idempotency_key,
            &self.item.destination,
            &self.state,
            &self.claimed,
            &self.owner,
            &self.item.next_attempt_at,
            &self.item.transport_ref,
            &self.doc,
            &self.seq,
            &self.created_at,
            &self.updated_at,
        ]
    }
}

/// The columns of `items` a row holds besides its document, read back by
/// [`column_disagreeing`].
pub(super) const COLUMNS: &str = "destination, state, claimed, claim_owner, next_attempt_at, \
     transport_ref, created_at, updated_at";

/// The first column of `row` (selected with [`COLUMNS`], by name) that is not
/// what [`NewRow::of`] writes for `item`, if any: the columns claims, lookups
/// and history filter on must say what the document says.
pub(super) fn column_disagreeing(row: &Row, item: &OutboxItem) -> Option<&'static str> {
    let expected = NewRow::of(item);
    if row.get::<_, &str>("destination") != item.destination {
        Some("destination")
    } else if row.get::<_, &str>("state") != expected.state {
        Some("state")
    } else if row.get::<_, bool>("claimed") != expected.claimed {
        Some("claimed")
    } else if row.get::<_, Option<&str>>("claim_owner") != expected.owner {
        Some("claim_owner")
    } else if row.get::<_, Option<DateTime<Utc>>>("next_attempt_at") != item.next_attempt_at {
        Some("next_attempt_at")
    } else if row.get::<_, Option<&str>>("transport_ref") != item.transport_ref.as_deref() {
        Some("transport_ref")
    } else if row.get::<_, DateTime<Utc>>("created_at") != expected.created_at {
        Some("created_at")
    } else if row.get::<_, DateTime<Utc>>("updated_at") != expected.updated_at {
        Some("updated_at")
    } else {
        None
    }
}
