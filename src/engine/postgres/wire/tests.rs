//! The wire client's own guarantees: framing, one round trip per pipeline,
//! statements prepared once, the pipeline's error semantics under one
//! `Sync` (skipped statements, the failed transaction rolled back, steps
//! after a `COMMIT`), binary rows (long ones too), notices and parameter
//! reports passed over, a dead session found closed, a silent server found
//! out (an answer stuck on the way, a server refusing the question), the
//! dead-peer bounds on the socket, and logins (trust, MD5, SCRAM-SHA-256, a
//! Unix socket) with the same typed errors as the `postgres` client. Against
//! the real server of `tests/support`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests panic loudly"
)]

use std::io::Write;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use postgres_protocol::message::backend::Message;

#[allow(
    clippy::duplicate_mod,
    reason = "the session tests load it too; neither module can reach the other's"
)]
#[path = "../../../../tests/support/stall_proxy.rs"]
mod stall_proxy;
use stall_proxy::StallProxy;

use super::frame::{Framed, Socket};
use super::{Connection, WireError};
use crate::engine::postgres::conn::{Conn, Step};
use crate::engine::postgres::test_server::{PgDatabase, PgServer};
use crate::error::Error;

/// A watchdog for waits on the server: far beyond what they need.
const LIMIT: Duration = Duration::from_secs(60);

fn config(url: &str) -> tokio_postgres::Config {
    url.parse().unwrap()
}

fn connect(url: &str) -> Connection {
    Connection::connect(&config(url)).expect("connect")
}

/// `waiter` (watched by the caller) asks for advisory lock `key` while a
/// session of `holder_url` holds it for `held`: whether its statement
/// succeeded, and whether its session was closed after.
fn wait_for_a_lock_held(
    holder_url: &str,
    mut waiter: Connection,
    key: i64,
    held: Duration,
) -> (bool, bool) {
    let mut holder = connect(holder_url);
    holder
        .simple(&format!("SELECT pg_advisory_lock({key})"))
        .unwrap();
    let waiting = std::thread::spawn(move || {
        let lock = format!("SELECT pg_advisory_lock({key})");
        let results = pipeline(&mut waiter, &[(lock.as_str(), &[])]);
        (results.into_iter().all(|r| r.is_ok()), waiter.is_closed())
    });
    std::thread::sleep(held);
    holder
        .simple(&format!("SELECT pg_advisory_unlock({key})"))
        .unwrap();
    waiting.join().unwrap()
}

fn pipeline(
    conn: &mut Connection,
    statements: &[(&str, super::connection::Params<'_>)],
) -> Vec<Result<super::Outcome, WireError>> {
    conn.pipeline(statements).expect("the pipeline is sent")
}

/// A socket pair: a `Framed` reading one end, the other end to write to.
fn framed_pair() -> (Framed, std::os::unix::net::UnixStream) {
    let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
    ours.set_read_timeout(Some(LIMIT)).unwrap();
    (Framed::new(Socket::Unix(ours)), theirs)
}

#[test]
fn a_message_split_across_reads_is_assembled_and_a_bad_length_or_eof_is_an_error() {
    let (mut framed, mut peer) = framed_pair();
    // `ReadyForQuery` (idle), then `ParseComplete`, the first split mid-header.
    let bytes = [b'Z', 0, 0, 0, 5, b'I', b'1', 0, 0, 0, 4];
    let writer = std::thread::spawn(move || {
        peer.write_all(&bytes[..3]).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        peer.write_all(&bytes[3..]).unwrap();
        // A header whose length is below its own size.
        std::thread::sleep(Duration::from_millis(50));
        peer.write_all(&[b'C', 0, 0, 0, 2]).unwrap();
    });
    match framed.next().unwrap() {
        Message::ReadyForQuery(body) => assert_eq!(body.status(), b'I'),
        _ => panic!("expected ReadyForQuery"),
    }
    assert!(matches!(framed.next().unwrap(), Message::ParseComplete));
    let Err(bad) = framed.next() else {
        panic!("a malformed length is an error")
    };
    assert!(
        bad.is_closed(),
        "a malformed message ends the session: {bad}"
    );
    writer.join().unwrap();

    let (mut framed, peer) = framed_pair();
    drop(peer);
    let Err(eof) = framed.next() else {
        panic!("end of stream is an error")
    };
    assert!(eof.is_closed(), "{eof}");
    assert_eq!(eof.to_string(), "connection closed");
}

#[test]
fn a_pipeline_is_one_round_trip_and_each_statement_is_prepared_once_per_session() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    db.psql("CREATE TABLE t (k text PRIMARY KEY, n bigint)");
    let mut conn = connect(&db.url());
    let before = conn.round_trips();
    let run = |conn: &mut Connection, k: &str| {
        let n = 7i64;
        let results = pipeline(
            conn,
            &[
                ("BEGIN", &[]),
                ("INSERT INTO t (k, n) VALUES ($1, $2)", &[&k, &n]),
                ("SELECT n FROM t WHERE k = $1", &[&k]),
                ("COMMIT", &[]),
            ],
        );
        let outcomes: Vec<super::Outcome> = results.into_iter().map(Result::unwrap).collect();
        assert_eq!(outcomes[1].count, 1, "one row inserted");
        assert_eq!(outcomes[2].rows.len(), 1);
        assert_eq!(outcomes[2].rows[0].get::<_, i64>(0), 7);
    };
    run(&mut conn, "a");
    assert_eq!(
        conn.round_trips() - before,
        2,
        "first use: one round trip to prepare every new statement, one to run the pipeline"
    );
    run(&mut conn, "b");
    assert_eq!(
        conn.round_trips() - before,
        3,
        "prepared statements are reused: the whole pipeline is one round trip"
    );
    let prepared = pipeline(
        &mut conn,
        &[("SELECT count(*) FROM pg_prepared_statements", &[])],
    );
    let prepared: i64 = prepared[0].as_ref().unwrap().rows[0].get(0);
    assert_eq!(
        prepared, 5,
        "BEGIN, the insert, the select, COMMIT and this count: each prepared once"
    );
    assert_eq!(
        db.psql("SELECT string_agg(k, ',' ORDER BY k) FROM t"),
        "a,b"
    );
    assert!(!conn.in_transaction());
}

#[test]
fn after_an_error_the_rest_is_skipped_nothing_commits_and_dropping_the_tx_rolls_back() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    db.psql("CREATE TABLE t (k text PRIMARY KEY)");
    let mut conn = Conn::connect(&config(&db.url())).unwrap();
    let zero = 0i32;
    {
        let mut tx = conn.begin();
        let results = tx
            .pipeline_each(&[
                Step::Execute("INSERT INTO t VALUES ($1)", &[&"a"]),
                Step::Query("SELECT 1 / $1::int", &[&zero]),
                Step::Execute("INSERT INTO t VALUES ($1)", &[&"b"]),
                Step::Simple("COMMIT"),
            ])
            .unwrap();
        assert!(results[0].is_ok());
        let failed = results[1].as_ref().expect_err("division by zero");
        assert_eq!(
            failed.code().map(tokio_postgres::error::SqlState::code),
            Some("22012"),
            "{failed}"
        );
        for (i, skipped) in results[2..].iter().enumerate() {
            let skipped = skipped.as_ref().expect_err("skipped");
            assert!(skipped.is_skipped(), "step {}: {skipped}", i + 2);
            assert!(!skipped.is_closed());
        }
        // The caller thought its `COMMIT` ended the transaction.
        tx.ended();
    }
    assert_eq!(db.psql("SELECT count(*) FROM t"), "0", "nothing committed");
    // The failed transaction was rolled back: the session works as new.
    let row = conn.query_one("SELECT count(*) FROM t", &[]).unwrap();
    assert_eq!(row.get::<_, i64>(0), 0);
    let mut tx = conn.begin();
    tx.execute("INSERT INTO t VALUES ($1)", &[&"c"]).unwrap();
    tx.commit().unwrap();
    assert_eq!(db.psql("SELECT string_agg(k, ',') FROM t"), "c");
}

#[test]
fn a_step_after_commit_runs_once_committed_and_its_failure_keeps_the_commit() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    db.psql("CREATE TABLE t (k text PRIMARY KEY)");
    let mut conn = Conn::connect(&config(&db.url())).unwrap();
    let mut tx = conn.begin();
    let results = tx
        .pipeline_each(&[
            Step::Execute("INSERT INTO t VALUES ($1)", &[&"a"]),
            Step::Simple("COMMIT"),
            // After the commit: a duplicate key, its own failure.
            Step::Execute("INSERT INTO t VALUES ($1)", &[&"a"]),
        ])
        .unwrap();
    tx.ended();
    assert!(results[0].is_ok() && results[1].is_ok());
    let e = results[2].as_ref().expect_err("the duplicate fails");
    assert_eq!(
        e.code().map(tokio_postgres::error::SqlState::code),
        Some("23505"),
        "{e}"
    );
    assert_eq!(
        db.psql("SELECT string_agg(k, ',') FROM t"),
        "a",
        "committed"
    );
    // And a successful step after `COMMIT` commits with the `Sync`.
    let mut tx = conn.begin();
    tx.pipeline(&[
        Step::Execute("INSERT INTO t VALUES ($1)", &[&"b"]),
        Step::Simple("COMMIT"),
        Step::Execute("INSERT INTO t VALUES ($1)", &[&"c"]),
    ])
    .unwrap();
    tx.ended();
    assert_eq!(
        db.psql("SELECT string_agg(k, ',' ORDER BY k) FROM t"),
        "a,b,c"
    );
}

#[test]
fn standalone_statements_commit_on_their_own() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    db.psql("CREATE TABLE t (k text PRIMARY KEY)");
    let mut conn = Conn::connect(&config(&db.url())).unwrap();
    let rows = conn
        .query("INSERT INTO t VALUES ($1) RETURNING k", &[&"a"])
        .unwrap();
    assert_eq!(rows[0].get::<_, &str>(0), "a");
    assert_eq!(
        db.psql("SELECT count(*) FROM t"),
        "1",
        "seen by another session"
    );
    let e = conn
        .query("INSERT INTO t VALUES ($1)", &[&"a"])
        .expect_err("duplicate");
    assert_eq!(
        e.code().map(tokio_postgres::error::SqlState::code),
        Some("23505")
    );
    assert_eq!(conn.query("SELECT k FROM t", &[]).unwrap().len(), 1);
}

#[test]
fn rows_decode_in_binary_by_index_and_name_and_row_counts_are_checked() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let mut conn = Conn::connect(&config(&db.url())).unwrap();
    let at: DateTime<Utc> = "2026-01-02T03:04:05.123456Z".parse().unwrap();
    let times = vec![at, at + chrono::Duration::seconds(1)];
    let row = conn
        .query_one(
            "SELECT $1::text AS word, $2::bigint AS n, $3::bool AS yes, $4::timestamptz AS at,
                    NULL::text AS nothing, $5::timestamptz[] AS times, ARRAY['x', 'y'] AS words",
            &[&"héllo", &-42i64, &true, &at, &times],
        )
        .unwrap();
    assert_eq!(row.len(), 7);
    assert_eq!(row.get::<_, &str>("word"), "héllo");
    assert_eq!(row.get::<_, String>(0), "héllo");
    assert_eq!(row.get::<_, i64>("n"), -42);
    assert!(row.get::<_, bool>(2));
    assert_eq!(row.get::<_, DateTime<Utc>>("at"), at);
    assert_eq!(row.get::<_, Option<&str>>("nothing"), None);
    assert_eq!(row.get::<_, Vec<DateTime<Utc>>>("times"), times);
    assert_eq!(row.get::<_, Vec<String>>(6), ["x", "y"]);
    let wrong = row.try_get::<_, i64>("word").expect_err("text is no i64");
    assert!(wrong.to_string().contains("column word"), "{wrong}");
    assert!(row.try_get::<_, &str>("absent").is_err());
    assert!(row.try_get::<_, &str>(7).is_err());
    assert!(
        row.try_get::<_, &str>("nothing").is_err(),
        "NULL is no &str"
    );

    let none = conn
        .query_one("SELECT 1 WHERE false", &[])
        .expect_err("no row");
    assert!(none.to_string().contains("exactly one row"), "{none}");
    let mut tx = conn.begin();
    let two = tx
        .query_opt("SELECT * FROM (VALUES (1), (2)) v", &[])
        .expect_err("two rows");
    assert!(two.to_string().contains("at most one row"), "{two}");
}

#[test]
fn a_bad_parameter_is_refused_before_anything_runs_and_the_session_stays_usable() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    db.psql("CREATE TABLE t (k text PRIMARY KEY, n bigint)");
    let mut conn = connect(&db.url());
    let sql = "INSERT INTO t (k, n) VALUES ($1, $2)";
    let count = conn.pipeline(&[(sql, &[&"a"])]).expect_err("one missing");
    assert!(
        count.to_string().contains("takes 2 parameters, 1 given"),
        "{count}"
    );
    let ty = conn
        .pipeline(&[(sql, &[&"a", &"not a number"])])
        .expect_err("text for bigint");
    assert!(ty.to_string().contains("$2"), "names the parameter: {ty}");
    // Nothing half-sent: the next pipeline runs normally.
    let results = pipeline(&mut conn, &[(sql, &[&"a", &1i64])]);
    assert_eq!(results[0].as_ref().unwrap().count, 1);
    assert_eq!(db.psql("SELECT count(*) FROM t"), "1");

    let syntax = conn
        .pipeline(&[("SELEKT 1", &[])])
        .expect_err("a syntax error fails preparing");
    assert_eq!(
        syntax.code().map(tokio_postgres::error::SqlState::code),
        Some("42601"),
        "{syntax}"
    );
    assert!(!conn.is_closed());
    let results = pipeline(&mut conn, &[("SELECT 1", &[])]);
    assert!(results[0].is_ok());
}

#[test]
fn a_terminated_session_is_found_closed_and_fails_at_once_afterwards() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let mut conn = Conn::connect(&config(&db.url())).unwrap();
    let pid: i32 = conn
        .query_one("SELECT pg_backend_pid()", &[])
        .unwrap()
        .get(0);
    assert!(!conn.is_closed());
    db.psql(&format!("SELECT pg_terminate_backend({pid})"));
    let deadline = Instant::now() + LIMIT;
    // The server may take a moment to end the session; until it does, a
    // statement still runs.
    let e = loop {
        if let Err(e) = conn.query_one("SELECT 1", &[]) {
            break e;
        }
        assert!(
            Instant::now() < deadline,
            "watchdog: the session never ended"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(conn.is_closed(), "a terminated session is closed: {e}");
    let again = conn.query_one("SELECT 1", &[]).expect_err("closed");
    assert!(again.is_closed() && again.to_string() == "connection closed");
}

/// Logins with passwords need `pg_hba.conf` lines: these two roles log in
/// over TCP with MD5 and SCRAM-SHA-256 (set once on the shared server).
fn password_roles(server: &PgServer) {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        server.psql(
            "postgres",
            "SET password_encryption = 'md5'; CREATE ROLE wire_md5 LOGIN PASSWORD 'md5-pw'",
        );
        server.psql(
            "postgres",
            "SET password_encryption = 'scram-sha-256'; \
             CREATE ROLE wire_scram LOGIN PASSWORD 'scram-pw'",
        );
        let hba = server.data_dir().join("pg_hba.conf");
        let old = std::fs::read_to_string(&hba).unwrap();
        std::fs::write(
            &hba,
            format!(
                "host all wire_md5 127.0.0.1/32 md5\n\
                 host all wire_scram 127.0.0.1/32 scram-sha-256\n{old}"
            ),
        )
        .unwrap();
        server.psql("postgres", "SELECT pg_reload_conf()");
        // The reload is asynchronous: wait until a password is asked for.
        let deadline = Instant::now() + LIMIT;
        let url = format!(
            "postgres://wire_scram:wrong@127.0.0.1:{}/postgres",
            server.port()
        );
        while Connection::connect(&config(&url)).is_ok() {
            assert!(
                Instant::now() < deadline,
                "watchdog: pg_hba.conf was never reloaded"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    });
}

#[test]
fn md5_and_scram_logins_work_and_a_wrong_password_is_the_postgres_clients_typed_error() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    password_roles(server);
    let db = server.database();
    for (user, password) in [("wire_md5", "md5-pw"), ("wire_scram", "scram-pw")] {
        let url = format!(
            "postgres://{user}:{password}@127.0.0.1:{}/{}",
            server.port(),
            db.name()
        );
        let mut conn = Conn::connect(&config(&url)).unwrap_or_else(|e| panic!("{user}: {e}"));
        let who: String = conn
            .query_one("SELECT current_user::text", &[])
            .unwrap()
            .get(0);
        assert_eq!(who, user);

        let wrong = format!(
            "postgres://{user}:not-{password}@127.0.0.1:{}/{}",
            server.port(),
            db.name()
        );
        let connector = crate::engine::postgres::Connector::parse(&wrong).unwrap();
        let ours = connector.conn().expect_err("a wrong password is refused");
        let Err(theirs) = connector.connect() else {
            panic!("refused by postgres too")
        };
        for e in [&ours, &theirs] {
            assert!(
                matches!(e, Error::Database { op: "connect", .. }),
                "{user}: {e:?}"
            );
            assert_eq!(e.sqlstate(), Some("28P01"), "{user}: {e:?}");
        }
        assert!(
            error_chain(&ours).contains("password authentication failed"),
            "{}",
            error_chain(&ours)
        );
        let none = format!(
            "postgres://{user}@127.0.0.1:{}/{}",
            server.port(),
            db.name()
        );
        let missing = crate::engine::postgres::Connector::parse(&none)
            .unwrap()
            .conn()
            .expect_err("no password");
        assert!(matches!(missing, Error::Database { op: "connect", .. }));
        assert!(error_chain(&missing).contains("password"), "{missing:?}");
    }
}

fn error_chain(e: &Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[test]
fn a_unix_socket_url_connects() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let dir = server.data_dir().parent().unwrap();
    let url = format!(
        "host={} port={} user=postgres dbname={}",
        dir.display(),
        server.port(),
        db.name()
    );
    let mut conn = Conn::connect(&config(&url)).expect("over the Unix socket");
    let local: Option<String> = conn
        .query_one("SELECT inet_client_addr()::text", &[])
        .unwrap()
        .get(0);
    assert_eq!(local, None, "a Unix-socket session has no client address");
}

#[test]
fn an_unreachable_server_and_required_tls_are_connect_errors_as_before() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    for url in [
        format!("postgres://u@127.0.0.1:{port}/db"),
        format!("postgres://u@127.0.0.1:{port}/db?sslmode=require"),
        format!("host=/nonexistent-dir port={port} user=u dbname=db"),
    ] {
        let connector = crate::engine::postgres::Connector::parse(&url).unwrap();
        let ours = connector.conn().expect_err("nothing listens");
        let Err(theirs) = connector.connect() else {
            panic!("nothing listens")
        };
        for e in [&ours, &theirs] {
            assert!(
                matches!(e, Error::Database { op: "connect", .. }),
                "{url}: {e:?}"
            );
            assert_eq!(e.sqlstate(), None);
        }
    }
    let Some(server) = PgServer::shared() else {
        return;
    };
    // A live server: TLS still cannot be had, and no session is opened.
    let url = format!("{}?sslmode=require", server.url("postgres"));
    let connector = crate::engine::postgres::Connector::parse(&url).unwrap();
    let ours = connector.conn().expect_err("no TLS");
    assert!(matches!(ours, Error::Database { op: "connect", .. }));
    assert!(error_chain(&ours).contains("TLS"), "{}", error_chain(&ours));
    assert!(connector.connect().is_err(), "nor with the postgres client");
}

#[test]
fn a_transaction_whose_first_pipeline_never_went_out_still_begins_with_its_next() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    db.psql("CREATE TABLE t (k text PRIMARY KEY)");
    let mut conn = Conn::connect(&config(&db.url())).unwrap();
    {
        let mut tx = conn.begin();
        // Refused while preparing: nothing of the pipeline, its `BEGIN`
        // included, reached the server.
        assert!(
            tx.execute("INSERT INTO nowhere VALUES ($1)", &[&"a"])
                .is_err()
        );
        tx.execute("INSERT INTO t VALUES ($1)", &[&"a"]).unwrap();
        // Dropped without a commit: rolled back, so never visible.
    }
    assert_eq!(
        db.psql("SELECT count(*) FROM t"),
        "0",
        "the insert ran inside the transaction, not on its own"
    );
}

#[test]
fn a_pipeline_larger_than_a_part_goes_out_in_parts_and_an_error_stops_the_rest() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    db.psql("CREATE TABLE t (k text PRIMARY KEY, body text)");
    let mut conn = connect(&db.url());
    let sql = "INSERT INTO t (k, body) VALUES ($1, $2)";
    let body = "x".repeat(1000);
    let keys: Vec<String> = (0..200).map(|i| format!("k{i:03}")).collect();
    // Prepared first, so that the round trips below are the pipeline's own.
    pipeline(
        &mut conn,
        &[("BEGIN", &[]), (sql, &[&"warm", &body]), ("ROLLBACK", &[])],
    );
    let run = |conn: &mut Connection, keys: &[String]| {
        let params: Vec<[&(dyn postgres_types::ToSql + Sync); 2]> =
            keys.iter().map(|k| [k as _, &body as _]).collect();
        let mut statements: Vec<(&str, super::connection::Params<'_>)> = vec![("BEGIN", &[])];
        statements.extend(params.iter().map(|p| (sql, &p[..])));
        statements.push(("COMMIT", &[]));
        let before = conn.round_trips();
        let results = pipeline(conn, &statements);
        (results, conn.round_trips() - before)
    };
    // 200 statements of over 1 KiB each: several parts, every one answered.
    let (results, trips) = run(&mut conn, &keys);
    assert!(results.iter().all(Result::is_ok));
    let parts = 200 * 1000 / super::connection::PART;
    assert!(
        trips > parts as u64,
        "{trips} round trips: the pipeline went out in parts"
    );
    assert_eq!(db.psql("SELECT count(*) FROM t"), "200");
    assert!(!conn.in_transaction());
    // A large first statement and a small rest (a large item's write and
    // its `COMMIT`, the transaction begun before): one part, one round trip
    // (the server answers nothing before it has read the large one whole).
    let large = "y".repeat(4 * super::connection::PART);
    assert!(pipeline(&mut conn, &[("BEGIN", &[])])[0].is_ok());
    let before = conn.round_trips();
    let results = pipeline(&mut conn, &[(sql, &[&"large", &large]), ("COMMIT", &[])]);
    assert!(results.iter().all(Result::is_ok));
    assert_eq!(
        conn.round_trips() - before,
        1,
        "a large item and its COMMIT"
    );
    db.psql("DELETE FROM t WHERE k = 'large'");

    // A duplicate key in the first part: the server skips the rest, so the
    // later parts are never sent; nothing commits; the session goes on.
    let mut again: Vec<String> = (200..400).map(|i| format!("k{i:03}")).collect();
    again[3] = "k000".into();
    let (results, trips) = run(&mut conn, &again);
    let e = results[4].as_ref().expect_err("the duplicate");
    assert_eq!(
        e.code().map(tokio_postgres::error::SqlState::code),
        Some("23505"),
        "{e}"
    );
    assert!(results[..4].iter().all(Result::is_ok));
    for skipped in &results[5..] {
        assert!(skipped.as_ref().expect_err("skipped").is_skipped());
    }
    assert_eq!(trips, 2, "the first part, then the `Sync` alone");
    assert_eq!(
        db.psql("SELECT count(*) FROM t"),
        "200",
        "nothing committed"
    );
    assert!(
        conn.in_transaction(),
        "the failed transaction is still open"
    );
    conn.simple("ROLLBACK").unwrap();
    let results = pipeline(&mut conn, &[("SELECT count(*) FROM t", &[])]);
    assert_eq!(results[0].as_ref().unwrap().rows[0].get::<_, i64>(0), 200);
}

/// The bytes of a backend message of kind `tag` with `body`.
fn message(tag: u8, body: &[u8]) -> Vec<u8> {
    let mut out = vec![tag];
    out.extend_from_slice(&u32::try_from(body.len() + 4).unwrap().to_be_bytes());
    out.extend_from_slice(body);
    out
}

#[test]
fn a_claimed_length_is_never_reserved_ahead_and_one_beyond_its_kind_is_refused_at_once() {
    // A row claiming 512 MiB, of which 100 bytes come before the end of the
    // stream: buffered as it arrives, never reserved from its header.
    let (mut framed, mut peer) = framed_pair();
    let mut bytes = vec![b'D'];
    bytes.extend_from_slice(&(512u32 << 20).to_be_bytes());
    bytes.extend_from_slice(&[7; 100]);
    peer.write_all(&bytes).unwrap();
    drop(peer);
    let Err(e) = framed.next() else {
        panic!("the stream ends mid-message")
    };
    assert!(e.is_closed(), "{e}");
    assert!(
        framed.buffered_capacity() < 1 << 20,
        "{} bytes reserved for 105 received",
        framed.buffered_capacity()
    );

    // Kinds that are always short, and any kind beyond the longest allowed:
    // refused at the header, without waiting for a body that may never come
    // (the peer stays open and silent).
    for (tag, len) in [
        (b'C', 1u32 << 20),
        (b'Z', 30_005),
        (b'D', u32::try_from(super::frame::LONG_MESSAGE).unwrap() + 5),
    ] {
        let (mut framed, mut peer) = framed_pair();
        let mut header = vec![tag];
        header.extend_from_slice(&len.to_be_bytes());
        peer.write_all(&header).unwrap();
        let started = Instant::now();
        let Err(e) = framed.next() else {
            panic!("a corrupt length")
        };
        assert!(e.is_closed(), "a corrupt stream ends the session: {e}");
        assert!(e.to_string().contains("claims"), "{e}");
        assert!(started.elapsed() < LIMIT, "refused without waiting");
        drop(peer);
    }
}

mod hostile_server {
    use std::io::Write;

    use proptest::prelude::*;

    use super::super::Connection;
    use super::{framed_pair, message};

    /// Kinds a server sends, and a few it never does.
    const TAGS: &[u8] = b"123nstTDCIEZNASKRvX!";

    fn stream() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..512),
            proptest::collection::vec(
                (
                    proptest::sample::select(TAGS),
                    proptest::collection::vec(any::<u8>(), 0..48)
                ),
                0..12
            )
            .prop_map(|messages| {
                messages
                    .iter()
                    .flat_map(|(tag, body)| message(*tag, body))
                    .collect()
            }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Whatever a server answers, a pipeline returns (typed results or a
        /// typed error): no panic, no wait beyond the stream's end.
        #[test]
        fn any_answer_from_the_server_gives_typed_results_never_a_panic(bytes in stream()) {
            let (framed, mut peer) = framed_pair();
            peer.write_all(&bytes).unwrap();
            peer.shutdown(std::net::Shutdown::Write).unwrap();
            let mut conn = Connection::over(framed);
            let n = 7i64;
            for _ in 0..3 {
                match conn.pipeline(&[("SELECT $1::bigint", &[&n]), ("COMMIT", &[])]) {
                    Ok(results) => {
                        prop_assert_eq!(results.len(), 2);
                        for outcome in results.iter().flatten() {
                            for row in &outcome.rows {
                                let _ = row.try_get::<_, Option<i64>>(0);
                                let _ = row.try_get::<_, Option<String>>(0);
                            }
                        }
                    }
                    Err(e) => { let _ = e.to_string(); }
                }
            }
            prop_assert!(conn.is_closed(), "the stream ended: the session is closed");
            drop(peer);
        }
    }
}

/// Runs `f` on a thread of its own; fails the test naming `guarantee` when
/// it has not returned within [`LIMIT`].
/// Polls `count_sql` (a `count(*)`) on `look` until it counts a row: a
/// session's statement is seen running or waiting on the server. Panics
/// with `never` after [`LIMIT`] (a watchdog).
fn wait_until_counted(look: &mut Connection, count_sql: &str, never: &str) {
    let deadline = Instant::now() + LIMIT;
    loop {
        let rows = pipeline(look, &[(count_sql, &[])]);
        if rows[0].as_ref().unwrap().rows[0].get::<_, i64>(0) > 0 {
            return;
        }
        assert!(Instant::now() < deadline, "watchdog: {never}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn within<T: Send + 'static>(guarantee: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (done, result) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(f());
    });
    result
        .recv_timeout(LIMIT)
        .unwrap_or_else(|_| panic!("watchdog: {guarantee}"))
}

/// A stall proxy in front of `server`, and a URL of `db` through it.
fn behind_a_stall_proxy(server: &PgServer, db: &PgDatabase<'_>) -> (StallProxy, String) {
    let proxy = StallProxy::to(server.port());
    let through = format!(
        "postgres://postgres@127.0.0.1:{}/{}?connect_timeout=2",
        proxy.port(),
        db.name()
    );
    (proxy, through)
}

#[test]
fn a_watched_session_gives_up_a_silent_server_and_never_cuts_a_slow_statement() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    db.psql("CREATE TABLE t (k text PRIMARY KEY)");
    let direct = config(&format!("{}?connect_timeout=2", db.url()));
    let patience = Duration::from_millis(500);

    // A lock wait far longer than the patience: the server is asked, finds
    // the statement running, and the wait goes on to its answer.
    let mut waiter = connect(&db.url());
    waiter.watch(patience, &direct).unwrap();
    assert_eq!(
        wait_for_a_lock_held(&db.url(), waiter, 42, patience * 6),
        (true, false),
        "a slow statement is waited for, however long"
    );

    // The path to the server stalls: the server cannot be asked either (the
    // asking connection takes the same path): given up, in bounded time.
    let (proxy, through) = behind_a_stall_proxy(server, &db);
    let mut conn = connect(&through);
    conn.watch(patience, &config(&through)).unwrap();
    let insert = "INSERT INTO t VALUES ($1)";
    let run = |conn: &mut Connection, k: &'static str| {
        pipeline(conn, &[("BEGIN", &[]), (insert, &[&k]), ("COMMIT", &[])])
    };
    // Prepared while the path answers: the stalled round trip is the pipeline.
    assert!(run(&mut conn, "warm").iter().all(Result::is_ok));
    proxy.stall();
    let (results, closed) = within(
        "a watched session whose server stopped answering gives up",
        move || {
            let results: Vec<String> = run(&mut conn, "a")
                .into_iter()
                .map(|r| r.expect_err("no answer").to_string())
                .collect();
            (results, conn.is_closed())
        },
    );
    assert!(closed);
    assert!(
        results[0].contains("stopped answering") && results[0].contains("unreachable"),
        "{results:?}"
    );

    // The answer is lost on the way while the server, asked directly, finds
    // the backend done and idle: given up after the second look.
    let (proxy, through) = behind_a_stall_proxy(server, &db);
    let mut conn = connect(&through);
    conn.watch(patience, &direct).unwrap();
    let staller = std::thread::spawn({
        let db_url = db.url();
        move || {
            // Once the statement runs on the server, cut the path.
            let mut look = connect(&db_url);
            wait_until_counted(
                &mut look,
                "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep(1.5)%'",
                "the statement never ran",
            );
            proxy.stall();
            proxy
        }
    });
    let (result, closed) = within("a lost answer is found out", move || {
        let results = pipeline(&mut conn, &[("SELECT pg_sleep(1.5)", &[])]);
        (results.into_iter().next().unwrap(), conn.is_closed())
    });
    let _proxy = staller.join().unwrap();
    let e = result.expect_err("the answer never came");
    assert!(closed, "{e}");
    assert!(e.to_string().contains("twice found not running"), "{e}");
}

#[test]
fn an_enqueue_whose_server_went_silent_fails_in_bounded_time() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let proxy = StallProxy::to(server.port());
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/{}?tcp_user_timeout=1000&connect_timeout=2",
        proxy.port(),
        db.name()
    );
    let message = |key: &str| crate::NewMessage {
        idempotency_key: key.into(),
        connector: "telegram".into(),
        grant_id: "bot-1".into(),
        destination: "chat".into(),
        content: "body".into(),
        ..Default::default()
    };
    let outbox = crate::Outbox::postgres(&url).open().unwrap();
    outbox.enqueue(message("before")).unwrap();
    proxy.stall();
    let failed = within(
        "an enqueue on a pooled connection whose server stopped answering returns",
        move || outbox.enqueue(message("after")),
    );
    let e = failed.expect_err("the server never answers");
    assert!(
        matches!(e, Error::Database { .. }),
        "a database error: {e:?}"
    );
    drop(proxy);
    assert_eq!(
        db.psql("SELECT string_agg(idempotency_key, ',') FROM durable_outbox.items"),
        "before",
        "the stalled enqueue never reached the server"
    );
}

#[test]
fn a_row_longer_than_a_short_message_reads_back_whole() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let mut conn = connect(&db.url());
    // A message body of 100 KB, and a row of the engine's own kind: a
    // `DataRow` three times longer than any short message may be.
    let long = 100_000i32;
    let results = pipeline(&mut conn, &[("SELECT repeat('x', $1)", &[&long])]);
    let outcome = results[0].as_ref().expect("a long row is a row");
    assert_eq!(outcome.rows[0].get::<_, &str>(0).len(), 100_000);
    assert!(!conn.is_closed());
}

#[test]
fn notices_and_parameter_reports_between_answers_are_passed_over() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let mut conn = connect(&db.url());
    // Preparing: an identifier longer than the server keeps draws a notice
    // from the parser, between `ParseComplete` and the description.
    let long_name = format!("SELECT 1 AS {}", "n".repeat(80));
    // Running: a `ROLLBACK` with no transaction open draws a warning, a
    // `SET` of a reported setting a `ParameterStatus`, both between the
    // pipeline's answers.
    let results = pipeline(
        &mut conn,
        &[
            (long_name.as_str(), &[]),
            ("ROLLBACK", &[]),
            ("SET application_name = 'renamed'", &[]),
            ("SELECT current_setting('application_name')", &[]),
        ],
    );
    let outcomes: Vec<super::Outcome> = results
        .into_iter()
        .map(|r| r.expect("a notice is no error"))
        .collect();
    assert_eq!(outcomes[0].rows[0].get::<_, i32>(0), 1);
    assert_eq!(outcomes[3].rows[0].get::<_, &str>(0), "renamed");
    assert!(!conn.is_closed());
}

#[test]
fn a_watched_session_whose_answer_is_stuck_on_the_way_is_given_up() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let direct = config(&format!("{}?connect_timeout=2", db.url()));
    let patience = Duration::from_millis(500);
    let (proxy, through) = behind_a_stall_proxy(server, &db);
    let mut conn = connect(&through);
    conn.watch(patience, &direct).unwrap();
    // Half the rows go out, then the statement waits for a lock; once it
    // waits, the path stalls and the lock is freed: the server goes on
    // writing 30 MB of rows that nobody reads, so its backend, asked
    // directly, is "active" but waiting to write to its client.
    let mut holder = connect(&db.url());
    holder.simple("SELECT pg_advisory_lock(44)").unwrap();
    let staller = std::thread::spawn({
        let db_url = db.url();
        move || {
            let mut look = connect(&db_url);
            wait_until_counted(
                &mut look,
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE wait_event_type = 'Lock' AND query LIKE 'SELECT repeat(%'",
                "the statement never waited",
            );
            proxy.stall();
            holder.simple("SELECT pg_advisory_unlock(44)").unwrap();
            proxy
        }
    });
    let (result, closed) = within("an answer stuck on its way is found out", move || {
        let results = pipeline(
            &mut conn,
            &[(
                "SELECT repeat('x', 1000) FROM generate_series(1, 60000) g \
                 WHERE g <> 30000 OR pg_advisory_lock(44)::text IS NOT NULL",
                &[],
            )],
        );
        (results.into_iter().next().unwrap(), conn.is_closed())
    });
    let _proxy = staller.join().unwrap();
    let e = result.expect_err("the rest of the answer never came");
    assert!(closed, "{e}");
    assert!(e.to_string().contains("twice found not running"), "{e}");
}

/// A role allowed one connection: its session's own, so a question about
/// it on a second one is refused (set once on the shared server).
fn single_connection_role(server: &PgServer) {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        server.psql(
            "postgres",
            "CREATE ROLE wire_single LOGIN CONNECTION LIMIT 1",
        );
    });
}

#[test]
fn a_watched_session_waits_on_when_the_server_refuses_the_question() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    single_connection_role(server);
    let db = server.database();
    let url = format!(
        "postgres://wire_single@127.0.0.1:{}/{}?connect_timeout=2",
        server.port(),
        db.name()
    );
    let patience = Duration::from_millis(500);
    let mut waiter = connect(&url);
    waiter.watch(patience, &config(&url)).unwrap();
    // The lock is held several times the patience: each look finds the
    // server refusing a second connection of the role (a server at its
    // connection limit), which is a live server.
    assert_eq!(
        wait_for_a_lock_held(&db.url(), waiter, 45, patience * 6),
        (true, false),
        "a server that refuses the question is alive: the statement is waited for"
    );
}

#[test]
fn a_tcp_session_carries_the_dead_peer_bounds_on_its_own_socket() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let connector = crate::engine::postgres::Connector::parse(&db.url()).unwrap();
    let framed = super::startup::open(connector.config()).expect("open");
    let Socket::Tcp(stream) = framed.socket() else {
        panic!("a host name opens a TCP session")
    };
    let socket = socket2::SockRef::from(stream);
    assert!(socket.keepalive().unwrap(), "keepalives on");
    assert_eq!(
        socket.tcp_keepalive_time().unwrap(),
        Duration::from_secs(15)
    );
    assert_eq!(
        socket.tcp_keepalive_interval().unwrap(),
        Duration::from_secs(5)
    );
    assert_eq!(socket.tcp_keepalive_retries().unwrap(), 3);
    assert_eq!(
        socket.tcp_user_timeout().unwrap(),
        Some(Duration::from_secs(30)),
        "unacknowledged data gives the connection up after 30 s"
    );
}
