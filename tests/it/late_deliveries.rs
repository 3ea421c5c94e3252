//! A send whose claim was lost while it ran (its owner's PostgreSQL session
//! cut, another handle declared it ambiguous) and that finishes *after* an
//! operator acted on the item is accounted for: a delivery is on the audit
//! chain with its transport ref, whatever the item had become, and an item
//! requeued but not resent yet becomes `sent` instead of going out a second
//! time; a send that certainly failed after the item was requeued changes
//! nothing and leaves no record (no message to account for), and the
//! requeued send goes out once. Every chain still verifies, online, through the operator tool's
//! cross-check of records against items, and offline from an export.
//!
//! PostgreSQL only: on the file engine a claim is lost only if the state files
//! are replaced behind the handle; the rules for every branch are unit-tested
//! in `src/rules/tests.rs`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use durable_outbox::{
    AMBIGUOUS_AFTER_RESTART, AuditOutcome, AuditRecord, CANCELLED, ItemState, Outbox, Outcome,
    SendError,
};

use crate::engines::EngineUnderTest;
use crate::harness::{DEADLOCK_LIMIT, msg, within};
use crate::postgres_outbox::{cut_owner_sessions, lose_the_claim_while_sending};

/// What a test sets up: the worker whose send outlives its claim, and an
/// operator's handle on the same outbox.
struct Hosts {
    engine: EngineUnderTest,
    worker: Outbox,
    operator: Outbox,
}

fn hosts() -> Option<Hosts> {
    let engine = EngineUnderTest::postgres()?;
    // The clock stands still: room for a resend in the same second as the
    // send it repeats (stored, so every handle has it).
    let worker = engine.open_with(|b| b.rate_limit(10, Duration::from_secs(1)));
    let operator = engine.open();
    worker.enqueue(msg("k", "chat-1")).unwrap();
    Some(Hosts {
        engine,
        worker,
        operator,
    })
}

impl Hosts {
    /// The worker's send of "k" delivers `reference`; while it runs its owner
    /// session is cut, the operator's handle declares the claim ambiguous,
    /// then `meanwhile` acts on the item. Returns the worker's receipt and the
    /// number of times its send ran.
    fn late_delivery(
        &self,
        reference: &str,
        meanwhile: impl FnOnce(&Outbox),
    ) -> (durable_outbox::DeliveryReceipt, usize) {
        self.late_send(Ok(Some(reference.into())), meanwhile)
    }

    /// [`late_delivery`](Self::late_delivery) for a send that returns `outcome`.
    fn late_send(
        &self,
        outcome: Result<Option<String>, SendError>,
        meanwhile: impl FnOnce(&Outbox),
    ) -> (durable_outbox::DeliveryReceipt, usize) {
        let mut failed = None;
        let (late, sends) = lose_the_claim_while_sending(&self.worker, "k", outcome, || {
            // A failed assertion here must still let the held send return,
            // or the test would end at the watchdog without its message.
            failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                cut_owner_sessions(&self.engine);
                let declared = self
                    .operator
                    .process("k", |_| panic!("never resent"))
                    .unwrap();
                assert_eq!(
                    declared.error_code.as_deref(),
                    Some(AMBIGUOUS_AFTER_RESTART)
                );
                meanwhile(&self.operator);
            }))
            .err();
        });
        if let Some(panic) = failed {
            std::panic::resume_unwind(panic);
        }
        (late.unwrap(), sends)
    }

    /// The records of "k", once the chain checked out every way (see
    /// [`verified_records`]).
    fn verified_records(&self) -> Vec<AuditRecord> {
        verified_records(&self.engine, &self.operator, "k")
    }

    /// Drains the outbox with a send that counts; returns how many it made.
    fn drain(&self) -> usize {
        let sends = AtomicUsize::new(0);
        self.operator
            .process_due(|_| {
                sends.fetch_add(1, Ordering::SeqCst);
                Ok(Some("resent".into()))
            })
            .unwrap();
        sends.load(Ordering::SeqCst)
    }
}

/// Checks the chain every way a user can: `verify_audit`, and with the
/// operator tool (the real binary), its cross-check of records against items
/// and an export verified offline. Returns the records of `key`.
pub(crate) fn verified_records(
    engine: &EngineUnderTest,
    outbox: &Outbox,
    key: &str,
) -> Vec<AuditRecord> {
    outbox.verify_audit().unwrap();
    #[cfg(feature = "cli")]
    verify_with_the_tool(engine, outbox);
    #[cfg(not(feature = "cli"))]
    let _ = engine;
    outbox.history(key).unwrap()
}

#[cfg(feature = "cli")]
fn verify_with_the_tool(engine: &EngineUnderTest, outbox: &Outbox) {
    const TOOL: &str = env!("CARGO_BIN_EXE_durable-outbox");
    let url = engine.url();
    let verify = std::process::Command::new(TOOL)
        .args(["verify", &url])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&verify.stdout);
    assert!(
        verify.status.success() && said.contains("verified"),
        "durable-outbox verify: {said}{}",
        String::from_utf8_lossy(&verify.stderr)
    );
    let export = std::process::Command::new(TOOL)
        .args(["export", &url, "--audit"])
        .output()
        .unwrap();
    assert!(export.status.success(), "{export:?}");
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), &export.stdout).unwrap();
    let offline = durable_outbox::AuditLog::verify(file.path()).expect("verifies offline");
    assert_eq!(offline.records, outbox.audit_head().unwrap().seq);
}

pub(crate) fn outcomes(records: &[AuditRecord]) -> Vec<&'static str> {
    records.iter().map(|r| r.outcome.as_str()).collect()
}

pub(crate) fn note(record: &AuditRecord) -> &str {
    record.note.as_deref().unwrap_or_default()
}

#[test]
fn a_delivery_after_a_requeue_makes_the_item_sent_and_it_is_not_sent_again() {
    let Some(hosts) = hosts() else { return };
    let (late, sends) = hosts.late_delivery("tg-1", |operator| {
        operator.requeue("k", "alice", "retry it").unwrap();
    });
    assert_eq!(sends, 1);
    assert_eq!(
        (late.outcome, late.transport_ref.as_deref()),
        (Outcome::Sent, Some("tg-1")),
        "{late:?}"
    );
    let item = hosts.operator.get("k").unwrap().unwrap();
    assert_eq!(
        (item.state(), item.transport_ref()),
        (ItemState::Sent, Some("tg-1"))
    );
    assert_eq!(hosts.drain(), 0, "delivered once: not sent a second time");
    let records = hosts.verified_records();
    assert_eq!(outcomes(&records), ["queued", "failed", "requeued", "sent"]);
    let sent = records.last().unwrap();
    assert_eq!(sent.transport_ref.as_deref(), Some("tg-1"));
    assert_eq!(late.audit_id.as_deref(), Some(sent.audit_id.as_str()));
    assert!(
        note(sent).starts_with("correction:") && note(sent).contains("requeued"),
        "{sent:?}"
    );
    assert_eq!(
        hosts
            .operator
            .find_by_transport_ref("tg-1")
            .unwrap()
            .map(|i| i.idempotency_key().to_owned()),
        Some("k".to_owned()),
        "a reply to it correlates"
    );
}

#[test]
fn a_delivery_after_a_cancel_is_on_record_and_the_item_stays_cancelled() {
    let Some(hosts) = hosts() else { return };
    let (late, sends) = hosts.late_delivery("tg-1", |operator| {
        operator.requeue("k", "alice", "retry it").unwrap();
        operator.cancel("k", "alice", "not needed").unwrap();
    });
    assert_eq!(sends, 1);
    assert_eq!(
        (late.outcome, late.transport_ref.as_deref()),
        (Outcome::Sent, Some("tg-1")),
        "the receipt says this send delivered: {late:?}"
    );
    let item = hosts.operator.get("k").unwrap().unwrap();
    assert_eq!(
        (item.state(), item.error_code()),
        (ItemState::Failed, Some(CANCELLED))
    );
    assert_eq!(hosts.drain(), 0);
    let records = hosts.verified_records();
    assert_eq!(
        outcomes(&records),
        ["queued", "failed", "requeued", "cancelled", "late_delivery"]
    );
    let delivery = records.last().unwrap();
    assert_eq!(delivery.outcome, AuditOutcome::LateDelivery);
    assert_eq!(delivery.transport_ref.as_deref(), Some("tg-1"));
    assert_eq!(late.audit_id.as_deref(), Some(delivery.audit_id.as_str()));
    assert_eq!(item.last_audit_id(), Some(delivery.audit_id.as_str()));
    assert!(note(delivery).contains("cancelled"), "{delivery:?}");
}

#[test]
fn a_delivery_after_a_resend_delivered_is_on_record_beside_it() {
    let Some(hosts) = hosts() else { return };
    let (late, sends) = hosts.late_delivery("tg-1", |operator| {
        operator.requeue("k", "alice", "retry it").unwrap();
        let resent = operator.process("k", |_| Ok(Some("tg-2".into()))).unwrap();
        assert_eq!(resent.outcome, Outcome::Sent);
    });
    assert_eq!(sends, 1);
    assert_eq!(
        (late.outcome, late.transport_ref.as_deref()),
        (Outcome::Sent, Some("tg-1"))
    );
    let item = hosts.operator.get("k").unwrap().unwrap();
    assert_eq!(
        (item.state(), item.transport_ref()),
        (ItemState::Sent, Some("tg-2")),
        "the item keeps the resend it recorded"
    );
    assert_eq!(hosts.drain(), 0);
    let records = hosts.verified_records();
    assert_eq!(
        outcomes(&records),
        ["queued", "failed", "requeued", "sent", "late_delivery"]
    );
    let delivery = records.last().unwrap();
    assert_eq!(delivery.transport_ref.as_deref(), Some("tg-1"));
    assert!(note(delivery).contains("tg-2"), "{delivery:?}");
}

/// The operator requeued the item and another handle is sending it again when
/// the lost claim's send returns delivered: that resend is already under way
/// (nothing can call it back), so the late delivery is put on record and the
/// resend finishes as its own.
#[test]
fn a_delivery_while_a_resend_is_under_way_is_on_record_and_the_resend_finishes() {
    let Some(hosts) = hosts() else { return };
    let resender = hosts.engine.open();
    let (entered_tx, entered_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let resending = {
        let resender = resender.clone();
        move || {
            resender.process("k", |_| {
                entered_tx.send(()).unwrap();
                release_rx.recv().unwrap();
                Ok(Some("tg-2".into()))
            })
        }
    };
    let (late, resent) = within(
        "a late delivery while a resend is held open",
        DEADLOCK_LIMIT,
        || {
            let mut resend_thread = None;
            let (late, sends) = hosts.late_delivery("tg-1", |operator| {
                operator.requeue("k", "alice", "retry it").unwrap();
                resend_thread = Some(std::thread::spawn(resending));
                entered_rx.recv().unwrap();
            });
            assert_eq!(sends, 1);
            let item = hosts.operator.get("k").unwrap().unwrap();
            assert_eq!(item.state(), ItemState::Queued, "the resend still holds it");
            assert!(item.dispatch_claimed());
            release_tx.send(()).unwrap();
            let resent = resend_thread.unwrap().join().unwrap().unwrap();
            (late, resent)
        },
    );
    assert_eq!(
        (late.outcome, late.transport_ref.as_deref()),
        (Outcome::Sent, Some("tg-1"))
    );
    assert_eq!(
        (resent.outcome, resent.transport_ref.as_deref()),
        (Outcome::Sent, Some("tg-2"))
    );
    assert_eq!(hosts.drain(), 0);
    let records = hosts.verified_records();
    assert_eq!(
        outcomes(&records),
        ["queued", "failed", "requeued", "late_delivery", "sent"]
    );
    let delivery = &records[3];
    assert_eq!(delivery.transport_ref.as_deref(), Some("tg-1"));
    assert!(note(delivery).contains("claimed again"), "{delivery:?}");
    assert_eq!(records[4].transport_ref.as_deref(), Some("tg-2"));
}

/// The lost claim's send certainly failed (the platform refused it) after the
/// operator requeued the item: nothing reached the chat, so nothing is
/// corrected or recorded, the item stays queued for the resend the operator
/// asked for, and that resend goes out once.
#[test]
fn a_send_that_certainly_failed_after_a_requeue_changes_nothing_and_the_requeued_send_goes_once() {
    let Some(hosts) = hosts() else { return };
    let mut requeued = None;
    let (late, sends) = hosts.late_send(Err(SendError::permanent("chat_not_found")), |operator| {
        requeued = Some(operator.requeue("k", "alice", "retry it").unwrap());
    });
    assert_eq!(sends, 1);
    assert_eq!(
        (
            late.outcome,
            late.audit_id.as_deref(),
            late.error_code.as_deref()
        ),
        (Outcome::Deferred, None, None),
        "still queued for the requeued send, nothing recorded: {late:?}"
    );
    let item = hosts.operator.get("k").unwrap().unwrap();
    assert_eq!(
        Some(&item),
        requeued.as_ref(),
        "the item is as the requeue left it"
    );
    assert_eq!(hosts.drain(), 1, "the requeued send goes out, once");
    assert_eq!(hosts.drain(), 0);
    let item = hosts.operator.get("k").unwrap().unwrap();
    assert_eq!(
        (item.state(), item.transport_ref(), item.error_code()),
        (ItemState::Sent, Some("resent"), None)
    );
    let records = hosts.verified_records();
    assert_eq!(
        outcomes(&records),
        ["queued", "failed", "requeued", "sent"],
        "the refused send left no record: no message to account for"
    );
    assert_eq!(records[3].transport_ref.as_deref(), Some("resent"));
}
