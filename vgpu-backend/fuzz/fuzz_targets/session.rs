//! `Session::handle` fed arbitrary request sequences: no input may panic, and after the
//! session is torn down the GPU holds nothing of it.
//!
//! Input: records `[op, pid, ctx, flags, len, body[len]]`. A record becomes a request with
//! a well-formed header (op, small pid and ctx) and the fuzzer's body bytes, or — when
//! flags bit 1 is set — the raw bytes `[op, pid, ctx, body..]` as they are. Flags bit 0
//! makes the fake frontend refuse SHMEM_MAP/UNMAP for that request.
#![no_main]

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use vgpu_backend::{GuestMemory, Session, ShmError, ShmMapper, VmLimits};
use vgpu_host_shim::{Gpu, SimConfig, SimGpu};
use vgpu_protocol::request::decode_reply;
use vm_memory::GuestAddress;

#[derive(Default)]
struct Frontend {
    refuse: AtomicBool,
}

impl ShmMapper for Frontend {
    fn map(&self, _: u64, _: RawFd, _: u64, _: u64, _: bool) -> Result<(), ShmError> {
        if self.refuse.load(Ordering::Relaxed) {
            return Err(ShmError::Frontend("refused".into()));
        }
        Ok(())
    }
    fn unmap(&self, _: u64, _: u64) -> Result<(), ShmError> {
        if self.refuse.load(Ordering::Relaxed) {
            return Err(ShmError::Frontend("refused".into()));
        }
        Ok(())
    }
}

fn gpu() -> &'static Arc<SimGpu> {
    static GPU: OnceLock<Arc<SimGpu>> = OnceLock::new();
    GPU.get_or_init(|| {
        SimGpu::new(SimConfig {
            vram_bytes: 32 << 20,
            max_channels: 64,
            max_contexts: 64,
            ..SimConfig::default()
        })
        .expect("sim GPU")
    })
}

fn memory() -> &'static GuestMemory {
    static MEM: OnceLock<GuestMemory> = OnceLock::new();
    MEM.get_or_init(|| {
        GuestMemory::from_ranges(&[(GuestAddress(0), 1 << 20), (GuestAddress(256 << 20), 2 << 20)])
            .expect("guest memory")
    })
}

fuzz_target!(|data: &[u8]| {
    let gpu = gpu();
    let before = gpu.stats();
    let dyn_gpu: Arc<dyn Gpu> = gpu.clone();
    let mut session = Session::new(
        dyn_gpu,
        VmLimits {
            max_contexts: 4,
            max_channels: 4,
            vram_bytes: 8 << 20,
            mapped_guest_bytes: 2 << 20,
            // Oversubscription on: allocations past the quota spill to the swap store.
            swap_bytes: 8 << 20,
            ..VmLimits::default()
        },
    );
    let shm = Frontend::default();
    let mut rest = data;
    while let [op, pid, ctx, flags, len, tail @ ..] = rest {
        let n = (*len as usize).min(tail.len());
        let (body, next) = tail.split_at(n);
        rest = next;
        let mut req = Vec::with_capacity(16 + n);
        if flags & 2 == 0 {
            // Every opcode (1..=19, the module requests included) and 0, which none is.
            for v in [u32::from(op % 20), u32::from(pid % 4), u32::from(ctx % 6), 0] {
                req.extend_from_slice(&v.to_le_bytes());
            }
        } else {
            req.extend_from_slice(&[*op, *pid, *ctx]);
        }
        req.extend_from_slice(body);
        shm.refuse.store(flags & 1 != 0, Ordering::Relaxed);
        let reply = session.handle(&req, memory(), &shm);
        assert!(decode_reply(0, &reply).is_ok(), "malformed reply");
    }
    shm.refuse.store(false, Ordering::Relaxed);
    session.teardown(&shm);
    assert!(session.is_empty());
    let after = gpu.stats();
    assert_eq!(
        (after.contexts, after.channels, after.vram_allocations, after.vram_free_bytes),
        (before.contexts, before.channels, before.vram_allocations, before.vram_free_bytes),
        "session leaked GPU objects"
    );
});
