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

/// Runs the Fleig workload (process 1 of VM `a`) to completion; its runtime.
fn run_workload(rig: &SchedRig, opts: &SchedOpts) -> Result<Duration> {
    let w = Tenant::spawn(
        rig.vm("a")?,
        TenantSpec::fixed(1, opts.workload_kernel_ns, opts.workload_kernels),
    )?;
    Ok(w.join()?.elapsed)
}

/// One Fleig point: the workload's wall runtime beside a throttle of `k` ns kernels and
/// its share of the GPU time used meanwhile.
fn beside_throttle(rig: &SchedRig, opts: &SchedOpts, k: u64) -> Result<(f64, f64)> {
    let throttle = Tenant::spawn(rig.vm("a")?, TenantSpec::throttle(2, k))?;
    std::thread::sleep(opts.warmup / 2);
    let (w0, t0) = (rig.proc_busy("a", 1), rig.proc_busy("a", 2));
    let rt = run_workload(rig, opts)?;
    let (w, t) = (
        rig.proc_busy("a", 1).saturating_sub(w0),
        rig.proc_busy("a", 2).saturating_sub(t0),
    );
    throttle.stop()?;
    Ok((rt.as_secs_f64(), share(w, w + t)))
}

/// Fleig §5.4.1/§5.4.2.1: the workload beside `throttle` (another process of the same
/// VM) whose kernels grow from 100 µs to 10 ms, under `none` and `fair`. Under `fair`
/// each point is the median of `fleig_reps` runs, each compared with a run of the
/// workload alone right before it (so both see the same host load).
fn fleig_sweep(
    opts: &SchedOpts,
    figs: &mut Vec<Figure>,
    plots: &mut Vec<(&'static str, Plot)>,
) -> Result<()> {
    let rig = SchedRig::new("fleig", &["a"], false)?;
    let be = rig.backend();
    start(be, Policy::Fair)?;
    // Warm-up: first runs pay for page faults and thread start-up.
    run_workload(&rig, opts)?;
    let mut series = Vec::new();
    let mut max_dev: f64 = 0.0;
    let mut none_runtimes = Vec::new();
    let mut alones = Vec::new();
    // The workload's GPU work, s.
    let work = (opts.workload_kernels * opts.workload_kernel_ns) as f64 / 1e9;
    for policy in [Policy::None, Policy::Fair] {
        let (mut pts, mut gpu_pts) = (Vec::new(), Vec::new());
        for &k in &opts.steps {
            let tag = format!("fleig_{policy}_k{}us", k / US);
            start(be, policy)?;
            if policy == Policy::None {
                let (rt, sh) = beside_throttle(&rig, opts, k)?;
                none_runtimes.push(rt);
                figs.push(fig(
                    &format!("{tag}_runtime"),
                    rt * 1e3,
                    "ms",
                    Better::Lower,
                ));
                figs.push(fig(
                    &format!("{tag}_workload_share"),
                    sh * 100.0,
                    "%",
                    Better::Higher,
                ));
                pts.push((k as f64 / 1e6, rt));
                gpu_pts.push((k as f64 / 1e6, work / sh.max(1e-9)));
                continue;
            }
            let (mut rts, mut shares, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..opts.fleig_reps.max(1) {
                let alone = run_workload(&rig, opts)?.as_secs_f64();
                alones.push(alone);
                let (rt, sh) = beside_throttle(&rig, opts, k)?;
                rts.push(rt);
                shares.push(sh);
                // Wall time: a 50 % share should take twice the runtime alone.
                ratios.push(rt / (2.0 * alone));
            }
            let (rt, sh, ratio) = (median(&mut rts), median(&mut shares), median(&mut ratios));
            // GPU time: the workload's work W got share `sh` of the GPU time used while
            // it ran, so on a fully busy GPU it takes W / sh; at a 50 % share, 2 W.
            let gpu_ratio = 0.5 / sh.max(1e-9);
            figs.push(fig(
                &format!("{tag}_runtime"),
                rt * 1e3,
                "ms",
                Better::Lower,
            ));
            figs.push(fig(
                &format!("{tag}_workload_share"),
                sh * 100.0,
                "%",
                Better::Higher,
            ));
            figs.push(fig(
                &format!("{tag}_wall_vs_half_share"),
                ratio,
                "ratio",
                Better::Lower,
            ));
            figs.push(fig(
                &format!("{tag}_gpu_runtime_vs_half_share"),
                gpu_ratio,
                "ratio",
                Better::Lower,
            ));
            let d = (gpu_ratio - 1.0) * 100.0;
            max_dev = max_dev.max(d.abs());
            figs.push(dev(&format!("{tag}_dev"), d, "%", 5.0));
            pts.push((k as f64 / 1e6, rt));
            gpu_pts.push((k as f64 / 1e6, work / sh.max(1e-9)));
        }
        series.push(Series {
            name: format!("{policy}, wall"),
            points: pts,
            dashed: false,
        });
        series.push(Series {
            name: format!("{policy}, GPU time"),
            points: gpu_pts,
            dashed: false,
        });
    }
    let alone = median(&mut alones);
    figs.push(fig(
        "fleig_workload_alone_runtime",
        alone * 1e3,
        "ms",
        Better::Lower,
    ));
    figs.push(dev("fleig_fair_max_dev", max_dev, "%", 5.0));
    if let (Some(first), Some(last)) = (none_runtimes.first(), none_runtimes.last()) {
        figs.push(
            fig(
                "fleig_none_slowdown_longest_vs_shortest",
                last / first,
                "ratio",
                Better::Higher,
            )
            .target(2.0),
        );
    }
    let (x0, x1) = (
        opts.steps.first().copied().unwrap_or(0) as f64 / 1e6,
        opts.steps.last().copied().unwrap_or(0) as f64 / 1e6,
    );
    series.push(Series {
        name: "50% share (2 W)".into(),
        points: vec![(x0, 2.0 * work), (x1, 2.0 * work)],
        dashed: true,
    });
    plots.push((
        "sched_fleig_runtime.svg",
        Plot {
            title: format!(
                "Workload ({} x {} ms kernels) beside throttle in its VM",
                opts.workload_kernels,
                opts.workload_kernel_ns as f64 / 1e6
            ),
            x_label: "throttle kernel length (ms)".into(),
            y_label: "workload runtime (s)".into(),
            log_x: true,
            y_min_top: 0.0,
            series,
        },
    ));
    Ok(())
}

/// Fleig §5.4.2.2: a workload in VM A against 1..8 throttles in VM B.
fn vm_against_throttles(
    opts: &SchedOpts,
    figs: &mut Vec<Figure>,
    plots: &mut Vec<(&'static str, Plot)>,
) -> Result<()> {
    let rig = SchedRig::new("vms", &["a", "b"], false)?;
    let be = rig.backend();
    let mut series = Vec::new();
    let mut max_dev: f64 = 0.0;
    for (policy, counts) in [
        (Policy::None, &opts.b_counts_none),
        (Policy::Fair, &opts.b_counts),
    ] {
        let mut pts = Vec::new();
        for &n in counts {
            start(be, policy)?;
            let mut tenants = vec![Tenant::spawn(rig.vm("a")?, TenantSpec::throttle(1, MS))?];
            for i in 0..n {
                tenants.push(Tenant::spawn(
                    rig.vm("b")?,
                    TenantSpec::throttle(11 + i as u32, 2 * MS),
                )?);
            }
            std::thread::sleep(opts.warmup * 2);
            let (a0, b0) = (rig.vm_busy("a"), rig.vm_busy("b"));
            std::thread::sleep(opts.window);
            let (a, b) = (
                rig.vm_busy("a").saturating_sub(a0),
                rig.vm_busy("b").saturating_sub(b0),
            );
            stop_all(tenants)?;
            let s = share(a, a + b) * 100.0;
            figs.push(fig(
                &format!("vm_a_share_{policy}_b{n}"),
                s,
                "%",
                Better::Higher,
            ));
            if policy == Policy::Fair {
                max_dev = max_dev.max((s - 50.0).abs());
                figs.push(dev(&format!("vm_a_dev_fair_b{n}"), s - 50.0, "pp", 3.0));
            }
            pts.push((n as f64, s));
        }
        series.push(Series {
            name: policy.to_string(),
            points: pts,
            dashed: false,
        });
    }
    figs.push(dev("vm_a_max_dev_fair", max_dev, "pp", 3.0));
    let nmax = opts.b_counts.iter().copied().max().unwrap_or(1) as f64;
    series.push(Series {
        name: "50%".into(),
        points: vec![(1.0, 50.0), (nmax, 50.0)],
        dashed: true,
    });
    plots.push((
        "sched_vm_vs_throttles.svg",
        Plot {
            title: "VM A (1 process) against n throttles in VM B".into(),
            x_label: "throttles in VM B".into(),
            y_label: "VM A's share of GPU time (%)".into(),
            log_x: false,
            y_min_top: 60.0,
            series,
        },
    ));
    Ok(())
}

/// Weights 1:2:4 across three saturating VMs (the lightest VM has the longest kernels,
/// so the GPU's own arbitration would favour it).
fn weights_1_2_4(opts: &SchedOpts, figs: &mut Vec<Figure>) -> Result<()> {
    let rig = SchedRig::new("w124", &["a", "b", "c"], false)?;
    let be = rig.backend();
    for (vm, w) in [("a", 100), ("b", 200), ("c", 400)] {
        be.set_vm_weight(vm, w)?;
    }
    start(be, Policy::Fair)?;
    let tenants = vec![
        Tenant::spawn(rig.vm("a")?, TenantSpec::throttle(1, 2 * MS))?,
        Tenant::spawn(rig.vm("b")?, TenantSpec::throttle(2, MS))?,
        Tenant::spawn(rig.vm("c")?, TenantSpec::throttle(3, 500 * US))?,
    ];
    std::thread::sleep(opts.warmup);
    let busy = busy_over(&rig, &[("a", 1), ("b", 2), ("c", 3)], opts.window * 2);
    stop_all(tenants)?;
    let total: u64 = busy.iter().sum();
    let mut max_dev: f64 = 0.0;
    for ((vm, ideal), b) in [("a", 1.0 / 7.0), ("b", 2.0 / 7.0), ("c", 4.0 / 7.0)]
        .iter()
        .zip(&busy)
    {
        let s = share(*b, total) * 100.0;
        figs.push(fig(
            &format!("weights_124_{vm}_share"),
            s,
            "%",
            Better::Higher,
        ));
        let d = s - ideal * 100.0;
        max_dev = max_dev.max(d.abs());
        figs.push(dev(&format!("weights_124_{vm}_dev"), d, "pp", 2.0));
    }
    figs.push(dev("weights_124_max_dev", max_dev, "pp", 2.0));
    Ok(())
}

/// Two levels: VMs 1:1, VM B with three processes; then one of them idles; then the
/// operator changes the weights to 1:3 (how many intervals until it shows).
fn two_levels(
    opts: &SchedOpts,
    figs: &mut Vec<Figure>,
    plots: &mut Vec<(&'static str, Plot)>,
) -> Result<()> {
    let rig = SchedRig::new("levels", &["a", "b"], false)?;
    let be = rig.backend();
    start(be, Policy::Fair)?;
    let interval_ns = u64::from(SchedConfig::default().interval_ms) * MS;
    let seq0 = be.sched_history(0).last().map_or(0, |r| r.seq + 1);
    let t_start = Instant::now();
    let procs: [(&str, u32); 4] = [("a", 1), ("b", 21), ("b", 22), ("b", 23)];
    let mut tenants = vec![
        Tenant::spawn(rig.vm("a")?, TenantSpec::throttle(1, MS))?,
        Tenant::spawn(rig.vm("b")?, TenantSpec::throttle(21, 500 * US))?,
        Tenant::spawn(rig.vm("b")?, TenantSpec::throttle(22, MS))?,
    ];
    let idler = Tenant::spawn(rig.vm("b")?, TenantSpec::throttle(23, 2 * MS))?;
    std::thread::sleep(opts.warmup);
    let busy = busy_over(&rig, &procs, opts.window);
    let total: u64 = busy.iter().sum();
    let ideal = [1.0 / 2.0, 1.0 / 6.0, 1.0 / 6.0, 1.0 / 6.0];
    let mut max_dev: f64 = 0.0;
    for (((vm, pid), b), i) in procs.iter().zip(&busy).zip(ideal) {
        let s = share(*b, total) * 100.0;
        figs.push(fig(
            &format!("two_level_{vm}{pid}_share"),
            s,
            "%",
            Better::Higher,
        ));
        max_dev = max_dev.max((s - i * 100.0).abs());
    }
    figs.push(dev("two_level_max_dev", max_dev, "pp", 2.0));

    // One of B's processes idles: its siblings get its share, A keeps half.
    let t_idle = t_start.elapsed().as_secs_f64();
    idler.stop()?;
    std::thread::sleep(opts.warmup);
    let busy = busy_over(&rig, &procs[..3], opts.window);
    let total: u64 = busy.iter().sum();
    let mut max_dev: f64 = 0.0;
    for (((vm, pid), b), i) in procs.iter().zip(&busy).zip([0.5, 0.25, 0.25]) {
        let s = share(*b, total) * 100.0;
        figs.push(fig(
            &format!("two_level_idle_{vm}{pid}_share"),
            s,
            "%",
            Better::Higher,
        ));
        max_dev = max_dev.max((s - i * 100.0).abs());
    }
    figs.push(dev("two_level_idle_max_dev", max_dev, "pp", 2.0));

    // The operator changes the weights: A 1, B 3.
    let t_weights = t_start.elapsed().as_secs_f64();
    let seq_change = be.sched_history(0).last().map_or(0, |r| r.seq + 1);
    be.set_vm_weight("b", 300)?;
    std::thread::sleep(opts.warmup);
    let busy = busy_over(&rig, &procs[..3], opts.window);
    stop_all(std::mem::take(&mut tenants))?;
    let total: u64 = busy.iter().sum();
    let mut max_dev: f64 = 0.0;
    for (((vm, pid), b), i) in procs.iter().zip(&busy).zip([0.25, 0.375, 0.375]) {
        let s = share(*b, total) * 100.0;
        figs.push(fig(
            &format!("weight_change_{vm}{pid}_share"),
            s,
            "%",
            Better::Higher,
        ));
        max_dev = max_dev.max((s - i * 100.0).abs());
    }
    figs.push(dev("weight_change_max_dev", max_dev, "pp", 2.0));
    // Intervals until VM A's share over a 10-interval window is within 5 pp of 25 %.
    let hist = be.sched_history(seq_change);
    const WIN: usize = 10;
    let a_busy: Vec<(u64, u64)> = hist
        .iter()
        .map(|r| {
            let a = r
                .vms
                .iter()
                .filter(|v| v.name == "a")
                .map(|v| v.busy_ns)
                .sum();
            let all = r.vms.iter().map(|v| v.busy_ns).sum();
            (a, all)
        })
        .collect();
    let took = (0..a_busy.len().saturating_sub(WIN))
        .find(|&i| {
            let (a, all) = a_busy[i..i + WIN]
                .iter()
                .fold((0, 0), |(x, y), (a, b)| (x + a, y + b));
            (share(a, all) - 0.25).abs() <= 0.05
        })
        .unwrap_or(a_busy.len());
    figs.push(
        fig(
            "weight_change_effect_intervals",
            took as f64,
            "intervals",
            Better::Lower,
        )
        .target(10.0),
    );
    figs.push(fig(
        "weight_change_effect_ms",
        (took as u64 * interval_ns) as f64 / 1e6,
        "ms",
        Better::Lower,
    ));

    // Shares over time, in 100 ms buckets.
    let hist = be.sched_history(seq0);
    let t0_ns = hist.first().map_or(0, |r| r.end_ns);
    let bucket = 100 * MS;
    let mut series: Vec<Series> = procs
        .iter()
        .map(|(vm, pid)| Series {
            name: format!("VM {vm} / PID {pid}"),
            points: Vec::new(),
            dashed: false,
        })
        .collect();
    let mut i = 0;
    while i < hist.len() {
        let b = (hist[i].end_ns - t0_ns) / bucket;
        let mut sums = [0u64; 4];
        let mut total = 0u64;
        while i < hist.len() && (hist[i].end_ns - t0_ns) / bucket == b {
            for v in &hist[i].vms {
                for p in &v.procs {
                    total += p.busy_ns;
                    if let Some(k) = procs
                        .iter()
                        .position(|(vm, pid)| *vm == v.name && *pid == p.pid)
                    {
                        sums[k] += p.busy_ns;
                    }
                }
            }
            i += 1;
        }
        let x = ((b * bucket) as f64 + bucket as f64 / 2.0) / 1e9;
        for (s, sum) in series.iter_mut().zip(sums) {
            s.points.push((x, share(sum, total) * 100.0));
        }
    }
    plots.push((
        "sched_shares_over_time.svg",
        Plot {
            title: format!(
                "VMs 1:1, B has 3 procs; B/23 idles at {t_idle:.1} s; weights 1:3 at {t_weights:.1} s"
            ),
            x_label: "time (s)".into(),
            y_label: "share of GPU time (%), 100 ms buckets".into(),
            log_x: false,
            y_min_top: 60.0,
            series,
        },
    ));
    Ok(())
}

/// One saturating tenant under fair vs none (alternating), and the shadow switch cost.
fn overhead(opts: &SchedOpts, figs: &mut Vec<Figure>) -> Result<()> {
    let rig = SchedRig::new("overhead", &["a"], false)?;
    let be = rig.backend();
    let tenant = Tenant::spawn(rig.vm("a")?, TenantSpec::throttle(1, 200 * US))?;
    // Alternate the order in each pair so drift in the host's load hits both sides;
    // the figure is the median of the pairs' ratios.
    let (mut none, mut fair, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for rep in 0..opts.overhead_reps {
        let order = if rep % 2 == 0 {
            [Policy::None, Policy::Fair]
        } else {
            [Policy::Fair, Policy::None]
        };
        let mut pair = [0.0; 2];
        for policy in order {
            start(be, policy)?;
            std::thread::sleep(opts.warmup / 3);
            let (k0, t0) = (tenant.completed(), Instant::now());
            std::thread::sleep(opts.window / 3);
            let rate = (tenant.completed() - k0) as f64 / t0.elapsed().as_secs_f64();
            pair[usize::from(policy == Policy::Fair)] = rate;
        }
        none.push(pair[0]);
        fair.push(pair[1]);
        ratios.push(pair[1] / pair[0].max(1e-9));
    }
    let shadows = be.sched_stats().shadows;
    let tick_max = be.sched_stats().tick_ns_max;
    let (n, f) = (median(&mut none), median(&mut fair));
    figs.push(fig("overhead_none_kernels_per_s", n, "1/s", Better::Higher));
    figs.push(fig("overhead_fair_kernels_per_s", f, "1/s", Better::Higher));
    figs.push(
        fig(
            "overhead_fair_vs_none_throughput",
            median(&mut ratios),
            "ratio",
            Better::Higher,
        )
        .target(0.99),
    );
    figs.push(fig(
        "sched_tick_max",
        tick_max as f64 / 1e3,
        "us",
        Better::Lower,
    ));
    // A lone tenant is never the over-user: fair must not have remapped anything.
    figs.push(
        fig(
            "overhead_fair_shadows",
            shadows as f64,
            "count",
            Better::Lower,
        )
        .target(0.0),
    );
    // Shadow switch cost on the live channel (policy none: nobody else remaps it).
    start(be, Policy::None)?;
    let ch = be
        .vm_channels("a")
        .first()
        .map(|c| c.0)
        .ok_or_else(|| SchedSuiteError::Other("no channel".into()))?;
    let (mut on, mut off) = (Vec::new(), Vec::new());
    for _ in 0..opts.switch_samples {
        on.push(be.shadow_channel("a", ch, true)?.ns);
        off.push(be.shadow_channel("a", ch, false)?.ns);
    }
    tenant.stop()?;
    for (name, v) in [("shadow", &mut on), ("unshadow", &mut off)] {
        for p in [50.0, 99.0] {
            figs.push(fig(
                &format!("{name}_switch_p{p:.0}"),
                percentile(v, p).unwrap_or(0) as f64 / 1e3,
                "us",
                Better::Lower,
            ));
        }
    }
    Ok(())
}

/// The baseline `timeslice` and the counter-less `sampling` policy on the
/// short-vs-long-kernel pair.
fn other_policies(opts: &SchedOpts, figs: &mut Vec<Figure>) -> Result<()> {
    let (short, long) = (200 * US, 2 * MS);
    {
        let rig = SchedRig::new("slice", &["a", "b"], false)?;
        start(rig.backend(), Policy::Timeslice)?;
        let tenants = vec![
            Tenant::spawn(rig.vm("a")?, TenantSpec::throttle(1, short))?,
            Tenant::spawn(rig.vm("b")?, TenantSpec::throttle(2, long))?,
        ];
        std::thread::sleep(opts.warmup);
        let busy = busy_over(&rig, &[("a", 1), ("b", 2)], opts.window);
        stop_all(tenants)?;
        figs.push(fig(
            "timeslice_vm_a_share",
            share(busy[0], busy[0] + busy[1]) * 100.0,
            "%",
            Better::Higher,
        ));
    }
    // The GPU hides its busy counters: shares from the tenants' kernel counts.
    let rig = SchedRig::new("sampling", &["a", "b"], true)?;
    start(rig.backend(), Policy::Sampling)?;
    let a = Tenant::spawn(rig.vm("a")?, TenantSpec::throttle(1, short))?;
    let b = Tenant::spawn(rig.vm("b")?, TenantSpec::throttle(2, long))?;
    std::thread::sleep(opts.warmup * 2);
    let (a0, b0) = (a.completed(), b.completed());
    std::thread::sleep(opts.window * 2);
    let (ga, gb) = ((a.completed() - a0) * short, (b.completed() - b0) * long);
    let st = rig.backend().sched_stats();
    stop_all(vec![a, b])?;
    let s = share(ga, ga + gb) * 100.0;
    figs.push(fig("sampling_vm_a_share", s, "%", Better::Higher));
    figs.push(dev("sampling_vm_a_dev", s - 50.0, "pp", 5.0));
    figs.push(fig(
        "sampling_samples",
        st.samples as f64,
        "count",
        Better::Higher,
    ));
    Ok(())
}

/// A tenant that idles, then bursts (issue 15), under `fair` with default settings: VMs
/// `a` and `b` run saturating 1 ms channels; VM `c` is connected with an idle channel for
/// 2 s (long enough for the scheduler to call it dormant and look at it only every few
/// intervals), then starts a saturating 2 ms throttle and wakes its idle channel with
/// the same. All three then want the whole GPU, so each is entitled to a third. Figures
/// over the first second of the burst: what `a` and `b` kept of their entitlement (the
/// lower one; goal ≥ 90 %), and `c`'s share.
fn idle_then_burst(figs: &mut Vec<Figure>) -> Result<()> {
    let rig = SchedRig::new("burst", &["a", "b", "c"], false)?;
    start(rig.backend(), Policy::Fair)?;
    let steady = vec![
        Tenant::spawn(rig.vm("a")?, TenantSpec::throttle(1, MS))?,
        Tenant::spawn(rig.vm("b")?, TenantSpec::throttle(2, MS))?,
    ];
    // `c`'s idle channel: created, used once, then left (the scheduler sees it quiet).
    let dev = vgpu_guest::Device::loopback(rig.vm("c")?, 30)?;
    let ctx = dev.create_context()?;
    let mut idle = ctx.create_channel()?;
    idle.launch(&vgpu_guest::KernelArgs::Spin { ns: MS }, [1, 1, 1])?;
    idle.finish()?;
    std::thread::sleep(Duration::from_secs(2));
    let quiet_before = rig.backend().sched_stats().quiet_channels;
    let burst = Tenant::spawn(rig.vm("c")?, TenantSpec::throttle(3, 2 * MS))?;
    for _ in 0..4 {
        idle.launch(&vgpu_guest::KernelArgs::Spin { ns: 2 * MS }, [1, 1, 1])?;
    }
    idle.submit()?;
    let who = [("a", 1), ("b", 2), ("c", 3), ("c", 30)];
    let busy = busy_over(&rig, &who, Duration::from_secs(1));
    idle.finish()?;
    drop(idle);
    drop(ctx);
    burst.stop()?;
    stop_all(steady)?;
    let total: u64 = busy.iter().sum();
    let third = 1.0 / 3.0;
    let kept = |b: u64| share(b, total) / third * 100.0;
    let kept_min = kept(busy[0]).min(kept(busy[1]));
    figs.push(
        fig(
            "burst_steady_vms_kept_of_entitlement_min",
            kept_min,
            "%",
            Better::Higher,
        )
        .target(90.0),
    );
    figs.push(fig(
        "burst_first_second_c_share",
        share(busy[2] + busy[3], total) * 100.0,
        "%",
        Better::Higher,
    ));
    figs.push(fig(
        "burst_quiet_channels_before",
        f64::from(quiet_before),
        "channels",
        Better::Higher,
    ));
    Ok(())
}

/// Mixed tenants (issue 15), default settings, `vgpu-demo`'s mix: VM `a` a saturating
/// 2 ms throttle, VM `b` a saturating 200 µs throttle; VM `c` two processes looping the
/// saxpy and hotspot workloads (kernels the sim runs on the CPU, a channel per run); VM
/// `d` looping sgemm. Each VM's share of the GPU time beside its entitlement (weighted
/// max-min over measured demand, as `vgpu-demo` and the control API report it) and the
/// deviation in pp; `mixed_max_dev` is the largest. The same mix runs under `none` too:
/// `mixed_utilization_fair_vs_none` is the GPU's busy fraction under `fair` over that
/// under `none` (a policy that holds tenants back while the GPU idles shows below 1).
fn mixed_tenants(opts: &SchedOpts, figs: &mut Vec<Figure>) -> Result<()> {
    let none = run_mix(opts, Policy::None)?;
    let shares = run_mix(opts, Policy::Fair)?;
    let mut max_dev: f64 = 0.0;
    for v in &shares.vms {
        let d = 100.0 * (v.share - v.entitled);
        max_dev = max_dev.max(d.abs());
        figs.push(fig(
            &format!("mixed_{}_share", v.name),
            100.0 * v.share,
            "%",
            Better::Higher,
        ));
        figs.push(fig(
            &format!("mixed_{}_entitled", v.name),
            100.0 * v.entitled,
            "%",
            Better::Higher,
        ));
        figs.push(dev(&format!("mixed_{}_dev", v.name), d, "pp", 3.0));
    }
    figs.push(dev("mixed_max_dev", max_dev, "pp", 3.0));
    figs.push(fig(
        "mixed_utilization_none",
        100.0 * none.utilization,
        "%",
        Better::Higher,
    ));
    figs.push(fig(
        "mixed_utilization_fair",
        100.0 * shares.utilization,
        "%",
        Better::Higher,
    ));
    figs.push(fig(
        "mixed_utilization_fair_vs_none",
        shares.utilization / none.utilization.max(1e-9),
        "ratio",
        Better::Higher,
    ));
    Ok(())
}

/// One run of the mixed tenants of [`mixed_tenants`] under `policy`: the shares over
/// the window after the warm-up.
fn run_mix(opts: &SchedOpts, policy: Policy) -> Result<vgpu_backend::GpuShares> {
    use std::sync::atomic::{AtomicBool, Ordering};
    use vgpu_guest::workloads::Workload;
    let rig = SchedRig::new("mixed", &["a", "b", "c", "d"], false)?;
    start(rig.backend(), policy)?;
    let throttles = [
        Tenant::spawn(rig.vm("a")?, TenantSpec::throttle(1, 2 * MS))?,
        Tenant::spawn(rig.vm("b")?, TenantSpec::throttle(2, 200 * US))?,
    ];
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let mut loops = Vec::new();
    for (vm, pid, name) in [("c", 31, "saxpy"), ("c", 32, "hotspot"), ("d", 41, "sgemm")] {
        let w = Workload::by_name(name, true)
            .ok_or_else(|| SchedSuiteError::Other(format!("no workload {name}")))?;
        let dev = vgpu_guest::Device::loopback(rig.vm(vm)?, pid)?;
        let stop = stop.clone();
        loops.push(std::thread::spawn(
            move || -> std::result::Result<u64, vgpu_guest::Error> {
                let ctx = dev.create_context()?;
                let mut runs = 0;
                while !stop.load(Ordering::Relaxed) {
                    w.run(&ctx)?;
                    runs += 1;
                }
                Ok(runs)
            },
        ));
    }
    std::thread::sleep(opts.warmup);
    let seq0 = rig.backend().next_interval();
    std::thread::sleep(opts.window.max(Duration::from_secs(2)));
    let shares = rig
        .backend()
        .gpu_shares_between(seq0, rig.backend().next_interval());
    stop.store(true, Ordering::Relaxed);
    for l in loops {
        let runs = l
            .join()
            .map_err(|_| SchedSuiteError::Other("a workload thread panicked".into()))??;
        if runs == 0 {
            return Err(SchedSuiteError::Other(
                "a workload never finished a run".into(),
            ));
        }
    }
    stop_all(throttles.into())?;
    Ok(shares)
}

/// Hostile shapes against a steady VM (issue 19), weights 1:1 under `fair` with default
/// settings: VM `a` churns (two processes, each a new context and channel per 8 ms
/// kernel, destroyed after it), or spreads one process over 16 saturating channels; VM `b`
/// runs one saturating 1 ms channel. Both demand the whole GPU, so each is entitled to
/// half; the figure is `a`'s deviation from it, over the whole run (the burst a new
/// tenant queues before its first interval runs unscheduled, and is paid back after). Then
/// short against long kernels (issue
/// 15): VM `a` a saturating 100 µs throttle, VM `b` a saturating 10 ms one
/// (`kernels_short_vs_long_*`; the GPU's own round-robin would give `a` about 1 %).
fn churn_and_many_channels(opts: &SchedOpts, figs: &mut Vec<Figure>) -> Result<()> {
    let cases: [(&str, Vec<TenantSpec>, TenantSpec); 3] = [
        (
            "churn_vs_steady",
            vec![TenantSpec::churn(1, 8 * MS), TenantSpec::churn(2, 8 * MS)],
            TenantSpec::throttle(9, MS),
        ),
        (
            "channels16_vs_steady",
            vec![TenantSpec::channels(1, MS, 16)],
            TenantSpec::throttle(9, MS),
        ),
        (
            "kernels_short_vs_long",
            vec![TenantSpec::throttle(1, 100 * US)],
            TenantSpec::throttle(9, 10 * MS),
        ),
    ];
    for (name, specs, steady) in cases {
        let rig = SchedRig::new(name, &["a", "b"], false)?;
        start(rig.backend(), Policy::Fair)?;
        let mut tenants = Vec::new();
        for spec in specs {
            tenants.push(Tenant::spawn(rig.vm("a")?, spec)?);
        }
        tenants.push(Tenant::spawn(rig.vm("b")?, steady)?);
        // From the start: what a tenant queues before the scheduler first sees its
        // channels runs at once (direct submission) and is paid back later, so a window
        // that began after a warm-up would count the payback without the burst.
        let before = (rig.vm_busy("a"), rig.vm_busy("b"));
        std::thread::sleep(opts.warmup + opts.window * 2);
        let a = rig.vm_busy("a").saturating_sub(before.0);
        let b = rig.vm_busy("b").saturating_sub(before.1);
        stop_all(tenants)?;
        let s = share(a, a + b) * 100.0;
        figs.push(fig(&format!("{name}_a_share"), s, "%", Better::Higher));
        figs.push(dev(&format!("{name}_dev"), s - 50.0, "pp", 3.0));
    }
    Ok(())
}

/// The scheduler while an eviction waits for a channel that never drains (issue 19): VM
/// `a` has a buffer and a channel blocked on a semaphore nobody releases; the operator
/// evicts the buffer with a 2 s drain timeout while VM `b` runs a throttle. Intervals run
/// per second of the wait, and the longest tick in intervals (target: under 2).
fn tick_while_eviction_waits(opts: &SchedOpts, figs: &mut Vec<Figure>) -> Result<()> {
    let rig = SchedRig::new("evict-wait", &["a", "b"], false)?;
    let be = rig.backend().clone();
    be.set_vram_config(VramConfig {
        enabled: false,
        drain_timeout_ms: 2_000,
        ..VramConfig::default()
    })
    .map_err(|e| SchedSuiteError::Other(e.to_string()))?;
    let guest = |e: vgpu_guest::Error| SchedSuiteError::Other(format!("guest: {e}"));
    let dev = Device::loopback(rig.vm("a")?, 1).map_err(guest)?;
    let ctx = dev.create_context().map_err(guest)?;
    let buf = ctx.alloc_vram(4 << 20).map_err(guest)?;
    let sem = ctx.alloc_vram(4096).map_err(guest)?;
    let mut ch = ctx.create_channel().map_err(guest)?;
    ch.sem_acquire(sem.gpu_va(), 1, SemaphoreMode::Equal)
        .map_err(guest)?;
    ch.submit().map_err(guest)?;
    let tb = Tenant::spawn(rig.vm("b")?, TenantSpec::throttle(2, MS))?;
    start(&be, Policy::Fair)?;
    std::thread::sleep(opts.warmup);
    let interval_ns = u64::from(SchedConfig::default().interval_ms) * MS;
    let be2 = be.clone();
    let ev = std::thread::spawn(move || be2.vram_evict("a", 4 << 20));
    std::thread::sleep(Duration::from_millis(100));
    let i0 = be.sched_stats().intervals;
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_millis(1500));
    let st = be.sched_stats();
    let secs = t0.elapsed().as_secs_f64();
    let evicted = ev
        .join()
        .map_err(|_| SchedSuiteError::Other("eviction thread panicked".into()))?;
    tb.stop()?;
    if let Ok(r) = evicted {
        return Err(SchedSuiteError::Other(format!(
            "the eviction moved {} bytes past a busy channel",
            r.bytes
        )));
    }
    drop((ch, buf, sem));
    figs.push(fig(
        "evict_wait_intervals_per_s",
        (st.intervals - i0) as f64 / secs,
        "1/s",
        Better::Higher,
    ));
    figs.push(
        fig(
            "evict_wait_tick_max",
            st.tick_ns_max as f64 / interval_ns as f64,
            "intervals",
            Better::Lower,
        )
        .target(2.0),
    );
    Ok(())
}
