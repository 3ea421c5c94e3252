//! A bot-like walk-through of the outbox: deliver, retry, hit a rate cap, fail
//! ambiguously and permanently, then correlate a reply and verify the audit log.
//!
//! Run it with `cargo run --example demo` (add a directory to keep the files:
//! `cargo run --example demo -- ./demo-outbox`).

use std::cell::RefCell;
use std::collections::HashMap;
use std::time::Duration;

use durable_outbox::{DeliveryReceipt, NewMessage, Outbox, OutboxItem, SendError};

/// A stand-in for a chat platform's send call, with the failures real ones have.
struct FakePlatform {
    next_id: u64,
    calls: HashMap<String, u32>,
}

impl FakePlatform {
    fn send(&mut self, item: &OutboxItem) -> Result<Option<String>, SendError> {
        let calls = self
            .calls
            .entry(item.idempotency_key().to_owned())
            .or_default();
        *calls += 1;
        match item.destination() {
            // The first request hits a 503 before the platform processed it: safe to retry.
            "chat-flaky" if *calls == 1 => Err(SendError::retryable("http_503")),
            // The platform says the chat does not exist: retrying cannot help.
            "chat-gone" => Err(SendError::permanent("chat_not_found")),
            // The request was written, then the response timed out: it may have arrived.
            "chat-slow" => Err(SendError::ambiguous("read_timeout_after_write")),
            _ => {
                self.next_id += 1;
                Ok(Some(format!("msg-{}", self.next_id)))
            }
        }
    }
}

fn message(key: &str, destination: &str, content: &str) -> NewMessage {
    NewMessage {
        idempotency_key: key.into(),
        connector: "telegram".into(),
        grant_id: "demo-bot".into(),
        destination: destination.into(),
        content: content.into(),
        ..Default::default()
    }
}

fn show(receipt: &DeliveryReceipt) {
    let detail = match (
        &receipt.transport_ref,
        &receipt.error_code,
        receipt.next_attempt_at,
    ) {
        (Some(r), _, _) => format!("transport_ref={r}"),
        (_, Some(code), Some(at)) => format!(
            "error_code={code} next_attempt_at={} UTC",
            at.format("%H:%M:%S%.3f")
        ),
        (_, Some(code), None) => format!("error_code={code}"),
        _ => String::new(),
    };
    println!(
        "  {:<10} -> {:<9} attempts={} {detail}",
        receipt.idempotency_key,
        receipt.outcome.as_str(),
        receipt.attempts
    );
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let temp;
    let dir = if let Some(dir) = std::env::args().nth(1) {
        std::path::PathBuf::from(dir)
    } else {
        temp = tempfile::tempdir()?;
        temp.path().to_path_buf()
    };
    // Two messages per chat per minute, short backoff so the demo is quick.
    let outbox = Outbox::builder(&dir)
        .rate_limit(2, Duration::from_secs(60))
        .backoff(durable_outbox::Backoff::Fixed(vec![Duration::from_millis(
            100,
        )]))
        .open()?;
    println!("outbox at {}", dir.display());

    println!("\n1. enqueue (durable before each call returns)");
    let messages = [
        ("welcome", "chat-1", "Welcome aboard!"),
        ("order-17", "chat-1", "Your order #17 shipped."),
        (
            "promo",
            "chat-1",
            "A third message to chat-1 in a minute: over the cap.",
        ),
        ("retry-me", "chat-flaky", "Sent on the second try."),
        ("lost-chat", "chat-gone", "Nobody will read this."),
        ("timeout", "chat-slow", "Maybe delivered, maybe not."),
    ];
    for (key, destination, content) in messages {
        outbox.enqueue(message(key, destination, content))?;
        println!("  {key:<10} queued for {destination}");
    }
    let again = outbox.enqueue(message("welcome", "chat-1", "Welcome aboard!"))?;
    println!(
        "  welcome    enqueued again: same item, state={} (idempotent)",
        again.state()
    );

    println!("\n2. process each item (claim fsynced before send, lock never held during send)");
    let platform = RefCell::new(FakePlatform {
        next_id: 1000,
        calls: HashMap::new(),
    });
    for (key, _, _) in messages {
        let receipt = outbox.process(key, |item| platform.borrow_mut().send(item))?;
        show(&receipt);
    }

    println!("\n3. process again: terminal items are never resent");
    for key in ["welcome", "timeout"] {
        let receipt = outbox.process(key, |_| unreachable!("a terminal item reached send"))?;
        show(&receipt);
    }

    println!("\n4. a reply arrives quoting the message it answers");
    let order = outbox.get("order-17")?.ok_or("order-17 is missing")?;
    let reply_to = order
        .transport_ref()
        .ok_or("order-17 has no transport ref")?
        .to_owned();
    let original = outbox
        .find_by_transport_ref(&reply_to)?
        .ok_or("reply not correlated")?;
    println!(
        "  reply_to={reply_to} answers {:?} sent to {}",
        original.idempotency_key(),
        original.destination()
    );

    println!("\n5. the audit log proves what happened");
    for record in outbox.history("timeout")? {
        println!(
            "  seq={:<3} {:<8} key={} error_code={}",
            record.seq,
            record.outcome.as_str(),
            record.idempotency_key,
            record.error_code.as_deref().unwrap_or("-")
        );
    }
    let report = outbox.verify_audit()?;
    println!(
        "  chain verified: {} records, head {}…",
        report.records,
        &report.head_hash[..16]
    );
    Ok(())
}
