//! What can go wrong on a wire connection: the server's own errors (with
//! their SQLSTATE), a lost or broken connection, and the client-side checks
//! (parameters, row counts, column types).

use std::fmt;

use postgres_protocol::message::backend::ErrorResponseBody;
use tokio_postgres::error::SqlState;

/// A failure of a wire connection or of one statement on it.
#[derive(Debug)]
pub(crate) struct WireError {
    kind: Kind,
}

#[derive(Debug)]
enum Kind {
    /// The server refused the statement (or the login): its report.
    Db(Box<DbError>),
    /// Reading or writing the socket failed: the connection is closed.
    Io(std::io::Error),
    /// The server closed the connection.
    Closed,
    /// No answer came within the socket's bound (the session may be alive).
    Quiet,
    /// The server went silent and was found not working on the session's
    /// statement: the client gave the session up.
    Silent(String),
    /// The server sent something the protocol does not allow here.
    Protocol(String),
    /// An earlier statement of the same pipeline failed, so the server
    /// skipped this one (it did not run).
    Skipped,
    /// A statement returned another number of rows than the caller expects.
    RowCount { expected: &'static str, got: usize },
    /// A parameter could not be encoded, or has the wrong count.
    Parameter(String),
    /// A column could not be read as the type asked for.
    Column(String),
    /// The connection settings ask for something this client cannot do.
    Config(String),
}

/// The server's report of an error: severity, SQLSTATE and texts.
#[derive(Debug)]
pub(crate) struct DbError {
    severity: String,
    code: SqlState,
    message: String,
    detail: Option<String>,
    hint: Option<String>,
}

impl DbError {
    /// The SQLSTATE.
    pub(crate) fn code(&self) -> &SqlState {
        &self.code
    }

    /// Whether the server ends the session with this error (`FATAL`, `PANIC`).
    fn ends_session(&self) -> bool {
        matches!(self.severity.as_str(), "FATAL" | "PANIC")
    }
}

impl fmt::Display for DbError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.severity, self.message)?;
        if let Some(detail) = &self.detail {
            write!(f, "\nDETAIL: {detail}")?;
        }
        if let Some(hint) = &self.hint {
            write!(f, "\nHINT: {hint}")?;
        }
        Ok(())
    }
}

impl WireError {
    /// The server's `ErrorResponse`.
    pub(super) fn from_response(body: &ErrorResponseBody) -> Self {
        use fallible_iterator::FallibleIterator;
        let mut severity = None;
        let mut localized = None;
        let mut code = None;
        let mut message = None;
        let mut detail = None;
        let mut hint = None;
        let mut fields = body.fields();
        loop {
            match fields.next() {
                Ok(Some(field)) => {
                    let value = String::from_utf8_lossy(field.value_bytes()).into_owned();
                    match field.type_() {
                        // `V` is never localized; `S` may be.
                        b'V' => severity = Some(value),
                        b'S' => localized = Some(value),
                        b'C' => code = Some(value),
                        b'M' => message = Some(value),
                        b'D' => detail = Some(value),
                        b'H' => hint = Some(value),
                        _ => {}
                    }
                }
                Ok(None) => break,
                Err(e) => return Self::protocol(format!("a malformed error report: {e}")),
            }
        }
        Self {
            kind: Kind::Db(Box::new(DbError {
                severity: severity.or(localized).unwrap_or_else(|| "ERROR".into()),
                code: SqlState::from_code(code.as_deref().unwrap_or("XX000")),
                message: message.unwrap_or_default(),
                detail,
                hint,
            })),
        }
    }

    pub(super) fn io(e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            return Self::closed();
        }
        Self { kind: Kind::Io(e) }
    }

    pub(super) fn closed() -> Self {
        Self { kind: Kind::Closed }
    }

    pub(super) fn quiet() -> Self {
        Self { kind: Kind::Quiet }
    }

    pub(super) fn silent(what: impl Into<String>) -> Self {
        Self {
            kind: Kind::Silent(what.into()),
        }
    }

    /// Whether a read found no answer within the socket's bound.
    pub(super) fn is_quiet(&self) -> bool {
        matches!(self.kind, Kind::Quiet)
    }

    pub(super) fn protocol(what: impl Into<String>) -> Self {
        Self {
            kind: Kind::Protocol(what.into()),
        }
    }

    pub(super) fn skipped() -> Self {
        Self {
            kind: Kind::Skipped,
        }
    }

    pub(crate) fn row_count(expected: &'static str, got: usize) -> Self {
        Self {
            kind: Kind::RowCount { expected, got },
        }
    }

    pub(super) fn parameter(what: impl Into<String>) -> Self {
        Self {
            kind: Kind::Parameter(what.into()),
        }
    }

    pub(super) fn column(what: impl Into<String>) -> Self {
        Self {
            kind: Kind::Column(what.into()),
        }
    }

    pub(super) fn config(what: impl Into<String>) -> Self {
        Self {
            kind: Kind::Config(what.into()),
        }
    }

    /// The server's SQLSTATE, when the server reported this error.
    pub(crate) fn code(&self) -> Option<&SqlState> {
        self.as_db_error().map(DbError::code)
    }

    /// The server's report, when the server reported this error.
    pub(crate) fn as_db_error(&self) -> Option<&DbError> {
        match &self.kind {
            Kind::Db(db) => Some(db),
            _ => None,
        }
    }

    /// Whether this error leaves the connection unusable: the socket failed,
    /// the server closed it, broke the protocol, or ended the session.
    pub(crate) fn is_closed(&self) -> bool {
        match &self.kind {
            Kind::Io(_) | Kind::Closed | Kind::Quiet | Kind::Silent(_) | Kind::Protocol(_) => true,
            Kind::Db(db) => db.ends_session(),
            _ => false,
        }
    }

    /// Whether the server skipped this statement after an earlier one of its
    /// pipeline failed.
    #[cfg(test)]
    pub(crate) fn is_skipped(&self) -> bool {
        matches!(self.kind, Kind::Skipped)
    }
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Db(db) => write!(f, "db error: {db}"),
            Kind::Io(e) => write!(f, "error communicating with the server: {e}"),
            Kind::Closed => f.write_str("connection closed"),
            Kind::Quiet => f.write_str("the server did not answer in time"),
            Kind::Silent(what) => write!(
                f,
                "connection given up: the server stopped answering ({what}); a statement \
                 sent may or may not have run"
            ),
            Kind::Protocol(what) => write!(f, "protocol error: {what}"),
            Kind::Skipped => f.write_str(
                "not run: an earlier statement of the same pipeline failed and the server \
                 skipped the rest",
            ),
            Kind::RowCount { expected, got } => {
                write!(f, "query returned {got} rows where {expected} was expected")
            }
            Kind::Parameter(what) => write!(f, "invalid parameter: {what}"),
            Kind::Column(what) => write!(f, "invalid column: {what}"),
            Kind::Config(what) => write!(f, "invalid connection settings: {what}"),
        }
    }
}

impl std::error::Error for WireError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.kind {
            Kind::Io(e) => Some(e),
            _ => None,
        }
    }
}
