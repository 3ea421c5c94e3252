//! Integration tests, one module per guarantee the outbox makes.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests fail loudly by panicking"
)]

mod engines;
mod harness;
#[cfg(feature = "postgres")]
#[path = "../support/postgres.rs"]
mod pg_server;
mod seeded;

mod adaptive_pacing;
mod at_most_once;
mod audit_log;
mod audit_removal;
mod bad_input;
mod bulk_actions;
mod byte_compat;
#[cfg(feature = "postgres")]
mod claim_identity;
#[cfg(feature = "postgres")]
mod connection_cap;
mod damaged_never_overwritten;
#[cfg(feature = "postgres")]
mod deferred_sealing;
mod delivery;
mod durable_writes;
mod failure_class;
mod hostile_input;
mod idempotent_transport;
#[cfg(feature = "postgres")]
mod large_pipelines;
#[cfg(feature = "postgres")]
mod late_deliveries;
#[cfg(feature = "postgres")]
mod migration;
mod model_check;
mod observability;
mod one_lifecycle;
mod operator_actions;
mod ordering;
#[cfg(feature = "postgres")]
mod postgres_outbox;
mod power_loss_regressions;
mod rate_caps;
mod replies;
mod retries;
#[cfg(unix)]
mod security;
mod seed_compat;
#[cfg(feature = "postgres")]
mod server_restart;
mod settings;
#[cfg(feature = "test-failpoints")]
mod stale_handles;

#[cfg(unix)]
mod disk_full;

#[cfg(feature = "tokio")]
mod async_api;
#[cfg(all(unix, feature = "test-failpoints"))]
mod audit_rotation;
#[cfg(all(feature = "tokio", feature = "test-failpoints"))]
mod batched_steps;
#[cfg(all(unix, feature = "test-failpoints"))]
mod concurrency;
#[cfg(feature = "test-failpoints")]
mod crash_repair;
#[cfg(feature = "tokio")]
mod current_thread_runtime;
#[cfg(all(feature = "tokio", feature = "test-failpoints"))]
mod cut_off_sends_never_resent;
#[cfg(feature = "tokio")]
mod finished_sends_survive_shutdown;
#[cfg(all(unix, feature = "test-failpoints"))]
mod group_commit;
#[cfg(feature = "test-failpoints")]
mod history;
#[cfg(feature = "tokio")]
mod http_loopback;
#[cfg(feature = "test-failpoints")]
mod injected_faults;
#[cfg(all(target_os = "linux", feature = "test-failpoints"))]
mod journal_growth_durable;
#[cfg(all(unix, feature = "matrix", feature = "test-failpoints"))]
mod matrix_delivery;
#[cfg(all(target_os = "linux", feature = "test-failpoints"))]
mod power_loss;
#[cfg(all(unix, feature = "test-failpoints"))]
mod processes;
#[cfg(all(feature = "postgres", feature = "tokio"))]
mod unrecorded_sends;
#[cfg(feature = "tokio")]
mod worker;
#[cfg(all(unix, feature = "tokio", feature = "test-failpoints"))]
mod worker_processes;
