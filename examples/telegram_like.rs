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
//!
//! The bot runs the outbox's delivery worker and stops on Ctrl-C or SIGTERM
//! (finishing running sends, leaving unsent messages queued for the next start).

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

/// Completes on Ctrl-C or SIGTERM — what a bot waits for. So that the demo
/// ends by itself, it also completes once every message is settled (nothing
/// queued, nothing in flight).
async fn stop_signal(outbox: Outbox) {
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                term.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    let settled = async {
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let busy = outbox.list_items().map_or(true, |items| {
                items.iter().any(|i| i.state() == ItemState::Queued)
            });
            if !busy {
                return;
            }
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => println!("\nCtrl-C: stopping gracefully"),
        () = terminate => println!("\nSIGTERM: stopping gracefully"),
        () = settled => println!("\nevery message settled (a bot would keep running until a signal)"),
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

    // The delivery loop: it sleeps until a message is due (a retry, a rate
    // slot, a platform's Retry-After) or enqueued, never on a fixed tick, and
    // keeps each chat's messages in order. On Ctrl-C or SIGTERM it stops
    // claiming, gives running sends up to 10 s, and leaves the rest queued.
    let send_client = client.clone();
    let worker = outbox
        .worker(move |item| {
            let client = send_client.clone();
            async move { client.send(item).await }
        })
        .concurrency(4)
        .shutdown_timeout(Duration::from_secs(10));
    let report = worker.run(stop_signal(outbox.clone())).await?;
    println!(
        "\nworker stopped: {} sent, {} failed, {} deferred, {} retried, {} released, {} cancelled",
        report.sent,
        report.failed,
        report.deferred,
        report.retried,
        report.released,
        report.cancelled
    );
    for item in outbox.list_items()? {
        println!(
            "  {:<14} {:<7} attempts={} {}",
            item.idempotency_key(),
            item.state().as_str(),
            item.attempts(),
            item.transport_ref()
                .map(|id| format!("message_id={id}"))
                .or_else(|| item.error_code().map(str::to_owned))
                .unwrap_or_default()
        );
    }

    println!("\nreplies arrive, quoting the messages they answer:");
    for reply in client.replies().await? {
        // Telegram numbers messages per chat: look the quoted id up in the
        // chat the reply came from.
        match outbox.find_by_transport_ref_in(&reply.chat_id, &reply.quotes)? {
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
    let alice: Vec<String> = platform
        .deliveries()
        .into_iter()
        .filter(|d| d.chat_id == "chat-alice")
        .map(|d| d.text)
        .collect();
    println!("  chat-alice received, in order: {alice:?}");
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
