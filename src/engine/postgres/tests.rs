//! The PostgreSQL engine's own guarantees against a real, throwaway server:
//! the audit table and its export, schemas and their migrations, wake-ups,
//! typed errors and poolers. What a handle does with it (claims, liveness,
//! caps, corrections after a lost claim, restarts) is tested through
//! `Outbox` in `tests/it` (`postgres_outbox` and the both-engine bodies).
//!
//! Each test takes a fresh database from a server shared by this test process
//! (`tests/support/postgres.rs`); tests that restart the server start their own.
//! Without PostgreSQL installed they skip with a printed reason, except under
//! `CI`, where they fail.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests panic loudly"
)]

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;

use super::test_server::PgServer;
#[allow(
    clippy::duplicate_mod,
    reason = "the session and wire tests load it too; none can reach the others'"
)]
#[path = "../../../tests/support/stall_proxy.rs"]
mod stall_proxy;
use super::{DEFAULT_SCHEMA, PgEngine};
use crate::audit::Hasher;
use crate::error::{AuditFault, Error};
use crate::item::{ItemState, OutboxItem};
use crate::message::content_hash;
use crate::rules::enqueue::insert_message;
use crate::rules::txn::Scope;
use crate::settings::Settings;

/// A watchdog for tests that wait on other threads: far beyond what they need.
const LIMIT: Duration = Duration::from_secs(60);

fn open(url: &str) -> PgEngine {
    PgEngine::open(url, DEFAULT_SCHEMA, Hasher::Plain).expect("open the postgres outbox")
}

fn item(key: &str, destination: &str) -> OutboxItem {
    let now = Utc::now();
    OutboxItem {
        idempotency_key: key.into(),
        connector: "telegram".into(),
        grant_id: "bot-1".into(),
        destination: destination.into(),
        content: format!("body of {key}"),
        content_hash: content_hash(&format!("body of {key}")),
        state: ItemState::Queued,
        attempts: 0,
        claim: None,
        created_at: now,
        updated_at: now,
        next_attempt_at: None,
        sent_at: None,
        error_code: None,
        failure_class: None,
        lane: "default".into(),
        direction: "outbound".into(),
        risk_class: None,
        transport_ref: None,
        last_audit_id: None,
        cooldown_until: None,
        maybe_sent_at: None,
        seq: None,
    }
}

/// The settings a handle opened with the defaults would pass.
fn defaults() -> Settings {
    Settings {
        rates: crate::rate::RatePolicy::default(),
        history_after: Duration::from_secs(60),
        retention: crate::history::Retention::KeepAll,
        max_attempts: 3,
        backoff: crate::retry::Backoff::default(),
        give_up_after: Duration::from_secs(3600),
        ordering: crate::order::Ordering::PerDestination,
        stored: Vec::new(),
    }
}

/// Enqueues `item`'s message through the rules' transaction, as
/// `Outbox::enqueue` does.
fn enqueue(engine: &PgEngine, item: OutboxItem) {
    let message = crate::NewMessage {
        idempotency_key: item.idempotency_key,
        connector: item.connector,
        grant_id: item.grant_id,
        destination: item.destination,
        content: item.content,
        ..Default::default()
    };
    let hash = content_hash(&message.content);
    engine
        .transact(
            Utc::now(),
            &defaults(),
            Scope::OneItem(&message.idempotency_key),
            |txn| insert_message(txn, &message, &hash),
        )
        .expect("enqueue");
}

/// The audit chain as the file a file outbox would hold, for the offline
/// verifier: every record's canonical line, in order.
fn export_to_file(engine: &PgEngine) -> tempfile::NamedTempFile {
    let file = tempfile::NamedTempFile::new().unwrap();
    let lines: Vec<u8> = engine
        .audit_page(0, super::AUDIT_PAGE)
        .unwrap()
        .iter()
        .flat_map(crate::audit::AuditRecord::to_line)
        .collect();
    std::fs::write(file.path(), lines).unwrap();
    file
}

#[test]
fn the_audit_table_holds_one_chain_the_file_verifier_accepts_and_edits_break_it() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let url = db.url();
    // Two hosts commit concurrently: the chain still has one order.
    let writers: Vec<_> = (0..2)
        .map(|host| {
            let url = url.clone();
            std::thread::spawn(move || {
                let engine = open(&url);
                for n in 0..15 {
                    enqueue(&engine, item(&format!("h{host}-{n}"), "chat"));
                }
            })
        })
        .collect();
    for writer in writers {
        writer.join().unwrap();
    }
    let engine = open(&url);
    let file = export_to_file(&engine);
    let report = crate::AuditLog::verify(file.path()).expect("the export verifies offline");
    assert_eq!(report.records, 30);
    let records = engine.audit_page(0, super::AUDIT_PAGE).unwrap();
    assert_eq!(records.len(), 30);
    assert_eq!(engine.audit_page(28, super::AUDIT_PAGE).unwrap().len(), 2);
    // Pages by seq: each starts after the last one read, and holds `limit`.
    let first = engine.audit_page(0, 10).unwrap();
    let second = engine.audit_page(first.last().unwrap().seq, 10).unwrap();
    assert_eq!(
        (first.len(), first[0].seq, second.len(), second[0].seq),
        (10, 1, 10, 11)
    );
    assert_eq!(records, crate::AuditLog::read(file.path()).unwrap());
    // Someone edits a record in the table: the exported chain no longer verifies.
    db.psql(&format!(
        "UPDATE {DEFAULT_SCHEMA}.audit SET line = replace(line, '\"chat\"', '\"evil\"') WHERE seq = 7"
    ));
    let edited = export_to_file(&engine);
    match crate::AuditLog::verify(edited.path()) {
        Err(Error::AuditBroken { line, fault, .. }) => {
            assert_eq!(line, 7);
            assert_eq!(fault, AuditFault::HashMismatch);
        }
        other => panic!("an edited record must fail verification, got {other:?}"),
    }
}

#[test]
fn keyed_chains_need_the_key() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let engine =
        PgEngine::open(&db.url(), DEFAULT_SCHEMA, Hasher::Keyed(b"secret".to_vec())).unwrap();
    enqueue(&engine, item("k1", "chat"));
    let file = export_to_file(&engine);
    assert!(crate::AuditLog::verify_keyed(file.path(), b"secret").is_ok());
    assert!(crate::AuditLog::verify(file.path()).is_err());
}

#[test]
fn a_newer_schema_is_refused_and_concurrent_opens_migrate_once() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let url = db.url();
    let openers: Vec<_> = (0..4)
        .map(|_| {
            let url = url.clone();
            std::thread::spawn(move || {
                PgEngine::open(&url, "shared_one", Hasher::Plain).map(|_| ())
            })
        })
        .collect();
    for opener in openers {
        opener
            .join()
            .unwrap()
            .expect("concurrent opens all succeed");
    }
    assert_eq!(
        db.psql("SELECT version FROM shared_one.outbox_meta"),
        super::SCHEMA_VERSION.to_string()
    );
    db.psql("UPDATE shared_one.outbox_meta SET version = 99");
    match PgEngine::open(&url, "shared_one", Hasher::Plain) {
        Err(Error::UnsupportedSchema {
            schema,
            found,
            known,
        }) => {
            assert_eq!(
                (schema.as_str(), found, known),
                ("shared_one", 99, super::SCHEMA_VERSION)
            );
        }
        other => panic!("a newer schema must be refused, got {other:?}"),
    }
    assert_eq!(
        db.psql("SELECT version FROM shared_one.outbox_meta"),
        "99",
        "nothing written"
    );
}

#[test]
fn schemas_keep_outboxes_apart_in_one_database() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let a = PgEngine::open(&db.url(), "bot_a", Hasher::Plain).unwrap();
    let b = PgEngine::open(&db.url(), "bot_b", Hasher::Plain).unwrap();
    enqueue(&a, item("same-key", "chat-a"));
    enqueue(&b, item("same-key", "chat-b"));
    assert_eq!(a.item("same-key").unwrap().unwrap().destination, "chat-a");
    assert_eq!(b.item("same-key").unwrap().unwrap().destination, "chat-b");
    assert_eq!(a.audit_page(0, super::AUDIT_PAGE).unwrap().len(), 1);
}

#[test]
fn a_commit_that_makes_work_due_wakes_a_waiter_on_another_handle() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let waiter = Arc::new(open(&db.url()));
    // Subscribe first, so the wake-up cannot be missed. The wait that starts
    // listening is woken at once: what was committed before it notified nobody.
    assert!(waiter.wait_for_work(LIMIT).unwrap());
    assert!(!waiter.wait_for_work(Duration::from_millis(50)).unwrap());
    let waiting = {
        let waiter = Arc::clone(&waiter);
        std::thread::spawn(move || waiter.wait_for_work(LIMIT).unwrap())
    };
    let producer = open(&db.url());
    enqueue(&producer, item("k1", "chat"));
    assert!(
        waiting.join().unwrap(),
        "wake-ups: the waiter timed out after {LIMIT:?}"
    );
}

#[test]
fn bad_urls_schemas_and_an_unreachable_server_are_typed_errors() {
    for url in [
        "postgres://sekrit:pw@host:notaport/db",
        "sekrit not a url = = =",
    ] {
        match PgEngine::open(url, DEFAULT_SCHEMA, Hasher::Plain) {
            Err(Error::InvalidConfig {
                setting: "url",
                reason,
            }) => {
                assert!(
                    !reason.contains("sekrit"),
                    "the URL is not echoed: {reason}"
                );
            }
            other => panic!("{url:?} must be refused as a URL, got {other:?}"),
        }
    }
    for schema in ["", "Upper", "1st", "with-dash", "x\"; DROP TABLE y; --"] {
        assert!(
            matches!(
                PgEngine::open("postgres://u@127.0.0.1/db", schema, Hasher::Plain),
                Err(Error::InvalidConfig {
                    setting: "schema",
                    ..
                })
            ),
            "{schema:?} must be refused"
        );
    }
    // A port nobody listens on: refused at once, as a typed error.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    match PgEngine::open(
        &format!("postgres://u@127.0.0.1:{port}/db"),
        DEFAULT_SCHEMA,
        Hasher::Plain,
    ) {
        Err(Error::Database { op: "connect", .. }) => {}
        other => panic!("an unreachable server must be a typed error, got {other:?}"),
    }
}

#[test]
fn a_transaction_mode_pooler_is_refused_before_anything_is_written_a_session_pool_works() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let Some(transaction_pool) = server.pgbouncer("transaction") else {
        return;
    };
    match PgEngine::open(
        &transaction_pool.url(db.name()),
        DEFAULT_SCHEMA,
        Hasher::Plain,
    ) {
        Err(Error::SessionLocksUnavailable { reason }) => {
            assert!(reason.contains("transaction-mode pooler"), "{reason}");
        }
        other => panic!("a transaction-mode pooler must be refused, got {other:?}"),
    }
    assert_eq!(
        db.psql(&format!(
            "SELECT count(*) FROM pg_namespace WHERE nspname = '{DEFAULT_SCHEMA}'"
        )),
        "0",
        "nothing was created"
    );
    let session_pool = server.pgbouncer("session").expect("pgbouncer started once");
    let outbox = crate::Outbox::postgres(&session_pool.url(db.name()))
        .open()
        .expect("a session pool keeps each handle's session: opened");
    outbox
        .enqueue(crate::NewMessage {
            idempotency_key: "k1".into(),
            connector: "telegram".into(),
            grant_id: "bot-1".into(),
            destination: "chat".into(),
            content: "hello".into(),
            ..Default::default()
        })
        .unwrap();
    let receipt = outbox.process("k1", |_| Ok(None)).unwrap();
    assert_eq!(receipt.outcome, crate::Outcome::Sent);
}

#[test]
fn a_version_1_schema_migrates_forward_keeping_items_and_their_order() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let url = db.url();
    let mut client = super::Connector::parse(&url).unwrap().connect().unwrap();
    super::schema::migrate_to(&mut client, DEFAULT_SCHEMA, 1).unwrap();
    assert_eq!(
        db.psql("SELECT version FROM durable_outbox.outbox_meta"),
        "1"
    );
    // Two items as the first stage wrote them: no seq, created or updated columns.
    for key in ["b-first", "a-second"] {
        let doc = String::from_utf8(crate::store::item_to_json(&item(key, "chat-1"))).unwrap();
        client
            .execute(
                "INSERT INTO durable_outbox.items (idempotency_key, revision, destination, state,
                   claimed, claim_owner, next_attempt_at, transport_ref, doc)
                 VALUES ($1, 1, 'chat-1', 'queued', false, NULL, NULL, NULL, $2)",
                &[&key, &doc],
            )
            .unwrap();
    }
    drop(client);
    let engine = open(&url);
    assert_eq!(
        db.psql("SELECT version FROM durable_outbox.outbox_meta"),
        super::SCHEMA_VERSION.to_string()
    );
    let listed: Vec<(String, Option<u64>)> = engine
        .live_items(Utc::now())
        .unwrap()
        .into_iter()
        .map(|item| (item.idempotency_key, item.seq))
        .collect();
    assert_eq!(
        listed,
        [
            ("a-second".to_owned(), Some(2)),
            ("b-first".to_owned(), Some(1))
        ],
        "each item's place in line is its enqueue order"
    );
    // The sequence continues after them, and the rules' transaction runs on them.
    let head = engine
        .transact(Utc::now(), &defaults(), Scope::Any, |txn| {
            assert_eq!(txn.next_seq("chat-1").unwrap(), 3);
            Ok(txn.head_of("chat-1").unwrap().map(|place| place.key))
        })
        .unwrap();
    assert_eq!(head.as_deref(), Some("b-first"));
}

/// How many committed audit events wait to be sealed.
fn pending(db: &super::test_server::PgDatabase<'_>) -> usize {
    db.psql(&format!(
        "SELECT count(*) FROM {DEFAULT_SCHEMA}.audit_pending"
    ))
    .trim()
    .parse()
    .unwrap()
}

/// A panic inside a transaction of the rules (a bug in a rule, or in what it
/// calls) unwinds out of the call and commits nothing; the handle goes on
/// as before: its next call, alone, seals its own commit's events before it
/// returns, as if the panicking transaction had never run (it does not stay
/// counted as running, which would leave each commit's events pending).
#[test]
fn a_panic_in_a_transaction_leaves_later_commits_sealed_when_they_return() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let engine = open(&db.url());
    enqueue(&engine, item("before", "chat"));
    assert_eq!(pending(&db), 0, "a lone call seals its own commit");
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        engine.transact(
            Utc::now(),
            &defaults(),
            Scope::Any,
            |_| -> crate::Result<()> { panic!("a bug in a rule") },
        )
    }));
    assert!(panicked.is_err(), "the panic reaches the caller");
    for n in 0..3 {
        enqueue(&engine, item(&format!("after-{n}"), "chat"));
        assert_eq!(
            pending(&db),
            0,
            "after-{n}: a lone call after a panicked transaction left its events pending"
        );
    }
    assert_eq!(engine.verify_audit().unwrap().records, 4);
}

/// A panic while a thread seals after its commit (here a fault point; in
/// production a bug) does not stop the handle's sealing for good: the next
/// commit is sealed when its call returns.
#[test]
fn a_panic_while_sealing_after_a_commit_leaves_later_commits_sealed() {
    use crate::FailAction;
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let engine = open(&db.url());
    engine
        .faults
        .arm("postgres.seal_after_commit", FailAction::Panic);
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        enqueue(&engine, item("a", "chat"));
    }));
    assert!(panicked.is_err(), "the sealing panicked");
    assert_eq!(pending(&db), 1, "committed, not sealed");
    // The fault is gone (armed again as a pass).
    engine
        .faults
        .arm("postgres.seal_after_commit", FailAction::DelayMs(0));
    enqueue(&engine, item("b", "chat"));
    assert_eq!(
        pending(&db),
        0,
        "the next commit after a panicked sealing was not sealed"
    );
    assert_eq!(engine.verify_audit().unwrap().records, 2);
}

/// A one-item transaction reads its destination's send times with their
/// items' keys in one statement (`txn::read_line`): the times of an item the
/// transaction changed are its new ones, not the committed ones, so each
/// committed time must stay paired with its own key.
#[test]
fn a_destination_s_send_times_stay_paired_with_their_items_in_one_transaction() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let engine = open(&db.url());
    for key in ["a", "b", "c"] {
        enqueue(&engine, item(key, "chat-1"));
    }
    // PostgreSQL keeps microseconds.
    let now = chrono::SubsecRound::trunc_subsecs(Utc::now(), 6);
    // Committed send times, in an order that is not the keys' order:
    // a latest, b earliest.
    let ago = |secs: i64| now - chrono::Duration::seconds(secs);
    let (at_a, at_b, at_c) = (ago(1), ago(3), ago(2));
    let mut client = super::Connector::parse(&db.url())
        .unwrap()
        .connect()
        .unwrap();
    for (key, at) in [("a", at_a), ("b", at_b), ("c", at_c)] {
        client
            .execute(
                "INSERT INTO durable_outbox.rate_times (idempotency_key, destination, at)
                 VALUES ($1, 'chat-1', $2)",
                &[&key, &at],
            )
            .unwrap();
    }
    let mut settings = defaults();
    settings.rates.per_destination = crate::RateLimit {
        count: 10,
        window: Duration::from_secs(60),
    };
    let times = engine
        .transact(now, &settings, Scope::OneItem("a"), |txn| {
            let all = txn.destination_times("chat-1", ago(30))?;
            // `a` changed in this transaction (still queued, unclaimed: it
            // counts no time of its own now).
            txn.item_mut("a")?.attempts = 0;
            let without_a = txn.destination_times("chat-1", ago(30))?;
            Ok((all, without_a))
        })
        .unwrap();
    let sorted = |mut v: Vec<chrono::DateTime<Utc>>| {
        v.sort();
        v
    };
    assert_eq!(
        sorted(times.0),
        vec![at_b, at_c, at_a],
        "every committed time"
    );
    assert_eq!(
        sorted(times.1),
        vec![at_b, at_c],
        "a's committed time, and only a's, left out once a changed"
    );
}

/// An enqueue's place in line is taken under its destination's lock held
/// *shared* until the transaction ends (`txn::next_seq`: the lock and
/// `nextval` are one statement): other enqueues of the destination take
/// theirs meanwhile, and a decision that reads the line (which takes the lock
/// exclusive, as a claim's `head_of` does here) waits, so it never passes
/// over a sequence taken but not yet committed.
#[test]
fn an_enqueue_sequence_is_taken_under_its_destination_s_lock() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let engine = open(&db.url());
    let mut other = super::Connector::parse(&db.url())
        .unwrap()
        .connect()
        .unwrap();
    let destination_lock = super::lock_key(DEFAULT_SCHEMA, "dest:chat-1");
    // Whether another session could take the lock in each mode (taken in a
    // transaction rolled back at once).
    let mut free = |shared: bool| -> bool {
        let sql = if shared {
            "SELECT pg_try_advisory_xact_lock_shared($1)"
        } else {
            "SELECT pg_try_advisory_xact_lock($1)"
        };
        let mut tx = other.transaction().unwrap();
        let free = tx.query_one(sql, &[&destination_lock]).unwrap().get(0);
        tx.rollback().unwrap();
        free
    };
    let seqs = engine
        .transact(Utc::now(), &defaults(), Scope::OneItem("k"), |txn| {
            let first = txn.next_seq("chat-1")?;
            assert!(
                !free(false),
                "a decision about the destination waits once a sequence is taken"
            );
            assert!(
                free(true),
                "another enqueue of the destination takes its sequence meanwhile"
            );
            let second = txn.next_seq("chat-1")?;
            Ok((first, second))
        })
        .unwrap();
    assert!(seqs.1 > seqs.0, "each call takes a new sequence: {seqs:?}");
    assert!(free(false), "the lock ends with the transaction");
    // An enqueue takes its place when the transaction opens, under the same
    // lock, and hands it out to the rule's first `next_seq`.
    let opened = engine
        .transact(
            Utc::now(),
            &defaults(),
            Scope::Enqueue("k", "chat-1"),
            |txn| {
                assert!(
                    !free(false) && free(true),
                    "an enqueue holds its destination's lock shared from its opening on"
                );
                let first = txn.next_seq("chat-1")?;
                let second = txn.next_seq("chat-1")?;
                Ok((first, second))
            },
        )
        .unwrap();
    assert!(
        opened.0 > seqs.1 && opened.1 > opened.0,
        "places taken at the opening and after it are new and in order: {seqs:?} {opened:?}"
    );
    assert!(free(false), "the lock ends with the transaction");
    engine
        .transact(Utc::now(), &defaults(), Scope::OneItem("k"), |txn| {
            txn.head_of("chat-1")?;
            assert!(
                !free(true),
                "no enqueue takes a sequence while a decision reads the line"
            );
            // Held exclusive already: a sequence taken now needs no more.
            txn.next_seq("chat-1")
        })
        .unwrap();
    assert!(free(false), "the lock ends with the transaction");
}

/// Two hosts enqueue one message: the second's opening statement waits for
/// the key's lock while the first commits the key's row. The second answers
/// with that item, as an enqueue of a key already in the outbox does; it
/// writes no second row and no second `queued` record. (Its opening
/// statement reads the row with a snapshot taken before the wait, so the row
/// reads as absent: `PgEngine::open_txn` runs such a transaction again once
/// its insert meets the row.)
#[test]
fn an_enqueue_that_waited_for_its_key_while_another_host_enqueued_it_answers_with_that_item() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let first = open(&db.url());
    let second = open(&db.url());
    let mut watcher = super::Connector::parse(&db.url())
        .unwrap()
        .connect()
        .unwrap();
    let message = crate::NewMessage {
        idempotency_key: "k".into(),
        connector: "telegram".into(),
        grant_id: "bot-1".into(),
        destination: "chat-1".into(),
        content: "hello".into(),
        ..Default::default()
    };
    let hash = content_hash(&message.content);
    let (inside, inside_seen) = std::sync::mpsc::channel::<()>();
    let (go, go_seen) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|scope| {
        let (first, message, hash) = (&first, &message, &hash);
        let holder = scope.spawn(move || {
            first.transact(Utc::now(), &defaults(), Scope::OneItem("k"), |txn| {
                let item = insert_message(txn, message, hash)?;
                inside.send(()).unwrap();
                go_seen
                    .recv_timeout(LIMIT)
                    .expect("watchdog: the test never let the first enqueue commit");
                Ok(item)
            })
        });
        inside_seen
            .recv_timeout(LIMIT)
            .expect("watchdog: the first enqueue never held the key's lock");
        let second = &second;
        let racer = scope.spawn(move || {
            second.transact(Utc::now(), &defaults(), Scope::OneItem("k"), |txn| {
                insert_message(txn, message, hash)
            })
        });
        // The second enqueue's opening statement waits for the key's lock.
        until_an_advisory_lock_is_awaited(
            &mut watcher,
            "the second enqueue never waited for the key's lock",
        );
        go.send(()).unwrap();
        let enqueued = holder.join().unwrap().expect("the first enqueue commits");
        let answered = racer
            .join()
            .unwrap()
            .expect("the second enqueue of the key answers, not fails");
        assert_eq!(
            answered.last_audit_id, enqueued.last_audit_id,
            "the second enqueue answers with the item the first one wrote"
        );
    });
    let report = first.verify_audit().unwrap();
    assert_eq!(report.records, 1, "one `queued` record for the one item");
    assert_eq!(
        db.psql("SELECT count(*) FROM durable_outbox.items"),
        "1",
        "one row for the key"
    );
}

/// A one-item transaction waiting at the writers' gate holds no lock on its
/// item's row: its opening statement reads the row only once the gate is
/// passed (`PgEngine::open_txn`, the lock order of `txn`). So a writer that
/// holds the gate exclusive (a drain step, a bulk action) can lock any row
/// without waiting for one that waits for it.
#[test]
fn a_one_item_transaction_waiting_at_the_gate_holds_no_row_lock() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let engine = open(&db.url());
    enqueue(&engine, item("k", "chat-1"));
    let mut other = super::Connector::parse(&db.url())
        .unwrap()
        .connect()
        .unwrap();
    let mut gate_holder = other.transaction().unwrap();
    gate_holder
        .execute(
            "SELECT pg_advisory_xact_lock($1)",
            &[&super::lock_key(DEFAULT_SCHEMA, "writers")],
        )
        .unwrap();
    std::thread::scope(|scope| {
        let engine = &engine;
        let waiter = scope.spawn(move || {
            engine.transact(Utc::now(), &defaults(), Scope::OneItem("k"), |txn| {
                Ok(txn.item("k")?.map(|item| item.state))
            })
        });
        until_an_advisory_lock_is_awaited(
            &mut gate_holder,
            "the one-item transaction never waited at the gate",
        );
        let row = gate_holder.query(
            "SELECT 1 FROM durable_outbox.items WHERE idempotency_key = 'k' FOR UPDATE NOWAIT",
            &[],
        );
        assert!(
            row.is_ok(),
            "the item's row was locked by a transaction still waiting at the gate: {row:?}"
        );
        gate_holder.rollback().unwrap();
        let state = waiter
            .join()
            .unwrap()
            .expect("the one-item transaction runs once the gate is free");
        assert_eq!(state, Some(ItemState::Queued));
    });
}

/// Waits until some session waits for an advisory lock (seen in `pg_locks`
/// through `conn`); `what` names the wait in the watchdog's message.
fn until_an_advisory_lock_is_awaited(conn: &mut impl postgres::GenericClient, what: &str) {
    let deadline = std::time::Instant::now() + LIMIT;
    while conn
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
            &[],
        )
        .unwrap()
        .get::<_, i64>(0)
        == 0
    {
        assert!(std::time::Instant::now() < deadline, "watchdog: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// One case of [`a_cap_s_nth_newest_time_equals_the_naive_count_over_every_time`]:
/// committed send times, the items a transaction changes, and what it asks.
#[derive(Debug, Clone)]
struct RateCase {
    /// `(key, seconds before now)`: key `k<i>` sends to `chat-<i % 2>`.
    committed: Vec<(usize, i64)>,
    /// `(key, destination, kind, seconds before now, another)`: an item the
    /// transaction puts, of any key (one with committed times or not) and to
    /// any destination (its key's committed one, or another).
    overlay: Vec<(usize, usize, u8, i64, i64)>,
    /// `(destination or the global cap, as the cap asks, seconds before now, n)`.
    asks: Vec<(Option<usize>, bool, i64, usize)>,
    count: u32,
    window: u64,
    /// The transaction's scope: a drain step's, a one-item transaction's,
    /// or a claim's decision about `k0`, queued in `chat-0` by the handle
    /// (which then reads that line as the transaction opens:
    /// `PgEngine::open_txn`).
    scope: RateScope,
    /// Whether the destination's line is read (`head_of`, as a claim does)
    /// before each ask, and whether the items are put before it.
    line_first: bool,
    overlay_first: bool,
}

/// The scope of a [`RateCase`]'s transaction.
#[derive(Debug, Clone, Copy)]
enum RateScope {
    Any,
    OneItem,
    Decide,
}

fn rate_case() -> impl proptest::strategy::Strategy<Value = RateCase> {
    use proptest::prelude::*;
    (
        prop::collection::vec((0..6usize, 0..8i64), 0..16),
        prop::collection::vec((0..7usize, 0..3usize, 0..5u8, 0..8i64, 0..8i64), 0..4),
        prop::collection::vec(
            (
                prop::option::weighted(0.8, 0..3usize),
                any::<bool>(),
                0..9i64,
                1..7usize,
            ),
            1..4,
        ),
        1..3u32,
        1..9u64,
        prop_oneof![
            Just(RateScope::Any),
            Just(RateScope::OneItem),
            Just(RateScope::Decide)
        ],
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(
            |(committed, overlay, asks, count, window, scope, line_first, overlay_first)| {
                RateCase {
                    committed,
                    overlay,
                    asks,
                    count,
                    window,
                    scope,
                    line_first,
                    overlay_first,
                }
            },
        )
}

/// The overlay item of `RateCase::overlay`'s entry, at `now`.
fn overlay_item(
    (key, destination, kind, ago, other): (usize, usize, u8, i64, i64),
    now: chrono::DateTime<Utc>,
) -> OutboxItem {
    let at = now - chrono::Duration::seconds(ago);
    let other = now - chrono::Duration::seconds(other);
    let mut item = item(&format!("k{key}"), &format!("chat-{destination}"));
    match kind {
        // Claimed: its claim counts.
        0 => {
            item.claim = Some(crate::item::Claim {
                owner: Some("someone".into()),
                at: Some(at),
            });
        }
        // Sent.
        1 => {
            item.state = ItemState::Sent;
            item.sent_at = Some(at);
        }
        // Sent, after an earlier send that may have left.
        2 => {
            item.state = ItemState::Sent;
            item.sent_at = Some(at);
            item.maybe_sent_at = Some(other);
        }
        // Failed after a send that may have left.
        3 => {
            item.state = ItemState::Failed;
            item.maybe_sent_at = Some(at);
        }
        // Queued, counting nothing (its committed times leave the count).
        _ => {}
    }
    item
}

/// A committed send time: key, destination, time.
type CommittedTime = (String, String, chrono::DateTime<Utc>);

/// Replaces the send times and items of the test database with `case`'s
/// committed times (one transaction); returns them.
fn load_rate_case(
    client: &mut postgres::Client,
    case: &RateCase,
    ago: impl Fn(i64) -> chrono::DateTime<Utc>,
) -> Vec<CommittedTime> {
    let mut committed: Vec<CommittedTime> = Vec::new();
    for (key, secs) in &case.committed {
        let row = (format!("k{key}"), format!("chat-{}", key % 2), ago(*secs));
        if !committed.iter().any(|c| c.0 == row.0 && c.2 == row.2) {
            committed.push(row);
        }
    }
    let column = |i: usize| -> Vec<String> {
        committed
            .iter()
            .map(|row| match i {
                0 => row.0.clone(),
                1 => row.1.clone(),
                _ => row.2.to_rfc3339(),
            })
            .collect()
    };
    let mut setup = client.transaction().unwrap();
    setup
        .batch_execute("DELETE FROM durable_outbox.items; DELETE FROM durable_outbox.rate_times")
        .unwrap();
    setup
        .execute(
            "INSERT INTO durable_outbox.rate_times (idempotency_key, destination, at)
             SELECT k, d, a::timestamptz FROM unnest($1::text[], $2::text[], $3::text[])
               AS t(k, d, a)",
            &[&column(0), &column(1), &column(2)],
        )
        .unwrap();
    setup.commit().unwrap();
    committed
}

/// The naive answer to each ask: `rate::nth_newest` over every committed
/// time of the destination (or all) whose item is not in `changed`, and the
/// changed items' own times.
fn naive_answers(
    committed: &[CommittedTime],
    changed: &std::collections::BTreeMap<String, OutboxItem>,
    asks: &[(Option<String>, chrono::DateTime<Utc>, usize)],
) -> Vec<Option<chrono::DateTime<Utc>>> {
    asks.iter()
        .map(|(destination, after, n)| {
            let matches = |d: &str| destination.as_deref().is_none_or(|want| want == d);
            let times = committed
                .iter()
                .filter(|(key, d, _)| matches(d) && !changed.contains_key(key))
                .map(|(_, _, at)| *at)
                .chain(
                    changed
                        .values()
                        .filter(|item| matches(&item.destination))
                        .flat_map(crate::store::rate_times),
                );
            crate::rate::nth_newest(times, *after, *n)
        })
        .collect()
}

/// A cap's question (`Txn::nth_newest_time`: the `n`-th newest time in a
/// window) read from PostgreSQL's newest end, bounded by `n` and served from a
/// claim's line when the line holds the answer, gives what the naive count
/// over every committed time, less the changed items' committed times, plus
/// their own times (`rate::nth_newest`), gives: ties, fewer than `n` times, `n`
/// beyond every row, a window reaching before the line's, items that moved
/// destination, one-item and drain transactions.
#[test]
fn a_cap_s_nth_newest_time_equals_the_naive_count_over_every_time() {
    use proptest::test_runner::{Config, TestCaseError, TestRunner};
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let engine = open(&db.url());
    // `TestRunner::run` takes a `Fn`: the client is borrowed per case.
    let client = std::cell::RefCell::new(
        super::Connector::parse(&db.url())
            .unwrap()
            .connect()
            .unwrap(),
    );
    // PostgreSQL keeps microseconds; whole seconds make ties common.
    let now = chrono::SubsecRound::trunc_subsecs(Utc::now(), 0);
    let ago = |secs: i64| now - chrono::Duration::seconds(secs);
    let cases = std::env::var("OUTBOX_PG_RATE_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(128);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&rate_case(), |case| {
        let committed = load_rate_case(&mut client.borrow_mut(), &case, ago);
        let overlay: Vec<OutboxItem> = case
            .overlay
            .iter()
            .map(|entry| overlay_item(*entry, now))
            .collect();
        // The transaction's items, the last of one key winning.
        let mut changed = std::collections::BTreeMap::<String, OutboxItem>::new();
        for item in &overlay {
            changed.insert(item.idempotency_key.clone(), item.clone());
        }
        let mut settings = defaults();
        settings.rates.per_destination = crate::RateLimit {
            count: case.count,
            window: Duration::from_secs(case.window),
        };
        let asks: Vec<(Option<String>, chrono::DateTime<Utc>, usize)> = case
            .asks
            .iter()
            .map(|(destination, as_cap, secs, n)| {
                let destination = destination.map(|d| format!("chat-{d}"));
                if *as_cap && destination.is_some() {
                    (destination, ago(case.window as i64), case.count as usize)
                } else {
                    (destination, ago(*secs), *n)
                }
            })
            .collect();
        let expected = naive_answers(&committed, &changed, &asks);
        let scope = match case.scope {
            RateScope::Decide => {
                // Queued by this handle: its decision reads the line of
                // `chat-0` as it opens (used when the rule's first read is
                // of that line, before any change).
                enqueue(&engine, item("k0", "chat-0"));
                Scope::Decide("k0")
            }
            RateScope::OneItem => Scope::OneItem("k0"),
            RateScope::Any => Scope::Any,
        };
        let got = engine
            .transact(now, &settings, scope, |txn| {
                let put = |txn: &mut super::txn::PgTxn<'_, '_>| -> crate::Result<()> {
                    for item in &overlay {
                        crate::rules::txn::Txn::insert(txn, item.clone())?;
                    }
                    Ok(())
                };
                if case.overlay_first {
                    put(txn)?;
                }
                let mut got = Vec::new();
                for (destination, after, n) in &asks {
                    if case.line_first
                        && let Some(destination) = destination
                    {
                        txn.head_of(destination)?;
                    }
                    got.push(txn.nth_newest_time(destination.as_deref(), *after, *n)?);
                }
                if !case.overlay_first {
                    // Asked again once the items changed.
                    put(txn)?;
                    got.clear();
                    for (destination, after, n) in &asks {
                        got.push(txn.nth_newest_time(destination.as_deref(), *after, *n)?);
                    }
                }
                Ok(got)
            })
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        proptest::prop_assert_eq!(got, expected, "asks {:?}", asks);
        Ok(())
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
}

/// A claim's line read sends back at most three of its destination's send
/// times with their keys (the newest, and the two its own item may hold),
/// however many sends the window holds: the cap's answer is found on the
/// server.
#[test]
fn a_claim_reads_no_more_send_times_than_its_cap_needs() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let engine = open(&db.url());
    let now = chrono::SubsecRound::trunc_subsecs(Utc::now(), 6);
    // 600 sends in the last minute: 10 a second.
    db.psql(
        "INSERT INTO durable_outbox.rate_times (idempotency_key, destination, at)
         SELECT 'sent-' || i, 'chat-1', now() - i * interval '100 milliseconds'
         FROM generate_series(1, 600) i",
    );
    enqueue(&engine, item("next", "chat-1"));
    let mut settings = defaults();
    settings.rates.per_destination = crate::RateLimit {
        count: 20,
        window: Duration::from_secs(120),
    };
    let (read, capped) = engine
        .transact(now, &settings, Scope::Decide("next"), |txn| {
            txn.head_of("chat-1")?;
            let read = txn.line_times_read("chat-1");
            let capped =
                txn.nth_newest_time(Some("chat-1"), now - chrono::Duration::seconds(120), 20)?;
            Ok((read, capped))
        })
        .unwrap();
    assert!(
        read.is_some_and(|read| read <= 3),
        "the line read {read:?} send times with their keys"
    );
    assert!(capped.is_some(), "600 sends in the window fill a cap of 20");
}

#[test]
fn an_open_that_may_not_upgrade_refuses_an_older_schema_writing_nothing() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let url = db.url();
    let previous = super::SCHEMA_VERSION - 1;
    let mut client = super::Connector::parse(&url).unwrap().connect().unwrap();
    super::schema::migrate_to(&mut client, DEFAULT_SCHEMA, previous).unwrap();
    drop(client);
    // The version row as stored (`xmin` changes with any write of it, even
    // of the same value), the tables' columns, and the registered owners.
    let stored = || {
        db.psql(
            "SELECT (SELECT version || '@' || xmin FROM durable_outbox.outbox_meta) \
             || ' ' || (SELECT string_agg(table_name || '.' || column_name, ',' \
                          ORDER BY table_name, column_name) \
                        FROM information_schema.columns WHERE table_schema = 'durable_outbox') \
             || ' owners ' || (SELECT count(*) FROM durable_outbox.owners)",
        )
    };
    let before = stored();
    // The operator tool's open.
    let look = || {
        crate::Outbox::postgres(&url)
            .compact_on_open(false)
            .create_if_missing(false)
            .upgrade_schema(false)
            .open()
    };
    match look() {
        Err(Error::SchemaUpgradeNeeded {
            schema,
            found,
            known,
        }) => assert_eq!(
            (schema.as_str(), found, known),
            (DEFAULT_SCHEMA, previous, super::SCHEMA_VERSION)
        ),
        other => panic!("an older schema must be refused, got {other:?}"),
    }
    assert_eq!(stored(), before, "nothing written");

    // A bot's open (the default) migrates it, as it always has.
    drop(crate::Outbox::postgres(&url).open().unwrap());
    assert_eq!(
        db.psql("SELECT version FROM durable_outbox.outbox_meta"),
        super::SCHEMA_VERSION.to_string()
    );
    // Then the tool's open goes on, and writes no new version row.
    let row = db.psql("SELECT xmin FROM durable_outbox.outbox_meta");
    drop(look().unwrap());
    assert_eq!(db.psql("SELECT xmin FROM durable_outbox.outbox_meta"), row);
    // Creating an outbox is not upgrading one.
    drop(
        crate::Outbox::postgres(&url)
            .schema("fresh")
            .upgrade_schema(false)
            .open()
            .unwrap(),
    );
    assert_eq!(
        db.psql("SELECT version FROM fresh.outbox_meta"),
        super::SCHEMA_VERSION.to_string()
    );
    // A directory has no schema to upgrade.
    let dir = tempfile::tempdir().unwrap();
    assert!(matches!(
        crate::Outbox::builder(dir.path())
            .upgrade_schema(false)
            .open(),
        Err(Error::InvalidConfig {
            setting: "upgrade_schema",
            ..
        })
    ));
}

#[test]
fn a_version_3_schema_migrates_to_4_keeping_items_their_order_and_lookups() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let url = db.url();
    let mut client = super::Connector::parse(&url).unwrap().connect().unwrap();
    super::schema::migrate_to(&mut client, DEFAULT_SCHEMA, 3).unwrap();
    // Items as version 3 wrote them (its statements are today's: neither
    // names `enqueue_order`), one of them sent with a transport reference.
    let mut sent = item("sent-one", "chat-1");
    sent.state = ItemState::Sent;
    sent.attempts = 1;
    sent.sent_at = Some(sent.updated_at);
    sent.transport_ref = Some("msg-77".into());
    sent.seq = Some(1);
    let mut queued = item("queued-one", "chat-1");
    queued.seq = Some(2);
    for item in [&sent, &queued] {
        let row = super::rows::NewRow::of(item);
        let written = client
            .execute(
                &super::rows::insert_item_sql("durable_outbox"),
                &row.params(),
            )
            .unwrap();
        assert_eq!(written, 1);
    }
    client
        .execute("SELECT setval('durable_outbox.enqueue_seq', 3, false)", &[])
        .unwrap();
    drop(client);

    let engine = open(&url);
    assert_eq!(
        db.psql("SELECT version FROM durable_outbox.outbox_meta"),
        super::SCHEMA_VERSION.to_string()
    );
    assert_eq!(
        db.psql(
            "SELECT count(*) FROM information_schema.columns
             WHERE table_schema = 'durable_outbox' AND table_name = 'items'
               AND column_name = 'enqueue_order'"
        ),
        "0",
        "version 4 drops the column nothing reads, and its indexes"
    );
    let listed: Vec<(String, Option<u64>)> = engine
        .live_items(Utc::now() - chrono::Duration::hours(1))
        .unwrap()
        .into_iter()
        .map(|item| (item.idempotency_key, item.seq))
        .collect();
    assert_eq!(
        listed,
        [
            ("queued-one".to_owned(), Some(2)),
            ("sent-one".to_owned(), Some(1))
        ]
    );
    let found = engine.find_ref(Some("chat-1"), "msg-77").unwrap();
    assert_eq!(
        found.map(|item| item.idempotency_key).as_deref(),
        Some("sent-one"),
        "the transport reference is still found"
    );
    assert_eq!(
        db.psql(
            "SELECT count(*) FROM pg_indexes WHERE schemaname = 'durable_outbox'
               AND tablename = 'items' AND indexdef LIKE '%(transport_ref, idempotency_key)%'"
        ),
        "1",
        "the lookup keeps an index"
    );
    // The rules run on the migrated table: a new item takes the next place.
    enqueue(&engine, item("after", "chat-1"));
    assert_eq!(
        engine.item("after").unwrap().and_then(|item| item.seq),
        Some(3)
    );
    assert!(engine.verify_audit().is_ok());
}

/// A session that `LISTEN`s on the default schema's wake-up channel.
fn listen(url: &str) -> postgres::Client {
    let mut client = postgres::Client::connect(url, postgres::NoTls).unwrap();
    client
        .batch_execute(&format!(
            "LISTEN \"{}\"",
            super::notify::channel(DEFAULT_SCHEMA)
        ))
        .unwrap();
    client
}

/// Takes `n` notifications from `listener` (each within [`LIMIT`]), then
/// any more already there; how many in all.
fn hear(listener: &mut postgres::Client, n: u64) -> u64 {
    use postgres::fallible_iterator::FallibleIterator;
    let mut notifications = listener.notifications();
    for heard in 0..n {
        assert!(
            notifications.timeout_iter(LIMIT).next().unwrap().is_some(),
            "wake-ups: heard {heard} of {n} notifications within {LIMIT:?}"
        );
    }
    n + u64::try_from(notifications.iter().count().unwrap()).unwrap()
}

/// Waits until no session has server process id `pid`.
fn until_the_session_is_gone(db: &super::test_server::PgDatabase<'_>, pid: i32, what: &str) {
    until(what, || {
        let left = db.psql(&format!(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = {pid}"
        ));
        (left == "0").then_some(())
    });
}

/// Polls `probe` until it answers, under a watchdog naming `what`.
fn until<T>(what: &str, mut probe: impl FnMut() -> Option<T>) -> T {
    let deadline = std::time::Instant::now() + LIMIT;
    loop {
        if let Some(answer) = probe() {
            return answer;
        }
        assert!(std::time::Instant::now() < deadline, "watchdog: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_burst_of_commits_sends_far_fewer_notifies_than_commits_and_one_after_the_last() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    // A longer interval than the default, so that "far fewer" holds however
    // slowly a loaded machine commits (it is bounded by the interval below).
    let interval = Duration::from_millis(50);
    let engine = PgEngine::open_with(
        &db.url(),
        DEFAULT_SCHEMA,
        Hasher::Plain,
        interval,
        crate::builder::Create::IfMissing,
        super::Versioning::CURRENT,
        super::MAX_CONNECTIONS,
    )
    .unwrap();
    let mut listener = listen(&db.url());
    let (threads, each) = (8, 50);
    let start = std::time::Instant::now();
    std::thread::scope(|scope| {
        for t in 0..threads {
            let engine = &engine;
            scope.spawn(move || {
                for i in 0..each {
                    enqueue(engine, item(&format!("t{t}-{i}"), &format!("chat-{t}")));
                }
            });
        }
    });
    let stats = engine.wake.settled(LIMIT);
    let elapsed = start.elapsed();
    let commits = threads * each;
    eprintln!(
        "wake-ups: {} NOTIFYs for {commits} commits in {elapsed:?}",
        stats.sent
    );
    assert_eq!(stats.requested, commits, "every enqueue requests a wake-up");
    assert_eq!(
        stats.covered, commits,
        "wake-ups: the last commit of the burst must have a NOTIFY sent after it"
    );
    // What the server delivered is what the sender says it sent.
    assert_eq!(hear(&mut listener, stats.sent), stats.sent);
    assert!(stats.sent >= 1);
    assert!(
        u128::from(stats.sent) <= 1 + elapsed.as_millis() / interval.as_millis(),
        "wake-ups: {} NOTIFYs in {elapsed:?} exceed one per coalescing interval",
        stats.sent
    );
    assert!(
        stats.sent * 4 <= commits,
        "wake-ups: {} NOTIFYs for {commits} commits in {elapsed:?} are not far fewer",
        stats.sent
    );
}

#[test]
fn only_a_commit_that_succeeded_requests_a_wake_up_and_its_change_is_visible_when_it_comes() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let engine = open(&db.url());
    let mut listener = listen(&db.url());
    // An insert of key `refused` fails at `COMMIT` (a deferred trigger).
    db.psql(&format!(
        "CREATE FUNCTION public.refuse() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN RAISE EXCEPTION 'refused at commit'; END $$; \
         CREATE CONSTRAINT TRIGGER refuse AFTER INSERT ON {DEFAULT_SCHEMA}.items \
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW \
         WHEN (NEW.idempotency_key = 'refused') EXECUTE FUNCTION public.refuse()"
    ));
    let message = |key: &str| crate::NewMessage {
        idempotency_key: key.into(),
        connector: "telegram".into(),
        grant_id: "bot-1".into(),
        destination: "chat".into(),
        content: "body".into(),
        ..Default::default()
    };
    let refused = message("refused");
    let failed = engine.transact(Utc::now(), &defaults(), Scope::OneItem("refused"), |txn| {
        insert_message(txn, &refused, &content_hash("body"))
    });
    assert!(
        matches!(failed, Err(Error::Database { op: "commit", .. })),
        "the commit fails: {failed:?}"
    );
    let rolled_back = message("rolled-back");
    let failed = engine.transact(
        Utc::now(),
        &defaults(),
        Scope::OneItem("rolled-back"),
        |txn| {
            insert_message(txn, &rolled_back, &content_hash("body"))?;
            Err::<(), _>(Error::invalid_config("test", "the caller gives up"))
        },
    );
    assert!(failed.is_err());
    assert_eq!(
        engine.wake.stats().requested,
        0,
        "wake-ups: a failed commit or a rollback must not request one"
    );
    enqueue(&engine, item("committed", "chat"));
    assert_eq!(engine.wake.settled(LIMIT).sent, 1);
    assert_eq!(hear(&mut listener, 1), 1, "one wake-up, for the one commit");
    // Once it is heard, the change it announces is there to read.
    let keys: Vec<String> = listener
        .query(
            &format!("SELECT idempotency_key FROM {DEFAULT_SCHEMA}.items"),
            &[],
        )
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(keys, ["committed"]);
}

#[test]
fn a_terminated_wake_up_connection_is_replaced_and_never_fails_a_commit() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let engine = open(&db.url());
    let mut listener = listen(&db.url());
    enqueue(&engine, item("before", "chat"));
    let before = engine.wake.settled(LIMIT);
    assert_eq!(hear(&mut listener, 1), 1);
    let pid = before
        .pid
        .expect("the sender connected for its first NOTIFY");
    db.psql(&format!("SELECT pg_terminate_backend({pid})"));
    until_the_session_is_gone(&db, pid, "the terminated wake-up session ends");
    // The commit succeeds, and its wake-up still goes out, on a new session.
    enqueue(&engine, item("after", "chat"));
    let after = engine.wake.settled(LIMIT);
    assert_eq!(
        (after.covered, after.sent),
        (2, 2),
        "wake-ups: the NOTIFY that met the dead connection must be sent on a new one"
    );
    assert_ne!(after.pid, Some(pid));
    assert_eq!(hear(&mut listener, 1), 1);
}

#[test]
fn dropping_a_handle_closes_its_wake_up_session() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let engine = open(&db.url());
    let mut listener = listen(&db.url());
    enqueue(&engine, item("k1", "chat"));
    let pid = engine.wake.settled(LIMIT).pid.expect("connected");
    enqueue(&engine, item("k2", "chat"));
    let (done, dropped) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(engine);
        done.send(()).ok();
    });
    dropped
        .recv_timeout(LIMIT)
        .expect("watchdog: dropping a handle joins its wake-up thread");
    // Both commits' wake-ups went out (the second's at the drop, at the latest).
    assert!(hear(&mut listener, 1) >= 1);
    until_the_session_is_gone(&db, pid, "the wake-up session ends with its handle");
}

/// A connection given back with a transaction still open on it (a caller
/// that sent `BEGIN` and never ended it) is closed, not pooled: the next
/// borrower's statements would run inside that transaction, and what it
/// believes committed would vanish with the connection.
#[test]
fn a_connection_given_back_inside_a_transaction_is_not_lent_again() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let engine = open(&db.url());
    {
        let mut client = engine.client().unwrap();
        client.query("BEGIN", &[]).unwrap();
    }
    {
        let mut client = engine.client().unwrap();
        client
            .query("CREATE TABLE public.after_a_stray_begin (v int)", &[])
            .unwrap();
    }
    assert_eq!(
        db.psql("SELECT to_regclass('public.after_a_stray_begin') IS NOT NULL")
            .trim(),
        "t",
        "the next borrower's statement committed on its own"
    );
}

/// A connection closed instead of pooled (it came back inside a
/// transaction) frees its slot of the cap: with a cap of one, the next
/// caller gets a connection at once instead of `PoolExhausted` (the wait's
/// bound is 2 s here: `connect_timeout` plus `tcp_user_timeout`).
#[test]
fn a_connection_closed_instead_of_pooled_frees_its_slot_of_the_cap() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let url = format!("{}?connect_timeout=1&tcp_user_timeout=1000", db.url());
    let engine = PgEngine::open_capped(
        &url,
        DEFAULT_SCHEMA,
        Hasher::Plain,
        crate::builder::Create::IfMissing,
        super::Versioning::CURRENT,
        1,
    )
    .unwrap();
    {
        let mut client = engine.client().unwrap();
        client.query("BEGIN", &[]).unwrap();
    }
    let mut client = engine
        .client()
        .expect("the discarded connection's slot is free again");
    client.query("SELECT 1", &[]).unwrap();
    drop(client);
    // And the cap holds: while one is lent, a second caller waits, then
    // gets the typed error naming the cap.
    let held = engine.client().unwrap();
    match engine.client() {
        Err(Error::PoolExhausted {
            max_connections: 1, ..
        }) => {}
        Err(other) => panic!("a second caller under a cap of one: {other}"),
        Ok(_) => panic!("a second connection under a cap of one"),
    }
    drop(held);
}

/// A handle keeps the committed version of its own claims only (what a
/// record of a send decides from), forgets one once a later version holds
/// no claim of its, and keeps at most `KNOWN_MAX`: its memory is bounded by
/// its sends in flight, not by what it ever sent.
#[test]
fn a_handle_keeps_the_versions_of_its_own_claims_only_and_boundedly() {
    use super::speculate::{KNOWN_MAX, Known};
    use crate::rules::lifecycle::{claim, mark_sent};

    let now = Utc::now();
    let known = Known::default();
    let ours = claim(&item("a", "chat-1"), "me", now);
    known.committed(&ours, 2, "me");
    known.committed(&claim(&item("b", "chat-1"), "them", now), 2, "me");
    known.committed(&item("c", "chat-1"), 1, "me");
    assert_eq!(known.len(), 1, "only our claim is kept");
    let mut sent = ours.clone();
    mark_sent(&mut sent, now, None);
    known.committed(&sent, 3, "me");
    assert_eq!(known.len(), 0, "a version without our claim forgets it");
    for n in 0..KNOWN_MAX + 10 {
        known.committed(
            &claim(&item(&format!("k{n}"), "chat-2"), "me", now),
            1,
            "me",
        );
        // Every claim is kept until the map is full; then it starts afresh.
        let expected = if n < KNOWN_MAX {
            n + 1
        } else {
            n + 1 - KNOWN_MAX
        };
        assert_eq!(known.len(), expected, "after the claim of k{n}");
    }
    let newest = format!("k{}", KNOWN_MAX + 9);
    assert!(
        known
            .take(&newest)
            .is_some_and(|(_, revision)| revision == 1)
    );
    assert!(known.take(&newest).is_none(), "taken, no longer kept");
    // Queued and unclaimed: its destination is known, until it is claimed.
    let queued = item("d", "chat-3");
    known.committed(&queued, 1, "me");
    assert_eq!(known.destination_of("d").as_deref(), Some("chat-3"));
    known.committed(&claim(&queued, "me", now), 2, "me");
    assert_eq!(known.destination_of("d"), None);
}

/// The crate's sessions waiting on a lock: their server process ids and
/// client ports.
fn waiting_on_a_lock(watcher: &mut postgres::Client) -> Vec<(i32, u16)> {
    watcher
        .query(
            "SELECT pid, client_port FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'
               AND application_name = 'durable-outbox' ORDER BY pid",
            &[],
        )
        .unwrap()
        .iter()
        .map(|row| (row.get(0), u16::try_from(row.get::<_, i32>(1)).unwrap()))
        .collect()
}

/// Waits until `n` of the crate's sessions wait on a lock; returns them.
fn until_waiting(watcher: &mut postgres::Client, n: usize, what: &str) -> Vec<(i32, u16)> {
    until(what, || {
        let waiting = waiting_on_a_lock(watcher);
        (waiting.len() >= n).then_some(waiting)
    })
}

/// A record sent in one round trip whose connection the client finds
/// closed while the server, which has not noticed, still holds the record's
/// statements (its `COMMIT` among them) behind a lock: the record may still
/// commit after the item was read again. Settled under the item's locks, the
/// record is found committed once it is (or made by the usual run, whose
/// commit the late one can no longer pass): on record once, never also as a
/// late delivery of the same send.
#[test]
fn a_record_cut_off_while_its_commit_waits_on_a_lock_is_on_record_once() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let proxy = stall_proxy::StallProxy::to(server.port());
    let through = format!(
        "postgres://postgres@127.0.0.1:{}/{}?connect_timeout=2",
        proxy.port(),
        db.name()
    );
    let outbox = crate::Outbox::postgres(&through)
        .rate_limit(u32::MAX, Duration::from_secs(60))
        .open()
        .unwrap();
    outbox
        .enqueue(crate::NewMessage {
            idempotency_key: "a".into(),
            connector: "telegram".into(),
            grant_id: "bot-1".into(),
            destination: "chat".into(),
            content: "hello".into(),
            ..Default::default()
        })
        .unwrap();
    let mut holder = postgres::Client::connect(&db.url(), postgres::NoTls).unwrap();
    let mut watcher = postgres::Client::connect(&db.url(), postgres::NoTls).unwrap();
    let (locked, is_locked) = std::sync::mpsc::channel::<()>();
    let (release, released) = std::sync::mpsc::channel::<()>();
    let receipt = std::thread::scope(|scope| {
        let outbox = &outbox;
        let proxy = &proxy;
        let receipt = scope.spawn(move || {
            outbox.process("a", |_| {
                // The claim is committed: its row is locked now, so that the
                // record's write waits behind the lock.
                locked.send(()).unwrap();
                released.recv().unwrap();
                Ok(Some("ref-a".to_owned()))
            })
        });
        is_locked.recv().unwrap();
        let mut row_lock = holder.transaction().unwrap();
        row_lock
            .batch_execute(
                "SELECT 1 FROM durable_outbox.items WHERE idempotency_key = 'a' FOR UPDATE",
            )
            .unwrap();
        release.send(()).unwrap();
        // The record's one pipeline waits on the row, holding the key's lock.
        let cut = until_waiting(&mut watcher, 1, "the record waits on the row");
        proxy.cut_client_of(cut[0].1);
        // The handle settles on another connection and waits on the key's
        // lock, which the cut-off session holds.
        until_waiting(&mut watcher, 2, "the settling run waits on the key's lock");
        row_lock.rollback().unwrap();
        receipt.join().unwrap()
    });
    let receipt = receipt.unwrap();
    assert_eq!(receipt.outcome, crate::Outcome::Sent);
    assert_eq!(receipt.transport_ref.as_deref(), Some("ref-a"));
    let outcomes: Vec<crate::AuditOutcome> = outbox
        .history("a")
        .unwrap()
        .iter()
        .map(|record| record.outcome)
        .collect();
    assert_eq!(
        outcomes,
        [crate::AuditOutcome::Queued, crate::AuditOutcome::Sent],
        "the send is on record once"
    );
    outbox.verify_audit().unwrap();
}

/// A record sent in one round trip commits only on the very version its
/// claim committed, not on another item of the key that reached the same
/// revision: here the item, its claim lost, was pruned (as retention does
/// to a terminal item; done by hand) and enqueued and claimed anew by
/// another handle, which leaves the new row at the revision the first
/// claim left (enqueued at 1, claimed at 2). The first send's record must
/// not write its version over the new claim: it finds the item claimed
/// again and records a late delivery, and the new claim's send records
/// itself.
#[test]
fn a_record_does_not_commit_on_a_new_item_of_its_key_at_the_same_revision() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let open = || {
        crate::Outbox::postgres(&db.url())
            .rate_limit(u32::MAX, Duration::from_secs(60))
            .open()
            .unwrap()
    };
    let message = |content: &str| crate::NewMessage {
        idempotency_key: "a".into(),
        connector: "telegram".into(),
        grant_id: "bot-1".into(),
        destination: "chat".into(),
        content: content.into(),
        ..Default::default()
    };
    let (first, second) = (open(), open());
    first.enqueue(message("first")).unwrap();
    let (claimed, is_claimed) = std::sync::mpsc::channel::<()>();
    let (go, gone) = std::sync::mpsc::channel::<()>();
    let (receipt, later) = std::thread::scope(|scope| {
        let second = &second;
        let mut later = None;
        let mut signals = Some((claimed, gone));
        let receipt = first
            .process("a", |_| {
                let (claimed, gone) = signals.take().unwrap();
                db.psql(
                    "DELETE FROM durable_outbox.items WHERE idempotency_key = 'a';
                     DELETE FROM durable_outbox.rate_times WHERE idempotency_key = 'a'",
                );
                second.enqueue(message("second")).unwrap();
                later = Some(scope.spawn(move || {
                    second.process("a", |_| {
                        claimed.send(()).unwrap();
                        gone.recv().unwrap();
                        Ok(Some("ref-second".to_owned()))
                    })
                }));
                is_claimed.recv().unwrap();
                Ok(Some("ref-first".to_owned()))
            })
            .unwrap();
        go.send(()).unwrap();
        (receipt, later.unwrap().join().unwrap().unwrap())
    });
    assert_eq!(receipt.outcome, crate::Outcome::Sent);
    assert_eq!(later.outcome, crate::Outcome::Sent);
    let item = second.get("a").unwrap().unwrap();
    assert_eq!(
        (item.content(), item.transport_ref()),
        ("second", Some("ref-second")),
        "the new item, sent by its own claim"
    );
    let outcomes: Vec<crate::AuditOutcome> = first
        .history("a")
        .unwrap()
        .iter()
        .map(|record| record.outcome)
        .collect();
    assert_eq!(
        outcomes,
        [
            crate::AuditOutcome::Queued,
            crate::AuditOutcome::Queued,
            crate::AuditOutcome::LateDelivery,
            crate::AuditOutcome::Sent
        ],
        "the first send a late delivery, the second sent"
    );
}

/// Whether another session could take `destination`'s lock exclusive now
/// (taken in a transaction rolled back at once).
fn destination_free(other: &mut postgres::Client, destination: &str) -> bool {
    let lock = super::lock_key(DEFAULT_SCHEMA, &format!("dest:{destination}"));
    let mut tx = other.transaction().unwrap();
    let free = tx
        .query_one("SELECT pg_try_advisory_xact_lock($1)", &[&lock])
        .unwrap()
        .get(0);
    tx.rollback().unwrap();
    free
}

/// A decision about an item this handle left queued and unclaimed takes
/// the destination's lock and reads its line as it opens, but only while the
/// item is still queued and unclaimed there: another host may have cancelled
/// it, or retention removed it and its key came back for another
/// destination. Then the decision holds no lock of the destination the
/// handle remembered (two destinations' locks, taken in any order, could
/// wait for each other in a cycle), takes its own item's when its rule reads
/// that line, and the handle forgets what it remembered.
#[test]
fn a_decision_takes_no_destination_lock_but_its_item_s_whatever_the_handle_remembers() {
    use crate::rules::bulk::Bulk;
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let ours = open(&db.url());
    let theirs = open(&db.url());
    let mut other = super::Connector::parse(&db.url())
        .unwrap()
        .connect()
        .unwrap();
    for key in ["cancelled", "moved", "kept"] {
        enqueue(&ours, item(key, "chat-a"));
    }
    theirs
        .transact(
            Utc::now(),
            &defaults(),
            Scope::OneItem("cancelled"),
            |txn| Bulk::Cancel.one(txn, "cancelled", "another host cancels it"),
        )
        .unwrap();
    // As retention removes an item that ended on another host, and the key
    // is enqueued again there, for another destination.
    db.psql("DELETE FROM durable_outbox.items WHERE idempotency_key = 'moved'");
    enqueue(&theirs, item("moved", "chat-b"));
    ours.transact(Utc::now(), &defaults(), Scope::Decide("cancelled"), |_| {
        assert!(
            destination_free(&mut other, "chat-a"),
            "a decision about a cancelled item holds no destination lock"
        );
        Ok(())
    })
    .unwrap();
    ours.transact(Utc::now(), &defaults(), Scope::Decide("moved"), |txn| {
        assert!(
            destination_free(&mut other, "chat-a"),
            "a decision holds no lock of the destination its item left"
        );
        let head = txn.head_of("chat-b")?;
        assert_eq!(head.map(|head| head.key).as_deref(), Some("moved"));
        assert!(
            !destination_free(&mut other, "chat-b"),
            "its item's line is read under its item's destination's lock"
        );
        Ok(())
    })
    .unwrap();
    for key in ["cancelled", "moved"] {
        assert_eq!(ours.known.destination_of(key), None, "{key}: forgotten");
    }
    ours.transact(Utc::now(), &defaults(), Scope::Decide("kept"), |txn| {
        assert!(
            !destination_free(&mut other, "chat-a"),
            "the line of an item still queued there is read as the decision opens"
        );
        let head = txn.head_of("chat-a")?;
        assert_eq!(head.map(|head| head.key).as_deref(), Some("kept"));
        Ok(())
    })
    .unwrap();
}

/// Only a claim's decision (`Scope::Decide`) reads its destination's line as
/// it opens: a cancel of an item this handle enqueued takes no destination
/// lock, and a requeue takes it shared for its sequence (ARCHITECTURE.md,
/// "the destination's lock"), so neither waits for the destination's
/// decisions nor holds back its enqueues for a line it never reads.
#[test]
fn a_cancel_or_a_requeue_of_an_item_the_handle_enqueued_reads_no_line_as_it_opens() {
    use crate::rules::bulk::Bulk;
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let engine = open(&db.url());
    let mut other = super::Connector::parse(&db.url())
        .unwrap()
        .connect()
        .unwrap();
    enqueue(&engine, item("cancelled", "chat-c"));
    engine
        .transact(
            Utc::now(),
            &defaults(),
            Scope::OneItem("cancelled"),
            |txn| {
                assert!(
                    destination_free(&mut other, "chat-c"),
                    "a cancel opens without its destination's lock"
                );
                Bulk::Cancel.one(txn, "cancelled", "an operator cancels it")?;
                assert!(
                    destination_free(&mut other, "chat-c"),
                    "a cancel takes no destination lock"
                );
                Ok(())
            },
        )
        .unwrap();
    // Queued and unclaimed again: the handle knows its destination.
    engine
        .transact(
            Utc::now(),
            &defaults(),
            Scope::OneItem("cancelled"),
            |txn| Bulk::Requeue.one(txn, "cancelled", "an operator requeues it"),
        )
        .unwrap();
    engine
        .transact(Utc::now(), &defaults(), Scope::OneItem("cancelled"), |_| {
            assert!(
                destination_free(&mut other, "chat-c"),
                "a cancel of a requeued item opens without its destination's lock"
            );
            Ok(())
        })
        .unwrap();
    engine
        .transact(Utc::now(), &defaults(), Scope::Decide("cancelled"), |_| {
            assert!(
                !destination_free(&mut other, "chat-c"),
                "a decision reads the line as it opens"
            );
            Ok(())
        })
        .unwrap();
}
