//! `status`: what is stuck, what failed and why, and whether the audit log holds.

use std::collections::BTreeMap;
use std::io::Write;
use std::process::ExitCode;

use chrono::{DateTime, Utc};
use durable_outbox::{
    AuditReport, DestinationWindow, Error, ItemState, OutboxItem, RateLimit, Settings,
};
use serde::Serialize;

use crate::args::StatusArgs;
use crate::view::{self, Table, age, clean, short};
use crate::{ATTENTION, CliResult};

/// The whole report; its JSON form is `status --json`.
#[derive(Debug, Serialize)]
struct Status {
    dir: String,
    now_utc: String,
    healthy: bool,
    /// One sentence per thing an operator should look at; empty when healthy.
    attention: Vec<String>,
    /// `None` when the outbox could not be opened because its audit log is broken.
    items: Option<Counts>,
    /// Sent and failed items the library moved out of the live state (after its
    /// `history_after`, a day by default); not counted in `items`.
    history_items: Option<usize>,
    oldest_queued: Option<Oldest>,
    failed_by_error_code: Vec<FailedCode>,
    rate_window: Option<RateWindow>,
    settings: Option<SettingsView>,
    audit: Audit,
    /// Files recovery set aside: bytes a crash or power cut left past a file's
    /// last durable point (`outbox.journal.torn-*`, `audit.jsonl.torn-*`).
    /// Nothing acknowledged is in them; kept for inspection.
    set_aside: Vec<String>,
}

#[derive(Debug, Default, Serialize)]
struct Counts {
    total: usize,
    queued: usize,
    /// Queued items claimed by a worker (included in `queued`).
    in_flight: usize,
    /// Queued, unclaimed and due now (included in `queued`).
    due: usize,
    /// Queued and held back until `next_attempt_at` (included in `queued`).
    waiting: usize,
    sent: usize,
    failed: usize,
}

#[derive(Debug, Serialize)]
struct Oldest {
    idempotency_key: String,
    created_at_utc: String,
    age_seconds: i64,
}

#[derive(Debug, Serialize)]
struct FailedCode {
    error_code: String,
    items: usize,
    /// Some of these failures may have been deliveries: only an operator can
    /// decide to resend them.
    ambiguous: bool,
    /// How many of `items` may have been delivered (their stored failure class
    /// is `ambiguous`, or, for items from before the class was stored, the code
    /// is a known ambiguous one).
    ambiguous_items: usize,
}

/// The caps, as the outbox stores them (or as `--rate-limit` asks), and each
/// destination's window measured the way the library counts it.
#[derive(Debug, Serialize)]
struct RateWindow {
    /// The per-destination cap for destinations no pattern matches (or the what-if cap).
    cap: u32,
    window_seconds: f64,
    /// `stored` (the outbox's own settings), `default` (an outbox from an older
    /// release that stores no cap: the library's default), or `what_if`.
    source: &'static str,
    /// Caps by destination pattern, first match wins (not applied in a what-if view).
    overrides: Vec<PatternCap>,
    /// The cap across all destinations, if any.
    global: Option<Cap>,
    destinations: Vec<DestinationRow>,
}

#[derive(Debug, Serialize)]
struct Cap {
    count: u32,
    window_seconds: f64,
}

#[derive(Debug, Serialize)]
struct PatternCap {
    pattern: String,
    count: u32,
    window_seconds: f64,
}

/// The other stored settings an operator asks about.
#[derive(Debug, Serialize)]
struct SettingsView {
    history_after_seconds: f64,
    max_attempts: u32,
    /// The settings the outbox stores; the rest are the library's defaults.
    stored: Vec<&'static str>,
}

#[derive(Debug, Serialize)]
struct DestinationRow {
    destination: String,
    /// Sends in the current window: sends, sends in progress, and sends that may
    /// have left (ambiguous failures), as the library counts them.
    sends_in_window: usize,
    cap: u32,
    window_seconds: f64,
    queued: usize,
    /// When the window has room again, if it is full now.
    next_free_slot_utc: Option<String>,
    /// Until when the platform asked not to send here (`retry_after`), if that is
    /// still in the future.
    cooldown_until_utc: Option<String>,
}

#[derive(Debug, Serialize)]
struct Audit {
    head_seq: Option<u64>,
    head_hash: Option<String>,
    verified: bool,
    records: Option<u64>,
    /// Why the chain did not verify.
    error: Option<String>,
}

pub fn run(args: &StatusArgs, out: &mut dyn Write) -> CliResult {
    let now = Utc::now();
    let ambiguous: Vec<&str> = crate::AMBIGUOUS_CODES
        .into_iter()
        .chain(args.ambiguous_codes.iter().map(String::as_str))
        .collect();
    let mut status = Status {
        dir: crate::target_label(&args.target),
        now_utc: short(now),
        healthy: true,
        attention: Vec::new(),
        items: None,
        history_items: None,
        oldest_queued: None,
        failed_by_error_code: Vec::new(),
        rate_window: None,
        settings: None,
        audit: Audit {
            head_seq: None,
            head_hash: None,
            verified: false,
            records: None,
            error: None,
        },
        set_aside: Vec::new(),
    };
    match crate::open(&args.target) {
        Ok(outbox) => {
            let items = outbox.list_items()?;
            summarise(&mut status, &items, now, &ambiguous);
            let settings = outbox.settings()?;
            let what_if = args.rate_limit.map(|cap| RateLimit {
                count: cap.count,
                window: cap.window,
            });
            let windows = outbox.rate_windows(what_if)?;
            status.rate_window = Some(rate_window(&settings, what_if, &windows));
            status.settings = Some(SettingsView {
                history_after_seconds: settings.history_after().as_secs_f64(),
                max_attempts: settings.max_attempts(),
                stored: STORED_NAMES
                    .into_iter()
                    .filter(|name| settings.is_stored(name))
                    .collect(),
            });
            status.history_items = Some(outbox.history_len()?);
            let head = outbox.audit_head()?;
            status.audit.head_seq = Some(head.seq);
            status.audit.head_hash = Some(head.hash);
            record_verification(&mut status, outbox.verify_audit())?;
        }
        // A broken chain stops the library from opening the outbox at all: report
        // it as the finding it is rather than as a failure of this command.
        Err(e) if matches!(e.downcast_ref::<Error>(), Some(Error::AuditBroken { .. })) => {
            status.audit.error = Some(e.to_string());
            status.attention.push(format!(
                "the audit chain does not verify ({e}); run `durable-outbox verify` and \
                 keep a copy of the directory before anything else touches it"
            ));
        }
        Err(e) => return Err(e),
    }
    if let crate::Place::Dir(dir) = crate::place(&args.target) {
        status.set_aside = set_aside_files(dir)?;
    }
    status.healthy = status.attention.is_empty();
    if args.json {
        view::write_json(out, &status)?;
    } else {
        write_text(&status, out)?;
    }
    Ok(if status.healthy {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(ATTENTION)
    })
}

/// The names of the files recovery set aside in `dir`, sorted.
fn set_aside_files(dir: &std::path::Path) -> std::io::Result<Vec<String>> {
    let mut names = Vec::new();
    if dir.is_dir() {
        for entry in std::fs::read_dir(dir)? {
            let name = entry?.file_name().to_string_lossy().into_owned();
            if name.contains(".torn-") {
                names.push(name);
            }
        }
    }
    names.sort();
    Ok(names)
}

fn record_verification(
    status: &mut Status,
    verified: durable_outbox::Result<AuditReport>,
) -> Result<(), Box<dyn std::error::Error>> {
    match verified {
        Ok(report) => {
            status.audit.verified = true;
            status.audit.records = Some(report.records);
        }
        Err(e @ Error::AuditBroken { .. }) => {
            status.audit.error = Some(e.to_string());
            status.attention.push(format!(
                "the audit chain does not verify ({e}); run `durable-outbox verify`"
            ));
        }
        Err(e) => return Err(e.into()),
    }
    Ok(())
}

/// Fills in everything that comes from the items.
fn summarise(status: &mut Status, items: &[OutboxItem], now: DateTime<Utc>, ambiguous: &[&str]) {
    let mut counts = Counts {
        total: items.len(),
        ..Counts::default()
    };
    let mut oldest: Option<&OutboxItem> = None;
    // Per error code: how many failed, and how many of those may have been delivered.
    let mut failed: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    for item in items {
        match item.state() {
            ItemState::Queued => {
                counts.queued += 1;
                if item.dispatch_claimed() {
                    counts.in_flight += 1;
                } else if item.next_attempt_at().is_some_and(|at| at > now) {
                    counts.waiting += 1;
                } else {
                    counts.due += 1;
                }
                if oldest.is_none_or(|o| item.created_at() < o.created_at()) {
                    oldest = Some(item);
                }
            }
            ItemState::Sent => counts.sent += 1,
            ItemState::Failed => {
                counts.failed += 1;
                let tally = failed.entry(item.error_code().unwrap_or("-")).or_default();
                tally.0 += 1;
                if crate::may_have_been_delivered(item, ambiguous) {
                    tally.1 += 1;
                }
            }
        }
    }
    status.oldest_queued = oldest.map(|item| Oldest {
        idempotency_key: item.idempotency_key().to_owned(),
        created_at_utc: short(item.created_at()),
        age_seconds: (now - item.created_at()).num_seconds().max(0),
    });
    status.failed_by_error_code = failed
        .into_iter()
        .map(|(code, (n, in_doubt))| FailedCode {
            error_code: code.to_owned(),
            items: n,
            ambiguous: in_doubt > 0,
            ambiguous_items: in_doubt,
        })
        .collect();
    let in_doubt: usize = status
        .failed_by_error_code
        .iter()
        .map(|f| f.ambiguous_items)
        .sum();
    if in_doubt > 0 {
        status.attention.push(format!(
            "{in_doubt} failed item(s) may have been delivered (ambiguous): check with the \
             recipient, then `requeue` or leave each one (`list --state failed`)"
        ));
    }
    status.items = Some(counts);
}

/// The settings a library outbox may store, by their builder names.
const STORED_NAMES: [&str; 7] = [
    "rate_limit",
    "rate_limit_for",
    "global_rate_limit",
    "history_after",
    "history_retention",
    "max_attempts",
    "backoff",
];

fn rate_window(
    settings: &Settings,
    what_if: Option<RateLimit>,
    windows: &[DestinationWindow],
) -> RateWindow {
    let cap = what_if.unwrap_or_else(|| settings.rate_limit());
    let source = if what_if.is_some() {
        "what_if"
    } else if settings.is_stored("rate_limit") {
        "stored"
    } else {
        "default"
    };
    RateWindow {
        cap: cap.count,
        window_seconds: cap.window.as_secs_f64(),
        source,
        overrides: settings
            .rate_limit_overrides()
            .iter()
            .map(|(pattern, cap)| PatternCap {
                pattern: pattern.clone(),
                count: cap.count,
                window_seconds: cap.window.as_secs_f64(),
            })
            .collect(),
        global: settings.global_rate_limit().map(|cap| Cap {
            count: cap.count,
            window_seconds: cap.window.as_secs_f64(),
        }),
        destinations: windows
            .iter()
            .map(|w| DestinationRow {
                destination: w.destination.clone(),
                sends_in_window: w.sends_in_window,
                cap: w.cap.count,
                window_seconds: w.cap.window.as_secs_f64(),
                queued: w.queued,
                next_free_slot_utc: w.next_free_slot.map(short),
                cooldown_until_utc: w.cooldown_until.map(short),
            })
            .collect(),
    }
}

fn write_text(status: &Status, out: &mut dyn Write) -> std::io::Result<()> {
    writeln!(out, "outbox   {}", clean(&status.dir))?;
    writeln!(out, "now      {}", status.now_utc)?;
    if status.healthy {
        writeln!(out, "health   ok")?;
    } else {
        writeln!(out, "health   NEEDS ATTENTION")?;
        for line in &status.attention {
            writeln!(out, "  - {}", clean(line))?;
        }
    }
    if let Some(c) = &status.items {
        writeln!(
            out,
            "\nitems    {} total: {} queued ({} in flight, {} due now, {} waiting), {} sent, {} failed",
            c.total, c.queued, c.in_flight, c.due, c.waiting, c.sent, c.failed
        )?;
    }
    if let Some(moved) = status.history_items.filter(|n| *n > 0) {
        writeln!(
            out,
            "history  {moved} older sent or failed items, not counted above (list --history)"
        )?;
    }
    if let Some(oldest) = &status.oldest_queued {
        let span = chrono::Duration::seconds(oldest.age_seconds);
        writeln!(
            out,
            "oldest queued  {} ({} old, enqueued {})",
            clean(&oldest.idempotency_key),
            age(span),
            oldest.created_at_utc
        )?;
    }
    if !status.failed_by_error_code.is_empty() {
        writeln!(out, "\nfailed by error code")?;
        let mut table = Table::new(vec!["ERROR CODE", "ITEMS", ""]);
        for f in &status.failed_by_error_code {
            let note = if f.ambiguous_items == f.items {
                "ambiguous: may have been delivered".to_owned()
            } else if f.ambiguous {
                format!("{} ambiguous: may have been delivered", f.ambiguous_items)
            } else {
                String::new()
            };
            table.row(vec![f.error_code.clone(), f.items.to_string(), note]);
        }
        table.write(out, "  ")?;
    }
    if let Some(window) = &status.rate_window {
        write_rate_window(window, out)?;
    }
    let audit = &status.audit;
    writeln!(out)?;
    if let (Some(seq), Some(hash)) = (audit.head_seq, &audit.head_hash) {
        writeln!(out, "audit    head seq {seq}, hash {hash}")?;
    }
    match (&audit.error, audit.records) {
        (Some(error), _) => writeln!(out, "audit    chain BROKEN: {}", clean(error))?,
        (None, Some(records)) => writeln!(out, "audit    chain verified ({records} records)")?,
        (None, None) => writeln!(out, "audit    chain not checked")?,
    }
    if !status.set_aside.is_empty() {
        writeln!(
            out,
            "set aside {} file(s): what a crash left past a durable point, rebuilt from the \
             journal; nothing acknowledged is in them (keep for inspection, then archive)",
            status.set_aside.len()
        )?;
        for name in &status.set_aside {
            writeln!(out, "  {}", clean(name))?;
        }
    }
    Ok(())
}

/// The rate section of the text report.
fn write_rate_window(window: &RateWindow, out: &mut dyn Write) -> std::io::Result<()> {
    let source = match window.source {
        "what_if" => "what-if, --rate-limit",
        "stored" => "stored in the outbox",
        _ => "library default; the outbox stores no cap",
    };
    writeln!(
        out,
        "\nrate window ({} sends per {}s per destination, {source})",
        window.cap, window.window_seconds
    )?;
    for o in &window.overrides {
        writeln!(
            out,
            "  destinations matching {}: {} sends per {}s",
            clean(&o.pattern),
            o.count,
            o.window_seconds
        )?;
    }
    if let Some(global) = &window.global {
        writeln!(
            out,
            "  across all destinations: {} sends per {}s",
            global.count, global.window_seconds
        )?;
    }
    let mut table = Table::new(vec![
        "DESTINATION",
        "SENDS",
        "QUEUED",
        "NEXT FREE SLOT",
        "COOLDOWN UNTIL",
    ]);
    for d in &window.destinations {
        table.row(vec![
            d.destination.clone(),
            format!("{}/{} per {}s", d.sends_in_window, d.cap, d.window_seconds),
            d.queued.to_string(),
            d.next_free_slot_utc.clone().unwrap_or_else(|| "-".into()),
            d.cooldown_until_utc.clone().unwrap_or_else(|| "-".into()),
        ]);
    }
    if table.is_empty() {
        writeln!(out, "  no sends in the window and nothing queued")?;
    } else {
        table.write(out, "  ")?;
    }
    Ok(())
}
