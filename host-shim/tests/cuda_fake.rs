//! The whole `cuda` GPU (front end, planner, host registration) on the CPU fake device:
//! runs in CI, where there is no GPU.

mod common;

use std::sync::Arc;

use common::cuda_cases::*;
use vgpu_host_shim::cuda::{CudaConfig, FakeCudaGpu, FakeDevice};

fn gpu() -> Arc<FakeCudaGpu> {
    FakeCudaGpu::with_device(
        Arc::new(FakeDevice::default()),
        CudaConfig {
            vram_bytes: 64 << 20,
            ..Default::default()
        },
    )
    .unwrap()
}

#[test]
fn fake_every_kernel_on_system_memory() {
    every_kernel_on_system_memory(&gpu());
}

#[test]
fn fake_every_kernel_on_vram() {
    every_kernel_on_vram(&gpu());
}

#[test]
fn fake_cpu_view_of_vram_is_coherent() {
    cpu_view_of_vram_is_coherent(&gpu());
}

#[test]
fn fake_hostile_pointers_fault_and_change_nothing() {
    hostile_pointers_fault_and_change_nothing(&gpu());
}

#[test]
fn fake_semaphores_order_channels() {
    semaphores_order_channels(&gpu());
}

#[test]
fn fake_counters_and_teardown_unregister_memory() {
    let g = gpu();
    counters_and_teardown(&g);
    // VRAM stays registered; the context's system memory is gone.
    assert_eq!(g.registered_pieces(), 0);
    assert_eq!(g.device().registered.lock().unwrap().len(), 1);
}
