//! Probes that must not make the next write dirty the file's inode, and the
//! kernel counter that shows it.

use std::fs::{self, File, OpenOptions};
use std::path::Path;

/// How many probe-then-write rounds each test makes: far more dirtyings than
/// clock ticks in the microseconds they take, if a probe asks for the times.
pub(crate) const ROUNDS: usize = 20;

/// Attempts per measurement: the fewest dirtyings of these count.
const ATTEMPTS: usize = 3;

/// One measurement at a time: the control's full `stat`s between writes hand
/// out fine-grained timestamps, which move the clock every other file's
/// coarse timestamps read (the multigrain floor).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The fewest inode dirtyings of the file at `path` (ext4's
/// `ext4_mark_inode_dirty`, any process) in [`ATTEMPTS`] runs of `f`, through
/// a private tracefs instance filtered on the file's inode. The fewest: other
/// processes' fine-grained timestamps move the clock this file's coarse ones
/// read, and can only add dirtyings. `None`, with the reason printed, where
/// that cannot be measured here (not root, no tracefs, not ext4, or
/// timestamps that are not multigrain, Linux before 6.13): when `CI` is set
/// that is a failure, since CI's machine has all four.
pub(crate) fn inode_dirtyings(path: &Path, mut f: impl FnMut()) -> Option<usize> {
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let unavailable = |why: &str| {
        assert!(
            std::env::var_os("CI").is_none(),
            "counting inode dirtyings needs {why} (CI is set)"
        );
        eprintln!("SKIPPED: counting inode dirtyings needs {why}");
        None
    };
    if !is_ext4(path) {
        return unavailable("the temp directory on ext4");
    }
    let Some(tracer) = Tracer::new(path) else {
        return unavailable("root and tracefs at /sys/kernel/tracing");
    };
    if !has_multigrain_timestamps(path) {
        return unavailable("multigrain timestamps (Linux 6.13 or later)");
    }
    (0..ATTEMPTS).map(|_| tracer.count(&mut f)).min()
}

fn is_ext4(path: &Path) -> bool {
    const EXT4_SUPER_MAGIC: u64 = 0xEF53;
    // `f_type`'s integer type differs between architectures.
    rustix::fs::statfs(path).is_ok_and(|s| s.f_type as u64 == EXT4_SUPER_MAGIC)
}

/// The control, on a scratch file beside `path`: a full `stat` between writes
/// dirties the inode at every write.
fn has_multigrain_timestamps(path: &Path) -> bool {
    let scratch = tempfile::NamedTempFile::new_in(path.parent().unwrap_or(Path::new("."))).unwrap();
    let Some(tracer) = Tracer::new(scratch.path()) else {
        return false;
    };
    let file = appender(scratch.path());
    let dirtied = tracer.count(|| {
        for _ in 0..ROUNDS {
            write_byte(&file);
            fs::metadata(scratch.path()).unwrap();
        }
    });
    dirtied >= ROUNDS
}

/// Opens `path` for appending, as the outbox's files are written.
pub(crate) fn appender(path: &Path) -> File {
    OpenOptions::new().append(true).open(path).unwrap()
}

pub(crate) fn write_byte(mut file: &File) {
    std::io::Write::write_all(&mut file, b"x").unwrap();
}

/// A tracefs instance of its own, recording `ext4_mark_inode_dirty` for one inode.
struct Tracer {
    root: std::path::PathBuf,
}

impl Tracer {
    fn new(path: &Path) -> Option<Self> {
        use std::os::unix::fs::MetadataExt;
        let instances = Path::new("/sys/kernel/tracing/instances");
        if !instances.is_dir() {
            return None;
        }
        let ino = fs::metadata(path).ok()?.ino();
        let root = instances.join(format!("durable-outbox-test-{}-{ino}", std::process::id()));
        fs::create_dir(&root).ok()?;
        let tracer = Self { root };
        let event = tracer.root.join("events/ext4/ext4_mark_inode_dirty");
        fs::write(event.join("filter"), format!("ino == {ino}")).ok()?;
        fs::write(event.join("enable"), "1").ok()?;
        Some(tracer)
    }

    fn count(&self, f: impl FnOnce()) -> usize {
        fs::write(self.root.join("trace"), "").unwrap();
        fs::write(self.root.join("tracing_on"), "1").unwrap();
        f();
        fs::write(self.root.join("tracing_on"), "0").unwrap();
        let trace = fs::read_to_string(self.root.join("trace")).unwrap();
        trace
            .lines()
            .filter(|l| l.contains("ext4_mark_inode_dirty:"))
            .count()
    }
}

impl Drop for Tracer {
    fn drop(&mut self) {
        let _ = fs::write(
            self.root.join("events/ext4/ext4_mark_inode_dirty/enable"),
            "0",
        );
        let _ = fs::remove_dir(&self.root);
    }
}

#[test]
fn an_identity_probe_leaves_the_next_writes_timestamp_coarse() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal");
    fs::write(&path, b"x").unwrap();
    let file = appender(&path);
    let dirtied = inode_dirtyings(&path, || {
        for _ in 0..ROUNDS {
            write_byte(&file);
            let id = super::identity(&path).unwrap().unwrap();
            assert!(id.len > 1);
        }
    });
    if let Some(dirtied) = dirtied {
        // At most one per clock tick (4 ms at most) that passes during the loop.
        assert!(
            dirtied <= ROUNDS / 2,
            "{dirtied} inode dirtyings in {ROUNDS} writes, each after an identity probe"
        );
    }
}

#[test]
fn an_identity_probe_of_an_open_file_leaves_the_next_writes_timestamp_coarse() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit");
    fs::write(&path, b"x").unwrap();
    let file = appender(&path);
    let dirtied = inode_dirtyings(&path, || {
        for _ in 0..ROUNDS {
            write_byte(&file);
            super::identity_of(&file).unwrap();
        }
    });
    if let Some(dirtied) = dirtied {
        assert!(
            dirtied <= ROUNDS / 2,
            "{dirtied} inode dirtyings in {ROUNDS} writes, each after an identity probe"
        );
    }
}

#[test]
fn the_identity_is_the_one_std_reports() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    fs::write(&path, b"12345").unwrap();
    let probed = super::identity(&path).unwrap().unwrap();
    assert_eq!(
        probed,
        super::identity_of_metadata(&fs::metadata(&path).unwrap())
    );
    assert_eq!(probed.len, 5);
    assert_eq!(
        super::identity_of(&File::open(&path).unwrap()).unwrap(),
        probed
    );
    assert_eq!(super::identity(&dir.path().join("missing")).unwrap(), None);
}

/// The journal as a second handle follows it: each of its transactions
/// refreshes from the files before it writes (another process wrote). That
/// refresh must not make the next entry's write dirty the journal's inode.
#[test]
fn a_refresh_between_journal_writes_leaves_the_journals_inode_clean() {
    use crate::failpoint::Failpoints;
    use crate::store::Store;
    let dir = tempfile::tempdir().unwrap();
    let store = Store::new(dir.path());
    let faults = Failpoints::none();
    let (mut ours, mut theirs) = (None, None);
    // One entry appended and written, as a group of one's leader writes it.
    let append = |loaded: &mut crate::store::Loaded| {
        store
            .append_unsynced(loaded, None, Vec::new(), &[], &faults)
            .unwrap();
        loaded.take_unsynced().unwrap().write(&faults).unwrap();
    };
    append(store.refresh(&mut ours).unwrap());
    store.refresh(&mut theirs).unwrap();
    let dirtied = inode_dirtyings(store.journal_path(), || {
        for _ in 0..ROUNDS {
            append(ours.as_mut().unwrap());
            store.refresh(&mut theirs).unwrap();
        }
    });
    if let Some(dirtied) = dirtied {
        assert!(
            dirtied <= ROUNDS / 2,
            "{dirtied} inode dirtyings of the journal in {ROUNDS} entries, each followed by another handle's refresh"
        );
    }
}
