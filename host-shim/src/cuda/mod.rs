//! `cuda`: the HAL on a real NVIDIA GPU.
//!
//! Guests see exactly what they see on the `sim`: channel control pages in host shared
//! memory that they map and store GP_PUT into. A host front end (`frontend`) plays
//! PFIFO and issues the work on one CUDA stream per channel. The control pages, channel
//! core, GP fetch/decode and context/channel tables are the front-end core it shares with
//! the sim (`crate::fifo`); this module adds planning, streams and host registration.
//!
//! Memory. The GPU's page tables are the same software MMU the sim uses
//! ([`crate::mmu::AddressSpace`]): every LAUNCH/COPY/semaphore address is translated and
//! checked through the issuing context's mappings when the entry is planned
//! ([`plan`]), and the kernels receive only the resulting flat pointers. VRAM is device
//! memory (`vram`); the CPU cannot map it, so the HAL offers no aperture file and guests
//! move bytes in and out with the copy engine (the runtime stages through guest RAM, as
//! `cudaMemcpy` does). System-memory targets (guest RAM, swapped VRAM chunks) are
//! registered with the driver when mapped, so kernels reach them over PCIe/C2C. See
//! `docs/architecture/gpu.md` ("The `cuda` GPU").
//!
//! Isolation: one CUDA context for all tenants, with checked pointer arguments. A guest's
//! own module kernel cannot be checked so: modules load only where this GPU serves one
//! VM in a process of its own ([`CudaConfig::guest_modules`], `modules`).

mod attributes;
mod channel;
pub mod device;
mod direct;
pub mod driver;
pub mod error;
pub mod fake;
pub mod fake_modules;
mod fake_vmm;
mod frontend;
mod hostreg;
mod identity;
mod modules;
pub mod plan;
pub mod timeline;
mod vram;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use self::channel::CudaChannel;
pub use self::device::Device;
pub use self::driver::CudaDevice;
pub use self::error::DeviceError;
pub use self::fake::{FakeDevice, FakeSignals};
pub use self::frontend::FrontendCounts;
use self::hostreg::HostRegistry;
use self::vram::DeviceVram;
use crate::fifo::control_pages::ControlPages;
use crate::fifo::tables::Tables;
use crate::hal::*;
use crate::mmu::AddressSpace;
use crate::vram::VramAllocator;
use crate::vram_pool::VramPool;

/// Sizes and polling behaviour of a `cuda` GPU.
#[derive(Debug, Clone)]
pub struct CudaConfig {
    /// Bytes of VRAM (device memory, allocated at start).
    pub vram_bytes: u64,
    pub max_channels: u32,
    pub max_contexts: u32,
    /// After activity, the front end busy-polls this long before it starts sleeping.
    pub busy_poll_ns: u64,
    /// ... and this long while its own work is on the GPU: a small kernel's completion and
    /// the guest's next submission are seen at once, not after a nap (the front end costs
    /// a core while it spins; with the GPU turn only the holder has work on the GPU).
    pub busy_poll_inflight_ns: u64,
    /// After a channel appears, the front end busy-polls this long: its first
    /// submission usually follows within a few hundred µs (the guest's reply path), and a
    /// sleeping front end's wake-up (doorbell, then kick thread, then front end) cost that
    /// submission 120–190 µs on the H100 (2026-11-27, `--only loop-overhead`).
    pub new_channel_poll_ns: u64,
    /// Sleep between polls while the front end's own work is on the GPU (completions are
    /// found by polling), and the shortest sleep when idle without the doorbell.
    pub min_idle_sleep_ns: u64,
    /// Longest sleep between polls when idle without the doorbell (doubling from
    /// `min_idle_sleep_ns`).
    pub max_idle_sleep_ns: u64,
    /// Idle with the doorbell armed (protocol.md §2.1): the front end sleeps until a
    /// doorbell, or for at most this long. 0: no doorbell; idle sleeps double from
    /// `min_idle_sleep_ns` to `max_idle_sleep_ns` and a submission waits for the next
    /// poll (the comparison baseline).
    pub doorbell_sleep_ns: u64,
    /// How long `invalidate_tlb`/`destroy_context` wait for a context's GPU work.
    pub drain_timeout: Duration,
    /// Most GP entries sharing one completion mark while the GPU's active channels
    /// belong to a single context (with several contexts, every entry gets its own mark,
    /// so busy time stays exact per entry).
    pub batch: u32,
    /// A channel with nothing on the GPU and no entry issued for this long does not count
    /// as active for batching. Default 100 ms: longer than the scheduler keeps a VM's
    /// channel shadowed. With 5 ms the weights 1:2:4 split drifted from 0.01–0.12 to
    /// 0.6–1.9 pp off (H100, 2026-11-28): a VM waiting out its slice went quiet, and the
    /// others' batches blurred its charge when it came back.
    pub batch_quiet_ns: u64,
    /// Most completion marks one channel may have on its stream at once.
    pub max_inflight: usize,
    /// About how much GPU time of a channel's work (its recent entries' mean times the
    /// entries in flight) the front end queues ahead; 0: no bound beyond `max_inflight`
    /// (64 marks of up to 32 entries). A VRAM move holds the channel's fetch and waits
    /// for what is queued ([`Gpu::hold_fetch`]).
    pub queue_ahead_ns: u64,
    /// Kernels of grids up to this many blocks that end a GP entry write its REF
    /// themselves (`kernels.cu`'s fence signal) instead of a stream write after them;
    /// 0: never. Default 1: on the H100 (2026-11-26) the signal raised back-to-back empty
    /// kernels from 0.56–0.68 to a median 0.90 × native CUDA, but a 256-block sgemm 1024³
    /// took 0.41 instead of 0.345 ms with it (its system-scope release after 4 MiB of
    /// output), so grids of several blocks keep the stream write.
    pub signal_max_blocks: u64,
    /// A channel whose entries take this long on the GPU or longer (its recent mean), or
    /// whose entries have not been timed yet, leaves a REF write its last kernel owes to
    /// a completion mark (the front end stores it once the mark is reached) rather than
    /// to the next kernel's first thread. The mark costs the GPU nothing between kernels
    /// but the front end ~1 µs of CPU time a GP entry; the kernel's system-scope store
    /// costs the GPU ~1.5 µs a kernel (native CUDA's saxpy 2²⁴ × 50 step loop with it:
    /// 3.75–3.76 ms of GPU time, without: 3.67–3.68; the VM's with the store:
    /// 3.79–3.80, with marks: 3.70; H100, 2026-12-08). Only kernels of several blocks
    /// owe a write (one block signals itself, `signal_max_blocks`), so a loop of them
    /// this short is the front end's to keep up with, and the GPU's store is free.
    /// `u64::MAX`: always the kernel's store.
    pub mark_owed_ref_over_ns: u64,
    /// Time the front end's parts (fetch and plan, issue, marks, retire) with the host
    /// clock, for [`frontend::FrontendCounts`] (benchmarks: four clock reads per entry).
    pub time_frontend: bool,
    /// The GPU turn shared with the other workers of a backend (one VM's GPU work per
    /// process, [`crate::gpu_turn`]); `None` in process, where one context's streams
    /// share the GPU without time-slicing.
    pub turn: Option<Arc<crate::gpu_turn::GpuTurn>>,
    /// Whether guests may load their own modules: only where this GPU serves one VM in a
    /// process of its own (a GPU worker). In the backend's process every VM shares one
    /// CUDA context, and MODULE_LOAD is refused with `ModulesNeedWorker`.
    pub guest_modules: bool,
}

impl Default for CudaConfig {
    fn default() -> Self {
        CudaConfig {
            vram_bytes: 1 << 30,
            max_channels: 256,
            max_contexts: 256,
            busy_poll_ns: 200_000,
            busy_poll_inflight_ns: 2_000_000,
            new_channel_poll_ns: 2_000_000,
            min_idle_sleep_ns: 10_000,
            max_idle_sleep_ns: 1_000_000,
            doorbell_sleep_ns: crate::fifo::doze::DEFAULT_SLEEP_NS,
            drain_timeout: Duration::from_secs(10),
            batch: 32,
            batch_quiet_ns: 100_000_000,
            max_inflight: 64,
            queue_ahead_ns: 2_000_000,
            signal_max_blocks: 1,
            mark_owed_ref_over_ns: 10_000,
            time_frontend: false,
            turn: None,
            guest_modules: false,
        }
    }
}

/// State shared by the API and the front-end thread.
pub(crate) struct Shared<D: Device> {
    cfg: CudaConfig,
    dev: Arc<D>,
    vram: DeviceVram,
    /// Contexts, channels and control pages; wakes the front-end thread.
    fifo: Tables<CudaChannel<D>, CudaContext>,
    shutdown: AtomicBool,
    frontend_cpu_ns: AtomicU64,
    stats: Arc<frontend::FrontendStats>,
    /// Scratch buffers replaced while work may still use them; freed at drop.
    old_scratch: Mutex<Vec<u64>>,
    /// Fence-signal counters of destroyed channels, for new channels (zeroed again
    /// before reuse); freed at drop.
    spare_counts: Mutex<Vec<u64>>,
    /// Host memory registered with the driver (the front end splits operands at its
    /// pieces' ends: one driver call must not span two registrations).
    hostreg: Mutex<HostRegistry>,
    /// The registry key of the next system-memory mapping (from 1; below [`HINT_KEY`]).
    next_sys_map: AtomicU64,
    /// Guests' modules by (context, module id).
    modules: Mutex<std::collections::HashMap<(ContextId, u32), D::Module>>,
    /// Functions contexts bound for LAUNCH_FUNCTION (read by the front end).
    functions: Mutex<modules::FunctionTable>,
    /// Guest addresses mapped as device addresses (only where guests load modules).
    identity: Mutex<identity::Mirrors>,
}

impl<D: Device> Shared<D> {
    fn retire_scratch(&self, ptrs: Vec<u64>) {
        self.old_scratch
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(ptrs);
    }
}

/// What `cuda` keeps with a context besides its address space.
struct CudaContext {
    sysmem: Arc<dyn SysMemory>,
    /// System-memory mappings whose host memory is registered: (GPU VA, registry key) →
    /// size. A key is the mapping's own, never reused: a retargeted part of a mapping may
    /// start at the same VA as the mapping (a run of swapped chunks whose first chunk
    /// moves), and releasing one must not end the other's registration while the GPU
    /// still reads through it.
    sys_maps: BTreeMap<(u64, u64), u64>,
    /// Keys of mappings unmapped or retargeted since the last `invalidate_tlb`: their host
    /// memory stays registered until the GPU is done with the old translations.
    released: Vec<u64>,
}

/// The `cuda` GPU over a [`Device`]: [`CudaGpu`] on real hardware, [`FakeCudaGpu`] in tests.
pub struct CudaGpuOf<D: Device> {
    shared: Arc<Shared<D>>,
    vram_alloc: VramPool,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// The `cuda` GPU on an NVIDIA GPU.
pub type CudaGpu = CudaGpuOf<CudaDevice>;
/// The `cuda` GPU on the CPU fake device (GPU-free tests).
pub type FakeCudaGpu = CudaGpuOf<FakeDevice>;

/// Registry keys of [`Gpu::prepare_sysram_hint`] holds: above every mapping's key (a
/// counter from 1), so they never collide with one.
const HINT_KEY: u64 = 1 << 63;

fn os_err(e: impl std::fmt::Display) -> HalError {
    HalError::Os(e.to_string())
}

impl CudaGpu {
    /// Opens NVIDIA GPU `index`. Fails with a clear error when the driver, NVRTC or the
    /// GPU is missing (see [`DeviceError::is_absent`]).
    pub fn open(index: u32, cfg: CudaConfig) -> std::result::Result<Arc<Self>, DeviceError> {
        let dev = CudaDevice::open(index)?;
        dev.set_signal_max_blocks(cfg.signal_max_blocks);
        Self::with_device(Arc::new(dev), cfg).map_err(|e| DeviceError::Driver {
            call: "starting the cuda GPU",
            code: e.to_string(),
        })
    }
}

impl<D: Device> CudaGpuOf<D> {
    /// A channel's counters as this GPU shows them: all of them.
    fn reported_counters(&self, c: ChannelCounters) -> ChannelCounters {
        c
    }

    /// Builds the GPU on `dev`: allocates and registers VRAM, starts the front end.
    pub fn with_device(dev: Arc<D>, cfg: CudaConfig) -> Result<Arc<Self>> {
        if cfg.max_channels == 0 || cfg.vram_bytes < 1 << 20 {
            return Err(HalError::InvalidArgument(
                "cuda needs at least one channel and 1 MiB of VRAM",
            ));
        }
        let t0 = Instant::now();
        let vram = DeviceVram::new(&*dev, cfg.vram_bytes)?;
        log::info!(
            "cuda: {} MiB of VRAM in device memory, allocated in {:?}",
            vram.len() >> 20,
            t0.elapsed()
        );
        let pages = Arc::new(ControlPages::new(cfg.max_channels).map_err(os_err)?);
        // The GPU writes each channel's REF itself, in stream order: a fence then signals
        // when its entry is done, not when the last entry sharing its completion mark is.
        if let Some((ptr, len)) = pages.host_range() {
            match dev.register_host(ptr, len) {
                Ok(()) => pages.set_device_mapped(true),
                Err(e) => log::warn!(
                    "cuda: control pages not registered ({e}); REF stored by the front end"
                ),
            }
        }
        let shared = Arc::new(Shared {
            cfg: cfg.clone(),
            dev,
            fifo: Tables::new(pages, cfg.max_contexts, vram.len()),
            vram,
            shutdown: AtomicBool::new(false),
            frontend_cpu_ns: AtomicU64::new(0),
            stats: Arc::new(frontend::FrontendStats {
                timed: AtomicBool::new(cfg.time_frontend),
                ..Default::default()
            }),
            old_scratch: Mutex::new(Vec::new()),
            spare_counts: Mutex::new(Vec::new()),
            hostreg: Mutex::new(HostRegistry::default()),
            next_sys_map: AtomicU64::new(1),
            modules: Mutex::new(Default::default()),
            functions: Mutex::new(Default::default()),
            identity: Mutex::new(Default::default()),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("cuda-pfifo".into())
            .spawn(move || {
                vgpu_sandbox::enter(vgpu_sandbox::Role::GpuEngine);
                frontend::run(s)
            })
            .map_err(os_err)?;
        shared.fifo.set_frontend(thread.thread().clone());
        Ok(Arc::new(CudaGpuOf {
            shared,
            vram_alloc: VramPool::new(cfg.vram_bytes),
            thread: Mutex::new(Some(thread)),
        }))
    }

    /// The device under this GPU.
    pub fn device(&self) -> &Arc<D> {
        &self.shared.dev
    }

    /// Host memory pieces registered with the device (leak checks).
    pub fn registered_pieces(&self) -> usize {
        self.shared
            .hostreg
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pieces()
    }

    /// The control pages' host range (address, bytes) while registered with the device
    /// for the GPU's own REF writes (registered for the GPU's whole life).
    pub fn control_pages_registration(&self) -> Option<(usize, usize)> {
        let pages = self.shared.fifo.pages();
        pages
            .host_range()
            .filter(|_| pages.device_mapped())
            .map(|(p, len)| (p as usize, len))
    }

    /// CUDA's own launch → kernel start in this process, ns per sample: TIMESTAMP
    /// kernels launched straight on a stream of the GPU's context, one after another.
    pub fn direct_launch_to_start_ns(
        &self,
        samples: u32,
    ) -> std::result::Result<Vec<i64>, DeviceError> {
        direct::launch_to_start(&*self.shared.dev, samples)
    }

    /// CUDA's own back-to-back launch rate in this process, kernels per second: `kernels`
    /// empty kernels launched straight on a stream of the GPU's context.
    pub fn direct_b2b_rate(&self, kernels: u32) -> std::result::Result<f64, DeviceError> {
        direct::b2b_rate(&*self.shared.dev, kernels)
    }

    /// CPU time of the front-end thread so far, in ns.
    pub fn frontend_cpu_ns(&self) -> u64 {
        self.shared.frontend_cpu_ns.load(Ordering::Relaxed)
    }

    /// What the front end has issued so far (entries, completion marks).
    pub fn frontend_counts(&self) -> frontend::FrontendCounts {
        self.shared.stats.snapshot()
    }

    /// Every live channel with its context and counters.
    pub fn channels(&self) -> Vec<(ChannelId, ContextId, ChannelCounters)> {
        self.shared.fifo.channel_list()
    }

    fn lock_identity(&self) -> std::sync::MutexGuard<'_, identity::Mirrors> {
        self.shared
            .identity
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Mirrors a new 2 MiB-page mapping at the guest's address (identity addressing),
    /// where guests load modules: VRAM at `offset`, or host memory for now (`None`).
    fn mirror(
        &self,
        ctx: ContextId,
        va: u64,
        size: u64,
        offset: Option<u64>,
        page: PageSize,
        flags: MapFlags,
    ) {
        if page == PageSize::Huge2M && self.shared.cfg.guest_modules {
            self.lock_identity().map(
                &*self.shared.dev,
                &self.shared.vram,
                ctx,
                va,
                size,
                offset,
                !flags.read_only,
            );
        }
    }

    /// Drops `ctx`'s mirrors of `va..va+size` before its page table changes there (after
    /// the context's work is done with them), re-adding them for a remap to VRAM
    /// (`retarget`: `Some(Some(offset))`; `Some(None)` host memory; `None` an unmap).
    fn unmirror(
        &self,
        ctx: ContextId,
        va: u64,
        size: u64,
        retarget: Option<Option<u64>>,
    ) -> Result<()> {
        let (listed, mapped) = {
            let m = self.lock_identity();
            (m.has_pages(ctx, va, size), m.touches(ctx, va, size))
        };
        if !listed {
            return Ok(());
        }
        if mapped {
            self.drain(&self.context_channels(ctx))?;
        }
        let dev = &*self.shared.dev;
        let mut mirrors = self.lock_identity();
        match retarget {
            None => mirrors.unmap(dev, ctx, va, size),
            Some(offset) => mirrors.remap(dev, &self.shared.vram, ctx, va, size, offset),
        }
        Ok(())
    }

    fn lock_vram(&self) -> std::sync::MutexGuard<'_, VramAllocator> {
        self.vram_alloc.lock()
    }

    fn space(&self, ctx: ContextId) -> Result<Arc<AddressSpace>> {
        self.shared.fifo.space(ctx)
    }

    /// Waits until every entry issued so far on `chans` has completed on the GPU.
    fn drain(&self, chans: &[Arc<CudaChannel<D>>]) -> Result<()> {
        let deadline = Instant::now() + self.shared.cfg.drain_timeout;
        for c in chans {
            while !c.drained(&*self.shared.dev) {
                if Instant::now() > deadline {
                    log::warn!("cuda: channel {:?} still has GPU work in flight", c.core.id);
                    return Err(HalError::Os(
                        "GPU work still in flight (a semaphore wait that nobody releases?)".into(),
                    ));
                }
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        Ok(())
    }

    fn context_channels(&self, ctx: ContextId) -> Vec<Arc<CudaChannel<D>>> {
        self.shared
            .fifo
            .channels()
            .into_iter()
            .filter(|c| c.core.ctx == ctx)
            .collect()
    }

    /// Frees removed channels' scratch once their streams have drained.
    fn reap(&self, removed: &[Arc<CudaChannel<D>>]) -> Result<()> {
        let drained = self.drain(removed);
        if drained.is_ok() {
            for c in removed {
                let mut st = c.lock();
                if let Some((p, _)) = st.scratch.take() {
                    self.shared.dev.free_device(p);
                }
                if let Some(p) = st.signal_count.take().filter(|&p| p != 0) {
                    self.keep_signal_count(p);
                }
            }
        } else {
            for c in removed {
                c.core.retire_slot();
            }
        }
        drained
    }

    /// A new channel, fresh or continuing at a saved position (live migration).
    fn new_channel(
        &self,
        ctx: ContextId,
        cfg: ChannelConfig,
        sink: Arc<dyn EventSink>,
        at: Option<ChannelResume>,
    ) -> Result<ChannelId> {
        let (core, ()) = self.shared.fifo.new_core(ctx, cfg, sink, at, |_| ())?;
        let stream = self.shared.dev.create_stream().map_err(os_err)?;
        let ch = Arc::new(CudaChannel::new(core, stream, self.shared.stats.clone()));
        if self.shared.cfg.signal_max_blocks > 0 {
            // The fence-signal counter now, not at the channel's first kernel: a driver
            // allocation and a synchronous zeroing there cost a short timed loop ~0.1 ms.
            ch.lock().signal_count = Some(self.signal_count());
        }
        let id = self.shared.fifo.insert_channel(ch.clone());
        if id.is_err() {
            // Its context went away meanwhile: nothing ran on the counter.
            if let Some(p) = ch.lock().signal_count.take().filter(|&p| p != 0) {
                self.shared.dev.free_device(p);
            }
        }
        id
    }

    /// A zeroed fence-signal counter for a new channel: a destroyed channel's if one is
    /// kept (no driver allocation), else a new one (0 if none can be had).
    fn signal_count(&self) -> u64 {
        let dev = &*self.shared.dev;
        loop {
            let spare = self
                .shared
                .spare_counts
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .pop();
            let Some(p) = spare else {
                return frontend::new_signal_count(dev);
            };
            match dev.zero_device(p, frontend::SIGNAL_COUNT_BYTES as usize) {
                Ok(()) => return p,
                Err(e) => {
                    log::warn!("cuda: zeroing a kept signal counter: {e}");
                    dev.free_device(p);
                }
            }
        }
    }

    /// Keeps a drained channel's signal counter for the next channel (a few at most; the
    /// rest are freed).
    fn keep_signal_count(&self, p: u64) {
        const KEPT: usize = 64;
        let mut spare = self
            .shared
            .spare_counts
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if spare.len() < KEPT {
            spare.push(p);
        } else {
            drop(spare);
            self.shared.dev.free_device(p);
        }
    }

    /// A registry key for a new system-memory mapping.
    fn new_sys_key(&self) -> u64 {
        self.shared.next_sys_map.fetch_add(1, Ordering::Relaxed)
    }

    /// Registers the host memory at `addr` (a system-memory mapping's, or a hint's) with
    /// the device for registry key `key`.
    fn register_sysram(&self, ctx: ContextId, key: u64, addr: u64, size: u64) -> Result<()> {
        let sysmem = self
            .shared
            .fifo
            .read_contexts()
            .get(&ctx)
            .map(|c| c.gpu.sysmem.clone())
            .ok_or(HalError::NoContext(ctx))?;
        let mut reg = self
            .shared
            .hostreg
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let mut done = 0u64;
        while done < size {
            let a = addr + done;
            let r = sysmem
                .translate(a, size - done)
                .filter(|r| r.len > 0 && !r.ptr.is_null())
                .ok_or(HalError::NotMapped { va: a, size })?;
            if let Err(e) = reg.register(&*self.shared.dev, (ctx, key), r.ptr, r.len) {
                reg.release(&*self.shared.dev, |k| *k == (ctx, key));
                return Err(os_err(e));
            }
            done += r.len as u64;
        }
        Ok(())
    }

    /// Ends registry key `key`'s hold on host memory at once (a registration no
    /// translation uses yet).
    fn release_key(&self, ctx: ContextId, key: u64) {
        self.shared
            .hostreg
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .release(&*self.shared.dev, |k| *k == (ctx, key));
    }

    /// Marks the registered mappings wholly inside `va..va+size` as released (their
    /// registration ends at the next `invalidate_tlb`, once the GPU is done with them).
    fn release_sysram(&self, ctx: ContextId, va: u64, size: u64) {
        let end = va.saturating_add(size);
        if let Some(c) = self.shared.fifo.write_contexts().get_mut(&ctx) {
            let c = &mut c.gpu;
            let gone: Vec<(u64, u64)> = c
                .sys_maps
                .range((va, 0)..(end, 0))
                .filter(|(&(s, _), &l)| s.saturating_add(l) <= end)
                .map(|(&k, _)| k)
                .collect();
            for k in gone {
                c.sys_maps.remove(&k);
                c.released.push(k.1);
            }
        }
    }

    /// Ends the registrations released in `ctx` (after the GPU drained).
    fn unregister_released(&self, ctx: ContextId) {
        let gone = self
            .shared
            .fifo
            .write_contexts()
            .get_mut(&ctx)
            .map(|c| std::mem::take(&mut c.gpu.released))
            .unwrap_or_default();
        if gone.is_empty() {
            return;
        }
        self.shared
            .hostreg
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .release(&*self.shared.dev, |k| k.0 == ctx && gone.contains(&k.1));
    }

    /// Logs a batched host copy: its size, rate, and how much of its host memory was
    /// registered with the driver (the rest went through the driver's staging).
    fn log_batch(&self, what: &str, host: &[(usize, usize)], t: Instant) {
        let ns = t.elapsed().as_nanos().max(1) as f64;
        let bytes: usize = host.iter().map(|h| h.1).sum();
        let reg = self
            .shared
            .hostreg
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let pinned: usize = host.iter().map(|&(p, n)| reg.registered_bytes(p, n)).sum();
        log::debug!(
            "cuda: batched VRAM {what} of {} copies, {bytes} bytes ({pinned} registered) in {:.1} us: {:.1} GB/s",
            host.len(),
            ns / 1e3,
            bytes as f64 / ns
        );
    }

    /// Records a registered system-memory mapping (its registry key `key`).
    fn note_sysram(&self, ctx: ContextId, va: u64, size: u64, key: u64) {
        if let Some(c) = self.shared.fifo.write_contexts().get_mut(&ctx) {
            c.gpu.sys_maps.insert((va, key), size);
        }
    }
}

impl<D: Device> Drop for CudaGpuOf<D> {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared.fifo.wake();
        let t = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = t {
            let _ = t.join();
        }
        let all = self.shared.fifo.remove_channels(|_| true);
        if self.reap(&all).is_err() {
            // The GPU may still touch this memory: leaking it is the safe choice.
            log::warn!("cuda: GPU dropped with work in flight; its memory stays registered");
            return;
        }
        let kept = [&self.shared.old_scratch, &self.shared.spare_counts];
        for p in kept
            .into_iter()
            .flat_map(|l| std::mem::take(&mut *l.lock().unwrap_or_else(|e| e.into_inner())))
        {
            self.shared.dev.free_device(p);
        }
        self.shared
            .hostreg
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .release(&*self.shared.dev, |_| true);
        let pages = self.shared.fifo.pages();
        if let Some((ptr, _)) = pages.host_range() {
            if pages.device_mapped() {
                if let Err(e) = self.shared.dev.unregister_host(ptr) {
                    log::warn!("cuda: unregistering the control pages: {e}");
                }
            }
        }
        self.lock_identity().forget_all(&*self.shared.dev);
        self.shared.vram.free(&*self.shared.dev);
    }
}

impl<D: Device> Gpu for CudaGpuOf<D> {
    fn lost(&self) -> Option<String> {
        self.shared.dev.lost()
    }

    crate::fifo::table_methods!();

    fn device_attributes(&self, _owner: u32) -> Result<Vec<(u32, i32)>> {
        Ok(self.shared.dev.attributes())
    }

    fn info(&self) -> GpuInfo {
        let cfg = &self.shared.cfg;
        GpuInfo {
            name: format!("cuda ({})", self.shared.dev.name()),
            vram_bytes: self.lock_vram().size(),
            compute_engines: 1,
            max_channels: cfg.max_channels,
            max_contexts: cfg.max_contexts,
            has_busy_counters: true,
        }
    }

    fn create_context(&self, sysmem: Arc<dyn SysMemory>) -> Result<ContextId> {
        let space = Arc::new(AddressSpace::new(sysmem.clone()));
        self.shared.fifo.create_context(
            space,
            CudaContext {
                sysmem,
                sys_maps: BTreeMap::new(),
                released: Vec::new(),
            },
        )
    }

    fn destroy_context(&self, ctx: ContextId) -> Result<()> {
        let (_, removed) = self.shared.fifo.remove_context(ctx)?;
        // Only once the GPU is done with the context's memory may it be unregistered (and
        // the owner free it). A stuck semaphore wait keeps the registration (and so the
        // pages) alive rather than let the GPU touch freed memory.
        let reaped = self.reap(&removed);
        // Mirrors go either way: a stuck kernel following a pointer then faults rather
        // than reach VRAM the pool hands out again.
        self.lock_identity().forget(&*self.shared.dev, ctx);
        match reaped {
            Ok(()) => {
                self.forget_modules(ctx);
                self.shared
                    .hostreg
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .release(&*self.shared.dev, |k| k.0 == ctx);
                Ok(())
            }
            Err(e) => {
                log::warn!("cuda: context {ctx:?} destroyed with GPU work in flight: {e}");
                // Its modules stay loaded (work in flight may run their code); its
                // functions are unbound, so no new entry finds them.
                self.unbind_functions(ctx);
                Ok(())
            }
        }
    }

    fn alloc_vram(&self, size: u64, align: u64) -> Result<VramAlloc> {
        let a = self.vram_alloc.alloc(size, align)?;
        if let Err(e) = self.shared.vram.zero(&*self.shared.dev, a.offset, a.size) {
            if let Err(e2) = self.vram_alloc.free(a.offset) {
                log::warn!("cuda: undoing a VRAM allocation: {e2}");
            }
            return Err(e);
        }
        Ok(a)
    }

    fn free_vram(&self, offset: u64) -> Result<()> {
        self.vram_alloc.free(offset)
    }

    fn vram_free_bytes(&self) -> u64 {
        self.vram_alloc.free_bytes()
    }

    fn vram_fd(&self) -> Option<FdRange> {
        None
    }

    fn vram_read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.shared.vram.read(&*self.shared.dev, offset, buf)
    }

    fn vram_write(&self, offset: u64, buf: &[u8]) -> Result<()> {
        self.shared.vram.write(&*self.shared.dev, offset, buf)
    }

    fn vram_read_many(&self, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        let t = Instant::now();
        self.shared.vram.read_many(&*self.shared.dev, reads)?;
        if log::log_enabled!(log::Level::Debug) {
            let host: Vec<(usize, usize)> = reads
                .iter()
                .map(|(_, b)| (b.as_ptr() as usize, b.len()))
                .collect();
            self.log_batch("read", &host, t);
        }
        Ok(())
    }

    fn vram_write_many(&self, writes: &[(u64, &[u8])]) -> Result<()> {
        let t = Instant::now();
        self.shared.vram.write_many(&*self.shared.dev, writes)?;
        if log::log_enabled!(log::Level::Debug) {
            let host: Vec<(usize, usize)> = writes
                .iter()
                .map(|(_, b)| (b.as_ptr() as usize, b.len()))
                .collect();
            self.log_batch("write", &host, t);
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
        match target {
            MapTarget::Vram { .. } => self.shared.fifo.check_vram_target(target, size)?,
            MapTarget::Sysram { addr } => {
                let space = self.space(ctx)?;
                let key = self.new_sys_key();
                self.register_sysram(ctx, key, addr, size)?;
                if let Err(e) = space.map(va, size, target, page, flags) {
                    self.release_key(ctx, key);
                    return Err(e);
                }
                self.note_sysram(ctx, va, size, key);
                self.mirror(ctx, va, size, None, page, flags);
                return Ok(());
            }
        }
        self.space(ctx)?.map(va, size, target, page, flags)?;
        if let MapTarget::Vram { offset } = target {
            self.mirror(ctx, va, size, Some(offset), page, flags);
        }
        Ok(())
    }

    fn unmap(&self, ctx: ContextId, va: u64, size: u64) -> Result<()> {
        let space = self.space(ctx)?;
        self.unmirror(ctx, va, size, None)?;
        space.unmap(va, size)?;
        self.release_sysram(ctx, va, size);
        Ok(())
    }

    fn remap(&self, ctx: ContextId, va: u64, size: u64, target: MapTarget) -> Result<()> {
        match target {
            MapTarget::Vram { offset } => {
                self.shared.fifo.check_vram_target(target, size)?;
                self.unmirror(ctx, va, size, Some(Some(offset)))?;
            }
            MapTarget::Sysram { addr } => {
                let space = self.space(ctx)?;
                self.unmirror(ctx, va, size, Some(None))?;
                // A new key for the retargeted range; whatever it replaces is released.
                self.release_sysram(ctx, va, size);
                let key = self.new_sys_key();
                self.register_sysram(ctx, key, addr, size)?;
                if let Err(e) = space.remap(va, size, target) {
                    self.release_key(ctx, key);
                    return Err(e);
                }
                self.note_sysram(ctx, va, size, key);
                return Ok(());
            }
        }
        self.space(ctx)?.remap(va, size, target)?;
        self.release_sysram(ctx, va, size);
        Ok(())
    }

    fn prepare_sysram_hint(&self, ctx: ContextId, addr: u64, len: u64) -> Result<()> {
        // Pinning host memory costs far more than copying into it (measured on the H100:
        // ~1.7 ms per 2 MiB chunk inside a move's pause); done here, the move's copy runs
        // at pinned speed and its remap finds the pages registered.
        self.register_sysram(ctx, HINT_KEY | addr, addr, len)
    }

    fn release_sysram_hint(&self, ctx: ContextId, addr: u64, _len: u64) {
        self.release_key(ctx, HINT_KEY | addr);
    }

    fn access_counts(
        &self,
        ctx: ContextId,
        va: u64,
        size: u64,
        reset: bool,
    ) -> Result<Vec<(u64, u32)>> {
        let mut counts = self.space(ctx)?.access_counts(va, size, reset)?;
        // Kernels reach mirrored pages through stored pointers, which no translation
        // counts: such pages count as used, so VRAM swapping evicts them last (a
        // kernel following a pointer into an evicted page faults).
        let mirrors = self.lock_identity();
        for (at, n) in &mut counts {
            if mirrors.covers(ctx, *at, 1, false) {
                *n = (*n).max(1);
            }
        }
        Ok(counts)
    }

    fn invalidate_tlb(&self, ctx: ContextId) -> Result<()> {
        let space = self.space(ctx)?;
        space.invalidate_tlb();
        // Entries planned before this point carry pointers from the old translations:
        // wait until the GPU has finished them; then released host memory may go.
        self.drain(&self.context_channels(ctx))?;
        self.unregister_released(ctx);
        Ok(())
    }

    /// Why a held fetch loses, repeats and runs early nothing: the front end fetches only
    /// in `issue_new`, under the channel's lock, after reading the flag there; a fetch
    /// under way keeps the lock through its whole batch. So once the flag is stored and
    /// the lock taken once after it, no fetch is under way or can start, and
    /// `fetched_done` (every issued mark reached) means nothing of the channel is on the
    /// GPU. The fetch position (`ChanState::fetched`) is untouched: on resume the front
    /// end goes on from the first entry it did not issue, each exactly once, planned on
    /// the translations of that time.
    fn hold_fetch(&self, ch: ChannelId, hold: bool) -> Result<bool> {
        let c = self.shared.fifo.channel(ch)?;
        c.core.set_fetch_held(hold);
        if hold {
            drop(c.lock());
        } else {
            // It may be asleep with the entries behind already published.
            self.shared.fifo.wake();
        }
        Ok(true)
    }

    fn fetched_done(&self, ch: ChannelId) -> Result<Option<bool>> {
        let c = self.shared.fifo.channel(ch)?;
        if !c.core.fetch_held() {
            return Ok(None);
        }
        Ok(Some(c.core.is_stopped() || c.drained(&*self.shared.dev)))
    }

    fn module_load(&self, ctx: ContextId, module: u32, image: &[u8]) -> Result<()> {
        self.load_module(ctx, module, image)
    }

    fn module_unload(&self, ctx: ContextId, module: u32) -> Result<()> {
        self.unload_module(ctx, module)
    }

    fn function_get(
        &self,
        ctx: ContextId,
        module: u32,
        name: &str,
        function: u32,
    ) -> Result<Option<Vec<ParamInfo>>> {
        self.bind_function(ctx, module, name, function)
    }

    fn global_read(
        &self,
        ctx: ContextId,
        module: u32,
        name: &str,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<()> {
        let copy = modules::VariableCopy::Out(buf);
        self.module_variable(ctx, module, name, offset, copy)
    }

    fn global_write(
        &self,
        ctx: ContextId,
        module: u32,
        name: &str,
        offset: u64,
        data: &[u8],
    ) -> Result<()> {
        let copy = modules::VariableCopy::In(data);
        self.module_variable(ctx, module, name, offset, copy)
    }

    fn global_get(&self, ctx: ContextId, module: u32, name: &str) -> Result<GlobalInfo> {
        self.module_global(ctx, module, name)
    }

    fn destroy_channel(&self, ch: ChannelId) -> Result<()> {
        let removed = self.shared.fifo.remove_channels(|c| c.core.id == ch);
        if removed.is_empty() {
            return Err(HalError::NoChannel(ch));
        }
        if let Err(e) = self.reap(&removed) {
            log::warn!("cuda: channel {ch:?} destroyed with GPU work in flight: {e}");
        }
        Ok(())
    }
}
