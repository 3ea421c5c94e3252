//! `durable-outbox`: the operator's command-line tool for an outbox directory.
//!
//! `main` only wires the real stdout and stderr to [`run`] and turns its error into
//! a message and an exit code; every command lives in its own module and writes
//! to the streams it is given. Build it with `--features cli`.

mod args;
mod history;
mod inspect;
mod migrate;
mod operate;
mod status;
mod upgrade;
mod verify;
mod view;

use std::error::Error;
use std::ffi::OsString;
use std::fmt;
use std::io::{self, BufWriter, Write};
use std::path::Path;
use std::process::ExitCode;

use clap::Parser;
use durable_outbox::{
    AMBIGUOUS_AFTER_RESTART, ItemState, Outbox, OutboxBuilder, OutboxItem, SEND_PANICKED,
};

use crate::args::{Cli, Command, Target};

/// What every command returns: an exit code, or an error for `main` to report.
pub type CliResult = Result<ExitCode, Box<dyn Error>>;

/// Exit code 1: something needs attention, was refused, or was not found.
pub const ATTENTION: u8 = 1;
/// Exit code 2: bad arguments or usage.
pub const USAGE: u8 = 2;

fn main() -> ExitCode {
    let stdout = io::stdout();
    let mut out = BufWriter::new(stdout.lock());
    let stderr = io::stderr();
    let mut err = stderr.lock();
    match run(std::env::args_os(), &mut out, &mut err) {
        Ok(code) => code,
        Err(error) => {
            // Whatever was printed before the error still goes out first.
            let _ = out.flush();
            report(error.as_ref(), &mut err)
        }
    }
}

/// Parses `args` (program name first) and runs the command.
///
/// # Errors
///
/// Whatever stopped the command: [`UsageError`] for bad arguments found after
/// parsing, the library's errors, and I/O errors writing the output.
pub fn run<I, T>(args: I, out: &mut dyn Write, err: &mut dyn Write) -> CliResult
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            // `--help` and `--version` go to stdout with 0; usage errors to stderr with 2.
            let text = e.render().to_string();
            if e.use_stderr() {
                err.write_all(text.as_bytes())?;
            } else {
                out.write_all(text.as_bytes())?;
                out.flush()?;
            }
            return Ok(ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(USAGE)));
        }
    };
    let code = match cli.command {
        Command::Status(args) => status::run(&args, out)?,
        Command::List(args) => inspect::list(&args, out)?,
        Command::Show(args) => inspect::show(&args, out)?,
        Command::Find(args) => inspect::find(&args, out)?,
        Command::Verify(args) => verify::run(&args, out, err)?,
        Command::Requeue(args) => operate::requeue(&args, out, err)?,
        Command::Cancel(args) => operate::cancel(&args, out, err)?,
        Command::Export(args) => inspect::export(&args, out)?,
        Command::Migrate(args) => migrate::run(&args, out)?,
        Command::UpgradeSchema(args) => upgrade::run(&args, out)?,
    };
    out.flush()?;
    Ok(code)
}

/// Prints `durable-outbox: <error>: <source>: …` and picks the exit code. A closed
/// pipe (`durable-outbox export … | head`) is a normal end, not an error.
fn report(error: &(dyn Error + 'static), err: &mut dyn Write) -> ExitCode {
    let mut chain = Some(error);
    let mut message = String::from("durable-outbox");
    while let Some(cause) = chain {
        if is_broken_pipe(cause) {
            return ExitCode::SUCCESS;
        }
        message.push_str(": ");
        message.push_str(&cause.to_string());
        chain = cause.source();
    }
    // The library's `InvalidConfig` names a value the tool took from the
    // command line (the URL, `--schema`, migrate's `DIR`): the tool sets
    // nothing else on a builder, and a stored setting that fails its checks
    // is reported as a damaged record instead.
    let library = error.downcast_ref::<durable_outbox::Error>();
    let bad_argument = error.is::<UsageError>()
        || matches!(library, Some(durable_outbox::Error::InvalidConfig { .. }));
    // An outbox at an older schema version is not usable as it is, as one
    // that is not an outbox: the tool does not migrate it as it looks.
    let older_schema = matches!(
        library,
        Some(durable_outbox::Error::SchemaUpgradeNeeded { .. })
    );
    let code = if bad_argument {
        message.push_str("\n\nFor more information, try '--help'.");
        USAGE
    } else if older_schema {
        message.push_str(upgrade::HINT);
        USAGE
    } else {
        ATTENTION
    };
    let _ = writeln!(err, "{message}");
    ExitCode::from(code)
}

/// Whether `error` is a write to a pipe whose reader has gone. JSON output reports
/// it wrapped in a `serde_json::Error`, whose `source()` skips the I/O error itself.
fn is_broken_pipe(error: &(dyn Error + 'static)) -> bool {
    let kind = error
        .downcast_ref::<io::Error>()
        .map(io::Error::kind)
        .or_else(|| {
            error
                .downcast_ref::<serde_json::Error>()
                .and_then(serde_json::Error::io_error_kind)
        });
    kind == Some(io::ErrorKind::BrokenPipe)
}

/// A problem with the arguments that clap cannot see, such as a directory that is
/// not an outbox. Exits with 2.
#[derive(Debug)]
pub struct UsageError(pub String);

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Error for UsageError {}

/// A lookup that matched nothing (`show`, `find`). Exits with 1.
#[derive(Debug)]
pub struct NotFound(pub String);

impl fmt::Display for NotFound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Error for NotFound {}

/// Error codes the library gives failures that may have been deliveries: only an
/// operator may send such an item again. `send_cancelled` is the async API's
/// `SEND_CANCELLED`, spelled out because the library exports it only with its
/// `tokio` feature, and a tokio bot's outbox must be read right without it.
pub const AMBIGUOUS_CODES: [&str; 3] = [AMBIGUOUS_AFTER_RESTART, SEND_PANICKED, "send_cancelled"];

/// Whether a failed item may have been delivered: its stored failure class says
/// so, or, for an item written before the class was stored (no class), its
/// error code is one of `legacy_codes` (the library's own ambiguous codes plus
/// the operator's `--ambiguous-code`s).
pub fn may_have_been_delivered(item: &OutboxItem, legacy_codes: &[&str]) -> bool {
    if item.state() != ItemState::Failed {
        return false;
    }
    match item.failure_class() {
        Some(class) => class.may_have_been_delivered(),
        None => item
            .error_code()
            .is_some_and(|code| legacy_codes.contains(&code)),
    }
}

/// The files whose presence makes a directory an outbox.
const OUTBOX_FILES: [&str; 4] = [
    "outbox.json",
    "outbox.journal",
    "audit.jsonl",
    "outbox.lock",
];

/// Opens the outbox in `target.dir` the way a bot does, without compacting it.
///
/// # Errors
///
/// As [`builder`], then the library's open errors.
pub fn open(target: &Target) -> Result<Outbox, Box<dyn Error>> {
    Ok(builder(target)?.open()?)
}

/// Checks that `target.dir` is an outbox and configures a handle on it.
///
/// The library would create a missing directory; an operator's typo must not, so
/// the directory has to exist and hold at least one outbox file. Opening does not
/// compact: a tool that mostly looks should write as little as possible.
///
/// # Errors
///
/// [`UsageError`] when `DIR` is not an outbox or the key file is unreadable or empty.
pub fn builder(target: &Target) -> Result<OutboxBuilder, Box<dyn Error>> {
    let dir = match place(target) {
        Place::Dir(dir) => dir,
        Place::Postgres(url) => return postgres_builder(target, url),
    };
    if target.schema.is_some() {
        return Err(usage(
            dir,
            "--schema applies to a postgres:// URL, not a directory",
        ));
    }
    match std::fs::metadata(dir) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => return Err(usage(dir, "not a directory")),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(usage(dir, "no such directory"));
        }
        Err(e) => return Err(Box::new(e)),
    }
    if !OUTBOX_FILES.iter().any(|name| dir.join(name).exists()) {
        return Err(usage(
            dir,
            "not an outbox directory (it has no outbox.json, outbox.journal, audit.jsonl or outbox.lock)",
        ));
    }
    // Checked above with its own messages; the library checks again as it
    // opens, so a directory emptied meanwhile is not made an outbox either.
    let mut builder = Outbox::builder(dir)
        .compact_on_open(false)
        .create_if_missing(false);
    if let Some(key) = audit_key(target)? {
        builder = builder.audit_key(key);
    }
    Ok(builder)
}

/// Where an outbox lives: the one place that tells a directory from a
/// PostgreSQL URL, for every command that takes `DIR|URL`.
#[derive(Debug, Clone, Copy)]
pub enum Place<'a> {
    /// A file outbox directory.
    Dir(&'a Path),
    /// A PostgreSQL outbox: the connection URL.
    Postgres(&'a str),
}

/// Which engine `target` names: a `postgres://` or `postgresql://` URL, or a directory.
pub fn place(target: &Target) -> Place<'_> {
    match target.dir.to_str() {
        Some(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
            Place::Postgres(url)
        }
        _ => Place::Dir(&target.dir),
    }
}

/// How to name the target in output: the directory, or the URL without its
/// password and without its query (`?password=…` is the other way the client
/// takes one, and `sslpassword` a third): user, host, port and database.
pub fn target_label(target: &Target) -> String {
    match place(target) {
        Place::Dir(dir) => dir.display().to_string(),
        Place::Postgres(url) => {
            let (scheme, rest) = url.split_once("://").unwrap_or(("postgres", url));
            // The client's order: credentials up to the first '@', then the
            // query from the first '?' after them.
            let (user, place) = match rest.split_once('@') {
                Some((credentials, place)) => {
                    let user = credentials
                        .split_once(':')
                        .map_or(credentials, |(name, _)| name);
                    (format!("{user}@"), place)
                }
                None => (String::new(), rest),
            };
            let place = place.split_once('?').map_or(place, |(place, _)| place);
            let shown = format!("{scheme}://{user}{place}");
            match &target.schema {
                Some(name) => format!("{shown} (schema {name})"),
                None => shown,
            }
        }
    }
}

#[cfg(feature = "postgres")]
fn postgres_builder(target: &Target, url: &str) -> Result<OutboxBuilder, Box<dyn Error>> {
    // A tool that only looks: a schema no bot has opened yet does not get
    // the tool's default settings stored as the outbox's, and a schema
    // holding no outbox (a typo, the wrong database) is refused, with
    // nothing created, as a directory that is not an outbox is. Nor is an
    // outbox at an older schema version migrated: the older bots running on
    // it would refuse it at their next start (`upgrade-schema` migrates).
    let mut builder = Outbox::postgres(url)
        .compact_on_open(false)
        .create_if_missing(false)
        .upgrade_schema(false);
    if let Some(schema) = &target.schema {
        builder = builder.schema(schema);
    }
    if let Some(key) = audit_key(target)? {
        builder = builder.audit_key(key);
    }
    Ok(builder)
}

#[cfg(not(feature = "postgres"))]
fn postgres_builder(_target: &Target, _url: &str) -> Result<OutboxBuilder, Box<dyn Error>> {
    Err(Box::new(UsageError(
        "this durable-outbox was built without PostgreSQL support: \
         build it with `--features cli,postgres`"
            .into(),
    )))
}

/// The HMAC key from `--audit-key-file`, if given.
///
/// # Errors
///
/// [`UsageError`] when the file cannot be read or is empty, or when group or
/// others can read it and `--allow-readable-key-file` was not given.
pub fn audit_key(target: &Target) -> Result<Option<Vec<u8>>, Box<dyn Error>> {
    let Some(path) = &target.audit_key_file else {
        return Ok(None);
    };
    let unreadable = |e: io::Error| usage(path, &format!("cannot read the audit key file: {e}"));
    // The mode is taken from the open file, so it is the file that is read.
    let mut file = std::fs::File::open(path).map_err(unreadable)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = file.metadata().map_err(unreadable)?.permissions().mode() & 0o7777;
        if mode & 0o077 != 0 && !target.allow_readable_key_file {
            return Err(usage(
                path,
                &format!(
                    "the audit key file is accessible by group or others (mode {mode:04o}): \
                     whoever can read the key can forge the audit log; \
                     run `chmod 600 {}`, or pass --allow-readable-key-file",
                    path.display()
                ),
            ));
        }
    }
    let mut key = Vec::new();
    io::Read::read_to_end(&mut file, &mut key).map_err(unreadable)?;
    if key.is_empty() {
        return Err(usage(path, "the audit key file is empty"));
    }
    Ok(Some(key))
}

fn usage(path: &Path, why: &str) -> Box<dyn Error> {
    Box::new(UsageError(format!("{}: {why}", path.display())))
}
