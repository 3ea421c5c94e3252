//! Runs the real binary and builds outboxes for it to look at.

use std::ffi::OsStr;
use std::path::Path;
use std::process::{Command, Output};

use durable_outbox::{ManualClock, NewMessage, Outbox, OutboxBuilder, SendError};
use serde_json::Value;
use tempfile::TempDir;

/// The binary under test, built by cargo for this test target.
pub const BIN: &str = env!("CARGO_BIN_EXE_durable-outbox");

/// The login name the tool sees (it records it when `--operator` is not given).
pub const LOGIN: &str = "night-shift";

/// One finished run of the tool.
#[derive(Debug)]
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// Runs the tool with `args` and waits for it.
pub fn cli<S: AsRef<OsStr>>(args: impl IntoIterator<Item = S>) -> Run {
    let output = command(args).output().expect("run durable-outbox");
    finished(&output)
}

/// The tool as a `Command`, with a known login name and no colours.
pub fn command<S: AsRef<OsStr>>(args: impl IntoIterator<Item = S>) -> Command {
    let mut command = Command::new(BIN);
    command
        .args(args)
        .env("LOGNAME", LOGIN)
        .env_remove("USER")
        .env("NO_COLOR", "1");
    command
}

pub fn finished(output: &Output) -> Run {
    Run {
        code: output.status.code().expect("exited, not killed"),
        stdout: String::from_utf8(output.stdout.clone()).expect("stdout is UTF-8"),
        stderr: String::from_utf8(output.stderr.clone()).expect("stderr is UTF-8"),
    }
}

impl Run {
    /// Asserts the exit code, showing both streams when it differs.
    #[track_caller]
    pub fn exits(&self, code: i32) -> &Self {
        assert_eq!(self.code, code, "exit code; the run was {self:#?}");
        self
    }

    /// Asserts that stdout contains `text`.
    #[track_caller]
    pub fn says(&self, text: &str) -> &Self {
        assert!(
            self.stdout.contains(text),
            "stdout lacks {text:?}; the run was {self:#?}"
        );
        self
    }

    /// Asserts that stderr contains `text`.
    #[track_caller]
    pub fn complains(&self, text: &str) -> &Self {
        assert!(
            self.stderr.contains(text),
            "stderr lacks {text:?}; the run was {self:#?}"
        );
        self
    }

    /// stdout parsed as JSON.
    #[track_caller]
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}); the run was {self:#?}"))
    }
}

/// A message to `destination` with an obvious body.
pub fn message(key: &str, destination: &str) -> NewMessage {
    NewMessage {
        idempotency_key: key.into(),
        connector: "telegram".into(),
        grant_id: "bot-1".into(),
        destination: destination.into(),
        content: format!("body of {key}"),
        ..Default::default()
    }
}

/// The outbox `builder` opens, its audit history grown to three sealed
/// segments (each of four items, queued and sent, then a compaction) and
/// the active file: old history for a removal to take.
pub fn in_three_sealed_segments(builder: OutboxBuilder) -> Outbox {
    let outbox = builder
        .rate_limit(u32::MAX, std::time::Duration::from_secs(60))
        .audit_rotate_bytes(4096)
        .open()
        .unwrap();
    for round in 0..3 {
        for i in 0..4 {
            let key = format!("r{round}-{i}");
            outbox.enqueue(message(&key, "chat-1")).unwrap();
            outbox
                .process(&key, |item| {
                    Ok(Some(format!("tg-{}", item.idempotency_key())))
                })
                .unwrap();
        }
        outbox.compact().unwrap();
    }
    outbox
}

/// An outbox directory plus an open handle on it (an idle "bot").
pub struct Fixture {
    pub dir: TempDir,
    pub outbox: Outbox,
}

impl Fixture {
    /// An empty outbox, created by a bot that caps each chat at 10 sends per
    /// 60 s (stored, so the tool reads it back). The fixtures send twice to
    /// one chat at once, which the default cap (one per chat per second)
    /// would defer; these tests are about the tool, not the cap.
    pub fn empty() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let outbox = Outbox::builder(dir.path())
            .rate_limit(10, std::time::Duration::from_secs(60))
            .open()
            .unwrap();
        Self { dir, outbox }
    }

    /// Six items, one of each situation an operator meets:
    ///
    /// | key | destination | state |
    /// |---|---|---|
    /// | welcome, order-17 | chat-1 | sent (refs tg-1, tg-2) |
    /// | queued-1 | chat-2 | queued, due now |
    /// | later-1 | chat-3 | queued, waiting an hour after an HTTP 429 |
    /// | gone-1 | chat-4 | failed, `chat_not_found` (permanent) |
    /// | timeout-1 | chat-5 | failed, `read_timeout` (ambiguous) |
    pub fn demo() -> Self {
        let f = Self::empty();
        for (key, destination) in [
            ("welcome", "chat-1"),
            ("order-17", "chat-1"),
            ("queued-1", "chat-2"),
            ("later-1", "chat-3"),
            ("gone-1", "chat-4"),
            ("timeout-1", "chat-5"),
        ] {
            f.outbox.enqueue(message(key, destination)).unwrap();
        }
        f.send("welcome", Ok(Some("tg-1".into())));
        f.send("order-17", Ok(Some("tg-2".into())));
        f.send(
            "later-1",
            Err(SendError::retryable("http_429").retry_after(std::time::Duration::from_secs(3600))),
        );
        f.send("gone-1", Err(SendError::permanent("chat_not_found")));
        f.send("timeout-1", Err(SendError::ambiguous("read_timeout")));
        f
    }

    /// Two items sent or failed on 2026-01-15 and since moved to history by a
    /// compaction two days later (`old-sent`, ref tg-old; `old-failed`,
    /// `chat_not_found`), and one still queued (`old-queued`).
    pub fn aged() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::at("2026-01-15T09:00:00Z").unwrap();
        let outbox = Outbox::builder(dir.path())
            .clock(clock.clone())
            .sleeper(clock.clone())
            .open()
            .unwrap();
        let f = Self { dir, outbox };
        for (key, destination) in [
            ("old-sent", "chat-1"),
            ("old-failed", "chat-2"),
            ("old-queued", "chat-3"),
        ] {
            f.outbox.enqueue(message(key, destination)).unwrap();
        }
        f.send("old-sent", Ok(Some("tg-old".into())));
        f.send("old-failed", Err(SendError::permanent("chat_not_found")));
        clock.advance(std::time::Duration::from_secs(2 * 86_400));
        f.outbox.compact().unwrap();
        assert_eq!(f.outbox.history_len().unwrap(), 2, "moved to history");
        f
    }

    /// Processes `key` once with a `send` that answers `result`; panics if
    /// the outbox did not hand it to `send` (a fixture that silently leaves an
    /// item queued would not be the situation its tests describe).
    pub fn send(&self, key: &str, result: Result<Option<String>, SendError>) {
        let mut result = Some(result);
        let receipt = self
            .outbox
            .process(key, |_| result.take().expect("sent once"))
            .unwrap();
        assert!(
            result.is_none(),
            "the fixture's {key} was not handed to send: {receipt:?}"
        );
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn file(&self, name: &str) -> std::path::PathBuf {
        self.dir.path().join(name)
    }

    /// Runs `durable-outbox <command> <this dir> <rest…>`.
    pub fn run(&self, command: &str, rest: &[&str]) -> Run {
        let mut args: Vec<&OsStr> = vec![OsStr::new(command), self.path().as_os_str()];
        args.extend(rest.iter().map(OsStr::new));
        cli(args)
    }

    /// The item as the library now sees it.
    pub fn item(&self, key: &str) -> durable_outbox::OutboxItem {
        self.outbox.get(key).unwrap().expect("item exists")
    }

    /// The outcomes of `key`'s audit records, oldest first.
    pub fn outcomes(&self, key: &str) -> Vec<&'static str> {
        self.outbox
            .history(key)
            .unwrap()
            .iter()
            .map(|r| r.outcome.as_str())
            .collect()
    }
}
