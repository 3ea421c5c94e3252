//! At-most-once: a claim is persisted before send; live claims block, dead ones fail as ambiguous.
//!
//! Bodies in `on_both_engines!` run on the file engine and on PostgreSQL
//! (`name::file`, `name::postgres`). File-only here: the `#[test]` forges a
//! dead claim in the snapshot by hand.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc;

use durable_outbox::{AMBIGUOUS_AFTER_RESTART, ItemState, Outcome, SEND_PANICKED, SendError};

use crate::engines::on_both_engines;
use crate::harness::{DEADLOCK_LIMIT, Harness, uncapped, within};
use crate::harness::{msg, secs};
use durable_outbox::FailureClass;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Runs `during` while another thread is inside `send` for `key`, then lets it finish.
fn while_sending(h: &Harness, key: &str, during: impl FnOnce()) -> Outcome {
    within(
        "the lock is never held while send runs",
        DEADLOCK_LIMIT,
        || sending(h, key, during),
    )
}

fn sending(h: &Harness, key: &str, during: impl FnOnce()) -> Outcome {
    let (entered_tx, entered_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    std::thread::scope(|s| {
        let outbox = h.outbox.clone();
        let sender = s.spawn(move || {
            outbox
                .process(key, |_| {
                    entered_tx.send(()).unwrap();
                    release_rx.recv().unwrap();
                    Ok(Some("tg-live".into()))
                })
                .unwrap()
                .outcome
        });
        entered_rx.recv().unwrap();
        during();
        release_tx.send(()).unwrap();
        sender.join().unwrap()
    })
}

on_both_engines! {
    fn a_second_thread_gets_in_flight_and_changes_nothing(engine) {
        let h = engine.harness();
        h.enqueue("k", "chat-1");
        let outcome = while_sending(&h, "k", || {
            let receipt =
                h.assert_files_unchanged(|| h.outbox.process("k", |_| panic!("sent twice")).unwrap());
            assert_eq!(receipt.outcome, Outcome::InFlight);
            assert_eq!(receipt.audit_id, None);
        });
        assert_eq!(outcome, Outcome::Sent);
        assert_eq!(h.outbox.get("k").unwrap().unwrap().attempts(), 1);
    }

    fn another_open_handle_sees_a_live_claim_as_in_flight(engine) {
        let h = engine.harness();
        h.enqueue("k", "chat-1");
        let other = h.reopen();
        let outcome = while_sending(&h, "k", || {
            let receipt = other.process("k", |_| panic!("sent twice")).unwrap();
            assert_eq!(receipt.outcome, Outcome::InFlight);
            let report = other.process_due(|_| panic!("sent twice")).unwrap();
            assert_eq!(report.in_flight, 1);
        });
        assert_eq!(outcome, Outcome::Sent);
    }

    fn a_panic_in_send_fails_the_item_as_ambiguous_and_leaves_the_outbox_usable(engine) {
        let h = engine.harness_with(uncapped);
        h.enqueue("boom", "chat-1");
        h.enqueue("next", "chat-1");
        let caught = catch_unwind(AssertUnwindSafe(|| {
            h.outbox
                .process("boom", |_| -> Result<Option<String>, SendError> {
                    panic!("transport bug")
                })
        }));
        assert!(caught.is_err(), "the panic reaches the caller");
        let item = h.outbox.get("boom").unwrap().unwrap();
        assert_eq!(item.state(), ItemState::Failed);
        assert_eq!(item.error_code(), Some(SEND_PANICKED));
        assert!(!item.dispatch_claimed());
        assert_eq!(
            h.outbox
                .process("boom", |_| panic!("resent"))
                .unwrap()
                .outcome,
            Outcome::Failed
        );
        assert_eq!(
            h.outbox.process("next", |_| Ok(None)).unwrap().outcome,
            Outcome::Sent
        );
        h.outbox.verify_audit().unwrap();
    }

    fn ambiguous_and_permanent_failures_are_not_retried(engine) {
        for error in [
            SendError::ambiguous("read_timeout"),
            SendError::permanent("chat_not_found"),
        ] {
            // One outbox per engine under test: each failure gets its own
            // key and chat (the default cap would defer a second send to one chat).
            let h = engine.harness();
            let key = error.code().to_owned();
            h.enqueue(&key, &format!("chat-{key}"));
            let mut calls = 0;
            let receipt = h
                .outbox
                .process(&key, |_| {
                    calls += 1;
                    Err(error.clone())
                })
                .unwrap();
            assert_eq!(calls, 1, "{error}");
            assert_eq!(receipt.outcome, Outcome::Failed);
            assert_eq!(receipt.error_code.as_deref(), Some(error.code()));
        }
    }

    fn many_threads_racing_on_the_same_keys_send_each_exactly_once(engine) {
        let h = engine.harness();
        let keys: Vec<String> = (0..20).map(|i| format!("k{i}")).collect();
        for (i, key) in keys.iter().enumerate() {
            h.enqueue(key, &format!("chat-{i}"));
        }
        let sends = std::sync::Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for key in &keys {
                        h.outbox
                            .process(key, |item| {
                                sends
                                    .lock()
                                    .unwrap()
                                    .push(item.idempotency_key().to_owned());
                                Ok(None)
                            })
                            .unwrap();
                    }
                });
            }
        });
        let mut sends = sends.into_inner().unwrap();
        sends.sort();
        let mut expected = keys.clone();
        expected.sort();
        assert_eq!(sends, expected, "every key sent exactly once");
        h.outbox.verify_audit().unwrap();
    }
}

#[test]
fn a_claim_whose_owner_is_gone_fails_as_ambiguous_without_sending() {
    let h = Harness::new();
    h.enqueue("k", "chat-1");
    // The handle that claims it disappears without recording an outcome, as a
    // process would after kill -9: forge that by naming, in a fresh snapshot
    // (compact first so the snapshot holds everything), an owner whose owner
    // file is still there but unlocked, which is what SIGKILL leaves.
    h.outbox.compact().unwrap();
    let path = h.path("outbox.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let text = text.replace(
        "\"dispatch_claimed\": false",
        "\"claim_owner\": \"4242-dead-0\",\n      \"claimed_at_utc\": \"2026-01-15T09:00:00.000000Z\",\n      \"dispatch_claimed\": true",
    );
    std::fs::write(&path, text).unwrap();
    crate::harness::plant_dead_owner(h.dir.path(), "4242-dead-0");

    let receipt = h
        .outbox
        .process("k", |_| panic!("an ambiguous claim must never be resent"))
        .unwrap();
    assert_eq!(receipt.outcome, Outcome::Failed);
    assert_eq!(receipt.error_code.as_deref(), Some(AMBIGUOUS_AFTER_RESTART));
    let item = h.outbox.get("k").unwrap().unwrap();
    assert_eq!(item.state(), ItemState::Failed);
    assert!(!item.dispatch_claimed());
    assert_eq!(h.audit_outcomes().last().unwrap(), "failed:k");
}

on_both_engines! {
    /// Handles racing to process the same keys: each key is sent exactly once.
    fn exactly_once_claim_under_races(engine) {
        let keys: Vec<String> = (0..12).map(|i| format!("k{i}")).collect();
        let first = engine.open_with(|b| b.rate_limit(u32::MAX, secs(60)));
        first
            .enqueue_many(keys.iter().map(|k| msg(k, &format!("chat-{k}"))).collect())
            .unwrap();
        let handles: Vec<_> = (0..3)
            .map(|_| engine.open_with(|b| b.rate_limit(u32::MAX, secs(60))))
            .collect();
        let sends: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
        within("each key is claimed by one handle only", DEADLOCK_LIMIT * 4, || {
            std::thread::scope(|scope| {
                for (i, handle) in handles.iter().enumerate() {
                    for thread in 0..2 {
                        let (keys, sends) = (&keys, Arc::clone(&sends));
                        scope.spawn(move || {
                            let mut order: Vec<&String> = keys.iter().collect();
                            if (i + thread) % 2 == 1 {
                                order.reverse();
                            }
                            for key in order {
                                handle
                                    .process(key, |item| {
                                        *sends
                                            .lock()
                                            .unwrap()
                                            .entry(item.idempotency_key().to_owned())
                                            .or_default() += 1;
                                        Ok(None)
                                    })
                                    .unwrap();
                            }
                        });
                    }
                }
            });
        });
        let sends = sends.lock().unwrap();
        for key in &keys {
            assert_eq!(sends.get(key), Some(&1), "{key} sent exactly once");
        }
        assert!(first.list_items().unwrap().iter().all(|i| i.state() == ItemState::Sent));
        first.verify_audit().unwrap();
    }

    /// A claim whose owner died mid-send (its liveness token is free) is
    /// failed as ambiguous by the next handle that looks, and never resent.
    fn a_dead_owners_claim_becomes_ambiguous_never_resent(engine) {
        engine.open().enqueue(msg("k", "chat-1")).unwrap();
        engine.forge_dead_claim("k");
        let outbox = engine.open();
        let receipt = outbox
            .process("k", |_| panic!("an ambiguous claim must never be resent"))
            .unwrap();
        assert_eq!(receipt.outcome, Outcome::Failed);
        assert_eq!(receipt.error_code.as_deref(), Some(AMBIGUOUS_AFTER_RESTART));
        let report = outbox.process_due(|_| panic!("never resent by a drain")).unwrap();
        assert_eq!(report.sent, 0);
        let item = engine.open().get("k").unwrap().unwrap();
        assert_eq!(
            (item.state(), item.failure_class()),
            (ItemState::Failed, Some(FailureClass::Ambiguous))
        );
        let outcomes: Vec<&str> = outbox.history("k").unwrap().iter().map(|r| r.outcome.as_str()).collect();
        assert_eq!(outcomes, ["queued", "failed"]);
        outbox.verify_audit().unwrap();
    }
}
