//! A reads/commits connection with its prepared statements.
//!
//! `Client::query` with a string prepares the statement on every call (one
//! round trip to parse and describe it, one to run it). A [`Conn`] prepares
//! each statement text once per connection and runs the prepared statement
//! from then on: one round trip per statement, and no parsing or planning on
//! the server for the statements every transaction repeats. Prepared
//! statements belong to the server session, not to a transaction: a
//! rollback keeps them.

use std::collections::HashMap;

use postgres::types::ToSql;
use postgres::{Client, Row, Statement, Transaction};

/// A connection and the statements prepared on it.
pub(crate) struct Conn {
    client: Client,
    statements: HashMap<String, Statement>,
}

impl Conn {
    pub(crate) fn new(client: Client) -> Self {
        Self {
            client,
            statements: HashMap::new(),
        }
    }

    /// Begins a transaction that runs its statements prepared.
    pub(crate) fn begin(&mut self) -> Result<Tx<'_>, postgres::Error> {
        Ok(Tx {
            tx: self.client.transaction()?,
            statements: &mut self.statements,
        })
    }
}

impl std::ops::Deref for Conn {
    type Target = Client;

    fn deref(&self) -> &Client {
        &self.client
    }
}

impl std::ops::DerefMut for Conn {
    fn deref_mut(&mut self) -> &mut Client {
        &mut self.client
    }
}

/// A transaction on a [`Conn`]: the calls of [`Transaction`], each with a
/// statement prepared once per connection. Dropped without
/// [`commit`](Self::commit), it rolls back.
pub(crate) struct Tx<'c> {
    tx: Transaction<'c>,
    statements: &'c mut HashMap<String, Statement>,
}

type Params<'a> = &'a [&'a (dyn ToSql + Sync)];

impl Tx<'_> {
    fn prepared(&mut self, sql: &str) -> Result<Statement, postgres::Error> {
        if let Some(statement) = self.statements.get(sql) {
            return Ok(statement.clone());
        }
        let statement = self.tx.prepare(sql)?;
        self.statements.insert(sql.to_owned(), statement.clone());
        Ok(statement)
    }

    pub(crate) fn query(
        &mut self,
        sql: &str,
        params: Params<'_>,
    ) -> Result<Vec<Row>, postgres::Error> {
        let statement = self.prepared(sql)?;
        self.tx.query(&statement, params)
    }

    pub(crate) fn query_one(
        &mut self,
        sql: &str,
        params: Params<'_>,
    ) -> Result<Row, postgres::Error> {
        let statement = self.prepared(sql)?;
        self.tx.query_one(&statement, params)
    }

    pub(crate) fn query_opt(
        &mut self,
        sql: &str,
        params: Params<'_>,
    ) -> Result<Option<Row>, postgres::Error> {
        let statement = self.prepared(sql)?;
        self.tx.query_opt(&statement, params)
    }

    pub(crate) fn execute(
        &mut self,
        sql: &str,
        params: Params<'_>,
    ) -> Result<u64, postgres::Error> {
        let statement = self.prepared(sql)?;
        self.tx.execute(&statement, params)
    }

    pub(crate) fn commit(self) -> Result<(), postgres::Error> {
        self.tx.commit()
    }
}
