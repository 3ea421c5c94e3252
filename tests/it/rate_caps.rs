//! Per-destination sliding-window caps, counted from persisted send times.
//!
//! Bodies in `on_both_engines!` run on the file engine and on PostgreSQL
//! (`name::file`, `name::postgres`); a restart is a handle dropped and another
//! opened (another process, or host). File-only here: the `#[test]`s edit
//! `outbox.json` to model what older releases wrote.

use durable_outbox::{Clock, Ordering, Outcome, RATE_CAPPED, RateLimit};

use crate::engines::{EngineUnderTest, on_both_engines};
use crate::harness::msg;
use crate::harness::{Harness, builder, secs};
use durable_outbox::{DESTINATION_COOLDOWN, SendError};

on_both_engines! {
    /// Threads of one handle deciding about items of one destination at
    /// the same moment (unordered, so each item is claimable) see each
    /// other's claims: a cap of one lets exactly one of them send. On
    /// PostgreSQL the decisions run side by side and only the destination's
    /// lock, held exclusive from the line's read to the commit, keeps them
    /// apart, whether the decision reads the line as it opens (an item this
    /// handle enqueued: even rounds) or later (one another handle enqueued:
    /// odd rounds).
    fn a_cap_holds_among_a_handle_s_threads_deciding_at_once(engine) {
        const THREADS: usize = 8;
        const ROUNDS: usize = 12;
        let h = engine.harness_with(|b| b.rate_limit(1, secs(60)).ordering(Ordering::Unordered));
        let other = h.reopen_with(|b| b.rate_limit(1, secs(60)).ordering(Ordering::Unordered));
        let mut sent_per_round = Vec::new();
        for round in 0..ROUNDS {
            let enqueuer = if round % 2 == 0 { &h.outbox } else { &other };
            let destination = format!("chat-{round}");
            let keys: Vec<String> = (0..THREADS).map(|t| format!("r{round}-t{t}")).collect();
            let start = std::sync::Barrier::new(THREADS);
            let sends = std::sync::atomic::AtomicUsize::new(0);
            std::thread::scope(|scope| {
                for key in &keys {
                    let (h, start, sends, destination) = (&h, &start, &sends, &destination);
                    scope.spawn(move || {
                        enqueuer.enqueue(msg(key, destination)).unwrap();
                        start.wait();
                        let receipt = h
                            .outbox
                            .process(key, |_| {
                                sends.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                                Ok(None)
                            })
                            .unwrap();
                        assert!(
                            matches!(receipt.outcome, Outcome::Sent | Outcome::Deferred),
                            "{key}: {:?}",
                            receipt.outcome
                        );
                    });
                }
            });
            sent_per_round.push(sends.into_inner());
        }
        println!("sends per round under a cap of one: {sent_per_round:?}");
        assert!(
            sent_per_round.iter().all(|&sent| sent == 1),
            "a cap of one let {sent_per_round:?} sends through"
        );
    }

    fn a_capped_item_is_deferred_to_the_exact_moment_a_slot_frees(engine) {
        let h = engine.harness_with(|b| b.rate_limit(2, secs(60)));
        for key in ["a", "b", "c"] {
            h.enqueue(key, "chat-1");
        }
        let t0 = h.clock.now();
        h.outbox.process("a", |_| Ok(None)).unwrap();
        h.clock.advance(secs(10));
        h.outbox.process("b", |_| Ok(None)).unwrap();
        h.clock.advance(secs(5));

        let receipt = h.outbox.process("c", |_| panic!("over the cap")).unwrap();
        assert_eq!(receipt.outcome, Outcome::Deferred);
        assert_eq!(receipt.error_code.as_deref(), Some(RATE_CAPPED));
        assert_eq!(
            receipt.next_attempt_at,
            Some(t0 + chrono::Duration::seconds(60))
        );
        assert_eq!(receipt.attempts, 0, "a deferral is not an attempt");

        // One microsecond early: still not attempted, and nothing is written.
        h.clock
            .set(t0 + chrono::Duration::seconds(60) - chrono::Duration::microseconds(1));
        let early = h.assert_files_unchanged(|| h.outbox.process("c", |_| panic!("early")).unwrap());
        assert_eq!(early.outcome, Outcome::Deferred);
        h.clock.set(t0 + chrono::Duration::seconds(60));
        assert_eq!(
            h.outbox.process("c", |_| Ok(None)).unwrap().outcome,
            Outcome::Sent
        );
    }

    fn caps_are_per_destination(engine) {
        let h = engine.harness_with(|b| b.rate_limit(1, secs(60)));
        h.enqueue("a", "chat-1");
        h.enqueue("b", "chat-2");
        h.enqueue("c", "chat-1");
        assert_eq!(
            h.outbox.process("a", |_| Ok(None)).unwrap().outcome,
            Outcome::Sent
        );
        assert_eq!(
            h.outbox.process("b", |_| Ok(None)).unwrap().outcome,
            Outcome::Sent
        );
        assert_eq!(
            h.outbox.process("c", |_| Ok(None)).unwrap().outcome,
            Outcome::Deferred
        );
    }

    fn destinations_matching_a_pattern_get_their_own_cap(engine) {
        // Telegram-like: 1 per minute for private chats (the default), 3 for groups ("-…").
        let h = engine.harness_with(|b| b.rate_limit(1, secs(60)).rate_limit_for("-*", 3, secs(60)));
        for key in ["g1", "g2", "g3", "g4"] {
            h.enqueue(key, "-100200");
        }
        h.enqueue("p1", "4242");
        h.enqueue("p2", "4242");
        let outcomes: Vec<_> = ["g1", "g2", "g3", "g4", "p1", "p2"]
            .iter()
            .map(|k| h.outbox.process(k, |_| Ok(None)).unwrap().outcome)
            .collect();
        let (sent, deferred) = (Outcome::Sent, Outcome::Deferred);
        assert_eq!(outcomes, [sent, sent, sent, deferred, sent, deferred]);
    }

    fn a_global_cap_holds_across_destinations_and_says_so(engine) {
        let h = engine.harness_with(|b| b.rate_limit(10, secs(60)).global_rate_limit(2, secs(1)));
        for i in 0..3 {
            h.enqueue(&format!("k{i}"), &format!("chat-{i}"));
        }
        let t0 = h.clock.now();
        assert_eq!(
            h.outbox.process("k0", |_| Ok(None)).unwrap().outcome,
            Outcome::Sent
        );
        assert_eq!(
            h.outbox.process("k1", |_| Ok(None)).unwrap().outcome,
            Outcome::Sent
        );
        let capped = h
            .outbox
            .process("k2", |_| panic!("over the global cap"))
            .unwrap();
        assert_eq!(capped.outcome, Outcome::Deferred);
        assert_eq!(
            capped.error_code.as_deref(),
            Some(durable_outbox::GLOBAL_RATE_CAPPED)
        );
        assert_eq!(
            capped.next_attempt_at,
            Some(t0 + chrono::Duration::seconds(1))
        );
        h.clock.advance(secs(1));
        assert_eq!(
            h.outbox.process("k2", |_| Ok(None)).unwrap().outcome,
            Outcome::Sent
        );
    }

    fn when_both_caps_bind_the_item_waits_for_the_later_one(engine) {
        let h = engine.harness_with(|b| b.rate_limit(1, secs(60)).global_rate_limit(1, secs(1)));
        h.enqueue("a", "chat-1");
        h.enqueue("b", "chat-1");
        let t0 = h.clock.now();
        h.outbox.process("a", |_| Ok(None)).unwrap();
        let r = h.outbox.process("b", |_| panic!("capped")).unwrap();
        assert_eq!(r.next_attempt_at, Some(t0 + chrono::Duration::seconds(60)));
        assert_eq!(r.error_code.as_deref(), Some(RATE_CAPPED));
    }

    /// With no cap set, a chat gets what Telegram and Slack publish, one send a
    /// second: a second message to the same chat leaves exactly one second after
    /// the first, and other chats are not held back by it.
    fn by_default_a_chat_gets_one_send_a_second_and_other_chats_do_not_wait(engine) {
        let h = engine.harness();
        let settings = h.outbox.settings().unwrap();
        assert_eq!(
            settings.rate_limit(),
            RateLimit {
                count: 1,
                window: secs(1)
            }
        );
        for (key, chat) in [
            ("a1", "chat-1"),
            ("a2", "chat-1"),
            ("b1", "chat-2"),
            ("c1", "chat-3"),
        ] {
            h.enqueue(key, chat);
        }
        let t0 = h.clock.now();
        let mut sent = Vec::new();
        let report = h
            .outbox
            .process_due(|item| {
                sent.push(item.idempotency_key().to_owned());
                Ok(None)
            })
            .unwrap();
        sent.sort();
        assert_eq!(sent, ["a1", "b1", "c1"], "one per chat, every chat at once");
        assert_eq!((report.sent, report.deferred), (3, 1));
        let slot = t0 + chrono::Duration::seconds(1);
        assert_eq!(
            h.outbox.get("a2").unwrap().unwrap().next_attempt_at(),
            Some(slot)
        );
        assert_eq!(h.outbox.next_due_at().unwrap(), Some(slot));

        h.clock.set(slot - chrono::Duration::microseconds(1));
        let early = h
            .outbox
            .process("a2", |_| panic!("inside the first send's second"))
            .unwrap();
        assert_eq!(
            (early.outcome, early.error_code.as_deref()),
            (Outcome::Deferred, Some(RATE_CAPPED))
        );
        h.clock.set(slot);
        let report = h.outbox.process_due(|_| Ok(None)).unwrap();
        assert_eq!((report.sent, report.deferred), (1, 0));
        assert!(
            h.outbox.settings().unwrap().is_stored("rate_limit"),
            "a new outbox stores the default with its first change"
        );
    }

    fn the_window_counts_from_the_send_not_from_the_enqueue(engine) {
        let h = engine.harness_with(|b| b.rate_limit(1, secs(60)));
        h.enqueue("a", "chat-1");
        h.enqueue("b", "chat-1");
        // `a` waits 50 s in the queue, then goes out.
        h.clock.advance(secs(50));
        let sent_at = h.clock.now();
        assert_eq!(
            h.outbox.process("a", |_| Ok(None)).unwrap().outcome,
            Outcome::Sent
        );
        // 70 s after the enqueue but only 20 s after the send: the window is full.
        h.clock.advance(secs(20));
        let b = h
            .outbox
            .process("b", |_| panic!("counted from created_at"))
            .unwrap();
        assert_eq!(b.outcome, Outcome::Deferred);
        assert_eq!(b.error_code.as_deref(), Some(RATE_CAPPED));
        assert_eq!(
            b.next_attempt_at,
            Some(sent_at + chrono::Duration::seconds(60))
        );
    }

    fn an_old_item_sent_now_holds_the_global_window_now(engine) {
        let h = engine.harness_with(|b| b.global_rate_limit(1, secs(10)));
        h.enqueue("old", "chat-1");
        h.clock.advance(secs(3600));
        h.enqueue("new", "chat-2");
        let sent_at = h.clock.now();
        h.outbox.process("old", |_| Ok(None)).unwrap();
        h.clock.advance(secs(5));
        let new = h
            .outbox
            .process("new", |_| panic!("counted from created_at"))
            .unwrap();
        assert_eq!(new.outcome, Outcome::Deferred);
        assert_eq!(
            new.next_attempt_at,
            Some(sent_at + chrono::Duration::seconds(10))
        );
    }

    fn an_ambiguous_send_counts_against_the_global_cap(engine) {
        let h = engine.harness_with(|b| b.global_rate_limit(1, secs(60)));
        h.enqueue("a", "chat-1");
        h.enqueue("b", "chat-2");
        let claimed_at = h.clock.now();
        h.outbox
            .process("a", |_| Err(durable_outbox::SendError::ambiguous("reset")))
            .unwrap();
        h.clock.advance(secs(1));
        let b = h
            .outbox
            .process("b", |_| panic!("global cap forgot it"))
            .unwrap();
        assert_eq!(
            b.error_code.as_deref(),
            Some(durable_outbox::GLOBAL_RATE_CAPPED)
        );
        assert_eq!(
            b.next_attempt_at,
            Some(claimed_at + chrono::Duration::seconds(60))
        );
    }

    fn a_requeued_ambiguous_send_still_counts_where_it_may_have_landed(engine) {
        let h = engine.harness_with(|b| b.rate_limit(1, secs(60)));
        h.enqueue("a", "chat-1");
        let claimed_at = h.clock.now();
        h.outbox
            .process("a", |_| Err(durable_outbox::SendError::ambiguous("reset")))
            .unwrap();
        h.outbox
            .requeue("a", "ops", "customer saw nothing")
            .unwrap();
        h.clock.advance(secs(10));
        // The operator's resend still waits for the window of the first attempt.
        let a = h
            .outbox
            .process("a", |_| panic!("the first attempt was forgotten"))
            .unwrap();
        assert_eq!(a.outcome, Outcome::Deferred);
        assert_eq!(
            a.next_attempt_at,
            Some(claimed_at + chrono::Duration::seconds(60))
        );
    }
}

on_both_engines! {
    fn caps_hold_across_a_restart(engine) {
        let outbox = engine.open_with(|b| b.rate_limit(1, secs(60)));
        outbox.enqueue(msg("a", "chat-1")).unwrap();
        outbox.enqueue(msg("b", "chat-1")).unwrap();
        outbox.process("a", |_| Ok(None)).unwrap();
        drop(outbox);
        let reopened = engine.open_with(|b| b.rate_limit(1, secs(60)));
        assert_eq!(
            reopened
                .process("b", |_| panic!("cap forgotten"))
                .unwrap()
                .outcome,
            Outcome::Deferred
        );
    }

    fn a_send_in_progress_counts_against_the_cap(engine) {
        // Unordered: under per-destination order b would wait behind a anyway.
        let h = engine.harness_with(|b| b.rate_limit(1, secs(60)).ordering(Ordering::Unordered));
        h.enqueue("a", "chat-1");
        h.enqueue("b", "chat-1");
        let other = h.reopen_with(|b| b.rate_limit(1, secs(60)).ordering(Ordering::Unordered));
        h.outbox
            .process("a", |_| {
                let r = other
                    .process("b", |_| panic!("cap exceeded by a concurrent send"))
                    .unwrap();
                assert_eq!(r.outcome, Outcome::Deferred);
                Ok(None)
            })
            .unwrap();
    }

    /// A bad cap is refused before anything is written.
    fn an_empty_pattern_or_a_zero_cap_is_rejected_at_open(engine) {
        for builder in [
            engine.builder().rate_limit_for("", 1, secs(1)),
            engine.builder().rate_limit_for("-*", 0, secs(1)),
            engine.builder().global_rate_limit(1, secs(0)),
        ] {
            let result = builder.open();
            assert!(
                matches!(result, Err(durable_outbox::Error::InvalidConfig { .. })),
                "{result:?}"
            );
        }
        assert!(engine.is_untouched(), "a refused open wrote nothing");
    }

    fn a_retry_after_cools_the_whole_destination_down_across_restarts(engine) {
        // Unordered, so b is held by the cooldown itself, not by waiting behind a.
        let h = engine.harness_with(|b| {
            b.max_inline_wait(std::time::Duration::ZERO)
                .ordering(Ordering::Unordered)
        });
        for (key, chat) in [("a", "chat-1"), ("b", "chat-1"), ("c", "chat-2")] {
            h.enqueue(key, chat);
        }
        let t0 = h.clock.now();
        let first = h
            .outbox
            .process("a", |_| {
                Err(durable_outbox::SendError::retryable("http_429").retry_after(secs(30)))
            })
            .unwrap();
        assert_eq!(first.outcome, Outcome::Deferred);
        // The platform said "wait 30 s" about chat-1: b must not go there either…
        let b = h
            .reopen_with(|b| {
                b.max_inline_wait(std::time::Duration::ZERO)
                    .ordering(Ordering::Unordered)
            })
            .process("b", |_| panic!("ignored the platform's Retry-After"))
            .unwrap();
        assert_eq!(b.outcome, Outcome::Deferred);
        assert_eq!(
            b.error_code.as_deref(),
            Some(durable_outbox::DESTINATION_COOLDOWN)
        );
        assert_eq!(b.next_attempt_at, Some(t0 + chrono::Duration::seconds(30)));
        // …while other chats are unaffected.
        assert_eq!(
            h.outbox.process("c", |_| Ok(None)).unwrap().outcome,
            Outcome::Sent
        );
        h.clock.advance(secs(30));
        assert_eq!(
            h.outbox.process("b", |_| Ok(None)).unwrap().outcome,
            Outcome::Sent
        );
        // No herd when the cooldown ends: the next send to chat-1 is paced by
        // what the platform asked for (see `adaptive_pacing`).
        let a = h
            .outbox
            .process("a", |_| panic!("inside the learned pace"))
            .unwrap();
        assert_eq!(
            a.error_code.as_deref(),
            Some(durable_outbox::DESTINATION_PACED)
        );
        assert_eq!(
            a.next_attempt_at,
            Some(t0 + chrono::Duration::milliseconds(30_000 + 37_500))
        );
        h.clock.advance(std::time::Duration::from_millis(37_500));
        assert_eq!(
            h.outbox.process("a", |_| Ok(None)).unwrap().outcome,
            Outcome::Sent
        );
    }
}

// ----- the default cap ------------------------------------------------------

// ----- the window counts sends, not enqueues -------------------------------

on_both_engines! {
    fn a_drained_backlog_counts_its_send_times_after_a_restart(engine) {
        let h = engine.harness_with(|b| b.rate_limit(2, secs(60)));
        for key in ["a", "b"] {
            h.enqueue(key, "chat-1");
        }
        h.clock.advance(secs(45));
        let sent_at = h.clock.now();
        let report = h.outbox.process_due(|_| Ok(None)).unwrap();
        assert_eq!(report.sent, 2);
        h.clock.advance(secs(30)); // 75 s after the enqueues, 30 s after the sends
        h.enqueue("c", "chat-1");
        let reopened = h.reopen_with(|b| b.rate_limit(2, secs(60)));
        let c = reopened
            .process("c", |_| panic!("counted from created_at"))
            .unwrap();
        assert_eq!(c.outcome, Outcome::Deferred);
        assert_eq!(
            c.next_attempt_at,
            Some(sent_at + chrono::Duration::seconds(60))
        );
    }
}

// ----- a send that may have left counts ------------------------------------

/// Sends `first` with `send` (which takes 5 s), then asserts that `second`, to
/// the same chat, waits a whole window (60 s) from the first claim, in this
/// handle and after a restart.
fn assert_counts_as_a_send(
    engine: &EngineUnderTest,
    send: impl FnOnce() -> Result<Option<String>, durable_outbox::SendError>,
    expected_code: &str,
) {
    let h = engine.harness_with(|b| b.rate_limit(1, secs(60)));
    h.enqueue("first", "chat-1");
    h.enqueue("second", "chat-1");
    h.clock.advance(secs(7)); // the claim, not the enqueue, is the send time
    let claimed_at = h.clock.now();
    let mut send = Some(send);
    let first = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        h.outbox
            .process("first", |_| {
                h.clock.advance(secs(5)); // a slow send: the claim, not the failure, counts
                (send.take().expect("sent once"))()
            })
            .unwrap()
    }));
    let item = h.outbox.get("first").unwrap().unwrap();
    assert_eq!(item.error_code(), Some(expected_code), "{first:?}");
    h.clock.advance(secs(30));
    let free = Some(claimed_at + chrono::Duration::seconds(60));
    let second = h
        .outbox
        .process("second", |_| panic!("an ambiguous send was forgotten"))
        .unwrap();
    assert_eq!(
        (second.outcome, second.next_attempt_at),
        (Outcome::Deferred, free)
    );
    let reopened = h.reopen_with(|b| b.rate_limit(1, secs(60)));
    let second = reopened
        .process("second", |_| panic!("forgotten after a restart"))
        .unwrap();
    assert_eq!(
        (second.outcome, second.next_attempt_at),
        (Outcome::Deferred, free)
    );
    h.clock.set(claimed_at + chrono::Duration::seconds(60));
    assert_eq!(
        reopened.process("second", |_| Ok(None)).unwrap().outcome,
        Outcome::Sent
    );
}

on_both_engines! {
    fn a_send_reported_ambiguous_counts_against_the_cap_across_restarts(engine) {
        assert_counts_as_a_send(
            engine,
            || Err(durable_outbox::SendError::ambiguous("read_timeout")),
            "read_timeout",
        );
    }

    fn a_send_that_panicked_counts_against_the_cap_across_restarts(engine) {
        assert_counts_as_a_send(engine, || panic!("transport bug"), durable_outbox::SEND_PANICKED);
    }
}

// ----- a cooldown belongs to the destination --------------------------------

/// Enqueues `a` and `b` for chat-1, lets `a` receive a 30 s `retry_after`, runs
/// `meanwhile` on the harness, then asserts `b` still waits for the cooldown.
fn assert_cooldown_survives(engine: &EngineUnderTest, meanwhile: impl FnOnce(&Harness)) {
    let h = engine.harness_with(|b| b.max_inline_wait(std::time::Duration::ZERO));
    h.enqueue("a", "chat-1");
    h.enqueue("b", "chat-1");
    let t0 = h.clock.now();
    h.outbox
        .process("a", |_| {
            Err(durable_outbox::SendError::retryable("http_429").retry_after(secs(30)))
        })
        .unwrap();
    meanwhile(&h);
    h.clock.advance(secs(1));
    let until = Some(t0 + chrono::Duration::seconds(30));
    for handle in [&h.outbox, &h.reopen()] {
        let b = handle
            .process("b", |_| panic!("the cooldown was lifted"))
            .unwrap();
        assert_eq!(b.outcome, Outcome::Deferred);
        assert_eq!(
            b.error_code.as_deref(),
            Some(durable_outbox::DESTINATION_COOLDOWN)
        );
        assert_eq!(b.next_attempt_at, until);
    }
    h.clock.set(t0 + chrono::Duration::seconds(30));
    assert_eq!(
        h.outbox.process("b", |_| Ok(None)).unwrap().outcome,
        Outcome::Sent
    );
}

on_both_engines! {
    /// `compact` drops the cooldowns whose moment has passed (a bot that
    /// talked to many chats carries none of theirs for ever) and keeps those
    /// still in force, judged at the handle's `now` as the rules judge them:
    /// one dropped does not come back when the clock steps back, and a
    /// compaction after the step keeps what is in force then.
    fn compact_drops_ended_cooldowns_and_keeps_those_in_force(engine) {
        let h = engine.harness_with(|b| {
            b.max_inline_wait(std::time::Duration::ZERO)
                .ordering(Ordering::Unordered)
        });
        h.enqueue("a", "chat-1");
        h.enqueue("b", "chat-2");
        let t0 = h.clock.now();
        for (key, wait) in [("a", 30), ("b", 3_600)] {
            let receipt = h
                .outbox
                .process(key, |_| Err(SendError::retryable("http_429").retry_after(secs(wait))))
                .unwrap();
            assert_eq!(receipt.outcome, Outcome::Deferred);
            // The cooldown belongs to the destination, not to the item.
            h.outbox.cancel(key, "ops", "not needed").unwrap();
        }
        let cooldown = |chat: &str| {
            h.outbox
                .rate_windows(None)
                .unwrap()
                .into_iter()
                .find(|w| w.destination == chat)
                .and_then(|w| w.cooldown_until)
        };
        let long = Some(t0 + chrono::Duration::seconds(3_600));
        assert_eq!(cooldown("chat-1"), Some(t0 + chrono::Duration::seconds(30)));
        h.clock.advance(secs(60));
        h.outbox.compact().unwrap();
        assert_eq!(cooldown("chat-2"), long, "a cooldown in force was dropped");
        // The clock steps back to before chat-1's cooldown ended: a kept
        // cooldown would hold chat-1 again; the dropped one does not.
        h.clock.set(t0 + chrono::Duration::seconds(10));
        assert_eq!(cooldown("chat-1"), None, "an ended cooldown was kept");
        assert_eq!(cooldown("chat-2"), long);
        h.outbox.compact().unwrap();
        assert_eq!(cooldown("chat-2"), long);
        // And it still holds chat-2 back.
        h.enqueue("c", "chat-2");
        let c = h.outbox.process("c", |_| panic!("sent into a cooldown")).unwrap();
        assert_eq!(c.error_code.as_deref(), Some(DESTINATION_COOLDOWN));
    }

    fn a_cooldown_outlives_the_cancel_of_the_item_that_got_it(engine) {
        assert_cooldown_survives(engine, |h| {
            h.reopen().cancel("a", "ops", "duplicate").unwrap();
        });
    }

    fn a_cooldown_outlives_a_requeue_of_the_item_that_got_it(engine) {
        assert_cooldown_survives(engine, |h| {
            h.outbox.cancel("a", "ops", "duplicate").unwrap();
            h.outbox
                .requeue("a", "ops", "not a duplicate after all")
                .unwrap();
        });
    }

    fn a_cooldown_outlives_the_move_of_the_item_that_got_it_to_history(engine) {
        assert_cooldown_survives(engine, |h| {
            h.outbox.cancel("a", "ops", "duplicate").unwrap();
            h.clock.advance(secs(1));
            // A maintenance job moves every terminal item to history at once
            // and lifts the cap to almost nothing.
            drop(h.reopen_with(|b| {
                b.history_after(std::time::Duration::ZERO)
                    .rate_limit(10, std::time::Duration::from_millis(1))
                    .update_settings()
            }));
            h.settle_history();
            assert_eq!(h.outbox.history_len().unwrap(), 1, "a moved to history");
        });
    }
}

// ----- with other processes ------------------------------------------------

#[cfg(all(unix, feature = "test-failpoints"))]
mod across_processes {
    use std::io::{BufRead, BufReader};
    use std::process::{Child, Command, Stdio};

    use chrono::Utc;
    use durable_outbox::{AMBIGUOUS_AFTER_RESTART, ManualClock, Outcome};

    use crate::engines::on_both_engines;
    use crate::harness::{msg, secs};

    const WORKER: &str = env!("CARGO_BIN_EXE_outbox-test-worker");

    fn worker(args: &[&str]) -> Command {
        let mut cmd = Command::new(WORKER);
        cmd.args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        cmd
    }

    /// Reads the child's stdout until a line starts with `prefix`.
    fn wait_for_line(child: &mut Child, prefix: &str) {
        let mut reader = BufReader::new(child.stdout.as_mut().expect("piped stdout"));
        let mut line = String::new();
        loop {
            line.clear();
            assert!(
                reader.read_line(&mut line).expect("read") > 0,
                "the worker exited before printing {prefix:?}"
            );
            if line.starts_with(prefix) {
                return;
            }
        }
    }

    on_both_engines! {
        fn a_send_cut_off_by_a_kill_counts_against_the_cap_after_the_restart(engine) {
            let bot = || engine.open_real_clock_with(|b| b.rate_limit(1, secs(3600)));
            let first = bot();
            first.enqueue(msg("a", "chat-1")).unwrap();
            first.enqueue(msg("b", "chat-1")).unwrap();
            let before = Utc::now();
            let mut child = worker(&["process", &engine.child_location("killed"), "a", "hang"])
                .spawn()
                .unwrap();
            wait_for_line(&mut child, "sending a");
            child.kill().unwrap(); // SIGKILL inside send
            let status = child.wait().unwrap();
            assert!(
                !status.success(),
                "the worker was killed mid-send: {status}"
            );
            engine.await_child_gone("killed");
            drop(first);

            let restarted = bot();
            let a = restarted.process("a", |_| panic!("resent")).unwrap();
            assert_eq!(a.error_code.as_deref(), Some(AMBIGUOUS_AFTER_RESTART));
            let claimed_at = restarted.get("a").unwrap().unwrap().maybe_sent_at();
            assert!(claimed_at.is_some_and(|at| at >= before), "{claimed_at:?}");
            for handle in [&restarted, &bot()] {
                let b = handle
                    .process("b", |_| panic!("the ambiguous send was forgotten"))
                    .unwrap();
                assert_eq!(b.outcome, Outcome::Deferred);
                assert_eq!(
                    b.next_attempt_at,
                    claimed_at.map(|at| at + chrono::Duration::seconds(3600))
                );
            }
        }

        fn another_process_compacting_with_defaults_never_lifts_the_cap(engine) {
            let now = chrono::SubsecRound::trunc_subsecs(Utc::now(), 0);
            // The bot allows one message per chat every three days; its last send
            // was two days ago, longer than the default `history_after` (a day).
            let clock = ManualClock::at(&(now - chrono::Duration::days(2)).to_rfc3339()).unwrap();
            let bot = engine
                .real_clock_builder()
                .clock(clock.clone())
                .rate_limit(1, secs(3 * 86_400))
                .open()
                .unwrap();
            bot.enqueue(msg("a", "chat-1")).unwrap();
            bot.process("a", |_| Ok(None)).unwrap();
            let sent_at = bot.get("a").unwrap().unwrap().sent_at().unwrap();
            clock.set(now);
            bot.enqueue(msg("b", "chat-1")).unwrap();

            // A maintenance job opens the outbox with every default and
            // compacts (PostgreSQL: applies retention, which opening does).
            let out = worker(&["maintain", &engine.location()]).output().unwrap();
            assert!(out.status.success(), "maintain failed: {out:?}");

            assert!(
                bot.list_items()
                    .unwrap()
                    .iter()
                    .any(|i| i.idempotency_key() == "a"),
                "a send inside the bot's window moved out of the live state"
            );
            let b = bot.process("b", |_| panic!("the cap was lifted")).unwrap();
            assert_eq!(b.outcome, Outcome::Deferred);
            assert_eq!(b.next_attempt_at, Some(sent_at + chrono::Duration::days(3)));
        }
    }

    #[cfg(feature = "cli")]
    on_both_engines! {
        fn an_operator_cancelling_the_item_that_got_a_retry_after_leaves_the_cooldown(engine) {
            let bot = engine.open_real_clock_with(|b| b.max_inline_wait(std::time::Duration::ZERO));
            bot.enqueue(msg("a", "chat-1")).unwrap();
            bot.enqueue(msg("b", "chat-1")).unwrap();
            bot.process("a", |_| {
                Err(durable_outbox::SendError::retryable("http_429").retry_after(secs(3600)))
            })
            .unwrap();
            let until = bot.get("a").unwrap().unwrap().cooldown_until();
            assert!(until.is_some());

            let cancel = Command::new(env!("CARGO_BIN_EXE_durable-outbox"))
                .args(["cancel", &engine.location(), "a"])
                .args(["--reason", "duplicate", "--operator", "ops"])
                .output()
                .unwrap();
            assert!(cancel.status.success(), "cancel failed: {cancel:?}");

            let b = bot
                .process("b", |_| panic!("the cooldown was lifted"))
                .unwrap();
            assert_eq!(b.outcome, Outcome::Deferred);
            assert_eq!(
                b.error_code.as_deref(),
                Some(durable_outbox::DESTINATION_COOLDOWN)
            );
            assert_eq!(b.next_attempt_at, until);
        }
    }
}

#[test]
fn an_ambiguous_failure_recorded_by_an_older_release_still_counts() {
    let h = Harness::with(|b| b.rate_limit(1, secs(60)));
    h.enqueue("a", "chat-1");
    h.enqueue("b", "chat-1");
    let t0 = h.clock.now();
    // Before this release a panicked send failed without `maybe_sent_at`.
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        h.outbox.process("a", |_| panic!("the send crashed"))
    }));
    assert!(panicked.is_err());
    h.outbox.compact().unwrap();
    let text = std::fs::read_to_string(h.path("outbox.json")).unwrap();
    let older: String = text
        .lines()
        .filter(|line| !line.contains("maybe_sent_at_utc"))
        .flat_map(|line| [line, "\n"])
        .collect();
    assert_ne!(older, text);
    std::fs::write(h.path("outbox.json"), older).unwrap();
    h.clock.advance(secs(10));
    let reopened = builder(h.dir.path(), &h.clock).open().unwrap();
    let b = reopened
        .process("b", |_| panic!("an older ambiguous failure was forgotten"))
        .unwrap();
    assert_eq!(b.outcome, Outcome::Deferred);
    assert_eq!(b.next_attempt_at, Some(t0 + chrono::Duration::seconds(60)));
}

#[test]
fn a_cooldown_an_older_release_kept_on_its_item_still_holds_the_destination() {
    let h = Harness::with(|b| b.max_inline_wait(std::time::Duration::ZERO));
    h.enqueue("a", "chat-1");
    h.enqueue("b", "chat-1");
    let t0 = h.clock.now();
    h.outbox
        .process("a", |_| {
            Err(durable_outbox::SendError::retryable("http_429").retry_after(secs(30)))
        })
        .unwrap();
    h.outbox.cancel("a", "ops", "duplicate").unwrap();
    h.outbox.compact().unwrap();
    // An older release kept the cooldown only on the item.
    let mut file: serde_json::Value =
        serde_json::from_slice(&std::fs::read(h.path("outbox.json")).unwrap()).unwrap();
    assert!(file.as_object_mut().unwrap().remove("cooldowns").is_some());
    std::fs::write(
        h.path("outbox.json"),
        serde_json::to_vec_pretty(&file).unwrap(),
    )
    .unwrap();
    let reopened = builder(h.dir.path(), &h.clock).open().unwrap();
    let b = reopened
        .process("b", |_| panic!("the item's cooldown was dropped"))
        .unwrap();
    assert_eq!(
        (b.error_code.as_deref(), b.next_attempt_at),
        (
            Some(durable_outbox::DESTINATION_COOLDOWN),
            Some(t0 + chrono::Duration::seconds(30))
        )
    );
}

#[cfg(feature = "tokio")]
on_both_engines! {
    fn a_send_future_dropped_mid_flight_counts_against_the_cap_from_its_claim(engine) {
        let h = engine.harness_with(|b| b.rate_limit(1, secs(60)));
        h.enqueue("a", "chat-1");
        h.enqueue("b", "chat-1");
        let claimed_at = h.clock.now();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        // The request went out; the answer never comes.
        crate::harness::drop_mid_send(&rt, &h.outbox, "a", || h.clock.advance(secs(5)));
        // The cancellation is recorded on the blocking pool: wait for it (generously).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while h.outbox.get("a").unwrap().unwrap().state() == durable_outbox::ItemState::Queued {
            assert!(
                std::time::Instant::now() < deadline,
                "a dropped send future was never recorded as cancelled"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let a = h.outbox.get("a").unwrap().unwrap();
        assert_eq!(a.error_code(), Some(durable_outbox::SEND_CANCELLED));
        let b = h
            .outbox
            .process("b", |_| panic!("the cancelled send was forgotten"))
            .unwrap();
        assert_eq!(b.outcome, Outcome::Deferred);
        assert_eq!(
            b.next_attempt_at,
            Some(claimed_at + chrono::Duration::seconds(60))
        );
    }
}

on_both_engines! {
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
