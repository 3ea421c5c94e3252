//! `requeue` and `cancel`: operator decisions, refused where they would be unsafe,
//! recorded with who and why.

use std::sync::mpsc;

use durable_outbox::{CANCELLED, ItemState};

use crate::harness::{Fixture, LOGIN, command, finished};

#[test]
fn requeue_sends_a_failed_item_again_and_records_who_and_why() {
    let f = Fixture::demo();
    f.run(
        "requeue",
        &[
            "gone-1",
            "--reason",
            "user unblocked the bot",
            "--operator",
            "alice",
        ],
    )
    .exits(0)
    .says("requeued gone-1 (was failed: chat_not_found)")
    .says("by alice: user unblocked the bot");
    let item = f.item("gone-1");
    assert_eq!((item.state(), item.attempts()), (ItemState::Queued, 0));
    let last = f.outbox.history("gone-1").unwrap().pop().unwrap();
    assert_eq!(last.outcome.as_str(), "requeued");
    assert_eq!(last.note.as_deref(), Some("alice: user unblocked the bot"));
}

#[test]
fn the_operator_defaults_to_the_login_name() {
    let f = Fixture::demo();
    let done = f
        .run(
            "requeue",
            &["timeout-1", "--reason", "checked: never arrived", "--json"],
        )
        .exits(0)
        .json();
    let last = f.outbox.history("timeout-1").unwrap().pop().unwrap();
    assert_eq!(done["operator"], LOGIN);
    assert_eq!(done["audit_seq"], last.seq);
    assert_eq!(
        last.note.as_deref(),
        Some(format!("{LOGIN}: checked: never arrived").as_str())
    );
}

#[cfg(target_os = "linux")]
#[test]
fn without_a_login_name_in_the_environment_the_account_name_is_recorded() {
    let f = Fixture::demo();
    let whoami = std::process::Command::new("id")
        .arg("-un")
        .output()
        .unwrap();
    let account = String::from_utf8(whoami.stdout).unwrap().trim().to_owned();
    let output = command(["cancel".as_ref(), f.path().as_os_str()])
        .args(["queued-1", "--reason", "duplicate"])
        .env_remove("LOGNAME")
        .output()
        .unwrap();
    finished(&output).exits(0);
    let last = f.outbox.history("queued-1").unwrap().pop().unwrap();
    assert_eq!(last.note, Some(format!("{account}: duplicate")));
}

#[test]
fn requeue_refuses_a_sent_item() {
    let f = Fixture::demo();
    f.run("requeue", &["welcome", "--reason", "again please"])
        .exits(1)
        .complains("refused")
        .complains("it was sent already");
    assert_eq!(f.outcomes("welcome"), ["queued", "sent"]);
}

#[test]
fn cancel_fails_a_queued_item_as_cancelled_by_the_operator() {
    let f = Fixture::demo();
    f.run(
        "cancel",
        &[
            "later-1",
            "--reason",
            "customer withdrew",
            "--operator",
            "bob",
        ],
    )
    .exits(0)
    .says("cancelled later-1 (was queued: http_429)");
    let item = f.item("later-1");
    assert_eq!(
        (item.state(), item.error_code()),
        (ItemState::Failed, Some(CANCELLED))
    );
    let last = f.outbox.history("later-1").unwrap().pop().unwrap();
    assert_eq!(last.outcome.as_str(), "cancelled");
    assert_eq!(last.note.as_deref(), Some("bob: customer withdrew"));
}

#[test]
fn cancel_refuses_an_item_that_is_not_queued() {
    let f = Fixture::demo();
    f.run("cancel", &["gone-1", "--reason", "tidy up"])
        .exits(1)
        .complains("it is failed already");
    f.run("cancel", &["nope", "--reason", "tidy up"])
        .exits(1)
        .complains("no outbox item has idempotency key \"nope\"");
}

#[test]
fn an_item_being_sent_right_now_is_refused_and_shown_in_flight() {
    let f = Fixture::demo();
    let (entered, in_send) = mpsc::channel();
    let (release, released) = mpsc::channel::<()>();
    let bot = f.outbox.clone();
    let sender = std::thread::spawn(move || {
        bot.process("queued-1", |_| {
            entered.send(()).unwrap();
            released.recv().unwrap();
            Ok(Some("tg-late".into()))
        })
    });
    in_send.recv().unwrap();

    f.run("cancel", &["queued-1", "--reason", "stop it"])
        .exits(1)
        .complains("in flight");
    let status = f.run("status", &["--json"]).exits(1).json();
    assert_eq!(status["items"]["in_flight"], 1);
    f.run("list", &["--state", "in-flight"])
        .exits(0)
        .says("queued-1")
        .says("in-flight");

    release.send(()).unwrap();
    sender.join().unwrap().unwrap();
    assert_eq!(f.item("queued-1").state(), ItemState::Sent);
    f.run("requeue", &["queued-1", "--reason", "no"])
        .exits(1)
        .complains("sent already");
}
