//! Bounded retries: only retryable failures retry, with the backoff, honouring `retry_after`.
//!
//! Bodies in `on_both_engines!` run on the file engine and on PostgreSQL
//! (`name::file`, `name::postgres`); every body here runs on both.

use durable_outbox::{Backoff, Clock, ItemState, Outcome, SendError};

use crate::engines::on_both_engines;
use crate::harness::msg;
use crate::harness::{ms, secs};
use durable_outbox::FailureClass;

on_both_engines! {
    fn retryable_failures_retry_with_the_configured_backoff_then_succeed(engine) {
        let h = engine.harness_with(|b| b.backoff(Backoff::Fixed(vec![ms(250), ms(500)])));
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

    fn exhausting_attempts_fails_with_the_last_error_code(engine) {
        let h = engine.harness_with(|b| b.max_attempts(2));
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

    fn retry_after_longer_than_the_backoff_is_honoured_inline(engine) {
        let h = engine.harness();
        h.enqueue("k", "chat-1");
        let start = h.clock.now();
        let mut times = Vec::new();
        let receipt = h
            .outbox
            .process("k", |_| {
                times.push((h.clock.now() - start).num_milliseconds());
                if times.len() == 1 {
                    Err(SendError::retryable("http_429").retry_after(secs(3)))
                } else {
                    Ok(None)
                }
            })
            .unwrap();
        assert_eq!(times, [0, 3000]);
        assert_eq!(
            receipt.attempts, 1,
            "the 429 was pacing, not a failed attempt"
        );
    }

    fn a_wait_beyond_max_inline_wait_defers_instead_of_sleeping(engine) {
        let h = engine.harness();
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

    fn exponential_backoff_is_used_when_configured(engine) {
        let h = engine.harness_with(|b| {
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

    /// A 429 is the platform pacing us: the item waits and the destination cools,
    /// but no attempt is used up, however many times it happens.
    fn a_retry_after_never_consumes_max_attempts(engine) {
        let h = engine.harness_with(|b| b.max_attempts(2).max_inline_wait(ms(0)));
        h.enqueue("k", "chat-1");
        for round in 0..5 {
            let receipt = h
                .outbox
                .process("k", |_| {
                    Err(SendError::retryable("http_429").retry_after(secs(10)))
                })
                .unwrap();
            assert_eq!(receipt.outcome, Outcome::Deferred, "round {round}");
            let item = h.outbox.get("k").unwrap().unwrap();
            assert_eq!((item.state(), item.attempts()), (ItemState::Queued, 0));
            assert!(item.cooldown_until().is_some(), "the destination cools");
            h.clock.advance(secs(10));
        }
        // Real failures still count: two of them and the item fails.
        for _ in 0..2 {
            h.outbox
                .process("k", |_| Err(SendError::retryable("http_503")))
                .unwrap();
            h.clock.advance(secs(60));
        }
        let item = h.outbox.get("k").unwrap().unwrap();
        assert_eq!(
            (item.state(), item.error_code(), item.attempts()),
            (ItemState::Failed, Some("http_503"), 2)
        );
    }

    /// What bounds pacing is the item's age: past `give_up_after` it fails with a
    /// clear code, as certainly not delivered.
    fn give_up_after_ends_endless_pacing_with_a_clear_code(engine) {
        let h = engine.harness_with(|b| b.give_up_after(secs(3600)).max_inline_wait(ms(0)));
        h.enqueue("k", "chat-1");
        let mut rounds = 0;
        loop {
            let receipt = h
                .outbox
                .process("k", |_| {
                    Err(SendError::retryable("http_429").retry_after(secs(600)))
                })
                .unwrap();
            rounds += 1;
            if receipt.outcome == Outcome::Failed {
                break;
            }
            assert!(rounds < 20, "pacing must end at give_up_after");
            h.clock.advance(secs(600));
        }
        // Sent at 0, 10, …, 60 min (the hour itself is still in time); the next
        // try would start after it.
        assert_eq!(rounds, 7);
        let item = h.outbox.get("k").unwrap().unwrap();
        assert_eq!(item.error_code(), Some(durable_outbox::GAVE_UP));
        assert_eq!(
            item.failure_class(),
            Some(durable_outbox::FailureClass::Retryable)
        );
        assert_eq!(
            h.outbox
                .history("k")
                .unwrap()
                .pop()
                .unwrap()
                .error_code
                .as_deref(),
            Some(durable_outbox::GAVE_UP)
        );
    }

    /// Pacing within `max_inline_wait` is slept through inline, but one call makes
    /// at most `max_attempts` sends: a platform answering 429 forever cannot keep
    /// `process` from returning.
    fn inline_pacing_is_bounded_per_call(engine) {
        let h = engine.harness_with(|b| b.max_attempts(3).give_up_after(secs(3600)));
        h.enqueue("k", "chat-1");
        let mut sends = 0;
        let receipt = h
            .outbox
            .process("k", |_| {
                sends += 1;
                Err(SendError::retryable("http_429").retry_after(secs(1)))
            })
            .unwrap();
        assert_eq!(sends, 3);
        assert_eq!(receipt.outcome, Outcome::Deferred);
        assert_eq!(h.outbox.get("k").unwrap().unwrap().attempts(), 0);
    }
}

on_both_engines! {
    /// Settings that cannot work are refused at open, before anything is written.
    fn invalid_settings_are_rejected_at_open(engine) {
        let cases = [
            engine.builder().max_attempts(0).open(),
            engine.builder().rate_limit(0, secs(1)).open(),
            engine.builder().rate_limit(1, secs(0)).open(),
            engine.builder().backoff(Backoff::Fixed(vec![])).open(),
        ];
        for result in cases {
            assert!(
                matches!(result, Err(durable_outbox::Error::InvalidConfig { .. })),
                "{result:?}"
            );
        }
        assert!(engine.is_untouched(), "a refused open wrote nothing");
        // The check sees what an open that succeeds writes.
        drop(engine.open());
        assert!(!engine.is_untouched(), "an open wrote something");
    }

    fn give_up_after_must_be_positive(engine) {
        let err = engine
            .builder()
            .give_up_after(std::time::Duration::ZERO)
            .open()
            .unwrap_err();
        assert!(err.to_string().contains("give_up_after"), "{err}");
        assert!(engine.is_untouched(), "a refused open wrote nothing");
    }
}

on_both_engines! {
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
}
