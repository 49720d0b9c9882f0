//! Churn with a GPU worker per VM (issue 30) leaves nothing behind: 1,000 connect /
//! disconnect cycles of a VM whose worker is also killed every tenth cycle (100 worker
//! restarts), then the backend has the fds and threads it had before, exactly one live
//! worker, no zombie, and no object of the VM in its books. (A test binary of its own:
//! fd and thread counts are per process.)

use vgpu_backend::VmLimits;
use vgpu_bench::churn::one_connection;
use vgpu_bench::proc_stats::{children, steady_fds_threads};
use vgpu_gpu_worker::{PoolConfig, TurnSlots, WorkerOptions, WorkerPool, WorkerProgram};
use vgpu_host_shim::GpuInfo;
use vgpu_test_support::{backend_bin, Host};

const MIB: u64 = 1 << 20;

fn host() -> Host<WorkerPool> {
    let pool = WorkerPool::new(PoolConfig {
        program: WorkerProgram {
            program: backend_bin(None),
            args: ["worker", "--gpu", "cuda-fake"].map(String::from).to_vec(),
        },
        gpu: GpuInfo {
            name: "cuda-fake".into(),
            vram_bytes: 64 * MIB,
            compute_engines: 1,
            max_channels: 32,
            max_contexts: 16,
            has_busy_counters: true,
        },
        per_worker: (16, 8),
        granularity: vgpu_gpu_worker::Granularity::Vm,
        max_workers_per_vm: 1,
        // The GPU turn, as `vgpu-backend --gpu-workers` runs them by default.
        opts: WorkerOptions {
            turn: Some(TurnSlots::new(4000).expect("the GPU turn's page")),
            ..WorkerOptions::default()
        },
    });
    let limits = VmLimits {
        vram_bytes: 16 * MIB,
        ..VmLimits::default()
    };
    Host::on_workers("worker-churn", pool, limits, &["vm"]).with_vm_mem(64 * MIB)
}

#[test]
fn a_thousand_cycles_and_a_hundred_worker_restarts_leave_nothing_behind() {
    let host = host();
    // The first connection starts what lives as long as the backend (the launcher
    // thread, the VM's first worker).
    one_connection(&host, "vm", 1, || ());
    let before = steady_fds_threads();
    const CYCLES: u32 = 1_000;
    for i in 1..=CYCLES {
        one_connection(&host, "vm", 1 + i, || {
            if i % 10 == 0 {
                host.worker("vm").kill();
            }
        });
    }
    // The last cycle killed the worker: one more connection starts the next.
    one_connection(&host, "vm", CYCLES + 2, || ());
    let after = steady_fds_threads();
    let st = host.gpu.stats();
    let kids = children();
    println!(
        "{CYCLES} cycles with workers: (fds, threads) {before:?} -> {after:?}, workers {st:?}, children (live, zombies) {kids:?}"
    );
    assert_eq!(after, before, "(fds, threads) before and after");
    assert_eq!((st.started, st.lost, st.running), (101, 100, 1));
    assert_eq!(kids, (1, 0), "one live worker, no zombie, no orphan");
    let s = host.backend.vm_stats("vm").unwrap();
    assert_eq!((s.contexts, s.channels, s.vram_bytes), (0, 0, 0), "{s:?}");
}
