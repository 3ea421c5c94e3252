//! The keyed audit log protects its own starting point (`audit.anchor`) and
//! end (the head `outbox.json` records) against someone without the key.

use std::fs;
use std::path::Path;

use durable_outbox::{Error, Outbox};

use crate::harness::{Harness, builder, msg};

const KEY: &[u8] = b"the bot's audit key";

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
    fs::write(h.path("outbox.json"), serde_json::to_vec_pretty(&state).unwrap()).unwrap();
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
    edit_state(&h, Some("fourth"), |head| *head = older["audit_head"].clone());
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
