//! A tokio bot delivering through the outbox to a chat platform over real HTTP.
//!
//! `cargo run --example telegram_like --features tokio`
//!
//! A loopback server plays a Telegram-like Bot API (see
//! `tests/support/fake_platform.rs`): it returns message ids, answers 429 with
//! `retry_after` when a chat is hammered, is too slow for one chat (the client
//! times out, so that message is ambiguous and never resent) and does not know
//! another (permanent failure). Then users reply, quoting the message ids, and the
//! bot finds which outbound message each reply answers.

#[path = "../tests/support/bot_client.rs"]
mod bot_client;
#[path = "../tests/support/fake_platform.rs"]
mod fake_platform;

use std::time::Duration;

use durable_outbox::{ItemState, NewMessage, Outbox};

use bot_client::BotClient;
use fake_platform::{Behaviour, FakePlatform};

fn message(key: &str, chat: &str, text: &str) -> NewMessage {
    NewMessage {
        idempotency_key: key.into(),
        connector: "telegram".into(),
        grant_id: "demo-bot".into(),
        destination: chat.into(),
        content: text.into(),
        ..Default::default()
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let platform = FakePlatform::start(Behaviour::default()).await?;
    let client = BotClient::new(&platform.url(), Duration::from_millis(500))?;
    let dir = tempfile::tempdir()?;
    // Looser than the platform's 1 message/s per chat, so a 429 shows up.
    let outbox = Outbox::builder(dir.path())
        .rate_limit(2, Duration::from_secs(1))
        .open()?;
    println!(
        "platform at {}, outbox at {}",
        platform.url(),
        dir.path().display()
    );

    for (key, chat, text) in [
        ("welcome-alice", "chat-alice", "Welcome, Alice!"),
        ("order-alice", "chat-alice", "Your order #17 shipped."),
        ("survey-alice", "chat-alice", "How did we do?"),
        ("welcome-bob", "chat-bob", "Welcome, Bob!"),
        ("order-bob", "chat-bob", "Your order #18 shipped."),
        ("welcome-carol", "slow-carol", "Welcome, Carol!"),
        ("welcome-dave", "gone-dave", "Welcome, Dave!"),
    ] {
        outbox.enqueue(message(key, chat, text))?;
    }

    let mut round = 0;
    loop {
        round += 1;
        let send_client = client.clone();
        let report = outbox
            .process_due_async(4, move |item| {
                let client = send_client.clone();
                async move { client.send(item).await }
            })
            .await?;
        println!(
            "\nround {round}: {} sent, {} failed, {} deferred, {} retried",
            report.sent, report.failed, report.deferred, report.retried
        );
        for r in &report.receipts {
            println!(
                "  {:<14} {:<9} attempts={} {}",
                r.idempotency_key,
                r.outcome.as_str(),
                r.attempts,
                r.transport_ref
                    .as_ref()
                    .map(|id| format!("message_id={id}"))
                    .or_else(|| r.error_code.clone())
                    .unwrap_or_default()
            );
        }
        let queued: Vec<_> = outbox
            .list_items()?
            .into_iter()
            .filter(|i| i.state() == ItemState::Queued)
            .collect();
        let Some(next) = queued
            .iter()
            .filter_map(durable_outbox::OutboxItem::next_attempt_at)
            .min()
        else {
            break;
        };
        let wait = (next - chrono::Utc::now()).to_std().unwrap_or_default();
        tokio::time::sleep(wait + Duration::from_millis(20)).await;
    }

    println!("\nreplies arrive, quoting the messages they answer:");
    for reply in client.replies().await? {
        match outbox.find_by_transport_ref(&reply.quotes)? {
            Some(item) => println!(
                "  {:?} in {} answers {}",
                reply.text,
                reply.chat_id,
                item.idempotency_key()
            ),
            // The platform delivered it, but our request timed out first: the
            // outbox recorded it as ambiguous, with no message id to match.
            None => println!(
                "  {:?} in {} answers a message whose delivery we could not confirm",
                reply.text, reply.chat_id
            ),
        }
    }

    let requests = platform.requests();
    println!("\nthe platform's view:");
    println!("  deliveries: {}", platform.deliveries().len());
    println!("  429 answers: {}", platform.rate_limited());
    println!(
        "  requests ignoring a Retry-After: {}",
        platform.violations().len()
    );
    println!(
        "  requests to slow-carol: {} (timed out once, never resent)",
        requests.get("slow-carol").copied().unwrap_or(0)
    );
    let report = outbox.verify_audit()?;
    println!("  audit chain verified: {} records", report.records);
    Ok(())
}
