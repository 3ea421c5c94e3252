//! Adaptive per-destination pacing, learned from the platform's `retry_after`.
//!
//! A cooldown alone (wait until the `retry_after` moment, then go) releases a
//! herd: every item held back for the destination becomes due at the same
//! instant, the first is accepted and the rest draw fresh 429s, each burning an
//! attempt. Pacing spaces sends to a destination instead.
//!
//! Two estimates of the server's interval, the larger wins, and the pace
//! keeps a quarter more than that:
//!
//! - *gap + h*: a 429 with `retry_after` *h* for a send that started *gap*
//!   after the destination's previous send says the platform wanted at least
//!   *gap + h* between the two. Exact when the previous send filled the
//!   server's bucket; lower when the bucket had room left (after a slow burst).
//! - *span / k*: leaky-bucket servers (Synapse's `rc_message`, Telegram's
//!   per-chat limit) answer a refusal with the moment the bucket is back at
//!   its threshold. Between two such moments *span* apart, the `k` sends
//!   accepted in between refilled it exactly: the interval is *span / k*,
//!   whatever the delays on our side.
//!
//! Later refusals only ever raise the pace. From then on a send to the
//! destination starts no sooner than the pace after the previous one (claims
//! count, so concurrent sends are spaced too) and the rate converges to the
//! server's without any setting.
//!
//! A learned pace is forgotten [`MEMORY`] after the last 429 that confirmed it,
//! so a lifted limit is noticed (at the price of one 429 per period under a
//! steady one). It lives in the open handle, not on disk: another process, or
//! this one after a restart, learns it again from its own first 429.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::clock::later;

/// How long a learned pace holds after the last 429 that set or confirmed it.
pub(crate) const MEMORY: Duration = Duration::from_secs(2 * 60);

/// The longest pace learned (a refusal after a long silence is not a rate).
const LONGEST: Duration = Duration::from_secs(5 * 60);

/// Learned spacing per destination, in one open handle.
#[derive(Debug, Default)]
pub(crate) struct Pacing {
    paces: Mutex<HashMap<String, Pace>>,
}

#[derive(Debug, Clone, Copy)]
struct Pace {
    interval: Duration,
    /// When the pace is forgotten unless another 429 confirms it.
    until: DateTime<Utc>,
    /// The moment the last refusal named (its start plus its `retry_after`).
    allowed_at: DateTime<Utc>,
}

/// What one refusal tells about the destination's rate.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Refusal {
    /// How long after the destination's previous send the refused one
    /// started (`None`: no previous send on record).
    pub(crate) gap: Option<Duration>,
    /// The server's `retry_after`.
    pub(crate) hint: Duration,
    /// When the refused send started.
    pub(crate) started: DateTime<Utc>,
    /// The `span / k` estimate against the previous refusal, when there was
    /// one and sends were accepted in between.
    pub(crate) since_last: Option<Duration>,
}

impl Pacing {
    /// Learns from a refusal recorded at `now`.
    pub(crate) fn learn(&self, destination: &str, refusal: Refusal, now: DateTime<Utc>) {
        let by_gap = (refusal.gap.unwrap_or_default() + refusal.hint).as_micros();
        let by_rate = refusal.since_last.map_or(0, |d| d.as_micros());
        // A quarter more: the estimates come from below, and at exactly the
        // server's rate any jitter draws another refusal.
        let raw = by_gap.max(by_rate) * 5 / 4;
        let interval = Duration::from_micros(u64::try_from(raw).unwrap_or(u64::MAX)).min(LONGEST);
        let allowed_at = later(refusal.started, refusal.hint);
        let mut paces = self.lock();
        let pace = paces.entry(destination.to_owned()).or_insert(Pace {
            interval,
            until: now,
            allowed_at,
        });
        if pace.until <= now {
            // Forgotten: start over from what the server says now.
            pace.interval = interval;
        } else {
            pace.interval = pace.interval.max(interval);
        }
        pace.until = later(now, MEMORY);
        pace.allowed_at = allowed_at;
    }

    /// The moment the destination's last refusal named, while its pace holds.
    pub(crate) fn last_allowed(
        &self,
        destination: &str,
        now: DateTime<Utc>,
    ) -> Option<DateTime<Utc>> {
        self.lock()
            .get(destination)
            .filter(|pace| pace.until > now)
            .map(|pace| pace.allowed_at)
    }

    /// The spacing to keep between sends to `destination` at `now`, if one is learned.
    pub(crate) fn interval(&self, destination: &str, now: DateTime<Utc>) -> Option<Duration> {
        let mut paces = self.lock();
        match paces.get(destination) {
            Some(pace) if pace.until > now => Some(pace.interval),
            Some(_) => {
                paces.remove(destination);
                None
            }
            None => None,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Pace>> {
        // The map holds plain values; a panic elsewhere cannot leave it torn.
        self.paces
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000 + secs, 0).unwrap_or_default()
    }

    fn refusal(gap_ms: Option<u64>, hint_ms: u64, started: i64) -> Refusal {
        Refusal {
            gap: gap_ms.map(Duration::from_millis),
            hint: Duration::from_millis(hint_ms),
            started: at(started),
            since_last: None,
        }
    }

    #[test]
    fn the_pace_is_the_gap_plus_the_servers_wait_and_a_quarter() {
        let p = Pacing::default();
        p.learn("c", refusal(Some(300), 1700, 0), at(0));
        assert_eq!(p.interval("c", at(1)), Some(Duration::from_millis(2500)));
        assert_eq!(p.interval("other", at(1)), None);
        assert_eq!(
            p.last_allowed("c", at(1)),
            Some(at(0) + chrono::Duration::milliseconds(1700))
        );
    }

    #[test]
    fn two_refusals_give_the_rate_when_the_gap_underestimates_it() {
        let p = Pacing::default();
        p.learn(
            "c",
            Refusal {
                since_last: Some(Duration::from_secs(2)),
                ..refusal(Some(500), 100, 10)
            },
            at(10),
        );
        assert_eq!(p.interval("c", at(11)), Some(Duration::from_millis(2500)));
    }

    #[test]
    fn later_refusals_only_raise_it_and_it_is_forgotten_after_the_memory() {
        let p = Pacing::default();
        p.learn("c", refusal(None, 2000, 0), at(0));
        p.learn("c", refusal(None, 1000, 5), at(5));
        let two = Some(Duration::from_millis(2500));
        assert_eq!(p.interval("c", at(6)), two);
        let memory = MEMORY.as_secs() as i64;
        assert_eq!(p.interval("c", at(5 + memory - 1)), two);
        assert_eq!(p.interval("c", at(5 + memory)), None);
        assert_eq!(p.last_allowed("c", at(5 + memory)), None);
        // Relearned from scratch, not raised from the forgotten value.
        p.learn("c", refusal(None, 1000, 6 + memory), at(6 + memory));
        assert_eq!(
            p.interval("c", at(7 + memory)),
            Some(Duration::from_millis(1250))
        );
    }

    #[test]
    fn a_refusal_after_a_long_silence_is_bounded() {
        let p = Pacing::default();
        p.learn("c", refusal(Some(3_600_000), 1000, 0), at(0));
        assert_eq!(p.interval("c", at(1)), Some(LONGEST));
    }
}
