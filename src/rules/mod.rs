//! The delivery rules, written once for every engine (first pieces).
//!
//! A rule reads items through [`Engine`](crate::engine::Engine), decides, and
//! commits its decision as one [`ChangeSet`](crate::engine::ChangeSet) whose
//! writes name the revisions they replace. The file engine's rules still live
//! in `outbox`; they move here when `Outbox` is served by both engines
//! (ARCHITECTURE.md, "Two engines").

#![allow(
    dead_code,
    reason = "first pieces: used by the PostgreSQL engine's tests until `Outbox` runs on them"
)]

pub(crate) mod lifecycle;
