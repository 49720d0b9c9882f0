//! Suite `sim`: what the GPU model itself delivers, natively (no virtualization): dispatch
//! rate of empty kernels, GP_PUT-store → kernel-start latency, copy-engine bandwidth as a
//! ratio to the host's memcpy, and sgemm throughput. It also reports the host CPU the
//! model's own threads burn, so no figure hides an engine thread fighting for a core.

use std::sync::Arc;
use std::time::Instant;

use thiserror::Error;
use vgpu_guest::workloads::{self, SgemmConfig};
use vgpu_guest::{ChannelOptions, Context, Device, KernelArgs};
use vgpu_host_shim::clock::now_ns;
use vgpu_host_shim::{HalError, SimConfig, SimGpu};

use crate::report::{Better, Figure};
use crate::suites::measure::{median, submit_latency, Publish};

const SUITE: &str = "sim";

#[derive(Debug, Error)]
pub enum SimSuiteError {
    #[error("GPU: {0}")]
    Hal(#[from] HalError),
    #[error("runtime: {0}")]
    Runtime(#[from] vgpu_guest::Error),
    #[error("copy engine produced wrong data at byte {0}")]
    CopyMismatch(usize),
}

/// Sizes of the suite's runs.
#[derive(Debug, Clone)]
pub struct SimOpts {
    pub dispatch_entries: u32,
    pub latency_samples: u32,
    pub copy_bytes: u64,
    pub copy_reps: u32,
    pub sgemm_dim: u32,
    pub sgemm_reps: u32,
}

impl SimOpts {
    pub fn full() -> Self {
        SimOpts {
            dispatch_entries: 200_000,
            latency_samples: 5_000,
            copy_bytes: 64 << 20,
            copy_reps: 16,
            sgemm_dim: 256,
            sgemm_reps: 8,
        }
    }

    /// Small sizes for smoke runs in the test suite.
    pub fn quick() -> Self {
        SimOpts {
            dispatch_entries: 5_000,
            latency_samples: 300,
            copy_bytes: 4 << 20,
            copy_reps: 2,
            sgemm_dim: 64,
            sgemm_reps: 2,
        }
    }
}

fn fig(name: &str, value: f64, unit: &str, better: Better) -> Figure {
    Figure::new(SUITE, name, value, unit, better)
}

pub fn run(opts: &SimOpts) -> Result<Vec<Figure>, SimSuiteError> {
    let gpu = SimGpu::new(SimConfig {
        vram_bytes: (opts.copy_bytes * 4).max(256 << 20),
        ..Default::default()
    })?;
    let dev = Device::native(gpu.clone())?;
    let ctx = dev.create_context()?;
    let wall0 = now_ns();
    let cpu0 = gpu.engine_cpu_ns();
    let mut figs = Vec::new();
    figs.push(dispatch(&ctx, opts)?);
    figs.extend(latency(&ctx, opts)?);
    figs.extend(copy(&ctx, opts)?);
    figs.push(sgemm(&ctx, opts)?);
    figs.push(engine_cpu(&gpu, cpu0, wall0));
    Ok(figs)
}

/// Empty kernels, one per GP entry, back to back on one channel.
fn dispatch(ctx: &Context, opts: &SimOpts) -> Result<Figure, SimSuiteError> {
    let mut ch = ctx.create_channel_with(ChannelOptions {
        gp_entries: 4096,
        ..Default::default()
    })?;
    // Warm up the TLB and the arenas.
    for _ in 0..1000 {
        ch.launch(&KernelArgs::Empty, [1, 1, 1])?;
        ch.submit()?;
    }
    ch.finish()?;
    let t0 = Instant::now();
    for _ in 0..opts.dispatch_entries {
        ch.launch(&KernelArgs::Empty, [1, 1, 1])?;
        ch.submit()?;
    }
    ch.finish()?;
    let rate = opts.dispatch_entries as f64 / t0.elapsed().as_secs_f64();
    Ok(fig("dispatch_empty_kernels", rate, "entries/s", Better::Higher).target(500_000.0))
}

/// Time from the GP_PUT store to the start of a kernel that writes the GPU clock, with
/// the PFIFO in its busy-poll window (one submission right after the previous completes).
fn latency(ctx: &Context, opts: &SimOpts) -> Result<Vec<Figure>, SimSuiteError> {
    let (p50, p99) = submit_latency(ctx, opts.latency_samples, Publish::Store)?;
    Ok(vec![
        fig("submit_latency_p50", p50, "us", Better::Lower).target(5.0),
        fig("submit_latency_p99", p99, "us", Better::Lower),
    ])
}

/// Copy engine VRAM→VRAM bandwidth against the host's memcpy of the same size.
fn copy(ctx: &Context, opts: &SimOpts) -> Result<Vec<Figure>, SimSuiteError> {
    let n = opts.copy_bytes;
    let src = ctx.alloc_vram(n)?;
    let dst = ctx.alloc_vram(n)?;
    let pattern: Vec<u8> = (0..n)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    src.write(0, &pattern)?;
    let mut ch = ctx.create_channel()?;
    // Warm-up copy also commits the destination's pages.
    ch.copy(dst.gpu_va(), src.gpu_va(), n)?;
    let f = ch.submit()?;
    ch.wait(f)?;
    // Host memcpy of the same size, both buffers warm. The two are timed alternately,
    // rep by rep, and compared by their medians, so drift on a noisy host hits both.
    let a = pattern.clone();
    let mut b = vec![1u8; n as usize];
    b.copy_from_slice(&a);
    let mut gpu_gbs = Vec::new();
    let mut host_gbs = Vec::new();
    // The engine's own time: GPU timestamps written just before and just after the copy,
    // so the host's wake-up latency in `wait` does not count.
    let stamps = ctx.alloc_host(4096)?;
    for _ in 0..opts.copy_reps {
        ch.sem_release_timestamp(stamps.gpu_va(), 1)?;
        ch.copy(dst.gpu_va(), src.gpu_va(), n)?;
        ch.sem_release_timestamp(stamps.gpu_va() + 16, 2)?;
        let f = ch.submit()?;
        ch.wait(f)?;
        let (t0, t1) = (stamps.read_u64(8)?, stamps.read_u64(24)?);
        gpu_gbs.push(n as f64 / t1.saturating_sub(t0).max(1) as f64);
        let t0 = now_ns();
        b.copy_from_slice(std::hint::black_box(&a));
        std::hint::black_box(&mut b);
        host_gbs.push(n as f64 / (now_ns() - t0).max(1) as f64);
    }
    let mut check = vec![0u8; n as usize];
    dst.read(0, &mut check)?;
    if let Some(i) = check.iter().zip(&pattern).position(|(a, b)| a != b) {
        return Err(SimSuiteError::CopyMismatch(i));
    }
    let gpu_gbs = median(&mut gpu_gbs);
    let host_gbs = median(&mut host_gbs);
    Ok(vec![
        fig("copy_engine", gpu_gbs, "GB/s", Better::Higher),
        fig("host_memcpy", host_gbs, "GB/s", Better::Higher),
        fig(
            "copy_engine_vs_memcpy",
            gpu_gbs / host_gbs,
            "ratio",
            Better::Higher,
        )
        .target(0.8),
    ])
}

fn sgemm(ctx: &Context, opts: &SimOpts) -> Result<Figure, SimSuiteError> {
    let d = opts.sgemm_dim;
    let cfg = SgemmConfig {
        m: d,
        n: d,
        k: d,
        iterations: opts.sgemm_reps,
        ..Default::default()
    };
    let r = workloads::sgemm::run(ctx, &cfg)?;
    let flops = 2.0 * (d as f64).powi(3) * r.iterations as f64;
    Ok(fig(
        "sgemm",
        flops / r.elapsed.as_secs_f64() / 1e9,
        "GFLOP/s",
        Better::Higher,
    ))
}

fn engine_cpu(gpu: &Arc<SimGpu>, cpu0: u64, wall0: u64) -> Figure {
    let cpu = gpu.engine_cpu_ns().saturating_sub(cpu0) as f64;
    let wall = now_ns().saturating_sub(wall0).max(1) as f64;
    fig("engine_threads_cpu", cpu / wall, "cores", Better::Lower)
}
