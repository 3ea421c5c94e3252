//! A PostgreSQL handle opens at most `max_connections` connections for its
//! reads and commits, however many calls run at once: a call that finds
//! them all in use waits for one, never deadlocks (no call holds one while
//! waiting for a second), and after the wait's bound gets a typed error
//! naming the cap.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, mpsc};

use durable_outbox::{Error, Outbox, Outcome};

use crate::engines::EngineUnderTest;
use crate::harness::{DEADLOCK_LIMIT, msg, uncapped, within};

/// The crate's connections to the test's database (its `application_name`;
/// the poller's own `psql` session has another). Besides the reads/commits
/// connections, an open handle that enqueued has two dedicated ones: its
/// owner lock and its wake-up sender (no worker listens in these tests).
fn crate_sessions(db: &str) -> usize {
    crate::pg_server::PgServer::shared()
        .unwrap()
        .psql(
            db,
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND application_name = 'durable-outbox'",
        )
        .trim()
        .parse()
        .unwrap()
}

/// The name of the test's database.
fn db_of(engine: &EngineUnderTest) -> String {
    engine.url().rsplit('/').next().unwrap().to_owned()
}

/// How many of the crate's sessions in `watcher`'s database wait on a lock.
fn sessions_waiting_on_a_lock(watcher: &mut postgres::Client) -> i64 {
    watcher
        .query_one(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'
               AND application_name = 'durable-outbox'",
            &[],
        )
        .unwrap()
        .get(0)
}

/// An outbox (no rate cap) of at most `cap` connections whose wait for one
/// is bounded at 2 s: `connect_timeout` 1 s plus `tcp_user_timeout` 1 s.
fn capped_with_a_2_s_bound(engine: &EngineUnderTest, cap: usize) -> Outbox {
    let url = format!("{}?connect_timeout=1&tcp_user_timeout=1000", engine.url());
    uncapped(Outbox::postgres(&url))
        .max_connections(cap)
        .open()
        .unwrap()
}

/// The handle's dedicated sessions counted by [`crate_sessions`].
const DEDICATED: usize = 2;

#[test]
fn sixteen_threads_on_a_cap_of_two_all_succeed_and_never_exceed_it() {
    let Some(engine) = EngineUnderTest::postgres() else {
        return;
    };
    let cap = 2;
    let outbox = engine.open_with(|b| uncapped(b).max_connections(cap));
    // Warm: the owner lock and the wake-up sender are open.
    outbox.enqueue(msg("warm", "chat-warm")).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let (first_sample, first_taken) = mpsc::channel();
    let poller = {
        let stop = Arc::clone(&stop);
        let db = db_of(&engine);
        std::thread::spawn(move || {
            let mut most = 0;
            let mut samples = 0;
            while !stop.load(Ordering::SeqCst) {
                most = most.max(crate_sessions(&db));
                samples += 1;
                if samples == 1 {
                    first_sample.send(()).unwrap();
                }
            }
            (most, samples)
        })
    };
    first_taken.recv().unwrap();
    let (threads, each) = (16, 6);
    within(
        "no deadlock under the connection cap",
        DEADLOCK_LIMIT,
        || {
            let start = Barrier::new(threads);
            std::thread::scope(|scope| {
                for t in 0..threads {
                    let (outbox, start) = (&outbox, &start);
                    scope.spawn(move || {
                        start.wait();
                        for i in 0..each {
                            let key = format!("t{t}-{i}");
                            outbox
                                .enqueue(msg(&key, &format!("chat-{t}")))
                                .unwrap_or_else(|e| panic!("enqueue {key}: {e}"));
                            let receipt = outbox
                                .process(&key, |_| Ok(None))
                                .unwrap_or_else(|e| panic!("process {key}: {e}"));
                            assert_eq!(receipt.outcome, Outcome::Sent, "{key}");
                        }
                    });
                }
            });
        },
    );
    // Idle connections stay open after the burst: one more sample sees them.
    let after = crate_sessions(&db_of(&engine));
    stop.store(true, Ordering::SeqCst);
    let (most, samples) = poller.join().unwrap();
    let most = most.max(after);
    assert!(samples > 1, "the poller sampled while the threads ran");
    assert!(
        most <= cap + DEDICATED,
        "at most {cap} reads/commits sessions (plus {DEDICATED} dedicated) were ever open; \
         saw {most} sessions"
    );
    let items = u64::try_from(threads * each).unwrap();
    assert_eq!(outbox.verify_audit().unwrap().records, 1 + items * 2);
}

/// Ends every session of the test's database (a server restart, an
/// operator's `pg_terminate_backend`), waiting until they are gone.
fn terminate_sessions(engine: &EngineUnderTest) {
    crate::pg_server::PgServer::shared().unwrap().psql(
        &db_of(engine),
        "SELECT count(pg_terminate_backend(pid, 30000)) FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    );
}

/// A call whose pooled connection turned out dead runs again on another
/// (see `connect`'s stale reruns): with a cap of one, it must give the dead
/// one's slot back before it takes the next, or it waits for itself.
#[test]
fn a_call_on_a_dead_connection_under_a_cap_of_one_runs_again_without_waiting_for_itself() {
    let Some(engine) = EngineUnderTest::postgres() else {
        return;
    };
    let outbox = engine.open_with(|b| uncapped(b).max_connections(1));
    outbox.enqueue(msg("a", "chat-1")).unwrap();
    within(
        "no deadlock under the connection cap",
        DEADLOCK_LIMIT,
        || {
            // A transaction of the rules on the dead connection.
            terminate_sessions(&engine);
            outbox.enqueue(msg("b", "chat-1")).unwrap();
            // A read on the dead connection.
            terminate_sessions(&engine);
            assert!(outbox.get("a").unwrap().is_some());
            // A chain read (sealing first, then the read and its flush, all on
            // one connection).
            terminate_sessions(&engine);
            assert_eq!(outbox.verify_audit().unwrap().records, 2);
        },
    );
}

/// A call that finds every connection of the cap held (here by reads that
/// wait on a table another session locked) waits, and once the bound passes
/// (the URL's `connect_timeout` plus `tcp_user_timeout`: 2 s here) gets
/// `PoolExhausted` naming the cap; the held calls still finish.
#[test]
fn a_call_that_waits_past_the_bound_gets_pool_exhausted_naming_the_cap() {
    let Some(engine) = EngineUnderTest::postgres() else {
        return;
    };
    let cap = 2;
    let outbox = capped_with_a_2_s_bound(&engine, cap);
    outbox.enqueue(msg("a", "chat-1")).unwrap();
    let mut admin = postgres::Client::connect(&engine.url(), postgres::NoTls).unwrap();
    let mut watcher = postgres::Client::connect(&engine.url(), postgres::NoTls).unwrap();
    let mut lock = admin.transaction().unwrap();
    lock.batch_execute("LOCK TABLE durable_outbox.items IN ACCESS EXCLUSIVE MODE")
        .unwrap();
    within(
        "no deadlock under the connection cap",
        DEADLOCK_LIMIT,
        || {
            std::thread::scope(|scope| {
                let held: Vec<_> = (0..cap).map(|_| scope.spawn(|| outbox.get("a"))).collect();
                // Both connections of the cap are lent, their reads waiting on the lock.
                loop {
                    let waiting = sessions_waiting_on_a_lock(&mut watcher);
                    if waiting == i64::try_from(cap).unwrap() {
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                match outbox.get("a") {
                    Err(Error::PoolExhausted {
                        max_connections, ..
                    }) => assert_eq!(max_connections, cap),
                    other => panic!("a call past the bound must be PoolExhausted: {other:?}"),
                }
                lock.rollback().unwrap();
                for call in held {
                    assert!(
                        call.join().unwrap().unwrap().is_some(),
                        "the held reads finish"
                    );
                }
            });
        },
    );
    // The cap's connections are back: calls go on.
    outbox.enqueue(msg("b", "chat-1")).unwrap();
}

#[test]
fn a_cap_of_zero_or_a_cap_on_a_directory_is_refused_naming_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    match Outbox::builder(dir.path()).max_connections(4).open() {
        Err(Error::InvalidConfig {
            setting: "max_connections",
            ..
        }) => {}
        other => panic!("a cap on a directory must be refused: {other:?}"),
    }
    let Some(engine) = EngineUnderTest::postgres() else {
        return;
    };
    match Outbox::postgres(&engine.url()).max_connections(0).open() {
        Err(Error::InvalidConfig {
            setting: "max_connections",
            ..
        }) => {}
        other => panic!("a cap of 0 must be refused: {other:?}"),
    }
}

/// A connection that cannot be opened (here the database refuses new
/// connections) frees the slot taken for it: once the database takes
/// connections again, the next call under a cap of one gets one instead
/// of waiting out the bound (2 s here) and `PoolExhausted`.
#[test]
fn a_connection_that_fails_to_open_frees_its_slot_of_the_cap() {
    let Some(engine) = EngineUnderTest::postgres() else {
        return;
    };
    let outbox = capped_with_a_2_s_bound(&engine, 1);
    outbox.enqueue(msg("a", "chat-1")).unwrap();
    let server = crate::pg_server::PgServer::shared().unwrap();
    let db = db_of(&engine);
    let allow = |allowed: bool| {
        server.psql(
            "postgres",
            &format!("ALTER DATABASE {db} WITH ALLOW_CONNECTIONS {allowed}"),
        );
    };
    allow(false);
    // Its sessions end too (from another database: this one refuses psql).
    server.psql(
        "postgres",
        &format!(
            "SELECT count(pg_terminate_backend(pid, 30000)) FROM pg_stat_activity
             WHERE datname = '{db}'"
        ),
    );
    let refused = outbox.get("a");
    allow(true);
    match refused {
        Err(Error::Database { .. }) => {}
        other => panic!("no connection could be opened: {other:?}"),
    }
    assert!(
        outbox.get("a").unwrap().is_some(),
        "the failed connect's slot is free again"
    );
}

/// A send that delivered is recorded as sent even when every connection of
/// the cap stays lent out past the wait's bound (2 s here) while the record
/// waits: the send happened, and a record given up on would leave its claim
/// to be settled later as an ambiguous failure (or, for an idempotent
/// transport, a resend) of a delivery whose outcome was known.
#[test]
fn a_delivered_send_is_recorded_as_sent_though_the_cap_stays_held_past_the_bound() {
    let Some(engine) = EngineUnderTest::postgres() else {
        return;
    };
    let outbox = capped_with_a_2_s_bound(&engine, 1);
    outbox.enqueue(msg("a", "chat-1")).unwrap();
    outbox.enqueue(msg("b", "chat-2")).unwrap();
    let mut admin = Some(postgres::Client::connect(&engine.url(), postgres::NoTls).unwrap());
    let mut watcher = postgres::Client::connect(&engine.url(), postgres::NoTls).unwrap();
    within(
        "no deadlock under the connection cap",
        DEADLOCK_LIMIT,
        || {
            std::thread::scope(|scope| {
                let outbox = &outbox;
                let mut threads = Vec::new();
                let receipt = outbox
                    .process("a", |_| {
                        let mut admin = admin.take().unwrap();
                        let (locked, is_locked) = mpsc::channel();
                        let (held, is_held) = mpsc::channel::<()>();
                        threads.push(scope.spawn(move || {
                            let mut lock = admin.transaction().unwrap();
                            lock.batch_execute(
                                "LOCK TABLE durable_outbox.items IN ACCESS EXCLUSIVE MODE",
                            )
                            .unwrap();
                            locked.send(()).unwrap();
                            is_held.recv().unwrap();
                            // Two bounded calls one after the other each
                            // wait out the bound: the lock goes two bounds
                            // after the send signalled, and the record began
                            // as the send returned, right after: it has
                            // waited past its own bound by then.
                            for _ in 0..2 {
                                match outbox.get("b") {
                                    Err(Error::PoolExhausted { .. }) => {}
                                    other => panic!("a read past the bound: {other:?}"),
                                }
                            }
                            lock.rollback().unwrap();
                        }));
                        is_locked.recv().unwrap();
                        // The cap's one connection is lent to a read that
                        // waits on the lock.
                        threads.push(scope.spawn(move || {
                            outbox.get("b").unwrap();
                        }));
                        while sessions_waiting_on_a_lock(&mut watcher) == 0 {
                            std::thread::yield_now();
                        }
                        held.send(()).unwrap();
                        Ok(Some("ref-a".to_owned()))
                    })
                    .unwrap_or_else(|e| panic!("the delivered send's record: {e}"));
                assert_eq!(receipt.outcome, Outcome::Sent);
                for thread in threads {
                    thread.join().unwrap();
                }
            });
        },
    );
    let item = outbox.get("a").unwrap().unwrap();
    assert_eq!(item.state(), durable_outbox::ItemState::Sent);
}
