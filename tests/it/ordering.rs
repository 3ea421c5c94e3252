//! Per-destination order: messages to one destination are handed to `send` in
//! enqueue order, a later one never starts while an earlier one is queued,
//! claimed or waiting for its retry, and a terminal head blocks nothing.
//! `Ordering::Unordered` opts out.

use std::sync::{Arc, Mutex};

use durable_outbox::{ItemState, Ordering, Outcome, SendError};

use crate::harness::{Harness, builder, msg, secs, uncapped};

#[test]
fn a_later_message_waits_behind_the_earlier_one_and_changes_nothing() {
    let h = Harness::with(uncapped);
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

#[test]
fn process_due_sends_each_destination_in_enqueue_order() {
    let h = Harness::with(uncapped);
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

#[test]
fn a_retry_holds_the_followers_until_the_head_goes() {
    let h = Harness::with(|b| uncapped(b).max_inline_wait(std::time::Duration::ZERO));
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

#[test]
fn a_failed_or_cancelled_head_does_not_block_the_rest() {
    let h = Harness::new();
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

#[test]
fn a_requeued_message_goes_to_the_back_of_its_destinations_line() {
    let h = Harness::with(uncapped);
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

#[test]
fn unordered_lets_several_messages_to_one_destination_go() {
    let h = Harness::with(|b| b.ordering(Ordering::Unordered));
    h.enqueue("m1", "chat-1");
    h.enqueue("m2", "chat-1");
    let receipt = h.outbox.process("m2", |_| Ok(None)).unwrap();
    assert_eq!(receipt.outcome, Outcome::Sent);
}

#[test]
fn a_message_in_flight_holds_its_followers_for_other_handles() {
    let h = Harness::new();
    h.enqueue("m1", "chat-1");
    h.enqueue("m2", "chat-1");
    let other = builder(h.dir.path(), &h.clock).open().unwrap();
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
#[test]
fn threads_with_separate_handles_keep_each_destinations_order() {
    let h = Harness::with(uncapped);
    let reopen = || uncapped(builder(h.dir.path(), &h.clock)).open().unwrap();
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
