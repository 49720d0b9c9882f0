//! Many VMs, a worker each (or a worker per guest process): [`WorkerPool`] hands every
//! VM its own [`VmWorker`] (the `Gpu` its session uses) and is itself the `Gpu` the
//! backend's global callers use (the scheduler's counters and watchdog, the VRAM
//! manager's totals), routing each channel call to the VM that owns the channel.
//!
//! A VM's worker starts at its first use (its first context or VRAM allocation) and
//! again after a loss, but only once the VM has let go of everything the lost one held
//! (the guest reset its device, the session tore its state down): a new worker's VRAM
//! offsets and ids then never meet a dead one's in the session's books. Until then the
//! VM's calls fail with `DeviceLost`, and its teardown calls on the dead worker's
//! objects succeed (their state is gone with the process).
//!
//! With [`Granularity::Process`] the same holds per guest process: each process's
//! contexts and VRAM ([`Gpu::create_context_for`], [`Gpu::alloc_vram_for`]) live in a
//! worker of that process's own, a loss fails that process's objects only, and a worker
//! whose process let go of its last object is shut down.

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

/// How a VM's GPU work is split into worker processes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Granularity {
    /// One worker for all of a VM's guest processes (the default: a CUDA context per VM).
    #[default]
    Vm,
    /// A worker per guest process: each process has its own GPU address space and fault
    /// domain, as on a real GPU, at a CUDA context per process.
    Process,
}

impl Granularity {
    /// The name the CLI and the API use: `vm` or `process`.
    pub fn name(self) -> &'static str {
        match self {
            Granularity::Vm => "vm",
            Granularity::Process => "process",
        }
    }
}

impl std::fmt::Display for Granularity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Granularity {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "vm" => Ok(Granularity::Vm),
            "process" => Ok(Granularity::Process),
            other => Err(format!("{other}: `vm` or `process`")),
        }
    }
}

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
    /// A worker per VM or per guest process.
    pub granularity: Granularity,
    /// With a worker per process: at most this many workers per VM (each holds a CUDA
    /// context and the VM's VRAM quota in device memory); a further process's first
    /// object is refused with `TooMany`.
    pub max_workers_per_vm: u32,
}

/// Counts of the pool's life, for the API and `/metrics`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Workers started (first starts and restarts).
    pub started: u64,
    /// Workers lost (died, faulted, timed out or broke the protocol).
    pub lost: u64,
    /// Workers running now.
    pub running: u64,
    /// The lost ones by why, in [`LossKind::ALL`]'s order (see [`PoolStats::lost_as`]).
    pub lost_by_kind: [u64; 6],
    /// A worker per VM or per guest process.
    pub granularity: Granularity,
    /// Per VM, by name.
    pub vms: Vec<VmWorkerStats>,
}

/// One VM's workers, for the API and `/metrics`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmWorkerStats {
    pub vm: String,
    /// Workers running now (with a worker per process: one per process with GPU objects).
    pub running: u64,
    pub started: u64,
    pub lost: u64,
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
    /// The GPU's device attributes, from the first worker asked (every worker runs on
    /// the same GPU).
    attributes: std::sync::OnceLock<Vec<(u32, i32)>>,
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
                attributes: std::sync::OnceLock::new(),
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
            start_locks: Mutex::default(),
            state: Mutex::new(VmObjects::default()),
            started: AtomicU64::new(0),
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
        let mut per_vm: Vec<VmWorkerStats> = vms.iter().map(|v| v.stats()).collect();
        per_vm.sort_by(|a, b| a.vm.cmp(&b.vm));
        PoolStats {
            started: self.shared.started.load(Ordering::Relaxed),
            lost: vms.iter().map(|v| v.losses()).sum(),
            running: per_vm.iter().map(|v| v.running).sum(),
            lost_by_kind,
            granularity: self.shared.cfg.granularity,
            vms: per_vm,
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
    /// The running (or lost, not yet let go of) worker of each owner: the guest process
    /// with a worker per process, else 0 for all of the VM's.
    workers: HashMap<u32, Arc<WorkerGpu>>,
    /// Where each owner's worker's VRAM offsets start in the VM's VRAM offsets: every
    /// worker's own start at 0, so a worker per process gets a window of its own (0 with
    /// a worker per VM).
    bases: HashMap<u32, u64>,
    /// Owners with an object being made on their worker (not yet in the books below):
    /// their worker is not idle.
    making: HashMap<u32, u32>,
    /// Context → its worker and that worker's VRAM base.
    ctxs: HashMap<u32, (Arc<WorkerGpu>, u64)>,
    chans: HashMap<u32, (u32, Arc<WorkerGpu>)>,
    /// VM offset → size, worker, the worker's VRAM base.
    vram: BTreeMap<u64, (u64, Arc<WorkerGpu>, u64)>,
    /// Bytes of VRAM allocations under way (with a worker per process: counted against
    /// the VM's quota before they land in `vram`).
    vram_pending: u64,
}

impl VmObjects {
    /// Whether anything of `w` is still held.
    fn holds(&self, w: &Arc<WorkerGpu>) -> bool {
        self.ctxs.values().any(|x| Arc::ptr_eq(&x.0, w))
            || self.chans.values().any(|x| Arc::ptr_eq(&x.1, w))
            || self.vram.values().any(|x| Arc::ptr_eq(&x.1, w))
    }
}

/// One VM's GPU: the VM's worker (or its processes' workers), restarted after a loss
/// once the VM (the process) let go of it.
pub struct VmWorker {
    vm: String,
    vram_bytes: u64,
    pool: Arc<PoolShared>,
    me: Weak<VmWorker>,
    /// One start at a time per owner (the processes of a VM start theirs side by side).
    start_locks: Mutex<HashMap<u32, Arc<Mutex<()>>>>,
    state: Mutex<VmObjects>,
    started: AtomicU64,
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

    fn running_workers(&self) -> u64 {
        lock(&self.state)
            .workers
            .values()
            .filter(|w| !w.is_lost())
            .count() as u64
    }

    fn running(&self) -> bool {
        self.running_workers() > 0
    }

    fn stats(&self) -> VmWorkerStats {
        VmWorkerStats {
            vm: self.vm.clone(),
            running: self.running_workers(),
            started: self.started.load(Ordering::Relaxed),
            lost: self.losses(),
            lost_by_kind: self.losses_by_kind(),
        }
    }

    /// A worker per VM or per guest process.
    pub fn granularity(&self) -> Granularity {
        self.pool.cfg.granularity
    }

    /// Whose worker `owner`'s objects go to: the owner's own with a worker per process,
    /// else the VM's (0).
    fn key(&self, owner: u32) -> u32 {
        match self.granularity() {
            Granularity::Vm => 0,
            Granularity::Process => owner,
        }
    }

    /// The process id of the VM's worker (of one of them, with a worker per process),
    /// while one runs.
    pub fn pid(&self) -> Option<u32> {
        let st = lock(&self.state);
        st.workers
            .get(&0)
            .or_else(|| st.workers.values().next())
            .map(|w| w.pid())
    }

    /// The process id of the worker of guest process `owner` (with a worker per VM: the
    /// VM's worker), while it has one.
    pub fn pid_of(&self, owner: u32) -> Option<u32> {
        lock(&self.state)
            .workers
            .get(&self.key(owner))
            .map(|w| w.pid())
    }

    /// The workers as (owner, process id, running), by owner: the owner is the guest
    /// process with a worker per process, else 0.
    pub fn workers(&self) -> Vec<(u32, u32, bool)> {
        let mut out: Vec<(u32, u32, bool)> = lock(&self.state)
            .workers
            .iter()
            .map(|(&o, w)| (o, w.pid(), !w.is_lost()))
            .collect();
        out.sort_unstable();
        out
    }

    /// Kills the VM's workers (as a fault would): their GPU is lost.
    pub fn kill(&self) {
        let ws: Vec<Arc<WorkerGpu>> = lock(&self.state).workers.values().cloned().collect();
        for w in ws {
            w.kill();
        }
    }

    /// Kills the worker of guest process `owner` (with a worker per VM: the VM's).
    pub fn kill_owner(&self, owner: u32) {
        let w = lock(&self.state).workers.get(&self.key(owner)).cloned();
        if let Some(w) = w {
            w.kill();
        }
    }

    /// Counts a lost worker that has been let go of.
    fn count_loss(&self, w: &WorkerGpu) {
        self.lost.fetch_add(1, Ordering::Relaxed);
        let kind = w.loss_kind().unwrap_or(LossKind::Exited);
        if let Some(i) = LossKind::ALL.iter().position(|k| *k == kind) {
            self.lost_by_kind[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// With a worker per process: shuts down the workers whose process let go of its
    /// last object (a lost one is counted). The shutdown waits for the worker's exit, so
    /// it runs outside the books' lock.
    fn reap_idle(&self) {
        if self.granularity() != Granularity::Process {
            return;
        }
        let idle: Vec<Arc<WorkerGpu>> = {
            let mut st = lock(&self.state);
            let keys: Vec<u32> = st
                .workers
                .iter()
                .filter(|(k, w)| !st.making.contains_key(k) && !st.holds(w))
                .map(|(&k, _)| k)
                .collect();
            for k in &keys {
                st.bases.remove(k);
            }
            keys.iter().filter_map(|k| st.workers.remove(k)).collect()
        };
        for w in idle {
            if w.is_lost() {
                self.count_loss(&w);
            } else {
                info!(
                    "VM {}: GPU worker (pid {}) idle: its process has no GPU object left",
                    self.vm,
                    w.pid()
                );
            }
        }
    }

    /// Makes an object of `owner`'s on its worker with `make`, and books it with `book`
    /// while the worker cannot be reaped as idle.
    fn make<T>(
        &self,
        owner: u32,
        make: impl FnOnce(&Arc<WorkerGpu>, u64) -> Result<T>,
        book: impl FnOnce(&mut VmObjects, &T, Arc<WorkerGpu>, u64),
    ) -> Result<T> {
        let key = self.key(owner);
        let (w, base) = self.worker(key)?;
        let made = make(&w, base);
        {
            let mut st = lock(&self.state);
            if let Ok(v) = &made {
                book(&mut st, v, w, base);
            }
            if let Some(n) = st.making.get_mut(&key) {
                *n -= 1;
                if *n == 0 {
                    st.making.remove(&key);
                }
            }
        }
        if made.is_err() {
            self.reap_idle();
        }
        made
    }

    /// The worker of `key`'s new objects and its VRAM base: the running one, or a new one
    /// if none runs and nothing of a lost one is held. Counts the object as being made
    /// ([`VmObjects::making`]).
    fn worker(&self, key: u32) -> Result<(Arc<WorkerGpu>, u64)> {
        if let Some(w) = self.worker_now(key)? {
            return Ok(w);
        }
        // One start at a time per owner: a start waits for one under way, then finds it.
        let key_lock = {
            let mut locks = lock(&self.start_locks);
            // Forget the locks nobody holds (the map stays as small as the starts under
            // way; a lock is never dropped while a thread can still take it).
            locks.retain(|_, l| Arc::strong_count(l) > 1);
            locks.entry(key).or_default().clone()
        };
        let _one_start = lock(&key_lock);
        if let Some(w) = self.worker_now(key)? {
            return Ok(w);
        }
        let cfg = &self.pool.cfg;
        if lock(&self.state).workers.len() >= cfg.max_workers_per_vm.max(1) as usize {
            warn!(
                "VM {}: guest process {key} refused a GPU worker: the VM has {} already",
                self.vm, cfg.max_workers_per_vm
            );
            return Err(HalError::TooMany("GPU workers of the VM"));
        }
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
        self.started.fetch_add(1, Ordering::Relaxed);
        match self.granularity() {
            Granularity::Vm => info!("VM {}: GPU worker {n} (pid {}) started", self.vm, w.pid()),
            Granularity::Process => info!(
                "VM {}: GPU worker {n} (pid {}) started for guest process {key}",
                self.vm,
                w.pid()
            ),
        }
        let mut st = lock(&self.state);
        // The lowest window no running worker of the VM has.
        let stride = self.vram_window();
        let base = (0u64..)
            .map(|i| i.saturating_mul(stride))
            .find(|b| !st.bases.values().any(|x| x == b))
            .unwrap_or(0);
        st.workers.insert(key, w.clone());
        st.bases.insert(key, base);
        *st.making.entry(key).or_default() += 1;
        Ok((w, base))
    }

    /// The span of VM VRAM offsets each worker's VRAM is placed in: past any offset a
    /// worker of the VM's VRAM quota gives (unbounded with a worker per VM).
    fn vram_window(&self) -> u64 {
        match self.granularity() {
            Granularity::Vm => u64::MAX,
            Granularity::Process => self.vram_bytes.max(2 << 20).next_power_of_two(),
        }
    }

    /// `t` as the worker with VRAM base `base` sees it: a VRAM offset outside that
    /// worker's window (another process's VRAM) is refused.
    fn local_target(&self, base: u64, t: MapTarget) -> Result<MapTarget> {
        match t {
            MapTarget::Vram { offset } => offset
                .checked_sub(base)
                .filter(|o| *o < self.vram_window())
                .map(|offset| MapTarget::Vram { offset })
                .ok_or(HalError::InvalidArgument(
                    "VRAM of another guest process's GPU worker",
                )),
            sys => Ok(sys),
        }
    }

    /// `key`'s running worker (counted as being made on), `None` if it has none, or
    /// `DeviceLost` while a lost one's objects are still held. A lost one let go of is
    /// counted and forgotten.
    fn worker_now(&self, key: u32) -> Result<Option<(Arc<WorkerGpu>, u64)>> {
        let mut st = lock(&self.state);
        match st.workers.get(&key).cloned() {
            Some(w) if !w.is_lost() => {
                *st.making.entry(key).or_default() += 1;
                let base = st.bases.get(&key).copied().unwrap_or(0);
                Ok(Some((w, base)))
            }
            Some(w) if st.holds(&w) => Err(HalError::DeviceLost(match self.granularity() {
                Granularity::Vm => {
                    format!("VM {}: its GPU worker was lost; reset the device", self.vm)
                }
                Granularity::Process => format!(
                    "VM {}: guest process {key}'s GPU worker was lost; destroy its contexts",
                    self.vm
                ),
            })),
            Some(w) => {
                st.workers.remove(&key);
                st.bases.remove(&key);
                drop(st);
                self.count_loss(&w);
                Ok(None)
            }
            None => Ok(None),
        }
    }

    fn of_ctx(&self, ctx: ContextId) -> Result<Arc<WorkerGpu>> {
        self.of_ctx_based(ctx).map(|c| c.0)
    }

    /// `ctx`'s worker and that worker's VRAM base.
    fn of_ctx_based(&self, ctx: ContextId) -> Result<(Arc<WorkerGpu>, u64)> {
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

    /// The worker holding the VRAM allocation that contains `offset..offset+len`, and
    /// `offset` as that worker sees it.
    fn of_vram(&self, offset: u64, len: u64) -> Result<(Arc<WorkerGpu>, u64)> {
        let st = lock(&self.state);
        match st.vram.range(..=offset).next_back() {
            Some((&start, (size, w, base))) if offset.saturating_add(len) <= start + size => {
                Ok((w.clone(), offset - base))
            }
            _ => Err(HalError::NoAllocation(offset)),
        }
    }

    /// [`Gpu::alloc_vram_for`] on `owner`'s worker, the offset placed in its window.
    fn alloc_vram_on(&self, owner: u32, size: u64, align: u64) -> Result<VramAlloc> {
        self.make(
            owner,
            // The worker's offset placed in its window of the VM's offsets.
            |w, base| {
                let a = w.alloc_vram(size, align)?;
                if a.offset.saturating_add(a.size) > self.vram_window() {
                    let _ = w.free_vram(a.offset);
                    return Err(HalError::InvalidArgument(
                        "a GPU worker's VRAM past its window",
                    ));
                }
                Ok(VramAlloc {
                    offset: base + a.offset,
                    size: a.size,
                })
            },
            |st, a, w, base| {
                st.vram.insert(a.offset, (a.size, w, base));
            },
        )
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
        // A worker per process starts at the process's first object: no owner yet.
        if self.granularity() == Granularity::Process {
            return;
        }
        let Some(me) = self.me.upgrade() else {
            return;
        };
        if self.running() {
            return;
        }
        let spawned = std::thread::Builder::new()
            .name(format!("vgpu-prestart-{}", self.vm))
            .spawn(move || {
                // Made and let go of at once: only the start is wanted.
                if let Err(e) = me.make(0, |_, _| Ok(()), |_, _, _, _| {}) {
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

    /// With a worker per process: starts the owners' workers side by side, each on a
    /// thread of its own (a migration's restore would otherwise start them one after
    /// another inside its downtime); their first objects wait for those starts.
    fn prepare_owners(&self, owners: &[u32]) {
        if self.granularity() != Granularity::Process {
            return;
        }
        let mut keys: Vec<u32> = owners.iter().map(|&o| self.key(o)).collect();
        keys.sort_unstable();
        keys.dedup();
        for key in keys {
            if lock(&self.state).workers.contains_key(&key) {
                continue;
            }
            let Some(me) = self.me.upgrade() else {
                return;
            };
            let spawned = std::thread::Builder::new()
                .name(format!("vgpu-prestart-{}-{key}", self.vm))
                .spawn(move || {
                    if let Err(e) = me.make(key, |_, _| Ok(()), |_, _, _, _| {}) {
                        warn!(
                            "VM {}: starting process {key}'s GPU worker ahead: {e}",
                            me.vm
                        );
                    }
                });
            if let Err(e) = spawned {
                warn!("VM {}: no thread to start a GPU worker ahead: {e}", self.vm);
            }
        }
    }

    fn info(&self) -> GpuInfo {
        let cfg = &self.pool.cfg;
        GpuInfo {
            name: format!("{} ({})", cfg.gpu.name, worker_per(cfg.granularity)),
            vram_bytes: self.vram_bytes,
            compute_engines: cfg.gpu.compute_engines,
            max_channels: cfg.per_worker.0,
            max_contexts: cfg.per_worker.1,
            has_busy_counters: true,
        }
    }

    fn device_attributes(&self, owner: u32) -> Result<Vec<(u32, i32)>> {
        if let Some(a) = self.pool.attributes.get() {
            return Ok(a.clone());
        }
        // Asked before any worker ran: the asking process's worker answers (its first
        // context follows soon in every program that asks).
        let a = self.make(owner, |w, _| w.device_attributes(0), |_, _, _, _| {})?;
        Ok(self.pool.attributes.get_or_init(|| a).clone())
    }

    fn create_context(&self, sysmem: Arc<dyn SysMemory>) -> Result<ContextId> {
        self.create_context_for(0, sysmem)
    }

    fn create_context_for(&self, owner: u32, sysmem: Arc<dyn SysMemory>) -> Result<ContextId> {
        let book = |st: &mut VmObjects, ctx: &ContextId, w, base| {
            st.ctxs.insert(ctx.0, (w, base));
        };
        match self.make(owner, |w, _| w.create_context(sysmem.clone()), book) {
            // The worker died between the look for it and the call (say it was still
            // exiting on a fault of the VM's previous guest process: seen on the H100).
            // Once more: a worker nothing holds is replaced by a fresh one, one still
            // held makes the guest reset as before.
            Err(HalError::DeviceLost(why)) => {
                info!(
                    "VM {}: a GPU worker was lost ({why}); trying another",
                    self.vm
                );
                self.make(owner, |w, _| w.create_context(sysmem), book)
            }
            r => r,
        }
    }

    fn destroy_context(&self, ctx: ContextId) -> Result<()> {
        let w = self.of_ctx(ctx)?;
        gone_is_done(w.destroy_context(ctx))?;
        lock(&self.state).ctxs.remove(&ctx.0);
        self.drop_channels(|_, c| c == ctx.0);
        self.reap_idle();
        Ok(())
    }

    fn alloc_vram(&self, size: u64, align: u64) -> Result<VramAlloc> {
        self.alloc_vram_for(0, size, align)
    }

    fn alloc_vram_for(&self, owner: u32, size: u64, align: u64) -> Result<VramAlloc> {
        if self.granularity() == Granularity::Vm {
            return self.alloc_vram_on(owner, size, align);
        }
        // Each process's worker has the VM's whole quota as its VRAM: the VM's quota
        // holds across them here, as one worker's allocator holds it per VM.
        {
            let mut st = lock(&self.state);
            let used: u64 = st.vram.values().map(|v| v.0).sum::<u64>() + st.vram_pending;
            if used.saturating_add(size) > self.vram_bytes {
                return Err(HalError::OutOfVram(size));
            }
            st.vram_pending += size;
        }
        let made = self.alloc_vram_on(owner, size, align);
        let mut st = lock(&self.state);
        st.vram_pending = st.vram_pending.saturating_sub(size);
        made
    }

    fn separates_owners(&self) -> bool {
        self.granularity() == Granularity::Process
    }

    fn free_vram(&self, offset: u64) -> Result<()> {
        let (w, local) = self.of_vram(offset, 0)?;
        gone_is_done(w.free_vram(local))?;
        lock(&self.state).vram.remove(&offset);
        self.reap_idle();
        Ok(())
    }

    fn vram_free_bytes(&self) -> u64 {
        self.vram_bytes.saturating_sub(self.allocated())
    }

    fn vram_fd(&self) -> Option<FdRange> {
        None
    }

    fn vram_read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let (w, local) = self.of_vram(offset, buf.len() as u64)?;
        w.vram_read(local, buf)
    }

    fn vram_write(&self, offset: u64, buf: &[u8]) -> Result<()> {
        let (w, local) = self.of_vram(offset, buf.len() as u64)?;
        w.vram_write(local, buf)
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
        let (w, base) = self.of_ctx_based(ctx)?;
        w.map(ctx, va, size, self.local_target(base, target)?, page, flags)
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
        let (w, base) = self.of_ctx_based(ctx)?;
        w.remap(ctx, va, size, self.local_target(base, target)?)
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
        self.reap_idle();
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

    fn hold_fetch(&self, ch: ChannelId, hold: bool) -> Result<bool> {
        self.of_ch(ch)?.hold_fetch(ch, hold)
    }

    fn fetched_done(&self, ch: ChannelId) -> Result<Option<bool>> {
        self.of_ch(ch)?.fetched_done(ch)
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

    fn global_read(
        &self,
        ctx: ContextId,
        module: u32,
        name: &str,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<()> {
        self.of_ctx(ctx)?
            .global_read(ctx, module, name, offset, buf)
    }

    fn global_write(
        &self,
        ctx: ContextId,
        module: u32,
        name: &str,
        offset: u64,
        data: &[u8],
    ) -> Result<()> {
        self.of_ctx(ctx)?
            .global_write(ctx, module, name, offset, data)
    }
}

const THROUGH_A_VM: HalError =
    HalError::Unsupported("with GPU workers, objects are made through the VM's GPU");

fn worker_per(g: Granularity) -> &'static str {
    match g {
        Granularity::Vm => "a worker per VM",
        Granularity::Process => "a worker per guest process",
    }
}

/// The backend's global view: totals, and channel calls routed to their VM.
impl Gpu for WorkerPool {
    fn info(&self) -> GpuInfo {
        let mut gi = self.shared.cfg.gpu.clone();
        gi.name = format!("{} ({})", gi.name, worker_per(self.shared.cfg.granularity));
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

    fn hold_fetch(&self, ch: ChannelId, hold: bool) -> Result<bool> {
        self.owner(ch)?.hold_fetch(ch, hold)
    }

    fn fetched_done(&self, ch: ChannelId) -> Result<Option<bool>> {
        self.owner(ch)?.fetched_done(ch)
    }
}
