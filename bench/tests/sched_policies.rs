//! The scheduler end to end over the real path (vgpu-backend serving loopback VMs over
//! vhost-user, guest processes submitting by stores to their channel pages): two levels
//! with an idling sibling, weights and process weight hints, the timeslice and sampling
//! policies, the share API, and the kernel watchdog. Shares are GPU busy time from the
//! backend's books (or, on the GPU without counters, from the tenants' kernel counts),
//! asserted with generous bounds: the benchmark (`vgpu-bench sched`) holds the targets.

use std::sync::Arc;
use std::time::{Duration, Instant};

use vgpu_backend::{Policy, SchedConfig, SchedError, VgpuBackend};
use vgpu_bench::sched_rig::{SchedRig, Tenant, TenantSpec};
use vgpu_guest::{Device, Error as GuestError, KernelArgs};
use vgpu_protocol::request::event;
use vgpu_protocol::ErrorCode;

const MS: u64 = 1_000_000;

/// The tests of this file measure shares of GPU time over wall-clock windows; run side by
/// side on a 2-core machine they starve each other's guest threads (`sampling` measured
/// 16–17 % instead of 50 % in 2 of 4 runs of the whole file, on the scheduler before and
/// after issue 15's changes alike). Each takes this lock for its whole run.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}
const WARMUP: Duration = Duration::from_millis(400);
const WINDOW: Duration = Duration::from_millis(1500);

fn start(be: &Arc<VgpuBackend>, policy: Policy) {
    be.start_scheduler(SchedConfig {
        policy,
        ..SchedConfig::default()
    })
    .expect("start scheduler");
}

/// Busy time of each (VM, PID) over `WINDOW`, as fractions of their sum.
fn shares(rig: &SchedRig, who: &[(&str, u32)]) -> Vec<f64> {
    let before: Vec<u64> = who.iter().map(|(v, p)| rig.proc_busy(v, *p)).collect();
    std::thread::sleep(WINDOW);
    let d: Vec<u64> = who
        .iter()
        .zip(before)
        .map(|((v, p), b)| rig.proc_busy(v, *p) - b)
        .collect();
    let total: u64 = d.iter().sum::<u64>().max(1);
    d.iter().map(|x| *x as f64 / total as f64).collect()
}

fn assert_near(what: &str, got: f64, want: f64, tol: f64) {
    assert!(
        (got - want).abs() <= tol,
        "{what}: {:.1} %, want {:.1} ± {:.0} pp",
        got * 100.0,
        want * 100.0,
        tol * 100.0
    );
}

#[test]
fn two_levels_and_an_idle_sibling_s_share_goes_to_the_others() {
    let _serial = serial();
    let _ = env_logger::builder().is_test(true).try_init();
    let rig = SchedRig::new("t-levels", &["a", "b"], false).expect("rig");
    let be = rig.backend();
    start(be, Policy::Fair);
    let a = Tenant::spawn(rig.vm("a").unwrap(), TenantSpec::throttle(1, MS)).unwrap();
    let b1 = Tenant::spawn(rig.vm("b").unwrap(), TenantSpec::throttle(21, 500_000)).unwrap();
    let b2 = Tenant::spawn(rig.vm("b").unwrap(), TenantSpec::throttle(22, MS)).unwrap();
    let b3 = Tenant::spawn(rig.vm("b").unwrap(), TenantSpec::throttle(23, 2 * MS)).unwrap();
    std::thread::sleep(WARMUP);
    let who = [("a", 1), ("b", 21), ("b", 22), ("b", 23)];
    let s = shares(&rig, &who);
    println!("1:1, B has 3 processes: {s:?}");
    for (i, want) in [0.5, 1.0 / 6.0, 1.0 / 6.0, 1.0 / 6.0].iter().enumerate() {
        assert_near(&format!("{:?}", who[i]), s[i], *want, 0.10);
    }
    // The share API rolls the same books up per VM and process.
    let api = be.gpu_shares(Duration::from_millis(1000));
    assert_eq!(api.policy, Policy::Fair);
    assert!(api.intervals > 10 && api.total_busy_ns > 0);
    assert!(api.utilization > 0.2, "{api:?}");
    let vm_a = api.vms.iter().find(|v| v.name == "a").expect("VM a");
    let vm_b = api.vms.iter().find(|v| v.name == "b").expect("VM b");
    assert_eq!(vm_b.procs.len(), 3);
    assert_near("API share of a", vm_a.share, 0.5, 0.10);
    let procs: u64 = vm_b.procs.iter().map(|p| p.busy_ns).sum();
    assert_eq!(procs, vm_b.busy_ns, "processes add up to their VM");
    for p in &vm_b.procs {
        assert_near(
            "API share of a B process in B",
            p.share_of_vm,
            1.0 / 3.0,
            0.10,
        );
        assert_eq!(p.channels.len(), 1);
    }
    // One of B's processes goes idle: B's other two split B's half, A keeps its half.
    b3.stop().unwrap();
    std::thread::sleep(WARMUP);
    let s = shares(&rig, &who[..3]);
    println!("B/23 idle: {s:?}");
    assert_near("a", s[0], 0.5, 0.10);
    assert_near("b/21", s[1], 0.25, 0.10);
    assert_near("b/22", s[2], 0.25, 0.10);
    let st = be.sched_stats();
    for t in [a, b1, b2] {
        assert!(t.stop().unwrap().kernels > 0);
    }
    assert!(st.shadows > 0 && st.failures == 0, "{st:?}");
    // The history records every interval with its length.
    let hist = be.sched_history(0);
    assert!(hist.len() > 100);
    assert!(hist.windows(2).all(|w| w[1].seq == w[0].seq + 1));
}

#[test]
fn vm_weights_hold_and_process_hints_never_raise_a_vm_s_share() {
    let _serial = serial();
    let rig = SchedRig::new("t-weights", &["a", "b"], false).expect("rig");
    let be = rig.backend();
    be.set_vm_weight("a", 100).unwrap();
    be.set_vm_weight("b", 300).unwrap();
    // B's process 21 asks for 3x its sibling; A's process asks for a huge weight, which
    // must not buy VM A more than its operator weight.
    be.set_process_weight("b", 21, 3).unwrap();
    be.set_process_weight("a", 1, 10_000).unwrap();
    assert_eq!(be.process_weight("b", 21), 3);
    assert_eq!(be.process_weight("b", 22), 1);
    assert!(matches!(
        be.set_process_weight("b", 1, 0),
        Err(SchedError::InvalidWeight(0))
    ));
    assert!(matches!(
        be.set_process_weight("zz", 1, 5),
        Err(SchedError::NoVm(_))
    ));
    start(be, Policy::Fair);
    let tenants = vec![
        // The lightest VM has the longest kernels: the GPU alone would favour it.
        Tenant::spawn(rig.vm("a").unwrap(), TenantSpec::throttle(1, 2 * MS)).unwrap(),
        Tenant::spawn(rig.vm("b").unwrap(), TenantSpec::throttle(21, 500_000)).unwrap(),
        Tenant::spawn(rig.vm("b").unwrap(), TenantSpec::throttle(22, 500_000)).unwrap(),
    ];
    std::thread::sleep(WARMUP);
    let s = shares(&rig, &[("a", 1), ("b", 21), ("b", 22)]);
    println!("weights 1:3, hints 3:1 in B: {s:?}");
    assert_near("VM a", s[0], 0.25, 0.10);
    assert_near("b/21", s[1], 0.75 * 0.75, 0.10);
    assert_near("b/22", s[2], 0.75 * 0.25, 0.10);
    be.clear_process_weight("b", 21);
    assert_eq!(be.process_weight("b", 21), 1);
    for t in tenants {
        t.stop().unwrap();
    }
}

#[test]
fn timeslice_and_sampling_share_the_gpu() {
    let _serial = serial();
    let (short, long) = (200_000, 2 * MS);
    {
        let rig = SchedRig::new("t-slice", &["a", "b"], false).expect("rig");
        let be = rig.backend();
        start(be, Policy::Timeslice);
        let a = Tenant::spawn(rig.vm("a").unwrap(), TenantSpec::throttle(1, short)).unwrap();
        let b = Tenant::spawn(rig.vm("b").unwrap(), TenantSpec::throttle(2, long)).unwrap();
        std::thread::sleep(WARMUP);
        let s = shares(&rig, &[("a", 1), ("b", 2)]);
        println!("timeslice: {s:?}");
        // Timeslice is known to give the short-kernel VM 30–39 % here (BENCHMARKS.md,
        // "Other policies": the long kernels released at a slice's end overrun into the
        // next): the bound checks it shares at all, with room below that range for this
        // 2-core machine's noise (28.8 % seen once).
        assert_near("timeslice a", s[0], 0.5, 0.25);
        let st = be.sched_stats();
        assert!(st.shadows > 10 && st.failures == 0, "{st:?}");
        a.stop().unwrap();
        b.stop().unwrap();
    }
    // A GPU without busy counters: fair and the watchdog are refused, sampling works.
    let rig = SchedRig::new("t-sampling", &["a", "b"], true).expect("rig");
    let be = rig.backend();
    assert!(matches!(
        be.start_scheduler(SchedConfig::default()),
        Err(SchedError::NoBusyCounters)
    ));
    assert!(matches!(
        be.start_scheduler(SchedConfig {
            policy: Policy::None,
            watchdog_ms: Some(100),
            ..SchedConfig::default()
        }),
        Err(SchedError::NoBusyCounters)
    ));
    start(be, Policy::Sampling);
    let a = Tenant::spawn(rig.vm("a").unwrap(), TenantSpec::throttle(1, short)).unwrap();
    let b = Tenant::spawn(rig.vm("b").unwrap(), TenantSpec::throttle(2, long)).unwrap();
    std::thread::sleep(WARMUP * 2);
    let (a0, b0) = (a.completed(), b.completed());
    std::thread::sleep(WINDOW * 2);
    let (ga, gb) = ((a.completed() - a0) * short, (b.completed() - b0) * long);
    let share_a = ga as f64 / (ga + gb) as f64;
    let st = be.sched_stats();
    let api = be.gpu_shares(Duration::from_secs(1));
    println!("sampling: a {:.1} %, {st:?}", share_a * 100.0);
    a.stop().unwrap();
    b.stop().unwrap();
    assert!(st.samples >= 2, "{st:?}");
    assert!(api.estimated, "shares are estimates without counters");
    assert_near("sampling a", share_a, 0.5, 0.15);
}

#[test]
fn watchdog_kills_a_runaway_kernel_and_spares_everyone_else() {
    let _serial = serial();
    let _ = env_logger::builder().is_test(true).try_init();
    let rig = SchedRig::new("t-watchdog", &["a", "b"], false).expect("rig");
    let be = rig.backend();
    be.start_scheduler(SchedConfig {
        watchdog_ms: Some(100),
        ..SchedConfig::default()
    })
    .expect("fair with watchdog");
    // Well-behaved tenants: one in the other VM, one in the runaway's VM.
    let a = Tenant::spawn(rig.vm("a").unwrap(), TenantSpec::throttle(1, MS)).unwrap();
    let b_ok = Tenant::spawn(rig.vm("b").unwrap(), TenantSpec::throttle(22, 5 * MS)).unwrap();
    let vm_b = rig.vm("b").unwrap();
    while vm_b.next_event(Duration::from_millis(1)).is_some() {}
    let dev = Device::loopback(vm_b.clone(), 21).unwrap();
    let ctx = dev.create_context().unwrap();
    let mut ch = ctx.create_channel().unwrap();
    ch.launch(&KernelArgs::Spin { ns: 20_000 * MS }, [1, 1, 1])
        .unwrap();
    let fence = ch.submit().unwrap();
    let t0 = Instant::now();
    let err = ch
        .wait_timeout(fence, Duration::from_secs(10))
        .expect_err("the runaway must not complete");
    let took = t0.elapsed();
    assert!(
        matches!(
            err,
            GuestError::ChannelFault {
                code: ErrorCode::WatchdogKilled,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(took < Duration::from_secs(5), "killed after {took:?}");
    assert_eq!(ch.error().map(|e| e.0), Some(ErrorCode::WatchdogKilled));
    // The owner was told through the event queue.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut told = false;
    while Instant::now() < deadline && !told {
        if let Some(ev) = vm_b.next_event(Duration::from_millis(100)) {
            told = ev.kind == event::CHANNEL_ERROR
                && ev.value == ErrorCode::WatchdogKilled.as_u32()
                && u64::from(ev.channel) == ch.handle().0;
        }
    }
    assert!(told, "no watchdog event for the channel");
    // Everyone else keeps running.
    let (ka, kb) = (a.completed(), b_ok.completed());
    std::thread::sleep(Duration::from_millis(300));
    assert!(a.completed() > ka, "VM a stalled");
    assert!(b_ok.completed() > kb, "VM b's other process stalled");
    let st = be.sched_stats();
    assert_eq!(st.watchdog_kills, 1, "{st:?}");
    assert!(a.stop().unwrap().kernels > 0);
    // The dead channel still shows submitted work, but it must not count as a busy
    // sibling holding process 22 back: 22 drains its queue and stops.
    assert!(b_ok.stop().unwrap().kernels > 0);
    // 5 ms kernels under a 100 ms limit were never killed (checked by the count above).
}
