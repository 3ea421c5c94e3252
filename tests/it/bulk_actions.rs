//! An operator acts on many items at once by filter: one audited record per
//! item with who and why, refusals listed, a dry run that changes nothing.
//!
//! Bodies in `on_both_engines!` run on the file engine and on PostgreSQL
//! (`name::file`, `name::postgres`). File-only here: none: every body runs on
//! both (the dry run also compares the file engine's journal).

use std::time::Duration;

use durable_outbox::{
    AuditOutcome, CANCELLED, Error, FailureClass, ItemFilter, ItemState, SendError,
};

use crate::engines::{EngineUnderTest, Kind, on_both_engines};
use crate::harness::msg;
use crate::harness::{Harness, secs, uncapped};

/// After an outage: three retryable failures (two in chat-1, one in chat-2),
/// one ambiguous failure, one sent item, two queued items.
fn after_an_outage(engine: &EngineUnderTest) -> Harness {
    let h = engine.harness_with(|b| uncapped(b).max_attempts(1));
    for (key, chat) in [
        ("down-1", "chat-1"),
        ("down-2", "chat-1"),
        ("down-3", "chat-2"),
        ("maybe", "chat-1"),
        ("sent", "chat-1"),
    ] {
        h.enqueue(key, chat);
    }
    h.outbox
        .process_due(|item| match item.idempotency_key() {
            "maybe" => Err(SendError::ambiguous("read_timeout")),
            "sent" => Ok(Some("tg-1".into())),
            _ => Err(SendError::retryable("connection_refused")),
        })
        .unwrap();
    h.clock.advance(secs(60));
    h.enqueue("waiting-1", "chat-1");
    h.enqueue("waiting-2", "chat-2");
    h
}

fn keys(items: &[durable_outbox::OutboxItem]) -> Vec<&str> {
    items
        .iter()
        .map(durable_outbox::OutboxItem::idempotency_key)
        .collect()
}

on_both_engines! {
    fn a_dry_run_reports_the_same_and_writes_nothing(engine) {
        let h = after_an_outage(engine);
        let filter = ItemFilter::new().error_code("connection_refused");
        let preview = h.assert_files_unchanged(|| h.outbox.preview_requeue_where(&filter).unwrap());
        // The file engine's journal too (PostgreSQL: items and audit head above).
        let journal = (engine.kind == Kind::File)
            .then(|| std::fs::read(h.path("outbox.journal")).unwrap());
        assert_eq!(keys(&preview.changed), ["down-1", "down-2", "down-3"]);
        assert!(
            preview
                .changed
                .iter()
                .all(|i| i.state() == ItemState::Queued)
        );
        if let Some(journal) = journal {
            assert_eq!(std::fs::read(h.path("outbox.journal")).unwrap(), journal);
        }
        assert_eq!(
            h.outbox.get("down-1").unwrap().unwrap().state(),
            ItemState::Failed
        );
        let done = h.outbox.requeue_where(&filter, "alice", "go").unwrap();
        assert_eq!(keys(&done.changed), keys(&preview.changed));
    }

    fn requeue_where_requeues_what_the_filter_selects_with_one_record_each(engine) {
        let h = after_an_outage(engine);
        let filter = ItemFilter::new()
            .state(ItemState::Failed)
            .class(FailureClass::Retryable)
            .destination("chat-1");
        let report = h
            .outbox
            .requeue_where(&filter, "alice", "platform back")
            .unwrap();
        assert_eq!(keys(&report.changed), ["down-1", "down-2"]);
        assert!(report.skipped.is_empty());
        for key in ["down-1", "down-2"] {
            let item = h.reopen().get(key).unwrap().unwrap();
            assert_eq!((item.state(), item.attempts()), (ItemState::Queued, 0));
            let last = h.outbox.history(key).unwrap().pop().unwrap();
            assert_eq!(last.outcome, AuditOutcome::Requeued);
            assert_eq!(last.note.as_deref(), Some("alice: platform back"));
        }
        // Untouched: another chat, another class.
        assert_eq!(
            h.outbox.get("down-3").unwrap().unwrap().state(),
            ItemState::Failed
        );
        assert_eq!(
            h.outbox.get("maybe").unwrap().unwrap().state(),
            ItemState::Failed
        );
        h.outbox.verify_audit().unwrap();
    }

    fn matching_items_the_action_does_not_apply_to_are_skipped_with_why(engine) {
        let h = after_an_outage(engine);
        let report = h
            .outbox
            .requeue_where(
                &ItemFilter::new().destination("chat-1"),
                "alice",
                "retry all",
            )
            .unwrap();
        assert_eq!(keys(&report.changed), ["down-1", "down-2", "maybe"]);
        let skipped: Vec<(&str, &str)> = report
            .skipped
            .iter()
            .map(|(k, why)| (k.as_str(), why.as_str()))
            .collect();
        assert_eq!(
            skipped,
            [
                ("sent", "it was sent already"),
                ("waiting-1", "it is queued already")
            ]
        );
    }

    fn cancel_where_cancels_queued_items_and_says_which_were_cancelled_already(engine) {
        let h = after_an_outage(engine);
        let filter = ItemFilter::new().state(ItemState::Queued);
        let report = h
            .outbox
            .cancel_where(&filter, "bob", "campaign withdrawn")
            .unwrap();
        assert_eq!(keys(&report.changed), ["waiting-1", "waiting-2"]);
        for item in &report.changed {
            assert_eq!(item.error_code(), Some(CANCELLED));
        }
        let again = h
            .outbox
            .cancel_where(&ItemFilter::new().error_code(CANCELLED), "bob", "again")
            .unwrap();
        assert!(again.changed.is_empty());
        assert_eq!(
            again.skipped,
            [
                (
                    "waiting-1".to_owned(),
                    "it was cancelled already".to_owned()
                ),
                (
                    "waiting-2".to_owned(),
                    "it was cancelled already".to_owned()
                )
            ]
        );
        let single = h.outbox.cancel("waiting-1", "bob", "again").unwrap_err();
        assert!(single.to_string().contains("cancelled already"), "{single}");
    }

    fn since_selects_by_last_change(engine) {
        let h = after_an_outage(engine);
        let since = h.outbox.get("waiting-1").unwrap().unwrap().updated_at();
        let recent = h.outbox.select(&ItemFilter::new().since(since)).unwrap();
        assert_eq!(keys(&recent), ["waiting-1", "waiting-2"]);
        // A std SystemTime works as well as a DateTime.
        let epoch = std::time::UNIX_EPOCH + Duration::from_secs(1);
        assert_eq!(
            h.outbox
                .select(&ItemFilter::new().since(epoch))
                .unwrap()
                .len(),
            7
        );
    }

    fn an_empty_filter_or_a_bad_operator_is_refused_and_nothing_is_written(engine) {
        let h = after_an_outage(engine);
        h.assert_files_unchanged(|| {
            let err = h
                .outbox
                .cancel_where(&ItemFilter::new(), "bob", "oops")
                .unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::InvalidField {
                        field: "filter",
                        ..
                    }
                ),
                "{err}"
            );
            let err = h
                .outbox
                .requeue_where(&ItemFilter::new().state(ItemState::Failed), " ", "why")
                .unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::InvalidField {
                        field: "operator",
                        ..
                    }
                ),
                "{err}"
            );
        });
        // `all()` says it on purpose.
        let report = h
            .outbox
            .cancel_where(&ItemFilter::all(), "bob", "shutdown")
            .unwrap();
        assert_eq!(keys(&report.changed), ["waiting-1", "waiting-2"]);
    }
}

on_both_engines! {
    /// Bulk requeue and cancel act on what the filter selects, each audited,
    /// and a dry run writes nothing.
    fn bulk_actions_by_filter(engine) {
        use durable_outbox::ItemFilter;
        let outbox = engine.open_with(|b| b.max_attempts(1));
        for (key, chat) in [("a", "chat-1"), ("b", "chat-2"), ("c", "chat-3")] {
            outbox.enqueue(msg(key, chat)).unwrap();
        }
        outbox.process("a", |_| Err(SendError::retryable("outage"))).unwrap();
        outbox.process("b", |_| Err(SendError::retryable("outage"))).unwrap();
        let failed = ItemFilter::new().state(ItemState::Failed);
        let before = outbox.verify_audit().unwrap().records;
        let preview = outbox.preview_requeue_where(&failed).unwrap();
        assert_eq!(preview.changed.len(), 2);
        assert_eq!(outbox.verify_audit().unwrap().records, before, "a dry run writes nothing");
        let report = engine.open().requeue_where(&failed, "alice", "platform back").unwrap();
        assert_eq!(report.changed.len(), 2);
        assert!(report.changed.iter().all(|i| i.state() == ItemState::Queued));
        let queued = ItemFilter::new().state(ItemState::Queued).destination("chat-3");
        let cancelled = outbox.cancel_where(&queued, "bob", "obsolete").unwrap();
        assert_eq!(cancelled.changed.len(), 1);
        assert_eq!(cancelled.changed[0].error_code(), Some(CANCELLED));
        assert_eq!(outbox.verify_audit().unwrap().records, before + 3);
        assert_eq!(
            outbox.select(&ItemFilter::new().state(ItemState::Queued)).unwrap().len(),
            2
        );
    }
}
