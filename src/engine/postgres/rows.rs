//! How an item is written to a row of `items`: the statement texts and their
//! parameters, shared by every writer (`PgEngine::put` for the rules'
//! inserts and updates, the migration's import for its inserts), so a column
//! added to the table is written by all of them or by none.

use chrono::{DateTime, Utc};
use postgres::Row;
use postgres::types::ToSql;

use super::super::Expect;
use crate::item::OutboxItem;
use crate::store::{item_to_json, rate_times};

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

/// One item's write, ready to run: its row (an `INSERT`, or an `UPDATE` of
/// the revision read) and, when they changed since
/// `before`, its send times (`rate_times`) and its destination's cooldown
/// (`cooldowns`, only ever raised).
pub(crate) struct ItemWrite<'i> {
    row: NewRow<'i>,
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
            row: NewRow::of(item),
            revision: match expect {
                Expect::Absent => None,
                Expect::Revision(revision) => Some(i64::try_from(revision).unwrap_or(i64::MAX)),
            },
            times: (!nothing_to_write).then_some(times),
            cooldown: item.cooldown_until.filter(|_| !cooldown_unchanged),
        }
    }

    /// The document the row's write stores (the item's JSON).
    pub(crate) fn doc(&self) -> &str {
        &self.row.doc
    }

    /// This write as one statement in schema `s` (quoted): the row's
    /// `INSERT` or `UPDATE`, with the send times, the cooldown and `pending`
    /// audit events (documents from `pending_docs`, inserted in order) as
    /// data-modifying `WITH` parts of it. The statement's row count is the
    /// row write's. One statement, not one per table: each statement costs
    /// the server and the client a round of parse-free but still real work
    /// (bind, executor start and end, a reply), which was most of the CPU an
    /// item took. The parts touch different tables, so the one snapshot they
    /// share changes nothing they write. An insert of a `strict` write fails
    /// on a row that exists (its transaction aborts) instead of inserting
    /// nothing.
    pub(crate) fn statement<'p>(
        &'p self,
        s: &str,
        strict: bool,
        pending: Option<&'p Vec<String>>,
    ) -> Statement<'p> {
        let (parts, main, params, op) = self.parts(s, strict, pending);
        let sql = if parts.is_empty() {
            main
        } else {
            format!("WITH {}\n{main}", parts.join(",\n"))
        };
        (sql, params, op)
    }

    /// This write as [`statement`](Self::statement) writes an update, but
    /// failing its transaction (division by zero, SQLSTATE `22012`) when the
    /// row is not the version expected, so that a `COMMIT` sent with it
    /// commits nothing of it (see [`speculate`](super::speculate)): its
    /// other parts run only with the row's update, and the statement
    /// returns one row. An insert fails on a row that exists instead (as
    /// a `strict` one).
    ///
    /// The version is the revision and `seq`, the place in line its enqueue
    /// took (never taken twice): a revision alone names a version of one
    /// row, and the key's row may have been replaced meanwhile by another
    /// that reached the same revision (a terminal item pruned by retention,
    /// then enqueued and claimed anew: revisions 1 and 2 again).
    pub(crate) fn guarded_statement<'p>(
        &'p self,
        s: &str,
        pending: &'p Vec<String>,
        seq: &'p i64,
    ) -> Statement<'p> {
        let (mut parts, main, mut params, op) = self.parts(s, true, Some(pending));
        let main = if self.revision.is_some() {
            params.push(seq);
            format!("{main} AND seq = ${}", params.len())
        } else {
            main
        };
        parts.push(format!("written AS ({main}\n RETURNING 1)"));
        let sql = format!(
            "WITH {}\nSELECT 1 / count(*) FROM written",
            parts.join(",\n")
        );
        (sql, params, op)
    }

    /// The parts of this write's statement: its data-modifying `WITH` parts,
    /// the row's write, their parameters and the operation's name.
    fn parts<'p>(
        &'p self,
        s: &str,
        strict: bool,
        pending: Option<&'p Vec<String>>,
    ) -> (
        Vec<String>,
        String,
        Vec<&'p (dyn postgres::types::ToSql + Sync)>,
        &'static str,
    ) {
        let (main, mut params, op) = match &self.revision {
            None => (
                if strict {
                    strict_insert_item_sql(s)
                } else {
                    insert_item_sql(s)
                },
                self.row.params().to_vec(),
                "insert an item",
            ),
            Some(revision) => (
                update_item_sql(s),
                self.row.update_params(revision).to_vec(),
                "update an item",
            ),
        };
        // `$1` is the item's key and `$2` its destination in both forms.
        let mut parts: Vec<String> = Vec::with_capacity(4);
        if let Some(times) = &self.times {
            // `gone` drops the rows of times the item no longer has; `added`
            // writes every time it has, and `ON CONFLICT DO NOTHING` skips
            // those already stored (the rows `gone` keeps: both parts read
            // the statement's snapshot, so `added` still sees them). `gone`
            // only ever keeps a row `added` also wants, so the two remove and
            // add disjoint sets of rows, in whichever order PostgreSQL runs
            // them (neither is read by the statement). That holds because a
            // key's destination never changes (an enqueue of a key names the
            // same message, or is refused): were it to change, a time kept
            // under the old destination would be skipped by `added` and then
            // deleted by `gone` if it ran after, losing the send from the new
            // destination's window.
            params.push(times);
            let n = params.len();
            parts.push(format!(
                "gone AS (DELETE FROM {s}.rate_times
                   WHERE idempotency_key = $1 AND NOT (at = ANY(${n}) AND destination = $2)),
                 added AS (INSERT INTO {s}.rate_times (idempotency_key, destination, at)
                   SELECT $1, $2, t FROM unnest(${n}::timestamptz[]) AS t
                   ON CONFLICT DO NOTHING)"
            ));
        }
        if let Some(until) = &self.cooldown {
            // The cooldown belongs to the destination: only ever raised.
            params.push(until);
            let n = params.len();
            parts.push(format!(
                "cooled AS (INSERT INTO {s}.cooldowns (destination, until) VALUES ($2, ${n})
                   ON CONFLICT (destination) DO UPDATE
                   SET until = GREATEST({s}.cooldowns.until, EXCLUDED.until))"
            ));
        }
        if let Some(docs) = pending.filter(|docs| !docs.is_empty()) {
            params.push(docs);
            let n = params.len();
            parts.push(format!("pended AS ({})", pending_insert_sql(s, n)));
        }
        (parts, main, params, op)
    }
}

/// Inserts pending audit events (parameter `$n`: their documents, from
/// `pending_docs`) into `audit_pending` in order: their ids, from the
/// table's sequence, follow the order given.
pub(super) fn pending_insert_sql(s: &str, n: usize) -> String {
    format!(
        "INSERT INTO {s}.audit_pending (event)
         SELECT doc FROM unnest(${n}::text[]) WITH ORDINALITY AS t(doc, n) ORDER BY n"
    )
}
