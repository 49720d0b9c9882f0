//! A `cuda` channel: its control-page slot, its CUDA stream, the GP entries in flight on
//! it, counters and error state.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use vgpu_protocol::{ControlPage, ErrorCode};

use super::device::Device;
use super::plan::HostAction;
use crate::fifo::control_pages::ControlPages;
use crate::hal::{ChannelConfig, ChannelCounters, ChannelId, ContextId, EventSink, GpuEvent};
use crate::mmu::AddressSpace;
use crate::wait_clock::WaitClock;

/// Issued GP entries sharing one end mark.
pub struct Inflight<M> {
    /// GP entries in the batch.
    pub entries: u32,
    /// GP_GET after the batch completes.
    pub next_get: u32,
    pub start: Option<M>,
    pub end: M,
    /// Whether the entry put work on the stream (only then is it charged).
    pub runs: bool,
    pub host: Vec<HostAction>,
    pub waits: bool,
    pub copies: u64,
}

/// Front-end state of a channel (touched by the front end and by drains).
pub struct ChanState<D: Device> {
    /// GP entries fetched and issued so far.
    pub fetched: u32,
    pub inflight: VecDeque<Inflight<D::Mark>>,
    /// Per-channel staging buffer on the device (pointer, bytes).
    pub scratch: Option<(u64, u64)>,
    /// Timeline time at which the last retired entry ended.
    pub last_end: u64,
}

pub struct CudaChannel<D: Device> {
    pub id: ChannelId,
    pub ctx: ContextId,
    pub space: Arc<AddressSpace>,
    pub cfg: ChannelConfig,
    pub slot: u32,
    pages: Arc<ControlPages>,
    sink: Arc<dyn EventSink>,
    pub stream: D::Stream,
    pub state: Mutex<ChanState<D>>,
    pub busy_ns: AtomicU64,
    /// Time a batch ending in a semaphore wait was in flight, less its kernels' time (the
    /// front end issues nothing behind such a batch; the wait itself runs on the GPU).
    pub sem_wait: WaitClock,
    pub gp_completed: AtomicU64,
    pub kernels: AtomicU64,
    pub copies: AtomicU64,
    error: Mutex<Option<(ErrorCode, u64)>>,
    pub stopped: AtomicBool,
    /// CLOCK_MONOTONIC ns when the front end last issued an entry of this channel (0:
    /// never); see [`CudaChannel::recently_active`].
    pub last_issue_ns: AtomicU64,
    /// Where the GPU writes this channel's REF (its control page in registered host
    /// memory); `None` when the control pages are not registered (the front end then
    /// stores REF when an entry's completion mark is reached).
    pub ref_ptr: Option<u64>,
    /// False once the channel was removed with GPU work that may still write its control
    /// page (a drain that timed out): its slot is then never handed out again, so a late
    /// REF write cannot land in another channel's page.
    slot_reusable: AtomicBool,
}

impl<D: Device> CudaChannel<D> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: ChannelId,
        ctx: ContextId,
        space: Arc<AddressSpace>,
        cfg: ChannelConfig,
        slot: u32,
        pages: Arc<ControlPages>,
        sink: Arc<dyn EventSink>,
        stream: D::Stream,
    ) -> Self {
        pages.init(slot, cfg.gp_entries);
        let ref_ptr = pages.gpu_field_addr(slot, ControlPage::REF);
        CudaChannel {
            id,
            ctx,
            space,
            cfg,
            slot,
            pages,
            sink,
            stream,
            state: Mutex::new(ChanState {
                fetched: 0,
                inflight: VecDeque::new(),
                scratch: None,
                last_end: 0,
            }),
            busy_ns: AtomicU64::new(0),
            sem_wait: WaitClock::default(),
            gp_completed: AtomicU64::new(0),
            kernels: AtomicU64::new(0),
            copies: AtomicU64::new(0),
            error: Mutex::new(None),
            stopped: AtomicBool::new(false),
            last_issue_ns: AtomicU64::new(0),
            ref_ptr,
            slot_reusable: AtomicBool::new(true),
        }
    }

    /// The channel's GPU work may outlive it: never reuse its control-page slot.
    pub fn retire_slot(&self) {
        self.slot_reusable.store(false, Ordering::Release);
    }

    /// Continues where a migrated channel stopped: the front end fetches entry
    /// `at.gp_get` next, the control page shows the saved fields with GP_PUT = GP_GET, and
    /// a saved error stops the channel again without a new event. Called before the
    /// channel is visible to the front end.
    pub fn resume_at(&self, at: crate::hal::ChannelResume) {
        self.lock().fetched = at.gp_get;
        self.pages.restore(self.slot, &at);
        if let Some(err) = at.error {
            *self.error.lock().unwrap_or_else(|e| e.into_inner()) = Some(err);
            self.stopped.store(true, Ordering::Release);
        }
    }

    pub fn lock(&self) -> std::sync::MutexGuard<'_, ChanState<D>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
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

    /// Stops the channel with an error (once): recorded, written to the control page and
    /// sent to the owner. Work already on the stream still runs to completion (CUDA cannot
    /// abandon a launched kernel); nothing more is issued.
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
        log::debug!("cuda channel {:?} faulted: {code} ({info:#x})", self.id);
        self.sink.event(GpuEvent::Error {
            channel: self.id,
            code,
            info,
        });
    }

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

    pub fn counters(&self) -> ChannelCounters {
        ChannelCounters {
            busy_ns: self.busy_ns.load(Ordering::Relaxed),
            gp_completed: self.gp_completed.load(Ordering::Relaxed),
            kernels: self.kernels.load(Ordering::Relaxed),
            copies: self.copies.load(Ordering::Relaxed),
            sem_wait_ns: self.sem_wait.read(crate::clock::now_ns()),
        }
    }
}

impl<D: Device> Drop for CudaChannel<D> {
    fn drop(&mut self) {
        if self.slot_reusable.load(Ordering::Acquire) {
            self.pages.give_back(self.slot);
        } else {
            log::warn!(
                "cuda channel {:?}: control-page slot {} retired (GPU work may still write it)",
                self.id,
                self.slot
            );
        }
    }
}
