//! A crash between the journal commit and the audit append loses no audit record:
//! the journal holds the sealed records, and the next touch appends them exactly.
//!
//! File-only by design: the crash is a failpoint between the journal commit and
//! the `audit.jsonl` append (on PostgreSQL both are one transaction;
//! `deferred_sealing` covers its own gap).

use durable_outbox::{AuditLog, Error, FailAction, Outbox};

use crate::harness::{Harness, msg};

#[test]
fn an_outcome_committed_without_its_record_gets_exactly_that_record_on_reopen() {
    let h = Harness::with(|b| b.failpoint("commit.before_audit", FailAction::Error));
    let err = h.outbox.enqueue(msg("k", "chat-1")).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err}");
    assert!(
        matches!(h.outbox.enqueue(msg("k2", "chat-1")), Err(Error::Poisoned)),
        "the handle refuses further writes"
    );
    assert!(
        AuditLog::read(h.path("audit.jsonl")).unwrap().is_empty(),
        "the record is missing"
    );

    let reopened = h.reopen();
    let history = reopened.history("k").unwrap();
    assert_eq!(history.len(), 1);
    assert_eq!(history[0].seq, 1);
    assert!(
        !history[0].reconciled,
        "it is the very record the commit sealed, not a substitute"
    );
    assert_eq!(
        Some(history[0].audit_id.as_str()),
        reopened.get("k").unwrap().unwrap().last_audit_id(),
        "the repaired record is the one the item names"
    );
    reopened.verify_audit().unwrap();
}

#[test]
fn reconcile_repairs_without_any_other_write() {
    // Commit 1 is the enqueue, 2 the claim, 3 the sent outcome: fail after the third.
    let h = Harness::with(|b| b.failpoint("commit.before_audit", FailAction::ErrorOnHit(3)));
    h.enqueue("a", "chat-1");
    h.outbox.process("a", |_| Ok(None)).unwrap_err();
    // Another live handle repairs it explicitly.
    let other = Outbox::open(h.dir.path()).unwrap();
    other.reconcile().unwrap();
    let outcomes: Vec<_> = other
        .history("a")
        .unwrap()
        .iter()
        .map(|r| r.outcome.as_str())
        .collect();
    assert_eq!(outcomes, ["queued", "sent"]);
    other.verify_audit().unwrap();
}
