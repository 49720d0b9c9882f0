//! `copy_heavy`: copy-engine traffic host → VRAM → VRAM → host in chunks, with a
//! Checksum kernel over the VRAM copy each iteration. Iterations alternate between two
//! source buffers so every iteration's copies are observable.

use std::time::Instant;

use vgpu_protocol::reference;
use vgpu_protocol::KernelArgs;

use super::{grid_1d, host_len, WorkloadReport, XorShift};
use crate::buffer::Buffer;
use crate::channel::Channel;
use crate::context::Context;
use crate::error::{Error, Result};

#[derive(Debug, Clone)]
pub struct CopyHeavyConfig {
    /// Bytes moved per leg (the size knob).
    pub bytes: u64,
    /// Largest single COPY method.
    pub chunk_bytes: u64,
    pub iterations: u32,
    pub seed: u64,
}

impl Default for CopyHeavyConfig {
    fn default() -> Self {
        CopyHeavyConfig {
            bytes: 16 << 20,
            chunk_bytes: 1 << 20,
            iterations: 10,
            seed: 5,
        }
    }
}

impl CopyHeavyConfig {
    pub fn small() -> Self {
        CopyHeavyConfig {
            bytes: (200 << 10) + 12,
            chunk_bytes: 64 << 10,
            iterations: 4,
            ..Default::default()
        }
    }
}

/// Records `len` bytes of copies from `src` to `dst` in chunks; returns methods recorded.
fn copy_chunks(ch: &mut Channel, dst: &Buffer, src: &Buffer, len: u64, chunk: u64) -> Result<u64> {
    let mut off = 0;
    let mut n = 0;
    while off < len {
        let this = chunk.min(len - off);
        ch.copy(dst.gpu_va() + off, src.gpu_va() + off, this)?;
        off += this;
        n += 1;
    }
    Ok(n)
}

pub fn run(ctx: &Context, cfg: &CopyHeavyConfig) -> Result<WorkloadReport> {
    if cfg.bytes == 0 || cfg.chunk_bytes == 0 {
        return Err(Error::InvalidArgument("copy sizes must be non-zero"));
    }
    let len = cfg.bytes;
    let mut rng = XorShift::new(cfg.seed);
    let data = [rng.bytes(host_len(len)?), rng.bytes(host_len(len)?)];
    let srcs = [ctx.alloc_host(len)?, ctx.alloc_host(len)?];
    for (b, d) in srcs.iter().zip(&data) {
        b.write(0, d)?;
    }
    let va = ctx.alloc_vram(len)?;
    let vb = ctx.alloc_vram(len)?;
    let dst = ctx.alloc_host(len)?;
    let res = ctx.alloc_host(8 * cfg.iterations.max(1) as u64)?;

    let mut ch = ctx.create_channel()?;
    let mut items = 0u64;
    let start = Instant::now();
    let mut last = None;
    for i in 0..cfg.iterations as u64 {
        let src = &srcs[(i % 2) as usize];
        items += copy_chunks(&mut ch, &va, src, len, cfg.chunk_bytes)?;
        items += copy_chunks(&mut ch, &vb, &va, len, cfg.chunk_bytes)?;
        items += copy_chunks(&mut ch, &dst, &vb, len, cfg.chunk_bytes)?;
        ch.launch(
            &KernelArgs::Checksum {
                src: vb.gpu_va(),
                len,
                dst: res.gpu_va() + i * 8,
            },
            grid_1d(len),
        )?;
        items += 1;
        last = Some(ch.submit()?);
    }
    if let Some(f) = last {
        ch.wait(f)?;
    }
    let elapsed = start.elapsed();

    let want = [reference::checksum(&data[0]), reference::checksum(&data[1])];
    for i in 0..cfg.iterations as u64 {
        let got = res.read_u64(i * 8)?;
        if got != want[(i % 2) as usize] {
            return Err(Error::Mismatch {
                workload: "copy_heavy",
                detail: format!(
                    "iteration {i}: GPU checksum {got:#x}, CPU {:#x}",
                    want[(i % 2) as usize]
                ),
            });
        }
    }
    if let Some(lastsrc) = (cfg.iterations as u64)
        .checked_sub(1)
        .map(|i| &data[(i % 2) as usize])
    {
        let mut back = vec![0u8; lastsrc.len()];
        dst.read(0, &mut back)?;
        if back != *lastsrc {
            return Err(Error::Mismatch {
                workload: "copy_heavy",
                detail: "host destination differs from the last source".into(),
            });
        }
    }
    Ok(WorkloadReport {
        name: "copy_heavy",
        iterations: cfg.iterations as u64,
        elapsed,
        gpu_items: items,
        verified: true,
    })
}
