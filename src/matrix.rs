//! A Matrix transport (feature `matrix`): log in once with a fixed device,
//! send each item with its stable transaction id, classify every failure, and
//! read the replies that quote a sent message.
//!
//! The classification is the part an outbox depends on; only the transport
//! knows whether its request was written:
//!
//! | what happened | class | why |
//! |---|---|---|
//! | connection refused, DNS failure, connect timeout | retryable | no byte of the request left |
//! | `429 M_LIMIT_EXCEEDED` | retryable, with `retry_after` from `retry_after_ms` (else the `Retry-After` header) | the server refused before processing |
//! | `401`, `403 M_FORBIDDEN`, `404`, any other `4xx` | permanent | the server refused and will again (unknown room, not a member, bad token, too large) |
//! | a timeout after the request was written, a reset, an unreadable `200` | ambiguous | the event may exist |
//! | any `5xx` | ambiguous | a proxy's `502`/`504` or Synapse's own `500` can come after the event was persisted |
//!
//! Every `5xx` is ambiguous, not retryable, because nothing in the answer says
//! whether the event was persisted. That costs nothing when the outbox is told
//! that this connector is idempotent
//! ([`OutboxBuilder::idempotent_transport`](crate::OutboxBuilder::idempotent_transport)):
//! the item is resent with the same `txnId`, and the homeserver answers a
//! repeat with the first event's id instead of creating a second event.
//! Synapse scopes that deduplication to the user *and* the device, which is why
//! [`MatrixClient::login`] takes a fixed `device_id`: log in again with the
//! same one (or reuse the [`MatrixSession`]) and the dedup survives restarts.
//!
//! TLS: the client is built without a TLS backend, so it speaks plain HTTP
//! (a homeserver on loopback, or behind a local proxy). For `https://`,
//! enable a TLS feature of `reqwest` in your own `Cargo.toml` (for example
//! `reqwest = { version = "0.13", features = ["rustls"] }`; Cargo unifies
//! features) or pass your own client to [`MatrixClient::with_http`].

use std::fmt::{self, Write as _};
use std::time::Duration;

use serde_json::Value;

use crate::error::{Error, Result};
use crate::item::OutboxItem;
use crate::send::SendError;

/// How long one send may take before its outcome is treated as ambiguous.
const SEND_TIMEOUT: Duration = Duration::from_secs(30);

/// A logged-in Matrix identity: who, on which device, with which token.
/// Store it and pass it to [`MatrixClient::from_session`] to avoid logging in
/// on every start (Synapse limits logins, `rc_login`).
#[derive(Clone, PartialEq, Eq)]
pub struct MatrixSession {
    /// The full user id, e.g. `@bot:example.org`.
    pub user_id: String,
    /// The device the token belongs to; transaction ids are deduplicated per device.
    pub device_id: String,
    /// The access token (a secret: `Debug` does not print it).
    pub access_token: String,
}

impl fmt::Debug for MatrixSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MatrixSession")
            .field("user_id", &self.user_id)
            .field("device_id", &self.device_id)
            .field("access_token", &"<secret>")
            .finish()
    }
}

/// A message in a room that replies to another event (`m.relates_to` →
/// `m.in_reply_to`). Find the outbound item it answers with
/// [`Outbox::find_by_transport_ref`](crate::Outbox::find_by_transport_ref)`(&reply.in_reply_to)`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MatrixReply {
    /// The room it was sent in.
    pub room_id: String,
    /// The reply's own event id.
    pub event_id: String,
    /// Who sent it.
    pub sender: String,
    /// Its text (`body`), including any fallback quote the client added.
    pub body: String,
    /// The event id it answers: the transport ref of the item it replies to.
    pub in_reply_to: String,
}

/// What one `/sync` returned.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SyncBatch {
    /// Pass this as `since` to the next [`MatrixClient::sync`].
    pub next_batch: String,
    /// Replies from other users in joined rooms, in timeline order.
    pub replies: Vec<MatrixReply>,
}

/// A Matrix client-server API client for one bot account.
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use durable_outbox::{MatrixClient, Outbox};
/// use std::time::Duration;
///
/// let client = MatrixClient::login("http://127.0.0.1:8008", "bot", "secret", "OUTBOX1").await?;
/// let outbox = Outbox::builder("/var/lib/bot/outbox")
///     .idempotent_transport(MatrixClient::CONNECTOR, Duration::from_secs(60 * 60))
///     .open()?;
/// let send = client.clone();
/// outbox
///     .process_due_async(1, move |item| {
///         let send = send.clone();
///         async move { send.send(item).await }
///     })
///     .await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct MatrixClient {
    http: reqwest::Client,
    homeserver: String,
    session: MatrixSession,
}

impl fmt::Debug for MatrixClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MatrixClient")
            .field("homeserver", &self.homeserver)
            .field("session", &self.session)
            .finish_non_exhaustive()
    }
}

impl MatrixClient {
    /// The connector name the examples and tests use for Matrix items.
    pub const CONNECTOR: &'static str = "matrix";

    /// Logs in with a password on a fixed `device_id` (`m.login.password`).
    ///
    /// Log in once and keep the session ([`session`](Self::session)): every
    /// login counts against the server's `rc_login`. Logging in again with the
    /// same `device_id` keeps the device, so transaction ids sent before are
    /// still deduplicated.
    ///
    /// # Errors
    ///
    /// [`Error::Matrix`] when the server cannot be reached or refuses the login.
    pub async fn login(
        homeserver: &str,
        user: &str,
        password: &str,
        device_id: &str,
    ) -> Result<Self> {
        let homeserver = homeserver.trim_end_matches('/').to_owned();
        let http = default_http().map_err(|e| matrix_error("login", &homeserver, None, e))?;
        let url = format!("{homeserver}/_matrix/client/v3/login");
        let body = serde_json::json!({
            "type": "m.login.password",
            "identifier": { "type": "m.id.user", "user": user },
            "password": password,
            "device_id": device_id,
            "initial_device_display_name": "durable-outbox",
        });
        let answer = json_call("login", &url, http.post(&url).json(&body)).await?;
        let field = |name: &str| {
            answer[name]
                .as_str()
                .map(str::to_owned)
                .ok_or_else(|| Error::Matrix {
                    operation: "login",
                    url: url.clone(),
                    status: Some(200),
                    errcode: None,
                    detail: format!("the answer has no {name}"),
                })
        };
        let session = MatrixSession {
            user_id: field("user_id")?,
            device_id: field("device_id")?,
            access_token: field("access_token")?,
        };
        Ok(Self {
            http,
            homeserver,
            session,
        })
    }

    /// A client for a session obtained earlier (no login request).
    ///
    /// # Errors
    ///
    /// [`Error::Matrix`] if the HTTP client cannot be built.
    pub fn from_session(homeserver: &str, session: MatrixSession) -> Result<Self> {
        let homeserver = homeserver.trim_end_matches('/').to_owned();
        let http = default_http().map_err(|e| matrix_error("connect", &homeserver, None, e))?;
        Ok(Self {
            http,
            homeserver,
            session,
        })
    }

    /// Uses `http` for every request (for TLS, proxies, or other timeouts).
    /// Its timeout bounds a send: past it, the send is ambiguous.
    #[must_use]
    pub fn with_http(mut self, http: reqwest::Client) -> Self {
        self.http = http;
        self
    }

    /// The session in use: store it to skip the next login.
    pub fn session(&self) -> &MatrixSession {
        &self.session
    }

    /// The homeserver's base URL, without a trailing slash.
    pub fn homeserver(&self) -> &str {
        &self.homeserver
    }

    /// Sends `item.content()` as an `m.text` message to the room
    /// `item.destination()` with `PUT …/send/m.room.message/{txnId}`, where
    /// `txnId` is [`item.transaction_id()`](OutboxItem::transaction_id).
    /// Returns the event id, which becomes the item's transport ref.
    ///
    /// # Errors
    ///
    /// A [`SendError`] whose class follows the table in the module docs; its
    /// code is the Matrix `errcode` when there is one (`M_LIMIT_EXCEEDED`,
    /// `M_FORBIDDEN`), otherwise a short description (`connect_failed`,
    /// `timeout_after_request_sent`, `http_502`).
    pub async fn send(&self, item: OutboxItem) -> std::result::Result<Option<String>, SendError> {
        let url = format!(
            "{}/_matrix/client/v3/rooms/{}/send/m.room.message/{}",
            self.homeserver,
            encode_path_segment(item.destination()),
            encode_path_segment(&item.transaction_id()),
        );
        let body = serde_json::json!({ "msgtype": "m.text", "body": item.content() });
        let response = match self
            .http
            .put(&url)
            .bearer_auth(&self.session.access_token)
            .timeout(SEND_TIMEOUT)
            .json(&body)
            .send()
            .await
        {
            Ok(response) => response,
            Err(e) => return Err(classify_transport_error(&e)),
        };
        let status = response.status().as_u16();
        let header_wait = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let answer = response.json::<Value>().await.ok();
        classify_answer(status, answer.as_ref(), header_wait)
    }

    /// Joins `room` (a room id or alias), accepting an invite if there is
    /// one; returns the room id. Joining a room the bot is already in is a no-op.
    ///
    /// # Errors
    ///
    /// [`Error::Matrix`] when the server cannot be reached or refuses (not
    /// invited to a private room, unknown alias).
    pub async fn join(&self, room: &str) -> Result<String> {
        let url = format!(
            "{}/_matrix/client/v3/join/{}",
            self.homeserver,
            encode_path_segment(room)
        );
        let request = self
            .http
            .post(&url)
            .bearer_auth(&self.session.access_token)
            .timeout(SEND_TIMEOUT)
            .json(&serde_json::json!({}));
        let answer = json_call("join", &url, request).await?;
        Ok(answer["room_id"].as_str().unwrap_or(room).to_owned())
    }

    /// One `/sync` long poll (up to `wait`): the replies other users sent to
    /// any event in the rooms the bot has joined, and the token for the next
    /// call. Pass `since: None` for the first call (the server then returns
    /// recent history).
    ///
    /// # Errors
    ///
    /// [`Error::Matrix`] when the server cannot be reached, refuses, or answers
    /// something that is not a sync response.
    pub async fn sync(&self, since: Option<&str>, wait: Duration) -> Result<SyncBatch> {
        let url = format!("{}/_matrix/client/v3/sync", self.homeserver);
        // Only message events in room timelines; no presence or account data.
        let filter = r#"{"presence":{"types":[]},"account_data":{"types":[]},"room":{"timeline":{"types":["m.room.message"],"limit":100},"state":{"types":[]},"ephemeral":{"types":[]},"account_data":{"types":[]}}}"#;
        let mut query = format!(
            "?timeout={}&filter={}",
            wait.as_millis(),
            encode_path_segment(filter)
        );
        if let Some(since) = since {
            query.push_str("&since=");
            query.push_str(&encode_path_segment(since));
        }
        let request = self
            .http
            .get(format!("{url}{query}"))
            .bearer_auth(&self.session.access_token)
            .timeout(wait + SEND_TIMEOUT);
        let answer = json_call("sync", &url, request).await?;
        let Some(next_batch) = answer["next_batch"].as_str().map(str::to_owned) else {
            return Err(Error::Matrix {
                operation: "sync",
                url,
                status: Some(200),
                errcode: None,
                detail: "the answer has no next_batch".into(),
            });
        };
        Ok(SyncBatch {
            next_batch,
            replies: replies_in(&answer, &self.session.user_id),
        })
    }
}

/// The default HTTP client: keep-alive, a bound on each send.
fn default_http() -> reqwest::Result<reqwest::Client> {
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .build()
}

/// Maps a request that got no HTTP answer to a failure class.
fn classify_transport_error(e: &reqwest::Error) -> SendError {
    if e.is_connect() {
        // Refused, unreachable, DNS, or a connect timeout: nothing was written.
        SendError::retryable("connect_failed")
    } else if e.is_builder() {
        SendError::permanent("invalid_request")
    } else if e.is_timeout() {
        SendError::ambiguous("timeout_after_request_sent")
    } else {
        // Reset or closed after the request may have been written.
        SendError::ambiguous("connection_lost")
    }
}

/// Maps an HTTP answer to a send result.
fn classify_answer(
    status: u16,
    answer: Option<&Value>,
    header_wait: Option<Duration>,
) -> std::result::Result<Option<String>, SendError> {
    let errcode = answer
        .and_then(|a| a["errcode"].as_str())
        .filter(|c| !c.is_empty())
        .map(str::to_owned);
    match status {
        200..=299 => match answer.and_then(|a| a["event_id"].as_str()) {
            Some(event_id) if !event_id.is_empty() => Ok(Some(event_id.to_owned())),
            _ => Err(SendError::ambiguous(format!(
                "http_{status}_unreadable_answer"
            ))),
        },
        429 => {
            let wait = answer
                .and_then(|a| a["retry_after_ms"].as_u64())
                .map(Duration::from_millis)
                .or(header_wait);
            let error = SendError::retryable(errcode.unwrap_or_else(|| "http_429".into()));
            Err(match wait {
                Some(wait) => error.retry_after(wait),
                None => error,
            })
        }
        400..=499 => Err(SendError::permanent(
            errcode.unwrap_or_else(|| format!("http_{status}")),
        )),
        _ => Err(SendError::ambiguous(match errcode {
            Some(code) => format!("http_{status}_{code}"),
            None => format!("http_{status}"),
        })),
    }
}

/// The replies in a sync answer, skipping the bot's own events.
fn replies_in(answer: &Value, own_user: &str) -> Vec<MatrixReply> {
    let mut replies = Vec::new();
    let Some(rooms) = answer["rooms"]["join"].as_object() else {
        return replies;
    };
    for (room_id, room) in rooms {
        let Some(events) = room["timeline"]["events"].as_array() else {
            continue;
        };
        for event in events {
            let in_reply_to =
                event["content"]["m.relates_to"]["m.in_reply_to"]["event_id"].as_str();
            let (Some(in_reply_to), Some(event_id), Some(sender)) = (
                in_reply_to,
                event["event_id"].as_str(),
                event["sender"].as_str(),
            ) else {
                continue;
            };
            if event["type"] != "m.room.message" || sender == own_user {
                continue;
            }
            replies.push(MatrixReply {
                room_id: room_id.clone(),
                event_id: event_id.to_owned(),
                sender: sender.to_owned(),
                body: event["content"]["body"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                in_reply_to: in_reply_to.to_owned(),
            });
        }
    }
    replies
}

/// Sends a non-send request and reads its JSON answer; any failure is an
/// [`Error::Matrix`] naming the operation.
async fn json_call(
    operation: &'static str,
    url: &str,
    request: reqwest::RequestBuilder,
) -> Result<Value> {
    let response = request
        .send()
        .await
        .map_err(|e| matrix_error(operation, url, None, e))?;
    let status = response.status().as_u16();
    let answer: Value = response
        .json()
        .await
        .map_err(|e| matrix_error(operation, url, Some(status), e))?;
    if (200..300).contains(&status) {
        return Ok(answer);
    }
    Err(Error::Matrix {
        operation,
        url: url.to_owned(),
        status: Some(status),
        errcode: answer["errcode"].as_str().map(str::to_owned),
        detail: answer["error"]
            .as_str()
            .unwrap_or("the server refused the request")
            .to_owned(),
    })
}

fn matrix_error(
    operation: &'static str,
    url: &str,
    status: Option<u16>,
    e: reqwest::Error,
) -> Error {
    Error::Matrix {
        operation,
        url: url.to_owned(),
        status,
        errcode: None,
        // Without the URL: the message already names it.
        detail: e.without_url().to_string(),
    }
}

/// Percent-encodes everything but RFC 3986 unreserved characters, so room ids
/// (`!id:server`), aliases (`#name:server`) and transaction ids are one path segment.
fn encode_path_segment(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            let _ = write!(out, "%{byte:02X}");
        }
    }
    out
}

#[cfg(test)]
mod tests;
