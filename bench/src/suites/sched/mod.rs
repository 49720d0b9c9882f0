//! Suite `sched`: the GPU scheduler over the real path (vgpu-backend serving loopback VMs
//! over vhost-user; guest processes submit by plain stores to their channel pages), with
//! the scenarios of Fleig's §5.4 and the weight, overhead and reaction figures,
//! each measured side by side in one run.
//!
//! Shares come from the GPU's busy counters (the backend's per-process books), not from
//! wall time, so they do not depend on how busy the shared host is. The Fleig runtimes
//! are reported twice: in wall time, and in GPU time — the runtime the workload would
//! have on a GPU kept fully busy (wall runtime × the GPU's utilization meanwhile), which
//! factors out the time the GPU idled because guest threads waited for a host core (on
//! the 2-core development machine shared with other jobs, they do). The targets hold the
//! GPU-time figures.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use thiserror::Error;
use vgpu_backend::{Policy, SchedConfig, SchedError, VgpuBackend, VramConfig};
use vgpu_guest::Device;
use vgpu_protocol::SemaphoreMode;

use crate::report::{Better, Figure};
use crate::sched_rig::{RigError, SchedRig, Tenant, TenantSpec};
use crate::stats::percentile;
use crate::suites::measure::median;
use crate::svg::{Plot, Series};

mod fleig;
mod hostile;
mod overhead;
mod shares;

use fleig::*;
use hostile::*;
use overhead::*;
use shares::*;

const SUITE: &str = "sched";
const US: u64 = 1_000;
const MS: u64 = 1_000_000;

#[derive(Debug, Error)]
pub enum SchedSuiteError {
    #[error("{0}")]
    Rig(#[from] RigError),
    #[error("scheduler: {0}")]
    Sched(#[from] SchedError),
    #[error("shadow: {0}")]
    Shadow(#[from] vgpu_backend::ShadowError),
    #[error("plots: {0}")]
    Io(#[from] std::io::Error),
    #[error("guest runtime: {0}")]
    Runtime(#[from] vgpu_guest::Error),
    #[error("{0}")]
    Other(String),
}

type Result<T> = std::result::Result<T, SchedSuiteError>;

#[derive(Debug, Clone)]
pub struct SchedOpts {
    /// Throttle kernel lengths of the Fleig sweep, ns.
    pub steps: Vec<u64>,
    /// The Fleig workload: this many spin kernels of `workload_kernel_ns`.
    pub workload_kernels: u64,
    pub workload_kernel_ns: u64,
    /// Settling time after a change, and the measurement window of share figures.
    pub warmup: Duration,
    pub window: Duration,
    /// Numbers of throttles in VM B (fair), and the ones also run under none.
    pub b_counts: Vec<usize>,
    pub b_counts_none: Vec<usize>,
    pub overhead_reps: u32,
    pub switch_samples: u32,
    /// Runs per `fair` point of the Fleig sweep (the median is reported).
    pub fleig_reps: u32,
    /// Where to write the SVG plots (none: no plots).
    pub plots: Option<PathBuf>,
    /// Only these scenarios (see [`SCENARIOS`]; empty: all).
    pub only: Vec<String>,
}

/// The suite's scenarios, in the order they run (names for `--only`).
pub const SCENARIOS: [&str; 10] = [
    "fleig",
    "throttles",
    "weights",
    "two_levels",
    "overhead",
    "policies",
    "hostile",
    "burst",
    "mixed",
    "evict_wait",
];

impl SchedOpts {
    pub fn full() -> Self {
        // 100 µs → 10 ms in 9 geometric steps.
        let steps = (0..9)
            .map(|i| (100_000.0 * 100f64.powf(f64::from(i) / 8.0)).round() as u64)
            .collect();
        SchedOpts {
            steps,
            workload_kernels: 500,
            workload_kernel_ns: MS,
            warmup: Duration::from_millis(300),
            window: Duration::from_millis(1500),
            b_counts: (1..=8).collect(),
            b_counts_none: vec![1, 4, 8],
            overhead_reps: 9,
            switch_samples: 500,
            fleig_reps: 3,
            plots: None,
            only: Vec::new(),
        }
    }

    pub fn quick() -> Self {
        SchedOpts {
            steps: vec![100 * US, MS, 10 * MS],
            workload_kernels: 60,
            workload_kernel_ns: MS,
            warmup: Duration::from_millis(150),
            window: Duration::from_millis(400),
            b_counts: vec![1, 4],
            b_counts_none: vec![1],
            overhead_reps: 1,
            switch_samples: 50,
            fleig_reps: 1,
            plots: None,
            only: Vec::new(),
        }
    }
}

fn fig(name: &str, value: f64, unit: &str, better: Better) -> Figure {
    Figure::new(SUITE, name, value, unit, better)
}

/// A deviation figure: |value − ideal| in percentage points (or %), at most `target`.
fn dev(name: &str, dev: f64, unit: &str, target: f64) -> Figure {
    fig(name, dev.abs(), unit, Better::Lower).target(target)
}

fn start(be: &std::sync::Arc<VgpuBackend>, policy: Policy) -> Result<()> {
    be.start_scheduler(SchedConfig {
        policy,
        ..SchedConfig::default()
    })?;
    Ok(())
}

fn share(a: u64, total: u64) -> f64 {
    if total == 0 {
        0.0
    } else {
        a as f64 / total as f64
    }
}

/// Busy time of each (VM, PID) over `window`.
fn busy_over(rig: &SchedRig, who: &[(&str, u32)], window: Duration) -> Vec<u64> {
    let before: Vec<u64> = who.iter().map(|(v, p)| rig.proc_busy(v, *p)).collect();
    std::thread::sleep(window);
    who.iter()
        .zip(before)
        .map(|((v, p), b)| rig.proc_busy(v, *p).saturating_sub(b))
        .collect()
}

fn stop_all(tenants: Vec<Tenant>) -> Result<()> {
    for t in tenants {
        t.stop()?;
    }
    Ok(())
}

pub fn run(opts: &SchedOpts) -> Result<Vec<Figure>> {
    let mut figs = Vec::new();
    let mut plots = Vec::new();
    if let Some(bad) = opts.only.iter().find(|o| !SCENARIOS.contains(&o.as_str())) {
        return Err(SchedSuiteError::Other(format!(
            "no scenario {bad:?} (one of {})",
            SCENARIOS.join(", ")
        )));
    }
    let on = |name: &str| opts.only.is_empty() || opts.only.iter().any(|o| o == name);
    if on("fleig") {
        fleig_sweep(opts, &mut figs, &mut plots)?;
    }
    if on("throttles") {
        vm_against_throttles(opts, &mut figs, &mut plots)?;
    }
    if on("weights") {
        weights_1_2_4(opts, &mut figs)?;
    }
    if on("two_levels") {
        two_levels(opts, &mut figs, &mut plots)?;
    }
    if on("overhead") {
        overhead(opts, &mut figs)?;
    }
    if on("policies") {
        other_policies(opts, &mut figs)?;
    }
    if on("hostile") {
        churn_and_many_channels(opts, &mut figs)?;
    }
    if on("burst") {
        idle_then_burst(&mut figs)?;
    }
    if on("mixed") {
        mixed_tenants(opts, &mut figs)?;
    }
    if on("evict_wait") {
        tick_while_eviction_waits(opts, &mut figs)?;
    }
    if let Some(dir) = &opts.plots {
        std::fs::create_dir_all(dir)?;
        for (file, plot) in plots {
            std::fs::write(dir.join(file), plot.render())?;
        }
    }
    Ok(figs)
}
