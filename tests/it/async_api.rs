//! The async API: the same at-most-once guarantees for tokio bots, with file work
//! off the async threads, cancellation treated as ambiguous, bounded concurrency.
//!
//! Bodies in `on_both_engines!` run on the file engine and on PostgreSQL
//! (`name::file`, `name::postgres`). File-only here: the `#[test]`s hold the
//! directory's lock file or use file-engine failpoints.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use durable_outbox::{ItemState, Outcome, SEND_CANCELLED, SEND_PANICKED, SendError};

use crate::engines::on_both_engines;
use crate::harness::{DEADLOCK_LIMIT, Harness, msg, runtime, secs, within};
use durable_outbox::FailureClass;

on_both_engines! {
    fn process_async_delivers_with_the_claim_durable_before_the_future_runs(engine) {
        let h = engine.harness();
        h.enqueue("k", "chat-1");
        let observer = h.reopen();
        let receipt = runtime().block_on(h.outbox.process_async("k", |item| {
            // Another handle (another process, in effect) already sees the claim.
            let seen = observer.get(item.idempotency_key()).unwrap().unwrap();
            async move {
                assert!(
                    seen.dispatch_claimed(),
                    "claimed before the send future ran"
                );
                tokio::task::yield_now().await;
                Ok(Some("tg-1".to_owned()))
            }
        }));
        let receipt = receipt.unwrap();
        assert_eq!(
            (receipt.outcome, receipt.transport_ref.as_deref()),
            (Outcome::Sent, Some("tg-1"))
        );
        assert_eq!(
            h.outbox.process("k", |_| panic!("resent")).unwrap().outcome,
            Outcome::Sent
        );
    }

    fn a_send_future_dropped_mid_flight_fails_as_ambiguous_and_is_never_resent(engine) {
        let h = engine.harness();
        h.enqueue("k", "chat-1");
        let rt = runtime();
        crate::harness::drop_mid_send(&rt, &h.outbox, "k", || {});
        // The cancellation is recorded on the blocking pool; wait for it
        // (generously: the assertion below says what it must be).
        let deadline = std::time::Instant::now() + DEADLOCK_LIMIT;
        let mut item = h.outbox.get("k").unwrap().unwrap();
        while item.state() == ItemState::Queued && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
            item = h.outbox.get("k").unwrap().unwrap();
        }
        assert_eq!(
            (item.state(), item.error_code()),
            (ItemState::Failed, Some(SEND_CANCELLED))
        );
        let again = rt.block_on(
            h.outbox
                .process_async("k", |_| async { panic!("resent after cancel") }),
        );
        assert_eq!(again.unwrap().outcome, Outcome::Failed);
    }

    fn a_panicking_send_future_is_recorded_then_resumed(engine) {
        let h = engine.harness();
        panics_are_recorded_then_resumed(&h, |_| async { transport_bug() });
    }

    /// A send that panics in its own body, before it returns its future, is
    /// the send's panic all the same: recorded as panicked (not as a
    /// cancelled send), then resumed.
    fn a_send_that_panics_before_returning_its_future_is_recorded_as_panicked(engine) {
        let h = engine.harness();
        panics_are_recorded_then_resumed(&h, |_| {
            let reply = transport_bug();
            async move { reply }
        });
    }

    /// `process_due_async`: a send that panics before returning its future
    /// is recorded as panicked, and the panic is resumed only once the send
    /// in flight beside it has finished and been recorded (not cancelled).
    fn a_drain_send_that_panics_before_returning_its_future_lets_the_others_finish(engine) {
        let h = engine.harness_with(|b| b.rate_limit(u32::MAX, secs(60)));
        h.enqueue("slow", "chat-slow");
        // b0 goes once slow's send has started; boom, behind it, then panics.
        h.enqueue("b0", "chat-1");
        h.enqueue("boom", "chat-1");
        let gate = Arc::new(tokio::sync::Notify::new());
        let slow_started = Arc::new(tokio::sync::Notify::new());
        let (opened, started) = (Arc::clone(&gate), Arc::clone(&slow_started));
        let rt = runtime();
        let joined = within(
            "a drain whose send panicked waits for the sends beside it",
            DEADLOCK_LIMIT,
            || {
                rt.block_on(async {
                    let outbox = h.outbox.clone();
                    let draining = tokio::spawn(async move {
                        outbox
                            .process_due_async(2, move |item| {
                                let (gate, started) = (Arc::clone(&opened), Arc::clone(&started));
                                let key = item.idempotency_key().to_owned();
                                assert_ne!(key, "boom", "transport bug");
                                async move {
                                    if key == "slow" {
                                        started.notify_one();
                                        gate.notified().await;
                                    } else {
                                        started.notified().await;
                                    }
                                    Ok::<_, SendError>(Some(format!("tr-{key}")))
                                }
                            })
                            .await
                    });
                    while h.outbox.get("boom").unwrap().unwrap().state() != ItemState::Failed {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    gate.notify_one();
                    draining.await
                })
            },
        );
        assert!(joined.unwrap_err().is_panic(), "the panic reaches the caller");
        let code = |key: &str| {
            let item = h.outbox.get(key).unwrap().unwrap();
            (item.state(), item.error_code().map(str::to_owned))
        };
        assert_eq!(code("slow"), (ItemState::Sent, None), "the send beside it finished");
        assert_eq!(code("boom"), (ItemState::Failed, Some(SEND_PANICKED.to_owned())));
    }

    /// `process_due_async` after a send panicked: the sends in flight beside
    /// it finish and are recorded, but no new one starts (as after an
    /// error, and as `process_due`, whose pass ends at the panic): the
    /// messages behind them stay queued, untouched, for the next pass.
    fn a_drain_starts_no_new_send_after_a_send_panicked(engine) {
        let h = engine.harness_with(|b| b.rate_limit(u32::MAX, secs(60)));
        for key in ["a1", "a2", "a3"] {
            h.enqueue(key, "chat-a");
        }
        h.enqueue("boom", "chat-b");
        let gate = Arc::new(tokio::sync::Notify::new());
        let a1_started = Arc::new(tokio::sync::Notify::new());
        let (opened, started) = (Arc::clone(&gate), Arc::clone(&a1_started));
        let sent = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
        let log = Arc::clone(&sent);
        let rt = runtime();
        let joined = within(
            "a drain whose send panicked waits for the send beside it",
            DEADLOCK_LIMIT,
            || {
                rt.block_on(async {
                    let outbox = h.outbox.clone();
                    let draining = tokio::spawn(async move {
                        outbox
                            .process_due_async(2, move |item| {
                                let (gate, log, started) =
                                    (Arc::clone(&opened), Arc::clone(&log), Arc::clone(&started));
                                async move {
                                    let key = item.idempotency_key().to_owned();
                                    log.lock().unwrap().push(key.clone());
                                    if key == "boom" {
                                        // Once a1's send is under way.
                                        started.notified().await;
                                        transport_bug()
                                    } else {
                                        if key == "a1" {
                                            started.notify_one();
                                            gate.notified().await;
                                        }
                                        Ok(Some(format!("tr-{key}")))
                                    }
                                }
                            })
                            .await
                    });
                    while h.outbox.get("boom").unwrap().unwrap().state() != ItemState::Failed {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    gate.notify_one();
                    draining.await
                })
            },
        );
        assert!(joined.unwrap_err().is_panic(), "the panic reaches the caller");
        let mut sent = sent.lock().unwrap().clone();
        sent.sort();
        assert_eq!(sent, ["a1", "boom"], "no new send after the panic");
        assert_eq!(h.outbox.get("a1").unwrap().unwrap().state(), ItemState::Sent);
        for key in ["a2", "a3"] {
            let item = h.outbox.get(key).unwrap().unwrap();
            assert_eq!(
                (item.state(), item.attempts(), item.dispatch_claimed()),
                (ItemState::Queued, 0, false),
                "{key} untouched"
            );
        }
    }

    fn retries_wait_through_the_configured_sleeper(engine) {
        let h = engine.harness();
        h.enqueue("k", "chat-1");
        let calls = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&calls);
        let receipt = runtime()
            .block_on(h.outbox.process_async("k", move |_| {
                let n = counter.fetch_add(1, Ordering::SeqCst);
                async move {
                    if n == 0 {
                        Err(SendError::retryable("http_503"))
                    } else {
                        Ok(None)
                    }
                }
            }))
            .unwrap();
        assert_eq!((receipt.outcome, receipt.attempts), (Outcome::Sent, 2));
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    fn process_due_async_bounds_concurrency_and_still_honours_rate_caps(engine) {
        let h = engine.harness_with(|b| b.rate_limit(2, secs(60)));
        for i in 0..24 {
            h.enqueue(&format!("k{i:02}"), &format!("chat-{}", i % 4));
        }
        let live = Arc::new(AtomicUsize::new(0));
        let peak = Arc::new(AtomicUsize::new(0));
        let (l, p) = (Arc::clone(&live), Arc::clone(&peak));
        let report = runtime()
            .block_on(h.outbox.process_due_async(3, move |item| {
                let (live, peak) = (Arc::clone(&l), Arc::clone(&p));
                async move {
                    let now = live.fetch_add(1, Ordering::SeqCst) + 1;
                    peak.fetch_max(now, Ordering::SeqCst);
                    // Hold the first send until a second one runs beside it:
                    // waiting for the event, not racing a 5 ms sleep against
                    // claims on a loaded machine. A drain that sends one at a
                    // time gives up after the watchdog and fails below.
                    let watchdog = std::time::Instant::now() + Duration::from_secs(10);
                    while peak.load(Ordering::SeqCst) < 2 && std::time::Instant::now() < watchdog {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    live.fetch_sub(1, Ordering::SeqCst);
                    Ok(Some(format!("tr-{}", item.idempotency_key())))
                }
            }))
            .unwrap();
        assert!(peak.load(Ordering::SeqCst) <= 3, "at most 3 in flight");
        assert!(peak.load(Ordering::SeqCst) >= 2, "and really concurrent");
        assert_eq!(
            report.sent, 8,
            "2 per destination per window, 4 destinations"
        );
        assert_eq!(report.deferred, 4, "each destination's third message");
        assert_eq!(report.waiting, 12, "the rest wait behind it, in order");
        let sent = h
            .outbox
            .list_items()
            .unwrap()
            .iter()
            .filter(|i| i.state() == ItemState::Sent)
            .count();
        assert_eq!(sent, 8);
        h.outbox.verify_audit().unwrap();
    }

    /// Every call a tokio bot makes has an async form that behaves as its blocking twin.
    fn the_bot_facing_calls_have_async_forms(engine) {
        use durable_outbox::{ItemFilter, ItemState};
        let h = engine.harness();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let o = &h.outbox;
            let item = o.enqueue_async(msg("a", "chat-1")).await.unwrap();
            assert_eq!(item.state(), ItemState::Queued);
            let many = o
                .enqueue_many_async(vec![msg("b", "chat-2"), msg("c", "chat-2")])
                .await
                .unwrap();
            assert_eq!(many.len(), 2);
            assert_eq!(o.get_async("a").await.unwrap(), Some(item));
            assert_eq!(o.list_items_async().await.unwrap().len(), 3);
            o.process_async("a", |_| async { Ok(Some("7".to_owned())) })
                .await
                .unwrap();
            o.process_async("b", |_| async { Ok(Some("7".to_owned())) })
                .await
                .unwrap();
            let found = o
                .find_by_transport_ref_in_async("chat-2", "7")
                .await
                .unwrap();
            assert_eq!(found.unwrap().idempotency_key(), "b");
            assert!(o.find_by_transport_ref_async("7").await.unwrap().is_some());
            let cancelled = o.cancel_async("c", "ops", "not needed").await.unwrap();
            assert_eq!(cancelled.state(), ItemState::Failed);
            let requeued = o
                .requeue_async("c", "ops", "needed after all")
                .await
                .unwrap();
            assert_eq!(requeued.state(), ItemState::Queued);
            let report = o
                .cancel_where_async(ItemFilter::new().destination("chat-2"), "ops", "closing")
                .await
                .unwrap();
            assert_eq!(report.changed.len(), 1, "c; b was sent");
            let report = o
                .requeue_where_async(ItemFilter::new().state(ItemState::Failed), "ops", "reopen")
                .await
                .unwrap();
            assert_eq!(report.changed.len(), 1);
        });
    }
}

fn transport_bug() -> Result<Option<String>, SendError> {
    panic!("transport bug")
}

/// `process_async` of a fresh item with `send`, which panics: the panic
/// reaches the caller's task, and the item is failed as `send_panicked`,
/// on a chain that verifies.
fn panics_are_recorded_then_resumed<F, Fut>(h: &Harness, send: F)
where
    F: FnMut(durable_outbox::OutboxItem) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<Option<String>, SendError>> + Send,
{
    h.enqueue("k", "chat-1");
    let rt = runtime();
    let joined = rt.block_on(async {
        let outbox = h.outbox.clone();
        tokio::spawn(async move { outbox.process_async("k", send).await }).await
    });
    assert!(
        joined.unwrap_err().is_panic(),
        "the panic reaches the caller's task"
    );
    let item = h.outbox.get("k").unwrap().unwrap();
    assert_eq!(
        (item.state(), item.error_code()),
        (ItemState::Failed, Some(SEND_PANICKED))
    );
    h.outbox.verify_audit().unwrap();
}

on_both_engines! {
    fn the_async_api_works_across_handles_like_the_blocking_one(engine) {
        let a = engine.open_real_clock_with(|b| b);
        let b = engine.open_real_clock_with(|b| b);
        a.enqueue(msg("k", "chat-1")).unwrap();
        let rt = runtime();
        let outcome = within(
            "the lock is never held while an async send runs",
            DEADLOCK_LIMIT,
            || {
                rt.block_on(a.process_async("k", |_| {
                    let b = b.clone();
                    async move {
                        let inner = b
                            .process_async("k", |_| async { panic!("sent twice") })
                            .await
                            .unwrap();
                        assert_eq!(inner.outcome, Outcome::InFlight);
                        Ok(None)
                    }
                }))
            },
        );
        assert_eq!(outcome.unwrap().outcome, Outcome::Sent);
    }
}

// postgres: a claim stuck behind a lock is modelled by holding the directory's
// `outbox.lock`; PostgreSQL has no such file (its equivalent, a row or advisory
// lock held by another session, is not reachable from the public API).
#[test]
fn a_process_async_cancelled_while_claiming_gives_the_claim_back() {
    let h = Harness::new();
    h.enqueue("k", "chat-1");
    // Hold the directory lock so the claim is stuck behind it, like a slow fsync.
    let lock = std::fs::File::open(h.path("outbox.lock")).unwrap();
    lock.lock().unwrap();
    let rt = runtime();
    let timed_out = rt.block_on(async {
        tokio::time::timeout(
            Duration::from_millis(100),
            h.outbox
                .process_async("k", |_| async { Ok(Some("tg-1".into())) }),
        )
        .await
    });
    assert!(
        timed_out.is_err(),
        "the caller gave up while the claim was pending"
    );
    lock.unlock().unwrap();
    // The claim commits after the caller left, then is given back untouched.
    let mut item = h.outbox.get("k").unwrap().unwrap();
    for _ in 0..200 {
        std::thread::sleep(Duration::from_millis(10));
        item = h.outbox.get("k").unwrap().unwrap();
        if !item.dispatch_claimed() && item.attempts() == 0 {
            break;
        }
    }
    assert_eq!(
        (item.state(), item.attempts(), item.dispatch_claimed()),
        (ItemState::Queued, 0, false)
    );
    let r = rt
        .block_on(
            h.outbox
                .process_async("k", |_| async { Ok(Some("tg-2".into())) }),
        )
        .unwrap();
    assert_eq!(
        r.outcome,
        Outcome::Sent,
        "never sent before, so it goes now"
    );
}

/// A runtime shut down while a claim waits on its blocking pool (here behind
/// the directory lock): the claim commits after the runtime stopped taking
/// work, its caller is gone, and the unused claim is still given back
/// untouched, not left to fail as ambiguous later although its send never
/// started. The handle, used on after the runtime, then sends it.
#[test]
fn a_claim_committed_after_its_runtime_shut_down_is_given_back() {
    let h = Harness::new();
    h.enqueue("k", "chat-1");
    let lock = std::fs::File::open(h.path("outbox.lock")).unwrap();
    lock.lock().unwrap();
    let rt = runtime();
    let (asked, asking) = std::sync::mpsc::channel::<()>();
    let outbox = h.outbox.clone();
    rt.spawn(async move {
        asked.send(()).unwrap();
        outbox
            .process_async("k", |_| async { panic!("sent from a runtime shut down") })
            .await
    });
    asking.recv().unwrap();
    // Give the claim time to reach the lock, then stop the runtime without
    // waiting for its blocking pool.
    std::thread::sleep(Duration::from_millis(100));
    rt.shutdown_background();
    lock.unlock().unwrap();
    let mut item = h.outbox.get("k").unwrap().unwrap();
    for _ in 0..500 {
        if !item.dispatch_claimed() && item.attempts() == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
        item = h.outbox.get("k").unwrap().unwrap();
    }
    assert_eq!(
        (item.state(), item.attempts(), item.dispatch_claimed()),
        (ItemState::Queued, 0, false),
        "an unused claim was not given back after its runtime shut down"
    );
    let r = h.outbox.process("k", |_| Ok(Some("tg-1".into()))).unwrap();
    assert_eq!(
        r.outcome,
        Outcome::Sent,
        "never sent before, so it goes now"
    );
}

/// A send running when its runtime is shut down is dropped with the runtime's
/// tasks: it may have left, so it is recorded as `send_cancelled` (failed,
/// never resent), as a send future dropped by its caller is, even though the
/// blocking pool takes no more work by then.
#[test]
fn a_send_running_when_its_runtime_shut_down_is_recorded_as_cancelled() {
    let h = Harness::new();
    h.enqueue("k", "chat-1");
    let rt = runtime();
    let (started, starting) = std::sync::mpsc::channel::<()>();
    let mut started = Some(started);
    let outbox = h.outbox.clone();
    rt.spawn(async move {
        outbox
            .process_async("k", move |_| {
                if let Some(started) = started.take() {
                    started.send(()).unwrap();
                }
                std::future::pending::<Result<Option<String>, SendError>>()
            })
            .await
    });
    starting.recv().unwrap();
    rt.shutdown_background();
    let mut item = h.outbox.get("k").unwrap().unwrap();
    for _ in 0..500 {
        if item.state() != ItemState::Queued {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
        item = h.outbox.get("k").unwrap().unwrap();
    }
    assert_eq!(
        (item.state(), item.error_code()),
        (ItemState::Failed, Some(SEND_CANCELLED)),
        "a send dropped with its runtime was not recorded as cancelled: {item:?}"
    );
    let r = h
        .outbox
        .process("k", |_| panic!("k was sent again"))
        .unwrap();
    assert_eq!(r.outcome, Outcome::Failed);
}

on_both_engines! {
    /// The async forms keep the same guarantees; a send future dropped
    /// mid-flight fails its item as ambiguous (`send_cancelled`), never resent.
    fn async_forms_and_a_dropped_send(engine) {
        use durable_outbox::SEND_CANCELLED;
        let outbox = engine.open_with(|b| b.rate_limit(u32::MAX, secs(60)));
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            outbox.enqueue_async(msg("a", "chat-1")).await.unwrap();
            outbox.enqueue_async(msg("b", "chat-2")).await.unwrap();
            outbox.enqueue_async(msg("c", "chat-3")).await.unwrap();
            let receipt = outbox
                .process_async("a", |_| async { Ok(Some("ref-a".into())) })
                .await
                .unwrap();
            assert_eq!(receipt.outcome, Outcome::Sent);
            // A send that never finishes, dropped by a timeout.
            let (entered_tx, entered_rx) = tokio::sync::oneshot::channel::<()>();
            let mut entered_tx = Some(entered_tx);
            let stuck = outbox.process_async("b", move |_| {
                if let Some(tx) = entered_tx.take() {
                    tx.send(()).ok();
                }
                std::future::pending::<Result<Option<String>, SendError>>()
            });
            tokio::select! {
                _ = stuck => panic!("the send never finishes"),
                _ = entered_rx => {}
            }
            let report = outbox
                .process_due_async(2, |_| async { Ok(None) })
                .await
                .unwrap();
            assert_eq!(report.sent, 1, "only c: b is ambiguous, never resent");
            let found = outbox.find_by_transport_ref_async("ref-a").await.unwrap().unwrap();
            assert_eq!(found.idempotency_key(), "a");
        });
        let b = engine.open().get("b").unwrap().unwrap();
        assert_eq!(
            (b.state(), b.error_code(), b.failure_class()),
            (ItemState::Failed, Some(SEND_CANCELLED), Some(FailureClass::Ambiguous))
        );
    }
}
