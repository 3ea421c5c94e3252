//! The file engine's files stay byte-compatible: the golden workload
//! ([`workload`]: retries, a `retry_after`, a cap deferral, ambiguous and
//! permanent failures, cancel, requeue, a bulk requeue, compaction, all on a
//! manual clock with fixed keys) writes today exactly the `outbox.json`,
//! `audit.jsonl` and journal text that the code before the delivery rules
//! were split from the engines (commit `6d8a87b`) wrote. The fixture and how
//! to regenerate it: `fixtures/golden-v1/README.md`.
//!
//! Compared byte for byte: `outbox.json` and `audit.jsonl` whole (nothing
//! normalised: after the final compaction neither holds an owner id, and every
//! time comes from the manual clock), and `outbox.journal` up to its
//! zero-filled preallocation (after the compaction only its header line; the
//! entries before it name the writing handle's owner id, pid and wall time,
//! and are gone). Owner files and the lock file are not compared.
//!
//! File-only by design: PostgreSQL has no files; its audit records are
//! checked against the same verifier in `deferred_sealing` and `migration`.

#[path = "byte_compat/workload.rs"]
mod workload;

use std::path::Path;

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/golden-v1");

/// The journal's text: everything before the zero fill that preallocates it.
fn journal_text(path: &Path) -> Vec<u8> {
    let bytes = std::fs::read(path).expect("read outbox.journal");
    let end = bytes.iter().position(|b| *b == 0).unwrap_or(bytes.len());
    assert!(
        bytes[end..].iter().all(|b| *b == 0),
        "only zeros follow the journal's text"
    );
    bytes[..end].to_vec()
}

/// Asserts `actual` equals the fixture file `name`, naming the first line
/// that differs.
fn assert_same_bytes(name: &str, actual: &[u8]) {
    let expected = std::fs::read(Path::new(FIXTURE).join(name)).expect("read the fixture");
    if actual == expected.as_slice() {
        return;
    }
    let (actual_text, expected_text) = (
        String::from_utf8_lossy(actual),
        String::from_utf8_lossy(&expected),
    );
    let first_difference = actual_text
        .lines()
        .zip(expected_text.lines())
        .enumerate()
        .find(|(_, (a, e))| a != e);
    match first_difference {
        Some((line, (a, e))) => panic!(
            "{name} is no longer byte-compatible with commit 6d8a87b: line {}\n  now: {a}\n  was: {e}",
            line + 1
        ),
        None => panic!(
            "{name} is no longer byte-compatible with commit 6d8a87b: {} bytes now, {} then \
             (one is a prefix of the other)",
            actual.len(),
            expected.len()
        ),
    }
}

#[test]
fn the_golden_workload_writes_the_same_bytes_as_before_the_rules_split() {
    let dir = tempfile::tempdir().expect("temp dir");
    workload::run(dir.path());
    let read = |name: &str| std::fs::read(dir.path().join(name)).expect("read an outbox file");
    assert_same_bytes("audit.jsonl", &read("audit.jsonl"));
    assert_same_bytes("outbox.json", &read("outbox.json"));
    assert_same_bytes(
        "outbox.journal.text",
        &journal_text(&dir.path().join("outbox.journal")),
    );
    // The fixture is a chain today's verifier accepts, not only equal bytes.
    let report = durable_outbox::AuditLog::verify(dir.path().join("audit.jsonl"))
        .expect("the golden audit log verifies");
    assert_eq!(report.records, 31);
}

#[test]
fn the_golden_outbox_opens_and_reads_the_same_today() {
    let dir = tempfile::tempdir().expect("temp dir");
    for name in ["outbox.json", "audit.jsonl"] {
        std::fs::copy(Path::new(FIXTURE).join(name), dir.path().join(name)).expect("copy");
    }
    let clock = durable_outbox::ManualClock::at(workload::START).expect("clock");
    let outbox = durable_outbox::Outbox::builder(dir.path())
        .clock(clock)
        .open()
        .expect("the fixture opens");
    let states: Vec<(String, String)> = outbox
        .list_items()
        .expect("list")
        .iter()
        .map(|i| {
            (
                i.idempotency_key().to_owned(),
                format!("{:?}:{}", i.state(), i.error_code().unwrap_or("-")),
            )
        })
        .collect();
    let expected: Vec<(String, String)> = [
        ("cap-1", "Sent:-"),
        ("cap-2", "Sent:-"),
        ("cap-3", "Sent:-"),
        ("down-1", "Sent:-"),
        ("down-2", "Sent:-"),
        ("flaky", "Sent:-"),
        ("maybe", "Sent:-"),
        ("ok", "Sent:-"),
        ("rejected", "Failed:chat_not_found"),
        ("slow-down", "Sent:-"),
        ("unwanted", "Failed:cancelled_by_operator"),
    ]
    .iter()
    .map(|(k, s)| ((*k).to_owned(), (*s).to_owned()))
    .collect();
    assert_eq!(states, expected);
    assert_eq!(outbox.verify_audit().expect("verify").records, 31);
}
