//! `verify`: a tampered, truncated or inconsistent outbox exits 1 naming the first
//! bad line; a sound one exits 0.

use crate::harness::Fixture;

/// Changes one hex digit of the content hash in line `line` of audit.jsonl: the
/// line stays valid JSON, so only the chain can tell. The log is compacted
/// first, so the record is durable: past the durable head, a bad line is what
/// a power cut leaves, and opening rebuilds it from the journal instead.
pub fn flip_a_byte_in_line(f: &Fixture, line: usize) {
    f.outbox.compact().unwrap();
    let path = f.file("audit.jsonl");
    let mut bytes = std::fs::read(&path).unwrap();
    let start: usize = bytes
        .split(|b| *b == b'\n')
        .take(line - 1)
        .map(|l| l.len() + 1)
        .sum();
    let field = b"\"content_hash\":\"";
    let at = start
        + bytes[start..]
            .windows(field.len())
            .position(|w| w == field)
            .unwrap()
        + field.len();
    bytes[at] = if bytes[at] == b'0' { b'1' } else { b'0' };
    std::fs::write(&path, bytes).unwrap();
}

#[test]
fn a_sound_outbox_verifies() {
    let f = Fixture::demo();
    let records = f.outbox.audit_head().unwrap().seq;
    f.run("verify", &[])
        .exits(0)
        .says(&format!("ok      audit chain: {records} records"))
        .says("verified");
    let report = f.run("verify", &["--json"]).exits(0).json();
    assert_eq!(report["verified"], true);
    assert_eq!(report["records"], f.outbox.audit_head().unwrap().seq);
    assert_eq!(report["items"], 6);
}

#[test]
fn a_flipped_byte_fails_naming_its_line() {
    let f = Fixture::demo();
    flip_a_byte_in_line(&f, 7);
    f.run("verify", &[])
        .exits(1)
        .says("FAILED")
        .says("line 7: hash mismatch")
        .says("NOT VERIFIED")
        .complains("verification failed");
    let report = f.run("verify", &["--json"]).exits(1).json();
    assert_eq!(report["verified"], false);
    assert_eq!(report["first_bad_line"], 7);
}

#[test]
fn a_cut_off_tail_is_caught_against_the_recorded_head() {
    let f = Fixture::demo();
    // Folded into outbox.json, the records are no longer in the journal to repair from.
    f.outbox.compact().unwrap();
    let path = f.file("audit.jsonl");
    let text = std::fs::read_to_string(&path).unwrap();
    let keep: Vec<&str> = text.lines().collect();
    std::fs::write(&path, format!("{}\n", keep[..keep.len() - 1].join("\n"))).unwrap();
    f.run("verify", &[]).exits(1).says("truncated");
}

#[test]
fn a_record_for_an_item_missing_from_the_state_is_named() {
    let f = Fixture::demo();
    f.outbox.compact().unwrap();
    let path = f.file("outbox.json");
    let mut state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let items = state["items"].as_array_mut().unwrap();
    items.retain(|i| i["idempotency_key"] != "gone-1");
    std::fs::write(&path, serde_json::to_vec(&state).unwrap()).unwrap();
    let first_record_of_gone = f.outbox.history("gone-1").unwrap()[0].seq;
    let report = f.run("verify", &["--json"]).exits(1).json();
    assert_eq!(report["first_bad_line"], first_record_of_gone);
    assert!(
        report["problems"][0]["message"]
            .as_str()
            .unwrap()
            .contains("\"gone-1\": has records, but the outbox has no such item"),
        "{report}"
    );
}

#[test]
fn progress_goes_to_stderr_when_asked_for() {
    let f = Fixture::demo();
    let records = f.outbox.audit_head().unwrap().seq;
    f.run("verify", &["--progress"])
        .exits(0)
        .complains("verify: opening the outbox")
        .complains("verify: checking every record of the audit chain")
        .complains(&format!(
            "verify: cross-checking {records} records against the items"
        ));
    let quiet = f.run("verify", &[]);
    assert_eq!(
        quiet.exits(0).stderr,
        "",
        "no progress when stderr is not a terminal"
    );
}

#[test]
fn a_keyed_log_verifies_with_its_key_file_and_hints_without_it() {
    let dir = tempfile::tempdir().unwrap();
    let key = b"bot secret";
    let outbox = durable_outbox::Outbox::builder(dir.path())
        .audit_key(key.to_vec())
        .open()
        .unwrap();
    outbox
        .enqueue(crate::harness::message("k", "chat-1"))
        .unwrap();
    let key_file = dir.path().join("audit.key");
    std::fs::write(&key_file, key).unwrap();
    // Private, as the tool requires of a key file (see `security`).
    #[cfg(unix)]
    std::fs::set_permissions(
        &key_file,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec!["verify", dir.path().to_str().unwrap()];
        args.extend_from_slice(extra);
        crate::harness::cli(args)
    };
    run(&["--audit-key-file", key_file.to_str().unwrap()])
        .exits(0)
        .says("verified");
    run(&[])
        .exits(1)
        .says("line 1: hash mismatch")
        .says("--audit-key-file");
}

/// A young outbox has a journal and no snapshot yet: the report must not
/// name a file the operator cannot find.
#[test]
fn verify_names_only_state_files_that_exist() {
    let f = crate::harness::Fixture::empty();
    f.outbox
        .enqueue(crate::harness::message("k", "chat-1"))
        .unwrap();
    assert!(!f.file("outbox.json").exists(), "no snapshot yet");
    let run = f.run("verify", &[]);
    run.exits(0)
        .says("the log reaches the head outbox.journal recorded");
    assert!(!run.stdout.contains("outbox.json"), "{}", run.stdout);
}
