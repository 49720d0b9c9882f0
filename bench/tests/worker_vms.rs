//! A GPU worker process per VM (issue 30) behind the real backend and vhost-user sockets,
//! without a GPU: each worker is `vgpu-backend worker --gpu cuda-fake` (the whole `cuda`
//! GPU on the CPU stand-in for the driver). Loopback VMs run verified work; one VM's
//! worker is killed (what a GPU fault does to a process) under the other's load.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vgpu_backend::VmLimits;
use vgpu_gpu_worker::{PoolConfig, TurnSlots, WorkerOptions, WorkerPool, WorkerProgram};
use vgpu_guest::{Context, Device, KernelArgs};
use vgpu_host_shim::GpuInfo;
use vgpu_loopback::LoopbackVm;
use vgpu_protocol::reference;
use vgpu_test_support::{backend_bin, Host};

const MIB: u64 = 1 << 20;

fn pool() -> Arc<WorkerPool> {
    WorkerPool::new(PoolConfig {
        program: WorkerProgram {
            program: backend_bin(None),
            args: ["worker", "--gpu", "cuda-fake"].map(String::from).to_vec(),
        },
        gpu: GpuInfo {
            name: "cuda-fake".into(),
            vram_bytes: 256 * MIB,
            compute_engines: 1,
            max_channels: 64,
            max_contexts: 32,
            has_busy_counters: true,
        },
        per_worker: (32, 16),
        granularity: vgpu_gpu_worker::Granularity::Vm,
        max_workers_per_vm: 1,
        // The GPU turn, as `vgpu-backend --gpu-workers` runs them by default.
        opts: WorkerOptions {
            turn: Some(TurnSlots::new(4000).expect("the GPU turn's page")),
            ..WorkerOptions::default()
        },
    })
}

fn host(tag: &str, names: &[&str]) -> Host<WorkerPool> {
    let limits = VmLimits {
        vram_bytes: 64 * MIB,
        ..VmLimits::default()
    };
    Host::on_workers(tag, pool(), limits, names).with_vm_mem(128 * MIB)
}

/// One verified `y = a·x + y` round in VRAM.
fn saxpy_round(ctx: &Context, n: usize, seed: u32) -> Result<bool, String> {
    let x: Vec<f32> = (0..n).map(|i| ((i as u32 ^ seed) % 97) as f32).collect();
    let mut y: Vec<f32> = (0..n).map(|i| ((i as u32 + seed) % 13) as f32).collect();
    let e = |e: vgpu_guest::Error| e.to_string();
    let xb = ctx.alloc_vram(n as u64 * 4).map_err(e)?;
    let yb = ctx.alloc_vram(n as u64 * 4).map_err(e)?;
    xb.write_f32(0, &x).map_err(e)?;
    yb.write_f32(0, &y).map_err(e)?;
    let mut ch = ctx.create_channel().map_err(e)?;
    ch.launch(
        &KernelArgs::Saxpy {
            x: xb.gpu_va(),
            y: yb.gpu_va(),
            n: n as u64,
            a: 2.0,
        },
        [(n as u32).div_ceil(256), 1, 1],
    )
    .map_err(e)?;
    ch.finish().map_err(e)?;
    let got = yb.read_f32_vec(0, n).map_err(e)?;
    reference::saxpy(2.0, &x, &mut y);
    Ok(got == y)
}

fn connect(host: &Host<WorkerPool>, vm: &str, pid: u32) -> (Arc<LoopbackVm>, Device) {
    let lb = host.connect(vm);
    let dev = Device::loopback(lb.clone(), pid).unwrap();
    (lb, dev)
}

/// Each VM gets a worker process of its own; killing one VM's worker fails that VM's
/// work with a device error while the other VM's verified rounds go on without a
/// failure; after the VM reconnects (its state torn down) it gets a new worker and
/// verified work again.
#[test]
fn a_killed_worker_fails_its_vm_only_and_the_vm_comes_back_on_a_new_one() {
    let host = host("workers-kill", &["a", "b"]);
    let (lb_a, dev_a) = connect(&host, "a", 10);
    let (lb_b, dev_b) = connect(&host, "b", 20);
    let ctx_a = dev_a.create_context().unwrap();
    let ctx_b = dev_b.create_context().unwrap();
    assert_eq!(saxpy_round(&ctx_a, 1 << 16, 1), Ok(true));
    assert_eq!(saxpy_round(&ctx_b, 1 << 16, 2), Ok(true));
    let (wa, wb) = (host.worker("a"), host.worker("b"));
    let (pid_a, pid_b) = (wa.pid().unwrap(), wb.pid().unwrap());
    assert_ne!(pid_a, pid_b, "a worker per VM");
    assert_eq!(host.gpu.stats().running, 2);

    // b keeps verifying while a's worker dies.
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let b_loop = std::thread::spawn(move || {
        let (mut ok, mut bad) = (0u32, Vec::new());
        let mut seed = 100;
        while !s.load(Ordering::Relaxed) {
            match saxpy_round(&ctx_b, 1 << 14, seed) {
                Ok(true) => ok += 1,
                other => bad.push(format!("{other:?}")),
            }
            seed += 1;
        }
        (ok, bad)
    });
    std::thread::sleep(Duration::from_millis(300));
    wa.kill();
    let t = Instant::now();
    let failed = loop {
        match saxpy_round(&ctx_a, 1 << 14, 7) {
            Ok(true) if t.elapsed() < Duration::from_secs(10) => continue,
            other => break other,
        }
    };
    assert!(
        failed.is_err(),
        "a's work after its worker died: {failed:?}"
    );
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    let (ok, bad) = b_loop.join().unwrap();
    assert!(bad.is_empty(), "b failed {} rounds: {:?}", bad.len(), bad);
    assert!(ok >= 3, "b ran {ok} rounds");
    assert_eq!(wb.pid(), Some(pid_b), "b kept its worker");

    // a resets (reconnects): a new worker, verified work again.
    drop((ctx_a, dev_a));
    lb_a.disconnect();
    let (_lb_a, dev_a) = connect(&host, "a", 11);
    let ctx_a = dev_a.create_context().unwrap();
    assert_eq!(saxpy_round(&ctx_a, 1 << 16, 3), Ok(true));
    let new_pid = wa.pid().unwrap();
    assert_ne!(new_pid, pid_a, "a runs on a new worker");
    assert!(
        !std::path::Path::new(&format!("/proc/{pid_a}")).exists() || {
            // A zombie is not a leak until the pool drops it; it is reaped with its handle.
            std::fs::read_to_string(format!("/proc/{pid_a}/stat")).is_ok_and(|s| s.contains(") Z "))
        }
    );
    let st = host.gpu.stats();
    assert_eq!((st.started, st.lost, st.running), (3, 1, 2));
    assert_eq!(
        host.backend.worker_stats(),
        Some(st.clone()),
        "what /metrics shows"
    );
    assert_eq!(st.lost_as(vgpu_gpu_worker::LossKind::Killed), 1, "{st:?}");
    assert_eq!(st.lost_by_kind.iter().sum::<u64>(), 1, "{st:?}");

    // A disconnect ends the VM's request threads, not its worker: b reconnects to the
    // same worker (its parent-death signal follows the launcher thread).
    drop(dev_b);
    lb_b.disconnect();
    std::thread::sleep(Duration::from_millis(300));
    let (_lb_b, dev_b) = connect(&host, "b", 21);
    let ctx_b = dev_b.create_context().unwrap();
    assert_eq!(saxpy_round(&ctx_b, 1 << 16, 4), Ok(true));
    assert_eq!(wb.pid(), Some(pid_b), "b still on its first worker");
    assert_eq!(host.gpu.stats().started, 3);
}

/// A VM's worker starts when its frontend connects, not at its first context, so neither
/// the guest's first request nor an incoming live migration's downtime waits for a GPU
/// context to be made; the first context then lands on that worker.
#[test]
fn a_connected_vm_has_its_worker_before_its_first_context() {
    let host = host("workers-ahead", &["a"]);
    assert_eq!(host.gpu.stats().running, 0, "no worker before a frontend");
    let (_lb, dev) = connect(&host, "a", 10);
    let t = Instant::now();
    while host.gpu.stats().running == 0 {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "no worker started after the connect"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = host.worker("a").pid().expect("the worker's pid");
    let ctx = dev.create_context().unwrap();
    assert_eq!(saxpy_round(&ctx, 1 << 12, 5), Ok(true));
    assert_eq!(host.worker("a").pid(), Some(pid), "the context went to it");
    assert_eq!(host.gpu.stats().started, 1, "one start, not two");
}
