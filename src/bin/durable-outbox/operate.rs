//! The write commands, `requeue` and `cancel`: operator decisions, each one audited.
//!
//! Both go through the library's own transactions, under the same lock as the
//! bot, so they are safe while it runs: an item the bot is sending right now is
//! refused, never changed underneath it.

use std::io::Write;
use std::process::ExitCode;

use durable_outbox::{CANCELLED, Error, OutboxItem};
use serde::Serialize;

use crate::args::OperatorArgs;
use crate::view::{self, ItemView, clean};
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
    let outbox = crate::open(&args.target)?;
    let before = outbox.get(&args.key)?;
    let done = match action {
        Action::Requeue => outbox.requeue(&args.key, &operator, &args.reason),
        Action::Cancel => outbox.cancel(&args.key, &operator, &args.reason),
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
            .history(&args.key)
            .ok()?
            .into_iter()
            .rev()
            .find(|r| r.audit_id == id)
            .map(|r| r.seq)
    });
    if action == Action::Requeue
        && let Some(code) = before.as_ref().and_then(OutboxItem::error_code)
        && crate::AMBIGUOUS_CODES.contains(&code)
    {
        writeln!(
            err,
            "durable-outbox: note: {:?} failed as {code}: its earlier attempt may have \
             been delivered, and the bot will now send it again",
            args.key
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
    writeln!(out, "{} {}{was}: {now}", action.done(), clean(&args.key))?;
    writeln!(
        out,
        "recorded in the audit log{} by {}: {}",
        audit_seq.map_or_else(String::new, |seq| format!(" as seq {seq}")),
        clean(&operator),
        clean(&args.reason)
    )?;
    Ok(ExitCode::SUCCESS)
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
