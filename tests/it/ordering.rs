//! Per-destination order: messages to one destination are handed to `send` in
//! enqueue order, a later one never starts while an earlier one is queued,
//! claimed or waiting for its retry, and a terminal head blocks nothing.
//! `Ordering::Unordered` opts out.
//!
//! Bodies in `on_both_engines!` run on the file engine and on PostgreSQL
//! (`name::file`, `name::postgres`). File-only here: the `#[test]` loads a
//! seed-format state file.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

#[cfg(feature = "test-failpoints")]
use durable_outbox::FailAction;
use durable_outbox::{ItemState, Ordering, Outbox, OutboxBuilder, Outcome, SendError};

use crate::engines::on_both_engines;
use crate::harness::{Harness, builder, msg, secs, uncapped};
use durable_outbox::Backoff;

on_both_engines! {
    fn a_later_message_waits_behind_the_earlier_one_and_changes_nothing(engine) {
        let h = engine.harness_with(uncapped);
        h.enqueue("m1", "chat-1");
        h.enqueue("m2", "chat-1");
        let receipt = h.assert_files_unchanged(|| {
            h.outbox
                .process("m2", |_| panic!("m2 started before m1"))
                .unwrap()
        });
        assert_eq!((receipt.outcome, receipt.attempts), (Outcome::Waiting, 0));
        assert_eq!(
            h.outbox.process("m1", |_| Ok(None)).unwrap().outcome,
            Outcome::Sent
        );
        assert_eq!(
            h.outbox.process("m2", |_| Ok(None)).unwrap().outcome,
            Outcome::Sent
        );
    }

    fn process_due_sends_each_destination_in_enqueue_order(engine) {
        let h = engine.harness_with(uncapped);
        // Keys sort against enqueue order, and the clock never moves: only the
        // enqueue sequence tells the order.
        for key in ["m5", "m4", "m3", "m1", "m2"] {
            h.enqueue(key, "chat-1");
        }
        h.enqueue("x1", "chat-2");
        let mut seen = Vec::new();
        let report = h
            .outbox
            .process_due(|item| {
                seen.push(item.idempotency_key().to_owned());
                Ok(None)
            })
            .unwrap();
        assert_eq!(report.sent, 6);
        let chat_1: Vec<&str> = seen
            .iter()
            .map(String::as_str)
            .filter(|k| k.starts_with('m'))
            .collect();
        assert_eq!(chat_1, ["m5", "m4", "m3", "m1", "m2"]);
    }

    fn a_retry_holds_the_followers_until_the_head_goes(engine) {
        let h = engine.harness_with(|b| uncapped(b).max_inline_wait(std::time::Duration::ZERO));
        h.enqueue("m1", "chat-1");
        h.enqueue("m2", "chat-1");
        let mut calls = Vec::new();
        let report = h
            .outbox
            .process_due(|item| {
                calls.push(item.idempotency_key().to_owned());
                Err(SendError::retryable("http_502"))
            })
            .unwrap();
        assert_eq!((report.retried, report.waiting), (1, 1));
        assert_eq!(
            calls,
            ["m1"],
            "m2 must not start while m1 waits for its retry"
        );
        let m2 = h.outbox.get("m2").unwrap().unwrap();
        assert_eq!((m2.state(), m2.attempts()), (ItemState::Queued, 0));
        h.clock.advance(secs(1));
        let mut calls = Vec::new();
        h.outbox
            .process_due(|item| {
                calls.push(item.idempotency_key().to_owned());
                Ok(None)
            })
            .unwrap();
        assert_eq!(calls, ["m1", "m2"]);
    }

    fn a_failed_or_cancelled_head_does_not_block_the_rest(engine) {
        let h = engine.harness();
        for key in ["m1", "m2", "m3"] {
            h.enqueue(key, "chat-1");
        }
        let failed = h
            .outbox
            .process("m1", |_| Err(SendError::permanent("chat_not_found")))
            .unwrap();
        assert_eq!(failed.outcome, Outcome::Failed);
        h.outbox.cancel("m2", "ops", "duplicate").unwrap();
        assert_eq!(
            h.outbox.process("m3", |_| Ok(None)).unwrap().outcome,
            Outcome::Sent
        );
    }

    fn a_requeued_message_goes_to_the_back_of_its_destinations_line(engine) {
        let h = engine.harness_with(uncapped);
        h.enqueue("m1", "chat-1");
        h.enqueue("m2", "chat-1");
        h.outbox
            .process("m1", |_| Err(SendError::permanent("bot_blocked")))
            .unwrap();
        h.outbox.requeue("m1", "ops", "unblocked").unwrap();
        let mut seen = Vec::new();
        h.outbox
            .process_due(|item| {
                seen.push(item.idempotency_key().to_owned());
                Ok(None)
            })
            .unwrap();
        assert_eq!(seen, ["m2", "m1"]);
    }

    fn unordered_lets_several_messages_to_one_destination_go(engine) {
        let h = engine.harness_with(|b| b.ordering(Ordering::Unordered));
        h.enqueue("m1", "chat-1");
        h.enqueue("m2", "chat-1");
        let receipt = h.outbox.process("m2", |_| Ok(None)).unwrap();
        assert_eq!(receipt.outcome, Outcome::Sent);
    }
}

on_both_engines! {
    fn a_message_in_flight_holds_its_followers_for_other_handles(engine) {
        let h = engine.harness();
        h.enqueue("m1", "chat-1");
        h.enqueue("m2", "chat-1");
        let other = h.reopen();
        h.outbox
            .process("m1", |_| {
                let r = other
                    .process("m2", |_| panic!("m2 started while m1 was in flight"))
                    .unwrap();
                assert_eq!(r.outcome, Outcome::Waiting);
                Ok(None)
            })
            .unwrap();
    }

    /// Enqueue order is a sequence, not a timestamp: two handles enqueueing at the
    /// same instant still get a total order, and threads draining with separate
    /// handles keep it.
    fn threads_with_separate_handles_keep_each_destinations_order(engine) {
        let h = engine.harness_with(uncapped);
        let reopen = || h.reopen_with(uncapped);
        let mut expected = Vec::new();
        for i in 0..12 {
            let key = format!("m{i:02}");
            // Alternate handles; the manual clock never moves, so times all tie.
            let handle = if i % 2 == 0 {
                h.outbox.clone()
            } else {
                reopen()
            };
            handle.enqueue(msg(&key, "chat-1")).unwrap();
            expected.push(key);
        }
        let log = Arc::new(Mutex::new(Vec::new()));
        let threads: Vec<_> = (0..3)
            .map(|_| {
                let (outbox, log) = (reopen(), Arc::clone(&log));
                std::thread::spawn(move || {
                    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
                    while outbox
                        .list_items()
                        .unwrap()
                        .iter()
                        .any(|i| i.state() != ItemState::Sent)
                    {
                        assert!(
                            std::time::Instant::now() < deadline,
                            "order across threads: the drains did not finish"
                        );
                        outbox
                            .process_due(|item| {
                                log.lock()
                                    .unwrap()
                                    .push(format!("start {}", item.idempotency_key()));
                                std::thread::sleep(std::time::Duration::from_millis(1));
                                log.lock()
                                    .unwrap()
                                    .push(format!("end {}", item.idempotency_key()));
                                Ok(None)
                            })
                            .unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let log = log.lock().unwrap().clone();
        let starts: Vec<String> = log
            .iter()
            .filter_map(|l| l.strip_prefix("start ").map(str::to_owned))
            .collect();
        assert_eq!(starts, expected, "each message once, in enqueue order");
        for pair in log.chunks(2) {
            assert_eq!(
                pair[0].replace("start", "end"),
                pair[1],
                "no start before the previous send to the chat ended"
            );
        }
    }
}

/// Items written before sequences existed (here by the Python reference) have
/// no `enqueue_seq`: they come before anything enqueued since.
#[test]
fn a_seed_item_without_a_sequence_goes_before_newer_messages() {
    let h = Harness::new();
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/seed-v1/outbox.json"),
        dir.path().join("outbox.json"),
    )
    .unwrap();
    let outbox = uncapped(builder(dir.path(), &h.clock)).open().unwrap();
    assert_eq!(
        outbox.get("seed-queued").unwrap().unwrap().enqueue_seq(),
        None
    );
    let newer = outbox.enqueue(msg("new-1", "chat-1")).unwrap();
    assert!(newer.enqueue_seq().is_some());
    let r = outbox
        .process("new-1", |_| panic!("jumped the queue"))
        .unwrap();
    assert_eq!(r.outcome, Outcome::Waiting);
    let mut seen = Vec::new();
    outbox
        .process_due(|item| {
            if item.destination() == "chat-1" {
                seen.push(item.idempotency_key().to_owned());
            }
            Ok(None)
        })
        .unwrap();
    assert_eq!(seen, ["seed-queued", "new-1"]);
}

on_both_engines! {
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

on_both_engines! {
    /// Enqueues racing on one destination against two claiming handles:
    /// every claim sends the oldest queued item of the chat, so the sends
    /// start in enqueue-sequence order, each item once. In each of 24 rounds
    /// four handles enqueue one message each at once (two of them slow
    /// between taking their place in line and committing), and the round
    /// ends once the claims sent all four, so the line is empty while a slow
    /// enqueue is still under way. On PostgreSQL enqueues of a destination
    /// run side by side (its lock taken shared) and a claim takes it
    /// exclusive: a claim that read the line while a smaller sequence was
    /// still uncommitted would send a later item first, and the earlier one
    /// after it.
    fn racing_enqueues_never_let_a_claim_send_a_later_item_first(engine) {
        const ENQUEUERS: usize = 4;
        const ROUNDS: usize = 24;
        const TOTAL: usize = ENQUEUERS * ROUNDS;
        let enqueuers: Vec<Outbox> = (0..ENQUEUERS)
            .map(|i| engine.open_with(|b| slow_enqueues(uncapped(b), i % 2 == 0)))
            .collect();
        let claimers = [engine.open_with(uncapped), engine.open_with(uncapped)];
        // Enqueued keys by their place in line, once their enqueue returned.
        let announced: Mutex<BTreeMap<u64, String>> = Mutex::default();
        // Each send's place in line, in the order the sends started.
        let sent: Mutex<Vec<(u64, String)>> = Mutex::default();
        let round = Barrier::new(ENQUEUERS);
        let deadline = Instant::now() + Duration::from_secs(120);
        let watchdog = || {
            assert!(
                Instant::now() < deadline,
                "watchdog: per-destination order under racing enqueues: the claims did not \
                 send every item in time"
            );
        };
        std::thread::scope(|scope| {
            for (i, outbox) in enqueuers.iter().enumerate() {
                let (announced, sent, round) = (&announced, &sent, &round);
                scope.spawn(move || {
                    for r in 0..ROUNDS {
                        round.wait();
                        let key = format!("e{i}-{r:03}");
                        let item = outbox.enqueue(msg(&key, "chat-1")).unwrap();
                        let seq = item.enqueue_seq().expect("an enqueue takes a place in line");
                        announced.lock().unwrap().insert(seq, key);
                        while sent.lock().unwrap().len() < (r + 1) * ENQUEUERS {
                            watchdog();
                            std::thread::sleep(Duration::from_millis(1));
                        }
                    }
                });
            }
            for outbox in &claimers {
                let (announced, sent) = (&announced, &sent);
                scope.spawn(move || {
                    while sent.lock().unwrap().len() < TOTAL {
                        watchdog();
                        let queued: Vec<String> = {
                            let done: HashSet<String> =
                                sent.lock().unwrap().iter().map(|(_, k)| k.clone()).collect();
                            announced
                                .lock()
                                .unwrap()
                                .values()
                                .filter(|key| !done.contains(*key))
                                .cloned()
                                .collect()
                        };
                        // Oldest announced first; the first one that is not
                        // the chat's head (or is another handle's send in
                        // flight) ends this pass.
                        for key in queued {
                            let receipt = outbox
                                .process(&key, |item| {
                                    let seq = item.enqueue_seq().expect("a place in line");
                                    sent.lock()
                                        .unwrap()
                                        .push((seq, item.idempotency_key().to_owned()));
                                    Ok(None)
                                })
                                .unwrap();
                            match receipt.outcome {
                                Outcome::Sent => {}
                                Outcome::Waiting | Outcome::InFlight => break,
                                other => panic!("{key}: {other:?}"),
                            }
                        }
                        std::thread::yield_now();
                    }
                });
            }
        });
        let sent = sent.into_inner().unwrap();
        let keys: HashSet<&String> = sent.iter().map(|(_, key)| key).collect();
        assert_eq!(keys.len(), TOTAL, "every item sent, each once: {sent:?}");
        for pair in sent.windows(2) {
            assert!(
                pair[0].0 < pair[1].0,
                "a claim sent {} (place {}) before {} (place {}): it passed an enqueue that took \
                 its place in line first and committed later",
                pair[0].1,
                pair[0].0,
                pair[1].1,
                pair[1].0
            );
        }
    }
}

/// `b`, with each enqueue held 15 ms between taking its place
/// in line and committing when `slow` (PostgreSQL, feature
/// `test-failpoints`; without it enqueues race at their own pace).
fn slow_enqueues(b: OutboxBuilder, slow: bool) -> OutboxBuilder {
    #[cfg(feature = "test-failpoints")]
    if slow {
        return b.failpoint("postgres.enqueue_seq_taken", FailAction::DelayMs(15));
    }
    let _ = slow;
    b
}
