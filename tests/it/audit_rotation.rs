//! A long-lived handle keeps a whole chain while other processes rotate the
//! audit log and an operator removes old segments, and a crash in the middle of
//! a removal leaves an outbox that verifies and opens.
//!
//! File-only by design: audit segments and their removal are files
//! (PostgreSQL's audit is one table).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Output;

use durable_outbox::{AuditLog, Outbox};

use crate::harness::{Harness, msg};
use crate::processes::worker;

fn run(dir: &Path, args: &[&str], failpoints: Option<&str>) -> Output {
    let d = dir.to_str().unwrap();
    let mut full = vec![args[0], d];
    full.extend_from_slice(&args[1..]);
    let mut cmd = worker(&full);
    if let Some(spec) = failpoints {
        cmd.env("DURABLE_OUTBOX_FAILPOINTS", spec);
    }
    cmd.output().expect("run worker")
}

fn run_ok(dir: &Path, args: &[&str]) -> String {
    let out = run(dir, args, None);
    assert!(
        out.status.success(),
        "worker {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn sealed(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<_> = fs::read_dir(dir)
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
fn a_handle_open_across_several_rotations_by_another_process_keeps_a_whole_chain() {
    let h = Harness::new();
    h.enqueue("bot-0", "chat-1");
    // Another process rotates three times while the bot's handle looks away.
    assert_eq!(run_ok(h.dir.path(), &["rotate", "rot", "3"]), "rotated 3\n");
    assert_eq!(sealed(h.dir.path()).len(), 3, "three rotations happened");

    h.outbox
        .enqueue(msg("bot-1", "chat-1"))
        .expect("no false 'audit chain broken' after another process rotated");
    h.outbox.process("bot-0", |_| Ok(None)).unwrap();
    let report = h.outbox.verify_audit().unwrap();
    assert_eq!(
        report.records,
        1 + 12 + 1 + 1,
        "every record, across four files"
    );
    assert_eq!(AuditLog::verify_dir(h.dir.path()).unwrap(), report);
}

#[test]
fn a_handle_open_when_an_operator_removes_old_segments_keeps_working() {
    for keep in [1, 0] {
        let h = Harness::new();
        h.enqueue("bot-0", "chat-1");
        run_ok(h.dir.path(), &["rotate", "rot", "3"]);
        let removed = run_ok(h.dir.path(), &["remove-audit", &keep.to_string()]);
        assert_eq!(removed, format!("removed {}\n", 3 - keep), "keep {keep}");
        assert_eq!(sealed(h.dir.path()).len(), keep);

        h.outbox
            .enqueue(msg("bot-1", "chat-1"))
            .unwrap_or_else(|e| panic!("keep {keep}: the bot's handle broke: {e}"));
        h.outbox.process("bot-0", |_| Ok(None)).unwrap();
        let report = h.outbox.verify_audit().unwrap();
        assert_eq!(AuditLog::verify_dir(h.dir.path()).unwrap(), report);
        let last = h.outbox.history("bot-0").unwrap().pop().unwrap();
        assert_eq!(last.outcome.as_str(), "sent", "keep {keep}");
    }
}

#[test]
fn a_crash_inside_segment_removal_leaves_a_verifiable_outbox_and_the_next_removal_finishes_it() {
    let h = Harness::new();
    run_ok(h.dir.path(), &["rotate", "rot", "3"]);
    let before = AuditLog::verify_dir(h.dir.path()).unwrap();
    // Killed after `audit.anchor` is in place, before any old segment is unlinked.
    let out = run(
        h.dir.path(),
        &["remove-audit", "1"],
        Some("audit_anchor.dir_fsync=kill"),
    );
    assert!(!out.status.success(), "the removal was interrupted");
    assert!(h.path("audit.anchor").exists(), "the anchor was written");
    assert_eq!(sealed(h.dir.path()).len(), 3, "no segment was unlinked");

    let report = AuditLog::verify_dir(h.dir.path())
        .expect("verification starts at the anchor, whatever files remain");
    assert_eq!(
        report.head_seq,
        before.head_seq + 1,
        "the removal's own record"
    );
    let reopened = Outbox::open(h.dir.path()).expect("the outbox opens");
    assert_eq!(reopened.verify_audit().unwrap(), report);
    h.outbox.enqueue(msg("after", "chat-1")).unwrap();
    assert_eq!(h.outbox.verify_audit().unwrap().records, report.records + 1);
    let records: Vec<_> = AuditLog::records_dir(h.dir.path())
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(
        records.first().map(|r| r.seq),
        Some(4 * 2 + 1),
        "reading starts after the anchor: the removed segments are not part of the chain"
    );

    // The next removal finishes the interrupted one before anything else.
    let removed = reopened
        .remove_old_audit_segments(1, "ops", "finish the removal")
        .unwrap();
    assert_eq!(removed, 2, "the two segments the crash left behind");
    assert_eq!(sealed(h.dir.path()).len(), 1);
    reopened.verify_audit().unwrap();
}
