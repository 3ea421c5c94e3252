//! A finish applies only to the claim it holds, never to "the claim of its
//! owner id". On PostgreSQL a handle whose owner session was cut takes its
//! owner lock again under the same id, so while its first send (attempt n)
//! still runs, another handle may declare that claim ambiguous, an operator
//! requeue the item, and the same handle claim it again and start a resend.
//! When attempt n then finishes:
//!
//! - delivered: the item is not marked `sent` under the resend; a
//!   `late_delivery` record names attempt n, and the resend finishes as its
//!   own (`sent`, with its own transport ref);
//! - a retryable failure: the item is not put back in the queue while the
//!   resend runs, so no third send starts, on any handle, at any later time;
//!
//! and in both cases the handle still sending the resend does not take its
//! own newer claim for an orphan once attempt n is over. The transport sees
//! exactly two sends: the lost one and the one the operator authorised.
//!
//! PostgreSQL only: on the file engine a handle never loses its owner lock,
//! so it cannot hold two claims of one item; the identity check itself is
//! unit-tested in `src/rules/tests.rs`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use durable_outbox::{
    AMBIGUOUS_AFTER_RESTART, AuditOutcome, DeliveryReceipt, ItemState, Outbox, Outcome, SendError,
};

use crate::engines::EngineUnderTest;
use crate::harness::{DEADLOCK_LIMIT, msg, within};
use crate::late_deliveries::{note, outcomes, verified_records};
use crate::postgres_outbox::cut_owner_sessions;

/// What the first send (attempt n) returns when it is let go.
type Outcome1 = Result<Option<String>, SendError>;

/// What happened, for the assertions.
struct Run {
    engine: EngineUnderTest,
    /// The handle that sent both attempts, and an operator's handle.
    worker: Outbox,
    operator: Outbox,
    /// The first send's receipt, and the resend's.
    first: DeliveryReceipt,
    resend: DeliveryReceipt,
    /// Sends the transport saw while the resend was still running, after
    /// the first one finished (drains on both handles, long after any backoff).
    sends_while_resending: usize,
    /// Sends the transport saw in all.
    sends: usize,
}

/// A send that counts, tells `entered` it started, and returns `outcome`
/// once `release` says so (only the first time: a send it makes again, which
/// the tests forbid, returns at once so the test can say so).
fn held_send(
    sends: &AtomicUsize,
    entered: mpsc::Sender<()>,
    release: mpsc::Receiver<()>,
    outcome: Outcome1,
) -> impl FnMut(&durable_outbox::OutboxItem) -> Outcome1 + '_ {
    let mut release = Some(release);
    move |_| {
        sends.fetch_add(1, Ordering::SeqCst);
        let _ = entered.send(());
        if let Some(release) = release.take() {
            // Let go, or the test gave up (the sender is gone): return either way.
            let _ = release.recv();
        }
        outcome.clone()
    }
}

/// Runs the scenario of the module docs; the first send returns `first`.
fn first_send_finishes_while_its_handle_resends(first: Outcome1) -> Option<Run> {
    let engine = EngineUnderTest::postgres()?;
    // The clock stands still: the resend is claimed in the same microsecond
    // as the lost claim, in the same attempt (a requeue starts the count
    // again), so only the claim's identity tells them apart. Room in the cap
    // for the resend in that second.
    let worker = engine.open_with(|b| b.rate_limit(10, Duration::from_secs(1)));
    let operator = engine.open();
    worker.enqueue(msg("k", "chat-1")).unwrap();
    let sends = AtomicUsize::new(0);
    let (first_entered, first_started) = mpsc::channel();
    let (first_release, first_held) = mpsc::channel::<()>();
    let (resend_entered, resend_started) = mpsc::channel();
    let (resend_release, resend_held) = mpsc::channel::<()>();
    let (first, resend, sends_while_resending) = within(
        "a finish applies only to the claim it holds",
        DEADLOCK_LIMIT,
        || {
            std::thread::scope(|scope| {
                let (worker, operator, engine, sends) = (&worker, &operator, &engine, &sends);
                let first_thread = scope.spawn(move || {
                    worker.process("k", held_send(sends, first_entered, first_held, first))
                });
                let mut resend_thread = None;
                // A failed assertion must still let both held sends return,
                // or the test would end at the watchdog without its message.
                let checked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    first_started.recv().unwrap();
                    // The worker's session is cut mid-send; the operator's
                    // handle declares the claim ambiguous and requeues the item.
                    cut_owner_sessions(engine);
                    let declared = operator.process("k", |_| panic!("never resent")).unwrap();
                    assert_eq!(
                        declared.error_code.as_deref(),
                        Some(AMBIGUOUS_AFTER_RESTART)
                    );
                    operator.requeue("k", "alice", "send it again").unwrap();
                    // The same handle (same owner id, its lock taken again)
                    // claims it again and starts the resend.
                    resend_thread = Some(scope.spawn(move || {
                        worker.process(
                            "k",
                            held_send(sends, resend_entered, resend_held, Ok(Some("tg-2".into()))),
                        )
                    }));
                    resend_started.recv().unwrap();
                    let resending = operator.get("k").unwrap().unwrap();
                    assert!(resending.dispatch_claimed(), "the resend holds the item");
                    // Attempt n finishes while the resend runs.
                    first_release.send(()).unwrap();
                    while !first_thread.is_finished() {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    let held = operator.get("k").unwrap().unwrap();
                    assert_eq!(
                        (
                            held.state(),
                            held.dispatch_claimed(),
                            held.next_attempt_at()
                        ),
                        (ItemState::Queued, true, None),
                        "the first send's finish left the resend's claim as it was: {held:?}"
                    );
                    // Long after any backoff, drains on both handles find the
                    // item in flight: nothing sends it a third time, and the
                    // worker does not take its own resend for an orphan.
                    engine.clock.advance(Duration::from_secs(3_600));
                    let before = sends.load(Ordering::SeqCst);
                    for (name, handle) in [("operator", operator), ("worker", worker)] {
                        let report = handle
                            .process_due(|_| {
                                sends.fetch_add(1, Ordering::SeqCst);
                                Ok(Some("tg-3".into()))
                            })
                            .unwrap();
                        assert_eq!(
                            (report.sent, report.failed, report.retried),
                            (0, 0, 0),
                            "the {name}'s drain: {report:?}"
                        );
                        let item = operator.get("k").unwrap().unwrap();
                        assert!(
                            item.dispatch_claimed() && item.state() == ItemState::Queued,
                            "after the {name}'s drain the resend still holds the item: {item:?}"
                        );
                    }
                    sends.load(Ordering::SeqCst) - before
                }));
                let _ = first_release.send(());
                let _ = resend_release.send(());
                let first = first_thread.join().unwrap();
                let resend = resend_thread.map(|t| t.join().unwrap());
                match checked {
                    Ok(sends_while_resending) => (
                        first.unwrap(),
                        resend.expect("the resend ran").unwrap(),
                        sends_while_resending,
                    ),
                    Err(panic) => std::panic::resume_unwind(panic),
                }
            })
        },
    );
    Some(Run {
        engine,
        worker,
        operator,
        first,
        resend,
        sends_while_resending,
        sends: sends.load(Ordering::SeqCst),
    })
}

impl Run {
    /// What both cases share: two sends in all, none while the resend ran,
    /// the resend recorded as the item's delivery, nothing sent afterwards.
    fn resend_is_the_delivery(&self) {
        assert_eq!(self.sends_while_resending, 0, "no third send");
        assert_eq!(self.sends, 2, "the lost send and the authorised resend");
        assert_eq!(
            (self.resend.outcome, self.resend.transport_ref.as_deref()),
            (Outcome::Sent, Some("tg-2")),
            "{:?}",
            self.resend
        );
        let item = self.operator.get("k").unwrap().unwrap();
        assert_eq!(
            (item.state(), item.transport_ref(), item.attempts()),
            (ItemState::Sent, Some("tg-2"), 1)
        );
        let drained = self
            .worker
            .process_due(|_| panic!("a sent item is never sent again"))
            .unwrap();
        assert_eq!(drained.sent, 0);
    }
}

#[test]
fn a_late_delivery_of_a_lost_claim_does_not_mark_its_handles_resend_sent() {
    let Some(run) = first_send_finishes_while_its_handle_resends(Ok(Some("tg-1".into()))) else {
        return;
    };
    assert_eq!(
        (run.first.outcome, run.first.transport_ref.as_deref()),
        (Outcome::Sent, Some("tg-1")),
        "the first send's receipt says it delivered: {:?}",
        run.first
    );
    run.resend_is_the_delivery();
    let records = verified_records(&run.engine, &run.operator, "k");
    assert_eq!(
        outcomes(&records),
        ["queued", "failed", "requeued", "late_delivery", "sent"]
    );
    let late = &records[3];
    assert_eq!(late.outcome, AuditOutcome::LateDelivery);
    assert_eq!(late.transport_ref.as_deref(), Some("tg-1"));
    assert_eq!(late.attempts, 1, "names the first send's attempt");
    assert_eq!(run.first.audit_id.as_deref(), Some(late.audit_id.as_str()));
    assert!(
        note(late).contains("claimed again") && note(late).contains("this send: attempt 1"),
        "{late:?}"
    );
    let sent = &records[4];
    assert_eq!(sent.transport_ref.as_deref(), Some("tg-2"));
    assert_eq!(run.resend.audit_id.as_deref(), Some(sent.audit_id.as_str()));
}

#[test]
fn a_retryable_failure_of_a_lost_claim_does_not_requeue_its_handles_resend() {
    let Some(run) =
        first_send_finishes_while_its_handle_resends(Err(SendError::retryable("http_503")))
    else {
        return;
    };
    assert_eq!(
        (run.first.outcome, run.first.audit_id.as_deref()),
        (Outcome::InFlight, None),
        "the first send's receipt says the item is being sent, nothing recorded: {:?}",
        run.first
    );
    run.resend_is_the_delivery();
    let records = verified_records(&run.engine, &run.operator, "k");
    assert_eq!(
        outcomes(&records),
        ["queued", "failed", "requeued", "sent"],
        "the failure of a send that no longer held the item changed nothing"
    );
    assert_eq!(records[3].transport_ref.as_deref(), Some("tg-2"));
}
