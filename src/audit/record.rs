//! One audit record, its canonical bytes and its hash.

use std::borrow::Cow;

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::send::FailureClass;

/// The `prev_hash` of the first record: 64 zeros.
pub const GENESIS_HASH: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// What an audit record reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum AuditOutcome {
    /// The item was enqueued.
    Queued,
    /// The item was delivered.
    Sent,
    /// The item failed terminally.
    Failed,
    /// A rate cap held the item back; it stays queued.
    Deferred,
    /// A retryable failure; the item stays queued for another attempt.
    Retrying,
    /// An operator moved a failed item back to the queue.
    Requeued,
    /// An operator cancelled a queued item.
    Cancelled,
    /// History was pruned by the retention policy (key `history-segment-<n>`
    /// or `history-retention`), or an operator removed old audit records
    /// (key `audit-segments`); the note names what went.
    Pruned,
    /// The outbox's stored settings changed; the note names each change
    /// (`rate_limit 10/60s -> 1/3600s`). The key is `settings`.
    Settings,
    /// A send whose claim was lost while it ran (declared ambiguous after its
    /// owner's session ended) delivered after the item had moved on: it was
    /// cancelled, claimed again or sent by another attempt. The record carries
    /// that send's transport ref and a note naming what the item had become; it
    /// reports a delivery, not a change of state: the item stays as its
    /// earlier records left it (its `last_audit_id` names this record).
    LateDelivery,
}

impl AuditOutcome {
    /// The name written to the file, e.g. `sent`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Sent => "sent",
            Self::Failed => "failed",
            Self::Deferred => "deferred",
            Self::Retrying => "retrying",
            Self::Requeued => "requeued",
            Self::Cancelled => "cancelled",
            Self::Pruned => "pruned",
            Self::Settings => "settings",
            Self::LateDelivery => "late_delivery",
        }
    }
}

/// The facts of one outcome, before it is given a place in the chain (as
/// JSON, a pending event of the PostgreSQL engine waiting to be sealed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct AuditEvent {
    pub(crate) attempts: u32,
    pub(crate) audit_id: String,
    pub(crate) connector: String,
    pub(crate) content_hash: String,
    pub(crate) destination: String,
    pub(crate) direction: String,
    pub(crate) error_code: Option<String>,
    pub(crate) failure_class: Option<FailureClass>,
    pub(crate) grant_id: String,
    pub(crate) idempotency_key: String,
    pub(crate) lane: String,
    pub(crate) outcome: AuditOutcome,
    /// Free text for operator actions (`operator: reason`); `None` otherwise.
    pub(crate) note: Option<String>,
    /// Set when the event itself is a late repair (e.g. a terminal item that never got a record).
    pub(crate) reconciled: bool,
    pub(crate) recorded_at_utc: String,
    pub(crate) risk_class: Option<String>,
    pub(crate) transport_ref: Option<String>,
}

impl AuditEvent {
    /// The event for `item` as it stands now: its fields, and the record's own
    /// outcome, id, note and time. Both engines build their records here.
    pub(crate) fn for_item(
        item: &crate::item::OutboxItem,
        outcome: AuditOutcome,
        audit_id: String,
        note: Option<&str>,
        reconciled: bool,
        recorded_at_utc: String,
    ) -> Self {
        Self {
            attempts: item.attempts,
            audit_id,
            connector: item.connector.clone(),
            content_hash: item.content_hash.clone(),
            destination: item.destination.clone(),
            direction: item.direction.clone(),
            error_code: item.error_code.clone(),
            failure_class: item.failure_class,
            grant_id: item.grant_id.clone(),
            idempotency_key: item.idempotency_key.clone(),
            lane: item.lane.clone(),
            outcome,
            note: note.map(str::to_owned),
            reconciled,
            recorded_at_utc,
            risk_class: item.risk_class.clone(),
            transport_ref: item.transport_ref.clone(),
        }
    }
}

/// One line of `audit.jsonl`.
///
/// Fields are declared in byte-wise alphabetical order: serde writes them in that
/// order, which is the canonical key order (see the module docs of `audit`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct AuditRecord {
    /// Attempts made when the outcome was recorded.
    pub attempts: u32,
    /// A unique id for this record (also on the receipt).
    pub audit_id: String,
    /// The item's connector.
    pub connector: String,
    /// SHA-256 of the message body (never the body itself).
    pub content_hash: String,
    /// The item's destination.
    pub destination: String,
    /// The item's direction label.
    pub direction: String,
    /// The error code, for failures, retries and deferrals.
    pub error_code: Option<String>,
    /// The class of the failure, for failures and retries recorded since the
    /// class is stored. Absent from the line when `None`, so records written
    /// before the field existed keep their canonical form and hash.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_class: Option<FailureClass>,
    /// The item's grant.
    pub grant_id: String,
    /// SHA-256 (or HMAC-SHA-256 in keyed mode) of the canonical record without this field, hex.
    pub hash: String,
    /// The item's key.
    pub idempotency_key: String,
    /// The item's lane label.
    pub lane: String,
    /// Operator actions: who and why. Resends under an idempotent transport:
    /// the ambiguous outcome that was resent.
    pub note: Option<String>,
    /// What happened.
    pub outcome: AuditOutcome,
    /// The previous record's `hash` ([`GENESIS_HASH`] for the first record).
    pub prev_hash: String,
    /// `true` when the record was appended late, by crash repair, rather than
    /// right after the outcome was committed.
    pub reconciled: bool,
    /// When the outcome happened (UTC, microseconds).
    pub recorded_at_utc: String,
    /// The item's risk class label.
    pub risk_class: Option<String>,
    /// 1 for the first record, then +1 per record.
    pub seq: u64,
    /// The platform's message id, for `sent`.
    pub transport_ref: Option<String>,
}

/// A record's fields, borrowed, in canonical order: with `hash`, the line of
/// the file; without, what gets hashed.
///
/// [`write`](Self::write) produces exactly the bytes `serde_json` gives for
/// [`AuditRecord`] (the format every existing log was written in): keys in
/// byte-wise order, no spaces, `failure_class` absent when `None`, strings
/// escaped as `serde_json` escapes them. It writes into one buffer sized
/// up front, with no serializer in between: sealing a record and appending
/// its line cost a copy of each field instead of a pass through `serde`.
/// The tests compare it with `serde_json` on arbitrary records.
struct Canonical<'a> {
    attempts: u32,
    audit_id: &'a str,
    connector: &'a str,
    content_hash: &'a str,
    destination: &'a str,
    direction: &'a str,
    error_code: Option<&'a str>,
    failure_class: Option<FailureClass>,
    grant_id: &'a str,
    hash: Option<&'a str>,
    idempotency_key: &'a str,
    lane: &'a str,
    note: Option<&'a str>,
    outcome: AuditOutcome,
    prev_hash: &'a str,
    reconciled: bool,
    recorded_at_utc: &'a str,
    risk_class: Option<&'a str>,
    seq: u64,
    transport_ref: Option<&'a str>,
}

impl<'a> Canonical<'a> {
    fn of(record: &'a AuditRecord, hash: Option<&'a str>) -> Self {
        Self {
            attempts: record.attempts,
            audit_id: &record.audit_id,
            connector: &record.connector,
            content_hash: &record.content_hash,
            destination: &record.destination,
            direction: &record.direction,
            error_code: record.error_code.as_deref(),
            failure_class: record.failure_class,
            grant_id: &record.grant_id,
            hash,
            idempotency_key: &record.idempotency_key,
            lane: &record.lane,
            note: record.note.as_deref(),
            outcome: record.outcome,
            prev_hash: &record.prev_hash,
            reconciled: record.reconciled,
            recorded_at_utc: &record.recorded_at_utc,
            risk_class: record.risk_class.as_deref(),
            seq: record.seq,
            transport_ref: record.transport_ref.as_deref(),
        }
    }

    /// The canonical JSON object, appended to `out` (reserved up front).
    fn write(&self, out: &mut Vec<u8>) {
        let text = [
            self.audit_id,
            self.connector,
            self.content_hash,
            self.destination,
            self.direction,
            self.error_code.unwrap_or(""),
            self.grant_id,
            self.hash.unwrap_or(""),
            self.idempotency_key,
            self.lane,
            self.note.unwrap_or(""),
            self.prev_hash,
            self.recorded_at_utc,
            self.risk_class.unwrap_or(""),
            self.transport_ref.unwrap_or(""),
        ];
        // Keys, punctuation and numbers take under 320 bytes.
        out.reserve(320 + text.iter().map(|t| t.len()).sum::<usize>());
        out.extend_from_slice(b"{\"attempts\":");
        write_u64(out, u64::from(self.attempts));
        out.extend_from_slice(b",\"audit_id\":");
        write_str(out, self.audit_id);
        out.extend_from_slice(b",\"connector\":");
        write_str(out, self.connector);
        out.extend_from_slice(b",\"content_hash\":");
        write_str(out, self.content_hash);
        out.extend_from_slice(b",\"destination\":");
        write_str(out, self.destination);
        out.extend_from_slice(b",\"direction\":");
        write_str(out, self.direction);
        out.extend_from_slice(b",\"error_code\":");
        write_opt(out, self.error_code);
        if let Some(class) = self.failure_class {
            out.extend_from_slice(b",\"failure_class\":");
            write_str(out, class.as_str());
        }
        out.extend_from_slice(b",\"grant_id\":");
        write_str(out, self.grant_id);
        if let Some(hash) = self.hash {
            out.extend_from_slice(b",\"hash\":");
            write_str(out, hash);
        }
        out.extend_from_slice(b",\"idempotency_key\":");
        write_str(out, self.idempotency_key);
        out.extend_from_slice(b",\"lane\":");
        write_str(out, self.lane);
        out.extend_from_slice(b",\"note\":");
        write_opt(out, self.note);
        out.extend_from_slice(b",\"outcome\":");
        write_str(out, self.outcome.as_str());
        out.extend_from_slice(b",\"prev_hash\":");
        write_str(out, self.prev_hash);
        out.extend_from_slice(if self.reconciled {
            b",\"reconciled\":true"
        } else {
            b",\"reconciled\":false"
        });
        out.extend_from_slice(b",\"recorded_at_utc\":");
        write_str(out, self.recorded_at_utc);
        out.extend_from_slice(b",\"risk_class\":");
        write_opt(out, self.risk_class);
        out.extend_from_slice(b",\"seq\":");
        write_u64(out, self.seq);
        out.extend_from_slice(b",\"transport_ref\":");
        write_opt(out, self.transport_ref);
        out.push(b'}');
    }
}

/// A JSON string as `serde_json` writes it. Text with nothing to escape (no
/// quote, backslash or control character: nearly every field) is copied as it is;
/// anything else goes through `serde_json` itself, so its escapes are theirs.
fn write_str(out: &mut Vec<u8>, text: &str) {
    if text.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.push(b'"');
        out.extend_from_slice(text.as_bytes());
        out.push(b'"');
    } else {
        #[expect(
            clippy::expect_used,
            reason = "writing a string into a Vec cannot fail"
        )]
        serde_json::to_writer(&mut *out, text).expect("a string serialises");
    }
}

fn write_opt(out: &mut Vec<u8>, text: Option<&str>) {
    match text {
        Some(text) => write_str(out, text),
        None => out.extend_from_slice(b"null"),
    }
}

/// An integer in decimal, as `serde_json` writes it.
fn write_u64(out: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[at..]);
}

/// How record hashes are computed.
#[derive(Clone)]
pub(crate) enum Hasher {
    /// Plain SHA-256: detects accidents and edits by anyone who does not recompute the chain.
    Plain,
    /// HMAC-SHA-256 with a secret key: a chain cannot be recomputed without the key.
    Keyed(Vec<u8>),
}

impl std::fmt::Debug for Hasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Plain => f.write_str("Plain"),
            Self::Keyed(_) => f.write_str("Keyed(<secret>)"),
        }
    }
}

impl Hasher {
    pub(crate) fn hash(&self, canonical: &[u8]) -> String {
        self.hash_parts(&[canonical])
    }

    /// Hashes the concatenation of `parts` without building it.
    pub(crate) fn hash_parts(&self, parts: &[&[u8]]) -> String {
        match self {
            Self::Plain => {
                let mut digest = Sha256::new();
                for part in parts {
                    digest.update(part);
                }
                hex::encode(digest.finalize())
            }
            Self::Keyed(key) => {
                #[expect(clippy::expect_used, reason = "HMAC accepts keys of every length")]
                let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC key of any length");
                for part in parts {
                    mac.update(part);
                }
                hex::encode(mac.finalize().into_bytes())
            }
        }
    }
}

impl AuditRecord {
    /// Places `event` after `prev` in the chain and computes its hash.
    pub(crate) fn seal(
        event: &AuditEvent,
        seq: u64,
        prev_hash: &str,
        reconciled: bool,
        hasher: &Hasher,
    ) -> Self {
        let mut record = Self {
            attempts: event.attempts,
            audit_id: event.audit_id.clone(),
            connector: event.connector.clone(),
            content_hash: event.content_hash.clone(),
            destination: event.destination.clone(),
            direction: event.direction.clone(),
            error_code: event.error_code.clone(),
            failure_class: event.failure_class,
            grant_id: event.grant_id.clone(),
            hash: String::new(),
            idempotency_key: event.idempotency_key.clone(),
            lane: event.lane.clone(),
            note: event.note.clone(),
            outcome: event.outcome,
            prev_hash: prev_hash.to_owned(),
            reconciled: reconciled || event.reconciled,
            recorded_at_utc: event.recorded_at_utc.clone(),
            risk_class: event.risk_class.clone(),
            seq,
            transport_ref: event.transport_ref.clone(),
        };
        let mut unhashed = Vec::new();
        Canonical::of(&record, None).write(&mut unhashed);
        record.hash = hasher.hash(&unhashed);
        record
    }

    /// The record as one line of the file, newline included.
    #[cfg(any(test, feature = "postgres"))]
    pub(crate) fn to_line(&self) -> Vec<u8> {
        let mut line = Vec::new();
        self.write_line(&mut line);
        line
    }

    /// Appends the record's line, newline included, to `out`.
    pub(crate) fn write_line(&self, out: &mut Vec<u8>) {
        Canonical::of(self, Some(&self.hash)).write(out);
        out.push(b'\n');
    }
}

/// The fields verification needs from a line, borrowed from it where possible.
///
/// Every field of [`AuditRecord`] is present and typed, so a structurally invalid
/// record is reported as malformed; only `seq`, `prev_hash` and `hash` are used,
/// and, to find the removal record a chain's start needs, `idempotency_key`,
/// `outcome` and `note`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code, reason = "fields are parsed to validate the record's shape")]
pub(crate) struct LineView<'a> {
    attempts: u32,
    #[serde(borrow)]
    audit_id: Cow<'a, str>,
    #[serde(borrow)]
    connector: Cow<'a, str>,
    #[serde(borrow)]
    content_hash: Cow<'a, str>,
    #[serde(borrow)]
    destination: Cow<'a, str>,
    #[serde(borrow)]
    direction: Cow<'a, str>,
    #[serde(borrow)]
    error_code: Option<Cow<'a, str>>,
    #[serde(default)]
    failure_class: Option<FailureClass>,
    #[serde(borrow)]
    grant_id: Cow<'a, str>,
    #[serde(borrow)]
    pub(crate) hash: Cow<'a, str>,
    #[serde(borrow)]
    pub(crate) idempotency_key: Cow<'a, str>,
    #[serde(borrow)]
    lane: Cow<'a, str>,
    #[serde(borrow)]
    pub(crate) note: Option<Cow<'a, str>>,
    pub(crate) outcome: AuditOutcome,
    #[serde(borrow)]
    pub(crate) prev_hash: Cow<'a, str>,
    reconciled: bool,
    #[serde(borrow)]
    recorded_at_utc: Cow<'a, str>,
    #[serde(borrow)]
    risk_class: Option<Cow<'a, str>>,
    pub(crate) seq: u64,
    #[serde(borrow)]
    transport_ref: Option<Cow<'a, str>>,
}

/// The key that introduces the hash in a canonical line. Inside JSON strings every
/// `"` is escaped, so this byte sequence can only be the `hash` key itself.
const HASH_MEMBER: &[u8] = b",\"hash\":\"";

/// Recomputes the hash of a stored canonical line: the line's own bytes with the
/// `,"hash":"<64 hex>"` member cut out, which is exactly the canonical form of the
/// record without `hash`. `None` when the line has no such member.
pub(crate) fn hash_of_line(line: &[u8], hasher: &Hasher) -> Option<String> {
    let start = line
        .windows(HASH_MEMBER.len())
        .position(|w| w == HASH_MEMBER)?;
    let end = start + HASH_MEMBER.len() + 64 + 1;
    if line.get(end - 1) != Some(&b'"') {
        return None;
    }
    Some(hasher.hash_parts(&[&line[..start], &line[end..]]))
}
