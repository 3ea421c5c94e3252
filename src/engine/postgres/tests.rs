//! The PostgreSQL engine's primitives against a real, throwaway server.
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

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::Utc;

use super::test_server::PgServer;
use super::{DEFAULT_SCHEMA, PgEngine, lock_key};
use crate::audit::{AuditEvent, AuditOutcome, Hasher};
use crate::clock::format_timestamp;
use crate::engine::{ChangeSet, CommitError, Engine, Expect, Put, RateView, Versioned};
use crate::error::{AuditFault, Error};
use crate::item::{Claim, ItemState, OutboxItem};
use crate::message::content_hash;

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

fn event(item: &OutboxItem, outcome: AuditOutcome) -> AuditEvent {
    AuditEvent {
        attempts: item.attempts,
        audit_id: format!(
            "{}-{}-{}",
            item.idempotency_key,
            outcome.as_str(),
            item.attempts
        ),
        connector: item.connector.clone(),
        content_hash: item.content_hash.clone(),
        destination: item.destination.clone(),
        direction: item.direction.clone(),
        error_code: item.error_code.clone(),
        failure_class: item.failure_class,
        grant_id: item.grant_id.clone(),
        idempotency_key: item.idempotency_key.clone(),
        lane: item.lane.clone(),
        outcome,
        note: None,
        reconciled: false,
        recorded_at_utc: format_timestamp(Utc::now()),
        risk_class: None,
        transport_ref: item.transport_ref.clone(),
    }
}

fn enqueue(engine: &PgEngine, item: OutboxItem) {
    let audit = vec![event(&item, AuditOutcome::Queued)];
    engine
        .commit(ChangeSet {
            puts: vec![Put {
                item,
                expect: Expect::Absent,
            }],
            audit,
            wake: true,
        })
        .expect("enqueue");
}

/// The rules' claim, reduced to what the engine checks: queued, owner named.
fn claim_as(owner: &str) -> impl FnMut(&OutboxItem, &RateView) -> Option<OutboxItem> + '_ {
    move |candidate, _| {
        let mut claimed = candidate.clone();
        claimed.attempts += 1;
        claimed.claim = Some(Claim {
            owner: Some(owner.to_owned()),
            at: Some(Utc::now()),
        });
        Some(claimed)
    }
}

/// Finishes a claimed item as sent; `Conflict` when its claim was lost.
fn finish_sent(engine: &PgEngine, claimed: &Versioned) -> Result<(), CommitError> {
    let mut item = claimed.item.clone();
    item.state = ItemState::Sent;
    item.claim = None;
    item.sent_at = Some(Utc::now());
    item.transport_ref = Some(format!("ref-{}", item.idempotency_key));
    let audit = vec![event(&item, AuditOutcome::Sent)];
    engine
        .commit(ChangeSet {
            puts: vec![Put {
                item,
                expect: Expect::Revision(claimed.revision),
            }],
            audit,
            wake: false,
        })
        .map(|_| ())
}

/// Fails an orphaned claim as ambiguous, the way the rules do.
fn fail_orphan(engine: &PgEngine, orphan: &Versioned) -> Result<(), CommitError> {
    let mut item = orphan.item.clone();
    item.state = ItemState::Failed;
    item.maybe_sent_at = item.claim.as_ref().and_then(|c| c.at);
    item.claim = None;
    item.error_code = Some(crate::outbox::AMBIGUOUS_AFTER_RESTART.into());
    item.failure_class = Some(crate::FailureClass::Ambiguous);
    let audit = vec![event(&item, AuditOutcome::Failed)];
    engine
        .commit(ChangeSet {
            puts: vec![Put {
                item,
                expect: Expect::Revision(orphan.revision),
            }],
            audit,
            wake: false,
        })
        .map(|_| ())
}

/// The orphaned claims, once there are any (bounded by the watchdog).
fn wait_for_orphans(observer: &PgEngine) -> Vec<Versioned> {
    let deadline = std::time::Instant::now() + LIMIT;
    loop {
        let orphans = observer.orphaned_claims().unwrap();
        if !orphans.is_empty() {
            return orphans;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "owner liveness: a dead owner's lock was still held after {LIMIT:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn export_to_file(engine: &PgEngine) -> tempfile::NamedTempFile {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), engine.export_audit().unwrap()).unwrap();
    file
}

#[test]
fn three_hosts_draining_one_backlog_claim_each_item_once_in_destination_order() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let url = db.url();
    let first = open(&url);
    let destinations = 6;
    let per_destination = 8;
    for n in 0..per_destination {
        for d in 0..destinations {
            enqueue(&first, item(&format!("d{d}-{n:02}"), &format!("chat-{d}")));
        }
    }
    // Every claim, in the order claims committed across all hosts.
    let claims: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let hosts: Vec<_> = (0..3)
        .map(|host| {
            let url = url.clone();
            let claims = Arc::clone(&claims);
            std::thread::spawn(move || {
                let engine = open(&url);
                let owner = engine.owner().to_owned();
                let deadline = std::time::Instant::now() + LIMIT;
                loop {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "at-most-once drain across hosts: host {host} is still draining after {LIMIT:?}"
                    );
                    let batch = engine.claim_batch(Utc::now(), 4, Duration::ZERO, &mut claim_as(&owner)).unwrap();
                    {
                        let mut claims = claims.lock().unwrap();
                        for claimed in &batch {
                            claims.push((
                                claimed.item.destination.clone(),
                                claimed.item.idempotency_key.clone(),
                            ));
                        }
                    }
                    for claimed in &batch {
                        finish_sent(&engine, claimed).expect("a live claim finishes");
                    }
                    if batch.is_empty() {
                        let left = engine
                            .list()
                            .unwrap()
                            .iter()
                            .filter(|v| v.item.state == ItemState::Queued)
                            .count();
                        if left == 0 {
                            return;
                        }
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
            })
        })
        .collect();
    for host in hosts {
        host.join().expect("host thread");
    }
    let claims = claims.lock().unwrap();
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (_, key) in claims.iter() {
        *seen.entry(key).or_default() += 1;
    }
    assert_eq!(
        seen.len(),
        destinations * per_destination,
        "every item was claimed"
    );
    assert!(
        seen.values().all(|&n| n == 1),
        "an item was claimed twice: {seen:?}"
    );
    // Strict per-destination order: claims of one destination come in enqueue order.
    let mut last: HashMap<&str, &str> = HashMap::new();
    for (destination, key) in claims.iter() {
        if let Some(previous) = last.insert(destination, key) {
            assert!(
                previous < key.as_str(),
                "{key} was claimed after {previous}"
            );
        }
    }
    let seqs: Vec<_> = first.list().unwrap().iter().map(|v| v.item.seq).collect();
    assert!(
        seqs.windows(2).all(|w| w[0].is_some() && w[0] < w[1]),
        "one enqueue order across hosts: {seqs:?}"
    );
    for versioned in first.list().unwrap() {
        assert_eq!(versioned.item.state, ItemState::Sent);
        assert_eq!(
            versioned.item.attempts, 1,
            "{}",
            versioned.item.idempotency_key
        );
    }
}

#[test]
fn a_live_owners_claim_is_not_an_orphan_a_closed_owners_is() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let worker = open(&db.url());
    let observer = open(&db.url());
    enqueue(&worker, item("k1", "chat-1"));
    let owner = worker.owner().to_owned();
    let claimed = worker
        .claim_batch(Utc::now(), 10, Duration::ZERO, &mut claim_as(&owner))
        .unwrap();
    assert_eq!(claimed.len(), 1);
    assert!(observer.owner_is_alive(&owner).unwrap());
    assert!(
        observer.orphaned_claims().unwrap().is_empty(),
        "a live claim is not an orphan"
    );
    // A claimed item is not handed out again while its owner lives.
    let observer_owner = observer.owner().to_owned();
    assert!(
        observer
            .claim_batch(
                Utc::now(),
                10,
                Duration::ZERO,
                &mut claim_as(&observer_owner)
            )
            .unwrap()
            .is_empty()
    );
    drop(worker);
    // The server releases the lock when the closed session's backend exits,
    // a moment after the client hung up.
    let orphans = wait_for_orphans(&observer);
    assert_eq!(orphans.len(), 1, "the closed handle's claim is orphaned");
    assert_eq!(orphans[0].item.claim_owner(), Some(owner.as_str()));
    fail_orphan(&observer, &orphans[0]).unwrap();
    // Failed, never handed out again.
    assert!(
        observer
            .claim_batch(
                Utc::now(),
                10,
                Duration::ZERO,
                &mut claim_as(&observer_owner)
            )
            .unwrap()
            .is_empty()
    );
    let stored = observer.get("k1").unwrap().unwrap().item;
    assert_eq!(stored.state, ItemState::Failed);
    assert_eq!(
        stored.error_code.as_deref(),
        Some(crate::outbox::AMBIGUOUS_AFTER_RESTART)
    );
}

#[test]
fn a_terminated_owner_connection_makes_its_claim_ambiguous_and_the_late_finish_sees_it() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let worker = open(&db.url());
    let observer = open(&db.url());
    enqueue(&worker, item("k1", "chat-1"));
    enqueue(&worker, item("k2", "chat-2"));
    let owner = worker.owner().to_owned();
    let claimed = worker
        .claim_batch(Utc::now(), 1, Duration::ZERO, &mut claim_as(&owner))
        .unwrap();
    assert_eq!(claimed.len(), 1);
    // Mid-send, the owner lock's session is killed (a network cut looks the same).
    let key = lock_key(DEFAULT_SCHEMA, &owner);
    let killed = db.psql(&format!(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_locks WHERE locktype = 'advisory' \
         AND granted AND objsubid = 1 AND classid = ((({key}::bigint >> 32) & 4294967295))::oid \
         AND objid = (({key}::bigint & 4294967295))::oid"
    ));
    assert_eq!(killed, "1", "exactly the owner's session was terminated");
    // The server drops the lock when the backend exits; wait for that, bounded.
    let orphans = wait_for_orphans(&observer);
    fail_orphan(&observer, &orphans[0]).unwrap();
    // The worker's send finishes after all: its claim is gone, and the commit says so.
    match finish_sent(&worker, &claimed[0]) {
        Err(CommitError::Conflict { key }) => assert_eq!(key, claimed[0].item.idempotency_key),
        other => panic!("a lost claim must be detected at finish, got {other:?}"),
    }
    let stored = observer
        .get(&claimed[0].item.idempotency_key)
        .unwrap()
        .unwrap()
        .item;
    assert_eq!(
        stored.state,
        ItemState::Failed,
        "never resent, never silently sent"
    );
    // The worker takes its lock again and keeps claiming under the same owner.
    let next = worker
        .claim_batch(Utc::now(), 1, Duration::ZERO, &mut claim_as(&owner))
        .unwrap();
    assert_eq!(next.len(), 1);
    assert!(observer.owner_is_alive(&owner).unwrap());
    assert!(observer.orphaned_claims().unwrap().is_empty());
}

#[test]
fn a_server_restart_mid_send_makes_the_claim_ambiguous_then_the_finish_corrects_it_nothing_resent()
{
    let Some(server) = PgServer::start() else {
        return;
    };
    let db = server.database();
    let worker = open(&db.url());
    enqueue(&worker, item("k1", "chat-1"));
    let owner = worker.owner().to_owned();
    let claimed = worker
        .claim_batch(Utc::now(), 1, Duration::ZERO, &mut claim_as(&owner))
        .unwrap();
    assert_eq!(claimed.len(), 1);
    server.crash();
    server.restart();
    let observer = open(&db.url());
    let repaired = crate::rules::repair::repair_orphans(&observer, Utc::now()).unwrap();
    assert_eq!(repaired, ["k1"], "every session lock died with the server");
    // The send finishes after all. The worker's first call may meet the
    // connection the restart closed (an error, nothing written); a worker
    // records again, and its handle reconnects.
    let result = Ok(Some("tg-7".to_owned()));
    let finished = match crate::rules::lifecycle::finish_claimed(
        &worker,
        &claimed[0],
        &result,
        None,
        Utc::now(),
    ) {
        Err(Error::Database { .. }) => {
            crate::rules::lifecycle::finish_claimed(&worker, &claimed[0], &result, None, Utc::now())
        }
        other => other,
    }
    .unwrap();
    assert!(
        matches!(finished, crate::rules::lifecycle::Finished::Corrected(_)),
        "the late delivery is a correction: {finished:?}"
    );
    assert!(
        worker
            .claim_batch(Utc::now(), 1, Duration::ZERO, &mut claim_as(&owner))
            .unwrap()
            .is_empty()
    );
    let stored = worker.get("k1").unwrap().unwrap().item;
    assert_eq!(stored.state, ItemState::Sent);
    assert_eq!(stored.transport_ref.as_deref(), Some("tg-7"));
    assert_eq!(stored.attempts, 1, "never resent");
    let outcomes: Vec<_> = worker
        .audit_records(0)
        .unwrap()
        .iter()
        .map(|r| r.outcome)
        .collect();
    assert_eq!(
        outcomes,
        [
            AuditOutcome::Queued,
            AuditOutcome::Failed,
            AuditOutcome::Sent
        ]
    );
    let file = export_to_file(&worker);
    assert_eq!(crate::AuditLog::verify(file.path()).unwrap().records, 3);
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
    let records = engine.audit_records(0).unwrap();
    assert_eq!(records.len(), 30);
    assert_eq!(engine.audit_records(28).unwrap().len(), 2);
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
fn a_conditional_write_that_lost_a_race_writes_nothing() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let engine = open(&db.url());
    enqueue(&engine, item("k1", "chat"));
    // The same key again: refused, and its audit record with it.
    let again = engine.commit(ChangeSet {
        puts: vec![
            Put {
                item: item("k2", "chat"),
                expect: Expect::Absent,
            },
            Put {
                item: item("k1", "chat"),
                expect: Expect::Absent,
            },
        ],
        audit: vec![event(&item("k1", "chat"), AuditOutcome::Queued)],
        wake: false,
    });
    assert!(matches!(again, Err(CommitError::Conflict { ref key }) if key == "k1"));
    assert!(
        engine.get("k2").unwrap().is_none(),
        "the whole change set rolled back"
    );
    assert_eq!(engine.audit_records(0).unwrap().len(), 1);
    let stale = engine.get("k1").unwrap().unwrap();
    let owner = engine.owner().to_owned();
    let claimed = engine
        .claim_batch(Utc::now(), 1, Duration::ZERO, &mut claim_as(&owner))
        .unwrap();
    assert_eq!(claimed[0].revision, stale.revision + 1);
    assert!(matches!(
        finish_sent(&engine, &stale),
        Err(CommitError::Conflict { .. })
    ));
    finish_sent(&engine, &claimed[0]).unwrap();
    assert_eq!(engine.audit_records(0).unwrap().len(), 2);
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
    assert_eq!(
        a.get("same-key").unwrap().unwrap().item.destination,
        "chat-a"
    );
    assert_eq!(
        b.get("same-key").unwrap().unwrap().item.destination,
        "chat-b"
    );
    assert_eq!(a.audit_records(0).unwrap().len(), 1);
}

#[test]
fn a_commit_that_makes_work_due_wakes_a_waiter_on_another_handle() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let waiter = Arc::new(open(&db.url()));
    // Subscribe first (a wait that times out), so the wake-up cannot be missed.
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
    let engine = open(&session_pool.url(db.name()));
    enqueue(&engine, item("k1", "chat"));
    let owner = engine.owner().to_owned();
    let claimed = engine
        .claim_batch(Utc::now(), 1, Duration::ZERO, &mut claim_as(&owner))
        .unwrap();
    assert_eq!(claimed.len(), 1);
    finish_sent(&engine, &claimed[0]).unwrap();
}

/// Environment of a child "host" process: the database URL, and what to do.
const CHILD_URL: &str = "OUTBOX_PG_HOST_URL";
const CHILD_MODE: &str = "OUTBOX_PG_HOST_MODE";

/// One host process. Spawned by the tests below with [`CHILD_URL`] and
/// [`CHILD_MODE`] set (`drain`: claim and send until nothing is queued,
/// printing `HOST:SENT <key>` per send; `hang`: claim one item, print
/// `HOST:CLAIMED <key>` and stay inside its "send"). Run without them, it is
/// one host draining its own backlog, checked.
#[test]
fn host_process() {
    let Ok(url) = std::env::var(CHILD_URL) else {
        let Some(server) = PgServer::shared() else {
            return;
        };
        let db = server.database();
        let engine = open(&db.url());
        for n in 0..3 {
            enqueue(&engine, item(&format!("k{n}"), "chat"));
        }
        let sent = drain(&engine, |_| {});
        assert_eq!(sent, ["k0", "k1", "k2"]);
        return;
    };
    let engine = open(&url);
    let owner = engine.owner().to_owned();
    match std::env::var(CHILD_MODE).as_deref() {
        Ok("hang") => {
            let claimed = engine
                .claim_batch(Utc::now(), 1, Duration::ZERO, &mut claim_as(&owner))
                .unwrap();
            println!("HOST:CLAIMED {}", claimed[0].item.idempotency_key);
            // Inside the send until the parent kills us (bounded, in case it does not).
            std::thread::sleep(LIMIT);
        }
        _ => {
            drain(&engine, |key| println!("HOST:SENT {key}"));
        }
    }
}

/// Claims and sends until nothing is queued; returns the keys sent.
fn drain(engine: &PgEngine, mut on_sent: impl FnMut(&str)) -> Vec<String> {
    let owner = engine.owner().to_owned();
    let deadline = std::time::Instant::now() + LIMIT;
    let mut sent = Vec::new();
    loop {
        assert!(
            std::time::Instant::now() < deadline,
            "drain: still draining after {LIMIT:?}"
        );
        let batch = engine
            .claim_batch(Utc::now(), 2, Duration::ZERO, &mut claim_as(&owner))
            .unwrap();
        for claimed in &batch {
            finish_sent(engine, claimed).expect("a live claim finishes");
            on_sent(&claimed.item.idempotency_key);
            sent.push(claimed.item.idempotency_key.clone());
        }
        if batch.is_empty() {
            let queued = engine
                .list()
                .unwrap()
                .iter()
                .any(|v| v.item.state == ItemState::Queued);
            if !queued {
                return sent;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

fn spawn_host(url: &str, mode: &str) -> std::process::Child {
    std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "engine::postgres::tests::host_process",
            "--nocapture",
        ])
        .args(["--test-threads", "1", "-q"])
        .env(CHILD_URL, url)
        .env(CHILD_MODE, mode)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .expect("spawn a host process")
}

#[test]
fn host_processes_racing_one_backlog_send_each_key_once() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let engine = open(&db.url());
    for n in 0..10 {
        for d in 0..3 {
            enqueue(&engine, item(&format!("d{d}-{n:02}"), &format!("chat-{d}")));
        }
    }
    let hosts: Vec<_> = (0..3).map(|_| spawn_host(&db.url(), "drain")).collect();
    let mut sent: HashMap<String, usize> = HashMap::new();
    for host in hosts {
        let output = host.wait_with_output().unwrap();
        assert!(output.status.success(), "a host process failed");
        for line in String::from_utf8_lossy(&output.stdout).lines() {
            if let Some(key) = line.strip_prefix("HOST:SENT ") {
                *sent.entry(key.to_owned()).or_default() += 1;
            }
        }
    }
    assert_eq!(sent.len(), 30, "every key was sent: {sent:?}");
    assert!(
        sent.values().all(|&n| n == 1),
        "a key was sent twice: {sent:?}"
    );
    for versioned in engine.list().unwrap() {
        assert_eq!(versioned.item.state, ItemState::Sent);
        assert_eq!(versioned.item.attempts, 1);
    }
}

#[test]
fn sigkill_inside_send_leaves_an_ambiguous_claim_that_is_never_resent() {
    use std::io::BufRead;
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let observer = open(&db.url());
    enqueue(&observer, item("k1", "chat"));
    let mut host = spawn_host(&db.url(), "hang");
    let mut lines = std::io::BufReader::new(host.stdout.take().unwrap()).lines();
    let claimed = loop {
        let line = lines
            .next()
            .expect("the host claims before it exits")
            .unwrap();
        if let Some(key) = line.strip_prefix("HOST:CLAIMED ") {
            break key.to_owned();
        }
    };
    assert_eq!(claimed, "k1");
    assert!(
        observer.orphaned_claims().unwrap().is_empty(),
        "a live send is not an orphan"
    );
    host.kill().unwrap(); // SIGKILL
    host.wait().unwrap();
    let orphans = wait_for_orphans(&observer);
    fail_orphan(&observer, &orphans[0]).unwrap();
    let owner = observer.owner().to_owned();
    assert!(
        observer
            .claim_batch(Utc::now(), 5, Duration::ZERO, &mut claim_as(&owner))
            .unwrap()
            .is_empty()
    );
    let stored = observer.get("k1").unwrap().unwrap().item;
    assert_eq!(stored.state, ItemState::Failed);
    assert_eq!(stored.attempts, 1, "never resent");
    assert!(stored.maybe_sent_at.is_some(), "counts as a possible send");
}

/// Claims `key` on `worker` through the rules, then cuts the worker's owner
/// session and lets `observer` repair the orphan: the state a network cut or
/// a server restart leaves mid-send.
fn claim_then_lose_it(
    db: &super::test_server::PgDatabase<'_>,
    worker: &PgEngine,
    observer: &PgEngine,
) -> Versioned {
    use crate::rules::lifecycle;
    let owner = worker.owner().to_owned();
    let claimed = worker
        .claim_batch(Utc::now(), 1, Duration::ZERO, &mut |item, _| {
            Some(lifecycle::claim(item, &owner, Utc::now()))
        })
        .unwrap()
        .pop()
        .expect("one claim");
    let key = lock_key(DEFAULT_SCHEMA, &owner);
    db.psql(&format!(
        "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' \
         AND granted AND objsubid = 1 AND classid = ((({key}::bigint >> 32) & 4294967295))::oid \
         AND objid = (({key}::bigint & 4294967295))::oid"
    ));
    let deadline = std::time::Instant::now() + LIMIT;
    loop {
        let repaired = crate::rules::repair::repair_orphans(observer, Utc::now()).unwrap();
        if !repaired.is_empty() {
            assert_eq!(
                repaired.as_slice(),
                std::slice::from_ref(&claimed.item.idempotency_key)
            );
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "owner liveness: lock never released"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    claimed
}

#[test]
fn a_delivery_that_finishes_after_its_claim_was_declared_ambiguous_is_corrected_on_record() {
    use crate::rules::lifecycle::{CORRECTION_NOTE, Finished, finish_claimed as finish};
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let worker = open(&db.url());
    let observer = open(&db.url());
    enqueue(&worker, item("k1", "chat"));
    let claimed = claim_then_lose_it(&db, &worker, &observer);
    let failed = observer.get("k1").unwrap().unwrap().item;
    assert_eq!(
        failed.error_code.as_deref(),
        Some(crate::outbox::AMBIGUOUS_AFTER_RESTART)
    );
    // The send did reach the platform, and the worker now says so.
    let finished = finish(
        &worker,
        &claimed,
        &Ok(Some("tg-1".into())),
        None,
        Utc::now(),
    )
    .unwrap();
    let Finished::Corrected(item) = finished else {
        panic!("a lost claim's delivery must be corrected on record, got {finished:?}");
    };
    assert_eq!(item.state, ItemState::Sent);
    assert_eq!((item.error_code, item.failure_class), (None, None));
    assert_eq!(item.attempts, 1, "never resent");
    let stored = observer
        .find_by_transport_ref("tg-1")
        .unwrap()
        .unwrap()
        .item;
    assert_eq!(
        (stored.idempotency_key.as_str(), stored.state),
        ("k1", ItemState::Sent)
    );
    let records = observer.audit_records(0).unwrap();
    let outcomes: Vec<_> = records
        .iter()
        .map(|r| (r.outcome, r.note.as_deref()))
        .collect();
    assert_eq!(
        outcomes,
        [
            (AuditOutcome::Queued, None),
            (AuditOutcome::Failed, None),
            (AuditOutcome::Sent, Some(CORRECTION_NOTE)),
        ]
    );
    let file = export_to_file(&observer);
    assert_eq!(crate::AuditLog::verify(file.path()).unwrap().records, 3);
    let owner = observer.owner().to_owned();
    assert!(
        observer
            .claim_batch(Utc::now(), 5, Duration::ZERO, &mut claim_as(&owner))
            .unwrap()
            .is_empty()
    );
}

#[test]
fn a_failed_send_after_a_lost_claim_keeps_the_item_failed_with_its_real_code() {
    use crate::rules::lifecycle::{Finished, finish_claimed as finish};
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let worker = open(&db.url());
    let observer = open(&db.url());
    enqueue(&worker, item("k1", "chat"));
    let claimed = claim_then_lose_it(&db, &worker, &observer);
    let result = Err(crate::SendError::permanent("chat_not_found"));
    let finished = finish(&worker, &claimed, &result, None, Utc::now()).unwrap();
    let Finished::Corrected(item) = finished else {
        panic!("expected a correction, got {finished:?}");
    };
    assert_eq!(item.state, ItemState::Failed);
    assert_eq!(item.error_code.as_deref(), Some("chat_not_found"));
    assert_eq!(item.failure_class, Some(crate::FailureClass::Permanent));
    assert_eq!(
        item.maybe_sent_at, None,
        "certainly not delivered: no longer a possible send"
    );
    let stored = observer.get("k1").unwrap().unwrap().item;
    assert_eq!(
        (
            stored.state,
            stored.error_code,
            stored.maybe_sent_at,
            stored.last_audit_id
        ),
        (item.state, item.error_code, None, item.last_audit_id),
        "stored as returned"
    );
}

#[test]
fn a_late_delivery_of_an_item_an_operator_moved_on_is_put_on_record_and_the_item_left_alone() {
    use crate::rules::lifecycle::{Finished, finish_claimed as finish};
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let worker = open(&db.url());
    let observer = open(&db.url());
    enqueue(&worker, item("k1", "chat"));
    let claimed = claim_then_lose_it(&db, &worker, &observer);
    // An operator requeues the ambiguous item before the late result arrives.
    let current = observer.get("k1").unwrap().unwrap();
    let mut requeued = current.item.clone();
    requeued.state = ItemState::Queued;
    requeued.error_code = None;
    observer
        .commit(ChangeSet {
            puts: vec![Put {
                item: requeued.clone(),
                expect: Expect::Revision(current.revision),
            }],
            audit: vec![event(&requeued, AuditOutcome::Requeued)],
            wake: true,
        })
        .unwrap();
    let finished = finish(
        &worker,
        &claimed,
        &Ok(Some("tg-9".into())),
        None,
        Utc::now(),
    )
    .unwrap();
    let Finished::LeftAlone(item) = finished else {
        panic!("an item that moved on must be left alone, got {finished:?}");
    };
    assert_eq!(
        item.state,
        ItemState::Queued,
        "the operator's decision stands"
    );
    let last = observer.audit_records(0).unwrap().pop().unwrap();
    assert_eq!(
        last.outcome,
        AuditOutcome::Sent,
        "the delivery is on record"
    );
    assert_eq!(last.transport_ref.as_deref(), Some("tg-9"));
    assert_eq!(
        observer.get("k1").unwrap().unwrap().item.state,
        ItemState::Queued
    );
}

#[test]
fn the_global_cap_holds_when_two_hosts_decide_at_the_same_moment() {
    use crate::rate::{RateLimit, RatePolicy};
    use crate::rules::lifecycle::{claim, claim_due};
    use crate::rules::rate::capped;
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let first = open(&db.url());
    enqueue(&first, item("a", "chat-a"));
    enqueue(&first, item("b", "chat-b"));
    let policy = RatePolicy {
        global: Some(RateLimit {
            count: 1,
            window: Duration::from_secs(3600),
        }),
        ..RatePolicy::default()
    };
    let (inside_tx, inside_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let host_a = {
        let url = db.url();
        let policy = policy.clone();
        std::thread::spawn(move || {
            let engine = open(&url);
            let owner = engine.owner().to_owned();
            let now = Utc::now();
            // Host A holds its decision open while host B tries to claim. The
            // hold ends when B is done or after a while, whichever is first:
            // with caps serialised, B waits for A, so A's hold runs out.
            engine
                .claim_batch(now, 1, policy.longest_window(), &mut |item, view| {
                    inside_tx.send(()).unwrap();
                    let _ = go_rx.recv_timeout(Duration::from_secs(2));
                    capped(&policy, &item.destination, view, now)
                        .is_none()
                        .then(|| claim(item, &owner, now))
                })
                .unwrap()
                .len()
        })
    };
    inside_rx
        .recv_timeout(LIMIT)
        .expect("host A reaches its decision");
    let host_b = open(&db.url());
    let b_claimed = claim_due(&host_b, &policy, Utc::now(), 1).unwrap().len();
    let _ = go_tx.send(());
    let a_claimed = host_a.join().unwrap();
    assert_eq!(
        (a_claimed, b_claimed),
        (1, 0),
        "a global cap of 1 admits one claim across hosts"
    );
    assert!(!host_b.get("b").unwrap().unwrap().item.dispatch_claimed());
}

#[test]
fn destination_caps_and_cooldowns_hold_across_hosts() {
    use crate::rate::{RateLimit, RatePolicy};
    use crate::rules::lifecycle::{Finished, claim_due, finish_claimed as finish};
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let first = open(&db.url());
    for n in 0..5 {
        enqueue(&first, item(&format!("c{n}"), "chat"));
    }
    let policy = RatePolicy {
        per_destination: RateLimit {
            count: 2,
            window: Duration::from_secs(3600),
        },
        ..RatePolicy::default()
    };
    let hosts: Vec<_> = (0..2)
        .map(|_| {
            let url = db.url();
            let policy = policy.clone();
            std::thread::spawn(move || {
                let engine = open(&url);
                let mut sent = 0;
                let mut idle = 0;
                while idle < 20 {
                    let batch = claim_due(&engine, &policy, Utc::now(), 2).unwrap();
                    if batch.is_empty() {
                        idle += 1;
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    for claimed in &batch {
                        let done = finish(&engine, claimed, &Ok(None), None, Utc::now()).unwrap();
                        assert!(matches!(done, Finished::Recorded(_)));
                        sent += 1;
                    }
                }
                sent
            })
        })
        .collect();
    let sent: usize = hosts.into_iter().map(|h| h.join().unwrap()).sum();
    assert_eq!(sent, 2, "a cap of 2 per hour admits 2 sends across hosts");
    let states: Vec<_> = first
        .list()
        .unwrap()
        .into_iter()
        .map(|v| v.item.state)
        .collect();
    assert_eq!(
        states,
        [
            ItemState::Sent,
            ItemState::Sent,
            ItemState::Queued,
            ItemState::Queued,
            ItemState::Queued
        ]
    );

    // A platform's retry_after on one host cools the destination for every host,
    // and outlives the item that received it.
    enqueue(&first, item("x1", "chat-2"));
    enqueue(&first, item("x2", "chat-2"));
    let now = Utc::now();
    // (c2's destination is capped: it is a candidate, skipped, and stays queued.)
    let claimed = claim_due(&first, &policy, now, 10).unwrap();
    let claimed = claimed
        .iter()
        .find(|c| c.item.idempotency_key == "x1")
        .unwrap();
    let retry = Err(crate::SendError::retryable("429").retry_after(Duration::from_secs(600)));
    let retry_at = crate::clock::later(now, Duration::from_secs(600));
    finish(&first, claimed, &retry, Some(retry_at), now).unwrap();
    // An operator cancels x1: x2 is the destination's head now, but still cooled.
    let current = first.get("x1").unwrap().unwrap();
    let mut cancelled = current.item.clone();
    cancelled.state = ItemState::Failed;
    first
        .commit(ChangeSet {
            puts: vec![Put {
                item: cancelled.clone(),
                expect: Expect::Revision(current.revision),
            }],
            audit: vec![event(&cancelled, AuditOutcome::Cancelled)],
            wake: false,
        })
        .unwrap();
    let other = open(&db.url());
    let during = claim_due(&other, &policy, now, 5).unwrap();
    assert!(
        during.iter().all(|c| c.item.destination != "chat-2"),
        "the cooldown holds on another host: {during:?}"
    );
    let after = claim_due(
        &other,
        &policy,
        crate::clock::later(now, Duration::from_secs(601)),
        5,
    )
    .unwrap();
    assert!(after.iter().any(|c| c.item.idempotency_key == "x2"));
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
        .list()
        .unwrap()
        .into_iter()
        .map(|v| (v.item.idempotency_key, v.item.seq))
        .collect();
    assert_eq!(
        listed,
        [
            ("b-first".to_owned(), Some(1)),
            ("a-second".to_owned(), Some(2))
        ],
        "each item's place in line is its enqueue order"
    );
    // The sequence continues after them, and the rules' transaction runs on them.
    let defaults = crate::settings::Settings {
        rates: crate::rate::RatePolicy::default(),
        history_after: Duration::from_secs(60),
        retention: crate::history::Retention::KeepAll,
        max_attempts: 3,
        backoff: crate::retry::Backoff::default(),
        give_up_after: Duration::from_secs(3600),
        ordering: crate::order::Ordering::PerDestination,
        stored: Vec::new(),
    };
    let head = engine
        .transact(
            Utc::now(),
            &defaults,
            crate::rules::txn::Scope::Any,
            |txn| {
                assert_eq!(txn.next_seq("chat-1").unwrap(), 3);
                Ok(txn.head_of("chat-1").unwrap().map(|place| place.key))
            },
        )
        .unwrap();
    assert_eq!(head.as_deref(), Some("b-first"));
}
