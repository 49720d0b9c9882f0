//! The `vgpu-smoke` checks on the transports that run on a host: natively, and over a
//! real `vgpu-backend` through a loopback VM (guest-RAM buffers as guest-physical
//! scatter-gather lists, control pages and apertures in the BAR window). In a VM the same
//! checks run over `/dev/vgpu` (`ci/rig/l2-driver.sh`). Each check compares with the CPU
//! reference, so these fail if a kernel, a mapping or a transport is wrong.

use vgpu_backend::VmLimits;
use vgpu_guest::Device;
use vgpu_guest_tools::smoke;
use vgpu_host_shim::{SimConfig, SimGpu};
use vgpu_test_support::Host;

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
    let host = Host::with_gpu("smoke", gpu, VmLimits::default(), &["vm"]).with_vm_mem(64 << 20);
    let dev = Device::loopback(host.connect("vm"), 42).unwrap();
    assert_all_pass(&smoke::run(&dev, 5), false);
}
