#!/usr/bin/env python3
"""Syscalls per transaction from an `strace -f -tt -T` log, between two syncs.

    strace -f -tt -T -o W1.trace target/release/examples/bench --n 1000 --destinations 50 --dir DIR
    python3 scripts/syscalls_per_txn.py W1.trace --skip 1000 --txns 2000

Every transaction ends in one sync (`fdatasync` for durable-outbox; pass
`--sync fsync` for the SQLite anchor, which `fsync`s its WAL). The script counts
the syscalls issued after the SKIP-th sync up to and including the
(SKIP+TXNS)-th, i.e. one phase of a run: with W1 at N = 1,000 the first 1,000
syncs are the enqueues and the next 2,000 the `process` phase (a claim and a
result record per item). Prints each syscall's count per transaction, its mean
time in the kernel (`-T`; strace itself inflates it) and its time per
transaction, most frequent first.
"""
import argparse
import collections
import re

LINE = re.compile(r"^\d+\s+(\S+)\s+(\w+)\(.*<([\d.]+)>\s*$")


def seconds(stamp):
    h, m, s = stamp.split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--skip", type=int, default=0, help="syncs before the phase")
    ap.add_argument("--txns", type=int, required=True, help="transactions (syncs) in the phase")
    ap.add_argument("--sync", default="fdatasync", help="the syscall that ends a transaction")
    args = ap.parse_args()
    count, spent = collections.Counter(), collections.Counter()
    syncs, first, last = 0, None, None
    with open(args.trace) as trace:
        for line in trace:
            m = LINE.match(line)
            if not m:
                continue  # "<unfinished ...>" halves and signals carry no time
            stamp, name, took = m.group(1), m.group(2), float(m.group(3))
            if args.skip <= syncs < args.skip + args.txns:
                count[name] += 1
                spent[name] += took
                first = first if first is not None else seconds(stamp)
                last = seconds(stamp)
            if name == args.sync:
                syncs += 1
    if not count:
        raise SystemExit(f"no syscalls between sync {args.skip} and {args.skip + args.txns} "
                         f"(the trace has {syncs} {args.sync} calls)")
    n = args.txns
    print(f"{n} transactions, {last - first:.3f} s of wall time under strace")
    print(f"{'syscall':14} {'per txn':>8} {'µs each':>8} {'µs/txn':>8}")
    for name, c in count.most_common():
        print(f"{name:14} {c / n:8.2f} {1e6 * spent[name] / c:8.1f} {1e6 * spent[name] / n:8.1f}")
    print(f"{'all':14} {sum(count.values()) / n:8.2f} {'':8} {1e6 * sum(spent.values()) / n:8.1f}")


if __name__ == "__main__":
    main()
