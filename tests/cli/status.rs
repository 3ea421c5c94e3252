//! `status`: counts, rate windows, failures and the audit head; exit 1 when an
//! operator is needed.

use durable_outbox::SendError;

use crate::harness::{Fixture, message};

#[test]
fn a_healthy_outbox_says_so_and_exits_0() {
    let f = Fixture::empty();
    f.outbox.enqueue(message("a", "chat-1")).unwrap();
    f.send("a", Ok(Some("tg-1".into())));
    f.outbox.enqueue(message("b", "chat-2")).unwrap();
    f.send("b", Err(SendError::permanent("chat_not_found")));
    f.run("status", &[]).exits(0).says("health   ok");
    assert_eq!(
        f.run("status", &["--json"]).exits(0).json()["healthy"],
        true
    );
}

/// The demo holds `timeout-1`, failed as `read_timeout` with the ambiguous
/// class: it may have been delivered, so the outbox is not healthy.
#[test]
fn the_demo_outbox_is_summarised_and_exits_1_for_its_ambiguous_item() {
    let f = Fixture::demo();
    let status = f.run("status", &["--json"]).exits(1).json();
    assert_eq!(status["healthy"], false);
    let items = &status["items"];
    assert_eq!(
        [
            &items["total"],
            &items["queued"],
            &items["due"],
            &items["waiting"],
            &items["in_flight"],
            &items["sent"],
            &items["failed"]
        ],
        [6, 2, 1, 1, 0, 2, 2]
    );
    assert_eq!(status["oldest_queued"]["idempotency_key"], "queued-1");
    let codes: Vec<(&str, u64, bool)> = status["failed_by_error_code"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["error_code"].as_str().unwrap(),
                f["items"].as_u64().unwrap(),
                f["ambiguous"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        codes,
        [("chat_not_found", 1, false), ("read_timeout", 1, true)]
    );
    let head = f.outbox.audit_head().unwrap();
    assert_eq!(status["audit"]["head_seq"], head.seq);
    assert_eq!(status["audit"]["head_hash"], head.hash);
    assert_eq!(status["audit"]["verified"], true);
}

#[test]
fn the_text_report_names_what_an_operator_asks_about() {
    let f = Fixture::demo();
    f.run("status", &[])
        .exits(1)
        .says("health   NEEDS ATTENTION")
        .says("1 failed item(s) may have been delivered")
        .says("6 total: 2 queued (0 in flight, 1 due now, 1 waiting), 2 sent, 2 failed")
        .says("oldest queued  queued-1")
        .says("chat_not_found")
        .says("chain verified");
}

#[test]
fn sends_per_destination_are_compared_with_the_cap() {
    let f = Fixture::demo();
    let status = f
        .run("status", &["--json", "--rate-limit", "2/60"])
        .exits(1)
        .json();
    let window = &status["rate_window"];
    assert_eq!(
        (&window["cap"], &window["window_seconds"], &window["source"]),
        (&2.into(), &60.0.into(), &"what_if".into())
    );
    let chat1 = window["destinations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["destination"] == "chat-1")
        .expect("chat-1 sent twice");
    assert_eq!(chat1["sends_in_window"], 2);
    assert!(chat1["next_free_slot_utc"].is_string(), "{chat1}");
    // later-1's HTTP 429 asked for an hour's pause on chat-3.
    let chat3 = window["destinations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["destination"] == "chat-3")
        .expect("chat-3 has a queued item");
    assert!(chat3["cooldown_until_utc"].is_string(), "{chat3}");
    // With the stored cap (the fixture bot's, 10 a minute) the window is not full.
    // (Exit 1: the demo's ambiguous timeout-1 needs an operator.)
    f.run("status", &[])
        .exits(1)
        .says("chat-1       2/10 per 60s")
        .says("stored in the outbox");
}

#[test]
fn the_caps_the_bot_stored_are_shown_without_flags() {
    let dir = tempfile::tempdir().unwrap();
    let bot = durable_outbox::Outbox::builder(dir.path())
        .rate_limit(1, std::time::Duration::from_secs(3 * 86_400))
        .rate_limit_for("-*", 20, std::time::Duration::from_secs(60))
        .global_rate_limit(30, std::time::Duration::from_secs(1))
        .max_attempts(5)
        .open()
        .unwrap();
    for (key, chat) in [
        ("a", "chat-1"),
        ("b", "chat-1"),
        ("g", "-100"),
        ("t", "chat-2"),
    ] {
        bot.enqueue(crate::harness::message(key, chat)).unwrap();
    }
    bot.process("a", |_| Ok(None)).unwrap();
    bot.process("g", |_| Ok(None)).unwrap();
    // A send that may have left counts like one.
    bot.process("t", |_| {
        Err(durable_outbox::SendError::ambiguous("read_timeout"))
    })
    .unwrap();
    let dir_arg = dir.path().to_str().unwrap();
    let status = crate::harness::cli(["status", dir_arg, "--json"]).json();
    let window = &status["rate_window"];
    assert_eq!(window["source"], "stored");
    assert_eq!(
        (&window["cap"], &window["window_seconds"]),
        (&1.into(), &259_200.0.into())
    );
    assert_eq!(window["overrides"][0]["pattern"], "-*");
    assert_eq!(window["global"]["count"], 30);
    assert_eq!(status["settings"]["max_attempts"], 5);
    let row = |chat: &str| {
        window["destinations"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["destination"] == chat)
            .unwrap_or_else(|| panic!("{chat} in {window}"))
            .clone()
    };
    let chat1 = row("chat-1");
    assert_eq!(
        (&chat1["sends_in_window"], &chat1["cap"]),
        (&1.into(), &1.into())
    );
    assert!(chat1["next_free_slot_utc"].is_string(), "{chat1}");
    let group = row("-100");
    assert_eq!(
        (&group["sends_in_window"], &group["cap"]),
        (&1.into(), &20.into())
    );
    assert_eq!(
        row("chat-2")["sends_in_window"],
        1,
        "the ambiguous send counts"
    );
    // Exit 1: `t` may have been delivered and waits for an operator.
    crate::harness::cli(["status", dir_arg])
        .exits(1)
        .says("1 sends per 259200s per destination, stored in the outbox")
        .says("destinations matching -*: 20 sends per 60s")
        .says("across all destinations: 30 sends per 1s");
    // --rate-limit is a what-if view over the same sends.
    let what_if = crate::harness::cli(["status", dir_arg, "--json", "--rate-limit", "5/60"]).json();
    assert_eq!(what_if["rate_window"]["source"], "what_if");
}

/// The bot's own ambiguous code needs no `--ambiguous-code`: the stored class says it.
#[test]
fn an_ambiguous_failure_needs_attention_from_its_stored_class() {
    let f = Fixture::empty();
    f.outbox.enqueue(message("m", "chat-1")).unwrap();
    f.send(
        "m",
        Err(SendError::ambiguous("connection_reset_after_write")),
    );
    f.run("status", &[])
        .exits(1)
        .says("NEEDS ATTENTION")
        .says("1 failed item(s) may have been delivered")
        .says("connection_reset_after_write  1      ambiguous: may have been delivered");
    let status = f.run("status", &["--json"]).exits(1).json();
    assert_eq!(status["healthy"], false);
    assert_eq!(status["failed_by_error_code"][0]["ambiguous_items"], 1);
    f.run("list", &["--state", "failed"])
        .exits(0)
        .says("connection_reset_after_write (may have been delivered)");
    f.run("show", &["m"])
        .exits(0)
        .says("failure class  ambiguous (may have been delivered)");
}

/// A permanent failure whose code the operator also passed as ambiguous is
/// read by its stored class: `--ambiguous-code` is only for pre-class items.
#[test]
fn the_stored_class_wins_over_ambiguous_code() {
    let f = Fixture::empty();
    f.outbox.enqueue(message("m", "chat-1")).unwrap();
    f.send("m", Err(SendError::permanent("chat_not_found")));
    f.run("status", &["--ambiguous-code", "chat_not_found"])
        .exits(0)
        .says("health   ok");
}

#[test]
fn a_broken_audit_chain_needs_attention() {
    let f = Fixture::demo();
    crate::verify::flip_a_byte_in_line(&f, 3);
    f.run("status", &[])
        .exits(1)
        .says("NEEDS ATTENTION")
        .says("line 3")
        .says("chain BROKEN");
}

#[test]
fn an_audited_settings_change_verifies_as_part_of_the_chain() {
    let f = Fixture::demo();
    durable_outbox::Outbox::builder(f.path())
        .rate_limit(3, std::time::Duration::from_secs(60))
        .update_settings()
        .open()
        .unwrap();
    let dir = f.path().to_str().unwrap();
    crate::harness::cli(["verify", dir]).exits(0);
    // Exit 1: the demo's ambiguous timeout-1 needs an operator.
    crate::harness::cli(["status", dir])
        .exits(1)
        .says("3 sends per 60s per destination, stored in the outbox");
}

#[test]
fn an_outbox_that_stores_no_cap_says_it_shows_the_library_default() {
    let dir = tempfile::tempdir().unwrap();
    let seed = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/seed-v1/outbox.json");
    std::fs::copy(seed, dir.path().join("outbox.json")).unwrap();
    let dir_arg = dir.path().to_str().unwrap();
    let status = crate::harness::cli(["status", dir_arg, "--json"]).json();
    assert_eq!(status["rate_window"]["source"], "default");
    assert_eq!(status["settings"]["stored"], serde_json::json!([]));
    crate::harness::cli(["status", dir_arg]).says("library default; the outbox stores no cap");
    // Looking stores nothing.
    let again = crate::harness::cli(["status", dir_arg, "--json"]).json();
    assert_eq!(again["settings"]["stored"], serde_json::json!([]));
}

/// A power cut left garbage past the audit log's durable point: the next open
/// sets it aside and rebuilds, and `status` tells the operator where it went.
#[test]
fn files_recovery_set_aside_are_listed() {
    let f = Fixture::empty();
    f.outbox.enqueue(message("a", "chat-1")).unwrap();
    f.run("status", &[]).exits(0);
    let status = f.run("status", &["--json"]).exits(0).json();
    assert_eq!(status["set_aside"], serde_json::json!([]));
    // An unsynced append that reached the disk torn: zeros, then a fragment.
    let mut audit = std::fs::OpenOptions::new()
        .append(true)
        .open(f.path().join("audit.jsonl"))
        .unwrap();
    std::io::Write::write_all(&mut audit, b"\0\0\0\0{\"seq\":99,\"tor").unwrap();
    drop(audit);
    let run = f.run("status", &[]);
    run.exits(0).says("set aside 1 file(s)");
    let status = f.run("status", &["--json"]).exits(0).json();
    let names = status["set_aside"].as_array().unwrap();
    assert_eq!(names.len(), 1);
    assert!(
        names[0].as_str().unwrap().starts_with("audit.jsonl.torn-"),
        "{names:?}"
    );
}
