//! A reply is matched to the message it answers within its own chat: Telegram
//! and Slack number messages per chat, so the same id names a message in every chat.
//!
//! Bodies in `on_both_engines!` run on the file engine and on PostgreSQL
//! (`name::file`, `name::postgres`). File-only here: the `#[test]` reads
//! history segment files written by an older release.

use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::engines::on_both_engines;
use crate::harness::{Harness, secs, uncapped};

/// Items `a` → chat-1 and `b` → chat-2, both delivered as platform message "7",
/// and `c` → chat-1 as "8", all at one instant (so `h` must be `uncapped`).
fn two_chats(h: &Harness) {
    for (key, chat, id) in [
        ("a", "chat-1", "7"),
        ("b", "chat-2", "7"),
        ("c", "chat-1", "8"),
    ] {
        h.enqueue(key, chat);
        let sent = h.outbox.process(key, |_| Ok(Some(id.into()))).unwrap();
        assert_eq!(sent.outcome, durable_outbox::Outcome::Sent, "{key}");
    }
}

fn key_of(found: Option<durable_outbox::OutboxItem>) -> Option<String> {
    found.map(|i| i.idempotency_key().to_owned())
}

on_both_engines! {
    fn the_same_id_in_two_chats_finds_the_message_of_the_right_chat(engine) {
        let h = engine.harness_with(uncapped);
        two_chats(&h);
        let find = |chat: &str, id: &str| key_of(h.outbox.find_by_transport_ref_in(chat, id).unwrap());
        assert_eq!(find("chat-1", "7").as_deref(), Some("a"));
        assert_eq!(find("chat-2", "7").as_deref(), Some("b"));
        assert_eq!(find("chat-2", "8"), None, "chat-2 never had a message 8");
        assert_eq!(find("chat-3", "7"), None);
        assert_eq!(find("chat-1", "  "), None, "a blank id finds nothing");
        // Another handle (another process) sees the same.
        let other = h.reopen();
        assert_eq!(
            key_of(other.find_by_transport_ref_in("chat-2", "7").unwrap()).as_deref(),
            Some("b")
        );
    }

    fn scoped_lookups_reach_into_history(engine) {
        let h = engine.harness_with(|b| uncapped(b).history_after(Duration::ZERO));
        two_chats(&h);
        moved_to_history(&h);
        for outbox in [&h.outbox, &h.reopen()] {
            let find =
                |chat: &str, id: &str| key_of(outbox.find_by_transport_ref_in(chat, id).unwrap());
            assert_eq!(find("chat-1", "7").as_deref(), Some("a"));
            assert_eq!(find("chat-2", "7").as_deref(), Some("b"));
            assert_eq!(find("chat-1", "8").as_deref(), Some("c"));
            assert_eq!(find("chat-2", "8"), None);
        }
    }

    fn the_global_lookup_still_finds_a_globally_unique_id(engine) {
        let h = engine.harness();
        h.enqueue("m", "!room:example.org");
        h.outbox
            .process("m", |_| Ok(Some("$event-id-1:example.org".into())))
            .unwrap();
        assert_eq!(
            key_of(
                h.outbox
                    .find_by_transport_ref("$event-id-1:example.org")
                    .unwrap()
            )
            .as_deref(),
            Some("m")
        );
    }
}

fn moved_to_history(h: &Harness) {
    h.clock.advance(secs(3 * 86_400));
    h.settle_history();
    assert_eq!(h.outbox.history_len().unwrap(), 3, "all three moved");
    assert!(h.outbox.list_items().unwrap().is_empty());
}

/// Rewrites a version 3 history index as version 2 (no scoped table), the
/// format written before scoped lookups existed.
fn downgrade_index(path: &std::path::Path) {
    let bytes = std::fs::read(path).unwrap();
    assert!(
        bytes.starts_with(b"DOIX3\n"),
        "the current format is version 3"
    );
    let body = &bytes[..bytes.len() - 32];
    let word = |at: usize| u64::from_le_bytes(body[at..at + 8].try_into().unwrap());
    let (keys, refs, newest) = (word(6), word(14), word(30));
    let entries = &body[38..38 + usize::try_from((keys + refs) * 16).unwrap()];
    let mut old = b"DOIX2\n".to_vec();
    old.extend_from_slice(&keys.to_le_bytes());
    old.extend_from_slice(&refs.to_le_bytes());
    old.extend_from_slice(&newest.to_le_bytes());
    old.extend_from_slice(entries);
    let sum = Sha256::digest(&old);
    old.extend_from_slice(&sum);
    std::fs::write(path, old).unwrap();
}

#[test]
fn segments_written_before_scoped_lookups_still_answer_them() {
    let h = Harness::with(|b| uncapped(b).history_after(Duration::ZERO));
    two_chats(&h);
    moved_to_history(&h);
    downgrade_index(&h.path("history/seg-00000001.idx"));
    let reopened = h.reopen();
    let find = |chat: &str, id: &str| key_of(reopened.find_by_transport_ref_in(chat, id).unwrap());
    assert_eq!(find("chat-1", "7").as_deref(), Some("a"));
    assert_eq!(find("chat-2", "7").as_deref(), Some("b"));
    assert_eq!(find("chat-2", "8"), None);
    assert_eq!(
        key_of(reopened.get("c").unwrap()).as_deref(),
        Some("c"),
        "keys of a version 2 segment still resolve"
    );
}
