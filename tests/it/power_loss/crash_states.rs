//! From an operation log to the states a power cut can leave on disk.
//!
//! The persistence model (what a POSIX filesystem promises, no more):
//! - a write or truncation of a file is durable once that file was fsynced
//!   after it; before that it may be lost, torn at 512-byte sector boundaries
//!   (any subset of its sectors on disk), or reach the disk as zeros (the size
//!   did, the data did not), independently of the file's other unsynced writes
//!   (so they may land out of order);
//! - a creation, unlink or rename is durable once its directory (both, for a
//!   rename) was fsynced after it; before that it may be lost. An `fsync` of a
//!   file does not make its name durable.
//!
//! A crash state is a cut (how many operations of the log happened) and a fate
//! for each operation that was not yet durable at the cut. The enumerator does
//! not walk the powerset (ALICE, OSDI '14): every cut gets the "nothing unsynced
//! survives" state, and a bounded, seeded sample of cuts gets the other shapes.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::OsString;
use std::hash::{Hash, Hasher};
use std::path::Path;

use super::recorder::{Op, ROOT};

/// Sector size for tears.
const SECTOR: u64 = 512;

/// What happens to one not-yet-durable operation in a crash state.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Fate {
    /// It reached the disk whole.
    Apply,
    /// It never reached the disk.
    Drop,
    /// Only these of its sectors (in order, `true` = on disk) reached the disk.
    Torn(Vec<bool>),
    /// The file grew to cover it, its data did not arrive: zeros.
    Zero,
}

/// How the unsynced operations of a state are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// Nothing unsynced survives: the state a disk cache lost whole.
    DurableOnly,
    /// Everything survives (what a process crash leaves).
    Everything,
    /// Unsynced operations reach the disk in order, up to a random point; the
    /// one at that point is torn.
    InOrderPrefix,
    /// Each unsynced operation independently applied, lost, torn or zeroed.
    Scrambled,
    /// Everything survives except each file's last unsynced write, torn with its
    /// first sectors missing: zeros, then the write's remnant.
    TornTails,
    /// Metadata (sizes, names) reached the disk, unsynced data did not.
    ZerosForData,
    /// All data arrived; in every directory the oldest unsynced name change
    /// did not, the later ones did (names reordered).
    LaterNamesOnly,
    /// Everything survives except each commit group's write (a journal write
    /// carrying several entries), torn with its first sectors lost up to one
    /// of its later entries, which is kept whole.
    GroupHeadLost,
    /// Everything survives except each file's last unsynced write, torn with
    /// its first and last sectors on disk (for a journal write: the line's
    /// start and its newline) and one or more sectors between them lost,
    /// sometimes several apart.
    MiddleLost,
}

impl Shape {
    /// Checked at every cut.
    pub const EVERY_CUT: [Shape; 3] = [Shape::DurableOnly, Shape::TornTails, Shape::LaterNamesOnly];
    /// Sampled over the cuts.
    pub const SAMPLED: [Shape; 6] = [
        Shape::InOrderPrefix,
        Shape::Scrambled,
        Shape::TornTails,
        Shape::ZerosForData,
        Shape::Everything,
        Shape::MiddleLost,
    ];
}

/// A small deterministic generator (xorshift64*), so a failing state replays
/// from its printed seed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
}

/// The log with what each operation needs to become durable.
pub struct Recording {
    pub ops: Vec<Op>,
    /// For each operation, the index of the first later fsync that makes it
    /// durable (`usize::MAX` if none does).
    durable_at: Vec<usize>,
    /// For each operation, what it touches, for the per-file tally.
    pub labels: Vec<&'static str>,
}

impl Recording {
    pub fn new(ops: Vec<Op>) -> Self {
        let durable_at = durability(&ops);
        let labels = label(&ops);
        Self {
            ops,
            durable_at,
            labels,
        }
    }

    /// Indices of the operations not yet durable after the first `cut` happened.
    pub fn pending(&self, cut: usize) -> Vec<usize> {
        (0..cut)
            .filter(|&i| !matches!(self.ops[i], Op::Mark(_)) && self.durable_at[i] >= cut)
            .collect()
    }

    /// The fates of the pending operations for one state.
    pub fn fates(&self, cut: usize, shape: Shape, rng: &mut Rng) -> BTreeMap<usize, Fate> {
        let pending = self.pending(cut);
        let mut fates = BTreeMap::new();
        match shape {
            Shape::DurableOnly => {
                for i in pending {
                    fates.insert(i, Fate::Drop);
                }
            }
            Shape::Everything | Shape::GroupHeadLost => {
                for i in pending {
                    let fate = if shape == Shape::GroupHeadLost && self.is_group_write(i) {
                        self.tear(i, rng, 3)
                    } else {
                        Fate::Apply
                    };
                    fates.insert(i, fate);
                }
            }
            Shape::InOrderPrefix => {
                let point = rng.below(pending.len() as u64 + 1) as usize;
                for (n, &i) in pending.iter().enumerate() {
                    let fate = match n.cmp(&point) {
                        std::cmp::Ordering::Less => Fate::Apply,
                        std::cmp::Ordering::Equal => {
                            let pattern = rng.below(3);
                            self.tear(i, rng, pattern)
                        }
                        std::cmp::Ordering::Greater => Fate::Drop,
                    };
                    fates.insert(i, fate);
                }
            }
            Shape::Scrambled => {
                for i in pending {
                    let fate = if matches!(self.ops[i], Op::Write { .. }) {
                        match rng.below(10) {
                            0..=3 => Fate::Apply,
                            4..=6 => Fate::Drop,
                            7 | 8 => {
                                let pattern = rng.below(3);
                                self.tear(i, rng, pattern)
                            }
                            _ => Fate::Zero,
                        }
                    } else if rng.below(2) == 0 {
                        Fate::Apply
                    } else {
                        Fate::Drop
                    };
                    fates.insert(i, fate);
                }
            }
            Shape::TornTails | Shape::MiddleLost => {
                let last_write = self.last_writes(&pending);
                // Middle tears keep every name; torn tails keep them or not.
                let keep_names = shape == Shape::MiddleLost || rng.below(2) == 0;
                for i in pending {
                    let fate = match self.ops[i] {
                        Op::Write { ino, .. } if last_write.get(&ino) == Some(&i) => {
                            if shape == Shape::MiddleLost {
                                self.tear_middle(i, rng)
                            } else {
                                self.tear(i, rng, 1)
                            }
                        }
                        Op::Write { .. } | Op::SetLen { .. } => Fate::Apply,
                        _ if keep_names => Fate::Apply,
                        _ => Fate::Drop,
                    };
                    fates.insert(i, fate);
                }
            }
            Shape::LaterNamesOnly => {
                let mut first_in_dir: HashSet<u64> = HashSet::new();
                for i in pending {
                    let dir = match &self.ops[i] {
                        Op::Create { dir, .. } | Op::Unlink { dir, .. } => Some(*dir),
                        Op::Rename { from_dir, .. } => Some(*from_dir),
                        _ => None,
                    };
                    let fate = match dir {
                        Some(dir) if first_in_dir.insert(dir) => Fate::Drop,
                        _ => Fate::Apply,
                    };
                    fates.insert(i, fate);
                }
            }
            Shape::ZerosForData => {
                for i in pending {
                    let fate = if matches!(self.ops[i], Op::Write { .. }) {
                        Fate::Zero
                    } else {
                        Fate::Apply
                    };
                    fates.insert(i, fate);
                }
            }
        }
        fates
    }

    /// A tear of write `i`: `pattern` 0 keeps its first sectors, 1 its last
    /// ones (zeros, then a remnant), 2 a random subset, 3 its last ones from
    /// a sector where one of its later lines starts (for a write of several
    /// lines; otherwise as 1).
    fn tear(&self, i: usize, rng: &mut Rng, pattern: u64) -> Fate {
        let Op::Write { offset, data, .. } = &self.ops[i] else {
            return if rng.below(2) == 0 {
                Fate::Apply
            } else {
                Fate::Drop
            };
        };
        let pieces = sector_pieces(*offset, data.len() as u64).len();
        if pieces < 2 {
            return Fate::Drop;
        }
        let mut split = 1 + rng.below(pieces as u64 - 1) as usize;
        // A commit group's write carries several entries: pattern 3 (and half
        // the time pattern 1) loses its first sectors up to one of its later
        // entries, which is kept whole.
        let starts = line_starts(data);
        if starts.len() >= 2 && (pattern == 3 || (pattern == 1 && rng.below(2) == 0)) {
            let line = starts[1 + rng.below(starts.len() as u64 - 1) as usize];
            let at = offset + line as u64;
            let first = offset / SECTOR;
            split = ((at / SECTOR - first) as usize).clamp(1, pieces - 1);
        }
        let sectors = match pattern {
            0 => (0..pieces).map(|p| p < split).collect(),
            1 | 3 => (0..pieces).map(|p| p >= split).collect(),
            _ => (0..pieces).map(|_| rng.below(2) == 0).collect(),
        };
        Fate::Torn(sectors)
    }

    /// The last of `pending`'s writes to each file, by inode.
    fn last_writes(&self, pending: &[usize]) -> HashMap<u64, usize> {
        let mut last_write = HashMap::new();
        for &i in pending {
            if let Op::Write { ino, .. } = self.ops[i] {
                last_write.insert(ino, i);
            }
        }
        last_write
    }

    /// A tear of write `i` that keeps its first and last sectors and loses
    /// some between them: half the time (when there are three or more
    /// between) every other one from the second sector on, so that the lost
    /// sectors are several runs apart; otherwise a random non-empty subset.
    /// A write of fewer than three sectors has no middle: it lands whole.
    fn tear_middle(&self, i: usize, rng: &mut Rng) -> Fate {
        let Op::Write { offset, data, .. } = &self.ops[i] else {
            return Fate::Apply;
        };
        let pieces = sector_pieces(*offset, data.len() as u64).len();
        if pieces < 3 {
            return Fate::Apply;
        }
        let middle = 1..pieces - 1;
        let mut sectors = vec![true; pieces];
        if middle.len() >= 3 && rng.below(2) == 0 {
            for p in middle.step_by(2) {
                sectors[p] = false;
            }
        } else {
            for p in middle.clone() {
                sectors[p] = rng.below(2) == 0;
            }
            if sectors.iter().all(|&on| on) {
                sectors[middle.start + rng.below(middle.len() as u64) as usize] = false;
            }
        }
        Fate::Torn(sectors)
    }

    /// Whether a journal write whose data ends with a newline is torn in this
    /// state with its first and last sectors on disk and a sector between
    /// them lost: a line whose start and newline landed, with zeros inside.
    /// The second value: the lost sectors form two or more separate runs.
    pub fn middle_lost(&self, fates: &BTreeMap<usize, Fate>) -> (bool, bool) {
        let mut found = (false, false);
        for (&i, fate) in fates {
            let (Fate::Torn(sectors), Op::Write { data, .. }) = (fate, &self.ops[i]) else {
                continue;
            };
            if self.labels[i] != "outbox.journal"
                || data.last() != Some(&b'\n')
                || sectors.first() != Some(&true)
                || sectors.last() != Some(&true)
                || sectors.iter().all(|&on| on)
            {
                continue;
            }
            let runs = sectors.windows(2).filter(|w| w[0] && !w[1]).count();
            found = (true, found.1 || runs >= 2);
        }
        found
    }

    /// The cuts at which the last unsynced write of the journal can be torn
    /// in its middle (it spans three sectors or more and ends a line).
    pub fn middle_cuts(&self) -> Vec<usize> {
        (1..=self.ops.len())
            .filter(|&cut| {
                let pending = self.pending(cut);
                let Some(&i) = pending
                    .iter()
                    .filter(|&&i| {
                        matches!(self.ops[i], Op::Write { .. })
                            && self.labels[i] == "outbox.journal"
                    })
                    .max()
                else {
                    return false;
                };
                let Op::Write { offset, data, .. } = &self.ops[i] else {
                    return false;
                };
                data.last() == Some(&b'\n') && sector_pieces(*offset, data.len() as u64).len() >= 3
            })
            .collect()
    }

    /// Whether operation `i` is a journal write that carries several whole
    /// entries (a commit group's write).
    pub fn is_group_write(&self, i: usize) -> bool {
        match &self.ops[i] {
            Op::Write { data, .. } => {
                self.labels[i] == "outbox.journal" && line_starts(data).len() >= 2
            }
            _ => false,
        }
    }

    /// Whether a commit group's write is torn in this state with its first
    /// sector lost and a later whole entry kept: zeros (or old bytes), then
    /// whole entries of the group that nobody was told were durable.
    pub fn group_head_lost(&self, fates: &BTreeMap<usize, Fate>) -> bool {
        fates.iter().any(|(&i, fate)| {
            let (Fate::Torn(sectors), Op::Write { offset, data, .. }) = (fate, &self.ops[i]) else {
                return false;
            };
            if !self.is_group_write(i) || sectors.first() != Some(&false) {
                return false;
            }
            let pieces = sector_pieces(*offset, data.len() as u64);
            let kept = |from: u64, to: u64| {
                pieces
                    .iter()
                    .zip(sectors)
                    .all(|(&(a, b), &on)| on || b <= from || a >= to)
            };
            let starts = line_starts(data);
            starts.windows(2).any(|w| {
                let (from, to) = (*offset + w[1] as u64, *offset + data.len() as u64);
                let end = data[w[1]..]
                    .iter()
                    .position(|&b| b == b'\n')
                    .map_or(to, |p| *offset + (w[1] + p + 1) as u64);
                kept(from, end)
            })
        })
    }

    /// The cuts at which a commit group's write is not yet durable.
    pub fn group_cuts(&self) -> Vec<usize> {
        (1..=self.ops.len())
            .filter(|&cut| {
                self.pending(cut)
                    .into_iter()
                    .any(|i| self.is_group_write(i))
            })
            .collect()
    }

    /// A key identifying the state: the markers before its cut and the
    /// operations that reached the disk (durable ones, and the pending ones
    /// with their fates; a lost operation leaves nothing), to check each
    /// distinct state once.
    pub fn state_key(&self, cut: usize, fates: &BTreeMap<usize, Fate>) -> u64 {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        let marks = self.ops[..cut]
            .iter()
            .filter(|op| matches!(op, Op::Mark(_)))
            .count();
        marks.hash(&mut hasher);
        for i in 0..cut {
            if matches!(
                self.ops[i],
                Op::Mark(_) | Op::Fsync { .. } | Op::FsyncDir { .. }
            ) {
                continue;
            }
            match fates.get(&i) {
                Some(Fate::Drop) => {}
                Some(fate) => (i, fate).hash(&mut hasher),
                None => (i, &Fate::Apply).hash(&mut hasher),
            }
        }
        hasher.finish()
    }

    /// Writes the state into `dir` (which must be empty).
    pub fn materialise(
        &self,
        cut: usize,
        fates: &BTreeMap<usize, Fate>,
        dir: &Path,
    ) -> std::io::Result<()> {
        let mut model = Model::default();
        model.nodes.insert(ROOT, MNode::Dir(BTreeMap::new()));
        for (i, op) in self.ops[..cut].iter().enumerate() {
            let fate = fates.get(&i).unwrap_or(&Fate::Apply);
            model.apply(op, fate);
        }
        model.write_out(ROOT, dir)
    }

    /// The labels of the operations pending at `cut`, each once.
    pub fn labels_at_risk(&self, cut: usize) -> HashSet<&'static str> {
        self.pending(cut)
            .into_iter()
            .map(|i| self.labels[i])
            .collect()
    }
}

/// Where each whole (newline-terminated) line of `data` starts.
fn line_starts(data: &[u8]) -> Vec<usize> {
    let mut starts = Vec::new();
    let mut start = 0;
    for (i, &b) in data.iter().enumerate() {
        if b == b'\n' {
            starts.push(start);
            start = i + 1;
        }
    }
    starts
}

/// The sector-aligned pieces `[start, end)` of a write at `offset` of `len` bytes.
fn sector_pieces(offset: u64, len: u64) -> Vec<(u64, u64)> {
    let mut pieces = Vec::new();
    let mut start = offset;
    let end = offset + len;
    while start < end {
        let next = ((start / SECTOR) + 1) * SECTOR;
        pieces.push((start, next.min(end)));
        start = next;
    }
    pieces
}

/// When each operation becomes durable: scanning backwards, the next fsync of
/// the file (data) or of the directory (names) after it.
fn durability(ops: &[Op]) -> Vec<usize> {
    let mut durable_at = vec![usize::MAX; ops.len()];
    let mut file_sync: HashMap<u64, usize> = HashMap::new();
    let mut dir_sync: HashMap<u64, usize> = HashMap::new();
    for (i, op) in ops.iter().enumerate().rev() {
        let dir = |d: &u64| dir_sync.get(d).copied().unwrap_or(usize::MAX);
        durable_at[i] = match op {
            Op::Write { ino, .. } | Op::SetLen { ino, .. } => {
                file_sync.get(ino).copied().unwrap_or(usize::MAX)
            }
            Op::Create { dir: d, .. } | Op::Unlink { dir: d, .. } => dir(d),
            Op::Rename {
                from_dir, to_dir, ..
            } => dir(from_dir).max(dir(to_dir)),
            Op::Fsync { .. } | Op::FsyncDir { .. } | Op::Mark(_) => 0,
        };
        match op {
            Op::Fsync { ino } => {
                file_sync.insert(*ino, i);
            }
            Op::FsyncDir { ino } => {
                dir_sync.insert(*ino, i);
            }
            _ => {}
        }
    }
    durable_at
}

/// What each operation touches, named by the file it ends up as (a temp file
/// renamed to `outbox.json` counts as the snapshot).
fn label(ops: &[Op]) -> Vec<&'static str> {
    let mut names: HashMap<u64, (u64, OsString)> = HashMap::new();
    let mut final_class: HashMap<u64, &'static str> = HashMap::new();
    let mut dirs: HashMap<u64, OsString> = HashMap::new();
    dirs.insert(ROOT, OsString::new());
    // First pass: where every inode ends up.
    let mut at: HashMap<(u64, OsString), u64> = HashMap::new();
    for op in ops {
        match op {
            Op::Create {
                dir,
                name,
                ino,
                is_dir,
            } => {
                names.insert(*ino, (*dir, name.clone()));
                at.insert((*dir, name.clone()), *ino);
                if *is_dir {
                    dirs.insert(*ino, name.clone());
                }
                final_class
                    .entry(*ino)
                    .or_insert_with(|| class(&dirs, *dir, name));
            }
            Op::Rename {
                from_dir,
                from,
                to_dir,
                to,
            } => {
                if let Some(ino) = at.remove(&(*from_dir, from.clone())) {
                    at.insert((*to_dir, to.clone()), ino);
                    let was = final_class.get(&ino).copied();
                    if was.is_none_or(|c| c == "temp files") {
                        final_class.insert(ino, class(&dirs, *to_dir, to));
                    }
                    names.insert(ino, (*to_dir, to.clone()));
                }
            }
            _ => {}
        }
    }
    let mut at: HashMap<(u64, OsString), u64> = HashMap::new();
    ops.iter()
        .map(|op| match op {
            Op::Write { ino, .. } | Op::SetLen { ino, .. } | Op::Fsync { ino } => {
                final_class.get(ino).copied().unwrap_or("other files")
            }
            Op::Create { dir, name, ino, .. } => {
                at.insert((*dir, name.clone()), *ino);
                entry_class(class(&dirs, *dir, name))
            }
            Op::Unlink { dir, name } => {
                let ino = at.remove(&(*dir, name.clone()));
                let what = ino
                    .and_then(|i| final_class.get(&i).copied())
                    .unwrap_or_else(|| class(&dirs, *dir, name));
                entry_class(what)
            }
            Op::Rename {
                from_dir,
                from,
                to_dir,
                to,
            } => {
                if let Some(ino) = at.remove(&(*from_dir, from.clone())) {
                    at.insert((*to_dir, to.clone()), ino);
                }
                let to_class = class(&dirs, *to_dir, to);
                if to_class == "sealed audit segments" {
                    "names: audit rotation (rename)"
                } else {
                    entry_class(to_class)
                }
            }
            Op::FsyncDir { .. } => "directory fsyncs",
            Op::Mark(_) => "markers",
        })
        .collect()
}

/// The kind of file a name in a directory is.
fn class(dirs: &HashMap<u64, OsString>, dir: u64, name: &OsString) -> &'static str {
    let name = name.to_string_lossy();
    let in_dir = dirs.get(&dir).map(|d| d.to_string_lossy().into_owned());
    match (in_dir.as_deref(), name.as_ref()) {
        (Some("history"), _) => "history/ segments",
        (Some("owners"), _) => "owners/",
        (_, "outbox.journal") => "outbox.journal",
        (_, "outbox.json") => "outbox.json (snapshot)",
        (_, "audit.jsonl") => "audit.jsonl",
        (_, n) if n.starts_with("audit-") && n.contains(".jsonl") => "sealed audit segments",
        (_, n) if n.starts_with(".outbox-tmp-") => "temp files",
        (_, n) if n.contains(".torn-") => "quarantine files",
        (_, "history" | "owners") => "directories",
        _ => "other files",
    }
}

/// The label of a change to a directory entry of a file of class `what`.
fn entry_class(what: &'static str) -> &'static str {
    match what {
        "history/ segments" => "names: history/ segments",
        "owners/" => "names: owners/",
        "outbox.journal" => "names: outbox.journal (rename)",
        "outbox.json (snapshot)" => "names: outbox.json (rename)",
        "audit.jsonl" => "names: audit.jsonl",
        "sealed audit segments" => "names: audit rotation (rename)",
        "temp files" => "names: temp files",
        "quarantine files" => "names: quarantine files",
        "directories" => "names: directories",
        _ => "names: other",
    }
}

#[derive(Debug)]
enum MNode {
    File(Vec<u8>),
    Dir(BTreeMap<OsString, u64>),
}

/// The replayed disk.
#[derive(Debug, Default)]
struct Model {
    nodes: HashMap<u64, MNode>,
}

impl Model {
    fn dir_mut(&mut self, ino: u64) -> Option<&mut BTreeMap<OsString, u64>> {
        match self.nodes.get_mut(&ino) {
            Some(MNode::Dir(entries)) => Some(entries),
            _ => None,
        }
    }

    fn file_mut(&mut self, ino: u64) -> Option<&mut Vec<u8>> {
        match self.nodes.get_mut(&ino) {
            Some(MNode::File(data)) => Some(data),
            _ => None,
        }
    }

    fn apply(&mut self, op: &Op, fate: &Fate) {
        match op {
            Op::Create {
                dir,
                name,
                ino,
                is_dir,
            } => {
                // The inode exists either way; only its name may be lost.
                let node = if *is_dir {
                    MNode::Dir(BTreeMap::new())
                } else {
                    MNode::File(Vec::new())
                };
                self.nodes.insert(*ino, node);
                if *fate == Fate::Apply
                    && let Some(entries) = self.dir_mut(*dir)
                {
                    entries.insert(name.clone(), *ino);
                }
            }
            Op::Unlink { dir, name } => {
                if *fate == Fate::Apply
                    && let Some(entries) = self.dir_mut(*dir)
                {
                    entries.remove(name);
                }
            }
            Op::Rename {
                from_dir,
                from,
                to_dir,
                to,
            } => {
                if *fate != Fate::Apply {
                    return;
                }
                let Some(ino) = self.dir_mut(*from_dir).and_then(|e| e.remove(from)) else {
                    return;
                };
                if let Some(entries) = self.dir_mut(*to_dir) {
                    entries.insert(to.clone(), ino);
                }
            }
            Op::SetLen { ino, len } => {
                if *fate == Fate::Apply
                    && let Some(data) = self.file_mut(*ino)
                {
                    data.resize(*len as usize, 0);
                }
            }
            Op::Write { ino, offset, data } => {
                let Some(file) = self.file_mut(*ino) else {
                    return;
                };
                let start = *offset as usize;
                match fate {
                    Fate::Apply => {
                        let end = start + data.len();
                        if file.len() < end {
                            file.resize(end, 0);
                        }
                        file[start..end].copy_from_slice(data);
                    }
                    Fate::Drop => {}
                    Fate::Zero => {
                        // Only the size arrived: the old bytes stay, new ones are zeros.
                        let end = start + data.len();
                        if file.len() < end {
                            file.resize(end, 0);
                        }
                    }
                    Fate::Torn(sectors) => {
                        let pieces = sector_pieces(*offset, data.len() as u64);
                        for ((from, to), on_disk) in pieces.into_iter().zip(sectors) {
                            if !on_disk {
                                continue;
                            }
                            let (from, to) = (from as usize, to as usize);
                            if file.len() < to {
                                file.resize(to, 0);
                            }
                            file[from..to].copy_from_slice(&data[from - start..to - start]);
                        }
                    }
                }
            }
            Op::Fsync { .. } | Op::FsyncDir { .. } | Op::Mark(_) => {}
        }
    }

    fn write_out(&self, dir_ino: u64, path: &Path) -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let Some(MNode::Dir(entries)) = self.nodes.get(&dir_ino) else {
            return Ok(());
        };
        for (name, ino) in entries {
            let target = path.join(name);
            match self.nodes.get(ino) {
                Some(MNode::Dir(_)) => {
                    std::fs::create_dir(&target)?;
                    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o700))?;
                    self.write_out(*ino, &target)?;
                }
                Some(MNode::File(data)) => {
                    std::fs::write(&target, data)?;
                    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600))?;
                }
                None => {}
            }
        }
        Ok(())
    }
}

/// The persistence model itself, on hand-written logs.
mod model {
    use std::collections::BTreeMap;
    use std::ffi::OsString;

    use super::{Fate, Recording, Rng, Shape};
    use crate::power_loss::recorder::{Op, ROOT};

    fn create(name: &str, ino: u64) -> Op {
        Op::Create {
            dir: ROOT,
            name: OsString::from(name),
            ino,
            is_dir: false,
        }
    }

    fn write(ino: u64, offset: u64, data: &[u8]) -> Op {
        Op::Write {
            ino,
            offset,
            data: data.to_vec(),
        }
    }

    fn state(
        recording: &Recording,
        cut: usize,
        fates: &BTreeMap<usize, Fate>,
    ) -> Vec<(String, Vec<u8>)> {
        let dir = tempfile::tempdir().unwrap();
        recording.materialise(cut, fates, dir.path()).unwrap();
        let mut files: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    e.file_name().to_string_lossy().into_owned(),
                    std::fs::read(e.path()).unwrap(),
                )
            })
            .collect();
        files.sort();
        files
    }

    #[test]
    fn only_what_an_fsync_covered_survives_a_cut_that_drops_everything_else() {
        let recording = Recording::new(vec![
            create("f", 2),
            Op::FsyncDir { ino: ROOT },
            write(2, 0, b"synced "),
            Op::Fsync { ino: 2 },
            write(2, 7, b"unsynced"),
            create("g", 3),
        ]);
        let cut = recording.ops.len();
        let fates = recording.fates(cut, Shape::DurableOnly, &mut Rng::new(1));
        assert_eq!(
            state(&recording, cut, &fates),
            [("f".into(), b"synced ".to_vec())]
        );
        let fates = recording.fates(cut, Shape::Everything, &mut Rng::new(1));
        assert_eq!(
            state(&recording, cut, &fates),
            [
                ("f".into(), b"synced unsynced".to_vec()),
                ("g".into(), Vec::new())
            ]
        );
    }

    #[test]
    fn a_rename_is_lost_until_its_directory_is_fsynced() {
        let mut ops = vec![
            create("tmp", 2),
            write(2, 0, b"new"),
            Op::Fsync { ino: 2 },
            Op::Rename {
                from_dir: ROOT,
                from: "tmp".into(),
                to_dir: ROOT,
                to: "file".into(),
            },
        ];
        let recording = Recording::new(ops.clone());
        let fates = recording.fates(4, Shape::DurableOnly, &mut Rng::new(1));
        assert!(
            state(&recording, 4, &fates).is_empty(),
            "neither name is durable"
        );
        ops.push(Op::FsyncDir { ino: ROOT });
        let recording = Recording::new(ops);
        let fates = recording.fates(5, Shape::DurableOnly, &mut Rng::new(1));
        assert_eq!(
            state(&recording, 5, &fates),
            [("file".into(), b"new".to_vec())]
        );
    }

    #[test]
    fn a_torn_tail_is_zeros_then_the_end_of_the_write() {
        let data: Vec<u8> = (0..1500u32).map(|i| b'a' + (i % 26) as u8).collect();
        let recording = Recording::new(vec![
            create("f", 2),
            Op::FsyncDir { ino: ROOT },
            write(2, 0, &data),
        ]);
        let fates = recording.fates(3, Shape::TornTails, &mut Rng::new(7));
        let files = state(&recording, 3, &fates);
        let torn = &files[0].1;
        assert_eq!(torn.len(), 1500);
        let split = torn.iter().position(|b| *b != 0).unwrap();
        assert!(split == 512 || split == 1024, "cut at a sector: {split}");
        assert_eq!(&torn[split..], &data[split..]);
    }

    #[test]
    fn a_middle_tear_keeps_the_first_and_last_sectors_and_loses_some_between() {
        // One 3000-byte line written at 100: sectors [100, 512), five whole
        // ones, then [3072, 3100) with the newline.
        let mut data = vec![b'x'; 2999];
        data.push(b'\n');
        let recording = Recording::new(vec![
            create("outbox.journal", 2),
            Op::FsyncDir { ino: ROOT },
            write(2, 100, &data),
        ]);
        assert_eq!(recording.middle_cuts(), [3]);
        let mut split = 0;
        for seed in 1..40 {
            let fates = recording.fates(3, Shape::MiddleLost, &mut Rng::new(seed));
            let (lost, apart) = recording.middle_lost(&fates);
            assert!(lost, "seed {seed}: {fates:?}");
            split += usize::from(apart);
            let files = state(&recording, 3, &fates);
            let torn = &files[0].1[100..];
            assert_eq!(torn.len(), data.len());
            assert_eq!(torn[..412], data[..412], "the first sector landed");
            assert_eq!(torn[2972..], data[2972..], "the last one, with the newline");
            assert!(torn.contains(&0), "seed {seed}: a sector between is lost");
            for sector in torn[412..2972].chunks(512) {
                assert!(
                    sector.iter().all(|b| *b == 0) || sector.iter().all(|b| *b == b'x'),
                    "whole sectors are lost or kept"
                );
            }
        }
        assert!(split > 0, "some tears lose sectors several runs apart");
    }

    #[test]
    fn a_group_write_loses_its_first_sectors_and_keeps_a_later_entry_whole() {
        // Three 400-byte lines in one journal write: a commit group's.
        let data: Vec<u8> = (0..3)
            .flat_map(|n| {
                let mut line = vec![b'a' + n; 399];
                line.push(b'\n');
                line
            })
            .collect();
        let recording = Recording::new(vec![
            create("outbox.journal", 2),
            Op::FsyncDir { ino: ROOT },
            write(2, 0, &data),
        ]);
        assert!(recording.is_group_write(2));
        assert_eq!(recording.group_cuts(), [3]);
        for seed in 1..20 {
            let fates = recording.fates(3, Shape::GroupHeadLost, &mut Rng::new(seed));
            assert!(recording.group_head_lost(&fates), "seed {seed}: {fates:?}");
            let files = state(&recording, 3, &fates);
            let torn = &files[0].1;
            assert_eq!(torn.len(), data.len());
            assert!(
                torn[..512].iter().all(|b| *b == 0),
                "the first sector is lost"
            );
            let kept_whole = [400, 800]
                .iter()
                .any(|&at| torn[at..at + 400] == data[at..at + 400]);
            assert!(kept_whole, "seed {seed}: a later entry is kept whole");
        }
    }
}
