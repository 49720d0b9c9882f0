//! `Device`: a GPU reached through some transport; the root of the public API.

use std::sync::Arc;

use crate::context::Context;
use crate::error::Result;
use crate::transport::{DeviceInfo, Transport};

/// An opened GPU. Cheap to clone; contexts keep the transport alive on their own.
#[derive(Clone)]
pub struct Device {
    transport: Arc<dyn Transport>,
    info: DeviceInfo,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("info", &self.info).finish()
    }
}

impl Device {
    /// Opens a device over any transport.
    pub fn new(transport: Arc<dyn Transport>) -> Result<Self> {
        let info = transport.info()?;
        log::debug!("opened {} device {:?}", info.transport, info.name);
        Ok(Device { transport, info })
    }

    /// Opens a GPU of this process directly (the baseline without virtualization).
    #[cfg(feature = "native")]
    pub fn native(gpu: Arc<dyn vgpu_host_shim::hal::Gpu>) -> Result<Self> {
        Self::new(Arc::new(crate::native::NativeTransport::new(gpu)))
    }

    /// Opens the vgpu device of a loopback VM as guest process `pid`.
    #[cfg(feature = "loopback")]
    pub fn loopback(vm: Arc<vgpu_loopback::LoopbackVm>, pid: u32) -> Result<Self> {
        Self::new(Arc::new(crate::loopback::LoopbackTransport::new(vm, pid)))
    }

    /// Connects a loopback VM of `mem_bytes` of guest RAM (a VMM in this process) to a
    /// running backend's vhost-user socket and opens the device as guest process `pid`
    /// (host-side checks of a running backend).
    #[cfg(feature = "loopback")]
    pub fn connect_loopback(
        socket: impl AsRef<std::path::Path>,
        mem_bytes: u64,
        pid: u32,
    ) -> Result<Self> {
        Self::connect_loopback_with(socket, mem_bytes, false, pid)
    }

    /// [`Self::connect_loopback`], with `forwarded`: a frontend without a shared-memory
    /// region (forwarded submission, protocol.md §9.1).
    #[cfg(feature = "loopback")]
    pub fn connect_loopback_with(
        socket: impl AsRef<std::path::Path>,
        mem_bytes: u64,
        forwarded: bool,
        pid: u32,
    ) -> Result<Self> {
        let mut cfg = vgpu_loopback::LoopbackConfig::with_mem(mem_bytes);
        if forwarded {
            cfg = cfg.forwarded();
        }
        let vm = vgpu_loopback::LoopbackVm::connect(socket.as_ref(), cfg).map_err(|e| {
            crate::error::Error::Os {
                what: "connecting the loopback VM",
                source: std::io::Error::other(e.to_string()),
            }
        })?;
        Self::loopback(vm, pid)
    }

    /// Opens the guest driver's device node (in a VM: [`crate::devvgpu::DEFAULT_PATH`]).
    pub fn devvgpu(path: impl AsRef<std::path::Path>) -> Result<Self> {
        Self::new(Arc::new(crate::devvgpu::DevVgpuTransport::open(path)?))
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    pub fn transport(&self) -> &Arc<dyn Transport> {
        &self.transport
    }

    /// Creates a GPU address space.
    pub fn create_context(&self) -> Result<Context> {
        Context::new(self.transport.clone())
    }
}
