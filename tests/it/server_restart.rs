//! A PostgreSQL server restart costs the bot no call: a pooled connection
//! that the restart closed is found dead on its next use, and work that
//! cannot have committed anything yet (a read; a transaction whose opening
//! pipeline failed) runs again on a fresh connection. A connection lost
//! during `COMMIT` is still the error it is (it may have committed) and is
//! never run again. What a restart means for claims in flight (ambiguous,
//! never resent, corrected at finish) is in
//! `postgres_outbox::a_server_restart_mid_send_makes_the_claim_ambiguous_then_the_finish_corrects_it`.

use durable_outbox::{Error, ItemState, Outbox, Outcome};

use crate::harness::{DEADLOCK_LIMIT, msg, within};

/// More calls than a handle keeps idle connections (8), all at once, so the
/// pool holds several connections when the server restarts.
const CONCURRENT_CALLS: usize = 12;

#[test]
fn after_a_server_restart_the_next_enqueue_and_process_succeed() {
    let Some(server) = crate::pg_server::PgServer::start() else {
        return;
    };
    let db = server.database();
    let outbox = Outbox::postgres(&db.url()).open().unwrap();
    outbox.enqueue(msg("before", "chat-1")).unwrap();
    assert_eq!(
        outbox
            .process("before", |_| Ok(Some("tr-0".into())))
            .unwrap()
            .outcome,
        Outcome::Sent
    );
    // Several connections in the pool: calls that overlap each take one.
    within("concurrent calls fill the pool", DEADLOCK_LIMIT, || {
        std::thread::scope(|scope| {
            for n in 0..CONCURRENT_CALLS {
                let outbox = &outbox;
                scope.spawn(move || {
                    outbox
                        .enqueue(msg(&format!("fill-{n}"), &format!("chat-fill-{n}")))
                        .unwrap();
                    outbox.get("before").unwrap();
                });
            }
        });
    });
    for round in 0..2 {
        server.crash();
        server.restart();
        // Every idle connection of the pool died with the server: the very
        // next call of each kind succeeds.
        let key = format!("after-{round}");
        outbox
            .enqueue(msg(&key, &format!("chat-after-{round}")))
            .unwrap();
        let receipt = outbox
            .process(&key, |_| Ok(Some(format!("tr-after-{round}"))))
            .unwrap();
        assert_eq!(receipt.outcome, Outcome::Sent, "{receipt:?}");
        let item = outbox.get(&key).unwrap().unwrap();
        assert_eq!(
            (item.state(), item.attempts()),
            (ItemState::Sent, 1),
            "sent once"
        );
    }
    // Reads right after a restart, too.
    server.crash();
    server.restart();
    assert_eq!(outbox.list_items().unwrap().len(), 3 + CONCURRENT_CALLS);
    let drained = outbox.process_due(|_| Ok(None)).unwrap();
    assert_eq!(drained.sent, CONCURRENT_CALLS, "{drained:?}");
    assert_eq!(
        outbox.verify_audit().unwrap().records,
        2 * (3 + CONCURRENT_CALLS) as u64
    );
}

/// A deferred trigger kills the session inside `COMMIT` of the first
/// enqueue that reaches it: that enqueue returns `Error::Database` (it may,
/// in general, have committed: the caller re-reads), it is not run again
/// on another connection, and the next call goes through.
#[test]
fn a_connection_lost_during_commit_is_an_error_never_a_rerun() {
    let Some(engine) = crate::engines::EngineUnderTest::postgres() else {
        return;
    };
    let outbox = engine.open();
    outbox.enqueue(msg("first", "chat-1")).unwrap();
    let url = engine.url();
    let db = url.rsplit('/').next().unwrap().to_owned();
    let server = crate::pg_server::PgServer::shared().unwrap();
    server.psql(
        &db,
        "CREATE SEQUENCE public.commit_kills;
         CREATE FUNCTION public.die_in_commit() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF nextval('public.commit_kills') = 1 THEN
                 PERFORM pg_terminate_backend(pg_backend_pid());
                 PERFORM pg_sleep(5);
             END IF;
             RETURN NULL;
         END $$;
         CREATE CONSTRAINT TRIGGER die_in_commit AFTER INSERT ON durable_outbox.items
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION public.die_in_commit();",
    );
    match outbox.enqueue(msg("lost", "chat-1")) {
        Err(Error::Database { .. }) => {}
        other => panic!("a session lost in COMMIT must be an error, not a rerun: {other:?}"),
    }
    assert_eq!(
        server.psql(&db, "SELECT last_value FROM public.commit_kills"),
        "1",
        "the transaction ran once"
    );
    // This one died before its commit took effect: nothing of it is there,
    // and the handle goes on.
    assert!(outbox.get("lost").unwrap().is_none());
    outbox.enqueue(msg("lost", "chat-1")).unwrap();
    assert_eq!(outbox.list_items().unwrap().len(), 2);
    assert_eq!(outbox.verify_audit().unwrap().records, 2);
}

/// A database (or role, or server) set to `synchronous_commit = off`, a
/// common tuning, acknowledges a commit before its WAL is on disk: a server
/// crash then takes back an enqueue that returned (lost) and a claim made
/// before `send` (the item queued again: sent twice). The outbox's
/// connections commit synchronously whatever the server's default. On a
/// server whose WAL writer waits 10 s between flushes, nothing else makes
/// the commits durable before the crash.
#[test]
fn an_enqueue_and_a_claim_survive_a_server_crash_on_a_database_that_commits_asynchronously() {
    let Some(server) = crate::pg_server::PgServer::start() else {
        return;
    };
    server.delay_the_wal_writer();
    let db = server.database();
    db.psql(&format!(
        "ALTER DATABASE {} SET synchronous_commit = off",
        db.name()
    ));
    let outbox = Outbox::postgres(&db.url()).open().unwrap();
    outbox.enqueue(msg("a", "chat-1")).unwrap();
    server.crash();
    server.restart();
    let item = outbox.get("a").unwrap();
    assert_eq!(
        item.map(|i| (i.state(), i.attempts())),
        Some((ItemState::Queued, 0)),
        "the enqueue returned before the crash: it must not be lost"
    );
    // The claim is committed before `send` runs; the server crashes during
    // the send, so the outcome is never recorded.
    let crashed = outbox.process("a", |_| {
        server.crash();
        Ok(Some("tr-a".into()))
    });
    assert!(
        crashed.is_err(),
        "the finish met a crashed server: {crashed:?}"
    );
    server.restart();
    drop(outbox);
    let outbox = Outbox::postgres(&db.url()).open().unwrap();
    let mut resent = 0;
    let receipt = outbox
        .process("a", |_| {
            resent += 1;
            Ok(Some("tr-a-again".into()))
        })
        .unwrap();
    assert_eq!(
        (resent, receipt.outcome),
        (0, Outcome::Failed),
        "the claim made before the first send survived: the item is ambiguous, never resent"
    );
}
