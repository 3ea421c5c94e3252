//! Real processes: concurrent writers, SIGKILL inside send, races on one key, a kill loop.
//!
//! Bodies in `on_both_engines!` run on the file engine and on PostgreSQL
//! (`name::file`, `name::postgres`): processes on one directory, or on one
//! schema. File-only here: the `#[test]`s kill at file-engine failpoints
//! (between the journal commit and the audit append, inside a move to
//! history or a prune) or check the directory after each kill (the kill loop;
//! on PostgreSQL `postgres_outbox::host_processes_racing_one_outbox_send_each_key_at_most_once`
//! kills a host among racing hosts).

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use durable_outbox::{AMBIGUOUS_AFTER_RESTART, ItemState, Outbox, Outcome};

use crate::engines::on_both_engines;

const WORKER: &str = env!("CARGO_BIN_EXE_outbox-test-worker");

pub(crate) fn worker(args: &[&str]) -> Command {
    let mut cmd = Command::new(WORKER);
    cmd.args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    cmd
}

fn spawn(args: &[&str]) -> Child {
    worker(args).spawn().expect("spawn worker")
}

/// Reads the child's stdout until a line starts with `prefix`.
pub(crate) fn wait_for_line(child: &mut Child, prefix: &str) -> String {
    let out = child.stdout.as_mut().expect("piped stdout");
    let mut reader = BufReader::new(out);
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            reader.read_line(&mut line).expect("read") > 0,
            "worker exited before printing {prefix:?}"
        );
        if line.starts_with(prefix) {
            return line.trim_end().to_owned();
        }
    }
}

fn kill9(child: &mut Child) {
    child.kill().expect("SIGKILL"); // std's kill is SIGKILL on Unix
    child.wait().expect("reap");
}

pub(crate) fn transport_log(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

on_both_engines! {
    fn concurrent_processes_enqueueing_lose_no_update(engine) {
        let location = engine.location();
        let children: Vec<Child> = (0..4)
            .map(|p| spawn(&["enqueue", &location, &format!("p{p}"), "40"]))
            .collect();
        let mut acked = HashSet::new();
        for child in children {
            let out = child.wait_with_output().unwrap();
            assert!(out.status.success());
            for line in String::from_utf8(out.stdout).unwrap().lines() {
                acked.insert(line.strip_prefix("queued ").unwrap().to_owned());
            }
        }
        assert_eq!(acked.len(), 160);
        let outbox = engine.open_real_clock_with(|b| b);
        let keys: HashSet<String> = outbox
            .list_items()
            .unwrap()
            .iter()
            .map(|i| i.idempotency_key().to_owned())
            .collect();
        assert_eq!(keys, acked);
        assert_eq!(outbox.verify_audit().unwrap().records, 160);
    }

    fn a_worker_killed_inside_send_leaves_an_ambiguous_item_that_is_never_resent(engine) {
        let outbox = engine.open_real_clock_with(|b| b);
        outbox.enqueue(crate::harness::msg("k", "chat-1")).unwrap();
        let mut child = spawn(&["process", &engine.child_location("killed"), "k", "hang"]);
        wait_for_line(&mut child, "sending k");

        // While the worker is alive and inside send, we are told it is in flight.
        let live = outbox
            .process("k", |_| panic!("sent while another process sends"))
            .unwrap();
        assert_eq!(live.outcome, Outcome::InFlight);

        kill9(&mut child);
        engine.await_child_gone("killed");
        let after = outbox
            .process("k", |_| panic!("resent after a crash"))
            .unwrap();
        assert_eq!(after.outcome, Outcome::Failed);
        assert_eq!(after.error_code.as_deref(), Some(AMBIGUOUS_AFTER_RESTART));
        assert_eq!(after.attempts, 1);
        outbox.verify_audit().unwrap();
    }

    fn processes_racing_on_one_key_deliver_it_once(engine) {
        let logs = tempfile::tempdir().unwrap();
        let log = logs.path().join("transport.log");
        engine
            .open_real_clock_with(|b| b)
            .enqueue(crate::harness::msg("k", "chat-1"))
            .unwrap();
        let d = engine.location();
        let l = log.to_str().unwrap();
        let children: Vec<Child> = (0..6)
            .map(|_| spawn(&["process", &d, "k", "deliver", l]))
            .collect();
        let mut outcomes = HashMap::new();
        for child in children {
            let out = child.wait_with_output().unwrap();
            assert!(out.status.success());
            *outcomes
                .entry(String::from_utf8(out.stdout).unwrap().trim().to_owned())
                .or_insert(0) += 1;
        }
        assert_eq!(
            transport_log(&log),
            ["k"],
            "delivered exactly once; outcomes {outcomes:?}"
        );
        assert!(
            outcomes
                .keys()
                .all(|o| o == "outcome sent" || o == "outcome in_flight"),
            "{outcomes:?}"
        );
    }
}

#[test]
fn a_kill_between_the_journal_commit_and_the_audit_append_is_repaired() {
    let dir = tempfile::tempdir().unwrap();
    let status = worker(&["enqueue", dir.path().to_str().unwrap(), "p", "1"])
        .env("DURABLE_OUTBOX_FAILPOINTS", "commit.before_audit=kill")
        .status()
        .unwrap();
    assert!(!status.success(), "the worker was killed");
    let outbox = Outbox::open(dir.path()).unwrap();
    assert_eq!(
        outbox.get("p-0").unwrap().unwrap().state(),
        ItemState::Queued
    );
    let history = outbox.history("p-0").unwrap();
    assert_eq!(
        history.len(),
        1,
        "the record the journal holds was appended"
    );
    assert_eq!(history[0].outcome.as_str(), "queued");
    outbox.verify_audit().unwrap();
}

/// Kill -9 torture: workers enqueue and deliver in a loop; the driver kills them at
/// random moments and checks every invariant after each kill. Longer runs:
/// `OUTBOX_TORTURE_SECS=600 cargo test --all-features --test it kill_loop`.
#[test]
fn kill_loop_never_loses_or_duplicates_a_message() {
    let budget = std::env::var("OUTBOX_TORTURE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8u64);
    let seed = std::env::var("OUTBOX_TORTURE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    let replay = format!("replay with OUTBOX_TORTURE_SEED={seed}");
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("transport.log");
    let mut rng = seed | 1;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let deadline = Instant::now() + Duration::from_secs(budget);
    // On a loaded machine the budget may end before the campaign has done the
    // work its name promises: it then goes on until it has (the minimums
    // asserted below), under a watchdog of its own.
    let watchdog = Instant::now() + Duration::from_secs(budget.max(8) * 20);
    // Every kill lands while its worker has the outbox open and is working.
    let mut kills = 0u32;
    let mut acked: HashSet<String> = HashSet::new();
    let mut ambiguous_seen = 0usize;
    let enough = |kills: u32, acked: usize, deliveries: usize, ambiguous: usize| {
        kills >= 10 && acked >= 10 && deliveries >= 5 && ambiguous >= 1
    };
    while Instant::now() < deadline
        || (!enough(
            kills,
            acked.len(),
            transport_log(&log).len(),
            ambiguous_seen,
        ) && Instant::now() < watchdog)
    {
        // A new key space every 16 kills, so long runs keep enqueueing new work.
        let space = format!("s{}", kills / 16);
        let seeds = [next(), next()];
        let pause = Duration::from_millis(5 + next() % 60);
        acked.extend(torture_round(
            dir.path(),
            &log,
            &space,
            seeds,
            pause,
            &replay,
        ));
        kills += 2;
        check_invariants(dir.path(), &log, &acked, seed, kills);
        if Instant::now() >= deadline {
            ambiguous_seen = caught_mid_send(dir.path());
        }
    }

    // Every claim a killed worker left is resolved, as ambiguous, and never resent.
    let ambiguous = resolve_dead_claims(dir.path(), &replay);
    check_invariants(dir.path(), &log, &acked, seed, kills);
    let deliveries = transport_log(&log).len();
    eprintln!(
        "kill loop (seed {seed}, {budget} s): {kills} kills interrupted work, {} enqueues \
         acknowledged, {deliveries} deliveries, {ambiguous} claims caught mid-send and failed as \
         ambiguous (never resent)",
        acked.len(),
    );
    // The campaign proves it did what its name says, not just that kill() ran.
    assert!(
        kills >= 10,
        "only {kills} kills interrupted work ({replay})"
    );
    assert!(
        acked.len() >= 10,
        "only {} enqueues acknowledged ({replay})",
        acked.len()
    );
    assert!(deliveries >= 5, "only {deliveries} deliveries ({replay})");
    assert!(ambiguous >= 1, "no kill landed inside send ({replay})");
}

/// Two torture workers on `dir`, killed with SIGKILL `pause` after both have
/// the outbox open. Returns the keys whose enqueue they acknowledged.
fn torture_round(
    dir: &Path,
    log: &Path,
    space: &str,
    seeds: [u64; 2],
    pause: Duration,
    replay: &str,
) -> Vec<String> {
    let d = dir.to_str().unwrap();
    let mut workers: Vec<(Child, BufReader<std::process::ChildStdout>)> = seeds
        .iter()
        .map(|seed| {
            let mut cmd = worker(&[
                "torture",
                d,
                log.to_str().unwrap(),
                &seed.to_string(),
                "100000",
                space,
            ]);
            cmd.stdout(Stdio::piped());
            let mut child = cmd.spawn().unwrap();
            let out = BufReader::new(child.stdout.take().unwrap());
            (child, out)
        })
        .collect();
    // Kill only once both have the outbox open, so every kill interrupts work
    // however slow the machine is.
    for (_, out) in &mut workers {
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert_eq!(
            line, "ready\n",
            "a torture worker failed to start ({replay})"
        );
    }
    std::thread::sleep(pause);
    let mut acked = Vec::new();
    for (mut child, mut stdout) in workers {
        child.kill().expect("SIGKILL");
        let status = child.wait().expect("reap");
        let mut out = String::new();
        std::io::Read::read_to_string(&mut stdout, &mut out).unwrap();
        // A worker that ended by itself (an error, or done) was not crashed by
        // us: the campaign would count kills while exercising nothing.
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(9),
            "a torture worker ended on its own ({status}) instead of being killed; its \
             output:\n{out}\n{replay}"
        );
        acked.extend(
            out.lines()
                .filter_map(|l| l.strip_prefix("queued "))
                .map(str::to_owned),
        );
    }
    acked
}

/// Resolves every claim dead workers left in `dir` (each must fail as
/// ambiguous without a send) and returns how many items are ambiguous.
/// Items a kill caught inside `send`: failed as ambiguous already, or still
/// claimed by a killed worker (which [`resolve_dead_claims`] fails as
/// ambiguous).
fn caught_mid_send(dir: &Path) -> usize {
    let outbox = Outbox::open(dir).unwrap();
    let items = outbox.list_items().unwrap();
    items
        .iter()
        .filter(|i| i.dispatch_claimed() || i.error_code() == Some(AMBIGUOUS_AFTER_RESTART))
        .count()
}

pub(crate) fn resolve_dead_claims(dir: &Path, replay: &str) -> usize {
    let outbox = Outbox::open(dir).unwrap();
    let claimed: Vec<String> = outbox
        .list_items()
        .unwrap()
        .into_iter()
        .filter(durable_outbox::OutboxItem::dispatch_claimed)
        .map(|i| i.idempotency_key().to_owned())
        .collect();
    for key in &claimed {
        let receipt = outbox
            .process(key, |_| {
                panic!("{key}: a dead worker's claim was resent ({replay})")
            })
            .unwrap();
        assert_eq!(
            receipt.error_code.as_deref(),
            Some(AMBIGUOUS_AFTER_RESTART),
            "{key}: {replay}"
        );
    }
    let items = outbox.list_items().unwrap();
    assert!(
        items.iter().all(|i| !i.dispatch_claimed()),
        "every killed worker's claim is resolved ({replay})"
    );
    items
        .iter()
        .filter(|i| i.error_code() == Some(AMBIGUOUS_AFTER_RESTART))
        .count()
}

pub(crate) fn check_invariants(
    dir: &Path,
    log: &Path,
    acked: &HashSet<String>,
    seed: u64,
    kills: u32,
) {
    let ctx = format!("after {kills} kills (replay with OUTBOX_TORTURE_SEED={seed})");
    let outbox = Outbox::open(dir).unwrap_or_else(|e| panic!("{ctx}: open failed: {e}"));
    outbox
        .verify_audit()
        .unwrap_or_else(|e| panic!("{ctx}: audit chain broken: {e}"));
    let items: HashMap<String, durable_outbox::OutboxItem> = outbox
        .list_items()
        .unwrap()
        .into_iter()
        .map(|i| (i.idempotency_key().to_owned(), i))
        .collect();
    for key in acked {
        assert!(
            items.contains_key(key),
            "{ctx}: acknowledged {key} was lost"
        );
    }
    let delivered = transport_log(log);
    let mut delivered_once = HashSet::new();
    for key in &delivered {
        assert!(
            delivered_once.insert(key),
            "{ctx}: {key} was delivered twice"
        );
    }
    for (key, item) in &items {
        if item.state() == ItemState::Sent {
            assert!(
                delivered_once.contains(key),
                "{ctx}: {key} is marked sent but never left"
            );
        }
        if item.state() == ItemState::Queued && !item.dispatch_claimed() {
            assert!(
                !delivered_once.contains(key),
                "{ctx}: {key} left but is queued to go again"
            );
        }
    }
}

/// Sends `keys` (each to its own chat) from this process, with settings that
/// let the `move` worker move them to history right away.
fn sent_items(dir: &Path, prefix: &str, n: usize) {
    let outbox = Outbox::builder(dir)
        .rate_limit(u32::MAX, Duration::from_millis(1))
        .open()
        .unwrap();
    for i in 0..n {
        let key = format!("{prefix}-{i}");
        outbox
            .enqueue(crate::harness::msg(&key, &format!("chat-{i}")))
            .unwrap();
        outbox
            .process(&key, |_| Ok(Some(format!("tr-{key}"))))
            .unwrap();
    }
    std::thread::sleep(Duration::from_millis(5));
}

#[test]
fn a_kill_at_any_step_of_a_move_to_history_loses_and_duplicates_nothing() {
    for point in [
        "history_index.rename",
        "history_log.rename",
        "history_log.dir_fsync",
        "state.rename",
        "state.dir_fsync",
        "journal_create.rename",
    ] {
        let dir = tempfile::tempdir().unwrap();
        sent_items(dir.path(), "k", 12);
        let status = worker(&["move", dir.path().to_str().unwrap()])
            .env("DURABLE_OUTBOX_FAILPOINTS", format!("{point}=kill"))
            .status()
            .unwrap();
        assert!(!status.success(), "{point}: the worker was killed");
        let outbox = Outbox::open(dir.path()).unwrap();
        for i in 0..12 {
            let key = format!("k-{i}");
            let item = outbox
                .get(&key)
                .unwrap()
                .unwrap_or_else(|| panic!("{point}: {key} lost"));
            assert_eq!(
                item.transport_ref(),
                Some(format!("tr-{key}").as_str()),
                "{point}"
            );
            let found = outbox.find_by_transport_ref(&format!("tr-{key}")).unwrap();
            assert_eq!(
                found.map(|i| i.idempotency_key().to_owned()),
                Some(key),
                "{point}"
            );
        }
        drop(outbox);
        // A move that completes afterwards leaves each item exactly once, in history.
        let status = worker(&["move", dir.path().to_str().unwrap()])
            .status()
            .unwrap();
        assert!(status.success(), "{point}: the second move");
        let outbox = Outbox::open(dir.path()).unwrap();
        assert_eq!(
            outbox.history_len().unwrap(),
            12,
            "{point}: moved once, not twice"
        );
        assert!(outbox.list_items().unwrap().is_empty(), "{point}");
        outbox
            .verify_audit()
            .unwrap_or_else(|e| panic!("{point}: {e}"));
    }
}

#[test]
fn a_kill_in_the_middle_of_a_prune_is_finished_by_the_next_one() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    sent_items(dir.path(), "old", 3);
    assert!(worker(&["move", d]).status().unwrap().success());
    sent_items(dir.path(), "new", 3);
    // Killed after the prune is audited, before the segment is deleted.
    let status = worker(&["move", d, "--prune"])
        .env("DURABLE_OUTBOX_FAILPOINTS", "history.prune=kill")
        .status()
        .unwrap();
    assert!(!status.success());
    assert!(
        dir.path().join("history/seg-00000001.log").exists(),
        "not deleted yet"
    );
    let outbox = Outbox::open(dir.path()).unwrap();
    assert!(
        outbox.get("new-1").unwrap().is_some(),
        "the new items are safe"
    );
    outbox.verify_audit().unwrap();
    drop(outbox);
    assert!(worker(&["move", d, "--prune"]).status().unwrap().success());
    assert!(
        !dir.path().join("history/seg-00000001.log").exists(),
        "the next prune finishes it"
    );
    let outbox = Outbox::open(dir.path()).unwrap();
    assert!(outbox.get("old-0").unwrap().is_none());
    assert!(outbox.get("new-2").unwrap().is_some());
    let prunes = durable_outbox::AuditLog::read(dir.path().join("audit.jsonl"))
        .unwrap()
        .iter()
        .filter(|r| r.outcome.as_str() == "pruned")
        .count();
    assert_eq!(
        prunes, 2,
        "the interrupted prune is recorded again when it is finished"
    );
    outbox.verify_audit().unwrap();
}
