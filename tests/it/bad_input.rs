//! Bad input gets a typed error naming the field or file position, and nothing is written.
//!
//! Bodies in `on_both_engines!` run on the file engine and on PostgreSQL
//! (`name::file`, `name::postgres`). File-only here: the `#[test]`s write a
//! damaged `outbox.json` and check the error names its line, item and field.

use durable_outbox::{Error, NewMessage, Outbox, limits};

use crate::engines::on_both_engines;
use crate::harness::{Harness, msg};

/// A field name and how to break it.
type Case = (&'static str, fn(&mut NewMessage));

on_both_engines! {
    fn invalid_fields_are_named_and_nothing_is_written(engine) {
        let h = engine.harness();
        h.enqueue("existing", "chat-1");
        let cases: [Case; 9] = [
            ("idempotency_key", |m| m.idempotency_key = "   ".into()),
            ("connector", |m| m.connector = String::new()),
            ("grant_id", |m| m.grant_id = "g\0".into()),
            ("destination", |m| {
                m.destination = "d".repeat(limits::DESTINATION + 1);
            }),
            ("content", |m| m.content = "x".repeat(limits::CONTENT + 1)),
            ("content", |m| m.content = "nul\0inside".into()),
            ("idempotency_key", |m| {
                m.idempotency_key = "k".repeat(limits::IDEMPOTENCY_KEY + 1);
            }),
            ("lane", |m| m.lane = Some(String::new())),
            ("risk_class", |m| m.risk_class = Some("x\ny".into())),
        ];
        for (field, mutate) in cases {
            let mut m = msg("new", "chat-1");
            mutate(&mut m);
            let err = h.assert_files_unchanged(|| h.outbox.enqueue(m).unwrap_err());
            assert!(
                matches!(err, Error::InvalidField { field: f, .. } if f == field),
                "{field}: {err}"
            );
            assert!(
                err.to_string().contains(field),
                "message names the field: {err}"
            );
        }
    }

    fn reusing_a_key_for_a_different_message_is_a_conflict_naming_the_field(engine) {
        let h = engine.harness();
        h.enqueue("k", "chat-1");
        let cases: [Case; 4] = [
            ("connector", |m| m.connector = "slack".into()),
            ("grant_id", |m| m.grant_id = "grant-2".into()),
            ("destination", |m| m.destination = "chat-2".into()),
            ("content", |m| m.content = "something else".into()),
        ];
        for (field, mutate) in cases {
            let mut m = msg("k", "chat-1");
            mutate(&mut m);
            let err = h.assert_files_unchanged(|| h.outbox.enqueue(m).unwrap_err());
            assert!(
                matches!(&err, Error::IdempotencyConflict { key, field: f } if key == "k" && *f == field),
                "{field}: {err}"
            );
        }
    }
}

/// Writes `bytes` as outbox.json in a fresh directory and opens it.
fn open_with_state(bytes: &[u8]) -> (tempfile::TempDir, Error) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("outbox.json"), bytes).unwrap();
    let err = Outbox::open(dir.path()).unwrap_err();
    assert_eq!(
        std::fs::read(dir.path().join("outbox.json")).unwrap(),
        bytes,
        "damaged file left untouched"
    );
    (dir, err)
}

#[test]
fn malformed_json_is_reported_with_its_line_and_column() {
    let (dir, err) = open_with_state(b"{\n  \"version\": 1,\n  \"items\": [,]\n}\n");
    match err {
        Error::Corrupt {
            path, line, column, ..
        } => {
            assert_eq!(path, dir.path().join("outbox.json"));
            assert_eq!((line, column), (3, 13));
        }
        other => panic!("expected Corrupt, got {other}"),
    }
}

#[test]
fn an_empty_file_is_corrupt_not_an_empty_outbox() {
    let (_dir, err) = open_with_state(b"");
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
}

#[test]
fn an_unknown_version_is_named() {
    let (_dir, err) = open_with_state(br#"{"version": 7, "items": [], "future_field": true}"#);
    assert!(
        matches!(err, Error::UnsupportedVersion { version: 7, .. }),
        "{err}"
    );
}

#[test]
fn invalid_values_name_the_item_and_field() {
    let seed = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fixtures/seed-v1/outbox.json"
    ))
    .unwrap();
    let cases = [
        (
            seed.replacen("\"state\": \"sent\"", "\"state\": \"teleported\"", 1),
            "state",
        ),
        (
            seed.replacen(
                "\"created_at_utc\": \"2026",
                "\"created_at_utc\": \"yesterday",
                1,
            ),
            "created_at_utc",
        ),
        (
            seed.replacen("\"content\": \"first\"", "\"content\": \"edited\"", 1),
            "content_hash",
        ),
        (
            seed.replacen("\"attempts\": 1", "\"attempts\": -1", 1),
            "attempts",
        ),
    ];
    for (text, field) in cases {
        let (_dir, err) = open_with_state(text.as_bytes());
        match &err {
            Error::InvalidRecord { location, .. } => {
                assert!(
                    location.contains("seed-cap-1") && location.contains(field),
                    "{field}: {err}"
                );
            }
            other => panic!("{field}: expected InvalidRecord, got {other}"),
        }
    }
}

#[test]
fn unknown_item_fields_are_refused_rather_than_silently_dropped() {
    let seed = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fixtures/seed-v1/outbox.json"
    ))
    .unwrap();
    let text = seed.replacen("\"attempts\": 1,", "\"attempts\": 1, \"priority\": 5,", 1);
    let (_dir, err) = open_with_state(text.as_bytes());
    assert!(
        matches!(err, Error::Corrupt { .. }) && err.to_string().contains("outbox.json"),
        "{err}"
    );
}

#[test]
fn a_file_damaged_after_open_is_reported_by_every_call_and_never_overwritten() {
    let h = Harness::new();
    h.enqueue("k", "chat-1");
    std::fs::write(h.path("outbox.json"), b"{ not json").unwrap();
    let err = h.assert_files_unchanged(|| h.outbox.enqueue(msg("k2", "chat-1")).unwrap_err());
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    let err = h.assert_files_unchanged(|| {
        h.outbox
            .process("k", |_| panic!("sent from a damaged state"))
            .unwrap_err()
    });
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    assert!(matches!(h.outbox.get("k"), Err(Error::Corrupt { .. })));
}

#[test]
fn an_open_that_may_not_create_refuses_a_directory_holding_no_outbox_and_writes_nothing() {
    let parent = tempfile::tempdir().unwrap();
    let missing = parent.path().join("typo");
    assert!(matches!(
        Outbox::builder(&missing).create_if_missing(false).open(),
        Err(Error::Io { path, .. }) if path == missing
    ));
    assert!(!missing.exists(), "the directory was not created");

    let empty = parent.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    match Outbox::builder(&empty).create_if_missing(false).open() {
        Err(Error::InvalidConfig {
            setting: "dir",
            reason,
        }) => {
            assert!(reason.contains("not an outbox directory"), "{reason}");
        }
        other => panic!("expected InvalidConfig(dir), got {other:?}"),
    }
    assert_eq!(
        std::fs::read_dir(&empty).unwrap().count(),
        0,
        "nothing written"
    );

    // Once a bot made it, the same open succeeds.
    drop(Outbox::open(&empty).unwrap());
    Outbox::builder(&empty)
        .create_if_missing(false)
        .open()
        .unwrap();
}
