//! Metrics through the [`metrics`](https://docs.rs/metrics) facade (feature
//! `metrics`); without the feature every call here compiles to nothing.
//!
//! Counters are emitted from the audit records a change committed, so each
//! outcome is counted exactly once, after it is durable, whichever call made
//! it. Gauges are refreshed after every `process_due` pass.
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | `durable_outbox_outcomes_total` | counter | `outcome`, `error_code`, `class` | audited outcomes: `queued` (enqueued), `sent`, `failed`, `retrying`, `deferred`, `requeued`, `cancelled`, `pruned`, `late_delivery` (a send whose lost claim's item had moved on, delivered: counted here, not as `sent`); `error_code` and `class` are empty when there is none |
//! | `durable_outbox_enqueue_to_sent_seconds` | histogram | — | from enqueue to the recorded delivery |
//! | `durable_outbox_queued` | gauge | — | queued items (including in flight) |
//! | `durable_outbox_in_flight` | gauge | — | queued items claimed by a worker |
//! | `durable_outbox_oldest_queued_age_seconds` | gauge | — | age of the oldest queued item, 0 when none |

#[cfg(feature = "metrics")]
use chrono::{DateTime, Utc};

#[cfg(feature = "metrics")]
use crate::item::{ItemState, OutboxItem};

#[cfg(feature = "metrics")]
/// Counter of audited outcomes.
const OUTCOMES_TOTAL: &str = "durable_outbox_outcomes_total";
/// Histogram of enqueue-to-sent latency, in seconds.
#[cfg(feature = "metrics")]
const ENQUEUE_TO_SENT_SECONDS: &str = "durable_outbox_enqueue_to_sent_seconds";
/// Gauge of queued items.
#[cfg(feature = "metrics")]
const QUEUED: &str = "durable_outbox_queued";
/// Gauge of items in flight.
#[cfg(feature = "metrics")]
const IN_FLIGHT: &str = "durable_outbox_in_flight";
/// Gauge of the oldest queued item's age, in seconds.
#[cfg(feature = "metrics")]
const OLDEST_QUEUED_AGE_SECONDS: &str = "durable_outbox_oldest_queued_age_seconds";

/// What one committed audit outcome is counted by: its outcome, error code,
/// failure class and item key (from a sealed record or an event still to be
/// sealed).
pub(crate) type Counted<'r> = (
    crate::AuditOutcome,
    Option<&'r str>,
    Option<crate::FailureClass>,
    &'r str,
);

/// Counts committed outcomes; `item` looks up the state they were committed
/// to, for the latency of deliveries. Both engines call it after a durable
/// commit: the file engine with its records, PostgreSQL with the events it
/// committed (sealed onto the chain later, perhaps by another handle).
#[cfg(feature = "metrics")]
pub(crate) fn committed<'r, 'a>(
    outcomes: impl IntoIterator<Item = Counted<'r>>,
    item: impl Fn(&str) -> Option<&'a OutboxItem>,
) {
    for (outcome, error_code, class, key) in outcomes {
        let labels = [
            ("outcome", outcome.as_str().to_owned()),
            ("error_code", error_code.unwrap_or_default().to_owned()),
            (
                "class",
                class.map(|c| c.as_str().to_owned()).unwrap_or_default(),
            ),
        ];
        metrics::counter!(OUTCOMES_TOTAL, &labels).increment(1);
        if outcome == crate::AuditOutcome::Sent
            && let Some(item) = item(key)
            && let Some(sent_at) = item.sent_at
        {
            let latency = (sent_at - item.created_at).to_std().unwrap_or_default();
            metrics::histogram!(ENQUEUE_TO_SENT_SECONDS).record(latency.as_secs_f64());
        }
    }
}

#[cfg(not(feature = "metrics"))]
pub(crate) fn committed<'r, 'a>(
    _outcomes: impl IntoIterator<Item = Counted<'r>>,
    _item: impl Fn(&str) -> Option<&'a crate::item::OutboxItem>,
) {
}

/// Sets the queue gauges from the live items.
#[cfg(feature = "metrics")]
pub(crate) fn gauges<'a>(items: impl Iterator<Item = &'a OutboxItem>, now: DateTime<Utc>) {
    let (mut queued, mut in_flight) = (0u64, 0u64);
    let mut oldest: Option<DateTime<Utc>> = None;
    for item in items.filter(|i| i.state == ItemState::Queued) {
        queued += 1;
        if item.claim.is_some() {
            in_flight += 1;
        }
        oldest = Some(oldest.map_or(item.created_at, |o| o.min(item.created_at)));
    }
    let age = oldest.map_or(0.0, |at| {
        (now - at).to_std().unwrap_or_default().as_secs_f64()
    });
    metrics::gauge!(QUEUED).set(queued as f64);
    metrics::gauge!(IN_FLIGHT).set(in_flight as f64);
    metrics::gauge!(OLDEST_QUEUED_AGE_SECONDS).set(age);
}
