//! A Matrix bot on a real homeserver: it announces itself in a room through the
//! outbox, answers every reply to one of its messages (through the outbox too),
//! and stops cleanly on Ctrl-C or SIGTERM.
//!
//! ```text
//! cargo run --example matrix_bot --features matrix -- \
//!     --homeserver http://127.0.0.1:8008 --user bot --password secret \
//!     --room '!abc:localhost' --dir /tmp/bot-outbox [--device OUTBOX1] [--messages 3]
//! ```
//!
//! - It logs in once per start with a fixed device id (`--device`), so the
//!   homeserver deduplicates transaction ids across restarts, and declares the
//!   `matrix` connector idempotent: a send whose outcome is unknown (a timeout,
//!   a kill -9) is resent under the same `txnId` and delivered once.
//! - Messages are keyed so that a rerun enqueues nothing new (`hello-0…`), and
//!   each answer is keyed by the reply's event id: a reply seen twice (a sync
//!   replayed after a restart) is answered once.
//! - Delivery is the crate's worker (`Outbox::worker`): messages to the room
//!   leave one at a time in enqueue order, paced by what the homeserver's
//!   429s asked for. On Ctrl-C it stops claiming, lets the send in progress
//!   finish and record its outcome, and exits; what is still queued is sent on
//!   the next start.

use std::time::Duration;

use durable_outbox::{ItemState, MatrixClient, NewMessage, Outbox, OutboxItem};

/// How long the platform keeps transaction ids that we rely on (Synapse keeps
/// them for about a day; declare less).
const DEDUP_WINDOW: Duration = Duration::from_secs(60 * 60);

struct Args {
    homeserver: String,
    user: String,
    password: String,
    room: String,
    dir: String,
    device: String,
    messages: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut args = std::env::args().skip(1);
    let (mut homeserver, mut user, mut password, mut room, mut dir) =
        (None, None, None, None, None);
    let (mut device, mut messages) = ("OUTBOX1".to_owned(), 3);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--homeserver" => homeserver = Some(value()?),
            "--user" => user = Some(value()?),
            "--password" => password = Some(value()?),
            "--room" => room = Some(value()?),
            "--dir" => dir = Some(value()?),
            "--device" => device = value()?,
            "--messages" => {
                messages = value()?.parse().map_err(|e| format!("--messages: {e}"))?;
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    let need = |v: Option<String>, name: &str| v.ok_or(format!("{name} is required"));
    Ok(Args {
        homeserver: need(homeserver, "--homeserver")?,
        user: need(user, "--user")?,
        password: need(password, "--password")?,
        room: need(room, "--room")?,
        dir: need(dir, "--dir")?,
        device,
        messages,
    })
}

fn message(key: String, room: &str, content: String) -> NewMessage {
    NewMessage {
        idempotency_key: key,
        connector: MatrixClient::CONNECTOR.into(),
        grant_id: "matrix-bot".into(),
        destination: room.to_owned(),
        content,
        ..Default::default()
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args().map_err(|e| {
        format!(
            "{e}\nusage: matrix_bot --homeserver URL --user U --password P --room ROOM --dir DIR [--device ID] [--messages N]"
        )
    })?;
    let outbox = Outbox::builder(&args.dir)
        .idempotent_transport(MatrixClient::CONNECTOR, DEDUP_WINDOW)
        .open()?;
    let client =
        MatrixClient::login(&args.homeserver, &args.user, &args.password, &args.device).await?;
    println!(
        "logged in as {} on device {}",
        client.session().user_id,
        client.session().device_id
    );
    let room = client.join(&args.room).await?;
    outbox.enqueue_many(
        (0..args.messages)
            .map(|i| {
                message(
                    format!("hello-{i}"),
                    &room,
                    format!("hello #{i} from durable-outbox: reply to me"),
                )
            })
            .collect(),
    )?;

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        println!("stopping: no new sends; the one in progress finishes and is recorded");
        let _ = stop_tx.send(true);
    });

    let replies = tokio::spawn(answer_replies(
        outbox.clone(),
        client.clone(),
        room.clone(),
        stop_rx.clone(),
    ));
    deliver(&outbox, &client, stop_rx).await?;
    replies.await??;

    let items = outbox.list_items()?;
    let count = |state| items.iter().filter(|i| i.state() == state).count();
    println!(
        "stopped: {} sent, {} failed, {} still queued (sent on the next start)",
        count(ItemState::Sent),
        count(ItemState::Failed),
        count(ItemState::Queued)
    );
    Ok(())
}

/// Runs the delivery worker until told to stop: it wakes on every enqueue
/// (the answers) and at each deferred item's moment, keeps one send at a time
/// per room in enqueue order, and on stop lets the send in progress finish.
async fn deliver(
    outbox: &Outbox,
    client: &MatrixClient,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<(), Box<dyn std::error::Error>> {
    let client = client.clone();
    let send = move |item: OutboxItem| {
        let client = client.clone();
        async move {
            let key = item.idempotency_key().to_owned();
            let sent = client.send(item).await;
            match &sent {
                Ok(event_id) => println!("sent {key} as {}", event_id.as_deref().unwrap_or("?")),
                Err(e) => println!("{key}: {e}"),
            }
            sent
        }
    };
    let stopped = async move {
        let _ = stop.wait_for(|stop| *stop).await;
    };
    let report = outbox
        .worker(send)
        .shutdown_timeout(Duration::from_secs(10))
        .run(stopped)
        .await?;
    println!(
        "worker: {} sent, {} failed, {} retried, {} released",
        report.sent, report.failed, report.retried, report.released
    );
    Ok(())
}

/// Long-polls `/sync`; every reply to one of our messages gets an answer.
async fn answer_replies(
    outbox: Outbox,
    client: MatrixClient,
    room: String,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<(), durable_outbox::Error> {
    // Start from now: replies sent while the bot was down are in the first batch.
    let mut since: Option<String> = None;
    while !*stop.borrow() {
        let batch = tokio::select! {
            batch = client.sync(since.as_deref(), Duration::from_secs(10)) => batch?,
            _ = stop.changed() => break,
        };
        since = Some(batch.next_batch);
        for reply in batch.replies {
            let Some(original) = outbox.find_by_transport_ref(&reply.in_reply_to)? else {
                continue; // a reply to something the outbox did not send
            };
            println!(
                "{} replied to {}: {:?}",
                reply.sender,
                original.idempotency_key(),
                last_line(&reply.body)
            );
            outbox.enqueue(message(
                format!("answer-{}", reply.event_id),
                &room,
                format!(
                    "{}: thanks, that was a reply to {}",
                    reply.sender,
                    original.idempotency_key()
                ),
            ))?;
        }
    }
    Ok(())
}

/// A reply's body starts with a quote of the original (`> …`); show the answer.
fn last_line(body: &str) -> &str {
    body.lines().last().unwrap_or(body)
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = async {
            match term.as_mut() {
                Some(term) => { term.recv().await; }
                None => std::future::pending().await,
            }
        } => {}
    }
}
