//! A GPU HAL without busy counters: wraps another HAL and reports
//! `has_busy_counters: false` and zero busy time, as a GPU without per-channel
//! accounting would. Everything else passes through. The scheduler then has to fall back
//! to GP_GET progress (the `sampling` policy); benchmarks measure the real shares from the
//! tenants' kernel counts.

use std::sync::Arc;

use vgpu_host_shim::hal::Result;
use vgpu_host_shim::{
    ChannelConfig, ChannelCounters, ChannelId, ContextId, EventSink, FdRange, Gpu, GpuInfo,
    MapFlags, MapTarget, PageSize, SysMemory, VramAlloc,
};
use vgpu_protocol::ErrorCode;

pub struct HiddenCounters {
    inner: Arc<dyn Gpu>,
}

impl HiddenCounters {
    pub fn new(inner: Arc<dyn Gpu>) -> Self {
        HiddenCounters { inner }
    }
}

impl Gpu for HiddenCounters {
    fn info(&self) -> GpuInfo {
        GpuInfo {
            has_busy_counters: false,
            ..self.inner.info()
        }
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
        self.inner.vram_fd()
    }
    fn prepare_sysram_hint(&self, ctx: ContextId, addr: u64, len: u64) -> Result<()> {
        self.inner.prepare_sysram_hint(ctx, addr, len)
    }
    fn release_sysram_hint(&self, ctx: ContextId, addr: u64, len: u64) {
        self.inner.release_sysram_hint(ctx, addr, len)
    }
    fn vram_read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.inner.vram_read(offset, buf)
    }
    fn vram_write(&self, offset: u64, buf: &[u8]) -> Result<()> {
        self.inner.vram_write(offset, buf)
    }
    fn vram_read_many(&self, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        self.inner.vram_read_many(reads)
    }
    fn vram_write_many(&self, writes: &[(u64, &[u8])]) -> Result<()> {
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
        Ok(ChannelCounters {
            busy_ns: 0,
            sem_wait_ns: 0,
            ..self.inner.channel_counters(ch)?
        })
    }
    fn channel_error(&self, ch: ChannelId) -> Result<Option<(ErrorCode, u64)>> {
        self.inner.channel_error(ch)
    }
    fn kill_channel(&self, ch: ChannelId, code: ErrorCode) -> Result<()> {
        self.inner.kill_channel(ch, code)
    }
}
