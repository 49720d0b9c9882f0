//! Blocking fence waits (protocol.md, "Blocking fence waits"; issue 34) end to end:
//! `vgpu-backend` on a vhost-user socket, a loopback VM, guest processes on the runtime.
//! A wait that outlasts its spin, yields and naps (10 ms) arms its channel's fence
//! wake-up and sleeps;
//! the GPU's front end sends a `FENCE` event when REF reaches the armed value and the
//! loopback's interrupt thread wakes the sleeper. Without that event every sleep would
//! run out (the waiter re-checks every 20 ms), so a wait whose sleep an event ended was
//! woken by the GPU: nothing else sends events here. The kernels run 25 ms: the wait
//! blocks from 10 ms on, its sleep would run out at 30 ms; a wait may still see its REF
//! when a sleep ends just before the event comes (a loaded machine), so two of three
//! waits woken is asked for.

use std::sync::Arc;

use vgpu_backend::VmLimits;
use vgpu_guest::{Channel, Device, KernelArgs};
use vgpu_host_shim::cuda::CudaConfig;
use vgpu_host_shim::sim::{SimConfig, SimGpu};
use vgpu_host_shim::Gpu;
use vgpu_loopback::LoopbackVm;
use vgpu_test_support::{fake_cuda_gpu, worker_pool_from_env, Host};

/// Each kernel's run: past the wait's spin, yields and naps (10 ms), short of its first
/// sleep's end (30 ms).
const SPIN_NS: u64 = 25_000_000;

fn sim() -> Arc<dyn Gpu> {
    SimGpu::new(SimConfig {
        vram_bytes: 128 << 20,
        ..SimConfig::default()
    })
    .expect("sim GPU")
}

fn cuda_fake() -> Arc<dyn Gpu> {
    fake_cuda_gpu(CudaConfig {
        vram_bytes: 128 << 20,
        ..CudaConfig::default()
    })
}

/// Runs a long kernel on `ch` and waits for it; asserts the wait slept; whether an event
/// woke it.
fn woken_wait(name: &str, vm: &LoopbackVm, ch: &mut Channel) -> bool {
    let (sleeps, woken) = ch.fence_sleeps();
    let events = vm.event_count();
    ch.launch(&KernelArgs::Spin { ns: SPIN_NS }, [1, 1, 1])
        .unwrap();
    let f = ch.submit().unwrap();
    ch.wait(f).unwrap();
    let (sleeps, woken) = (ch.fence_sleeps().0 - sleeps, ch.fence_sleeps().1 - woken);
    assert!(sleeps >= 1, "{name}: the wait never slept");
    assert!(
        woken <= 1,
        "{name}: {sleeps} sleeps, {woken} ended by an event"
    );
    woken == 1 && vm.event_count() > events
}

/// Twice on one channel (armed, woken, disarmed, armed again), then on another.
fn three_woken_waits(name: &str, vm: Arc<LoopbackVm>) {
    let dev = Device::loopback(vm.clone(), 7).unwrap();
    let ctx = dev.create_context().unwrap();
    let mut ch = ctx.create_channel().unwrap();
    let mut other = ctx.create_channel().unwrap();
    let woken = [
        woken_wait(name, &vm, &mut ch),
        woken_wait(name, &vm, &mut ch),
        woken_wait(name, &vm, &mut other),
    ];
    assert!(
        woken.iter().filter(|&&w| w).count() >= 2,
        "{name}: waits woken by an event: {woken:?}"
    );
    drop((ch, other, ctx, dev));
    vm.disconnect();
}

#[test]
fn a_long_fence_wait_sleeps_until_the_gpu_wakes_it() {
    for (name, gpu) in [("sim", sim()), ("cuda-fake", cuda_fake())] {
        let host = Host::on_gpu(
            &format!("fence-wake-{name}"),
            gpu,
            VmLimits::default(),
            &["vm"],
        );
        three_woken_waits(name, host.connect("vm"));
    }
}

/// The same through a GPU worker process: the wake-up crosses the worker's event socket.
#[test]
fn a_fence_wake_up_comes_through_a_gpu_worker() {
    let pool = worker_pool_from_env(256 << 20);
    let host = Host::on_workers("fence-wake-worker", pool, VmLimits::default(), &["vm"])
        .with_vm_mem(128 << 20);
    three_woken_waits("worker", host.connect("vm"));
}
