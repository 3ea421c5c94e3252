//! Model check of the item lifecycle (brief §3) and the per-destination rate caps (§4),
//! including the destination-wide cooldown a platform's `retry_after` imposes and
//! the pace learned from it (one send per learned interval, held by the handle).
//!
//! Proptest generates runs of: enqueue (a small pool of keys and destinations,
//! sometimes reusing a key for a different message), `process(key)` with scripted
//! `send` replies (delivered with or without a transport ref, retryable, retryable
//! with `retry_after`, permanent, ambiguous, a panic), `process_due`, clock moves,
//! clean restarts (sometimes with another `max_attempts`) and crashes in the middle
//! of a send (a claim forged for an owner that no longer exists). A small in-memory
//! model of the brief runs alongside. After every step the receipts, the items, the
//! transport-ref lookups, the clock and the audit records must be exactly the
//! model's, and a step the model says writes nothing must leave both files
//! byte-for-byte unchanged. Throughout, `send` only sees durably claimed items, and
//! no key reaches `send` again unless its previous attempt failed as retryable.
//!
//! Cases: `OUTBOX_PROPTEST_CASES` (default 64); replay: `OUTBOX_PROPTEST_SEED`.
//!
//! File-only by design: each step's "writes nothing" is checked on the files'
//! bytes, and crashes are forged in the snapshot; the same lifecycle runs on
//! both engines in the guarantee modules.

use std::collections::{BTreeMap, BTreeSet};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use durable_outbox::{
    AMBIGUOUS_AFTER_RESTART, ATTEMPTS_EXHAUSTED, AuditLog, Clock, DESTINATION_COOLDOWN,
    DESTINATION_PACED, DeliveryReceipt, DrainReport, Error, ItemState, ManualClock, NewMessage,
    Outbox, OutboxItem, Outcome, RATE_CAPPED, SEND_PANICKED, SendError, limits,
};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

use crate::harness::START;
use crate::seeded::{self, ensure};

const KEYS: [&str; 5] = ["k0", "k1", "k2", "k3", "k4"];
const DESTINATIONS: [&str; 2] = ["chat-a", "chat-b"];
/// The references replies use; every one is looked up after every step.
const REFS: [&str; 3] = ["tr-1", "tr-2", "tr-3"];
/// An owner whose process is gone: its owner file is left unlocked, as SIGKILL leaves it.
const DEAD_OWNER: &str = "999999-dead-0";

type Step = Result<(), TestCaseError>;

// ----- generated input ------------------------------------------------------

#[derive(Debug, Clone, Copy)]
struct Settings {
    max_attempts: u32,
    rate_count: u32,
    rate_window_ms: u64,
    max_inline_wait_ms: u64,
}

/// What the scripted `send` answers.
#[derive(Debug, Clone)]
enum Reply {
    Delivered(Option<String>),
    Retryable(String),
    RetryAfter(String, u64),
    Permanent(String),
    Ambiguous(String),
    Panic,
}

#[derive(Debug, Clone)]
enum Op {
    Enqueue {
        key: usize,
        destination: usize,
        other_content: bool,
    },
    /// Send calls use `replies` in turn, cycling.
    Process {
        key: usize,
        replies: Vec<Reply>,
    },
    ProcessDue {
        replies: Vec<Reply>,
    },
    Advance {
        ms: u64,
    },
    /// Drop the handle and open a new one, possibly with another `max_attempts`.
    Restart {
        max_attempts: u32,
    },
    /// Another process claimed `key` and died inside `send`.
    CrashMidSend {
        key: usize,
        owner_recorded: bool,
        reopen: bool,
    },
}

fn transport_ref() -> impl Strategy<Value = Option<String>> {
    let hostile = vec![
        " ".to_owned(),
        "\t\n".to_owned(),
        "tr\u{0}x\ny".to_owned(),
        "\u{7}".to_owned(),
        "r".repeat(600),
        "é".repeat(300),
        "\u{1F600}".repeat(130),
        "x".repeat(limits::TRANSPORT_REF),
    ];
    prop_oneof![
        6 => prop::sample::select(REFS.to_vec()).prop_map(|r| Some(r.to_owned())),
        2 => Just(None),
        2 => prop::sample::select(hostile).prop_map(Some),
    ]
}

fn error_code() -> impl Strategy<Value = String> {
    prop::sample::select(vec![
        "http_502".to_owned(),
        "http_429".to_owned(),
        String::new(),
        "   ".to_owned(),
        "bad\u{1b}[31mcode\n".to_owned(),
        "c".repeat(700),
    ])
}

fn reply() -> impl Strategy<Value = Reply> {
    prop_oneof![
        8 => transport_ref().prop_map(Reply::Delivered),
        4 => error_code().prop_map(Reply::Retryable),
        2 => (error_code(), prop::sample::select(vec![100u64, 250, 400, 1_000, 30_000]))
            .prop_map(|(c, ms)| Reply::RetryAfter(c, ms)),
        1 => error_code().prop_map(Reply::Permanent),
        1 => error_code().prop_map(Reply::Ambiguous),
        1 => Just(Reply::Panic),
    ]
}

fn replies() -> impl Strategy<Value = Vec<Reply>> {
    prop::collection::vec(reply(), 1..4)
}

fn op() -> impl Strategy<Value = Op> {
    let key = 0..KEYS.len();
    prop_oneof![
        5 => (key.clone(), 0..DESTINATIONS.len(), prop::bool::weighted(0.15)).prop_map(
            |(key, destination, other_content)| Op::Enqueue { key, destination, other_content }
        ),
        6 => (key.clone(), replies()).prop_map(|(key, replies)| Op::Process { key, replies }),
        2 => replies().prop_map(|replies| Op::ProcessDue { replies }),
        4 => prop_oneof![
            prop::sample::select(vec![1u64, 249, 250, 251, 500, 750, 1_000, 10_000, 60_000]),
            0..70_000u64,
        ]
        .prop_map(|ms| Op::Advance { ms }),
        1 => (1..=4u32).prop_map(|max_attempts| Op::Restart { max_attempts }),
        1 => (key, any::<bool>(), any::<bool>()).prop_map(|(key, owner_recorded, reopen)| {
            Op::CrashMidSend { key, owner_recorded, reopen }
        }),
    ]
}

fn settings() -> impl Strategy<Value = Settings> {
    (
        1..=4u32,
        1..=2u32,
        prop::sample::select(vec![1_000u64, 10_000, 60_000]),
        prop::sample::select(vec![0u64, 250, 1_000, 5_000]),
    )
        .prop_map(
            |(max_attempts, rate_count, rate_window_ms, max_inline_wait_ms)| Settings {
                max_attempts,
                rate_count,
                rate_window_ms,
                max_inline_wait_ms,
            },
        )
}

// ----- the model ------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq)]
struct ModelItem {
    destination: usize,
    other_content: bool,
    state: ItemState,
    attempts: u32,
    /// Set only by a forged crash: when the dead worker claimed.
    claimed_at: Option<DateTime<Utc>>,
    created_at: DateTime<Utc>,
    next_attempt_at: Option<DateTime<Utc>>,
    sent_at: Option<DateTime<Utc>>,
    error_code: Option<String>,
    transport_ref: Option<String>,
    /// Set by a retryable failure with `retry_after`: holds the whole destination.
    cooldown_until: Option<DateTime<Utc>>,
    /// The claim time of a send that failed as ambiguous: it may have left, so
    /// it counts against the cap whatever the item's state.
    maybe_sent_at: Option<DateTime<Utc>>,
    /// Enqueue order: larger than every item's before it.
    seq: u64,
}

/// The comparable part of one audit record.
#[derive(Debug, Clone, PartialEq, Eq)]
struct AuditLine {
    outcome: &'static str,
    key: String,
    attempts: u32,
    error_code: Option<String>,
    transport_ref: Option<String>,
}

/// The comparable part of a receipt; `recorded` is whether it carries an audit id.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Expected {
    key: String,
    outcome: Outcome,
    attempts: u32,
    transport_ref: Option<String>,
    error_code: Option<String>,
    next_attempt_at: Option<DateTime<Utc>>,
    recorded: bool,
}

impl Expected {
    fn of(receipt: &DeliveryReceipt) -> Self {
        Self {
            key: receipt.idempotency_key.clone(),
            outcome: receipt.outcome,
            attempts: receipt.attempts,
            transport_ref: receipt.transport_ref.clone(),
            error_code: receipt.error_code.clone(),
            next_attempt_at: receipt.next_attempt_at,
            recorded: receipt.audit_id.is_some(),
        }
    }
}

enum Decision {
    Done(Expected),
    Send,
}

#[derive(Debug, PartialEq, Eq)]
enum ProcessResult {
    NotFound,
    Receipt(Expected),
    Panicked,
}

#[derive(Debug, Default, PartialEq, Eq)]
struct DrainTally {
    sent: usize,
    failed: usize,
    deferred: usize,
    retried: usize,
    in_flight: usize,
    waiting: usize,
    receipts: Vec<Expected>,
    panicked: bool,
}

impl DrainTally {
    fn add(&mut self, expected: Expected, retried: bool) {
        match expected.outcome {
            Outcome::Sent => self.sent += 1,
            Outcome::Failed => self.failed += 1,
            Outcome::InFlight => self.in_flight += 1,
            Outcome::Waiting => self.waiting += 1,
            Outcome::Deferred if retried => self.retried += 1,
            Outcome::Deferred => self.deferred += 1,
        }
        self.receipts.push(expected);
    }

    fn of(report: &DrainReport) -> Self {
        Self {
            sent: report.sent,
            failed: report.failed,
            deferred: report.deferred,
            retried: report.retried,
            in_flight: report.in_flight,
            waiting: report.waiting,
            receipts: {
                let mut receipts: Vec<Expected> =
                    report.receipts.iter().map(Expected::of).collect();
                receipts.sort_by(|a, b| a.key.cmp(&b.key));
                receipts
            },
            panicked: false,
        }
    }
}

/// What the outbox stores for a caller's code or reference: control characters
/// replaced, never blank, at most `TRANSPORT_REF` bytes cut on a char boundary.
fn sanitized(text: &str) -> String {
    let mapped: String = text
        .chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect();
    let mut clean = if mapped.trim().is_empty() {
        "unspecified".to_owned()
    } else {
        mapped
    };
    let mut cut = clean.len().min(limits::TRANSPORT_REF);
    while !clean.is_char_boundary(cut) {
        cut -= 1;
    }
    clean.truncate(cut);
    clean
}

fn millis(ms: u64) -> chrono::Duration {
    chrono::Duration::milliseconds(ms as i64)
}

/// An item's place in its destination's line: sequence, creation time, key.
type Place = (u64, DateTime<Utc>, String);

struct Model {
    settings: Settings,
    now: DateTime<Utc>,
    items: BTreeMap<String, ModelItem>,
    audit: Vec<AuditLine>,
    /// Per destination, the latest `retry_after` moment: it belongs to the
    /// destination, whatever becomes of the item that received it.
    cooldowns: BTreeMap<usize, DateTime<Utc>>,
    /// Per destination, the learned pace: the interval between sends and until
    /// when it holds. It lives in the open handle: a restart forgets it.
    /// (interval, held until, the moment the last refusal named)
    paces: BTreeMap<usize, (chrono::Duration, DateTime<Utc>, DateTime<Utc>)>,
}

/// How long a learned pace holds after the 429 that set or confirmed it.
const PACE_MEMORY_MS: u64 = 2 * 60 * 1000;
/// The longest pace learned.
const PACE_LONGEST_MS: u64 = 5 * 60 * 1000;

impl Model {
    fn item(&mut self, key: &str) -> &mut ModelItem {
        self.items.get_mut(key).expect("model item exists")
    }

    fn record(&mut self, key: &str, outcome: &'static str) {
        let item = &self.items[key];
        self.audit.push(AuditLine {
            outcome,
            key: key.to_owned(),
            attempts: item.attempts,
            error_code: item.error_code.clone(),
            transport_ref: item.transport_ref.clone(),
        });
    }

    fn expect(&self, key: &str, outcome: Outcome, recorded: bool) -> Expected {
        let item = &self.items[key];
        Expected {
            key: key.to_owned(),
            outcome,
            attempts: item.attempts,
            transport_ref: item.transport_ref.clone(),
            error_code: item.error_code.clone(),
            next_attempt_at: item.next_attempt_at,
            recorded,
        }
    }

    /// Fails a claimed item whose send may have left: it keeps counting as a
    /// send from its claim time.
    fn fail_ambiguous(&mut self, key: &str, code: &str) -> Expected {
        let item = self.item(key);
        item.maybe_sent_at = item.claimed_at;
        self.fail(key, code)
    }

    fn fail(&mut self, key: &str, code: &str) -> Expected {
        let item = self.item(key);
        item.state = ItemState::Failed;
        item.claimed_at = None;
        item.next_attempt_at = None;
        item.error_code = Some(code.to_owned());
        self.record(key, "failed");
        self.expect(key, Outcome::Failed, true)
    }

    /// Every send and claim time of `destination` (what the rate rules count).
    fn send_times(&self, destination: usize) -> Vec<DateTime<Utc>> {
        self.items
            .values()
            .filter(|i| i.destination == destination)
            .flat_map(|i| {
                let current = match i.state {
                    ItemState::Sent => i.sent_at,
                    ItemState::Queued => i.claimed_at,
                    ItemState::Failed => None,
                };
                current.into_iter().chain(i.maybe_sent_at)
            })
            .collect()
    }

    /// §4: `None` if a send to `destination` may start now, else when a slot of
    /// the rate cap frees.
    fn free_slot(&self, destination: usize) -> Option<DateTime<Utc>> {
        let window = millis(self.settings.rate_window_ms);
        let count = self.settings.rate_count as usize;
        let mut recent: Vec<DateTime<Utc>> = self
            .send_times(destination)
            .into_iter()
            .filter(|t| *t > self.now - window)
            .collect();
        if recent.len() < count {
            return None;
        }
        recent.sort();
        // The slot frees when all but `count - 1` of them have left the window.
        Some(recent[recent.len() - count] + window)
    }

    /// A platform's `retry_after` holds its whole destination until its
    /// moment, whatever happens to the item that received it.
    fn cooldown(&self, destination: usize) -> Option<DateTime<Utc>> {
        self.cooldowns
            .get(&destination)
            .copied()
            .filter(|until| *until > self.now)
    }

    /// With a learned pace: when the next send to `destination` may start
    /// (the pace after its latest send), if that is later than now.
    fn paced(&self, destination: usize) -> Option<DateTime<Utc>> {
        let (interval, until, _) = *self.paces.get(&destination)?;
        if until <= self.now {
            return None;
        }
        self.send_times(destination)
            .into_iter()
            .filter(|t| *t >= self.now - interval)
            .max()
            .map(|last| last + interval)
            .filter(|free| *free > self.now)
    }

    /// Learns a pace from a `retry_after` of `hint_ms` on the send of `key`,
    /// started at `started` (the gap since the destination's previous send,
    /// plus the hint; only ever raised while it holds).
    fn learn_pace(
        &mut self,
        destination: usize,
        started: DateTime<Utc>,
        hint_ms: u64,
    ) -> Option<DateTime<Utc>> {
        let previous = self
            .send_times(destination)
            .into_iter()
            .filter(|t| *t >= started - millis(PACE_MEMORY_MS) && *t < started)
            .max();
        let gap = previous.map_or(chrono::Duration::zero(), |at| started - at);
        let now = self.now;
        // Since the previous refusal's moment, the accepted sends refilled the
        // bucket up to this one's: the interval is the span over their count.
        let allowed_at = started + millis(hint_ms);
        let since_last = self
            .paces
            .get(&destination)
            .filter(|(_, until, _)| *until > now)
            .and_then(|(_, _, last)| {
                let accepted = self
                    .send_times(destination)
                    .into_iter()
                    .filter(|t| *t >= *last && *t < started)
                    .count() as i64;
                let span = (allowed_at - *last).num_microseconds().expect("small");
                (accepted > 0 && span >= 0).then(|| span / accepted)
            });
        // The larger estimate and a quarter more, in whole microseconds.
        let by_gap = (gap + millis(hint_ms)).num_microseconds().expect("small");
        let estimate = by_gap.max(since_last.unwrap_or(0)) * 5 / 4;
        let interval = chrono::Duration::microseconds(estimate).min(millis(PACE_LONGEST_MS));
        let pace = self
            .paces
            .entry(destination)
            .or_insert((interval, now, allowed_at));
        pace.0 = if pace.1 <= now {
            interval
        } else {
            pace.0.max(interval)
        };
        pace.1 = now + millis(PACE_MEMORY_MS);
        pace.2 = allowed_at;
        let interval = pace.0;
        previous.map(|at| at + interval)
    }

    /// When a send to `destination` may start, if not now, and which limit
    /// decides: the latest of the rate cap, a cooldown and the pace (the later
    /// one in that order on a tie).
    fn held_until(&self, destination: usize) -> Option<(DateTime<Utc>, &'static str)> {
        let capped = self.free_slot(destination).map(|at| (at, RATE_CAPPED));
        let cooled = self
            .cooldown(destination)
            .map(|at| (at, DESTINATION_COOLDOWN));
        let paced = self.paced(destination).map(|at| (at, DESTINATION_PACED));
        [capped, cooled, paced].into_iter().flatten().fold(
            None,
            |best: Option<(DateTime<Utc>, &'static str)>, c| match best {
                Some(b) if b.0 > c.0 => Some(b),
                _ => Some(c),
            },
        )
    }

    /// Whether `process` would hand `key` to `send` right now.
    fn would_claim(&self, key: &str) -> bool {
        self.items.get(key).is_some_and(|item| {
            item.state == ItemState::Queued
                && item.claimed_at.is_none()
                && item.attempts < self.settings.max_attempts
                && item.next_attempt_at.is_none_or(|at| at <= self.now)
                && self.held_until(item.destination).is_none()
        })
    }

    /// §3/§4: what `process` does before sending. `None` for an unknown key.
    fn decide(&mut self, key: &str) -> Option<Decision> {
        let item = self.items.get(key)?;
        let done = match item.state {
            ItemState::Sent => Some(self.expect(key, Outcome::Sent, true)),
            ItemState::Failed => Some(self.expect(key, Outcome::Failed, true)),
            ItemState::Queued if item.claimed_at.is_some() => {
                Some(self.fail_ambiguous(key, AMBIGUOUS_AFTER_RESTART))
            }
            // Per-destination order: only the destination's earliest queued item goes.
            ItemState::Queued if self.head(item.destination).as_deref() != Some(key) => {
                Some(self.expect(key, Outcome::Waiting, false))
            }
            ItemState::Queued if item.attempts >= self.settings.max_attempts => {
                Some(self.fail(key, ATTEMPTS_EXHAUSTED))
            }
            ItemState::Queued if item.next_attempt_at.is_some_and(|at| at > self.now) => {
                Some(self.expect(key, Outcome::Deferred, false))
            }
            ItemState::Queued => self.held_until(item.destination).map(|(free_at, code)| {
                let item = self.item(key);
                item.next_attempt_at = Some(free_at);
                item.error_code = Some(code.to_owned());
                self.record(key, "deferred");
                self.expect(key, Outcome::Deferred, true)
            }),
        };
        if let Some(done) = done {
            return Some(Decision::Done(done));
        }
        let now = self.now;
        let item = self.item(key);
        item.attempts += 1;
        item.claimed_at = Some(now);
        item.next_attempt_at = None;
        item.error_code = None;
        Some(Decision::Send)
    }

    /// §3: records what `send` replied; returns the receipt and the retry wait.
    fn finish(&mut self, key: &str, reply: &Reply) -> (Expected, Option<u64>) {
        let now = self.now;
        let max_attempts = self.settings.max_attempts;
        let (code, hint, retryable) = match reply {
            Reply::Delivered(transport_ref) => {
                let item = self.item(key);
                item.state = ItemState::Sent;
                item.claimed_at = None;
                item.sent_at = Some(now);
                item.error_code = None;
                item.transport_ref = transport_ref
                    .as_deref()
                    .filter(|r| !r.trim().is_empty())
                    .map(sanitized);
                self.record(key, "sent");
                return (self.expect(key, Outcome::Sent, true), None);
            }
            Reply::Panic => return (self.fail_ambiguous(key, SEND_PANICKED), None),
            Reply::Ambiguous(code) => return (self.fail_ambiguous(key, &sanitized(code)), None),
            Reply::Retryable(code) => (code, 0, true),
            Reply::RetryAfter(code, ms) => (code, *ms, true),
            Reply::Permanent(code) => (code, 0, false),
        };
        // A `retry_after` is platform pacing: it does not consume an attempt.
        let paced = matches!(reply, Reply::RetryAfter(..));
        let item = self.item(key);
        // The reference backoff: 250 ms after the first attempt, 500 ms after later ones.
        let backoff = if item.attempts <= 1 { 250 } else { 500 };
        let wait = backoff.max(hint);
        if retryable && now + millis(wait) > item.created_at + chrono::Duration::days(1) {
            return (self.fail(key, durable_outbox::GAVE_UP), None);
        }
        if !(retryable && (paced || item.attempts < max_attempts)) {
            return (self.fail(key, &sanitized(code)), None);
        }
        if paced {
            item.attempts -= 1;
        }
        let pace_free = if paced {
            let (destination, started) = (item.destination, item.claimed_at.unwrap_or(now));
            self.learn_pace(destination, started, hint)
        } else {
            None
        };
        let item = self.item(key);
        item.claimed_at = None;
        item.cooldown_until = matches!(reply, Reply::RetryAfter(..)).then(|| now + millis(hint));
        if let Some(until) = item.cooldown_until {
            let destination = item.destination;
            let held = self.cooldowns.entry(destination).or_insert(until);
            *held = (*held).max(until);
        }
        let item = self.item(key);
        item.error_code = Some(sanitized(code));
        item.next_attempt_at = Some((now + millis(wait)).max(pace_free.unwrap_or(now)));
        self.record(key, "retrying");
        (self.expect(key, Outcome::Deferred, true), Some(wait))
    }

    fn process(&mut self, key: &str, replies: &[Reply], sends: &mut Vec<String>) -> ProcessResult {
        let mut calls = 0;
        loop {
            match self.decide(key) {
                None => return ProcessResult::NotFound,
                Some(Decision::Done(expected)) => return ProcessResult::Receipt(expected),
                Some(Decision::Send) => {}
            }
            let reply = &replies[calls % replies.len()];
            calls += 1;
            sends.push(key.to_owned());
            let (expected, wait) = self.finish(key, reply);
            if matches!(reply, Reply::Panic) {
                return ProcessResult::Panicked;
            }
            match wait {
                Some(ms)
                    if ms <= self.settings.max_inline_wait_ms
                        && calls < self.settings.max_attempts as usize =>
                {
                    self.now += millis(ms);
                }
                _ => return ProcessResult::Receipt(expected),
            }
        }
    }

    /// The place of an item in its destination's line.
    fn place(&self, key: &str) -> Place {
        let item = &self.items[key];
        (item.seq, item.created_at, key.to_owned())
    }

    /// A destination's head: its queued item enqueued first.
    fn head(&self, destination: usize) -> Option<String> {
        self.items
            .iter()
            .filter(|(_, i)| i.destination == destination && i.state == ItemState::Queued)
            .map(|(key, _)| self.place(key))
            .min()
            .map(|(_, _, key)| key)
    }

    /// One pass over the items due when it starts, each looked at once. Each
    /// step records the previous send and claims the next: among the
    /// destinations' heads that are due (or carry a claim), the destination
    /// served least recently goes first, then the earliest enqueued. A panic
    /// in `send` is recorded and ends the pass. Keys never reached and still
    /// queued are reported as waiting.
    fn process_due(&mut self, replies: &[Reply], sends: &mut Vec<String>) -> DrainTally {
        let due: BTreeSet<String> = self
            .items
            .iter()
            .filter(|(_, i)| i.state == ItemState::Queued)
            .filter(|(_, i)| i.next_attempt_at.is_none_or(|at| at <= self.now))
            .map(|(key, _)| key.clone())
            .collect();
        let mut seen = BTreeSet::new();
        let mut served: BTreeMap<usize, u64> = BTreeMap::new();
        let mut tick = 0;
        let mut tally = DrainTally::default();
        let mut calls = 0;
        loop {
            let mut tried = BTreeSet::new();
            let mut claimed = None;
            'pick: loop {
                let mut candidates: Vec<(u64, Place, usize)> = (0..DESTINATIONS.len())
                    .filter_map(|d| self.head(d).map(|key| (d, key)))
                    .filter(|(_, key)| {
                        let item = &self.items[key];
                        (item.claimed_at.is_some()
                            || item.next_attempt_at.is_none_or(|at| at <= self.now))
                            && due.contains(key)
                            && !seen.contains(key)
                            && !tried.contains(key)
                    })
                    .map(|(d, key)| (served.get(&d).copied().unwrap_or(0), self.place(&key), d))
                    .collect();
                if candidates.is_empty() {
                    break;
                }
                candidates.sort();
                for (_, (_, _, key), destination) in candidates {
                    seen.insert(key.clone());
                    match self.decide(&key) {
                        None => unreachable!("due keys exist"),
                        Some(Decision::Done(expected)) => tally.add(expected, false),
                        Some(Decision::Send) => {
                            tick += 1;
                            served.insert(destination, tick);
                            claimed = Some(key);
                            break 'pick;
                        }
                    }
                    tried.insert(key);
                }
            }
            let Some(key) = claimed else { break };
            let reply = replies[calls % replies.len()].clone();
            calls += 1;
            sends.push(key.clone());
            let (expected, wait) = self.finish(&key, &reply);
            if matches!(reply, Reply::Panic) {
                tally.panicked = true;
                return tally;
            }
            tally.add(expected, wait.is_some());
        }
        for key in due.difference(&seen) {
            let item = &self.items[key];
            if item.state == ItemState::Queued && item.claimed_at.is_none() {
                tally.add(self.expect(key, Outcome::Waiting, false), false);
            }
        }
        tally.receipts.sort_by(|a, b| a.key.cmp(&b.key));
        tally
    }

    /// The item `find_by_transport_ref` must return: the first by key.
    fn find_ref(&self, transport_ref: &str) -> Option<String> {
        self.items
            .iter()
            .find(|(_, i)| i.transport_ref.as_deref() == Some(transport_ref))
            .map(|(key, _)| key.clone())
    }
}

// ----- the real outbox --------------------------------------------------------

/// Every hand-off to `send`, and any breach of the at-most-once rule.
#[derive(Default)]
struct Hands {
    /// Per key: hand-offs so far, and whether the last one failed as retryable.
    per_key: BTreeMap<String, (u32, bool)>,
    violations: Vec<String>,
}

impl Hands {
    fn hand(&mut self, key: &str, how: &str) {
        let (count, retryable) = self.per_key.entry(key.to_owned()).or_default();
        if *count > 0 && !*retryable {
            self.violations.push(format!(
                "at-most-once broken: {key} handed to send ({how}) a {}th time although \
                 its previous attempt did not fail as retryable",
                *count + 1
            ));
        }
        *count += 1;
        *retryable = false;
    }

    fn failed_retryable(&mut self, key: &str) {
        if let Some(entry) = self.per_key.get_mut(key) {
            entry.1 = true;
        }
    }
}

fn message(key: &str, destination: usize, other_content: bool) -> NewMessage {
    NewMessage {
        idempotency_key: key.to_owned(),
        connector: "telegram".into(),
        grant_id: "grant-1".into(),
        destination: DESTINATIONS[destination].to_owned(),
        content: if other_content {
            format!("another body for {key}")
        } else {
            format!("body of {key}")
        },
        ..Default::default()
    }
}

fn open(dir: &std::path::Path, clock: &ManualClock, settings: Settings) -> Outbox {
    Outbox::builder(dir)
        .clock(clock.clone())
        .sleeper(clock.clone())
        .max_attempts(settings.max_attempts)
        // The model's backoff: the reference design's 250 ms, then 500 ms.
        .backoff(durable_outbox::Backoff::Fixed(vec![
            Duration::from_millis(250),
            Duration::from_millis(500),
        ]))
        .give_up_after(Duration::from_secs(86_400))
        .rate_limit(
            settings.rate_count,
            Duration::from_millis(settings.rate_window_ms),
        )
        .max_inline_wait(Duration::from_millis(settings.max_inline_wait_ms))
        .update_settings()
        .open()
        .expect("open the outbox")
}

/// The scripted transport: checks the claim is on disk, then answers from `replies`.
fn scripted<'a>(
    probe: &'a Outbox,
    replies: &'a [Reply],
    hands: &'a mut Hands,
    sends: &'a mut Vec<String>,
) -> impl FnMut(&OutboxItem) -> Result<Option<String>, SendError> + 'a {
    let mut calls = 0;
    move |item| {
        let key = item.idempotency_key().to_owned();
        let on_disk = probe.get(&key).ok().flatten();
        if !on_disk
            .as_ref()
            .is_some_and(|d| d.dispatch_claimed() && d.attempts() == item.attempts())
        {
            hands.violations.push(format!(
                "claim-before-send broken: {key} reached send without its claim on disk \
                 (on disk: {on_disk:?})"
            ));
        }
        hands.hand(&key, "send");
        sends.push(key.clone());
        let reply = &replies[calls % replies.len()];
        calls += 1;
        match reply {
            Reply::Delivered(transport_ref) => Ok(transport_ref.clone()),
            Reply::Retryable(code) => {
                hands.failed_retryable(&key);
                Err(SendError::retryable(code.clone()))
            }
            Reply::RetryAfter(code, ms) => {
                hands.failed_retryable(&key);
                Err(SendError::retryable(code.clone()).retry_after(Duration::from_millis(*ms)))
            }
            Reply::Permanent(code) => Err(SendError::permanent(code.clone())),
            Reply::Ambiguous(code) => Err(SendError::ambiguous(code.clone())),
            Reply::Panic => panic!("model_check: scripted panic inside send for {key}"),
        }
    }
}

/// A fresh directory for one run. The model checks logic, not durability, so the
/// runs use a memory filesystem when there is one: every fresh journal is
/// preallocated and fsynced, which would otherwise dominate the run time.
fn scratch_dir() -> tempfile::TempDir {
    let shm = std::path::Path::new("/dev/shm");
    if shm.is_dir()
        && let Ok(dir) = tempfile::Builder::new()
            .prefix("outbox-model-")
            .tempdir_in(shm)
    {
        return dir;
    }
    tempfile::tempdir().expect("temp dir")
}

struct Run {
    dir: tempfile::TempDir,
    clock: ManualClock,
    outbox: Option<Outbox>,
    settings: Settings,
    hands: Hands,
    model: Model,
}

impl Run {
    fn new(settings: Settings) -> Self {
        let dir = scratch_dir();
        let clock = ManualClock::at(START).expect("start time");
        let outbox = open(dir.path(), &clock, settings);
        let now = clock.now();
        Self {
            dir,
            clock,
            outbox: Some(outbox),
            settings,
            hands: Hands::default(),
            model: Model {
                settings,
                now,
                items: BTreeMap::new(),
                audit: Vec::new(),
                cooldowns: BTreeMap::new(),
                paces: BTreeMap::new(),
            },
        }
    }

    fn outbox(&self) -> &Outbox {
        self.outbox.as_ref().expect("open handle")
    }

    /// The state files (snapshot and journal) and the audit log.
    fn files(&self) -> (Vec<u8>, Vec<u8>) {
        let read = |name: &str| std::fs::read(self.dir.path().join(name)).unwrap_or_default();
        (
            [read("outbox.json"), read("outbox.journal")].concat(),
            read("audit.jsonl"),
        )
    }

    fn restart(&mut self) {
        self.model.paces.clear();
        drop(self.outbox.take());
        self.outbox = Some(open(self.dir.path(), &self.clock, self.settings));
    }

    fn step(&mut self, op: &Op) -> Step {
        let audit_before = self.model.audit.len();
        let files_before = self.files();
        match op {
            Op::Enqueue {
                key,
                destination,
                other_content,
            } => self.enqueue(KEYS[*key], *destination, *other_content)?,
            Op::Process { key, replies } => self.process(KEYS[*key], replies)?,
            Op::ProcessDue { replies } => self.process_due(replies)?,
            Op::Advance { ms } => {
                self.clock.advance(Duration::from_millis(*ms));
                self.model.now += millis(*ms);
            }
            Op::Restart { max_attempts } => {
                // The restart stores its new max_attempts (`update_settings`): a
                // change of a stored setting is audited. An outbox that has
                // recorded nothing yet stores its settings with its first change.
                let changed = *max_attempts != self.settings.max_attempts;
                let stored = !self.model.audit.is_empty();
                self.settings.max_attempts = *max_attempts;
                self.model.settings.max_attempts = *max_attempts;
                self.restart();
                if changed && stored {
                    self.model.audit.push(AuditLine {
                        outcome: "settings",
                        key: "settings".into(),
                        attempts: 0,
                        error_code: None,
                        transport_ref: None,
                    });
                } else {
                    // Opening may compact the snapshot, but it never records an outcome.
                    ensure(self.files().1 == files_before.1, || {
                        "a clean restart changed audit.jsonl".into()
                    })?;
                }
            }
            Op::CrashMidSend {
                key,
                owner_recorded,
                reopen,
            } => {
                if self.model.would_claim(KEYS[*key]) {
                    self.forge_dead_claim(KEYS[*key], *owner_recorded);
                    // The claim reached the disk before the crash; the send may have left.
                    self.hands.hand(KEYS[*key], "a send that crashed");
                    let now = self.model.now;
                    let item = self.model.item(KEYS[*key]);
                    item.attempts += 1;
                    item.claimed_at = Some(now);
                    item.next_attempt_at = None;
                    item.error_code = None;
                }
                if *reopen {
                    self.restart();
                }
                ensure(self.files().1 == files_before.1, || {
                    "a crash and restart changed audit.jsonl without any outcome".into()
                })?;
            }
        }
        let writes_expected = self.model.audit.len() != audit_before;
        if !writes_expected && !matches!(op, Op::CrashMidSend { .. } | Op::Restart { .. }) {
            ensure(self.files() == files_before, || {
                "a step that records no outcome changed outbox.json, outbox.journal or audit.jsonl"
                    .into()
            })?;
        }
        self.compare()
    }

    fn enqueue(&mut self, key: &str, destination: usize, other_content: bool) -> Step {
        let result = self
            .outbox()
            .enqueue(message(key, destination, other_content));
        let expected_conflict = self.model.items.get(key).and_then(|existing| {
            if existing.destination != destination {
                Some("destination")
            } else if existing.other_content != other_content {
                Some("content")
            } else {
                None
            }
        });
        match (result, expected_conflict) {
            (Err(Error::IdempotencyConflict { field, .. }), Some(expected)) => {
                ensure(field == expected, || {
                    format!("idempotency conflict on {key} names {field}, expected {expected}")
                })
            }
            (Ok(item), None) => {
                if !self.model.items.contains_key(key) {
                    let now = self.model.now;
                    self.model.items.insert(
                        key.to_owned(),
                        ModelItem {
                            destination,
                            other_content,
                            state: ItemState::Queued,
                            attempts: 0,
                            claimed_at: None,
                            created_at: now,
                            next_attempt_at: None,
                            sent_at: None,
                            error_code: None,
                            transport_ref: None,
                            cooldown_until: None,
                            maybe_sent_at: None,
                            seq: self.model.items.values().map(|i| i.seq).max().unwrap_or(0) + 1,
                        },
                    );
                    self.model.record(key, "queued");
                }
                let expected = observed_model(key, &self.model.items[key]);
                ensure(observed(&item) == expected, || {
                    format!(
                        "enqueue({key}) returned {:?}, the model has {expected:?}",
                        observed(&item)
                    )
                })
            }
            (result, expected) => Err(TestCaseError::fail(format!(
                "enqueue({key}) gave {result:?}; the model expects a conflict on {expected:?}"
            ))),
        }
    }

    fn process(&mut self, key: &str, replies: &[Reply]) -> Step {
        let mut expected_sends = Vec::new();
        let expected = self.model.process(key, replies, &mut expected_sends);
        let mut sends = Vec::new();
        let outbox = self.outbox.clone().expect("open handle");
        let result = {
            let mut send = scripted(&outbox, replies, &mut self.hands, &mut sends);
            catch_unwind(AssertUnwindSafe(|| outbox.process(key, &mut send)))
        };
        ensure(sends == expected_sends, || {
            format!(
                "process({key}) called send for {sends:?}, the model expects {expected_sends:?}"
            )
        })?;
        let actual = match result {
            Err(_) => ProcessResult::Panicked,
            Ok(Err(Error::NotFound { .. })) => ProcessResult::NotFound,
            Ok(Err(e)) => {
                return Err(TestCaseError::fail(format!(
                    "process({key}) failed unexpectedly: {e}"
                )));
            }
            Ok(Ok(receipt)) => {
                self.check_audit_id(&receipt)?;
                ProcessResult::Receipt(Expected::of(&receipt))
            }
        };
        ensure(actual == expected, || {
            format!("process({key}) returned {actual:?}, the model expects {expected:?}")
        })
    }

    fn process_due(&mut self, replies: &[Reply]) -> Step {
        let mut expected_sends = Vec::new();
        let expected = self.model.process_due(replies, &mut expected_sends);
        let mut sends = Vec::new();
        let outbox = self.outbox.clone().expect("open handle");
        let result = {
            let mut send = scripted(&outbox, replies, &mut self.hands, &mut sends);
            catch_unwind(AssertUnwindSafe(|| outbox.process_due(&mut send)))
        };
        ensure(sends == expected_sends, || {
            format!("process_due called send for {sends:?}, the model expects {expected_sends:?}")
        })?;
        let actual = match result {
            Err(_) => DrainTally {
                panicked: true,
                ..DrainTally::default()
            },
            Ok(Err(e)) => {
                return Err(TestCaseError::fail(format!(
                    "process_due failed unexpectedly: {e}"
                )));
            }
            Ok(Ok(report)) => {
                for receipt in &report.receipts {
                    self.check_audit_id(receipt)?;
                }
                DrainTally::of(&report)
            }
        };
        // A panic ends the pass: only the items' states tell what happened before it.
        let expected = if expected.panicked {
            DrainTally {
                panicked: true,
                ..DrainTally::default()
            }
        } else {
            expected
        };
        ensure(actual == expected, || {
            format!("process_due reported {actual:?}, the model expects {expected:?}")
        })
    }

    /// A receipt's audit id is the audit record of the item's latest outcome.
    fn check_audit_id(&self, receipt: &DeliveryReceipt) -> Step {
        let Some(id) = &receipt.audit_id else {
            return Ok(());
        };
        let item = self
            .outbox()
            .get(&receipt.idempotency_key)
            .expect("get")
            .expect("a receipt's item exists");
        ensure(item.last_audit_id() == Some(id.as_str()), || {
            format!(
                "receipt for {} carries audit id {id}, but the item's last audit id is {:?}",
                receipt.idempotency_key,
                item.last_audit_id()
            )
        })
    }

    /// Writes a claim into outbox.json as a worker that then died would have left it.
    fn forge_dead_claim(&self, key: &str, owner_recorded: bool) {
        // Fold the journal into the snapshot first, so the snapshot holds every item.
        self.outbox().compact().expect("compact");
        let path = self.dir.path().join("outbox.json");
        let mut state: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).expect("read outbox.json"))
                .expect("outbox.json parses");
        let now = self.model.now.to_rfc3339_opts(SecondsFormat::Micros, true);
        let item = state["items"]
            .as_array_mut()
            .expect("items")
            .iter_mut()
            .find(|i| i["idempotency_key"] == key)
            .expect("the item to claim");
        let attempts = item["attempts"].as_u64().expect("attempts");
        item["attempts"] = (attempts + 1).into();
        item["dispatch_claimed"] = true.into();
        item["next_attempt_at_utc"] = serde_json::Value::Null;
        item["error_code"] = serde_json::Value::Null;
        item["updated_at_utc"] = now.clone().into();
        if owner_recorded {
            crate::harness::plant_dead_owner(self.dir.path(), DEAD_OWNER);
            item["claim_owner"] = DEAD_OWNER.into();
            item["claimed_at_utc"] = now.into();
        }
        std::fs::write(&path, serde_json::to_vec_pretty(&state).expect("serialise"))
            .expect("write the forged claim");
    }

    /// Everything observable must be the model's.
    fn compare(&self) -> Step {
        ensure(self.clock.now() == self.model.now, || {
            format!(
                "inline retry waits: the clock is at {}, the model at {}",
                self.clock.now(),
                self.model.now
            )
        })?;
        let items = self.outbox().list_items().expect("list items");
        let actual: BTreeMap<String, Observed> = items
            .iter()
            .map(|i| (i.idempotency_key().to_owned(), observed(i)))
            .collect();
        let expected: BTreeMap<String, Observed> = self
            .model
            .items
            .iter()
            .map(|(key, item)| (key.clone(), observed_model(key, item)))
            .collect();
        ensure(actual == expected, || {
            format!(
                "items differ from the model (§3 lifecycle, §4 caps):\n  outbox: {actual:#?}\n  model:  {expected:#?}"
            )
        })?;
        let hostile: Vec<String> = items
            .iter()
            .filter_map(|i| i.transport_ref().map(str::to_owned))
            .collect();
        for transport_ref in REFS.iter().map(|r| (*r).to_owned()).chain(hostile) {
            let found = self
                .outbox()
                .find_by_transport_ref(&transport_ref)
                .expect("find_by_transport_ref")
                .map(|i| i.idempotency_key().to_owned());
            let expected = self.model.find_ref(&transport_ref);
            ensure(found == expected, || {
                format!(
                    "find_by_transport_ref({transport_ref:?}) found {found:?}, the model {expected:?}"
                )
            })?;
        }
        let records = AuditLog::read(self.dir.path().join("audit.jsonl")).expect("read audit");
        let actual: Vec<AuditLine> = records
            .iter()
            .map(|r| AuditLine {
                outcome: r.outcome.as_str(),
                key: r.idempotency_key.clone(),
                attempts: r.attempts,
                error_code: r.error_code.clone(),
                transport_ref: r.transport_ref.clone(),
            })
            .collect();
        ensure(actual == self.model.audit, || {
            format!(
                "audit records differ from the model (one record per outcome, §5):\n  log:   {actual:#?}\n  model: {:#?}",
                self.model.audit
            )
        })?;
        ensure(records.iter().all(|r| !r.reconciled), || {
            "a record was marked reconciled although no write was ever interrupted".into()
        })?;
        ensure(self.hands.violations.is_empty(), || {
            self.hands.violations.join("\n")
        })
    }

    fn finish(&self) -> Step {
        let report = self
            .outbox()
            .verify_audit()
            .map_err(|e| TestCaseError::fail(format!("audit chain does not verify: {e}")))?;
        ensure(report.records == self.model.audit.len() as u64, || {
            format!(
                "verify_audit counted {} records, the model {}",
                report.records,
                self.model.audit.len()
            )
        })?;
        AuditLog::verify(self.dir.path().join("audit.jsonl"))
            .map_err(|e| TestCaseError::fail(format!("AuditLog::verify failed: {e}")))?;
        Ok(())
    }
}

/// The fields of an item the model predicts.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Observed {
    destination: String,
    content: String,
    state: ItemState,
    attempts: u32,
    claimed: bool,
    created_at: DateTime<Utc>,
    next_attempt_at: Option<DateTime<Utc>>,
    sent_at: Option<DateTime<Utc>>,
    error_code: Option<String>,
    transport_ref: Option<String>,
    cooldown_until: Option<DateTime<Utc>>,
}

fn observed(item: &OutboxItem) -> Observed {
    Observed {
        destination: item.destination().to_owned(),
        content: item.content().to_owned(),
        state: item.state(),
        attempts: item.attempts(),
        claimed: item.dispatch_claimed(),
        created_at: item.created_at(),
        next_attempt_at: item.next_attempt_at(),
        sent_at: item.sent_at(),
        error_code: item.error_code().map(str::to_owned),
        transport_ref: item.transport_ref().map(str::to_owned),
        cooldown_until: item.cooldown_until(),
    }
}

fn observed_model(key: &str, item: &ModelItem) -> Observed {
    let m = message(key, item.destination, item.other_content);
    Observed {
        destination: m.destination,
        content: m.content,
        state: item.state,
        attempts: item.attempts,
        claimed: item.claimed_at.is_some(),
        created_at: item.created_at,
        next_attempt_at: item.next_attempt_at,
        sent_at: item.sent_at,
        error_code: item.error_code.clone(),
        transport_ref: item.transport_ref.clone(),
        cooldown_until: item.cooldown_until,
    }
}

#[test]
fn random_runs_match_the_lifecycle_and_rate_cap_model() {
    let strategy = (settings(), prop::collection::vec(op(), 1..48));
    seeded::check(
        "model_check",
        64,
        &strategy,
        |(settings, ops): (Settings, Vec<Op>)| {
            let mut run = Run::new(settings);
            for (index, op) in ops.iter().enumerate() {
                run.step(op)
                    .map_err(|e| TestCaseError::fail(format!("step {index} ({op:?}): {e}")))?;
            }
            run.finish()
        },
    );
}

/// After a panic in `send`, `process_due` leaves every item it had not handed to
/// `send` exactly as it was. The model check relies on that; this pins it down.
#[test]
fn a_panic_in_process_due_leaves_the_items_not_yet_sent_unchanged() {
    let dir = tempfile::tempdir().expect("temp dir");
    let clock = ManualClock::at(START).expect("start time");
    let outbox = Outbox::builder(dir.path())
        .clock(clock.clone())
        .sleeper(clock.clone())
        .max_inline_wait(Duration::ZERO)
        .open()
        .expect("open");
    outbox.enqueue(message("a", 0, false)).expect("enqueue a");
    clock.advance(Duration::from_millis(1));
    outbox.enqueue(message("b", 1, false)).expect("enqueue b");
    let retried = outbox
        .process("b", |_| Err(SendError::retryable("http_502")))
        .expect("process b");
    assert_eq!(retried.outcome, Outcome::Deferred);
    clock.advance(Duration::from_millis(250));
    let before = outbox.get("b").expect("get").expect("b");
    let drained = catch_unwind(AssertUnwindSafe(|| {
        outbox.process_due(|item| match item.idempotency_key() {
            "a" => panic!("model_check: scripted panic for a"),
            other => panic!("{other} was sent after the batch's send panicked"),
        })
    }));
    assert!(drained.is_err(), "the panic reaches the caller");
    let after = outbox.get("b").expect("get").expect("b");
    let fields = |i: &OutboxItem| {
        (
            i.state(),
            i.attempts(),
            i.dispatch_claimed(),
            i.error_code().map(str::to_owned),
            i.next_attempt_at(),
        )
    };
    assert_eq!(
        fields(&after),
        fields(&before),
        "b was never handed to send; it must be as it was (state, attempts, claim, \
         error_code, next_attempt_at)"
    );
}
