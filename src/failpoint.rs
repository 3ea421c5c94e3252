//! Named fault-injection points, compiled in only with the `test-failpoints` feature
//! and in the crate's own unit tests (so every unit test builds under every
//! feature combination, `tokio` alone included).
//!
//! Each open outbox carries its own [`Failpoints`] (set on the builder, or read from
//! the `DURABLE_OUTBOX_FAILPOINTS` environment variable by child processes in crash
//! tests), so tests running in parallel threads never see each other's faults.
//! Without the feature every check compiles to nothing.

use std::io;

/// What a failpoint does when it is hit.
#[cfg(any(test, feature = "test-failpoints"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailAction {
    /// Return an injected I/O error (`EIO`) from the step.
    Error,
    /// Return an injected I/O error only on the n-th hit (1-based), pass otherwise.
    ErrorOnHit(u32),
    /// Kill the process on the spot (`SIGKILL` to itself): no destructors, no flushing.
    Kill,
    /// Kill the process on the spot on the n-th hit (1-based), pass otherwise.
    KillOnHit(u32),
    /// Panic in the calling thread.
    Panic,
    /// Panic only on the n-th hit (1-based), pass otherwise.
    PanicOnHit(u32),
    /// Sleep this many milliseconds, then pass: a slow step (e.g. a slow
    /// fdatasync) without a fault. Hits are counted, as for every armed point
    /// (see `Outbox::failpoint_hits`).
    DelayMs(u32),
    /// On the n-th hit (1-based), hold the step until another process says
    /// go: create `<name>.paused` in the directory
    /// `DURABLE_OUTBOX_FAILPOINT_DIR` names, then wait until `<name>.resume`
    /// appears there (at most two minutes), then pass. For tests that must
    /// act at an exact point of a child process's run (an operator's removal
    /// between two pages the CLI reads). Without the variable it passes.
    PauseOnHit(u32),
}

#[cfg(any(test, feature = "test-failpoints"))]
mod enabled {
    use super::FailAction;
    use std::collections::HashMap;
    use std::io;
    use std::sync::Mutex;

    /// The failpoints armed for one open outbox.
    #[derive(Debug, Default)]
    pub struct Failpoints {
        armed: Mutex<HashMap<String, (FailAction, u32)>>,
    }

    impl Failpoints {
        /// No failpoint armed.
        #[cfg_attr(not(test), allow(dead_code))]
        pub(crate) fn none() -> Self {
            Self::default()
        }

        pub(crate) fn arm(&self, name: &str, action: FailAction) {
            self.armed
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(name.to_owned(), (action, 0));
        }

        /// Reads `name=error;name2=kill;name3=error@2;name4=kill@5;name5=delay@20;name6=panic@3` from the environment.
        pub(crate) fn from_env() -> Self {
            let this = Self::default();
            if let Ok(spec) = std::env::var("DURABLE_OUTBOX_FAILPOINTS") {
                for entry in spec.split(';').filter(|e| !e.is_empty()) {
                    let (name, action) = entry.split_once('=').unwrap_or((entry, "error"));
                    let action = match action {
                        "kill" => FailAction::Kill,
                        other if other.starts_with("kill@") => {
                            match other.trim_start_matches("kill@").parse() {
                                Ok(n) => FailAction::KillOnHit(n),
                                Err(_) => FailAction::Kill,
                            }
                        }
                        "panic" => FailAction::Panic,
                        other if other.starts_with("panic@") => {
                            match other.trim_start_matches("panic@").parse() {
                                Ok(n) => FailAction::PanicOnHit(n),
                                Err(_) => FailAction::Panic,
                            }
                        }
                        other if other.starts_with("pause@") => {
                            match other.trim_start_matches("pause@").parse() {
                                Ok(n) => FailAction::PauseOnHit(n),
                                Err(_) => FailAction::Error,
                            }
                        }
                        other if other.starts_with("delay@") => {
                            match other.trim_start_matches("delay@").parse() {
                                Ok(ms) => FailAction::DelayMs(ms),
                                Err(_) => FailAction::Error,
                            }
                        }
                        other => match other.strip_prefix("error@").map(str::parse) {
                            Some(Ok(n)) => FailAction::ErrorOnHit(n),
                            _ => FailAction::Error,
                        },
                    };
                    this.arm(name, action);
                }
            }
            this
        }

        /// How often the armed failpoint `name` was reached (0 if not armed).
        pub(crate) fn hits(&self, name: &str) -> u32 {
            self.armed
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .get(name)
                .map_or(0, |(_, hits)| *hits)
        }

        pub(crate) fn check(&self, name: &str) -> io::Result<()> {
            let mut armed = self
                .armed
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let Some((action, hits)) = armed.get_mut(name) else {
                return Ok(());
            };
            *hits += 1;
            let action = *action;
            let hits = *hits;
            drop(armed);
            match action {
                FailAction::Error => Err(super::injected(name)),
                FailAction::ErrorOnHit(n) if n == hits => Err(super::injected(name)),
                FailAction::PauseOnHit(n) if n == hits => {
                    super::pause(name);
                    Ok(())
                }
                FailAction::ErrorOnHit(_) | FailAction::PauseOnHit(_) => Ok(()),
                FailAction::DelayMs(ms) => {
                    std::thread::sleep(std::time::Duration::from_millis(u64::from(ms)));
                    Ok(())
                }
                FailAction::KillOnHit(n) if n != hits => Ok(()),
                FailAction::Kill | FailAction::KillOnHit(_) => {
                    // SIGKILL ourselves: the closest a test can get to pulling the plug
                    // on the process (the kernel still flushes what it already has).
                    let _ = std::process::Command::new("kill")
                        .args(["-9", &std::process::id().to_string()])
                        .status();
                    std::process::abort();
                }
                FailAction::PanicOnHit(n) if n != hits => Ok(()),
                FailAction::Panic | FailAction::PanicOnHit(_) => {
                    panic!("failpoint {name} panicked")
                }
            }
        }
    }
}

#[cfg(any(test, feature = "test-failpoints"))]
pub use enabled::Failpoints;

/// [`FailAction::PauseOnHit`]: announces the pause with a file and waits
/// for the file that ends it.
#[cfg(any(test, feature = "test-failpoints"))]
fn pause(name: &str) {
    let Some(dir) = std::env::var_os("DURABLE_OUTBOX_FAILPOINT_DIR") else {
        return;
    };
    let dir = std::path::PathBuf::from(dir);
    if let Err(e) = std::fs::write(dir.join(format!("{name}.paused")), b"") {
        tracing::error!(error = %e, "failpoint {name}: could not announce the pause");
        return;
    }
    let resume = dir.join(format!("{name}.resume"));
    let began = std::time::Instant::now();
    while !resume.exists() {
        if began.elapsed() > std::time::Duration::from_secs(120) {
            tracing::error!("failpoint {name}: nobody resumed it in two minutes; going on");
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// The failpoints of one open outbox: nothing, without the `test-failpoints` feature
/// (outside the unit tests).
#[cfg(not(any(test, feature = "test-failpoints")))]
#[derive(Debug, Default)]
pub(crate) struct Failpoints;

#[cfg(not(any(test, feature = "test-failpoints")))]
impl Failpoints {
    pub(crate) fn from_env() -> Self {
        Self
    }

    /// No failpoint armed.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn none() -> Self {
        Self
    }

    #[inline]
    #[allow(clippy::unused_self, clippy::unnecessary_wraps)]
    pub(crate) fn check(&self, _name: &str) -> io::Result<()> {
        Ok(())
    }
}

#[cfg_attr(not(any(test, feature = "test-failpoints")), allow(dead_code))]
fn injected(name: &str) -> io::Error {
    io::Error::other(format!("injected fault at failpoint {name}"))
}
