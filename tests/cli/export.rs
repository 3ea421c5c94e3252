//! `export`: items or audit records as JSON lines or CSV, and a closed pipe is a
//! normal end.

use std::io::{BufRead, BufReader};
use std::process::Stdio;

use durable_outbox::NewMessage;

use crate::harness::{Fixture, command, message};

#[test]
fn items_export_as_json_lines_without_bodies_unless_asked() {
    let f = Fixture::demo();
    let run = f.run("export", &[]);
    let lines: Vec<serde_json::Value> = run
        .exits(0)
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 6);
    assert!(lines.iter().all(|l| l.get("content").is_none()));
    let with_bodies = f.run("export", &["--show-content"]);
    with_bodies.exits(0).says("\"content\":\"body of welcome\"");
}

#[test]
fn items_export_as_csv_with_a_header_and_quoting() {
    let f = Fixture::demo();
    f.outbox
        .enqueue(NewMessage {
            content: "say \"hi\", then\ngo".into(),
            ..message("quoted", "chat-9")
        })
        .unwrap();
    let run = f.run("export", &["--format", "csv", "--show-content"]);
    run.exits(0).says("\"say \"\"hi\"\", then\ngo\"\r\n");
    let header = run.stdout.lines().next().unwrap();
    assert!(
        header.starts_with("idempotency_key,state,dispatch_claimed,"),
        "{header}"
    );
    assert!(header.ends_with(",last_audit_id,content"), "{header}");
    let rows = f.run("export", &["--format", "csv"]);
    assert_eq!(rows.exits(0).stdout.matches("\r\n").count(), 1 + 7);
}

#[test]
fn audit_export_as_json_lines_is_the_log_itself() {
    let f = Fixture::demo();
    let run = f.run("export", &["--audit"]);
    let log = std::fs::read_to_string(f.file("audit.jsonl")).unwrap();
    assert_eq!(run.exits(0).stdout, log);
}

#[test]
fn audit_export_as_csv_has_one_row_per_record() {
    let f = Fixture::demo();
    let run = f.run("export", &["--audit", "--format", "csv"]);
    let lines: Vec<&str> = run.exits(0).stdout.split("\r\n").collect();
    assert!(lines[0].starts_with("seq,recorded_at_utc,outcome,idempotency_key,"));
    let records = f.outbox.audit_head().unwrap().seq as usize;
    assert_eq!(lines.len(), 1 + records + 1, "header, records, final empty");
    assert!(lines[1].starts_with("1,"));
}

#[test]
fn a_reader_that_stops_early_is_not_an_error() {
    let f = Fixture::empty();
    let big = "x".repeat(1000);
    let messages = (0..2000)
        .map(|i| NewMessage {
            content: big.clone(),
            ..message(&format!("k{i:04}"), "chat-1")
        })
        .collect();
    f.outbox.enqueue_many(messages).unwrap();
    // About 2 MB of output against a 64 KiB pipe: the tool is still writing when
    // the reader goes away (`durable-outbox export DIR | head -1`).
    let mut child = command([
        "export".as_ref(),
        f.path().as_os_str(),
        "--show-content".as_ref(),
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert!(first.contains("\"idempotency_key\":\"k0000\""), "{first}");
    let output = child.wait_with_output().unwrap();
    let run = crate::harness::finished(&output);
    assert_eq!(run.exits(0).stderr, "");
}
