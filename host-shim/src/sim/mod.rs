//! `sim`: a software GPU that behaves like the Fermi-class hardware in the seeds —
//! memory-mapped channel control pages polled by a round-robin PFIFO, non-preemptible
//! kernels, a concurrent copy engine, a paging MMU per context, and per-channel counters.
//!
//! The control pages, channel core, GP fetch/decode and context/channel tables are the
//! front-end core it shares with `cuda` (`crate::fifo`); this module adds the engines.

mod channel;
mod copy_engine;
mod exec;
mod pfifo;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use self::channel::SimChannel;
use self::exec::{Step, WorkItem};
use crate::fifo::control_pages::ControlPages;
use crate::fifo::tables::Tables;
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
    /// With nothing running, copying or stalled, the PFIFO sleeps until a doorbell or for
    /// at most this long (protocol.md §2.1); 0: no doorbell, it naps as above and a
    /// submission waits for the next poll.
    pub doorbell_sleep_ns: u64,
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
            doorbell_sleep_ns: crate::fifo::doze::DEFAULT_SLEEP_NS,
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
    /// Contexts, channels and control pages; wakes the PFIFO thread.
    fifo: Tables<SimChannel, SimContext>,
    copy_done: Mutex<Vec<CopyResult>>,
    shutdown: AtomicBool,
    pfifo_cpu_ns: AtomicU64,
    copy_cpu_ns: AtomicU64,
}

impl Shared {
    fn take_copy_results(&self) -> Vec<CopyResult> {
        std::mem::take(&mut *self.copy_done.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn push_copy_result(&self, r: CopyResult) {
        self.copy_done
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(r);
        self.fifo.wake();
    }
}

/// What the sim keeps with a context: the engine time all its channels ever used.
struct SimContext {
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
    vram_alloc: VramPool,
    /// VRAM size (fixed): `info()` needs no allocator lock.
    vram_bytes: u64,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

fn os_err(e: impl std::fmt::Display) -> HalError {
    HalError::Os(e.to_string())
}

impl SimGpu {
    /// A channel's counters as this GPU shows them: without busy time or semaphore waits
    /// when configured to hide them (a GPU without per-channel counters).
    fn reported_counters(&self, c: ChannelCounters) -> ChannelCounters {
        if self.shared.cfg.hide_busy_counters {
            ChannelCounters {
                busy_ns: 0,
                sem_wait_ns: 0,
                ..c
            }
        } else {
            c
        }
    }

    pub fn new(cfg: SimConfig) -> Result<Arc<Self>> {
        if cfg.compute_engines == 0 || cfg.max_channels == 0 || cfg.vram_bytes < 1 << 20 {
            return Err(HalError::InvalidArgument(
                "sim needs at least one engine, one channel and 1 MiB of VRAM",
            ));
        }
        let vram = SharedMem::new("vgpu-vram", cfg.vram_bytes).map_err(os_err)?;
        let pages = Arc::new(ControlPages::new(cfg.max_channels).map_err(os_err)?);
        let fifo = Tables::new(pages, cfg.max_contexts, vram.len());
        let shared = Arc::new(Shared {
            vram,
            fifo,
            copy_done: Mutex::new(Vec::new()),
            shutdown: AtomicBool::new(false),
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
        shared.fifo.set_frontend(pfifo.thread().clone());
        Ok(Arc::new(SimGpu {
            shared,
            vram_alloc: VramPool::new(cfg.vram_bytes),
            vram_bytes: cfg.vram_bytes,
            threads: Mutex::new(vec![pfifo, copy]),
        }))
    }

    fn lock_vram(&self) -> std::sync::MutexGuard<'_, VramAllocator> {
        self.vram_alloc.lock()
    }

    fn space(&self, ctx: ContextId) -> Result<Arc<AddressSpace>> {
        self.shared.fifo.space(ctx)
    }

    /// Engine time used by all channels a context ever had (tools and demos; the backend
    /// keeps its own books from channel counters).
    pub fn context_busy_ns(&self, ctx: ContextId) -> Result<u64> {
        self.shared
            .fifo
            .read_contexts()
            .get(&ctx)
            .map(|c| c.gpu.busy_ns.load(Ordering::Relaxed))
            .ok_or(HalError::NoContext(ctx))
    }

    /// Live object counts.
    pub fn stats(&self) -> SimStats {
        let vram = self.lock_vram();
        SimStats {
            contexts: self.shared.fifo.context_count(),
            channels: self.shared.fifo.channel_count(),
            control_slots_in_use: self.shared.fifo.pages().slots_in_use(),
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
        self.shared.fifo.channel_list()
    }

    /// Mapped pages in a context (leak checks).
    pub fn mapped_pages(&self, ctx: ContextId) -> Result<usize> {
        Ok(self.space(ctx)?.mapped_pages())
    }
}

impl Drop for SimGpu {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared.fifo.wake();
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|e| e.into_inner()));
        for t in threads {
            let _ = t.join();
        }
    }
}

impl Gpu for SimGpu {
    crate::fifo::table_methods!();

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
        let busy_ns = Arc::new(AtomicU64::new(0));
        let space = Arc::new(AddressSpace::new(sysmem));
        self.shared
            .fifo
            .create_context(space, SimContext { busy_ns })
    }

    fn destroy_context(&self, ctx: ContextId) -> Result<()> {
        self.shared.fifo.remove_context(ctx)?;
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
        self.shared.fifo.check_vram_target(target, size)?;
        self.space(ctx)?.map(va, size, target, page, flags)
    }

    fn unmap(&self, ctx: ContextId, va: u64, size: u64) -> Result<()> {
        self.space(ctx)?.unmap(va, size)
    }

    fn remap(&self, ctx: ContextId, va: u64, size: u64, target: MapTarget) -> Result<()> {
        self.shared.fifo.check_vram_target(target, size)?;
        self.space(ctx)?.remap(va, size, target)
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

    fn invalidate_tlb(&self, ctx: ContextId) -> Result<()> {
        self.space(ctx)?.invalidate_tlb();
        Ok(())
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

    fn destroy_channel(&self, ch: ChannelId) -> Result<()> {
        if self
            .shared
            .fifo
            .remove_channels(|c| c.core.id == ch)
            .is_empty()
        {
            return Err(HalError::NoChannel(ch));
        }
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
        let (core, busy_ns) = self
            .shared
            .fifo
            .new_core(ctx, cfg, sink, at, |c| c.gpu.busy_ns.clone())?;
        let ch = Arc::new(SimChannel::new(core, busy_ns));
        self.shared.fifo.insert_channel(ch)
    }
}
