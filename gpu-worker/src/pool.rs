//! Many VMs, a worker each: [`WorkerPool`] hands every VM its own [`VmWorker`] (the
//! `Gpu` its session uses) and is itself the `Gpu` the backend's global callers use
//! (the scheduler's counters and watchdog, the VRAM manager's totals), routing each
//! channel call to the VM that owns the channel.
//!
//! A VM's worker starts at its first use (its first context or VRAM allocation) and
//! again after a loss, but only once the VM has let go of everything the lost one held
//! (the guest reset its device, the session tore its state down): a new worker's VRAM
//! offsets and ids then never meet a dead one's in the session's books. Until then the
//! VM's calls fail with `DeviceLost`, and its teardown calls on the dead worker's
//! objects succeed (their state is gone with the process).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use log::{info, warn};
use vgpu_host_shim::hal::Result;
use vgpu_host_shim::{
    ChannelConfig, ChannelCounters, ChannelId, ChannelResume, ContextId, EventSink, FdRange, Gpu,
    GpuInfo, HalError, MapFlags, MapTarget, PageSize, SysMemory, VramAlloc,
};
use vgpu_protocol::ErrorCode;

use crate::client::{Ids, LossKind, WorkerGpu, WorkerOptions};
use crate::WorkerProgram;

/// What the pool starts and how the backend sees the whole GPU.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// The worker program and its arguments (the pool adds `--vram-mib`).
    pub program: WorkerProgram,
    /// The GPU as the backend's books see it: its VRAM, contexts and channels in all.
    pub gpu: GpuInfo,
    /// Channels and contexts each worker's GPU has (at most the whole GPU's).
    pub per_worker: (u32, u32),
    pub opts: WorkerOptions,
}

/// Counts of the pool's life, for the API and `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Workers started (first starts and restarts).
    pub started: u64,
    /// Workers lost (died, faulted, timed out or broke the protocol).
    pub lost: u64,
    /// Workers running now.
    pub running: u64,
    /// The lost ones by why, in [`LossKind::ALL`]'s order (see [`PoolStats::lost_as`]).
    pub lost_by_kind: [u64; 6],
}

impl PoolStats {
    /// Workers lost for `kind`.
    pub fn lost_as(&self, kind: LossKind) -> u64 {
        LossKind::ALL
            .iter()
            .position(|k| *k == kind)
            .map_or(0, |i| self.lost_by_kind[i])
    }
}

struct PoolShared {
    cfg: PoolConfig,
    ids: Arc<Ids>,
    next_worker: AtomicU32,
    started: AtomicU64,
    /// Channel id → the VM that owns it.
    directory: Mutex<HashMap<u32, Weak<VmWorker>>>,
    vms: Mutex<Vec<Weak<VmWorker>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The workers of a backend.
pub struct WorkerPool {
    shared: Arc<PoolShared>,
}

impl WorkerPool {
    pub fn new(cfg: PoolConfig) -> Arc<Self> {
        Arc::new(WorkerPool {
            shared: Arc::new(PoolShared {
                ids: cfg.opts.ids.clone(),
                cfg,
                next_worker: AtomicU32::new(0),
                started: AtomicU64::new(0),
                directory: Mutex::new(HashMap::new()),
                vms: Mutex::new(Vec::new()),
            }),
        })
    }

    /// VM `vm`'s GPU: a worker of its own with `vram_bytes` of VRAM, started at first use.
    pub fn vm_gpu(&self, vm: &str, vram_bytes: u64) -> Arc<VmWorker> {
        let w = Arc::new_cyclic(|me| VmWorker {
            vm: vm.to_string(),
            vram_bytes: vram_bytes.min(self.shared.cfg.gpu.vram_bytes),
            pool: self.shared.clone(),
            me: me.clone(),
            start_lock: Mutex::new(()),
            state: Mutex::new(VmObjects::default()),
            lost: AtomicU64::new(0),
            lost_by_kind: Default::default(),
        });
        let mut vms = lock(&self.shared.vms);
        vms.retain(|v| v.strong_count() > 0);
        vms.push(Arc::downgrade(&w));
        w
    }

    pub fn stats(&self) -> PoolStats {
        let vms: Vec<Arc<VmWorker>> = lock(&self.shared.vms)
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        let mut lost_by_kind = [0u64; 6];
        for v in &vms {
            for (n, k) in lost_by_kind.iter_mut().zip(v.losses_by_kind()) {
                *n += k;
            }
        }
        PoolStats {
            started: self.shared.started.load(Ordering::Relaxed),
            lost: vms.iter().map(|v| v.losses()).sum(),
            running: vms.iter().filter(|v| v.running()).count() as u64,
            lost_by_kind,
        }
    }

    fn owner(&self, ch: ChannelId) -> Result<Arc<VmWorker>> {
        lock(&self.shared.directory)
            .get(&ch.0)
            .and_then(Weak::upgrade)
            .ok_or(HalError::NoChannel(ch))
    }
}

/// What a VM holds on its worker(s), each object with the worker it lives in.
#[derive(Default)]
struct VmObjects {
    current: Option<Arc<WorkerGpu>>,
    ctxs: HashMap<u32, Arc<WorkerGpu>>,
    chans: HashMap<u32, (u32, Arc<WorkerGpu>)>,
    vram: BTreeMap<u64, (u64, Arc<WorkerGpu>)>,
}

impl VmObjects {
    /// Whether anything of `w` is still held.
    fn holds(&self, w: &Arc<WorkerGpu>) -> bool {
        self.ctxs.values().any(|x| Arc::ptr_eq(x, w))
            || self.chans.values().any(|x| Arc::ptr_eq(&x.1, w))
            || self.vram.values().any(|x| Arc::ptr_eq(&x.1, w))
    }
}

/// One VM's GPU: the VM's worker, restarted after a loss once the VM let go of it.
pub struct VmWorker {
    vm: String,
    vram_bytes: u64,
    pool: Arc<PoolShared>,
    me: Weak<VmWorker>,
    start_lock: Mutex<()>,
    state: Mutex<VmObjects>,
    lost: AtomicU64,
    /// Losses by why, in [`LossKind::ALL`]'s order.
    lost_by_kind: [AtomicU64; 6],
}

/// A lost worker's teardown calls succeed: what they would undo died with it.
fn gone_is_done(r: Result<()>) -> Result<()> {
    match r {
        Err(HalError::DeviceLost(_)) => Ok(()),
        r => r,
    }
}

impl VmWorker {
    fn losses(&self) -> u64 {
        self.lost.load(Ordering::Relaxed)
    }

    fn losses_by_kind(&self) -> [u64; 6] {
        let mut out = [0; 6];
        for (o, n) in out.iter_mut().zip(&self.lost_by_kind) {
            *o = n.load(Ordering::Relaxed);
        }
        out
    }

    fn running(&self) -> bool {
        lock(&self.state)
            .current
            .as_ref()
            .is_some_and(|w| !w.is_lost())
    }

    /// The worker's process id, while one runs.
    pub fn pid(&self) -> Option<u32> {
        lock(&self.state).current.as_ref().map(|w| w.pid())
    }

    /// Kills the VM's worker (as a fault would): its GPU is lost.
    pub fn kill(&self) {
        if let Some(w) = lock(&self.state).current.clone() {
            w.kill();
        }
    }

    /// The worker new objects go to: the running one, or a new one if none runs and
    /// nothing of a lost one is held.
    fn worker(&self) -> Result<Arc<WorkerGpu>> {
        let _one_start = lock(&self.start_lock);
        {
            let mut st = lock(&self.state);
            match st.current.clone() {
                Some(w) if !w.is_lost() => return Ok(w),
                Some(w) if st.holds(&w) => {
                    return Err(HalError::DeviceLost(format!(
                        "VM {}: its GPU worker was lost; reset the device",
                        self.vm
                    )))
                }
                Some(w) => {
                    st.current = None;
                    self.lost.fetch_add(1, Ordering::Relaxed);
                    let kind = w.loss_kind().unwrap_or(LossKind::Exited);
                    if let Some(i) = LossKind::ALL.iter().position(|k| *k == kind) {
                        self.lost_by_kind[i].fetch_add(1, Ordering::Relaxed);
                    }
                }
                None => {}
            }
        }
        let cfg = &self.pool.cfg;
        let n = self.pool.next_worker.fetch_add(1, Ordering::Relaxed);
        let mut prog = cfg.program.clone();
        prog.args.extend([
            "--vram-mib".to_string(),
            (self.vram_bytes >> 20).max(1).to_string(),
            "--max-channels".to_string(),
            cfg.per_worker.0.to_string(),
            "--max-contexts".to_string(),
            cfg.per_worker.1.to_string(),
        ]);
        let opts = WorkerOptions {
            worker: n,
            ids: self.pool.ids.clone(),
            ..cfg.opts.clone()
        };
        let w = WorkerGpu::start(&prog, &opts).map_err(|e| {
            warn!("VM {}: GPU worker {n} did not start: {e}", self.vm);
            HalError::DeviceLost(format!("starting a GPU worker: {e}"))
        })?;
        self.pool.started.fetch_add(1, Ordering::Relaxed);
        info!("VM {}: GPU worker {n} (pid {}) started", self.vm, w.pid());
        lock(&self.state).current = Some(w.clone());
        Ok(w)
    }

    fn of_ctx(&self, ctx: ContextId) -> Result<Arc<WorkerGpu>> {
        lock(&self.state)
            .ctxs
            .get(&ctx.0)
            .cloned()
            .ok_or(HalError::NoContext(ctx))
    }

    fn of_ch(&self, ch: ChannelId) -> Result<Arc<WorkerGpu>> {
        lock(&self.state)
            .chans
            .get(&ch.0)
            .map(|c| c.1.clone())
            .ok_or(HalError::NoChannel(ch))
    }

    /// The worker holding the VRAM allocation that contains `offset..offset+len`.
    fn of_vram(&self, offset: u64, len: u64) -> Result<Arc<WorkerGpu>> {
        let st = lock(&self.state);
        match st.vram.range(..=offset).next_back() {
            Some((&start, (size, w))) if offset.saturating_add(len) <= start + size => {
                Ok(w.clone())
            }
            _ => Err(HalError::NoAllocation(offset)),
        }
    }

    fn allocated(&self) -> u64 {
        lock(&self.state).vram.values().map(|v| v.0).sum()
    }

    fn add_channel(&self, ctx: ContextId, w: &Arc<WorkerGpu>, id: ChannelId) {
        lock(&self.state).chans.insert(id.0, (ctx.0, w.clone()));
        lock(&self.pool.directory).insert(id.0, self.me.clone());
    }

    fn drop_channels(&self, gone: impl Fn(u32, u32) -> bool) {
        let ids: Vec<u32> = {
            let mut st = lock(&self.state);
            let ids = st
                .chans
                .iter()
                .filter(|(&ch, c)| gone(ch, c.0))
                .map(|(&ch, _)| ch)
                .collect::<Vec<_>>();
            for ch in &ids {
                st.chans.remove(ch);
            }
            ids
        };
        let mut dir = lock(&self.pool.directory);
        for ch in ids {
            dir.remove(&ch);
        }
    }
}

impl Drop for VmWorker {
    fn drop(&mut self) {
        let st = std::mem::take(&mut *lock(&self.state));
        let mut dir = lock(&self.pool.directory);
        for ch in st.chans.keys() {
            dir.remove(ch);
        }
    }
}

impl Gpu for VmWorker {
    /// Starts the VM's worker on a thread of its own, if none runs; a first context
    /// meanwhile waits for that start rather than making a second (the start lock).
    fn prepare(&self) {
        let Some(me) = self.me.upgrade() else {
            return;
        };
        if self.running() {
            return;
        }
        let spawned = std::thread::Builder::new()
            .name(format!("vgpu-prestart-{}", self.vm))
            .spawn(move || {
                if let Err(e) = me.worker() {
                    warn!("VM {}: starting its GPU worker ahead: {e}", me.vm);
                }
            });
        if let Err(e) = spawned {
            warn!(
                "VM {}: no thread to start its GPU worker ahead: {e}",
                self.vm
            );
        }
    }

    fn info(&self) -> GpuInfo {
        let cfg = &self.pool.cfg;
        GpuInfo {
            name: format!("{} (a worker per VM)", cfg.gpu.name),
            vram_bytes: self.vram_bytes,
            compute_engines: cfg.gpu.compute_engines,
            max_channels: cfg.per_worker.0,
            max_contexts: cfg.per_worker.1,
            has_busy_counters: true,
        }
    }

    fn create_context(&self, sysmem: Arc<dyn SysMemory>) -> Result<ContextId> {
        let mut w = self.worker()?;
        let ctx = match w.create_context(sysmem.clone()) {
            // The worker died between `worker()`'s look and the call (say it was still
            // exiting on a fault of the VM's previous guest process). If the VM holds
            // nothing of it, the new context goes to a fresh worker instead of failing.
            Err(HalError::DeviceLost(why)) if w.is_lost() && !lock(&self.state).holds(&w) => {
                info!(
                    "VM {}: its GPU worker was lost ({why}); starting another",
                    self.vm
                );
                w = self.worker()?;
                w.create_context(sysmem)?
            }
            r => r?,
        };
        lock(&self.state).ctxs.insert(ctx.0, w);
        Ok(ctx)
    }

    fn destroy_context(&self, ctx: ContextId) -> Result<()> {
        let w = self.of_ctx(ctx)?;
        gone_is_done(w.destroy_context(ctx))?;
        lock(&self.state).ctxs.remove(&ctx.0);
        self.drop_channels(|_, c| c == ctx.0);
        Ok(())
    }

    fn alloc_vram(&self, size: u64, align: u64) -> Result<VramAlloc> {
        let w = self.worker()?;
        let a = w.alloc_vram(size, align)?;
        lock(&self.state).vram.insert(a.offset, (a.size, w));
        Ok(a)
    }

    fn free_vram(&self, offset: u64) -> Result<()> {
        let w = self.of_vram(offset, 0)?;
        gone_is_done(w.free_vram(offset))?;
        lock(&self.state).vram.remove(&offset);
        Ok(())
    }

    fn vram_free_bytes(&self) -> u64 {
        self.vram_bytes.saturating_sub(self.allocated())
    }

    fn vram_fd(&self) -> Option<FdRange> {
        None
    }

    fn vram_read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.of_vram(offset, buf.len() as u64)?
            .vram_read(offset, buf)
    }

    fn vram_write(&self, offset: u64, buf: &[u8]) -> Result<()> {
        self.of_vram(offset, buf.len() as u64)?
            .vram_write(offset, buf)
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
        self.of_ctx(ctx)?.map(ctx, va, size, target, page, flags)
    }

    fn unmap(&self, ctx: ContextId, va: u64, size: u64) -> Result<()> {
        gone_is_done(self.of_ctx(ctx)?.unmap(ctx, va, size))
    }

    fn page_table_bytes(&self, ctx: ContextId) -> Result<u64> {
        self.of_ctx(ctx)?.page_table_bytes(ctx)
    }

    fn map_cost(&self, ctx: ContextId, va: u64, size: u64, page: PageSize) -> Result<u64> {
        self.of_ctx(ctx)?.map_cost(ctx, va, size, page)
    }

    fn remap(&self, ctx: ContextId, va: u64, size: u64, target: MapTarget) -> Result<()> {
        self.of_ctx(ctx)?.remap(ctx, va, size, target)
    }

    fn prepare_sysram_hint(&self, ctx: ContextId, addr: u64, len: u64) -> Result<()> {
        self.of_ctx(ctx)?.prepare_sysram_hint(ctx, addr, len)
    }

    fn release_sysram_hint(&self, ctx: ContextId, addr: u64, len: u64) {
        if let Ok(w) = self.of_ctx(ctx) {
            w.release_sysram_hint(ctx, addr, len);
        }
    }

    fn invalidate_tlb(&self, ctx: ContextId) -> Result<()> {
        gone_is_done(self.of_ctx(ctx)?.invalidate_tlb(ctx))
    }

    fn access_counts(
        &self,
        ctx: ContextId,
        va: u64,
        size: u64,
        reset: bool,
    ) -> Result<Vec<(u64, u32)>> {
        self.of_ctx(ctx)?.access_counts(ctx, va, size, reset)
    }

    fn create_channel(
        &self,
        ctx: ContextId,
        cfg: ChannelConfig,
        sink: Arc<dyn EventSink>,
    ) -> Result<ChannelId> {
        let w = self.of_ctx(ctx)?;
        let id = w.create_channel(ctx, cfg, sink)?;
        self.add_channel(ctx, &w, id);
        Ok(id)
    }

    fn create_channel_resumed(
        &self,
        ctx: ContextId,
        cfg: ChannelConfig,
        sink: Arc<dyn EventSink>,
        at: ChannelResume,
    ) -> Result<ChannelId> {
        let w = self.of_ctx(ctx)?;
        let id = w.create_channel_resumed(ctx, cfg, sink, at)?;
        self.add_channel(ctx, &w, id);
        Ok(id)
    }

    fn destroy_channel(&self, ch: ChannelId) -> Result<()> {
        let w = self.of_ch(ch)?;
        gone_is_done(w.destroy_channel(ch))?;
        self.drop_channels(|id, _| id == ch.0);
        Ok(())
    }

    fn control_page(&self, ch: ChannelId) -> Result<FdRange> {
        self.of_ch(ch)?.control_page(ch)
    }

    fn doorbell(&self, ch: ChannelId) {
        if let Ok(w) = self.of_ch(ch) {
            w.doorbell(ch);
        }
    }

    fn channel_counters(&self, ch: ChannelId) -> Result<ChannelCounters> {
        self.of_ch(ch)?.channel_counters(ch)
    }

    fn channel_error(&self, ch: ChannelId) -> Result<Option<(ErrorCode, u64)>> {
        self.of_ch(ch)?.channel_error(ch)
    }

    fn kill_channel(&self, ch: ChannelId, code: ErrorCode) -> Result<()> {
        gone_is_done(self.of_ch(ch)?.kill_channel(ch, code))
    }

    fn module_load(&self, ctx: ContextId, module: u32, image: &[u8]) -> Result<()> {
        self.of_ctx(ctx)?.module_load(ctx, module, image)
    }

    fn module_unload(&self, ctx: ContextId, module: u32) -> Result<()> {
        gone_is_done(self.of_ctx(ctx)?.module_unload(ctx, module))
    }

    fn function_get(
        &self,
        ctx: ContextId,
        module: u32,
        name: &str,
        function: u32,
    ) -> Result<Option<Vec<vgpu_host_shim::ParamInfo>>> {
        self.of_ctx(ctx)?.function_get(ctx, module, name, function)
    }

    fn global_get(
        &self,
        ctx: ContextId,
        module: u32,
        name: &str,
    ) -> Result<vgpu_host_shim::GlobalInfo> {
        self.of_ctx(ctx)?.global_get(ctx, module, name)
    }
}

const THROUGH_A_VM: HalError =
    HalError::Unsupported("with a worker per VM, objects are made through the VM's GPU");

/// The backend's global view: totals, and channel calls routed to their VM.
impl Gpu for WorkerPool {
    fn info(&self) -> GpuInfo {
        let mut gi = self.shared.cfg.gpu.clone();
        gi.name = format!("{} (a worker per VM)", gi.name);
        gi
    }

    fn create_context(&self, _sysmem: Arc<dyn SysMemory>) -> Result<ContextId> {
        Err(THROUGH_A_VM)
    }

    fn destroy_context(&self, _ctx: ContextId) -> Result<()> {
        Err(THROUGH_A_VM)
    }

    fn alloc_vram(&self, _size: u64, _align: u64) -> Result<VramAlloc> {
        Err(THROUGH_A_VM)
    }

    fn free_vram(&self, _offset: u64) -> Result<()> {
        Err(THROUGH_A_VM)
    }

    /// The whole GPU's VRAM less what every VM's worker has allocated.
    fn vram_free_bytes(&self) -> u64 {
        let used: u64 = lock(&self.shared.vms)
            .iter()
            .filter_map(Weak::upgrade)
            .map(|v| v.allocated())
            .sum();
        self.shared.cfg.gpu.vram_bytes.saturating_sub(used)
    }

    fn vram_fd(&self) -> Option<FdRange> {
        None
    }

    fn vram_read(&self, _offset: u64, _buf: &mut [u8]) -> Result<()> {
        Err(THROUGH_A_VM)
    }

    fn vram_write(&self, _offset: u64, _buf: &[u8]) -> Result<()> {
        Err(THROUGH_A_VM)
    }

    fn map(
        &self,
        _ctx: ContextId,
        _va: u64,
        _size: u64,
        _target: MapTarget,
        _page: PageSize,
        _flags: MapFlags,
    ) -> Result<()> {
        Err(THROUGH_A_VM)
    }

    fn unmap(&self, _ctx: ContextId, _va: u64, _size: u64) -> Result<()> {
        Err(THROUGH_A_VM)
    }

    fn page_table_bytes(&self, _ctx: ContextId) -> Result<u64> {
        Err(THROUGH_A_VM)
    }

    fn map_cost(&self, _ctx: ContextId, _va: u64, _size: u64, _page: PageSize) -> Result<u64> {
        Err(THROUGH_A_VM)
    }

    fn remap(&self, _ctx: ContextId, _va: u64, _size: u64, _target: MapTarget) -> Result<()> {
        Err(THROUGH_A_VM)
    }

    fn invalidate_tlb(&self, _ctx: ContextId) -> Result<()> {
        Err(THROUGH_A_VM)
    }

    fn access_counts(
        &self,
        _ctx: ContextId,
        _va: u64,
        _size: u64,
        _reset: bool,
    ) -> Result<Vec<(u64, u32)>> {
        Err(THROUGH_A_VM)
    }

    fn create_channel(
        &self,
        _ctx: ContextId,
        _cfg: ChannelConfig,
        _sink: Arc<dyn EventSink>,
    ) -> Result<ChannelId> {
        Err(THROUGH_A_VM)
    }

    fn destroy_channel(&self, ch: ChannelId) -> Result<()> {
        self.owner(ch)?.destroy_channel(ch)
    }

    fn control_page(&self, ch: ChannelId) -> Result<FdRange> {
        self.owner(ch)?.control_page(ch)
    }

    fn doorbell(&self, ch: ChannelId) {
        if let Ok(v) = self.owner(ch) {
            v.doorbell(ch);
        }
    }

    fn channel_counters(&self, ch: ChannelId) -> Result<ChannelCounters> {
        self.owner(ch)?.channel_counters(ch)
    }

    fn channel_error(&self, ch: ChannelId) -> Result<Option<(ErrorCode, u64)>> {
        self.owner(ch)?.channel_error(ch)
    }

    fn kill_channel(&self, ch: ChannelId, code: ErrorCode) -> Result<()> {
        self.owner(ch)?.kill_channel(ch, code)
    }
}
