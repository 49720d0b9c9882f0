//! The `cuda` GPU on a real NVIDIA GPU. Every test prints why it skipped when there is no
//! driver or GPU (CI); on the device machine run it as described in docs/testing.md.
//! `VGPU_CUDA_INDEX` picks the GPU (default 0).

mod common;

use std::sync::Arc;

use common::cuda_cases::*;
use vgpu_host_shim::cuda::{CudaConfig, CudaGpu};

fn gpu() -> Option<Arc<CudaGpu>> {
    let index = std::env::var("VGPU_CUDA_INDEX")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    match CudaGpu::open(
        index,
        CudaConfig {
            vram_bytes: 256 << 20,
            ..Default::default()
        },
    ) {
        Ok(g) => Some(g),
        Err(e) if e.is_absent() => {
            eprintln!("SKIPPED: no usable CUDA GPU here: {e}");
            None
        }
        Err(e) => panic!("a CUDA GPU is present but cannot be used: {e}"),
    }
}

#[test]
fn gpu_every_kernel_on_system_memory() {
    if let Some(g) = gpu() {
        every_kernel_on_system_memory(&g);
    }
}

#[test]
fn gpu_every_kernel_on_vram() {
    if let Some(g) = gpu() {
        every_kernel_on_vram(&g);
    }
}

#[test]
fn gpu_host_copies_and_kernels_agree_on_vram() {
    if let Some(g) = gpu() {
        host_copies_and_kernels_agree_on_vram(&g);
    }
}

#[test]
fn gpu_batched_host_copies_move_many_chunks_exactly() {
    if let Some(g) = gpu() {
        batched_host_copies_move_many_chunks_exactly(&g);
    }
}

#[test]
fn gpu_hostile_pointers_fault_and_change_nothing() {
    if let Some(g) = gpu() {
        hostile_pointers_fault_and_change_nothing(&g);
    }
}

#[test]
fn gpu_semaphores_order_channels() {
    if let Some(g) = gpu() {
        semaphores_order_channels(&g);
    }
}

#[test]
fn gpu_fence_signals_before_its_batch_ends() {
    if let Some(g) = gpu() {
        fence_signals_before_its_batch_ends(&g);
    }
}

#[test]
fn gpu_counters_and_teardown() {
    if let Some(g) = gpu() {
        counters_and_teardown(&g);
        assert_eq!(g.registered_pieces(), 0);
    }
}

#[test]
fn gpu_resumed_channel_continues_at_its_saved_position() {
    if let Some(g) = gpu() {
        resumed_channel_continues_at_its_saved_position(&g);
    }
}

#[test]
fn gpu_activity_counter_counts_the_group_work() {
    if let Some(g) = gpu() {
        activity_counter_counts_the_group_work(&g);
    }
}
