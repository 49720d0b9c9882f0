//! Suite `swap`: VRAM oversubscription through `vgpu-backend`'s VRAM manager, measured
//! over the real path (vhost-user socket, loopback VM, guest processes using the runtime)
//! and side by side with an all-in-VRAM run in the same process.
//!
//! Figures:
//! - slowdown of a kernel loop on a hot set when the VM allocated 1.5×/2×/4× the GPU's
//!   VRAM (the rest cold), vs the same loop on a GPU with room for everything;
//! - the same with the hot set itself in swap (the manager off, so it stays there);
//! - swap-out throughput ÷ host memcpy throughput;
//! - pause time per 64 MiB eviction, p50 and p99;
//! - how long a guest CPU store into the buffer being evicted waits (its chunks are
//!   read-only while they move), p50 and p99 over the evictions, beside the gap between
//!   the same stores when nothing moves;
//! - time for two allocating VMs to converge to equal VRAM shares.
//!
//! The sim GPU charges system-memory accesses like VRAM accesses (no PCIe model), so the
//! slowdowns measure the mechanism's cost (pauses, copies, the manager's CPU), not the
//! bandwidth a real GPU loses on swapped data; the hot-set figures say how much of the hot
//! set was in swap while timed, so a reader can apply a PCIe factor. With `--gpu cuda` the
//! oversubscription and convergence parts run on a real GPU (swapped chunks then live in
//! host memory the GPU reads over PCIe); the pause and store-wait part is the sim's (a GPU
//! without a CPU view of VRAM has no aperture stores to wait; `vgpu-bench cuda --only
//! swap` measures its evictions and pauses).
//!
//! Slowdowns compare medians of alternating runs. The headline figure uses the CPU time
//! of the sim's engine threads (what the GPU model spent executing the hot loop), which a
//! busy host does not inflate; `_busy` (the hot process's GPU busy time from the HAL
//! counters, which is wall time on the engine) and `_wall` (submit to fence) are printed
//! beside it and swing by tens of percent on a loaded 2-core host.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use thiserror::Error;
use vgpu_backend::{VgpuBackend, VmLimits, VramConfig};
use vgpu_guest::{Buffer, Channel, Context, Device, KernelArgs};
use vgpu_host_shim::cuda::{CudaConfig, CudaGpu};
use vgpu_host_shim::{Gpu, GpuChoice, HalError, SimConfig, SimGpu};
use vgpu_loopback::{LoopbackConfig, LoopbackVm};

use crate::report::{Better, Figure};

const SUITE: &str = "swap";
const MIB: u64 = 1 << 20;
const HOT_PID: u32 = 100;
const COLD_PID: u32 = 200;

#[derive(Debug, Error)]
pub enum SwapSuiteError {
    #[error("GPU: {0}")]
    Hal(#[from] HalError),
    #[error("runtime: {0}")]
    Runtime(#[from] vgpu_guest::Error),
    #[error("backend: {0}")]
    Backend(String),
    #[error("loopback VM: {0}")]
    Loopback(String),
    #[error("cuda GPU: {0}")]
    Cuda(String),
}

type Result<T> = std::result::Result<T, SwapSuiteError>;

#[derive(Debug, Clone)]
pub struct SwapOpts {
    /// VRAM of the oversubscribed GPU.
    pub vram: u64,
    /// Timed iterations of the hot loop, runs per configuration (median taken).
    pub iters: u32,
    pub runs: u32,
    /// 64 MiB evictions timed for the pause percentiles.
    pub pause_reps: u32,
    /// 64 MiB evictions with a guest thread storing into the buffer (store waits).
    pub store_reps: u32,
    /// Bytes each VM of the convergence run allocates (in 4 MiB steps).
    pub converge_bytes: u64,
    /// The GPU the rigs run on.
    pub gpu: GpuChoice,
}

impl SwapOpts {
    pub fn full() -> Self {
        SwapOpts {
            vram: 128 * MIB,
            iters: 20,
            runs: 5,
            pause_reps: 21,
            store_reps: 11,
            converge_bytes: 128 * MIB,
            gpu: GpuChoice::Sim,
        }
    }

    pub fn quick() -> Self {
        SwapOpts {
            vram: 64 * MIB,
            iters: 5,
            runs: 2,
            pause_reps: 3,
            store_reps: 2,
            converge_bytes: 64 * MIB,
            gpu: GpuChoice::Sim,
        }
    }
}

/// A backend on a GPU with `vram` bytes serving `vms` loopback VMs.
struct Rig {
    gpu: Arc<dyn Gpu>,
    /// The same GPU when it is the sim (its engine threads' CPU time is the steadiest
    /// measure of the GPU work there).
    sim: Option<Arc<SimGpu>>,
    backend: Arc<VgpuBackend>,
    vms: Vec<Arc<LoopbackVm>>,
    dir: PathBuf,
}

impl Rig {
    fn new(
        choice: GpuChoice,
        tag: &str,
        vram: u64,
        limits: VmLimits,
        vms: &[&str],
    ) -> Result<Self> {
        let (gpu, sim): (Arc<dyn Gpu>, _) = match choice {
            GpuChoice::Sim => {
                let sim = SimGpu::new(SimConfig {
                    vram_bytes: vram,
                    ..SimConfig::default()
                })?;
                (sim.clone(), Some(sim))
            }
            GpuChoice::Cuda { index } => {
                let cfg = CudaConfig {
                    vram_bytes: vram,
                    ..CudaConfig::default()
                };
                let gpu =
                    CudaGpu::open(index, cfg).map_err(|e| SwapSuiteError::Cuda(e.to_string()))?;
                (gpu, None)
            }
        };
        let backend = VgpuBackend::new(gpu.clone(), limits);
        let dir =
            std::env::temp_dir().join(format!("vgpu-bench-swap-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| SwapSuiteError::Backend(e.to_string()))?;
        let mut out = Vec::new();
        for name in vms {
            let sock = dir.join(format!("{name}.sock"));
            backend
                .serve_vm(name, &sock)
                .map_err(|e| SwapSuiteError::Backend(e.to_string()))?;
            let vm = LoopbackVm::connect(&sock, LoopbackConfig::with_mem(64 << 20))
                .map_err(|e| SwapSuiteError::Loopback(e.to_string()))?;
            out.push(vm);
        }
        Ok(Rig {
            gpu,
            sim,
            backend,
            vms: out,
            dir,
        })
    }

    /// CPU time of the sim's engine threads (0 on another GPU).
    fn engine_cpu_ns(&self) -> u64 {
        self.sim.as_ref().map_or(0, |s| s.engine_cpu_ns())
    }

    fn config(&self, cfg: VramConfig) -> Result<()> {
        self.backend
            .set_vram_config(cfg)
            .map_err(|e| SwapSuiteError::Backend(e.to_string()))
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.backend.shutdown();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn limits(vram: u64) -> VmLimits {
    VmLimits {
        vram_bytes: vram,
        swap_bytes: 4 * vram,
        ..VmLimits::default()
    }
}

/// The hot loop: saxpy over pairs of hot buffers and a memcpy, `iters` times; returns the
/// time per iteration in seconds.
fn hot_loop(ch: &mut Channel, hot: &[Buffer], iters: u32) -> Result<f64> {
    let t0 = Instant::now();
    for _ in 0..iters {
        for pair in hot.chunks(2) {
            if let [x, y] = pair {
                ch.launch(
                    &KernelArgs::Saxpy {
                        x: x.gpu_va(),
                        y: y.gpu_va(),
                        n: x.len() / 4,
                        a: 0.5,
                    },
                    [1, 1, 1],
                )?;
                ch.launch(
                    &KernelArgs::Memcpy {
                        dst: x.gpu_va(),
                        src: y.gpu_va(),
                        len: x.len(),
                    },
                    [1, 1, 1],
                )?;
            }
        }
        let f = ch.submit()?;
        ch.wait(f)?;
    }
    Ok(t0.elapsed().as_secs_f64() / f64::from(iters.max(1)))
}

/// Allocates `cold` bytes written once and a hot set of `hot` bytes (hot last, so it must
/// win VRAM back from the cold set), warms up, and times the hot loop.
struct Oversub {
    /// GPU busy time of the hot process per iteration (HAL counters).
    per_iter_s: f64,
    /// CPU time of the sim's engine threads per iteration (immune to preemption).
    cpu_per_iter_s: f64,
    /// Wall time per iteration (submit to fence).
    wall_per_iter_s: f64,
    /// Chunks moved (either way) while the loop was timed.
    moved: u64,
    /// Bytes of the hot set in swap when the timing ended.
    hot_swapped: u64,
}

fn oversub_run(rig: &Rig, hot: u64, cold: u64, iters: u32, settle: Duration) -> Result<Oversub> {
    // The cold set belongs to one guest process, the hot set to another, so the per-process
    // figures say exactly where the hot set is.
    let cold_dev = Device::loopback(rig.vms[0].clone(), COLD_PID)?;
    let cold_ctx: Context = cold_dev.create_context()?;
    let mut cold_ch = cold_ctx.create_channel()?;
    let dev = Device::loopback(rig.vms[0].clone(), HOT_PID)?;
    let ctx: Context = dev.create_context()?;
    let mut ch = ctx.create_channel()?;
    let piece = 8 * MIB;
    let mut cold_bufs = Vec::new();
    let mut left = cold;
    while left > 0 {
        let n = left.min(piece);
        let b = cold_ctx.alloc_vram(n)?;
        cold_ch.launch(
            &KernelArgs::Memset {
                dst: b.gpu_va(),
                len: n,
                pattern: 0x3f80_0000,
            },
            [1, 1, 1],
        )?;
        cold_bufs.push(b);
        left -= n;
    }
    let f = cold_ch.submit()?;
    cold_ch.wait(f)?;
    let mut hot_bufs = Vec::new();
    let mut left = hot;
    while left > 0 {
        let n = left.min(piece);
        hot_bufs.push(ctx.alloc_vram(n)?);
        left -= n;
    }
    let f = ch.submit()?;
    ch.wait(f)?;
    // Warm up (first touches commit host pages on both sides) while the manager moves the
    // hot set in.
    hot_loop(&mut ch, &hot_bufs, 2)?;
    let t0 = Instant::now();
    while t0.elapsed() < settle {
        hot_loop(&mut ch, &hot_bufs, 1)?;
    }
    // GPU busy time of the hot process (engine time, robust against a busy host) per
    // iteration; the wall time is noisier on a shared 2-core machine.
    let busy = |rig: &Rig| -> u64 {
        rig.backend
            .process_busy_ns("a")
            .iter()
            .find(|(p, _)| *p == HOT_PID)
            .map_or(0, |(_, ns)| *ns)
    };
    let moves = |rig: &Rig| -> u64 {
        rig.backend
            .vram_stats("a")
            .map_or(0, |r| r.vm.evictions + r.vm.swap_ins)
    };
    let m0 = moves(rig);
    let (b0, c0) = (busy(rig), rig.engine_cpu_ns());
    let wall = hot_loop(&mut ch, &hot_bufs, iters)?;
    let moved = moves(rig) - m0;
    let n = f64::from(iters.max(1));
    let per_iter = (busy(rig) - b0) as f64 / 1e9 / n;
    let cpu_per_iter = rig.engine_cpu_ns().saturating_sub(c0) as f64 / 1e9 / n;
    let hot_swapped = rig
        .backend
        .vram_stats("a")
        .and_then(|r| {
            r.procs
                .iter()
                .find(|p| p.pid == HOT_PID)
                .map(|p| p.swapped_bytes)
        })
        .unwrap_or(0);
    drop(cold_bufs);
    drop(hot_bufs);
    Ok(Oversub {
        per_iter_s: per_iter,
        cpu_per_iter_s: cpu_per_iter,
        wall_per_iter_s: wall,
        hot_swapped,
        moved,
    })
}

/// Slowdowns in % of `over` against `base` by GPU busy time, engine CPU time and wall
/// time (medians).
fn slowdowns(base: &[Oversub], over: &[Oversub]) -> [f64; 3] {
    let pick = |v: &[Oversub], f: fn(&Oversub) -> f64| median(v.iter().map(f).collect());
    let slow = |f: fn(&Oversub) -> f64| (pick(over, f) / pick(base, f).max(1e-12) - 1.0) * 100.0;
    [
        slow(|o| o.per_iter_s),
        slow(|o| o.cpu_per_iter_s),
        slow(|o| o.wall_per_iter_s),
    ]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2]
    }
}

fn quantile(mut v: Vec<f64>, q: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return 0.0;
    }
    v[(((v.len() - 1) as f64) * q).round() as usize]
}

/// Host memcpy throughput between two buffers (bytes/s, one copy).
fn memcpy_throughput(bufs: &mut (Vec<u8>, Vec<u8>)) -> f64 {
    let t0 = Instant::now();
    bufs.1.copy_from_slice(&bufs.0);
    std::hint::black_box(&mut bufs.1);
    bufs.1.len() as f64 / t0.elapsed().as_secs_f64().max(1e-9)
}

pub fn run(opts: &SwapOpts) -> Result<Vec<Figure>> {
    let mut figs = Vec::new();
    let v = opts.vram;
    let hot = v / 2;
    let settle = Duration::from_millis(if opts.runs > 1 { 1500 } else { 600 });

    // 1. Oversubscription with a cold working set, and with the hot set evicted.
    let on_sim = opts.gpu == GpuChoice::Sim;
    let big = Rig::new(opts.gpu, "big", 8 * v, limits(8 * v), &["a"])?;
    let small = Rig::new(opts.gpu, "small", v, limits(v), &["a"])?;
    // Warm-up of both rigs (first touches of the memfds), not measured.
    oversub_run(&big, hot, 4 * v - hot, 1, Duration::ZERO)?;
    oversub_run(&small, hot, 4 * v - hot, 1, Duration::ZERO)?;
    for f in [1.5f64, 2.0, 4.0] {
        let total = (v as f64 * f) as u64 / MIB * MIB;
        let cold = total - hot;
        let (mut base, mut over, mut swapped, mut moved) = (Vec::new(), Vec::new(), 0, 0);
        for run in 0..opts.runs {
            // Alternate which side goes first.
            if run % 2 == 0 {
                base.push(oversub_run(&big, hot, cold, opts.iters, settle)?);
            }
            small.config(VramConfig::default())?;
            let r = oversub_run(&small, hot, cold, opts.iters, settle)?;
            swapped = swapped.max(r.hot_swapped);
            moved += r.moved;
            over.push(r);
            if run % 2 == 1 {
                base.push(oversub_run(&big, hot, cold, opts.iters, settle)?);
            }
        }
        let [busy, cpu, wall] = slowdowns(&base, &over);
        let name = format!("cold_set_{f}x_slowdown");
        // The headline: the sim's engine CPU time; on a real GPU, its own busy time.
        let head = if on_sim { cpu } else { busy };
        let mut fig = Figure::new(SUITE, &name, head, "%", Better::Lower);
        if f == 2.0 {
            fig = fig.target(5.0);
        }
        figs.push(fig);
        figs.push(Figure::new(
            SUITE,
            &format!("{name}_busy"),
            busy,
            "%",
            Better::Lower,
        ));
        figs.push(Figure::new(
            SUITE,
            &format!("{name}_wall"),
            wall,
            "%",
            Better::Lower,
        ));
        figs.push(Figure::new(
            SUITE,
            &format!("cold_set_{f}x_chunks_moved_while_timed"),
            moved as f64,
            "chunks",
            Better::Lower,
        ));
        figs.push(Figure::new(
            SUITE,
            &format!("cold_set_{f}x_hot_bytes_in_swap"),
            swapped as f64 / MIB as f64,
            "MiB",
            Better::Lower,
        ));
        // Hot set evicted: the manager is off, the hot set (allocated last) stays in swap.
        let (mut base, mut over, mut swapped) = (Vec::new(), Vec::new(), 0);
        for run in 0..opts.runs {
            if run % 2 == 0 {
                base.push(oversub_run(&big, hot, cold, opts.iters, Duration::ZERO)?);
            }
            small.config(VramConfig {
                enabled: false,
                ..VramConfig::default()
            })?;
            let r = oversub_run(&small, hot, cold, opts.iters, Duration::ZERO)?;
            swapped = swapped.max(r.hot_swapped);
            over.push(r);
            if run % 2 == 1 {
                base.push(oversub_run(&big, hot, cold, opts.iters, Duration::ZERO)?);
            }
        }
        small.config(VramConfig::default())?;
        let [busy, cpu, wall] = slowdowns(&base, &over);
        let name = format!("hot_set_evicted_{f}x_slowdown");
        let head = if on_sim { cpu } else { busy };
        figs.push(Figure::new(SUITE, &name, head, "%", Better::Lower));
        figs.push(Figure::new(
            SUITE,
            &format!("{name}_busy"),
            busy,
            "%",
            Better::Lower,
        ));
        figs.push(Figure::new(
            SUITE,
            &format!("{name}_wall"),
            wall,
            "%",
            Better::Lower,
        ));
        figs.push(Figure::new(
            SUITE,
            &format!("hot_set_evicted_{f}x_hot_bytes_in_swap"),
            swapped as f64 / MIB as f64,
            "MiB",
            Better::Higher,
        ));
        // Let the manager bring the VM's leftovers in before the next size.
        small.backend.vram_rebalance();
    }
    drop(big);
    drop(small);
    if on_sim {
        figs.extend(pauses_and_store_waits(opts)?);
    }
    figs.extend(convergence(opts)?);
    Ok(figs)
}

/// Swap throughput, pause per 64 MiB eviction and guest CPU store waits (sim only).
fn pauses_and_store_waits(opts: &SwapOpts) -> Result<Vec<Figure>> {
    let mut figs = Vec::new();
    let v = opts.vram;
    let rig = Rig::new(
        opts.gpu,
        "pause",
        128 * MIB.max(v),
        limits(128 * MIB.max(v)),
        &["a"],
    )?;
    let pause_cfg = VramConfig {
        enabled: false,
        batch_bytes: 64 * MIB,
        drain_timeout_ms: 2_000,
        ..VramConfig::default()
    };
    rig.config(pause_cfg)?;
    let dev = Device::loopback(rig.vms[0].clone(), 100)?;
    let ctx = dev.create_context()?;
    let mut ch = ctx.create_channel()?;
    let buf = ctx.alloc_vram(64 * MIB)?;
    let small_buf = ctx.alloc_vram(MIB)?;
    // For the second set of evictions, a guest thread storing into the buffer, one word
    // per page round the buffer with a 100 µs sleep between stores, recording every gap
    // between two stores. (The first set, for pause and throughput, runs without it: the
    // storing thread shares the two cores with the copy.)
    let writer_stop = Arc::new(AtomicBool::new(false));
    let start_writer = |buf: Buffer| {
        let stop = writer_stop.clone();
        std::thread::spawn(move || -> (Buffer, Vec<(Instant, Duration)>) {
            let mut gaps = Vec::new();
            let pages = 64 * MIB / 4096;
            let mut last = Instant::now();
            let mut k = 0u64;
            while !stop.load(Ordering::Relaxed) {
                if buf.write((k % pages) * 4096, &k.to_le_bytes()).is_err() {
                    break;
                }
                let now = Instant::now();
                gaps.push((last, now - last));
                last = now;
                k += 1;
                std::thread::sleep(Duration::from_micros(100));
            }
            (buf, gaps)
        })
    };
    let mut buf = Some(buf);
    let mut writer = None;
    let mut evictions: Vec<(Instant, Instant)> = Vec::new();
    let (mut pauses, mut rates) = (Vec::new(), Vec::new());
    let (mut memcpys, mut ratios) = (Vec::new(), Vec::new());
    let mut failed = 0u32;
    let mut scratch = (
        vec![0x5au8; 64 * MIB as usize],
        vec![0u8; 64 * MIB as usize],
    );
    for rep in 0..opts.pause_reps + opts.store_reps {
        let storing = rep >= opts.pause_reps;
        if storing && writer.is_none() {
            writer = buf.take().map(start_writer);
        }
        // Some work in flight on the paused channel.
        ch.launch(
            &KernelArgs::Memset {
                dst: small_buf.gpu_va(),
                len: MIB,
                pattern: 1,
            },
            [1, 1, 1],
        )?;
        ch.submit()?;
        let t_evict = Instant::now();
        let evicted = rig.backend.vram_evict("a", 64 * MIB);
        if storing {
            evictions.push((t_evict, Instant::now()));
        }
        let r = match evicted {
            Ok(r) => r,
            Err(e) => {
                // A drain that timed out on a loaded host: counted, not fatal.
                log::warn!("64 MiB eviction: {e}");
                failed += 1;
                continue;
            }
        };
        if r.bytes >= 64 * MIB && !storing {
            pauses.push(r.pause_ns as f64 / 1e6);
            let rate = r.bytes as f64 / (r.copy_ns.max(1) as f64 / 1e9);
            // Host memcpy of the same size right after, so both see the same load.
            let memcpy = memcpy_throughput(&mut scratch);
            rates.push(rate);
            memcpys.push(memcpy);
            ratios.push(rate / memcpy.max(1.0));
        }
        rig.config(VramConfig {
            enabled: true,
            batch_bytes: 64 * MIB,
            lru_exchange: false,
            ..pause_cfg
        })?;
        rig.backend.vram_rebalance();
        rig.config(pause_cfg)?;
    }
    let f = ch.submit()?;
    ch.wait(f)?;
    writer_stop.store(true, Ordering::Relaxed);
    let (buf, gaps) = match writer {
        Some(w) => {
            let (b, g) = w
                .join()
                .map_err(|_| SwapSuiteError::Loopback("the storing thread panicked".into()))?;
            (Some(b), g)
        }
        None => (buf, Vec::new()),
    };
    // Per eviction, the longest wait of a store that ended inside it; apart from the
    // evictions, the usual gap.
    let mut store_waits = Vec::new();
    let mut idle_gaps = Vec::new();
    for (start, gap) in &gaps {
        let end = *start + *gap;
        if !evictions.iter().any(|(a, b)| end >= *a && *start <= *b) {
            idle_gaps.push(gap.as_secs_f64() * 1e3);
        }
    }
    for (a, b) in &evictions {
        let longest = gaps
            .iter()
            .filter(|(start, gap)| *start + *gap >= *a && *start <= *b)
            .map(|(_, gap)| gap.as_secs_f64() * 1e3)
            .fold(0.0, f64::max);
        store_waits.push(longest);
    }
    drop((buf, small_buf, ch, ctx, dev));
    let memcpy = median(memcpys);
    let swap_rate = median(rates);
    figs.push(Figure::new(
        SUITE,
        "swap_out_throughput",
        swap_rate / 1e9,
        "GB/s",
        Better::Higher,
    ));
    figs.push(Figure::new(
        SUITE,
        "memcpy_throughput",
        memcpy / 1e9,
        "GB/s",
        Better::Higher,
    ));
    figs.push(
        Figure::new(
            SUITE,
            "swap_over_memcpy",
            median(ratios),
            "ratio",
            Better::Higher,
        )
        .target(0.5),
    );
    figs.push(Figure::new(
        SUITE,
        "pause_64mib_p50",
        quantile(pauses.clone(), 0.5),
        "ms",
        Better::Lower,
    ));
    figs.push(Figure::new(
        SUITE,
        "pause_64mib_failed",
        f64::from(failed),
        "count",
        Better::Lower,
    ));
    figs.push(Figure::new(
        SUITE,
        "pause_64mib_p99",
        quantile(pauses, 0.99),
        "ms",
        Better::Lower,
    ));
    figs.push(Figure::new(
        SUITE,
        "cpu_store_wait_64mib_p50",
        quantile(store_waits.clone(), 0.5),
        "ms",
        Better::Lower,
    ));
    figs.push(Figure::new(
        SUITE,
        "cpu_store_wait_64mib_p99",
        quantile(store_waits, 0.99),
        "ms",
        Better::Lower,
    ));
    figs.push(Figure::new(
        SUITE,
        "cpu_store_gap_idle_p50",
        quantile(idle_gaps, 0.5),
        "ms",
        Better::Lower,
    ));
    drop(rig);
    Ok(figs)
}

/// Two allocating VMs converge to equal shares.
fn convergence(opts: &SwapOpts) -> Result<Vec<Figure>> {
    let mut figs = Vec::new();
    let cv = opts.converge_bytes;
    let rig = Rig::new(opts.gpu, "converge", cv, limits(cv), &["a", "b"])?;
    let step = 4 * MIB;
    let hold = |vm: Arc<LoopbackVm>| -> Result<(Device, Context, Vec<Buffer>)> {
        let dev = Device::loopback(vm, 100)?;
        let ctx = dev.create_context()?;
        Ok((dev, ctx, Vec::new()))
    };
    let (_da, ca, mut ba) = hold(rig.vms[0].clone())?;
    let (_db, cb, mut bb) = hold(rig.vms[1].clone())?;
    for _ in 0..cv / step {
        ba.push(ca.alloc_vram(step)?);
    }
    std::thread::sleep(Duration::from_millis(100));
    let t0 = Instant::now();
    for _ in 0..cv / step {
        bb.push(cb.alloc_vram(step)?);
    }
    let half = cv / 2;
    let mut converged = None;
    while t0.elapsed() < Duration::from_secs(30) {
        let ra = rig.backend.vram_stats("a").map(|r| r.vm.resident_bytes);
        let rb = rig.backend.vram_stats("b").map(|r| r.vm.resident_bytes);
        if let (Some(a), Some(b)) = (ra, rb) {
            if a.abs_diff(b) <= 2 * step && a + b + 2 * step >= 2 * half {
                converged = Some(t0.elapsed().as_secs_f64());
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    figs.push(
        Figure::new(
            SUITE,
            "two_vm_convergence",
            // Not converged within 30 s: the time waited (the target is then missed).
            converged.unwrap_or_else(|| t0.elapsed().as_secs_f64()),
            "s",
            Better::Lower,
        )
        .target(5.0),
    );
    let free = rig.gpu.vram_free_bytes();
    drop((ba, bb));
    log::debug!("convergence run ended with {free} bytes of VRAM free");
    Ok(figs)
}
