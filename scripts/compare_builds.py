#!/usr/bin/env python3
"""Two builds of the bench side by side: before/after figures of one change.

    python3 scripts/compare_builds.py OLD_BENCH NEW_BENCH [--repeats 3]

OLD_BENCH and NEW_BENCH are release builds of `examples/bench` (with the
tokio feature), e.g. one built from main in a scratch checkout and this
tree's `target/release/examples/bench`. Runs, REPEATS times and alternating
the two builds (and which of them goes first, from repeat to repeat) so the
machine's noise falls on both:

- the async drain (`--workload async`, 20 ms sends, a chat per item, N=2000)
  at concurrency 16, 32, 64 and 128 (bound: concurrency / 20 ms);
- W2 (enqueue then process each key) with 1 and 8 threads, N=2000;
- W1 (sequential process), N=1000.

Prints the load average before and after, and a Markdown table of medians;
every run's JSON goes to stderr. The figures are fsync-bound: run it when the
machine is as quiet as it gets.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ASYNC = [16, 32, 64, 128]


def run(cmd):
    work = tempfile.mkdtemp(prefix="cmp-", dir=os.environ.get("BENCH_DIR", "/tmp"))
    try:
        out = subprocess.run(cmd + ["--dir", os.path.join(work, "dir")],
                             check=True, capture_output=True, text=True).stdout
        line = json.loads(out.strip().splitlines()[-1])
        print(json.dumps(line), file=sys.stderr)
        return line
    finally:
        shutil.rmtree(work, ignore_errors=True)


def cases():
    out = {}
    for c in ASYNC:
        out[f"async C={c}"] = (["--workload", "async", "--concurrency", str(c), "--send-us", "20000",
                                "--n", "2000", "--destinations", "2000"], "async_per_s")
    for t in (1, 8):
        out[f"W2 T={t}"] = (["--workload", "w2", "--threads", str(t), "--n", "2000",
                             "--destinations", "50"], "w2_per_s")
    out["W1 process"] = (["--n", "1000", "--destinations", "50"], "process_per_s")
    return out


def load():
    return open("/proc/loadavg").read().split()[:3]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"load average before: {' '.join(load())}")
    results = {(name, build): [] for name in cases() for build in ("old", "new")}
    builds = [("old", args.old), ("new", args.new)]
    for repeat in range(args.repeats):
        for name, (flags, key) in cases().items():
            # Which build runs first alternates from repeat to repeat: the
            # second run of a pair was measured to come out slower (W1 0.95x
            # old-first, 1.14x new-first on one quiet machine), so a fixed
            # order would bias every ratio the same way.
            for build, path in builds if repeat % 2 == 0 else builds[::-1]:
                results[(name, build)].append(run([path] + flags)[key])
    print(f"load average after: {' '.join(load())}")
    print(f"| figure (median of {args.repeats}, alternating; first build alternating too) | before | after | after / before |")
    print("|---|---:|---:|---:|")
    for name in cases():
        old = statistics.median(results[(name, "old")])
        new = statistics.median(results[(name, "new")])
        extra = ""
        if name.startswith("async"):
            bound = int(name.split("=")[1]) * 50
            extra = f" ({old / bound:.2f} → {new / bound:.2f} of the bound {bound:,})"
        print(f"| {name}, items/s{extra} | {old:,.0f} | {new:,.0f} | {new / old:.2f}× |")


if __name__ == "__main__":
    main()
