//! A sim channel: configuration, control-page slot, counters and error state. The PFIFO's
//! execution state for it (fetch position, pending work) lives in the PFIFO thread.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use vgpu_protocol::{ControlPage, ErrorCode};

use crate::fifo::control_pages::ControlPages;
use crate::hal::{
    ActivityCounter, ChannelConfig, ChannelCounters, ChannelId, ChannelResume, ContextId,
    EventSink, GpuEvent,
};
use crate::mmu::AddressSpace;
use crate::wait_clock::WaitClock;

pub struct SimChannel {
    pub id: ChannelId,
    pub ctx: ContextId,
    pub space: Arc<AddressSpace>,
    pub cfg: ChannelConfig,
    pub slot: u32,
    pages: Arc<ControlPages>,
    sink: Arc<dyn EventSink>,
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
    /// Time its head entry waited on a semaphore acquire (the PFIFO thread writes it).
    pub sem_wait: WaitClock,
    pub gp_completed: AtomicU64,
    pub kernels: AtomicU64,
    pub copies: AtomicU64,
    error: Mutex<Option<(ErrorCode, u64)>>,
    /// Set once the channel has stopped (error, kill or destroy): engines drop its work.
    pub stopped: AtomicBool,
    /// GP entries completed before this channel existed (a channel resumed after live
    /// migration): where the PFIFO starts fetching.
    start_get: AtomicU32,
    /// Where its activity is counted ([`crate::hal::Gpu::count_activity`]).
    activity: OnceLock<Arc<ActivityCounter>>,
}

/// What a channel shares with its context.
pub struct Owner {
    pub ctx: ContextId,
    pub space: Arc<AddressSpace>,
    pub busy_ns: Arc<AtomicU64>,
}

impl SimChannel {
    pub fn new(
        id: ChannelId,
        owner: Owner,
        cfg: ChannelConfig,
        slot: u32,
        pages: Arc<ControlPages>,
        sink: Arc<dyn EventSink>,
    ) -> Self {
        pages.init(slot, cfg.gp_entries);
        let Owner {
            ctx,
            space,
            busy_ns: context_busy_ns,
        } = owner;
        SimChannel {
            id,
            ctx,
            space,
            cfg,
            slot,
            pages,
            sink,
            busy_ns: AtomicU64::new(0),
            running_since: AtomicU64::new(0),
            running_until: AtomicU64::new(0),
            busy_reported: AtomicU64::new(0),
            context_busy_ns,
            sem_wait: WaitClock::default(),
            gp_completed: AtomicU64::new(0),
            kernels: AtomicU64::new(0),
            copies: AtomicU64::new(0),
            error: Mutex::new(None),
            stopped: AtomicBool::new(false),
            start_get: AtomicU32::new(0),
            activity: OnceLock::new(),
        }
    }

    /// Makes a channel that nothing has run on yet continue where a migrated channel
    /// stopped: the control page's GPU-written fields and GP_PUT = GP_GET, the fetch
    /// position, and a stopped channel's error (recorded without an event: its owner was
    /// told on the source).
    pub fn resume_at(&self, at: ChannelResume) {
        self.start_get.store(at.gp_get, Ordering::Release);
        self.pages.restore(self.slot, &at);
        if let Some(err) = at.error {
            *self.error.lock().unwrap_or_else(|e| e.into_inner()) = Some(err);
            self.stopped.store(true, Ordering::Release);
        }
    }

    /// Counts the channel's activity into `counter` from now on; false if it already
    /// counts into another one.
    pub fn count_activity(&self, counter: Arc<ActivityCounter>) -> bool {
        let same = Arc::as_ptr(&counter);
        self.activity.get_or_init(|| counter);
        self.activity.get().is_some_and(|c| Arc::as_ptr(c) == same)
    }

    /// The PFIFO fetched or completed an entry, or the channel stopped on an error.
    pub fn note_activity(&self) {
        if let Some(c) = self.activity.get() {
            c.bump();
        }
    }

    /// Where the PFIFO starts fetching (0 for a fresh channel).
    pub fn start_get(&self) -> u32 {
        self.start_get.load(Ordering::Acquire)
    }

    pub fn load(&self, field: usize) -> u32 {
        self.pages.load(self.slot, field)
    }

    pub fn store(&self, field: usize, v: u32) {
        self.pages.store(self.slot, field, v)
    }

    pub fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    pub fn error(&self) -> Option<(ErrorCode, u64)> {
        *self.error.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stops the channel with an error: recorded, written to the control page, and sent
    /// to the owner once. Later faults of an already stopped channel are ignored.
    pub fn fault(&self, code: ErrorCode, info: u64) {
        {
            let mut e = self.error.lock().unwrap_or_else(|e| e.into_inner());
            if e.is_some() {
                return;
            }
            *e = Some((code, info));
        }
        self.stopped.store(true, Ordering::Release);
        self.pages.show_error(self.slot, code, info);
        self.note_activity();
        log::debug!("channel {:?} faulted: {code} ({info:#x})", self.id);
        self.sink.event(GpuEvent::Error {
            channel: self.id,
            code,
            info,
        });
    }

    /// Stops the channel without an error event (destroy).
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
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

    pub fn notify(&self, token: u32) {
        self.pages.bump(self.slot, ControlPage::NOTIFY_SEQ);
        self.sink.event(GpuEvent::Notify {
            channel: self.id,
            token,
        });
    }

    pub fn counters(&self) -> ChannelCounters {
        ChannelCounters {
            busy_ns: self.busy_now(),
            gp_completed: self.gp_completed.load(Ordering::Relaxed),
            kernels: self.kernels.load(Ordering::Relaxed),
            copies: self.copies.load(Ordering::Relaxed),
            sem_wait_ns: self.sem_wait.read(crate::clock::now_ns()),
        }
    }
}

impl Drop for SimChannel {
    fn drop(&mut self) {
        // The last reference is gone (no engine holds the channel), so the slot can be reused.
        self.pages.give_back(self.slot);
    }
}
