//! One VM connection's life, as the churn tests repeat it: a loopback VM connects, a
//! process runs a kernel on a VRAM buffer, and the VM goes; returns once the backend has
//! torn the connection down. Panics on any failure (a test fixture).

use std::time::{Duration, Instant};

use vgpu_guest::{Device, KernelArgs};
use vgpu_host_shim::Gpu;
use vgpu_test_support::Host;

/// Connects to `vm`, runs a memset as guest process `pid`, calls `before_leaving` (with
/// the process's objects still alive), disconnects and waits for the teardown.
pub fn one_connection<G: Gpu + ?Sized>(
    host: &Host<G>,
    vm: &str,
    pid: u32,
    before_leaving: impl FnOnce(),
) {
    let seen = host.backend.vm_stats(vm).map_or(0, |s| s.disconnects);
    let lvm = host.connect(vm);
    {
        let dev = Device::loopback(lvm.clone(), pid).unwrap();
        let ctx = dev.create_context().unwrap();
        let buf = ctx.alloc_vram(4096).unwrap();
        let mut ch = ctx.create_channel().unwrap();
        ch.launch(
            &KernelArgs::Memset {
                dst: buf.gpu_va(),
                len: 4096,
                pattern: pid,
            },
            [1, 1, 1],
        )
        .unwrap();
        ch.finish().unwrap();
        before_leaving();
    }
    lvm.disconnect();
    drop(lvm);
    // Torn down, not merely seen closing: `connected` drops before the teardown runs.
    wait_torn_down(host, vm, seen);
}

/// Waits (up to 10 s) until the backend has torn down `vm`'s connection: its disconnect
/// count has passed `seen`, the count from before the connection.
pub fn wait_torn_down<G: Gpu + ?Sized>(host: &Host<G>, vm: &str, seen: u64) {
    let t0 = Instant::now();
    while host
        .backend
        .vm_stats(vm)
        .is_some_and(|s| s.disconnects <= seen)
        && t0.elapsed() < Duration::from_secs(10)
    {
        std::thread::sleep(Duration::from_millis(2));
    }
}
