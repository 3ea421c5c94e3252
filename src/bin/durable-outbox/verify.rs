//! `verify`: the audit chain, its head against the state, and the state against
//! the log, with progress on long logs.

use std::collections::{HashMap, HashSet};
use std::io::{self, IsTerminal, Write};
use std::process::ExitCode;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use durable_outbox::{AuditFault, AuditOutcome, Error, Head, ItemState, Outbox, OutboxItem};
use serde::Serialize;

use crate::args::VerifyArgs;
use crate::history::LogReader;
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
/// How many times the whole check starts again after an operator's removal
/// of old audit records took records the cross-check had not read yet.
const REMOVAL_REREADS: usize = 3;

/// How the records of the chain are named in problems: the lines of
/// `audit.jsonl` (a verified chain numbers its records 1, 2, 3…: the seq is
/// the line), or the rows of a PostgreSQL outbox's `audit` table, by seq.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Records {
    Lines,
    Rows,
}

impl Records {
    fn of(place: crate::Place<'_>) -> Self {
        match place {
            crate::Place::Dir(_) => Self::Lines,
            crate::Place::Postgres(_) => Self::Rows,
        }
    }

    /// The record with this seq, for a message.
    fn record(self, seq: u64) -> String {
        match self {
            Self::Lines => format!("audit.jsonl line {seq}"),
            Self::Rows => format!("audit record seq {seq}"),
        }
    }

    /// The log, for a message.
    fn log(self) -> &'static str {
        match self {
            Self::Lines => "audit.jsonl",
            Self::Rows => "the audit table",
        }
    }

    /// A problem about the record with this seq.
    fn problem(self, seq: u64, key: &str, message: String) -> Problem {
        Problem {
            line: (self == Self::Lines).then_some(seq),
            seq: (self == Self::Rows).then_some(seq),
            idempotency_key: Some(key.to_owned()),
            message,
            hint: None,
        }
    }
}

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
    /// Items whose every record was in the old audit history an operator
    /// removed (`remove_old_audit_segments`): the chain starts after them.
    items_with_removed_records: usize,
    /// A crash remnant after the last whole line, not yet set aside.
    torn_tail_bytes: u64,
    /// The line of the first problem, when a problem has one (a directory).
    first_bad_line: Option<u64>,
    /// The seq of the first problem's record, when a problem has one (PostgreSQL).
    #[serde(skip_serializing_if = "Option::is_none")]
    first_bad_seq: Option<u64>,
    /// Every problem found, those with a line first, in line order.
    problems: Vec<Problem>,
    /// The checks that passed, in order (text output).
    #[serde(skip)]
    passed: Vec<String>,
}

#[derive(Debug, Serialize)]
struct Problem {
    /// 1-based line of `audit.jsonl`, when the problem is one record (a directory).
    line: Option<u64>,
    /// The seq of the record, when the problem is one record (PostgreSQL).
    #[serde(skip_serializing_if = "Option::is_none")]
    seq: Option<u64>,
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
    let outbox = check(
        crate::place(&args.target),
        builder,
        &mut progress,
        &mut result,
    )?;
    if let Some(expected) = &args.expect_head
        && let Some(outbox) = &outbox
        && result.problems.is_empty()
    {
        progress.update(&format!(
            "looking for the expected head, seq {}",
            expected.seq
        ))?;
        check_expected_head(
            outbox,
            expected,
            Records::of(crate::place(&args.target)),
            &mut result,
        );
    }
    progress.finish()?;
    result.problems.sort_by(|a, b| {
        let (a_at, b_at) = (a.line.or(a.seq), b.line.or(b.seq));
        (a_at.is_none(), a_at, &a.idempotency_key).cmp(&(b_at.is_none(), b_at, &b.idempotency_key))
    });
    result.first_bad_line = result.problems.iter().find_map(|p| p.line);
    result.first_bad_seq = result.problems.iter().find_map(|p| p.seq);
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
        if result.items_with_removed_records > 0 {
            writeln!(
                out,
                "note    {} item(s) have no record in the chain: their records were in the old \
                 audit history an operator removed",
                result.items_with_removed_records
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

/// Runs the phases in order; the first one that fails ends the run with its
/// problem. A cross-check that found records gone which an operator's
/// removal of old audit records took while it read (see [`removed_meanwhile`])
/// starts the checks again on the chain as it is now, up to
/// [`REMOVAL_REREADS`] times.
fn check(
    place: crate::Place<'_>,
    builder: durable_outbox::OutboxBuilder,
    progress: &mut Progress<'_>,
    result: &mut Verification,
) -> Result<Option<Outbox>, Box<dyn std::error::Error>> {
    let label = match place {
        crate::Place::Dir(dir) => {
            let size = std::fs::metadata(dir.join("audit.jsonl")).map_or(0, |m| m.len());
            format!("opening the outbox (audit.jsonl is {})", human_size(size))
        }
        crate::Place::Postgres(_) => "opening the outbox".to_owned(),
    };
    let records = Records::of(place);
    let outbox = match progress.phase(&label, move || builder.open())? {
        Ok(outbox) => outbox,
        // A URL or schema naming no outbox is the argument's fault, as a
        // directory that is not an outbox is: exit 2, not a failed check;
        // so is an outbox at an older schema version, not migrated here.
        Err(e @ (Error::InvalidConfig { .. } | Error::SchemaUpgradeNeeded { .. })) => {
            return Err(Box::new(e));
        }
        Err(e) => {
            result.problems.push(problem_of(&e, records, None));
            return Ok(None);
        }
    };
    for _ in 0..REMOVAL_REREADS {
        *result = Verification::default();
        match check_open(&outbox, place, progress, result)? {
            Checked::Done => return Ok(Some(outbox)),
            Checked::RemovedMeanwhile(e) => {
                tracing::debug!(error = %e, "records went in a removal while they were read");
                progress.update("old audit records were removed meanwhile; reading again")?;
            }
        }
    }
    *result = Verification::default();
    result.problems.push(Problem {
        line: None,
        seq: None,
        idempotency_key: None,
        message: format!(
            "old audit records were removed during each of {REMOVAL_REREADS} attempts to \
             read the log; run verify again"
        ),
        hint: None,
    });
    Ok(Some(outbox))
}

/// How one pass of the checks on an open outbox ended.
enum Checked {
    /// With the result filled in.
    Done,
    /// The cross-check met a hole that a removal which committed while it
    /// read explains: not damage; read again.
    RemovedMeanwhile(Error),
}

/// The chain, its head and the cross-check, once.
fn check_open(
    outbox: &Outbox,
    place: crate::Place<'_>,
    progress: &mut Progress<'_>,
    result: &mut Verification,
) -> io::Result<Checked> {
    let records = Records::of(place);
    let report = match progress.phase(
        "checking every record of the audit chain and the recorded head",
        || outbox.verify_audit(),
    )? {
        Ok(report) => report,
        Err(e) => {
            let first = first_seq(outbox);
            result.problems.push(problem_of(&e, records, first));
            return Ok(Checked::Done);
        }
    };
    result.torn_tail_bytes = report.torn_tail_bytes;
    result.passed.push(format!(
        "audit chain: {} records, every hash and link checks out",
        report.records
    ));
    // Name only files that exist: a young outbox has a journal and no snapshot.
    let recorded_by = match place {
        crate::Place::Postgres(_) => Some("the audit_head row"),
        crate::Place::Dir(dir) => match (
            dir.join("outbox.json").exists(),
            dir.join("outbox.journal").exists(),
        ) {
            (true, _) => Some("outbox.json"),
            (false, true) => Some("outbox.journal"),
            (false, false) => None,
        },
    };
    result.passed.push(match recorded_by {
        Some(files) => format!("the log reaches the head {files} recorded"),
        None => "the log is the whole record: there is no state file recording a head".to_owned(),
    });
    if let Err(e) = cross_check(outbox, records, progress, result) {
        match e {
            Failure::Io(e) => return Err(e),
            Failure::Outbox(e) if removed_meanwhile(outbox, &e) => {
                return Ok(Checked::RemovedMeanwhile(e));
            }
            Failure::Outbox(e) => {
                let first = first_seq(outbox);
                result.problems.push(problem_of(&e, records, first));
            }
        }
    }
    Ok(Checked::Done)
}

/// Whether `error`, met while reading the chain record by record, is a hole
/// that an operator's removal of old audit records explains: the reader
/// missed seq *n*, and the chain now starts after *n* (the removal committed
/// between two of the reader's pages or files, and took records it had not
/// reached). A hole the chain's start does not explain (records deleted from
/// the middle) is damage and reported.
fn removed_meanwhile(outbox: &Outbox, error: &Error) -> bool {
    let Error::AuditBroken {
        fault: AuditFault::SeqGap { expected, .. },
        ..
    } = error
    else {
        return false;
    };
    first_seq(outbox).is_some_and(|first| first > *expected)
}

/// The seq of the chain's first record now (`None` when it cannot be read).
fn first_seq(outbox: &Outbox) -> Option<u64> {
    match outbox.audit_records().ok()?.next()? {
        Ok(record) => Some(record.seq),
        Err(_) => None,
    }
}

/// `--expect-head`: the (verified) log still holds the record an operator
/// copied off the host earlier, with the same hash, or, after a removal of
/// old records, starts right after it, linked to that hash (the anchor: the
/// last removed record, which the chain's start proves on both engines).
fn check_expected_head(
    outbox: &Outbox,
    expected: &Head,
    records_are: Records,
    result: &mut Verification,
) {
    let mut last = 0;
    let mut found = None;
    let records = match outbox.audit_records() {
        Ok(records) => records,
        Err(e) => {
            result
                .problems
                .push(problem_of(&e, records_are, first_seq(outbox)));
            return;
        }
    };
    let mut oldest = None;
    // Whether the expected record is the anchor of removed history.
    let mut anchor = false;
    for record in records {
        match record {
            Ok(record) => {
                // After a removal of old records the chain starts right
                // after the last removed one and links to its hash (the
                // chain verified: its start is the one the removal's record
                // names), so the expected head may be exactly that anchor.
                if oldest.is_none() && expected.seq.checked_add(1) == Some(record.seq) {
                    found = Some(record.prev_hash);
                    anchor = true;
                    break;
                }
                oldest.get_or_insert(record.seq);
                last = record.seq;
                if record.seq == expected.seq {
                    found = Some(record.hash);
                    break;
                }
            }
            Err(e) => {
                result
                    .problems
                    .push(problem_of(&e, records_are, first_seq(outbox)));
                return;
            }
        }
    }
    let message = match found {
        Some(hash) if hash == expected.hash => {
            result.passed.push(if anchor {
                format!(
                    "the log holds the expected head, seq {} with its hash, as the anchor \
                     its oldest record links to (the records up to it were removed)",
                    expected.seq
                )
            } else {
                format!(
                    "the log holds the expected head, seq {} with its hash",
                    expected.seq
                )
            });
            return;
        }
        Some(hash) => format!(
            "audit record seq {} has hash {hash}, not the expected {}: the log was rewritten",
            expected.seq, expected.hash
        ),
        None if oldest.is_some_and(|first| first > expected.seq) => format!(
            "audit record seq {} is no longer in the log (old segments were removed): \
             record a newer head to check against",
            expected.seq
        ),
        None => format!(
            "the log ends at seq {last}, before the expected head seq {}: \
             its tail was cut, or the outbox was restored from an earlier copy",
            expected.seq
        ),
    };
    result.problems.push(Problem {
        line: None,
        seq: None,
        idempotency_key: None,
        message,
        hint: None,
    });
}

/// Why the cross-check stopped early: the output failed, or the outbox could
/// not be read (which is a verification problem, not a crash of the tool).
enum Failure {
    Io(io::Error),
    Outbox(Error),
}

impl From<io::Error> for Failure {
    fn from(e: io::Error) -> Self {
        Self::Io(e)
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Self::Outbox(e)
    }
}

/// What the log says about one item.
struct Logged {
    /// The line (= seq) of its first record.
    first_seq: u64,
    content_hash: String,
    destination: String,
    last_seq: u64,
    last_audit_id: String,
    /// The outcome of its last record that says its state (every outcome
    /// but `late_delivery`).
    last_outcome: AuditOutcome,
}

/// Every record belongs to an item (live or in history) with the same body hash
/// and destination, and every item's latest outcome is its last record and
/// agrees with its state.
///
/// The library has no call that returns the items and the audit head at one
/// moment, and a running bot may commit between two calls. So the log is read
/// up to the head once (the long part), then, until two looks at the head agree,
/// read on to the head, take the items, and look again: no outcome was recorded
/// in between, so the items match the log up to that head.
fn cross_check(
    outbox: &Outbox,
    records: Records,
    progress: &mut Progress<'_>,
    result: &mut Verification,
) -> Result<(), Failure> {
    let mut reader = LogReader::open(outbox)?;
    let mut logged: HashMap<String, Logged> = HashMap::new();
    let head = outbox.audit_head()?;
    progress.update(&format!(
        "cross-checking {} records against the items",
        head.seq
    ))?;
    read_log(&mut reader, &head, records, &mut logged, progress, result)?;
    for _ in 0..SNAPSHOT_TRIES {
        let before = outbox.audit_head()?;
        read_log(&mut reader, &before, records, &mut logged, progress, result)?;
        let live = outbox.list_items()?;
        let live_keys: HashSet<&str> = live.iter().map(OutboxItem::idempotency_key).collect();
        let mut moved = Vec::new();
        for key in logged.keys().filter(|k| !live_keys.contains(k.as_str())) {
            moved.extend(outbox.get(key)?);
        }
        if outbox.audit_head()? != before {
            continue;
        }
        let before_items = result.problems.len();
        let items: HashMap<&str, &OutboxItem> = live
            .iter()
            .chain(&moved)
            .map(|i| (i.idempotency_key(), i))
            .collect();
        check_logged(&logged, &items, records, result);
        check_unlogged(&live, &logged, reader.first_seq > 1, records, result);
        let history = outbox.history_len()?;
        if result.problems.len() == before_items {
            result.records = Some(before.seq);
            result.head_seq = Some(before.seq);
            result.head_hash = Some(before.hash.clone());
            result.items = Some(live.len() + moved.len());
            let where_ = if history > 0 {
                format!(
                    " ({} live, {} of {history} in history)",
                    live.len(),
                    moved.len()
                )
            } else {
                String::new()
            };
            result.passed.push(format!(
                "{} items{where_}: every record belongs to one, and each one's latest \
                 outcome has its record",
                live.len() + moved.len()
            ));
            result
                .passed
                .push(format!("head seq {}, hash {}", before.seq, before.hash));
        }
        return Ok(());
    }
    result.problems.push(Problem {
        line: None,
        seq: None,
        idempotency_key: None,
        message: format!(
            "the outbox changed during each of {SNAPSHOT_TRIES} attempts to read it \
             consistently; run verify again"
        ),
        hint: None,
    });
    Ok(())
}

/// Reads the log on to `head`, remembering what each item's records say and
/// flagging a record that disagrees with the item's earlier ones.
fn read_log(
    reader: &mut LogReader,
    head: &Head,
    records: Records,
    logged: &mut HashMap<String, Logged>,
    progress: &mut Progress<'_>,
    result: &mut Verification,
) -> Result<(), Failure> {
    let mut report = Ok(());
    reader.read_to(head, |record| {
        if record.seq % RECORDS_PER_REPORT == 0 && report.is_ok() {
            report = progress.update(&format!(
                "cross-checked {} of {} records",
                record.seq, head.seq
            ));
        }
        // A change of the stored settings, a prune of history or of old
        // audit records: about the outbox, not an item.
        if matches!(
            record.outcome,
            AuditOutcome::Settings | AuditOutcome::Pruned
        ) {
            return;
        }
        // A verified chain numbers its records 1, 2, 3…: the seq is the line.
        let seq = record.seq;
        let key = record.idempotency_key;
        match logged.get_mut(&key) {
            None => {
                logged.insert(
                    key,
                    Logged {
                        first_seq: seq,
                        content_hash: record.content_hash,
                        destination: record.destination,
                        last_seq: seq,
                        last_audit_id: record.audit_id,
                        last_outcome: record.outcome,
                    },
                );
            }
            Some(known) => {
                let differs = if known.content_hash != record.content_hash {
                    Some("content hash")
                } else if known.destination != record.destination {
                    Some("destination")
                } else {
                    None
                };
                if let Some(field) = differs {
                    result.problems.push(records.problem(
                        seq,
                        &key,
                        format!(
                            "{}: item {key:?}: the {field} differs from its record at {}",
                            records.record(seq),
                            records.record(known.first_seq)
                        ),
                    ));
                }
                known.last_seq = seq;
                known.last_audit_id = record.audit_id;
                // A late delivery reports a send, not a state: the item is as
                // its earlier record left it, and is compared with that one.
                if record.outcome != AuditOutcome::LateDelivery {
                    known.last_outcome = record.outcome;
                }
            }
        }
    })?;
    Ok(report?)
}

/// Checks each item the log names against the item itself.
fn check_logged(
    logged: &HashMap<String, Logged>,
    items: &HashMap<&str, &OutboxItem>,
    records: Records,
    result: &mut Verification,
) {
    for (key, log) in logged {
        let bad = |seq: u64, message: String| {
            records.problem(
                seq,
                key,
                format!("{}: item {key:?}: {message}", records.record(seq)),
            )
        };
        let Some(item) = items.get(key.as_str()) else {
            result.problems.push(bad(
                log.first_seq,
                "has records, but the outbox has no such item, live or in history".to_owned(),
            ));
            continue;
        };
        if item.content_hash() != log.content_hash {
            result.problems.push(bad(
                log.first_seq,
                "the record's content hash differs from the item's".to_owned(),
            ));
        } else if item.destination() != log.destination {
            result.problems.push(bad(
                log.first_seq,
                "the record's destination differs from the item's".to_owned(),
            ));
        }
        match item.last_audit_id() {
            None => result.problems.push(bad(
                log.last_seq,
                "has audit records but the item names none as its latest".to_owned(),
            )),
            Some(id) if id != log.last_audit_id => result.problems.push(bad(
                log.last_seq,
                format!(
                    "its last record is audit id {}, but the item's latest outcome is audit id {id}",
                    log.last_audit_id
                ),
            )),
            Some(_) => {
                if let Some(expected) = state_after(log.last_outcome)
                    && expected != item.state()
                {
                    result.problems.push(bad(
                        log.last_seq,
                        format!(
                            "its last record says {} but the item is {}",
                            log.last_outcome.as_str(),
                            item.state()
                        ),
                    ));
                }
            }
        }
    }
}

/// Live items the log never mentions: fine for the reference design's items
/// (it kept no log), a problem for an item that names its latest record.
fn check_unlogged(
    live: &[OutboxItem],
    logged: &HashMap<String, Logged>,
    removed_before: bool,
    records: Records,
    result: &mut Verification,
) {
    for item in live {
        let key = item.idempotency_key();
        if logged.contains_key(key) {
            continue;
        }
        match item.last_audit_id() {
            None => result.unaudited_items += 1,
            // The chain (verified) starts where an operator's removal of old
            // records says: an item with no record since had its records there.
            Some(_) if removed_before => result.items_with_removed_records += 1,
            Some(id) => result.problems.push(Problem {
                line: None,
                seq: None,
                idempotency_key: Some(key.to_owned()),
                message: format!(
                    "item {key:?}: its latest outcome (audit id {id}) has no record in {}",
                    records.log()
                ),
                hint: None,
            }),
        }
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
        // An outcome this tool does not know yet: nothing to compare. A
        // `late_delivery` is not a state (`read_log` keeps the one before it).
        _ => None,
    }
}

/// A library error as a verification problem, with its line when it names
/// one. On PostgreSQL the verifier counts a bad record's position from the
/// table's first row (seq `first`, more than 1 after a removal of old
/// records): the problem names the record's seq instead.
fn problem_of(error: &Error, records: Records, first: Option<u64>) -> Problem {
    let (line, seq, mut message) = match error {
        Error::AuditBroken { line, fault, .. } if records == Records::Rows => {
            // A gap names the seq found; otherwise the rows up to this one
            // followed each other from the first.
            let seq = match fault {
                AuditFault::SeqGap { found, .. } => Some(*found),
                _ => first.map(|first| first + line.saturating_sub(1)),
            };
            let at = seq.map_or_else(
                || format!("row {line} of the audit table"),
                |seq| format!("{} (row {line} of the table)", records.record(seq)),
            );
            (None, seq, format!("{at}: {fault}"))
        }
        Error::AuditBroken { line, .. } => (Some(*line), None, error.to_string()),
        _ => (None, None, error.to_string()),
    };
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
        line,
        seq,
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
