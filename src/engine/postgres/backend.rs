//! What an `Outbox` handle asks of its PostgreSQL engine: the same calls as
//! `engine::file::FileEngine`, so `Outbox` dispatches to either with one arm.
//!
//! **History on PostgreSQL.** The file engine moves terminal items out of its
//! in-memory state into history segments, because every handle keeps the live
//! state in memory and replays it. Here nothing is held in memory and every
//! lookup is an index scan, so moving rows would cost writes and buy nothing:
//! terminal items stay in `items`, and "history" is the view of those last
//! changed more than `history_after` ago and outside every rate window
//! (`Settings::history_cutoff`, the file engine's rule; `list_items` leaves them out,
//! `history_items` lists them, `get` and the transport-ref lookups find both).
//! Retention applies on open (unless the handle was opened with
//! `compact_on_open(false)`, as a tool that only looks is) and on `compact`
//! (as the file engine's compaction, which runs on open too): under `history_retention`
//! `MaxAge(age)` the terminal items last changed longer ago than `age` are
//! deleted, with one `pruned` audit record; `MaxSegments` has no segments to
//! count here and keeps everything (logged).

use std::sync::Arc;

use chrono::{DateTime, Utc};

use super::connect::blocking_local;
use super::{PgEngine, PgTxn, blocking};
use crate::audit::{AuditRecord, AuditReport, Hasher, Head};
use crate::builder::OutboxBuilder;
use crate::clock::{Clock, earlier};
use crate::engine::file::DueSummary;
use crate::error::{Error, Result};
use crate::filter::ItemFilter;
use crate::item::{ItemState, OutboxItem};
use crate::rate::{DestinationWindow, RateLimit};
use crate::receipt::{DeliveryReceipt, DrainReport, Outcome};
use crate::rules::txn::{Scope, Wait};
use crate::settings::Settings;

/// The engine's name in errors about operations it does not offer.
pub(crate) const ENGINE: &str = "postgres";

/// An open PostgreSQL outbox, as a handle uses it.
pub(crate) struct PgBackend {
    /// Always `Some` until dropped (taken out to close its connections where
    /// the client may block, see [`blocking`]).
    engine: Option<PgEngine>,
    /// This handle's builder values of the stored settings.
    defaults: Settings,
    clock: Arc<dyn Clock>,
    /// The handle's `audit_rotate_bytes`: the size of the segments an
    /// operator's removal of old audit records counts in (see
    /// `retention::Segments`).
    audit_segment_bytes: u64,
}

impl PgBackend {
    /// Opens the outbox the builder names (see [`OutboxBuilder::open`]).
    pub(crate) fn open(builder: &mut OutboxBuilder) -> Result<Self> {
        let Some(target) = builder.postgres.clone() else {
            return Err(Error::invalid_config("url", "no PostgreSQL URL was given"));
        };
        let hasher = builder
            .audit_key
            .take()
            .map_or(Hasher::Plain, Hasher::Keyed);
        let max_connections = builder.max_connections.unwrap_or(super::MAX_CONNECTIONS);
        let versioning = super::Versioning {
            #[cfg(any(test, feature = "test-failpoints"))]
            target: builder
                .schema_version_for_tests
                .unwrap_or(super::SCHEMA_VERSION),
            #[cfg(not(any(test, feature = "test-failpoints")))]
            target: super::SCHEMA_VERSION,
            upgrade: builder.upgrade_schema.unwrap_or(true),
        };
        let engine = blocking(|| {
            PgEngine::open_capped(
                &target.url,
                &target.schema,
                hasher,
                builder.create,
                versioning,
                max_connections,
            )
        })?;
        #[cfg(any(test, feature = "test-failpoints"))]
        for (name, action) in &builder.failpoints {
            engine.faults.arm(name, *action);
        }
        let defaults = builder.handle_settings();
        let now = builder.clock.now();
        blocking(|| {
            super::retry::retrying("storing the settings", |_| {
                engine.settle_settings(
                    &defaults,
                    &builder.explicit,
                    builder.update_settings,
                    !builder.compact_on_open,
                    now,
                )
            })
        })?;
        // Like the file engine's compaction on open: history past
        // `history_retention` goes now; and, as there, not for a handle that
        // only looks (`compact_on_open(false)`: the operator's tool, a probe).
        if builder.compact_on_open {
            let settings = defaults.with_stored(&blocking(|| engine.stored_settings())?);
            blocking(|| {
                super::retry::retrying("a retention prune", |_| {
                    engine.apply_retention(&settings, now)
                })
            })?;
        }
        Ok(Self {
            engine: Some(engine),
            defaults,
            clock: Arc::clone(&builder.clock),
            audit_segment_bytes: builder.audit_rotate_bytes,
        })
    }

    /// The engine underneath (liveness, wake-ups).
    pub(crate) fn engine(&self) -> &PgEngine {
        match &self.engine {
            Some(engine) => engine,
            None => unreachable!("taken only when dropped"),
        }
    }

    /// The schema the outbox lives in.
    pub(crate) fn schema(&self) -> &str {
        self.engine().schema()
    }

    /// This handle's owner id.
    pub(crate) fn owner_id(&self) -> &str {
        &self.engine().owner
    }

    /// This handle's builder values of the stored settings.
    pub(crate) fn defaults(&self) -> &Settings {
        &self.defaults
    }

    /// No fault points on PostgreSQL.
    #[expect(
        clippy::unnecessary_wraps,
        clippy::unused_self,
        reason = "the same call as the file engine's, whose fault point can fail"
    )]
    pub(crate) fn check_after_send(&self) -> Result<()> {
        Ok(())
    }

    /// Runs one transaction of the rules (again, from the start, when the
    /// server aborted it to break a deadlock: see `PgEngine::transact_waiting`),
    /// waiting for a connection of the cap as `wait` says.
    pub(crate) fn transact<T>(
        &self,
        scope: Scope<'_>,
        wait: Wait,
        f: impl FnMut(&mut PgTxn<'_, '_>) -> Result<T>,
    ) -> Result<T> {
        blocking_local(|| {
            self.engine()
                .transact_waiting(self.clock.now(), &self.defaults, scope, wait, f)
        })
    }

    /// The item with this key, live or history.
    pub(crate) fn get(&self, key: &str) -> Result<Option<OutboxItem>> {
        blocking(|| self.engine().item(key))
    }

    /// When terminal items count as history (`Settings::history_cutoff`).
    fn history_cutoff(&self) -> Result<DateTime<Utc>> {
        Ok(self.settings()?.history_cutoff(self.clock.now()))
    }

    /// Live items (matching `filter`), sorted by key.
    pub(crate) fn list(&self, filter: Option<&ItemFilter>) -> Result<Vec<OutboxItem>> {
        let cutoff = self.history_cutoff()?;
        let mut items = blocking(|| self.engine().live_items(cutoff))?;
        if let Some(filter) = filter {
            items.retain(|item| filter.matches(item));
        }
        Ok(items)
    }

    /// Terminal items past `history_after`, oldest first.
    pub(crate) fn history_items(&self) -> Result<crate::history::HistoryItems> {
        let cutoff = self.history_cutoff()?;
        Ok(crate::history::HistoryItems::of(blocking(|| {
            self.engine().history_items(cutoff)
        })?))
    }

    /// How many items are history.
    pub(crate) fn history_len(&self) -> Result<usize> {
        let cutoff = self.history_cutoff()?;
        Ok(blocking(|| self.engine().history_items(cutoff))?.len())
    }

    /// The item whose send returned `transport_ref` (to `destination`).
    pub(crate) fn find_by_transport_ref(
        &self,
        destination: Option<&str>,
        transport_ref: &str,
    ) -> Result<Option<OutboxItem>> {
        blocking(|| self.engine().find_ref(destination, transport_ref))
    }

    /// Adds a `Waiting` receipt for each of `keys` still queued and unclaimed.
    pub(crate) fn report_waiting(&self, keys: &[String], report: &mut DrainReport) -> Result<()> {
        for key in keys {
            if let Some(item) = blocking(|| self.engine().item(key))?
                && item.state == ItemState::Queued
                && item.claim.is_none()
            {
                report.add(
                    DeliveryReceipt::for_item(&item, Outcome::Waiting, None),
                    false,
                );
            }
        }
        Ok(())
    }

    /// When the next item is due, and whether another handle's claim holds a line.
    pub(crate) fn due_summary(&self, _own: &str, now: DateTime<Utc>) -> Result<DueSummary> {
        let ordering = self.settings()?.ordering;
        let (next_due, foreign_claim) = blocking(|| self.engine().due_summary(ordering, now))?;
        Ok(DueSummary {
            next_due,
            foreign_claim,
        })
    }

    /// The keys of the items due at `now`, oldest first.
    pub(crate) fn due_keys(&self, now: DateTime<Utc>) -> Result<Vec<String>> {
        blocking(|| self.engine().due_keys(now))
    }

    /// Sets the queue gauges from the queued items.
    #[cfg(feature = "metrics")]
    pub(crate) fn publish_gauges(&self, now: DateTime<Utc>) -> Result<()> {
        let queued = blocking(|| self.engine().live_items(now))?;
        crate::metrics::gauges(queued.iter(), now);
        Ok(())
    }

    /// The settings in force.
    pub(crate) fn settings(&self) -> Result<Settings> {
        let stored = blocking(|| self.engine().stored_settings())?;
        Ok(self.defaults.with_stored(&stored))
    }

    /// Every destination with something in its rate window, something
    /// queued, or a cooldown, measured at `now` against its cap (or
    /// `what_if`), sorted by destination: as the file engine measures it.
    pub(crate) fn rate_windows(
        &self,
        what_if: Option<RateLimit>,
        now: DateTime<Utc>,
    ) -> Result<Vec<DestinationWindow>> {
        let settings = self.settings()?;
        let longest = what_if.map_or_else(|| settings.rates.longest_window(), |cap| cap.window);
        let (queued, times, cooldowns) =
            blocking(|| self.engine().rate_inputs(earlier(now, longest), now))?;
        let mut destinations: std::collections::BTreeSet<&String> = queued.keys().collect();
        destinations.extend(times.keys());
        destinations.extend(cooldowns.keys());
        Ok(destinations
            .into_iter()
            .filter_map(|destination| {
                let cap = what_if.unwrap_or_else(|| settings.rate_limit_for(destination));
                let cutoff = earlier(now, cap.window);
                let in_window: Vec<DateTime<Utc>> = times
                    .get(destination)
                    .into_iter()
                    .flatten()
                    .copied()
                    .filter(|at| *at > cutoff)
                    .collect();
                let queued = queued.get(destination).copied().unwrap_or(0);
                let cooldown_until = cooldowns.get(destination).copied();
                (queued > 0 || !in_window.is_empty() || cooldown_until.is_some()).then(|| {
                    DestinationWindow {
                        destination: destination.clone(),
                        cap,
                        sends_in_window: in_window.len(),
                        next_free_slot: cap.next_free_slot(now, in_window.iter().copied()),
                        queued,
                        cooldown_until,
                    }
                })
            })
            .collect())
    }

    /// Removes the oldest audit records, all but the newest `keep` of the
    /// segments this handle's `audit_rotate_bytes` cuts the chain into,
    /// after a `pruned` record carrying `note` (see
    /// `PgEngine::remove_old_audit_segments`). Rerun from the start when the
    /// server aborts it to break a deadlock.
    pub(crate) fn remove_old_audit_segments(&self, keep: usize, note: &str) -> Result<usize> {
        let now = self.clock.now();
        blocking(|| {
            super::retry::retrying("an audit removal", |_| {
                self.engine()
                    .remove_old_audit_segments(keep, note, self.audit_segment_bytes, now)
            })
        })
    }

    /// Verifies the audit table's chain against its head row.
    pub(crate) fn verify_audit(&self) -> Result<AuditReport> {
        blocking(|| self.engine().verify_audit())
    }

    /// Housekeeping now (see `retention`): seals pending audit events and
    /// applies `history_retention` under the stored settings.
    pub(crate) fn compact(&self) -> Result<()> {
        let settings = self.settings()?;
        let now = self.clock.now();
        let done = blocking(|| self.engine().compact(&settings, now))?;
        tracing::debug!(
            schema = %self.schema(),
            sealed = done.sealed,
            pruned = done.pruned,
            cooldowns = done.cooldowns,
            "compacted"
        );
        Ok(())
    }

    /// The audit chain's head.
    pub(crate) fn audit_head(&self) -> Result<Head> {
        blocking(|| self.engine().audit_head())
    }

    /// Every audit record about `key`, oldest first.
    pub(crate) fn history(&self, key: &str) -> Result<Vec<AuditRecord>> {
        blocking(|| self.engine().records_of(key))
    }
}

impl Drop for PgBackend {
    fn drop(&mut self) {
        // Closing the connections talks to the server: where the client may block.
        if let Some(engine) = self.engine.take() {
            blocking(move || drop(engine));
        }
    }
}
