//! One test body, run against each storage engine.
//!
//! [`on_both_engines!`] turns `fn name(engine) { … }` into a module `name`
//! with two tests, `name::file` (a fresh directory) and `name::postgres` (a
//! fresh database on the throwaway server this test process shares, see
//! `tests/support/postgres.rs`; feature `postgres`). The body sees an
//! [`EngineUnderTest`]: it opens handles with [`EngineUnderTest::open`] or
//! [`EngineUnderTest::open_with`] and never names the engine, so the same
//! assertions hold for both. Without a PostgreSQL server the `postgres` half
//! skips with a printed reason, except under `CI`, where it fails.

use durable_outbox::{ManualClock, Outbox, OutboxBuilder};

use std::sync::Arc;

use crate::harness::{Harness, START};

/// Which engine a body runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    #[cfg(feature = "postgres")]
    Postgres,
}

/// A fresh, empty outbox on one engine, and the manual clock its handles share.
pub struct EngineUnderTest {
    pub kind: Kind,
    pub clock: ManualClock,
    dir: Arc<tempfile::TempDir>,
    #[cfg(feature = "postgres")]
    db: Option<crate::pg_server::PgDatabase<'static>>,
}

impl EngineUnderTest {
    /// An outbox in a fresh directory.
    pub fn file() -> Self {
        Self {
            kind: Kind::File,
            clock: ManualClock::at(START).expect("start time"),
            dir: Arc::new(tempfile::tempdir().expect("temp dir")),
            #[cfg(feature = "postgres")]
            db: None,
        }
    }

    /// An outbox in a fresh database, or `None` (skipped, outside CI) without
    /// a PostgreSQL server.
    #[cfg(feature = "postgres")]
    pub fn postgres() -> Option<Self> {
        let server = crate::pg_server::PgServer::shared()?;
        Some(Self {
            kind: Kind::Postgres,
            clock: ManualClock::at(START).expect("start time"),
            dir: Arc::new(tempfile::tempdir().expect("temp dir")),
            db: Some(server.database()),
        })
    }

    /// A fresh, empty outbox on the same engine (a campaign's next round).
    #[cfg_attr(
        not(feature = "test-failpoints"),
        allow(dead_code, reason = "the process tests need test-failpoints")
    )]
    pub fn fresh(&self) -> Self {
        match self.kind {
            Kind::File => Self::file(),
            #[cfg(feature = "postgres")]
            Kind::Postgres => Self::postgres().expect("the server that served this engine"),
        }
    }

    /// A builder for another handle on this outbox, with the shared manual
    /// clock as clock and sleeper.
    pub fn builder(&self) -> OutboxBuilder {
        self.real_clock_builder()
            .clock(self.clock.clone())
            .sleeper(self.clock.clone())
    }

    /// A builder for a handle on this outbox with the crate's defaults: the
    /// system clock, and sleeps that take real time (the worker's waits).
    pub fn real_clock_builder(&self) -> OutboxBuilder {
        match self.kind {
            Kind::File => Outbox::builder(self.dir.path()),
            #[cfg(feature = "postgres")]
            Kind::Postgres => Outbox::postgres(&self.url()),
        }
    }

    /// Opens a handle on the system clock with extra builder settings.
    pub fn open_real_clock_with(
        &self,
        configure: impl FnOnce(OutboxBuilder) -> OutboxBuilder,
    ) -> Outbox {
        configure(self.real_clock_builder())
            .open()
            .unwrap_or_else(|e| panic!("open the {:?} outbox: {e}", self.kind))
    }

    /// Whether nothing has been written to this outbox yet: the directory is
    /// empty (file), the outbox's schema does not exist (PostgreSQL). A
    /// refused open must leave it so.
    pub fn is_untouched(&self) -> bool {
        match self.kind {
            Kind::File => std::fs::read_dir(self.dir.path())
                .expect("read the outbox directory")
                .next()
                .is_none(),
            #[cfg(feature = "postgres")]
            Kind::Postgres => {
                let db = self.db.as_ref().expect("a database");
                db.psql(
                    "SELECT count(*) FROM information_schema.schemata \
                     WHERE schema_name = 'durable_outbox'",
                ) == "0"
            }
        }
    }

    /// Where a child process (`outbox-test-worker`, the CLI) finds this
    /// outbox: the directory, or the PostgreSQL URL.
    #[cfg_attr(
        not(feature = "test-failpoints"),
        allow(dead_code, reason = "the process tests need test-failpoints")
    )]
    pub fn location(&self) -> String {
        match self.kind {
            Kind::File => self.dir.path().to_str().expect("a UTF-8 path").to_owned(),
            #[cfg(feature = "postgres")]
            Kind::Postgres => self.url(),
        }
    }

    /// Like [`location`](Self::location) for a child the test may kill: on
    /// PostgreSQL its sessions carry `name` as their application name, so
    /// [`await_child_gone`](Self::await_child_gone) can see them end.
    #[cfg_attr(
        not(feature = "test-failpoints"),
        allow(dead_code, reason = "the process tests need test-failpoints")
    )]
    pub fn child_location(&self, name: &str) -> String {
        match self.kind {
            // The directory names no process.
            Kind::File => {
                let _ = name;
                self.location()
            }
            #[cfg(feature = "postgres")]
            Kind::Postgres => format!("{}?application_name={name}", self.url()),
        }
    }

    /// After a child opened at [`child_location`](Self::child_location)`(name)`
    /// was killed: waits until its liveness token is free. File: the kernel
    /// releases the owner file's lock when the process dies, nothing to wait
    /// for. PostgreSQL: the server ends the child's sessions, and with them
    /// its owner lock, only once it notices the closed sockets.
    #[cfg_attr(
        not(feature = "test-failpoints"),
        allow(dead_code, reason = "the process tests need test-failpoints")
    )]
    pub fn await_child_gone(&self, name: &str) {
        match self.kind {
            Kind::File => {
                let _ = name;
            }
            #[cfg(feature = "postgres")]
            Kind::Postgres => {
                let db = self.db.as_ref().expect("a database");
                let deadline = std::time::Instant::now() + crate::harness::DEADLOCK_LIMIT;
                while db.psql(&format!(
                    "SELECT count(*) FROM pg_stat_activity \
                     WHERE datname = current_database() AND application_name = '{name}'"
                )) != "0"
                {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "the server still runs the killed child {name}'s sessions \
                         after {:?}",
                        crate::harness::DEADLOCK_LIMIT
                    );
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
            }
        }
    }

    /// Opens a handle (another "process" or "host" when called again).
    pub fn open(&self) -> Outbox {
        self.open_with(|b| b)
    }

    /// Opens a handle with extra builder settings.
    pub fn open_with(&self, configure: impl FnOnce(OutboxBuilder) -> OutboxBuilder) -> Outbox {
        configure(self.builder())
            .open()
            .unwrap_or_else(|e| panic!("open the {:?} outbox: {e}", self.kind))
    }

    /// A [`Harness`] around a fresh handle on this outbox.
    pub fn harness(&self) -> Harness {
        self.harness_with(|b| b)
    }

    /// A [`Harness`] around a fresh handle with extra builder settings; its
    /// `reopen` opens further handles on the same outbox.
    pub fn harness_with(&self, configure: impl FnOnce(OutboxBuilder) -> OutboxBuilder) -> Harness {
        let outbox = self.open_with(configure);
        let url = match self.kind {
            Kind::File => None,
            #[cfg(feature = "postgres")]
            Kind::Postgres => Some(self.url()),
        };
        Harness::on_engine(Arc::clone(&self.dir), self.clock.clone(), outbox, url)
    }

    /// Makes `key` (queued, unclaimed, committed) look as a handle killed
    /// inside `send` leaves it: claimed (attempt 1) by an owner whose liveness
    /// token nobody holds. File: the claim is written into a fresh
    /// `outbox.json`, and an unlocked owner file planted (what SIGKILL leaves).
    /// PostgreSQL: the row names an owner whose advisory lock is free (what a
    /// dead session leaves).
    pub fn forge_dead_claim(&self, key: &str) {
        const OWNER: &str = "4242-dead-0";
        const AT: &str = "2026-01-15T09:00:00.000000Z";
        match self.kind {
            Kind::File => {
                // Opening compacts: the snapshot then holds every item.
                drop(self.open());
                let path = self.dir.path().join("outbox.json");
                let text = std::fs::read_to_string(&path).expect("read outbox.json");
                let needle = format!("\"idempotency_key\": \"{key}\"");
                let at = text.find(&needle).expect("the item is in the snapshot");
                let (head, tail) = text.split_at(at);
                // The item's fields are sorted: `attempts` and
                // `dispatch_claimed` come before its key.
                let start = head.rfind('{').expect("the item's object");
                let (before, item) = head.split_at(start);
                let item = item
                    .replacen("\"attempts\": 0", "\"attempts\": 1", 1)
                    .replacen(
                        "\"dispatch_claimed\": false",
                        &format!(
                            "\"claim_owner\": \"{OWNER}\",\n      \"claimed_at_utc\": \"{AT}\",\n      \"dispatch_claimed\": true"
                        ),
                        1,
                    );
                std::fs::write(&path, format!("{before}{item}{tail}")).expect("write outbox.json");
                crate::harness::plant_dead_owner(self.dir.path(), OWNER);
            }
            #[cfg(feature = "postgres")]
            Kind::Postgres => {
                let db = self.db.as_ref().expect("a database");
                let updated = db.psql(&format!(
                    "UPDATE durable_outbox.items SET claimed = true, claim_owner = '{OWNER}',
                       revision = revision + 1,
                       doc = (doc::jsonb || '{{\"claim_owner\": \"{OWNER}\",
                         \"claimed_at_utc\": \"{AT}\", \"dispatch_claimed\": true,
                         \"attempts\": 1}}'::jsonb)::text
                     WHERE idempotency_key = '{key}' AND state = 'queued' AND NOT claimed
                     RETURNING idempotency_key"
                ));
                assert_eq!(updated, key, "forged the claim");
            }
        }
    }

    /// The database URL (PostgreSQL only).
    #[cfg(feature = "postgres")]
    pub fn url(&self) -> String {
        self.db
            .as_ref()
            .map(crate::pg_server::PgDatabase::url)
            .unwrap_or_default()
    }
}

/// `on_both_engines! { fn name(engine) { body } … }`: each body as the tests
/// `name::file` and `name::postgres`. Attributes (docs, `allow`) go on the
/// module `name`.
macro_rules! on_both_engines {
    ($( $(#[$meta:meta])* fn $name:ident($engine:ident) $body:block )*) => {
        $(
            $(#[$meta])*
            mod $name {
                #[allow(unused_imports)]
                use super::*;

                fn body($engine: &$crate::engines::EngineUnderTest) $body

                #[test]
                fn file() {
                    body(&$crate::engines::EngineUnderTest::file());
                }

                #[cfg(feature = "postgres")]
                #[test]
                fn postgres() {
                    if let Some(engine) = $crate::engines::EngineUnderTest::postgres() {
                        body(&engine);
                    }
                }
            }
        )*
    };
}

pub(crate) use on_both_engines;
