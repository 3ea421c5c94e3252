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

fn not_supported(result: Result<impl std::fmt::Debug, Error>, operation: &str) {
    match result {
        Err(Error::NotSupported {
            engine: "postgres",
            operation: op,
            ..
        }) if op == operation => {}
        other => panic!("{operation} on postgres: expected NotSupported, got {other:?}"),
    }
}

#[test]
fn what_the_postgres_engine_lacks_is_a_typed_error_naming_it() {
    let Some(engine) = engine() else { return };
    let outbox = engine.open();
    assert_eq!(
        outbox.dir(),
        None,
        "an outbox in PostgreSQL has no directory"
    );
    outbox.enqueue(msg("a", "chat-1")).unwrap();
    let refused = outbox.remove_old_audit_segments(0, "alice", "tidy");
    let message = format!("{refused:?}");
    not_supported(refused, "remove_old_audit_segments");
    assert!(message.contains("postgres"), "{message}");
    // Nothing was written, and the outbox is still fine afterwards.
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

/// Kills every owner session (each handle's advisory-lock connection) as a
/// network cut or a server restart would; handles take their lock again on
/// their next call.
fn cut_owner_sessions(engine: &EngineUnderTest) {
    let url = engine.url();
    let db = url.rsplit('/').next().unwrap().to_owned();
    let server = crate::pg_server::PgServer::shared().unwrap();
    server.psql(
        &db,
        "SELECT count(pg_terminate_backend(pid)) FROM pg_locks
         WHERE locktype = 'advisory' AND granted AND pid <> pg_backend_pid()",
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
    assert!(!counts.is_empty(), "the hosts delivered something");
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
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
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
