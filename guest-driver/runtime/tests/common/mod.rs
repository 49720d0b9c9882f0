//! Shared setup: a small `sim` GPU opened through the native transport.

use std::sync::Arc;

use vgpu_guest::Device;
use vgpu_host_shim::hal::Gpu;
use vgpu_host_shim::sim::{SimConfig, SimGpu};

pub fn sim() -> Arc<SimGpu> {
    SimGpu::new(SimConfig {
        vram_bytes: 256 << 20,
        compute_engines: 1,
        max_channels: 64,
        max_contexts: 16,
        ..Default::default()
    })
    .expect("sim GPU")
}

pub fn device() -> (Arc<SimGpu>, Device) {
    let gpu = sim();
    let dyn_gpu: Arc<dyn Gpu> = gpu.clone();
    let dev = Device::native(dyn_gpu).expect("native device");
    (gpu, dev)
}
