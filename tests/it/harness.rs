//! A small harness so each test reads as the behaviour it checks.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use durable_outbox::{ManualClock, NewMessage, Outbox, OutboxBuilder};
use tempfile::TempDir;

pub const START: &str = "2026-01-15T09:00:00Z";

/// An outbox with a manual clock (sleeping advances it): in a fresh
/// directory ([`Harness::new`], [`Harness::with`]), or on whichever engine an
/// [`on_both_engines!`](crate::engines::on_both_engines) body runs
/// ([`EngineUnderTest::harness`](crate::engines::EngineUnderTest::harness)).
/// `dir` and the file readers (`path`, `state_bytes`, `audit_bytes`) are for
/// file-only tests; on PostgreSQL the directory stays empty.
pub struct Harness {
    pub dir: Arc<TempDir>,
    pub clock: ManualClock,
    pub outbox: Outbox,
    /// The PostgreSQL URL the outbox lives at, `None` on the file engine.
    pub url: Option<String>,
}

impl Harness {
    pub fn new() -> Self {
        Self::with(|b| b)
    }

    /// Like `new`, with extra builder settings.
    pub fn with(configure: impl Fn(OutboxBuilder) -> OutboxBuilder) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let clock = ManualClock::at(START).expect("start time");
        let outbox = configure(builder(dir.path(), &clock))
            .open()
            .expect("open outbox");
        Self {
            dir: Arc::new(dir),
            clock,
            outbox,
            url: None,
        }
    }

    /// A harness around a handle opened on an engine under test.
    pub(crate) fn on_engine(
        dir: Arc<TempDir>,
        clock: ManualClock,
        outbox: Outbox,
        url: Option<String>,
    ) -> Self {
        Self {
            dir,
            clock,
            outbox,
            url,
        }
    }

    /// Opens a second, independent handle on the same outbox (another
    /// "process", or another host on PostgreSQL).
    pub fn reopen(&self) -> Outbox {
        self.reopen_with(|b| b)
    }

    /// Like `reopen`, with extra builder settings.
    pub fn reopen_with(&self, configure: impl FnOnce(OutboxBuilder) -> OutboxBuilder) -> Outbox {
        let builder = match &self.url {
            #[cfg(feature = "postgres")]
            Some(url) => Outbox::postgres(url)
                .clock(self.clock.clone())
                .sleeper(self.clock.clone()),
            _ => builder(self.dir.path(), &self.clock),
        };
        configure(builder).open().expect("reopen outbox")
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn state_bytes(&self) -> Vec<u8> {
        std::fs::read(self.path("outbox.json")).unwrap_or_default()
    }

    pub fn audit_bytes(&self) -> Vec<u8> {
        std::fs::read(self.path("audit.jsonl")).unwrap_or_default()
    }

    /// Runs `f` and asserts that it wrote nothing: on the file engine neither
    /// `outbox.json` nor `audit.jsonl` changed by a byte; on PostgreSQL every
    /// item reads the same and the audit chain has the same head.
    pub fn assert_files_unchanged<T>(&self, f: impl FnOnce() -> T) -> T {
        if self.url.is_some() {
            let before = (
                self.outbox.list_items().expect("list"),
                self.outbox.audit_head().expect("head"),
            );
            let value = f();
            let after = (
                self.outbox.list_items().expect("list"),
                self.outbox.audit_head().expect("head"),
            );
            assert!(after.0 == before.0, "an item changed");
            assert_eq!(after.1, before.1, "an audit record was written");
            return value;
        }
        let (state, audit) = (self.state_bytes(), self.audit_bytes());
        let value = f();
        assert!(self.state_bytes() == state, "outbox.json changed");
        assert!(self.audit_bytes() == audit, "audit.jsonl changed");
        value
    }

    /// Lets history and retention catch up with the clock: compaction moves
    /// old terminal items into segments and prunes on the file engine, and
    /// applies retention on PostgreSQL (where history is a view of old
    /// terminal rows).
    pub fn settle_history(&self) {
        self.outbox.compact().expect("compact");
    }

    pub fn enqueue(&self, key: &str, destination: &str) {
        self.outbox.enqueue(msg(key, destination)).expect("enqueue");
    }

    /// Every audit record, in order: `audit.jsonl` on the file engine, the
    /// audit table on PostgreSQL.
    pub fn audit_records(&self) -> Vec<durable_outbox::AuditRecord> {
        if self.url.is_some() {
            self.outbox
                .audit_records()
                .expect("read audit")
                .map(|r| r.expect("an audit record"))
                .collect()
        } else {
            durable_outbox::AuditLog::read(self.path("audit.jsonl")).expect("read audit")
        }
    }

    /// The outcome names of the audit records, in order (`outcome:key`).
    pub fn audit_outcomes(&self) -> Vec<String> {
        self.audit_records()
            .iter()
            .map(|r| format!("{}:{}", r.outcome.as_str(), r.idempotency_key))
            .collect()
    }
}

/// A per-destination cap that never binds, for tests about something else
/// (order, history, replies, operator actions…) that send several messages to
/// one chat, or resend one, while the manual clock stands still. The crate's
/// default (one send per chat per second) would defer all but the first; the
/// tests that are about caps, `rate_caps` and `settings`, set their own.
pub fn uncapped(b: OutboxBuilder) -> OutboxBuilder {
    b.rate_limit(u32::MAX, secs(60))
}

/// A builder with the manual clock as both clock and sleeper.
pub fn builder(dir: &Path, clock: &ManualClock) -> OutboxBuilder {
    Outbox::builder(dir)
        .clock(clock.clone())
        .sleeper(clock.clone())
}

/// A valid message.
pub fn msg(key: &str, destination: &str) -> NewMessage {
    NewMessage {
        idempotency_key: key.into(),
        connector: "telegram".into(),
        grant_id: "grant-1".into(),
        destination: destination.into(),
        content: format!("body of {key}"),
        ..Default::default()
    }
}

/// A two-thread tokio runtime for the async tests (`process_async`, the
/// worker): small, as the machines that run the suite have two cores.
#[cfg(feature = "tokio")]
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

pub fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

pub fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Leaves `owners/<id>.owner` the way a process killed with SIGKILL leaves its
/// owner file: present, with nobody holding its lock. A claim naming `id` is
/// then orphaned.
pub fn plant_dead_owner(dir: &Path, id: &str) {
    use std::os::unix::fs::OpenOptionsExt;
    let owners = dir.join("owners");
    std::fs::create_dir_all(&owners).expect("owners directory");
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(owners.join(format!("{id}.owner")))
        .expect("plant an unlocked owner file");
}

/// Runs `body`, and stops the whole test binary with a message naming
/// `guarantee` if it has not finished within `limit`: a test that can deadlock
/// (a lock held across `send`, a claim never released) reports the broken
/// guarantee instead of hanging the suite. A panicking body fails as usual.
pub fn within<T>(guarantee: &str, limit: Duration, body: impl FnOnce() -> T) -> T {
    let (finished, watch) = std::sync::mpsc::channel::<()>();
    let guarantee = guarantee.to_owned();
    std::thread::spawn(move || {
        if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = watch.recv_timeout(limit) {
            // Straight to the process's stderr: the harness's output capture
            // would swallow an `eprintln!` along with the test binary.
            let _ = writeln!(
                std::io::stderr(),
                "WATCHDOG: {guarantee} is broken: the test did not finish within {limit:?} \
                 (a deadlock); stopping the test binary"
            );
            std::process::exit(70);
        }
    });
    let value = body();
    drop(finished);
    value
}

/// Calls `process_async(key, …)` with a send that never answers, and drops
/// the call's future once the send has started (the request is out), as a
/// caller that gives up does. `at_send` runs when the send starts (a test
/// moves its manual clock there). Event-driven: the drop waits for the send
/// to start however slow the claim is, and a send that never starts fails
/// the test after [`DEADLOCK_LIMIT`]. A fixed timeout instead would drop the
/// call before the claim on a loaded machine, which tests something else.
#[cfg(feature = "tokio")]
pub fn drop_mid_send(
    runtime: &tokio::runtime::Runtime,
    outbox: &Outbox,
    key: &str,
    mut at_send: impl FnMut(),
) {
    let (started, in_flight) = tokio::sync::oneshot::channel::<()>();
    let mut started = Some(started);
    runtime.block_on(async {
        let call = outbox.process_async(key, |_| {
            at_send();
            let started = started.take();
            async move {
                if let Some(started) = started {
                    let _ = started.send(());
                }
                // The request was written; the answer never comes.
                tokio::time::sleep(Duration::from_secs(3600)).await;
                Ok(None)
            }
        });
        let raced = tokio::time::timeout(DEADLOCK_LIMIT, async {
            tokio::select! {
                receipt = call => panic!("a send that never answers returned {receipt:?}"),
                _ = in_flight => {}
            }
        })
        .await;
        assert!(
            raced.is_ok(),
            "the send did not start within {DEADLOCK_LIMIT:?}"
        );
    });
}

/// The files in `dir` whose name starts with `prefix`, in name order: the
/// copies recovery sets aside (`<file>.torn-<n>`), for one.
pub fn files_starting_with(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut found: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with(prefix))
        .collect();
    found.sort();
    found
}

/// How long a test that can deadlock may run before its watchdog fires:
/// far beyond what it needs on a loaded two-core machine.
pub const DEADLOCK_LIMIT: Duration = Duration::from_secs(30);

/// A test needs `tool`, which is missing (`why`). In CI (`CI` set) that is a
/// failure that says what to install; elsewhere the test is skipped, loudly.
pub fn missing_tool(tool: &str, why: &str) {
    assert!(
        std::env::var_os("CI").is_none(),
        "{tool} is required in CI and is missing ({why}); install it (see .ci/run)"
    );
    eprintln!("SKIPPED: {tool} is not available here ({why}); CI would fail");
}
