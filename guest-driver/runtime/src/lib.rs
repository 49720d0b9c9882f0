//! `vgpu-guest`: the guest runtime. Applications are written once against [`Device`],
//! [`Context`], [`Buffer`] and [`Channel`]; a [`Transport`] carries the resource requests
//! (natively to a host-shim GPU, over the loopback frontend, or through `/dev/vgpu`).
//! Work submission itself never goes through the transport: the runtime writes GP
//! entries into memory it owns and stores GP_PUT into the channel's mapped control page.
//!
//! ```no_run
//! # fn demo(gpu: std::sync::Arc<dyn vgpu_host_shim::hal::Gpu>) -> vgpu_guest::Result<()> {
//! use vgpu_guest::{Device, KernelArgs};
//! let dev = Device::native(gpu)?;
//! let ctx = dev.create_context()?;
//! let x = ctx.alloc_vram(4096)?;
//! x.write_f32(0, &[1.0; 1024])?;
//! let mut ch = ctx.create_channel()?;
//! ch.launch(&KernelArgs::Memset { dst: x.gpu_va(), len: 4096, pattern: 0 }, [1, 1, 1])?;
//! let fence = ch.submit()?;
//! ch.wait(fence)?;
//! # Ok(()) }
//! ```

mod arena;
mod buffer;
mod channel;
mod context;
mod control;
mod device;
pub mod devvgpu;
mod error;
#[cfg(feature = "loopback")]
pub mod loopback;
pub mod mmap;
mod native;
mod pushbuf;
mod transport;
mod va;
mod wait;
pub mod workloads;

pub use buffer::Buffer;
pub use channel::{Channel, ChannelOptions, Fence};
pub use context::{Context, BIG_PAGE_THRESHOLD, HUGE_PAGE_THRESHOLD};
pub use device::Device;
pub use error::{Error, Result};
pub use native::{HostRegions, NativeTransport};
pub use transport::{
    BlockOn, ChanHandle, ChannelDesc, CpuPtr, CtxHandle, DeviceInfo, MemHandle, MemKind, Transport,
};
pub use va::{BIG_BASE, HUGE_BASE, SMALL_BASE, VA_END};
pub use vgpu_host_shim::hal::{MapFlags, PageSize};
pub use vgpu_protocol::{ErrorCode, KernelArgs, KernelId, Method, SemaphoreMode};
