//! Two states a power cut leaves, written by hand: each used to make the outbox
//! unopenable for good. Everything past a file's last durable point is a crash
//! remnant, whatever its shape; it is set aside byte for byte and rebuilt from
//! the journal. Damage before the durable point is still refused.
//!
//! File-only by design: hand-written crash states of the files.

use std::fs;
use std::path::Path;

use durable_outbox::{Error, ManualClock, Outbox};

use crate::harness::{START, builder, files_starting_with, msg};

fn open(dir: &Path) -> Outbox {
    let clock = ManualClock::at(START).unwrap();
    builder(dir, &clock).open().expect("the outbox opens")
}

/// Where the entries of `outbox.journal` end: its first zero byte.
fn journal_end(dir: &Path) -> usize {
    let bytes = fs::read(dir.join("outbox.journal")).unwrap();
    bytes.iter().position(|b| *b == 0).unwrap()
}

#[test]
fn a_torn_unacknowledged_entry_beyond_zeros_is_set_aside_before_the_next_commit() {
    let dir = tempfile::tempdir().unwrap();
    {
        let outbox = open(dir.path());
        outbox.enqueue(msg("a", "chat-1")).unwrap();
    }
    // Reopening compacts: the journal is now its header and zeros.
    drop(open(dir.path()));
    let end = journal_end(dir.path());
    // A power cut during the next entry's write (a large one): its first sector
    // never reached the disk (zeros), later ones did (the entry's end, with its
    // newline), reaching past where the next, smaller entry ends.
    let remnant = format!("{}\"}}],\"audit\":[]}}\n", "y".repeat(4000)).into_bytes();
    let mut journal = fs::read(dir.path().join("outbox.journal")).unwrap();
    let at = end + 100;
    journal[at..at + remnant.len()].copy_from_slice(&remnant);
    fs::write(dir.path().join("outbox.journal"), &journal).unwrap();

    {
        let outbox = open(dir.path());
        outbox
            .enqueue(msg("b", "chat-1"))
            .expect("an enqueue after the cut is acknowledged");
    }
    let outbox = Outbox::open(dir.path()).expect("the outbox opens after that commit");
    assert!(outbox.get("a").unwrap().is_some());
    assert!(
        outbox.get("b").unwrap().is_some(),
        "the acknowledged enqueue"
    );
    outbox.verify_audit().unwrap();
    let set_aside = files_starting_with(dir.path(), "outbox.journal.torn-");
    assert_eq!(set_aside.len(), 1, "{set_aside:?}");
    let kept = fs::read(&set_aside[0]).unwrap();
    let mut expected = vec![0u8; 100];
    expected.extend_from_slice(&remnant);
    assert_eq!(
        kept, expected,
        "the remnant is kept byte for byte, from the end of the entries on"
    );
}

#[test]
fn a_group_write_torn_with_its_first_sectors_missing_is_set_aside_and_the_outbox_opens() {
    // A commit group's leader writes its members' entries in one write, then
    // syncs. A power cut before that sync completes may keep any of the
    // write's sectors: here its first ones are lost (zeros: the journal is
    // preallocated) and its later ones, holding whole entries of the same
    // group, landed. No entry of the group was acknowledged; the ones before
    // it were, and must open.
    let dir = tempfile::tempdir().unwrap();
    let journal_path = dir.path().join("outbox.journal");
    let audit_path = dir.path().join("audit.jsonl");
    let (group_start, sector_end, group_end, audit_before) = {
        let outbox = open(dir.path());
        outbox.enqueue(msg("a", "chat-1")).unwrap();
        let group_start = journal_end(dir.path());
        // The log as it was when the group was written: its records are
        // appended only after the group's sync.
        let audit_before = fs::read(&audit_path).unwrap();
        outbox
            .enqueue(durable_outbox::NewMessage {
                content: "x".repeat(1500),
                ..msg("b", "chat-1")
            })
            .unwrap();
        let b_end = journal_end(dir.path());
        outbox.enqueue(msg("c", "chat-2")).unwrap();
        outbox.enqueue(msg("d", "chat-3")).unwrap();
        let group_end = journal_end(dir.path());
        // The first sector boundary inside the group: `b` spans it, so `c`
        // and `d` lie wholly after it.
        let sector_end = (group_start / 512 + 1) * 512;
        assert!(sector_end < b_end, "b must span a sector boundary");
        (group_start, sector_end, group_end, audit_before)
    };
    let mut journal = fs::read(&journal_path).unwrap();
    journal[group_start..sector_end].fill(0);
    fs::write(&journal_path, &journal).unwrap();
    fs::write(&audit_path, &audit_before).unwrap();

    assert_torn_write_set_aside(
        dir.path(),
        &journal[group_start..group_end],
        &["b", "c", "d"],
        "chat-4",
    );
}

#[test]
fn a_whole_entry_out_of_sequence_past_the_zeros_is_damage_and_is_refused() {
    // What a torn group write can never leave: an entry that is not later
    // than the last one applied (here a copy of `a`'s) past the zeros.
    let dir = tempfile::tempdir().unwrap();
    let journal_path = dir.path().join("outbox.journal");
    let (a_start, a_end) = {
        let outbox = open(dir.path());
        outbox.enqueue(msg("a", "chat-1")).unwrap();
        // `a`'s line is the one after the header.
        let bytes = fs::read(dir.path().join("outbox.journal")).unwrap();
        let a_start = bytes.iter().position(|b| *b == b'\n').unwrap() + 1;
        (a_start, journal_end(dir.path()))
    };
    let mut journal = fs::read(&journal_path).unwrap();
    let line = journal[a_start..a_end].to_vec();
    let at = a_end + 700;
    journal[at..at + line.len()].copy_from_slice(&line);
    fs::write(&journal_path, &journal).unwrap();
    let clock = durable_outbox::ManualClock::at(START).unwrap();
    let refused = builder(dir.path(), &clock).open().map(|_| ()).unwrap_err();
    assert!(
        matches!(&refused, Error::InvalidRecord { path, location, .. }
            if path.ends_with("outbox.journal") && *location == format!("byte {a_end}")),
        "{refused:?}"
    );
    assert_eq!(fs::read(&journal_path).unwrap(), journal, "nothing written");
}

/// An outbox whose snapshot makes record 1 (`a`) durable, with `b` and `c`
/// appended to the log after it (unsynced) and held by the journal. Returns
/// the directory and the log's bytes and where `b`'s line starts.
fn log_with_unsynced_records() -> (tempfile::TempDir, Vec<u8>, usize) {
    let dir = tempfile::tempdir().unwrap();
    {
        let outbox = open(dir.path());
        outbox.enqueue(msg("a", "chat-1")).unwrap();
    }
    drop(open(dir.path()));
    let durable = fs::read(dir.path().join("audit.jsonl")).unwrap().len();
    {
        let outbox = open(dir.path());
        outbox.enqueue(msg("b", "chat-1")).unwrap();
        outbox.enqueue(msg("c", "chat-1")).unwrap();
        // The handle is dropped without a compaction: the journal holds b and c.
    }
    let log = fs::read(dir.path().join("audit.jsonl")).unwrap();
    assert_eq!(log.split(|b| *b == b'\n').count(), 4, "three records");
    (dir, log, durable)
}

/// Opens the damaged outbox and checks the log came back exactly as written,
/// with the damaged region kept in a quarantine file.
fn assert_rebuilt(dir: &Path, log: &[u8], damaged_from: usize) {
    let damaged = fs::read(dir.join("audit.jsonl")).unwrap();
    let outbox = open(dir);
    for key in ["a", "b", "c"] {
        assert!(outbox.get(key).unwrap().is_some(), "{key} is kept");
    }
    outbox.verify_audit().unwrap();
    assert_eq!(
        fs::read(dir.join("audit.jsonl")).unwrap(),
        log,
        "the log is rebuilt from the journal, byte for byte"
    );
    let set_aside = files_starting_with(dir, "audit.jsonl.torn-");
    assert_eq!(set_aside.len(), 1, "{set_aside:?}");
    assert_eq!(
        fs::read(&set_aside[0]).unwrap(),
        &damaged[damaged_from..],
        "the unsynced region is kept byte for byte"
    );
    drop(outbox);
    open(dir).verify_audit().unwrap();
}

#[test]
fn unsynced_audit_records_that_landed_out_of_order_are_set_aside_and_rebuilt() {
    let (dir, log, durable) = log_with_unsynced_records();
    // `b`'s block never reached the disk; `c`'s, later in the file, did.
    let b_end = durable + log[durable..].iter().position(|b| *b == b'\n').unwrap() + 1;
    let mut damaged = log.clone();
    damaged[durable..b_end].fill(0);
    fs::write(dir.path().join("audit.jsonl"), &damaged).unwrap();
    assert_rebuilt(dir.path(), &log, durable);
}

#[test]
fn an_unsynced_audit_line_with_zeros_inside_is_set_aside_and_rebuilt() {
    let (dir, log, durable) = log_with_unsynced_records();
    let mut damaged = log.clone();
    damaged[durable + 40..durable + 60].fill(0);
    fs::write(dir.path().join("audit.jsonl"), &damaged).unwrap();
    assert_rebuilt(dir.path(), &log, durable);
}

#[test]
fn damage_to_a_durable_audit_record_is_refused_and_nothing_is_written() {
    let (dir, log, durable) = log_with_unsynced_records();
    let mut damaged = log.clone();
    damaged[durable / 2..durable / 2 + 8].fill(0);
    fs::write(dir.path().join("audit.jsonl"), &damaged).unwrap();
    let clock = ManualClock::at(START).unwrap();
    let err = builder(dir.path(), &clock).open().unwrap_err();
    assert!(
        matches!(err, Error::AuditBroken { line: 1, .. }),
        "the damaged durable record is named: {err}"
    );
    assert_eq!(fs::read(dir.path().join("audit.jsonl")).unwrap(), damaged);
    assert!(files_starting_with(dir.path(), "audit.jsonl.torn-").is_empty());
}

/// An outbox whose journal holds the acknowledged `a`, then the entry of a
/// large `b` (about 3 KiB) whose write a power cut tore: of the whole
/// 512-byte sectors of the file inside `b`'s line, those numbered in
/// `sectors_lost` (0 is the first) never reached the disk (zeros: the
/// journal is preallocated), while the others, with `b`'s first bytes and its
/// newline, did. Unless `b_was_synced`, `b`'s audit record is not in the log
/// (it is appended only after the journal's sync, which the cut came before).
/// Returns the directory, the damaged journal's bytes of `b`'s write and
/// `b`'s line as it was written.
fn journal_with_torn_middle(
    sectors_lost: &[usize],
    b_was_synced: bool,
) -> (tempfile::TempDir, Vec<u8>, Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    let journal_path = dir.path().join("outbox.journal");
    let audit_path = dir.path().join("audit.jsonl");
    let (b_start, b_end, audit_before) = {
        let outbox = open(dir.path());
        outbox.enqueue(msg("a", "chat-1")).unwrap();
        let b_start = journal_end(dir.path());
        let audit_before = fs::read(&audit_path).unwrap();
        outbox
            .enqueue(durable_outbox::NewMessage {
                content: "x".repeat(2000),
                ..msg("b", "chat-1")
            })
            .unwrap();
        (b_start, journal_end(dir.path()), audit_before)
    };
    let mut journal = fs::read(&journal_path).unwrap();
    let written = journal[b_start..b_end].to_vec();
    // The sector boundaries inside `b`'s line; its first sector (which holds
    // the line's start) and its last (which holds the newline) landed.
    let first_boundary = (b_start / 512 + 1) * 512;
    for &n in sectors_lost {
        let from = first_boundary + n * 512;
        assert!(
            from + 512 < b_end - 1,
            "sector {n} must lie inside b's line"
        );
        journal[from..from + 512].fill(0);
    }
    assert_eq!(journal[b_end - 1], b'\n', "b's newline landed");
    fs::write(&journal_path, &journal).unwrap();
    if !b_was_synced {
        fs::write(&audit_path, &audit_before).unwrap();
    }
    (dir, journal[b_start..b_end].to_vec(), written)
}

/// Opens an outbox whose last unsynced write (of `torn`'s bytes, holding the
/// entries of `lost`) a power cut tore after the acknowledged `a`: `a` is
/// there and none of `lost` is, an enqueue to `destination` after the cut is
/// kept by a reopen, the chain verifies, and the torn bytes (zeros and all)
/// are set aside once, byte for byte.
fn assert_torn_write_set_aside(dir: &Path, torn: &[u8], lost: &[&str], destination: &str) {
    {
        let outbox = open(dir);
        assert!(
            outbox.get("a").unwrap().is_some(),
            "acknowledged a was lost"
        );
        for key in lost {
            assert!(
                outbox.get(key).unwrap().is_none(),
                "{key} was in the torn write, yet it was applied"
            );
        }
        outbox
            .enqueue(msg("p", destination))
            .expect("an enqueue after the cut is acknowledged");
    }
    let outbox = Outbox::open(dir).expect("the outbox opens after that commit");
    assert!(outbox.get("a").unwrap().is_some());
    assert!(
        outbox.get("p").unwrap().is_some(),
        "the acknowledged enqueue"
    );
    outbox.verify_audit().unwrap();
    let set_aside = files_starting_with(dir, "outbox.journal.torn-");
    assert_eq!(set_aside.len(), 1, "{set_aside:?}");
    assert_eq!(
        fs::read(&set_aside[0]).unwrap(),
        torn,
        "the torn write is kept byte for byte, from the end of the entries on"
    );
}

#[test]
fn an_unsynced_entry_whose_middle_sector_was_lost_but_whose_newline_landed_is_set_aside() {
    // Each sector in turn: near the line's start, where the open's first
    // small read sees the zeros before the newline, and further in, where
    // zeros and newline come in one read.
    for lost in 0..=4 {
        let (dir, torn, _) = journal_with_torn_middle(&[lost], false);
        assert_torn_write_set_aside(dir.path(), &torn, &["b"], "chat-2");
    }
}

#[test]
fn an_unsynced_entry_that_lost_several_separate_middle_sectors_is_set_aside() {
    for lost in [&[0, 2, 4][..], &[1, 3]] {
        let (dir, torn, _) = journal_with_torn_middle(lost, false);
        assert_torn_write_set_aside(dir.path(), &torn, &["b"], "chat-2");
    }
}

#[test]
fn a_group_write_that_lost_sectors_across_entries_but_kept_its_last_ones_is_set_aside() {
    // A commit group's one write carries b, c and d. The power cut kept its
    // first sector (b's start), lost the two sectors that hold b's end and
    // c's start, and kept the rest: c's end with its newline and d whole.
    // None of the group was acknowledged; a was.
    let dir = tempfile::tempdir().unwrap();
    let journal_path = dir.path().join("outbox.journal");
    let audit_path = dir.path().join("audit.jsonl");
    let (group_start, c_start, group_end, audit_before) = {
        let outbox = open(dir.path());
        outbox.enqueue(msg("a", "chat-1")).unwrap();
        let group_start = journal_end(dir.path());
        let audit_before = fs::read(&audit_path).unwrap();
        let big = |key: &str, chat: &str| durable_outbox::NewMessage {
            content: "x".repeat(1200),
            ..msg(key, chat)
        };
        outbox.enqueue(big("b", "chat-1")).unwrap();
        let c_start = journal_end(dir.path());
        outbox.enqueue(big("c", "chat-2")).unwrap();
        outbox.enqueue(msg("d", "chat-3")).unwrap();
        (group_start, c_start, journal_end(dir.path()), audit_before)
    };
    let mut journal = fs::read(&journal_path).unwrap();
    // The sector holding c's start and the one before it.
    let lost_from = (c_start / 512 - 1) * 512;
    let lost_to = (c_start / 512 + 1) * 512;
    assert!(
        lost_from > group_start + 17,
        "b's first sector (its checksum) landed"
    );
    let c_end = c_start + journal[c_start..].iter().position(|b| *b == b'\n').unwrap() + 1;
    assert!(lost_to < c_end, "c's newline landed");
    journal[lost_from..lost_to].fill(0);
    fs::write(&journal_path, &journal).unwrap();
    fs::write(&audit_path, &audit_before).unwrap();

    assert_torn_write_set_aside(
        dir.path(),
        &journal[group_start..group_end],
        &["b", "c", "d"],
        "chat-4",
    );
}

/// Opening `dir` is refused, naming `outbox.journal` at `byte {at}`, and
/// writes nothing: the journal is as it was and nothing is set aside.
fn assert_journal_refused_at(dir: &Path, at: usize) {
    let journal_path = dir.join("outbox.journal");
    let journal = fs::read(&journal_path).unwrap();
    let clock = ManualClock::at(START).unwrap();
    let refused = builder(dir, &clock).open().map(|_| ()).unwrap_err();
    assert!(
        matches!(&refused, Error::InvalidRecord { path, location, .. }
            if path.ends_with("outbox.journal") && *location == format!("byte {at}")),
        "{refused:?}"
    );
    assert_eq!(fs::read(&journal_path).unwrap(), journal, "nothing written");
    assert!(files_starting_with(dir, "outbox.journal.torn-").is_empty());
}

#[test]
fn a_flipped_byte_in_the_last_whole_entry_is_damage_and_is_refused() {
    // A whole line (its newline on disk) without a zero byte in it cannot be
    // what a power cut left: every sector of it reached the disk, so its
    // bytes are what was written. A bad checksum there is damage, and the
    // entry may have been acknowledged: setting it aside would lose it.
    let dir = tempfile::tempdir().unwrap();
    let (b_start, b_end) = {
        let outbox = open(dir.path());
        outbox.enqueue(msg("a", "chat-1")).unwrap();
        let b_start = journal_end(dir.path());
        outbox.enqueue(msg("b", "chat-1")).unwrap();
        (b_start, journal_end(dir.path()))
    };
    let journal_path = dir.path().join("outbox.journal");
    let mut journal = fs::read(&journal_path).unwrap();
    journal[b_start + (b_end - b_start) / 2] ^= 0x01;
    fs::write(&journal_path, &journal).unwrap();
    assert_journal_refused_at(dir.path(), b_start);
}

#[test]
fn a_torn_line_followed_by_an_entry_that_is_not_later_is_damage_and_is_refused() {
    // b's write lost a middle sector (the shape a power cut leaves), but a
    // whole entry past it is one no torn write can hold: a repeat of b's seq
    // or of an earlier one. Whatever produced that, it is not a tear.
    for repeat in ["a", "b"] {
        let (dir, torn, b_line) = journal_with_torn_middle(&[3], false);
        let journal_path = dir.path().join("outbox.journal");
        let mut journal = fs::read(&journal_path).unwrap();
        let header_end = journal.iter().position(|b| *b == b'\n').unwrap() + 1;
        let a_end = header_end
            + journal[header_end..]
                .iter()
                .position(|b| *b == b'\n')
                .unwrap()
            + 1;
        let b_end = a_end + torn.len();
        let line = if repeat == "a" {
            journal[header_end..a_end].to_vec()
        } else {
            b_line
        };
        let at = b_end + 300;
        journal[at..at + line.len()].copy_from_slice(&line);
        fs::write(&journal_path, &journal).unwrap();
        assert_journal_refused_at(dir.path(), a_end);
    }
}

#[test]
fn zeros_inside_an_entry_whose_audit_record_is_in_the_log_are_damage_and_are_refused() {
    // The journal's bytes are those of a torn write of b, but b's audit
    // record is in the log, which is appended only after the journal's sync:
    // b was synced (and acknowledged), so the lost sector is damage to
    // synced data, not a tear. It is refused, naming where b starts.
    let (dir, torn, _) = journal_with_torn_middle(&[3], true);
    let journal_path = dir.path().join("outbox.journal");
    let audit_path = dir.path().join("audit.jsonl");
    let b_start = fs::read(&journal_path)
        .unwrap()
        .windows(torn.len())
        .position(|w| w == torn.as_slice())
        .unwrap();
    let audit = fs::read(&audit_path).unwrap();
    assert_journal_refused_at(dir.path(), b_start);
    assert_eq!(fs::read(&audit_path).unwrap(), audit, "nothing written");
}
