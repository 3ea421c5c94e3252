//! Nobody else's files: the outbox refuses a directory or state file another
//! user prepared or can write, never follows a planted link, and a keyed audit
//! log protects its own starting point (`audit.anchor`) and end (the head
//! `outbox.json` records) against someone without the key.
//!
//! File-only by design: ownership and modes of the directory and its files,
//! planted links, the keyed log's anchor file.

use std::fs;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::Path;
use std::time::Duration;

use durable_outbox::{Error, Outbox};

use crate::harness::{Harness, builder, msg};

/// A uid no account on a test machine has: "another local user".
const STRANGER: u32 = 4242;
const KEY: &[u8] = b"the bot's audit key";

/// Gives `path` to [`STRANGER`]. Only root may; elsewhere the test cannot run:
/// it fails when `CI` is set and is skipped (with a reason) otherwise.
fn give_to_stranger(path: &Path) -> bool {
    match std::os::unix::fs::lchown(path, Some(STRANGER), None) {
        Ok(()) => true,
        Err(e) if e.kind() != std::io::ErrorKind::PermissionDenied => {
            panic!("chown {}: {e}", path.display())
        }
        Err(e) if std::env::var_os("CI").is_some() => {
            panic!("this test needs to chown a file to another uid (run as root): {e}")
        }
        Err(e) => {
            eprintln!("skipped: cannot chown to another uid without root ({e})");
            false
        }
    }
}

fn chmod(path: &Path, mode: u32) {
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).unwrap();
}

/// The names in `dir`, sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Asserts `result` is [`Error::Untrusted`] about `path`, and returns its
/// reason and fix.
fn untrusted<T>(result: durable_outbox::Result<T>, path: &Path) -> (u32, u32, String, String) {
    match result {
        Err(Error::Untrusted {
            path: refused,
            owner,
            mode,
            reason,
            fix,
        }) => {
            assert_eq!(refused, path, "the error names the file to fix");
            (owner, mode, reason, fix)
        }
        Err(other) => panic!("expected Untrusted for {}, got {other}", path.display()),
        Ok(_) => panic!("{} was trusted", path.display()),
    }
}

// ----- 1. directories and state files of another user -----------------------

#[test]
fn an_existing_directory_another_user_owns_is_refused_and_left_untouched() {
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("outbox");
    fs::create_dir(&dir).unwrap();
    chmod(&dir, 0o755);
    if !give_to_stranger(&dir) {
        return;
    }
    let (owner, mode, reason, fix) = untrusted(Outbox::open(&dir), &dir);
    assert_eq!((owner, mode), (STRANGER, 0o755));
    assert!(
        reason.contains(&format!("owned by uid {STRANGER}")),
        "{reason}"
    );
    assert!(fix.contains("chown"), "{fix}");
    assert!(listing(&dir).is_empty(), "nothing was created in it");
}

#[test]
fn a_world_writable_journal_planted_in_the_directory_is_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("outbox.journal");
    fs::write(&journal, b"").unwrap();
    chmod(&journal, 0o666);
    let (_, mode, reason, fix) = untrusted(Outbox::open(dir.path()), &journal);
    assert_eq!(mode, 0o666);
    assert!(reason.contains("others can write it"), "{reason}");
    assert!(fix.contains("chmod o-w"), "{fix}");
    assert_eq!(
        listing(dir.path()),
        ["outbox.journal"],
        "no lock, no owner file"
    );
    let message = Outbox::open(dir.path()).unwrap_err().to_string();
    assert!(message.contains("outbox.journal"), "{message}");
}

#[test]
fn a_state_and_audit_log_another_user_planted_are_refused() {
    // Another user who plants outbox.json and audit.jsonl would have their own
    // queued message sent as the bot's.
    let planted = Harness::new();
    planted.enqueue("theirs", "chat-victim");
    planted.outbox.compact().unwrap();
    let state = planted.path("outbox.json");
    for name in [
        "outbox.json",
        "audit.jsonl",
        "outbox.journal",
        "outbox.lock",
    ] {
        if !give_to_stranger(&planted.path(name)) {
            return;
        }
    }
    // Whichever it meets first, a planted file is refused.
    match Outbox::open(planted.dir.path()) {
        Err(Error::Untrusted { owner, path, .. }) => {
            assert_eq!(owner, STRANGER);
            assert_eq!(path.parent(), Some(planted.dir.path()));
        }
        other => panic!("expected Untrusted, got {:?}", other.map(|_| ())),
    }
    // Given back, the same files open: the check is about ownership only.
    for name in [
        "outbox.json",
        "audit.jsonl",
        "outbox.journal",
        "outbox.lock",
    ] {
        std::os::unix::fs::lchown(planted.path(name), Some(0), None).unwrap();
    }
    assert!(state.exists());
    let outbox = Outbox::open(planted.dir.path()).unwrap();
    assert!(outbox.get("theirs").unwrap().is_some());
}

#[test]
fn files_in_owners_and_history_are_checked_too() {
    let h = Harness::with(|b| b.history_after(Duration::from_secs(3600)));
    h.enqueue("old", "chat-1");
    h.outbox.process("old", |_| Ok(Some("m-1".into()))).unwrap();
    h.clock.advance(Duration::from_secs(2 * 3600));
    h.outbox.compact().unwrap();
    let segment = fs::read_dir(h.path("history"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "log"))
        .expect("a history segment");
    chmod(&segment, 0o622);
    let (_, _, reason, _) = untrusted(builder(h.dir.path(), &h.clock).open(), &segment);
    assert!(reason.contains("others can write it"), "{reason}");
    chmod(&segment, 0o600);

    let stranger_owner = h.path("owners").join("1-planted-0.owner");
    fs::write(&stranger_owner, b"").unwrap();
    if !give_to_stranger(&stranger_owner) {
        return;
    }
    untrusted(builder(h.dir.path(), &h.clock).open(), &stranger_owner);
}

#[test]
fn a_group_writable_directory_opens_only_when_that_group_is_trusted() {
    let dir = tempfile::tempdir().unwrap();
    chmod(dir.path(), 0o2770);
    let (_, mode, reason, fix) = untrusted(Outbox::open(dir.path()), dir.path());
    assert_eq!(mode, 0o2770);
    assert!(reason.contains("can write it"), "{reason}");
    let gid = {
        use std::os::unix::fs::MetadataExt;
        fs::metadata(dir.path()).unwrap().gid()
    };
    assert!(fix.contains(&format!("shared_group({gid})")), "{fix}");

    // Trusting another group does not help; trusting this one does.
    untrusted(
        Outbox::builder(dir.path()).shared_group(gid + 1).open(),
        dir.path(),
    );
    let outbox = Outbox::builder(dir.path())
        .shared_group(gid)
        .open()
        .unwrap();
    outbox.enqueue(msg("k", "chat-1")).unwrap();
    drop(outbox);

    // Writable by others is never accepted, shared group or not.
    chmod(dir.path(), 0o2777);
    let (_, _, reason, fix) = untrusted(
        Outbox::builder(dir.path()).shared_group(gid).open(),
        dir.path(),
    );
    assert!(reason.contains("others can write it"), "{reason}");
    assert!(fix.contains("chmod o-w"), "{fix}");
}

#[test]
fn a_directory_owned_by_another_member_of_the_trusted_group_opens() {
    let dir = tempfile::tempdir().unwrap();
    chmod(dir.path(), 0o2770);
    if !give_to_stranger(dir.path()) {
        return;
    }
    untrusted(Outbox::open(dir.path()), dir.path());
    let gid = {
        use std::os::unix::fs::MetadataExt;
        fs::metadata(dir.path()).unwrap().gid()
    };
    Outbox::builder(dir.path())
        .shared_group(gid)
        .open()
        .expect("a group member's directory, when the group is trusted");
}

#[test]
fn a_planted_symlink_in_place_of_a_state_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let target = elsewhere.path().join("their.json");
    fs::write(&target, b"{}").unwrap();
    let link = dir.path().join("outbox.json");
    symlink(&target, &link).unwrap();
    let (_, _, reason, _) = untrusted(Outbox::open(dir.path()), &link);
    assert!(reason.contains("symbolic link"), "{reason}");
}

// ----- 2. history/ is never followed -----------------------------------------

/// An outbox with one sent item old enough to move to history at the next compaction.
fn with_history_due() -> Harness {
    let h = Harness::with(|b| b.history_after(Duration::from_secs(3600)));
    h.enqueue("old", "chat-1");
    h.outbox.process("old", |_| Ok(Some("m-1".into()))).unwrap();
    h.clock.advance(Duration::from_secs(2 * 3600));
    h
}

#[test]
fn a_history_symlink_planted_before_open_is_refused() {
    let h = with_history_due();
    let elsewhere = tempfile::tempdir().unwrap();
    let link = h.path("history");
    symlink(elsewhere.path(), &link).unwrap();
    let (_, _, reason, _) = untrusted(builder(h.dir.path(), &h.clock).open(), &link);
    assert!(reason.contains("symbolic link"), "{reason}");
    assert!(
        listing(elsewhere.path()).is_empty(),
        "no body was written there"
    );
}

#[test]
fn a_history_symlink_planted_while_open_is_not_followed() {
    let h = with_history_due();
    let elsewhere = tempfile::tempdir().unwrap();
    symlink(elsewhere.path(), h.path("history")).unwrap();
    let err = h.outbox.compact().unwrap_err();
    assert!(
        matches!(&err, Error::Io { path, .. } if path.ends_with("history")),
        "{err}"
    );
    assert!(
        listing(elsewhere.path()).is_empty(),
        "no body was written there"
    );
    // The item stays live and findable.
    assert!(h.outbox.get("old").unwrap().is_some());
}

// ----- 3. keyed audit: the anchor is authenticated ---------------------------

/// A keyed outbox with three items, compacted (so the journal is empty).
fn keyed_with_three() -> Harness {
    let h = Harness::with(|b| b.audit_key(KEY));
    for key in ["first", "second", "third"] {
        h.enqueue(key, "chat-1");
    }
    h.outbox.compact().unwrap();
    h
}

fn audit_lines(h: &Harness) -> Vec<String> {
    String::from_utf8(h.audit_bytes())
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

fn write_lines(path: &Path, lines: &[String]) {
    let mut text = lines.join("\n");
    text.push('\n');
    fs::write(path, text).unwrap();
}

/// The state with `key` removed from its items and `edit` applied to its head.
fn edit_state(h: &Harness, drop_key: Option<&str>, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut state: serde_json::Value = serde_json::from_slice(&h.state_bytes()).unwrap();
    if let Some(key) = drop_key {
        state["items"]
            .as_array_mut()
            .unwrap()
            .retain(|item| item["idempotency_key"] != key);
    }
    edit(&mut state["audit_head"]);
    fs::write(
        h.path("outbox.json"),
        serde_json::to_vec_pretty(&state).unwrap(),
    )
    .unwrap();
}

fn keyed(h: &Harness) -> durable_outbox::Result<Outbox> {
    builder(h.dir.path(), &h.clock).audit_key(KEY).open()
}

/// Opening, then a full verification: the first error of either.
fn open_and_verify(h: &Harness) -> durable_outbox::Result<durable_outbox::AuditReport> {
    keyed(h)?.verify_audit()
}

#[test]
fn a_planted_anchor_cannot_cut_the_front_of_a_keyed_log() {
    let h = keyed_with_three();
    let lines = audit_lines(&h);
    let first: serde_json::Value = serde_json::from_str(&lines[0]).unwrap();
    assert_eq!(first["idempotency_key"], "first");
    // Without the key: delete the first item's record, start the chain after
    // it, and drop the item from the state.
    write_lines(&h.path("audit.jsonl"), &lines[1..]);
    let anchor = serde_json::json!({"seq": 1, "hash": first["hash"]});
    fs::write(h.path("audit.anchor"), anchor.to_string()).unwrap();
    edit_state(&h, Some("first"), |_| {});
    let err = open_and_verify(&h).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidRecord { path, location, .. }
            if path.ends_with("audit.anchor") && location == "mac"),
        "{err}"
    );

    // Nor does an anchor with a made-up MAC.
    let forged = serde_json::json!({
        "seq": 1, "hash": first["hash"], "removed_at_seq": 3, "mac": "ab".repeat(32)
    });
    fs::write(h.path("audit.anchor"), forged.to_string()).unwrap();
    let err = open_and_verify(&h).unwrap_err();
    assert!(err.to_string().contains("MAC does not match"), "{err}");
}

#[test]
fn a_keyed_removal_of_old_segments_still_verifies_and_reopens() {
    let h = Harness::with(|b| b.audit_key(KEY).audit_rotate_bytes(1024));
    for round in 0..3 {
        for i in 0..4 {
            h.enqueue(&format!("r{round}-{i}"), "chat-1");
        }
        h.outbox.compact().unwrap();
    }
    assert_eq!(
        h.outbox
            .remove_old_audit_segments(1, "ops", "older than a year")
            .unwrap(),
        2
    );
    let anchor: serde_json::Value =
        serde_json::from_slice(&fs::read(h.path("audit.anchor")).unwrap()).unwrap();
    assert!(anchor["mac"].is_string(), "{anchor}");
    assert_eq!(h.outbox.verify_audit().unwrap().records, 5);
    let reopened = builder(h.dir.path(), &h.clock)
        .audit_key(KEY)
        .audit_rotate_bytes(1024)
        .open()
        .unwrap();
    reopened.enqueue(msg("after", "chat-2")).unwrap();
    assert_eq!(reopened.verify_audit().unwrap().records, 6);

    // The anchor's seq moved on without the key: refused.
    let mut moved = anchor.clone();
    moved["seq"] = serde_json::json!(anchor["seq"].as_u64().unwrap() + 1);
    fs::write(h.path("audit.anchor"), moved.to_string()).unwrap();
    assert!(reopened.verify_audit().is_err());
}

// ----- 4. keyed audit: the recorded head is authenticated ---------------------

#[test]
fn a_cut_tail_with_its_head_moved_back_is_caught_in_keyed_mode() {
    let h = keyed_with_three();
    let state: serde_json::Value = serde_json::from_slice(&h.state_bytes()).unwrap();
    assert!(state["audit_head"]["mac"].is_string(), "{state}");
    let lines = audit_lines(&h);
    let second: serde_json::Value = serde_json::from_str(&lines[1]).unwrap();
    // Without the key: cut the last record, drop its item, move the head back.
    write_lines(&h.path("audit.jsonl"), &lines[..2]);
    let offset = (lines[0].len() + lines[1].len() + 2) as u64;
    edit_state(&h, Some("third"), |head| {
        head["seq"] = second["seq"].clone();
        head["hash"] = second["hash"].clone();
        head["offset"] = offset.into();
    });
    let err = open_and_verify(&h).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidRecord { path, location, .. }
            if path.ends_with("outbox.json") && location == "audit_head.mac"),
        "{err}"
    );

    // Removing the MAC does not help either.
    edit_state(&h, None, |head| {
        head.as_object_mut().unwrap().remove("mac");
    });
    let err = open_and_verify(&h).unwrap_err();
    assert!(err.to_string().contains("carries no MAC"), "{err}");
}

#[test]
fn a_head_copied_from_an_older_snapshot_does_not_fit_a_newer_one() {
    let h = keyed_with_three();
    let older: serde_json::Value = serde_json::from_slice(&h.state_bytes()).unwrap();
    h.enqueue("fourth", "chat-1");
    h.outbox.compact().unwrap();
    // Cut the fourth record and put the older snapshot's (valid) head back,
    // keeping the newer generation so the journal still matches.
    let lines = audit_lines(&h);
    write_lines(&h.path("audit.jsonl"), &lines[..3]);
    edit_state(&h, Some("fourth"), |head| {
        *head = older["audit_head"].clone();
    });
    let err = open_and_verify(&h).unwrap_err();
    assert!(err.to_string().contains("MAC does not match"), "{err}");
}

#[test]
fn a_plain_log_is_unaffected_by_head_macs() {
    let h = Harness::new();
    h.enqueue("k", "chat-1");
    h.outbox.compact().unwrap();
    let state: serde_json::Value = serde_json::from_slice(&h.state_bytes()).unwrap();
    assert!(state["audit_head"].get("mac").is_none(), "{state}");
    assert_eq!(h.reopen().verify_audit().unwrap().records, 1);
}
