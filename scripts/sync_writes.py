#!/usr/bin/env python3
"""Block writes per file sync of one bench run, and what made the extra ones.

    sudo python3 scripts/sync_writes.py -- target/release/examples/bench --n 1000 --destinations 50
    sudo python3 scripts/sync_writes.py -- /tmp/anchors/release/sqlite-outbox --n 1000 --destinations 50

Runs the command with `--dir DIR` appended (a fresh directory under
`$BENCH_DIR`, default /tmp) under a private tracefs instance that records, for
that process and its threads only:

- `ext4:ext4_sync_file_enter` / `_exit`: each `fsync`/`fdatasync`;
- `block:block_rq_issue`: every block request issued inside a sync, `M` in its
  flags marking a metadata write (on ext4 without a jbd2 journal: the synced
  file's inode-table block, written because one of its 16 inodes is dirty);
- `ext4:ext4_mark_inode_dirty`: which inode was dirtied, by this process,
  between one sync and the next.

Prints the command's last output line (the bench's JSON), then: syncs, write
requests and metadata writes per sync, the syncs grouped by the set of the
directory's files dirtied since the previous sync (`:M` = that sync wrote an
inode-table block, `:-` = it did not), and each file's inode number and
inode-table block (inode - 1) // 16: files in one block share its writes.
Dirtyings by kernel threads (writeback) are not attributed to the process and
show as syncs with an `M` after nothing.

Needs root and tracefs (/sys/kernel/tracing). Measurement only: the counts are
robust, the times are whatever the shared machine gives.
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

TRACEFS = "/sys/kernel/tracing"
EVENTS = [
    "block/block_rq_issue",
    "ext4/ext4_sync_file_enter",
    "ext4/ext4_sync_file_exit",
    "ext4/ext4_mark_inode_dirty",
]
INO = re.compile(r"ino (\d+)")
# block_rq_issue: 254,0 WSM 4096 () 326631440 + 8 ...
RQ = re.compile(r"block_rq_issue: \S+ (\S+) \d+ \(\S*\) (\d+) \+ (\d+)")


def put(instance, name, value):
    with open(os.path.join(instance, name), "w") as f:
        f.write(value)


def run_traced(instance, command):
    put(instance, "tracing_on", "0")
    put(instance, "trace", "")
    put(instance, "buffer_size_kb", "65536")
    put(instance, "options/event-fork", "1")
    for event in EVENTS:
        put(instance, f"events/{event}/enable", "1")
    # The shell puts its own pid in the filter, then becomes the command.
    wrapped = ["sh", "-c", f'echo $$ > {instance}/set_event_pid; exec "$@"', "sh"] + command
    put(instance, "tracing_on", "1")
    try:
        out = subprocess.run(wrapped, capture_output=True, text=True)
    finally:
        put(instance, "tracing_on", "0")
    with open(os.path.join(instance, "trace")) as f:
        lines = f.readlines()
    if out.returncode != 0:
        sys.exit(f"the command failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout, lines


def summarise(lines, names):
    syncs = writes = meta = 0
    in_sync = False
    dirtied = set()
    at_sync = frozenset()
    wrote_meta = False
    groups = collections.Counter()
    for line in lines:
        if line.startswith("#"):
            continue
        if "ext4_mark_inode_dirty:" in line:
            m = INO.search(line)
            if m:
                dirtied.add(names.get(m.group(1), "other"))
        elif "ext4_sync_file_enter:" in line:
            syncs += 1
            in_sync, wrote_meta = True, False
            at_sync, dirtied = frozenset(dirtied), set()
        elif "block_rq_issue:" in line and in_sync:
            m = RQ.search(line)
            if m and "W" in m.group(1) and int(m.group(3)) > 0:
                writes += 1
                if "M" in m.group(1):
                    meta += 1
                    wrote_meta = True
        elif "ext4_sync_file_exit:" in line and in_sync:
            in_sync = False
            key = "+".join(sorted(at_sync)) or "nothing"
            groups[key + (":M" if wrote_meta else ":-")] += 1
    return syncs, writes, meta, groups


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS (gets --dir DIR)")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command after --")
    if not os.path.isdir(os.path.join(TRACEFS, "instances")):
        sys.exit(f"needs root and tracefs at {TRACEFS}")
    instance = os.path.join(TRACEFS, "instances", f"sync_writes-{os.getpid()}")
    os.mkdir(instance)
    work = tempfile.mkdtemp(prefix="sync-writes-", dir=os.environ.get("BENCH_DIR", "/tmp"))
    target = os.path.join(work, "dir")
    try:
        stdout, lines = run_traced(instance, command + ["--dir", target])
        inodes = {str(os.stat(os.path.join(target, n)).st_ino): n for n in os.listdir(target)}
    finally:
        for event in EVENTS:
            put(instance, f"events/{event}/enable", "0")
        put(instance, "set_event_pid", "")
        os.rmdir(instance)
        shutil.rmtree(work, ignore_errors=True)
    syncs, writes, meta, groups = summarise(lines, inodes)
    last = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    print(last)
    per = lambda n: f"{n / syncs:.3f}" if syncs else "-"
    print(f"syncs {syncs}, write requests per sync {per(writes)}, "
          f"inode-table (metadata) writes per sync {per(meta)}")
    print("| dirtied since the previous sync | inode block written | syncs |")
    print("|---|---|---:|")
    for key, count in groups.most_common():
        files, wrote = key.rsplit(":", 1)
        print(f"| {files} | {'yes' if wrote == 'M' else 'no'} | {count} |")
    print("| file | inode | inode-table block |")
    print("|---|---:|---:|")
    for ino, name in sorted(inodes.items(), key=lambda kv: int(kv[0])):
        print(f"| {name} | {ino} | {(int(ino) - 1) // 16} |")


if __name__ == "__main__":
    main()
