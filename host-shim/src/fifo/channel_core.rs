//! What every channel has, whichever GPU runs it: identity, address space, control-page
//! slot, error state, the counters both GPUs keep, and where its activity is counted. Each
//! GPU's channel type contains one [`ChannelCore`] and adds its own execution state.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use vgpu_protocol::{ControlPage, ErrorCode};

use super::control_pages::ControlPages;
use crate::hal::{
    ActivityCounter, ChannelConfig, ChannelCounters, ChannelId, ChannelResume, ContextId,
    EventSink, GpuEvent,
};
use crate::mmu::AddressSpace;
use crate::wait_clock::WaitClock;

pub struct ChannelCore {
    pub id: ChannelId,
    pub ctx: ContextId,
    pub space: Arc<AddressSpace>,
    pub cfg: ChannelConfig,
    pub slot: u32,
    pages: Arc<ControlPages>,
    sink: Arc<dyn EventSink>,
    /// Time its head entry waited on a semaphore acquire (the GPU's front-end thread
    /// writes it).
    pub sem_wait: WaitClock,
    pub gp_completed: AtomicU64,
    pub kernels: AtomicU64,
    pub copies: AtomicU64,
    error: Mutex<Option<(ErrorCode, u64)>>,
    /// Set once the channel has stopped (error, kill or destroy): engines drop its work.
    pub stopped: AtomicBool,
    /// Set while a holder keeps the front end from fetching the channel's next entries
    /// ([`crate::hal::Gpu::hold_fetch`]).
    fetch_held: AtomicBool,
    /// GP entries completed before this channel existed (a channel resumed after live
    /// migration): where the front end starts fetching.
    start_get: AtomicU32,
    /// Where its activity is counted ([`crate::hal::Gpu::count_activity`]).
    activity: OnceLock<Arc<ActivityCounter>>,
    /// False once the channel was removed with GPU work that may still write its control
    /// page (a drain that timed out): its slot is then never handed out again, so a late
    /// write cannot land in another channel's page.
    slot_reusable: AtomicBool,
}

impl ChannelCore {
    /// A channel in control-page `slot` (taken from `pages`), whose page gets the fields a
    /// fresh channel starts with.
    pub fn new(
        id: ChannelId,
        ctx: ContextId,
        space: Arc<AddressSpace>,
        cfg: ChannelConfig,
        slot: u32,
        pages: Arc<ControlPages>,
        sink: Arc<dyn EventSink>,
    ) -> Self {
        pages.init(slot, cfg.gp_entries);
        ChannelCore {
            id,
            ctx,
            space,
            cfg,
            slot,
            pages,
            sink,
            sem_wait: WaitClock::default(),
            gp_completed: AtomicU64::new(0),
            kernels: AtomicU64::new(0),
            copies: AtomicU64::new(0),
            error: Mutex::new(None),
            stopped: AtomicBool::new(false),
            fetch_held: AtomicBool::new(false),
            start_get: AtomicU32::new(0),
            activity: OnceLock::new(),
            slot_reusable: AtomicBool::new(true),
        }
    }

    /// Makes a channel that nothing has run on yet continue where a migrated channel
    /// stopped: the control page's GPU-written fields and GP_PUT = GP_GET, the fetch
    /// position, and a stopped channel's error (recorded without an event: its owner was
    /// told on the source). Called before the channel is visible to the front end.
    pub fn resume_at(&self, at: ChannelResume) {
        self.start_get.store(at.gp_get, Ordering::Release);
        self.pages.restore(self.slot, &at);
        if let Some(err) = at.error {
            *self.error.lock().unwrap_or_else(|e| e.into_inner()) = Some(err);
            self.stopped.store(true, Ordering::Release);
        }
    }

    /// Where the front end starts fetching (0 for a fresh channel).
    pub fn start_get(&self) -> u32 {
        self.start_get.load(Ordering::Acquire)
    }

    /// Counts the channel's activity into `counter` from now on; false if it already
    /// counts into another one.
    pub fn count_activity(&self, counter: Arc<ActivityCounter>) -> bool {
        let same = Arc::as_ptr(&counter);
        self.activity.get_or_init(|| counter);
        self.activity.get().is_some_and(|c| Arc::as_ptr(c) == same)
    }

    /// The front end fetched or completed an entry, or the channel stopped on an error.
    pub fn note_activity(&self) {
        if let Some(c) = self.activity.get() {
            c.bump();
        }
    }

    pub fn load(&self, field: usize) -> u32 {
        self.pages.load(self.slot, field)
    }

    pub fn store(&self, field: usize, v: u32) {
        self.pages.store(self.slot, field, v)
    }

    /// Where a device writes `field` of this channel's page, if the pages are registered
    /// with one.
    pub fn gpu_field_addr(&self, field: usize) -> Option<u64> {
        self.pages.gpu_field_addr(self.slot, field)
    }

    /// Keeps the front end from fetching new entries (`held`) or lets it again. The
    /// front end reads the flag under its channel lock before each fetch, so a holder
    /// that sets it and then takes that lock once knows no fetch is under way or to come.
    pub fn set_fetch_held(&self, held: bool) {
        self.fetch_held.store(held, Ordering::Release);
    }

    pub fn fetch_held(&self) -> bool {
        self.fetch_held.load(Ordering::Acquire)
    }

    pub fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    pub fn error(&self) -> Option<(ErrorCode, u64)> {
        *self.error.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stops the channel with an error: recorded, written to the control page, and sent
    /// to the owner once. Later faults of an already stopped channel are ignored. Work a
    /// GPU cannot abandon (a kernel already launched on a CUDA stream) still finishes;
    /// nothing more of the channel's runs.
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

    pub fn notify(&self, token: u32) {
        self.pages.bump(self.slot, ControlPage::NOTIFY_SEQ);
        self.sink.event(GpuEvent::Notify {
            channel: self.id,
            token,
        });
    }

    /// Wakes the channel's sleeping fence waiter once `REF` has reached the value it
    /// armed (`REF_WAKE`): clears `REF_WAKE_ARMED` and sends a `Fence` event; whether it
    /// did. Called by the front end whenever REF may have moved (the GPU writes it on
    /// its own) — one load of the armed word when nobody sleeps.
    ///
    /// # Why no waiter sleeps past its fence
    ///
    /// The waiter stores `REF_WAKE`, then `REF_WAKE_ARMED = 1`, issues a full fence and
    /// reads `REF`; it sleeps only if `REF` had not reached its value. The front end
    /// calls this after REF may have moved and keeps calling it while the channel has
    /// work on the GPU. If the waiter's load missed the final REF, that REF was written
    /// after the waiter's fence, so a later call here sees both the armed word and the
    /// REF, and sends the event; if REF never reaches the value, the waiter's own
    /// timeout ends the sleep. A clear that races with a re-arm (another value stored
    /// meanwhile) at worst wakes the waiter early: it re-reads REF and arms again.
    /// Where the GPU writes REF itself (the `cuda` front end's pass) no fence is needed:
    /// no store of this thread's is ordered against the look at the armed word.
    pub fn wake_fence_waiter(&self) -> bool {
        if self.load(ControlPage::REF_WAKE_ARMED) == 0 {
            return false;
        }
        let armed_for = self.load(ControlPage::REF_WAKE);
        let reached = self.load(ControlPage::REF);
        let error = self.load(ControlPage::ERROR) != 0;
        if !error && !vgpu_protocol::counter_reached(reached, armed_for) {
            return false;
        }
        let armed = self.load(ControlPage::REF_WAKE_ARMED);
        if armed == 0
            || !self
                .pages
                .compare_store(self.slot, ControlPage::REF_WAKE_ARMED, armed, 0)
        {
            return false;
        }
        self.sink.event(GpuEvent::Fence {
            channel: self.id,
            reference: reached,
        });
        true
    }

    /// Stores REF (a `SET_REF` the front end executes itself) and wakes a waiter armed
    /// for it: the full fence orders the store before the look at the armed word, as the
    /// waiter orders its arming before its look at REF.
    pub fn set_ref(&self, value: u32) {
        self.store(ControlPage::REF, value);
        std::sync::atomic::fence(Ordering::SeqCst);
        self.wake_fence_waiter();
    }

    /// [`ChannelCore::set_ref`], but only while REF still holds `from`: the GPU may
    /// already have written a later value, which must not be undone. Whether it stored.
    pub fn advance_ref(&self, from: u32, value: u32) -> bool {
        let stored = self
            .pages
            .compare_store(self.slot, ControlPage::REF, from, value);
        std::sync::atomic::fence(Ordering::SeqCst);
        self.wake_fence_waiter();
        stored
    }

    /// The counters, with the busy time the GPU keeps its own way.
    pub fn counters(&self, busy_ns: u64) -> ChannelCounters {
        ChannelCounters {
            busy_ns,
            gp_completed: self.gp_completed.load(Ordering::Relaxed),
            kernels: self.kernels.load(Ordering::Relaxed),
            copies: self.copies.load(Ordering::Relaxed),
            sem_wait_ns: self.sem_wait.read(crate::clock::now_ns()),
        }
    }

    /// The channel's GPU work may outlive it: never reuse its control-page slot.
    pub fn retire_slot(&self) {
        self.slot_reusable.store(false, Ordering::Release);
    }
}

impl Drop for ChannelCore {
    fn drop(&mut self) {
        // The last reference is gone (no engine holds the channel), so the slot can be
        // reused unless GPU work may still write it.
        if self.slot_reusable.load(Ordering::Acquire) {
            self.pages.give_back(self.slot);
        } else {
            log::warn!(
                "channel {:?}: control-page slot {} retired (GPU work may still write it)",
                self.id,
                self.slot
            );
        }
    }
}
