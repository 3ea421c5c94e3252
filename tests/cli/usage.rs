//! Bad arguments get a clear message and exit code 2; `--help` documents the exit codes.

use crate::harness::{Fixture, cli};

const COMMANDS: [&str; 8] = [
    "status", "list", "show", "find", "verify", "requeue", "cancel", "export",
];

#[test]
fn no_command_prints_usage_and_exits_2() {
    cli::<&str>([]).exits(2).complains("Usage: durable-outbox");
}

#[test]
fn an_unknown_command_is_named() {
    cli(["frobnicate", "/tmp"])
        .exits(2)
        .complains("unrecognized subcommand 'frobnicate'");
}

#[test]
fn help_lists_every_command_and_the_exit_codes() {
    let run = cli(["--help"]);
    run.exits(0)
        .says("Exit codes:")
        .says("bad arguments or usage");
    for command in COMMANDS {
        run.says(command);
    }
}

#[test]
fn every_command_has_help_with_the_exit_codes() {
    for command in COMMANDS {
        cli([command, "--help"])
            .exits(0)
            .says(&format!("Usage: durable-outbox {command}"))
            .says("Exit codes:");
    }
}

#[test]
fn invalid_option_values_are_rejected_with_what_was_expected() {
    let f = Fixture::demo();
    f.run("list", &["--state", "bogus"])
        .exits(2)
        .complains("invalid value 'bogus'")
        .complains("in-flight");
    f.run("status", &["--rate-limit", "10"])
        .exits(2)
        .complains("expected COUNT/SECONDS");
    f.run("list", &["--since", "yesterday"])
        .exits(2)
        .complains("an age such as 90s");
    f.run("list", &["--limit", "-1"]).exits(2);
    f.run("export", &["--format", "xlsx"])
        .exits(2)
        .complains("jsonl");
}

#[test]
fn a_missing_required_argument_is_named() {
    let f = Fixture::demo();
    f.run("requeue", &["gone-1"]).exits(2).complains("--reason");
    f.run("find", &[]).exits(2).complains("--transport-ref");
    cli(["show"]).exits(2).complains("<DIR|URL>");
}

#[test]
fn a_blank_reason_is_a_usage_error_and_changes_nothing() {
    let f = Fixture::demo();
    f.run("cancel", &["queued-1", "--reason", "  "])
        .exits(2)
        .complains("reason")
        .complains("blank");
    assert_eq!(f.outcomes("queued-1"), ["queued"]);
}

#[test]
fn a_directory_that_does_not_exist_is_not_created() {
    let parent = tempfile::tempdir().unwrap();
    let missing = parent.path().join("typo");
    cli(["status".as_ref(), missing.as_os_str()])
        .exits(2)
        .complains("no such directory");
    assert!(!missing.exists());
}

#[test]
fn a_directory_without_outbox_files_is_refused_untouched() {
    let dir = tempfile::tempdir().unwrap();
    cli(["list".as_ref(), dir.path().as_os_str()])
        .exits(2)
        .complains("not an outbox directory");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn an_unreadable_audit_key_file_is_a_usage_error() {
    let f = Fixture::demo();
    f.run("status", &["--audit-key-file", "/nonexistent/key"])
        .exits(2)
        .complains("cannot read the audit key file");
}
