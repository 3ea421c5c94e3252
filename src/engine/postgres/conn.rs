//! A reads/commits connection: prepared statements, and pipelines under one
//! `Sync`.
//!
//! **Prepared once.** A [`Conn`] prepares each statement text once per
//! connection (one round trip for the statements of a pipeline it has not
//! seen yet) and runs the prepared statement from then on. Prepared
//! statements belong to the server session, not to a transaction: a rollback
//! keeps them.
//!
//! **Pipelined, one `Sync` per round trip.** A [`Conn`] is the engine's own
//! protocol client ([`wire`](super::wire)), on a blocking socket. The
//! statements of a pipeline ([`Tx::pipeline`]), the transaction's `BEGIN` and
//! a `COMMIT` among them included, go out in one write ended by one `Sync`:
//! the server runs them one after the other, each with its own snapshot and
//! in the order sent (a lock taken by one is held when the next reads,
//! exactly as if they had been sent one by one), and answers them together.
//!
//! **`BEGIN` travels with the first statement.** [`Conn::begin`] sends
//! nothing: the transaction's `BEGIN` goes in front of its first statements,
//! and a transaction that ran no statement sends nothing at all.
//!
//! **After an error the rest is skipped.** When one statement of a pipeline
//! fails, the server skips the statements after it up to the `Sync` (a
//! `COMMIT` among them included: nothing of the transaction commits); each
//! gets a "not run" error, and the caller gets the first error, in the order
//! sent. The transaction is then a failed one, still open on the server:
//! dropping the [`Tx`] rolls it back, whether or not the caller marked it
//! [ended](Tx::ended) (it asks the session, not its own flag). A step *after*
//! a `COMMIT` runs once the commit is done, outside the transaction (its
//! failure does not undo the commit). A lost connection fails every step not
//! answered yet with a closed-connection error: a `COMMIT` among them may or
//! may not have committed.
//!
//! Standalone statements ([`Conn::query`], [`Conn::query_one`]) are one
//! statement per `Sync`: each commits on its own (autocommit).

use postgres::types::ToSql;

use super::wire::{Connection, Outcome, WireError};

pub(crate) use super::wire::Row;

/// A connection and its prepared statements.
#[derive(Debug)]
pub(crate) struct Conn {
    wire: Connection,
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
    /// A statement without parameters (`COMMIT`, `ROLLBACK`), prepared as
    /// the others.
    Simple(&'static str),
}

/// What one step returned.
#[derive(Debug, Default)]
pub(crate) struct Done {
    /// The rows of a [`Step::Query`].
    pub(crate) rows: Vec<Row>,
    /// The rows changed by a [`Step::Execute`] (selected, for a query).
    pub(crate) count: u64,
}

/// The step's own check of what its statement returned.
fn checked(step: Step<'_>, outcome: Outcome) -> Result<Done, WireError> {
    let n = outcome.rows.len();
    match step {
        Step::QueryOne(..) if n != 1 => Err(WireError::row_count("exactly one row", n)),
        Step::QueryOpt(..) if n > 1 => Err(WireError::row_count("at most one row", n)),
        _ => Ok(Done {
            rows: outcome.rows,
            count: outcome.count,
        }),
    }
}

impl Conn {
    /// Connects with `config`.
    ///
    /// # Errors
    /// The server could not be reached, refused the session, or the settings
    /// ask for what the client cannot do (TLS).
    pub(crate) fn connect(config: &tokio_postgres::Config) -> Result<Self, WireError> {
        Ok(Self {
            wire: Connection::connect(config)?,
        })
    }

    /// Bounds each wait for an answer: a server silent for `patience` is
    /// asked (over a new connection opened with `config`) whether the
    /// session still runs a statement, and the session is given up when it
    /// does not (see [`wire`](super::wire)'s connection docs).
    ///
    /// # Errors
    /// Reading the session's backend process id failed.
    pub(crate) fn watch(
        &mut self,
        patience: std::time::Duration,
        config: &tokio_postgres::Config,
    ) -> Result<(), WireError> {
        self.wire.watch(patience, config)
    }

    /// Whether the session is gone (every statement would fail). An idle
    /// connection whose server went away looks open until its next use.
    pub(crate) fn is_closed(&self) -> bool {
        self.wire.is_closed()
    }

    /// Whether the server said, in its last `ReadyForQuery`, that a
    /// transaction is open on the session (`T`), or a failed one (`E`):
    /// anything but idle (`I`).
    pub(crate) fn in_transaction(&self) -> bool {
        self.wire.in_transaction()
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

    /// Runs `steps` as one pipeline, preceded by `begin` when given; every
    /// step's result, in order (`begin`'s first).
    fn run(
        &mut self,
        begin: Option<&'static str>,
        steps: &[Step<'_>],
    ) -> Result<Vec<Result<Done, WireError>>, WireError> {
        let none: Params<'_> = &[];
        let mut all: Vec<Step<'_>> = Vec::with_capacity(steps.len() + 1);
        all.extend(begin.map(Step::Simple));
        all.extend_from_slice(steps);
        let statements: Vec<(&str, Params<'_>)> = all
            .iter()
            .map(|step| match *step {
                Step::Query(sql, params)
                | Step::QueryOne(sql, params)
                | Step::QueryOpt(sql, params)
                | Step::Execute(sql, params) => (sql, params),
                Step::Simple(sql) => (sql, none),
            })
            .collect();
        let results = self.wire.pipeline(&statements)?;
        Ok(all
            .iter()
            .zip(results)
            .map(|(step, result)| result.and_then(|outcome| checked(*step, outcome)))
            .collect())
    }

    /// Runs one statement outside any transaction (prepared on first use).
    fn one(&mut self, step: Step<'_>) -> Result<Done, WireError> {
        first_error(self.run(None, &[step])?).map(|mut done| done.swap_remove(0))
    }

    /// The rows of `sql`, run on its own (autocommit).
    pub(crate) fn query(&mut self, sql: &str, params: Params<'_>) -> Result<Vec<Row>, WireError> {
        self.one(Step::Query(sql, params)).map(|done| done.rows)
    }

    /// The one row of `sql`, run on its own.
    pub(crate) fn query_one(&mut self, sql: &str, params: Params<'_>) -> Result<Row, WireError> {
        self.one(Step::QueryOne(sql, params)).map(only_row)
    }
}

/// Every result, or the first error among them.
fn first_error(results: Vec<Result<Done, WireError>>) -> Result<Vec<Done>, WireError> {
    results.into_iter().collect()
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
    /// The first step that failed (the server skipped the ones after it; the
    /// transaction is aborted).
    pub(crate) fn pipeline(&mut self, steps: &[Step<'_>]) -> Result<Vec<Done>, WireError> {
        let results = self.pipeline_each(steps)?;
        first_error(results)
    }

    /// As [`pipeline`](Self::pipeline), with each step's own result: a step
    /// after a failed one was skipped (a "not run" error); a step after a
    /// `COMMIT` ran outside the transaction, and may fail on its own.
    ///
    /// # Errors
    /// Preparing a statement failed, or `BEGIN` did.
    pub(crate) fn pipeline_each(
        &mut self,
        steps: &[Step<'_>],
    ) -> Result<Vec<Result<Done, WireError>>, WireError> {
        let begin = (!self.open).then_some(self.begin);
        // Open once the pipeline went out (an error here sent nothing).
        let mut results = self.conn.run(begin, steps)?;
        self.open = true;
        if begin.is_some() {
            results.remove(0)?;
        }
        Ok(results)
    }

    fn one(&mut self, step: Step<'_>) -> Result<Done, WireError> {
        self.pipeline(&[step]).map(|mut done| done.swap_remove(0))
    }

    pub(crate) fn query(&mut self, sql: &str, params: Params<'_>) -> Result<Vec<Row>, WireError> {
        self.one(Step::Query(sql, params)).map(|done| done.rows)
    }

    pub(crate) fn query_one(&mut self, sql: &str, params: Params<'_>) -> Result<Row, WireError> {
        self.one(Step::QueryOne(sql, params)).map(only_row)
    }

    pub(crate) fn query_opt(
        &mut self,
        sql: &str,
        params: Params<'_>,
    ) -> Result<Option<Row>, WireError> {
        self.one(Step::QueryOpt(sql, params))
            .map(|mut done| done.rows.pop())
    }

    pub(crate) fn execute(&mut self, sql: &str, params: Params<'_>) -> Result<u64, WireError> {
        self.one(Step::Execute(sql, params)).map(|done| done.count)
    }

    /// Commits (nothing to send if no statement ran).
    ///
    /// # Errors
    /// `COMMIT` failed: the transaction may or may not have committed if the
    /// connection was lost meanwhile.
    pub(crate) fn commit(mut self) -> Result<(), WireError> {
        if !self.open {
            return Ok(());
        }
        self.open = false;
        first_error(self.conn.run(None, &[Step::Simple("COMMIT")])?).map(drop)
    }

    /// Marks the transaction ended by a `COMMIT` the caller sent in a
    /// pipeline. Should the `COMMIT` have been skipped (a step before it
    /// failed), the session still holds the failed transaction, and
    /// dropping this rolls it back.
    pub(crate) fn ended(mut self) {
        self.mark_ended();
    }

    /// Whether the connection was found closed (its server session is gone).
    pub(crate) fn is_closed(&self) -> bool {
        self.conn.is_closed()
    }

    /// As [`ended`](Self::ended), for a transaction the caller keeps.
    pub(crate) fn mark_ended(&mut self) {
        self.open = false;
    }
}

impl Drop for Tx<'_> {
    fn drop(&mut self) {
        if self.open || self.conn.wire.in_transaction() {
            // Best effort: a lost connection has rolled back on the server
            // anyway.
            let _ = self.conn.wire.simple("ROLLBACK");
        }
    }
}

/// The row of a [`Step::QueryOne`] (checked: there is one).
fn only_row(mut done: Done) -> Row {
    match done.rows.pop() {
        Some(row) => row,
        None => unreachable!("query_one returns a row or an error"),
    }
}
