//! The `cuda` GPU's cases through a worker process on a real NVIDIA GPU (issue 30): runs
//! when `VGPU_WORKER_GPU` names the worker's GPU (`cuda`, `cuda:N`), as on the device
//! machine (`ci/device/run.sh run workers`); prints SKIPPED otherwise.

#[path = "../../host-shim/tests/common/mod.rs"]
mod common;

use std::sync::Arc;

use common::cuda_cases::*;
use vgpu_gpu_worker::{WorkerGpu, WorkerOptions, WorkerProgram};

fn worker() -> Option<Arc<WorkerGpu>> {
    let Ok(gpu) = std::env::var("VGPU_WORKER_GPU") else {
        eprintln!("SKIPPED: VGPU_WORKER_GPU is not set (no GPU named for the worker)");
        return None;
    };
    let prog = WorkerProgram {
        // The device machine runs a copy of the binaries: `VGPU_GPU_WORKER` says where.
        program: std::env::var_os("VGPU_GPU_WORKER")
            .map_or_else(|| env!("CARGO_BIN_EXE_vgpu-gpu-worker").into(), Into::into),
        args: ["--gpu", &gpu, "--vram-mib", "256", "--max-channels", "64"]
            .map(String::from)
            .to_vec(),
    };
    Some(WorkerGpu::start(&prog, &WorkerOptions::default()).expect("a worker on the GPU"))
}

#[test]
fn gpu_worker_every_kernel_on_system_memory() {
    if let Some(g) = worker() {
        every_kernel_on_system_memory(&g);
    }
}

#[test]
fn gpu_worker_every_kernel_on_vram() {
    if let Some(g) = worker() {
        every_kernel_on_vram(&g);
    }
}

#[test]
fn gpu_worker_host_copies_and_kernels_agree_on_vram() {
    if let Some(g) = worker() {
        host_copies_and_kernels_agree_on_vram(&g);
    }
}

#[test]
fn gpu_worker_batched_host_copies_move_many_chunks_exactly() {
    if let Some(g) = worker() {
        batched_host_copies_move_many_chunks_exactly(&g);
    }
}

#[test]
fn gpu_worker_hostile_pointers_fault_and_change_nothing() {
    if let Some(g) = worker() {
        hostile_pointers_fault_and_change_nothing(&g);
    }
}

#[test]
fn gpu_worker_semaphores_order_channels() {
    if let Some(g) = worker() {
        semaphores_order_channels(&g);
    }
}

#[test]
fn gpu_worker_resumed_channel_continues_at_its_saved_position() {
    if let Some(g) = worker() {
        resumed_channel_continues_at_its_saved_position(&g);
    }
}

#[test]
fn gpu_worker_fence_signals_before_its_batch_ends() {
    if let Some(g) = worker() {
        fence_signals_before_its_batch_ends(&g);
    }
}

#[test]
fn gpu_worker_module_vector_adds() {
    if let Some(g) = worker() {
        common::module_cases::module_vector_adds(&g);
    }
}

#[test]
fn gpu_worker_module_global_round_trip() {
    if let Some(g) = worker() {
        common::module_cases::module_global_round_trip(&g);
    }
}

#[test]
fn gpu_worker_module_hostile_inputs() {
    if let Some(g) = worker() {
        common::module_cases::module_hostile_inputs(&g);
    }
}

/// A guest's kernel writing a wild pointer on the real GPU: its worker's context is lost
/// and the worker exits; another worker keeps running verified module work.
#[test]
fn gpu_worker_module_wild_write_loses_its_worker_only() {
    let (Some(a), Some(b)) = (worker(), worker()) else {
        return;
    };
    let lost = || a.is_lost();
    common::module_cases::module_wild_write_loses_the_context(&a, &lost);
    common::module_cases::module_vector_adds(&b);
}
