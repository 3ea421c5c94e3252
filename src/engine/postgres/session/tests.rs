//! Dead peers, against a real server: every connection a handle opens asks
//! the server to drop it within the keepalive bounds (a URL's own values
//! win), a call on a connection whose peer stopped answering fails within
//! the answer timeout instead of hanging and closes its session, and
//! dropping the wake-up sender returns while its server does not answer.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests panic loudly"
)]

use std::sync::mpsc;
use std::time::Duration;

use super::super::Connector;
use super::super::liveness::Liveness;
use super::super::notify::{Listener, Sender};
use super::super::test_server::{PgDatabase, PgServer};
use super::Session;

#[path = "../../../../tests/support/stall_proxy.rs"]
mod stall_proxy;
use stall_proxy::StallProxy;

/// The server's view of a session's dead-peer settings, in its base units:
/// keepalive idle, interval (s), count, `tcp_user_timeout` (ms).
const SETTINGS: &str = "SELECT \
    (SELECT setting FROM pg_settings WHERE name = 'tcp_keepalives_idle'), \
    (SELECT setting FROM pg_settings WHERE name = 'tcp_keepalives_interval'), \
    (SELECT setting FROM pg_settings WHERE name = 'tcp_keepalives_count'), \
    (SELECT setting FROM pg_settings WHERE name = 'tcp_user_timeout')";

fn settings_of(session: &mut Session) -> [String; 4] {
    let row = session.query_one("test", SETTINGS, &[]).unwrap();
    [row.get(0), row.get(1), row.get(2), row.get(3)]
}

fn expected(idle: &str, interval: &str, count: &str, user_timeout_ms: &str) -> [String; 4] {
    [idle, interval, count, user_timeout_ms].map(str::to_owned)
}

/// Runs `f` on a thread of its own and returns what it returned, or fails
/// the test, naming `guarantee`, when it has not returned after `limit`.
fn within<T: Send + 'static>(
    limit: Duration,
    guarantee: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (done, result) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(f());
    });
    result
        .recv_timeout(limit)
        .unwrap_or_else(|_| panic!("{guarantee}: still waiting after {limit:?}"))
}

/// A fresh database reached through a [`StallProxy`]: `url` goes through
/// the proxy. Fields drop in order: the proxy closes before the database
/// goes.
struct Stallable {
    url: String,
    proxy: StallProxy,
    _db: PgDatabase<'static>,
}

/// A fresh database behind a proxy, with `query` (the dead-peer bounds
/// under test) on its URL; `None` where no test server runs.
fn behind_a_proxy(query: &str) -> Option<Stallable> {
    let server = PgServer::shared()?;
    let db = server.database();
    let proxy = StallProxy::to(server.port());
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/{}?{query}",
        proxy.port(),
        db.name()
    );
    Some(Stallable {
        url,
        proxy,
        _db: db,
    })
}

/// A whole handle (owner lock, pool, `LISTEN`, wake-up sender) on `url`.
fn open_engine(url: &str) -> super::super::PgEngine {
    super::super::PgEngine::open(
        url,
        super::super::DEFAULT_SCHEMA,
        crate::audit::Hasher::Plain,
    )
    .unwrap()
}

/// A handle on a host that vanished keeps its owner lock, and its claims
/// look alive, until the *server* gives up its session: each connection
/// kind must ask for the bounds at connect (the client's keepalives alone
/// only free the client).
#[test]
fn every_connection_kind_asks_the_server_to_drop_a_dead_peer_within_the_bounds() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let connector = Connector::parse(&db.url()).unwrap();
    let defaults = expected("15", "5", "3", "30000");

    let mut owner = Liveness::take(&connector, "outbox", "owner-settings")
        .unwrap()
        .expect("a fresh owner id is free");
    assert_eq!(
        settings_of(owner.session()),
        defaults,
        "the owner lock's connection"
    );

    let mut listener = Listener::start(&connector, "outbox").unwrap();
    assert_eq!(
        settings_of(listener.session()),
        defaults,
        "the LISTEN connection"
    );

    let mut sync = connector.connect().unwrap();
    let row = sync.query_one(SETTINGS, &[]).unwrap();
    let seen: [String; 4] = [row.get(0), row.get(1), row.get(2), row.get(3)];
    assert_eq!(
        seen, defaults,
        "a synchronous client (migrations, opening checks)"
    );

    // The pool's reads/commits connections: the ones that hold row locks.
    let mut pooled = connector.conn().unwrap();
    let row = pooled.query_one(SETTINGS, &[]).unwrap();
    let seen: [String; 4] = [row.get(0), row.get(1), row.get(2), row.get(3)];
    assert_eq!(seen, defaults, "a pooled reads/commits connection");
    // The wake-up sender's connection: `notify::tests`.
}

/// An operator who tuned the bounds in the URL gets them, on both ends.
#[test]
fn a_urls_own_dead_peer_settings_win_over_the_defaults() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let url = format!(
        "{}?keepalives_idle=7&keepalives_interval=2&keepalives_retries=4&tcp_user_timeout=9000",
        db.url()
    );
    let connector = Connector::parse(&url).unwrap();
    assert_eq!(
        connector.config().get_keepalives_idle(),
        Duration::from_secs(7)
    );
    assert_eq!(connector.answer_timeout(), Duration::from_secs(9));
    let mut session = connector.session().unwrap();
    assert_eq!(
        settings_of(&mut session),
        expected("7", "2", "4", "9000"),
        "the URL's client-side values are asked of the server too"
    );

    // Server settings given in the URL's `options` are left to them.
    let url = format!(
        "{}?options=-c%20tcp_keepalives_count%3D6%20-c%20tcp_user_timeout%3D12000",
        db.url()
    );
    let mut session = Connector::parse(&url).unwrap().session().unwrap();
    assert_eq!(
        settings_of(&mut session),
        expected("15", "5", "6", "12000"),
        "`options` set the count and user timeout; the defaults fill the rest"
    );

    // A URL's own 2 h idle (the client's default value) is kept, not
    // taken for "unset".
    let url = format!("{}?keepalives_idle=7200", db.url());
    let connector = Connector::parse(&url).unwrap();
    assert_eq!(
        connector.config().get_keepalives_idle(),
        Duration::from_secs(7200)
    );
    assert_eq!(
        settings_of(&mut connector.session().unwrap())[0],
        "7200",
        "keepalives_idle=7200 in the URL"
    );
}

/// A peer that acknowledges packets but never answers passes every TCP
/// timeout; the owner lock's check must still end, and report the lock lost
/// (its claims are then never counted as this handle's), within the answer
/// timeout (the URL's `tcp_user_timeout`, here 2 s).
#[test]
fn a_check_of_the_owner_lock_whose_server_stopped_answering_fails_instead_of_hanging() {
    let Some(path) = behind_a_proxy("tcp_user_timeout=2000&connect_timeout=2") else {
        return;
    };
    let connector = Connector::parse(&path.url).unwrap();
    let mut owner = Liveness::take(&connector, "outbox", "owner-stalled")
        .unwrap()
        .expect("a fresh owner id is free");
    assert!(owner.is_held(), "held while the path answers");

    path.proxy.stall();
    let held = within(
        Duration::from_secs(60),
        "a check of the owner lock on a connection whose peer stopped answering ends \
         within the answer timeout",
        move || owner.is_held(),
    );
    assert!(!held, "no answer: the lock counts as lost");

    // Opening a connection through the stalled path fails too (the
    // client's own `connect_timeout` covers only the socket, which the
    // proxy accepts).
    let opened = within(
        Duration::from_secs(60),
        "opening a connection whose server does not answer the startup ends within \
         connect_timeout + the answer timeout",
        move || connector.session().map(drop),
    );
    assert!(
        matches!(opened, Err(crate::Error::Database { op: "connect", .. })),
        "{opened:?}"
    );
}

/// Dropping a handle joins its wake-up sender, which sends what is pending
/// first: with a server that stopped answering, that `NOTIFY` would wait
/// for as long as the answer timeout (here ten minutes), and so would the
/// drop. It must return after at most `CLOSE_WAIT`, leaving the thread to
/// end on its own.
#[test]
fn dropping_the_wake_up_sender_returns_while_its_server_does_not_answer() {
    let Some(path) = behind_a_proxy("tcp_user_timeout=600000") else {
        return;
    };
    let connector = Connector::parse(&path.url).unwrap();
    let sender = Sender::start(&connector, "outbox", Duration::ZERO).unwrap();
    sender.request();
    let stats = sender.settled(Duration::from_secs(60));
    assert_eq!(stats.sent, 1, "the first NOTIFY reached the server");

    path.proxy.stall();
    // This one's NOTIFY never gets an answer.
    sender.request();
    within(
        Duration::from_secs(30),
        "dropping a handle returns within CLOSE_WAIT while its server does not answer",
        move || drop(sender),
    );
}

/// The whole handle: its owner lock, `LISTEN`, pooled and wake-up
/// connections all behind a path that stopped answering, with a wake-up
/// pending. Dropping it returns (within `CLOSE_WAIT` and what closing its
/// sockets takes) instead of waiting for any of them.
#[test]
fn dropping_a_handle_whose_server_stopped_answering_returns() {
    let Some(path) = behind_a_proxy("tcp_user_timeout=600000") else {
        return;
    };
    let engine = open_engine(&path.url);
    // Every connection kind is open: the LISTEN one once a worker waited.
    assert!(engine.wait_for_work(Duration::from_millis(10)).unwrap());
    engine.wake.request();
    assert_eq!(engine.wake.settled(Duration::from_secs(60)).sent, 1);

    path.proxy.stall();
    engine.wake.request();
    within(
        Duration::from_secs(30),
        "dropping a handle returns while its server does not answer",
        move || drop(engine),
    );
}

/// What a claim asks first: that the handle's owner lock is held, taking it
/// again after a cut. With the server no longer answering, the check, the
/// new connection and its verification are each bounded: the claim gets an
/// error (and claims nothing) instead of waiting for ever.
#[test]
fn a_claim_on_a_handle_whose_server_stopped_answering_gets_an_error_in_bounded_time() {
    let Some(path) = behind_a_proxy("tcp_user_timeout=2000&connect_timeout=2") else {
        return;
    };
    let engine = open_engine(&path.url);
    engine.ensure_owner().expect("held while the path answers");

    path.proxy.stall();
    let (engine, owned) = within(
        Duration::from_secs(60),
        "a claim's owner check on a handle whose server stopped answering ends in bounded time",
        move || {
            let owned = engine.ensure_owner();
            (engine, owned)
        },
    );
    assert!(
        matches!(owned, Err(crate::Error::Database { .. })),
        "{owned:?}"
    );
    within(
        Duration::from_secs(30),
        "dropping a handle returns while its server does not answer",
        move || drop(engine),
    );
}

/// A statement left unanswered gives its session up for good: its answer
/// may still come, so the session is out of step; and the `LISTEN`er,
/// which listens again on another connection only once its session reads
/// as closed, would otherwise wait on a connection that hears nothing.
#[test]
fn a_session_whose_statement_went_unanswered_is_closed_for_good() {
    let Some(path) = behind_a_proxy("tcp_user_timeout=1000&connect_timeout=2") else {
        return;
    };
    let connector = Connector::parse(&path.url).unwrap();
    let mut session = connector.session().unwrap();
    assert!(!session.is_closed());
    path.proxy.stall();
    let (session, first) = within(
        Duration::from_secs(60),
        "a statement whose server stopped answering returns within the answer timeout",
        move || {
            let first = session.query_one("test", "SELECT 1", &[]).map(drop);
            (session, first)
        },
    );
    assert!(
        matches!(first, Err(crate::Error::Database { .. })),
        "{first:?}"
    );
    assert!(session.is_closed(), "given up after the missed deadline");
}
