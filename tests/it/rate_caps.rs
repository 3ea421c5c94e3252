//! Per-destination sliding-window caps, counted from persisted send times.

use durable_outbox::{Clock, Outcome, RATE_CAPPED};

use crate::harness::{Harness, builder, secs};

#[test]
fn a_capped_item_is_deferred_to_the_exact_moment_a_slot_frees() {
    let h = Harness::with(|b| b.rate_limit(2, secs(60)));
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

#[test]
fn caps_are_per_destination() {
    let h = Harness::with(|b| b.rate_limit(1, secs(60)));
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

#[test]
fn caps_hold_across_a_restart() {
    let h = Harness::with(|b| b.rate_limit(1, secs(60)));
    h.enqueue("a", "chat-1");
    h.enqueue("b", "chat-1");
    h.outbox.process("a", |_| Ok(None)).unwrap();
    let dir = h.dir.path().to_path_buf();
    let clock = h.clock.clone();
    drop(h.outbox);
    let reopened = builder(&dir, &clock)
        .rate_limit(1, secs(60))
        .open()
        .unwrap();
    assert_eq!(
        reopened
            .process("b", |_| panic!("cap forgotten"))
            .unwrap()
            .outcome,
        Outcome::Deferred
    );
}

#[test]
fn a_send_in_progress_counts_against_the_cap() {
    let h = Harness::with(|b| b.rate_limit(1, secs(60)));
    h.enqueue("a", "chat-1");
    h.enqueue("b", "chat-1");
    let other = builder(h.dir.path(), &h.clock)
        .rate_limit(1, secs(60))
        .open()
        .unwrap();
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

#[test]
fn destinations_matching_a_pattern_get_their_own_cap() {
    // Telegram-like: 1 per minute for private chats (the default), 3 for groups ("-…").
    let h = Harness::with(|b| b.rate_limit(1, secs(60)).rate_limit_for("-*", 3, secs(60)));
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

#[test]
fn a_global_cap_holds_across_destinations_and_says_so() {
    let h = Harness::with(|b| b.rate_limit(10, secs(60)).global_rate_limit(2, secs(1)));
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

#[test]
fn when_both_caps_bind_the_item_waits_for_the_later_one() {
    let h = Harness::with(|b| b.rate_limit(1, secs(60)).global_rate_limit(1, secs(1)));
    h.enqueue("a", "chat-1");
    h.enqueue("b", "chat-1");
    let t0 = h.clock.now();
    h.outbox.process("a", |_| Ok(None)).unwrap();
    let r = h.outbox.process("b", |_| panic!("capped")).unwrap();
    assert_eq!(r.next_attempt_at, Some(t0 + chrono::Duration::seconds(60)));
    assert_eq!(r.error_code.as_deref(), Some(RATE_CAPPED));
}

#[test]
fn an_empty_pattern_or_a_zero_cap_is_rejected_at_open() {
    let dir = tempfile::tempdir().unwrap();
    for builder in [
        durable_outbox::Outbox::builder(dir.path()).rate_limit_for("", 1, secs(1)),
        durable_outbox::Outbox::builder(dir.path()).rate_limit_for("-*", 0, secs(1)),
        durable_outbox::Outbox::builder(dir.path()).global_rate_limit(1, secs(0)),
    ] {
        assert!(matches!(
            builder.open(),
            Err(durable_outbox::Error::InvalidConfig { .. })
        ));
    }
}

#[test]
fn a_retry_after_cools_the_whole_destination_down_across_restarts() {
    let h = Harness::with(|b| b.max_inline_wait(std::time::Duration::ZERO));
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
        .reopen()
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
    assert_eq!(
        h.outbox.process("a", |_| Ok(None)).unwrap().outcome,
        Outcome::Sent
    );
}
