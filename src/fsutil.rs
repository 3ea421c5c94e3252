//! The few low-level file operations everything durable is built from.
//!
//! Durability contract (see ARCHITECTURE.md): a rename within one directory is
//! atomic; data is durable only after `sync_all` on the file **and** an fsync of the
//! directory that names it. `tempfile`'s `persist` is a bare rename, so the syncs
//! are done here explicitly. A failed fsync is never retried: the caller gets the
//! error and must treat the data as possibly lost.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::failpoint::Failpoints;

/// Mode of every file the outbox creates: owner read/write only (bodies are private).
pub(crate) const FILE_MODE: u32 = 0o600;

/// Prefix of temp files used for atomic replacement; swept on open.
pub(crate) const TEMP_PREFIX: &str = ".outbox-tmp-";

/// How far an atomic replace got before it failed.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum ReplaceFailure {
    /// Failed before the rename: the previous file is intact and current.
    BeforeRename,
    /// The rename happened but the directory fsync failed: the new file is visible
    /// but may not survive a power loss. The handle must be poisoned.
    AfterRename,
}

/// Opens (creating if needed, mode 0600) a file for reading and writing, refusing
/// to follow a symlink at the last path component.
pub(crate) fn open_private(path: &Path, append: bool) -> io::Result<File> {
    let mut options = OpenOptions::new();
    options.read(true).create(true);
    if append {
        options.append(true);
    } else {
        options.write(true);
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(FILE_MODE).custom_flags(O_NOFOLLOW);
    }
    options.open(path)
}

/// Stops reads through `file` from updating the file's access time
/// (`O_NOATIME`), for a file that is read right after another writer wrote
/// it, on every transaction: on a `relatime` mount each such read after a
/// write updates the access time and dirties the inode again, as the write
/// just did (`perf record -e ext4:ext4_mark_inode_dirty`: one from `pwrite`,
/// one from `pread`'s `touch_atime`). Nothing reads these files' access times.
/// Linux allows the flag to the file's owner only: for a file another user
/// owns (an outbox shared by a group) reads keep updating it, as before.
pub(crate) fn no_access_time(file: &File) {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        use rustix::fs::{OFlags, fcntl_getfl, fcntl_setfl};
        if let Ok(flags) = fcntl_getfl(file) {
            // EPERM (not the owner) is the documented fallback above.
            let _ = fcntl_setfl(file, flags | OFlags::NOATIME);
        }
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    let _ = file;
}

/// Reads into `buf` from `offset` until it is full or the file ends; returns
/// how many bytes were read. Unlike `File::read_to_end`, which `stat`s the
/// file to size its buffer (and so asks for its timestamps: see
/// [`identity`]), it makes no call but the reads.
pub(crate) fn read_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match read_once_at(file, &mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

#[cfg(unix)]
fn read_once_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    std::os::unix::fs::FileExt::read_at(file, buf, offset)
}

#[cfg(not(unix))]
fn read_once_at(mut file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    use std::io::{Read, Seek, SeekFrom};
    file.seek(SeekFrom::Start(offset))?;
    file.read(buf)
}

/// Writes all of `buf` at `offset`, leaving the file's cursor alone on Unix.
pub(crate) fn write_all_at(file: &File, buf: &[u8], offset: u64) -> io::Result<()> {
    #[cfg(unix)]
    {
        std::os::unix::fs::FileExt::write_all_at(file, buf, offset)
    }
    #[cfg(not(unix))]
    {
        use std::io::{Seek, SeekFrom};
        let mut file = file;
        file.seek(SeekFrom::Start(offset))?;
        file.write_all(buf)
    }
}

/// A file's identity and length: what is needed to notice that it was
/// replaced or grew, without its timestamps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Identity {
    pub(crate) dev: u64,
    pub(crate) ino: u64,
    pub(crate) len: u64,
}

/// The identity and length of the file at `path` (`None` if there is none),
/// without asking for its timestamps: on Linux 6.13+ (multigrain timestamps)
/// a `stat` that reads a file's modification or change time makes the next
/// write to that file take a fine-grained timestamp, which dirties its inode
/// on every write instead of once per clock tick; on ext4 without a journal
/// each dirty inode then costs an extra write at the next `fdatasync` of any
/// file whose inode shares its inode-table block. Files written on every
/// transaction (the journal, the audit log) are probed with this.
pub(crate) fn identity(path: &Path) -> io::Result<Option<Identity>> {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        use rustix::fs::{AtFlags, CWD, StatxFlags};
        match rustix::fs::statx(
            CWD,
            path,
            AtFlags::empty(),
            StatxFlags::INO | StatxFlags::SIZE,
        ) {
            Ok(stat) => return Ok(Some(identity_of_statx(&stat))),
            Err(rustix::io::Errno::NOENT) => return Ok(None),
            // No `statx` (an old kernel, a sandbox): the portable call below.
            Err(rustix::io::Errno::NOSYS | rustix::io::Errno::PERM) => {}
            Err(e) => return Err(e.into()),
        }
    }
    match fs::metadata(path) {
        Ok(meta) => Ok(Some(identity_of_metadata(&meta))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// As [`identity`], for an open file.
pub(crate) fn identity_of(file: &File) -> io::Result<Identity> {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        use rustix::fs::{AtFlags, StatxFlags};
        match rustix::fs::statx(
            file,
            "",
            AtFlags::EMPTY_PATH,
            StatxFlags::INO | StatxFlags::SIZE,
        ) {
            Ok(stat) => return Ok(identity_of_statx(&stat)),
            Err(rustix::io::Errno::NOSYS | rustix::io::Errno::PERM) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(identity_of_metadata(&file.metadata()?))
}

#[cfg(any(target_os = "linux", target_os = "android"))]
fn identity_of_statx(stat: &rustix::fs::Statx) -> Identity {
    Identity {
        // The encoding `std`'s `MetadataExt::dev` gives for the same file.
        dev: rustix::fs::makedev(stat.stx_dev_major, stat.stx_dev_minor),
        ino: stat.stx_ino,
        len: stat.stx_size,
    }
}

/// The identity and length in `meta`.
pub(crate) fn identity_of_metadata(meta: &fs::Metadata) -> Identity {
    #[cfg(unix)]
    let (dev, ino) = {
        use std::os::unix::fs::MetadataExt;
        (meta.dev(), meta.ino())
    };
    #[cfg(not(unix))]
    let (dev, ino) = (0, 0);
    Identity {
        dev,
        ino,
        len: meta.len(),
    }
}

/// Opens an existing file for reading (and writing, if `write`), refusing to
/// follow a symlink at the last path component: a planted link must never make
/// the outbox read or write someone else's file.
pub(crate) fn open_existing(path: &Path, write: bool) -> io::Result<File> {
    let mut options = OpenOptions::new();
    options.read(true).write(write);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(O_NOFOLLOW);
    }
    options.open(path)
}

/// Reads a whole file without following a symlink at its last component.
pub(crate) fn read_existing(path: &Path) -> io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    io::Read::read_to_end(&mut open_existing(path, false)?, &mut bytes)?;
    Ok(bytes)
}

/// Writes `bytes` to a new file `dir/<stem>-<n>` (the first free `n`), mode
/// 0600, created exclusively (so never through a planted symlink), and fsyncs it
/// and the directory. Returns its path.
pub(crate) fn write_quarantine(dir: &Path, stem: &str, bytes: &[u8]) -> Result<PathBuf> {
    for n in 0u32.. {
        let path = dir.join(format!("{stem}-{n}"));
        let mut options = OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(FILE_MODE);
        }
        match options.open(&path) {
            Ok(mut file) => {
                file.write_all(bytes)
                    .and_then(|()| file.sync_all())
                    .and_then(|()| sync_dir(dir))
                    .map_err(|e| Error::io(&path, "write quarantine file", e))?;
                return Ok(path);
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(Error::io(&path, "create quarantine file", e)),
        }
    }
    unreachable!("u32 names run out only after four billion quarantines")
}

/// `O_NOFOLLOW` for the platforms we build on (the value differs by architecture).
#[cfg(all(unix, any(target_os = "linux", target_os = "android")))]
#[cfg(any(target_arch = "aarch64", target_arch = "arm"))]
const O_NOFOLLOW: i32 = 0o100_000;
#[cfg(all(unix, any(target_os = "linux", target_os = "android")))]
#[cfg(not(any(target_arch = "aarch64", target_arch = "arm")))]
const O_NOFOLLOW: i32 = 0o400_000;
#[cfg(all(unix, not(any(target_os = "linux", target_os = "android"))))]
const O_NOFOLLOW: i32 = 0x0100;

/// Makes sure `path`, a directory the outbox keeps inside its own (`owners/`,
/// `history/`), is a real directory, creating it (mode 0700) if missing. A
/// symlink or a file in its place is refused, never followed: a planted link
/// must not make the outbox write bodies or lock files somewhere else. A new
/// directory is made durable (its parent fsynced) before this returns.
pub(crate) fn private_subdir(path: &Path) -> Result<()> {
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => return Ok(()),
        Ok(_) => {
            return Err(Error::io(
                path,
                "open directory",
                io::Error::other("not a directory (a symlink or a file is in the way)"),
            ));
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io(path, "stat", e)),
    }
    let mut builder = fs::DirBuilder::new();
    #[cfg(unix)]
    {
        use std::os::unix::fs::DirBuilderExt;
        builder.mode(0o700);
    }
    // Not recursive: the parent is the outbox directory, which exists, and a
    // link planted between the check above and here makes this fail.
    match builder.create(path) {
        // The new name is durable only once the parent is fsynced: without it a
        // power cut can keep later changes that rely on it and lose the directory.
        Ok(()) => {
            let parent = path.parent().unwrap_or(Path::new("."));
            sync_dir(parent).map_err(|e| Error::io(parent, "fsync directory", e))
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => match fs::symlink_metadata(path) {
            Ok(meta) if meta.is_dir() => Ok(()),
            _ => Err(Error::io(path, "create directory", e)),
        },
        Err(e) => Err(Error::io(path, "create directory", e)),
    }
}

/// fsyncs a directory so that renames and creations inside it are durable.
pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    #[cfg(unix)]
    {
        File::open(dir)?.sync_all()
    }
    #[cfg(not(unix))]
    {
        // Windows has no directory fsync; NTFS journals the rename's metadata.
        let _ = dir;
        Ok(())
    }
}

/// Atomically replaces `dir/name` with `bytes`: temp file in `dir` (mode 0600, unique
/// name, created exclusively so a planted symlink is never followed) → write →
/// fsync → rename over → fsync `dir`.
///
/// On failure before the rename the temp file is removed and the old file is
/// untouched.
///
/// `failpoint` names this replace's fault points (`<failpoint>.write`, `.fsync`,
/// `.rename`, `.dir_fsync`) for the crash tests.
pub(crate) fn replace_atomically(
    dir: &Path,
    name: &str,
    bytes: &[u8],
    faults: &Failpoints,
    failpoint: &str,
) -> std::result::Result<(), (ReplaceFailure, Error)> {
    let point = |step: &str| format!("{failpoint}.{step}");
    let target = dir.join(name);
    let before = |op: &'static str, path: &Path, e: io::Error| {
        (ReplaceFailure::BeforeRename, Error::io(path, op, e))
    };
    let mut builder = tempfile::Builder::new();
    builder.prefix(TEMP_PREFIX).suffix(".tmp");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(fs::Permissions::from_mode(FILE_MODE));
    }
    let mut temp = builder
        .tempfile_in(dir)
        .map_err(|e| before("create temp file", dir, e))?;
    let temp_path = temp.path().to_path_buf();
    faults
        .check(&point("write"))
        .and_then(|()| temp.write_all(bytes))
        .map_err(|e| before("write", &temp_path, e))?;
    faults
        .check(&point("fsync"))
        .and_then(|()| temp.as_file().sync_all())
        .map_err(|e| before("fsync", &temp_path, e))?;
    faults
        .check(&point("rename"))
        .map_err(|e| before("rename", &target, e))?;
    temp.persist(&target)
        .map_err(|e| before("rename", &target, e.error))?;
    faults
        .check(&point("dir_fsync"))
        .and_then(|()| sync_dir(dir))
        .map_err(|e| {
            (
                ReplaceFailure::AfterRename,
                Error::io(dir, "fsync directory", e),
            )
        })?;
    Ok(())
}

/// Removes temp files left behind by writers that crashed mid-replace.
/// Call only while holding the directory lock: a live writer's temp file is in use
/// until it releases the lock.
pub(crate) fn sweep_temp_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    let entries = fs::read_dir(dir).map_err(|e| Error::io(dir, "read directory", e))?;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(dir, "read directory", e))?;
        let name = entry.file_name();
        if name.to_string_lossy().starts_with(TEMP_PREFIX) {
            let path = entry.path();
            match fs::remove_file(&path) {
                Ok(()) => removed.push(path),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io(&path, "remove stale temp file", e)),
            }
        }
    }
    Ok(removed)
}

#[cfg(test)]
pub(crate) mod tests;
