//! An outbox written by the Python reference design (`fixtures/seed-v1`): the tool
//! reads it as it is, and an operator can settle the claim its crash left behind.

use durable_outbox::{AMBIGUOUS_AFTER_RESTART, Outbox};
use tempfile::TempDir;

use crate::harness::{Run, cli};

const SEED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/seed-v1/outbox.json");

/// A copy of the reference's directory: just its `outbox.json`.
fn seed() -> TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(SEED, dir.path().join("outbox.json")).unwrap();
    dir
}

fn run(dir: &TempDir, command: &str, rest: &[&str]) -> Run {
    let mut args = vec![command, dir.path().to_str().unwrap()];
    args.extend_from_slice(rest);
    cli(args)
}

#[test]
fn the_reference_outbox_is_listed_and_summarised() {
    let dir = seed();
    let status = run(&dir, "status", &["--json"]).exits(0).json();
    assert_eq!(status["items"]["total"], 7);
    assert_eq!(status["items"]["sent"], 3);
    assert_eq!(
        status["items"]["in_flight"], 1,
        "the claim the reference left"
    );
    assert_eq!(
        status["failed_by_error_code"][0]["error_code"],
        "ConnectionError"
    );
    run(&dir, "list", &[])
        .exits(0)
        .says("seed-claimed")
        .says("in-flight")
        .says("ref tg-1001");
    run(&dir, "find", &["--transport-ref", "tg-1001"])
        .exits(0)
        .says("key            seed-sent")
        .says("none: the item predates the audit log");
}

#[test]
fn the_reference_outbox_verifies_with_its_unaudited_items_noted() {
    let dir = seed();
    let report = run(&dir, "verify", &["--json"]).exits(0).json();
    assert_eq!(report["unaudited_items"], 7);
    run(&dir, "verify", &[])
        .exits(0)
        .says("7 item(s) have no audit record yet");
}

#[test]
fn looking_leaves_the_reference_snapshot_in_its_version_1_format() {
    // The file engine's counterpart of a schema migrated by a look: only a
    // compaction writes `outbox.json` (in this release's format), and the
    // tool's open does not compact, though the journal holds a bot's entries.
    let dir = seed();
    let bot = Outbox::open(dir.path()).unwrap();
    bot.enqueue(crate::harness::message("after-the-seed", "chat-1"))
        .unwrap();
    let before = std::fs::read(dir.path().join("outbox.json")).unwrap();
    assert!(
        String::from_utf8_lossy(&before).contains("\"version\": 1"),
        "the bot's open and enqueue left the reference's snapshot as it was"
    );
    for (command, rest) in [
        ("status", &[][..]),
        ("list", &["--history"][..]),
        ("show", &["after-the-seed"][..]),
        ("find", &["tg-1001"][..]),
        ("verify", &[][..]),
        ("export", &["--audit"][..]),
    ] {
        run(&dir, command, rest).exits(0);
        let after = std::fs::read(dir.path().join("outbox.json")).unwrap();
        assert!(
            after == before,
            "{command} rewrote outbox.json: {}",
            String::from_utf8_lossy(&after[..after.len().min(40)])
        );
    }
}

#[test]
fn an_ambiguous_claim_needs_attention_until_an_operator_decides() {
    let dir = seed();
    // The bot starts and touches the crashed claim: it fails as ambiguous, unsent.
    let bot = Outbox::open(dir.path()).unwrap();
    let receipt = bot
        .process("seed-claimed", |_| panic!("resent an ambiguous message"))
        .unwrap();
    assert_eq!(receipt.error_code.as_deref(), Some(AMBIGUOUS_AFTER_RESTART));

    run(&dir, "status", &[])
        .exits(1)
        .says("may have been delivered")
        .says("ambiguous_delivery_after_restart  1      ambiguous");
    run(
        &dir,
        "requeue",
        &[
            "seed-claimed",
            "--reason",
            "recipient confirmed it never arrived",
        ],
    )
    .exits(0)
    .complains("may have been delivered");
    run(&dir, "status", &[]).exits(0);
    run(&dir, "verify", &[]).exits(0);
    let last = bot.history("seed-claimed").unwrap().pop().unwrap();
    assert_eq!(last.outcome.as_str(), "requeued");
}

/// Seed items were written before the failure class was stored: for them, and
/// only for them, `--ambiguous-code` says which codes may have been deliveries.
#[test]
fn ambiguous_code_still_reads_items_written_before_the_class() {
    let dir = seed();
    run(&dir, "status", &["--ambiguous-code", "ConnectionError"])
        .exits(1)
        .says("1 failed item(s) may have been delivered")
        .says("ConnectionError");
}
