//! A `cuda` channel: the shared [`ChannelCore`] plus its CUDA stream, the GP entries in
//! flight on it and its busy time.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use vgpu_protocol::ControlPage;

use super::device::Device;
use super::frontend::FrontendStats;
use super::plan::HostAction;
use crate::fifo::channel_core::ChannelCore;
use crate::fifo::tables::FifoChannel;
use crate::hal::ChannelCounters;

/// Issued GP entries sharing one end mark.
pub struct Inflight<M> {
    /// GP entries in the batch.
    pub entries: u32,
    /// GP_GET after the batch completes.
    pub next_get: u32,
    /// Host time the batch was issued: it is charged from then (mapped onto the GPU
    /// timeline), or from its stream's previous entry's end if that came later.
    pub issued_ns: u64,
    pub end: M,
    /// Whether the entry put work on the stream (only then is it charged).
    pub runs: bool,
    pub host: Vec<HostAction>,
    pub waits: bool,
    pub copies: u64,
    pub kernels: u64,
    pub last_kernel: &'static str,
}

/// Front-end state of a channel (touched by the front end and by drains).
pub struct ChanState<D: Device> {
    /// GP entries fetched and issued so far.
    pub fetched: u32,
    pub inflight: VecDeque<Inflight<D::Mark>>,
    /// Per-channel staging buffer on the device (pointer, bytes).
    pub scratch: Option<(u64, u64)>,
    /// The word in device memory on which the blocks of a kernel that writes REF itself
    /// count themselves done (`kernels.cu`); made with the channel, outside the guest's
    /// first timed submission (`None` when kernels do not signal). `Some(0)`: it could
    /// not be had, REF is written by stream writes.
    pub signal_count: Option<u64>,
    /// Timeline time at which the last retired entry ended.
    pub last_end: u64,
    /// Recent GP entries' time on the stream, start to end (1/8-weighted mean; 0 before
    /// the first): with entries in flight, about how long a drain of the channel waits.
    pub mean_entry_ns: u64,
}

impl<D: Device> ChanState<D> {
    /// GP entries issued and not yet completed.
    pub fn entries_in_flight(&self) -> u32 {
        self.inflight.iter().map(|i| i.entries).sum()
    }

    /// Folds a completed batch of `entries` that ran `ns` on the stream into the mean.
    pub fn note_entry_time(&mut self, ns: u64, entries: u32) {
        let per_entry = ns / u64::from(entries.max(1));
        self.mean_entry_ns = if self.mean_entry_ns == 0 {
            per_entry
        } else {
            super::timeline::mean_with(self.mean_entry_ns, per_entry)
        };
    }

    /// Most GP entries this channel may have in flight so that about `queue_ahead_ns`
    /// of its work is queued on the GPU (0: no bound). Never fewer than two: one runs
    /// while the next waits, so the GPU does not idle between entries.
    pub fn entry_cap(&self, queue_ahead_ns: u64) -> u32 {
        if queue_ahead_ns == 0 || self.mean_entry_ns == 0 {
            return u32::MAX;
        }
        u32::try_from(queue_ahead_ns / self.mean_entry_ns)
            .unwrap_or(u32::MAX)
            .max(2)
    }
}

pub struct CudaChannel<D: Device> {
    pub core: ChannelCore,
    pub stream: D::Stream,
    pub state: Mutex<ChanState<D>>,
    pub busy_ns: AtomicU64,
    /// CLOCK_MONOTONIC ns when the front end last issued an entry of this channel (0:
    /// never); see [`CudaChannel::recently_active`].
    pub last_issue_ns: AtomicU64,
    /// Where the GPU writes this channel's REF (its control page in registered host
    /// memory); `None` when the control pages are not registered (the front end then
    /// stores REF when an entry's completion mark is reached).
    pub ref_ptr: Option<u64>,
    /// The GPU's front-end counters (shared by its channels).
    pub stats: Arc<FrontendStats>,
}

impl<D: Device> CudaChannel<D> {
    /// A channel on `stream`; the front end fetches from the core's start position
    /// (where a migrated channel stopped, else 0). Its core's semaphore-wait clock counts
    /// the time a batch ending in a semaphore wait was in flight, less its kernels' time
    /// (the front end issues nothing behind such a batch; the wait itself runs on the GPU).
    pub fn new(core: ChannelCore, stream: D::Stream, stats: Arc<FrontendStats>) -> Self {
        let ref_ptr = core.gpu_field_addr(ControlPage::REF);
        let fetched = core.start_get();
        CudaChannel {
            core,
            stream,
            state: Mutex::new(ChanState {
                fetched,
                inflight: VecDeque::new(),
                scratch: None,
                signal_count: None,
                last_end: 0,
                mean_entry_ns: 0,
            }),
            busy_ns: AtomicU64::new(0),
            last_issue_ns: AtomicU64::new(0),
            ref_ptr,
            stats,
        }
    }

    pub fn lock(&self) -> std::sync::MutexGuard<'_, ChanState<D>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<D: Device> FifoChannel for CudaChannel<D> {
    fn core(&self) -> &ChannelCore {
        &self.core
    }

    fn counters(&self) -> ChannelCounters {
        self.core.counters(self.busy_ns.load(Ordering::Relaxed))
    }
}
