//! Request-handler tests without a socket: a `Session` over a `SimGpu`, a test guest
//! memory and a fake `ShmMapper` that records SHMEM_MAP/UNMAP calls. This module holds
//! the fixture; the tests are in one module per subject.

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

mod channels;
mod lifecycle;
mod migration;
mod modules;
mod property;
mod resources;

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

/// A guest range of `len` bytes at guest-physical `gpa`.
fn range(gpa: u64, len: u64) -> GuestRange {
    GuestRange { gpa, len }
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
