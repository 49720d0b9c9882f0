//! The `cuda` GPU on a real NVIDIA GPU. Every test prints why it skipped when there is no
//! driver or GPU (CI); on the device machine run it as described in docs/testing.md.
//! `VGPU_CUDA_INDEX` picks the GPU (default 0).

mod common;

use std::sync::Arc;

use common::cuda_cases::*;
use vgpu_host_shim::cuda::{CudaConfig, CudaGpu};

fn gpu() -> Option<Arc<CudaGpu>> {
    // `RUST_LOG=warn` shows what the GPU reports (a teardown that leaks, say).
    let _ = env_logger::builder().is_test(true).try_init();
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
fn gpu_fence_wake_up_comes_when_ref_reaches_the_armed_value() {
    if let Some(g) = gpu() {
        fence_wake_up_comes_when_ref_reaches_the_armed_value(&g);
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
fn gpu_counts_activity_of_a_channel_group() {
    if let Some(g) = gpu() {
        activity_counter_counts_the_group_work(&g);
    }
}

/// Known bug (found 2026-11-26 on the H100): once a `CudaGpu` of the process has been
/// dropped, the next one's batched host-to-VRAM copies fail with
/// `cuMemcpyHtoDAsync: CUDA_ERROR_INVALID_VALUE` (single copies and kernels work; with the
/// first GPU still alive both work). A backend opens one GPU per process, so it shows
/// only in this suite, where each test opens its own; the per-VM workers of issue 30 own
/// one context each. Run with `--ignored` to see it. Until it is fixed the batched case
/// must be the first of the process to open a GPU (`--test-threads=1` runs tests by name:
/// `gpu_batched_…` comes first).
#[test]
#[ignore = "known bug: batched copies of a CudaGpu opened after another was dropped"]
fn gpu_second_gpu_after_a_dropped_one_copies_in_batches() {
    if let Some(g) = gpu() {
        batched_host_copies_move_many_chunks_exactly(&g);
    }
    if let Some(g) = gpu() {
        batched_host_copies_move_many_chunks_exactly(&g);
    }
}

/// The `cuda` GPU in a process that serves every VM refuses a guest's module and says
/// what runs them (modules on a real GPU: `gpu-worker/tests/worker_cuda.rs`).
#[test]
fn gpu_in_process_refuses_guest_modules() {
    if let Some(g) = gpu() {
        use vgpu_host_shim::Gpu;
        let p = common::Proc::new(&g, common::SYS_BASE);
        let err = g
            .module_load(p.ctx, 1, common::module_cases::TEST_PTX.as_bytes())
            .unwrap_err();
        assert_eq!(err.code(), vgpu_protocol::ErrorCode::ModulesNeedWorker);
        g.destroy_context(p.ctx).unwrap();
    }
}
