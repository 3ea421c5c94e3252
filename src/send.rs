//! How a caller's `send` reports failure, in the four classes that decide what happens next.

use std::fmt;
use std::time::Duration;

/// What kind of failure a send hit. The class decides whether the outbox may retry.
///
/// Only the connector knows whether its request left the host, so only it can pick
/// the class. When in doubt, pick [`Ambiguous`](FailureClass::Ambiguous): the item
/// then fails instead of risking a duplicate.
///
/// The class of an item's last failure is stored with the item
/// ([`OutboxItem::failure_class`](crate::OutboxItem::failure_class)) and in its
/// audit record, so an operator reads "may have been delivered" from the outbox
/// itself rather than from a list of error codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureClass {
    /// The message certainly did not leave (connection refused, DNS failure, HTTP 429,
    /// a 5xx returned before processing). Retried up to `max_attempts`.
    Retryable,
    /// The message certainly did not leave and never will (chat not found, bot
    /// blocked). The item fails at once.
    Permanent,
    /// The message may have left (timeout after the request was written, connection
    /// reset after the write). The item fails at once and is never resent automatically.
    Ambiguous,
}

impl FailureClass {
    /// `retryable`, `permanent` or `ambiguous`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Retryable => "retryable",
            Self::Permanent => "permanent",
            Self::Ambiguous => "ambiguous",
        }
    }

    /// The class named by [`as_str`](Self::as_str)'s text, if any.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "retryable" => Some(Self::Retryable),
            "permanent" => Some(Self::Permanent),
            "ambiguous" => Some(Self::Ambiguous),
            _ => None,
        }
    }

    /// `true` for [`Ambiguous`](Self::Ambiguous): the message may have been
    /// delivered, so only an operator may send it again.
    pub fn may_have_been_delivered(self) -> bool {
        self == Self::Ambiguous
    }
}

impl fmt::Display for FailureClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A failed send, as reported by the caller's `send` closure.
///
/// ```
/// use durable_outbox::{FailureClass, SendError};
/// use std::time::Duration;
///
/// // Telegram answered 429 "retry after 3": certainly not sent, try again in 3 s.
/// let e = SendError::retryable("http_429").retry_after(Duration::from_secs(3));
/// assert_eq!(e.class(), FailureClass::Retryable);
/// assert_eq!(e.retry_after_hint(), Some(Duration::from_secs(3)));
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct SendError {
    class: FailureClass,
    code: String,
    retry_after: Option<Duration>,
}

impl SendError {
    /// The message certainly did not leave; it may be retried. `code` becomes the item's `error_code`.
    pub fn retryable(code: impl Into<String>) -> Self {
        Self::new(FailureClass::Retryable, code)
    }

    /// The message did not leave and never will; the item fails.
    pub fn permanent(code: impl Into<String>) -> Self {
        Self::new(FailureClass::Permanent, code)
    }

    /// The message may have left; the item fails and is never resent automatically.
    pub fn ambiguous(code: impl Into<String>) -> Self {
        Self::new(FailureClass::Ambiguous, code)
    }

    fn new(class: FailureClass, code: impl Into<String>) -> Self {
        Self {
            class,
            code: code.into(),
            retry_after: None,
        }
    }

    /// The earliest the platform allows another attempt (e.g. HTTP `Retry-After`).
    /// Only meaningful for retryable failures; the outbox waits at least this long.
    #[must_use]
    pub fn retry_after(mut self, wait: Duration) -> Self {
        self.retry_after = Some(wait);
        self
    }

    /// The failure class.
    pub fn class(&self) -> FailureClass {
        self.class
    }

    /// The error code given at construction.
    pub fn code(&self) -> &str {
        &self.code
    }

    /// The platform's requested wait, if any.
    pub fn retry_after_hint(&self) -> Option<Duration> {
        self.retry_after
    }
}

impl fmt::Debug for SendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SendError")
            .field("class", &self.class)
            .field("code", &self.code)
            .field("retry_after", &self.retry_after)
            .finish()
    }
}

impl fmt::Display for SendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} send failure: {}", self.class.as_str(), self.code)
    }
}

impl std::error::Error for SendError {}
