//! The error codes the rules write on items (public: tools recognise them),
//! and how a caller-supplied code is made storable.

/// The error code of an item whose claimant died mid-send: it may or may not have left.
pub const AMBIGUOUS_AFTER_RESTART: &str = "ambiguous_delivery_after_restart";
/// The error code of an item whose `send` panicked (treated as ambiguous).
pub const SEND_PANICKED: &str = "send_panicked";
/// The error code of an item whose async send future was dropped before it
/// finished (treated as ambiguous: it may have been delivered). Set by the
/// `tokio` feature's `process_async`; defined always so tools can recognise it.
pub const SEND_CANCELLED: &str = "send_cancelled";
/// The error code of an item an operator cancelled.
pub const CANCELLED: &str = "cancelled_by_operator";
/// The error code on a deferral because the platform asked (with `retry_after`)
/// not to send to the destination until a moment that has not come yet.
pub const DESTINATION_COOLDOWN: &str = "destination_cooldown";
/// The error code on a deferral because sends to the destination are spaced
/// by the interval learned from its `retry_after`s (adaptive pacing: after a
/// 429, one send per learned interval instead of a herd when the cooldown ends).
pub const DESTINATION_PACED: &str = "destination_paced";
/// The error code on a deferral caused by the cap across all destinations.
pub const GLOBAL_RATE_CAPPED: &str = "global_rate_cap";
/// The error code on a deferral caused by the destination's rate cap.
pub const RATE_CAPPED: &str = "destination_rate_cap";
/// The error code of an item still failing (retryably) when its
/// [`give_up_after`](crate::OutboxBuilder::give_up_after) age ran out: it was
/// never delivered, and the outbox stopped trying.
pub const GAVE_UP: &str = "gave_up_after_deadline";
/// The error code of a queued item that already used up its attempts (e.g. after
/// `max_attempts` was lowered).
pub const ATTEMPTS_EXHAUSTED: &str = "max_attempts_exhausted";

/// Makes a caller-supplied code or reference storable: no NUL or control
/// characters, not blank, at most `max` bytes (cut on a character boundary).
pub(crate) fn sanitize(text: &str, max: usize) -> String {
    let mut clean: String = text
        .chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect();
    if clean.trim().is_empty() {
        "unspecified".clone_into(&mut clean);
    }
    if clean.len() > max {
        let mut cut = max;
        while !clean.is_char_boundary(cut) {
            cut -= 1;
        }
        clean.truncate(cut);
    }
    clean
}
