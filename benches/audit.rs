//! Audit-log benchmark: is appending O(1) in the log's size, and how fast is `verify`?
//!
//! `cargo bench --bench audit [-- --records N]` (default 200,000).
//!
//! The large log is written by this program itself, following the canonical form
//! documented in the `audit` module (an independent writer), next to an
//! `outbox.json` that records its head. Then it measures, in one run:
//! - `AuditLog::verify` over the whole log (records/s);
//! - `Outbox::open`, which verifies the log too;
//! - the median `enqueue` latency with an empty log and with the large log. The
//!   state is equally small in both, so any difference is the log's size.

#![allow(
    clippy::unwrap_used,
    reason = "a benchmark stops loudly on any failure"
)]

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use durable_outbox::{AuditLog, NewMessage, Outbox};
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

fn write_synthetic_log(dir: &Path, records: u64) -> (u64, String) {
    let mut out = std::io::BufWriter::new(std::fs::File::create(dir.join("audit.jsonl")).unwrap());
    let mut prev = "0".repeat(64);
    for seq in 1..=records {
        let mut record: Map<String, Value> = json!({
            "attempts": seq % 3, "audit_id": format!("{seq:032x}"), "connector": "telegram",
            "content_hash": hex::encode(Sha256::digest(seq.to_le_bytes())), "destination": format!("chat-{}", seq % 50),
            "direction": "outbound", "error_code": null, "grant_id": "grant-1",
            "idempotency_key": format!("key-{seq:08}"), "lane": "outbound-telegram", "note": null,
            "outcome": if seq % 2 == 0 { "sent" } else { "queued" }, "prev_hash": prev, "reconciled": false,
            "recorded_at_utc": "2026-01-15T09:00:00.000000Z", "risk_class": null, "seq": seq,
            "transport_ref": null,
        })
        .as_object()
        .unwrap()
        .clone();
        let hash = hex::encode(Sha256::digest(serde_json::to_vec(&record).unwrap()));
        record.insert("hash".into(), Value::String(hash.clone()));
        serde_json::to_writer(&mut out, &record).unwrap();
        out.write_all(b"\n").unwrap();
        prev = hash;
    }
    out.flush().unwrap();
    let state = json!({"version": 2, "audit_head": {"seq": records, "hash": prev}, "items": []});
    std::fs::write(dir.join("outbox.json"), serde_json::to_vec(&state).unwrap()).unwrap();
    (records, prev)
}

/// Enqueues `n` messages into each outbox, alternating between them so both see
/// the same disk noise, and returns each one's median latency.
fn median_enqueues(outboxes: [&Outbox; 2], n: usize) -> [Duration; 2] {
    let mut times = [Vec::with_capacity(n), Vec::with_capacity(n)];
    for i in 0..n {
        for (which, outbox) in outboxes.iter().enumerate() {
            let message = NewMessage {
                idempotency_key: format!("k-{i}"),
                connector: "telegram".into(),
                grant_id: "grant-1".into(),
                destination: format!("chat-{}", i % 50),
                content: "x".repeat(200),
                ..Default::default()
            };
            let start = Instant::now();
            outbox.enqueue(message).unwrap();
            times[which].push(start.elapsed());
        }
    }
    times.map(|mut t| {
        t.sort();
        t[n / 2]
    })
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let records = args
        .iter()
        .position(|a| a == "--records")
        .and_then(|i| args.get(i + 1))
        .and_then(|n| n.parse().ok())
        .unwrap_or(200_000u64);
    let samples = 200;

    let big_dir = tempfile::tempdir().unwrap();
    write_synthetic_log(big_dir.path(), records);
    let bytes = std::fs::metadata(big_dir.path().join("audit.jsonl"))
        .unwrap()
        .len();

    let start = Instant::now();
    let report = AuditLog::verify(big_dir.path().join("audit.jsonl")).unwrap();
    let verify = start.elapsed();
    assert_eq!(report.records, records);

    let start = Instant::now();
    let big = Outbox::open(big_dir.path()).unwrap();
    let open = start.elapsed();
    let empty_dir = tempfile::tempdir().unwrap();
    let empty = Outbox::open(empty_dir.path()).unwrap();
    let [small, large] = median_enqueues([&empty, &big], samples);
    big.verify_audit().unwrap();

    println!(
        "{}",
        json!({
            "bench": "audit",
            "records": records,
            "log_bytes": bytes,
            "verify_s": verify.as_secs_f64(),
            "verify_records_per_s": (records as f64 / verify.as_secs_f64()).round(),
            "open_s": open.as_secs_f64(),
            "enqueue_median_us_empty_log": small.as_micros(),
            "enqueue_median_us_large_log": large.as_micros(),
            "large_over_empty": (large.as_secs_f64() / small.as_secs_f64() * 100.0).round() / 100.0,
        })
    );
}
