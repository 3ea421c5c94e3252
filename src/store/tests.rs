//! The on-disk format: round trips, the seed's format, and refusals.

use std::path::Path;

use super::{Loaded, State, Store, decode, encode};
use crate::failpoint::Failpoints;

const SEED: &str = include_str!("../../fixtures/seed-v1/outbox.json");

fn path() -> &'static Path {
    Path::new("outbox.json")
}

#[test]
fn the_seed_file_decodes_and_round_trips_through_version_2() {
    let state = decode(path(), SEED.as_bytes()).unwrap();
    assert_eq!(state.items.len(), 7);
    let again = decode(path(), &encode(&state)).unwrap();
    assert_eq!(again.items, state.items);
    assert!(again.audit_head.is_none());
}

#[test]
fn encoding_is_sorted_pretty_and_newline_terminated() {
    let state = decode(path(), SEED.as_bytes()).unwrap();
    let text = String::from_utf8(encode(&state)).unwrap();
    assert!(text.ends_with("}\n"));
    assert!(text.starts_with("{\n  \"version\": 2,"));
    let keys: Vec<_> = text
        .match_indices("\"idempotency_key\": ")
        .map(|(i, _)| &text[i + 19..i + 32])
        .collect();
    let mut sorted = keys.clone();
    sorted.sort_unstable();
    assert_eq!(keys, sorted);
}

#[test]
fn an_empty_state_encodes_without_optional_fields() {
    let text = String::from_utf8(encode(&State::default())).unwrap();
    assert!(!text.contains("audit_head"));
    assert!(decode(path(), text.as_bytes()).unwrap().items.is_empty());
}

#[test]
fn duplicate_keys_are_refused() {
    let value: serde_json::Value = serde_json::from_str(SEED).unwrap();
    let mut items = value["items"].as_array().unwrap().clone();
    items.push(items[0].clone());
    let doubled = serde_json::json!({"version": 1, "items": items});
    let err = decode(path(), doubled.to_string().as_bytes()).unwrap_err();
    assert!(
        err.to_string().contains("duplicate idempotency_key"),
        "{err}"
    );
}

#[test]
fn version_zero_and_future_versions_are_refused() {
    for version in [0, 3, 99] {
        let text = format!(r#"{{"version": {version}, "items": []}}"#);
        assert!(matches!(
            decode(path(), text.as_bytes()),
            Err(crate::Error::UnsupportedVersion { version: v, .. }) if v == version
        ));
    }
}

/// A journal store in a fresh directory (kept while the returned guard
/// lives), and failpoints for its writes, none armed.
fn fresh_store() -> (tempfile::TempDir, Store, Failpoints) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::new(dir.path());
    (dir, store, Failpoints::none())
}

/// Loads the writer's state `ours` of `store` and commits one entry (synced)
/// with it; returns the loaded state.
fn with_one_entry<'a>(
    store: &Store,
    ours: &'a mut Option<Loaded>,
    faults: &Failpoints,
) -> &'a mut Loaded {
    let loaded = store.refresh(ours).unwrap();
    store.commit(loaded, Vec::new(), &[], faults).unwrap();
    loaded
}

/// A transaction whose journal cannot grow (a full disk), or whose growth
/// cannot be synced, fails alone and cleanly: nothing of its entry may stay
/// behind for the group's write, or the next entry would follow it with the
/// same sequence number.
#[test]
fn a_failed_journal_extension_leaves_nothing_of_its_entry_for_the_next_write() {
    for point in ["journal.extend", "journal.extend_sync"] {
        a_failed_growth_leaves_nothing_of_its_entry(point);
    }
}

fn a_failed_growth_leaves_nothing_of_its_entry(point: &str) {
    use super::CommitFailure;
    use crate::failpoint::FailAction;
    let (_dir, store, faults) = fresh_store();
    faults.arm(point, FailAction::ErrorOnHit(1));
    let mut ours = None;
    let loaded = store.refresh(&mut ours).unwrap();
    let mut appended = 0u64;
    loop {
        match store.append_unsynced(loaded, None, Vec::new(), &[], &faults) {
            Ok(()) => appended += 1,
            Err((failure, e)) => {
                assert_eq!(failure, CommitFailure::Clean, "{e}");
                break;
            }
        }
        assert!(
            appended < 1_000_000,
            "{point}: the journal never had to grow"
        );
    }
    // The next entry grows the file and takes the failed one's place.
    store
        .append_unsynced(loaded, None, Vec::new(), &[], &faults)
        .unwrap();
    appended += 1;
    loaded.take_unsynced().unwrap().write(&faults).unwrap();
    let mut theirs = None;
    let reread = store.refresh(&mut theirs).unwrap();
    assert_eq!(
        reread.cursor.as_ref().map(|c| c.next_seq - 1),
        Some(appended),
        "{point}: the journal does not hold exactly the entries that were appended"
    );
    assert_eq!(faults.hits(point), 2, "{point}: not reached by each growth");
}

/// A synchronous commit (settings, an audit prune, compaction's record)
/// while a group's entries are still unwritten writes them ahead of its own,
/// each where it belongs: a reload finds all of them, in order.
#[test]
fn a_synchronous_commit_writes_the_unwritten_entries_ahead_of_its_own() {
    let (_dir, store, faults) = fresh_store();
    let mut ours = None;
    // One entry already written and synced, two left unwritten by a group.
    let loaded = with_one_entry(&store, &mut ours, &faults);
    for _ in 0..2 {
        store
            .append_unsynced(loaded, None, Vec::new(), &[], &faults)
            .unwrap();
    }
    store.commit(loaded, Vec::new(), &[], &faults).unwrap();
    let mut theirs = None;
    let reread = store.refresh(&mut theirs).unwrap();
    assert_eq!(reread.cursor.as_ref().map(|c| c.next_seq), Some(5));
    assert_eq!(
        reread.cursor.as_ref().map(|c| c.offset),
        loaded.cursor.as_ref().map(|c| c.offset),
        "the entries on disk end where the writer's do"
    );
}

/// Entries appended for a commit group that its leader never wrote (the
/// group failed, the handle is poisoned) leave the cached state ahead of the
/// files: a refresh must read the files afresh. Keeping them would make the
/// next synchronous commit write them ahead of its own entry, so a change
/// whose caller was told it failed would become durable after all.
#[test]
fn a_refresh_forgets_entries_that_were_never_written() {
    let (_dir, store, faults) = fresh_store();
    let mut ours = None;
    let loaded = with_one_entry(&store, &mut ours, &faults);
    // A group's entry, appended, never written.
    store
        .append_unsynced(loaded, None, Vec::new(), &[], &faults)
        .unwrap();
    let loaded = store.refresh(&mut ours).unwrap();
    assert_eq!(
        loaded.cursor.as_ref().map(|c| c.next_seq),
        Some(2),
        "the refreshed state still counts the entry that was never written"
    );
    store.commit(loaded, Vec::new(), &[], &faults).unwrap();
    let mut theirs = None;
    let reread = store.refresh(&mut theirs).unwrap();
    assert_eq!(
        reread.cursor.as_ref().map(|c| c.next_seq - 1),
        Some(2),
        "the journal holds the entry that was never written (or lost a committed one)"
    );
}

/// A header whose newline was damaged runs on into the entry after it: the
/// first "line" is the header and an acknowledged entry, and no whole line
/// follows. The journal alone must call that damage (an error naming it),
/// not a lone bad header to be set aside: setting it aside would drop the
/// acknowledged entry from the state, and nothing else may catch it (an
/// entry whose audit records a power cut lost, or one that carries none).
#[test]
fn a_damaged_header_running_into_an_entry_is_an_error_not_a_lone_bad_header() {
    let (dir, store, faults) = fresh_store();
    let mut ours = None;
    with_one_entry(&store, &mut ours, &faults);
    drop(ours);
    let journal = dir.path().join("outbox.journal");
    let mut bytes = std::fs::read(&journal).unwrap();
    let header_end = bytes.iter().position(|b| *b == b'\n').unwrap();
    assert_ne!(bytes[header_end + 1], 0, "no entry after the header");
    bytes[header_end] = b'x';
    std::fs::write(&journal, &bytes).unwrap();
    let mut theirs = None;
    let err = store
        .refresh(&mut theirs)
        .map(|loaded| store.settle_torn(loaded))
        .expect_err("a header running into an acknowledged entry was judged a lone bad header");
    assert!(
        err.to_string().contains("outbox.journal"),
        "the error does not name the journal: {err}"
    );
    assert_eq!(
        std::fs::read(&journal).unwrap(),
        bytes,
        "the damaged journal was changed"
    );
}

/// A growth whose sync failed is not left on the file: the file's length is
/// what the last synced growth made it. Otherwise another handle (another
/// process, or this one after a reload) takes the length as allocated,
/// writes entries into zeros that were never made durable, and never syncs
/// them as a growth: after a power cut the blocks past its entries may read
/// as old disk contents, which a load takes for damage.
#[test]
fn a_growth_whose_sync_failed_is_grown_and_synced_again_by_the_next_writer() {
    use crate::failpoint::FailAction;
    let (dir, store, faults) = fresh_store();
    let journal = dir.path().join("outbox.journal");
    faults.arm("journal.extend_sync", FailAction::ErrorOnHit(1));
    let mut ours = None;
    let loaded = with_one_entry(&store, &mut ours, &faults);
    let durable_len = std::fs::metadata(&journal).unwrap().len();
    let mut appended = 0u64;
    while store
        .append_unsynced(loaded, None, Vec::new(), &[], &faults)
        .is_ok()
    {
        appended += 1;
        assert!(appended < 1_000_000, "the journal never had to grow");
    }
    assert_eq!(
        std::fs::metadata(&journal).unwrap().len(),
        durable_len,
        "a growth whose sync failed was left on the file"
    );
    loaded.take_unsynced().unwrap().write(&faults).unwrap();
    drop(ours);
    // Another handle: the entry that needs the growth grows the file and
    // syncs the growth itself.
    let theirs_faults = Failpoints::none();
    theirs_faults.arm("journal.extend_sync", FailAction::ErrorOnHit(u32::MAX));
    let mut theirs = None;
    let loaded = store.refresh(&mut theirs).unwrap();
    store
        .commit(loaded, Vec::new(), &[], &theirs_faults)
        .unwrap();
    assert_eq!(
        theirs_faults.hits("journal.extend_sync"),
        1,
        "the next writer wrote into a growth that was never synced"
    );
}
