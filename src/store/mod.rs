//! `outbox.json`: the only module that reads or writes it.
//!
//! The file is always replaced whole and atomically (see `fsutil`). A file that
//! cannot be read, parsed or validated is reported with its path and position and
//! is never overwritten: every write path loads first and stops at the error.

mod v1;

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};

use crate::audit::{AuditEvent, Head};
use crate::clock::{format_timestamp, parse_timestamp};
use crate::error::{Error, Result};
use crate::failpoint::Failpoints;
use crate::fsutil::{self, ReplaceFailure};
use crate::item::{Claim, ItemState, OutboxItem};
use crate::message::content_hash;

pub(crate) use v1::CURRENT_VERSION;
use v1::{FileV1, HeadV1, ItemV1, VersionProbe};

/// Name of the state file inside an outbox directory.
pub(crate) const STATE_FILE: &str = "outbox.json";

/// The outbox's whole state, as held in memory between load and save.
#[derive(Debug, Clone, Default)]
pub(crate) struct State {
    /// Items by idempotency key (sorted, as in the file).
    pub(crate) items: BTreeMap<String, OutboxItem>,
    /// The audit head when this state was written, before `pending_audit`.
    pub(crate) audit_head: Option<Head>,
    /// Outcomes committed with this state whose audit records may not be in the log yet.
    pub(crate) pending_audit: Vec<AuditEvent>,
}

/// Reads and writes `outbox.json` in one directory.
#[derive(Debug)]
pub(crate) struct Store {
    dir: PathBuf,
    path: PathBuf,
}

impl Store {
    pub(crate) fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_path_buf(),
            path: dir.join(STATE_FILE),
        }
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Loads the current state; a missing file is an empty outbox.
    pub(crate) fn load(&self) -> Result<State> {
        let bytes = match std::fs::read(&self.path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(State::default()),
            Err(e) => return Err(Error::io(&self.path, "read", e)),
        };
        decode(&self.path, &bytes)
    }

    /// Replaces the file with `state`, durably.
    pub(crate) fn save(
        &self,
        state: &State,
        faults: &Failpoints,
    ) -> std::result::Result<(), (ReplaceFailure, Error)> {
        let bytes = encode(state);
        fsutil::replace_atomically(&self.dir, STATE_FILE, &bytes, faults)
    }
}

/// Serialises a state as version 2, pretty-printed, newline-terminated.
pub(crate) fn encode(state: &State) -> Vec<u8> {
    let file = FileV1 {
        version: CURRENT_VERSION,
        audit_head: state.audit_head.as_ref().map(HeadV1::from),
        items: state.items.values().map(item_to_disk).collect(),
        pending_audit: state.pending_audit.clone(),
    };
    #[expect(clippy::expect_used, reason = "plain data always serialises")]
    let mut bytes = serde_json::to_vec_pretty(&file).expect("outbox state serialises");
    bytes.push(b'\n');
    bytes
}

/// Parses and validates a file's bytes.
pub(crate) fn decode(path: &Path, bytes: &[u8]) -> Result<State> {
    let file: FileV1 = match serde_json::from_slice(bytes) {
        Ok(file) => file,
        Err(e) => {
            // Name an unknown version rather than the first field it does not know.
            if let Ok(VersionProbe {
                version: Some(version),
            }) = serde_json::from_slice(bytes)
                && !(1..=CURRENT_VERSION).contains(&version)
            {
                return Err(Error::UnsupportedVersion {
                    path: path.to_path_buf(),
                    version,
                });
            }
            return Err(Error::corrupt(path, e));
        }
    };
    if !(1..=CURRENT_VERSION).contains(&file.version) {
        return Err(Error::UnsupportedVersion {
            path: path.to_path_buf(),
            version: file.version,
        });
    }
    let mut items = BTreeMap::new();
    for (index, raw) in file.items.into_iter().enumerate() {
        let item = item_from_disk(path, index, raw)?;
        let key = item.idempotency_key.clone();
        if items.insert(key.clone(), item).is_some() {
            return Err(invalid(
                path,
                format!("items[{index}] (key {key:?})"),
                "duplicate idempotency_key",
            ));
        }
    }
    Ok(State {
        items,
        audit_head: file.audit_head.map(|h| Head {
            seq: h.seq,
            hash: h.hash,
        }),
        pending_audit: file.pending_audit,
    })
}

fn invalid(path: &Path, location: String, reason: impl Into<String>) -> Error {
    Error::InvalidRecord {
        path: path.to_path_buf(),
        location,
        reason: reason.into(),
    }
}

fn item_to_disk(item: &OutboxItem) -> ItemV1 {
    let time = |t: Option<DateTime<Utc>>| t.map(format_timestamp);
    ItemV1 {
        attempts: i64::from(item.attempts),
        claim_owner: item.claim.as_ref().and_then(|c| c.owner.clone()),
        claimed_at_utc: time(item.claim.as_ref().and_then(|c| c.at)),
        connector: item.connector.clone(),
        content: item.content.clone(),
        content_hash: item.content_hash.clone(),
        created_at_utc: format_timestamp(item.created_at),
        destination: item.destination.clone(),
        direction: item.direction.clone(),
        dispatch_claimed: item.claim.is_some(),
        error_code: item.error_code.clone(),
        grant_id: item.grant_id.clone(),
        idempotency_key: item.idempotency_key.clone(),
        lane: item.lane.clone(),
        last_audit_id: item.last_audit_id.clone(),
        next_attempt_at_utc: time(item.next_attempt_at),
        risk_class: item.risk_class.clone(),
        sent_at_utc: time(item.sent_at),
        state: item.state.as_str().to_owned(),
        transport_ref: item.transport_ref.clone(),
        updated_at_utc: format_timestamp(item.updated_at),
    }
}

fn item_from_disk(path: &Path, index: usize, raw: ItemV1) -> Result<OutboxItem> {
    let at = |field: &str| {
        format!(
            "items[{index}] (key {:?}) field {field}",
            raw.idempotency_key
        )
    };
    let required_time = |field: &'static str, value: &str| {
        parse_timestamp(value).ok_or_else(|| {
            invalid(
                path,
                at(field),
                format!("{value:?} is not an RFC 3339 time"),
            )
        })
    };
    let optional_time = |field: &'static str, value: &Option<String>| {
        value
            .as_deref()
            .map(|v| required_time(field, v))
            .transpose()
    };
    if raw.idempotency_key.trim().is_empty() {
        return Err(invalid(path, at("idempotency_key"), "must not be blank"));
    }
    let state = ItemState::parse(&raw.state).ok_or_else(|| {
        invalid(
            path,
            at("state"),
            format!("{:?} is not one of queued, sent, failed", raw.state),
        )
    })?;
    let attempts = u32::try_from(raw.attempts).map_err(|_| {
        invalid(
            path,
            at("attempts"),
            format!("{} is out of range", raw.attempts),
        )
    })?;
    if content_hash(&raw.content) != raw.content_hash {
        return Err(invalid(
            path,
            at("content_hash"),
            "does not match the SHA-256 of content",
        ));
    }
    let claim = if raw.dispatch_claimed {
        Some(Claim {
            owner: raw.claim_owner.clone(),
            at: optional_time("claimed_at_utc", &raw.claimed_at_utc)?,
        })
    } else {
        None
    };
    Ok(OutboxItem {
        created_at: required_time("created_at_utc", &raw.created_at_utc)?,
        updated_at: required_time("updated_at_utc", &raw.updated_at_utc)?,
        next_attempt_at: optional_time("next_attempt_at_utc", &raw.next_attempt_at_utc)?,
        sent_at: optional_time("sent_at_utc", &raw.sent_at_utc)?,
        idempotency_key: raw.idempotency_key,
        connector: raw.connector,
        grant_id: raw.grant_id,
        destination: raw.destination,
        content: raw.content,
        content_hash: raw.content_hash,
        state,
        attempts,
        claim,
        error_code: raw.error_code,
        lane: raw.lane,
        direction: raw.direction,
        risk_class: raw.risk_class,
        transport_ref: raw.transport_ref,
        last_audit_id: raw.last_audit_id,
    })
}

#[cfg(test)]
mod tests;
