//! Advisory locks: `outbox.lock` serialises read-modify-writes across threads and
//! processes; one `owners/<id>.owner` file per open outbox proves its owner is alive.
//!
//! Locks are `flock`-style (std `File::lock`): released by the kernel when the
//! holder dies, which is exactly what makes a dead claimant detectable. They are
//! advisory and unreliable on network filesystems: keep an outbox on a local disk.

use std::fs::{self, File, OpenOptions, TryLockError};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::error::{Error, Result};
use crate::fsutil;

/// Name of the lock file inside an outbox directory. Never replaced or deleted.
pub(crate) const LOCK_FILE: &str = "outbox.lock";
/// Directory holding one owner file per open outbox.
pub(crate) const OWNERS_DIR: &str = "owners";

/// The directory-wide exclusive lock, guarding this process's cached state `T`.
///
/// The lock file also carries a **change counter**: eight bytes at offset 0, which
/// every holder that is about to write to the outbox bumps first (see
/// [`DirGuard::mark_writing`]). A holder that finds the counter where it last
/// left it knows no other process has written since, and skips re-reading the
/// files (see [`DirGuard::is_stale`]). The bump goes to the page cache, which
/// every process shares and a process crash does not lose; a bump always
/// precedes the write it announces, so a writer killed half-way is noticed too.
///
/// The `flock` may outlive one guard: while this process has journal entries
/// written but not yet fsynced (a commit group, see `commit`), it keeps the
/// lock, so no other process can read an entry that is not durable yet.
#[derive(Debug)]
pub(crate) struct DirLock<T> {
    path: PathBuf,
    /// One descriptor per open outbox plus the state only touched under the lock.
    /// The mutex serialises this process's threads (a `flock` belongs to an open
    /// file description, so threads sharing it would not exclude each other); the
    /// `flock` serialises processes.
    inner: Mutex<Slot<T>>,
}

#[derive(Debug)]
struct Slot<T> {
    file: File,
    state: T,
    /// Whether this process holds the `flock` now.
    held: bool,
    /// Keep the `flock` when the guard drops: unsynced entries are in the journal.
    pending: bool,
    /// The change counter this process's cached state is current with.
    seen: Option<u64>,
    /// The counter as read (or last bumped) during the current hold.
    counter: u64,
    /// Whether this hold has bumped the counter already.
    bumped: bool,
    /// When this process took the `flock` (feature `commit-profile` only).
    flocked_at: crate::profile::Mark,
}

/// Proof that the directory lock is held; gives access to the guarded `T`.
/// Unlocks on drop, unless a commit group keeps it (see [`DirGuard::set_pending`]).
pub(crate) struct DirGuard<'a, T> {
    inner: MutexGuard<'a, Slot<T>>,
    path: &'a Path,
    /// Let the `flock` go if this guard drops in a panic while a commit group
    /// is open (see [`DirGuard::release_on_panic`]).
    release_on_panic: bool,
}

impl<T> DirLock<T> {
    pub(crate) fn open(dir: &Path, state: T) -> Result<Self> {
        let path = dir.join(LOCK_FILE);
        let file = fsutil::open_private(&path, false)
            .map_err(|e| Error::io(&path, "open lock file", e))?;
        crate::fsutil::no_access_time(&file);
        Ok(Self {
            path,
            inner: Mutex::new(Slot {
                file,
                state,
                held: false,
                pending: false,
                seen: None,
                counter: 0,
                bumped: false,
                flocked_at: crate::profile::Mark::now(),
            }),
        })
    }

    /// Blocks until this thread holds the lock exclusively. Takes the `flock`
    /// unless this process holds it already (an open commit group), and then
    /// reads the change counter.
    pub(crate) fn lock(&self) -> Result<DirGuard<'_, T>> {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        if !inner.held {
            loop {
                match inner.file.lock() {
                    Ok(()) => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(Error::io(&self.path, "lock", e)),
                }
            }
            inner.held = true;
            inner.bumped = false;
            inner.flocked_at = crate::profile::Mark::now();
            let mut buf = [0u8; 8];
            let counter = match read_exact_at(&inner.file, &mut buf) {
                Ok(true) => u64::from_le_bytes(buf),
                // Never written: a new outbox, or one only older releases used.
                Ok(false) => 0,
                Err(e) => {
                    // Unlocks on drop.
                    let _ = DirGuard {
                        inner,
                        path: &self.path,
                        release_on_panic: true,
                    };
                    return Err(Error::io(&self.path, "read change counter", e));
                }
            };
            inner.counter = counter;
        }
        Ok(DirGuard {
            inner,
            path: &self.path,
            release_on_panic: false,
        })
    }
}

/// Reads the change counter without taking the lock, for a watcher that only
/// wants to know *whether* anyone wrote: one `pread`, no `stat` (a `stat` of
/// the journal between two of its writes would make the next one dirty the
/// journal's inode, and the next `fdatasync` pay a second I/O for it).
#[cfg(feature = "tokio")]
#[derive(Debug)]
pub(crate) struct CounterProbe {
    file: File,
}

#[cfg(feature = "tokio")]
impl CounterProbe {
    /// Opens `outbox.lock` in `dir` for reading (never through a symlink).
    pub(crate) fn open(dir: &Path) -> io::Result<Self> {
        let file = fsutil::open_existing(&dir.join(LOCK_FILE), false)?;
        crate::fsutil::no_access_time(&file);
        Ok(Self { file })
    }

    /// The counter now; `None` if it cannot be read (never written, or an error).
    pub(crate) fn read(&self) -> Option<u64> {
        let mut buf = [0u8; 8];
        match read_exact_at(&self.file, &mut buf) {
            Ok(true) => Some(u64::from_le_bytes(buf)),
            _ => None,
        }
    }
}

/// Reads exactly `buf.len()` bytes at offset 0; `false` if the file is shorter.
fn read_exact_at(file: &File, buf: &mut [u8]) -> io::Result<bool> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileExt;
        let mut done = 0;
        while done < buf.len() {
            match file.read_at(&mut buf[done..], done as u64) {
                Ok(0) => return Ok(false),
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }
    #[cfg(not(unix))]
    {
        // No positional reads: never trust the cache, always re-read the files.
        let _ = (file, buf);
        Ok(false)
    }
}

impl<T> DirGuard<'_, T> {
    /// Whether another process may have written since this process's cached
    /// state was last made current ([`Writes::mark_current`]).
    pub(crate) fn is_stale(&self) -> bool {
        cfg!(not(unix)) || self.inner.seen != Some(self.inner.counter)
    }

    /// Whether this process has journal entries written but not yet synced.
    pub(crate) fn is_pending(&self) -> bool {
        self.inner.pending
    }

    /// Lets the `flock` go if this guard drops in a panic while a commit group
    /// is open: for a group's leader, whose panic fails the group, so that
    /// nobody is left to finish it. Any other holder keeps it then: the open
    /// group's members are still waiting and their leader will write their
    /// entries (kept in memory until then) where this process last left the
    /// journal, which no other process may write to before.
    pub(crate) fn release_on_panic(&mut self) {
        self.release_on_panic = true;
    }

    /// Keeps the `flock` past this guard (`true`: unsynced entries are in the
    /// journal) or lets it go with the last guard (`false`).
    pub(crate) fn set_pending(&mut self, pending: bool) {
        self.inner.pending = pending;
    }

    /// The guarded state and the change counter, borrowed separately.
    pub(crate) fn split(&mut self) -> (&mut T, Writes<'_>) {
        let Slot {
            file,
            state,
            seen,
            counter,
            bumped,
            ..
        } = &mut *self.inner;
        (
            state,
            Writes {
                file,
                seen,
                counter,
                bumped,
                path: self.path,
            },
        )
    }

    /// As [`Writes::mark_writing`].
    ///
    /// # Errors
    ///
    /// As [`Writes::mark_writing`].
    pub(crate) fn mark_writing(&mut self) -> Result<()> {
        self.split().1.mark_writing()
    }

    /// As [`Writes::mark_current`].
    pub(crate) fn mark_current(&mut self) {
        self.split().1.mark_current();
    }
}

/// The change counter of one hold of the lock.
pub(crate) struct Writes<'a> {
    file: &'a File,
    seen: &'a mut Option<u64>,
    counter: &'a mut u64,
    bumped: &'a mut bool,
    path: &'a Path,
}

impl Writes<'_> {
    /// Records that the cached state is current with the files as they are now.
    pub(crate) fn mark_current(&mut self) {
        *self.seen = Some(*self.counter);
    }

    /// Announces a write: bumps the change counter (once per hold) before this
    /// process changes any file of the outbox, so every other process re-reads.
    ///
    /// # Errors
    ///
    /// The write error of the lock file; nothing else was written then.
    pub(crate) fn mark_writing(&mut self) -> Result<()> {
        if *self.bumped {
            return Ok(());
        }
        let was_current = *self.seen == Some(*self.counter);
        let next = self.counter.wrapping_add(1);
        write_all_at_start(self.file, &next.to_le_bytes())
            .map_err(|e| Error::io(self.path, "write change counter", e))?;
        *self.counter = next;
        *self.bumped = true;
        if was_current {
            *self.seen = Some(next);
        }
        Ok(())
    }
}

fn write_all_at_start(file: &File, bytes: &[u8]) -> io::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileExt;
        file.write_all_at(bytes, 0)
    }
    #[cfg(not(unix))]
    {
        let _ = (file, bytes);
        Ok(())
    }
}

impl<T> std::ops::Deref for DirGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.inner.state
    }
}

impl<T> std::ops::DerefMut for DirGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.inner.state
    }
}

impl<T> Drop for DirGuard<'_, T> {
    fn drop(&mut self) {
        // A leader's panic while a group is open leaves nobody to finish it:
        // let other processes in (the handle is poisoned by the commit group).
        if self.inner.pending && !(self.release_on_panic && std::thread::panicking()) {
            return;
        }
        self.inner.pending = false;
        if self.inner.held {
            self.inner.flocked_at.end(crate::profile::Span::Flock);
        }
        self.inner.held = false;
        if let Err(e) = self.inner.file.unlock() {
            tracing::error!(path = %self.path.display(), error = %e, "failed to release the outbox lock");
        }
    }
}

/// This open outbox's liveness token: an exclusively locked `owners/<id>.owner`.
///
/// **Invariant:** the lock is held for the whole life of the open outbox, so a claim
/// naming this owner is live exactly while the file is locked.
#[derive(Debug)]
pub(crate) struct OwnerLease {
    id: String,
    path: PathBuf,
    _file: File,
}

static OWNER_COUNTER: AtomicU64 = AtomicU64::new(0);

impl OwnerLease {
    /// Creates and locks a fresh owner file. Call with the directory lock held so
    /// a concurrent sweep cannot remove the file between creation and locking.
    pub(crate) fn acquire<T>(dir: &Path, _held: &DirGuard<'_, T>) -> Result<Self> {
        let owners = owners_dir(dir)?;
        loop {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let id = format!(
                "{}-{:x}-{}",
                std::process::id(),
                nanos,
                OWNER_COUNTER.fetch_add(1, Ordering::Relaxed)
            );
            let path = owners.join(format!("{id}.owner"));
            let mut options = OpenOptions::new();
            options.write(true).create_new(true);
            #[cfg(unix)]
            {
                use std::os::unix::fs::OpenOptionsExt;
                options.mode(fsutil::FILE_MODE);
            }
            match options.open(&path) {
                Ok(file) => {
                    file.try_lock().map_err(|e| {
                        Error::io(&path, "lock owner file", io::Error::other(e.to_string()))
                    })?;
                    return Ok(Self {
                        id,
                        path,
                        _file: file,
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(Error::io(&path, "create owner file", e)),
            }
        }
    }

    pub(crate) fn id(&self) -> &str {
        &self.id
    }
}

impl Drop for OwnerLease {
    fn drop(&mut self) {
        // Remove first, then the descriptor closes and the lock goes with it. A
        // checker that opened the file just before the removal sees it unlocked
        // only after we are gone, which is the truth.
        if let Err(e) = fs::remove_file(&self.path) {
            tracing::warn!(path = %self.path.display(), error = %e, "could not remove owner file");
        }
    }
}

/// Whether the open outbox `owner` is still alive (holds its owner file's lock).
///
/// Errors other than "not found" count as alive: a wrong "alive" only delays a
/// claim's resolution, a wrong "dead" would fail a message that is being sent.
pub(crate) fn owner_is_alive(dir: &Path, owner: &str) -> bool {
    if owner.is_empty() || owner.contains(['/', '\\']) || owner.contains("..") {
        return false;
    }
    let path = dir.join(OWNERS_DIR).join(format!("{owner}.owner"));
    match File::open(&path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => false,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot check owner liveness; assuming alive");
            true
        }
        Ok(file) => match file.try_lock() {
            Ok(()) => false,
            Err(TryLockError::WouldBlock) => true,
            Err(TryLockError::Error(e)) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot check owner liveness; assuming alive");
                true
            }
        },
    }
}

/// The owners directory, created if missing. A symlink or file in its place is
/// refused: a planted link must not make us create or delete files elsewhere.
pub(crate) fn owners_dir(dir: &Path) -> Result<PathBuf> {
    let owners = dir.join(OWNERS_DIR);
    fsutil::private_subdir(&owners)?;
    Ok(owners)
}

/// Removes owner files whose owners are gone. Call with the directory lock held.
pub(crate) fn sweep_dead_owners<T>(dir: &Path, _held: &DirGuard<'_, T>) -> Result<()> {
    let Ok(entries) = fs::read_dir(owners_dir(dir)?) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let Some(id) = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".owner"))
        else {
            continue;
        };
        if !owner_is_alive(dir, id)
            && let Err(e) = fs::remove_file(&path)
            && e.kind() != io::ErrorKind::NotFound
        {
            tracing::warn!(path = %path.display(), error = %e, "could not remove a dead owner file");
        }
    }
    Ok(())
}

/// Creates a directory (mode 0700 on Unix) and its missing parents, if it does
/// not exist. Each new directory is made durable: its name survives a power cut
/// only once the directory holding it is fsynced, and everything written inside
/// it would be lost with it.
pub(crate) fn create_private_dir(path: &Path) -> Result<()> {
    let mut missing = Vec::new();
    let mut at = path;
    while fs::symlink_metadata(at).is_err() {
        missing.push(at);
        match at.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => at = parent,
            _ => break,
        }
    }
    let mut builder = fs::DirBuilder::new();
    #[cfg(unix)]
    {
        use std::os::unix::fs::DirBuilderExt;
        builder.mode(0o700);
    }
    if missing.is_empty() {
        // It exists: succeed for a directory, name the problem for anything else.
        builder.recursive(true);
        return builder
            .create(path)
            .map_err(|e| Error::io(path, "create directory", e));
    }
    for dir in missing.into_iter().rev() {
        match builder.create(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && dir.is_dir() => continue,
            Err(e) => return Err(Error::io(dir, "create directory", e)),
        }
        let parent = dir
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        crate::fsutil::sync_dir(parent).map_err(|e| Error::io(parent, "fsync directory", e))?;
    }
    Ok(())
}

#[cfg(test)]
#[cfg(any(target_os = "linux", target_os = "android"))]
mod tests {
    use super::*;
    use std::fs::FileTimes;
    use std::time::{Duration, SystemTime};

    /// Sets `path`'s access time before its modification time, as after a
    /// write: the next read updates it on a `relatime` mount.
    fn age_access_time(path: &Path) -> SystemTime {
        let accessed = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000_000);
        let times = FileTimes::new()
            .set_accessed(accessed)
            .set_modified(accessed + Duration::from_secs(60));
        File::options()
            .write(true)
            .open(path)
            .and_then(|f| f.set_times(times))
            .expect("set times");
        accessed
    }

    fn accessed(path: &Path) -> SystemTime {
        std::fs::metadata(path)
            .and_then(|m| m.accessed())
            .expect("access time")
    }

    #[test]
    fn reading_the_change_counter_leaves_the_lock_files_access_time_alone() {
        let dir = tempfile::tempdir().expect("dir");
        // Does this filesystem update access times on a read at all?
        let control = dir.path().join("control");
        std::fs::write(&control, b"12345678").expect("write");
        let before = age_access_time(&control);
        std::fs::read(&control).expect("read");
        if accessed(&control) == before {
            assert!(
                std::env::var_os("CI").is_none(),
                "this test needs a filesystem that records access times (relatime) under {}",
                dir.path().display()
            );
            println!(
                "SKIPPED: {} does not record access times",
                dir.path().display()
            );
            return;
        }
        let lock = DirLock::open(dir.path(), ()).expect("open");
        lock.lock()
            .and_then(|mut g| g.mark_writing())
            .expect("write");
        let path = dir.path().join(LOCK_FILE);
        let before = age_access_time(&path);
        // A new hold reads the counter (the guard above let the flock go).
        drop(lock.lock().expect("lock"));
        #[cfg(feature = "tokio")]
        assert!(
            CounterProbe::open(dir.path())
                .expect("probe")
                .read()
                .is_some()
        );
        assert_eq!(
            accessed(&path),
            before,
            "reading the change counter dirtied the lock file's inode (its access time)"
        );
    }
}
