//! `find`: which item a reply answers, within the chat it came from.

use crate::harness::{Fixture, message};

/// Two chats whose platform numbers messages per chat: both got message "7".
fn two_chats() -> Fixture {
    let f = Fixture::empty();
    for (key, chat) in [("to-alice", "chat-1"), ("to-bob", "chat-2")] {
        f.outbox.enqueue(message(key, chat)).unwrap();
        f.send(key, Ok(Some("7".into())));
    }
    f
}

#[test]
fn find_takes_the_reference_positionally_and_scopes_it_to_a_destination() {
    let f = two_chats();
    f.run("find", &["7", "--destination", "chat-2"])
        .exits(0)
        .says("to-bob");
    f.run("find", &["7", "--destination", "chat-1"])
        .exits(0)
        .says("to-alice");
    let found = f
        .run(
            "find",
            &["--transport-ref", "7", "--destination", "chat-2", "--json"],
        )
        .exits(0)
        .json();
    assert_eq!(found["item"]["idempotency_key"], "to-bob");
    f.run("find", &["7", "--destination", "chat-3"])
        .exits(1)
        .complains("no outbox item has transport ref \"7\" in destination \"chat-3\"");
}

#[test]
fn find_needs_a_reference_and_only_one() {
    let f = two_chats();
    f.run("find", &[]).exits(2);
    f.run("find", &["7", "--transport-ref", "7"]).exits(2);
}
