//! One lifecycle, two engines: the core delivery guarantees, each written once
//! and run against the file engine and against PostgreSQL (`engines`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use durable_outbox::{
    AMBIGUOUS_AFTER_RESTART, Backoff, CANCELLED, Clock, DESTINATION_COOLDOWN, Error, FailureClass,
    ItemState, Outcome, RATE_CAPPED, SendError,
};

use crate::engines::on_both_engines;
use crate::harness::{DEADLOCK_LIMIT, msg, secs, within};

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

    /// Messages to one destination go in enqueue order; a later one waits.
    fn per_destination_order(engine) {
        let outbox = engine.open_with(|b| b.rate_limit(u32::MAX, secs(60)));
        for key in ["a1", "a2", "a3"] {
            outbox.enqueue(msg(key, "chat-a")).unwrap();
        }
        outbox.enqueue(msg("b1", "chat-b")).unwrap();
        let early = outbox.process("a2", |_| panic!("a2 must wait for a1")).unwrap();
        assert_eq!(early.outcome, Outcome::Waiting);

        let sent: Arc<Mutex<Vec<String>>> = Arc::default();
        let log = Arc::clone(&sent);
        let report = engine
            .open()
            .process_due(move |item| {
                log.lock().unwrap().push(item.idempotency_key().to_owned());
                Ok(None)
            })
            .unwrap();
        assert_eq!(report.sent, 4);
        let sent = sent.lock().unwrap();
        let chat_a: Vec<&String> = sent.iter().filter(|k| k.starts_with('a')).collect();
        assert_eq!(chat_a, ["a1", "a2", "a3"]);
    }

    /// A rate cap and a platform cooldown hold for every handle of the outbox.
    fn caps_and_cooldowns_hold_across_handles(engine) {
        let first = engine.open_with(|b| b.rate_limit(1, secs(60)));
        let second = engine.open();
        for (key, chat) in [("a", "chat-1"), ("b", "chat-1"), ("c", "chat-2"), ("d", "chat-2")] {
            first.enqueue(msg(key, chat)).unwrap();
        }
        let t0 = engine.clock.now();
        assert_eq!(first.process("a", |_| Ok(None)).unwrap().outcome, Outcome::Sent);
        engine.clock.advance(secs(10));
        let capped = second.process("b", |_| panic!("over the cap")).unwrap();
        assert_eq!(capped.outcome, Outcome::Deferred);
        assert_eq!(capped.error_code.as_deref(), Some(RATE_CAPPED));
        assert_eq!(capped.next_attempt_at, Some(t0 + chrono::Duration::seconds(60)));
        assert_eq!(capped.attempts, 0, "a deferral is not an attempt");
        assert_eq!(
            second.settings().unwrap().rate_limit().count,
            1,
            "the first handle's cap is stored and in force for the second"
        );

        // A 429 on chat-2 cools the whole destination down, for every handle.
        let refused = first
            .process("c", |_| Err(SendError::retryable("429").retry_after(secs(30))))
            .unwrap();
        assert_eq!(refused.outcome, Outcome::Deferred);
        // The cooldown belongs to the destination, not to the item that got it.
        first.cancel("c", "ops", "superseded").unwrap();
        let cooled = second.process("d", |_| panic!("cooling down")).unwrap();
        assert_eq!(cooled.outcome, Outcome::Deferred);
        assert_eq!(cooled.error_code.as_deref(), Some(DESTINATION_COOLDOWN));
        engine.clock.advance(secs(31));
        assert_eq!(second.process("d", |_| Ok(None)).unwrap().outcome, Outcome::Sent);
    }

    /// A retryable failure is retried after its backoff; out of attempts it fails.
    fn retry_then_give_up(engine) {
        let outbox = engine.open_with(|b| {
            b.max_attempts(2)
                .backoff(Backoff::Fixed(vec![secs(30)]))
                .max_inline_wait(secs(0))
        });
        outbox.enqueue(msg("a", "chat-1")).unwrap();
        let first = outbox.process("a", |_| Err(SendError::retryable("timeout"))).unwrap();
        assert_eq!((first.outcome, first.attempts), (Outcome::Deferred, 1));
        assert_eq!(
            outbox.process("a", |_| panic!("not due yet")).unwrap().outcome,
            Outcome::Deferred
        );
        engine.clock.advance(secs(30));
        let second = outbox.process("a", |_| Err(SendError::retryable("timeout"))).unwrap();
        assert_eq!((second.outcome, second.attempts), (Outcome::Failed, 2));
        let item = engine.open().get("a").unwrap().unwrap();
        assert_eq!(item.failure_class(), Some(FailureClass::Retryable));
        assert_eq!(item.error_code(), Some("timeout"));
    }

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

on_both_engines! {
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

    /// Settings the first handle stored are in force for a handle opened
    /// with other values; `update_settings` changes them, audited.
    fn stored_settings_are_shared(engine) {
        let first = engine.open_with(|b| b.max_attempts(3));
        first.enqueue(msg("a", "chat-1")).unwrap();
        let second = engine.open_with(|b| b.max_attempts(7));
        assert_eq!(second.settings().unwrap().max_attempts(), 3, "the stored value wins");
        let third = engine.open_with(|b| b.max_attempts(5).update_settings());
        assert_eq!(third.settings().unwrap().max_attempts(), 5);
        assert_eq!(first.settings().unwrap().max_attempts(), 5, "reaches open handles");
        let note = third.history("settings").unwrap().last().and_then(|r| r.note.clone());
        assert!(note.is_some_and(|n| n.contains("max_attempts 3 -> 5")));
        third.verify_audit().unwrap();
    }
}

#[cfg(feature = "tokio")]
on_both_engines! {
    /// The delivery worker drains what another handle (process, host)
    /// enqueues while it runs, woken without polling the items.
    fn the_worker_drains_what_another_handle_enqueues(engine) {
        use std::time::Duration;
        let worker_handle = engine.open_with(|b| b.rate_limit(u32::MAX, secs(60)));
        // The same settings: on a new directory the handle that commits
        // first stores its own (the clock is manual: a cap would never free).
        let producer = engine.open_with(|b| b.rate_limit(u32::MAX, secs(60)));
        let sent: Arc<Mutex<Vec<String>>> = Arc::default();
        let log = Arc::clone(&sent);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let report = within("the worker is woken by another handle's enqueue", DEADLOCK_LIMIT * 2, || {
            runtime.block_on(async {
                let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
                let worker = worker_handle.worker(move |item: durable_outbox::OutboxItem| {
                    let log = Arc::clone(&log);
                    async move {
                        log.lock().unwrap().push(item.idempotency_key().to_owned());
                        Ok::<_, SendError>(None)
                    }
                });
                let running = tokio::spawn(worker.run(async move {
                    stopped.await.ok();
                }));
                tokio::time::sleep(Duration::from_millis(200)).await;
                for (key, chat) in [("a1", "chat-a"), ("b1", "chat-b"), ("a2", "chat-a")] {
                    producer.enqueue(msg(key, chat)).unwrap();
                }
                while sent.lock().unwrap().len() < 3 {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                stop.send(()).unwrap();
                running.await.unwrap().unwrap()
            })
        });
        assert_eq!(report.sent, 3);
        let sent = sent.lock().unwrap();
        let chat_a: Vec<&String> = sent.iter().filter(|k| k.starts_with('a')).collect();
        assert_eq!(chat_a, ["a1", "a2"], "in order");
        assert!(producer.list_items().unwrap().iter().all(|i| i.state() == ItemState::Sent));
    }
}

on_both_engines! {
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
}

#[cfg(feature = "tokio")]
on_both_engines! {
    /// The async forms keep the same guarantees; a send future dropped
    /// mid-flight fails its item as ambiguous (`send_cancelled`), never resent.
    fn async_forms_and_a_dropped_send(engine) {
        use durable_outbox::SEND_CANCELLED;
        let outbox = engine.open_with(|b| b.rate_limit(u32::MAX, secs(60)));
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            outbox.enqueue_async(msg("a", "chat-1")).await.unwrap();
            outbox.enqueue_async(msg("b", "chat-2")).await.unwrap();
            outbox.enqueue_async(msg("c", "chat-3")).await.unwrap();
            let receipt = outbox
                .process_async("a", |_| async { Ok(Some("ref-a".into())) })
                .await
                .unwrap();
            assert_eq!(receipt.outcome, Outcome::Sent);
            // A send that never finishes, dropped by a timeout.
            let (entered_tx, entered_rx) = tokio::sync::oneshot::channel::<()>();
            let mut entered_tx = Some(entered_tx);
            let stuck = outbox.process_async("b", move |_| {
                if let Some(tx) = entered_tx.take() {
                    tx.send(()).ok();
                }
                std::future::pending::<Result<Option<String>, SendError>>()
            });
            tokio::select! {
                _ = stuck => panic!("the send never finishes"),
                _ = entered_rx => {}
            }
            let report = outbox
                .process_due_async(2, |_| async { Ok(None) })
                .await
                .unwrap();
            assert_eq!(report.sent, 1, "only c: b is ambiguous, never resent");
            let found = outbox.find_by_transport_ref_async("ref-a").await.unwrap().unwrap();
            assert_eq!(found.idempotency_key(), "a");
        });
        let b = engine.open().get("b").unwrap().unwrap();
        assert_eq!(
            (b.state(), b.error_code(), b.failure_class()),
            (ItemState::Failed, Some(SEND_CANCELLED), Some(FailureClass::Ambiguous))
        );
    }
}

on_both_engines! {
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
}

on_both_engines! {
    /// `rate_windows` measures each destination as the caps see it: sends in
    /// the window (an ambiguous one included; a refused one not), when it
    /// frees, what is queued, a cooldown.
    fn rate_windows_measure_what_the_caps_see(engine) {
        let outbox = engine.open_with(|b| b.rate_limit(2, secs(60)));
        for (key, chat) in [("a", "chat-1"), ("b", "chat-1"), ("c", "chat-1"), ("d", "chat-2")] {
            outbox.enqueue(msg(key, chat)).unwrap();
        }
        let t0 = engine.clock.now();
        outbox.process("a", |_| Ok(None)).unwrap();
        engine.clock.advance(secs(10));
        outbox.process("b", |_| Err(SendError::ambiguous("reset"))).unwrap();
        outbox
            .process("d", |_| Err(SendError::retryable("429").retry_after(secs(30))))
            .unwrap();
        let windows = engine.open().rate_windows(None).unwrap();
        let summary: Vec<(String, usize, usize, bool, bool)> = windows
            .iter()
            .map(|w| {
                (
                    w.destination.clone(),
                    w.sends_in_window,
                    w.queued,
                    w.next_free_slot.is_some(),
                    w.cooldown_until.is_some(),
                )
            })
            .collect();
        assert_eq!(
            summary,
            [
                ("chat-1".to_owned(), 2, 1, true, false),
                ("chat-2".to_owned(), 0, 1, false, true),
            ]
        );
        assert_eq!(windows[0].next_free_slot, Some(t0 + chrono::Duration::seconds(60)));
        let what_if = outbox.rate_windows(Some(durable_outbox::RateLimit { count: 5, window: secs(60) }));
        assert!(what_if.unwrap().iter().all(|w| w.next_free_slot.is_none()));
    }
}

on_both_engines! {
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

on_both_engines! {
    /// The cap across all destinations holds for every handle: the third
    /// send in its window, from another handle, waits for the first to age out.
    fn the_global_cap_holds_across_handles(engine) {
        let configure = |b: durable_outbox::OutboxBuilder| {
            b.rate_limit(u32::MAX, secs(60)).global_rate_limit(2, secs(60))
        };
        let first = engine.open_with(configure);
        let second = engine.open_with(configure);
        for (key, chat) in [("a", "chat-1"), ("b", "chat-2"), ("c", "chat-3")] {
            first.enqueue(msg(key, chat)).unwrap();
        }
        let t0 = engine.clock.now();
        assert_eq!(first.process("a", |_| Ok(None)).unwrap().outcome, Outcome::Sent);
        engine.clock.advance(secs(5));
        assert_eq!(second.process("b", |_| Ok(None)).unwrap().outcome, Outcome::Sent);
        let capped = second.process("c", |_| panic!("over the global cap")).unwrap();
        assert_eq!(capped.outcome, Outcome::Deferred);
        assert_eq!(capped.error_code.as_deref(), Some(durable_outbox::GLOBAL_RATE_CAPPED));
        assert_eq!(capped.next_attempt_at, Some(t0 + chrono::Duration::seconds(60)));
        engine.clock.set(t0 + chrono::Duration::seconds(60));
        assert_eq!(first.process("c", |_| Ok(None)).unwrap().outcome, Outcome::Sent);
    }
}

on_both_engines! {
    /// A message in flight holds its chat's followers for every other handle;
    /// `Ordering::Unordered` opts out, and a drain then passes a deferred item.
    fn order_holds_across_handles_unless_unordered(engine) {
        let outbox = engine.open_with(|b| b.rate_limit(u32::MAX, secs(60)));
        outbox.enqueue(msg("m1", "chat-1")).unwrap();
        outbox.enqueue(msg("m2", "chat-1")).unwrap();
        let other = engine.open();
        let first = outbox
            .process("m1", |_| {
                let r = other.process("m2", |_| panic!("m2 started while m1 was in flight")).unwrap();
                assert_eq!(r.outcome, Outcome::Waiting);
                let drained = other.process_due(|_| panic!("nothing may pass m1")).unwrap();
                assert_eq!(drained.sent, 0);
                Ok(None)
            })
            .unwrap();
        assert_eq!(first.outcome, Outcome::Sent);

        let loose = engine.open_with(|b| {
            b.ordering(durable_outbox::Ordering::Unordered)
                .backoff(Backoff::Fixed(vec![secs(30)]))
                .max_inline_wait(secs(0))
                .update_settings()
        });
        loose.enqueue(msg("u1", "chat-2")).unwrap();
        loose.enqueue(msg("u2", "chat-2")).unwrap();
        loose.process("u1", |_| Err(SendError::retryable("timeout"))).unwrap();
        let sent: Arc<Mutex<Vec<String>>> = Arc::default();
        let log = Arc::clone(&sent);
        loose
            .process_due(move |item| {
                log.lock().unwrap().push(item.idempotency_key().to_owned());
                Ok(None)
            })
            .unwrap();
        assert_eq!(*sent.lock().unwrap(), ["m2", "u2"], "u2 passes the deferred u1");
    }
}
