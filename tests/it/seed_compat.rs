//! An outbox.json written by the Python reference design opens and keeps working.
//! The fixture is produced by `fixtures/seed-v1/make_fixture.py`, which drives the reference itself.
//!
//! File-only by design: a state file written by the Python reference.

use durable_outbox::{AMBIGUOUS_AFTER_RESTART, ItemState, Outcome};

use crate::harness::{Harness, builder, secs};

const SEED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/seed-v1/outbox.json");

fn seeded() -> Harness {
    let h = Harness::new();
    drop(h.outbox);
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(SEED, dir.path().join("outbox.json")).unwrap();
    let outbox = builder(dir.path(), &h.clock)
        .rate_limit(2, secs(60))
        .open()
        .unwrap();
    Harness::on_engine(std::sync::Arc::new(dir), h.clock, outbox, None)
}

#[test]
fn every_seed_item_loads_with_its_fields() {
    let h = seeded();
    let items = h.outbox.list_items().unwrap();
    assert_eq!(items.len(), 7);
    let sent = h.outbox.get("seed-sent").unwrap().unwrap();
    assert_eq!(sent.state(), ItemState::Sent);
    assert_eq!(sent.transport_ref(), Some("tg-1001"));
    assert_eq!(sent.content(), "hello from the seed");
    assert_eq!(sent.lane(), "outbound-telegram");
    let failed = h.outbox.get("seed-failed").unwrap().unwrap();
    assert_eq!(
        (failed.state(), failed.attempts(), failed.error_code()),
        (ItemState::Failed, 3, Some("ConnectionError"))
    );
    assert!(
        h.outbox
            .get("seed-claimed")
            .unwrap()
            .unwrap()
            .dispatch_claimed()
    );
}

#[test]
fn a_claim_left_by_the_crashed_reference_fails_as_ambiguous_and_is_never_resent() {
    let h = seeded();
    let receipt = h
        .outbox
        .process("seed-claimed", |_| panic!("resent an ambiguous message"))
        .unwrap();
    assert_eq!(receipt.outcome, Outcome::Failed);
    assert_eq!(receipt.error_code.as_deref(), Some(AMBIGUOUS_AFTER_RESTART));
}

#[test]
fn reply_correlation_works_on_seed_items() {
    let h = seeded();
    assert_eq!(
        h.outbox
            .find_by_transport_ref("tg-1001")
            .unwrap()
            .unwrap()
            .idempotency_key(),
        "seed-sent"
    );
}

#[test]
fn seed_terminal_items_get_their_missing_audit_record_on_first_touch() {
    let h = seeded();
    let receipt = h.outbox.process("seed-sent", |_| panic!("resent")).unwrap();
    assert_eq!(receipt.outcome, Outcome::Sent);
    let history = h.outbox.history("seed-sent").unwrap();
    assert_eq!(history.len(), 1);
    assert_eq!(history[0].outcome.as_str(), "sent");
    assert!(history[0].reconciled, "a late record is marked as such");
    assert_eq!(
        receipt.audit_id.as_deref(),
        Some(history[0].audit_id.as_str())
    );
    // The second touch finds the record and appends nothing.
    let again =
        h.assert_files_unchanged(|| h.outbox.process("seed-sent", |_| panic!("resent")).unwrap());
    assert_eq!(again, receipt);
}

#[test]
fn the_seed_deferred_item_waits_for_its_time_and_the_cap_then_sends() {
    let h = seeded();
    // The reference deferred it to 09:01:00.123456; before that, no attempt.
    h.clock.set("2026-01-15T09:00:30Z".parse().unwrap());
    assert_eq!(
        h.outbox
            .process("seed-deferred", |_| panic!("early"))
            .unwrap()
            .outcome,
        Outcome::Deferred
    );
    h.clock.set("2026-01-15T09:01:00.123456Z".parse().unwrap());
    assert_eq!(
        h.outbox
            .process("seed-deferred", |_| Ok(Some("tg-2".into())))
            .unwrap()
            .outcome,
        Outcome::Sent
    );
}

#[test]
fn queued_seed_items_are_delivered_and_the_file_is_upgraded() {
    let h = seeded();
    assert_eq!(
        h.outbox
            .process("seed-queued", |_| Ok(None))
            .unwrap()
            .outcome,
        Outcome::Sent
    );
    assert!(
        String::from_utf8(h.state_bytes())
            .unwrap()
            .contains("\"version\": 1"),
        "only the journal is written…"
    );
    h.outbox.compact().unwrap();
    let text = String::from_utf8(h.state_bytes()).unwrap();
    assert!(
        text.contains("\"version\": 2"),
        "…until a compaction writes the current format"
    );
    h.outbox.verify_audit().unwrap();
}
