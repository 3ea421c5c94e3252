//! Moving a file outbox into PostgreSQL (`Migration`, `durable-outbox
//! migrate`): nothing acknowledged is lost or resent, the audit chain arrives
//! byte for byte, the source directory is never written, a directory in use
//! or a non-empty target is refused, and a failure half-way leaves the target
//! as it was (no schema when it had none, empty tables when it had them).
//! Every test runs against the throwaway server of `tests/support/postgres.rs`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use durable_outbox::{AuditLog, Error, ManualClock, Migration, Outbox, OutboxBuilder, SendError};

use crate::harness::{START, msg, secs};
use crate::pg_server::{PgDatabase, PgServer};

const DAY: Duration = Duration::from_secs(24 * 60 * 60);

fn database() -> Option<PgDatabase<'static>> {
    Some(PgServer::shared()?.database())
}

/// Every file under `dir` with its bytes.
fn tree(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut files = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(at) = stack.pop() {
        for entry in std::fs::read_dir(&at).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                files.insert(path.clone(), std::fs::read(&path).unwrap());
            }
        }
    }
    files
}

/// A refused migration did not even create the schema.
fn assert_untouched(db: &PgDatabase<'_>) {
    assert_eq!(
        db.psql("SELECT count(*) FROM pg_namespace WHERE nspname = 'durable_outbox'"),
        "0",
        "nothing was written to the server"
    );
}

/// A child process killed (`SIGKILL`) and reaped when dropped, also when the test fails.
#[cfg(feature = "test-failpoints")]
struct Killed(std::process::Child);

#[cfg(feature = "test-failpoints")]
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn file_builder(dir: &Path, clock: &ManualClock) -> OutboxBuilder {
    Outbox::builder(dir)
        .clock(clock.clone())
        .sleeper(clock.clone())
        .rate_limit(u32::MAX, Duration::from_millis(1))
}

fn pg_builder(db: &PgDatabase<'_>, clock: &ManualClock) -> OutboxBuilder {
    Outbox::postgres(&db.url())
        .clock(clock.clone())
        .sleeper(clock.clone())
}

/// A file outbox with history (five sent, one failed, a day old), a stored
/// setting, a destination cooling down, and three queued items, closed.
fn busy_file_outbox(dir: &Path, clock: &ManualClock) {
    let outbox = file_builder(dir, clock).max_attempts(5).open().unwrap();
    for i in 0..5 {
        let key = format!("old-{i}");
        outbox
            .enqueue(msg(&key, &format!("chat-{}", i % 2)))
            .unwrap();
        outbox
            .process(&key, |_| Ok(Some(format!("tr-{i}"))))
            .unwrap();
    }
    outbox.enqueue(msg("old-failed", "chat-9")).unwrap();
    outbox
        .process("old-failed", |_| {
            Err(SendError::permanent("chat_not_found"))
        })
        .unwrap();
    clock.advance(DAY + secs(1));
    outbox.compact().unwrap();
    assert_eq!(outbox.history_len().unwrap(), 6, "history segments exist");
    outbox.enqueue(msg("slow", "chat-7")).unwrap();
    outbox
        .process("slow", |_| {
            Err(SendError::retryable("rate_limited").retry_after(secs(600)))
        })
        .unwrap();
    for key in ["q-1", "q-2"] {
        outbox.enqueue(msg(key, "chat-3")).unwrap();
    }
    // A sent item still in the live state.
    outbox.enqueue(msg("recent", "chat-4")).unwrap();
    outbox
        .process("recent", |_| Ok(Some("tr-recent".into())))
        .unwrap();
}

#[test]
fn a_migrated_outbox_holds_every_item_and_the_same_audit_chain_and_works_on_postgres() {
    let Some(db) = database() else { return };
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::at(START).unwrap();
    busy_file_outbox(dir.path(), &clock);
    let file = file_builder(dir.path(), &clock).open().unwrap();
    let mut keys: Vec<String> = file
        .list_items()
        .unwrap()
        .iter()
        .map(|i| i.idempotency_key().to_owned())
        .collect();
    keys.extend((0..5).map(|i| format!("old-{i}")));
    keys.push("old-failed".into());
    let file_items: Vec<_> = keys.iter().map(|k| file.get(k).unwrap().unwrap()).collect();
    let file_head = file.verify_audit().unwrap();
    let file_history: Vec<_> = keys.iter().map(|k| file.history(k).unwrap()).collect();
    drop(file);
    let audit_file = std::fs::read(dir.path().join("audit.jsonl")).unwrap();

    let before = tree(dir.path());
    let report = Migration::new(dir.path(), &db.url()).run().unwrap();
    assert_eq!(
        tree(dir.path()),
        before,
        "the source directory is not written"
    );
    assert_eq!(
        (
            report.live_items,
            report.history_items,
            report.claimed_items
        ),
        (4, 6, 0)
    );
    assert_eq!(report.audit_head.seq, file_head.head_seq);
    assert_eq!(report.audit_head.hash, file_head.head_hash);

    let pg = pg_builder(&db, &clock).open().unwrap();
    for (item, history) in file_items.iter().zip(&file_history) {
        let key = item.idempotency_key();
        let moved = pg
            .get(key)
            .unwrap()
            .unwrap_or_else(|| panic!("{key} moved"));
        assert_eq!(
            (
                moved.state(),
                moved.transport_ref(),
                moved.attempts(),
                moved.error_code()
            ),
            (
                item.state(),
                item.transport_ref(),
                item.attempts(),
                item.error_code()
            ),
            "{key}"
        );
        assert_eq!(&pg.history(key).unwrap(), history, "{key}'s audit records");
    }
    assert_eq!(
        pg.find_by_transport_ref("tr-3")
            .unwrap()
            .unwrap()
            .idempotency_key(),
        "old-3",
        "a history item is found by its transport ref"
    );
    assert_eq!(
        pg.history_items().unwrap().count(),
        6,
        "history stays history"
    );
    assert_eq!(
        pg.settings().unwrap().max_attempts(),
        5,
        "stored settings moved"
    );
    // The chain: same head, the same lines as audit.jsonl, and it goes on.
    let pg_head = pg.verify_audit().unwrap();
    assert_eq!(
        (pg_head.head_seq, pg_head.head_hash.clone()),
        (file_head.head_seq, file_head.head_hash.clone())
    );
    let lines = db.psql("SELECT string_agg(line, E'\\n' ORDER BY seq) FROM durable_outbox.audit");
    assert_eq!(
        format!("{lines}\n").into_bytes(),
        audit_file,
        "the audit table holds audit.jsonl's lines byte for byte"
    );
    assert_eq!(
        AuditLog::verify(dir.path().join("audit.jsonl"))
            .unwrap()
            .head_hash,
        pg_head.head_hash
    );

    deliver_after_migration(&pg, &clock, file_head.head_seq);
}

/// Delivery goes on after a migration: the queued items in order, the
/// cooling destination only once its cooldown ends, new items behind the
/// migrated ones, the chain growing from the migrated head.
fn deliver_after_migration(pg: &Outbox, clock: &ManualClock, migrated_head: u64) {
    pg.enqueue(msg("q-3", "chat-3")).unwrap();
    let mut sent = Vec::new();
    pg.process_due(|item| {
        sent.push(item.idempotency_key().to_owned());
        Ok(Some(format!("tr-{}", item.idempotency_key())))
    })
    .unwrap();
    for _ in 0..3 {
        clock.advance(secs(2));
        pg.process_due(|item| {
            sent.push(item.idempotency_key().to_owned());
            Ok(Some(format!("tr-{}", item.idempotency_key())))
        })
        .unwrap();
    }
    assert_eq!(sent, ["q-1", "q-2", "q-3"], "in order, the cooldown held");
    clock.advance(secs(600));
    pg.process_due(|item| {
        sent.push(item.idempotency_key().to_owned());
        Ok(Some("tr-slow".into()))
    })
    .unwrap();
    assert_eq!(sent.last().map(String::as_str), Some("slow"));
    assert!(pg.verify_audit().unwrap().head_seq > migrated_head);
    assert_eq!(
        pg.find_by_transport_ref("tr-q-2")
            .unwrap()
            .unwrap()
            .idempotency_key(),
        "q-2"
    );
}

#[test]
fn a_keyed_chain_moves_as_it_is_and_needs_its_key() {
    let Some(db) = database() else { return };
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::at(START).unwrap();
    let key = b"audit key of the bot".to_vec();
    {
        let outbox = file_builder(dir.path(), &clock)
            .audit_key(key.clone())
            .open()
            .unwrap();
        outbox.enqueue(msg("a", "chat-1")).unwrap();
        outbox.process("a", |_| Ok(Some("tr-a".into()))).unwrap();
    }
    match Migration::new(dir.path(), &db.url()).run() {
        Err(Error::AuditBroken { line: 1, .. }) => {}
        other => panic!("a keyed chain without its key must not verify: {other:?}"),
    }
    assert_untouched(&db);
    let report = Migration::new(dir.path(), &db.url())
        .audit_key(key.clone())
        .run()
        .unwrap();
    assert_eq!(report.audit_records, 2);
    let pg = pg_builder(&db, &clock).audit_key(key).open().unwrap();
    assert_eq!(pg.verify_audit().unwrap().head_hash, report.audit_head.hash);
    assert!(
        pg_builder(&db, &clock)
            .open()
            .unwrap()
            .verify_audit()
            .is_err(),
        "without the key the chain does not verify on PostgreSQL either"
    );
}

#[test]
fn a_schema_that_holds_an_outbox_is_refused_and_keeps_what_it_holds() {
    let Some(db) = database() else { return };
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::at(START).unwrap();
    busy_file_outbox(dir.path(), &clock);
    let pg = pg_builder(&db, &clock).open().unwrap();
    pg.enqueue(msg("already-here", "chat-1")).unwrap();
    match Migration::new(dir.path(), &db.url()).run() {
        Err(Error::TargetNotEmpty {
            schema,
            items: 1,
            audit_records: 1,
        }) if schema == "durable_outbox" => {}
        other => panic!("a non-empty schema must be refused: {other:?}"),
    }
    assert_eq!(db.psql("SELECT count(*) FROM durable_outbox.items"), "1");
    assert_eq!(pg.verify_audit().unwrap().records, 1);
    // Another schema of the same database is empty: that works.
    Migration::new(dir.path(), &db.url())
        .schema("moved")
        .run()
        .unwrap();
    assert_eq!(db.psql("SELECT count(*) FROM moved.items"), "10");
}

#[test]
fn a_failure_half_way_leaves_the_target_empty() {
    let Some(db) = database() else { return };
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::at(START).unwrap();
    busy_file_outbox(dir.path(), &clock);
    // The tables exist (an opened, empty outbox), and the server fails the
    // third audit insert: items went in before it.
    drop(pg_builder(&db, &clock).open().unwrap());
    db.psql(
        "CREATE FUNCTION durable_outbox.fail_third() RETURNS trigger LANGUAGE plpgsql AS
         $$ BEGIN IF NEW.seq = 3 THEN RAISE EXCEPTION 'injected failure'; END IF; RETURN NEW; END $$",
    );
    db.psql(
        "CREATE TRIGGER fail_third BEFORE INSERT ON durable_outbox.audit
         FOR EACH ROW EXECUTE FUNCTION durable_outbox.fail_third()",
    );
    match Migration::new(dir.path(), &db.url()).run() {
        Err(Error::Database { .. }) => {}
        other => panic!("the injected failure must surface: {other:?}"),
    }
    for table in ["items", "audit", "rate_times", "cooldowns"] {
        assert_eq!(
            db.psql(&format!("SELECT count(*) FROM durable_outbox.{table}")),
            "0",
            "{table} is empty after the failed migration"
        );
    }
    assert_eq!(db.psql("SELECT seq FROM durable_outbox.audit_head"), "0");
    db.psql("DROP TRIGGER fail_third ON durable_outbox.audit");
    let report = Migration::new(dir.path(), &db.url()).run().unwrap();
    assert_eq!(report.live_items + report.history_items, 10);
}

/// A migration into a database that has no outbox yet creates the schema and
/// its tables in the same transaction as the copy: when the copy fails, the
/// server is left exactly as it was, with no empty tables to trip the next
/// attempt or a bot that opens the URL.
#[test]
fn a_failure_half_way_into_a_fresh_database_leaves_no_schema_behind() {
    let Some(db) = database() else { return };
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::at(START).unwrap();
    busy_file_outbox(dir.path(), &clock);
    // Nothing exists yet to put a trigger on: an event trigger puts one on
    // the audit table the moment the migration creates it, and that one
    // fails the third audit insert (after every item went in).
    db.psql(
        "CREATE FUNCTION public.fail_third() RETURNS trigger LANGUAGE plpgsql AS
         $$ BEGIN IF NEW.seq = 3 THEN RAISE EXCEPTION 'injected failure'; END IF; RETURN NEW; END $$",
    );
    db.psql(
        "CREATE FUNCTION public.arm_failure() RETURNS event_trigger LANGUAGE plpgsql AS
         $$ DECLARE c record; BEGIN
              FOR c IN SELECT * FROM pg_event_trigger_ddl_commands()
                       WHERE command_tag = 'CREATE TABLE'
                         AND object_identity = 'durable_outbox.audit' LOOP
                EXECUTE 'CREATE TRIGGER fail_third BEFORE INSERT ON durable_outbox.audit
                         FOR EACH ROW EXECUTE FUNCTION public.fail_third()';
              END LOOP;
            END $$",
    );
    db.psql(
        "CREATE EVENT TRIGGER arm_failure ON ddl_command_end WHEN TAG IN ('CREATE TABLE')
         EXECUTE FUNCTION public.arm_failure()",
    );
    match Migration::new(dir.path(), &db.url()).run() {
        Err(Error::Database { .. }) => {}
        other => panic!("the injected failure must surface: {other:?}"),
    }
    assert_untouched(&db);
    db.psql("DROP EVENT TRIGGER arm_failure");
    let report = Migration::new(dir.path(), &db.url()).run().unwrap();
    assert_eq!(report.live_items + report.history_items, 10);
}

#[test]
fn a_copy_that_reads_back_different_is_rolled_back() {
    let Some(db) = database() else { return };
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::at(START).unwrap();
    busy_file_outbox(dir.path(), &clock);
    // The server changes one audit line as it stores it: the check before
    // the commit must see it.
    drop(pg_builder(&db, &clock).open().unwrap());
    db.psql(
        "CREATE FUNCTION durable_outbox.tamper() RETURNS trigger LANGUAGE plpgsql AS
         $$ BEGIN NEW.line := replace(NEW.line, 'chat-9', 'chat-8'); RETURN NEW; END $$",
    );
    db.psql(
        "CREATE TRIGGER tamper BEFORE INSERT ON durable_outbox.audit
         FOR EACH ROW EXECUTE FUNCTION durable_outbox.tamper()",
    );
    match Migration::new(dir.path(), &db.url()).run() {
        Err(Error::MigrationMismatch { what }) => assert!(what.contains("audit record"), "{what}"),
        other => panic!("a copy that differs must be refused: {other:?}"),
    }
    assert_eq!(db.psql("SELECT count(*) FROM durable_outbox.items"), "0");
    assert_eq!(db.psql("SELECT count(*) FROM durable_outbox.audit"), "0");
}

#[test]
fn a_directory_whose_lock_is_held_is_refused_naming_the_lock() {
    let Some(db) = database() else { return };
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::at(START).unwrap();
    busy_file_outbox(dir.path(), &clock);
    // A separate open file description: the lock conflicts as another
    // process's would (a bot in the middle of a commit).
    let held = std::fs::File::open(dir.path().join("outbox.lock")).unwrap();
    held.lock().unwrap();
    match Migration::new(dir.path(), &db.url()).run() {
        Err(Error::InUse { path, .. }) if path.ends_with("outbox.lock") => {}
        other => panic!("a held directory lock must be refused: {other:?}"),
    }
    assert_untouched(&db);
    drop(held);
    Migration::new(dir.path(), &db.url()).run().unwrap();
}

#[test]
fn a_directory_that_is_not_an_outbox_is_refused() {
    let Some(db) = database() else { return };
    let dir = tempfile::tempdir().unwrap();
    match Migration::new(dir.path().join("typo"), &db.url()).run() {
        Err(Error::Io { path, .. }) if path.ends_with("typo") => {}
        other => panic!("{other:?}"),
    }
    match Migration::new(dir.path(), &db.url()).run() {
        Err(Error::InvalidConfig { setting: "dir", .. }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// A bot process inside `send`: the directory is refused while it lives; once
/// it is killed, its claim moves and the first PostgreSQL drain fails it as
/// ambiguous instead of sending it again.
#[cfg(feature = "test-failpoints")]
#[test]
fn an_open_outbox_is_refused_and_a_dead_claim_becomes_ambiguous_on_postgres() {
    use crate::processes::{wait_for_line, worker};
    use durable_outbox::{AMBIGUOUS_AFTER_RESTART, ItemState};

    let Some(db) = database() else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    {
        let outbox = Outbox::open(dir.path()).unwrap();
        outbox.enqueue(msg("in-flight", "chat-1")).unwrap();
        outbox.enqueue(msg("waiting", "chat-2")).unwrap();
    }
    let mut child = Killed(
        worker(&["process", d, "in-flight", "hang"])
            .spawn()
            .unwrap(),
    );
    wait_for_line(&mut child.0, "sending in-flight");
    let refused = Migration::new(dir.path(), &db.url()).run();
    let pid = child.0.id().to_string();
    match &refused {
        Err(Error::InUse { path, reason })
            if path.parent().is_some_and(|p| p.ends_with("owners")) && reason.contains(&pid) => {}
        other => panic!("an open outbox must be refused, naming its owner: {other:?}"),
    }
    assert!(refused.unwrap_err().to_string().contains("in use"));
    assert_untouched(&db);
    drop(child);

    let report = Migration::new(dir.path(), &db.url()).run().unwrap();
    assert_eq!(report.claimed_items, 1);
    let pg = Outbox::postgres(&db.url()).open().unwrap();
    let mut sent = Vec::new();
    pg.process_due(|item| {
        sent.push(item.idempotency_key().to_owned());
        Ok(None)
    })
    .unwrap();
    assert_eq!(sent, ["waiting"], "the dead claim is never resent");
    let item = pg.get("in-flight").unwrap().unwrap();
    assert_eq!(
        (item.state(), item.error_code()),
        (ItemState::Failed, Some(AMBIGUOUS_AFTER_RESTART))
    );
    pg.verify_audit().unwrap();
}

#[test]
fn an_item_that_went_to_history_twice_moves_once_as_its_newest_version() {
    let Some(db) = database() else { return };
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::at(START).unwrap();
    {
        let outbox = file_builder(dir.path(), &clock).open().unwrap();
        outbox.enqueue(msg("again", "chat-1")).unwrap();
        outbox
            .process("again", |_| Err(SendError::permanent("chat_not_found")))
            .unwrap();
        clock.advance(DAY + secs(1));
        outbox.compact().unwrap();
        // The operator sends it again from history; it fails again and
        // leaves for history a second time: two segments hold the key.
        outbox
            .requeue("again", "alice", "the chat exists again")
            .unwrap();
        outbox
            .process("again", |_| Err(SendError::permanent("bot_blocked")))
            .unwrap();
        clock.advance(DAY + secs(1));
        outbox.compact().unwrap();
        assert!(outbox.list_items().unwrap().is_empty(), "both moves done");
    }
    let report = Migration::new(dir.path(), &db.url()).run().unwrap();
    assert_eq!(report.history_items, 1, "{report:?}");
    let pg = pg_builder(&db, &clock).open().unwrap();
    let item = pg.get("again").unwrap().unwrap();
    assert_eq!(item.error_code(), Some("bot_blocked"), "the newest version");
}
