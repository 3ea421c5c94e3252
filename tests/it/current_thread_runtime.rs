//! A bot on a current-thread tokio runtime (`#[tokio::main(flavor =
//! "current_thread")]`) can use its outbox from that runtime's thread, on
//! both engines: the `_async` forms, and the blocking calls too (they block
//! that thread, and so the runtime's other tasks, while they run). On
//! PostgreSQL the client cannot run a runtime there: its connections' input
//! and output run on a helper thread.

use durable_outbox::{ItemState, Outcome, SendError};

use crate::engines::on_both_engines;
use crate::harness::msg;

fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

on_both_engines! {
    /// The async forms, called from the runtime's own thread.
    fn the_async_forms_work_on_a_current_thread_runtime(engine) {
        current_thread().block_on(async {
            let outbox = engine.open();
            outbox.enqueue_async(msg("a", "chat-1")).await.unwrap();
            let receipt = outbox
                .process_async("a", |_| async { Ok::<_, SendError>(Some("tr-a".into())) })
                .await
                .unwrap();
            assert_eq!(receipt.outcome, Outcome::Sent);
            let item = outbox.get_async("a").await.unwrap().unwrap();
            assert_eq!(item.state(), ItemState::Sent);
            assert_eq!(outbox.verify_audit().unwrap().records, 2);
            drop(outbox);
        });
    }

    /// The blocking forms, called from the runtime's own thread, work on
    /// both engines (the file engine only touches files; PostgreSQL's client
    /// runs its input and output on a helper thread), and so does dropping
    /// the handle there.
    fn blocking_calls_work_on_a_current_thread_runtimes_own_thread(engine) {
        current_thread().block_on(async {
            let outbox = engine.open();
            outbox.enqueue(msg("a", "chat-1")).unwrap();
            let receipt = outbox.process("a", |_| Ok(Some("tr-a".into()))).unwrap();
            assert_eq!(receipt.outcome, Outcome::Sent);
            outbox.enqueue(msg("b", "chat-2")).unwrap();
            assert_eq!(outbox.process_due(|_| Ok(None)).unwrap().sent, 1);
            let item = outbox.get("a").unwrap().unwrap();
            assert_eq!((item.state(), item.attempts()), (ItemState::Sent, 1));
            assert_eq!(outbox.list_items().unwrap().len(), 2);
            assert_eq!(outbox.verify_audit().unwrap().records, 4);
            outbox.compact().unwrap();
            drop(outbox);
            // A second handle, opened and dropped on the same thread.
            let again = engine.open();
            assert_eq!(again.list_items().unwrap().len(), 2);
            drop(again);
        });
    }
}
