//! The on-disk format of `outbox.json`, kept apart from the API types.
//!
//! Version 1 is the reference (Python) design's file; version 2 is version 1 plus
//! optional fields: `audit_head` (with `mac` in keyed mode), `generation`, `settings`
//! and `cooldowns` at the top level, and `claim_owner`, `claimed_at_utc`,
//! `cooldown_until_utc`, `enqueue_seq`, `failure_class`, `last_audit_id`, `maybe_sent_at_utc` on
//! items. This crate reads
//! both and writes version 2. Item keys are written sorted, as the reference does.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::message::{DEFAULT_DIRECTION, DEFAULT_LANE};

/// The version this release writes.
pub(crate) const CURRENT_VERSION: u64 = 2;

/// The whole file.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FileV1 {
    pub(crate) version: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) audit_head: Option<HeadV1>,
    /// Which journal continues this snapshot (`outbox.journal` with the same
    /// generation); bumped by every compaction.
    #[serde(default)]
    pub(crate) generation: u64,
    /// The stored settings (see `settings`); absent before they were stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) settings: Option<SettingsV1>,
    /// Per destination, the moment a platform's `retry_after` lets sends resume
    /// (only moments still ahead when the snapshot was written).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub(crate) cooldowns: BTreeMap<String, String>,
    pub(crate) items: Vec<ItemV1>,
}

/// The stored settings. Every field is optional: a setting nobody stored yet is
/// absent. Durations are `{"secs": u64, "nanos": u32}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SettingsV1 {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) rate_limit: Option<CapV1>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) rate_limit_for: Option<Vec<PatternCapV1>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) global_rate_limit: Option<CapV1>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) history_after: Option<Duration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) history_retention: Option<RetentionV1>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) max_attempts: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) backoff: Option<BackoffV1>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) give_up_after: Option<Duration>,
    /// `per_destination` or `unordered`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) ordering: Option<String>,
}

/// A rate cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct CapV1 {
    pub(crate) count: u32,
    pub(crate) window: Duration,
}

/// A rate cap for destinations matching a pattern.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PatternCapV1 {
    pub(crate) pattern: String,
    pub(crate) count: u32,
    pub(crate) window: Duration,
}

/// History retention: `"keep_all"`, `{"max_age": duration}` or `{"max_segments": n}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub(crate) enum RetentionV1 {
    KeepAll,
    MaxAge(Duration),
    MaxSegments(u64),
}

/// Backoff: `{"fixed": [durations]}` or `{"exponential": {"base", "cap", "jitter"}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub(crate) enum BackoffV1 {
    Fixed(Vec<Duration>),
    Exponential {
        base: Duration,
        cap: Duration,
        jitter: bool,
    },
}

/// Only the version, for a helpful error when the rest does not parse.
#[derive(Deserialize)]
pub(crate) struct VersionProbe {
    pub(crate) version: Option<u64>,
}

/// The audit head as recorded in the file.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct HeadV1 {
    pub(crate) hash: String,
    /// Keyed audit logs only: HMAC-SHA-256 under the audit key over the head's
    /// seq and hash and the file's generation (see `audit::anchor`), so the
    /// head cannot be moved back over a cut-off tail without the key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) mac: Option<String>,
    /// Where the head record ends in `audit.jsonl` (bytes), so opening can
    /// resume verification there instead of re-reading the whole log.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) offset: Option<u64>,
    pub(crate) seq: u64,
}

/// One item, with the reference design's field names (alphabetical, as it writes them).
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ItemV1 {
    pub(crate) attempts: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) claim_owner: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) claimed_at_utc: Option<String>,
    pub(crate) connector: String,
    pub(crate) content: String,
    pub(crate) content_hash: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) cooldown_until_utc: Option<String>,
    pub(crate) created_at_utc: String,
    pub(crate) destination: String,
    #[serde(default = "default_direction")]
    pub(crate) direction: String,
    pub(crate) dispatch_claimed: bool,
    /// The item's place in enqueue order (per-destination delivery order).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) enqueue_seq: Option<u64>,
    #[serde(default)]
    pub(crate) error_code: Option<String>,
    /// The class of the last failure (`retryable`, `permanent`, `ambiguous`);
    /// absent in files written before it was stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) failure_class: Option<String>,
    pub(crate) grant_id: String,
    pub(crate) idempotency_key: String,
    #[serde(default = "default_lane")]
    pub(crate) lane: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) last_audit_id: Option<String>,
    /// The claim time of a send that may have reached the platform (an ambiguous
    /// failure): it counts against the destination's caps like a send.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) maybe_sent_at_utc: Option<String>,
    #[serde(default)]
    pub(crate) next_attempt_at_utc: Option<String>,
    #[serde(default)]
    pub(crate) risk_class: Option<String>,
    #[serde(default)]
    pub(crate) sent_at_utc: Option<String>,
    pub(crate) state: String,
    #[serde(default)]
    pub(crate) transport_ref: Option<String>,
    pub(crate) updated_at_utc: String,
}

fn default_lane() -> String {
    DEFAULT_LANE.to_owned()
}

fn default_direction() -> String {
    DEFAULT_DIRECTION.to_owned()
}
