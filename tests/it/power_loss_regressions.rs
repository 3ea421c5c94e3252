//! Two states a power cut leaves, written by hand: each used to make the outbox
//! unopenable for good. Everything past a file's last durable point is a crash
//! remnant, whatever its shape; it is set aside byte for byte and rebuilt from
//! the journal. Damage before the durable point is still refused.
//!
//! File-only by design: hand-written crash states of the files.

use std::fs;
use std::path::Path;

use durable_outbox::{Error, ManualClock, Outbox};

use crate::harness::{START, builder, msg};

fn open(dir: &Path) -> Outbox {
    let clock = ManualClock::at(START).unwrap();
    builder(dir, &clock).open().expect("the outbox opens")
}

/// Files in `dir` whose name starts with `prefix`.
fn quarantined(dir: &Path, prefix: &str) -> Vec<std::path::PathBuf> {
    let mut found: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with(prefix))
        .collect();
    found.sort();
    found
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
    let set_aside = quarantined(dir.path(), "outbox.journal.torn-");
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

    {
        let outbox = open(dir.path());
        assert!(
            outbox.get("a").unwrap().is_some(),
            "acknowledged a was lost"
        );
        for key in ["b", "c", "d"] {
            assert!(
                outbox.get(key).unwrap().is_none(),
                "{key} follows a lost entry of its group, yet it was applied"
            );
        }
        outbox
            .enqueue(msg("p", "chat-4"))
            .expect("an enqueue after the cut is acknowledged");
    }
    let outbox = Outbox::open(dir.path()).expect("the outbox opens after that commit");
    assert!(outbox.get("a").unwrap().is_some());
    assert!(
        outbox.get("p").unwrap().is_some(),
        "the acknowledged enqueue"
    );
    outbox.verify_audit().unwrap();
    let set_aside = quarantined(dir.path(), "outbox.journal.torn-");
    assert_eq!(set_aside.len(), 1, "{set_aside:?}");
    assert_eq!(
        fs::read(&set_aside[0]).unwrap(),
        journal[group_start..group_end],
        "the torn group is kept byte for byte, from the end of the entries on"
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
    let set_aside = quarantined(dir, "audit.jsonl.torn-");
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
    assert!(quarantined(dir.path(), "audit.jsonl.torn-").is_empty());
}
