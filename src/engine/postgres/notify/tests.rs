//! The wake-up sender's coalescing, with a stand-in for the server's
//! `NOTIFY` (the engine's own tests in `../tests.rs` run it against a real
//! server): every request is answered by a send that starts after it, sends
//! are at least the interval apart, a burst becomes few sends, and dropping
//! the sender sends what is pending and joins its thread.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests panic loudly"
)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Sender, Shared};

/// A watchdog for waits on the sender thread: far beyond what they need.
const LIMIT: Duration = Duration::from_secs(60);

/// An interval no test waits out: a send that waited for it would hang the
/// test (caught by [`LIMIT`]).
const FOREVER: Duration = Duration::from_secs(3600);

/// When each stand-in send started and ended.
type Log = Arc<Mutex<Vec<(Instant, Instant)>>>;

/// A sender whose sends are logged and take `each` (reaching the server).
fn sender(interval: Duration, each: Duration) -> (Sender, Log) {
    let log: Log = Arc::default();
    let theirs = Arc::clone(&log);
    let sender = Sender::spawn(Arc::new(Shared::default()), interval, move || {
        let start = Instant::now();
        std::thread::sleep(each);
        theirs.lock().unwrap().push((start, Instant::now()));
        true
    })
    .unwrap();
    (sender, log)
}

#[test]
fn the_first_request_after_a_quiet_period_is_sent_at_once() {
    let (sender, log) = sender(FOREVER, Duration::ZERO);
    sender.request();
    let stats = sender.settled(LIMIT);
    assert_eq!(
        (stats.covered, stats.sent),
        (1, 1),
        "wake-ups: the first request must go out without waiting for the interval"
    );
    assert_eq!(log.lock().unwrap().len(), 1);
}

#[test]
fn requests_during_a_send_are_merged_into_one_trailing_send_after_the_interval() {
    let interval = Duration::from_millis(30);
    let (started_tx, started) = mpsc::channel::<()>();
    let (release, released) = mpsc::channel::<()>();
    let released = Mutex::new(released);
    let log: Log = Arc::default();
    let theirs = Arc::clone(&log);
    let sender = Sender::spawn(Arc::new(Shared::default()), interval, move || {
        let start = Instant::now();
        started_tx.send(()).ok();
        // Held until the test made its requests (only the first send).
        released.lock().unwrap().recv_timeout(LIMIT).ok();
        theirs.lock().unwrap().push((start, Instant::now()));
        true
    })
    .unwrap();
    sender.request();
    started.recv_timeout(LIMIT).expect("the first send starts");
    // Ten requests while the first send runs: none is covered by it.
    for _ in 0..10 {
        sender.request();
    }
    drop(release);
    let stats = sender.settled(LIMIT);
    assert_eq!(
        (stats.requested, stats.covered, stats.sent),
        (11, 11, 2),
        "wake-ups: requests made during a send need one more send, and only one"
    );
    let log = log.lock().unwrap();
    let (first_end, second_start) = (log[0].1, log[1].0);
    assert!(
        second_start.duration_since(first_end) >= interval,
        "wake-ups: the trailing send must wait the coalescing interval ({:?} < {interval:?})",
        second_start.duration_since(first_end)
    );
}

#[test]
fn a_burst_of_concurrent_requests_becomes_few_sends_and_the_last_request_is_answered() {
    let interval = super::COALESCE;
    let (sender, log) = sender(interval, Duration::from_micros(200));
    let sender = Arc::new(sender);
    let start = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..8 {
            let sender = &sender;
            scope.spawn(move || {
                for _ in 0..500 {
                    sender.request();
                    std::thread::sleep(Duration::from_micros(50));
                }
            });
        }
    });
    let stats = sender.settled(LIMIT);
    let elapsed = start.elapsed();
    assert_eq!(
        (stats.requested, stats.covered),
        (4000, 4000),
        "wake-ups: the last request of the burst must have a send after it"
    );
    // Each send after the first waits the interval after the one before it.
    let bound = 1 + elapsed.as_millis() / interval.as_millis();
    assert!(
        u128::from(stats.sent) <= bound,
        "wake-ups: {} sends in {elapsed:?} exceed one per {interval:?}",
        stats.sent
    );
    assert_eq!(
        log.lock().unwrap().len(),
        usize::try_from(stats.sent).unwrap()
    );
    for pair in log.lock().unwrap().windows(2) {
        assert!(pair[1].0.duration_since(pair[0].1) >= interval);
    }
}

#[test]
fn a_failed_send_still_answers_its_requests_and_the_next_request_sends_again() {
    let failing = Arc::new(AtomicBool::new(true));
    let theirs = Arc::clone(&failing);
    let sender = Sender::spawn(Arc::new(Shared::default()), Duration::ZERO, move || {
        !theirs.load(Ordering::SeqCst)
    })
    .unwrap();
    sender.request();
    let stats = sender.settled(LIMIT);
    assert_eq!((stats.covered, stats.sent), (1, 0));
    failing.store(false, Ordering::SeqCst);
    sender.request();
    let stats = sender.settled(LIMIT);
    assert_eq!(
        (stats.covered, stats.sent),
        (2, 1),
        "wake-ups: a failed send must not stop the next request's"
    );
}

/// Set when the stand-in send (owned by the sender thread) is dropped.
struct DroppedFlag(Arc<AtomicBool>);

impl Drop for DroppedFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[test]
fn dropping_the_sender_sends_what_is_pending_at_once_and_joins_its_thread() {
    let sends = Arc::new(Mutex::new(0u32));
    let dropped = Arc::new(AtomicBool::new(false));
    let flag = DroppedFlag(Arc::clone(&dropped));
    let theirs = Arc::clone(&sends);
    let sender = Sender::spawn(Arc::new(Shared::default()), FOREVER, move || {
        let _owned = &flag;
        *theirs.lock().unwrap() += 1;
        true
    })
    .unwrap();
    sender.request();
    assert_eq!(sender.settled(LIMIT).sent, 1);
    // Within the interval: pending until the interval ends, or the drop.
    sender.request();
    let (done, dropping) = mpsc::channel();
    std::thread::spawn(move || {
        drop(sender);
        done.send(()).ok();
    });
    dropping.recv_timeout(LIMIT).expect(
        "wake-ups: dropping the sender must send the pending wake-up at once, not after the interval",
    );
    assert_eq!(*sends.lock().unwrap(), 2, "the pending wake-up was sent");
    assert!(
        dropped.load(Ordering::SeqCst),
        "wake-ups: the sender thread (which owns the send) must have ended when the drop returns"
    );
}

/// The sender's connection is one of the handle's: it asks the server to
/// drop it within the dead-peer bounds, as every other does
/// (`session::tests`).
#[test]
fn the_wake_up_senders_connection_asks_the_server_for_the_dead_peer_bounds() {
    let Some(server) = super::super::test_server::PgServer::shared() else {
        return;
    };
    let db = server.database();
    let mut line = super::Line {
        connector: super::Connector::parse(&db.url()).unwrap(),
        statement: "SELECT 1".to_owned(),
        client: None,
        shared: Arc::new(Shared::default()),
    };
    assert!(line.connect(), "the sender connects");
    let row = line
        .client
        .as_mut()
        .unwrap()
        .query_one(
            "test",
            "SELECT (SELECT setting FROM pg_settings WHERE name = 'tcp_keepalives_idle'), \
                    (SELECT setting FROM pg_settings WHERE name = 'tcp_user_timeout')",
            &[],
        )
        .unwrap();
    assert_eq!(
        (row.get::<_, String>(0), row.get::<_, String>(1)),
        ("15".to_owned(), "30000".to_owned())
    );
}
