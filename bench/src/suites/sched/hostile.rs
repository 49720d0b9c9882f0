//! Tenants that try to escape or upset the policy: a burst after idling, a mix of light
//! and heavy tenants, churning channels and many channels, and a tick while an eviction
//! waits.

use super::*;

/// A tenant that idles, then bursts (issue 15), under `fair` with default settings: VMs
/// `a` and `b` run saturating 1 ms channels; VM `c` is connected with an idle channel for
/// 2 s (long enough for the scheduler to call it dormant and look at it only every few
/// intervals), then starts a saturating 2 ms throttle and wakes its idle channel with
/// the same. All three then want the whole GPU, so each is entitled to a third. Figures
/// over the first second of the burst: what `a` and `b` kept of their entitlement (the
/// lower one; goal ≥ 90 %), and `c`'s share.
pub(super) fn idle_then_burst(figs: &mut Vec<Figure>) -> Result<()> {
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
pub(super) fn mixed_tenants(opts: &SchedOpts, figs: &mut Vec<Figure>) -> Result<()> {
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
pub(super) fn run_mix(opts: &SchedOpts, policy: Policy) -> Result<vgpu_backend::GpuShares> {
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
pub(super) fn churn_and_many_channels(opts: &SchedOpts, figs: &mut Vec<Figure>) -> Result<()> {
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
pub(super) fn tick_while_eviction_waits(opts: &SchedOpts, figs: &mut Vec<Figure>) -> Result<()> {
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
