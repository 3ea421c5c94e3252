#!/usr/bin/env python3
"""Where a W2 item's PostgreSQL server CPU goes: a build-up from three bare
durable transactions to the engine's whole SQL, measured with pgbench.

    python3 scripts/pg_cost_buildup.py [--n 4000] [--repeats 3]

Starts a throwaway server as `compare_pg.py` does (its `Server`: `initdb`,
`pg_ctl`, fsync on) and runs, REPEATS times in turns, `pgbench -M prepared
-c 8 -j 2` on scripts of one W2 item each, reporting items/s and the
server's and pgbench's CPU per item (medians):

- `floor`: the issue's floor (`compare_pg.TWO_UPDATES`: two single-row
  `UPDATE` transactions);
- `skeleton`: the least any design with three durable transactions per item
  (enqueue, claim, finish) can do: an insert, then twice a row read `FOR
  UPDATE` and an update, each transaction's statements sent as pipelines of
  one `Sync` (`\\startpipeline`), on a table with a primary key and one
  partial index;
- `all off` .. `all on`: BASE_SQL below, the statements the engine ran for a
  W2 item at commit 2987fac (`compare_pg.OUR_SQL` of then), sent as the
  engine would with one `Sync` per round trip and without the wake-up, with
  every feature removed (`all off`), with one feature put back (`only +F`),
  and whole (`all on`). Features: `gate` (the writers' gate, the key's lock,
  the settings and the owner probe, one statement per transaction), `audit`
  (the pending events and their sealing), `rate` (the send times' writes),
  `head` (the claim's line read), `destlock` (the destination's lock in the
  enqueue and the claim), `indexes` (the six `items` indexes beyond the
  primary key, `enqueue_order`'s and the queued line's; removed with `DROP`
  on the schema the bench created).

- `all on (enqueue lock shared)`: `all on` with the enqueue's destination
  lock taken shared (`pg_advisory_xact_lock_shared`), as the engine takes
  it since the eighth pass (the claim's stays exclusive); and `only
  +destlock (enqueue lock shared)` likewise beside `only +destlock`.

- `all on (enqueue lock shared, three round trips)`: the same with the
  enqueue and the claim in three round trips each, as the engine sends them
  (the destination's lock, with the sequence or the line read, a round trip
  after the item's row; BASE_SQL sends each in two): against the line
  above, what taking the destination's lock in the opening round trip would
  save a client that sends one `Sync` per round trip.
- `all on (enqueue lock shared, claim in three round trips)`: the engine's
  shape since the eighth pass took the enqueue's lock in its opening round
  trip: only the claim's destination lock and line read a round trip after
  its row. Against `all on (enqueue lock shared)`, what a claim in two
  round trips (its destination guessed) would save.
- `all on (enqueue lock shared, finish's time in place)`: the same with the
  finish's send-time write (`DELETE` the claim's row, `INSERT` the send's
  `ON CONFLICT DO NOTHING`) replaced by one `UPDATE` of the row in place:
  what that would save at most (see docs/performance.md, "The finish's send-time
  write").

- `all on (enqueue lock shared, claim in three round trips) + LEVER`: the
  engine's shape of the ninth pass with one design lever applied, and with
  all of them (`+ all levers`, and `+ all levers but no send times`), to
  measure each before building it: `audit once` (the sealing appends narrow
  `(seq, hash, event id)` records and leaves the pending bodies where they
  are, instead of deleting them and writing each again), `enqueue in one
  round trip` (no read before a fresh key's insert: `ON CONFLICT DO
  NOTHING`, a taken key read after), `finish in one round trip` (the
  finish's update names the revision its claim wrote, with no read before
  it), `narrow writes` (the claim and the finish write the state's columns,
  not the document) and `no send times` (no `rate_times` writes at all).
- `… + hot claim` (alone, and with all five levers): the claim a HOT
  update, changing no indexed column: the claim owner's index dropped (an
  orphan scan would read the queued line), the claim keeping the row's
  times, `fillfactor = 70` on `items` so the new version fits its page. The
  share of `items` updates that were HOT is printed to stderr for every
  line, to check that a line does what it says.
- `all on (enqueue lock shared, claim in three round trips), K per
  transaction` (K = 2, 4, 8): K items' enqueues in one transaction, then
  their claims in one, then their finishes in one (one destination for the
  K), each item's statements as the engine sends them: what sharing a
  `COMMIT` among K items would save the server (items/s and CPU are per
  item).

- `enqueues alone` and `enqueues alone (enqueue lock shared)`: the W2
  item's enqueue transaction only (items/s are enqueues/s), with the
  destination's lock exclusive as before the eighth pass and shared as
  since; with `--destinations 1` every client enqueues to one destination.

`--destinations D` (default 50, W2's) spreads the items over D
destinations: with few of them the enqueues and claims of 8 clients meet on
the destinations' locks, which is what the shared mode changes. `--only
NAME;...` runs only the named lines (the floor and the skeleton included
only when named).

The schema each script runs on is created by the bench (`BENCH`, default
`target/release/examples/bench`, built with `--features postgres`) with one
item, so the tables are the engine's. The SQL is frozen here: a later
`compare_pg.OUR_SQL` describes the engine of its day; this script answers
"which feature costs what" for the statements of 2987fac.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare_pg as cp  # noqa: E402

BASE_SQL = r"""\set k random(1, 9000000000000000000)
\set d random(0, :destinations - 1)
\set seal random(1, :seal_one_in)
\set gate 11
\set owner 12
\startpipeline
BEGIN;
SELECT (SELECT doc FROM {s}.settings WHERE id = 1), pg_try_advisory_xact_lock_shared(:owner) FROM (SELECT pg_advisory_xact_lock_shared(:gate), pg_advisory_xact_lock(:k)) gate;
SELECT idempotency_key, revision, doc, seq FROM {s}.items WHERE idempotency_key = 'key-' || :k FOR UPDATE;
SELECT pg_advisory_xact_lock(-1 - :d);
\endpipeline
\startpipeline
WITH pended AS (INSERT INTO {s}.audit_pending (event) SELECT doc FROM unnest(ARRAY['{{"key":"key-' || :k || '","outcome":"queued","pad":"' || repeat('x', {event_pad}) || '"}}']::text[]) WITH ORDINALITY AS t(doc, n) ORDER BY n) INSERT INTO {s}.items (idempotency_key, revision, destination, state, claimed, claim_owner, next_attempt_at, transport_ref, doc, seq, created_at, updated_at) VALUES ('key-' || :k, 1, 'chat-' || :d, 'queued', false, NULL, NULL, NULL, '{{"key":"key-' || :k || '","state":"queued","pad":"' || repeat('x', {doc_pad}) || '"}}', nextval('{s}.enqueue_seq'), now(), now());
COMMIT;
\endpipeline
\startpipeline
BEGIN;
SELECT (SELECT doc FROM {s}.settings WHERE id = 1), pg_try_advisory_xact_lock_shared(:owner) FROM (SELECT pg_advisory_xact_lock_shared(:gate), pg_advisory_xact_lock(:k)) gate;
SELECT idempotency_key, revision, doc, seq FROM {s}.items WHERE idempotency_key = 'key-' || :k FOR UPDATE;
SELECT pg_advisory_xact_lock(-1 - :d);
SELECT h.idempotency_key, h.revision, h.doc, h.seq, t.keys, t.ats, (SELECT until FROM {s}.cooldowns WHERE destination = 'chat-' || :d) FROM (SELECT array_agg(idempotency_key ORDER BY at, idempotency_key) AS keys, array_agg(at ORDER BY at, idempotency_key) AS ats FROM {s}.rate_times WHERE destination = 'chat-' || :d AND at >= now() - interval '1 minute') t LEFT JOIN LATERAL (SELECT idempotency_key, revision, doc, seq FROM {s}.items WHERE destination = 'chat-' || :d AND state = 'queued' AND NOT (idempotency_key = ANY('{{}}'::text[])) ORDER BY seq, created_at, idempotency_key LIMIT 1) h ON true;
\endpipeline
\startpipeline
WITH gone AS (DELETE FROM {s}.rate_times WHERE idempotency_key = 'key-' || :k AND NOT (at = ANY(ARRAY[now()]) AND destination = 'chat-' || :d)), added AS (INSERT INTO {s}.rate_times (idempotency_key, destination, at) SELECT 'key-' || :k, 'chat-' || :d, t FROM unnest(ARRAY[now()]) AS t ON CONFLICT DO NOTHING) UPDATE {s}.items SET revision = revision + 1, destination = 'chat-' || :d, state = 'queued', claimed = true, claim_owner = 'owner-1', next_attempt_at = NULL, transport_ref = NULL, doc = '{{"key":"key-' || :k || '","state":"claimed","pad":"' || repeat('x', {doc_pad}) || '"}}', seq = seq, created_at = now(), updated_at = now() WHERE idempotency_key = 'key-' || :k AND revision = 1;
COMMIT;
\endpipeline
\startpipeline
BEGIN;
SELECT (SELECT doc FROM {s}.settings WHERE id = 1), pg_try_advisory_xact_lock_shared(:owner) FROM (SELECT pg_advisory_xact_lock_shared(:gate), pg_advisory_xact_lock(:k)) gate;
SELECT idempotency_key, revision, doc, seq FROM {s}.items WHERE idempotency_key = 'key-' || :k FOR UPDATE;
\endpipeline
\startpipeline
WITH gone AS (DELETE FROM {s}.rate_times WHERE idempotency_key = 'key-' || :k AND NOT (at = ANY(ARRAY[now()]) AND destination = 'chat-' || :d)), added AS (INSERT INTO {s}.rate_times (idempotency_key, destination, at) SELECT 'key-' || :k, 'chat-' || :d, t FROM unnest(ARRAY[now()]) AS t ON CONFLICT DO NOTHING), pended AS (INSERT INTO {s}.audit_pending (event) SELECT doc FROM unnest(ARRAY['{{"key":"key-' || :k || '","outcome":"sent","pad":"' || repeat('x', {event_pad}) || '"}}']::text[]) WITH ORDINALITY AS t(doc, n) ORDER BY n) UPDATE {s}.items SET revision = revision + 1, destination = 'chat-' || :d, state = 'sent', claimed = false, claim_owner = NULL, next_attempt_at = NULL, transport_ref = 'tr-' || :k, doc = '{{"key":"key-' || :k || '","state":"sent","pad":"' || repeat('x', {doc_pad}) || '"}}', seq = seq, created_at = now(), updated_at = now() WHERE idempotency_key = 'key-' || :k AND revision = 2;
COMMIT;
\endpipeline
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

SKELETON = r"""\set k random(1, 9000000000000000000)
\set d random(0, :destinations - 1)
\startpipeline
BEGIN;
INSERT INTO sk VALUES ('key-' || :k, 'chat-' || :d, 'queued', :k, repeat('x', 800));
COMMIT;
\endpipeline
\startpipeline
BEGIN;
SELECT state, doc FROM sk WHERE k = 'key-' || :k FOR UPDATE;
\endpipeline
\startpipeline
UPDATE sk SET state = 'claimed', doc = repeat('y', 800) WHERE k = 'key-' || :k;
COMMIT;
\endpipeline
\startpipeline
BEGIN;
SELECT state, doc FROM sk WHERE k = 'key-' || :k FOR UPDATE;
\endpipeline
\startpipeline
UPDATE sk SET state = 'sent', doc = repeat('z', 800) WHERE k = 'key-' || :k;
COMMIT;
\endpipeline
"""
SKELETON_TABLE = """CREATE TABLE IF NOT EXISTS sk (k text PRIMARY KEY, dest text NOT NULL,
    state text NOT NULL, seq bigint NOT NULL, doc text NOT NULL);
CREATE INDEX IF NOT EXISTS sk_q ON sk (dest, seq) WHERE state = 'queued';"""

GATE = ("SELECT (SELECT doc FROM {s}.settings WHERE id = 1), pg_try_advisory_xact_lock_shared(:owner) "
        "FROM (SELECT pg_advisory_xact_lock_shared(:gate), pg_advisory_xact_lock(:k)) gate;\n")
EVENT = ("(INSERT INTO {s}.audit_pending (event) SELECT doc FROM unnest(ARRAY['{{\"key\":\"key-' || :k "
         "|| '\",\"outcome\":\"%s\",\"pad\":\"' || repeat('x', {event_pad}) || '\"}}']::text[]) "
         "WITH ORDINALITY AS t(doc, n) ORDER BY n)")
RATE = ("WITH gone AS (DELETE FROM {s}.rate_times WHERE idempotency_key = 'key-' || :k AND NOT "
        "(at = ANY(ARRAY[now()]) AND destination = 'chat-' || :d)), added AS (INSERT INTO "
        "{s}.rate_times (idempotency_key, destination, at) SELECT 'key-' || :k, 'chat-' || :d, t "
        "FROM unnest(ARRAY[now()]) AS t ON CONFLICT DO NOTHING)")

MOVED = ("WITH moved AS (UPDATE {s}.rate_times SET at = now() WHERE idempotency_key = 'key-' || :k "
         "AND destination = 'chat-' || :d)")


def without(feature, sql):
    """BASE_SQL (or what is left of it) without `feature`."""
    if feature == "gate":
        out = sql.replace(GATE, "")
    elif feature == "audit":
        out = sql.replace("WITH pended AS " + EVENT % "queued" + " ", "")
        out = out.replace(", pended AS " + EVENT % "sent", "")
        out = out.split("\\if :seal = 1")[0]
    elif feature == "rate":
        out = sql.replace(RATE + " UPDATE", "UPDATE").replace(RATE + ", pended", "WITH pended")
    elif feature == "head":
        out = "\n".join(l for l in sql.splitlines() if not l.startswith("SELECT h.idempotency_key"))
    elif feature == "destlock":
        out = "\n".join(l for l in sql.splitlines() if l != "SELECT pg_advisory_xact_lock(-1 - :d);")
    else:
        return sql
    if out == sql:
        sys.exit(f"the feature {feature!r} was not found in the SQL: the script is out of date")
    return out


FEATURES = ["gate", "audit", "rate", "head", "destlock", "indexes"]


def variant(on, shared_enqueue_lock=False, three_round_trips=False, times_in_place=False,
            claim_three_round_trips=False):
    sql = BASE_SQL
    for feature in FEATURES:
        if feature not in on:
            sql = without(feature, sql)
    if claim_three_round_trips:
        # Only the claim's destination lock (the second) a round trip after
        # its row's: the engine since the eighth pass's enqueue change.
        lock = "SELECT pg_advisory_xact_lock(-1 - :d);\n"
        if sql.count(lock) != 2:
            sys.exit("the destination locks were not found: the script is out of date")
        first = sql.index(lock) + len(lock)
        sql = sql[:first] + sql[first:].replace(lock, "\\endpipeline\n\\startpipeline\n" + lock, 1)
    if three_round_trips:
        # The engine's shape: the destination's lock (with the enqueue's
        # sequence, or the claim's line read) a round trip after the row's.
        lock = "SELECT pg_advisory_xact_lock(-1 - :d);\n"
        if sql.count(lock) != 2:
            sys.exit("the destination locks were not found: the script is out of date")
        sql = sql.replace(lock, "\\endpipeline\n\\startpipeline\n" + lock)
    if times_in_place:
        # The finish's send time written over the claim's, in place.
        if sql.count(RATE + ", pended") != 1:
            sys.exit("the finish's send-time write was not found: the script is out of date")
        sql = sql.replace(RATE + ", pended", MOVED + ", pended")
    if shared_enqueue_lock:
        # The enqueue's lock is the first; the claim's, the second, stays.
        lock = "SELECT pg_advisory_xact_lock(-1 - :d);"
        if sql.count(lock) != 2:
            sys.exit("the enqueue's and the claim's destination locks were not found: "
                     "the script is out of date")
        sql = sql.replace(lock, "SELECT pg_advisory_xact_lock_shared(-1 - :d);", 1)
    return sql, "indexes" not in on


FOR_UPDATE = ("SELECT idempotency_key, revision, doc, seq FROM {s}.items WHERE idempotency_key "
              "= 'key-' || :k FOR UPDATE;\n")
BREAK = "\\endpipeline\n\\startpipeline\n"
SEALING = ("WITH d AS (DELETE FROM {s}.audit_pending WHERE id IN (SELECT id FROM {s}.audit_pending "
           "ORDER BY id LIMIT 1000) RETURNING id, event) SELECT count(*) AS n FROM d \\gset\n"
           "\\set tail :head + :n\n")
SEALED = ("WITH sealed AS (INSERT INTO {s}.audit (seq, hash, line) SELECT * FROM unnest(ARRAY(SELECT "
          ":head + g FROM generate_series(1, :n) g), ARRAY(SELECT repeat('h', 64) FROM "
          "generate_series(1, :n)), ARRAY(SELECT repeat('x', {line_len}) FROM generate_series(1, "
          ":n)))) UPDATE {s}.audit_head SET seq = :tail, hash = repeat('h', 64) WHERE id = 1;\n")
# Audit events stored once: the sealing leaves the pending bodies where they
# are and appends narrow (seq, hash, event id) records after the head.
SEALING_ONCE = ("WITH sealed AS (INSERT INTO {s}.audit_seal (seq, hash, event_id) SELECT :head + "
                "row_number() OVER (ORDER BY id), repeat('h', 64), id FROM {s}.audit_pending WHERE "
                "id > :head ORDER BY id LIMIT 1000 RETURNING seq) SELECT coalesce(max(seq), :head) "
                "AS tail FROM sealed \\gset\n"
                "UPDATE {s}.audit_head SET seq = :tail, hash = repeat('h', 64) WHERE id = 1;\n")
AUDIT_SEAL_TABLE = ("CREATE TABLE IF NOT EXISTS {s}.audit_seal (seq bigint PRIMARY KEY, "
                    "hash text NOT NULL, event_id bigint NOT NULL)")
LEVERS = ["audit once", "enqueue in one round trip", "finish in one round trip",
          "narrow writes", "no send times"]
# A claim that is a HOT update: it changes no indexed column (the claim
# owner's index dropped: an orphan scan would read the queued line instead;
# the times it keeps), on pages with room for the new version.
HOT_CLAIM_SETUP = ("DROP INDEX {s}.items_claim_owner_idx; "
                   "ALTER TABLE {s}.items SET (fillfactor = 70)")
CLAIM_TIMES = ("created_at = now(), updated_at = now() WHERE idempotency_key = 'key-' || :k "
               "AND revision = 1;")


def replace_once(sql, old, new, what):
    if sql.count(old) < 1:
        sys.exit(f"{what} was not found: the script is out of date")
    return sql.replace(old, new, 1)


def design(levers):
    """Today's shape (`all on (enqueue lock shared, claim in three round
    trips)`) with the named design levers applied: what each would save
    before it is built."""
    sql, _ = variant(set(FEATURES), True, False, False, True)
    if "no send times" in levers:
        sql = without("rate", sql)
    if "audit once" in levers:
        sql = replace_once(sql, SEALING + SEALED, SEALING_ONCE, "the sealing")
    if "narrow writes" in levers:
        # The claim and the finish write the state's columns, not the document.
        for state in ("claimed", "sent"):
            doc = (" doc = '{{\"key\":\"key-' || :k || '\",\"state\":\"%s\",\"pad\":\"' || "
                   "repeat('x', {doc_pad}) || '\"}}',") % state
            sql = replace_once(sql, doc, "", f"the {state} document")
    if "finish in one round trip" in levers:
        # The finish's update names the revision its claim wrote: no read
        # before it (a lost claim shows as no row updated, then read).
        at = sql.rindex(FOR_UPDATE)
        sql = sql[:at] + sql[at:].replace(FOR_UPDATE + BREAK, "", 1)
        if FOR_UPDATE + BREAK in sql[at:]:
            sys.exit("the finish's read was not found: the script is out of date")
    if "enqueue in one round trip" in levers:
        # A fresh key's insert needs no read before it (ON CONFLICT DO
        # NOTHING; a key already there is read after, in a second look).
        head = sql.index(FOR_UPDATE)
        first_break = sql.index(BREAK, head)
        sql = sql[:head] + sql[head + len(FOR_UPDATE):first_break] + sql[first_break + len(BREAK):]
        sql = replace_once(sql, "now(), now());\nCOMMIT;", "now(), now()) ON CONFLICT DO NOTHING;\nCOMMIT;",
                           "the enqueue's insert")
    if "hot claim" in levers:
        sql = replace_once(sql, CLAIM_TIMES, CLAIM_TIMES.replace(
            "created_at = now(), updated_at = now()",
            "created_at = created_at, updated_at = updated_at"), "the claim's times")
        return sql, HOT_CLAIM_SETUP
    return sql, False


def batched(k):
    """Today's shape with `k` items per transaction (see the module's doc)."""
    sql, _ = variant(set(FEATURES), True, False, False, True)
    head, rest = sql.split("\\startpipeline\n", 1)
    body, seal = ("\\startpipeline\n" + rest).split("\\if :seal = 1", 1)
    phases = body.split("COMMIT;\n")
    if len(phases) != 4:
        sys.exit("the three transactions were not found: the script is out of date")
    phases.pop()
    head = head.replace("\\set k random(1, 9000000000000000000)\n", "".join(
        f"\\set k{j} random(1, 9000000000000000000)\n" for j in range(k)))
    out = head
    for phase in phases:
        phase = phase.removeprefix("\\endpipeline\n")
        for j in range(k):
            part = re.sub(r":k\b", f":k{j}", phase)
            if j > 0:
                part = part.replace("BEGIN;\n", "", 1)
            out += part + ("\\endpipeline\n" if j < k - 1 else "COMMIT;\n\\endpipeline\n")
    return out + "\\if :seal = 1" + seal, False, k


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--destinations", type=int, default=50)
    ap.add_argument("--only", default="", help="line names to run, separated by ;")
    args = ap.parse_args()
    bench = os.environ.get("BENCH", cp.BENCH)
    variants = {"floor": None, "skeleton": None, "all off": variant(set())}
    variants.update({f"only +{f}": variant({f}) for f in FEATURES})
    variants["only +destlock (enqueue lock shared)"] = variant({"destlock"}, True)
    variants["all on"] = variant(set(FEATURES))
    variants["all on (enqueue lock shared)"] = variant(set(FEATURES), True)
    variants["all on (enqueue lock shared, three round trips)"] = variant(
        set(FEATURES), True, True)
    variants["all on (enqueue lock shared, claim in three round trips)"] = variant(
        set(FEATURES), True, False, False, True)
    variants["all on (enqueue lock shared, finish's time in place)"] = variant(
        set(FEATURES), True, False, True)
    # Enqueues alone (the first two pipelines of the W2 item): what the
    # destination lock's mode changes where it binds, many clients
    # enqueueing to few destinations (`--destinations 1`).
    whole = variant(set(FEATURES))[0]
    enqueue_only = whole[:whole.index("\\endpipeline\n", whole.index("\\endpipeline\n") + 1)]
    enqueue_only += "\\endpipeline\n"
    variants["enqueues alone"] = (enqueue_only, False)
    variants["enqueues alone (enqueue lock shared)"] = (
        enqueue_only.replace("SELECT pg_advisory_xact_lock(-1 - :d);",
                             "SELECT pg_advisory_xact_lock_shared(-1 - :d);"), False)
    today = "all on (enqueue lock shared, claim in three round trips)"
    for lever in LEVERS:
        variants[f"{today} + {lever}"] = design({lever})
    variants[f"{today} + all levers"] = design(set(LEVERS))
    variants[f"{today} + all levers but no send times"] = design(set(LEVERS) - {"no send times"})
    variants[f"{today} + hot claim"] = design({"hot claim"})
    variants[f"{today} + hot claim + all levers"] = design(set(LEVERS) | {"hot claim"})
    for k in (2, 4, 8):
        variants[f"{today}, {k} per transaction"] = batched(k)
    if args.only:
        names = [name.strip() for name in args.only.split(";")]
        unknown = [name for name in names if name not in variants]
        if unknown:
            sys.exit(f"unknown lines {unknown}; known: {list(variants)}")
        variants = {name: variants[name] for name in names}
    server = cp.Server("/tmp")
    results = {}
    try:
        server.tool("pgbench", "-i", "-s", "1", "-q", "-h", "127.0.0.1", "-p", str(server.port),
                    "-U", "postgres", "bench", quiet=True)
        server.psql("bench", SKELETON_TABLE)
        count = 0
        for _ in range(args.repeats):
            for name, spec in variants.items():
                count += 1
                path = os.path.join(server.root, f"v{count}.sql")
                mode = "prepared"
                per_txn = 1
                if name == "floor":
                    text, mode = cp.TWO_UPDATES, "simple"
                elif name == "skeleton":
                    text = SKELETON
                else:
                    sql, drop_indexes, *per = spec
                    per_txn = per[0] if per else per_txn
                    schema = f"b{count}"
                    subprocess.run([bench, "--workload", "w2", "--threads", "1", "--n", "1",
                                    "--destinations", str(args.destinations),
                                    "--postgres", server.url(),
                                    "--schema", schema], check=True, capture_output=True)
                    if isinstance(drop_indexes, str):
                        server.psql("bench", drop_indexes.format(s=f'"{schema}"'))
                    elif drop_indexes:
                        server.psql("bench", f"""DO $$ DECLARE i text; BEGIN
                            ALTER TABLE {schema}.items DROP CONSTRAINT IF EXISTS items_enqueue_order_key;
                            FOR i IN SELECT format('%I.%I', schemaname, indexname) FROM pg_indexes
                              WHERE schemaname = '{schema}' AND tablename = 'items'
                                AND indexname NOT LIKE '%pkey'
                                AND indexdef NOT LIKE '%(destination, seq, created_at, idempotency_key)%'
                            LOOP EXECUTE 'DROP INDEX ' || i; END LOOP; END $$""")
                    server.psql("bench", AUDIT_SEAL_TABLE.format(s=f'"{schema}"'))
                    text = sql.format(s=f'"{schema}"', chan=f"durable_outbox_{schema}",
                                      doc_pad=760, event_pad=500, line_len=610)
                with open(path, "w") as f:
                    f.write(text)
                server.psql("bench", "CHECKPOINT")
                _, tps, server_s, client_s = server.pgbench(
                    "-M", mode, "-c", "8", "-j", "2", "-t", str(args.n // 8 // per_txn),
                    "-D", f"destinations={args.destinations}", "-D",
                    f"seal_one_in={max(1, 10 // per_txn)}",
                    "-f", path)
                if name not in ("floor", "skeleton"):
                    # Whether the claims and finishes were HOT updates (stderr).
                    hot = server.psql("bench", "SELECT n_tup_upd, n_tup_hot_upd FROM "
                                      "pg_stat_user_tables WHERE schemaname = "
                                      f"'b{count}' AND relname = 'items'")
                    print(f"  items updates, HOT: {hot}", file=sys.stderr)
                row = (tps * per_txn, 1000 * server_s / args.n, 1000 * client_s / args.n)
                results.setdefault(name, []).append(row)
                print(name, ["%.2f" % x for x in row], file=sys.stderr, flush=True)
    finally:
        server.stop()
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end, "
          f"N = {args.n}, 8 clients, {args.destinations} destinations, "
          f"medians of {args.repeats}\n")
    print("| script | items/s | server CPU ms/item | pgbench CPU ms/item |")
    print("|---|---:|---:|---:|")
    for name, rows in results.items():
        med = [statistics.median(r[i] for r in rows) for i in range(3)]
        print(f"| {name} | {med[0]:,.0f} | {med[1]:.2f} | {med[2]:.2f} |")


if __name__ == "__main__":
    main()
