//! What a keyed chain needs besides its records: an authenticated starting
//! point (`audit.anchor`) and an authenticated end (the `audit_head` that
//! `outbox.json` records).
//!
//! Record hashes alone do not stop someone without the key from cutting whole
//! records off either end of the chain. Cutting the front needs a new starting
//! point, so in keyed mode the anchor carries a MAC, and names the keyed removal
//! record (`audit-segments`) that the operator's removal appended, which in
//! turn names the anchor. Cutting the tail needs the recorded head moved back,
//! so in keyed mode the head carries a MAC over its seq, hash and the snapshot's
//! generation (a head copied from an older snapshot does not fit a newer one).
//!
//! Both MACs are HMAC-SHA-256 under the audit key of a fixed text (see
//! [`anchor_text`] and [`head_text`]), written as lowercase hex. In plain mode
//! neither is written or checked: anyone can recompute a plain SHA-256.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::record::Hasher;
use super::{AuditOutcome, AuditRecord, Head};
use crate::error::{Error, Result};
use crate::fsutil;

/// Name of the file recording where the chain starts after an operator removed
/// old sealed segments.
pub(crate) const ANCHOR_FILE: &str = "audit.anchor";

/// The `idempotency_key` of the system record that audits a removal of sealed
/// audit segments.
pub(crate) const REMOVAL_SUBJECT: &str = "audit-segments";

/// `audit.anchor` on disk: `{"hash","mac","removed_at_seq","seq"}`. Version 1
/// files have only `hash` and `seq`; `mac` is present in keyed mode only.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct AnchorFile {
    hash: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    mac: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    removed_at_seq: Option<u64>,
    seq: u64,
}

/// Where the remaining chain starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Anchor {
    /// The last removed record (genesis when nothing was removed).
    pub(crate) head: Head,
    /// The seq of the record that audited the removal, when the file names it.
    pub(crate) removed_at_seq: Option<u64>,
}

impl Anchor {
    fn genesis() -> Self {
        Self {
            head: Head::genesis(),
            removed_at_seq: None,
        }
    }
}

/// The text the anchor's MAC covers.
fn anchor_text(head: &Head, removed_at_seq: u64) -> String {
    format!(
        "durable-outbox audit.anchor 1\nseq {}\nhash {}\nremoved_at_seq {removed_at_seq}\n",
        head.seq, head.hash
    )
}

/// The text the recorded head's MAC covers.
fn head_text(head: &Head, generation: u64) -> String {
    format!(
        "durable-outbox audit_head 1\nseq {}\nhash {}\ngeneration {generation}\n",
        head.seq, head.hash
    )
}

/// Compares two MACs in time independent of where they differ.
fn same_mac(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |diff, (x, y)| diff | (x ^ y))
            == 0
}

/// The words a removal record's note ends with, naming the anchor it leaves.
pub(crate) fn removal_note(anchor: &Head) -> String {
    format!(
        "the chain now starts after seq {} hash {}",
        anchor.seq, anchor.hash
    )
}

/// Whether a record (its `idempotency_key`, `outcome` and `note`) is a
/// removal of old audit records that leaves the chain starting right after
/// `anchor`: the `pruned` record with subject [`REMOVAL_SUBJECT`] whose note
/// ends with [`removal_note`]`(anchor)` and the closing parenthesis, as both
/// engines write it (`<operator>: <reason> (removed …; the chain now starts
/// after seq S hash H)`). The operator's words come first, so they cannot
/// stand in for the engine's.
pub(crate) fn names_anchor(
    key: &str,
    outcome: AuditOutcome,
    note: Option<&str>,
    anchor: &Head,
) -> bool {
    key == REMOVAL_SUBJECT
        && outcome == AuditOutcome::Pruned
        && note.is_some_and(|note| {
            note.strip_suffix(')')
                .is_some_and(|rest| rest.ends_with(&removal_note(anchor)))
        })
}

/// The bytes of `audit.anchor` for a removal that ends at `head`, audited by
/// the record at `removed_at_seq`.
pub(crate) fn encode_anchor(head: &Head, removed_at_seq: u64, hasher: &Hasher) -> Vec<u8> {
    let mac = match hasher {
        Hasher::Plain => None,
        Hasher::Keyed(_) => Some(hasher.hash(anchor_text(head, removed_at_seq).as_bytes())),
    };
    let file = AnchorFile {
        hash: head.hash.clone(),
        mac,
        removed_at_seq: Some(removed_at_seq),
        seq: head.seq,
    };
    #[expect(clippy::expect_used, reason = "plain data always serialises")]
    let mut bytes = serde_json::to_vec(&file).expect("anchor serialises");
    bytes.push(b'\n');
    bytes
}

/// Reads the anchor in `dir` (genesis when there is none). In keyed mode it
/// must carry a valid MAC and name its removal record.
pub(crate) fn read_anchor(dir: &Path, hasher: &Hasher) -> Result<Anchor> {
    let path = dir.join(ANCHOR_FILE);
    let bytes = match fsutil::read_existing(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Anchor::genesis()),
        Err(e) => return Err(Error::io(&path, "read", e)),
    };
    let file: AnchorFile = serde_json::from_slice(&bytes).map_err(|e| Error::corrupt(&path, e))?;
    let anchor = Anchor {
        head: Head {
            seq: file.seq,
            hash: file.hash,
        },
        removed_at_seq: file.removed_at_seq,
    };
    if let Hasher::Keyed(_) = hasher {
        let invalid = |location: &str, reason: &str| Error::InvalidRecord {
            path: path.clone(),
            location: location.into(),
            reason: reason.into(),
        };
        let (Some(mac), Some(removed_at_seq)) = (&file.mac, anchor.removed_at_seq) else {
            return Err(invalid(
                "mac",
                "the audit log is keyed but the anchor is not authenticated: \
                 it was not written by a keyed removal of old segments",
            ));
        };
        let expected = hasher.hash(anchor_text(&anchor.head, removed_at_seq).as_bytes());
        if !same_mac(mac, &expected) {
            return Err(invalid(
                "mac",
                "the anchor's MAC does not match (it was edited, or written with another key)",
            ));
        }
    }
    Ok(anchor)
}

/// In keyed mode, checks that the (verified) chain holds the record the anchor
/// names, and that it is the removal that left this anchor: an anchor copied
/// from elsewhere does not start this chain.
pub(crate) fn check_removal_record(
    dir: &Path,
    anchor: &Anchor,
    files: &[PathBuf],
    hasher: &Hasher,
) -> Result<()> {
    let (Hasher::Keyed(_), Some(seq)) = (hasher, anchor.removed_at_seq) else {
        return Ok(());
    };
    let path = dir.join(ANCHOR_FILE);
    let wanted = removal_note(&anchor.head);
    // The file holding `seq`: the last whose first record is at or before it.
    for file in files.iter().rev() {
        let mut records = super::AuditLog::records(file)?.peekable();
        match records.peek() {
            Some(Ok(first)) if first.seq <= seq => {}
            Some(Err(_)) => {}
            Some(Ok(_)) | None => continue,
        }
        for record in records {
            let record: AuditRecord = record?;
            if record.seq == seq {
                let matches = record.idempotency_key == REMOVAL_SUBJECT
                    && record.outcome == AuditOutcome::Pruned
                    && record
                        .note
                        .as_deref()
                        .is_some_and(|note| note.contains(&wanted));
                return if matches {
                    Ok(())
                } else {
                    Err(Error::InvalidRecord {
                        path,
                        location: "removed_at_seq".into(),
                        reason: format!(
                            "audit record seq {seq} is not the removal that left this anchor"
                        ),
                    })
                };
            }
        }
        break;
    }
    Err(Error::InvalidRecord {
        path,
        location: "removed_at_seq".into(),
        reason: format!(
            "the chain has no audit record seq {seq}, the removal that left this anchor"
        ),
    })
}

/// The MAC of the head a snapshot of `generation` records (keyed mode only).
pub(crate) fn head_mac(hasher: &Hasher, head: &Head, generation: u64) -> Option<String> {
    match hasher {
        Hasher::Plain => None,
        Hasher::Keyed(_) => Some(hasher.hash(head_text(head, generation).as_bytes())),
    }
}

/// In keyed mode, checks the MAC of the head the snapshot at `state_path`
/// records.
pub(crate) fn check_head_mac(
    hasher: &Hasher,
    head: &Head,
    generation: u64,
    mac: Option<&str>,
    state_path: &Path,
) -> Result<()> {
    let Some(expected) = head_mac(hasher, head, generation) else {
        return Ok(());
    };
    let reason = match mac {
        Some(mac) if same_mac(mac, &expected) => return Ok(()),
        Some(_) => {
            "the recorded audit head's MAC does not match: outbox.json was edited \
             (a log cut short and its head moved back), or written with another key"
        }
        None => {
            "the audit log is keyed but the recorded audit head carries no MAC: \
             outbox.json was edited, or written without the key"
        }
    };
    Err(Error::InvalidRecord {
        path: state_path.to_path_buf(),
        location: "audit_head.mac".into(),
        reason: reason.into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::AuditEvent;

    fn event(key: &str, outcome: AuditOutcome, note: Option<String>) -> AuditEvent {
        AuditEvent {
            attempts: 0,
            audit_id: format!("id-{key}"),
            connector: "-".into(),
            content_hash: "-".into(),
            destination: "-".into(),
            direction: "-".into(),
            error_code: None,
            failure_class: None,
            grant_id: "-".into(),
            idempotency_key: key.into(),
            lane: "-".into(),
            outcome,
            note,
            reconciled: false,
            recorded_at_utc: "2026-01-15T09:00:00.000000Z".into(),
            risk_class: None,
            transport_ref: None,
        }
    }

    /// A keyed chain `a`, `b`, removal (naming the anchor after `a`), `c`,
    /// written without `a`, as a removal leaves it. Returns the dir, the
    /// anchor head and the hasher.
    fn chain() -> (tempfile::TempDir, Head, Hasher) {
        let hasher = Hasher::Keyed(b"k".to_vec());
        let dir = tempfile::tempdir().unwrap();
        let first = AuditRecord::seal(
            &event("a", AuditOutcome::Queued, None),
            1,
            super::super::GENESIS_HASH,
            false,
            &hasher,
        );
        let anchor = Head {
            seq: 1,
            hash: first.hash.clone(),
        };
        let mut prev = first;
        let mut kept = Vec::new();
        for (seq, event) in [
            (2, event("b", AuditOutcome::Queued, None)),
            (
                3,
                event(
                    REMOVAL_SUBJECT,
                    AuditOutcome::Pruned,
                    Some(format!("ops: old ({})", removal_note(&anchor))),
                ),
            ),
            (4, event("c", AuditOutcome::Queued, None)),
        ] {
            let record = AuditRecord::seal(&event, seq, &prev.hash, false, &hasher);
            kept.extend(record.to_line());
            prev = record;
        }
        std::fs::write(dir.path().join(super::super::AUDIT_FILE), kept).unwrap();
        (dir, anchor, hasher)
    }

    fn check(dir: &Path, hasher: &Hasher) -> Result<()> {
        let anchor = read_anchor(dir, hasher)?;
        let files = vec![dir.join(super::super::AUDIT_FILE)];
        check_removal_record(dir, &anchor, &files, hasher)
    }

    #[test]
    fn a_keyed_anchor_needs_the_removal_record_that_names_it() {
        let (dir, head, hasher) = chain();
        let path = dir.path().join(ANCHOR_FILE);
        std::fs::write(&path, encode_anchor(&head, 3, &hasher)).unwrap();
        check(dir.path(), &hasher).unwrap();
        // A valid MAC naming a record that is not the removal, or no record.
        for wrong in [2, 4, 9] {
            std::fs::write(&path, encode_anchor(&head, wrong, &hasher)).unwrap();
            let err = check(dir.path(), &hasher).unwrap_err();
            assert!(
                matches!(&err, Error::InvalidRecord { location, .. } if location == "removed_at_seq"),
                "{err}"
            );
        }
        // The removal names another anchor.
        let other = Head {
            seq: 1,
            hash: "ab".repeat(32),
        };
        std::fs::write(&path, encode_anchor(&other, 3, &hasher)).unwrap();
        assert!(check(dir.path(), &hasher).is_err());
    }

    #[test]
    fn a_keyed_anchor_without_a_valid_mac_is_refused_and_a_plain_one_is_read() {
        let (dir, head, hasher) = chain();
        let path = dir.path().join(ANCHOR_FILE);
        std::fs::write(&path, encode_anchor(&head, 3, &Hasher::Plain)).unwrap();
        assert!(read_anchor(dir.path(), &hasher).is_err(), "no MAC");
        assert_eq!(read_anchor(dir.path(), &Hasher::Plain).unwrap().head, head);
        let other_key = Hasher::Keyed(b"other".to_vec());
        std::fs::write(&path, encode_anchor(&head, 3, &other_key)).unwrap();
        assert!(read_anchor(dir.path(), &hasher).is_err(), "another key");
    }
}
