//! The file engine's transaction: an overlay over the in-memory state, under
//! the directory lock. Reads see the committed state plus this transaction's
//! own changes; nothing is visible to anyone else until it commits.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use chrono::{DateTime, Utc};

use crate::audit::{AuditEvent, AuditRecord, AuditTail, Hasher, Head};
use crate::error::{Error, Result};
use crate::filter::ItemFilter;
use crate::history::History;
use crate::item::{ItemState, OutboxItem};
use crate::lock;
use crate::order::{self, OrderKey};
use crate::rules::txn::Txn;
use crate::settings::Settings;
use crate::store::{Loaded, rate_times};

/// How many due fronts one step looks at (beyond claimed and just-changed
/// items): enough for fair rotation, small enough that a step costs the same
/// with fifty thousand destinations as with five.
const CANDIDATE_WINDOW: usize = 64;

/// The head the next audit record chains to: the last record journalled, which
/// is ahead of the log while a commit group waits for its sync.
pub(super) fn sealing_head(audit: &AuditTail, loaded: &Loaded) -> Head {
    match loaded.journal_audit.last() {
        Some(last) if last.seq > audit.head().seq => Head {
            seq: last.seq,
            hash: last.hash.clone(),
        },
        _ => audit.head().clone(),
    }
}

/// One read-modify-write over the loaded state (see [`Txn`]).
pub(crate) struct FileTxn<'a> {
    pub(super) base: &'a Loaded,
    /// Terminal items that left the live state; read only.
    pub(super) history: &'a History,
    /// The outbox directory (owner files live under it).
    pub(super) dir: &'a Path,
    /// Items changed by this transaction (whole new versions), in key order
    /// (the journal entry's order). Boxed: a batched step changes a hundred
    /// items, and an ordered map moves its values as it grows.
    pub(super) overlay: BTreeMap<String, Box<OutboxItem>>,
    /// Audit records this transaction produces, sealed in order after `head`.
    pub(super) records: Vec<AuditRecord>,
    pub(super) head: Head,
    pub(super) hasher: &'a Hasher,
    pub(super) now: DateTime<Utc>,
    /// The settings in force: stored ones over this handle's.
    pub(super) settings: Settings,
    /// The last enqueue sequence handed out (starts at the largest live one).
    pub(super) last_seq: u64,
}

impl FileTxn<'_> {
    /// Whether the transaction changed anything (and so must be journalled).
    pub(super) fn changed(&self) -> bool {
        !self.overlay.is_empty() || !self.records.is_empty()
    }

    /// The items this transaction changed, in key order.
    fn overlay_items(&self) -> impl Iterator<Item = &OutboxItem> {
        self.overlay.values().map(|item| &**item)
    }

    fn get(&self, key: &str) -> Option<&OutboxItem> {
        self.overlay
            .get(key)
            .map(|item| &**item)
            .or_else(|| self.base.state.items.get(key))
    }

    /// `destination`'s two head candidates: the committed line's first item
    /// this transaction left alone, and the earliest queued item it changed.
    fn head_candidates(&self, destination: &str) -> (Option<&OrderKey>, Option<OrderKey>) {
        let committed = self
            .base
            .index
            .lines
            .line(destination)
            .find(|place| !self.overlay.contains_key(&place.key));
        let pending = self
            .overlay_items()
            .filter(|i| i.destination == destination && i.state == ItemState::Queued)
            .map(OrderKey::of)
            .min();
        (committed, pending)
    }

    fn head(&self, destination: &str) -> Option<OrderKey> {
        let (committed, pending) = self.head_candidates(destination);
        committed.cloned().into_iter().chain(pending).min()
    }
}

impl Txn for FileTxn<'_> {
    fn now(&self) -> DateTime<Utc> {
        self.now
    }

    fn settings(&self) -> &Settings {
        &self.settings
    }

    fn item(&mut self, key: &str) -> Result<Option<&OutboxItem>> {
        Ok(self.get(key))
    }

    fn item_mut(&mut self, key: &str) -> Result<&mut OutboxItem> {
        if !self.overlay.contains_key(key) {
            let item = self
                .base
                .state
                .items
                .get(key)
                .ok_or_else(|| Error::NotFound {
                    key: key.to_owned(),
                })?;
            self.overlay.insert(key.to_owned(), Box::new(item.clone()));
        }
        match self.overlay.get_mut(key) {
            Some(item) => Ok(&mut **item),
            None => unreachable!("inserted above"),
        }
    }

    fn archived(&mut self, key: &str) -> Result<Option<OutboxItem>> {
        self.history.get(key)
    }

    fn insert(&mut self, item: OutboxItem) -> Result<()> {
        self.overlay
            .insert(item.idempotency_key.clone(), Box::new(item));
        Ok(())
    }

    fn next_seq(&mut self, _destination: &str) -> Result<u64> {
        self.last_seq += 1;
        Ok(self.last_seq)
    }

    fn head_of(&mut self, destination: &str) -> Result<Option<OrderKey>> {
        Ok(self.head(destination))
    }

    fn candidates(
        &mut self,
        ordering: order::Ordering,
        admits: &mut dyn FnMut(&OutboxItem) -> bool,
    ) -> Result<Vec<(String, OrderKey)>> {
        let this: &Self = self;
        let lines = &this.base.index.lines;
        // Each destination's earliest queued item this transaction changed,
        // in one pass over the overlay: a batched step changes a hundred
        // items, and asking the overlay per candidate cost a pass each.
        let mut pending: HashMap<&str, OrderKey> = HashMap::new();
        for item in this.overlay_items() {
            if item.state == ItemState::Queued {
                let place = OrderKey::of(item);
                match pending.get_mut(item.destination.as_str()) {
                    Some(earliest) if *earliest <= place => {}
                    Some(earliest) => *earliest = place,
                    None => {
                        pending.insert(item.destination.as_str(), place);
                    }
                }
            }
        }
        // As `head`, over `pending`.
        let head = |destination: &str| -> Option<&OrderKey> {
            lines
                .line(destination)
                .find(|place| !this.overlay.contains_key(&place.key))
                .into_iter()
                .chain(pending.get(destination))
                .min()
        };
        let mut out: Vec<(String, OrderKey)> = Vec::new();
        let mut destinations: HashSet<&str> = HashSet::new();
        // Cheapest test first: a worker's own sends in flight are claimed
        // items `admits` turns away, and with many slots they are most of
        // the claimed ones; the head test (a walk of the line and of the
        // overlay) runs only for what `admits` lets through.
        let mut consider = |place: &OrderKey| {
            let Some(item) = this.get(&place.key) else {
                return;
            };
            let ready = item.state == ItemState::Queued
                && (item.claim.is_some() || item.next_attempt_at.is_none_or(|at| at <= this.now));
            if ready
                && !destinations.contains(item.destination.as_str())
                && admits(item)
                && (ordering == order::Ordering::Unordered
                    || head(&item.destination).is_some_and(|head| head.key == place.key))
            {
                destinations.insert(item.destination.as_str());
                out.push((item.destination.clone(), place.clone()));
            }
        };
        for place in lines.claimed() {
            if !this.overlay.contains_key(&place.key) {
                consider(place);
            }
        }
        for item in this.overlay_items() {
            if item.state == ItemState::Queued {
                consider(&OrderKey::of(item));
            }
            if let Some(head) = head(&item.destination) {
                consider(head);
            }
        }
        for place in lines
            .due_fronts(ordering, this.now)
            .filter(|place| !this.overlay.contains_key(&place.key))
            .take(CANDIDATE_WINDOW)
        {
            consider(place);
        }
        Ok(out)
    }

    fn select(&mut self, filter: &ItemFilter) -> Result<Vec<OutboxItem>> {
        let mut items: Vec<OutboxItem> = self
            .base
            .state
            .items
            .values()
            .filter(|item| filter.matches(item))
            .cloned()
            .collect();
        items.sort_unstable_by(|a, b| a.idempotency_key.cmp(&b.idempotency_key));
        Ok(items)
    }

    fn destination_cooldown(&mut self, destination: &str) -> Result<Option<DateTime<Utc>>> {
        let committed = self.base.state.cooldowns.get(destination).copied();
        let pending = self
            .overlay_items()
            .filter(|i| i.destination == destination)
            .filter_map(|i| i.cooldown_until)
            .max();
        Ok(committed.max(pending).filter(|until| *until > self.now))
    }

    fn all_times(&mut self, since: DateTime<Utc>) -> Result<Vec<DateTime<Utc>>> {
        let mut times: Vec<DateTime<Utc>> = self
            .base
            .index
            .all_rate_times_since(since)
            .filter(|(_, key)| !self.overlay.contains_key(*key))
            .map(|(at, _)| at)
            .collect();
        times.extend(self.overlay_items().flat_map(rate_times));
        Ok(times)
    }

    fn destination_times(
        &mut self,
        destination: &str,
        since: DateTime<Utc>,
    ) -> Result<Vec<DateTime<Utc>>> {
        let mut times: Vec<DateTime<Utc>> = self
            .base
            .index
            .rate_times_since(destination, since)
            .filter(|(_, key)| !self.overlay.contains_key(*key))
            .map(|(at, _)| at)
            .collect();
        times.extend(
            self.overlay_items()
                .filter(|i| i.destination == destination)
                .flat_map(rate_times),
        );
        Ok(times)
    }

    fn nth_newest_time(
        &mut self,
        destination: Option<&str>,
        after: DateTime<Utc>,
        n: usize,
    ) -> Result<Option<DateTime<Utc>>> {
        // This transaction's own times replace those of the items it changed.
        let pending: Vec<DateTime<Utc>> = self
            .overlay_items()
            .filter(|i| destination.is_none_or(|d| i.destination == d))
            .flat_map(rate_times)
            .filter(|at| *at > after)
            .collect();
        let (committed_count, newest_first) = self.base.index.rate_times_newest_first(destination);
        if committed_count + pending.len() < n {
            return Ok(None);
        }
        // The `n` newest committed times still in force, then the pending
        // ones: the `n`-th newest of all is among them.
        let committed = newest_first
            .take_while(|(at, _)| *at > after)
            .filter(|(_, key)| !self.overlay.contains_key(*key))
            .map(|(at, _)| at)
            .take(n);
        Ok(crate::rate::nth_newest(committed.chain(pending), after, n))
    }

    fn audit_id(&mut self, key: &str, now: DateTime<Utc>) -> Result<String> {
        Ok(crate::rules::record::item_audit_id(&self.head, key, now))
    }

    fn seal(&mut self, event: &AuditEvent) -> Result<()> {
        let sealed = AuditRecord::seal(
            event,
            self.head.seq + 1,
            &self.head.hash,
            false,
            self.hasher,
        );
        self.head = Head {
            seq: sealed.seq,
            hash: sealed.hash.clone(),
        };
        self.records.push(sealed);
        Ok(())
    }

    fn owner_is_alive(&mut self, owner: &str) -> Result<bool> {
        Ok(lock::owner_is_alive(self.dir, owner))
    }
}
