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

impl Ordering {
    /// The name stored in the outbox's settings: `per_destination` or `unordered`.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::PerDestination => "per_destination",
            Self::Unordered => "unordered",
        }
    }

    /// The ordering a stored name means.
    pub(crate) fn parse(name: &str) -> Option<Self> {
        match name {
            "per_destination" => Some(Self::PerDestination),
            "unordered" => Some(Self::Unordered),
            _ => None,
        }
    }
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
    /// Per queued item: its due entry, and whether it is claimed.
    pending: HashMap<String, (Due, bool)>,
    /// Each destination's head, if unclaimed (per-destination order).
    heads: Fronts,
    /// Each destination's earliest-due unclaimed item (unordered).
    fronts: Fronts,
    /// Claimed queued items: in flight, or left by a worker that died.
    claimed: BTreeSet<OrderKey>,
    /// The largest enqueue sequence of any live item.
    max_seq: u64,
}

/// When a queued item may go: `fresh` items (never deferred) are due from
/// their creation, and always due, even if a clock stepped back since;
/// deferred ones at their `next_attempt_at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Due {
    at: DateTime<Utc>,
    fresh: bool,
}

impl Due {
    fn of(item: &OutboxItem) -> Self {
        Self {
            at: item.next_attempt_at.unwrap_or(item.created_at),
            fresh: item.next_attempt_at.is_none(),
        }
    }
}

/// One entry per destination, split by whether it is fresh (always due) or
/// deferred (due at its time), each ordered by time.
#[derive(Debug, Default)]
struct Fronts {
    fresh: BTreeSet<(DateTime<Utc>, OrderKey)>,
    deferred: BTreeSet<(DateTime<Utc>, OrderKey)>,
    of: HashMap<String, (Due, OrderKey)>,
}

impl Fronts {
    fn set(&mut self, destination: &str, entry: Option<(Due, &OrderKey)>) {
        let current = self.of.get(destination).map(|(due, place)| (*due, place));
        if current == entry {
            return;
        }
        if let Some((due, place)) = self.of.remove(destination) {
            self.side(due.fresh).remove(&(due.at, place));
        }
        if let Some((due, place)) = entry {
            self.side(due.fresh).insert((due.at, place.clone()));
            self.of.insert(destination.to_owned(), (due, place.clone()));
        }
    }

    fn side(&mut self, fresh: bool) -> &mut BTreeSet<(DateTime<Utc>, OrderKey)> {
        if fresh {
            &mut self.fresh
        } else {
            &mut self.deferred
        }
    }

    /// The entries due at `now`, earliest first: every fresh one, and the
    /// deferred ones whose time has come.
    fn due(&self, now: DateTime<Utc>) -> impl Iterator<Item = &OrderKey> {
        let mut fresh = self.fresh.iter().peekable();
        let mut deferred = self
            .deferred
            .iter()
            .take_while(move |(at, _)| *at <= now)
            .peekable();
        std::iter::from_fn(move || {
            let take_fresh = match (fresh.peek(), deferred.peek()) {
                (Some(f), Some(d)) => f <= d,
                (Some(_), None) => true,
                (None, _) => false,
            };
            let next = if take_fresh {
                fresh.next()
            } else {
                deferred.next()
            };
            next.map(|(_, place)| place)
        })
    }

    /// The earliest moment an entry is due (at most `now` if one is fresh).
    fn next_due(&self, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
        match self.fresh.first() {
            Some((at, _)) => Some((*at).min(now)),
            None => self.deferred.first().map(|(at, _)| *at),
        }
    }
}

impl Lines {
    pub(crate) fn insert(&mut self, item: &OutboxItem) {
        self.max_seq = self.max_seq.max(item.seq.unwrap_or(0));
        if item.state != ItemState::Queued {
            return;
        }
        let (place, due, destination) = (OrderKey::of(item), Due::of(item), &item.destination);
        let claimed = item.claim.is_some();
        // A destination already known keeps its key: no copy of its name.
        match self.by_destination.get_mut(destination) {
            Some(line) => {
                line.insert(place.clone());
            }
            None => {
                self.by_destination
                    .insert(destination.clone(), BTreeSet::from([place.clone()]));
            }
        }
        self.pending
            .insert(item.idempotency_key.clone(), (due, claimed));
        if claimed {
            self.claimed.insert(place);
        } else {
            match self.unclaimed.get_mut(destination) {
                Some(set) => {
                    set.insert((due.at, place));
                }
                None => {
                    self.unclaimed
                        .insert(destination.clone(), BTreeSet::from([(due.at, place)]));
                }
            }
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
                set.remove(&(due.at, place));
                if set.is_empty() {
                    self.unclaimed.remove(destination);
                }
            }
        }
        self.refresh(destination);
    }

    /// Recomputes `destination`'s head and front entries; an entry that did
    /// not change is left in place (most changes leave the line's head and
    /// front as they were, or only flip its claim).
    fn refresh(&mut self, destination: &str) {
        let head = self
            .by_destination
            .get(destination)
            .and_then(BTreeSet::first)
            .and_then(|head| match self.pending.get(&head.key) {
                Some((due, false)) => Some((*due, head)),
                _ => None,
            });
        self.heads.set(destination, head);
        let front = self
            .unclaimed
            .get(destination)
            .and_then(BTreeSet::first)
            .and_then(|(_, place)| self.pending.get(&place.key).map(|(due, _)| (*due, place)));
        self.fronts.set(destination, front);
    }

    /// `destination`'s queued items in enqueue order.
    pub(crate) fn line(&self, destination: &str) -> impl Iterator<Item = &OrderKey> {
        self.by_destination.get(destination).into_iter().flatten()
    }

    /// The unclaimed items due at `now`, one per destination (its head, or
    /// under `Unordered` its earliest-due item), earliest due first.
    pub(crate) fn due_fronts(
        &self,
        ordering: Ordering,
        now: DateTime<Utc>,
    ) -> impl Iterator<Item = &OrderKey> {
        self.side(ordering).due(now)
    }

    /// When the earliest front is due (at most `now` if one is due already).
    pub(crate) fn next_due(&self, ordering: Ordering, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.side(ordering).next_due(now)
    }

    fn side(&self, ordering: Ordering) -> &Fronts {
        match ordering {
            Ordering::PerDestination => &self.heads,
            Ordering::Unordered => &self.fronts,
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
    /// What the current attempt of a transaction noted, to undo if the
    /// transaction is rolled back and run again (see [`Picker::undo_attempt`]).
    attempt: Vec<Noted>,
}

/// One note of an attempt, as [`Picker::undo_attempt`] takes it back.
#[derive(Debug)]
enum Noted {
    /// The key was added to `seen`.
    Seen(String),
    /// The destination was served at `tick`; before, at `before`.
    Served {
        destination: String,
        tick: u64,
        before: Option<u64>,
    },
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
        if let Some(seen) = &mut self.seen
            && seen.insert(key.to_owned())
        {
            self.attempt.push(Noted::Seen(key.to_owned()));
        }
    }

    /// Notes that an item to `destination` was claimed.
    pub(crate) fn served(&mut self, destination: &str) {
        self.tick += 1;
        let before = self.served.insert(destination.to_owned(), self.tick);
        self.attempt.push(Noted::Served {
            destination: destination.to_owned(),
            tick: self.tick,
            before,
        });
    }

    /// Starts an attempt of a transaction: what is noted from now on can be
    /// taken back with [`undo_attempt`](Self::undo_attempt).
    pub(crate) fn begin_attempt(&mut self) {
        self.attempt.clear();
    }

    /// Takes back what the attempt begun last noted (its transaction was
    /// rolled back, so nothing it looked at or claimed happened): its keys
    /// may be looked at again, and its destinations' turns are restored,
    /// unless another step served one since.
    pub(crate) fn undo_attempt(&mut self) {
        for noted in std::mem::take(&mut self.attempt).into_iter().rev() {
            match noted {
                Noted::Seen(key) => {
                    if let Some(seen) = &mut self.seen {
                        seen.remove(&key);
                    }
                }
                Noted::Served {
                    destination,
                    tick,
                    before,
                } => {
                    if self.served.get(&destination) == Some(&tick) {
                        match before {
                            Some(before) => self.served.insert(destination, before),
                            None => self.served.remove(&destination),
                        };
                    }
                }
            }
        }
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
        // Enqueue order, then (stably) least recently served first: one
        // look-up per candidate, not two per comparison.
        candidates.sort_by(|(_, a), (_, b)| a.cmp(b));
        candidates.sort_by_cached_key(|(d, _)| self.served.get(d).copied().unwrap_or(0));
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

    fn item(key: &str, destination: &str, seq: u64) -> OutboxItem {
        let at = Utc.timestamp_opt(1_000, 0).single().unwrap_or_default();
        OutboxItem {
            idempotency_key: key.into(),
            connector: "c".into(),
            grant_id: "g".into(),
            destination: destination.into(),
            content: String::new(),
            content_hash: String::new(),
            state: ItemState::Queued,
            attempts: 0,
            claim: None,
            created_at: at,
            updated_at: at,
            next_attempt_at: None,
            sent_at: None,
            error_code: None,
            lane: "l".into(),
            direction: "d".into(),
            risk_class: None,
            transport_ref: None,
            last_audit_id: None,
            cooldown_until: None,
            maybe_sent_at: None,
            failure_class: None,
            seq: Some(seq),
        }
    }

    /// `Fronts::set` leaves an unchanged entry in place; an entry for the
    /// same item with a new due moment is replaced, on the right side. (Every
    /// change today reaches it through a removal that drops the item's entry
    /// first, so only this test sees the comparison.)
    #[test]
    fn a_front_whose_due_moment_changes_is_replaced() {
        let at = Utc.timestamp_opt(1_000, 0).single().unwrap_or_default();
        let later = Utc.timestamp_opt(1_060, 0).single().unwrap_or_default();
        let place = key(1, 1_000, "a");
        let mut fronts = Fronts::default();
        let fresh = Due { at, fresh: true };
        fronts.set("chat", Some((fresh, &place)));
        fronts.set("chat", Some((fresh, &place)));
        assert_eq!(fronts.due(at).count(), 1);
        let deferred = Due {
            at: later,
            fresh: false,
        };
        fronts.set("chat", Some((deferred, &place)));
        assert_eq!(fronts.due(at).count(), 0);
        assert_eq!(fronts.next_due(at), Some(later));
        assert_eq!(
            fronts
                .due(later)
                .map(|p| p.key.as_str())
                .collect::<Vec<_>>(),
            ["a"]
        );
        fronts.set("chat", None);
        assert_eq!(fronts.next_due(at), None);
    }

    #[test]
    fn an_undone_attempt_leaves_the_picker_as_it_was_before_it() {
        let mut picker = Picker::pass(["a".to_owned(), "b".to_owned(), "c".to_owned()]);
        picker.begin_attempt();
        picker.looked_at("a");
        picker.served("chat-1");
        picker.begin_attempt();
        picker.looked_at("b");
        picker.looked_at("c");
        picker.served("chat-1");
        picker.served("chat-2");
        picker.undo_attempt();
        assert!(!picker.admits("a"), "an earlier attempt's look stands");
        assert!(
            picker.admits("b") && picker.admits("c"),
            "the undone looks are gone"
        );
        assert_eq!(picker.unseen(), ["b", "c"]);
        let mut ranked = vec![
            ("chat-1".to_owned(), key(1, 1, "x")),
            ("chat-2".to_owned(), key(2, 2, "y")),
            ("chat-3".to_owned(), key(3, 3, "z")),
        ];
        picker.rank(&mut ranked);
        let order: Vec<&str> = ranked.iter().map(|(d, _)| d.as_str()).collect();
        assert_eq!(
            order,
            ["chat-2", "chat-3", "chat-1"],
            "chat-1 keeps the earlier attempt's turn, chat-2 none"
        );
        // Undoing again takes back nothing more.
        picker.undo_attempt();
        assert!(!picker.admits("a"));
    }

    fn front_keys(lines: &Lines, ordering: Ordering) -> Vec<String> {
        let later = Utc.timestamp_opt(100_000, 0).single().unwrap_or_default();
        lines
            .due_fronts(ordering, later)
            .map(|p| p.key.clone())
            .collect()
    }

    /// Replaces `old` by `new` the way `store` applies a change.
    fn change(lines: &mut Lines, old: &OutboxItem, new: &OutboxItem) {
        lines.remove(old);
        lines.insert(new);
    }

    #[test]
    fn the_lines_index_follows_claims_retries_and_outcomes() {
        let mut lines = Lines::default();
        let (a1, a2, b1) = (item("a1", "a", 1), item("a2", "a", 2), item("b1", "b", 3));
        for i in [&a1, &a2, &b1] {
            lines.insert(i);
        }
        assert_eq!(lines.max_seq(), 3);
        assert_eq!(front_keys(&lines, Ordering::PerDestination), ["a1", "b1"]);
        // Claiming a1: a's head is in flight, so a has no front; a2 still waits.
        let mut claimed = a1.clone();
        claimed.claim = Some(crate::item::Claim {
            owner: None,
            at: None,
        });
        change(&mut lines, &a1, &claimed);
        assert_eq!(front_keys(&lines, Ordering::PerDestination), ["b1"]);
        assert_eq!(front_keys(&lines, Ordering::Unordered), ["a2", "b1"]);
        assert_eq!(lines.claimed().count(), 1);
        // A retry puts a1 back, due later: still a's head, now after b1.
        let mut retried = a1.clone();
        retried.next_attempt_at = Some(a1.created_at + chrono::Duration::seconds(5));
        change(&mut lines, &claimed, &retried);
        assert_eq!(front_keys(&lines, Ordering::PerDestination), ["b1", "a1"]);
        // Sent: a2 becomes the head.
        let mut sent = retried.clone();
        sent.state = ItemState::Sent;
        change(&mut lines, &retried, &sent);
        assert_eq!(front_keys(&lines, Ordering::PerDestination), ["a2", "b1"]);
        assert_eq!(lines.line("a").count(), 1);
        assert_eq!(lines.claimed().count(), 0);
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
    fn ranking_puts_never_served_first_then_least_recent_each_in_enqueue_order() {
        let mut picker = Picker::worker();
        picker.served("b");
        picker.served("a");
        // Given in an order that is neither: the rank alone must sort them.
        let mut candidates = vec![
            ("a".to_owned(), key(2, 0, "a2")),
            ("y".to_owned(), key(7, 0, "y7")),
            ("b".to_owned(), key(5, 0, "b5")),
            ("x".to_owned(), key(3, 0, "x3")),
            ("z".to_owned(), key(1, 0, "z1")),
        ];
        picker.rank(&mut candidates);
        let keys: Vec<&str> = candidates.iter().map(|(_, k)| k.key.as_str()).collect();
        assert_eq!(keys, ["z1", "x3", "y7", "b5", "a2"]);
    }

    /// Serves `first`, then `fillers` more destinations, so that the picker
    /// remembers `fillers + 1` turns.
    fn picker_with_turns(first: &str, fillers: usize) -> Picker {
        let mut picker = Picker::worker();
        picker.served(first);
        for i in 0..fillers {
            picker.served(&format!("filler-{i}"));
        }
        picker
    }

    #[test]
    fn up_to_the_memory_bound_a_chat_with_nothing_queued_keeps_its_turn() {
        // A flooded chat whose message is in flight is no candidate meanwhile;
        // with exactly SERVED_MEMORY turns remembered, a rank must not forget
        // its turn, or its next message would jump a chat never served.
        let mut picker = picker_with_turns("flood", SERVED_MEMORY - 1);
        picker.rank(&mut [("other".to_owned(), key(1, 0, "o1"))]);
        let mut candidates = vec![
            ("flood".to_owned(), key(2, 0, "f2")),
            ("new".to_owned(), key(3, 0, "n3")),
        ];
        picker.rank(&mut candidates);
        assert_eq!(
            candidates[0].0, "new",
            "the chat never served goes before the flood, however old the flood's message"
        );
    }

    #[test]
    fn past_the_memory_bound_chats_with_nothing_queued_are_forgotten() {
        // A worker that has served more chats than SERVED_MEMORY must not keep
        // growing: the next rank forgets every chat that is not a candidate.
        let mut picker = picker_with_turns("old", SERVED_MEMORY);
        assert_eq!(picker.served.len(), SERVED_MEMORY + 1);
        picker.rank(&mut [("other".to_owned(), key(1, 0, "o1"))]);
        assert!(
            picker.served.is_empty(),
            "{} turns still remembered",
            picker.served.len()
        );
        // Forgotten chats count as never served: enqueue order decides between them.
        let mut candidates = vec![
            ("old".to_owned(), key(3, 0, "old3")),
            ("filler-0".to_owned(), key(2, 0, "f2")),
        ];
        picker.rank(&mut candidates);
        assert_eq!(candidates[0].0, "filler-0");
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
