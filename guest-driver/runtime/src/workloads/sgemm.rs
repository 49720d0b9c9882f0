//! `sgemm`: `C = alpha·A·B + beta·C` repeated; a compute-bound kernel loop.

use std::time::Instant;

use vgpu_protocol::reference;
use vgpu_protocol::KernelArgs;

use super::{compare_f32, f32_bytes, host_len, Expected, WorkloadReport, XorShift};
use crate::context::Context;
use crate::error::{Error, Result};

#[derive(Debug, Clone)]
pub struct SgemmConfig {
    /// A is m×k, B is k×n, C is m×n (row-major).
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub iterations: u32,
    pub alpha: f32,
    /// Below 1 so that repeated iterations stay bounded.
    pub beta: f32,
    pub seed: u64,
}

impl Default for SgemmConfig {
    fn default() -> Self {
        SgemmConfig {
            m: 256,
            n: 256,
            k: 256,
            iterations: 10,
            alpha: 1.0,
            beta: 0.5,
            seed: 2,
        }
    }
}

impl SgemmConfig {
    pub fn small() -> Self {
        SgemmConfig {
            m: 33,
            n: 17,
            k: 29,
            iterations: 3,
            ..Default::default()
        }
    }
}

fn elems(r: u32, c: u32) -> Result<u64> {
    (r as u64)
        .checked_mul(c as u64)
        .ok_or(Error::InvalidArgument("matrix too large"))
}

pub fn run(ctx: &Context, cfg: &SgemmConfig) -> Result<WorkloadReport> {
    run_expecting(ctx, cfg, &mut Expected::default())
}

/// [`run`], checking against `expected` (see [`Expected`]).
pub fn run_expecting(
    ctx: &Context,
    cfg: &SgemmConfig,
    expected: &mut Expected,
) -> Result<WorkloadReport> {
    let (m, n, k) = (cfg.m, cfg.n, cfg.k);
    let (a_n, b_n, c_n) = (elems(m, k)?, elems(k, n)?, elems(m, n)?);
    let mut rng = XorShift::new(cfg.seed);
    let a = rng.f32_vec(host_len(a_n)?);
    let b = rng.f32_vec(host_len(b_n)?);
    let c = rng.f32_vec(host_len(c_n)?);
    let ab = ctx.alloc_vram(f32_bytes(a_n)?)?;
    let bb = ctx.alloc_vram(f32_bytes(b_n)?)?;
    let cb = ctx.alloc_vram(f32_bytes(c_n)?)?;
    ab.write_f32(0, &a)?;
    bb.write_f32(0, &b)?;
    cb.write_f32(0, &c)?;

    let mut ch = ctx.create_channel()?;
    let args = KernelArgs::Sgemm {
        a: ab.gpu_va(),
        b: bb.gpu_va(),
        c: cb.gpu_va(),
        m,
        n,
        k,
        alpha: cfg.alpha,
        beta: cfg.beta,
    };
    let grid = [n.div_ceil(16).max(1), m.div_ceil(16).max(1), 1];
    let start = Instant::now();
    let mut last = None;
    for _ in 0..cfg.iterations {
        ch.launch(&args, grid)?;
        last = Some(ch.submit()?);
    }
    if let Some(f) = last {
        ch.wait(f)?;
    }
    let elapsed = start.elapsed();

    let (mu, nu, ku) = (m as usize, n as usize, k as usize);
    let want = expected.get_or(|| {
        let mut c = c;
        for _ in 0..cfg.iterations {
            reference::parallel::sgemm(mu, nu, ku, cfg.alpha, &a, &b, cfg.beta, &mut c);
        }
        c
    });
    compare_f32("sgemm", &cb.read_f32_vec(0, want.len())?, want)?;
    Ok(WorkloadReport {
        name: "sgemm",
        iterations: cfg.iterations as u64,
        elapsed,
        gpu_items: cfg.iterations as u64,
        verified: true,
    })
}
