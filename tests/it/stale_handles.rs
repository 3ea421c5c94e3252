//! Several handles on one directory, each with its own cached view: no handle
//! may act on a stale view in a way that loses or duplicates a message. Each test
//! reproduces a defect found in review, with the scenario that showed it.
//!
//! File-only by design: each defect was in one handle's cached view of the
//! journal or history segments, reproduced with file failpoints.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use durable_outbox::{FailAction, ManualClock, NewMessage, Outbox, Outcome};

fn msg(key: &str, size: usize) -> NewMessage {
    NewMessage {
        idempotency_key: key.into(),
        connector: "telegram".into(),
        grant_id: "bot-1".into(),
        destination: format!("chat-{key}"),
        content: "x".repeat(size),
        ..Default::default()
    }
}

#[test]
fn a_handle_never_zeroes_journal_entries_another_handle_appended() {
    let dir = tempfile::tempdir().unwrap();
    let a = Outbox::open(dir.path()).unwrap();
    let b = Outbox::builder(dir.path())
        .compact_on_open(false)
        .open()
        .unwrap();
    b.enqueue(msg("b-0", 10)).unwrap(); // b's cursor knows the 1 MiB preallocation
    for i in 0..20 {
        a.enqueue(msg(&format!("a-{i}"), 100 * 1024)).unwrap(); // a grows the journal
    }
    b.enqueue(msg("b-1", 10)).unwrap(); // must not "extend" from its stale length
    drop((a, b));
    let c = Outbox::builder(dir.path())
        .compact_on_open(false)
        .open()
        .unwrap();
    let missing: Vec<_> = (0..20)
        .filter(|i| c.get(&format!("a-{i}")).unwrap().is_none())
        .collect();
    assert!(
        missing.is_empty(),
        "acknowledged enqueues lost: {missing:?}"
    );
    assert!(c.get("b-1").unwrap().is_some());
}

#[test]
fn a_history_segment_written_by_another_handle_is_never_overwritten_or_missed() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::at("2026-01-01T00:00:00Z").unwrap();
    let open = |fail: bool| {
        let b = Outbox::builder(dir.path())
            .clock(clock.clone())
            .history_after(Duration::from_secs(3600));
        if fail {
            b.failpoint("state.write", FailAction::ErrorOnHit(1))
        } else {
            b
        }
        .open()
        .unwrap()
    };
    let (a, b) = (open(true), open(false));
    let sends = AtomicUsize::new(0);
    let send = |_: &durable_outbox::OutboxItem| {
        sends.fetch_add(1, Ordering::SeqCst);
        Ok(Some("ref".to_string()))
    };
    a.enqueue(msg("x", 10)).unwrap();
    a.process("x", send).unwrap();
    clock.advance(Duration::from_secs(7200));
    // a writes a history segment, then fails to write the snapshot: the
    // generation does not move, so b has no reason to look at history.
    assert!(a.compact().is_err());
    b.enqueue(msg("y", 10)).unwrap();
    b.process("y", send).unwrap();
    clock.advance(Duration::from_secs(7200));
    b.compact().unwrap();
    assert_eq!(sends.load(Ordering::SeqCst), 2);
    // a must still know y, or it would accept it as new and send it again.
    assert!(a.get("y").unwrap().is_some(), "a lost sight of y");
    a.enqueue(msg("y", 10)).unwrap();
    assert_eq!(a.process("y", send).unwrap().outcome, Outcome::Sent);
    assert_eq!(sends.load(Ordering::SeqCst), 2, "y was sent a second time");
}

#[test]
fn a_failed_batch_claim_does_not_declare_another_threads_send_dead() {
    let dir = tempfile::tempdir().unwrap();
    // Commit 1: the enqueue; 2: k's claim; 3: the drain's batch claim (fails cleanly).
    let o = Outbox::builder(dir.path())
        .failpoint("journal.write", FailAction::ErrorOnHit(3))
        .open()
        .unwrap();
    o.enqueue_many(vec![msg("j", 10), msg("k", 10)]).unwrap();
    let (entered_tx, entered_rx) = mpsc::channel::<()>();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let sender = {
        let o = o.clone();
        std::thread::spawn(move || {
            o.process("k", |_| {
                entered_tx.send(()).unwrap();
                release_rx.recv().unwrap();
                Ok(Some("tg-1".into()))
            })
        })
    };
    entered_rx.recv().unwrap();
    assert!(o.process_due(|_| panic!("nothing should be sent")).is_err());
    let meanwhile = o
        .process("k", |_| panic!("resent while in flight"))
        .unwrap();
    assert_eq!(
        meanwhile.outcome,
        Outcome::InFlight,
        "a live send must not be failed as ambiguous"
    );
    release_tx.send(()).unwrap();
    let first = sender.join().unwrap().unwrap();
    assert_eq!(
        (first.outcome, first.transport_ref.as_deref()),
        (Outcome::Sent, Some("tg-1"))
    );
}

#[test]
fn a_failed_compaction_after_a_commit_does_not_fail_the_committed_call() {
    let dir = tempfile::tempdir().unwrap();
    let o = Outbox::builder(dir.path())
        .failpoint("state.write", FailAction::Error)
        .open()
        .unwrap();
    // Big items push the journal past the compaction threshold; every snapshot
    // write then fails cleanly, as on a disk too full for one.
    for n in 0..60 {
        let key = format!("big-{n}");
        o.enqueue(msg(&key, 200 * 1024))
            .unwrap_or_else(|e| panic!("enqueue {key}: {e}"));
        o.cancel(&key, "ops", "bulk cleanup").unwrap();
    }
    o.enqueue(msg("m", 10)).unwrap();
    let mut sent = false;
    let receipt = o
        .process("m", |_| {
            sent = true;
            Ok(None)
        })
        .unwrap();
    assert!(sent && receipt.outcome == Outcome::Sent);
}
