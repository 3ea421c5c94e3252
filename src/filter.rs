//! Which items an operator's bulk action applies to.

use chrono::{DateTime, Utc};

use crate::item::{ItemState, OutboxItem};
use crate::send::FailureClass;

/// Selects items for [`Outbox::requeue_where`](crate::Outbox::requeue_where),
/// [`Outbox::cancel_where`](crate::Outbox::cancel_where) and
/// [`Outbox::select`](crate::Outbox::select). Every criterion given must hold.
///
/// An empty filter is refused by the bulk actions, so a forgotten criterion
/// cannot requeue or cancel everything; say [`ItemFilter::all`] to mean it.
///
/// ```
/// use durable_outbox::{FailureClass, ItemFilter, ItemState};
/// use std::time::{Duration, SystemTime};
///
/// // Everything that failed as retryable in chat-42 during the last two hours.
/// let filter = ItemFilter::new()
///     .state(ItemState::Failed)
///     .class(FailureClass::Retryable)
///     .destination("chat-42")
///     .since(SystemTime::now() - Duration::from_secs(2 * 3600));
/// assert!(!filter.is_empty());
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ItemFilter {
    state: Option<ItemState>,
    error_code: Option<String>,
    class: Option<FailureClass>,
    destination: Option<String>,
    since: Option<DateTime<Utc>>,
    all: bool,
}

impl ItemFilter {
    /// A filter with no criterion yet (matches every item, but bulk actions
    /// refuse it until a criterion is added or [`all`](Self::all) is used).
    pub fn new() -> Self {
        Self::default()
    }

    /// Every item, on purpose.
    pub fn all() -> Self {
        Self {
            all: true,
            ..Self::default()
        }
    }

    /// Only items in this state.
    #[must_use]
    pub fn state(mut self, state: ItemState) -> Self {
        self.state = Some(state);
        self
    }

    /// Only items whose error code is exactly this.
    #[must_use]
    pub fn error_code(mut self, code: impl Into<String>) -> Self {
        self.error_code = Some(code.into());
        self
    }

    /// Only items whose stored failure class is this (items written before the
    /// class was stored have none, and never match).
    #[must_use]
    pub fn class(mut self, class: FailureClass) -> Self {
        self.class = Some(class);
        self
    }

    /// Only items for this destination.
    #[must_use]
    pub fn destination(mut self, destination: impl Into<String>) -> Self {
        self.destination = Some(destination.into());
        self
    }

    /// Only items that last changed at or after this moment. Takes a
    /// [`std::time::SystemTime`] or a [`DateTime<Utc>`](crate::DateTime).
    #[must_use]
    pub fn since(mut self, at: impl Into<DateTime<Utc>>) -> Self {
        self.since = Some(at.into());
        self
    }

    /// `true` when no criterion was given (and [`all`](Self::all) was not used).
    pub fn is_empty(&self) -> bool {
        !self.all
            && self.state.is_none()
            && self.error_code.is_none()
            && self.class.is_none()
            && self.destination.is_none()
            && self.since.is_none()
    }

    /// Whether `item` meets every criterion.
    pub fn matches(&self, item: &OutboxItem) -> bool {
        self.state.is_none_or(|s| item.state == s)
            && self
                .error_code
                .as_deref()
                .is_none_or(|c| item.error_code.as_deref() == Some(c))
            && self.class.is_none_or(|c| item.failure_class == Some(c))
            && self
                .destination
                .as_deref()
                .is_none_or(|d| item.destination == d)
            && self.since.is_none_or(|t| item.updated_at >= t)
    }
}

/// What a bulk operator action did (or, from a dry run, would do).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BulkReport {
    /// The items changed, as they are now (or would be), sorted by key. Each
    /// has its own audit record naming the operator and the reason.
    pub changed: Vec<OutboxItem>,
    /// Items the filter matched that the action does not apply to, with why
    /// (e.g. "it was sent already"), sorted by key.
    pub skipped: Vec<(String, String)>,
}
