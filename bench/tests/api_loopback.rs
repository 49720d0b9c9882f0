//! The control API with guests running: `vgpu-backend` with the fair scheduler, loopback
//! VMs over real vhost-user sockets, guest processes submitting by stores to their BAR,
//! and every operator action sent through the API's unix socket.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use vgpu_backend::api::types::VmVramBody;
use vgpu_backend::VramConfig;
use vgpu_bench::suites::api::{weight_flips, LiveRig, FLIP_VMS};
use vgpu_guest::workloads::throttle::{self, ThrottleConfig};
use vgpu_guest::{Device, KernelArgs};
use vgpu_host_shim::kernels::reference;
use vgpu_protocol::ErrorCode;

fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < timeout {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    f()
}

/// Pause, drain and resume a VM while the scheduler runs: a paused VM gets no GPU time at
/// all (the scheduler must not unshadow its channels), a channel created while paused
/// starts shadowed, and resume lets everything run again.
#[test]
fn pause_drain_resume_with_the_scheduler_running() {
    let _ = env_logger::builder().is_test(true).try_init();
    let rig = LiveRig::new("pause", &[("a", 1_000_000), ("b", 1_000_000)], 10).expect("rig");
    let c = rig.client();
    assert!(wait_until(Duration::from_secs(10), || rig.busy_ns("a") > 0
        && rig.busy_ns("b") > 0));

    let d = c.drain("a", Some(5000)).expect("drain");
    assert!(d.paused && d.channels >= 1, "{d:?}");
    let waited = d.waited_ms.expect("waited");
    println!("drain: {} channel(s), waited {waited:.2} ms", d.channels);
    // After a drain nothing of `a` runs, across many scheduler intervals.
    let (a0, b0) = (rig.busy_ns("a"), rig.busy_ns("b"));
    std::thread::sleep(Duration::from_millis(500));
    let (a1, b1) = (rig.busy_ns("a"), rig.busy_ns("b"));
    assert_eq!(a1, a0, "a ran while drained");
    assert!(
        b1 > b0 + 100_000_000,
        "b gets the GPU: {} ms",
        (b1 - b0) / 1_000_000
    );
    let st = c.vm_stats("a").expect("stats");
    assert!(st.paused);
    assert!(
        !st.channels.is_empty() && st.channels.iter().all(|ch| ch.shadowed),
        "{st:?}"
    );

    // A new guest process in the paused VM: its channel starts shadowed, its work waits.
    let (tx, rx) = mpsc::channel();
    let vm = rig.vm("a").expect("vm a");
    let late = std::thread::spawn(move || {
        let dev = Device::loopback(vm, 777).expect("device");
        let ctx = dev.create_context().expect("context");
        let r = throttle::run(
            &ctx,
            &ThrottleConfig {
                kernel_ns: 200_000,
                iterations: Some(5),
                depth: 2,
                stop: None,
            },
        );
        let _ = tx.send(r.map(|r| r.iterations));
    });
    assert!(wait_until(Duration::from_secs(10), || {
        c.vm_stats("a")
            .map(|s| s.channels.iter().any(|ch| ch.pid == 777))
            .unwrap_or(false)
    }));
    std::thread::sleep(Duration::from_millis(200));
    let st = c.vm_stats("a").expect("stats");
    let late_ch: Vec<_> = st.channels.iter().filter(|ch| ch.pid == 777).collect();
    assert!(late_ch.iter().all(|ch| ch.shadowed), "{late_ch:?}");
    assert!(
        late_ch.iter().any(|ch| ch.backlog > 0),
        "its submissions wait: {late_ch:?}"
    );
    assert!(
        rx.try_recv().is_err(),
        "the late process finished while paused"
    );
    assert_eq!(rig.busy_ns("a"), a0, "a ran while paused");

    let r = c.resume("a").expect("resume");
    assert!(!r.paused);
    let done = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("late process");
    assert_eq!(done.expect("throttle"), 5);
    late.join().expect("late thread");
    assert!(wait_until(Duration::from_secs(10), || rig.busy_ns("a")
        > a0 + 50_000_000));
    // Pause and resume again: still consistent.
    c.pause("a").expect("pause");
    c.resume("a").expect("resume");
    assert_eq!(rig.backend.vm_paused("a"), Some(false));
}

/// The VRAM quota set through the API is the limit `ALLOC_VRAM` checks.
#[test]
fn vram_quota_limits_new_allocations() {
    let rig = LiveRig::new("quota", &[("q", 100_000)], 10).expect("rig");
    let c = rig.client();
    let dev = Device::loopback(rig.vm("q").expect("vm"), 9).expect("device");
    let ctx = dev.create_context().expect("context");
    let _a = ctx.alloc_vram(4 << 20).expect("4 MiB");
    let used = c.vm("q").expect("vm").usage.vram_bytes;
    c.set_vram_quota("q", used + (1 << 20)).expect("quota");
    match ctx.alloc_vram(2 << 20) {
        Err(vgpu_guest::Error::Device(ErrorCode::LimitExceeded)) => {}
        other => panic!("over the quota: {other:?}"),
    }
    let _b = ctx.alloc_vram(1 << 20).expect("within the quota");
    // A quota below the usage keeps what exists and refuses anything new.
    c.set_vram_quota("q", 4096).expect("tiny quota");
    assert!(ctx.alloc_vram(4096).is_err());
    assert_eq!(c.vm("q").expect("vm").usage.vram_bytes, used + (1 << 20));
    c.set_vram_quota("q", 64 << 20).expect("raise");
    let _c = ctx.alloc_vram(8 << 20).expect("after raising");
    let st = c.vm_stats("q").expect("stats");
    assert_eq!(st.vram_quota_bytes, 64 << 20);
    assert!(st.vram_resident_bytes >= 13 << 20);
}

/// A weight change through the API takes effect within two scheduler intervals (counted
/// in the scheduler's own ticks, median of five changes, plus a generous wall-clock bound
/// on each; the precise figures are `vgpu-bench api`).
#[test]
fn weight_change_takes_effect_within_two_intervals() {
    let _ = env_logger::builder().is_test(true).try_init();
    let interval_ms = 20;
    let rig = LiveRig::new("flip", &FLIP_VMS, interval_ms).expect("rig");
    std::thread::sleep(Duration::from_millis(300));
    let flips = weight_flips(&rig, 5).expect("flips");
    for f in &flips {
        println!(
            "weight change: {:.2} ms, tick {} after the answer",
            f.wall_ns as f64 / 1e6,
            f.intervals
        );
        // Generous: a guest thread starved of CPU on a loaded host submits nothing, and
        // an idle VM cannot be seen held back.
        assert!(f.wall_ns < 2_000_000_000, "{f:?}");
    }
    // Typically the very next tick; the median must be within two.
    let mut ticks: Vec<u64> = flips.iter().map(|f| f.intervals).collect();
    ticks.sort_unstable();
    assert!(ticks[ticks.len() / 2] <= 2, "ticks {ticks:?}");
    // And the shares follow: `a` at weight 1 against `b` at 100 gets little of the GPU.
    let c = rig.client();
    c.set_weight("a", 1).expect("weight");
    std::thread::sleep(Duration::from_millis(300));
    let (a0, b0) = (rig.busy_ns("a"), rig.busy_ns("b"));
    std::thread::sleep(Duration::from_millis(1500));
    let (a, b) = (rig.busy_ns("a") - a0, rig.busy_ns("b") - b0);
    let share = a as f64 / (a + b).max(1) as f64;
    println!("a's share at weight 1 vs 100: {:.1} %", share * 100.0);
    assert!(share < 0.2, "a's share {:.1} %", share * 100.0);
    // The API shows each VM's entitlement beside its share: at weight 1 against 100 `a`
    // is owed at most what `b` (weight 100) leaves it — about 1/101 when `b` saturates,
    // what `b` did not want otherwise; the deviation is the share's distance from that,
    // and /metrics has the gauge.
    for vm in ["a", "b"] {
        let st = c.vm_stats(vm).expect("stats");
        let w = st
            .windows
            .iter()
            .find(|w| w.window_s == 1)
            .expect("1 s window");
        let (e, d) = (
            w.entitled.expect("entitled"),
            w.deviation_pp.expect("deviation"),
        );
        println!(
            "{vm}: share {:.3}, entitled {e:.3}, deviation {d:+.1} pp",
            w.share
        );
        assert!((0.0..=1.0).contains(&e) && d.is_finite());
        if vm == "a" {
            assert!(e < 0.05, "a at weight 1 is owed little: {e}");
        }
    }
    let m = c.metrics().expect("metrics");
    assert!(
        metric(&m, "vgpu_vm_gpu_entitled_share{vm=\"b\",window=\"10s\"}").is_some(),
        "entitlement gauge"
    );
}

const MIB: u64 = 1 << 20;

/// The value of the sample `series` (`name{labels}` exactly as rendered) in `/metrics`.
fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// The VM's VRAM figures read three ways at one moment: the API's stats, `/metrics`, and
/// the API again; the two API reads must agree (nothing moved in between).
fn vram_snapshot(rig: &LiveRig, vm: &str) -> (VmVramBody, String) {
    let c = rig.client();
    for _ in 0..50 {
        let a = c.vm_stats(vm).expect("stats").vram;
        let m = c.metrics().expect("metrics");
        let b = c.vm_stats(vm).expect("stats").vram;
        if a == b {
            return (a, m);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("the VRAM figures of {vm} never settled");
}

/// Checks that `/metrics` shows the same VRAM figures as the stats body, per VM and per
/// process.
fn assert_metrics_match(m: &str, vm: &str, v: &VmVramBody) {
    let series = |name: &str| format!("{name}{{vm=\"{vm}\"}}");
    for (name, want) in [
        ("vgpu_vm_vram_resident_bytes", v.resident_bytes as f64),
        ("vgpu_vm_vram_swapped_bytes", v.swapped_bytes as f64),
        ("vgpu_vm_vram_evictions_total", v.evictions as f64),
        ("vgpu_vm_vram_swap_ins_total", v.swap_ins as f64),
        ("vgpu_vm_vram_bytes_out_total", v.bytes_out as f64),
        ("vgpu_vm_vram_bytes_in_total", v.bytes_in as f64),
        ("vgpu_vm_vram_pauses_total", v.pauses as f64),
        (
            "vgpu_vm_vram_pause_seconds_total",
            v.pause_ns_total as f64 / 1e9,
        ),
        ("vgpu_vm_vram_drain_timeouts_total", v.drain_timeouts as f64),
        ("vgpu_vm_vram_move_failures_total", v.move_failures as f64),
    ] {
        assert_eq!(metric(m, &series(name)), Some(want), "{name}:\n{m}");
    }
    let max = format!("vgpu_vm_vram_pause_seconds{{vm=\"{vm}\",which=\"max\"}}");
    assert_eq!(metric(m, &max), Some(v.pause_ns_max as f64 / 1e9), "{m}");
    for p in &v.processes {
        let series = |name: &str| format!("{name}{{vm=\"{vm}\",pid=\"{}\"}}", p.pid);
        for (name, want) in [
            ("vgpu_process_vram_resident_bytes", p.resident_bytes as f64),
            ("vgpu_process_vram_swapped_bytes", p.swapped_bytes as f64),
            ("vgpu_process_vram_evictions_total", p.evictions as f64),
            ("vgpu_process_vram_swap_ins_total", p.swap_ins as f64),
            ("vgpu_process_vram_bytes_out_total", p.bytes_out as f64),
            ("vgpu_process_vram_bytes_in_total", p.bytes_in as f64),
            (
                "vgpu_process_vram_pause_seconds_total",
                p.pause_ns as f64 / 1e9,
            ),
        ] {
            assert_eq!(metric(m, &series(name)), Some(want), "{name}:\n{m}");
        }
    }
}

/// A real eviction and swap-in of a guest process's buffer (its channel paused for the
/// moves, a throttle guest running beside it), seen through the API's VM stats and
/// `/metrics`: the counters move by exactly what the moves did, per VM and per process.
#[test]
fn vram_swap_counters_through_the_api() {
    let _ = env_logger::builder().is_test(true).try_init();
    let rig = LiveRig::new("vram", &[("s", 1_000_000)], 10).expect("rig");
    // The manager stays off until the swap-in, so that only the forced eviction moves.
    rig.backend
        .set_vram_config(VramConfig {
            enabled: false,
            ..VramConfig::default()
        })
        .expect("vram config");
    let dev = Device::loopback(rig.vm("s").expect("vm"), 9).expect("device");
    let ctx = dev.create_context().expect("context");
    let mut ch = ctx.create_channel().expect("channel");
    let buf = ctx.alloc_vram(8 * MIB).expect("8 MiB");
    ch.launch(
        &KernelArgs::Memset {
            dst: buf.gpu_va(),
            len: 8 * MIB,
            pattern: 0x5a5a_5a5a,
        },
        [1, 1, 1],
    )
    .expect("launch");
    let f = ch.submit().expect("submit");
    ch.wait(f).expect("wait");
    let pattern = vec![0x5au8; (8 * MIB) as usize];

    let (v0, m0) = vram_snapshot(&rig, "s");
    assert_eq!((v0.evictions, v0.swap_ins, v0.pauses), (0, 0, 0), "{v0:?}");
    assert_eq!(
        (v0.resident_bytes, v0.swapped_bytes),
        (8 * MIB, 0),
        "{v0:?}"
    );
    let p0 = v0.processes.iter().find(|p| p.pid == 9).expect("pid 9");
    assert_eq!(p0.resident_bytes, 8 * MIB, "{v0:?}");
    assert_metrics_match(&m0, "s", &v0);

    let r = rig.backend.vram_evict("s", 8 * MIB).expect("evict");
    assert_eq!(r.bytes, 8 * MIB, "{r:?}");
    assert_eq!(r.chunks, 4, "{r:?}");
    let (v1, m1) = vram_snapshot(&rig, "s");
    println!("after eviction: {v1:?}");
    assert_eq!(
        (v1.resident_bytes, v1.swapped_bytes),
        (0, 8 * MIB),
        "{v1:?}"
    );
    assert_eq!((v1.evictions, v1.bytes_out), (4, 8 * MIB), "{v1:?}");
    assert_eq!((v1.swap_ins, v1.bytes_in), (0, 0), "{v1:?}");
    assert!(v1.pauses >= 1 && v1.pause_ns_total > 0, "{v1:?}");
    assert!(
        v1.pause_ns_max >= v1.pause_p99_ns && v1.pause_p99_ns >= v1.pause_p50_ns,
        "{v1:?}"
    );
    assert!(v1.pause_p50_ns > 0, "{v1:?}");
    let p1 = v1.processes.iter().find(|p| p.pid == 9).expect("pid 9");
    assert_eq!((p1.evictions, p1.bytes_out), (4, 8 * MIB), "{p1:?}");
    assert_eq!(
        (p1.resident_bytes, p1.swapped_bytes),
        (0, 8 * MIB),
        "{p1:?}"
    );
    assert_eq!(p1.pause_ns, v1.pause_ns_total, "{v1:?}");
    let st = rig.client().vm_stats("s").expect("stats");
    assert_eq!(
        (st.vram_resident_bytes, st.vram_swapped_bytes),
        (0, 8 * MIB)
    );
    assert_metrics_match(&m1, "s", &v1);
    // The guest's bytes survived, read through its aperture from the swap copy.
    let mut got = vec![0u8; pattern.len()];
    buf.read(0, &mut got).expect("read");
    assert!(got == pattern, "the buffer changed while swapped out");

    // The manager brings the chunks back (VRAM is plentiful).
    rig.backend
        .set_vram_config(VramConfig::default())
        .expect("vram config");
    rig.backend.vram_rebalance();
    assert!(wait_until(Duration::from_secs(10), || rig
        .backend
        .vram_stats("s")
        .is_some_and(|r| r.vm.swapped_bytes == 0)));
    let (v2, m2) = vram_snapshot(&rig, "s");
    println!("after swap-in: {v2:?}");
    assert_eq!(
        (v2.resident_bytes, v2.swapped_bytes),
        (8 * MIB, 0),
        "{v2:?}"
    );
    assert_eq!((v2.evictions, v2.bytes_out), (4, 8 * MIB), "{v2:?}");
    assert_eq!((v2.swap_ins, v2.bytes_in), (4, 8 * MIB), "{v2:?}");
    assert!(
        v2.pauses > v1.pauses && v2.pause_ns_total > v1.pause_ns_total,
        "{v2:?}"
    );
    let p2 = v2.processes.iter().find(|p| p.pid == 9).expect("pid 9");
    assert_eq!((p2.swap_ins, p2.bytes_in), (4, 8 * MIB), "{p2:?}");
    assert_metrics_match(&m2, "s", &v2);
    assert!(
        metric(&m2, "vgpu_vram_manager_passes_total").is_some_and(|n| n >= 1.0),
        "{m2}"
    );
    buf.read(0, &mut got).expect("read");
    assert!(got == pattern, "the buffer changed across the swap-in");
    // The GPU sees the same bytes at the same address.
    let sum = ctx.alloc_host(4096).expect("host buffer");
    ch.launch(
        &KernelArgs::Checksum {
            src: buf.gpu_va(),
            len: 8 * MIB,
            dst: sum.gpu_va(),
        },
        [1, 1, 1],
    )
    .expect("launch");
    let f = ch.submit().expect("submit");
    ch.wait(f).expect("wait");
    assert_eq!(sum.read_u64(0).expect("sum"), reference::checksum(&pattern));
    assert!(ch.error().is_none());
}
