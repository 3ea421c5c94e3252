use std::time::Duration;

use serde_json::json;

use super::*;
use crate::send::FailureClass;

fn class_of(status: u16, answer: &Value) -> (FailureClass, String, Option<Duration>) {
    let e = classify_answer(status, Some(answer), None).unwrap_err();
    (e.class(), e.code().to_owned(), e.retry_after_hint())
}

#[test]
fn an_event_id_is_the_transport_ref() {
    let sent = classify_answer(200, Some(&json!({"event_id": "$abc:hs"})), None);
    assert_eq!(sent, Ok(Some("$abc:hs".to_owned())));
}

#[test]
fn a_success_without_an_event_id_is_ambiguous() {
    // The event may exist; the outbox must not resend it blindly.
    let e = classify_answer(200, Some(&json!({})), None).unwrap_err();
    assert_eq!(e.class(), FailureClass::Ambiguous);
    let e = classify_answer(200, None, None).unwrap_err();
    assert_eq!(e.class(), FailureClass::Ambiguous);
}

#[test]
fn a_429_is_retryable_after_the_servers_retry_after_ms() {
    let (class, code, wait) = class_of(
        429,
        &json!({"errcode": "M_LIMIT_EXCEEDED", "retry_after_ms": 1923}),
    );
    assert_eq!(class, FailureClass::Retryable);
    assert_eq!(code, "M_LIMIT_EXCEEDED");
    assert_eq!(wait, Some(Duration::from_millis(1923)));
}

#[test]
fn a_429_without_retry_after_ms_falls_back_to_the_header() {
    let e = classify_answer(
        429,
        Some(&json!({"errcode": "M_LIMIT_EXCEEDED"})),
        Some(Duration::from_secs(2)),
    )
    .unwrap_err();
    assert_eq!(e.retry_after_hint(), Some(Duration::from_secs(2)));
}

#[test]
fn refusals_are_permanent() {
    for (status, errcode) in [
        (403, "M_FORBIDDEN"),
        (404, "M_NOT_FOUND"),
        (401, "M_UNKNOWN_TOKEN"),
        (413, "M_TOO_LARGE"),
    ] {
        let (class, code, _) = class_of(status, &json!({"errcode": errcode}));
        assert_eq!((class, code.as_str()), (FailureClass::Permanent, errcode));
    }
}

#[test]
fn every_5xx_is_ambiguous() {
    let (class, code, _) = class_of(500, &json!({"errcode": "M_UNKNOWN"}));
    assert_eq!(
        (class, code.as_str()),
        (FailureClass::Ambiguous, "http_500_M_UNKNOWN")
    );
    let e = classify_answer(502, None, None).unwrap_err();
    assert_eq!((e.class(), e.code()), (FailureClass::Ambiguous, "http_502"));
}

#[test]
fn replies_name_the_event_they_answer_and_skip_the_bots_own() {
    let answer = json!({"next_batch": "s1", "rooms": {"join": {"!r:hs": {"timeline": {"events": [
        {"type": "m.room.message", "event_id": "$1", "sender": "@alice:hs",
         "content": {"body": "> quoted\n\nthanks", "m.relates_to": {"m.in_reply_to": {"event_id": "$sent"}}}},
        {"type": "m.room.message", "event_id": "$2", "sender": "@alice:hs",
         "content": {"body": "not a reply"}},
        {"type": "m.room.message", "event_id": "$3", "sender": "@bot:hs",
         "content": {"body": "own", "m.relates_to": {"m.in_reply_to": {"event_id": "$1"}}}},
    ]}}}}});
    let replies = replies_in(&answer, "@bot:hs");
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].in_reply_to, "$sent");
    assert_eq!(replies[0].event_id, "$1");
    assert_eq!(replies[0].room_id, "!r:hs");
}

#[test]
fn room_ids_and_aliases_stay_one_path_segment() {
    assert_eq!(encode_path_segment("!abc:hs.org"), "%21abc%3Ahs.org");
    assert_eq!(encode_path_segment("#a/b:hs"), "%23a%2Fb%3Ahs");
    assert_eq!(encode_path_segment("do1-0a"), "do1-0a");
}

#[test]
fn debug_never_prints_the_token() {
    let session = MatrixSession {
        user_id: "@bot:hs".into(),
        device_id: "D".into(),
        access_token: "syt_secret".into(),
    };
    assert!(!format!("{session:?}").contains("syt_secret"));
}
