//! A send whose outcome could not be recorded is never left looking in
//! flight: once the call or the worker that ran it has returned the error,
//! the item keeps its claim, and the next look of the same handle settles it
//! as ambiguous (it may have been delivered, so it is never sent again),
//! whichever path failed to record it.

use std::sync::mpsc;

#[cfg(feature = "test-failpoints")]
use durable_outbox::FailAction;
use durable_outbox::{AMBIGUOUS_AFTER_RESTART, Error, ItemState, OutboxItem, Outcome};

use crate::engines::EngineUnderTest;
use crate::harness::{DEADLOCK_LIMIT, msg, runtime, uncapped, within};

/// One send of [`held_sends`].
type HeldSend = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<Option<String>, durable_outbox::SendError>> + Send>,
>;

/// A transport whose sends report their key on the returned receiver, then
/// hold until the returned sender says go, and deliver as `tr-{key}`.
fn held_sends() -> (
    mpsc::Receiver<String>,
    tokio::sync::watch::Sender<bool>,
    impl Fn(OutboxItem) -> HeldSend + Send + Sync + 'static,
) {
    let (sending, started) = mpsc::channel::<String>();
    let (go, finish) = tokio::sync::watch::channel(false);
    let transport = move |item: OutboxItem| {
        let sending = sending.clone();
        let mut finish = finish.clone();
        Box::pin(async move {
            sending.send(item.idempotency_key().to_owned()).unwrap();
            finish.wait_for(|go| *go).await.unwrap();
            Ok(Some(format!("tr-{}", item.idempotency_key())))
        }) as HeldSend
    };
    (started, go, transport)
}

/// A worker whose record of a finished send fails in its batch's rules
/// (here a lock wait ended by the database's `lock_timeout`, as a DBA may
/// set it), and again when that send is recorded in a step of its own,
/// stops with the error; the send is then no longer counted as running, so
/// the handle's next look settles the item as ambiguous instead of reporting
/// it in flight for as long as the handle lives.
#[test]
fn a_worker_send_whose_record_failed_batched_and_alone_is_settled_by_the_next_look() {
    let Some(engine) = EngineUnderTest::postgres() else {
        return;
    };
    let url = engine.url();
    let name = url.rsplit('/').next().unwrap();
    // Every session opened from now on gives up a lock wait after 300 ms.
    crate::pg_server::PgServer::shared().unwrap().psql(
        name,
        &format!("ALTER DATABASE \"{name}\" SET lock_timeout = '300ms'"),
    );
    let outbox = engine.open_real_clock_with(uncapped);
    outbox.enqueue(msg("a", "chat-a")).unwrap();
    let mut session = postgres::Client::connect(&url, postgres::NoTls).unwrap();
    let (started, go, transport) = held_sends();
    let rt = runtime();
    let ended = within(
        "a worker whose record of a send failed stops",
        DEADLOCK_LIMIT,
        || {
            let running = rt.spawn(
                outbox
                    .worker(transport)
                    .concurrency(1)
                    .run(std::future::pending()),
            );
            assert_eq!(started.recv().unwrap(), "a");
            // While a is being sent, the test's session takes its row: the
            // worker's record of the send waits for it and times out, in
            // its batch and then alone.
            session
                .batch_execute(
                    "BEGIN; SELECT 1 FROM durable_outbox.items
                     WHERE idempotency_key = 'a' FOR UPDATE",
                )
                .unwrap();
            go.send(true).unwrap();
            rt.block_on(running).unwrap()
        },
    );
    match ended {
        Err(Error::Database { .. }) => {}
        other => panic!("the worker must stop with the database's error: {other:?}"),
    }
    session.batch_execute("ROLLBACK").unwrap();
    let item = outbox.get("a").unwrap().unwrap();
    assert!(
        item.dispatch_claimed(),
        "the claim stayed, the result did not"
    );

    let looked = outbox.process("a", |_| panic!("a was sent again")).unwrap();
    assert_eq!(
        looked.outcome,
        Outcome::Failed,
        "the unrecorded send still looks in flight: {looked:?}"
    );
    let item = outbox.get("a").unwrap().unwrap();
    assert_eq!(
        (item.state(), item.error_code()),
        (ItemState::Failed, Some(AMBIGUOUS_AFTER_RESTART))
    );
    outbox.verify_audit().unwrap();
}

/// A panic on the way into a worker's batched step, before the batch has
/// collected its members (`step.collect` armed to panic once, at the first
/// step of the slots that finished their sends), is raised by `Worker::run`,
/// and nobody records those finished sends: once the run has raised it, the
/// handle's next looks settle every unrecorded send as ambiguous. None may
/// look in flight for as long as the handle lives (its chat's line would
/// stay blocked). Requests queued behind the panicked batch are recorded by
/// the next one, so a look may briefly find one of them in flight: each key
/// is looked at until it is not, under a generous deadline.
#[cfg(feature = "test-failpoints")]
#[test]
fn a_worker_send_whose_batch_panicked_before_collecting_it_is_settled_by_the_next_look() {
    const CHATS: usize = 4;
    let dir = tempfile::tempdir().unwrap();
    // Hit 1: the worker's fill claims every chat's item; hit 2: the first
    // step of the slots after their sends.
    let outbox = uncapped(durable_outbox::Outbox::builder(dir.path()))
        .failpoint("step.collect", FailAction::PanicOnHit(2))
        .open()
        .unwrap();
    let keys: Vec<String> = (0..CHATS).map(|c| format!("k{c}")).collect();
    outbox
        .enqueue_many(keys.iter().map(|k| msg(k, &format!("chat-{k}"))).collect())
        .unwrap();
    let (started, go, transport) = held_sends();
    // Kept alive until the looks are done: later batches run on its pool.
    let rt = runtime();
    within(
        "a worker whose batch panicked before collecting its members raises the panic",
        DEADLOCK_LIMIT,
        || {
            let running = rt.spawn(
                outbox
                    .worker(transport)
                    .concurrency(CHATS)
                    .run(std::future::pending()),
            );
            for _ in 0..CHATS {
                started.recv().unwrap();
            }
            go.send(true).unwrap();
            match rt.block_on(running) {
                Err(join) if join.is_panic() => {}
                other => panic!("the worker did not raise the panic: {other:?}"),
            }
        },
    );
    assert_eq!(outbox.failpoint_hits("step.collect"), 2);
    let deadline = std::time::Instant::now() + DEADLOCK_LIMIT;
    let mut ambiguous = 0;
    for key in &keys {
        let looked = loop {
            let looked = outbox
                .process(key, |_| panic!("{key} was sent again"))
                .unwrap();
            if looked.outcome != Outcome::InFlight || std::time::Instant::now() > deadline {
                break looked;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        assert_ne!(
            looked.outcome,
            Outcome::InFlight,
            "{key}'s unrecorded send still looks in flight: {looked:?}"
        );
        let item = outbox.get(key).unwrap().unwrap();
        match item.state() {
            ItemState::Sent => assert_eq!(item.transport_ref(), Some(format!("tr-{key}").as_str())),
            ItemState::Failed => {
                assert_eq!(item.error_code(), Some(AMBIGUOUS_AFTER_RESTART), "{key}");
                ambiguous += 1;
            }
            other @ ItemState::Queued => panic!("{key} ended {other:?}"),
        }
    }
    assert!(ambiguous >= 1, "the panicked batch had a member");
    outbox.verify_audit().unwrap();
}
