//! An operator's removal of old audit history
//! (`Outbox::remove_old_audit_segments`) means the same on both engines:
//! the newest `keep` segments (by `audit_rotate_bytes`) stay, a `pruned`
//! record names the operator, the reason, the range and where the chain now
//! starts, the chain verifies from there (and so does an export, offline),
//! and records deleted from the front without such a record are found.
//! On PostgreSQL also: another host sealing during the removal loses no
//! record, a removal that fails or whose process dies half-way changes
//! nothing, and a file outbox pruned before it moved migrates whole.

use std::io::Write;

use durable_outbox::{AuditFault, AuditLog, AuditRecord, Error, Outbox};

use crate::engines::{EngineUnderTest, on_both_engines};
use crate::harness::{msg, uncapped};

/// The segment size these tests cut the chain by: four enqueue records
/// (about 600 bytes a line) pass it, three do not. The file engine seals at
/// the compaction after each round of four, PostgreSQL cuts after the
/// fourth: the same segments.
const SEGMENT: u64 = 2048;

fn open(engine: &EngineUnderTest) -> Outbox {
    engine.open_with(|b| uncapped(b).audit_rotate_bytes(SEGMENT))
}

/// Three rounds of four enqueues, each round ending with a compaction (where
/// the file engine seals its active log as a segment): 12 records, three
/// segments of four.
fn three_segments(outbox: &Outbox) {
    for round in 0..3 {
        for i in 0..4 {
            outbox
                .enqueue(msg(&format!("r{round}-{i}"), "chat-1"))
                .unwrap();
        }
        outbox.compact().unwrap();
    }
}

/// The chain as a user reads it (`audit_records`).
fn chain(outbox: &Outbox) -> Vec<AuditRecord> {
    outbox
        .audit_records()
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

/// `records` written as an export is (one JSON record a line).
fn export_of(records: &[AuditRecord]) -> tempfile::NamedTempFile {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    for record in records {
        serde_json::to_writer(&mut file, record).unwrap();
        file.write_all(b"\n").unwrap();
    }
    file.flush().unwrap();
    file
}

/// The documented Python verifier's verdict on `path`: `Some(stdout)` when
/// it accepted it, `None` when python3 is missing (outside CI).
fn python_verifies(path: &std::path::Path) -> Option<Result<String, String>> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/verify_audit.py");
    match std::process::Command::new("python3")
        .arg(script)
        .arg(path)
        .output()
    {
        Err(e) => {
            crate::harness::missing_tool("python3", &e.to_string());
            None
        }
        Ok(out) if out.status.success() => Some(Ok(String::from_utf8(out.stdout).unwrap())),
        Ok(out) => Some(Err(String::from_utf8(out.stderr).unwrap())),
    }
}

fn front_cut(error: Error) -> (u64, AuditFault) {
    match error {
        Error::AuditBroken { line, fault, .. } => (line, fault),
        other => panic!("expected AuditBroken, got {other:?}"),
    }
}

on_both_engines! {
    /// Keep 1 of 3: the oldest two segments go, after a `pruned` record
    /// naming the operator, the reason and where the chain now starts; the
    /// chain verifies from there, with the library, offline from an export
    /// (Rust and Python), and after a reopen; items are not touched.
    fn the_newest_segments_stay_and_the_chain_verifies_from_the_removal(engine) {
        let outbox = open(engine);
        three_segments(&outbox);
        let before = outbox.verify_audit().unwrap();
        assert_eq!(before.records, 12);

        let removed = outbox
            .remove_old_audit_segments(1, "ops", "older than a year")
            .unwrap();
        assert_eq!(removed, 2, "two of three segments");

        let records = chain(&outbox);
        let keys: Vec<&str> = records.iter().map(|r| r.idempotency_key.as_str()).collect();
        assert_eq!(
            keys,
            ["r2-0", "r2-1", "r2-2", "r2-3", "audit-segments"],
            "the newest segment stays, then the removal's record"
        );
        let first = &records[0];
        assert_eq!(first.seq, 9, "the chain now starts after the removed records");
        let removal = records.last().unwrap();
        assert_eq!(removal.outcome.as_str(), "pruned");
        assert_eq!(removal.seq, before.head_seq + 1, "appended at the head");
        let note = removal.note.as_deref().unwrap();
        assert!(
            note.starts_with("ops: older than a year (removed 2 "),
            "names operator, reason and how many: {note}"
        );
        assert!(
            note.ends_with(&format!(
                "the chain now starts after seq {} hash {})",
                first.seq - 1,
                first.prev_hash
            )),
            "names the last removed record, which the first kept one links to: {note}"
        );

        let report = outbox.verify_audit().unwrap();
        assert_eq!((report.records, report.head_seq), (5, 13));
        assert!(outbox.history("r0-0").unwrap().is_empty(), "its records went");
        assert_eq!(outbox.history("r2-0").unwrap().len(), 1);
        assert!(outbox.get("r0-0").unwrap().is_some(), "items are not audit history");

        let export = export_of(&records);
        assert_eq!(AuditLog::verify(export.path()).unwrap(), report, "offline");
        if let Some(verdict) = python_verifies(export.path()) {
            assert_eq!(verdict, Ok("ok 5\n".to_owned()), "the Python verifier");
        }

        let reopened = open(engine);
        reopened.enqueue(msg("after", "chat-2")).unwrap();
        assert_eq!(reopened.verify_audit().unwrap().records, 6);
        assert_eq!(
            outbox.remove_old_audit_segments(1, "ops", "again").unwrap(),
            0,
            "one segment left: nothing to remove, nothing written"
        );
        assert_eq!(reopened.verify_audit().unwrap().records, 6);
    }

    /// Keep 0: every sealed segment goes, the active part stays; a second
    /// removal later starts from the first one's anchor and both verify.
    fn keeping_none_leaves_the_active_records_and_removals_chain(engine) {
        let outbox = open(engine);
        three_segments(&outbox);
        assert_eq!(outbox.remove_old_audit_segments(0, "ops", "all old").unwrap(), 3);
        let records = chain(&outbox);
        assert_eq!(records.len(), 1, "only the removal's record: {records:?}");
        assert_eq!(records[0].seq, 13);
        for round in 3..5 {
            for i in 0..4 {
                outbox.enqueue(msg(&format!("r{round}-{i}"), "chat-1")).unwrap();
            }
            outbox.compact().unwrap();
        }
        // The engines cut these two rounds (and the first removal's record)
        // at different records (the file engine at each compaction), but
        // both have more than one segment now, the oldest holding the first
        // removal's record.
        let removed = outbox.remove_old_audit_segments(1, "ops", "again").unwrap();
        assert_eq!(removed, 1);
        let records = chain(&outbox);
        let removals: Vec<&AuditRecord> = records
            .iter()
            .filter(|r| r.idempotency_key == "audit-segments")
            .collect();
        assert_eq!(removals.len(), 1, "the first removal's record went with its segment");
        assert!(
            removals[0].note.as_deref().unwrap().ends_with(&format!(
                "the chain now starts after seq {} hash {})",
                records[0].seq - 1,
                records[0].prev_hash
            )),
            "the second removal names the new start"
        );
        let report = outbox.verify_audit().unwrap();
        assert_eq!(report.records as usize, records.len());
        let export = export_of(&records);
        assert_eq!(AuditLog::verify(export.path()).unwrap(), report);
        if let Some(verdict) = python_verifies(export.path()) {
            assert_eq!(
                verdict,
                Ok(format!("ok {}\n", records.len())),
                "the Python verifier, after two removals"
            );
        }
    }

    /// Keyed: the removal's record is keyed like every record, so what is
    /// left verifies with the key, here and from an export, and a reopened
    /// keyed handle goes on; without the key the export does not verify.
    fn a_keyed_chain_is_pruned_and_verifies_with_its_key(engine) {
        let key = vec![7u8; 32];
        let keyed = |b| uncapped(b).audit_rotate_bytes(SEGMENT).audit_key(key.clone());
        let outbox = engine.open_with(keyed);
        three_segments(&outbox);
        assert_eq!(outbox.remove_old_audit_segments(1, "ops", "older than a year").unwrap(), 2);
        let report = outbox.verify_audit().unwrap();
        assert_eq!(report.records, 5);
        let export = export_of(&chain(&outbox));
        assert_eq!(AuditLog::verify_keyed(export.path(), &key).unwrap(), report);
        assert!(AuditLog::verify(export.path()).is_err(), "not without the key");
        let reopened = engine.open_with(keyed);
        reopened.enqueue(msg("after", "chat-2")).unwrap();
        assert_eq!(reopened.verify_audit().unwrap().records, 6);
    }

    /// An export whose first records were cut, with or without a removal
    /// before, does not verify offline: its start is named by no record.
    fn an_export_cut_at_the_front_fails_offline(engine) {
        let outbox = open(engine);
        three_segments(&outbox);
        let whole = chain(&outbox);
        assert_eq!(
            front_cut(AuditLog::verify(export_of(&whole[2..]).path()).unwrap_err()),
            (1, AuditFault::FrontCut { first_seq: 3 }),
            "no removal at all"
        );
        outbox.remove_old_audit_segments(1, "ops", "older than a year").unwrap();
        let kept = chain(&outbox);
        AuditLog::verify(export_of(&kept).path()).unwrap();
        assert_eq!(
            front_cut(AuditLog::verify(export_of(&kept[1..]).path()).unwrap_err()),
            (1, AuditFault::FrontCut { first_seq: 10 }),
            "cut past where the removal says the chain starts"
        );
        if let Some(verdict) = python_verifies(export_of(&kept[1..]).path()) {
            let said = verdict.expect_err("the Python verifier refuses it too");
            assert!(said.contains("line 1"), "{said}");
        }
    }
}

/// How a reader of the chain ended: the records it handed out, and the error
/// that ended it, if any.
fn read_on(reader: durable_outbox::AuditChainRecords, mut last: u64) -> (Vec<u64>, Option<Error>) {
    let mut seqs = Vec::new();
    for record in reader {
        match record {
            Ok(record) => {
                assert_eq!(
                    record.seq,
                    last + 1,
                    "record seq {} handed out right after seq {last}: the chain read has a \
                     hole",
                    record.seq
                );
                last = record.seq;
                seqs.push(record.seq);
            }
            Err(e) => return (seqs, Some(e)),
        }
    }
    (seqs, None)
}

on_both_engines! {
    /// A reader of the chain (`audit_records`: what the CLI's `export
    /// --audit` and `verify` read) that a removal overtakes never hands out
    /// a chain with a hole in it: the records it had not reached went, so it
    /// stops at the gap with `AuditFault::SeqGap` naming the seq it expected
    /// and the one it found, and nothing after. (More than a page of the
    /// table, 1,000 records, and two sealed segments of the directory, so
    /// the reader is part-way when the removal commits.)
    fn a_reader_overtaken_by_a_removal_stops_at_the_gap(engine) {
        let outbox = open(engine);
        for round in 0..2 {
            let batch = (0..600)
                .map(|i| msg(&format!("p{round}-{i}"), "chat-1"))
                .collect();
            outbox.enqueue_many(batch).unwrap();
            outbox.compact().unwrap();
        }
        outbox.enqueue(msg("last", "chat-1")).unwrap();
        let mut reader = outbox.audit_records().unwrap();
        let first = reader.next().unwrap().unwrap();
        assert_eq!(first.seq, 1);
        assert!(outbox.remove_old_audit_segments(0, "ops", "all old").unwrap() > 0);
        let start = chain(&outbox)[0].seq;
        assert!(start > 1_001, "the removal took records the reader had not reached");

        let (seqs, error) = read_on(reader, first.seq);
        let last = seqs.last().copied().unwrap_or(first.seq);
        match error {
            Some(Error::AuditBroken {
                fault: AuditFault::SeqGap { expected, found },
                ..
            }) => assert_eq!((expected, found), (last + 1, start)),
            other => panic!("expected the reader to stop at the gap, got {other:?}"),
        }
        // A reader started now reads what is left, whole.
        let (seqs, error) = read_on(outbox.audit_records().unwrap(), start - 1);
        assert!(error.is_none(), "{error:?}");
        assert_eq!(seqs.first(), Some(&start));
    }
}

/// A directory's reader lists the files when it starts: a compaction that
/// seals `audit.jsonl` as a segment before the reader reaches it moves those
/// records, it does not remove them, so the reader finds them in the new
/// segment and hands out the whole chain.
#[test]
fn a_reader_overtaken_by_a_rotation_reads_the_moved_records() {
    let engine = EngineUnderTest::file();
    let outbox = open(&engine);
    let batch = |round: usize| {
        (0..4)
            .map(|i| msg(&format!("q{round}-{i}"), "chat-1"))
            .collect()
    };
    outbox.enqueue_many(batch(0)).unwrap();
    outbox.compact().unwrap();
    outbox.enqueue_many(batch(1)).unwrap();
    let mut reader = outbox.audit_records().unwrap();
    let first = reader.next().unwrap().unwrap();
    assert_eq!(first.seq, 1);
    // Seals seq 5 to 8 (listed as `audit.jsonl`) as `audit-5.jsonl`.
    outbox.compact().unwrap();
    outbox.enqueue(msg("after", "chat-1")).unwrap();
    let (seqs, error) = read_on(reader, first.seq);
    assert!(error.is_none(), "{error:?}");
    assert_eq!(seqs, (2..=9).collect::<Vec<u64>>(), "every record, once");
}

/// PostgreSQL: rows deleted by hand from the front of the `audit` table
/// (without a removal, or past one) fail `verify_audit` at the first row.
#[cfg(feature = "postgres")]
#[test]
fn rows_deleted_from_the_front_of_the_table_fail_verification() {
    let Some(engine) = EngineUnderTest::postgres() else {
        return;
    };
    let outbox = open(&engine);
    three_segments(&outbox);
    let db = crate::pg_server::PgServer::shared().unwrap();
    let name = engine.url().rsplit('/').next().unwrap().to_owned();
    db.psql(&name, "DELETE FROM durable_outbox.audit WHERE seq <= 2");
    assert_eq!(
        front_cut(outbox.verify_audit().unwrap_err()),
        (1, AuditFault::FrontCut { first_seq: 3 }),
        "no removal record names seq 2"
    );

    let engine = engine.fresh();
    let outbox = open(&engine);
    three_segments(&outbox);
    outbox
        .remove_old_audit_segments(1, "ops", "older than a year")
        .unwrap();
    outbox.verify_audit().unwrap();
    let name = engine.url().rsplit('/').next().unwrap().to_owned();
    db.psql(&name, "DELETE FROM durable_outbox.audit WHERE seq = 9");
    assert_eq!(
        front_cut(outbox.verify_audit().unwrap_err()),
        (1, AuditFault::FrontCut { first_seq: 10 }),
        "the removal names seq 8, the rows start after 9"
    );
}

/// PostgreSQL: a file outbox whose oldest segments were removed migrates
/// with the chain it has (from its anchor), which verifies there and goes on.
#[cfg(feature = "postgres")]
#[test]
fn a_file_outbox_pruned_before_it_moved_migrates_and_verifies() {
    let Some(server) = crate::pg_server::PgServer::shared() else {
        return;
    };
    let db = server.database();
    let file = EngineUnderTest::file();
    let outbox = open(&file);
    three_segments(&outbox);
    assert_eq!(
        outbox
            .remove_old_audit_segments(1, "ops", "older than a year")
            .unwrap(),
        2
    );
    let file_report = outbox.verify_audit().unwrap();
    let file_chain = chain(&outbox);
    drop(outbox);

    let report = durable_outbox::Migration::new(file.location(), &db.url())
        .run()
        .unwrap();
    assert_eq!(report.audit_head.seq, file_report.head_seq);
    let pg = Outbox::postgres(&db.url()).open().unwrap();
    assert_eq!(pg.verify_audit().unwrap(), file_report);
    assert_eq!(
        chain(&pg),
        file_chain,
        "the same records, from the same start"
    );
    pg.enqueue(msg("after", "chat-1")).unwrap();
    assert_eq!(pg.verify_audit().unwrap().records, file_report.records + 1);
}

/// The database name of a PostgreSQL engine's outbox, for `psql`.
#[cfg(all(feature = "postgres", feature = "test-failpoints"))]
fn database(engine: &EngineUnderTest) -> String {
    engine.url().rsplit('/').next().unwrap().to_owned()
}

#[cfg(all(feature = "postgres", feature = "test-failpoints"))]
fn psql(engine: &EngineUnderTest, sql: &str) -> String {
    crate::pg_server::PgServer::shared()
        .unwrap()
        .psql(&database(engine), sql)
}

/// PostgreSQL, two handles like two hosts: while one removes old records
/// (held inside its transaction, after its delete, by a failpoint delay),
/// the other commits enqueues. None is lost: each has its one record, after
/// the removal's (the head was locked, so they waited as pending events),
/// and the chain is one order that verifies, here and offline.
#[cfg(all(feature = "postgres", feature = "test-failpoints"))]
#[test]
fn another_host_committing_during_a_removal_loses_no_record() {
    use durable_outbox::FailAction;
    use std::time::{Duration, Instant};
    /// Enqueues the other host commits during the removal.
    const N: usize = 12;

    let Some(engine) = EngineUnderTest::postgres() else {
        return;
    };
    let remover = engine.open_with(|b| {
        uncapped(b)
            .audit_rotate_bytes(SEGMENT)
            .failpoint("postgres.audit_removal", FailAction::DelayMs(2_000))
    });
    let other_host = open(&engine);
    three_segments(&remover);
    let removal = crate::harness::within(
        "a removal and another host's commits both finish",
        crate::harness::DEADLOCK_LIMIT,
        || {
            std::thread::scope(|scope| {
                let removing = scope
                    .spawn(|| remover.remove_old_audit_segments(1, "ops", "older than a year"));
                // Event-driven: the removal's session is inside its
                // transaction, its last statement the delete (it holds the
                // head and waits at the failpoint, before its commit).
                let deadline = Instant::now() + crate::harness::DEADLOCK_LIMIT;
                while psql(
                    &engine,
                    "SELECT count(*) FROM pg_stat_activity
                     WHERE datname = current_database() AND state = 'idle in transaction'
                       AND query LIKE 'DELETE FROM %audit WHERE seq <=%'",
                ) == "0"
                {
                    assert!(Instant::now() < deadline, "the removal never began");
                    std::thread::sleep(Duration::from_millis(10));
                }
                for i in 0..N {
                    other_host
                        .enqueue(msg(&format!("b-{i}"), "chat-2"))
                        .expect("commits go on during a removal");
                }
                removing.join().unwrap().unwrap()
            })
        },
    );
    assert_eq!(removal, 2);
    let report = other_host.verify_audit().unwrap();
    assert_eq!(report.head_seq, 12 + 1 + N as u64, "every record, once");
    let records = chain(&other_host);
    let pruned = records
        .iter()
        .find(|r| r.idempotency_key == "audit-segments")
        .unwrap()
        .seq;
    for i in 0..N {
        let key = format!("b-{i}");
        let mine: Vec<u64> = records
            .iter()
            .filter(|r| r.idempotency_key == key)
            .map(|r| r.seq)
            .collect();
        assert_eq!(mine.len(), 1, "{key}: one record");
        assert!(mine[0] > pruned, "{key}: sealed after the removal's record");
    }
    assert_eq!(
        AuditLog::verify(export_of(&records).path()).unwrap(),
        report
    );
}

/// PostgreSQL: a removal that fails after its delete, before its commit,
/// changes nothing: the same rows, the same head, verification as before,
/// and the next removal does the work.
#[cfg(all(feature = "postgres", feature = "test-failpoints"))]
#[test]
fn a_removal_that_fails_half_way_leaves_the_chain_as_it_was() {
    use durable_outbox::FailAction;

    let Some(engine) = EngineUnderTest::postgres() else {
        return;
    };
    let failing = engine.open_with(|b| {
        uncapped(b)
            .audit_rotate_bytes(SEGMENT)
            .failpoint("postgres.audit_removal", FailAction::Error)
    });
    three_segments(&failing);
    let before = (failing.verify_audit().unwrap(), chain(&failing));
    let failed = failing.remove_old_audit_segments(1, "ops", "older than a year");
    assert!(failed.is_err(), "{failed:?}");
    assert_eq!((failing.verify_audit().unwrap(), chain(&failing)), before);
    assert_eq!(
        open(&engine)
            .remove_old_audit_segments(1, "ops", "older than a year")
            .unwrap(),
        2
    );
}

/// PostgreSQL: the process running a removal is killed (`SIGKILL`) after
/// its delete, before its commit: the server rolls it back, and the chain
/// is as it was.
#[cfg(all(unix, feature = "postgres", feature = "test-failpoints"))]
#[test]
fn a_removal_killed_half_way_leaves_the_chain_as_it_was() {
    use std::os::unix::process::ExitStatusExt;

    let Some(engine) = EngineUnderTest::postgres() else {
        return;
    };
    let outbox = open(&engine);
    three_segments(&outbox);
    let before = (outbox.verify_audit().unwrap(), chain(&outbox));
    let location = engine.child_location("remover");
    let out = crate::processes::worker(&["remove-audit", &location, "1"])
        .env("DURABLE_OUTBOX_FAILPOINTS", "postgres.audit_removal=kill")
        .output()
        .unwrap();
    assert_eq!(
        out.status.signal(),
        Some(9),
        "killed at the failpoint: {out:?}"
    );
    engine.await_child_gone("remover");
    assert_eq!((outbox.verify_audit().unwrap(), chain(&outbox)), before);
}
