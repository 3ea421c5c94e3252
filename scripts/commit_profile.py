#!/usr/bin/env python3
"""Where a W2 transaction spends its time: the commit path's counters as a table.

    python3 scripts/commit_profile.py [--threads 8] [--n 2000] [--repeats 1] [--bench PATH]

Builds the bench with the diagnostics-only `commit-profile` feature (unless
--bench names a build that has it), runs W2 with DURABLE_OUTBOX_COMMIT_PROFILE
set, and prints, per run: items/s, transactions per fdatasync (histogram and
mean), and each span's count and mean (µs): waiting for the lock, holding it
(freshness check, rules, journal append, the append split into encoding the
entry, buffering it and applying it to memory), a follower's and a leader's
wait for durability, the leader's lock holds around the sync, its one write of
the group's entries, the sync itself, and each hold of the `flock`. The spans are defined in `src/profile.rs`.
"""
import argparse
import json
import os
import shutil
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "target", "release", "examples", "bench")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--destinations", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--bench")
    args = ap.parse_args()
    bench = args.bench
    if bench is None:
        subprocess.run(["cargo", "build", "-q", "--release", "--example", "bench",
                        "--features", "tokio,commit-profile"], cwd=ROOT, check=True)
        bench = BENCH
    print(f"load average: {' '.join(open('/proc/loadavg').read().split()[:3])}")
    for _ in range(args.repeats):
        work = tempfile.mkdtemp(prefix="profile-", dir=os.environ.get("BENCH_DIR", "/tmp"))
        try:
            done = subprocess.run(
                [bench, "--workload", "w2", "--threads", str(args.threads), "--n", str(args.n),
                 "--destinations", str(args.destinations), "--dir", os.path.join(work, "dir")],
                env=dict(os.environ, DURABLE_OUTBOX_COMMIT_PROFILE="1"),
                check=True, capture_output=True, text=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        # The timed handle's line: the set-up and the checking handles write little.
        profiles = [json.loads(line)["commit_profile"] for line in done.stderr.splitlines()
                    if line.startswith('{"commit_profile"')]
        if not profiles:
            raise SystemExit("no profile printed: is the bench built with --features commit-profile?")
        profile = max(profiles, key=lambda p: p["txn_total"]["n"])
        groups = profile.pop("groups")
        syncs = sum(groups)
        covered = sum(size * count for size, count in enumerate(groups))
        print(f"\nW2 T={args.threads} N={args.n}: {result['w2_per_s']:,.0f} items/s, "
              f"{result['wall_s']:.3f} s wall")
        print(f"transactions per fdatasync: mean {covered / max(syncs, 1):.2f} over {syncs} syncs; "
              f"histogram (size: syncs) "
              + ", ".join(f"{size}: {count}" for size, count in enumerate(groups) if count)
              + (" (16 = 16 or more)" if groups[-1] else ""))
        print("| span | count | mean µs | total ms |")
        print("|---|---:|---:|---:|")
        for name, span in profile.items():
            print(f"| {name} | {span['n']} | {span['mean_us']:.1f} | {span['total_ms']:.1f} |")


if __name__ == "__main__":
    main()
