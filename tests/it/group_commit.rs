//! Group commit: concurrent transactions on one handle share one fdatasync, and
//! each still gets its own answer. A call returns only after its own change is
//! durable; a refused call fails nobody else's; a failed sync fails its whole
//! group and everything after it, and none of them is reported durable; a
//! SIGKILL in the middle of a group loses nothing acknowledged and sends nothing
//! twice; two processes with many threads each interleave safely.
//!
//! File-only by design: the journal's shared fdatasync and its failpoints.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Mutex;

use durable_outbox::{Error, FailAction, ItemState, Outbox, Outcome};

use crate::harness::{DEADLOCK_LIMIT, Harness, msg, within};
use crate::processes::{check_invariants, resolve_dead_claims, transport_log, worker};

const THREADS: usize = 8;

#[test]
fn every_thread_gets_its_own_result_and_a_refused_call_fails_nobody_else() {
    within(
        "group commit: every concurrent call gets its own result",
        DEADLOCK_LIMIT,
        || {
            let h = Harness::with(|b| b.rate_limit(1000, std::time::Duration::from_secs(60)));
            std::thread::scope(|scope| {
                for t in 0..THREADS {
                    let outbox = &h.outbox;
                    scope.spawn(move || {
                        for i in 0..15 {
                            let key = format!("k-{t}-{i}");
                            outbox.enqueue(msg(&key, &format!("chat-{t}"))).unwrap();
                            // The same key for another chat is refused, and
                            // only this call: its neighbours in the group commit.
                            let conflict = outbox.enqueue(msg(&key, "chat-other")).unwrap_err();
                            assert!(
                                matches!(conflict, Error::IdempotencyConflict { .. }),
                                "{conflict}"
                            );
                            let invalid = outbox.enqueue(msg("", "chat-1")).unwrap_err();
                            assert!(matches!(invalid, Error::InvalidField { .. }), "{invalid}");
                            let receipt = outbox
                                .process(&key, |_| Ok(Some(format!("tr-{key}"))))
                                .unwrap();
                            assert_eq!(receipt.outcome, Outcome::Sent, "{key}");
                        }
                    });
                }
            });
            // Another handle (another process) sees every change, each with its
            // records in the order the changes were made.
            let other = h.reopen();
            let items = other.list_items().unwrap();
            assert_eq!(items.len(), THREADS * 15);
            assert!(items.iter().all(|i| i.state() == ItemState::Sent));
            assert_eq!(
                other.verify_audit().unwrap().records,
                2 * THREADS as u64 * 15
            );
            for t in 0..THREADS {
                let key = format!("k-{t}-14");
                let outcomes: Vec<String> = other
                    .history(&key)
                    .unwrap()
                    .iter()
                    .map(|r| r.outcome.as_str().to_owned())
                    .collect();
                assert_eq!(outcomes, ["queued", "sent"], "{key}");
            }
        },
    );
}

/// Threads that each commit again as soon as their last commit is durable
/// share each sync, all of them: the first one back does not sync alone while
/// the others arrive (which split eight threads into groups of one and seven,
/// about four transactions per fdatasync). The sync is slowed to 50 ms so the
/// scheduler has that long to bring every released thread back.
#[test]
fn threads_released_by_a_sync_share_the_next_one() {
    const EACH: usize = 10;
    within(
        "group commit: released threads share the next sync",
        DEADLOCK_LIMIT,
        || {
            let h = Harness::with(|b| b.failpoint("journal.fsync", FailAction::DelayMs(50)));
            let before = h.outbox.failpoint_hits("journal.fsync");
            let start = std::sync::Barrier::new(THREADS);
            std::thread::scope(|scope| {
                for t in 0..THREADS {
                    let (outbox, start) = (&h.outbox, &start);
                    scope.spawn(move || {
                        start.wait();
                        for i in 0..EACH {
                            outbox
                                .enqueue(msg(&format!("k-{t}-{i}"), &format!("chat-{t}")))
                                .unwrap();
                        }
                    });
                }
            });
            let syncs = (h.outbox.failpoint_hits("journal.fsync") - before) as usize;
            let commits = THREADS * EACH;
            println!(
                "{commits} commits of {THREADS} threads in {syncs} syncs: {:.1} per sync",
                commits as f64 / syncs as f64
            );
            // All eight in every group would be 10 syncs; groups of one and
            // seven take 20.
            assert!(
                syncs * 6 <= commits,
                "{commits} commits took {syncs} syncs: fewer than 6 per sync"
            );
            assert_eq!(h.reopen().list_items().unwrap().len(), commits);
        },
    );
}

/// What one call of the fault campaign returned.
enum Answer {
    Durable(String),
    SyncFailed(String),
    Poisoned(String),
}

#[test]
fn a_failed_sync_fails_its_whole_group_and_everything_after_it() {
    within(
        "group commit: a failed sync wakes every member with an error",
        DEADLOCK_LIMIT * 2,
        || {
            // The failure must land on a group with a member written after its
            // leader's entry; that is up to the scheduler, so try a few times
            // and prove it happened. Usually the first round does; a loaded
            // machine may run the threads one after another for many rounds.
            let mut followers_seen = 0;
            for round in 0..200 {
                followers_seen += failed_sync_round(round);
                if followers_seen > 0 {
                    break;
                }
            }
            assert!(
                followers_seen > 0,
                "no injected fsync failure ever hit a group with a follower after its leader: \
                 the test exercised nothing"
            );
        },
    );
}

/// One handle, THREADS threads enqueueing until their first error, the journal
/// fsync failing at its 6th hit. Returns how many entries the journal holds
/// after the failed leader's own (members of its group, or later, written but
/// never acknowledged).
fn failed_sync_round(round: u32) -> usize {
    let h = Harness::with(|b| b.failpoint("journal.fsync", FailAction::ErrorOnHit(6)));
    let answers = enqueue_until_error(&h, round, "fsync");
    let (leader, order) = check_after_a_failed_group(&h, &answers);
    let at_leader = order
        .iter()
        .position(|k| *k == leader)
        .expect("the leader's entry reached the journal");
    order.len() - at_leader - 1
}

/// As [`failed_sync_round`], with the leader's one write of its group's
/// entries failing half-way (at its 6th group): half of the bytes reach the
/// journal, and then the error. Returns how many whole entries the journal
/// holds that nobody was told are durable (the failed group's first members).
fn failed_group_write_round(round: u32) -> usize {
    let h = Harness::with(|b| b.failpoint("journal.group_write", FailAction::ErrorOnHit(6)));
    let answers = enqueue_until_error(&h, round, "append");
    let (_, order) = check_after_a_failed_group(&h, &answers);
    let durable = answers
        .iter()
        .filter(|a| matches!(a, Answer::Durable(_)))
        .count();
    order.len() - durable
}

/// THREADS threads enqueueing on `h` until each gets its first error: the
/// leader of the failed group gets the I/O error of `op`, everybody else
/// [`Error::Poisoned`]. (Each stops after 500 calls anyway: a failure that is
/// never reported fails the checks instead of running forever.)
fn enqueue_until_error(h: &Harness, round: u32, op: &str) -> Vec<Answer> {
    let answers = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (outbox, answers) = (&h.outbox, &answers);
            scope.spawn(move || {
                for i in 0..500 {
                    let key = format!("r{round}-{t}-{i}");
                    let answer = match outbox.enqueue(msg(&key, "chat-1")) {
                        Ok(_) => Answer::Durable(key),
                        Err(Error::Io { op: failed, .. }) if failed == op => {
                            Answer::SyncFailed(key)
                        }
                        Err(Error::Poisoned) => Answer::Poisoned(key),
                        Err(other) => panic!("{key}: unexpected error {other}"),
                    };
                    let done = !matches!(answer, Answer::Durable(_));
                    answers.lock().unwrap().push(answer);
                    if done {
                        break;
                    }
                }
            });
        }
    });
    answers.into_inner().unwrap()
}

/// What every failed group must leave: one call failed with the I/O error,
/// the handle poisoned, and an outbox that reopens with a verifying audit
/// chain, every acknowledged change, and acknowledged changes as a prefix of
/// the journal. Returns the leader's key and the keys in journal order.
fn check_after_a_failed_group(h: &Harness, answers: &[Answer]) -> (String, Vec<String>) {
    let leader: Vec<&str> = answers
        .iter()
        .filter_map(|a| match a {
            Answer::SyncFailed(k) => Some(k.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(leader.len(), 1, "exactly one call led the failed sync");
    // The handle stays poisoned: nothing after the failure is ever durable.
    assert!(matches!(
        h.outbox.enqueue(msg("after", "chat-1")),
        Err(Error::Poisoned)
    ));
    assert!(matches!(h.outbox.list_items(), Err(Error::Poisoned)));
    // What reached the disk decides, as for one failed fsync: a reopen finds
    // every acknowledged change and nothing that was never attempted.
    let reopened = h.reopen();
    reopened.verify_audit().unwrap();
    let durable: HashSet<&str> = answers
        .iter()
        .filter_map(|a| match a {
            Answer::Durable(k) => Some(k.as_str()),
            _ => None,
        })
        .collect();
    let attempted: HashSet<&str> = answers
        .iter()
        .map(|a| match a {
            Answer::Durable(k) | Answer::SyncFailed(k) | Answer::Poisoned(k) => k.as_str(),
        })
        .collect();
    // The audit log is in journal order.
    let order: Vec<String> = durable_outbox::AuditLog::read(h.path("audit.jsonl"))
        .unwrap()
        .into_iter()
        .map(|r| r.idempotency_key)
        .collect();
    assert!(order.iter().all(|k| attempted.contains(k.as_str())));
    for key in &durable {
        assert!(
            order.iter().any(|k| k == key),
            "acknowledged {key} was lost"
        );
        assert_eq!(
            reopened.get(key).unwrap().map(|item| item.state()),
            Some(ItemState::Queued),
            "acknowledged {key} is not in the reopened outbox"
        );
    }
    // Acknowledged changes are a prefix of the journal: everything from the
    // first unacknowledged entry on (the failed group, and whatever was
    // written after it) was answered with an error.
    if let Some(first_failed) = order.iter().position(|k| !durable.contains(k.as_str())) {
        for key in &order[first_failed..] {
            assert!(
                !durable.contains(key.as_str()),
                "{key} was reported durable although an earlier entry's sync failed"
            );
        }
    }
    (leader[0].to_owned(), order)
}

#[test]
fn a_group_write_that_fails_half_way_fails_its_whole_group_and_the_outbox_reopens() {
    within(
        "group commit: a failed write of a group's entries fails every member",
        DEADLOCK_LIMIT * 2,
        || {
            // As for a failed sync: the failure must land on a group of two or
            // more, so that part of it (a whole entry) reaches the journal.
            let mut unacknowledged = 0;
            for round in 0..200 {
                unacknowledged += failed_group_write_round(round);
                if unacknowledged > 0 {
                    break;
                }
            }
            assert!(
                unacknowledged > 0,
                "no injected group write failure ever left a whole entry of its group: \
                 the test exercised nothing"
            );
        },
    );
}

#[test]
fn a_panic_in_a_transaction_while_a_group_is_open_keeps_other_processes_off_its_entries() {
    within(
        "group commit: another process never writes where an open group's entries go",
        DEADLOCK_LIMIT,
        || {
            // How often opening passes the journal's write point, so that the
            // panic lands on the second transaction after it.
            let probe = Harness::with(|b| b.failpoint("journal.write", FailAction::DelayMs(0)));
            let setup = probe.outbox.failpoint_hits("journal.write");
            drop(probe);
            let h = Harness::with(|b| {
                b.failpoint("journal.write", FailAction::PanicOnHit(setup + 2))
                    .failpoint("commit.lead", FailAction::DelayMs(1000))
            });
            // Another process (its own `flock`), opened before anything happens.
            let other = h.reopen();
            std::thread::scope(|scope| {
                // A's entry is kept for its leader (A itself), which waits
                // before it takes the lock again to write and sync it.
                let a = scope.spawn(|| h.outbox.enqueue(msg("a", "chat-1")).map(|_| ()));
                let limit = std::time::Instant::now() + std::time::Duration::from_secs(20);
                while h.outbox.failpoint_hits("commit.lead") == 0 {
                    assert!(std::time::Instant::now() < limit, "A never led its sync");
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                // B panics under the lock while A's group is open.
                let b = scope.spawn(|| h.outbox.enqueue(msg("b", "chat-2")));
                assert!(b.join().is_err(), "B's transaction was to panic");
                // The other process commits; it must not write before A's
                // entry is in the journal, or one would overwrite the other.
                let c = scope.spawn(|| other.enqueue(msg("c", "chat-3")).map(|_| ()));
                a.join().unwrap().unwrap();
                c.join().unwrap().unwrap();
            });
            drop(other);
            let reopened = h.reopen();
            reopened.verify_audit().unwrap();
            for key in ["a", "c"] {
                assert!(
                    reopened.get(key).unwrap().is_some(),
                    "acknowledged {key} was lost"
                );
            }
        },
    );
}

#[test]
fn a_leader_that_panics_outside_the_lock_lets_other_processes_in() {
    // The class: a leader unwinding out of its sync while it does not hold
    // the state's lock (its group's write, its fdatasync). Its group fails,
    // and the `flock` it keeps for the group must go with it: a poisoned
    // handle that is still open must not keep every other process out.
    for failpoint in ["journal.group_write", "journal.fsync"] {
        within(
            "group commit: a leader's panic outside the lock releases the flock",
            DEADLOCK_LIMIT,
            || {
                let h = Harness::with(|b| b.failpoint(failpoint, FailAction::Panic));
                // Another process (its own `flock`), opened before anything happens.
                let other = h.reopen();
                let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    h.outbox.enqueue(msg("a", "chat-1"))
                }));
                assert!(panicked.is_err(), "{failpoint}: the leader was to panic");
                assert!(
                    matches!(h.outbox.enqueue(msg("b", "chat-2")), Err(Error::Poisoned)),
                    "{failpoint}: the handle whose group failed still commits"
                );
                // The poisoned handle stays open; the other process commits.
                other.enqueue(msg("c", "chat-3")).unwrap();
                drop(other);
                // And the same process opens the outbox again.
                let reopened = h.reopen();
                reopened.verify_audit().unwrap();
                assert!(
                    reopened.get("c").unwrap().is_some(),
                    "{failpoint}: acknowledged c was lost"
                );
                assert!(reopened.get("b").unwrap().is_none(), "{failpoint}");
            },
        );
    }
}

#[test]
fn a_compaction_waiting_for_the_lock_while_a_group_fails_refuses_instead_of_saving_it() {
    within(
        "group commit: a failed group's changes never reach a snapshot",
        DEADLOCK_LIMIT,
        || {
            let h = Harness::with(|b| {
                b.failpoint("journal.group_write", FailAction::Error)
                    .failpoint("commit.quiet", FailAction::DelayMs(1500))
            });
            std::thread::scope(|scope| {
                // The compaction checks the handle is healthy, then waits
                // for the lock (held back here) while the group fails.
                let compact = scope.spawn(|| h.outbox.compact());
                let limit = std::time::Instant::now() + std::time::Duration::from_secs(20);
                while h.outbox.failpoint_hits("commit.quiet") == 0 {
                    assert!(std::time::Instant::now() < limit, "compact never started");
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                // Half of `a`'s entry reaches the journal, then the write fails.
                let failed = h.outbox.enqueue(msg("a", "chat-1")).unwrap_err();
                assert!(matches!(failed, Error::Io { .. }), "{failed:?}");
                let compacted = compact.join().unwrap();
                assert!(
                    matches!(compacted, Err(Error::Poisoned)),
                    "a compaction ran on the handle whose group failed: {compacted:?}"
                );
            });
            let reopened = h.reopen();
            reopened.verify_audit().unwrap();
            assert!(
                reopened.get("a").unwrap().is_none(),
                "the failed enqueue of a was made durable by a snapshot of the cached state"
            );
        },
    );
}

/// The number of kill rounds of the group crash campaign: the default keeps
/// the suite fast; `OUTBOX_GROUP_KILL_ROUNDS` runs a longer campaign.
fn kill_rounds() -> u32 {
    std::env::var("OUTBOX_GROUP_KILL_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4)
}

#[test]
fn a_kill_in_the_middle_of_a_group_loses_nothing_acknowledged_and_sends_nothing_twice() {
    within(
        "group commit: a kill mid-group leaves an outbox that opens",
        // About half a second per round on a loaded machine; generous.
        DEADLOCK_LIMIT * (4 + kill_rounds() / 8),
        || {
            let dir = tempfile::tempdir().unwrap();
            let log = dir.path().join("transport.log");
            let outbox_dir = dir.path().join("outbox");
            let d = outbox_dir.to_str().unwrap();
            let mut acked = HashSet::new();
            let mut biggest_interrupted = 0;
            let rounds = kill_rounds();
            for round in 0..rounds {
                // Kill at a leader's sync, a different one each round: the
                // other threads' entries are written and waiting for it.
                let hit = 3 + (7 * round) % 30;
                let out = worker(&[
                    "group",
                    d,
                    log.to_str().unwrap(),
                    &format!("g{round}"),
                    &THREADS.to_string(),
                    "20",
                ])
                .env(
                    "DURABLE_OUTBOX_FAILPOINTS",
                    format!("journal.fsync=kill@{hit}"),
                )
                .output()
                .unwrap();
                let stdout = String::from_utf8(out.stdout).unwrap();
                assert_eq!(
                    std::os::unix::process::ExitStatusExt::signal(&out.status),
                    Some(9),
                    "round {round}: the worker was not killed at sync {hit}: {}\n{stdout}",
                    out.status
                );
                let queued: HashSet<String> = stdout
                    .lines()
                    .filter_map(|l| l.strip_prefix("queued "))
                    .map(str::to_owned)
                    .collect();
                let sent: HashSet<&str> = stdout
                    .lines()
                    .filter_map(|l| l.strip_prefix("sent "))
                    .collect();
                // Changes the journal holds but whose call never returned: the
                // group the kill interrupted (an enqueue, a claim or an outcome
                // further along than what was acknowledged).
                let unacked = Outbox::open(&outbox_dir)
                    .unwrap()
                    .list_items()
                    .unwrap()
                    .iter()
                    .filter(|i| i.idempotency_key().starts_with(&format!("g{round}-")))
                    .filter(|i| {
                        let key = i.idempotency_key();
                        let on_disk = match (i.state(), i.dispatch_claimed()) {
                            (ItemState::Sent, _) => 3,
                            (_, true) => 2,
                            _ => 1,
                        };
                        let acknowledged = if sent.contains(key) {
                            3
                        } else {
                            u8::from(queued.contains(key))
                        };
                        on_disk > acknowledged
                    })
                    .count();
                biggest_interrupted = biggest_interrupted.max(unacked);
                let replay = format!("round {round}, kill at sync {hit}");
                resolve_dead_claims(&outbox_dir, &replay);
                acked.extend(queued);
                check_invariants(&outbox_dir, &log, &acked, u64::from(round), round + 1);
            }
            assert!(
                biggest_interrupted >= 2,
                "no kill in {rounds} rounds interrupted a group with more than one \
                 unacknowledged change: the campaign exercised no group"
            );
            assert!(!transport_log(&log).is_empty());
        },
    );
}

#[test]
fn two_processes_with_many_threads_each_interleave_their_groups_safely() {
    within(
        "group commit: two processes share the directory lock",
        DEADLOCK_LIMIT * 2,
        || {
            let dir = tempfile::tempdir().unwrap();
            let log = dir.path().join("transport.log");
            let outbox_dir = dir.path().join("outbox");
            let d = outbox_dir.to_str().unwrap();
            let children: Vec<_> = (0..2)
                .map(|p| {
                    worker(&[
                        "group",
                        d,
                        log.to_str().unwrap(),
                        &format!("p{p}"),
                        "4",
                        "15",
                    ])
                    .spawn()
                    .unwrap()
                })
                .collect();
            for child in children {
                let out = child.wait_with_output().unwrap();
                let stdout = String::from_utf8(out.stdout).unwrap();
                assert!(out.status.success(), "{stdout}");
                assert!(!stdout.contains("error"), "{stdout}");
                assert_eq!(
                    stdout.lines().filter(|l| l.starts_with("sent ")).count(),
                    60
                );
            }
            let outbox = Outbox::open(&outbox_dir).unwrap();
            let items = outbox.list_items().unwrap();
            assert_eq!(items.len(), 120);
            assert!(
                items
                    .iter()
                    .all(|i| i.state() == ItemState::Sent && i.attempts() == 1)
            );
            assert_eq!(outbox.verify_audit().unwrap().records, 240);
            let delivered = transport_log(&log);
            let once: HashSet<&String> = delivered.iter().collect();
            assert_eq!((delivered.len(), once.len()), (120, 120));
            check_invariants(Path::new(&outbox_dir), &log, &HashSet::new(), 0, 0);
        },
    );
}

/// A worker's slots that finish together share commit groups: one slot's step
/// never holds the others back while it waits for its fdatasync. (Its picker
/// used to be locked across the step's sync, so every step paid its own.) The
/// sync is slowed to 100 ms so the other slots surely arrive during it; the
/// sends of each round are held until all eight are running, then let go at once.
#[cfg(feature = "tokio")]
#[test]
fn a_workers_slots_that_finish_together_share_one_sync() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const CHATS: usize = 8;
    const ROUNDS: usize = 4;
    const SYNC_MS: u32 = 100;
    within(
        "group commit: a worker's concurrent outcomes share a sync",
        std::time::Duration::from_secs(120),
        || {
            let dir = tempfile::tempdir().unwrap();
            let outbox = Outbox::builder(dir.path())
                .rate_limit(u32::MAX, std::time::Duration::from_secs(60))
                .failpoint("journal.fsync", FailAction::DelayMs(SYNC_MS))
                .open()
                .unwrap();
            // Round r of chat c is the r-th message to chat c.
            let messages = (1..=ROUNDS)
                .flat_map(|r| {
                    (0..CHATS).map(move |c| msg(&format!("r{r}-c{c}"), &format!("chat-{c}")))
                })
                .collect();
            outbox.enqueue_many(messages).unwrap();
            let before = outbox.failpoint_hits("journal.fsync");
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            let started = Arc::new(AtomicUsize::new(0));
            let (gate, opened) = tokio::sync::watch::channel(0usize);
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let send = {
                let started = Arc::clone(&started);
                move |item: durable_outbox::OutboxItem| {
                    let started = Arc::clone(&started);
                    let mut opened = opened.clone();
                    async move {
                        let key = item.idempotency_key().to_owned();
                        let round: usize = key[1..key.find('-').unwrap()].parse().unwrap();
                        started.fetch_add(1, Ordering::SeqCst);
                        opened.wait_for(|open| *open >= round).await.unwrap();
                        Ok(Some(format!("tr-{key}")))
                    }
                }
            };
            let report = runtime.block_on(async {
                let worker = outbox.worker(send).concurrency(CHATS);
                let running = tokio::spawn(worker.run(async move {
                    stopped.await.ok();
                }));
                for round in 1..=ROUNDS {
                    // Every slot is in its send of this round: let them all go.
                    while started.load(Ordering::SeqCst) < round * CHATS {
                        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
                    }
                    gate.send(round).unwrap();
                }
                loop {
                    let items = outbox.list_items().unwrap();
                    if items.iter().all(|i| i.state() == ItemState::Sent) {
                        break;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
                stop.send(()).unwrap();
                running.await.unwrap().unwrap()
            });
            assert_eq!(report.sent, CHATS * ROUNDS);
            let syncs = outbox.failpoint_hits("journal.fsync") - before;
            // Each of the CHATS * ROUNDS sends ends in a step of its own; alone,
            // each would cost a sync, plus one per first claim.
            let alone = (CHATS + CHATS * ROUNDS) as u32;
            assert!(
                syncs <= alone / 2,
                "{syncs} fdatasyncs for {alone} steps: the slots' steps did not share syncs"
            );
        },
    );
}
