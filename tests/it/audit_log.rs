//! The audit log: a verifiable chain with one record per outcome, and never a body.
//!
//! Bodies in `on_both_engines!` run on the file engine and on PostgreSQL
//! (`name::file`, `name::postgres`). File-only here: the `#[test]`s read,
//! edit, tear or forge the lines of `audit.jsonl` (PostgreSQL's audit table
//! is checked against the same verifier in `deferred_sealing` and `migration`).

use std::fs;

use durable_outbox::{AuditFault, AuditLog, Error, GENESIS_HASH, Outbox, SendError};
use sha2::{Digest, Sha256};

use crate::engines::{EngineUnderTest, Kind, on_both_engines};
use crate::harness::{Harness, builder, files_starting_with, msg, secs};

/// A mixed workload: sends, retries, deferrals, failures.
fn busy() -> Harness {
    busy_on(&EngineUnderTest::file())
}

/// [`busy`] on the engine under test.
fn busy_on(engine: &EngineUnderTest) -> Harness {
    let h = engine.harness_with(|b| b.rate_limit(2, secs(60)));
    for i in 0..12 {
        h.enqueue(&format!("k{i:02}"), &format!("chat-{}", i % 3));
    }
    for i in 0..12 {
        let key = format!("k{i:02}");
        h.outbox
            .process(&key, |item| match i % 4 {
                0 => Ok(Some(format!("tr-{}", item.idempotency_key()))),
                1 => Err(SendError::permanent("chat_not_found")),
                2 if item.attempts() == 1 => Err(SendError::retryable("http_502")),
                _ => Ok(None),
            })
            .unwrap();
    }
    h
}

fn lines(h: &Harness) -> Vec<String> {
    String::from_utf8(h.audit_bytes())
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

fn write_lines(h: &Harness, lines: &[String]) {
    let text: String = lines.iter().flat_map(|l| [l.as_str(), "\n"]).collect();
    fs::write(h.path("audit.jsonl"), text).unwrap();
}

fn fault(err: Error) -> (u64, AuditFault) {
    match err {
        Error::AuditBroken { line, fault, .. } => (line, fault),
        other => panic!("expected AuditBroken, got {other}"),
    }
}

on_both_engines! {
    fn a_mixed_workload_verifies_clean_with_one_record_per_outcome(engine) {
        let h = busy_on(engine);
        let report = h.outbox.verify_audit().unwrap();
        let outcomes = h.audit_outcomes();
        assert_eq!(report.records, outcomes.len() as u64);
        for kind in ["queued", "sent", "failed", "deferred", "retrying"] {
            assert!(
                outcomes.iter().any(|o| o.starts_with(kind)),
                "no {kind} record in {outcomes:?}"
            );
        }
        if engine.kind == Kind::File {
            assert_eq!(report, AuditLog::verify(h.path("audit.jsonl")).unwrap());
        }
        assert_eq!(h.outbox.audit_head().unwrap().hash, report.head_hash);
    }

    fn no_message_body_ever_reaches_the_audit_log(engine) {
        let h = engine.harness();
        let secret = "the launch code is 0000";
        let mut m = msg("k", "chat-1");
        m.content = secret.into();
        h.outbox.enqueue(m).unwrap();
        h.outbox
            .process("k", |_| Err(SendError::retryable("x")))
            .unwrap();
        // File: the log's bytes. PostgreSQL: every field of every record.
        let audit = match engine.kind {
            Kind::File => String::from_utf8(h.audit_bytes()).unwrap(),
            #[cfg(feature = "postgres")]
            Kind::Postgres => serde_json::to_string(&h.audit_records()).unwrap(),
        };
        assert!(!audit.contains("launch code"));
        assert!(
            audit.contains(&hex::encode(Sha256::digest(secret.as_bytes()))),
            "the hash is recorded instead"
        );
    }

    fn history_lists_one_items_records_in_order(engine) {
        let h = busy_on(engine);
        let outcomes: Vec<_> = h
            .outbox
            .history("k02")
            .unwrap()
            .iter()
            .map(|r| r.outcome.as_str())
            .collect();
        assert_eq!(outcomes, ["queued", "retrying", "sent"]);
    }
}

/// Recomputes the chain with nothing but `serde_json` and `sha2`, as a third party would.
#[test]
fn an_independent_reverifier_agrees_with_verify() {
    let h = busy();
    let mut prev = GENESIS_HASH.to_owned();
    let mut seq = 0;
    for line in lines(&h) {
        let mut value: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(&line).unwrap();
        let hash = value.remove("hash").unwrap().as_str().unwrap().to_owned();
        seq += 1;
        assert_eq!(value["seq"], seq);
        assert_eq!(value["prev_hash"], prev.as_str());
        let canonical = serde_json::to_string(&value).unwrap(); // BTreeMap: sorted keys, compact
        assert_eq!(hex::encode(Sha256::digest(canonical.as_bytes())), hash);
        prev = hash;
    }
    assert_eq!(h.outbox.verify_audit().unwrap().head_hash, prev);
}

/// The Python snippet in the audit module docs, run for real when python3 exists.
#[test]
fn the_documented_python_verifier_accepts_the_log() {
    let h = busy();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/verify_audit.py");
    match std::process::Command::new("python3")
        .arg(script)
        .arg(h.path("audit.jsonl"))
        .output()
    {
        Err(e) => crate::harness::missing_tool("python3", &e.to_string()),
        Ok(out) => {
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let expected = format!("ok {}\n", h.outbox.verify_audit().unwrap().records);
            assert_eq!(String::from_utf8_lossy(&out.stdout), expected);
        }
    }
}

#[test]
fn an_edited_field_is_detected_at_its_line() {
    let h = busy();
    let mut l = lines(&h);
    l[4] = l[4].replace("\"attempts\":0", "\"attempts\":9");
    write_lines(&h, &l);
    assert_eq!(
        fault(h.outbox.verify_audit().unwrap_err()),
        (5, AuditFault::HashMismatch)
    );
    assert_eq!(
        fault(AuditLog::verify(h.path("audit.jsonl")).unwrap_err()),
        (5, AuditFault::HashMismatch)
    );
}

#[test]
fn a_deleted_line_is_detected() {
    let h = busy();
    let mut l = lines(&h);
    l.remove(3);
    write_lines(&h, &l);
    assert_eq!(
        fault(AuditLog::verify(h.path("audit.jsonl")).unwrap_err()),
        (4, AuditFault::BrokenLink)
    );
}

#[test]
fn swapped_lines_are_detected() {
    let h = busy();
    let mut l = lines(&h);
    l.swap(5, 6);
    write_lines(&h, &l);
    assert_eq!(
        fault(AuditLog::verify(h.path("audit.jsonl")).unwrap_err()).0,
        6
    );
}

#[test]
fn an_inserted_forged_line_with_a_correct_hash_is_detected() {
    let h = busy();
    let mut l = lines(&h);
    // Forge a record that links to line 2 and hashes correctly, and slip it in after it.
    let mut forged: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&l[1]).unwrap();
    let prev = forged.remove("hash").unwrap();
    forged.insert("prev_hash".into(), prev);
    forged.insert("seq".into(), 3.into());
    forged.insert("outcome".into(), "sent".into());
    let hash = hex::encode(Sha256::digest(
        serde_json::to_string(&forged).unwrap().as_bytes(),
    ));
    forged.insert("hash".into(), hash.into());
    l.insert(2, serde_json::to_string(&forged).unwrap());
    write_lines(&h, &l);
    let (line, fault) = fault(AuditLog::verify(h.path("audit.jsonl")).unwrap_err());
    assert_eq!(
        line, 4,
        "the forged line verifies, the next one cannot link to it"
    );
    assert_eq!(fault, AuditFault::BrokenLink);
}

#[test]
fn a_truncated_tail_is_detected_against_the_head_in_outbox_json() {
    let h = busy();
    // After a compaction the snapshot records the head and the journal no longer
    // holds the records: a cut-off tail cannot be rebuilt, only detected.
    h.outbox.compact().unwrap();
    let mut l = lines(&h);
    let total = l.len() as u64;
    l.truncate(l.len() - 3);
    write_lines(&h, &l);
    // The file alone still verifies: only the head recorded in outbox.json reveals the cut.
    assert_eq!(
        AuditLog::verify(h.path("audit.jsonl")).unwrap().records,
        total - 3
    );
    let err = Outbox::open(h.dir.path()).unwrap_err();
    assert!(matches!(fault(err).1, AuditFault::Truncated { .. }));
}

#[test]
fn records_cut_off_the_log_but_still_in_the_journal_are_restored_byte_for_byte() {
    let h = busy();
    let whole = h.audit_bytes();
    let mut l = lines(&h);
    l.truncate(l.len() - 3);
    write_lines(&h, &l);
    let reopened = h.reopen();
    reopened.verify_audit().unwrap();
    assert_eq!(h.audit_bytes(), whole, "the log is exactly as it was");
}

#[test]
fn a_torn_last_line_is_quarantined_and_the_chain_continues() {
    let h = busy();
    let before = h.outbox.verify_audit().unwrap();
    let mut bytes = h.audit_bytes();
    let torn = br#"{"attempts":1,"audit_id":"abc","conn"#;
    bytes.extend_from_slice(torn);
    fs::write(h.path("audit.jsonl"), &bytes).unwrap();
    assert_eq!(
        AuditLog::verify(h.path("audit.jsonl"))
            .unwrap()
            .torn_tail_bytes,
        torn.len() as u64
    );

    let reopened = builder(h.dir.path(), &h.clock)
        .rate_limit(2, secs(60))
        .open()
        .unwrap();
    let quarantined = files_starting_with(h.dir.path(), "audit.jsonl.torn-");
    assert_eq!(quarantined.len(), 1);
    assert_eq!(
        fs::read(&quarantined[0]).unwrap(),
        torn,
        "the torn bytes are kept, not dropped"
    );
    reopened.enqueue(msg("after", "chat-9")).unwrap();
    let after = reopened.verify_audit().unwrap();
    assert_eq!(after.records, before.records + 1);
    assert_eq!(after.torn_tail_bytes, 0);
}

#[test]
fn a_tail_of_zeros_is_treated_as_torn() {
    let h = busy();
    let mut bytes = h.audit_bytes();
    bytes.extend_from_slice(&[0u8; 300]);
    fs::write(h.path("audit.jsonl"), &bytes).unwrap();
    let reopened = h.reopen();
    reopened.verify_audit().unwrap();
}

#[test]
fn damage_in_the_middle_is_fatal_and_the_log_is_left_untouched() {
    let h = busy();
    // Reopening compacts: the log is fsynced and the snapshot records its head,
    // so every record is durable. (Damage past the durable head is what a power
    // cut leaves, and is repaired: see `power_loss_regressions`.)
    drop(h.reopen());
    let mut bytes = h.audit_bytes();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x01;
    fs::write(h.path("audit.jsonl"), &bytes).unwrap();
    // Opening trusts what the last compaction verified (it resumes at the head
    // the snapshot recorded); a full verification reports the damage.
    let reopened = Outbox::open(h.dir.path()).unwrap();
    assert!(matches!(
        reopened.verify_audit(),
        Err(Error::AuditBroken { .. })
    ));
    // A handle that verified the file earlier trusts those bytes for appends, but
    // its full verification still reports the damage.
    assert!(matches!(
        h.outbox.verify_audit(),
        Err(Error::AuditBroken { .. })
    ));
    assert_eq!(h.audit_bytes(), bytes);
}

#[test]
fn keyed_chains_reject_a_chain_recomputed_without_the_key() {
    let key = b"0123456789abcdef0123456789abcdef";
    let h = Harness::with(|b| b.audit_key(key.to_vec()));
    h.enqueue("a", "chat-1");
    h.outbox.process("a", |_| Ok(None)).unwrap();
    // Reopening compacts: both records become durable in the log itself, so a
    // forgery of them cannot pass for what a power cut left behind.
    drop(
        builder(h.dir.path(), &h.clock)
            .audit_key(key.to_vec())
            .open()
            .unwrap(),
    );
    let path = h.path("audit.jsonl");
    assert_eq!(AuditLog::verify_keyed(&path, key).unwrap().records, 2);
    assert_eq!(
        fault(AuditLog::verify(&path).unwrap_err()),
        (1, AuditFault::HashMismatch)
    );
    assert_eq!(
        fault(AuditLog::verify_keyed(&path, b"wrong key").unwrap_err()),
        (1, AuditFault::HashMismatch)
    );

    // An attacker edits a record and recomputes every hash with plain SHA-256.
    let mut prev = GENESIS_HASH.to_owned();
    let forged: Vec<String> = lines(&h)
        .iter()
        .map(|line| {
            let mut v: serde_json::Map<String, serde_json::Value> =
                serde_json::from_str(line).unwrap();
            v.remove("hash");
            v.insert("prev_hash".into(), prev.clone().into());
            v.insert("destination".into(), "chat-evil".into());
            prev = hex::encode(Sha256::digest(
                serde_json::to_string(&v).unwrap().as_bytes(),
            ));
            v.insert("hash".into(), prev.clone().into());
            serde_json::to_string(&v).unwrap()
        })
        .collect();
    write_lines(&h, &forged);
    assert!(
        AuditLog::verify(&path).is_ok(),
        "the forgery is a valid plain chain…"
    );
    assert_eq!(
        fault(AuditLog::verify_keyed(&path, key).unwrap_err()),
        (1, AuditFault::HashMismatch),
        "…but not a keyed one"
    );
    let err = builder(h.dir.path(), &h.clock)
        .audit_key(key.to_vec())
        .open()
        .unwrap_err();
    assert!(matches!(err, Error::AuditBroken { .. }), "{err}");
}

#[test]
fn a_seq_gap_is_named_even_when_hashes_and_links_are_recomputed() {
    let h = busy();
    let mut l = lines(&h);
    let mut v: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&l[2]).unwrap();
    v.remove("hash");
    v.insert("seq".into(), 7.into());
    let hash = hex::encode(Sha256::digest(
        serde_json::to_string(&v).unwrap().as_bytes(),
    ));
    v.insert("hash".into(), hash.into());
    l[2] = serde_json::to_string(&v).unwrap();
    write_lines(&h, &l);
    let (line, fault) = fault(AuditLog::verify(h.path("audit.jsonl")).unwrap_err());
    assert_eq!(
        (line, fault),
        (
            3,
            AuditFault::SeqGap {
                expected: 3,
                found: 7
            }
        )
    );
}

/// A crash can cut the last append anywhere: at every byte, recovery keeps the
/// previous record, quarantines exactly the partial bytes, and the chain goes on.
#[test]
fn a_last_record_torn_at_every_byte_is_recovered() {
    let h = busy();
    let whole = h.audit_bytes();
    let last_start = whole[..whole.len() - 1]
        .iter()
        .rposition(|b| *b == b'\n')
        .unwrap()
        + 1;
    let records = lines(&h).len() as u64;
    for cut in last_start + 1..whole.len() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("audit.jsonl"), &whole[..cut]).unwrap();
        let report = AuditLog::verify(dir.path().join("audit.jsonl")).unwrap();
        assert_eq!(report.records, records - 1, "cut at byte {cut}");
        assert_eq!(
            report.torn_tail_bytes,
            (cut - last_start) as u64,
            "cut at byte {cut}"
        );
    }
}

#[test]
fn reopening_after_a_torn_append_repairs_the_record_from_the_journal() {
    // The journal committed the outcome, the append was torn by the crash:
    // reopening quarantines the fragment and appends the record again, whole.
    let whole = busy().audit_bytes();
    let last_start = whole[..whole.len() - 1]
        .iter()
        .rposition(|b| *b == b'\n')
        .unwrap()
        + 1;
    for cut in (last_start + 1..whole.len()).step_by(53) {
        let h = busy();
        let whole = h.audit_bytes();
        fs::write(h.path("audit.jsonl"), &whole[..cut]).unwrap();
        let reopened = h.reopen();
        reopened.verify_audit().unwrap();
        assert_eq!(
            h.audit_bytes(),
            whole,
            "cut at byte {cut}: the record is restored exactly"
        );
        let torn: Vec<_> = fs::read_dir(h.dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.to_string_lossy().contains("audit.jsonl.torn-"))
            .collect();
        assert_eq!(torn.len(), 1, "cut at byte {cut}");
        assert_eq!(
            fs::read(&torn[0]).unwrap(),
            &whole[last_start..cut],
            "the fragment is kept"
        );
    }
}

#[test]
fn opening_resumes_verification_at_the_last_compaction_and_full_verify_still_finds_old_damage() {
    let h = busy();
    h.outbox.compact().unwrap(); // records the resume point in outbox.json
    h.enqueue("after", "chat-5");
    let mut bytes = h.audit_bytes();
    bytes[40] ^= 0x01; // inside the first record, long verified
    fs::write(h.path("audit.jsonl"), &bytes).unwrap();
    let reopened = Outbox::open(h.dir.path()).expect("open checks only the recent records");
    let (line, fault) = fault(reopened.verify_audit().unwrap_err());
    assert_eq!(
        (line, fault),
        (1, AuditFault::HashMismatch),
        "the full verification finds it"
    );
}

#[test]
fn a_log_that_does_not_match_the_resume_point_is_verified_from_the_start() {
    let h = busy();
    h.outbox.compact().unwrap();
    // Rewrite history: a log of a different chain, as long as the original.
    let other = busy_with_key(b"another chain");
    let mut bytes = other;
    bytes.resize(h.audit_bytes().len(), b'\n');
    fs::write(h.path("audit.jsonl"), &bytes).unwrap();
    assert!(matches!(
        Outbox::open(h.dir.path()),
        Err(Error::AuditBroken { .. })
    ));
}

/// The audit bytes of `busy()`'s workload under a keyed chain.
fn busy_with_key(key: &[u8]) -> Vec<u8> {
    let h = Harness::with(|b| b.rate_limit(2, secs(60)).audit_key(key.to_vec()));
    for i in 0..12 {
        h.enqueue(&format!("k{i:02}"), &format!("chat-{}", i % 3));
    }
    h.audit_bytes()
}

fn sealed_files(h: &Harness) -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> = fs::read_dir(h.dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.starts_with("audit-") && name.ends_with(".jsonl")
        })
        .collect();
    files.sort();
    files
}

#[test]
fn a_large_log_rotates_and_the_chain_continues_across_segments() {
    let h = Harness::with(|b| b.audit_rotate_bytes(1024));
    for i in 0..4 {
        h.enqueue(&format!("a{i}"), "chat-1");
    }
    h.outbox.compact().unwrap();
    let sealed = sealed_files(&h);
    assert_eq!(sealed.len(), 1, "sealed once past 1 KiB");
    assert!(sealed[0].ends_with("audit-000000000001.jsonl"));
    let sealed_bytes = fs::read(&sealed[0]).unwrap();
    assert!(
        !h.path("audit.jsonl").exists(),
        "the next record starts a new file"
    );

    // An older handle, opened before the rotation, keeps the chain whole.
    let other = h.reopen();
    h.enqueue("b0", "chat-1");
    other.enqueue(msg("b1", "chat-1")).unwrap();
    h.outbox.process("a0", |_| Ok(None)).unwrap();
    assert_eq!(
        fs::read(&sealed[0]).unwrap(),
        sealed_bytes,
        "sealed segments never change"
    );

    let first_active: serde_json::Value = serde_json::from_str(lines(&h).first().unwrap()).unwrap();
    let last_sealed: serde_json::Value = serde_json::from_str(
        String::from_utf8(sealed_bytes)
            .unwrap()
            .lines()
            .last()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        first_active["prev_hash"], last_sealed["hash"],
        "linked across files"
    );
    assert_eq!(
        first_active["seq"],
        last_sealed["seq"].as_u64().unwrap() + 1
    );

    let report = h.outbox.verify_audit().unwrap();
    assert_eq!(
        report.records, 7,
        "4 + 2 queued and 1 sent, verified across files"
    );
    assert_eq!(AuditLog::verify_dir(h.dir.path()).unwrap(), report);
    let kinds: Vec<_> = h
        .outbox
        .history("a0")
        .unwrap()
        .iter()
        .map(|r| r.outcome.as_str())
        .collect();
    assert_eq!(kinds, ["queued", "sent"], "history reads every segment");
    // A restarted handle starts after the sealed segments.
    let restarted = Outbox::builder(h.dir.path())
        .audit_rotate_bytes(1024)
        .open()
        .unwrap();
    restarted.enqueue(msg("c0", "chat-1")).unwrap();
    assert_eq!(restarted.verify_audit().unwrap().records, 8);
}

#[test]
fn tampering_in_a_sealed_segment_is_found_and_located() {
    let h = Harness::with(|b| b.audit_rotate_bytes(1024));
    for i in 0..4 {
        h.enqueue(&format!("a{i}"), "chat-1");
    }
    h.outbox.compact().unwrap();
    h.enqueue("b0", "chat-1");
    let sealed = sealed_files(&h).pop().unwrap();
    let text = fs::read_to_string(&sealed)
        .unwrap()
        .replacen("\"attempts\":0", "\"attempts\":7", 2);
    fs::write(&sealed, text).unwrap();
    match h.outbox.verify_audit().unwrap_err() {
        Error::AuditBroken { path, line, fault } => {
            assert_eq!(path, sealed);
            assert_eq!((line, fault), (1, AuditFault::HashMismatch));
        }
        other => panic!("expected AuditBroken, got {other}"),
    }
}

#[test]
fn an_operator_can_remove_old_audit_segments_and_verification_starts_at_the_anchor() {
    let h = Harness::with(|b| b.audit_rotate_bytes(1024));
    for round in 0..3 {
        for i in 0..4 {
            h.enqueue(&format!("r{round}-{i}"), "chat-1");
        }
        h.outbox.compact().unwrap();
    }
    assert_eq!(sealed_files(&h).len(), 3);
    let removed = h
        .outbox
        .remove_old_audit_segments(1, "ops", "older than a year")
        .unwrap();
    assert_eq!(removed, 2);
    assert_eq!(sealed_files(&h).len(), 1);
    assert!(h.path("audit.anchor").exists());
    let report = h.outbox.verify_audit().unwrap();
    assert_eq!(
        report.records, 5,
        "4 records in the kept segment, then the pruned record"
    );
    assert_eq!(AuditLog::verify_dir(h.dir.path()).unwrap(), report);
    let note = h
        .outbox
        .history("audit-segments")
        .unwrap()
        .pop()
        .unwrap()
        .note
        .unwrap();
    assert!(
        note.starts_with("ops: older than a year (removed 2 sealed audit segments"),
        "{note}"
    );
    // Tampering in what is kept is still found; a reopened handle continues the chain.
    let reopened = h.reopen();
    reopened.enqueue(msg("after", "chat-2")).unwrap();
    assert_eq!(reopened.verify_audit().unwrap().records, 6);
}
