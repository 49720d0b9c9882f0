//! The `cuda` GPU on the CPU stand-in for the driver (no GPU needed), behind the real
//! backend and vhost-user sockets, with loopback VMs: VRAM is device memory the CPU cannot
//! map, so the backend refuses `MAP_APERTURE` and the runtime moves buffer bytes through
//! the copy engine; VRAM oversubscription evicts to host memory and swaps back.

use std::sync::Arc;
use std::time::{Duration, Instant};

use vgpu_backend::VmLimits;
use vgpu_guest::workloads::Workload;
use vgpu_guest::{Device, KernelArgs};
use vgpu_host_shim::cuda::{CudaConfig, FakeCudaGpu, FakeDevice};
use vgpu_host_shim::Gpu;
use vgpu_loopback::LoopbackVm;
use vgpu_protocol::reference;
use vgpu_test_support::Host;

const MIB: u64 = 1 << 20;

/// A [`Host`] on the fake `cuda` GPU with a loopback VM (256 MiB of guest RAM) connected
/// to each of its VMs; the VMs disconnect before the host shuts down.
struct Rig {
    vms: Vec<Arc<LoopbackVm>>,
    host: Host<dyn Gpu>,
}

impl Rig {
    fn new(tag: &str, vram: u64, limits: VmLimits, names: &[&str]) -> Rig {
        let gpu = FakeCudaGpu::with_device(
            Arc::new(FakeDevice::default()),
            CudaConfig {
                vram_bytes: vram,
                ..CudaConfig::default()
            },
        )
        .expect("fake cuda GPU");
        let host = Host::on_gpu(tag, gpu, limits, names).with_vm_mem(256 * MIB);
        let vms = names.iter().map(|n| host.connect(n)).collect();
        Rig { vms, host }
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        for vm in &self.vms {
            vm.disconnect();
        }
    }
}

fn floats(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 1024)
        .map(|v| v as f32 * 0.25)
        .collect()
}

/// Writes `x` and `y` into VRAM buffers, runs `y = a·x + y` on the GPU and returns
/// the result read back, with the CPU reference beside it.
fn saxpy_in_vram(
    ctx: &vgpu_guest::Context,
    x: &[f32],
    mut y: Vec<f32>,
    a: f32,
) -> (Vec<f32>, Vec<f32>, vgpu_guest::Buffer) {
    let n = x.len();
    let xb = ctx.alloc_vram(n as u64 * 4).unwrap();
    let yb = ctx.alloc_vram(n as u64 * 4).unwrap();
    xb.write_f32(0, x).unwrap();
    yb.write_f32(0, &y).unwrap();
    let mut ch = ctx.create_channel().unwrap();
    ch.launch(
        &KernelArgs::Saxpy {
            x: xb.gpu_va(),
            y: yb.gpu_va(),
            n: n as u64,
            a,
        },
        [(n as u32).div_ceil(256), 1, 1],
    )
    .unwrap();
    ch.finish().unwrap();
    let got = yb.read_f32_vec(0, n).unwrap();
    reference::saxpy(a, x, &mut y);
    (got, y, xb)
}

/// CPU stores and GPU reads agree on VRAM the CPU cannot map: a buffer larger than the
/// stager's two halves is written from the CPU, a kernel computes on it, and the CPU reads
/// the result back, bit-exactly.
#[test]
fn vram_without_a_cpu_view_is_staged_and_agrees_with_kernels() {
    let rig = Rig::new("cuda-fake-stage", 256 * MIB, VmLimits::default(), &["vm"]);
    let dev = Device::loopback(rig.vms[0].clone(), 7).unwrap();
    let ctx = dev.create_context().unwrap();
    let n = (20 * MIB / 4) as usize + 3;
    let x = floats(n, 1);
    let (got, y, xb) = saxpy_in_vram(&ctx, &x, floats(n, 2), 0.5);
    assert!(xb.is_staged().unwrap(), "cuda VRAM must not be CPU-mapped");
    assert!(
        got == y,
        "saxpy over staged VRAM differs from the CPU reference"
    );
    // Unaligned partial access inside a staged buffer.
    xb.write(4097, &[1, 2, 3, 4, 5]).unwrap();
    let mut back = [0u8; 7];
    xb.read(4096, &mut back).unwrap();
    let x0 = x[1024].to_le_bytes()[0];
    assert_eq!(back, [x0, 1, 2, 3, 4, 5, x[1025].to_le_bytes()[2]]);
}

/// Every shared workload runs bit-exactly from a loopback VM on the cuda GPU.
#[test]
fn every_workload_runs_bit_exactly_in_a_vm() {
    let rig = Rig::new("cuda-fake-wl", 256 * MIB, VmLimits::default(), &["vm"]);
    let dev = Device::loopback(rig.vms[0].clone(), 9).unwrap();
    let ctx = dev.create_context().unwrap();
    for name in Workload::NAMES {
        let w = Workload::by_name(name, true).unwrap();
        let r = w.run(&ctx).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(r.verified, "{name} not verified");
    }
}

/// Two VMs that together want twice the GPU's VRAM: chunks are evicted to host memory
/// (device→host copies) and swapped back while both keep verifying their results.
#[test]
fn oversubscribed_vram_evicts_to_host_memory_and_results_stay_exact() {
    let limits = VmLimits {
        vram_bytes: 48 * MIB,
        swap_bytes: 48 * MIB,
        ..VmLimits::default()
    };
    let rig = Rig::new("cuda-fake-swap", 64 * MIB, limits, &["a", "b"]);
    let threads: Vec<_> = rig
        .vms
        .iter()
        .enumerate()
        .map(|(i, vm)| {
            let vm = vm.clone();
            std::thread::spawn(move || {
                let dev = Device::loopback(vm, 100 + i as u32).unwrap();
                let ctx = dev.create_context().unwrap();
                let n = (20 * MIB / 4) as usize;
                let t0 = Instant::now();
                let mut round = 0u32;
                while t0.elapsed() < Duration::from_secs(4) || round < 3 {
                    let x = floats(n, round);
                    let (got, y, _) = saxpy_in_vram(&ctx, &x, floats(n, round + 7), 2.0);
                    assert!(got == y, "VM {i} round {round}: result differs");
                    round += 1;
                }
                round
            })
        })
        .collect();
    for t in threads {
        assert!(t.join().unwrap() >= 3);
    }
    let moved: u64 = ["a", "b"]
        .iter()
        .map(|n| {
            let s = rig.host.backend.vram_stats(n).unwrap().vm;
            s.evictions + s.spilled_chunks
        })
        .sum();
    assert!(
        moved > 0,
        "no chunk ever left VRAM: the test did not oversubscribe"
    );
}
