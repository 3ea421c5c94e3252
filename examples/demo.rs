//! A bot-like walk-through of the outbox: deliver, retry, hit a rate cap and
//! leave once it frees, fail ambiguously and permanently, then correlate a
//! reply and verify the audit log.
//!
//! Run it with `cargo run --example demo`. Give it a directory to keep the
//! files for the operator tool: `cargo run --example demo -- ./demo-outbox`,
//! then `durable-outbox status ./demo-outbox`.

use std::cell::RefCell;
use std::collections::HashMap;
use std::time::Duration;

use durable_outbox::{DeliveryReceipt, NewMessage, Outbox, OutboxItem, SendError};

/// The demo's per-chat cap: two messages per window.
const WINDOW: Duration = Duration::from_secs(3);

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

fn show(outbox: &Outbox, receipt: &DeliveryReceipt) {
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
    // The stored failure class says whether a failed message may have arrived.
    let class = outbox
        .get(&receipt.idempotency_key)
        .ok()
        .flatten()
        .and_then(|item| item.failure_class());
    let detail = match class {
        Some(class) if class.may_have_been_delivered() => {
            format!("{detail} (may have been delivered: never resent automatically)")
        }
        Some(class) if receipt.outcome == durable_outbox::Outcome::Failed => {
            format!("{detail} ({class}: certainly not delivered)")
        }
        _ => detail,
    };
    println!(
        "  {:<10} -> {:<9} attempts={} {detail}",
        receipt.idempotency_key,
        receipt.outcome.as_str(),
        receipt.attempts
    );
}

/// Step 4: a rate-capped item waits for its slot, then leaves.
fn deferred_item_leaves(
    outbox: &Outbox,
    platform: &RefCell<FakePlatform>,
) -> Result<(), Box<dyn std::error::Error>> {
    println!("\n4. the deferred item leaves once the rate window has room");
    let promo = outbox.get("promo")?.ok_or("promo is missing")?;
    if let Some(at) = promo.next_attempt_at() {
        let wait = (at - durable_outbox::Utc::now())
            .to_std()
            .unwrap_or_default();
        println!("  promo      waits {} ms for a free slot", wait.as_millis());
        std::thread::sleep(wait);
    }
    let report = outbox.process_due(|item| platform.borrow_mut().send(item))?;
    for receipt in &report.receipts {
        show(outbox, receipt);
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Given a directory, the files stay there for the operator tool; without
    // one they live in a temporary directory removed at the end.
    let temp;
    let (dir, kept) = if let Some(dir) = std::env::args().nth(1) {
        (std::path::PathBuf::from(dir), true)
    } else {
        temp = tempfile::tempdir()?;
        (temp.path().to_path_buf(), false)
    };
    // Two messages per chat per 3 s, short backoff so the demo is quick.
    let outbox = Outbox::builder(&dir)
        .rate_limit(2, WINDOW)
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
            "A third message to chat-1 within 3 s: over the cap.",
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
        show(&outbox, &receipt);
    }

    println!("\n3. process again: terminal items are never resent");
    for key in ["welcome", "timeout"] {
        let receipt = outbox.process(key, |_| unreachable!("a terminal item reached send"))?;
        show(&outbox, &receipt);
    }

    deferred_item_leaves(&outbox, &platform)?;

    println!("\n5. a reply arrives quoting the message it answers");
    let order = outbox.get("order-17")?.ok_or("order-17 is missing")?;
    let reply_to = order
        .transport_ref()
        .ok_or("order-17 has no transport ref")?
        .to_owned();
    // Telegram numbers messages per chat: look the id up in the reply's chat.
    let original = outbox
        .find_by_transport_ref_in("chat-1", &reply_to)?
        .ok_or("reply not correlated")?;
    println!(
        "  reply_to={reply_to} answers {:?} sent to {}",
        original.idempotency_key(),
        original.destination()
    );

    println!("\n6. the audit log proves what happened");
    for record in outbox.history("timeout")? {
        println!(
            "  seq={:<3} {:<8} key={} error_code={} class={}",
            record.seq,
            record.outcome.as_str(),
            record.idempotency_key,
            record.error_code.as_deref().unwrap_or("-"),
            record.failure_class.map_or("-", |c| c.as_str())
        );
    }
    let report = outbox.verify_audit()?;
    println!(
        "  chain verified: {} records, head {}…",
        report.records,
        &report.head_hash[..16]
    );
    if kept {
        println!(
            "\nthe files are kept in {0}: try `durable-outbox status {0}`",
            dir.display()
        );
    } else {
        println!(
            "\n(the files were in a temporary directory, now removed; pass a path to keep them)"
        );
    }
    Ok(())
}
