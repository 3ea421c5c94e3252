#!/usr/bin/env python3
"""PostgreSQL W2 figures beside their floor, in one run on one server.

    python3 scripts/compare_pg.py [--n 1000] [--n1 300] [--repeats 3] [--no-build]
        [--before BENCH] [--also NAME=BENCH ...]
    python3 scripts/compare_pg.py --serve      # start the server, print its URL, wait

Starts a throwaway PostgreSQL server as the test harness does
(`tests/support/postgres.rs`: `initdb` into a temporary directory, as the
`postgres` user when run as root, `pg_ctl start` on a free loopback port),
but with `fsync` on (the server's defaults), on the disk of `--dir` (default
/tmp). Then, REPEATS times, in turns so the machine's noise falls on all of
them alike:

- ours (PostgreSQL): `bench --workload w2 --threads T --n N --postgres URL
  --schema S`, T = 1 (N = --n1) and T = 8 (N = --n), a fresh schema each run;
- the floor: `pgbench -n -c T -j min(T,2) -T SECS -f two_updates.sql`, two
  single-row UPDATE transactions per item (after `pgbench -i -s 1`), in items/s
  (one run of the script is one item, so pgbench's tps);
- the issue's floor read literally ("a built-in script of two single-row
  update transactions per item"): `pgbench -n -c T -j min(T,2) -T SECS -b
  simple-update`, pgbench's own single-row update transaction (which also
  reads the row back and inserts a history row), two per item: tps / 2;
- our SQL via pgbench: `pgbench -n -M prepared -c 8 -j 2 -t N/8` running
  OUR_SQL below: the statements one W2 item runs on our engine at T=8 (as
  `log_statement = all` shows them), in the same three transactions
  (enqueue, claim, finish), with pgbench variables for keys and
  destinations, and a sealing transaction at the rate ours sealed at T=8 in
  the same round (its calls in `pg_stat_statements`), on a fresh schema our
  bench created. It is what the SQL our guarantees need costs with a lean C
  client: ours minus it is what our client and its use of the protocol
  cost;
- the file engine (`bench --workload w2 --dir ...`) and the SQLite anchor
  (`sqlite-outbox --threads T`), T = 8, N = --n, on the same disk.

Prints the medians (and every run) as a Markdown table, with floor / ours,
and the WAL each of our runs wrote per item (`pg_current_wal_insert_lsn`
before and after the run, less what a run of one item writes, tables
included): a figure the machine's load hardly moves, unlike items/s;
every run's JSON goes to stderr. The server is stopped and its directory
removed at the end (also on Ctrl-C).

And CPU per item, server and client apart, for ours, `--before`, our SQL
via pgbench and the floor: the server's is what the postmaster and its children used during the
run (for ours less a run of one item, as for WAL) (`/proc`: the postmaster's own and reaped children's user + system time,
plus the time of the children still alive; the backends of a run exit at its
end and are reaped into it), the client's is the bench's own figure of its
timed part (`client_cpu_ms_per_item`; absent from older benches) or, for
`pgbench`, its user + system time. On a machine shared with other work these
move less than items/s do.
"""
import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ANCHORS = os.path.join(ROOT, "..", "shared", "anchors")
BENCH = os.environ.get("BENCH", os.path.join(ROOT, "target", "release", "examples", "bench"))
SQLITE = "/tmp/anchors/release/sqlite-outbox"

TWO_UPDATES = """\\set a random(1, 100000 * :scale)
\\set b random(1, 100000 * :scale)
BEGIN;
UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = :a;
END;
BEGIN;
UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = :b;
END;
"""

# Our SQL, one W2 item on our engine at T=8, for pgbench (see the module's
# doc). `{s}` is the schema, `{chan}` its wake-up channel. Where ours sends a
# value it computed as a parameter, this computes one of the same size on the
# server (documents and audit events: the lengths a W2 item has; timestamps:
# `now()`); the advisory lock keys are pgbench variables. Statements in the
# order of `src/engine/postgres`:
#
# - each transaction opens with the writers' gate, the item key's lock, the
#   stored settings and the owner probe in one statement, then the item's row
#   `FOR UPDATE` (`transact.rs`, `open_txn`);
# - enqueue: the destination's lock, shared, with `nextval` (`txn.rs`, `next_seq`),
#   the row's insert carrying its pending audit event (`rows.rs`), `COMMIT`;
# - the wake-up, once every `notify_one_in` items (ours' coalesced `NOTIFY`s
#   in the same round, from `pg_stat_statements`, as for sealing): ours sends
#   it from a connection of its own with asynchronous commits (`notify.rs`),
#   here one statement after the enqueue on the same connection, committed
#   asynchronously as ours' session does;
# - claim: the destination's lock, exclusive, its line (head, the three newest send
#   times, the cap's count-th newest found on the server (W2's cap is
#   u32::MAX per minute), cooldown: `txn.rs`, `read_line`), the row's update
#   with its send times, `COMMIT`;
# - finish: the row's update with its send times and pending event, `COMMIT`;
# - sealing, once every `seal_one_in` items (`sealing.rs`): the head `FOR
#   UPDATE SKIP LOCKED`, the pending events taken, the records inserted and
#   the head moved, `COMMIT`. Ours hashes the events in the client; here the
#   server counts the events it deleted and inserts as many records of the
#   chain's length (`\gset` takes one row, so the events do not travel to
#   the client: about 1 KB less per item than ours moves).
#
# Not modelled: the rare `Waiting` retries (a chat's earlier item still in
# flight on another thread), which write nothing.
OUR_SQL = r"""\set k random(1, 9000000000000000000)
\set d random(0, :destinations - 1)
\set seal random(1, :seal_one_in)
\set wake random(1, :notify_one_in)
\set gate 11
\set owner 12
BEGIN;
SELECT (SELECT doc FROM {s}.settings WHERE id = 1), pg_try_advisory_xact_lock_shared(:owner) FROM (SELECT pg_advisory_xact_lock_shared(:gate), pg_advisory_xact_lock(:k)) gate;
SELECT idempotency_key, revision, doc, seq FROM {s}.items WHERE idempotency_key = 'key-' || :k FOR UPDATE;
SELECT nextval('{s}.enqueue_seq') AS seq FROM (SELECT pg_advisory_xact_lock_shared(-1 - :d)) l \gset
WITH pended AS (INSERT INTO {s}.audit_pending (event) SELECT doc FROM unnest(ARRAY['{{"key":"key-' || :k || '","outcome":"queued","pad":"' || repeat('x', {event_pad}) || '"}}']::text[]) WITH ORDINALITY AS t(doc, n) ORDER BY n) INSERT INTO {s}.items (idempotency_key, revision, destination, state, claimed, claim_owner, next_attempt_at, transport_ref, doc, seq, created_at, updated_at) VALUES ('key-' || :k, 1, 'chat-' || :d, 'queued', false, NULL, NULL, NULL, '{{"key":"key-' || :k || '","state":"queued","pad":"' || repeat('x', {doc_pad}) || '"}}', COALESCE(:seq, nextval('{s}.enqueue_seq')), now(), now());
COMMIT;
\if :wake = 1
SELECT pg_notify('{chan}', ''), set_config('synchronous_commit', 'off', true);
\endif
BEGIN;
SELECT (SELECT doc FROM {s}.settings WHERE id = 1), pg_try_advisory_xact_lock_shared(:owner) FROM (SELECT pg_advisory_xact_lock_shared(:gate), pg_advisory_xact_lock(:k)) gate;
SELECT idempotency_key, revision, doc, seq FROM {s}.items WHERE idempotency_key = 'key-' || :k FOR UPDATE;
SELECT pg_advisory_xact_lock(-1 - :d);
SELECT h.idempotency_key, h.revision, h.doc, h.seq, t.keys, t.ats, (SELECT until FROM {s}.cooldowns WHERE destination = 'chat-' || :d), (SELECT at FROM {s}.rate_times WHERE destination = 'chat-' || :d AND at > now() - interval '1 minute' AND NOT (idempotency_key = ANY('{{}}'::text[])) ORDER BY at DESC OFFSET 4294967294 LIMIT 1) FROM (SELECT array_agg(idempotency_key ORDER BY at DESC, idempotency_key) AS keys, array_agg(at ORDER BY at DESC, idempotency_key) AS ats FROM (SELECT idempotency_key, at FROM {s}.rate_times WHERE destination = 'chat-' || :d AND at >= now() - interval '1 minute' ORDER BY at DESC LIMIT 3) r) t LEFT JOIN LATERAL (SELECT idempotency_key, revision, doc, seq FROM {s}.items WHERE destination = 'chat-' || :d AND state = 'queued' AND NOT (idempotency_key = ANY('{{}}'::text[])) ORDER BY seq, created_at, idempotency_key LIMIT 1) h ON true;
WITH gone AS (DELETE FROM {s}.rate_times WHERE idempotency_key = 'key-' || :k AND NOT (at = ANY(ARRAY[now()]) AND destination = 'chat-' || :d)), added AS (INSERT INTO {s}.rate_times (idempotency_key, destination, at) SELECT 'key-' || :k, 'chat-' || :d, t FROM unnest(ARRAY[now()]) AS t ON CONFLICT DO NOTHING) UPDATE {s}.items SET revision = revision + 1, destination = 'chat-' || :d, state = 'queued', claimed = true, claim_owner = 'owner-1', next_attempt_at = NULL, transport_ref = NULL, doc = '{{"key":"key-' || :k || '","state":"claimed","pad":"' || repeat('x', {doc_pad}) || '"}}', seq = COALESCE(:seq, seq), created_at = now(), updated_at = now() WHERE idempotency_key = 'key-' || :k AND revision = 1;
COMMIT;
BEGIN;
SELECT (SELECT doc FROM {s}.settings WHERE id = 1), pg_try_advisory_xact_lock_shared(:owner) FROM (SELECT pg_advisory_xact_lock_shared(:gate), pg_advisory_xact_lock(:k)) gate;
SELECT idempotency_key, revision, doc, seq FROM {s}.items WHERE idempotency_key = 'key-' || :k FOR UPDATE;
WITH gone AS (DELETE FROM {s}.rate_times WHERE idempotency_key = 'key-' || :k AND NOT (at = ANY(ARRAY[now()]) AND destination = 'chat-' || :d)), added AS (INSERT INTO {s}.rate_times (idempotency_key, destination, at) SELECT 'key-' || :k, 'chat-' || :d, t FROM unnest(ARRAY[now()]) AS t ON CONFLICT DO NOTHING), pended AS (INSERT INTO {s}.audit_pending (event) SELECT doc FROM unnest(ARRAY['{{"key":"key-' || :k || '","outcome":"sent","pad":"' || repeat('x', {event_pad}) || '"}}']::text[]) WITH ORDINALITY AS t(doc, n) ORDER BY n) UPDATE {s}.items SET revision = revision + 1, destination = 'chat-' || :d, state = 'sent', claimed = false, claim_owner = NULL, next_attempt_at = NULL, transport_ref = 'tr-' || :k, doc = '{{"key":"key-' || :k || '","state":"sent","pad":"' || repeat('x', {doc_pad}) || '"}}', seq = COALESCE(:seq, seq), created_at = now(), updated_at = now() WHERE idempotency_key = 'key-' || :k AND revision = 2;
COMMIT;
\if :seal = 1
\set got 0
BEGIN;
SELECT 1 AS got, seq AS head, set_config('synchronous_commit', 'off', true) FROM {s}.audit_head WHERE id = 1 FOR UPDATE SKIP LOCKED \aset
\if :got
WITH d AS (DELETE FROM {s}.audit_pending WHERE id IN (SELECT id FROM {s}.audit_pending ORDER BY id LIMIT 1000) RETURNING id, event) SELECT count(*) AS n FROM d \gset
\set tail :head + :n
WITH sealed AS (INSERT INTO {s}.audit (seq, hash, line) SELECT * FROM unnest(ARRAY(SELECT :head + g FROM generate_series(1, :n) g), ARRAY(SELECT repeat('h', 64) FROM generate_series(1, :n)), ARRAY(SELECT repeat('x', {line_len}) FROM generate_series(1, :n)))) UPDATE {s}.audit_head SET seq = :tail, hash = repeat('h', 64) WHERE id = 1;
\endif
COMMIT;
\endif
"""


def our_sql(schema):
    """OUR_SQL for `schema`, with a W2 item's sizes: its document ~800
    bytes, a pending event ~540, a sealed record ~610."""
    return OUR_SQL.format(s=f'"{schema}"', chan=f"durable_outbox_{schema}",
                          doc_pad=760, event_pad=500, line_len=610)


def pg_bin():
    if os.environ.get("PG_BIN"):
        return os.environ["PG_BIN"]
    versions = sorted((int(v), v) for v in os.listdir("/usr/lib/postgresql") if v.isdigit())
    if not versions:
        sys.exit("no PostgreSQL server binaries (apt-get install -y postgresql)")
    return os.path.join("/usr/lib/postgresql", versions[-1][1], "bin")


class Server:
    """A throwaway server: initdb + pg_ctl, stopped by stop()."""

    def __init__(self, base):
        self.bin = pg_bin()
        self.root = tempfile.mkdtemp(prefix="compare-pg-", dir=base)
        self.data = os.path.join(self.root, "data")
        self.as_postgres = os.geteuid() == 0
        if self.as_postgres:
            shutil.chown(self.root, "postgres", "postgres")
        self.tool("initdb", "-D", self.data, "-A", "trust", "-U", "postgres", "-E", "UTF8",
                  quiet=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        opts = (f"-k {self.root} -p {self.port} -c listen_addresses=127.0.0.1 "
                "-c max_connections=200 -c shared_preload_libraries=pg_stat_statements")
        self.tool("pg_ctl", "-D", self.data, "-l", os.path.join(self.root, "server.log"),
                  "-w", "-o", opts, "start", quiet=True)
        self.psql("postgres", "CREATE DATABASE bench")

    def tool(self, name, *args, quiet=False):
        cmd = [os.path.join(self.bin, name), *args]
        if self.as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        out = subprocess.DEVNULL if quiet else None
        subprocess.run(cmd, check=True, stdout=out, stdin=subprocess.DEVNULL)

    def url(self, db="bench"):
        return f"postgres://postgres@127.0.0.1:{self.port}/{db}"

    def cpu_s(self):
        """CPU seconds used so far by the postmaster and its children (see
        the module's doc)."""
        with open(os.path.join(self.data, "postmaster.pid")) as f:
            pid = int(f.readline())
        tick = os.sysconf("SC_CLK_TCK")

        def times(p):
            with open(f"/proc/{p}/stat") as f:
                return [int(x) for x in f.read().rsplit(")", 1)[1].split()[11:15]]

        total = sum(times(pid))
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = f.read().split()
        for child in children:
            try:
                total += sum(times(child)[:2])
            except (FileNotFoundError, ProcessLookupError):
                pass
        return total / tick

    def settle(self):
        """Waits (up to 5 s) until only this query's own session is connected
        to `bench`: a finished run's backends have exited and been reaped."""
        for _ in range(50):
            if self.psql("bench", "SELECT count(*) FROM pg_stat_activity "
                                  "WHERE datname = 'bench' "
                                  "AND backend_type = 'client backend'") == "1":
                return
            time.sleep(0.1)

    def pgbench(self, *args):
        """Runs `pgbench -n ARGS` against `bench` once the server is settled:
        its output, its tps, and the CPU seconds the server and pgbench
        used meanwhile (see the module's doc)."""
        self.settle()
        cpu_start = self.cpu_s()
        own_start = os.times()
        out = subprocess.run(
            [os.path.join(self.bin, "pgbench"), "-n", *args,
             "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "bench"],
            check=True, capture_output=True, text=True).stdout
        self.settle()
        own = os.times()
        client_s = (own.children_user - own_start.children_user
                    + own.children_system - own_start.children_system)
        tps = next(float(l.split("=")[1].split()[0]) for l in out.splitlines()
                   if l.startswith("tps ="))
        return out, tps, self.cpu_s() - cpu_start, client_s

    def psql(self, db, sql):
        return subprocess.run(
            [os.path.join(self.bin, "psql"), "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1",
             "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-d", db, "-c", sql],
            check=True, capture_output=True, text=True).stdout.strip()

    def stop(self):
        try:
            self.tool("pg_ctl", "-D", self.data, "-m", "fast", "-w", "stop", quiet=True)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def build(no_build):
    if no_build:
        return
    subprocess.run(["cargo", "build", "-q", "--release", "--example", "bench",
                    "--features", "postgres,tokio"], cwd=ROOT, check=True)
    env = dict(os.environ, CARGO_TARGET_DIR="/tmp/anchors")
    subprocess.run(["cargo", "build", "-q", "--release", "--manifest-path",
                    os.path.join(ANCHORS, "sqlite-outbox", "Cargo.toml")], env=env, check=True)


def last_json(out):
    line = json.loads(out.strip().splitlines()[-1])
    print(json.dumps(line), file=sys.stderr)
    return line


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1000, help="items at 8 threads")
    ap.add_argument("--n1", type=int, default=300, help="items at 1 thread")
    ap.add_argument("--destinations", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pgbench-secs", type=int, default=10)
    ap.add_argument("--dir", default=os.environ.get("BENCH_DIR", "/tmp"))
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--before", metavar="BENCH",
                    help="another bench binary (e.g. built from an older commit) to run "
                         "beside ours, at T=8 and T=1, for a paired before/after figure")
    ap.add_argument("--also", metavar="NAME=BENCH", action="append", default=[],
                    help="more bench binaries (e.g. one step of a change alone) to run at "
                         "T=8 beside ours, each as its own case named NAME (repeatable)")
    ap.add_argument("--serve", action="store_true",
                    help="start the server, print its URL and wait for Ctrl-C")
    args = ap.parse_args()
    build(args.no_build or args.serve)
    # Every binary a case runs must be there before the first case: a case
    # failing at the end of a run would throw away the minutes before it.
    needed = [BENCH] if args.serve else [BENCH, SQLITE] + ([args.before] if args.before else []) \
        + [spec.split("=", 1)[-1] for spec in args.also]
    missing = [path for path in needed if not os.access(path, os.X_OK)]
    if missing:
        sys.exit("compare_pg: missing " + ", ".join(missing)
                 + (" (run without --no-build to build ours and the SQLite anchor)"
                    if args.no_build else ""))
    server = Server(args.dir)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    try:
        if args.serve:
            server.psql("bench", "CREATE EXTENSION pg_stat_statements")
            print(server.url(), flush=True)
            while True:
                time.sleep(3600)
        subprocess.run([os.path.join(server.bin, "pgbench"), "-i", "-q", "-s", "1",
                        "-h", "127.0.0.1", "-p", str(server.port), "-U", "postgres", "bench"],
                       check=True, capture_output=True)
        script = os.path.join(server.root, "two_updates.sql")
        with open(script, "w") as f:
            f.write(TWO_UPDATES)
        server.psql("bench", "CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        d = str(args.destinations)
        counter = [0]
        # Items per sealing transaction in ours' last T=8 run (before any: a
        # typical figure).
        seal_one_in = [16]
        # Items per `NOTIFY` in ours' last T=8 run (before any: one each, as
        # before they were coalesced).
        notify_one_in = [1]

        wal = {}
        base = {}

        cpu = {}

        def run_bench(bench, threads, n, schema, extra=()):
            """Runs W2 on a fresh schema; its output, the WAL it wrote and the
            server's CPU seconds."""
            start = server.psql("bench", "SELECT pg_current_wal_insert_lsn()")
            server.settle()
            cpu_start = server.cpu_s()
            out = subprocess.run(
                [bench, "--workload", "w2", "--threads", str(threads), "--n", str(n),
                 "--destinations", d, "--postgres", server.url(), "--schema", schema,
                 *extra],
                check=True, capture_output=True, text=True).stdout
            server.settle()
            cpu_used = server.cpu_s() - cpu_start
            used = float(server.psql(
                "bench", f"SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '{start}')"))
            return out, used, cpu_used

        def ours(threads, n, bench=BENCH, name=None, extra=()):
            counter[0] += 1
            if bench not in base:
                # What creating the tables and one item write, once per binary:
                # taken off each run's WAL, so WAL per item is the workload's.
                # The server's other clients are idle meanwhile (cases run in
                # turns).
                base[bench] = run_bench(bench, 1, 1, f"w2_base_{counter[0]}")[1:]
            schema = f"w2_{threads}_{counter[0]}"
            out, used, cpu_used = run_bench(bench, threads, n, schema, extra)
            line = last_json(out)
            if threads == 8 and bench == BENCH and not extra:
                seals = int(server.psql(
                    "bench", "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements "
                             f"WHERE query LIKE '%INSERT INTO \"{schema}\".audit (seq%'"))
                if seals:
                    seal_one_in[0] = max(1, round(n / seals))
                notifies = int(server.psql(
                    "bench", "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements "
                             f"WHERE query LIKE 'NOTIFY \"durable_outbox_{schema}\"%'"))
                if notifies:
                    notify_one_in[0] = max(1, round(n / notifies))
            if name:
                base_wal, base_cpu = base[bench]
                wal.setdefault(name, []).append((used - base_wal) / (n - 1))
                # Less what opening the outbox, the untimed check after the
                # run and one item cost (the base run), as for WAL.
                cpu.setdefault(name, []).append(
                    (1000 * (cpu_used - base_cpu) / (n - 1), line.get("client_cpu_ms_per_item")))
            return line["w2_per_s"]

        def floor(clients):
            _, tps, server_s, client_s = server.pgbench(
                "-c", str(clients), "-j", str(min(clients, 2)), "-T", str(args.pgbench_secs),
                "-f", script)
            items = tps * args.pgbench_secs
            cpu.setdefault(f"pgbench floor {clients} client{'s' if clients > 1 else ''}",
                           []).append((1000 * server_s / items, 1000 * client_s / items))
            # One pgbench transaction of this script is two UPDATE
            # transactions, i.e. one item: tps is items/s already.
            print(json.dumps({"impl": "pgbench", "clients": clients, "items_per_s": tps}),
                  file=sys.stderr)
            return tps

        def builtin_floor(clients):
            """The issue's floor read literally: pgbench's built-in
            single-row update transaction (`-b simple-update`: one `UPDATE`
            of `pgbench_accounts`, a `SELECT` of it and an `INSERT` into
            `pgbench_history`), two of them per item."""
            _, tps, server_s, client_s = server.pgbench(
                "-c", str(clients), "-j", str(min(clients, 2)), "-T", str(args.pgbench_secs),
                "-b", "simple-update")
            items = tps / 2
            cpu.setdefault(f"pgbench built-in simple-update {clients} clients", []).append(
                (1000 * server_s / (items * args.pgbench_secs),
                 1000 * client_s / (items * args.pgbench_secs)))
            print(json.dumps({"impl": "pgbench -b simple-update", "clients": clients,
                              "items_per_s": items}), file=sys.stderr)
            return items

        def our_sql_via_pgbench(clients, n):
            """OUR_SQL on a fresh schema our bench created (one item, so
            the tables, settings and audit head exist as ours has them)."""
            counter[0] += 1
            schema = f"sql_{clients}_{counter[0]}"
            subprocess.run([BENCH, "--workload", "w2", "--threads", "1", "--n", "1",
                            "--destinations", d, "--postgres", server.url(), "--schema", schema],
                           check=True, capture_output=True)
            path = os.path.join(server.root, f"{schema}.sql")
            with open(path, "w") as f:
                f.write(our_sql(schema))
            per_client = max(1, n // clients)
            items = per_client * clients
            out, tps, server_s, client_s = server.pgbench(
                "-M", "prepared", "-c", str(clients), "-j", str(min(clients, 2)),
                "-t", str(per_client), "-D", f"destinations={d}",
                "-D", f"seal_one_in={seal_one_in[0]}",
                "-D", f"notify_one_in={notify_one_in[0]}", "-f", path)
            failed = next((l for l in out.splitlines() if l.startswith("number of failed")), "")
            if not failed.startswith("number of failed transactions: 0 "):
                sys.exit(f"our SQL via pgbench: {failed or out}")
            cpu.setdefault(f"our SQL via pgbench {clients} clients", []).append(
                (1000 * server_s / items, 1000 * client_s / items))
            print(json.dumps({"impl": "our SQL via pgbench", "clients": clients,
                              "items_per_s": tps, "seal_one_in": seal_one_in[0],
                              "notify_one_in": notify_one_in[0]}),
                  file=sys.stderr)
            return tps

        def on_disk(cmd):
            work = tempfile.mkdtemp(prefix="w2-", dir=args.dir)
            try:
                out = subprocess.run(cmd + ["--dir", os.path.join(work, "dir")],
                                     check=True, capture_output=True, text=True).stdout
                return last_json(out)
            finally:
                shutil.rmtree(work, ignore_errors=True)

        n = str(args.n)
        cases = {
            "ours (PostgreSQL) T=8": lambda: ours(8, args.n, name="ours (PostgreSQL) T=8"),
            # As pgbench's tps leaves connecting out: the handle opened and
            # its connections made before the clock starts (`--warm yes`).
            "ours, warm (PostgreSQL) T=8": lambda: ours(
                8, args.n, name="ours, warm (PostgreSQL) T=8", extra=("--warm", "yes")),
            "pgbench floor 8 clients": lambda: floor(8),
            "pgbench built-in simple-update 8 clients (tps / 2)": lambda: builtin_floor(8),
            "our SQL via pgbench 8 clients": lambda: our_sql_via_pgbench(8, args.n),
            "ours (PostgreSQL) T=1": lambda: ours(1, args.n1, name="ours (PostgreSQL) T=1"),
            "pgbench floor 1 client": lambda: floor(1),
            "file engine T=8": lambda: on_disk(
                [BENCH, "--workload", "w2", "--threads", "8", "--n", n, "--destinations", d]
            )["w2_per_s"],
            "SQLite anchor T=8": lambda: on_disk(
                [SQLITE, "--threads", "8", "--n", n, "--destinations", d])["w2_per_s"],
        }
        if args.before:
            cases["before (PostgreSQL) T=8"] = lambda: ours(
                8, args.n, args.before, name="before (PostgreSQL) T=8")
            cases["before (PostgreSQL) T=1"] = lambda: ours(
                1, args.n1, args.before, name="before (PostgreSQL) T=1")
        for also in args.also:
            label, _, bench = also.partition("=")
            name = f"{label} (PostgreSQL) T=8"
            cases[name] = (lambda bench, name: lambda: ours(8, args.n, bench, name=name))(
                bench, name)
        runs = {name: [] for name in cases}
        for _ in range(args.repeats):
            for name, case in cases.items():
                runs[name].append(case())
        med = {name: statistics.median(v) for name, v in runs.items()}
        load = open("/proc/loadavg").read().split()[:3]
        print(f"\nmedian of {args.repeats}, load average {' '.join(load)} at the end, "
              f"N = {args.n} (T=8), {args.n1} (T=1), {args.destinations} destinations\n")
        print("| figure | items/s (median) | runs |")
        print("|---|---:|---|")
        for name, values in runs.items():
            print(f"| {name} | {med[name]:,.0f} | {', '.join(f'{v:,.0f}' for v in values)} |")
        print()
        for t, fl in ((8, "pgbench floor 8 clients"), (1, "pgbench floor 1 client")):
            print(f"floor / ours at T={t}: {med[fl] / med[f'ours (PostgreSQL) T={t}']:.2f}x")
        print(f"floor / ours, warm at T=8 (connecting left out of both): "
              f"{med['pgbench floor 8 clients'] / med['ours, warm (PostgreSQL) T=8']:.2f}x")
        builtin = med["pgbench built-in simple-update 8 clients (tps / 2)"]
        print(f"built-in floor / ours at T=8: {builtin / med['ours (PostgreSQL) T=8']:.2f}x "
              f"(warm: {builtin / med['ours, warm (PostgreSQL) T=8']:.2f}x)")
        sql = med["our SQL via pgbench 8 clients"]
        print(f"floor / our SQL via pgbench at T=8: {med['pgbench floor 8 clients'] / sql:.2f}x")
        print(f"our SQL via pgbench / ours at T=8: {sql / med['ours (PostgreSQL) T=8']:.2f}x")
        if args.before:
            for t in (8, 1):
                print(f"ours / before at T={t}: "
                      f"{med[f'ours (PostgreSQL) T={t}'] / med[f'before (PostgreSQL) T={t}']:.2f}x")
        print()
        print("| WAL per item (median, bytes) | | runs |")
        print("|---|---:|---|")
        for name, values in wal.items():
            print(f"| {name} | {statistics.median(values):,.0f} | "
                  f"{', '.join(f'{v:,.0f}' for v in values)} |")
        print()
        print("| CPU per item (median, ms) | server | client | runs (server/client) |")
        print("|---|---:|---:|---|")
        for name, values in cpu.items():
            srv = statistics.median(v[0] for v in values)
            clients = [v[1] for v in values if v[1] is not None]
            cli = f"{statistics.median(clients):.2f}" if clients else "n/a"
            runs = ", ".join(f"{v[0]:.2f}/{'n/a' if v[1] is None else f'{v[1]:.2f}'}"
                             for v in values)
            print(f"| {name} | {srv:.2f} | {cli} | {runs} |")
        print()
        print(f"file engine / ours at T=8: "
              f"{med['file engine T=8'] / med['ours (PostgreSQL) T=8']:.2f}x")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
