//! One durable message and its lifecycle state.

use std::fmt;

use chrono::{DateTime, Utc};
use sha2::{Digest, Sha256};

use crate::message::ContentSummary;
use crate::send::FailureClass;

/// Where an item is in its lifecycle.
///
/// `Queued` items may be attempted; `Sent` and `Failed` are terminal and are never
/// sent again by [`Outbox::process`](crate::Outbox::process).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ItemState {
    /// Waiting to be sent (possibly claimed by a worker right now, see
    /// [`OutboxItem::dispatch_claimed`]).
    Queued,
    /// Delivered; `sent_at` and possibly `transport_ref` are set.
    Sent,
    /// Given up; `error_code` says why. Only an operator can requeue it.
    Failed,
}

impl ItemState {
    /// The name stored in `outbox.json`: `queued`, `sent` or `failed`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Sent => "sent",
            Self::Failed => "failed",
        }
    }

    /// `true` for `Sent` and `Failed`.
    pub fn is_terminal(self) -> bool {
        !matches!(self, Self::Queued)
    }

    pub(crate) fn parse(text: &str) -> Option<Self> {
        match text {
            "queued" => Some(Self::Queued),
            "sent" => Some(Self::Sent),
            "failed" => Some(Self::Failed),
            _ => None,
        }
    }
}

impl fmt::Display for ItemState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Who holds a dispatch claim, as recorded in `outbox.json`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Claim {
    /// The owner id of the open outbox that claimed the item. `None` for claims
    /// written by the reference design, which recorded no owner: such a claim can
    /// only be a leftover from a crash.
    pub(crate) owner: Option<String>,
    /// When the claim was taken (counts against the destination's rate cap).
    pub(crate) at: Option<DateTime<Utc>>,
}

/// Which claim a send holds: the item, the owner that claimed it, the attempt
/// the claim started (the item's `attempts` while it is claimed) and the
/// claim time, as stored (to the microsecond, like `claimed_at_utc`).
///
/// A send finishes, gives back or abandons *this* claim, never "the claim of
/// our owner id": on PostgreSQL a handle whose session was cut takes its owner
/// lock again under the same id, so after another handle declared its claim
/// ambiguous, an operator requeued the item and the handle claimed it again,
/// two sends of one handle may run for one key. A requeue starts the attempt
/// count again, so the attempt alone does not tell them apart; the claim time
/// does, and one handle never holds two claims of a key with the same
/// identity at once (`decide` makes the later one a microsecond later).
/// Nothing new is stored: both parts are fields every claim already has.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct ClaimId {
    /// The item's idempotency key.
    pub(crate) key: String,
    /// The owner id the claim names (`None`: the reference design's claim,
    /// which is nobody's).
    pub(crate) owner: Option<String>,
    /// The item's attempt count while the claim stands.
    pub(crate) attempt: u32,
    /// The claim time, to the microsecond.
    pub(crate) at: Option<DateTime<Utc>>,
}

impl ClaimId {
    /// The identity of the claim `item` holds (of a claimed item, as the
    /// claim made it or as read back).
    pub(crate) fn of(item: &OutboxItem) -> Self {
        let claim = item.claim.as_ref();
        Self {
            key: item.idempotency_key.clone(),
            owner: claim.and_then(|c| c.owner.clone()),
            attempt: item.attempts,
            at: claim.and_then(|c| c.at).map(stored_precision),
        }
    }

    /// The item's key.
    pub(crate) fn key(&self) -> &str {
        &self.key
    }

    /// The attempt and claim time: what tells two claims of one owner and
    /// one key apart.
    pub(crate) fn stamp(&self) -> ClaimStamp {
        (self.attempt, self.at)
    }
}

/// What tells two claims of one owner and one key apart: the attempt and the
/// claim time (see [`ClaimId`]).
pub(crate) type ClaimStamp = (u32, Option<DateTime<Utc>>);

/// A time as the files and the database keep it: to the microsecond.
fn stored_precision(at: DateTime<Utc>) -> DateTime<Utc> {
    use chrono::SubsecRound;
    at.trunc_subsecs(6)
}

/// One message in the outbox, as last persisted.
///
/// Accessors are named after the item's fields in `outbox.json`. `Debug` prints the
/// body as its length and hash, never its text.
#[derive(Clone, PartialEq, Eq)]
pub struct OutboxItem {
    pub(crate) idempotency_key: String,
    pub(crate) connector: String,
    pub(crate) grant_id: String,
    pub(crate) destination: String,
    pub(crate) content: String,
    pub(crate) content_hash: String,
    pub(crate) state: ItemState,
    pub(crate) attempts: u32,
    /// `Some` exactly when `dispatch_claimed` is true in the file.
    pub(crate) claim: Option<Claim>,
    pub(crate) created_at: DateTime<Utc>,
    pub(crate) updated_at: DateTime<Utc>,
    pub(crate) next_attempt_at: Option<DateTime<Utc>>,
    pub(crate) sent_at: Option<DateTime<Utc>>,
    pub(crate) error_code: Option<String>,
    pub(crate) lane: String,
    pub(crate) direction: String,
    pub(crate) risk_class: Option<String>,
    pub(crate) transport_ref: Option<String>,
    /// The audit id of the last outcome recorded for this item, when known.
    pub(crate) last_audit_id: Option<String>,
    /// Until when the platform asked not to send to this item's destination at
    /// all (a `retry_after` on a retryable failure, e.g. HTTP 429).
    pub(crate) cooldown_until: Option<DateTime<Utc>>,
    /// The claim time of this item's latest send whose outcome is unknown (an
    /// ambiguous failure): it may have reached the platform, so it counts
    /// against the destination's caps as a send, whatever happens to the item.
    pub(crate) maybe_sent_at: Option<DateTime<Utc>>,
    /// The class of the last failure (`None` before any, after a success, for
    /// an operator's cancel, and in files written before the class was stored).
    pub(crate) failure_class: Option<FailureClass>,
    /// Where the item stands in enqueue order (`enqueue_seq` in the file):
    /// allocated under the lock, larger than every live item's. `None` for items
    /// written before sequences existed, which come first (see `order`).
    pub(crate) seq: Option<u64>,
}

impl OutboxItem {
    /// The caller-owned key.
    pub fn idempotency_key(&self) -> &str {
        &self.idempotency_key
    }
    /// The connector that sends it.
    pub fn connector(&self) -> &str {
        &self.connector
    }
    /// The grant (credential) it is sent under.
    pub fn grant_id(&self) -> &str {
        &self.grant_id
    }
    /// Where it goes.
    pub fn destination(&self) -> &str {
        &self.destination
    }
    /// The message body.
    pub fn content(&self) -> &str {
        &self.content
    }
    /// SHA-256 of the body, lowercase hex.
    pub fn content_hash(&self) -> &str {
        &self.content_hash
    }
    /// Lifecycle state.
    pub fn state(&self) -> ItemState {
        self.state
    }
    /// How many times a send was started (claims taken).
    pub fn attempts(&self) -> u32 {
        self.attempts
    }
    /// `true` while a worker holds the at-most-once dispatch claim (or held it when it died).
    pub fn dispatch_claimed(&self) -> bool {
        self.claim.is_some()
    }
    /// When it was enqueued.
    pub fn created_at(&self) -> DateTime<Utc> {
        self.created_at
    }
    /// When it last changed.
    pub fn updated_at(&self) -> DateTime<Utc> {
        self.updated_at
    }
    /// The earliest time the next attempt may start (after a deferral or a retryable failure).
    pub fn next_attempt_at(&self) -> Option<DateTime<Utc>> {
        self.next_attempt_at
    }
    /// When it was delivered.
    pub fn sent_at(&self) -> Option<DateTime<Utc>> {
        self.sent_at
    }
    /// Why the last attempt failed, or why the item failed.
    pub fn error_code(&self) -> Option<&str> {
        self.error_code.as_deref()
    }
    /// The lane label.
    pub fn lane(&self) -> &str {
        &self.lane
    }
    /// The direction label.
    pub fn direction(&self) -> &str {
        &self.direction
    }
    /// The risk class label, if any.
    pub fn risk_class(&self) -> Option<&str> {
        self.risk_class.as_deref()
    }
    /// The platform's id for the delivered message, used to correlate replies.
    pub fn transport_ref(&self) -> Option<&str> {
        self.transport_ref.as_deref()
    }
    /// The audit id of the last outcome recorded for this item, if known.
    pub fn last_audit_id(&self) -> Option<&str> {
        self.last_audit_id.as_deref()
    }

    /// Until when the platform asked not to send to this destination (from the
    /// last retryable failure's `retry_after`), if that is still recorded.
    pub fn cooldown_until(&self) -> Option<DateTime<Utc>> {
        self.cooldown_until
    }

    /// When this item's latest send that may or may not have reached the
    /// platform (an ambiguous failure: a dead worker's claim, a panic, a
    /// cancelled future, [`SendError::ambiguous`](crate::SendError::ambiguous))
    /// was claimed. It counts against the destination's rate caps as a send.
    pub fn maybe_sent_at(&self) -> Option<DateTime<Utc>> {
        self.maybe_sent_at
    }

    /// The class of the failure behind [`error_code`](Self::error_code), as
    /// stored when it happened: [`FailureClass::Ambiguous`] means the message
    /// may have been delivered (a `send` that reported it, a crashed claim, a
    /// panic, a cancelled async send). `None` when nothing failed, for an
    /// operator's cancel or a rate deferral, and for items written before the
    /// class was stored (seed files); read those by their error code.
    pub fn failure_class(&self) -> Option<FailureClass> {
        self.failure_class
    }

    /// Its place in enqueue order: a number larger than that of every item
    /// live when it was enqueued (or requeued). `None` for items written by
    /// releases (or the reference design) that had no sequence; they come first.
    pub fn enqueue_seq(&self) -> Option<u64> {
        self.seq
    }

    /// A transaction id for the platform, stable for this item forever: the same
    /// on every attempt, after a restart, after an operator's requeue, and in
    /// every process. Platforms that deduplicate by a client transaction id
    /// (Matrix `txnId`, Telegram has none, many HTTP APIs take an
    /// `Idempotency-Key` header) use it to turn a repeated send into the first
    /// one's answer.
    ///
    /// It is `do1-` followed by the first 128 bits, in lowercase hex, of the
    /// SHA-256 of `durable-outbox transaction id 1\n` and the idempotency key:
    /// printable ASCII, 36 bytes, safe in a URL path, and revealing nothing of
    /// the key beyond equality.
    ///
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// use durable_outbox::{NewMessage, Outbox};
    ///
    /// let outbox = Outbox::open(dir.path())?;
    /// let item = outbox.enqueue(NewMessage {
    ///     idempotency_key: "order-17".into(),
    ///     connector: "matrix".into(),
    ///     grant_id: "bot-1".into(),
    ///     destination: "!room:example.org".into(),
    ///     content: "your order shipped".into(),
    ///     ..Default::default()
    /// })?;
    /// assert!(item.transaction_id().starts_with("do1-"));
    /// assert_eq!(item.transaction_id().len(), 36);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn transaction_id(&self) -> String {
        let digest = Sha256::new()
            .chain_update(b"durable-outbox transaction id 1\n")
            .chain_update(self.idempotency_key.as_bytes())
            .finalize();
        format!("do1-{}", hex::encode(&digest[..16]))
    }

    /// The owner id written into the claim, if any.
    pub(crate) fn claim_owner(&self) -> Option<&str> {
        self.claim.as_ref().and_then(|c| c.owner.as_deref())
    }

    /// Whether the item still holds exactly `claim`: queued, claimed by its
    /// owner (a claim naming no owner is nobody's), in the same attempt, at
    /// the same time. A claim that was lost and a newer one of the same owner
    /// are different claims.
    pub(crate) fn holds(&self, claim: &ClaimId) -> bool {
        self.state == ItemState::Queued
            && self.idempotency_key == claim.key
            && claim.owner.is_some()
            && self.claim_owner() == claim.owner.as_deref()
            && self.claim_stamp() == Some(claim.stamp())
    }

    /// The attempt and claim time of the claim the item holds (see
    /// [`ClaimId::stamp`]), `None` if unclaimed.
    pub(crate) fn claim_stamp(&self) -> Option<ClaimStamp> {
        self.claim
            .as_ref()
            .map(|c| (self.attempts, c.at.map(stored_precision)))
    }
}

impl fmt::Debug for OutboxItem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboxItem")
            .field("idempotency_key", &self.idempotency_key)
            .field("connector", &self.connector)
            .field("grant_id", &self.grant_id)
            .field("destination", &self.destination)
            .field("content", &ContentSummary(&self.content))
            .field("state", &self.state)
            .field("attempts", &self.attempts)
            .field("dispatch_claimed", &self.dispatch_claimed())
            .field("next_attempt_at", &self.next_attempt_at)
            .field("sent_at", &self.sent_at)
            .field("error_code", &self.error_code)
            .field("failure_class", &self.failure_class)
            .field("transport_ref", &self.transport_ref)
            .finish_non_exhaustive()
    }
}
