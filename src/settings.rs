//! Settings that shape state every handle shares: the rate caps, how long items
//! stay live, retention, attempts and backoff.
//!
//! They are stored in the outbox (`outbox.json` and `outbox.journal` carry them,
//! see `store`), so a maintenance job or the operator CLI that opens the
//! directory with default builder values works with the bot's caps, not its own.
//!
//! The rules, applied by [`plan`] when a handle opens:
//!
//! - A new outbox stores every setting of the handle that creates it.
//! - A stored setting wins over a builder value. A builder value that differs
//!   logs a warning and is ignored, unless the builder says
//!   [`update_settings`](crate::OutboxBuilder::update_settings): then it replaces
//!   the stored one, with a `settings` audit record.
//! - An outbox created by an older release stores nothing yet: a setting is
//!   stored (audited) the first time a handle sets it explicitly; until then each
//!   handle uses its own value, as before.

use std::fmt::Write as _;
use std::time::Duration;

use crate::history::Retention;
use crate::order::Ordering;
use crate::rate::{RateLimit, RatePolicy};
use crate::retry::Backoff;

/// The settings an outbox stores: `None` for one nobody has stored yet.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Stored {
    pub(crate) rate_limit: Option<RateLimit>,
    pub(crate) rate_limit_for: Option<Vec<(String, RateLimit)>>,
    pub(crate) global_rate_limit: Option<RateLimit>,
    pub(crate) history_after: Option<Duration>,
    pub(crate) history_retention: Option<Retention>,
    pub(crate) max_attempts: Option<u32>,
    pub(crate) backoff: Option<Backoff>,
    pub(crate) give_up_after: Option<Duration>,
    pub(crate) ordering: Option<Ordering>,
}

impl Stored {
    /// Whether nothing is stored.
    pub(crate) fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// Every setting of `settings`, as a new outbox stores them.
    pub(crate) fn all_of(settings: &Settings) -> Self {
        Self {
            rate_limit: Some(settings.rates.per_destination),
            rate_limit_for: Some(settings.rates.overrides.clone()),
            global_rate_limit: settings.rates.global,
            history_after: Some(settings.history_after),
            history_retention: Some(settings.retention),
            max_attempts: Some(settings.max_attempts),
            backoff: Some(settings.backoff.clone()),
            give_up_after: Some(settings.give_up_after),
            ordering: Some(settings.ordering),
        }
    }

    /// Checks stored values as the builder checks its own.
    pub(crate) fn validate(&self) -> crate::Result<()> {
        if let Some(cap) = &self.rate_limit {
            cap.validate()?;
        }
        let overrides = RatePolicy {
            overrides: self.rate_limit_for.clone().unwrap_or_default(),
            global: self.global_rate_limit,
            ..RatePolicy::default()
        };
        overrides.validate()?;
        if self.max_attempts == Some(0) {
            return Err(crate::Error::invalid_config(
                "max_attempts",
                "must be at least 1",
            ));
        }
        if let Some(backoff) = &self.backoff {
            backoff.validate()?;
        }
        if self.give_up_after.is_some_and(|age| age.is_zero()) {
            return Err(crate::Error::invalid_config(
                "give_up_after",
                "must be positive",
            ));
        }
        Ok(())
    }
}

/// The settings in force for an outbox: what it stores, and for anything it
/// does not store (an outbox created by an older release), this handle's own
/// builder values. See [`Outbox::settings`](crate::Outbox::settings).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    pub(crate) rates: RatePolicy,
    pub(crate) history_after: Duration,
    pub(crate) retention: Retention,
    pub(crate) max_attempts: u32,
    pub(crate) backoff: Backoff,
    pub(crate) give_up_after: Duration,
    pub(crate) ordering: Ordering,
    /// The names of the settings the outbox stores (the rest are this handle's).
    pub(crate) stored: Vec<&'static str>,
}

impl Settings {
    /// The moment before which a terminal item counts as history, on every
    /// engine: at least `history_after` ago, and never inside the longest
    /// rate window (an item that still counts against a cap stays live).
    pub(crate) fn history_cutoff(
        &self,
        now: chrono::DateTime<chrono::Utc>,
    ) -> chrono::DateTime<chrono::Utc> {
        crate::clock::earlier(now, self.history_after.max(self.rates.longest_window()))
    }

    /// The cap for destinations no pattern matches.
    pub fn rate_limit(&self) -> RateLimit {
        self.rates.per_destination
    }

    /// The caps by destination pattern, first match wins.
    pub fn rate_limit_overrides(&self) -> &[(String, RateLimit)] {
        &self.rates.overrides
    }

    /// The cap that applies to `destination`.
    pub fn rate_limit_for(&self, destination: &str) -> RateLimit {
        self.rates.for_destination(destination)
    }

    /// The cap across all destinations, if any.
    pub fn global_rate_limit(&self) -> Option<RateLimit> {
        self.rates.global
    }

    /// How long a sent or failed item stays live before it may move to history
    /// (never less than the longest rate window).
    pub fn history_after(&self) -> Duration {
        self.history_after
    }

    /// How much history is kept.
    pub fn history_retention(&self) -> Retention {
        self.retention
    }

    /// Attempts allowed per item.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The wait after a retryable failure.
    pub fn backoff(&self) -> &Backoff {
        &self.backoff
    }

    /// How long after its enqueue an item that keeps failing retryably (or is
    /// kept waiting by a platform's `retry_after`) is given up.
    pub fn give_up_after(&self) -> Duration {
        self.give_up_after
    }

    /// Whether messages to one destination leave in enqueue order.
    pub fn ordering(&self) -> Ordering {
        self.ordering
    }

    /// Whether the outbox stores this setting (named as its builder method, e.g.
    /// `"rate_limit"`), rather than taking it from this handle's builder.
    pub fn is_stored(&self, name: &str) -> bool {
        self.stored.contains(&name)
    }

    /// These settings with `stored` laid over them.
    pub(crate) fn with_stored(&self, stored: &Stored) -> Self {
        let mut names = Vec::new();
        let mut pick = |name: &'static str, present: bool| {
            if present {
                names.push(name);
            }
        };
        pick("rate_limit", stored.rate_limit.is_some());
        pick("rate_limit_for", stored.rate_limit_for.is_some());
        pick("global_rate_limit", stored.global_rate_limit.is_some());
        pick("history_after", stored.history_after.is_some());
        pick("history_retention", stored.history_retention.is_some());
        pick("max_attempts", stored.max_attempts.is_some());
        pick("backoff", stored.backoff.is_some());
        pick("give_up_after", stored.give_up_after.is_some());
        pick("ordering", stored.ordering.is_some());
        Self {
            rates: RatePolicy {
                per_destination: stored.rate_limit.unwrap_or(self.rates.per_destination),
                overrides: stored
                    .rate_limit_for
                    .clone()
                    .unwrap_or_else(|| self.rates.overrides.clone()),
                global: stored.global_rate_limit.or(self.rates.global),
            },
            history_after: stored.history_after.unwrap_or(self.history_after),
            retention: stored.history_retention.unwrap_or(self.retention),
            max_attempts: stored.max_attempts.unwrap_or(self.max_attempts),
            backoff: stored
                .backoff
                .clone()
                .unwrap_or_else(|| self.backoff.clone()),
            give_up_after: stored.give_up_after.unwrap_or(self.give_up_after),
            ordering: stored.ordering.unwrap_or(self.ordering),
            stored: names,
        }
    }
}

/// What opening a handle does to the stored settings.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    /// The settings to store, when they change.
    pub(crate) store: Option<Stored>,
    /// What changed, for the audit record (`None` when nothing is recorded:
    /// the initial settings of a new outbox are its first state, not a change).
    pub(crate) note: Option<String>,
    /// Builder values ignored because another value is stored, for a warning.
    pub(crate) ignored: Vec<String>,
}

/// Decides what a handle opening with `builder` settings (of which `explicit`
/// were set by the caller) does to what the outbox stores.
pub(crate) fn plan(
    stored: &Stored,
    builder: &Settings,
    explicit: &Stored,
    update: bool,
    new_outbox: bool,
) -> Plan {
    if new_outbox && stored.is_empty() {
        return Plan {
            store: Some(Stored::all_of(builder)),
            ..Plan::default()
        };
    }
    let mut next = stored.clone();
    let mut m = Merge {
        update,
        note: String::new(),
        ignored: Vec::new(),
    };
    m.field(
        &mut next.rate_limit,
        explicit.rate_limit.as_ref(),
        "rate_limit",
        show_cap,
    );
    m.field(
        &mut next.rate_limit_for,
        explicit.rate_limit_for.as_ref(),
        "rate_limit_for",
        |v| show_overrides(v),
    );
    m.field(
        &mut next.global_rate_limit,
        explicit.global_rate_limit.as_ref(),
        "global_rate_limit",
        show_cap,
    );
    m.field(
        &mut next.history_after,
        explicit.history_after.as_ref(),
        "history_after",
        |d| show_duration(*d),
    );
    m.field(
        &mut next.history_retention,
        explicit.history_retention.as_ref(),
        "history_retention",
        show_retention,
    );
    m.field(
        &mut next.max_attempts,
        explicit.max_attempts.as_ref(),
        "max_attempts",
        u32::to_string,
    );
    m.field(
        &mut next.backoff,
        explicit.backoff.as_ref(),
        "backoff",
        show_backoff,
    );
    m.field(
        &mut next.give_up_after,
        explicit.give_up_after.as_ref(),
        "give_up_after",
        |d| show_duration(*d),
    );
    m.field(
        &mut next.ordering,
        explicit.ordering.as_ref(),
        "ordering",
        |o| o.as_str().to_owned(),
    );
    let Merge { note, ignored, .. } = m;
    if note.is_empty() {
        return Plan {
            ignored,
            ..Plan::default()
        };
    }
    Plan {
        store: Some(next),
        note: Some(note),
        ignored,
    }
}

/// What [`plan`] has decided so far.
struct Merge {
    update: bool,
    note: String,
    ignored: Vec<String>,
}

impl Merge {
    /// One setting of [`plan`]: store `wanted` where nothing is stored, or where
    /// `update` says so; otherwise note that it is ignored.
    fn field<T: PartialEq + Clone>(
        &mut self,
        stored: &mut Option<T>,
        wanted: Option<&T>,
        name: &str,
        show: impl Fn(&T) -> String,
    ) {
        let Some(wanted) = wanted else { return };
        let old = match stored.as_ref() {
            Some(old) if old == wanted => return,
            Some(old) if !self.update => {
                self.ignored.push(format!(
                    "{name}: the builder says {}, the outbox stores {}",
                    show(wanted),
                    show(old)
                ));
                return;
            }
            Some(old) => show(old),
            None => "not stored".to_owned(),
        };
        if !self.note.is_empty() {
            self.note.push_str("; ");
        }
        let _ = write!(self.note, "{name} {old} -> {}", show(wanted));
        *stored = Some(wanted.clone());
    }
}

fn show_duration(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}s", d.as_secs_f64())
    }
}

fn show_cap(cap: &RateLimit) -> String {
    format!("{}/{}", cap.count, show_duration(cap.window))
}

fn show_overrides(overrides: &[(String, RateLimit)]) -> String {
    let parts: Vec<String> = overrides
        .iter()
        .map(|(pattern, cap)| format!("{pattern:?}={}", show_cap(cap)))
        .collect();
    format!("[{}]", parts.join(", "))
}

fn show_retention(retention: &Retention) -> String {
    match retention {
        Retention::KeepAll => "keep_all".to_owned(),
        Retention::MaxAge(age) => format!("max_age {}", show_duration(*age)),
        Retention::MaxSegments(n) => format!("max_segments {n}"),
    }
}

fn show_backoff(backoff: &Backoff) -> String {
    match backoff {
        Backoff::Fixed(delays) => {
            let parts: Vec<String> = delays.iter().map(|d| show_duration(*d)).collect();
            format!("fixed [{}]", parts.join(", "))
        }
        Backoff::Exponential { base, cap, jitter } => format!(
            "exponential base {} cap {}{}",
            show_duration(*base),
            show_duration(*cap),
            if *jitter { " with jitter" } else { "" }
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults() -> Settings {
        Settings {
            rates: RatePolicy::default(),
            history_after: Duration::from_secs(86_400),
            retention: Retention::KeepAll,
            max_attempts: 3,
            backoff: Backoff::default(),
            give_up_after: Duration::from_secs(86_400),
            ordering: Ordering::PerDestination,
            stored: Vec::new(),
        }
    }

    fn cap(count: u32, secs: u64) -> RateLimit {
        RateLimit {
            count,
            window: Duration::from_secs(secs),
        }
    }

    #[test]
    fn a_new_outbox_stores_every_setting_without_an_audit_note() {
        let plan = plan(
            &Stored::default(),
            &defaults(),
            &Stored::default(),
            false,
            true,
        );
        let stored = plan.store.expect("stored");
        // The documented default: one send per destination per second.
        assert_eq!(stored.rate_limit, Some(cap(1, 1)));
        assert_eq!(stored.max_attempts, Some(3));
        assert_eq!(plan.note, None);
    }

    #[test]
    fn a_stored_value_wins_over_a_different_builder_value() {
        let stored = Stored {
            rate_limit: Some(cap(1, 259_200)),
            ..Stored::default()
        };
        let explicit = Stored {
            rate_limit: Some(cap(10, 60)),
            ..Stored::default()
        };
        let plan = plan(&stored, &defaults(), &explicit, false, false);
        assert!(plan.store.is_none());
        assert_eq!(plan.ignored.len(), 1, "{:?}", plan.ignored);
        assert!(plan.ignored[0].contains("rate_limit"));
    }

    #[test]
    fn update_replaces_only_the_values_set_and_says_what_changed() {
        let stored = Stored {
            rate_limit: Some(cap(1, 60)),
            max_attempts: Some(5),
            ..Stored::default()
        };
        let explicit = Stored {
            rate_limit: Some(cap(2, 60)),
            ..Stored::default()
        };
        let plan = plan(&stored, &defaults(), &explicit, true, false);
        let next = plan.store.expect("changed");
        assert_eq!(
            (next.rate_limit, next.max_attempts),
            (Some(cap(2, 60)), Some(5))
        );
        assert_eq!(plan.note.as_deref(), Some("rate_limit 1/60s -> 2/60s"));
    }

    #[test]
    fn an_older_outbox_stores_what_a_handle_sets_explicitly() {
        let explicit = Stored {
            history_after: Some(Duration::from_secs(7)),
            ..Stored::default()
        };
        let plan = plan(&Stored::default(), &defaults(), &explicit, false, false);
        let next = plan.store.expect("adopted");
        assert_eq!(next.history_after, Some(Duration::from_secs(7)));
        assert_eq!(next.rate_limit, None, "defaults are not stored");
        assert_eq!(plan.note.as_deref(), Some("history_after not stored -> 7s"));
    }

    #[test]
    fn stored_values_are_laid_over_the_handles_own() {
        let stored = Stored {
            rate_limit: Some(cap(1, 5)),
            ..Stored::default()
        };
        let settings = defaults().with_stored(&stored);
        assert_eq!(settings.rate_limit(), cap(1, 5));
        assert_eq!(settings.max_attempts(), 3);
        assert!(settings.is_stored("rate_limit"));
        assert!(!settings.is_stored("max_attempts"));
    }
}
