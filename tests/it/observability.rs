//! What an operator's dashboards see: `tracing` spans around enqueue, claim,
//! send and finish, and (feature `metrics`) counters, a latency histogram and
//! queue gauges through the `metrics` facade.
//!
//! Bodies in `on_both_engines!` run on the file engine and on PostgreSQL
//! (`name::file`, `name::postgres`); every body here runs on both.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use durable_outbox::SendError;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

use crate::engines::on_both_engines;
use crate::harness::secs;

/// A span's name and its fields as last recorded.
type SpanFields = (&'static str, HashMap<String, String>);

/// Every span a test thread opened, with its fields as last recorded.
#[derive(Default)]
struct Spans {
    spans: Mutex<HashMap<u64, SpanFields>>,
    /// Every event's message, in order.
    events: Mutex<Vec<String>>,
}

struct Fields<'a>(&'a mut HashMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(
            field.name().to_owned(),
            format!("{value:?}").trim_matches('"').to_owned(),
        );
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

thread_local! {
    /// Where this thread's spans go, while a test collects them.
    static COLLECTING: std::cell::RefCell<Option<Arc<Spans>>> =
        const { std::cell::RefCell::new(None) };
}

/// The process-wide subscriber: hands each span to the collector of the thread
/// that opened it, if any. Global rather than scoped (`with_default`) because
/// tracing caches per callsite whether anyone is interested: with only a scoped
/// subscriber, another test thread that hits a callsite first can cache "no one"
/// for it. A global one is interested in every callsite, always.
struct Router {
    next: AtomicU64,
}

impl Router {
    fn collector() -> Option<Arc<Spans>> {
        COLLECTING.with(|c| c.borrow().clone())
    }
}

impl Subscriber for Router {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        if let Some(spans) = Self::collector() {
            let mut fields = HashMap::new();
            span.record(&mut Fields(&mut fields));
            spans
                .spans
                .lock()
                .unwrap()
                .insert(id, (span.metadata().name(), fields));
        }
        Id::from_u64(id)
    }
    fn record(&self, span: &Id, values: &Record<'_>) {
        if let Some(spans) = Self::collector()
            && let Some((_, fields)) = spans.spans.lock().unwrap().get_mut(&span.into_u64())
        {
            values.record(&mut Fields(fields));
        }
    }
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        if let Some(spans) = Self::collector() {
            let mut fields = HashMap::new();
            event.record(&mut Fields(&mut fields));
            let message = fields.remove("message").unwrap_or_default();
            spans.events.lock().unwrap().push(message);
        }
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

/// Runs `f` with this thread's spans collected.
fn collecting_spans(f: impl FnOnce()) -> Arc<Spans> {
    static INSTALL: std::sync::Once = std::sync::Once::new();
    INSTALL.call_once(|| {
        tracing::subscriber::set_global_default(Router {
            next: AtomicU64::new(0),
        })
        .expect("no other global subscriber in this test binary");
    });
    // Callsites registered before the subscriber existed: ask them again.
    tracing::callsite::rebuild_interest_cache();
    let spans = Arc::new(Spans::default());
    COLLECTING.with(|c| *c.borrow_mut() = Some(Arc::clone(&spans)));
    f();
    COLLECTING.with(|c| *c.borrow_mut() = None);
    spans
}

impl Spans {
    /// The fields of every span named `name`, in the order opened.
    fn named(&self, name: &str) -> Vec<HashMap<String, String>> {
        let spans = self.spans.lock().unwrap();
        let mut found: Vec<(&u64, &HashMap<String, String>)> = spans
            .iter()
            .filter(|(_, (n, _))| *n == name)
            .map(|(id, (_, fields))| (id, fields))
            .collect();
        found.sort_by_key(|(id, _)| **id);
        found.into_iter().map(|(_, f)| f.clone()).collect()
    }
}

fn field<'a>(span: &'a HashMap<String, String>, name: &str) -> &'a str {
    span.get(name).map_or("", String::as_str)
}

on_both_engines! {
    fn enqueue_claim_send_and_finish_each_have_a_span_with_key_destination_attempt_and_outcome(engine) {
        let h = engine.harness_with(|b| b.max_inline_wait(std::time::Duration::ZERO));
        let spans = collecting_spans(|| {
            h.enqueue("k", "chat-1");
            h.outbox
                .process("k", |_| Err(SendError::retryable("http_503")))
                .unwrap();
            h.clock.advance(secs(3600));
            h.outbox.process("k", |_| Ok(Some("tg-1".into()))).unwrap();
        });
        let enqueue = spans.named("outbox.enqueue");
        assert_eq!(enqueue.len(), 1);
        assert_eq!(
            (
                field(&enqueue[0], "key"),
                field(&enqueue[0], "destination"),
                field(&enqueue[0], "outcome")
            ),
            ("k", "chat-1", "queued")
        );
        let claims: Vec<String> = spans
            .named("outbox.claim")
            .iter()
            .map(|s| {
                format!(
                    "{} {} {}",
                    field(s, "key"),
                    field(s, "attempt"),
                    field(s, "outcome")
                )
            })
            .collect();
        assert_eq!(claims, ["k 1 claimed", "k 2 claimed"]);
        let sends = spans.named("outbox.send");
        assert_eq!(sends.len(), 2);
        assert_eq!(field(&sends[1], "destination"), "chat-1");
        assert_eq!(field(&sends[1], "attempt"), "2");
        let finishes: Vec<(String, String)> = spans
            .named("outbox.finish")
            .iter()
            .map(|s| {
                (
                    field(s, "outcome").to_owned(),
                    field(s, "error_code").to_owned(),
                )
            })
            .collect();
        assert_eq!(
            finishes,
            [
                ("deferred".to_owned(), "http_503".to_owned()),
                ("sent".to_owned(), String::new())
            ]
        );
    }
}

#[cfg(feature = "metrics")]
mod metrics_facade {
    use std::collections::BTreeMap;
    use std::sync::{Arc, Mutex};

    use durable_outbox::{ItemState, SendError};
    use metrics::{
        Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata,
        Recorder, SharedString, Unit,
    };

    use crate::harness::secs;

    /// Every metric's values by `name{label=value,…}`.
    #[derive(Default)]
    struct Recorded(Mutex<BTreeMap<String, Vec<f64>>>);

    struct Handle(Arc<Recorded>, String);

    impl Handle {
        fn push(&self, value: f64, accumulate: bool) {
            let mut all = self.0.0.lock().unwrap();
            let values = all.entry(self.1.clone()).or_default();
            match (accumulate, values.last_mut()) {
                (true, Some(last)) => *last += value,
                _ => values.push(value),
            }
        }
    }

    impl CounterFn for Handle {
        fn increment(&self, value: u64) {
            self.push(value as f64, true);
        }
        fn absolute(&self, value: u64) {
            self.push(value as f64, false);
        }
    }
    impl GaugeFn for Handle {
        fn increment(&self, value: f64) {
            self.push(value, true);
        }
        fn decrement(&self, value: f64) {
            self.push(-value, true);
        }
        fn set(&self, value: f64) {
            self.push(value, false);
        }
    }
    impl HistogramFn for Handle {
        fn record(&self, value: f64) {
            self.push(value, false);
        }
    }

    struct TestRecorder(Arc<Recorded>);

    impl TestRecorder {
        fn handle(&self, key: &Key) -> Arc<Handle> {
            let mut labels: Vec<String> = key
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            labels.sort();
            Arc::new(Handle(
                Arc::clone(&self.0),
                format!("{}{{{}}}", key.name(), labels.join(",")),
            ))
        }
    }

    impl Recorder for TestRecorder {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
            Counter::from_arc(self.handle(key))
        }
        fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::from_arc(self.handle(key))
        }
        fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::from_arc(self.handle(key))
        }
    }

    crate::engines::on_both_engines! {
        #[allow(clippy::float_cmp, reason = "whole numbers, recorded exactly")]
        fn outcomes_latency_and_queue_gauges_reach_the_recorder(engine) {
            let h = engine.harness_with(|b| b.max_attempts(1));
            let values = Arc::new(Recorded::default());
            let recorder = TestRecorder(Arc::clone(&values));
            metrics::with_local_recorder(&recorder, || {
                for (key, chat) in [("ok", "chat-1"), ("gone", "chat-2"), ("later", "chat-3")] {
                    h.enqueue(key, chat);
                }
                h.enqueue("waiting", "chat-4");
                h.outbox.cancel("waiting", "ops", "not now").unwrap();
                h.enqueue("new", "chat-5");
                h.clock.advance(secs(2));
                h.outbox
                    .process_due(|item| match item.idempotency_key() {
                        "ok" => Ok(Some("tg-1".into())),
                        "gone" => Err(SendError::permanent("chat_not_found")),
                        "later" => Err(SendError::retryable("http_429").retry_after(secs(60))),
                        _ => {
                            // Leave "new" for later: still queued when the gauges are set.
                            Err(SendError::retryable("http_429").retry_after(secs(60)))
                        }
                    })
                    .unwrap();
            });
            assert_eq!(
                h.outbox.get("later").unwrap().unwrap().state(),
                ItemState::Queued
            );
            let all = values.0.lock().unwrap();
            let total = |labels: &str| {
                all.get(&format!("durable_outbox_outcomes_total{{{labels}}}"))
                    .and_then(|v| v.last().copied())
                    .unwrap_or(0.0)
            };
            assert_eq!(total("class=,error_code=,outcome=queued"), 5.0, "{all:#?}");
            assert_eq!(total("class=,error_code=,outcome=sent"), 1.0);
            assert_eq!(
                total("class=permanent,error_code=chat_not_found,outcome=failed"),
                1.0
            );
            assert_eq!(
                total("class=retryable,error_code=http_429,outcome=retrying"),
                2.0
            );
            assert_eq!(
                total("class=,error_code=cancelled_by_operator,outcome=cancelled"),
                1.0
            );
            assert_eq!(
                all.get("durable_outbox_enqueue_to_sent_seconds{}"),
                Some(&vec![2.0]),
                "enqueued, then sent two seconds later"
            );
            assert_eq!(all.get("durable_outbox_queued{}"), Some(&vec![2.0]));
            assert_eq!(all.get("durable_outbox_in_flight{}"), Some(&vec![0.0]));
            assert_eq!(
                all.get("durable_outbox_oldest_queued_age_seconds{}"),
                Some(&vec![2.0])
            );
        }
    }
}

#[cfg(feature = "tokio")]
on_both_engines! {
    /// The worker says what it is doing: started, stopping, stopped with its tally.
    fn the_worker_logs_its_state_changes(engine) {
        let h = engine.harness();
        h.enqueue("k", "chat-1");
        let spans = collecting_spans(|| {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let report = runtime
                .block_on(
                    h.outbox
                        .worker(|_| async { Ok(Some("tg-1".to_owned())) })
                        .run(async {
                            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                        }),
                )
                .unwrap();
            assert_eq!(report.sent, 1);
        });
        let events = spans.events.lock().unwrap().clone();
        let position = |text: &str| {
            events
                .iter()
                .position(|e| e.starts_with(text))
                .unwrap_or_else(|| panic!("no {text:?} in {events:?}"))
        };
        assert!(
            position("delivery worker started") < position("delivery worker stopping")
                && position("delivery worker stopping") < position("delivery worker stopped"),
            "{events:?}"
        );
    }
}
