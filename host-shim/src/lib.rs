//! `vgpu-host-shim`: the GPU HAL ([`hal::Gpu`]) and the `sim` software GPU.

pub mod choice;
pub mod clock;
pub mod cuda;
pub mod gpu_view;
pub mod hal;
pub mod host_copy_log;
pub mod kernels;
pub mod mmu;
pub mod shared_mem;
pub mod sim;
pub mod wait_clock;

/// The VRAM allocator: the protocol's range allocator, shared with the runtime's GPU
/// virtual address allocator.
mod vram_pool;
pub mod write_log;
pub mod vram {
    pub use vgpu_protocol::range::{RangeAllocator, VramAllocator, VRAM_GRANULE};
}

pub use choice::GpuChoice;
pub use hal::{
    ActivityCounter, ChannelConfig, ChannelCounters, ChannelId, ChannelResume, ContextId,
    EventSink, FdRange, Gpu, GpuEvent, GpuInfo, HalError, HostRange, MapFlags, MapTarget, PageSize,
    SysMemory, VramAlloc,
};
pub use host_copy_log::{CopyDir, HostCopy, HostCopyLog};
pub use sim::{SimConfig, SimGpu, SimStats};
