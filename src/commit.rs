//! Group commit: transactions that arrive while one fdatasync runs share the next.
//!
//! Each committing transaction writes its journal entry under the lock and gets
//! a **ticket** (this handle's count of entries written). It then waits here
//! until its ticket is durable. The first waiter that finds no sync running
//! becomes the **leader**: it syncs everything written so far (its cover),
//! appends the group's audit records, and wakes the others. Entries written
//! while a leader syncs form the next group.
//!
//! Waiters park, each with its ticket; a finished sync unparks only the ones
//! it made durable, plus the lowest ticket left to lead the next sync. (A
//! condition variable's `notify_all` woke every waiter after every sync, and
//! they all fought for the state's mutex: about three sleeps per transaction
//! with 8 threads instead of one.)
//!
//! A failed sync fails every ticket it covered and every later one: the
//! handle is poisoned and nothing after the last good sync is reported
//! durable. A leader that panics counts as a failed sync.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, Thread};

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
    /// Threads parked in `wait_durable`, with the ticket each waits for. A
    /// finished sync wakes only those it covered, and one more to lead the
    /// next sync: waking them all would have every thread fight for this
    /// mutex after every sync, most of them only to go back to sleep.
    parked: Vec<(u64, Thread)>,
}

impl SyncState {
    /// Takes the parked threads a finished sync must wake: the one with the
    /// lowest ticket not yet durable first (it leads the next sync, so it
    /// should not wait for the others' wake-ups), then every one whose ticket
    /// is now durable (all of them after a failure).
    fn take_wakeups(&mut self) -> Vec<Thread> {
        let durable = self.durable;
        let failed = self.failed;
        let (done, mut left): (Vec<_>, Vec<_>) = std::mem::take(&mut self.parked)
            .into_iter()
            .partition(|(ticket, _)| failed || *ticket <= durable);
        let mut wake = Vec::with_capacity(done.len() + 1);
        if let Some(next) = left
            .iter()
            .enumerate()
            .min_by_key(|(_, (ticket, _))| *ticket)
            .map(|(i, _)| i)
        {
            wake.push(left.swap_remove(next).1);
        }
        wake.extend(done.into_iter().map(|(_, t)| t));
        self.parked = left;
        wake
    }

    /// Forgets a parked entry of the current thread (it is awake again).
    fn unpark_self(&mut self) {
        let me = thread::current().id();
        self.parked.retain(|(_, t)| t.id() != me);
    }
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
        loop {
            let mut state = self.state();
            state.unpark_self();
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
                let mut state = self.state();
                state.syncing = false;
                let failure = match synced.result {
                    Ok(()) => {
                        crate::profile::group(synced.cover.saturating_sub(state.durable));
                        state.durable = state.durable.max(synced.cover);
                        None
                    }
                    Err(e) => {
                        state.failed = true;
                        // Transactions waiting to start must see it too.
                        self.changed.notify_all();
                        Some(e)
                    }
                };
                let wake = state.take_wakeups();
                drop(state);
                for parked in wake {
                    parked.unpark();
                }
                if let Some(e) = failure
                    && ticket <= synced.cover
                {
                    return Err(e);
                }
                continue;
            }
            // A sync is running: sleep until a leader wakes this thread (a
            // spurious wake-up just looks again).
            state.parked.push((ticket, thread::current()));
            drop(state);
            thread::park();
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
            let wake = state.take_wakeups();
            self.group.changed.notify_all();
            drop(state);
            for parked in wake {
                parked.unpark();
            }
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
    fn parked_waiters_are_all_woken_and_share_syncs() {
        const THREADS: u64 = 8;
        const EACH: u64 = 200;
        let group = Arc::new(Group::default());
        let written = Arc::new(Mutex::new(0u64));
        let syncs = Arc::new(AtomicU64::new(0));
        let (done, finished) = std::sync::mpsc::channel();
        for _ in 0..THREADS {
            let (group, written, syncs, done) = (
                Arc::clone(&group),
                Arc::clone(&written),
                Arc::clone(&syncs),
                done.clone(),
            );
            std::thread::spawn(move || {
                for _ in 0..EACH {
                    let ticket = {
                        let mut w = written.lock().unwrap();
                        *w += 1;
                        *w
                    };
                    let lead = || {
                        // Everything written before the sync starts is covered.
                        let cover = *written.lock().unwrap();
                        syncs.fetch_add(1, Ordering::SeqCst);
                        std::thread::sleep(std::time::Duration::from_micros(200));
                        Synced {
                            cover,
                            result: Ok(()),
                        }
                    };
                    group
                        .wait_durable(ticket, lead)
                        .map_err(|e| e.to_string())
                        .unwrap();
                }
                done.send(()).unwrap();
            });
        }
        for _ in 0..THREADS {
            // A lost wake-up would leave a thread parked forever.
            finished
                .recv_timeout(std::time::Duration::from_secs(60))
                .expect("every waiter is woken once its ticket is durable");
        }
        assert_eq!(group.state().durable, THREADS * EACH);
        assert!(group.state().parked.is_empty());
        assert!(syncs.load(Ordering::SeqCst) < THREADS * EACH);
    }

    #[test]
    fn a_waiter_the_sync_did_not_cover_is_woken_to_lead_the_next() {
        let group = Arc::new(Group::default());
        let (done, finished) = std::sync::mpsc::channel();
        let late = {
            let group = Arc::clone(&group);
            std::thread::spawn(move || {
                // Writes its entry (ticket 2) while the first sync runs.
                while !group.state().syncing {
                    std::thread::yield_now();
                }
                let own = group.wait_durable(2, || Synced {
                    cover: 2,
                    result: Ok(()),
                });
                done.send(own.map_err(|e| e.to_string())).unwrap();
            })
        };
        group
            .wait_durable(1, || {
                // The sync started before ticket 2 was written: it covers 1 only.
                while group.state().parked.is_empty() {
                    std::thread::yield_now();
                }
                Synced {
                    cover: 1,
                    result: Ok(()),
                }
            })
            .map_err(|e| e.to_string())
            .unwrap();
        let own = finished
            .recv_timeout(std::time::Duration::from_secs(30))
            .expect("the uncovered waiter was left parked with nobody to sync for it");
        own.unwrap();
        late.join().unwrap();
        assert_eq!(group.state().durable, 2);
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
