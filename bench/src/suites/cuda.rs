//! Suite `cuda`: vgpu on a real NVIDIA GPU. The shared workloads at realistic sizes, run
//! through vgpu's native runtime on the `cuda` GPU and from a loopback VM over the real
//! vhost-user path, side by side; submission latency (guest store → GPU clock at kernel
//! start); back-to-back small-kernel throughput; GPU shares of two VMs with 10 ms vs 1 ms
//! kernels; the front end's CPU use. With `baseline`, the project's native CUDA program
//! (`bench/cuda-native`, the same kernels) runs in the same invocation and its figures are
//! printed beside ours with the ratios.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use thiserror::Error;
use vgpu_backend::{Policy, SchedConfig, VgpuBackend, VmLimits, VramConfig};
use vgpu_gpu_worker::{PoolConfig, TurnSlots, WorkerOptions, WorkerPool, WorkerProgram};
use vgpu_guest::workloads::{
    CopyHeavyConfig, HotspotConfig, ReductionConfig, SaxpyConfig, SgemmConfig, ThrottleConfig,
    Workload,
};
use vgpu_guest::{Device, KernelArgs};
use vgpu_host_shim::cuda::{
    CudaConfig, CudaGpu, CudaGpuOf, Device as CudaDeviceTrait, FakeCudaGpu, FakeDevice,
};
use vgpu_host_shim::Gpu;
use vgpu_loopback::{LoopbackConfig, LoopbackVm};

use crate::report::{Better, Figure};
use crate::sched_rig::{Tenant, TenantSpec};
use crate::suites::measure::{min, submit_latency, Publish};

mod long_wait;
mod loop_overhead;

const SUITE: &str = "cuda";
const MS: u64 = 1_000_000;

#[derive(Debug, Error)]
pub enum CudaSuiteError {
    #[error("cuda GPU: {0}")]
    Open(String),
    #[error("runtime: {0}")]
    Runtime(#[from] vgpu_guest::Error),
    #[error("backend: {0}")]
    Backend(String),
    #[error("loopback VM: {0}")]
    Loopback(String),
    #[error("baseline program: {0}")]
    Baseline(String),
}

#[derive(Debug, Clone)]
pub struct CudaOpts {
    pub index: u32,
    /// Run on the CPU fake device instead (plumbing checks without a GPU).
    pub fake: bool,
    pub small: bool,
    /// The issue's realistic sizes (saxpy 2²⁸, sgemm 4096³, stencil 8192²; `--large`).
    pub large: bool,
    pub reps: u32,
    pub latency_samples: u32,
    pub b2b_kernels: u32,
    /// Rounds of the back-to-back figure (each: CUDA native, vgpu native, the VM).
    pub b2b_rounds: u32,
    pub fairness_secs: f64,
    pub vram_mib: u64,
    /// The native CUDA baseline program to run alongside.
    pub baseline: Option<PathBuf>,
    /// The sections to run (all when empty); the baseline program runs the same ones.
    pub only: Vec<Section>,
    /// The workloads to run (all when empty; `--workloads sgemm,hotspot`); the baseline
    /// program runs the same ones.
    pub workloads: Vec<String>,
    /// The front end's batching (see `CudaConfig::batch`, `max_inflight`).
    pub batch: u32,
    pub max_inflight: usize,
    /// Run each VM's GPU work in a worker process of its own (issue 30): this program,
    /// run as `PROGRAM worker --gpu ...` (`vgpu-backend`). The native side stays in
    /// process.
    pub workers: Option<PathBuf>,
    /// With workers: the GPU turn's quantum, µs (0: none, the GPU time-slices them).
    pub turn_us: u64,
    /// Guest processes of one VM in the `granularity` section.
    pub processes: u32,
    /// Kernels' fence signals (see `CudaConfig::signal_max_blocks`) of the in-process GPU.
    pub signal_max_blocks: u64,
    /// The idle front end's longest sleep with the doorbell armed, ns (0: no doorbell;
    /// see `CudaConfig::doorbell_sleep_ns`), in process and in the workers.
    pub doorbell_sleep_ns: u64,
    /// How long the in-process front end spins after activity (`CudaConfig::busy_poll_ns`).
    pub busy_poll_ns: u64,
    /// Time the in-process front end's parts (`CudaConfig::time_frontend`): the b2b
    /// section then reports each part's host time per GP entry.
    pub time_frontend: bool,
}

/// A part of the suite (`vgpu-bench cuda --only SECTION,…`; the native baseline program
/// takes the same names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Section {
    /// The six workloads natively and in the VM, and the front end's CPU under them.
    Workloads,
    /// Submission latency (guest store → kernel start).
    Latency,
    /// Back-to-back empty kernels.
    B2b,
    /// The front end's CPU right after work and idle.
    FrontendCpu,
    /// VRAM swap on vgpu itself (eviction, pause, swap-in).
    Swap,
    /// Two VMs' shares under `none` and `fair`, and weights 1:2:4.
    Fairness,
    /// With `--workers`: a worker per VM against a worker per guest process (device
    /// memory per worker, a process's first context, N processes' GPU throughput). Not a
    /// section of the baseline program.
    Granularity,
    /// Where a short loop's time goes, in the VM and vgpu native (asked for by name
    /// only; not a section of the baseline program).
    LoopOverhead,
    /// A long wait's cost to the waiter, napping or asleep until the GPU's wake-up (asked
    /// for by name only; not a section of the baseline program).
    LongWait,
}

impl Section {
    /// The name the baseline program takes.
    fn arg(self) -> &'static str {
        match self {
            Section::Workloads => "workloads",
            Section::Latency => "latency",
            Section::B2b => "b2b",
            Section::FrontendCpu => "frontend-cpu",
            Section::Swap => "swap",
            Section::Fairness => "fairness",
            Section::Granularity => "granularity",
            Section::LoopOverhead => "loop-overhead",
            Section::LongWait => "long-wait",
        }
    }
}

impl CudaOpts {
    /// Whether section `s` runs.
    pub fn runs(&self, s: Section) -> bool {
        self.only.is_empty() || self.only.contains(&s)
    }

    pub fn full(index: u32) -> Self {
        CudaOpts {
            index,
            fake: false,
            small: false,
            large: false,
            reps: 3,
            latency_samples: 2000,
            b2b_kernels: 20_000,
            b2b_rounds: 5,
            fairness_secs: 4.0,
            vram_mib: 8192,
            baseline: None,
            only: Vec::new(),
            workloads: Vec::new(),
            batch: CudaConfig::default().batch,
            max_inflight: CudaConfig::default().max_inflight,
            workers: None,
            turn_us: 4000,
            processes: 4,
            signal_max_blocks: CudaConfig::default().signal_max_blocks,
            doorbell_sleep_ns: CudaConfig::default().doorbell_sleep_ns,
            busy_poll_ns: CudaConfig::default().busy_poll_ns,
            time_frontend: false,
        }
    }

    pub fn quick(index: u32) -> Self {
        CudaOpts {
            small: true,
            reps: 1,
            latency_samples: 200,
            b2b_kernels: 500,
            b2b_rounds: 1,
            fairness_secs: 0.5,
            vram_mib: 256,
            ..Self::full(index)
        }
    }
}

/// The workloads at the sizes this suite measures (also the baseline program's sizes:
/// keep `bench/cuda-native/native.cu` in step). `large`: the issue's realistic sizes for
/// the three that have one (saxpy 2²⁸, sgemm 4096³, stencil 8192²; their CPU references
/// run on every core of the host).
pub fn workloads(small: bool, large: bool) -> Vec<Workload> {
    if small {
        return Workload::NAMES
            .iter()
            .filter_map(|n| Workload::by_name(n, true))
            .collect();
    }
    vec![
        Workload::Throttle(ThrottleConfig {
            kernel_ns: 1_000_000,
            iterations: Some(200),
            depth: 4,
            stop: None,
        }),
        Workload::Saxpy(SaxpyConfig {
            n: if large { 1 << 28 } else { 1 << 24 },
            iterations: 50,
            ..SaxpyConfig::default()
        }),
        Workload::Sgemm(SgemmConfig {
            m: if large { 4096 } else { 1024 },
            n: if large { 4096 } else { 1024 },
            k: if large { 4096 } else { 1024 },
            iterations: 2,
            ..SgemmConfig::default()
        }),
        Workload::Hotspot(HotspotConfig {
            width: if large { 8192 } else { 4096 },
            height: if large { 8192 } else { 4096 },
            iterations: 20,
            ..HotspotConfig::default()
        }),
        Workload::Reduction(ReductionConfig {
            n: 1 << 23,
            iterations: 4,
            ..ReductionConfig::default()
        }),
        Workload::CopyHeavy(CopyHeavyConfig {
            bytes: 64 << 20,
            chunk_bytes: 4 << 20,
            iterations: 4,
            ..CopyHeavyConfig::default()
        }),
    ]
}

fn fig(name: &str, value: f64, unit: &str, better: Better) -> Figure {
    Figure::new(SUITE, name, value, unit, better)
}

/// Each rig VM's VRAM quota (a worker's VRAM: the cuda GPU allocates it in device memory
/// when it opens).
const RIG_VM_VRAM: u64 = 4 << 30;

/// A backend on `gpu` serving loopback VMs on private sockets.
struct Rig {
    backend: Arc<VgpuBackend>,
    vms: Vec<Arc<LoopbackVm>>,
    dir: PathBuf,
}

/// How the rigs' VMs get their GPU: the suite's in-process GPU, or a worker process
/// each running this program (`PROGRAM worker --gpu GPU`).
#[derive(Clone)]
struct VmGpus {
    gpu: Arc<dyn Gpu>,
    workers: Option<WorkerProgram>,
    turn_us: u64,
    granularity: vgpu_gpu_worker::Granularity,
}

impl Rig {
    fn new(g: &VmGpus, names: &[&str], vm_mem: u64) -> Result<Self, CudaSuiteError> {
        let limits = VmLimits {
            vram_bytes: RIG_VM_VRAM,
            mapped_guest_bytes: 2 << 30,
            swap_bytes: 2 << 30,
            ..VmLimits::default()
        };
        let backend = match &g.workers {
            None => VgpuBackend::new(g.gpu.clone(), limits),
            Some(prog) => {
                let gi = g.gpu.info();
                let turn = (g.turn_us > 0)
                    .then(|| TurnSlots::new(g.turn_us))
                    .transpose()
                    .map_err(|e| CudaSuiteError::Backend(format!("the GPU turn: {e}")))?;
                let pool = WorkerPool::new(PoolConfig {
                    program: prog.clone(),
                    per_worker: (gi.max_channels, gi.max_contexts),
                    granularity: g.granularity,
                    max_workers_per_vm: 64,
                    gpu: gi,
                    opts: WorkerOptions {
                        turn,
                        ..WorkerOptions::default()
                    },
                });
                VgpuBackend::with_workers(pool, limits)
            }
        };
        let dir = vgpu_test_support::try_temp_dir("bench-cuda")
            .map_err(|e| CudaSuiteError::Backend(e.to_string()))?;
        let mut vms = Vec::new();
        for name in names {
            let sock = dir.join(format!("{name}.sock"));
            backend
                .serve_vm(name, &sock)
                .map_err(|e| CudaSuiteError::Backend(e.to_string()))?;
            let vm = LoopbackVm::connect(&sock, LoopbackConfig::with_mem(vm_mem))
                .map_err(|e| CudaSuiteError::Loopback(e.to_string()))?;
            vms.push(vm);
        }
        Ok(Rig { backend, vms, dir })
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        for vm in &self.vms {
            vm.disconnect();
        }
        self.backend.shutdown();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Back-to-back empty kernels, `per_entry` to a GP entry (each entry with its fence);
/// kernels per second.
fn b2b_rate(
    ctx: &vgpu_guest::Context,
    kernels: u32,
    per_entry: u32,
) -> Result<f64, vgpu_guest::Error> {
    let mut ch = ctx.create_channel()?;
    ch.launch(&KernelArgs::Empty, [1, 1, 1])?;
    let f = ch.submit()?;
    ch.wait(f)?;
    let t0 = Instant::now();
    let mut last = None;
    for i in 0..kernels {
        ch.launch(&KernelArgs::Empty, [1, 1, 1])?;
        if (i + 1) % per_entry.max(1) == 0 || i + 1 == kernels {
            last = Some(ch.submit()?);
        }
    }
    if let Some(f) = last {
        ch.wait(f)?;
    }
    Ok(kernels as f64 / t0.elapsed().as_secs_f64())
}

/// Back-to-back empty kernels: vgpu native and the VM and, with a baseline program, CUDA
/// native, in `b2b_rounds` rounds of one after the other. The host's launch rate swings
/// between runs (CUDA's own from 198 k to 334 k per s on the lent H100, 2026-11-26), so
/// the ratio is taken within each round and the median of the rounds reported.
fn b2b<D: CudaDeviceTrait>(
    gpu: &CudaGpuOf<D>,
    nctx: &vgpu_guest::Context,
    gctx: &vgpu_guest::Context,
    opts: &CudaOpts,
) -> Result<Vec<Figure>, CudaSuiteError> {
    let rounds = opts.b2b_rounds.max(1);
    let (mut rn, mut rg, mut rc, mut ratios) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut entries, mut marks) = (0, 0);
    let mut parts = [0u64; 4];
    for _ in 0..rounds {
        let cuda = match &opts.baseline {
            Some(path) => baseline_b2b(path, opts)?,
            None => None,
        };
        // vgpu native runs on this process's GPU: its front end's batching is counted.
        let c0 = gpu.frontend_counts();
        rn.push(b2b_rate(nctx, opts.b2b_kernels, 1)?);
        let c1 = gpu.frontend_counts();
        entries += c1.entries - c0.entries;
        marks += c1.end_marks - c0.end_marks;
        for (p, (a, b)) in parts.iter_mut().zip([
            (c0.fetch_plan_ns, c1.fetch_plan_ns),
            (c0.issue_ns, c1.issue_ns),
            (c0.mark_ns, c1.mark_ns),
            (c0.retire_ns, c1.retire_ns),
        ]) {
            *p += b - a;
        }
        let vm = b2b_rate(gctx, opts.b2b_kernels, 1)?;
        rg.push(vm);
        if let Some(c) = cuda {
            rc.push(c);
            ratios.push(vm / c);
        }
    }
    // The same kernels 32 to a GP entry: the cost of the per-entry work (one fence each).
    let grouped = b2b_rate(gctx, opts.b2b_kernels, 32)?;
    let mut figs = vec![
        fig(
            "b2b_empty_kernels_vm_32_per_entry",
            grouped,
            "kernels/s",
            Better::Higher,
        ),
        fig(
            "b2b_empty_kernels_vgpu_native",
            median(&mut rn),
            "kernels/s",
            Better::Higher,
        ),
        fig(
            "b2b_empty_kernels_vm",
            median(&mut rg),
            "kernels/s",
            Better::Higher,
        ),
        fig("b2b_rounds", f64::from(rounds), "rounds", Better::Higher),
        fig(
            "b2b_vgpu_native_entries_per_mark",
            entries as f64 / marks.max(1) as f64,
            "entries",
            Better::Higher,
        ),
    ];
    if opts.time_frontend {
        // Where the front end's host time per entry went, vgpu native's runs.
        for (name, ns) in ["fetch_plan", "issue", "mark", "retire"].iter().zip(parts) {
            figs.push(fig(
                &format!("b2b_vgpu_native_frontend_{name}_ns_per_entry"),
                ns as f64 / entries.max(1) as f64,
                "ns",
                Better::Lower,
            ));
        }
    }
    if !ratios.is_empty() {
        figs.push(fig(
            "b2b_paired_cuda_native_kernels_per_s",
            median(&mut rc),
            "kernels/s",
            Better::Higher,
        ));
        let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = ratios.iter().copied().fold(0.0, f64::max);
        figs.push(
            fig(
                "b2b_paired_vm_vs_cuda_native",
                median(&mut ratios),
                "ratio",
                Better::Higher,
            )
            .target(0.8),
        );
        figs.push(fig(
            "b2b_paired_vm_vs_cuda_native_min",
            lo,
            "ratio",
            Better::Higher,
        ));
        figs.push(fig(
            "b2b_paired_vm_vs_cuda_native_max",
            hi,
            "ratio",
            Better::Higher,
        ));
    }
    Ok(figs)
}

/// The median of `v` (sorted in place; 0 when empty).
fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One back-to-back run of the baseline program (`--only b2b`): kernels per second.
fn baseline_b2b(path: &PathBuf, opts: &CudaOpts) -> Result<Option<f64>, CudaSuiteError> {
    let one = CudaOpts {
        only: vec![Section::B2b],
        ..opts.clone()
    };
    Ok(baseline(path, &one)?
        .iter()
        .find(|f| f.name == "cuda_native_b2b_empty_kernels_per_s")
        .map(|f| f.value))
}

/// Two VMs, one with 10 ms and one with 1 ms kernels, under `policy`: each VM's share of
/// the wall time, from completed kernels × kernel length.
fn fairness(gpu: &VmGpus, policy: Policy, secs: f64) -> Result<(f64, f64), CudaSuiteError> {
    let rig = Rig::new(gpu, &["a", "b"], 32 << 20)?;
    rig.backend
        .start_scheduler(SchedConfig {
            policy,
            ..SchedConfig::default()
        })
        .map_err(|e| CudaSuiteError::Backend(e.to_string()))?;
    let ten = |vm: usize, pid, ns| {
        Tenant::spawn(rig.vms[vm].clone(), TenantSpec::throttle(pid, ns))
            .map_err(|e| CudaSuiteError::Backend(e.to_string()))
    };
    let a = ten(0, 1, 10 * MS)?;
    let b = ten(1, 2, MS)?;
    std::thread::sleep(Duration::from_millis(300));
    let (a0, b0, t0) = (a.completed(), b.completed(), Instant::now());
    std::thread::sleep(Duration::from_secs_f64(secs));
    let (a1, b1, wall) = (a.completed(), b.completed(), t0.elapsed().as_nanos() as f64);
    let stop = |t: Tenant| t.stop().map_err(|e| CudaSuiteError::Backend(e.to_string()));
    stop(a)?;
    stop(b)?;
    Ok((
        (a1 - a0) as f64 * 10.0 * MS as f64 / wall * 100.0,
        (b1 - b0) as f64 * MS as f64 / wall * 100.0,
    ))
}

/// Device memory in use on GPU `index`, MiB, from `nvidia-smi` (`None` without one: the
/// fake device).
fn gpu_used_mib(index: u32) -> Option<f64> {
    let out = Command::new("nvidia-smi")
        .args([
            "--query-gpu=memory.used",
            "--format=csv,noheader,nounits",
            "-i",
            &index.to_string(),
        ])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

/// Waits (at most 20 s) until every tenant has completed a kernel: their workers run.
fn all_running(tenants: &[Tenant]) {
    let t0 = Instant::now();
    while tenants.iter().any(|t| t.completed() == 0) && t0.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Kernel time `tenants` of 1 ms kernels complete between them per wall time over
/// `secs`, %: above 100 where their kernels overlap (one context's streams run one-block
/// kernels side by side; workers taking the GPU turn do not).
fn busy_share(tenants: &[Tenant], secs: f64) -> f64 {
    all_running(tenants);
    std::thread::sleep(Duration::from_millis(300));
    let c0: u64 = tenants.iter().map(|t| t.completed()).sum();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(secs));
    let c1: u64 = tenants.iter().map(|t| t.completed()).sum();
    (c1 - c0) as f64 * MS as f64 / t0.elapsed().as_nanos() as f64 * 100.0
}

/// A worker per VM against a worker per guest process, for one VM of `opts.processes`
/// guest processes: each process's first `CREATE_CONTEXT` (a worker start with a worker
/// per process; with one per VM the first waits for the VM's worker started at connect),
/// device memory per worker (`nvidia-smi`, on a GPU), and the kernel time one process of
/// 1 ms kernels completes against N processes at once (with a worker per process the GPU
/// turn hands over between them; with one per VM they share one context).
fn granularity(gpu: &VmGpus, opts: &CudaOpts) -> Result<Vec<Figure>, CudaSuiteError> {
    use vgpu_gpu_worker::Granularity;
    let n = opts.processes.max(2);
    let be = |e: vgpu_guest::Error| CudaSuiteError::Backend(e.to_string());
    let mut figs = Vec::new();
    for g in [Granularity::Vm, Granularity::Process] {
        let gpus = VmGpus {
            granularity: g,
            ..gpu.clone()
        };
        let used0 = gpu_used_mib(opts.index);
        let rig = Rig::new(&gpus, &["g"], 64 << 20)?;
        let t_connect = Instant::now();
        let mut firsts = Vec::new();
        let mut held = Vec::new();
        for pid in 1..=n {
            let t = Instant::now();
            let dev = Device::loopback(rig.vms[0].clone(), pid).map_err(be)?;
            let ctx = dev.create_context().map_err(be)?;
            firsts.push(t.elapsed().as_secs_f64() * 1e3);
            held.push((ctx, dev));
        }
        let all_ms = t_connect.elapsed().as_secs_f64() * 1e3;
        let workers = rig.backend.worker_stats().map_or(0, |s| s.running);
        let used1 = gpu_used_mib(opts.index);
        drop(held);
        let tag = g.name();
        let mean = firsts.iter().sum::<f64>() / firsts.len() as f64;
        let max = firsts.iter().cloned().fold(0.0, f64::max);
        figs.push(fig(
            &format!("granularity_{tag}_first_context_mean_ms"),
            mean,
            "ms",
            Better::Lower,
        ));
        figs.push(fig(
            &format!("granularity_{tag}_first_context_max_ms"),
            max,
            "ms",
            Better::Lower,
        ));
        figs.push(fig(
            &format!("granularity_{tag}_{n}procs_contexts_from_connect_ms"),
            all_ms,
            "ms",
            Better::Lower,
        ));
        figs.push(fig(
            &format!("granularity_{tag}_{n}procs_workers"),
            workers as f64,
            "count",
            Better::Lower,
        ));
        if let (Some(a), Some(b)) = (used0, used1) {
            figs.push(fig(
                &format!("granularity_{tag}_{n}procs_device_mib"),
                b - a,
                "MiB",
                Better::Lower,
            ));
            let per_worker = (b - a) / workers.max(1) as f64;
            figs.push(fig(
                &format!("granularity_{tag}_device_mib_per_worker"),
                per_worker,
                "MiB",
                Better::Lower,
            ));
            // Each worker allocates the VM's whole VRAM quota when it starts; the rest is
            // its CUDA context.
            let vram_mib = (RIG_VM_VRAM.min(gpu.gpu.info().vram_bytes) >> 20) as f64;
            figs.push(fig(
                &format!("granularity_{tag}_device_mib_per_worker_beyond_vram"),
                per_worker - vram_mib,
                "MiB",
                Better::Lower,
            ));
        }
        let spawn = |pid: u32| {
            Tenant::spawn(rig.vms[0].clone(), TenantSpec::throttle(pid, MS))
                .map_err(|e| CudaSuiteError::Backend(e.to_string()))
        };
        let stop = |t: Tenant| t.stop().map_err(|e| CudaSuiteError::Backend(e.to_string()));
        let one = vec![spawn(100)?];
        let alone = busy_share(&one, opts.fairness_secs);
        for t in one {
            stop(t)?;
        }
        let many = (0..n)
            .map(|i| spawn(200 + i))
            .collect::<Result<Vec<_>, _>>()?;
        let together = busy_share(&many, opts.fairness_secs);
        for t in many {
            stop(t)?;
        }
        figs.push(fig(
            &format!("granularity_{tag}_1proc_kernel_time"),
            alone,
            "%",
            Better::Higher,
        ));
        figs.push(fig(
            &format!("granularity_{tag}_{n}procs_kernel_time"),
            together,
            "%",
            Better::Higher,
        ));
        figs.push(fig(
            &format!("granularity_{tag}_{n}procs_over_1proc"),
            if alone > 0.0 { together / alone } else { 0.0 },
            "ratio",
            Better::Higher,
        ));
    }
    Ok(figs)
}

/// Three VMs with weights 1:2:4, each running 1 ms kernels, under the fair policy: each
/// VM's share of the wall time.
fn weighted(gpu: &VmGpus, secs: f64) -> Result<Vec<f64>, CudaSuiteError> {
    let rig = Rig::new(gpu, &["w1", "w2", "w4"], 32 << 20)?;
    for (name, w) in [("w1", 100), ("w2", 200), ("w4", 400)] {
        rig.backend
            .set_vm_weight(name, w)
            .map_err(|e| CudaSuiteError::Backend(e.to_string()))?;
    }
    rig.backend
        .start_scheduler(SchedConfig {
            policy: Policy::Fair,
            ..SchedConfig::default()
        })
        .map_err(|e| CudaSuiteError::Backend(e.to_string()))?;
    let mut tenants = Vec::new();
    for (i, vm) in rig.vms.iter().enumerate() {
        tenants.push(
            Tenant::spawn(vm.clone(), TenantSpec::throttle(i as u32 + 1, MS))
                .map_err(|e| CudaSuiteError::Backend(e.to_string()))?,
        );
    }
    std::thread::sleep(Duration::from_millis(300));
    let c0: Vec<u64> = tenants.iter().map(|t| t.completed()).collect();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(secs));
    let c1: Vec<u64> = tenants.iter().map(|t| t.completed()).collect();
    let wall = t0.elapsed().as_nanos() as f64;
    for t in tenants {
        t.stop()
            .map_err(|e| CudaSuiteError::Backend(e.to_string()))?;
    }
    Ok(c0
        .iter()
        .zip(&c1)
        .map(|(a, b)| (b - a) as f64 * MS as f64 / wall * 100.0)
        .collect())
}

fn run_on<D: CudaDeviceTrait>(
    gpu: Arc<CudaGpuOf<D>>,
    opts: &CudaOpts,
) -> Result<Vec<Figure>, CudaSuiteError> {
    let mut figs = Vec::new();
    let dyn_gpu: Arc<dyn Gpu> = gpu.clone();
    let vm_gpus = VmGpus {
        gpu: dyn_gpu.clone(),
        workers: opts.workers.as_ref().map(|program| WorkerProgram {
            program: program.clone(),
            args: vec![
                "worker".into(),
                "--gpu".into(),
                if opts.fake {
                    "cuda-fake".into()
                } else {
                    format!("cuda:{}", opts.index)
                },
                "--doorbell-sleep-us".into(),
                (opts.doorbell_sleep_ns / 1000).to_string(),
            ],
        }),
        turn_us: opts.turn_us,
        granularity: vgpu_gpu_worker::Granularity::Vm,
    };
    if vm_gpus.workers.is_some() {
        figs.push(fig("vm_gpu_in_worker_process", 1.0, "bool", Better::Higher));
        figs.push(fig(
            "worker_turn_quantum_us",
            opts.turn_us as f64,
            "us",
            Better::Lower,
        ));
    }
    let vm_sections = [Section::Workloads, Section::Latency, Section::B2b];
    let loops = opts.only.contains(&Section::LoopOverhead);
    let long_waits = opts.only.contains(&Section::LongWait);
    if loops || long_waits || vm_sections.iter().any(|&s| opts.runs(s)) {
        let rig = Rig::new(&vm_gpus, &["bench"], 768 << 20)?;
        let native = Device::native(dyn_gpu.clone())?;
        let guest = Device::loopback(rig.vms[0].clone(), 1000)?;
        let nctx = native.create_context()?;
        let gctx = guest.create_context()?;
        if opts.runs(Section::Workloads) {
            figs.extend(run_workloads(&gpu, &nctx, &gctx, opts)?);
        }
        if opts.runs(Section::Latency) {
            figs.extend(latency(&nctx, &gctx, opts)?);
        }
        if opts.runs(Section::B2b) {
            figs.extend(b2b(&gpu, &nctx, &gctx, opts)?);
        }
        if loops {
            figs.extend(loop_overhead::loop_overhead(
                &nctx,
                "vgpu_native",
                opts.small,
            )?);
            figs.extend(loop_overhead::loop_overhead(&gctx, "vm", opts.small)?);
        }
        if long_waits {
            figs.extend(long_wait::long_wait(&nctx, "vgpu_native", opts.small)?);
            figs.extend(long_wait::long_wait(&gctx, "vm", opts.small)?);
        }
    }
    // The in-process front end's CPU: not the VMs' with workers.
    if opts.runs(Section::FrontendCpu) && vm_gpus.workers.is_none() {
        figs.extend(frontend_cpu(&gpu));
    }
    if opts.runs(Section::Swap) {
        figs.extend(vram_swap(&vm_gpus, opts.small)?);
    }
    // Asked for by name only: it starts a worker per process, 2 × N CUDA contexts.
    if opts.only.contains(&Section::Granularity) {
        if vm_gpus.workers.is_none() {
            return Err(CudaSuiteError::Backend(
                "--only granularity compares worker processes: add --workers".into(),
            ));
        }
        figs.extend(granularity(&vm_gpus, opts)?);
    }
    if !opts.runs(Section::Fairness) {
        return Ok(figs);
    }

    for (policy, tag) in [(Policy::None, "none"), (Policy::Fair, "fair")] {
        let (a, b) = fairness(&vm_gpus, policy, opts.fairness_secs)?;
        figs.push(fig(
            &format!("fairness_{tag}_10ms_vm_share"),
            a,
            "%",
            Better::Higher,
        ));
        figs.push(fig(
            &format!("fairness_{tag}_1ms_vm_share"),
            b,
            "%",
            Better::Higher,
        ));
    }
    let shares = weighted(&vm_gpus, opts.fairness_secs)?;
    // Weights divide the GPU time the VMs got; what switching between workers costs (the
    // GPU turn's hand-overs) is reported beside them, not charged to one VM's share.
    let used: f64 = shares.iter().sum();
    figs.push(fig("weights_1_2_4_gpu_used", used, "%", Better::Higher));
    let want = [100.0 / 7.0, 200.0 / 7.0, 400.0 / 7.0];
    for ((w, share), want) in [1, 2, 4].iter().zip(&shares).zip(want) {
        let of_used = if used > 0.0 {
            share / used * 100.0
        } else {
            0.0
        };
        figs.push(fig(
            &format!("weights_1_2_4_w{w}_share"),
            *share,
            "%",
            Better::Higher,
        ));
        figs.push(fig(
            &format!("weights_1_2_4_w{w}_share_of_used"),
            of_used,
            "%",
            Better::Higher,
        ));
        figs.push(fig(
            &format!("weights_1_2_4_w{w}_wall_off_by"),
            (share - want).abs(),
            "pp",
            Better::Lower,
        ));
        figs.push(
            fig(
                &format!("weights_1_2_4_w{w}_off_by"),
                (of_used - want).abs(),
                "pp",
                Better::Lower,
            )
            .target(2.0),
        );
    }
    Ok(figs)
}

/// The six workloads natively and in the VM, and the front end's CPU under them.
fn run_workloads<D: CudaDeviceTrait>(
    gpu: &CudaGpuOf<D>,
    nctx: &vgpu_guest::Context,
    gctx: &vgpu_guest::Context,
    opts: &CudaOpts,
) -> Result<Vec<Figure>, CudaSuiteError> {
    let mut figs = Vec::new();
    let cpu0 = gpu.frontend_cpu_ns();
    let wall0 = Instant::now();
    for w in workloads(opts.small, opts.large) {
        let name = w.name();
        if !opts.workloads.is_empty() && !opts.workloads.iter().any(|n| n == name) {
            continue;
        }
        let (mut n, mut g) = (Vec::new(), Vec::new());
        // Every run verifies its result bit-exactly against the CPU reference.
        w.run(nctx)?;
        w.run(gctx)?;
        let (mut entries, mut marks) = (0, 0);
        for _ in 0..opts.reps {
            n.push(w.run(nctx)?.elapsed.as_secs_f64());
            let c0 = gpu.frontend_counts();
            g.push(w.run(gctx)?.elapsed.as_secs_f64());
            let c1 = gpu.frontend_counts();
            entries += c1.entries - c0.entries;
            marks += c1.end_marks - c0.end_marks;
        }
        let (n, g) = (min(&n), min(&g));
        if opts.workers.is_none() && marks > 0 {
            // How many GP entries shared a completion mark (each mark is a stream op
            // between kernels): the VM's runs, on this process's front end.
            figs.push(fig(
                &format!("{name}_vm_entries_per_mark"),
                entries as f64 / marks as f64,
                "entries",
                Better::Higher,
            ));
        }
        log::info!("{name}: native {:.3} ms, VM {:.3} ms", n * 1e3, g * 1e3);
        figs.push(fig(
            &format!("{name}_vgpu_native_ms"),
            n * 1e3,
            "ms",
            Better::Lower,
        ));
        figs.push(fig(&format!("{name}_vm_ms"), g * 1e3, "ms", Better::Lower));
        figs.push(
            fig(
                &format!("{name}_vm_vs_vgpu_native"),
                g / n,
                "ratio",
                Better::Lower,
            )
            .target(1.03),
        );
        figs.push(fig(
            &format!("{name}_verified_bit_exact"),
            1.0,
            "bool",
            Better::Higher,
        ));
    }
    // The in-process front end's CPU: the VM's own is in its worker, with workers.
    if opts.workers.is_none() {
        let busy_cpu = (gpu.frontend_cpu_ns() - cpu0) as f64 / wall0.elapsed().as_nanos() as f64;
        figs.push(fig(
            "frontend_cpu_under_workloads",
            busy_cpu * 100.0,
            "% of a core",
            Better::Lower,
        ));
    }
    Ok(figs)
}

/// Submission latency (guest store → GPU clock at kernel start), native and in the VM.
fn latency(
    nctx: &vgpu_guest::Context,
    gctx: &vgpu_guest::Context,
    opts: &CudaOpts,
) -> Result<Vec<Figure>, CudaSuiteError> {
    let mut figs = Vec::new();
    let n = submit_latency(nctx, opts.latency_samples, Publish::Store)?;
    let g = submit_latency(gctx, opts.latency_samples, Publish::Store)?;
    figs.push(fig(
        "submit_to_kernel_start_p50_vgpu_native",
        n.0,
        "us",
        Better::Lower,
    ));
    figs.push(fig(
        "submit_to_kernel_start_p99_vgpu_native",
        n.1,
        "us",
        Better::Lower,
    ));
    figs.push(fig(
        "submit_to_kernel_start_p50_vm",
        g.0,
        "us",
        Better::Lower,
    ));
    figs.push(fig(
        "submit_to_kernel_start_p99_vm",
        g.1,
        "us",
        Better::Lower,
    ));
    Ok(figs)
}

/// The front end's CPU in the second after work and in the second after that: it spins
/// briefly after activity, then sleeps until a doorbell (protocol.md, "Doorbell").
fn frontend_cpu<D: CudaDeviceTrait>(gpu: &CudaGpuOf<D>) -> Vec<Figure> {
    let mut figs = Vec::new();
    for name in ["frontend_cpu_first_second_after_work", "frontend_cpu_idle"] {
        let cpu1 = gpu.frontend_cpu_ns();
        let t = Instant::now();
        std::thread::sleep(Duration::from_secs(1));
        let used = (gpu.frontend_cpu_ns() - cpu1) as f64 / t.elapsed().as_nanos() as f64;
        figs.push(fig(name, used * 100.0, "% of a core", Better::Lower));
    }
    figs
}

/// VRAM swapping on vgpu itself: a VM's buffers are written and computed on, then
/// evicted 64 MiB at a time by the backend (device→host copies into the VM's swap memory,
/// page tables retargeted), computed on while evicted (kernels read host memory), swapped
/// back in, and verified bit-exactly after each step.
fn vram_swap(gpu: &VmGpus, small: bool) -> Result<Vec<Figure>, CudaSuiteError> {
    const VM: &str = "swap";
    let step: u64 = if small { 4 << 20 } else { 64 << 20 };
    let rounds = 4u64;
    let rig = Rig::new(gpu, &[VM], 256 << 20)?;
    let be = rig.backend.clone();
    let manual = VramConfig {
        enabled: false,
        batch_bytes: step,
        ..VramConfig::default()
    };
    be.set_vram_config(manual)
        .map_err(|e| CudaSuiteError::Backend(e.to_string()))?;
    let dev = Device::loopback(rig.vms[0].clone(), 1)?;
    let ctx = dev.create_context()?;
    let n = step / 4;
    let data = |seed: u64| -> Vec<f32> {
        (0..n)
            .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 1024) as f32 * 0.25)
            .collect()
    };
    // x: what gets evicted (allocated first: the coldest); y: the result.
    let xs: Vec<_> = (0..rounds)
        .map(|_| ctx.alloc_vram(step))
        .collect::<Result<_, _>>()?;
    let x0 = data(1);
    for x in &xs {
        x.write_f32(0, &x0)?;
    }
    let y = ctx.alloc_vram(step)?;
    let mut ch = ctx.create_channel()?;
    let saxpy_ms = |ch: &mut vgpu_guest::Channel, reps: u32| -> Result<f64, CudaSuiteError> {
        y.write_f32(0, &vec![0.0; n as usize])?;
        let t = Instant::now();
        for _ in 0..reps {
            ch.launch(
                &KernelArgs::Saxpy {
                    x: xs[0].gpu_va(),
                    y: y.gpu_va(),
                    n,
                    a: 1.0,
                },
                [(n as u32).div_ceil(256), 1, 1],
            )?;
        }
        ch.finish()?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let want: Vec<f32> = x0.iter().map(|v| v * reps as f32).collect();
        if y.read_f32_vec(0, n as usize)? != want {
            return Err(CudaSuiteError::Backend(
                "saxpy over swapped VRAM differs".into(),
            ));
        }
        Ok(ms)
    };
    saxpy_ms(&mut ch, 2)?;
    let resident = saxpy_ms(&mut ch, 10)?;
    let (mut pauses, mut copy_ns, mut bytes) = (Vec::new(), 0u64, 0u64);
    for _ in 0..rounds {
        let r = be
            .vram_evict(VM, step)
            .map_err(|e| CudaSuiteError::Backend(e.to_string()))?;
        pauses.push(r.pause_ns as f64 / 1e6);
        copy_ns += r.copy_ns;
        bytes += r.bytes;
    }
    let swapped = be
        .vram_stats(VM)
        .map(|r| r.vm.swapped_bytes)
        .unwrap_or_default();
    let evicted = saxpy_ms(&mut ch, 10)?;
    for x in &xs {
        if x.read_f32_vec(0, n as usize)? != x0 {
            return Err(CudaSuiteError::Backend("evicted VRAM differs".into()));
        }
    }
    be.set_vram_config(VramConfig::default())
        .map_err(|e| CudaSuiteError::Backend(e.to_string()))?;
    let t = Instant::now();
    let mut passes = 0;
    while be.vram_stats(VM).is_some_and(|r| r.vm.swapped_bytes > 0) && passes < 1000 {
        be.vram_rebalance();
        passes += 1;
    }
    let swap_in_s = t.elapsed().as_secs_f64();
    let back = be.vram_stats(VM).map(|r| r.vm).unwrap_or_default();
    let again = saxpy_ms(&mut ch, 10)?;
    pauses.sort_by(f64::total_cmp);
    let gbs = |b: u64, s: f64| b as f64 / s.max(1e-9) / 1e9;
    let tag = step >> 20;
    Ok(vec![
        fig(
            "vram_evicted_bytes",
            swapped as f64 / 1048576.0,
            "MiB",
            Better::Higher,
        ),
        fig(
            "vram_evict_gb_per_s",
            gbs(bytes, copy_ns as f64 / 1e9),
            "GB/s",
            Better::Higher,
        ),
        fig(
            &format!("vram_evict_pause_{tag}mib_p50_ms"),
            pauses.get(pauses.len() / 2).copied().unwrap_or(0.0),
            "ms",
            Better::Lower,
        )
        .target(5.0),
        fig(
            &format!("vram_evict_pause_{tag}mib_max_ms"),
            pauses.last().copied().unwrap_or(0.0),
            "ms",
            Better::Lower,
        ),
        fig(
            "vram_swap_in_gb_per_s",
            gbs(back.bytes_in, swap_in_s),
            "GB/s",
            Better::Higher,
        ),
        fig(
            &format!("saxpy_{tag}mib_resident_ms"),
            resident,
            "ms",
            Better::Lower,
        ),
        fig(
            &format!("saxpy_{tag}mib_evicted_ms"),
            evicted,
            "ms",
            Better::Lower,
        ),
        fig(
            &format!("saxpy_{tag}mib_after_swap_in_ms"),
            again,
            "ms",
            Better::Lower,
        ),
        fig(
            "hot_set_evicted_slowdown",
            evicted / resident.max(1e-9),
            "ratio",
            Better::Lower,
        ),
        fig("vram_swap_verified_bit_exact", 1.0, "bool", Better::Higher),
    ])
}

/// Runs the native CUDA baseline program and turns its `name value unit` lines into figures.
fn baseline(path: &PathBuf, opts: &CudaOpts) -> Result<Vec<Figure>, CudaSuiteError> {
    let mut cmd = Command::new(path);
    if opts.small {
        cmd.arg("--quick");
    }
    if opts.large {
        cmd.arg("--large");
    }
    if !opts.only.is_empty() {
        // The baseline has no workers: no granularity section.
        let names: Vec<&str> = opts
            .only
            .iter()
            .filter(|s| **s != Section::Granularity)
            .map(|s| s.arg())
            .collect();
        cmd.arg("--only").arg(names.join(","));
    }
    if !opts.workloads.is_empty() {
        cmd.arg("--workloads").arg(opts.workloads.join(","));
    }
    let out = cmd
        .output()
        .map_err(|e| CudaSuiteError::Baseline(format!("{}: {e}", path.display())))?;
    if !out.status.success() {
        return Err(CudaSuiteError::Baseline(format!(
            "{} exited with {}: {}",
            path.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    let mut figs = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let parts: Vec<&str> = line.split_whitespace().collect();
        if let [name, value, unit] = parts[..] {
            if let Ok(v) = value.parse::<f64>() {
                let better = if unit.contains("/s") {
                    Better::Higher
                } else {
                    Better::Lower
                };
                figs.push(fig(&format!("cuda_native_{name}"), v, unit, better));
            }
        }
    }
    Ok(figs)
}

/// Ratios of our figures to the baseline's where both exist.
fn ratios(figs: &[Figure]) -> Vec<Figure> {
    let get = |n: &str| figs.iter().find(|f| f.name == n).map(|f| f.value);
    let mut out = Vec::new();
    for w in Workload::NAMES {
        for place in ["device", "pinned"] {
            if let (Some(vm), Some(nat)) = (
                get(&format!("{w}_vm_ms")),
                get(&format!("cuda_native_{w}_{place}_ms")),
            ) {
                out.push(fig(
                    &format!("{w}_vm_vs_cuda_native_{place}"),
                    vm / nat,
                    "ratio",
                    Better::Lower,
                ));
            }
        }
    }
    if let (Some(vm), Some(nat)) = (
        get("submit_to_kernel_start_p50_vm"),
        get("cuda_native_launch_to_kernel_start_p50_us"),
    ) {
        out.push(
            fig(
                "submit_latency_vm_minus_cuda_native_p50",
                vm - nat,
                "us",
                Better::Lower,
            )
            .target(3.0),
        );
    }
    if let (Some(vm), Some(nat)) = (
        get("vram_evict_gb_per_s"),
        get("cuda_native_swap_plain_dtoh_64mib_gb_per_s"),
    ) {
        out.push(
            fig(
                "vram_evict_vs_plain_dtoh_copy",
                vm / nat,
                "ratio",
                Better::Higher,
            )
            .target(0.8),
        );
    }
    if let (Some(vm), Some(nat)) = (
        get("vram_swap_in_gb_per_s"),
        get("cuda_native_swap_plain_htod_64mib_gb_per_s"),
    ) {
        out.push(fig(
            "vram_swap_in_vs_plain_htod_copy",
            vm / nat,
            "ratio",
            Better::Higher,
        ));
    }
    // The paired rounds' median where they ran (see `b2b`), else one run against the other.
    if let Some(r) = get("b2b_paired_vm_vs_cuda_native") {
        out.push(fig("b2b_vm_vs_cuda_native", r, "ratio", Better::Higher).target(0.8));
    } else if let (Some(vm), Some(nat)) = (
        get("b2b_empty_kernels_vm"),
        get("cuda_native_b2b_empty_kernels_per_s"),
    ) {
        out.push(fig("b2b_vm_vs_cuda_native", vm / nat, "ratio", Better::Higher).target(0.8));
    }
    out
}

pub fn run(opts: &CudaOpts) -> Result<Vec<Figure>, CudaSuiteError> {
    let cfg = CudaConfig {
        vram_bytes: opts.vram_mib << 20,
        batch: opts.batch,
        max_inflight: opts.max_inflight,
        signal_max_blocks: opts.signal_max_blocks,
        doorbell_sleep_ns: opts.doorbell_sleep_ns,
        busy_poll_ns: opts.busy_poll_ns,
        time_frontend: opts.time_frontend,
        ..CudaConfig::default()
    };
    let mut figs = if opts.fake {
        let gpu = FakeCudaGpu::with_device(Arc::new(FakeDevice::default()), cfg)
            .map_err(|e| CudaSuiteError::Open(e.to_string()))?;
        run_on(gpu, opts)?
    } else {
        let gpu =
            CudaGpu::open(opts.index, cfg).map_err(|e| CudaSuiteError::Open(e.to_string()))?;
        run_on(gpu, opts)?
    };
    if let Some(path) = &opts.baseline {
        figs.extend(baseline(path, opts)?);
        let r = ratios(&figs);
        figs.extend(r);
    }
    Ok(figs)
}
