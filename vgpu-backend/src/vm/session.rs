//! Per-VM session: every GPU object a VM's guest created, who owns it, and what it uses.
//!
//! The state is split in two:
//! - [`SessionState`]: plain data keyed by the guest-visible ids (contexts, VRAM objects,
//!   GPU mappings, channels, usage) — what live migration will serialize;
//! - [`HalHandles`]: the HAL's handles for those objects on *this* host (context and
//!   channel ids, VRAM offsets, the sysmem snapshots) — rebuilt on a migration target.
//!
//! Ownership: a context belongs to the guest PID that created it; VRAM objects, mappings
//! and channels belong to the (PID, context) that created them. Ids are per VM, so another
//! VM's ids are simply not found.
//!
//! Lifetime: a session lives as long as its vhost-user connection. When the frontend
//! disconnects (or the backend restarts) the session is torn down: every channel, context
//! and VRAM object of the VM is destroyed in the HAL. Nothing of the guest's GPU state
//! survives a backend restart; the guest driver must re-create its contexts, buffers and
//! channels (a reconnecting frontend resets the device, so the driver probes again).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use log::{debug, warn};
use vgpu_host_shim::{ActivityCounter, ChannelId, ContextId, Gpu};
use vgpu_protocol::device::slot_offset;
use vgpu_protocol::request::GuestRange;
use vgpu_protocol::PAGE_SIZE;

use crate::capacity::{Counts, VmCapacity};
use crate::events::{EventQueue, EVENT_FIFO_CAPACITY};
use crate::guest_mem::GuestSysMemory;
use crate::sched::handle::RetiredChannel;
use crate::shmem::{NullShm, ShmMapper};

/// Per-VM resource limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmLimits {
    pub max_contexts: u32,
    pub max_channels: u32,
    /// Contexts and channels of the GPU kept for this VM whatever other VMs take
    /// ([`crate::capacity`]); at most `max_contexts` and `max_channels` count.
    pub reserved_contexts: u32,
    pub reserved_channels: u32,
    /// VRAM the VM's objects may hold in total.
    pub vram_bytes: u64,
    /// Guest memory the VM may have mapped into GPU address spaces in total.
    pub mapped_guest_bytes: u64,
    /// VRAM objects the VM may hold beyond `vram_bytes`, swapped to system memory
    /// ([`crate::vram`]); 0: no oversubscription.
    pub swap_bytes: u64,
    /// GPU mappings (MAP_VRAM, MAP_GUEST) the VM may have at once.
    pub max_mappings: u32,
    /// Host memory the VM's GPU mappings may take: the GPU's page tables and the
    /// backend's records of them.
    pub page_table_bytes: u64,
}

impl VmLimits {
    /// The reserve the VM asks of the GPU: its reserved contexts and channels, at most
    /// its limits.
    pub fn reserve(&self) -> Counts {
        Counts {
            contexts: self.reserved_contexts.min(self.max_contexts),
            channels: self.reserved_channels.min(self.max_channels),
        }
    }
}

impl Default for VmLimits {
    fn default() -> Self {
        VmLimits {
            max_contexts: 64,
            max_channels: 128,
            reserved_contexts: 1,
            reserved_channels: 4,
            vram_bytes: 512 << 20,
            mapped_guest_bytes: 1 << 30,
            swap_bytes: 0,
            max_mappings: 16384,
            // 2 GiB mapped with 4 KiB pages, 30 GiB with 64 KiB pages.
            page_table_bytes: 32 << 20,
        }
    }
}

/// A VM's usage and counters, as the operator sees them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VmStats {
    /// Whether a frontend is connected now.
    pub connected: bool,
    /// Whether the driver acked `VIRTIO_VGPU_F_FORWARDED` (forwarded submission).
    pub forwarded: bool,
    pub contexts: u32,
    pub channels: u32,
    pub vram_bytes: u64,
    pub mapped_guest_bytes: u64,
    pub aperture_bytes: u64,
    /// GPU mappings, and the host memory they take (page tables and their records).
    pub mappings: u32,
    pub page_table_bytes: u64,
    /// Control requests handled (all connections).
    pub requests: u64,
    /// Of those, answered with an error.
    pub errors: u64,
    /// Frontend disconnects (each tore the session down).
    pub disconnects: u64,
    pub events_delivered: u64,
    pub events_dropped: u64,
    pub events_pending: u64,
    /// Connections the backend ended because the driver broke a virtqueue.
    pub ring_errors: u64,
}

/// A context: a GPU address space of one guest process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContextState {
    pub pid: u32,
}

/// A VRAM object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemState {
    pub pid: u32,
    pub ctx: u32,
    /// Bytes allocated (at least what was asked for).
    pub size: u64,
    pub align: u64,
    /// Region-relative offset of its aperture window, if mapped there.
    pub aperture: Option<u64>,
}

/// What a GPU mapping points at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MappingTarget {
    /// A whole VRAM object.
    Vram { mem: u32 },
    /// Guest-physical ranges, mapped back to back.
    Guest { ranges: Vec<GuestRange> },
}

/// A GPU mapping made by MAP_VRAM or MAP_GUEST, keyed by (ctx, va).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MappingState {
    pub pid: u32,
    pub size: u64,
    /// Page size code (`vgpu_protocol::request::PAGE_*`).
    pub page: u32,
    pub flags: u32,
    pub target: MappingTarget,
}

/// A channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChannelState {
    pub pid: u32,
    pub ctx: u32,
    /// Its control-page slot in the BAR (reserved while the channel lives).
    pub slot: u32,
    /// Whether the slot is mapped: the real control page, or its shadow page while the
    /// channel is shadowed (see [`crate::shadow`]).
    pub slot_mapped: bool,
    pub gp_ring_va: u64,
    pub gp_entries: u32,
}

impl ChannelState {
    /// A forwarded channel: no slot, no BAR view; the guest submits with `SUBMIT`.
    pub fn forwarded(&self) -> bool {
        self.slot == vgpu_protocol::device::NO_SLOT
    }

    /// Whether the shadow mechanism can hold the channel: its slot shows its page, or it
    /// has no slot (forwarded: the hold catches its `SUBMIT`s).
    pub fn holdable(&self) -> bool {
        self.slot_mapped || self.forwarded()
    }
}

/// Resource usage counted against [`VmLimits`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub vram_bytes: u64,
    pub mapped_guest_bytes: u64,
    pub aperture_bytes: u64,
    /// Host memory of the VM's GPU mappings: its contexts' page tables as the GPU counts
    /// them, plus the records of the mappings.
    pub page_table_bytes: u64,
}

/// The serializable part of a session.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SessionState {
    pub contexts: BTreeMap<u32, ContextState>,
    pub mems: BTreeMap<u32, MemState>,
    /// Keyed by (ctx, va).
    pub mappings: BTreeMap<(u32, u64), MappingState>,
    pub channels: BTreeMap<u32, ChannelState>,
    pub usage: Usage,
    /// Last ids handed out (contexts, VRAM objects and channels get fresh ids, never
    /// reused soon, so a stale id in a buggy guest process does not hit a new object).
    pub last_context: u32,
    pub last_mem: u32,
    pub last_channel: u32,
    /// Guests' modules and the functions bound from them (issue 31; migrated with their
    /// images and variables, `vm::migration`).
    pub modules: BTreeMap<u32, ModuleState>,
    pub functions: BTreeMap<u32, FunctionState>,
    pub last_module: u32,
    pub last_function: u32,
}

/// A guest's module: who loaded it, into which context, and the image as loaded (kept
/// for a live migration, which loads it again on the destination).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModuleState {
    pub pid: u32,
    pub ctx: u32,
    pub image: std::sync::Arc<[u8]>,
}

/// A function bound for LAUNCH_FUNCTION: its process, context, module and name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FunctionState {
    pub pid: u32,
    pub ctx: u32,
    pub module: u32,
    pub name: String,
}

/// HAL handles of a session's objects on this host.
#[derive(Default)]
pub struct HalHandles {
    pub contexts: BTreeMap<u32, (ContextId, Arc<GuestSysMemory>)>,
    /// The huge-page slot each context was told to use (`CREATE_CONTEXT`; not migrated:
    /// a restored context's slot is read from its mappings).
    pub huge_slots: BTreeMap<u32, u32>,
    /// VRAM objects in chunks (in VRAM or swapped, see [`crate::vram`]).
    pub vram: BTreeMap<u32, crate::vram::backing::ObjBacking>,
    /// The VM's frames for pieces smaller than a chunk ([`crate::vram::slabs`]).
    pub slabs: crate::vram::slabs::SlabPool,
    pub channels: BTreeMap<u32, ChannelId>,
    /// The backend's own mappings of control pages, for SUBMIT (API-remoting baseline),
    /// keyed by the HAL's channel id, which is never reused.
    pub control_maps: BTreeMap<ChannelId, crate::shadow::PageMap>,
}

/// Per-PID busy-time accounting: live channels (read from the HAL on demand) plus what
/// destroyed channels had accumulated.
#[derive(Debug, Default)]
pub(crate) struct BusyBook {
    live: BTreeMap<u32, LiveChannel>,
    retired: BTreeMap<u32, u64>,
    /// Channels destroyed since the scheduler last looked, with their final busy time:
    /// it charges what they used since its previous reading (see [`RetiredChannel`]).
    recent: std::collections::VecDeque<RetiredChannel>,
    /// The VM's activity count ([`SessionShared::activity`]): raised when a channel comes
    /// or goes.
    activity: Arc<ActivityCounter>,
}

/// A live channel in the book.
#[derive(Debug)]
pub(crate) struct LiveChannel {
    pub pid: u32,
    pub hal: ChannelId,
    /// Its activity count (see [`SessionShared::count_activity`]).
    pub activity: Arc<ActivityCounter>,
    /// The count when the scheduler last found it quiet (`None`: not quiet then): while
    /// the count stays there, the channel did nothing since.
    pub quiet_at: Option<u64>,
    /// Its control page, where the GPU's front end says it sleeps (`WANT_DOORBELL`);
    /// `None` if it could not be mapped (doorbells then always ring).
    pub page: Option<crate::shadow::PageMap>,
}

/// Destroyed channels kept for the scheduler between two of its readings; beyond that
/// (no scheduler running) the oldest are dropped.
const RECENT_RETIRED: usize = 4096;

/// What a session shares with observers (the operator API, stats) and with GPU threads.
/// Observers never take the session lock, so a slow frontend cannot stall them.
pub struct SessionShared {
    pub events: Arc<EventQueue>,
    busy: Mutex<BusyBook>,
    requests: AtomicU64,
    errors: AtomicU64,
    disconnects: AtomicU64,
    ring_errors: AtomicU64,
    contexts: AtomicU64,
    channels: AtomicU64,
    vram_bytes: AtomicU64,
    mapped_guest_bytes: AtomicU64,
    aperture_bytes: AtomicU64,
    mappings: AtomicU64,
    page_table_bytes: AtomicU64,
    /// The VM's activity: the GPU raises it when any of the VM's channels fetches or
    /// completes work or stops ([`Gpu::count_activity`]), the session when a channel comes
    /// or goes. Unchanged since the scheduler's last look: nothing of the VM moved.
    activity: Arc<ActivityCounter>,
    /// Some channel's activity is not counted by the GPU (it lacks the feature).
    uncounted: AtomicBool,
    /// The driver acked `VIRTIO_VGPU_F_FORWARDED`: channels get no BAR slot.
    forwarded: AtomicBool,
    /// The VM's VRAM quota, its one copy: ALLOC_VRAM's limit (with the swap limit), the
    /// most the VRAM manager keeps resident for it, what the config space advertises.
    /// Set only through [`crate::vm::control::validate_vram_quota`]'s checks.
    vram_quota: AtomicU64,
}

impl SessionShared {
    /// The VM's VRAM quota now.
    pub(crate) fn vram_quota(&self) -> u64 {
        self.vram_quota.load(Ordering::Acquire)
    }

    /// Sets the VRAM quota (already validated).
    pub(in crate::vm) fn set_vram_quota(&self, bytes: u64) {
        self.vram_quota.store(bytes, Ordering::Release);
    }

    pub fn new(events: Arc<EventQueue>, vram_quota: u64) -> Self {
        let activity = Arc::new(ActivityCounter::new());
        SessionShared {
            events,
            vram_quota: AtomicU64::new(vram_quota),
            busy: Mutex::new(BusyBook {
                activity: activity.clone(),
                ..BusyBook::default()
            }),
            activity,
            uncounted: AtomicBool::new(false),
            forwarded: AtomicBool::new(false),
            requests: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            disconnects: AtomicU64::new(0),
            ring_errors: AtomicU64::new(0),
            contexts: AtomicU64::new(0),
            channels: AtomicU64::new(0),
            vram_bytes: AtomicU64::new(0),
            mapped_guest_bytes: AtomicU64::new(0),
            aperture_bytes: AtomicU64::new(0),
            mappings: AtomicU64::new(0),
            page_table_bytes: AtomicU64::new(0),
        }
    }

    /// Rings the VM's doorbell on `gpu` if its front end sleeps: after anything but the
    /// guest moved a GP_PUT the front end reads (protocol.md, "Doorbell").
    pub(crate) fn ring_doorbell(&self, gpu: &dyn Gpu) {
        // Orders the caller's GP_PUT store before the look at WANT_DOORBELL, as the
        // guest's fence does.
        std::sync::atomic::fence(Ordering::SeqCst);
        let target = self.busy().doorbell_target();
        if let Some(ch) = target {
            gpu.doorbell(ch);
        }
    }

    pub(crate) fn busy(&self) -> MutexGuard<'_, BusyBook> {
        self.busy.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn count_request(&self, error: bool) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        if error {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Records the driver's choice of submission mode (its acked features).
    pub fn set_forwarded(&self, on: bool) {
        self.forwarded.store(on, Ordering::Release);
    }

    /// Whether the driver submits forwarded (no shared-memory region).
    pub fn forwarded(&self) -> bool {
        self.forwarded.load(Ordering::Acquire)
    }

    pub(crate) fn count_ring_error(&self) {
        self.ring_errors.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn count_disconnect(&self) {
        self.disconnects.fetch_add(1, Ordering::Relaxed);
    }

    /// Stats (without `connected`, which the caller knows).
    /// Frontend disconnects so far (each ended a connection and its session).
    pub fn disconnects(&self) -> u64 {
        self.disconnects.load(Ordering::Relaxed)
    }

    pub fn stats(&self) -> VmStats {
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        VmStats {
            connected: false,
            forwarded: self.forwarded(),
            contexts: r(&self.contexts) as u32,
            channels: r(&self.channels) as u32,
            vram_bytes: r(&self.vram_bytes),
            mapped_guest_bytes: r(&self.mapped_guest_bytes),
            aperture_bytes: r(&self.aperture_bytes),
            mappings: r(&self.mappings) as u32,
            page_table_bytes: r(&self.page_table_bytes),
            requests: r(&self.requests),
            errors: r(&self.errors),
            disconnects: r(&self.disconnects),
            events_delivered: self.events.delivered(),
            events_dropped: self.events.dropped(),
            events_pending: self.events.pending() as u64,
            ring_errors: r(&self.ring_errors),
        }
    }

    /// Busy time of each live channel as the HAL counts it: (guest channel id, owning
    /// guest PID, HAL channel id, busy ns). Channels whose counters cannot be read are
    /// left out.
    pub fn channel_busy_ns(&self, gpu: &dyn Gpu) -> Vec<(u32, u32, ChannelId, u64)> {
        let book = self.busy();
        book.live
            .iter()
            .filter_map(|(g, c)| {
                gpu.channel_counters(c.hal)
                    .ok()
                    .map(|n| (*g, c.pid, c.hal, n.busy_ns))
            })
            .collect()
    }

    /// Has the GPU count channel `hch`'s activity into a count of its own that rolls up
    /// into the VM's; if it cannot, the VM's count is no longer complete
    /// ([`SessionShared::activity_counted`]). Returns the channel's count.
    pub(crate) fn count_activity(&self, gpu: &dyn Gpu, hch: ChannelId) -> Arc<ActivityCounter> {
        let own = Arc::new(ActivityCounter::with_parent(self.activity.clone()));
        if !gpu.count_activity(hch, own.clone()).unwrap_or(false) {
            self.uncounted.store(true, Ordering::Release);
        }
        own
    }

    /// Raises the VM's activity count for a change the GPU does not see (a hold).
    pub(crate) fn note_change(&self) {
        self.activity.bump();
    }

    /// The VM's activity count (complete while [`SessionShared::activity_counted`]).
    pub fn activity(&self) -> Arc<ActivityCounter> {
        self.activity.clone()
    }

    /// Whether the GPU counted the work of every channel the VM had.
    pub fn activity_counted(&self) -> bool {
        !self.uncounted.load(Ordering::Acquire)
    }

    /// GPU busy time per guest PID: live channels' HAL counters plus destroyed channels.
    pub fn process_busy_ns(&self, gpu: &dyn Gpu) -> Vec<(u32, u64)> {
        let book = self.busy();
        let mut out = book.retired.clone();
        for c in book.live.values() {
            if let Ok(n) = gpu.channel_counters(c.hal) {
                *out.entry(c.pid).or_default() += n.busy_ns;
            }
        }
        out.into_iter().collect()
    }
}

impl BusyBook {
    /// Each live channel, by guest channel id.
    pub(crate) fn live_mut(&mut self) -> impl Iterator<Item = (u32, &mut LiveChannel)> + '_ {
        self.live.iter_mut().map(|(g, c)| (*g, c))
    }

    /// Channels destroyed since the previous call, with their final busy time.
    pub(crate) fn take_recent(&mut self) -> Vec<RetiredChannel> {
        self.recent.drain(..).collect()
    }

    /// Where a doorbell for the whole VM goes, if its GPU's front end sleeps: some live
    /// channel (the GPU routes a doorbell by channel to the VM's front end, which then
    /// looks at all of them), whose page shows the front end's `WANT_DOORBELL` (it arms
    /// every channel's page before it sleeps).
    pub(crate) fn doorbell_target(&self) -> Option<ChannelId> {
        let c = self.live.values().next()?;
        let wanted = c
            .page
            .as_ref()
            .is_none_or(|p| p.load(vgpu_protocol::ControlPage::WANT_DOORBELL) != 0);
        wanted.then_some(c.hal)
    }

    pub(crate) fn add_live(
        &mut self,
        guest_ch: u32,
        pid: u32,
        hal: ChannelId,
        activity: Arc<ActivityCounter>,
        page: Option<crate::shadow::PageMap>,
    ) {
        self.live.insert(
            guest_ch,
            LiveChannel {
                pid,
                hal,
                activity,
                quiet_at: None,
                page,
            },
        );
        self.activity.bump();
    }

    /// Moves a channel's busy time to the retired books; call before destroying it.
    pub(crate) fn retire(&mut self, gpu: &dyn Gpu, guest_ch: u32) {
        if let Some(LiveChannel { pid, hal: ch, .. }) = self.live.remove(&guest_ch) {
            self.activity.bump();
            let busy = gpu.channel_counters(ch).map(|c| c.busy_ns).unwrap_or(0);
            *self.retired.entry(pid).or_default() += busy;
            if self.recent.len() >= RECENT_RETIRED {
                self.recent.pop_front();
            }
            self.recent.push_back(RetiredChannel {
                pid,
                hal: ch,
                busy_ns: busy,
            });
        }
    }

    pub(crate) fn forget(&mut self, guest_ch: u32) {
        self.live.remove(&guest_ch);
        self.activity.bump();
    }
}

/// One VM's GPU objects and the logic that manages them (request handling lives in
/// [`crate::vm::requests`]).
pub struct Session {
    pub(in crate::vm) gpu: Arc<dyn Gpu>,
    pub(in crate::vm) limits: VmLimits,
    pub(in crate::vm) shared: Arc<SessionShared>,
    pub(in crate::vm) state: SessionState,
    pub(in crate::vm) hal: HalHandles,
    /// Shadowed channels and the VM's shadow-page pool.
    pub(in crate::vm) shadows: crate::shadow::Shadows,
    /// Holds on the VM's owners (pause, scheduler, VRAM moves) that channels are born
    /// into ([`crate::shadow::holds`]).
    pub(in crate::vm) hold: crate::shadow::OwnerHolds,
    /// Swap store and VRAM-manager counters.
    pub(in crate::vm) swap: crate::vram::VmSwap,
    /// A live migration's VRAM pre-copy books (either side).
    pub(in crate::vm) precopy: crate::vm::migration::chunks::PrecopyBooks,
    /// The VM's place in the book of the GPU's contexts and channels.
    pub(in crate::vm) capacity: VmCapacity,
}

impl Session {
    /// A session that reports into `shared`, with a book of the GPU's contexts and
    /// channels of its own (no other VM shares the GPU with it).
    pub fn with_shared(gpu: Arc<dyn Gpu>, limits: VmLimits, shared: Arc<SessionShared>) -> Self {
        let capacity = VmCapacity::standalone(crate::capacity::gpu_totals(gpu.as_ref()));
        Self::with_capacity(gpu, limits, shared, capacity)
    }

    /// A session that reports into `shared` and takes contexts and channels through
    /// `capacity`, its VM's place in the backend's book.
    pub(crate) fn with_capacity(
        gpu: Arc<dyn Gpu>,
        limits: VmLimits,
        shared: Arc<SessionShared>,
        capacity: VmCapacity,
    ) -> Self {
        Session {
            gpu,
            limits,
            shared,
            state: SessionState::default(),
            hal: HalHandles::default(),
            shadows: crate::shadow::Shadows::new(),
            hold: crate::shadow::OwnerHolds::default(),
            swap: crate::vram::VmSwap::default(),
            precopy: Default::default(),
            capacity,
        }
    }

    /// A stand-alone session (tests, tools): events go to a detached FIFO.
    /// A frontend connected: the GPU starts ahead what the VM's first use needs.
    pub fn prepare_gpu(&self) {
        self.gpu.prepare();
    }

    pub fn new(gpu: Arc<dyn Gpu>, limits: VmLimits) -> Self {
        let events = Arc::new(EventQueue::detached(EVENT_FIFO_CAPACITY));
        Self::with_shared(
            gpu,
            limits,
            Arc::new(SessionShared::new(events, limits.vram_bytes)),
        )
    }

    /// The VM's limits, with its VRAM quota as it is now.
    pub fn limits(&self) -> VmLimits {
        VmLimits {
            vram_bytes: self.shared.vram_quota(),
            ..self.limits
        }
    }

    pub fn state(&self) -> &SessionState {
        &self.state
    }

    pub fn shared(&self) -> &Arc<SessionShared> {
        &self.shared
    }

    /// Whether the session holds no object.
    pub fn is_empty(&self) -> bool {
        self.state.contexts.is_empty()
            && self.state.mems.is_empty()
            && self.state.channels.is_empty()
            && self.state.mappings.is_empty()
    }

    /// Wakes the VRAM manager when this VM's swap state changes.
    pub(crate) fn set_vram_waker(&mut self, w: Arc<crate::vram::Waker>) {
        self.swap.set_waker(w);
    }

    /// The VM's VRAM moves so far (evictions, swap-ins, spills, pauses).
    pub(crate) fn vram_move_counters(&self) -> crate::vram::VmVramStats {
        self.swap.counters.vm
    }

    /// Tells the GPU's book how many contexts and channels the VM has.
    pub(crate) fn sync_capacity(&self) {
        self.capacity.set_used(Counts {
            contexts: self.state.contexts.len() as u32,
            channels: self.state.channels.len() as u32,
        });
    }

    /// Copies usage into the shared counters and the GPU's book.
    pub(crate) fn publish(&self) {
        self.sync_capacity();
        let s = &self.shared;
        let u = &self.state.usage;
        s.contexts
            .store(self.state.contexts.len() as u64, Ordering::Relaxed);
        s.channels
            .store(self.state.channels.len() as u64, Ordering::Relaxed);
        s.vram_bytes.store(u.vram_bytes, Ordering::Relaxed);
        s.mapped_guest_bytes
            .store(u.mapped_guest_bytes, Ordering::Relaxed);
        s.aperture_bytes.store(u.aperture_bytes, Ordering::Relaxed);
        s.mappings
            .store(self.state.mappings.len() as u64, Ordering::Relaxed);
        s.page_table_bytes
            .store(u.page_table_bytes, Ordering::Relaxed);
    }

    /// Destroys every object of the VM in the HAL and forgets them. BAR mappings are
    /// removed through `shm` where possible (best effort: failures are logged, the objects
    /// are freed regardless — use [`NullShm`] when the frontend is gone). Pending events
    /// are discarded and late events of the old channels are ignored.
    pub fn teardown(&mut self, shm: &dyn ShmMapper) {
        self.precopy = Default::default();
        if !self.is_empty() {
            debug!(
                "tearing down session: {} contexts, {} channels, {} VRAM objects",
                self.state.contexts.len(),
                self.state.channels.len(),
                self.state.mems.len()
            );
        }
        // 1. Take the guest's view away: control-page slots and aperture windows.
        for ch in self.state.channels.values_mut() {
            if ch.slot_mapped {
                if let Some(off) = slot_offset(ch.slot) {
                    if let Err(e) = shm.unmap(off, PAGE_SIZE) {
                        warn!("teardown: SHMEM_UNMAP of slot {}: {e}", ch.slot);
                    }
                }
                ch.slot_mapped = false;
            }
        }
        for mem in self.state.mems.values_mut() {
            if let Some(off) = mem.aperture.take() {
                let len = crate::shmem::page_round_up(mem.size).unwrap_or(mem.size);
                if let Err(e) = shm.unmap(off, len) {
                    warn!("teardown: SHMEM_UNMAP of aperture {off:#x}: {e}");
                }
            }
        }
        // The slots are unmapped (or the frontend is gone): shadow pages are free again.
        self.shadows.clear();
        // 2. Channels (after their busy time is booked), then address spaces: once
        //    destroy_context returns no engine touches the VM's memory any more.
        {
            let mut book = self.shared.busy();
            for (id, ch) in std::mem::take(&mut self.hal.channels) {
                book.retire(self.gpu.as_ref(), id);
                if let Err(e) = self.gpu.destroy_channel(ch) {
                    debug!("teardown: destroy channel {id}: {e}");
                }
            }
        }
        for (id, (ctx, _)) in std::mem::take(&mut self.hal.contexts) {
            if let Err(e) = self.gpu.destroy_context(ctx) {
                warn!("teardown: destroy context {id}: {e}");
            }
        }
        // 3. VRAM last: nothing can reach it now.
        for (_, b) in std::mem::take(&mut self.hal.vram) {
            self.free_object(&b);
        }
        self.hal.control_maps.clear();
        let (last_context, last_mem, last_channel) = (
            self.state.last_context,
            self.state.last_mem,
            self.state.last_channel,
        );
        let (last_module, last_function) = (self.state.last_module, self.state.last_function);
        // Modules went with their contexts.
        self.state = SessionState {
            last_context,
            last_mem,
            last_channel,
            last_module,
            last_function,
            ..SessionState::default()
        };
        self.shared.events.reset();
        self.publish();
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if !self.is_empty() {
            self.teardown(&NullShm);
        }
    }
}
