//! What only a PostgreSQL outbox (`Outbox::postgres`) must show: liveness
//! that ends with the owner's session, typed errors for what it does not
//! offer, and calls from async code. The shared lifecycle runs in
//! `one_lifecycle` against both engines.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;

use durable_outbox::{AMBIGUOUS_AFTER_RESTART, Error, ItemState, Outbox, Outcome};

use crate::engines::EngineUnderTest;
use crate::harness::{DEADLOCK_LIMIT, msg, within};

fn engine() -> Option<EngineUnderTest> {
    EngineUnderTest::postgres()
}

#[test]
fn an_outbox_in_postgres_has_no_directory_and_a_removal_with_nothing_to_remove_writes_nothing() {
    let Some(engine) = engine() else { return };
    let outbox = engine.open();
    assert_eq!(
        outbox.dir(),
        None,
        "an outbox in PostgreSQL has no directory"
    );
    outbox.enqueue(msg("a", "chat-1")).unwrap();
    // One record is far from a whole segment (64 MiB by default): nothing
    // to remove, and no record of a removal (see `audit_removal`).
    assert_eq!(
        outbox
            .remove_old_audit_segments(0, "alice", "tidy")
            .unwrap(),
        0
    );
    assert_eq!(outbox.verify_audit().unwrap().records, 1);
    outbox.enqueue(msg("b", "chat-1")).unwrap();
    assert_eq!(outbox.verify_audit().unwrap().records, 2);
}

#[test]
fn a_schema_on_a_directory_and_bad_urls_are_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    match Outbox::builder(dir.path()).schema("bots").open() {
        Err(Error::InvalidConfig {
            setting: "schema", ..
        }) => {}
        other => panic!("a schema on a directory must be refused: {other:?}"),
    }
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "nothing written"
    );
    match Outbox::postgres("postgres://bot:sekrit@host:notaport/db").open() {
        Err(Error::InvalidConfig {
            setting: "url",
            reason,
        }) => {
            assert!(
                !reason.contains("sekrit"),
                "the password is not echoed: {reason}"
            );
        }
        other => panic!("a bad URL must be refused: {other:?}"),
    }
    let Some(engine) = engine() else { return };
    match Outbox::postgres(&engine.url()).schema("Not-A-Name").open() {
        Err(Error::InvalidConfig {
            setting: "schema", ..
        }) => {}
        other => panic!("a bad schema name must be refused: {other:?}"),
    }
}

#[test]
fn outboxes_in_two_schemas_of_one_database_are_apart() {
    let Some(engine) = engine() else { return };
    let first = engine.open_with(|b| b.schema("bot_one"));
    let second = engine.open_with(|b| b.schema("bot_two"));
    first.enqueue(msg("a", "chat-1")).unwrap();
    assert!(second.get("a").unwrap().is_none());
    second.enqueue(msg("a", "chat-1")).unwrap();
    first.process("a", |_| Ok(None)).unwrap();
    assert_eq!(second.get("a").unwrap().unwrap().state(), ItemState::Queued);
}

/// Kills every owner session (each handle's advisory-lock connection) of
/// this test's database as a network cut or a server restart would; handles
/// take their lock again on their next call. It returns once those sessions
/// are gone (`pg_terminate_backend` only signals; a session still dying
/// would hold its lock a moment longer, and a claim made meanwhile would be
/// declared dead right after). Only this database's: the
/// server is shared by tests running at the same time, each in its own
/// database, and theirs must not be cut.
pub(crate) fn cut_owner_sessions(engine: &EngineUnderTest) {
    let url = engine.url();
    let db = url.rsplit('/').next().unwrap().to_owned();
    let server = crate::pg_server::PgServer::shared().unwrap();
    server.psql(
        &db,
        "SELECT count(pg_terminate_backend(pid, 30000)) FROM pg_locks
         WHERE locktype = 'advisory' AND granted AND pid <> pg_backend_pid()
           AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    );
}

/// A handle whose owner session was cut takes its owner lock again before
/// its next claim names it (the transaction's first statement finds the lock
/// free): a send it starts afterwards is live to every other handle, which
/// answers `InFlight` and never declares it dead.
#[test]
fn after_a_cut_a_handle_takes_its_owner_lock_again_before_its_next_claim() {
    let Some(engine) = engine() else { return };
    let worker = engine.open();
    let other = engine.open();
    worker.enqueue(msg("k", "chat-1")).unwrap();
    cut_owner_sessions(&engine);
    let (entered_tx, entered_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let receipt = within(
        "a send after its owner's lock was taken again",
        DEADLOCK_LIMIT,
        || {
            std::thread::scope(|scope| {
                let worker = &worker;
                let sending = scope.spawn(move || {
                    worker
                        .process("k", |_| {
                            entered_tx.send(()).unwrap();
                            release_rx.recv().unwrap();
                            Ok(Some("tr-k".into()))
                        })
                        .unwrap()
                });
                entered_rx.recv().unwrap();
                let seen = other.process("k", |_| panic!("never resent"));
                release_tx.send(()).unwrap();
                (seen.unwrap(), sending.join().unwrap())
            })
        },
    );
    let (seen, receipt) = receipt;
    assert_eq!(
        seen.outcome,
        Outcome::InFlight,
        "a send whose owner holds its lock again is live: {seen:?}"
    );
    assert_eq!(receipt.outcome, Outcome::Sent);
    assert_eq!(
        other.get("k").unwrap().unwrap().state(),
        ItemState::Sent,
        "sent once, on record"
    );
}

#[test]
fn a_cut_owner_session_mid_send_is_ambiguous_never_resent_then_corrected_when_the_send_ends() {
    let Some(engine) = engine() else { return };
    let worker = engine.open();
    let other = engine.open();
    worker.enqueue(msg("k", "chat-1")).unwrap();
    let sends = AtomicUsize::new(0);
    let (entered_tx, entered_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let late = within(
        "a send outlives its owner's session",
        DEADLOCK_LIMIT,
        || {
            std::thread::scope(|scope| {
                let (worker, sends) = (&worker, &sends);
                let sending = scope.spawn(move || {
                    worker
                        .process("k", |_| {
                            sends.fetch_add(1, Ordering::SeqCst);
                            entered_tx.send(()).unwrap();
                            release_rx.recv().unwrap();
                            Ok(Some("delivered-late".into()))
                        })
                        .unwrap()
                });
                entered_rx.recv().unwrap();
                // While it sends, the owner's session ends: to every other handle
                // the send now looks dead. Nothing is resent.
                cut_owner_sessions(&engine);
                let receipt = other.process("k", |_| panic!("never resent")).unwrap();
                assert_eq!(receipt.outcome, Outcome::Failed);
                assert_eq!(receipt.error_code.as_deref(), Some(AMBIGUOUS_AFTER_RESTART));
                assert_eq!(
                    other.process_due(|_| panic!("never resent")).unwrap().sent,
                    0
                );
                release_tx.send(()).unwrap();
                sending.join().unwrap()
            })
        },
    );
    assert_eq!(sends.load(Ordering::SeqCst), 1, "sent exactly once");
    // The late finish records what really happened, as an audited correction:
    // the item is sent, with its transport ref, so a reply still correlates.
    assert_eq!(late.outcome, Outcome::Sent, "{late:?}");
    let item = other.get("k").unwrap().unwrap();
    assert_eq!(
        (item.state(), item.transport_ref()),
        (ItemState::Sent, Some("delivered-late"))
    );
    let records = other.history("k").unwrap();
    let outcomes: Vec<&str> = records.iter().map(|r| r.outcome.as_str()).collect();
    assert_eq!(outcomes, ["queued", "failed", "sent"]);
    let note = records
        .last()
        .and_then(|r| r.note.clone())
        .unwrap_or_default();
    assert!(note.starts_with("correction:"), "{note}");
    assert_eq!(
        other
            .find_by_transport_ref("delivered-late")
            .unwrap()
            .unwrap()
            .idempotency_key(),
        "k"
    );
    // Both handles carry on: the cut handle took its owner lock again.
    worker.enqueue(msg("after", "chat-2")).unwrap();
    assert_eq!(
        worker.process("after", |_| Ok(None)).unwrap().outcome,
        Outcome::Sent
    );
    other.verify_audit().unwrap();
}

#[test]
fn calls_from_async_code_and_drops_there_do_not_panic() {
    let Some(engine) = engine() else { return };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let url = engine.url();
    let state = runtime.block_on(async move {
        let outbox = Outbox::postgres(&url).open().unwrap();
        outbox.enqueue(msg("a", "chat-1")).unwrap();
        outbox.process("a", |_| Ok(None)).unwrap();
        let state = outbox.get("a").unwrap().unwrap().state();
        drop(outbox);
        state
    });
    assert_eq!(state, ItemState::Sent);
}

#[test]
fn an_edited_or_cut_audit_table_fails_verification_at_its_position() {
    let Some(engine) = engine() else { return };
    let outbox = engine.open();
    for key in ["a", "b", "c"] {
        outbox.enqueue(msg(key, "chat-1")).unwrap();
    }
    assert_eq!(outbox.verify_audit().unwrap().records, 3);
    let url = engine.url();
    let db = url.rsplit('/').next().unwrap().to_owned();
    let server = crate::pg_server::PgServer::shared().unwrap();
    // The last row cut off: the head row still names it.
    server.psql(&db, "DELETE FROM durable_outbox.audit WHERE seq = 3");
    match outbox.verify_audit() {
        Err(Error::AuditBroken {
            path,
            line: 3,
            fault:
                durable_outbox::AuditFault::Truncated {
                    expected_seq: 3,
                    found_seq: 2,
                },
        }) => assert_eq!(path.to_string_lossy(), "postgres:durable_outbox.audit"),
        other => panic!("a cut tail must be found: {other:?}"),
    }
    // A row edited in place: its hash no longer matches, at its position.
    server.psql(
        &db,
        "UPDATE durable_outbox.audit SET line = replace(line, '\"chat-1\"', '\"chat-9\"') WHERE seq = 2",
    );
    match outbox.verify_audit() {
        Err(Error::AuditBroken {
            line: 2,
            fault: durable_outbox::AuditFault::HashMismatch,
            ..
        }) => {}
        other => panic!("an edited row must be found: {other:?}"),
    }
}

/// Hosts racing one outbox: real processes (`outbox-test-worker torture`)
/// enqueue, process and drain random keys of one key space at once, one of
/// them killed (`SIGKILL`) mid-run. Each key reaches the transport at most once, every
/// delivered key is recorded `sent` or (the killed host's send) ambiguous,
/// and the chain verifies.
#[cfg(all(unix, feature = "test-failpoints"))]
#[test]
fn host_processes_racing_one_outbox_send_each_key_at_most_once() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};

    const WORKER: &str = env!("CARGO_BIN_EXE_outbox-test-worker");
    let Some(engine) = engine() else { return };
    let url = engine.url();
    let logs = tempfile::tempdir().unwrap();
    let log = logs.path().join("transport.log");
    let rounds = std::env::var("OUTBOX_PG_HOST_ROUNDS").unwrap_or_else(|_| "120".into());
    within("host processes finish", DEADLOCK_LIMIT * 4, || {
        let hosts: Vec<_> = (0..4)
            .map(|seed| {
                Command::new(WORKER)
                    .args([
                        "torture",
                        &url,
                        log.to_str().unwrap(),
                        &(seed * 7919 + 1).to_string(),
                        &rounds,
                    ])
                    .stdout(Stdio::piped())
                    .stderr(Stdio::inherit())
                    .spawn()
                    .expect("spawn a host")
            })
            .collect();
        let mut hosts = hosts.into_iter();
        // The first host is killed once it has done some work.
        let mut victim = hosts.next().unwrap();
        let lines = BufReader::new(victim.stdout.take().unwrap()).lines();
        let mut seen = 0;
        for line in lines {
            let line = line.unwrap();
            if line.starts_with("queued") {
                seen += 1;
            }
            if seen == 5 || line == "done" {
                break;
            }
        }
        victim.kill().unwrap();
        victim.wait().unwrap();
        for mut host in hosts {
            assert!(host.wait().unwrap().success(), "a host failed");
        }
    });
    let delivered = std::fs::read_to_string(&log).unwrap_or_default();
    let mut counts: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for key in delivered.lines() {
        *counts.entry(key).or_default() += 1;
    }
    println!(
        "host processes ({rounds} rounds each, one killed): {} of the 64 keys delivered",
        counts.len()
    );
    // Three hosts that ran all their rounds over 64 keys deliver most of
    // them: a campaign that delivered a handful raced nothing.
    assert!(
        counts.len() >= 32,
        "the hosts delivered only {} keys",
        counts.len()
    );
    for (key, n) in &counts {
        assert_eq!(*n, 1, "{key} reached the transport {n} times");
    }
    let outbox = engine.open();
    for key in counts.keys() {
        let item = outbox.get(key).unwrap().expect("a delivered key is known");
        let ambiguous = item.failure_class() == Some(durable_outbox::FailureClass::Ambiguous);
        assert!(
            item.state() == ItemState::Sent || ambiguous,
            "{key} was delivered but is {:?}",
            item.state()
        );
    }
    // A last drain sends what is still queued, and nothing that left already
    // (the killed host's claim, if any, is failed as ambiguous instead).
    let mut resent = Vec::new();
    outbox
        .process_due(|item| {
            if counts.contains_key(item.idempotency_key()) {
                resent.push(item.idempotency_key().to_owned());
            }
            Ok(None)
        })
        .unwrap();
    assert!(resent.is_empty(), "sent again: {resent:?}");
    assert!(
        outbox
            .list_items()
            .unwrap()
            .iter()
            .all(|i| i.state() != ItemState::Queued),
        "everything is decided"
    );
    outbox.verify_audit().unwrap();
}

#[test]
fn a_dropped_connection_is_a_typed_error_with_nothing_half_written_then_reconnects() {
    let Some(engine) = engine() else { return };
    let outbox = engine.open();
    outbox.enqueue(msg("before", "chat-1")).unwrap();
    let url = engine.url();
    let db = url.rsplit('/').next().unwrap().to_owned();
    let server = crate::pg_server::PgServer::shared().unwrap();
    // Every session of the database ends, as in a failover or a cut.
    server.psql(
        &db,
        "SELECT count(pg_terminate_backend(pid, 30000)) FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    );
    let batch = || {
        vec![
            msg("x1", "chat-1"),
            msg("x2", "chat-2"),
            msg("x3", "chat-3"),
        ]
    };
    match outbox.enqueue_many(batch()) {
        Ok(items) => assert_eq!(items.len(), 3),
        Err(Error::Database { .. }) => {
            let other = engine.open();
            for key in ["x1", "x2", "x3"] {
                assert!(
                    other.get(key).unwrap().is_none(),
                    "{key}: nothing half-written"
                );
            }
            // The handle reconnects on its next call.
            assert_eq!(outbox.enqueue_many(batch()).unwrap().len(), 3);
        }
        Err(other) => panic!("a dropped connection must be Error::Database: {other:?}"),
    }
    assert_eq!(
        outbox.process("x2", |_| Ok(None)).unwrap().outcome,
        Outcome::Sent
    );
    assert_eq!(outbox.verify_audit().unwrap().records, 5);
}

/// Runs `sql` on the outbox's database, behind the library's back.
fn psql(engine: &EngineUnderTest, sql: &str) -> String {
    let url = engine.url();
    let db = url.rsplit('/').next().unwrap().to_owned();
    crate::pg_server::PgServer::shared().unwrap().psql(&db, sql)
}

/// A transaction the server aborts to break a real deadlock is run again:
/// the caller gets its item, written once, with one audit record. The cycle
/// is closed by locks taken outside the crate's lock order, as an operator's
/// trigger or another program on the same tables can: inserting `victim`
/// takes advisory locks 1001 then 1002, and a session of the test holds 1002
/// and asks for 1001 once the insert waits for it.
#[test]
fn a_transaction_the_server_aborts_in_a_deadlock_is_run_again_and_writes_once() {
    let Some(engine) = engine() else { return };
    let outbox = engine.open();
    psql(&engine, "CREATE SEQUENCE public.victim_inserts");
    psql(
        &engine,
        "CREATE FUNCTION public.lock_two() RETURNS trigger LANGUAGE plpgsql AS
         $$ BEGIN
              PERFORM nextval('public.victim_inserts');
              PERFORM pg_advisory_xact_lock(1001);
              PERFORM pg_advisory_xact_lock(1002);
              RETURN NEW;
            END $$",
    );
    psql(
        &engine,
        "CREATE TRIGGER lock_two BEFORE INSERT ON durable_outbox.items FOR EACH ROW
         WHEN (NEW.idempotency_key = 'victim') EXECUTE FUNCTION public.lock_two()",
    );
    let mut other = postgres::Client::connect(&engine.url(), postgres::NoTls).unwrap();
    // This session waits long before it looks for a deadlock: the outbox's
    // session (1 s, the default) finds the cycle and is the one aborted.
    other
        .batch_execute("SET deadlock_timeout = '10min'")
        .unwrap();
    let enqueued = within(
        "a deadlocked transaction is rerun, not waited on forever",
        DEADLOCK_LIMIT,
        || {
            let mut tx = other.transaction().unwrap();
            tx.execute("SELECT pg_advisory_xact_lock(1002)", &[])
                .unwrap();
            std::thread::scope(|scope| {
                let enqueuing = scope.spawn(|| outbox.enqueue(msg("victim", "chat-1")));
                // Once the insert holds 1001 and waits for 1002, close the cycle.
                loop {
                    let waiting: i64 = tx
                        .query_one(
                            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'
                               AND classid = 0 AND objid = 1002 AND NOT granted
                               AND database = (SELECT oid FROM pg_database
                                               WHERE datname = current_database())",
                            &[],
                        )
                        .unwrap()
                        .get(0);
                    if waiting > 0 {
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                tx.execute("SELECT pg_advisory_xact_lock(1001)", &[])
                    .unwrap();
                tx.commit().unwrap();
                enqueuing.join().unwrap()
            })
        },
    );
    let item = enqueued.expect("the deadlocked enqueue is run again and succeeds");
    assert_eq!(item.state(), ItemState::Queued);
    assert_eq!(
        psql(&engine, "SELECT last_value FROM public.victim_inserts"),
        "2",
        "the first insert was aborted by the deadlock, the second committed"
    );
    assert_eq!(
        psql(&engine, "SELECT count(*) FROM durable_outbox.items"),
        "1"
    );
    let records = outbox.history("victim").unwrap();
    assert_eq!(records.len(), 1, "one enqueue on record: {records:?}");
    assert_eq!(outbox.verify_audit().unwrap().records, 1);
    assert_eq!(outbox.get("victim").unwrap().unwrap(), item);
}

/// The rerun is bounded: a transaction the server keeps aborting
/// (serialization failures, SQLSTATE 40001, injected by a trigger) runs 5
/// times, then the caller gets `Error::Database` carrying the server's code,
/// and nothing of it is written.
#[test]
fn a_transaction_aborted_every_time_is_run_five_times_then_fails_writing_nothing() {
    let Some(engine) = engine() else { return };
    let outbox = engine.open();
    psql(&engine, "CREATE SEQUENCE public.tries");
    psql(
        &engine,
        "CREATE FUNCTION public.always_conflict() RETURNS trigger LANGUAGE plpgsql AS
         $$ BEGIN
              PERFORM nextval('public.tries');
              RAISE EXCEPTION 'injected conflict' USING ERRCODE = 'serialization_failure';
            END $$",
    );
    psql(
        &engine,
        "CREATE TRIGGER always_conflict BEFORE INSERT ON durable_outbox.items FOR EACH ROW
         EXECUTE FUNCTION public.always_conflict()",
    );
    match outbox.enqueue(msg("never", "chat-1")) {
        Err(e @ Error::Database { .. }) => {
            assert_eq!(e.sqlstate(), Some("40001"), "the server's code: {e:?}");
        }
        other => panic!("the last abort must surface as Error::Database: {other:?}"),
    }
    assert_eq!(psql(&engine, "SELECT last_value FROM public.tries"), "5");
    for table in ["items", "audit", "audit_pending"] {
        assert_eq!(
            psql(
                &engine,
                &format!("SELECT count(*) FROM durable_outbox.{table}")
            ),
            "0",
            "nothing in {table}"
        );
    }
}

/// A drain step the server aborts (its claim's write fails once with a
/// serialization failure) is run again with the picker and the in-flight
/// set as they were before it: the pass still sends every due item once.
/// Without the undo, the pass would count the rolled-back look as done and
/// skip that item.
#[test]
fn a_drain_step_run_again_after_an_abort_still_sends_every_item_once() {
    let Some(engine) = engine() else { return };
    let outbox = engine.open_with(|b| b.rate_limit(u32::MAX, std::time::Duration::from_secs(60)));
    for (key, chat) in [("a", "chat-1"), ("b", "chat-2"), ("c", "chat-3")] {
        outbox.enqueue(msg(key, chat)).unwrap();
    }
    psql(&engine, "CREATE SEQUENCE public.claims");
    psql(
        &engine,
        "CREATE FUNCTION public.first_claim_conflicts() RETURNS trigger LANGUAGE plpgsql AS
         $$ BEGIN
              IF NEW.claimed THEN
                IF nextval('public.claims') = 1 THEN
                  RAISE EXCEPTION 'injected conflict' USING ERRCODE = 'serialization_failure';
                END IF;
              END IF;
              RETURN NEW;
            END $$",
    );
    psql(
        &engine,
        "CREATE TRIGGER first_claim_conflicts BEFORE UPDATE ON durable_outbox.items
         FOR EACH ROW EXECUTE FUNCTION public.first_claim_conflicts()",
    );
    let mut sent = Vec::new();
    let report = outbox
        .process_due(|item| {
            sent.push(item.idempotency_key().to_owned());
            Ok(None)
        })
        .unwrap();
    sent.sort();
    assert_eq!(sent, ["a", "b", "c"], "each item sent once");
    assert_eq!(report.sent, 3, "{report:?}");
    assert_eq!(
        psql(&engine, "SELECT last_value FROM public.claims"),
        "4",
        "one claim aborted, three committed"
    );
    for key in ["a", "b", "c"] {
        assert_eq!(outbox.get(key).unwrap().unwrap().state(), ItemState::Sent);
    }
    assert_eq!(outbox.verify_audit().unwrap().records, 6);
}

/// The keys of rows whose filter columns (what claims, lookups and history
/// read) do not say what the row's document says.
fn rows_disagreeing_with_their_document(engine: &EngineUnderTest) -> String {
    psql(
        engine,
        "SELECT string_agg(idempotency_key, ',') FROM durable_outbox.items, LATERAL
           (SELECT doc::jsonb AS d) AS j
         WHERE destination IS DISTINCT FROM d ->> 'destination'
            OR state IS DISTINCT FROM d ->> 'state'
            OR claimed IS DISTINCT FROM (d ->> 'dispatch_claimed')::boolean
            OR claim_owner IS DISTINCT FROM d ->> 'claim_owner'
            OR next_attempt_at IS DISTINCT FROM (d ->> 'next_attempt_at_utc')::timestamptz
            OR transport_ref IS DISTINCT FROM d ->> 'transport_ref'
            OR created_at IS DISTINCT FROM (d ->> 'created_at_utc')::timestamptz
            OR updated_at IS DISTINCT FROM (d ->> 'updated_at_utc')::timestamptz
            OR seq IS DISTINCT FROM (d ->> 'enqueue_seq')::bigint",
    )
}

/// Every writer keeps a row's columns in step with its document, whatever
/// the lifecycle did to it: enqueued, claimed (checked while its send runs),
/// sent, retried after a `retry_after`, cancelled and requeued, each at a
/// later moment than the last.
#[test]
fn every_rows_columns_say_what_its_document_says() {
    use durable_outbox::SendError;
    let Some(engine) = engine() else { return };
    let outbox = engine.open_with(|b| {
        b.rate_limit(u32::MAX, std::time::Duration::from_secs(60))
            .max_inline_wait(std::time::Duration::ZERO)
    });
    for (key, chat) in [("a", "chat-1"), ("b", "chat-2"), ("c", "chat-3")] {
        outbox.enqueue(msg(key, chat)).unwrap();
    }
    assert_eq!(rows_disagreeing_with_their_document(&engine), "");
    engine.clock.advance(crate::harness::secs(10));
    outbox
        .process("a", |_| {
            // Claimed and committed: the row says so too.
            assert_eq!(rows_disagreeing_with_their_document(&engine), "");
            Ok(Some("ref-a".into()))
        })
        .unwrap();
    engine.clock.advance(crate::harness::secs(10));
    outbox
        .process("b", |_| {
            Err(SendError::retryable("rate_limited").retry_after(crate::harness::secs(30)))
        })
        .unwrap();
    engine.clock.advance(crate::harness::secs(10));
    outbox.cancel("c", "ops", "not needed").unwrap();
    engine.clock.advance(crate::harness::secs(10));
    outbox.requeue("c", "ops", "needed after all").unwrap();
    assert_eq!(outbox.get("a").unwrap().unwrap().state(), ItemState::Sent);
    assert!(
        outbox
            .get("b")
            .unwrap()
            .unwrap()
            .next_attempt_at()
            .is_some()
    );
    assert_eq!(rows_disagreeing_with_their_document(&engine), "");
}

/// Runs `worker.process(key, send)` on a thread, waits until `send` has
/// started, runs `meanwhile` (which makes the claim look dead), then lets
/// `send` return `outcome`. Returns what `process` returned and how often
/// `send` ran. Under a watchdog: `send` is held on a channel.
pub(crate) fn lose_the_claim_while_sending(
    worker: &Outbox,
    key: &str,
    outcome: Result<Option<String>, durable_outbox::SendError>,
    meanwhile: impl FnOnce(),
) -> (Result<durable_outbox::DeliveryReceipt, Error>, usize) {
    let sends = AtomicUsize::new(0);
    let (entered_tx, entered_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let finished = within(
        "a send outlives its owner's session",
        DEADLOCK_LIMIT,
        || {
            std::thread::scope(|scope| {
                let sends = &sends;
                let sending = scope.spawn(move || {
                    worker.process(key, |_| {
                        sends.fetch_add(1, Ordering::SeqCst);
                        entered_tx.send(()).unwrap();
                        release_rx.recv().unwrap();
                        outcome.clone()
                    })
                });
                entered_rx.recv().unwrap();
                meanwhile();
                release_tx.send(()).unwrap();
                sending.join().unwrap()
            })
        },
    );
    (finished, sends.load(Ordering::SeqCst))
}

/// A send that certainly did not deliver, finishing after its claim was
/// declared ambiguous (its owner's session cut): the correction keeps the
/// item failed, with the platform's real code, no longer a possible send;
/// nothing is resent.
#[test]
fn a_failed_send_after_its_claim_was_lost_keeps_the_item_failed_with_its_real_code() {
    let Some(engine) = engine() else { return };
    let worker = engine.open();
    let other = engine.open();
    worker.enqueue(msg("k", "chat-1")).unwrap();
    let (late, sends) = lose_the_claim_while_sending(
        &worker,
        "k",
        Err(durable_outbox::SendError::permanent("chat_not_found")),
        || {
            cut_owner_sessions(&engine);
            let receipt = other.process("k", |_| panic!("never resent")).unwrap();
            assert_eq!(receipt.error_code.as_deref(), Some(AMBIGUOUS_AFTER_RESTART));
        },
    );
    assert_eq!(sends, 1);
    let late = late.unwrap();
    assert_eq!(late.outcome, Outcome::Failed, "{late:?}");
    let item = other.get("k").unwrap().unwrap();
    assert_eq!(item.state(), ItemState::Failed);
    assert_eq!(item.error_code(), Some("chat_not_found"));
    assert_eq!(
        item.maybe_sent_at(),
        None,
        "certainly not delivered: no longer counted as a possible send"
    );
    let records = other.history("k").unwrap();
    let outcomes: Vec<&str> = records.iter().map(|r| r.outcome.as_str()).collect();
    assert_eq!(outcomes, ["queued", "failed", "failed"]);
    let note = records
        .last()
        .and_then(|r| r.note.clone())
        .unwrap_or_default();
    assert!(note.starts_with("correction:"), "{note}");
    assert_eq!(
        other.process_due(|_| panic!("never resent")).unwrap().sent,
        0
    );
    other.verify_audit().unwrap();
}

/// The whole server restarts (crash, immediate stop) while a handle is inside
/// `send`: every session lock died with it, so another handle fails the claim
/// as ambiguous and never resends it; when the send returns, the worker
/// takes its owner lock again and records the delivery as a correction. The
/// worker's next call after the restart succeeds (see `server_restart`).
#[test]
fn a_server_restart_mid_send_makes_the_claim_ambiguous_then_the_finish_corrects_it() {
    let Some(server) = crate::pg_server::PgServer::start() else {
        return;
    };
    let db = server.database();
    let worker = Outbox::postgres(&db.url()).open().unwrap();
    worker.enqueue(msg("k1", "chat-1")).unwrap();
    let (late, sends) =
        lose_the_claim_while_sending(&worker, "k1", Ok(Some("tg-7".into())), || {
            server.crash();
            server.restart();
            let observer = Outbox::postgres(&db.url()).open().unwrap();
            let receipt = observer.process("k1", |_| panic!("never resent")).unwrap();
            assert_eq!(receipt.error_code.as_deref(), Some(AMBIGUOUS_AFTER_RESTART));
            // The worker's idle connections died with the server: its next
            // call finds them closed and runs on a fresh one.
            assert!(worker.get("k1").unwrap().is_some());
        });
    assert_eq!(sends, 1, "sent exactly once");
    let late = late.unwrap();
    assert_eq!(late.outcome, Outcome::Sent, "{late:?}");
    let observer = Outbox::postgres(&db.url()).open().unwrap();
    let item = observer.get("k1").unwrap().unwrap();
    assert_eq!(
        (item.state(), item.transport_ref(), item.attempts()),
        (ItemState::Sent, Some("tg-7"), 1)
    );
    let records = observer.history("k1").unwrap();
    let outcomes: Vec<&str> = records.iter().map(|r| r.outcome.as_str()).collect();
    assert_eq!(outcomes, ["queued", "failed", "sent"]);
    assert!(
        records[2]
            .note
            .as_deref()
            .unwrap_or_default()
            .starts_with("correction:"),
        "{records:?}"
    );
    assert_eq!(
        observer
            .process_due(|_| panic!("never resent"))
            .unwrap()
            .sent,
        0
    );
    assert_eq!(observer.verify_audit().unwrap().records, 3);
}

/// `audit_records` streams a PostgreSQL chain a page (1,000 records) at a
/// time, by seq, so an export of a long chain never holds it whole: a chain
/// of 2,500 records comes out whole, in order, each linked to the one
/// before; and the stream reads the table as it goes, so records sealed
/// after it started, beyond the page it holds, still come out (a stream that
/// read everything at the start would end at 2,500). With failpoints, the
/// pages are counted as they are read: the 1,001st record is the first of
/// the second page, so a stream that loaded everything at once fails.
#[test]
fn a_long_chain_is_streamed_page_by_page_whole_and_in_order() {
    let Some(engine) = engine() else { return };
    #[cfg(feature = "test-failpoints")]
    let outbox = engine.open_with(|b| {
        b.failpoint(
            "postgres.audit_page",
            durable_outbox::FailAction::DelayMs(0),
        )
    });
    #[cfg(not(feature = "test-failpoints"))]
    let outbox = engine.open();
    let pages = || -> u32 {
        #[cfg(feature = "test-failpoints")]
        return outbox.failpoint_hits("postgres.audit_page");
        #[cfg(not(feature = "test-failpoints"))]
        return 0;
    };
    for batch in 0..5 {
        outbox
            .enqueue_many(
                (0..500)
                    .map(|n| msg(&format!("k-{batch}-{n}"), &format!("chat-{n}")))
                    .collect(),
            )
            .unwrap();
    }
    assert_eq!(outbox.audit_head().unwrap().seq, 2_500);
    let mut records = outbox.audit_records().unwrap();
    let first = records.next().unwrap().unwrap();
    assert_eq!(first.seq, 1);
    // Sealed while the stream holds its first page.
    outbox.enqueue(msg("late", "chat-late")).unwrap();
    let mut seqs = vec![first.seq];
    let mut previous = first.hash.clone();
    for record in records {
        let record = record.unwrap();
        if cfg!(feature = "test-failpoints") && (record.seq == 1_000 || record.seq == 1_001) {
            let expected = if record.seq == 1_000 { 1 } else { 2 };
            assert_eq!(
                pages(),
                expected,
                "record {} comes from page {expected} of 1,000 records",
                record.seq
            );
        }
        assert_eq!(
            record.prev_hash, previous,
            "seq {} links to the one before",
            record.seq
        );
        previous.clone_from(&record.hash);
        seqs.push(record.seq);
    }
    assert!(
        seqs.iter().copied().eq(1..=2_501),
        "whole, in order, once each: {} records, the last seq {:?}",
        seqs.len(),
        seqs.last()
    );
    assert_eq!(previous, outbox.audit_head().unwrap().hash);
    assert_eq!(outbox.verify_audit().unwrap().records, 2_501);
    if cfg!(feature = "test-failpoints") {
        // Three pages of records, and the empty one that ends the stream.
        assert_eq!(pages(), 4);
    }
}

/// Another host that found this handle's owner lock free (its session was
/// cut) holds the owner's key for the rest of the transaction in which it
/// settles the dead owner's claims. A claim this handle makes meanwhile must
/// not name its owner while the lock is free: it takes the lock again first
/// (after that transaction ends), so the send it starts is live to every
/// other handle, which answers `InFlight` and never declares it dead.
///
/// The other host is a real handle settling a claim of the cut owner (`j`),
/// held inside that transaction by a table lock of the test's on
/// `audit_pending`, which its commit writes to.
#[test]
fn a_claim_made_while_another_host_settles_the_cut_owners_claims_names_a_held_lock() {
    let Some(engine) = engine() else { return };
    let worker = engine.open();
    worker.enqueue(msg("j", "chat-1")).unwrap();
    worker.enqueue(msg("k", "chat-2")).unwrap();
    let owner = psql(&engine, "SELECT owner_id FROM durable_outbox.owners");
    assert!(!owner.is_empty() && !owner.contains('\n'), "{owner:?}");
    // `j` is claimed by the worker, as its send left it before the cut.
    let forged = psql(
        &engine,
        &format!(
            "UPDATE durable_outbox.items SET claimed = true, claim_owner = '{owner}',
               revision = revision + 1,
               doc = (doc::jsonb || '{{\"claim_owner\": \"{owner}\",
                 \"claimed_at_utc\": \"2026-01-15T09:00:00.000000Z\",
                 \"dispatch_claimed\": true, \"attempts\": 1}}'::jsonb)::text
             WHERE idempotency_key = 'j' RETURNING idempotency_key"
        ),
    );
    assert_eq!(forged, "j");
    let other = engine.open();
    cut_owner_sessions(&engine);

    let mut admin = postgres::Client::connect(&engine.url(), postgres::NoTls).unwrap();
    let mut holding = admin.transaction().unwrap();
    holding
        .batch_execute("LOCK TABLE durable_outbox.audit_pending IN EXCLUSIVE MODE")
        .unwrap();
    let mut watcher = postgres::Client::connect(&engine.url(), postgres::NoTls).unwrap();
    // How many sessions of this database wait for a lock of `locktype`.
    let waiting = |watcher: &mut postgres::Client, locktype: &str| -> i64 {
        watcher
            .query_one(
                "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database
                 WHERE d.datname = current_database() AND l.locktype = $1 AND NOT l.granted",
                &[&locktype],
            )
            .unwrap()
            .get(0)
    };
    let (entered_tx, entered_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let sends = AtomicUsize::new(0);
    let (settled, seen, sent) = within(
        "a claim while another host settles the cut owner's claims",
        DEADLOCK_LIMIT,
        || {
            std::thread::scope(|scope| {
                let (worker, other, sends) = (&worker, &other, &sends);
                // The other host settles `j`: it probes the worker's lock,
                // finds it free, and holds the key until its commit, which
                // waits for the test's table lock.
                let settling =
                    scope.spawn(move || other.process("j", |_| panic!("never resent")).unwrap());
                while waiting(&mut watcher, "relation") == 0 {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                let sending = scope.spawn(move || {
                    worker
                        .process("k", |_| {
                            sends.fetch_add(1, Ordering::SeqCst);
                            entered_tx.send(()).unwrap();
                            release_rx.recv().unwrap();
                            Ok(Some("tr-k".into()))
                        })
                        .unwrap()
                });
                // The worker claims and starts its send at once (a claim
                // writes no audit event), or waits to take its owner lock
                // again (the other host holds its key).
                let mut entered = false;
                while !entered && !sending.is_finished() && waiting(&mut watcher, "advisory") == 0 {
                    entered = entered_rx.try_recv().is_ok();
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                holding.commit().unwrap();
                let settled = settling.join().unwrap();
                if !entered {
                    entered_rx
                        .recv()
                        .expect("the worker's call ended without sending (its panic is above)");
                }
                // The worker is inside `send`: its claim must be live.
                let seen = other.process("k", |_| panic!("never resent")).unwrap();
                release_tx.send(()).unwrap();
                (settled, seen, sending.join().unwrap())
            })
        },
    );
    assert_eq!(
        settled.error_code.as_deref(),
        Some(AMBIGUOUS_AFTER_RESTART),
        "the cut owner's claim is settled: {settled:?}"
    );
    assert_eq!(
        seen.outcome,
        Outcome::InFlight,
        "a send started after the cut is live to other handles: {seen:?}"
    );
    assert_eq!(sent.outcome, Outcome::Sent, "{sent:?}");
    assert_eq!(sends.load(Ordering::SeqCst), 1);
    let records = other.history("k").unwrap();
    let outcomes: Vec<&str> = records.iter().map(|r| r.outcome.as_str()).collect();
    assert_eq!(
        outcomes,
        ["queued", "sent"],
        "no correction: never declared dead"
    );
    other.verify_audit().unwrap();
}

/// A worker listens for other hosts' wake-ups on a session of its own, which
/// is read only while someone waits on it. Every commit of every host still
/// `NOTIFY`s the channel: a session left listening after the worker stopped
/// piles the notifications up, its backend blocks writing them once the
/// socket is full, and the server's notify queue (one for the whole
/// cluster, 8 GB) can no longer be trimmed past it, until every `NOTIFY` on
/// the server fails. So a stopped worker leaves no session listening, while
/// its handle stays open for other calls.
#[test]
fn a_stopped_worker_leaves_no_session_listening_while_its_handle_stays_open() {
    let Some(engine) = engine() else { return };
    let outbox =
        engine.open_real_clock_with(|b| b.rate_limit(u32::MAX, std::time::Duration::from_secs(60)));
    let listening = || sessions_listening(&engine);
    let runtime = crate::harness::runtime();
    within(
        "a worker starts listening, then stops",
        DEADLOCK_LIMIT,
        || run_a_worker_until(&outbox, &runtime, || listening() > 0),
    );
    within(
        "the stopped worker's listening session ends",
        DEADLOCK_LIMIT,
        || {
            while listening() > 0 {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        },
    );
    // The handle goes on.
    outbox.enqueue(msg("after", "chat-1")).unwrap();
    assert_eq!(
        outbox.get("after").unwrap().unwrap().state(),
        ItemState::Queued
    );
}

/// Runs a worker (whose sends succeed) on `outbox` until `until` holds,
/// then stops it and waits for it to return.
fn run_a_worker_until(
    outbox: &durable_outbox::Outbox,
    runtime: &tokio::runtime::Runtime,
    until: impl Fn() -> bool,
) {
    runtime.block_on(async {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let worker = outbox.worker(|_item: durable_outbox::OutboxItem| async {
            Ok::<_, durable_outbox::SendError>(None)
        });
        let running = tokio::spawn(worker.run(async move {
            stopped.await.ok();
        }));
        while !until() {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        stop.send(()).unwrap();
        running.await.unwrap().unwrap();
    });
}

/// How many sessions of the test's database listen for wake-ups.
fn sessions_listening(engine: &EngineUnderTest) -> usize {
    psql(
        engine,
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND query LIKE 'LISTEN%'",
    )
    .parse()
    .unwrap()
}

/// The worker's listening thread unwinding (here a panic where it waits for
/// wake-ups, the second time it does, so its session listens by then) still
/// lowers the handle's count of listeners: once the worker stops, no session
/// listens, as after a clean stop, while the handle stays open.
#[cfg(feature = "test-failpoints")]
#[test]
fn a_listening_thread_that_panics_leaves_no_session_listening() {
    let Some(engine) = engine() else { return };
    let outbox = engine.open_real_clock_with(|b| {
        b.rate_limit(u32::MAX, std::time::Duration::from_secs(60))
            .failpoint(
                "postgres.wait_for_work",
                durable_outbox::FailAction::PanicOnHit(2),
            )
    });
    let runtime = crate::harness::runtime();
    within(
        "a worker listens, its listening thread panics, the worker stops",
        DEADLOCK_LIMIT,
        // Its listening thread waits 50 ms at a time (the default
        // `watch_interval`), so the second wait comes soon.
        || {
            run_a_worker_until(&outbox, &runtime, || {
                outbox.failpoint_hits("postgres.wait_for_work") >= 2
            });
        },
    );
    within(
        "no session listens once the worker stopped",
        DEADLOCK_LIMIT,
        || {
            while sessions_listening(&engine) > 0 {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        },
    );
    outbox.enqueue(msg("after", "chat-1")).unwrap();
    assert_eq!(
        outbox.get("after").unwrap().unwrap().state(),
        ItemState::Queued
    );
}

/// `compact_on_open(false)` marks a handle that only looks (the operator's
/// tool, a probe). On PostgreSQL it keeps two promises: opening a schema
/// that holds no outbox yet stores none of its settings, so the bot's first
/// open stores the bot's own; and opening prunes no history past
/// `history_retention`, whatever the looking handle's clock says.
#[test]
fn a_handle_that_only_looks_stores_no_settings_and_prunes_nothing_on_open() {
    let Some(engine) = engine() else { return };
    let secs = std::time::Duration::from_secs;
    let stored_rows = || psql(&engine, "SELECT count(*) FROM durable_outbox.settings");

    let look = engine
        .builder()
        .compact_on_open(false)
        .rate_limit(5, secs(11))
        .max_attempts(4)
        .open()
        .unwrap();
    let settings = look.settings().unwrap();
    assert!(
        !settings.is_stored("rate_limit") && !settings.is_stored("max_attempts"),
        "the look's settings are its own, not the outbox's"
    );
    assert_eq!(stored_rows(), "0", "nothing stored for the new outbox");
    drop(look);

    let bot = engine
        .builder()
        .rate_limit(3, secs(7))
        .max_attempts(9)
        .history_retention(durable_outbox::Retention::MaxAge(secs(7 * 86_400)))
        .open()
        .unwrap();
    let settings = bot.settings().unwrap();
    assert_eq!(
        (settings.rate_limit().count, settings.max_attempts()),
        (3, 9),
        "the bot's first open stores the bot's settings"
    );
    assert!(settings.is_stored("rate_limit") && settings.is_stored("max_attempts"));
    bot.enqueue(msg("old-sent", "chat-1")).unwrap();
    bot.process("old-sent", |_| Ok(Some("tg-old".into())))
        .unwrap();
    let head = bot.audit_head().unwrap();
    drop(bot);

    // A month later the sent item is past the stored week of retention.
    engine.clock.advance(secs(30 * 86_400));
    let look = engine.builder().compact_on_open(false).open().unwrap();
    assert!(look.get("old-sent").unwrap().is_some(), "nothing pruned");
    assert_eq!(look.audit_head().unwrap(), head, "no `pruned` record");
    assert_eq!(look.settings().unwrap().max_attempts(), 9);
    drop(look);
    // The same open by a bot prunes it: the look's was a real choice.
    let bot = engine.builder().open().unwrap();
    assert!(bot.get("old-sent").unwrap().is_none(), "pruned on open");
    assert_ne!(bot.audit_head().unwrap(), head);
}

/// A worker's listening session that was cut (a server restart, a network
/// cut, a failover) is opened again on its next wait, and `NOTIFY`s sent
/// while nobody listened reached nobody: once it listens again the worker
/// reads the state again, so another host's enqueue committed in between is
/// delivered instead of waiting for the next unrelated wake-up (for an
/// idle worker with nothing deferred, for ever). The wait before the worker
/// listens again is 2 s here (its watch interval), and the enqueue lands in it.
#[test]
fn a_worker_whose_listening_session_was_cut_delivers_what_another_host_enqueued_meanwhile() {
    let Some(engine) = engine() else { return };
    let uncapped = |b: durable_outbox::OutboxBuilder| {
        b.rate_limit(u32::MAX, std::time::Duration::from_secs(60))
    };
    let outbox = engine.open_real_clock_with(uncapped);
    let producer = engine.open_real_clock_with(uncapped);
    let listening = || sessions_listening(&engine);
    let runtime = crate::harness::runtime();
    let report = within(
        "a worker whose listening session was cut is woken by what was enqueued meanwhile",
        DEADLOCK_LIMIT,
        || {
            runtime.block_on(async {
                let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
                let worker = outbox
                    .worker(|item: durable_outbox::OutboxItem| async move {
                        Ok::<_, durable_outbox::SendError>(Some(format!(
                            "tr-{}",
                            item.idempotency_key()
                        )))
                    })
                    .watch_interval(std::time::Duration::from_secs(2));
                let running = tokio::spawn(worker.run(async move {
                    stopped.await.ok();
                }));
                while listening() == 0 {
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                }
                // The cut: the listening session ends (waited for), then
                // another host enqueues while nobody listens.
                psql(
                    &engine,
                    "SELECT count(pg_terminate_backend(pid, 30000)) FROM pg_stat_activity
                     WHERE datname = current_database() AND query LIKE 'LISTEN%'",
                );
                producer.enqueue(msg("meanwhile", "chat-1")).unwrap();
                while producer.get("meanwhile").unwrap().unwrap().state() != ItemState::Sent {
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
                stop.send(()).unwrap();
                running.await.unwrap().unwrap()
            })
        },
    );
    assert_eq!(report.sent, 1);
}

/// The outcomes on record for `key`, in order.
#[cfg(feature = "test-failpoints")]
fn outcomes(outbox: &Outbox, key: &str) -> Vec<durable_outbox::AuditOutcome> {
    outbox
        .history(key)
        .unwrap()
        .iter()
        .map(|record| record.outcome)
        .collect()
}

/// A handle records what its sends did in one round trip: decided from the
/// version its own claim committed, sent with its `COMMIT` (see
/// `engine::postgres::speculate`). The failpoint counts the records that
/// went that way (it never fires).
#[cfg(feature = "test-failpoints")]
#[test]
fn a_handle_records_its_sends_from_the_version_its_claims_committed() {
    use durable_outbox::FailAction;
    let Some(engine) = engine() else { return };
    let outbox = engine.open_with(|b| {
        b.failpoint(
            "postgres.speculation_lost_unsent",
            FailAction::ErrorOnHit(u32::MAX),
        )
    });
    send_each(&outbox, &["a", "b", "c"]);
    assert_eq!(
        outbox.failpoint_hits("postgres.speculation_lost_unsent"),
        3,
        "every record went the one-round-trip way"
    );
    // Queued and sent, for each.
    assert_eq!(outbox.verify_audit().unwrap().records, 6);
}

/// A record whose connection was lost after its `COMMIT` was carried out
/// (its answer lost) is found committed by reading the item again: reported
/// as what it was, on record once, not decided again as a lost claim.
#[cfg(feature = "test-failpoints")]
#[test]
fn a_record_whose_answer_was_lost_after_it_committed_is_reported_once() {
    a_record_lost_once_is_settled("postgres.speculation_lost_committed");
}

/// A record whose connection was lost before anything reached the server
/// is found not committed by reading the item again, and made the usual way.
#[cfg(feature = "test-failpoints")]
#[test]
fn a_record_whose_connection_was_lost_before_it_was_sent_is_made_the_usual_way() {
    a_record_lost_once_is_settled("postgres.speculation_lost_unsent");
}

/// Enqueues each key to a chat of its own and processes it with a send that
/// delivers it as `m-<key>`: each is reported and stored as sent.
#[cfg(feature = "test-failpoints")]
fn send_each(outbox: &Outbox, keys: &[&str]) {
    for key in keys {
        outbox.enqueue(msg(key, &format!("chat-{key}"))).unwrap();
        let receipt = outbox
            .process(key, |_| Ok(Some(format!("m-{key}"))))
            .unwrap();
        assert_eq!(receipt.outcome, Outcome::Sent, "{key}");
        let item = outbox.get(key).unwrap().unwrap();
        assert_eq!(
            (item.state(), item.transport_ref()),
            (ItemState::Sent, Some(format!("m-{key}").as_str())),
            "{key}"
        );
    }
}

/// The first one-round-trip record loses its connection at `failpoint`
/// (once), the second does not: both are sent, on record as a plain send
/// is, and the chain holds each item's two records once.
#[cfg(feature = "test-failpoints")]
fn a_record_lost_once_is_settled(failpoint: &str) {
    use durable_outbox::FailAction;
    let Some(engine) = engine() else { return };
    let outbox = engine.open_with(|b| b.failpoint(failpoint, FailAction::ErrorOnHit(1)));
    send_each(&outbox, &["lost", "plain"]);
    assert_eq!(
        outbox.failpoint_hits(failpoint),
        2,
        "the loss was exercised once, then a record went through"
    );
    assert_eq!(outcomes(&outbox, "lost"), outcomes(&outbox, "plain"));
    assert_eq!(outbox.verify_audit().unwrap().records, 4);
}
