//! `verify_audit` reads the chain in pages within one snapshot: the same
//! answers (report, or the first bad record's position and fault) whatever
//! the page size, wherever a page boundary falls (on the removal record
//! that names the chain's start included), and never more rows at once
//! than a page.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests panic loudly"
)]

use chrono::Utc;

use super::super::test_server::PgServer;
use super::super::{DEFAULT_SCHEMA, PgEngine};
use crate::audit::{AuditOutcome, Hasher};
use crate::error::Error;
use crate::message::content_hash;
use crate::rules::enqueue::insert_message;
use crate::rules::txn::Scope;

fn enqueue(engine: &PgEngine, key: &str) {
    let message = crate::NewMessage {
        idempotency_key: key.to_owned(),
        connector: "telegram".into(),
        grant_id: "bot-1".into(),
        destination: "chat".into(),
        content: format!("body of {key}"),
        ..Default::default()
    };
    let hash = content_hash(&message.content);
    let settings = crate::settings::Settings {
        rates: crate::rate::RatePolicy::default(),
        history_after: std::time::Duration::from_secs(60),
        retention: crate::history::Retention::KeepAll,
        max_attempts: 3,
        backoff: crate::retry::Backoff::default(),
        give_up_after: std::time::Duration::from_secs(3600),
        ordering: crate::order::Ordering::PerDestination,
        stored: Vec::new(),
    };
    engine
        .transact(Utc::now(), &settings, Scope::OneItem(key), |txn| {
            insert_message(txn, &message, &hash)
        })
        .expect("enqueue");
}

#[test]
fn verify_reads_in_pages_with_the_same_answers_wherever_a_page_ends() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let engine = PgEngine::open(&db.url(), DEFAULT_SCHEMA, Hasher::Plain).unwrap();
    for n in 0..9 {
        enqueue(&engine, &format!("before-{n}"));
    }
    // Every record its own segment: all but the newest two go.
    let removed = engine
        .remove_old_audit_segments(2, "test", 1, Utc::now())
        .unwrap();
    assert!(removed > 0, "old records were removed");
    for n in 0..5 {
        enqueue(&engine, &format!("after-{n}"));
    }
    let rows = engine.audit_page(0, 1_000).unwrap();
    let first = rows[0].seq;
    assert!(first > 1, "the chain starts after the removed records");
    let removal = rows
        .iter()
        .position(|r| r.outcome == AuditOutcome::Pruned)
        .expect("the removal's record is in the chain");
    assert!(removal > 0, "records precede the removal's record");
    let n = i64::try_from(rows.len()).unwrap();

    let (whole, _) = engine.verify_audit_in_pages(i64::MAX).unwrap();
    assert_eq!(whole.records, rows.len() as u64);
    // Every page size from one row up: some page ends right before the
    // removal's record, some right on it, some past it.
    for page in 1..=n + 1 {
        let (report, largest) = engine.verify_audit_in_pages(page).unwrap();
        assert_eq!(report, whole, "page size {page}");
        assert!(
            largest <= usize::try_from(page).unwrap(),
            "page size {page}: one statement returned {largest} rows"
        );
    }
    assert_eq!(engine.verify_audit().unwrap(), whole);

    // A record edited right after the removal's: found at the same
    // position, with the same fault, whatever the page size.
    let edited = i64::try_from(rows[removal + 1].seq).unwrap();
    db.psql(&format!(
        "UPDATE {DEFAULT_SCHEMA}.audit SET line = replace(line, '\"chat\"', '\"evil\"') WHERE seq = {edited}"
    ));
    let broken = |page: i64| match engine.verify_audit_in_pages(page) {
        Err(Error::AuditBroken { line, fault, .. }) => (line, fault),
        other => panic!("page size {page}: an edited record must fail, got {other:?}"),
    };
    let expected = broken(i64::MAX);
    assert_eq!(
        expected.0,
        removal as u64 + 2,
        "the edited record's position"
    );
    for page in 1..=n + 1 {
        assert_eq!(broken(page), expected, "page size {page}");
    }
}

/// A row keyed below every real seq (0 or negative: the table does not
/// forbid them; an operator's or an intruder's insert) is read by a scan
/// of the whole table, so verifying must find it too, whatever the page
/// size: a paged read that starts above 0 would pass it over and call a
/// tampered chain intact.
#[test]
fn verify_finds_a_row_keyed_below_the_first_seq_whatever_the_page_size() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    for below in [0, -5, i64::MIN] {
        let db = server.database();
        let engine = PgEngine::open(&db.url(), DEFAULT_SCHEMA, Hasher::Plain).unwrap();
        for n in 0..3 {
            enqueue(&engine, &format!("k-{n}"));
        }
        engine.verify_audit().unwrap();
        db.psql(&format!(
            "INSERT INTO {DEFAULT_SCHEMA}.audit (seq, hash, line) \
             SELECT {below}, hash, line FROM {DEFAULT_SCHEMA}.audit ORDER BY seq LIMIT 1"
        ));
        for page in [1, 2, 1_000, i64::MAX] {
            match engine.verify_audit_in_pages(page) {
                Err(Error::AuditBroken { .. }) => {}
                other => panic!(
                    "seq {below}, page size {page}: a row keyed below the chain passed: {other:?}"
                ),
            }
        }
    }
}

/// A chain read returns only records a server crash cannot take back.
/// Another handle seals without waiting for its WAL flush; when that sealing
/// commits between a reader's own sealing and its read, the read sees it, so
/// the reader must flush before it returns. On a server whose WAL writer
/// waits 10 s between flushes, nothing else flushes it meanwhile.
#[test]
fn a_chain_read_returns_only_records_whose_wal_is_flushed() {
    use crate::failpoint::FailAction;
    use std::time::{Duration, Instant};

    let Some(server) = PgServer::start() else {
        return;
    };
    server.delay_the_wal_writer();
    let db = server.database();
    let writer = PgEngine::open(&db.url(), DEFAULT_SCHEMA, Hasher::Plain).unwrap();
    let reader = PgEngine::open(&db.url(), DEFAULT_SCHEMA, Hasher::Plain).unwrap();
    enqueue(&writer, "first");
    let point = "postgres.before_chain_read";
    reader.faults.arm(point, FailAction::DelayMs(3_000));
    std::thread::scope(|scope| {
        let read = scope.spawn(|| reader.audit_head().unwrap());
        let deadline = Instant::now() + Duration::from_secs(60);
        while reader.faults.hits(point) == 0 {
            assert!(
                Instant::now() < deadline,
                "the reader never reached its read after sealing"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        // Committed, then sealed without waiting for the flush, while the
        // reader waits between its sealing and its read.
        enqueue(&writer, "second");
        let sealed_to = db.psql("SELECT pg_current_wal_insert_lsn()");
        let head = read.join().unwrap();
        assert_eq!(
            head.seq, 2,
            "the read saw the other handle's sealing (else this test proves nothing)"
        );
        let flushed = db.psql(&format!(
            "SELECT pg_current_wal_flush_lsn() >= '{sealed_to}'::pg_lsn"
        ));
        assert_eq!(
            flushed, "t",
            "the head returned ({head:?}) is not durable: WAL is not flushed past {sealed_to}"
        );
    });
}
