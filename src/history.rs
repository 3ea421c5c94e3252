//! `history/`: terminal items that left the live state, in immutable segments.
//!
//! A sent or failed item stays in the live state (snapshot and journal) while it
//! can still matter: inside a rate window, or younger than
//! [`history_after`](crate::OutboxBuilder::history_after). The next compaction
//! moves it into a new history segment, so the live state, and with it the cost
//! of every compaction and of opening, stays proportional to recent traffic.
//!
//! # Files
//!
//! - `seg-<n>.log`: one item per line, framed like the journal
//!   (`<16 hex> <json>\n`, the hex being the first 64 bits of the JSON's SHA-256),
//!   with the snapshot's item fields.
//! - `seg-<n>.idx`: the segment's index, so opening never reads the segments:
//!   `DOIX3\n`, three little-endian `u64` counts and the newest item's last
//!   change (microseconds since the epoch, `i64`), the key entries, the
//!   transport-ref entries, then the destination-scoped transport-ref entries
//!   (each a `u64` hash — the first 8 bytes of the SHA-256 of the text, for a
//!   scoped ref of `destination`, NUL, `transport_ref` — and a `u64` byte offset
//!   into the log, sorted), then the SHA-256 of everything before it.
//!   Version 2 indexes (`DOIX2\n`, written before scoped lookups existed) have
//!   two counts and no scoped table; they stay readable, and a scoped lookup
//!   in such a segment goes through its transport-ref table and checks the
//!   destination of each candidate.
//!
//! Both are written to a temp file, fsynced and renamed into place (index
//! first, then log; the log's presence is what makes a segment exist), then the
//! directory is fsynced, and only then does the snapshot stop holding the items.
//! A crash in between leaves an item in both places: the live copy wins, and the
//! next move skips items the history already holds.
//!
//! # Memory
//!
//! Each history item costs 16 bytes of index in memory, plus 32 more if it has a
//! transport ref (global and destination-scoped): 48 MB for a million sent items. All segments' entries are kept
//! merged in one sorted array, so a lookup is one binary search and one read.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::failpoint::Failpoints;
use crate::fsutil::{self, ReplaceFailure};
use crate::item::OutboxItem;
use crate::store::CommitFailure;

/// Directory of the history segments inside an outbox directory.
pub(crate) const HISTORY_DIR: &str = "history";
const INDEX_MAGIC: &[u8] = b"DOIX3\n";
/// The index format before destination-scoped refs: still read.
const INDEX_MAGIC_V2: &[u8] = b"DOIX2\n";
/// Bytes of the version 2 index header after the magic: key count, ref count, newest time.
const HEADER_V2: usize = 24;
/// Bytes of the version 3 header: key, ref and scoped-ref counts, newest time.
const HEADER: usize = 32;

/// The text a destination-scoped transport ref is filed under.
fn scoped_text(destination: &str, transport_ref: &str) -> String {
    format!("{destination}\0{transport_ref}")
}

/// The stable 64-bit hash an index files a text under.
fn text_hash(text: &str) -> u64 {
    let digest = Sha256::digest(text.as_bytes());
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(bytes)
}

/// One immutable segment and its index, in memory.
#[derive(Debug)]
struct Segment {
    number: u64,
    log: PathBuf,
    /// The log, opened on first lookup and kept (segments never change).
    file: std::sync::OnceLock<fs::File>,
    /// How many items it holds.
    items: usize,
    /// The latest change of any of its items: retention by age goes by this.
    newest: DateTime<Utc>,
    /// Pruned: its entries are gone from the merged index.
    gone: bool,
    /// Its index has the destination-scoped table (version 3).
    scoped: bool,
}

/// All history segments of one outbox, as far as this handle has loaded them.
#[derive(Debug)]
pub(crate) struct History {
    dir: PathBuf,
    /// Oldest first; their index entries live in `keys` and `refs` below.
    segments: Vec<Segment>,
    /// Every segment's `(hash of key, location)`, merged and sorted, so a lookup
    /// is one binary search however many segments there are. A location packs
    /// the position in `segments` above the low 40 bits of the byte offset.
    keys: Vec<(u64, u64)>,
    /// The same for transport refs.
    refs: Vec<(u64, u64)>,
    /// The same for `destination` NUL `transport_ref` (version 3 segments only).
    scoped_refs: Vec<(u64, u64)>,
}

/// One segment's index tables, as read from its file.
struct Tables {
    keys: Vec<(u64, u64)>,
    refs: Vec<(u64, u64)>,
    /// Empty for a version 2 index.
    scoped: Vec<(u64, u64)>,
}

/// Bits of a packed location that hold the byte offset (1 TiB per segment).
const OFFSET_BITS: u32 = 40;

fn pack(segment: usize, offset: u64) -> u64 {
    ((segment as u64) << OFFSET_BITS) | (offset & ((1 << OFFSET_BITS) - 1))
}

fn unpack(location: u64) -> (usize, u64) {
    (
        usize::try_from(location >> OFFSET_BITS).unwrap_or(usize::MAX),
        location & ((1 << OFFSET_BITS) - 1),
    )
}

/// Merges `extra` (sorted) into `into` (sorted).
fn merge_sorted(into: &mut Vec<(u64, u64)>, mut extra: Vec<(u64, u64)>) {
    if extra.is_empty() {
        return;
    }
    into.append(&mut extra);
    // Two sorted runs: the stable sort detects them and merges in O(n), where
    // an unstable sort would start over in O(n log n).
    #[allow(
        clippy::stable_sort_primitive,
        reason = "the stable sort merges sorted runs in O(n)"
    )]
    into.sort();
}

/// Where to look an item up.
#[derive(Clone, Copy)]
enum By<'a> {
    Key(&'a str),
    TransportRef(&'a str),
    ScopedRef(&'a str, &'a str),
}

impl History {
    pub(crate) fn new(outbox_dir: &Path) -> Self {
        Self {
            dir: outbox_dir.join(HISTORY_DIR),
            segments: Vec::new(),
            keys: Vec::new(),
            refs: Vec::new(),
            scoped_refs: Vec::new(),
        }
    }

    /// Number of items in history (as loaded).
    pub(crate) fn len(&self) -> usize {
        self.keys.len()
    }

    /// Loads the indexes of segments this handle has not seen yet (other
    /// processes add segments when they compact). Reads no log.
    pub(crate) fn refresh(&mut self) -> Result<()> {
        let entries = match fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(Error::io(&self.dir, "read directory", e)),
        };
        let known = self.segments.last().map_or(0, |s| s.number);
        let mut present = std::collections::HashSet::new();
        let mut fresh = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| Error::io(&self.dir, "read directory", e))?;
            let name = entry.file_name();
            let Some(number) = name
                .to_str()
                .and_then(|n| n.strip_prefix("seg-"))
                .and_then(|n| n.strip_suffix(".log"))
                .and_then(|n| n.parse::<u64>().ok())
            else {
                continue;
            };
            present.insert(number);
            if number > known {
                fresh.push(number);
            }
        }
        // Segments another process pruned.
        let gone: Vec<usize> = self
            .segments
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.gone && !present.contains(&s.number))
            .map(|(at, _)| at)
            .collect();
        for at in gone {
            self.forget(at);
        }
        fresh.sort_unstable();
        let (mut new_keys, mut new_refs, mut new_scoped) = (Vec::new(), Vec::new(), Vec::new());
        for number in fresh {
            let (segment, tables) = self.load_segment(number)?;
            let at = self.segments.len();
            let packed =
                |table: Vec<(u64, u64)>| table.into_iter().map(move |(h, o)| (h, pack(at, o)));
            new_keys.extend(packed(tables.keys));
            new_refs.extend(packed(tables.refs));
            new_scoped.extend(packed(tables.scoped));
            self.segments.push(segment);
        }
        new_keys.sort_unstable();
        new_refs.sort_unstable();
        new_scoped.sort_unstable();
        merge_sorted(&mut self.keys, new_keys);
        merge_sorted(&mut self.refs, new_refs);
        merge_sorted(&mut self.scoped_refs, new_scoped);
        Ok(())
    }

    fn log_path(&self, number: u64) -> PathBuf {
        self.dir.join(format!("seg-{number:08}.log"))
    }

    fn index_path(&self, number: u64) -> PathBuf {
        self.dir.join(format!("seg-{number:08}.idx"))
    }

    /// Reads one segment's index (version 3, or version 2 without the scoped table).
    fn load_segment(&self, number: u64) -> Result<(Segment, Tables)> {
        let path = self.index_path(number);
        let bytes = fsutil::read_existing(&path).map_err(|e| Error::io(&path, "read", e))?;
        let corrupt = |why: &str| Error::InvalidRecord {
            path: path.clone(),
            location: "index".into(),
            reason: why.to_owned(),
        };
        let (header, tables) = if bytes.starts_with(INDEX_MAGIC) {
            (HEADER, 3)
        } else if bytes.starts_with(INDEX_MAGIC_V2) {
            (HEADER_V2, 2)
        } else {
            return Err(corrupt("not a history index"));
        };
        if bytes.len() < INDEX_MAGIC.len() + header + 32 {
            return Err(corrupt("not a history index"));
        }
        let (body, sum) = bytes.split_at(bytes.len() - 32);
        if Sha256::digest(body).as_slice() != sum {
            return Err(corrupt("checksum mismatch"));
        }
        let read_u64 = |at: usize| {
            let mut word = [0u8; 8];
            word.copy_from_slice(&body[at..at + 8]);
            u64::from_le_bytes(word)
        };
        let at = INDEX_MAGIC.len();
        let counts: Vec<u64> = (0..tables).map(|i| read_u64(at + i * 8)).collect();
        let newest = DateTime::<Utc>::from_timestamp_micros(read_u64(at + tables * 8) as i64)
            .ok_or_else(|| corrupt("newest time out of range"))?;
        let expected = counts
            .iter()
            .try_fold(0u64, |sum, n| sum.checked_add(*n))
            .and_then(|n| n.checked_mul(16))
            .and_then(|n| usize::try_from(n).ok())
            .and_then(|n| n.checked_add(at + header));
        if expected != Some(body.len()) {
            return Err(corrupt("length does not match its counts"));
        }
        let pairs = |from: usize, n: u64| -> Vec<(u64, u64)> {
            (0..usize::try_from(n).unwrap_or(0))
                .map(|i| (read_u64(from + i * 16), read_u64(from + i * 16 + 8)))
                .collect()
        };
        let first = at + header;
        let keys = pairs(first, counts[0]);
        let refs = pairs(first + keys.len() * 16, counts[1]);
        let scoped = match counts.get(2) {
            Some(n) => pairs(first + (keys.len() + refs.len()) * 16, *n),
            None => Vec::new(),
        };
        Ok((
            Segment {
                number,
                log: self.log_path(number),
                file: std::sync::OnceLock::new(),
                items: keys.len(),
                newest,
                gone: false,
                scoped: tables == 3,
            },
            Tables { keys, refs, scoped },
        ))
    }

    /// The history copy of the item with this key, if any (the newest).
    pub(crate) fn get(&self, key: &str) -> Result<Option<OutboxItem>> {
        self.find(By::Key(key))
    }

    /// The history item with this transport ref, if any (the newest).
    pub(crate) fn find_by_transport_ref(&self, transport_ref: &str) -> Result<Option<OutboxItem>> {
        self.find(By::TransportRef(transport_ref))
    }

    /// The history item that went to `destination` with this transport ref,
    /// if any (the newest).
    pub(crate) fn find_by_destination_ref(
        &self,
        destination: &str,
        transport_ref: &str,
    ) -> Result<Option<OutboxItem>> {
        self.find(By::ScopedRef(destination, transport_ref))
    }

    /// The packed locations filed under `text` in `table`.
    fn locations<'t>(table: &'t [(u64, u64)], text: &str) -> impl Iterator<Item = u64> + 't {
        let hash = text_hash(text);
        let start = table.partition_point(|(h, _)| *h < hash);
        let end = start + table[start..].partition_point(|(h, _)| *h == hash);
        table[start..end].iter().map(|(_, location)| *location)
    }

    fn find(&self, by: By<'_>) -> Result<Option<OutboxItem>> {
        let mut candidates: Vec<u64> = match by {
            By::Key(t) => Self::locations(&self.keys, t).collect(),
            By::TransportRef(t) => Self::locations(&self.refs, t).collect(),
            By::ScopedRef(destination, t) => {
                let mut found: Vec<u64> =
                    Self::locations(&self.scoped_refs, &scoped_text(destination, t)).collect();
                // Version 2 segments have no scoped table: their global one,
                // each candidate's destination checked below.
                found.extend(Self::locations(&self.refs, t).filter(|location| {
                    self.segments
                        .get(unpack(*location).0)
                        .is_some_and(|s| !s.scoped)
                }));
                found
            }
        };
        // Newest segment first: locations sort by segment position.
        candidates.sort_unstable();
        for location in candidates.into_iter().rev() {
            let (at, offset) = unpack(location);
            let Some(segment) = self.segments.get(at) else {
                continue;
            };
            let item = read_item(segment.file()?, &segment.log, offset)?;
            let matches = match by {
                By::Key(text) => item.idempotency_key == text,
                By::TransportRef(text) => item.transport_ref.as_deref() == Some(text),
                By::ScopedRef(destination, text) => {
                    item.destination == destination && item.transport_ref.as_deref() == Some(text)
                }
            };
            if matches {
                return Ok(Some(item));
            }
        }
        Ok(None)
    }

    /// Writes `items` as a new segment, durably. Items the history already
    /// holds in the same version (a move repeated after a crash) are skipped.
    /// Returns how many were written.
    ///
    /// # Errors
    ///
    /// As an atomic replace: a failure before a rename leaves nothing visible
    /// ([`CommitFailure::Clean`]), one after it may have left the segment in place.
    pub(crate) fn append_segment(
        &mut self,
        items: &[&OutboxItem],
        faults: &Failpoints,
    ) -> std::result::Result<usize, (CommitFailure, Error)> {
        let clean = |e| (CommitFailure::Clean, e);
        // Another handle may have written a segment this one has not loaded (its
        // compaction failed after the segment, so the generation did not move):
        // load it first, so numbering continues after it and its items are known.
        self.refresh().map_err(clean)?;
        let mut fresh = Vec::with_capacity(items.len());
        for item in items {
            let known = self.get(&item.idempotency_key).map_err(clean)?;
            if known.is_none_or(|old| old.last_audit_id != item.last_audit_id) {
                fresh.push(*item);
            }
        }
        if fresh.is_empty() {
            return Ok(0);
        }
        fsutil::private_subdir(&self.dir).map_err(clean)?;
        let number = self.segments.last().map_or(1, |s| s.number + 1);
        if self.log_path(number).exists() {
            // Never replace a segment: refresh() above loaded every existing one.
            return Err(clean(Error::io(
                self.log_path(number),
                "write history segment",
                io::Error::other("a segment of that number exists already"),
            )));
        }
        let mut log = Vec::new();
        let mut keys = Vec::with_capacity(fresh.len());
        let mut refs = Vec::new();
        let mut scoped = Vec::new();
        for item in &fresh {
            let offset = log.len() as u64;
            log.extend_from_slice(&crate::store::encode_item_line(item));
            keys.push((text_hash(&item.idempotency_key), offset));
            if let Some(r) = &item.transport_ref {
                refs.push((text_hash(r), offset));
                scoped.push((text_hash(&scoped_text(&item.destination, r)), offset));
            }
        }
        keys.sort_unstable();
        refs.sort_unstable();
        scoped.sort_unstable();
        let mut index = Vec::with_capacity(
            INDEX_MAGIC.len() + HEADER + (keys.len() + refs.len() + scoped.len()) * 16 + 32,
        );
        let newest = fresh.iter().map(|i| i.updated_at).max().unwrap_or_default();
        index.extend_from_slice(INDEX_MAGIC);
        index.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        index.extend_from_slice(&(refs.len() as u64).to_le_bytes());
        index.extend_from_slice(&(scoped.len() as u64).to_le_bytes());
        index.extend_from_slice(&(newest.timestamp_micros() as u64).to_le_bytes());
        for (hash, offset) in keys.iter().chain(&refs).chain(&scoped) {
            index.extend_from_slice(&hash.to_le_bytes());
            index.extend_from_slice(&offset.to_le_bytes());
        }
        let sum = Sha256::digest(&index);
        index.extend_from_slice(&sum);
        let (index_name, log_name) = (
            format!("seg-{number:08}.idx"),
            format!("seg-{number:08}.log"),
        );
        let settle = |(how, e)| match how {
            ReplaceFailure::BeforeRename => (CommitFailure::Clean, e),
            ReplaceFailure::AfterRename => (CommitFailure::Uncertain, e),
        };
        // The index has no effect without its log, so a crash between the two
        // renames leaves only an unused index file, overwritten next time.
        fsutil::replace_atomically(&self.dir, &index_name, &index, faults, "history_index")
            .map_err(settle)?;
        fsutil::replace_atomically(&self.dir, &log_name, &log, faults, "history_log")
            .map_err(settle)?;
        let at = self.segments.len();
        self.segments.push(Segment {
            number,
            log: self.log_path(number),
            file: std::sync::OnceLock::new(),
            items: keys.len(),
            newest,
            gone: false,
            scoped: true,
        });
        merge_sorted(
            &mut self.scoped_refs,
            scoped.into_iter().map(|(h, o)| (h, pack(at, o))).collect(),
        );
        merge_sorted(
            &mut self.keys,
            keys.into_iter().map(|(h, o)| (h, pack(at, o))).collect(),
        );
        merge_sorted(
            &mut self.refs,
            refs.into_iter().map(|(h, o)| (h, pack(at, o))).collect(),
        );
        Ok(fresh.len())
    }
}

/// Every item in history, segment by segment, oldest segment first; see
/// [`Outbox::history_items`](crate::Outbox::history_items).
#[derive(Debug)]
pub struct HistoryItems {
    /// Items read already (a PostgreSQL outbox's history), handed out first.
    ready: std::collections::VecDeque<OutboxItem>,
    logs: std::collections::VecDeque<PathBuf>,
    current: Option<(PathBuf, io::BufReader<fs::File>, u64)>,
}

impl HistoryItems {
    /// These items, in this order (history that is not in segment files).
    #[cfg(feature = "postgres")]
    pub(crate) fn of(items: Vec<OutboxItem>) -> Self {
        Self {
            ready: items.into(),
            logs: std::collections::VecDeque::new(),
            current: None,
        }
    }
}

impl Iterator for HistoryItems {
    type Item = Result<OutboxItem>;

    fn next(&mut self) -> Option<Self::Item> {
        use std::io::BufRead;
        if let Some(item) = self.ready.pop_front() {
            return Some(Ok(item));
        }
        loop {
            if let Some((path, reader, offset)) = self.current.as_mut() {
                let mut line = Vec::new();
                match reader.read_until(b'\n', &mut line) {
                    Err(e) => {
                        let path = path.clone();
                        self.current = None;
                        return Some(Err(Error::io(&path, "read", e)));
                    }
                    Ok(0) => self.current = None,
                    Ok(n) => {
                        let at = *offset;
                        *offset += n as u64;
                        return Some(crate::store::decode_item_line(path, at, &line));
                    }
                }
            }
            let path = self.logs.pop_front()?;
            match fsutil::open_existing(&path, false) {
                Ok(file) => self.current = Some((path, io::BufReader::new(file), 0)),
                // Pruned since the listing was taken: nothing left to read there.
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Some(Err(Error::io(&path, "open", e))),
            }
        }
    }
}

impl History {
    /// A reader over every segment present now (segments never change, so it
    /// needs no lock while it reads).
    pub(crate) fn items(&self) -> HistoryItems {
        HistoryItems {
            ready: std::collections::VecDeque::new(),
            logs: self
                .segments
                .iter()
                .filter(|s| !s.gone)
                .map(|s| s.log.clone())
                .collect(),
            current: None,
        }
    }
}

/// How much history to keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Retention {
    /// Keep every segment (the default).
    #[default]
    KeepAll,
    /// Prune segments whose newest item last changed longer ago than this.
    MaxAge(std::time::Duration),
    /// Keep at most this many segments, pruning the oldest.
    MaxSegments(usize),
}

/// A segment due for pruning.
#[derive(Debug, Clone)]
pub(crate) struct Prunable {
    pub(crate) number: u64,
    pub(crate) items: usize,
    pub(crate) newest: DateTime<Utc>,
}

impl History {
    /// The segments `policy` says must go at `now`, oldest first.
    ///
    /// The newest segment is always kept: segment numbers must never be reused,
    /// and the newest existing one is where numbering continues.
    pub(crate) fn prunable(&self, policy: Retention, now: DateTime<Utc>) -> Vec<Prunable> {
        let mut live: Vec<&Segment> = self.segments.iter().filter(|s| !s.gone).collect();
        live.pop();
        let due: Vec<&&Segment> = match policy {
            Retention::KeepAll => Vec::new(),
            Retention::MaxAge(age) => {
                let cutoff = crate::clock::earlier(now, age);
                live.iter().filter(|s| s.newest < cutoff).collect()
            }
            Retention::MaxSegments(keep) => {
                // `live` no longer counts the newest, which is always kept.
                let excess = (live.len() + 1).saturating_sub(keep.max(1));
                live.iter().take(excess).collect()
            }
        };
        due.into_iter()
            .map(|s| Prunable {
                number: s.number,
                items: s.items,
                newest: s.newest,
            })
            .collect()
    }

    /// Deletes a segment (log first: without it the segment does not exist; then
    /// its index) and forgets its entries. Call only after the prune is audited.
    pub(crate) fn remove_segment(&mut self, number: u64) -> Result<()> {
        let Some(at) = self
            .segments
            .iter()
            .position(|s| s.number == number && !s.gone)
        else {
            return Ok(());
        };
        for path in [self.log_path(number), self.index_path(number)] {
            match fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io(&path, "remove pruned segment", e)),
            }
            // One fsync per removal: unsynced name changes may reach the disk in
            // any order, and an index whose log is still there cannot be read.
            fsutil::sync_dir(&self.dir).map_err(|e| Error::io(&self.dir, "fsync directory", e))?;
        }
        self.forget(at);
        Ok(())
    }

    /// Drops a segment's entries from the merged index.
    fn forget(&mut self, at: usize) {
        if let Some(segment) = self.segments.get_mut(at) {
            segment.gone = true;
            segment.file = std::sync::OnceLock::new();
        }
        self.keys.retain(|(_, location)| unpack(*location).0 != at);
        self.refs.retain(|(_, location)| unpack(*location).0 != at);
        self.scoped_refs
            .retain(|(_, location)| unpack(*location).0 != at);
    }
}

impl Segment {
    fn file(&self) -> Result<&fs::File> {
        if let Some(file) = self.file.get() {
            return Ok(file);
        }
        let file =
            fsutil::open_existing(&self.log, false).map_err(|e| Error::io(&self.log, "open", e))?;
        Ok(self.file.get_or_init(|| file))
    }
}

/// Reads and checks the item line at `offset` of a segment log.
fn read_item(file: &fs::File, log: &Path, offset: u64) -> Result<OutboxItem> {
    let mut line = Vec::with_capacity(1024);
    let mut chunk = vec![0u8; 2048];
    let mut at = offset;
    loop {
        let n = read_at(file, &mut chunk, at).map_err(|e| Error::io(log, "read", e))?;
        if n == 0 {
            break;
        }
        if let Some(end) = chunk[..n].iter().position(|b| *b == b'\n') {
            line.extend_from_slice(&chunk[..=end]);
            break;
        }
        line.extend_from_slice(&chunk[..n]);
        at += n as u64;
    }
    crate::store::decode_item_line(log, offset, &line)
}

#[cfg(unix)]
fn read_at(file: &fs::File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    std::os::unix::fs::FileExt::read_at(file, buf, offset)
}

#[cfg(not(unix))]
fn read_at(mut file: &fs::File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    use std::io::{Read, Seek};
    file.seek(io::SeekFrom::Start(offset))?;
    file.read(buf)
}
