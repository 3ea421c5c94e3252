//! The tool keeps the audit key private and refuses outboxes other users could
//! have prepared, saying what to fix.

use std::fs;
use std::os::unix::fs::PermissionsExt;

use crate::harness::{Fixture, message};

const KEY: &[u8] = b"bot secret";

/// A keyed outbox with one item and its key in a file of mode `mode`.
fn keyed(mode: u32) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let outbox = durable_outbox::Outbox::builder(dir.path().join("outbox"))
        .audit_key(KEY.to_vec())
        .open()
        .unwrap();
    outbox.enqueue(message("k", "chat-1")).unwrap();
    let key_file = dir.path().join("audit.key");
    fs::write(&key_file, KEY).unwrap();
    fs::set_permissions(&key_file, fs::Permissions::from_mode(mode)).unwrap();
    (dir, key_file)
}

fn verify(dir: &tempfile::TempDir, extra: &[&str]) -> crate::harness::Run {
    let outbox = dir.path().join("outbox");
    let mut args = vec!["verify", outbox.to_str().unwrap()];
    args.extend_from_slice(extra);
    crate::harness::cli(args)
}

#[test]
fn a_key_file_others_can_read_is_refused_with_the_fix() {
    for mode in [0o644, 0o640, 0o604] {
        let (dir, key_file) = keyed(mode);
        let key = key_file.to_str().unwrap();
        verify(&dir, &["--audit-key-file", key])
            .exits(2)
            .complains(&format!("mode {mode:04o}"))
            .complains("group or others")
            .complains(&format!("chmod 600 {key}"))
            .complains("--allow-readable-key-file");
    }
}

#[test]
fn a_private_key_file_is_used_and_the_override_is_explicit() {
    let (dir, key_file) = keyed(0o600);
    let key = key_file.to_str().unwrap();
    verify(&dir, &["--audit-key-file", key])
        .exits(0)
        .says("verified");
    fs::set_permissions(&key_file, fs::Permissions::from_mode(0o644)).unwrap();
    verify(
        &dir,
        &["--audit-key-file", key, "--allow-readable-key-file"],
    )
    .exits(0)
    .says("verified");
}

#[test]
fn an_outbox_others_can_write_is_refused_with_the_fix() {
    let f = Fixture::demo();
    fs::set_permissions(f.path(), fs::Permissions::from_mode(0o777)).unwrap();
    f.run("status", &[])
        .exits(1)
        .complains("others can write it")
        .complains(&format!("chmod o-w {}", f.path().display()));
}

/// Copies of every regular file in `dir`.
fn snapshot(dir: &std::path::Path) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| {
            let bytes = fs::read(&p).unwrap();
            (p, bytes)
        })
        .collect()
}

#[test]
fn a_head_kept_off_host_catches_an_outbox_restored_from_an_earlier_copy() {
    let dir = tempfile::tempdir().unwrap();
    let outbox = durable_outbox::Outbox::open(dir.path()).unwrap();
    outbox.enqueue(message("first", "chat-1")).unwrap();
    drop(outbox);
    let earlier = snapshot(dir.path());
    let outbox = durable_outbox::Outbox::open(dir.path()).unwrap();
    outbox.enqueue(message("second", "chat-1")).unwrap();
    let head = outbox.audit_head().unwrap();
    drop(outbox);
    let expect = format!("{}:{}", head.seq, head.hash);
    let verify = |extra: &[&str]| {
        let mut args = vec!["verify", dir.path().to_str().unwrap()];
        args.extend_from_slice(extra);
        crate::harness::cli(args)
    };
    verify(&["--expect-head", &expect]).exits(0).says(&format!(
        "the log holds the expected head, seq {}",
        head.seq
    ));

    // Every file put back as it was: consistent, so only the outside copy tells.
    for (path, bytes) in &earlier {
        fs::write(path, bytes).unwrap();
    }
    verify(&[]).exits(0).says("verified");
    verify(&["--expect-head", &expect])
        .exits(1)
        .says("restored from an earlier copy")
        .says("NOT VERIFIED");

    let rewritten = format!("1:{}", "ab".repeat(32));
    verify(&["--expect-head", &rewritten])
        .exits(1)
        .says("the log was rewritten");
    verify(&["--expect-head", "12"])
        .exits(2)
        .complains("expected SEQ:HASH");
}
