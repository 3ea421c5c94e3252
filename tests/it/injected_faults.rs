//! Injected I/O faults at every durable step: a typed error, old-or-new state, never a resend.

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

#[test]
fn a_fault_before_the_rename_keeps_the_old_state_and_the_handle_usable() {
    for point in ["state.write", "state.fsync", "state.rename"] {
        let h = Harness::with(|b| b.failpoint(point, FailAction::ErrorOnHit(2)));
        h.enqueue("first", "chat-1");
        let err =
            h.assert_files_unchanged(|| h.outbox.enqueue(msg("second", "chat-1")).unwrap_err());
        assert!(matches!(err, Error::Io { .. }), "{point}: {err}");
        assert_eq!(temp_files(&h), 0, "{point}: the temp file is removed");
        h.enqueue("second", "chat-1"); // not poisoned: the old state is known to be intact
        assert_eq!(h.outbox.list_items().unwrap().len(), 2, "{point}");
        h.outbox.verify_audit().unwrap();
    }
}

#[test]
fn a_failed_directory_fsync_poisons_the_handle_and_a_reopen_sees_a_consistent_outbox() {
    let h = Harness::with(|b| b.failpoint("state.dir_fsync", FailAction::ErrorOnHit(2)));
    h.enqueue("first", "chat-1");
    let err = h.outbox.enqueue(msg("second", "chat-1")).unwrap_err();
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
        h.outbox.enqueue(msg("third", "chat-1")),
        Err(Error::Poisoned)
    ));
    let reopened = h.reopen();
    // The rename happened, so the new state is visible; its audit record is repaired.
    assert!(reopened.get("second").unwrap().is_some());
    assert_eq!(reopened.verify_audit().unwrap().records, 2);
}

#[test]
fn audit_append_faults_poison_and_the_record_is_never_lost_or_doubled() {
    for point in ["audit.write", "audit.fsync"] {
        let h = Harness::with(|b| b.failpoint(point, FailAction::ErrorOnHit(2)));
        h.enqueue("first", "chat-1");
        assert!(
            h.outbox.enqueue(msg("second", "chat-1")).is_err(),
            "{point}"
        );
        assert!(matches!(h.outbox.list_items(), Ok(ref items) if items.len() == 2));
        assert!(
            matches!(
                h.outbox.enqueue(msg("third", "chat-1")),
                Err(Error::Poisoned)
            ),
            "{point}"
        );
        let reopened = h.reopen();
        let outcomes: Vec<_> = reopened
            .history("second")
            .unwrap()
            .iter()
            .map(|r| r.outcome.as_str())
            .collect();
        assert_eq!(outcomes, ["queued"], "{point}: exactly one record");
        reopened.verify_audit().unwrap();
    }
}

#[test]
fn a_fault_while_claiming_means_no_send() {
    for point in ["state.write", "state.fsync", "state.rename"] {
        let h = Harness::with(|b| b.failpoint(point, FailAction::ErrorOnHit(2)));
        h.enqueue("k", "chat-1");
        let err = h
            .outbox
            .process("k", |_| panic!("sent without a durable claim"))
            .unwrap_err();
        assert!(matches!(err, Error::Io { .. }), "{point}: {err}");
        let item = h.outbox.get("k").unwrap().unwrap();
        assert!(!item.dispatch_claimed() && item.attempts() == 0, "{point}");
        assert_eq!(
            h.outbox.process("k", |_| Ok(None)).unwrap().outcome,
            Outcome::Sent,
            "{point}"
        );
    }
}

#[test]
fn a_fault_recording_the_result_after_send_never_leads_to_a_resend() {
    // Hit 1: enqueue; hit 2: the claim; hit 3: recording "sent".
    for point in ["state.write", "state.fsync", "state.rename"] {
        let h = Harness::with(|b| b.failpoint(point, FailAction::ErrorOnHit(3)));
        h.enqueue("k", "chat-1");
        let mut sends = 0;
        let err = h
            .outbox
            .process("k", |_| {
                sends += 1;
                Ok(Some("tg-1".into()))
            })
            .unwrap_err();
        assert!(matches!(err, Error::Io { .. }), "{point}: {err}");
        // The record does not know whether the message left: it must fail as ambiguous.
        let receipt = h
            .outbox
            .process("k", |_| panic!("{point}: resent"))
            .unwrap();
        assert_eq!(sends, 1);
        assert_eq!(receipt.outcome, Outcome::Failed, "{point}");
        assert_eq!(receipt.error_code.as_deref(), Some(AMBIGUOUS_AFTER_RESTART));
        assert_eq!(
            h.outbox.get("k").unwrap().unwrap().state(),
            ItemState::Failed
        );
    }
}
