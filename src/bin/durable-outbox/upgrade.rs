//! `upgrade-schema URL`: migrate a PostgreSQL outbox's tables to this
//! release's schema version. The only command that does: every other one
//! opens with `upgrade_schema(false)` and refuses an older version (see
//! `postgres_builder`), because the bots of the older release running on the
//! outbox would refuse the migrated tables at their next start.

use std::io::Write;
use std::process::ExitCode;

use durable_outbox::{Error, OutboxBuilder};

use crate::args::UpgradeSchemaArgs;
use crate::{CliResult, Place, UsageError};

/// What the operator reads under the refusal of an outbox at an older
/// schema version (after the library's message).
pub const HINT: &str = "\n\n\
The tool does not migrate a schema as it looks: bots of the older release go on \
running on migrated tables, but each refuses them at its next start. When you \
upgrade the bots, run `durable-outbox upgrade-schema URL` (with the same --schema), \
or start an upgraded bot: its open migrates.";

/// Migrates the outbox at `args.url` if its tables are older than this
/// release's, and says what it did.
///
/// # Errors
///
/// [`UsageError`] for a directory; the library's open errors (a schema
/// holding no outbox, or a newer one, is refused as by the other commands).
pub fn run(args: &UpgradeSchemaArgs, out: &mut dyn Write) -> CliResult {
    let target = args.target();
    if let Place::Dir(_) = crate::place(&target) {
        return Err(Box::new(UsageError(
            "upgrade-schema takes a postgres:// or postgresql:// URL: \
             a directory has no schema to upgrade"
                .into(),
        )));
    }
    let label = crate::target_label(&target);
    // Looking first, as every command does, tells whether there is anything
    // to do and from which version.
    match crate::builder(&target)?.open() {
        Ok(_) => {
            writeln!(
                out,
                "{label}: the outbox is at this release's schema version already; nothing was changed"
            )?;
        }
        Err(Error::SchemaUpgradeNeeded {
            schema,
            found,
            known,
        }) => {
            drop(upgrading(crate::builder(&target)?).open()?);
            writeln!(
                out,
                "{label}: upgraded schema {schema:?} from outbox schema version {found} to {known}"
            )?;
            writeln!(
                out,
                "bots of the older release still running go on; each refuses the schema at its \
                 next start: restart them with this release"
            )?;
        }
        Err(e) => return Err(Box::new(e)),
    }
    Ok(ExitCode::SUCCESS)
}

/// The tool's handle, allowed to migrate the tables.
#[cfg(feature = "postgres")]
fn upgrading(builder: OutboxBuilder) -> OutboxBuilder {
    builder.upgrade_schema(true)
}

/// Without PostgreSQL support `crate::builder` refuses every URL before this.
#[cfg(not(feature = "postgres"))]
fn upgrading(builder: OutboxBuilder) -> OutboxBuilder {
    builder
}
