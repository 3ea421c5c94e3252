//! A send the worker cuts off at its shutdown deadline may have left: it is
//! recorded as cancelled (`send_cancelled`, never resent). When that record
//! is refused (a write error), the worker says so: `run` returns the error,
//! not a report counting the send as cancelled, and the claim left behind is
//! settled by the next look as any unrecorded claim is: failed as ambiguous,
//! never sent again.
//!
//! File-only by design: the refused write is an injected journal fault.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use durable_outbox::{Error, FailAction, Outbox, OutboxItem, Outcome, SendError};

use crate::harness::{DEADLOCK_LIMIT, msg, runtime};

#[test]
fn a_send_cut_off_at_the_deadline_whose_record_is_refused_is_reported_and_never_resent() {
    let dir = tempfile::tempdir().unwrap();
    // Journal writes: the enqueue (1), the worker's claim (2), the record of
    // the send cut off at the deadline (3), refused.
    let outbox = Outbox::builder(dir.path())
        .failpoint("journal.write", FailAction::ErrorOnHit(3))
        .open()
        .unwrap();
    outbox.enqueue(msg("a", "chat-1")).unwrap();
    let started = Arc::new(AtomicUsize::new(0));
    let sends = Arc::clone(&started);
    let ended = runtime().block_on(async {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let worker = outbox
            .worker(move |_item: OutboxItem| {
                sends.fetch_add(1, Ordering::SeqCst);
                // A send that never answers: only the deadline ends it.
                std::future::pending::<Result<Option<String>, SendError>>()
            })
            .shutdown_timeout(Duration::from_millis(50));
        let running = tokio::spawn(worker.run(async move {
            stopped.await.ok();
        }));
        tokio::time::timeout(DEADLOCK_LIMIT, async {
            while started.load(Ordering::SeqCst) == 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the worker never started the send");
        stop.send(()).unwrap();
        tokio::time::timeout(DEADLOCK_LIMIT, running)
            .await
            .expect("a worker whose record of a cut-off send is refused still stops")
            .unwrap()
    });
    match ended {
        Err(Error::Io { op: "append", .. }) => {}
        other => panic!(
            "the worker did not report the refused record of the send it cut off: {:?}",
            other.map(|report| report.cancelled)
        ),
    }
    assert_eq!(
        outbox.failpoint_hits("journal.write"),
        3,
        "the record of the cut-off send was not the write refused"
    );
    let item = outbox.get("a").unwrap().unwrap();
    assert!(
        item.dispatch_claimed(),
        "the refused record changed the item anyway: {item:?}"
    );
    // The next look settles the claim: its send may have left, so the item
    // fails as ambiguous instead of being sent again, or being reported in
    // flight for as long as the handle lives.
    let looked = outbox
        .process("a", |_| -> Result<Option<String>, SendError> {
            panic!("a send cut off at the deadline was sent again")
        })
        .unwrap();
    assert_eq!(
        looked.outcome,
        Outcome::Failed,
        "the claim of the cut-off send was not settled: {looked:?}"
    );
    assert_eq!(started.load(Ordering::SeqCst), 1);
    outbox.verify_audit().unwrap();
}
