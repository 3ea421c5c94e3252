//! Rerunning a transaction the server rolled back to break a deadlock
//! (SQLSTATE `40P01`) or a serialization conflict (`40001`).
//!
//! Both errors mean the server aborted the whole transaction: nothing of it
//! is visible, and running it again from the start is what PostgreSQL's
//! documentation asks of the client. The rules' transactions are designed
//! never to wait in a cycle (see `txn`, the lock order), but a lock taken
//! outside that order (an operator's trigger, a session of another program
//! on the same tables) can still close one, and then the server picks one
//! transaction to abort. That caller should not see a failure it could not
//! have caused: [`retrying`] reruns it, a bounded number of times, with a
//! short, growing pause so the two do not collide again at once.
//!
//! **Invariant:** only a whole transaction is rerun, and only one whose
//! effects outside the database are undone or repeatable: every caller
//! documents how (`PgEngine::transact_waiting`: the rules' side effects on the
//! handle, `Outbox::step` and `Outbox::claim` undo theirs before a rerun;
//! `send` never runs inside a transaction). Any other error, and a
//! connection lost during `COMMIT` (which may have committed), is returned
//! at once.

use std::time::Duration;

use postgres::error::SqlState;

use crate::error::{Error, Result};

/// How many times a transaction runs at most before its error is returned.
pub(crate) const ATTEMPTS: u32 = 5;

/// Whether `error` is the server's report that it aborted the transaction to
/// break a deadlock or a serialization conflict: safe to run it again.
pub(crate) fn is_retryable(error: &Error) -> bool {
    let Error::Database { source, .. } = error else {
        return false;
    };
    super::sqlstate(source.as_ref()).is_some_and(|code| {
        code == SqlState::T_R_DEADLOCK_DETECTED.code()
            || code == SqlState::T_R_SERIALIZATION_FAILURE.code()
    })
}

/// Runs `attempt` (given its number, from 1) until it succeeds, fails with an
/// error that is not [retryable](is_retryable), or has run [`ATTEMPTS`]
/// times; returns its last result. `what` names the transaction in the log.
///
/// # Errors
/// The last attempt's error.
pub(crate) fn retrying<T>(what: &str, mut attempt: impl FnMut(u32) -> Result<T>) -> Result<T> {
    let mut n = 1;
    loop {
        match attempt(n) {
            Err(e) if n < ATTEMPTS && is_retryable(&e) => {
                let pause = pause(n);
                tracing::warn!(
                    transaction = what,
                    attempt = n,
                    error = %error_chain(&e),
                    pause_ms = pause.as_millis(),
                    "the server rolled the transaction back (deadlock or serialization \
                     conflict); running it again"
                );
                std::thread::sleep(pause);
                n += 1;
            }
            done => return done,
        }
    }
}

/// The pause before attempt `n + 1`: 5 ms doubled per attempt, plus up to as
/// much again taken from the clock's nanoseconds, so two transactions that
/// collided do not start again in step.
fn pause(n: u32) -> Duration {
    let base = 5u64 << n.min(6);
    let jitter = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::from(d.subsec_nanos()))
        % (base * 1_000_000);
    Duration::from_millis(base) + Duration::from_nanos(jitter)
}

/// The error and its sources, for the log (the server's message is a source).
fn error_chain(error: &Error) -> String {
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(e) = source {
        text.push_str(": ");
        text.push_str(&e.to_string());
        source = e.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_servers_deadlock_and_serialization_aborts_are_rerun() {
        let mut runs = 0;
        let result: Result<()> = retrying("test", |_| {
            runs += 1;
            Err(Error::invalid_config("url", "not retryable"))
        });
        assert!(result.is_err());
        assert_eq!(runs, 1, "any other error is returned at once");
        assert!(!is_retryable(&Error::Database {
            op: "commit",
            source: "a plain message".into(),
        }));
    }

    #[test]
    fn pauses_grow_and_stay_short() {
        assert!(pause(1) >= Duration::from_millis(10));
        assert!(pause(1) < Duration::from_millis(20));
        assert!(pause(4) >= Duration::from_millis(80));
        assert!(pause(ATTEMPTS) < Duration::from_secs(1));
    }
}
