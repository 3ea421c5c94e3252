//! The outbox's state on disk: the snapshot `outbox.json` and the journal
//! `outbox.journal`, and this handle's in-memory copy of them.
//!
//! The state is the snapshot plus every journal entry of the same generation,
//! applied in order. A transaction appends one checksummed entry and fsyncs it:
//! one durable step per change, whatever the backlog. Compaction writes a new
//! snapshot (atomically: temp → fsync → rename → fsync directory) with the next
//! generation, then starts an empty journal for it; a crash in between leaves a
//! journal of the old generation, which is recognised as already folded in.
//!
//! Each handle keeps the state in memory with indexes (by transport ref, by
//! destination). Before every use, under the directory lock, it checks the two
//! files' identity and size: a grown journal is read from where it stopped, a
//! replaced file is reloaded. Nothing is re-parsed that has not changed.
//!
//! A file that cannot be read, parsed or validated is reported with its path and
//! position and is never overwritten.

mod journal;
mod v1;

use std::collections::{BTreeSet, HashMap};
use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use chrono::{DateTime, Utc};

use crate::audit::{AuditRecord, Head};
use crate::clock::{format_timestamp, parse_timestamp};
use crate::error::{Error, Result};
use crate::failpoint::Failpoints;
use crate::fsutil::{self, ReplaceFailure, read_at, write_all_at};
use crate::history::Retention;
use crate::item::{Claim, ItemState, OutboxItem};
use crate::message::content_hash;
use crate::order::Lines;
use crate::outbox::{AMBIGUOUS_AFTER_RESTART, SEND_CANCELLED, SEND_PANICKED};
use crate::rate::RateLimit;
use crate::retry::Backoff;
use crate::settings::Stored;

pub(crate) use journal::JOURNAL_FILE;
use journal::{EntryV1, HeaderV1, JOURNAL_VERSION, Line};
pub(crate) use v1::CURRENT_VERSION;
use v1::{
    BackoffV1, CapV1, FileV1, HeadV1, ItemV1, PatternCapV1, RetentionV1, SettingsV1, VersionProbe,
};

/// Name of the snapshot inside an outbox directory.
pub(crate) const STATE_FILE: &str = "outbox.json";

/// Compact once the journal is larger than this many bytes… (replaying 8 MiB on
/// open takes a few milliseconds; compacting a small outbox often would cost more)
const COMPACT_MIN_BYTES: u64 = 8 * 1024 * 1024;
/// …and larger than this multiple of the snapshot (so compaction stays amortised O(1)).
const COMPACT_SNAPSHOT_FACTOR: u64 = 2;

/// A snapshot's contents.
#[derive(Debug, Clone, Default)]
pub(crate) struct State {
    /// Items by idempotency key. A hash map: lookups stay O(1) however large
    /// the backlog; the file and `list_items` sort by key when they need to.
    pub(crate) items: HashMap<String, OutboxItem>,
    /// The audit head when the snapshot was written; the log holds at least this.
    pub(crate) audit_head: Option<Head>,
    /// Where that head record ends in the log, in bytes, when known.
    pub(crate) audit_offset: Option<u64>,
    /// The head's MAC, in keyed mode (checked by the caller, who has the key).
    pub(crate) audit_mac: Option<String>,
    /// The journal generation that continues this snapshot.
    pub(crate) generation: u64,
    /// The settings every handle shares (see `settings`).
    pub(crate) settings: Stored,
    /// Per destination, the latest moment a platform's `retry_after` asked
    /// sends to wait for. It belongs to the destination: whatever happens to
    /// the item that received it later (cancel, requeue, a move to history)
    /// does not lift it. Folded in from every item applied (`Loaded::apply`).
    pub(crate) cooldowns: HashMap<String, DateTime<Utc>>,
}

/// Secondary indexes over the items, kept in step with every change.
#[derive(Debug, Default)]
pub(crate) struct Index {
    by_transport_ref: HashMap<String, BTreeSet<String>>,
    /// The same per destination: platforms whose message ids are unique only
    /// within a chat (Telegram, Slack) are looked up here.
    by_destination_ref: HashMap<String, HashMap<String, BTreeSet<String>>>,
    /// Per destination, the times that count against its rate cap (send times,
    /// and claim times of sends in progress), ordered by time.
    rate_times: HashMap<String, BTreeSet<(DateTime<Utc>, String)>>,
    /// The same times across all destinations, for the global cap.
    all_rate_times: BTreeSet<(DateTime<Utc>, String)>,
    /// The queued items per destination, in enqueue and due order (see `order`).
    pub(crate) lines: Lines,
}

/// The error codes this crate gives ambiguous failures. An item failed with one
/// by a release that did not record `maybe_sent_at` counts from its last change.
const AMBIGUOUS_CODES: [&str; 3] = [AMBIGUOUS_AFTER_RESTART, SEND_PANICKED, SEND_CANCELLED];

/// The times an item counts against its destination's rate caps: its send, a
/// send in progress (from its claim), and a send that may have reached the
/// platform (an ambiguous failure, from its claim), in whatever state the item
/// is now. At most two.
pub(crate) fn rate_times(item: &OutboxItem) -> impl Iterator<Item = DateTime<Utc>> + use<> {
    let current = match (item.state, &item.claim) {
        (ItemState::Sent, _) => item.sent_at,
        (ItemState::Queued, Some(claim)) => claim.at.or(Some(item.updated_at)),
        _ => None,
    };
    let legacy_ambiguous = item.state == ItemState::Failed
        && item
            .error_code
            .as_deref()
            .is_some_and(|code| AMBIGUOUS_CODES.contains(&code));
    let maybe = item
        .maybe_sent_at
        .or_else(|| legacy_ambiguous.then_some(item.updated_at));
    current
        .into_iter()
        .chain(maybe.filter(|at| Some(*at) != current))
}

impl Index {
    fn build(items: &HashMap<String, OutboxItem>) -> Self {
        let mut index = Self::default();
        for item in items.values() {
            index.insert(item);
        }
        index
    }

    fn insert(&mut self, item: &OutboxItem) {
        let key = &item.idempotency_key;
        if let Some(r) = &item.transport_ref {
            self.by_transport_ref
                .entry(r.clone())
                .or_default()
                .insert(key.clone());
            self.by_destination_ref
                .entry(item.destination.clone())
                .or_default()
                .entry(r.clone())
                .or_default()
                .insert(key.clone());
        }
        for at in rate_times(item) {
            self.rate_times
                .entry(item.destination.clone())
                .or_default()
                .insert((at, key.clone()));
            self.all_rate_times.insert((at, key.clone()));
        }
        self.lines.insert(item);
    }

    fn remove(&mut self, item: &OutboxItem) {
        let key = &item.idempotency_key;
        if let Some(r) = &item.transport_ref
            && let Some(keys) = self.by_transport_ref.get_mut(r)
        {
            keys.remove(key);
            if keys.is_empty() {
                self.by_transport_ref.remove(r);
            }
        }
        if let Some(r) = &item.transport_ref
            && let Some(refs) = self.by_destination_ref.get_mut(&item.destination)
        {
            if let Some(keys) = refs.get_mut(r) {
                keys.remove(key);
                if keys.is_empty() {
                    refs.remove(r);
                }
            }
            if refs.is_empty() {
                self.by_destination_ref.remove(&item.destination);
            }
        }
        for at in rate_times(item) {
            self.all_rate_times.remove(&(at, key.clone()));
            if let Some(times) = self.rate_times.get_mut(&item.destination) {
                times.remove(&(at, key.clone()));
                if times.is_empty() {
                    self.rate_times.remove(&item.destination);
                }
            }
        }
        self.lines.remove(item);
    }

    /// The first key (in key order) whose item carries this transport ref.
    pub(crate) fn key_for_transport_ref(&self, transport_ref: &str) -> Option<&str> {
        self.by_transport_ref
            .get(transport_ref)
            .and_then(BTreeSet::first)
            .map(String::as_str)
    }

    /// The first key (in key order) whose item went to `destination` and carries
    /// this transport ref.
    pub(crate) fn key_for_destination_ref(
        &self,
        destination: &str,
        transport_ref: &str,
    ) -> Option<&str> {
        self.by_destination_ref
            .get(destination)
            .and_then(|refs| refs.get(transport_ref))
            .and_then(BTreeSet::first)
            .map(String::as_str)
    }

    /// Every destination with a send or claim at or after `since`.
    pub(crate) fn destinations_since(&self, since: DateTime<Utc>) -> impl Iterator<Item = &str> {
        self.rate_times
            .iter()
            .filter(move |(_, times)| times.last().is_some_and(|(at, _)| *at >= since))
            .map(|(destination, _)| destination.as_str())
    }

    /// The rate-counting times of every destination at or after `since`, with keys.
    pub(crate) fn all_rate_times_since(
        &self,
        since: DateTime<Utc>,
    ) -> impl Iterator<Item = (DateTime<Utc>, &str)> {
        self.all_rate_times
            .range((since, String::new())..)
            .map(|(at, key)| (*at, key.as_str()))
    }

    /// The rate-counting times of `destination` (every destination's with
    /// `None`), newest first, with their keys, and how many there are in all
    /// (an upper bound of any window's count, in O(1)).
    pub(crate) fn rate_times_newest_first(
        &self,
        destination: Option<&str>,
    ) -> (usize, impl Iterator<Item = (DateTime<Utc>, &str)>) {
        let times = match destination {
            Some(destination) => self.rate_times.get(destination),
            None => Some(&self.all_rate_times),
        };
        (
            times.map_or(0, BTreeSet::len),
            times
                .into_iter()
                .flat_map(|times| times.iter().rev())
                .map(|(at, key)| (*at, key.as_str())),
        )
    }

    /// The rate-counting times of `destination` at or after `since`, with their keys.
    /// O(log n + k): only the window is visited, however long the history.
    pub(crate) fn rate_times_since(
        &self,
        destination: &str,
        since: DateTime<Utc>,
    ) -> impl Iterator<Item = (DateTime<Utc>, &str)> {
        self.rate_times
            .get(destination)
            .into_iter()
            .flat_map(move |times| times.range((since, String::new())..))
            .map(|(at, key)| (*at, key.as_str()))
    }
}

/// Identity and size of a file, to notice changes without reading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    len: u64,
    modified: Option<std::time::SystemTime>,
}

fn stamp(path: &Path) -> Result<Option<Stamp>> {
    match fs::metadata(path) {
        Ok(meta) => {
            #[cfg(unix)]
            let (dev, ino) = {
                use std::os::unix::fs::MetadataExt;
                (meta.dev(), meta.ino())
            };
            #[cfg(not(unix))]
            let (dev, ino) = (0, 0);
            Ok(Some(Stamp {
                dev,
                ino,
                len: meta.len(),
                modified: meta.modified().ok(),
            }))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(path, "stat", e)),
    }
}

/// Where this handle stands in the current journal.
#[derive(Debug)]
struct Cursor {
    /// Shared with a commit group's leader, which fsyncs it without the lock.
    file: Arc<File>,
    /// Identity of the journal file the cursor reads.
    dev: u64,
    ino: u64,
    /// Bytes read and applied so far: where the next entry goes.
    offset: u64,
    /// The next entry's sequence number.
    next_seq: u64,
    /// The file's length: zeros from the end of the entries up to here.
    allocated: u64,
    /// Entries of a commit group encoded and applied but not written yet:
    /// they end at `offset`. The group's leader writes them all in one
    /// `pwrite` just before its `fdatasync` (see [`Loaded::take_unsynced`]),
    /// instead of every member paying a write (and a timestamp update of the
    /// journal's inode) under the lock.
    unwritten: Vec<u8>,
}

impl Cursor {
    /// A cursor on a journal's first entry, just after its header.
    fn at_start(file: File, (dev, ino): (u64, u64), header_len: usize, allocated: u64) -> Self {
        Self {
            file: Arc::new(file),
            dev,
            ino,
            offset: header_len as u64,
            next_seq: 1,
            allocated,
            unwritten: Vec::new(),
        }
    }

    /// Where the unwritten entries start in the file.
    fn written_end(&self) -> u64 {
        self.offset - self.unwritten.len() as u64
    }
}

/// What a group's unwritten entries start with room for (8 transactions of
/// a few items each), so that its members do not regrow the buffer.
const UNWRITTEN_CAPACITY: usize = 32 * 1024;

/// A commit group's share of the journal, taken by its leader under the lock
/// and written and synced without it: the entries appended since the last
/// leader took its share, which sit at `at` in `file`.
#[derive(Debug)]
pub(crate) struct Unsynced {
    file: Arc<File>,
    at: u64,
    bytes: Vec<u8>,
}

impl Unsynced {
    /// Writes the group's entries in one go (nothing when there are none).
    /// Every byte of them lies below the file's length, which only grows,
    /// so the write never extends the file.
    ///
    /// A failure may leave any prefix of the bytes written: whole entries
    /// nobody was told are durable, and a torn one, which recovery sets aside.
    pub(crate) fn write(&self, faults: &Failpoints) -> io::Result<()> {
        if self.bytes.is_empty() {
            return Ok(());
        }
        if let Err(e) = faults.check("journal.group_write") {
            // As a short write that then fails: half of the group reaches the file.
            write_all_at(&self.file, &self.bytes[..self.bytes.len() / 2], self.at)?;
            return Err(e);
        }
        write_all_at(&self.file, &self.bytes, self.at)
    }

    /// Makes every entry written to the journal so far durable.
    pub(crate) fn sync(&self, faults: &Failpoints) -> io::Result<()> {
        sync_journal(&self.file, faults)
    }
}

/// The state as this handle knows it, with what is needed to keep it current.
#[derive(Debug)]
pub(crate) struct Loaded {
    pub(crate) state: State,
    pub(crate) index: Index,
    /// Audit records committed in the journal since the snapshot, oldest first.
    pub(crate) journal_audit: Vec<AuditRecord>,
    snapshot: Option<Stamp>,
    /// `None` when there is no journal of the snapshot's generation yet.
    cursor: Option<Cursor>,
    /// Bytes past the cursor that no acknowledged entry owns (a write a power
    /// cut tore), waiting to be set aside before anything is written over them.
    torn: Option<Torn>,
    /// A journal whose header did not parse, with no entry after it: it holds
    /// nothing acknowledged, but it is damaged, so it is set aside before a
    /// fresh journal takes its name (see [`Store::settle_torn`]).
    bad_journal: Option<BadJournal>,
    /// Journal offset before which no further automatic compaction is tried.
    compaction_retry_at: u64,
}

impl Loaded {
    /// The journal's audit records with `seq` above `after`, in order. O(1) to
    /// find: the records are contiguous in `seq`.
    pub(crate) fn journal_audit_after(&self, after: u64) -> &[AuditRecord] {
        let Some(first) = self.journal_audit.first() else {
            return &[];
        };
        let skip = after.saturating_sub(first.seq - 1);
        self.journal_audit
            .get(usize::try_from(skip).unwrap_or(usize::MAX)..)
            .unwrap_or(&[])
    }

    /// Where the bytes past the journal's last whole entry start, when they
    /// were judged what a power cut left of an unsynced write (still to be
    /// set aside): the position an error about them names.
    pub(crate) fn torn_at(&self) -> Option<u64> {
        self.torn.as_ref().map(|t| t.at)
    }

    /// The journal's audit record with this `seq`, if it is in the journal.
    pub(crate) fn journal_audit_at(&self, seq: u64) -> Option<&AuditRecord> {
        let first = self.journal_audit.first()?.seq;
        let index = usize::try_from(seq.checked_sub(first)?).ok()?;
        self.journal_audit.get(index)
    }

    /// Whether the journal has grown enough that a compaction pays for itself.
    pub(crate) fn wants_compaction(&self) -> bool {
        let journal = self.cursor.as_ref().map_or(0, |c| c.offset);
        let snapshot = self.snapshot.map_or(0, |s| s.len);
        journal > COMPACT_MIN_BYTES
            && journal > snapshot * COMPACT_SNAPSHOT_FACTOR
            && journal >= self.compaction_retry_at
    }

    /// After a failed compaction, wait for another 1 MiB of journal before trying
    /// again, rather than re-encoding the whole state at every commit.
    pub(crate) fn defer_compaction(&mut self) {
        let journal = self.cursor.as_ref().map_or(0, |c| c.offset);
        self.compaction_retry_at = journal + 1024 * 1024;
    }

    /// The entries appended since the last call, for a commit group's leader
    /// to write and sync (without the lock: entries appended meanwhile go
    /// after them, to the next leader). `None` without a journal.
    pub(crate) fn take_unsynced(&mut self) -> Option<Unsynced> {
        let cursor = self.cursor.as_mut()?;
        let at = cursor.written_end();
        Some(Unsynced {
            file: Arc::clone(&cursor.file),
            at,
            bytes: std::mem::replace(
                &mut cursor.unwritten,
                Vec::with_capacity(UNWRITTEN_CAPACITY),
            ),
        })
    }

    /// Whether anything has been journalled since the snapshot.
    pub(crate) fn has_journal_entries(&self) -> bool {
        self.cursor.as_ref().is_some_and(|c| c.next_seq > 1)
    }

    fn apply(&mut self, item: OutboxItem) {
        if let Some(old) = self.state.items.get(&item.idempotency_key) {
            self.index.remove(old);
        }
        self.index.insert(&item);
        fold_cooldown(&mut self.state.cooldowns, &item);
        self.state.items.insert(item.idempotency_key.clone(), item);
    }
}

/// Raises the item's destination's cooldown to the item's, if that is later.
fn fold_cooldown(cooldowns: &mut HashMap<String, DateTime<Utc>>, item: &OutboxItem) {
    if let Some(until) = item.cooldown_until {
        let current = cooldowns.entry(item.destination.clone()).or_insert(until);
        *current = (*current).max(until);
    }
}

/// A crash remnant found past the last whole entry: where it starts (the cursor
/// when it was found) and its bytes up to its last non-zero byte.
#[derive(Debug)]
struct Torn {
    at: u64,
    bytes: Vec<u8>,
}

/// A journal judged unusable on load: its bytes up to the last non-zero one
/// (the preallocated zeros after them hold nothing), and why.
#[derive(Debug)]
struct BadJournal {
    bytes: Vec<u8>,
    reason: &'static str,
}

/// How far a failed commit got.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum CommitFailure {
    /// Nothing reached the journal: the state is as before and the handle is usable.
    Clean,
    /// Bytes may have reached the journal, or a new file may not be durable:
    /// the handle must be poisoned.
    Uncertain,
}

/// Reads and writes the snapshot and journal in one directory.
#[derive(Debug)]
pub(crate) struct Store {
    dir: PathBuf,
    path: PathBuf,
    journal_path: PathBuf,
}

impl Store {
    pub(crate) fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_path_buf(),
            path: dir.join(STATE_FILE),
            journal_path: dir.join(JOURNAL_FILE),
        }
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Whether `outbox.json` is not the file `loaded` was read from (replaced,
    /// rewritten or removed behind the outbox's back): one `stat`. Every other
    /// change by a writer is announced by the lock file's change counter.
    pub(crate) fn snapshot_changed(&self, loaded: Option<&Loaded>) -> Result<bool> {
        let Some(loaded) = loaded else {
            return Ok(true);
        };
        Ok(stamp(&self.path)? != loaded.snapshot)
    }

    /// Brings `loaded` up to date with the files, loading them the first time.
    /// Call with the directory lock held.
    pub(crate) fn refresh<'a>(&self, loaded: &'a mut Option<Loaded>) -> Result<&'a mut Loaded> {
        let snapshot = stamp(&self.path)?;
        // Identity only: asking for the journal's timestamps would make the next
        // entry's write dirty its inode (see `fsutil::identity`).
        let journal = fsutil::identity(&self.journal_path)
            .map_err(|e| Error::io(&self.journal_path, "stat", e))?;
        let reload = match loaded.as_ref() {
            None => true,
            Some(current) => {
                // Entries never written (their group failed): the state is
                // ahead of the files, so read the files afresh.
                current
                    .cursor
                    .as_ref()
                    .is_some_and(|c| !c.unwritten.is_empty())
                    || current.snapshot != snapshot
                    || match (&current.cursor, journal) {
                        (None, None) => false,
                        (Some(c), Some(j)) => (c.dev, c.ino) != (j.dev, j.ino),
                        _ => true,
                    }
            }
        };
        if reload {
            *loaded = None;
            let fresh = self.load(snapshot)?;
            return Ok(loaded.insert(fresh));
        }
        let Some(current) = loaded.as_mut() else {
            unreachable!("reload handles None")
        };
        if let (Some(cursor), Some(j)) = (current.cursor.as_mut(), journal) {
            if j.len < cursor.offset {
                return Err(invalid(
                    &self.journal_path,
                    format!("byte {}", j.len),
                    format!(
                        "the journal shrank below the {} bytes already applied: it was truncated",
                        cursor.offset
                    ),
                ));
            }
            // Another handle may have grown the file: never write zeros below
            // its real length, they would cover acknowledged entries. (A handle
            // that finds the change counter unmoved knows nobody did, and never
            // `stat`s the journal: on a kernel with multigrain timestamps a
            // `stat` between two writes makes the next write dirty the inode,
            // and the next `fdatasync` write it out, a second I/O.)
            cursor.allocated = cursor.allocated.max(j.len);
            // The journal is preallocated, so its length says nothing about new
            // entries: probe the bytes at the cursor (one small read).
            self.read_journal(current)?;
        }
        Ok(current)
    }

    /// Loads the snapshot and replays the journal of its generation.
    fn load(&self, snapshot: Option<Stamp>) -> Result<Loaded> {
        let state = if snapshot.is_some() {
            let bytes =
                fsutil::read_existing(&self.path).map_err(|e| Error::io(&self.path, "read", e))?;
            decode(&self.path, &bytes)?
        } else {
            State::default()
        };
        let mut loaded = Loaded {
            index: Index::build(&state.items),
            state,
            journal_audit: Vec::new(),
            snapshot,
            cursor: None,
            torn: None,
            bad_journal: None,
            compaction_retry_at: 0,
        };
        let file = match fsutil::open_existing(&self.journal_path, true) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(loaded),
            Err(e) => return Err(Error::io(&self.journal_path, "open", e)),
        };
        // Other processes' entries are read through it right after they are written.
        fsutil::no_access_time(&file);
        let meta = file
            .metadata()
            .map_err(|e| Error::io(&self.journal_path, "stat", e))?;
        #[cfg(unix)]
        let (dev, ino) = {
            use std::os::unix::fs::MetadataExt;
            (meta.dev(), meta.ino())
        };
        #[cfg(not(unix))]
        let (dev, ino) = (0, 0);
        let mut header = Vec::new();
        (&file)
            .take(4096)
            .read_to_end(&mut header)
            .map_err(|e| Error::io(&self.journal_path, "read", e))?;
        if header.is_empty() {
            // An empty journal holds nothing acknowledged; the next commit starts it again.
            return Ok(loaded);
        }
        let generation = match journal::next_line(&header) {
            // Created atomically, so a bad header alone was never acknowledged;
            // but a bad header with entries after it is damage, not a tear.
            Line::Invalid { len, terminated } => {
                loaded.bad_journal = Some(self.bad_header(&file, header, len, terminated)?);
                return Ok(loaded);
            }
            Line::Valid(json, len) => {
                let head: HeaderV1 = serde_json::from_slice(json).map_err(|e| {
                    invalid(
                        &self.journal_path,
                        "line 1".into(),
                        format!("invalid header: {e}"),
                    )
                })?;
                if head.journal != JOURNAL_VERSION {
                    return Err(invalid(
                        &self.journal_path,
                        "line 1".into(),
                        format!("unsupported journal version {}", head.journal),
                    ));
                }
                (head.generation, len)
            }
        };
        let (generation, header_len) = generation;
        if generation < loaded.state.generation {
            // Left by a compaction that crashed after writing the snapshot: every
            // entry is already in the snapshot.
            return Ok(loaded);
        }
        if generation > loaded.state.generation {
            return Err(invalid(
                &self.path,
                "generation".into(),
                format!(
                    "snapshot generation {} is older than the journal's {generation}: outbox.json was replaced or rolled back",
                    loaded.state.generation
                ),
            ));
        }
        loaded.cursor = Some(Cursor::at_start(file, (dev, ino), header_len, meta.len()));
        self.read_journal(&mut loaded)?;
        self.check_beyond_end(&mut loaded)?;
        Ok(loaded)
    }

    /// A journal whose header line (the first `len` bytes of `header`, the
    /// file's first bytes; `terminated`: whole) did not parse. With no entry
    /// after it, nothing acknowledged is in it and the next commit starts a
    /// fresh journal; but the file is damaged, so its bytes are kept to be
    /// set aside first, never overwritten. With entries after it, it is
    /// damage, not a tear: an error.
    fn bad_header(
        &self,
        mut file: &File,
        mut header: Vec<u8>,
        len: usize,
        terminated: bool,
    ) -> Result<BadJournal> {
        // No header is longer than one for the largest generation: a bad
        // first line longer than that runs on past where the header ended
        // (its newline damaged) into what may be acknowledged entries.
        let longest = journal::encode_line(&HeaderV1 {
            journal: JOURNAL_VERSION,
            generation: u64::MAX,
        })
        .len();
        if len > longest {
            return Err(invalid(
                &self.journal_path,
                "line 1".into(),
                format!(
                    "the header is damaged and runs on for {len} bytes, past where any header ends: it may hold entries"
                ),
            ));
        }
        let mut rest = Vec::new();
        file.read_to_end(&mut rest)
            .map_err(|e| Error::io(&self.journal_path, "read", e))?;
        let mut after = header[len.min(header.len())..].to_vec();
        after.extend_from_slice(&rest);
        if !journal::is_remnant(false, &after) {
            return Err(invalid(
                &self.journal_path,
                "line 1".into(),
                "the header is damaged but entries follow it",
            ));
        }
        header.extend_from_slice(&rest);
        Ok(BadJournal {
            bytes: without_trailing_zeros(header),
            reason: if terminated {
                "its header line is whole but invalid, and no entry follows it"
            } else {
                "its header line is unfinished, and no entry follows it"
            },
        })
    }

    /// Applies journal entries past the cursor; quarantines a torn tail.
    fn read_journal(&self, loaded: &mut Loaded) -> Result<()> {
        let Some(cursor) = loaded.cursor.as_mut() else {
            return Ok(());
        };
        let start = cursor.offset;
        let fresh = read_until_zero(&cursor.file, start)
            .map_err(|e| Error::io(&self.journal_path, "read", e))?;
        let mut pos = 0;
        let mut entries = Vec::new();
        let mut next_seq = cursor.next_seq;
        while pos < fresh.len() && fresh[pos] != 0 {
            match journal::next_line(&fresh[pos..]) {
                Line::Valid(json, len) => {
                    let at = format!("byte {}", start + pos as u64);
                    let entry: EntryV1 = serde_json::from_slice(json).map_err(|e| {
                        invalid(
                            &self.journal_path,
                            at.clone(),
                            format!("invalid entry: {e}"),
                        )
                    })?;
                    if entry.seq != next_seq {
                        return Err(invalid(
                            &self.journal_path,
                            at,
                            format!("entry seq {} where {next_seq} was expected", entry.seq),
                        ));
                    }
                    next_seq += 1;
                    let mut items = Vec::with_capacity(entry.items.len());
                    for (i, raw) in entry.items.into_iter().enumerate() {
                        items.push(item_from_disk(
                            &self.journal_path,
                            &format!("{at} item {i}"),
                            raw,
                        )?);
                    }
                    let settings = entry
                        .settings
                        .map(|raw| {
                            settings_from_disk(&self.journal_path, &format!("{at} settings"), raw)
                        })
                        .transpose()?;
                    entries.push((items, entry.audit, settings, len));
                    pos += len;
                }
                Line::Invalid { len, terminated } => {
                    let tail = read_remnant(&cursor.file, start + pos as u64, &fresh[pos..])
                        .map_err(|e| Error::io(&self.journal_path, "read", e))?;
                    if journal::is_unsynced_tail(terminated, &tail[len.min(tail.len())..], next_seq)
                    {
                        break;
                    }
                    return Err(invalid(
                        &self.journal_path,
                        format!("byte {}", start + pos as u64),
                        "checksum mismatch or malformed line (the journal is damaged)",
                    ));
                }
            }
        }
        let torn_at = start + pos as u64;
        let advanced = !entries.is_empty();
        for (items, audit, settings, len) in entries {
            for item in items {
                loaded.apply(item);
            }
            if let Some(settings) = settings {
                loaded.state.settings = settings;
            }
            loaded.journal_audit.extend(audit);
            let Some(cursor) = loaded.cursor.as_mut() else {
                unreachable!("checked above")
            };
            cursor.offset += len as u64;
            cursor.next_seq += 1;
        }
        if pos < fresh.len() && fresh[pos] != 0 {
            let Some(cursor) = loaded.cursor.as_ref() else {
                unreachable!("checked above")
            };
            let mut tail = read_remnant(&cursor.file, torn_at, &fresh[pos..])
                .map_err(|e| Error::io(&self.journal_path, "read", e))?;
            let end = tail.iter().rposition(|b| *b != 0).map_or(0, |i| i + 1);
            tail.truncate(end);
            loaded.torn = Some(Torn {
                at: torn_at,
                bytes: tail,
            });
        } else if advanced {
            // Another handle wrote entries here, so it set aside whatever lay
            // past the old end first: what this handle knew of is gone.
            loaded.torn = None;
        }
        // Nothing new at the cursor: a remnant found earlier (possibly beyond a
        // zeroed gap, by `check_beyond_end`) is still there and must be kept in
        // mind until it is set aside, however often the state is refreshed.
        Ok(())
    }

    /// Once per load: looks past the entries' end for non-zero bytes. Whole lines
    /// there that cannot be later entries of an unsynced group's torn write mean
    /// damage (reported); anything else is a remnant, set aside like a torn tail
    /// (see [`journal::is_unsynced_tail`]).
    fn check_beyond_end(&self, loaded: &mut Loaded) -> Result<()> {
        let Some(cursor) = loaded.cursor.as_ref() else {
            return Ok(());
        };
        if loaded.torn.is_some() {
            return Ok(());
        }
        let len =
            usize::try_from(cursor.allocated.saturating_sub(cursor.offset)).unwrap_or(usize::MAX);
        let mut rest = vec![0; len];
        let n = read_at(&cursor.file, &mut rest, cursor.offset)
            .map_err(|e| Error::io(&self.journal_path, "read", e))?;
        rest.truncate(n);
        let Some(last) = rest.iter().rposition(|b| *b != 0) else {
            return Ok(());
        };
        rest.truncate(last + 1);
        // Whole entries after the zeros are the rest of an unsynced group's
        // torn write only if they come later in the sequence.
        if !journal::is_unsynced_tail(false, &rest, cursor.next_seq) {
            return Err(invalid(
                &self.journal_path,
                format!("byte {}", cursor.offset),
                "whole lines that are not later entries follow a zeroed region: the journal is damaged",
            ));
        }
        loaded.torn = Some(Torn {
            at: cursor.offset,
            bytes: rest,
        });
        Ok(())
    }

    /// Copies an unacknowledged, torn journal tail aside, then zeroes it. Called
    /// only once the state has been checked, so an open that fails leaves the
    /// journal untouched, and before any new entry is written over it.
    ///
    /// The bytes are read again first: another handle may have set them aside
    /// already (then there is nothing left to do), and only the bytes that were
    /// judged a remnant are ever zeroed.
    ///
    /// A journal whose header was judged bad, with nothing after it, is set
    /// aside the same way, whole ([`set_aside_bad_journal`](Self::set_aside_bad_journal)).
    pub(crate) fn settle_torn(&self, loaded: &mut Loaded) -> Result<()> {
        self.set_aside_bad_journal(loaded)?;
        let (Some(torn), Some(cursor)) = (loaded.torn.take(), loaded.cursor.as_mut()) else {
            return Ok(());
        };
        if torn.at != cursor.offset {
            // Entries were written past where it was found: someone settled it.
            return Ok(());
        }
        let mut now = vec![0; torn.bytes.len()];
        let n = read_at(&cursor.file, &mut now, torn.at)
            .map_err(|e| Error::io(&self.journal_path, "read", e))?;
        now.truncate(n);
        if now.iter().all(|b| *b == 0) {
            return Ok(());
        }
        if now != torn.bytes {
            return Err(invalid(
                &self.journal_path,
                format!("byte {}", torn.at),
                "the unacknowledged tail changed while the directory was locked",
            ));
        }
        let quarantine =
            fsutil::write_quarantine(&self.dir, &format!("{JOURNAL_FILE}.torn"), &torn.bytes)?;
        write_all_at(&cursor.file, &vec![0; torn.bytes.len()], torn.at)
            .and_then(|()| cursor.file.sync_data())
            .map_err(|e| Error::io(&self.journal_path, "zero torn tail", e))?;
        tracing::warn!(
            journal = %self.journal_path.display(),
            quarantine = %quarantine.display(),
            bytes = torn.bytes.len(),
            "moved an unacknowledged, torn journal tail aside"
        );
        Ok(())
    }

    /// Copies a journal judged bad on load (its header did not parse and no
    /// entry follows it: nothing acknowledged) to `outbox.journal.torn-<n>`,
    /// then removes it, so that a fresh journal can take its name and no
    /// later load finds it again. Like a torn tail, it is set aside only once
    /// the state has been checked, and its bytes are read again first: gone
    /// already (another handle set it aside) means nothing to do, changed
    /// means an error, and nothing is removed.
    fn set_aside_bad_journal(&self, loaded: &mut Loaded) -> Result<()> {
        if loaded.cursor.is_some() {
            loaded.bad_journal = None;
            return Ok(());
        }
        let Some(bad) = loaded.bad_journal.take() else {
            return Ok(());
        };
        let now = match fsutil::read_existing(&self.journal_path) {
            Ok(now) => without_trailing_zeros(now),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(Error::io(&self.journal_path, "read", e)),
        };
        if now != bad.bytes {
            return Err(invalid(
                &self.journal_path,
                "line 1".into(),
                "the journal judged damaged changed while the directory was locked",
            ));
        }
        let quarantine = (!bad.bytes.is_empty())
            .then(|| {
                fsutil::write_quarantine(&self.dir, &format!("{JOURNAL_FILE}.torn"), &bad.bytes)
            })
            .transpose()?;
        fs::remove_file(&self.journal_path)
            .and_then(|()| fsutil::sync_dir(&self.dir))
            .map_err(|e| Error::io(&self.journal_path, "set aside damaged journal", e))?;
        tracing::warn!(
            journal = %self.journal_path.display(),
            quarantine = %quarantine.as_deref().map_or_else(|| "none (only zeros)".into(), |q| q.display().to_string()),
            bytes = bad.bytes.len(),
            reason = bad.reason,
            "moved a damaged journal aside; the next change starts a fresh one"
        );
        Ok(())
    }

    /// Journals one transaction durably and applies it to `loaded`.
    pub(crate) fn commit(
        &self,
        loaded: &mut Loaded,
        items: Vec<OutboxItem>,
        audit: &[AuditRecord],
        faults: &Failpoints,
    ) -> std::result::Result<(), (CommitFailure, Error)> {
        self.commit_settings(loaded, None, items, audit, faults)
    }

    /// As [`commit`](Self::commit), storing new settings too when `settings`
    /// is `Some` (the whole stored set: it replaces the current one).
    pub(crate) fn commit_settings(
        &self,
        loaded: &mut Loaded,
        settings: Option<Stored>,
        items: Vec<OutboxItem>,
        audit: &[AuditRecord],
        faults: &Failpoints,
    ) -> std::result::Result<(), (CommitFailure, Error)> {
        self.write_entry(loaded, settings, items, audit, faults, true)
    }

    /// Appends one transaction's entry to the journal's unwritten entries
    /// (neither written nor synced) and applies it to `loaded`, for a commit
    /// group: the caller must hold the directory lock until a leader has
    /// written and synced it ([`Loaded::take_unsynced`]), and poison the
    /// handle if that fails. Only growing the file touches it here, so that a
    /// full disk fails this transaction alone, cleanly.
    pub(crate) fn append_unsynced(
        &self,
        loaded: &mut Loaded,
        settings: Option<Stored>,
        items: Vec<OutboxItem>,
        audit: &[AuditRecord],
        faults: &Failpoints,
    ) -> std::result::Result<(), (CommitFailure, Error)> {
        self.write_entry(loaded, settings, items, audit, faults, false)
    }

    /// The journal's path, for errors.
    pub(crate) fn journal_path(&self) -> &Path {
        &self.journal_path
    }

    fn write_entry(
        &self,
        loaded: &mut Loaded,
        settings: Option<Stored>,
        items: Vec<OutboxItem>,
        audit: &[AuditRecord],
        faults: &Failpoints,
        sync: bool,
    ) -> std::result::Result<(), (CommitFailure, Error)> {
        self.settle_torn(loaded)
            .map_err(|e| (CommitFailure::Uncertain, e))?;
        if loaded.cursor.is_none() {
            self.start_journal(loaded, loaded.state.generation, faults)?;
        }
        let Some(cursor) = loaded.cursor.as_mut() else {
            unreachable!("started above")
        };
        faults.check("journal.write").map_err(|e| {
            (
                CommitFailure::Clean,
                Error::io(&self.journal_path, "append", e),
            )
        })?;
        let mark = crate::profile::Mark::now();
        let entry = EntryV1 {
            seq: cursor.next_seq,
            items: items.iter().map(item_to_disk).collect(),
            audit: audit.to_vec(),
            settings: settings.as_ref().map(settings_to_disk),
        };
        // Encoded straight after the unwritten entries, where it will be written.
        let written_end = cursor.written_end();
        let start = cursor.unwritten.len();
        journal::encode_line_into(&mut cursor.unwritten, &entry);
        let len = (cursor.unwritten.len() - start) as u64;
        let mark = mark.end(crate::profile::Span::AppendEncode);
        let uncertain = |op: &'static str, e: io::Error| {
            (
                CommitFailure::Uncertain,
                Error::io(&self.journal_path, op, e),
            )
        };
        // `allocated` is the file's real length: this handle extended it last,
        // or another did and `refresh` (run before any write of a handle whose
        // cache is stale) took its length. No `stat` here (see `refresh`).
        // Keep at least one zero byte after the entry: it marks the end.
        let needed = cursor.offset + len + 1;
        if needed > cursor.allocated {
            // Grow in large steps; on a nearly full disk, by just what this entry
            // needs. Zeros past the end change nothing, so a failure here is clean.
            let extend = |to: u64| {
                let zeros = vec![0u8; usize::try_from(to - cursor.allocated).unwrap_or(usize::MAX)];
                write_all_at(&cursor.file, &zeros, cursor.allocated)
            };
            let generous = needed.max(cursor.allocated + journal::GROW);
            let grown = faults.check("journal.extend").and_then(|()| {
                if extend(generous).is_ok() {
                    Ok(generous)
                } else {
                    extend(needed).map(|()| needed)
                }
            });
            // The zeros are made durable before any entry is written into
            // them: until then a power cut may leave the file's new length
            // with blocks that were never written, which a filesystem may
            // show as old disk contents (ext4 mounted `data=writeback`), and
            // garbage after the entries reads as damage.
            let grown = grown.and_then(|grown| {
                faults
                    .check("journal.extend_sync")
                    .and_then(|()| self.sync_growth(cursor))
                    .map(|()| grown)
            });
            match grown {
                Ok(grown) => cursor.allocated = grown,
                Err(e) => {
                    cursor.unwritten.truncate(start);
                    // What was grown (part of it, on a full disk; all of it,
                    // when its sync failed) is not known durable: cut it off,
                    // or a later reader would take the length as allocated
                    // and write entries into it without syncing a growth.
                    // Only zeros this call wrote lie past `allocated`.
                    if let Err(cut) = cursor.file.set_len(cursor.allocated) {
                        tracing::warn!(
                            journal = %self.journal_path.display(),
                            error = %cut,
                            "could not cut off a journal growth that failed: a handle that reads the file later may write into zeros never synced"
                        );
                    }
                    return Err((
                        CommitFailure::Clean,
                        Error::io(&self.journal_path, "extend", e),
                    ));
                }
            }
        }
        if sync {
            // Entries a group left unwritten go first: no gap of zeros may
            // separate them from this one.
            let written = write_all_at(&cursor.file, &cursor.unwritten, written_end);
            cursor.unwritten.clear();
            written.map_err(|e| uncertain("append", e))?;
            sync_journal(&cursor.file, faults).map_err(|e| uncertain("fsync", e))?;
        }
        let mark = mark.end(crate::profile::Span::AppendWrite);
        cursor.offset += len;
        cursor.next_seq += 1;
        for item in items {
            loaded.apply(item);
        }
        if let Some(settings) = settings {
            loaded.state.settings = settings;
        }
        loaded.journal_audit.extend(entry.audit);
        let _ = mark.end(crate::profile::Span::AppendApply);
        Ok(())
    }

    /// Makes a growth of the journal (its new zeros and its length) durable.
    ///
    /// Through a descriptor of its own: a commit group's leader may be
    /// between its write and its `fdatasync` on the shared one, and Linux
    /// reports a write-back error once per open file description, to the
    /// first `fsync` on it. An error this sync met would be consumed on the
    /// shared descriptor, and the leader told its group is durable; on a
    /// description of its own, the leader's sync still reports it.
    ///
    /// A failure fails the transaction that grew the journal, cleanly: no
    /// entry was written into the zeros, and the growth is made again (and
    /// synced) by the next entry that needs it.
    fn sync_growth(&self, cursor: &Cursor) -> io::Result<()> {
        let own = fsutil::open_existing(&self.journal_path, false)?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::MetadataExt;
            let meta = own.metadata()?;
            if (meta.dev(), meta.ino()) != (cursor.dev, cursor.ino) {
                return Err(io::Error::other(
                    "outbox.journal was replaced while the directory was locked",
                ));
            }
        }
        #[cfg(not(unix))]
        let _ = cursor;
        own.sync_data()
    }

    /// Creates an empty journal (just its header) for `generation`, atomically,
    /// after setting aside a damaged one it would replace (a compaction may
    /// get here first).
    fn start_journal(
        &self,
        loaded: &mut Loaded,
        generation: u64,
        faults: &Failpoints,
    ) -> std::result::Result<(), (CommitFailure, Error)> {
        self.set_aside_bad_journal(loaded)
            .map_err(|e| (CommitFailure::Clean, e))?;
        let header = journal::encode_line(&HeaderV1 {
            journal: JOURNAL_VERSION,
            generation,
        });
        let mut contents = header.clone();
        contents.resize(header.len() + journal::PREALLOCATE, 0);
        fsutil::replace_atomically(&self.dir, JOURNAL_FILE, &contents, faults, "journal_create")
            .map_err(|(how, e)| {
                let failure = match how {
                    ReplaceFailure::BeforeRename => CommitFailure::Clean,
                    ReplaceFailure::AfterRename => CommitFailure::Uncertain,
                };
                (failure, e)
            })?;
        let file = fsutil::open_existing(&self.journal_path, true).map_err(|e| {
            (
                CommitFailure::Uncertain,
                Error::io(&self.journal_path, "open", e),
            )
        })?;
        fsutil::no_access_time(&file);
        let (dev, ino) = match stamp(&self.journal_path) {
            Ok(Some(s)) => (s.dev, s.ino),
            Ok(None) => {
                return Err((
                    CommitFailure::Uncertain,
                    Error::io(&self.journal_path, "stat", io::ErrorKind::NotFound.into()),
                ));
            }
            Err(e) => return Err((CommitFailure::Uncertain, e)),
        };
        loaded.cursor = Some(Cursor::at_start(
            file,
            (dev, ino),
            header.len(),
            contents.len() as u64,
        ));
        Ok(())
    }

    /// Folds the journal into a new snapshot of the next generation, then starts
    /// an empty journal for it. The caller must have made every audit record up
    /// to `audit_head` durable first.
    pub(crate) fn compact(
        &self,
        loaded: &mut Loaded,
        audit_head: Head,
        audit_offset: u64,
        hasher: &crate::audit::Hasher,
        evicted: &std::collections::HashSet<String>,
        faults: &Failpoints,
    ) -> std::result::Result<(), (CommitFailure, Error)> {
        let mut items = std::mem::take(&mut loaded.state.items);
        let mut moved = Vec::with_capacity(evicted.len());
        for key in evicted {
            if let Some(item) = items.remove(key) {
                moved.push(item);
            }
        }
        let generation = loaded.state.generation + 1;
        let next = State {
            items,
            audit_mac: crate::audit::head_mac(hasher, &audit_head, generation),
            audit_head: Some(audit_head),
            audit_offset: Some(audit_offset),
            generation,
            settings: loaded.state.settings.clone(),
            cooldowns: loaded.state.cooldowns.clone(),
        };
        let saved =
            fsutil::replace_atomically(&self.dir, STATE_FILE, &encode(&next), faults, "state");
        let failed = saved.err();
        let committed = !matches!(failed, Some((ReplaceFailure::BeforeRename, _)));
        loaded.state.items = next.items;
        if committed {
            loaded.state.audit_head.clone_from(&next.audit_head);
            loaded.state.audit_offset = next.audit_offset;
            loaded.state.audit_mac.clone_from(&next.audit_mac);
            loaded.state.generation = next.generation;
            for item in &moved {
                loaded.index.remove(item);
            }
        } else {
            // The snapshot still holds them: they stay live.
            for item in moved {
                loaded
                    .state
                    .items
                    .insert(item.idempotency_key.clone(), item);
            }
        }
        if let Some((how, e)) = failed {
            return Err(match how {
                ReplaceFailure::BeforeRename => (CommitFailure::Clean, e),
                ReplaceFailure::AfterRename => (CommitFailure::Uncertain, e),
            });
        }
        loaded.journal_audit.clear();
        loaded.snapshot = stamp(&self.path).map_err(|e| (CommitFailure::Uncertain, e))?;
        loaded.cursor = None;
        self.start_journal(loaded, next.generation, faults)
    }
}

/// `bytes` without the zeros at their end.
fn without_trailing_zeros(mut bytes: Vec<u8>) -> Vec<u8> {
    let end = bytes.iter().rposition(|b| *b != 0).map_or(0, |i| i + 1);
    bytes.truncate(end);
    bytes
}

/// Makes every entry written to `journal` so far durable.
pub(crate) fn sync_journal(journal: &File, faults: &Failpoints) -> io::Result<()> {
    faults
        .check("journal.fsync")
        .and_then(|()| journal.sync_data())
}

/// Reads from `offset` until the first zero byte (the end of the entries) or the
/// end of the file. Usually one small read: nothing new since the last look.
fn read_until_zero(file: &File, offset: u64) -> io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    // Small first: usually nothing is new and only the first byte matters.
    let mut chunk = 1024;
    loop {
        let old = buf.len();
        buf.resize(old + chunk, 0);
        let n = read_at(file, &mut buf[old..], offset + old as u64)?;
        buf.truncate(old + n);
        if n == 0 || buf[old..].contains(&0) {
            return Ok(buf);
        }
        chunk = (chunk * 4).min(1 << 20);
    }
}

/// The bytes from a bad line on, up to a long run of zeros or the end of the
/// file: enough to see whether whole lines follow (damage) or not (a remnant).
/// Reads to the end of the file: a remnant must be judged on everything after
/// it (whole lines anywhere past a zeroed region that are not later entries
/// mean damage, not a tear).
/// This is the rare path, after a bad line; the journal is bounded by compaction.
fn read_remnant(file: &File, offset: u64, probe: &[u8]) -> io::Result<Vec<u8>> {
    const CHUNK: usize = 1024 * 1024;
    let mut buf = probe.to_vec();
    loop {
        let old = buf.len();
        buf.resize(old + CHUNK, 0);
        let n = read_at(file, &mut buf[old..], offset + old as u64)?;
        buf.truncate(old + n);
        if n == 0 {
            return Ok(buf);
        }
    }
}

/// One item as a checksummed line (the journal's framing), for history segments.
pub(crate) fn encode_item_line(item: &OutboxItem) -> Vec<u8> {
    journal::encode_line(&item_to_disk(item))
}

/// Checks and parses one item line of a history segment read at `offset`.
pub(crate) fn decode_item_line(path: &Path, offset: u64, line: &[u8]) -> Result<OutboxItem> {
    let place = format!("byte {offset}");
    let Line::Valid(json, _) = journal::next_line(line) else {
        return Err(invalid(path, place, "checksum mismatch or malformed line"));
    };
    let raw: ItemV1 = serde_json::from_slice(json)
        .map_err(|e| invalid(path, place.clone(), format!("invalid item: {e}")))?;
    item_from_disk(path, &place, raw)
}

/// One item as the JSON object `outbox.json` stores (no framing): how other
/// engines store an item, so every engine reads and writes the same fields.
#[cfg(feature = "postgres")]
pub(crate) fn item_to_json(item: &OutboxItem) -> Vec<u8> {
    #[expect(clippy::expect_used, reason = "plain data always serialises")]
    serde_json::to_vec(&item_to_disk(item)).expect("items serialise")
}

/// Parses and checks one item stored by [`item_to_json`]; `place` names where
/// it was read (e.g. `row "order-17"`) in errors about `path`.
#[cfg(feature = "postgres")]
pub(crate) fn item_from_json(path: &Path, place: &str, json: &[u8]) -> Result<OutboxItem> {
    let raw: ItemV1 = serde_json::from_slice(json)
        .map_err(|e| invalid(path, place.to_owned(), format!("invalid item: {e}")))?;
    item_from_disk(path, place, raw)
}

/// The stored settings as the JSON object `outbox.json` keeps under `"settings"`.
#[cfg(feature = "postgres")]
pub(crate) fn settings_to_json(stored: &Stored) -> String {
    #[expect(clippy::expect_used, reason = "plain data always serialises")]
    serde_json::to_string(&settings_to_disk(stored)).expect("settings serialise")
}

/// Parses and checks settings stored by [`settings_to_json`], read at `place`
/// in `path`.
#[cfg(feature = "postgres")]
pub(crate) fn settings_from_json(path: &Path, place: &str, json: &str) -> Result<Stored> {
    let raw: SettingsV1 = serde_json::from_str(json)
        .map_err(|e| invalid(path, place.to_owned(), format!("invalid settings: {e}")))?;
    settings_from_disk(path, place, raw)
}

/// Serialises a state as version 2, pretty-printed, newline-terminated.
pub(crate) fn encode(state: &State) -> Vec<u8> {
    let file = FileV1 {
        version: CURRENT_VERSION,
        audit_head: state.audit_head.as_ref().map(|h| HeadV1 {
            hash: h.hash.clone(),
            mac: state.audit_mac.clone(),
            offset: state.audit_offset,
            seq: h.seq,
        }),
        generation: state.generation,
        settings: (!state.settings.is_empty()).then(|| settings_to_disk(&state.settings)),
        cooldowns: state
            .cooldowns
            .iter()
            .map(|(destination, until)| (destination.clone(), format_timestamp(*until)))
            .collect(),
        items: {
            let mut sorted: Vec<&OutboxItem> = state.items.values().collect();
            sorted.sort_unstable_by(|a, b| a.idempotency_key.cmp(&b.idempotency_key));
            sorted.into_iter().map(item_to_disk).collect()
        },
    };
    #[expect(clippy::expect_used, reason = "plain data always serialises")]
    let mut bytes = serde_json::to_vec_pretty(&file).expect("outbox state serialises");
    bytes.push(b'\n');
    bytes
}

/// Parses and validates a snapshot's bytes.
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
    let mut items = HashMap::with_capacity(file.items.len());
    for (index, raw) in file.items.into_iter().enumerate() {
        let item = item_from_disk(path, &format!("items[{index}]"), raw)?;
        let key = item.idempotency_key.clone();
        if items.insert(key.clone(), item).is_some() {
            return Err(invalid(
                path,
                format!("items[{index}] (key {key:?})"),
                "duplicate idempotency_key",
            ));
        }
    }
    let settings = file
        .settings
        .map(|raw| settings_from_disk(path, "settings", raw))
        .transpose()?
        .unwrap_or_default();
    let mut cooldowns = HashMap::with_capacity(file.cooldowns.len());
    for (destination, until) in file.cooldowns {
        let at = parse_timestamp(&until).ok_or_else(|| {
            invalid(
                path,
                format!("cooldowns[{destination:?}]"),
                format!("{until:?} is not an RFC 3339 time"),
            )
        })?;
        cooldowns.insert(destination, at);
    }
    // A cooldown an older release kept only on its item belongs to the destination.
    for item in items.values() {
        fold_cooldown(&mut cooldowns, item);
    }
    Ok(State {
        items,
        settings,
        cooldowns,
        audit_offset: file.audit_head.as_ref().and_then(|h| h.offset),
        audit_mac: file.audit_head.as_ref().and_then(|h| h.mac.clone()),
        audit_head: file.audit_head.map(|h| Head {
            seq: h.seq,
            hash: h.hash,
        }),
        generation: file.generation,
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
        cooldown_until_utc: time(item.cooldown_until),
        created_at_utc: format_timestamp(item.created_at),
        destination: item.destination.clone(),
        direction: item.direction.clone(),
        dispatch_claimed: item.claim.is_some(),
        enqueue_seq: item.seq,
        error_code: item.error_code.clone(),
        failure_class: item.failure_class.map(|c| c.as_str().to_owned()),
        grant_id: item.grant_id.clone(),
        idempotency_key: item.idempotency_key.clone(),
        lane: item.lane.clone(),
        last_audit_id: item.last_audit_id.clone(),
        maybe_sent_at_utc: time(item.maybe_sent_at),
        next_attempt_at_utc: time(item.next_attempt_at),
        risk_class: item.risk_class.clone(),
        sent_at_utc: time(item.sent_at),
        state: item.state.as_str().to_owned(),
        transport_ref: item.transport_ref.clone(),
        updated_at_utc: format_timestamp(item.updated_at),
    }
}

fn item_from_disk(path: &Path, place: &str, raw: ItemV1) -> Result<OutboxItem> {
    let at = |field: &str| format!("{place} (key {:?}) field {field}", raw.idempotency_key);
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
    let cooldown_until = optional_time("cooldown_until_utc", &raw.cooldown_until_utc)?;
    let maybe_sent_at = optional_time("maybe_sent_at_utc", &raw.maybe_sent_at_utc)?;
    let failure_class = raw
        .failure_class
        .as_deref()
        .map(|text| {
            crate::send::FailureClass::parse(text).ok_or_else(|| {
                invalid(
                    path,
                    at("failure_class"),
                    format!("{text:?} is not one of retryable, permanent, ambiguous"),
                )
            })
        })
        .transpose()?;
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
        cooldown_until,
        maybe_sent_at,
        failure_class,
        seq: raw.enqueue_seq,
    })
}

fn settings_to_disk(stored: &Stored) -> SettingsV1 {
    let cap = |cap: &RateLimit| CapV1 {
        count: cap.count,
        window: cap.window,
    };
    SettingsV1 {
        rate_limit: stored.rate_limit.as_ref().map(cap),
        rate_limit_for: stored.rate_limit_for.as_ref().map(|overrides| {
            overrides
                .iter()
                .map(|(pattern, cap)| PatternCapV1 {
                    pattern: pattern.clone(),
                    count: cap.count,
                    window: cap.window,
                })
                .collect()
        }),
        global_rate_limit: stored.global_rate_limit.as_ref().map(cap),
        history_after: stored.history_after,
        history_retention: stored.history_retention.map(|retention| match retention {
            Retention::KeepAll => RetentionV1::KeepAll,
            Retention::MaxAge(age) => RetentionV1::MaxAge(age),
            Retention::MaxSegments(n) => RetentionV1::MaxSegments(n as u64),
        }),
        max_attempts: stored.max_attempts,
        backoff: stored.backoff.as_ref().map(|backoff| match backoff {
            Backoff::Fixed(delays) => BackoffV1::Fixed(delays.clone()),
            Backoff::Exponential { base, cap, jitter } => BackoffV1::Exponential {
                base: *base,
                cap: *cap,
                jitter: *jitter,
            },
        }),
        give_up_after: stored.give_up_after,
        ordering: stored.ordering.map(|o| o.as_str().to_owned()),
    }
}

/// Converts and validates stored settings read at `place` in `path`.
fn settings_from_disk(path: &Path, place: &str, raw: SettingsV1) -> Result<Stored> {
    let cap = |cap: CapV1| RateLimit {
        count: cap.count,
        window: cap.window,
    };
    let stored = Stored {
        rate_limit: raw.rate_limit.map(cap),
        rate_limit_for: raw.rate_limit_for.map(|overrides| {
            overrides
                .into_iter()
                .map(|o| {
                    (
                        o.pattern,
                        RateLimit {
                            count: o.count,
                            window: o.window,
                        },
                    )
                })
                .collect()
        }),
        global_rate_limit: raw.global_rate_limit.map(cap),
        history_after: raw.history_after,
        history_retention: raw
            .history_retention
            .map(|retention| match retention {
                RetentionV1::KeepAll => Ok(Retention::KeepAll),
                RetentionV1::MaxAge(age) => Ok(Retention::MaxAge(age)),
                RetentionV1::MaxSegments(n) => {
                    usize::try_from(n).map(Retention::MaxSegments).map_err(|_| {
                        invalid(path, format!("{place} history_retention"), "out of range")
                    })
                }
            })
            .transpose()?,
        max_attempts: raw.max_attempts,
        backoff: raw.backoff.map(|backoff| match backoff {
            BackoffV1::Fixed(delays) => Backoff::Fixed(delays),
            BackoffV1::Exponential { base, cap, jitter } => {
                Backoff::Exponential { base, cap, jitter }
            }
        }),
        give_up_after: raw.give_up_after,
        ordering: raw
            .ordering
            .map(|name| {
                crate::order::Ordering::parse(&name).ok_or_else(|| {
                    invalid(
                        path,
                        format!("{place} ordering"),
                        format!("{name:?} is not per_destination or unordered"),
                    )
                })
            })
            .transpose()?,
    };
    stored.validate().map_err(|e| match e {
        Error::InvalidConfig { setting, reason } => {
            invalid(path, format!("{place} {setting}"), reason)
        }
        other => other,
    })?;
    Ok(stored)
}

#[cfg(test)]
mod tests;
