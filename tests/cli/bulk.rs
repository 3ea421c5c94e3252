//! `requeue` and `cancel` by filter, with `--dry-run`: one audit record per item.

use durable_outbox::{ItemState, SendError};

use crate::harness::{Fixture, message};

/// Three retryable failures after an outage (two in chat-1, one in a chat with
/// nothing queued before it), the demo's
/// situations besides.
fn after_an_outage() -> Fixture {
    let f = Fixture::demo();
    for (key, chat) in [
        ("down-1", "chat-1"),
        ("down-2", "chat-1"),
        ("down-3", "chat-6"),
    ] {
        f.outbox.enqueue(message(key, chat)).unwrap();
    }
    // One attempt, so a refused connection fails the item (an audited change
    // of the stored setting).
    let refused = durable_outbox::Outbox::builder(f.path())
        .max_attempts(1)
        .update_settings()
        .open()
        .unwrap();
    for key in ["down-1", "down-2", "down-3"] {
        refused
            .process(key, |_| Err(SendError::retryable("connection_refused")))
            .unwrap();
    }
    f
}

#[test]
fn a_dry_run_lists_what_would_change_and_records_nothing() {
    let f = after_an_outage();
    let head = f.outbox.audit_head().unwrap();
    f.run(
        "requeue",
        &[
            "--state",
            "failed",
            "--class",
            "retryable",
            "--dry-run",
            "--reason",
            "platform back",
        ],
    )
    .exits(0)
    .says("dry run: would requeue 3 item(s); nothing was changed or recorded")
    .says("down-1")
    .says("connection_refused  retryable");
    assert_eq!(f.outbox.audit_head().unwrap(), head, "nothing recorded");
    assert_eq!(f.item("down-1").state(), ItemState::Failed);
}

#[test]
fn requeue_by_filter_records_one_audited_decision_per_item() {
    let f = after_an_outage();
    f.run(
        "requeue",
        &[
            "--error-code",
            "connection_refused",
            "--destination",
            "chat-1",
            "--since",
            "1h",
            "--operator",
            "alice",
            "--reason",
            "platform back",
        ],
    )
    .exits(0)
    .says("requeued 2 item(s), each recorded in the audit log by alice: platform back")
    .says("down-1")
    .says("down-2");
    for key in ["down-1", "down-2"] {
        assert_eq!(f.item(key).state(), ItemState::Queued);
        let last = f.outbox.history(key).unwrap().pop().unwrap();
        assert_eq!(last.note.as_deref(), Some("alice: platform back"));
    }
    assert_eq!(f.item("down-3").state(), ItemState::Failed, "other chat");
}

#[test]
fn cancel_by_filter_lists_what_it_skipped_and_json_says_the_same() {
    let f = after_an_outage();
    let done = f
        .run(
            "cancel",
            &[
                "--destination",
                "chat-3",
                "--operator",
                "bob",
                "--reason",
                "chat closed",
                "--json",
            ],
        )
        .exits(0)
        .json();
    assert_eq!(done["changed"][0]["idempotency_key"], "later-1");
    assert_eq!(done["dry_run"], false);
    // Again: nothing left to cancel there, and it says why.
    f.run("cancel", &["--destination", "chat-3", "--reason", "again"])
        .exits(1)
        .says("later-1: it was cancelled already")
        .complains("no item the filters select can be cancelled");
    // The single-key form says the same.
    f.run("cancel", &["later-1", "--reason", "again"])
        .exits(1)
        .complains("it was cancelled already");
}

#[test]
fn filters_and_a_key_do_not_mix_and_dry_run_needs_filters() {
    let f = after_an_outage();
    f.run("requeue", &["down-1", "--state", "failed", "--reason", "x"])
        .exits(2);
    f.run("requeue", &["down-1", "--dry-run", "--reason", "x"])
        .exits(2);
    f.run("requeue", &["--reason", "x"]).exits(2);
    f.run("requeue", &["--class", "sometimes", "--reason", "x"])
        .exits(2);
}
