//! A recording FUSE filesystem: a plain in-memory filesystem that logs, in the
//! order the kernel delivers them, every operation that changes what a disk
//! would hold (writes, truncations, creations, unlinks, renames) and every
//! `fsync`/`fdatasync` and directory fsync. A process working in the mount sees
//! an ordinary filesystem; the log is what the crash-state enumerator replays.
//!
//! The kernel is not asked for a write-back cache, so every `write(2)` reaches
//! the filesystem before it returns, in order, and every fsync is delivered as
//! an `FSYNC`/`FSYNCDIR` request: the log sees the real syscalls of the
//! workload, without any seam in the crate under test.
//!
//! A lookup of a name starting with [`MARK_PREFIX`] is an in-band marker from
//! the workload (an acknowledgement, a send): it is logged and answered ENOENT.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{OsStr, OsString};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, LockOwner,
    OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyOpen, ReplyWrite, Request, TimeOrNow, WriteFlags,
};

/// Names the workload looks up to leave a marker in the log.
pub const MARK_PREFIX: &str = ".powerloss-mark-";

/// The root directory's inode.
pub const ROOT: u64 = 1;

/// One logged operation.
#[derive(Debug, Clone)]
pub enum Op {
    /// A new file or directory `name` in directory `dir`.
    Create {
        dir: u64,
        name: OsString,
        ino: u64,
        is_dir: bool,
    },
    /// `name` removed from `dir` (a file or an empty directory).
    Unlink { dir: u64, name: OsString },
    /// `from_dir/from` renamed to `to_dir/to`, replacing what was there.
    Rename {
        from_dir: u64,
        from: OsString,
        to_dir: u64,
        to: OsString,
    },
    /// `data` written to file `ino` at `offset`.
    Write {
        ino: u64,
        offset: u64,
        data: Vec<u8>,
    },
    /// File `ino` truncated or extended (with zeros) to `len`.
    SetLen { ino: u64, len: u64 },
    /// `fsync` or `fdatasync` of file `ino`.
    Fsync { ino: u64 },
    /// fsync of directory `ino`.
    FsyncDir { ino: u64 },
    /// A marker from the workload.
    Mark(String),
}

#[derive(Debug)]
enum Kind {
    File(Vec<u8>),
    Dir(BTreeMap<OsString, u64>),
}

#[derive(Debug)]
struct Node {
    kind: Kind,
    perm: u16,
    nlink: u32,
}

/// The live filesystem and its log.
#[derive(Debug)]
pub struct State {
    nodes: HashMap<u64, Node>,
    next_ino: u64,
    uid: u32,
    gid: u32,
    /// Every operation so far, in order.
    pub log: Vec<Op>,
}

/// The filesystem handed to `fuser`; the test keeps a clone of `state`.
pub struct RecordingFs {
    pub state: Arc<Mutex<State>>,
}

/// Entries and attributes are not cached by the kernel: every path resolution
/// asks, so the kernel's view can never drift from the filesystem's.
const TTL: Duration = Duration::ZERO;

impl RecordingFs {
    /// An empty filesystem whose files belong to `uid:gid`.
    pub fn new(uid: u32, gid: u32) -> Self {
        let mut nodes = HashMap::new();
        nodes.insert(
            ROOT,
            Node {
                kind: Kind::Dir(BTreeMap::new()),
                perm: 0o755,
                nlink: 2,
            },
        );
        Self {
            state: Arc::new(Mutex::new(State {
                nodes,
                next_ino: ROOT + 1,
                uid,
                gid,
                log: Vec::new(),
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Runs `workload` on a fresh recording mount whose filesystem is named
/// `fs_name`, and returns what it returned with the operation log, taken
/// once the mount is down (a workload that panics takes the mount down as
/// it unwinds). `None`, after reporting why (a failure when `CI` is set),
/// where this machine cannot mount one.
pub fn record<T>(fs_name: &str, workload: impl FnOnce(&Path) -> T) -> Option<(T, Vec<Op>)> {
    use std::os::unix::fs::MetadataExt;
    let unavailable = |why: &str| {
        crate::harness::missing_tool(
            "FUSE (/dev/fuse, and the right to mount: root, or fusermount3 from Debian's fuse3)",
            why,
        );
    };
    if !Path::new("/dev/fuse").exists() {
        unavailable("/dev/fuse does not exist");
        return None;
    }
    let base = tempfile::tempdir().unwrap();
    let mount = base.path().join("mnt");
    std::fs::create_dir(&mount).unwrap();
    let meta = std::fs::metadata(&mount).unwrap();
    let fs = RecordingFs::new(meta.uid(), meta.gid());
    let state = fs.state.clone();
    let mut config = fuser::Config::default();
    config.mount_options = vec![fuser::MountOption::FSName(fs_name.into())];
    let session = match fuser::spawn_mount(fs, &mount, &config) {
        Ok(session) => session,
        Err(e) => {
            unavailable(&format!("cannot mount a FUSE filesystem: {e}"));
            return None;
        }
    };
    let done = workload(&mount);
    session.umount_and_join().unwrap();
    let log = std::mem::take(&mut state.lock().unwrap().log);
    Some((done, log))
}

impl State {
    fn attr(&self, ino: u64) -> Option<FileAttr> {
        let node = self.nodes.get(&ino)?;
        let (kind, size) = match &node.kind {
            Kind::File(data) => (FileType::RegularFile, data.len() as u64),
            Kind::Dir(entries) => (FileType::Directory, entries.len() as u64),
        };
        Some(FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: UNIX_EPOCH,
            mtime: UNIX_EPOCH,
            ctime: UNIX_EPOCH,
            crtime: UNIX_EPOCH,
            kind,
            perm: node.perm,
            nlink: node.nlink,
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        })
    }

    fn dir(&self, ino: u64) -> Result<&BTreeMap<OsString, u64>, Errno> {
        match self.nodes.get(&ino).map(|n| &n.kind) {
            Some(Kind::Dir(entries)) => Ok(entries),
            Some(Kind::File(_)) => Err(Errno::ENOTDIR),
            None => Err(Errno::ENOENT),
        }
    }

    fn dir_mut(&mut self, ino: u64) -> Result<&mut BTreeMap<OsString, u64>, Errno> {
        match self.nodes.get_mut(&ino).map(|n| &mut n.kind) {
            Some(Kind::Dir(entries)) => Ok(entries),
            Some(Kind::File(_)) => Err(Errno::ENOTDIR),
            None => Err(Errno::ENOENT),
        }
    }

    fn file_mut(&mut self, ino: u64) -> Result<&mut Vec<u8>, Errno> {
        match self.nodes.get_mut(&ino).map(|n| &mut n.kind) {
            Some(Kind::File(data)) => Ok(data),
            Some(Kind::Dir(_)) => Err(Errno::EISDIR),
            None => Err(Errno::ENOENT),
        }
    }

    fn create(&mut self, dir: u64, name: &OsStr, mode: u32, is_dir: bool) -> Result<u64, Errno> {
        if self.dir(dir)?.contains_key(name) {
            return Err(Errno::EEXIST);
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        let kind = if is_dir {
            Kind::Dir(BTreeMap::new())
        } else {
            Kind::File(Vec::new())
        };
        self.nodes.insert(
            ino,
            Node {
                kind,
                perm: (mode & 0o7777) as u16,
                nlink: if is_dir { 2 } else { 1 },
            },
        );
        self.dir_mut(dir)?.insert(name.to_owned(), ino);
        self.log.push(Op::Create {
            dir,
            name: name.to_owned(),
            ino,
            is_dir,
        });
        Ok(ino)
    }

    fn remove(&mut self, dir: u64, name: &OsStr, want_dir: bool) -> Result<(), Errno> {
        let ino = *self.dir(dir)?.get(name).ok_or(Errno::ENOENT)?;
        match (&self.nodes[&ino].kind, want_dir) {
            (Kind::Dir(entries), true) if !entries.is_empty() => return Err(Errno::ENOTEMPTY),
            (Kind::Dir(_), false) => return Err(Errno::EISDIR),
            (Kind::File(_), true) => return Err(Errno::ENOTDIR),
            _ => {}
        }
        self.dir_mut(dir)?.remove(name);
        if let Some(node) = self.nodes.get_mut(&ino) {
            node.nlink = 0;
        }
        self.log.push(Op::Unlink {
            dir,
            name: name.to_owned(),
        });
        Ok(())
    }

    fn rename(
        &mut self,
        from_dir: u64,
        from: &OsStr,
        to_dir: u64,
        to: &OsStr,
        no_replace: bool,
    ) -> Result<(), Errno> {
        let ino = *self.dir(from_dir)?.get(from).ok_or(Errno::ENOENT)?;
        if let Some(&old) = self.dir(to_dir)?.get(to) {
            if no_replace {
                return Err(Errno::EEXIST);
            }
            if matches!(self.nodes[&old].kind, Kind::Dir(_)) {
                return Err(Errno::EISDIR);
            }
            if let Some(node) = self.nodes.get_mut(&old) {
                node.nlink = 0;
            }
        }
        self.dir_mut(from_dir)?.remove(from);
        self.dir_mut(to_dir)?.insert(to.to_owned(), ino);
        self.log.push(Op::Rename {
            from_dir,
            from: from.to_owned(),
            to_dir,
            to: to.to_owned(),
        });
        Ok(())
    }

    fn set_len(&mut self, ino: u64, len: u64) -> Result<(), Errno> {
        let data = self.file_mut(ino)?;
        data.resize(usize::try_from(len).map_err(|_| Errno::EFBIG)?, 0);
        self.log.push(Op::SetLen { ino, len });
        Ok(())
    }

    fn write(&mut self, ino: u64, offset: u64, bytes: &[u8]) -> Result<(), Errno> {
        let data = self.file_mut(ino)?;
        let start = usize::try_from(offset).map_err(|_| Errno::EFBIG)?;
        let end = start + bytes.len();
        if data.len() < end {
            data.resize(end, 0);
        }
        data[start..end].copy_from_slice(bytes);
        self.log.push(Op::Write {
            ino,
            offset,
            data: bytes.to_vec(),
        });
        Ok(())
    }
}

fn reply_entry(state: &State, ino: u64, reply: ReplyEntry) {
    match state.attr(ino) {
        Some(attr) => reply.entry(&TTL, &attr, Generation(0)),
        None => reply.error(Errno::ENOENT),
    }
}

impl Filesystem for RecordingFs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let mut state = self.lock();
        if let Some(what) = name.to_str().and_then(|n| n.strip_prefix(MARK_PREFIX)) {
            state.log.push(Op::Mark(what.to_owned()));
            reply.error(Errno::ENOENT);
            return;
        }
        match state.dir(parent.0).map(|d| d.get(name).copied()) {
            Ok(Some(ino)) => reply_entry(&state, ino, reply),
            Ok(None) => reply.error(Errno::ENOENT),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.lock().attr(ino.0) {
            Some(attr) => reply.attr(&TTL, &attr),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let mut state = self.lock();
        if let Some(mode) = mode
            && let Some(node) = state.nodes.get_mut(&ino.0)
        {
            node.perm = (mode & 0o7777) as u16;
        }
        if let Some(len) = size
            && let Err(e) = state.set_len(ino.0, len)
        {
            reply.error(e);
            return;
        }
        match state.attr(ino.0) {
            Some(attr) => reply.attr(&TTL, &attr),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn mknod(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        if mode & 0o170_000 != 0o100_000 {
            reply.error(Errno::EPERM);
            return;
        }
        let mut state = self.lock();
        match state.create(parent.0, name, mode & !umask, false) {
            Ok(ino) => reply_entry(&state, ino, reply),
            Err(e) => reply.error(e),
        }
    }

    fn mkdir(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let mut state = self.lock();
        match state.create(parent.0, name, mode & !umask, true) {
            Ok(ino) => reply_entry(&state, ino, reply),
            Err(e) => reply.error(e),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        match self.lock().remove(parent.0, name, false) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        match self.lock().remove(parent.0, name, true) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        if flags.contains(RenameFlags::RENAME_EXCHANGE) {
            reply.error(Errno::EINVAL);
            return;
        }
        let no_replace = flags.contains(RenameFlags::RENAME_NOREPLACE);
        match self
            .lock()
            .rename(parent.0, name, newparent.0, newname, no_replace)
        {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.lock().nodes.get(&ino.0).map(|n| &n.kind) {
            Some(Kind::File(_)) => reply.opened(FileHandle(0), FopenFlags::empty()),
            Some(Kind::Dir(_)) => reply.error(Errno::EISDIR),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let state = self.lock();
        match state.nodes.get(&ino.0).map(|n| &n.kind) {
            Some(Kind::File(data)) => {
                let start = usize::try_from(offset)
                    .unwrap_or(usize::MAX)
                    .min(data.len());
                let end = start.saturating_add(size as usize).min(data.len());
                reply.data(&data[start..end]);
            }
            Some(Kind::Dir(_)) => reply.error(Errno::EISDIR),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        match self.lock().write(ino.0, offset, data) {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => reply.error(e),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.lock().log.push(Op::Fsync { ino: ino.0 });
        reply.ok();
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let state = self.lock();
        let entries = match state.dir(ino.0) {
            Ok(entries) => entries,
            Err(e) => {
                reply.error(e);
                return;
            }
        };
        let mut all = vec![
            (ino.0, FileType::Directory, OsString::from(".")),
            (ROOT, FileType::Directory, OsString::from("..")),
        ];
        for (name, child) in entries {
            let kind = match state.nodes.get(child).map(|n| &n.kind) {
                Some(Kind::Dir(_)) => FileType::Directory,
                _ => FileType::RegularFile,
            };
            all.push((*child, kind, name.clone()));
        }
        let skip = usize::try_from(offset).unwrap_or(usize::MAX);
        for (i, (child, kind, name)) in all.into_iter().enumerate().skip(skip) {
            if reply.add(INodeNo(child), (i + 1) as u64, kind, &name) {
                break;
            }
        }
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.lock().log.push(Op::FsyncDir { ino: ino.0 });
        reply.ok();
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        reply.ok();
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        let mut state = self.lock();
        let created = state.create(parent.0, name, mode & !umask, false);
        match created.map(|ino| state.attr(ino)) {
            Ok(Some(attr)) => reply.created(
                &TTL,
                &attr,
                Generation(0),
                FileHandle(0),
                FopenFlags::empty(),
            ),
            Ok(None) => reply.error(Errno::EIO),
            Err(e) => reply.error(e),
        }
    }
}
