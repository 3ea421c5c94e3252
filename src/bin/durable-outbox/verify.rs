//! `verify`: the audit chain, its head against the state, and the state against
//! the log, with progress on long logs.

use std::collections::HashMap;
use std::io::{self, IsTerminal, Write};
use std::path::Path;
use std::process::ExitCode;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use durable_outbox::{
    AuditFault, AuditLog, AuditOutcome, Error, Head, ItemState, Outbox, OutboxItem,
};
use serde::Serialize;

use crate::args::VerifyArgs;
use crate::view::{self, clean};
use crate::{ATTENTION, CliResult};

/// How often a long step's line is rewritten on a terminal.
const TICK: Duration = Duration::from_secs(1);
/// How often a long step adds a line when progress goes to a file or pipe.
const LINE_TICK: Duration = Duration::from_secs(10);
/// How many records the cross-check reads between two progress lines.
const RECORDS_PER_REPORT: u64 = 100_000;
/// How many times to look for a moment when the bot is not committing (see `snapshot`).
const SNAPSHOT_TRIES: usize = 100;

/// The result; its JSON form is `verify --json`.
#[derive(Debug, Default, Serialize)]
struct Verification {
    verified: bool,
    /// Records in the chain (at the moment the cross-checks looked).
    records: Option<u64>,
    head_seq: Option<u64>,
    head_hash: Option<String>,
    items: Option<usize>,
    /// Items with no audit record at all: written by the reference design,
    /// which kept no log, and not touched since.
    unaudited_items: usize,
    /// A crash remnant after the last whole line, not yet set aside.
    torn_tail_bytes: u64,
    /// The line of the first problem, when a problem has one.
    first_bad_line: Option<u64>,
    /// Every problem found, those with a line first, in line order.
    problems: Vec<Problem>,
    /// The checks that passed, in order (text output).
    #[serde(skip)]
    passed: Vec<String>,
}

#[derive(Debug, Serialize)]
struct Problem {
    /// 1-based line of `audit.jsonl`, when the problem is one record.
    line: Option<u64>,
    /// The item involved, if any.
    idempotency_key: Option<String>,
    message: String,
    /// What else may explain it.
    #[serde(skip_serializing_if = "Option::is_none")]
    hint: Option<&'static str>,
}

pub fn run(args: &VerifyArgs, out: &mut dyn Write, err: &mut dyn Write) -> CliResult {
    let builder = crate::builder(&args.target)?;
    let mut progress = Progress::new(err, args.progress);
    let mut result = Verification::default();
    check(&args.target.dir, builder, &mut progress, &mut result)?;
    progress.finish()?;
    result.problems.sort_by_key(|p| (p.line.is_none(), p.line));
    result.first_bad_line = result.problems.iter().find_map(|p| p.line);
    result.verified = result.problems.is_empty();
    if args.json {
        view::write_json(out, &result)?;
    } else {
        for line in &result.passed {
            writeln!(out, "ok      {line}")?;
        }
        for problem in &result.problems {
            writeln!(out, "FAILED  {}", clean(&problem.message))?;
            if let Some(hint) = problem.hint {
                writeln!(out, "hint    {hint}")?;
            }
        }
        if result.unaudited_items > 0 {
            writeln!(
                out,
                "note    {} item(s) have no audit record yet: written by the reference \
                 design, which kept no log; the bot records them when it next touches them",
                result.unaudited_items
            )?;
        }
        if result.torn_tail_bytes > 0 {
            writeln!(
                out,
                "note    {} bytes of an unfinished last line (a crash remnant) will be set aside \
                 by the next write",
                result.torn_tail_bytes
            )?;
        }
        writeln!(
            out,
            "{}",
            if result.verified {
                "verified"
            } else {
                "NOT VERIFIED"
            }
        )?;
    }
    if result.verified {
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(first) = result.problems.first() {
        // For whoever only sees stderr (a cron mail, a pipeline), after the report.
        out.flush()?;
        let _ = writeln!(
            progress.err,
            "durable-outbox: verification failed: {}",
            clean(&first.message)
        );
    }
    Ok(ExitCode::from(ATTENTION))
}

/// Runs the phases in order; the first one that fails ends the run with its problem.
fn check(
    dir: &Path,
    builder: durable_outbox::OutboxBuilder,
    progress: &mut Progress<'_>,
    result: &mut Verification,
) -> io::Result<()> {
    let size = std::fs::metadata(dir.join("audit.jsonl")).map_or(0, |m| m.len());
    let label = format!(
        "opening the outbox and checking the audit chain ({})",
        human_size(size)
    );
    let outbox = match progress.phase(&label, move || builder.open())? {
        Ok(outbox) => outbox,
        Err(e) => {
            result.problems.push(problem_of(&e));
            return Ok(());
        }
    };
    let report = match progress.phase("re-checking the chain against the recorded head", || {
        outbox.verify_audit()
    })? {
        Ok(report) => report,
        Err(e) => {
            result.problems.push(problem_of(&e));
            return Ok(());
        }
    };
    result.torn_tail_bytes = report.torn_tail_bytes;
    result.passed.push(format!(
        "audit chain: {} records, every hash and link checks out",
        report.records
    ));
    result
        .passed
        .push("the log reaches the head outbox.json recorded".to_owned());
    match snapshot(&outbox) {
        Ok(Some((items, head))) => cross_check(&outbox, &items, &head, progress, result)?,
        Ok(None) => result.problems.push(Problem {
            line: None,
            idempotency_key: None,
            message: format!(
                "the outbox changed during each of {SNAPSHOT_TRIES} attempts to read it \
                 consistently; run verify again"
            ),
            hint: None,
        }),
        Err(e) => result.problems.push(problem_of(&e)),
    }
    Ok(())
}

/// The items and the audit head as of one moment. The library has no call that
/// returns both atomically, and a running bot may commit between two calls, so
/// read the head, the items, and the head again until the two heads agree: no
/// outcome was recorded in between, so the items match the log up to that head.
/// `None` when the bot committed during every try.
fn snapshot(outbox: &Outbox) -> durable_outbox::Result<Option<(Vec<OutboxItem>, Head)>> {
    for _ in 0..SNAPSHOT_TRIES {
        let before = outbox.audit_head()?;
        let items = outbox.list_items()?;
        let after = outbox.audit_head()?;
        if before == after {
            return Ok(Some((items, after)));
        }
    }
    Ok(None)
}

/// The last record seen for one item.
struct Last {
    seq: u64,
    audit_id: String,
    outcome: AuditOutcome,
}

/// Every record up to `head` belongs to a known item with the same body hash and
/// destination; every item's latest outcome is its last record, and agrees with
/// its state.
fn cross_check(
    outbox: &Outbox,
    items: &[OutboxItem],
    head: &Head,
    progress: &mut Progress<'_>,
    result: &mut Verification,
) -> io::Result<()> {
    progress.update(&format!(
        "cross-checking {} records against {} items",
        head.seq,
        items.len()
    ))?;
    let before = result.problems.len();
    let Some(last) = check_records(outbox, items, head, progress, result)? else {
        return Ok(());
    };
    check_items(items, &last, result);
    if result.problems.len() == before {
        result.records = Some(head.seq);
        result.head_seq = Some(head.seq);
        result.head_hash = Some(head.hash.clone());
        result.items = Some(items.len());
        result.passed.push(format!(
            "{} items: every record belongs to one, and each one's latest outcome has its record",
            items.len()
        ));
        result
            .passed
            .push(format!("head seq {}, hash {}", head.seq, head.hash));
    }
    Ok(())
}

/// Reads the log up to `head`, checking each record against its item. Returns the
/// last record of each item, or `None` when the log could not be read.
fn check_records(
    outbox: &Outbox,
    items: &[OutboxItem],
    head: &Head,
    progress: &mut Progress<'_>,
    result: &mut Verification,
) -> io::Result<Option<HashMap<String, Last>>> {
    let by_key: HashMap<&str, &OutboxItem> =
        items.iter().map(|i| (i.idempotency_key(), i)).collect();
    let mut last: HashMap<String, Last> = HashMap::new();
    let records = match AuditLog::records(outbox.dir().join("audit.jsonl")) {
        Ok(records) => records,
        Err(e) => {
            result.problems.push(problem_of(&e));
            return Ok(None);
        }
    };
    for record in records {
        let record = match record {
            Ok(record) => record,
            Err(e) => {
                result.problems.push(problem_of(&e));
                return Ok(None);
            }
        };
        if record.seq > head.seq {
            break; // appended by the bot after the snapshot
        }
        if record.seq % RECORDS_PER_REPORT == 0 {
            progress.update(&format!(
                "cross-checked {} of {} records",
                record.seq, head.seq
            ))?;
        }
        // A verified chain numbers its records 1, 2, 3…: the seq is the line.
        let key = record.idempotency_key.as_str();
        let differs = match by_key.get(key) {
            None => Some(format!(
                "a record for item {key:?}, which the state does not have"
            )),
            Some(item) if item.content_hash() != record.content_hash => {
                Some(format!("the content hash differs from item {key:?}'s"))
            }
            Some(item) if item.destination() != record.destination => {
                Some(format!("the destination differs from item {key:?}'s"))
            }
            Some(_) => None,
        };
        if let Some(message) = differs {
            result.problems.push(Problem {
                line: Some(record.seq),
                idempotency_key: Some(key.to_owned()),
                message: format!("audit.jsonl line {}: {message}", record.seq),
                hint: None,
            });
        }
        last.insert(
            record.idempotency_key,
            Last {
                seq: record.seq,
                audit_id: record.audit_id,
                outcome: record.outcome,
            },
        );
    }
    Ok(Some(last))
}

/// Each item's latest outcome must be its last record, and agree with its state.
fn check_items(items: &[OutboxItem], last: &HashMap<String, Last>, result: &mut Verification) {
    for item in items {
        let key = item.idempotency_key();
        let bad = |line: Option<u64>, message: String| Problem {
            line,
            idempotency_key: Some(key.to_owned()),
            message: match line {
                Some(line) => format!("audit.jsonl line {line}: item {key:?}: {message}"),
                None => format!("item {key:?}: {message}"),
            },
            hint: None,
        };
        let problem = match (item.last_audit_id(), last.get(key)) {
            (None, None) => {
                result.unaudited_items += 1;
                None
            }
            (Some(id), None) => Some(bad(
                None,
                format!("its latest outcome (audit id {id}) has no record in audit.jsonl"),
            )),
            (None, Some(l)) => Some(bad(
                Some(l.seq),
                "has audit records but the state names none as its latest".to_owned(),
            )),
            (Some(id), Some(l)) if l.audit_id != id => Some(bad(
                Some(l.seq),
                format!(
                    "its last record is audit id {}, but the state's latest outcome is audit id {id}",
                    l.audit_id
                ),
            )),
            (Some(_), Some(l)) => state_after(l.outcome)
                .filter(|expected| *expected != item.state())
                .map(|_| {
                    bad(
                        Some(l.seq),
                        format!(
                            "its last record says {} but the item is {}",
                            l.outcome.as_str(),
                            item.state()
                        ),
                    )
                }),
        };
        result.problems.extend(problem);
    }
}

/// A file size for people: `812 bytes`, `4.2 KiB`, `173.1 MiB`.
fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} bytes");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// The state an item is in right after a record with this outcome.
fn state_after(outcome: AuditOutcome) -> Option<ItemState> {
    match outcome {
        AuditOutcome::Sent => Some(ItemState::Sent),
        AuditOutcome::Failed | AuditOutcome::Cancelled => Some(ItemState::Failed),
        AuditOutcome::Queued
        | AuditOutcome::Deferred
        | AuditOutcome::Retrying
        | AuditOutcome::Requeued => Some(ItemState::Queued),
        // An outcome this tool does not know yet: nothing to compare.
        _ => None,
    }
}

/// A library error as a verification problem, with its line when it names one.
fn problem_of(error: &Error) -> Problem {
    let mut message = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    let first_line_forged = matches!(
        error,
        Error::AuditBroken {
            line: 1,
            fault: AuditFault::HashMismatch,
            ..
        }
    );
    Problem {
        line: match error {
            Error::AuditBroken { line, .. } => Some(*line),
            _ => None,
        },
        idempotency_key: None,
        message,
        hint: first_line_forged.then_some(
            "a keyed (HMAC) log checked without its key, or with another key, fails at line 1: \
             pass the bot's key with --audit-key-file",
        ),
    }
}

/// How progress is shown on stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shown {
    /// Not at all (stderr is a file or pipe, and --progress was not given).
    Off,
    /// A line per step, and a line per [`LINE_TICK`] of a long step (--progress
    /// into a file or pipe).
    Lines,
    /// One line per step, rewritten in place every [`TICK`] (stderr is a terminal).
    Terminal,
}

/// Progress on stderr, for a person watching a long verification.
struct Progress<'w> {
    err: &'w mut dyn Write,
    shown: Shown,
    /// A terminal line was written without its newline (it is being rewritten).
    open_line: bool,
}

impl<'w> Progress<'w> {
    fn new(err: &'w mut dyn Write, forced: bool) -> Self {
        let shown = if io::stderr().is_terminal() {
            Shown::Terminal
        } else if forced {
            Shown::Lines
        } else {
            Shown::Off
        };
        Self {
            err,
            shown,
            open_line: false,
        }
    }

    /// Starts a step, or moves a step along: rewritten in place on a terminal.
    fn update(&mut self, what: &str) -> io::Result<()> {
        match self.shown {
            Shown::Off => Ok(()),
            Shown::Lines => writeln!(self.err, "verify: {what}"),
            Shown::Terminal => {
                self.open_line = true;
                write!(self.err, "\r\x1b[Kverify: {what}")?;
                self.err.flush()
            }
        }
    }

    /// Ends the line a terminal update left open, before anything else is printed.
    fn finish(&mut self) -> io::Result<()> {
        if std::mem::take(&mut self.open_line) {
            writeln!(self.err)?;
        }
        Ok(())
    }

    /// Runs `work` on another thread and reports, while it runs, how long it has
    /// been running, so a long log never looks like a hang.
    fn phase<T: Send>(&mut self, label: &str, work: impl FnOnce() -> T + Send) -> io::Result<T> {
        if self.shown == Shown::Off {
            return Ok(work());
        }
        self.update(label)?;
        let tick = if self.shown == Shown::Terminal {
            TICK
        } else {
            LINE_TICK
        };
        let started = Instant::now();
        std::thread::scope(|scope| {
            let (done, result) = mpsc::channel();
            scope.spawn(move || {
                let _ = done.send(work());
            });
            loop {
                match result.recv_timeout(tick) {
                    Ok(value) => return Ok(value),
                    Err(RecvTimeoutError::Timeout) => {
                        self.update(&format!("{label}: {}s", started.elapsed().as_secs()))?;
                    }
                    // The worker panicked; leaving the scope re-raises its panic.
                    Err(RecvTimeoutError::Disconnected) => {
                        return Err(io::Error::other("verification stopped unexpectedly"));
                    }
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_at_a_glance() {
        assert_eq!(human_size(812), "812 bytes");
        assert_eq!(human_size(4300), "4.2 KiB");
        assert_eq!(human_size(181_525_595), "173.1 MiB");
    }
}
