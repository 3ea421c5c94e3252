//! A loopback chat platform that behaves like Telegram's Bot API where it matters
//! to an outbox, shared by `examples/telegram_like.rs` and `tests/it/http_loopback.rs`.
//!
//! - `POST /bot<token>/sendMessage` with `{"chat_id": …, "text": …}` answers
//!   `{"ok":true,"result":{"message_id":N}}` and records the delivery.
//! - A chat sent to again less than `min_gap` after its last accepted message gets
//!   HTTP 429 `{"ok":false,"error_code":429,"parameters":{"retry_after":S}}`. A
//!   request that arrives while the chat is still under a 429 it was told about
//!   is recorded as a violation: the client did not honour Retry-After.
//! - Chats named `slow-…` accept the message, then take `slow_for` to answer: a
//!   client with a shorter timeout cannot know it was delivered.
//! - Chats named `gone-…` answer 400 `chat not found`.
//! - `GET /replies` lists one user reply per delivered message, quoting its id
//!   (`reply_to_message_id`), as a bot's update stream would.
//!
//! The HTTP/1.1 handling is deliberately minimal: one request per connection,
//! `Content-Length` bodies, `Connection: close`.

#![allow(dead_code, reason = "the example and the test each use part of it")]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// One message the platform accepted.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub message_id: u64,
    pub chat_id: String,
    pub text: String,
}

#[derive(Debug, Default)]
struct Inner {
    next_id: u64,
    deliveries: Vec<Delivery>,
    last_accepted: HashMap<String, Instant>,
    /// Per chat, the moment until which it was told to wait.
    blocked_until: HashMap<String, Instant>,
    violations: Vec<String>,
    requests: HashMap<String, usize>,
    rate_limited: usize,
}

/// A running fake platform on 127.0.0.1.
#[derive(Clone)]
pub struct FakePlatform {
    pub addr: SocketAddr,
    inner: Arc<Mutex<Inner>>,
}

/// How the fake platform behaves.
#[derive(Debug, Clone, Copy)]
pub struct Behaviour {
    /// The least time between two accepted messages to one chat.
    pub min_gap: Duration,
    /// The Retry-After a 429 announces, in whole seconds.
    pub retry_after_secs: u64,
    /// How long `slow-…` chats take to answer.
    pub slow_for: Duration,
}

impl Default for Behaviour {
    fn default() -> Self {
        Self {
            min_gap: Duration::from_secs(1),
            retry_after_secs: 1,
            slow_for: Duration::from_millis(1500),
        }
    }
}

impl FakePlatform {
    /// Starts the platform on an ephemeral loopback port.
    pub async fn start(behaviour: Behaviour) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let platform = Self {
            addr: listener.local_addr()?,
            inner: Arc::new(Mutex::new(Inner::default())),
        };
        let serving = platform.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let platform = serving.clone();
                tokio::spawn(async move {
                    let _ = platform.serve(stream, behaviour).await;
                });
            }
        });
        Ok(platform)
    }

    /// The base URL, e.g. `http://127.0.0.1:41234`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every accepted message, in order.
    pub fn deliveries(&self) -> Vec<Delivery> {
        self.lock().deliveries.clone()
    }

    /// Requests that ignored a Retry-After.
    pub fn violations(&self) -> Vec<String> {
        self.lock().violations.clone()
    }

    /// How many sendMessage requests each chat received.
    pub fn requests(&self) -> HashMap<String, usize> {
        self.lock().requests.clone()
    }

    /// How many 429s were answered.
    pub fn rate_limited(&self) -> usize {
        self.lock().rate_limited
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    async fn serve(&self, mut stream: TcpStream, behaviour: Behaviour) -> std::io::Result<()> {
        let (method, path, body) = read_request(&mut stream).await?;
        let (status, reply) = if method == "GET" && path == "/replies" {
            (200, self.replies())
        } else if method == "POST" && path.ends_with("/sendMessage") {
            self.send_message(&body, behaviour).await
        } else {
            (
                404,
                r#"{"ok":false,"error_code":404,"description":"Not Found"}"#.to_owned(),
            )
        };
        let response = format!(
            "HTTP/1.1 {status} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{reply}",
            if status == 200 { "OK" } else { "Error" },
            reply.len()
        );
        stream.write_all(response.as_bytes()).await?;
        stream.shutdown().await
    }

    async fn send_message(&self, body: &[u8], behaviour: Behaviour) -> (u16, String) {
        let Ok(request) = serde_json::from_slice::<serde_json::Value>(body) else {
            return (
                400,
                r#"{"ok":false,"error_code":400,"description":"Bad Request: invalid JSON"}"#
                    .to_owned(),
            );
        };
        let chat = request["chat_id"].as_str().unwrap_or_default().to_owned();
        let text = request["text"].as_str().unwrap_or_default().to_owned();
        let accepted = {
            let mut inner = self.lock();
            *inner.requests.entry(chat.clone()).or_default() += 1;
            let now = Instant::now();
            if let Some(until) = inner.blocked_until.get(&chat)
                && now < *until
            {
                let early = until.duration_since(now);
                inner
                    .violations
                    .push(format!("{chat}: request {early:?} before its Retry-After"));
            }
            if chat.starts_with("gone-") {
                None
            } else if inner
                .last_accepted
                .get(&chat)
                .is_some_and(|last| now.duration_since(*last) < behaviour.min_gap)
            {
                inner.rate_limited += 1;
                inner.blocked_until.insert(
                    chat.clone(),
                    now + Duration::from_secs(behaviour.retry_after_secs),
                );
                return (
                    429,
                    format!(
                        r#"{{"ok":false,"error_code":429,"description":"Too Many Requests: retry after {0}","parameters":{{"retry_after":{0}}}}}"#,
                        behaviour.retry_after_secs
                    ),
                );
            } else {
                inner.next_id += 1;
                let message_id = inner.next_id;
                inner.last_accepted.insert(chat.clone(), now);
                inner.deliveries.push(Delivery {
                    message_id,
                    chat_id: chat.clone(),
                    text,
                });
                Some(message_id)
            }
        };
        let Some(message_id) = accepted else {
            return (
                400,
                r#"{"ok":false,"error_code":400,"description":"Bad Request: chat not found"}"#
                    .to_owned(),
            );
        };
        if chat.starts_with("slow-") {
            tokio::time::sleep(behaviour.slow_for).await;
        }
        (
            200,
            format!(r#"{{"ok":true,"result":{{"message_id":{message_id}}}}}"#),
        )
    }

    fn replies(&self) -> String {
        let inner = self.lock();
        let replies: Vec<serde_json::Value> = inner
            .deliveries
            .iter()
            .map(|d| {
                serde_json::json!({
                    "chat_id": d.chat_id,
                    "text": format!("thanks for message {}", d.message_id),
                    "reply_to_message_id": d.message_id,
                })
            })
            .collect();
        serde_json::json!({ "ok": true, "result": replies }).to_string()
    }
}

/// Reads one HTTP/1.1 request: method, path, body.
async fn read_request(stream: &mut TcpStream) -> std::io::Result<(String, String, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let header_end = loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break end + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..header_end]).into_owned();
    let mut lines = head.lines();
    let mut request_line = lines.next().unwrap_or_default().split_whitespace();
    let method = request_line.next().unwrap_or_default().to_owned();
    let path = request_line.next().unwrap_or_default().to_owned();
    let length = lines
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    let mut body = buf[header_end..].to_vec();
    while body.len() < length {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    Ok((method, path, body))
}
