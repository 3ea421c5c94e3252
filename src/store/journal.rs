//! `outbox.journal`: the write-ahead journal of state changes since the last snapshot.
//!
//! Every line is `<16 hex> <json>\n`, where the hex is the first 64 bits of the
//! SHA-256 of the JSON bytes. The first line is a [`HeaderV1`] naming the snapshot
//! generation the journal continues; every later line is an [`EntryV1`]: the full
//! new versions of the items one transaction changed, the exact audit records
//! it produced, and, when it changed them, the whole new stored settings. Entries are numbered from 1 without gaps.
//!
//! The file is preallocated with zeros (and extended in large zero-filled steps),
//! and entries overwrite the zeros in place: an fsync then flushes only data, not
//! a size change, which on ext4 saves a journal commit per transaction. The first
//! zero byte where a line would start marks the end of the entries; no entry can
//! contain a zero byte (JSON escapes it, and NUL is rejected in every field).
//!
//! A line ends at its newline or, before it, at its first zero byte: a line
//! with a zero byte in it is *unfinished* even when its newline is on disk
//! ([`next_line`]). A power cut may keep any of an unsynced write's 512-byte
//! sectors and lose the others; a lost sector reads as the zeros the journal
//! was preallocated with, so zeros inside a line are sectors of a write that
//! did not all land, never part of an entry.
//!
//! An unfinished line is what a crash during a write leaves behind: that write
//! was never acknowledged, so the remnant is copied to `outbox.journal.torn-<n>`
//! and zeroed. So are whole entries after it that come later in the sequence: a
//! commit group writes its entries in one write, whose later sectors a power
//! cut may keep without its first or middle ones (see [`is_unsynced_tail`]).
//!
//! A bad line that is whole (its newline on disk, no zero byte in it) is damage,
//! reported with its byte position, even when it is the last line: every sector
//! of it landed, so a power cut cannot have made it (a flipped bit, a
//! tampered byte can), and it may be an acknowledged entry, which setting it
//! aside would silently drop. So are whole lines after a bad one that cannot be
//! later entries of the same write (not an entry, or a seq at or before the
//! expected one). Zeros inside an entry that *was* synced (a disk that lost a
//! sector) look like a tear here; the audit log tells them apart when it holds
//! a record of that entry (records are logged only after the journal's sync),
//! and opening then refuses (`engine::file::reconcile`).
//!
//! The header is written with the preallocated zeros into a temp file, synced,
//! then renamed into place: a journal's name never shows a torn header.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::v1::{ItemV1, SettingsV1};
use crate::audit::AuditRecord;

/// Name of the journal inside an outbox directory.
pub(crate) const JOURNAL_FILE: &str = "outbox.journal";

/// The journal format version written in headers.
pub(crate) const JOURNAL_VERSION: u32 = 1;

/// The first line of a journal.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct HeaderV1 {
    pub(crate) journal: u32,
    pub(crate) generation: u64,
}

/// One committed transaction.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct EntryV1 {
    pub(crate) seq: u64,
    pub(crate) items: Vec<ItemV1>,
    pub(crate) audit: Vec<AuditRecord>,
    /// The whole stored settings after this transaction, when it changed them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) settings: Option<SettingsV1>,
}

/// Encodes one checksummed line.
pub(crate) fn encode_line<T: Serialize>(value: &T) -> Vec<u8> {
    let mut line = Vec::new();
    encode_line_into(&mut line, value);
    line
}

/// Appends one checksummed line to `out`, encoding the JSON in place (no
/// copy of it): the checksum is filled in once the JSON is there.
pub(crate) fn encode_line_into<T: Serialize>(out: &mut Vec<u8>, value: &T) {
    let start = out.len();
    out.extend_from_slice(&[b' '; 17]);
    #[expect(clippy::expect_used, reason = "plain data always serialises")]
    serde_json::to_writer(&mut *out, value).expect("journal lines serialise");
    let sum = checksum(&out[start + 17..]);
    out[start..start + 16].copy_from_slice(&sum);
    out.push(b'\n');
}

/// The first 64 bits of the SHA-256 of `json`, as 16 lowercase hex digits.
fn checksum(json: &[u8]) -> [u8; 16] {
    let mut hex = [0u8; 16];
    // 8 bytes always fit 16 hex digits.
    let _ = hex::encode_to_slice(&Sha256::digest(json)[..8], &mut hex);
    hex
}

/// What the next line of a buffer is.
pub(crate) enum Line<'a> {
    /// A whole line whose checksum matches: its JSON, and its length with the newline.
    Valid(&'a [u8], usize),
    /// Not a valid line. `terminated`: its newline comes before any zero byte
    /// (a whole line: damage, not a tear); then `len` is its length with the
    /// newline. Otherwise it is unfinished (a zero byte, or the end of the
    /// buffer, comes first, whether or not a newline follows the zeros) and
    /// `len` is its length up to there.
    Invalid { len: usize, terminated: bool },
}

/// Zeros a fresh journal is preallocated with, after its header.
pub(crate) const PREALLOCATE: usize = 1024 * 1024;
/// How much a full journal grows by, at least.
pub(crate) const GROW: u64 = 4 * 1024 * 1024;

/// Splits the next line off `buf` (which must not be empty) and checks it.
/// A line ends at its newline; a zero byte before the newline makes it
/// unfinished, even when the newline follows the zeros: no whole entry holds a
/// zero byte, so that line is a write whose middle sectors never landed.
pub(crate) fn next_line(buf: &[u8]) -> Line<'_> {
    let Some(end) = buf.iter().position(|b| *b == b'\n' || *b == 0) else {
        return Line::Invalid {
            len: buf.len(),
            terminated: false,
        };
    };
    if buf[end] == 0 {
        return Line::Invalid {
            len: end,
            terminated: false,
        };
    }
    let line = &buf[..end];
    let invalid = Line::Invalid {
        len: end + 1,
        terminated: true,
    };
    if line.len() < 18 || line[16] != b' ' {
        return invalid;
    }
    let (sum, json) = (&line[..16], &line[17..]);
    if checksum(json) != sum {
        return invalid;
    }
    Line::Valid(json, end + 1)
}

/// Whether the region where the entries end (at a bad line, or past the
/// zeros that end them) is what a crash left of the last, unsynced write of
/// entries rather than damage: the bad line is unfinished (see [`next_line`]:
/// one with zeros inside is, even with its newline on disk), and every whole,
/// valid line after it is an entry *later* than `next_seq` (the seq expected
/// there), in ascending order.
///
/// Later entries may be whole there because a commit group's leader writes
/// all its members' entries in one write before its one sync, and a power
/// cut may keep any of that write's sectors: some lost (zeros at the start of
/// a line, or inside one) and later ones, with whole entries of the same
/// group, on disk. None of the group was acknowledged. Whole lines that
/// cannot be such entries (not an entry, or a seq at or before the expected
/// one) are damage, as is a bad line that is whole.
pub(crate) fn is_unsynced_tail(bad_terminated: bool, rest: &[u8], next_seq: u64) -> bool {
    let mut last = next_seq;
    !bad_terminated
        && each_whole_line(rest, |json| match serde_json::from_slice::<EntryV1>(json) {
            Ok(entry) if entry.seq > last => {
                last = entry.seq;
                true
            }
            _ => false,
        })
}

/// Whether the region starting at a bad line is a crash remnant rather than
/// damage: the bad line is unfinished and no whole, valid line follows it.
pub(crate) fn is_remnant(bad_terminated: bool, rest: &[u8]) -> bool {
    !bad_terminated && each_whole_line(rest, |_| false)
}

/// Walks `rest` past zeros and bad lines, asking `accept` about each whole,
/// valid line; false as soon as it refuses one.
fn each_whole_line(rest: &[u8], mut accept: impl FnMut(&[u8]) -> bool) -> bool {
    let mut pos = 0;
    while pos < rest.len() {
        if rest[pos] == 0 {
            pos += 1;
            continue;
        }
        match next_line(&rest[pos..]) {
            Line::Valid(json, len) => {
                if !accept(json) {
                    return false;
                }
                pos += len;
            }
            Line::Invalid { len, .. } => pos += len.max(1),
        }
    }
    true
}
