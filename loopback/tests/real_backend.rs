//! The loopback frontend against the real `vgpu-backend` with the sim GPU.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vgpu_backend::{VgpuBackend, VmLimits};
use vgpu_host_shim::{SimConfig, SimGpu};
use vgpu_loopback::{LoopbackConfig, LoopbackVm};
use vgpu_protocol::device::{APERTURE_OFFSET, CHANNEL_SLOTS, SHM_SIZE};
use vgpu_protocol::request::{decode_reply, Op, ReplyBody, Request};
use vgpu_protocol::PROTOCOL_VERSION;

fn socket(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("vgpu-vmm-real-{}-{name}.sock", std::process::id()))
}

fn call(vm: &LoopbackVm, pid: u32, ctx: u32, op: Op) -> ReplyBody {
    let req = Request { pid, ctx, op };
    let reply = vm.request(&req.encode()).unwrap();
    decode_reply(req.opcode(), &reply)
        .unwrap()
        .unwrap_or_else(|code| panic!("{req:?} failed: {code:?}"))
}

#[test]
fn get_info_and_aperture_through_real_backend() {
    let _ = env_logger::builder().is_test(true).try_init();
    let gpu = SimGpu::new(SimConfig::default()).unwrap();
    let backend = VgpuBackend::new(gpu, VmLimits::default());
    let path = socket("vm0");
    backend.serve_vm("vm0", &path).unwrap();

    let vm = LoopbackVm::connect(&path, LoopbackConfig::with_mem(64 << 20)).unwrap();
    let cfg = vm.config().unwrap();
    assert_eq!(cfg.version, PROTOCOL_VERSION);
    assert_eq!(cfg.aperture_offset, APERTURE_OFFSET);
    assert_eq!(vm.shm_len(), SHM_SIZE);

    let ReplyBody::Info(info) = call(&vm, 100, 0, Op::GetInfo) else {
        panic!("not an info reply");
    };
    assert_eq!(info.version, PROTOCOL_VERSION);
    assert!(info.channel_slots >= 1 && info.channel_slots <= CHANNEL_SLOTS);

    // VRAM through the BAR aperture: a real SHMEM_MAP round trip.
    let ReplyBody::Context { ctx, .. } = call(&vm, 100, 0, Op::CreateContext) else {
        panic!("not a context reply");
    };
    let ReplyBody::Mem { mem, .. } = call(
        &vm,
        100,
        ctx,
        Op::AllocVram {
            size: 64 << 10,
            align: 4096,
        },
    ) else {
        panic!("not a mem reply");
    };
    let maps = vm.shmem_maps();
    let ReplyBody::Aperture { offset } = call(&vm, 100, ctx, Op::MapAperture { mem }) else {
        panic!("not an aperture reply");
    };
    assert_eq!(vm.shmem_maps(), maps + 1);
    assert!(offset >= APERTURE_OFFSET && offset + (64 << 10) <= SHM_SIZE);
    let p = vm.shm_base().wrapping_add(offset as usize);
    // SAFETY: the backend mapped 64 KiB of VRAM writable at `offset` (reply sent after
    // the frontend acked the SHMEM_MAP).
    unsafe {
        p.write_volatile(0x5a);
        p.add((64 << 10) - 1).write_volatile(0xa5);
    }
    call(&vm, 100, ctx, Op::UnmapAperture { mem });
    let ReplyBody::Aperture { offset: o2 } = call(&vm, 100, ctx, Op::MapAperture { mem }) else {
        panic!("not an aperture reply");
    };
    let p2 = vm.shm_base().wrapping_add(o2 as usize);
    // SAFETY: mapped again (same VRAM) at `o2`.
    unsafe {
        assert_eq!(p2.read_volatile(), 0x5a);
        assert_eq!(p2.add((64 << 10) - 1).read_volatile(), 0xa5);
    }

    // Disconnect: the backend notices and tears the VM down.
    vm.disconnect();
    let t0 = Instant::now();
    while backend.vm_stats("vm0").is_some_and(|s| s.connected) {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "backend did not see the disconnect"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(vm);

    // The socket listens again: a second VM session works.
    let vm = Arc::new(LoopbackVm::connect(&path, LoopbackConfig::default()).unwrap());
    assert!(matches!(call(&vm, 1, 0, Op::GetInfo), ReplyBody::Info(_)));
    drop(vm);
    backend.shutdown();
    let _ = std::fs::remove_file(&path);
}
