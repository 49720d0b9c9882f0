//! A GPU worker per guest process (`vgpu-backend --gpu-workers=process`, issue 30) behind
//! the real backend and vhost-user sockets, without a GPU: each worker is `vgpu-backend
//! worker --gpu cuda-fake` (`VGPU_WORKER_GPU=cuda` on a GPU). Two processes of one VM get
//! two workers; killing one (what a GPU fault does to a process) fails that process's
//! contexts only, while the VM's other process and another VM keep verifying; workers go
//! when their process's last object does and when the VM disconnects. Churn:
//! `worker_processes_churn.rs`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vgpu_backend::VmLimits;
use vgpu_gpu_worker::{Granularity, LossKind, WorkerPool};
use vgpu_guest::{Context, Device, Error, KernelArgs};
use vgpu_protocol::{reference, ErrorCode};
use vgpu_test_support::{worker_pool_from_env_as, Host};

const MIB: u64 = 1 << 20;

fn host(tag: &str, names: &[&str]) -> Host<WorkerPool> {
    let _ = env_logger::builder().is_test(true).try_init();
    let limits = VmLimits {
        vram_bytes: 64 * MIB,
        ..VmLimits::default()
    };
    let pool = worker_pool_from_env_as(256 * MIB, Granularity::Process);
    Host::on_workers(tag, pool, limits, names).with_vm_mem(128 * MIB)
}

/// One verified `y = a·x + y` round in VRAM.
fn saxpy_round(ctx: &Context, n: usize, seed: u32) -> Result<bool, Error> {
    let x: Vec<f32> = (0..n).map(|i| ((i as u32 ^ seed) % 97) as f32).collect();
    let mut y: Vec<f32> = (0..n).map(|i| ((i as u32 + seed) % 13) as f32).collect();
    let xb = ctx.alloc_vram(n as u64 * 4)?;
    let yb = ctx.alloc_vram(n as u64 * 4)?;
    xb.write_f32(0, &x)?;
    yb.write_f32(0, &y)?;
    let mut ch = ctx.create_channel()?;
    ch.launch(
        &KernelArgs::Saxpy {
            x: xb.gpu_va(),
            y: yb.gpu_va(),
            n: n as u64,
            a: 2.0,
        },
        [(n as u32).div_ceil(256), 1, 1],
    )?;
    ch.finish()?;
    let got = yb.read_f32_vec(0, n)?;
    reference::saxpy(2.0, &x, &mut y);
    Ok(got == y)
}

/// Verified rounds on `ctx` until `stop`: (rounds verified, what failed).
fn verify_until(
    ctx: Context,
    stop: Arc<AtomicBool>,
    seed: u32,
) -> JoinHandle<(u32, Vec<String>, Context)> {
    std::thread::spawn(move || {
        let (mut ok, mut bad) = (0u32, Vec::new());
        let mut s = seed;
        while !stop.load(Ordering::Relaxed) {
            match saxpy_round(&ctx, 1 << 14, s) {
                Ok(true) => ok += 1,
                other => bad.push(format!("{other:?}")),
            }
            s += 1;
        }
        (ok, bad, ctx)
    })
}

/// Whether process `pid` is gone (reaped: not even a zombie).
fn gone(pid: u32) -> bool {
    !std::path::Path::new(&format!("/proc/{pid}")).exists()
}

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "waited 10 s for {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn each_guest_process_gets_a_worker_and_a_killed_one_fails_that_process_only() {
    let host = host("wproc-kill", &["a", "b"]);
    let lb_a = host.connect("a");
    let lb_b = host.connect("b");
    let a10 = Device::loopback(lb_a.clone(), 10).unwrap();
    let a11 = Device::loopback(lb_a.clone(), 11).unwrap();
    let b20 = Device::loopback(lb_b.clone(), 20).unwrap();
    let (wa, wb) = (host.worker("a"), host.worker("b"));
    assert!(
        wa.workers().is_empty(),
        "no worker before a process's first object"
    );

    let c10 = a10.create_context().unwrap();
    let c11 = a11.create_context().unwrap();
    let c20 = b20.create_context().unwrap();
    for (c, seed) in [(&c10, 1), (&c11, 2), (&c20, 3)] {
        assert_eq!(saxpy_round(c, 1 << 16, seed).ok(), Some(true));
    }
    let (p10, p11) = (wa.pid_of(10).unwrap(), wa.pid_of(11).unwrap());
    let p20 = wb.pid_of(20).unwrap();
    assert_ne!(p10, p11, "a worker per guest process");
    assert_eq!(
        wa.workers(),
        vec![(10, p10, true), (11, p11, true)],
        "VM a's workers by process"
    );
    assert_eq!(host.gpu.stats().running, 3);
    // A process's second context goes to its worker.
    let c10b = a10.create_context().unwrap();
    assert_eq!(saxpy_round(&c10b, 1 << 12, 4).ok(), Some(true));
    assert_eq!(wa.pid_of(10), Some(p10));
    drop(c10b);
    assert_eq!(wa.pid_of(10), Some(p10), "still held by its first context");

    // Process 11 of the same VM and VM b keep verifying while process 10's worker dies.
    let stop = Arc::new(AtomicBool::new(false));
    let l11 = verify_until(c11, stop.clone(), 100);
    let l20 = verify_until(c20, stop.clone(), 200);
    std::thread::sleep(Duration::from_millis(300));
    wa.kill_owner(10);
    let t = Instant::now();
    let failed = loop {
        match saxpy_round(&c10, 1 << 14, 7) {
            Ok(true) if t.elapsed() < Duration::from_secs(10) => continue,
            other => break other,
        }
    };
    let err = failed.expect_err("process 10's work after its worker died");
    assert_eq!(
        err.code(),
        ErrorCode::DeviceLost,
        "a clear device error: {err}"
    );
    // While its lost worker's objects are held, a new one is refused the same way.
    let again = a10.create_context().map(|_| ()).unwrap_err();
    assert_eq!(again.code(), ErrorCode::DeviceLost, "{again}");
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    let (ok11, bad11, c11) = l11.join().unwrap();
    let (ok20, bad20, c20) = l20.join().unwrap();
    assert!(bad11.is_empty(), "process 11 failed: {bad11:?}");
    assert!(bad20.is_empty(), "VM b failed: {bad20:?}");
    assert!(ok11 >= 3 && ok20 >= 3, "rounds: {ok11}, {ok20}");
    assert_eq!(wa.pid_of(11), Some(p11), "process 11 kept its worker");
    assert_eq!(wb.pid_of(20), Some(p20), "VM b kept its worker");

    // Process 10 lets go of its context: its lost worker is counted and forgotten, and
    // its next context runs on a new worker.
    drop(c10);
    let c10 = a10.create_context().unwrap();
    assert_eq!(saxpy_round(&c10, 1 << 16, 8).ok(), Some(true));
    let p10_new = wa.pid_of(10).unwrap();
    assert_ne!(p10_new, p10, "process 10 runs on a new worker");
    wait_for("the killed worker's reaping", || gone(p10));
    let st = host.gpu.stats();
    assert_eq!((st.started, st.lost, st.running), (4, 1, 3), "{st:?}");
    assert_eq!(st.granularity, Granularity::Process);
    let (sa, sb) = (&st.vms[0], &st.vms[1]);
    assert_eq!(
        (sa.vm.as_str(), sa.started, sa.lost, sa.running),
        ("a", 3, 1, 2)
    );
    assert_eq!(
        (sb.vm.as_str(), sb.started, sb.lost, sb.running),
        ("b", 1, 0, 1)
    );
    assert_eq!(st.lost_as(LossKind::Killed), 1, "{st:?}");
    assert_eq!(host.backend.worker_stats(), Some(st), "what /metrics shows");

    // Process 11's last context goes: so does its worker.
    drop(c11);
    wait_for("process 11's worker to go", || wa.pid_of(11).is_none());
    wait_for("process 11's worker to be reaped", || gone(p11));
    assert_eq!(wa.workers(), vec![(10, p10_new, true)]);

    // VM a disconnects with process 10's context held: its worker goes with the
    // teardown; VM b runs on.
    let seen = host.backend.vm_stats("a").unwrap().disconnects;
    lb_a.disconnect();
    wait_for("VM a's teardown", || {
        host.backend.vm_stats("a").unwrap().disconnects > seen
    });
    wait_for("VM a's workers to go", || wa.workers().is_empty());
    wait_for("VM a's last worker to be reaped", || gone(p10_new));
    drop((c10, a10, a11));
    assert_eq!(saxpy_round(&c20, 1 << 16, 9).ok(), Some(true));
    assert_eq!(wb.pid_of(20), Some(p20));
    let st = host.gpu.stats();
    assert_eq!((st.started, st.lost, st.running), (4, 1, 1), "{st:?}");
}

/// A VM gets at most `max_workers_per_vm` workers (8 here): a further process's first
/// context is refused with `LIMIT_EXCEEDED` (a guest cannot take a CUDA context and the
/// VM's VRAM quota in device memory per pid it makes up), and gets one once another
/// process has let go of its worker.
#[test]
fn a_vm_gets_at_most_its_cap_of_workers() {
    let host = host("wproc-cap", &["a"]);
    let lb = host.connect("a");
    let mut held = Vec::new();
    for pid in 1..=8 {
        let dev = Device::loopback(lb.clone(), pid).unwrap();
        let ctx = dev.create_context().unwrap();
        held.push((ctx, dev));
    }
    assert_eq!(host.worker("a").workers().len(), 8);
    let ninth = Device::loopback(lb.clone(), 9).unwrap();
    let refused = ninth.create_context().map(|_| ()).unwrap_err();
    assert_eq!(refused.code(), ErrorCode::LimitExceeded, "{refused}");
    // A process that has a worker still makes more contexts on it.
    let more = held[0].1.create_context().unwrap();
    drop(more);
    held.remove(1);
    wait_for("process 2's worker to go", || {
        host.worker("a").pid_of(2).is_none()
    });
    let ctx = ninth.create_context().unwrap();
    assert_eq!(saxpy_round(&ctx, 1 << 12, 9).ok(), Some(true));
    assert_eq!(host.worker("a").workers().len(), 8);
}
