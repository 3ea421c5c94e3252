//! Batched steps: a worker's slots that are ready to step at the same moment
//! share one transaction (one lock hold, one journal entry, one audit append),
//! and every guarantee of a single step still holds: each send is recorded
//! once, per-destination order, caps and backpressure are those of single
//! steps, the audit chain verifies in journal order, a failed sync under a
//! batch reports none of it durable and loses nothing acknowledged.
//!
//! Batches of two or more are counted by the `step.batch` failpoint (armed to
//! pass), so each test proves it exercised them and prints how many.
//!
//! Bodies in `on_both_engines!` run on the file engine and on PostgreSQL.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use durable_outbox::{AuditOutcome, Error, FailAction, ItemState, Outbox, OutboxItem, SendError};

use crate::engines::on_both_engines;
use crate::harness::{DEADLOCK_LIMIT, msg, runtime, secs, within};

/// Runs a worker with `concurrency` slots until `done` holds for the
/// outbox's items, then shuts it down and returns its report.
fn run_worker<F, Fut>(
    outbox: &Outbox,
    concurrency: usize,
    send: F,
    done: impl Fn(&[OutboxItem]) -> bool,
) -> durable_outbox::Result<durable_outbox::WorkerReport>
where
    F: Fn(OutboxItem) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<Option<String>, SendError>> + Send + 'static,
{
    runtime().block_on(async {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let worker = outbox.worker(send).concurrency(concurrency);
        let running = tokio::spawn(worker.run(async move {
            stopped.await.ok();
        }));
        loop {
            if running.is_finished() {
                break;
            }
            // A poisoned handle fails the read: the worker stops on its own.
            if outbox.list_items().is_ok_and(|items| done(&items)) {
                let _ = stop.send(());
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        running.await.unwrap()
    })
}

/// Each chat's keys in the order they were handed to `send`.
fn per_chat(sent: &[String]) -> BTreeMap<String, Vec<String>> {
    let mut chats: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for key in sent {
        let chat = key.split('-').nth(1).unwrap().to_owned();
        chats.entry(chat).or_default().push(key.clone());
    }
    chats
}

/// The boxed future of [`released_by_rounds`]'s transport.
type SendFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Option<String>, SendError>> + Send>>;

/// A transport for `chats` chats of `rounds` messages each (keys
/// "r{round}-c{chat}"): it records each send and holds it until every send of
/// its round has started, then lets the round go all at once, so the slots'
/// next steps fall together. Returns the transport and its [`Rounds`] (join
/// the releaser once the worker has ended).
fn released_by_rounds(
    chats: usize,
    rounds: usize,
) -> (
    impl Fn(OutboxItem) -> SendFuture + Send + Sync + 'static,
    Rounds,
) {
    let started = Arc::new(AtomicUsize::new(0));
    let sent = Arc::new(Mutex::new(Vec::new()));
    let (gate, opened) = tokio::sync::watch::channel(0usize);
    let transport = {
        let (started, sent) = (Arc::clone(&started), Arc::clone(&sent));
        move |item: OutboxItem| -> SendFuture {
            let (started, sent) = (Arc::clone(&started), Arc::clone(&sent));
            let mut opened = opened.clone();
            Box::pin(async move {
                let key = item.idempotency_key().to_owned();
                let round: usize = key[1..key.find('-').unwrap()].parse().unwrap();
                sent.lock().unwrap().push(key.clone());
                started.fetch_add(1, Ordering::SeqCst);
                // Each round's sends finish together: the slots' next steps
                // share batches.
                opened.wait_for(|open| *open >= round).await.unwrap();
                Ok(Some(format!("tr-{key}")))
            })
        }
    };
    let releaser = std::thread::spawn(move || {
        for round in 1..=rounds {
            while started.load(Ordering::SeqCst) < round * chats {
                std::thread::sleep(Duration::from_millis(2));
            }
            gate.send(round).unwrap();
        }
    });
    (transport, Rounds { sent, releaser })
}

/// What [`released_by_rounds`] hands back beside its transport.
struct Rounds {
    /// The keys in the order they were handed to `send`.
    sent: Arc<Mutex<Vec<String>>>,
    /// The thread that lets the rounds go.
    releaser: std::thread::JoinHandle<()>,
}

/// Every one of `chats` × `rounds` items was sent exactly once, with its own
/// transport ref and in one attempt, and each chat's sends left in enqueue
/// order.
fn each_item_sent_once_in_chat_order(
    outbox: &Outbox,
    sent: &[String],
    chats: usize,
    rounds: usize,
) {
    let once: HashSet<&String> = sent.iter().collect();
    assert_eq!(
        (sent.len(), once.len()),
        (chats * rounds, chats * rounds),
        "an item was sent twice or not at all: {sent:?}"
    );
    for (chat, keys) in per_chat(sent) {
        let expected: Vec<String> = (1..=rounds).map(|r| format!("r{r}-{chat}")).collect();
        assert_eq!(keys, expected, "chat {chat} out of order");
    }
    for item in outbox.list_items().unwrap() {
        let key = item.idempotency_key();
        assert_eq!(item.transport_ref(), Some(format!("tr-{key}").as_str()));
        assert_eq!(item.attempts(), 1, "{key}");
    }
}

/// Sixteen slots whose sends are let go a round at a time, all at once, with
/// a slow journal write (under the lock, as a saturated lock would be): their
/// steps pile up behind it and share transactions. Every item
/// is sent once, each chat in enqueue order, the audit chain verifies with
/// each item's records in lifecycle order, and far fewer journal entries are
/// written than steps are taken.
#[test]
fn slots_that_finish_together_share_one_transaction_and_keep_order() {
    const CHATS: usize = 16;
    const ROUNDS: usize = 4;
    within(
        "batched steps: slots finishing together share one transaction",
        Duration::from_secs(120),
        || {
            let dir = tempfile::tempdir().unwrap();
            let outbox = Outbox::builder(dir.path())
                .rate_limit(u32::MAX, secs(60))
                .failpoint("journal.write", FailAction::DelayMs(5))
                .failpoint("step.batch", FailAction::DelayMs(0))
                .open()
                .unwrap();
            // Key "r{round}-c{chat}": round r is chat c's r-th message.
            let messages = (1..=ROUNDS)
                .flat_map(|r| (0..CHATS).map(move |c| msg(&format!("r{r}-c{c}"), &format!("c{c}"))))
                .collect();
            outbox.enqueue_many(messages).unwrap();
            let writes_before = outbox.failpoint_hits("journal.write");
            let (transport, Rounds { sent, releaser }) = released_by_rounds(CHATS, ROUNDS);
            let report = run_worker(&outbox, CHATS, transport, |items| {
                items.iter().all(|i| i.state() == ItemState::Sent)
            })
            .unwrap();
            releaser.join().unwrap();
            assert_eq!(report.sent, CHATS * ROUNDS);
            let batches = outbox.failpoint_hits("step.batch");
            let writes = outbox.failpoint_hits("journal.write") - writes_before;
            // Alone, each send's outcome is a step, plus one per first claim.
            let steps = CHATS * ROUNDS + CHATS;
            println!("{steps} steps in {writes} journal entries, {batches} batches of two or more");
            assert!(batches >= 2, "only {batches} batches of two or more slots");
            assert!(
                (writes as usize) <= steps / 4,
                "{writes} journal entries for {steps} steps: the slots' steps were not batched"
            );
            let sent = sent.lock().unwrap().clone();
            each_item_sent_once_in_chat_order(&outbox, &sent, CHATS, ROUNDS);
            // The chain verifies; each item's records say queued, then sent.
            outbox.verify_audit().unwrap();
            let mut lifecycle: BTreeMap<String, Vec<AuditOutcome>> = BTreeMap::new();
            for record in durable_outbox::AuditLog::read(dir.path().join("audit.jsonl")).unwrap() {
                lifecycle
                    .entry(record.idempotency_key.clone())
                    .or_default()
                    .push(record.outcome);
            }
            for (key, outcomes) in lifecycle {
                assert_eq!(
                    outcomes,
                    [AuditOutcome::Queued, AuditOutcome::Sent],
                    "{key}: audit records out of lifecycle order"
                );
            }
        },
    );
}

/// A global cap of 10 sends a minute with 16 slots stepping in batches: one
/// batch claims for several slots, each claim checked against those before
/// it, so exactly 10 go and the rest are deferred, not sent. (A slow journal
/// write keeps the lock busy, so the slots' steps pile up into batches.)
#[test]
fn a_batch_of_claims_never_exceeds_a_cap() {
    within(
        "batched steps: caps hold inside a batch",
        DEADLOCK_LIMIT * 2,
        || {
            let dir = tempfile::tempdir().unwrap();
            let outbox = Outbox::builder(dir.path())
                .rate_limit(u32::MAX, secs(60))
                .global_rate_limit(10, secs(60))
                .failpoint("journal.write", FailAction::DelayMs(2))
                .failpoint("step.batch", FailAction::DelayMs(0))
                .open()
                .unwrap();
            outbox
                .enqueue_many(
                    (0..40)
                        .map(|i| msg(&format!("k{i:02}-c{i}"), &format!("c{i}")))
                        .collect(),
                )
                .unwrap();
            let sent = Arc::new(AtomicUsize::new(0));
            let counter = Arc::clone(&sent);
            let report = run_worker(
                &outbox,
                16,
                move |item: OutboxItem| {
                    let counter = Arc::clone(&counter);
                    async move {
                        counter.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        Ok(Some(format!("tr-{}", item.idempotency_key())))
                    }
                },
                |items| {
                    items
                        .iter()
                        .filter(|i| i.state() == ItemState::Sent)
                        .count()
                        >= 10
                        && items.iter().all(|i| !i.dispatch_claimed())
                },
            )
            .unwrap();
            let batches = outbox.failpoint_hits("step.batch");
            println!("{batches} batches of two or more under the cap");
            assert!(batches >= 1, "no batch of two or more slots was exercised");
            assert_eq!(sent.load(Ordering::SeqCst), 10, "sends past the global cap");
            assert_eq!(report.sent, 10);
            let items = outbox.list_items().unwrap();
            assert_eq!(
                items
                    .iter()
                    .filter(|i| i.state() == ItemState::Sent)
                    .count(),
                10
            );
            assert_eq!(
                items
                    .iter()
                    .filter(|i| i.state() == ItemState::Queued)
                    .count(),
                30
            );
        },
    );
}

/// The journal's fdatasync fails under a worker whose slots step in batches
/// (at its k-th sync, for several k). The worker stops with the error; what
/// a reopen finds is consistent: every item whose send started is sent or
/// left ambiguous and is never resent; every other item goes out once.
#[test]
fn a_failed_sync_under_batched_steps_resends_nothing_and_loses_nothing() {
    within(
        "batched steps: a failed sync fails its batches and loses nothing",
        Duration::from_secs(180),
        || {
            let mut batched_runs = 0;
            for hit in [3_u32, 5, 8, 11] {
                let dir = tempfile::tempdir().unwrap();
                let outbox = Outbox::builder(dir.path())
                    .rate_limit(u32::MAX, secs(60))
                    .failpoint("journal.fsync", FailAction::ErrorOnHit(hit))
                    .failpoint("journal.write", FailAction::DelayMs(2))
                    .failpoint("step.batch", FailAction::DelayMs(0))
                    .open()
                    .unwrap();
                outbox
                    .enqueue_many(
                        (0..96)
                            .map(|i| msg(&format!("k{i:02}-c{i}"), &format!("c{i}")))
                            .collect(),
                    )
                    .unwrap();
                let started = Arc::new(Mutex::new(HashSet::new()));
                let log = Arc::clone(&started);
                let run = run_worker(
                    &outbox,
                    16,
                    move |item: OutboxItem| {
                        let log = Arc::clone(&log);
                        async move {
                            log.lock()
                                .unwrap()
                                .insert(item.idempotency_key().to_owned());
                            tokio::time::sleep(Duration::from_millis(2)).await;
                            Ok(Some(format!("tr-{}", item.idempotency_key())))
                        }
                    },
                    |items| items.iter().all(|i| i.state() == ItemState::Sent),
                );
                match run {
                    Err(Error::Io { op: "fsync", .. } | Error::Poisoned) => {}
                    Ok(report) => {
                        // All sent before that many syncs: nothing to check.
                        assert_eq!(report.sent, 96);
                        println!("sync {hit} was never reached");
                        continue;
                    }
                    Err(other) => panic!("sync {hit}: the worker stopped on {other}"),
                }
                let batches = outbox.failpoint_hits("step.batch");
                println!("sync {hit} failed after {batches} batches of two or more");
                if batches > 0 {
                    batched_runs += 1;
                }
                assert!(matches!(outbox.list_items(), Err(Error::Poisoned)));
                drop(outbox);
                let started = started.lock().unwrap().clone();
                after_failed_sync(dir.path(), hit, &started);
            }
            assert!(
                batched_runs >= 2,
                "only {batched_runs} of the runs had batched steps before their failed sync"
            );
        },
    );
}

/// What a reopen finds after the failed sync `hit`, given the keys whose
/// send started: the chain verifies; every sent item had started; every
/// started item has its claim or outcome on disk and is never resent; claims
/// left in the page cache fail as ambiguous; every other item goes out once.
fn after_failed_sync(dir: &std::path::Path, hit: u32, started: &HashSet<String>) {
    let reopened = Outbox::builder(dir)
        .rate_limit(u32::MAX, secs(60))
        .compact_on_open(false)
        .open()
        .unwrap();
    reopened.verify_audit().unwrap();
    let before = reopened.list_items().unwrap();
    // A claim written in the failed group reached the page cache: its
    // item is failed as ambiguous, never sent (at most one per slot).
    let claimed: HashSet<String> = before
        .iter()
        .filter(|i| i.dispatch_claimed())
        .map(|i| i.idempotency_key().to_owned())
        .collect();
    assert!(
        claimed.len() <= 16,
        "sync {hit}: {} claims for 16 slots",
        claimed.len()
    );
    for item in &before {
        let key = item.idempotency_key();
        if item.state() == ItemState::Sent {
            assert!(started.contains(key), "sync {hit}: {key} sent unseen");
        }
        if started.contains(key) {
            assert!(
                item.dispatch_claimed() || item.state() == ItemState::Sent,
                "sync {hit}: {key}'s send started but neither its claim nor its outcome is on disk"
            );
        }
    }
    reopened
        .process_due(|item| {
            assert!(
                !started.contains(item.idempotency_key()),
                "at-most-once: {} was resent after the failed sync {hit}",
                item.idempotency_key()
            );
            Ok(Some(format!("tr-{}", item.idempotency_key())))
        })
        .unwrap();
    for item in reopened.list_items().unwrap() {
        let key = item.idempotency_key();
        if claimed.contains(key) {
            assert_eq!(
                item.error_code(),
                Some(durable_outbox::AMBIGUOUS_AFTER_RESTART),
                "{key}"
            );
        } else if !started.contains(key) {
            assert_eq!(
                (item.state(), item.attempts()),
                (ItemState::Sent, 1),
                "{key}"
            );
        }
    }
}

on_both_engines! {
    /// A worker with 32 slots over a few busy chats and many quiet ones, its
    /// steps batched: every item is sent once, each chat in enqueue order,
    /// and the audit chain verifies (PostgreSQL runs the same batch rules
    /// in one SQL transaction).
    fn a_batched_worker_sends_each_item_once_and_each_chat_in_order(engine) {
        let outbox = engine.open_with(|b| b.rate_limit(u32::MAX, secs(60)));
        let mut messages = Vec::new();
        for n in 0..6 {
            for chat in 0..8 {
                messages.push(msg(&format!("m{n}-busy{chat}"), &format!("busy{chat}")));
            }
        }
        for chat in 0..40 {
            messages.push(msg(&format!("m0-quiet{chat}"), &format!("quiet{chat}")));
        }
        let total = messages.len();
        outbox.enqueue_many(messages).unwrap();
        let sent = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&sent);
        let report = within("batched steps on both engines: everything is sent", DEADLOCK_LIMIT * 4, || {
            run_worker(
                &outbox,
                32,
                move |item: OutboxItem| {
                    let log = Arc::clone(&log);
                    async move {
                        log.lock().unwrap().push(item.idempotency_key().to_owned());
                        tokio::time::sleep(Duration::from_millis(3)).await;
                        Ok(Some(format!("tr-{}", item.idempotency_key())))
                    }
                },
                |items| items.iter().all(|i| i.state() == ItemState::Sent),
            )
            .unwrap()
        });
        assert_eq!(report.sent, total);
        let sent = sent.lock().unwrap().clone();
        let once: HashSet<&String> = sent.iter().collect();
        assert_eq!((sent.len(), once.len()), (total, total), "an item was sent twice");
        for (chat, keys) in per_chat(&sent) {
            let rounds: Vec<usize> = keys.iter().map(|k| k[1..k.find('-').unwrap()].parse().unwrap()).collect();
            let mut sorted = rounds.clone();
            sorted.sort_unstable();
            assert_eq!(rounds, sorted, "chat {chat} out of order: {keys:?}");
        }
        outbox.verify_audit().unwrap();
    }
}

/// A panic in a batch's rules behaves as a panic in the rules of a single
/// step does: `Worker::run` raises it (the same message), rather than
/// returning an error about a vanished leader. Nothing of the batch was
/// written; a worker started afterwards sends every item, none twice, and
/// the chain verifies.
#[test]
fn a_panic_in_a_batchs_rules_is_raised_by_the_worker() {
    const CHATS: usize = 8;
    within(
        "batched steps: a panic in a batch's rules is raised by the worker",
        Duration::from_secs(120),
        || {
            let dir = tempfile::tempdir().unwrap();
            let outbox = Outbox::builder(dir.path())
                .rate_limit(u32::MAX, secs(60))
                .failpoint("journal.write", FailAction::DelayMs(5))
                .failpoint("step.batch", FailAction::Panic)
                .open()
                .unwrap();
            let messages = (0..CHATS)
                .flat_map(|c| (1..=2).map(move |r| msg(&format!("r{r}-c{c}"), &format!("c{c}"))))
                .collect();
            outbox.enqueue_many(messages).unwrap();
            let sent = Arc::new(Mutex::new(Vec::new()));
            let started = Arc::new(AtomicUsize::new(0));
            let (gate, opened) = tokio::sync::watch::channel(false);
            let transport = {
                let (sent, started) = (Arc::clone(&sent), Arc::clone(&started));
                move |item: OutboxItem| {
                    let (sent, started) = (Arc::clone(&sent), Arc::clone(&started));
                    let mut opened = opened.clone();
                    async move {
                        sent.lock().unwrap().push(item.idempotency_key().to_owned());
                        started.fetch_add(1, Ordering::SeqCst);
                        // The first round finishes all at once: the slots'
                        // next steps share a batch.
                        opened.wait_for(|open| *open).await.unwrap();
                        Ok(Some(format!("tr-{}", item.idempotency_key())))
                    }
                }
            };
            let raised = runtime().block_on(async {
                let running = tokio::spawn(
                    outbox
                        .worker(transport)
                        .concurrency(CHATS)
                        .run(std::future::pending()),
                );
                while started.load(Ordering::SeqCst) < CHATS {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                gate.send(true).unwrap();
                match running.await {
                    Err(join) if join.is_panic() => join.into_panic(),
                    Err(join) => panic!("the worker's task failed otherwise: {join}"),
                    Ok(ended) => panic!("the worker ended without raising the panic: {ended:?}"),
                }
            });
            let message = raised
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| raised.downcast_ref::<&str>().map(|m| (*m).to_owned()))
                .unwrap_or_default();
            assert_eq!(message, "failpoint step.batch panicked");
            assert!(outbox.failpoint_hits("step.batch") >= 1);
            drop(outbox);

            // A new worker on the reopened outbox finishes the job.
            let reopened = Outbox::builder(dir.path())
                .rate_limit(u32::MAX, secs(60))
                .open()
                .unwrap();
            let again = Arc::clone(&sent);
            run_worker(
                &reopened,
                CHATS,
                move |item: OutboxItem| {
                    let again = Arc::clone(&again);
                    async move {
                        again
                            .lock()
                            .unwrap()
                            .push(item.idempotency_key().to_owned());
                        Ok(Some(format!("tr-{}", item.idempotency_key())))
                    }
                },
                |items| items.iter().all(|i| i.state() != ItemState::Queued),
            )
            .unwrap();
            let sent = sent.lock().unwrap().clone();
            let once: HashSet<&String> = sent.iter().collect();
            assert_eq!(once.len(), sent.len(), "an item was sent twice: {sent:?}");
            for item in reopened.list_items().unwrap() {
                let key = item.idempotency_key();
                match item.state() {
                    // Sent: by either worker, exactly once.
                    ItemState::Sent => assert!(once.contains(&key.to_owned()), "{key}"),
                    // A send whose outcome the panicked batch did not record
                    // is ambiguous, never resent.
                    ItemState::Failed => assert_eq!(
                        item.error_code(),
                        Some(durable_outbox::AMBIGUOUS_AFTER_RESTART),
                        "{key}"
                    ),
                    ItemState::Queued => panic!("{key} is still queued"),
                }
            }
            reopened.verify_audit().unwrap();
        },
    );
}

/// A panic on the way into a batch, before it has collected its members
/// (`step.collect` armed to panic once, at the first step of the slots'
/// second round, which several of them share), is raised by `Worker::run`
/// too: the requests the batch was started for are its members. Dropping it
/// and letting them step alone would go on as if nothing happened, hiding a
/// bug in the rules' way in.
#[test]
fn a_panic_before_a_batch_collects_its_members_is_raised_by_the_worker() {
    const CHATS: usize = 8;
    within(
        "batched steps: a panic before a batch collects its members is raised by the worker",
        Duration::from_secs(120),
        || {
            let dir = tempfile::tempdir().unwrap();
            // Hit 1: the step that claims the first round (the worker's fill).
            let outbox = Outbox::builder(dir.path())
                .rate_limit(u32::MAX, secs(60))
                .failpoint("step.collect", FailAction::PanicOnHit(2))
                .open()
                .unwrap();
            let messages = (0..CHATS)
                .flat_map(|c| (1..=2).map(move |r| msg(&format!("r{r}-c{c}"), &format!("c{c}"))))
                .collect();
            outbox.enqueue_many(messages).unwrap();
            let started = Arc::new(AtomicUsize::new(0));
            let (gate, opened) = tokio::sync::watch::channel(false);
            let transport = {
                let started = Arc::clone(&started);
                move |item: OutboxItem| {
                    let started = Arc::clone(&started);
                    let mut opened = opened.clone();
                    async move {
                        started.fetch_add(1, Ordering::SeqCst);
                        opened.wait_for(|open| *open).await.unwrap();
                        Ok(Some(format!("tr-{}", item.idempotency_key())))
                    }
                }
            };
            let probe = outbox.clone();
            let raised = runtime().block_on(async {
                // Shuts the worker down once nothing is queued: a worker that
                // dropped the panic ends cleanly instead of raising it.
                let drained = async move {
                    while probe
                        .list_items()
                        .is_ok_and(|items| items.iter().any(|i| i.state() == ItemState::Queued))
                    {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                };
                let running = tokio::spawn(outbox.worker(transport).concurrency(CHATS).run(drained));
                while started.load(Ordering::SeqCst) < CHATS {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                gate.send(true).unwrap();
                match running.await {
                    Err(join) if join.is_panic() => join.into_panic(),
                    Err(join) => panic!("the worker's task failed otherwise: {join}"),
                    Ok(ended) => panic!(
                        "the worker ended without raising the panic before its batch collected: {ended:?}"
                    ),
                }
            });
            let message = raised
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| raised.downcast_ref::<&str>().map(|m| (*m).to_owned()))
                .unwrap_or_default();
            assert_eq!(message, "failpoint step.collect panicked");
            assert!(outbox.failpoint_hits("step.collect") >= 2);
            outbox.verify_audit().unwrap();
        },
    );
}

/// PostgreSQL aborts a batched step (serialization failure, SQLSTATE 40001,
/// injected once by a trigger on the first transaction that finishes two
/// items: only a batch of two or more members does) and the engine runs it
/// again: the rerun keeps the batch's members (their finished sends are
/// recorded, none is told its step failed; a rerun that dropped them stops
/// the worker with "the leader of the step's batch is gone"), and the
/// claims it makes instead of the aborted attempt's are each sent once:
/// every item is sent once, each chat in order, the worker ends cleanly, and
/// the chain verifies. (The aborted attempt's in-flight marks are taken back
/// too; the rerun claims the same items, so a mark left over would not show
/// here.)
#[cfg(feature = "postgres")]
#[test]
fn a_batch_rerun_after_a_postgres_abort_keeps_its_members_and_sends_each_item_once() {
    const CHATS: usize = 8;
    const ROUNDS: usize = 3;
    let Some(engine) = crate::engines::EngineUnderTest::postgres() else {
        return;
    };
    let outbox = engine.open_with(|b| {
        b.rate_limit(u32::MAX, secs(60))
            .failpoint("step.batch", FailAction::DelayMs(0))
    });
    let messages = (1..=ROUNDS)
        .flat_map(|r| (0..CHATS).map(move |c| msg(&format!("r{r}-c{c}"), &format!("c{c}"))))
        .collect();
    outbox.enqueue_many(messages).unwrap();
    let url = engine.url();
    let db = url.rsplit('/').next().unwrap().to_owned();
    let server = crate::pg_server::PgServer::shared().unwrap();
    server.psql(
        &db,
        "CREATE SEQUENCE public.batch_aborts;
         CREATE FUNCTION public.abort_first_batch() RETURNS trigger LANGUAGE plpgsql AS $$
         DECLARE finishes int;
         BEGIN
             IF OLD.claimed AND NOT NEW.claimed THEN
                 finishes := coalesce(nullif(current_setting('outbox_test.finishes', true), ''), '0')::int + 1;
                 PERFORM set_config('outbox_test.finishes', finishes::text, true);
                 IF finishes = 2 AND NOT (SELECT is_called FROM public.batch_aborts) THEN
                     PERFORM nextval('public.batch_aborts');
                     RAISE EXCEPTION 'injected conflict' USING ERRCODE = 'serialization_failure';
                 END IF;
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER abort_first_batch BEFORE UPDATE ON durable_outbox.items
             FOR EACH ROW EXECUTE FUNCTION public.abort_first_batch();",
    );
    let (transport, Rounds { sent, releaser }) = released_by_rounds(CHATS, ROUNDS);
    let report = within(
        "a batch rerun after a PostgreSQL abort",
        DEADLOCK_LIMIT * 2,
        || {
            run_worker(&outbox, CHATS, transport, |items| {
                items.iter().all(|i| i.state() == ItemState::Sent)
            })
        },
    )
    .expect("the worker ends cleanly: no member of the rerun batch was failed");
    releaser.join().unwrap();
    assert_eq!(
        server.psql(&db, "SELECT is_called FROM public.batch_aborts"),
        "t",
        "no batch of two or more finished sends was aborted: nothing was rerun ({} batches)",
        outbox.failpoint_hits("step.batch")
    );
    assert_eq!(report.sent, CHATS * ROUNDS, "{report:?}");
    let sent = sent.lock().unwrap().clone();
    each_item_sent_once_in_chat_order(&outbox, &sent, CHATS, ROUNDS);
    outbox.verify_audit().unwrap();
}
