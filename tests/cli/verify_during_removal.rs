//! `verify` while an operator removes old audit records: a removal that
//! commits while the tool reads the chain record by record takes records it
//! has not reached (a PostgreSQL page, a sealed segment file), which is not
//! damage. The tool reads again once it sees that the chain now starts past
//! the hole, and verifies; a hole the chain's start does not explain is
//! still reported (a segment deleted by hand from the middle). Each test holds the tool at the exact point between two
//! pages or files with a pause failpoint (`DURABLE_OUTBOX_FAILPOINTS`), and
//! removes while it waits.

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use durable_outbox::Outbox;

use crate::harness::{Run, command, finished, in_three_sealed_segments};

/// Far beyond what each wait needs.
const LIMIT: Duration = Duration::from_secs(120);

/// Waits for `path` to exist, failing the test (naming `what`) after [`LIMIT`].
fn until_exists(path: &Path, what: &str) {
    let began = Instant::now();
    while !path.exists() {
        assert!(began.elapsed() < LIMIT, "{what}: not after {LIMIT:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs `verify LOCATION` held at failpoint `point`'s pause on its `hit`-th
/// hit; while it waits there, runs `during`; then lets it go on.
fn verify_while(location: &str, point: &str, hit: u32, during: impl FnOnce()) -> Run {
    let pauses = tempfile::tempdir().unwrap();
    let child: Child = command(["verify", location])
        .env("DURABLE_OUTBOX_FAILPOINTS", format!("{point}=pause@{hit}"))
        .env("DURABLE_OUTBOX_FAILPOINT_DIR", pauses.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    until_exists(
        &pauses.path().join(format!("{point}.paused")),
        "verify reaches the point between two reads of the chain",
    );
    during();
    std::fs::write(pauses.path().join(format!("{point}.resume")), b"").unwrap();
    let (done, output) = mpsc::channel();
    std::thread::spawn(move || done.send(child.wait_with_output()));
    let output = output
        .recv_timeout(LIMIT)
        .expect("verify during a removal of old audit records finishes")
        .unwrap();
    finished(&output)
}

/// Asserts that `run` verified an outbox whose old records were removed.
fn verified_after_removal(run: &Run) {
    run.exits(0)
        .says("verified")
        .says("have no record in the chain: their records were in the old audit history");
}

/// A file outbox with three sealed segments and the active file.
fn three_segments(dir: &Path) -> Outbox {
    in_three_sealed_segments(Outbox::builder(dir))
}

/// The sealed segments of a file outbox made by [`three_segments`] and
/// closed, oldest first.
fn sealed_segments(dir: &Path) -> Vec<PathBuf> {
    drop(three_segments(dir));
    let mut segments: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("audit-")
        })
        .collect();
    segments.sort();
    assert!(segments.len() >= 3, "{segments:?}");
    segments
}

/// Removes all but the newest segment; returns the chain's first seq after.
fn remove_old(outbox: &Outbox) -> u64 {
    let removed = outbox
        .remove_old_audit_segments(1, "ops", "older than a year")
        .unwrap();
    assert!(removed >= 1, "segments were removed");
    outbox.audit_records().unwrap().next().unwrap().unwrap().seq
}

#[test]
fn a_removal_that_deletes_segments_while_verify_reads_them_is_read_again_not_reported() {
    let dir = tempfile::tempdir().unwrap();
    let outbox = three_segments(dir.path());
    // Held before the tool opens its second file; the removal deletes it.
    let run = verify_while(dir.path().to_str().unwrap(), "audit.next_file", 1, || {
        let first = remove_old(&outbox);
        assert!(first > 1, "the chain now starts at {first}");
    });
    verified_after_removal(&run);
}

#[test]
fn a_segment_deleted_by_hand_while_verify_reads_is_still_reported() {
    let dir = tempfile::tempdir().unwrap();
    let segments = sealed_segments(dir.path());
    // The chain's start stays: the hole is damage, whenever it was made.
    let run = verify_while(dir.path().to_str().unwrap(), "audit.next_file", 1, || {
        std::fs::remove_file(&segments[1]).unwrap();
    });
    run.exits(1).says("sequence gap").says("NOT VERIFIED");
}

/// A front cut made by hand (the oldest segments deleted, no removal record
/// naming the new start) while the tool reads looks, to the cross-check,
/// like a removal that committed meanwhile: the chain now starts past the
/// hole. Reading again must not launder it: the chain read again has no
/// record of its removal, and the tool says NOT VERIFIED.
#[test]
fn a_front_cut_by_hand_while_verify_reads_is_still_reported() {
    let dir = tempfile::tempdir().unwrap();
    let segments = sealed_segments(dir.path());
    let run = verify_while(dir.path().to_str().unwrap(), "audit.next_file", 1, || {
        std::fs::remove_file(&segments[0]).unwrap();
        std::fs::remove_file(&segments[1]).unwrap();
    });
    run.exits(1).says("NOT VERIFIED");
}

#[cfg(feature = "postgres")]
#[test]
fn a_removal_that_commits_while_verify_reads_the_chain_is_read_again_not_reported() {
    let Some(server) = crate::pg_server::PgServer::shared() else {
        return;
    };
    let db = server.database();
    let url = db.url();
    // More records than the tool reads in one page (1,000).
    let outbox = crate::verify_postgres::outbox_with(&url, 1_100);
    // Held before the tool reads its second page; the removal takes the
    // records it would read next.
    let run = verify_while(&url, "postgres.audit_page", 2, || {
        let first = remove_old(&outbox);
        assert!(
            first > 1_001,
            "the removal took the record the tool reads next (the chain starts at {first})"
        );
    });
    verified_after_removal(&run);
}
