//! Time seams: where "now" comes from and how the outbox waits between retries.
//!
//! Production code uses [`SystemClock`] and [`ThreadSleeper`]. Tests (yours and
//! ours) use [`ManualClock`], which is both a clock and a sleeper: sleeping on it
//! advances its time instantly, so backoff and rate-window behaviour can be
//! tested without real waiting.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};

/// A source of the current UTC time.
pub trait Clock: Send + Sync {
    /// The current time.
    fn now(&self) -> DateTime<Utc>;
}

/// Something that can block the calling thread for a while (used between inline retries).
pub trait Sleeper: Send + Sync {
    /// Wait for `duration`.
    fn sleep(&self, duration: Duration);
}

/// The operating system's wall clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// Sleeps with [`std::thread::sleep`].
#[derive(Debug, Default, Clone, Copy)]
pub struct ThreadSleeper;

impl Sleeper for ThreadSleeper {
    fn sleep(&self, duration: Duration) {
        std::thread::sleep(duration);
    }
}

/// A clock that only moves when told to; sleeping on it advances it.
///
/// Clones share one time, so a test can keep a handle while the outbox holds another.
///
/// ```
/// use durable_outbox::{Clock, ManualClock, Sleeper};
/// use std::time::Duration;
///
/// let clock = ManualClock::at("2026-01-01T00:00:00Z")?;
/// let start = clock.now();
/// clock.sleep(Duration::from_secs(5));
/// assert_eq!((clock.now() - start).num_seconds(), 5);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct ManualClock {
    now: Arc<Mutex<DateTime<Utc>>>,
}

impl ManualClock {
    /// A clock stopped at `start`.
    pub fn new(start: DateTime<Utc>) -> Self {
        Self {
            now: Arc::new(Mutex::new(start)),
        }
    }

    /// A clock stopped at an RFC 3339 time such as `2026-01-01T00:00:00Z`.
    ///
    /// # Errors
    ///
    /// Returns the parse error when `rfc3339` is not a valid RFC 3339 timestamp.
    pub fn at(rfc3339: &str) -> Result<Self, chrono::ParseError> {
        Ok(Self::new(
            DateTime::parse_from_rfc3339(rfc3339)?.with_timezone(&Utc),
        ))
    }

    /// Move the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        let mut now = self.now.lock().unwrap_or_else(PoisonError::into_inner);
        *now = later(*now, by);
    }

    /// Set the clock to `to` (which may be in the past).
    pub fn set(&self, to: DateTime<Utc>) {
        *self.now.lock().unwrap_or_else(PoisonError::into_inner) = to;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        *self.now.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Sleeper for ManualClock {
    fn sleep(&self, duration: Duration) {
        self.advance(duration);
    }
}

impl fmt::Debug for ManualClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ManualClock")
            .field("now", &self.now())
            .finish()
    }
}

/// Formats a time the way `outbox.json` and `audit.jsonl` store it:
/// `2026-01-31T12:00:00.123456Z` (UTC, microseconds, `Z`), as the reference design does.
pub(crate) fn format_timestamp(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// Parses any RFC 3339 timestamp (with `Z` or an offset) into UTC.
pub(crate) fn parse_timestamp(text: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(text)
        .ok()
        .map(|t| t.with_timezone(&Utc))
}

/// The latest time the outbox stores: the end of year 9999, the last one RFC 3339
/// (and so `outbox.json`) can write. Later times saturate to it.
pub(crate) fn latest() -> DateTime<Utc> {
    DateTime::<Utc>::from_timestamp(253_402_300_799, 999_999_000)
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// `at + d`, saturating at [`latest`] instead of overflowing: a platform's
/// `Retry-After` is outside input and may be absurd.
pub(crate) fn later(at: DateTime<Utc>, d: Duration) -> DateTime<Utc> {
    chrono::Duration::from_std(d)
        .ok()
        .and_then(|d| at.checked_add_signed(d))
        .map_or_else(latest, |t| t.min(latest()))
}

/// `at - d`, saturating at the earliest representable time.
pub(crate) fn earlier(at: DateTime<Utc>, d: Duration) -> DateTime<Utc> {
    chrono::Duration::from_std(d)
        .ok()
        .and_then(|d| at.checked_sub_signed(d))
        .unwrap_or(DateTime::<Utc>::MIN_UTC)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_round_trip_in_the_reference_format() {
        let t = parse_timestamp("2026-03-04T05:06:07.089123Z").unwrap();
        assert_eq!(format_timestamp(t), "2026-03-04T05:06:07.089123Z");
    }

    #[test]
    fn offsets_are_normalised_to_utc() {
        let t = parse_timestamp("2026-03-04T07:06:07+02:00").unwrap();
        assert_eq!(format_timestamp(t), "2026-03-04T05:06:07.000000Z");
    }

    #[test]
    fn far_future_arithmetic_saturates_at_a_storable_time() {
        let now = parse_timestamp("2026-01-01T00:00:00Z").unwrap();
        let far = later(now, Duration::MAX);
        assert_eq!(far, latest());
        assert_eq!(
            parse_timestamp(&format_timestamp(far)),
            Some(far),
            "it round-trips"
        );
        assert!(earlier(now, Duration::MAX) < now);
    }

    #[test]
    fn garbage_is_not_a_timestamp() {
        assert!(parse_timestamp("yesterday").is_none());
    }
}
