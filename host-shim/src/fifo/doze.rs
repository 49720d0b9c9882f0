//! The front end's sleep with the doorbell armed (docs/protocol.md, "Doorbell"), which
//! both GPUs' front ends take when they have nothing to do.
//!
//! Polling GP_PUT finds a submission only at the next poll, and an idle front end that
//! polls often costs CPU for nothing. So before a long sleep the front end stores
//! `WANT_DOORBELL = 1` into every channel's control page, and an application that
//! advanced GP_PUT and then finds the flag set rings the doorbell (in a VM a write that
//! the VMM turns into an eventfd kick, in loopback the kick itself), which unparks the
//! front end.
//!
//! # Why no submission waits for the sleep to end
//!
//! The front end stores the flag into every page, issues a full (SeqCst) fence, then
//! reads every GP_PUT; the application stores GP_PUT, issues a full fence, then reads the
//! flag. Of two such store-fence-load sequences at least one load sees the other's store:
//! either the front end sees the new GP_PUT and does not sleep, or the application sees
//! the flag and rings, and the ring unparks the thread (an unpark that comes before the
//! park makes the park return at once, so a ring racing with the decision is not lost).
//! Whoever else moves a GP_PUT the front end reads (the backend releasing a shadowed
//! channel's entries, a forwarded SUBMIT) rings as the application does. A channel created
//! during the sleep wakes the front end itself ([`super::tables::Tables`] unparks it on
//! every change of the channel table). The sleep still ends after `timeout`, so an
//! application that never rings is served late, not never.

use std::sync::atomic::{fence, Ordering};
use std::time::Duration;

use vgpu_protocol::ControlPage;

use super::channel_core::ChannelCore;

/// The longest sleep of an idle front end with the doorbell armed, both GPUs' default:
/// the safety net for an application that does not ring, at ~100 wake-ups a second.
pub const DEFAULT_SLEEP_NS: u64 = 10_000_000;

/// Arms the doorbell of every channel in `chans` (each with its `core`), then parks for
/// up to `timeout` unless one of them already has work (`pending`), and disarms them
/// again. Returns whether it slept.
pub fn sleep_with_doorbell<T>(
    chans: &[T],
    core: impl Fn(&T) -> &ChannelCore,
    pending: impl Fn(&T) -> bool,
    timeout: Duration,
) -> bool {
    // Stopped channels (faulted, or removed: their slot may soon be another channel's)
    // fetch nothing and get no flag.
    let live = || chans.iter().filter(|c| !core(c).is_stopped());
    for c in live() {
        core(c).store(ControlPage::WANT_DOORBELL, 1);
    }
    fence(Ordering::SeqCst);
    let sleep = !live().any(&pending);
    if sleep {
        std::thread::park_timeout(timeout);
    }
    for c in live() {
        core(c).store(ControlPage::WANT_DOORBELL, 0);
    }
    sleep
}
