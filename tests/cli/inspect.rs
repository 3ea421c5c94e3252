//! `list`, `show` and `find`: what was sent to whom, without leaking bodies.

use durable_outbox::NewMessage;

use crate::harness::{Fixture, message};

/// The keys in a `list --json` answer, in order.
fn keys(f: &Fixture, args: &[&str]) -> Vec<String> {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    f.run("list", &all)
        .exits(0)
        .json()
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["idempotency_key"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn list_shows_a_table_without_bodies() {
    let f = Fixture::demo();
    let run = f.run("list", &[]);
    run.exits(0)
        .says("KEY")
        .says("STATE")
        .says("gone-1")
        .says("chat_not_found")
        .says("ref tg-2");
    assert!(!run.stdout.contains("body of"), "{}", run.stdout);
    f.run("list", &["--show-content"])
        .exits(0)
        .says("CONTENT")
        .says("body of gone-1");
    let json = f.run("list", &["--json"]).exits(0).json();
    assert!(json[0].get("content").is_none(), "{json}");
}

#[test]
fn list_filters_by_state_destination_and_time() {
    let f = Fixture::demo();
    let mut failed = keys(&f, &["--state", "failed"]);
    failed.sort();
    assert_eq!(failed, ["gone-1", "timeout-1"]);
    let mut chat1 = keys(&f, &["--destination", "chat-1"]);
    chat1.sort();
    assert_eq!(chat1, ["order-17", "welcome"]);
    assert_eq!(keys(&f, &["--since", "1h"]).len(), 6);
    assert!(keys(&f, &["--since", "2999-01-01T00:00:00Z"]).is_empty());
    f.run("list", &["--since", "2999-01-01T00:00:00Z"])
        .exits(0)
        .says("no matching items");
}

#[test]
fn list_limit_keeps_the_most_recent() {
    let f = Fixture::demo();
    f.send("queued-1", Ok(Some("tg-3".into())));
    assert_eq!(keys(&f, &["--limit", "1"]), ["queued-1"]);
    f.run("list", &["--limit", "2"])
        .exits(0)
        .says("(2 of 6 matching items shown)");
}

#[test]
fn show_prints_the_item_and_its_whole_history() {
    let f = Fixture::demo();
    f.run("show", &["later-1"])
        .exits(0)
        .says("state          queued")
        .says("error code     http_429")
        .says("retrying")
        .says("audit history (2 records)");
    let shown = f.run("show", &["welcome", "--json"]).exits(0).json();
    assert_eq!(shown["item"]["state"], "sent");
    assert_eq!(shown["item"]["transport_ref"], "tg-1");
    assert!(shown["item"].get("content").is_none());
    let outcomes: Vec<&str> = shown["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(outcomes, ["queued", "sent"]);
    f.run("show", &["welcome", "--show-content"])
        .exits(0)
        .says("body of welcome");
}

#[test]
fn show_of_an_unknown_key_exits_1() {
    let f = Fixture::demo();
    f.run("show", &["nope"])
        .exits(1)
        .complains("durable-outbox: no outbox item has idempotency key \"nope\"");
}

#[test]
fn find_correlates_a_reply_with_what_it_answers() {
    let f = Fixture::demo();
    f.run("find", &["--transport-ref", "tg-2"])
        .exits(0)
        .says("key            order-17")
        .says("destination    chat-1");
    let found = f
        .run("find", &["--transport-ref", "tg-1", "--json"])
        .exits(0)
        .json();
    assert_eq!(found["item"]["idempotency_key"], "welcome");
    f.run("find", &["--transport-ref", "tg-999"])
        .exits(1)
        .complains("no outbox item has transport ref \"tg-999\"");
}

#[test]
fn text_from_the_outbox_cannot_drive_the_terminal() {
    let f = Fixture::empty();
    f.outbox
        .enqueue(NewMessage {
            content: "\u{1b}[2Jcleared your screen".into(),
            ..message("k", "chat-1")
        })
        .unwrap();
    let run = f.run("list", &["--show-content"]);
    run.exits(0).says("\\u{1b}[2Jcleared your screen");
    assert!(!run.stdout.contains('\u{1b}'));
    let run = f.run("show", &["k", "--show-content"]);
    assert!(!run.exits(0).stdout.contains('\u{1b}'));
}
