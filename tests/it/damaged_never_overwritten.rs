//! A damaged file is never overwritten: when the outbox replaces a file whose
//! content did not parse, it first copies the file's bytes aside (as
//! `<file>.torn-<n>`, the name recovery's other set-aside copies take, which
//! `durable-outbox status` lists), whatever the damage and whichever call
//! gets there first: an open, a commit or a compaction of a handle already
//! open.
//!
//! The one such file is a journal whose header line does not parse and after
//! which no entry follows: it holds nothing acknowledged, so the outbox opens
//! and starts a fresh journal, but its bytes used to be renamed over, gone.
//! (A bad header with entries after it is refused, nothing written; torn
//! journal and audit tails are set aside by their own tests.)
//!
//! File-only by design: the files on disk.

use std::fs;
use std::path::{Path, PathBuf};

use durable_outbox::{ManualClock, Outbox};

use crate::harness::{START, builder, files_starting_with, msg};

const JOURNAL: &str = "outbox.journal";

fn open(dir: &Path) -> Outbox {
    let clock = ManualClock::at(START).unwrap();
    builder(dir, &clock).open().expect("the outbox opens")
}

/// The set-aside copies of the journal in `dir`.
fn set_aside(dir: &Path) -> Vec<PathBuf> {
    files_starting_with(dir, &format!("{JOURNAL}.torn-"))
}

/// An outbox holding "a", folded into its snapshot: its journal is a header
/// and the zeros it was preallocated with.
fn compacted(dir: &Path) {
    open(dir).enqueue(msg("a", "chat-1")).unwrap();
    // Reopening compacts.
    drop(open(dir));
    let journal = fs::read(dir.join(JOURNAL)).unwrap();
    let end = journal.iter().position(|b| *b == 0).unwrap();
    assert_eq!(
        journal.iter().position(|b| *b == b'\n').map(|at| at + 1),
        Some(end),
        "the journal is not a lone header"
    );
}

/// A way a header line can be damaged, applied to the header's bytes.
type Damage = fn(&mut [u8]);

/// Ways a header line can be damaged, each with its name.
fn damages() -> Vec<(&'static str, Damage)> {
    vec![
        // A flipped byte: the line is whole, its checksum does not match.
        ("a flipped byte in a whole header line", |header| {
            header[20] ^= 0x20;
        }),
        // Its middle sector lost: zeros before its newline, an unfinished line.
        ("zeros inside the header line", |header| {
            let len = header.len();
            header[10..len - 5].fill(0);
        }),
    ]
}

/// The journal with its header damaged by `damage`, trailing zeros kept.
fn damaged_journal(dir: &Path, damage: Damage) -> Vec<u8> {
    let mut journal = fs::read(dir.join(JOURNAL)).unwrap();
    let header_len = journal.iter().position(|b| *b == b'\n').unwrap() + 1;
    damage(&mut journal[..header_len]);
    journal
}

/// `bytes` without the zeros at their end.
fn trimmed(bytes: &[u8]) -> &[u8] {
    let end = bytes.iter().rposition(|b| *b != 0).map_or(0, |i| i + 1);
    &bytes[..end]
}

/// After the damaged journal `was` was replaced: it was copied aside once,
/// byte for byte (its preallocated zeros aside), the journal in its place is
/// a fresh one, and the outbox holds "a" and `also`.
fn assert_set_aside_and_outbox_whole(dir: &Path, was: &[u8], what: &str, also: &[&str]) {
    let copies = set_aside(dir);
    assert_eq!(
        copies.len(),
        1,
        "{what}: the damaged journal was overwritten without being set aside (copies: {copies:?})"
    );
    assert_eq!(
        fs::read(&copies[0]).unwrap(),
        trimmed(was),
        "{what}: the copy set aside is not the damaged journal byte for byte"
    );
    let reopened = open(dir);
    for key in ["a"].iter().chain(also) {
        assert!(
            reopened.get(key).unwrap().is_some(),
            "{what}: {key} was lost"
        );
    }
    reopened.verify_audit().unwrap();
    assert_eq!(set_aside(dir).len(), 1, "{what}: set aside again on reopen");
}

#[test]
fn opening_sets_a_journal_with_a_damaged_header_and_nothing_after_it_aside() {
    for (what, damage) in damages() {
        let dir = tempfile::tempdir().unwrap();
        compacted(dir.path());
        let was = damaged_journal(dir.path(), damage);
        fs::write(dir.path().join(JOURNAL), &was).unwrap();
        let outbox = open(dir.path());
        // Set aside by the open itself, as a torn tail is.
        assert_eq!(
            set_aside(dir.path()).len(),
            1,
            "{what}: opening did not set the damaged journal aside"
        );
        outbox
            .enqueue(msg("b", "chat-1"))
            .expect("an enqueue after the damaged journal was set aside");
        drop(outbox);
        assert_set_aside_and_outbox_whole(dir.path(), &was, what, &["b"]);
    }
}

/// Puts the damaged journal `was` in place as a new file (as a restore or
/// another program would) and bumps the change counter in `outbox.lock`, so
/// a handle already open reads the files again.
fn replace_behind_an_open_handle(dir: &Path, was: &[u8]) {
    let staged = dir.join("staged-journal");
    fs::write(&staged, was).unwrap();
    fs::rename(&staged, dir.join(JOURNAL)).unwrap();
    let lock = dir.join("outbox.lock");
    let mut counter = fs::read(&lock).unwrap();
    let bumped = u64::from_le_bytes(counter[..8].try_into().unwrap()).wrapping_add(1);
    counter[..8].copy_from_slice(&bumped.to_le_bytes());
    fs::write(&lock, counter).unwrap();
}

/// For each damage: the damaged journal put in place behind a handle
/// already open, then `call` on that handle, which gets there first. The
/// journal must be set aside, and the outbox hold "a" and `also`.
fn set_aside_behind_an_open_handle(call: impl Fn(&Outbox), also: &[&str]) {
    for (what, damage) in damages() {
        let dir = tempfile::tempdir().unwrap();
        compacted(dir.path());
        let was = damaged_journal(dir.path(), damage);
        let outbox = open(dir.path());
        replace_behind_an_open_handle(dir.path(), &was);
        call(&outbox);
        drop(outbox);
        assert_set_aside_and_outbox_whole(dir.path(), &was, what, also);
    }
}

#[test]
fn a_commit_of_an_open_handle_sets_a_journal_with_a_damaged_header_aside() {
    set_aside_behind_an_open_handle(
        |outbox| {
            outbox
                .enqueue(msg("b", "chat-1"))
                .expect("an enqueue after the damaged journal was set aside");
        },
        &["b"],
    );
}

#[test]
fn a_compaction_of_an_open_handle_sets_a_journal_with_a_damaged_header_aside() {
    set_aside_behind_an_open_handle(
        |outbox| {
            outbox
                .compact()
                .expect("a compaction after the damaged journal was set aside");
        },
        &[],
    );
}

/// A header whose newline is damaged runs on into the entry after it, so the
/// first "line" is the header and an acknowledged entry together, and no
/// whole line follows it. That is damage hiding an acknowledged change, not
/// a lone bad header: the open must refuse with an error naming the journal,
/// and leave every byte where it was (setting the journal aside would open
/// the outbox without the change, and a message marked sent would be sent
/// again).
#[test]
fn a_damaged_header_that_runs_into_an_entry_is_refused_not_set_aside() {
    let dir = tempfile::tempdir().unwrap();
    compacted(dir.path());
    // One acknowledged entry after the header, left in the journal.
    open(dir.path()).enqueue(msg("b", "chat-1")).unwrap();
    let mut journal = fs::read(dir.path().join(JOURNAL)).unwrap();
    let header_end = journal.iter().position(|b| *b == b'\n').unwrap();
    assert!(
        journal[header_end + 1] != 0,
        "the entry is not in the journal"
    );
    journal[header_end] = b'x';
    fs::write(dir.path().join(JOURNAL), &journal).unwrap();
    let clock = ManualClock::at(START).unwrap();
    let err = builder(dir.path(), &clock)
        .open()
        .expect_err("an outbox whose acknowledged entry hides behind a damaged header opened");
    let text = err.to_string();
    assert!(
        text.contains(JOURNAL),
        "the error does not name the journal: {text}"
    );
    assert!(
        set_aside(dir.path()).is_empty(),
        "the journal holding an acknowledged entry was set aside"
    );
    assert_eq!(
        fs::read(dir.path().join(JOURNAL)).unwrap(),
        journal,
        "the damaged journal was changed"
    );
}
