//! Terminal items leave the live state for `history/` and stay findable:
//! by key, by transport ref, for idempotent enqueue, for requeue.

use std::time::Duration;

use durable_outbox::{Error, ItemState, Outbox, Outcome, SendError};

use crate::harness::{Harness, builder, msg, secs};

const DAY: Duration = Duration::from_secs(24 * 60 * 60);

/// An outbox with `n` sent items (refs `tr-i`) and one failed one, a day old.
fn with_old_traffic(n: usize) -> Harness {
    let h = Harness::new();
    for i in 0..n {
        let key = format!("old-{i}");
        h.enqueue(&key, &format!("chat-{}", i % 3));
        h.outbox
            .process(&key, |_| Ok(Some(format!("tr-{i}"))))
            .unwrap();
    }
    h.enqueue("old-failed", "chat-9");
    h.outbox
        .process("old-failed", |_| {
            Err(SendError::permanent("chat_not_found"))
        })
        .unwrap();
    h.clock.advance(DAY + secs(1));
    h
}

#[test]
fn old_terminal_items_move_to_history_and_stay_findable() {
    let h = with_old_traffic(5);
    h.enqueue("fresh", "chat-1");
    h.outbox.compact().unwrap();
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
    assert!(
        std::fs::read_to_string(h.path("outbox.json"))
            .unwrap()
            .matches("idempotency_key")
            .count()
            == 1
    );
    // Another handle, and a reopened one, see the same.
    assert_eq!(
        h.reopen().get("old-0").unwrap().unwrap().transport_ref(),
        Some("tr-0")
    );
}

#[test]
fn a_history_item_is_never_sent_again_and_its_key_stays_taken() {
    let h = with_old_traffic(2);
    h.outbox.compact().unwrap();
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

#[test]
fn a_failed_item_in_history_can_still_be_requeued() {
    let h = with_old_traffic(1);
    h.outbox.compact().unwrap();
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

#[test]
fn items_inside_a_rate_window_stay_live_whatever_history_after_says() {
    let h = Harness::with(|b| b.history_after(Duration::ZERO).rate_limit(1, secs(600)));
    h.enqueue("a", "chat-1");
    h.outbox.process("a", |_| Ok(None)).unwrap();
    h.clock.advance(secs(60));
    h.outbox.compact().unwrap();
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
    h.outbox.compact().unwrap();
    assert_eq!(h.outbox.history_len().unwrap(), 1);
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
