//! `migrate DIR URL`: copy a file outbox into PostgreSQL (see
//! `durable_outbox::Migration`). Needs the `postgres` feature.

use std::io::Write;

use crate::CliResult;
use crate::args::{MigrateArgs, Target};

pub fn run(args: &MigrateArgs, out: &mut dyn Write) -> CliResult {
    if !(args.url.starts_with("postgres://") || args.url.starts_with("postgresql://")) {
        return Err(Box::new(crate::UsageError(
            "URL must be a postgres:// or postgresql:// URL".into(),
        )));
    }
    let key_target = Target {
        dir: args.dir.clone(),
        schema: None,
        audit_key_file: args.audit_key_file.clone(),
        allow_readable_key_file: args.allow_readable_key_file,
    };
    let key = crate::audit_key(&key_target)?;
    migrate(args, key, out)
}

#[cfg(feature = "postgres")]
fn migrate(args: &MigrateArgs, key: Option<Vec<u8>>, out: &mut dyn Write) -> CliResult {
    let mut migration = durable_outbox::Migration::new(&args.dir, &args.url);
    if let Some(schema) = &args.schema {
        migration = migration.schema(schema);
    }
    if let Some(key) = key {
        migration = migration.audit_key(key);
    }
    let report = migration.run()?;
    if args.json {
        crate::view::write_json(
            out,
            &serde_json::json!({
                "migrated": true,
                "live_items": report.live_items,
                "claimed_items": report.claimed_items,
                "history_items": report.history_items,
                "audit_records": report.audit_records,
                "audit_head_seq": report.audit_head.seq,
                "audit_head_hash": report.audit_head.hash,
            }),
        )?;
    } else {
        // Claimed items are worth a warning only when there are some.
        let claimed = match report.claimed_items {
            0 => String::new(),
            n => format!(" ({n} claimed: they will fail as ambiguous, never resent)"),
        };
        writeln!(
            out,
            "migrated {} live items{claimed} and {} history items",
            report.live_items, report.history_items
        )?;
        writeln!(
            out,
            "audit    {} records, head seq {} {} (the same on both sides)",
            report.audit_records, report.audit_head.seq, report.audit_head.hash
        )?;
        writeln!(
            out,
            "verified every item and audit line read back equal; {} was not changed",
            args.dir.display()
        )?;
    }
    Ok(std::process::ExitCode::SUCCESS)
}

#[cfg(not(feature = "postgres"))]
fn migrate(_args: &MigrateArgs, _key: Option<Vec<u8>>, _out: &mut dyn Write) -> CliResult {
    Err(Box::new(crate::UsageError(
        "this durable-outbox was built without PostgreSQL support: \
         build it with `--features cli,postgres`"
            .into(),
    )))
}
