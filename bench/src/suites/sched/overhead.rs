//! What scheduling costs: tick time, the shadow switch, the reaction to a weight change,
//! and the other policies (timeslice, sampling) side by side.

use super::*;

/// One saturating tenant under fair vs none (alternating), and the shadow switch cost.
pub(super) fn overhead(opts: &SchedOpts, figs: &mut Vec<Figure>) -> Result<()> {
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
pub(super) fn other_policies(opts: &SchedOpts, figs: &mut Vec<Figure>) -> Result<()> {
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
