//! A reads/commits connection: prepared statements, and pipelines.
//!
//! **Prepared once.** `query` with a string prepares the statement on every
//! call (one round trip to parse and describe it, one to run it). A [`Conn`]
//! prepares each statement text of a transaction once per connection and runs
//! the prepared statement from then on. Prepared statements belong to the
//! server session, not to a transaction: a rollback keeps them.
//!
//! **Pipelined.** The synchronous `postgres` client waits for each statement's
//! answer before it sends the next, so a transaction of eight statements costs
//! eight round trips, each a wake-up of the server process and of the client.
//! A [`Conn`] drives `tokio_postgres` itself (on a current-thread runtime of
//! its own, as the synchronous client does) and sends statements that do not
//! need each other's answers together ([`Tx::pipeline`]): the server still
//! runs them one after the other, each with its own snapshot and in the order
//! sent, so a lock taken by one is held when the next reads, exactly as if
//! they had been sent one by one; only the waiting in between is gone.
//!
//! **`BEGIN` travels with the first statement.** [`Conn::begin`] sends
//! nothing: the transaction's `BEGIN` goes in front of its first statements,
//! and a transaction that ran no statement sends nothing at all.
//!
//! An error in one statement of a pipeline aborts the transaction, so the
//! statements after it fail too ("current transaction is aborted"); the
//! caller gets the first error, in the order sent.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

use postgres::types::ToSql;
use postgres::{Row, Statement};
use tokio::runtime::Runtime;

use super::connect::drive;

/// A connection, the runtime that drives it, and its prepared statements.
pub(crate) struct Conn {
    // Declared before `runtime`: dropped first, so the connection task sees
    // the client go and ends the session (`Terminate`) when last polled.
    client: tokio_postgres::Client,
    statements: HashMap<String, Statement>,
    runtime: Runtime,
}

type Params<'a> = &'a [&'a (dyn ToSql + Sync)];

/// One statement of a pipeline.
#[derive(Clone, Copy)]
pub(crate) enum Step<'a> {
    /// A statement with parameters, prepared once per connection: its rows.
    Query(&'a str, Params<'a>),
    /// The same, returning exactly one row (an error otherwise).
    QueryOne(&'a str, Params<'a>),
    /// The same, returning at most one row (an error otherwise).
    QueryOpt(&'a str, Params<'a>),
    /// The same, for the number of rows it changed.
    Execute(&'a str, Params<'a>),
    /// A statement without parameters, unprepared (`COMMIT`, `ROLLBACK`).
    Simple(&'static str),
}

/// What one step returned.
#[derive(Default)]
pub(crate) struct Done {
    /// The rows of a [`Step::Query`].
    pub(crate) rows: Vec<Row>,
    /// The rows changed by a [`Step::Execute`].
    pub(crate) count: u64,
}

type Pending<'f> = Pin<Box<dyn Future<Output = Result<Done, postgres::Error>> + Send + 'f>>;

/// Polls `futures` together, in order, until all are done: the first poll of
/// each sends its request, so requests leave in this order, together.
async fn join_in_order(mut futures: Vec<Pending<'_>>) -> Vec<Result<Done, postgres::Error>> {
    let mut out: Vec<Option<Result<Done, postgres::Error>>> =
        futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut waiting = false;
        for (future, slot) in futures.iter_mut().zip(out.iter_mut()) {
            if slot.is_none() {
                match future.as_mut().poll(cx) {
                    Poll::Ready(done) => *slot = Some(done),
                    Poll::Pending => waiting = true,
                }
            }
        }
        if waiting {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    out.into_iter().flatten().collect()
}

impl Conn {
    /// Connects with `config`.
    pub(crate) fn connect(config: &tokio_postgres::Config) -> Result<Self, ConnectError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(ConnectError::Runtime)?;
        let (client, connection) = runtime
            .block_on(config.connect(tokio_postgres::NoTls))
            .map_err(ConnectError::Postgres)?;
        // Runs whenever the runtime is driven (inside each `block_on`); ends
        // when the session does. A lost session shows as a closed client.
        drop(runtime.spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "a PostgreSQL connection ended");
            }
        }));
        Ok(Self {
            client,
            statements: HashMap::new(),
            runtime,
        })
    }

    /// Whether the session is gone (every statement would fail).
    pub(crate) fn is_closed(&self) -> bool {
        self.client.is_closed()
    }

    /// Begins a transaction: nothing is sent until its first statement,
    /// which carries the `BEGIN`.
    pub(crate) fn begin(&mut self) -> Tx<'_> {
        self.begin_as("BEGIN")
    }

    /// Begins a repeatable-read, read-only transaction (one snapshot for
    /// every statement), sent with its first statement.
    pub(crate) fn begin_snapshot(&mut self) -> Tx<'_> {
        self.begin_as("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
    }

    fn begin_as(&mut self, begin: &'static str) -> Tx<'_> {
        Tx {
            conn: self,
            begin,
            open: false,
        }
    }

    /// The statement prepared for `sql` on this connection.
    fn prepared(&mut self, sql: &str) -> Result<Statement, postgres::Error> {
        if let Some(statement) = self.statements.get(sql) {
            return Ok(statement.clone());
        }
        let statement = drive(&self.runtime, self.client.prepare(sql))?;
        self.statements.insert(sql.to_owned(), statement.clone());
        Ok(statement)
    }

    /// Runs `steps` as one pipeline, preceded by `begin` when given; every
    /// step's result, in order (`begin`'s first).
    fn run(
        &mut self,
        begin: Option<&'static str>,
        steps: &[Step<'_>],
    ) -> Result<Vec<Result<Done, postgres::Error>>, postgres::Error> {
        let mut statements = Vec::with_capacity(steps.len());
        for step in steps {
            statements.push(match step {
                Step::Query(sql, _)
                | Step::QueryOne(sql, _)
                | Step::QueryOpt(sql, _)
                | Step::Execute(sql, _) => Some(self.prepared(sql)?),
                Step::Simple(_) => None,
            });
        }
        let client = &self.client;
        let mut futures: Vec<Pending<'_>> = Vec::with_capacity(steps.len() + 1);
        if let Some(begin) = begin {
            futures.push(Box::pin(async move {
                client.batch_execute(begin).await.map(|()| Done::default())
            }));
        }
        for (step, statement) in steps.iter().zip(statements.iter()) {
            let future: Pending<'_> =
                match (*step, statement) {
                    (Step::Simple(sql), _) => Box::pin(async move {
                        client.batch_execute(sql).await.map(|()| Done::default())
                    }),
                    (_, None) => unreachable!("every step with parameters was prepared above"),
                    (Step::Query(_, params), Some(statement)) => Box::pin(async move {
                        client.query(statement, params).await.map(|rows| Done {
                            count: rows.len() as u64,
                            rows,
                        })
                    }),
                    (Step::QueryOne(_, params), Some(statement)) => Box::pin(async move {
                        client.query_one(statement, params).await.map(|row| Done {
                            rows: vec![row],
                            count: 1,
                        })
                    }),
                    (Step::QueryOpt(_, params), Some(statement)) => Box::pin(async move {
                        client.query_opt(statement, params).await.map(|row| {
                            let rows: Vec<Row> = row.into_iter().collect();
                            Done {
                                count: rows.len() as u64,
                                rows,
                            }
                        })
                    }),
                    (Step::Execute(_, params), Some(statement)) => Box::pin(async move {
                        client.execute(statement, params).await.map(|count| Done {
                            rows: Vec::new(),
                            count,
                        })
                    }),
                };
            futures.push(future);
        }
        Ok(drive(&self.runtime, join_in_order(futures)))
    }

    /// Runs one statement outside any transaction (prepared on first use).
    fn one(&mut self, step: Step<'_>) -> Result<Done, postgres::Error> {
        first_error(self.run(None, &[step])?).map(|mut done| done.swap_remove(0))
    }

    /// The rows of `sql`, run on its own (autocommit).
    pub(crate) fn query(
        &mut self,
        sql: &str,
        params: Params<'_>,
    ) -> Result<Vec<Row>, postgres::Error> {
        self.one(Step::Query(sql, params)).map(|done| done.rows)
    }

    /// The one row of `sql`, run on its own.
    pub(crate) fn query_one(
        &mut self,
        sql: &str,
        params: Params<'_>,
    ) -> Result<Row, postgres::Error> {
        self.one(Step::QueryOne(sql, params)).map(only_row)
    }

    /// Runs `sql` (no parameters, possibly several statements) unprepared.
    pub(crate) fn batch_execute(&mut self, sql: &str) -> Result<(), postgres::Error> {
        drive(&self.runtime, self.client.batch_execute(sql))
    }
}

/// Every result, or the first error among them.
fn first_error(results: Vec<Result<Done, postgres::Error>>) -> Result<Vec<Done>, postgres::Error> {
    results.into_iter().collect()
}

/// Why a connection could not be opened.
#[derive(Debug)]
pub(crate) enum ConnectError {
    /// The runtime that drives it could not be built.
    Runtime(std::io::Error),
    /// The server refused or could not be reached.
    Postgres(postgres::Error),
}

/// A transaction on a [`Conn`]: prepared statements, pipelines, and a
/// `BEGIN` sent with its first statement. Dropped without
/// [`commit`](Self::commit), it rolls back.
pub(crate) struct Tx<'c> {
    conn: &'c mut Conn,
    begin: &'static str,
    /// Whether `BEGIN` was sent (and no `COMMIT` or `ROLLBACK` yet).
    open: bool,
}

impl Tx<'_> {
    /// Runs `steps` together, in order, inside the transaction (after its
    /// `BEGIN`, sent with them when this is the first use); every step's
    /// result, or the first error in the order sent.
    ///
    /// # Errors
    /// The first step that failed (the ones after it fail as well: the
    /// transaction is aborted).
    pub(crate) fn pipeline(&mut self, steps: &[Step<'_>]) -> Result<Vec<Done>, postgres::Error> {
        let results = self.pipeline_each(steps)?;
        first_error(results)
    }

    /// As [`pipeline`](Self::pipeline), with each step's own result (a step
    /// after `COMMIT` runs outside the transaction, and may fail on its own).
    ///
    /// # Errors
    /// Preparing a statement failed, or `BEGIN` did.
    pub(crate) fn pipeline_each(
        &mut self,
        steps: &[Step<'_>],
    ) -> Result<Vec<Result<Done, postgres::Error>>, postgres::Error> {
        let begin = (!self.open).then_some(self.begin);
        self.open = true;
        let mut results = self.conn.run(begin, steps)?;
        if begin.is_some() {
            results.remove(0)?;
        }
        Ok(results)
    }

    fn one(&mut self, step: Step<'_>) -> Result<Done, postgres::Error> {
        self.pipeline(&[step]).map(|mut done| done.swap_remove(0))
    }

    pub(crate) fn query(
        &mut self,
        sql: &str,
        params: Params<'_>,
    ) -> Result<Vec<Row>, postgres::Error> {
        self.one(Step::Query(sql, params)).map(|done| done.rows)
    }

    pub(crate) fn query_one(
        &mut self,
        sql: &str,
        params: Params<'_>,
    ) -> Result<Row, postgres::Error> {
        self.one(Step::QueryOne(sql, params)).map(only_row)
    }

    pub(crate) fn query_opt(
        &mut self,
        sql: &str,
        params: Params<'_>,
    ) -> Result<Option<Row>, postgres::Error> {
        self.one(Step::QueryOpt(sql, params))
            .map(|mut done| done.rows.pop())
    }

    pub(crate) fn execute(
        &mut self,
        sql: &str,
        params: Params<'_>,
    ) -> Result<u64, postgres::Error> {
        self.one(Step::Execute(sql, params)).map(|done| done.count)
    }

    /// Commits (nothing to send if no statement ran).
    ///
    /// # Errors
    /// `COMMIT` failed: the transaction may or may not have committed if the
    /// connection was lost meanwhile.
    pub(crate) fn commit(mut self) -> Result<(), postgres::Error> {
        if !self.open {
            return Ok(());
        }
        self.open = false;
        self.conn.batch_execute("COMMIT")
    }

    /// Marks the transaction ended by a `COMMIT` the caller sent in a
    /// pipeline (nothing is rolled back on drop).
    pub(crate) fn ended(mut self) {
        self.mark_ended();
    }

    /// As [`ended`](Self::ended), for a transaction the caller keeps.
    pub(crate) fn mark_ended(&mut self) {
        self.open = false;
    }
}

impl Drop for Tx<'_> {
    fn drop(&mut self) {
        if self.open {
            // Best effort, as the synchronous client's transactions: a lost
            // connection has rolled back on the server anyway.
            let _ = self.conn.batch_execute("ROLLBACK");
        }
    }
}

/// The row of a [`Step::QueryOne`] (the client checked there is one).
fn only_row(mut done: Done) -> Row {
    match done.rows.pop() {
        Some(row) => row,
        None => unreachable!("query_one returns a row or an error"),
    }
}
