//! The class of an item's failure is stored with the item and in its audit
//! record, so "may have been delivered" is read from the outbox itself.
//!
//! Bodies in `on_both_engines!` run on the file engine and on PostgreSQL
//! (`name::file`, `name::postgres`). File-only here: the `#[test]`s read or
//! edit `outbox.json` and `audit.jsonl` bytes, or forge a crash in the
//! snapshot.

use std::panic::{AssertUnwindSafe, catch_unwind};

use durable_outbox::{
    AMBIGUOUS_AFTER_RESTART, AuditLog, AuditOutcome, Error, FailureClass, ItemState, SEND_PANICKED,
    SendError,
};

use crate::engines::{Kind, on_both_engines};
use crate::harness::{Harness, builder, secs};

const SEED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/seed-v1/outbox.json");

/// Enqueues `key` to a chat of its own (so no earlier message holds it back)
/// and fails its one send with `error`.
fn fail_with(h: &Harness, key: &str, error: SendError) {
    h.enqueue(key, &format!("chat-{key}"));
    let mut error = Some(error);
    h.outbox
        .process(key, |_| Err(error.take().expect("sent once")))
        .unwrap();
}

on_both_engines! {
    fn each_failure_keeps_its_class_across_a_reopen(engine) {
        let h = engine.harness_with(|b| b.max_inline_wait(std::time::Duration::ZERO));
        fail_with(&h, "later", SendError::retryable("http_503"));
        fail_with(&h, "gone", SendError::permanent("chat_not_found"));
        fail_with(&h, "maybe", SendError::ambiguous("read_timeout"));
        h.enqueue("fine", "chat-2");
        h.outbox.process("fine", |_| Ok(None)).unwrap();

        for outbox in [&h.outbox, &h.reopen()] {
            let class = |key: &str| outbox.get(key).unwrap().unwrap().failure_class();
            assert_eq!(class("later"), Some(FailureClass::Retryable));
            assert_eq!(class("gone"), Some(FailureClass::Permanent));
            assert_eq!(class("maybe"), Some(FailureClass::Ambiguous));
            assert_eq!(class("fine"), None, "nothing failed");
        }
        // File: and in the snapshot written by a compaction, not only in the journal.
        if engine.kind == Kind::File {
            h.outbox.compact().unwrap();
            let state = String::from_utf8(h.state_bytes()).unwrap();
            assert!(state.contains(r#""failure_class": "ambiguous""#), "{state}");
        }
    }
}

on_both_engines! {
    fn a_success_or_a_requeue_clears_the_class_and_a_cancel_sets_none(engine) {
        let h = engine.harness_with(|b| b.max_inline_wait(std::time::Duration::ZERO));
        fail_with(&h, "k", SendError::retryable("http_503"));
        h.clock.advance(secs(3600));
        h.outbox.process("k", |_| Ok(None)).unwrap();
        assert_eq!(h.outbox.get("k").unwrap().unwrap().failure_class(), None);

        fail_with(&h, "amb", SendError::ambiguous("reset_after_write"));
        let requeued = h
            .outbox
            .requeue("amb", "ops", "checked with the user")
            .unwrap();
        assert_eq!(requeued.failure_class(), None);

        h.enqueue("c", "chat-3");
        let cancelled = h.outbox.cancel("c", "ops", "wrong chat").unwrap();
        assert_eq!(
            (cancelled.state(), cancelled.failure_class()),
            (ItemState::Failed, None),
            "an operator's cancel is not a delivery failure"
        );
    }

    fn a_panicking_send_is_stored_as_ambiguous(engine) {
        let h = engine.harness();
        h.enqueue("k", "chat-1");
        let panicked = catch_unwind(AssertUnwindSafe(|| {
            h.outbox.process("k", |_| panic!("transport bug"))
        }));
        assert!(panicked.is_err());
        let item = h.reopen().get("k").unwrap().unwrap();
        assert_eq!(item.error_code(), Some(SEND_PANICKED));
        assert_eq!(item.failure_class(), Some(FailureClass::Ambiguous));
    }
}

/// The seed file holds a claim left by a process that died mid-send.
#[test]
fn a_crashed_claim_is_stored_as_ambiguous_and_seed_items_have_no_class() {
    let h = Harness::new();
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(SEED, dir.path().join("outbox.json")).unwrap();
    let outbox = builder(dir.path(), &h.clock).open().unwrap();
    let failed = outbox.get("seed-failed").unwrap().unwrap();
    assert_eq!(
        (failed.state(), failed.failure_class()),
        (ItemState::Failed, None),
        "written before the class existed: unknown, not guessed"
    );
    outbox
        .process("seed-claimed", |_| panic!("resent a claimed message"))
        .unwrap();
    let item = outbox.get("seed-claimed").unwrap().unwrap();
    assert_eq!(item.error_code(), Some(AMBIGUOUS_AFTER_RESTART));
    assert_eq!(item.failure_class(), Some(FailureClass::Ambiguous));
}

#[test]
fn the_audit_record_carries_the_class_and_old_records_keep_their_bytes() {
    let h = Harness::with(|b| b.max_inline_wait(std::time::Duration::ZERO));
    fail_with(&h, "later", SendError::retryable("http_503"));
    fail_with(&h, "maybe", SendError::ambiguous("read_timeout"));
    let records = AuditLog::read(h.path("audit.jsonl")).unwrap();
    let class_of = |key: &str, outcome: AuditOutcome| {
        records
            .iter()
            .find(|r| r.idempotency_key == key && r.outcome == outcome)
            .expect("record")
            .failure_class
    };
    assert_eq!(
        class_of("later", AuditOutcome::Retrying),
        Some(FailureClass::Retryable)
    );
    assert_eq!(
        class_of("maybe", AuditOutcome::Failed),
        Some(FailureClass::Ambiguous)
    );
    assert_eq!(class_of("maybe", AuditOutcome::Queued), None);
    // A record without a class is written exactly as before the field existed:
    // no key at all, so logs from older releases keep verifying.
    let text = String::from_utf8(h.audit_bytes()).unwrap();
    let queued_line = text.lines().next().unwrap();
    assert!(!queued_line.contains("failure_class"), "{queued_line}");
    let failed_line = text.lines().last().unwrap();
    assert!(
        failed_line
            .contains(r#""error_code":"read_timeout","failure_class":"ambiguous","grant_id""#),
        "canonical (sorted) position: {failed_line}"
    );
    h.outbox.verify_audit().unwrap();
    verify_with_python(&h);
}

/// `fixtures/verify_audit.py` re-verifies a log holding records with and
/// without the new field.
fn verify_with_python(h: &Harness) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/verify_audit.py");
    match std::process::Command::new("python3")
        .arg(script)
        .arg(h.path("audit.jsonl"))
        .output()
    {
        Err(e) if std::env::var_os("CI").is_some() => {
            panic!("python3 is required in CI to check the documented verifier: {e}")
        }
        Err(e) => eprintln!("skipped the Python verifier: python3 is not available ({e})"),
        Ok(out) => assert!(
            out.status.success(),
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

#[test]
fn an_unknown_class_in_the_state_file_is_refused_by_name() {
    let h = Harness::new();
    fail_with(&h, "k", SendError::permanent("chat_not_found"));
    h.outbox.compact().unwrap();
    let path = h.path("outbox.json");
    let h = Harness {
        outbox: builder(h.dir.path(), &h.clock).open().unwrap(),
        ..h
    };
    drop(h.outbox);
    let text = std::fs::read_to_string(&path).unwrap();
    let edited = text.replace(
        r#""failure_class": "permanent""#,
        r#""failure_class": "maybe""#,
    );
    assert_ne!(text, edited);
    std::fs::write(&path, &edited).unwrap();
    let err = builder(h.dir.path(), &h.clock).open().unwrap_err();
    match &err {
        Error::InvalidRecord { location, .. } => {
            assert!(location.contains("failure_class"), "{err}");
        }
        other => panic!("expected InvalidRecord, got {other:?}"),
    }
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        edited,
        "left as it was"
    );
}

#[cfg(feature = "tokio")]
on_both_engines! {
    fn a_cancelled_async_send_is_stored_as_ambiguous(engine) {
        use std::time::Duration;
        let h = engine.harness();
        h.enqueue("k", "chat-1");
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        // Drop the future once the send is running (a timer could fire before the
        // claim commits on a loaded machine, and then nothing was sent at all).
        let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
        let started_tx = std::sync::Mutex::new(Some(started_tx));
        let dropped_mid_send = rt.block_on(async {
            let process = h.outbox.process_async("k", move |_| {
                let started = started_tx.lock().unwrap().take();
                async move {
                    if let Some(started) = started {
                        let _ = started.send(());
                    }
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    Ok(None)
                }
            });
            tokio::pin!(process);
            tokio::select! {
                _ = &mut process => false,
                _ = started_rx => true,
            }
        });
        assert!(
            dropped_mid_send,
            "the send started and its future was dropped"
        );
        // Recorded on the blocking pool: wait for it, under a generous watchdog.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let item = loop {
            let item = h.outbox.get("k").unwrap().unwrap();
            if item.state() != ItemState::Queued {
                break item;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "a cancelled send must be recorded as ambiguous"
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(item.failure_class(), Some(FailureClass::Ambiguous));
    }
}
