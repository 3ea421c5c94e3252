//! The golden workload: one deterministic run through every kind of record
//! the file engine writes. It uses only the public API as it stood at commit
//! `6d8a87b` (before the delivery rules were split from the engines), so the
//! same file also generates the fixture on that commit (see
//! `fixtures/golden-v1/README.md`). Only `durable_outbox` and `std`: nothing
//! from the test harness.

use std::path::Path;
use std::time::Duration;

use durable_outbox::{
    Backoff, ItemFilter, ItemState, ManualClock, NewMessage, Outbox, OutboxBuilder, SendError,
};

/// The manual clock's first reading.
pub const START: &str = "2026-01-15T09:00:00Z";

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn message(key: &str, destination: &str) -> NewMessage {
    NewMessage {
        idempotency_key: key.into(),
        connector: "telegram".into(),
        grant_id: "grant-1".into(),
        destination: destination.into(),
        content: format!("body of {key}"),
        ..Default::default()
    }
}

/// Every setting that shapes what is stored is named here, so a changed
/// default cannot change the files.
fn builder(dir: &Path, clock: &ManualClock) -> OutboxBuilder {
    Outbox::builder(dir)
        .clock(clock.clone())
        .sleeper(clock.clone())
        .max_attempts(3)
        .backoff(Backoff::Fixed(vec![secs(10), secs(20)]))
        .rate_limit(2, secs(60))
        .history_after(secs(30 * 24 * 3600))
}

/// A panic naming the step, for `unwrap_or_else`.
fn fail<T>(message: &str) -> impl FnOnce(durable_outbox::Error) -> T {
    let message = message.to_owned();
    move |e| panic!("golden workload: {message}: {e}")
}

/// Runs the workload in `dir` (empty or absent), ending with a compaction and
/// the handle dropped: `outbox.json` and `audit.jsonl` are then final.
pub fn run(dir: &Path) {
    let clock = ManualClock::at(START).unwrap_or_else(|e| panic!("golden workload: clock: {e}"));
    let outbox = builder(dir, &clock)
        .open()
        .unwrap_or_else(|e| panic!("golden workload: open: {e}"));
    let enqueue = |key: &str, chat: &str| {
        outbox.enqueue(message(key, chat)).unwrap_or_else(fail(key));
    };

    // A plain send, a retry then a send, a platform's retry_after.
    enqueue("ok", "chat-a");
    enqueue("flaky", "chat-b");
    enqueue("slow-down", "chat-c");
    outbox
        .process("ok", |_| Ok(Some("tg-1".into())))
        .unwrap_or_else(fail("process ok"));
    outbox
        .process("flaky", |item| {
            if item.attempts() == 1 {
                Err(SendError::retryable("http_502"))
            } else {
                Ok(Some("tg-2".into()))
            }
        })
        .unwrap_or_else(fail("process flaky"));
    outbox
        .process_due(|item| match item.idempotency_key() {
            "slow-down" => Err(SendError::retryable("http_429").retry_after(secs(45))),
            other => panic!("golden workload: {other} was not due"),
        })
        .unwrap_or_else(fail("drain with retry_after"));
    // The same key again is a no-op, not a second item.
    enqueue("ok", "chat-a");

    // A cap deferral: two sends a minute to chat-d, the third waits.
    enqueue_many(&outbox, &["cap-1", "cap-2", "cap-3"], "chat-d");
    outbox
        .process_due(|item| Ok(Some(format!("tg-{}", item.idempotency_key()))))
        .unwrap_or_else(fail("drain under the cap"));

    // Ambiguous and permanent failures; a cancel.
    enqueue("maybe", "chat-e");
    enqueue("rejected", "chat-f");
    enqueue("unwanted", "chat-g");
    outbox
        .cancel("unwanted", "alice", "sent by mistake")
        .unwrap_or_else(fail("cancel"));
    outbox
        .process_due(|item| match item.idempotency_key() {
            "maybe" => Err(SendError::ambiguous("read_timeout")),
            "rejected" => Err(SendError::permanent("chat_not_found")),
            _ => Ok(None),
        })
        .unwrap_or_else(fail("drain with failures"));

    // Time passes: the retry_after and the cap window end.
    clock.advance(secs(61));
    outbox
        .process_due(|_| Ok(Some("tg-late".into())))
        .unwrap_or_else(fail("drain after the window"));

    // An operator requeues the ambiguous item; a bulk action over an outage.
    outbox
        .requeue("maybe", "bob", "checked: not delivered")
        .unwrap_or_else(fail("requeue"));
    enqueue_many(&outbox, &["down-1", "down-2"], "chat-h");
    outbox
        .process_due(|item| match item.idempotency_key() {
            "maybe" => Ok(Some("tg-maybe".into())),
            _ => Err(SendError::permanent("connection_refused")),
        })
        .unwrap_or_else(fail("drain with an outage"));
    let requeued = outbox
        .requeue_where(
            &ItemFilter::new()
                .state(ItemState::Failed)
                .error_code("connection_refused"),
            "carol",
            "the outage is over",
        )
        .unwrap_or_else(fail("requeue_where"));
    assert_eq!(requeued.changed.len(), 2, "golden workload: bulk requeue");
    clock.advance(secs(61));
    outbox
        .process_due(|_| Ok(None))
        .unwrap_or_else(fail("drain after the outage"));

    outbox.compact().unwrap_or_else(fail("compact"));
}

fn enqueue_many(outbox: &Outbox, keys: &[&str], chat: &str) {
    outbox
        .enqueue_many(keys.iter().map(|k| message(k, chat)).collect())
        .unwrap_or_else(fail("enqueue_many"));
}
