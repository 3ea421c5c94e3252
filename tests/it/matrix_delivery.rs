//! A Matrix bot against a real Synapse homeserver (see `tests/support/synapse.rs`):
//! the room's own history is the truth about what was delivered.
//!
//! One Synapse is shared by the tests of this binary (fresh users and rooms per
//! test); the outage test starts its own so it can stop it. The shared server's
//! message limiter is the one the issue measured (0.5/s after a burst of 3);
//! tests that are not about the limiter lift it for their bot user.
//!
//! File engine only (`postgres:` not run there): what is under test is the
//! Matrix transport against a real homeserver's limiter, and every run costs
//! that limiter's real time; the worker and the pacing it drives run on both
//! engines in `worker`, `worker_processes` and `adaptive_pacing`.

#[path = "../support/synapse.rs"]
mod synapse;

use std::future::Future;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use durable_outbox::{
    AMBIGUOUS_AFTER_RESTART, AuditLog, AuditOutcome, ItemState, MatrixClient, NewMessage, Outbox,
    OutboxBuilder, OutboxItem, Outcome, SendError,
};
use serde_json::Value;

use synapse::{Account, MessageLimit, Synapse};

/// The transaction-id dedup window the tests declare (Synapse keeps ids far longer).
const DEDUP_WINDOW: Duration = Duration::from_secs(60 * 60);

fn message(key: &str, room: &str) -> NewMessage {
    NewMessage {
        idempotency_key: key.to_owned(),
        connector: MatrixClient::CONNECTOR.into(),
        grant_id: "bot".into(),
        destination: room.to_owned(),
        content: format!("message {key}"),
        ..Default::default()
    }
}

/// `count` messages `{prefix}-00…` to `room`, enqueued in one step, in order.
fn enqueue(outbox: &Outbox, prefix: &str, room: &str, count: usize) -> Vec<String> {
    let keys: Vec<String> = (0..count).map(|i| format!("{prefix}-{i:02}")).collect();
    outbox
        .enqueue_many(keys.iter().map(|k| message(k, room)).collect())
        .unwrap();
    keys
}

/// An outbox that does not pace itself (the server's limiter is under test).
fn unpaced(dir: &std::path::Path) -> OutboxBuilder {
    Outbox::builder(dir).rate_limit(10_000, Duration::from_secs(1))
}

async fn login(server: &Synapse, bot: &Account, device: &str) -> MatrixClient {
    MatrixClient::login(&server.url(), &bot.localpart, &bot.password, device)
        .await
        .unwrap()
}

/// Runs the delivery worker with `concurrency` sends in flight until every
/// item is terminal (a watchdog names the guarantee if that takes too long).
async fn deliver_all<F, Fut>(outbox: &Outbox, concurrency: usize, send: F, guarantee: &str)
where
    F: Fn(OutboxItem) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Option<String>, SendError>> + Send + 'static,
{
    let watched = outbox.clone();
    let guarantee = guarantee.to_owned();
    let all_terminal = async move {
        let watchdog = Instant::now() + Duration::from_secs(150);
        loop {
            let items = watched.list_items().unwrap();
            let queued = items.iter().filter(|i| !i.state().is_terminal()).count();
            if queued == 0 {
                return;
            }
            assert!(
                Instant::now() < watchdog,
                "watchdog: {guarantee}: {queued} items still queued after 150 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    outbox
        .worker(send)
        .concurrency(concurrency)
        .run(all_terminal)
        .await
        .unwrap();
}

/// The bot's messages in the room, oldest first: (body, event id, `origin_server_ts`).
async fn bot_messages(
    server: &Synapse,
    reader: &Account,
    bot: &Account,
    room: &str,
) -> Vec<(String, String, u64)> {
    server
        .messages(reader, room)
        .await
        .iter()
        .filter(|e| e["sender"] == bot.user_id.as_str())
        .map(|e: &Value| {
            (
                e["content"]["body"].as_str().unwrap().to_owned(),
                e["event_id"].as_str().unwrap().to_owned(),
                e["origin_server_ts"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// Asserts that the room holds exactly `keys`' messages, once each (in this
/// order when `ordered`), and that each item is `Sent` with its event id as
/// transport ref.
async fn assert_delivered_once(
    server: &Synapse,
    (reader, bot, room): (&Account, &Account, &str),
    outbox: &Outbox,
    keys: &[String],
    ordered: bool,
) {
    let in_room = bot_messages(server, reader, bot, room).await;
    let mut bodies: Vec<&str> = in_room.iter().map(|(b, _, _)| b.as_str()).collect();
    let expected: Vec<String> = keys.iter().map(|k| format!("message {k}")).collect();
    if ordered {
        assert_eq!(
            bodies, expected,
            "the room must hold each message once, in enqueue order"
        );
    } else {
        bodies.sort_unstable();
        assert_eq!(
            bodies, expected,
            "the room must hold each message exactly once"
        );
    }
    for (body, event_id, _) in &in_room {
        let key = body.strip_prefix("message ").unwrap();
        let item = outbox.get(key).unwrap().unwrap();
        assert_eq!(item.state(), ItemState::Sent, "{key}");
        assert_eq!(item.transport_ref(), Some(event_id.as_str()), "{key}");
    }
    outbox.verify_audit().unwrap();
}

fn millis(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_messages_arrive_exactly_once_in_enqueue_order() {
    let Some(server) = Synapse::shared().await else {
        return;
    };
    let (bot, alice) = (
        server.user("bot", true).await,
        server.user("alice", true).await,
    );
    let room = server.room(&alice, &bot).await;
    let client = login(server, &bot, "OUTBOX").await;
    let dir = tempfile::tempdir().unwrap();
    let outbox = unpaced(dir.path()).open().unwrap();
    let keys = enqueue(&outbox, "fifty", &room, 50);

    let send = move |item| {
        let client = client.clone();
        async move { client.send(item).await }
    };
    deliver_all(&outbox, 1, send, "fifty messages are delivered").await;

    assert_delivered_once(server, (&alice, &bot, &room), &outbox, &keys, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_over_the_servers_limit_honours_every_retry_after() {
    let Some(server) = Synapse::shared().await else {
        return;
    };
    // The bot is under the server's limiter: 0.5/s after a burst of 3.
    let (bot, alice) = (
        server.user("bot", false).await,
        server.user("alice", true).await,
    );
    let room = server.room(&alice, &bot).await;
    let client = login(server, &bot, "OUTBOX").await;
    let dir = tempfile::tempdir().unwrap();
    let outbox = unpaced(dir.path()).open().unwrap();
    let keys = enqueue(&outbox, "burst", &room, 8);

    // Every request's start, and every 429's arrival with its retry_after.
    let starts = Arc::new(Mutex::new(Vec::<SystemTime>::new()));
    let refusals = Arc::new(Mutex::new(Vec::<(SystemTime, Duration)>::new()));
    let send = {
        let (starts, refusals) = (Arc::clone(&starts), Arc::clone(&refusals));
        move |item| {
            let (client, starts, refusals) =
                (client.clone(), Arc::clone(&starts), Arc::clone(&refusals));
            async move {
                starts.lock().unwrap().push(SystemTime::now());
                let result = client.send(item).await;
                if let Err(e) = &result {
                    assert_eq!(e.code(), "M_LIMIT_EXCEEDED", "only 429s expected: {e}");
                    let wait = e.retry_after_hint().expect("a 429 names its wait");
                    refusals.lock().unwrap().push((SystemTime::now(), wait));
                }
                result
            }
        }
    };
    deliver_all(&outbox, 1, send, "a rate-limited burst is delivered").await;

    assert_delivered_once(server, (&alice, &bot, &room), &outbox, &keys, true).await;
    let refusals = refusals.lock().unwrap().clone();
    assert!(
        !refusals.is_empty(),
        "8 messages at once must exceed a burst of 3"
    );
    // Adaptive pacing: after the first 429, sends follow the server's rate.
    assert!(
        refusals.len() <= 3,
        "after the first 429 at most 2 more, got {}: {refusals:?}",
        refusals.len()
    );
    // Client side: no request started inside a window the server announced.
    for (at, wait) in &refusals {
        for start in starts.lock().unwrap().iter().filter(|s| *s > at) {
            assert!(
                *start >= *at + *wait,
                "a request started {:?} into a {wait:?} retry_after",
                start.duration_since(*at).unwrap()
            );
        }
    }
    let starts = starts.lock().unwrap().clone();
    let first = millis(starts[0]);
    // Server side: no event was accepted inside a window either (same host
    // clock; origin_server_ts is truncated to the millisecond).
    let in_room = bot_messages(server, &alice, &bot, &room).await;
    for (at, wait) in &refusals {
        let (from, until) = (millis(*at), millis(*at + *wait));
        for (body, _, ts) in &in_room {
            assert!(
                !(from < *ts && *ts + 1 < until),
                "{body} was accepted at {ts}, inside the window {from}..{until}"
            );
        }
    }
    eprintln!(
        "burst: {} messages, {} 429s from the server: {:?}; request starts (ms after the first): {:?}",
        keys.len(),
        refusals.len(),
        refusals
            .iter()
            .map(|(at, wait)| (millis(*at) - first, wait.as_millis()))
            .collect::<Vec<_>>(),
        starts
            .iter()
            .map(|s| millis(*s) - first)
            .collect::<Vec<_>>(),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_are_correlated_to_the_messages_they_answer() {
    let Some(server) = Synapse::shared().await else {
        return;
    };
    let (bot, alice) = (
        server.user("bot", true).await,
        server.user("alice", true).await,
    );
    let room = server.room(&alice, &bot).await;
    let client = login(server, &bot, "OUTBOX").await;
    let dir = tempfile::tempdir().unwrap();
    let outbox = unpaced(dir.path()).open().unwrap();
    let keys = enqueue(&outbox, "ask", &room, 5);
    let send = {
        let client = client.clone();
        move |item| {
            let client = client.clone();
            async move { client.send(item).await }
        }
    };
    deliver_all(&outbox, 1, send, "questions are delivered").await;
    // Start listening before anyone answers, as a bot does.
    let mut since = client.sync(None, Duration::ZERO).await.unwrap().next_batch;

    // Alice answers three of the five, out of order.
    let mut expected = Vec::new();
    for key in [&keys[3], &keys[0], &keys[4]] {
        let event_id = outbox
            .get(key)
            .unwrap()
            .unwrap()
            .transport_ref()
            .unwrap()
            .to_owned();
        let reply = server
            .reply(&alice, &room, &event_id, &format!("answer to {key}"))
            .await;
        expected.push((reply, key.clone()));
    }

    let mut correlated = Vec::new();
    let watchdog = Instant::now() + Duration::from_secs(30);
    while correlated.len() < expected.len() {
        assert!(
            Instant::now() < watchdog,
            "watchdog: replies are correlated: only {correlated:?} after 30 s"
        );
        let batch = client
            .sync(Some(&since), Duration::from_secs(5))
            .await
            .unwrap();
        since = batch.next_batch;
        for reply in batch.replies {
            assert_eq!(reply.sender, alice.user_id);
            let original = outbox
                .find_by_transport_ref(&reply.in_reply_to)
                .unwrap()
                .expect("every reply answers a message the outbox sent");
            correlated.push((reply.event_id, original.idempotency_key().to_owned()));
        }
    }
    assert_eq!(correlated, expected);
}

/// Runs the test worker's `matrix-send` in a child process and SIGKILLs it
/// once its PUT has been answered, before the outcome is recorded. Returns the
/// event id the child saw.
fn kill_after_put(
    dir: &std::path::Path,
    server: &Synapse,
    bot: &Account,
    room: &str,
    key: &str,
    idempotent: bool,
) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_outbox-test-worker"))
        .arg("matrix-send")
        .arg(dir)
        .args([
            &server.url(),
            &bot.localpart,
            &bot.password,
            "OUTBOX",
            room,
            key,
        ])
        .arg(if idempotent { "idempotent" } else { "plain" })
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let event_id = line
        .strip_prefix("put-answered ")
        .unwrap_or_else(|| panic!("the child should report its PUT, said {line:?}"))
        .trim()
        .to_owned();
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    event_id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bot_killed_after_its_put_resends_under_the_same_txn_id_only_when_opted_in() {
    let Some(server) = Synapse::shared().await else {
        return;
    };
    let (bot, alice) = (
        server.user("bot", true).await,
        server.user("alice", true).await,
    );
    let room = server.room(&alice, &bot).await;

    for idempotent in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let key = format!("killed-{idempotent}");
        let (d, b, r, k) = (
            dir.path().to_owned(),
            bot.clone(),
            room.clone(),
            key.clone(),
        );
        let event_id =
            tokio::task::spawn_blocking(move || kill_after_put(&d, server, &b, &r, &k, idempotent))
                .await
                .unwrap();

        // The bot restarts: a new process, the same device.
        let mut builder = unpaced(dir.path());
        if idempotent {
            builder = builder.idempotent_transport(MatrixClient::CONNECTOR, DEDUP_WINDOW);
        }
        let outbox = builder.open().unwrap();
        let client = login(server, &bot, "OUTBOX").await;
        let receipt = outbox
            .process_async(&key, |item| {
                let client = client.clone();
                async move { client.send(item).await }
            })
            .await
            .unwrap();
        let item = outbox.get(&key).unwrap().unwrap();
        let copies = bot_messages(server, &alice, &bot, &room)
            .await
            .into_iter()
            .filter(|(body, _, _)| *body == format!("message {key}"))
            .count();
        if idempotent {
            assert_eq!(receipt.outcome, Outcome::Sent);
            assert_eq!(item.transport_ref(), Some(event_id.as_str()));
            assert_eq!(item.attempts(), 2);
            assert_eq!(copies, 1, "the resend must be deduplicated by txnId");
            let notes: Vec<String> = AuditLog::records_dir(dir.path())
                .unwrap()
                .map(Result::unwrap)
                .filter(|r| r.idempotency_key == key && r.outcome == AuditOutcome::Retrying)
                .filter_map(|r| r.note)
                .collect();
            assert_eq!(notes.len(), 1, "the resend is audited once");
            assert!(notes[0].contains(AMBIGUOUS_AFTER_RESTART), "{notes:?}");
        } else {
            assert_eq!(receipt.outcome, Outcome::Failed);
            assert_eq!(item.error_code(), Some(AMBIGUOUS_AFTER_RESTART));
            assert_eq!(item.attempts(), 1, "never resent without the opt-in");
            assert_eq!(copies, 1, "at most once");
        }
        outbox.verify_audit().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_down_for_ten_seconds_loses_and_doubles_nothing() {
    let Some(server) = Synapse::start(MessageLimit {
        per_second: 1000.0,
        burst_count: 1000,
    })
    .await
    else {
        return;
    };
    let server = Arc::new(server);
    let (bot, alice) = (
        server.user("bot", true).await,
        server.user("alice", true).await,
    );
    let room = server.room(&alice, &bot).await;
    let client = login(&server, &bot, "OUTBOX").await;
    let dir = tempfile::tempdir().unwrap();
    // A request cut by the kill is ambiguous: resend it under its txnId.
    let outbox = unpaced(dir.path())
        .idempotent_transport(MatrixClient::CONNECTOR, DEDUP_WINDOW)
        .max_attempts(1000)
        .backoff(durable_outbox::Backoff::Exponential {
            base: Duration::from_millis(100),
            cap: Duration::from_secs(1),
            jitter: false,
        })
        .open()
        .unwrap();
    let keys = enqueue(&outbox, "outage", &room, 30);

    let delivered = Arc::new(AtomicUsize::new(0));
    let outage = {
        let (server, delivered) = (Arc::clone(&server), Arc::clone(&delivered));
        tokio::spawn(async move {
            while delivered.load(Ordering::SeqCst) < 10 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let stopper = Arc::clone(&server);
            tokio::task::spawn_blocking(move || stopper.stop())
                .await
                .unwrap();
            let down = Instant::now();
            tokio::time::sleep(Duration::from_secs(10)).await;
            server.restart().await;
            down.elapsed()
        })
    };
    let send = {
        let delivered = Arc::clone(&delivered);
        move |item| {
            let (client, delivered) = (client.clone(), Arc::clone(&delivered));
            async move {
                // Pace to ~20/s so the outage lands mid-run.
                tokio::time::sleep(Duration::from_millis(50)).await;
                let result = client.send(item).await;
                if result.is_ok() {
                    delivered.fetch_add(1, Ordering::SeqCst);
                }
                result
            }
        }
    };
    deliver_all(&outbox, 1, send, "an outage loses nothing").await;
    let down_for = outage.await.unwrap();
    assert!(down_for >= Duration::from_secs(10));

    assert_delivered_once(&server, (&alice, &bot, &room), &outbox, &keys, true).await;
    let retried = outbox
        .list_items()
        .unwrap()
        .iter()
        .filter(|i| i.attempts() > 1)
        .count();
    eprintln!("outage: down for {down_for:?}; {retried} items needed more than one attempt");
    assert!(retried >= 1, "the outage must have hit at least one send");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_servers_refusals_are_classified_as_it_means_them() {
    let Some(server) = Synapse::shared().await else {
        return;
    };
    let (bot, alice) = (
        server.user("bot", true).await,
        server.user("alice", true).await,
    );
    // A bad password is a typed error naming the endpoint and Matrix errcode.
    let refused = MatrixClient::login(&server.url(), &bot.localpart, "wrong", "OUTBOX").await;
    assert!(
        matches!(
            &refused,
            Err(durable_outbox::Error::Matrix { operation: "login", status: Some(403), errcode: Some(code), .. })
                if code == "M_FORBIDDEN"
        ),
        "{refused:?}"
    );
    // A room the bot was never invited to: permanent, the item fails at once.
    let carol = server.user("carol", true).await;
    let private = server.room(&alice, &carol).await;
    let client = login(server, &bot, "OUTBOX").await;
    let dir = tempfile::tempdir().unwrap();
    let outbox = unpaced(dir.path())
        .max_inline_wait(Duration::ZERO)
        .open()
        .unwrap();
    outbox.enqueue(message("forbidden", &private)).unwrap();
    let receipt = outbox
        .process_async("forbidden", |item| {
            let client = client.clone();
            async move { client.send(item).await }
        })
        .await
        .unwrap();
    assert_eq!(receipt.outcome, Outcome::Failed);
    assert_eq!(receipt.error_code.as_deref(), Some("M_FORBIDDEN"));
    assert_eq!(receipt.attempts, 1);
    // Nobody listening: certainly not sent, so retryable.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let nowhere = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let offline = MatrixClient::from_session(&nowhere, client.session().clone()).unwrap();
    outbox.enqueue(message("offline", &private)).unwrap();
    let receipt = outbox
        .process_async("offline", |item| {
            let offline = offline.clone();
            async move { offline.send(item).await }
        })
        .await
        .unwrap();
    assert_eq!(receipt.outcome, Outcome::Deferred);
    assert_eq!(receipt.error_code.as_deref(), Some("connect_failed"));
}

/// The targets, with the crate's defaults and the worker at
/// concurrency 8: 20 messages to one room under Synapse's limiter (0.5/s after
/// a burst of 3) all delivered, exactly once, in enqueue order, none failed,
/// and at most 2 more 429s after the first. The timings are printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_messages_under_the_servers_limit_with_the_defaults_and_the_worker() {
    let Some(server) = Synapse::shared().await else {
        return;
    };
    let (bot, alice) = (
        server.user("bot", false).await,
        server.user("alice", true).await,
    );
    let room = server.room(&alice, &bot).await;
    let client = login(server, &bot, "OUTBOX").await;
    let dir = tempfile::tempdir().unwrap();
    let outbox = Outbox::open(dir.path()).unwrap();
    let keys = enqueue(&outbox, "target", &room, 20);

    let refusals = Arc::new(Mutex::new(Vec::<(SystemTime, Duration)>::new()));
    let send = {
        let refusals = Arc::clone(&refusals);
        move |item| {
            let (client, refusals) = (client.clone(), Arc::clone(&refusals));
            async move {
                let result = client.send(item).await;
                if let Err(e) = &result
                    && let Some(wait) = e.retry_after_hint()
                {
                    refusals.lock().unwrap().push((SystemTime::now(), wait));
                }
                result
            }
        }
    };
    let started = Instant::now();
    deliver_all(&outbox, 8, send, "the issue's targets are met").await;
    let took = started.elapsed();

    assert_delivered_once(server, (&alice, &bot, &room), &outbox, &keys, true).await;
    let refusals = refusals.lock().unwrap().clone();
    assert!(
        refusals.len() <= 3,
        "after the first 429 at most 2 more, got {}: {refusals:?}",
        refusals.len()
    );
    let in_room = bot_messages(server, &alice, &bot, &room).await;
    let span = in_room.last().unwrap().2 - in_room.first().unwrap().2;
    eprintln!(
        "targets: 20 messages in {took:?} (first to last event {span} ms); the server's \
         own limit is about 34 s (ratio {:.2}); {} 429s",
        took.as_secs_f64() / 34.0,
        refusals.len()
    );
}
