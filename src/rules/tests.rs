//! The rules run against an in-memory [`Txn`]: no files, no lock, no server.
//! This is the third implementation of the trait (after the file engine and,
//! to come, PostgreSQL), and it checks the rules on their own.

use std::collections::{BTreeMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};

use crate::audit::{AuditEvent, AuditOutcome, AuditRecord, Hasher, Head};
use crate::error::{Error, Result};
use crate::filter::ItemFilter;
use crate::item::{Claim, ClaimId, ItemState, OutboxItem};
use crate::message::NewMessage;
use crate::order::{self, OrderKey};
use crate::pacing::Pacing;
use crate::rate::{RateLimit, RatePolicy};
use crate::receipt::Outcome;
use crate::retry::Backoff;
use crate::rules::bulk::Bulk;
use crate::rules::codes::{AMBIGUOUS_AFTER_RESTART, CANCELLED, DESTINATION_COOLDOWN, RATE_CAPPED};
use crate::rules::lifecycle::SendResult;
use crate::rules::lifecycle::{Decision, decide, finish};
use crate::rules::txn::Txn;
use crate::rules::{Actor, InFlight};
use crate::send::{FailureClass, SendError};
use crate::settings::Settings;
use crate::store::rate_times;

/// Every item in one map; sealed records in a list.
struct MemTxn {
    now: DateTime<Utc>,
    settings: Settings,
    items: BTreeMap<String, OutboxItem>,
    archive: BTreeMap<String, OutboxItem>,
    head: Head,
    sealed: Vec<AuditRecord>,
    alive: HashSet<String>,
    last_seq: u64,
}

impl Txn for MemTxn {
    fn now(&self) -> DateTime<Utc> {
        self.now
    }
    fn settings(&self) -> &Settings {
        &self.settings
    }
    fn item(&mut self, key: &str) -> Result<Option<&OutboxItem>> {
        Ok(self.items.get(key))
    }
    fn item_mut(&mut self, key: &str) -> Result<&mut OutboxItem> {
        self.items.get_mut(key).ok_or_else(|| Error::NotFound {
            key: key.to_owned(),
        })
    }
    fn archived(&mut self, key: &str) -> Result<Option<OutboxItem>> {
        Ok(self.archive.get(key).cloned())
    }
    fn insert(&mut self, item: OutboxItem) -> Result<()> {
        self.items.insert(item.idempotency_key.clone(), item);
        Ok(())
    }
    fn next_seq(&mut self, _destination: &str) -> Result<u64> {
        self.last_seq += 1;
        Ok(self.last_seq)
    }
    fn head_of(&mut self, destination: &str) -> Result<Option<OrderKey>> {
        Ok(self
            .items
            .values()
            .filter(|i| i.destination == destination && i.state == ItemState::Queued)
            .map(OrderKey::of)
            .min())
    }
    fn candidates(
        &mut self,
        ordering: order::Ordering,
        admits: &mut dyn FnMut(&OutboxItem) -> bool,
    ) -> Result<Vec<(String, OrderKey)>> {
        let mut out = Vec::new();
        let mut destinations = HashSet::new();
        let keys: Vec<String> = self.items.keys().cloned().collect();
        for key in keys {
            let item = &self.items[&key];
            let destination = item.destination.clone();
            let ready = item.state == ItemState::Queued
                && (item.claim.is_some() || item.next_attempt_at.is_none_or(|at| at <= self.now));
            let in_line = ordering == order::Ordering::Unordered
                || self.head_of(&destination)?.is_some_and(|h| h.key == key);
            let item = &self.items[&key];
            if ready && in_line && admits(item) && destinations.insert(destination.clone()) {
                out.push((destination, OrderKey::of(item)));
            }
        }
        Ok(out)
    }
    fn select(&mut self, filter: &ItemFilter) -> Result<Vec<OutboxItem>> {
        Ok(self
            .items
            .values()
            .filter(|i| filter.matches(i))
            .cloned()
            .collect())
    }
    fn destination_cooldown(&mut self, destination: &str) -> Result<Option<DateTime<Utc>>> {
        Ok(self
            .items
            .values()
            .filter(|i| i.destination == destination)
            .filter_map(|i| i.cooldown_until)
            .max()
            .filter(|until| *until > self.now))
    }
    fn all_times(&mut self, since: DateTime<Utc>) -> Result<Vec<DateTime<Utc>>> {
        Ok(self
            .items
            .values()
            .flat_map(rate_times)
            .filter(|at| *at >= since)
            .collect())
    }
    fn destination_times(
        &mut self,
        destination: &str,
        since: DateTime<Utc>,
    ) -> Result<Vec<DateTime<Utc>>> {
        Ok(self
            .items
            .values()
            .filter(|i| i.destination == destination)
            .flat_map(rate_times)
            .filter(|at| *at >= since)
            .collect())
    }
    fn audit_id(&mut self, key: &str, now: DateTime<Utc>) -> Result<String> {
        Ok(crate::rules::record::item_audit_id(&self.head, key, now))
    }
    fn seal(&mut self, event: &AuditEvent) -> Result<()> {
        let record = AuditRecord::seal(
            event,
            self.head.seq + 1,
            &self.head.hash,
            false,
            &Hasher::Plain,
        );
        self.head = Head {
            seq: record.seq,
            hash: record.hash.clone(),
        };
        self.sealed.push(record);
        Ok(())
    }
    fn owner_is_alive(&mut self, owner: &str) -> Result<bool> {
        Ok(self.alive.contains(owner))
    }
}

fn at(secs: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_700_000_000 + secs, 0).unwrap()
}

fn txn(now: DateTime<Utc>) -> MemTxn {
    MemTxn {
        now,
        settings: Settings {
            rates: RatePolicy::default(),
            history_after: Duration::from_secs(86_400),
            retention: crate::history::Retention::KeepAll,
            max_attempts: 3,
            backoff: Backoff::Fixed(vec![Duration::from_secs(5)]),
            give_up_after: Duration::from_secs(86_400),
            ordering: order::Ordering::PerDestination,
            stored: Vec::new(),
        },
        items: BTreeMap::new(),
        archive: BTreeMap::new(),
        head: Head::genesis(),
        sealed: Vec::new(),
        alive: HashSet::new(),
        last_seq: 0,
    }
}

/// The parts of a handle the rules need, owned by the test.
struct Handle {
    in_flight: Mutex<InFlight>,
    pacing: Pacing,
    idempotent: BTreeMap<String, Duration>,
}

impl Handle {
    fn new() -> Self {
        Self {
            in_flight: Mutex::new(InFlight::default()),
            pacing: Pacing::default(),
            idempotent: BTreeMap::new(),
        }
    }
    fn actor(&self) -> Actor<'_> {
        self.actor_as("me")
    }
    fn actor_as<'a>(&'a self, owner: &'a str) -> Actor<'a> {
        Actor {
            owner,
            in_flight: &self.in_flight,
            pacing: &self.pacing,
            idempotent: &self.idempotent,
        }
    }
}

fn enqueue(txn: &mut MemTxn, key: &str, destination: &str) -> OutboxItem {
    let message = NewMessage {
        idempotency_key: key.into(),
        connector: "telegram".into(),
        grant_id: "bot".into(),
        destination: destination.into(),
        content: format!("hello from {key}"),
        ..Default::default()
    };
    let hash = crate::message::content_hash(&message.content);
    crate::rules::enqueue::insert_message(txn, &message, &hash).unwrap()
}

fn claimed(decision: Decision) -> OutboxItem {
    match decision {
        Decision::Send(item, _) => *item,
        Decision::Done(receipt) => panic!("not claimed: {:?}", receipt.outcome),
    }
}

fn outcome(decision: &Decision) -> Outcome {
    match decision {
        Decision::Send(..) => panic!("claimed"),
        Decision::Done(receipt) => receipt.outcome,
    }
}

#[test]
fn a_due_head_is_claimed_and_the_next_message_to_its_chat_waits() {
    let handle = Handle::new();
    let mut txn = txn(at(0));
    enqueue(&mut txn, "a", "chat");
    enqueue(&mut txn, "b", "chat");
    let item = claimed(decide(&handle.actor(), &mut txn, "a").unwrap());
    assert_eq!((item.attempts, item.claim_owner()), (1, Some("me")));
    assert!(handle.actor().is_sending(&item));
    let b = decide(&handle.actor(), &mut txn, "b").unwrap();
    assert_eq!(
        outcome(&b),
        Outcome::Waiting,
        "b is behind a, which is in flight"
    );
    assert!(!txn.items["b"].dispatch_claimed());
}

#[test]
fn a_claim_whose_owner_is_gone_fails_ambiguous_on_record_and_is_never_resent() {
    let handle = Handle::new();
    let mut txn = txn(at(100));
    enqueue(&mut txn, "a", "chat");
    txn.items.get_mut("a").unwrap().claim = Some(Claim {
        owner: Some("gone".into()),
        at: Some(at(50)),
    });
    let before = txn.sealed.len();
    let decision = decide(&handle.actor(), &mut txn, "a").unwrap();
    assert_eq!(outcome(&decision), Outcome::Failed);
    let item = &txn.items["a"];
    assert_eq!(item.state, ItemState::Failed);
    assert_eq!(item.error_code.as_deref(), Some(AMBIGUOUS_AFTER_RESTART));
    assert_eq!(item.failure_class, Some(FailureClass::Ambiguous));
    assert_eq!(
        item.maybe_sent_at,
        Some(at(50)),
        "counts as a send from its claim"
    );
    assert_eq!(txn.sealed.len(), before + 1);
    assert_eq!(
        txn.sealed.last().unwrap().audit_id,
        item.last_audit_id.clone().unwrap()
    );
    // A claim whose owner is alive is left alone.
    enqueue(&mut txn, "b", "other");
    txn.items.get_mut("b").unwrap().claim = Some(Claim {
        owner: Some("alive".into()),
        at: Some(at(60)),
    });
    txn.alive.insert("alive".into());
    let decision = decide(&handle.actor(), &mut txn, "b").unwrap();
    assert_eq!(outcome(&decision), Outcome::InFlight);
}

#[test]
fn a_retry_after_costs_no_attempt_and_cools_the_whole_destination() {
    let handle = Handle::new();
    let mut txn = txn(at(0));
    txn.settings.ordering = order::Ordering::Unordered;
    enqueue(&mut txn, "a", "chat");
    enqueue(&mut txn, "b", "chat");
    let a = ClaimId::of(&claimed(decide(&handle.actor(), &mut txn, "a").unwrap()));
    let refused: crate::rules::lifecycle::SendResult = Ok(Err(
        SendError::retryable("429").retry_after(Duration::from_secs(30))
    ));
    let (receipt, wait) = finish(&handle.actor(), &mut txn, &a, &refused).unwrap();
    assert_eq!(receipt.outcome, Outcome::Deferred);
    assert_eq!(wait, Some(Duration::from_secs(30)));
    let a = &txn.items["a"];
    assert_eq!(a.attempts, 0, "a 429 is pacing, not a failed attempt");
    assert_eq!(a.cooldown_until, Some(at(30)));
    assert!(a.next_attempt_at.is_some_and(|t| t >= at(30)));
    let b = decide(&handle.actor(), &mut txn, "b").unwrap();
    assert_eq!(outcome(&b), Outcome::Deferred);
    assert_eq!(
        txn.items["b"].error_code.as_deref(),
        Some(DESTINATION_COOLDOWN)
    );
    assert_eq!(txn.items["b"].next_attempt_at, Some(at(30)));
}

#[test]
fn a_full_rate_window_defers_to_the_moment_a_slot_frees() {
    let handle = Handle::new();
    let mut txn = txn(at(0));
    txn.settings.rates.per_destination = RateLimit {
        count: 1,
        window: Duration::from_secs(60),
    };
    enqueue(&mut txn, "a", "chat");
    let a = ClaimId::of(&claimed(decide(&handle.actor(), &mut txn, "a").unwrap()));
    finish(&handle.actor(), &mut txn, &a, &Ok(Ok(Some("m1".into())))).unwrap();
    assert_eq!(txn.items["a"].state, ItemState::Sent);
    assert_eq!(txn.items["a"].transport_ref.as_deref(), Some("m1"));
    txn.now = at(10);
    enqueue(&mut txn, "b", "chat");
    let b = decide(&handle.actor(), &mut txn, "b").unwrap();
    assert_eq!(outcome(&b), Outcome::Deferred);
    assert_eq!(txn.items["b"].error_code.as_deref(), Some(RATE_CAPPED));
    assert_eq!(txn.items["b"].next_attempt_at, Some(at(60)));
    assert_eq!(txn.items["b"].attempts, 0);
}

#[test]
fn every_change_is_on_record_in_the_order_the_rules_made_it() {
    let handle = Handle::new();
    let mut txn = txn(at(0));
    enqueue(&mut txn, "a", "chat");
    let a = ClaimId::of(&claimed(decide(&handle.actor(), &mut txn, "a").unwrap()));
    finish(&handle.actor(), &mut txn, &a, &Ok(Ok(None))).unwrap();
    let outcomes: Vec<AuditOutcome> = txn.sealed.iter().map(|r| r.outcome).collect();
    assert_eq!(outcomes, [AuditOutcome::Queued, AuditOutcome::Sent]);
    let seqs: Vec<u64> = txn.sealed.iter().map(|r| r.seq).collect();
    assert_eq!(seqs, [1, 2]);
    assert_eq!(txn.sealed[1].prev_hash, txn.sealed[0].hash);
}

#[test]
fn a_drain_step_records_the_finished_send_and_claims_the_next_in_one_transaction() {
    let handle = Handle::new();
    let mut txn = txn(at(0));
    enqueue(&mut txn, "a", "chat-1");
    enqueue(&mut txn, "b", "chat-1");
    enqueue(&mut txn, "c", "chat-2");
    let mut picker = crate::order::Picker::worker();
    let first =
        crate::rules::drain::step(&handle.actor(), &mut txn, None, Some(&mut picker)).unwrap();
    let (item, _) = first.claimed.expect("one claimed");
    let sent: crate::rules::lifecycle::SendResult = Ok(Ok(None));
    let second = crate::rules::drain::step(
        &handle.actor(),
        &mut txn,
        Some((&ClaimId::of(&item), &sent)),
        Some(&mut picker),
    )
    .unwrap();
    let (receipt, _) = second.finished.expect("recorded");
    assert_eq!(receipt.outcome, Outcome::Sent);
    let (next, _) = second.claimed.expect("the next one claimed");
    assert_ne!(next.idempotency_key, item.idempotency_key);
    assert_ne!(
        next.idempotency_key, "b",
        "b is not its chat's head before a is sent, nor the fairest pick after"
    );
    let claimed: Vec<&str> = txn
        .items
        .values()
        .filter(|i| i.dispatch_claimed())
        .map(|i| i.idempotency_key.as_str())
        .collect();
    assert_eq!(
        claimed,
        [next.idempotency_key.as_str()],
        "one send at a time per step"
    );
}

// ----- a send that finishes after its claim was lost ----------------------

/// `me` claims "a" and starts sending; its owner session ends (nobody holds
/// "me" alive), so `other` declares the claim ambiguous. Returns the handle
/// whose send is still running and the claim that send holds, for `finish`.
fn lose_the_claim(txn: &mut MemTxn) -> (Handle, ClaimId) {
    let handle = Handle::new();
    enqueue(txn, "a", "chat");
    let lost = ClaimId::of(&claimed(decide(&handle.actor(), txn, "a").unwrap()));
    let other = Handle::new();
    txn.now = at(10);
    let declared = decide(&other.actor_as("other"), txn, "a").unwrap();
    assert_eq!(outcome(&declared), Outcome::Failed);
    assert_eq!(
        txn.items["a"].error_code.as_deref(),
        Some(AMBIGUOUS_AFTER_RESTART)
    );
    txn.now = at(20);
    (handle, lost)
}

#[expect(
    clippy::unnecessary_wraps,
    reason = "what `send` returned, in the type `finish` takes"
)]
fn delivered(reference: &str) -> SendResult {
    Ok(Ok(Some(reference.to_owned())))
}

/// The last sealed record, which must be the one the item names as its latest.
fn last_record(txn: &MemTxn, key: &str) -> AuditRecord {
    let record = txn.sealed.last().unwrap().clone();
    assert_eq!(record.idempotency_key, key);
    assert_eq!(
        txn.items[key].last_audit_id.as_deref(),
        Some(record.audit_id.as_str()),
        "the item names its latest record"
    );
    record
}

#[test]
fn a_delivery_after_the_item_was_requeued_makes_it_sent_and_it_is_not_sent_again() {
    let mut txn = txn(at(0));
    let (handle, lost) = lose_the_claim(&mut txn);
    Bulk::Requeue.one(&mut txn, "a", "alice: retry").unwrap();
    assert_eq!(
        txn.items["a"].attempts, 0,
        "a requeue starts the count again"
    );
    let (receipt, wait) = finish(&handle.actor(), &mut txn, &lost, &delivered("m1")).unwrap();
    assert_eq!(
        (receipt.outcome, receipt.transport_ref.as_deref(), wait),
        (Outcome::Sent, Some("m1"), None)
    );
    let item = &txn.items["a"];
    assert_eq!(
        (
            item.state,
            item.transport_ref.as_deref(),
            item.claim.is_none()
        ),
        (ItemState::Sent, Some("m1"), true)
    );
    assert_eq!(item.attempts, 1, "the late send was an attempt");
    let record = last_record(&txn, "a");
    assert_eq!(record.outcome, AuditOutcome::Sent);
    assert_eq!(record.transport_ref.as_deref(), Some("m1"));
    assert_eq!(receipt.audit_id.as_deref(), Some(record.audit_id.as_str()));
    let note = record.note.unwrap();
    assert!(
        note.starts_with("correction:") && note.contains("requeued"),
        "{note}"
    );
    // Not sent a second time: the next look finds it sent.
    let again = decide(&Handle::new().actor_as("third"), &mut txn, "a").unwrap();
    assert_eq!(outcome(&again), Outcome::Sent);
}

#[test]
fn a_delivery_after_the_item_was_cancelled_is_on_record_and_the_item_stays_cancelled() {
    let mut txn = txn(at(0));
    let (handle, lost) = lose_the_claim(&mut txn);
    Bulk::Requeue.one(&mut txn, "a", "alice: retry").unwrap();
    Bulk::Cancel
        .one(&mut txn, "a", "alice: not needed")
        .unwrap();
    let before = txn.items["a"].clone();
    let records = txn.sealed.len();
    let (receipt, _) = finish(&handle.actor(), &mut txn, &lost, &delivered("m1")).unwrap();
    assert_eq!(receipt.outcome, Outcome::Sent, "this send delivered");
    assert_eq!(receipt.transport_ref.as_deref(), Some("m1"));
    assert_eq!(receipt.error_code, None);
    let item = &txn.items["a"];
    assert_eq!(
        (
            item.state,
            item.error_code.as_deref(),
            item.transport_ref.as_deref()
        ),
        (ItemState::Failed, Some(CANCELLED), None),
        "state left alone"
    );
    assert_eq!(
        (item.attempts, &item.claim),
        (before.attempts, &before.claim)
    );
    assert_eq!(txn.sealed.len(), records + 1);
    let record = last_record(&txn, "a");
    assert_eq!(record.outcome, AuditOutcome::LateDelivery);
    assert_eq!(record.transport_ref.as_deref(), Some("m1"));
    assert_eq!(record.error_code, None);
    assert_eq!(receipt.audit_id.as_deref(), Some(record.audit_id.as_str()));
    let note = record.note.unwrap();
    assert!(
        note.starts_with("late delivery:") && note.contains("cancelled"),
        "{note}"
    );
}

#[test]
fn a_delivery_while_another_attempt_holds_the_item_is_on_record_and_that_attempt_goes_on() {
    let mut txn = txn(at(0));
    let (handle, lost) = lose_the_claim(&mut txn);
    Bulk::Requeue.one(&mut txn, "a", "alice: retry").unwrap();
    let resender = Handle::new();
    txn.alive.insert("resender".into());
    let second_claim = ClaimId::of(&claimed(
        decide(&resender.actor_as("resender"), &mut txn, "a").unwrap(),
    ));
    let (receipt, _) = finish(&handle.actor(), &mut txn, &lost, &delivered("m1")).unwrap();
    assert_eq!(
        (receipt.outcome, receipt.transport_ref.as_deref()),
        (Outcome::Sent, Some("m1"))
    );
    assert_eq!(txn.items["a"].state, ItemState::Queued);
    assert_eq!(txn.items["a"].claim_owner(), Some("resender"), "claim kept");
    let record = last_record(&txn, "a");
    assert_eq!(record.outcome, AuditOutcome::LateDelivery);
    assert_eq!(record.transport_ref.as_deref(), Some("m1"));
    let note = record.note.unwrap();
    assert!(
        note.contains("claimed again") && note.contains("resender"),
        "{note}"
    );
    // The resend already under way finishes as its own.
    let (resent, _) = finish(
        &resender.actor_as("resender"),
        &mut txn,
        &second_claim,
        &delivered("m2"),
    )
    .unwrap();
    assert_eq!(resent.outcome, Outcome::Sent);
    assert_eq!(txn.items["a"].transport_ref.as_deref(), Some("m2"));
    assert_eq!(last_record(&txn, "a").outcome, AuditOutcome::Sent);
}

#[test]
fn a_delivery_after_a_resend_delivered_is_on_record_and_the_item_keeps_the_resend() {
    let mut txn = txn(at(0));
    let (handle, lost) = lose_the_claim(&mut txn);
    Bulk::Requeue.one(&mut txn, "a", "alice: retry").unwrap();
    let resender = Handle::new();
    let second_claim = ClaimId::of(&claimed(
        decide(&resender.actor_as("resender"), &mut txn, "a").unwrap(),
    ));
    finish(
        &resender.actor_as("resender"),
        &mut txn,
        &second_claim,
        &delivered("m2"),
    )
    .unwrap();
    let (receipt, _) = finish(&handle.actor(), &mut txn, &lost, &delivered("m1")).unwrap();
    assert_eq!(
        (receipt.outcome, receipt.transport_ref.as_deref()),
        (Outcome::Sent, Some("m1"))
    );
    let item = &txn.items["a"];
    assert_eq!(
        (item.state, item.transport_ref.as_deref()),
        (ItemState::Sent, Some("m2"))
    );
    let record = last_record(&txn, "a");
    assert_eq!(record.outcome, AuditOutcome::LateDelivery);
    assert_eq!(record.transport_ref.as_deref(), Some("m1"));
    let note = record.note.unwrap();
    assert!(
        note.contains("sent by another attempt") && note.contains("m2"),
        "{note}"
    );
}

#[test]
fn a_send_that_did_not_deliver_after_the_item_moved_on_changes_nothing_and_says_where_it_is() {
    let mut txn = txn(at(0));
    let (handle, lost) = lose_the_claim(&mut txn);
    Bulk::Requeue.one(&mut txn, "a", "alice: retry").unwrap();
    let refused: SendResult = Ok(Err(SendError::permanent("chat_not_found")));
    let (before, records) = (txn.items["a"].clone(), txn.sealed.len());
    let (receipt, wait) = finish(&handle.actor(), &mut txn, &lost, &refused).unwrap();
    assert_eq!(
        (receipt.outcome, receipt.audit_id.as_deref(), wait),
        (Outcome::Deferred, None, None),
        "still queued: the resend the operator asked for comes"
    );
    assert_eq!(txn.items["a"], before, "left alone");
    assert_eq!(txn.sealed.len(), records, "no delivery to account for");
    // Claimed again by a live worker: that worker is sending it.
    let resender = Handle::new();
    txn.alive.insert("resender".into());
    claimed(decide(&resender.actor_as("resender"), &mut txn, "a").unwrap());
    let (receipt, _) = finish(&handle.actor(), &mut txn, &lost, &refused).unwrap();
    assert_eq!(receipt.outcome, Outcome::InFlight);
    assert_eq!(txn.items["a"].claim_owner(), Some("resender"));
}

#[test]
fn an_unknown_outcome_of_a_lost_claim_leaves_the_ambiguous_failure_and_reports_it() {
    let mut txn = txn(at(0));
    let (handle, lost) = lose_the_claim(&mut txn);
    let (before, records) = (txn.items["a"].clone(), txn.sealed.len());
    let timeout: SendResult = Ok(Err(SendError::ambiguous("timeout")));
    let (receipt, _) = finish(&handle.actor(), &mut txn, &lost, &timeout).unwrap();
    assert_eq!(receipt.outcome, Outcome::Failed, "not in flight: it failed");
    assert_eq!(receipt.error_code.as_deref(), Some(AMBIGUOUS_AFTER_RESTART));
    assert_eq!((&txn.items["a"], txn.sealed.len()), (&before, records));
}

// ----- a finish applies only to the claim it holds -------------------------

/// `me` loses its claim of "a" (declared ambiguous by `other`), an operator
/// requeues it, and `me` claims it again at `again` while the first send
/// still runs: the same owner id holds a newer claim. Returns the handle,
/// the lost claim and the newer one.
fn claimed_again_by_the_same_owner(
    txn: &mut MemTxn,
    again: DateTime<Utc>,
) -> (Handle, ClaimId, ClaimId) {
    let (handle, lost) = lose_the_claim(txn);
    Bulk::Requeue.one(txn, "a", "alice: retry").unwrap();
    txn.now = again;
    let newer = ClaimId::of(&claimed(decide(&handle.actor(), txn, "a").unwrap()));
    assert_eq!(newer.owner.as_deref(), Some("me"));
    assert_eq!(
        newer.attempt, lost.attempt,
        "a requeue starts the count again: the attempt alone does not tell them apart"
    );
    assert_ne!(newer, lost);
    (handle, lost, newer)
}

#[test]
fn a_delivery_under_a_lost_claim_is_a_late_delivery_even_when_its_owner_claimed_the_item_again() {
    let mut txn = txn(at(0));
    let (handle, lost, newer) = claimed_again_by_the_same_owner(&mut txn, at(30));
    let held = txn.items["a"].clone();
    let (receipt, wait) = finish(&handle.actor(), &mut txn, &lost, &delivered("m1")).unwrap();
    assert_eq!(
        (receipt.outcome, receipt.transport_ref.as_deref(), wait),
        (Outcome::Sent, Some("m1"), None),
        "the receipt says this send delivered"
    );
    let item = &txn.items["a"];
    assert_eq!(
        (item.state, item.transport_ref.as_deref()),
        (ItemState::Queued, None),
        "the newer send still holds the item: it is not marked sent under it"
    );
    assert!(item.holds(&newer), "the newer claim is kept");
    assert_eq!(item.claim, held.claim);
    let record = last_record(&txn, "a");
    assert_eq!(record.outcome, AuditOutcome::LateDelivery);
    assert_eq!(record.transport_ref.as_deref(), Some("m1"));
    assert_eq!(
        record.attempts, lost.attempt,
        "names the late send's attempt"
    );
    let note = record.note.unwrap();
    assert!(
        note.contains("claimed again") && note.contains("claimed at 2023-11-14T22:13:20.000000Z"),
        "the note names the lost claim: {note}"
    );
    // The newer send finishes as its own.
    let (resent, _) = finish(&handle.actor(), &mut txn, &newer, &delivered("m2")).unwrap();
    assert_eq!(resent.outcome, Outcome::Sent);
    let item = &txn.items["a"];
    assert_eq!(
        (item.state, item.transport_ref.as_deref()),
        (ItemState::Sent, Some("m2"))
    );
    let record = last_record(&txn, "a");
    assert_eq!(
        (record.outcome, record.transport_ref.as_deref()),
        (AuditOutcome::Sent, Some("m2"))
    );
}

#[test]
fn a_retryable_failure_under_a_lost_claim_does_not_requeue_the_newer_send_of_its_owner() {
    let mut txn = txn(at(0));
    let (handle, lost, newer) = claimed_again_by_the_same_owner(&mut txn, at(30));
    let (held, records) = (txn.items["a"].clone(), txn.sealed.len());
    let busy: SendResult = Ok(Err(SendError::retryable("http_503")));
    let (receipt, wait) = finish(&handle.actor(), &mut txn, &lost, &busy).unwrap();
    assert_eq!(
        (receipt.outcome, wait),
        (Outcome::InFlight, None),
        "no backoff: the item is being sent"
    );
    assert_eq!(
        txn.items["a"], held,
        "left alone: still claimed, not queued"
    );
    assert_eq!(txn.sealed.len(), records, "nothing happened to account for");
    // The handle's send of the lost claim is over; the newer one is still
    // running and is live to every look, its own handle's included.
    handle.in_flight.lock().unwrap().remove(&lost);
    assert!(handle.actor().is_sending(&txn.items["a"]));
    txn.now = at(3_600);
    let own_look = decide(&handle.actor(), &mut txn, "a").unwrap();
    assert_eq!(
        outcome(&own_look),
        Outcome::InFlight,
        "its own handle does not take the newer send for an orphan"
    );
    txn.alive.insert("me".into());
    let other_look = decide(&Handle::new().actor_as("other"), &mut txn, "a").unwrap();
    assert_eq!(outcome(&other_look), Outcome::InFlight, "no third send");
    assert!(txn.items["a"].holds(&newer));
}

#[test]
fn a_newer_claim_of_the_same_owner_at_the_same_moment_is_a_different_claim() {
    // The clock stands still: the claim, its loss, the requeue and the
    // newer claim all happen at 0 (room in the cap for the resend).
    let mut txn = txn(at(0));
    txn.settings.rates.per_destination = RateLimit {
        count: 10,
        window: Duration::from_secs(1),
    };
    let handle = Handle::new();
    enqueue(&mut txn, "a", "chat");
    let lost = ClaimId::of(&claimed(decide(&handle.actor(), &mut txn, "a").unwrap()));
    let declared = decide(&Handle::new().actor_as("other"), &mut txn, "a").unwrap();
    assert_eq!(outcome(&declared), Outcome::Failed);
    Bulk::Requeue.one(&mut txn, "a", "alice: retry").unwrap();
    let newer = ClaimId::of(&claimed(decide(&handle.actor(), &mut txn, "a").unwrap()));
    assert_eq!(newer.stamp().0, lost.stamp().0);
    assert_ne!(
        newer, lost,
        "two sends of one handle never share an identity"
    );
    assert_eq!(
        newer.at,
        Some(at(0) + chrono::TimeDelta::microseconds(1)),
        "a microsecond later, as stored"
    );
    let busy: SendResult = Ok(Err(SendError::retryable("http_503")));
    let (receipt, _) = finish(&handle.actor(), &mut txn, &lost, &busy).unwrap();
    assert_eq!(receipt.outcome, Outcome::InFlight);
    assert!(txn.items["a"].holds(&newer));
}

#[test]
fn giving_back_or_abandoning_a_lost_claim_leaves_the_newer_claim_of_its_owner_alone() {
    use crate::rules::lifecycle::{abandon, release};
    let mut txn = txn(at(0));
    let (handle, lost, newer) = claimed_again_by_the_same_owner(&mut txn, at(30));
    let (held, records) = (txn.items["a"].clone(), txn.sealed.len());
    let mut before = held.clone();
    before.claim = None;
    release(&handle.actor(), &mut txn, &lost, &before).unwrap();
    abandon(&handle.actor(), &mut txn, &lost, "send_cancelled").unwrap();
    assert_eq!((&txn.items["a"], txn.sealed.len()), (&held, records));
    abandon(&handle.actor(), &mut txn, &newer, "send_cancelled").unwrap();
    assert_eq!(txn.items["a"].error_code.as_deref(), Some("send_cancelled"));
}

#[test]
fn a_claim_is_the_same_claim_when_read_back_at_the_stored_precision() {
    let mut txn = txn(at(0) + chrono::TimeDelta::nanoseconds(123_456_789));
    enqueue(&mut txn, "a", "chat");
    let item = claimed(decide(&Handle::new().actor(), &mut txn, "a").unwrap());
    // As the snapshot, the journal and the database keep it: `claimed_at_utc`.
    let mut read_back = item.clone();
    let claim = read_back.claim.as_mut().unwrap();
    let stored = crate::clock::format_timestamp(claim.at.unwrap());
    claim.at = crate::clock::parse_timestamp(&stored);
    assert_eq!(
        read_back
            .claim
            .as_ref()
            .unwrap()
            .at
            .unwrap()
            .timestamp_subsec_nanos(),
        123_456_000
    );
    assert!(read_back.holds(&ClaimId::of(&item)));
}
