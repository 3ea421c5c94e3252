//! A throwaway Synapse homeserver for tests that need a real Matrix server.
//!
//! - Synapse is installed from `PyPI` into a virtualenv under the target directory
//!   by `scripts/synapse-venv.sh` (pinned version; a marker file makes reruns
//!   instant; a lock file keeps two test processes from installing at once).
//! - Each server gets a temp dir with a generated config: `SQLite`, 127.0.0.1 on a
//!   free port, no federation, a `registration_shared_secret`, login/join/invite
//!   limits raised out of the way, and the test's own `rc_message`.
//! - The server runs in its own process group under a `sh` watchdog that reads
//!   its stdin: when the test process ends in any way, the pipe closes and the
//!   watchdog kills Synapse. `stop` and `Drop` kill the whole group by its id.
//! - Without python3 or venv the harness says what to install; when `CI` is set
//!   that is a test failure, never a silent pass.

#![allow(dead_code, reason = "each test uses part of the harness")]

use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// The server's message limiter, `rc_message`.
#[derive(Debug, Clone, Copy)]
pub struct MessageLimit {
    /// Sustained messages per second per user.
    pub per_second: f64,
    /// Messages allowed at once before the rate applies.
    pub burst_count: u32,
}

/// The limit the issue measured against: 0.5 messages a second after a burst of 3.
pub const ISSUE_LIMIT: MessageLimit = MessageLimit {
    per_second: 0.5,
    burst_count: 3,
};

/// A registered user and a token for the harness's own requests (the code
/// under test logs in by itself with the password).
#[derive(Debug, Clone)]
pub struct Account {
    pub localpart: String,
    pub user_id: String,
    pub password: String,
    pub token: String,
}

/// A running (or stopped) Synapse.
pub struct Synapse {
    dir: tempfile::TempDir,
    port: u16,
    python: PathBuf,
    secret: String,
    /// The watchdog shell (leader of the server's process group), while running.
    child: Mutex<Option<Child>>,
    admin: Option<Account>,
}

/// The tests' shared server: started once per test binary, killed by its
/// watchdog when the binary exits.
static SHARED: tokio::sync::OnceCell<Option<Synapse>> = tokio::sync::OnceCell::const_new();

/// Either skip (returning `None`, with the reason printed) or, in CI, fail.
fn unavailable(reason: &str) -> Option<Synapse> {
    assert!(
        std::env::var_os("CI").is_none(),
        "a real Synapse is required in CI: {reason}"
    );
    eprintln!("skipped: no real Synapse: {reason}");
    None
}

impl Synapse {
    /// The shared server (message limiter [`ISSUE_LIMIT`]); `None` when it
    /// cannot run here and `CI` is not set.
    pub async fn shared() -> Option<&'static Self> {
        SHARED
            .get_or_init(|| async { Self::start(ISSUE_LIMIT).await })
            .await
            .as_ref()
    }

    /// Installs Synapse if needed and starts a fresh server with `rc_message`.
    pub async fn start(limit: MessageLimit) -> Option<Self> {
        let python = match tokio::task::spawn_blocking(install).await.unwrap() {
            Ok(python) => python,
            Err(reason) => return unavailable(&reason),
        };
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let secret = hex::encode(random_bytes());
        write_config(dir.path(), port, &secret, limit);
        let mut server = Self {
            dir,
            port,
            python,
            secret,
            child: Mutex::new(None),
            admin: None,
        };
        server.spawn().await;
        server.admin = Some(server.register_raw("admin", true).await);
        Some(server)
    }

    /// The client-server API base URL.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The server's combined stdout/stderr log.
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("synapse.log")
    }

    /// Kills the server's process group and waits for it.
    pub fn stop(&self) {
        let Some(mut child) = self.child.lock().unwrap().take() else {
            return;
        };
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", child.id())])
            .status();
        let _ = child.kill();
        let _ = child.wait();
        // The port is free once the listener is gone.
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
            assert!(
                Instant::now() < deadline,
                "synapse still listening after kill"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Starts the stopped server again on the same port and database.
    pub async fn restart(&self) {
        self.spawn().await;
    }

    async fn spawn(&self) {
        let log = std::fs::File::create(self.log_path()).unwrap();
        let child = Command::new("sh")
            .arg("-c")
            // The server dies with the test process: `read` returns at EOF.
            .arg(r#""$1" -m synapse.app.homeserver -c "$2" & pid=$!; read -r _; kill -KILL "$pid""#)
            .arg("synapse-watchdog")
            .arg(&self.python)
            .arg(self.dir.path().join("homeserver.yaml"))
            .current_dir(self.dir.path())
            .stdin(Stdio::piped())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .process_group(0)
            .spawn()
            .unwrap();
        *self.child.lock().unwrap() = Some(child);
        let http = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            if let Ok(r) = http.get(format!("{}/health", self.url())).send().await
                && r.status().is_success()
            {
                return;
            }
            if Instant::now() > deadline {
                let log = std::fs::read_to_string(self.log_path()).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(30).collect();
                panic!(
                    "synapse did not become healthy in 90 s; log tail:\n{}",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Registers `@{prefix}-{random}:localhost`. `unlimited` lifts the message
    /// limiter for this user (Synapse's per-user override); otherwise the
    /// server's `rc_message` applies.
    pub async fn user(&self, prefix: &str, unlimited: bool) -> Account {
        let localpart = format!("{prefix}-{}", &hex::encode(random_bytes())[..8]);
        let account = self.register_raw(&localpart, false).await;
        if unlimited {
            let admin = self.admin.as_ref().unwrap();
            let url = format!(
                "{}/_synapse/admin/v1/users/{}/override_ratelimit",
                self.url(),
                account.user_id
            );
            call(
                reqwest::Client::new()
                    .post(url)
                    .bearer_auth(&admin.token)
                    .json(&json!({"messages_per_second": 0, "burst_count": 0})),
            )
            .await;
        }
        account
    }

    /// Shared-secret registration (HMAC-SHA1 over nonce, user, password, admin flag).
    async fn register_raw(&self, localpart: &str, admin: bool) -> Account {
        let http = reqwest::Client::new();
        let url = format!("{}/_synapse/admin/v1/register", self.url());
        let nonce = call(http.get(&url)).await["nonce"]
            .as_str()
            .unwrap()
            .to_owned();
        let password = hex::encode(random_bytes());
        let mut text = Vec::new();
        for part in [
            nonce.as_str(),
            localpart,
            &password,
            if admin { "admin" } else { "notadmin" },
        ] {
            if !text.is_empty() {
                text.push(0);
            }
            text.extend_from_slice(part.as_bytes());
        }
        let mac = hmac_sha1(&self.python, self.secret.as_bytes(), &text);
        let answer = call(http.post(&url).json(&json!({
            "nonce": nonce,
            "username": localpart,
            "password": password,
            "admin": admin,
            "mac": mac,
        })))
        .await;
        Account {
            localpart: localpart.to_owned(),
            user_id: answer["user_id"].as_str().unwrap().to_owned(),
            password,
            token: answer["access_token"].as_str().unwrap().to_owned(),
        }
    }

    /// A fresh private room created by `owner` (who must be unlimited: room
    /// creation counts against the message limiter) with `bot` joined.
    pub async fn room(&self, owner: &Account, bot: &Account) -> String {
        let http = reqwest::Client::new();
        let created = call(
            http.post(format!("{}/_matrix/client/v3/createRoom", self.url()))
                .bearer_auth(&owner.token)
                .json(&json!({"preset": "private_chat", "invite": [bot.user_id]})),
        )
        .await;
        let room = created["room_id"].as_str().unwrap().to_owned();
        call(
            http.post(format!(
                "{}/_matrix/client/v3/join/{}",
                self.url(),
                encode(&room)
            ))
            .bearer_auth(&bot.token)
            .json(&json!({})),
        )
        .await;
        room
    }

    /// Every `m.room.message` in the room, oldest first (`/messages`, forwards).
    pub async fn messages(&self, reader: &Account, room: &str) -> Vec<Value> {
        let http = reqwest::Client::new();
        let mut from: Option<String> = None;
        let mut events = Vec::new();
        loop {
            let mut url = format!(
                "{}/_matrix/client/v3/rooms/{}/messages?dir=f&limit=500",
                self.url(),
                encode(room)
            );
            if let Some(from) = &from {
                url.push_str("&from=");
                url.push_str(&encode(from));
            }
            let page = call(http.get(url).bearer_auth(&reader.token)).await;
            let chunk = page["chunk"].as_array().cloned().unwrap_or_default();
            events.extend(
                chunk
                    .iter()
                    .filter(|e| e["type"] == "m.room.message")
                    .cloned(),
            );
            match page["end"].as_str() {
                Some(end) if !chunk.is_empty() => from = Some(end.to_owned()),
                _ => return events,
            }
        }
    }

    /// `author` replies to `event_id` in `room`; returns the reply's event id.
    pub async fn reply(&self, author: &Account, room: &str, event_id: &str, text: &str) -> String {
        let url = format!(
            "{}/_matrix/client/v3/rooms/{}/send/m.room.message/{}",
            self.url(),
            encode(room),
            hex::encode(random_bytes())
        );
        let answer = call(
            reqwest::Client::new()
                .put(url)
                .bearer_auth(&author.token)
                .json(&json!({
                    "msgtype": "m.text",
                    "body": text,
                    "m.relates_to": {"m.in_reply_to": {"event_id": event_id}},
                })),
        )
        .await;
        answer["event_id"].as_str().unwrap().to_owned()
    }
}

impl Drop for Synapse {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One harness request that must succeed; its JSON answer.
async fn call(request: reqwest::RequestBuilder) -> Value {
    let response = request.send().await.unwrap();
    let status = response.status();
    let answer: Value = response.json().await.unwrap_or(Value::Null);
    assert!(status.is_success(), "synapse answered {status}: {answer}");
    answer
}

/// Runs `scripts/synapse-venv.sh` under a lock; returns the venv's python.
fn install() -> Result<PathBuf, String> {
    let target = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .unwrap()
        .join("synapse");
    std::fs::create_dir_all(&target).map_err(|e| format!("{}: {e}", target.display()))?;
    let lock = std::fs::File::create(target.join("install.lock")).unwrap();
    lock.lock().unwrap();
    let venv = target.join("venv");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/synapse-venv.sh");
    let out = Command::new("sh")
        .arg(&script)
        .arg(&venv)
        .output()
        .map_err(|e| format!("cannot run sh {}: {e}", script.display()))?;
    if !out.status.success() {
        return Err(format!(
            "installing Synapse failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(venv.join("bin/python"))
}

fn write_config(dir: &Path, port: u16, secret: &str, limit: MessageLimit) {
    let d = dir.display();
    let raised = "{per_second: 1000, burst_count: 1000}";
    let config = format!(
        "server_name: localhost
pid_file: {d}/homeserver.pid
listeners:
  - port: {port}
    bind_addresses: ['127.0.0.1']
    type: http
    tls: false
    x_forwarded: false
    resources:
      - names: [client]
        compress: false
database:
  name: sqlite3
  args:
    database: {d}/homeserver.db
media_store_path: {d}/media
signing_key_path: {d}/signing.key
report_stats: false
enable_metrics: false
registration_shared_secret: \"{secret}\"
macaroon_secret_key: \"{secret}-macaroon\"
form_secret: \"{secret}-form\"
trusted_key_servers: []
suppress_key_server_warning: true
federation_domain_whitelist: []
rc_message: {{per_second: {per_second}, burst_count: {burst}}}
rc_login:
  address: {raised}
  account: {raised}
  failed_attempts: {raised}
rc_registration: {raised}
rc_joins:
  local: {raised}
  remote: {raised}
rc_invites:
  per_room: {raised}
  per_user: {raised}
",
        per_second = limit.per_second,
        burst = limit.burst_count,
    );
    std::fs::write(dir.join("homeserver.yaml"), config).unwrap();
    // A signing key, so the server does not spend seconds generating one:
    // `ed25519 <version> <unpadded base64 of a 32-byte seed>`.
    std::fs::write(
        dir.join("signing.key"),
        format!("ed25519 a_test {}\n", base64_unpadded(&random_bytes())),
    )
    .unwrap();
}

/// HMAC-SHA1 via the venv's Python (stdlib only; the message has NUL bytes,
/// so it goes through stdin).
fn hmac_sha1(python: &Path, key: &[u8], message: &[u8]) -> String {
    let mut child = Command::new(python)
        .arg("-c")
        .arg(
            "import hmac,hashlib,sys; \
             print(hmac.new(bytes.fromhex(sys.argv[1]), sys.stdin.buffer.read(), hashlib.sha1).hexdigest())",
        )
        .arg(hex::encode(key))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(message).unwrap();
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert!(child.wait().unwrap().success());
    out.trim().to_owned()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// 32 unpredictable-enough bytes for secrets and names in a throwaway server.
fn random_bytes() -> [u8; 32] {
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .unwrap()
        .read_exact(&mut bytes)
        .unwrap();
    bytes
}

fn base64_unpadded(bytes: &[u8]) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            out.push(char::from(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]));
        }
    }
    out
}

/// Percent-encodes a path or query component.
pub fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}
