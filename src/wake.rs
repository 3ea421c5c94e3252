//! In-process wake-ups: a worker subscribes, and every enqueue (or requeue) on
//! any clone of the same handle calls it after its commit, so the worker claims
//! the new item at once instead of polling.

use std::sync::{Arc, Mutex, PoisonError};

/// A listener: cheap, never blocks (it only flags a waiting task).
pub(crate) type Listener = Arc<dyn Fn() + Send + Sync>;

/// The listeners of one handle (shared by its clones).
#[derive(Default)]
pub(crate) struct Wakers {
    listeners: Mutex<Vec<(u64, Listener)>>,
    next_id: Mutex<u64>,
}

impl Wakers {
    /// Adds a listener; returns its id for [`unsubscribe`](Self::unsubscribe).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn subscribe(&self, listener: Listener) -> u64 {
        let mut next = self.next_id.lock().unwrap_or_else(PoisonError::into_inner);
        *next += 1;
        let id = *next;
        self.list().push((id, listener));
        id
    }

    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn unsubscribe(&self, id: u64) {
        self.list().retain(|(i, _)| *i != id);
    }

    /// Calls every listener (outside the list's lock).
    pub(crate) fn wake(&self) {
        let listeners: Vec<Listener> = self.list().iter().map(|(_, l)| Arc::clone(l)).collect();
        for listener in listeners {
            listener();
        }
    }

    fn list(&self) -> std::sync::MutexGuard<'_, Vec<(u64, Listener)>> {
        self.listeners
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}
