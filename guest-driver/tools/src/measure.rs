//! Measurements shared by the suites.

use std::time::{Duration, Instant};

use vgpu_guest::{Context, KernelArgs};

use crate::stats::percentile;

/// How a submission reaches the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Publish {
    /// The guest stores GP_PUT (the direct path).
    Store,
    /// The host stores it on request (the API-remoting baseline).
    Remote,
}

/// p50 and p99, in µs, of GP_PUT publish → kernel start: `samples` `TIMESTAMP` kernels,
/// each submitted after the previous completed. The runtime reads the host clock right
/// before publishing; the kernel writes the GPU clock (the same CLOCK_MONOTONIC) at start.
/// Below zero where the GPU clock's mapping puts the start early.
pub fn submit_latency(
    ctx: &Context,
    samples: u32,
    publish: Publish,
) -> Result<(f64, f64), vgpu_guest::Error> {
    const WARMUP: u32 = 100;
    let mut ch = ctx.create_channel()?;
    ch.set_api_remoting(publish == Publish::Remote);
    ch.set_stamp_publish(true);
    let ts = ctx.alloc_host(4096)?;
    let mut v = Vec::with_capacity(samples as usize);
    for i in 0..samples + WARMUP {
        ch.launch(&KernelArgs::Timestamp { dst: ts.gpu_va() }, [1, 1, 1])?;
        let fence = ch.submit()?;
        let t = ch.last_publish_ns();
        ch.wait_timeout(fence, Duration::from_secs(10))?;
        if i >= WARMUP {
            // Signed: the GPU's clock is mapped onto the host's with an error of a few
            // µs, which may put a start before its publish; a difference of two such
            // figures on one mapping is still exact (clamped at zero it was not).
            v.push(ts.read_u64(0)?.wrapping_sub(t) as i64);
        }
    }
    let p50 = percentile(&mut v, 50.0).unwrap_or(0) as f64 / 1e3;
    let p99 = percentile(&mut v, 99.0).unwrap_or(0) as f64 / 1e3;
    Ok((p50, p99))
}

/// Submissions per second of a stream of `n` empty-kernel submissions, each a GP entry of
/// its own, published back to back (the ring keeps up to its size in flight) and waited
/// for once at the end: the rate at which the path takes work, not the GPU's.
pub fn submit_throughput(ctx: &Context, n: u32) -> Result<f64, vgpu_guest::Error> {
    let mut ch = ctx.create_channel()?;
    // Warm-up: first touch of the ring and arenas.
    for _ in 0..16 {
        ch.launch(&KernelArgs::Empty, [1, 1, 1])?;
        ch.submit()?;
    }
    ch.finish()?;
    let t0 = Instant::now();
    let mut last = None;
    for _ in 0..n {
        ch.launch(&KernelArgs::Empty, [1, 1, 1])?;
        last = Some(ch.submit()?);
    }
    if let Some(f) = last {
        ch.wait_timeout(f, Duration::from_secs(60))?;
    }
    Ok(f64::from(n) / t0.elapsed().as_secs_f64().max(1e-9))
}

/// The median of `v` (0 when empty).
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// The smallest value of `v` (infinity when empty).
pub fn min(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

/// The largest value of `v`, of values ≥ 0 (0 when empty).
pub fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(0.0, f64::max)
}
