//! The file engine: one outbox is one directory. Serves the rules'
//! transactions ([`FileTxn`]) under the directory lock, with the commit
//! protocol of ARCHITECTURE.md ("The commit protocol"): catch up on what other
//! processes wrote, reconcile the audit log, run the transaction over the
//! in-memory state, journal its change and join a commit group, append the
//! audit records once the group is durable; compaction and housekeeping when
//! the journal has grown.
//!
//! The files themselves belong to `store` (`outbox.json`, `outbox.journal`),
//! `audit` (`audit.jsonl`), `history` (`history/`) and `lock` (`outbox.lock`,
//! owner files); this module orchestrates them.

mod housekeeping;
mod reconcile;
mod txn;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use chrono::{DateTime, Utc};

use crate::audit::{AuditRecord, AuditReport, AuditTail, Hasher, Head};
use crate::builder::OutboxBuilder;
use crate::clock::{Clock, earlier};
use crate::commit::{Group, Synced};
use crate::error::{Error, Result};
use crate::failpoint::Failpoints;
use crate::filter::ItemFilter;
use crate::fsutil;
use crate::history::History;
use crate::item::{ItemState, OutboxItem};
use crate::lock::{self, DirLock, OwnerLease};
use crate::profile::{Mark, Span};
use crate::rate::{DestinationWindow, RateLimit};
use crate::receipt::{DeliveryReceipt, DrainReport, Outcome};
use crate::rules::record::system_event;
use crate::settings::{Settings, Stored};
use crate::store::{CommitFailure, Loaded, Store};

use self::housekeeping::{Housekeeping, compact_locked};
use self::reconcile::{reconcile_audit, settle_settings};
pub(crate) use self::txn::FileTxn;
use self::txn::sealing_head;

/// When the next item is due, for a worker's sleep.
#[derive(Debug, Default)]
pub(crate) struct DueSummary {
    /// The earliest due moment of a claimable item.
    pub(crate) next_due: Option<DateTime<Utc>>,
    /// Some line is held by a claim of another handle.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) foreign_claim: bool,
}

/// One open outbox directory: its files, its lock, this handle's liveness
/// token, and the commit group.
pub(crate) struct FileEngine {
    dir: PathBuf,
    store: Store,
    /// Held only for read-modify-write; never across `send`. Guards the audit tail.
    lock: DirLock<Locked>,
    /// This handle's liveness token; claims name its id.
    owner: OwnerLease,
    /// Set after a durability failure whose outcome on disk is unknown.
    poisoned: AtomicBool,
    /// The commit group: transactions waiting for their journal entry's sync.
    group: Group,
    /// The settings this handle stores with its first change, when it opened a
    /// new outbox (unless another handle stored its own first).
    initial_settings: Option<Stored>,
    /// This handle's builder values of the stored settings: what a setting the
    /// outbox does not store falls back to (see `settings`).
    defaults: Settings,
    /// Seal the active audit file once it is this large.
    audit_rotate_bytes: u64,
    clock: Arc<dyn Clock>,
    faults: Failpoints,
}

impl FileEngine {
    /// Opens (creating if needed) the outbox directory of `builder`: checks who
    /// may own it, sweeps temp files and dead owner files, takes this handle's
    /// owner file, catches up, reconciles the audit log, stores the settings
    /// the builder set explicitly, and compacts if the journal holds entries.
    ///
    /// # Errors
    /// As [`OutboxBuilder::open`].
    pub(crate) fn open(builder: &mut OutboxBuilder) -> Result<Self> {
        let dir = builder.dir.clone();
        if builder.create == crate::builder::Create::Never {
            check_outbox_dir(&dir)?;
        }
        lock::create_private_dir(&dir)?;
        crate::trust::check_outbox_dir(&dir, builder.trust)?;
        let hasher = builder
            .audit_key
            .take()
            .map_or(Hasher::Plain, Hasher::Keyed);
        let lock = DirLock::open(
            &dir,
            Locked {
                audit: AuditTail::new(&dir, hasher),
                loaded: None,
                history: History::new(&dir),
                history_generation: None,
                written: 0,
                hold_syncs: 0,
                hold_since: None,
            },
        )?;
        #[cfg_attr(not(any(test, feature = "test-failpoints")), allow(unused_mut))]
        let mut faults = Failpoints::from_env();
        #[cfg(any(test, feature = "test-failpoints"))]
        for (name, action) in &builder.failpoints {
            faults.arm(name, *action);
        }
        let _ = &mut faults;
        let store = Store::new(&dir);
        let defaults = builder.handle_settings();
        let (owner, initial_settings) = {
            let mut guard = lock.lock()?;
            guard.mark_writing()?;
            for stale in fsutil::sweep_temp_files(&dir)? {
                tracing::info!(path = %stale.display(), "removed a temp file left by a crashed writer");
            }
            lock::sweep_dead_owners(&dir, &guard)?;
            let owner = OwnerLease::acquire(&dir, &guard)?;
            let (audit, loaded, history) = guard.refresh(&store)?;
            reconcile_audit(audit, loaded, &faults)?;
            store.settle_torn(loaded)?;
            let compact = builder.compact_on_open && loaded.has_journal_entries();
            let initial = settle_settings(&store, audit, loaded, &defaults, builder, &faults)?;
            if compact {
                // Start from a fresh snapshot: outbox.json is current after every open.
                let keep = Housekeeping::new(
                    builder.clock.now(),
                    &defaults.with_stored(&loaded.state.settings),
                    builder.audit_rotate_bytes,
                );
                compact_locked(&store, audit, loaded, history, &keep, &faults)
                    .map_err(|(_, e)| e)?;
            }
            guard.mark_current();
            (owner, initial)
        };
        Ok(Self {
            dir,
            store,
            lock,
            owner,
            poisoned: AtomicBool::new(false),
            group: Group::default(),
            initial_settings,
            defaults,
            audit_rotate_bytes: builder.audit_rotate_bytes,
            clock: Arc::clone(&builder.clock),
            faults,
        })
    }

    /// The outbox directory.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// The owner id this handle's claims carry.
    pub(crate) fn owner_id(&self) -> &str {
        self.owner.id()
    }

    /// This handle's builder values of the stored settings.
    pub(crate) fn defaults(&self) -> &Settings {
        &self.defaults
    }

    /// How often the armed test failpoint `name` was reached.
    #[cfg(any(test, feature = "test-failpoints"))]
    pub(crate) fn failpoint_hits(&self, name: &str) -> u32 {
        self.faults.hits(name)
    }

    /// Checks the test failpoint `name` (nothing without the feature), as an
    /// I/O error of `op` on the outbox.
    ///
    /// # Errors
    /// [`Error::Io`] when `name` is armed to fail here.
    pub(crate) fn check_failpoint(&self, name: &str, op: &'static str) -> Result<()> {
        self.faults
            .check(name)
            .map_err(|e| Error::io(self.store.path(), op, e))
    }

    /// The fault point between a send and the transaction that records it.
    ///
    /// # Errors
    /// [`Error::Io`] when the `process.after_send` failpoint is armed.
    pub(crate) fn check_after_send(&self) -> Result<()> {
        self.faults
            .check("process.after_send")
            .map_err(|e| Error::io(self.store.path(), "process", e))
    }

    // ----- reads -----------------------------------------------------------

    /// The item with this key, if any, live or in history.
    pub(crate) fn get(&self, key: &str) -> Result<Option<OutboxItem>> {
        self.read(|loaded, history| match loaded.state.items.get(key) {
            Some(item) => Ok(Some(item.clone())),
            None => history.get(key),
        })
    }

    /// The live items `filter` matches (every live item for `None`), sorted by key.
    pub(crate) fn list(&self, filter: Option<&ItemFilter>) -> Result<Vec<OutboxItem>> {
        self.read(|loaded, _| {
            let mut items: Vec<OutboxItem> = loaded
                .state
                .items
                .values()
                .filter(|item| filter.is_none_or(|f| f.matches(item)))
                .cloned()
                .collect();
            items.sort_unstable_by(|a, b| a.idempotency_key.cmp(&b.idempotency_key));
            Ok(items)
        })
    }

    /// Every item that has moved to history, read from disk as iterated.
    pub(crate) fn history_items(&self) -> Result<crate::history::HistoryItems> {
        self.read(|_, history| Ok(history.items()))
    }

    /// How many items have moved to history.
    pub(crate) fn history_len(&self) -> Result<usize> {
        self.read(|_, history| Ok(history.len()))
    }

    /// The item whose delivery returned this transport reference, live first,
    /// then in history; with `destination`, only among that destination's.
    pub(crate) fn find_by_transport_ref(
        &self,
        destination: Option<&str>,
        transport_ref: &str,
    ) -> Result<Option<OutboxItem>> {
        self.read(|loaded, history| {
            let key = match destination {
                None => loaded.index.key_for_transport_ref(transport_ref),
                Some(destination) => loaded
                    .index
                    .key_for_destination_ref(destination, transport_ref),
            };
            match key.and_then(|key| loaded.state.items.get(key)) {
                Some(item) => Ok(Some(item.clone())),
                None => match destination {
                    None => history.find_by_transport_ref(transport_ref),
                    Some(destination) => {
                        history.find_by_destination_ref(destination, transport_ref)
                    }
                },
            }
        })
    }

    /// Adds a `Waiting` receipt for each of `keys` still queued and unclaimed.
    pub(crate) fn report_waiting(&self, keys: &[String], report: &mut DrainReport) -> Result<()> {
        self.read(|loaded, _| {
            for key in keys {
                if let Some(item) = loaded.state.items.get(key)
                    && item.state == ItemState::Queued
                    && item.claim.is_none()
                {
                    report.add(
                        DeliveryReceipt::for_item(item, Outcome::Waiting, None),
                        false,
                    );
                }
            }
            Ok(())
        })
    }

    /// When the next item is due at `now`, and whether a claim of another
    /// handle than `own` holds a line.
    pub(crate) fn due_summary(&self, own: &str, now: DateTime<Utc>) -> Result<DueSummary> {
        self.read(|loaded, _| {
            let ordering = loaded
                .state
                .settings
                .ordering
                .unwrap_or(self.defaults.ordering);
            let lines = &loaded.index.lines;
            let foreign_claim = lines.claimed().any(|place| {
                loaded
                    .state
                    .items
                    .get(&place.key)
                    .is_some_and(|item| item.claim_owner() != Some(own))
            });
            Ok(DueSummary {
                next_due: lines.next_due(ordering, now),
                foreign_claim,
            })
        })
    }

    /// The keys of the items due at `now`, oldest first.
    pub(crate) fn due_keys(&self, now: DateTime<Utc>) -> Result<Vec<String>> {
        let mut due: Vec<(DateTime<Utc>, String)> = self.read(|loaded, _| {
            Ok(loaded
                .state
                .items
                .values()
                .filter(|item| item.state == ItemState::Queued)
                .filter(|item| item.next_attempt_at.is_none_or(|at| at <= now))
                .map(|item| (item.created_at, item.idempotency_key.clone()))
                .collect())
        })?;
        due.sort();
        Ok(due.into_iter().map(|(_, key)| key).collect())
    }

    /// Sets the queue gauges at `now`.
    #[cfg(feature = "metrics")]
    pub(crate) fn publish_gauges(&self, now: DateTime<Utc>) -> Result<()> {
        self.read(|loaded, _| {
            crate::metrics::gauges(loaded.state.items.values(), now);
            Ok(())
        })
    }

    /// The settings in force: stored over this handle's builder values.
    pub(crate) fn settings(&self) -> Result<Settings> {
        self.read(|loaded, _| Ok(self.defaults.with_stored(&loaded.state.settings)))
    }

    /// Every destination's rate window at `now` (see `Outbox::rate_windows`).
    pub(crate) fn rate_windows(
        &self,
        what_if: Option<RateLimit>,
        now: DateTime<Utc>,
    ) -> Result<Vec<DestinationWindow>> {
        self.read(|loaded, _| {
            let settings = self.defaults.with_stored(&loaded.state.settings);
            let longest = what_if.map_or_else(|| settings.rates.longest_window(), |cap| cap.window);
            let mut queued: BTreeMap<&str, usize> = BTreeMap::new();
            for item in loaded.state.items.values() {
                if item.state == ItemState::Queued {
                    *queued.entry(item.destination.as_str()).or_default() += 1;
                }
            }
            for destination in loaded.index.destinations_since(earlier(now, longest)) {
                queued.entry(destination).or_default();
            }
            for (destination, until) in &loaded.state.cooldowns {
                if *until > now {
                    queued.entry(destination.as_str()).or_default();
                }
            }
            Ok(queued
                .into_iter()
                .filter_map(|(destination, queued)| {
                    let cap = what_if.unwrap_or_else(|| settings.rate_limit_for(destination));
                    let cutoff = earlier(now, cap.window);
                    let times: Vec<DateTime<Utc>> = loaded
                        .index
                        .rate_times_since(destination, cutoff)
                        .map(|(at, _)| at)
                        .filter(|at| *at > cutoff)
                        .collect();
                    let cooldown_until = loaded
                        .state
                        .cooldowns
                        .get(destination)
                        .copied()
                        .filter(|until| *until > now);
                    (queued > 0 || !times.is_empty() || cooldown_until.is_some()).then(|| {
                        DestinationWindow {
                            destination: destination.to_owned(),
                            cap,
                            sends_in_window: times.len(),
                            next_free_slot: cap.next_free_slot(now, times.iter().copied()),
                            queued,
                            cooldown_until,
                        }
                    })
                })
                .collect())
        })
    }

    // ----- operations outside the rules ------------------------------------

    /// Removes all sealed audit segments but the newest `keep`, after a
    /// `pruned` record carrying `note`. Returns how many were removed.
    pub(crate) fn remove_old_audit_segments(&self, keep: usize, note: &str) -> Result<usize> {
        let inner = self;
        let mut guard = self.lock_quiet()?;
        guard.mark_writing()?;
        let (audit, loaded, _) = guard.refresh(&inner.store)?;
        self.guard_poison(reconcile_audit(audit, loaded, &inner.faults))?;
        let sealed = crate::audit::sealed_segments(&inner.dir)?;
        let remove = sealed.len().saturating_sub(keep);
        if remove == 0 {
            return Ok(0);
        }
        let range = format!(
            "{} to {}",
            sealed[0].1.display(),
            sealed[remove - 1].1.display()
        );
        // The anchor the removal leaves, named in its (keyed) record so that in
        // keyed mode the anchor is only accepted with this record in the chain.
        let anchor = crate::audit::last_head(&sealed[remove - 1].1)?;
        let head = audit.head().clone();
        let event = system_event(
            &head,
            crate::audit::REMOVAL_SUBJECT,
            format!(
                "{note} (removed {remove} sealed audit segments: {range}; {})",
                crate::audit::removal_note(&anchor)
            ),
            inner.clock.now(),
        );
        let record = AuditRecord::seal(&event, head.seq + 1, &head.hash, false, audit.hasher());
        self.settle(inner.store.commit(
            loaded,
            Vec::new(),
            std::slice::from_ref(&record),
            &inner.faults,
        ))?;
        self.guard_poison(audit.append_records(std::slice::from_ref(&record), &inner.faults))?;
        let removed = self.guard_poison(audit.remove_sealed(keep, &inner.faults))?;
        Ok(removed.len())
    }

    /// Verifies the whole audit chain against the head the state recorded.
    pub(crate) fn verify_audit(&self) -> Result<AuditReport> {
        self.transact(|_| Ok(()))?;
        let mut guard = self.lock_quiet()?;
        let (audit, loaded, _) = guard.refresh(&self.store)?;
        let expected = loaded
            .journal_audit
            .last()
            .map(|r| Head {
                seq: r.seq,
                hash: r.hash.clone(),
            })
            .or_else(|| loaded.state.audit_head.clone());
        audit.verify_whole(expected.as_ref())
    }

    /// Writes a fresh snapshot now and starts an empty journal.
    pub(crate) fn compact(&self) -> Result<()> {
        let inner = self;
        let mut guard = self.lock_quiet()?;
        guard.mark_writing()?;
        let (audit, loaded, history) = guard.refresh(&inner.store)?;
        self.guard_poison(reconcile_audit(audit, loaded, &inner.faults))?;
        let keep = self.housekeeping(loaded);
        self.settle(compact_locked(
            &inner.store,
            audit,
            loaded,
            history,
            &keep,
            &inner.faults,
        ))
    }

    /// The audit log's current head.
    pub(crate) fn audit_head(&self) -> Result<Head> {
        let mut guard = self.lock.lock()?;
        guard.audit.catch_up()?;
        Ok(guard.audit.head().clone())
    }

    // ----- the commit protocol ---------------------------------------------

    /// Runs `f` on the current state under the lock (no audit repair, no write).
    fn read<T>(&self, f: impl FnOnce(&Loaded, &History) -> Result<T>) -> Result<T> {
        let inner = self;
        if self.is_poisoned() {
            return Err(Error::Poisoned);
        }
        let mut guard = inner.lock.lock()?;
        // Another process wrote: catch up (but leave the audit log and its
        // repair to the next transaction, which sees the counter still moved).
        let stale = self.is_stale(&guard)?;
        let (locked, _) = guard.split();
        let (_, loaded, history) = if stale {
            locked.refresh_with(&inner.store, false)?
        } else {
            locked.parts(&inner.store)?
        };
        let value = f(loaded, history);
        // The answer may rest on entries of a commit group not yet durable.
        let ticket = locked.written;
        drop(guard);
        self.wait_durable(ticket)?;
        value
    }

    /// Whether the cached state must be re-read from the files: another
    /// process announced a write (the change counter moved), or `outbox.json`
    /// was changed behind the outbox's back (one `stat`). Never while this
    /// process's commit group holds the lock: nobody else can have written.
    fn is_stale(&self, guard: &crate::lock::DirGuard<'_, Locked>) -> Result<bool> {
        if guard.is_pending() {
            return Ok(false);
        }
        Ok(guard.is_stale() || self.store.snapshot_changed(guard.loaded.as_ref())?)
    }

    /// Whether a durability failure poisoned this handle.
    fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Acquire) || self.group.failed()
    }

    /// Returns once this handle's journal entry `ticket` (and every earlier
    /// one) is durable, syncing the journal if no other thread is.
    fn wait_durable(&self, ticket: u64) -> Result<()> {
        self.wait_durable_led(ticket).0
    }

    /// As [`wait_durable`](Self::wait_durable), and whether this thread led a sync.
    fn wait_durable_led(&self, ticket: u64) -> (Result<()>, bool) {
        let mut led = false;
        let result = self.group.wait_durable(ticket, || {
            led = true;
            let unwinding = LeaderUnwinding(self);
            let synced = self.sync_group();
            std::mem::forget(unwinding);
            synced
        });
        if result.is_err() {
            self.poisoned.store(true, Ordering::Release);
            // Nothing of this handle's will be synced any more: never keep
            // other processes out for entries nobody will finish.
            if let Ok(mut guard) = self.lock.lock() {
                guard.set_pending(false);
            }
        }
        (result, led)
    }

    /// The lock with no commit group open: every entry this handle wrote is
    /// durable and in the audit log. For operations that look at the log or
    /// replace files.
    fn lock_quiet(&self) -> Result<crate::lock::DirGuard<'_, Locked>> {
        loop {
            if self.is_poisoned() {
                return Err(Error::Poisoned);
            }
            self.faults
                .check("commit.quiet")
                .map_err(|e| Error::io(self.store.path(), "lock", e))?;
            let guard = self.lock.lock()?;
            // Again under the lock: a group that failed while this thread
            // waited for it let the lock go with its members' changes applied
            // to the cached state but not on disk; compacting or committing
            // from that state would make them durable after all.
            if self.is_poisoned() {
                return Err(Error::Poisoned);
            }
            if !guard.is_pending() {
                return Ok(guard);
            }
            let ticket = guard.written;
            drop(guard);
            self.wait_durable(ticket)?;
        }
    }

    /// A commit group's leader: fsyncs every journal entry written so far
    /// (without the lock, so the next group can form meanwhile), then appends
    /// their audit records in journal order, and lets the `flock` go once
    /// nothing is left unsynced (compacting first if the journal grew enough).
    fn sync_group(&self) -> Synced {
        let inner = self;
        let failed = |e| Synced {
            cover: u64::MAX,
            result: Err(e),
        };
        if let Err(e) = inner.faults.check("commit.lead") {
            return failed(Error::io(inner.store.journal_path(), "fsync", e));
        }
        let mut mark = Mark::now();
        let (cover, unsynced, last_record) = {
            let mut guard = match inner.lock.lock() {
                Ok(guard) => guard,
                Err(e) => return failed(e),
            };
            guard.release_on_panic();
            mark = mark.end(Span::LeadLockWait1);
            guard.hold_syncs += 1;
            if guard.hold_syncs >= crate::commit::MIN_SYNCS_PER_HOLD
                && guard
                    .hold_since
                    .is_some_and(|since| since.elapsed() >= crate::commit::MAX_HOLD)
            {
                // Let this group drain, so other processes get the lock.
                inner.group.set_closing(true);
            }
            let written = guard.written;
            let loaded = guard.loaded.as_mut();
            let last_record = loaded
                .as_ref()
                .and_then(|l| l.journal_audit.last().map(|r| r.seq));
            (written, loaded.and_then(Loaded::take_unsynced), last_record)
        };
        let mark = mark.end(Span::LeadHold1);
        // The whole group's entries in one write, then one sync. A failed
        // write fails the group as a failed sync does: its members' changes
        // are applied in memory but not (all) on disk, so the handle is
        // poisoned below and nobody is told they are durable.
        let (synced, mark) = unsynced.map_or((Ok(()), mark), |unsynced| {
            let path = inner.store.journal_path();
            let written = unsynced
                .write(&inner.faults)
                .map_err(|e| Error::io(path, "append", e));
            let mark = mark.end(Span::GroupWrite);
            let synced = written.and_then(|()| {
                unsynced
                    .sync(&inner.faults)
                    .map_err(|e| Error::io(path, "fsync", e))
            });
            (synced, mark)
        });
        let mark = mark.end(Span::Sync);
        let mut guard = match inner.lock.lock() {
            Ok(guard) => guard,
            Err(e) => return failed(e),
        };
        guard.release_on_panic();
        let mark = mark.end(Span::LeadLockWait2);
        let result = synced.and_then(|()| {
            inner
                .faults
                .check("commit.before_audit")
                .map_err(|e| Error::io(inner.store.path(), "append", e))?;
            let (audit, loaded, _) = guard.parts(&inner.store)?;
            let durable = loaded.journal_audit_after(audit.head().seq);
            let upto = durable
                .iter()
                .take_while(|r| last_record.is_some_and(|last| r.seq <= last))
                .count();
            audit.append_records(&durable[..upto], &inner.faults)?;
            crate::metrics::committed(
                durable[..upto].iter().map(|r| {
                    (
                        r.outcome,
                        r.error_code.as_deref(),
                        r.failure_class,
                        r.idempotency_key.as_str(),
                    )
                }),
                |key| loaded.state.items.get(key),
            );
            Ok(())
        });
        if let Err(e) = result {
            // Nothing after the last good sync is reported durable; let other
            // processes in to recover what is really on disk.
            inner.poisoned.store(true, Ordering::Release);
            guard.set_pending(false);
            inner.group.set_closing(false);
            return Synced {
                cover,
                result: Err(e),
            };
        }
        if guard.written == cover {
            self.compact_if_grown(&mut guard);
            guard.hold_syncs = 0;
            guard.hold_since = None;
            guard.set_pending(false);
            inner.group.set_closing(false);
        }
        drop(guard);
        let _ = mark.end(Span::LeadHold2);
        Synced {
            cover,
            result: Ok(()),
        }
    }

    /// After a group drained: compact if the journal outgrew the snapshot. The
    /// group's changes are durable whatever happens here: a clean failure is
    /// retried at a later commit; an uncertain one poisons the handle for the
    /// calls that follow.
    fn compact_if_grown(&self, guard: &mut crate::lock::DirGuard<'_, Locked>) {
        let inner = self;
        let Ok((audit, loaded, history)) = guard.parts(&inner.store) else {
            return;
        };
        if !loaded.wants_compaction() {
            return;
        }
        let keep = self.housekeeping(loaded);
        let compacted = compact_locked(&inner.store, audit, loaded, history, &keep, &inner.faults);
        if let Err(e) = self.settle(compacted) {
            tracing::warn!(error = %e, "compaction after a commit failed; the commit stands");
            loaded.defer_compaction();
        }
    }

    /// What the next compaction moves to history and prunes from it, by the
    /// settings the outbox stores (whatever this handle was opened with).
    fn housekeeping(&self, loaded: &Loaded) -> Housekeeping {
        let config = self;
        Housekeeping::new(
            config.clock.now(),
            &config.defaults.with_stored(&loaded.state.settings),
            config.audit_rotate_bytes,
        )
    }

    /// Runs one locked read-modify-write: catch up on the audit log and the state,
    /// repair audit records a crash left behind, apply `f`, then (if anything
    /// changed) journal the change durably and append its audit records.
    pub(crate) fn transact<T>(&self, f: impl FnOnce(&mut FileTxn<'_>) -> Result<T>) -> Result<T> {
        let inner = self;
        if self.is_poisoned() {
            return Err(Error::Poisoned);
        }
        let start = Mark::now();
        inner.group.wait_open();
        let underway = inner.group.begin();
        let mark = start.end(Span::TxnWaitOpen);
        let mut guard = inner.lock.lock()?;
        let mark = mark.end(Span::TxnLockWait);
        // Again under the lock: a group that failed meanwhile has let the
        // `flock` go, and nothing may be written after it.
        if self.is_poisoned() {
            return Err(Error::Poisoned);
        }
        let stale = self.is_stale(&guard)?;
        if !guard.is_pending() {
            // The first transaction of this hold of the `flock`.
            inner.group.set_shared(stale);
        }
        let (locked, mut writes) = guard.split();
        let (audit, loaded, history) = if stale {
            // Another process wrote since we last looked (or never looked):
            // catch up, and announce the repairs this may write.
            writes.mark_writing()?;
            let (audit, loaded, history) = locked.refresh(&inner.store)?;
            self.guard_poison(reconcile_audit(audit, loaded, &inner.faults))?;
            self.guard_poison(inner.store.settle_torn(loaded))?;
            writes.mark_current();
            (audit, loaded, history)
        } else {
            locked.parts(&inner.store)?
        };
        let mark = mark.end(Span::TxnFresh);
        let mut txn = FileTxn {
            base: loaded,
            history,
            dir: &inner.dir,
            overlay: BTreeMap::new(),
            records: Vec::new(),
            head: sealing_head(audit, loaded),
            hasher: audit.hasher(),
            now: inner.clock.now(),
            settings: inner.defaults.with_stored(&loaded.state.settings),
            last_seq: loaded.index.lines.max_seq(),
        };
        let value = f(&mut txn);
        let mark = mark.end(Span::TxnRules);
        let wrote = match value {
            Ok(_) if txn.changed() => {
                let FileTxn {
                    overlay, records, ..
                } = txn;
                // The first change to a new outbox also stores its initial settings.
                // (Cloned only then, not under the lock of every commit.)
                let initial = inner
                    .initial_settings
                    .as_ref()
                    .filter(|_| loaded.state.settings.is_empty())
                    .cloned();
                writes.mark_writing()?;
                self.settle(inner.store.append_unsynced(
                    loaded,
                    initial,
                    overlay.into_values().map(|item| *item).collect(),
                    &records,
                    &inner.faults,
                ))?;
                locked.written += 1;
                locked
                    .hold_since
                    .get_or_insert_with(std::time::Instant::now);
                true
            }
            _ => false,
        };
        // A change waits for its own sync; a read or a refusal waits for the
        // entries it saw, which may not be durable yet either.
        let ticket = locked.written;
        if wrote {
            guard.set_pending(true);
        }
        drop(guard);
        drop(underway);
        let mark = if wrote {
            mark.end(Span::TxnAppend)
        } else {
            mark
        };
        let (durable, led) = self.wait_durable_led(ticket);
        durable?;
        if wrote {
            let _ = mark.end(if led {
                Span::LeaderWait
            } else {
                Span::FollowerWait
            });
            let _ = start.end(Span::TxnTotal);
        }
        value
    }

    /// Turns a commit failure into an error, poisoning the handle when the
    /// on-disk outcome is uncertain.
    fn settle(&self, result: std::result::Result<(), (CommitFailure, Error)>) -> Result<()> {
        match result {
            Ok(()) => Ok(()),
            Err((CommitFailure::Clean, e)) => Err(e),
            Err((CommitFailure::Uncertain, e)) => {
                self.poisoned.store(true, Ordering::Release);
                Err(e)
            }
        }
    }

    /// Poisons the handle when a durability step failed after data may have reached the disk.
    fn guard_poison<T>(&self, result: Result<T>) -> Result<T> {
        if result.is_err() {
            self.poisoned.store(true, Ordering::Release);
        }
        result
    }
}

/// Lets the `flock` go if a commit group's leader unwinds out of its sync
/// anywhere, also where it does not hold the state's lock (its group's write
/// and `fdatasync`), where no guard of the directory lock is there to drop:
/// its group fails, and a member still waiting to lead or to hear it is the
/// only other thread that would have released the lock; with none, the
/// poisoned handle kept every other process out for as long as it was open.
/// The handle is poisoned first, so no thread of this process writes again.
struct LeaderUnwinding<'a>(&'a FileEngine);

impl Drop for LeaderUnwinding<'_> {
    fn drop(&mut self) {
        self.0.poisoned.store(true, Ordering::Release);
        if let Ok(mut guard) = self.0.lock.lock() {
            guard.set_pending(false);
        }
    }
}

impl Drop for FileEngine {
    fn drop(&mut self) {
        crate::profile::report();
    }
}

/// What this process knows that is only touched under the directory lock.
struct Locked {
    audit: AuditTail,
    /// The state, loaded on first use and kept current (see `store`).
    loaded: Option<Loaded>,
    /// The history segments' indexes, loaded as far as `history_generation`.
    history: History,
    /// The snapshot generation the history was last refreshed for: segments
    /// only ever appear with a compaction, which bumps the generation.
    history_generation: Option<u64>,
    /// Journal entries this handle has written: the last commit ticket handed out.
    written: u64,
    /// Syncs since this process last took the `flock`.
    hold_syncs: u32,
    /// When this process's current commit group took the `flock`.
    hold_since: Option<std::time::Instant>,
}

impl Locked {
    /// Catches up on the audit log, the state and (after a compaction elsewhere)
    /// the history. Returns the pieces, borrowed separately.
    fn refresh<'a>(
        &'a mut self,
        store: &Store,
    ) -> Result<(&'a mut AuditTail, &'a mut Loaded, &'a mut History)> {
        self.refresh_with(store, true)
    }

    /// As [`refresh`](Self::refresh); `with_audit: false` skips the audit log,
    /// for reads that do not look at it (open has read it once already).
    fn refresh_with<'a>(
        &'a mut self,
        store: &Store,
        with_audit: bool,
    ) -> Result<(&'a mut AuditTail, &'a mut Loaded, &'a mut History)> {
        let Self {
            audit,
            loaded,
            history,
            history_generation,
            ..
        } = self;
        let loaded = store.refresh(loaded)?;
        if with_audit {
            let state = &loaded.state;
            if audit.is_fresh() {
                // First look: start after the sealed segments, and resume the
                // active log where the last compaction verified it, so opening
                // costs the recent records, not the whole history.
                audit.load_base()?;
                if let (Some(head), Some(offset)) = (&state.audit_head, state.audit_offset)
                    && !audit.resume_at(head, offset)?
                {
                    tracing::warn!(
                        "the audit log does not match the resume point in outbox.json; verifying it from the start"
                    );
                }
            }
            // The snapshot's head was fsynced before the snapshot was written:
            // past it, the log may hold whatever a power cut left.
            audit.note_durable(state.audit_head.as_ref().map_or(0, |h| h.seq));
            audit.catch_up()?;
        }
        if *history_generation != Some(loaded.state.generation) {
            history.refresh()?;
            *history_generation = Some(loaded.state.generation);
        }
        Ok((audit, loaded, history))
    }

    /// The pieces as they are, for a caller whose cached state is current.
    fn parts(&mut self, store: &Store) -> Result<(&mut AuditTail, &mut Loaded, &mut History)> {
        if self.loaded.is_none() {
            return self.refresh(store);
        }
        let Self {
            audit,
            loaded,
            history,
            ..
        } = self;
        let Some(loaded) = loaded.as_mut() else {
            unreachable!("loaded above")
        };
        Ok((audit, loaded, history))
    }
}

/// The directory must exist and hold an outbox file: a typo must not migrate
/// an empty outbox, nor open one where
/// [`create_if_missing(false)`](crate::OutboxBuilder::create_if_missing) says
/// none may be created.
///
/// # Errors
/// [`Error::InvalidConfig`] (`dir`) for a file or a directory with no outbox
/// file; [`Error::Io`] when it cannot be looked at (a missing directory).
pub(crate) fn check_outbox_dir(dir: &Path) -> Result<()> {
    match std::fs::metadata(dir) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => {
            return Err(Error::invalid_config(
                "dir",
                format!("{} is not a directory", dir.display()),
            ));
        }
        Err(e) => return Err(Error::io(dir, "stat", e)),
    }
    // A bot's first open makes `outbox.lock` before anything else, and an
    // outbox nothing was written to yet has only that.
    if ![
        "outbox.json",
        "outbox.journal",
        "audit.jsonl",
        "outbox.lock",
    ]
    .iter()
    .any(|name| dir.join(name).exists())
    {
        return Err(Error::invalid_config(
            "dir",
            format!(
                "{} is not an outbox directory (no outbox.json, outbox.journal, audit.jsonl or outbox.lock)",
                dir.display()
            ),
        ));
    }
    Ok(())
}
