//! One session and its pipelines: statements prepared once per session by
//! name, and a pipeline of statements sent in one write and ended by one
//! `Sync`.
//!
//! **A pipeline** `[s1, s2, …]` goes out as `Bind`/`Execute` per statement
//! (after a `Parse`/`Describe` round trip for statements this session has not
//! prepared yet), then one `Sync`, in one write; the answers are read up to
//! the server's `ReadyForQuery`. So the server reads the statements in one
//! go, answers them in one go, and flushes its socket once, and the client
//! waits once.
//!
//! **What one `Sync` changes.** The server runs the statements one after the
//! other, in the order sent, each with its own snapshot, exactly as if sent
//! one by one. But:
//!
//! - after an error, the server *skips* every later statement of the
//!   pipeline (they do not run: each gets [`WireError::is_skipped`]) up to
//!   the `Sync`;
//! - statements outside an explicit transaction (no `BEGIN` in front) form
//!   one implicit transaction up to the `Sync`: all commit at the `Sync`, or
//!   none when one fails. A `COMMIT` inside the pipeline commits at once;
//!   the statements after it run in such an implicit transaction;
//! - an error inside an explicit transaction leaves the session in a failed
//!   transaction (the `COMMIT` after the error was skipped): the caller must
//!   roll it back. [`Connection::in_transaction`] says whether one is open.
//!
//! **Bounded pipelines.** The client writes the whole pipeline before it
//! reads an answer (blocking socket). The server answers each statement as it
//! runs it, so a pipeline whose *early* statements return more rows than the
//! two sockets' buffers hold (megabytes on loopback) while the client still
//! writes a large rest would wait on both sides. The engine's pipelines are
//! a few statements, and a statement that returns many rows (reads of the
//! chain, of due or claimed items) is a pipeline of its own, as is the one
//! large write (a sealing's records, then its `COMMIT`): keep them so.

use std::collections::HashMap;
use std::sync::Arc;

use postgres_protocol::message::backend::Message;
use postgres_protocol::message::frontend;
use postgres_types::{Format, ToSql, Type};

use super::error::WireError;
use super::frame::Framed;
use super::row::{Column, Row};

/// A statement's parameters.
pub(crate) type Params<'a> = &'a [&'a (dyn ToSql + Sync)];

/// What one statement of a pipeline returned.
#[derive(Debug, Default)]
pub(crate) struct Outcome {
    /// Its rows (none for a statement that returns none).
    pub(crate) rows: Vec<Row>,
    /// The count of its command tag: rows inserted, updated, deleted or
    /// selected.
    pub(crate) count: u64,
}

/// A statement prepared on the session, and what its description said.
struct Prepared {
    name: String,
    params: Vec<Type>,
    columns: Arc<[Column]>,
}

/// One session with the server.
pub(crate) struct Connection {
    framed: Framed,
    statements: HashMap<String, Arc<Prepared>>,
    /// Statement names handed out so far: names are never reused, so a
    /// statement the server prepared and the client never heard of cannot
    /// collide with a later one.
    named: u64,
    /// The transaction status of the last `ReadyForQuery`: `I` idle, `T` in
    /// a transaction, `E` in a failed one.
    status: u8,
    closed: bool,
    /// Round trips so far: writes the client then waited on.
    round_trips: u64,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("prepared", &self.statements.len())
            .field("status", &char::from(self.status))
            .field("closed", &self.closed)
            .finish_non_exhaustive()
    }
}

impl Connection {
    /// Opens a session with the settings of `config` (see
    /// [`startup`](super::startup)).
    ///
    /// # Errors
    /// As [`startup::open`](super::startup::open).
    pub(crate) fn connect(config: &tokio_postgres::Config) -> Result<Self, WireError> {
        Ok(Self {
            framed: super::startup::open(config)?,
            statements: HashMap::new(),
            named: 0,
            status: b'I',
            closed: false,
            round_trips: 0,
        })
    }

    /// Whether the session is gone (found so by the last exchange: a socket
    /// error, the server closing it, or a session-ending error).
    pub(crate) fn is_closed(&self) -> bool {
        self.closed
    }

    /// Whether the server said, at the end of the last exchange, that a
    /// transaction is open on the session (possibly a failed one).
    pub(crate) fn in_transaction(&self) -> bool {
        self.status != b'I'
    }

    /// How many round trips the session took since it opened.
    #[cfg(test)]
    pub(crate) fn round_trips(&self) -> u64 {
        self.round_trips
    }

    /// Writes what is encoded, as one round trip.
    fn send(&mut self) -> Result<(), WireError> {
        self.round_trips += 1;
        self.framed.flush()
    }

    /// Notes `e`; a connection-ending one closes the session for good.
    fn note(&mut self, e: WireError) -> WireError {
        if e.is_closed() {
            self.closed = true;
        }
        e
    }

    /// Runs `statements` as one pipeline (see the module docs): each one's
    /// result, in order. The first error is the statement's own; the
    /// statements after it were skipped. When the session is lost meanwhile,
    /// every statement not answered yet gets a closed-connection error (it
    /// may or may not have run: a `COMMIT` among them may have committed).
    ///
    /// # Errors
    /// Before anything of the pipeline ran: the session is closed, preparing
    /// a statement failed (the server's error for it), or a parameter could
    /// not be encoded.
    pub(crate) fn pipeline(
        &mut self,
        statements: &[(&str, Params<'_>)],
    ) -> Result<Vec<Result<Outcome, WireError>>, WireError> {
        if self.closed {
            return Err(WireError::closed());
        }
        let prepared = self.prepare(statements.iter().map(|(sql, _)| *sql))?;
        if let Err(e) = self.encode(statements, &prepared) {
            self.framed.out.clear();
            return Err(e);
        }
        frontend::sync(&mut self.framed.out);
        if let Err(e) = self.send() {
            // Nothing (or part of the pipeline, without its `Sync`) reached
            // the server: each statement fails with the loss.
            let e = self.note(e);
            let mut all: Vec<Result<Outcome, WireError>> = Vec::with_capacity(statements.len());
            all.push(Err(e));
            all.resize_with(statements.len().max(1), || Err(WireError::closed()));
            all.truncate(statements.len());
            return Ok(all);
        }
        Ok(self.read_results(&prepared))
    }

    /// `Bind`/`Execute` of each statement into the outgoing buffer.
    fn encode(
        &mut self,
        statements: &[(&str, Params<'_>)],
        prepared: &[Arc<Prepared>],
    ) -> Result<(), WireError> {
        for ((_, params), statement) in statements.iter().zip(prepared) {
            if params.len() != statement.params.len() {
                return Err(WireError::parameter(format!(
                    "the statement takes {} parameters, {} given",
                    statement.params.len(),
                    params.len()
                )));
            }
            let formats: Vec<i16> = params
                .iter()
                .zip(&statement.params)
                .map(|(param, ty)| match param.encode_format(ty) {
                    Format::Text => 0,
                    Format::Binary => 1,
                })
                .collect();
            let mut at = 0usize;
            let bound = frontend::bind(
                "",
                &statement.name,
                formats,
                params.iter().zip(&statement.params),
                |(param, ty), buf| {
                    at += 1;
                    match param.to_sql_checked(ty, buf) {
                        Ok(postgres_types::IsNull::No) => Ok(postgres_protocol::IsNull::No),
                        Ok(postgres_types::IsNull::Yes) => Ok(postgres_protocol::IsNull::Yes),
                        Err(e) => Err(format!("${at} ({ty}): {e}").into()),
                    }
                },
                Some(1),
                &mut self.framed.out,
            );
            match bound {
                Ok(()) => {}
                Err(frontend::BindError::Conversion(e)) => {
                    return Err(WireError::parameter(e.to_string()));
                }
                Err(frontend::BindError::Serialization(e)) => {
                    return Err(WireError::parameter(e.to_string()));
                }
            }
            frontend::execute("", 0, &mut self.framed.out)
                .map_err(|e| WireError::parameter(e.to_string()))?;
        }
        Ok(())
    }

    /// Reads the answers of a pipeline of `prepared` up to `ReadyForQuery`.
    fn read_results(&mut self, prepared: &[Arc<Prepared>]) -> Vec<Result<Outcome, WireError>> {
        let n = prepared.len();
        let mut results: Vec<Result<Outcome, WireError>> = Vec::with_capacity(n);
        let mut rows: Vec<Row> = Vec::new();
        let mut failed = false;
        let lost = loop {
            let message = match self.framed.next() {
                Ok(message) => message,
                Err(e) => break Some(e),
            };
            match message {
                Message::BindComplete
                | Message::NoticeResponse(_)
                | Message::ParameterStatus(_)
                | Message::NotificationResponse(_) => {}
                Message::DataRow(body) => {
                    let Some(statement) = prepared.get(results.len()) else {
                        break Some(WireError::protocol("a row after the last statement"));
                    };
                    match Row::new(statement.columns.clone(), body) {
                        Ok(row) => rows.push(row),
                        Err(e) => break Some(e),
                    }
                }
                Message::CommandComplete(body) => {
                    let count = body
                        .tag()
                        .ok()
                        .and_then(|tag| tag.rsplit(' ').next())
                        .and_then(|n| n.parse().ok())
                        .unwrap_or(0);
                    results.push(Ok(Outcome {
                        rows: std::mem::take(&mut rows),
                        count,
                    }));
                }
                Message::EmptyQueryResponse => results.push(Ok(Outcome::default())),
                Message::ErrorResponse(body) => {
                    let e = WireError::from_response(&body);
                    rows.clear();
                    failed = true;
                    if e.is_closed() {
                        results.push(Err(e));
                        break Some(WireError::closed());
                    }
                    results.push(Err(e));
                }
                Message::ReadyForQuery(body) => {
                    self.status = body.status();
                    break None;
                }
                _ => break Some(WireError::protocol("an unexpected message in a pipeline")),
            }
        };
        match lost {
            Some(e) => {
                let e = self.note(e);
                self.closed = true;
                if results.len() < n {
                    results.push(Err(e));
                }
                while results.len() < n {
                    results.push(Err(WireError::closed()));
                }
            }
            None => {
                while results.len() < n {
                    results.push(Err(if failed {
                        WireError::skipped()
                    } else {
                        WireError::protocol("the server answered fewer statements than sent")
                    }));
                }
            }
        }
        results.truncate(n);
        results
    }

    /// The prepared statement of each of `sqls`, preparing (in one round
    /// trip) those this session has not prepared yet.
    fn prepare<'s>(
        &mut self,
        sqls: impl Iterator<Item = &'s str> + Clone,
    ) -> Result<Vec<Arc<Prepared>>, WireError> {
        let mut missing: Vec<(&str, String)> = Vec::new();
        for sql in sqls.clone() {
            if !self.statements.contains_key(sql) && !missing.iter().any(|(m, _)| *m == sql) {
                let name = format!("s{}", self.named);
                self.named += 1;
                missing.push((sql, name));
            }
        }
        if !missing.is_empty() {
            self.prepare_missing(&missing)?;
        }
        sqls.map(|sql| {
            self.statements
                .get(sql)
                .cloned()
                .ok_or_else(|| WireError::protocol("a statement was not prepared"))
        })
        .collect()
    }

    /// `Parse` and `Describe` of each statement, one `Sync`: the statements,
    /// their parameter types and result columns, kept for the session.
    fn prepare_missing(&mut self, missing: &[(&str, String)]) -> Result<(), WireError> {
        if self.closed {
            return Err(WireError::closed());
        }
        for (sql, name) in missing {
            frontend::parse(name, sql, std::iter::empty(), &mut self.framed.out)
                .and_then(|()| frontend::describe(b'S', name, &mut self.framed.out))
                .map_err(|e| {
                    self.framed.out.clear();
                    WireError::parameter(format!("a statement's text: {e}"))
                })?;
        }
        frontend::sync(&mut self.framed.out);
        if let Err(e) = self.send() {
            return Err(self.note(e));
        }
        let mut error: Option<WireError> = None;
        let mut at = 0;
        let mut params: Vec<Type> = Vec::new();
        loop {
            let message = match self.framed.next() {
                Ok(message) => message,
                Err(e) => return Err(self.note(e)),
            };
            match message {
                Message::ParseComplete
                | Message::NoticeResponse(_)
                | Message::ParameterStatus(_)
                | Message::NotificationResponse(_) => {}
                Message::ParameterDescription(body) => {
                    use fallible_iterator::FallibleIterator;
                    params.clear();
                    let mut oids = body.parameters();
                    loop {
                        match oids.next() {
                            Ok(Some(oid)) => match Type::from_oid(oid) {
                                Some(ty) => params.push(ty),
                                None => {
                                    error.get_or_insert(WireError::parameter(format!(
                                        "parameter type OID {oid} is not a built-in type"
                                    )));
                                }
                            },
                            Ok(None) => break,
                            Err(e) => return Err(self.note(WireError::io(e))),
                        }
                    }
                }
                Message::RowDescription(body) => {
                    use fallible_iterator::FallibleIterator;
                    let mut columns = Vec::new();
                    let mut fields = body.fields();
                    loop {
                        match fields.next() {
                            Ok(Some(field)) => match Type::from_oid(field.type_oid()) {
                                Some(ty) => columns.push(Column {
                                    name: field.name().to_owned(),
                                    ty,
                                }),
                                None => {
                                    error.get_or_insert(WireError::column(format!(
                                        "column {} has type OID {}, not a built-in type",
                                        field.name(),
                                        field.type_oid()
                                    )));
                                }
                            },
                            Ok(None) => break,
                            Err(e) => return Err(self.note(WireError::io(e))),
                        }
                    }
                    self.described(missing.get(at), &mut params, columns, error.is_some());
                    at += 1;
                }
                Message::NoData => {
                    self.described(missing.get(at), &mut params, Vec::new(), error.is_some());
                    at += 1;
                }
                Message::ErrorResponse(body) => {
                    let e = WireError::from_response(&body);
                    if e.is_closed() {
                        return Err(self.note(e));
                    }
                    error.get_or_insert(e);
                }
                Message::ReadyForQuery(body) => {
                    self.status = body.status();
                    break;
                }
                _ => {
                    return Err(
                        self.note(WireError::protocol("an unexpected message while preparing"))
                    );
                }
            }
        }
        match error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Keeps a statement once its description is complete (not when one of
    /// its types is unknown).
    fn described(
        &mut self,
        statement: Option<&(&str, String)>,
        params: &mut Vec<Type>,
        columns: Vec<Column>,
        broken: bool,
    ) {
        let params = std::mem::take(params);
        if let (Some((sql, name)), false) = (statement, broken) {
            self.statements.insert(
                (*sql).to_owned(),
                Arc::new(Prepared {
                    name: name.clone(),
                    params,
                    columns: columns.into(),
                }),
            );
        }
    }

    /// Runs `sql` (no parameters, possibly several statements) with the
    /// simple protocol; the first error.
    ///
    /// # Errors
    /// The server's first error, or the session's loss.
    pub(crate) fn simple(&mut self, sql: &str) -> Result<(), WireError> {
        if self.closed {
            return Err(WireError::closed());
        }
        frontend::query(sql, &mut self.framed.out).map_err(|e| {
            self.framed.out.clear();
            WireError::parameter(format!("a statement's text: {e}"))
        })?;
        if let Err(e) = self.send() {
            return Err(self.note(e));
        }
        let mut error = None;
        loop {
            match self.framed.next() {
                Ok(Message::ErrorResponse(body)) => {
                    let e = WireError::from_response(&body);
                    if e.is_closed() {
                        return Err(self.note(e));
                    }
                    error.get_or_insert(e);
                }
                Ok(Message::ReadyForQuery(body)) => {
                    self.status = body.status();
                    break;
                }
                Ok(_) => {}
                Err(e) => return Err(self.note(e)),
            }
        }
        match error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        if !self.closed {
            // Best effort: the server ends the session either way.
            frontend::terminate(&mut self.framed.out);
            let _ = self.framed.flush();
        }
    }
}
