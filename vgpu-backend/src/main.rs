//! `vgpu-backend`: serves vgpu devices to VMs over vhost-user, one socket per VM, on the
//! built-in `sim` GPU.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::parser::ValueSource;
use clap::Parser;
use clap::{ArgMatches, CommandFactory, FromArgMatches};
use log::{error, info, warn};
use vgpu_backend::api::{ApiOptions, ApiServer};
use vgpu_backend::config::FileConfig;
use vgpu_backend::{sandbox, SchedArgs, VgpuBackend, VmLimits};
use vgpu_host_shim::cuda::{CudaConfig, CudaGpu};
use vgpu_host_shim::{Gpu, GpuChoice, SimConfig, SimGpu};
use vgpu_sandbox::{privileges, Mode, Role};

#[derive(Debug, Parser)]
#[command(name = "vgpu-backend", version, about)]
struct Cli {
    /// TOML configuration (see docs/vgpu-backend.example.toml); flags override it.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Directory of the VM sockets (`DIR/NAME.sock`).
    #[arg(long, value_name = "DIR")]
    socket_dir: Option<PathBuf>,
    /// A VM to serve (repeatable); replaces the config file's VM list (a listed VM keeps
    /// its settings from the file).
    #[arg(long = "vm", value_name = "NAME")]
    vms: Vec<String>,
    /// Unix socket of the operator control API.
    #[arg(long, value_name = "PATH")]
    api_socket: Option<PathBuf>,
    /// The GPU: `sim` (the software GPU) or `cuda[:INDEX]` (an NVIDIA GPU through the
    /// CUDA driver, loaded at run time) [default: the config file's `gpu.model`, else sim].
    #[arg(long, value_name = "sim|cuda[:INDEX]")]
    gpu: Option<vgpu_host_shim::GpuChoice>,
    /// VRAM of the GPU, MiB [default: 1024] (on cuda: pinned host memory, see
    /// docs/operator-guide.md).
    #[arg(long)]
    vram_mib: Option<u64>,
    /// Compute engines of the sim GPU [default: 1].
    #[arg(long)]
    compute_engines: Option<u32>,
    /// Channels the sim GPU supports in total [default: 256].
    #[arg(long)]
    gpu_max_channels: Option<u32>,
    /// Contexts the sim GPU supports in total [default: 256].
    #[arg(long)]
    gpu_max_contexts: Option<u32>,
    /// Longest sleep of the sim GPU's idle PFIFO between polls of GP_PUT, microseconds:
    /// the latency of a submission after an idle spell vs. the CPU an idle GPU model
    /// costs. Raise it where CPU is dear (the nested rig runs the backend under TCG, where
    /// the default's wake-ups eat most of a vCPU).
    #[arg(long, value_name = "US", default_value_t = 250,
          value_parser = clap::value_parser!(u64).range(10..=100_000))]
    sim_idle_sleep_us: u64,
    /// Longest sleep of an idle GPU front end with the doorbell armed, microseconds
    /// (sim and cuda, in this process and in GPU workers): guests ring the doorbell when
    /// they submit to a sleeping front end, so this only bounds the wait of one that does
    /// not. 0: no doorbell; idle front ends poll GP_PUT at growing intervals.
    #[arg(long, value_name = "US", default_value_t = 10_000,
          value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    doorbell_sleep_us: u64,
    /// Per-VM limit: VRAM, MiB (default: the GPU's VRAM).
    #[arg(long)]
    vm_vram_mib: Option<u64>,
    /// Per-VM limit: GPU contexts.
    #[arg(long)]
    vm_max_contexts: Option<u32>,
    /// Per-VM limit: channels.
    #[arg(long)]
    vm_max_channels: Option<u32>,
    /// Per-VM reserve: contexts of the GPU kept for the VM whatever other VMs take
    /// [default: 1, at most the VM's limit].
    #[arg(long)]
    vm_reserved_contexts: Option<u32>,
    /// Per-VM reserve: channels of the GPU kept for the VM whatever other VMs take
    /// [default: 4, at most the VM's limit].
    #[arg(long)]
    vm_reserved_channels: Option<u32>,
    /// Per-VM limit: guest memory mapped into GPU address spaces, MiB.
    #[arg(long)]
    vm_mapped_guest_mib: Option<u64>,
    /// Per-VM limit: VRAM objects beyond the VRAM quota, swapped to host memory, MiB
    /// (default 0: no oversubscription).
    #[arg(long)]
    vm_swap_mib: Option<u64>,
    /// Per-VM limit: GPU mappings at once [default: 16384].
    #[arg(long)]
    vm_max_mappings: Option<u32>,
    /// Per-VM limit: host memory of the VM's GPU mappings (page tables), MiB [default: 32].
    #[arg(long)]
    vm_page_table_mib: Option<u64>,
    /// What a syscall outside a thread's seccomp filter does: `kill` the process, `log`
    /// it and let it run, or `off` (no filters; capabilities kept) [default: the config
    /// file's `sandbox.seccomp`, else kill].
    #[arg(long, value_name = "kill|log|off")]
    seccomp: Option<vgpu_sandbox::Mode>,
    /// With `--gpu cuda`, each VM's GPU work runs in a worker process of its own (its own
    /// CUDA context and fault domain, `vgpu-backend worker`): `vm`, the default with
    /// `--gpu cuda` (`--gpu-workers` alone means it too). Workers are started by a
    /// launcher process forked before the seccomp filters go on, and run under a filter
    /// of their own in the backend's seccomp mode. `process` gives each guest process a
    /// worker of its own instead (its own GPU address space and fault domain, as on a
    /// real GPU), at a CUDA context per guest process (about 0.5 GiB of device memory and
    /// 160 ms to start on an H100). `off` runs every VM in the backend's one CUDA context:
    /// one GPU address space and one fault domain for all of them, no guest modules.
    #[arg(
        long,
        value_name = "vm|process|off",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "vm"
    )]
    gpu_workers: Option<WorkersFlag>,
    /// Test-only: the GPU the workers (`--gpu-workers`) run instead of the configured
    /// one (`cuda-fake`: the CUDA GPU on its CPU stand-in, for tests without a GPU).
    #[arg(long, hide = true)]
    test_worker_gpu: Option<String>,
    /// Test-only: each moving VRAM chunk's CPU view stays read-only this much longer
    /// before its copy, so guest stores through the aperture hit moving chunks and wait in
    /// their VMM (the nested rig's way to exercise that wait).
    #[arg(long, hide = true, value_name = "MS", default_value_t = 0,
          value_parser = clap::value_parser!(u64).range(0..=5000))]
    test_hold_read_only_ms: u64,
    /// With `--gpu-workers`: how long one VM's worker may keep the GPU while others wait,
    /// microseconds (the GPU turn: workers take the GPU one at a time, so each VM is
    /// charged only for GPU time it alone used; 0 lets the GPU time-slice them instead,
    /// which charges both VMs for shared time and breaks the scheduler's shares).
    #[arg(long, default_value_t = 4000, value_parser = parse_turn_us)]
    gpu_turn_us: u64,
    /// With `--gpu-workers=process`: at most this many workers per VM (each holds a CUDA
    /// context and the VM's VRAM quota in device memory); a further guest process's first
    /// context is refused with LIMIT_EXCEEDED.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1000))]
    gpu_workers_per_vm: u32,
    #[command(flatten)]
    sched: SchedArgs,
}

impl Cli {
    /// The configuration file (or an empty one) with the flags applied over it.
    /// `given` tells whether a flag (by its argument id) was on the command line.
    fn file_config(&self, given: impl Fn(&str) -> bool) -> Result<FileConfig, String> {
        let mut f = match &self.config {
            Some(p) => FileConfig::load(p).map_err(|e| e.to_string())?,
            None => FileConfig::default(),
        };
        if let Some(d) = &self.socket_dir {
            f.socket_dir = Some(d.clone());
        }
        if !self.vms.is_empty() {
            let old = std::mem::take(&mut f.vm);
            for name in &self.vms {
                let mut e = old
                    .iter()
                    .find(|v| v.name == *name)
                    .cloned()
                    .unwrap_or_default();
                e.name = name.clone();
                // An explicit --socket-dir places every listed VM there.
                if self.socket_dir.is_some() {
                    e.socket = None;
                }
                f.vm.push(e);
            }
        }
        if let Some(p) = &self.api_socket {
            f.api.socket = Some(p.clone());
        }
        if let Some(m) = self.seccomp {
            f.sandbox.seccomp = Some(m.name().to_string());
        }
        // Scheduler flags override the file only where given (they all have defaults).
        let a = &self.sched;
        let s = &mut f.scheduler;
        if given("sched_policy") {
            s.policy = Some(a.sched_policy.name().to_string());
        }
        if given("sched_interval_ms") {
            s.interval_ms = Some(a.sched_interval_ms);
        }
        if given("sched_threshold_us") {
            s.threshold_us = Some(a.sched_threshold_us);
        }
        if given("sched_slice_ms") {
            s.slice_ms = Some(a.sched_slice_ms);
        }
        if given("sched_sample_period_ms") {
            s.sample_period_ms = Some(a.sched_sample_period_ms);
        }
        if given("sched_charge_idle") {
            s.charge_idle = Some(a.sched_charge_idle);
        }
        s.unshadow_cap = a.sched_unshadow_cap.or(s.unshadow_cap);
        s.watchdog_ms = a.watchdog_ms.or(s.watchdog_ms);
        let g = &mut f.gpu;
        if let Some(choice) = self.gpu {
            g.model = Some(choice.to_string());
        }
        g.vram_mib = self.vram_mib.or(g.vram_mib);
        g.compute_engines = self.compute_engines.or(g.compute_engines);
        g.max_channels = self.gpu_max_channels.or(g.max_channels);
        g.max_contexts = self.gpu_max_contexts.or(g.max_contexts);
        // Per-VM flags apply to every VM, over the file's per-VM values.
        for v in &mut f.vm {
            v.vram_mib = self.vm_vram_mib.or(v.vram_mib);
            v.max_contexts = self.vm_max_contexts.or(v.max_contexts);
            v.max_channels = self.vm_max_channels.or(v.max_channels);
            v.reserved_contexts = self.vm_reserved_contexts.or(v.reserved_contexts);
            v.reserved_channels = self.vm_reserved_channels.or(v.reserved_channels);
            v.mapped_guest_mib = self.vm_mapped_guest_mib.or(v.mapped_guest_mib);
            v.swap_mib = self.vm_swap_mib.or(v.swap_mib);
            v.max_mappings = self.vm_max_mappings.or(v.max_mappings);
            v.page_table_mib = self.vm_page_table_mib.or(v.page_table_mib);
        }
        for (name, w) in &a.vm_weights {
            let v =
                f.vm.iter_mut()
                    .find(|v| v.name == *name)
                    .ok_or_else(|| format!("--vm-weight {name}={w}: no VM {name:?}"))?;
            v.weight = Some(*w);
        }
        Ok(f)
    }
}

/// Blocks SIGINT and SIGTERM in this thread (and so in every thread started after) and
/// returns the set, for `sigwait`.
fn block_signals() -> std::io::Result<libc::sigset_t> {
    // SAFETY: sigset_t is plain data; sigemptyset initialises it before any other use.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, exclusively borrowed sigset_t; the calls only write it and
    // this thread's signal mask.
    let rc = unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut())
    };
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(rc));
    }
    Ok(set)
}

fn wait_for_signal(set: &libc::sigset_t) -> i32 {
    let mut sig: libc::c_int = 0;
    loop {
        // SAFETY: `set` is an initialised sigset_t and `sig` a valid out pointer.
        let rc = unsafe { libc::sigwait(set, &mut sig) };
        if rc == 0 {
            return sig;
        }
    }
}

/// Before the GPU opens and the first thread starts: drops capabilities and installs the
/// process filter on this thread, which every later thread inherits; threads then narrow
/// it to their role (`vgpu_backend::sandbox`).
fn confine_process(mode: Mode, gpu: GpuChoice) -> Result<(), String> {
    if mode == Mode::Off {
        warn!("seccomp: off (no filters; capabilities kept)");
        return Ok(());
    }
    let plan = sandbox::plan(mode, gpu).map_err(|e| format!("seccomp: {e}"))?;
    if privileges::drop_all().map_err(|e| format!("capabilities: {e}"))? {
        info!("capabilities dropped");
    }
    let plan = vgpu_sandbox::install_plan(plan).map_err(|e| format!("seccomp: {e}"))?;
    plan.apply(Role::BackendProcess)
        .map_err(|e| format!("seccomp: {e}"))?;
    info!("seccomp: {mode} (filters per thread role; docs/operator-guide.md)");
    Ok(())
}

fn run(cli: Cli, matches: &ArgMatches) -> Result<(), String> {
    let given = |id: &str| matches.value_source(id) == Some(ValueSource::CommandLine);
    let cfg = cli
        .file_config(given)?
        .resolve()
        .map_err(|e| format!("configuration: {e}"))?;
    if cfg.vms.is_empty() {
        return Err("no VM to serve: give --vm NAME or [[vm]] in the config file".into());
    }
    let set = block_signals().map_err(|e| format!("blocking signals: {e}"))?;
    let cuda = matches!(cfg.gpu.model, GpuChoice::Cuda { .. });
    let workers = match cli.gpu_workers {
        Some(WorkersFlag::Off) => None,
        Some(WorkersFlag::On(_)) if !cuda => {
            return Err("--gpu-workers is for --gpu cuda".into());
        }
        Some(WorkersFlag::On(g)) => Some(g),
        None => cuda.then_some(vgpu_gpu_worker::Granularity::Vm),
    };
    if let Some(granularity) = workers {
        let program = worker_program(&cfg, cli.test_worker_gpu.as_deref(), cli.doorbell_sleep_us)?;
        // Before the filters: no thread of the backend may start a process afterwards.
        let pid = vgpu_gpu_worker::launcher::start_process_launcher(
            &program.program,
            &["worker-launcher".to_string()],
            &program,
        )
        .map_err(|e| format!("the GPU worker launcher: {e}"))?;
        info!("GPU worker launcher: pid {pid}");
        // The backend itself never calls the driver with workers: the sim's roles, which
        // refuse every open.
        confine_process(cfg.seccomp, GpuChoice::Sim)?;
        let backend = VgpuBackend::with_workers(
            worker_pool(
                &cfg.gpu,
                program,
                cli.gpu_turn_us,
                granularity,
                cli.gpu_workers_per_vm,
            )?,
            VmLimits::default(),
        );
        let served = serve(backend, &cfg, set);
        vgpu_gpu_worker::launcher::stop_process_launcher();
        return served;
    }
    confine_process(cfg.seccomp, cfg.gpu.model)?;
    let gpu: Arc<dyn Gpu> = match cfg.gpu.model {
        GpuChoice::Sim => SimGpu::new(SimConfig {
            vram_bytes: cfg.gpu.vram_bytes,
            compute_engines: cfg.gpu.compute_engines,
            max_channels: cfg.gpu.max_channels,
            max_contexts: cfg.gpu.max_contexts,
            max_idle_sleep_ns: cli.sim_idle_sleep_us * 1000,
            doorbell_sleep_ns: cli.doorbell_sleep_us * 1000,
            ..SimConfig::default()
        })
        .map_err(|e| format!("sim GPU: {e}"))?,
        GpuChoice::Cuda { index } => CudaGpu::open(
            index,
            CudaConfig {
                vram_bytes: cfg.gpu.vram_bytes,
                max_channels: cfg.gpu.max_channels,
                max_contexts: cfg.gpu.max_contexts,
                doorbell_sleep_ns: cli.doorbell_sleep_us * 1000,
                ..CudaConfig::default()
            },
        )
        .map_err(|e| format!("cuda GPU {index}: {e}"))?,
    };
    serve(VgpuBackend::new(gpu, VmLimits::default()), &cfg, set)
}

/// `--gpu-workers`: a worker per VM or per guest process, or none.
#[derive(Debug, Clone, Copy)]
enum WorkersFlag {
    On(vgpu_gpu_worker::Granularity),
    Off,
}

impl std::str::FromStr for WorkersFlag {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(WorkersFlag::Off),
            other => other
                .parse()
                .map(WorkersFlag::On)
                .map_err(|_| format!("{other}: `vm`, `process` or `off`")),
        }
    }
}

/// `--gpu-turn-us`: 0 (off) or 100 µs ..= 100 ms.
fn parse_turn_us(s: &str) -> Result<u64, String> {
    let v: u64 = s.parse().map_err(|e| format!("{e}"))?;
    if v == 0 || (100..=100_000).contains(&v) {
        Ok(v)
    } else {
        Err("0 (off) or 100..=100000 µs".into())
    }
}

/// The worker of `--gpu-workers`: this program run as `vgpu-backend worker` on the
/// configured GPU (or `test_gpu`) in the backend's seccomp mode.
fn worker_program(
    cfg: &vgpu_backend::config::Config,
    test_gpu: Option<&str>,
    doorbell_sleep_us: u64,
) -> Result<vgpu_gpu_worker::WorkerProgram, String> {
    let exe = std::env::current_exe().map_err(|e| format!("this program's path: {e}"))?;
    let gpu = match test_gpu {
        None => cfg.gpu.model.to_string(),
        Some("cuda-fake") => "cuda-fake".to_string(),
        Some(other) => return Err(format!("--test-worker-gpu {other}: only cuda-fake")),
    };
    Ok(vgpu_gpu_worker::WorkerProgram {
        program: exe,
        args: vec![
            "worker".into(),
            "--gpu".into(),
            gpu,
            "--seccomp".into(),
            cfg.seccomp.name().into(),
            "--doorbell-sleep-us".into(),
            doorbell_sleep_us.to_string(),
        ],
    })
}

/// The workers of `--gpu-workers`: `program`, one per VM (or per guest process).
fn worker_pool(
    g: &vgpu_backend::config::GpuConfig,
    program: vgpu_gpu_worker::WorkerProgram,
    turn_us: u64,
    granularity: vgpu_gpu_worker::Granularity,
    max_workers_per_vm: u32,
) -> Result<Arc<vgpu_gpu_worker::WorkerPool>, String> {
    let turn = (turn_us > 0)
        .then(|| vgpu_gpu_worker::TurnSlots::new(turn_us))
        .transpose()
        .map_err(|e| format!("the GPU turn: {e}"))?;
    let cfg = vgpu_gpu_worker::PoolConfig {
        program,
        gpu: vgpu_host_shim::GpuInfo {
            name: g.model.to_string(),
            vram_bytes: g.vram_bytes,
            compute_engines: 1,
            max_channels: g.max_channels,
            max_contexts: g.max_contexts,
            has_busy_counters: true,
        },
        per_worker: (g.max_channels, g.max_contexts),
        granularity,
        max_workers_per_vm,
        opts: vgpu_gpu_worker::WorkerOptions {
            turn,
            ..vgpu_gpu_worker::WorkerOptions::default()
        },
    };
    info!(
        "GPU workers: one per {} ({}), GPU turn {}",
        match granularity {
            vgpu_gpu_worker::Granularity::Vm => "VM",
            vgpu_gpu_worker::Granularity::Process => "guest process",
        },
        cfg.program.program.display(),
        if turn_us > 0 {
            format!("quantum {turn_us} µs")
        } else {
            "off (time-sliced)".to_string()
        }
    );
    Ok(vgpu_gpu_worker::WorkerPool::new(cfg))
}

/// Serves the configured VMs on `backend` until SIGINT or SIGTERM.
fn serve(
    backend: Arc<VgpuBackend>,
    cfg: &vgpu_backend::config::Config,
    set: libc::sigset_t,
) -> Result<(), String> {
    let info = backend.gpu().info();
    for vm in &cfg.vms {
        if let Some(dir) = vm.socket.parent() {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        backend
            .serve_vm_with_limits(&vm.name, &vm.socket, vm.limits)
            .map_err(|e| format!("VM {}: {e}", vm.name))?;
        backend
            .set_vm_weight(&vm.name, vm.weight)
            .map_err(|e| format!("VM {}: {e}", vm.name))?;
        info!(
            "VM {}: weight {}, limits {:?}",
            vm.name, vm.weight, vm.limits
        );
    }
    backend
        .start_scheduler(cfg.scheduler)
        .map_err(|e| format!("scheduler: {e}"))?;
    let api = match &cfg.api_socket {
        Some(p) => {
            if let Some(dir) = p.parent() {
                std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            }
            Some(ApiServer::start(&backend, p, ApiOptions::default()).map_err(|e| e.to_string())?)
        }
        None => None,
    };
    // Everything is bound and started: the main thread narrows to waiting and shutting down.
    vgpu_sandbox::enter(Role::BackendMain);
    info!(
        "serving {} VM(s) on {} ({} MiB VRAM, {} engine(s)); policy {}",
        cfg.vms.len(),
        info.name,
        info.vram_bytes >> 20,
        info.compute_engines,
        cfg.scheduler.policy
    );
    let sig = wait_for_signal(&set);
    info!("signal {sig}: shutting down");
    drop(api);
    backend.shutdown();
    Ok(())
}

fn main() -> ExitCode {
    // `vgpu-backend worker ...`: one VM's GPU worker, started by a backend.
    if std::env::args().nth(1).as_deref() == Some("worker") {
        let args = std::env::args().enumerate().filter(|(i, _)| *i != 1);
        return vgpu_gpu_worker::cli::main_with(args.map(|(_, a)| a));
    }
    // `vgpu-backend worker-launcher PROGRAM ARGS...`: starts a backend's workers.
    if std::env::args().nth(1).as_deref() == Some("worker-launcher") {
        return vgpu_gpu_worker::launcher::main_with(std::env::args().skip(2));
    }
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let matches = Cli::command().get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    if cli.test_hold_read_only_ms > 0 {
        warn!(
            "test-only: moving VRAM chunks stay read-only {} ms longer",
            cli.test_hold_read_only_ms
        );
        vgpu_backend::vm::vram_move::set_test_read_only_hold(std::time::Duration::from_millis(
            cli.test_hold_read_only_ms,
        ));
    }
    match run(cli, &matches) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("{e}");
            ExitCode::FAILURE
        }
    }
}
