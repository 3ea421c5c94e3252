//! Terminal items leave the live state for `history/` and stay findable:
//! by key, by transport ref, for idempotent enqueue, for requeue.
//!
//! Bodies in `on_both_engines!` run on the file engine and on PostgreSQL
//! (`name::file`, `name::postgres`); "settling" history is a compaction on the
//! file engine and an open on PostgreSQL. File-only here: the `#[test]`s are
//! about segment files (moves, damaged index, `MaxSegments`, failpoints
//! mid-move).

use std::time::Duration;

use durable_outbox::{Error, ItemState, Outbox, Outcome, SendError};

use crate::engines::{EngineUnderTest, Kind, on_both_engines};
use crate::harness::{Harness, builder, msg, secs, uncapped};

const DAY: Duration = Duration::from_secs(24 * 60 * 60);

/// An outbox with `n` sent items (refs `tr-i`) and one failed one, a day old.
/// Uncapped: chats receive several items at one instant.
fn with_old_traffic(n: usize) -> Harness {
    with_old_traffic_on(&EngineUnderTest::file(), n)
}

/// [`with_old_traffic`] on the engine under test.
fn with_old_traffic_on(engine: &EngineUnderTest, n: usize) -> Harness {
    let h = engine.harness_with(uncapped);
    for i in 0..n {
        let key = format!("old-{i}");
        h.enqueue(&key, &format!("chat-{}", i % 3));
        let sent = h
            .outbox
            .process(&key, |_| Ok(Some(format!("tr-{i}"))))
            .unwrap();
        assert_eq!(sent.outcome, Outcome::Sent, "{key}");
    }
    h.enqueue("old-failed", "chat-9");
    let failed = h
        .outbox
        .process("old-failed", |_| {
            Err(SendError::permanent("chat_not_found"))
        })
        .unwrap();
    assert_eq!(failed.outcome, Outcome::Failed);
    h.clock.advance(DAY + secs(1));
    h
}

on_both_engines! {
    fn old_terminal_items_move_to_history_and_stay_findable(engine) {
        let h = with_old_traffic_on(engine, 5);
        h.enqueue("fresh", "chat-1");
        h.settle_history();
        assert_eq!(h.outbox.history_len().unwrap(), 6);
        let live: Vec<_> = h
            .outbox
            .list_items()
            .unwrap()
            .iter()
            .map(|i| i.idempotency_key().to_owned())
            .collect();
        assert_eq!(live, ["fresh"], "only live items are listed");
        let item = h.outbox.get("old-3").unwrap().expect("found in history");
        assert_eq!(
            (item.state(), item.transport_ref()),
            (ItemState::Sent, Some("tr-3"))
        );
        assert_eq!(
            h.outbox
                .find_by_transport_ref("tr-4")
                .unwrap()
                .unwrap()
                .idempotency_key(),
            "old-4"
        );
        assert!(h.outbox.find_by_transport_ref("tr-99").unwrap().is_none());
        if engine.kind == Kind::File {
            assert!(
                std::fs::read_to_string(h.path("outbox.json"))
                    .unwrap()
                    .matches("idempotency_key")
                    .count()
                    == 1
            );
        }
        // Another handle, and a reopened one, see the same.
        assert_eq!(
            h.reopen().get("old-0").unwrap().unwrap().transport_ref(),
            Some("tr-0")
        );
    }

    fn history_items_lists_every_moved_item_from_disk(engine) {
        let h = with_old_traffic_on(engine, 4);
        h.settle_history();
        let mut keys: Vec<String> = h
            .outbox
            .history_items()
            .unwrap()
            .map(|item| item.unwrap().idempotency_key().to_owned())
            .collect();
        keys.sort();
        assert_eq!(keys, ["old-0", "old-1", "old-2", "old-3", "old-failed"]);
    }

    fn a_history_item_is_never_sent_again_and_its_key_stays_taken(engine) {
        let h = with_old_traffic_on(engine, 2);
        h.settle_history();
        let receipt = h
            .outbox
            .process("old-1", |_| panic!("resent from history"))
            .unwrap();
        assert_eq!(
            (receipt.outcome, receipt.transport_ref.as_deref()),
            (Outcome::Sent, Some("tr-1"))
        );
        assert!(receipt.audit_id.is_some());
        // Enqueueing the same message again is the idempotent no-op it always was…
        let again = h.outbox.enqueue(msg("old-1", "chat-1")).unwrap();
        assert_eq!(again.state(), ItemState::Sent);
        assert_eq!(
            h.outbox.list_items().unwrap().len(),
            0,
            "nothing was requeued"
        );
        // …and a different message under the key is still a conflict.
        let mut other = msg("old-1", "chat-1");
        other.content = "something else".into();
        assert!(matches!(
            h.outbox.enqueue(other),
            Err(Error::IdempotencyConflict { .. })
        ));
    }

    fn a_failed_item_in_history_can_still_be_requeued(engine) {
        let h = with_old_traffic_on(engine, 1);
        h.settle_history();
        assert!(h.outbox.list_items().unwrap().is_empty());
        h.outbox
            .requeue("old-failed", "ops", "the chat exists again")
            .unwrap();
        assert_eq!(
            h.outbox
                .process("old-failed", |_| Ok(None))
                .unwrap()
                .outcome,
            Outcome::Sent
        );
        assert_eq!(
            h.outbox.get("old-failed").unwrap().unwrap().state(),
            ItemState::Sent,
            "the live copy wins"
        );
        let err = h.outbox.requeue("old-0", "ops", "resend").unwrap_err();
        assert!(matches!(err, Error::InvalidTransition { .. }), "{err}");
    }
}

on_both_engines! {
    fn items_inside_a_rate_window_stay_live_whatever_history_after_says(engine) {
        let h = engine.harness_with(|b| b.history_after(Duration::ZERO).rate_limit(1, secs(600)));
        h.enqueue("a", "chat-1");
        h.outbox.process("a", |_| Ok(None)).unwrap();
        h.clock.advance(secs(60));
        h.settle_history();
        assert_eq!(
            h.outbox.history_len().unwrap(),
            0,
            "it still counts against the cap"
        );
        h.enqueue("b", "chat-1");
        assert_eq!(
            h.outbox.process("b", |_| Ok(None)).unwrap().outcome,
            Outcome::Deferred
        );
        h.clock.advance(secs(600));
        h.settle_history();
        assert_eq!(h.outbox.history_len().unwrap(), 1);
    }


}

#[test]
fn a_move_interrupted_after_the_segment_duplicates_nothing() {
    // The segment is written, then writing the snapshot fails: the items are in
    // both places. Lookups prefer the live copy, and the next move skips them.
    let h = with_old_traffic(3);
    drop(h.outbox);
    let failing = builder(h.dir.path(), &h.clock)
        .compact_on_open(false)
        .failpoint("state.rename", durable_outbox::FailAction::ErrorOnHit(1))
        .open()
        .unwrap();
    assert!(failing.compact().is_err());
    assert_eq!(failing.history_len().unwrap(), 4, "the segment was written");
    assert_eq!(
        failing.list_items().unwrap().len(),
        4,
        "and the items are still live"
    );
    assert_eq!(
        failing.get("old-2").unwrap().unwrap().transport_ref(),
        Some("tr-2")
    );
    failing.compact().unwrap();
    assert_eq!(failing.history_len().unwrap(), 4, "nothing was moved twice");
    assert!(failing.list_items().unwrap().is_empty());
    drop(failing);
    let reopened = Outbox::open(h.dir.path()).unwrap();
    assert_eq!(reopened.history_len().unwrap(), 4);
    reopened.verify_audit().unwrap();
}

#[test]
fn a_move_failing_before_the_segment_exists_keeps_everything_live() {
    let h = with_old_traffic(2);
    drop(h.outbox);
    let failing = builder(h.dir.path(), &h.clock)
        .compact_on_open(false)
        .failpoint(
            "history_log.fsync",
            durable_outbox::FailAction::ErrorOnHit(1),
        )
        .open()
        .unwrap();
    assert!(failing.compact().is_err());
    assert_eq!(failing.history_len().unwrap(), 0);
    assert_eq!(failing.list_items().unwrap().len(), 3);
    failing.compact().unwrap();
    assert_eq!(failing.history_len().unwrap(), 3);
}

#[test]
fn a_damaged_history_index_is_reported_not_ignored() {
    let h = with_old_traffic(2);
    h.outbox.compact().unwrap();
    let index = h.path("history/seg-00000001.idx");
    let mut bytes = std::fs::read(&index).unwrap();
    bytes[10] ^= 0xff;
    std::fs::write(&index, &bytes).unwrap();
    let err = Outbox::open(h.dir.path()).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidRecord { path, reason, .. } if path == &index && reason.contains("checksum")),
        "{err}"
    );
}

/// Moves `n` sent items (keys `{prefix}-i`) into a new history segment.
fn add_segment(h: &Harness, prefix: &str, n: usize) {
    for i in 0..n {
        let key = format!("{prefix}-{i}");
        h.outbox.enqueue(msg(&key, "chat-1")).unwrap();
        h.outbox.process(&key, |_| Ok(None)).unwrap();
        h.clock.advance(secs(60));
    }
    h.clock.advance(DAY + secs(1));
    h.settle_history();
}

#[test]
fn retention_keeps_the_newest_segments_and_audits_each_prune() {
    let h = Harness::with(|b| b.history_retention(durable_outbox::Retention::MaxSegments(2)));
    for prefix in ["s1", "s2", "s3", "s4"] {
        add_segment(&h, prefix, 2);
    }
    assert_eq!(
        h.outbox.history_len().unwrap(),
        4,
        "two segments of two items remain"
    );
    assert!(h.outbox.get("s1-0").unwrap().is_none(), "pruned");
    assert!(h.outbox.get("s2-1").unwrap().is_none(), "pruned");
    assert!(h.outbox.get("s3-0").unwrap().is_some());
    assert!(h.outbox.get("s4-1").unwrap().is_some());
    let pruned: Vec<String> = durable_outbox::AuditLog::read(h.path("audit.jsonl"))
        .unwrap()
        .into_iter()
        .filter(|r| r.outcome.as_str() == "pruned")
        .map(|r| r.note.unwrap())
        .collect();
    assert_eq!(pruned.len(), 2, "{pruned:?}");
    assert!(pruned[0].contains("segment 1 (2 items"), "{pruned:?}");
    assert!(!h.path("history/seg-00000001.log").exists());
    // Another handle notices the pruned segments are gone.
    let other = h.reopen();
    assert!(other.get("s2-0").unwrap().is_none());
    other.verify_audit().unwrap();
}

// postgres: `MaxSegments` counts segment files, which PostgreSQL does not
// have; it keeps all history there (documented), so nothing is pruned.
#[test]
fn a_pruned_key_is_forgotten_and_can_be_enqueued_again() {
    let h = Harness::with(|b| b.history_retention(durable_outbox::Retention::MaxSegments(1)));
    add_segment(&h, "old", 1);
    add_segment(&h, "new", 1);
    assert!(h.outbox.get("old-0").unwrap().is_none());
    // The documented rule: the key is free again, and a new message is sent.
    let again = h.outbox.enqueue(msg("old-0", "chat-1")).unwrap();
    assert_eq!((again.state(), again.attempts()), (ItemState::Queued, 0));
}

// postgres: "never the newest segment" is a rule about segment files;
// PostgreSQL prunes every row past `MaxAge` (one_lifecycle covers that).
#[test]
fn retention_by_age_prunes_old_segments_but_never_the_newest() {
    let h = Harness::with(|b| b.history_retention(durable_outbox::Retention::MaxAge(DAY * 7)));
    add_segment(&h, "a", 1);
    h.clock.advance(DAY * 10);
    add_segment(&h, "b", 1);
    assert!(
        h.outbox.get("a-0").unwrap().is_none(),
        "older than 7 days: pruned"
    );
    assert!(h.outbox.get("b-0").unwrap().is_some());
    h.clock.advance(DAY * 30);
    h.settle_history();
    assert!(
        h.outbox.get("b-0").unwrap().is_some(),
        "the newest segment is always kept"
    );
    h.outbox.verify_audit().unwrap();
}
