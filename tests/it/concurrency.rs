//! Many writers on one outbox (brief §6): several `Outbox` handles with several
//! threads each, and worker processes at the same time, race `enqueue`, `process`,
//! `process_due` and `find_by_transport_ref`. On both engines (`on_both_engines!`):
//! processes on one directory, or processes ("hosts") on one PostgreSQL schema. The transport log is the truth: every
//! delivery appends its key and fsyncs before `send` returns `Ok`.
//!
//! Proved: no acknowledged item is lost (and each is eventually sent or failed),
//! no key is delivered twice, a delivered item is recorded as sent with exactly one
//! `sent` audit record, a correlated reply only finds delivered items, no claim
//! outlives the handles, the audit chain verifies, and the whole run finishes
//! within a bounded wall time (a watchdog reports a hang as a failure).
//!
//! Knobs: `OUTBOX_TORTURE_SECS` (repeat rounds for this long), `OUTBOX_TORTURE_SEED`.

use std::collections::{HashMap, HashSet};
use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use durable_outbox::{Error, ItemState, NewMessage, Outbox, OutboxItem, SendError};

use crate::engines::{EngineUnderTest, on_both_engines};
use crate::seeded;

const WORKER: &str = env!("CARGO_BIN_EXE_outbox-test-worker");
const HANDLES: usize = 2;
const THREADS_PER_HANDLE: usize = 2;
const THREAD_OPS: usize = 60;
const TORTURE_ROUNDS: &str = "80";
/// The code of a transport failure that certainly sent nothing.
const FLAKY: &str = "flaky_connect";
/// Generous: one round takes seconds; only a hang gets near this.
const WATCHDOG: Duration = Duration::from_secs(120);

/// A small deterministic generator, so a failing seed replays.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Worker processes, shared with the watchdog so it can kill them.
#[derive(Clone, Default)]
struct Children(Arc<Mutex<Vec<(String, Child)>>>);

/// What a finished worker left behind.
struct Finished {
    name: String,
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

impl Children {
    fn spawn(&self, args: &[&str]) -> usize {
        let child = Command::new(WORKER)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn worker");
        let mut children = self.0.lock().expect("children");
        children.push((args.join(" "), child));
        children.len() - 1
    }

    /// Polls (never holding the lock while waiting) until worker `i` exits.
    fn wait(&self, i: usize) -> Finished {
        loop {
            {
                let mut children = self.0.lock().expect("children");
                let (name, child) = &mut children[i];
                if let Some(status) = child.try_wait().expect("try_wait") {
                    let mut stdout = String::new();
                    let mut stderr = String::new();
                    if let Some(out) = child.stdout.as_mut() {
                        out.read_to_string(&mut stdout).expect("read stdout");
                    }
                    if let Some(err) = child.stderr.as_mut() {
                        err.read_to_string(&mut stderr).expect("read stderr");
                    }
                    return Finished {
                        name: name.clone(),
                        status,
                        stdout,
                        stderr,
                    };
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn kill_all(&self) {
        let mut children = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for (_, child) in children.iter_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn message(key: &str, i: u64) -> NewMessage {
    NewMessage {
        idempotency_key: key.to_owned(),
        connector: "telegram".into(),
        grant_id: "grant-1".into(),
        destination: format!("chat-{}", i % 5),
        content: format!("concurrent {key}"),
        ..Default::default()
    }
}

/// The same settings as the worker processes, on the system clock.
fn open(engine: &EngineUnderTest) -> Outbox {
    engine.open_real_clock_with(|b| {
        b.rate_limit(u32::MAX, Duration::from_secs(60))
            .max_inline_wait(Duration::ZERO)
    })
}

/// The transport: a message has left once its key is fsynced in the log.
fn deliver(log: &Path, item: &OutboxItem) -> Result<Option<String>, SendError> {
    let mut file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| SendError::retryable(format!("log: {e}")))?;
    file.write_all(format!("{}\n", item.idempotency_key()).as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(|e| SendError::ambiguous(format!("log: {e}")))?;
    Ok(Some(format!("tr-{}", item.idempotency_key())))
}

fn delivered(log: &Path) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Keys of every namespace: ours (`c-`), the torture workers' (`t-`), the enqueue worker's (`e-`).
fn any_key(rng: &mut Rng) -> String {
    match rng.below(4) {
        0 => format!("t-{}", rng.below(64)),
        1 => format!("e-{}", rng.below(30)),
        _ => format!("c-{}", rng.below(48)),
    }
}

/// Shared by the threads of one round.
struct Shared<'a> {
    log: &'a Path,
    acked: Mutex<HashSet<String>>,
    broken: Mutex<Vec<String>>,
}

impl Shared<'_> {
    fn broke(&self, what: String) {
        self.broken.lock().expect("broken").push(what);
    }
}

/// One thread's random mix of calls.
fn thread_ops(outbox: &Outbox, thread_seed: u64, shared: &Shared<'_>) {
    let mut rng = Rng::new(thread_seed);
    for _ in 0..THREAD_OPS {
        let flaky = rng.below(6) == 0;
        let mut send = |item: &OutboxItem| {
            if flaky {
                Err(SendError::retryable(FLAKY))
            } else {
                deliver(shared.log, item)
            }
        };
        match rng.below(20) {
            0..7 => {
                let i = rng.below(48);
                let key = format!("c-{i}");
                match outbox.enqueue(message(&key, i)) {
                    Ok(item) if item.idempotency_key() == key => {
                        shared.acked.lock().expect("acked").insert(key);
                    }
                    other => shared.broke(format!("enqueue({key}) gave {other:?}")),
                }
            }
            7..13 => {
                let key = any_key(&mut rng);
                match outbox.process(&key, &mut send) {
                    Ok(_) | Err(Error::NotFound { .. }) => {}
                    Err(e) => shared.broke(format!("process({key}) failed: {e}")),
                }
            }
            13..16 => {
                if let Err(e) = outbox.process_due(&mut send) {
                    shared.broke(format!("process_due failed: {e}"));
                }
            }
            _ => {
                let key = any_key(&mut rng);
                match outbox.find_by_transport_ref(&format!("tr-{key}")) {
                    Ok(None) => {}
                    Ok(Some(item)) => {
                        // Read the log after the lookup: the delivery happened before.
                        let left = delivered(shared.log).contains(&key);
                        if item.idempotency_key() != key || item.state() != ItemState::Sent || !left
                        {
                            shared.broke(format!(
                                "correlation broken: tr-{key} found {:?} in state {}, delivered: {left}",
                                item.idempotency_key(),
                                item.state()
                            ));
                        }
                    }
                    Err(e) => shared.broke(format!("find_by_transport_ref failed: {e}")),
                }
            }
        }
    }
}

struct Summary {
    acked: usize,
    delivered: usize,
    failed: usize,
}

/// One round: threads and processes race on a fresh outbox, then every
/// invariant is checked. Returns what broke, if anything.
fn round(seed: u64, children: &Children, engine: &EngineUnderTest) -> Result<Summary, String> {
    let logs = tempfile::tempdir().expect("temp dir");
    let log = logs.path().join("transport.log");
    let location = engine.location();
    let (d, l) = (location.as_str(), log.to_str().expect("utf-8 path"));
    drop(open(engine));
    let mut workers = vec![
        children.spawn(&[
            "torture",
            d,
            l,
            &(seed ^ 0x1111).to_string(),
            TORTURE_ROUNDS,
        ]),
        children.spawn(&[
            "torture",
            d,
            l,
            &(seed ^ 0x2222).to_string(),
            TORTURE_ROUNDS,
        ]),
        children.spawn(&["enqueue", d, "e", "30"]),
    ];
    let shared = Shared {
        log: &log,
        acked: Mutex::new(HashSet::new()),
        broken: Mutex::new(Vec::new()),
    };
    let handles: Vec<Outbox> = (0..HANDLES).map(|_| open(engine)).collect();
    std::thread::scope(|s| {
        for (h, outbox) in handles.iter().enumerate() {
            for t in 0..THREADS_PER_HANDLE {
                let shared = &shared;
                let thread_seed = seed.wrapping_add((h * THREADS_PER_HANDLE + t) as u64 + 1);
                s.spawn(move || thread_ops(outbox, thread_seed, shared));
            }
        }
        // Drains in other processes while the threads run.
        for _ in 0..3 {
            std::thread::sleep(Duration::from_millis(40));
            workers.push(children.spawn(&["drain", d, l]));
        }
    });
    drop(handles);
    let mut acked = shared.acked.into_inner().expect("acked");
    let mut broken = shared.broken.into_inner().expect("broken");
    for i in workers {
        let done = children.wait(i);
        if !done.status.success() {
            broken.push(format!(
                "worker `{}` failed ({}): {}",
                done.name,
                done.status,
                done.stderr.trim()
            ));
        }
        acked.extend(
            done.stdout
                .lines()
                .filter_map(|line| line.strip_prefix("queued "))
                .map(str::to_owned),
        );
    }
    broken.extend(check(engine, &log, &acked, false));
    // Let every backoff expire, drain what is left, and check again: by now every
    // acknowledged item must have been sent or failed for good.
    let outbox = open(engine);
    for _ in 0..6 {
        std::thread::sleep(Duration::from_millis(300));
        if let Err(e) = outbox.process_due(|item| deliver(&log, item)) {
            broken.push(format!("final process_due failed: {e}"));
        }
    }
    drop(outbox);
    broken.extend(check(engine, &log, &acked, true));
    if broken.is_empty() {
        let items = open(engine).list_items().expect("items");
        Ok(Summary {
            acked: acked.len(),
            delivered: delivered(&log).len(),
            failed: items
                .iter()
                .filter(|i| i.state() == ItemState::Failed)
                .count(),
        })
    } else {
        Err(broken.join("\n  "))
    }
}

/// Every invariant, from a fresh handle, with no other handle open.
fn check(
    engine: &EngineUnderTest,
    log: &Path,
    acked: &HashSet<String>,
    drained: bool,
) -> Vec<String> {
    let mut broken = Vec::new();
    let outbox = open(engine);
    if let Err(e) = outbox.verify_audit() {
        broken.push(format!("audit-chain broken: {e}"));
    }
    let items: HashMap<String, OutboxItem> = outbox
        .list_items()
        .expect("items")
        .into_iter()
        .map(|i| (i.idempotency_key().to_owned(), i))
        .collect();
    for key in acked {
        match items.get(key) {
            None => broken.push(format!("never-lost broken: acknowledged {key} is gone")),
            Some(item) if drained && item.state() == ItemState::Queued => broken.push(format!(
                "never-lost broken: acknowledged {key} is still queued after a final drain ({item:?})"
            )),
            Some(item)
                if item.state() == ItemState::Failed
                    && !matches!(item.error_code(), Some(FLAKY | "max_attempts_exhausted")) =>
            {
                broken.push(format!(
                    "{key} failed with {:?}, although the transport only ever failed as retryable",
                    item.error_code()
                ));
            }
            Some(_) => {}
        }
    }
    let log = delivered(log);
    let mut seen = HashSet::new();
    for key in &log {
        if !seen.insert(key) {
            broken.push(format!("at-most-once broken: {key} was delivered twice"));
        }
    }
    for (key, item) in &items {
        if item.dispatch_claimed() {
            broken.push(format!(
                "{key} is still claimed although every handle closed normally"
            ));
        }
        let left = seen.contains(key);
        if (item.state() == ItemState::Sent) != left {
            broken.push(format!(
                "{key} is {} but delivered: {left} (sent must mean delivered, and back)",
                item.state()
            ));
        }
    }
    match outbox
        .audit_records()
        .and_then(Iterator::collect::<Result<Vec<_>, _>>)
    {
        Err(e) => broken.push(format!("audit log unreadable: {e}")),
        Ok(records) => {
            let mut sent_records: HashMap<&str, usize> = HashMap::new();
            for record in records.iter().filter(|r| r.outcome.as_str() == "sent") {
                *sent_records.entry(&record.idempotency_key).or_default() += 1;
            }
            for (key, item) in &items {
                let n = sent_records.get(key.as_str()).copied().unwrap_or(0);
                let expected = usize::from(item.state() == ItemState::Sent);
                if n != expected {
                    broken.push(format!(
                        "{key} ({}) has {n} sent audit records, expected {expected}",
                        item.state()
                    ));
                }
            }
        }
    }
    broken
}

/// Rounds until `budget` has passed (at least one), the first on `engine`,
/// each later one on a fresh outbox of the same engine.
fn run(
    seed: u64,
    budget: Duration,
    children: &Children,
    engine: &EngineUnderTest,
) -> Result<(u64, Summary), String> {
    let start = Instant::now();
    let mut rounds: u64 = 0;
    loop {
        let round_seed = seed.wrapping_add(rounds.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let fresh;
        let engine = if rounds == 0 {
            engine
        } else {
            fresh = engine.fresh();
            &fresh
        };
        let summary = round(round_seed, children, engine)
            .map_err(|e| format!("round {rounds} (seed {round_seed}):\n  {e}"))?;
        rounds += 1;
        if start.elapsed() >= budget {
            return Ok((rounds, summary));
        }
    }
}

on_both_engines! {
    fn threads_and_processes_racing_on_one_outbox_lose_nothing_and_send_nothing_twice(engine) {
        let budget = Duration::from_secs(seeded::env_u64("OUTBOX_TORTURE_SECS").unwrap_or(0));
        let seed = seeded::seed_from_env("OUTBOX_TORTURE_SEED");
        let replay = format!("replay: OUTBOX_TORTURE_SEED={seed}");
        let children = Children::default();
        // The watchdog: a hang kills the workers and stops the test binary
        // naming the guarantee (a hung thread of this process cannot be
        // stopped any other way).
        let (finished, watch) = mpsc::channel::<()>();
        let (watched, limit, why) = (children.clone(), WATCHDOG + budget, replay.clone());
        std::thread::spawn(move || {
            if let Err(mpsc::RecvTimeoutError::Timeout) = watch.recv_timeout(limit) {
                watched.kill_all();
                let _ = writeln!(
                    std::io::stderr(),
                    "WATCHDOG: bounded-time broken: the run did not finish within {limit:?}: a \
                     deadlock, a lock never released or a worker stuck\n{why}"
                );
                std::process::exit(70);
            }
        });
        let result = catch_unwind(AssertUnwindSafe(|| run(seed, budget, &children, engine)));
        drop(finished);
        match result {
            Ok(Ok((rounds, last))) => {
                eprintln!(
                    "concurrency: {rounds} round(s), last: {} acknowledged, {} delivered once, {} failed",
                    last.acked, last.delivered, last.failed
                );
                assert!(
                    last.acked > 0 && last.delivered > 0,
                    "the run exercised nothing ({replay})"
                );
            }
            Ok(Err(broken)) => panic!("{broken}\n{replay}"),
            Err(_) => {
                children.kill_all();
                panic!("the run panicked (see above)\n{replay}");
            }
        }
    }
}
