//! The happy path a bot relies on: enqueue, deliver, correlate, never resend.
//!
//! Bodies in `on_both_engines!` run on the file engine and on PostgreSQL
//! (`name::file`, `name::postgres`). File-only here: the `#[test]` counts the
//! journal's entries (one per drain step).

use std::cell::Cell;

use durable_outbox::{Error, ItemState, Outcome, SendError};

use crate::engines::on_both_engines;
use crate::harness::{Harness, msg, secs};
use durable_outbox::{Backoff, Clock};

on_both_engines! {
    fn enqueue_then_process_delivers_once_and_records_the_transport_ref(engine) {
        let h = engine.harness();
        let item = h.outbox.enqueue(msg("order-17", "chat-42")).unwrap();
        assert_eq!(item.state(), ItemState::Queued);
        assert_eq!(item.attempts(), 0);

        let calls = Cell::new(0);
        let receipt = h
            .outbox
            .process("order-17", |item| {
                calls.set(calls.get() + 1);
                assert_eq!(item.content(), "body of order-17");
                assert!(
                    item.dispatch_claimed(),
                    "send runs with the claim persisted"
                );
                Ok(Some("tg-1".into()))
            })
            .unwrap();
        assert_eq!(receipt.outcome, Outcome::Sent);
        assert_eq!(receipt.attempts, 1);
        assert_eq!(receipt.transport_ref.as_deref(), Some("tg-1"));
        assert!(receipt.audit_id.is_some());
        assert_eq!(calls.get(), 1);

        let stored = h.outbox.get("order-17").unwrap().unwrap();
        assert_eq!(stored.state(), ItemState::Sent);
        assert!(!stored.dispatch_claimed());
        assert_eq!(stored.sent_at(), Some(h.clock_now()));
        assert_eq!(stored.transport_ref(), Some("tg-1"));
    }

    fn a_sent_item_is_never_sent_again_and_returns_the_same_receipt(engine) {
        let h = engine.harness();
        h.enqueue("k", "chat-1");
        let first = h.outbox.process("k", |_| Ok(Some("tg-9".into()))).unwrap();
        let again = h
            .outbox
            .process("k", |_| panic!("a sent item must not reach send"))
            .unwrap();
        assert_eq!(again, first);
    }

    fn a_failed_item_is_never_sent_again(engine) {
        let h = engine.harness();
        h.enqueue("k", "chat-1");
        let failed = h
            .outbox
            .process("k", |_| Err(SendError::permanent("chat_not_found")))
            .unwrap();
        assert_eq!(failed.outcome, Outcome::Failed);
        let again = h.outbox.process("k", |_| panic!("must not send")).unwrap();
        assert_eq!(again.outcome, Outcome::Failed);
        assert_eq!(again.error_code.as_deref(), Some("chat_not_found"));
    }

    fn enqueue_of_a_sent_key_returns_the_sent_item_without_requeueing(engine) {
        let h = engine.harness();
        h.enqueue("k", "chat-1");
        h.outbox.process("k", |_| Ok(None)).unwrap();
        let again = h.outbox.enqueue(msg("k", "chat-1")).unwrap();
        assert_eq!(again.state(), ItemState::Sent);
    }

    fn find_by_transport_ref_correlates_replies_and_ignores_blanks(engine) {
        let h = engine.harness();
        for (key, tr) in [("a", "tg-1"), ("b", "tg-2")] {
            h.enqueue(key, "chat-1");
            h.outbox.process(key, |_| Ok(Some(tr.into()))).unwrap();
            h.clock.advance(secs(10));
        }
        assert_eq!(
            h.outbox
                .find_by_transport_ref("tg-2")
                .unwrap()
                .unwrap()
                .idempotency_key(),
            "b"
        );
        assert!(h.outbox.find_by_transport_ref("tg-3").unwrap().is_none());
        assert!(h.outbox.find_by_transport_ref("  ").unwrap().is_none());
        assert!(h.outbox.find_by_transport_ref("").unwrap().is_none());
    }

    fn a_send_without_a_message_id_is_still_sent(engine) {
        let h = engine.harness();
        h.enqueue("k", "chat-1");
        let r = h.outbox.process("k", |_| Ok(Some("   ".into()))).unwrap();
        assert_eq!(r.outcome, Outcome::Sent);
        assert_eq!(r.transport_ref, None, "a blank id is not a reference");
    }

    fn list_items_is_sorted_by_key_and_get_returns_none_for_unknown_keys(engine) {
        let h = engine.harness();
        for key in ["c", "a", "b"] {
            h.enqueue(key, "chat-1");
        }
        let keys: Vec<_> = h
            .outbox
            .list_items()
            .unwrap()
            .iter()
            .map(|i| i.idempotency_key().to_owned())
            .collect();
        assert_eq!(keys, ["a", "b", "c"]);
        assert!(h.outbox.get("zzz").unwrap().is_none());
    }

    fn processing_an_unknown_key_is_a_typed_error(engine) {
        let h = engine.harness();
        let err = h.outbox.process("ghost", |_| Ok(None)).unwrap_err();
        assert!(
            matches!(err, Error::NotFound { ref key } if key == "ghost"),
            "{err}"
        );
    }

    fn process_due_drains_oldest_first_and_tallies_every_outcome(engine) {
        let h = engine.harness_with(|b| b.rate_limit(1, secs(60)));
        // Enqueued out of key order, to prove the drain goes by age, not by key.
        for key in ["b-first", "a-second"] {
            h.enqueue(key, "chat-1");
            h.clock.advance(secs(1));
        }
        h.enqueue("c-perm", "chat-2");
        h.enqueue("d-retry", "chat-3");
        let mut order = Vec::new();
        let report = h
            .outbox
            .process_due(|item| {
                order.push(item.idempotency_key().to_owned());
                match item.idempotency_key() {
                    "c-perm" => Err(SendError::permanent("bot_blocked")),
                    "d-retry" => Err(SendError::retryable("http_503")),
                    _ => Ok(None),
                }
            })
            .unwrap();
        assert_eq!(
            order,
            ["b-first", "c-perm", "d-retry"],
            "a-second is capped behind b-first"
        );
        assert_eq!(
            (
                report.sent,
                report.failed,
                report.deferred,
                report.retried,
                report.in_flight
            ),
            (1, 1, 1, 1, 0)
        );
        assert_eq!(report.total(), 4);
    }

    fn process_due_skips_items_that_are_not_due_yet(engine) {
        let h = engine.harness();
        h.enqueue("k", "chat-1");
        let r = h
            .outbox
            .process(
                "k",
                |_| Err(SendError::retryable("x").retry_after(secs(30))),
            )
            .unwrap();
        assert_eq!(r.outcome, Outcome::Deferred);
        let report = h.outbox.process_due(|_| panic!("not due")).unwrap();
        assert_eq!(report.total(), 0);
        h.clock.advance(secs(30));
        let report = h.outbox.process_due(|_| Ok(None)).unwrap();
        assert_eq!(report.sent, 1);
    }

    fn a_panic_mid_drain_records_what_was_sent_and_releases_what_was_not(engine) {
        let h = engine.harness();
        for i in 0..5 {
            h.enqueue(&format!("k{i}"), &format!("chat-{i}"));
            h.clock.advance(secs(1));
        }
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            h.outbox.process_due(|item| {
                assert!(item.idempotency_key() != "k2", "transport bug");
                Ok(None)
            })
        }));
        assert!(caught.is_err(), "the panic reaches the caller");
        let state = |key: &str| {
            let item = h.outbox.get(key).unwrap().unwrap();
            (item.state(), item.attempts(), item.dispatch_claimed())
        };
        assert_eq!(state("k0"), (ItemState::Sent, 1, false));
        assert_eq!(state("k1"), (ItemState::Sent, 1, false));
        assert_eq!(
            state("k2"),
            (ItemState::Failed, 1, false),
            "the panicked send is ambiguous"
        );
        assert_eq!(
            state("k3"),
            (ItemState::Queued, 0, false),
            "never handed to send: untouched"
        );
        assert_eq!(state("k4"), (ItemState::Queued, 0, false));
        let report = h.outbox.process_due(|_| Ok(None)).unwrap();
        assert_eq!(report.sent, 2);
        h.outbox.verify_audit().unwrap();
    }
}

on_both_engines! {
    fn enqueue_is_idempotent_for_the_same_message(engine) {
        let h = engine.harness();
        let first = h.outbox.enqueue(msg("k", "chat-1")).unwrap();
        let audit = h.audit_records();
        let second = h.outbox.enqueue(msg("k", "chat-1")).unwrap();
        assert_eq!(first, second);
        assert_eq!(
            h.audit_records(),
            audit,
            "a duplicate enqueue records nothing"
        );
        assert_eq!(h.outbox.list_items().unwrap().len(), 1);
    }
}

impl Harness {
    pub fn clock_now(&self) -> chrono::DateTime<chrono::Utc> {
        use durable_outbox::Clock;
        self.clock.now()
    }
}

#[test]
fn process_due_records_each_outcome_in_the_step_that_claims_the_next_item() {
    let h = Harness::new();
    for i in 0..8 {
        h.enqueue(&format!("k{i}"), &format!("chat-{i}"));
    }
    let entries = || {
        std::fs::read_to_string(h.path("outbox.journal"))
            .unwrap()
            .lines()
            .count()
    };
    let before = entries();
    let report = h.outbox.process_due(|_| Ok(None)).unwrap();
    assert_eq!(report.sent, 8);
    assert_eq!(
        entries() - before,
        9,
        "one claim, then seven entries each recording one send and claiming the next, then the last outcome"
    );
}

on_both_engines! {
    /// Enqueue is durable and idempotent; get, list, process and both
    /// transport-ref lookups see what was recorded; the audit chain verifies.
    fn enqueue_process_and_correlate(engine) {
        let outbox = engine.open();
        outbox.enqueue(msg("b", "chat-2")).unwrap();
        let a = outbox.enqueue(msg("a", "chat-1")).unwrap();
        assert_eq!((a.state(), a.attempts()), (ItemState::Queued, 0));
        // The same message again is the same item; another message under the key is refused.
        assert_eq!(outbox.enqueue(msg("a", "chat-1")).unwrap(), a);
        let mut other = msg("a", "chat-1");
        other.content = "something else".into();
        assert!(matches!(
            outbox.enqueue(other),
            Err(Error::IdempotencyConflict { .. })
        ));

        let keys: Vec<String> = outbox
            .list_items()
            .unwrap()
            .iter()
            .map(|i| i.idempotency_key().to_owned())
            .collect();
        assert_eq!(keys, ["a", "b"], "sorted by key");

        let receipt = outbox.process("a", |_| Ok(Some("7".into()))).unwrap();
        assert_eq!(receipt.outcome, Outcome::Sent);
        let again = outbox.process("a", |_| panic!("a sent item is never sent again")).unwrap();
        assert_eq!(again.outcome, Outcome::Sent);
        outbox.process("b", |_| Ok(Some("7".into()))).unwrap();

        // A second handle (another process or host) sees the same.
        let other = engine.open();
        let sent = other.get("a").unwrap().expect("a exists");
        assert_eq!((sent.state(), sent.transport_ref()), (ItemState::Sent, Some("7")));
        assert_eq!(
            other.find_by_transport_ref_in("chat-2", "7").unwrap().unwrap().idempotency_key(),
            "b"
        );
        assert_eq!(
            other.find_by_transport_ref("7").unwrap().unwrap().idempotency_key(),
            "a",
            "the first by key"
        );
        assert!(other.find_by_transport_ref_in("chat-3", "7").unwrap().is_none());
        assert!(other.get("missing").unwrap().is_none());
        let report = other.verify_audit().unwrap();
        assert_eq!(report.records, 4, "two queued, two sent");
        let outcomes: Vec<&str> = other.history("a").unwrap().iter().map(|r| r.outcome.as_str()).collect();
        assert_eq!(outcomes, ["queued", "sent"]);
    }

    /// `enqueue_many` is all or nothing: one conflicting message and none is written.
    fn enqueue_many_is_all_or_nothing(engine) {
        let outbox = engine.open();
        outbox.enqueue(msg("taken", "chat-1")).unwrap();
        let mut conflicting = msg("taken", "chat-1");
        conflicting.content = "another body".into();
        let result = outbox.enqueue_many(vec![msg("new-1", "chat-1"), conflicting, msg("new-2", "chat-2")]);
        assert!(matches!(result, Err(Error::IdempotencyConflict { .. })), "{result:?}");
        let other = engine.open();
        assert!(other.get("new-1").unwrap().is_none(), "nothing of the batch was written");
        assert!(other.get("new-2").unwrap().is_none());
        assert_eq!(other.verify_audit().unwrap().records, 1);
        let items = other.enqueue_many(vec![msg("new-1", "chat-1"), msg("new-2", "chat-2")]).unwrap();
        assert_eq!(items.len(), 2);
        assert_eq!(outbox.list_items().unwrap().len(), 3);
    }

    /// `next_due_at` says when a hand-written loop should look again: now
    /// when something is due, a retry's moment when only that is left, and an
    /// item waiting behind its chat's deferred head does not count.
    fn next_due_at_tells_a_loop_when_to_look(engine) {
        let outbox = engine.open_with(|b| {
            b.backoff(Backoff::Fixed(vec![secs(30)]))
                .max_inline_wait(secs(0))
                .rate_limit(u32::MAX, secs(60))
        });
        assert_eq!(outbox.next_due_at().unwrap(), None, "nothing queued");
        let now = engine.clock.now();
        outbox.enqueue(msg("a", "chat-1")).unwrap();
        assert!(outbox.next_due_at().unwrap().is_some_and(|at| at <= now));
        outbox.process("a", |_| Err(SendError::retryable("timeout"))).unwrap();
        let retry_at = now + chrono::Duration::seconds(30);
        assert_eq!(outbox.next_due_at().unwrap(), Some(retry_at));
        outbox.enqueue(msg("b", "chat-1")).unwrap();
        assert_eq!(
            engine.open().next_due_at().unwrap(),
            Some(retry_at),
            "b waits behind a"
        );
        outbox.enqueue(msg("c", "chat-2")).unwrap();
        assert!(outbox.next_due_at().unwrap().is_some_and(|at| at <= now));
    }
}
