//! The control API with guests running: `vgpu-backend` with the fair scheduler, loopback
//! VMs over real vhost-user sockets, guest processes submitting by stores to their BAR,
//! and every operator action sent through the API's unix socket.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use vgpu_guest::workloads::throttle::{self, ThrottleConfig};
use vgpu_guest::Device;
use vgpu_protocol::ErrorCode;
use vgpu_tools::suites::api::{weight_flips, LiveRig, FLIP_VMS};

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
}
