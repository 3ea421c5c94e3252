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
//! with 8 threads instead of one.) A woken thread, a transaction starting and
//! the poison checks read `durable`, `failed` and `closing` from atomics
//! mirrored under the mutex, so a released group does not queue for it; and a
//! gathering leader is woken only by the settling transactions its wait can
//! end or change at, not by each one (about 7 futex calls per transaction
//! with 8 threads before these two, under 4 after).
//!
//! A leader **gathers** before it syncs. It waits for every transaction
//! already under way ([`Group::begin`]: queued for the lock or holding it) to
//! write its entry, and, for at most as long as the last sync took, for the
//! threads the last sync released to write their next one. Without it,
//! 8 threads that each commit again as soon as they are released split into
//! a group of one (the first back, syncing alone) and a group of seven (the
//! rest, arriving during that sync), over and over: about 4 transactions per
//! fdatasync instead of 8. A thread that does not come back costs the next
//! leader at most one sync's time; a lone thread (its own last group) never
//! waits.
//!
//! A failed sync fails every ticket it covered and every later one: the
//! handle is poisoned and nothing after the last good sync is reported
//! durable. A leader that panics counts as a failed sync.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, Thread};
use std::time::Duration;

use crate::error::{Error, Result};

/// Once this process has held the directory lock for this long and at least
/// [`MIN_SYNCS_PER_HOLD`] syncs, new transactions wait for the group to drain,
/// so the lock passes to other processes. Draining costs a sync that no new
/// group overlaps, so it is bounded by time, not done after every sync.
pub(crate) const MAX_HOLD: std::time::Duration = std::time::Duration::from_millis(10);

/// See [`MAX_HOLD`].
pub(crate) const MIN_SYNCS_PER_HOLD: u32 = 2;

/// How long a leader gathers at most (see [`Group::gather`]). Transactions
/// under way hold the lock for microseconds each; the bound only keeps a
/// leader from waiting on one that is itself stuck, and caps the wait for
/// released threads on a very slow disk.
const GATHER_LIMIT: Duration = Duration::from_millis(50);

/// The durability tickets of one handle.
#[derive(Debug)]
pub(crate) struct Group {
    state: Mutex<SyncState>,
    changed: Condvar,
    /// Transactions that have begun ([`Group::begin`]): they are queued for
    /// the lock or hold it, and will write an entry or give up shortly.
    begun: AtomicU64,
    /// Transactions that have written their entry or given up.
    settled: AtomicU64,
    /// A leader is waiting in [`Group::gather`] (set after `gatherer`), so a
    /// settling transaction must wake it.
    gathering: AtomicBool,
    /// [`GATHER_LIMIT`], longer in tests that must not depend on the scheduler.
    gather_limit: Duration,
    /// Another process wrote since this one last held the directory lock:
    /// the lock is shared, so leaders do not wait for released threads (see
    /// [`Group::set_shared`]).
    shared: AtomicBool,
    /// Copies of `SyncState::durable`, `failed` and `closing`, stored under
    /// the state's mutex and read without it: a thread woken by its sync, a
    /// transaction starting, and the poison checks look here instead of all
    /// queueing for the mutex the moment a group is released.
    durable: AtomicU64,
    failed: AtomicBool,
    closing: AtomicBool,
    /// The `settled` counts at which a settling transaction wakes the
    /// gathering leader: the ones its wait can end or change at (see
    /// [`Group::gather`]), not every one.
    wake_at: AtomicU64,
    wake_also: AtomicU64,
    /// Run once between `wait_durable`'s first look at `durable` and its
    /// look at `failed`: the window a test needs to reach.
    #[cfg(test)]
    between_looks: tests::Hook,
}

impl Default for Group {
    fn default() -> Self {
        Self {
            state: Mutex::default(),
            changed: Condvar::new(),
            begun: AtomicU64::new(0),
            settled: AtomicU64::new(0),
            gathering: AtomicBool::new(false),
            gather_limit: GATHER_LIMIT,
            shared: AtomicBool::new(false),
            durable: AtomicU64::new(0),
            failed: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            wake_at: AtomicU64::new(0),
            wake_also: AtomicU64::new(0),
            #[cfg(test)]
            between_looks: tests::Hook::default(),
        }
    }
}

/// A transaction under way, from the lock to its entry written (or given up):
/// a leader about to sync waits for those begun before it, so that they join
/// its sync instead of each paying the next one.
pub(crate) struct Underway<'a> {
    group: &'a Group,
}

impl Drop for Underway<'_> {
    fn drop(&mut self) {
        let group = self.group;
        let settled = group.settled.fetch_add(1, Ordering::SeqCst) + 1;
        // Either the leader sees the new count, or this sees its flag (both
        // sequentially consistent, the thresholds stored before the flag):
        // no wake-up is lost. Only a count the leader waits for wakes it.
        if group.gathering.load(Ordering::SeqCst)
            && (settled >= group.wake_at.load(Ordering::SeqCst)
                || settled == group.wake_also.load(Ordering::SeqCst))
            && let Some(leader) = &group.state().gatherer
        {
            leader.unpark();
        }
    }
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
    /// A leader waiting for the transactions under way to settle.
    gatherer: Option<Thread>,
    /// The `settled` count at which every transaction of the last group will
    /// have written its next entry, if its thread comes straight back.
    expect: u64,
    /// How long the last sync took.
    last_sync: Duration,
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
        self.failed.load(Ordering::Acquire)
    }

    /// Marks the group failed (with the state's mutex held).
    fn fail(&self, state: &mut SyncState) {
        state.failed = true;
        self.failed.store(true, Ordering::Release);
    }

    /// Blocks while the group is closing (draining to release the lock).
    pub(crate) fn wait_open(&self) {
        if !self.closing.load(Ordering::Acquire) {
            return;
        }
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
            self.closing.store(closing, Ordering::Release);
            if !closing {
                self.changed.notify_all();
            }
        }
    }

    /// Records whether another process wrote since this one last held the
    /// directory lock. While it does, a group that drains lets the `flock`
    /// go to the other process, so a leader must not wait for the threads the
    /// last sync released: every group would drain and hand the lock over,
    /// each handing costing the other process a catch-up. Only transactions
    /// that arrive together are gathered then (and `MAX_HOLD` shares the lock).
    pub(crate) fn set_shared(&self, shared: bool) {
        self.shared.store(shared, Ordering::Relaxed);
    }

    /// Marks a transaction as under way until the returned value drops: call
    /// once it may write (past [`wait_open`](Self::wait_open)), drop once its
    /// entry is written or it wrote nothing, and before waiting to be durable.
    pub(crate) fn begin(&self) -> Underway<'_> {
        self.begun.fetch_add(1, Ordering::SeqCst);
        Underway { group: self }
    }

    /// A leader's wait for every transaction begun before now to settle, so
    /// its entry joins this sync, and for the threads the last sync released
    /// to write again (for at most `patience`); all within [`GATHER_LIMIT`].
    fn gather(&self, expect: u64, patience: Duration) {
        let begun = self.begun.load(Ordering::SeqCst);
        let target = begun.max(expect);
        if self.settled.load(Ordering::SeqCst) >= target {
            return;
        }
        self.state().gatherer = Some(thread::current());
        // The wait ends at `target`; at `begun` its deadline may shorten.
        self.wake_at.store(target, Ordering::SeqCst);
        self.wake_also.store(begun, Ordering::SeqCst);
        self.gathering.store(true, Ordering::SeqCst);
        let start = std::time::Instant::now();
        let deadline = start + self.gather_limit;
        loop {
            let settled = self.settled.load(Ordering::SeqCst);
            if settled >= target {
                break;
            }
            let now = std::time::Instant::now();
            let until = if settled >= begun {
                deadline.min(start + patience)
            } else {
                deadline
            };
            if now >= until {
                break;
            }
            thread::park_timeout(until - now);
        }
        self.gathering.store(false, Ordering::SeqCst);
        self.state().gatherer = None;
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
            // Without the mutex first: a thread its sync woke is done here.
            // (If its wake-up was spurious and its entry is still parked, the
            // sync that made it durable removes the entry.)
            if ticket <= self.durable.load(Ordering::Acquire) {
                return Ok(());
            }
            #[cfg(test)]
            self.between_looks.run();
            if self.failed() {
                // A sync may have made this ticket durable after the load
                // above and before a later sync failed: `failed` is stored
                // after that `durable`, so reading `durable` again now tells.
                if ticket <= self.durable.load(Ordering::Acquire) {
                    return Ok(());
                }
                return Err(Error::Poisoned);
            }
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
                let (expect, patience) = if state.closing || self.shared.load(Ordering::Relaxed) {
                    (0, Duration::ZERO)
                } else {
                    (state.expect, state.last_sync)
                };
                drop(state);
                let mut leading = Leading {
                    group: self,
                    done: false,
                };
                self.gather(expect, patience);
                let started = std::time::Instant::now();
                let synced = lead();
                leading.done = true;
                let mut state = self.state();
                state.syncing = false;
                let failure = match synced.result {
                    Ok(()) => {
                        let members = synced.cover.saturating_sub(state.durable);
                        crate::profile::group(members);
                        state.last_sync = started.elapsed();
                        state.expect = self.settled.load(Ordering::SeqCst) + members;
                        state.durable = state.durable.max(synced.cover);
                        self.durable.store(state.durable, Ordering::Release);
                        None
                    }
                    Err(e) => {
                        self.fail(&mut state);
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
            self.group.fail(&mut state);
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

    /// Work a test runs once at a point of `Group`'s code.
    #[derive(Default)]
    pub(super) struct Hook(Mutex<Option<Box<dyn FnOnce() + Send>>>);

    impl Hook {
        fn set(&self, work: impl FnOnce() + Send + 'static) {
            *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(Box::new(work));
        }

        pub(super) fn run(&self) {
            let work = self.0.lock().unwrap_or_else(PoisonError::into_inner).take();
            if let Some(work) = work {
                work();
            }
        }
    }

    impl std::fmt::Debug for Hook {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Hook")
        }
    }

    /// A thread that found its ticket not durable yet, and then the group
    /// failed, must look at `durable` again: a sync may have covered its
    /// ticket in between, before a later sync failed. Its change is durable
    /// and must be reported so, not as `Poisoned` (a caller told `Poisoned`
    /// may do again what is already done, e.g. enqueue under a new key).
    #[test]
    fn a_ticket_made_durable_just_before_the_group_failed_is_reported_durable() {
        let group = Arc::new(Group::default());
        let failing = |cover| Synced {
            cover,
            result: Err(Error::io(
                std::path::Path::new("j"),
                "fsync",
                std::io::Error::other("injected"),
            )),
        };
        // Between this thread's two looks: a sync covers ticket 1, then the
        // next one (ticket 2's) fails.
        let others = Arc::clone(&group);
        group.between_looks.set(move || {
            others
                .wait_durable(1, || Synced {
                    cover: 1,
                    result: Ok(()),
                })
                .map_err(|e| e.to_string())
                .unwrap();
            assert!(others.wait_durable(2, || failing(2)).is_err());
        });
        let told = group.wait_durable(1, || failing(1));
        assert!(
            told.is_ok(),
            "a ticket a sync made durable was reported as {told:?} because a later sync failed"
        );
        assert!(group.failed(), "the later sync's failure was lost");
        assert!(matches!(
            group.wait_durable(2, || failing(2)),
            Err(Error::Poisoned)
        ));
    }

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
        durable(&group, 3, lead);
        for ticket in 1..=5 {
            group
                .wait_durable(ticket, || unreachable!("already durable"))
                .map_err(|e| e.to_string())
                .unwrap();
        }
        assert_eq!(syncs.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_ticket_just_past_a_syncs_cover_waits_for_a_sync_of_its_own() {
        let group = Group::default();
        let syncs = AtomicU64::new(0);
        let lead = |cover| {
            syncs.fetch_add(1, Ordering::SeqCst);
            Synced {
                cover,
                result: Ok(()),
            }
        };
        group
            .wait_durable(1, || lead(1))
            .map_err(|e| e.to_string())
            .unwrap();
        // Ticket 2 was written after that sync: only a sync covering it may
        // report it durable.
        group
            .wait_durable(2, || lead(2))
            .map_err(|e| e.to_string())
            .unwrap();
        assert_eq!(
            syncs.load(Ordering::SeqCst),
            2,
            "a ticket the last sync did not cover was reported durable without a sync"
        );
        assert_eq!(group.state().durable, 2);
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
                    durable(&group, ticket, lead);
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

    /// Polls `ready` until it holds (or a generous limit passes, so that the
    /// test fails on its assertion instead of hanging).
    /// Waits until `ticket` is durable (leading with `lead` when it must);
    /// panics with the error's text if the group failed.
    fn durable(group: &Group, ticket: u64, lead: impl FnMut() -> Synced) {
        if let Err(e) = group.wait_durable(ticket, lead) {
            panic!("ticket {ticket} was not made durable: {e}");
        }
    }

    fn until(ready: impl Fn() -> bool) {
        let limit = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while !ready() && std::time::Instant::now() < limit {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    #[test]
    fn a_leader_waits_for_a_transaction_under_way_so_both_share_one_sync() {
        let group = Group::default();
        let written = AtomicU64::new(1);
        let syncs = AtomicU64::new(0);
        let lead = || {
            syncs.fetch_add(1, Ordering::SeqCst);
            Synced {
                cover: written.load(Ordering::SeqCst),
                result: Ok(()),
            }
        };
        let (begun, has_begun) = std::sync::mpsc::channel();
        std::thread::scope(|scope| {
            scope.spawn(|| {
                // Under way (queued for the lock) before ticket 1's sync starts;
                // it writes ticket 2 only once the leader is waiting for it
                // (or, if the leader does not wait, after its sync).
                let underway = group.begin();
                begun.send(()).unwrap();
                until(|| {
                    group.gathering.load(Ordering::SeqCst) || syncs.load(Ordering::SeqCst) > 0
                });
                written.store(2, Ordering::SeqCst);
                drop(underway);
                durable(&group, 2, lead);
            });
            has_begun.recv().unwrap();
            durable(&group, 1, lead);
        });
        assert_eq!(
            syncs.load(Ordering::SeqCst),
            1,
            "the transaction under way paid a sync of its own"
        );
        assert_eq!(group.state().durable, 2);
    }

    #[test]
    fn a_leader_waits_for_the_threads_the_last_sync_released() {
        // Patience up to the first sync's 500 ms: no scheduler is that late.
        let group = Group {
            gather_limit: std::time::Duration::from_secs(5),
            ..Group::default()
        };
        let written = AtomicU64::new(2);
        let syncs = AtomicU64::new(0);
        let lead = || {
            // The first sync is slow: the next leader's patience is its length.
            if syncs.fetch_add(1, Ordering::SeqCst) == 0 {
                std::thread::sleep(std::time::Duration::from_millis(500));
            }
            Synced {
                cover: written.load(Ordering::SeqCst),
                result: Ok(()),
            }
        };
        // Two transactions (tickets 1 and 2) share the first sync.
        drop(group.begin());
        drop(group.begin());
        durable(&group, 2, lead);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                // The second member comes back after the first has started
                // to lead the next sync.
                until(|| {
                    group.gathering.load(Ordering::SeqCst) || syncs.load(Ordering::SeqCst) > 1
                });
                let underway = group.begin();
                written.store(4, Ordering::SeqCst);
                drop(underway);
                durable(&group, 4, lead);
            });
            let underway = group.begin();
            written.store(3, Ordering::SeqCst);
            drop(underway);
            durable(&group, 3, lead);
        });
        assert_eq!(
            syncs.load(Ordering::SeqCst),
            2,
            "the members of the last group did not share the next sync"
        );
        assert_eq!(group.state().durable, 4);
    }

    #[test]
    fn a_leader_stops_gathering_a_syncs_time_after_the_transactions_under_way_settle() {
        // A released thread that never comes back must cost one sync's time
        // (200 ms here), not the gather limit: the settling transaction that
        // ends "under way" must wake the leader although its count is short
        // of the released threads'.
        let group = Group {
            gather_limit: std::time::Duration::from_secs(30),
            ..Group::default()
        };
        let first = std::sync::atomic::AtomicBool::new(true);
        let written = AtomicU64::new(3);
        let lead = || {
            if first.swap(false, Ordering::SeqCst) {
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
            Synced {
                cover: written.load(Ordering::SeqCst),
                result: Ok(()),
            }
        };
        // Three members share a sync; only one of them comes back (ticket 4),
        // while another transaction is under way (ticket 5).
        for _ in 0..3 {
            drop(group.begin());
        }
        durable(&group, 3, lead);
        let start = std::time::Instant::now();
        std::thread::scope(|scope| {
            let underway = group.begin();
            scope.spawn(|| {
                let underway = underway;
                until(|| group.gathering.load(Ordering::SeqCst));
                written.store(5, Ordering::SeqCst);
                drop(underway);
                durable(&group, 5, lead);
            });
            drop(group.begin());
            written.store(4, Ordering::SeqCst);
            durable(&group, 4, lead);
        });
        assert!(
            start.elapsed() < std::time::Duration::from_secs(15),
            "the leader gathered for {:?}, up to its limit, for a thread that never came back",
            start.elapsed()
        );
        assert_eq!(group.state().durable, 5);
    }

    #[test]
    fn a_lone_thread_never_waits_for_anyone_before_its_sync() {
        // A leader that waited for others would wait the whole first sync.
        let group = Group {
            gather_limit: std::time::Duration::from_secs(10),
            ..Group::default()
        };
        let first = std::sync::atomic::AtomicBool::new(true);
        let lead = |cover| {
            if first.swap(false, Ordering::SeqCst) {
                std::thread::sleep(std::time::Duration::from_secs(1));
            }
            Synced {
                cover,
                result: Ok(()),
            }
        };
        drop(group.begin());
        group
            .wait_durable(1, || lead(1))
            .map_err(|e| e.to_string())
            .unwrap();
        // The same (and only) thread commits again: nobody else is coming.
        let start = std::time::Instant::now();
        drop(group.begin());
        group
            .wait_durable(2, || lead(2))
            .map_err(|e| e.to_string())
            .unwrap();
        assert!(
            start.elapsed() < std::time::Duration::from_millis(500),
            "a lone thread waited {:?} for others before its sync",
            start.elapsed()
        );
    }

    #[test]
    fn with_another_process_writing_a_leader_does_not_wait_for_released_threads() {
        let group = Group {
            gather_limit: std::time::Duration::from_secs(10),
            ..Group::default()
        };
        let first = std::sync::atomic::AtomicBool::new(true);
        let lead = |cover| {
            if first.swap(false, Ordering::SeqCst) {
                std::thread::sleep(std::time::Duration::from_secs(1));
            }
            Synced {
                cover,
                result: Ok(()),
            }
        };
        // Two members share a slow sync; then only one of them comes back,
        // while another process shares the lock.
        drop(group.begin());
        drop(group.begin());
        group
            .wait_durable(2, || lead(2))
            .map_err(|e| e.to_string())
            .unwrap();
        group.set_shared(true);
        let start = std::time::Instant::now();
        drop(group.begin());
        group
            .wait_durable(3, || lead(3))
            .map_err(|e| e.to_string())
            .unwrap();
        assert!(
            start.elapsed() < std::time::Duration::from_millis(500),
            "with the lock shared, a leader waited {:?} for a released thread",
            start.elapsed()
        );
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
