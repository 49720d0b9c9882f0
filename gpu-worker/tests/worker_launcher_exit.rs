//! The launcher's end takes its workers with it: a launcher told to stop (the backend's
//! shutdown) kills and reaps its workers and is reaped itself. (A test binary of its own:
//! a process has one launcher.)

#[path = "../../host-shim/tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::cuda_cases::*;
use vgpu_gpu_worker::launcher::{start_process_launcher, stop_process_launcher};
use vgpu_gpu_worker::{WorkerGpu, WorkerOptions, WorkerProgram};
use vgpu_host_shim::Gpu;

const BIN: &str = env!("CARGO_BIN_EXE_vgpu-gpu-worker");

fn alive(pid: u32) -> bool {
    // A zombie is not alive: its state is Z.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit(')').next().map(|r| r.trim_start().to_string()))
        .is_some_and(|r| !r.starts_with('Z'))
}

fn exists(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

#[test]
fn a_stopped_launcher_takes_its_workers() {
    let base = WorkerProgram {
        program: BIN.into(),
        args: ["--gpu", "cuda-fake", "--vram-mib", "64"]
            .map(String::from)
            .to_vec(),
    };
    // From a thread that outlives the test's end (the launcher dies with it).
    let (tx, rx) = std::sync::mpsc::channel();
    let b = base.clone();
    std::thread::spawn(move || {
        tx.send(start_process_launcher(BIN.as_ref(), &["launcher".into()], &b).unwrap())
            .unwrap();
        loop {
            std::thread::park();
        }
    });
    let launcher = rx.recv().unwrap();
    let workers: Vec<_> = (0..3)
        .map(|_| WorkerGpu::start(&base, &WorkerOptions::default()).unwrap())
        .collect();
    every_kernel_on_vram(&workers[0]);
    let pids: Vec<u32> = workers.iter().map(|w| w.pid()).collect();
    assert!(pids.iter().all(|p| alive(*p)));
    stop_process_launcher();
    assert!(!exists(launcher), "the launcher was reaped");
    let t = Instant::now();
    while pids.iter().any(|p| exists(*p)) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "workers left: {pids:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // Their handles see them gone.
    for w in &workers {
        assert!(w
            .create_context(std::sync::Arc::new(common::TestSysMem::new(
                common::SYS_BASE,
                common::SYS_LEN
            )))
            .is_err());
    }
}
