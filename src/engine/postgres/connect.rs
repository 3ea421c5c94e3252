//! How a handle reaches its server: the URL parsed once ([`Connector`]) into
//! the one configuration every connection is opened with (with the dead-peer
//! defaults: keepalives, `tcp_user_timeout`, `connect_timeout`, and the same
//! bounds asked of the server, see [`ServerSettings`]); synchronous clients
//! for migrations and opening checks; dedicated connections with a deadline
//! on every call for the owner lock, `LISTEN` and `NOTIFY`
//! ([`session`](super::session)); and the handle's pool of reads/commits
//! connections ([`conn`](super::conn)), each lent to one caller at a time.
//!
//! **A pooled connection's waits** are bounded by the answer timeout: a
//! peer silent that long is asked, over a new connection, whether the
//! session still runs a statement, and given up when it does not or cannot
//! be asked (a slow statement is never cut: see `wire`'s connection).
//! **Not bounded yet:** a synchronous client's startup and statements (used
//! while opening: migrations, the pooler check) wait for a peer that
//! acknowledges but never answers; a dead network ends them within the
//! keepalive and `tcp_user_timeout` bounds.
//!
//! **A pooled connection can be dead without knowing it.** A connection's
//! socket is read only during a call, so an idle connection whose server
//! restarted (or whose session an operator terminated) looks open until its
//! next statement fails. Work that is safe to run again is then run again on
//! the next connection, once per dead connection and at most
//! [`STALE_RERUNS`] times: a read ([`PgEngine::read`]), and a transaction
//! of the rules whose *opening* pipeline failed (`transact`: `BEGIN` and
//! the gate's statements, before anything of it could commit). A connection
//! lost later in a transaction, and above all during `COMMIT` (which may
//! have committed), is returned as the error it is and never rerun.

use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use postgres::{Client, NoTls};

use super::conn::Conn;
use super::{PgEngine, db, lock};
use crate::error::{Error, Result};
use crate::rules::txn::Wait;

/// How many idle reads/commits connections a handle keeps open between calls.
pub(crate) const IDLE_CONNECTIONS: usize = 8;

/// How many reads/commits connections a handle may have open at once (idle
/// and lent) unless its builder says otherwise
/// (`OutboxBuilder::max_connections`). With the handle's dedicated
/// connections on top (see [`PgEngine::client`]), a handle uses at most 13
/// of the server's `max_connections` (100 by default, shared by everyone).
pub(crate) const MAX_CONNECTIONS: usize = 10;

/// How many times one call runs again on another connection after the one
/// it used turned out dead: once per idle connection of the pool, plus the
/// first fresh one, so a call after a server restart meets every connection
/// the restart closed and still succeeds.
pub(super) const STALE_RERUNS: usize = IDLE_CONNECTIONS;

/// How long opening a connection may take when the URL sets no `connect_timeout`.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Idle time before the first TCP keepalive probe, on both ends of every
/// connection, when the URL sets no `keepalives_idle` (the client library's
/// own default is two hours, the kernel's too).
pub(crate) const KEEPALIVES_IDLE: Duration = Duration::from_secs(15);

/// Time between unanswered keepalive probes (URL: `keepalives_interval`).
pub(crate) const KEEPALIVES_INTERVAL: Duration = Duration::from_secs(5);

/// Unanswered probes after which the connection is given up (URL:
/// `keepalives_retries`): an idle connection whose peer vanished is closed
/// [`KEEPALIVES_IDLE`] + [`KEEPALIVES_INTERVAL`] × this = 30 s after its last
/// traffic.
pub(crate) const KEEPALIVES_RETRIES: u32 = 3;

/// How long sent data may stay unacknowledged before the connection is
/// given up (URL: `tcp_user_timeout`; keepalives do not run while data is
/// outstanding). It is also how long a statement on a dedicated connection
/// (the owner lock, `LISTEN`, `NOTIFY`: see [`session`](super::session)) may
/// go unanswered, which catches a peer that acknowledges but never answers.
pub(crate) const TCP_USER_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs `f`, which uses the synchronous client, so that the client may block
/// the thread:
///
/// - on a worker thread of a multi-thread tokio runtime (a bot calling
///   `get` from async code, a handle dropped there), through
///   `block_in_place`, since the client drives its own small runtime and
///   must not be started inside another;
/// - on a thread that runs a current-thread runtime (`#[tokio::main(flavor
///   = "current_thread")]`, `#[tokio::test]`), where a runtime cannot be
///   started and `block_in_place` is refused, on a scoped helper thread `f`
///   is handed to. The calling thread waits, as for any blocking call, and
///   so do that runtime's other tasks: the `_async` forms leave them running;
/// - elsewhere (plain threads, the blocking pool the `_async` forms use),
///   `f` just runs.
///
/// A panic in `f` is raised again on the calling thread.
pub(crate) fn blocking<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    if on_a_current_thread_runtime() {
        std::thread::scope(|scope| {
            match std::thread::Builder::new()
                .name("durable-outbox-pg".into())
                .spawn_scoped(scope, f)
            {
                Ok(helper) => helper
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
                Err(e) => panic!("could not start a thread for a PostgreSQL call: {e}"),
            }
        })
    } else {
        blocking_here(f)
    }
}

/// Runs `future` to completion on `runtime` (a dedicated connection's own,
/// see [`session`](super::session)), waiting: on a thread inside a
/// current-thread tokio runtime, where a runtime cannot be started, on a
/// scoped helper thread (see [`blocking`]).
pub(crate) fn drive<F>(runtime: &tokio::runtime::Runtime, future: F) -> F::Output
where
    F: std::future::Future + Send,
    F::Output: Send,
{
    if on_a_current_thread_runtime() {
        blocking(|| runtime.block_on(future))
    } else {
        runtime.block_on(future)
    }
}

/// As [`blocking`], for an `f` that must stay on the calling thread (a
/// transaction of the rules, whose closure need not be `Send`). Its
/// reads/commits connections need no runtime (blocking sockets, see
/// [`conn`](super::conn)): they block the calling thread as any blocking call does; the
/// owner session's calls move to a helper thread (see [`blocking`]).
pub(crate) fn blocking_local<T>(f: impl FnOnce() -> T) -> T {
    blocking_here(f)
}

/// Whether this thread runs a tokio runtime that is not multi-threaded (or
/// works for one: its blocking pool, where a helper thread is merely not
/// needed).
fn on_a_current_thread_runtime() -> bool {
    tokio::runtime::Handle::try_current()
        .is_ok_and(|handle| handle.runtime_flavor() != tokio::runtime::RuntimeFlavor::MultiThread)
}

/// `f` through `block_in_place` on a multi-thread runtime's worker, else as is.
fn blocking_here<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

/// Opens connections to one server.
#[derive(Clone)]
pub(crate) struct Connector {
    /// The URL's settings with our defaults where it has none: what every
    /// connection of the handle is opened with (the pooled ones in
    /// [`conn`] too).
    config: tokio_postgres::Config,
    /// `SELECT set_config(…)` of the server-side dead-peer settings the
    /// URL's `options` do not set, and of durable commits, run first on each
    /// connection.
    server_settings: String,
}

impl Connector {
    /// Parses a `postgres://` URL (or `key=value` string). The error never
    /// repeats the URL: it may hold a password.
    ///
    /// Where the URL does not say otherwise, every connection gets a bounded
    /// `connect_timeout` and TCP keepalives and a `tcp_user_timeout` that
    /// close it about 30 s after its peer went silent, and asks the server
    /// for the same on its end (see [`ServerSettings`]): a handle on a dead
    /// host holds its owner lock that long, not the kernel's two hours.
    pub(crate) fn parse(url: &str) -> Result<Self> {
        let mut config: tokio_postgres::Config = url.parse().map_err(|e: postgres::Error| {
            Error::invalid_config(
                "url",
                format!("not a PostgreSQL connection URL ({e}); expected postgres://user@host:port/database"),
            )
        })?;
        let given = named_parameters(url);
        let names = |key: &str| given.iter().any(|(name, _)| name == key);
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        if config.get_application_name().is_none() {
            config.application_name("durable-outbox");
        }
        // `keepalives=0` in the URL turns them off; `keepalives_idle` has no
        // "unset" in the client's config (it reads as its 2 h default), so
        // whether the URL names it decides.
        if !names("keepalives_idle") {
            config.keepalives_idle(KEEPALIVES_IDLE);
        }
        if config.get_keepalives_interval().is_none() {
            config.keepalives_interval(KEEPALIVES_INTERVAL);
        }
        if config.get_keepalives_retries().is_none() {
            config.keepalives_retries(KEEPALIVES_RETRIES);
        }
        match tcp_user_timeout_of(&given)? {
            UserTimeout::Unset => {
                config.tcp_user_timeout(TCP_USER_TIMEOUT);
            }
            // As the client parsed it: none.
            UserTimeout::Off => {}
            UserTimeout::Set(timeout) => {
                config.tcp_user_timeout(timeout);
            }
        }
        let server_settings = ServerSettings::of(&config).statement();
        Ok(Self {
            config,
            server_settings,
        })
    }

    /// The client configuration every connection of the handle is opened with.
    pub(crate) fn config(&self) -> &tokio_postgres::Config {
        &self.config
    }

    /// The statement that asks the server for its end of the dead-peer
    /// bounds and for durable commits (see [`ServerSettings`]), to run first
    /// on a new connection.
    pub(crate) fn server_settings(&self) -> &str {
        &self.server_settings
    }

    /// How long a statement on a dedicated connection may go unanswered:
    /// the URL's `tcp_user_timeout`, or [`TCP_USER_TIMEOUT`].
    pub(crate) fn answer_timeout(&self) -> Duration {
        self.config
            .get_tcp_user_timeout()
            .copied()
            .filter(|t| !t.is_zero())
            .unwrap_or(TCP_USER_TIMEOUT)
    }

    /// How long opening a connection may take in all: the socket's
    /// `connect_timeout` (which the client applies to the socket alone),
    /// then the startup and the server settings, each answer within
    /// [`answer_timeout`](Self::answer_timeout).
    pub(crate) fn open_timeout(&self) -> Duration {
        self.config
            .get_connect_timeout()
            .copied()
            .unwrap_or(CONNECT_TIMEOUT)
            + self.answer_timeout()
    }

    /// A synchronous client (migrations, opening checks), its server-side
    /// settings applied.
    pub(crate) fn connect(&self) -> Result<Client> {
        let mut client = postgres::Config::from(self.config.clone())
            .connect(NoTls)
            .map_err(db("connect"))?;
        client
            .batch_execute(self.server_settings())
            .map_err(db("apply the connection's server settings"))?;
        Ok(client)
    }

    /// A dedicated connection whose every call has a deadline (see
    /// [`session`](super::session)).
    pub(crate) fn session(&self) -> Result<super::session::Session> {
        super::session::Session::open(self)
    }

    /// A reads/commits connection (see [`conn`]), its server-side settings
    /// applied: a host that vanished in the middle of a transaction holds
    /// its row and advisory locks until the server ends its session.
    pub(super) fn conn(&self) -> Result<Conn> {
        let mut conn = blocking(|| Conn::connect(&self.config)).map_err(db("connect"))?;
        // A server that stops answering is found out; a slow statement is not cut.
        conn.watch(self.answer_timeout(), &self.config)
            .map_err(db("connect"))?;
        conn.query(self.server_settings(), &[])
            .map_err(db("apply the connection's server settings"))?;
        Ok(conn)
    }
}

/// The server's end of the dead-peer bounds: the same keepalive timing and
/// `tcp_user_timeout` as the client's, so that the *server* ends the session
/// of a host that vanished (and releases its owner lock: its claims are
/// found orphaned) in about 30 s, not after the kernel's two hours and more.
/// Sent as `set_config` after connecting, not as the startup `options`,
/// which pgbouncer refuses; a setting the URL's `options` already give
/// (`-c tcp_keepalives_idle=…`) is left to them, and one the server does not
/// know (`tcp_user_timeout` before PostgreSQL 12) is skipped.
///
/// And durable commits: a `synchronous_commit` of `off` (a common tuning of
/// a server, database or role, or the URL's `options`) acknowledges a commit
/// before its WAL is flushed, so a server crash would take back an enqueue
/// that returned (lost) or a claim made before `send` (the item queued
/// again: sent twice). Every connection raises `off` to `on`; the stronger
/// or equal levels (`local`, `remote_write`, `on`, `remote_apply`) are left
/// as they are. The handle's own commits that need no flush (sealing, the
/// wake-up `NOTIFY`s) turn it off for themselves.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct ServerSettings {
    /// `(name, value)` to set, in the server's units.
    pub(crate) settings: Vec<(&'static str, String)>,
}

impl ServerSettings {
    fn of(config: &tokio_postgres::Config) -> Self {
        let options = config.get_options().unwrap_or_default();
        let mut settings = Vec::new();
        if config.get_keepalives() {
            let interval = config
                .get_keepalives_interval()
                .unwrap_or(KEEPALIVES_INTERVAL);
            let retries = config
                .get_keepalives_retries()
                .unwrap_or(KEEPALIVES_RETRIES);
            settings.push((
                "tcp_keepalives_idle",
                config.get_keepalives_idle().as_secs().max(1).to_string(),
            ));
            settings.push((
                "tcp_keepalives_interval",
                interval.as_secs().max(1).to_string(),
            ));
            settings.push(("tcp_keepalives_count", retries.to_string()));
        }
        if let Some(timeout) = config.get_tcp_user_timeout() {
            settings.push(("tcp_user_timeout", timeout.as_millis().to_string()));
        }
        settings.retain(|(name, _)| !options_set(options, name));
        Self { settings }
    }

    /// One statement setting them all for the session, with
    /// `synchronous_commit` raised to `on` where it is `off`.
    fn statement(&self) -> String {
        let mut values = String::new();
        for (name, value) in &self.settings {
            for part in ["('", name, "', '", value, "'), "] {
                values.push_str(part);
            }
        }
        format!(
            "SELECT set_config(s.name, s.value, false) \
             FROM (VALUES {values}('synchronous_commit', 'on')) AS s(name, value) \
             WHERE EXISTS (SELECT 1 FROM pg_settings p WHERE p.name = s.name) \
             AND (s.name <> 'synchronous_commit' OR current_setting('synchronous_commit') = 'off')"
        )
    }
}

/// Whether the startup `options` (`-c name=value`, `--name=value`) set `name`.
fn options_set(options: &str, name: &str) -> bool {
    let mut words = options.split_whitespace();
    while let Some(word) = words.next() {
        let setting = if word == "-c" {
            words.next()
        } else {
            word.strip_prefix("-c").or_else(|| word.strip_prefix("--"))
        };
        if setting
            .and_then(|s| s.split_once('='))
            .is_some_and(|(n, _)| n.replace('-', "_") == name)
        {
            return true;
        }
    }
    false
}

/// The parameters a connection string gives, name and value, in either of
/// its forms: the query of a `postgres://` URL (`?keepalives_idle=5&…`, the
/// value as written, not percent-decoded), or a `key=value` string (a quoted
/// value unquoted, its escapes undone). Run on a string the client parsed
/// already, so it only needs to find them, not to validate.
fn named_parameters(url: &str) -> Vec<(String, String)> {
    if let Some(rest) = url
        .strip_prefix("postgresql://")
        .or_else(|| url.strip_prefix("postgres://"))
    {
        // The credentials end at the first '@'; the query starts at the
        // first '?' after them.
        let after_credentials = rest.split_once('@').map_or(rest, |(_, r)| r);
        return after_credentials
            .split_once('?')
            .map(|(_, query)| {
                query
                    .split('&')
                    .filter_map(|pair| pair.split_once('='))
                    .map(|(key, value)| (key.to_owned(), value.to_owned()))
                    .collect()
            })
            .unwrap_or_default();
    }
    let mut pairs = Vec::new();
    let mut chars = url.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| !c.is_whitespace() && *c != '=') {
            key.push(c);
        }
        if key.is_empty() {
            return pairs;
        }
        while chars.next_if(|c| c.is_whitespace() || *c == '=').is_some() {}
        let quoted = chars.next_if_eq(&'\'').is_some();
        let mut value = String::new();
        while let Some(c) = chars.next() {
            match c {
                '\\' => value.extend(chars.next()),
                '\'' if quoted => break,
                c if c.is_whitespace() && !quoted => break,
                c => value.push(c),
            }
        }
        pairs.push((key, value));
    }
}

/// A URL's `tcp_user_timeout`, as [`tcp_user_timeout_of`] reads it.
#[derive(Debug, PartialEq, Eq)]
enum UserTimeout {
    /// Not given: ours ([`TCP_USER_TIMEOUT`]).
    Unset,
    /// Given as 0 or less: the socket option off.
    Off,
    /// Given.
    Set(Duration),
}

/// The URL's `tcp_user_timeout`, read as libpq reads it: in milliseconds
/// (the client library we parse URLs with reads whole seconds, so the same
/// URL would mean a thousand times longer here than in `psql`).
///
/// # Errors
/// [`Error::InvalidConfig`] (field `url`) when the value is not a whole number.
fn tcp_user_timeout_of(given: &[(String, String)]) -> Result<UserTimeout> {
    let Some((_, value)) = given
        .iter()
        .rev()
        .find(|(name, _)| name == "tcp_user_timeout")
    else {
        return Ok(UserTimeout::Unset);
    };
    let millis: i64 = value.trim().parse().map_err(|_| {
        Error::invalid_config(
            "url",
            "tcp_user_timeout must be a whole number of milliseconds (as libpq reads it)",
        )
    })?;
    Ok(match u64::try_from(millis) {
        Ok(millis) if millis > 0 => UserTimeout::Set(Duration::from_millis(millis)),
        _ => UserTimeout::Off,
    })
}

/// The handle's reads/commits connections: those idle between calls, and
/// how many are open in all (idle and lent out), never more than `max`.
///
/// A slot is taken before a connection is opened and freed when the
/// connection is dropped (closed, found dead, or discarded by
/// [`PgEngine::give_back`]); a caller that finds every slot taken and no
/// idle connection waits on `freed` until a connection comes back or a slot
/// frees, or until its deadline.
pub(super) struct Pool {
    state: Mutex<PoolState>,
    /// Signalled once per connection given back idle and per freed slot.
    freed: Condvar,
    max: usize,
}

/// What [`Pool`]'s mutex guards.
struct PoolState {
    idle: Vec<Conn>,
    /// Connections open: idle, lent out, or being opened.
    open: usize,
}

/// A slot taken for a connection being opened: freed when dropped unless
/// the connection opened ([`Slot::filled`]), so a failed or panicking
/// connect never keeps a slot.
struct Slot<'p> {
    pool: &'p Pool,
    filled: bool,
}

impl Slot<'_> {
    fn filled(mut self) {
        self.filled = true;
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        if !self.filled {
            self.pool.closed(None);
        }
    }
}

impl Pool {
    /// An empty pool of at most `max` connections (at least 1).
    pub(super) fn new(max: usize) -> Self {
        Self {
            state: Mutex::new(PoolState {
                idle: Vec::new(),
                open: 0,
            }),
            freed: Condvar::new(),
            max: max.max(1),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, PoolState> {
        lock(&self.state)
    }

    /// An idle connection (maybe dead: the caller finds out), else `None`:
    /// a slot taken for a connection the caller opens (see [`Slot`]);
    /// waiting up to `timeout` for either while every slot is taken (with
    /// `None`, or a timeout too long to count, as long as it takes). Idle
    /// connections found closed are dropped on the way, their slots freed.
    ///
    /// # Errors
    /// [`Error::PoolExhausted`] when `timeout` passes first.
    fn take(&self, timeout: Option<Duration>) -> Result<Option<Conn>> {
        let deadline = timeout.and_then(|timeout| Instant::now().checked_add(timeout));
        let mut state = self.state();
        loop {
            let before = state.idle.len();
            state.idle.retain(|conn| !conn.is_closed());
            state.open -= before - state.idle.len();
            if let Some(conn) = state.idle.pop() {
                return Ok(Some(conn));
            }
            if state.open < self.max {
                state.open += 1;
                return Ok(None);
            }
            let Some(deadline) = deadline else {
                state = self
                    .freed
                    .wait(state)
                    .unwrap_or_else(PoisonError::into_inner);
                continue;
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::PoolExhausted {
                    max_connections: self.max,
                    waited: timeout.unwrap_or_default(),
                });
            }
            state = self
                .freed
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Keeps `conn` idle when there is room ([`IDLE_CONNECTIONS`]); else
    /// hands it back to be closed (its slot freed by [`closed`](Self::closed)).
    fn keep(&self, conn: Conn) -> Option<Conn> {
        let mut state = self.state();
        if state.idle.len() >= IDLE_CONNECTIONS {
            return Some(conn);
        }
        state.idle.push(conn);
        drop(state);
        self.freed.notify_one();
        None
    }

    /// Closes `conn` (if any) and frees its slot, waking one waiter.
    fn closed(&self, conn: Option<Conn>) {
        // Closed before the slot is freed: the next connection is not
        // opened while this one still stands.
        drop(conn);
        let mut state = self.state();
        state.open = state.open.saturating_sub(1);
        drop(state);
        self.freed.notify_one();
    }
}

/// A reads/commits connection lent by [`PgEngine::client`].
pub(super) struct Pooled<'e> {
    engine: &'e PgEngine,
    client: Option<Conn>,
}

impl std::ops::Deref for Pooled<'_> {
    type Target = Conn;

    fn deref(&self) -> &Conn {
        match &self.client {
            Some(client) => client,
            None => unreachable!("taken only in drop"),
        }
    }
}

impl std::ops::DerefMut for Pooled<'_> {
    fn deref_mut(&mut self) -> &mut Conn {
        match &mut self.client {
            Some(client) => client,
            None => unreachable!("taken only in drop"),
        }
    }
}

impl Drop for Pooled<'_> {
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            self.engine.give_back(client);
        }
    }
}

impl PgEngine {
    /// A reads/commits connection of its own for the caller: an idle one of
    /// the pool, or a new one (a closed one is dropped). Given back to the
    /// pool when the guard drops.
    ///
    /// **The cap.** A handle has at most its `max_connections` (see
    /// [`MAX_CONNECTIONS`]) of these open; a caller that finds them all lent
    /// out waits until one comes back or closes, for at most
    /// [`Connector::open_timeout`] (the URL's `connect_timeout` plus its
    /// answer timeout: as long as opening a connection could take; a
    /// transaction recording a send waits as long as it takes, see
    /// [`client_waiting`](Self::client_waiting)). On top
    /// come the handle's dedicated connections: one holding the owner lock,
    /// one listening while a worker waits for work, one sending wake-ups;
    /// and, briefly, one asking the server about a silent connection, and
    /// those of opening and of taking the owner lock again.
    ///
    /// **No call holds a lent connection while taking another** (with the
    /// cap, callers each holding one and waiting for a second could wait
    /// for ever): a stale rerun gives the dead connection back first, and
    /// every path that needs more than one statement (sealing after a
    /// commit, a chain read and `make_reads_durable`, retention) runs them
    /// on the connection it holds.
    ///
    /// # Errors
    /// [`Error::PoolExhausted`] when none came free in time;
    /// [`Error::Database`] when a new connection cannot be opened.
    pub(super) fn client(&self) -> Result<Pooled<'_>> {
        self.client_waiting(Wait::Bounded)
    }

    /// [`client`](Self::client), waiting for a connection of the cap at
    /// most [`Connector::open_timeout`] ([`Wait::Bounded`]) or as long as
    /// it takes ([`Wait::UntilFree`]: a transaction that records a send
    /// which already happened).
    ///
    /// # Errors
    /// As [`client`](Self::client); never [`Error::PoolExhausted`] with
    /// [`Wait::UntilFree`].
    pub(super) fn client_waiting(&self, wait: Wait) -> Result<Pooled<'_>> {
        let timeout = match wait {
            Wait::Bounded => Some(self.connector.open_timeout()),
            Wait::UntilFree => None,
        };
        let client = if let Some(idle) = self.pool.take(timeout)? {
            idle
        } else {
            let slot = Slot {
                pool: &self.pool,
                filled: false,
            };
            let fresh = self.connector.conn()?;
            slot.filled();
            fresh
        };
        Ok(Pooled {
            engine: self,
            client: Some(client),
        })
    }

    /// Runs `op`, a read that is safe to run again, on a pooled connection;
    /// if it fails and its connection turned out closed (see the module
    /// docs), runs it again on another, at most [`STALE_RERUNS`] times.
    ///
    /// # Errors
    /// `op`'s error on a live connection (or on the last one tried), or
    /// [`Error::Database`] when no connection can be opened.
    pub(super) fn read<T>(&self, op: impl FnMut(&mut Conn) -> Result<T>) -> Result<T> {
        self.on_a_live_connection("reading", op)
            .map(|(_client, value)| value)
    }

    /// A pooled connection on which every audit event committed so far is
    /// sealed (what a reader of the chain starts with): sealing is the first
    /// use of the connection, so a dead one is found there and sealing runs
    /// again on another, as [`read`](Self::read) does. Running sealing again
    /// is safe even after a `COMMIT` lost with its connection: it seals
    /// whatever is still pending under the head's row lock, so a second run
    /// only finds less to do.
    ///
    /// # Errors
    /// Sealing's errors, as [`read`](Self::read) returns them.
    pub(super) fn sealed_client(&self) -> Result<Pooled<'_>> {
        let (client, ()) =
            self.on_a_live_connection("sealing", |client| self.seal_before_reading(client))?;
        // A failpoint here stands for the moment between a reader's sealing
        // and its read, when another handle's sealing may commit.
        self.faults
            .check("postgres.before_chain_read")
            .map_err(|e| Error::io(self.place(), "read the audit chain", e))?;
        Ok(client)
    }

    /// Runs `op` (safe to run again) on a pooled connection, and again on
    /// another while it fails on one that turned out closed, at most
    /// [`STALE_RERUNS`] times; returns the connection it succeeded on with
    /// its value. `doing` names the work in the log line of a rerun.
    fn on_a_live_connection<T>(
        &self,
        doing: &'static str,
        mut op: impl FnMut(&mut Conn) -> Result<T>,
    ) -> Result<(Pooled<'_>, T)> {
        let mut reruns = 0;
        loop {
            let mut client = self.client()?;
            match op(&mut client) {
                Err(e) if client.is_closed() && reruns < STALE_RERUNS => {
                    reruns += 1;
                    tracing::info!(
                        schema = %self.schema,
                        error = %e,
                        "a pooled connection was closed (server restart or terminated \
                         session); {doing} again on another"
                    );
                }
                Err(e) => return Err(e),
                Ok(value) => return Ok((client, value)),
            }
        }
    }

    /// Keeps `client` for the next caller (up to [`IDLE_CONNECTIONS`]),
    /// unless it is closed or not idle: a session the server reports inside
    /// a transaction (`ReadyForQuery` status `T`, or `E` for a failed one)
    /// would run the next caller's statements in that transaction, so it is
    /// closed instead (the server rolls the transaction back). A connection
    /// closed here frees its slot of the pool.
    pub(super) fn give_back(&self, client: Conn) {
        if client.in_transaction() && !client.is_closed() {
            tracing::warn!(
                schema = %self.schema,
                "a connection came back with a transaction open on it; closed, not pooled"
            );
            self.pool.closed(Some(client));
            return;
        }
        if client.is_closed() {
            self.pool.closed(Some(client));
            return;
        }
        if let Some(surplus) = self.pool.keep(client) {
            self.pool.closed(Some(surplus));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{Connector, TCP_USER_TIMEOUT, named_parameters, options_set};
    use crate::error::Error;

    /// libpq reads `tcp_user_timeout` in milliseconds; a URL copied from a
    /// `psql` setup must mean the same here, not a thousand times longer.
    #[test]
    fn a_urls_tcp_user_timeout_is_read_in_milliseconds_as_libpq_reads_it() {
        let timeout = |url: &str| {
            Connector::parse(url)
                .unwrap()
                .config()
                .get_tcp_user_timeout()
                .copied()
        };
        assert_eq!(
            timeout("postgres://u@h/db?tcp_user_timeout=30000"),
            Some(Duration::from_secs(30))
        );
        assert_eq!(
            timeout("host=h user=u tcp_user_timeout=2500"),
            Some(Duration::from_millis(2500))
        );
        assert_eq!(timeout("postgres://u@h/db"), Some(TCP_USER_TIMEOUT));
        assert_eq!(
            timeout("postgres://u@h/db?tcp_user_timeout=0"),
            None,
            "0 turns it off"
        );
        assert!(matches!(
            Connector::parse("postgres://u@h/db?tcp_user_timeout=soon"),
            Err(Error::InvalidConfig { .. })
        ));
    }

    #[test]
    fn the_parameters_a_connection_string_names_are_found_in_either_form() {
        let pairs = |url: &str| -> Vec<(String, String)> { named_parameters(url) };
        let owned = |list: &[(&str, &str)]| -> Vec<(String, String)> {
            list.iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        };
        assert_eq!(
            pairs("postgres://u:p%3Fw@h:5432/db?keepalives_idle=5&sslmode=disable"),
            owned(&[("keepalives_idle", "5"), ("sslmode", "disable")])
        );
        assert!(pairs("postgresql://u@h/db").is_empty());
        assert_eq!(
            pairs("host=h password='a b\\' keepalives_idle=9' dbname = d  tcp_user_timeout=4"),
            owned(&[
                ("host", "h"),
                ("password", "a b' keepalives_idle=9"),
                ("dbname", "d"),
                ("tcp_user_timeout", "4"),
            ]),
            "a quoted value with spaces and an escaped quote is one value"
        );
    }

    #[test]
    fn startup_options_that_set_a_server_setting_are_recognised() {
        assert!(options_set(
            "-c tcp_keepalives_idle=5",
            "tcp_keepalives_idle"
        ));
        assert!(options_set("-ctcp_user_timeout=5", "tcp_user_timeout"));
        assert!(options_set(
            "--tcp-keepalives-count=2",
            "tcp_keepalives_count"
        ));
        assert!(!options_set(
            "-c tcp_keepalives_idle=5",
            "tcp_keepalives_count"
        ));
    }
}
