//! The operator's actions on items — requeue (the only way an ambiguous item
//! is ever resent) and cancel — one by key or many by filter.

use std::borrow::Cow;

use chrono::{DateTime, Utc};

use crate::audit::AuditOutcome;
use crate::error::{Error, Result};
use crate::filter::BulkReport;
use crate::item::{ItemState, OutboxItem};
use crate::message::limits;
use crate::rules::codes::CANCELLED;
use crate::rules::record::record;
use crate::rules::txn::Txn;

/// The two operator actions on items.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bulk {
    /// Send a `failed` item again, at the back of its destination's line.
    Requeue,
    /// Do not send a `queued` item: it fails with [`CANCELLED`].
    Cancel,
}

impl Bulk {
    /// Why this action does not apply to `item`, if it does not.
    pub(crate) fn refusal(self, item: &OutboxItem) -> Option<Cow<'static, str>> {
        let claimed = item.claim.is_some();
        let why: Cow<'static, str> = match (self, item.state) {
            (Self::Requeue, ItemState::Sent) => "it was sent already".into(),
            (_, ItemState::Queued) if claimed => "it is in flight (claimed by a worker)".into(),
            (Self::Requeue, ItemState::Queued) => "it is queued already".into(),
            (Self::Requeue, ItemState::Failed) | (Self::Cancel, ItemState::Queued) => return None,
            (Self::Cancel, ItemState::Failed) if item.error_code.as_deref() == Some(CANCELLED) => {
                "it was cancelled already".into()
            }
            (Self::Cancel, state) => format!("it is {state} already").into(),
        };
        Some(why)
    }

    /// The error refusing this action on `key`.
    pub(crate) fn refused(self, key: &str, why: Cow<'static, str>) -> Error {
        Error::InvalidTransition {
            key: key.to_owned(),
            action: match self {
                Self::Requeue => "requeued",
                Self::Cancel => "cancelled",
            },
            reason: why.into_owned(),
        }
    }

    /// The item as the action leaves it, without its audit stamp.
    pub(crate) fn preview(self, item: &OutboxItem, now: DateTime<Utc>) -> OutboxItem {
        let mut item = item.clone();
        match self {
            Self::Requeue => {
                item.state = ItemState::Queued;
                item.attempts = 0;
                item.error_code = None;
                item.failure_class = None;
                item.next_attempt_at = None;
                item.cooldown_until = None;
            }
            Self::Cancel => {
                item.state = ItemState::Failed;
                item.error_code = Some(CANCELLED.to_owned());
                item.failure_class = None;
                item.next_attempt_at = None;
            }
        }
        item.updated_at = item.updated_at.max(now);
        item
    }

    /// Applies the action to an item it applies to (live or in history), with
    /// its audit record carrying `note`. Returns the item as changed.
    ///
    /// # Errors
    /// [`Error::NotFound`]; the engine's errors.
    pub(crate) fn apply<T: Txn + ?Sized>(
        self,
        txn: &mut T,
        key: &str,
        note: &str,
    ) -> Result<OutboxItem> {
        let now = txn.now();
        let mut changed = self.preview(txn.live_item(key)?, now);
        let outcome = match self {
            Self::Requeue => AuditOutcome::Requeued,
            Self::Cancel => AuditOutcome::Cancelled,
        };
        if self == Self::Requeue {
            // A requeue is a new turn: the back of the destination's line.
            changed.seq = Some(txn.next_seq(&changed.destination)?);
        }
        txn.insert(changed)?;
        record(txn, key, outcome, Some(note), false)?;
        txn.existing(key).cloned()
    }

    /// The action on one item by key, refused with why if it does not apply.
    ///
    /// # Errors
    /// [`Error::NotFound`]; [`Error::InvalidTransition`]; the engine's errors.
    pub(crate) fn one<T: Txn + ?Sized>(
        self,
        txn: &mut T,
        key: &str,
        note: &str,
    ) -> Result<OutboxItem> {
        let item = txn.live_item(key)?;
        if let Some(why) = self.refusal(item) {
            return Err(self.refused(key, why));
        }
        self.apply(txn, key, note)
    }

    /// Which of `matched` (sorted by key) the action applies to, and a report
    /// listing the others with why.
    pub(crate) fn plan(self, matched: &[OutboxItem]) -> (Vec<&OutboxItem>, BulkReport) {
        let mut todo = Vec::new();
        let mut report = BulkReport::default();
        for item in matched {
            match self.refusal(item) {
                Some(why) => report
                    .skipped
                    .push((item.idempotency_key.clone(), why.into_owned())),
                None => todo.push(item),
            }
        }
        (todo, report)
    }

    /// The action on every item of `matched` (sorted by key) it applies to,
    /// each with its audit record carrying `note`.
    ///
    /// # Errors
    /// The engine's errors. Nothing is changed on error.
    pub(crate) fn many<T: Txn + ?Sized>(
        self,
        txn: &mut T,
        matched: &[OutboxItem],
        note: &str,
    ) -> Result<BulkReport> {
        let (todo, mut report) = self.plan(matched);
        for item in todo {
            report
                .changed
                .push(self.apply(txn, &item.idempotency_key, note)?);
        }
        Ok(report)
    }
}

/// Checks an operator's name and reason and joins them into an audit note.
///
/// # Errors
/// [`Error::InvalidField`] for a blank or oversize operator or reason.
pub(crate) fn operator_note(operator: &str, reason: &str) -> Result<String> {
    use crate::message::{TextRule, check_text};
    check_text("operator", operator, limits::LABEL, TextRule::Identifier)?;
    check_text(
        "reason",
        reason,
        limits::TRANSPORT_REF,
        TextRule::Identifier,
    )?;
    Ok(format!("{operator}: {reason}"))
}
