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

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};

use crate::item::OutboxItem;

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
    /// destination first, then enqueue order.
    pub(crate) fn rank(&mut self, candidates: &mut Vec<(String, OrderKey)>) {
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
