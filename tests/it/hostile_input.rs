//! Hostile input never panics the outbox, never corrupts what is on disk, and is
//! never stored raw or unbounded (brief §7).
//!
//! - Loaders: arbitrary bytes and mutations of a valid snapshot (`outbox.json`),
//!   journal (`outbox.journal`) and audit log (`audit.jsonl`): flipped bytes,
//!   truncation, inserted garbage, duplicated, reordered or deleted entries, values
//!   of the wrong type (in the journal also with a recomputed checksum).
//!   `Outbox::open`, an enqueue through a handle opened before the damage, and
//!   `AuditLog::verify`/`read`/`records` either succeed or return a typed error; a
//!   file that produced an error is left as it was (the one change allowed is a
//!   torn tail moved, byte for byte, into a quarantine file); edits to the audit
//!   chain are detected; an accepted journal lost no acknowledged change.
//! - Caller text: every `NewMessage` field is checked against its documented limit
//!   with the first bad field named and nothing written; transport references and
//!   error codes returned by `send` are stored without control characters and cut
//!   to `limits::TRANSPORT_REF` bytes; a `retry_after` or setting too large for
//!   the calendar is not a panic.
//! - Symlinks planted in the outbox directory are never written through.
//!
//! Cases: `OUTBOX_PROPTEST_CASES` (default 128 per property); replay: `OUTBOX_PROPTEST_SEED`.
//!
//! File-only by design for the loaders and symlinks (damaged files); the
//! caller-text bounds are checked on both engines in `bad_input`.

use std::any::Any;
use std::collections::BTreeSet;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;

use durable_outbox::{
    AuditLog, Backoff, DEFAULT_DIRECTION, DEFAULT_LANE, Error, ItemState, ManualClock, NewMessage,
    Outbox, OutboxItem, Outcome, SendError, limits,
};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::TestCaseError;
use sha2::{Digest, Sha256};

use crate::harness::{START, builder, msg, secs};
use crate::seeded::{self, ensure};

const CASES: u32 = 128;
const STATE: &str = "outbox.json";
const JOURNAL: &str = "outbox.journal";
const AUDIT: &str = "audit.jsonl";
const FILES: [&str; 3] = [STATE, JOURNAL, AUDIT];

type Check = Result<(), TestCaseError>;

// ----- helpers ----------------------------------------------------------------

fn panic_text(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "<non-text panic>".to_owned())
}

/// Runs `f`, turning a panic into a failure that names `what`.
fn no_panic<T>(what: &str, f: impl FnOnce() -> T) -> Result<T, TestCaseError> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        TestCaseError::fail(format!(
            "no-panic broken: {what} panicked: {}",
            panic_text(payload.as_ref())
        ))
    })
}

/// The errors a damaged file may produce: typed, with a path and a position.
fn is_typed_load_error(error: &Error) -> bool {
    matches!(
        error,
        Error::Corrupt { .. }
            | Error::InvalidRecord { .. }
            | Error::UnsupportedVersion { .. }
            | Error::AuditBroken { .. }
    )
}

fn typed<T: std::fmt::Debug>(what: &str, result: &Result<T, Error>) -> Check {
    match result {
        Err(e) if !is_typed_load_error(e) => Err(TestCaseError::fail(format!(
            "typed-error broken: {what} returned {e:?}, not Corrupt/InvalidRecord/UnsupportedVersion/AuditBroken"
        ))),
        _ => Ok(()),
    }
}

fn read(dir: &Path, name: &str) -> Option<Vec<u8>> {
    std::fs::read(dir.join(name)).ok()
}

/// Every file name in `dir` (not recursive).
fn names(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .expect("read dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect()
}

/// The three files of an outbox, each possibly absent.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Files([Option<Vec<u8>>; 3]);

impl Files {
    fn read(dir: &Path) -> Self {
        Self(FILES.map(|name| read(dir, name)))
    }

    fn write(&self, dir: &Path) {
        for (name, bytes) in FILES.iter().zip(&self.0) {
            if let Some(bytes) = bytes {
                std::fs::write(dir.join(name), bytes).expect("write outbox file");
            }
        }
    }

    fn get(&self, name: &str) -> Option<&[u8]> {
        let i = FILES.iter().position(|n| *n == name).expect("known file");
        self.0[i].as_deref()
    }

    fn with(&self, name: &str, bytes: Vec<u8>) -> Self {
        let mut files = self.clone();
        let i = FILES.iter().position(|n| *n == name).expect("known file");
        files.0[i] = Some(bytes);
        files
    }

    /// A fresh directory holding these files.
    fn materialize(&self) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("temp dir");
        self.write(dir.path());
        dir
    }
}

/// Whether `is` is `was` with `torn` (a tail, now in a quarantine file) either cut
/// off or overwritten with zeros in place.
fn tail_set_aside(was: &[u8], is: &[u8], torn: &[u8]) -> bool {
    if torn.is_empty() || !was.ends_with(torn) && was.len() != is.len() {
        return false;
    }
    if is.len() + torn.len() == was.len() {
        return was.starts_with(is) && was.ends_with(torn);
    }
    let Some(at) = was.iter().zip(is).position(|(a, b)| a != b) else {
        return false;
    };
    let end = at + torn.len();
    was.len() == is.len()
        && end <= was.len()
        && was[at..end] == *torn
        && is[at..end].iter().all(|b| *b == 0)
        && was[end..] == is[end..]
}

/// After an operation that failed, every file is as `expected`, except that a torn
/// tail of the journal or the log may have been set aside, byte for byte, into a
/// new `<file>.torn-*` quarantine file. (Strict equality is demanded by
/// `a_failed_open_leaves_the_audit_log_and_journal_byte_for_byte_unchanged`.)
fn untouched_after_error(
    dir: &Path,
    before_names: &BTreeSet<String>,
    expected: &Files,
    error: &Error,
) -> Check {
    let now = Files::read(dir);
    for name in FILES {
        let (was, is) = (expected.get(name), now.get(name));
        if was == is {
            continue;
        }
        let torn: Vec<u8> = names(dir)
            .difference(before_names)
            .filter(|n| n.starts_with(&format!("{name}.torn-")))
            .flat_map(|n| read(dir, n).unwrap_or_default())
            .collect();
        let (was, is) = (was.unwrap_or_default(), is.unwrap_or_default());
        ensure(name != STATE && tail_set_aside(was, is, &torn), || {
            format!(
                "damaged-file-untouched broken: the call failed ({error}) but {name} changed \
                 ({} bytes before, {} after, {} quarantined) beyond setting a torn tail aside",
                was.len(),
                is.len(),
                torn.len()
            )
        })?;
    }
    Ok(())
}

fn clock() -> ManualClock {
    ManualClock::at(START).expect("start time")
}

fn open_in(dir: &Path) -> Result<Outbox, Error> {
    builder(dir, &clock()).rate_limit(1, secs(60)).open()
}

// ----- a valid outbox to damage ----------------------------------------------------

/// Fills `outbox` with an item in every state through the public API.
fn populate(outbox: &Outbox) {
    let mut labelled = msg("a-sent", "chat-1");
    labelled.lane = Some("lane-x".into());
    labelled.risk_class = Some("low".into());
    outbox.enqueue(labelled).expect("enqueue");
    outbox.enqueue(msg("b-capped", "chat-1")).expect("enqueue");
    let mut unicode = msg("c-failed", "chat-2");
    unicode.content = "héllo ✓ \"quoted\"\n\ttabbed \u{1F600}".into();
    outbox.enqueue(unicode).expect("enqueue");
    outbox
        .enqueue(msg("d-retrying", "chat-3"))
        .expect("enqueue");
    outbox.enqueue(msg("e-queued", "chat-4")).expect("enqueue");
    outbox
        .process("a-sent", |_| Ok(Some("tr-a".into())))
        .expect("send");
    outbox
        .process("b-capped", |_| panic!("over the cap"))
        .expect("defer");
    outbox
        .process("c-failed", |_| Err(SendError::permanent("chat_not_found")))
        .expect("fail");
    outbox
        .process("d-retrying", |_| {
            Err(SendError::retryable("http_429").retry_after(secs(30)))
        })
        .expect("retry later");
}

/// A populated outbox in `dir`, still open; with `compacted`, folded into the snapshot.
fn build(dir: &Path, compacted: bool) -> Outbox {
    let outbox = open_in(dir).expect("open");
    populate(&outbox);
    if compacted {
        outbox.compact().expect("compact");
    }
    outbox
}

struct Template {
    /// Every change folded into `outbox.json`; the journal holds only its header.
    compacted: Files,
    /// No snapshot: every change is in `outbox.journal`.
    journaled: Files,
    /// The items, as the outbox reports them.
    items: Vec<OutboxItem>,
}

/// Both layouts of one populated outbox, built once.
fn template() -> &'static Template {
    static TEMPLATE: OnceLock<Template> = OnceLock::new();
    TEMPLATE.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temp dir");
        let outbox = build(dir.path(), false);
        // Journals are preallocated with zeros; keep the lines and a short zero run,
        // so damage lands where it matters and copies stay small.
        let trimmed = |files: Files| {
            let journal = files.get(JOURNAL).expect("journal");
            let end = journal.iter().rposition(|b| *b == b'\n').expect("a header") + 1;
            files.with(JOURNAL, [&journal[..end], &[0u8; 64][..]].concat())
        };
        let journaled = trimmed(Files::read(dir.path()));
        outbox.compact().expect("compact");
        let compacted = trimmed(Files::read(dir.path()));
        assert!(
            journaled.get(STATE).is_none() && compacted.get(STATE).is_some(),
            "the template needs both layouts"
        );
        Template {
            compacted,
            journaled,
            items: outbox.list_items().expect("items"),
        }
    })
}

// ----- damage -----------------------------------------------------------------------

/// A JSON value of some type, for "wrong type" edits.
#[derive(Debug, Clone)]
enum Leaf {
    Null,
    Bool(bool),
    Int(i64),
    Big(u64),
    Float(f64),
    Text(String),
    EmptyArray,
    EmptyObject,
}

impl Leaf {
    fn value(&self) -> serde_json::Value {
        match self {
            Self::Null => serde_json::Value::Null,
            Self::Bool(b) => (*b).into(),
            Self::Int(n) => (*n).into(),
            Self::Big(n) => (*n).into(),
            Self::Float(f) => (*f).into(),
            Self::Text(s) => s.clone().into(),
            Self::EmptyArray => serde_json::json!([]),
            Self::EmptyObject => serde_json::json!({}),
        }
    }
}

fn leaf() -> impl Strategy<Value = Leaf> {
    prop_oneof![
        Just(Leaf::Null),
        any::<bool>().prop_map(Leaf::Bool),
        prop_oneof![Just(-1i64), Just(0), Just(1), Just(i64::MAX), any::<i64>()]
            .prop_map(Leaf::Int),
        prop_oneof![Just(u64::from(u32::MAX) + 1), Just(u64::MAX)].prop_map(Leaf::Big),
        prop_oneof![Just(1.5f64), Just(-0.0), Just(1e300)].prop_map(Leaf::Float),
        prop::sample::select(vec![
            String::new(),
            " ".into(),
            "queued".into(),
            "sent".into(),
            "failed".into(),
            "teleported".into(),
            "2026-01-15T09:00:00Z".into(),
            "yesterday".into(),
            "a-sent".into(),
            "999999-dead-0".into(),
            "../../etc/passwd".into(),
            "nul\u{0}inside".into(),
            "x".repeat(70_000),
        ])
        .prop_map(Leaf::Text),
        Just(Leaf::EmptyArray),
        Just(Leaf::EmptyObject),
    ]
}

const ITEM_FIELDS: [&str; 22] = [
    "attempts",
    "claim_owner",
    "claimed_at_utc",
    "connector",
    "content",
    "content_hash",
    "created_at_utc",
    "destination",
    "direction",
    "dispatch_claimed",
    "error_code",
    "grant_id",
    "idempotency_key",
    "lane",
    "last_audit_id",
    "next_attempt_at_utc",
    "risk_class",
    "sent_at_utc",
    "state",
    "transport_ref",
    "updated_at_utc",
    "unknown_field",
];
const TOP_FIELDS: [&str; 6] = [
    "version",
    "audit_head",
    "generation",
    "pending_audit",
    "items",
    "unknown",
];
const RECORD_FIELDS: [&str; 8] = [
    "seq",
    "hash",
    "prev_hash",
    "outcome",
    "attempts",
    "idempotency_key",
    "reconciled",
    "unknown",
];

/// Byte-level damage, the same for every file.
#[derive(Debug, Clone)]
enum Bytes {
    Flip { at: Index, mask: u8 },
    Truncate { at: Index },
    Insert { at: Index, garbage: Vec<u8> },
}

fn bytes_damage() -> impl Strategy<Value = Bytes> {
    let garbage = prop_oneof![
        prop::collection::vec(any::<u8>(), 1..24),
        prop::sample::select(vec![
            b"\n".to_vec(),
            b"\0\0\0\0".to_vec(),
            b"{}".to_vec(),
            b"]".to_vec(),
            b"\"".to_vec(),
            b",".to_vec(),
            b"\xff\xfe".to_vec(),
        ]),
    ];
    prop_oneof![
        (any::<Index>(), 1..=255u8).prop_map(|(at, mask)| Bytes::Flip { at, mask }),
        any::<Index>().prop_map(|at| Bytes::Truncate { at }),
        (any::<Index>(), garbage).prop_map(|(at, garbage)| Bytes::Insert { at, garbage }),
    ]
}

impl Bytes {
    fn apply(&self, original: &[u8]) -> Vec<u8> {
        let mut out = original.to_vec();
        match self {
            Self::Flip { at, mask } => out[at.index(original.len())] ^= mask,
            Self::Truncate { at } => out.truncate(at.index(original.len())),
            Self::Insert { at, garbage } => {
                let at = at.index(original.len() + 1);
                out.splice(at..at, garbage.iter().copied());
            }
        }
        out
    }
}

/// Damage to `outbox.json`.
#[derive(Debug, Clone)]
enum StateDamage {
    Bytes(Bytes),
    DuplicateItem(Index),
    WrongType {
        item: Index,
        field: &'static str,
        value: Leaf,
    },
    RemoveField {
        item: Index,
        field: &'static str,
    },
    TopLevel {
        field: &'static str,
        value: Leaf,
    },
}

fn state_damage() -> impl Strategy<Value = StateDamage> {
    let field = prop::sample::select(ITEM_FIELDS.to_vec());
    prop_oneof![
        3 => bytes_damage().prop_map(StateDamage::Bytes),
        1 => any::<Index>().prop_map(StateDamage::DuplicateItem),
        3 => (any::<Index>(), field.clone(), leaf())
            .prop_map(|(item, field, value)| StateDamage::WrongType { item, field, value }),
        1 => (any::<Index>(), field).prop_map(|(item, field)| StateDamage::RemoveField { item, field }),
        1 => (prop::sample::select(TOP_FIELDS.to_vec()), leaf())
            .prop_map(|(field, value)| StateDamage::TopLevel { field, value }),
    ]
}

impl StateDamage {
    fn apply(&self, original: &[u8]) -> Vec<u8> {
        let mut state: serde_json::Value = serde_json::from_slice(original).expect("valid");
        let items = state["items"].as_array_mut().expect("items");
        match self {
            Self::Bytes(bytes) => return bytes.apply(original),
            Self::DuplicateItem(index) => {
                let copy = items[index.index(items.len())].clone();
                items.push(copy);
            }
            Self::WrongType { item, field, value } => {
                let n = items.len();
                items[item.index(n)][*field] = value.value();
            }
            Self::RemoveField { item, field } => {
                let n = items.len();
                items[item.index(n)]
                    .as_object_mut()
                    .expect("object")
                    .remove(*field);
            }
            Self::TopLevel { field, value } => state[*field] = value.value(),
        }
        serde_json::to_vec_pretty(&state).expect("serialise")
    }
}

/// Damage to a line-oriented file: the journal or the audit log.
#[derive(Debug, Clone)]
enum LineDamage {
    Bytes(Bytes),
    DuplicateLine(Index),
    SwapLines(Index, Index),
    DeleteLine(Index),
    /// Set a field of one line's JSON to a value of another type (for the journal:
    /// a field of the entry's first item, or of the header or entry itself).
    WrongType {
        line: Index,
        field: &'static str,
        value: Leaf,
    },
    Append(Vec<u8>),
}

fn line_damage(fields: Vec<&'static str>) -> impl Strategy<Value = LineDamage> {
    prop_oneof![
        4 => bytes_damage().prop_map(LineDamage::Bytes),
        1 => any::<Index>().prop_map(LineDamage::DuplicateLine),
        1 => (any::<Index>(), any::<Index>()).prop_map(|(a, b)| LineDamage::SwapLines(a, b)),
        1 => any::<Index>().prop_map(LineDamage::DeleteLine),
        3 => (any::<Index>(), prop::sample::select(fields), leaf())
            .prop_map(|(line, field, value)| LineDamage::WrongType { line, field, value }),
        1 => prop::collection::vec(any::<u8>(), 1..64).prop_map(LineDamage::Append),
    ]
}

/// The journal's line checksum (documented in `store::journal`): the first 64 bits
/// of the SHA-256 of the JSON, in hex.
fn seal_journal_line(json: &str) -> String {
    format!(
        "{} {json}",
        hex::encode(&Sha256::digest(json.as_bytes())[..8])
    )
}

impl LineDamage {
    /// Damages `original`; `journal` lines carry a checksum, recomputed after an edit.
    fn apply(&self, original: &[u8], journal: bool) -> Vec<u8> {
        let text = std::str::from_utf8(original).expect("utf-8 file");
        let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
        let n = lines.len();
        match self {
            Self::Bytes(bytes) => return bytes.apply(original),
            Self::Append(garbage) => return [original, garbage].concat(),
            Self::DuplicateLine(i) => {
                let i = i.index(n);
                lines.insert(i, lines[i].clone());
            }
            Self::SwapLines(a, b) => lines.swap(a.index(n), b.index(n)),
            Self::DeleteLine(i) => {
                lines.remove(i.index(n));
            }
            Self::WrongType { line, field, value } => {
                // Only lines that hold JSON (not the journal's zero padding).
                fn json_of(l: &str, journal: bool) -> Option<&str> {
                    if journal { l.get(17..) } else { Some(l) }
                }
                let candidates: Vec<usize> = (0..n)
                    .filter(|i| {
                        json_of(&lines[*i], journal)
                            .is_some_and(|j| serde_json::from_str::<serde_json::Value>(j).is_ok())
                    })
                    .collect();
                if candidates.is_empty() {
                    return original.to_vec();
                }
                let i = candidates[line.index(candidates.len())];
                let json = json_of(&lines[i], journal).expect("checked above");
                let mut record: serde_json::Value = serde_json::from_str(json).expect("JSON");
                match record.get_mut("items").and_then(|items| items.get_mut(0)) {
                    Some(item) if journal && ITEM_FIELDS.contains(field) => {
                        item[*field] = value.value();
                    }
                    _ => record[*field] = value.value(),
                }
                let json = serde_json::to_string(&record).expect("serialise");
                lines[i] = if journal {
                    seal_journal_line(&json)
                } else {
                    json
                };
            }
        }
        lines
            .iter()
            .flat_map(|l| [l.as_bytes(), b"\n"])
            .flatten()
            .copied()
            .collect()
    }
}

// ----- properties: the loaders --------------------------------------------------

/// Arbitrary JSON-ish documents: random values under the real field names.
fn json_document() -> impl Strategy<Value = Vec<u8>> {
    let item = prop::collection::btree_map(
        prop::sample::select(ITEM_FIELDS.to_vec()).prop_map(str::to_owned),
        leaf().prop_map(|l| l.value()),
        0..ITEM_FIELDS.len(),
    );
    (
        prop_oneof![Just(1u64), Just(2), Just(3), any::<u64>()],
        prop::collection::vec(item, 0..3),
        any::<bool>(),
    )
        .prop_map(|(version, items, with_head)| {
            let mut doc = serde_json::json!({ "version": version, "items": items });
            if with_head {
                doc["audit_head"] = serde_json::json!({ "seq": 3, "hash": "00" });
            }
            serde_json::to_vec(&doc).expect("serialise")
        })
}

/// Opens a fresh handle on `dir`, which holds `files`: an error must be typed and
/// leave every file as it was. Returns the error, if the files were refused.
fn open_damaged(dir: &Path, files: &Files) -> Result<Option<Error>, TestCaseError> {
    let before = names(dir);
    let result = no_panic("Outbox::open on damaged files", || open_in(dir))?;
    typed("Outbox::open", &result)?;
    match result {
        Err(e) => {
            untouched_after_error(dir, &before, files, &e)?;
            ensure(
                !names(dir).iter().any(|n| n.starts_with(".outbox-tmp-")),
                || "no-temp-leftovers broken: a failed open left a temp file".into(),
            )?;
            Ok(Some(e))
        }
        Ok(outbox) => {
            let listed = no_panic("list_items on accepted files", || outbox.list_items())?;
            typed("list_items", &listed)?;
            Ok(None)
        }
    }
}

/// Damages `name` under a handle that is already open, then enqueues through it:
/// no panic, a typed error or success, and after an error every file as it was.
/// Where the handle that sees the damage comes from.
#[derive(Clone, Copy)]
enum Older {
    /// Opened on a copy of the compacted template (cheap).
    OnCompacted,
    /// The handle that wrote every journal entry itself.
    Writer,
}

/// Damages `name` under a handle that is already open, then enqueues through it:
/// no panic, a typed error or success, and after an error every file as it was.
fn enqueue_through_an_older_handle(
    older: Older,
    name: &str,
    damage: impl Fn(&[u8]) -> Vec<u8>,
) -> Result<Result<(), Error>, TestCaseError> {
    let dir = match older {
        Older::OnCompacted => template().compacted.materialize(),
        Older::Writer => tempfile::tempdir().expect("temp dir"),
    };
    let old = match older {
        Older::OnCompacted => open_in(dir.path()).expect("open the intact outbox"),
        Older::Writer => build(dir.path(), false),
    };
    let intact = read(dir.path(), name).expect("file to damage");
    let damaged = damage(&intact);
    std::fs::write(dir.path().join(name), &damaged).expect("damage");
    let files = Files::read(dir.path());
    let before = names(dir.path());
    let result = no_panic("enqueue through a handle opened before the damage", || {
        old.enqueue(msg("z-new", "chat-9")).map(|_| ())
    })?;
    typed("enqueue after damage", &result)?;
    if let Err(e) = &result {
        untouched_after_error(dir.path(), &before, &files, e)?;
    }
    Ok(result)
}

#[test]
fn arbitrary_bytes_as_a_snapshot_or_journal_give_a_typed_error_and_stay_untouched() {
    let strategy = (
        prop_oneof![
            prop::collection::vec(any::<u8>(), 0..256),
            json_document(),
            json_document().prop_map(|doc| {
                let json = String::from_utf8(doc).expect("utf-8");
                format!("{}\n", seal_journal_line(&json)).into_bytes()
            }),
        ],
        any::<bool>(),
    );
    seeded::check(
        "arbitrary_bytes_as_snapshot_or_journal",
        CASES,
        &strategy,
        |(bytes, as_journal)| {
            let name = if as_journal { JOURNAL } else { STATE };
            let files = Files([None, None, None]).with(name, bytes);
            let dir = files.materialize();
            open_damaged(dir.path(), &files).map(|_| ())
        },
    );
}

#[test]
fn a_damaged_snapshot_gives_a_typed_error_and_stays_untouched() {
    seeded::check("damaged_snapshot", CASES, &state_damage(), |damage| {
        let t = template();
        let intact = t.compacted.get(STATE).expect("snapshot");
        let damaged = damage.apply(intact);
        if damaged == intact {
            return Ok(());
        }
        // A fresh open decides whether the damaged file is acceptable.
        let files = t.compacted.with(STATE, damaged);
        let dir = files.materialize();
        let refused = open_damaged(dir.path(), &files)?;
        if let StateDamage::DuplicateItem(_) = damage {
            ensure(matches!(refused, Some(Error::InvalidRecord { .. })), || {
                format!(
                    "never-silently-dropped broken: a duplicated item opened as {refused:?}, not InvalidRecord"
                )
            })?;
        }
        // An older handle must refuse what open refuses, and leave every file as it was.
        let result =
            enqueue_through_an_older_handle(Older::OnCompacted, STATE, |b| damage.apply(b))?;
        if let Some(refusal) = &refused {
            ensure(result.is_err(), || {
                format!(
                    "damaged-file-untouched broken: open refuses this outbox.json ({refusal}), \
                     but an enqueue through an older handle accepted it"
                )
            })?;
        }
        Ok(())
    });
}

#[test]
fn a_damaged_journal_gives_a_typed_error_or_loses_no_acknowledged_change() {
    let mut fields = ITEM_FIELDS.to_vec();
    fields.extend(["seq", "journal", "generation", "audit"]);
    seeded::check("damaged_journal", CASES, &line_damage(fields), |damage| {
        let t = template();
        let intact = t.journaled.get(JOURNAL).expect("journal");
        let damaged = damage.apply(intact, true);
        if damaged == intact {
            return Ok(());
        }
        let files = t.journaled.with(JOURNAL, damaged);
        let dir = files.materialize();
        let refused = open_damaged(dir.path(), &files)?;
        let resealed = matches!(damage, LineDamage::WrongType { .. });
        if refused.is_none() && !resealed {
            // Without a valid checksum nothing new can enter; nothing acknowledged may leave.
            let outbox = open_in(dir.path()).expect("reopen");
            let items = outbox.list_items().expect("items");
            ensure(items == t.items, || {
                format!(
                    "nothing-lost broken: the damaged journal was accepted but the items differ:\n  now: {items:#?}\n  were: {:#?}",
                    t.items
                )
            })?;
        }
        Ok(())
    });
}

#[test]
fn a_journal_damaged_under_its_writer_gives_a_typed_error_and_stays_untouched() {
    // Each case builds its outbox through the public API (journal preallocation
    // included), so this property runs fewer cases.
    let cases = seeded::env_u64("OUTBOX_PROPTEST_CASES").map_or(24, |n| (n / 4).max(1) as u32);
    let mut fields = ITEM_FIELDS.to_vec();
    fields.extend(["seq", "journal", "generation", "audit"]);
    seeded::check_cases(
        "journal_damaged_under_its_writer",
        cases,
        &line_damage(fields),
        |damage| {
            enqueue_through_an_older_handle(Older::Writer, JOURNAL, |b| {
                // Damage the lines, keep the preallocated zeros after them.
                let end = b.iter().rposition(|x| *x == b'\n').map_or(0, |i| i + 1);
                [damage.apply(&b[..end], true), b[end..].to_vec()].concat()
            })
            .map(|_| ())
        },
    );
}

#[test]
fn a_damaged_audit_log_is_detected_or_repaired_and_never_loses_bytes() {
    let strategy = (line_damage(RECORD_FIELDS.to_vec()), any::<bool>());
    seeded::check(
        "damaged_audit_log",
        CASES,
        &strategy,
        |(damage, compacted)| {
            let t = template();
            let layout = if compacted {
                &t.compacted
            } else {
                &t.journaled
            };
            let intact = layout.get(AUDIT).expect("audit log");
            let damaged = damage.apply(intact, false);
            if damaged == intact {
                return Ok(());
            }
            let files = layout.with(AUDIT, damaged.clone());
            let dir = files.materialize();
            let path = dir.path().join(AUDIT);

            // The read-only verifier: typed results, file untouched, edits detected.
            let verified = no_panic("AuditLog::verify", || AuditLog::verify(&path))?;
            typed("AuditLog::verify", &verified)?;
            let read_back = no_panic("AuditLog::read", || AuditLog::read(&path))?;
            typed("AuditLog::read", &read_back)?;
            let streamed = no_panic("AuditLog::records", || {
                AuditLog::records(&path)
                    .map(|records| records.filter_map(Result::err).collect::<Vec<_>>())
            })?;
            typed("AuditLog::records", &streamed)?;
            for e in streamed.iter().flatten() {
                ensure(is_typed_load_error(e), || {
                    format!("typed-error broken: AuditLog::records yielded {e:?}")
                })?;
            }
            ensure(
                read(dir.path(), AUDIT).as_deref() == Some(&damaged[..]),
                || "read-only broken: AuditLog::verify, read or records changed the file".into(),
            )?;
            if !intact.starts_with(&damaged) {
                // Not a clean cut of the original: the chain must notice, at worst as a torn tail.
                ensure(
                    verified.as_ref().map_or(true, |r| r.torn_tail_bytes > 0),
                    || {
                        format!(
                            "chain-detects-edits broken: AuditLog::verify accepted {damage:?} as {verified:?}"
                        )
                    },
                )?;
            }

            // Opening the outbox: a typed error with every file as it was, or a log that
            // kept every byte it had (a torn tail quarantined) and verifies.
            let before = names(dir.path());
            if open_damaged(dir.path(), &files)?.is_none() {
                let now = read(dir.path(), AUDIT).unwrap_or_default();
                let torn: Vec<u8> = names(dir.path())
                    .difference(&before)
                    .filter(|n| n.starts_with("audit.jsonl.torn-"))
                    .flat_map(|n| read(dir.path(), n).unwrap_or_default())
                    .collect();
                let kept = damaged.len().saturating_sub(torn.len());
                ensure(
                    damaged[kept..] == torn[..] && now.starts_with(&damaged[..kept]),
                    || {
                        "nothing-lost broken: open accepted the log but its bytes are neither kept nor quarantined".into()
                    },
                )?;
                let outbox = open_in(dir.path()).expect("reopen");
                let report = no_panic("verify_audit after open", || outbox.verify_audit())?;
                // Opening re-verifies only what was written since the last
                // compaction (so it stays fast with years of history); damage to
                // the part a compaction already verified is for the full
                // verification to find, and it must.
                let found_by_full_verify =
                    compacted && matches!(report, Err(durable_outbox::Error::AuditBroken { .. }));
                ensure(report.is_ok() || found_by_full_verify, || {
                    format!("audit-chain broken: the log open accepted does not verify: {report:?}")
                })?;
                if !compacted && intact.starts_with(&damaged) {
                    // A cut log is completed from the journal, byte for byte.
                    ensure(now == intact, || {
                        "repair broken: the records a cut removed were not re-appended exactly"
                            .into()
                    })?;
                }
            }

            enqueue_through_an_older_handle(Older::OnCompacted, AUDIT, |b| damage.apply(b, false))
                .map(|_| ())
        },
    );
}

#[test]
fn a_failed_open_leaves_the_audit_log_and_journal_byte_for_byte_unchanged() {
    // Damage that no crash produces, so the open must fail, and it must fail
    // without first cutting (or zeroing) a "torn tail" and moving it aside:
    // - the log: its last record is gone and the one before it is cut in the
    //   middle, and the journal cannot restore them (it was compacted);
    // - the journal: cut in the middle of an early entry whose audit records the
    //   log already holds (a crash never leaves the log ahead of the journal).
    let t = template();
    let cut_in_line = |bytes: &[u8], from_end: usize| {
        let newlines: Vec<usize> = (0..bytes.len()).filter(|i| bytes[*i] == b'\n').collect();
        bytes[..newlines[newlines.len() - from_end] + 20].to_vec()
    };
    let journal = t.journaled.get(JOURNAL).expect("journal");
    let cases = [
        (
            AUDIT,
            t.compacted
                .with(AUDIT, cut_in_line(t.compacted.get(AUDIT).expect("log"), 3)),
        ),
        (JOURNAL, t.journaled.with(JOURNAL, cut_in_line(journal, 8))),
    ];
    let mut broken = Vec::new();
    for (name, files) in cases {
        let dir = files.materialize();
        let Err(err) = open_in(dir.path()) else {
            broken.push(format!("{name}: damage that no crash leaves was accepted"));
            continue;
        };
        let now = read(dir.path(), name);
        if now.as_deref() != files.get(name) {
            broken.push(format!(
                "{name}: Outbox::open failed ({err}) but had already changed {name} ({} bytes \
                 before, {} after) and set bytes aside in {:?}",
                files.get(name).map_or(0, <[u8]>::len),
                now.map_or(0, |b| b.len()),
                names(dir.path())
                    .iter()
                    .filter(|n| n.contains(".torn-"))
                    .collect::<Vec<_>>()
            ));
        }
    }
    assert!(
        broken.is_empty(),
        "damaged-file-untouched broken:\n  {}",
        broken.join("\n  ")
    );
}

#[test]
fn a_truncated_audit_log_is_reported_at_a_real_line() {
    // `AuditBroken::line` is documented as 1-based: 0 is not a position.
    let t = template();
    let audit = t.compacted.get(AUDIT).expect("audit");
    let newlines: Vec<usize> = (0..audit.len()).filter(|i| audit[*i] == b'\n').collect();
    for keep_lines in [0, 1, newlines.len() - 2] {
        let cut = if keep_lines == 0 {
            0
        } else {
            newlines[keep_lines - 1] + 1
        };
        let dir = t.compacted.with(AUDIT, audit[..cut].to_vec()).materialize();
        match open_in(dir.path()) {
            Err(Error::AuditBroken { line, fault, .. }) => assert!(
                (1..=keep_lines as u64 + 1).contains(&line),
                "error-position broken: a log cut to {keep_lines} whole records is reported at \
                 line {line} ({fault}); expected a line in 1..={}",
                keep_lines + 1
            ),
            other => panic!(
                "truncation-detected broken: a log cut to {keep_lines} records opened as {other:?}"
            ),
        }
    }
}

// ----- properties: caller text ------------------------------------------------------

/// A field value, some of them sized relative to the field's own limit.
#[derive(Debug, Clone)]
enum Text {
    Literal(String),
    /// `unit` repeated to about `limit + delta` bytes.
    Sized {
        unit: &'static str,
        delta: i64,
    },
}

impl Text {
    fn render(&self, limit: usize) -> String {
        match self {
            Self::Literal(s) => s.clone(),
            Self::Sized { unit, delta } => {
                let bytes = (limit as i64 + delta).max(1) as usize;
                unit.repeat(bytes.div_ceil(unit.len()))
            }
        }
    }
}

const CONTROLS: [char; 9] = [
    '\0', '\n', '\t', '\r', '\u{7}', '\u{1b}', '\u{7f}', '\u{85}', '\u{9f}',
];

fn text() -> impl Strategy<Value = Text> {
    let word = "[a-zA-Z0-9_.:@/-]{1,20}";
    prop_oneof![
        8 => word.prop_map(Text::Literal),
        2 => any::<String>().prop_map(Text::Literal),
        1 => prop::sample::select(vec!["", " ", "\t\n", "\u{3000}", "\u{2028}"])
            .prop_map(|s| Text::Literal(s.to_owned())),
        2 => (word, prop::sample::select(CONTROLS.to_vec()), word)
            .prop_map(|(a, c, b)| Text::Literal(format!("{a}{c}{b}"))),
        2 => (prop::sample::select(vec!["k", "é", "\u{1F600}"]), -4i64..=4)
            .prop_map(|(unit, delta)| Text::Sized { unit, delta }),
    ]
}

#[derive(Debug, Clone)]
struct Fields {
    required: [Text; 5],
    labels: [Option<Text>; 3],
}

/// (field name, limit, whether control characters other than NUL are allowed)
const REQUIRED: [(&str, usize, bool); 5] = [
    ("idempotency_key", limits::IDEMPOTENCY_KEY, false),
    ("connector", limits::CONNECTOR, false),
    ("grant_id", limits::GRANT_ID, false),
    ("destination", limits::DESTINATION, false),
    ("content", limits::CONTENT, true),
];
const LABELS: [&str; 3] = ["lane", "direction", "risk_class"];

/// The documented rule: not blank, at most `limit` bytes, no NUL, and for
/// identifiers no control character at all.
fn breaks_rule(value: &str, limit: usize, body: bool) -> bool {
    value.trim().is_empty()
        || value.len() > limit
        || value.contains('\0')
        || (!body && value.chars().any(char::is_control))
}

impl Fields {
    fn message(&self) -> NewMessage {
        let r: Vec<String> = self
            .required
            .iter()
            .zip(REQUIRED)
            .map(|(t, (_, limit, _))| t.render(limit))
            .collect();
        let l: Vec<Option<String>> = self
            .labels
            .iter()
            .map(|t| t.as_ref().map(|t| t.render(limits::LABEL)))
            .collect();
        NewMessage {
            idempotency_key: r[0].clone(),
            connector: r[1].clone(),
            grant_id: r[2].clone(),
            destination: r[3].clone(),
            content: r[4].clone(),
            lane: l[0].clone(),
            direction: l[1].clone(),
            risk_class: l[2].clone(),
        }
    }

    /// The first field that breaks its rule, in declaration order.
    fn first_bad(m: &NewMessage) -> Option<&'static str> {
        let required = [
            &m.idempotency_key,
            &m.connector,
            &m.grant_id,
            &m.destination,
            &m.content,
        ];
        for (value, (name, limit, body)) in required.into_iter().zip(REQUIRED) {
            if breaks_rule(value, limit, body) {
                return Some(name);
            }
        }
        let labels = [&m.lane, &m.direction, &m.risk_class];
        labels
            .into_iter()
            .zip(LABELS)
            .find(|(value, _)| {
                value
                    .as_deref()
                    .is_some_and(|v| breaks_rule(v, limits::LABEL, false))
            })
            .map(|(_, name)| name)
    }
}

fn fields() -> impl Strategy<Value = Fields> {
    let label = || prop::option::weighted(0.3, text());
    (
        [text(), text(), text(), text(), text()],
        [label(), label(), label()],
    )
        .prop_map(|(required, labels)| Fields { required, labels })
}

/// Lookups with a message's hostile destination text as the key: no panic,
/// nothing found, nothing written.
fn hostile_lookups(outbox: &Outbox, dir: &Path, m: &NewMessage) -> Check {
    let key = &m.destination;
    if key == "existing" || *key == m.idempotency_key {
        return Ok(());
    }
    let files = (read(dir, STATE), read(dir, AUDIT));
    let lookups = no_panic("lookups with hostile text", || {
        (
            outbox.get(key).map(|i| i.is_some()),
            outbox.find_by_transport_ref(key).map(|i| i.is_some()),
            outbox.history(key).map(|h| h.len()),
            outbox
                .process(key, |_| panic!("sent an unknown key"))
                .map(|r| r.outcome),
        )
    })?;
    ensure(
        matches!(
            lookups,
            (Ok(false), Ok(false), Ok(0), Err(Error::NotFound { .. }))
        ),
        || format!("lookups of the unknown key {key:?} gave {lookups:?}"),
    )?;
    ensure((read(dir, STATE), read(dir, AUDIT)) == files, || {
        "nothing-written broken: a lookup of an unknown key changed the files".into()
    })
}

#[test]
fn every_enqueue_field_is_bounded_and_the_first_bad_one_is_named() {
    seeded::check("enqueue_field_bounds", CASES, &fields(), |fields| {
        let dir = tempfile::tempdir().expect("temp dir");
        let outbox = open_in(dir.path()).expect("open");
        outbox
            .enqueue(msg("existing", "chat-1"))
            .expect("seed item");
        let files = (read(dir.path(), STATE), read(dir.path(), AUDIT));
        let m = fields.message();
        let expected = Fields::first_bad(&m);
        let result = no_panic("enqueue", || outbox.enqueue(m.clone()))?;
        match (&result, expected) {
            (Err(Error::InvalidField { field, .. }), Some(bad)) => {
                ensure(*field == bad, || {
                    format!(
                        "field-named broken: enqueue blamed {field}, the first bad field is {bad}"
                    )
                })?;
                ensure(
                    (read(dir.path(), STATE), read(dir.path(), AUDIT)) == files,
                    || {
                        format!(
                            "nothing-written broken: a rejected enqueue ({bad}) changed the files"
                        )
                    },
                )?;
            }
            (Ok(item), None) if m.idempotency_key == "existing" => {
                ensure(item.idempotency_key() == "existing", || "wrong item".into())?;
            }
            (Ok(_), None) => {
                let stored = outbox
                    .get(&m.idempotency_key)
                    .expect("get")
                    .expect("stored");
                let round_trip = (
                    stored.connector(),
                    stored.grant_id(),
                    stored.destination(),
                    stored.content(),
                    stored.lane(),
                    stored.direction(),
                    stored.risk_class(),
                );
                let wanted = (
                    m.connector.as_str(),
                    m.grant_id.as_str(),
                    m.destination.as_str(),
                    m.content.as_str(),
                    m.lane.as_deref().unwrap_or(DEFAULT_LANE),
                    m.direction.as_deref().unwrap_or(DEFAULT_DIRECTION),
                    m.risk_class.as_deref(),
                );
                ensure(round_trip == wanted, || {
                    "round-trip broken: the stored item differs from what was enqueued".into()
                })?;
                let history = outbox.history(&m.idempotency_key).expect("history");
                ensure(
                    history.len() == 1 && history[0].destination == m.destination,
                    || {
                        format!(
                            "audit broken: expected one queued record for the key, got {history:?}"
                        )
                    },
                )?;
                outbox.verify_audit().map_err(|e| {
                    TestCaseError::fail(format!(
                        "audit-chain broken after an accepted enqueue: {e}"
                    ))
                })?;
            }
            (result, expected) => {
                return Err(TestCaseError::fail(format!(
                    "field-bounds broken: enqueue gave {result:?}, the first bad field is {expected:?}"
                )));
            }
        }
        hostile_lookups(&outbox, dir.path(), &m)
    });
}

/// Text a transport might return: any characters, controls, and lengths past the limit.
fn transport_text() -> impl Strategy<Value = String> {
    let special = prop::sample::select(vec![
        '\0',
        '\n',
        '\r',
        '\t',
        '\u{1b}',
        '\u{7f}',
        '\u{85}',
        ' ',
        'é',
        '\u{1F600}',
        '\u{202E}',
    ]);
    prop_oneof![
        any::<String>(),
        prop::collection::vec(prop_oneof![any::<char>(), special], 0..64)
            .prop_map(|c| c.into_iter().collect()),
        (
            prop::sample::select(vec!["r", "é", "\u{1F600}", "a\u{0}", " "]),
            (limits::TRANSPORT_REF / 4)..(limits::TRANSPORT_REF * 2),
        )
            .prop_map(|(unit, n)| unit.repeat(n)),
    ]
}

/// What storing `raw` must give: control characters replaced, blank becomes
/// `fallback`, and a prefix of that of at most `TRANSPORT_REF` bytes that stops
/// only where the next character would not fit.
fn check_stored(what: &str, raw: &str, stored: &str, blank_becomes: &str) -> Check {
    let mapped: String = raw
        .chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect();
    let full = if mapped.trim().is_empty() {
        blank_becomes.to_owned()
    } else {
        mapped
    };
    ensure(!stored.chars().any(char::is_control), || {
        format!("sanitized broken: {what} stored with a control character: {stored:?}")
    })?;
    ensure(stored.len() <= limits::TRANSPORT_REF, || {
        format!(
            "bounded broken: {what} stored with {} bytes, the limit is {}",
            stored.len(),
            limits::TRANSPORT_REF
        )
    })?;
    ensure(full.starts_with(stored), || {
        format!("sanitized broken: {what} stored as {stored:?}, not a prefix of {full:?}")
    })?;
    let next = full[stored.len()..].chars().next();
    ensure(
        next.is_none_or(|c| stored.len() + c.len_utf8() > limits::TRANSPORT_REF),
        || {
            format!(
                "bounded broken: {what} was cut at {} bytes although more fit",
                stored.len()
            )
        },
    )
}

#[test]
fn transport_refs_and_error_codes_from_send_are_sanitized_and_bounded() {
    seeded::check("transport_text", CASES, &transport_text(), |raw| {
        let dir = tempfile::tempdir().expect("temp dir");
        let outbox = open_in(dir.path()).expect("open");
        for (key, destination) in [("ref", "chat-1"), ("perm", "chat-2"), ("retry", "chat-3")] {
            outbox.enqueue(msg(key, destination)).expect("enqueue");
        }
        let sent = outbox
            .process("ref", |_| Ok(Some(raw.clone())))
            .expect("process");
        let item = outbox.get("ref").expect("get").expect("item");
        ensure(
            sent.outcome == Outcome::Sent && item.state() == ItemState::Sent,
            || format!("delivery broken: a reply of {raw:?} did not mark the item sent"),
        )?;
        ensure(
            sent.transport_ref.as_deref() == item.transport_ref(),
            || "the receipt and the stored item disagree on the transport ref".into(),
        )?;
        match item.transport_ref() {
            None => ensure(raw.trim().is_empty(), || {
                format!("a non-blank transport ref {raw:?} was dropped")
            })?,
            Some(stored) => {
                ensure(!raw.trim().is_empty(), || {
                    format!("a blank transport ref {raw:?} was stored as {stored:?}")
                })?;
                check_stored("transport_ref", &raw, stored, "")?;
                let found = outbox.find_by_transport_ref(stored).expect("find");
                ensure(found.is_some_and(|i| i.idempotency_key() == "ref"), || {
                    "correlation broken: the stored transport ref does not find its item".into()
                })?;
                let logged = outbox.history("ref").expect("history");
                ensure(
                    logged.last().and_then(|r| r.transport_ref.as_deref()) == Some(stored),
                    || "the sent audit record does not carry the stored transport ref".into(),
                )?;
            }
        }
        let failed = outbox
            .process("perm", |_| Err(SendError::permanent(raw.clone())))
            .expect("process");
        let code = failed.error_code.clone().unwrap_or_default();
        check_stored("a permanent error code", &raw, &code, "unspecified")?;
        let retried = outbox
            .process("retry", |_| {
                Err(SendError::retryable(raw.clone()).retry_after(secs(60)))
            })
            .expect("process");
        ensure(retried.outcome == Outcome::Deferred, || {
            "retry broken".into()
        })?;
        let code = retried.error_code.clone().unwrap_or_default();
        check_stored("a retryable error code", &raw, &code, "unspecified")?;
        outbox
            .verify_audit()
            .map(|_| ())
            .map_err(|e| TestCaseError::fail(format!("audit-chain broken: {e}")))
    });
}

#[test]
fn a_retry_after_too_large_for_the_calendar_gives_up_instead_of_panicking() {
    // A platform's Retry-After is outside input: a bot may turn any number it is sent
    // into a Duration. It must not panic inside the outbox and strand the item.
    let dir = tempfile::tempdir().expect("temp dir");
    let outbox = open_in(dir.path()).expect("open");
    outbox.enqueue(msg("k", "chat-1")).expect("enqueue");
    let first = catch_unwind(AssertUnwindSafe(|| {
        outbox.process("k", |_| {
            Err(SendError::retryable("http_429").retry_after(Duration::from_secs(u64::MAX)))
        })
    }));
    let item = outbox.get("k").expect("get").expect("item");
    let again = catch_unwind(AssertUnwindSafe(|| {
        outbox.process("k", |_| panic!("too early"))
    }));
    assert!(
        first.is_ok(),
        "no-panic broken: process panicked recording a retry_after of u64::MAX seconds \
         ({}); the item is left {:?}, claimed: {}, and the next process call says {:?}",
        first
            .as_ref()
            .err()
            .map_or_else(String::new, |p| panic_text(p.as_ref())),
        item.state(),
        item.dispatch_claimed(),
        again.as_ref().ok().map(|r| r.as_ref().map(|r| r.outcome))
    );
    // A wait past `give_up_after` (24 h by default) can never be honoured in
    // time: the item fails at once with GAVE_UP (certainly not delivered).
    assert!(
        !item.dispatch_claimed()
            && item.state() == ItemState::Failed
            && item.error_code() == Some(durable_outbox::GAVE_UP),
        "a retryable failure left the item {:?} ({:?}), claimed: {}",
        item.state(),
        item.error_code(),
        item.dispatch_claimed()
    );
    assert!(
        matches!(again, Ok(Ok(ref r)) if r.outcome == Outcome::Failed),
        "the far-future retry must give up, not be in flight or sent"
    );
}

#[test]
fn out_of_range_durations_in_settings_are_rejected_at_open_never_a_panic_later() {
    type Configure = fn(durable_outbox::OutboxBuilder) -> durable_outbox::OutboxBuilder;
    let cases: [(&str, Configure); 3] = [
        ("rate_limit window of Duration::MAX", |b| {
            b.rate_limit(1, Duration::MAX)
        }),
        ("fixed backoff of Duration::MAX", |b| {
            b.backoff(Backoff::Fixed(vec![Duration::MAX]))
                .max_inline_wait(Duration::ZERO)
        }),
        ("exponential backoff capped at Duration::MAX", |b| {
            b.backoff(Backoff::Exponential {
                base: Duration::MAX,
                cap: Duration::MAX,
                jitter: true,
            })
            .max_inline_wait(Duration::ZERO)
        }),
    ];
    let mut broken = Vec::new();
    for (name, configure) in cases {
        let dir = tempfile::tempdir().expect("temp dir");
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            let outbox = match configure(builder(dir.path(), &clock())).open() {
                Err(Error::InvalidConfig { .. }) => return,
                other => other.expect("open"),
            };
            outbox.enqueue(msg("a", "chat-1")).expect("enqueue");
            outbox.enqueue(msg("b", "chat-1")).expect("enqueue");
            let _ = outbox.process("a", |_| Err(SendError::retryable("http_503")));
            let _ = outbox.process("b", |_| Ok(None));
        }));
        if let Err(payload) = outcome {
            broken.push(format!("{name}: {}", panic_text(payload.as_ref())));
        }
    }
    assert!(
        broken.is_empty(),
        "no-panic broken: settings accepted by open panicked later in process:\n  {}",
        broken.join("\n  ")
    );
}

// ----- symlinks ---------------------------------------------------------------------

#[cfg(unix)]
mod symlinks {
    use super::{AUDIT, JOURNAL, STATE, msg, names, open_in, read, template};
    use std::os::unix::fs::symlink;
    use std::path::PathBuf;

    /// An outbox directory next to a victim file outside it.
    struct Planted {
        root: tempfile::TempDir,
        victim: PathBuf,
    }

    impl Planted {
        /// `victim_bytes: None` leaves the victim absent (a dangling link).
        fn new(victim_bytes: Option<&[u8]>) -> Self {
            let root = tempfile::tempdir().expect("temp dir");
            std::fs::create_dir(root.path().join("outbox")).expect("outbox dir");
            let victim = root.path().join("victim");
            if let Some(bytes) = victim_bytes {
                std::fs::write(&victim, bytes).expect("victim");
            }
            Self { root, victim }
        }

        fn dir(&self) -> PathBuf {
            self.root.path().join("outbox")
        }

        fn plant(&self, name: &str) {
            symlink(&self.victim, self.dir().join(name)).expect("plant symlink");
        }

        fn assert_victim(&self, expected: Option<&[u8]>, how: &str) {
            let now = std::fs::read(&self.victim).ok();
            assert!(
                now.as_deref() == expected,
                "no-write-through broken: {how}: the symlink's target changed from {:?} to {:?}",
                expected.map(String::from_utf8_lossy),
                now.as_deref().map(String::from_utf8_lossy)
            );
        }
    }

    #[test]
    fn a_symlink_at_the_audit_path_is_never_written_through() {
        // With and without a final newline: the second looks like a torn last line.
        for victim in [&b"precious\n"[..], b"precious", b""] {
            let p = Planted::new(Some(victim));
            p.plant(AUDIT);
            let result = open_in(&p.dir()).and_then(|o| o.enqueue(msg("k", "chat-1")));
            p.assert_victim(
                Some(victim),
                &format!("audit.jsonl planted as a symlink, open + enqueue gave {result:?}"),
            );

            // Planted under a handle that is already open.
            let p = Planted::new(Some(victim));
            let outbox = open_in(&p.dir()).expect("open");
            p.plant(AUDIT);
            let result = outbox.enqueue(msg("k", "chat-1"));
            p.assert_victim(
                Some(victim),
                &format!("audit.jsonl planted under an open handle, enqueue gave {result:?}"),
            );
        }
    }

    #[test]
    fn planted_temp_file_symlinks_are_never_written_through() {
        let p = Planted::new(Some(b"precious"));
        p.plant(".outbox-tmp-planted.tmp");
        let outbox = open_in(&p.dir()).expect("open");
        // Planted again under the open handle, where no sweep removes it.
        std::os::unix::fs::symlink(&p.victim, p.dir().join(".outbox-tmp-planted2.tmp"))
            .expect("plant");
        for i in 0..20 {
            outbox
                .enqueue(msg(&format!("k{i}"), "chat-1"))
                .expect("enqueue");
        }
        outbox.process("k0", |_| Ok(None)).expect("process");
        outbox.compact().expect("compact");
        p.assert_victim(Some(b"precious"), "symlinks planted as .outbox-tmp-* files");
    }

    #[test]
    fn a_symlink_at_the_snapshot_or_journal_path_is_replaced_not_written_through() {
        let t = template();
        for (name, layout) in [(STATE, &t.compacted), (JOURNAL, &t.journaled)] {
            let victim = layout.get(name).expect("file");
            let p = Planted::new(Some(victim));
            layout.write(&p.dir());
            std::fs::remove_file(p.dir().join(name)).expect("remove");
            p.plant(name);
            let result = open_in(&p.dir()).and_then(|o| {
                o.enqueue(msg("z-new", "chat-9"))?;
                o.compact()
            });
            p.assert_victim(
                Some(victim),
                &format!("{name} planted as a symlink, open + enqueue + compact gave {result:?}"),
            );
        }
    }

    #[test]
    fn a_symlink_at_a_quarantine_name_is_not_followed() {
        let t = template();
        let layout = &t.journaled;
        // A torn last audit record (the journal still holds it) and a torn journal tail.
        let audit = layout.get(AUDIT).expect("audit");
        let torn_audit = &audit[..audit.len() - 7];
        let seq = String::from_utf8_lossy(audit).lines().count() - 1;
        for (file, name) in [
            (AUDIT, format!("audit.jsonl.torn-{seq}-0")),
            (JOURNAL, "outbox.journal.torn-0".to_owned()),
        ] {
            for victim in [Some(&b"precious"[..]), None] {
                let p = Planted::new(victim);
                layout.write(&p.dir());
                if file == AUDIT {
                    std::fs::write(p.dir().join(AUDIT), torn_audit).expect("tear the log");
                } else {
                    // An unfinished line right after the last entry, before the zeros.
                    let journal = layout.get(JOURNAL).expect("journal");
                    let end = journal.iter().rposition(|b| *b == b'\n').expect("lines") + 1;
                    let journal = [&journal[..end], b"0123abcd {\"half", &journal[end..]].concat();
                    std::fs::write(p.dir().join(JOURNAL), journal).expect("tear the journal");
                }
                p.plant(&name);
                let opened = open_in(&p.dir());
                p.assert_victim(
                    victim,
                    &format!(
                        "{name} planted as a symlink ({}), a torn {file} tail was quarantined; \
                         open gave {:?}",
                        if victim.is_some() {
                            "to a file"
                        } else {
                            "dangling"
                        },
                        opened.as_ref().map(|_| ())
                    ),
                );
                assert!(opened.is_ok(), "a torn {file} tail is repaired: {opened:?}");
                assert!(
                    names(&p.dir())
                        .iter()
                        .any(|n| n.starts_with(&format!("{file}.torn-")) && *n != name),
                    "the torn {file} tail went to another, free name"
                );
            }
        }
        let _ = read;
    }

    #[test]
    fn a_symlink_at_the_owners_directory_is_not_written_through() {
        let root = tempfile::tempdir().expect("temp dir");
        let victim = root.path().join("victim-dir");
        std::fs::create_dir(&victim).expect("victim dir");
        std::fs::write(victim.join("unrelated.owner"), b"keep").expect("victim file");
        let dir = root.path().join("outbox");
        std::fs::create_dir(&dir).expect("outbox dir");
        symlink(&victim, dir.join("owners")).expect("plant");
        let opened = open_in(&dir);
        let listing = names(&victim);
        assert!(
            listing.len() == 1 && listing.contains("unrelated.owner"),
            "no-write-through broken: owners/ planted as a symlink to another directory; open \
             gave {:?} and that directory now holds {listing:?}",
            opened.map(|_| ())
        );
    }
}
