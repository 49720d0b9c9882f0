//! `reduction`: ReduceSum and Checksum over a VRAM vector, results written to host
//! memory (so SYSRAM mappings are exercised). Each iteration starts at a slightly
//! different element, so a stale result cannot pass for a fresh one.

use std::time::Instant;

use vgpu_protocol::reference;
use vgpu_protocol::KernelArgs;

use super::{f32_bytes, grid_1d, host_len, WorkloadReport, XorShift};
use crate::context::Context;
use crate::error::{Error, Result};

#[derive(Debug, Clone)]
pub struct ReductionConfig {
    /// Vector length in elements (the size knob).
    pub n: u64,
    pub iterations: u32,
    pub seed: u64,
}

impl Default for ReductionConfig {
    fn default() -> Self {
        ReductionConfig {
            n: 1 << 22,
            iterations: 20,
            seed: 4,
        }
    }
}

impl ReductionConfig {
    pub fn small() -> Self {
        ReductionConfig {
            n: 10_000,
            iterations: 6,
            ..Default::default()
        }
    }
}

/// Bytes of results per iteration: f32 sum, padding, u64 checksum.
const SLOT: u64 = 16;
/// Iteration `i` skips `i % SKEW` leading elements.
const SKEW: u64 = 4;

pub fn run(ctx: &Context, cfg: &ReductionConfig) -> Result<WorkloadReport> {
    if cfg.n <= SKEW {
        return Err(Error::InvalidArgument(
            "reduction needs more than 4 elements",
        ));
    }
    let mut rng = XorShift::new(cfg.seed);
    let data = rng.f32_vec(host_len(cfg.n)?);
    let src = ctx.alloc_vram(f32_bytes(cfg.n)?)?;
    src.write_f32(0, &data)?;
    let res = ctx.alloc_host(SLOT * cfg.iterations.max(1) as u64)?;

    let mut ch = ctx.create_channel()?;
    let start = Instant::now();
    let mut last = None;
    for i in 0..cfg.iterations as u64 {
        let skip = i % SKEW;
        let (va, count) = (src.gpu_va() + skip * 4, cfg.n - skip);
        let dst = res.gpu_va() + i * SLOT;
        ch.launch(
            &KernelArgs::ReduceSum {
                src: va,
                n: count,
                dst,
            },
            grid_1d(count),
        )?;
        ch.launch(
            &KernelArgs::Checksum {
                src: va,
                len: count * 4,
                dst: dst + 8,
            },
            grid_1d(count),
        )?;
        last = Some(ch.submit()?);
    }
    if let Some(f) = last {
        ch.wait(f)?;
    }
    let elapsed = start.elapsed();

    let mut want = Vec::new();
    for skip in 0..SKEW.min(cfg.iterations as u64) {
        let part = &data[skip as usize..];
        let bytes: Vec<u8> = part.iter().flat_map(|v| v.to_le_bytes()).collect();
        want.push((reference::reduce_sum(part), reference::checksum(&bytes)));
    }
    for i in 0..cfg.iterations as u64 {
        let (sum, sumck) = want[(i % SKEW) as usize];
        let got = res.read_f32_vec(i * SLOT, 1)?[0];
        let got_ck = res.read_u64(i * SLOT + 8)?;
        if got.to_bits() != sum.to_bits() || got_ck != sumck {
            return Err(Error::Mismatch {
                workload: "reduction",
                detail: format!(
                    "iteration {i}: GPU sum {got} checksum {got_ck:#x}, CPU {sum} {sumck:#x}"
                ),
            });
        }
    }
    Ok(WorkloadReport {
        name: "reduction",
        iterations: cfg.iterations as u64,
        elapsed,
        gpu_items: 2 * cfg.iterations as u64,
        verified: true,
    })
}
