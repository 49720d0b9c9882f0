//! Suite `guest` (`vgpu-guest-bench` in a VM, `vgpu-bench guest` on a host): the shared
//! workloads and submission round trips through one device, as an application in a VM
//! sees them — over `/dev/vgpu` in a guest, or natively on an
//! in-process sim (`--native`, the baseline to run on the host or in L1). Figures carry
//! the transport in their names (`saxpy_devvgpu`, `saxpy_native`), so the two runs'
//! figures put side by side give the VM-vs-native ratio.
//!
//! Round trips are timed with the guest's own clock (submit of an empty kernel until its
//! fence is seen): a VM's clock and the GPU's are not comparable, so the host-clock
//! publish→start latency of the `virt` suite does not exist here. The submission rate
//! (empty kernels published back to back, waited for once) needs no shared clock.

use std::time::{Duration, Instant};

use thiserror::Error;
use vgpu_guest::workloads::Workload;
use vgpu_guest::{Context, Device, KernelArgs};

use crate::measure::{min, submit_throughput};
use crate::report::{Better, Figure};
use crate::stats::percentile;

const SUITE: &str = "guest";

#[derive(Debug, Error)]
pub enum GuestSuiteError {
    #[error(transparent)]
    Native(#[from] crate::native::NativeError),
    #[error("runtime: {0}")]
    Runtime(#[from] vgpu_guest::Error),
}

#[derive(Debug, Clone)]
pub struct GuestOpts {
    /// `None`: an in-process sim GPU; `Some(path)`: the device node.
    pub device: Option<String>,
    pub reps: u32,
    pub small: bool,
    pub latency_samples: u32,
    /// Submissions in the submission-rate stream.
    pub throughput_submits: u32,
    /// Only the submission figures (round trips, rate): no workloads.
    pub submit_only: bool,
    /// With the in-process sim: its longest idle sleep between GP_PUT polls (µs), to
    /// match a backend started with the same `--sim-idle-sleep-us`.
    pub sim_idle_sleep_us: Option<u64>,
}

impl GuestOpts {
    pub fn full(device: Option<String>) -> Self {
        GuestOpts {
            device,
            reps: 5,
            small: false,
            latency_samples: 1000,
            throughput_submits: 20_000,
            submit_only: false,
            sim_idle_sleep_us: None,
        }
    }

    pub fn quick(device: Option<String>) -> Self {
        GuestOpts {
            device,
            reps: 1,
            small: true,
            latency_samples: 50,
            throughput_submits: 1000,
            submit_only: false,
            sim_idle_sleep_us: None,
        }
    }
}

/// The command-line options of the guest suite, shared by `vgpu-guest-bench` and
/// `vgpu-bench guest`.
#[derive(Debug, Clone, clap::Args)]
pub struct GuestArgs {
    /// The device node.
    #[arg(long, default_value = vgpu_guest::devvgpu::DEFAULT_PATH)]
    pub device: String,
    /// Use an in-process sim GPU instead of the device.
    #[arg(long)]
    pub native: bool,
    /// Timed runs of each workload (the best counts); default 1 with --quick, else 5.
    #[arg(long)]
    pub reps: Option<u32>,
    /// With --native: the sim's longest idle sleep between polls, µs (match the
    /// backend's --sim-idle-sleep-us for a fair comparison).
    #[arg(long)]
    pub sim_idle_sleep_us: Option<u64>,
    /// Only the submission figures (round trips and rate), no workloads.
    #[arg(long)]
    pub submit_only: bool,
    /// Round trips timed per figure (default 50 with --quick, else 1000).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub samples: Option<u32>,
}

impl GuestArgs {
    /// The suite's options: small sizes with `quick`, then what the arguments say.
    pub fn opts(&self, quick: bool) -> GuestOpts {
        let device = (!self.native).then(|| self.device.clone());
        let mut opts = if quick {
            GuestOpts::quick(device)
        } else {
            GuestOpts::full(device)
        };
        opts.reps = self.reps.unwrap_or(opts.reps);
        opts.sim_idle_sleep_us = self.sim_idle_sleep_us;
        opts.submit_only = self.submit_only;
        opts.latency_samples = self.samples.unwrap_or(opts.latency_samples);
        opts
    }
}

/// p50 and p99 (µs) of submit → fence seen for empty kernels, one at a time. With
/// `remote`, GP_PUT goes to the host in a request (the API-remoting baseline).
fn round_trip(ctx: &Context, samples: u32, remote: bool) -> Result<(f64, f64), GuestSuiteError> {
    let warmup = (samples / 10).max(5);
    let mut ch = ctx.create_channel()?;
    ch.set_api_remoting(remote);
    let mut v = Vec::with_capacity(samples as usize);
    for i in 0..samples + warmup {
        let t = Instant::now();
        ch.launch(&KernelArgs::Empty, [1, 1, 1])?;
        let f = ch.submit()?;
        ch.wait_timeout(f, Duration::from_secs(30))?;
        if i >= warmup {
            v.push(t.elapsed().as_nanos() as u64);
        }
    }
    let mut p = |q| percentile(&mut v, q).unwrap_or(0) as f64 / 1e3;
    let p50 = p(50.0);
    Ok((p50, p(99.0)))
}

pub fn run(opts: &GuestOpts) -> Result<Vec<Figure>, GuestSuiteError> {
    let dev = match &opts.device {
        Some(path) => Device::devvgpu(path)?,
        None => crate::native::device(opts.sim_idle_sleep_us)?,
    };
    let side = dev.info().transport;
    let ctx = dev.create_context()?;
    let fig = |name: &str, v: f64, unit: &str, b| Figure::new(SUITE, name, v, unit, b);
    let mut figs = Vec::new();
    let workloads: &[&str] = if opts.submit_only {
        &[]
    } else {
        &Workload::NAMES
    };
    for name in workloads {
        let Some(w) = Workload::by_name(name, opts.small) else {
            continue;
        };
        // The CPU reference once, every run checked against it.
        let mut expected = vgpu_guest::workloads::Expected::default();
        w.run_expecting(&ctx, &mut expected)?;
        let mut t = Vec::new();
        for _ in 0..opts.reps.max(1) {
            t.push(w.run_expecting(&ctx, &mut expected)?.elapsed.as_secs_f64());
        }
        figs.push(fig(
            &format!("{name}_{side}"),
            min(&t) * 1e3,
            "ms",
            Better::Lower,
        ));
    }
    let (p50, p99) = round_trip(&ctx, opts.latency_samples, false)?;
    figs.push(fig(
        &format!("round_trip_p50_{side}"),
        p50,
        "us",
        Better::Lower,
    ));
    figs.push(fig(
        &format!("round_trip_p99_{side}"),
        p99,
        "us",
        Better::Lower,
    ));
    let rate = submit_throughput(&ctx, opts.throughput_submits)?;
    figs.push(fig(
        &format!("submit_rate_{side}"),
        rate,
        "1/s",
        Better::Higher,
    ));
    if opts.device.is_some() {
        let (r50, r99) = round_trip(&ctx, opts.latency_samples, true)?;
        figs.push(fig("round_trip_p50_api_remoting", r50, "us", Better::Lower));
        figs.push(fig("round_trip_p99_api_remoting", r99, "us", Better::Lower));
        figs.push(fig(
            "api_remoting_vs_direct_p50",
            r50 / p50.max(1e-3),
            "ratio",
            Better::Higher,
        ));
    }
    Ok(figs)
}
