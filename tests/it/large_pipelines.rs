//! A transaction of many statements on PostgreSQL never waits on itself. A
//! pipeline goes out before its answers are read; had it gone out whole, a
//! pipeline whose answers outgrow what the connection buffers (a Unix socket
//! holds about 200 KiB in flight, and no more) would leave the client
//! blocked writing and the server blocked answering, for ever.
//! `enqueue_many` of thousands of messages (one write per item, in one
//! transaction) is such a pipeline.

use durable_outbox::{NewMessage, Outbox};

use crate::harness::{DEADLOCK_LIMIT, msg, within};

/// Messages in one `enqueue_many`: the server's answers to the item writes
/// (one each, about 20 bytes) outgrow a Unix socket's buffer twice over.
const MANY: usize = 20_000;

/// A URL for `db` over the server's Unix socket.
fn unix_url(db: &crate::pg_server::PgDatabase<'_>) -> String {
    let dir = db.server().data_dir().parent().unwrap().to_owned();
    format!(
        "host={} port={} user=postgres dbname={}",
        dir.display(),
        db.server().port(),
        db.name()
    )
}

#[test]
fn an_enqueue_many_of_thousands_of_messages_commits_and_never_hangs() {
    let Some(server) = crate::pg_server::PgServer::shared() else {
        return;
    };
    let db = server.database();
    let outbox = Outbox::postgres(&unix_url(&db)).open().unwrap();
    let messages: Vec<NewMessage> = (0..MANY)
        .map(|i| NewMessage {
            content: format!("body {i}: {}", "x".repeat(200)),
            ..msg(&format!("bulk-{i:05}"), &format!("chat-{}", i % 50))
        })
        .collect();
    let items = within(
        "large pipelines: an enqueue_many of thousands of messages returns",
        DEADLOCK_LIMIT * 4,
        || outbox.enqueue_many(messages).unwrap(),
    );
    assert_eq!(items.len(), MANY);
    let listed = outbox.list_items().unwrap();
    assert_eq!(listed.len(), MANY, "every message committed");
    assert_eq!(listed[0].idempotency_key(), "bulk-00000");
    assert_eq!(
        listed[MANY - 1].idempotency_key(),
        format!("bulk-{:05}", MANY - 1)
    );
}
