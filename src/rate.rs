//! Sliding-window rate caps: per destination (with overrides by destination
//! pattern) and, optionally, across all destinations.

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::clock::{earlier, later};

/// At most `count` sends per destination in any sliding `window`.
///
/// Sends are counted from the persisted `sent_at` times (and the claim times of
/// sends in progress), so a cap holds across restarts and across processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    /// Sends allowed per window.
    pub count: u32,
    /// The window's length.
    pub window: Duration,
}

impl Default for RateLimit {
    /// One send per destination per second: the per-chat rate the platforms
    /// publish (Telegram: "about 1 message per second" in one chat; Slack: "one
    /// message per second per channel").
    ///
    /// One per second rather than a burst (*N* per *N* s): both platforms
    /// allow short bursts but promise none, and a sliding window pays for a
    /// burst afterwards (after three at once, the fourth waits three seconds).
    /// A bot's answer of several messages arrives a second apart, as a person
    /// would type it, and a chat quiet for a second sends at once. Different
    /// chats never hold each other back.
    ///
    /// It is the per-chat limit only. Telegram also takes at most 20 messages
    /// a minute in a group (`rate_limit_for("-*", 20, Duration::from_secs(60))`),
    /// and a Matrix homeserver sets its own rate (Synapse's default: 0.2 a
    /// second after a burst of 10), which the outbox learns from the server's
    /// first `retry_after` (adaptive pacing) without a setting.
    ///
    /// Until this release the default was 10 sends per 60 s, the reference
    /// design's. The cap is a stored setting: an outbox created with that
    /// default keeps it; `rate_limit(10, Duration::from_secs(60))` with
    /// [`update_settings`](crate::OutboxBuilder::update_settings) picks it for
    /// any outbox.
    fn default() -> Self {
        Self {
            count: 1,
            window: Duration::from_secs(1),
        }
    }
}

impl RateLimit {
    /// `None` when a send may start at `now`; otherwise the exact moment a slot frees.
    ///
    /// `recent` are the send (or claim) times of the destination; times at or
    /// before `now - window` no longer count.
    pub(crate) fn next_free_slot(
        &self,
        now: DateTime<Utc>,
        recent: impl IntoIterator<Item = DateTime<Utc>>,
    ) -> Option<DateTime<Utc>> {
        let cutoff = earlier(now, self.window);
        self.free_after(nth_newest(recent, cutoff, self.count as usize))
    }

    /// The moment a slot frees when the `count`-th newest time in the window
    /// (see [`nth_newest`]) is `nth_newest`: that send must age out for fewer
    /// than `count` to remain. `None` (fewer than `count` in the window): a
    /// send may start now. Every cap decision ends here.
    pub(crate) fn free_after(&self, nth_newest: Option<DateTime<Utc>>) -> Option<DateTime<Utc>> {
        nth_newest.map(|at| later(at, self.window))
    }

    pub(crate) fn validate(&self) -> crate::Result<()> {
        if self.count == 0 {
            return Err(crate::Error::invalid_config(
                "rate_limit",
                "count must be at least 1",
            ));
        }
        if self.window.is_zero() {
            return Err(crate::Error::invalid_config(
                "rate_limit",
                "window must be positive",
            ));
        }
        Ok(())
    }
}

/// The `n`-th newest (1: the newest) of `times` later than `after`, or `None`
/// when fewer than `n` are. A cap of `count` per window is reached at `now`
/// exactly when the `count`-th newest time after `now - window` exists, and it
/// frees once that time ages out: so a cap needs only the `count` newest
/// times of its window, never all of them (see `Txn::nth_newest_time`).
pub(crate) fn nth_newest(
    times: impl IntoIterator<Item = DateTime<Utc>>,
    after: DateTime<Utc>,
    n: usize,
) -> Option<DateTime<Utc>> {
    if n == 0 {
        return None;
    }
    let mut later_ones: Vec<DateTime<Utc>> = times.into_iter().filter(|at| *at > after).collect();
    if later_ones.len() < n {
        return None;
    }
    let (_, nth, _) = later_ones.select_nth_unstable_by(n - 1, |a, b| b.cmp(a));
    Some(*nth)
}

/// One destination's rate window as [`Outbox::rate_windows`](crate::Outbox::rate_windows)
/// measured it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DestinationWindow {
    /// The destination.
    pub destination: String,
    /// The cap it was measured against.
    pub cap: RateLimit,
    /// Sends in the window ending now: sends, sends in progress, and sends that
    /// may have left (ambiguous failures).
    pub sends_in_window: usize,
    /// When the window has room again, if it is full now.
    pub next_free_slot: Option<DateTime<Utc>>,
    /// Items queued for it.
    pub queued: usize,
    /// Until when the platform asked not to send to it (`retry_after`), if that
    /// is still ahead.
    pub cooldown_until: Option<DateTime<Utc>>,
}

/// The caps the outbox enforces: a default per destination, overrides for
/// destinations matching a pattern, and an optional cap across all destinations.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct RatePolicy {
    pub(crate) per_destination: RateLimit,
    /// `(pattern, cap)`, first match wins.
    pub(crate) overrides: Vec<(String, RateLimit)>,
    pub(crate) global: Option<RateLimit>,
}

impl RatePolicy {
    /// The cap that applies to `destination`.
    pub(crate) fn for_destination(&self, destination: &str) -> RateLimit {
        self.overrides
            .iter()
            .find(|(pattern, _)| glob_match(pattern, destination))
            .map_or(self.per_destination, |(_, cap)| *cap)
    }

    /// The longest window of any cap: sends older than this count against none.
    pub(crate) fn longest_window(&self) -> std::time::Duration {
        self.overrides
            .iter()
            .map(|(_, cap)| cap.window)
            .chain(self.global.map(|cap| cap.window))
            .fold(self.per_destination.window, std::cmp::Ord::max)
    }

    pub(crate) fn validate(&self) -> crate::Result<()> {
        self.per_destination.validate()?;
        for (pattern, cap) in &self.overrides {
            if pattern.is_empty() {
                return Err(crate::Error::invalid_config(
                    "rate_limit_for",
                    "the destination pattern must not be empty",
                ));
            }
            cap.validate()?;
        }
        if let Some(cap) = &self.global {
            cap.validate()?;
        }
        Ok(())
    }
}

/// Whether `text` matches `pattern`, where `*` matches any run of characters
/// (including none) and every other character matches itself.
pub(crate) fn glob_match(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    // Greedy matching with backtracking to the last `*`: O(len(p) * len(t)) at worst.
    let (mut pi, mut ti) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ti));
            pi += 1;
        } else if pi < p.len() && p[pi] == t[ti] {
            pi += 1;
            ti += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000 + secs, 0).unwrap()
    }

    fn cap(count: u32, secs: u64) -> RateLimit {
        RateLimit {
            count,
            window: Duration::from_secs(secs),
        }
    }

    #[test]
    fn under_the_cap_is_free() {
        assert_eq!(cap(3, 60).next_free_slot(t(100), [t(50), t(90)]), None);
    }

    #[test]
    fn at_the_cap_the_oldest_send_decides() {
        let free = cap(2, 60).next_free_slot(t(100), [t(90), t(50)]);
        assert_eq!(free, Some(t(110)));
    }

    #[test]
    fn over_the_cap_enough_sends_must_age_out() {
        // Four sends in the window with a cap of two: three must expire.
        let free = cap(2, 60).next_free_slot(t(100), [t(41), t(42), t(43), t(44)]);
        assert_eq!(free, Some(t(103)));
    }

    #[test]
    fn a_send_exactly_one_window_ago_no_longer_counts() {
        assert_eq!(cap(1, 60).next_free_slot(t(100), [t(40)]), None);
        assert_eq!(cap(1, 60).next_free_slot(t(100), [t(41)]), Some(t(101)));
    }

    #[test]
    fn glob_patterns_match_as_documented() {
        assert!(glob_match("-*", "-100123"));
        assert!(!glob_match("-*", "100123"));
        assert!(glob_match("chat-42", "chat-42"));
        assert!(!glob_match("chat-42", "chat-420"));
        assert!(glob_match("*@example.com", "ops@example.com"));
        assert!(glob_match("a*b*c", "aXXbYYc"));
        assert!(!glob_match("a*b*c", "aXXbYY"));
        assert!(glob_match("*", ""));
    }

    #[test]
    fn the_first_matching_override_wins_and_the_default_covers_the_rest() {
        let policy = RatePolicy {
            per_destination: cap(1, 1),
            overrides: vec![("-100*".into(), cap(30, 1)), ("-*".into(), cap(20, 60))],
            global: None,
        };
        assert_eq!(policy.for_destination("-1001234"), cap(30, 1));
        assert_eq!(policy.for_destination("-42"), cap(20, 60));
        assert_eq!(policy.for_destination("42"), cap(1, 1));
    }

    #[test]
    fn zero_values_are_rejected() {
        assert!(cap(0, 60).validate().is_err());
        assert!(cap(1, 0).validate().is_err());
    }
}
