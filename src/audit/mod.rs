//! The hash-chained audit log, `audit.jsonl`: one record per outcome, never a body.
//!
//! # Format
//!
//! Each line is one JSON object followed by `\n`. The object's keys are written in
//! byte-wise ascending order with no whitespace (`{"attempts":1,"audit_id":"…",…}`);
//! strings use JSON's standard escapes (`\"`, `\\`, `\n`, `\r`, `\t`, `\b`, `\f`,
//! other control characters as lowercase `\u00xx`) and are otherwise raw UTF-8;
//! numbers are integers; absent values are `null`, except `failure_class`, which
//! is left out when absent: records written before the field existed keep
//! exactly their bytes and hashes, and one verifier reads both. Fields: see
//! [`AuditRecord`].
//!
//! # The chain
//!
//! `hash` is the lowercase hex SHA-256 of the record's canonical form **without** its
//! `hash` key (the same serialisation rules as above). `prev_hash` is the previous
//! record's `hash`, or 64 zeros ([`GENESIS_HASH`]) for the first; `seq` starts at 1
//! and grows by exactly 1. In keyed mode ([`OutboxBuilder::audit_key`](crate::OutboxBuilder::audit_key))
//! `hash` is HMAC-SHA-256 under the key instead of SHA-256.
//!
//! A third party can re-verify a file in a few lines of Python:
//!
//! ```text
//! prev, seq = "0" * 64, 0
//! for line in open("audit.jsonl", encoding="utf-8"):
//!     rec = json.loads(line); h = rec.pop("hash"); seq += 1
//!     assert rec["seq"] == seq and rec["prev_hash"] == prev
//!     body = json.dumps(rec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
//!     assert hashlib.sha256(body.encode()).hexdigest() == h
//!     prev = h
//! ```
//!
//! (`fixtures/verify_audit.py` is that loop, plus the one rule for a chain
//! whose oldest records an operator removed: its first record then follows
//! the last removed one, and the removal's own record, key `audit-segments`,
//! outcome `pruned`, must be in the chain with a note ending `the chain now
//! starts after seq S hash H)` naming exactly that record. The same rule
//! applies to an export and to a PostgreSQL outbox's table; a directory keeps
//! the start in `audit.anchor`.)
//!
//! # When it is verified
//!
//! Every compaction records in `outbox.json` where the verified log ends (the
//! head's seq, hash and byte offset). Opening checks that the record at that
//! offset is that head, then verifies only what follows: years of history cost
//! nothing at startup. [`Outbox::verify_audit`](crate::Outbox::verify_audit) and
//! [`AuditLog::verify`] verify the whole log; run one regularly (the CLI's
//! `verify`) to catch damage to old records. If the log does not match the
//! recorded head, opening verifies it from the start and reports what is wrong.
//!
//! # What it proves, and what it cannot
//!
//! Editing, deleting, inserting or reordering records breaks the chain. Cutting off
//! the tail is caught against the head (seq, hash) that `outbox.json` records.
//! Someone who can rewrite **both** files and recompute plain SHA-256 hashes cannot be
//! detected without an outside anchor: use keyed mode, or copy
//! [`AuditReport::head_hash`] somewhere the host cannot rewrite.
//!
//! In keyed mode the ends of the chain are authenticated too (see the `anchor`
//! module): `audit.anchor`, where the chain starts after old segments were
//! removed, carries a MAC and must be named by the keyed removal record, and the
//! head `outbox.json` records carries a MAC bound to the snapshot's generation.
//! Without the key neither end can be moved. What even the key cannot show is a
//! complete earlier copy of every file put back, or the newest records cut
//! together with the journal entries that hold them (what was recorded since the
//! last compaction): for those, keep the head off the host
//! ([`Outbox::audit_head`](crate::Outbox::audit_head), the CLI's `verify
//! --expect-head`).
//!
//! # Crashes
//!
//! Appends are not atomic and not fsynced one by one (the journal holds every
//! record, sealed, before it is appended): after a power cut, the log past the
//! last record known to be durable (the head a snapshot recorded after fsyncing
//! the log) can hold anything: a partial line, zeros, zeros and then a later
//! record, a line with zeros inside. From the first line there that does not
//! verify, the rest is moved, byte for byte, to `audit.jsonl.torn-<seq>-<n>` and
//! cut from the log, and the missing records are re-appended from the journal.
//! Damage at or before the durable record is an error, and the file is never
//! modified.

mod anchor;
mod record;

use std::collections::VecDeque;
use std::fs::{self, File};
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

pub(crate) use anchor::{ANCHOR_FILE, REMOVAL_SUBJECT, check_head_mac, head_mac, removal_note};
pub(crate) use record::{AuditEvent, Hasher};
pub use record::{AuditOutcome, AuditRecord, GENESIS_HASH};

use crate::error::{AuditFault, Error, Result};
use crate::failpoint::Failpoints;
use crate::fsutil;

/// Name of the audit log inside an outbox directory.
pub(crate) const AUDIT_FILE: &str = "audit.jsonl";

/// How many recent (seq, hash) pairs the tail remembers for head cross-checks.
const RECENT: usize = 64;

/// The last record of a chain: its `seq` and `hash` (`seq` 0 and [`GENESIS_HASH`] when empty).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    /// The last record's sequence number (0 for an empty log).
    pub seq: u64,
    /// The last record's hash.
    pub hash: String,
}

impl Head {
    pub(crate) fn genesis() -> Self {
        Self {
            seq: 0,
            hash: GENESIS_HASH.to_owned(),
        }
    }
}

/// The result of a successful verification.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AuditReport {
    /// Whole records verified.
    pub records: u64,
    /// The last record's seq (0 when empty).
    pub head_seq: u64,
    /// The last record's hash ([`GENESIS_HASH`] when empty). Keep a copy off the
    /// host to detect a wholesale rewrite later.
    pub head_hash: String,
    /// Bytes of an unfinished last line left by a crash (not yet quarantined), if any.
    pub torn_tail_bytes: u64,
}

/// Read-only access to an audit file: verification and reading.
///
/// These functions never modify the file. An open [`Outbox`](crate::Outbox) is the
/// only writer.
#[derive(Debug)]
pub struct AuditLog;

impl AuditLog {
    /// Verifies the whole chain of a plain (unkeyed) audit file.
    ///
    /// A missing file verifies as empty. A torn last line is reported in
    /// [`AuditReport::torn_tail_bytes`], not as an error.
    ///
    /// The chain starts at seq 1, or, in an export of a chain whose oldest
    /// records an operator removed
    /// ([`Outbox::remove_old_audit_segments`](crate::Outbox::remove_old_audit_segments)),
    /// right after the last removed record, which the removal's own record
    /// in the file must name.
    ///
    /// # Errors
    ///
    /// [`Error::AuditBroken`] naming the first bad line and the fault
    /// ([`AuditFault`]): [`AuditFault::FrontCut`] at line 1 for a file that
    /// starts after seq 1 with no removal record naming that start (records
    /// cut from its front); [`Error::Io`] when the file cannot be read.
    ///
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// use durable_outbox::AuditLog;
    /// let report = AuditLog::verify(dir.path().join("audit.jsonl"))?;
    /// assert_eq!(report.records, 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn verify(path: impl AsRef<Path>) -> Result<AuditReport> {
        verify_file(path.as_ref(), &Hasher::Plain)
    }

    /// Verifies the whole chain of an outbox directory's audit log: its sealed
    /// segments (`audit-<first seq>.jsonl`, written when the log rotates) in
    /// order, then the active `audit.jsonl`, each linking to the one before.
    ///
    /// # Errors
    ///
    /// As [`verify`](Self::verify), naming the file and line of the first fault.
    ///
    /// If an operator removed the oldest sealed segments, verification starts at
    /// the anchor they left (`audit.anchor`: the last removed record's seq and hash).
    pub fn verify_dir(dir: impl AsRef<Path>) -> Result<AuditReport> {
        let dir = dir.as_ref();
        let anchor = anchor::read_anchor(dir, &Hasher::Plain)?.head;
        let files = chain_files(dir, &anchor)?;
        verify_files_from(anchor, &files, &Hasher::Plain, |_| {})
    }

    /// Streams every record of an outbox directory's audit log, in chain order:
    /// the sealed segments, then the active `audit.jsonl` (see
    /// [`AuditChainRecords`]: each record follows the one before).
    ///
    /// # Errors
    ///
    /// [`Error::Io`] when the directory cannot be listed; each item as
    /// [`records`](Self::records), or [`Error::AuditBroken`] with
    /// [`AuditFault::SeqGap`] where records are missing (removed while it
    /// read), after which it ends.
    pub fn records_dir(dir: impl AsRef<Path>) -> Result<AuditChainRecords> {
        let dir = dir.as_ref();
        let anchor = anchor::read_anchor(dir, &Hasher::Plain)?.head;
        Ok(AuditChainRecords {
            ready: VecDeque::new(),
            files: chain_files(dir, &anchor)?.into(),
            current: None,
            dir: Some(dir.to_path_buf()),
            last_seq: None,
            #[cfg(feature = "postgres")]
            pages: None,
            before_file: BeforeFile(None),
            opened: false,
        })
    }

    /// Verifies a keyed (HMAC-SHA-256) audit file with `key`.
    ///
    /// # Errors
    ///
    /// As [`verify`](Self::verify); a wrong key fails at line 1 with
    /// [`AuditFault::HashMismatch`].
    pub fn verify_keyed(path: impl AsRef<Path>, key: &[u8]) -> Result<AuditReport> {
        verify_file(path.as_ref(), &Hasher::Keyed(key.to_vec()))
    }

    /// Reads every whole record, in order, without checking hashes.
    ///
    /// # Errors
    ///
    /// [`Error::AuditBroken`] with [`AuditFault::Malformed`] for a line that is not
    /// a record (a torn last line is skipped); [`Error::Io`] when unreadable.
    pub fn read(path: impl AsRef<Path>) -> Result<Vec<AuditRecord>> {
        Self::records(path)?.collect()
    }

    /// Streams the records one at a time, for logs too large to hold in memory.
    /// A torn last line (no newline) ends the stream quietly. A missing file is empty.
    ///
    /// # Errors
    ///
    /// [`Error::Io`] when the file cannot be opened; each item may be
    /// [`Error::AuditBroken`] (malformed line) or [`Error::Io`].
    ///
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// # let outbox = durable_outbox::Outbox::open(dir.path())?;
    /// use durable_outbox::AuditLog;
    /// for record in AuditLog::records(dir.path().join("audit.jsonl"))? {
    ///     let record = record?;
    ///     println!("{} {} {}", record.seq, record.outcome.as_str(), record.idempotency_key);
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn records(path: impl AsRef<Path>) -> Result<AuditRecords> {
        let path = path.as_ref().to_path_buf();
        let reader = match File::open(&path) {
            Ok(file) => Some(BufReader::with_capacity(1 << 16, file)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(Error::io(&path, "open", e)),
        };
        Ok(AuditRecords {
            path,
            reader,
            line: 0,
            buffer: Vec::with_capacity(512),
        })
    }
}

/// An iterator over every record of an outbox's audit chain, in chain order:
/// a directory's sealed segments, then its active log (see
/// [`AuditLog::records_dir`]); or a PostgreSQL outbox's `audit` table, read a
/// page at a time (see `Outbox::audit_records`). Either way a long chain is
/// never held in memory whole.
///
/// Each record handed out follows the one before (its `seq` one more): the
/// chain is read while the outbox goes on, and an operator's removal of old
/// records ([`Outbox::remove_old_audit_segments`](crate::Outbox::remove_old_audit_segments))
/// may take records this reader has not reached yet. Then, rather than go on
/// past the hole, the next item is [`Error::AuditBroken`] with
/// [`AuditFault::SeqGap`] (the seq expected, the seq found) and the reader
/// ends: read the chain again from its new start.
#[derive(Debug)]
pub struct AuditChainRecords {
    /// Records read already (the current page of a table), handed out first.
    ready: VecDeque<AuditRecord>,
    files: VecDeque<PathBuf>,
    current: Option<AuditRecords>,
    /// The directory the files are in: listed again when a compaction
    /// sealed `audit.jsonl` as a segment after the reader listed it.
    dir: Option<PathBuf>,
    /// The seq of the last record handed out: the next one must follow it.
    last_seq: Option<u64>,
    /// Where the next page comes from, for a chain that is not in files.
    #[cfg(feature = "postgres")]
    pages: Option<Pages>,
    /// Called before each file after the first is opened (a test seam).
    before_file: BeforeFile,
    /// Whether a file was opened yet.
    opened: bool,
}

/// What runs before the reader opens its next file: tests hold the reader
/// there (`Outbox::audit_records` arms the `audit.next_file` failpoint) to
/// change the directory between two files.
#[derive(Default)]
struct BeforeFile(Option<Box<dyn FnMut() + Send + Sync>>);

impl std::fmt::Debug for BeforeFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "<hook>" } else { "none" })
    }
}

/// Reads the page of records after a seq (empty: the chain ends there).
#[cfg(feature = "postgres")]
type NextPage = Box<dyn FnMut(u64) -> Result<Vec<AuditRecord>> + Send + Sync>;

/// A chain read page by page, keyed by seq.
#[cfg(feature = "postgres")]
struct Pages {
    next: NextPage,
    /// Where the records are (`postgres:<schema>.audit`), for errors.
    place: PathBuf,
    /// The seq of the last record read.
    after: u64,
    /// How many records were read (a gap's position, for errors).
    read: u64,
    /// No page is left (the last was empty, or failed).
    done: bool,
}

#[cfg(feature = "postgres")]
impl std::fmt::Debug for Pages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pages")
            .field("place", &self.place)
            .field("after", &self.after)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl AuditChainRecords {
    /// The records `next` returns page by page: `next(after)` reads those with
    /// a seq above `after`, in order, up to a page; an empty page ends the
    /// chain, an error is handed out once and ends it too. `place` names
    /// where they are in errors.
    #[cfg(feature = "postgres")]
    pub(crate) fn paged(place: PathBuf, next: NextPage) -> Self {
        Self {
            ready: VecDeque::new(),
            files: VecDeque::new(),
            current: None,
            dir: None,
            last_seq: None,
            pages: Some(Pages {
                next,
                place,
                after: 0,
                read: 0,
                done: false,
            }),
            before_file: BeforeFile(None),
            opened: false,
        }
    }

    /// Calls `hook` before each file after the first is opened.
    #[cfg(any(test, feature = "test-failpoints"))]
    pub(crate) fn before_each_next_file(mut self, hook: Box<dyn FnMut() + Send + Sync>) -> Self {
        self.before_file = BeforeFile(Some(hook));
        self
    }

    /// Where the record just read is, for an error about it: the file and
    /// its line, or the table and the record's position in this read.
    fn where_read(&self) -> (PathBuf, u64) {
        #[cfg(feature = "postgres")]
        if let Some(pages) = &self.pages {
            let position = pages.read - self.ready.len() as u64;
            return (pages.place.clone(), position);
        }
        self.current.as_ref().map_or_else(
            || (PathBuf::new(), 0),
            |file| (file.path.clone(), file.line),
        )
    }

    /// Ends the reader: nothing more is handed out.
    fn stop(&mut self) {
        self.ready.clear();
        self.files.clear();
        self.current = None;
        #[cfg(feature = "postgres")]
        if let Some(pages) = self.pages.as_mut() {
            pages.done = true;
        }
    }

    /// After a record that does not follow `next - 1` in a directory: lists
    /// the files again and reads on from the one that holds `next` (a
    /// compaction sealed `audit.jsonl`, listed before, as a segment, so its
    /// records moved, they did not go). `None` when no file holds it any
    /// more (a removal took it) or there is no directory.
    fn find_moved(&mut self, next: u64) -> Option<Result<AuditRecord>> {
        let dir = self.dir.clone()?;
        let sealed = match sealed_segments(&dir) {
            Ok(sealed) => sealed,
            Err(e) => return Some(Err(e)),
        };
        // The newest segment starting at or before `next`, and every file after.
        let from = sealed.iter().rposition(|(first, _)| *first <= next)?;
        let mut files: VecDeque<PathBuf> = sealed
            .into_iter()
            .skip(from)
            .map(|(_, path)| path)
            .collect();
        files.push_back(dir.join(AUDIT_FILE));
        self.files = files;
        self.current = None;
        loop {
            match self.next_record()? {
                Ok(record) if record.seq < next => {}
                Ok(record) if record.seq == next => return Some(Ok(record)),
                Ok(_) => return None,
                Err(e) => return Some(Err(e)),
            }
        }
    }

    /// The next record as read, before the check that it follows the last.
    fn next_record(&mut self) -> Option<Result<AuditRecord>> {
        if let Some(record) = self.ready.pop_front() {
            return Some(Ok(record));
        }
        #[cfg(feature = "postgres")]
        if self.pages.is_some() {
            return match self.next_page()? {
                Ok(()) => self.ready.pop_front().map(Ok),
                Err(e) => Some(Err(e)),
            };
        }
        loop {
            if let Some(record) = self.current.as_mut().and_then(Iterator::next) {
                return Some(record);
            }
            let path = self.files.pop_front()?;
            if std::mem::replace(&mut self.opened, true)
                && let Some(hook) = self.before_file.0.as_mut()
            {
                hook();
            }
            match AuditLog::records(&path) {
                Ok(records) => self.current = Some(records),
                Err(e) => return Some(Err(e)),
            }
        }
    }

    /// The next page, when the chain is read by pages and one is left.
    #[cfg(feature = "postgres")]
    fn next_page(&mut self) -> Option<Result<()>> {
        let pages = self.pages.as_mut().filter(|pages| !pages.done)?;
        match (pages.next)(pages.after) {
            Ok(page) if page.is_empty() => {
                pages.done = true;
                None
            }
            Ok(page) => {
                pages.after = page.last().map_or(pages.after, |record| record.seq);
                pages.read += page.len() as u64;
                self.ready = page.into();
                Some(Ok(()))
            }
            Err(e) => {
                pages.done = true;
                Some(Err(e))
            }
        }
    }
}

impl Iterator for AuditChainRecords {
    type Item = Result<AuditRecord>;

    fn next(&mut self) -> Option<Self::Item> {
        let record = match self.next_record()? {
            Ok(record) => record,
            Err(e) => return Some(Err(e)),
        };
        if let Some(last) = self.last_seq
            && record.seq != last + 1
        {
            if record.seq > last + 1
                && let Some(moved) = self.find_moved(last + 1)
            {
                if let Ok(record) = &moved {
                    self.last_seq = Some(record.seq);
                }
                return Some(moved);
            }
            // Records between were removed while this reader went on (or
            // the chain is damaged): never hand out a chain with a hole.
            let (place, line) = self.where_read();
            self.stop();
            return Some(Err(broken(
                &place,
                line,
                AuditFault::SeqGap {
                    expected: last + 1,
                    found: record.seq,
                },
            )));
        }
        self.last_seq = Some(record.seq);
        Some(Ok(record))
    }
}

/// An iterator over an audit file's records; see [`AuditLog::records`].
#[derive(Debug)]
pub struct AuditRecords {
    path: PathBuf,
    reader: Option<BufReader<File>>,
    line: u64,
    buffer: Vec<u8>,
}

impl Iterator for AuditRecords {
    type Item = Result<AuditRecord>;

    fn next(&mut self) -> Option<Self::Item> {
        let reader = self.reader.as_mut()?;
        self.buffer.clear();
        match reader.read_until(b'\n', &mut self.buffer) {
            Err(e) => {
                self.reader = None;
                Some(Err(Error::io(&self.path, "read", e)))
            }
            Ok(0) => None,
            Ok(_) if self.buffer.last() != Some(&b'\n') || is_zero_fill(&self.buffer) => {
                // A torn tail: whatever follows is a crash remnant, not a record.
                self.reader = None;
                None
            }
            Ok(_) => {
                self.line += 1;
                let body = &self.buffer[..self.buffer.len() - 1];
                Some(serde_json::from_slice(body).map_err(|e| {
                    broken(&self.path, self.line, AuditFault::Malformed(e.to_string()))
                }))
            }
        }
    }
}

fn broken(path: &Path, line: u64, fault: AuditFault) -> Error {
    Error::AuditBroken {
        path: path.to_path_buf(),
        line,
        fault,
    }
}

/// Calls `f` with each whole line (without its `\n`); stops quietly at a torn tail.
/// Returns the byte length of an unterminated tail.
fn for_each_line(path: &Path, mut f: impl FnMut(u64, &[u8]) -> Result<()>) -> Result<u64> {
    let file = match File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(Error::io(path, "open", e)),
    };
    let mut reader = BufReader::with_capacity(1 << 16, file);
    let mut line = Vec::with_capacity(512);
    let mut line_no = 0;
    loop {
        line.clear();
        let n = reader
            .read_until(b'\n', &mut line)
            .map_err(|e| Error::io(path, "read", e))?;
        if n == 0 {
            return Ok(0);
        }
        line_no += 1;
        if line.last() != Some(&b'\n') || is_zero_fill(&line) {
            // A crash remnant, unless more whole lines follow it.
            let mut rest = Vec::new();
            reader
                .read_to_end(&mut rest)
                .map_err(|e| Error::io(path, "read", e))?;
            if is_tear(&line, &rest) {
                return Ok((line.len() + rest.len()) as u64);
            }
        }
        let body = line.strip_suffix(b"\n").unwrap_or(&line);
        f(line_no, body)?;
    }
}

/// A line of only NULs (and its newline): what a crash leaves when the file's size
/// reached the disk before its data.
fn is_zero_fill(line: &[u8]) -> bool {
    line.iter().all(|b| *b == 0 || *b == b'\n')
}

/// Whether `first` (the first bad line) plus `rest` (everything after it) is a
/// crash remnant rather than damage: an unterminated line at the very end, or zeros.
fn is_tear(first: &[u8], rest: &[u8]) -> bool {
    let unterminated_last = first.last() != Some(&b'\n') && rest.is_empty();
    let zeros = is_zero_fill(first) && is_zero_fill(rest);
    unterminated_last || zeros
}

/// Verification state carried from one record to the next.
struct Chain<'h> {
    hasher: &'h Hasher,
    head: Head,
    /// For a chain read on its own (see [`Front`]); `None` when it starts at
    /// a known point (genesis, or the directory's `audit.anchor`).
    front: Option<Front>,
}

/// Where a chain read on its own starts: an export, the PostgreSQL `audit`
/// table, anything with no `audit.anchor` beside it. Its first record is
/// seq 1 after genesis, or, when an operator removed the oldest records,
/// the record after the last removed one; then the chain must hold the
/// removal record (`audit-segments`, `pruned`) that names that last removed
/// record as where the chain now starts. That record is hashed into the
/// chain like every other (under the key, in keyed mode), so deleting
/// records from the front, with or without a removal, leaves a start no
/// record names: [`AuditFault::FrontCut`].
#[derive(Debug, Default)]
struct Front {
    /// Whether the first record was seen.
    started: bool,
    /// The record before the first one (its seq and hash, from the first
    /// record's `seq` and `prev_hash`), when the first one is not seq 1.
    anchor: Option<Head>,
    /// Whether a verified removal record names `anchor`.
    named: bool,
}

impl Chain<'_> {
    /// A chain that starts at genesis, or at the point a removal record in
    /// it names (see [`Front`]).
    fn on_its_own(hasher: &Hasher) -> Chain<'_> {
        Chain {
            hasher,
            head: Head::genesis(),
            front: Some(Front::default()),
        }
    }

    /// A chain that continues from `start` (genesis, or an anchor file's).
    fn from(hasher: &Hasher, start: Head) -> Chain<'_> {
        Chain {
            hasher,
            head: start,
            front: None,
        }
    }

    /// Checks one line and advances the head.
    ///
    /// The line is parsed (every field typed, unknown fields refused), linked to the
    /// previous head, and its hash recomputed over its own bytes minus the `hash`
    /// member. For a canonical line those bytes are the canonical form without
    /// `hash`; a line that is not canonical cannot match the hash its writer made.
    fn check(&mut self, line: &[u8]) -> std::result::Result<(), AuditFault> {
        let view: record::LineView<'_> =
            serde_json::from_slice(line).map_err(|e| AuditFault::Malformed(e.to_string()))?;
        if let Some(front) = self.front.as_mut()
            && !front.started
        {
            front.started = true;
            if view.seq > 1 {
                // Older records were removed: the chain continues from the
                // record before this one, which a removal record must name
                // (checked once the whole chain is read: `finish`).
                let anchor = Head {
                    seq: view.seq - 1,
                    hash: view.prev_hash.clone().into_owned(),
                };
                self.head = anchor.clone();
                front.anchor = Some(anchor);
            }
        }
        let expected = self.head.seq + 1;
        if view.prev_hash != self.head.hash {
            return Err(AuditFault::BrokenLink);
        }
        if view.seq != expected {
            return Err(AuditFault::SeqGap {
                expected,
                found: view.seq,
            });
        }
        match record::hash_of_line(line, self.hasher) {
            Some(hash) if hash == view.hash => {}
            _ => return Err(AuditFault::HashMismatch),
        }
        if let Some(Front {
            anchor: Some(anchor),
            named: named @ false,
            ..
        }) = self.front.as_mut()
        {
            *named = anchor::names_anchor(
                &view.idempotency_key,
                view.outcome,
                view.note.as_deref(),
                anchor,
            );
        }
        self.head = Head {
            seq: view.seq,
            hash: view.hash.into_owned(),
        };
        Ok(())
    }

    /// After the last record: a chain read on its own that does not start at
    /// genesis must hold the removal record naming its start.
    fn finish(&self) -> std::result::Result<(), AuditFault> {
        match &self.front {
            Some(Front {
                anchor: Some(anchor),
                named: false,
                ..
            }) => Err(AuditFault::FrontCut {
                first_seq: anchor.seq + 1,
            }),
            _ => Ok(()),
        }
    }
}

/// Verifies one file read on its own: from genesis, or from the point a
/// removal record in it names (an export of a chain whose oldest records
/// were removed; see [`Front`]).
fn verify_file(path: &Path, hasher: &Hasher) -> Result<AuditReport> {
    let paths = [path.to_path_buf()];
    verify_chain(Chain::on_its_own(hasher), &paths, |_| {})
}

/// Verifies one chain across files, in order, continuing from `start`
/// (genesis, or the anchor where an operator's removal left it): the first
/// record of each file links to the last record of the one before. Only the
/// last file may end in a torn line.
fn verify_files_from(
    start: Head,
    paths: &[PathBuf],
    hasher: &Hasher,
    on_record: impl FnMut(&Head),
) -> Result<AuditReport> {
    verify_chain(Chain::from(hasher, start), paths, on_record)
}

/// Verifies `paths` in order with `chain`, calling `on_record` with the head
/// after each record.
fn verify_chain(
    mut chain: Chain<'_>,
    paths: &[PathBuf],
    mut on_record: impl FnMut(&Head),
) -> Result<AuditReport> {
    let mut records = 0;
    let mut torn = 0;
    for (i, path) in paths.iter().enumerate() {
        torn = for_each_line(path, |line_no, line| {
            chain
                .check(line)
                .map_err(|fault| broken(path, line_no, fault))?;
            records += 1;
            on_record(&chain.head);
            Ok(())
        })?;
        if torn > 0 && i + 1 < paths.len() {
            return Err(broken(
                path,
                records + 1,
                AuditFault::Malformed("a sealed audit segment ends in an unfinished line".into()),
            ));
        }
    }
    if let Some(first) = paths.first() {
        chain.finish().map_err(|fault| broken(first, 1, fault))?;
    }
    Ok(AuditReport {
        records,
        head_seq: chain.head.seq,
        head_hash: chain.head.hash,
        torn_tail_bytes: torn,
    })
}

/// One record's line as stored (without its newline), with the head it makes.
#[cfg(feature = "postgres")]
pub(crate) type ChainLine = (Head, Vec<u8>);

/// Every record line of an outbox directory's audit chain, verified with
/// `hasher` from where it starts (genesis, or the anchor an operator's
/// removal of old segments left), exactly as the files hold them (without
/// the newline), then `journal` (sealed records a crash left only in the
/// journal, past the files' head), for copying the chain elsewhere byte for
/// byte. A torn last line is left out, as it was never acknowledged. A chain
/// that starts at an anchor holds the removal record naming it, so the copy
/// verifies on its own (see [`Front`]).
///
/// # Errors
/// [`Error::AuditBroken`] naming the file and line of the first fault (a keyed
/// chain read without its key fails at line 1); the errors of reading
/// `audit.anchor` (in keyed mode it must carry its MAC);
/// [`Error::Io`] when a file cannot be read.
#[cfg(feature = "postgres")]
pub(crate) fn chain_lines(
    dir: &Path,
    hasher: &Hasher,
    journal: &[AuditRecord],
) -> Result<(Vec<ChainLine>, Head)> {
    let anchor = anchor::read_anchor(dir, hasher)?.head;
    let mut chain = Chain::from(hasher, anchor.clone());
    let mut lines = Vec::new();
    let files = chain_files(dir, &anchor)?;
    for (i, path) in files.iter().enumerate() {
        let torn = for_each_line(path, |line_no, line| {
            chain
                .check(line)
                .map_err(|fault| broken(path, line_no, fault))?;
            lines.push((chain.head.clone(), line.to_vec()));
            Ok(())
        })?;
        if torn > 0 && i + 1 < files.len() {
            return Err(broken(
                path,
                lines.len() as u64 + 1,
                AuditFault::Malformed("a sealed audit segment ends in an unfinished line".into()),
            ));
        }
    }
    let place = dir.join("outbox.journal");
    let files_head = chain.head.seq;
    for record in journal.iter().filter(|r| r.seq > files_head) {
        let mut line = record.to_line();
        line.pop();
        chain
            .check(&line)
            .map_err(|fault| broken(&place, record.seq, fault))?;
        lines.push((chain.head.clone(), line));
    }
    let head = chain.head;
    Ok((lines, head))
}

/// Verifies a chain held outside a file (the PostgreSQL engine's `audit`
/// table): `lines` in chain order, each without its newline, checked exactly
/// as a line of `audit.jsonl`, from genesis or from the start a removal
/// record in it names (see [`Front`]: rows deleted from the front without
/// one are [`AuditFault::FrontCut`]), then cross-checked against the head the
/// store recorded (`expected`), so a cut-off tail is found too. Faults name
/// `place` and the 1-based position in the rows.
#[cfg(feature = "postgres")]
pub(crate) fn verify_lines(
    place: &Path,
    lines: impl IntoIterator<Item = impl AsRef<[u8]>>,
    hasher: &Hasher,
    expected: &Head,
) -> Result<AuditReport> {
    let mut chain = Chain::on_its_own(hasher);
    let mut records = 0;
    for line in lines {
        records += 1;
        chain
            .check(line.as_ref())
            .map_err(|fault| broken(place, records, fault))?;
    }
    chain.finish().map_err(|fault| broken(place, 1, fault))?;
    if chain.head.seq < expected.seq {
        return Err(broken(
            place,
            records + 1,
            AuditFault::Truncated {
                expected_seq: expected.seq,
                found_seq: chain.head.seq,
            },
        ));
    }
    if chain.head != *expected {
        // Its position in the chain: the rows may start after removed ones.
        let position = records.saturating_sub(chain.head.seq - expected.seq);
        return Err(broken(
            place,
            position,
            AuditFault::HeadMismatch { seq: expected.seq },
        ));
    }
    Ok(AuditReport {
        records,
        head_seq: chain.head.seq,
        head_hash: chain.head.hash,
        torn_tail_bytes: 0,
    })
}

/// Name of the sealed audit segment whose first record has seq `first`.
fn sealed_name(first: u64) -> String {
    format!("audit-{first:012}.jsonl")
}

/// The sealed audit segments in `dir`, oldest first: `(first seq, path)`.
pub(crate) fn sealed_segments(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(dir, "read directory", e)),
    };
    let mut sealed = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(dir, "read directory", e))?;
        let name = entry.file_name();
        if let Some(first) = name
            .to_str()
            .and_then(|n| n.strip_prefix("audit-"))
            .and_then(|n| n.strip_suffix(".jsonl"))
            .and_then(|n| n.parse::<u64>().ok())
        {
            sealed.push((first, entry.path()));
        }
    }
    sealed.sort();
    Ok(sealed)
}

/// The seq and hash of the last record of a sealed segment (whole, fsynced).
pub(crate) fn last_head(path: &Path) -> Result<Head> {
    let bytes = fsutil::read_existing(path).map_err(|e| Error::io(path, "read", e))?;
    let body = bytes.strip_suffix(b"\n").unwrap_or(&bytes);
    let start = body.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
    // Lines before the record, plus one: the split yields one more piece than newlines.
    let line = body[..start].split(|b| *b == b'\n').count() as u64;
    let view: record::LineView<'_> = serde_json::from_slice(&body[start..]).map_err(|e| {
        broken(
            path,
            line,
            AuditFault::Malformed(format!("last record: {e}")),
        )
    })?;
    Ok(Head {
        seq: view.seq,
        hash: view.hash.into_owned(),
    })
}

/// Every audit file of an outbox directory, in chain order: the sealed segments
/// that continue from `anchor`, then the active `audit.jsonl`.
///
/// A sealed segment whose first record is at or before the anchor was removed by
/// an operator: the anchor is written only after that removal is audited, and a
/// crash before the segment was unlinked leaves it behind. It is no longer part
/// of the chain, so it is skipped (and [`AuditTail::remove_sealed`] finishes the
/// removal the next time it runs).
pub(crate) fn chain_files(dir: &Path, anchor: &Head) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = sealed_segments(dir)?
        .into_iter()
        .filter(|(first, _)| *first > anchor.seq)
        .map(|(_, p)| p)
        .collect();
    files.push(dir.join(AUDIT_FILE));
    Ok(files)
}

/// The writer's view of the log: what has been verified so far and where the chain ends.
///
/// **Invariant:** only touched while the directory lock is held, so no other writer
/// appends between [`catch_up`](Self::catch_up) and [`append`](Self::append).
#[derive(Debug)]
pub(crate) struct AuditTail {
    dir: PathBuf,
    path: PathBuf,
    hasher: Hasher,
    /// Append handle, opened on first use.
    file: Option<File>,
    /// Bytes of the file verified so far; everything before is trusted.
    verified_len: u64,
    /// Lines verified so far (for error positions).
    lines: u64,
    /// The most recent heads, newest last, for cross-checks against `outbox.json`.
    recent: VecDeque<Head>,
    /// A crash remnant after the last whole record, waiting to be set aside.
    torn: Option<Vec<u8>>,
    /// The last record known to be durable in the log itself (fsynced before a
    /// snapshot recorded it). A bad line after it is a crash remnant, whatever
    /// its shape, since the journal holds every later record; before it, damage.
    durable_seq: u64,
    /// The last record before the active file (the sealed segments' head), or genesis.
    base: Head,
    /// Identity of the active file this tail has read or written, to notice a
    /// rotation by another handle.
    file_id: Option<(u64, u64)>,
}

fn file_identity(id: &fsutil::Identity) -> (u64, u64) {
    (id.dev, id.ino)
}

impl AuditTail {
    pub(crate) fn new(dir: &Path, hasher: Hasher) -> Self {
        let mut recent = VecDeque::with_capacity(RECENT);
        recent.push_back(Head::genesis());
        Self {
            dir: dir.to_path_buf(),
            path: dir.join(AUDIT_FILE),
            hasher,
            file: None,
            verified_len: 0,
            lines: 0,
            recent,
            torn: None,
            durable_seq: 0,
            base: Head::genesis(),
            file_id: None,
        }
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Before anything else is read: starts the chain at the head of the sealed
    /// segments, if the log has rotated (their last record).
    pub(crate) fn load_base(&mut self) -> Result<()> {
        // Read (and in keyed mode authenticated) even when sealed segments
        // follow it, so a planted anchor is refused at open.
        let anchor = anchor::read_anchor(&self.dir, &self.hasher)?.head;
        let Some((_, newest)) = sealed_segments(&self.dir)?.pop() else {
            if anchor.seq > 0 {
                self.base = anchor.clone();
                self.recent.clear();
                self.recent.push_back(anchor);
            }
            return Ok(());
        };
        self.base = last_head(&newest)?;
        self.recent.clear();
        self.recent.push_back(self.base.clone());
        Ok(())
    }

    /// Seals the active file as `audit-<first seq>.jsonl` once it has grown past
    /// `limit` bytes; the next record starts a new `audit.jsonl`, linked to the
    /// last sealed one. Call under the lock, after [`sync`](Self::sync).
    pub(crate) fn rotate_if_over(&mut self, limit: u64) -> Result<bool> {
        if self.verified_len < limit || self.torn.is_some() || self.head().seq == self.base.seq {
            return Ok(false);
        }
        let sealed = self.dir.join(sealed_name(self.base.seq + 1));
        if sealed.exists() {
            return Err(Error::io(
                &sealed,
                "seal audit segment",
                std::io::Error::other("a sealed segment of that name exists already"),
            ));
        }
        fs::rename(&self.path, &sealed).map_err(|e| Error::io(&sealed, "seal audit segment", e))?;
        fsutil::sync_dir(&self.dir).map_err(|e| Error::io(&self.dir, "fsync directory", e))?;
        self.start_new_file();
        Ok(true)
    }

    /// Removes all sealed segments but the newest `keep`, after writing the
    /// anchor (the last removed record) that verification starts from. Returns
    /// the removed segments' paths. Call under the lock, after the removal is
    /// audited.
    pub(crate) fn remove_sealed(
        &mut self,
        keep: usize,
        faults: &Failpoints,
    ) -> Result<Vec<PathBuf>> {
        let mut removed = self.finish_removal()?;
        let sealed = sealed_segments(&self.dir)?;
        let remove = sealed.len().saturating_sub(keep);
        if remove == 0 {
            return Ok(removed);
        }
        let last_removed = &sealed[remove - 1].1;
        let last = last_head(last_removed)?;
        // The record just appended audits this removal and names this anchor.
        let anchor = anchor::encode_anchor(&last, self.head().seq, &self.hasher);
        fsutil::replace_atomically(&self.dir, ANCHOR_FILE, &anchor, faults, "audit_anchor")
            .map_err(|(_, e)| e)?;
        removed.extend(self.finish_removal()?);
        Ok(removed)
    }

    /// Unlinks the sealed segments the anchor says were removed (all of them
    /// after a fresh anchor; the leftovers of a removal a crash interrupted
    /// otherwise), then fsyncs the directory. Returns their paths.
    fn finish_removal(&self) -> Result<Vec<PathBuf>> {
        let anchor = anchor::read_anchor(&self.dir, &self.hasher)?.head;
        let mut removed = Vec::new();
        for (first, path) in sealed_segments(&self.dir)? {
            if first > anchor.seq {
                break;
            }
            match fs::remove_file(&path) {
                Ok(()) => removed.push(path),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io(&path, "remove audit segment", e)),
            }
        }
        if !removed.is_empty() {
            fsutil::sync_dir(&self.dir).map_err(|e| Error::io(&self.dir, "fsync directory", e))?;
        }
        Ok(removed)
    }

    /// Forgets the active file: the chain continues in a new one.
    fn start_new_file(&mut self) {
        self.file = None;
        self.file_id = None;
        self.verified_len = 0;
        self.lines = 0;
        self.base = self.head().clone();
    }

    /// Bytes of the log verified (or written) so far.
    pub(crate) fn verified_len(&self) -> u64 {
        self.verified_len
    }

    /// Whether nothing has been read yet.
    pub(crate) fn is_fresh(&self) -> bool {
        self.verified_len == 0 && self.lines == 0
    }

    /// Starts from a point a compaction recorded instead of the start of the
    /// log: the record ending at byte `offset` must be `head` (checked), and
    /// everything before it was verified when that compaction ran. Returns
    /// `false` (and changes nothing) when the log does not match, so the caller
    /// verifies from the start and reports precisely what is wrong.
    pub(crate) fn resume_at(&mut self, head: &Head, offset: u64) -> Result<bool> {
        if head.seq == 0 || offset == 0 {
            return Ok(false);
        }
        let Ok(mut file) = fsutil::open_existing(&self.path, false) else {
            return Ok(false);
        };
        let identity = fsutil::identity_of(&file).map_err(|e| Error::io(&self.path, "stat", e))?;
        if identity.len < offset {
            return Ok(false);
        }
        // The last record before `offset`: records are at most a few KiB.
        let window = offset.min(64 * 1024);
        let mut tail = vec![0u8; usize::try_from(window).unwrap_or(0)];
        file.seek(SeekFrom::Start(offset - window))
            .and_then(|_| file.read_exact(&mut tail))
            .map_err(|e| Error::io(&self.path, "read", e))?;
        let Some(body) = tail.strip_suffix(b"\n") else {
            return Ok(false);
        };
        let start = body.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
        if start == 0 && window < offset {
            return Ok(false);
        }
        let Ok(record) = serde_json::from_slice::<record::LineView<'_>>(&body[start..]) else {
            return Ok(false);
        };
        if record.seq != head.seq || record.hash != head.hash {
            return Ok(false);
        }
        self.verified_len = offset;
        self.file_id = Some(file_identity(&identity));
        self.lines = head.seq.saturating_sub(self.base.seq);
        self.recent.clear();
        self.recent.push_back(head.clone());
        Ok(true)
    }

    pub(crate) fn head(&self) -> &Head {
        self.recent
            .back()
            .unwrap_or_else(|| unreachable!("recent always holds the head"))
    }

    /// The hash of record `seq`, if it is recent enough to be remembered.
    pub(crate) fn hash_at(&self, seq: u64) -> Option<&str> {
        self.recent
            .iter()
            .find(|h| h.seq == seq)
            .map(|h| h.hash.as_str())
    }

    fn remember(&mut self, head: Head) {
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back(head);
    }

    /// Records that the log is durable up to record `seq` (the head a snapshot
    /// recorded after fsyncing the log). Never moves back.
    pub(crate) fn note_durable(&mut self, seq: u64) {
        self.durable_seq = self.durable_seq.max(seq);
    }

    /// Reads and verifies whatever other writers appended since the last call, and
    /// quarantines a torn tail left by a crash. O(new bytes).
    pub(crate) fn catch_up(&mut self) -> Result<()> {
        // One stat in the common case where nobody appended since we last
        // looked; without the timestamps, so the next append's stays coarse
        // (see `fsutil::identity`).
        let meta = fsutil::identity(&self.path).map_err(|e| Error::io(&self.path, "stat", e))?;
        let rotated = match (self.file_id, &meta) {
            (Some(id), Some(meta)) => id != file_identity(meta),
            (Some(_), None) => true,
            (None, _) => false,
        };
        if rotated {
            self.follow_rotation()?;
        }
        let Some(meta) = meta else {
            if self.verified_len == 0 {
                return Ok(());
            }
            return Err(Error::io(
                &self.path,
                "stat",
                std::io::ErrorKind::NotFound.into(),
            ));
        };
        self.file_id.get_or_insert(file_identity(&meta));
        let len = meta.len;
        if len == self.verified_len {
            self.torn = None;
            return Ok(());
        }
        self.absorb_from(&self.path.clone(), true)
    }

    /// Another handle sealed the file this tail was following, maybe several
    /// times over, and an operator may since have removed old sealed segments.
    /// Reads every sealed segment from where this tail stopped, in chain order,
    /// and leaves it at the start of the new active file.
    ///
    /// Records that an operator removed (everything up to `audit.anchor`) cannot
    /// be read any more: the chain continues from the anchor, as it does for a
    /// fresh open. A segment missing from the middle of the chain with no anchor
    /// covering it is reported as a broken link: that is not a rotation.
    fn follow_rotation(&mut self) -> Result<()> {
        let anchor = anchor::read_anchor(&self.dir, &self.hasher)?.head;
        let partly_read = self.base.seq + 1;
        for (first, path) in sealed_segments(&self.dir)? {
            if first < partly_read {
                continue; // read whole before the last rotation this tail saw
            }
            if first == partly_read {
                // The file this tail was reading: go on from where it stopped.
            } else if first == self.head().seq + 1 {
                self.start_new_file();
            } else if first <= anchor.seq {
                continue; // removed by an operator; a crash left it behind
            } else if first == anchor.seq + 1 && anchor.seq > self.head().seq {
                self.jump_to(anchor.clone());
            } else {
                return Err(broken(
                    &path,
                    1,
                    AuditFault::Truncated {
                        expected_seq: self.head().seq + 1,
                        found_seq: first,
                    },
                ));
            }
            self.absorb_from(&path, false)?;
            if self.torn.take().is_some() {
                return Err(broken(
                    &path,
                    self.lines + 1,
                    AuditFault::Malformed(
                        "a sealed audit segment ends in an unfinished line".into(),
                    ),
                ));
            }
        }
        if anchor.seq > self.head().seq {
            // Every segment after this tail's position was removed: the active
            // file continues from the anchor.
            self.jump_to(anchor);
        } else {
            self.start_new_file();
        }
        Ok(())
    }

    /// Continues the chain from `head` (an operator's anchor) in a new file.
    fn jump_to(&mut self, head: Head) {
        self.recent.clear();
        self.recent.push_back(head);
        self.start_new_file();
    }

    /// Reads and verifies records of `path` past `verified_len`; notes a torn tail.
    ///
    /// In the active file (`active`), everything after the last durable record
    /// was appended without an fsync of its own: a power cut can leave it in any
    /// shape (zeros, then a later record; a line with zeros inside; fragments out
    /// of order). From the first bad line past that point, the rest is a remnant
    /// to set aside: the journal holds those records and they are re-appended.
    /// A bad line at or before the durable record is damage, and an error.
    /// Sealed segments were fsynced before they were sealed: only a clean tear
    /// is tolerated there (and then reported by the caller).
    fn absorb_from(&mut self, path: &Path, active: bool) -> Result<()> {
        let opened;
        // The descriptor this tail writes with, when it has one: the same file
        // (`catch_up` compared identities), and its reads leave the access
        // time alone.
        let file = if let (Some(file), true) = (&self.file, active) {
            file
        } else {
            opened = fsutil::open_existing(path, false).map_err(|e| Error::io(path, "open", e))?;
            fsutil::no_access_time(&opened);
            &opened
        };
        let len = fsutil::identity_of(file)
            .map_err(|e| Error::io(path, "stat", e))?
            .len;
        if len < self.verified_len {
            return Err(broken(
                path,
                self.lines,
                AuditFault::Truncated {
                    expected_seq: self.head().seq,
                    found_seq: 0,
                },
            ));
        }
        let mut fresh = vec![0; usize::try_from(len - self.verified_len).unwrap_or(usize::MAX)];
        let read = fsutil::read_at(file, &mut fresh, self.verified_len)
            .map_err(|e| Error::io(path, "read", e))?;
        fresh.truncate(read);

        let mut chain = Chain::from(&self.hasher, self.head().clone());
        let mut offset = 0;
        let mut heads = Vec::new();
        while offset < fresh.len() {
            let rest = &fresh[offset..];
            let end = rest.iter().position(|b| *b == b'\n');
            let line = end.map_or(rest, |end| &rest[..=end]);
            let after = end.map_or(&[][..], |end| &rest[end + 1..]);
            if (end.is_none() || is_zero_fill(line)) && is_tear(line, after) {
                break;
            }
            let body = line.strip_suffix(b"\n").unwrap_or(line);
            let line_no = self.lines + heads.len() as u64 + 1;
            if let Err(fault) = chain.check(body) {
                if active && chain.head.seq >= self.durable_seq {
                    break;
                }
                return Err(broken(path, line_no, fault));
            }
            heads.push(chain.head.clone());
            offset += line.len();
        }
        self.lines += heads.len() as u64;
        self.verified_len += offset as u64;
        for head in heads {
            self.remember(head);
        }
        self.torn = (offset < fresh.len()).then(|| fresh[offset..].to_vec());
        Ok(())
    }

    /// Moves a torn tail noticed by [`catch_up`](Self::catch_up) into its own
    /// file, then cuts it from the log. Called only once the state has been
    /// checked, so an open that fails leaves the log untouched.
    pub(crate) fn settle_torn_tail(&mut self) -> Result<()> {
        let Some(tail) = self.torn.take() else {
            return Ok(());
        };
        let stem = format!("{AUDIT_FILE}.torn-{}", self.head().seq);
        let path = fsutil::write_quarantine(&self.dir, &stem, &tail)?;
        let log = fsutil::open_existing(&self.path, true)
            .map_err(|e| Error::io(&self.path, "open", e))?;
        log.set_len(self.verified_len)
            .and_then(|()| log.sync_all())
            .map_err(|e| Error::io(&self.path, "truncate torn tail", e))?;
        tracing::warn!(
            log = %self.path.display(),
            quarantine = %path.display(),
            bytes = tail.len(),
            "moved a torn audit tail aside"
        );
        Ok(())
    }

    /// Verifies the whole file from the start, and that it contains the head
    /// `outbox.json` recorded (`expected`): a log cut short of it was truncated.
    pub(crate) fn verify_whole(&self, expected: Option<&Head>) -> Result<AuditReport> {
        let mut hash_at_expected = None;
        let anchor = anchor::read_anchor(&self.dir, &self.hasher)?;
        let files = chain_files(&self.dir, &anchor.head)?;
        let report = verify_files_from(anchor.head.clone(), &files, &self.hasher, |head| {
            if expected.is_some_and(|e| e.seq == head.seq) {
                hash_at_expected = Some(head.hash.clone());
            }
        })?;
        anchor::check_removal_record(&self.dir, &anchor, &files, &self.hasher)?;
        if let Some(expected) = expected.filter(|e| e.seq > 0) {
            match hash_at_expected {
                None => {
                    return Err(broken(
                        &self.path,
                        report.head_seq + 1,
                        AuditFault::Truncated {
                            expected_seq: expected.seq,
                            found_seq: report.head_seq,
                        },
                    ));
                }
                Some(hash) if hash != expected.hash => {
                    return Err(broken(
                        &self.path,
                        expected.seq,
                        AuditFault::HeadMismatch { seq: expected.seq },
                    ));
                }
                Some(_) => {}
            }
        }
        Ok(report)
    }

    /// The hash function of this log.
    pub(crate) fn hasher(&self) -> &Hasher {
        &self.hasher
    }

    /// Appends sealed records, which must continue the chain from the current head.
    /// Does **not** fsync: the records are already durable in the journal entry
    /// that committed them, and are re-appended from there after a crash.
    ///
    /// On error the handle must be poisoned by the caller: the bytes may be partly
    /// in the file, and only a fresh [`catch_up`](Self::catch_up) can tell.
    pub(crate) fn append_records(
        &mut self,
        records: &[AuditRecord],
        faults: &Failpoints,
    ) -> Result<()> {
        if records.is_empty() {
            return Ok(());
        }
        self.settle_torn_tail()?;
        let mut buffer = Vec::with_capacity(records.len() * 640);
        let mut head = self.head().clone();
        for record in records {
            if record.seq != head.seq + 1 || record.prev_hash != head.hash {
                return Err(broken(
                    &self.path,
                    self.lines + 1,
                    AuditFault::HeadMismatch { seq: head.seq },
                ));
            }
            record.write_line(&mut buffer);
            head = Head {
                seq: record.seq,
                hash: record.hash.clone(),
            };
        }
        let file = self.append_handle()?;
        faults
            .check("audit.write")
            .and_then(|()| std::io::Write::write_all(file, &buffer))
            .map_err(|e| Error::io(&self.path, "append", e))?;
        self.verified_len += buffer.len() as u64;
        self.lines += records.len() as u64;
        for record in records {
            self.remember(Head {
                seq: record.seq,
                hash: record.hash.clone(),
            });
        }
        Ok(())
    }

    /// fsyncs the log, making every appended record durable in the log itself
    /// (done before a compaction drops the journal entries that also hold them).
    pub(crate) fn sync(&mut self, faults: &Failpoints) -> Result<()> {
        let path = self.path.clone();
        let file = self.append_handle()?;
        faults
            .check("audit.fsync")
            .and_then(|()| file.sync_data())
            .map_err(|e| Error::io(&path, "fsync", e))?;
        let head = self.head().seq;
        self.note_durable(head);
        Ok(())
    }

    /// The append-mode descriptor, opened (and the file created durably) on first use.
    fn append_handle(&mut self) -> Result<&mut File> {
        if self.file.is_none() {
            let created = !self.path.exists();
            let file = fsutil::open_private(&self.path, true)
                .map_err(|e| Error::io(&self.path, "open", e))?;
            if created {
                fsutil::sync_dir(&self.dir)
                    .map_err(|e| Error::io(&self.dir, "fsync directory", e))?;
            }
            // Appends are followed by other handles' reads of this descriptor.
            fsutil::no_access_time(&file);
            let meta = fsutil::identity_of(&file).map_err(|e| Error::io(&self.path, "stat", e))?;
            self.file_id = Some(file_identity(&meta));
            self.file = Some(file);
        }
        match self.file.as_mut() {
            Some(file) => Ok(file),
            None => unreachable!("opened above"),
        }
    }
}

#[cfg(test)]
mod tests;
