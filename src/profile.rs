//! Where a file-engine transaction spends its time, for tuning group commit
//! (feature `commit-profile`, diagnostics only); without the feature every
//! call here compiles to nothing.
//!
//! The counters are process-wide sums (a bench runs one handle per process).
//! A handle that closes with `DURABLE_OUTBOX_COMMIT_PROFILE` set prints them
//! to stderr as one JSON line and starts them again from zero.

/// One timed span of the commit path.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Span {
    /// A writing transaction, from `transact` to "durable".
    TxnTotal,
    /// Waiting for a draining group to let new transactions in.
    TxnWaitOpen,
    /// Waiting for the in-process mutex (and the `flock`, when not held).
    TxnLockWait,
    /// Holding the lock: the freshness check (and catch-up when stale).
    TxnFresh,
    /// Holding the lock: the rules.
    TxnRules,
    /// Holding the lock: encoding and writing the journal entry.
    TxnAppend,
    /// Within the append: building and encoding the entry's line.
    AppendEncode,
    /// Within the append: extending the journal if needed, and keeping the
    /// line for the group's leader to write.
    AppendWrite,
    /// Within the append: applying the entry to the in-memory state.
    AppendApply,
    /// From writing the entry to "durable", when this thread led no sync.
    FollowerWait,
    /// From writing the entry to "durable", when this thread led a sync.
    LeaderWait,
    /// A leader waiting for the lock before its sync.
    LeadLockWait1,
    /// A leader holding the lock before its sync.
    LeadHold1,
    /// A leader writing its group's entries (one `pwrite`).
    GroupWrite,
    /// The `fdatasync` itself.
    Sync,
    /// A leader waiting for the lock after its sync.
    LeadLockWait2,
    /// A leader holding the lock after its sync (audit append, release).
    LeadHold2,
    /// One hold of the `flock`, from taking it to letting it go.
    Flock,
}

#[cfg(feature = "commit-profile")]
mod enabled {
    use super::Span;
    use std::fmt::Write as _;
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    use std::time::Instant;

    const SPANS: [(&str, Span); 18] = [
        ("txn_total", Span::TxnTotal),
        ("txn_wait_open", Span::TxnWaitOpen),
        ("txn_lock_wait", Span::TxnLockWait),
        ("txn_fresh", Span::TxnFresh),
        ("txn_rules", Span::TxnRules),
        ("txn_append", Span::TxnAppend),
        ("append_encode", Span::AppendEncode),
        ("append_write", Span::AppendWrite),
        ("append_apply", Span::AppendApply),
        ("follower_wait", Span::FollowerWait),
        ("leader_wait", Span::LeaderWait),
        ("lead_lock_wait1", Span::LeadLockWait1),
        ("lead_hold1", Span::LeadHold1),
        ("group_write", Span::GroupWrite),
        ("sync", Span::Sync),
        ("lead_lock_wait2", Span::LeadLockWait2),
        ("lead_hold2", Span::LeadHold2),
        ("flock", Span::Flock),
    ];
    /// Group sizes counted one by one up to this; larger ones share the last bucket.
    const GROUP_BUCKETS: usize = 17;

    static COUNT: [AtomicU64; SPANS.len()] = [const { AtomicU64::new(0) }; SPANS.len()];
    static NANOS: [AtomicU64; SPANS.len()] = [const { AtomicU64::new(0) }; SPANS.len()];
    static GROUPS: [AtomicU64; GROUP_BUCKETS] = [const { AtomicU64::new(0) }; GROUP_BUCKETS];

    /// A moment on the commit path.
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct Mark(Instant);

    impl Mark {
        pub(crate) fn now() -> Self {
            Self(Instant::now())
        }

        /// Adds the time since this mark to `span`; returns a mark for now.
        pub(crate) fn end(self, span: Span) -> Self {
            let now = Instant::now();
            let nanos = u64::try_from((now - self.0).as_nanos()).unwrap_or(u64::MAX);
            COUNT[span as usize].fetch_add(1, Relaxed);
            NANOS[span as usize].fetch_add(nanos, Relaxed);
            Self(now)
        }
    }

    /// Counts one sync that made `transactions` journal entries durable.
    pub(crate) fn group(transactions: u64) {
        let bucket = usize::try_from(transactions)
            .unwrap_or(usize::MAX)
            .min(GROUP_BUCKETS - 1);
        GROUPS[bucket].fetch_add(1, Relaxed);
    }

    /// Prints and resets the counters, if `DURABLE_OUTBOX_COMMIT_PROFILE` is set.
    pub(crate) fn report() {
        if std::env::var_os("DURABLE_OUTBOX_COMMIT_PROFILE").is_none() {
            return;
        }
        let mut line = String::from("{\"commit_profile\":{");
        for (i, (name, span)) in SPANS.iter().enumerate() {
            let count = COUNT[*span as usize].swap(0, Relaxed);
            let nanos = NANOS[*span as usize].swap(0, Relaxed);
            let _ = write!(
                line,
                "{}\"{name}\":{{\"n\":{count},\"total_ms\":{:.1},\"mean_us\":{:.1}}}",
                if i == 0 { "" } else { "," },
                nanos as f64 / 1e6,
                if count == 0 {
                    0.0
                } else {
                    nanos as f64 / count as f64 / 1e3
                }
            );
        }
        line.push_str(",\"groups\":[");
        for (i, bucket) in GROUPS.iter().enumerate() {
            let _ = write!(
                line,
                "{}{}",
                if i == 0 { "" } else { "," },
                bucket.swap(0, Relaxed)
            );
        }
        line.push_str("]}}");
        eprintln!("{line}");
    }
}

#[cfg(not(feature = "commit-profile"))]
mod enabled {
    use super::Span;

    /// A moment on the commit path (nothing without the feature).
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct Mark;

    impl Mark {
        pub(crate) fn now() -> Self {
            Self
        }

        #[expect(
            clippy::unused_self,
            reason = "the same signature as with the feature, where the mark is read"
        )]
        pub(crate) fn end(self, _span: Span) -> Self {
            Self
        }
    }

    pub(crate) fn group(_transactions: u64) {}

    pub(crate) fn report() {}
}

pub(crate) use enabled::{Mark, group, report};
