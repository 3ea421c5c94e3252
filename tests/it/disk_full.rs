//! A full disk, for real (ENOSPC on a small tmpfs): a call that cannot get space
//! returns `Error::Io` carrying ENOSPC and never panics; what is on disk still
//! loads and holds every acknowledged item; no temp file is left behind; the audit
//! chain verifies; nothing is handed to `send` twice, and what was handed is
//! recorded as sent or failed as ambiguous, never left to go again; and once space
//! is freed the outbox enqueues and delivers again.
//!
//! Mounting a tmpfs needs privileges: as root the test mounts one directly,
//! otherwise it re-runs itself inside `unshare -rm` (a user and mount namespace).
//! When neither works it prints why and passes without running.
//! `OUTBOX_DISK_FULL_VIA_UNSHARE=1` forces the `unshare` path.
//!
//! File-only by design: ENOSPC on the outbox's filesystem.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use durable_outbox::{
    AMBIGUOUS_AFTER_RESTART, AuditLog, Error, ItemState, ManualClock, NewMessage, Outbox,
};

use crate::harness::{START, builder};

const TEST_NAME: &str =
    "disk_full::a_full_disk_fails_cleanly_and_the_outbox_recovers_when_space_returns";
const TMPFS_SIZE: &str = "64m";
/// Set (to the mount point) in the re-run inside `unshare`.
const MOUNTED_ENV: &str = "OUTBOX_DISK_FULL_MOUNTED";
const INNER_MARKER: &str = "disk_full: running on the tmpfs mounted by unshare";

/// A tmpfs mounted for the test; unmounted on drop, even when the test fails.
struct Tmpfs {
    path: PathBuf,
    /// Whether we mounted it (and so must unmount it).
    owned: bool,
    _root: Option<tempfile::TempDir>,
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let unmounted = Command::new("umount")
            .arg(&self.path)
            .status()
            .is_ok_and(|s| s.success());
        if !unmounted {
            // Something still holds a file open: detach it now, free it when released.
            let _ = Command::new("umount").arg("-l").arg(&self.path).status();
        }
    }
}

enum Setup {
    Mounted(Tmpfs),
    /// The test ran (or was skipped) in a child process; nothing left to do here.
    Done,
}

/// Mounts a tmpfs directly, or re-runs this test inside `unshare -rm`.
fn setup() -> Setup {
    if let Ok(path) = std::env::var(MOUNTED_ENV) {
        println!("{INNER_MARKER}");
        return Setup::Mounted(Tmpfs {
            path: PathBuf::from(path),
            owned: false,
            _root: None,
        });
    }
    let root = tempfile::tempdir().expect("temp dir");
    let mnt = root.path().join("mnt");
    std::fs::create_dir(&mnt).expect("mount point");
    let direct = if std::env::var_os("OUTBOX_DISK_FULL_VIA_UNSHARE").is_some() {
        Err("OUTBOX_DISK_FULL_VIA_UNSHARE is set".to_owned())
    } else {
        Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={TMPFS_SIZE}"), "tmpfs"])
            .arg(&mnt)
            .output()
            .map_err(|e| format!("cannot run mount: {e}"))
            .and_then(|out| {
                if out.status.success() {
                    Ok(())
                } else {
                    Err(String::from_utf8_lossy(&out.stderr).trim().to_owned())
                }
            })
    };
    match direct {
        Ok(()) => Setup::Mounted(Tmpfs {
            path: mnt,
            owned: true,
            _root: Some(root),
        }),
        Err(why) => {
            rerun_under_unshare(&mnt, &why);
            Setup::Done
        }
    }
}

fn rerun_under_unshare(mnt: &Path, direct_failure: &str) {
    let exe = std::env::current_exe().expect("test binary");
    let script = format!(
        "mount -t tmpfs -o size={TMPFS_SIZE} tmpfs \"$1\" && \
         {MOUNTED_ENV}=\"$1\" exec \"$2\" --exact \"$3\" --nocapture --test-threads=1"
    );
    let out = Command::new("unshare")
        .args(["-rm", "sh", "-c", &script, "sh"])
        .arg(mnt)
        .arg(&exe)
        .arg(TEST_NAME)
        .output();
    let out = match out {
        Ok(out) => out,
        Err(e) => {
            crate::harness::missing_tool(
                "a tmpfs mount (root, or unshare -rm)",
                &format!("mount: {direct_failure}; cannot run unshare: {e}"),
            );
            return;
        }
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !stdout.contains(INNER_MARKER) {
        crate::harness::missing_tool(
            "a tmpfs mount (root, or unshare -rm)",
            &format!("mount: {direct_failure}; unshare -rm: {}", stderr.trim()),
        );
        return;
    }
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "the disk-full test failed inside unshare -rm:\n{stdout}\n{stderr}"
    );
    eprintln!("disk_full: ran inside unshare -rm (mount: {direct_failure})");
}

/// Filler files that take every free byte of the tmpfs.
struct Filler {
    files: Vec<PathBuf>,
}

impl Filler {
    /// Takes all free space but `leave` bytes (rounded to pages by the tmpfs).
    fn fill(mnt: &Path, leave: u64) -> Self {
        let mut files = Vec::new();
        for chunk in [1 << 20, 4096, 1] {
            let path = mnt.join(format!("filler-{}", files.len()));
            let mut file = std::fs::File::create(&path).expect("filler file");
            files.push(path);
            let block = vec![0xA5u8; chunk];
            loop {
                match file.write_all(&block) {
                    Ok(()) => {}
                    Err(e) if e.kind() == ErrorKind::StorageFull => break,
                    Err(e) => panic!("filling the tmpfs: {e}"),
                }
            }
        }
        if leave > 0 {
            let big = std::fs::OpenOptions::new()
                .write(true)
                .open(&files[0])
                .expect("filler");
            let len = big.metadata().expect("filler size").len();
            big.set_len(len.saturating_sub(leave))
                .expect("shrink filler");
        }
        Self { files }
    }

    fn free(self) {
        for file in self.files {
            std::fs::remove_file(file).expect("remove filler");
        }
    }
}

fn message(key: &str) -> NewMessage {
    NewMessage {
        idempotency_key: key.to_owned(),
        connector: "telegram".into(),
        grant_id: "grant-1".into(),
        // One chat per message: each is processed on its own, and per-destination
        // order would hold a message behind an earlier one never processed.
        destination: format!("chat-{key}"),
        // Big enough that the journal and the log need fresh space soon.
        content: format!("{key}: {}", "x".repeat(12_000)),
        ..Default::default()
    }
}

/// What the test knows: acknowledged keys and how often each was handed to `send`.
#[derive(Default)]
struct Ledger {
    acked: BTreeSet<String>,
    handed: BTreeMap<String, u32>,
}

impl Ledger {
    /// A `send` that counts hand-offs and always delivers.
    fn send(&mut self) -> impl FnMut(&durable_outbox::OutboxItem) -> SendResult + '_ {
        |item| {
            *self
                .handed
                .entry(item.idempotency_key().to_owned())
                .or_default() += 1;
            Ok(Some(format!("tr-{}", item.idempotency_key())))
        }
    }
}

type SendResult = Result<Option<String>, durable_outbox::SendError>;

/// A full-disk failure: `Error::Io` whose cause is ENOSPC.
fn assert_enospc(what: &str, err: &Error) {
    let enospc = matches!(err, Error::Io { source, .. } if source.kind() == ErrorKind::StorageFull);
    assert!(
        enospc,
        "full-disk-is-Io broken: {what} on a full disk returned {err:?}, not Error::Io carrying ENOSPC"
    );
}

fn temp_files(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .expect("read outbox dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".outbox-tmp-"))
        .collect()
}

/// While the disk is still full: what a crash right now would leave must load,
/// hold every acknowledged item and verify. Checked on a copy off the tmpfs, so
/// nothing is written to the full disk.
fn check_what_is_on_disk(dir: &Path, ledger: &Ledger, when: &str) {
    assert!(
        temp_files(dir).is_empty(),
        "no-temp-leftovers broken {when}: {:?}",
        temp_files(dir)
    );
    let audit = dir.join("audit.jsonl");
    if let Err(e) = AuditLog::verify(&audit) {
        panic!("audit-chain broken {when}: {e}");
    }
    let copy = tempfile::tempdir().expect("scratch dir");
    for name in ["outbox.json", "outbox.journal", "audit.jsonl"] {
        if dir.join(name).exists() {
            std::fs::copy(dir.join(name), copy.path().join(name)).expect("copy");
        }
    }
    let outbox = Outbox::open(copy.path()).unwrap_or_else(|e| {
        panic!("loads broken {when}: the files on the full disk do not open: {e}")
    });
    // Live or already moved to history (opening compacts, and the copy is opened
    // with the real clock, to which these items are old): `get` finds both.
    let lost: Vec<&String> = ledger
        .acked
        .iter()
        .filter(|key| outbox.get(key).expect("get").is_none())
        .collect();
    assert!(
        lost.is_empty(),
        "never-lost broken {when}: acknowledged items missing on disk: {lost:?}"
    );
    if let Err(e) = outbox.verify_audit() {
        panic!("audit-chain broken {when} (state against log): {e}");
    }
}

/// After space returns: a new handle opens, repairs, and works.
fn check_recovered(dir: &Path, clock: &ManualClock, ledger: &mut Ledger, cycle: &str) -> Outbox {
    let outbox = open(dir, clock).unwrap_or_else(|e| {
        panic!("recovers broken after {cycle}: open failed once space was freed: {e}")
    });
    if let Err(e) = outbox.verify_audit() {
        panic!("audit-chain broken after {cycle}: {e}");
    }
    let items: BTreeMap<String, durable_outbox::OutboxItem> = outbox
        .list_items()
        .expect("items")
        .into_iter()
        .map(|i| (i.idempotency_key().to_owned(), i))
        .collect();
    for key in &ledger.acked {
        assert!(
            items.contains_key(key),
            "never-lost broken after {cycle}: acknowledged {key} is gone"
        );
    }
    for (key, n) in &ledger.handed {
        assert!(
            *n == 1,
            "at-most-once broken after {cycle}: {key} was handed to send {n} times"
        );
        let item = &items[key];
        let settled = item.state() == ItemState::Sent
            || (item.state() == ItemState::Failed
                && item.error_code() == Some(AMBIGUOUS_AFTER_RESTART))
            || item.dispatch_claimed();
        assert!(
            settled,
            "at-most-once broken after {cycle}: {key} reached send but is {} ({:?}): it could \
             be sent again",
            item.state(),
            item.error_code()
        );
    }
    assert!(
        temp_files(dir).is_empty(),
        "no-temp-leftovers broken after {cycle}"
    );
    let key = format!("after-{cycle}");
    outbox
        .enqueue(message(&key))
        .unwrap_or_else(|e| panic!("recovers broken after {cycle}: enqueue failed: {e}"));
    ledger.acked.insert(key.clone());
    let receipt = outbox
        .process(&key, ledger.send())
        .unwrap_or_else(|e| panic!("recovers broken after {cycle}: process failed: {e}"));
    assert_eq!(
        receipt.outcome.as_str(),
        "sent",
        "recovers broken after {cycle}"
    );
    outbox
}

/// Enqueues fresh keys until a call fails; returns that error.
fn enqueue_until_full(outbox: &Outbox, ledger: &mut Ledger, cycle: &str) -> Error {
    for i in 0..20_000 {
        let key = format!("{cycle}-{i}");
        match outbox.enqueue(message(&key)) {
            Ok(_) => {
                ledger.acked.insert(key);
            }
            Err(err) => {
                eprintln!("disk_full: {cycle}: enqueue #{i} hit the full disk: {err}");
                return err;
            }
        }
    }
    panic!("full-disk broken: 20,000 enqueues of 12 KB fit on a {TMPFS_SIZE} tmpfs ({cycle})")
}

fn open(dir: &Path, clock: &ManualClock) -> Result<Outbox, Error> {
    builder(dir, clock)
        .rate_limit(u32::MAX, Duration::from_secs(60))
        .open()
}

#[test]
fn a_full_disk_fails_cleanly_and_the_outbox_recovers_when_space_returns() {
    let tmpfs = match setup() {
        Setup::Mounted(tmpfs) => tmpfs,
        Setup::Done => return,
    };
    let mnt = tmpfs.path.clone();
    let dir = mnt.join("outbox");
    let clock = ManualClock::at(START).expect("clock");
    let mut ledger = Ledger::default();
    let mut outbox = open(&dir, &clock).expect("open on the tmpfs");
    for i in 0..5 {
        let key = format!("before-{i}");
        outbox.enqueue(message(&key)).expect("enqueue with space");
        ledger.acked.insert(key);
    }
    outbox
        .process("before-0", ledger.send())
        .expect("deliver with space");

    // Enqueue until the disk is full, with different amounts of space left at the
    // start, so the space runs out in different writes (the log's append, the
    // journal's growth).
    for (cycle, leave) in [
        ("enqueue-full", 0),
        ("enqueue-64k", 64 << 10),
        ("enqueue-1m", 3 << 19),
    ] {
        let filler = Filler::fill(&mnt, leave);
        let err = enqueue_until_full(&outbox, &mut ledger, cycle);
        assert_enospc("enqueue", &err);
        // Later calls on the same handle fail too, cleanly (Io or Poisoned).
        let key = format!("{cycle}-one-more");
        match outbox.enqueue(message(&key)) {
            Err(Error::Io { .. } | Error::Poisoned) => {}
            Ok(_) => {
                ledger.acked.insert(key);
            }
            Err(other) => panic!("a second enqueue on a full disk returned {other:?}"),
        }
        check_what_is_on_disk(&dir, &ledger, &format!("after {cycle} hit ENOSPC"));
        drop(outbox);
        filler.free();
        outbox = check_recovered(&dir, &clock, &mut ledger, cycle);
    }

    // Cycle 2: deliver queued items until the disk is full.
    let queued: Vec<String> = outbox
        .list_items()
        .expect("items")
        .iter()
        .filter(|i| i.state() == ItemState::Queued)
        .map(|i| i.idempotency_key().to_owned())
        .collect();
    let filler = Filler::fill(&mnt, 0);
    let mut process_error = None;
    for key in &queued {
        if let Err(e) = outbox.process(key, ledger.send()) {
            process_error = Some(e);
            break;
        }
    }
    if let Some(err) = &process_error {
        eprintln!("disk_full: process hit the full disk: {err}");
        assert_enospc("process", err);
    }
    let drained = outbox.process_due(ledger.send());
    if let Err(e) = &drained {
        eprintln!("disk_full: process_due on the full disk: {e}");
        if !matches!(e, Error::Poisoned) {
            assert_enospc("process_due", e);
        }
    }
    assert!(
        process_error.is_some() || drained.is_err(),
        "full-disk broken: {} deliveries all fit on a full tmpfs",
        queued.len()
    );
    check_what_is_on_disk(&dir, &ledger, "after delivery hit ENOSPC");
    drop(outbox);
    filler.free();
    let outbox = check_recovered(&dir, &clock, &mut ledger, "process-full");

    // Everything still queued goes out now, once each.
    outbox.process_due(ledger.send()).expect("final drain");
    let items = outbox.list_items().expect("items");
    assert!(
        items.iter().all(|i| i.state() != ItemState::Queued),
        "never-lost broken: items still queued after the final drain"
    );
    assert!(
        ledger.handed.values().all(|n| *n == 1),
        "at-most-once broken: {:?}",
        ledger
            .handed
            .iter()
            .filter(|(_, n)| **n > 1)
            .collect::<Vec<_>>()
    );
    drop(outbox);
    drop(tmpfs);
}
