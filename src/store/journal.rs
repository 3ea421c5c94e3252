//! `outbox.journal`: the write-ahead journal of state changes since the last snapshot.
//!
//! Every line is `<16 hex> <json>\n`, where the hex is the first 64 bits of the
//! SHA-256 of the JSON bytes. The first line is a [`HeaderV1`] naming the snapshot
//! generation the journal continues; every later line is an [`EntryV1`]: the full
//! new versions of the items one transaction changed, and the exact audit records
//! it produced. Entries are numbered from 1 without gaps.
//!
//! A line without its newline, with a bad checksum, or made of zeros, at the very
//! end of the file, is what a crash during an append leaves behind: that append was
//! never acknowledged, so the remnant is moved to `outbox.journal.torn-<n>` and cut
//! off. A bad line with good lines after it is damage, and is reported.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::v1::ItemV1;
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
}

/// Encodes one checksummed line.
pub(crate) fn encode_line<T: Serialize>(value: &T) -> Vec<u8> {
    #[expect(clippy::expect_used, reason = "plain data always serialises")]
    let json = serde_json::to_vec(value).expect("journal lines serialise");
    let mut line = Vec::with_capacity(json.len() + 18);
    line.extend_from_slice(checksum(&json).as_bytes());
    line.push(b' ');
    line.extend_from_slice(&json);
    line.push(b'\n');
    line
}

fn checksum(json: &[u8]) -> String {
    hex::encode(&Sha256::digest(json)[..8])
}

/// What the next line of a buffer is.
pub(crate) enum Line<'a> {
    /// A whole line whose checksum matches: its JSON, and its length with the newline.
    Valid(&'a [u8], usize),
    /// Not a valid line; `len` is its length up to and including its newline (or to
    /// the end of the buffer when it has none).
    Invalid { len: usize, terminated: bool },
}

/// Splits the next line off `buf` (which must not be empty) and checks it.
pub(crate) fn next_line(buf: &[u8]) -> Line<'_> {
    let Some(end) = buf.iter().position(|b| *b == b'\n') else {
        return Line::Invalid {
            len: buf.len(),
            terminated: false,
        };
    };
    let line = &buf[..end];
    let invalid = Line::Invalid {
        len: end + 1,
        terminated: true,
    };
    if line.len() < 18 || line[16] != b' ' {
        return invalid;
    }
    let (sum, json) = (&line[..16], &line[17..]);
    if checksum(json).as_bytes() != sum {
        return invalid;
    }
    Line::Valid(json, end + 1)
}

/// Whether `bytes` (the rest of a journal after a bad line) is a crash remnant:
/// nothing but zeros, or no complete line at all.
pub(crate) fn is_remnant(first_bad_terminated: bool, rest_after_bad: &[u8], bad: &[u8]) -> bool {
    let zeros = |b: &[u8]| b.iter().all(|x| *x == 0 || *x == b'\n');
    (!first_bad_terminated && rest_after_bad.is_empty()) || (zeros(bad) && zeros(rest_after_bad))
}
