#!/usr/bin/env python3
"""Runs workload W1 for durable-outbox and the SQLite anchor side by side.

    python3 scripts/compare_w1.py [--ns 100,1000,5000] [--repeats 3]

Builds both in release mode (the anchor from ../shared/anchors, into /tmp/anchors),
then for each N runs the two implementations alternately, REPEATS times, each in a
fresh directory, and prints the median of each metric and the ratios as a Markdown
table. Alternating the runs spreads this shared machine's noise over both.

Every paired round is printed too (`--rounds`, on by default): for each N, one
line per round with both implementations' process/s and their ratio, then the
lowest ratio, so a criterion on *each* round ("W1 process >= 1.2x SQLite in
every one of 3 paired runs") is read off one command, not only the medians.
The load average is printed before and after: the figures are fsync-bound and
the machine may be shared.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ANCHORS = os.path.join(ROOT, "..", "shared", "anchors")


def build():
    subprocess.run(["cargo", "build", "-q", "--release", "--example", "bench"], cwd=ROOT, check=True)
    env = dict(os.environ, CARGO_TARGET_DIR="/tmp/anchors")
    subprocess.run(["cargo", "build", "-q", "--release", "--manifest-path",
                    os.path.join(ANCHORS, "sqlite-outbox", "Cargo.toml")], env=env, check=True)
    return {
        "durable-outbox": [os.path.join(ROOT, "target", "release", "examples", "bench")],
        "sqlite-outbox": ["/tmp/anchors/release/sqlite-outbox"],
    }


def run(cmd, n, d):
    work = tempfile.mkdtemp(prefix="w1-", dir=os.environ.get("BENCH_DIR", "/tmp"))
    target = os.path.join(work, "dir")
    try:
        out = subprocess.run(cmd + ["--n", str(n), "--destinations", str(d), "--dir", target],
                             check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])
    finally:
        shutil.rmtree(work, ignore_errors=True)


def load():
    return " ".join(open("/proc/loadavg").read().split()[:3])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default="100,1000,5000")
    ap.add_argument("--destinations", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", action=argparse.BooleanOptionalAction, default=True,
                    help="print every paired round (default); --no-rounds: medians only")
    args = ap.parse_args()
    impls = build()
    print(f"load average before: {load()}")
    rows = []
    rounds = []
    for n in [int(x) for x in args.ns.split(",")]:
        results = {name: [] for name in impls}
        for _ in range(args.repeats):
            for name, cmd in impls.items():
                results[name].append(run(cmd, n, args.destinations))
        rounds.append((n, results))
        med = {name: {k: statistics.median(r[k] for r in rs)
                      for k in ("enqueue_per_s", "process_per_s", "lookup_per_s")}
               for name, rs in results.items()}
        rows.append((n, med))
        print(json.dumps({"n": n, "medians": med}), file=sys.stderr)
    print(f"load average after: {load()}\n")
    if args.rounds:
        print("| N | round | durable-outbox process/s | SQLite process/s | ratio | "
              "durable-outbox enqueue/s | SQLite enqueue/s | ratio |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for n, results in rounds:
            ours, base = results["durable-outbox"], results["sqlite-outbox"]
            ratios = []
            for i, (o, b) in enumerate(zip(ours, base), 1):
                ratio = o["process_per_s"] / b["process_per_s"]
                ratios.append(ratio)
                print(f"| {n} | {i} | {o['process_per_s']:,.0f} | {b['process_per_s']:,.0f} | "
                      f"**{ratio:.2f}×** | {o['enqueue_per_s']:,.0f} | {b['enqueue_per_s']:,.0f} | "
                      f"{o['enqueue_per_s'] / b['enqueue_per_s']:.2f}× |")
            print(f"| {n} | lowest | | | **{min(ratios):.2f}×** | | | |")
        print()
    print("| N | impl | enqueue/s | process/s | lookup/s |")
    print("|---:|---|---:|---:|---:|")
    for n, med in rows:
        for name in impls:
            m = med[name]
            print(f"| {n} | {name} | {m['enqueue_per_s']:,.0f} | {m['process_per_s']:,.0f} | {m['lookup_per_s']:,.0f} |")
        ours, base = med["durable-outbox"], med["sqlite-outbox"]
        print(f"| {n} | **ratio** | **{ours['enqueue_per_s'] / base['enqueue_per_s']:.2f}×** | "
              f"**{ours['process_per_s'] / base['process_per_s']:.2f}×** | "
              f"**{ours['lookup_per_s'] / base['lookup_per_s']:.2f}×** |")
    first, last = rows[0][1]["durable-outbox"], rows[-1][1]["durable-outbox"]
    print(f"\nper-operation cost at N={rows[-1][0]} vs N={rows[0][0]} (durable-outbox): "
          f"enqueue {first['enqueue_per_s'] / last['enqueue_per_s']:.2f}×, "
          f"process {first['process_per_s'] / last['process_per_s']:.2f}×, "
          f"lookup {first['lookup_per_s'] / last['lookup_per_s']:.2f}×")


if __name__ == "__main__":
    main()
