//! The delivery worker (feature `tokio`): the loop a bot runs instead of its own.
//!
//! A [`Worker`] keeps up to `concurrency` sends running. Each *slot* claims an
//! item right before handing it to `send`, and records the outcome in the same
//! durable step that claims its next item. Slots ready to step at the same
//! moment share one step (**batched steps**, see [`Steps`]): one transaction
//! records all their outcomes and hands out all their claims, with one lock
//! hold, one journal entry and one audit append; each slot is told its
//! outcome only once that step is durable. Between sends it sleeps, without polling the state: it wakes when
//! an enqueue on any clone of the handle notifies it, when the journal of the
//! directory changes (another process), at the exact moment the earliest
//! deferred item falls due, or when `shutdown` completes.
//!
//! **Cross-process wake-ups** come from a watcher thread that reads the change
//! counter in `outbox.lock` (eight bytes, which every writer bumps before it
//! writes) and `stat`s `outbox.json` (identity, size, modification time: an
//! operator may replace it). It never `stat`s the journal: on kernels with
//! multigrain timestamps that would make the journal's next write dirty its
//! inode, and the next `fdatasync` write the inode too. The interval starts at
//! 1 ms after a change and doubles to at most [`Worker::watch_interval`] (50 ms
//! by default) while nothing changes: about 20 looks a second when idle, and an
//! enqueue by another process is seen within that interval.
//!
//! **Backpressure:** the worker claims an item only when a slot is free to send
//! it, so at most `concurrency` items are claimed (and held in memory) at once,
//! however fast messages are enqueued; the rest stay queued on disk.

use std::cell::Cell;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use tokio::sync::{Notify, oneshot, watch};
use tokio::task::JoinSet;

use crate::asynchronous::{
    CatchUnwind, ClaimTicket, Ran, blocking, must_run, off_the_runtime_on, pool_gone,
};
use crate::error::{Error, Result};
use crate::item::{ClaimId, OutboxItem};
use crate::lock::CounterProbe;
use crate::order::Picker;
use crate::outbox::{AsMember, Outbox, SEND_CANCELLED, SendResult, Stepped};
use crate::receipt::{DeliveryReceipt, DrainReport, Outcome};
use crate::rules::drain::{Batched, Claim, Member};
use crate::send::SendError;

/// The default number of sends in flight at once.
const DEFAULT_CONCURRENCY: usize = 8;
/// The default time running sends get to finish after shutdown is asked for.
const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);
/// The default longest pause between two looks at the journal.
const DEFAULT_WATCH_INTERVAL: Duration = Duration::from_millis(50);
/// How often a destination held by another process's claim is looked at again:
/// a process killed mid-send writes nothing that would wake us, so its claim is
/// found dead (and failed as ambiguous) on this re-check.
const FOREIGN_CLAIM_RECHECK: Duration = Duration::from_secs(1);

/// A delivery loop over one outbox; made by [`Outbox::worker`], started by
/// [`run`](Self::run).
///
/// What it guarantees:
/// - **Order:** under the outbox's [`Ordering`](crate::Ordering) (per
///   destination by default), messages to one destination are handed to `send`
///   in enqueue order, one at a time, across threads and processes.
/// - **Fairness:** free slots go to the destination served least recently, so
///   one flooded destination does not starve the others, and the global rate
///   cap's slots are shared the same way.
/// - **Backpressure:** at most `concurrency` items are claimed at once.
/// - **Graceful shutdown:** see [`run`](Self::run).
/// - **Crash-sized ambiguity:** an item is claimed right before its `send`, so
///   a crash leaves ambiguous only the sends that had started.
pub struct Worker<F> {
    outbox: Outbox,
    send: F,
    concurrency: usize,
    shutdown_timeout: Duration,
    watch_interval: Duration,
}

impl<F> std::fmt::Debug for Worker<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("outbox", &self.outbox)
            .field("concurrency", &self.concurrency)
            .field("shutdown_timeout", &self.shutdown_timeout)
            .field("watch_interval", &self.watch_interval)
            .finish_non_exhaustive()
    }
}

/// What a worker did between [`run`](Worker::run) and its return.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WorkerReport {
    /// Items delivered.
    pub sent: usize,
    /// Items that failed terminally (permanent or ambiguous errors, panics,
    /// exhausted attempts, dead claims found on the way).
    pub failed: usize,
    /// Times an item was held back by a rate cap or a platform cooldown.
    pub deferred: usize,
    /// Sends that failed retryably and were rescheduled.
    pub retried: usize,
    /// Items claimed during shutdown before their send started, given back
    /// untouched (still queued, attempts unchanged).
    pub released: usize,
    /// Sends still running at the shutdown deadline, dropped and failed as
    /// [`SEND_CANCELLED`] (they may have been delivered; never resent).
    pub cancelled: usize,
}

impl Outbox {
    /// A delivery worker that hands due items to `send` (same contract as
    /// [`process_due_async`](Outbox::process_due_async)'s). Configure it, then
    /// [`run`](Worker::run) it.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let dir = tempfile::tempdir()?;
    /// use std::time::Duration;
    /// use durable_outbox::{NewMessage, Outbox, SendError};
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
    /// let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    /// let worker = outbox
    ///     .worker(move |item: durable_outbox::OutboxItem| {
    ///         // e.g. post to the platform, mapped to SendError
    ///         async move { Ok::<_, SendError>(Some(format!("tg-{}", item.idempotency_key()))) }
    ///     })
    ///     .concurrency(4)
    ///     .shutdown_timeout(Duration::from_secs(10));
    /// let running = tokio::spawn(worker.run(async move { stopped.await.ok(); }));
    /// // In a bot: run until Ctrl-C / SIGTERM. Here: until the item is sent.
    /// while outbox.get("order-17")?.and_then(|i| i.transport_ref().map(str::to_owned)).is_none() {
    ///     tokio::time::sleep(Duration::from_millis(5)).await;
    /// }
    /// stop.send(()).ok();
    /// let report = running.await??;
    /// assert_eq!(report.sent, 1);
    /// # Ok(())
    /// # }
    /// ```
    pub fn worker<F, Fut>(&self, send: F) -> Worker<F>
    where
        F: Fn(OutboxItem) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<Option<String>, SendError>> + Send + 'static,
    {
        Worker {
            outbox: self.clone(),
            send,
            concurrency: DEFAULT_CONCURRENCY,
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
            watch_interval: DEFAULT_WATCH_INTERVAL,
        }
    }
}

impl<F, Fut> Worker<F>
where
    F: Fn(OutboxItem) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = std::result::Result<Option<String>, SendError>> + Send + 'static,
{
    /// How many sends may run at once (at least 1). Default 8. Also the most
    /// items the worker holds claimed at any moment.
    #[must_use]
    pub fn concurrency(mut self, sends: usize) -> Self {
        self.concurrency = sends.max(1);
        self
    }

    /// How long sends already running get to finish once shutdown is asked
    /// for. Default 30 s. Sends still running then are dropped and fail as
    /// [`SEND_CANCELLED`].
    #[must_use]
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.shutdown_timeout = timeout;
        self
    }

    /// The longest pause between two looks at the journal for changes made by
    /// other processes (at least 1 ms). Default 50 ms: another process's enqueue
    /// is picked up within about this long. Enqueues through this handle or its
    /// clones wake the worker at once regardless. On PostgreSQL other hosts'
    /// commits wake the worker through `LISTEN`/`NOTIFY` as they come, not on
    /// this interval; there it is only how often (at least every 50 ms) the
    /// listening thread checks whether the worker has stopped.
    #[must_use]
    pub fn watch_interval(mut self, interval: Duration) -> Self {
        self.watch_interval = interval.max(Duration::from_millis(1));
        self
    }

    /// Delivers until `shutdown` completes, then stops gracefully:
    ///
    /// 1. no new claims;
    /// 2. sends already running get up to `shutdown_timeout` to finish, and
    ///    their real outcome is recorded;
    /// 3. an item claimed but not yet handed to `send` is released untouched
    ///    (still queued, attempts unchanged);
    /// 4. only sends still running at the deadline are dropped and fail as
    ///    [`SEND_CANCELLED`].
    ///
    /// A panic in `send` fails its item with
    /// [`SEND_PANICKED`](crate::SEND_PANICKED) and the worker carries on.
    /// Dropping the returned future instead of completing `shutdown` cancels
    /// running sends at once (as `SEND_CANCELLED`) and releases unstarted claims.
    /// Sends that finished are recorded even when the runtime shuts down
    /// before their step ran: the step then runs where the runtime drops it,
    /// and claims nothing more.
    ///
    /// # Panics
    ///
    /// A panic in `send` does not stop the worker (above). A panic in the
    /// outbox's own delivery rules (a bug, or an injected fault) is raised by
    /// `run`, with its message, whether that step ran alone or batched with
    /// other slots' steps; nothing of that step is written, and the sends it
    /// would have recorded are settled by the next look as any unrecorded
    /// claim is (ambiguous, never resent).
    ///
    /// # Errors
    ///
    /// The first load or write error (e.g. [`Error::Io`], [`Error::Poisoned`])
    /// stops the worker: it claims nothing more, lets running sends finish as in
    /// a shutdown, then returns the error.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<WorkerReport> {
        let Self {
            outbox,
            send,
            concurrency,
            shutdown_timeout,
            watch_interval,
        } = self;
        let (cancel, cancelled) = watch::channel(false);
        let shared = Arc::new(Shared {
            outbox: outbox.clone(),
            send,
            picker: Mutex::new(Picker::worker()),
            steps: Steps::default(),
            runtime: tokio::runtime::Handle::current(),
            stopping: AtomicBool::new(false),
            cancelled,
            tally: Mutex::new(Tally::default()),
            keep_panics: false,
        });
        let wake = Arc::new(Notify::new());
        let _subscription = Subscription::new(&outbox, &wake);
        let _watcher = Watcher::spawn_for(&outbox, Arc::clone(&wake), watch_interval);
        let mut slots: JoinSet<Result<SlotEnd>> = JoinSet::new();
        let mut failure: Option<Error> = None;
        let mut shutdown = std::pin::pin!(shutdown);
        tracing::info!(
            outbox = %outbox.location(),
            concurrency,
            "delivery worker started"
        );
        loop {
            // A shutdown that has completed (before `run`, or while the last
            // round ran) stops the worker before it claims anything more:
            // "no new claims" holds from that moment, not from the next wait.
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                () = std::future::ready(()) => {}
            }
            if let Err(e) = fill(&shared, &mut slots, concurrency).await {
                failure = Some(e);
                break;
            }
            let pause = if slots.len() < concurrency {
                match next_pause(&outbox).await {
                    Ok(pause) => pause,
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                }
            } else {
                None
            };
            tokio::select! {
                () = &mut shutdown => break,
                () = wake.notified() => {}
                Some(done) = slots.join_next(), if !slots.is_empty() => {
                    if let Err(e) = slot_ended(&outbox, done) {
                        failure = Some(e);
                        break;
                    }
                }
                () = sleep_for(pause) => {}
            }
        }
        shared.stopping.store(true, Ordering::Release);
        if let Some(e) = &failure {
            tracing::error!(
                error = %e,
                running = slots.len(),
                "delivery worker stopping on an error: no new claims, running sends finish"
            );
        } else {
            tracing::info!(
                running = slots.len(),
                timeout = ?shutdown_timeout,
                "delivery worker stopping: no new claims, running sends get the shutdown timeout"
            );
        }
        let late = wind_down(&outbox, &mut slots, shutdown_timeout, &cancel).await;
        if let Some(e) = failure.or(late) {
            return Err(e);
        }
        let tally = std::mem::take(&mut *shared.tally());
        let report = tally.into_worker_report();
        tracing::info!(
            sent = report.sent,
            failed = report.failed,
            deferred = report.deferred,
            retried = report.retried,
            released = report.released,
            cancelled = report.cancelled,
            "delivery worker stopped"
        );
        Ok(report)
    }
}

/// The end of a shutdown: running sends get `timeout` to finish and record
/// their outcome; those still running then are cancelled (each recorded as
/// `send_cancelled`). Returns the first error recording any of them.
async fn wind_down(
    outbox: &Outbox,
    slots: &mut JoinSet<Result<SlotEnd>>,
    timeout: Duration,
    cancel: &watch::Sender<bool>,
) -> Option<Error> {
    let graceful = tokio::time::timeout(timeout, async {
        let mut first = None;
        while let Some(done) = slots.join_next().await {
            if let Err(e) = slot_ended(outbox, done) {
                first.get_or_insert(e);
            }
        }
        first
    })
    .await;
    match graceful {
        Ok(error) => error,
        Err(_deadline) => {
            tracing::warn!(
                running = slots.len(),
                "shutdown timeout reached: cancelling the sends still running (each fails as send_cancelled)"
            );
            let _ = cancel.send(true);
            let mut first = None;
            while let Some(done) = slots.join_next().await {
                if let Err(e) = slot_ended(outbox, done) {
                    first.get_or_insert(e);
                }
            }
            first
        }
    }
}

/// What all slots of one worker or drain share.
struct Shared<F> {
    outbox: Outbox,
    send: F,
    picker: Mutex<Picker>,
    /// The slots' steps waiting to be batched.
    steps: Steps,
    /// Where a batch's leader runs (the blocking pool of this runtime).
    runtime: tokio::runtime::Handle,
    /// Set once shutdown is asked for: record outcomes, claim nothing more.
    stopping: AtomicBool,
    /// Becomes `true` at the shutdown deadline: drop running sends.
    cancelled: watch::Receiver<bool>,
    tally: Mutex<Tally>,
    /// A drain hands a send's panic back to its caller; a worker carries on.
    keep_panics: bool,
}

impl<F> Shared<F> {
    fn tally(&self) -> std::sync::MutexGuard<'_, Tally> {
        self.tally.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }
}

impl<F> Shared<F> {
    /// What a batch's leader needs of the slots' shared state.
    fn ctx(&self) -> StepCtx<'_> {
        StepCtx {
            picker: &self.picker,
            stopping: &self.stopping,
            tally: &self.tally,
            runtime: Some(&self.runtime),
        }
    }
}

/// What a batch's leader needs of the slots' shared state.
struct StepCtx<'a> {
    picker: &'a Mutex<Picker>,
    stopping: &'a AtomicBool,
    tally: &'a Mutex<Tally>,
    /// Where a durable batch's answers are handed out (see [`answer`]);
    /// without one, the leader answers each member itself.
    runtime: Option<&'a tokio::runtime::Handle>,
}

impl StepCtx<'_> {
    fn tally(&self) -> std::sync::MutexGuard<'_, Tally> {
        self.tally.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Batched steps: the slots' steps that wait at the same moment share one
/// transaction.
///
/// A slot ready to step queues its request (its finished send, the claims it
/// wants) and awaits its answer, holding no thread. If no batch is gathering,
/// it starts a **leader** on the blocking pool: the leader asks for the
/// outbox's lock and, once it holds it, takes every request queued by then
/// (those that arrived while it waited included) and runs them as one
/// transaction ([`Outbox::step_batch`]). Still under the lock, it starts the
/// next leader if more requests queued behind its batch, so the next batch
/// forms and takes the lock as soon as this one has written its entry, while
/// this one waits for its sync (the commit group then covers both). Once its
/// batch is durable, the leader answers every member.
///
/// What each member is told, and when:
/// - the batch committed durably: its claims (its outcome is recorded);
/// - the batch's rules failed (one member's error, e.g. an item gone from
///   under its send): nothing was written; each member reruns its own step
///   alone, so one member's error fails only that member;
/// - the batch's write or sync failed: every member fails (the first with
///   the error, the others with [`Error::Poisoned`]) and none is reported
///   durable.
#[derive(Default)]
struct Steps {
    queue: Mutex<StepQueue>,
}

#[derive(Default)]
struct StepQueue {
    waiting: Vec<Request>,
    /// A leader is gathering a batch (waiting for the lock or running it).
    gathering: bool,
}

/// One slot's step, waiting to be batched.
struct Request {
    /// Declared first, so dropped first: a request dropped unanswered takes
    /// its send out of the in-flight set before its slot learns it is gone.
    finished: Option<Finished>,
    claims: usize,
    reply: oneshot::Sender<Reply>,
}

impl AsMember for Request {
    fn member(&self) -> Member<'_> {
        Member {
            finished: self.finished.as_ref().map(|f| (&f.claim, &f.result)),
            claims: self.claims,
        }
    }
}

/// A slot's finished send on its way to its record. Its claim stays in the
/// handle's in-flight set for exactly as long as this lives, and leaves it
/// when this is dropped, whichever way: recorded by a batch, failed, or
/// dropped unrecorded with its request (a leader that unwound, a runtime
/// gone). Kept in flight meanwhile, no look takes the send for an orphan
/// (which would settle it as ambiguous under its running record); taken out
/// after, an unrecorded send is settled by the next look as any unrecorded
/// claim is (ambiguous, never resent), instead of being reported in flight,
/// skipped by every drain and holding its chat's line, for as long as the
/// handle lives. A claim made meanwhile with the same stamp is made a
/// microsecond apart (`lifecycle::apart_from_our_sends`), so this never
/// takes out another send's mark.
pub(crate) struct Finished {
    outbox: Outbox,
    claim: ClaimId,
    result: SendResult,
}

impl Finished {
    fn new(outbox: &Outbox, claim: ClaimId, result: SendResult) -> Self {
        Self {
            outbox: outbox.clone(),
            claim,
            result,
        }
    }
}

impl Drop for Finished {
    fn drop(&mut self) {
        self.outbox.in_flight().remove(&self.claim);
    }
}

/// What a slot waiting in [`Steps`] is told.
enum Reply {
    /// The batch is durable: this slot's claims.
    Done(Vec<ClaimTicket>),
    /// The batch's write or sync failed.
    Failed(Error),
    /// The batch's rules failed and nothing was written: step alone.
    Alone(Option<Finished>, usize),
    /// The batch's rules panicked and nothing was written: raise this panic
    /// in the slot, as a panic in the rules of a single step is.
    Panicked(Box<dyn std::any::Any + Send>),
}

impl Steps {
    fn queue(&self) -> std::sync::MutexGuard<'_, StepQueue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues a slot's step; `true` if no batch is gathering, so the caller
    /// must start a leader ([`lead`](Self::lead)).
    fn push(&self, request: Request) -> bool {
        let mut queue = self.queue();
        queue.waiting.push(request);
        !std::mem::replace(&mut queue.gathering, true)
    }

    /// Starts the next leader (`next`) if requests are queued, or ends
    /// gathering. `true`: the next leader was refused (`next` answered
    /// `false`), and the caller owes the queued requests a batch.
    fn hand_over(&self, next: &dyn Fn() -> bool) -> bool {
        let mut queue = self.queue();
        if queue.waiting.is_empty() {
            queue.gathering = false;
            false
        } else {
            drop(queue);
            !self.starting(next)
        }
    }

    /// Runs `start`, which starts a leader for the queued requests (see
    /// [`spawn_leader`]). If it unwinds (a panic in it, or tokio's when the
    /// OS refuses the blocking pool a thread), no leader is coming: the
    /// queue is left as [`abandon`](Self::abandon) leaves it, so no request
    /// waits for that leader, and the panic goes on.
    fn starting(&self, start: impl FnOnce() -> bool) -> bool {
        let unwinding = Unwinding {
            steps: self,
            handed: Cell::new(false),
        };
        let started = start();
        unwinding.handed.set(true);
        started
    }

    /// Ends gathering with no leader to come: the queued requests are
    /// dropped unanswered, so their slots get an error instead of waiting
    /// forever, and the next request leads again.
    fn abandon(&self) {
        let mut queue = self.queue();
        let dropped = std::mem::take(&mut queue.waiting);
        queue.gathering = false;
        drop(queue);
        // Each takes its finished send out of the in-flight set.
        drop(dropped);
    }

    /// Gathers and runs one batch, then answers its members; `next` starts
    /// the leader of the following batch, or answers `false` if it could
    /// not (its runtime is shutting down: see [`spawn_leader`]). This leader
    /// then leads the following batch itself, once its own is done and it
    /// holds no lock (`next` may be asked under the outbox's lock, which the
    /// following batch needs), claiming nothing more.
    fn lead(&self, outbox: &Outbox, ctx: &StepCtx<'_>, next: impl Fn() -> bool) {
        while self.lead_once(outbox, ctx, &next) {
            ctx.stopping.store(true, Ordering::Release);
        }
    }

    /// One batch of [`lead`](Self::lead); `true` if the next leader was
    /// refused and this one owes the queued requests their batch.
    fn lead_once(&self, outbox: &Outbox, ctx: &StepCtx<'_>, next: &dyn Fn() -> bool) -> bool {
        let owed = Cell::new(false);
        let unwinding = Unwinding {
            steps: self,
            handed: Cell::new(false),
        };
        let handed = &unwinding.handed;
        let ran = Cell::new(false);
        let pick = (!ctx.stopping.load(Ordering::Acquire)).then_some(ctx.picker);
        let (mut members, result) = outbox.step_batch(
            || std::mem::take(&mut self.queue().waiting),
            pick,
            |members| {
                if members.len() > 1 {
                    // Counts batches shared by several slots; a crash here
                    // lands in the middle of one.
                    outbox.check_failpoint("step.batch", "batched step")?;
                }
                // Still under the lock: let the next batch form behind it
                // (once: PostgreSQL may rerun a transaction it rolled back).
                if !handed.replace(true) {
                    owed.set(self.hand_over(next));
                }
                ran.set(true);
                Ok(())
            },
        );
        let taken_from_queue = members.is_empty();
        if taken_from_queue {
            // The batch failed before it collected its members (the
            // transaction never began: a poisoned handle, a lock error; or
            // a panic on the way in): the requests it was started for are
            // its members, and are told below as if collected (to step
            // alone after an error, to raise the panic after a panic).
            members = std::mem::take(&mut self.queue().waiting);
        }
        // Marked handed before handing over: if starting the next leader
        // unwinds, its own guard (`Steps::starting`) frees the queue, and
        // this leader's guard must not free it again under a leader that a
        // step pushed in between started.
        if !handed.replace(true) {
            owed.set(self.hand_over(next));
        }
        let result = match result {
            Ok(result) => result,
            Err(payload) => {
                // Nothing was written: each member raises the panic (the
                // first with its own payload, the others with its message),
                // so whichever slot ends first stops the worker with it.
                // Nobody records the members' finished sends now: they are
                // no longer ours to keep in flight (a later look settles
                // them), and leave the in-flight set with their requests.
                let message = panic_copy(payload.as_ref());
                let mut payload = Some(payload);
                for member in members {
                    let raised: Box<dyn std::any::Any + Send> =
                        payload.take().unwrap_or_else(|| Box::new(message.clone()));
                    let _ = member.reply.send(Reply::Panicked(raised));
                }
                return owed.get();
            }
        };
        match result {
            Ok(batched) => answer(outbox, ctx, members, batched),
            Err(e) if ran.get() => {
                // Written, not durable: nobody's step may be reported done.
                let mut error = Some(e);
                for member in members {
                    let e = error.take().unwrap_or(Error::Poisoned);
                    let _ = member.reply.send(Reply::Failed(e));
                }
            }
            Err(e) => {
                if members.len() > 1 {
                    tracing::debug!(error = %e, members = members.len(), "a batched step failed in its rules; each member steps alone");
                }
                for member in members {
                    let _ = member
                        .reply
                        .send(Reply::Alone(member.finished, member.claims));
                }
            }
        }
        owed.get()
    }
}

/// A panic's message, for the members of a batch beyond the first (a
/// payload cannot be cloned).
fn panic_copy(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|message| (*message).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a batched step panicked".to_owned())
}

/// A leader unwinding (a panic outside the rules) before it handed leadership on,
/// or a leader's start unwinding ([`Steps::starting`]): the requests queued
/// are dropped, so their slots get an error instead of waiting forever for a
/// leader nobody will start, and the next request leads again
/// ([`Steps::abandon`]).
///
/// **Invariant:** the queue is gathering only while a leader is running or
/// started. Every way out of a leader (its batch answered, an error, a panic
/// in the rules or in any closure it runs, starting the next leader
/// included) and of a request's push that starts one either hands the queue
/// to a leader that runs or leaves it not gathering.
struct Unwinding<'a> {
    steps: &'a Steps,
    handed: Cell<bool>,
}

impl Drop for Unwinding<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() && !self.handed.get() {
            self.steps.abandon();
        }
    }
}

/// Counts a durable batch's outcomes in the worker's tally (each finished send
/// and each item looked at but not claimed) and returns its claims per member.
fn count_outcomes(ctx: &StepCtx<'_>, batched: Batched) -> Vec<Vec<Claim>> {
    let Batched {
        finished,
        looked,
        claimed,
    } = batched;
    let mut tally = ctx.tally();
    for (receipt, wait) in finished.iter().flatten() {
        tally.add(receipt, wait.is_some());
    }
    for receipt in &looked {
        tally.add(receipt, false);
    }
    claimed
}

/// Tells each member of a durable batch its claims, after counting its outcome.
///
/// With a runtime to hand them out on, a batch of several members is
/// answered from one task there: the leader's thread wakes that one task,
/// and the members' tasks are then woken from inside the runtime, which
/// queues them on its own worker. Waking each member from the leader's
/// thread costs a wake-up across threads per member, and on a busy machine a
/// woken worker preempts the leader between two answers: the last member of
/// a 64-slot batch then started its next send up to milliseconds late.
fn answer(outbox: &Outbox, ctx: &StepCtx<'_>, members: Vec<Request>, batched: Batched) {
    let claimed = count_outcomes(ctx, batched);
    let answers: Vec<(oneshot::Sender<Reply>, Reply)> = members
        .into_iter()
        .zip(claimed)
        .map(|(member, claims)| {
            let tickets = claims
                .into_iter()
                .map(|(item, before)| ClaimTicket::new(outbox.clone(), item, before))
                .collect();
            (member.reply, Reply::Done(tickets))
        })
        .collect();
    let several = answers.len() > 1;
    let hand_out = move || {
        for (reply, answer) in answers {
            // A slot gone meanwhile drops its tickets, which releases the claims.
            let _ = reply.send(answer);
        }
    };
    match ctx.runtime {
        Some(runtime) if several => {
            drop(runtime.spawn(async move { hand_out() }));
        }
        _ => hand_out(),
    }
}

/// A member's step on its own, after its batch failed in its rules: a batch
/// of one, so its error (if any) is its own.
fn step_alone(
    outbox: &Outbox,
    ctx: &StepCtx<'_>,
    finished: Option<Finished>,
    claims: usize,
) -> Result<Vec<ClaimTicket>> {
    let (reply, _answer) = oneshot::channel();
    let alone = Request {
        finished,
        claims,
        reply,
    };
    let pick = (!ctx.stopping.load(Ordering::Acquire)).then_some(ctx.picker);
    let (members, result) = outbox.step_batch(|| vec![alone], pick, |_| Ok(()));
    // Whatever happens, the member's send leaves the in-flight set with it:
    // recorded, or, after an error, nobody records it after us (a later look
    // settles it, as after a failed single step).
    let batched = result.unwrap_or_else(|payload| std::panic::resume_unwind(payload))?;
    let claimed = count_outcomes(ctx, batched);
    drop(members);
    Ok(claimed
        .into_iter()
        .flatten()
        .map(|(item, before)| ClaimTicket::new(outbox.clone(), item, before))
        .collect())
}

/// Counts (and for a drain, receipts) of what the slots did.
#[derive(Default)]
struct Tally {
    report: DrainReport,
    keep_receipts: bool,
    released: usize,
    cancelled: usize,
    panic: Option<Box<dyn std::any::Any + Send>>,
}

impl Tally {
    fn add(&mut self, receipt: &DeliveryReceipt, retried: bool) {
        let report = &mut self.report;
        match receipt.outcome {
            Outcome::Sent => report.sent += 1,
            Outcome::Failed => report.failed += 1,
            Outcome::InFlight => report.in_flight += 1,
            Outcome::Waiting => report.waiting += 1,
            Outcome::Deferred if retried => report.retried += 1,
            Outcome::Deferred => report.deferred += 1,
        }
        if self.keep_receipts {
            report.receipts.push(receipt.clone());
        }
    }

    fn add_step(&mut self, stepped: &Stepped) {
        if let Some((receipt, wait)) = &stepped.finished {
            self.add(receipt, wait.is_some());
        }
        for receipt in &stepped.looked {
            self.add(receipt, false);
        }
    }

    fn into_worker_report(self) -> WorkerReport {
        WorkerReport {
            sent: self.report.sent,
            failed: self.report.failed,
            deferred: self.report.deferred,
            retried: self.report.retried,
            released: self.released,
            cancelled: self.cancelled,
        }
    }
}

/// How a slot ended.
enum SlotEnd {
    /// Nothing more to claim, or shutdown.
    Idle,
}

/// Claims items for free slots and starts them, until all slots are busy or
/// nothing is claimable. The free slots' claims are asked for in one step.
async fn fill<F, Fut>(
    shared: &Arc<Shared<F>>,
    slots: &mut JoinSet<Result<SlotEnd>>,
    concurrency: usize,
) -> Result<()>
where
    F: Fn(OutboxItem) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = std::result::Result<Option<String>, SendError>> + Send + 'static,
{
    while slots.len() < concurrency && !shared.stopping() {
        let free = concurrency - slots.len();
        let tickets = claim_next(shared, None, free).await?;
        let short = tickets.len() < free;
        for ticket in tickets {
            slots.spawn(slot(Arc::clone(shared), ticket));
        }
        if short {
            return Ok(());
        }
    }
    Ok(())
}

/// One durable step, batched with the other slots' steps waiting at the same
/// moment: record `finished` (if any), then claim up to `claims` items unless
/// shutting down. The claims come back as tickets, each releasing its claim
/// untouched if dropped before its send starts. Waiting for the batch holds
/// no thread: only a batch's leader runs on the blocking pool.
async fn claim_next<F>(
    shared: &Arc<Shared<F>>,
    finished: Option<(ClaimId, SendResult)>,
    claims: usize,
) -> Result<Vec<ClaimTicket>>
where
    F: Send + Sync + 'static,
{
    // From here on the send leaves the in-flight set when `finished` is
    // dropped: on an error here, or with its request, recorded or not.
    let finished = finished.map(|(claim, result)| Finished::new(&shared.outbox, claim, result));
    if finished.is_some() {
        shared.outbox.check_after_send()?;
    }
    let (reply, answer) = oneshot::channel();
    if shared.steps.push(Request {
        finished,
        claims,
        reply,
    }) && !shared.steps.starting(|| spawn_leader(shared))
    {
        // Refused: the runtime is shutting down. This poll holds no lock,
        // so the batch runs here: it records, and claims nothing more.
        shared.stopping.store(true, Ordering::Release);
        lead_on(shared);
    }
    match answer.await {
        Ok(Reply::Done(tickets)) => Ok(tickets),
        Ok(Reply::Failed(e)) => Err(e),
        Ok(Reply::Panicked(payload)) => std::panic::resume_unwind(payload),
        Ok(Reply::Alone(finished, claims)) => {
            // It records a send that ran: it must run even if the pool,
            // its runtime shutting down, refuses it (see `must_run`).
            let work = Arc::clone(shared);
            must_run(&shared.outbox, move || {
                step_alone(&work.outbox, &work.ctx(), finished, claims)
            })
            .await
        }
        // The leader unwound before answering (or the runtime is shutting
        // down): nothing of this step is known to be durable. The request
        // was dropped unanswered, and its finished send with it, out of the
        // in-flight set: the next look settles it.
        Err(_) => Err(Error::io(
            shared.outbox.location(),
            "batched step",
            std::io::Error::other("the leader of the step's batch is gone"),
        )),
    }
}

/// Starts a batch's leader on the blocking pool; it hands leadership on the
/// same way when requests queued behind its batch. `false` if the pool
/// refused it: the caller then leads itself, once it holds no lock.
///
/// A leader always runs: its batch records sends that ran. A runtime
/// shutting down drops the tasks handed to its pool without running them:
/// one handed over once the shutdown began is dropped at once, inside this
/// call, by a caller that may hold the outbox's lock (a leader handing on
/// from inside its transaction), so it does not run there (it would wait
/// for that lock forever) but is reported refused; one queued before, and
/// dropped later by the pool's threads, runs where it is dropped
/// ([`off_the_runtime_on`]). A leader run either way is a step of a worker
/// shutting down: it records the finished sends and claims nothing more
/// (nothing would send a claim from a runtime that is going away).
fn spawn_leader<F>(shared: &Arc<Shared<F>>) -> bool
where
    F: Send + Sync + 'static,
{
    const PENDING: u8 = 0;
    const SPAWNED: u8 = 1;
    const REFUSED: u8 = 2;
    // As when the pool panics handing the leader a thread (see `Steps::starting`).
    if let Err(e) = shared
        .outbox
        .check_failpoint("step.spawn", "start a batch's leader")
    {
        panic!("{e}");
    }
    let handing = Arc::new(AtomicU8::new(PENDING));
    let handed = Arc::clone(&handing);
    let work = Arc::clone(shared);
    off_the_runtime_on(Some(&shared.runtime), move |ran| {
        if ran == Ran::WhereDropped {
            if handed
                .compare_exchange(PENDING, REFUSED, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return;
            }
            work.stopping.store(true, Ordering::Release);
        }
        lead_on(&work);
    });
    handing
        .compare_exchange(PENDING, SPAWNED, Ordering::AcqRel, Ordering::Acquire)
        .is_ok()
}

/// Leads batches on this thread (see [`Steps::lead`]).
fn lead_on<F>(shared: &Arc<Shared<F>>)
where
    F: Send + Sync + 'static,
{
    shared
        .steps
        .lead(&shared.outbox, &shared.ctx(), || spawn_leader(shared));
}

/// Sends claimed items one after another: each outcome is recorded in the same
/// durable step that claims the next item.
async fn slot<F, Fut>(shared: Arc<Shared<F>>, first: ClaimTicket) -> Result<SlotEnd>
where
    F: Fn(OutboxItem) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = std::result::Result<Option<String>, SendError>> + Send + 'static,
{
    let mut next = Some(first);
    while let Some(ticket) = next.take() {
        if shared.stopping() {
            // Claimed, never handed to `send`: give it back as it was.
            let outbox = shared.outbox.clone();
            blocking(&shared.outbox, move || ticket.release_now(&outbox)).await?;
            shared.tally().released += 1;
            return Ok(SlotEnd::Idle);
        }
        let (item, guard) = ticket.start_send();
        let key = item.idempotency_key.clone();
        let claim = ClaimId::of(&item);
        // A panic in `send`'s own body, before it returns its future, fails
        // the item as panicked too; it must not end the slot's task, which
        // would raise it from `run` and cancel every other send in flight.
        let sending = CatchUnwind::start(|| (shared.send)(item));
        let mut cancelled = shared.cancelled.clone();
        let result: SendResult = tokio::select! {
            result = sending => result,
            () = deadline(&mut cancelled) => {
                // The deadline passed mid-send: it may have left. Never resent.
                guard.disarm();
                let outbox = shared.outbox.clone();
                let owned = claim.clone();
                must_run(&shared.outbox, move || outbox.abandon(&owned, SEND_CANCELLED)).await?;
                shared.tally().cancelled += 1;
                return Ok(SlotEnd::Idle);
            }
        };
        guard.disarm();
        let panicked = result.is_err();
        if panicked {
            tracing::error!(key, "send panicked; the item fails as send_panicked");
        }
        let (result, panic) = match result {
            Err(payload) if shared.keep_panics => (Err(Box::new(()) as _), Some(payload)),
            other => (other, None),
        };
        if let Some(payload) = panic {
            // Record, claim nothing more, and hand the panic to the drain's
            // caller. No slot claims from here on either: the sends in flight
            // finish and are recorded, and no new one starts (as after an
            // error, and as `process_due`, whose pass ends at the panic).
            shared.stopping.store(true, Ordering::Release);
            let outbox = shared.outbox.clone();
            let recorded = must_run(&shared.outbox, move || {
                outbox.step(Some((&claim, &result)), None)
            })
            .await;
            match recorded {
                Ok(stepped) => shared.tally().add_step(&stepped),
                Err(e) => tracing::error!(error = %e, "could not record a panicked send"),
            }
            shared.tally().panic.get_or_insert(payload);
            return Ok(SlotEnd::Idle);
        }
        next = claim_next(&shared, Some((claim, result)), 1).await?.pop();
    }
    Ok(SlotEnd::Idle)
}

/// Folds a finished slot task into the worker's state.
fn slot_ended(
    outbox: &Outbox,
    done: std::result::Result<Result<SlotEnd>, tokio::task::JoinError>,
) -> Result<()> {
    match done {
        Ok(Ok(SlotEnd::Idle)) => Ok(()),
        Ok(Err(e)) => Err(e),
        Err(join) if join.is_panic() => std::panic::resume_unwind(join.into_panic()),
        Err(join) => Err(pool_gone(outbox, &join)),
    }
}

/// How long to sleep before looking again: until the earliest due item, with a
/// re-check while another process's claim holds a line. `None`: until woken.
async fn next_pause(outbox: &Outbox) -> Result<Option<Duration>> {
    let probe = outbox.clone();
    let summary = blocking(outbox, move || probe.due_summary()).await?;
    let now = outbox.clock().now();
    let until_due = summary.next_due.map(|at| {
        // An item due now that was not claimable a moment ago (a race with
        // another process): look again very soon, never spin.
        (at - now)
            .to_std()
            .unwrap_or(Duration::ZERO)
            .max(Duration::from_millis(1))
    });
    let recheck = summary.foreign_claim.then_some(FOREIGN_CLAIM_RECHECK);
    Ok(match (until_due, recheck) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    })
}

/// Completes when the shutdown deadline passes (never, if the worker is gone).
async fn deadline(cancelled: &mut watch::Receiver<bool>) {
    if cancelled.wait_for(|c| *c).await.is_err() {
        std::future::pending::<()>().await;
    }
}

async fn sleep_for(pause: Option<Duration>) {
    match pause {
        Some(pause) => tokio::time::sleep(pause).await,
        None => std::future::pending().await,
    }
}

/// Runs one drain pass with up to `concurrency` slots (see `process_due_async`).
pub(crate) async fn drain<F, Fut>(
    outbox: &Outbox,
    concurrency: usize,
    send: F,
) -> Result<DrainReport>
where
    F: Fn(OutboxItem) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = std::result::Result<Option<String>, SendError>> + Send + 'static,
{
    let probe = outbox.clone();
    let due = blocking(outbox, move || probe.due_keys()).await?;
    let (_cancel, cancelled) = watch::channel(false);
    let shared = Arc::new(Shared {
        outbox: outbox.clone(),
        send,
        picker: Mutex::new(Picker::pass(due)),
        steps: Steps::default(),
        runtime: tokio::runtime::Handle::current(),
        stopping: AtomicBool::new(false),
        cancelled,
        tally: Mutex::new(Tally {
            keep_receipts: true,
            ..Tally::default()
        }),
        keep_panics: true,
    });
    let mut slots: JoinSet<Result<SlotEnd>> = JoinSet::new();
    let mut first_error = fill(&shared, &mut slots, concurrency.max(1)).await.err();
    while let Some(done) = slots.join_next().await {
        if let Err(e) = slot_ended(outbox, done) {
            shared.stopping.store(true, Ordering::Release);
            first_error.get_or_insert(e);
        }
        if first_error.is_none() && shared.tally().panic.is_none() {
            // A slot that ended left room: another line may have become claimable.
            if let Err(e) = fill(&shared, &mut slots, concurrency.max(1)).await {
                shared.stopping.store(true, Ordering::Release);
                first_error = Some(e);
            }
        }
    }
    let mut tally = std::mem::take(&mut *shared.tally());
    if let Some(payload) = tally.panic.take() {
        std::panic::resume_unwind(payload);
    }
    if let Some(e) = first_error {
        return Err(e);
    }
    let picker = std::mem::take(&mut *shared.picker.lock().unwrap_or_else(PoisonError::into_inner));
    let probe = outbox.clone();
    let mut report = tally.report;
    blocking(outbox, move || {
        probe.report_waiting(&picker, &mut report)?;
        Ok(report)
    })
    .await
}

/// Keeps the worker subscribed to in-process enqueues while it runs.
struct Subscription {
    outbox: Outbox,
    id: u64,
}

impl Subscription {
    fn new(outbox: &Outbox, wake: &Arc<Notify>) -> Self {
        let wake = Arc::clone(wake);
        let id = outbox.subscribe(Arc::new(move || wake.notify_one()));
        Self {
            outbox: outbox.clone(),
            id,
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.outbox.unsubscribe(self.id);
    }
}

/// Watches the state files for changes by other processes (see the module docs).
struct Watcher {
    stop: Arc<AtomicBool>,
}

/// What identifies a version of a file without reading it.
type FileStamp = Option<(u64, u64, Option<SystemTime>)>;

fn file_stamp(path: &Path) -> FileStamp {
    let meta = std::fs::metadata(path).ok()?;
    #[cfg(unix)]
    let identity = std::os::unix::fs::MetadataExt::ino(&meta);
    #[cfg(not(unix))]
    let identity = 0;
    Some((identity, meta.len(), meta.modified().ok()))
}

impl Watcher {
    /// Watches what other processes or hosts change: a directory's state
    /// files, or a PostgreSQL outbox's `NOTIFY`s.
    fn spawn_for(outbox: &Outbox, wake: Arc<Notify>, max_interval: Duration) -> Self {
        match outbox.dir() {
            Some(dir) => Self::spawn(dir, wake, max_interval),
            None => Self::listen(outbox.clone(), wake, max_interval),
        }
    }

    /// Wakes the worker on every `NOTIFY` a commit on any host sends (an
    /// enqueue, a requeue, a retry), waiting at most `max_interval` at a time
    /// so the thread notices it should stop. A lost connection is reopened on
    /// the next wait; meanwhile the worker still wakes at due times.
    #[cfg_attr(not(feature = "postgres"), allow(clippy::needless_pass_by_value))]
    fn listen(outbox: Outbox, wake: Arc<Notify>, max_interval: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        #[cfg(feature = "postgres")]
        {
            let flag = Arc::clone(&stop);
            let interval = max_interval.max(Duration::from_millis(50));
            let spawned = std::thread::Builder::new()
                .name("outbox-listen".into())
                .spawn(move || {
                    let Some(engine) = outbox.postgres_engine() else {
                        return;
                    };
                    // Dropped at the end, or while a panic unwinds this
                    // thread: either way this worker stops listening.
                    let listening = engine.start_listening();
                    while !flag.load(Ordering::Acquire) {
                        match engine.wait_for_work(interval) {
                            Ok(true) => wake.notify_one(),
                            Ok(false) => {}
                            Err(e) => {
                                tracing::warn!(error = %e, "listening for wake-ups failed; retrying");
                                std::thread::sleep(interval);
                            }
                        }
                    }
                    // Nobody reads the listening session from here on: it
                    // must not stay subscribed (see `stop_listening`).
                    drop(listening);
                });
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "could not start the wake-up listener; other hosts' enqueues wake the worker only at due times");
            }
        }
        #[cfg(not(feature = "postgres"))]
        let _ = (outbox, wake, max_interval);
        Self { stop }
    }

    fn spawn(dir: &Path, wake: Arc<Notify>, max_interval: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let snapshot: PathBuf = dir.join(crate::store::STATE_FILE);
        let counter = crate::lock::CounterProbe::open(dir);
        if let Err(e) = &counter {
            tracing::warn!(error = %e, "could not open the lock file to watch its change counter; other processes' enqueues wake the worker only at due times");
        }
        let spawned = std::thread::Builder::new()
            .name("outbox-watch".into())
            .spawn(move || {
                let look = || {
                    (
                        counter.as_ref().ok().and_then(CounterProbe::read),
                        file_stamp(&snapshot),
                    )
                };
                let mut last = look();
                let mut interval = Duration::from_millis(1);
                while !flag.load(Ordering::Acquire) {
                    std::thread::sleep(interval);
                    let now = look();
                    if now == last {
                        interval = (interval * 2).min(max_interval);
                    } else {
                        last = now;
                        interval = Duration::from_millis(1);
                        wake.notify_one();
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "could not start the journal watcher; other processes' enqueues wake the worker only at due times");
        }
        Self { stop }
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::NewMessage;

    fn open(dir: &Path, faults: &[(&str, crate::FailAction)]) -> Outbox {
        let mut builder = Outbox::builder(dir).rate_limit(u32::MAX, Duration::from_secs(60));
        for (name, action) in faults {
            builder = builder.failpoint(name, *action);
        }
        builder.open().expect("open")
    }

    fn message(key: &str, destination: &str) -> NewMessage {
        NewMessage {
            idempotency_key: key.into(),
            connector: "telegram".into(),
            grant_id: "bot-1".into(),
            destination: destination.into(),
            content: format!("hello {key}"),
            ..Default::default()
        }
    }

    /// The send under `claim`, finished and delivered as `tr-{key}`.
    fn delivered(claim: &ClaimId) -> (ClaimId, SendResult) {
        let reference = format!("tr-{}", claim.key());
        (claim.clone(), Ok(Ok(Some(reference))))
    }

    /// A claim of an item that does not exist.
    fn ghost() -> ClaimId {
        ClaimId {
            key: "ghost".into(),
            owner: None,
            attempt: 1,
            at: None,
        }
    }

    /// Enqueues a (chat-a) and b (chat-b) and claims both with single steps;
    /// returns their claims, a's first.
    fn two_claimed(outbox: &Outbox, picker: &Mutex<Picker>) -> [ClaimId; 2] {
        outbox
            .enqueue_many(vec![message("a", "chat-a"), message("b", "chat-b")])
            .expect("enqueue");
        let mut claims: Vec<ClaimId> = (0..2)
            .map(|_| {
                let stepped = outbox.step(None, Some(picker)).expect("claim");
                let (item, _) = stepped.claimed.expect("claimed");
                ClaimId::of(&item)
            })
            .collect();
        claims.sort_by(|x, y| x.key.cmp(&y.key));
        claims.try_into().expect("two claims")
    }

    /// An outbox in a temporary directory with `a` (chat-a) and `b` (chat-b)
    /// claimed by single steps, and a worker's step context over it.
    struct TwoClaimed {
        _dir: tempfile::TempDir,
        outbox: Outbox,
        picker: Mutex<Picker>,
        stopping: AtomicBool,
        tally: Mutex<Tally>,
        /// a's claim, then b's.
        claims: [ClaimId; 2],
    }

    impl TwoClaimed {
        /// `faults` armed on the outbox; `stopping`: whether the worker is
        /// shutting down (a step then claims nothing more).
        fn new(faults: &[(&str, crate::FailAction)], stopping: bool) -> Self {
            let dir = tempfile::tempdir().expect("dir");
            let outbox = open(dir.path(), faults);
            let picker = Mutex::new(Picker::worker());
            let claims = two_claimed(&outbox, &picker);
            Self {
                _dir: dir,
                outbox,
                picker,
                stopping: AtomicBool::new(stopping),
                tally: Mutex::new(Tally::default()),
                claims,
            }
        }

        fn ctx(&self) -> StepCtx<'_> {
            StepCtx {
                picker: &self.picker,
                stopping: &self.stopping,
                tally: &self.tally,
                runtime: None,
            }
        }
    }

    /// Queues a slot's step; the first queued starts the gathering.
    fn queue(
        steps: &Steps,
        outbox: &Outbox,
        (claim, result): (ClaimId, SendResult),
        claims: usize,
    ) -> oneshot::Receiver<Reply> {
        let (reply, answer) = oneshot::channel();
        steps.push(Request {
            finished: Some(Finished::new(outbox, claim, result)),
            claims,
            reply,
        });
        answer
    }

    /// Leads one batch of everything queued (nothing queues behind it).
    fn lead(steps: &Steps, outbox: &Outbox, ctx: &StepCtx<'_>) {
        steps.lead(outbox, ctx, || {
            panic!("nothing was queued behind the batch")
        });
        assert!(steps.queue().waiting.is_empty() && !steps.queue().gathering);
    }

    #[test]
    fn a_members_rule_error_fails_only_that_member_and_the_others_rerun_alone() {
        let fixture = TwoClaimed::new(&[], true);
        let TwoClaimed {
            outbox,
            tally,
            claims: [a, b],
            ..
        } = &fixture;
        let ctx = fixture.ctx();
        let steps = Steps::default();
        // Recording a send of an item that does not exist fails in the rules.
        let answers = [
            ("ghost", queue(&steps, outbox, delivered(&ghost()), 0)),
            ("a", queue(&steps, outbox, delivered(a), 0)),
            ("b", queue(&steps, outbox, delivered(b), 0)),
        ];
        lead(&steps, outbox, &ctx);
        for (name, mut answer) in answers {
            let Ok(Reply::Alone(finished, claims)) = answer.try_recv() else {
                panic!("{name} was not told to step alone after its batch failed");
            };
            match (name, step_alone(outbox, &ctx, finished, claims)) {
                ("ghost", Err(Error::NotFound { key })) => assert_eq!(key, "ghost"),
                ("a" | "b", Ok(tickets)) => assert!(tickets.is_empty()),
                (_, other) => panic!("{name}: unexpected {:?}", other.map(|t| t.len())),
            }
        }
        for (key, reference) in [("a", "tr-a"), ("b", "tr-b")] {
            let item = outbox.get(key).expect("get").expect("live");
            assert_eq!(item.transport_ref(), Some(reference), "{key} was lost");
        }
        assert_eq!(tally.lock().expect("tally").report.sent, 2);
        outbox.verify_audit().expect("audit");
    }

    /// Between a batch that failed in its rules and each member's own step,
    /// the members' finished sends are still ours: a look at one of them in
    /// between (another slot's step, a `process` of the key) must find it in
    /// flight, not take it for an orphan and declare it ambiguous, and its
    /// retryable failure is then recorded as a retry, not a terminal failure.
    #[test]
    fn a_send_waiting_to_step_alone_after_its_batch_failed_stays_in_flight() {
        let fixture = TwoClaimed::new(&[], true);
        let TwoClaimed {
            outbox,
            claims: [a, b],
            ..
        } = &fixture;
        let ctx = fixture.ctx();
        let steps = Steps::default();
        let unavailable: SendResult = Ok(Err(SendError::retryable("http_503")));
        let answers = [
            ("ghost", queue(&steps, outbox, delivered(&ghost()), 0)),
            ("a", queue(&steps, outbox, delivered(a), 0)),
            ("b", queue(&steps, outbox, (b.clone(), unavailable), 0)),
        ];
        lead(&steps, outbox, &ctx);
        let looked = outbox
            .process("b", |_| -> std::result::Result<Option<String>, SendError> {
                panic!("b was sent again while its first send waited to be recorded")
            })
            .expect("look at b");
        assert_eq!(
            looked.outcome,
            Outcome::InFlight,
            "a finished send waiting to be recorded was taken for an orphan: {looked:?}"
        );
        for (name, mut answer) in answers {
            let Ok(Reply::Alone(finished, claims)) = answer.try_recv() else {
                panic!("{name} was not told to step alone after its batch failed");
            };
            let stepped = step_alone(outbox, &ctx, finished, claims);
            assert_eq!(stepped.is_err(), name == "ghost", "{name}");
        }
        let b = outbox.get("b").expect("get").expect("live");
        assert_eq!(
            b.state(),
            crate::ItemState::Queued,
            "b's retry was lost: {b:?}"
        );
        assert!(b.next_attempt_at().is_some(), "b is not due again: {b:?}");
        assert!(
            outbox.in_flight().is_empty(),
            "a recorded send stayed in flight"
        );
        outbox.verify_audit().expect("audit");
    }

    /// Two claimed sends queued as one batch whose failpoint `point` panics:
    /// each member is handed that panic (not told to step alone, which would
    /// drop it), the queue is left for the next request to lead, nothing of
    /// the batch was written and neither send is left in flight.
    fn each_member_is_handed_the_panic_of(point: &str) {
        use crate::FailAction;
        let fixture = TwoClaimed::new(&[(point, FailAction::Panic)], true);
        let TwoClaimed {
            outbox,
            claims: [a, b],
            ..
        } = &fixture;
        let ctx = fixture.ctx();
        let steps = Steps::default();
        let mut a = queue(&steps, outbox, delivered(a), 0);
        let mut b = queue(&steps, outbox, delivered(b), 0);
        steps.lead(outbox, &ctx, || {
            panic!("nothing was queued behind the batch")
        });
        for (name, answer) in [("a", &mut a), ("b", &mut b)] {
            match answer.try_recv() {
                Ok(Reply::Panicked(payload)) => assert_eq!(
                    panic_copy(payload.as_ref()),
                    format!("failpoint {point} panicked"),
                    "{name} was handed another panic"
                ),
                Ok(Reply::Alone(..)) => {
                    panic!("{name} was told to step alone: the panic was dropped")
                }
                Ok(_) => panic!("{name} was told something other than the panic"),
                Err(e) => panic!("{name} was left without an answer: {e}"),
            }
        }
        let queue = steps.queue();
        assert!(
            queue.waiting.is_empty() && !queue.gathering,
            "a later step would wait for a leader nobody starts"
        );
        drop(queue);
        // Both sends are still unrecorded claims, and neither is in flight.
        assert!(outbox.in_flight().is_empty());
        for key in ["a", "b"] {
            let item = outbox.get(key).expect("get").expect("live");
            assert_eq!(item.state(), crate::ItemState::Queued, "{key}");
            assert!(item.transport_ref().is_none(), "{key}");
        }
    }

    #[test]
    fn a_panic_in_a_batchs_rules_is_raised_in_each_member_and_the_next_request_leads_again() {
        each_member_is_handed_the_panic_of("step.batch");
    }

    /// A panic on the way into a batch, before it has collected its members:
    /// the requests it was started for are its members and each is handed
    /// the panic.
    #[test]
    fn a_panic_before_a_batch_collects_its_members_is_raised_in_each_request() {
        each_member_is_handed_the_panic_of("step.collect");
    }

    /// After a panic on the way into a batch, the requests it was started
    /// for are told the panic, so nobody will record their finished sends:
    /// those sends must leave this handle's in-flight set, as a panic in the
    /// rules makes them. A send left marked in flight is never settled while
    /// the handle lives: every look reports it in flight, so its item is
    /// never failed as ambiguous and, under per-destination order, its
    /// destination's line stays blocked.
    #[test]
    fn a_panic_before_a_batch_collects_its_members_leaves_none_of_their_sends_in_flight() {
        use crate::FailAction;
        let fixture = TwoClaimed::new(&[("step.collect", FailAction::PanicOnHit(1))], true);
        let TwoClaimed {
            outbox,
            claims: [a, b],
            ..
        } = &fixture;
        let ctx = fixture.ctx();
        let steps = Steps::default();
        let mut answers = [
            queue(&steps, outbox, delivered(a), 0),
            queue(&steps, outbox, delivered(b), 0),
        ];
        lead(&steps, outbox, &ctx);
        for answer in &mut answers {
            assert!(matches!(answer.try_recv(), Ok(Reply::Panicked(_))));
        }
        assert!(
            outbox.in_flight().is_empty(),
            "sends nobody will record were left in flight"
        );
        // What a user sees: a look settles the unrecorded send (it may have
        // left: failed as ambiguous, never sent again) instead of reporting
        // it in flight for as long as the handle lives.
        let looked = outbox
            .process("a", |_| -> std::result::Result<Option<String>, SendError> {
                panic!("a was sent again after its send's fate was lost")
            })
            .expect("look at a");
        assert_eq!(
            looked.outcome,
            Outcome::Failed,
            "a's unrecorded send was not settled: {looked:?}"
        );
    }

    /// A leader that unwinds before handing leadership on (here: as when
    /// spawning the next leader panics, which tokio does when the OS
    /// refuses it a thread) drops the requests queued behind its batch
    /// unanswered: `claim_next` then returns "the leader of the step's batch
    /// is gone", and nobody will record that slot's finished send. It must
    /// leave the handle's in-flight set: a send left marked is reported in
    /// flight by every look, skipped by every drain of this handle and holds
    /// its chat's line until the handle is dropped, so its item never
    /// leaves. Other sends of the handle stay marked.
    #[test]
    fn a_finished_send_whose_leader_is_gone_does_not_stay_in_flight() {
        let fixture = TwoClaimed::new(&[], false);
        let TwoClaimed {
            outbox,
            claims: [a, b],
            ..
        } = &fixture;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let shared = Arc::new(Shared {
            outbox: outbox.clone(),
            send: (),
            picker: Mutex::new(Picker::worker()),
            steps: Steps::default(),
            runtime: runtime.handle().clone(),
            stopping: AtomicBool::new(false),
            cancelled: watch::channel(false).1,
            tally: Mutex::new(Tally::default()),
            keep_panics: false,
        });
        // A leader is gathering a batch: a's step queues behind it.
        shared.steps.queue().gathering = true;
        let stepped = runtime.block_on(async {
            let mut stepping = std::pin::pin!(claim_next(&shared, Some(delivered(a)), 1));
            tokio::select! {
                biased;
                _ = &mut stepping => panic!("a's step was answered without a leader"),
                () = tokio::task::yield_now() => {}
            }
            assert_eq!(shared.steps.queue().waiting.len(), 1, "a's step is queued");
            // The leader unwinds before it hands leadership on.
            let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let _leader = Unwinding {
                    steps: &shared.steps,
                    handed: Cell::new(false),
                };
                panic!("OS can't spawn worker thread");
            }));
            assert!(unwound.is_err());
            stepping.await
        });
        match stepped {
            Err(Error::Io {
                op: "batched step", ..
            }) => {}
            other => panic!(
                "a's slot was not told its leader is gone: {:?}",
                other.map(|t| t.len())
            ),
        }
        assert!(
            !outbox.in_flight().contains("a", a.stamp()),
            "a's unrecorded send was left in flight"
        );
        assert!(
            outbox.in_flight().contains("b", b.stamp()),
            "b, still being sent, was taken out of flight"
        );
        // What a user sees: a look settles a's unrecorded send (it may have
        // left: failed as ambiguous, never sent again).
        let looked = outbox
            .process("a", |_| -> std::result::Result<Option<String>, SendError> {
                panic!("a was sent again after its record was lost")
            })
            .expect("look at a");
        assert_eq!(
            looked.outcome,
            Outcome::Failed,
            "a's unrecorded send still looks in flight: {looked:?}"
        );
    }

    /// The guarantee the tests below check, named by their watchdogs.
    const NEVER_STRANDED: &str = "a panicking leader never strands the queued steps";

    /// How long a step may take before a test takes it for stranded: far
    /// beyond any step's time on a loaded machine.
    const STRANDED_AFTER: Duration = Duration::from_secs(60);

    /// A worker's shared state over `outbox`, whose leaders run on `runtime`.
    fn shared_on(outbox: &Outbox, runtime: &tokio::runtime::Runtime) -> Arc<Shared<()>> {
        Arc::new(Shared {
            outbox: outbox.clone(),
            send: (),
            picker: Mutex::new(Picker::worker()),
            steps: Steps::default(),
            runtime: runtime.handle().clone(),
            stopping: AtomicBool::new(false),
            cancelled: watch::channel(false).1,
            tally: Mutex::new(Tally::default()),
            keep_panics: false,
        })
    }

    /// Waits (polling) until `done` holds; fails naming `what` if it never does.
    fn wait_until(what: &str, done: impl Fn() -> bool) {
        let start = std::time::Instant::now();
        while !done() {
            assert!(
                start.elapsed() < STRANDED_AFTER,
                "{NEVER_STRANDED}: gave up waiting until {what}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// A step (`claim_next`, as a slot or `fill` runs it) awaited under the
    /// watchdog: a step left waiting for a leader nobody will start fails
    /// the test, naming the guarantee, instead of hanging it.
    fn step_within<T>(
        runtime: &tokio::runtime::Runtime,
        who: &str,
        step: impl Future<Output = T>,
    ) -> T {
        runtime
            .block_on(async { tokio::time::timeout(STRANDED_AFTER, step).await })
            .unwrap_or_else(|_| {
                panic!(
                    "{NEVER_STRANDED} is broken: {who} waited {STRANDED_AFTER:?} for a leader \
                     that never came"
                )
            })
    }

    /// Two claimed items, a multi-thread runtime, and a worker's shared state
    /// over them, where the `hit`-th start of a leader panics.
    fn leader_start_panics_on_hit(
        hit: u32,
    ) -> (TwoClaimed, tokio::runtime::Runtime, Arc<Shared<()>>) {
        let fixture = TwoClaimed::new(&[("step.spawn", crate::FailAction::PanicOnHit(hit))], false);
        let runtime = multi_thread_runtime();
        let shared = shared_on(&fixture.outbox, &runtime);
        (fixture, runtime, shared)
    }

    /// `a`'s step (its send recorded as delivered), spawned on `runtime`:
    /// it leads a batch unless one is gathering.
    fn spawn_step_of(
        runtime: &tokio::runtime::Runtime,
        shared: &Arc<Shared<()>>,
        a: &ClaimId,
    ) -> tokio::task::JoinHandle<Result<usize>> {
        runtime.spawn({
            let (shared, a) = (Arc::clone(shared), a.clone());
            async move {
                claim_next(&shared, Some(delivered(&a)), 0)
                    .await
                    .map(|t| t.len())
            }
        })
    }

    /// Awaits `a`'s step `first` under the watchdog: its leader's start
    /// panicked, and the step raises that panic.
    fn a_step_raises_its_leaders_panic(
        runtime: &tokio::runtime::Runtime,
        first: tokio::task::JoinHandle<Result<usize>>,
    ) {
        let first = step_within(runtime, "a's step", first);
        assert!(
            first.as_ref().is_err_and(tokio::task::JoinError::is_panic),
            "a's step did not raise its leader's panic: {first:?}"
        );
    }

    fn multi_thread_runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime")
    }

    /// A leader starts the next one from inside its transaction when a step
    /// queued behind its batch (`fill`'s, here). If that start panics (a
    /// panic in our code, or tokio's "OS can't spawn worker thread" when the
    /// OS refuses the blocking pool a thread), the batch's members raise the
    /// panic; the step queued behind must not be left waiting for a leader
    /// that never comes (a worker awaiting `fill` there never saw its slots'
    /// panic, and no shutdown could end it), and the next step must lead
    /// again.
    #[test]
    fn a_leader_whose_hand_over_panics_never_strands_the_steps_queued_behind_it() {
        // The first start (a's step) passes; the second, the hand-over, panics.
        let (fixture, runtime, shared) = leader_start_panics_on_hit(2);
        let TwoClaimed { claims: [a, _], .. } = &fixture;
        // Holding the picker stops a's leader between collecting its batch
        // and running it, so the next step queues behind the batch.
        let picker = shared.picker.lock().expect("picker");
        let first = spawn_step_of(&runtime, &shared, a);
        wait_until("a's leader collected its batch", || {
            let queue = shared.steps.queue();
            queue.gathering && queue.waiting.is_empty()
        });
        let behind = runtime.spawn({
            let shared = Arc::clone(&shared);
            async move { claim_next(&shared, None, 1).await.map(|t| t.len()) }
        });
        wait_until("the next step queued behind a's batch", || {
            shared.steps.queue().waiting.len() == 1
        });
        drop(picker);
        a_step_raises_its_leaders_panic(&runtime, first);
        match step_within(&runtime, "the step queued behind a's batch", behind) {
            Ok(Err(Error::Io {
                op: "batched step", ..
            })) => {}
            other => panic!("the step queued behind was not told its leader is gone: {other:?}"),
        }
        let queue = shared.steps.queue();
        assert!(
            queue.waiting.is_empty() && !queue.gathering,
            "{NEVER_STRANDED}: the queue was left gathering with no leader"
        );
        drop(queue);
        let next = step_within(&runtime, "a later step", claim_next(&shared, None, 1));
        assert!(
            next.is_ok(),
            "a later step failed: {:?}",
            next.map(|t| t.len())
        );
    }

    /// The first step of a batch starts its leader itself (`claim_next`);
    /// if that start panics, the step raises it, and the steps after it
    /// must find the queue free to lead again, not gathering behind a
    /// leader that was never started.
    #[test]
    fn a_step_whose_leader_fails_to_start_never_strands_the_next_steps() {
        let (fixture, runtime, shared) = leader_start_panics_on_hit(1);
        let TwoClaimed {
            outbox,
            claims: [a, b],
            ..
        } = &fixture;
        let first = spawn_step_of(&runtime, &shared, a);
        a_step_raises_its_leaders_panic(&runtime, first);
        let next = step_within(
            &runtime,
            "b's step, after a's leader failed to start",
            claim_next(&shared, Some(delivered(b)), 0),
        );
        assert!(next.is_ok(), "b's step failed: {:?}", next.map(|t| t.len()));
        let item = outbox.get("b").expect("get").expect("live");
        assert_eq!(
            item.transport_ref(),
            Some("tr-b"),
            "b's send was not recorded"
        );
        assert!(
            !outbox.in_flight().contains("a", a.stamp()),
            "a's unrecorded send was left in flight"
        );
    }

    #[test]
    fn a_failed_sync_fails_every_member_of_its_batch_and_reports_none() {
        use crate::FailAction;
        // How many syncs the set-up costs, so the batch's own sync fails.
        let probe = tempfile::tempdir().expect("dir");
        let counted = open(probe.path(), &[("journal.fsync", FailAction::DelayMs(0))]);
        two_claimed(&counted, &Mutex::new(Picker::worker()));
        let setup = counted.failpoint_hits("journal.fsync");
        let fixture = TwoClaimed::new(
            &[("journal.fsync", FailAction::ErrorOnHit(setup + 1))],
            false,
        );
        let TwoClaimed {
            outbox,
            tally,
            claims: [a, b],
            ..
        } = &fixture;
        let ctx = fixture.ctx();
        let steps = Steps::default();
        let mut b = queue(&steps, outbox, delivered(b), 0);
        let mut a = queue(&steps, outbox, delivered(a), 1);
        lead(&steps, outbox, &ctx);
        match b.try_recv() {
            Ok(Reply::Failed(Error::Io { op: "fsync", .. })) => {}
            Ok(Reply::Failed(e)) => panic!("b failed with {e}"),
            Ok(_) => panic!("b was told something other than the failure"),
            Err(e) => panic!("b got no answer: {e}"),
        }
        assert!(
            matches!(a.try_recv(), Ok(Reply::Failed(Error::Poisoned))),
            "a was not failed as poisoned"
        );
        assert_eq!(outbox.failpoint_hits("journal.fsync"), setup + 1);
        let report = &tally.lock().expect("tally").report;
        assert_eq!(
            (report.sent, report.failed, report.retried),
            (0, 0, 0),
            "an outcome of a batch whose sync failed was counted"
        );
        assert!(outbox.in_flight().is_empty());
    }
}
