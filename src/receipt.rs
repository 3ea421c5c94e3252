//! What `process` and `process_due` report back.

use chrono::{DateTime, Utc};

use crate::item::OutboxItem;

/// The result of one [`Outbox::process`](crate::Outbox::process) call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Delivered (now or earlier).
    Sent,
    /// Terminally failed (now or earlier); `error_code` says why.
    Failed,
    /// Not attempted now: a rate cap, a backoff or a `retry_after` holds it until
    /// `next_attempt_at`. The item stays queued.
    Deferred,
    /// Another worker (thread or process) is sending it right now. Nothing changed.
    InFlight,
    /// Not attempted: an earlier message to the same destination is still
    /// queued, in flight or waiting for its retry, and messages to one
    /// destination leave in enqueue order (see [`Ordering`](crate::Ordering)).
    /// Nothing changed; the item goes once everything before it is sent or failed.
    Waiting,
}

impl Outcome {
    /// `sent`, `failed`, `deferred`, `in_flight` or `waiting`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Sent => "sent",
            Self::Failed => "failed",
            Self::Deferred => "deferred",
            Self::InFlight => "in_flight",
            Self::Waiting => "waiting",
        }
    }
}

/// What happened to one item.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeliveryReceipt {
    /// The item's connector.
    pub connector: String,
    /// The item's destination.
    pub destination: String,
    /// The item's key.
    pub idempotency_key: String,
    /// What happened.
    pub outcome: Outcome,
    /// The audit record of this outcome, when one exists (`None` for `InFlight` and
    /// for a repeated `Deferred` answer that changed nothing).
    pub audit_id: Option<String>,
    /// Attempts made so far.
    pub attempts: u32,
    /// The platform's message id, for `Sent`.
    pub transport_ref: Option<String>,
    /// Why it failed or was deferred.
    pub error_code: Option<String>,
    /// When it may be attempted again, for `Deferred`.
    pub next_attempt_at: Option<DateTime<Utc>>,
}

impl DeliveryReceipt {
    pub(crate) fn for_item(item: &OutboxItem, outcome: Outcome, audit_id: Option<String>) -> Self {
        Self {
            connector: item.connector.clone(),
            destination: item.destination.clone(),
            idempotency_key: item.idempotency_key.clone(),
            outcome,
            audit_id,
            attempts: item.attempts,
            transport_ref: item.transport_ref.clone(),
            error_code: item.error_code.clone(),
            next_attempt_at: item.next_attempt_at,
        }
    }
}

/// The tally of one [`Outbox::process_due`](crate::Outbox::process_due) pass.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DrainReport {
    /// Items delivered.
    pub sent: usize,
    /// Items that failed terminally in this pass.
    pub failed: usize,
    /// Items held back by a rate cap.
    pub deferred: usize,
    /// Items another worker was sending.
    pub in_flight: usize,
    /// Items that hit a retryable failure and were rescheduled.
    pub retried: usize,
    /// Items that stayed queued behind an earlier message to the same
    /// destination that had not left yet (see [`Outcome::Waiting`]).
    pub waiting: usize,
    /// Every receipt, in processing order.
    pub receipts: Vec<DeliveryReceipt>,
}

impl DrainReport {
    pub(crate) fn add(&mut self, receipt: DeliveryReceipt, retried: bool) {
        match receipt.outcome {
            Outcome::Sent => self.sent += 1,
            Outcome::Failed => self.failed += 1,
            Outcome::InFlight => self.in_flight += 1,
            Outcome::Waiting => self.waiting += 1,
            Outcome::Deferred if retried => self.retried += 1,
            Outcome::Deferred => self.deferred += 1,
        }
        self.receipts.push(receipt);
    }

    /// Number of items looked at.
    pub fn total(&self) -> usize {
        self.receipts.len()
    }
}
