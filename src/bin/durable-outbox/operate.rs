//! The write commands, `requeue` and `cancel`: operator decisions, each one audited.
//!
//! Both go through the library's own transactions, under the same lock as the
//! bot, so they are safe while it runs: an item the bot is sending right now is
//! refused, never changed underneath it.

use std::io::Write;
use std::process::ExitCode;

use chrono::Utc;
use durable_outbox::{CANCELLED, Error, FailureClass, ItemFilter, ItemState, OutboxItem};
use serde::Serialize;

use crate::args::{BulkState, ClassFilter, OperatorArgs};
use crate::view::{self, ItemView, Table, clean};
use crate::{ATTENTION, CliResult, UsageError};

/// What the library calls each action in its refusals and audit records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Requeue,
    Cancel,
}

impl Action {
    fn done(self) -> &'static str {
        match self {
            Self::Requeue => "requeued",
            Self::Cancel => "cancelled",
        }
    }
}

/// `requeue --json` and `cancel --json`.
#[derive(Serialize)]
struct Done<'a> {
    action: &'static str,
    operator: &'a str,
    reason: &'a str,
    /// The sequence number of the audit record that holds the decision.
    audit_seq: Option<u64>,
    item: ItemView<'a>,
}

pub fn requeue(args: &OperatorArgs, out: &mut dyn Write, err: &mut dyn Write) -> CliResult {
    act(Action::Requeue, args, out, err)
}

pub fn cancel(args: &OperatorArgs, out: &mut dyn Write, err: &mut dyn Write) -> CliResult {
    act(Action::Cancel, args, out, err)
}

fn act(action: Action, args: &OperatorArgs, out: &mut dyn Write, err: &mut dyn Write) -> CliResult {
    let operator = match &args.operator {
        Some(name) => name.clone(),
        None => login_name()?,
    };
    let Some(key) = args.key.as_deref() else {
        return bulk(action, args, &operator, out, err);
    };
    let outbox = crate::open(&args.target)?;
    let before = outbox.get(key)?;
    let done = match action {
        Action::Requeue => outbox.requeue(key, &operator, &args.reason),
        Action::Cancel => outbox.cancel(key, &operator, &args.reason),
    };
    let item = match done {
        Ok(item) => item,
        Err(Error::InvalidField { field, reason }) => {
            return Err(Box::new(UsageError(format!("--{field}: {reason}"))));
        }
        Err(refused @ Error::InvalidTransition { .. }) => {
            writeln!(err, "durable-outbox: refused: {refused}")?;
            return Ok(ExitCode::from(ATTENTION));
        }
        Err(e) => return Err(e.into()),
    };
    // The record that holds the decision is the one the item now names.
    let audit_seq = item.last_audit_id().and_then(|id| {
        outbox
            .history(key)
            .ok()?
            .into_iter()
            .rev()
            .find(|r| r.audit_id == id)
            .map(|r| r.seq)
    });
    if action == Action::Requeue
        && let Some(was) = before
            .as_ref()
            .filter(|b| crate::may_have_been_delivered(b, &crate::AMBIGUOUS_CODES))
    {
        let code = was.error_code().unwrap_or("-");
        writeln!(
            err,
            "durable-outbox: note: {key:?} failed as {code}: its earlier attempt may have \
             been delivered, and the bot will now send it again"
        )?;
    }
    if args.json {
        view::write_json(
            out,
            &Done {
                action: action.done(),
                operator: &operator,
                reason: &args.reason,
                audit_seq,
                item: ItemView::new(&item, false),
            },
        )?;
        return Ok(ExitCode::SUCCESS);
    }
    let was = before.map_or_else(String::new, |b| {
        let code = b.error_code().map(|c| format!(": {c}")).unwrap_or_default();
        format!(" (was {}{code})", b.state())
    });
    let now = match action {
        Action::Requeue => "queued again, attempts reset; the bot sends it on its next pass",
        Action::Cancel => &format!("failed with {CANCELLED}; it will not be sent"),
    };
    writeln!(out, "{} {}{was}: {now}", action.done(), clean(key))?;
    writeln!(
        out,
        "recorded in the audit log{} by {}: {}",
        audit_seq.map_or_else(String::new, |seq| format!(" as seq {seq}")),
        clean(&operator),
        clean(&args.reason)
    )?;
    Ok(ExitCode::SUCCESS)
}

/// `requeue --json` and `cancel --json` with filters.
#[derive(Serialize)]
struct BulkDone<'a> {
    action: &'static str,
    dry_run: bool,
    operator: &'a str,
    reason: &'a str,
    changed: Vec<ItemView<'a>>,
    skipped: Vec<Skipped<'a>>,
}

#[derive(Serialize)]
struct Skipped<'a> {
    idempotency_key: &'a str,
    why: &'a str,
}

/// The library's filter for the command's `--state --error-code --class
/// --destination --since`.
fn filter(args: &OperatorArgs) -> ItemFilter {
    let mut filter = ItemFilter::new();
    if let Some(state) = args.state {
        filter = filter.state(match state {
            BulkState::Queued => ItemState::Queued,
            BulkState::Sent => ItemState::Sent,
            BulkState::Failed => ItemState::Failed,
        });
    }
    if let Some(code) = &args.error_code {
        filter = filter.error_code(code.clone());
    }
    if let Some(class) = args.class {
        filter = filter.class(match class {
            ClassFilter::Retryable => FailureClass::Retryable,
            ClassFilter::Permanent => FailureClass::Permanent,
            ClassFilter::Ambiguous => FailureClass::Ambiguous,
        });
    }
    if let Some(destination) = &args.destination {
        filter = filter.destination(destination.clone());
    }
    if let Some(since) = args.since {
        filter = filter.since(since.resolve(Utc::now()));
    }
    filter
}

/// `requeue`/`cancel` by filter: every selected item, one audit record each.
fn bulk(
    action: Action,
    args: &OperatorArgs,
    operator: &str,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> CliResult {
    let outbox = crate::open(&args.target)?;
    let filter = filter(args);
    // What the items were, to show what changed (taken just before acting).
    let before: std::collections::HashMap<String, OutboxItem> = outbox
        .select(&filter)?
        .into_iter()
        .map(|item| (item.idempotency_key().to_owned(), item))
        .collect();
    let done = match (action, args.dry_run) {
        (Action::Requeue, true) => outbox.preview_requeue_where(&filter),
        (Action::Cancel, true) => outbox.preview_cancel_where(&filter),
        (Action::Requeue, false) => outbox.requeue_where(&filter, operator, &args.reason),
        (Action::Cancel, false) => outbox.cancel_where(&filter, operator, &args.reason),
    };
    let report = match done {
        Ok(report) => report,
        Err(Error::InvalidField { field, reason }) => {
            return Err(Box::new(UsageError(format!("--{field}: {reason}"))));
        }
        Err(e) => return Err(e.into()),
    };
    let code = if report.changed.is_empty() {
        ExitCode::from(ATTENTION)
    } else {
        ExitCode::SUCCESS
    };
    if args.json {
        view::write_json(
            out,
            &BulkDone {
                action: action.done(),
                dry_run: args.dry_run,
                operator,
                reason: &args.reason,
                changed: report
                    .changed
                    .iter()
                    .map(|i| ItemView::new(i, false))
                    .collect(),
                skipped: report
                    .skipped
                    .iter()
                    .map(|(key, why)| Skipped {
                        idempotency_key: key,
                        why,
                    })
                    .collect(),
            },
        )?;
        return Ok(code);
    }
    write_bulk_text(action, args, operator, &report, &before, out, err)?;
    Ok(code)
}

/// The text report of a bulk action: what changed (as it was), what was skipped.
fn write_bulk_text(
    action: Action,
    args: &OperatorArgs,
    operator: &str,
    report: &durable_outbox::BulkReport,
    before: &std::collections::HashMap<String, OutboxItem>,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> std::io::Result<()> {
    let n = report.changed.len();
    if args.dry_run {
        writeln!(
            out,
            "dry run: would {} {n} item(s); nothing was changed or recorded",
            match action {
                Action::Requeue => "requeue",
                Action::Cancel => "cancel",
            }
        )?;
    } else if n == 0 {
        writeln!(out, "{} nothing; nothing was recorded", action.done())?;
    } else {
        writeln!(
            out,
            "{} {n} item(s), each recorded in the audit log by {}: {}",
            action.done(),
            clean(operator),
            clean(&args.reason)
        )?;
    }
    if n > 0 {
        let mut table = Table::new(vec!["KEY", "DESTINATION", "WAS", "ERROR CODE", "CLASS"]);
        for item in &report.changed {
            let was = match action {
                Action::Requeue => "failed",
                Action::Cancel => "queued",
            };
            let was_item = before.get(item.idempotency_key());
            let code = was_item
                .and_then(OutboxItem::error_code)
                .unwrap_or("-")
                .to_owned();
            let class = was_item
                .and_then(OutboxItem::failure_class)
                .map_or("-", FailureClass::as_str)
                .to_owned();
            table.row(vec![
                item.idempotency_key().to_owned(),
                item.destination().to_owned(),
                was.to_owned(),
                code,
                class,
            ]);
        }
        table.write(out, "  ")?;
    }
    if !report.skipped.is_empty() {
        writeln!(out, "skipped {} matching item(s):", report.skipped.len())?;
        for (key, why) in &report.skipped {
            writeln!(out, "  {}: {}", clean(key), clean(why))?;
        }
    }
    let in_doubt = report
        .changed
        .iter()
        .filter_map(|item| before.get(item.idempotency_key()))
        .filter(|item| crate::may_have_been_delivered(item, &crate::AMBIGUOUS_CODES))
        .count();
    if action == Action::Requeue && in_doubt > 0 {
        writeln!(
            err,
            "durable-outbox: note: {in_doubt} of these may have been delivered (ambiguous): \
             the bot {} send them again",
            if args.dry_run { "would" } else { "will now" }
        )?;
    }
    if n == 0 {
        writeln!(
            err,
            "durable-outbox: no item the filters select can be {}",
            action.done()
        )?;
    } else if action == Action::Requeue && !args.dry_run {
        writeln!(out, "the bot sends them on its next pass")?;
    }
    Ok(())
}

/// The operator's login name, for the audit record when `--operator` is not given:
/// `LOGNAME` or `USER` (set by login shells, `su`, `sudo` and cron), else the
/// account that owns this process, looked up in `/etc/passwd`.
fn login_name() -> Result<String, UsageError> {
    ["LOGNAME", "USER"]
        .iter()
        .find_map(|var| std::env::var(var).ok().filter(|v| !v.trim().is_empty()))
        .or_else(account_name)
        .ok_or_else(|| UsageError("cannot tell your login name: pass --operator NAME".to_owned()))
}

/// The name of the account running this process. `/proc/self` belongs to the
/// process's effective user, which spares a libc call for `getpwuid`.
#[cfg(unix)]
fn account_name() -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let uid = std::fs::metadata("/proc/self").ok()?.uid().to_string();
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|line| {
        let mut fields = line.split(':');
        let name = fields.next()?;
        (fields.nth(1)? == uid && !name.is_empty()).then(|| name.to_owned())
    })
}

#[cfg(not(unix))]
fn account_name() -> Option<String> {
    std::env::var("USERNAME")
        .ok()
        .filter(|v| !v.trim().is_empty())
}
