//! One lifecycle, two engines: history, run on both engines. Every other
//! guarantee's both-engine bodies live in the module named after it
//! (`delivery`, `at_most_once`, `ordering`, `rate_caps`, `retries`, …, via
//! `engines::on_both_engines!`); these two stay here because the `history`
//! module needs the `test-failpoints` feature and history on PostgreSQL must
//! be covered without it.

use durable_outbox::ItemState;

use crate::engines::on_both_engines;
use crate::harness::{msg, secs};

on_both_engines! {
    /// Terminal items older than `history_after` leave the live listing and
    /// appear in history; `get` and the transport-ref lookups still find them,
    /// and a requeue brings one back.
    fn old_terminal_items_become_history(engine) {
        let outbox = engine.open_with(|b| b.history_after(secs(60)));
        outbox.enqueue(msg("old", "chat-1")).unwrap();
        outbox.process("old", |_| Ok(Some("ref-old".into()))).unwrap();
        engine.clock.advance(secs(120));
        outbox.enqueue(msg("new", "chat-2")).unwrap();
        // The file engine moves them at compaction, which every open runs.
        let reader = engine.open();
        let live: Vec<String> = reader.list_items().unwrap().iter().map(|i| i.idempotency_key().to_owned()).collect();
        assert_eq!(live, ["new"]);
        let history: Vec<String> = reader
            .history_items()
            .unwrap()
            .map(|i| i.unwrap().idempotency_key().to_owned())
            .collect();
        assert_eq!(history, ["old"]);
        assert_eq!(reader.history_len().unwrap(), 1);
        assert_eq!(reader.get("old").unwrap().unwrap().state(), ItemState::Sent);
        assert_eq!(
            reader.find_by_transport_ref_in("chat-1", "ref-old").unwrap().unwrap().idempotency_key(),
            "old"
        );
        // Same key, same message: still the old item, nothing new.
        assert_eq!(reader.enqueue(msg("old", "chat-1")).unwrap().state(), ItemState::Sent);
        reader.verify_audit().unwrap();
    }

    /// `history_retention` `MaxAge` deletes history older than its age (with
    /// a `pruned` audit record) and nothing younger; the chain still verifies.
    fn retention_prunes_old_history_audited(engine) {
        use durable_outbox::Retention;
        let configure = |b: durable_outbox::OutboxBuilder| {
            b.history_after(secs(60))
                .history_retention(Retention::MaxAge(secs(3600)))
        };
        let outbox = engine.open_with(configure);
        outbox.enqueue(msg("old", "chat-1")).unwrap();
        outbox.process("old", |_| Ok(None)).unwrap();
        engine.clock.advance(secs(120));
        drop(engine.open_with(configure)); // the file engine moves "old" to history
        engine.clock.advance(secs(2 * 3600));
        outbox.enqueue(msg("recent", "chat-1")).unwrap();
        outbox.process("recent", |_| Ok(None)).unwrap();
        engine.clock.advance(secs(120));
        let reader = engine.open_with(configure); // retention runs on open
        assert!(reader.get("old").unwrap().is_none(), "older than the retention age: gone");
        assert_eq!(reader.get("recent").unwrap().unwrap().state(), ItemState::Sent);
        let report = reader.verify_audit().unwrap();
        assert_eq!(report.records, 5, "two queued, two sent, one pruned");
    }

    /// A bot that stays up applies retention by calling `compact` now and
    /// then: on the handle it runs on, without reopening, the same pass as an
    /// open (history past its retention age goes, with a `pruned` record;
    /// nothing younger), and the chain still verifies from its start.
    fn compact_applies_retention_on_a_long_lived_handle(engine) {
        use durable_outbox::Retention;
        let outbox = engine.open_with(|b| {
            b.history_after(secs(60))
                .history_retention(Retention::MaxAge(secs(3600)))
        });
        outbox.enqueue(msg("old", "chat-1")).unwrap();
        outbox.process("old", |_| Ok(None)).unwrap();
        engine.clock.advance(secs(120));
        outbox.compact().unwrap(); // the file engine moves "old" to history
        assert_eq!(outbox.history_len().unwrap(), 1);
        engine.clock.advance(secs(2 * 3600));
        outbox.enqueue(msg("recent", "chat-1")).unwrap();
        outbox.process("recent", |_| Ok(None)).unwrap();
        engine.clock.advance(secs(120));
        outbox.compact().unwrap();
        assert!(outbox.get("old").unwrap().is_none(), "older than the retention age: gone");
        assert_eq!(outbox.get("recent").unwrap().unwrap().state(), ItemState::Sent);
        assert_eq!(outbox.history_len().unwrap(), 1, "only the recent item is history");
        let report = outbox.verify_audit().unwrap();
        assert_eq!(report.records, 5, "two queued, two sent, one pruned");
        // Nothing left to prune: a second pass writes nothing.
        outbox.compact().unwrap();
        assert_eq!(outbox.verify_audit().unwrap().records, 5);
    }
}
