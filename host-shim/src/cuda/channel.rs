//! A `cuda` channel: the shared [`ChannelCore`] plus its CUDA stream, the GP entries in
//! flight on it and its busy time.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use vgpu_protocol::ControlPage;

use super::device::Device;
use super::error::DeviceError;
use super::frontend::FrontendStats;
use super::plan::{HostAction, Op, RefWrite};
use crate::clock::now_ns;
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
    /// The REF write the stream's last kernel left owed (its grid too large to signal
    /// itself), kept for the next kernel to do as it starts: see
    /// [`CudaChannel::settle_owed`] for why it is never lost or late.
    pub owed_ref: Option<RefWrite>,
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
                owed_ref: None,
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

    /// Issues the REF write `st` owes as a stream write, and moves the last batch's end
    /// mark behind it (a batch of no entries when none is in flight).
    ///
    /// # Why an owed REF write is never lost, nor late
    ///
    /// A kernel too large to signal itself leaves its entry's REF write owed
    /// ([`Device::issue`]). The front end keeps it only while the sweep that issued the
    /// kernel ended on its batch limit with more entries fetchable, none of its entries
    /// asks for a host action, and nothing failed: the next sweep then issues the next
    /// entry, and its first op does the write as it starts (a kernel) or before it
    /// (anything else), behind the owing kernel in stream order, so never early. Every
    /// other way out of a sweep issues it: as a stream write before the batch's mark
    /// ([`CudaChannel::issue_owed`]) when the batch will not be followed at once, and
    /// here when a sweep issues nothing (its fetch is held, its caps are reached, the
    /// GPU turn is another worker's, or the channel is stopped: drains come here through
    /// [`CudaChannel::drained`]). So a write is owed for at most one sweep, and whatever
    /// waits for the channel's last mark (retire, drains, migration) waits for it too:
    /// the mark is recorded after it.
    pub fn settle_owed(&self, dev: &D, st: &mut ChanState<D>) -> Result<(), DeviceError> {
        if !self.issue_owed(dev, st)? {
            return Ok(());
        }
        let end = dev.mark(&self.stream)?;
        self.stats.end_marks.fetch_add(1, Ordering::Relaxed);
        match st.inflight.back_mut() {
            Some(last) => last.end = end,
            None => st.inflight.push_back(Inflight {
                entries: 0,
                next_get: st.fetched,
                issued_ns: now_ns(),
                end,
                runs: false,
                host: Vec::new(),
                waits: false,
                copies: 0,
                kernels: 0,
                last_kernel: "",
            }),
        }
        Ok(())
    }

    /// Issues the REF write `st` owes, if any, as a stream write (no mark: the caller
    /// records one after it); whether there was one.
    pub fn issue_owed(&self, dev: &D, st: &mut ChanState<D>) -> Result<bool, DeviceError> {
        let Some(w) = st.owed_ref.take() else {
            return Ok(false);
        };
        let write = Op::WriteValue {
            ptr: w.ptr,
            value: w.value,
        };
        if let Err(e) = dev.issue(&self.stream, &write, None) {
            st.owed_ref = Some(w);
            return Err(e);
        }
        Ok(true)
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
