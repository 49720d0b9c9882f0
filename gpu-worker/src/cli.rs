//! A worker's command line and `main`: `vgpu-gpu-worker` and `vgpu-backend worker` both
//! run it. Started by the backend with its command socket as fd 3, its event socket as
//! fd 4 and the GPU turn's page as fd 5; not meant to be run by hand.

use std::os::fd::{FromRawFd, OwnedFd};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use log::error;

use crate::sandbox::{confine, WorkerGpuKind};
use crate::{serve, ServeOptions, COMMAND_FD, EVENT_FD, TURN_FD};
use vgpu_host_shim::cuda::{CudaConfig, CudaGpu, FakeCudaGpu, FakeDevice};
use vgpu_host_shim::gpu_turn::GpuTurn;
use vgpu_host_shim::{Gpu, SimConfig, SimGpu};

#[derive(Debug, Parser)]
#[command(name = "vgpu-gpu-worker", version, about)]
struct Cli {
    /// The GPU: `cuda[:INDEX]`, `cuda-fake` (the CPU stand-in for the CUDA device, for
    /// tests without a GPU) or `sim`.
    #[arg(long, default_value = "cuda")]
    gpu: String,
    /// VRAM of this worker's GPU, MiB.
    #[arg(long, default_value_t = 1024)]
    vram_mib: u64,
    /// Channels of this worker's GPU.
    #[arg(long, default_value_t = 256)]
    max_channels: u32,
    /// Contexts of this worker's GPU.
    #[arg(long, default_value_t = 256)]
    max_contexts: u32,
    /// How often channels' counters are published, microseconds.
    #[arg(long, default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(100..=100_000))]
    publish_us: u64,
    /// This worker's slot in the GPU turn, whose page is fd 5 (`cuda` GPUs only; without
    /// it the GPU time-slices this worker's context with the others').
    #[arg(long)]
    turn_slot: Option<u32>,
    /// How long the worker may keep the turn while others wait, microseconds.
    #[arg(long, default_value_t = 4000)]
    turn_quantum_us: u64,
    /// Longest sleep of the idle front end with the doorbell armed, microseconds; 0: no
    /// doorbell (the backend's `--doorbell-sleep-us`).
    #[arg(long, default_value_t = 10_000,
          value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    doorbell_sleep_us: u64,
    /// Test-only fault injection: this long after the start, run a kernel that writes a
    /// wild address (`cuda`; on `cuda-fake` the device acts one out), as a faulty or
    /// hostile kernel would. The worker then loses its GPU and exits.
    #[arg(long, hide = true)]
    test_fault_after_ms: Option<u64>,
    /// What a syscall outside the worker's seccomp filter does: `kill` the worker, `log`
    /// it and let it run (to find what a driver needs), or `off`. The backend passes its
    /// own `--seccomp`; without the flag `$VGPU_WORKER_SECCOMP`, else `kill` (so tests that
    /// start workers themselves can run them in `log` mode on a GPU).
    #[arg(long, value_name = "kill|log|off")]
    seccomp: Option<vgpu_sandbox::Mode>,
}

/// The seccomp mode: the flag, else `$VGPU_WORKER_SECCOMP`, else kill.
fn seccomp_mode(cli: &Cli) -> Result<vgpu_sandbox::Mode, String> {
    if let Some(m) = cli.seccomp {
        return Ok(m);
    }
    match std::env::var("VGPU_WORKER_SECCOMP") {
        Ok(v) => v.parse().map_err(|e| format!("VGPU_WORKER_SECCOMP: {e}")),
        Err(_) => Ok(vgpu_sandbox::Mode::Kill),
    }
}

/// Runs `fault` on a thread of its own after `after_ms` (the test-only injection).
fn fault_later(after_ms: Option<u64>, fault: impl FnOnce() + Send + 'static) {
    let Some(ms) = after_ms else {
        return;
    };
    log::warn!("test fault injection: a wild write in {ms} ms");
    let spawned = std::thread::Builder::new()
        .name("test-fault".into())
        .spawn(move || {
            std::thread::sleep(Duration::from_millis(ms));
            fault();
        });
    if let Err(e) = spawned {
        log::error!("test fault injection: {e}");
    }
}

fn turn(cli: &Cli) -> Result<Option<Arc<GpuTurn>>, String> {
    let Some(slot) = cli.turn_slot else {
        return Ok(None);
    };
    // SAFETY: with `--turn-slot` the backend started this process with the turn page as
    // fd 5 (see `crate::client::spawn`); nothing else in it owns that fd.
    let fd = unsafe { OwnedFd::from_raw_fd(TURN_FD) };
    GpuTurn::open(fd, slot, cli.turn_quantum_us.saturating_mul(1000))
        .map(Some)
        .map_err(|e| format!("the GPU turn: {e}"))
}

fn open(cli: &Cli) -> Result<Arc<dyn Gpu>, String> {
    let cfg = CudaConfig {
        vram_bytes: cli.vram_mib << 20,
        max_channels: cli.max_channels,
        max_contexts: cli.max_contexts,
        turn: turn(cli)?,
        // This process serves one VM: its guests may run their own modules here.
        guest_modules: true,
        doorbell_sleep_ns: cli.doorbell_sleep_us * 1000,
        ..CudaConfig::default()
    };
    let gpu: Arc<dyn Gpu> = match cli.gpu.as_str() {
        "sim" => SimGpu::new(SimConfig {
            vram_bytes: cli.vram_mib << 20,
            max_channels: cli.max_channels,
            max_contexts: cli.max_contexts,
            doorbell_sleep_ns: cli.doorbell_sleep_us * 1000,
            ..SimConfig::default()
        })
        .map_err(|e| format!("sim GPU: {e}"))?,
        "cuda-fake" => {
            let dev = Arc::new(FakeDevice::default());
            let gpu = FakeCudaGpu::with_device(dev.clone(), cfg)
                .map_err(|e| format!("fake cuda GPU: {e}"))?;
            fault_later(cli.test_fault_after_ms, move || dev.poison());
            gpu
        }
        other => {
            let index = match other.strip_prefix("cuda") {
                Some("") => 0,
                Some(rest) => rest
                    .strip_prefix(':')
                    .and_then(|i| i.parse().ok())
                    .ok_or_else(|| {
                        format!("--gpu {other:?}: expected cuda[:INDEX], cuda-fake or sim")
                    })?,
                None => {
                    return Err(format!(
                        "--gpu {other:?}: expected cuda[:INDEX], cuda-fake or sim"
                    ))
                }
            };
            let gpu = CudaGpu::open(index, cfg).map_err(|e| format!("cuda GPU {index}: {e}"))?;
            let dev = gpu.device().clone();
            fault_later(cli.test_fault_after_ms, move || {
                if let Err(e) = dev.inject_wild_write() {
                    log::error!("test fault injection: {e}");
                }
            });
            gpu
        }
    };
    Ok(gpu)
}

/// Runs a worker with the command line `args` (the first is the program's name).
pub fn main_with(args: impl IntoIterator<Item = String>) -> ExitCode {
    let _ = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .try_init();
    let cli = match Cli::try_parse_from(args) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    let mode = match seccomp_mode(&cli) {
        Ok(m) => m,
        Err(e) => {
            error!("{e}");
            return ExitCode::FAILURE;
        }
    };
    // Off the driver the filter goes on before anything else happens (opening the GPU
    // included); the CUDA driver first opens its device nodes and starts its threads, then
    // every thread takes the filter.
    let kind = if cli.gpu.starts_with("cuda") && cli.gpu != "cuda-fake" {
        WorkerGpuKind::Cuda
    } else {
        WorkerGpuKind::Cpu
    };
    if kind == WorkerGpuKind::Cpu {
        if let Err(e) = confine(mode, kind) {
            error!("{e}");
            return ExitCode::FAILURE;
        }
    }
    let gpu = match open(&cli) {
        Ok(g) => g,
        Err(e) => {
            error!("{e}");
            return ExitCode::FAILURE;
        }
    };
    if kind == WorkerGpuKind::Cuda {
        if let Err(e) = confine(mode, kind) {
            error!("{e}");
            return ExitCode::FAILURE;
        }
    }
    // SAFETY: the backend started this process with its sockets as fds 3 and 4 (see
    // `crate::client::spawn`); nothing else in it owns them.
    let (cmd, events) = unsafe {
        (
            OwnedFd::from_raw_fd(COMMAND_FD),
            OwnedFd::from_raw_fd(EVENT_FD),
        )
    };
    let opts = ServeOptions {
        publish_every: Duration::from_micros(cli.publish_us),
    };
    match serve(gpu, cmd, events, opts) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("{e}");
            ExitCode::FAILURE
        }
    }
}
