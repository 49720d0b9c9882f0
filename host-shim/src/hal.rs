//! The GPU hardware abstraction layer: what the backend and the native runtime may ask of
//! a GPU. The `sim` GPU implements it; real GPU executors can implement it later.
//!
//! The interface is deliberately hardware-shaped: the scheduler controls channels only
//! through the control pages it maps for a VM (and GP_PUT values it writes itself), never
//! through a hidden "pause" switch, so there is none here.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use thiserror::Error;
pub use vgpu_protocol::mem::{MapFlags, PageSize};
pub use vgpu_protocol::module::ParamInfo;
use vgpu_protocol::ErrorCode;

/// A GPU address space (one per guest process context).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContextId(pub u32);

/// A command-submission channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChannelId(pub u32);

/// A count of GPU activity of a channel or a group of channels (a VM's, say): a GPU that
/// supports it ([`Gpu::count_activity`]) raises it whenever the channel fetches a GP
/// entry, completes one or stops on an error. A channel can use GPU time only for an entry
/// it fetched, so an observer that finds the count unchanged since its last look knows
/// that the channel did nothing meanwhile, without reading its control page or counters
/// (the scheduler's quiet channels and dormant VMs, issue 15). A counter may have a
/// parent, raised with it: a channel's count rolls up to its VM's. The front end already
/// polls every channel, so keeping it costs the GPU an atomic add or two per entry.
#[derive(Debug, Default)]
pub struct ActivityCounter {
    count: AtomicU64,
    parent: Option<Arc<ActivityCounter>>,
}

impl ActivityCounter {
    pub fn new() -> Self {
        Self::default()
    }

    /// A counter whose every rise also raises `parent`.
    pub fn with_parent(parent: Arc<ActivityCounter>) -> Self {
        ActivityCounter {
            count: AtomicU64::new(0),
            parent: Some(parent),
        }
    }

    /// Notes activity (the GPU's side).
    pub fn bump(&self) {
        self.count.fetch_add(1, Ordering::Release);
        if let Some(p) = &self.parent {
            p.bump();
        }
    }

    /// The count now; compare it with an earlier reading.
    pub fn get(&self) -> u64 {
        self.count.load(Ordering::Acquire)
    }
}

/// A VRAM allocation: `size` bytes at `offset` in VRAM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VramAlloc {
    pub offset: u64,
    pub size: u64,
}

/// Where a mapping points.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MapTarget {
    /// Byte offset in VRAM.
    Vram { offset: u64 },
    /// Address in the context's system memory (see [`SysMemory`]).
    Sysram { addr: u64 },
}

/// A channel's GP ring, fixed at creation (GPU-private state, not in the control page).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChannelConfig {
    /// GPU virtual address of the ring (16-byte entries), in the channel's context.
    pub gp_ring_va: u64,
    /// Ring size in entries: a power of two, see `vgpu_protocol::channel::valid_gp_entries`.
    pub gp_entries: u32,
}

impl ChannelConfig {
    /// The ring every GPU accepts: a valid size, entry-aligned, inside the address space.
    pub fn check(&self) -> Result<()> {
        use vgpu_protocol::gp::{GPU_VA_LIMIT, GP_ENTRY_SIZE};
        if !vgpu_protocol::channel::valid_gp_entries(self.gp_entries) {
            return Err(HalError::InvalidArgument(
                "GP ring size must be a power of two in 2..=65536",
            ));
        }
        let ring_bytes = self.gp_entries as u64 * GP_ENTRY_SIZE as u64;
        if !self.gp_ring_va.is_multiple_of(GP_ENTRY_SIZE as u64)
            || self
                .gp_ring_va
                .checked_add(ring_bytes)
                .is_none_or(|e| e > GPU_VA_LIMIT)
        {
            return Err(HalError::InvalidArgument(
                "GP ring misaligned or outside the address space",
            ));
        }
        Ok(())
    }
}

/// Where a re-created channel resumes (live migration): its ring position and the fields
/// the GPU writes into its control page, as the source GPU left them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChannelResume {
    /// GP entries completed: the GPU fetches entry `gp_get` next (GP_PUT starts equal, so
    /// nothing runs until the owner raises it).
    pub gp_get: u32,
    pub reference: u32,
    pub notify_seq: u32,
    /// The error the channel had stopped on: it starts stopped with it (no event is sent).
    pub error: Option<(ErrorCode, u64)>,
}

/// Per-channel accounting, as real GPUs expose it to the host.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChannelCounters {
    /// Nanoseconds the channel occupied an engine, including the part of a kernel that is
    /// still running (the counter ticks while it runs; it never goes backwards).
    pub busy_ns: u64,
    /// GP entries completed.
    pub gp_completed: u64,
    /// Kernels launched (counted at launch, so faulted or aborted ones are included).
    pub kernels: u64,
    /// Copy methods completed.
    pub copies: u64,
    /// Nanoseconds the channel's next work waited on a semaphore acquire not yet
    /// satisfied, including a wait still going on (never goes backwards). Work pending
    /// behind such a wait cannot use the GPU: the scheduler does not hold other tenants
    /// back for it (issue 28).
    pub sem_wait_ns: u64,
}

/// Something the GPU tells a channel's owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuEvent {
    /// A `NOTIFY` method executed.
    Notify { channel: ChannelId, token: u32 },
    /// `REF` reached the value a sleeping waiter armed (`ControlPage::REF_WAKE`).
    Fence { channel: ChannelId, reference: u32 },
    /// The channel faulted and stopped; `info` is the faulting address or method offset.
    Error {
        channel: ChannelId,
        code: ErrorCode,
        info: u64,
    },
}

/// Receives a channel's events. Called from GPU threads: must not block for long.
pub trait EventSink: Send + Sync {
    fn event(&self, ev: GpuEvent);
}

/// A contiguous piece of host memory backing system-memory addresses.
#[derive(Debug, Clone, Copy)]
pub struct HostRange {
    pub ptr: *mut u8,
    pub len: usize,
}

/// A piece of system memory as a file range: `len` bytes at system address `addr` are
/// `len` bytes of `fd` from `fd_offset` (valid while the [`SysMemory`] lives).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SysRegion {
    pub addr: u64,
    pub len: u64,
    pub fd: RawFd,
    pub fd_offset: u64,
}

/// Translates a context's system-memory addresses to host memory.
///
/// The native runtime backs it with its own allocations; the backend backs it with a
/// VM's guest RAM, so the GPU can reach only what the backend put in the translation.
pub trait SysMemory: Send + Sync {
    /// The host memory at `addr`: a non-empty range of at most `len` bytes that starts at
    /// `addr` and stays valid while `self` lives, or `None` if `addr` is not backed.
    fn translate(&self, addr: u64, len: u64) -> Option<HostRange>;
    /// The same memory as file ranges, for a GPU in another process (a worker) that maps
    /// it itself; empty (the default) when it is not backed by files such a GPU can map.
    fn regions(&self) -> Vec<SysRegion> {
        Vec::new()
    }
}

/// A range of a file descriptor owned by the GPU (valid while the GPU lives); map it with
/// `mmap(MAP_SHARED)` to see what the GPU sees, from this process or another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdRange {
    pub fd: RawFd,
    pub offset: u64,
    pub len: u64,
}

/// Static facts about a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    pub name: String,
    pub vram_bytes: u64,
    pub compute_engines: u32,
    pub max_channels: u32,
    pub max_contexts: u32,
    /// Whether [`Gpu::channel_counters`] reports busy time. A scheduler must fall back to
    /// observing GP_GET when it does not.
    pub has_busy_counters: bool,
}

/// A module global: where it lives in device memory, and its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GlobalInfo {
    pub addr: u64,
    pub size: u64,
}

/// HAL errors.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum HalError {
    #[error("no such context {0:?}")]
    NoContext(ContextId),
    #[error("no such channel {0:?}")]
    NoChannel(ChannelId),
    #[error("no VRAM allocation at offset {0:#x}")]
    NoAllocation(u64),
    #[error("out of VRAM (asked for {0} bytes)")]
    OutOfVram(u64),
    #[error("too many {0}")]
    TooMany(&'static str),
    #[error("invalid argument: {0}")]
    InvalidArgument(&'static str),
    #[error("range {va:#x}+{size:#x} overlaps an existing mapping")]
    Overlap { va: u64, size: u64 },
    #[error("range {va:#x}+{size:#x} is not mapped")]
    NotMapped { va: u64, size: u64 },
    #[error("mixing page sizes within one 2 MiB region at {0:#x}")]
    PageSizeConflict(u64),
    #[error("host memory: {0}")]
    Os(String),
    #[error("not supported by this GPU: {0}")]
    Unsupported(&'static str),
    /// The GPU is gone: its worker process died, faulted or broke the protocol.
    #[error("GPU lost: {0}")]
    DeviceLost(String),
    /// A GPU in another process refused with this code.
    #[error("refused by the GPU: {0}")]
    Refused(ErrorCode),
}

impl HalError {
    /// The protocol error code a guest should see for this failure.
    pub fn code(&self) -> ErrorCode {
        match self {
            HalError::NoContext(_) | HalError::NoChannel(_) | HalError::NoAllocation(_) => {
                ErrorCode::NotFound
            }
            HalError::OutOfVram(_) => ErrorCode::NoMemory,
            HalError::TooMany(_) => ErrorCode::LimitExceeded,
            HalError::InvalidArgument(_)
            | HalError::Overlap { .. }
            | HalError::NotMapped { .. }
            | HalError::PageSizeConflict(_) => ErrorCode::InvalidArgument,
            HalError::Os(_) => ErrorCode::Internal,
            HalError::Unsupported(_) => ErrorCode::Unsupported,
            HalError::DeviceLost(_) => ErrorCode::DeviceLost,
            HalError::Refused(code) => *code,
        }
    }
}

pub type Result<T> = std::result::Result<T, HalError>;

/// The GPU HAL.
pub trait Gpu: Send + Sync {
    fn info(&self) -> GpuInfo;

    /// The real GPU's device attributes as guests are told them (GET_ATTRIBUTES):
    /// `(CUdevice_attribute, value)` pairs, at most `request::MAX_ATTRIBUTES`. `owner`
    /// is the asking guest process (a GPU with a worker per process may have to start
    /// one to ask). The default: none (the `sim` is no CUDA GPU).
    fn device_attributes(&self, _owner: u32) -> Result<Vec<(u32, i32)>> {
        Ok(Vec::new())
    }

    /// A frontend has connected and will use this GPU: start ahead what its first use
    /// would otherwise wait for (a worker process: a CUDA context takes 0.2–0.35 s on the
    /// H100, inside a live migration's downtime on a destination). Returns at once and
    /// never fails: a failed start shows at first use, which tries again. The default
    /// does nothing.
    fn prepare(&self) {}

    /// Creates an address space whose system-memory targets resolve through `sysmem`.
    fn create_context(&self, sysmem: Arc<dyn SysMemory>) -> Result<ContextId>;
    /// Destroys an address space and every channel in it. When it returns, no engine
    /// touches memory through that address space any more.
    fn destroy_context(&self, ctx: ContextId) -> Result<()>;

    /// Allocates VRAM; `align` is a power of two (at least 4 KiB is used).
    fn alloc_vram(&self, size: u64, align: u64) -> Result<VramAlloc>;

    /// [`Gpu::create_context`] for guest process `owner` (its pid in the VM). A GPU that
    /// gives each guest process an address space and fault domain of its own (a worker
    /// process per guest process) places the context by it; the default ignores it.
    fn create_context_for(&self, owner: u32, sysmem: Arc<dyn SysMemory>) -> Result<ContextId> {
        let _ = owner;
        self.create_context(sysmem)
    }
    /// [`Gpu::alloc_vram`] for guest process `owner`, as [`Gpu::create_context_for`]:
    /// VRAM for `owner`'s objects, mappable into `owner`'s contexts.
    fn alloc_vram_for(&self, owner: u32, size: u64, align: u64) -> Result<VramAlloc> {
        let _ = owner;
        self.alloc_vram(size, align)
    }
    /// A hint: guest processes `owners` are about to make objects (a live migration's
    /// restore). A GPU that starts something per owner (a worker process per guest
    /// process) may start them now, side by side. Returns at once and never fails; the
    /// default does nothing.
    fn prepare_owners(&self, owners: &[u32]) {
        let _ = owners;
    }
    /// Whether VRAM of different owners lives apart ([`Gpu::alloc_vram_for`]): then one
    /// owner's VRAM cannot be mapped into another owner's contexts, and the owner must not
    /// place pieces of different owners in one allocation. `false` (the default): all of
    /// the GPU's VRAM is one space.
    fn separates_owners(&self) -> bool {
        false
    }
    /// Frees the allocation that starts at `offset`.
    fn free_vram(&self, offset: u64) -> Result<()>;
    /// Bytes of VRAM not allocated.
    fn vram_free_bytes(&self) -> u64;
    /// The whole of VRAM as a file range (for aperture mappings), or `None` when the CPU
    /// cannot map this GPU's VRAM (device memory behind no user-mappable BAR): then guests
    /// reach VRAM only through the GPU (copies), and `MAP_APERTURE` is unsupported.
    fn vram_fd(&self) -> Option<FdRange>;
    /// Host reads and writes of VRAM (bounds-checked). Allocated VRAM reads as zero until
    /// written: a new allocation never shows what an earlier owner left there.
    fn vram_read(&self, offset: u64, buf: &mut [u8]) -> Result<()>;
    fn vram_write(&self, offset: u64, buf: &[u8]) -> Result<()>;
    /// Several [`Gpu::vram_read`]s at once (a VRAM move's chunks): a GPU with a copy
    /// engine queues them all and waits once, so the engine does not idle between them.
    /// When it returns, every copy has arrived or an error is returned; after an error the
    /// buffers' contents are unspecified. The default reads one after the other.
    fn vram_read_many(&self, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        for (offset, buf) in reads.iter_mut() {
            self.vram_read(*offset, buf)?;
        }
        Ok(())
    }
    /// Several [`Gpu::vram_write`]s at once, as [`Gpu::vram_read_many`]; after an error the
    /// written VRAM's contents are unspecified.
    fn vram_write_many(&self, writes: &[(u64, &[u8])]) -> Result<()> {
        for (offset, buf) in writes {
            self.vram_write(*offset, buf)?;
        }
        Ok(())
    }

    /// Maps `size` bytes at `va` to `target` with pages of `page`. `va`, `size` and the
    /// target must be aligned to the page size; the range must be unmapped.
    fn map(
        &self,
        ctx: ContextId,
        va: u64,
        size: u64,
        target: MapTarget,
        page: PageSize,
        flags: MapFlags,
    ) -> Result<()>;
    /// Unmaps whole pages covering exactly `va..va+size`.
    fn unmap(&self, ctx: ContextId, va: u64, size: u64) -> Result<()>;
    /// Host memory `ctx`'s page tables take now, bytes: what its mappings cost the host
    /// (the backend counts it against the VM).
    fn page_table_bytes(&self, ctx: ContextId) -> Result<u64>;
    /// What [`Gpu::map`] of `va..va+size` with pages of `page` would add to
    /// [`Gpu::page_table_bytes`] now (0 for a range it would refuse).
    fn map_cost(&self, ctx: ContextId, va: u64, size: u64, page: PageSize) -> Result<u64>;
    /// Rewrites the targets of existing mappings (for VRAM↔SYSRAM migration). Takes effect
    /// for the GPU only after [`Gpu::invalidate_tlb`].
    fn remap(&self, ctx: ContextId, va: u64, size: u64, target: MapTarget) -> Result<()>;
    /// A hint: `ctx`'s system-memory range `addr..addr+len` is about to become the target
    /// of mappings (a VRAM eviction's destination). A GPU that must prepare host memory
    /// before it can reach it (pin and register it with a driver) may do that now, before
    /// the owner pauses any channel, instead of inside the pause. Mappings made later keep
    /// what they need; [`Gpu::release_sysram_hint`] drops the hint's own hold.
    fn prepare_sysram_hint(&self, _ctx: ContextId, _addr: u64, _len: u64) -> Result<()> {
        Ok(())
    }
    /// Ends a [`Gpu::prepare_sysram_hint`].
    fn release_sysram_hint(&self, _ctx: ContextId, _addr: u64, _len: u64) {}
    /// Drops cached translations: page-table changes become visible to the engines. When it
    /// returns, no engine still uses memory reached through a dropped translation, so the
    /// owner may free memory it unmapped (or removed from the context's `SysMemory`).
    fn invalidate_tlb(&self, ctx: ContextId) -> Result<()>;

    /// Stops (`hold`) or resumes fetching channel `ch`'s new GP entries; entries already
    /// fetched run on. False: this GPU cannot, and a pause must wait for the channel's
    /// whole ring instead. While held, the entries published but not fetched run later,
    /// planned on the translations of that time.
    fn hold_fetch(&self, _ch: ChannelId, _hold: bool) -> Result<bool> {
        Ok(false)
    }

    /// With `ch`'s fetch held ([`Gpu::hold_fetch`]), whether everything it fetched has
    /// completed; `None` when its fetch is not held (or this GPU cannot hold it).
    fn fetched_done(&self, _ch: ChannelId) -> Result<Option<bool>> {
        Ok(None)
    }

    /// Starts (`on`, clearing the record) or stops recording which memory the engines
    /// write through `ctx`'s address space (live migration's pre-copy). Returns whether
    /// this GPU records writes; one that does not (the default) reports every range as
    /// written in [`Gpu::take_written`], so its owner copies everything while paused.
    fn track_writes(&self, ctx: ContextId, on: bool) -> Result<bool> {
        let _ = (ctx, on);
        Ok(false)
    }
    /// Whether the engines wrote anything in `len` bytes at `target` through `ctx` since
    /// tracking started or the last take covering it; clears that part of the record.
    /// Take before copying a range: a write that lands later is noted for the next take.
    fn take_written(&self, ctx: ContextId, target: MapTarget, len: u64) -> Result<bool> {
        let _ = (ctx, target, len);
        Ok(true)
    }
    /// Per-page access counts for the pages covering `va..va+size` (one entry per mapped
    /// page, in address order: page VA and count); `reset` zeroes them after reading.
    fn access_counts(
        &self,
        ctx: ContextId,
        va: u64,
        size: u64,
        reset: bool,
    ) -> Result<Vec<(u64, u32)>>;

    /// Creates a channel in `ctx`; its events go to `sink`.
    fn create_channel(
        &self,
        ctx: ContextId,
        cfg: ChannelConfig,
        sink: Arc<dyn EventSink>,
    ) -> Result<ChannelId>;
    /// Creates a channel in `ctx` that continues where a channel of another GPU stopped
    /// (live migration): its control page starts with `at`'s fields and GP_PUT = GP_GET,
    /// and the GPU fetches entry `at.gp_get` next. A GPU that cannot place a channel's
    /// fetch position says [`HalError::Unsupported`] (the default).
    fn create_channel_resumed(
        &self,
        ctx: ContextId,
        cfg: ChannelConfig,
        sink: Arc<dyn EventSink>,
        at: ChannelResume,
    ) -> Result<ChannelId> {
        let _ = (ctx, cfg, sink, at);
        Err(HalError::Unsupported(
            "creating a channel at a saved ring position",
        ))
    }
    /// Destroys a channel at any moment; work in flight is abandoned.
    fn destroy_channel(&self, ch: ChannelId) -> Result<()>;
    /// The channel's 4 KiB control page.
    fn control_page(&self, ch: ChannelId) -> Result<FdRange>;
    /// Every channel's control page, slot after slot (channel `ch`'s is at
    /// [`Gpu::control_page`]'s offset), for a process that serves this GPU to another:
    /// or `None` (the default) when the pages are not one file.
    fn control_pages(&self) -> Option<FdRange> {
        None
    }
    /// Why the GPU is unusable for good (a kernel faulted the device and every context
    /// of the process is gone), or `None` (the default) while it works. A process that
    /// serves this GPU to others exits then, so a new one gets a working GPU.
    fn lost(&self) -> Option<String> {
        None
    }
    /// Optional doorbell: tells the GPU to look at the channel now instead of at its next poll.
    fn doorbell(&self, ch: ChannelId);
    fn channel_counters(&self, ch: ChannelId) -> Result<ChannelCounters>;
    /// Counts channel `ch`'s activity into `counter` from now on (see
    /// [`ActivityCounter`]). Returns whether this GPU does; one that does not (the
    /// default) leaves its observers to read every channel.
    fn count_activity(&self, ch: ChannelId, counter: Arc<ActivityCounter>) -> Result<bool> {
        let _ = (ch, counter);
        Ok(false)
    }
    /// The channel's error, if it has stopped on one.
    fn channel_error(&self, ch: ChannelId) -> Result<Option<(ErrorCode, u64)>>;
    /// Stops a channel with an error (the watchdog's tool): a running kernel is abandoned,
    /// the owner gets an error event, other channels continue.
    fn kill_channel(&self, ch: ChannelId, code: ErrorCode) -> Result<()>;

    /// Loads a guest's module `image` (PTX, cubin or fatbin) into `ctx` as `module`, an id
    /// the owner chose (unique in `ctx`). A GPU that cannot run a guest's own code safely
    /// refuses with the code that says which one can (the default: the `sim`).
    fn module_load(&self, ctx: ContextId, module: u32, image: &[u8]) -> Result<()> {
        let _ = (ctx, module, image);
        Err(HalError::Refused(ErrorCode::ModulesNeedCudaGpu))
    }
    /// Unloads a module once the context's channels have finished what they were given;
    /// its functions are forgotten (a later launch of one faults its channel).
    fn module_unload(&self, ctx: ContextId, module: u32) -> Result<()> {
        let _ = (ctx, module);
        Err(HalError::Refused(ErrorCode::ModulesNeedCudaGpu))
    }
    /// Binds `function` (an id the owner chose, unique in `ctx`) to the function `name`
    /// of `module`, for `LAUNCH_FUNCTION`s of `ctx`'s channels; returns its parameter
    /// layout when the GPU knows it.
    fn function_get(
        &self,
        ctx: ContextId,
        module: u32,
        name: &str,
        function: u32,
    ) -> Result<Option<Vec<ParamInfo>>> {
        let _ = (ctx, module, name, function);
        Err(HalError::Refused(ErrorCode::ModulesNeedCudaGpu))
    }
    /// The device address and size of the global `name` of `module`.
    fn global_get(&self, ctx: ContextId, module: u32, name: &str) -> Result<GlobalInfo> {
        let _ = (ctx, module, name);
        Err(HalError::Refused(ErrorCode::ModulesNeedCudaGpu))
    }
    /// Reads `buf.len()` bytes at `offset` of `module`'s variable `name` (a live
    /// migration saving a paused VM: nothing of the context runs).
    fn global_read(
        &self,
        ctx: ContextId,
        module: u32,
        name: &str,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<()> {
        let _ = (ctx, module, name, offset, buf);
        Err(HalError::Refused(ErrorCode::ModulesNeedCudaGpu))
    }
    /// Writes `data` at `offset` of `module`'s variable `name` (a migration's
    /// destination restoring it).
    fn global_write(
        &self,
        ctx: ContextId,
        module: u32,
        name: &str,
        offset: u64,
        data: &[u8],
    ) -> Result<()> {
        let _ = (ctx, module, name, offset, data);
        Err(HalError::Refused(ErrorCode::ModulesNeedCudaGpu))
    }
}
