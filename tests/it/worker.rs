//! The delivery worker in-process: woken by enqueues, asleep until the next
//! due moment, graceful shutdown, backpressure, fairness and order.
//!
//! Every wait runs under a watchdog that names the guarantee it waits for.
//!
//! Bodies in `on_both_engines!` run on the file engine and on PostgreSQL
//! (`name::file`, `name::postgres`); every body here runs on both. Most use
//! the system clock (`EngineUnderTest::open_real_clock_with`): the worker's
//! sleeps and wake-ups are what they check.

use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use durable_outbox::{Backoff, ItemState, Ordering, Outbox, OutboxItem, SendError};
use tokio::sync::{Notify, oneshot};

use crate::engines::{EngineUnderTest, on_both_engines};
use crate::harness::msg;
use crate::harness::{DEADLOCK_LIMIT, runtime, secs};

const WATCHDOG: Duration = Duration::from_secs(60);

/// Awaits `f` under the watchdog; a hang fails naming `what`.
async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(WATCHDOG, f)
        .await
        .unwrap_or_else(|_elapsed| panic!("{what}: nothing happened within {WATCHDOG:?}"))
}

/// Polls `done` (a cheap state read) until it holds, under the watchdog.
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    within(what, async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
}

/// A handle on the system clock (the worker's waits here are wall-clock)
/// with a cap that never binds.
fn open(engine: &EngineUnderTest) -> Outbox {
    engine.open_real_clock_with(|b| b.rate_limit(u32::MAX, Duration::from_secs(60)))
}

/// Records the keys handed to `send`, in order, and signals each start.
#[derive(Clone, Default)]
struct Transport {
    started: Arc<Mutex<Vec<String>>>,
    notify: Arc<Notify>,
}

impl Transport {
    fn started(&self) -> Vec<String> {
        self.started.lock().unwrap().clone()
    }

    fn note(&self, item: &OutboxItem) {
        self.started
            .lock()
            .unwrap()
            .push(item.idempotency_key().to_owned());
        self.notify.notify_waiters();
    }
}

/// Runs a worker with `concurrency` over what is queued until all is sent;
/// returns the keys in the order they reached `send`.
fn deliver_all(outbox: &Outbox, concurrency: usize) -> Vec<String> {
    let t = Transport::default();
    let sender = t.clone();
    let probe = outbox.clone();
    runtime().block_on(async {
        let (stop, stopped) = oneshot::channel::<()>();
        let worker = outbox
            .worker(move |item: OutboxItem| {
                let t = sender.clone();
                async move {
                    t.note(&item);
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    Ok::<_, SendError>(None)
                }
            })
            .concurrency(concurrency);
        let running = tokio::spawn(worker.run(async move {
            stopped.await.ok();
        }));
        until("delivery: everything sent", || {
            probe
                .list_items()
                .unwrap()
                .iter()
                .all(|i| i.state() == ItemState::Sent)
        })
        .await;
        stop.send(()).unwrap();
        within("shutdown", running).await.unwrap().unwrap();
    });
    t.started()
}

/// Enqueues a flood of 30 to one chat and one message to each of three
/// quiet chats, delivers with concurrency 1 and asserts the quiet chats were
/// served by turn, not after the flood.
fn assert_the_quiet_chats_are_served_by_turn(engine: &EngineUnderTest, ordering: Ordering) {
    let outbox = engine.open_real_clock_with(|b| {
        b.rate_limit(u32::MAX, Duration::from_secs(60))
            .ordering(ordering)
    });
    let flood = (0..30).map(|i| msg(&format!("flood-{i:02}"), "chat-flood"));
    let quiet = (0..3).map(|i| msg(&format!("quiet-{i}"), &format!("chat-q{i}")));
    outbox.enqueue_many(flood.chain(quiet).collect()).unwrap();
    let started = deliver_all(&outbox, 1);
    let last_quiet = started
        .iter()
        .rposition(|k| k.starts_with("quiet"))
        .unwrap();
    assert!(
        last_quiet < 8,
        "fairness ({ordering:?}): the three quiet chats were served by turn, \
         not after the flood; order was {started:?}"
    );
}

on_both_engines! {
    fn an_enqueue_on_a_clone_wakes_the_worker_at_once(engine) {
        let outbox = open(engine);
        let t = Transport::default();
        let sender = t.clone();
        runtime().block_on(async {
            let (stop, stopped) = oneshot::channel::<()>();
            // The journal watcher looks only once an hour: only the in-process
            // notification can wake this worker.
            let worker = outbox
                .worker(move |item: OutboxItem| {
                    let t = sender.clone();
                    async move {
                        t.note(&item);
                        Ok::<_, SendError>(None)
                    }
                })
                .watch_interval(Duration::from_secs(3600));
            let running = tokio::spawn(worker.run(async move {
                stopped.await.ok();
            }));
            tokio::time::sleep(Duration::from_millis(50)).await;
            let clone = outbox.clone();
            clone.enqueue(msg("hello", "chat-1")).unwrap();
            until("in-process wake-up: the enqueue reaches send", || {
                t.started() == ["hello"]
            })
            .await;
            stop.send(()).unwrap();
            let report = within("shutdown", running).await.unwrap().unwrap();
            assert_eq!(report.sent, 1);
        });
    }

    fn a_deferred_item_wakes_the_worker_at_its_moment_and_not_before(engine) {
        let outbox = engine.open_real_clock_with(|b| {
            b.rate_limit(u32::MAX, Duration::from_secs(60))
                .backoff(Backoff::Fixed(vec![Duration::from_millis(300)]))
        });
        outbox.enqueue(msg("flaky", "chat-1")).unwrap();
        let attempts: Arc<Mutex<Vec<chrono::DateTime<chrono::Utc>>>> = Arc::default();
        let seen = Arc::clone(&attempts);
        let probe = outbox.clone();
        runtime().block_on(async {
            let (stop, stopped) = oneshot::channel::<()>();
            let worker = outbox
                .worker(move |item: OutboxItem| {
                    let seen = Arc::clone(&seen);
                    async move {
                        seen.lock().unwrap().push(chrono::Utc::now());
                        if item.attempts() == 1 {
                            Err(SendError::retryable("http_502"))
                        } else {
                            Ok(None)
                        }
                    }
                })
                .watch_interval(Duration::from_secs(3600));
            let running = tokio::spawn(worker.run(async move {
                stopped.await.ok();
            }));
            until("deferred wake-up: the retry is sent", || {
                probe
                    .get("flaky")
                    .unwrap()
                    .is_some_and(|i| i.state() == ItemState::Sent)
            })
            .await;
            stop.send(()).unwrap();
            let report = within("shutdown", running).await.unwrap().unwrap();
            assert_eq!((report.sent, report.retried), (1, 1));
        });
        let attempts = attempts.lock().unwrap().clone();
        assert_eq!(attempts.len(), 2, "one retry, no extra attempt");
        assert!(
            attempts[1] - attempts[0] >= chrono::Duration::milliseconds(300),
            "the retry waited for its backoff"
        );
    }

    fn graceful_shutdown_finishes_running_sends_and_leaves_the_rest_untouched(engine) {
        let outbox = open(engine);
        for i in 0..6 {
            outbox
                .enqueue(msg(&format!("m{i}"), &format!("chat-{i}")))
                .unwrap();
        }
        let t = Transport::default();
        let gate = Arc::new(Notify::new());
        let (sender, release) = (t.clone(), Arc::clone(&gate));
        runtime().block_on(async {
            let (stop, stopped) = oneshot::channel::<()>();
            let worker = outbox
                .worker(move |item: OutboxItem| {
                    let (t, gate) = (sender.clone(), Arc::clone(&release));
                    async move {
                        let opened = gate.notified();
                        t.note(&item);
                        opened.await;
                        Ok::<_, SendError>(Some("ok".into()))
                    }
                })
                .concurrency(2)
                .shutdown_timeout(Duration::from_secs(30));
            let running = tokio::spawn(worker.run(async move {
                stopped.await.ok();
            }));
            until("graceful shutdown: two sends running", || {
                t.started().len() == 2
            })
            .await;
            stop.send(()).unwrap();
            tokio::time::sleep(Duration::from_millis(100)).await;
            gate.notify_waiters();
            let report = within("graceful shutdown", running).await.unwrap().unwrap();
            assert_eq!((report.sent, report.cancelled), (2, 0));
        });
        let started = t.started();
        assert_eq!(started.len(), 2, "no new claims after shutdown");
        for item in outbox.list_items().unwrap() {
            if started.iter().any(|k| k == item.idempotency_key()) {
                assert_eq!(item.state(), ItemState::Sent);
            } else {
                assert_eq!(
                    (item.state(), item.attempts(), item.dispatch_claimed()),
                    (ItemState::Queued, 0, false),
                    "graceful shutdown: {} untouched",
                    item.idempotency_key()
                );
            }
        }
    }

    fn a_slow_send_never_has_more_than_concurrency_items_claimed(engine) {
        let outbox = open(engine);
        let batch = (0..40)
            .map(|i| msg(&format!("m{i:02}"), &format!("chat-{i}")))
            .collect();
        outbox.enqueue_many(batch).unwrap();
        let live = Arc::new(AtomicUsize::new(0));
        let peak = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new(Notify::new());
        let t = Transport::default();
        let (l, p, g, sender) = (
            Arc::clone(&live),
            Arc::clone(&peak),
            Arc::clone(&gate),
            t.clone(),
        );
        let probe = outbox.clone();
        runtime().block_on(async {
            let (stop, stopped) = oneshot::channel::<()>();
            let worker = outbox
                .worker(move |item: OutboxItem| {
                    let (live, peak, gate, t) = (
                        Arc::clone(&l),
                        Arc::clone(&p),
                        Arc::clone(&g),
                        sender.clone(),
                    );
                    async move {
                        let opened = gate.notified();
                        let now = live.fetch_add(1, AtomicOrdering::SeqCst) + 1;
                        peak.fetch_max(now, AtomicOrdering::SeqCst);
                        t.note(&item);
                        opened.await;
                        live.fetch_sub(1, AtomicOrdering::SeqCst);
                        Ok::<_, SendError>(None)
                    }
                })
                .concurrency(3);
            let running = tokio::spawn(worker.run(async move {
                stopped.await.ok();
            }));
            until("backpressure: three sends running", || {
                t.started().len() == 3
            })
            .await;
            // Sends are stuck: the worker must not claim ahead of them.
            tokio::time::sleep(Duration::from_millis(200)).await;
            let items = probe.list_items().unwrap();
            let claimed = items.iter().filter(|i| i.dispatch_claimed()).count();
            let touched = items.iter().filter(|i| i.attempts() > 0).count();
            assert_eq!(
                (claimed, touched),
                (3, 3),
                "backpressure: at most `concurrency` claimed"
            );
            // Open the gate until everything is through.
            let start = Instant::now();
            while probe
                .list_items()
                .unwrap()
                .iter()
                .any(|i| i.state() != ItemState::Sent)
            {
                assert!(
                    start.elapsed() < WATCHDOG,
                    "backpressure: the backlog drains"
                );
                gate.notify_waiters();
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            stop.send(()).unwrap();
            let report = within("shutdown", running).await.unwrap().unwrap();
            assert_eq!(report.sent, 40);
        });
        assert_eq!(peak.load(AtomicOrdering::SeqCst), 3);
    }

    fn five_messages_to_one_chat_arrive_in_order_with_concurrency_eight(engine) {
        let outbox = open(engine);
        let batch = ["m1", "m2", "m3", "m4", "m5"]
            .iter()
            .map(|k| msg(k, "chat-1"))
            .chain((0..10).map(|i| msg(&format!("other-{i}"), &format!("chat-x{i}"))))
            .collect();
        outbox.enqueue_many(batch).unwrap();
        let started = deliver_all(&outbox, 8);
        let chat_1: Vec<&str> = started
            .iter()
            .map(String::as_str)
            .filter(|k| k.starts_with('m'))
            .collect();
        assert_eq!(chat_1, ["m1", "m2", "m3", "m4", "m5"]);
    }

    /// Per-destination order: a flood of 30 to one chat does not delay three
    /// quiet chats behind it.
    fn a_flooded_destination_does_not_starve_the_others_in_order(engine) {
        assert_the_quiet_chats_are_served_by_turn(engine, Ordering::PerDestination);
    }

    /// Unordered: the same fairness without the per-chat order.
    fn a_flooded_destination_does_not_starve_the_others_unordered(engine) {
        assert_the_quiet_chats_are_served_by_turn(engine, Ordering::Unordered);
    }
}

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
        let report = crate::harness::within("the worker is woken by another handle's enqueue", DEADLOCK_LIMIT * 2, || {
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
    /// "A panic in `send` fails its item with `SEND_PANICKED` and the worker
    /// carries on": also when `send` panics in its own body, before it
    /// returns the future, and while another slot's send is in flight, which
    /// must finish and be recorded as sent, not be cancelled.
    fn a_send_that_panics_before_returning_its_future_fails_its_item_and_the_worker_carries_on(engine) {
        let outbox = open(engine);
        outbox
            .enqueue_many(vec![
                msg("slow", "chat-slow"),
                msg("boom", "chat-1"),
                msg("after", "chat-1"),
            ])
            .unwrap();
        let t = Transport::default();
        let gate = Arc::new(Notify::new());
        let (sender, release) = (t.clone(), Arc::clone(&gate));
        let probe = outbox.clone();
        let report = runtime().block_on(async {
            let (stop, stopped) = oneshot::channel::<()>();
            let worker = outbox
                .worker(move |item: OutboxItem| {
                    let (t, gate) = (sender.clone(), Arc::clone(&release));
                    t.note(&item);
                    assert_ne!(item.idempotency_key(), "boom", "transport bug");
                    async move {
                        if item.idempotency_key() == "slow" {
                            gate.notified().await;
                        }
                        Ok::<_, SendError>(Some(format!("tr-{}", item.idempotency_key())))
                    }
                })
                .concurrency(2);
            let mut running = tokio::spawn(worker.run(async move {
                stopped.await.ok();
            }));
            let sent = |key: &str| {
                probe
                    .get(key)
                    .unwrap()
                    .is_some_and(|i| i.state() == ItemState::Sent)
            };
            within("a panicking send: the worker carries on to the next message", async {
                tokio::select! {
                    ended = &mut running => panic!("the worker stopped on a panicking send: {ended:?}"),
                    () = until("the next message to the panicked send's chat is sent", || sent("after")) => {}
                }
            })
            .await;
            gate.notify_one();
            within("a panicking send: the send in flight beside it finishes", async {
                tokio::select! {
                    ended = &mut running => panic!("the worker stopped on a panicking send: {ended:?}"),
                    () = until("the slow send is recorded", || sent("slow")) => {}
                }
            })
            .await;
            stop.send(()).unwrap();
            within("shutdown", running).await.unwrap().unwrap()
        });
        assert_eq!((report.sent, report.failed, report.cancelled), (2, 1, 0));
        let boom = outbox.get("boom").unwrap().unwrap();
        assert_eq!(
            (boom.state(), boom.error_code()),
            (ItemState::Failed, Some(durable_outbox::SEND_PANICKED)),
            "the panicked send is recorded as panicked"
        );
        assert_eq!(t.started().iter().filter(|k| *k == "boom").count(), 1, "never resent");
    }
}

on_both_engines! {
    /// A worker whose shutdown has already completed when it starts (a
    /// SIGTERM during the bot's start-up) claims nothing and sends nothing:
    /// "no new claims" from the moment shutdown completes.
    fn a_worker_whose_shutdown_already_completed_claims_and_sends_nothing(engine) {
        let outbox = open(engine);
        for i in 0..3 {
            outbox.enqueue(msg(&format!("m{i}"), &format!("chat-{i}"))).unwrap();
        }
        let t = Transport::default();
        let sender = t.clone();
        let report = runtime().block_on(async {
            let worker = outbox.worker(move |item: OutboxItem| {
                let t = sender.clone();
                async move {
                    t.note(&item);
                    Ok::<_, SendError>(None)
                }
            });
            within("a worker stopped before it started", worker.run(std::future::ready(())))
                .await
                .unwrap()
        });
        assert_eq!(t.started(), Vec::<String>::new(), "nothing sent after shutdown");
        assert_eq!((report.sent, report.released), (0, 0), "nothing claimed: {report:?}");
        for item in outbox.list_items().unwrap() {
            assert_eq!(
                (item.state(), item.attempts(), item.dispatch_claimed()),
                (ItemState::Queued, 0, false),
                "{} untouched",
                item.idempotency_key()
            );
        }
    }
}
