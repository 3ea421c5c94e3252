//! A child process for the crash and concurrency tests: it drives an outbox the
//! way a bot would, so the test can SIGKILL it at the worst moments.
//!
//! Every line it prints is flushed at once, so the parent knows exactly what was
//! acknowledged before a kill. Failpoints come from `DURABLE_OUTBOX_FAILPOINTS`.
//!
//! Where a command takes DIR, `open` also accepts a `postgres://` URL (feature
//! `postgres`): the same workload on a PostgreSQL outbox, one process per "host".
//!
//! Commands:
//! - `enqueue DIR PREFIX N`: enqueue `PREFIX-0..N` (destination `chat-{i%7}`),
//!   printing `queued KEY` after each call returns.
//! - `process DIR KEY hang`: process KEY with a send that prints `sending KEY` and
//!   then blocks forever (the parent kills it there).
//! - `process DIR KEY deliver LOG`: process KEY with a send that appends KEY to the
//!   transport LOG (fsynced) before returning; prints the outcome.
//! - `move DIR [--prune]`: compact, moving every terminal item to history
//!   (and pruning history down to its newest segment with `--prune`).
//! - `maintain DIR`: open with default settings and compact, as a maintenance job would.
//! - `drain DIR LOG`: `process_due` once with the delivering send; prints the tally.
//! - `rotate DIR PREFIX ROUNDS`: with a 1 KiB audit rotation threshold, enqueue
//!   four messages and compact, ROUNDS times: the audit log rotates each round.
//! - `remove-audit DIR KEEP`: remove all sealed audit segments but the newest KEEP
//!   (on PostgreSQL, segments of 1 KiB, as `rotate` seals).
//! - `torture DIR LOG SEED ROUNDS [SPACE]`: enqueue and process random keys
//!   (`SPACE-0` … `SPACE-63`) in a loop.
//! - `drain-hang DIR`: `process_due` with a send that prints `sending KEY` and
//!   then blocks forever (the parent kills it there).
//! - `serve DIR LOG CONCURRENCY SEND_MS SHUTDOWN_MS` (feature `tokio`): run the
//!   delivery worker until SIGTERM. Its send appends `start KEY DEST` to LOG,
//!   sleeps `SEND_MS` (a key containing `retry` fails retryably on its first
//!   attempt instead), appends `end KEY`. Prints `ready` once running and
//!   `report sent=… failed=… deferred=… retried=… released=… cancelled=…` at the end.
//! - `powerloss DIR`: the power-loss harness's workload (see [`power_loss`]): a
//!   fixed life of an outbox that passes through every kind of durable write,
//!   with its acknowledgements recorded in the filesystem's own operation log,
//!   ending with threads that commit at once (commit groups).
//! - `group DIR LOG PREFIX THREADS N`: THREADS threads share one handle; thread
//!   t enqueues `PREFIX-t-0..N` (each to a chat of its own) one by one and
//!   processes each with the delivering
//!   send, printing `queued KEY` and `sent KEY` as the calls return (and
//!   `error KEY WHY`, then stopping that thread, if one fails): commit groups
//!   form, so a kill or an injected fault lands in the middle of one.
//! - `matrix-send DIR HOMESERVER USER PASSWORD DEVICE ROOM KEY idempotent|plain`
//!   (feature `matrix`): log in, enqueue KEY for ROOM, send it for real, print
//!   `put-answered EVENT_ID` once the homeserver answered the PUT, and hang
//!   before the outcome is recorded (the parent kills it there).

use std::fs::OpenOptions;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

use durable_outbox::{NewMessage, Outbox, OutboxItem, SendError};

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// The fake transport: a message "left" once its key is fsynced in the log.
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

fn message(key: &str, i: u64) -> NewMessage {
    NewMessage {
        idempotency_key: key.to_owned(),
        connector: "telegram".into(),
        grant_id: "grant-1".into(),
        destination: format!("chat-{}", i % 7),
        content: format!("message {key}"),
        ..Default::default()
    }
}

/// A builder for DIR, or for a `postgres://` URL in its place: the same
/// workload on PostgreSQL, each process a "host".
fn builder_for(dir: &str) -> durable_outbox::OutboxBuilder {
    #[cfg(feature = "postgres")]
    if dir.starts_with("postgres://") {
        return Outbox::postgres(dir);
    }
    Outbox::builder(dir)
}

fn open(dir: &str) -> Outbox {
    builder_for(dir)
        .rate_limit(u32::MAX, Duration::from_secs(60))
        .max_inline_wait(Duration::ZERO)
        .open()
        .unwrap_or_else(|e| fail(&format!("open: {e}")))
}

fn fail(why: &str) -> ! {
    eprintln!("worker: {why}");
    std::process::exit(3)
}

/// A small deterministic generator (xorshift), so a failing seed can be replayed.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// A maintenance job: opens with every default and compacts, the way a cron
/// job or an operator's script would.
/// A maintenance job: opens with every default and compacts. On PostgreSQL
/// (no journal to fold) opening is the maintenance: it applies retention.
fn maintain(dir: &str) {
    #[cfg(feature = "postgres")]
    if dir.starts_with("postgres://") {
        drop(
            builder_for(dir)
                .open()
                .unwrap_or_else(|e| fail(&format!("open: {e}"))),
        );
        say("compacted");
        return;
    }
    let outbox = Outbox::open(dir).unwrap_or_else(|e| fail(&format!("open: {e}")));
    outbox
        .compact()
        .unwrap_or_else(|e| fail(&format!("compact: {e}")));
    say("compacted");
}

/// Rotates the audit log `rounds` times: four enqueues and a compaction each.
fn rotate(dir: &str, prefix: &str, rounds: &str) {
    let outbox = Outbox::builder(dir)
        .rate_limit(u32::MAX, Duration::from_secs(60))
        .audit_rotate_bytes(1024)
        .open()
        .unwrap_or_else(|e| fail(&format!("open: {e}")));
    let rounds: u64 = rounds.parse().unwrap_or_else(|_| fail("ROUNDS"));
    for round in 0..rounds {
        for i in 0..4 {
            let key = format!("{prefix}-{round}-{i}");
            outbox
                .enqueue(message(&key, i))
                .unwrap_or_else(|e| fail(&format!("enqueue: {e}")));
        }
        outbox
            .compact()
            .unwrap_or_else(|e| fail(&format!("compact: {e}")));
    }
    say(&format!("rotated {rounds}"));
}

/// An operator's removal of all sealed audit segments but the newest `keep`,
/// with the 1 KiB segments of `rotate` (what a PostgreSQL outbox counts;
/// a directory's segments are files already).
fn remove_audit(dir: &str, keep: &str) {
    let outbox = builder_for(dir)
        .audit_rotate_bytes(1024)
        .open()
        .unwrap_or_else(|e| fail(&format!("open: {e}")));
    let keep: usize = keep.parse().unwrap_or_else(|_| fail("KEEP"));
    let removed = outbox
        .remove_old_audit_segments(keep, "ops", "older than a year")
        .unwrap_or_else(|e| fail(&format!("remove: {e}")));
    say(&format!("removed {removed}"));
}

/// Many threads on one handle, each enqueueing and processing its own keys.
fn group(dir: &str, log: &str, prefix: &str, threads: &str, n: &str) {
    let outbox = open(dir);
    let threads: usize = threads.parse().unwrap_or_else(|_| fail("THREADS"));
    let n: usize = n.parse().unwrap_or_else(|_| fail("N"));
    let log = Path::new(log);
    say("ready");
    std::thread::scope(|scope| {
        for t in 0..threads {
            let outbox = &outbox;
            scope.spawn(move || {
                for i in 0..n {
                    let key = format!("{prefix}-{t}-{i}");
                    // A chat of its own: per-chat order never defers it.
                    let mut m = message(&key, i as u64);
                    m.destination = format!("chat-{key}");
                    if let Err(e) = outbox.enqueue(m) {
                        say(&format!("error {key} {e}"));
                        return;
                    }
                    say(&format!("queued {key}"));
                    match outbox.process(&key, |item| deliver(log, item)) {
                        Ok(receipt) => say(&format!("{} {key}", receipt.outcome.as_str())),
                        Err(e) => {
                            say(&format!("error {key} {e}"));
                            return;
                        }
                    }
                }
            });
        }
    });
    say("done");
}

#[allow(clippy::too_many_lines, reason = "one short arm per command")]
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| {
        args.get(i)
            .map_or_else(|| fail("missing argument"), String::as_str)
    };
    match arg(0) {
        "enqueue" => {
            let outbox = open(arg(1));
            let n: u64 = arg(3).parse().unwrap_or_else(|_| fail("N"));
            for i in 0..n {
                let key = format!("{}-{i}", arg(2));
                outbox
                    .enqueue(message(&key, i))
                    .unwrap_or_else(|e| fail(&format!("enqueue: {e}")));
                say(&format!("queued {key}"));
            }
        }
        "process" => {
            let outbox = open(arg(1));
            let key = arg(2);
            let receipt = match arg(3) {
                "hang" => outbox.process(key, |item| {
                    say(&format!("sending {}", item.idempotency_key()));
                    loop {
                        std::thread::sleep(Duration::from_secs(3600));
                    }
                }),
                "deliver" => {
                    let log = Path::new(arg(4));
                    outbox.process(key, |item| deliver(log, item))
                }
                other => fail(&format!("unknown mode {other}")),
            }
            .unwrap_or_else(|e| fail(&format!("process: {e}")));
            say(&format!("outcome {}", receipt.outcome.as_str()));
        }
        "move" => {
            // Compact with history_after 0 and a 1 ms window, stored for the
            // outbox (compaction goes by the stored settings): every terminal item
            // older than a millisecond moves to history (and, with --prune, the
            // oldest history segments are pruned down to one).
            let mut builder = Outbox::builder(arg(1))
                .rate_limit(u32::MAX, Duration::from_millis(1))
                .history_after(Duration::ZERO)
                .update_settings()
                .compact_on_open(false);
            if args.get(2).map(String::as_str) == Some("--prune") {
                builder = builder.history_retention(durable_outbox::Retention::MaxSegments(1));
            }
            let outbox = builder
                .open()
                .unwrap_or_else(|e| fail(&format!("open: {e}")));
            outbox
                .compact()
                .unwrap_or_else(|e| fail(&format!("compact: {e}")));
            say("moved");
        }
        "maintain" => maintain(arg(1)),
        "rotate" => rotate(arg(1), arg(2), arg(3)),
        "remove-audit" => remove_audit(arg(1), arg(2)),
        "drain" => drain(arg(1), Path::new(arg(2))),
        "group" => group(arg(1), arg(2), arg(3), arg(4), arg(5)),
        "torture" => {
            let outbox = open(arg(1));
            let log = Path::new(arg(2));
            let mut rng = Rng(arg(3).parse::<u64>().unwrap_or_else(|_| fail("SEED")) | 1);
            let rounds: u64 = arg(4).parse().unwrap_or_else(|_| fail("ROUNDS"));
            // An optional key space: drivers move it on so long runs keep
            // enqueueing new messages instead of re-touching 64 finished ones.
            let space = args.get(5).map_or("t", String::as_str);
            // From here on a kill interrupts real work (the outbox is open).
            say("ready");
            for _ in 0..rounds {
                let i = rng.next() % 64;
                let key = format!("{space}-{i}");
                match rng.next() % 3 {
                    0 => {
                        outbox
                            .enqueue(message(&key, i))
                            .unwrap_or_else(|e| fail(&format!("enqueue: {e}")));
                        say(&format!("queued {key}"));
                    }
                    1 => match outbox.process(&key, |item| deliver(log, item)) {
                        Ok(_) | Err(durable_outbox::Error::NotFound { .. }) => {}
                        Err(e) => fail(&format!("process: {e}")),
                    },
                    _ => {
                        outbox
                            .process_due(|item| deliver(log, item))
                            .unwrap_or_else(|e| fail(&format!("drain: {e}")));
                    }
                }
            }
            say("done");
        }
        "drain-hang" => drain_hang(arg(1)),
        #[cfg(feature = "tokio")]
        "serve" => serve::run(&args),
        "powerloss" => power_loss(Path::new(arg(1))),
        #[cfg(feature = "matrix")]
        "matrix-send" => matrix_send(&args),
        other => fail(&format!("unknown command {other}")),
    }
}

/// `process_due` once with the delivering send; prints the tally.
fn drain(dir: &str, log: &Path) {
    let report = open(dir)
        .process_due(|item| deliver(log, item))
        .unwrap_or_else(|e| fail(&format!("drain: {e}")));
    say(&format!(
        "drained sent={} failed={} in_flight={}",
        report.sent, report.failed, report.in_flight
    ));
}

/// `process_due` with a send that announces itself and never returns.
fn drain_hang(dir: &str) {
    let outbox = open(dir);
    outbox
        .process_due(|item| {
            say(&format!("sending {}", item.idempotency_key()));
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        })
        .unwrap_or_else(|e| fail(&format!("drain: {e}")));
}

/// The tokio delivery worker, stopped by SIGTERM.
#[cfg(feature = "tokio")]
mod serve {
    use std::io::Write;
    use std::path::PathBuf;
    use std::time::Duration;

    use durable_outbox::{OutboxItem, SendError};

    use super::{builder_for, fail, say};

    fn append(log: &PathBuf, line: &str) {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap_or_else(|e| fail(&format!("log: {e}")));
        file.write_all(format!("{line}\n").as_bytes())
            .unwrap_or_else(|e| fail(&format!("log: {e}")));
    }

    pub(super) fn run(args: &[String]) {
        let arg = |i: usize| {
            args.get(i)
                .map_or_else(|| fail("missing argument"), String::as_str)
        };
        let number = |i: usize| arg(i).parse::<u64>().unwrap_or_else(|_| fail("number"));
        let log = PathBuf::from(arg(2));
        let concurrency = number(3) as usize;
        let send_for = Duration::from_millis(number(4));
        let shutdown_timeout = Duration::from_millis(number(5));
        let outbox = builder_for(arg(1))
            .rate_limit(u32::MAX, Duration::from_secs(60))
            .backoff(durable_outbox::Backoff::Fixed(vec![Duration::from_millis(
                100,
            )]))
            .max_inline_wait(Duration::ZERO)
            .open()
            .unwrap_or_else(|e| fail(&format!("open: {e}")));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| fail(&format!("runtime: {e}")));
        let report = runtime.block_on(async move {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .unwrap_or_else(|e| fail(&format!("signal: {e}")));
            let worker = outbox
                .worker(move |item: OutboxItem| {
                    let log = log.clone();
                    async move {
                        let key = item.idempotency_key().to_owned();
                        append(&log, &format!("start {key} {}", item.destination()));
                        if key.contains("retry") && item.attempts() == 1 {
                            append(&log, &format!("end {key} retryable"));
                            return Err(SendError::retryable("http_502"));
                        }
                        tokio::time::sleep(send_for).await;
                        append(&log, &format!("end {key}"));
                        Ok(Some(format!("tr-{key}")))
                    }
                })
                .concurrency(concurrency)
                .shutdown_timeout(shutdown_timeout);
            say("ready");
            worker
                .run(async move {
                    term.recv().await;
                })
                .await
        });
        let report = report.unwrap_or_else(|e| fail(&format!("worker: {e}")));
        say(&format!(
            "report sent={} failed={} deferred={} retried={} released={} cancelled={}",
            report.sent,
            report.failed,
            report.deferred,
            report.retried,
            report.released,
            report.cancelled
        ));
    }
}

/// Tells the recording filesystem mounted at `dir` that something happened, in
/// order with the writes: a lookup of a name it answers "not found" and logs.
/// Everything done before the call has reached the filesystem by then.
fn mark(dir: &Path, what: &str) {
    let _ = std::fs::symlink_metadata(dir.join(format!(".powerloss-mark-{what}")));
}

/// The settings the power-loss harness opens its crash states with, too: every
/// compaction moves finished items to history, rotates the audit log once it
/// passes 2 KiB, and keeps two history segments.
fn power_loss_builder(dir: &Path) -> durable_outbox::OutboxBuilder {
    Outbox::builder(dir)
        .rate_limit(u32::MAX, Duration::from_millis(1))
        .max_inline_wait(Duration::ZERO)
        .history_after(Duration::ZERO)
        .audit_rotate_bytes(2048)
        .history_retention(durable_outbox::Retention::MaxSegments(2))
}

/// The power-loss workload. Marks: `ack-KEY` once an enqueue returned `Ok`;
/// `send-KEY` when a send starts (the message may have left from then on);
/// `mayprune-KEY` before a compaction that may prune KEY's history segment,
/// `kept-KEY` after it for the keys still there. Its last phase runs
/// [`POWER_LOSS_THREADS`] threads on one handle, so commit groups carry
/// several transactions' entries in one write.
fn power_loss(dir: &Path) {
    let open = || {
        power_loss_builder(dir)
            .open()
            .unwrap_or_else(|e| fail(&format!("open: {e}")))
    };
    let send = |item: &OutboxItem| {
        let key = item.idempotency_key();
        mark(dir, &format!("send-{key}"));
        if key.ends_with("-refused") {
            Err(SendError::permanent("refused"))
        } else {
            Ok(Some(format!("tr-{key}")))
        }
    };
    let enqueue = |outbox: &Outbox, keys: &[&str]| {
        for (i, key) in keys.iter().enumerate() {
            outbox
                .enqueue(message(key, i as u64))
                .unwrap_or_else(|e| fail(&format!("enqueue: {e}")));
            mark(dir, &format!("ack-{key}"));
        }
    };
    // Before a compaction (which may prune history): every key in history.
    let may_prune = |outbox: &Outbox| {
        let keys: Vec<String> = outbox
            .history_items()
            .unwrap_or_else(|e| fail(&format!("history: {e}")))
            .map(|item| item.map(|i| i.idempotency_key().to_owned()))
            .collect::<Result<_, _>>()
            .unwrap_or_else(|e| fail(&format!("history: {e}")));
        for key in &keys {
            mark(dir, &format!("mayprune-{key}"));
        }
        keys
    };
    let kept = |outbox: &Outbox, keys: Vec<String>| {
        for key in keys {
            if outbox.get(&key).ok().flatten().is_some() {
                mark(dir, &format!("kept-{key}"));
            }
        }
    };
    let compact = |outbox: &Outbox| {
        // Past the 1 ms rate window, so finished items may move to history.
        std::thread::sleep(Duration::from_millis(3));
        let keys = may_prune(outbox);
        outbox
            .compact()
            .unwrap_or_else(|e| fail(&format!("compact: {e}")));
        kept(outbox, keys);
    };
    let process = |outbox: &Outbox, key: &str| {
        outbox
            .process(key, send)
            .unwrap_or_else(|e| fail(&format!("process: {e}")));
    };

    let outbox = open();
    enqueue(&outbox, &["a0", "a1-refused", "a2", "a3"]);
    process(&outbox, "a0");
    process(&outbox, "a1-refused");
    compact(&outbox);
    enqueue(&outbox, &["b0", "b1"]);
    outbox
        .process_due(send)
        .unwrap_or_else(|e| fail(&format!("drain: {e}")));
    compact(&outbox);
    enqueue(&outbox, &["c0"]);
    process(&outbox, "c0");
    compact(&outbox);
    enqueue(&outbox, &["c1"]);
    process(&outbox, "c1");
    std::thread::sleep(Duration::from_millis(3));
    let keys = may_prune(&outbox);
    drop(outbox);
    // A second life: opening compacts what the first left in the journal.
    let outbox = open();
    kept(&outbox, keys);
    enqueue(&outbox, &["d0"]);
    process(&outbox, "d0");
    // Commit groups: threads sharing the handle commit at once, so one
    // leader's write carries several transactions' entries (the state a power
    // cut can tear with its first sectors lost and later entries kept). Each
    // mark still follows the call that returned, so the oracle stays exact.
    // Each round starts together, so its commits meet in groups.
    let round = std::sync::Barrier::new(POWER_LOSS_THREADS);
    std::thread::scope(|scope| {
        for t in 0..POWER_LOSS_THREADS {
            let (outbox, round) = (&outbox, &round);
            scope.spawn(move || {
                for j in 0..3 {
                    round.wait();
                    let key = format!("t{t}-{j}");
                    enqueue(outbox, &[key.as_str()]);
                    if j == 0 {
                        process(outbox, &key);
                    }
                }
            });
        }
    });
    drop(outbox);
    say("done");
}

/// Threads of the power-loss workload's commit-group phase.
const POWER_LOSS_THREADS: usize = 6;

/// Sends one item to a real homeserver and hangs after the PUT was answered.
#[cfg(feature = "matrix")]
fn matrix_send(args: &[String]) {
    use durable_outbox::MatrixClient;
    let [_, dir, homeserver, user, password, device, room, key, mode] = args else {
        fail("matrix-send DIR HOMESERVER USER PASSWORD DEVICE ROOM KEY MODE")
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| fail(&format!("runtime: {e}")));
    runtime.block_on(async {
        let mut builder = Outbox::builder(dir).rate_limit(u32::MAX, Duration::from_secs(1));
        if mode == "idempotent" {
            builder =
                builder.idempotent_transport(MatrixClient::CONNECTOR, Duration::from_secs(3600));
        }
        let outbox = builder
            .open()
            .unwrap_or_else(|e| fail(&format!("open: {e}")));
        outbox
            .enqueue(NewMessage {
                idempotency_key: key.clone(),
                connector: MatrixClient::CONNECTOR.into(),
                grant_id: "bot".into(),
                destination: room.clone(),
                content: format!("message {key}"),
                ..Default::default()
            })
            .unwrap_or_else(|e| fail(&format!("enqueue: {e}")));
        let client = MatrixClient::login(homeserver, user, password, device)
            .await
            .unwrap_or_else(|e| fail(&format!("login: {e}")));
        let _ = outbox
            .process_async(key, |item| {
                let client = client.clone();
                async move {
                    let sent = client.send(item).await;
                    match &sent {
                        Ok(Some(event_id)) => say(&format!("put-answered {event_id}")),
                        other => say(&format!("put-failed {other:?}")),
                    }
                    // Never return: the outcome is not recorded before the kill.
                    std::future::pending::<()>().await;
                    sent
                }
            })
            .await;
        fail("the send returned");
    });
}
