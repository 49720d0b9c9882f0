//! A move on a GPU without a CPU view of VRAM (the `cuda` GPU) copies all its chunks in
//! one batched HAL call each way, and the bytes arrive exactly.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vgpu_host_shim::hal::Result;
use vgpu_host_shim::{
    ChannelConfig, ChannelCounters, ChannelId, ContextId, EventSink, FdRange, Gpu, GpuInfo,
    MapFlags, MapTarget, PageSize, SimConfig, SimGpu, SysMemory, VramAlloc,
};
use vgpu_protocol::request::{Op, ReplyBody, Request};
use vgpu_protocol::ErrorCode;
use vm_memory::GuestAddress;

use crate::guest_mem::GuestMemory;
use crate::shmem::ShmMapper;
use crate::vm::session::{Session, VmLimits};
use crate::vram::backing::Loc;
use crate::vram::handle::Dir;

const MIB: u64 = 1 << 20;

/// The sim without a CPU view of VRAM, counting host copies: single ones, and the
/// number of buffers in each batched call.
struct NoCpuView {
    inner: Arc<SimGpu>,
    single: AtomicU32,
    batches: Mutex<Vec<(Dir, usize)>>,
}

impl Gpu for NoCpuView {
    fn info(&self) -> GpuInfo {
        self.inner.info()
    }
    fn create_context(&self, sysmem: Arc<dyn SysMemory>) -> Result<ContextId> {
        self.inner.create_context(sysmem)
    }
    fn destroy_context(&self, ctx: ContextId) -> Result<()> {
        self.inner.destroy_context(ctx)
    }
    fn alloc_vram(&self, size: u64, align: u64) -> Result<VramAlloc> {
        self.inner.alloc_vram(size, align)
    }
    fn free_vram(&self, offset: u64) -> Result<()> {
        self.inner.free_vram(offset)
    }
    fn vram_free_bytes(&self) -> u64 {
        self.inner.vram_free_bytes()
    }
    fn vram_fd(&self) -> Option<FdRange> {
        None
    }
    fn vram_read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.single.fetch_add(1, Ordering::Relaxed);
        self.inner.vram_read(offset, buf)
    }
    fn vram_write(&self, offset: u64, buf: &[u8]) -> Result<()> {
        self.single.fetch_add(1, Ordering::Relaxed);
        self.inner.vram_write(offset, buf)
    }
    fn vram_read_many(&self, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        self.batches.lock().unwrap().push((Dir::Out, reads.len()));
        self.inner.vram_read_many(reads)
    }
    fn vram_write_many(&self, writes: &[(u64, &[u8])]) -> Result<()> {
        self.batches.lock().unwrap().push((Dir::In, writes.len()));
        self.inner.vram_write_many(writes)
    }
    fn map(
        &self,
        ctx: ContextId,
        va: u64,
        size: u64,
        target: MapTarget,
        page: PageSize,
        flags: MapFlags,
    ) -> Result<()> {
        self.inner.map(ctx, va, size, target, page, flags)
    }
    fn unmap(&self, ctx: ContextId, va: u64, size: u64) -> Result<()> {
        self.inner.unmap(ctx, va, size)
    }
    fn page_table_bytes(&self, ctx: ContextId) -> Result<u64> {
        self.inner.page_table_bytes(ctx)
    }
    fn map_cost(&self, ctx: ContextId, va: u64, size: u64, page: PageSize) -> Result<u64> {
        self.inner.map_cost(ctx, va, size, page)
    }
    fn remap(&self, ctx: ContextId, va: u64, size: u64, target: MapTarget) -> Result<()> {
        self.inner.remap(ctx, va, size, target)
    }
    fn invalidate_tlb(&self, ctx: ContextId) -> Result<()> {
        self.inner.invalidate_tlb(ctx)
    }
    fn access_counts(
        &self,
        ctx: ContextId,
        va: u64,
        size: u64,
        reset: bool,
    ) -> Result<Vec<(u64, u32)>> {
        self.inner.access_counts(ctx, va, size, reset)
    }
    fn create_channel(
        &self,
        ctx: ContextId,
        cfg: ChannelConfig,
        sink: Arc<dyn EventSink>,
    ) -> Result<ChannelId> {
        self.inner.create_channel(ctx, cfg, sink)
    }
    fn destroy_channel(&self, ch: ChannelId) -> Result<()> {
        self.inner.destroy_channel(ch)
    }
    fn control_page(&self, ch: ChannelId) -> Result<FdRange> {
        self.inner.control_page(ch)
    }
    fn doorbell(&self, ch: ChannelId) {
        self.inner.doorbell(ch)
    }
    fn channel_counters(&self, ch: ChannelId) -> Result<ChannelCounters> {
        self.inner.channel_counters(ch)
    }
    fn channel_error(&self, ch: ChannelId) -> Result<Option<(ErrorCode, u64)>> {
        self.inner.channel_error(ch)
    }
    fn kill_channel(&self, ch: ChannelId, code: ErrorCode) -> Result<()> {
        self.inner.kill_channel(ch, code)
    }
}

/// Maps nothing (the object has no CPU view to map).
struct NoMaps;

impl ShmMapper for NoMaps {
    fn map(
        &self,
        _: u64,
        _: std::os::fd::RawFd,
        _: u64,
        _: u64,
        _: bool,
    ) -> std::result::Result<(), crate::error::ShmError> {
        panic!("a move without a CPU view mapped one")
    }
    fn unmap(&self, _: u64, _: u64) -> std::result::Result<(), crate::error::ShmError> {
        Ok(())
    }
}

/// The VRAM offsets of object `obj`'s chunks (all resident).
fn vram_chunks(s: &Session, obj: u32) -> Vec<(u64, u64)> {
    s.hal.vram[&obj]
        .chunks
        .iter()
        .map(|c| match c.loc {
            Loc::Vram(o) => (o, c.len),
            Loc::Swap => panic!("chunk at {:#x} is not resident", c.off),
        })
        .collect()
}

#[test]
fn a_move_without_a_cpu_view_copies_every_chunk_in_one_batch_exactly() {
    let inner = SimGpu::new(SimConfig {
        vram_bytes: 32 * MIB,
        ..SimConfig::default()
    })
    .unwrap();
    let gpu = Arc::new(NoCpuView {
        inner,
        single: AtomicU32::new(0),
        batches: Mutex::new(Vec::new()),
    });
    let limits = VmLimits {
        swap_bytes: 32 * MIB,
        ..VmLimits::default()
    };
    let mut s = Session::new(gpu.clone(), limits);
    let mem = GuestMemory::from_ranges(&[(GuestAddress(0x10000), 0x10000)]).unwrap();
    let shm = NoMaps;
    let req = |s: &mut Session, ctx: u32, op: Op| {
        s.execute(&Request { pid: 7, ctx, op }, &mem, &shm).unwrap()
    };
    let ReplyBody::Context { ctx } = req(&mut s, 0, Op::CreateContext) else {
        panic!("context");
    };
    // Three chunks, the last one short.
    let ReplyBody::Mem { mem: obj, .. } = req(
        &mut s,
        ctx,
        Op::AllocVram {
            size: 5 * MIB,
            align: 2 * MIB,
        },
    ) else {
        panic!("alloc");
    };
    let pattern = |k: usize, len: u64| -> Vec<u8> {
        (0..len as usize)
            .map(|i| (i.wrapping_mul(31) ^ (k * 0x55)) as u8)
            .collect()
    };
    for (k, (o, len)) in vram_chunks(&s, obj).into_iter().enumerate() {
        gpu.inner.vram_write(o, &pattern(k, len)).unwrap();
    }
    let t = Duration::from_secs(1);
    let out = s
        .move_chunks(obj, &[0, 1, 2], Dir::Out, &NoMaps, t)
        .unwrap();
    assert_eq!((out.chunks, out.bytes), (3, 5 * MIB));
    let back = s.move_chunks(obj, &[0, 1, 2], Dir::In, &NoMaps, t).unwrap();
    assert_eq!((back.chunks, back.bytes), (3, 5 * MIB));
    assert_eq!(
        *gpu.batches.lock().unwrap(),
        [(Dir::Out, 3), (Dir::In, 3)],
        "one batched call per move"
    );
    assert_eq!(gpu.single.load(Ordering::Relaxed), 0);
    // The bytes went out to swap and came back to (new) VRAM unchanged.
    for (k, (o, len)) in vram_chunks(&s, obj).into_iter().enumerate() {
        let mut got = vec![0u8; len as usize];
        gpu.inner.vram_read(o, &mut got).unwrap();
        assert!(
            got == pattern(k, len),
            "chunk {k} differs after a round trip"
        );
    }
}
