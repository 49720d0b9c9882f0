//! Workers started and dropped leave no process and no file descriptor behind (a test
//! binary of its own: other tests' fds would move the count).

#[path = "../../host-shim/tests/common/mod.rs"]
mod common;

use std::sync::Arc;

use common::kernels::T;
use common::*;
use vgpu_gpu_worker::{WorkerGpu, WorkerOptions, WorkerProgram};

fn worker() -> Arc<WorkerGpu> {
    let prog = WorkerProgram {
        program: env!("CARGO_BIN_EXE_vgpu-gpu-worker").into(),
        args: [
            "--gpu",
            "cuda-fake",
            "--vram-mib",
            "16",
            "--max-channels",
            "16",
        ]
        .map(String::from)
        .to_vec(),
    };
    WorkerGpu::start(&prog, &WorkerOptions::default()).unwrap()
}

fn process_exists(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[test]
fn workers_come_and_go_without_leaks() {
    // Warm up whatever the first start opens for good (the logger, the test harness).
    drop(worker());
    let fds = open_fds();
    let mut pids = Vec::new();
    for i in 0..20 {
        let g = worker();
        pids.push(g.pid());
        if i % 2 == 0 {
            let p = Proc::new(&g, SYS_BASE);
            let mut ch = p.channel(0);
            let m = ch.launch(&spin(1000));
            ch.submit(&[m]);
            ch.wait_idle(T).unwrap();
        }
    }
    assert_eq!(open_fds(), fds, "every worker's fds closed");
    for pid in pids {
        assert!(!process_exists(pid), "worker {pid} reaped");
    }
}
