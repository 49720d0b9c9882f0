//! A worker's command line and `main`: `vgpu-gpu-worker` and `vgpu-backend worker` both
//! run it. Started by the backend with its command socket as fd 3, its event socket as
//! fd 4 and the GPU turn's page as fd 5; not meant to be run by hand.

use std::os::fd::{FromRawFd, OwnedFd};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use log::error;

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
    /// Test-only fault injection: this long after the start, run a kernel that writes a
    /// wild address (`cuda`; on `cuda-fake` the device acts one out), as a faulty or
    /// hostile kernel would. The worker then loses its GPU and exits.
    #[arg(long, hide = true)]
    test_fault_after_ms: Option<u64>,
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
        ..CudaConfig::default()
    };
    let gpu: Arc<dyn Gpu> = match cli.gpu.as_str() {
        "sim" => SimGpu::new(SimConfig {
            vram_bytes: cli.vram_mib << 20,
            max_channels: cli.max_channels,
            max_contexts: cli.max_contexts,
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
    let gpu = match open(&cli) {
        Ok(g) => g,
        Err(e) => {
            error!("{e}");
            return ExitCode::FAILURE;
        }
    };
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
