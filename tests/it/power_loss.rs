//! Power loss: every state a power cut can leave opens, recovers, and loses
//! nothing that was acknowledged.
//!
//! The workload (`outbox-test-worker powerloss`, a real process) runs against a
//! recording FUSE filesystem mounted by this test ([`recorder`]), which logs
//! every write, truncation, creation, unlink, rename, fsync and directory fsync
//! the kernel delivers, with the workload's acknowledgements in between. The
//! enumerator ([`crash_states`]) replays that log into the states a power cut
//! at each point can leave (unsynced writes lost, torn at sector boundaries,
//! zero-filled, landed out of order; names not yet made durable by a directory
//! fsync missing; a commit group's write, which carries several transactions'
//! entries because the workload's last phase commits from six threads, with
//! its first sectors lost and a later entry kept; the journal's last unsynced
//! write with its first and last sectors kept and some between lost), writes
//! each into a plain directory, and checks it:
//!
//! - it opens (a typed error is a failure: a power cut never damages anything
//!   before a durable point);
//! - every enqueue acknowledged before the cut is there (checked before the
//!   first compaction, which may prune history by the stored retention policy,
//!   and again after it for everything that was not in history);
//! - an item is `Sent` only if its send ran before the cut;
//! - `verify_audit` passes;
//! - a second open sees exactly what the first saw;
//! - after one more (short) commit, it opens again with nothing lost;
//! - a drain then sends nothing whose send already ran.
//!
//! Because it sees the real syscalls, deleting the journal's `fdatasync` or the
//! directory fsync after a rename makes it report an acknowledged enqueue lost;
//! refusing whole entries past a zeroed region (the journal's check before
//! `is_unsynced_tail`) makes it report states that do not open, and so does
//! reading a line with zeros before its newline as whole (`next_line`).
//!
//! Knobs: `OUTBOX_POWERLOSS_STATES` (distinct states to check; default
//! [`DEFAULT_STATES`]), `OUTBOX_POWERLOSS_SEED` (replay a sample). Needs
//! `/dev/fuse` and the right to mount (root, or `fusermount3` from Debian's
//! `fuse3`); without them it fails when `CI` is set and skips otherwise.
//!
//! File-only by design: what a power cut leaves of the files.

mod crash_states;
pub(crate) mod recorder;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use durable_outbox::{ItemState, Outbox, OutboxItem};

use crash_states::{Fate, Recording, Rng, Shape};
use recorder::Op;

const WORKER: &str = env!("CARGO_BIN_EXE_outbox-test-worker");

/// The key of the enqueue each crash state gets after its recovery.
const PROBE: &str = "p";

/// Distinct crash states checked by default (about a minute on a busy 2-core
/// machine in a debug build).
const DEFAULT_STATES: usize = 800;

/// The worker must finish its workload within this (it takes about a second).
const WORKLOAD_WATCHDOG: Duration = Duration::from_secs(300);

/// Each of these must have been at risk (unsynced at the cut) in at least this
/// many checked states, or the campaign did not cover what it claims.
const MUST_COVER: &[&str] = &[
    "outbox.journal",
    "names: outbox.journal (rename)",
    "outbox.json (snapshot)",
    "names: outbox.json (rename)",
    "audit.jsonl",
    "names: audit rotation (rename)",
    "history/ segments",
    "names: history/ segments",
    "names: temp files",
];
const MIN_PER_FILE: usize = 3;

/// Tears (each keeping a random later entry) of the unsynced commit-group
/// writes planned at each cut where there is one.
const GROUP_TEARS: usize = 4;

/// Tears in the middle of the journal's last unsynced write (first and last
/// sectors kept) planned at each cut where it spans three sectors or more.
const MIDDLE_TEARS: usize = 3;
/// Checked states in which a journal write was torn with its first and last
/// sectors (the line's start and its newline) on disk and one between them
/// lost, at least; and of those, states whose lost sectors were several runs
/// apart.
const MIN_MIDDLE_LOST: usize = 20;
const MIN_MIDDLE_LOST_APART: usize = 3;

/// Recorded journal writes that carried several entries (commit groups of the
/// workload's threaded phase), at least.
const MIN_GROUP_WRITES: usize = 2;
/// Checked states in which such a write was torn with its first sector lost
/// and a later whole entry kept, at least.
const MIN_GROUP_HEAD_LOST: usize = 6;

/// The settings the workload runs with (`power_loss_builder` in the worker).
/// Its history retention (two segments) is stored in the outbox and applies
/// to recovery too: pruning deletes acknowledged items on purpose, so the
/// workload's prunes are covered by its `mayprune-` markers, and each state is
/// first checked before any compaction could prune (see [`check_state`]).
fn builder(dir: &Path) -> durable_outbox::OutboxBuilder {
    Outbox::builder(dir)
        .rate_limit(u32::MAX, Duration::from_millis(1))
        .max_inline_wait(Duration::ZERO)
        .history_after(Duration::ZERO)
        .audit_rotate_bytes(2048)
}

/// Runs the workload on a recording mount and returns its operation log.
fn record_workload() -> Option<Vec<Op>> {
    let ((status, out, err), log) = recorder::record("outbox-powerloss", |mount| {
        let mut child = Command::new(WORKER)
            .arg("powerloss")
            .arg(mount)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let started = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if started.elapsed() > WORKLOAD_WATCHDOG {
                let _ = child.kill();
                let _ = child.wait();
                // Unwinding takes the mount down.
                panic!(
                    "watchdog: the power-loss workload did not finish in {WORKLOAD_WATCHDOG:?} \
                     (a hang on the recording filesystem)"
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let (mut out, mut err) = (String::new(), String::new());
        child
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut out)
            .unwrap();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        (status, out, err)
    })?;
    assert!(
        status.success() && out.contains("done"),
        "the workload failed on the recording filesystem: {status}\n{out}\n{err}"
    );
    Some(log)
}

/// What the workload had been told by the cut.
#[derive(Default)]
struct Oracle {
    acked: Vec<String>,
    sends: HashSet<String>,
    /// Keys whose history segment a compaction in progress may have pruned.
    may_be_pruned: HashSet<String>,
}

impl Oracle {
    fn at(ops: &[Op]) -> Self {
        let mut oracle = Self::default();
        for op in ops {
            let Op::Mark(mark) = op else { continue };
            if let Some(key) = mark.strip_prefix("ack-") {
                oracle.acked.push(key.to_owned());
            } else if let Some(key) = mark.strip_prefix("send-") {
                oracle.sends.insert(key.to_owned());
            } else if let Some(key) = mark.strip_prefix("mayprune-") {
                oracle.may_be_pruned.insert(key.to_owned());
            } else if let Some(key) = mark.strip_prefix("kept-") {
                oracle.may_be_pruned.remove(key);
            }
        }
        oracle
    }
}

/// What an open handle shows: the live items, the history, the audit head.
#[derive(PartialEq)]
struct Picture {
    items: Vec<OutboxItem>,
    history: Vec<OutboxItem>,
    audit_head: (u64, String),
}

fn picture(outbox: &Outbox) -> Result<Picture, String> {
    let items = outbox
        .list_items()
        .map_err(|e| format!("list_items: {e}"))?;
    let history = outbox
        .history_items()
        .map_err(|e| format!("history_items: {e}"))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("history_items: {e}"))?;
    let head = outbox
        .audit_head()
        .map_err(|e| format!("audit_head: {e}"))?;
    Ok(Picture {
        items,
        history,
        audit_head: (head.seq, head.hash),
    })
}

/// Opens one crash state and checks every invariant.
fn check_state(dir: &Path, oracle: &Oracle) -> Result<(), String> {
    // First, what the cut left, before any compaction: the retention policy
    // stored in the outbox may prune history on the next one, on purpose.
    let before = builder(dir)
        .compact_on_open(false)
        .open()
        .map_err(|e| format!("it does not open: {e}"))?;
    for key in &oracle.acked {
        let found = before.get(key).map_err(|e| format!("get {key}: {e}"))?;
        if found.is_none() && !oracle.may_be_pruned.contains(key) {
            return Err(format!("acknowledged enqueue {key:?} lost"));
        }
    }
    let left = picture(&before)?;
    for item in left.items.iter().chain(&left.history) {
        let key = item.idempotency_key();
        if item.state() == ItemState::Sent && !oracle.sends.contains(key) {
            return Err(format!("{key:?} is Sent but its send never ran"));
        }
    }
    drop(before);
    let prunable: HashSet<&str> = left
        .history
        .iter()
        .map(OutboxItem::idempotency_key)
        .chain(oracle.may_be_pruned.iter().map(String::as_str))
        .collect();
    // Then recovery as a bot gets it: open (and compact).
    let first = builder(dir)
        .open()
        .map_err(|e| format!("it does not open with a compaction: {e}"))?;
    for key in &oracle.acked {
        let found = first.get(key).map_err(|e| format!("get {key}: {e}"))?;
        if found.is_none() && !prunable.contains(key.as_str()) {
            return Err(format!("acknowledged enqueue {key:?} lost by recovery"));
        }
    }
    let seen = picture(&first)?;
    for item in seen.items.iter().chain(&seen.history) {
        let key = item.idempotency_key();
        if item.state() == ItemState::Sent && !oracle.sends.contains(key) {
            return Err(format!("{key:?} is Sent but its send never ran"));
        }
    }
    first
        .verify_audit()
        .map_err(|e| format!("verify_audit: {e}"))?;
    let seen = picture(&first)?;
    drop(first);
    let second = builder(dir)
        .open()
        .map_err(|e| format!("the second open fails: {e}"))?;
    if picture(&second)? != seen {
        return Err("a second open sees something else than the first".into());
    }
    // The smallest commit there is: whatever recovery left past the journal's
    // end must not turn into damage when a short entry is written over part of it.
    second
        .enqueue(durable_outbox::NewMessage {
            idempotency_key: PROBE.into(),
            connector: "c".into(),
            grant_id: "g".into(),
            destination: "d".into(),
            content: "p".into(),
            ..Default::default()
        })
        .map_err(|e| format!("an enqueue after recovery: {e}"))?;
    drop(second);
    let third = builder(dir)
        .open()
        .map_err(|e| format!("it does not open after a commit that followed recovery: {e}"))?;
    for key in oracle.acked.iter().map(String::as_str).chain([PROBE]) {
        let found = third.get(key).map_err(|e| format!("get {key}: {e}"))?;
        if found.is_none() && !prunable.contains(key) {
            return Err(format!("acknowledged enqueue {key:?} lost after recovery"));
        }
    }
    let mut drained = Vec::new();
    third
        .process_due(|item| {
            drained.push(item.idempotency_key().to_owned());
            Ok(Some("again".into()))
        })
        .map_err(|e| format!("drain: {e}"))?;
    if let Some(key) = drained.iter().find(|k| oracle.sends.contains(*k)) {
        return Err(format!("{key:?} was sent again by a drain after the cut"));
    }
    third
        .verify_audit()
        .map_err(|e| format!("verify_audit after the drain: {e}"))?;
    Ok(())
}

/// Where crash states are written: memory when there is a tmpfs for it.
fn scratch() -> tempfile::TempDir {
    let shm = Path::new("/dev/shm");
    if shm.is_dir()
        && let Ok(dir) = tempfile::Builder::new()
            .prefix("outbox-powerloss-")
            .tempdir_in(shm)
    {
        return dir;
    }
    tempfile::tempdir().unwrap()
}

fn describe(op: Option<&Op>) -> String {
    match op {
        Some(Op::Write { ino, offset, data }) => {
            format!("write of {} bytes at {offset} to inode {ino}", data.len())
        }
        Some(other) => format!("{other:?}"),
        None => "the end of the log".into(),
    }
}

struct Campaign {
    checked: usize,
    by_shape: BTreeMap<&'static str, usize>,
    at_risk: BTreeMap<&'static str, usize>,
    /// States with a commit group's write torn, first sector lost, a later
    /// whole entry kept.
    group_head_lost: usize,
    /// States with a journal write torn in its middle, its first and last
    /// sectors kept; and those with the lost sectors several runs apart.
    middle_lost: usize,
    middle_lost_apart: usize,
    failures: Vec<String>,
}

fn shape_name(shape: Shape) -> &'static str {
    match shape {
        Shape::DurableOnly => "durable only",
        Shape::Everything => "everything kept",
        Shape::InOrderPrefix => "in-order prefix, torn",
        Shape::Scrambled => "scrambled",
        Shape::TornTails => "torn tails",
        Shape::ZerosForData => "zeros for data",
        Shape::LaterNamesOnly => "later names only",
        Shape::GroupHeadLost => "group write, head lost",
        Shape::MiddleLost => "middle sectors lost",
    }
}

/// Checks up to `budget` distinct states: first, at every cut where a commit
/// group's write is unsynced, [`GROUP_TEARS`] tears of it with its head lost;
/// then, at every cut where the journal's last unsynced write spans three
/// sectors or more, [`MIDDLE_TEARS`] tears of it with sectors between its
/// first and last lost; then the durable-only, torn-tails and reordered-names states at every cut;
/// then sampled cuts and shapes.
fn run_campaign(recording: &Recording, budget: usize, seed: u64) -> Campaign {
    let n = recording.ops.len();
    let mut rng = Rng::new(seed);
    let mut distinct = HashSet::new();
    let mut campaign = Campaign {
        checked: 0,
        by_shape: BTreeMap::new(),
        at_risk: BTreeMap::new(),
        group_head_lost: 0,
        middle_lost: 0,
        middle_lost_apart: 0,
        failures: Vec::new(),
    };
    let scratch = scratch();
    let mut plan: Vec<(usize, Shape)> = recording
        .group_cuts()
        .into_iter()
        .flat_map(|cut| std::iter::repeat_n((cut, Shape::GroupHeadLost), GROUP_TEARS))
        .chain(
            recording
                .middle_cuts()
                .into_iter()
                .flat_map(|cut| std::iter::repeat_n((cut, Shape::MiddleLost), MIDDLE_TEARS)),
        )
        .chain(
            Shape::EVERY_CUT
                .iter()
                .flat_map(|&shape| (0..=n).map(move |cut| (cut, shape))),
        )
        .collect();
    plan.reverse();
    // Sampling is stratified by what is at risk, so files that are unsynced
    // only briefly (a rename just before its directory fsync) get their share.
    let mut cuts_by_label: BTreeMap<&'static str, Vec<usize>> = BTreeMap::new();
    for cut in 1..=n {
        for label in recording.labels_at_risk(cut) {
            cuts_by_label.entry(label).or_default().push(cut);
        }
    }
    let strata: Vec<&Vec<usize>> = cuts_by_label.values().collect();
    let mut attempts = 0;
    while campaign.checked < budget && campaign.failures.len() < 10 && attempts < budget * 20 {
        attempts += 1;
        let (cut, shape) = plan.pop().unwrap_or_else(|| {
            let cuts = strata[rng.below(strata.len() as u64) as usize];
            let cut = cuts[rng.below(cuts.len() as u64) as usize];
            let shape = Shape::SAMPLED[rng.below(Shape::SAMPLED.len() as u64) as usize];
            (cut, shape)
        });
        let fates: BTreeMap<usize, Fate> = recording.fates(cut, shape, &mut rng);
        if !distinct.insert(recording.state_key(cut, &fates)) {
            continue;
        }
        let dir = scratch.path().join(format!("state-{}", campaign.checked));
        std::fs::create_dir(&dir).unwrap();
        recording.materialise(cut, &fates, &dir).unwrap();
        let oracle = Oracle::at(&recording.ops[..cut]);
        let checked = crate::harness::within(
            "recovery from a power cut finishes (no deadlock)",
            crate::harness::DEADLOCK_LIMIT,
            || check_state(&dir, &oracle),
        );
        if let Err(why) = checked {
            let mut risk: Vec<_> = recording.labels_at_risk(cut).into_iter().collect();
            risk.sort_unstable();
            campaign.failures.push(format!(
                "cut after op {cut} of {n} (next: {}), shape {:?}, seed {seed}: {why}\n    \
                 unsynced at the cut: {risk:?}",
                describe(recording.ops.get(cut)),
                shape,
            ));
        }
        std::fs::remove_dir_all(&dir).unwrap();
        campaign.checked += 1;
        if recording.group_head_lost(&fates) {
            campaign.group_head_lost += 1;
        }
        let (middle_lost, apart) = recording.middle_lost(&fates);
        campaign.middle_lost += usize::from(middle_lost);
        campaign.middle_lost_apart += usize::from(apart);
        *campaign.by_shape.entry(shape_name(shape)).or_default() += 1;
        for label in recording.labels_at_risk(cut) {
            *campaign.at_risk.entry(label).or_default() += 1;
        }
    }
    campaign
}

fn env_number(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| {
        v.parse()
            .unwrap_or_else(|_| panic!("{name} must be a number, not {v:?}"))
    })
}

#[test]
fn every_state_a_power_cut_can_leave_opens_and_loses_nothing_acknowledged() {
    let Some(ops) = record_workload() else {
        return;
    };
    let budget = env_number("OUTBOX_POWERLOSS_STATES").map_or(DEFAULT_STATES, |n| n as usize);
    let seed = env_number("OUTBOX_POWERLOSS_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    if std::env::var_os("OUTBOX_POWERLOSS_DUMP").is_some() {
        for (i, op) in ops.iter().enumerate() {
            eprintln!("{i:5} {}", describe(Some(op)));
        }
    }
    let recording = Recording::new(ops);
    let mut kinds: HashMap<&str, usize> = HashMap::new();
    for op in &recording.ops {
        let kind = match op {
            Op::Create { .. } => "create",
            Op::Unlink { .. } => "unlink",
            Op::Rename { .. } => "rename",
            Op::Write { .. } => "write",
            Op::SetLen { .. } => "truncate",
            Op::Fsync { .. } => "fsync",
            Op::FsyncDir { .. } => "directory fsync",
            Op::Mark(_) => "marker",
        };
        *kinds.entry(kind).or_default() += 1;
    }
    let started = Instant::now();
    let campaign = run_campaign(&recording, budget, seed);
    let mut kinds: Vec<_> = kinds.into_iter().collect();
    kinds.sort_unstable();
    eprintln!(
        "power loss: {} operations recorded {kinds:?}; {} distinct crash states checked in {:.1?} \
         (seed {seed}; OUTBOX_POWERLOSS_STATES={budget})",
        recording.ops.len(),
        campaign.checked,
        started.elapsed()
    );
    eprintln!("  states by shape: {:?}", campaign.by_shape);
    let group_writes = (0..recording.ops.len())
        .filter(|&i| recording.is_group_write(i))
        .count();
    eprintln!(
        "  journal writes carrying >= 2 entries (commit groups): {group_writes}; states with one \
         torn, its first sector lost and a later whole entry kept: {}",
        campaign.group_head_lost
    );
    eprintln!(
        "  states with a journal write torn in its middle (first and last sectors kept, one or \
         more between lost): {}; of them with the lost sectors several runs apart: {}",
        campaign.middle_lost, campaign.middle_lost_apart
    );
    eprintln!("  states in which each file had unsynced changes at the cut:");
    for (label, count) in &campaign.at_risk {
        eprintln!("    {label:<34} {count}");
    }
    assert!(
        campaign.failures.is_empty(),
        "{} crash state(s) broke an invariant:\n  {}",
        campaign.failures.len(),
        campaign.failures.join("\n  ")
    );
    let floor = budget.min(300);
    assert!(
        campaign.checked >= floor,
        "only {} crash states were checked (at least {floor} expected)",
        campaign.checked
    );
    assert!(
        group_writes >= MIN_GROUP_WRITES,
        "only {group_writes} recorded journal writes carried several entries (at least \
         {MIN_GROUP_WRITES} expected): the threaded phase formed no commit groups"
    );
    assert!(
        campaign.group_head_lost >= MIN_GROUP_HEAD_LOST,
        "only {} checked states tore a commit group's write with its first sector lost and a \
         later whole entry kept (at least {MIN_GROUP_HEAD_LOST} expected)",
        campaign.group_head_lost
    );
    assert!(
        campaign.middle_lost >= MIN_MIDDLE_LOST.min(budget / 10),
        "only {} checked states tore a journal write in its middle with its first and last \
         sectors kept (at least {MIN_MIDDLE_LOST} expected)",
        campaign.middle_lost
    );
    assert!(
        campaign.middle_lost_apart >= MIN_MIDDLE_LOST_APART.min(budget / 100),
        "only {} checked states lost sectors of a journal write several runs apart (at least \
         {MIN_MIDDLE_LOST_APART} expected)",
        campaign.middle_lost_apart
    );
    for label in MUST_COVER {
        let count = campaign.at_risk.get(label).copied().unwrap_or(0);
        assert!(
            count >= MIN_PER_FILE,
            "{label}: at risk in only {count} checked states (at least {MIN_PER_FILE} expected)"
        );
    }
}
