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
//! **A silent server is found out, a slow statement is not cut.** A
//! [watched](Connection::watch) session bounds each wait for an answer by
//! its patience (the pool: the URL's `tcp_user_timeout`, 30 s by default).
//! When it passes without a byte, the client does not give up yet: a slow
//! statement (a lock wait behind another host's `compact`, a big
//! `compact` itself, a slow disk under `COMMIT`) sends nothing for as long
//! as it runs, and cutting it would fail work that was going to succeed. It
//! asks the server instead, over a new connection bounded the same way,
//! whether the session's backend is running a statement
//! (`pg_stat_activity`: `active`, and not waiting to read from or write
//! to its client): if so it waits again; if the backend is gone, or
//! twice in a row not running one (its answer is lost on the way), or the
//! server cannot be reached to ask, the session is given up (closed; a
//! `COMMIT` among the statements not answered may or may not have
//! committed). A server that refuses the question (too many connections)
//! is alive, and the wait goes on.
//!
//! **Bounded writes.** The server answers each statement as it runs it, and
//! stops reading while its answers wait to be read; a blocking client that
//! wrote a whole large pipeline before reading would then wait on the
//! server and the server on it, for ever (a Unix socket holds about 200 KiB
//! in flight: the answers to 10,000 item writes of an `enqueue_many`). So a
//! pipeline goes out in parts: a statement, then those after it up to
//! [`PART`] bytes; each part but the last ends with a `Flush`, and
//! its answers are read before the next part is written; the last ends with
//! the `Sync`. What the client writes while the server may be answering
//! is thus at most `PART` bytes (nothing of a part is answered before its
//! first statement was read whole), which the sockets' buffers hold. After an error in a part,
//! the parts after it are not sent (the server would skip them): the
//! `Sync` follows at once. The one-`Sync` semantics above are unchanged; a
//! pipeline of `k` parts costs `k` round trips (one for the pipelines the
//! engine sends per item). A statement whose *rows* outgrow the buffers
//! while the rest of its part is written is still a risk: the engine runs
//! such reads (of the chain, of due or claimed items) as pipelines of their
//! own.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use postgres_protocol::message::backend::Message;
use postgres_protocol::message::frontend;
use postgres_types::{Format, ToSql, Type};

use super::error::WireError;
use super::frame::Framed;
use super::row::{Column, Row};

/// The most bytes of a pipeline written before its answers so far are read
/// (see the module docs): far below what a connection buffers in flight
/// (a Unix socket about 200 KiB, TCP on loopback more).
pub(super) const PART: usize = 32 * 1024;

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

/// A pipeline's answers read so far.
struct Answers<'p> {
    prepared: &'p [Arc<Prepared>],
    results: Vec<Result<Outcome, WireError>>,
    /// The rows of the statement being answered.
    rows: Vec<Row>,
    /// Whether a statement failed (the server skips the rest).
    failed: bool,
}

/// What a [watched](Connection::watch) session needs to ask the server about
/// itself when it goes silent.
struct Watch {
    /// The settings to open the asking connection with.
    config: tokio_postgres::Config,
    /// The session's backend process (`pg_backend_pid()`).
    pid: i32,
    patience: Duration,
}

/// What the server said about a silent session's backend.
#[derive(Debug, PartialEq, Eq)]
enum Probe {
    /// Running a statement (or the server alive but refusing to tell).
    Working,
    /// Alive, not running a statement: its answer was sent.
    Idle,
    /// No such backend, or no answer from the server.
    Gone,
}

impl Watch {
    fn probe(&self) -> Probe {
        let mut asking = match Connection::connect(&self.config) {
            Ok(asking) => asking,
            // The server answered with a refusal: it is alive.
            Err(e) if e.code().is_some() => return Probe::Working,
            Err(_) => return Probe::Gone,
        };
        if asking
            .framed
            .socket()
            .set_timeout(Some(self.patience))
            .is_err()
        {
            return Probe::Gone;
        }
        // Running a statement, and not waiting on the client: a backend that
        // waits to read (a pipeline's part answered, awaiting the next) or to
        // write (its answer stuck on the way) has nothing more to say.
        let sql = format!(
            "SELECT coalesce(state = 'active' \
                 AND wait_event_type IS DISTINCT FROM 'Client', false) \
             FROM pg_catalog.pg_stat_activity WHERE pid = {}",
            self.pid
        );
        match asking.simple_value(&sql) {
            Ok(Some(working)) if working == "t" => Probe::Working,
            Ok(Some(_)) => Probe::Idle,
            Err(e) if e.code().is_some() => Probe::Working,
            Ok(None) | Err(_) => Probe::Gone,
        }
    }
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
    /// How a silent server is found out (`None`: waits are unbounded).
    watch: Option<Watch>,
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
        Ok(Self::over(super::startup::open(config)?))
    }

    /// Bounds each wait for an answer by `patience`, after which the server
    /// is asked whether the session is still running a statement (see the
    /// module docs); `config` opens the asking connection.
    ///
    /// # Errors
    /// Reading the session's backend process id failed (its own error).
    pub(crate) fn watch(
        &mut self,
        patience: Duration,
        config: &tokio_postgres::Config,
    ) -> Result<(), WireError> {
        let pid = self
            .simple_value("SELECT pg_backend_pid()")?
            .and_then(|pid| pid.parse().ok())
            .ok_or_else(|| WireError::protocol("pg_backend_pid() returned no number"))?;
        self.framed
            .socket()
            .set_timeout(Some(patience))
            .map_err(|e| self.note(WireError::io(e)))?;
        self.watch = Some(Watch {
            config: config.clone(),
            pid,
            patience,
        });
        Ok(())
    }

    /// The next message, waiting as long as the server works on the
    /// session's statement (see the module docs).
    fn next(&mut self) -> Result<Message, WireError> {
        let mut idle = false;
        loop {
            match self.framed.next() {
                Err(e) if e.is_quiet() => {
                    let Some(watch) = &self.watch else {
                        return Err(e);
                    };
                    match watch.probe() {
                        Probe::Working => idle = false,
                        Probe::Idle if !idle => idle = true,
                        verdict => {
                            return Err(WireError::silent(format!(
                                "no answer for {:?}, then {}",
                                watch.patience,
                                if verdict == Probe::Idle {
                                    "its backend twice found not running a statement"
                                } else {
                                    "its backend gone or the server unreachable"
                                }
                            )));
                        }
                    }
                }
                other => return other,
            }
        }
    }

    /// A session over `framed`, already started (by [`connect`](Self::connect),
    /// or a test's stand-in server).
    pub(super) fn over(framed: Framed) -> Self {
        Self {
            framed,
            statements: HashMap::new(),
            named: 0,
            status: b'I',
            closed: false,
            round_trips: 0,
            watch: None,
        }
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
        let ends = match self.encode(statements, &prepared) {
            Ok(ends) => ends,
            Err(e) => {
                self.framed.out.clear();
                return Err(e);
            }
        };
        let encoded = self.framed.out.split();
        let mut answers = Answers {
            prepared: &prepared,
            results: Vec::with_capacity(prepared.len()),
            rows: Vec::new(),
            failed: false,
        };
        let n = prepared.len();
        // Statements `next..` and their bytes from `start` are still to go.
        let (mut next, mut start) = (0, 0);
        let lost = loop {
            // A part: its first statement, whatever its size (the server
            // answers nothing of the part before it has read it whole), then
            // statements while they add up to at most `PART` bytes.
            let mut end = next + 1;
            while end < n && ends[end] - ends[next] <= PART {
                end += 1;
            }
            let end = end.min(n);
            let stop = if end > next { ends[end - 1] } else { start };
            self.framed.out.extend_from_slice(&encoded[start..stop]);
            let last = end == n;
            if last {
                frontend::sync(&mut self.framed.out);
            } else {
                frontend::flush(&mut self.framed.out);
            }
            if let Err(e) = self.send() {
                break Some(e);
            }
            if last {
                break self.read_answers(&mut answers, None).err();
            }
            if let Err(e) = self.read_answers(&mut answers, Some(end)) {
                break Some(e);
            }
            (next, start) = (end, stop);
            if answers.failed {
                // The server skips everything up to the `Sync`: the rest is
                // not sent at all.
                frontend::sync(&mut self.framed.out);
                if let Err(e) = self.send() {
                    break Some(e);
                }
                break self.read_answers(&mut answers, None).err();
            }
        };
        Ok(self.finish(answers, lost))
    }

    /// `Bind`/`Execute` of each statement into the outgoing buffer.
    fn encode(
        &mut self,
        statements: &[(&str, Params<'_>)],
        prepared: &[Arc<Prepared>],
    ) -> Result<Vec<usize>, WireError> {
        let mut ends = Vec::with_capacity(statements.len());
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
            ends.push(self.framed.out.len());
        }
        Ok(ends)
    }

    /// Reads answers of a pipeline into `answers`: up to `ReadyForQuery`
    /// (`until`: `None`, the `Sync` was sent), or until statements `..n` are
    /// answered or one failed (`Some(n)`, a `Flush` was sent). `Err`: the
    /// session was lost, or the server broke the protocol.
    fn read_answers(
        &mut self,
        answers: &mut Answers<'_>,
        until: Option<usize>,
    ) -> Result<(), WireError> {
        loop {
            if until.is_some_and(|n| answers.failed || answers.results.len() >= n) {
                return Ok(());
            }
            match self.next()? {
                Message::BindComplete
                | Message::NoticeResponse(_)
                | Message::ParameterStatus(_)
                | Message::NotificationResponse(_) => {}
                Message::DataRow(body) => {
                    let Some(statement) = answers.prepared.get(answers.results.len()) else {
                        return Err(WireError::protocol("a row after the last statement"));
                    };
                    answers
                        .rows
                        .push(Row::new(statement.columns.clone(), body)?);
                }
                Message::CommandComplete(body) => {
                    let count = body
                        .tag()
                        .ok()
                        .and_then(|tag| tag.rsplit(' ').next())
                        .and_then(|n| n.parse().ok())
                        .unwrap_or(0);
                    let rows = std::mem::take(&mut answers.rows);
                    answers.results.push(Ok(Outcome { rows, count }));
                }
                Message::EmptyQueryResponse => answers.results.push(Ok(Outcome::default())),
                Message::ErrorResponse(body) => {
                    let e = WireError::from_response(&body);
                    answers.rows.clear();
                    answers.failed = true;
                    let ends_session = e.is_closed();
                    answers.results.push(Err(e));
                    if ends_session {
                        return Err(WireError::closed());
                    }
                }
                Message::ReadyForQuery(body) if until.is_none() => {
                    self.status = body.status();
                    return Ok(());
                }
                _ => return Err(WireError::protocol("an unexpected message in a pipeline")),
            }
        }
    }

    /// Each statement's result: its answer, "not run" for a statement the
    /// server skipped after an error, and, once the session was `lost`, the
    /// loss for every statement not answered (it may or may not have run).
    fn finish(
        &mut self,
        answers: Answers<'_>,
        lost: Option<WireError>,
    ) -> Vec<Result<Outcome, WireError>> {
        let n = answers.prepared.len();
        let mut results = answers.results;
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
                    results.push(Err(if answers.failed {
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
            let message = match self.next() {
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
        self.simple_value(sql).map(drop)
    }

    /// As [`simple`](Self::simple): the first column of the first row, as
    /// text (`None`: no row, or SQL `NULL`).
    fn simple_value(&mut self, sql: &str) -> Result<Option<String>, WireError> {
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
        let mut value = None;
        let mut row = false;
        loop {
            match self.next() {
                Ok(Message::ErrorResponse(body)) => {
                    let e = WireError::from_response(&body);
                    if e.is_closed() {
                        return Err(self.note(e));
                    }
                    error.get_or_insert(e);
                }
                Ok(Message::DataRow(body)) if !row => {
                    use fallible_iterator::FallibleIterator;
                    row = true;
                    let buffer = body.buffer();
                    value = body
                        .ranges()
                        .next()
                        .ok()
                        .flatten()
                        .flatten()
                        .and_then(|r| buffer.get(r))
                        .map(|v| String::from_utf8_lossy(v).into_owned());
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
            None => Ok(value),
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
