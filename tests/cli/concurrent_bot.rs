//! The tool next to a running bot: reads stay consistent, writes take the bot's
//! lock, nothing is lost and the audit log verifies afterwards.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use durable_outbox::{CANCELLED, ItemState, Outbox};

use crate::harness::{Fixture, message};

/// A bot loop on its own handle: enqueue one message, drain everything due.
struct Bot {
    stop: Arc<AtomicBool>,
    rounds: Arc<AtomicUsize>,
    thread: Option<std::thread::JoinHandle<durable_outbox::Result<usize>>>,
}

impl Drop for Bot {
    /// A failing test stops its bot too.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

impl Bot {
    fn start(dir: &std::path::Path) -> Self {
        // The cap is a stored setting the fixture already wrote: raising it
        // takes an explicit, audited update (a plain builder value is ignored,
        // and the default cap would defer this bot's messages after a few rounds).
        let outbox = Outbox::builder(dir)
            .rate_limit(1_000_000, Duration::from_secs(60))
            .update_settings()
            .open()
            .unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let rounds = Arc::new(AtomicUsize::new(0));
        let thread = {
            let (stop, rounds) = (stop.clone(), rounds.clone());
            std::thread::spawn(move || {
                let mut n = 0;
                while !stop.load(Ordering::Acquire) {
                    outbox.enqueue(message(
                        &format!("bot-{n:05}"),
                        &format!("bot-chat-{}", n % 7),
                    ))?;
                    outbox
                        .process_due(|item| Ok(Some(format!("ref-{}", item.idempotency_key()))))?;
                    n += 1;
                    rounds.store(n, Ordering::Release);
                }
                Ok(n)
            })
        };
        Self {
            stop,
            rounds,
            thread: Some(thread),
        }
    }

    /// Waits until the bot has finished `more` rounds beyond now.
    fn wait_for_rounds(&self, more: usize) {
        let target = self.rounds.load(Ordering::Acquire) + more;
        while self.rounds.load(Ordering::Acquire) < target {
            let thread = self.thread.as_ref().expect("running");
            assert!(!thread.is_finished(), "the bot stopped early");
            std::thread::yield_now();
        }
    }

    fn stop(mut self) -> usize {
        self.stop.store(true, Ordering::Release);
        let thread = self.thread.take().expect("running");
        thread.join().unwrap().expect("the bot never failed")
    }
}

#[test]
fn the_tool_reads_and_writes_safely_while_a_bot_runs() {
    let f = Fixture::demo();
    let bot = Bot::start(f.path());
    bot.wait_for_rounds(3);

    // The demo's ambiguous `timeout-1` needs an operator: exit 1, not an error.
    f.run("status", &[])
        .exits(1)
        .says("may have been delivered");
    f.run("verify", &[]).exits(0).says("verified");
    f.run(
        "requeue",
        &[
            "gone-1",
            "--reason",
            "user unblocked the bot",
            "--operator",
            "alice",
        ],
    )
    .exits(0);
    f.run(
        "cancel",
        &[
            "later-1",
            "--reason",
            "customer withdrew",
            "--operator",
            "alice",
        ],
    )
    .exits(0);
    let listed = f.run("list", &["--json"]).exits(0).json();
    assert!(listed.as_array().unwrap().len() > 6);
    f.run("verify", &["--json"]).exits(0);

    bot.wait_for_rounds(3);
    let enqueued = bot.stop();

    let outbox = Outbox::open(f.path()).unwrap();
    for n in 0..enqueued {
        let item = outbox
            .get(&format!("bot-{n:05}"))
            .unwrap()
            .expect("not lost");
        assert_eq!(item.state(), ItemState::Sent, "{item:?}");
    }
    assert_eq!(
        outbox.get("gone-1").unwrap().unwrap().state(),
        ItemState::Sent
    );
    let later = outbox.get("later-1").unwrap().unwrap();
    assert_eq!(later.error_code(), Some(CANCELLED));
    let requeued = outbox.history("gone-1").unwrap();
    assert!(requeued.iter().any(|r| r.outcome.as_str() == "requeued"));
    outbox.verify_audit().unwrap();
    f.run("verify", &[]).exits(0);
}
