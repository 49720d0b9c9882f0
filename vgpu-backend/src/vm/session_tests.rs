//! Request-handler tests without a socket: a `Session` over a `SimGpu`, a test guest
//! memory and a fake `ShmMapper` that records SHMEM_MAP/UNMAP calls.

use std::collections::BTreeMap;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use proptest::prelude::*;
use vgpu_host_shim::{Gpu, SimConfig, SimGpu, SimStats};
use vgpu_protocol::device::{slot_offset, APERTURE_OFFSET, APERTURE_SIZE, CHANNEL_SLOTS};
use vgpu_protocol::request::{
    decode_reply, event, GuestRange, Op, ReplyBody, Request, StatsReply, MAP_READ_ONLY, PAGE_2M,
    PAGE_4K, PAGE_64K,
};
use vgpu_protocol::{ErrorCode, PAGE_SIZE, PROTOCOL_VERSION};
use vm_memory::GuestAddress;

use crate::error::ShmError;
use crate::guest_mem::GuestMemory;
use crate::shmem::ShmMapper;
use crate::vm::session::{MappingTarget, Session, VmLimits};

const MIB: u64 = 1 << 20;
/// Guest RAM: 2 MiB at 0, 4 MiB at 256 MiB (2 MiB aligned), 64 KiB at 1 GiB.
const R0: (u64, u64) = (0, 2 * MIB);
const R1: (u64, u64) = (256 * MIB, 4 * MIB);
const R2: (u64, u64) = (1 << 30, 64 << 10);

#[derive(Debug, Clone, PartialEq, Eq)]
enum ShmCall {
    Map {
        off: u64,
        fd: RawFd,
        fd_off: u64,
        len: u64,
        writable: bool,
    },
    Unmap {
        off: u64,
        len: u64,
    },
}

#[derive(Default)]
struct FakeShm {
    calls: Mutex<Vec<ShmCall>>,
    fail_map: AtomicBool,
    fail_unmap: AtomicBool,
    no_channel: AtomicBool,
}

impl FakeShm {
    fn calls(&self) -> Vec<ShmCall> {
        self.calls.lock().unwrap().clone()
    }
    /// A position in the call log.
    fn mark(&self) -> usize {
        self.calls.lock().unwrap().len()
    }
    /// The calls made since `mark`.
    fn since(&self, mark: usize) -> Vec<ShmCall> {
        self.calls.lock().unwrap()[mark..].to_vec()
    }
    /// The mappings in place now: offset → len (after replaying the log).
    fn live(&self) -> BTreeMap<u64, u64> {
        let mut m = BTreeMap::new();
        for c in self.calls() {
            match c {
                // As a frontend's mmap(MAP_FIXED) does: a map replaces, and an unmap
                // removes, whatever lies in its range (a VRAM aperture may be mapped
                // chunk by chunk and unmapped whole).
                ShmCall::Map { off, len, .. } => {
                    m.retain(|&o, &mut l| o + l <= off || o >= off + len);
                    m.insert(off, len);
                }
                ShmCall::Unmap { off, len } => {
                    m.retain(|&o, &mut l| o + l <= off || o >= off + len);
                }
            }
        }
        m
    }
}

impl ShmMapper for FakeShm {
    fn map(
        &self,
        off: u64,
        fd: RawFd,
        fd_off: u64,
        len: u64,
        writable: bool,
    ) -> Result<(), ShmError> {
        if self.no_channel.load(Ordering::Relaxed) {
            return Err(ShmError::NoChannel);
        }
        if self.fail_map.load(Ordering::Relaxed) {
            return Err(ShmError::Frontend("refused".into()));
        }
        self.calls.lock().unwrap().push(ShmCall::Map {
            off,
            fd,
            fd_off,
            len,
            writable,
        });
        Ok(())
    }
    fn unmap(&self, off: u64, len: u64) -> Result<(), ShmError> {
        if self.fail_unmap.load(Ordering::Relaxed) {
            return Err(ShmError::Frontend("refused".into()));
        }
        self.calls.lock().unwrap().push(ShmCall::Unmap { off, len });
        Ok(())
    }
}

/// The GPU's stats once they equal `want` or after a grace period: the sim releases a
/// destroyed channel's control page when its engine threads drop their last reference.
fn settled(gpu: &SimGpu, want: SimStats) -> SimStats {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    loop {
        let s = gpu.stats();
        if s == want || std::time::Instant::now() > deadline {
            return s;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

fn sim() -> Arc<SimGpu> {
    SimGpu::new(SimConfig {
        vram_bytes: 64 * MIB,
        max_channels: 64,
        max_contexts: 64,
        ..SimConfig::default()
    })
    .unwrap()
}

fn guest_mem() -> GuestMemory {
    GuestMemory::from_ranges(&[
        (GuestAddress(R0.0), R0.1 as usize),
        (GuestAddress(R1.0), R1.1 as usize),
        (GuestAddress(R2.0), R2.1 as usize),
    ])
    .unwrap()
}

fn limits() -> VmLimits {
    VmLimits {
        max_contexts: 4,
        max_channels: 4,
        vram_bytes: 16 * MIB,
        mapped_guest_bytes: 4 * MIB,
        swap_bytes: 0,
        ..VmLimits::default()
    }
}

struct T {
    gpu: Arc<SimGpu>,
    s: Session,
    mem: GuestMemory,
    shm: FakeShm,
    baseline: SimStats,
}

type R = Result<ReplyBody, ErrorCode>;

impl T {
    fn new() -> Self {
        Self::with(sim(), limits())
    }
    fn with(gpu: Arc<SimGpu>, limits: VmLimits) -> Self {
        let baseline = gpu.stats();
        let dyn_gpu: Arc<dyn Gpu> = gpu.clone();
        T {
            s: Session::new(dyn_gpu, limits),
            gpu,
            mem: guest_mem(),
            shm: FakeShm::default(),
            baseline,
        }
    }
    fn raw(&mut self, bytes: &[u8]) -> Vec<u8> {
        self.s.handle(bytes, &self.mem, &self.shm)
    }
    fn req(&mut self, pid: u32, ctx: u32, op: Op) -> R {
        let r = Request { pid, ctx, op };
        let reply = self.raw(&r.encode());
        decode_reply(r.opcode(), &reply).expect("well-formed reply")
    }
    fn ctx(&mut self, pid: u32) -> u32 {
        match self.req(pid, 0, Op::CreateContext) {
            Ok(ReplyBody::Context { ctx, .. }) => ctx,
            other => panic!("create context: {other:?}"),
        }
    }
    fn alloc(&mut self, pid: u32, ctx: u32, size: u64, align: u64) -> (u32, u64) {
        match self.req(pid, ctx, Op::AllocVram { size, align }) {
            Ok(ReplyBody::Mem { mem, size }) => (mem, size),
            other => panic!("alloc: {other:?}"),
        }
    }
    fn channel(&mut self, pid: u32, ctx: u32) -> (u32, u32) {
        match self.req(
            pid,
            ctx,
            Op::CreateChannel {
                gp_ring_va: 0x10_0000,
                gp_entries: 64,
            },
        ) {
            Ok(ReplyBody::Channel { channel, slot }) => (channel, slot),
            other => panic!("channel: {other:?}"),
        }
    }
    fn stats(&mut self) -> StatsReply {
        match self.req(0, 0, Op::GetStats) {
            Ok(ReplyBody::Stats(s)) => s,
            other => panic!("stats: {other:?}"),
        }
    }
    fn hctx(&self, ctx: u32) -> vgpu_host_shim::ContextId {
        self.s.hal.contexts[&ctx].0
    }
    fn mapped_pages(&self, ctx: u32) -> usize {
        self.gpu.mapped_pages(self.hctx(ctx)).unwrap()
    }
    fn assert_baseline(&self) {
        assert_eq!(
            settled(&self.gpu, self.baseline),
            self.baseline,
            "HAL objects leaked"
        );
    }
    /// Books agree with the HAL and with the fake BAR.
    fn check_consistent(&self) {
        let st = self.s.state();
        let hal = self.gpu.stats();
        assert_eq!(hal.contexts - self.baseline.contexts, st.contexts.len());
        assert_eq!(hal.channels - self.baseline.channels, st.channels.len());
        // Each VRAM object is a set of chunks: whole ones are GPU allocations of their
        // own, shorter ones pieces of the VM's frames (see crate::vram::slabs).
        let chunks: usize = self
            .s
            .hal
            .vram
            .values()
            .map(|b| {
                b.chunks
                    .iter()
                    .filter(|c| {
                        matches!(c.loc, crate::vram::backing::Loc::Vram(_))
                            && c.len == crate::vram::backing::CHUNK
                    })
                    .count()
            })
            .sum();
        let frames = (self.s.hal.slabs.frame_bytes() / crate::vram::backing::CHUNK) as usize;
        assert_eq!(
            hal.vram_allocations - self.baseline.vram_allocations,
            chunks + frames
        );
        assert_eq!(self.s.hal.vram.len(), st.mems.len());
        let vram: u64 = st.mems.values().map(|m| m.size).sum();
        assert_eq!(st.usage.vram_bytes, vram);
        let resident: u64 = self.s.hal.vram.values().map(|b| b.resident_bytes()).sum();
        assert_eq!(
            self.baseline.vram_free_bytes - hal.vram_free_bytes,
            resident + self.s.vram_slack()
        );
        let guest: u64 = st
            .mappings
            .values()
            .filter(|m| matches!(m.target, MappingTarget::Guest { .. }))
            .map(|m| m.size)
            .sum();
        assert_eq!(st.usage.mapped_guest_bytes, guest);
        assert!(guest <= self.s.limits().mapped_guest_bytes);
        assert!(vram <= self.s.limits().vram_bytes);
        let mut bar = BTreeMap::new();
        for c in st.channels.values().filter(|c| c.slot_mapped) {
            bar.insert(slot_offset(c.slot).unwrap(), PAGE_SIZE);
        }
        let mut aperture = 0;
        for m in st.mems.values() {
            if let Some(off) = m.aperture {
                let len = m.size.div_ceil(PAGE_SIZE) * PAGE_SIZE;
                assert!(off >= APERTURE_OFFSET && off + len <= APERTURE_OFFSET + APERTURE_SIZE);
                bar.insert(off, len);
                aperture += len;
            }
        }
        assert_eq!(st.usage.aperture_bytes, aperture);
        // A VRAM object's aperture window may be backed by several SHMEM_MAPs (one per
        // run of contiguous 2 MiB chunks): compare the covered ranges, coalesced.
        assert_eq!(coalesce(&self.shm.live()), coalesce(&bar), "BAR mappings");
        // No two BAR mappings overlap.
        let v: Vec<_> = bar.iter().collect();
        for w in v.windows(2) {
            assert!(w[0].0 + w[0].1 <= *w[1].0);
        }
        for ((ctx, va), m) in &st.mappings {
            assert!(st.contexts.contains_key(ctx));
            assert_eq!(st.contexts[ctx].pid, m.pid);
            assert!(va.checked_add(m.size).is_some());
        }
        let shared = self.s.shared().stats();
        assert_eq!(shared.contexts as usize, st.contexts.len());
        assert_eq!(shared.vram_bytes, vram);
        // Page-table memory: the contexts' tables as the GPU counts them, plus records.
        let tables: u64 = st
            .contexts
            .keys()
            .map(|c| self.gpu.page_table_bytes(self.hctx(*c)).unwrap())
            .sum();
        let records: u64 = st
            .mappings
            .values()
            .map(crate::vm::requests::record_of)
            .sum();
        assert_eq!(st.usage.page_table_bytes, tables + records);
        assert!(st.usage.page_table_bytes <= self.s.limits().page_table_bytes);
        assert!(st.mappings.len() <= self.s.limits().max_mappings as usize);
        assert_eq!(shared.mappings as usize, st.mappings.len());
        assert_eq!(shared.page_table_bytes, st.usage.page_table_bytes);
    }
}

#[test]
fn info_and_stats() {
    let mut t = T::new();
    match t.req(9, 0, Op::GetInfo).unwrap() {
        ReplyBody::Info(i) => {
            assert_eq!(i.version, PROTOCOL_VERSION);
            assert_eq!(i.vram_bytes, 16 * MIB);
            assert_eq!(i.max_contexts, 4);
            assert_eq!(i.channel_slots, CHANNEL_SLOTS.min(limits().max_channels));
            assert_eq!(i.compute_engines, 1);
        }
        other => panic!("{other:?}"),
    }
    let s = t.stats();
    assert_eq!(
        s,
        StatsReply {
            vram_limit: 16 * MIB,
            ..StatsReply::default()
        }
    );
    let c = t.ctx(1);
    t.alloc(1, c, 8192, 4096);
    let s = t.stats();
    assert_eq!((s.contexts, s.vram_bytes), (1, 8192));
    let shared = t.s.shared().stats();
    assert_eq!(shared.requests, 5);
    assert_eq!(shared.errors, 0);
}

#[test]
fn contexts_are_owned_and_limited() {
    let mut t = T::new();
    let a = t.ctx(100);
    let b = t.ctx(200);
    assert_ne!(a, b);
    assert!(a < 16 && b < 16, "small ids");
    assert_eq!(
        t.req(200, a, Op::DestroyContext),
        Err(ErrorCode::PermissionDenied)
    );
    assert_eq!(t.req(100, 77, Op::DestroyContext), Err(ErrorCode::NotFound));
    assert_eq!(t.req(100, 0, Op::DestroyContext), Err(ErrorCode::NotFound));
    t.ctx(1);
    t.ctx(1);
    assert_eq!(
        t.req(1, 0, Op::CreateContext),
        Err(ErrorCode::LimitExceeded)
    );
    assert_eq!(t.req(100, a, Op::DestroyContext), Ok(ReplyBody::Empty));
    assert_eq!(t.req(100, a, Op::DestroyContext), Err(ErrorCode::NotFound));
    let again = t.ctx(5);
    assert_ne!(
        again, a,
        "a freed context id is not handed out again at once"
    );
    t.check_consistent();
    assert!(t.s.shared().stats().errors >= 5);
}

#[test]
fn alloc_vram_validation_and_limits() {
    let mut t = T::new();
    let c = t.ctx(1);
    let bad = |size, align| Op::AllocVram { size, align };
    for (size, align) in [
        (0, 4096),
        (4096, 0),
        (4096, 3000),
        (4096, 2048),
        (4096, 1 << 31),
        (16 * MIB + 1, 4096),
        (u64::MAX, 4096),
    ] {
        assert_eq!(
            t.req(1, c, bad(size, align)),
            Err(ErrorCode::InvalidArgument),
            "size {size} align {align}"
        );
    }
    let (m, size) = t.alloc(1, c, 100, 4096);
    assert_eq!(size, 4096, "rounded to a page");
    t.alloc(1, c, 8 * MIB, 2 * MIB);
    t.alloc(1, c, 7 * MIB, 4096);
    // 4 KiB + 8 MiB + 7 MiB used: 1 MiB - 4 KiB left.
    assert_eq!(t.req(1, c, bad(MIB, 4096)), Err(ErrorCode::LimitExceeded));
    t.alloc(1, c, MIB - 4096, 4096);
    assert_eq!(t.req(1, c, bad(1, 4096)), Err(ErrorCode::LimitExceeded));
    // Ownership of FREE_MEM.
    let c2 = t.ctx(1);
    let c3 = t.ctx(2);
    assert_eq!(
        t.req(2, c3, Op::FreeMem { mem: m }),
        Err(ErrorCode::PermissionDenied)
    );
    assert_eq!(
        t.req(1, c2, Op::FreeMem { mem: m }),
        Err(ErrorCode::NotFound)
    );
    assert_eq!(
        t.req(2, c, Op::FreeMem { mem: m }),
        Err(ErrorCode::PermissionDenied)
    );
    assert_eq!(
        t.req(1, c, Op::FreeMem { mem: 9999 }),
        Err(ErrorCode::NotFound)
    );
    assert_eq!(t.req(1, c, Op::FreeMem { mem: m }), Ok(ReplyBody::Empty));
    assert_eq!(
        t.req(1, c, Op::FreeMem { mem: m }),
        Err(ErrorCode::NotFound)
    );
    t.check_consistent();
    // Alloc in someone else's context.
    assert_eq!(
        t.req(2, c, bad(4096, 4096)),
        Err(ErrorCode::PermissionDenied)
    );
    t.s.teardown(&t.shm);
    t.assert_baseline();
}

#[test]
fn map_vram_and_unmap() {
    let mut t = T::new();
    let c = t.ctx(1);
    let (m, _) = t.alloc(1, c, 64 << 10, 64 << 10);
    let (big, _) = t.alloc(1, c, 2 * MIB, 2 * MIB);
    let map = |mem, va, page, flags| Op::MapVram {
        mem,
        flags,
        va,
        page,
    };
    assert_eq!(
        t.req(1, c, map(m, 0x1000, PAGE_64K, 0)),
        Err(ErrorCode::InvalidArgument)
    );
    assert_eq!(
        t.req(1, c, map(m, 1 << 48, PAGE_4K, 0)),
        Err(ErrorCode::InvalidArgument)
    );
    assert_eq!(
        t.req(1, c, map(m, (1 << 48) - 4096, PAGE_4K, 0)),
        Err(ErrorCode::InvalidArgument)
    );
    assert_eq!(
        t.req(1, c, map(m, 0x20_0000, PAGE_2M, 0)),
        Err(ErrorCode::InvalidArgument),
        "object smaller than one 2 MiB page"
    );
    assert_eq!(
        t.req(1, c, map(777, 0x20_0000, PAGE_4K, 0)),
        Err(ErrorCode::NotFound)
    );
    assert_eq!(
        t.req(1, c, map(m, 0x40_0000, PAGE_64K, MAP_READ_ONLY)),
        Ok(ReplyBody::Empty)
    );
    assert_eq!(t.mapped_pages(c), 1);
    // Overlap with itself and with another object.
    assert_eq!(
        t.req(1, c, map(m, 0x40_0000, PAGE_4K, 0)),
        Err(ErrorCode::InvalidArgument)
    );
    assert_eq!(
        t.req(1, c, map(m, 0x40_f000, PAGE_4K, 0)),
        Err(ErrorCode::InvalidArgument)
    );
    assert_eq!(
        t.req(1, c, map(m, 0x3f_1000, PAGE_4K, 0)),
        Err(ErrorCode::InvalidArgument)
    );
    // Adjacent is fine; a second mapping of the same object too.
    assert_eq!(
        t.req(1, c, map(m, 0x41_0000, PAGE_64K, 0)),
        Ok(ReplyBody::Empty)
    );
    assert_eq!(
        t.req(1, c, map(big, 0x60_0000, PAGE_2M, 0)),
        Ok(ReplyBody::Empty)
    );
    // Another process cannot map or unmap in this context.
    let c2 = t.ctx(2);
    assert_eq!(
        t.req(2, c, map(m, 0x80_0000, PAGE_4K, 0)),
        Err(ErrorCode::PermissionDenied)
    );
    assert_eq!(
        t.req(2, c2, map(m, 0x80_0000, PAGE_4K, 0)),
        Err(ErrorCode::PermissionDenied)
    );
    assert_eq!(
        t.req(2, c, Op::Unmap { va: 0x40_0000 }),
        Err(ErrorCode::PermissionDenied)
    );
    assert_eq!(
        t.req(2, c2, Op::Unmap { va: 0x40_0000 }),
        Err(ErrorCode::NotFound)
    );
    // UNMAP needs the exact start.
    assert_eq!(
        t.req(1, c, Op::Unmap { va: 0x40_1000 }),
        Err(ErrorCode::NotFound)
    );
    assert_eq!(
        t.req(1, c, Op::Unmap { va: 0x40_0000 }),
        Ok(ReplyBody::Empty)
    );
    assert_eq!(
        t.req(1, c, Op::Unmap { va: 0x40_0000 }),
        Err(ErrorCode::NotFound)
    );
    t.check_consistent();
    // FREE_MEM while mapped: every mapping goes first.
    assert_eq!(t.req(1, c, Op::FreeMem { mem: m }), Ok(ReplyBody::Empty));
    assert_eq!(t.s.state().mappings.len(), 1);
    assert_eq!(t.mapped_pages(c), 1, "only the 2 MiB mapping is left");
    t.check_consistent();
    assert_eq!(t.req(1, c, Op::DestroyContext), Ok(ReplyBody::Empty));
    assert_eq!(t.req(2, c2, Op::DestroyContext), Ok(ReplyBody::Empty));
    t.assert_baseline();
}

fn range(gpa: u64, len: u64) -> GuestRange {
    GuestRange { gpa, len }
}

#[test]
fn map_guest_validation() {
    let mut t = T::new();
    let c = t.ctx(1);
    let mg = |va, page, ranges: Vec<GuestRange>| Op::MapGuest {
        va,
        page,
        flags: 0,
        ranges,
    };
    let inval = Err(ErrorCode::InvalidArgument);
    let cases: Vec<(&str, Op)> = vec![
        ("zero length", mg(0x10_0000, PAGE_4K, vec![range(0, 0)])),
        (
            "unaligned gpa",
            mg(0x10_0000, PAGE_4K, vec![range(0x800, 4096)]),
        ),
        (
            "unaligned len",
            mg(0x10_0000, PAGE_4K, vec![range(0, 4000)]),
        ),
        ("unaligned va", mg(0x10_0800, PAGE_4K, vec![range(0, 4096)])),
        (
            "outside the table",
            mg(0x10_0000, PAGE_4K, vec![range(R0.1, 4096)]),
        ),
        (
            "past a region's end",
            mg(0x10_0000, PAGE_4K, vec![range(R0.1 - 4096, 8192)]),
        ),
        ("huge", mg(0x10_0000, PAGE_4K, vec![range(0, !0xfffu64)])),
        (
            "gpa overflow",
            mg(0x10_0000, PAGE_4K, vec![range(!0xfffu64, 4096)]),
        ),
        (
            "overlapping ranges",
            mg(0x10_0000, PAGE_4K, vec![range(0, 8192), range(4096, 4096)]),
        ),
        (
            "duplicate ranges",
            mg(
                0x10_0000,
                PAGE_4K,
                vec![range(R1.0, 4096), range(R1.0, 4096)],
            ),
        ),
        (
            "va overflow",
            mg((1 << 48) - 4096, PAGE_4K, vec![range(0, 8192)]),
        ),
        (
            "2 MiB page, 4 KiB range",
            mg(0x20_0000, PAGE_2M, vec![range(0, 4096)]),
        ),
        (
            "2 MiB page, region too small",
            mg(0x20_0000, PAGE_2M, vec![range(R2.0, 2 * MIB)]),
        ),
    ];
    for (what, op) in cases {
        assert_eq!(t.req(1, c, op), inval, "{what}");
    }
    assert_eq!(t.s.state().mappings.len(), 0);
    assert_eq!(t.mapped_pages(c), 0);
    // Piecewise mapping of ranges in three regions.
    let ranges = vec![range(R1.0 + 2 * MIB, 2 * MIB), range(R0.0, 2 * MIB)];
    assert_eq!(
        t.req(1, c, mg(0x4000_0000, PAGE_2M, ranges)),
        Ok(ReplyBody::Empty)
    );
    assert_eq!(t.mapped_pages(c), 2);
    assert_eq!(t.stats().mapped_guest_bytes, 4 * MIB);
    // The limit (4 MiB) is reached.
    assert_eq!(
        t.req(1, c, mg(0x1000_0000, PAGE_4K, vec![range(R2.0, 4096)])),
        Err(ErrorCode::LimitExceeded)
    );
    // Overlap with the existing mapping.
    assert_eq!(
        t.req(1, c, Op::Unmap { va: 0x4000_0000 }),
        Ok(ReplyBody::Empty)
    );
    assert_eq!(t.mapped_pages(c), 0);
    let ranges = vec![range(R2.0, 64 << 10), range(R0.0 + 64 * 1024, 128 << 10)];
    assert_eq!(
        t.req(1, c, mg(0x10_0000, PAGE_64K, ranges)),
        Ok(ReplyBody::Empty)
    );
    assert_eq!(t.mapped_pages(c), 3);
    assert_eq!(
        t.req(1, c, mg(0x12_0000, PAGE_64K, vec![range(R1.0, 64 << 10)])),
        Err(ErrorCode::InvalidArgument),
        "overlaps the second piece"
    );
    assert_eq!(
        t.req(1, c, mg(0x13_0000, PAGE_64K, vec![range(R1.0, 64 << 10)])),
        Ok(ReplyBody::Empty),
        "adjacent"
    );
    t.check_consistent();
    // A guest mapping is not a VRAM object.
    assert_eq!(
        t.req(1, c, Op::FreeMem { mem: 1 }),
        Err(ErrorCode::NotFound)
    );
    assert_eq!(t.req(1, c, Op::DestroyContext), Ok(ReplyBody::Empty));
    t.check_consistent();
    t.assert_baseline();
}

#[test]
fn map_guest_the_gpu_sees_guest_memory() {
    use vgpu_host_shim::SysMemory;
    let mut t = T::new();
    let c = t.ctx(1);
    let sys = t.s.hal.contexts[&c].1.clone();
    let ranges = vec![range(R1.0, 4096)];
    let op = Op::MapGuest {
        va: 0x1000,
        page: PAGE_4K,
        flags: 0,
        ranges,
    };
    assert_eq!(t.req(1, c, op), Ok(ReplyBody::Empty));
    // The context's SysMemory is this VM's memory, byte for byte.
    use vm_memory::Bytes;
    t.mem.write_slice(b"hello", GuestAddress(R1.0)).unwrap();
    let hr = sys.translate(R1.0, 5).unwrap();
    // SAFETY: `hr` points into the test guest memory, which outlives this read.
    let got = unsafe { std::slice::from_raw_parts(hr.ptr, hr.len) };
    assert_eq!(got, b"hello");
    assert!(sys.translate(R1.0 + R1.1, 1).is_none());
}

#[test]
fn aperture_windows() {
    let mut t = T::new();
    let c = t.ctx(1);
    let (a, a_size) = t.alloc(1, c, 8192, 4096);
    let (b, _) = t.alloc(1, c, 4096, 4096);
    let vram_fd = t.gpu.vram_fd().expect("the sim has a CPU view of VRAM");
    let off_a = match t.req(1, c, Op::MapAperture { mem: a }) {
        Ok(ReplyBody::Aperture { offset }) => offset,
        other => panic!("{other:?}"),
    };
    assert_eq!(off_a, APERTURE_OFFSET);
    let alloc_a = match t.s.hal.vram[&a].chunks[0].loc {
        crate::vram::backing::Loc::Vram(offset) => vgpu_host_shim::VramAlloc {
            offset,
            size: a_size,
        },
        other => panic!("{other:?}"),
    };
    assert_eq!(
        t.shm.calls(),
        vec![ShmCall::Map {
            off: APERTURE_OFFSET,
            fd: vram_fd.fd,
            fd_off: vram_fd.offset + alloc_a.offset,
            len: a_size,
            writable: true,
        }]
    );
    assert_eq!(
        t.req(1, c, Op::MapAperture { mem: a }),
        Err(ErrorCode::InvalidArgument)
    );
    let off_b = match t.req(1, c, Op::MapAperture { mem: b }) {
        Ok(ReplyBody::Aperture { offset }) => offset,
        other => panic!("{other:?}"),
    };
    assert_eq!(off_b, APERTURE_OFFSET + 8192, "first fit after a");
    assert_eq!(t.stats().aperture_bytes, 12288);
    // Ownership.
    let c2 = t.ctx(2);
    assert_eq!(
        t.req(2, c2, Op::UnmapAperture { mem: a }),
        Err(ErrorCode::PermissionDenied)
    );
    assert_eq!(
        t.req(2, c2, Op::MapAperture { mem: 4242 }),
        Err(ErrorCode::NotFound)
    );
    // A failing frontend leaves everything as it was.
    t.shm.fail_unmap.store(true, Ordering::Relaxed);
    assert_eq!(
        t.req(1, c, Op::UnmapAperture { mem: a }),
        Err(ErrorCode::Internal)
    );
    assert_eq!(
        t.req(1, c, Op::FreeMem { mem: a }),
        Err(ErrorCode::Internal)
    );
    t.check_consistent();
    t.shm.fail_unmap.store(false, Ordering::Relaxed);
    assert_eq!(
        t.req(1, c, Op::UnmapAperture { mem: a }),
        Ok(ReplyBody::Empty)
    );
    assert_eq!(
        t.req(1, c, Op::UnmapAperture { mem: a }),
        Err(ErrorCode::NotFound)
    );
    // The hole is reused first.
    let (d, _) = t.alloc(1, c, 4096, 4096);
    assert_eq!(
        t.req(1, c, Op::MapAperture { mem: d }),
        Ok(ReplyBody::Aperture {
            offset: APERTURE_OFFSET
        })
    );
    t.shm.no_channel.store(true, Ordering::Relaxed);
    assert_eq!(
        t.req(1, c, Op::MapAperture { mem: a }),
        Err(ErrorCode::Unsupported)
    );
    t.shm.no_channel.store(false, Ordering::Relaxed);
    t.check_consistent();
    // FREE_MEM of a mapped object unmaps it from the BAR first.
    let mark = t.shm.mark();
    assert_eq!(t.req(1, c, Op::FreeMem { mem: b }), Ok(ReplyBody::Empty));
    assert_eq!(
        t.shm.since(mark),
        vec![ShmCall::Unmap {
            off: off_b,
            len: 4096
        }]
    );
    let mark = t.shm.mark();
    assert_eq!(t.req(1, c, Op::DestroyContext), Ok(ReplyBody::Empty));
    assert_eq!(
        t.shm.since(mark),
        vec![ShmCall::Unmap {
            off: APERTURE_OFFSET,
            len: 4096
        }]
    );
    assert_eq!(t.stats().aperture_bytes, 0);
    assert_eq!(t.req(2, c2, Op::DestroyContext), Ok(ReplyBody::Empty));
    t.assert_baseline();
}

#[test]
fn aperture_full() {
    let gpu = SimGpu::new(SimConfig {
        vram_bytes: 512 * MIB,
        ..SimConfig::default()
    })
    .unwrap();
    let mut t = T::with(
        gpu,
        VmLimits {
            vram_bytes: 512 * MIB,
            ..limits()
        },
    );
    let c = t.ctx(1);
    let (a, _) = t.alloc(1, c, APERTURE_SIZE - 4096, 4096);
    let (b, _) = t.alloc(1, c, 8192, 4096);
    assert!(t.req(1, c, Op::MapAperture { mem: a }).is_ok());
    assert_eq!(
        t.req(1, c, Op::MapAperture { mem: b }),
        Err(ErrorCode::LimitExceeded)
    );
    t.check_consistent();
    drop(t.s);
}

#[test]
fn channels() {
    let mut t = T::new();
    let c = t.ctx(1);
    let bad = |gp_ring_va, gp_entries| Op::CreateChannel {
        gp_ring_va,
        gp_entries,
    };
    for (va, n) in [
        (0x1000, 0),
        (0x1000, 3),
        (0x1000, 1 << 17),
        (0x1008, 64),
        ((1 << 48) - 16, 64),
    ] {
        assert_eq!(
            t.req(1, c, bad(va, n)),
            Err(ErrorCode::InvalidArgument),
            "{va:#x} {n}"
        );
    }
    let (ch, slot) = t.channel(1, c);
    assert_eq!(slot, 0);
    let page = t.gpu.control_page(t.s.hal.channels[&ch]).unwrap();
    assert_eq!(
        t.shm.calls(),
        vec![ShmCall::Map {
            off: 0,
            fd: page.fd,
            fd_off: page.offset,
            len: PAGE_SIZE,
            writable: true
        }]
    );
    let (ch2, slot2) = t.channel(1, c);
    assert_eq!(slot2, 1);
    assert_ne!(ch, ch2);
    // Ownership.
    let c2 = t.ctx(2);
    assert_eq!(
        t.req(2, c2, Op::DestroyChannel { channel: ch }),
        Err(ErrorCode::PermissionDenied)
    );
    assert_eq!(
        t.req(2, c, Op::DestroyChannel { channel: ch }),
        Err(ErrorCode::PermissionDenied)
    );
    let c3 = t.ctx(1);
    assert_eq!(
        t.req(1, c3, Op::DestroyChannel { channel: ch }),
        Err(ErrorCode::NotFound)
    );
    assert_eq!(
        t.req(1, c, Op::DestroyChannel { channel: 999 }),
        Err(ErrorCode::NotFound)
    );
    // Destroy frees the slot; the next channel takes it again.
    let mark = t.shm.mark();
    assert_eq!(
        t.req(1, c, Op::DestroyChannel { channel: ch }),
        Ok(ReplyBody::Empty)
    );
    assert_eq!(
        t.shm.since(mark),
        vec![ShmCall::Unmap {
            off: 0,
            len: PAGE_SIZE
        }]
    );
    let (ch3, slot3) = t.channel(1, c);
    assert_eq!(slot3, 0);
    assert!(ch3 > ch2, "channel ids are not reused");
    // A failing SHMEM_MAP destroys the new channel again.
    let before = t.gpu.stats();
    t.shm.fail_map.store(true, Ordering::Relaxed);
    assert_eq!(t.req(1, c, bad(0x1000, 64)), Err(ErrorCode::Internal));
    t.shm.fail_map.store(false, Ordering::Relaxed);
    t.shm.no_channel.store(true, Ordering::Relaxed);
    assert_eq!(t.req(1, c, bad(0x1000, 64)), Err(ErrorCode::Unsupported));
    t.shm.no_channel.store(false, Ordering::Relaxed);
    assert_eq!(settled(&t.gpu, before), before);
    // A failing SHMEM_UNMAP keeps the channel.
    t.shm.fail_unmap.store(true, Ordering::Relaxed);
    assert_eq!(
        t.req(1, c, Op::DestroyChannel { channel: ch3 }),
        Err(ErrorCode::Internal)
    );
    assert_eq!(t.req(1, c, Op::DestroyContext), Err(ErrorCode::Internal));
    t.shm.fail_unmap.store(false, Ordering::Relaxed);
    t.check_consistent();
    // Limit: 4 channels per VM.
    t.channel(1, c);
    t.channel(1, c3);
    assert_eq!(t.req(1, c, bad(0x1000, 64)), Err(ErrorCode::LimitExceeded));
    t.check_consistent();
    // Busy time is reported per PID.
    let busy = t.s.shared().process_busy_ns(t.gpu.as_ref());
    assert_eq!(busy.iter().map(|(p, _)| *p).collect::<Vec<_>>(), vec![1]);
    assert_eq!(t.req(1, c, Op::DestroyContext), Ok(ReplyBody::Empty));
    assert_eq!(t.req(1, c3, Op::DestroyContext), Ok(ReplyBody::Empty));
    assert_eq!(t.req(2, c2, Op::DestroyContext), Ok(ReplyBody::Empty));
    assert!(t.shm.live().is_empty());
    t.assert_baseline();
    let busy = t.s.shared().process_busy_ns(t.gpu.as_ref());
    assert_eq!(busy.len(), 1, "destroyed channels stay in the books");
}

#[test]
fn channel_events_are_tagged_with_the_guest_id() {
    let mut t = T::new();
    let c = t.ctx(1);
    let (ch, _) = t.channel(1, c);
    let hch = t.s.hal.channels[&ch];
    t.gpu.kill_channel(hch, ErrorCode::WatchdogKilled).unwrap();
    let events = t.s.shared().events.clone();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while events.is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let e = events.pop().expect("an error event");
    assert_eq!(e.kind, event::CHANNEL_ERROR);
    assert_eq!(e.channel, ch);
    assert_eq!(e.value, ErrorCode::WatchdogKilled.as_u32());
    // After teardown, late events of old channels are dropped.
    t.s.teardown(&t.shm);
    assert!(events.is_empty());
    t.assert_baseline();
}

#[test]
fn mappings_are_bounded_in_number_and_in_page_table_memory() {
    let mut t = T::with(
        sim(),
        VmLimits {
            max_mappings: 3,
            // Two 2 MiB regions of 4 KiB pages and a little more.
            page_table_bytes: 80 << 10,
            ..limits()
        },
    );
    let c = t.ctx(1);
    let (m, _) = t.alloc(1, c, 2 * MIB, 2 * MIB);
    let map = |va| Op::MapVram {
        mem: m,
        flags: 0,
        va,
        page: PAGE_4K,
    };
    assert_eq!(t.req(1, c, map(0x1000_0000)), Ok(ReplyBody::Empty));
    assert_eq!(t.req(1, c, map(0x2000_0000)), Ok(ReplyBody::Empty));
    t.check_consistent();
    let held = t.s.state().usage.page_table_bytes;
    assert!(held > 2 * 512 * 64, "{held}");
    // A third alias needs a third page table: over the memory bound, nothing mapped.
    let pages = t.mapped_pages(c);
    assert_eq!(t.req(1, c, map(0x3000_0000)), Err(ErrorCode::LimitExceeded));
    assert_eq!(t.mapped_pages(c), pages);
    assert_eq!(t.s.state().usage.page_table_bytes, held);
    assert_eq!(
        t.req(1, c, Op::Unmap { va: 0x3000_0000 }),
        Err(ErrorCode::NotFound)
    );
    // 2 MiB pages cost little: the third mapping fits, the fourth is one too many.
    assert_eq!(
        t.req(
            1,
            c,
            Op::MapVram {
                mem: m,
                flags: 0,
                va: 0x4000_0000,
                page: PAGE_2M,
            }
        ),
        Ok(ReplyBody::Empty)
    );
    assert_eq!(
        t.req(
            1,
            c,
            Op::MapGuest {
                va: 0x5000_0000,
                page: PAGE_2M,
                flags: 0,
                ranges: vec![range(R0.0, R0.1)],
            }
        ),
        Err(ErrorCode::LimitExceeded)
    );
    t.check_consistent();
    // Unmapping gives the memory back; destroying the context gives back the rest.
    assert_eq!(
        t.req(1, c, Op::Unmap { va: 0x1000_0000 }),
        Ok(ReplyBody::Empty)
    );
    assert!(t.s.state().usage.page_table_bytes < held);
    assert_eq!(t.req(1, c, map(0x3000_0000)), Ok(ReplyBody::Empty));
    t.check_consistent();
    assert_eq!(t.req(1, c, Op::DestroyContext), Ok(ReplyBody::Empty));
    assert_eq!(t.s.state().usage.page_table_bytes, 0);
    assert_eq!(t.s.shared().stats().mappings, 0);
    t.assert_baseline();
}

#[test]
fn destroy_context_frees_everything() {
    let mut t = T::new();
    let c = t.ctx(1);
    let other = t.ctx(2);
    let (m, _) = t.alloc(1, c, 64 << 10, 64 << 10);
    let (m2, _) = t.alloc(1, c, 4096, 4096);
    t.req(
        1,
        c,
        Op::MapVram {
            mem: m,
            flags: 0,
            va: 0x100_0000,
            page: PAGE_64K,
        },
    )
    .unwrap();
    t.req(
        1,
        c,
        Op::MapGuest {
            va: 0x200_0000,
            page: PAGE_4K,
            flags: 0,
            ranges: vec![range(R0.0, 8192)],
        },
    )
    .unwrap();
    t.req(1, c, Op::MapAperture { mem: m2 }).unwrap();
    t.channel(1, c);
    t.channel(1, c);
    let (m_other, _) = t.alloc(2, other, 4096, 4096);
    t.check_consistent();
    assert_eq!(t.req(1, c, Op::DestroyContext), Ok(ReplyBody::Empty));
    t.check_consistent();
    let st = t.s.state();
    assert_eq!(st.contexts.len(), 1);
    assert_eq!(st.mems.keys().copied().collect::<Vec<_>>(), vec![m_other]);
    assert!(st.channels.is_empty() && st.mappings.is_empty());
    assert_eq!(t.stats().mapped_guest_bytes, 0);
    assert!(t.shm.live().is_empty());
    assert_eq!(t.req(2, other, Op::DestroyContext), Ok(ReplyBody::Empty));
    t.assert_baseline();
}

#[test]
fn teardown_frees_everything() {
    let mut t = T::new();
    for pid in 1..=3 {
        let c = t.ctx(pid);
        let (m, _) = t.alloc(pid, c, 4096, 4096);
        t.req(pid, c, Op::MapAperture { mem: m }).unwrap();
        t.req(
            pid,
            c,
            Op::MapVram {
                mem: m,
                flags: 0,
                va: 0x1000,
                page: PAGE_4K,
            },
        )
        .unwrap();
        t.channel(pid, c);
    }
    assert_ne!(t.gpu.stats(), t.baseline);
    t.s.teardown(&crate::shmem::NullShm);
    assert!(t.s.is_empty());
    t.assert_baseline();
    assert_eq!(
        t.stats(),
        StatsReply {
            vram_limit: 16 * MIB,
            ..StatsReply::default()
        }
    );
    // Dropping a non-empty session frees too.
    let c = t.ctx(9);
    t.alloc(9, c, 4096, 4096);
    let T {
        gpu, s, baseline, ..
    } = t;
    drop(s);
    assert_eq!(settled(&gpu, baseline), baseline);
}

#[test]
fn ids_are_per_vm() {
    let gpu = sim();
    let mut a = T::with(gpu.clone(), limits());
    let mut b = T::with(gpu, limits());
    let ca = a.ctx(1);
    let (ma, _) = a.alloc(1, ca, 4096, 4096);
    let (cha, _) = a.channel(1, ca);
    // VM b knows nothing of VM a's ids, even with the same PID.
    assert_eq!(b.req(1, ca, Op::DestroyContext), Err(ErrorCode::NotFound));
    assert_eq!(
        b.req(1, ca, Op::FreeMem { mem: ma }),
        Err(ErrorCode::NotFound)
    );
    let cb = b.ctx(1);
    assert_eq!(cb, ca, "same small id, different VM");
    assert_eq!(
        b.req(1, cb, Op::FreeMem { mem: ma }),
        Err(ErrorCode::NotFound)
    );
    assert_eq!(
        b.req(1, cb, Op::DestroyChannel { channel: cha }),
        Err(ErrorCode::NotFound)
    );
    assert_eq!(
        b.req(1, cb, Op::MapAperture { mem: ma }),
        Err(ErrorCode::NotFound)
    );
    assert_eq!(a.s.state().mems.len(), 1);
    assert_eq!(a.s.state().channels.len(), 1);
}

#[test]
fn malformed_requests_get_error_replies() {
    let mut t = T::new();
    let good = Request {
        pid: 1,
        ctx: 0,
        op: Op::CreateContext,
    }
    .encode();
    let cases: Vec<(Vec<u8>, ErrorCode)> = vec![
        (vec![], ErrorCode::InvalidArgument),
        (good[..15].to_vec(), ErrorCode::InvalidArgument),
        ([good.clone(), vec![0]].concat(), ErrorCode::InvalidArgument),
        (
            {
                let mut v = good.clone();
                v[0] = 99;
                v
            },
            ErrorCode::Unsupported,
        ),
        (
            {
                let mut v = good.clone();
                v[12] = 1;
                v
            },
            ErrorCode::InvalidArgument,
        ),
        (vec![0xff; 100_000], ErrorCode::InvalidArgument),
    ];
    for (bytes, code) in cases {
        let reply = t.raw(&bytes);
        assert_eq!(decode_reply(0, &reply), Ok(Err(code)));
    }
    assert_eq!(t.s.shared().stats().errors, 6);
    assert_eq!(t.s.reject(ErrorCode::InvalidArgument).len(), 8);
    assert!(t.s.is_empty());
}

// ---- property tests -----------------------------------------------------------------

fn arb_op() -> impl Strategy<Value = (u32, u32, Op)> {
    // Small id spaces so that ops hit existing objects often.
    let pid = 1..4u32;
    let ctx = 0..5u32;
    let mem = 0..8u32;
    let page = prop_oneof![
        3 => Just(PAGE_4K),
        1 => Just(PAGE_64K),
        1 => Just(PAGE_2M),
        1 => Just(7u32),
    ];
    let va = prop_oneof![
        3 => (0..64u64).prop_map(|p| p * 4096),
        1 => (0..8u64).prop_map(|p| p * 2 * MIB),
        1 => any::<u64>(),
    ];
    let gpa = prop_oneof![
        3 => (0..600u64).prop_map(|p| p * 4096),
        3 => (0..1100u64).prop_map(|p| R1.0 + p * 4096),
        1 => (0..3u64).prop_map(|p| R2.0 + p * 32768),
        1 => any::<u64>(),
    ];
    let len = prop_oneof![
        6 => (0..16u64).prop_map(|p| p * 4096),
        1 => Just(64 << 10),
        1 => Just(2 * MIB),
        1 => any::<u64>(),
    ];
    let ranges = proptest::collection::vec((gpa, len).prop_map(|(gpa, len)| range(gpa, len)), 1..4);
    let size = prop_oneof![
        4 => 1..70_000u64,
        1 => Just(2 * MIB),
        1 => Just(9 * MIB),
        1 => any::<u64>(),
    ];
    let align = prop_oneof![
        3 => Just(4096u64),
        1 => Just(65536),
        1 => Just(2 * MIB),
        1 => any::<u64>(),
    ];
    let op = prop_oneof![
        1 => Just(Op::GetInfo),
        1 => Just(Op::GetStats),
        3 => Just(Op::CreateContext),
        1 => Just(Op::DestroyContext),
        5 => (size, align).prop_map(|(size, align)| Op::AllocVram { size, align }),
        1 => mem.clone().prop_map(|mem| Op::FreeMem { mem }),
        4 => (mem.clone(), 0..2u32, va.clone(), page.clone()).prop_map(|(mem, flags, va, page)| {
            Op::MapVram {
                mem,
                flags,
                va,
                page,
            }
        }),
        4 => (va.clone(), page, 0..2u32, ranges).prop_map(|(va, page, flags, ranges)| {
            Op::MapGuest {
                va,
                page,
                flags,
                ranges,
            }
        }),
        2 => va.clone().prop_map(|va| Op::Unmap { va }),
        2 => mem.clone().prop_map(|mem| Op::MapAperture { mem }),
        1 => mem.prop_map(|mem| Op::UnmapAperture { mem }),
        2 => (va, prop_oneof![Just(64u32), Just(2), any::<u32>()]).prop_map(
            |(gp_ring_va, gp_entries)| Op::CreateChannel {
                gp_ring_va: gp_ring_va & !15,
                gp_entries,
            }
        ),
        1 => (0..8u32).prop_map(|channel| Op::DestroyChannel { channel }),
    ];
    (pid, ctx, op)
}

/// A step: a valid-looking op, raw bytes, or a frontend failure toggle.
#[derive(Debug, Clone)]
enum Step {
    /// An op; with `smart`, ids are redirected to existing objects and their owner.
    Op(u32, u32, Op, bool),
    Bytes(Vec<u8>),
    Mutated(u32, u32, Op, usize, u8),
    FailMap(bool),
    FailUnmap(bool),
}

fn arb_step() -> impl Strategy<Value = Step> {
    prop_oneof![
        8 => (arb_op(), proptest::bool::weighted(0.8))
            .prop_map(|((p, c, o), smart)| Step::Op(p, c, o, smart)),
        1 => proptest::collection::vec(any::<u8>(), 0..80).prop_map(Step::Bytes),
        1 => (arb_op(), any::<usize>(), any::<u8>())
            .prop_map(|((p, c, o), at, b)| Step::Mutated(p, c, o, at, b)),
        1 => any::<bool>().prop_map(Step::FailMap),
        1 => any::<bool>().prop_map(Step::FailUnmap),
    ]
}

/// Points a random op at existing objects: a live context and its owner, and that
/// context's VRAM objects, channels and mappings (ids picked by the random values).
fn aim(t: &T, pid: u32, ctx: u32, op: Op) -> (u32, u32, Op) {
    let st = t.s.state();
    let ctxs: Vec<(u32, u32)> = st.contexts.iter().map(|(c, s)| (*c, s.pid)).collect();
    if ctxs.is_empty() {
        return (pid, ctx, op);
    }
    let (ctx, pid) = ctxs[ctx as usize % ctxs.len()];
    let mems: Vec<u32> = st
        .mems
        .iter()
        .filter(|(_, m)| m.ctx == ctx)
        .map(|(id, _)| *id)
        .collect();
    let pick = |i: u32| {
        if mems.is_empty() {
            i
        } else {
            mems[i as usize % mems.len()]
        }
    };
    let op = match op {
        Op::FreeMem { mem } => Op::FreeMem { mem: pick(mem) },
        Op::MapAperture { mem } => Op::MapAperture { mem: pick(mem) },
        Op::UnmapAperture { mem } => Op::UnmapAperture { mem: pick(mem) },
        Op::MapVram {
            mem,
            flags,
            va,
            page,
        } => Op::MapVram {
            mem: pick(mem),
            flags,
            va,
            page,
        },
        Op::DestroyChannel { channel } => {
            let chans: Vec<u32> = st
                .channels
                .iter()
                .filter(|(_, c)| c.ctx == ctx)
                .map(|(id, _)| *id)
                .collect();
            Op::DestroyChannel {
                channel: if chans.is_empty() {
                    channel
                } else {
                    chans[channel as usize % chans.len()]
                },
            }
        }
        Op::Unmap { va } => {
            let vas: Vec<u64> = st
                .mappings
                .range((ctx, 0)..=(ctx, u64::MAX))
                .map(|((_, va), _)| *va)
                .collect();
            Op::Unmap {
                va: if vas.is_empty() {
                    va
                } else {
                    vas[(va % vas.len() as u64) as usize]
                },
            }
        }
        other => other,
    };
    (pid, ctx, op)
}

fn shared_sim() -> Arc<SimGpu> {
    // One GPU for all cases: engine threads are not free.
    static GPU: std::sync::OnceLock<Arc<SimGpu>> = std::sync::OnceLock::new();
    GPU.get_or_init(sim).clone()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..200)) {
        let mut t = T::with(shared_sim(), limits());
        let reply = t.raw(&b);
        prop_assert!(decode_reply(0, &reply).is_ok());
    }

    #[test]
    fn random_ops_keep_the_books_consistent(steps in proptest::collection::vec(arb_step(), 1..120)) {
        static SERIAL: Mutex<()> = Mutex::new(());
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let mut t = T::with(shared_sim(), limits());
        for step in steps {
            match step {
                Step::Op(pid, ctx, op, smart) => {
                    let (pid, ctx, op) = if smart { aim(&t, pid, ctx, op) } else { (pid, ctx, op) };
                    let opcode = Request { pid, ctx, op: op.clone() }.opcode();
                    let reply = t.raw(&Request { pid, ctx, op }.encode());
                    prop_assert!(decode_reply(opcode, &reply).is_ok());
                }
                Step::Bytes(b) => {
                    let reply = t.raw(&b);
                    prop_assert!(decode_reply(0, &reply).is_ok());
                }
                Step::Mutated(pid, ctx, op, at, byte) => {
                    let mut b = Request { pid, ctx, op }.encode();
                    let i = at % b.len();
                    b[i] = byte;
                    let reply = t.raw(&b);
                    prop_assert!(decode_reply(0, &reply).is_ok());
                }
                Step::FailMap(on) => t.shm.fail_map.store(on, Ordering::Relaxed),
                Step::FailUnmap(on) => t.shm.fail_unmap.store(on, Ordering::Relaxed),
            }
            t.check_consistent();
        }
        t.shm.fail_unmap.store(false, Ordering::Relaxed);
        t.s.teardown(&t.shm);
        prop_assert!(t.shm.live().is_empty());
        t.assert_baseline();
    }
}

/// Merges adjacent `offset -> len` ranges.
fn coalesce(ranges: &BTreeMap<u64, u64>) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (&off, &len) in ranges {
        match out.last_mut() {
            Some(last) if last.0 + last.1 == off => last.1 += len,
            _ => out.push((off, len)),
        }
    }
    out
}

// ---- live migration (crate::vm::migration) --------------------------------------------

/// A session with objects at non-trivial ids and places: two contexts (one id skipped),
/// a 3 MiB VRAM object with a pattern, mapped on the GPU and in the aperture, a guest
/// mapping, two channels with work queued in their shadow pages; paused for migration.
fn migration_source() -> (T, Vec<u32>) {
    use crate::shadow::Holder;
    let mut a = T::new();
    let c1 = a.ctx(7);
    let gone = a.ctx(7);
    a.req(7, gone, Op::DestroyContext).unwrap();
    let c2 = a.ctx(8);
    let (m1, size) = a.alloc(7, c1, 3 * MIB, 4096);
    let b = a.s.hal.vram[&m1].clone();
    for c in &b.chunks {
        if let crate::vram::backing::Loc::Vram(o) = c.loc {
            let bytes: Vec<u8> = (0..c.len).map(|i| ((c.off + i) * 31 % 251) as u8).collect();
            a.gpu.vram_write(o, &bytes).unwrap();
        }
    }
    let map = Op::MapVram {
        mem: m1,
        flags: 0,
        va: 0x40_0000_0000,
        page: PAGE_4K,
    };
    a.req(7, c1, map).unwrap();
    a.req(7, c1, Op::MapAperture { mem: m1 }).unwrap();
    let guest = Op::MapGuest {
        va: 0x20_0000,
        page: PAGE_4K,
        flags: MAP_READ_ONLY,
        ranges: vec![range(R1.0, 0x2000), range(R0.0 + 0x1000, 0x1000)],
    };
    a.req(8, c2, guest).unwrap();
    let (ch1, _) = a.channel(7, c1);
    let (ch2, _) = a.channel(8, c2);
    assert_eq!(size, 3 * MIB);
    a.s.hold.paused = true;
    for ch in [ch1, ch2] {
        a.s.hold_channel(ch, Holder::Operator, true, &a.shm)
            .unwrap();
    }
    (a, vec![ch1, ch2])
}

#[test]
fn migration_round_trip_restores_everything_at_the_same_places() {
    use vgpu_protocol::migration::{DeviceState, VmRecord};
    let (mut a, chans) = migration_source();
    // The guest submitted 3 entries to channel 1 while paused.
    assert!(a.s.shadows.raise_shadow_put(chans[0], 3));
    let st = a.s.save_device_state(VmRecord::default()).unwrap();
    let st = DeviceState::decode(&st.encode()).unwrap();
    assert_eq!(st.channels[0].gp_put, 3);
    assert_eq!(st.mems[0].data.len() as u64, 3 * MIB);
    assert!(st.mems[0]
        .data
        .iter()
        .enumerate()
        .all(|(i, &v)| v == (i as u64 * 31 % 251) as u8));

    let mut b = T::new();
    b.s.load_device_state(&st, &b.mem, &b.shm).unwrap();
    assert_eq!(b.s.state.contexts, a.s.state.contexts);
    assert_eq!(b.s.state.mems, a.s.state.mems);
    assert_eq!(b.s.state.mappings, a.s.state.mappings);
    assert_eq!(b.s.state.channels, a.s.state.channels);
    assert_eq!(b.s.state.usage, a.s.state.usage);
    // Every BAR view at the same offset; channels shadowed with the guest's GP_PUT.
    let (av, bv) = (a.shm.live(), b.shm.live());
    assert_eq!(av, bv);
    for &ch in &chans {
        assert!(b.s.is_shadowed(ch));
        assert_eq!(
            b.s.peek_channel_any(ch).unwrap(),
            a.s.peek_channel_any(ch).unwrap()
        );
    }
    // Same contents: the destination saves what the source saved.
    let again = b.s.save_device_state(VmRecord::default()).unwrap();
    assert_eq!(again.mems, st.mems);
    assert_eq!(again.channels, st.channels);
    // New ids continue after the saved ones.
    let c3 = b.ctx(9);
    assert!(c3 > *st.contexts.iter().map(|c| &c.id).max().unwrap());
}

#[test]
fn a_hostile_state_is_refused_and_leaves_the_destination_empty() {
    use vgpu_protocol::migration::{DeviceState, MappingTargetRecord, VmRecord};
    let (mut a, _) = migration_source();
    let st = a.s.save_device_state(VmRecord::default()).unwrap();
    let mut cases: Vec<(&str, DeviceState)> = Vec::new();
    let mut s = st.clone();
    s.channels[1].slot = s.channels[0].slot;
    cases.push(("two channels in one slot", s));
    let mut s = st.clone();
    s.channels[1].id = s.channels[0].id;
    cases.push(("duplicate channel id", s));
    let mut s = st.clone();
    s.contexts[1].id = s.contexts[0].id;
    cases.push(("duplicate context id", s));
    let mut s = st.clone();
    s.channels[0].pid = 999;
    cases.push(("channel in another process's context", s));
    let mut s = st.clone();
    s.mems[0].data.truncate(10);
    cases.push(("short VRAM contents", s));
    let mut s = st.clone();
    s.mems[0].aperture = Some(3);
    cases.push(("misaligned aperture", s));
    let mut s = st.clone();
    s.mappings[0].va += 1;
    cases.push(("misaligned mapping", s));
    let mut s = st.clone();
    if let MappingTargetRecord::Guest { ranges } = &mut s.mappings[1].target {
        ranges[0].0 = 64 << 30;
    }
    cases.push(("guest range outside RAM", s));
    let mut s = st.clone();
    s.channels[0].error = Some((0xdead, 0));
    cases.push(("unknown error code", s));
    let mut s = st.clone();
    s.channels[0].slot = CHANNEL_SLOTS;
    cases.push(("slot outside the BAR", s));
    for (what, s) in cases {
        let mut b = T::new();
        let r = b.s.load_device_state(&s, &b.mem, &b.shm);
        assert!(r.is_err(), "{what}: accepted");
        assert!(b.s.is_empty(), "{what}: objects left");
        assert!(b.shm.live().is_empty(), "{what}: BAR views left");
        b.assert_baseline();
    }
    // A destination that already serves objects refuses any state.
    let mut b = T::new();
    b.ctx(1);
    assert!(matches!(
        b.s.load_device_state(&st, &b.mem, &b.shm),
        Err(crate::vm::migration::MigrationError::NotEmpty)
    ));
}

/// The fake cuda GPU set up as a worker sets it up: guest modules load.
fn module_gpu() -> Arc<vgpu_host_shim::cuda::FakeCudaGpu> {
    use vgpu_host_shim::cuda::{CudaConfig, FakeCudaGpu, FakeDevice};
    FakeCudaGpu::with_device(
        Arc::new(FakeDevice::default()),
        CudaConfig {
            vram_bytes: 64 * MIB,
            guest_modules: true,
            ..CudaConfig::default()
        },
    )
    .unwrap()
}

/// The module requests on a GPU that loads guest modules (the fake cuda GPU as a worker
/// sets it up), one request at a time: the image is read from guest RAM, ids are fresh,
/// ownership and limits are checked, a destroyed context takes its modules, and a live
/// migration carries the modules, their variables and bindings.
#[test]
fn module_requests_check_everything_and_migrate() {
    use vgpu_protocol::migration::VmRecord;
    let mut s = Session::new(module_gpu(), limits());
    let (mem, shm) = (guest_mem(), FakeShm::default());
    let req = |s: &mut Session, pid, ctx, op| {
        let r = Request { pid, ctx, op };
        decode_reply(r.opcode(), &s.handle(&r.encode(), &mem, &shm)).unwrap()
    };
    let ptx = b".version 7.0\n.target sm_50\n.global .u32 g;\n.entry k(\n.param .u64 p,\n.param .u32 n\n)\n{\nret;\n}\n";
    // The image spans two guest RAM regions, in order.
    let (head, tail) = ptx.split_at(40);
    use vm_memory::Bytes;
    mem.write_slice(head, GuestAddress(R0.0 + 0x1000)).unwrap();
    mem.write_slice(tail, GuestAddress(R1.0)).unwrap();
    let ranges = vec![
        range(R0.0 + 0x1000, head.len() as u64),
        range(R1.0, tail.len() as u64),
    ];
    let Ok(ReplyBody::Context { ctx, .. }) = req(&mut s, 7, 0, Op::CreateContext) else {
        panic!("no context");
    };
    // Ownership before anything is read: another process, an unknown context.
    let load = |ranges: &Vec<GuestRange>| Op::ModuleLoad {
        ranges: ranges.clone(),
    };
    assert_eq!(
        req(&mut s, 8, ctx, load(&ranges)),
        Err(ErrorCode::PermissionDenied)
    );
    assert_eq!(
        req(&mut s, 7, ctx + 1, load(&ranges)),
        Err(ErrorCode::NotFound)
    );
    // A range outside guest RAM.
    let outside = vec![range(3 << 30, 4096)];
    assert_eq!(
        req(&mut s, 7, ctx, load(&outside)),
        Err(ErrorCode::InvalidArgument)
    );
    let Ok(ReplyBody::Module { module }) = req(&mut s, 7, ctx, load(&ranges)) else {
        panic!("the module loads");
    };
    assert_ne!(module, 0);
    // What the guest writes there afterwards changes nothing (read once).
    mem.write_slice(&[0xff; 16], GuestAddress(R0.0 + 0x1000))
        .unwrap();
    let get = |module, name: &[u8]| Op::FunctionGet {
        module,
        name: name.to_vec(),
    };
    let Ok(ReplyBody::Function(f)) = req(&mut s, 7, ctx, get(module, b"k")) else {
        panic!("function k");
    };
    let layout: Vec<(u32, u32)> = f
        .params
        .unwrap()
        .iter()
        .map(|p| (p.offset, p.size))
        .collect();
    assert_eq!(layout, [(0, 8), (8, 4)]);
    assert_eq!(
        req(&mut s, 7, ctx, get(module, b"nope")),
        Err(ErrorCode::NotFound)
    );
    assert_eq!(
        req(&mut s, 7, ctx, get(module + 1, b"k")),
        Err(ErrorCode::NotFound)
    );
    assert_eq!(
        req(&mut s, 8, ctx, get(module, b"k")),
        Err(ErrorCode::PermissionDenied)
    );
    let Ok(ReplyBody::Global { size, .. }) = req(
        &mut s,
        7,
        ctx,
        Op::GlobalGet {
            module,
            name: b"g".to_vec(),
        },
    ) else {
        panic!("global g");
    };
    assert_eq!(size, 4);
    // A migration carries the module, its variable's contents and the binding: the
    // destination has them at the same ids.
    let hctx = s.hal.contexts[&ctx].0;
    s.gpu
        .global_write(hctx, module, "g", 0, &0x1234_5678u32.to_le_bytes())
        .unwrap();
    s.hold.paused = true;
    let st = s.save_device_state(VmRecord::default()).unwrap();
    let st = vgpu_protocol::migration::DeviceState::decode(&st.encode()).unwrap();
    assert_eq!(st.modules.modules.len(), 1);
    assert_eq!(
        st.modules.modules[0].variables,
        [("g".to_string(), 0x1234_5678u32.to_le_bytes().to_vec())]
    );
    assert_eq!(st.modules.functions[0].name, "k");
    s.hold.paused = false;
    let mut d = Session::new(module_gpu(), limits());
    d.load_device_state(&st, &mem, &shm).unwrap();
    assert_eq!(
        d.state.modules.keys().copied().collect::<Vec<_>>(),
        [module]
    );
    assert_eq!(
        d.state.modules[&module].image,
        s.state.modules[&module].image
    );
    assert_eq!(d.state.functions, s.state.functions);
    let dctx = d.hal.contexts[&ctx].0;
    let mut got = [0u8; 4];
    d.gpu.global_read(dctx, module, "g", 0, &mut got).unwrap();
    assert_eq!(u32::from_le_bytes(got), 0x1234_5678);
    // Fresh ids on the destination continue after the source's.
    d.hold.paused = false;
    let Ok(ReplyBody::Function(f2)) = req(&mut d, 7, ctx, get(module, b"k")) else {
        panic!("k again on the destination");
    };
    assert!(f2.function > st.modules.functions[0].id);
    // Unload, then again: gone.
    assert_eq!(
        req(&mut s, 7, ctx, Op::ModuleUnload { module }),
        Ok(ReplyBody::Empty)
    );
    assert_eq!(
        req(&mut s, 7, ctx, Op::ModuleUnload { module }),
        Err(ErrorCode::NotFound)
    );
    assert!(s.state.functions.is_empty());
    // The overwritten image no longer loads; restored, it does.
    assert_eq!(
        req(&mut s, 7, ctx, load(&ranges)),
        Err(ErrorCode::BadModule)
    );
    mem.write_slice(head, GuestAddress(R0.0 + 0x1000)).unwrap();
    // A destroyed context takes its modules; ids are not reused.
    let Ok(ReplyBody::Module { module: m2 }) = req(&mut s, 7, ctx, load(&ranges)) else {
        panic!("loads again");
    };
    assert_ne!(m2, module);
    req(&mut s, 7, ctx, Op::DestroyContext).unwrap();
    assert!(s.state.modules.is_empty());
    s.hold.paused = true;
    assert!(s.save_device_state(VmRecord::default()).is_ok());
}

/// A fatbin nvcc packed with LZ4 (`--compress-mode=speed -Xfatbin -compress-all`, as
/// older nvcc did by default) migrates with its variable: the source lists it from the
/// unpacked image, the destination gets its contents.
#[test]
fn an_lz4_packed_fatbins_variable_migrates() {
    use vgpu_protocol::migration::VmRecord;
    use vm_memory::Bytes;
    let image = include_bytes!("../../../protocol/tests/data/matmul_sm75_lz4.fatbin");
    let mut s = Session::new(module_gpu(), limits());
    let (mem, shm) = (guest_mem(), FakeShm::default());
    let req = |s: &mut Session, ctx, op| {
        let r = Request { pid: 7, ctx, op };
        decode_reply(r.opcode(), &s.handle(&r.encode(), &mem, &shm)).unwrap()
    };
    mem.write_slice(image, GuestAddress(R0.0 + 0x1000)).unwrap();
    let Ok(ReplyBody::Context { ctx, .. }) = req(&mut s, 0, Op::CreateContext) else {
        panic!("no context");
    };
    let load = Op::ModuleLoad {
        ranges: vec![range(R0.0 + 0x1000, image.len() as u64)],
    };
    let Ok(ReplyBody::Module { module }) = req(&mut s, ctx, load) else {
        panic!("the fatbin loads");
    };
    let hctx = s.hal.contexts[&ctx].0;
    s.gpu
        .global_write(hctx, module, "calls", 0, &41u32.to_le_bytes())
        .unwrap();
    s.hold.paused = true;
    let st = s.save_device_state(VmRecord::default()).unwrap();
    assert_eq!(
        st.modules.modules[0].variables,
        [("calls".to_string(), 41u32.to_le_bytes().to_vec())]
    );
    let mut d = Session::new(module_gpu(), limits());
    d.load_device_state(&st, &mem, &shm).unwrap();
    let mut got = [0u8; 4];
    d.gpu
        .global_read(d.hal.contexts[&ctx].0, module, "calls", 0, &mut got)
        .unwrap();
    assert_eq!(u32::from_le_bytes(got), 41);
}

#[test]
fn the_sim_refuses_module_loads_with_its_code() {
    let mut t = T::new();
    let ctx = t.ctx(1);
    let r = t.req(
        1,
        ctx,
        Op::ModuleLoad {
            ranges: vec![range(R0.0, 64)],
        },
    );
    assert_eq!(r, Err(ErrorCode::ModulesNeedCudaGpu));
    assert!(t.s.state.modules.is_empty());
}
