//! Adaptive per-destination pacing, learned from the platform's `retry_after`.
//!
//! A cooldown alone (wait until the `retry_after` moment, then go) releases a
//! herd: every item held back for the destination becomes due at the same
//! instant, the first is accepted and the rest draw fresh 429s, each burning an
//! attempt. Pacing spaces sends to a destination instead.
//!
//! The estimate: a 429 with `retry_after` *h* for a send that started *gap*
//! after the destination's previous send says the platform wanted *gap + h*
//! between the two; the pace keeps a quarter more than that. Servers that limit with a leaky or token bucket (Synapse's
//! `rc_message`, Telegram's per-chat limit) refill one slot per fixed interval;
//! after a burst, the first refusal arrives right after an accepted send, so
//! *gap* is near zero and *h* is that interval. Later refusals only ever raise
//! the estimate. From then on a send to the destination starts no sooner than
//! the interval after the previous one (claims count, so concurrent sends are
//! spaced too) and the rate converges to the server's without any setting.
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
}

impl Pacing {
    /// Learns from a 429 at `now` whose send started `gap` after the
    /// destination's previous send (`None`: no previous send is on record) and
    /// whose `retry_after` was `hint`.
    pub(crate) fn learn(
        &self,
        destination: &str,
        gap: Option<Duration>,
        hint: Duration,
        now: DateTime<Utc>,
    ) {
        // A quarter more than the estimate: it comes from below (any slack
        // in the server's bucket shortens it), and at exactly the server's
        // rate any jitter draws another refusal.
        let estimate = (gap.unwrap_or_default() + hint).as_micros() * 5 / 4;
        let interval =
            Duration::from_micros(u64::try_from(estimate).unwrap_or(u64::MAX)).min(LONGEST);
        let mut paces = self.lock();
        let pace = paces.entry(destination.to_owned()).or_insert(Pace {
            interval,
            until: now,
        });
        if pace.until <= now {
            // Forgotten: start over from what the server says now.
            pace.interval = interval;
        } else {
            pace.interval = pace.interval.max(interval);
        }
        pace.until = later(now, MEMORY);
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

    #[test]
    fn the_pace_is_the_gap_plus_the_servers_wait() {
        let p = Pacing::default();
        p.learn(
            "c",
            Some(Duration::from_millis(300)),
            Duration::from_millis(1700),
            at(0),
        );
        assert_eq!(p.interval("c", at(1)), Some(Duration::from_millis(2500)));
        assert_eq!(p.interval("other", at(1)), None);
    }

    #[test]
    fn later_refusals_only_raise_it_and_it_is_forgotten_after_the_memory() {
        let p = Pacing::default();
        p.learn("c", None, Duration::from_secs(2), at(0));
        p.learn("c", None, Duration::from_secs(1), at(5));
        assert_eq!(p.interval("c", at(6)), Some(Duration::from_millis(2500)));
        let memory = MEMORY.as_secs() as i64;
        assert_eq!(
            p.interval("c", at(5 + memory - 1)),
            Some(Duration::from_millis(2500))
        );
        assert_eq!(p.interval("c", at(5 + memory)), None);
        // Relearned from scratch, not raised from the forgotten value.
        p.learn("c", None, Duration::from_secs(1), at(6 + memory));
        assert_eq!(
            p.interval("c", at(7 + memory)),
            Some(Duration::from_millis(1250))
        );
    }

    #[test]
    fn a_refusal_after_a_long_silence_is_bounded() {
        let p = Pacing::default();
        p.learn(
            "c",
            Some(Duration::from_secs(3600)),
            Duration::from_secs(1),
            at(0),
        );
        assert_eq!(p.interval("c", at(1)), Some(LONGEST));
    }
}
