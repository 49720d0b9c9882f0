//! Suite `scale`: one backend serving many VMs (issue 15). `vms` loopback VMs, each with
//! `procs` guest processes of `channels` channels (64 × 4 × 4 = 1,024 channels in the full
//! run), most idle, a rotating set of `busy` VMs running 1 ms kernels under the `fair`
//! scheduler. Measured: the scheduler thread's CPU per tick and per second, the longest
//! tick, shadow switches per second, process RSS, fds and threads per VM and per channel,
//! and control-request round trips from an idle VM while the busy set runs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use thiserror::Error;
use vgpu_backend::{Policy, SchedConfig, VgpuBackend, VmLimits};
use vgpu_guest::{Channel, Context, Device, KernelArgs};
use vgpu_host_shim::{HalError, SimConfig, SimGpu};
use vgpu_loopback::{LoopbackConfig, LoopbackVm};

use crate::proc_stats::{open_fds, rss, thread_cpu_ns, threads};
use crate::report::{Better, Figure};

const SUITE: &str = "scale";

#[derive(Debug, Error)]
pub enum ScaleError {
    #[error("GPU: {0}")]
    Hal(#[from] HalError),
    #[error("backend: {0}")]
    Backend(String),
    #[error("loopback VM: {0}")]
    Loopback(String),
    #[error("runtime: {0}")]
    Runtime(#[from] vgpu_guest::Error),
}

#[derive(Debug, Clone)]
pub struct ScaleOpts {
    pub vms: u32,
    pub procs: u32,
    pub channels: u32,
    /// VMs busy at once (the set rotates every `rotate_ms`).
    pub busy: u32,
    pub rotate_ms: u64,
    /// Length of the measured window.
    pub secs: f64,
    /// Control round trips measured.
    pub requests: u32,
}

impl ScaleOpts {
    pub fn full() -> Self {
        ScaleOpts {
            vms: 64,
            procs: 4,
            channels: 4,
            busy: 4,
            rotate_ms: 1000,
            secs: 5.0,
            requests: 1000,
        }
    }

    pub fn quick() -> Self {
        ScaleOpts {
            vms: 8,
            procs: 2,
            channels: 2,
            busy: 2,
            rotate_ms: 300,
            secs: 1.0,
            requests: 100,
        }
    }
}

fn fig(name: &str, value: f64, unit: &str, better: Better) -> Figure {
    Figure::new(SUITE, name, value, unit, better)
}

/// The `p`th percentile of sorted samples (0 without samples).
fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

struct Tenant {
    _dev: Device,
    ctx: Context,
    channels: Vec<Channel>,
}

/// Keeps VM `i`'s first channel busy with 1 ms kernels (two in flight) while `on(i)`.
fn busy_loop(
    t: &mut Tenant,
    i: u32,
    on: &dyn Fn(u32) -> bool,
    stop: &AtomicBool,
) -> Result<(), ScaleError> {
    let ch = &mut t.channels[0];
    let mut inflight = std::collections::VecDeque::new();
    while !stop.load(Ordering::Relaxed) {
        if !on(i) {
            while let Some(f) = inflight.pop_front() {
                ch.wait(f)?;
            }
            std::thread::sleep(Duration::from_millis(5));
            continue;
        }
        ch.launch(&KernelArgs::Spin { ns: 1_000_000 }, [1, 1, 1])?;
        inflight.push_back(ch.submit()?);
        if inflight.len() >= 2 {
            if let Some(f) = inflight.pop_front() {
                ch.wait(f)?;
            }
        }
    }
    while let Some(f) = inflight.pop_front() {
        ch.wait(f)?;
    }
    Ok(())
}

pub fn run(opts: &ScaleOpts) -> Result<Vec<Figure>, ScaleError> {
    let total_channels = opts.vms * opts.procs * opts.channels;
    let sim = SimGpu::new(SimConfig {
        vram_bytes: 256 << 20,
        max_channels: total_channels + 64,
        max_contexts: opts.vms * opts.procs + 16,
        ..SimConfig::default()
    })?;
    let backend = VgpuBackend::new(
        sim,
        VmLimits {
            vram_bytes: 4 << 20,
            ..VmLimits::default()
        },
    );
    backend
        .start_scheduler(SchedConfig {
            policy: Policy::Fair,
            ..SchedConfig::default()
        })
        .map_err(|e| ScaleError::Backend(e.to_string()))?;
    let dir =
        vgpu_test_support::try_temp_dir("scale").map_err(|e| ScaleError::Backend(e.to_string()))?;
    let result = measure(opts, &backend, &dir);
    backend.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn measure(
    opts: &ScaleOpts,
    backend: &Arc<VgpuBackend>,
    dir: &std::path::Path,
) -> Result<Vec<Figure>, ScaleError> {
    let total_channels = opts.vms * opts.procs * opts.channels;
    let (rss0, fds0, thr0) = (rss(), open_fds(), threads());
    let mut vms: Vec<Arc<LoopbackVm>> = Vec::new();
    for i in 0..opts.vms {
        let name = format!("vm{i}");
        let sock = dir.join(format!("{name}.sock"));
        backend
            .serve_vm(&name, &sock)
            .map_err(|e| ScaleError::Backend(e.to_string()))?;
        let vm = vgpu_test_support::connect_retry(
            &sock,
            LoopbackConfig::with_mem(48 << 20),
            Duration::from_secs(10),
        )
        .map_err(|e| ScaleError::Loopback(e.to_string()))?;
        vms.push(vm);
    }
    let (rss1, fds1, thr1) = (rss(), open_fds(), threads());
    let mut tenants: Vec<Vec<Tenant>> = Vec::new();
    for (i, vm) in vms.iter().enumerate() {
        let mut procs = Vec::new();
        for p in 0..opts.procs {
            let dev = Device::loopback(vm.clone(), 1000 + p)?;
            let ctx = dev.create_context()?;
            let channels = (0..opts.channels)
                .map(|_| ctx.create_channel())
                .collect::<Result<Vec<_>, _>>()?;
            procs.push(Tenant {
                _dev: dev,
                ctx,
                channels,
            });
        }
        log::debug!("scale: VM {i} has its channels");
        tenants.push(procs);
    }
    let (rss2, fds2, thr2) = (rss(), open_fds(), threads());

    // The busy set: VMs whose index is in the current window of `busy` consecutive ones.
    let t0 = Instant::now();
    let (n, busy, rotate) = (opts.vms, opts.busy.min(opts.vms), opts.rotate_ms.max(1));
    let on = move |i: u32| {
        let window = (t0.elapsed().as_millis() as u64 / rotate) as u32;
        let first = (window * busy) % n;
        (i + n - first) % n < busy
    };
    let stop = Arc::new(AtomicBool::new(false));
    let mut idle_tenant = None;
    let mut workers = Vec::new();
    for (i, mut procs) in tenants.into_iter().enumerate() {
        if i + 1 == opts.vms as usize {
            idle_tenant = procs.pop();
        }
        let Some(mut first) = (!procs.is_empty()).then(|| procs.remove(0)) else {
            continue;
        };
        let stop = stop.clone();
        workers.push(std::thread::spawn(move || {
            let r = busy_loop(&mut first, i as u32, &on, &stop);
            drop(procs);
            r
        }));
    }
    std::thread::sleep(Duration::from_millis(500));
    let s0 = backend.sched_stats();
    let cpu0 = thread_cpu_ns("vgpu-sched");
    let w0 = Instant::now();
    // Control requests from an idle process of the last VM meanwhile.
    let mut rtt = Vec::new();
    if let Some(t) = &idle_tenant {
        let gap = Duration::from_secs_f64(opts.secs / f64::from(opts.requests.max(1)) * 0.9);
        for _ in 0..opts.requests {
            let a = Instant::now();
            let b = t.ctx.alloc_vram(4096)?;
            drop(b);
            // Four requests: ALLOC_VRAM and MAP_VRAM, then UNMAP and FREE_MEM.
            rtt.push(a.elapsed().as_secs_f64() * 1e6 / 4.0);
            std::thread::sleep(gap);
        }
    }
    let rest = Duration::from_secs_f64(opts.secs).saturating_sub(w0.elapsed());
    std::thread::sleep(rest);
    let wall = w0.elapsed().as_secs_f64();
    let cpu = thread_cpu_ns("vgpu-sched") - cpu0;
    let s1 = backend.sched_stats();
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        match w.join() {
            Ok(r) => r?,
            Err(_) => return Err(ScaleError::Backend("a tenant thread panicked".into())),
        }
    }
    drop(idle_tenant);
    let ticks = (s1.intervals - s0.intervals).max(1) as f64;
    let switches = (s1.shadows - s0.shadows + s1.unshadows - s0.unshadows) as f64;
    rtt.sort_by(f64::total_cmp);
    let per = |a: u64, b: u64, n: u32| (b.saturating_sub(a)) as f64 / f64::from(n.max(1));
    let mib = |b: f64| b / 1048576.0;
    let figs = vec![
        fig("vms", f64::from(opts.vms), "VMs", Better::Higher),
        fig(
            "channels",
            f64::from(total_channels),
            "channels",
            Better::Higher,
        ),
        fig("busy_vms", f64::from(busy), "VMs", Better::Higher),
        fig(
            "sched_cpu",
            cpu as f64 / (wall * 1e9) * 100.0,
            "% of a core",
            Better::Lower,
        )
        .target(1.0),
        fig(
            "sched_cpu_per_tick",
            cpu as f64 / ticks / 1e3,
            "us",
            Better::Lower,
        ),
        fig("sched_ticks_per_s", ticks / wall, "1/s", Better::Higher),
        fig(
            "sched_tick_max",
            s1.tick_ns_max as f64 / 1e3,
            "us",
            Better::Lower,
        ),
        fig(
            "shadow_switches_per_s",
            switches / wall,
            "1/s",
            Better::Higher,
        ),
        fig(
            "sched_channels_observed_last_tick",
            f64::from(s1.observed_channels),
            "channels",
            Better::Lower,
        ),
        fig(
            "sched_channels_quiet_last_tick",
            f64::from(s1.quiet_channels),
            "channels",
            Better::Higher,
        ),
        fig(
            "sched_busy_skips",
            (s1.busy_skips - s0.busy_skips) as f64,
            "intervals",
            Better::Lower,
        ),
        fig(
            "rss_per_vm",
            mib(per(rss0, rss1, opts.vms)),
            "MiB",
            Better::Lower,
        ),
        fig(
            "rss_per_channel",
            per(rss1, rss2, total_channels) / 1024.0,
            "KiB",
            Better::Lower,
        ),
        fig(
            "fds_per_vm",
            per(fds0, fds1, opts.vms),
            "fds",
            Better::Lower,
        ),
        fig(
            "fds_per_channel",
            per(fds1, fds2, total_channels),
            "fds",
            Better::Lower,
        ),
        fig(
            "threads_per_vm",
            per(thr0, thr1, opts.vms),
            "threads",
            Better::Lower,
        ),
        fig(
            "threads_per_channel",
            per(thr1, thr2, total_channels),
            "threads",
            Better::Lower,
        ),
        fig("control_request_p50", pct(&rtt, 50.0), "us", Better::Lower),
        fig("control_request_p99", pct(&rtt, 99.0), "us", Better::Lower),
    ];
    for vm in &vms {
        vm.disconnect();
    }
    Ok(figs)
}
