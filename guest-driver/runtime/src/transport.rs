//! What differs between the ways a process reaches the GPU.
//!
//! The runtime's public types (`Device`, `Context`, `Buffer`, `Channel`) are written once
//! against this trait. A transport hands out opaque handles and raw CPU pointers into
//! mappings *it* owns (an `mmap` of the GPU's memfds natively, a window of the device BAR
//! in the loopback transport, an `mmap` of `/dev/vgpu` in a guest). Pointers stay valid
//! until the object they belong to is freed through the same transport. The fast path —
//! writing GP entries and storing GP_PUT — never goes through the transport.

use std::ptr::NonNull;
use std::time::Duration;

use vgpu_protocol::mem::{MapFlags, PageSize};
use vgpu_protocol::module::ParamInfo;

use crate::error::Result;

/// A GPU address space, as named by the transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CtxHandle(pub u64);

/// A memory allocation (VRAM or host memory), as named by the transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemHandle(pub u64);

/// A channel, as named by the transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChanHandle(pub u64);

/// Where an allocation lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemKind {
    /// GPU memory; CPU access goes through an aperture mapping, or through copies where
    /// the CPU cannot map VRAM (see `Buffer`).
    Vram,
    /// System memory the GPU reaches through its MMU (SYSRAM target).
    Host,
}

/// A CPU view of transport-owned memory: `len` bytes at `ptr`.
#[derive(Debug, Clone, Copy)]
pub struct CpuPtr {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a `CpuPtr` is only an address; whoever dereferences it must uphold the
// transport's validity contract and synchronise with the GPU, on any thread.
unsafe impl Send for CpuPtr {}
// SAFETY: as for `Send`: sharing the address itself is harmless.
unsafe impl Sync for CpuPtr {}

impl CpuPtr {
    /// # Safety
    /// `ptr..ptr+len` must be mapped read/write memory that stays mapped until the object
    /// it was handed out for is freed through the transport that handed it out.
    pub unsafe fn new(ptr: NonNull<u8>, len: usize) -> Self {
        CpuPtr { ptr, len }
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Answers whether the device was lost under a process (see [`Transport::lost_probe`]).
pub type LostProbe = std::sync::Arc<dyn Fn() -> bool + Send + Sync>;

/// A newly created channel: its handle and its mapped control page.
#[derive(Debug, Clone, Copy)]
pub struct ChannelDesc {
    pub handle: ChanHandle,
    /// The channel's 4 KiB control page (see `vgpu_protocol::ControlPage`). For a
    /// forwarded channel, a copy the transport owns and refreshes in
    /// [`Transport::refresh_control`]; stores to it reach no GPU.
    pub control: CpuPtr,
    /// Forwarded submission (the device has no shared-memory region): GP_PUT goes out
    /// with [`Transport::remote_submit`], and `control` is brought up to date with
    /// [`Transport::refresh_control`] (protocol.md §9, "Forwarded submission").
    pub forwarded: bool,
}

/// Facts about the device a transport reaches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Which transport carries requests (`native`, `loopback`, `devvgpu`).
    pub transport: &'static str,
    pub name: String,
    pub protocol_version: u32,
    pub vram_bytes: u64,
    pub compute_engines: u32,
    pub max_channels: u32,
    pub max_contexts: u32,
}

/// What a blocking wait ([`Transport::block_on`]) waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockOn {
    /// The channel's REF reaches this fence value (wrapping compare).
    Fence(u32),
    /// The channel's notify count (NOTIFY_SEQ, or notify events seen) reaches this value.
    Notify(u32),
}

/// A context the device made: its handle, and the huge-page slot the host asked its
/// 2 MiB-page buffers to start in (`CREATE_CONTEXT`'s reply; `None`: the runtime picks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NewContext {
    pub handle: CtxHandle,
    pub huge_slot: Option<u32>,
}

/// The resource-management half of the device interface. Object safe; implementations
/// must be callable from any thread. Sizes and addresses passed in are already aligned
/// to the page size the caller chose.
pub trait Transport: Send + Sync {
    fn info(&self) -> Result<DeviceInfo>;

    fn create_context(&self) -> Result<NewContext>;
    /// Destroys the address space and anything of it still alive (channels first).
    fn destroy_context(&self, ctx: CtxHandle) -> Result<()>;

    /// Allocates `size` bytes of VRAM aligned to `align` (a power of two).
    fn alloc_vram(&self, ctx: CtxHandle, size: u64, align: u64) -> Result<MemHandle>;
    /// Allocates `size` bytes of zeroed host memory the GPU can reach, aligned to `align`.
    fn alloc_host(&self, ctx: CtxHandle, size: u64, align: u64) -> Result<MemHandle>;
    /// The GPU page size host allocations get when `wanted` would suit their size. A
    /// transport whose host memory is scattered physically (pinned guest pages) maps it
    /// with 4 KiB pages, and the buffer must then sit where 4 KiB pages may go.
    fn host_page_size(&self, wanted: PageSize) -> PageSize {
        wanted
    }
    /// Frees an allocation (its GPU mappings must be gone) and any CPU view of it.
    fn free_mem(&self, ctx: CtxHandle, mem: MemHandle) -> Result<()>;
    /// A CPU view of the whole allocation, valid until `free_mem`. May be created lazily
    /// (VRAM apertures cost a mapping); repeated calls return the same view.
    fn cpu_map(&self, ctx: CtxHandle, mem: MemHandle) -> Result<CpuPtr>;

    /// Maps the whole allocation at `va` in the context's GPU address space.
    fn gpu_map(
        &self,
        ctx: CtxHandle,
        mem: MemHandle,
        va: u64,
        page: PageSize,
        flags: MapFlags,
    ) -> Result<()>;
    /// Unmaps `va..va+size`; when it returns the GPU no longer uses the old translation.
    fn gpu_unmap(&self, ctx: CtxHandle, va: u64, size: u64) -> Result<()>;

    /// Creates a channel whose GP ring of `gp_entries` entries lives at `gp_ring_va`.
    fn create_channel(
        &self,
        ctx: CtxHandle,
        gp_ring_va: u64,
        gp_entries: u32,
    ) -> Result<ChannelDesc>;
    /// Destroys a channel; its control page must no longer be touched afterwards.
    fn destroy_channel(&self, ctx: CtxHandle, ch: ChanHandle) -> Result<()>;
    /// A cheap check that the device this process started on is gone (reset under it):
    /// channels consult it before touching their control page, whose mapping may then
    /// show another generation's page. `None`: the transport never loses its device, or
    /// its kernel driver takes the mapping away itself.
    fn lost_probe(&self) -> Option<LostProbe> {
        None
    }
    /// Rings the doorbell: the GPU's front end, asleep (the channel's `WANT_DOORBELL`),
    /// looks at its channels now instead of at the end of its sleep (protocol.md,
    /// "Doorbell"). Best effort: a ring that cannot be delivered only delays the work.
    fn doorbell(&self, ch: ChanHandle);

    /// Has the host store `gp_put` into the channel's control page: the API-remoting
    /// baseline, one request per submission. Transports without a host side refuse.
    fn remote_submit(&self, _ctx: CtxHandle, _ch: ChanHandle, _gp_put: u32) -> Result<()> {
        Err(crate::error::Error::Device(
            vgpu_protocol::ErrorCode::Unsupported,
        ))
    }

    /// Forwarded channels: copies the GPU-written fields of the channel's control page
    /// (GP_GET, REF, NOTIFY_SEQ, ERROR, ERROR_INFO) into the page handed out in its
    /// [`ChannelDesc`] (one request). Direct channels need nothing: the page is the GPU's.
    fn refresh_control(&self, _ctx: CtxHandle, _ch: ChanHandle) -> Result<()> {
        Ok(())
    }

    /// Loads a module image (PTX, cubin or fatbin) into the context; returns its id.
    /// Transports that cannot carry guest modules refuse.
    fn module_load(&self, _ctx: CtxHandle, _image: &[u8]) -> Result<u32> {
        Err(crate::error::Error::Device(
            vgpu_protocol::ErrorCode::Unsupported,
        ))
    }
    fn module_unload(&self, _ctx: CtxHandle, _module: u32) -> Result<()> {
        Err(crate::error::Error::Device(
            vgpu_protocol::ErrorCode::Unsupported,
        ))
    }
    /// Function `name` of `module`: its id for `LAUNCH_FUNCTION` and its parameter
    /// layout when the GPU knows it.
    fn function_get(
        &self,
        _ctx: CtxHandle,
        _module: u32,
        _name: &str,
    ) -> Result<(u32, Option<Vec<ParamInfo>>)> {
        Err(crate::error::Error::Device(
            vgpu_protocol::ErrorCode::Unsupported,
        ))
    }
    /// The real GPU's device attributes (`(CUdevice_attribute, value)`; none on the
    /// sim). Transports without them refuse.
    fn device_attributes(&self) -> Result<Vec<(u32, i32)>> {
        Err(crate::error::Error::Device(
            vgpu_protocol::ErrorCode::Unsupported,
        ))
    }
    /// Global `name` of `module`: its device address and size.
    fn global_get(&self, _ctx: CtxHandle, _module: u32, _name: &str) -> Result<(u64, u64)> {
        Err(crate::error::Error::Device(
            vgpu_protocol::ErrorCode::Unsupported,
        ))
    }
    /// Copies `data` to `offset` of global `name` of `module` (GLOBAL_WRITE). Not
    /// ordered against the context's GPU work: callers wait for it first.
    fn global_write(
        &self,
        _ctx: CtxHandle,
        _module: u32,
        _name: &str,
        _offset: u64,
        _data: &[u8],
    ) -> Result<()> {
        Err(crate::error::Error::Device(
            vgpu_protocol::ErrorCode::Unsupported,
        ))
    }
    /// Copies `buf.len()` bytes from `offset` of global `name` of `module` into `buf`
    /// (GLOBAL_READ); as [`Transport::global_write`], after the context's work.
    fn global_read(
        &self,
        _ctx: CtxHandle,
        _module: u32,
        _name: &str,
        _offset: u64,
        _buf: &mut [u8],
    ) -> Result<()> {
        Err(crate::error::Error::Device(
            vgpu_protocol::ErrorCode::Unsupported,
        ))
    }

    /// How many device events (fence wake-ups, channel errors) this process has seen,
    /// where a waiter on channel `ch` can sleep until the next
    /// ([`Transport::wait_device_events`]); `None` where it cannot (it polls).
    fn device_events(&self, _ctx: CtxHandle, _ch: ChanHandle) -> Option<u64> {
        None
    }

    /// Sleeps, with channel `ch`'s fence wake-up armed for `fence`, until the count of
    /// [`Transport::device_events`] differs from `seen` (or, in a kernel driver, until
    /// an event finds the fence reached) or `timeout` passes; whether the sleep ended
    /// before its time.
    fn wait_device_events(
        &self,
        _ctx: CtxHandle,
        _ch: ChanHandle,
        _fence: u32,
        _seen: u64,
        timeout: Duration,
    ) -> bool {
        std::thread::sleep(timeout.min(Duration::from_micros(100)));
        false
    }

    /// Sleeps in the driver until `what` is reached, the channel faults
    /// (`ChannelFault`) or `timeout` passes (`Timeout`). Transports without a kernel
    /// driver refuse; callers then poll the control page (`Channel::wait`).
    fn block_on(
        &self,
        _ctx: CtxHandle,
        _ch: ChanHandle,
        _what: BlockOn,
        _timeout: Duration,
    ) -> Result<()> {
        Err(crate::error::Error::Device(
            vgpu_protocol::ErrorCode::Unsupported,
        ))
    }
}
