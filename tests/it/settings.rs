//! Settings that shape shared state live in the outbox: every handle, the CLI
//! and a maintenance job work with the same caps, and only an explicit,
//! audited update changes them.
//!
//! Bodies in `on_both_engines!` run on the file engine and on PostgreSQL
//! (`name::file`, `name::postgres`); a restart is a handle dropped and another
//! opened. File-only here: the `#[test]`s read, damage or hand-write
//! `outbox.json` and the journal, or model older releases' files.

use durable_outbox::{AuditOutcome, Error, Outcome, RateLimit, Retention};

use crate::engines::{Kind, on_both_engines};
use crate::harness::{Harness, builder, msg, secs};

const SEED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/seed-v1/outbox.json");

/// An outbox as the release before the one-send-a-second default created it
/// with its defaults (10 sends per 60 s, stored): `hello-1` sent to chat-1 at
/// the harness's start. See `fixtures/stored-defaults-v2/README.md`.
const STORED_DEFAULTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/stored-defaults-v2");

fn cap(count: u32, window_secs: u64) -> RateLimit {
    RateLimit {
        count,
        window: secs(window_secs),
    }
}

/// The notes of the settings changes in the audit log, on either engine.
fn settings_records(h: &Harness) -> Vec<String> {
    h.audit_records()
        .into_iter()
        .filter(|r| r.outcome == AuditOutcome::Settings)
        .map(|r| r.note.unwrap_or_default())
        .collect()
}

on_both_engines! {
    fn a_new_outbox_stores_its_creators_settings_with_its_first_change(engine) {
        let h = engine.harness_with(|b| {
            b.rate_limit(2, secs(30))
                .rate_limit_for("-*", 20, secs(60))
                .global_rate_limit(30, secs(1))
                .max_attempts(5)
                .history_after(secs(3600))
                .history_retention(Retention::MaxSegments(4))
        });
        h.enqueue("a", "chat-1");
        // Another process opening with every default works with the creator's values.
        let settings = h.reopen().settings().unwrap();
        assert_eq!(settings.rate_limit(), cap(2, 30));
        assert_eq!(settings.rate_limit_for("-100"), cap(20, 60));
        assert_eq!(settings.global_rate_limit(), Some(cap(30, 1)));
        assert_eq!(settings.max_attempts(), 5);
        assert_eq!(settings.history_after(), secs(3600));
        assert_eq!(settings.history_retention(), Retention::MaxSegments(4));
        assert!(settings.is_stored("rate_limit") && settings.is_stored("backoff"));
        assert!(
            settings_records(&h).is_empty(),
            "the initial settings are the outbox's first state, not a change"
        );
    }
}

on_both_engines! {
    fn a_handle_opened_with_a_weaker_cap_keeps_the_stored_one(engine) {
        let h = engine.harness_with(|b| b.rate_limit(1, secs(60)));
        h.enqueue("a", "chat-1");
        h.enqueue("b", "chat-1");
        h.outbox.process("a", |_| Ok(None)).unwrap();
        let careless = h.reopen_with(|b| b.rate_limit(100, secs(60)).max_attempts(9));
        let b = careless
            .process("b", |_| panic!("a builder value weakened the stored cap"))
            .unwrap();
        assert_eq!(b.outcome, Outcome::Deferred);
        assert_eq!(careless.settings().unwrap().rate_limit(), cap(1, 60));
        assert_eq!(
            careless.settings().unwrap().max_attempts(),
            12,
            "the stored default"
        );
        assert!(settings_records(&h).is_empty(), "nothing was changed");
    }

    /// A send's record is decided by the settings stored when it is made, not
    /// by those its claim was made under (on PostgreSQL the record is first
    /// decided from what the handle knows, and must not commit on settings
    /// another handle changed meanwhile).
    fn a_settings_change_made_while_a_send_runs_governs_its_record(engine) {
        let h = engine.harness_with(|b| b.max_attempts(5));
        h.enqueue("a", "chat-1");
        let receipt = h
            .outbox
            .process("a", |_| {
                drop(h.reopen_with(|b| b.max_attempts(1).update_settings()));
                Err(durable_outbox::SendError::retryable("http_502"))
            })
            .unwrap();
        // Under the new settings its one attempt was its last.
        assert_eq!(receipt.outcome, Outcome::Failed);
        let item = h.outbox.get("a").unwrap().unwrap();
        assert_eq!(
            (item.state(), item.attempts()),
            (durable_outbox::ItemState::Failed, 1)
        );
        h.outbox.verify_audit().unwrap();
    }

    fn update_settings_changes_them_for_every_handle_with_an_audit_record(engine) {
        let h = engine.harness_with(|b| b.rate_limit(1, secs(60)));
        for key in ["a", "b", "c"] {
            h.enqueue(key, "chat-1");
        }
        h.outbox.process("a", |_| Ok(None)).unwrap();
        let before = h.outbox.audit_head().unwrap().seq;
        h.reopen_with(|b| b.rate_limit(2, secs(60)).update_settings());
        // The bot's own handle, opened before the change, follows it at its next call.
        assert_eq!(
            h.outbox.process("b", |_| Ok(None)).unwrap().outcome,
            Outcome::Sent
        );
        assert_eq!(
            h.outbox
                .process("c", |_| panic!("over the new cap"))
                .unwrap()
                .outcome,
            Outcome::Deferred
        );
        assert_eq!(
            settings_records(&h),
            ["rate_limit 1/60s -> 2/60s (updated by a handle opened with update_settings)"]
        );
        let records = h.audit_records();
        let change = records
            .iter()
            .find(|r| r.outcome == AuditOutcome::Settings)
            .unwrap();
        assert_eq!(
            (change.seq, change.idempotency_key.as_str()),
            (before + 1, "settings")
        );
        h.outbox.verify_audit().unwrap();
        // Updating to the values already stored writes nothing.
        let head = h.outbox.audit_head().unwrap();
        h.reopen_with(|b| {
            b.rate_limit(2, secs(60))
                .update_settings()
                .compact_on_open(false)
        });
        assert_eq!(h.outbox.audit_head().unwrap(), head);
    }

    fn stored_settings_survive_compaction_and_restarts(engine) {
        let h = engine.harness_with(|b| b.rate_limit(1, secs(600)).max_attempts(7));
        h.enqueue("a", "chat-1");
        h.settle_history();
        drop(h.reopen());
        if engine.kind == Kind::File {
            let text = std::fs::read_to_string(h.path("outbox.json")).unwrap();
            assert!(text.contains("\"settings\""), "{text}");
        }
        let settings = h.reopen().settings().unwrap();
        assert_eq!(
            (settings.rate_limit(), settings.max_attempts()),
            (cap(1, 600), 7)
        );
    }
}

#[test]
fn an_outbox_from_an_older_release_keeps_working_and_stores_what_is_set_explicitly() {
    let h = Harness::new();
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(SEED, dir.path().join("outbox.json")).unwrap();
    let defaults = builder(dir.path(), &h.clock).open().unwrap();
    let settings = defaults.settings().unwrap();
    assert!(
        !settings.is_stored("rate_limit"),
        "nothing chosen, nothing stored"
    );
    // So this handle's own default applies: today's, one send a second.
    assert_eq!(settings.rate_limit(), cap(1, 1));
    defaults.enqueue(msg("new", "chat-9")).unwrap();
    assert_eq!(
        defaults.process("new", |_| Ok(None)).unwrap().outcome,
        Outcome::Sent
    );
    drop(defaults);
    let bot = builder(dir.path(), &h.clock)
        .history_after(secs(7 * 86_400))
        .open()
        .unwrap();
    let settings = bot.settings().unwrap();
    assert!(settings.is_stored("history_after"));
    assert!(
        !settings.is_stored("rate_limit"),
        "only what was set is stored"
    );
    let notes: Vec<String> = durable_outbox::AuditLog::read(dir.path().join("audit.jsonl"))
        .unwrap()
        .into_iter()
        .filter(|r| r.outcome == AuditOutcome::Settings)
        .map(|r| r.note.unwrap_or_default())
        .collect();
    assert_eq!(
        notes,
        ["history_after not stored -> 604800s (stored on first explicit use)"]
    );
}

/// The default cap changed from 10 sends per 60 s to one a second, but it is
/// a stored setting: an outbox created with the old default keeps it under a
/// handle with today's defaults, which stores, warns and audits nothing; only
/// an explicit update moves it to the new one.
#[test]
fn an_outbox_created_with_the_old_default_cap_keeps_it() {
    let h = Harness::new();
    let dir = tempfile::tempdir().unwrap();
    for file in ["outbox.json", "audit.jsonl"] {
        std::fs::copy(format!("{STORED_DEFAULTS}/{file}"), dir.path().join(file)).unwrap();
    }
    // Ten seconds after `hello-1`: outside a one-second window, inside a minute.
    h.clock.advance(secs(10));
    let bot = builder(dir.path(), &h.clock).open().unwrap();
    let settings = bot.settings().unwrap();
    assert!(settings.is_stored("rate_limit"));
    assert_eq!(settings.rate_limit(), cap(10, 60));
    for key in ["hello-2", "hello-3"] {
        bot.enqueue(msg(key, "chat-1")).unwrap();
    }
    let report = bot.process_due(|_| Ok(None)).unwrap();
    assert_eq!(
        (report.sent, report.deferred),
        (2, 0),
        "three sends in a minute are within 10 per 60 s"
    );
    bot.verify_audit().unwrap();
    let settings_notes = |dir: &std::path::Path| -> Vec<String> {
        durable_outbox::AuditLog::read(dir.join("audit.jsonl"))
            .unwrap()
            .into_iter()
            .filter(|r| r.outcome == AuditOutcome::Settings)
            .map(|r| r.note.unwrap_or_default())
            .collect()
    };
    assert!(settings_notes(dir.path()).is_empty(), "nothing changed");
    drop(bot);
    // Opting in to the new default is an explicit, audited update.
    let updated = builder(dir.path(), &h.clock)
        .rate_limit(1, secs(1))
        .update_settings()
        .open()
        .unwrap();
    assert_eq!(updated.settings().unwrap().rate_limit(), cap(1, 1));
    assert_eq!(
        settings_notes(dir.path()),
        ["rate_limit 10/60s -> 1/1s (updated by a handle opened with update_settings)"]
    );
}

#[test]
fn a_damaged_stored_setting_is_refused_naming_it_and_nothing_is_written() {
    let h = Harness::with(|b| b.rate_limit(1, secs(60)));
    h.enqueue("a", "chat-1");
    h.outbox.compact().unwrap();
    let text = std::fs::read_to_string(h.path("outbox.json")).unwrap();
    let damaged = text.replacen("\"count\": 1", "\"count\": 0", 1);
    assert_ne!(damaged, text, "the fixture stores the cap");
    std::fs::write(h.path("outbox.json"), &damaged).unwrap();
    let before = std::fs::read(h.path("outbox.json")).unwrap();
    let err = builder(h.dir.path(), &h.clock).open().unwrap_err();
    match &err {
        Error::InvalidRecord { location, .. } => {
            assert!(location.contains("rate_limit"), "{err}");
        }
        other => panic!("expected InvalidRecord, got {other}"),
    }
    assert_eq!(std::fs::read(h.path("outbox.json")).unwrap(), before);
}

#[test]
fn a_damaged_setting_in_the_journal_is_refused_naming_its_place() {
    use sha2::{Digest, Sha256};
    let h = Harness::with(|b| b.rate_limit(1, secs(60)));
    h.enqueue("a", "chat-1");
    builder(h.dir.path(), &h.clock)
        .rate_limit(2, secs(60))
        .update_settings()
        .compact_on_open(false)
        .open()
        .unwrap();
    // Rewrite the settings entry with a zero cap and a valid checksum: only the
    // settings check can catch it.
    let journal = std::fs::read(h.path("outbox.journal")).unwrap();
    let end = journal.iter().position(|b| *b == 0).unwrap();
    let text = std::str::from_utf8(&journal[..end]).unwrap();
    let last = text
        .lines()
        .collect::<Vec<_>>()
        .iter()
        .rposition(|line| line.contains("\"settings\""))
        .expect("the journal holds the update");
    let mut rewritten = String::new();
    let mut offset = None;
    for (i, line) in text.lines().enumerate() {
        let (_, json) = line.split_at(17);
        let mut value: serde_json::Value = serde_json::from_str(json).unwrap();
        if i == last {
            value["settings"]["rate_limit"]["count"] = 0.into();
            offset = Some(rewritten.len());
        }
        let json = serde_json::to_string(&value).unwrap();
        let sum = hex::encode(&Sha256::digest(json.as_bytes())[..8]);
        rewritten.extend([sum.as_str(), " ", json.as_str(), "\n"]);
    }
    let offset = offset.expect("the journal holds the settings entry");
    let mut bytes = rewritten.into_bytes();
    bytes.resize(journal.len().max(bytes.len() + 1), 0);
    std::fs::write(h.path("outbox.journal"), &bytes).unwrap();

    let err = builder(h.dir.path(), &h.clock).open().unwrap_err();
    match &err {
        Error::InvalidRecord { path, location, .. } => {
            assert!(path.ends_with("outbox.journal"), "{err}");
            assert_eq!(
                location,
                &format!("byte {offset} settings rate_limit"),
                "{err}"
            );
        }
        other => panic!("expected InvalidRecord, got {other}"),
    }
    assert_eq!(
        std::fs::read(h.path("outbox.journal")).unwrap(),
        bytes,
        "nothing written"
    );
}

on_both_engines! {
    fn a_handle_with_a_shorter_give_up_age_never_gives_up_the_bots_items_early(engine) {
        let h = engine.harness_with(|b| b.give_up_after(secs(2 * 3600)));
        h.enqueue("a", "chat-1");
        // A maintenance job (or a second worker) opened with a one-second deadline.
        let impatient = h.reopen_with(|b| b.give_up_after(secs(1)).max_inline_wait(secs(0)));
        assert_eq!(impatient.settings().unwrap().give_up_after(), secs(7200));
        assert!(impatient.settings().unwrap().is_stored("give_up_after"));
        h.clock.advance(secs(600));
        let receipt = impatient
            .process("a", |_| {
                Err(durable_outbox::SendError::retryable("http_503").retry_after(secs(5)))
            })
            .unwrap();
        assert_eq!(
            receipt.outcome,
            Outcome::Deferred,
            "ten minutes is inside the bot's two hours: paced, not given up"
        );
        // The bot can change it, audited.
        let bot = h.reopen_with(|b| b.give_up_after(secs(600)).update_settings());
        assert_eq!(h.outbox.settings().unwrap().give_up_after(), secs(600));
        let records = settings_records(&h);
        assert_eq!(records.len(), 1);
        assert!(
            records[0].starts_with("give_up_after 7200s -> 600s"),
            "{records:?}"
        );
        drop(bot);
    }

    /// A broadcast bot lifted the per-chat order; a second worker opened
    /// with the default does not put it back.
    fn an_unordered_outbox_stays_unordered_for_a_handle_with_the_default(engine) {
        let h = engine.harness_with(|b| b.ordering(durable_outbox::Ordering::Unordered));
        h.enqueue("first", "chat-1");
        h.enqueue("second", "chat-1");
        let other = h.reopen();
        assert_eq!(
            other.settings().unwrap().ordering(),
            durable_outbox::Ordering::Unordered
        );
        assert_eq!(
            other.process("second", |_| Ok(None)).unwrap().outcome,
            Outcome::Sent,
            "unordered: the second message need not wait for the first"
        );
    }

    /// And the other way round: a handle opened with Unordered never breaks
    /// the order a chat bot's outbox keeps.
    fn an_ordered_outbox_stays_ordered_for_a_handle_opened_unordered(engine) {
        let chat_bot = engine.harness();
        chat_bot.enqueue("m1", "chat-1");
        chat_bot.enqueue("m2", "chat-1");
        let careless = chat_bot.reopen_with(|b| b.ordering(durable_outbox::Ordering::Unordered));
        assert_eq!(
            careless
                .process("m2", |_| panic!("m2 overtook m1"))
                .unwrap()
                .outcome,
            Outcome::Waiting
        );
        assert!(
            settings_records(&chat_bot).is_empty(),
            "nothing was changed"
        );
    }
}

on_both_engines! {
    /// Settings the first handle stored are in force for a handle opened
    /// with other values; `update_settings` changes them, audited.
    fn stored_settings_are_shared(engine) {
        let first = engine.open_with(|b| b.max_attempts(3));
        first.enqueue(msg("a", "chat-1")).unwrap();
        let second = engine.open_with(|b| b.max_attempts(7));
        assert_eq!(second.settings().unwrap().max_attempts(), 3, "the stored value wins");
        let third = engine.open_with(|b| b.max_attempts(5).update_settings());
        assert_eq!(third.settings().unwrap().max_attempts(), 5);
        assert_eq!(first.settings().unwrap().max_attempts(), 5, "reaches open handles");
        let note = third.history("settings").unwrap().last().and_then(|r| r.note.clone());
        assert!(note.is_some_and(|n| n.contains("max_attempts 3 -> 5")));
        third.verify_audit().unwrap();
    }
}
