//! Files are private, complete JSON after every call, and crash leftovers are cleaned up.
//!
//! File-only by design, except `data_survives_reopening` (on both engines,
//! `on_both_engines!`): the rest reads or damages the directory's files.

use durable_outbox::Outbox;

use crate::engines::on_both_engines;
use crate::harness::{Harness, msg};

#[cfg(unix)]
#[test]
fn every_file_the_outbox_creates_is_private() {
    use std::os::unix::fs::PermissionsExt;
    let h = Harness::new();
    h.enqueue("k", "chat-1");
    h.outbox.compact().unwrap();
    h.enqueue("k2", "chat-1");
    for name in [
        "outbox.json",
        "outbox.journal",
        "audit.jsonl",
        "outbox.lock",
    ] {
        let mode = std::fs::metadata(h.path(name))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600, "{name} has mode {mode:o}");
    }
    let owners = std::fs::metadata(h.path("owners"))
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(owners, 0o700);
}

/// The journal's bytes up to the zeros it is preallocated with.
fn journal_bytes(h: &Harness) -> Vec<u8> {
    let mut bytes = std::fs::read(h.path("outbox.journal")).unwrap();
    let end = bytes.iter().position(|b| *b == 0).unwrap_or(bytes.len());
    assert!(
        bytes[end..].iter().all(|b| *b == 0),
        "only zeros after the entries"
    );
    bytes.truncate(end);
    bytes
}

/// The journal's framing: `<16 hex> <json>\n`, the hex being the first 64 bits of
/// the JSON's SHA-256 (see `src/store/journal.rs`). Checked here independently.
fn journal_entries(h: &Harness) -> Vec<serde_json::Value> {
    use sha2::{Digest, Sha256};
    let text = String::from_utf8(journal_bytes(h)).unwrap();
    text.lines()
        .map(|line| {
            let (sum, json) = line.split_once(' ').unwrap();
            assert_eq!(
                sum,
                &hex::encode(Sha256::digest(json.as_bytes()))[..16],
                "checksum of {json}"
            );
            serde_json::from_str(json).unwrap()
        })
        .collect()
}

#[test]
fn each_change_is_one_checksummed_journal_entry_with_its_audit_records() {
    let h = Harness::new();
    for i in 0..5 {
        h.enqueue(&format!("k{i}"), "chat-1");
        let entries = journal_entries(&h);
        assert_eq!(
            entries[0]["generation"], 0,
            "the header names the snapshot generation"
        );
        assert_eq!(entries.len(), i + 2, "header plus one entry per enqueue");
        let last = &entries[i + 1];
        assert_eq!(last["seq"], i as u64 + 1);
        assert_eq!(last["items"][0]["idempotency_key"], format!("k{i}"));
        assert_eq!(
            last["audit"][0]["seq"],
            i as u64 + 1,
            "the sealed audit record rides along"
        );
    }
}

#[test]
fn compaction_writes_a_complete_snapshot_and_starts_the_next_generation() {
    let h = Harness::new();
    for i in 0..3 {
        h.enqueue(&format!("k{i}"), "chat-1");
    }
    h.outbox.compact().unwrap();
    let snapshot: serde_json::Value = serde_json::from_slice(&h.state_bytes()).unwrap();
    assert_eq!(snapshot["version"], 2);
    assert_eq!(snapshot["generation"], 1);
    assert_eq!(snapshot["items"].as_array().unwrap().len(), 3);
    assert_eq!(snapshot["audit_head"]["seq"], 3);
    let entries = journal_entries(&h);
    assert_eq!(entries.len(), 1, "only the header of generation 1");
    assert_eq!(entries[0]["generation"], 1);
    assert_eq!(h.reopen().list_items().unwrap().len(), 3);
}

#[test]
fn a_journal_left_by_a_compaction_that_crashed_is_recognised_as_folded_in() {
    let h = Harness::new();
    h.enqueue("a", "chat-1");
    let old_journal = std::fs::read(h.path("outbox.journal")).unwrap();
    h.outbox.compact().unwrap();
    // The crash hit after the new snapshot, before the new journal replaced the old.
    std::fs::write(h.path("outbox.journal"), old_journal).unwrap();
    let reopened = h.reopen();
    assert_eq!(
        reopened.list_items().unwrap().len(),
        1,
        "the entry is not applied twice"
    );
    reopened.enqueue(msg("b", "chat-1")).unwrap();
    assert_eq!(h.reopen().list_items().unwrap().len(), 2);
    reopened.verify_audit().unwrap();
}

#[test]
fn a_torn_journal_tail_is_set_aside_and_the_acknowledged_entries_survive() {
    let h = Harness::new();
    h.enqueue("a", "chat-1");
    h.enqueue("b", "chat-1");
    // A crash mid-write leaves the start of the next entry where the zeros were.
    let end = journal_bytes(&h).len();
    let mut bytes = std::fs::read(h.path("outbox.journal")).unwrap();
    let torn = b"0123456789abcdef {\"seq\":3,\"items\":[{\"attempts\"";
    bytes[end..end + torn.len()].copy_from_slice(torn);
    std::fs::write(h.path("outbox.journal"), &bytes).unwrap();
    let reopened = h.reopen();
    assert_eq!(reopened.list_items().unwrap().len(), 2);
    assert_eq!(
        std::fs::read(h.path("outbox.journal.torn-0")).unwrap(),
        torn
    );
    reopened.enqueue(msg("c", "chat-1")).unwrap();
    assert_eq!(
        h.reopen().list_items().unwrap().len(),
        3,
        "the next entry takes the torn one's place"
    );
    reopened.verify_audit().unwrap();
}

#[test]
fn damage_inside_the_journal_is_reported_and_the_journal_left_alone() {
    let h = Harness::new();
    h.enqueue("a", "chat-1");
    h.enqueue("b", "chat-1");
    let mut bytes = std::fs::read(h.path("outbox.journal")).unwrap();
    let first_entry = bytes.iter().position(|b| *b == b'\n').unwrap() + 40;
    bytes[first_entry] ^= 0x20;
    std::fs::write(h.path("outbox.journal"), &bytes).unwrap();
    let err = Outbox::open(h.dir.path()).unwrap_err();
    assert!(
        matches!(&err, durable_outbox::Error::InvalidRecord { path, location, .. }
            if path.ends_with("outbox.journal") && location.starts_with("byte ")),
        "{err}"
    );
    assert_eq!(std::fs::read(h.path("outbox.journal")).unwrap(), bytes);
}

#[test]
fn stale_temp_files_from_crashed_writers_are_swept_on_open() {
    let h = Harness::new();
    h.enqueue("k", "chat-1");
    let stale = h.path(".outbox-tmp-crashed123.tmp");
    std::fs::write(&stale, b"half a file").unwrap();
    let unrelated = h.path("notes.txt");
    std::fs::write(&unrelated, b"mine").unwrap();
    let _again = h.reopen();
    assert!(!stale.exists(), "the stale temp file was removed");
    assert!(unrelated.exists(), "other files are left alone");
    assert_eq!(h.reopen().list_items().unwrap().len(), 1);
}

#[test]
fn owner_files_of_closed_handles_are_removed() {
    let h = Harness::new();
    let count = || std::fs::read_dir(h.path("owners")).unwrap().count();
    assert_eq!(count(), 1);
    let second = h.reopen();
    assert_eq!(count(), 2);
    drop(second);
    assert_eq!(count(), 1);
}

#[test]
fn a_symlink_planted_at_the_lock_path_is_not_followed() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("elsewhere");
    std::fs::write(&target, b"precious").unwrap();
    #[cfg(unix)]
    std::os::unix::fs::symlink(&target, dir.path().join("outbox.lock")).unwrap();
    #[cfg(unix)]
    {
        let err = Outbox::open(dir.path()).unwrap_err();
        assert!(err.to_string().contains("outbox.lock"), "{err}");
        assert_eq!(std::fs::read(&target).unwrap(), b"precious");
    }
}

on_both_engines! {
    fn data_survives_reopening(engine) {
        let h = engine.harness();
        h.outbox.enqueue(msg("k", "chat-1")).unwrap();
        h.outbox.process("k", |_| Ok(Some("tg-1".into()))).unwrap();
        let again = engine.open_real_clock_with(|b| b);
        assert_eq!(
            again
                .find_by_transport_ref("tg-1")
                .unwrap()
                .unwrap()
                .idempotency_key(),
            "k"
        );
        again.verify_audit().unwrap();
    }
}

#[test]
fn opening_without_compaction_leaves_snapshot_and_journal_as_they_are() {
    let h = Harness::new();
    h.enqueue("a", "chat-1");
    let (snapshot, journal) = (
        h.state_bytes(),
        std::fs::read(h.path("outbox.journal")).unwrap(),
    );
    let looker = Outbox::builder(h.dir.path())
        .compact_on_open(false)
        .open()
        .unwrap();
    assert_eq!(looker.list_items().unwrap().len(), 1);
    assert_eq!(h.state_bytes(), snapshot);
    assert_eq!(std::fs::read(h.path("outbox.journal")).unwrap(), journal);
    drop(looker);
    let _compacting = h.reopen();
    assert_ne!(h.state_bytes(), snapshot, "the default open compacts");
}

#[test]
fn a_damaged_journal_header_with_entries_after_it_is_reported_not_replaced() {
    let h = Harness::new();
    h.enqueue("a", "chat-1");
    let mut bytes = std::fs::read(h.path("outbox.journal")).unwrap();
    bytes[3] ^= 0x01; // inside the header's checksum
    std::fs::write(h.path("outbox.journal"), &bytes).unwrap();
    let err = Outbox::open(h.dir.path()).unwrap_err();
    assert!(
        matches!(&err, durable_outbox::Error::InvalidRecord { location, .. } if location == "line 1"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(h.path("outbox.journal")).unwrap(),
        bytes,
        "left as it was"
    );
}
