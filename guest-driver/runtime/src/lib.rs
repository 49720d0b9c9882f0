//! `vgpu-guest`: the guest runtime. Applications are written once against [`Device`],
//! [`Context`], [`Buffer`] and [`Channel`]; a [`Transport`] carries the resource requests
//! (through `/dev/vgpu` in a VM; on a host, with feature `native` to a host-shim GPU in
//! this process, with feature `loopback` over the loopback frontend). The default build
//! depends on `vgpu-protocol` alone: what a guest compiles has no host code in it.
//! Work submission itself never goes through the transport: the runtime writes GP
//! entries into memory it owns and stores GP_PUT into the channel's mapped control page.
//!
//! ```no_run
//! # fn demo() -> vgpu_guest::Result<()> {
//! use vgpu_guest::{Device, KernelArgs};
//! let dev = Device::devvgpu(vgpu_guest::devvgpu::DEFAULT_PATH)?;
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
pub mod clock;
mod context;
mod control;
mod device;
pub mod devvgpu;
mod error;
#[cfg(feature = "loopback")]
pub mod loopback;
pub mod mmap;
mod module;
#[cfg(feature = "native")]
mod native;
mod pushbuf;
mod stage;
mod transport;
mod va;
mod wait;
pub mod workloads;

pub use buffer::Buffer;
pub use channel::{Channel, ChannelOptions, Fence};
pub use context::{Context, BIG_PAGE_THRESHOLD, HUGE_PAGE_THRESHOLD};
pub use device::Device;
pub use error::{Error, Result};
pub use module::{Arg, Function, Global, Module};
#[cfg(feature = "native")]
pub use native::{HostRegions, NativeTransport};
pub use transport::{
    BlockOn, ChanHandle, ChannelDesc, CpuPtr, CtxHandle, DeviceInfo, MemHandle, MemKind,
    NewContext, Transport,
};
pub use va::{BIG_BASE, HUGE_BASE, HUGE_SLOTS, HUGE_SLOT_BYTES, SMALL_BASE, VA_END};
pub use vgpu_protocol::mem::{MapFlags, PageSize};
pub use vgpu_protocol::{ErrorCode, KernelArgs, KernelId, Method, SemaphoreMode};
