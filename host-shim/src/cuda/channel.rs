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
    /// The REF value to store once the mark is reached.
    pub due_ref: Option<DueRef>,
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
    /// The REF write the stream's last op left owed (a kernel whose grid is too large to
    /// signal itself), for the next op of the batch to do first; the batch's mark takes
    /// what is still owed when it ends ([`DueRef`]). Never kept past a sweep.
    pub owed_ref: Option<RefWrite>,
    /// REF's value in stream order just before `owed_ref`'s.
    pub owed_from: u32,
    /// The last REF value issued, in stream order (done or owed).
    pub ref_last: u32,
    /// REF writes issued to the GPU (kernels' signals, prior writes, stream writes).
    pub gpu_ref_writes: u64,
    /// The last entry's methods and plan, kept for their buffers: the next entry is
    /// fetched and planned into them.
    pub methods: Vec<vgpu_protocol::Method>,
    pub plan: super::plan::Plan,
}

/// A REF value the front end stores itself once its batch's mark is reached: the batch's
/// last kernel could not write it (its grid is too large to signal itself), and no op
/// followed in the batch to do it. Where a stream write between two kernels costs the
/// GPU ~2.4 µs (H100, 2026-11-28), the host's store costs it nothing.
///
/// # Why REF is never early, never lost and never undone
///
/// - *Never early.* A due value is stored once its batch's mark is reached, and the mark
///   is recorded after the kernel that owes it, which has therefore completed, with all
///   stream work before it. An owed write done by the next op of the batch runs after the
///   owing kernel in stream order.
/// - *Never lost.* An owed write is done by the next op of its batch
///   ([`CudaChannel::issue_op`]) or taken by the batch's mark, which every batch gets (also
///   one cut short by a faulting entry; only a failing mark faults the whole channel).
///   A reached batch's due value is stored by the front end's retire, or before that by
///   [`CudaChannel::drained`]: a channel counts as drained (pauses, VRAM moves,
///   migration) only with its REF stored.
/// - *Never undone.* REF holds the last value in stream order. Due values are stored in
///   batch order under the channel's lock, so a later due value never precedes an
///   earlier one. If no REF write went to the GPU after the batch's mark
///   (`gpu_writes` unchanged), no later value can be in REF yet: a plain store. Otherwise
///   the GPU may already have written a later one, and the store is a compare-and-swap
///   from `from`, the value REF holds in stream order just before this one: it lands
///   only where no later value has. (A guest whose `SET_REF` values repeat can see the
///   swap miss on an equal later value: REF then holds that value; its own channel only.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DueRef {
    pub value: u32,
    /// REF's value in stream order just before this one.
    pub from: u32,
    /// [`ChanState::gpu_ref_writes`] when the batch's mark was recorded.
    pub gpu_writes: u64,
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

    /// The REF write still owed as a batch ends: its mark takes it.
    pub fn take_due(&mut self) -> Option<DueRef> {
        self.owed_ref.take().map(|w| DueRef {
            value: w.value,
            from: self.owed_from,
            gpu_writes: self.gpu_ref_writes,
        })
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
        // Where a migrated channel's REF stood.
        let ref_last = core.load(ControlPage::REF);
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
                owed_from: 0,
                ref_last,
                gpu_ref_writes: 0,
                methods: Vec::new(),
                plan: Default::default(),
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

    /// Issues `op` behind the REF write the stream owes so far (the op does it first:
    /// a builtin kernel as it starts, anything else by a stream write before it), and
    /// keeps what `op` leaves owed, with REF's bookkeeping (see [`DueRef`]).
    pub fn issue_op(&self, dev: &D, st: &mut ChanState<D>, op: &Op) -> Result<(), DeviceError> {
        let prior = st.owed_ref.take();
        let owed = match dev.issue(&self.stream, op, prior) {
            Ok(owed) => owed,
            Err(e) => {
                st.owed_ref = prior;
                return Err(e);
            }
        };
        let own = match *op {
            Op::LaunchSignal(_, ref s) => Some(s.value),
            Op::WriteValue { ptr, value } if Some(ptr) == self.ref_ptr => Some(value),
            _ => None,
        };
        let before = st.ref_last;
        if let Some(v) = own {
            st.ref_last = v;
        }
        let on_gpu = u64::from(prior.is_some()) + u64::from(own.is_some() && owed.is_none());
        st.gpu_ref_writes += on_gpu;
        if owed.is_some() {
            st.owed_from = before;
        }
        st.owed_ref = owed;
        Ok(())
    }

    /// Stores a reached batch's [`DueRef`]: plainly when no REF write was issued to the
    /// GPU after the batch's mark, else only over the value REF held before it.
    pub fn store_due(&self, due: DueRef, gpu_ref_writes: u64) {
        if gpu_ref_writes == due.gpu_writes {
            self.core.set_ref(due.value);
        } else {
            self.core.advance_ref(due.from, due.value);
        }
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
