//! `sim`: a software GPU that behaves like the Fermi-class hardware in the seeds —
//! memory-mapped channel control pages polled by a round-robin PFIFO, non-preemptible
//! kernels, a concurrent copy engine, a paging MMU per context, and per-channel counters.

mod channel;
pub(crate) mod control_pages;
mod copy_engine;
mod exec;
mod pfifo;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::thread::{JoinHandle, Thread};

use vgpu_protocol::ErrorCode;

use self::channel::SimChannel;
use self::control_pages::ControlPages;
use self::exec::{Step, WorkItem};
use crate::hal::*;
use crate::host_copy_log::{self, CopyDir, HostCopy, HostCopyLog};
use crate::mmu::AddressSpace;
use crate::shared_mem::SharedMem;
use crate::vram::VramAllocator;
use crate::vram_pool::{self, VramPool};

/// Sizes and polling behaviour of a sim GPU.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub vram_bytes: u64,
    pub compute_engines: u32,
    pub max_channels: u32,
    pub max_contexts: u32,
    /// After activity, the PFIFO busy-polls this long before it starts sleeping.
    pub busy_poll_ns: u64,
    /// Shortest and longest sleep between polls when idle (the sleep doubles each time).
    pub min_idle_sleep_ns: u64,
    pub max_idle_sleep_ns: u64,
    /// Spin kernels are timed by sleeping, then spinning for this last stretch.
    pub spin_window_ns: u64,
    /// A GPU without per-channel accounting: `has_busy_counters` is false and channel
    /// counters report no busy or semaphore-wait time (the `sampling` policy's case).
    pub hide_busy_counters: bool,
    /// A GPU without a CPU view of VRAM (`vram_fd` is `None`), like `cuda`: its owner
    /// copies VRAM through the HAL.
    pub hide_vram_view: bool,
    /// Records every host copy to or from VRAM.
    pub host_copy_log: Option<Arc<HostCopyLog>>,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            vram_bytes: 1 << 30,
            compute_engines: 1,
            max_channels: 256,
            max_contexts: 256,
            busy_poll_ns: 200_000,
            min_idle_sleep_ns: 10_000,
            max_idle_sleep_ns: 250_000,
            spin_window_ns: 20_000,
            hide_busy_counters: false,
            hide_vram_view: false,
            host_copy_log: None,
        }
    }
}

/// Work handed to the copy engine.
pub(crate) struct CopyJob {
    ch: Arc<SimChannel>,
    item: WorkItem,
}

/// The copy engine's answer.
pub(crate) struct CopyResult {
    chan: ChannelId,
    item: WorkItem,
    step: Step,
    busy_ns: u64,
    /// Where the item started on the copy engine (to tell a bare stall from progress).
    pc_before: usize,
}

/// State shared by the API, the PFIFO thread and the copy engine.
pub(crate) struct Shared {
    cfg: SimConfig,
    vram: SharedMem,
    channels: RwLock<BTreeMap<ChannelId, Arc<SimChannel>>>,
    /// Bumped whenever `channels` changes, so the PFIFO re-reads it only then.
    gen: AtomicU64,
    copy_done: Mutex<Vec<CopyResult>>,
    shutdown: AtomicBool,
    pfifo_thread: OnceLock<Thread>,
    pfifo_cpu_ns: AtomicU64,
    copy_cpu_ns: AtomicU64,
}

impl Shared {
    fn channels_snapshot(&self) -> Vec<Arc<SimChannel>> {
        self.channels
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }

    fn take_copy_results(&self) -> Vec<CopyResult> {
        std::mem::take(&mut *self.copy_done.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn push_copy_result(&self, r: CopyResult) {
        self.copy_done
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(r);
        self.wake_pfifo();
    }

    fn wake_pfifo(&self) {
        if let Some(t) = self.pfifo_thread.get() {
            t.unpark();
        }
    }
}

struct Context {
    space: Arc<AddressSpace>,
    busy_ns: Arc<AtomicU64>,
}

/// Counts of live objects, for leak checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimStats {
    pub contexts: usize,
    pub channels: usize,
    pub control_slots_in_use: usize,
    pub vram_allocations: usize,
    pub vram_free_bytes: u64,
}

/// The sim GPU. Dropping it stops its engine threads.
pub struct SimGpu {
    shared: Arc<Shared>,
    pages: Arc<ControlPages>,
    vram_alloc: VramPool,
    /// Read on every map/unmap/invalidate of any VM, written only when a context comes or
    /// goes: a reader-writer lock, so that one VM's page-table calls never queue behind
    /// another's (issue 16).
    contexts: RwLock<HashMap<ContextId, Context>>,
    /// VRAM size (fixed): `info()` needs no allocator lock.
    vram_bytes: u64,
    next_context: AtomicU32,
    next_channel: AtomicU32,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

fn os_err(e: impl std::fmt::Display) -> HalError {
    HalError::Os(e.to_string())
}

impl SimGpu {
    pub fn new(cfg: SimConfig) -> Result<Arc<Self>> {
        if cfg.compute_engines == 0 || cfg.max_channels == 0 || cfg.vram_bytes < 1 << 20 {
            return Err(HalError::InvalidArgument(
                "sim needs at least one engine, one channel and 1 MiB of VRAM",
            ));
        }
        let vram = SharedMem::new("vgpu-vram", cfg.vram_bytes).map_err(os_err)?;
        let pages = Arc::new(ControlPages::new(cfg.max_channels).map_err(os_err)?);
        let shared = Arc::new(Shared {
            vram,
            channels: RwLock::new(BTreeMap::new()),
            gen: AtomicU64::new(0),
            copy_done: Mutex::new(Vec::new()),
            shutdown: AtomicBool::new(false),
            pfifo_thread: OnceLock::new(),
            pfifo_cpu_ns: AtomicU64::new(0),
            copy_cpu_ns: AtomicU64::new(0),
            cfg: cfg.clone(),
        });
        let (tx, rx) = mpsc::channel();
        let s = shared.clone();
        let copy = std::thread::Builder::new()
            .name("sim-copy".into())
            .spawn(move || {
                vgpu_sandbox::enter(vgpu_sandbox::Role::GpuEngine);
                copy_engine::run(s, rx)
            })
            .map_err(os_err)?;
        let s = shared.clone();
        let pfifo = std::thread::Builder::new()
            .name("sim-pfifo".into())
            .spawn(move || {
                vgpu_sandbox::enter(vgpu_sandbox::Role::GpuEngine);
                pfifo::Pfifo::new(s, tx).run()
            })
            .map_err(os_err)?;
        let _ = shared.pfifo_thread.set(pfifo.thread().clone());
        Ok(Arc::new(SimGpu {
            shared,
            pages,
            vram_alloc: VramPool::new(cfg.vram_bytes),
            contexts: RwLock::new(HashMap::new()),
            vram_bytes: cfg.vram_bytes,
            next_context: AtomicU32::new(1),
            next_channel: AtomicU32::new(1),
            threads: Mutex::new(vec![pfifo, copy]),
        }))
    }

    fn read_contexts(&self) -> std::sync::RwLockReadGuard<'_, HashMap<ContextId, Context>> {
        self.contexts.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write_contexts(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<ContextId, Context>> {
        self.contexts.write().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_vram(&self) -> std::sync::MutexGuard<'_, VramAllocator> {
        self.vram_alloc.lock()
    }

    fn space(&self, ctx: ContextId) -> Result<Arc<AddressSpace>> {
        self.read_contexts()
            .get(&ctx)
            .map(|c| c.space.clone())
            .ok_or(HalError::NoContext(ctx))
    }

    /// Engine time used by all channels a context ever had (tools and demos; the backend
    /// keeps its own books from channel counters).
    pub fn context_busy_ns(&self, ctx: ContextId) -> Result<u64> {
        self.read_contexts()
            .get(&ctx)
            .map(|c| c.busy_ns.load(Ordering::Relaxed))
            .ok_or(HalError::NoContext(ctx))
    }

    fn channel(&self, ch: ChannelId) -> Result<Arc<SimChannel>> {
        self.shared
            .channels
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&ch)
            .cloned()
            .ok_or(HalError::NoChannel(ch))
    }

    fn remove_channels(&self, pred: impl Fn(&SimChannel) -> bool) -> usize {
        let mut chans = self
            .shared
            .channels
            .write()
            .unwrap_or_else(|e| e.into_inner());
        let before = chans.len();
        chans.retain(|_, c| {
            let drop_it = pred(c);
            if drop_it {
                c.stop();
            }
            !drop_it
        });
        let removed = before - chans.len();
        drop(chans);
        if removed > 0 {
            self.shared.gen.fetch_add(1, Ordering::AcqRel);
            self.shared.wake_pfifo();
        }
        removed
    }

    /// Live object counts.
    pub fn stats(&self) -> SimStats {
        let vram = self.lock_vram();
        SimStats {
            contexts: self.read_contexts().len(),
            channels: self
                .shared
                .channels
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .len(),
            control_slots_in_use: self.pages.slots_in_use(),
            vram_allocations: vram.allocations(),
            vram_free_bytes: vram.free_bytes(),
        }
    }

    /// CPU time the GPU model's own threads (PFIFO and copy engine) have consumed, in ns.
    /// Benchmarks report it so that no figure is an artifact of engine threads competing
    /// with the workload for a core.
    pub fn engine_cpu_ns(&self) -> u64 {
        self.shared.pfifo_cpu_ns.load(Ordering::Relaxed)
            + self.shared.copy_cpu_ns.load(Ordering::Relaxed)
    }

    /// Every live channel with its context and counters (for tools and demos; the backend
    /// keeps its own books).
    pub fn channels(&self) -> Vec<(ChannelId, ContextId, ChannelCounters)> {
        self.shared
            .channels_snapshot()
            .iter()
            .map(|c| (c.id, c.ctx, c.counters()))
            .collect()
    }

    /// Mapped pages in a context (leak checks).
    pub fn mapped_pages(&self, ctx: ContextId) -> Result<usize> {
        Ok(self.space(ctx)?.mapped_pages())
    }
}

impl Drop for SimGpu {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared.wake_pfifo();
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|e| e.into_inner()));
        for t in threads {
            let _ = t.join();
        }
    }
}

impl Gpu for SimGpu {
    fn info(&self) -> GpuInfo {
        let cfg = &self.shared.cfg;
        GpuInfo {
            name: "sim".into(),
            vram_bytes: self.vram_bytes,
            compute_engines: cfg.compute_engines,
            max_channels: cfg.max_channels,
            max_contexts: cfg.max_contexts,
            has_busy_counters: !cfg.hide_busy_counters,
        }
    }

    fn create_context(&self, sysmem: Arc<dyn SysMemory>) -> Result<ContextId> {
        let mut ctxs = self.write_contexts();
        if ctxs.len() >= self.shared.cfg.max_contexts as usize {
            return Err(HalError::TooMany("contexts"));
        }
        let id = ContextId(self.next_context.fetch_add(1, Ordering::Relaxed));
        ctxs.insert(
            id,
            Context {
                space: Arc::new(AddressSpace::new(sysmem)),
                busy_ns: Arc::new(AtomicU64::new(0)),
            },
        );
        Ok(id)
    }

    fn destroy_context(&self, ctx: ContextId) -> Result<()> {
        let context = self
            .write_contexts()
            .remove(&ctx)
            .ok_or(HalError::NoContext(ctx))?;
        self.remove_channels(|c| c.ctx == ctx);
        // Engines may still hold the address space; from here on they cannot touch its
        // memory, so the owner may free it as soon as this returns.
        context.space.kill();
        Ok(())
    }

    fn alloc_vram(&self, size: u64, align: u64) -> Result<VramAlloc> {
        vram_pool::alloc_zeroed(&self.vram_alloc, &self.shared.vram, size, align)
    }

    fn free_vram(&self, offset: u64) -> Result<()> {
        self.vram_alloc.free(offset)
    }

    fn vram_free_bytes(&self) -> u64 {
        self.vram_alloc.free_bytes()
    }

    fn vram_fd(&self) -> Option<FdRange> {
        if self.shared.cfg.hide_vram_view {
            return None;
        }
        vram_pool::fd_range(&self.shared.vram)
    }

    fn vram_read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        host_copy_log::record_in(
            self.shared.cfg.host_copy_log.as_deref(),
            HostCopy::Single(CopyDir::FromVram),
        );
        vram_pool::read(&self.shared.vram, offset, buf)
    }

    fn vram_write(&self, offset: u64, buf: &[u8]) -> Result<()> {
        host_copy_log::record_in(
            self.shared.cfg.host_copy_log.as_deref(),
            HostCopy::Single(CopyDir::ToVram),
        );
        vram_pool::write(&self.shared.vram, offset, buf)
    }

    fn vram_read_many(&self, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        host_copy_log::record_in(
            self.shared.cfg.host_copy_log.as_deref(),
            HostCopy::Batch(CopyDir::FromVram, reads.len()),
        );
        for (offset, buf) in reads.iter_mut() {
            vram_pool::read(&self.shared.vram, *offset, buf)?;
        }
        Ok(())
    }

    fn vram_write_many(&self, writes: &[(u64, &[u8])]) -> Result<()> {
        host_copy_log::record_in(
            self.shared.cfg.host_copy_log.as_deref(),
            HostCopy::Batch(CopyDir::ToVram, writes.len()),
        );
        for (offset, buf) in writes {
            vram_pool::write(&self.shared.vram, *offset, buf)?;
        }
        Ok(())
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
        if let MapTarget::Vram { offset } = target {
            if offset
                .checked_add(size)
                .is_none_or(|end| end > self.shared.vram.len())
            {
                return Err(HalError::InvalidArgument("VRAM target out of bounds"));
            }
        }
        self.space(ctx)?.map(va, size, target, page, flags)
    }

    fn unmap(&self, ctx: ContextId, va: u64, size: u64) -> Result<()> {
        self.space(ctx)?.unmap(va, size)
    }

    fn page_table_bytes(&self, ctx: ContextId) -> Result<u64> {
        Ok(self.space(ctx)?.table_bytes())
    }

    fn map_cost(&self, ctx: ContextId, va: u64, size: u64, page: PageSize) -> Result<u64> {
        Ok(self.space(ctx)?.map_cost(va, size, page))
    }

    fn remap(&self, ctx: ContextId, va: u64, size: u64, target: MapTarget) -> Result<()> {
        if let MapTarget::Vram { offset } = target {
            if offset
                .checked_add(size)
                .is_none_or(|end| end > self.shared.vram.len())
            {
                return Err(HalError::InvalidArgument("VRAM target out of bounds"));
            }
        }
        self.space(ctx)?.remap(va, size, target)
    }

    fn invalidate_tlb(&self, ctx: ContextId) -> Result<()> {
        self.space(ctx)?.invalidate_tlb();
        Ok(())
    }

    fn access_counts(
        &self,
        ctx: ContextId,
        va: u64,
        size: u64,
        reset: bool,
    ) -> Result<Vec<(u64, u32)>> {
        self.space(ctx)?.access_counts(va, size, reset)
    }

    /// Every engine write goes through a [`crate::gpu_view::GpuView`] of the channel's
    /// address space, which notes it in the space's [`crate::write_log::WriteLog`].
    fn track_writes(&self, ctx: ContextId, on: bool) -> Result<bool> {
        self.space(ctx)?.writes().set(on);
        Ok(true)
    }

    fn take_written(&self, ctx: ContextId, target: MapTarget, len: u64) -> Result<bool> {
        Ok(self.space(ctx)?.writes().take(target, len))
    }

    fn create_channel(
        &self,
        ctx: ContextId,
        cfg: ChannelConfig,
        sink: Arc<dyn EventSink>,
    ) -> Result<ChannelId> {
        self.new_channel(ctx, cfg, sink, None)
    }

    fn create_channel_resumed(
        &self,
        ctx: ContextId,
        cfg: ChannelConfig,
        sink: Arc<dyn EventSink>,
        at: ChannelResume,
    ) -> Result<ChannelId> {
        self.new_channel(ctx, cfg, sink, Some(at))
    }

    fn destroy_channel(&self, ch: ChannelId) -> Result<()> {
        if self.remove_channels(|c| c.id == ch) == 0 {
            return Err(HalError::NoChannel(ch));
        }
        Ok(())
    }

    fn control_page(&self, ch: ChannelId) -> Result<FdRange> {
        Ok(self.pages.fd_range(self.channel(ch)?.slot))
    }

    fn doorbell(&self, _ch: ChannelId) {
        self.shared.wake_pfifo();
    }

    fn channel_counters(&self, ch: ChannelId) -> Result<ChannelCounters> {
        let counters = self.channel(ch)?.counters();
        if self.shared.cfg.hide_busy_counters {
            return Ok(ChannelCounters {
                busy_ns: 0,
                sem_wait_ns: 0,
                ..counters
            });
        }
        Ok(counters)
    }

    fn count_activity(&self, ch: ChannelId, counter: Arc<ActivityCounter>) -> Result<bool> {
        Ok(self.channel(ch)?.count_activity(counter))
    }

    fn channel_error(&self, ch: ChannelId) -> Result<Option<(ErrorCode, u64)>> {
        Ok(self.channel(ch)?.error())
    }

    fn kill_channel(&self, ch: ChannelId, code: ErrorCode) -> Result<()> {
        self.channel(ch)?.fault(code, 0);
        self.shared.wake_pfifo();
        Ok(())
    }
}

impl SimGpu {
    /// A new channel, fresh or resumed at `at` (see [`Gpu::create_channel_resumed`]).
    fn new_channel(
        &self,
        ctx: ContextId,
        cfg: ChannelConfig,
        sink: Arc<dyn EventSink>,
        at: Option<ChannelResume>,
    ) -> Result<ChannelId> {
        cfg.check()?;
        let owner = self
            .read_contexts()
            .get(&ctx)
            .map(|c| channel::Owner {
                ctx,
                space: c.space.clone(),
                busy_ns: c.busy_ns.clone(),
            })
            .ok_or(HalError::NoContext(ctx))?;
        let slot = self.pages.take().ok_or(HalError::TooMany("channels"))?;
        let id = ChannelId(self.next_channel.fetch_add(1, Ordering::Relaxed));
        let ch = Arc::new(SimChannel::new(
            id,
            owner,
            cfg,
            slot,
            self.pages.clone(),
            sink,
        ));
        if let Some(at) = at {
            ch.resume_at(at);
        }
        {
            // The context may have been destroyed meanwhile; check under the channel lock
            // order (contexts, then channels) so no channel outlives its context.
            let ctxs = self.read_contexts();
            if !ctxs.contains_key(&ctx) {
                return Err(HalError::NoContext(ctx));
            }
            self.shared
                .channels
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .insert(id, ch);
        }
        self.shared.gen.fetch_add(1, Ordering::AcqRel);
        self.shared.wake_pfifo();
        Ok(id)
    }
}
