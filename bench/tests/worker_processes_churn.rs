//! Churn with a GPU worker per guest process (`--gpu-workers=process`, issue 30) leaves
//! nothing behind: connect/disconnect cycles of a VM with two guest processes (two
//! workers each time, one of them killed every fifth cycle), the VM disconnecting with
//! everything held, then the backend has the fds and threads it had before, no worker,
//! no child (live or zombie), and no object of the VM in its books. (A test binary of its
//! own: fd, thread and child counts are per process.)

use std::time::{Duration, Instant};

use vgpu_backend::VmLimits;
use vgpu_bench::proc_stats::{children, steady_fds_threads};
use vgpu_gpu_worker::{Granularity, LossKind, WorkerPool};
use vgpu_guest::{Context, Device, KernelArgs};
use vgpu_test_support::{worker_pool_from_env_as, Host};

const MIB: u64 = 1 << 20;

fn host() -> Host<WorkerPool> {
    let limits = VmLimits {
        vram_bytes: 16 * MIB,
        ..VmLimits::default()
    };
    let pool = worker_pool_from_env_as(64 * MIB, Granularity::Process);
    Host::on_workers("wproc-churn", pool, limits, &["vm"]).with_vm_mem(64 * MIB)
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

/// One connection of VM `vm` with two guest processes, each with a context, VRAM and a
/// finished kernel; `kill` kills the first process's worker before the disconnect. The
/// VM disconnects with everything held (the teardown destroys it).
fn two_process_connection(host: &Host<WorkerPool>, vm: &str, pid: u32, kill: bool) {
    let seen = host.backend.vm_stats(vm).map_or(0, |s| s.disconnects);
    let lvm = host.connect(vm);
    let devs = [pid, pid + 1].map(|p| Device::loopback(lvm.clone(), p).unwrap());
    let ctxs: Vec<Context> = devs.iter().map(|d| d.create_context().unwrap()).collect();
    let mut held = Vec::new();
    for (i, ctx) in ctxs.iter().enumerate() {
        let buf = ctx.alloc_vram(4096).unwrap();
        let mut ch = ctx.create_channel().unwrap();
        ch.launch(
            &KernelArgs::Memset {
                dst: buf.gpu_va(),
                len: 4096,
                pattern: pid + i as u32,
            },
            [1, 1, 1],
        )
        .unwrap();
        ch.finish().unwrap();
        held.push((buf, ch));
    }
    assert_eq!(host.worker(vm).workers().len(), 2, "a worker per process");
    if kill {
        host.worker(vm).kill_owner(pid);
    }
    lvm.disconnect();
    vgpu_bench::churn::wait_torn_down(host, vm, seen);
    drop((held, ctxs, devs));
    drop(lvm);
}

/// Connect/disconnect cycles of a VM with two guest processes, a worker killed every
/// fifth: the backend ends with the fds and threads it had, no worker running, no
/// child left (live or zombie), and nothing of the VM in its books.
#[test]
fn connect_disconnect_cycles_with_a_worker_per_process_leave_nothing_behind() {
    let host = host();
    two_process_connection(&host, "vm", 1, false);
    wait_for("the first workers to go", || {
        host.worker("vm").workers().is_empty()
    });
    let before = steady_fds_threads();
    const CYCLES: u32 = 100;
    for i in 1..=CYCLES {
        two_process_connection(&host, "vm", 10 * i, i % 5 == 0);
    }
    wait_for("the last workers to go", || {
        host.worker("vm").workers().is_empty()
    });
    let after = steady_fds_threads();
    let st = host.gpu.stats();
    let kids = children();
    println!(
        "{CYCLES} cycles, two processes each: (fds, threads) {before:?} -> {after:?}, workers {st:?}, children (live, zombies) {kids:?}"
    );
    assert_eq!(after, before, "(fds, threads) before and after");
    let starts = 2 * (u64::from(CYCLES) + 1);
    assert_eq!((st.started, st.lost, st.running), (starts, 20, 0), "{st:?}");
    assert_eq!(st.lost_as(LossKind::Killed), 20, "{st:?}");
    assert_eq!(kids, (0, 0), "no worker, no zombie, no orphan");
    let s = host.backend.vm_stats("vm").unwrap();
    assert_eq!((s.contexts, s.channels, s.vram_bytes), (0, 0, 0), "{s:?}");
}
