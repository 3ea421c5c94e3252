//! Operator actions: requeue a failed item (the only way an ambiguous one is ever
//! resent) and cancel a queued one, both refused where unsafe, both audited.
//!
//! Bodies in `on_both_engines!` run on the file engine and on PostgreSQL
//! (`name::file`, `name::postgres`); every body here runs on both.

use durable_outbox::{AMBIGUOUS_AFTER_RESTART, CANCELLED, Error, ItemState, Outcome, SendError};

use crate::engines::on_both_engines;
use crate::harness::{DEADLOCK_LIMIT, Harness, uncapped, within};
use crate::harness::{msg, secs};

fn failed_ambiguously(h: &Harness, key: &str) {
    h.enqueue(key, "chat-1");
    let r = h
        .outbox
        .process(key, |_| Err(SendError::ambiguous("read_timeout")))
        .unwrap();
    assert_eq!(r.outcome, Outcome::Failed);
}

on_both_engines! {
    fn requeue_sends_a_failed_item_again_and_audits_who_and_why(engine) {
        // Uncapped: the ambiguous attempt counts against the cap, and the resend
        // follows it at the same instant.
        let h = engine.harness_with(uncapped);
        failed_ambiguously(&h, "k");
        let item = h
            .outbox
            .requeue("k", "alice", "checked the chat: it never arrived")
            .unwrap();
        assert_eq!(
            (item.state(), item.attempts(), item.error_code()),
            (ItemState::Queued, 0, None)
        );
        assert_eq!(
            h.outbox
                .process("k", |_| Ok(Some("tg-2".into())))
                .unwrap()
                .outcome,
            Outcome::Sent
        );
        let history = h.outbox.history("k").unwrap();
        let requeued = history
            .iter()
            .find(|r| r.outcome.as_str() == "requeued")
            .unwrap();
        assert_eq!(
            requeued.note.as_deref(),
            Some("alice: checked the chat: it never arrived")
        );
        assert!(!requeued.reconciled);
        let kinds: Vec<_> = history.iter().map(|r| r.outcome.as_str()).collect();
        assert_eq!(kinds, ["queued", "failed", "requeued", "sent"]);
        h.outbox.verify_audit().unwrap();
    }

    fn requeue_refuses_sent_queued_and_in_flight_items_and_writes_nothing(engine) {
        let h = engine.harness();
        h.enqueue("sent", "chat-1");
        h.outbox.process("sent", |_| Ok(None)).unwrap();
        h.enqueue("queued", "chat-2");
        for key in ["sent", "queued"] {
            let err =
                h.assert_files_unchanged(|| h.outbox.requeue(key, "alice", "why not").unwrap_err());
            assert!(
                matches!(
                    err,
                    Error::InvalidTransition {
                        action: "requeued",
                        ..
                    }
                ),
                "{key}: {err}"
            );
        }
        let err = h.outbox.requeue("ghost", "alice", "why").unwrap_err();
        assert!(matches!(err, Error::NotFound { .. }), "{err}");
        // In flight: another handle is inside send right now.
        h.enqueue("busy", "chat-3");
        let other = h.reopen();
        within(
            "the lock is never held while send runs",
            DEADLOCK_LIMIT,
            || {
                h.outbox
                    .process("busy", |_| {
                        let err = other.requeue("busy", "alice", "impatient").unwrap_err();
                        assert!(err.to_string().contains("in flight"), "{err}");
                        let err = other.cancel("busy", "alice", "impatient").unwrap_err();
                        assert!(err.to_string().contains("in flight"), "{err}");
                        Ok(None)
                    })
                    .unwrap()
            },
        );
    }

    fn cancel_fails_a_queued_item_for_good_and_audits_it(engine) {
        let h = engine.harness();
        h.enqueue("k", "chat-1");
        let item = h.outbox.cancel("k", "carol", "customer withdrew").unwrap();
        assert_eq!(
            (item.state(), item.error_code()),
            (ItemState::Failed, Some(CANCELLED))
        );
        assert_eq!(
            h.outbox
                .process("k", |_| panic!("sent a cancelled item"))
                .unwrap()
                .outcome,
            Outcome::Failed
        );
        let last = h.outbox.history("k").unwrap().pop().unwrap();
        assert_eq!(
            (last.outcome.as_str(), last.note.as_deref()),
            ("cancelled", Some("carol: customer withdrew"))
        );
        let err = h.assert_files_unchanged(|| h.outbox.cancel("k", "carol", "again").unwrap_err());
        assert!(
            matches!(
                err,
                Error::InvalidTransition {
                    action: "cancelled",
                    ..
                }
            ),
            "{err}"
        );
    }

    fn operator_and_reason_are_validated(engine) {
        let h = engine.harness();
        failed_ambiguously(&h, "k");
        for (operator, reason, field) in [
            ("", "r", "operator"),
            ("a", " ", "reason"),
            ("a\0", "r", "operator"),
        ] {
            let err = h.assert_files_unchanged(|| h.outbox.requeue("k", operator, reason).unwrap_err());
            assert!(
                matches!(err, Error::InvalidField { field: f, .. } if f == field),
                "{err}"
            );
        }
    }
}

on_both_engines! {
    fn an_ambiguous_item_left_by_a_crash_can_be_requeued(engine) {
        let h = engine.harness_with(uncapped);
        h.enqueue("k", "chat-1");
        engine.forge_dead_claim("k");
        let r = h.outbox.process("k", |_| panic!("resent")).unwrap();
        assert_eq!(r.error_code.as_deref(), Some(AMBIGUOUS_AFTER_RESTART));
        h.outbox
            .requeue("k", "bob", "customer confirmed nothing arrived")
            .unwrap();
        assert_eq!(
            h.outbox.process("k", |_| Ok(None)).unwrap().outcome,
            Outcome::Sent
        );
    }
}

on_both_engines! {
    /// An ambiguous send is never resent by the outbox; an operator's requeue
    /// and cancel are audited with who and why.
    fn requeue_and_cancel_are_audited(engine) {
        let outbox = engine.open();
        outbox.enqueue(msg("a", "chat-1")).unwrap();
        outbox.enqueue(msg("b", "chat-2")).unwrap();
        let failed = outbox.process("a", |_| Err(SendError::ambiguous("reset_after_write"))).unwrap();
        assert_eq!(failed.outcome, Outcome::Failed);
        assert_eq!(
            outbox.process("a", |_| panic!("never resent")).unwrap().outcome,
            Outcome::Failed
        );
        let requeued = engine.open().requeue("a", "alice", "never arrived").unwrap();
        assert_eq!((requeued.state(), requeued.attempts()), (ItemState::Queued, 0));
        // The ambiguous send still counts against the chat's cap (one a second).
        engine.clock.advance(secs(1));
        assert_eq!(outbox.process("a", |_| Ok(None)).unwrap().outcome, Outcome::Sent);

        let cancelled = outbox.cancel("b", "bob", "withdrawn").unwrap();
        assert_eq!(
            (cancelled.state(), cancelled.error_code()),
            (ItemState::Failed, Some(CANCELLED))
        );
        assert!(matches!(
            outbox.cancel("b", "bob", "twice"),
            Err(Error::InvalidTransition { .. })
        ));
        assert!(matches!(
            outbox.requeue("missing", "bob", "why"),
            Err(Error::NotFound { .. })
        ));
        let notes: Vec<Option<String>> = outbox
            .history("a")
            .unwrap()
            .into_iter()
            .map(|r| r.note)
            .collect();
        assert!(notes.contains(&Some("alice: never arrived".to_owned())), "{notes:?}");
        assert_eq!(
            outbox.history("b").unwrap().last().and_then(|r| r.note.clone()).as_deref(),
            Some("bob: withdrawn")
        );
        outbox.verify_audit().unwrap();
    }
}
