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
use crate::rules::Actor;
use crate::rules::codes::{
    DESTINATION_COOLDOWN, DESTINATION_PACED, GLOBAL_RATE_CAPPED, RATE_CAPPED,
};
use crate::rules::txn::Txn;

/// When a send to `destination` at the transaction's moment would exceed a
/// cap (the destination's, the global one), a platform's cooldown or the
/// learned pace: the moment every limit allows it, and which binds last (on a
/// tie, the later in that order). `None`: the send may start now. The one cap
/// rule of both engines.
///
/// Each cap asks only for the time that decides it: the `count`-th newest
/// in its window ([`Txn::nth_newest_time`]); the pace, for the newest.
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
    let cap = rates.for_destination(destination);
    let global = rates.global;
    let per_destination = cap
        .free_after(txn.nth_newest_time(
            Some(destination),
            earlier(now, cap.window),
            cap.count as usize,
        )?)
        .map(|at| (at, RATE_CAPPED));
    let global = match global {
        Some(cap) => cap
            .free_after(txn.nth_newest_time(None, earlier(now, cap.window), cap.count as usize)?)
            .map(|at| (at, GLOBAL_RATE_CAPPED)),
        None => None,
    };
    let cooled = txn
        .destination_cooldown(destination)?
        .filter(|until| *until > now)
        .map(|until| (until, DESTINATION_COOLDOWN));
    let caps = [per_destination, global, cooled]
        .into_iter()
        .flatten()
        .max_by_key(|(at, _)| *at);
    let paced = match actor.pacing.interval(destination, now) {
        // The pace counts from the destination's last send; one exactly a
        // pace ago allows a send now.
        Some(pace) => txn
            .nth_newest_time(Some(destination), earlier(now, pace), 1)?
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
