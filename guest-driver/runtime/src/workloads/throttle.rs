//! `throttle`: the seeds' load generator. It does nothing but keep the GPU busy with
//! spin kernels of a fixed length, with up to `depth` submissions in flight, so that a
//! competing workload feels a steady, greedy neighbour.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use vgpu_protocol::KernelArgs;

use super::WorkloadReport;
use crate::context::Context;
use crate::error::{Error, Result};

#[derive(Debug, Clone)]
pub struct ThrottleConfig {
    /// Length of each spin kernel.
    pub kernel_ns: u64,
    /// Kernels to run; `None` runs until `stop` is set.
    pub iterations: Option<u64>,
    /// Submissions kept in flight (at least 1).
    pub depth: usize,
    /// Set to end the run early (checked before each submission).
    pub stop: Option<Arc<AtomicBool>>,
}

impl Default for ThrottleConfig {
    fn default() -> Self {
        ThrottleConfig {
            kernel_ns: 100_000,
            iterations: Some(100),
            depth: 2,
            stop: None,
        }
    }
}

impl ThrottleConfig {
    /// A small run for tests.
    pub fn small() -> Self {
        ThrottleConfig {
            kernel_ns: 20_000,
            iterations: Some(32),
            ..Default::default()
        }
    }
}

pub fn run(ctx: &Context, cfg: &ThrottleConfig) -> Result<WorkloadReport> {
    if cfg.iterations.is_none() && cfg.stop.is_none() {
        return Err(Error::InvalidArgument(
            "throttle needs iterations or a stop flag",
        ));
    }
    let depth = cfg.depth.max(1);
    let mut ch = ctx.create_channel()?;
    let args = KernelArgs::Spin { ns: cfg.kernel_ns };
    let stopped = || cfg.stop.as_ref().is_some_and(|s| s.load(Ordering::Relaxed));
    let mut in_flight = VecDeque::with_capacity(depth);
    let mut done = 0u64;
    let start = Instant::now();
    while cfg.iterations.is_none_or(|n| done < n) && !stopped() {
        if in_flight.len() >= depth {
            if let Some(f) = in_flight.pop_front() {
                ch.wait(f)?;
            }
        }
        ch.launch(&args, [1, 1, 1])?;
        in_flight.push_back(ch.submit()?);
        done += 1;
    }
    for f in in_flight {
        ch.wait(f)?;
    }
    Ok(WorkloadReport {
        name: "throttle",
        iterations: done,
        elapsed: start.elapsed(),
        gpu_items: done,
        // Nothing to compare: every spin's fence signalled without a channel error.
        verified: true,
    })
}
