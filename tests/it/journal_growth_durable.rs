//! A journal growth is durable before an entry is written into it: no entry
//! byte lands past the journal's length as of its last `fsync`.
//!
//! The journal is preallocated with zeros and entries overwrite them in
//! place; when it is full it grows by writing zeros past its end. Until those
//! zeros and the new length are synced, a power cut may keep the length
//! without the zeros, and a filesystem may then show old disk contents there
//! (ext4 mounted `data=writeback`): garbage after the entries, which opening
//! reads as damage. So the growth is synced first.
//!
//! The recording FUSE filesystem of the power-loss campaign
//! (`power_loss::recorder`) logs every write and `fsync` the kernel delivers,
//! in order; the workload (enqueues of large messages, so the journal grows
//! within a few entries) runs in this process on a mount of it, and the log
//! is checked: each write to the file named `outbox.journal` at that moment
//! may put non-zero bytes only below that file's length at its last `fsync`
//! (writes to a temp file before its rename are not at risk: it is synced
//! before its name exists). Before the fix, the entry that needed the growth
//! was written past the synced length, with the zeros, and synced with them.
//!
//! Needs `/dev/fuse` and the right to mount; without them it fails when `CI`
//! is set and skips otherwise. File-only by design.

use std::collections::HashMap;
use std::ffi::OsString;
use std::time::Duration;

use durable_outbox::{NewMessage, Outbox};

use crate::power_loss::recorder::{self, Op, ROOT};

const JOURNAL: &str = "outbox.journal";

/// Content of each message: large, so a few entries fill the 1 MiB the
/// journal starts with.
const CONTENT: usize = 200 * 1024;

/// Enqueues: enough to grow the journal once (8 x 200 KiB > 1 MiB).
const ENQUEUES: usize = 8;

/// What the checker found in a log.
#[derive(Default, Debug)]
struct Growths {
    /// Times the journal's length grew past its synced length by a write.
    grown: usize,
    /// Writes that put non-zero bytes into the journal past its synced
    /// length: (op index, offset, the synced length then).
    unsynced_entries: Vec<(usize, u64, u64)>,
}

/// Walks the log, tracking the names in the outbox directory (the mount's
/// root), each file's length and its length at its last `fsync`.
fn check(ops: &[Op]) -> Growths {
    let mut names: HashMap<OsString, u64> = HashMap::new();
    let mut len: HashMap<u64, u64> = HashMap::new();
    let mut synced: HashMap<u64, u64> = HashMap::new();
    let mut found = Growths::default();
    for (i, op) in ops.iter().enumerate() {
        match op {
            Op::Create { dir, name, ino, .. } if *dir == ROOT => {
                names.insert(name.clone(), *ino);
            }
            Op::Unlink { dir, name } if *dir == ROOT => {
                names.remove(name);
            }
            Op::Rename {
                from_dir,
                from,
                to_dir,
                to,
            } if *from_dir == ROOT && *to_dir == ROOT => {
                if let Some(ino) = names.remove(from) {
                    names.insert(to.clone(), ino);
                }
            }
            Op::Write { ino, offset, data } => {
                let is_journal = names.get(&OsString::from(JOURNAL)) == Some(ino);
                let end = offset + data.len() as u64;
                let durable = synced.get(ino).copied().unwrap_or(0);
                if is_journal {
                    let past = durable.saturating_sub(*offset) as usize;
                    if data.len() > past && data[past..].iter().any(|b| *b != 0) {
                        found.unsynced_entries.push((i, *offset, durable));
                    }
                    let was = len.get(ino).copied().unwrap_or(0);
                    if end > was && was == durable {
                        found.grown += 1;
                    }
                }
                let now = len.entry(*ino).or_insert(0);
                *now = (*now).max(end);
            }
            Op::SetLen { ino, len: to } => {
                len.insert(*ino, *to);
            }
            Op::Fsync { ino } => {
                synced.insert(*ino, len.get(ino).copied().unwrap_or(0));
            }
            _ => {}
        }
    }
    found
}

#[test]
fn a_journal_growth_is_synced_before_an_entry_is_written_into_it() {
    let Some(((), ops)) = recorder::record("outbox-growth", |dir| {
        crate::harness::within(
            "a journal growth is synced before an entry is written into it (the workload finishes)",
            crate::harness::DEADLOCK_LIMIT,
            || {
                let outbox = Outbox::builder(dir)
                    .rate_limit(u32::MAX, Duration::from_millis(1))
                    .open()
                    .unwrap();
                for n in 0..ENQUEUES {
                    outbox
                        .enqueue(NewMessage {
                            idempotency_key: format!("k{n}"),
                            connector: "c".into(),
                            grant_id: "g".into(),
                            destination: "d".into(),
                            content: "x".repeat(CONTENT),
                            ..Default::default()
                        })
                        .unwrap();
                }
            },
        );
    }) else {
        return;
    };
    let found = check(&ops);
    assert!(
        found.grown >= 1,
        "the workload never grew the journal ({} ops recorded): the test checks nothing",
        ops.len()
    );
    assert!(
        found.unsynced_entries.is_empty(),
        "entries were written into a journal growth that was not synced yet (a power cut could \
         leave old disk contents there, read as damage): (op, offset, synced length) = {:?}",
        found.unsynced_entries
    );
}
