//! The in-process `sim` GPU behind the tools' `--native` option: the baseline without
//! virtualization, for a host (or the rig's L1). Only a build with feature `native` has
//! it; the guest build (the default) depends on the guest runtime alone.

use thiserror::Error;
use vgpu_guest::Device;

#[derive(Debug, Error)]
pub enum NativeError {
    #[cfg(feature = "native")]
    #[error("GPU: {0}")]
    Hal(#[from] vgpu_host_shim::HalError),
    #[error(transparent)]
    Runtime(#[from] vgpu_guest::Error),
    #[error("--native needs the tools built with feature `native` (a host build)")]
    NotBuilt,
}

/// Opens an in-process sim GPU through the native transport. `max_idle_sleep_us` caps
/// the sim's idle sleep between GP_PUT polls (match a backend's `--sim-idle-sleep-us`).
#[cfg(feature = "native")]
pub fn device(max_idle_sleep_us: Option<u64>) -> Result<Device, NativeError> {
    let mut cfg = vgpu_host_shim::SimConfig::default();
    if let Some(us) = max_idle_sleep_us {
        cfg.max_idle_sleep_ns = us.saturating_mul(1000).max(cfg.min_idle_sleep_ns);
    }
    Ok(Device::native(vgpu_host_shim::SimGpu::new(cfg)?)?)
}

/// Without feature `native` there is no in-process GPU.
#[cfg(not(feature = "native"))]
pub fn device(_max_idle_sleep_us: Option<u64>) -> Result<Device, NativeError> {
    Err(NativeError::NotBuilt)
}
