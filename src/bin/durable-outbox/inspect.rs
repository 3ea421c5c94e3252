//! The read commands: `list`, `show`, `find` and `export`.

use std::borrow::Cow;
use std::io::Write;
use std::process::ExitCode;

use chrono::{DateTime, Utc};
use durable_outbox::{AuditRecord, ItemState, Outbox, OutboxItem};
use serde::Serialize;

use crate::args::{ExportArgs, ExportFormat, FindArgs, ListArgs, ShowArgs, StateFilter};
use crate::history;
use crate::view::{self, ItemView, Table, clean, detail, or_dash, short, state_label};
use crate::{CliResult, NotFound};

pub fn list(args: &ListArgs, out: &mut dyn Write) -> CliResult {
    let outbox = crate::open(&args.target)?;
    let now = Utc::now();
    let since = args.since.map(|s| s.resolve(now));
    let mut all = outbox.list_items()?;
    let in_history = outbox.history_len()?;
    if args.history {
        let moved = history::items(&outbox, &all)?;
        all.extend(moved);
    }
    let mut items: Vec<OutboxItem> = all
        .into_iter()
        .filter(|item| args.state.is_none_or(|s| state_matches(s, item)))
        .filter(|item| {
            args.destination
                .as_deref()
                .is_none_or(|d| item.destination() == d)
        })
        .filter(|item| since.is_none_or(|t| item.updated_at() >= t))
        .collect();
    // Newest activity first: what an operator asks about is usually recent.
    items.sort_by(|a, b| {
        b.updated_at()
            .cmp(&a.updated_at())
            .then_with(|| a.idempotency_key().cmp(b.idempotency_key()))
    });
    let matching = items.len();
    if let Some(limit) = args.limit {
        items.truncate(limit);
    }
    if args.json {
        let views: Vec<ItemView<'_>> = items
            .iter()
            .map(|i| ItemView::new(i, args.show_content))
            .collect();
        view::write_json(out, &views)?;
        return Ok(ExitCode::SUCCESS);
    }
    let history_note = |out: &mut dyn Write| {
        if in_history > 0 && !args.history {
            writeln!(
                out,
                "({in_history} older items are in history: add --history to list them too)"
            )
        } else {
            Ok(())
        }
    };
    if items.is_empty() {
        writeln!(out, "no matching items")?;
        history_note(out)?;
        return Ok(ExitCode::SUCCESS);
    }
    let mut header = vec![
        "UPDATED",
        "KEY",
        "STATE",
        "DESTINATION",
        "CONNECTOR",
        "ATTEMPTS",
        "DETAIL",
    ];
    if args.show_content {
        header.push("CONTENT");
    }
    let mut table = Table::new(header);
    for item in &items {
        let mut row = vec![
            short(item.updated_at()),
            item.idempotency_key().to_owned(),
            state_label(item).to_owned(),
            item.destination().to_owned(),
            item.connector().to_owned(),
            item.attempts().to_string(),
            detail(item, now),
        ];
        if args.show_content {
            row.push(item.content().to_owned());
        }
        table.row(row);
    }
    table.write(out, "")?;
    if items.len() < matching {
        writeln!(out, "({} of {matching} matching items shown)", items.len())?;
    }
    history_note(out)?;
    Ok(ExitCode::SUCCESS)
}

fn state_matches(filter: StateFilter, item: &OutboxItem) -> bool {
    match filter {
        StateFilter::Queued => item.state() == ItemState::Queued,
        StateFilter::InFlight => item.state() == ItemState::Queued && item.dispatch_claimed(),
        StateFilter::Sent => item.state() == ItemState::Sent,
        StateFilter::Failed => item.state() == ItemState::Failed,
    }
}

pub fn show(args: &ShowArgs, out: &mut dyn Write) -> CliResult {
    let outbox = crate::open(&args.target)?;
    let item = outbox
        .get(&args.key)?
        .ok_or_else(|| NotFound(format!("no outbox item has idempotency key {:?}", args.key)))?;
    describe(&outbox, &item, args.show_content, args.json, out)
}

pub fn find(args: &FindArgs, out: &mut dyn Write) -> CliResult {
    let outbox = crate::open(&args.target)?;
    let reference = args
        .transport_ref
        .as_deref()
        .or(args.transport_ref_flag.as_deref())
        .unwrap_or_default();
    let found = match &args.destination {
        Some(destination) => outbox.find_by_transport_ref_in(destination, reference)?,
        None => outbox.find_by_transport_ref(reference)?,
    };
    let item = found.ok_or_else(|| {
        let scope = args
            .destination
            .as_deref()
            .map(|d| format!(" in destination {d:?}"))
            .unwrap_or_default();
        NotFound(format!(
            "no outbox item has transport ref {reference:?}{scope}"
        ))
    })?;
    describe(&outbox, &item, args.show_content, args.json, out)
}

/// The stored failure class as a person reads it.
fn failure_class_text(item: &OutboxItem) -> String {
    match item.failure_class() {
        Some(class) if class.may_have_been_delivered() => {
            format!("{class} (may have been delivered)")
        }
        Some(class) => class.to_string(),
        None if crate::may_have_been_delivered(item, &crate::AMBIGUOUS_CODES) => {
            "- (may have been delivered, by its error code)".to_owned()
        }
        None => "-".to_owned(),
    }
}

/// `show --json` and `find --json`.
#[derive(Serialize)]
struct Described<'a> {
    item: ItemView<'a>,
    history: &'a [AuditRecord],
}

/// Prints one item and its audit history.
fn describe(
    outbox: &Outbox,
    item: &OutboxItem,
    show_content: bool,
    json: bool,
    out: &mut dyn Write,
) -> CliResult {
    let history = outbox.history(item.idempotency_key())?;
    if json {
        view::write_json(
            out,
            &Described {
                item: ItemView::new(item, show_content),
                history: &history,
            },
        )?;
        return Ok(ExitCode::SUCCESS);
    }
    let when = |at: Option<DateTime<Utc>>| at.map_or_else(|| "-".to_owned(), short);
    let fields = [
        ("key", clean(item.idempotency_key())),
        ("state", state_label(item).to_owned()),
        ("destination", clean(item.destination())),
        ("connector", clean(item.connector())),
        ("grant", clean(item.grant_id())),
        ("attempts", item.attempts().to_string()),
        ("created", short(item.created_at())),
        ("updated", short(item.updated_at())),
        ("next attempt", when(item.next_attempt_at())),
        ("sent", when(item.sent_at())),
        ("cooldown until", when(item.cooldown_until())),
        ("error code", or_dash(item.error_code())),
        ("failure class", failure_class_text(item)),
        ("transport ref", or_dash(item.transport_ref())),
        ("lane", clean(item.lane())),
        ("direction", clean(item.direction())),
        ("risk class", or_dash(item.risk_class())),
        (
            "content",
            format!(
                "{} bytes, sha256 {}",
                item.content().len(),
                item.content_hash()
            ),
        ),
        ("last audit id", or_dash(item.last_audit_id())),
    ];
    for (name, value) in fields {
        writeln!(out, "{name:<14} {value}")?;
    }
    if show_content {
        writeln!(out, "\n{}", clean(item.content()))?;
    }
    writeln!(out, "\naudit history ({} records)", history.len())?;
    if history.is_empty() {
        writeln!(
            out,
            "  none: the item predates the audit log (written by the reference design)"
        )?;
        return Ok(ExitCode::SUCCESS);
    }
    let mut table = Table::new(vec![
        "SEQ", "RECORDED", "OUTCOME", "ATTEMPTS", "ERROR", "REF", "NOTE",
    ]);
    for record in &history {
        let mut outcome = record.outcome.as_str().to_owned();
        if record.reconciled {
            outcome.push_str(" (late)");
        }
        table.row(vec![
            record.seq.to_string(),
            record_time(&record.recorded_at_utc),
            outcome,
            record.attempts.to_string(),
            or_dash(record.error_code.as_deref()),
            or_dash(record.transport_ref.as_deref()),
            or_dash(record.note.as_deref()),
        ]);
    }
    table.write(out, "  ")?;
    Ok(ExitCode::SUCCESS)
}

/// A record's time in the tables' whole-second form (kept as stored if it does not parse).
fn record_time(stored: &str) -> String {
    DateTime::parse_from_rfc3339(stored)
        .map_or_else(|_| stored.to_owned(), |t| short(t.with_timezone(&Utc)))
}

pub fn export(args: &ExportArgs, out: &mut dyn Write) -> CliResult {
    // Exports what is there; checking it is `verify`'s job (opening checks only
    // what was appended since the last snapshot).
    let outbox = crate::open(&args.target)?;
    if args.audit {
        export_audit(&outbox, args.format, out)?;
    } else {
        let mut items = outbox.list_items()?;
        let moved = history::items(&outbox, &items)?;
        items.extend(moved);
        items.sort_by(|a, b| a.idempotency_key().cmp(b.idempotency_key()));
        let views = items.iter().map(|i| ItemView::new(i, args.show_content));
        match args.format {
            ExportFormat::Jsonl => {
                for item in views {
                    serde_json::to_writer(&mut *out, &item)?;
                    out.write_all(b"\n")?;
                }
            }
            ExportFormat::Csv => {
                let mut header = ITEM_COLUMNS.to_vec();
                if args.show_content {
                    header.push("content");
                }
                csv_row(out, header.iter().map(|h| Cow::Borrowed(*h)))?;
                for item in views {
                    csv_row(out, item_cells(&item))?;
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

const ITEM_COLUMNS: [&str; 20] = [
    "idempotency_key",
    "state",
    "dispatch_claimed",
    "connector",
    "grant_id",
    "destination",
    "attempts",
    "created_at_utc",
    "updated_at_utc",
    "next_attempt_at_utc",
    "sent_at_utc",
    "cooldown_until_utc",
    "error_code",
    "transport_ref",
    "lane",
    "direction",
    "risk_class",
    "content_hash",
    "content_bytes",
    "last_audit_id",
];

/// The cells of [`ITEM_COLUMNS`] (and `content` when present), in order.
fn item_cells<'a>(item: &'a ItemView<'a>) -> impl Iterator<Item = Cow<'a, str>> {
    let opt = |v: Option<&'a str>| Cow::Borrowed(v.unwrap_or(""));
    let owned_opt = |v: &'a Option<String>| Cow::Borrowed(v.as_deref().unwrap_or(""));
    [
        Cow::Borrowed(item.idempotency_key),
        Cow::Borrowed(item.state),
        Cow::Borrowed(if item.dispatch_claimed {
            "true"
        } else {
            "false"
        }),
        Cow::Borrowed(item.connector),
        Cow::Borrowed(item.grant_id),
        Cow::Borrowed(item.destination),
        Cow::Owned(item.attempts.to_string()),
        Cow::Borrowed(item.created_at_utc.as_str()),
        Cow::Borrowed(item.updated_at_utc.as_str()),
        owned_opt(&item.next_attempt_at_utc),
        owned_opt(&item.sent_at_utc),
        owned_opt(&item.cooldown_until_utc),
        opt(item.error_code),
        opt(item.transport_ref),
        Cow::Borrowed(item.lane),
        Cow::Borrowed(item.direction),
        opt(item.risk_class),
        Cow::Borrowed(item.content_hash),
        Cow::Owned(item.content_bytes.to_string()),
        opt(item.last_audit_id),
    ]
    .into_iter()
    .chain(item.content.map(Cow::Borrowed))
}

const AUDIT_COLUMNS: [&str; 19] = [
    "seq",
    "recorded_at_utc",
    "outcome",
    "idempotency_key",
    "destination",
    "connector",
    "grant_id",
    "attempts",
    "error_code",
    "transport_ref",
    "note",
    "reconciled",
    "lane",
    "direction",
    "risk_class",
    "content_hash",
    "audit_id",
    "prev_hash",
    "hash",
];

/// Streams the audit log record by record, so a long log is never held in memory.
fn export_audit(
    outbox: &Outbox,
    format: ExportFormat,
    out: &mut dyn Write,
) -> Result<(), Box<dyn std::error::Error>> {
    let records = outbox.audit_records()?;
    if format == ExportFormat::Csv {
        csv_row(out, AUDIT_COLUMNS.iter().map(|h| Cow::Borrowed(*h)))?;
    }
    for record in records {
        let r = record?;
        match format {
            ExportFormat::Jsonl => {
                serde_json::to_writer(&mut *out, &r)?;
                out.write_all(b"\n")?;
            }
            ExportFormat::Csv => {
                let opt = |v: &Option<String>| v.clone().unwrap_or_default();
                csv_row(
                    out,
                    [
                        r.seq.to_string(),
                        r.recorded_at_utc.clone(),
                        r.outcome.as_str().to_owned(),
                        r.idempotency_key.clone(),
                        r.destination.clone(),
                        r.connector.clone(),
                        r.grant_id.clone(),
                        r.attempts.to_string(),
                        opt(&r.error_code),
                        opt(&r.transport_ref),
                        opt(&r.note),
                        r.reconciled.to_string(),
                        r.lane.clone(),
                        r.direction.clone(),
                        opt(&r.risk_class),
                        r.content_hash.clone(),
                        r.audit_id.clone(),
                        r.prev_hash.clone(),
                        r.hash.clone(),
                    ]
                    .into_iter()
                    .map(Cow::Owned),
                )?;
            }
        }
    }
    Ok(())
}

/// Writes one CSV row (RFC 4180): a field with a comma, quote, CR or LF is quoted,
/// quotes doubled. Values are written exactly as stored.
fn csv_row<'a>(
    out: &mut dyn Write,
    cells: impl Iterator<Item = Cow<'a, str>>,
) -> std::io::Result<()> {
    let mut line = String::new();
    for (i, cell) in cells.enumerate() {
        if i > 0 {
            line.push(',');
        }
        if cell.contains([',', '"', '\r', '\n']) {
            line.push('"');
            line.push_str(&cell.replace('"', "\"\""));
            line.push('"');
        } else {
            line.push_str(&cell);
        }
    }
    line.push_str("\r\n");
    out.write_all(line.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(cells: &[&str]) -> String {
        let mut out = Vec::new();
        csv_row(&mut out, cells.iter().map(|c| Cow::Borrowed(*c))).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn csv_quotes_only_what_needs_it() {
        assert_eq!(row(&["a", "-100123", ""]), "a,-100123,\r\n");
        assert_eq!(
            row(&["x,y", "say \"hi\"", "two\nlines"]),
            "\"x,y\",\"say \"\"hi\"\"\",\"two\nlines\"\r\n"
        );
    }

    #[test]
    fn item_cells_match_the_header() {
        let dir = tempfile::tempdir().unwrap();
        let outbox = Outbox::open(dir.path()).unwrap();
        let item = outbox
            .enqueue(durable_outbox::NewMessage {
                idempotency_key: "k".into(),
                connector: "c".into(),
                grant_id: "g".into(),
                destination: "d".into(),
                content: "body".into(),
                ..Default::default()
            })
            .unwrap();
        let plain = ItemView::new(&item, false);
        assert_eq!(item_cells(&plain).count(), ITEM_COLUMNS.len());
        let with_body = ItemView::new(&item, true);
        assert_eq!(item_cells(&with_body).count(), ITEM_COLUMNS.len() + 1);
    }
}
