//! Adaptive pacing: after a 429, sends to that destination are spaced by what
//! the server's `retry_after` said, instead of a herd leaving when the cooldown
//! ends. Driven against a model of Synapse's limiter on a manual clock, so every
//! moment is exact.
//!
//! Bodies in `on_both_engines!` run on the file engine and on PostgreSQL
//! (`name::file`, `name::postgres`); every body here runs on both.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use durable_outbox::{Clock, DESTINATION_PACED, ItemState, ManualClock, OutboxItem, SendError};

use crate::engines::on_both_engines;
use crate::harness::{Harness, secs};

/// Synapse's `rc_message` limiter: a bucket of `burst` that drains at `rate`
/// per second; a request that would overflow it is refused with the time until
/// it would fit.
struct Limiter {
    clock: ManualClock,
    rate: f64,
    burst: f64,
    level: f64,
    last: Option<DateTime<Utc>>,
    accepted: Vec<(String, DateTime<Utc>)>,
    refused: Vec<(DateTime<Utc>, Duration)>,
}

impl Limiter {
    fn new(clock: &ManualClock, rate: f64, burst: u32) -> Self {
        Self {
            clock: clock.clone(),
            rate,
            burst: f64::from(burst),
            level: 0.0,
            last: None,
            accepted: Vec::new(),
            refused: Vec::new(),
        }
    }

    fn send(&mut self, item: &OutboxItem) -> Result<Option<String>, SendError> {
        let now = self.clock.now();
        if let Some(last) = self.last {
            let drained = (now - last).num_microseconds().unwrap() as f64 / 1e6 * self.rate;
            self.level = (self.level - drained).max(0.0);
        }
        self.last = Some(now);
        if self.level + 1.0 > self.burst {
            let wait = Duration::from_secs_f64((self.level + 1.0 - self.burst) / self.rate);
            // Synapse reports whole milliseconds, rounded up.
            let wait = Duration::from_millis(wait.as_micros().div_ceil(1000) as u64);
            self.refused.push((now, wait));
            return Err(SendError::retryable("M_LIMIT_EXCEEDED").retry_after(wait));
        }
        self.level += 1.0;
        self.accepted.push((item.idempotency_key().to_owned(), now));
        Ok(Some(format!("$ev-{}", item.idempotency_key())))
    }
}

/// Runs `process_due` until nothing is queued, jumping the clock to the next
/// due moment in between. Returns the virtual time it took.
fn drain(h: &Harness, limiter: &Arc<Mutex<Limiter>>) -> Duration {
    let start = h.clock.now();
    for _ in 0..1000 {
        let send = |item: &OutboxItem| limiter.lock().unwrap().send(item);
        h.outbox.process_due(send).unwrap();
        let items = h.outbox.list_items().unwrap();
        let next = items
            .iter()
            .filter(|i| i.state() == ItemState::Queued)
            .filter_map(OutboxItem::next_attempt_at)
            .min();
        match next {
            Some(at) => h.clock.set(at.max(h.clock.now())),
            None if items.iter().all(|i| i.state().is_terminal()) => {
                return (h.clock.now() - start).to_std().unwrap();
            }
            None => {}
        }
    }
    panic!("watchdog: paced delivery finishes within 1000 passes");
}

on_both_engines! {
    fn after_the_first_429_sends_follow_the_servers_rate_without_a_herd(engine) {
        // Unlimited on our side: the pacing alone.
        twenty_under_synapses_limit(&engine.harness_with(|b| b.rate_limit(10_000, secs(1))));
    }

    /// The targets with the crate's defaults (one send per chat per second
    /// and the learned pace): against the same server, within 1.5 times its own
    /// limit, in order, with at most 2 more 429s after the first.
    fn with_the_defaults_twenty_messages_meet_the_servers_limit(engine) {
        twenty_under_synapses_limit(&engine.harness());
    }

    fn a_paced_destination_defers_with_its_own_code_and_others_are_not_slowed(engine) {
        let h = engine.harness_with(|b| {
            b.rate_limit(10_000, secs(1))
                .max_inline_wait(Duration::ZERO)
        });
        for key in ["a", "b", "c"] {
            h.enqueue(key, "!busy");
        }
        h.enqueue("other", "!quiet");
        // "a" is accepted; "b", a moment later, is told to wait 2 s.
        h.outbox.process("a", |_| Ok(Some("$a".into()))).unwrap();
        h.clock.advance(Duration::from_millis(100));
        let refused = h
            .outbox
            .process("b", |_| {
                Err(SendError::retryable("M_LIMIT_EXCEEDED").retry_after(secs(2)))
            })
            .unwrap();
        assert_eq!(refused.outcome, durable_outbox::Outcome::Deferred);

        // When the cooldown ends, "b" is still held by the learned pace, 2.625 s
        // after "a" ((0.1 s since "a" + the 2 s asked for) and a quarter more)…
        h.clock.advance(secs(2));
        let sent_a = h.outbox.get("a").unwrap().unwrap().sent_at().unwrap();
        let b = h
            .outbox
            .process("b", |_| panic!("inside the pace"))
            .unwrap();
        assert_eq!(b.outcome, durable_outbox::Outcome::Deferred);
        assert_eq!(
            b.next_attempt_at,
            Some(sent_a + chrono::Duration::milliseconds(2625))
        );
        // …then goes, and "c" is spaced by the same pace after it.
        h.clock.set(b.next_attempt_at.unwrap());
        let b = h.outbox.process("b", |_| Ok(Some("$b".into()))).unwrap();
        assert_eq!(b.outcome, durable_outbox::Outcome::Sent);
        let c = h
            .outbox
            .process("c", |_| panic!("inside the pace"))
            .unwrap();
        assert_eq!(c.outcome, durable_outbox::Outcome::Deferred);
        assert_eq!(c.error_code.as_deref(), Some(DESTINATION_PACED));
        let sent_b = h.outbox.get("b").unwrap().unwrap().sent_at().unwrap();
        assert_eq!(
            c.next_attempt_at,
            Some(sent_b + chrono::Duration::milliseconds(2625))
        );
        // Another destination is not paced.
        let other = h
            .outbox
            .process("other", |_| Ok(Some("$o".into())))
            .unwrap();
        assert_eq!(other.outcome, durable_outbox::Outcome::Sent);
    }
}

/// Twenty messages to one room of a server that allows 0.5/s after a burst of
/// 3, as in the issue: all delivered once, in order, after the first 429 at
/// most 2 more, none inside an announced window, within 1.5 times the
/// server's own limit (virtual time: every moment is the manual clock's).
fn twenty_under_synapses_limit(h: &Harness) {
    for i in 0..20 {
        h.enqueue(&format!("m-{i:02}"), "!room");
    }
    let limiter = Arc::new(Mutex::new(Limiter::new(&h.clock, 0.5, 3)));
    let took = drain(h, &limiter);

    let limiter = limiter.lock().unwrap();
    let keys: Vec<&str> = limiter.accepted.iter().map(|(k, _)| k.as_str()).collect();
    let expected: Vec<String> = (0..20).map(|i| format!("m-{i:02}")).collect();
    assert_eq!(keys, expected, "all delivered, once, in order");
    assert!(
        limiter.refused.len() <= 3,
        "after the first 429 at most 2 more, got {}: {:?}",
        limiter.refused.len(),
        limiter.refused
    );
    // The server's own limit: 3 at once, then one per 2 s: 34 s for 20 (the
    // pace keeps a quarter more than the server's interval).
    assert!(took <= secs(34).mul_f64(1.5), "took {took:?}");
    // No request inside an announced window.
    for (at, wait) in &limiter.refused {
        let until = *at + chrono::Duration::from_std(*wait).unwrap();
        assert!(
            !limiter.accepted.iter().any(|(_, t)| t > at && *t < until),
            "a send inside the window {at}..{until}"
        );
    }
    eprintln!(
        "paced: 20 messages in {took:?} (server limit 34 s), {} 429s",
        limiter.refused.len()
    );
}
