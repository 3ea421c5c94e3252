//! The async API for tokio bots (feature `tokio`).
//!
//! Same guarantees as the blocking API, without stalling the runtime: every file
//! operation and fsync runs on tokio's blocking pool (`spawn_blocking`); only the
//! caller's send future runs on the async worker. The claim is durable before the
//! future is first polled. A future that is dropped mid-send (a timeout, a
//! `select!` that went the other way, a cancelled task) may or may not have
//! delivered: the item fails as [`SEND_CANCELLED`], is never resent, and an
//! operator may requeue it. A send that has finished is recorded whatever
//! happens next: every write that must follow a send (its record, the
//! record of its cancellation, the release of an unused claim) runs exactly
//! once, on the blocking pool or, when a runtime shutting down drops it
//! there unrun, where it is dropped (`off_the_runtime_on`).

use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::error::{Error, Result};
use crate::item::{ClaimId, OutboxItem};
use crate::outbox::{Claimed, Outbox, SEND_CANCELLED, SendResult};
use crate::receipt::{DeliveryReceipt, DrainReport};
use crate::send::SendError;

#[cfg_attr(docsrs, doc(cfg(feature = "tokio")))]
impl Outbox {
    /// [`process`](Outbox::process) for async transports: `send` returns a future.
    ///
    /// The claim is fsynced (on the blocking pool) before the future is polled.
    /// Retry waits of up to `max_inline_wait` are slept on the blocking pool too,
    /// through the configured sleeper, so a `ManualClock` works in tests.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let dir = tempfile::tempdir()?;
    /// use durable_outbox::{NewMessage, Outbox, Outcome, SendError};
    ///
    /// let outbox = Outbox::open(dir.path())?;
    /// outbox.enqueue(NewMessage {
    ///     idempotency_key: "order-17".into(),
    ///     connector: "telegram".into(),
    ///     grant_id: "bot-1".into(),
    ///     destination: "chat-42".into(),
    ///     content: "your order shipped".into(),
    ///     ..Default::default()
    /// })?;
    /// let receipt = outbox
    ///     .process_async("order-17", |item| async move {
    ///         // e.g. client.post(url).json(&body).send().await, mapped to SendError
    ///         Ok::<_, SendError>(Some(format!("tg-{}", item.idempotency_key())))
    ///     })
    ///     .await?;
    /// assert_eq!(receipt.outcome, Outcome::Sent);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Cancellation
    ///
    /// Dropping the returned future before `send` is called gives the claim
    /// back (the item is queued again as it was, attempts unchanged; a claim
    /// still being made is given back once made). Dropping it while `send`
    /// is in progress fails the item as [`SEND_CANCELLED`] (recorded on the
    /// blocking pool); it is never resent. Either way the claim is settled by this handle, not
    /// left for a restart (unless that write fails: the claim then stays, and
    /// the next look at the item fails it as ambiguous).
    /// Once `send` has finished, its outcome is recorded even if the future is
    /// dropped, or the runtime shuts down, before the blocking pool runs the
    /// record: a pool that drops the record unrun runs it where it drops it.
    ///
    /// # Panics
    ///
    /// A panic in `send`, in its body or in the future it returns, is
    /// recorded (the item fails with [`SEND_PANICKED`](crate::SEND_PANICKED)),
    /// then resumed in the caller.
    ///
    /// # Errors
    ///
    /// As [`process`](Outbox::process); plus [`Error::Io`] if the blocking pool
    /// is shutting down.
    pub async fn process_async<F, Fut>(&self, key: &str, mut send: F) -> Result<DeliveryReceipt>
    where
        F: FnMut(OutboxItem) -> Fut,
        Fut: Future<Output = std::result::Result<Option<String>, SendError>>,
    {
        // As in `process`: paced retries consume no attempt, so bound the sends.
        let mut sends = 0;
        loop {
            let (receipt, retry_wait) = match self.send_once(key, &mut send).await? {
                Step::Done(receipt) => return Ok(receipt),
                Step::Sent(receipt, retry_wait) => (receipt, retry_wait),
            };
            sends += 1;
            match retry_wait {
                Some(wait) if wait <= self.max_inline_wait() && sends < self.max_attempts() => {
                    let sleeper = self.sleeper();
                    blocking(self, move || {
                        sleeper.sleep(wait);
                        Ok(())
                    })
                    .await?;
                }
                _ => return Ok(receipt),
            }
        }
    }

    /// [`process_due`](Outbox::process_due) for async transports: up to
    /// `concurrency` items in flight at once (at least 1), with no inline retry
    /// sleeps (retryable failures are rescheduled). Same order, fairness and
    /// claim-per-send rules as `process_due`: messages to one destination go one
    /// at a time in enqueue order, so one destination never holds more than one
    /// of the `concurrency` slots. Rate caps still hold: every claim counts the
    /// sends in flight, so concurrent items never exceed a cap.
    ///
    /// Receipts are reported in completion order. For a long-running loop that
    /// sleeps until work arrives, use [`Outbox::worker`].
    ///
    /// # Cancellation
    ///
    /// As for a [`Worker`](crate::Worker)'s `run`: dropping the returned
    /// future fails the sends in progress as [`SEND_CANCELLED`] (never
    /// resent), gives back the claims whose send had not started, and still
    /// records the sends that had finished.
    ///
    /// # Panics
    ///
    /// A panic in `send` (its body or its future) is recorded, and stops new
    /// sends; it is resumed once the other in-flight items have finished and
    /// been recorded.
    ///
    /// # Errors
    ///
    /// The first error stops new sends; items in flight finish and are recorded.
    pub async fn process_due_async<F, Fut>(
        &self,
        concurrency: usize,
        send: F,
    ) -> Result<DrainReport>
    where
        F: Fn(OutboxItem) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<Option<String>, SendError>> + Send + 'static,
    {
        let report = crate::worker::drain(self, concurrency, send).await?;
        let outbox = self.clone();
        blocking(self, move || outbox.publish_gauges()).await?;
        Ok(report)
    }

    /// One claim → send → record round, with cancellation and panic handling.
    async fn send_once<F, Fut>(&self, key: &str, send: &mut F) -> Result<Step>
    where
        F: FnMut(OutboxItem) -> Fut,
        Fut: Future<Output = std::result::Result<Option<String>, SendError>>,
    {
        let (outbox, owned_key) = (self.clone(), key.to_owned());
        // The claim comes back as a ticket: if this future is dropped while the
        // claim is still being made, the ticket is dropped with the task's output
        // and gives the claim back (the send never started, so nothing is lost).
        let claimed = blocking(self, move || {
            Ok(match outbox.claim(&owned_key)? {
                Claimed::Done(receipt) => Ticket::Done(receipt),
                Claimed::Send(item, before) => {
                    Ticket::Send(ClaimTicket::new(outbox.clone(), item, before))
                }
            })
        })
        .await?;
        let ticket = match claimed {
            Ticket::Done(receipt) => return Ok(Step::Done(receipt)),
            Ticket::Send(ticket) => ticket,
        };
        // From here on the send may start: a drop now means "maybe delivered".
        let (item, guard) = ticket.start_send();
        let claim = ClaimId::of(&item);
        let span = crate::outbox::send_span(&item);
        // A panic in `send` itself, before it returns its future, is the
        // send's panic too: recorded as panicked, like one in the future.
        let sending = span.in_scope(|| CatchUnwind::start(|| send(item)));
        let result: SendResult = tracing::Instrument::instrument(sending, span).await;
        guard.disarm();
        let outbox = self.clone();
        // The send ran: its record must be written even if this future is
        // dropped now or the runtime shuts down before the pool runs it. A
        // panic in `send` is resumed by `record_result` after recording, and
        // here, in the caller.
        let (receipt, retry_wait) =
            must_run(self, move || outbox.record_result(&claim, result)).await?;
        Ok(Step::Sent(receipt, retry_wait))
    }
}

/// What the claim step hands back to the async side.
enum Ticket {
    Done(DeliveryReceipt),
    Send(ClaimTicket),
}

/// A durable claim whose send has not started. Dropped unused, it releases the
/// claim: the item is restored exactly as it was, since it never left. It
/// gives back (or, once started, abandons) this very claim, never a newer
/// one the item may hold by then.
pub(crate) struct ClaimTicket {
    outbox: Option<Outbox>,
    claim: ClaimId,
    item: Box<OutboxItem>,
    before: Box<OutboxItem>,
}

impl ClaimTicket {
    pub(crate) fn new(outbox: Outbox, item: Box<OutboxItem>, before: Box<OutboxItem>) -> Self {
        Self {
            outbox: Some(outbox),
            claim: ClaimId::of(&item),
            item,
            before,
        }
    }

    /// Gives the claim back now (blocking), instead of on drop.
    pub(crate) fn release_now(mut self, outbox: &Outbox) -> Result<()> {
        self.outbox = None;
        outbox.release(&self.claim, &self.before)
    }

    /// Turns the ticket into a started send, guarded against cancellation.
    pub(crate) fn start_send(mut self) -> (OutboxItem, CancelGuard) {
        let outbox = self.outbox.take();
        let claim = self.claim.clone();
        let item = std::mem::replace(&mut self.item, Box::new((*self.before).clone()));
        (*item, CancelGuard { outbox, claim })
    }
}

impl Drop for ClaimTicket {
    fn drop(&mut self) {
        let Some(outbox) = self.outbox.take() else {
            return;
        };
        let claim = self.claim.clone();
        let before = std::mem::replace(&mut self.before, self.item.clone());
        off_the_runtime(move || {
            if let Err(e) = outbox.release(&claim, &before) {
                // The claim stays; the next touch fails it as ambiguous.
                tracing::error!(key = claim.key(), error = %e, "could not release an unsent claim");
            }
        });
    }
}

/// Runs `work` on the current runtime's blocking pool, or right here outside
/// a runtime, for a guard's `Drop` that must write (see [`off_the_runtime_on`]).
fn off_the_runtime(work: impl FnOnce() + Send + 'static) {
    let runtime = tokio::runtime::Handle::try_current().ok();
    off_the_runtime_on(runtime.as_ref(), move |_| work());
}

/// Where work handed to [`off_the_runtime_on`] ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ran {
    /// On the blocking pool, as asked.
    OnThePool,
    /// Where the pool dropped it (its runtime is shutting down), or right
    /// away, without a runtime.
    WhereDropped,
}

/// Runs `work` exactly once, on `runtime`'s blocking pool, or right here
/// without one: a write that must not be skipped. A pool whose runtime is
/// shutting down drops the task it is handed without running it (a task
/// handed over once the shutdown began is dropped at once, by the thread that
/// hands it over; one still queued when the pool's threads wind down, by
/// them): `work` then runs where it is dropped, and is told so. Skipping it
/// would lose what it writes: the record of a send that ran (the claim left
/// behind is settled as ambiguous after a restart, and until then the
/// handle, used on after its runtime, reports the item in flight), or the
/// release of an unused claim (failed as ambiguous later although its send
/// never started).
pub(crate) fn off_the_runtime_on(
    runtime: Option<&tokio::runtime::Handle>,
    work: impl FnOnce(Ran) + Send + 'static,
) {
    let once = RunOnce(Some(work));
    match runtime {
        Some(runtime) => drop(runtime.spawn_blocking(move || once.run())),
        None => drop(once),
    }
}

/// [`off_the_runtime_on`] the current runtime for a write whose caller
/// awaits its result: the record of a send that ran, which must be written
/// even if the caller's future is dropped or the runtime shuts down before
/// the pool gets to it. A panic in `work` is resumed in the caller.
///
/// # Errors
///
/// `work`'s; [`Error::Io`] if it was dropped unrun (it never is: the pool
/// either runs it or drops it, which runs it).
pub(crate) async fn must_run<T: Send + 'static>(
    outbox: &Outbox,
    work: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let (done, result) = tokio::sync::oneshot::channel();
    off_the_runtime(move || {
        // Nobody may be waiting any more: the write is what matters.
        let _ = done.send(catch_unwind(AssertUnwindSafe(work)));
    });
    match result.await {
        Ok(Ok(result)) => result,
        Ok(Err(panic)) => resume_unwind(panic),
        Err(_) => Err(Error::io(
            outbox.location(),
            "run blocking task",
            std::io::Error::other("a write handed to the blocking pool was dropped unrun"),
        )),
    }
}

/// Work that runs exactly once: when asked, or else when dropped.
struct RunOnce<F: FnOnce(Ran)>(Option<F>);

impl<F: FnOnce(Ran)> RunOnce<F> {
    fn run(mut self) {
        if let Some(work) = self.0.take() {
            work(Ran::OnThePool);
        }
    }
}

impl<F: FnOnce(Ran)> Drop for RunOnce<F> {
    fn drop(&mut self) {
        if let Some(work) = self.0.take() {
            work(Ran::WhereDropped);
        }
    }
}

/// What one round produced.
enum Step {
    /// Nothing was sent (terminal, deferred, in flight elsewhere).
    Done(DeliveryReceipt),
    /// A send ran; its receipt and, for a retryable failure, the wait before the next try.
    Sent(DeliveryReceipt, Option<std::time::Duration>),
}

/// The blocking calls a tokio bot makes, run on the blocking pool so they never
/// stall the runtime's workers with file I/O and fsyncs. Each behaves exactly
/// as its blocking namesake, and runs to its end once handed to the pool,
/// even if the future awaiting it is dropped. Anything else (e.g.
/// [`Outbox::verify_audit`]) is one line away:
/// `tokio::task::spawn_blocking({ let o = outbox.clone(); move || o.verify_audit() }).await`.
#[cfg_attr(docsrs, doc(cfg(feature = "tokio")))]
impl Outbox {
    /// [`enqueue`](Outbox::enqueue) on the blocking pool.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let dir = tempfile::tempdir()?;
    /// use durable_outbox::{NewMessage, Outbox};
    ///
    /// let outbox = Outbox::open(dir.path())?;
    /// let item = outbox
    ///     .enqueue_async(NewMessage {
    ///         idempotency_key: "order-17".into(),
    ///         connector: "telegram".into(),
    ///         grant_id: "bot-1".into(),
    ///         destination: "chat-42".into(),
    ///         content: "your order shipped".into(),
    ///         ..Default::default()
    ///     })
    ///     .await?;
    /// assert_eq!(outbox.get_async("order-17").await?, Some(item));
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Cancellation
    ///
    /// Dropping the returned future does not stop the enqueue once it is
    /// handed to the blocking pool: the message may be queued although its
    /// caller was never told. Enqueue it again with the same idempotency key
    /// to learn which (the existing item comes back, nothing is written).
    ///
    /// # Errors
    ///
    /// As [`enqueue`](Outbox::enqueue); plus [`Error::Io`] if the blocking pool
    /// is shutting down.
    pub async fn enqueue_async(&self, message: crate::NewMessage) -> Result<OutboxItem> {
        let outbox = self.clone();
        blocking(self, move || outbox.enqueue(message)).await
    }

    /// [`enqueue_many`](Outbox::enqueue_many) on the blocking pool.
    ///
    /// # Errors
    ///
    /// As [`enqueue_many`](Outbox::enqueue_many); plus [`Error::Io`] if the
    /// blocking pool is shutting down.
    pub async fn enqueue_many_async(
        &self,
        messages: Vec<crate::NewMessage>,
    ) -> Result<Vec<OutboxItem>> {
        let outbox = self.clone();
        blocking(self, move || outbox.enqueue_many(messages)).await
    }

    /// [`get`](Outbox::get) on the blocking pool.
    ///
    /// # Errors
    ///
    /// As [`get`](Outbox::get); plus [`Error::Io`] if the blocking pool is
    /// shutting down.
    pub async fn get_async(&self, key: &str) -> Result<Option<OutboxItem>> {
        let (outbox, key) = (self.clone(), key.to_owned());
        blocking(self, move || outbox.get(&key)).await
    }

    /// [`list_items`](Outbox::list_items) on the blocking pool.
    ///
    /// # Errors
    ///
    /// As [`list_items`](Outbox::list_items); plus [`Error::Io`] if the
    /// blocking pool is shutting down.
    pub async fn list_items_async(&self) -> Result<Vec<OutboxItem>> {
        let outbox = self.clone();
        blocking(self, move || outbox.list_items()).await
    }

    /// [`find_by_transport_ref`](Outbox::find_by_transport_ref) on the blocking pool.
    ///
    /// # Errors
    ///
    /// As [`get`](Outbox::get); plus [`Error::Io`] if the blocking pool is
    /// shutting down.
    pub async fn find_by_transport_ref_async(
        &self,
        transport_ref: &str,
    ) -> Result<Option<OutboxItem>> {
        let (outbox, reference) = (self.clone(), transport_ref.to_owned());
        blocking(self, move || outbox.find_by_transport_ref(&reference)).await
    }

    /// [`find_by_transport_ref_in`](Outbox::find_by_transport_ref_in) on the
    /// blocking pool: match a reply within the chat it came from.
    ///
    /// # Errors
    ///
    /// As [`get`](Outbox::get); plus [`Error::Io`] if the blocking pool is
    /// shutting down.
    pub async fn find_by_transport_ref_in_async(
        &self,
        destination: &str,
        transport_ref: &str,
    ) -> Result<Option<OutboxItem>> {
        let (outbox, destination, reference) = (
            self.clone(),
            destination.to_owned(),
            transport_ref.to_owned(),
        );
        blocking(self, move || {
            outbox.find_by_transport_ref_in(&destination, &reference)
        })
        .await
    }

    /// [`requeue`](Outbox::requeue) on the blocking pool.
    ///
    /// # Errors
    ///
    /// As [`requeue`](Outbox::requeue); plus [`Error::Io`] if the blocking
    /// pool is shutting down.
    pub async fn requeue_async(
        &self,
        key: &str,
        operator: &str,
        reason: &str,
    ) -> Result<OutboxItem> {
        let outbox = self.clone();
        let (key, operator, reason) = (key.to_owned(), operator.to_owned(), reason.to_owned());
        blocking(self, move || outbox.requeue(&key, &operator, &reason)).await
    }

    /// [`cancel`](Outbox::cancel) on the blocking pool.
    ///
    /// # Errors
    ///
    /// As [`cancel`](Outbox::cancel); plus [`Error::Io`] if the blocking pool
    /// is shutting down.
    pub async fn cancel_async(
        &self,
        key: &str,
        operator: &str,
        reason: &str,
    ) -> Result<OutboxItem> {
        let outbox = self.clone();
        let (key, operator, reason) = (key.to_owned(), operator.to_owned(), reason.to_owned());
        blocking(self, move || outbox.cancel(&key, &operator, &reason)).await
    }

    /// [`requeue_where`](Outbox::requeue_where) on the blocking pool.
    ///
    /// # Errors
    ///
    /// As [`requeue_where`](Outbox::requeue_where); plus [`Error::Io`] if the
    /// blocking pool is shutting down.
    pub async fn requeue_where_async(
        &self,
        filter: crate::ItemFilter,
        operator: &str,
        reason: &str,
    ) -> Result<crate::BulkReport> {
        let outbox = self.clone();
        let (operator, reason) = (operator.to_owned(), reason.to_owned());
        blocking(self, move || {
            outbox.requeue_where(&filter, &operator, &reason)
        })
        .await
    }

    /// [`cancel_where`](Outbox::cancel_where) on the blocking pool.
    ///
    /// # Errors
    ///
    /// As [`cancel_where`](Outbox::cancel_where); plus [`Error::Io`] if the
    /// blocking pool is shutting down.
    pub async fn cancel_where_async(
        &self,
        filter: crate::ItemFilter,
        operator: &str,
        reason: &str,
    ) -> Result<crate::BulkReport> {
        let outbox = self.clone();
        let (operator, reason) = (operator.to_owned(), reason.to_owned());
        blocking(self, move || {
            outbox.cancel_where(&filter, &operator, &reason)
        })
        .await
    }
}

/// Runs file work on tokio's blocking pool.
pub(crate) async fn blocking<T: Send + 'static>(
    outbox: &Outbox,
    work: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    match tokio::task::spawn_blocking(work).await {
        Ok(result) => result,
        Err(join) if join.is_panic() => resume_unwind(join.into_panic()),
        Err(join) => Err(pool_gone(outbox, &join)),
    }
}

pub(crate) fn pool_gone(outbox: &Outbox, join: &tokio::task::JoinError) -> Error {
    Error::io(
        outbox.location(),
        "run blocking task",
        std::io::Error::other(join.to_string()),
    )
}

/// Fails the item as [`SEND_CANCELLED`] if dropped before [`disarm`](Self::disarm):
/// the send future was dropped mid-flight, so the message may have left.
pub(crate) struct CancelGuard {
    outbox: Option<Outbox>,
    claim: ClaimId,
}

impl CancelGuard {
    pub(crate) fn disarm(mut self) {
        self.outbox = None;
    }
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        let Some(outbox) = self.outbox.take() else {
            return;
        };
        let claim = self.claim.clone();
        off_the_runtime(move || {
            if let Err(e) = outbox.abandon(&claim, SEND_CANCELLED) {
                // The claim stays; the next touch of the item fails it as
                // ambiguous instead, since it is no longer in flight here.
                tracing::error!(key = claim.key(), error = %e, "could not record a cancelled send");
            }
        });
    }
}

/// Calls a send and polls the future it returns, turning a panic in either
/// (the call's own body, before it returns its future, or one poll of the
/// future) into an `Err`, like `std::panic::catch_unwind` for each of them.
pub(crate) struct CatchUnwind<F>(Started<F>);

/// Where a [`CatchUnwind`] stands.
enum Started<F> {
    /// The call returned its future.
    Polling(Pin<Box<F>>),
    /// The call panicked: its payload, until handed out.
    Panicked(Option<Box<dyn std::any::Any + Send>>),
}

impl<F: Future> CatchUnwind<F> {
    /// Calls `call` (the caller's send) at once, catching a panic in it.
    pub(crate) fn start(call: impl FnOnce() -> F) -> Self {
        Self(match catch_unwind(AssertUnwindSafe(call)) {
            Ok(future) => Started::Polling(Box::pin(future)),
            Err(panic) => Started::Panicked(Some(panic)),
        })
    }
}

impl<F: Future> Future for CatchUnwind<F> {
    type Output = std::thread::Result<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.get_mut().0 {
            Started::Polling(future) => {
                let inner = future.as_mut();
                match catch_unwind(AssertUnwindSafe(move || inner.poll(cx))) {
                    Ok(Poll::Pending) => Poll::Pending,
                    Ok(Poll::Ready(value)) => Poll::Ready(Ok(value)),
                    Err(panic) => Poll::Ready(Err(panic)),
                }
            }
            // Polled again after it was ready (a misuse): the same
            // outcome, with the payload already handed out.
            Started::Panicked(panic) => Poll::Ready(Err(panic
                .take()
                .unwrap_or_else(|| Box::new("a send that panicked, polled again")))),
        }
    }
}
