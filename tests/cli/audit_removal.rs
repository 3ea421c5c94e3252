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
    let before: Vec<(u64, String)> = outbox
        .audit_records()
        .unwrap()
        .map(|record| {
            let record = record.unwrap();
            (record.seq, record.hash)
        })
        .collect();
    assert!(
        outbox
            .remove_old_audit_segments(1, "ops", "older than a year")
            .unwrap()
            >= 1
    );
    let head = outbox.verify_audit().unwrap();
    let first = outbox.audit_records().unwrap().next().unwrap().unwrap().seq;
    drop(outbox);
    // The last removed record: the chain's start links to its hash, and the
    // removal's record names it, so a head an operator recorded exactly
    // there is still proven; one before it is not.
    let (anchor, anchor_hash) = before[usize::try_from(first).unwrap() - 2].clone();
    assert!(anchor > 1, "records before the anchor were removed");
    cli([
        "verify",
        location,
        "--expect-head",
        &format!("{anchor}:{anchor_hash}"),
    ])
    .exits(0)
    .says(&format!("the log holds the expected head, seq {anchor}"))
    .says("verified");
    cli([
        "verify",
        location,
        "--expect-head",
        &format!("{anchor}:{}", "0".repeat(64)),
    ])
    .exits(1)
    .says("the log was rewritten");
    let (older, older_hash) = &before[usize::try_from(anchor).unwrap() - 2];
    cli([
        "verify",
        location,
        "--expect-head",
        &format!("{older}:{older_hash}"),
    ])
    .exits(1)
    .says("no longer in the log");

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
