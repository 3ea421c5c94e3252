//! Stored settings on PostgreSQL: the one `settings` row (the same JSON
//! object `outbox.json` stores under `"settings"`), read inside a
//! transaction, and settled on open with a `settings` audit record.

use std::path::PathBuf;

use chrono::{DateTime, Utc};

use super::conn::Tx;
use super::{PgEngine, db};
use crate::audit::AuditOutcome;
use crate::error::Result;
use crate::rules::record::system_event_of;
use crate::settings::{Settings, Stored};
use crate::store::{settings_from_json, settings_to_json};

impl PgEngine {
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
    pub(super) fn stored_of(&self, doc: Option<String>) -> Result<Stored> {
        match doc {
            None => Ok(Stored::default()),
            Some(doc) => settings_from_json(&self.settings_place(), "row 1", &doc),
        }
    }

    /// The stored settings, as last committed.
    pub(crate) fn stored_settings(&self) -> Result<Stored> {
        self.read(|client| {
            let mut tx = client.begin();
            let stored = self.read_settings(&mut tx)?;
            tx.commit().map_err(db("end a read"))?;
            Ok(stored)
        })
    }

    /// Applies the settings rules of `settings::plan` on open: a new outbox
    /// stores every value of the opening handle at once (no audit record: the
    /// first state, not a change); values set explicitly on an outbox that
    /// lacks them, or with `update_settings`, are stored with a `settings`
    /// audit record; a builder value a stored one overrides is logged.
    ///
    /// A handle that only looks (`looking`: opened with
    /// `compact_on_open(false)`, as the operator's tool and a monitoring probe
    /// are) stores nothing for a new outbox: on the file engine a new
    /// outbox's settings go with the handle's first change, which such a
    /// handle never makes, so the tool's defaults never take the place of
    /// those of the bot that opens after it.
    pub(crate) fn settle_settings(
        &self,
        defaults: &Settings,
        explicit: &Stored,
        update: bool,
        looking: bool,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let mut client = self.client()?;
        let mut tx = client.begin();
        let s = &self.s;
        // Pending events go on the chain first: this record comes after them.
        let head = self.begin_outbox_write(&mut tx)?;
        let stored = self.read_settings(&mut tx)?;
        let items: i64 = tx
            .query_one(&format!("SELECT count(*) FROM {s}.items"), &[])
            .map_err(db("count items"))?
            .get(0);
        let new_outbox = items == 0 && head.seq == 0;
        if new_outbox && looking && stored.is_empty() {
            return tx.commit().map_err(db("end a read"));
        }
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
            let event = system_event_of(
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
}
