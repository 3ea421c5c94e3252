//! PostgreSQL seals audit records after the commit that made them (see
//! `engine::postgres`, "Deferred sealing"): what that must keep. Concurrent
//! writers on two handles give one chain that the file verifier accepts,
//! with every record once and each item's records in the order of its
//! changes; a handle that dies between a commit and its sealing loses
//! nothing (the next handle, or the next reader, seals).

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use durable_outbox::{AuditLog, AuditOutcome, Error, ItemState, Outbox, Outcome, SendError};

use crate::engines::EngineUnderTest;
use crate::harness::{DEADLOCK_LIMIT, msg, within};

/// Every sealed line of the outbox's `audit` table, in seq order, as a file
/// the offline verifier reads (the bytes `audit.jsonl` would hold).
fn export(engine: &EngineUnderTest) -> tempfile::NamedTempFile {
    let out = psql(engine, "SELECT line FROM durable_outbox.audit ORDER BY seq");
    let file = tempfile::NamedTempFile::new().unwrap();
    let mut bytes = out.into_bytes();
    if !bytes.is_empty() && !bytes.ends_with(b"\n") {
        bytes.push(b'\n');
    }
    std::fs::write(file.path(), bytes).unwrap();
    file
}

/// Runs `sql` on the outbox's database, behind the library's back.
fn psql(engine: &EngineUnderTest, sql: &str) -> String {
    let url = engine.url();
    let name = url.rsplit('/').next().unwrap().to_owned();
    crate::pg_server::PgServer::shared()
        .unwrap()
        .psql(&name, sql)
}

fn count(engine: &EngineUnderTest, table: &str) -> usize {
    psql(
        engine,
        &format!("SELECT count(*) FROM durable_outbox.{table}"),
    )
    .trim()
    .parse()
    .unwrap()
}

fn open(engine: &EngineUnderTest) -> Outbox {
    engine.open_with(|b| {
        b.rate_limit(u32::MAX, Duration::from_secs(60))
            .max_inline_wait(Duration::ZERO)
    })
}

/// How many times each key is requeued after failing.
const ROUNDS: u32 = 4;

/// 4 threads on each of two handles race on 12 keys: each enqueues every key,
/// processes it (the send fails for good) and requeues it when it is failed,
/// until every key was requeued `ROUNDS` times. Each item's changes are
/// serialised by its row, its records sealed after the commits by whichever
/// handle gets the head: the chain must still hold each item's records in a
/// lifecycle's order (queued, then failed and requeued by turns, ending
/// failed), every record once, and end with the id the item carries.
#[test]
fn writers_on_two_handles_give_one_chain_in_each_items_order() {
    let Some(engine) = EngineUnderTest::postgres() else {
        return;
    };
    let handles = [open(&engine), open(&engine)];
    let keys: Vec<String> = (0..12).map(|i| format!("k{i:02}")).collect();
    let requeues: HashMap<&str, AtomicU32> = keys
        .iter()
        .map(|k| (k.as_str(), AtomicU32::new(0)))
        .collect();
    // Every audit id a call returned, as the callers saw them.
    let returned: Mutex<Vec<String>> = Mutex::new(Vec::new());
    within("racing writers finish", DEADLOCK_LIMIT * 2, || {
        std::thread::scope(|scope| {
            for t in 0..8 {
                let outbox = &handles[t % 2];
                let (keys, requeues, returned) = (&keys, &requeues, &returned);
                scope.spawn(move || {
                    let mut open: Vec<&str> = keys.iter().map(String::as_str).collect();
                    open.rotate_left(t);
                    while !open.is_empty() {
                        open.retain(|key| {
                            // Its own chat: per-chat order never holds it back.
                            let item = outbox.enqueue(msg(key, &format!("chat-{key}"))).unwrap();
                            let turn = &requeues[key];
                            match item.state() {
                                ItemState::Queued => {
                                    let receipt = outbox
                                        .process(key, |_| Err(SendError::permanent("refused")))
                                        .unwrap();
                                    assert!(
                                        matches!(
                                            receipt.outcome,
                                            Outcome::Failed | Outcome::InFlight
                                        ),
                                        "{key}: {:?}",
                                        receipt.outcome
                                    );
                                    returned.lock().unwrap().extend(receipt.audit_id);
                                    true
                                }
                                ItemState::Failed => {
                                    // A turn is taken before the requeue, so two
                                    // threads that both saw the item failed cannot
                                    // requeue it past ROUNDS between them.
                                    if turn
                                        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |t| {
                                            (t < ROUNDS).then_some(t + 1)
                                        })
                                        .is_err()
                                    {
                                        return false;
                                    }
                                    match outbox.requeue(key, "ops", "again") {
                                        Ok(item) => {
                                            returned
                                                .lock()
                                                .unwrap()
                                                .extend(item.last_audit_id().map(str::to_owned));
                                        }
                                        // Another thread requeued it first: the
                                        // turn is given back.
                                        Err(Error::InvalidTransition { .. }) => {
                                            turn.fetch_sub(1, Ordering::SeqCst);
                                        }
                                        Err(e) => panic!("{key}: requeue: {e}"),
                                    }
                                    true
                                }
                                ItemState::Sent => {
                                    panic!("{key}: sent, though every send was refused")
                                }
                            }
                        });
                    }
                });
            }
        });
    });
    let report = handles[0].verify_audit().unwrap();
    assert_eq!(count(&engine, "audit_pending"), 0, "a reader seals first");
    let expected = keys.len() as u64 * (2 * u64::from(ROUNDS) + 2);
    assert_eq!(report.records, expected);
    // The offline verifier accepts the table's lines as a file.
    let file = export(&engine);
    assert_eq!(AuditLog::verify(file.path()).unwrap().records, expected);

    each_items_records_in_order(&handles[1], &keys, returned.into_inner().unwrap());
}

/// Each key's records, read from the chain: a lifecycle's order ending with
/// the id the item carries, every audit id once, every id a call returned
/// among them.
fn each_items_records_in_order(outbox: &Outbox, keys: &[String], returned: Vec<String>) {
    let mut ids = HashSet::new();
    for key in keys {
        let records = outbox.history(key).unwrap();
        let outcomes: Vec<AuditOutcome> = records.iter().map(|r| r.outcome).collect();
        let mut lifecycle = vec![AuditOutcome::Queued, AuditOutcome::Failed];
        for _ in 0..ROUNDS {
            lifecycle.extend([AuditOutcome::Requeued, AuditOutcome::Failed]);
        }
        assert_eq!(
            outcomes, lifecycle,
            "{key}: its records in its changes' order"
        );
        assert!(
            records.windows(2).all(|w| w[0].seq < w[1].seq),
            "{key}: history in chain order"
        );
        let item = outbox.get(key).unwrap().unwrap();
        assert_eq!(
            item.last_audit_id(),
            Some(records.last().unwrap().audit_id.as_str()),
            "{key}: the item carries its last record's id"
        );
        for record in records {
            assert!(ids.insert(record.audit_id), "{key}: an audit id twice");
        }
    }
    for id in returned {
        assert!(
            ids.contains(&id),
            "a returned audit id {id} is on the chain"
        );
    }
}

/// A handle's threads that commit side by side leave their events pending
/// while others are still running (one sealing serves many commits), but the
/// last call out seals for all: once every call has returned, nothing is left
/// pending, without any reader of the chain having sealed.
#[test]
fn the_last_call_of_a_handle_to_return_leaves_nothing_pending() {
    let Some(engine) = EngineUnderTest::postgres() else {
        return;
    };
    let outbox = open(&engine);
    within("eight threads on one handle finish", DEADLOCK_LIMIT, || {
        std::thread::scope(|scope| {
            for t in 0..8 {
                let outbox = &outbox;
                scope.spawn(move || {
                    for i in 0..9 {
                        let key = format!("t{t}-{i}");
                        outbox.enqueue(msg(&key, &format!("chat-{t}"))).unwrap();
                        let receipt = outbox.process(&key, |_| Ok(None)).unwrap();
                        assert_eq!(receipt.outcome, Outcome::Sent, "{key}");
                    }
                });
            }
        });
    });
    assert_eq!(
        count(&engine, "audit_pending"),
        0,
        "the last call out sealed every commit's events"
    );
    assert_eq!(count(&engine, "audit"), 144);
    assert_eq!(outbox.verify_audit().unwrap().records, 144);
}

/// A handle whose sealing after the commit fails (as if it died right
/// there) leaves the committed events pending, not lost; the next handle
/// opening seals them, a reader of the chain seals what it finds first, and
/// so does `compact`.
#[cfg(feature = "test-failpoints")]
#[test]
fn events_committed_and_never_sealed_are_sealed_by_the_next_handle_or_reader() {
    use durable_outbox::FailAction;
    let Some(engine) = EngineUnderTest::postgres() else {
        return;
    };
    let dying = engine.open_with(|b| {
        b.rate_limit(u32::MAX, Duration::from_secs(60))
            .failpoint("postgres.seal_after_commit", FailAction::Error)
    });
    for key in ["a", "b", "c"] {
        dying.enqueue(msg(key, &format!("chat-{key}"))).unwrap();
    }
    // Three changes of one item, all pending: sealed in their order.
    let failed = dying
        .process("a", |_| Err(SendError::permanent("refused")))
        .unwrap();
    assert_eq!(failed.outcome, Outcome::Failed);
    dying.requeue("a", "ops", "again").unwrap();
    assert_eq!(count(&engine, "audit_pending"), 5, "committed, not sealed");
    assert_eq!(count(&engine, "audit"), 0);

    let next = open(&engine);
    assert_eq!(count(&engine, "audit_pending"), 0, "sealed on open");
    assert_eq!(next.verify_audit().unwrap().records, 5);
    assert_eq!(
        next.history("a")
            .unwrap()
            .iter()
            .map(|r| r.outcome)
            .collect::<Vec<_>>(),
        [
            AuditOutcome::Queued,
            AuditOutcome::Failed,
            AuditOutcome::Requeued
        ],
        "one item's records in its changes' order"
    );
    for key in ["a", "b", "c"] {
        let records = next.history(key).unwrap();
        assert_eq!(
            next.get(key).unwrap().unwrap().last_audit_id(),
            Some(records.last().unwrap().audit_id.as_str()),
            "{key}"
        );
    }

    // A pending event counts for verification: the verifier seals first.
    dying.cancel("c", "ops", "not needed").unwrap();
    assert_eq!(count(&engine, "audit_pending"), 1);
    assert_eq!(dying.verify_audit().unwrap().records, 6);
    assert_eq!(count(&engine, "audit_pending"), 0);

    // A reader of one item's history seals before it reads.
    let receipt = dying.process("b", |_| Ok(Some("tr-b".into()))).unwrap();
    assert_eq!(receipt.outcome, Outcome::Sent);
    assert_eq!(count(&engine, "audit_pending"), 1);
    let records = next.history("b").unwrap();
    assert_eq!(
        records.iter().map(|r| r.outcome).collect::<Vec<_>>(),
        [AuditOutcome::Queued, AuditOutcome::Sent]
    );
    assert_eq!(records[1].audit_id, receipt.audit_id.unwrap());
    assert_eq!(count(&engine, "audit_pending"), 0);

    // `compact` seals what is pending (a bot's periodic housekeeping).
    dying.cancel("a", "ops", "done with it").unwrap();
    assert_eq!(count(&engine, "audit_pending"), 1);
    dying.compact().unwrap();
    assert_eq!(count(&engine, "audit_pending"), 0, "sealed by compact");
    assert_eq!(count(&engine, "audit"), 8);
    let file = export(&engine);
    assert_eq!(AuditLog::verify(file.path()).unwrap().records, 8);
}

/// A host process `SIGKILL`ed right after a commit, before its sealing: the
/// item and its event are durable, and the next handle seals the event.
#[cfg(all(unix, feature = "test-failpoints"))]
#[test]
fn a_host_killed_between_a_commit_and_its_sealing_loses_nothing() {
    use std::process::{Command, Stdio};

    const WORKER: &str = env!("CARGO_BIN_EXE_outbox-test-worker");
    let Some(engine) = EngineUnderTest::postgres() else {
        return;
    };
    let url = engine.url();
    let status = within("the killed host exits", DEADLOCK_LIMIT, || {
        Command::new(WORKER)
            .args(["enqueue", &url, "k", "5"])
            // Killed on the third commit's sealing: k-0 and k-1 are sealed,
            // k-2 committed with its event pending.
            .env(
                "DURABLE_OUTBOX_FAILPOINTS",
                "postgres.seal_after_commit=kill@3",
            )
            .stdout(Stdio::null())
            .status()
            .expect("run a host")
    });
    assert!(!status.success(), "the host was killed");
    assert_eq!(count(&engine, "items"), 3, "k-2 committed");
    assert_eq!(count(&engine, "audit_pending"), 1, "its event pending");

    let next = open(&engine);
    assert_eq!(count(&engine, "audit_pending"), 0);
    let report = next.verify_audit().unwrap();
    assert_eq!(report.records, 3);
    let records = next.history("k-2").unwrap();
    assert_eq!(records.len(), 1);
    assert_eq!(
        next.get("k-2").unwrap().unwrap().last_audit_id(),
        Some(records[0].audit_id.as_str())
    );
    let file = export(&engine);
    assert_eq!(AuditLog::verify(file.path()).unwrap().records, 3);
}

/// Runs `outbox_write` (a retention prune or a stored-settings change: a
/// writer that passes the writers' gate alone and seals a record about the
/// outbox) while `dying` cancels `key`, so that the cancellation commits
/// after `outbox_write` sealed what was pending before it began and before
/// it passes the gate. The cancellation's event stays pending (`dying`'s
/// sealing after a commit fails), so only `outbox_write` can seal it before
/// its own record. The order is forced with locks, not timing: a session of
/// the test holds `key`'s row, so the cancellation waits inside its
/// transaction, holding the gate shared; `outbox_write` starts once that
/// wait is seen and queues at the gate; the row is let go once that wait is
/// seen too. The manual clock moves by `advance` after the cancellation took
/// its time and before `outbox_write` takes its own.
#[cfg(feature = "test-failpoints")]
fn an_outbox_write_racing_a_commit<T: Send>(
    engine: &EngineUnderTest,
    dying: &Outbox,
    key: &str,
    advance: Duration,
    outbox_write: impl FnOnce() -> T + Send,
) -> T {
    let mut session = postgres::Client::connect(&engine.url(), postgres::NoTls).unwrap();
    let mut probe = postgres::Client::connect(&engine.url(), postgres::NoTls).unwrap();
    // Until a session of this database waits for a lock of this kind.
    let mut wait_for = |condition: &str| {
        let sql = format!(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock' AND {condition}"
        );
        while probe.query_one(&sql, &[]).unwrap().get::<_, i64>(0) == 0 {
            std::thread::sleep(Duration::from_millis(2));
        }
    };
    within(
        "an outbox write racing a commit ends (lock order: gate, then rows)",
        DEADLOCK_LIMIT,
        || {
            session
                .batch_execute(&format!(
                    "BEGIN; SELECT 1 FROM durable_outbox.items
                     WHERE idempotency_key = '{key}' FOR UPDATE"
                ))
                .unwrap();
            std::thread::scope(|scope| {
                let cancelling = scope.spawn(|| dying.cancel(key, "ops", "not needed"));
                // The cancellation waits for the row.
                wait_for("wait_event <> 'advisory'");
                engine.clock.advance(advance);
                let writing = scope.spawn(outbox_write);
                // The outbox write waits at the gate.
                wait_for("wait_event = 'advisory'");
                session.batch_execute("ROLLBACK").unwrap();
                let cancelled = cancelling.join().unwrap().unwrap();
                assert_eq!(cancelled.state(), ItemState::Failed, "cancelled");
                writing.join().unwrap()
            })
        },
    )
}

/// Where the records of `key`, and the first record with `outcome`, are on
/// the chain (their positions), read through the handle's audit stream.
#[cfg(feature = "test-failpoints")]
fn positions(outbox: &Outbox, key: &str, outcome: AuditOutcome) -> (Vec<usize>, usize) {
    let records: Vec<_> = outbox
        .audit_records()
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let of_key = records
        .iter()
        .enumerate()
        .filter(|(_, r)| r.idempotency_key == key)
        .map(|(i, _)| i)
        .collect();
    let at = records
        .iter()
        .position(|r| r.outcome == outcome)
        .unwrap_or_else(|| panic!("no {outcome:?} record on the chain"));
    (of_key, at)
}

/// A retention prune that passes the gate while an item's last change is
/// committed and not yet sealed seals that change first: the chain holds
/// the pruned item's whole life (queued, cancelled) once each, then the
/// `pruned` record, never a record of an item after the record of its
/// deletion; the item is gone and the chain verifies, online and offline.
#[cfg(feature = "test-failpoints")]
#[test]
fn a_prune_seals_the_pending_last_change_of_an_item_it_deletes_before_its_own_record() {
    use durable_outbox::{FailAction, Retention};
    let Some(engine) = EngineUnderTest::postgres() else {
        return;
    };
    let configure = |b: durable_outbox::OutboxBuilder| {
        b.rate_limit(u32::MAX, Duration::from_secs(60))
            .history_after(Duration::from_secs(60))
            .history_retention(Retention::MaxAge(Duration::from_secs(3600)))
    };
    let dying = engine
        .open_with(|b| configure(b).failpoint("postgres.seal_after_commit", FailAction::Error));
    let bot = engine.open_with(configure);
    dying.enqueue(msg("old", "chat-old")).unwrap();
    // Cancelled at the start, pruned three hours later (past the hour kept).
    an_outbox_write_racing_a_commit(
        &engine,
        &dying,
        "old",
        Duration::from_secs(3 * 3600),
        || {
            bot.compact().unwrap();
        },
    );
    assert!(
        bot.get("old").unwrap().is_none(),
        "past its retention age: pruned"
    );
    // Read before the chain is (its reader seals first).
    let pending = count(&engine, "audit_pending");
    let (old, pruned) = positions(&bot, "old", AuditOutcome::Pruned);
    assert_eq!(old.len(), 2, "queued and cancelled, each once");
    assert!(
        old.iter().all(|&at| at < pruned),
        "a record of the pruned item is on the chain after the prune's \
         (positions {old:?}, prune at {pruned})"
    );
    assert_eq!(
        bot.history("old")
            .unwrap()
            .iter()
            .map(|r| r.outcome)
            .collect::<Vec<_>>(),
        [AuditOutcome::Queued, AuditOutcome::Cancelled]
    );
    assert_eq!(pending, 0, "compact left an event pending");
    assert_eq!(bot.verify_audit().unwrap().records, 3);
    let file = export(&engine);
    assert_eq!(AuditLog::verify(file.path()).unwrap().records, 3);
}

/// A stored-settings change (a handle opened with `update_settings`) that
/// passes the gate while another handle's change is committed and not yet
/// sealed seals that change first: the `settings` record comes after every
/// change committed before it, each once; the new value is in force and the
/// chain verifies.
#[cfg(feature = "test-failpoints")]
#[test]
fn a_settings_change_seals_the_changes_committed_before_it_first() {
    use durable_outbox::FailAction;
    let Some(engine) = EngineUnderTest::postgres() else {
        return;
    };
    let dying = engine.open_with(|b| {
        b.rate_limit(u32::MAX, Duration::from_secs(60))
            .max_attempts(3)
            .failpoint("postgres.seal_after_commit", FailAction::Error)
    });
    dying.enqueue(msg("k", "chat-k")).unwrap();
    let updated = an_outbox_write_racing_a_commit(&engine, &dying, "k", Duration::ZERO, || {
        engine.open_with(|b| {
            b.rate_limit(u32::MAX, Duration::from_secs(60))
                .max_attempts(9)
                .update_settings()
        })
    });
    assert_eq!(updated.settings().unwrap().max_attempts(), 9);
    // Read before the chain is (its reader seals first).
    let pending = count(&engine, "audit_pending");
    let (k, settings) = positions(&updated, "k", AuditOutcome::Settings);
    assert_eq!(k.len(), 2, "queued and cancelled, each once");
    assert!(
        k.iter().all(|&at| at < settings),
        "a change committed before the settings change is on the chain after \
         its record (positions {k:?}, settings at {settings})"
    );
    assert_eq!(pending, 0, "a handle's open left an event pending");
    assert_eq!(updated.verify_audit().unwrap().records, 3);
    let file = export(&engine);
    assert_eq!(AuditLog::verify(file.path()).unwrap().records, 3);
}

/// A lone caller's calls leave nothing to seal: each commit's events are on
/// the chain when the call returns, the send's record made in one round trip
/// (`engine::postgres::speculate`) included, so a reader never pays for a
/// writer's sealing and the pending table stays empty on a quiet bot.
#[test]
fn a_lone_caller_s_calls_leave_no_event_pending() {
    let Some(engine) = EngineUnderTest::postgres() else {
        return;
    };
    let outbox = open(&engine);
    for key in ["a", "b", "c"] {
        outbox.enqueue(msg(key, &format!("chat-{key}"))).unwrap();
        assert_eq!(count(&engine, "audit_pending"), 0, "after enqueueing {key}");
        let receipt = outbox
            .process(key, |_| Ok(Some(format!("m-{key}"))))
            .unwrap();
        assert_eq!(receipt.outcome, Outcome::Sent);
        assert_eq!(count(&engine, "audit_pending"), 0, "after sending {key}");
    }
    assert_eq!(
        count(&engine, "audit"),
        6,
        "queued and sent, each on the chain"
    );
}
