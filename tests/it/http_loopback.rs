//! The whole path over real HTTP on 127.0.0.1: a tokio bot, a real HTTP client,
//! a Telegram-like platform that rate-limits, times out and rejects. The
//! platform's own log is the truth.
//!
//! On both engines (`on_both_engines!`: `name::file`, `name::postgres`), on
//! the system clock.

#[path = "../support/bot_client.rs"]
mod bot_client;
#[path = "../support/fake_platform.rs"]
mod fake_platform;

use std::collections::HashSet;
use std::time::Duration;

use durable_outbox::ItemState;

use bot_client::BotClient;
use fake_platform::{Behaviour, FakePlatform};

use crate::engines::on_both_engines;
use crate::harness::msg;

on_both_engines! {
    #[allow(clippy::too_many_lines, reason = "one scenario, told in order")]
    fn a_tokio_bot_delivers_at_most_once_honours_429s_and_correlates_replies(engine) {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let platform = FakePlatform::start(Behaviour {
                min_gap: Duration::from_millis(600),
                retry_after_secs: 1,
                slow_for: Duration::from_millis(800),
            })
            .await
            .unwrap();
            let client = BotClient::new(&platform.url(), Duration::from_millis(300)).unwrap();
            // Looser than the platform (two sends a second per chat where it takes one
            // per 600 ms), so it answers 429 and the outbox must obey. Two, not three:
            // a third concurrent request could already be on the wire when the 429
            // comes back, which no client can prevent.
            let outbox = engine.open_real_clock_with(|b| b.rate_limit(2, Duration::from_secs(1)));
            let chats = [
                "chat-a", "chat-a", "chat-a", "chat-b", "chat-b", "slow-c", "gone-d",
            ];
            for (i, chat) in chats.iter().enumerate() {
                outbox.enqueue(msg(&format!("k{i}"), chat)).unwrap();
            }

            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            loop {
                let send_client = client.clone();
                outbox
                    .process_due_async(4, move |item| {
                        let client = send_client.clone();
                        async move { client.send(item).await }
                    })
                    .await
                    .unwrap();
                let items = outbox.list_items().unwrap();
                let Some(next) = items
                    .iter()
                    .filter(|i| i.state() == ItemState::Queued)
                    .filter_map(durable_outbox::OutboxItem::next_attempt_at)
                    .min()
                else {
                    break;
                };
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the drain did not finish: {items:?}"
                );
                let wait = (next - chrono::Utc::now()).to_std().unwrap_or_default();
                tokio::time::sleep(wait + Duration::from_millis(20)).await;
            }

            // At most once: the platform accepted each message exactly once or not at all.
            let deliveries = platform.deliveries();
            let texts: Vec<_> = deliveries.iter().map(|d| d.text.clone()).collect();
            let unique: HashSet<_> = texts.iter().collect();
            assert_eq!(
                unique.len(),
                texts.len(),
                "a message was delivered twice: {texts:?}"
            );
            assert_eq!(
                deliveries.len(),
                6,
                "everything but the unknown chat arrived: {texts:?}"
            );
            // 429s were provoked and honoured: no request inside a Retry-After.
            assert!(
                platform.rate_limited() >= 1,
                "the scenario should provoke a 429"
            );
            assert_eq!(platform.violations(), Vec::<String>::new());
            // The timeout after the request was written: ambiguous, never resent.
            assert_eq!(platform.requests().get("slow-c"), Some(&1));
            let slow = outbox.get("k5").unwrap().unwrap();
            assert_eq!(
                (slow.state(), slow.error_code()),
                (ItemState::Failed, Some("timeout_after_request_sent"))
            );
            let gone = outbox.get("k6").unwrap().unwrap();
            assert_eq!(
                (gone.state(), gone.error_code()),
                (ItemState::Failed, Some("Bad Request: chat not found"))
            );
            let sent = outbox
                .list_items()
                .unwrap()
                .iter()
                .filter(|i| i.state() == ItemState::Sent)
                .count();
            assert_eq!(sent, 5);

            // Replies quote message ids; every confirmed delivery correlates.
            let mut correlated = 0;
            for reply in client.replies().await.unwrap() {
                match outbox.find_by_transport_ref(&reply.quotes).unwrap() {
                    Some(item) => {
                        assert_eq!(item.destination(), reply.chat_id);
                        correlated += 1;
                    }
                    None => assert_eq!(
                        reply.chat_id, "slow-c",
                        "only the unconfirmed delivery is unknown"
                    ),
                }
            }
            assert_eq!(correlated, 5);
            outbox.verify_audit().unwrap();
        });
    }
}
