//! Pure chain logic: the canonical encoding is pinned by golden vectors.

use super::record::{AuditEvent, AuditOutcome, AuditRecord, Hasher, hash_of_line};
use super::{AuditTail, GENESIS_HASH};
use crate::failpoint::Failpoints;

fn event() -> AuditEvent {
    AuditEvent {
        attempts: 1,
        audit_id: "00112233445566778899aabbccddeeff".into(),
        connector: "telegram".into(),
        content_hash: "19add855".into(),
        destination: "chat-1".into(),
        direction: "outbound".into(),
        error_code: None,
        failure_class: None,
        grant_id: "grant-1".into(),
        idempotency_key: "key-\"quoted\"\n".into(),
        lane: "outbound-telegram".into(),
        outcome: AuditOutcome::Sent,
        note: None,
        reconciled: false,
        recorded_at_utc: "2026-01-15T09:00:00.000000Z".into(),
        risk_class: None,
        transport_ref: Some("tr-1".into()),
    }
}

/// Golden vector: changing field order, escaping or hashing breaks every existing log.
#[test]
fn the_canonical_line_and_hash_are_stable() {
    let record = AuditRecord::seal(&event(), 1, GENESIS_HASH, false, &Hasher::Plain);
    let line = String::from_utf8(record.to_line()).unwrap();
    let expected_line = concat!(
        r#"{"attempts":1,"audit_id":"00112233445566778899aabbccddeeff","connector":"telegram","#,
        r#""content_hash":"19add855","destination":"chat-1","direction":"outbound","error_code":null,"#,
        r#""grant_id":"grant-1","hash":"HASH","idempotency_key":"key-\"quoted\"\n","#,
        r#""lane":"outbound-telegram","note":null,"outcome":"sent","prev_hash":"0000000000000000000000000000000000000000000000000000000000000000","#,
        r#""reconciled":false,"recorded_at_utc":"2026-01-15T09:00:00.000000Z","risk_class":null,"seq":1,"#,
        r#""transport_ref":"tr-1"}"#,
        "\n"
    );
    assert_eq!(line, expected_line.replace("HASH", &record.hash));
    // Computed independently with Python:
    // json.dumps(rec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert_eq!(
        record.hash,
        "488212257cf64e167177ba4de84929fff7c2d9d2eda7ba1f69370016663d8e66",
    );
}

#[test]
fn hashing_the_stored_line_equals_hashing_the_record() {
    for hasher in [Hasher::Plain, Hasher::Keyed(b"k".to_vec())] {
        let record = AuditRecord::seal(&event(), 5, GENESIS_HASH, true, &hasher);
        let line = record.to_line();
        assert_eq!(
            hash_of_line(&line[..line.len() - 1], &hasher),
            Some(record.hash.clone())
        );
    }
}

#[test]
fn keyed_and_plain_hashes_differ() {
    let plain = AuditRecord::seal(&event(), 1, GENESIS_HASH, false, &Hasher::Plain);
    let keyed = AuditRecord::seal(
        &event(),
        1,
        GENESIS_HASH,
        false,
        &Hasher::Keyed(b"secret".to_vec()),
    );
    assert_ne!(plain.hash, keyed.hash);
}

/// `n` records continuing `tail`'s chain.
fn next_records(tail: &AuditTail, n: u64) -> Vec<AuditRecord> {
    let mut head = tail.head().clone();
    (0..n)
        .map(|_| {
            let r = AuditRecord::seal(&event(), head.seq + 1, &head.hash, false, &Hasher::Plain);
            head = super::Head {
                seq: r.seq,
                hash: r.hash.clone(),
            };
            r
        })
        .collect()
}

#[test]
fn records_that_do_not_continue_the_chain_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut tail = AuditTail::new(dir.path(), Hasher::Plain);
    let records = next_records(&tail, 2);
    assert!(
        tail.append_records(&records[1..], &Failpoints::none())
            .is_err()
    );
    assert!(!tail.path().exists(), "nothing was written");
}

#[test]
fn the_tail_appends_without_rereading_and_catches_up_on_other_writers() {
    let dir = tempfile::tempdir().unwrap();
    let faults = Failpoints::none();
    let mut ours = AuditTail::new(dir.path(), Hasher::Plain);
    let mut theirs = AuditTail::new(dir.path(), Hasher::Plain);
    ours.append_records(&next_records(&ours, 2), &faults)
        .unwrap();
    assert_eq!(ours.head().seq, 2);
    theirs.catch_up().unwrap();
    assert_eq!(theirs.head(), ours.head());
    theirs
        .append_records(&next_records(&theirs, 1), &faults)
        .unwrap();
    ours.catch_up().unwrap();
    assert_eq!(ours.head().seq, 3);
    assert_eq!(ours.hash_at(2), theirs.hash_at(2));
    assert!(ours.hash_at(2).is_some());
    assert_eq!(super::AuditLog::verify(ours.path()).unwrap().records, 3);
}

#[test]
fn a_shrunken_log_is_reported_not_followed() {
    let dir = tempfile::tempdir().unwrap();
    let mut tail = AuditTail::new(dir.path(), Hasher::Plain);
    tail.append_records(&next_records(&tail, 2), &Failpoints::none())
        .unwrap();
    std::fs::write(tail.path(), b"").unwrap();
    assert!(tail.catch_up().is_err());
}

/// Another handle's catch-up between appends (every transaction of a second
/// process) must not make each append dirty the log's inode: on Linux 6.13+
/// a `stat` that reads the times, or a read that updates the access time,
/// does, and on ext4 without a journal every dirty inode costs an extra write
/// at the next `fdatasync` of the journal whose inode shares its block.
#[test]
fn a_catch_up_between_appends_leaves_the_logs_inode_clean() {
    use crate::fsutil::tests::{ROUNDS, inode_dirtyings};
    let dir = tempfile::tempdir().unwrap();
    let faults = Failpoints::none();
    let mut ours = AuditTail::new(dir.path(), Hasher::Plain);
    let mut theirs = AuditTail::new(dir.path(), Hasher::Plain);
    ours.append_records(&next_records(&ours, 1), &faults)
        .unwrap();
    theirs.catch_up().unwrap();
    // Both descriptors open, so the rounds measure the steady state.
    theirs
        .append_records(&next_records(&theirs, 1), &faults)
        .unwrap();
    ours.catch_up().unwrap();
    let path = ours.path().to_path_buf();
    let dirtied = inode_dirtyings(&path, || {
        for _ in 0..ROUNDS {
            let record = next_records(&ours, 1);
            ours.append_records(&record, &faults).unwrap();
            theirs.catch_up().unwrap();
            assert_eq!(theirs.head(), ours.head());
        }
    });
    if let Some(dirtied) = dirtied {
        assert!(
            dirtied <= ROUNDS / 2,
            "{dirtied} inode dirtyings of the log in {ROUNDS} appends, each caught up on by another handle"
        );
    }
}

mod canonical_writer {
    use proptest::prelude::*;

    use super::super::record::{AuditEvent, AuditOutcome, AuditRecord, Hasher, hash_of_line};
    use crate::send::FailureClass;

    /// Text with what a JSON writer must escape (quotes, backslashes, every
    /// control character) and what it must not (DEL, non-ASCII).
    fn text() -> impl Strategy<Value = String> {
        let special = prop_oneof![
            Just('"'),
            Just('\\'),
            (0u8..0x20).prop_map(char::from),
            Just('\u{7f}'),
            Just('é'),
            Just('\u{2028}'),
            Just('a'),
        ];
        prop_oneof![
            proptest::collection::vec(prop_oneof![special, any::<char>()], 0..12)
                .prop_map(|chars| chars.into_iter().collect::<String>()),
            "[a-z0-9-]{0,16}",
        ]
    }

    fn outcome() -> impl Strategy<Value = AuditOutcome> {
        prop_oneof![
            Just(AuditOutcome::Queued),
            Just(AuditOutcome::Sent),
            Just(AuditOutcome::Failed),
            Just(AuditOutcome::Deferred),
            Just(AuditOutcome::Retrying),
            Just(AuditOutcome::Requeued),
            Just(AuditOutcome::Cancelled),
            Just(AuditOutcome::Pruned),
            Just(AuditOutcome::Settings),
            Just(AuditOutcome::LateDelivery),
        ]
    }

    fn class() -> impl Strategy<Value = Option<FailureClass>> {
        prop_oneof![
            Just(None),
            Just(Some(FailureClass::Retryable)),
            Just(Some(FailureClass::Permanent)),
            Just(Some(FailureClass::Ambiguous)),
        ]
    }

    prop_compose! {
        fn event()(
            attempts in any::<u32>(),
            strings in proptest::collection::vec(text(), 11),
            options in proptest::collection::vec(proptest::option::of(text()), 4),
            failure_class in class(),
            outcome in outcome(),
            reconciled in any::<bool>(),
        ) -> AuditEvent {
            AuditEvent {
                attempts,
                audit_id: strings[0].clone(),
                connector: strings[1].clone(),
                content_hash: strings[2].clone(),
                destination: strings[3].clone(),
                direction: strings[4].clone(),
                error_code: options[0].clone(),
                failure_class,
                grant_id: strings[5].clone(),
                idempotency_key: strings[6].clone(),
                lane: strings[7].clone(),
                outcome,
                note: options[1].clone(),
                reconciled,
                recorded_at_utc: strings[8].clone(),
                risk_class: options[2].clone(),
                transport_ref: options[3].clone(),
            }
        }
    }

    proptest! {
        /// The canonical writer is the format every existing log was written
        /// in: `serde_json`'s bytes for the record, and the hash of those bytes
        /// without the hash member (what `verify` recomputes from a stored line).
        #[test]
        fn the_canonical_writer_writes_what_serde_json_writes(
            event in event(),
            seq in any::<u64>(),
            prev in text(),
            reconciled in any::<bool>(),
            keyed in any::<bool>(),
        ) {
            let hasher = if keyed { Hasher::Keyed(b"k".to_vec()) } else { Hasher::Plain };
            let record = AuditRecord::seal(&event, seq, &prev, reconciled, &hasher);
            let mut expected = serde_json::to_vec(&record).unwrap();
            expected.push(b'\n');
            let line = record.to_line();
            prop_assert_eq!(&line, &expected);
            prop_assert_eq!(hash_of_line(&line[..line.len() - 1], &hasher), Some(record.hash.clone()));
        }
    }
}

/// A chain read on its own (an export, the PostgreSQL table) starts at
/// genesis, or where a removal record in it says the chain now starts.
mod a_chain_read_on_its_own {
    use super::super::anchor::{REMOVAL_SUBJECT, removal_note};
    use super::super::{Chain, Head};
    use super::*;
    use crate::error::AuditFault;

    /// Seals `events` into a chain from genesis; each line with the head
    /// before it.
    fn sealed(events: &[AuditEvent]) -> Vec<(Head, Vec<u8>)> {
        let mut head = Head::genesis();
        events
            .iter()
            .map(|event| {
                let record =
                    AuditRecord::seal(event, head.seq + 1, &head.hash, false, &Hasher::Plain);
                let before = std::mem::replace(
                    &mut head,
                    Head {
                        seq: record.seq,
                        hash: record.hash.clone(),
                    },
                );
                let mut line = record.to_line();
                line.pop();
                (before, line)
            })
            .collect()
    }

    fn item(key: &str) -> AuditEvent {
        AuditEvent {
            idempotency_key: key.into(),
            ..event()
        }
    }

    fn removal(key: &str, outcome: AuditOutcome, note: String) -> AuditEvent {
        AuditEvent {
            idempotency_key: key.into(),
            outcome,
            note: Some(note),
            ..event()
        }
    }

    /// The verdict on `lines` read on their own: the head seq, or the fault.
    fn verdict<'l>(lines: impl IntoIterator<Item = &'l Vec<u8>>) -> Result<u64, AuditFault> {
        let hasher = Hasher::Plain;
        let mut chain = Chain::on_its_own(&hasher);
        for line in lines {
            chain.check(line)?;
        }
        chain.finish()?;
        Ok(chain.head.seq)
    }

    /// Five item records; the sixth is `last` (a removal of the first two,
    /// or not), then one more item.
    fn with_sixth(last: impl FnOnce(&Head) -> AuditEvent) -> Vec<Vec<u8>> {
        let mut events: Vec<AuditEvent> = (1..=5).map(|i| item(&format!("k{i}"))).collect();
        let anchor = sealed(&events)[2].0.clone();
        assert_eq!(anchor.seq, 2, "the record before the third");
        events.push(last(&anchor));
        events.push(item("k7"));
        sealed(&events).into_iter().map(|(_, line)| line).collect()
    }

    fn engine_note(operator: &str, anchor: &Head) -> String {
        format!(
            "{operator} (removed 1 audit segments: records seq 1 to {}; {})",
            anchor.seq,
            removal_note(anchor)
        )
    }

    #[test]
    fn a_whole_chain_verifies_and_a_cut_front_without_a_removal_does_not() {
        let lines = with_sixth(|_| item("k6"));
        assert_eq!(verdict(&lines), Ok(7));
        assert_eq!(
            verdict(&lines[2..]),
            Err(AuditFault::FrontCut { first_seq: 3 })
        );
    }

    #[test]
    fn the_removal_record_that_names_the_start_makes_it_the_start() {
        let lines = with_sixth(|anchor| {
            removal(
                REMOVAL_SUBJECT,
                AuditOutcome::Pruned,
                engine_note("ops: old", anchor),
            )
        });
        assert_eq!(
            verdict(&lines),
            Ok(7),
            "from genesis, whole, it verifies too"
        );
        assert_eq!(verdict(&lines[2..]), Ok(7));
        assert_eq!(
            verdict(&lines[3..]),
            Err(AuditFault::FrontCut { first_seq: 4 }),
            "one record more cut than the removal says"
        );
    }

    /// A sixth record made from the anchor it might name.
    type Sixth = fn(&Head) -> AuditEvent;

    #[test]
    fn only_the_engines_words_in_a_removal_record_name_a_start() {
        let cases: [(&str, Sixth); 3] = [
            ("an item's record with the words", |anchor| {
                removal("k6", AuditOutcome::Pruned, engine_note("ops", anchor))
            }),
            ("another outcome", |anchor| {
                removal(
                    REMOVAL_SUBJECT,
                    AuditOutcome::Settings,
                    engine_note("ops", anchor),
                )
            }),
            (
                "the operator's words, the engine naming another start",
                |anchor| {
                    let other = Head {
                        seq: 1,
                        hash: GENESIS_HASH.into(),
                    };
                    removal(
                        REMOVAL_SUBJECT,
                        AuditOutcome::Pruned,
                        engine_note(&format!("ops: ({})", removal_note(anchor)), &other),
                    )
                },
            ),
        ];
        for (case, sixth) in cases {
            let lines = with_sixth(sixth);
            assert_eq!(
                verdict(&lines[2..]),
                Err(AuditFault::FrontCut { first_seq: 3 }),
                "{case}"
            );
        }
    }

    #[test]
    fn a_first_record_that_claims_seq_one_must_follow_genesis() {
        let lines = with_sixth(|_| item("k6"));
        // The second record alone: seq 2, not a front cut but not seq 1.
        assert_eq!(
            verdict(&lines[1..2]),
            Err(AuditFault::FrontCut { first_seq: 2 })
        );
        let mut forged: serde_json::Value = serde_json::from_slice(&lines[1]).unwrap();
        forged["seq"] = 1.into();
        let forged = serde_json::to_vec(&forged).unwrap();
        assert_eq!(verdict([&forged]), Err(AuditFault::BrokenLink));
    }
}
