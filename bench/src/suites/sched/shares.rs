//! Shares by weight: three VMs at 1:2:4, and two levels (VMs, then the processes inside).

use super::*;

/// Weights 1:2:4 across three saturating VMs (the lightest VM has the longest kernels,
/// so the GPU's own arbitration would favour it).
pub(super) fn weights_1_2_4(opts: &SchedOpts, figs: &mut Vec<Figure>) -> Result<()> {
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
pub(super) fn two_levels(
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
