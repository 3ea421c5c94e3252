//! The `durable-outbox` operator tool, run as a real process against real outbox
//! directories: ones this crate wrote, one the Python reference wrote, damaged
//! ones, and one a bot is writing to while the tool runs.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests fail loudly by panicking"
)]

mod harness;
#[cfg(feature = "postgres")]
#[path = "../support/postgres.rs"]
mod pg_server;

mod audit_removal;
mod bulk;
mod concurrent_bot;
mod export;
mod history;
mod inspect;
mod operator_actions;
#[cfg(feature = "postgres")]
mod postgres;
mod replies;
#[cfg(unix)]
mod security;
mod seed_v1;
mod status;
mod usage;
mod verify;
#[cfg(feature = "test-failpoints")]
mod verify_during_removal;
#[cfg(feature = "postgres")]
mod verify_postgres;
