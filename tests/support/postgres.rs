//! A throwaway PostgreSQL server for tests.
//!
//! [`PgServer::start`] runs `initdb` into a temporary directory (as the
//! `postgres` user when the tests run as root: the server refuses to run as
//! root), then `pg_ctl start` on a free loopback port with its socket in that
//! directory. Each test takes a fresh database from it ([`PgServer::database`]).
//! The server is stopped when the guard drops, on success and on panic alike;
//! a watchdog process also stops it if the test process is killed outright.
//!
//! Missing server binaries fail the test when `CI` is set (CI installs Debian's
//! `postgresql`, see `.ci/run`); elsewhere the test is skipped with a printed reason.
//!
//! This file is shared: the library's unit tests include it with `#[path]`, and
//! so does the integration suite.

#![allow(
    dead_code,
    reason = "each test binary uses a different part of the harness"
)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// Where the server binaries are: `$PG_BIN`, else the newest
/// `/usr/lib/postgresql/<v>/bin` (Debian's layout), else `initdb` on `PATH`.
fn bin_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("PG_BIN") {
        return Some(PathBuf::from(dir));
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = entry.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return Some(bin);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .find(|dir| dir.join("initdb").exists() && dir.join("pg_ctl").exists())
}

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| out.stdout.trim_ascii() == b"0")
}

/// The reason the server cannot run here, or `None` when it can.
fn unavailable() -> Option<String> {
    let Some(bin) = bin_dir() else {
        return Some("no initdb/pg_ctl (apt-get install postgresql)".into());
    };
    if !bin.join("pg_ctl").exists() {
        return Some(format!("{} has no pg_ctl", bin.display()));
    }
    None
}

/// Whether tests needing the server can run. `false` means the caller returns
/// (skips) — possible only outside CI: under `CI` a missing server panics.
pub fn available() -> bool {
    match unavailable() {
        None => true,
        Some(why) => {
            assert!(
                std::env::var_os("CI").is_none(),
                "PostgreSQL is required in CI and is missing: {why}; .ci/run installs it"
            );
            eprintln!("SKIPPED: PostgreSQL is not available here ({why}); CI would fail");
            false
        }
    }
}

/// A running throwaway server; stopped on drop.
pub struct PgServer {
    bin: PathBuf,
    /// Holds the data directory and the socket; removed after the server stops.
    root: tempfile::TempDir,
    data: PathBuf,
    port: u16,
    as_postgres: bool,
    watchdog: Option<std::process::Child>,
}

static DATABASES: AtomicU64 = AtomicU64::new(0);

impl PgServer {
    /// Initialises and starts a new server, or `None` (after printing why) when
    /// PostgreSQL is not installed and `CI` is not set.
    ///
    /// # Panics
    /// When `initdb` or `pg_ctl start` fails, with the server's log.
    pub fn start() -> Option<Self> {
        if !available() {
            return None;
        }
        let bin = bin_dir()?;
        let as_postgres = running_as_root();
        let root = tempfile::Builder::new()
            .prefix("outbox-pg-")
            .tempdir()
            .expect("temp dir for the test server");
        let data = root.path().join("data");
        if as_postgres {
            // The server runs as `postgres`: give it the directory.
            let status = Command::new("chown")
                .arg("postgres:postgres")
                .arg(root.path())
                .status()
                .expect("chown the test server's directory");
            assert!(status.success(), "chown postgres {}", root.path().display());
        }
        let mut server = Self {
            bin,
            root,
            data,
            port: 0,
            as_postgres,
            watchdog: None,
        };
        // From here on the directory is the watchdog's to clean up if this
        // process dies, whatever step it dies in.
        server.watchdog = Some(server.spawn_watchdog());
        let init = server
            .command("initdb")
            .arg("-D")
            .arg(&server.data)
            .args(["-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync"])
            .output()
            .expect("run initdb");
        assert!(
            init.status.success(),
            "initdb failed: {}{}",
            String::from_utf8_lossy(&init.stdout),
            String::from_utf8_lossy(&init.stderr)
        );
        // A port is free when we look; another test process may take it before
        // the server binds, so a failed start tries another one.
        let mut last = String::new();
        for _ in 0..5 {
            server.port = free_port();
            if server.pg_ctl_start() {
                return Some(server);
            }
            last = server.log();
        }
        panic!("pg_ctl start failed five times; server log:\n{last}");
    }

    /// A server shared by every test of this process (started once). It is
    /// stopped by its watchdog when the process exits.
    pub fn shared() -> Option<&'static Self> {
        static SHARED: OnceLock<Option<PgServer>> = OnceLock::new();
        SHARED.get_or_init(Self::start).as_ref()
    }

    fn command(&self, tool: &str) -> Command {
        let program = self.bin.join(tool);
        let mut command = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(program);
            c
        } else {
            Command::new(program)
        };
        command.stdin(Stdio::null());
        command
    }

    fn log_path(&self) -> PathBuf {
        self.root.path().join("server.log")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    fn pg_ctl_start(&self) -> bool {
        let options = format!(
            "-k {} -p {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200",
            self.root.path().display(),
            self.port
        );
        self.command("pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .arg("-l")
            .arg(self.log_path())
            .args(["-w", "-t", "60", "-o", &options, "start"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// A process that stops the server and removes its directory once this
    /// test process is gone, however it went (a SIGKILL, an abort, a `timeout`
    /// killing the whole process group): `Drop` does not run then, and a
    /// shared server (a static) is never dropped at all. It runs in its own
    /// process group and ignores the signals a group kill sends.
    fn spawn_watchdog(&self) -> std::process::Child {
        use std::os::unix::process::CommandExt;
        let script = format!(
            "trap '' HUP INT TERM; while kill -0 {pid} 2>/dev/null; do sleep 1; done; \
             for f in '{root}'/bouncer-*/pgbouncer.pid; do [ -f \"$f\" ] && kill \"$(cat \"$f\")\"; done; \
             {ctl}; rm -rf '{root}'",
            pid = std::process::id(),
            ctl = self.stop_command_line(),
            root = self.root.path().display(),
        );
        Command::new("sh")
            .args(["-c", &script])
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the test server's watchdog")
    }

    fn stop_command_line(&self) -> String {
        let ctl = self.bin.join("pg_ctl");
        let prefix = if self.as_postgres {
            "runuser -u postgres -- "
        } else {
            ""
        };
        format!(
            "{prefix}'{}' -D '{}' -m immediate -w stop >/dev/null 2>&1",
            ctl.display(),
            self.data.display()
        )
    }

    /// The loopback port the server listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A URL for database `db`.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// A fresh, empty database for one test; dropped with the guard.
    pub fn database(&self) -> PgDatabase<'_> {
        let name = format!(
            "t_{}_{}",
            std::process::id(),
            DATABASES.fetch_add(1, Ordering::Relaxed)
        );
        self.psql("postgres", &format!("CREATE DATABASE {name}"));
        PgDatabase { server: self, name }
    }

    /// Runs one SQL statement with `psql` against `db`; panics on failure.
    pub fn psql(&self, db: &str, sql: &str) -> String {
        let out = Command::new(self.bin.join("psql"))
            .args([
                "-X",
                "-q",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-h",
                "127.0.0.1",
            ])
            .args([
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
                "-d",
                db,
                "-c",
                sql,
            ])
            .stdin(Stdio::null())
            .output()
            .expect("run psql");
        assert!(
            out.status.success(),
            "psql {sql:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// Stops the server at once, as a crash would (`pg_ctl stop -m immediate`).
    pub fn crash(&self) {
        let status = self
            .command("pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .args(["-m", "immediate", "-w", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("run pg_ctl stop");
        assert!(status.success(), "pg_ctl stop failed:\n{}", self.log());
    }

    /// Starts the server again on the same port after [`crash`](Self::crash).
    pub fn restart(&self) {
        assert!(
            self.pg_ctl_start(),
            "pg_ctl restart failed:\n{}",
            self.log()
        );
    }

    /// Makes the WAL writer wait 10 s between flushes (and never flush for
    /// volume), so a commit that does not flush its own WAL stays unflushed
    /// for the length of a test: what a crash then takes back shows it.
    pub fn delay_the_wal_writer(&self) {
        self.psql("postgres", "ALTER SYSTEM SET wal_writer_delay = '10s'");
        self.psql(
            "postgres",
            "ALTER SYSTEM SET wal_writer_flush_after = '1GB'",
        );
        self.psql("postgres", "SELECT pg_reload_conf()");
    }

    /// The data directory (for diagnostics).
    pub fn data_dir(&self) -> &Path {
        &self.data
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let _ = Command::new("sh")
            .args(["-c", &self.stop_command_line()])
            .status();
        if let Some(mut watchdog) = self.watchdog.take() {
            let _ = watchdog.kill();
            let _ = watchdog.wait();
        }
    }
}

/// One test's database; dropped (connections forced out) with the guard.
pub struct PgDatabase<'a> {
    server: &'a PgServer,
    name: String,
}

impl PgDatabase<'_> {
    /// The database's URL.
    pub fn url(&self) -> String {
        self.server.url(&self.name)
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The server it lives on.
    pub fn server(&self) -> &PgServer {
        self.server
    }

    /// Runs one SQL statement with `psql` in this database.
    pub fn psql(&self, sql: &str) -> String {
        self.server.psql(&self.name, sql)
    }
}

impl Drop for PgDatabase<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // Keep it for a post-mortem while the server lives; the server goes anyway.
            return;
        }
        let _ = Command::new(self.server.bin.join("psql"))
            .args([
                "-X",
                "-q",
                "-h",
                "127.0.0.1",
                "-p",
                &self.server.port.to_string(),
            ])
            .args(["-U", "postgres", "-d", "postgres", "-c"])
            .arg(format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// A `pgbouncer` in front of a [`PgServer`]; stopped on drop.
pub struct PgBouncer<'a> {
    server: &'a PgServer,
    dir: PathBuf,
    port: u16,
}

impl PgServer {
    /// Starts `pgbouncer` with `pool_mode` (`session` or `transaction`) in front
    /// of this server, or `None` (after printing why) when it is not installed
    /// and `CI` is not set.
    ///
    /// # Panics
    /// When it is missing under `CI`, or does not start.
    pub fn pgbouncer(&self, pool_mode: &str) -> Option<PgBouncer<'_>> {
        let Some(program) = ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
        else {
            assert!(
                std::env::var_os("CI").is_none(),
                "pgbouncer is required in CI and is missing; .ci/run installs it"
            );
            eprintln!("SKIPPED: pgbouncer is not available here; CI would fail");
            return None;
        };
        let dir = self.root.path().join(format!(
            "bouncer-{}",
            DATABASES.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir(&dir).expect("pgbouncer dir");
        std::fs::write(dir.join("users.txt"), "\"postgres\" \"\"\n").expect("pgbouncer users");
        let mut last = String::new();
        for _ in 0..5 {
            let port = free_port();
            let ini = format!(
                "[databases]\n* = host=127.0.0.1 port={server}\n\n[pgbouncer]\n\
                 listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n\
                 auth_type = trust\nauth_file = {dir}/users.txt\npool_mode = {pool_mode}\n\
                 default_pool_size = 4\npidfile = {dir}/pgbouncer.pid\n\
                 logfile = {dir}/pgbouncer.log\n",
                server = self.port,
                dir = dir.display(),
            );
            std::fs::write(dir.join("pgbouncer.ini"), ini).expect("pgbouncer.ini");
            if self.as_postgres {
                let status = Command::new("chown")
                    .args(["-R", "postgres:postgres"])
                    .arg(&dir)
                    .status()
                    .expect("chown the pgbouncer dir");
                assert!(status.success());
            }
            let mut command = if self.as_postgres {
                let mut c = Command::new("runuser");
                c.args(["-u", "postgres", "--"]).arg(&program);
                c
            } else {
                Command::new(&program)
            };
            let status = command
                .arg("-d")
                .arg(dir.join("pgbouncer.ini"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .expect("run pgbouncer");
            let bouncer = PgBouncer {
                server: self,
                dir: dir.clone(),
                port,
            };
            if status.success() && bouncer.wait_until_listening() {
                return Some(bouncer);
            }
            last = std::fs::read_to_string(dir.join("pgbouncer.log")).unwrap_or_default();
        }
        panic!("pgbouncer did not start five times; its log:\n{last}");
    }
}

impl PgBouncer<'_> {
    fn wait_until_listening(&self) -> bool {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while std::time::Instant::now() < deadline {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        false
    }

    /// A URL for database `db` through the pooler.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }
}

impl Drop for PgBouncer<'_> {
    fn drop(&mut self) {
        if let Ok(pid) = std::fs::read_to_string(self.dir.join("pgbouncer.pid")) {
            let _ = Command::new("kill").arg(pid.trim()).status();
        }
        let _ = self.server;
    }
}
