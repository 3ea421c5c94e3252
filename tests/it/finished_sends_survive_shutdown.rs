//! A send that has run is recorded, whatever happens to the runtime or the
//! future that ran it: its outcome (here: delivered, with its transport
//! reference) is written even when the tokio runtime shuts down, is dropped,
//! or the caller drops the future after the send finished but before its
//! record ran on the blocking pool. It is never lost to a claim that a
//! reopen settles as `ambiguous_delivery_after_restart`, and never resent.
//!
//! Each test makes its window deterministic. Most hold the send inside the
//! poll that ends it until the runtime is shutting down (its blocking pool
//! refuses new work): the record is handed to the pool in that same poll,
//! and refused. Tokio runs a task queued before the shutdown once a pool
//! thread frees up, so only a refused one was ever lost. The dropped-future
//! test instead queues the record behind a "gate" task on the runtime's
//! only blocking thread, and aborts the future before the gate opens. File
//! engine only: the path under test is the async layer's, the same for
//! every engine.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, mpsc};
use std::time::{Duration, Instant};

use durable_outbox::{ItemState, Outbox, OutboxItem, Outcome, SEND_PANICKED, SendError};

use crate::harness::{DEADLOCK_LIMIT, Harness, uncapped, within};

/// The runtime's live threads (workers and blocking), to wait until every
/// one has exited: then every task its blocking pool held was run or dropped.
#[derive(Clone, Default)]
struct Threads(Arc<(Mutex<usize>, Condvar)>);

impl Threads {
    fn started(&self) {
        *self.0.0.lock().unwrap() += 1;
    }

    fn stopped(&self) {
        *self.0.0.lock().unwrap() -= 1;
        self.0.1.notify_all();
    }

    /// Waits until no thread of the runtime is left (a watchdog names the
    /// guarantee if that never happens).
    fn wait_all_stopped(&self, guarantee: &str) {
        let (live, changed) = &*self.0;
        let (live, timeout) = changed
            .wait_timeout_while(live.lock().unwrap(), DEADLOCK_LIMIT, |live| *live > 0)
            .unwrap();
        assert!(
            !timeout.timed_out(),
            "{guarantee}: {} runtime threads still running after {DEADLOCK_LIMIT:?}",
            *live
        );
    }
}

/// A runtime with one worker thread and one blocking thread, counting its
/// threads.
fn counted_runtime() -> (tokio::runtime::Runtime, Threads) {
    let threads = Threads::default();
    let (start, stop) = (threads.clone(), threads.clone());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .max_blocking_threads(1)
        .on_thread_start(move || start.started())
        .on_thread_stop(move || stop.stopped())
        .enable_all()
        .build()
        .unwrap();
    (runtime, threads)
}

/// The gate a send closes on the runtime's only blocking thread: whatever
/// the outbox hands to the blocking pool after that waits until
/// [`Gate::open`].
struct Gate {
    open: Mutex<Option<mpsc::Sender<()>>>,
    held: Mutex<Option<mpsc::Receiver<()>>>,
}

impl Gate {
    fn new() -> Arc<Self> {
        let (open, held) = mpsc::channel();
        Arc::new(Self {
            open: Mutex::new(Some(open)),
            held: Mutex::new(Some(held)),
        })
    }

    /// Occupies the blocking thread until the gate opens; returns once it is
    /// occupied.
    async fn close(&self) {
        let held = self.held.lock().unwrap().take().expect("closed once");
        let (occupied, occupying) = tokio::sync::oneshot::channel();
        drop(tokio::task::spawn_blocking(move || {
            occupied.send(()).unwrap();
            let _ = held.recv();
        }));
        occupying.await.unwrap();
    }

    fn open(&self) {
        drop(self.open.lock().unwrap().take());
    }
}

/// A send boxed, as the transports here return it.
type Sending = std::pin::Pin<Box<dyn Future<Output = Result<Option<String>, SendError>> + Send>>;

/// A transport that delivers `key`'s message as `tr-{key}`. The first send
/// reports its key on `finished`, then finishes only once `go` says so,
/// inside the very poll that returns its result: the caller's record of it
/// is then handed to the blocking pool in that poll, after whatever the test
/// did meanwhile (shut the runtime down).
fn held_transport(
    finished: mpsc::Sender<String>,
    go: mpsc::Receiver<()>,
) -> impl Fn(OutboxItem) -> Sending + Send + Sync + 'static {
    held_transport_ending(finished, go, false)
}

/// [`held_transport`] whose first send, once `go` says so, panics instead
/// of delivering when `panics` is set.
fn held_transport_ending(
    finished: mpsc::Sender<String>,
    go: mpsc::Receiver<()>,
    panics: bool,
) -> impl Fn(OutboxItem) -> Sending + Send + Sync + 'static {
    let first = Arc::new(AtomicBool::new(true));
    let finished = Mutex::new(finished);
    let go = Arc::new(Mutex::new(go));
    move |item: OutboxItem| {
        let first = first.swap(false, Ordering::SeqCst);
        let finished = finished.lock().unwrap().clone();
        let go = Arc::clone(&go);
        Box::pin(async move {
            let key = item.idempotency_key().to_owned();
            finished.send(key.clone()).unwrap();
            if first {
                go.lock().unwrap().recv().unwrap();
                assert!(!panics, "the transport panicked after sending {key}");
            }
            Ok(Some(format!("tr-{key}")))
        }) as Sending
    }
}

/// A transport that delivers `key`'s message as `tr-{key}`: the first send
/// closes `gate` first, then reports on `finished` that it has returned.
fn gated_transport(
    gate: &Arc<Gate>,
    finished: mpsc::Sender<String>,
) -> impl Fn(OutboxItem) -> Sending + Send + Sync + 'static {
    let gate = Arc::clone(gate);
    let first = Arc::new(AtomicBool::new(true));
    let finished = Mutex::new(finished);
    move |item: OutboxItem| {
        let gate = Arc::clone(&gate);
        let first = first.swap(false, Ordering::SeqCst);
        let finished = finished.lock().unwrap().clone();
        Box::pin(async move {
            let key = item.idempotency_key().to_owned();
            if first {
                gate.close().await;
            }
            finished.send(key.clone()).unwrap();
            Ok(Some(format!("tr-{key}")))
        }) as Sending
    }
}

/// `key` was delivered once and is recorded so: by this handle, by a look
/// that would send it again (it must not), and by a handle opened afresh.
fn assert_recorded_as_sent(h: &Harness, key: &str) {
    let item = h.outbox.get(key).unwrap().unwrap();
    assert_eq!(
        (item.state(), item.transport_ref(), item.dispatch_claimed()),
        (ItemState::Sent, Some(format!("tr-{key}").as_str()), false),
        "the record of {key}'s finished send was lost: {item:?}"
    );
    let looked = h
        .outbox
        .process(key, |_| panic!("{key} was sent again"))
        .unwrap();
    assert_eq!(looked.outcome, Outcome::Sent);
    let reopened = h.reopen();
    let item = reopened.get(key).unwrap().unwrap();
    assert_eq!(item.state(), ItemState::Sent, "after reopening: {item:?}");
    reopened.verify_audit().unwrap();
}

/// `key` was never handed to `send`: queued, untouched.
fn assert_untouched(outbox: &Outbox, key: &str) {
    let item = outbox.get(key).unwrap().unwrap();
    assert_eq!(
        (item.state(), item.attempts(), item.dispatch_claimed()),
        (ItemState::Queued, 0, false),
        "{key} was never sent, yet is not as it was: {item:?}"
    );
}

/// `process_async`: the send returns just after its runtime was shut down
/// without waiting for its blocking pool, which then refuses the record.
/// The caller, still being polled, is told the receipt only once the
/// record is durable (before the fix it was told `Error::Io`, "run
/// blocking task", and the record was lost).
#[test]
fn a_process_async_send_finished_when_its_runtime_shut_down_is_recorded_as_sent() {
    let h = Harness::with(uncapped);
    h.enqueue("k", "chat-1");
    let (rt, threads) = counted_runtime();
    let (finished, finishing) = mpsc::channel();
    let (go, going) = mpsc::channel();
    let transport = held_transport(finished, going);
    let outbox = h.outbox.clone();
    let (told, telling) = mpsc::channel();
    rt.spawn(async move {
        let receipt = outbox.process_async("k", transport).await;
        told.send(receipt).unwrap();
    });
    within(
        "a finished send is recorded after a shutdown",
        DEADLOCK_LIMIT,
        || {
            assert_eq!(finishing.recv().unwrap(), "k");
            rt.shutdown_background();
            go.send(()).unwrap();
            threads.wait_all_stopped("a finished send is recorded after a shutdown");
        },
    );
    let receipt = telling.try_recv().expect("the caller was told nothing");
    let receipt = receipt.expect("the caller was told an error");
    assert_eq!(
        (receipt.outcome, receipt.transport_ref.as_deref()),
        (Outcome::Sent, Some("tr-k"))
    );
    assert_recorded_as_sent(&h, "k");
}

/// The worker: the send returns after its runtime was shut down (with a
/// timeout shorter than the send), so the batched step that records it is
/// refused by the blocking pool. It is recorded all the same, and the next
/// item of the chat is not claimed from a runtime that is going away.
#[test]
fn a_worker_send_finished_when_its_runtime_shut_down_is_recorded_as_sent() {
    let h = Harness::with(uncapped);
    h.enqueue("a", "chat-1");
    h.enqueue("b", "chat-1");
    let (rt, threads) = counted_runtime();
    let (finished, finishing) = mpsc::channel();
    let (go, going) = mpsc::channel();
    let worker = h
        .outbox
        .worker(held_transport(finished, going))
        .concurrency(1);
    rt.spawn(worker.run(std::future::pending()));
    within(
        "a worker's finished send is recorded after a shutdown",
        DEADLOCK_LIMIT,
        || {
            assert_eq!(finishing.recv().unwrap(), "a");
            rt.shutdown_timeout(Duration::from_millis(50));
            go.send(()).unwrap();
            threads.wait_all_stopped("a worker's finished send is recorded after a shutdown");
        },
    );
    assert!(
        finishing.try_recv().is_err(),
        "b was sent from a runtime shut down"
    );
    assert_untouched(&h.outbox, "b");
    assert_recorded_as_sent(&h, "a");
}

/// `process_due_async`: the send returns while its runtime is being dropped
/// (on another thread: dropping waits for the send's thread), after the
/// blocking pool began to refuse work.
#[test]
fn a_drain_send_finished_when_its_runtime_was_dropped_is_recorded_as_sent() {
    let h = Harness::with(uncapped);
    h.enqueue("k", "chat-1");
    let (rt, _threads) = counted_runtime();
    let (finished, finishing) = mpsc::channel();
    let (go, going) = mpsc::channel();
    let transport = held_transport(finished, going);
    let outbox = h.outbox.clone();
    let handle = rt.handle().clone();
    rt.spawn(async move { outbox.process_due_async(1, transport).await });
    within(
        "a drain's finished send is recorded after its runtime is dropped",
        DEADLOCK_LIMIT,
        || {
            assert_eq!(finishing.recv().unwrap(), "k");
            let dropping = std::thread::spawn(move || drop(rt));
            wait_until_the_pool_refuses_work(&handle);
            go.send(()).unwrap();
            dropping.join().unwrap();
        },
    );
    assert_recorded_as_sent(&h, "k");
}

/// Waits until the runtime of `handle` is shutting down its blocking pool:
/// work handed to it then is dropped at once instead of being queued.
fn wait_until_the_pool_refuses_work(handle: &tokio::runtime::Handle) {
    /// Sets its flag when dropped.
    struct Dropped(Arc<AtomicBool>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let deadline = Instant::now() + DEADLOCK_LIMIT;
    loop {
        let dropped = Arc::new(AtomicBool::new(false));
        let probe = Dropped(Arc::clone(&dropped));
        drop(handle.spawn_blocking(move || drop(probe)));
        if dropped.load(Ordering::SeqCst) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the runtime's blocking pool never began to shut down"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// `process_due_async` dropped by its caller after a send finished, before
/// its record ran: the record still runs (the runtime lives on), and a later
/// drain of the same handle sends what comes next.
#[test]
fn a_drain_dropped_after_its_send_finished_still_records_it() {
    let h = Harness::with(uncapped);
    h.enqueue("k", "chat-1");
    let (rt, _threads) = counted_runtime();
    let gate = Gate::new();
    let (finished, finishing) = mpsc::channel();
    let transport = gated_transport(&gate, finished);
    let outbox = h.outbox.clone();
    let drain = rt.spawn(async move { outbox.process_due_async(1, transport).await });
    within(
        "a drain dropped after its send finished records it",
        DEADLOCK_LIMIT,
        || {
            assert_eq!(finishing.recv().unwrap(), "k");
            drain.abort();
            let aborted = rt.block_on(drain);
            assert!(aborted.unwrap_err().is_cancelled());
            gate.open();
            // The record runs on the pool, after the caller left: wait for it.
            let deadline = Instant::now() + DEADLOCK_LIMIT;
            while h.outbox.get("k").unwrap().unwrap().dispatch_claimed()
                && Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(10));
            }
        },
    );
    assert_recorded_as_sent(&h, "k");
    h.enqueue("next", "chat-1");
    let report = rt
        .block_on(
            h.outbox
                .process_due_async(1, |_| async { Ok(Some("tr-next".to_owned())) }),
        )
        .unwrap();
    assert_eq!(report.sent, 1, "the chat's line stayed blocked: {report:?}");
}

/// A send that panics just after its runtime was shut down: its drain
/// records the panic (the message may have left: failed as
/// `send_panicked`, never resent) even though the blocking pool refuses
/// the step that records it.
#[test]
fn a_drain_send_that_panicked_as_its_runtime_shut_down_is_recorded_as_panicked() {
    let h = Harness::with(uncapped);
    h.enqueue("k", "chat-1");
    let (rt, threads) = counted_runtime();
    let (finished, finishing) = mpsc::channel();
    let (go, going) = mpsc::channel();
    let transport = held_transport_ending(finished, going, true);
    let outbox = h.outbox.clone();
    rt.spawn(async move { outbox.process_due_async(1, transport).await });
    within(
        "a panicked send is recorded after a shutdown",
        DEADLOCK_LIMIT,
        || {
            assert_eq!(finishing.recv().unwrap(), "k");
            rt.shutdown_background();
            go.send(()).unwrap();
            threads.wait_all_stopped("a panicked send is recorded after a shutdown");
        },
    );
    let item = h.outbox.get("k").unwrap().unwrap();
    assert_eq!(
        (item.state(), item.error_code(), item.dispatch_claimed()),
        (ItemState::Failed, Some(SEND_PANICKED), false),
        "the record of k's panicked send was lost: {item:?}"
    );
    let looked = h
        .outbox
        .process("k", |_| panic!("k was sent again"))
        .unwrap();
    assert_eq!(looked.outcome, Outcome::Failed);
    h.reopen().verify_audit().unwrap();
}

/// A leader hands leadership on while it holds the outbox's lock (so the
/// next batch forms behind it). When the runtime is shutting down, the
/// pool refuses that next leader: it must not then run in place, under the
/// lock its own transaction needs (a self-deadlock that kept the runtime's
/// drop waiting forever and lost every record of the batch), but after the
/// current batch, by the same thread. Here a and b finish together and
/// share a batch (`step.collect` slowed so both are in it); while that
/// batch is held in its rules (`step.batch` slowed), c finishes and queues
/// behind it, and the runtime is shut down.
#[cfg(feature = "test-failpoints")]
#[test]
fn a_batch_queued_behind_a_leader_when_its_runtime_shut_down_is_recorded() {
    use durable_outbox::FailAction;
    let h = Harness::with(|b| {
        uncapped(b)
            .failpoint("step.collect", FailAction::DelayMs(300))
            .failpoint("step.batch", FailAction::DelayMs(1000))
    });
    for key in ["a", "b", "c"] {
        h.enqueue(key, &format!("chat-{key}"));
    }
    let (rt, threads) = counted_runtime();
    let (started, starting) = mpsc::channel::<String>();
    let (finished, finishing) = mpsc::channel::<String>();
    let (first, first_go) = tokio::sync::watch::channel(false);
    let (second, second_go) = tokio::sync::watch::channel(false);
    let transport = move |item: OutboxItem| {
        let (started, finished) = (started.clone(), finished.clone());
        let key = item.idempotency_key().to_owned();
        let mut go = if key == "c" {
            second_go.clone()
        } else {
            first_go.clone()
        };
        Box::pin(async move {
            started.send(key.clone()).unwrap();
            go.wait_for(|go| *go).await.unwrap();
            finished.send(key.clone()).unwrap();
            Ok(Some(format!("tr-{key}")))
        }) as Sending
    };
    let worker = h.outbox.worker(transport).concurrency(3);
    rt.spawn(worker.run(std::future::pending()));
    within(
        "a batch queued behind a leader is recorded after a shutdown",
        DEADLOCK_LIMIT,
        || {
            for _ in 0..3 {
                starting.recv().unwrap();
            }
            first.send(true).unwrap();
            let deadline = Instant::now() + DEADLOCK_LIMIT;
            while h.outbox.failpoint_hits("step.batch") == 0 {
                assert!(Instant::now() < deadline, "a and b never shared a batch");
                std::thread::sleep(Duration::from_millis(5));
            }
            second.send(true).unwrap();
            let mut done: Vec<String> = (0..3).map(|_| finishing.recv().unwrap()).collect();
            done.sort();
            assert_eq!(done, ["a", "b", "c"]);
            rt.shutdown_background();
            threads.wait_all_stopped("a batch queued behind a leader is recorded after a shutdown");
        },
    );
    for key in ["a", "b", "c"] {
        assert_recorded_as_sent(&h, key);
    }
}

/// A finished send whose batched step failed in its rules (nothing of the
/// batch written) is recorded by a step of its own. When that happens as
/// the runtime shuts down, the pool refuses that step too, and it must still
/// run where it is refused: the message was delivered, and is recorded as
/// sent, not left claimed for the next look to fail as ambiguous. Here the
/// batch after the send fails on the way in (`step.collect`, its 2nd hit;
/// the 1st is the drain's claim of k).
#[cfg(feature = "test-failpoints")]
#[test]
fn a_send_whose_step_reruns_alone_as_its_runtime_shut_down_is_recorded() {
    use durable_outbox::FailAction;
    let h = Harness::with(|b| uncapped(b).failpoint("step.collect", FailAction::ErrorOnHit(2)));
    h.enqueue("k", "chat-1");
    let (rt, threads) = counted_runtime();
    let (finished, finishing) = mpsc::channel();
    let (go, going) = mpsc::channel();
    let transport = held_transport_ending(finished, going, false);
    let outbox = h.outbox.clone();
    rt.spawn(async move { outbox.process_due_async(1, transport).await });
    within(
        "a send whose step reruns alone is recorded after a shutdown",
        DEADLOCK_LIMIT,
        || {
            assert_eq!(finishing.recv().unwrap(), "k");
            rt.shutdown_background();
            go.send(()).unwrap();
            threads.wait_all_stopped("a send whose step reruns alone is recorded after a shutdown");
        },
    );
    let item = h.outbox.get("k").unwrap().unwrap();
    assert_eq!(
        (item.state(), item.transport_ref(), item.dispatch_claimed()),
        (ItemState::Sent, Some("tr-k"), false),
        "the record of k's send was lost: {item:?}"
    );
    assert_eq!(
        h.outbox.failpoint_hits("step.collect"),
        3,
        "k's batch failed on the way in, then k stepped alone"
    );
    h.reopen().verify_audit().unwrap();
}
