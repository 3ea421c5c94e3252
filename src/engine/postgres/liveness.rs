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

use super::session::Session;
use super::{Connector, db, lock_key};
use crate::error::{Error, Result};

/// Another connection of the handle, to look at the owner lock from outside.
pub(crate) enum Other<'c> {
    /// The synchronous client opening uses.
    Client(&'c mut Client),
    /// A dedicated connection, answered within its deadline (after a cut).
    Session(&'c mut Session),
}

/// The lock that makes one owner alive.
///
/// Its connection is a [`Session`]: each check is answered within the
/// connection's answer timeout or counts as the lock lost (and the
/// connection is closed, so the server ends the session and the lock with
/// it as soon as it hears of it), instead of holding every claim of the
/// handle behind a check that never returns.
pub(crate) struct Liveness {
    client: Session,
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
        let mut client = connector.session()?;
        let key = lock_key(schema, owner);
        let row = client.query_one(
            "take the owner lock",
            "SELECT pg_try_advisory_lock($1), pg_backend_pid()",
            &[&key],
        )?;
        let (locked, pid): (bool, i32) = (row.get(0), row.get(1));
        if !locked {
            return Ok(None);
        }
        Ok(Some(Self {
            client,
            pid,
            key,
            confirmed_from: None,
        }))
    }

    /// Connects and takes `owner`'s lock again after the session that held
    /// it ended (a cut, a server restart), waiting while other hosts'
    /// transactions hold the key: each found the lock free and is settling
    /// this owner's claims (see `PgTxn::owner_is_alive`), and a claim must
    /// not name the owner before they end. The wait is bounded by half the
    /// connection's answer timeout (`lock_timeout`), within the session's
    /// deadline.
    ///
    /// # Errors
    /// [`Error::SessionLocksUnavailable`] when the lock stayed taken that
    /// long (another session holds it: the old one not ended yet on the
    /// server, or a long transaction); [`Error::Database`].
    pub(crate) fn retake(connector: &Connector, schema: &str, owner: &str) -> Result<Self> {
        let mut client = connector.session()?;
        let key = lock_key(schema, owner);
        let wait = (connector.answer_timeout() / 2).as_millis().max(1);
        client.batch_execute(
            "bound the owner lock's wait",
            &format!("BEGIN; SET LOCAL lock_timeout = {wait}"),
        )?;
        let taken = client.query_one(
            "take the owner lock again",
            "SELECT pg_backend_pid() FROM (SELECT pg_advisory_lock($1)) AS taken",
            &[&key],
        );
        let pid: i32 = match taken {
            Ok(row) => row.get(0),
            Err(Error::Database { source, .. })
                if super::sqlstate(source.as_ref())
                    == Some(postgres::error::SqlState::LOCK_NOT_AVAILABLE.code()) =>
            {
                return Err(Error::SessionLocksUnavailable {
                    reason: format!(
                        "owner lock {owner} stayed taken by another session for {wait} ms after \
                         the original one ended"
                    ),
                });
            }
            Err(e) => return Err(e),
        };
        // The session lock outlives the transaction that took it.
        client.batch_execute("end taking the owner lock", "COMMIT")?;
        Ok(Self {
            client,
            pid,
            key,
            confirmed_from: None,
        })
    }

    /// Checks, from another session `other`, that the lock is held by this
    /// connection's own server session, and that the session is still the one
    /// that took it. Either failing means something between us and the server
    /// (a transaction-mode pooler) moves statements between sessions.
    pub(crate) fn verify(&mut self, other: Other<'_>) -> Result<()> {
        let now: i32 = self
            .client
            .query_one(
                "read the owner session's pid",
                "SELECT pg_backend_pid()",
                &[],
            )?
            .get(0);
        let holder_sql = "SELECT (SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted
               AND objsubid = 1
               AND classid = ((($1::bigint >> 32) & 4294967295)::bigint)::oid
               AND objid = (($1::bigint & 4294967295)::bigint)::oid LIMIT 1)";
        let op = "look up the owner lock";
        let holder: Option<i32> = match other {
            Other::Client(client) => client
                .query_one(holder_sql, &[&self.key])
                .map_err(db(op))?
                .get(0),
            Other::Session(session) => session.query_one(op, holder_sql, &[&self.key])?.get(0),
        };
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
    /// the lock is gone, and other handles may already treat our claims as
    /// orphans. `false` too, within the connection's answer timeout, when
    /// the server does not answer: the connection is then closed.
    pub(crate) fn is_held(&mut self) -> bool {
        let began = std::time::Instant::now();
        let held = !self.client.is_closed()
            && self
                .client
                .query_one("check the owner lock", "SELECT pg_backend_pid()", &[])
                .is_ok_and(|row| row.get::<_, i32>(0) == self.pid);
        self.confirmed_from = held.then_some(began);
        held
    }

    /// The dedicated connection, for tests that look at its settings.
    #[cfg(test)]
    pub(crate) fn session(&mut self) -> &mut Session {
        &mut self.client
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

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        reason = "tests panic loudly"
    )]

    use super::super::test_server::PgServer;
    use super::*;

    /// `refuse_transaction_pooling` is the first line against a pooler; this
    /// is the second, for one that passed it: at open and after a cut, the
    /// owner lock must be held by the owner connection's own session, or
    /// another host would take the lock as free and resend a live send.
    #[test]
    fn an_owner_lock_not_held_by_the_owner_connections_own_session_is_refused() {
        let Some(server) = PgServer::shared() else {
            return;
        };
        let db = server.database();
        let connector = Connector::parse(&db.url()).unwrap();
        let mut other = connector.connect().unwrap();
        let mut liveness = Liveness::take(&connector, "outbox", "owner-1")
            .unwrap()
            .expect("a fresh owner id is free");
        liveness
            .verify(Other::Client(&mut other))
            .expect("the lock is held by the session that took it: verified");
        let lock_session = liveness.pid;

        // The lock stays with the session that took it while the owner
        // connection now talks to another one (as if a pooler moved it).
        let mut stray = connector.session().unwrap();
        let stray_session: i32 = stray
            .query_one("test", "SELECT pg_backend_pid()", &[])
            .unwrap()
            .get(0);
        // The connection that took the lock stays open, so its session keeps it.
        let _taken_in = std::mem::replace(&mut liveness.client, stray);
        let refused = |result: Result<()>, what: &str| match result {
            Err(Error::SessionLocksUnavailable { reason }) => {
                assert!(
                    reason.contains("transaction-mode pooler"),
                    "{what}: {reason}"
                );
            }
            other => panic!("{what}: must be refused, got {other:?}"),
        };
        refused(
            liveness.verify(Other::Client(&mut other)),
            "the connection moved to another session",
        );

        // The connection's session is the one on record, but the server says
        // another session holds the lock.
        liveness.pid = stray_session;
        assert_ne!(stray_session, lock_session);
        refused(
            liveness.verify(Other::Client(&mut other)),
            "the lock is held by another session",
        );
    }

    /// What `ensure_owner` relies on before it takes the lock again: the lock
    /// is reported held while its session lives and lost once the session is
    /// gone (no clock: a slow handle is never declared dead), and a check that
    /// began after a caller asked answers for that caller (the threads of a
    /// handle that found the lock gone after a cut share the one check that
    /// follows; one that found it lost takes it again).
    #[test]
    fn the_owner_lock_is_held_while_its_session_lives_and_a_later_check_answers_for_earlier_askers()
    {
        let Some(server) = PgServer::shared() else {
            return;
        };
        let db = server.database();
        let connector = Connector::parse(&db.url()).unwrap();
        let mut liveness = Liveness::take(&connector, "outbox", "owner-2")
            .unwrap()
            .expect("a fresh owner id is free");
        let asked_before = std::time::Instant::now();
        assert!(
            liveness.held_since(asked_before),
            "a live session holds the lock"
        );
        let asked_after = std::time::Instant::now();

        // The session ends (a network cut, as `pg_terminate_backend` makes
        // it); the call waits until the server process is gone (PostgreSQL 14+).
        let mut admin = connector.connect().unwrap();
        let ended: bool = admin
            .query_one("SELECT pg_terminate_backend($1, 60000)", &[&liveness.pid])
            .unwrap()
            .get(0);
        assert!(ended, "the owner session was terminated");

        assert!(
            liveness.held_since(asked_before),
            "the check that began after this caller asked found the lock held: it answers for it"
        );
        assert!(
            !liveness.held_since(asked_after),
            "a caller who asked after that check gets a check of its own, which finds the session gone"
        );
        assert!(!liveness.is_held(), "the lock is lost with its session");
        let retaken = Liveness::take(&connector, "outbox", "owner-2")
            .unwrap()
            .expect("the ended session released the lock: it can be taken again");
        drop(retaken);
    }
}
