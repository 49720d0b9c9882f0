//! `hotspot`: Rodinia-style 2-D stencil, ping-ponging between two VRAM grids; a chain of
//! dependent kernels like the seeds' HOTSPOT benchmark.

use std::time::Instant;

use vgpu_protocol::reference;
use vgpu_protocol::KernelArgs;

use super::{compare_f32, f32_bytes, host_len, Expected, WorkloadReport, XorShift};
use crate::context::Context;
use crate::error::{Error, Result};

#[derive(Debug, Clone)]
pub struct HotspotConfig {
    pub width: u32,
    pub height: u32,
    /// Stencil steps (one kernel each).
    pub iterations: u32,
    /// Steps per submission (GP entry); 1 submits each step on its own.
    pub steps_per_submit: u32,
    pub c_center: f32,
    pub c_neighbor: f32,
    pub seed: u64,
}

impl Default for HotspotConfig {
    fn default() -> Self {
        HotspotConfig {
            width: 512,
            height: 512,
            iterations: 100,
            steps_per_submit: 1,
            c_center: 0.6,
            c_neighbor: 0.1,
            seed: 3,
        }
    }
}

impl HotspotConfig {
    pub fn small() -> Self {
        HotspotConfig {
            width: 37,
            height: 23,
            iterations: 9,
            steps_per_submit: 2,
            ..Default::default()
        }
    }
}

pub fn run(ctx: &Context, cfg: &HotspotConfig) -> Result<WorkloadReport> {
    run_expecting(ctx, cfg, &mut Expected::default())
}

/// [`run`], checking against `expected` (see [`Expected`]).
pub fn run_expecting(
    ctx: &Context,
    cfg: &HotspotConfig,
    expected: &mut Expected,
) -> Result<WorkloadReport> {
    let cells = (cfg.width as u64)
        .checked_mul(cfg.height as u64)
        .ok_or(Error::InvalidArgument("grid too large"))?;
    let bytes = f32_bytes(cells)?;
    let mut rng = XorShift::new(cfg.seed);
    let init = rng.f32_vec(host_len(cells)?);
    let bufs = [ctx.alloc_vram(bytes)?, ctx.alloc_vram(bytes)?];
    bufs[0].write_f32(0, &init)?;

    let mut ch = ctx.create_channel()?;
    let per_submit = cfg.steps_per_submit.max(1);
    let grid = [
        cfg.width.div_ceil(16).max(1),
        cfg.height.div_ceil(16).max(1),
        1,
    ];
    let start = Instant::now();
    let mut last = None;
    for i in 0..cfg.iterations {
        let (src, dst) = (&bufs[(i % 2) as usize], &bufs[((i + 1) % 2) as usize]);
        let args = KernelArgs::Stencil2d {
            src: src.gpu_va(),
            dst: dst.gpu_va(),
            width: cfg.width,
            height: cfg.height,
            c_center: cfg.c_center,
            c_neighbor: cfg.c_neighbor,
        };
        ch.launch(&args, grid)?;
        if (i + 1) % per_submit == 0 || i + 1 == cfg.iterations {
            last = Some(ch.submit()?);
        }
    }
    if let Some(f) = last {
        ch.wait(f)?;
    }
    let elapsed = start.elapsed();

    let (w, h) = (cfg.width as usize, cfg.height as usize);
    let want = expected.get_or(|| {
        let mut cur = init;
        let mut next = vec![0f32; cur.len()];
        for _ in 0..cfg.iterations {
            reference::parallel::stencil2d(w, h, cfg.c_center, cfg.c_neighbor, &cur, &mut next);
            std::mem::swap(&mut cur, &mut next);
        }
        cur
    });
    let out = &bufs[(cfg.iterations % 2) as usize];
    compare_f32("hotspot", &out.read_f32_vec(0, want.len())?, want)?;
    Ok(WorkloadReport {
        name: "hotspot",
        iterations: cfg.iterations as u64,
        elapsed,
        gpu_items: cfg.iterations as u64,
        verified: true,
    })
}
