//! The command line, declared with clap's derive API. Parsing only: no I/O here.

use std::path::PathBuf;
use std::time::Duration;

use chrono::{DateTime, Utc};
use clap::{Args, Parser, Subcommand, ValueEnum};

/// The exit codes, shown under every `--help` and in the README.
pub const EXIT_CODES: &str = "\
Exit codes:
  0  success: the outbox is healthy, verified, found, or the action was recorded
  1  needs attention: failed ambiguous items or a broken audit chain (status),
     verification failed (verify), the action was refused (requeue, cancel),
     nothing matched (show, find), or the outbox could not be read
  2  bad arguments or usage: unknown option, invalid value, DIR is not an
     outbox, URL's schema holds no outbox or one at an older schema version
     (see upgrade-schema)";

/// Inspect and operate a durable-outbox outbox (a directory, or a PostgreSQL
/// schema given by URL) while the bot runs.
///
/// Every command opens the outbox the way the bot does and takes the same lock for
/// each change, so it is safe to run next to a live bot. Read commands record
/// nothing (opening repairs what a crash left, as the bot's own open would);
/// `requeue` and `cancel` are recorded in the audit log with who and why.
/// No command but `upgrade-schema` migrates a PostgreSQL outbox's tables.
#[derive(Debug, Parser)]
#[command(name = "durable-outbox", version, after_help = EXIT_CODES)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Health at a glance: what is stuck, what failed, whether the audit log holds.
    ///
    /// Counts by state, sends per destination in the current rate window against
    /// the caps the outbox stores (the bot's own; `--rate-limit` for a what-if
    /// view), the oldest queued item's age, items in flight, failed items by
    /// error code, the audit head and whether the chain verifies. Exits 1 when
    /// something needs an operator: a failed item that may have been delivered
    /// (ambiguous), or a broken audit chain.
    ///
    /// Counts are of the live items; sent and failed items the library has moved
    /// to history (after a day, by default) are only totalled.
    ///
    /// "In flight" means claimed by a worker. A claim whose worker died is
    /// counted there too until the bot next touches the item, which then fails
    /// as `ambiguous_delivery_after_restart` (and is never resent by itself).
    #[command(after_help = EXIT_CODES)]
    Status(StatusArgs),
    /// A table of items, most recently changed first.
    ///
    /// Lists the live items: queued ones, and sent or failed ones until the
    /// library moves them to history (after a day, by default); add --history for
    /// those too. Message bodies are shown only with --show-content.
    #[command(after_help = EXIT_CODES)]
    List(ListArgs),
    /// One item and its full audit history.
    #[command(after_help = EXIT_CODES)]
    Show(ShowArgs),
    /// Which item a reply answers: look it up by the platform's message id.
    ///
    /// `find DIR REF --destination CHAT` finds the item sent to CHAT with that
    /// id; without --destination the id must be unique across chats.
    #[command(after_help = EXIT_CODES)]
    Find(FindArgs),
    /// Verify the audit chain and cross-check it against the items.
    ///
    /// Checks every record's hash and link, that the log reaches the head
    /// outbox.json recorded, that every record belongs to a known item, and that
    /// every item's latest outcome has its record. Exits 1 naming the first bad line.
    #[command(after_help = EXIT_CODES)]
    Verify(VerifyArgs),
    /// Send a failed item again, or every failed item the filters select
    /// (recorded in the audit log, one record per item).
    ///
    /// An operator's decision, and the only way an ambiguous item (one that may
    /// have been delivered) is ever sent again. The item goes back to queued with
    /// its attempts reset; the bot sends it on its next pass. Refuses sent items
    /// and items a worker is sending right now.
    ///
    /// With filters instead of KEY (`--state`, `--error-code`, `--class`,
    /// `--destination`, `--since`; all must hold) it acts on every live item
    /// they select and lists what it skipped; `--dry-run` shows that first.
    #[command(after_help = EXIT_CODES)]
    Requeue(OperatorArgs),
    /// Stop a queued item, or every queued item the filters select, from being
    /// sent (recorded in the audit log, one record per item).
    ///
    /// The item becomes failed with `cancelled_by_operator`. Refuses items a
    /// worker is sending right now: they may be leaving as you type. Filters
    /// and `--dry-run` work as for `requeue`.
    #[command(after_help = EXIT_CODES)]
    Cancel(OperatorArgs),
    /// Every item, or every audit record, as JSON lines or CSV.
    ///
    /// Items, live and moved to history, carry the field names of outbox.json and
    /// no bodies unless --show-content; audit records are exported as stored.
    #[command(after_help = EXIT_CODES)]
    Export(ExportArgs),
    /// Copy a file outbox into PostgreSQL, to run the bot on more than one host.
    ///
    /// Copies every live item (claims included: a send that was in progress
    /// becomes failed as ambiguous on PostgreSQL, never resent), history, the
    /// stored settings, cooldowns and the audit chain byte for byte, in one
    /// transaction that commits only once the copy reads back equal and the
    /// chain verifies to the same head. Refuses while a bot has DIR open, and
    /// a schema that already holds an outbox. DIR is only read. Stop the bots
    /// first; start them again with `Outbox::postgres(URL)`.
    #[command(after_help = EXIT_CODES)]
    Migrate(MigrateArgs),
    /// Migrate a PostgreSQL outbox's tables to this release's schema version.
    ///
    /// Every other command refuses an outbox at an older version (exit 2)
    /// rather than migrate it as it looks: bots of the older release go on
    /// running on migrated tables, but each refuses them at its next start.
    /// Run this when you upgrade the bots (an upgraded bot's own start
    /// migrates too). Nothing else is changed; an outbox already at this
    /// release's version is left as it is.
    #[command(after_help = EXIT_CODES)]
    UpgradeSchema(UpgradeSchemaArgs),
}

/// `upgrade-schema`.
#[derive(Debug, Args)]
pub struct UpgradeSchemaArgs {
    /// The PostgreSQL database, `postgres://user@host:port/database`.
    #[arg(value_name = "URL")]
    pub url: String,
    /// The schema the outbox lives in (default `durable_outbox`).
    #[arg(long, value_name = "SCHEMA")]
    pub schema: Option<String>,
    /// The audit HMAC key of a keyed chain, as for the other commands.
    #[arg(long, value_name = "FILE")]
    pub audit_key_file: Option<PathBuf>,
    /// Use the --audit-key-file even if group or others can read it.
    #[arg(long, requires = "audit_key_file")]
    pub allow_readable_key_file: bool,
}

impl UpgradeSchemaArgs {
    /// The outbox, as the other commands name it.
    pub fn target(&self) -> Target {
        Target {
            dir: PathBuf::from(&self.url),
            schema: self.schema.clone(),
            audit_key_file: self.audit_key_file.clone(),
            allow_readable_key_file: self.allow_readable_key_file,
        }
    }
}

/// `migrate`.
#[derive(Debug, Args)]
pub struct MigrateArgs {
    /// The file outbox to copy.
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,
    /// The PostgreSQL database, `postgres://user@host:port/database`.
    #[arg(value_name = "URL")]
    pub url: String,
    /// The schema to fill (default `durable_outbox`); it must hold no outbox yet.
    #[arg(long, value_name = "SCHEMA")]
    pub schema: Option<String>,
    /// The audit HMAC key of a keyed chain, as for the other commands.
    #[arg(long, value_name = "FILE")]
    pub audit_key_file: Option<PathBuf>,
    /// Use the --audit-key-file even if group or others can read it.
    #[arg(long, requires = "audit_key_file")]
    pub allow_readable_key_file: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// The outbox a command works on.
#[derive(Debug, Args)]
pub struct Target {
    /// The outbox directory (the one the bot opens), or the PostgreSQL
    /// database of an `Outbox::postgres` outbox: `postgres://user@host:port/db`.
    #[arg(value_name = "DIR|URL")]
    pub dir: PathBuf,
    /// With a `postgres://` URL: the schema the outbox lives in (default `durable_outbox`).
    #[arg(long, value_name = "SCHEMA")]
    pub schema: Option<String>,
    /// A file holding the audit HMAC key, for bots that set `audit_key` (its exact bytes).
    /// It must not be readable by group or others (chmod 600), as ssh requires of
    /// private keys: whoever can read the key can forge the audit log.
    #[arg(long, value_name = "FILE")]
    pub audit_key_file: Option<PathBuf>,
    /// Use the --audit-key-file even if group or others can read it.
    #[arg(long, requires = "audit_key_file")]
    pub allow_readable_key_file: bool,
}

/// `status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub target: Target,
    /// A what-if view: compare every destination's window against this cap
    /// instead of the caps the outbox stores (the bot's own).
    #[arg(long, value_name = "COUNT/SECONDS", value_parser = parse_rate_limit)]
    pub rate_limit: Option<RateCap>,
    /// An error code your bot gives ambiguous failures (may have been delivered),
    /// besides the library's own `ambiguous_delivery_after_restart`,
    /// `send_panicked` and `send_cancelled`. Repeatable.
    #[arg(long = "ambiguous-code", value_name = "CODE")]
    pub ambiguous_codes: Vec<String>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `list`.
#[derive(Debug, Args)]
pub struct ListArgs {
    #[command(flatten)]
    pub target: Target,
    /// Only items in this state.
    #[arg(long, value_enum, value_name = "STATE")]
    pub state: Option<StateFilter>,
    /// Only items for this destination.
    #[arg(long, value_name = "DESTINATION")]
    pub destination: Option<String>,
    /// Only items that changed at or after T: an RFC 3339 time
    /// (2026-01-15T09:00:00Z) or an age such as 90s, 15m, 2h or 7d.
    #[arg(long, value_name = "T", value_parser = parse_since)]
    pub since: Option<Since>,
    /// Show at most N items (the most recently changed).
    #[arg(long, value_name = "N")]
    pub limit: Option<usize>,
    /// Also list items moved to history (sent or failed over a day ago), found
    /// through the audit log: slower on a long log.
    #[arg(long)]
    pub history: bool,
    /// Include message bodies.
    #[arg(long)]
    pub show_content: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `show`.
#[derive(Debug, Args)]
pub struct ShowArgs {
    #[command(flatten)]
    pub target: Target,
    /// The item's idempotency key.
    #[arg(value_name = "KEY")]
    pub key: String,
    /// Include the message body.
    #[arg(long)]
    pub show_content: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `find`.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("reference").required(true).args(["transport_ref", "transport_ref_flag"])))]
pub struct FindArgs {
    #[command(flatten)]
    pub target: Target,
    /// The platform's message id a reply quotes.
    #[arg(value_name = "REF")]
    pub transport_ref: Option<String>,
    /// The same, as an option (`--transport-ref R`).
    #[arg(long = "transport-ref", value_name = "R")]
    pub transport_ref_flag: Option<String>,
    /// The chat the reply came from. Telegram and Slack number messages per
    /// chat, so without it "7" may find another chat's message 7; leave it out
    /// only for platforms with globally unique ids (Matrix event ids).
    #[arg(long, value_name = "DESTINATION")]
    pub destination: Option<String>,
    /// Include the message body.
    #[arg(long)]
    pub show_content: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `verify`.
#[derive(Debug, Args)]
pub struct VerifyArgs {
    #[command(flatten)]
    pub target: Target,
    /// Report progress on stderr even when it is not a terminal.
    #[arg(long)]
    pub progress: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// An audit head recorded earlier somewhere this host cannot write (from
    /// `status --json` or `verify --json`): the log must still hold that record
    /// with that hash. Catches what nothing on the host can: the log cut back to
    /// an earlier point together with the state, or every file restored from
    /// an older copy.
    #[arg(long, value_name = "SEQ:HASH", value_parser = parse_head)]
    pub expect_head: Option<durable_outbox::Head>,
}

/// `requeue` and `cancel`.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("which").required(true).multiple(true)
    .args(["key", "state", "error_code", "class", "destination", "since"])))]
#[command(group(clap::ArgGroup::new("bulk").multiple(true)
    .args(["state", "error_code", "class", "destination", "since"])))]
pub struct OperatorArgs {
    #[command(flatten)]
    pub target: Target,
    /// The item's idempotency key (or select items with the filters below).
    #[arg(value_name = "KEY", conflicts_with_all = ["state", "error_code", "class", "destination", "since"])]
    pub key: Option<String>,
    /// Every item in this state (filters combine: all must hold).
    #[arg(long, value_enum, value_name = "STATE")]
    pub state: Option<BulkState>,
    /// Every item with exactly this error code.
    #[arg(long, value_name = "CODE")]
    pub error_code: Option<String>,
    /// Every item whose stored failure class is this.
    #[arg(long, value_enum, value_name = "CLASS")]
    pub class: Option<ClassFilter>,
    /// Every item for this destination.
    #[arg(long, value_name = "DESTINATION")]
    pub destination: Option<String>,
    /// Every item that changed at or after T: an RFC 3339 time or an age (90s, 15m, 2h, 7d).
    #[arg(long, value_name = "T", value_parser = parse_since)]
    pub since: Option<Since>,
    /// List what the filters select and what would change; record nothing.
    #[arg(long, requires = "bulk")]
    pub dry_run: bool,
    /// Why: recorded in the audit log.
    #[arg(long, value_name = "TEXT")]
    pub reason: String,
    /// Who decided: recorded in the audit log. Default: your login name.
    #[arg(long, value_name = "NAME")]
    pub operator: Option<String>,
    /// Print the updated item as JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `export`.
#[derive(Debug, Args)]
pub struct ExportArgs {
    #[command(flatten)]
    pub target: Target,
    /// Output format.
    #[arg(long, value_enum, default_value_t = ExportFormat::Jsonl)]
    pub format: ExportFormat,
    /// Export the audit log's records instead of the items.
    #[arg(long)]
    pub audit: bool,
    /// Include message bodies (items only; the audit log never holds them).
    #[arg(long)]
    pub show_content: bool,
}

/// `list --state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StateFilter {
    /// Waiting to be sent, including items in flight.
    Queued,
    /// Queued and claimed by a worker (being sent now, or its worker died).
    InFlight,
    /// Delivered.
    Sent,
    /// Given up (or cancelled).
    Failed,
}

/// `requeue --state` and `cancel --state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BulkState {
    /// Waiting to be sent.
    Queued,
    /// Delivered.
    Sent,
    /// Given up (or cancelled).
    Failed,
}

/// `--class`: a stored failure class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ClassFilter {
    /// Certainly not delivered; could be retried.
    Retryable,
    /// Certainly not delivered, and never will be as it is.
    Permanent,
    /// May have been delivered.
    Ambiguous,
}

/// `export --format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ExportFormat {
    /// One JSON object per line.
    Jsonl,
    /// Comma-separated values with a header row (RFC 4180 quoting).
    Csv,
}

/// `status --rate-limit`: at most `count` sends per destination per `window`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateCap {
    /// Sends allowed per window.
    pub count: u32,
    /// The window's length.
    pub window: Duration,
}

/// `list --since`: an absolute time, or an age resolved against "now" when the
/// command runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Since {
    /// A point in time.
    At(DateTime<Utc>),
    /// This long before now.
    Ago(Duration),
}

impl Since {
    /// The point in time this stands for, given the current time.
    pub fn resolve(self, now: DateTime<Utc>) -> DateTime<Utc> {
        match self {
            Self::At(at) => at,
            Self::Ago(age) => chrono::Duration::from_std(age)
                .ok()
                .and_then(|age| now.checked_sub_signed(age))
                .unwrap_or(DateTime::<Utc>::MIN_UTC),
        }
    }
}

/// Parses `COUNT/SECONDS`, both positive, e.g. `10/60`.
fn parse_rate_limit(text: &str) -> Result<RateCap, String> {
    let expected = || format!("expected COUNT/SECONDS such as 10/60, got {text:?}");
    let (count, seconds) = text.split_once('/').ok_or_else(expected)?;
    let count: u32 = count.trim().parse().map_err(|_| expected())?;
    let seconds: u64 = seconds.trim().parse().map_err(|_| expected())?;
    if count == 0 || seconds == 0 {
        return Err(format!("both numbers must be positive, got {text:?}"));
    }
    Ok(RateCap {
        count,
        window: Duration::from_secs(seconds),
    })
}

/// Parses `SEQ:HASH`, the hash being 64 lowercase hex digits.
fn parse_head(text: &str) -> Result<durable_outbox::Head, String> {
    let expected = || format!("expected SEQ:HASH such as 42:<64 hex digits>, got {text:?}");
    let (seq, hash) = text.split_once(':').ok_or_else(expected)?;
    let seq: u64 = seq.trim().parse().map_err(|_| expected())?;
    let hash = hash.trim();
    if seq == 0
        || hash.len() != 64
        || !hash
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return Err(expected());
    }
    Ok(durable_outbox::Head {
        seq,
        hash: hash.to_owned(),
    })
}

/// Parses an RFC 3339 time or an age `<number><s|m|h|d>`.
fn parse_since(text: &str) -> Result<Since, String> {
    if let Ok(at) = DateTime::parse_from_rfc3339(text) {
        return Ok(Since::At(at.with_timezone(&Utc)));
    }
    let unit = |c: char| match c {
        's' => Some(1),
        'm' => Some(60),
        'h' => Some(3600),
        'd' => Some(86_400),
        _ => None,
    };
    let age = text
        .char_indices()
        .last()
        .and_then(|(at, c)| Some((text[..at].parse::<u64>().ok()?, unit(c)?)))
        .and_then(|(n, scale)| n.checked_mul(scale));
    match age {
        Some(seconds) => Ok(Since::Ago(Duration::from_secs(seconds))),
        None => Err(format!(
            "expected an RFC 3339 time (2026-01-15T09:00:00Z) or an age such as 90s, 15m, 2h, 7d; got {text:?}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_limits_need_two_positive_numbers() {
        assert_eq!(
            parse_rate_limit("2/30"),
            Ok(RateCap {
                count: 2,
                window: Duration::from_secs(30)
            })
        );
        for bad in ["10", "0/60", "10/0", "a/b", "10/60s", ""] {
            assert!(parse_rate_limit(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn since_takes_times_and_ages() {
        let now = DateTime::parse_from_rfc3339("2026-01-15T10:00:00Z")
            .unwrap()
            .with_timezone(&Utc);
        let at = |t: &str| parse_since(t).unwrap().resolve(now).to_rfc3339();
        assert_eq!(at("2h"), "2026-01-15T08:00:00+00:00");
        assert_eq!(at("90s"), "2026-01-15T09:58:30+00:00");
        assert_eq!(at("2026-01-15T11:00:00+01:00"), "2026-01-15T10:00:00+00:00");
        for bad in ["yesterday", "2w", "h", "-5m", ""] {
            assert!(parse_since(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_command_line_is_well_formed() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
