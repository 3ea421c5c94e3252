//! The engine's own client for its reads/commits connections: a minimal
//! implementation of PostgreSQL's extended query protocol over a blocking
//! socket, built for one thing, pipelines: a transaction's statements go out
//! in one write and end with **one** `Sync`, so the server answers and flushes
//! once per round trip rather than once per statement, and the client waits
//! once (see [`connection`]).
//!
//! Messages, authentication and values come from `postgres-protocol` and
//! `postgres-types` (binary format both ways), the connection settings from
//! the `tokio_postgres::Config` the engine parses. The engine's other
//! sessions (owner lock, `LISTEN`, `NOTIFY`, migrations) keep the `postgres`
//! client.
//!
//! One concept per file: [`frame`] (the socket, message framing),
//! [`startup`] (hosts, the startup message, authentication), [`connection`]
//! (prepared statements, pipelines), [`row`] (decoding rows), [`error`].

mod connection;
mod error;
mod frame;
mod row;
mod startup;

#[cfg(test)]
mod tests;

pub(crate) use connection::{Connection, Outcome};
pub(crate) use error::WireError;
pub(crate) use row::Row;
