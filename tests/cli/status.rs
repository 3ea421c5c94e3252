//! `status`: counts, rate windows, failures and the audit head; exit 1 when an
//! operator is needed.

use crate::harness::Fixture;

#[test]
fn a_healthy_outbox_is_summarised_and_exits_0() {
    let f = Fixture::demo();
    let status = f.run("status", &["--json"]).exits(0).json();
    assert_eq!(status["healthy"], true);
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
        [("chat_not_found", 1, false), ("read_timeout", 1, false)]
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
        .exits(0)
        .says("health   ok")
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
        .exits(0)
        .json();
    let window = &status["rate_window"];
    assert_eq!(
        (&window["cap"], &window["window_seconds"]),
        (&2.into(), &60.into())
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
    // With the default cap of 10 the window is not full.
    f.run("status", &[]).exits(0).says("chat-1       2/10");
}

#[test]
fn an_ambiguous_failure_needs_attention() {
    let f = Fixture::demo();
    let run = f.run("status", &["--ambiguous-code", "read_timeout"]);
    run.exits(1)
        .says("NEEDS ATTENTION")
        .says("1 failed item(s) may have been delivered");
    let status = f
        .run("status", &["--json", "--ambiguous-code", "read_timeout"])
        .exits(1)
        .json();
    assert_eq!(status["healthy"], false);
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
