//! Sent and failed items the library moved to history are still verified,
//! found, listed on request, exported and requeueable.

use durable_outbox::ItemState;

use crate::harness::Fixture;

fn keys(run: &crate::harness::Run) -> Vec<String> {
    let mut keys: Vec<String> = run
        .json()
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["idempotency_key"].as_str().unwrap().to_owned())
        .collect();
    keys.sort();
    keys
}

#[test]
fn items_in_history_verify_with_their_records() {
    let f = Fixture::aged();
    f.run("verify", &[])
        .exits(0)
        .says("3 items (1 live, 2 of 2 in history)")
        .says("verified");
}

#[test]
fn list_shows_live_items_and_history_on_request() {
    let f = Fixture::aged();
    f.run("list", &[])
        .exits(0)
        .says("old-queued")
        .says("(2 older items are in history: add --history to list them too)");
    assert_eq!(keys(&f.run("list", &["--json"])), ["old-queued"]);
    assert_eq!(
        keys(&f.run("list", &["--json", "--history"])),
        ["old-failed", "old-queued", "old-sent"]
    );
}

#[test]
fn status_totals_history_apart_from_the_live_counts() {
    let f = Fixture::aged();
    let status = f.run("status", &["--json"]).exits(0).json();
    assert_eq!(status["items"]["total"], 1);
    assert_eq!(status["history_items"], 2);
    f.run("status", &[])
        .exits(0)
        .says("history  2 older sent or failed items");
}

#[test]
fn show_find_and_export_reach_into_history() {
    let f = Fixture::aged();
    f.run("show", &["old-failed"])
        .exits(0)
        .says("error code     chat_not_found")
        .says("audit history (2 records)");
    f.run("find", &["--transport-ref", "tg-old"])
        .exits(0)
        .says("key            old-sent");
    let exported = f.run("export", &[]);
    assert_eq!(exported.exits(0).stdout.lines().count(), 3);
}

#[test]
fn a_failed_item_in_history_can_be_requeued() {
    let f = Fixture::aged();
    f.run("requeue", &["old-failed", "--reason", "chat restored"])
        .exits(0)
        .says("requeued old-failed (was failed: chat_not_found)");
    assert_eq!(f.item("old-failed").state(), ItemState::Queued);
    f.run("verify", &[]).exits(0);
}
