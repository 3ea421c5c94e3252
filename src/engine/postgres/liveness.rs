//! Owner liveness: a session-level advisory lock held on a dedicated connection.
//!
//! Each open handle registers a fresh owner id (never reused: `owners` has it
//! as a primary key) and locks it with `pg_advisory_lock` on a connection used
//! for nothing else. The server releases the lock exactly when that session
//! ends: the process died, the connection was cut, the server restarted. So an
//! owner whose lock another session can take is dead, and its claims are
//! orphans — with no clock involved, a slow send is never declared dead.
//!
//! A transaction-mode pooler (pgbouncer `pool_mode = transaction`) hands each
//! transaction whichever server session is free, so a session lock taken
//! through it belongs to no client in particular. Opening refuses such a path
//! with [`Error::SessionLocksUnavailable`] before writing anything
//! ([`refuse_transaction_pooling`]: two client connections must never share a
//! server session, and neither may move), and [`Liveness::verify`] checks that
//! `pg_locks` names the owner connection's own session as the lock's holder.

use postgres::Client;

use super::{Connector, db, lock_key};
use crate::error::{Error, Result};

/// The lock that makes one owner alive.
pub(crate) struct Liveness {
    client: Client,
    /// The server process of `client`'s session when the lock was taken.
    pid: i32,
    key: i64,
    /// When the last check that found the lock held began.
    confirmed_from: Option<std::time::Instant>,
}

impl Liveness {
    /// Connects and locks `owner`. `Ok(None)` when the lock is taken already
    /// (only possible for an id someone else registered: pick another).
    pub(crate) fn take(connector: &Connector, schema: &str, owner: &str) -> Result<Option<Self>> {
        let mut client = connector.connect()?;
        let key = lock_key(schema, owner);
        let locked: bool = client
            .query_one("SELECT pg_try_advisory_lock($1)", &[&key])
            .map_err(db("take the owner lock"))?
            .get(0);
        if !locked {
            return Ok(None);
        }
        let pid: i32 = client
            .query_one("SELECT pg_backend_pid()", &[])
            .map_err(db("read the owner session's pid"))?
            .get(0);
        Ok(Some(Self {
            client,
            pid,
            key,
            confirmed_from: None,
        }))
    }

    /// Checks, from another session `other`, that the lock is held by this
    /// connection's own server session, and that the session is still the one
    /// that took it. Either failing means something between us and the server
    /// (a transaction-mode pooler) moves statements between sessions.
    pub(crate) fn verify(&mut self, other: &mut Client) -> Result<()> {
        let now: i32 = self
            .client
            .query_one("SELECT pg_backend_pid()", &[])
            .map_err(db("read the owner session's pid"))?
            .get(0);
        let holder: Option<i32> = other
            .query_opt(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted
                   AND objsubid = 1
                   AND classid = ((($1::bigint >> 32) & 4294967295)::bigint)::oid
                   AND objid = (($1::bigint & 4294967295)::bigint)::oid",
                &[&self.key],
            )
            .map_err(db("look up the owner lock"))?
            .map(|row| row.get(0));
        if now != self.pid || holder != Some(self.pid) {
            return Err(Error::SessionLocksUnavailable {
                reason: format!(
                    "the owner lock was taken by server session {}, the connection now talks to \
                     session {now}, and the server says session {} holds the lock: a \
                     transaction-mode pooler (e.g. pgbouncer pool_mode=transaction) is in \
                     between; connect directly or through a session-mode pool",
                    self.pid,
                    holder.map_or_else(|| "none".to_owned(), |p| p.to_string()),
                ),
            });
        }
        Ok(())
    }

    /// Whether the session that holds the lock is still there (a cheap round
    /// trip on the dedicated connection). `false` after a cut or a restart:
    /// the lock is gone, and other handles may already treat our claims as orphans.
    pub(crate) fn is_held(&mut self) -> bool {
        let began = std::time::Instant::now();
        let held = !self.client.is_closed()
            && self
                .client
                .query_one("SELECT pg_backend_pid()", &[])
                .is_ok_and(|row| row.get::<_, i32>(0) == self.pid);
        self.confirmed_from = held.then_some(began);
        held
    }

    /// Whether the lock was held at some moment after `asked`: a check that
    /// began after `asked` and found it held answers for every caller that
    /// waited for it meanwhile (the threads of a handle share one check
    /// instead of queueing one round trip each); otherwise a check now.
    pub(crate) fn held_since(&mut self, asked: std::time::Instant) -> bool {
        if self.confirmed_from.is_some_and(|from| from >= asked) {
            return true;
        }
        self.is_held()
    }
}

/// The server session (`pg_backend_pid`) a connection's next statement runs in,
/// asked with the simple query protocol (no prepared statement, which a
/// transaction-mode pooler could route to another session).
fn session_of(client: &mut Client) -> Result<String> {
    let messages = client
        .simple_query("SELECT pg_backend_pid()")
        .map_err(db("read the session's pid"))?;
    messages
        .iter()
        .find_map(|message| match message {
            postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
            _ => None,
        })
        .ok_or_else(|| Error::Database {
            op: "read the session's pid",
            source: "the server returned no row".into(),
        })
}

/// Refuses a connection path on which a client does not keep one server
/// session: two client connections that ever run in the same server session,
/// or one that moves between sessions, are behind a transaction-mode pooler
/// (pgbouncer hands the most recently freed session to the next transaction,
/// so this shows at once). Directly connected or session-pooled clients each
/// keep their own session for life.
pub(crate) fn refuse_transaction_pooling(first: &mut Client, second: &mut Client) -> Result<()> {
    let mut firsts = Vec::new();
    let mut seconds = Vec::new();
    for _ in 0..3 {
        firsts.push(session_of(first)?);
        seconds.push(session_of(second)?);
    }
    let moved =
        firsts.iter().any(|pid| *pid != firsts[0]) || seconds.iter().any(|pid| *pid != seconds[0]);
    let shared = firsts.iter().find(|pid| seconds.contains(pid));
    if moved || shared.is_some() {
        return Err(Error::SessionLocksUnavailable {
            reason: format!(
                "two connections were served by server sessions {firsts:?} and {seconds:?}: \
                 statements move between sessions, as behind a transaction-mode pooler \
                 (pgbouncer pool_mode=transaction); the owner lock would not belong to this \
                 handle. Connect directly or through a session-mode pool"
            ),
        });
    }
    Ok(())
}
