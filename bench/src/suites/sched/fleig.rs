//! Fleig's §5.4 scenarios: the workload's runtime beside throttles of growing kernel
//! lengths, and a VM against throttling VMs.

use super::*;

/// Runs the Fleig workload (process 1 of VM `a`) to completion; its runtime.
pub(super) fn run_workload(rig: &SchedRig, opts: &SchedOpts) -> Result<Duration> {
    let w = Tenant::spawn(
        rig.vm("a")?,
        TenantSpec::fixed(1, opts.workload_kernel_ns, opts.workload_kernels),
    )?;
    Ok(w.join()?.elapsed)
}

/// One Fleig point: the workload's wall runtime beside a throttle of `k` ns kernels and
/// its share of the GPU time used meanwhile.
pub(super) fn beside_throttle(rig: &SchedRig, opts: &SchedOpts, k: u64) -> Result<(f64, f64)> {
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
pub(super) fn fleig_sweep(
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
pub(super) fn vm_against_throttles(
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
