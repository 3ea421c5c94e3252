//! Exactly once where the platform allows it: under `idempotent_transport`, an
//! ambiguous outcome is resent with the item's stable transaction id (which the
//! platform deduplicates); everywhere else at-most-once stands unchanged.
//!
//! Bodies in `on_both_engines!` run on the file engine and on PostgreSQL
//! (`name::file`, `name::postgres`); every body here runs on both.

use std::sync::{Arc, Mutex};

use durable_outbox::{AMBIGUOUS_AFTER_RESTART, AuditOutcome, Error, Outcome, SendError};

use crate::engines::{EngineUnderTest, on_both_engines};
use crate::harness::{Harness, msg, secs, uncapped};

const WINDOW: std::time::Duration = std::time::Duration::from_secs(3600);

/// A harness whose `telegram` connector (the one `msg` uses) is idempotent.
/// Uncapped: a resend follows its ambiguous attempt at the same instant, and
/// an ambiguous attempt counts against the cap.
fn idempotent(engine: &EngineUnderTest) -> Harness {
    engine.harness_with(|b| uncapped(b).idempotent_transport("telegram", WINDOW))
}

/// A send that answers `ambiguous` `failures` times, then delivers; it records
/// every transaction id it was handed.
fn flaky(
    failures: usize,
    seen: &Arc<Mutex<Vec<String>>>,
) -> impl FnMut(&durable_outbox::OutboxItem) -> Result<Option<String>, SendError> {
    let seen = Arc::clone(seen);
    move |item| {
        let mut seen = seen.lock().unwrap();
        seen.push(item.transaction_id());
        if seen.len() <= failures {
            Err(SendError::ambiguous("timeout_after_request_sent"))
        } else {
            Ok(Some(format!("ev-{}", item.transaction_id())))
        }
    }
}

/// The notes of the `retrying` audit records.
fn resend_notes(h: &Harness) -> Vec<String> {
    h.audit_records()
        .into_iter()
        .filter(|r| r.outcome == AuditOutcome::Retrying)
        .map(|r| r.note.unwrap_or_default())
        .collect()
}

on_both_engines! {
    fn an_ambiguous_send_is_resent_with_the_same_transaction_id(engine) {
        let h = idempotent(engine);
        h.enqueue("k", "chat-1");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let receipt = h.outbox.process("k", flaky(1, &seen)).unwrap();

        assert_eq!(receipt.outcome, Outcome::Sent);
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 2);
        assert_eq!(seen[0], seen[1], "a resend must reuse the transaction id");
        let item = h.outbox.get("k").unwrap().unwrap();
        assert_eq!(item.attempts(), 2);
        assert_eq!(
            h.audit_outcomes(),
            ["queued:k", "retrying:k", "sent:k"],
            "the resend is on the record"
        );
        let notes = resend_notes(&h);
        assert!(
            notes[0].contains("timeout_after_request_sent") && notes[0].contains("transaction id"),
            "{notes:?}"
        );
        h.outbox.verify_audit().unwrap();
    }

    fn past_the_dedup_window_an_ambiguous_send_fails(engine) {
        let h = idempotent(engine);
        h.enqueue("k", "chat-1");
        // The platform may have forgotten a transaction id from that long ago.
        h.clock.advance(WINDOW + secs(1));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let receipt = h.outbox.process("k", flaky(1, &seen)).unwrap();

        assert_eq!(receipt.outcome, Outcome::Failed);
        assert_eq!(seen.lock().unwrap().len(), 1);
    }

    fn a_claim_whose_worker_died_is_resent_under_its_transaction_id(engine) {
        let h = idempotent(engine);
        h.enqueue("k", "chat-1");
        engine.forge_dead_claim("k");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let receipt = h.outbox.process("k", flaky(0, &seen)).unwrap();

        assert_eq!(receipt.outcome, Outcome::Sent);
        let item = h.outbox.get("k").unwrap().unwrap();
        assert_eq!(item.attempts(), 2);
        assert_eq!(seen.lock().unwrap().as_slice(), [item.transaction_id()]);
        assert!(resend_notes(&h)[0].contains(AMBIGUOUS_AFTER_RESTART));
    }
}

on_both_engines! {
    fn other_connectors_keep_at_most_once(engine) {
        let h = engine.harness_with(|b| b.idempotent_transport("matrix", WINDOW));
        h.enqueue("k", "chat-1"); // connector "telegram"
        let seen = Arc::new(Mutex::new(Vec::new()));
        let receipt = h.outbox.process("k", flaky(1, &seen)).unwrap();

        assert_eq!(receipt.outcome, Outcome::Failed);
        assert_eq!(
            receipt.error_code.as_deref(),
            Some("timeout_after_request_sent")
        );
        assert_eq!(seen.lock().unwrap().len(), 1, "never resent");
        let again = h.outbox.process("k", |_| panic!("resent")).unwrap();
        assert_eq!(again.outcome, Outcome::Failed);
    }

    fn with_no_attempts_left_an_ambiguous_send_fails_with_its_own_code(engine) {
        let h = engine.harness_with(|b| {
            uncapped(b)
                .idempotent_transport("telegram", WINDOW)
                .max_attempts(2)
        });
        h.enqueue("k", "chat-1");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let receipt = h.outbox.process("k", flaky(5, &seen)).unwrap();

        assert_eq!(receipt.outcome, Outcome::Failed);
        assert_eq!(
            receipt.error_code.as_deref(),
            Some("timeout_after_request_sent")
        );
        assert_eq!(seen.lock().unwrap().len(), 2);
    }

    fn without_the_opt_in_a_dead_claim_still_fails_as_ambiguous(engine) {
        let h = engine.harness();
        h.enqueue("k", "chat-1");
        engine.forge_dead_claim("k");
        let receipt = h.outbox.process("k", |_| panic!("resent")).unwrap();
        assert_eq!(receipt.outcome, Outcome::Failed);
        assert_eq!(receipt.error_code.as_deref(), Some(AMBIGUOUS_AFTER_RESTART));
    }

    fn a_transaction_id_is_stable_across_handles_and_pinned(engine) {
        let h = engine.harness();
        let item = h.outbox.enqueue(msg("order-17", "chat-1")).unwrap();
        // sha256("durable-outbox transaction id 1\norder-17"), first 16 bytes.
        assert_eq!(
            item.transaction_id(),
            "do1-d85ff2e45b9260e4afef877ba6ae6a82"
        );
        let reopened = h.reopen().get("order-17").unwrap().unwrap();
        assert_eq!(reopened.transaction_id(), item.transaction_id());
        let other = h.outbox.enqueue(msg("order-18", "chat-1")).unwrap();
        assert_ne!(other.transaction_id(), item.transaction_id());
    }
}

#[cfg(feature = "tokio")]
on_both_engines! {
    fn a_send_future_dropped_mid_flight_goes_back_to_the_queue(engine) {
        let h = idempotent(engine);
        h.enqueue("k", "chat-1");
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        crate::harness::drop_mid_send(&runtime, &h.outbox, "k", || {});
        // The cancellation is recorded on the blocking pool; wait for it.
        let watchdog = std::time::Instant::now() + crate::harness::DEADLOCK_LIMIT;
        let mut item = h.outbox.get("k").unwrap().unwrap();
        while item.dispatch_claimed() {
            assert!(
                std::time::Instant::now() < watchdog,
                "watchdog: a cancelled send is recorded"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
            item = h.outbox.get("k").unwrap().unwrap();
        }
        assert_eq!(item.state(), durable_outbox::ItemState::Queued);
        assert_eq!(item.error_code(), Some(durable_outbox::SEND_CANCELLED));
        let receipt = h.outbox.process("k", |_| Ok(Some("ev".into()))).unwrap();
        assert_eq!(receipt.outcome, Outcome::Sent);
    }
}

on_both_engines! {
    fn bad_idempotent_transport_settings_are_refused(engine) {
        for builder in [
            engine.builder().idempotent_transport(" ", WINDOW),
            engine
                .builder()
                .idempotent_transport("matrix", std::time::Duration::ZERO),
        ] {
            let e = builder.open().unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::InvalidConfig {
                        setting: "idempotent_transport",
                        ..
                    }
                ),
                "{e}"
            );
        }
        assert!(engine.is_untouched(), "nothing written");
    }
}
