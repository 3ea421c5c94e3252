//! `verify` on a PostgreSQL outbox: problems name the record's seq in the
//! audit table (there is no `audit.jsonl` to count lines in).

use durable_outbox::Outbox;

use crate::harness::{cli, message};
use crate::pg_server::PgServer;

/// A bot's outbox with `n` queued items (one record each).
pub fn outbox_with(url: &str, n: usize) -> Outbox {
    let outbox = Outbox::postgres(url)
        .audit_rotate_bytes(4096)
        .open()
        .unwrap();
    let messages = (0..n)
        .map(|i| message(&format!("m-{i}"), "chat-1"))
        .collect();
    outbox.enqueue_many(messages).unwrap();
    outbox
}

#[test]
fn problems_name_the_records_seq_in_the_audit_table() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let url = db.url();
    drop(outbox_with(&url, 10));

    // An item the log names is gone from the table (the chain verifies).
    db.psql("DELETE FROM durable_outbox.items WHERE idempotency_key = 'm-3'");
    let run = cli(["verify", &url]);
    run.exits(1)
        .says("audit record seq 4: item \"m-3\": has records, but the outbox has no such item");
    assert!(!run.stdout.contains("audit.jsonl"), "{run:#?}");
    let report = cli(["verify", &url, "--json"]).exits(1).json();
    assert_eq!(report["first_bad_seq"], 4, "{report}");
    assert_eq!(
        report["first_bad_line"],
        serde_json::Value::Null,
        "{report}"
    );

    // A record edited in the table: the verifier's position is turned into
    // the record's seq.
    db.psql(
        "UPDATE durable_outbox.audit SET line = replace(line, '\"chat-1\"', '\"evil\"') \
         WHERE seq = 7",
    );
    let run = cli(["verify", &url]);
    run.exits(1)
        .says("audit record seq 7 (row 7 of the table): hash mismatch");
    assert!(!run.stdout.contains("line 7"), "{run:#?}");
    assert_eq!(
        cli(["verify", &url, "--json"]).exits(1).json()["first_bad_seq"],
        7
    );
}
