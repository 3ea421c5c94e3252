//! Delivery order: which queued item of a destination may be sent next.
//!
//! **The rule** (default, [`Ordering::PerDestination`]): messages to one
//! destination are handed to `send` in enqueue order, one at a time. The
//! destination's *head* is its queued item (claimed or not, due or waiting for a
//! retry) that was enqueued first; only the head may be claimed. Every other
//! queued item to that destination waits, whatever its own due time, until the
//! head is terminal: sent, or failed (including cancelled and ambiguous). A
//! terminal item never blocks anything.
//!
//! Enqueue order is the item's `enqueue_seq`, a number allocated under the
//! directory lock that is larger than that of every item live at the time, so it
//! is total across threads and processes (timestamps can tie). Items written
//! before sequences existed have none and come first, ordered by creation time
//! and then key. An operator's requeue gives the item a fresh sequence: it goes
//! to the back of its destination's line, behind everything queued there now.
//!
//! [`Ordering::Unordered`] drops the rule, for broadcasts where each destination
//! receives one message and throughput matters more.

use std::collections::{BTreeSet, HashMap, HashSet};

use chrono::{DateTime, Utc};

use crate::item::{ItemState, OutboxItem};

/// How an outbox orders deliveries to one destination; set with
/// [`OutboxBuilder::ordering`](crate::OutboxBuilder::ordering).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Ordering {
    /// Messages to one destination leave in enqueue order, one at a time: a
    /// later one never starts while an earlier one to the same destination is
    /// queued, claimed or waiting for its retry. The default.
    #[default]
    PerDestination,
    /// No order between messages: any due item may be sent, several to one
    /// destination at once (rate caps still hold). For broadcasts.
    Unordered,
}

/// An item's place in its destination's line: sequence, then creation time,
/// then key (items without a sequence sort first, by time).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct OrderKey {
    seq: u64,
    created_at: DateTime<Utc>,
    pub(crate) key: String,
}

impl OrderKey {
    pub(crate) fn of(item: &OutboxItem) -> Self {
        Self {
            seq: item.seq.unwrap_or(0),
            created_at: item.created_at,
            key: item.idempotency_key.clone(),
        }
    }
}

/// The queued items of every destination, indexed so that choosing the next
/// item costs `O(log n)` per look however large the backlog: per destination
/// its line in enqueue order, and across destinations each line's *front*
/// (the head, or for unordered delivery the earliest-due unclaimed item)
/// ordered by when it falls due. Kept in step with every change by `store`.
#[derive(Debug, Default)]
pub(crate) struct Lines {
    /// Per destination, its queued items (claimed or not) in enqueue order.
    by_destination: HashMap<String, BTreeSet<OrderKey>>,
    /// Per destination, its unclaimed queued items by due time.
    unclaimed: HashMap<String, BTreeSet<(DateTime<Utc>, OrderKey)>>,
    /// Per queued item: when it falls due, and whether it is claimed.
    pending: HashMap<String, (DateTime<Utc>, bool)>,
    /// Each destination's head, if unclaimed, by due time (per-destination order).
    heads: BTreeSet<(DateTime<Utc>, OrderKey)>,
    head_of: HashMap<String, (DateTime<Utc>, OrderKey)>,
    /// Each destination's earliest-due unclaimed item, by due time (unordered).
    fronts: BTreeSet<(DateTime<Utc>, OrderKey)>,
    front_of: HashMap<String, (DateTime<Utc>, OrderKey)>,
    /// Claimed queued items: in flight, or left by a worker that died.
    claimed: BTreeSet<OrderKey>,
    /// The largest enqueue sequence of any live item.
    max_seq: u64,
}

/// When a queued item may go: its next attempt, or its creation.
fn due_of(item: &OutboxItem) -> DateTime<Utc> {
    item.next_attempt_at.unwrap_or(item.created_at)
}

impl Lines {
    pub(crate) fn insert(&mut self, item: &OutboxItem) {
        self.max_seq = self.max_seq.max(item.seq.unwrap_or(0));
        if item.state != ItemState::Queued {
            return;
        }
        let (place, due, destination) = (OrderKey::of(item), due_of(item), &item.destination);
        let claimed = item.claim.is_some();
        self.by_destination
            .entry(destination.clone())
            .or_default()
            .insert(place.clone());
        self.pending
            .insert(item.idempotency_key.clone(), (due, claimed));
        if claimed {
            self.claimed.insert(place);
        } else {
            self.unclaimed
                .entry(destination.clone())
                .or_default()
                .insert((due, place));
        }
        self.refresh(destination);
    }

    pub(crate) fn remove(&mut self, item: &OutboxItem) {
        if item.state != ItemState::Queued {
            return;
        }
        let (place, destination) = (OrderKey::of(item), &item.destination);
        if let Some(line) = self.by_destination.get_mut(destination) {
            line.remove(&place);
            if line.is_empty() {
                self.by_destination.remove(destination);
            }
        }
        if let Some((due, claimed)) = self.pending.remove(&item.idempotency_key) {
            if claimed {
                self.claimed.remove(&place);
            } else if let Some(set) = self.unclaimed.get_mut(destination) {
                set.remove(&(due, place));
                if set.is_empty() {
                    self.unclaimed.remove(destination);
                }
            }
        }
        self.refresh(destination);
    }

    /// Recomputes `destination`'s head and front entries.
    fn refresh(&mut self, destination: &str) {
        if let Some(old) = self.head_of.remove(destination) {
            self.heads.remove(&old);
        }
        if let Some(old) = self.front_of.remove(destination) {
            self.fronts.remove(&old);
        }
        let head = self
            .by_destination
            .get(destination)
            .and_then(BTreeSet::first);
        if let Some(head) = head
            && let Some((due, false)) = self.pending.get(&head.key)
        {
            let entry = (*due, head.clone());
            self.heads.insert(entry.clone());
            self.head_of.insert(destination.to_owned(), entry);
        }
        if let Some(front) = self.unclaimed.get(destination).and_then(BTreeSet::first) {
            self.fronts.insert(front.clone());
            self.front_of.insert(destination.to_owned(), front.clone());
        }
    }

    /// `destination`'s queued items in enqueue order.
    pub(crate) fn line(&self, destination: &str) -> impl Iterator<Item = &OrderKey> {
        self.by_destination.get(destination).into_iter().flatten()
    }

    /// One unclaimed item per destination (its head, or under `Unordered` its
    /// earliest-due item), earliest due first.
    pub(crate) fn fronts(
        &self,
        ordering: Ordering,
    ) -> impl Iterator<Item = &(DateTime<Utc>, OrderKey)> {
        match ordering {
            Ordering::PerDestination => self.heads.iter(),
            Ordering::Unordered => self.fronts.iter(),
        }
    }

    /// Every claimed queued item.
    pub(crate) fn claimed(&self) -> impl Iterator<Item = &OrderKey> {
        self.claimed.iter()
    }

    /// The largest enqueue sequence among live items (0 if none has one).
    pub(crate) fn max_seq(&self) -> u64 {
        self.max_seq
    }
}

/// How a drain or worker chooses among the items it may claim next.
///
/// **Fairness:** the destination served least recently (by this picker) goes
/// first, then the oldest item. A flooded destination gets one turn per round
/// like every other, and each freed slot of the global cap goes to the next
/// destination in that rotation. Under the per-destination order a destination
/// also never has more than one send in flight, so it can hold at most one of
/// the worker's slots.
#[derive(Debug, Default)]
pub(crate) struct Picker {
    /// Per destination, the tick of its last claim by this picker.
    served: HashMap<String, u64>,
    tick: u64,
    /// A drain pass looks at each item once: the keys it has looked at.
    seen: Option<HashSet<String>>,
    /// A drain pass takes only the items that were due when it started.
    only: Option<HashSet<String>>,
}

/// Past this many remembered destinations, forget those with nothing queued.
const SERVED_MEMORY: usize = 4096;

impl Picker {
    /// For a worker: any due item, for as long as it runs.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn worker() -> Self {
        Self::default()
    }

    /// For one drain pass over `due` (the keys due when it started): each at most once.
    pub(crate) fn pass(due: impl IntoIterator<Item = String>) -> Self {
        Self {
            seen: Some(HashSet::new()),
            only: Some(due.into_iter().collect()),
            ..Self::default()
        }
    }

    /// Whether `key` may still be picked.
    pub(crate) fn admits(&self, key: &str) -> bool {
        self.only.as_ref().is_none_or(|only| only.contains(key))
            && self.seen.as_ref().is_none_or(|seen| !seen.contains(key))
    }

    /// Notes that `key` was looked at (decided, whatever the outcome).
    pub(crate) fn looked_at(&mut self, key: &str) {
        if let Some(seen) = &mut self.seen {
            seen.insert(key.to_owned());
        }
    }

    /// Notes that an item to `destination` was claimed.
    pub(crate) fn served(&mut self, destination: &str) {
        self.tick += 1;
        self.served.insert(destination.to_owned(), self.tick);
    }

    /// Orders candidates `(destination, place)`: least recently served
    /// destination first, then enqueue order. Candidates come from a window of
    /// the earliest-due fronts, so a destination with older pending work is in
    /// the window before one with newer work, and a flooded destination has a
    /// single front.
    pub(crate) fn rank(&mut self, candidates: &mut [(String, OrderKey)]) {
        if self.served.len() > SERVED_MEMORY {
            let live: HashSet<&str> = candidates.iter().map(|(d, _)| d.as_str()).collect();
            self.served.retain(|d, _| live.contains(d.as_str()));
        }
        candidates.sort_by(|(da, a), (db, b)| {
            let ta = self.served.get(da).copied().unwrap_or(0);
            let tb = self.served.get(db).copied().unwrap_or(0);
            ta.cmp(&tb).then_with(|| a.cmp(b))
        });
    }

    /// The keys of the pass that were never looked at.
    pub(crate) fn unseen(&self) -> Vec<String> {
        match (&self.only, &self.seen) {
            (Some(only), Some(seen)) => {
                let mut keys: Vec<String> = only.difference(seen).cloned().collect();
                keys.sort_unstable();
                keys
            }
            _ => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn key(seq: u64, secs: i64, key: &str) -> OrderKey {
        OrderKey {
            seq,
            created_at: Utc.timestamp_opt(secs, 0).single().unwrap_or_default(),
            key: key.into(),
        }
    }

    #[test]
    fn the_least_recently_served_destination_goes_first() {
        let mut picker = Picker::worker();
        picker.served("flood");
        let mut candidates = vec![
            ("flood".to_owned(), key(1, 0, "f1")),
            ("quiet".to_owned(), key(9, 0, "q1")),
        ];
        picker.rank(&mut candidates);
        assert_eq!(candidates[0].0, "quiet");
        picker.served("quiet");
        picker.rank(&mut candidates);
        assert_eq!(candidates[0].0, "flood");
    }

    #[test]
    fn a_pass_takes_each_of_its_keys_once() {
        let mut picker = Picker::pass(["a".to_owned(), "b".to_owned()]);
        assert!(picker.admits("a") && !picker.admits("c"));
        picker.looked_at("a");
        assert!(!picker.admits("a"));
        assert_eq!(picker.unseen(), vec!["b".to_owned()]);
    }

    #[test]
    fn sequence_wins_over_time_and_key() {
        assert!(key(1, 50, "z") < key(2, 10, "a"));
    }

    #[test]
    fn items_without_a_sequence_come_first_by_time_then_key() {
        assert!(key(0, 10, "b") < key(1, 0, "a"));
        assert!(key(0, 10, "b") < key(0, 11, "a"));
        assert!(key(0, 10, "a") < key(0, 10, "b"));
    }
}
