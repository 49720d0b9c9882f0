//! Suite `cuda`: vgpu on a real NVIDIA GPU. The shared workloads at realistic sizes, run
//! through vgpu's native runtime on the `cuda` GPU and from a loopback VM over the real
//! vhost-user path, side by side; submission latency (guest store → GPU clock at kernel
//! start); back-to-back small-kernel throughput; GPU shares of two VMs with 10 ms vs 1 ms
//! kernels; the front end's CPU use. With `baseline`, the project's native CUDA program
//! (`bench/cuda-native`, the same kernels) runs in the same invocation and its figures are
//! printed beside ours with the ratios.
//!
//! This file holds the options, the sections and the rig (a backend with loopback VMs)
//! and runs the sections; each section with more than a few lines is a module of its own
//! (`b2b`, `fairness`, `granularity`, `vram_swap`, `loop_overhead`, `long_wait`), as is
//! the baseline program's driver (`baseline`).

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use thiserror::Error;
use vgpu_backend::{Policy, SchedConfig, VgpuBackend, VmLimits, VramConfig};
use vgpu_gpu_worker::{PoolConfig, TurnSlots, WorkerOptions, WorkerPool, WorkerProgram};
use vgpu_guest::workloads::{
    CopyHeavyConfig, Expected, HotspotConfig, ReductionConfig, SaxpyConfig, SgemmConfig,
    ThrottleConfig, Workload,
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

mod b2b;
mod baseline;
mod fairness;
mod granularity;
mod latency;
mod long_wait;
mod loop_overhead;
mod vram_swap;

use b2b::b2b;
use baseline::{baseline, baseline_after_idle, ratios};
use fairness::{fairness, gpu_used_mib, weighted};
use granularity::granularity;
use vram_swap::vram_swap;

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
    /// The realistic sizes (saxpy 2²⁸, sgemm 4096³, stencil 8192²; `--large`).
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
    /// How long the in-process front end polls after a channel appears
    /// (`CudaConfig::new_channel_poll_ns`).
    pub new_channel_poll_ns: u64,
    /// How long an idle channel still counts as active for batching
    /// (`CudaConfig::batch_quiet_ns`).
    pub batch_quiet_ns: u64,
    /// Time the in-process front end's parts (`CudaConfig::time_frontend`): the b2b
    /// section then reports each part's host time per GP entry.
    pub time_frontend: bool,
    /// Entries this long leave an owed REF write to a completion mark, ns
    /// (`CudaConfig::mark_owed_ref_over_ns`), in process.
    pub mark_owed_ref_over_ns: u64,
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
            new_channel_poll_ns: CudaConfig::default().new_channel_poll_ns,
            batch_quiet_ns: CudaConfig::default().batch_quiet_ns,
            time_frontend: false,
            mark_owed_ref_over_ns: CudaConfig::default().mark_owed_ref_over_ns,
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
/// keep `bench/cuda-native/native.cu` in step). `large`: the realistic sizes for
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
            figs.extend(latency::latency(&gpu, &nctx, &gctx, opts)?);
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
        // Every run verifies its result bit-exactly against the CPU reference, computed
        // once (`Expected`): each timed loop follows its own setup only, as the
        // baseline's do.
        let mut expected = Expected::default();
        w.run_expecting(nctx, &mut expected)?;
        w.run_expecting(gctx, &mut expected)?;
        let (mut entries, mut marks) = (0, 0);
        for _ in 0..opts.reps {
            n.push(w.run_expecting(nctx, &mut expected)?.elapsed.as_secs_f64());
            let c0 = gpu.frontend_counts();
            g.push(w.run_expecting(gctx, &mut expected)?.elapsed.as_secs_f64());
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

pub fn run(opts: &CudaOpts) -> Result<Vec<Figure>, CudaSuiteError> {
    let cfg = CudaConfig {
        vram_bytes: opts.vram_mib << 20,
        batch: opts.batch,
        max_inflight: opts.max_inflight,
        signal_max_blocks: opts.signal_max_blocks,
        doorbell_sleep_ns: opts.doorbell_sleep_ns,
        busy_poll_ns: opts.busy_poll_ns,
        new_channel_poll_ns: opts.new_channel_poll_ns,
        batch_quiet_ns: opts.batch_quiet_ns,
        time_frontend: opts.time_frontend,
        mark_owed_ref_over_ns: opts.mark_owed_ref_over_ns,
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
        if opts.runs(Section::Workloads) {
            figs.extend(baseline_after_idle(path, opts)?);
        }
        let r = ratios(&figs);
        figs.extend(r);
    }
    Ok(figs)
}

/// Runs `section` alone on the fake device and looks its figures up by name (the
/// sections' tests).
#[cfg(test)]
fn fake_section_figures(section: Section) -> impl Fn(&str) -> f64 {
    let opts = CudaOpts {
        fake: true,
        only: vec![section],
        ..CudaOpts::quick(0)
    };
    let figs = run(&opts).unwrap_or_else(|e| panic!("{section:?} on the fake device: {e}"));
    move |n: &str| {
        figs.iter()
            .find(|f| f.name == n)
            .map(|f| f.value)
            .unwrap_or_else(|| panic!("no figure {n}"))
    }
}
