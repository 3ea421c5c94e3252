//! Files are private, complete JSON after every call, and crash leftovers are cleaned up.

use durable_outbox::Outbox;

use crate::harness::{Harness, msg};

#[cfg(unix)]
#[test]
fn every_file_the_outbox_creates_is_private() {
    use std::os::unix::fs::PermissionsExt;
    let h = Harness::new();
    h.enqueue("k", "chat-1");
    for name in ["outbox.json", "audit.jsonl", "outbox.lock"] {
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

#[test]
fn the_state_file_is_complete_json_with_the_audit_head_after_every_call() {
    let h = Harness::new();
    for i in 0..5 {
        h.enqueue(&format!("k{i}"), "chat-1");
        let value: serde_json::Value = serde_json::from_slice(&h.state_bytes()).unwrap();
        assert_eq!(value["version"], 2);
        assert_eq!(value["items"].as_array().unwrap().len(), i + 1);
        // The head recorded is the log's head before this call's own record.
        assert_eq!(value["audit_head"]["seq"], i as u64);
        assert_eq!(value["pending_audit"].as_array().unwrap().len(), 1);
    }
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

#[test]
fn data_survives_reopening() {
    let h = Harness::new();
    h.outbox.enqueue(msg("k", "chat-1")).unwrap();
    h.outbox.process("k", |_| Ok(Some("tg-1".into()))).unwrap();
    let again = Outbox::open(h.dir.path()).unwrap();
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
