//! The doorbell (protocol.md, "Doorbell") end to end: `vgpu-backend` on vhost-user
//! sockets, loopback VMs, guest processes on the runtime. The GPU's front end is set to
//! sleep up to a minute once idle, so a submission that runs within seconds was woken by
//! a doorbell: the guest's own (direct channels), or the backend's after it stored the
//! GP_PUT (forwarded SUBMIT).

use std::sync::Arc;
use std::time::{Duration, Instant};

use vgpu_backend::VmLimits;
use vgpu_guest::{Context, Device, KernelArgs};
use vgpu_host_shim::cuda::CudaConfig;
use vgpu_host_shim::sim::{SimConfig, SimGpu};
use vgpu_host_shim::Gpu;
use vgpu_loopback::LoopbackVm;
use vgpu_test_support::{fake_cuda_gpu, Host};

/// Longer than any test may take: a front end that is not woken serves nothing in time.
const SLEEP_NS: u64 = 60_000_000_000;
/// Far beyond a doorbell's wake-up, far below the sleep.
const PROMPT: Duration = Duration::from_secs(5);

fn sim() -> Arc<dyn Gpu> {
    SimGpu::new(SimConfig {
        vram_bytes: 128 << 20,
        doorbell_sleep_ns: SLEEP_NS,
        ..SimConfig::default()
    })
    .expect("sim GPU")
}

fn cuda_fake() -> Arc<dyn Gpu> {
    fake_cuda_gpu(CudaConfig {
        vram_bytes: 128 << 20,
        doorbell_sleep_ns: SLEEP_NS,
        ..CudaConfig::default()
    })
}

/// Rounds of: let the front end fall asleep, submit a memset, wait for it. Returns the
/// slowest round.
fn rounds_after_idle(ctx: &Context, remoting: bool) -> Duration {
    let buf = ctx.alloc_host(4096).unwrap();
    let mut ch = ctx.create_channel().unwrap();
    ch.set_api_remoting(remoting);
    let mut slowest = Duration::ZERO;
    for i in 1..=5u32 {
        // Past the front end's busy poll (a fraction of a millisecond): asleep.
        std::thread::sleep(Duration::from_millis(30));
        let t = Instant::now();
        ch.launch(
            &KernelArgs::Memset {
                dst: buf.gpu_va(),
                len: 4,
                pattern: i,
            },
            [1, 1, 1],
        )
        .unwrap();
        ch.finish().unwrap();
        slowest = slowest.max(t.elapsed());
        assert_eq!(buf.read_u32_vec(0, 1).unwrap(), vec![i]);
    }
    slowest
}

fn run(tag: &str, gpu: Arc<dyn Gpu>, forwarded: bool) -> (Duration, Arc<LoopbackVm>) {
    let host = Host::on_gpu(tag, gpu, VmLimits::default(), &["vm"]);
    let vm = if forwarded {
        host.connect_forwarded("vm")
    } else {
        host.connect("vm")
    };
    let dev = Device::loopback(vm.clone(), 7).unwrap();
    let ctx = dev.create_context().unwrap();
    let slowest = rounds_after_idle(&ctx, forwarded);
    drop(ctx);
    drop(dev);
    vm.disconnect();
    (slowest, vm)
}

#[test]
fn a_guest_rings_a_sleeping_front_end_and_its_work_runs_at_once() {
    for (name, gpu) in [("sim", sim()), ("cuda-fake", cuda_fake())] {
        let (slowest, vm) = run(&format!("bell-{name}"), gpu, false);
        assert!(
            slowest < PROMPT,
            "{name}: a submission after idle took {slowest:?}"
        );
        assert!(
            vm.doorbells() >= 5,
            "{name}: every submission after idle rang ({} rings)",
            vm.doorbells()
        );
    }
}

#[test]
fn the_backend_rings_for_a_forwarded_submission() {
    let (slowest, vm) = run("bell-fwd", sim(), true);
    assert!(
        slowest < PROMPT,
        "a forwarded submission after idle took {slowest:?}"
    );
    assert_eq!(
        vm.doorbells(),
        0,
        "the guest had no page to see the flag in"
    );
}
