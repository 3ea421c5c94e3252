//! How a handle reaches its server: the URL parsed once ([`Connector`]),
//! synchronous clients for the owner lock, `LISTEN`, `NOTIFY` and migrations, and the
//! handle's pool of reads/commits connections ([`conn`](super::conn)),
//! each lent to one caller at a time.
//!
//! **A pooled connection can be dead without knowing it.** A connection's
//! runtime is driven only during a call, so an idle connection whose server
//! restarted (or whose session an operator terminated) looks open until its
//! next statement fails. Work that is safe to run again is then run again on
//! the next connection, once per dead connection and at most
//! [`STALE_RERUNS`] times: a read ([`PgEngine::read`]), and a transaction
//! of the rules whose *opening* pipeline failed (`transact`: `BEGIN` and
//! the gate's statements, before anything of it could commit). A connection
//! lost later in a transaction, and above all during `COMMIT` (which may
//! have committed), is returned as the error it is and never rerun.

use std::time::Duration;

use postgres::{Client, NoTls};

use super::conn::{self, Conn};
use super::{PgEngine, db, lock};
use crate::error::{Error, Result};

/// How many idle reads/commits connections a handle keeps open between calls.
pub(crate) const IDLE_CONNECTIONS: usize = 8;

/// How many times one call runs again on another connection after the one
/// it used turned out dead: once per idle connection of the pool, plus the
/// first fresh one, so a call after a server restart meets every connection
/// the restart closed and still succeeds.
pub(super) const STALE_RERUNS: usize = IDLE_CONNECTIONS;

/// How long opening a connection may take when the URL sets no `connect_timeout`.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

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

/// Runs `future` to completion on `runtime` (a connection's own), waiting:
/// on a thread inside a current-thread tokio runtime, where a runtime
/// cannot be started, on a scoped helper thread (see [`blocking`]); the
/// caller's code (a rule's closure) stays on the caller's thread, only the
/// connection's input and output move.
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
/// transaction of the rules, whose closure need not be `Send`): its
/// connections' input and output move to a helper thread instead (see
/// [`drive`]), as does the owner session's.
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
    config: tokio_postgres::Config,
}

impl Connector {
    /// Parses a `postgres://` URL (or `key=value` string). The error never
    /// repeats the URL: it may hold a password.
    pub(crate) fn parse(url: &str) -> Result<Self> {
        let mut config: tokio_postgres::Config = url.parse().map_err(|e: postgres::Error| {
            Error::invalid_config(
                "url",
                format!("not a PostgreSQL connection URL ({e}); expected postgres://user@host:port/database"),
            )
        })?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        if config.get_application_name().is_none() {
            config.application_name("durable-outbox");
        }
        Ok(Self { config })
    }

    /// A synchronous client (owner lock, `LISTEN`, `NOTIFY`, migrations).
    pub(crate) fn connect(&self) -> Result<Client> {
        postgres::Config::from(self.config.clone())
            .connect(NoTls)
            .map_err(db("connect"))
    }

    /// A reads/commits connection (see [`conn`]).
    pub(super) fn conn(&self) -> Result<Conn> {
        blocking(|| Conn::connect(&self.config)).map_err(|e| match e {
            conn::ConnectError::Postgres(e) => db("connect")(e),
            conn::ConnectError::Runtime(e) => Error::Database {
                op: "connect",
                source: Box::new(e),
            },
        })
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
    pub(super) fn client(&self) -> Result<Pooled<'_>> {
        let idle = {
            let mut idle = lock(&self.clients);
            idle.retain(|client| !client.is_closed());
            idle.pop()
        };
        let client = match idle {
            Some(client) => client,
            None => self.connector.conn()?,
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
        self.on_a_live_connection("sealing", |client| self.seal_before_reading(client))
            .map(|(client, ())| client)
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

    /// Keeps `client` for the next caller (up to [`IDLE_CONNECTIONS`]).
    pub(super) fn give_back(&self, client: Conn) {
        let mut idle = lock(&self.clients);
        if !client.is_closed() && idle.len() < IDLE_CONNECTIONS {
            idle.push(client);
            return;
        }
        drop(idle);
        // Its runtime cannot be dropped inside a current-thread runtime.
        blocking(move || drop(client));
    }
}
