//! `vgpu-backend`: serves vgpu devices to VMs over vhost-user, one socket per VM, on the
//! built-in `sim` GPU.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use log::{error, info};
use vgpu_backend::{SchedArgs, VgpuBackend, VmLimits};
use vgpu_host_shim::{Gpu, SimConfig, SimGpu};

#[derive(Debug, Parser)]
#[command(name = "vgpu-backend", version, about)]
struct Cli {
    /// Directory of the VM sockets (`DIR/NAME.sock`).
    #[arg(long, value_name = "DIR")]
    socket_dir: PathBuf,
    /// A VM to serve (repeatable).
    #[arg(long = "vm", value_name = "NAME", required = true)]
    vms: Vec<String>,
    /// VRAM of the sim GPU, MiB.
    #[arg(long, default_value_t = 1024)]
    vram_mib: u64,
    /// Compute engines of the sim GPU.
    #[arg(long, default_value_t = 1)]
    compute_engines: u32,
    /// Channels the sim GPU supports in total.
    #[arg(long, default_value_t = 256)]
    gpu_max_channels: u32,
    /// Contexts the sim GPU supports in total.
    #[arg(long, default_value_t = 256)]
    gpu_max_contexts: u32,
    /// Longest sleep of the sim GPU's idle PFIFO between polls of GP_PUT, microseconds:
    /// the latency of a submission after an idle spell vs. the CPU an idle GPU model
    /// costs. Raise it where CPU is dear (the nested rig runs the backend under TCG, where
    /// the default's wake-ups eat most of a vCPU).
    #[arg(long, value_name = "US", default_value_t = 250,
          value_parser = clap::value_parser!(u64).range(10..=100_000))]
    sim_idle_sleep_us: u64,
    /// Per-VM limit: VRAM, MiB (default: the GPU's VRAM).
    #[arg(long)]
    vm_vram_mib: Option<u64>,
    /// Per-VM limit: GPU contexts.
    #[arg(long)]
    vm_max_contexts: Option<u32>,
    /// Per-VM limit: channels.
    #[arg(long)]
    vm_max_channels: Option<u32>,
    /// Per-VM limit: guest memory mapped into GPU address spaces, MiB.
    #[arg(long)]
    vm_mapped_guest_mib: Option<u64>,
    /// Per-VM limit: VRAM objects beyond the VRAM quota, swapped to host memory, MiB
    /// (default 0: no oversubscription).
    #[arg(long)]
    vm_swap_mib: Option<u64>,
    #[command(flatten)]
    sched: SchedArgs,
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

fn run(cli: Cli) -> Result<(), String> {
    let set = block_signals().map_err(|e| format!("blocking signals: {e}"))?;
    let vram_bytes = cli
        .vram_mib
        .checked_mul(1 << 20)
        .ok_or("--vram-mib too large")?;
    let gpu = SimGpu::new(SimConfig {
        vram_bytes,
        compute_engines: cli.compute_engines,
        max_channels: cli.gpu_max_channels,
        max_contexts: cli.gpu_max_contexts,
        max_idle_sleep_ns: cli.sim_idle_sleep_us * 1000,
        ..SimConfig::default()
    })
    .map_err(|e| format!("sim GPU: {e}"))?;
    let info = gpu.info();
    let defaults = VmLimits::default();
    let mib = |m: u64| m.checked_mul(1 << 20).ok_or("limit too large");
    let limits = VmLimits {
        max_contexts: cli.vm_max_contexts.unwrap_or(defaults.max_contexts),
        max_channels: cli.vm_max_channels.unwrap_or(defaults.max_channels),
        vram_bytes: match cli.vm_vram_mib {
            Some(m) => mib(m)?,
            None => info.vram_bytes,
        },
        mapped_guest_bytes: match cli.vm_mapped_guest_mib {
            Some(m) => mib(m)?,
            None => defaults.mapped_guest_bytes,
        },
        swap_bytes: match cli.vm_swap_mib {
            Some(m) => mib(m)?,
            None => defaults.swap_bytes,
        },
    };
    std::fs::create_dir_all(&cli.socket_dir)
        .map_err(|e| format!("{}: {e}", cli.socket_dir.display()))?;
    let gpu: Arc<dyn Gpu> = gpu;
    let backend = VgpuBackend::new(gpu, limits);
    for name in &cli.vms {
        let socket = cli.socket_dir.join(format!("{name}.sock"));
        backend
            .serve_vm(name, &socket)
            .map_err(|e| format!("VM {name}: {e}"))?;
    }
    cli.sched
        .apply(&backend)
        .map_err(|e| format!("scheduler: {e}"))?;
    info!(
        "serving {} VM(s) on {} ({} MiB VRAM, {} engine(s)); limits per VM: {limits:?}",
        cli.vms.len(),
        info.name,
        info.vram_bytes >> 20,
        info.compute_engines
    );
    let sig = wait_for_signal(&set);
    info!("signal {sig}: shutting down");
    backend.shutdown();
    Ok(())
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("{e}");
            ExitCode::FAILURE
        }
    }
}
