//! A sim channel: the shared [`ChannelCore`] plus the sim's busy-time bookkeeping. The
//! PFIFO's execution state for it (fetch position, pending work) lives in the PFIFO thread.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::fifo::channel_core::ChannelCore;
use crate::fifo::tables::FifoChannel;
use crate::hal::ChannelCounters;

pub struct SimChannel {
    pub core: ChannelCore,
    busy_ns: AtomicU64,
    /// While a spin kernel holds an engine: when it took the engine and when it will end
    /// (0: none), so the busy counter ticks while the kernel runs, as hardware counters do.
    running_since: AtomicU64,
    running_until: AtomicU64,
    /// The largest busy time reported, so readings never go backwards while a running
    /// kernel's time moves from the estimate to the charged total.
    busy_reported: AtomicU64,
    /// The context's running total, which outlives its channels.
    context_busy_ns: Arc<AtomicU64>,
}

impl SimChannel {
    pub fn new(core: ChannelCore, context_busy_ns: Arc<AtomicU64>) -> Self {
        SimChannel {
            core,
            busy_ns: AtomicU64::new(0),
            running_since: AtomicU64::new(0),
            running_until: AtomicU64::new(0),
            busy_reported: AtomicU64::new(0),
            context_busy_ns,
        }
    }

    /// Charges engine time to the channel and its context.
    pub fn charge(&self, ns: u64) {
        self.busy_ns.fetch_add(ns, Ordering::Relaxed);
        self.context_busy_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// A spin kernel took an engine at `start` and holds it until `until`.
    pub fn set_running(&self, start: u64, until: u64) {
        self.running_until.store(until, Ordering::SeqCst);
        self.running_since.store(start.max(1), Ordering::SeqCst);
    }

    /// The spin kernel left its engine; call before charging its time.
    pub fn clear_running(&self) {
        self.running_since.store(0, Ordering::SeqCst);
    }

    /// Busy time including the running part of a spin kernel, never decreasing.
    fn busy_now(&self) -> u64 {
        // Load the total before the running mark: the engine clears the mark before it
        // charges, so a reading never counts a kernel both ways.
        let busy = self.busy_ns.load(Ordering::SeqCst);
        let since = self.running_since.load(Ordering::SeqCst);
        let running = if since == 0 {
            0
        } else {
            let until = self.running_until.load(Ordering::SeqCst);
            crate::clock::now_ns().min(until).saturating_sub(since)
        };
        let v = busy.saturating_add(running);
        self.busy_reported.fetch_max(v, Ordering::SeqCst).max(v)
    }
}

impl FifoChannel for SimChannel {
    fn core(&self) -> &ChannelCore {
        &self.core
    }

    fn counters(&self) -> ChannelCounters {
        self.core.counters(self.busy_now())
    }
}
