//! `vgpu-host-shim`: the GPU HAL ([`hal::Gpu`]) and its two GPUs, the `sim` software GPU
//! ([`sim`]) and the `cuda` GPU on an NVIDIA device ([`cuda`]).
//!
//! Both GPUs stand on one front-end core, the private `fifo` module: the control pages,
//! the `ChannelCore` each GPU's channel contains (ids, slot, error state, the shared
//! counters, activity count), GP fetch/decode, and the context/channel tables with the
//! VRAM bounds check. A GPU adds only how an entry's methods run: the sim's PFIFO and
//! copy engine, or the cuda planner issuing onto CUDA streams.

pub mod choice;
pub mod clock;
pub mod cuda;
mod fifo;
pub mod gpu_turn;
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
/// Both GPUs' default longest sleep of an idle front end with the doorbell armed.
pub use fifo::doze::DEFAULT_SLEEP_NS as DEFAULT_DOORBELL_SLEEP_NS;
pub use hal::{
    ActivityCounter, ChannelConfig, ChannelCounters, ChannelId, ChannelResume, ContextId,
    EventSink, FdRange, GlobalInfo, Gpu, GpuEvent, GpuInfo, HalError, HostRange, MapFlags,
    MapTarget, PageSize, ParamInfo, SysMemory, SysRegion, VramAlloc,
};
pub use host_copy_log::{CopyDir, HostCopy, HostCopyLog};
pub use sim::{SimConfig, SimGpu, SimStats};
