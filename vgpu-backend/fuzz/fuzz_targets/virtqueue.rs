//! The backend's virtqueue handling fed arbitrary rings: a descriptor table, an avail ring
//! and avail indices built from the fuzzer's bytes in guest memory, served through
//! `VhostUserBackend::handle_event` on the control queue (each chain's request decoded
//! and answered by a real session on the sim GPU) and on the event queue (pending events
//! written into the driver's buffers). Loops, out-of-range and zero/huge lengths,
//! indirect tables, chains across memory regions and avail-index jumps must end in an
//! error reply, an empty used entry or a broken ring — never a panic or a hang — and the
//! used ring may only name heads the queue has, with replies no longer than a reply
//! (checked when no descriptor could aim the device's writes at the rings).
//! After a device reset the GPU holds nothing of the session.
//!
//! Input: `[flags, avail_idx: u16, avail_idx2: u16, event_avail_idx: u16, events,
//! descriptors (16 bytes each, queue-size many), avail ring (2 bytes each), data..]`.
//! flags bit 0: EVENT_IDX; bit 1: also serve the event queue; bits 2-4: queue size
//! 2^(1+n); bit 5: a second kick after the avail index moved to `avail_idx2`.
//! A descriptor's address is placed by its top two bits: 00 inside the first memory
//! region, 01 inside the second (small) one, otherwise as written (mostly nowhere).
#![no_main]

use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use vgpu_backend::vhu_vgpu::{VhuVgpu, Vring};
use vgpu_backend::{EventQueue, GuestMemory, VmLimits};
use vgpu_host_shim::{Gpu, SimConfig, SimGpu};
use vgpu_protocol::device::{CONTROL_QUEUE, EVENT_QUEUE, QUEUE_SIZE};
use vgpu_protocol::request::{Event, MAX_REPLY_SIZE};
use vhost_user_backend::{VhostUserBackend, VringT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryAtomic};
use vmm_sys_util::epoll::EventSet;

const REGION1: (u64, usize) = (0, 0x2_0000);
const REGION2: (u64, usize) = (0x10_0000, 0x1000);
/// The rings live in a region of their own that placed descriptors never point into.
const RINGS: (u64, usize) = (0x4000_0000, 0x6000);
/// (descriptor table, avail ring, used ring) of each queue.
const CONTROL_RING: (u64, u64, u64) = (RINGS.0, RINGS.0 + 0x1000, RINGS.0 + 0x2000);
const EVENT_RING: (u64, u64, u64) = (RINGS.0 + 0x3000, RINGS.0 + 0x4000, RINGS.0 + 0x5000);
const DATA: u64 = 0x1000;
const VIRTQ_DESC_F_WRITE: u16 = 2;
const VIRTQ_DESC_F_INDIRECT: u16 = 4;

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

/// Where a fuzzed descriptor address points (see the module docs).
fn place(addr: u64) -> u64 {
    match addr >> 62 {
        0 => REGION1.0 + addr % REGION1.1 as u64,
        1 => REGION2.0 + addr % REGION2.1 as u64,
        _ => addr & (u64::MAX >> 2),
    }
}

/// Writes one split ring: descriptors (addresses placed), avail ring entries and index.
fn write_ring(mem: &GuestMemory, at: (u64, u64, u64), descs: &[u8], avail: &[u8], idx: u16) {
    for (i, d) in descs.chunks_exact(16).enumerate() {
        let addr = u64::from_le_bytes(d[..8].try_into().expect("8 bytes"));
        let mut raw = [0u8; 16];
        raw[..8].copy_from_slice(&place(addr).to_le_bytes());
        raw[8..].copy_from_slice(&d[8..]);
        mem.write_slice(&raw, GuestAddress(at.0 + i as u64 * 16))
            .expect("descriptor table in memory");
    }
    mem.write_slice(avail, GuestAddress(at.1 + 4))
        .expect("avail ring in memory");
    mem.write_obj(idx, GuestAddress(at.1 + 2))
        .expect("avail index in memory");
}

fn vring(
    mem: &GuestMemoryAtomic<GuestMemory>,
    at: (u64, u64, u64),
    size: u16,
    event_idx: bool,
) -> Vring {
    let v = Vring::new(mem.clone(), QUEUE_SIZE).expect("vring");
    v.set_queue_size(size);
    v.set_queue_info(at.0, at.1, at.2).expect("queue addresses");
    v.set_queue_event_idx(event_idx);
    v.set_queue_ready(true);
    v.set_enabled(true);
    v
}

/// Whether the device can write the rings only as a device: no descriptor of the table is
/// indirect (its table could point anywhere) or writable into the rings' region. Only
/// then does the used ring show what the device put there (a guest may aim its reply
/// buffers at its own used ring).
fn rings_private(descs: &[u8]) -> bool {
    descs.chunks_exact(16).all(|d| {
        let addr = place(u64::from_le_bytes(d[..8].try_into().expect("8 bytes")));
        let len = u64::from(u32::from_le_bytes(d[8..12].try_into().expect("4 bytes")));
        let flags = u16::from_le_bytes([d[12], d[13]]);
        let into_rings = addr < RINGS.0 + RINGS.1 as u64 && addr.saturating_add(len) > RINGS.0;
        flags & VIRTQ_DESC_F_INDIRECT == 0 && !(flags & VIRTQ_DESC_F_WRITE != 0 && into_rings)
    })
}

/// The used ring names only heads the queue has, with replies no longer than a reply.
fn check_used(mem: &GuestMemory, used: u64, size: u16, max_len: usize) {
    let idx: u16 = mem.read_obj(GuestAddress(used + 2)).expect("used index");
    for i in 0..idx.min(size) {
        let elem = used + 4 + u64::from(i) * 8;
        let id: u32 = mem.read_obj(GuestAddress(elem)).expect("used id");
        let len: u32 = mem.read_obj(GuestAddress(elem + 4)).expect("used len");
        assert!(
            id < u32::from(size),
            "used entry names head {id} of a {size}-entry queue"
        );
        assert!(len as usize <= max_len, "used entry claims {len} bytes");
    }
}

fuzz_target!(|data: &[u8]| {
    let [flags, a0, a1, b0, b1, e0, e1, events, rest @ ..] = data else {
        return;
    };
    let size = 1u16 << (1 + ((flags >> 2) & 7));
    let (descs, rest) = rest.split_at(rest.len().min(size as usize * 16));
    let (avail, rest) = rest.split_at(rest.len().min(size as usize * 2));
    let descs = &descs[..descs.len() / 16 * 16];
    let avail = &avail[..avail.len() / 2 * 2];
    let mem = GuestMemory::from_ranges(&[
        (GuestAddress(REGION1.0), REGION1.1),
        (GuestAddress(REGION2.0), REGION2.1),
        (GuestAddress(RINGS.0), RINGS.1),
    ])
    .expect("guest memory");
    let payload = &rest[..rest.len().min(REGION1.1 - DATA as usize)];
    mem.write_slice(payload, GuestAddress(DATA))
        .expect("data in memory");
    let event_idx = flags & 1 != 0;
    write_ring(
        &mem,
        CONTROL_RING,
        descs,
        avail,
        u16::from_le_bytes([*a0, *a1]),
    );
    let serve_events = flags & 2 != 0;
    if serve_events {
        write_ring(
            &mem,
            EVENT_RING,
            descs,
            avail,
            u16::from_le_bytes([*e0, *e1]),
        );
    }

    let gpu = gpu();
    let before = gpu.stats();
    let atomic = GuestMemoryAtomic::new(mem.clone());
    let queue = Arc::new(EventQueue::detached(16));
    let dyn_gpu: Arc<dyn Gpu> = gpu.clone();
    let limits = VmLimits {
        max_contexts: 4,
        max_channels: 4,
        vram_bytes: 8 << 20,
        mapped_guest_bytes: 64 << 10,
        swap_bytes: 0,
        ..VmLimits::default()
    };
    let dev =
        VhuVgpu::detached("fuzz", dyn_gpu, limits, queue.clone(), atomic.clone()).expect("device");
    dev.set_event_idx(event_idx);
    let vrings = [
        vring(&atomic, CONTROL_RING, size, event_idx),
        vring(&atomic, EVENT_RING, size, event_idx),
    ];
    dev.handle_event(CONTROL_QUEUE, EventSet::IN, &vrings, 0)
        .expect("control queue");
    if flags & 0x20 != 0 {
        mem.write_obj(
            u16::from_le_bytes([*b0, *b1]),
            GuestAddress(CONTROL_RING.1 + 2),
        )
        .expect("avail index in memory");
        dev.handle_event(CONTROL_QUEUE, EventSet::IN, &vrings, 0)
            .expect("control queue, second kick");
    }
    let check = rings_private(descs);
    if check {
        check_used(&mem, CONTROL_RING.2, size, MAX_REPLY_SIZE);
    }
    if serve_events {
        let epoch = queue.epoch();
        for i in 0..u32::from(*events % 8) {
            queue.push(
                epoch,
                Event {
                    kind: 1 + i % 2,
                    channel: i,
                    value: i,
                    info: u64::from(i) << 32,
                },
            );
        }
        dev.handle_event(EVENT_QUEUE, EventSet::IN, &vrings, 0)
            .expect("event queue");
        if check {
            check_used(&mem, EVENT_RING.2, size, vgpu_protocol::request::EVENT_SIZE);
        }
    }
    dev.reset_device();
    let after = gpu.stats();
    assert_eq!(
        (
            after.contexts,
            after.channels,
            after.vram_allocations,
            after.vram_free_bytes
        ),
        (
            before.contexts,
            before.channels,
            before.vram_allocations,
            before.vram_free_bytes
        ),
        "the device leaked GPU objects"
    );
});
