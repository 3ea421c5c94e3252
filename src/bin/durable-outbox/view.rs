//! How items, times and tables look: the JSON shapes scripts rely on and the text
//! a person reads.

use std::fmt::Write as _;
use std::io::{self, Write};

use chrono::{DateTime, SecondsFormat, Utc};
use durable_outbox::{FailureClass, ItemState, OutboxItem};
use serde::Serialize;

/// An item as the JSON output and the exports show it: the field names of
/// `outbox.json`, times in RFC 3339 UTC, the body only when asked for.
#[derive(Debug, Serialize)]
pub struct ItemView<'a> {
    pub idempotency_key: &'a str,
    pub state: &'static str,
    pub dispatch_claimed: bool,
    pub connector: &'a str,
    pub grant_id: &'a str,
    pub destination: &'a str,
    pub attempts: u32,
    pub created_at_utc: String,
    pub updated_at_utc: String,
    pub next_attempt_at_utc: Option<String>,
    pub sent_at_utc: Option<String>,
    pub cooldown_until_utc: Option<String>,
    pub error_code: Option<&'a str>,
    /// The stored class of the last failure: `retryable`, `permanent` or
    /// `ambiguous` (may have been delivered); `null` before any failure and for
    /// items written before the class was stored.
    pub failure_class: Option<&'static str>,
    pub transport_ref: Option<&'a str>,
    pub lane: &'a str,
    pub direction: &'a str,
    pub risk_class: Option<&'a str>,
    pub content_hash: &'a str,
    pub content_bytes: usize,
    pub last_audit_id: Option<&'a str>,
    /// Present only with `--show-content`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<&'a str>,
}

impl<'a> ItemView<'a> {
    pub fn new(item: &'a OutboxItem, show_content: bool) -> Self {
        Self {
            idempotency_key: item.idempotency_key(),
            state: item.state().as_str(),
            dispatch_claimed: item.dispatch_claimed(),
            connector: item.connector(),
            grant_id: item.grant_id(),
            destination: item.destination(),
            attempts: item.attempts(),
            created_at_utc: precise(item.created_at()),
            updated_at_utc: precise(item.updated_at()),
            next_attempt_at_utc: item.next_attempt_at().map(precise),
            sent_at_utc: item.sent_at().map(precise),
            cooldown_until_utc: item.cooldown_until().map(precise),
            error_code: item.error_code(),
            failure_class: item.failure_class().map(FailureClass::as_str),
            transport_ref: item.transport_ref(),
            lane: item.lane(),
            direction: item.direction(),
            risk_class: item.risk_class(),
            content_hash: item.content_hash(),
            content_bytes: item.content().len(),
            last_audit_id: item.last_audit_id(),
            content: show_content.then(|| item.content()),
        }
    }
}

/// The state as a person reads it: a claimed queued item is `in-flight`.
pub fn state_label(item: &OutboxItem) -> &'static str {
    match item.state() {
        ItemState::Queued if item.dispatch_claimed() => "in-flight",
        state => state.as_str(),
    }
}

/// What a person most wants to know about an item besides its state.
pub fn detail(item: &OutboxItem, now: DateTime<Utc>) -> String {
    match item.state() {
        ItemState::Sent => item
            .transport_ref()
            .map_or_else(String::new, |r| format!("ref {r}")),
        ItemState::Failed => {
            let code = item.error_code().unwrap_or("");
            if crate::may_have_been_delivered(item, &crate::AMBIGUOUS_CODES) {
                format!("{code} (may have been delivered)")
            } else {
                code.to_owned()
            }
        }
        ItemState::Queued if item.dispatch_claimed() => "claimed by a worker".to_owned(),
        ItemState::Queued => {
            let mut text = String::new();
            if let Some(code) = item.error_code() {
                text.push_str(code);
            }
            match item.next_attempt_at() {
                Some(at) if at > now => {
                    if !text.is_empty() {
                        text.push_str(", ");
                    }
                    let _ = write!(text, "next attempt in {}", age(at - now));
                }
                _ => {
                    if !text.is_empty() {
                        text.push_str(", ");
                    }
                    text.push_str("due now");
                }
            }
            text
        }
    }
}

/// JSON and export times: microseconds, as the outbox stores them.
pub fn precise(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// Table times: whole seconds, still RFC 3339 UTC.
pub fn short(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Secs, true)
}

/// An age such as `3d4h`, `5m12s` or `0s` (negative ages read as `0s`).
pub fn age(span: chrono::Duration) -> String {
    let total = span.num_seconds().max(0);
    let (days, hours, minutes, seconds) = (
        total / 86_400,
        total % 86_400 / 3600,
        total % 3600 / 60,
        total % 60,
    );
    match (days, hours, minutes) {
        (0, 0, 0) => format!("{seconds}s"),
        (0, 0, _) => format!("{minutes}m{seconds}s"),
        (0, _, _) => format!("{hours}h{minutes}m"),
        _ => format!("{days}d{hours}h"),
    }
}

/// Makes text from the outbox safe to print on a terminal: control characters and
/// bidirectional overrides (which could hide or reorder what follows) are escaped.
pub fn clean(text: &str) -> String {
    let risky = |c: char| {
        c.is_control()
            || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    };
    if !text.chars().any(risky) {
        return text.to_owned();
    }
    text.chars()
        .map(|c| {
            if risky(c) {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// `-` for a missing value.
pub fn or_dash(text: Option<&str>) -> String {
    text.map_or_else(|| "-".to_owned(), clean)
}

/// A plain-text table: a header row, left-aligned columns two spaces apart.
#[derive(Debug)]
pub struct Table {
    header: Vec<&'static str>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(header: Vec<&'static str>) -> Self {
        Self {
            header,
            rows: Vec::new(),
        }
    }

    /// Adds a row; cells are escaped for the terminal.
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows
            .push(cells.into_iter().map(|c| clean(&c)).collect());
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Writes the table, each line prefixed with `indent`.
    pub fn write(&self, out: &mut dyn Write, indent: &str) -> io::Result<()> {
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (width, cell) in widths.iter_mut().zip(row) {
                *width = (*width).max(cell.chars().count());
            }
        }
        let line = |cells: Vec<&str>| {
            let mut text = indent.to_owned();
            let last = cells.len().saturating_sub(1);
            for (i, (cell, width)) in cells.iter().zip(&widths).enumerate() {
                text.push_str(cell);
                if i < last {
                    let pad = width - cell.chars().count() + 2;
                    text.extend(std::iter::repeat_n(' ', pad));
                }
            }
            text.truncate(text.trim_end().len());
            text.push('\n');
            text
        };
        out.write_all(line(self.header.clone()).as_bytes())?;
        for row in &self.rows {
            out.write_all(line(row.iter().map(String::as_str).collect()).as_bytes())?;
        }
        Ok(())
    }
}

/// Writes `value` as pretty JSON and a newline.
pub fn write_json(out: &mut dyn Write, value: &impl Serialize) -> io::Result<()> {
    serde_json::to_writer_pretty(&mut *out, value)?;
    out.write_all(b"\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_at_a_glance() {
        let s = chrono::Duration::seconds;
        assert_eq!(age(s(-5)), "0s");
        assert_eq!(age(s(42)), "42s");
        assert_eq!(age(s(312)), "5m12s");
        assert_eq!(age(s(3 * 3600 + 120)), "3h2m");
        assert_eq!(age(s(2 * 86_400 + 3600)), "2d1h");
    }

    #[test]
    fn terminal_escapes_are_neutralised() {
        assert_eq!(clean("plain ünïcode"), "plain ünïcode");
        assert_eq!(clean("a\u{1b}[31mred\nb"), "a\\u{1b}[31mred\\nb");
        assert_eq!(clean("x\u{202e}y"), "x\\u{202e}y");
    }

    #[test]
    fn tables_align_on_the_widest_cell() {
        let mut table = Table::new(vec!["KEY", "STATE"]);
        table.row(vec!["a-long-key".into(), "sent".into()]);
        table.row(vec!["k".into(), "failed".into()]);
        let mut out = Vec::new();
        table.write(&mut out, "").unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "KEY         STATE\na-long-key  sent\nk           failed\n"
        );
    }
}
