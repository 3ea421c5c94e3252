#!/usr/bin/env python3
"""Concurrency figures against the SQLite anchor, as the ratio table of docs/performance.md.

    python3 scripts/compare_w2.py [--n 2000] [--w1-n 1000] [--repeats 3]

Builds the bench (release, with the tokio feature) and the anchors (into
/tmp/anchors), then runs, REPEATS times and alternating implementations so the
machine's noise falls on both ("paired runs"):

- W2 (enqueue then process each key) with 1 and 8 threads on one handle, and
  with 2 processes x 4 threads on one directory; SQLite with 1 and 8 threads;
- the async worker (`process_due_async`, concurrency 64, 20 ms sends, a chat
  per item: per-chat order allows one send in flight per chat);
- W1 at --w1-n (sequential process), and the fsync floor (two append +
  fdatasync per processed item).

Prints the medians and the ratios as a Markdown table (the W1 ratio and the
8-thread / 1-thread scaling also for each paired run), and the load average
before and after; every run's JSON goes to stderr. Run it when the machine is quiet (see `uptime`): the figures are
fsync-bound and other builds share the disk.
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
BENCH = os.path.join(ROOT, "target", "release", "examples", "bench")
SQLITE = "/tmp/anchors/release/sqlite-outbox"
FLOOR = "/tmp/anchors/release/fsync-floor"


def build():
    subprocess.run(["cargo", "build", "-q", "--release", "--example", "bench", "--features", "tokio"],
                   cwd=ROOT, check=True)
    env = dict(os.environ, CARGO_TARGET_DIR="/tmp/anchors")
    for anchor in ("sqlite-outbox", "fsync-floor"):
        subprocess.run(["cargo", "build", "-q", "--release", "--manifest-path",
                        os.path.join(ANCHORS, anchor, "Cargo.toml")], env=env, check=True)


def run(cmd):
    work = tempfile.mkdtemp(prefix="w2-", dir=os.environ.get("BENCH_DIR", "/tmp"))
    try:
        out = subprocess.run(cmd + ["--dir", os.path.join(work, "dir")],
                             check=True, capture_output=True, text=True).stdout
        line = json.loads(out.strip().splitlines()[-1])
        print(json.dumps(line), file=sys.stderr)
        return line
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--w1-n", type=int, default=1000)
    ap.add_argument("--destinations", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    build()
    print(f"load average before: {' '.join(open('/proc/loadavg').read().split()[:3])}")
    n, d = str(args.n), str(args.destinations)
    cases = {
        "ours T=1": [BENCH, "--workload", "w2", "--threads", "1", "--n", n, "--destinations", d],
        "sqlite T=1": [SQLITE, "--threads", "1", "--n", n, "--destinations", d],
        "ours T=8": [BENCH, "--workload", "w2", "--threads", "8", "--n", n, "--destinations", d],
        "sqlite T=8": [SQLITE, "--threads", "8", "--n", n, "--destinations", d],
        "ours 2x4": [BENCH, "--workload", "w2", "--threads", "4", "--processes", "2",
                     "--n", n, "--destinations", d],
        # A chat per item: per-chat order would cap the sends in flight at D.
        "ours async": [BENCH, "--workload", "async", "--concurrency", "64", "--send-us", "20000",
                       "--n", n, "--destinations", n],
    }
    w1 = {
        "ours W1": [BENCH, "--n", str(args.w1_n), "--destinations", d],
        "sqlite W1": [SQLITE, "--n", str(args.w1_n), "--destinations", d],
    }
    results = {name: [] for name in list(cases) + list(w1) + ["floor", "async send ms"]}
    for _ in range(args.repeats):
        for name, cmd in cases.items():
            key = "async_per_s" if "async" in name else "w2_per_s"
            out = run(cmd)
            results[name].append(out[key])
            if "async" in name:
                # The sends' measured mean length (tokio's timer rounds up).
                results["async send ms"].append(out["send_mean_ms"])
        for name, cmd in w1.items():
            results[name].append(run(cmd)["process_per_s"])
        floor = run([FLOOR, "--iters", "500"])
        results["floor"].append(floor["append_fdatasync"]["median_us"])
    print(f"load average after: {' '.join(open('/proc/loadavg').read().split()[:3])}")
    med = {name: statistics.median(v) for name, v in results.items()}
    w1_ratios = [o / s for o, s in zip(results["ours W1"], results["sqlite W1"])]
    # Per processed item: two append+fdatasync at the floor.
    floor_ratio = (1e6 / med["ours W1"]) / (2 * med["floor"])
    print(f"| figure (median of {args.repeats} paired runs) | durable-outbox | SQLite anchor | ratio |")
    print("|---|---:|---:|---:|")
    print(f"| W2 T=8, N={n}, items/s | {med['ours T=8']:,.0f} | {med['sqlite T=8']:,.0f} | "
          f"**{med['ours T=8'] / med['sqlite T=8']:.1f}×** |")
    print(f"| W2 T=1, N={n}, items/s | {med['ours T=1']:,.0f} | {med['sqlite T=1']:,.0f} | "
          f"{med['ours T=1'] / med['sqlite T=1']:.2f}× |")
    scaling = [e / o for e, o in zip(results["ours T=8"], results["ours T=1"])]
    print(f"| W2 T=8 / T=1 (scaling) | {med['ours T=8'] / med['ours T=1']:.1f}× (each run: "
          f"{', '.join(f'{r:.2f}' for r in scaling)}) | "
          f"{med['sqlite T=8'] / med['sqlite T=1']:.1f}× | |")
    print(f"| W2 2 processes × 4 threads vs SQLite T=8, items/s | {med['ours 2x4']:,.0f} | "
          f"{med['sqlite T=8']:,.0f} | **{med['ours 2x4'] / med['sqlite T=8']:.1f}×** |")
    at_send = 64 * 1000 / med["async send ms"]
    print(f"| async drain, concurrency 64, 20 ms sends, items/s (bound 3,200) | "
          f"{med['ours async']:,.0f} | | {med['ours async'] / 3200:.2f} of bound; "
          f"{med['ours async'] / at_send:.2f} of {at_send:,.0f}, the bound at the sends' "
          f"measured {med['async send ms']:.1f} ms |")
    print(f"| W1 process, N={args.w1_n}, items/s | {med['ours W1']:,.0f} | {med['sqlite W1']:,.0f} | "
          f"**{statistics.median(w1_ratios):.2f}×** (each run: "
          f"{', '.join(f'{r:.2f}' for r in w1_ratios)}) |")
    print(f"| W1 process cost / fsync floor (2 × {med['floor']:,.0f} µs) | {floor_ratio:.2f}× | | |")


if __name__ == "__main__":
    main()
