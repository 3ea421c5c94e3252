//! After an operator removed old audit history (`remove_old_audit_segments`),
//! the tool still verifies the outbox (the removal's own record and the items
//! whose records went are expected, not problems) and its export verifies
//! offline, in a directory and through a `postgres://` URL alike.

use durable_outbox::{AuditLog, OutboxBuilder};

use crate::harness::{cli, in_three_sealed_segments};

/// Three segments of records (four items, each queued and sent), the oldest
/// two removed; then `verify` and `export --audit` on `location`.
fn a_pruned_outbox_verifies_with_the_tool(location: &str, builder: OutboxBuilder) {
    let outbox = in_three_sealed_segments(builder);
    assert!(
        outbox
            .remove_old_audit_segments(1, "ops", "older than a year")
            .unwrap()
            >= 1
    );
    let head = outbox.verify_audit().unwrap();
    drop(outbox);

    cli(["verify", location])
        .exits(0)
        .says("verified")
        .says("have no record in the chain: their records were in the old audit history");
    let export = cli(["export", location, "--audit"]).exits(0).stdout.clone();
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), export).unwrap();
    assert_eq!(AuditLog::verify(file.path()).unwrap(), head, "offline");
}

#[test]
fn a_pruned_directory_verifies_with_the_tool() {
    let dir = tempfile::tempdir().unwrap();
    a_pruned_outbox_verifies_with_the_tool(
        dir.path().to_str().unwrap(),
        durable_outbox::Outbox::builder(dir.path()),
    );
}

#[cfg(feature = "postgres")]
#[test]
fn a_pruned_postgres_outbox_verifies_with_the_tool() {
    let Some(server) = crate::pg_server::PgServer::shared() else {
        return;
    };
    let db = server.database();
    let url = db.url();
    a_pruned_outbox_verifies_with_the_tool(&url, durable_outbox::Outbox::postgres(&url));
}
