//! Bounded retries: only retryable failures retry, with the backoff, honouring `retry_after`.

use durable_outbox::{Backoff, Clock, ItemState, Outcome, SendError};

use crate::harness::{Harness, ms, secs};

#[test]
fn retryable_failures_retry_with_the_reference_backoff_then_succeed() {
    let h = Harness::new();
    h.enqueue("k", "chat-1");
    let start = h.clock.now();
    let mut seen = Vec::new();
    let receipt = h
        .outbox
        .process("k", |item| {
            seen.push((item.attempts(), (h.clock.now() - start).num_milliseconds()));
            if item.attempts() < 3 {
                Err(SendError::retryable("http_502"))
            } else {
                Ok(Some("tg".into()))
            }
        })
        .unwrap();
    assert_eq!(receipt.outcome, Outcome::Sent);
    assert_eq!(receipt.attempts, 3);
    assert_eq!(
        seen,
        [(1, 0), (2, 250), (3, 750)],
        "waits of 250 ms then 500 ms"
    );
    assert_eq!(
        h.audit_outcomes(),
        ["queued:k", "retrying:k", "retrying:k", "sent:k"]
    );
}

#[test]
fn exhausting_attempts_fails_with_the_last_error_code() {
    let h = Harness::with(|b| b.max_attempts(2));
    h.enqueue("k", "chat-1");
    let mut n = 0;
    let receipt = h
        .outbox
        .process("k", |_| {
            n += 1;
            Err(SendError::retryable(format!("refused-{n}")))
        })
        .unwrap();
    assert_eq!(n, 2);
    assert_eq!(receipt.outcome, Outcome::Failed);
    assert_eq!(receipt.error_code.as_deref(), Some("refused-2"));
    assert_eq!(
        h.outbox.get("k").unwrap().unwrap().state(),
        ItemState::Failed
    );
}

#[test]
fn retry_after_longer_than_the_backoff_is_honoured_inline() {
    let h = Harness::new();
    h.enqueue("k", "chat-1");
    let start = h.clock.now();
    let mut times = Vec::new();
    h.outbox
        .process("k", |item| {
            times.push((h.clock.now() - start).num_milliseconds());
            if item.attempts() == 1 {
                Err(SendError::retryable("http_429").retry_after(secs(3)))
            } else {
                Ok(None)
            }
        })
        .unwrap();
    assert_eq!(times, [0, 3000]);
}

#[test]
fn a_wait_beyond_max_inline_wait_defers_instead_of_sleeping() {
    let h = Harness::new();
    h.enqueue("k", "chat-1");
    let before = h.clock.now();
    let receipt = h
        .outbox
        .process("k", |_| {
            Err(SendError::retryable("http_429").retry_after(secs(30)))
        })
        .unwrap();
    assert_eq!(h.clock.now(), before, "did not sleep");
    assert_eq!(receipt.outcome, Outcome::Deferred);
    assert_eq!(receipt.error_code.as_deref(), Some("http_429"));
    assert_eq!(
        receipt.next_attempt_at,
        Some(before + chrono::Duration::seconds(30))
    );

    // Not attempted before that moment…
    h.clock.advance(secs(29));
    let early =
        h.assert_files_unchanged(|| h.outbox.process("k", |_| panic!("too early")).unwrap());
    assert_eq!(early.outcome, Outcome::Deferred);
    // …and attempted from then on.
    h.clock.advance(secs(1));
    assert_eq!(
        h.outbox.process("k", |_| Ok(None)).unwrap().outcome,
        Outcome::Sent
    );
}

#[test]
fn exponential_backoff_is_used_when_configured() {
    let h = Harness::with(|b| {
        b.max_attempts(4).backoff(Backoff::Exponential {
            base: ms(100),
            cap: ms(250),
            jitter: false,
        })
    });
    h.enqueue("k", "chat-1");
    let start = h.clock.now();
    let mut times = Vec::new();
    h.outbox
        .process("k", |_| {
            times.push((h.clock.now() - start).num_milliseconds());
            Err(SendError::retryable("down"))
        })
        .unwrap();
    assert_eq!(times, [0, 100, 300, 550]);
}

#[test]
fn invalid_settings_are_rejected_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        durable_outbox::Outbox::builder(dir.path())
            .max_attempts(0)
            .open(),
        durable_outbox::Outbox::builder(dir.path())
            .rate_limit(0, secs(1))
            .open(),
        durable_outbox::Outbox::builder(dir.path())
            .rate_limit(1, secs(0))
            .open(),
        durable_outbox::Outbox::builder(dir.path())
            .backoff(Backoff::Fixed(vec![]))
            .open(),
    ];
    for result in cases {
        assert!(
            matches!(result, Err(durable_outbox::Error::InvalidConfig { .. })),
            "{result:?}"
        );
    }
}
