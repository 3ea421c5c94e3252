//! Injected I/O faults at every durable step: a typed error, the old or the new
//! state (never a mix), no fsync retried as if nothing happened, never a resend.
//!
//! File-only by design: the faults are file-engine failpoints (write, fsync,
//! rename).

use durable_outbox::{AMBIGUOUS_AFTER_RESTART, Error, FailAction, ItemState, Outcome};

use crate::harness::{Harness, msg};

fn temp_files(h: &Harness) -> usize {
    std::fs::read_dir(h.dir.path())
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with(".outbox-tmp-")
        })
        .count()
}

fn journal(h: &Harness) -> Vec<u8> {
    std::fs::read(h.path("outbox.journal")).unwrap()
}

#[test]
fn a_journal_write_that_fails_before_any_byte_keeps_the_state_and_the_handle_usable() {
    let h = Harness::with(|b| b.failpoint("journal.write", FailAction::ErrorOnHit(2)));
    h.enqueue("first", "chat-1");
    let before = journal(&h);
    let err = h.assert_files_unchanged(|| h.outbox.enqueue(msg("second", "chat-1")).unwrap_err());
    assert!(matches!(err, Error::Io { .. }), "{err}");
    assert_eq!(journal(&h), before);
    assert!(
        h.outbox.get("second").unwrap().is_none(),
        "the failed change is not visible"
    );
    h.enqueue("second", "chat-1");
    assert_eq!(h.outbox.list_items().unwrap().len(), 2);
    h.outbox.verify_audit().unwrap();
}

#[test]
fn a_failed_journal_fsync_poisons_the_handle_and_is_never_retried() {
    let h = Harness::with(|b| b.failpoint("journal.fsync", FailAction::ErrorOnHit(2)));
    h.enqueue("first", "chat-1");
    let err = h.outbox.enqueue(msg("second", "chat-1")).unwrap_err();
    assert!(matches!(err, Error::Io { op: "fsync", .. }), "{err}");
    assert!(matches!(
        h.outbox.enqueue(msg("third", "chat-1")),
        Err(Error::Poisoned)
    ));
    assert!(
        matches!(h.outbox.list_items(), Err(Error::Poisoned)),
        "reads too: the state is uncertain"
    );
    // What reached the disk decides; here the bytes were written, so a reopen sees
    // the entry, complete and with its audit record.
    let reopened = h.reopen();
    let items = reopened.list_items().unwrap();
    assert_eq!(
        items.len(),
        2,
        "the failed fsync's bytes reached the page cache: the entry is there"
    );
    assert_eq!(reopened.verify_audit().unwrap().records, items.len() as u64);
}

#[test]
fn audit_append_faults_poison_and_the_record_is_never_lost_or_doubled() {
    let h = Harness::with(|b| b.failpoint("audit.write", FailAction::ErrorOnHit(2)));
    h.enqueue("first", "chat-1");
    assert!(h.outbox.enqueue(msg("second", "chat-1")).is_err());
    assert!(matches!(
        h.outbox.enqueue(msg("third", "chat-1")),
        Err(Error::Poisoned)
    ));
    let reopened = h.reopen();
    let outcomes: Vec<_> = reopened
        .history("second")
        .unwrap()
        .iter()
        .map(|r| r.outcome.as_str())
        .collect();
    assert_eq!(outcomes, ["queued"], "exactly one record");
    reopened.verify_audit().unwrap();
}

#[test]
fn a_compaction_failing_before_the_rename_keeps_snapshot_and_journal() {
    for point in ["state.write", "state.fsync", "state.rename"] {
        let h = Harness::with(|b| b.failpoint(point, FailAction::ErrorOnHit(1)));
        h.enqueue("a", "chat-1");
        let journal_before = journal(&h);
        let err = h.assert_files_unchanged(|| h.outbox.compact().unwrap_err());
        assert!(matches!(err, Error::Io { .. }), "{point}: {err}");
        assert_eq!(journal(&h), journal_before, "{point}");
        assert_eq!(temp_files(&h), 0, "{point}: the temp file is removed");
        h.enqueue("b", "chat-1"); // not poisoned: nothing changed on disk
        h.outbox.compact().unwrap();
        assert_eq!(h.reopen().list_items().unwrap().len(), 2, "{point}");
    }
}

#[test]
fn a_compaction_whose_directory_fsync_fails_poisons_and_reopens_consistent() {
    let h = Harness::with(|b| b.failpoint("state.dir_fsync", FailAction::ErrorOnHit(1)));
    h.enqueue("a", "chat-1");
    let err = h.outbox.compact().unwrap_err();
    assert!(
        matches!(
            err,
            Error::Io {
                op: "fsync directory",
                ..
            }
        ),
        "{err}"
    );
    assert!(matches!(
        h.outbox.enqueue(msg("b", "chat-1")),
        Err(Error::Poisoned)
    ));
    let reopened = h.reopen();
    assert_eq!(reopened.list_items().unwrap().len(), 1);
    reopened.verify_audit().unwrap();
}

#[test]
fn a_fault_while_claiming_means_no_send() {
    for point in ["journal.write", "journal.fsync"] {
        let h = Harness::with(|b| b.failpoint(point, FailAction::ErrorOnHit(2)));
        h.enqueue("k", "chat-1");
        let err = h
            .outbox
            .process("k", |_| panic!("{point}: sent without a durable claim"))
            .unwrap_err();
        assert!(matches!(err, Error::Io { .. }), "{point}: {err}");
    }
    // A clean failure leaves the item unclaimed and the handle usable.
    let h = Harness::with(|b| b.failpoint("journal.write", FailAction::ErrorOnHit(2)));
    h.enqueue("k", "chat-1");
    h.outbox
        .process("k", |_| panic!("sent without a durable claim"))
        .unwrap_err();
    let item = h.outbox.get("k").unwrap().unwrap();
    assert!(!item.dispatch_claimed() && item.attempts() == 0);
    assert_eq!(
        h.outbox.process("k", |_| Ok(None)).unwrap().outcome,
        Outcome::Sent
    );
}

#[test]
fn a_fault_recording_the_result_after_send_never_leads_to_a_resend() {
    // Commit 1: enqueue; 2: the claim; 3: recording "sent".
    let h = Harness::with(|b| b.failpoint("journal.write", FailAction::ErrorOnHit(3)));
    h.enqueue("k", "chat-1");
    let mut sends = 0;
    let err = h
        .outbox
        .process("k", |_| {
            sends += 1;
            Ok(Some("tg-1".into()))
        })
        .unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err}");
    // The record does not know whether the message left: it must fail as ambiguous.
    let receipt = h.outbox.process("k", |_| panic!("resent")).unwrap();
    assert_eq!(sends, 1);
    assert_eq!(receipt.outcome, Outcome::Failed);
    assert_eq!(receipt.error_code.as_deref(), Some(AMBIGUOUS_AFTER_RESTART));
    assert_eq!(
        h.outbox.get("k").unwrap().unwrap().state(),
        ItemState::Failed
    );
}

#[test]
fn a_drain_whose_result_record_failed_fails_the_item_as_ambiguous_on_its_next_pass() {
    // The drain's twin of the test above: the next *pass* of the same handle
    // must find the item (claimed by this handle, no longer in its in-flight
    // set) and settle it, not skip it as one of its own sends in progress.
    // Commit 1: enqueue; 2: the step that claims; 3: the step recording "sent".
    let h = Harness::with(|b| b.failpoint("journal.write", FailAction::ErrorOnHit(3)));
    h.enqueue("k", "chat-1");
    let mut sends = 0;
    let err = h
        .outbox
        .process_due(|_| {
            sends += 1;
            Ok(Some("tg-1".into()))
        })
        .unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err}");
    let item = h.outbox.get("k").unwrap().unwrap();
    assert!(
        item.dispatch_claimed(),
        "the claim stayed, the result did not"
    );
    let report = h.outbox.process_due(|_| panic!("resent")).unwrap();
    assert_eq!(sends, 1);
    assert_eq!(
        (report.failed, report.sent, report.in_flight, report.waiting),
        (1, 0, 0, 0),
        "{report:?}"
    );
    let item = h.outbox.get("k").unwrap().unwrap();
    assert_eq!(item.state(), ItemState::Failed);
    assert_eq!(item.error_code(), Some(AMBIGUOUS_AFTER_RESTART));
}

#[test]
fn an_uncertain_result_record_is_resolved_by_what_reached_the_disk() {
    let h = Harness::with(|b| b.failpoint("journal.fsync", FailAction::ErrorOnHit(3)));
    h.enqueue("k", "chat-1");
    h.outbox
        .process("k", |_| Ok(Some("tg-1".into())))
        .unwrap_err();
    let dir = h.dir.path().to_path_buf();
    let clock = h.clock.clone();
    drop(h.outbox); // the poisoned handle goes away, and its claim with it
    let reopened = crate::harness::builder(&dir, &clock).open().unwrap();
    let receipt = reopened.process("k", |_| panic!("resent")).unwrap();
    // The entry's bytes were written before the failed fsync, so the outcome is known.
    assert_eq!(receipt.outcome, Outcome::Sent);
    assert_eq!(receipt.transport_ref.as_deref(), Some("tg-1"));
}
