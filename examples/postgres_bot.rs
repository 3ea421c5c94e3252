//! A bot on two hosts sharing one outbox in PostgreSQL.
//!
//! ```sh
//! cargo run --example postgres_bot --features postgres,tokio -- postgres://bot@db.internal/bot [HOST]
//! ```
//!
//! Run it on as many hosts as you like against the same database: each host
//! enqueues its own greetings (keyed by `HOST`, default the machine's host
//! name; two copies on one machine need two names, or the second one's
//! greetings are the first one's again and enqueueing them is a no-op), and every host's worker delivers from the one
//! backlog, each message once, in order per chat, under one rate cap. A host
//! that dies mid-send leaves that message failed as ambiguous (never resent);
//! everything else goes on from the other hosts.

use std::time::Duration;

use durable_outbox::{NewMessage, Outbox, OutboxItem, SendError};

/// Stands in for the platform call (Telegram, Matrix, …): returns the
/// platform's message id, used to correlate replies.
async fn send_to_platform(item: OutboxItem) -> Result<Option<String>, SendError> {
    println!("-> {}: {}", item.destination(), item.content());
    Ok(Some(format!("msg-{}", item.idempotency_key())))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::args()
        .nth(1)
        .ok_or("usage: postgres_bot postgres://user@host/database [HOST]")?;
    // Part of every key this host enqueues. Not `$HOSTNAME`: shells set it
    // without exporting it, so every host would read the same fallback and
    // enqueue the same keys.
    let host = std::env::args()
        .nth(2)
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|name| name.trim().to_owned())
        })
        .unwrap_or_else(|| "this-host".into());
    println!("host {host}");

    // Every host opens the same outbox: same URL, same schema.
    let outbox = Outbox::postgres(&url)
        .schema("chat_bot")
        .rate_limit(1, Duration::from_secs(1)) // about 1 message/s per chat
        .open()?;

    for n in 0..3 {
        outbox.enqueue(NewMessage {
            idempotency_key: format!("{host}-greeting-{n}"),
            connector: "telegram".into(),
            grant_id: "bot-1".into(),
            destination: format!("chat-{n}"),
            content: format!("hello from {host}"),
            ..Default::default()
        })?;
    }

    // Delivers what any host enqueues (woken through LISTEN/NOTIFY) until
    // Ctrl-C or 10 seconds, whichever comes first; running sends finish.
    let report = outbox
        .worker(send_to_platform)
        .run(async {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                () = tokio::time::sleep(Duration::from_secs(10)) => {}
            }
        })
        .await?;
    println!("sent {}, failed {}", report.sent, report.failed);
    println!(
        "audit chain: {} records verified",
        outbox.verify_audit()?.records
    );
    Ok(())
}
