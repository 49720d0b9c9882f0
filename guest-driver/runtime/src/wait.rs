//! Waiting for the GPU without burning a core: spin briefly, then yield, then sleep.
//!
//! The project's machines have two cores shared by guests, backend and GPU model, so a
//! waiter must get off the CPU quickly when the GPU is not about to finish.

use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Spin this long first: a GPU that is about to finish answers within microseconds.
const SPIN_FOR: Duration = Duration::from_micros(20);
/// Then yield (cheap when nobody else wants the core) up to this point.
const YIELD_UNTIL: Duration = Duration::from_micros(200);
/// Then sleep in naps of 1/64 of the time waited so far, within these bounds, so a wait
/// overshoots the GPU's completion by a bounded fraction while costing few wake-ups.
/// The cap bounds the overshoot of long waits: with naps of 1/16 up to 1 ms, a 16 ms sgemm
/// was seen done up to ~0.8 ms late and a 5.4 ms stencil loop ~0.3 ms (device run 7 on the
/// H100, issue 13: 3–6 % of the workload against native CUDA, whose synchronize spins).
/// At 100 µs a long wait costs ~10,000 wake-ups a second, a few % of a core.
const NAP_DIVISOR: u32 = 64;
const MIN_NAP: Duration = Duration::from_micros(10);
const MAX_NAP: Duration = Duration::from_micros(100);

/// A wait expected to take this long keeps yielding up to 5/4 of it (its completion is
/// then seen within a yield, as native CUDA's spinning synchronize sees it), but never
/// longer than this: past it, naps.
const MAX_YIELD: Duration = Duration::from_millis(2);

/// A count of device events (fence wake-ups, channel errors) that waiters sleep on:
/// what an interrupt handler bumps and a blocked waiter wakes from.
#[cfg(feature = "native")]
#[derive(Debug, Default)]
pub(crate) struct EventCount {
    count: std::sync::Mutex<u64>,
    cv: std::sync::Condvar,
}

#[cfg(feature = "native")]
impl EventCount {
    pub(crate) fn get(&self) -> u64 {
        *self.count.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn bump(&self) {
        *self.count.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        self.cv.notify_all();
    }

    /// Sleeps until the count differs from `seen` or `timeout` passes; whether it does.
    pub(crate) fn wait(&self, seen: u64, timeout: Duration) -> bool {
        let guard = self.count.lock().unwrap_or_else(|e| e.into_inner());
        let (count, _) = self
            .cv
            .wait_timeout_while(guard, timeout, |c| *c == seen)
            .unwrap_or_else(|e| e.into_inner());
        *count != seen
    }
}

/// Polls `done` with backoff until it returns `Some`, an error, or `deadline` passes.
pub(crate) fn poll_until<T>(
    deadline: Option<Instant>,
    done: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    poll_until_expecting(deadline, Duration::ZERO, done)
}

/// [`poll_until`] for a wait expected to take about `expected` (e.g. the last few waits
/// of the same loop): it keeps the core through it rather than napping past its end.
pub(crate) fn poll_until_expecting<T>(
    deadline: Option<Instant>,
    expected: Duration,
    done: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    wait_until(deadline, expected, done, None)
}

/// A wait expected to end before [`BLOCK_AFTER`] yields again from this long before its
/// expected end up to 5/4 of it, where it would nap: a nap asked for 10 µs ended ~45 µs
/// later on the H100's host, so a 3.8 ms saxpy loop, past its 2 ms of yields, could be
/// seen done up to that late. Longer than such a nap's overshoot, so the naps before it
/// end before the work does. (The VM's saxpy loop did not measurably move with it: 3.85
/// and 3.86 against 3.84 ms, H100 2026-12-07; issue 34.)
const YIELD_LEAD: Duration = Duration::from_micros(100);

/// The longest a blocked waiter sleeps before it looks again by itself: the safety net
/// for a wake-up that cannot come (a channel moved by live migration while its waiter
/// slept: the new page has nothing armed). 50 wake-ups a second cost nothing noticeable.
pub(crate) const MAX_BLOCK: Duration = Duration::from_millis(20);

/// A wait napping this long goes to sleep until an interrupt instead (with `block`). A
/// nap ends within a microsecond of its time; the interrupt comes through the backend's
/// event queue, tens of microseconds after the GPU's REF (on the H100, 2026-11-27, a
/// fresh channel's loop blocking from 200 µs on: saxpy and hotspot VM ÷ vgpu native
/// 1.01–1.07 against 1.00 with naps). So short waits nap, and long ones, where naps cost
/// thousands of wake-ups a second for a few tens of microseconds on a wait of many
/// milliseconds, sleep once.
pub(crate) const BLOCK_AFTER: Duration = Duration::from_millis(10);

/// [`poll_until_expecting`], but once it has waited [`BLOCK_AFTER`] it calls `block`
/// (with the longest it may sleep) instead of napping: a sleep that an interrupt ends
/// (issue 34).
pub(crate) fn wait_until<T>(
    deadline: Option<Instant>,
    expected: Duration,
    mut done: impl FnMut() -> Result<Option<T>>,
    mut block: Option<&mut dyn FnMut(Duration) -> Result<()>>,
) -> Result<T> {
    let start = Instant::now();
    let yield_until = (expected + expected / 4).clamp(YIELD_UNTIL, MAX_YIELD.max(YIELD_UNTIL));
    loop {
        if let Some(v) = done()? {
            return Ok(v);
        }
        let now = Instant::now();
        if deadline.is_some_and(|d| now >= d) {
            return Err(Error::Timeout);
        }
        let waited = now - start;
        if waited < SPIN_FOR {
            for _ in 0..64 {
                std::hint::spin_loop();
            }
        } else if waited < yield_until || near_expected_end(waited, expected) {
            std::thread::yield_now();
        } else if let Some(block) = block.as_mut().filter(|_| waited >= BLOCK_AFTER) {
            let left = deadline.map_or(MAX_BLOCK, |d| d.saturating_duration_since(now));
            block(left.min(MAX_BLOCK))?;
        } else {
            tight_timer_slack();
            // Until about when it is expected to end, short naps: its end is seen within
            // one (a 3 ms saxpy loop, past the yields, napped ~45 µs at a time).
            let nap = if waited < expected + expected / 4 {
                MIN_NAP
            } else {
                waited / NAP_DIVISOR
            };
            let mut nap = nap.clamp(MIN_NAP, MAX_NAP);
            if let Some(d) = deadline {
                nap = nap.min(d.saturating_duration_since(now));
            }
            std::thread::sleep(nap);
        }
    }
}

/// Whether a wait that has lasted `waited` is within [`YIELD_LEAD`] of its expected end,
/// or past it by up to a quarter (a wait expected to outlast [`BLOCK_AFTER`] blocks
/// instead).
fn near_expected_end(waited: Duration, expected: Duration) -> bool {
    expected < BLOCK_AFTER && waited + YIELD_LEAD >= expected && waited < expected + expected / 4
}

/// Once per thread: its naps end within about a microsecond of their time, not Linux's
/// default 50 µs later (which was most of a small kernel's loop overhead on the H100).
fn tight_timer_slack() {
    thread_local! {
        static DONE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    if DONE.with(|d| d.replace(true)) {
        return;
    }
    const SLACK_NS: libc::c_ulong = 1_000;
    // SAFETY: prctl with integer arguments only; it changes this thread's timer slack.
    let rc = unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, SLACK_NS, 0, 0, 0) };
    if rc != 0 {
        log::debug!("PR_SET_TIMERSLACK: {}", std::io::Error::last_os_error());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wait expected to take 4 ms naps through its middle and yields from 100 µs
    /// before its expected end to a quarter past it; a wait that long with no
    /// expectation, or one expected past the blocking point, never yields there.
    #[test]
    fn yields_only_near_the_expected_end() {
        let ms = Duration::from_millis;
        let us = Duration::from_micros;
        assert!(!near_expected_end(ms(3), ms(4)));
        assert!(!near_expected_end(us(3_899), ms(4)));
        assert!(near_expected_end(us(3_900), ms(4)));
        assert!(near_expected_end(us(4_999), ms(4)));
        assert!(!near_expected_end(ms(5), ms(4)));
        assert!(!near_expected_end(ms(3), Duration::ZERO));
        assert!(!near_expected_end(ms(20), ms(20)));
    }

    #[test]
    fn returns_value_or_times_out() {
        let mut n = 0;
        let v = poll_until(None, || {
            n += 1;
            Ok((n == 100).then_some(n))
        });
        assert_eq!(v.unwrap(), 100);
        let t = Instant::now();
        let r: Result<()> = poll_until(Some(t + Duration::from_millis(20)), || Ok(None));
        assert!(matches!(r, Err(Error::Timeout)));
        assert!(t.elapsed() < Duration::from_secs(1));
    }
}
