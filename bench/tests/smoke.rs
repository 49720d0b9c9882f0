//! The `vgpu-smoke` checks on the transports that run on a host: natively, and over a
//! real `vgpu-backend` through a loopback VM (guest-RAM buffers as guest-physical
//! scatter-gather lists, control pages and apertures in the BAR window). In a VM the same
//! checks run over `/dev/vgpu` (`ci/rig/l2-driver.sh`). Each check compares with the CPU
//! reference, so these fail if a kernel, a mapping or a transport is wrong.

use std::time::{Duration, Instant};

use vgpu_backend::{VgpuBackend, VmLimits};
use vgpu_guest::Device;
use vgpu_guest_tools::smoke;
use vgpu_host_shim::{SimConfig, SimGpu};
use vgpu_vmm::loopback::{LoopbackConfig, LoopbackVm};

fn assert_all_pass(checks: &[smoke::Check], blocking_expected: bool) {
    let failed: Vec<_> = checks.iter().filter(|c| c.failure.is_some()).collect();
    assert!(failed.is_empty(), "failed: {failed:#?}");
    // Every builtin kernel on both kinds of memory (10 kernels + copy engine each).
    for kind in ["vram", "host"] {
        for k in [
            "empty",
            "spin",
            "memset",
            "memcpy",
            "saxpy",
            "sgemm",
            "reduce_sum",
            "checksum",
            "stencil2d",
            "timestamp",
            "copy_engine",
        ] {
            let name = format!("{kind}/{k}");
            assert!(
                checks.iter().any(|c| c.name == name && c.passed()),
                "{name} did not pass: {checks:#?}"
            );
        }
    }
    let wait = checks
        .iter()
        .find(|c| c.name == "wait/notify_and_fence")
        .expect("wait check");
    // Blocking waits need a kernel driver; host transports refuse them.
    assert_eq!(wait.skipped, !blocking_expected);
}

#[test]
fn smoke_native() {
    let gpu = SimGpu::new(SimConfig::default()).unwrap();
    let dev = Device::native(gpu).unwrap();
    assert_all_pass(&smoke::run(&dev, 3), false);
}

#[test]
fn smoke_loopback() {
    let gpu = SimGpu::new(SimConfig::default()).unwrap();
    let backend = VgpuBackend::new(gpu, VmLimits::default());
    let dir = std::env::temp_dir().join(format!("vgpu-smoke-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("vm.sock");
    backend.serve_vm("vm", &sock).unwrap();
    let t0 = Instant::now();
    let vm = loop {
        match LoopbackVm::connect(
            &sock,
            LoopbackConfig {
                mem_bytes: 64 << 20,
            },
        ) {
            Ok(v) => break v,
            Err(e) if t0.elapsed() > Duration::from_secs(10) => panic!("connect: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    let dev = Device::loopback(vm, 42).unwrap();
    assert_all_pass(&smoke::run(&dev, 5), false);
    let _ = std::fs::remove_dir_all(&dir);
}
