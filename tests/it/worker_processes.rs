//! The delivery worker as a real child process: SIGTERM mid-batch (graceful
//! shutdown), SIGKILL mid-batch (crash-sized ambiguity), two workers on one
//! directory (per-destination order across processes) and another process's
//! enqueue waking an idle worker.
//!
//! Every wait runs under a deadline that names the guarantee it was waiting for.
//!
//! Bodies in `on_both_engines!` run on the file engine and on PostgreSQL
//! (`name::file`, `name::postgres`): the worker processes share one directory
//! or one schema. File-only here: the `#[test]` kills the worker at a
//! file-engine failpoint (its k-th journal fdatasync).

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use durable_outbox::{
    AMBIGUOUS_AFTER_RESTART, ItemState, NewMessage, Outbox, OutboxItem, SEND_CANCELLED,
};

use crate::engines::{EngineUnderTest, on_both_engines};

const WORKER: &str = env!("CARGO_BIN_EXE_outbox-test-worker");
/// Generous: the machine may be loaded; a hang fails, a slow pass does not.
const WATCHDOG: Duration = Duration::from_secs(60);

/// A child process killed when dropped, so a failing test leaves none behind.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

impl std::ops::Deref for Reaped {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Reaped {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

/// Starts `outbox-test-worker serve` on `location` (a directory or a
/// PostgreSQL URL, see `EngineUnderTest::child_location`).
fn serve(location: &str, log: &Path, concurrency: u32, send_ms: u64, shutdown_ms: u64) -> Reaped {
    let mut child = Command::new(WORKER)
        .arg("serve")
        .arg(location)
        .arg(log)
        .args([
            concurrency.to_string(),
            send_ms.to_string(),
            shutdown_ms.to_string(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the worker");
    crate::processes::wait_for_line(&mut child, "ready");
    Reaped(child)
}

fn log_lines(log: &Path) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

fn started(log: &Path) -> Vec<String> {
    log_lines(log)
        .iter()
        .filter_map(|l| l.strip_prefix("start "))
        .map(|rest| rest.split(' ').next().unwrap_or_default().to_owned())
        .collect()
}

/// Waits (under the watchdog) until `done` holds; `what` names the guarantee.
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + WATCHDOG;
    while !done() {
        assert!(
            Instant::now() < deadline,
            "{what}: still not true after {WATCHDOG:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn sigterm(child: &Child) {
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -TERM failed");
}

fn wait_exit(child: &mut Child, what: &str) {
    let deadline = Instant::now() + WATCHDOG;
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            assert!(status.success(), "{what}: the worker exited with {status}");
            return;
        }
        assert!(Instant::now() < deadline, "{what}: the worker did not stop");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn report(child: &mut Child) -> BTreeMap<String, usize> {
    let line = crate::processes::wait_for_line(child, "report ");
    line.trim_start_matches("report ")
        .split(' ')
        .map(|kv| {
            let (k, v) = kv.split_once('=').expect("k=v");
            (k.to_owned(), v.parse().expect("count"))
        })
        .collect()
}

fn message(key: &str, destination: &str) -> NewMessage {
    NewMessage {
        idempotency_key: key.to_owned(),
        connector: "telegram".into(),
        grant_id: "bot-1".into(),
        destination: destination.to_owned(),
        content: format!("message {key}"),
        ..Default::default()
    }
}

/// Opens `dir` with the cap the helper's `serve` sets (none that binds). The
/// first handle stores its settings, and these tests are about processes and
/// order, not caps: under the default, one send per chat per second, a chat's
/// eight messages would take eight seconds.
fn open(engine: &EngineUnderTest) -> durable_outbox::Result<Outbox> {
    engine
        .real_clock_builder()
        .rate_limit(u32::MAX, Duration::from_secs(60))
        .open()
}

fn items(engine: &EngineUnderTest) -> BTreeMap<String, OutboxItem> {
    engine
        .real_clock_builder()
        .compact_on_open(false)
        .open()
        .expect("open")
        .list_items()
        .expect("list")
        .into_iter()
        .map(|i| (i.idempotency_key().to_owned(), i))
        .collect()
}

/// [`items`] of a directory (the failpoint test, file-only).
fn dir_items(dir: &Path) -> BTreeMap<String, OutboxItem> {
    Outbox::builder(dir)
        .compact_on_open(false)
        .open()
        .expect("open")
        .list_items()
        .expect("list")
        .into_iter()
        .map(|i| (i.idempotency_key().to_owned(), i))
        .collect()
}

/// Twelve messages, each to its own chat (so order does not hold any back).
fn twelve(engine: &EngineUnderTest) {
    let outbox = open(engine).expect("open");
    let batch = (0..12)
        .map(|i| message(&format!("m{i:02}"), &format!("chat-{i}")))
        .collect();
    outbox.enqueue_many(batch).expect("enqueue");
}

/// After SIGKILL only sends that had started are in doubt.
fn only_started_sends_are_ambiguous(engine: &EngineUnderTest, running: &[String]) {
    let claimed: HashSet<String> = items(engine)
        .into_iter()
        .filter(|(_, i)| i.dispatch_claimed())
        .map(|(k, _)| k)
        .collect();
    let running: HashSet<String> = running.iter().cloned().collect();
    assert_eq!(
        claimed, running,
        "crash-sized ambiguity: claims = started sends"
    );
    let outbox = open(engine).expect("reopen");
    let report = outbox
        .process_due(|item| {
            assert!(
                !running.contains(item.idempotency_key()),
                "at-most-once: a started send was resent"
            );
            Ok(None)
        })
        .expect("drain");
    assert_eq!(report.failed, running.len());
    for (key, item) in items(engine) {
        if running.contains(&key) {
            assert_eq!(item.error_code(), Some(AMBIGUOUS_AFTER_RESTART), "{key}");
        } else {
            assert_eq!(
                (item.state(), item.attempts()),
                (ItemState::Sent, 1),
                "{key} never reached send before the crash: it went out normally after"
            );
        }
    }
}

on_both_engines! {
    fn sigterm_mid_batch_lets_running_sends_finish_and_leaves_the_rest_untouched(engine) {
        let logs = tempfile::tempdir().unwrap();
        let log = logs.path().join("transport.log");
        twelve(engine);
        let mut child = serve(&engine.location(), &log, 3, 400, 20_000);
        wait_until("graceful shutdown: three sends running", || {
            started(&log).len() >= 3
        });
        sigterm(&child);
        wait_exit(&mut child, "graceful shutdown");
        let report = report(&mut child);
        let running = started(&log);
        assert_eq!(running.len(), 3, "no new claims after SIGTERM: {running:?}");
        assert_eq!(
            report["sent"], 3,
            "running sends finished and were recorded"
        );
        assert_eq!(report["cancelled"], 0);
        let items = items(engine);
        for (key, item) in &items {
            if running.contains(key) {
                assert_eq!(
                    item.state(),
                    ItemState::Sent,
                    "{key} finished during shutdown"
                );
            } else {
                assert_eq!(
                    (item.state(), item.attempts(), item.dispatch_claimed()),
                    (ItemState::Queued, 0, false),
                    "graceful shutdown: {key} was never handed to send, so it is untouched"
                );
            }
        }
    }

    fn sigterm_with_sends_past_the_deadline_cancels_only_those_sends(engine) {
        let logs = tempfile::tempdir().unwrap();
        let log = logs.path().join("transport.log");
        twelve(engine);
        let mut child = serve(&engine.location(), &log, 3, 600_000, 200);
        wait_until("shutdown deadline: three sends running", || {
            started(&log).len() >= 3
        });
        sigterm(&child);
        wait_exit(&mut child, "shutdown deadline");
        let report = report(&mut child);
        assert_eq!((report["cancelled"], report["sent"]), (3, 0));
        let running = started(&log);
        for (key, item) in items(engine) {
            if running.contains(&key) {
                assert_eq!(
                    (item.state(), item.error_code()),
                    (ItemState::Failed, Some(SEND_CANCELLED)),
                    "{key} was still sending at the deadline: cancelled, never resent"
                );
            } else {
                assert_eq!(
                    (item.state(), item.attempts(), item.dispatch_claimed()),
                    (ItemState::Queued, 0, false),
                    "{key} was never handed to send: untouched"
                );
            }
        }
    }

    fn sigkill_of_a_worker_leaves_only_its_started_sends_ambiguous(engine) {
        let logs = tempfile::tempdir().unwrap();
        let log = logs.path().join("transport.log");
        twelve(engine);
        let mut child = serve(&engine.child_location("killed"), &log, 3, 600_000, 20_000);
        wait_until("crash-sized ambiguity: three sends running", || {
            started(&log).len() >= 3
        });
        child.kill().expect("SIGKILL");
        child.wait().expect("reap");
        engine.await_child_gone("killed");
        only_started_sends_are_ambiguous(engine, &started(&log));
    }

    fn sigkill_in_process_due_leaves_only_the_started_send_ambiguous(engine) {
        twelve(engine);
        let mut child = Command::new(WORKER)
            .arg("drain-hang")
            .arg(engine.child_location("killed"))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn");
        let line = crate::processes::wait_for_line(&mut child, "sending ");
        child.kill().expect("SIGKILL");
        child.wait().expect("reap");
        engine.await_child_gone("killed");
        let key = line.trim_start_matches("sending ").to_owned();
        only_started_sends_are_ambiguous(engine, &[key]);
    }

    fn two_worker_processes_deliver_each_destination_in_enqueue_order(engine) {
        let logs = tempfile::tempdir().unwrap();
        let log = logs.path().join("transport.log");
        open(engine).expect("create");
        let mut workers = vec![
            serve(&engine.location(), &log, 4, 15, 20_000),
            serve(&engine.location(), &log, 4, 15, 20_000),
        ];
        let outbox = open(engine).expect("open");
        // Interleaved across three chats, from this (third) process; some fail
        // retryably first, which must hold their followers back until they go.
        let mut expected: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for i in 0..8 {
            for chat in ["chat-a", "chat-b", "chat-c"] {
                let key = if i % 3 == 1 {
                    format!("{chat}-{i}-retry")
                } else {
                    format!("{chat}-{i}")
                };
                outbox.enqueue(message(&key, chat)).expect("enqueue");
                expected.entry(chat.to_owned()).or_default().push(key);
            }
        }
        wait_until("order across processes: everything sent", || {
            outbox
                .list_items()
                .unwrap()
                .iter()
                .all(|i| i.state() == ItemState::Sent)
        });
        for worker in &workers {
            sigterm(worker);
        }
        for worker in &mut workers {
            wait_exit(worker, "order across processes: shutdown");
        }
        // Per chat: starts in enqueue order (a retried key starts twice in a row),
        // and nothing starts before the previous message to that chat ended.
        let mut order: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut open_send: BTreeMap<String, String> = BTreeMap::new();
        for line in log_lines(&log) {
            let parts: Vec<&str> = line.split(' ').collect();
            match parts.as_slice() {
                ["start", key, chat] => {
                    assert!(
                        open_send
                            .insert((*chat).to_owned(), (*key).to_owned())
                            .is_none(),
                        "order across processes: {key} started while another send to {chat} ran"
                    );
                    let seen = order.entry((*chat).to_owned()).or_default();
                    if seen.last().map(String::as_str) != Some(*key) {
                        seen.push((*key).to_owned());
                    }
                }
                ["end", key, ..] => {
                    let chat = open_send
                        .iter()
                        .find(|(_, k)| k.as_str() == *key)
                        .map(|(c, _)| c.clone())
                        .expect("an end matches a start");
                    open_send.remove(&chat);
                }
                other => panic!("unexpected log line {other:?}"),
            }
        }
        assert_eq!(
            order, expected,
            "order across processes: enqueue order per chat"
        );
    }

    fn another_process_enqueue_wakes_an_idle_worker(engine) {
        let logs = tempfile::tempdir().unwrap();
        let log = logs.path().join("transport.log");
        open(engine).expect("create");
        let mut child = serve(&engine.location(), &log, 2, 0, 20_000);
        // Nothing is queued or deferred: the worker sleeps with no due time, so
        // only its journal watcher can notice this enqueue from another process.
        std::thread::sleep(Duration::from_millis(200));
        let outbox = open(engine).expect("open");
        for i in 0..3 {
            outbox
                .enqueue(message(&format!("late-{i}"), &format!("chat-{i}")))
                .expect("enqueue");
            wait_until("cross-process wake-up: the enqueue is delivered", || {
                outbox
                    .get(&format!("late-{i}"))
                    .unwrap()
                    .is_some_and(|item| item.state() == ItemState::Sent)
            });
            std::thread::sleep(Duration::from_millis(100));
        }
        sigterm(&child);
        wait_exit(&mut child, "cross-process wake-up: shutdown");
        assert_eq!(report(&mut child)["sent"], 3);
    }

    fn a_worker_waiting_behind_a_crashed_process_claim_resolves_it_and_carries_on(engine) {
        let logs = tempfile::tempdir().unwrap();
        let log = logs.path().join("transport.log");
        let outbox = open(engine).expect("open");
        outbox.enqueue(message("m1", "chat-1")).unwrap();
        outbox.enqueue(message("m2", "chat-1")).unwrap();
        // Another process claims m1 and hangs inside its send.
        let mut claimant = Reaped(
            Command::new(WORKER)
                .arg("process")
                .arg(engine.location())
                .args(["m1", "hang"])
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("spawn the claimant"),
        );
        crate::processes::wait_for_line(&mut claimant, "sending m1");
        let mut worker = serve(&engine.location(), &log, 2, 0, 20_000);
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            started(&log).is_empty(),
            "order: m2 must wait while m1 is in flight in another process"
        );
        // The claimant dies mid-send: nothing is written, yet the worker must
        // notice, fail m1 as ambiguous (never resent) and deliver m2.
        claimant.kill().expect("SIGKILL");
        claimant.wait().expect("reap");
        wait_until("a dead claim does not block its line forever", || {
            outbox
                .get("m2")
                .unwrap()
                .is_some_and(|i| i.state() == ItemState::Sent)
        });
        assert_eq!(started(&log), ["m2"], "m1 is never resent");
        let m1 = outbox.get("m1").unwrap().unwrap();
        assert_eq!(m1.error_code(), Some(AMBIGUOUS_AFTER_RESTART));
        sigterm(&worker);
        wait_exit(&mut worker, "shutdown");
    }
}

/// A worker whose slots share commit groups, `SIGKILL`ed at its k-th fdatasync
/// (the leader's sync of a group, with other slots' steps written and waiting):
/// every send that had started has its claim on disk (or its outcome), none of
/// them is ever resent, and every item that was not in flight goes out once
/// afterwards. (A claim written but not yet synced survives a process kill in
/// the page cache: its item fails as ambiguous though its send never started,
/// at most one per slot.)
#[test]
fn sigkill_at_a_sync_shared_by_worker_slots_resends_nothing() {
    // The first sync is the slots' first claims, in one batched step; from
    // then on each round of 8 sends costs at least one: 80 items take at
    // least 11.
    for hit in [3, 6, 9] {
        kill_worker_at(&format!("journal.fsync=kill@{hit}"), 8, 80);
    }
}

/// A worker whose slots step in batches, `SIGKILL`ed in the middle of its
/// k-th batch of two or more slots (the batch's rules have run under the
/// lock, nothing of it is written yet): as at a sync, no started send is
/// resent, nothing not in flight is lost, at most one claim per slot. That
/// the kill happens at all proves k such batches ran.
#[test]
fn sigkill_in_the_middle_of_a_batched_step_resends_nothing() {
    for hit in [1, 4, 8] {
        kill_worker_at(&format!("step.batch=kill@{hit}"), 16, 160);
        println!("killed in the middle of batched step {hit} (of two or more slots)");
    }
}

/// Runs a worker with `slots` slots over `items` items (a chat each, 5 ms
/// sends) under the failpoints `spec`, which must kill it; then checks what
/// the kill left and drains the rest.
fn kill_worker_at(spec: &str, slots: usize, items: usize) {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("transport.log");
    {
        let outbox = Outbox::open(dir.path()).expect("open");
        let batch = (0..items)
            .map(|i| message(&format!("k-{i:03}"), &format!("chat-{i}")))
            .collect();
        outbox.enqueue_many(batch).expect("enqueue");
    }
    let mut child = Reaped(
        Command::new(WORKER)
            .arg("serve")
            .arg(dir.path())
            .arg(&log)
            .args([slots.to_string().as_str(), "5", "20000"])
            .env("DURABLE_OUTBOX_FAILPOINTS", spec)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the worker"),
    );
    let deadline = Instant::now() + WATCHDOG;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the worker was not killed at {spec} within {WATCHDOG:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(!status.success(), "{spec}: the worker was not killed");
    let started: HashSet<String> = started(&log).into_iter().collect();
    let before = dir_items(dir.path());
    for key in &started {
        let item = &before[key];
        assert!(
            item.dispatch_claimed() || item.state() == ItemState::Sent,
            "{spec}: {key}'s send started but neither its claim nor its outcome is on disk"
        );
    }
    for (key, item) in &before {
        if item.state() == ItemState::Sent {
            assert!(started.contains(key), "{spec}: {key} sent unseen");
        }
    }
    let claimed = before.values().filter(|i| i.dispatch_claimed()).count();
    assert!(
        claimed <= slots,
        "{spec}: {claimed} claims, more than the {slots} slots"
    );
    let outbox = Outbox::open(dir.path()).expect("reopen");
    outbox
        .process_due(|item| {
            assert!(
                !started.contains(item.idempotency_key()),
                "at-most-once: {} was resent after the kill at {spec}",
                item.idempotency_key()
            );
            Ok(Some(format!("tr-{}", item.idempotency_key())))
        })
        .expect("drain");
    for (key, item) in dir_items(dir.path()) {
        let was_claimed = before[&key].dispatch_claimed();
        if was_claimed {
            assert_eq!(item.error_code(), Some(AMBIGUOUS_AFTER_RESTART), "{key}");
        } else {
            assert_eq!(
                (item.state(), item.attempts()),
                (ItemState::Sent, 1),
                "{spec}: {key} was not in flight at the kill: sent once"
            );
        }
    }
}
