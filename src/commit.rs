//! Group commit: transactions that arrive while one fdatasync runs share the next.
//!
//! Each committing transaction writes its journal entry under the lock and gets
//! a **ticket** (this handle's count of entries written). It then waits here
//! until its ticket is durable. The first waiter that finds no sync running
//! becomes the **leader**: it syncs everything written so far (its cover),
//! appends the group's audit records, and wakes the others. Entries written
//! while a leader syncs form the next group.
//!
//! A failed sync fails every ticket it covered and every later one: the
//! handle is poisoned and nothing after the last good sync is reported
//! durable. A leader that panics counts as a failed sync.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

use crate::error::{Error, Result};

/// Once this process has held the directory lock for this long and at least
/// [`MIN_SYNCS_PER_HOLD`] syncs, new transactions wait for the group to drain,
/// so the lock passes to other processes. Draining costs a sync that no new
/// group overlaps, so it is bounded by time, not done after every sync.
pub(crate) const MAX_HOLD: std::time::Duration = std::time::Duration::from_millis(10);

/// See [`MAX_HOLD`].
pub(crate) const MIN_SYNCS_PER_HOLD: u32 = 2;

/// The durability tickets of one handle.
#[derive(Debug, Default)]
pub(crate) struct Group {
    state: Mutex<SyncState>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct SyncState {
    /// Every ticket up to this one is durable.
    durable: u64,
    /// A leader is syncing.
    syncing: bool,
    /// A sync failed: no later ticket will ever be durable.
    failed: bool,
    /// New transactions wait: the group must drain so the `flock` is released.
    closing: bool,
}

/// What a leader's sync achieved.
pub(crate) struct Synced {
    /// The last ticket the sync covered.
    pub(crate) cover: u64,
    /// `Ok` if every covered ticket is durable (and its audit records appended).
    pub(crate) result: Result<()>,
}

impl Group {
    fn state(&self) -> MutexGuard<'_, SyncState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether a sync has failed (the handle is poisoned).
    pub(crate) fn failed(&self) -> bool {
        self.state().failed
    }

    /// Blocks while the group is closing (draining to release the lock).
    pub(crate) fn wait_open(&self) {
        let mut state = self.state();
        while state.closing && !state.failed {
            state = self
                .changed
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Sets or clears "closing"; clearing wakes the transactions waiting to start.
    pub(crate) fn set_closing(&self, closing: bool) {
        let mut state = self.state();
        if state.closing != closing {
            state.closing = closing;
            if !closing {
                self.changed.notify_all();
            }
        }
    }

    /// Returns once `ticket` is durable, leading a sync if none is running.
    /// `lead` syncs everything written so far and reports its cover (which
    /// includes every ticket already handed out).
    ///
    /// # Errors
    ///
    /// The leader's own error when its sync failed; [`Error::Poisoned`] for
    /// every other transaction whose ticket that sync (or a later one) did not
    /// make durable.
    pub(crate) fn wait_durable(&self, ticket: u64, mut lead: impl FnMut() -> Synced) -> Result<()> {
        let mut state = self.state();
        loop {
            if ticket <= state.durable {
                return Ok(());
            }
            if state.failed {
                return Err(Error::Poisoned);
            }
            if !state.syncing {
                state.syncing = true;
                drop(state);
                let mut leading = Leading {
                    group: self,
                    done: false,
                };
                let synced = lead();
                leading.done = true;
                state = self.state();
                state.syncing = false;
                self.changed.notify_all();
                match synced.result {
                    Ok(()) => state.durable = state.durable.max(synced.cover),
                    Err(e) => {
                        state.failed = true;
                        if ticket <= synced.cover {
                            return Err(e);
                        }
                    }
                }
                continue;
            }
            state = self
                .changed
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }
}

/// Fails the group if the leader unwinds out of its sync.
struct Leading<'a> {
    group: &'a Group,
    done: bool,
}

impl Drop for Leading<'_> {
    fn drop(&mut self) {
        if !self.done {
            let mut state = self.group.state();
            state.syncing = false;
            state.failed = true;
            self.group.changed.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    #[test]
    fn one_sync_covers_every_ticket_written_before_it() {
        let group = Group::default();
        let syncs = AtomicU64::new(0);
        let lead = || {
            syncs.fetch_add(1, Ordering::SeqCst);
            Synced {
                cover: 5,
                result: Ok(()),
            }
        };
        group
            .wait_durable(3, lead)
            .map_err(|e| e.to_string())
            .unwrap();
        for ticket in 1..=5 {
            group
                .wait_durable(ticket, || unreachable!("already durable"))
                .map_err(|e| e.to_string())
                .unwrap();
        }
        assert_eq!(syncs.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_failed_sync_fails_its_tickets_and_every_later_one() {
        let group = Group::default();
        let first = group.wait_durable(2, || Synced {
            cover: 3,
            result: Err(Error::io(
                std::path::Path::new("j"),
                "fsync",
                std::io::Error::other("injected"),
            )),
        });
        assert!(matches!(first, Err(Error::Io { .. })), "{first:?}");
        assert!(group.failed());
        for ticket in [1, 3, 4] {
            let later = group.wait_durable(ticket, || unreachable!("no sync after a failure"));
            assert!(matches!(later, Err(Error::Poisoned)), "{later:?}");
        }
    }

    #[test]
    fn a_leader_that_panics_fails_the_group_instead_of_hanging_it() {
        let group = Arc::new(Group::default());
        let g = Arc::clone(&group);
        let panicked =
            std::thread::spawn(move || g.wait_durable(1, || panic!("injected panic in the sync")))
                .join();
        assert!(panicked.is_err());
        let after = group.wait_durable(1, || unreachable!("failed groups do not sync"));
        assert!(matches!(after, Err(Error::Poisoned)), "{after:?}");
    }
}
