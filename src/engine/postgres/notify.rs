//! Wake-ups across hosts with `LISTEN`/`NOTIFY`.
//!
//! A commit that makes work due sends `NOTIFY` on the schema's channel right
//! after its transaction committed, so the notification comes after the change
//! is visible (and never for a rolled-back one); not inside the transaction,
//! where PostgreSQL would hold its notify queue lock through the commit's WAL
//! flush and so serialise every such commit. A waiting worker holds a
//! dedicated connection that `LISTEN`s. A wake-up is a hint: the waiter reads
//! the items again, and waits with a timeout so a missed notification (the
//! listener was reconnecting) only delays work, never loses it.

use std::time::Duration;

use postgres::Client;
use postgres::fallible_iterator::FallibleIterator;

use super::sealing::Seal;
use super::{Connector, PgEngine, db, lock};
use crate::error::Result;

/// The channel of `schema`'s outbox.
pub(crate) fn channel(schema: &str) -> String {
    format!("durable_outbox_{schema}")
}

/// The statement that sends a wake-up (parameter: the [`channel`]), outside
/// any transaction (after the change it announces committed: the rules'
/// commit sends it in the same pipeline, after its `COMMIT`): one short
/// statement, its own transaction. `pg_notify` gives that transaction an id,
/// so it commits with a WAL record; committed synchronously it would wait for
/// a WAL flush of its own (a fourth one per item on the W2 path, after the
/// enqueue's, the claim's and the finish's), holding the notify queue's lock
/// through it. It commits asynchronously instead: a wake-up is a hint (see
/// above), and one that a server crash takes back announced a change that
/// was durable before it.
pub(crate) const WAKE_SQL: &str =
    "SELECT pg_notify($1, ''), set_config('synchronous_commit', 'off', true)";

/// A connection that listens for wake-ups.
pub(crate) struct Listener {
    client: Client,
}

impl Listener {
    /// Connects and subscribes. Wake-ups committed before this returns are not seen.
    pub(crate) fn start(connector: &Connector, schema: &str) -> Result<Self> {
        let mut client = connector.connect()?;
        client
            .batch_execute(&format!("LISTEN \"{}\"", channel(schema)))
            .map_err(db("listen for wake-ups"))?;
        Ok(Self { client })
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.client.is_closed()
    }

    /// Waits up to `timeout` for a wake-up; `true` when one came. Wake-ups that
    /// arrived together count as one.
    pub(crate) fn wait(&mut self, timeout: Duration) -> Result<bool> {
        let mut notifications = self.client.notifications();
        let woken = notifications
            .timeout_iter(timeout)
            .next()
            .map_err(db("wait for a wake-up"))?
            .is_some();
        if woken {
            // Drain what is already here: one re-read answers them all.
            let mut pending = notifications.iter();
            while pending.next().map_err(db("drain wake-ups"))?.is_some() {}
        }
        Ok(woken)
    }
}

/// What a worker asks of the engine besides the rules' transactions.
impl PgEngine {
    /// Blocks until a commit that made work due lands (on any handle of any
    /// host: `NOTIFY`) or `timeout` passes; `true` when woken. Waking is only
    /// a hint: a waiter reads again after it. A worker's tick also seals what
    /// a crashed handle or a skipped best-effort sealing left pending.
    pub(crate) fn wait_for_work(&self, timeout: Duration) -> Result<bool> {
        // A worker's tick: events a crashed handle or a skipped best-effort
        // sealing left pending go on the chain.
        {
            let mut client = self.client()?;
            self.seal_pending(&mut client, Seal::IfFree)?;
        }
        let mut listener = lock(&self.listener);
        if listener.as_ref().is_none_or(Listener::is_closed) {
            *listener = Some(Listener::start(&self.connector, &self.schema)?);
        }
        match listener.as_mut() {
            Some(listener) => listener.wait(timeout),
            None => Ok(false),
        }
    }
}
