//! `saxpy`: `y = a·x + y` repeated over VRAM vectors; a bandwidth-bound kernel loop.

use std::time::Instant;

use vgpu_protocol::reference;
use vgpu_protocol::KernelArgs;

use super::{compare_f32, f32_bytes, grid_1d, host_len, Expected, WorkloadReport, XorShift};
use crate::context::Context;
use crate::error::Result;

#[derive(Debug, Clone)]
pub struct SaxpyConfig {
    /// Vector length in elements (the size knob).
    pub n: u64,
    pub iterations: u32,
    pub a: f32,
    pub seed: u64,
}

impl Default for SaxpyConfig {
    fn default() -> Self {
        SaxpyConfig {
            n: 1 << 20,
            iterations: 100,
            a: 0.5,
            seed: 1,
        }
    }
}

impl SaxpyConfig {
    pub fn small() -> Self {
        SaxpyConfig {
            n: 4096 + 3,
            iterations: 8,
            ..Default::default()
        }
    }
}

pub fn run(ctx: &Context, cfg: &SaxpyConfig) -> Result<WorkloadReport> {
    run_expecting(ctx, cfg, &mut Expected::default())
}

/// [`run`], checking against `expected` (see [`Expected`]).
pub fn run_expecting(
    ctx: &Context,
    cfg: &SaxpyConfig,
    expected: &mut Expected,
) -> Result<WorkloadReport> {
    let bytes = f32_bytes(cfg.n)?;
    let mut rng = XorShift::new(cfg.seed);
    let x = rng.f32_vec(host_len(cfg.n)?);
    let y = rng.f32_vec(x.len());
    let xb = ctx.alloc_vram(bytes)?;
    let yb = ctx.alloc_vram(bytes)?;
    xb.write_f32(0, &x)?;
    yb.write_f32(0, &y)?;

    let mut ch = ctx.create_channel()?;
    let args = KernelArgs::Saxpy {
        x: xb.gpu_va(),
        y: yb.gpu_va(),
        n: cfg.n,
        a: cfg.a,
    };
    let start = Instant::now();
    // One GP entry per iteration; the channel runs them in order, so only the last fence
    // needs waiting for (the runtime waits for ring space on its own).
    let mut last = None;
    for _ in 0..cfg.iterations {
        ch.launch(&args, grid_1d(cfg.n))?;
        last = Some(ch.submit()?);
    }
    if let Some(f) = last {
        ch.wait(f)?;
    }
    let elapsed = start.elapsed();

    let want = expected.get_or(|| {
        let mut y = y;
        for _ in 0..cfg.iterations {
            reference::parallel::saxpy(cfg.a, &x, &mut y);
        }
        y
    });
    compare_f32("saxpy", &yb.read_f32_vec(0, want.len())?, want)?;
    Ok(WorkloadReport {
        name: "saxpy",
        iterations: cfg.iterations as u64,
        elapsed,
        gpu_items: cfg.iterations as u64,
        verified: true,
    })
}
