//! Wake-ups across hosts with `LISTEN`/`NOTIFY`, coalesced.
//!
//! **A wake-up is a hint.** A waiting worker holds a dedicated connection
//! that `LISTEN`s on the schema's [`channel`]; when woken it reads the items
//! again, and it waits with a timeout, so a late or missed notification (the
//! listener was reconnecting) only delays work, never loses it. A
//! notification carries nothing: one sent after several commits announces
//! them all. The listening session is read only while a worker waits on it,
//! so the last worker of a handle to stop closes it
//! ([`PgEngine::stop_listening`]): left subscribed, it would hold back the
//! server's notify queue.
//!
//! **Requesting costs a commit nothing.** A commit that makes an item
//! claimable, once its `COMMIT` succeeded, calls [`Sender::request`]: a
//! counter raised under a mutex, no statement on the commit's connection and
//! no waiting. (Sending `NOTIFY` on that connection after each such commit
//! was a fourth transaction per item on the enqueue–claim–finish path: a
//! commit record, PostgreSQL's database-wide notify queue lock at commit,
//! and a reply to wait for.) Each handle has one sender thread with a
//! connection of its own, opened from the handle's connector (same server,
//! settings and timeouts) on the first request, that sends `NOTIFY`:
//!
//! - the first request after a quiet period goes out at once, so a lone
//!   enqueue is announced as fast as before;
//! - requests that arrive while a `NOTIFY` is being sent, or within
//!   [`COALESCE`] after one was sent, are merged into one trailing `NOTIFY`,
//!   sent when that interval has passed.
//!
//! **Invariant:** a `NOTIFY` is sent only after a request, and a request is
//! made only after the `COMMIT` it announces succeeded: a wake-up never comes
//! before the change is visible, and never for a rolled-back transaction.
//!
//! **Invariant:** every request is followed by at least one `NOTIFY` that
//! starts after it: the thread takes the request count before each send, and
//! a count that grew meanwhile calls for another send. Dropping the handle
//! sends what is pending at once and joins the thread, waiting at most
//! [`CLOSE_WAIT`]: when the server does not answer, the thread is left to
//! end on its own (its `NOTIFY` fails within the connection's answer
//! timeout, see [`session`](super::session)), and the drop returns. The
//! last wake-up is then lost, which only delays other hosts' workers until
//! their next poll.
//!
//! The sender's connection failing (the server restarted, an operator
//! terminated the session) is logged and the connection opened again at once
//! for the same `NOTIFY`; if that fails too, the request is given up (logged)
//! and the next request connects again. It never blocks or fails a commit.
//!
//! The connection commits its `NOTIFY`s asynchronously (`synchronous_commit
//! = off`): `NOTIFY` gives its transaction an id, so it commits with a WAL
//! record, and a synchronous commit would wait for a flush of its own,
//! holding the notify queue's lock through it. A server crash may take such
//! a notification back; the change it announced was durable before it, and
//! waiters read again after a restart anyway.
//!
//! Within one process, the worker is also woken without the server: an
//! enqueue or a requeue on any clone of the handle calls the worker's
//! in-process wake-up (`crate::wake`) after its commit.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::sealing::Seal;
use super::session::Session;
use super::{Connector, PgEngine, lock};
use crate::error::{Error, Result};

/// The channel of `schema`'s outbox.
pub(crate) fn channel(schema: &str) -> String {
    format!("durable_outbox_{schema}")
}

/// How long after a `NOTIFY` was sent the next one waits, collecting the
/// requests that come meanwhile into one.
///
/// It bounds a handle's `NOTIFY`s to about a hundred a second however fast it
/// commits: each costs the server about 0.3 ms of CPU (measured with `pgbench`
/// running our statements with and without it), as much as a fifth of an
/// item on the enqueue–claim–finish path, so the whole is at most some 3 % of
/// one core, and a shrinking share of the work as the commit rate rises (at
/// a thousand items a second, 2 % of the items' CPU instead of a fifth). It
/// is also the most a worker on another host wakes
/// later than it would with one `NOTIFY` per commit. That delay only arises
/// during a burst, whose first commit is announced at once: a worker idle
/// when the burst starts is woken by it, and while it works it reads the
/// items again after each send anyway. Ten milliseconds is small beside a
/// send to a chat service (tens to hundreds of milliseconds).
pub(crate) const COALESCE: Duration = Duration::from_millis(10);

/// The longest dropping a handle waits for its sender thread to send what
/// is pending and end.
pub(crate) const CLOSE_WAIT: Duration = Duration::from_secs(2);

/// A handle's wake-up sender: [`request`](Self::request) after a commit that
/// made work due; a thread of its own sends the `NOTIFY`s (see the module
/// docs). Dropping it sends what is pending and joins the thread.
pub(crate) struct Sender {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// What the requesters and the sender thread share.
#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    /// Signalled when a request finds the thread idle, when the handle
    /// closes, and after each send (for tests that wait for one).
    changed: Condvar,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        // Nothing in the state is left half-changed by a panic.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[derive(Default)]
struct State {
    /// Requests made so far.
    requested: u64,
    /// The request count the last send started after: every request up to
    /// it has a `NOTIFY` (or a failed attempt at one) after it.
    covered: u64,
    /// `NOTIFY`s that reached the server.
    sent: u64,
    /// Whether the thread waits for a request (only then must a request
    /// signal it: a commit pays for no system call otherwise).
    idle: bool,
    /// The handle is being dropped: send what is pending now, then end.
    closing: bool,
    /// The thread has ended (or unwound).
    ended: bool,
    /// The server process id of the sender's connection, once it connected
    /// (for the log, and for tests that terminate it).
    pid: Option<i32>,
}

/// A snapshot of a sender's counters, for tests.
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stats {
    pub(crate) requested: u64,
    pub(crate) covered: u64,
    pub(crate) sent: u64,
    pub(crate) pid: Option<i32>,
}

impl Sender {
    /// Starts the sender thread of the outbox in `schema`, sending at most
    /// once per `interval` ([`COALESCE`]) after the first; it connects
    /// through `connector` on the first request.
    ///
    /// # Errors
    /// [`Error::Database`] when the thread cannot be started.
    pub(crate) fn start(connector: &Connector, schema: &str, interval: Duration) -> Result<Self> {
        let shared = Arc::new(Shared::default());
        let mut line = Line {
            connector: connector.clone(),
            statement: format!("NOTIFY \"{}\"", channel(schema)),
            client: None,
            shared: Arc::clone(&shared),
        };
        Self::spawn(shared, interval, move || line.send())
    }

    /// Starts the thread that calls `send` (true: it reached the server) for
    /// the requests, at most once per `interval` after the first.
    fn spawn(
        shared: Arc<Shared>,
        interval: Duration,
        send: impl FnMut() -> bool + Send + 'static,
    ) -> Result<Self> {
        let theirs = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("outbox-wake".into())
            .spawn(move || {
                let _ended = Ended(&theirs);
                run(&theirs, interval, send);
            })
            .map_err(|e| Error::Database {
                op: "start the wake-up sender thread",
                source: Box::new(e),
            })?;
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }

    /// Asks for a `NOTIFY` after a commit that made work due (call it only
    /// once that `COMMIT` succeeded). Never blocks on the server.
    pub(crate) fn request(&self) {
        let mut state = self.shared.state();
        state.requested += 1;
        if state.idle {
            state.idle = false;
            self.shared.changed.notify_all();
        }
    }

    /// The counters so far.
    #[cfg(test)]
    pub(crate) fn stats(&self) -> Stats {
        let state = self.shared.state();
        Stats {
            requested: state.requested,
            covered: state.covered,
            sent: state.sent,
            pid: state.pid,
        }
    }

    /// Waits up to `limit` until every request so far has a send started
    /// after it; the counters then.
    #[cfg(test)]
    pub(crate) fn settled(&self, limit: Duration) -> Stats {
        let state = self.shared.state();
        let target = state.requested;
        let (state, _) = self
            .shared
            .changed
            .wait_timeout_while(state, limit, |s| s.covered < target)
            .unwrap_or_else(PoisonError::into_inner);
        Stats {
            requested: state.requested,
            covered: state.covered,
            sent: state.sent,
            pid: state.pid,
        }
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        let mut state = self.shared.state();
        state.closing = true;
        self.shared.changed.notify_all();
        let (state, _) = self
            .shared
            .changed
            .wait_timeout_while(state, CLOSE_WAIT, |s| !s.ended)
            .unwrap_or_else(PoisonError::into_inner);
        let ended = state.ended;
        drop(state);
        let Some(thread) = self.thread.take() else {
            return;
        };
        if !ended {
            // Detached: it ends once its call fails (see the module docs).
            tracing::warn!(
                "the wake-up sender did not finish within {CLOSE_WAIT:?} (the server does not \
                 answer); closing without waiting for it"
            );
        } else if thread.join().is_err() {
            tracing::error!("the wake-up sender thread panicked");
        }
    }
}

/// Marks the sender thread ended when it returns or unwinds.
struct Ended<'s>(&'s Shared);

impl Drop for Ended<'_> {
    fn drop(&mut self) {
        self.0.state().ended = true;
        self.0.changed.notify_all();
    }
}

/// The sender thread: waits for requests and calls `send` for them (see the
/// module docs), until the handle closes with nothing pending.
fn run(shared: &Shared, interval: Duration, mut send: impl FnMut() -> bool) {
    // When the last send ended: the next waits until `interval` after it.
    let mut last_end: Option<Instant> = None;
    let mut state = shared.state();
    loop {
        if state.requested == state.covered {
            if state.closing {
                return;
            }
            state.idle = true;
            shared.changed.notify_all();
            state = shared
                .changed
                .wait_while(state, |s| s.idle && !s.closing)
                .unwrap_or_else(PoisonError::into_inner);
            state.idle = false;
            continue;
        }
        let wait = last_end
            .map(|end| (end + interval).saturating_duration_since(Instant::now()))
            .filter(|wait| !wait.is_zero() && !state.closing);
        if let Some(wait) = wait {
            // Requests meanwhile join this one; closing ends the wait.
            state = shared
                .changed
                .wait_timeout_while(state, wait, |s| !s.closing)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
            continue;
        }
        // Every request up to here was made before this send starts.
        let target = state.requested;
        drop(state);
        let reached = send();
        last_end = Some(Instant::now());
        state = shared.state();
        state.covered = target;
        state.sent += u64::from(reached);
        shared.changed.notify_all();
    }
}

/// The sender thread's connection.
struct Line {
    connector: Connector,
    /// `NOTIFY "<channel>"`.
    statement: String,
    /// Opened on the first send; dropped when it fails.
    client: Option<Session>,
    shared: Arc<Shared>,
}

impl Line {
    /// Sends one `NOTIFY`; whether it reached the server. A connection that
    /// turns out dead (a terminated session, a restarted server) is opened
    /// again at once for the same `NOTIFY`; a failure is logged.
    fn send(&mut self) -> bool {
        loop {
            let fresh = self.client.as_ref().is_none_or(Session::is_closed);
            if fresh && !self.connect() {
                return false;
            }
            let Some(client) = self.client.as_mut() else {
                return false;
            };
            match client.batch_execute("send a wake-up", &self.statement) {
                Ok(()) => return true,
                Err(e) => {
                    let pid = self.shared.state().pid.take();
                    self.client = None;
                    if fresh {
                        tracing::warn!(error = %e, pid, "could not send a wake-up (NOTIFY); the next request connects again");
                        return false;
                    }
                    tracing::warn!(error = %e, pid, "the wake-up connection failed; sending the wake-up (NOTIFY) on a new one");
                }
            }
        }
    }

    /// Opens the connection; false (logged) when that fails.
    fn connect(&mut self) -> bool {
        let opened = self.connector.session().and_then(|mut client| {
            // Asynchronous commits for this session's `NOTIFY`s (see the
            // module docs); its server process id for the log.
            let row = client.query_one(
                "set up the wake-up connection",
                "SELECT pg_backend_pid(), set_config('synchronous_commit', 'off', false)",
                &[],
            )?;
            Ok((client, row.get::<_, i32>(0)))
        });
        match opened {
            Ok((client, pid)) => {
                self.client = Some(client);
                self.shared.state().pid = Some(pid);
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not open the wake-up connection; the next request tries again");
                false
            }
        }
    }
}

/// A connection that listens for wake-ups.
pub(crate) struct Listener {
    client: Session,
}

impl Listener {
    /// Connects and subscribes. Wake-ups committed before this returns are not seen.
    pub(crate) fn start(connector: &Connector, schema: &str) -> Result<Self> {
        let mut client = connector.session()?;
        client.batch_execute(
            "listen for wake-ups",
            &format!("LISTEN \"{}\"", channel(schema)),
        )?;
        Ok(Self { client })
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.client.is_closed()
    }

    /// The dedicated connection, for tests that look at its settings.
    #[cfg(test)]
    pub(crate) fn session(&mut self) -> &mut Session {
        &mut self.client
    }

    /// Waits up to `timeout` for a wake-up; `true` when one came. Wake-ups that
    /// arrived together count as one.
    pub(crate) fn wait(&mut self, timeout: Duration) -> Result<bool> {
        self.client.notified("wait for a wake-up", timeout)
    }
}

/// One worker's share of its handle's listening session, from
/// [`PgEngine::start_listening`]: dropping it (at the end of the worker's
/// wait loop, or while its thread unwinds) stops that worker's listening.
#[must_use = "listening stops when the guard drops"]
pub(crate) struct Listening<'e> {
    engine: &'e PgEngine,
}

impl Drop for Listening<'_> {
    fn drop(&mut self) {
        self.engine.stop_listening();
    }
}

/// What a worker asks of the engine besides the rules' transactions.
impl PgEngine {
    /// A worker of this handle starts waiting for wake-ups
    /// ([`wait_for_work`](Self::wait_for_work)) until the returned guard
    /// drops, which calls [`stop_listening`](Self::stop_listening): also
    /// when the worker's thread unwinds from a panic, so no path leaves the
    /// count raised and the session listening.
    pub(crate) fn start_listening(&self) -> Listening<'_> {
        self.listeners
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Listening { engine: self }
    }

    /// A worker of this handle stopped waiting for wake-ups: when it was the
    /// last, the listening session is closed (the server ends its
    /// subscription with it; a later wait listens again). The session is
    /// read only while someone waits on it, and every commit of every host
    /// still notifies the channel: left open, it would pile the
    /// notifications up, its backend would block writing them, and the
    /// server's notify queue (one for the whole cluster) could no longer be
    /// trimmed past it, until every `NOTIFY` on the server failed.
    fn stop_listening(&self) {
        if self
            .listeners
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst)
            == 1
        {
            let listener = lock(&self.listener).take();
            drop(listener);
        }
    }

    /// Blocks until a commit that made work due lands (on any handle of any
    /// host: `NOTIFY`) or `timeout` passes; `true` when woken. Waking is only
    /// a hint: a waiter reads again after it. A wait that (re)opens the
    /// listening session answers `true` at once, since what was committed
    /// before it listened woke nobody. A worker's tick also seals what
    /// a crashed handle or a skipped best-effort sealing left pending.
    pub(crate) fn wait_for_work(&self, timeout: Duration) -> Result<bool> {
        // A failpoint here stands for anything on the waiting thread that
        // fails or unwinds (a panic in a log subscriber, a bug).
        self.faults
            .check("postgres.wait_for_work")
            .map_err(|e| Error::io(self.place(), "wait for work", e))?;
        // A worker's tick: events a crashed handle or a skipped best-effort
        // sealing left pending go on the chain.
        {
            let mut client = self.client()?;
            self.seal_pending(&mut client, Seal::IfFree)?;
        }
        let mut listener = lock(&self.listener);
        if listener.as_ref().is_none_or(Listener::is_closed) {
            *listener = Some(Listener::start(&self.connector, &self.schema)?);
            // Listening only from now on: what was committed while nobody
            // listened (before the first wait, or while a cut session was
            // down) notified nobody. Woken now, the worker reads the state
            // again, after this point, and sees it.
            return Ok(true);
        }
        match listener.as_mut() {
            Some(listener) => listener.wait(timeout),
            None => Ok(false),
        }
    }
}

#[cfg(test)]
mod tests;
