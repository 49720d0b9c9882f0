//! A channel's semaphore-wait time ([`crate::hal::ChannelCounters::sem_wait_ns`]): finished
//! waits plus the one going on, read by the scheduler while a GPU thread updates it.
//!
//! One writer (the thread that runs the channel's entries) calls [`WaitClock::begin`] and
//! [`WaitClock::end`]; any thread reads. A reading between `end`'s two stores may count
//! the ending wait twice; `reported` keeps readings from going backwards afterwards, so
//! a reader sees a monotonic counter that is never short of the true total.

use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, Default)]
pub struct WaitClock {
    /// Finished waits, ns.
    done_ns: AtomicU64,
    /// When the wait going on began (CLOCK_MONOTONIC ns; 0: none).
    since: AtomicU64,
    /// The largest value read so far.
    reported: AtomicU64,
}

impl WaitClock {
    /// A wait begins at `at`, or goes on (then the earlier start stays).
    pub fn begin(&self, at: u64) {
        if self.since.load(Ordering::SeqCst) == 0 {
            self.since.store(at.max(1), Ordering::SeqCst);
        }
    }

    /// The wait going on (if any) ended at `at`; `minus_ns` of it was not waiting (work
    /// that ran in the same span, on GPUs that only see the span).
    pub fn end(&self, at: u64, minus_ns: u64) {
        let since = self.since.load(Ordering::SeqCst);
        if since != 0 {
            let ns = at.saturating_sub(since).saturating_sub(minus_ns);
            self.done_ns.fetch_add(ns, Ordering::SeqCst);
            self.since.store(0, Ordering::SeqCst);
        }
    }

    /// Wait time so far at `now`, including the wait going on; never decreasing.
    pub fn read(&self, now: u64) -> u64 {
        let since = self.since.load(Ordering::SeqCst);
        let done = self.done_ns.load(Ordering::SeqCst);
        let going = if since == 0 {
            0
        } else {
            now.saturating_sub(since)
        };
        let v = done.saturating_add(going);
        self.reported.fetch_max(v, Ordering::SeqCst).max(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_finished_and_running_waits_and_never_goes_back() {
        let w = WaitClock::default();
        assert_eq!(w.read(100), 0);
        w.begin(100);
        w.begin(150); // goes on: the start stays
        assert_eq!(w.read(180), 80);
        w.end(200, 0);
        assert_eq!(w.read(300), 100);
        w.end(400, 0); // no wait going on: nothing added
        assert_eq!(w.read(400), 100);
        w.begin(500);
        w.end(600, 30);
        assert_eq!(w.read(700), 170);
        // A reading during a wait that then ends with work subtracted never shrinks.
        w.begin(1000);
        assert_eq!(w.read(1100), 270);
        w.end(1100, 90);
        assert_eq!(w.read(1100), 270);
    }
}
