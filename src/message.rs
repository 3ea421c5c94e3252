//! What a caller hands to [`Outbox::enqueue`](crate::Outbox::enqueue), and the bounds it must respect.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// Size limits enforced on every entry point, in bytes of UTF-8.
///
/// They keep one item (and so one rewrite of `outbox.json`) bounded, and they are
/// generous for every chat platform we know: Telegram caps a message at 4,096
/// characters, Slack at 40,000.
pub mod limits {
    /// Longest idempotency key.
    pub const IDEMPOTENCY_KEY: usize = 256;
    /// Longest connector name (e.g. `telegram`).
    pub const CONNECTOR: usize = 64;
    /// Longest grant id.
    pub const GRANT_ID: usize = 256;
    /// Longest destination (chat id, channel, address).
    pub const DESTINATION: usize = 256;
    /// Largest message body: 256 KiB.
    pub const CONTENT: usize = 256 * 1024;
    /// Longest `lane`, `direction` or `risk_class`.
    pub const LABEL: usize = 64;
    /// Longest transport reference (the platform's message id) or error code.
    pub const TRANSPORT_REF: usize = 512;
}

/// The lane a message uses when the caller does not name one (the reference design's default).
pub const DEFAULT_LANE: &str = "outbound-telegram";
/// The direction a message has when the caller does not name one.
pub const DEFAULT_DIRECTION: &str = "outbound";

/// A message to enqueue. Passive input: fill the fields, the outbox validates them.
///
/// `lane`, `direction` and `risk_class` are optional labels carried into the audit
/// log; `None` means the defaults ([`DEFAULT_LANE`], [`DEFAULT_DIRECTION`], no risk class).
///
/// ```
/// use durable_outbox::NewMessage;
///
/// let message = NewMessage {
///     idempotency_key: "order-17".into(),
///     connector: "telegram".into(),
///     grant_id: "bot-1".into(),
///     destination: "chat-42".into(),
///     content: "your order shipped".into(),
///     ..Default::default()
/// };
/// assert!(message.lane.is_none());
/// ```
#[derive(Clone, Default, PartialEq, Eq)]
pub struct NewMessage {
    /// The caller-owned key that makes enqueueing idempotent.
    pub idempotency_key: String,
    /// The connector (platform adapter) that will send it, e.g. `telegram`.
    pub connector: String,
    /// The credential or bot identity the send uses.
    pub grant_id: String,
    /// Where it goes: a chat id, channel or address. Rate caps are per destination.
    pub destination: String,
    /// The message body. Stored in `outbox.json`, never in the audit log.
    pub content: String,
    /// Optional lane label (default [`DEFAULT_LANE`]).
    pub lane: Option<String>,
    /// Optional direction label (default [`DEFAULT_DIRECTION`]).
    pub direction: Option<String>,
    /// Optional risk class label.
    pub risk_class: Option<String>,
}

impl fmt::Debug for NewMessage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NewMessage")
            .field("idempotency_key", &self.idempotency_key)
            .field("connector", &self.connector)
            .field("grant_id", &self.grant_id)
            .field("destination", &self.destination)
            .field("content", &ContentSummary(&self.content))
            .field("lane", &self.lane)
            .field("direction", &self.direction)
            .field("risk_class", &self.risk_class)
            .finish()
    }
}

/// Prints a body as its length and hash prefix so `Debug` output never leaks it.
pub(crate) struct ContentSummary<'a>(pub(crate) &'a str);

impl fmt::Debug for ContentSummary<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hash = content_hash(self.0);
        write!(f, "<{} bytes, sha256 {}…>", self.0.len(), &hash[..12])
    }
}

/// SHA-256 of the UTF-8 body, lowercase hex: the `content_hash` field.
pub(crate) fn content_hash(content: &str) -> String {
    hex::encode(Sha256::digest(content.as_bytes()))
}

/// How strictly a text field is checked.
#[derive(Clone, Copy)]
pub(crate) enum TextRule {
    /// An identifier: not blank, no control characters at all.
    Identifier,
    /// A body: not blank; newlines and tabs allowed, NUL not.
    Body,
}

/// Checks one text field against its rule and byte limit.
pub(crate) fn check_text(
    field: &'static str,
    value: &str,
    max: usize,
    rule: TextRule,
) -> Result<()> {
    if value.trim().is_empty() {
        return Err(Error::invalid_field(field, "must not be blank"));
    }
    if value.len() > max {
        return Err(Error::invalid_field(
            field,
            format!("is {} bytes, the limit is {max}", value.len()),
        ));
    }
    if let Some(position) = value.find('\0') {
        return Err(Error::invalid_field(
            field,
            format!("contains a NUL byte at byte {position}"),
        ));
    }
    if let TextRule::Identifier = rule
        && let Some((position, c)) = value.char_indices().find(|(_, c)| c.is_control())
    {
        return Err(Error::invalid_field(
            field,
            format!("contains control character {c:?} at byte {position}"),
        ));
    }
    Ok(())
}

/// Checks an optional label (`lane`, `direction`, `risk_class`).
fn check_label(field: &'static str, value: Option<&str>) -> Result<()> {
    match value {
        None => Ok(()),
        Some(v) => check_text(field, v, limits::LABEL, TextRule::Identifier),
    }
}

impl NewMessage {
    /// Validates every field; the first problem found is returned.
    pub(crate) fn validate(&self) -> Result<()> {
        check_text(
            "idempotency_key",
            &self.idempotency_key,
            limits::IDEMPOTENCY_KEY,
            TextRule::Identifier,
        )?;
        check_text(
            "connector",
            &self.connector,
            limits::CONNECTOR,
            TextRule::Identifier,
        )?;
        check_text(
            "grant_id",
            &self.grant_id,
            limits::GRANT_ID,
            TextRule::Identifier,
        )?;
        check_text(
            "destination",
            &self.destination,
            limits::DESTINATION,
            TextRule::Identifier,
        )?;
        check_text("content", &self.content, limits::CONTENT, TextRule::Body)?;
        check_label("lane", self.lane.as_deref())?;
        check_label("direction", self.direction.as_deref())?;
        check_label("risk_class", self.risk_class.as_deref())?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid() -> NewMessage {
        NewMessage {
            idempotency_key: "k".into(),
            connector: "telegram".into(),
            grant_id: "g".into(),
            destination: "chat-1".into(),
            content: "hello\nworld".into(),
            ..Default::default()
        }
    }

    fn field_of(m: &NewMessage) -> Option<&'static str> {
        match m.validate() {
            Err(Error::InvalidField { field, .. }) => Some(field),
            Ok(()) => None,
            Err(other) => panic!("unexpected error {other}"),
        }
    }

    #[test]
    fn a_complete_message_is_valid() {
        assert_eq!(field_of(&valid()), None);
    }

    #[test]
    fn each_required_field_is_named_when_blank() {
        type Mutation = fn(&mut NewMessage);
        let cases: [(&str, Mutation); 5] = [
            ("idempotency_key", |m| m.idempotency_key = " ".into()),
            ("connector", |m| m.connector = String::new()),
            ("grant_id", |m| m.grant_id = "\t".into()),
            ("destination", |m| m.destination = String::new()),
            ("content", |m| m.content = "  \n".into()),
        ];
        for (name, mutate) in cases {
            let mut m = valid();
            mutate(&mut m);
            assert_eq!(field_of(&m), Some(name), "{name}");
        }
    }

    #[test]
    fn limits_are_inclusive_and_enforced() {
        let mut m = valid();
        m.destination = "d".repeat(limits::DESTINATION);
        assert_eq!(field_of(&m), None);
        m.destination.push('d');
        assert_eq!(field_of(&m), Some("destination"));
    }

    #[test]
    fn nul_is_rejected_even_in_the_body_but_newlines_are_not() {
        let mut m = valid();
        m.content = "a\0b".into();
        assert_eq!(field_of(&m), Some("content"));
        m.content = "line\nline\ttab".into();
        assert_eq!(field_of(&m), None);
    }

    #[test]
    fn identifiers_reject_control_characters() {
        let mut m = valid();
        m.idempotency_key = "a\nb".into();
        assert_eq!(field_of(&m), Some("idempotency_key"));
        let mut m = valid();
        m.lane = Some("lane\u{7}".into());
        assert_eq!(field_of(&m), Some("lane"));
    }

    #[test]
    fn debug_never_prints_the_body() {
        let mut m = valid();
        m.content = "top secret body".into();
        let printed = format!("{m:?}");
        assert!(!printed.contains("top secret"), "{printed}");
        assert!(printed.contains("15 bytes"), "{printed}");
    }
}
