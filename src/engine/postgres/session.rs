//! A dedicated connection on which every call has a deadline: the owner
//! lock's ([`liveness`](super::liveness)), the `LISTEN`er's and the wake-up
//! sender's ([`notify`](super::notify)).
//!
//! **Why a deadline.** TCP keepalives and `tcp_user_timeout` (set on every
//! connection, see [`Connector`]) close a connection whose peer went silent
//! at the packet level. A peer that still acknowledges packets but never
//! answers (a hung server, a stuck proxy or pooler in between) passes both,
//! and a client waiting for its answer would wait forever: the owner lock's
//! check would hold every claim of the handle, the sender thread would never
//! end, and dropping the handle would wait for it. So every statement here
//! gets an answer within [`Connector::answer_timeout`] (the URL's
//! `tcp_user_timeout`, 30 s by default) or fails with [`Error::Database`],
//! and the connection is then closed: its session can no longer be trusted
//! to be in step (an answer may still come), and the server, once it hears
//! of the close, ends the session and releases what it held.
//!
//! Opening is bounded as a whole ([`Connector::open_timeout`]): the client's
//! `connect_timeout` covers only the socket, not the startup that follows.
//!
//! **Dropping never blocks:** the connection's runtime is shut down without
//! waiting (the socket closes; the server ends an idle session on the
//! end-of-file as it does on a `Terminate`).

use std::time::Duration;

use postgres::Row;
use postgres::types::ToSql;
use tokio::runtime::Runtime;
use tokio::sync::mpsc;
use tokio_postgres::AsyncMessage;

use super::Connector;
use super::connect::drive;
use crate::error::{Error, Result};

/// One dedicated connection (see the module docs).
pub(crate) struct Session {
    /// `None` once the session was given up after a missed deadline.
    client: Option<tokio_postgres::Client>,
    /// Notifications (`LISTEN`) as the connection task receives them.
    notifications: mpsc::UnboundedReceiver<tokio_postgres::Notification>,
    /// The task that reads the socket (runs whenever the runtime is driven).
    task: tokio::task::JoinHandle<()>,
    /// Drives the connection during calls; `None` only while dropping.
    runtime: Option<Runtime>,
    /// How long one statement may go unanswered.
    answer: Duration,
}

/// A call that got no answer in time.
fn unanswered(op: &'static str, after: Duration) -> Error {
    Error::Database {
        op,
        source: format!(
            "no answer from the server within {} s (a dead network, or a stalled server \
             or proxy); the connection was closed",
            after.as_secs_f64()
        )
        .into(),
    }
}

fn closed(op: &'static str) -> Error {
    Error::Database {
        op,
        source: "the connection was closed after an earlier call went unanswered".into(),
    }
}

impl Session {
    /// Connects with `connector`'s configuration and applies its server
    /// settings, all within [`Connector::open_timeout`].
    ///
    /// # Errors
    /// [`Error::Database`] when the server cannot be reached, refuses, or
    /// does not answer in time.
    pub(crate) fn open(connector: &Connector) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::Database {
                op: "connect",
                source: Box::new(e),
            })?;
        let limit = connector.open_timeout();
        let config = connector.config().clone();
        let connected = drive(&runtime, async move {
            tokio::time::timeout(limit, config.connect(tokio_postgres::NoTls)).await
        });
        let (client, mut connection) = match connected {
            Ok(Ok(pair)) => pair,
            Ok(Err(e)) => return Err(super::db("connect")(e)),
            Err(_) => return Err(unanswered("connect", limit)),
        };
        let (sender, notifications) = mpsc::unbounded_channel();
        let task = runtime.spawn(async move {
            loop {
                match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                    Some(Ok(AsyncMessage::Notification(n))) => {
                        // The receiver may be gone: the session is closing.
                        let _ = sender.send(n);
                    }
                    Some(Ok(_)) => {}
                    Some(Err(e)) => {
                        tracing::debug!(error = %e, "a dedicated PostgreSQL connection ended");
                        return;
                    }
                    None => return,
                }
            }
        });
        let mut session = Self {
            client: Some(client),
            notifications,
            task,
            runtime: Some(runtime),
            answer: connector.answer_timeout(),
        };
        session.batch_execute(
            "apply the connection's server settings",
            connector.server_settings(),
        )?;
        Ok(session)
    }

    /// Whether the session is gone (closed by the server or the network, or
    /// given up after a missed deadline).
    pub(crate) fn is_closed(&self) -> bool {
        self.client
            .as_ref()
            .is_none_or(tokio_postgres::Client::is_closed)
    }

    /// One row of `sql`, answered within the deadline.
    ///
    /// # Errors
    /// [`Error::Database`] naming `op`: the statement failed, the session is
    /// closed, or no answer came in time (the session is then given up).
    pub(crate) fn query_one(
        &mut self,
        op: &'static str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row> {
        let (Some(client), Some(runtime)) = (self.client.as_ref(), self.runtime.as_ref()) else {
            return Err(closed(op));
        };
        let answer = self.answer;
        let outcome = drive(runtime, async move {
            tokio::time::timeout(answer, client.query_one(sql, params)).await
        });
        self.settle(op, outcome)
    }

    /// `sql` (statements without parameters) answered within the deadline.
    ///
    /// # Errors
    /// As [`query_one`](Self::query_one).
    pub(crate) fn batch_execute(&mut self, op: &'static str, sql: &str) -> Result<()> {
        let (Some(client), Some(runtime)) = (self.client.as_ref(), self.runtime.as_ref()) else {
            return Err(closed(op));
        };
        let answer = self.answer;
        let outcome = drive(runtime, async move {
            tokio::time::timeout(answer, client.batch_execute(sql)).await
        });
        self.settle(op, outcome)
    }

    /// Waits up to `timeout` for a notification (after `LISTEN`); `true`
    /// when one came. Notifications that arrived together count as one.
    ///
    /// # Errors
    /// [`Error::Database`] when the connection ended: listen again on another.
    pub(crate) fn notified(&mut self, op: &'static str, timeout: Duration) -> Result<bool> {
        let mut woken = self.notifications.try_recv().is_ok();
        if !woken {
            if self.is_closed() {
                return Err(closed(op));
            }
            let Some(runtime) = self.runtime.as_ref() else {
                return Err(closed(op));
            };
            let notifications = &mut self.notifications;
            let got = drive(runtime, async move {
                tokio::time::timeout(timeout, notifications.recv()).await
            });
            woken = match got {
                Ok(Some(_)) => true,
                Ok(None) => {
                    return Err(Error::Database {
                        op,
                        source: "the connection ended".into(),
                    });
                }
                Err(_) => false,
            };
        }
        // Drain what is already here: one re-read answers them all.
        while self.notifications.try_recv().is_ok() {}
        Ok(woken)
    }

    /// A call's outcome as the crate's result; a missed deadline gives the
    /// session up.
    fn settle<T>(
        &mut self,
        op: &'static str,
        outcome: std::result::Result<
            std::result::Result<T, tokio_postgres::Error>,
            tokio::time::error::Elapsed,
        >,
    ) -> Result<T> {
        match outcome {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(super::db(op)(e)),
            Err(_) => {
                self.give_up();
                Err(unanswered(op, self.answer))
            }
        }
    }

    /// Closes the socket now: the answer that did not come may still come,
    /// so the session is out of step; the server ends it once it hears of
    /// the close.
    fn give_up(&mut self) {
        self.client = None;
        self.task.abort();
        if let Some(runtime) = self.runtime.as_ref() {
            // An aborted task ends at its next poll, dropping the socket.
            let task = &mut self.task;
            drive(runtime, async move {
                let _ = task.await;
            });
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.client = None;
        self.task.abort();
        if let Some(runtime) = self.runtime.take() {
            // Never waits (and may run inside an async context): the task
            // and its socket are dropped, which closes the connection.
            runtime.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests;
