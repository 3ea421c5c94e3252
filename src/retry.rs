//! Backoff between retryable attempts.

use std::time::Duration;

use sha2::{Digest, Sha256};

/// How long to wait after a retryable failure before the next attempt.
///
/// A platform's `retry_after` (see [`SendError::retry_after`](crate::SendError::retry_after))
/// always wins when it is longer than the backoff.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backoff {
    /// Wait `delays[n - 1]` after the n-th failed attempt; the last entry repeats
    /// when there are more retries than entries. (The reference design used
    /// `[250 ms, 500 ms]`: with three attempts, a two-second outage failed every
    /// message sent during it.)
    Fixed(Vec<Duration>),
    /// Wait `base * 2^(n - 1)` after the n-th failed attempt, capped at `cap`.
    /// With `jitter`, the wait is drawn from `[wait / 2, wait]`, deterministically
    /// per item and attempt, so a burst of failures does not retry in lockstep.
    Exponential {
        /// The first wait.
        base: Duration,
        /// The longest wait.
        cap: Duration,
        /// Spread waits over the upper half of the interval.
        jitter: bool,
    },
}

/// The default: exponential from 1 s, doubling up to 10 min, jittered.
///
/// With the default 12 attempts the waits are about 1, 2, 4, … 512 s, then
/// 600 s: an item keeps trying for roughly 14 to 27 minutes (by jitter) before
/// it fails, long enough to ride out a platform or network outage of several
/// minutes, while a burst of failures does not retry in lockstep. Platform
/// pacing (`retry_after`) is separate: it uses no attempts and is bounded by
/// [`give_up_after`](crate::OutboxBuilder::give_up_after).
impl Default for Backoff {
    fn default() -> Self {
        Self::Exponential {
            base: Duration::from_secs(1),
            cap: Duration::from_secs(600),
            jitter: true,
        }
    }
}

impl Backoff {
    /// The wait after failed attempt number `attempt` (1-based) of the item `key`.
    pub fn delay(&self, attempt: u32, key: &str) -> Duration {
        let attempt = attempt.max(1);
        match self {
            Self::Fixed(delays) => {
                let index = (attempt as usize - 1).min(delays.len().saturating_sub(1));
                delays.get(index).copied().unwrap_or_default()
            }
            Self::Exponential { base, cap, jitter } => {
                let factor = 1u32.checked_shl(attempt - 1).unwrap_or(u32::MAX);
                let wait = base.saturating_mul(factor).min(*cap);
                if *jitter {
                    let half = wait / 2;
                    half + half.mul_f64(unit_fraction(key, attempt))
                } else {
                    wait
                }
            }
        }
    }

    pub(crate) fn validate(&self) -> crate::Result<()> {
        match self {
            Self::Fixed(delays) if delays.is_empty() => Err(crate::Error::invalid_config(
                "backoff",
                "a fixed backoff needs at least one delay",
            )),
            Self::Exponential { base, cap, .. } if base > cap => Err(crate::Error::invalid_config(
                "backoff",
                "base must not exceed cap",
            )),
            _ => Ok(()),
        }
    }
}

/// A stable pseudo-random number in `[0, 1)` derived from the key and attempt.
fn unit_fraction(key: &str, attempt: u32) -> f64 {
    let digest = Sha256::new()
        .chain_update(key.as_bytes())
        .chain_update(attempt.to_le_bytes())
        .finalize();
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&digest[..8]);
    (u64::from_le_bytes(bytes) >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn fixed_delays_repeat_the_last_entry() {
        let b = Backoff::Fixed(vec![MS(250), MS(500)]);
        assert_eq!(b.delay(1, "k"), MS(250));
        assert_eq!(b.delay(2, "k"), MS(500));
        assert_eq!(b.delay(3, "k"), MS(500), "the last delay repeats");
    }

    /// The default with the default 12 attempts rides out a multi-minute outage.
    #[test]
    fn the_default_keeps_trying_for_minutes_not_milliseconds() {
        let b = Backoff::default();
        let total: Duration = (1..12).map(|n| b.delay(n, "key")).sum();
        assert!(total >= Duration::from_secs(13 * 60), "{total:?}");
        assert!(total <= Duration::from_secs(28 * 60), "{total:?}");
        assert!(b.delay(1, "key") >= MS(500), "not a tight loop");
    }

    #[test]
    fn exponential_doubles_up_to_the_cap() {
        let b = Backoff::Exponential {
            base: MS(100),
            cap: MS(1000),
            jitter: false,
        };
        let waits: Vec<_> = (1..=6).map(|n| b.delay(n, "k")).collect();
        assert_eq!(
            waits,
            [MS(100), MS(200), MS(400), MS(800), MS(1000), MS(1000)]
        );
        assert_eq!(b.delay(200, "k"), MS(1000), "huge attempt numbers saturate");
    }

    #[test]
    fn jitter_stays_in_the_upper_half_and_varies_by_key() {
        let b = Backoff::Exponential {
            base: MS(1000),
            cap: MS(1000),
            jitter: true,
        };
        let waits: Vec<_> = (0..50).map(|i| b.delay(1, &format!("key-{i}"))).collect();
        assert!(waits.iter().all(|w| *w >= MS(500) && *w <= MS(1000)));
        assert!(
            waits.iter().any(|w| *w != waits[0]),
            "jitter must spread keys"
        );
        assert_eq!(b.delay(1, "key-3"), waits[3], "and be stable per key");
    }

    #[test]
    fn invalid_policies_are_rejected() {
        assert!(Backoff::Fixed(vec![]).validate().is_err());
        let b = Backoff::Exponential {
            base: MS(2),
            cap: MS(1),
            jitter: false,
        };
        assert!(b.validate().is_err());
    }
}
