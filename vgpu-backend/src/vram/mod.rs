//! The VRAM manager: per-VM VRAM shares and transparent swapping of VRAM to system memory
//! behind running guests (DESIGN.md "VRAM swapping"; Metter's thesis, done per VM).
//!
//! - [`policy`]: shares (weight-derived, capped by quota and demand), victim and swap-in
//!   order;
//! - [`backing`]: a VRAM object as 2 MiB chunks, each in VRAM or in swap;
//! - [`slabs`]: a VM's own 2 MiB frames for its pieces smaller than a chunk (whole chunks
//!   come from the GPU at chunk alignment, so no VM's small objects split another's);
//! - [`store`]: the per-VM swap memfd and the `SysMemory` that lets the GPU reach it;
//! - [`vram_objects`](crate::vm::vram_objects) (in `vm`): allocating, freeing and mapping
//!   chunked objects;
//! - [`vram_move`](crate::vm::vram_move) (in `vm`): the pause dance that moves chunks
//!   (shadow + drain, copy, remap, invalidate, aperture, free, resume);
//! - [`stats`]: counters per VM and per process.
//!
//! Allocation never blocks on another VM: chunks that do not fit in free VRAM are placed
//! straight into the VM's swap store (as long as the VM stays within its VRAM + swap
//! limit) and the manager thread is woken. Each pass it reads the MMU access counters
//! (recency per chunk), computes the shares, then moves chunks: from the VM furthest over
//! its share to the VM furthest below it (deficit order), into free VRAM, and within a VM
//! it swaps a hot swapped chunk for a cold resident one. Only one session lock is held at
//! a time, never across VMs, so nothing can deadlock with the request path or the
//! scheduler.

pub mod backing;
pub mod handle;
pub mod policy;
pub mod slabs;
pub mod stats;
pub mod store;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::{debug, info};
use thiserror::Error;

use crate::VgpuBackend;
use backing::CHUNK;
use handle::{Dir, VramVm};
use policy::VmFigures;
pub use stats::{MoveReport, ProcVramStats, VmVramStats, VramOverview, VramReport};

/// Largest swap store per VM (virtual size; pages are committed only when used).
pub const MAX_SWAP_STORE: u64 = 1 << 40;

/// Why a move did not happen.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum MoveError {
    #[error("the object or its context is gone")]
    Gone,
    #[error("channels did not drain in time")]
    DrainTimeout,
    #[error("pausing a channel failed: {0}")]
    Pause(String),
    #[error("no swap space")]
    NoSwap,
    #[error("no free VRAM")]
    NoVram,
    #[error("GPU: {0}")]
    Hal(String),
    #[error("aperture remap: {0}")]
    Aperture(String),
    #[error("no frontend connected")]
    Disconnected,
}

/// Errors of the VRAM manager's operator interface.
#[derive(Debug, Error)]
pub enum VramError {
    #[error("no VM named {0:?}")]
    NoVm(String),
    #[error("VM {0:?} has no frontend connected")]
    NotConnected(String),
    #[error("invalid VRAM configuration: {0}")]
    InvalidConfig(String),
    #[error("move failed: {0}")]
    Move(#[from] MoveError),
}

/// Tunables of the manager.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VramConfig {
    /// Period of the manager's passes when nothing wakes it (1..=10000 ms).
    pub period_ms: u32,
    /// Most bytes moved per pause (one batch).
    pub batch_bytes: u64,
    /// How long a move waits for the channels to drain before it gives up on the victim.
    pub drain_timeout_ms: u32,
    /// Within a VM, swap a hot swapped chunk for a cold resident one (LRU replacement).
    pub lru_exchange: bool,
    /// Whether the manager moves anything at all (off: allocations still spill).
    pub enabled: bool,
}

impl Default for VramConfig {
    fn default() -> Self {
        VramConfig {
            period_ms: 20,
            batch_bytes: 16 << 20,
            drain_timeout_ms: 100,
            lru_exchange: true,
            enabled: true,
        }
    }
}

/// Wakes the manager thread (from the request path: allocation spills, frees).
#[derive(Debug, Default)]
pub struct Waker {
    flag: Mutex<bool>,
    cv: Condvar,
}

impl Waker {
    pub fn wake(&self) {
        *self.flag.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.cv.notify_one();
    }

    fn wait(&self, timeout: Duration) {
        let g = self.flag.lock().unwrap_or_else(|e| e.into_inner());
        let (mut g, _) = self
            .cv
            .wait_timeout_while(g, timeout, |f| !*f)
            .unwrap_or_else(|e| e.into_inner());
        *g = false;
    }
}

/// The VRAM state of one VM's session.
#[derive(Debug, Default)]
pub struct VmSwap {
    pub(crate) store: Option<Arc<store::SwapStore>>,
    pub(crate) counters: stats::Counters,
    /// The manager's epoch (recency clock), copied in at each pass.
    pub(crate) epoch: u64,
    waker: Option<Arc<Waker>>,
}

impl VmSwap {
    pub(crate) fn set_waker(&mut self, w: Arc<Waker>) {
        self.waker = Some(w);
    }

    pub(crate) fn wake(&self) {
        if let Some(w) = &self.waker {
            w.wake();
        }
    }
}

/// The backend's VRAM manager.
#[derive(Default)]
pub(crate) struct VramManager {
    waker: Arc<Waker>,
    config: Mutex<VramConfig>,
    thread: Mutex<Option<JoinHandle<()>>>,
    stop: Arc<AtomicBool>,
    /// Serializes passes and forced evictions.
    pass_lock: Mutex<()>,
    epoch: AtomicU64,
    passes: AtomicU64,
    batches: AtomicU64,
}

impl VramManager {
    pub(crate) fn waker(&self) -> Arc<Waker> {
        self.waker.clone()
    }

    fn config(&self) -> VramConfig {
        *self.config.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts the manager thread once.
    pub(crate) fn start(&self, be: &Arc<VgpuBackend>) {
        let mut t = self.thread.lock().unwrap_or_else(|e| e.into_inner());
        if t.is_some() || self.stop.load(Ordering::Acquire) {
            return;
        }
        let weak = Arc::downgrade(be);
        let stop = self.stop.clone();
        let waker = self.waker.clone();
        match std::thread::Builder::new()
            .name("vgpu-vram".into())
            .spawn(move || thread_main(weak, stop, waker))
        {
            Ok(h) => *t = Some(h),
            Err(e) => log::error!("cannot start the VRAM manager thread: {e}"),
        }
    }

    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.waker.wake();
        let h = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(h) = h {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

fn thread_main(be: Weak<VgpuBackend>, stop: Arc<AtomicBool>, waker: Arc<Waker>) {
    vgpu_sandbox::enter(vgpu_sandbox::Role::VramManager);
    loop {
        let period = match be.upgrade() {
            Some(b) => Duration::from_millis(u64::from(b.vram.config().period_ms)),
            None => return,
        };
        waker.wait(period);
        if stop.load(Ordering::Acquire) {
            break;
        }
        let Some(b) = be.upgrade() else { return };
        if b.stop.load(Ordering::Acquire) {
            break;
        }
        b.vram_pass();
    }
    debug!("VRAM manager stopped");
}

/// One VM as a pass sees it.
struct PassVm {
    vm: Arc<dyn VramVm>,
    fig: VmFigures,
}

impl VgpuBackend {
    /// One pass of the manager: recency, shares, moves.
    pub(crate) fn vram_pass(&self) {
        let _g = self
            .vram
            .pass_lock
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let cfg = self.vram.config();
        let epoch = self.vram.epoch.fetch_add(1, Ordering::Relaxed) + 1;
        self.vram.passes.fetch_add(1, Ordering::Relaxed);
        let mut vms: Vec<PassVm> = Vec::new();
        for vm in self.vram_vms().into_iter().filter(|v| v.movable()) {
            let f = vm.begin_pass(epoch);
            let fig = VmFigures {
                weight: vm.weight(),
                quota: f.quota,
                allocated: f.allocated,
                resident: f.resident,
                pinned: !f.swappable,
            };
            vms.push(PassVm { vm, fig });
        }
        if !cfg.enabled || vms.is_empty() {
            return;
        }
        let vram = self.gpu.info().vram_bytes;
        let figs: Vec<VmFigures> = vms.iter().map(|v| v.fig).collect();
        let shares = policy::shares(vram, &figs);
        for (v, s) in vms.iter().zip(&shares) {
            v.vm.set_share(*s);
        }
        let timeout = Duration::from_millis(u64::from(cfg.drain_timeout_ms));
        let deadline = Instant::now() + Duration::from_millis(200);
        let mut stuck: Vec<BTreeSet<u32>> = vec![BTreeSet::new(); vms.len()];
        // 1. Deficit order: VMs below their share get VRAM back first, taken from the VM
        //    furthest over its share when none is free; then spare VRAM for anyone.
        while Instant::now() < deadline {
            let figs: Vec<VmFigures> = vms.iter().map(|v| v.fig).collect();
            let order = policy::swap_in_order(&figs, &shares);
            let Some(&u) = order.first() else { break };
            let owed = shares[u].saturating_sub(figs[u].resident);
            let free = self.gpu.vram_free_bytes();
            if free < CHUNK {
                if owed == 0 {
                    break;
                }
                let Some(v) = policy::victim(&figs, &shares) else {
                    break;
                };
                if v == u {
                    break;
                }
                let over = figs[v].resident - shares[v];
                let amount = cfg.batch_bytes.min(over).min(owed).max(1);
                if !self.evict_from(&mut vms[v], amount, timeout, &mut stuck[v]) {
                    break;
                }
                continue;
            }
            let amount = if owed > 0 { owed } else { free }
                .min(free)
                .min(cfg.batch_bytes);
            if !self.swap_in_to(&mut vms[u], amount, timeout, &mut stuck[u]) {
                break;
            }
        }
        // 2. LRU exchange within a VM: a swapped chunk touched more recently than a
        //    resident one takes its place.
        if cfg.lru_exchange {
            // A pinned VM's chunks stay put (one a forced eviction moved out comes back
            // through the deficit order above).
            for v in vms.iter_mut().filter(|v| !v.fig.pinned) {
                if Instant::now() >= deadline {
                    break;
                }
                self.exchange(v, cfg.batch_bytes, timeout);
            }
        }
    }

    /// Evicts up to `amount` bytes (whole chunks) of VM `v`'s coldest resident chunks.
    fn evict_from(
        &self,
        v: &mut PassVm,
        amount: u64,
        timeout: Duration,
        stuck: &mut BTreeSet<u32>,
    ) -> bool {
        loop {
            let Some(((mem, idx), _)) = v.vm.coldest_resident(amount, stuck) else {
                return false;
            };
            let ctx = v.vm.object_context(mem).unwrap_or(0);
            match v.vm.move_chunks(mem, &idx, Dir::Out, timeout) {
                Ok(r) if r.bytes > 0 => {
                    self.vram.batches.fetch_add(1, Ordering::Relaxed);
                    v.fig.resident = v.fig.resident.saturating_sub(r.bytes);
                    return true;
                }
                Ok(_) => return false,
                Err(e) => {
                    debug!("VM {}: eviction from ctx {ctx}: {e}", v.vm.name());
                    // Give up on this victim, pick another.
                    stuck.insert(ctx);
                }
            }
        }
    }

    /// Swaps in up to `amount` bytes of VM `v`'s hottest swapped chunks.
    fn swap_in_to(
        &self,
        v: &mut PassVm,
        amount: u64,
        timeout: Duration,
        stuck: &mut BTreeSet<u32>,
    ) -> bool {
        loop {
            let Some(((mem, idx), _)) = v.vm.hottest_swapped(amount.max(1), stuck) else {
                return false;
            };
            let ctx = v.vm.object_context(mem).unwrap_or(0);
            match v.vm.move_chunks(mem, &idx, Dir::In, timeout) {
                Ok(r) if r.bytes > 0 => {
                    self.vram.batches.fetch_add(1, Ordering::Relaxed);
                    v.fig.resident += r.bytes;
                    return true;
                }
                Ok(_) | Err(MoveError::NoVram) => return false,
                Err(e) => {
                    debug!("VM {}: swap-in to ctx {ctx}: {e}", v.vm.name());
                    stuck.insert(ctx);
                }
            }
        }
    }

    /// LRU replacement inside one VM: while its hottest swapped chunk is more recent than
    /// its coldest resident chunk, trade them (a batch at a time).
    fn exchange(&self, v: &mut PassVm, batch: u64, timeout: Duration) {
        let none = BTreeSet::new();
        for _ in 0..4 {
            let (Some((_, hot)), Some((_, cold))) = (
                v.vm.hottest_swapped(CHUNK, &none),
                v.vm.coldest_resident(CHUNK, &none),
            ) else {
                return;
            };
            if hot <= cold {
                return;
            }
            if self.gpu.vram_free_bytes() < CHUNK {
                let Some(((mem, idx), _)) = v.vm.coldest_resident(batch, &none) else {
                    return;
                };
                // Only chunks colder than the hot one go.
                let idx = v.vm.colder_than(mem, idx, hot);
                if v.vm
                    .move_chunks(mem, &idx, Dir::Out, timeout)
                    .map(|r| r.bytes)
                    .unwrap_or(0)
                    == 0
                {
                    return;
                }
            }
            let Some(((mem, idx), _)) = v.vm.hottest_swapped(batch, &none) else {
                return;
            };
            if v.vm
                .move_chunks(mem, &idx, Dir::In, timeout)
                .map(|r| r.bytes)
                .unwrap_or(0)
                == 0
            {
                return;
            }
            self.vram.batches.fetch_add(1, Ordering::Relaxed);
        }
    }

    // ---- operator interface -----------------------------------------------------------

    /// VRAM figures and swap counters of VM `name`, totals and per guest process.
    pub fn vram_stats(&self, name: &str) -> Option<VramReport> {
        self.vram_vm(name).map(|vm| vm.report())
    }

    /// Backend-wide VRAM figures.
    pub fn vram_overview(&self) -> VramOverview {
        VramOverview {
            vram_bytes: self.gpu.info().vram_bytes,
            free_bytes: self.gpu.vram_free_bytes(),
            passes: self.vram.passes.load(Ordering::Relaxed),
            batches: self.vram.batches.load(Ordering::Relaxed),
        }
    }

    /// Sets VM `name`'s VRAM quota: the most it keeps resident when others need VRAM, and
    /// (with its swap limit) what ALLOC_VRAM admits. Objects already allocated stay.
    pub fn set_vram_quota(&self, name: &str, bytes: u64) -> Result<(), VramError> {
        if let Err(e) = crate::control::validate_vram_quota(bytes) {
            return Err(VramError::InvalidConfig(e.to_string()));
        }
        let vm = self
            .vm(name)
            .ok_or_else(|| VramError::NoVm(name.to_string()))?;
        vm.set_quota(bytes);
        self.vram.waker.wake();
        info!("VM {name}: VRAM quota {bytes} bytes");
        Ok(())
    }

    /// The manager's tunables.
    pub fn vram_config(&self) -> VramConfig {
        self.vram.config()
    }

    pub fn set_vram_config(&self, cfg: VramConfig) -> Result<(), VramError> {
        if !(1..=10_000).contains(&cfg.period_ms)
            || cfg.batch_bytes < CHUNK
            || !(1..=60_000).contains(&cfg.drain_timeout_ms)
        {
            return Err(VramError::InvalidConfig(format!("{cfg:?}")));
        }
        *self.vram.config.lock().unwrap_or_else(|e| e.into_inner()) = cfg;
        self.vram.waker.wake();
        Ok(())
    }

    /// Runs one manager pass now (tests, benchmarks).
    pub fn vram_rebalance(&self) {
        self.vram_pass();
    }

    /// Evicts `bytes` of VM `name`'s coldest resident chunks now, in batches of up to
    /// `bytes` per pause (forced trim; benchmarks measure the pause with it). Returns what
    /// the moves did, summed (pause time: the longest single pause).
    pub fn vram_evict(&self, name: &str, bytes: u64) -> Result<MoveReport, VramError> {
        let _g = self
            .vram
            .pass_lock
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let vm = self
            .vram_vm(name)
            .ok_or_else(|| VramError::NoVm(name.to_string()))?;
        if !vm.movable() {
            return Err(VramError::NotConnected(name.to_string()));
        }
        let timeout = Duration::from_millis(u64::from(self.vram.config().drain_timeout_ms));
        let mut total = MoveReport::default();
        let none = BTreeSet::new();
        let mut gone = 0;
        while total.bytes < bytes {
            let Some(((mem, idx), _)) = vm.coldest_resident(bytes - total.bytes, &none) else {
                break;
            };
            let r = match vm.move_chunks(mem, &idx, Dir::Out, timeout) {
                // Freed while its channels drained: nothing of it is resident any more.
                Err(MoveError::Gone) if gone < 16 => {
                    gone += 1;
                    continue;
                }
                r => r?,
            };
            if r.bytes == 0 {
                break;
            }
            total.chunks += r.chunks;
            total.bytes += r.bytes;
            total.channels_paused = total.channels_paused.max(r.channels_paused);
            total.pause_ns = total.pause_ns.max(r.pause_ns);
            total.drain_ns += r.drain_ns;
            total.copy_ns += r.copy_ns;
        }
        self.vram.batches.fetch_add(1, Ordering::Relaxed);
        Ok(total)
    }
}
