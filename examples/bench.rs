//! Workload W1 (see `../shared/anchors/README.md`), printed as one JSON line with the
//! same keys as the anchors, so the three can be compared side by side:
//!
//! ```text
//! cargo run --release --example bench -- --n 1000 --destinations 50 --dir /tmp/w1-1000
//! cargo run --release --example bench -- --workload broadcast --n 50000 --dir /tmp/bc
//! ```
//!
//! W1: enqueue N messages (destination `chat-{i % D}`, 200-character content with i,
//! key `key-{i:08}`), process each key in order with a send returning `tr-{i}` and a
//! cap high enough that nothing defers (the cap check still runs), look every
//! `tr-{i}` up, then verify (untimed) that all are sent once and the chain is intact.
//!
//! broadcast: enqueue N messages to N destinations with `enqueue_many` (batches of
//! 1,000), then drain them with `process_due`.
//!
//! wake (feature `tokio`): the delivery worker's wake-up latency, from `enqueue`
//! returning to `send` being called, for N enqueues spaced 100 ms apart (so each
//! finds the worker asleep): first through a clone of the worker's handle (the
//! in-process notification), then from a child process (the journal watcher;
//! with `--postgres`, the child is another handle, and the wake-up its
//! commit's `NOTIFY`). Reports median, p99 and max in milliseconds:
//!
//! ```text
//! cargo run --release --features tokio --example bench -- --workload wake --n 200 --dir /tmp/wake
//! cargo run --release --features tokio,postgres --example bench -- --workload wake --n 200 \
//!     --postgres postgres://postgres@127.0.0.1:5432/bench --schema wake
//! ```
//!
//! W2 (`--workload w2 --threads T [--send-us U]`): one `Outbox` shared by T threads;
//! thread t takes keys i = t, t+T, t+2T, … and for each enqueues the W1 message and
//! then processes it with a send returning `tr-{i}` (sleeping U µs first, if given).
//! Prints `w2_per_s` = N / wall time, after checking (untimed) that all N are sent
//! once and the chain verifies. `--processes P` runs P such processes on one
//! directory, each with T threads and keys i ≡ p (mod P) of N (the parent
//! prints the figure for all of them together).
//!
//! `--postgres URL [--schema NAME]` (feature `postgres`; W1, W2 and wake): the same
//! workload on a PostgreSQL outbox in schema NAME (default `bench`; it must be
//! new or empty), instead of `--dir`:
//!
//! ```text
//! cargo run --release --features postgres --example bench -- --workload w2 --threads 8 \
//!     --n 2000 --postgres postgres://postgres@127.0.0.1:5432/bench --schema w2_8
//! ```
//!
//! async (`--features tokio`, `--workload async --concurrency C [--send-us U]`):
//! enqueue N messages (untimed, `enqueue_many`), then one `process_due_async`
//! with C sends in flight, each sleeping U µs (tokio's timer); prints
//! `async_per_s` = N / drain time, to compare with C / U (`bound_per_s`), and
//! the sends' measured mean length `send_mean_ms` with the bound it allows,
//! `bound_at_send_mean_per_s` = C / that mean (tokio's timer rounds a sleep up
//! to its next millisecond tick, so a 20 ms send takes about 21 ms).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use durable_outbox::{ItemState, NewMessage, Outbox};

struct Args {
    workload: String,
    n: usize,
    history: usize,
    destinations: usize,
    dir: PathBuf,
    threads: usize,
    send_us: u64,
    processes: usize,
    /// `--part p`: this child runs only the keys with i % processes == p.
    part: Option<usize>,
    concurrency: usize,
    /// `--postgres URL`: a PostgreSQL outbox instead of `--dir`.
    postgres: Option<String>,
    /// `--schema NAME`: its schema.
    schema: String,
    /// `--warm yes` (W2, one process): open the outbox and give it one
    /// connection per thread before the clock starts, and drop it after the
    /// clock stops, as `pgbench` leaves connecting out of its `tps`.
    warm: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        workload: "w1".into(),
        n: 1000,
        history: 100_000,
        destinations: 50,
        dir: PathBuf::new(),
        threads: 1,
        send_us: 0,
        processes: 1,
        part: None,
        concurrency: 64,
        postgres: None,
        schema: "bench".into(),
        warm: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--workload" => args.workload = value,
            "--n" => args.n = value.parse().map_err(|e| format!("--n: {e}"))?,
            "--history" => args.history = value.parse().map_err(|e| format!("--history: {e}"))?,
            "--destinations" => {
                args.destinations = value.parse().map_err(|e| format!("--destinations: {e}"))?;
            }
            "--dir" => args.dir = PathBuf::from(value),
            "--threads" => args.threads = value.parse().map_err(|e| format!("--threads: {e}"))?,
            "--send-us" => args.send_us = value.parse().map_err(|e| format!("--send-us: {e}"))?,
            "--processes" => {
                args.processes = value.parse().map_err(|e| format!("--processes: {e}"))?;
            }
            "--concurrency" => {
                args.concurrency = value.parse().map_err(|e| format!("--concurrency: {e}"))?;
            }
            "--part" => args.part = Some(value.parse().map_err(|e| format!("--part: {e}"))?),
            "--postgres" => args.postgres = Some(value),
            "--schema" => args.schema = value,
            "--warm" => args.warm = value == "yes",
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if args.postgres.is_some() {
        // The outbox is the schema; the directory only holds nothing.
        args.dir = std::env::temp_dir().join(format!("bench-pg-{}", std::process::id()));
    }
    if args.dir.as_os_str().is_empty()
        || args.n == 0
        || args.destinations == 0
        || args.threads == 0
        || args.processes == 0
    {
        return Err(
            "usage: bench [--workload w1|broadcast|w2|wake|async] [--threads T] [--send-us U] \
             [--processes P] --n N --destinations D --dir DIR"
                .into(),
        );
    }
    // The wake workload's child enqueues into the parent's live outbox.
    if args.workload != "wake-enqueuer"
        && args.part.is_none()
        && args.dir.exists()
        && std::fs::read_dir(&args.dir)
            .map_err(|e| e.to_string())?
            .next()
            .is_some()
    {
        return Err(format!(
            "--dir {} must be missing or empty",
            args.dir.display()
        ));
    }
    Ok(args)
}

fn content(i: usize) -> String {
    let text = format!(
        "msg-{i:08}: {}",
        "lorem ipsum dolor sit amet consectetur adipiscing elit ".repeat(4)
    );
    text[..200].to_owned()
}

fn message(i: usize, destination: String) -> NewMessage {
    NewMessage {
        idempotency_key: format!("key-{i:08}"),
        connector: "telegram".into(),
        grant_id: "grant-1".into(),
        destination,
        content: content(i),
        ..Default::default()
    }
}

fn open(args: &Args) -> Result<Outbox, Box<dyn std::error::Error>> {
    if let Some(url) = &args.postgres {
        #[cfg(feature = "postgres")]
        return Ok(Outbox::postgres(url)
            .schema(&args.schema)
            .rate_limit(u32::MAX, Duration::from_secs(60))
            .open()?);
        #[cfg(not(feature = "postgres"))]
        return Err(format!("--postgres {url}: build with --features postgres").into());
    }
    Ok(Outbox::builder(&args.dir)
        .rate_limit(u32::MAX, Duration::from_secs(60))
        .open()?)
}

fn w1(args: &Args) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let outbox = open(args)?;
    w1_on(&outbox, args, 0)
}

/// W1 on an open outbox whose audit log already holds `audit_before` records.
fn w1_on(
    outbox: &Outbox,
    args: &Args,
    audit_before: u64,
) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let n = args.n;
    let start = Instant::now();
    for i in 0..n {
        outbox.enqueue(message(i, format!("chat-{}", i % args.destinations)))?;
    }
    let enqueue_s = start.elapsed().as_secs_f64();

    let start = Instant::now();
    for i in 0..n {
        let receipt = outbox.process(&format!("key-{i:08}"), |_| Ok(Some(format!("tr-{i}"))))?;
        if receipt.outcome != durable_outbox::Outcome::Sent {
            return Err(format!("key-{i:08}: {:?}", receipt.outcome).into());
        }
    }
    let process_s = start.elapsed().as_secs_f64();

    let start = Instant::now();
    for i in 0..n {
        let found = outbox.find_by_transport_ref(&format!("tr-{i}"))?;
        if found
            .as_ref()
            .map(durable_outbox::OutboxItem::idempotency_key)
            != Some(format!("key-{i:08}").as_str())
        {
            return Err(format!("tr-{i} resolved to {found:?}").into());
        }
    }
    let lookup_s = start.elapsed().as_secs_f64();

    let items = outbox.list_items()?;
    assert_eq!(items.len(), n);
    assert!(
        items
            .iter()
            .all(|i| i.state() == ItemState::Sent && i.attempts() == 1 && !i.dispatch_claimed())
    );
    let audit = outbox.verify_audit()?;
    assert_eq!(audit.records, audit_before + 2 * n as u64);
    Ok(serde_json::json!({
        "impl": "durable-outbox", "workload": "w1", "n": n, "destinations": args.destinations,
        "enqueue_s": enqueue_s, "process_s": process_s, "lookup_s": lookup_s,
        "enqueue_per_s": (n as f64 / enqueue_s).round(), "process_per_s": (n as f64 / process_s).round(),
        "lookup_per_s": (n as f64 / lookup_s).round(),
        "state_bytes": dir_bytes(&args.dir, |name| name != "audit.jsonl"),
        "audit_records": audit.records,
        "audit_bytes": dir_bytes(&args.dir, |name| name == "audit.jsonl"),
    }))
}

/// Total size of the files in `dir` whose names pass `keep`.
fn dir_bytes(dir: &std::path::Path, keep: impl Fn(&str) -> bool) -> u64 {
    std::fs::read_dir(dir).map_or(0, |entries| {
        entries
            .flatten()
            .filter(|e| keep(&e.file_name().to_string_lossy()))
            .filter_map(|e| e.metadata().ok())
            .filter(std::fs::Metadata::is_file)
            .map(|m| m.len())
            .sum()
    })
}

/// Old traffic: --history items sent under a manual clock long ago and moved
/// to history by compactions in chunks, as a long-running bot's would be.
fn prefill(args: &Args) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let total = args.history;
    let clock = durable_outbox::ManualClock::at("2025-01-01T00:00:00Z")?;
    let outbox = Outbox::builder(&args.dir)
        .clock(clock.clone())
        .rate_limit(u32::MAX, Duration::from_millis(1))
        .history_after(Duration::ZERO)
        .open()?;
    let chunk = 10_000;
    let mut i = 0;
    while i < total {
        let end = total.min(i + chunk);
        let mut batch = Vec::with_capacity(1000);
        for j in i..end {
            let mut m = message(j, format!("chat-{}", j % args.destinations));
            m.idempotency_key = format!("hist-{j:08}");
            batch.push(m);
            if batch.len() == 1000 {
                outbox.enqueue_many(std::mem::take(&mut batch))?;
            }
        }
        if !batch.is_empty() {
            outbox.enqueue_many(batch)?;
        }
        outbox.process_due(|item| Ok(Some(format!("h{}", item.idempotency_key()))))?;
        clock.advance(Duration::from_secs(1));
        outbox.compact()?;
        i = end;
    }
    assert_eq!(outbox.history_len()?, total);
    Ok(serde_json::json!({ "prefilled": total }))
}

/// Resident and peak memory of this process, in bytes (Linux), from /proc.
fn memory() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .map_or(0, |kib| kib * 1024)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// W1 (N = --n) on an outbox whose history already holds --history terminal
/// items, against W1 on an empty outbox; plus open time, lookups of history
/// items by transport ref, and memory.
fn history(args: &Args) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let total = args.history;
    // Prefill (untimed) in a child process, so the measurements below run in a
    // process that, like a restarted bot, only opened the outbox.
    let prefill = Instant::now();
    let status = std::process::Command::new(std::env::current_exe()?)
        .args(["--workload", "prefill", "--history", &total.to_string()])
        .args(["--destinations", &args.destinations.to_string()])
        .arg("--dir")
        .arg(&args.dir)
        .status()?;
    if !status.success() {
        return Err(format!("prefill failed: {status}").into());
    }
    let prefill_s = prefill.elapsed().as_secs_f64();

    let start = Instant::now();
    let outbox = open(args)?;
    let open_s = start.elapsed().as_secs_f64();
    let (rss_after_open, _) = memory();

    let lookups = 20_000.min(total.max(1));
    let start = Instant::now();
    for k in 0..lookups {
        let j = (k * 7919) % total.max(1);
        let found = outbox.find_by_transport_ref(&format!("hhist-{j:08}"))?;
        assert!(found.is_some(), "history item {j} not found");
    }
    let history_lookup_s = start.elapsed().as_secs_f64();

    let loaded = w1_on(&outbox, args, 2 * total as u64)?;
    let empty_dir = tempfile::tempdir()?;
    let empty_args = Args {
        dir: empty_dir.path().join("w1"),
        workload: "w1".into(),
        postgres: None,
        schema: String::new(),
        ..*args
    };
    let empty = w1(&empty_args)?;
    let (rss, peak) = memory();
    let ratio = |k: &str| {
        (loaded[k].as_f64().unwrap_or(0.0) / empty[k].as_f64().unwrap_or(1.0) * 100.0).round()
            / 100.0
    };
    Ok(serde_json::json!({
        "impl": "durable-outbox", "workload": "history", "history_items": total, "n": args.n,
        "prefill_s": prefill_s, "open_s": open_s,
        "history_lookup_per_s": (lookups as f64 / history_lookup_s).round(),
        "w1_with_history": { "enqueue_per_s": loaded["enqueue_per_s"], "process_per_s": loaded["process_per_s"], "lookup_per_s": loaded["lookup_per_s"] },
        "w1_empty": { "enqueue_per_s": empty["enqueue_per_s"], "process_per_s": empty["process_per_s"], "lookup_per_s": empty["lookup_per_s"] },
        "ratio_with_history_over_empty": { "enqueue": ratio("enqueue_per_s"), "process": ratio("process_per_s"), "lookup": ratio("lookup_per_s") },
        "rss_bytes_after_open": rss_after_open, "rss_bytes_end": rss, "peak_rss_bytes": peak,
        "history_bytes": dir_bytes(&args.dir.join("history"), |_| true),
    }))
}

/// 50,000 messages to 50,000 destinations: batched enqueue, then one drain.
fn broadcast(args: &Args) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let n = args.n;
    let outbox = open(args)?;
    let start = Instant::now();
    let mut i = 0;
    while i < n {
        let batch: Vec<NewMessage> = (i..n.min(i + 1000))
            .map(|j| message(j, format!("user-{j}")))
            .collect();
        i += batch.len();
        outbox.enqueue_many(batch)?;
    }
    let enqueue_s = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let report = outbox.process_due(|item| Ok(Some(format!("tr-{}", item.idempotency_key()))))?;
    let process_s = start.elapsed().as_secs_f64();
    if report.sent != n {
        return Err(format!("drained {} of {n}: {report:?}", report.sent).into());
    }
    let audit = outbox.verify_audit()?;
    assert_eq!(audit.records, 2 * n as u64);
    Ok(serde_json::json!({
        "impl": "durable-outbox", "workload": "broadcast", "n": n, "destinations": n,
        "enqueue_s": enqueue_s, "process_s": process_s,
        "enqueue_per_s": (n as f64 / enqueue_s).round(), "process_per_s": (n as f64 / process_s).round(),
        "state_bytes": dir_bytes(&args.dir, |name| name != "audit.jsonl"),
        "audit_records": audit.records,
    }))
}

/// Wake-up latency of the delivery worker.
#[cfg(feature = "tokio")]
mod wake {
    use std::collections::HashMap;
    use std::io::{BufRead, Write};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    use durable_outbox::{OutboxItem, SendError};

    use super::{Args, message, open};

    /// The spacing between enqueues: longer than a send, so each finds the worker idle.
    const SPACING: Duration = Duration::from_millis(100);

    fn micros_now() -> u128 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros())
    }

    /// Child process: enqueue N messages (keys `x-{i}`), printing each key
    /// with the time its enqueue returned.
    pub(super) fn enqueuer(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
        let outbox = open(args)?;
        let mut out = std::io::stdout().lock();
        for i in 0..args.n {
            let mut m = message(i, format!("chat-{i}"));
            m.idempotency_key = format!("x-{i}");
            outbox.enqueue(m)?;
            writeln!(out, "x-{i} {}", micros_now())?;
            out.flush()?;
            std::thread::sleep(SPACING);
        }
        Ok(())
    }

    fn summary(mut latencies_us: Vec<u128>) -> serde_json::Value {
        latencies_us.sort_unstable();
        let at = |q: f64| {
            let i = ((latencies_us.len() as f64 - 1.0) * q).round() as usize;
            latencies_us.get(i).map_or(0.0, |us| *us as f64 / 1000.0)
        };
        serde_json::json!({
            "samples": latencies_us.len(), "median_ms": at(0.5), "p99_ms": at(0.99), "max_ms": at(1.0),
        })
    }

    pub(super) fn run(args: &Args) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
        let outbox = open(args)?;
        let seen: Arc<Mutex<HashMap<String, u128>>> = Arc::default();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let record = Arc::clone(&seen);
        let worker = outbox.worker(move |item: OutboxItem| {
            let at = micros_now();
            record
                .lock()
                .map(|mut m| m.insert(item.idempotency_key().to_owned(), at))
                .ok();
            async move { Ok::<_, SendError>(None) }
        });
        let running = runtime.spawn(worker.run(async move {
            stopped.await.ok();
        }));
        std::thread::sleep(Duration::from_millis(100));

        // Same process: a clone of the worker's handle.
        let clone = outbox.clone();
        let mut returned = HashMap::new();
        for i in 0..args.n {
            let mut m = message(i, format!("chat-{i}"));
            m.idempotency_key = format!("s-{i}");
            clone.enqueue(m)?;
            returned.insert(format!("s-{i}"), micros_now());
            std::thread::sleep(SPACING);
        }
        std::thread::sleep(Duration::from_millis(200));

        // Another process (on PostgreSQL: another handle, as another host's).
        let mut child = std::process::Command::new(std::env::current_exe()?);
        child.args(["--workload", "wake-enqueuer", "--n", &args.n.to_string()]);
        match &args.postgres {
            Some(url) => child.args(["--postgres", url, "--schema", &args.schema]),
            None => child.arg("--dir").arg(&args.dir),
        };
        let child = child.stdout(std::process::Stdio::piped()).spawn()?;
        let output = child.wait_with_output()?;
        if !output.status.success() {
            return Err("the enqueuing child failed".into());
        }
        for line in output.stdout.lines() {
            let line = line?;
            if let Some((key, at)) = line.split_once(' ') {
                returned.insert(key.to_owned(), at.parse()?);
            }
        }
        std::thread::sleep(Duration::from_millis(300));
        stop.send(()).ok();
        runtime.block_on(running)??;

        let seen = seen.lock().map_err(|_| "poisoned")?.clone();
        let latency = |prefix: &str| -> Result<Vec<u128>, String> {
            returned
                .iter()
                .filter(|(k, _)| k.starts_with(prefix))
                .map(|(k, at)| {
                    seen.get(k)
                        .map(|sent| sent.saturating_sub(*at))
                        .ok_or_else(|| format!("{k} was never sent"))
                })
                .collect()
        };
        Ok(serde_json::json!({
            "impl": "durable-outbox", "workload": "wake", "n": args.n,
            "same_process": summary(latency("s-")?),
            "cross_process": summary(latency("x-")?),
        }))
    }
}

/// The keys of W2 one process runs: i ≡ part (mod processes).
fn w2_keys(args: &Args, part: usize) -> Vec<usize> {
    (part..args.n).step_by(args.processes).collect()
}

/// W2's timed part in this process: T threads on one `Outbox` (opened here
/// unless `warm` is given).
fn w2_run(
    args: &Args,
    keys: &[usize],
    warm: Option<&Outbox>,
) -> Result<(), Box<dyn std::error::Error>> {
    let opened;
    let outbox = if let Some(outbox) = warm {
        outbox
    } else {
        opened = open(args)?;
        &opened
    };
    let send_us = args.send_us;
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..args.threads)
            .map(|t| {
                let mine: Vec<usize> = keys.iter().copied().skip(t).step_by(args.threads).collect();
                scope.spawn(move || -> Result<(), String> {
                    for i in mine {
                        outbox
                            .enqueue(message(i, format!("chat-{}", i % args.destinations)))
                            .map_err(|e| format!("enqueue {i}: {e}"))?;
                        // Per-chat order may hold a key behind an earlier one
                        // of its chat that another thread is still sending
                        // (`Waiting`: nothing was written).
                        loop {
                            let receipt = outbox
                                .process(&format!("key-{i:08}"), |_| {
                                    if send_us > 0 {
                                        std::thread::sleep(Duration::from_micros(send_us));
                                    }
                                    Ok(Some(format!("tr-{i}")))
                                })
                                .map_err(|e| format!("process {i}: {e}"))?;
                            match receipt.outcome {
                                durable_outbox::Outcome::Sent => break,
                                durable_outbox::Outcome::Waiting
                                | durable_outbox::Outcome::Deferred => {
                                    std::thread::sleep(Duration::from_micros(100));
                                }
                                other => return Err(format!("key-{i:08}: {other:?}")),
                            }
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        for worker in workers {
            worker.join().map_err(|_| "a W2 thread panicked")??;
        }
        Ok::<(), Box<dyn std::error::Error>>(())
    })
}

fn w2(args: &Args) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    if let Some(part) = args.part {
        w2_run(args, &w2_keys(args, part), None)?;
        return Ok(serde_json::Value::Null);
    }
    // Create the outbox first, so the timed part measures only the workload.
    drop(open(args)?);
    let warm = if args.warm && args.processes == 1 {
        let outbox = open(args)?;
        warm_up(&outbox, args.threads)?;
        Some(outbox)
    } else {
        None
    };
    let cpu_start = own_cpu_s();
    let start = Instant::now();
    if args.processes == 1 {
        w2_run(args, &w2_keys(args, 0), warm.as_ref())?;
    } else {
        let exe = std::env::current_exe()?;
        let children: Vec<_> = (0..args.processes)
            .map(|p| {
                std::process::Command::new(&exe)
                    .args(std::env::args().skip(1))
                    .args(["--part", &p.to_string()])
                    .spawn()
            })
            .collect::<Result<_, _>>()?;
        for mut child in children {
            let status = child.wait()?;
            if !status.success() {
                return Err(format!("a W2 process failed: {status}").into());
            }
        }
    }
    let wall_s = start.elapsed().as_secs_f64();
    // This process's CPU (all its threads) in the timed part: with one
    // process, the client's cost per item beside the server's.
    let client_cpu_ms_per_item = cpu_start
        .zip(own_cpu_s())
        .filter(|_| args.processes == 1)
        .map(|(before, after)| 1000.0 * (after - before) / args.n as f64);
    drop(warm);
    let outbox = open(args)?;
    let items = outbox.list_items()?;
    if items.len() != args.n
        || !items.iter().all(|i| {
            i.state() == ItemState::Sent
                && i.attempts() == 1
                && !i.dispatch_claimed()
                && i.transport_ref().is_some()
        })
    {
        return Err("W2: not every item was sent exactly once".into());
    }
    let audit = outbox.verify_audit()?;
    if audit.records != 2 * args.n as u64 {
        return Err(format!("W2: {} audit records for {} items", audit.records, args.n).into());
    }
    Ok(serde_json::json!({
        "impl": "durable-outbox", "workload": "w2", "n": args.n, "threads": args.threads,
        "processes": args.processes, "send_us": args.send_us, "wall_s": wall_s,
        "w2_per_s": (args.n as f64 / wall_s).round(),
        "client_cpu_ms_per_item": client_cpu_ms_per_item, "warm": args.warm,
    }))
}

/// Gives `outbox` one connection per thread (PostgreSQL: its pool fills as
/// `threads` reads overlap), so the timed part starts as a bot that has run
/// a while does: with its connections made.
fn warm_up(outbox: &Outbox, threads: usize) -> Result<(), Box<dyn std::error::Error>> {
    let barrier = std::sync::Barrier::new(threads);
    std::thread::scope(|scope| {
        let readers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    barrier.wait();
                    outbox.get("warm-up: a key never enqueued").map(|_| ())
                })
            })
            .collect();
        for reader in readers {
            reader.join().map_err(|_| "a warm-up thread panicked")??;
        }
        Ok(())
    })
}

/// This process's user + system CPU seconds so far, from `/proc/self/stat`
/// (Linux; `None` elsewhere). Its clock ticks are taken as 100 per second,
/// the value on every Linux this runs on.
fn own_cpu_s() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces) in parentheses.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0)
}

/// The async worker: every due item through `process_due_async`.
#[cfg(feature = "tokio")]
fn drain_async(args: &Args) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let outbox = open(args)?;
    let n = args.n;
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        outbox.enqueue_many(
            chunk
                .iter()
                .map(|&i| message(i, format!("chat-{}", i % args.destinations)))
                .collect(),
        )?;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let send_us = args.send_us;
    // Total time spent inside sends, in ns, to report their real mean length.
    let sending = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let spent = std::sync::Arc::clone(&sending);
    let start = Instant::now();
    let report = runtime.block_on(outbox.process_due_async(args.concurrency, move |item| {
        let spent = std::sync::Arc::clone(&spent);
        async move {
            let began = Instant::now();
            if send_us > 0 {
                tokio::time::sleep(Duration::from_micros(send_us)).await;
            }
            let took = u64::try_from(began.elapsed().as_nanos()).unwrap_or(u64::MAX);
            spent.fetch_add(took, std::sync::atomic::Ordering::Relaxed);
            Ok(Some(format!("tr-{}", item.idempotency_key())))
        }
    }))?;
    let drain_s = start.elapsed().as_secs_f64();
    let send_mean_ms =
        sending.load(std::sync::atomic::Ordering::Relaxed) as f64 / n.max(1) as f64 / 1e6;
    if report.sent != n {
        return Err(format!("drained {} of {n}: {report:?}", report.sent).into());
    }
    let audit = outbox.verify_audit()?;
    if audit.records != 2 * n as u64 {
        return Err(format!("{} audit records for {n} items", audit.records).into());
    }
    Ok(serde_json::json!({
        "impl": "durable-outbox", "workload": "async", "n": n,
        "concurrency": args.concurrency, "send_us": send_us, "wall_s": drain_s,
        "async_per_s": (n as f64 / drain_s).round(),
        "bound_per_s": if send_us > 0 { (args.concurrency as f64 * 1e6 / send_us as f64).round() } else { 0.0 },
        "send_mean_ms": (send_mean_ms * 1000.0).round() / 1000.0,
        "bound_at_send_mean_per_s": if send_mean_ms > 0.0 { (args.concurrency as f64 * 1e3 / send_mean_ms).round() } else { 0.0 },
    }))
}

fn main() {
    let args = match parse_args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("bench: {e}");
            std::process::exit(2);
        }
    };
    let result = match args.workload.as_str() {
        "w1" => w1(&args),
        "broadcast" => broadcast(&args),
        "history" => history(&args),
        "prefill" => prefill(&args).map(|_| serde_json::Value::Null),
        #[cfg(feature = "tokio")]
        "wake" => wake::run(&args),
        "w2" => w2(&args),
        #[cfg(feature = "tokio")]
        "wake-enqueuer" => wake::enqueuer(&args).map(|()| serde_json::Value::Null),
        #[cfg(feature = "tokio")]
        "async" => drain_async(&args),
        other => Err(format!("unknown workload {other}").into()),
    };
    match result {
        Ok(serde_json::Value::Null) => {}
        Ok(line) => println!("{line}"),
        Err(e) => {
            eprintln!("bench: {e}");
            std::process::exit(1);
        }
    }
}
