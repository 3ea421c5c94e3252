//! A bot's transport over real HTTP (reqwest), with each failure mapped to the
//! class the outbox needs. Shared by `examples/telegram_like.rs` and the
//! loopback test.
//!
//! The mapping is the important part: only the transport knows whether its
//! request was written.
//! - connection refused / DNS / connect timeout: nothing was sent → retryable;
//! - HTTP 429 with `retry_after`: rejected before processing → retryable, and the
//!   outbox waits at least that long before sending to the chat again;
//! - 400/403/404 (chat not found, bot blocked): permanent;
//! - a timeout after the request was written, a reset, an unreadable answer, a
//!   5xx from a proxy: the message may have arrived → ambiguous, never resent.

#![allow(dead_code, reason = "the example and the test each use part of it")]

use std::time::Duration;

use durable_outbox::{OutboxItem, SendError};

/// A Bot-API-like client.
#[derive(Clone)]
pub struct BotClient {
    http: reqwest::Client,
    base: String,
}

/// A user's reply; `quotes` is the id of the message it answers.
#[derive(Debug, Clone)]
pub struct Reply {
    pub chat_id: String,
    pub text: String,
    pub quotes: String,
}

impl BotClient {
    /// A client for the platform at `base`, giving up on a request after `timeout`.
    pub fn new(base: &str, timeout: Duration) -> reqwest::Result<Self> {
        Ok(Self {
            http: reqwest::Client::builder().timeout(timeout).build()?,
            base: base.trim_end_matches('/').to_owned(),
        })
    }

    /// Sends one outbox item; returns the platform's message id.
    pub async fn send(&self, item: OutboxItem) -> Result<Option<String>, SendError> {
        let url = format!("{}/botTOKEN/sendMessage", self.base);
        let body = serde_json::json!({ "chat_id": item.destination(), "text": item.content() });
        let response = match self.http.post(url).json(&body).send().await {
            Ok(response) => response,
            Err(e) if e.is_connect() => return Err(SendError::retryable("connect_failed")),
            Err(e) if e.is_timeout() => {
                return Err(SendError::ambiguous("timeout_after_request_sent"));
            }
            Err(e) => return Err(SendError::ambiguous(format!("transport_error: {e}"))),
        };
        let status = response.status().as_u16();
        let Ok(answer) = response.json::<serde_json::Value>().await else {
            return Err(SendError::ambiguous(format!(
                "http_{status}_unreadable_answer"
            )));
        };
        match status {
            200 => Ok(answer["result"]["message_id"]
                .as_u64()
                .map(|id| id.to_string())),
            429 => {
                let wait = answer["parameters"]["retry_after"].as_u64().unwrap_or(1);
                Err(SendError::retryable("http_429").retry_after(Duration::from_secs(wait)))
            }
            400 | 403 | 404 => Err(SendError::permanent(
                answer["description"]
                    .as_str()
                    .unwrap_or("rejected")
                    .to_owned(),
            )),
            _ => Err(SendError::ambiguous(format!("http_{status}"))),
        }
    }

    /// The replies users sent, as an update stream would deliver them.
    pub async fn replies(&self) -> reqwest::Result<Vec<Reply>> {
        let answer: serde_json::Value = self
            .http
            .get(format!("{}/replies", self.base))
            .send()
            .await?
            .json()
            .await?;
        Ok(answer["result"]
            .as_array()
            .map(|replies| {
                replies
                    .iter()
                    .map(|r| Reply {
                        chat_id: r["chat_id"].as_str().unwrap_or_default().to_owned(),
                        text: r["text"].as_str().unwrap_or_default().to_owned(),
                        quotes: r["reply_to_message_id"].to_string(),
                    })
                    .collect()
            })
            .unwrap_or_default())
    }
}
