//! Rate decisions: whether a send to a destination may start now (its cap,
//! the global cap, a platform cooldown, the learned pace), and learning the
//! pace from a platform's `retry_after`.
//!
//! The caps themselves (`crate::rate`) and the pacing memory
//! (`crate::pacing`) are pure; this module feeds them what the transaction
//! sees.

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::clock::{earlier, later};
use crate::error::Result;
use crate::pacing;
use crate::rate::RatePolicy;
use crate::rules::Actor;
use crate::rules::codes::{
    DESTINATION_COOLDOWN, DESTINATION_PACED, GLOBAL_RATE_CAPPED, RATE_CAPPED,
};
use crate::rules::txn::Txn;

/// What a cap decision looks at besides the item: the times that count
/// against caps (sends, sends in progress, possible sends; see
/// `store::rate_times`) and the destination's cooldown, as the transaction
/// sees them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct RateView {
    /// The candidate's destination's times.
    pub(crate) destination_times: Vec<DateTime<Utc>>,
    /// Every destination's times (for the global cap).
    pub(crate) all_times: Vec<DateTime<Utc>>,
    /// Until when the platform asked not to send to the destination, if ever.
    pub(crate) cooldown_until: Option<DateTime<Utc>>,
}

/// When a send to `destination` at `now` would break a cap (the
/// destination's, the global one, a platform's cooldown) given the times in
/// `view`: the moment all allow it, and which one binds last (on a tie, the
/// later in that order). `None`: the caps allow it now. The one cap rule of
/// both engines.
pub(crate) fn capped(
    policy: &RatePolicy,
    destination: &str,
    view: &RateView,
    now: DateTime<Utc>,
) -> Option<(DateTime<Utc>, &'static str)> {
    let cap = policy.for_destination(destination);
    let per_destination = cap
        .next_free_slot(now, view.destination_times.iter().copied())
        .map(|at| (at, RATE_CAPPED));
    let global = policy.global.and_then(|cap| {
        cap.next_free_slot(now, view.all_times.iter().copied())
            .map(|at| (at, GLOBAL_RATE_CAPPED))
    });
    let cooled = view
        .cooldown_until
        .filter(|until| *until > now)
        .map(|until| (until, DESTINATION_COOLDOWN));
    [per_destination, global, cooled]
        .into_iter()
        .flatten()
        .max_by_key(|(at, _)| *at)
}

/// When a send to `destination` at the transaction's moment would exceed a
/// cap or the learned pace: the moment every limit allows it, and which binds
/// last.
///
/// # Errors
/// The engine's read errors.
pub(crate) fn rate_capped<T: Txn + ?Sized>(
    actor: &Actor<'_>,
    txn: &mut T,
    destination: &str,
) -> Result<Option<(DateTime<Utc>, &'static str)>> {
    let now = txn.now();
    let rates = &txn.settings().rates;
    let window = rates.for_destination(destination).window;
    let global_window = rates.global.map(|cap| cap.window);
    let view = RateView {
        destination_times: txn.destination_times(destination, earlier(now, window))?,
        all_times: match global_window {
            Some(window) => txn.all_times(earlier(now, window))?,
            None => Vec::new(),
        },
        cooldown_until: txn.destination_cooldown(destination)?,
    };
    let caps = capped(&txn.settings().rates, destination, &view, now);
    let paced = match actor.pacing.interval(destination, now) {
        Some(pace) => txn
            .destination_times(destination, earlier(now, pace))?
            .into_iter()
            .max()
            .map(|last| (later(last, pace), DESTINATION_PACED))
            .filter(|(at, _)| *at > now),
        None => None,
    };
    // Every limit must allow the send; the latest moment is when all do.
    Ok([caps, paced]
        .into_iter()
        .flatten()
        .max_by_key(|(at, _)| *at))
}

/// Learns `destination`'s pace from a `retry_after` of `hint` on the send
/// claimed at `started` that the platform just refused; see `pacing`. Returns
/// when the pace next allows a send there (after the destination's previous
/// send).
///
/// # Errors
/// The engine's read errors.
pub(crate) fn learn_pace<T: Txn + ?Sized>(
    actor: &Actor<'_>,
    txn: &mut T,
    destination: &str,
    started: DateTime<Utc>,
    hint: Duration,
) -> Result<Option<DateTime<Utc>>> {
    let now = txn.now();
    let previous = txn
        .destination_times(destination, earlier(started, pacing::MEMORY))?
        .into_iter()
        .filter(|at| *at < started)
        .max();
    let gap = previous.and_then(|at| started.signed_duration_since(at).to_std().ok());
    // Sends accepted since the moment the previous refusal named refilled
    // the server's bucket up to this refusal's moment.
    let since_last = match actor.pacing.last_allowed(destination, now) {
        Some(last) => {
            let accepted = txn
                .destination_times(destination, last)?
                .into_iter()
                .filter(|at| *at < started)
                .count();
            per_send(later(started, hint), last, accepted)
        }
        None => None,
    };
    let refusal = pacing::Refusal {
        gap,
        hint,
        started,
        since_last,
    };
    actor.pacing.learn(destination, refusal, now);
    let Some(pace) = actor.pacing.interval(destination, now) else {
        return Ok(None);
    };
    Ok(previous.map(|at| later(at, pace)))
}

/// The span from `last` to `until` shared by `accepted` sends.
fn per_send(until: DateTime<Utc>, last: DateTime<Utc>, accepted: usize) -> Option<Duration> {
    let span = until.signed_duration_since(last).to_std().ok()?;
    let per = span.as_micros() / u128::try_from(accepted).ok().filter(|k| *k > 0)?;
    Some(Duration::from_micros(u64::try_from(per).ok()?))
}
