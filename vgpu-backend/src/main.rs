//! `vgpu-backend`: serves vgpu devices to VMs over vhost-user, one socket per VM, on the
//! built-in `sim` GPU.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use log::{error, info};
use vgpu_backend::api::{ApiOptions, ApiServer};
use vgpu_backend::config::FileConfig;
use vgpu_backend::{VgpuBackend, VmLimits};
use vgpu_host_shim::{Gpu, SimConfig, SimGpu};

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
    /// Scheduling policy: none, fair (timeslice and sampling are not implemented yet).
    #[arg(long)]
    policy: Option<String>,
    /// Scheduling interval, ms.
    #[arg(long)]
    sched_interval_ms: Option<u32>,
    /// VRAM of the sim GPU, MiB [default: 1024].
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
    /// Per-VM scheduling weight (1..=10000).
    #[arg(long)]
    vm_weight: Option<u32>,
}

impl Cli {
    /// The configuration file (or an empty one) with the flags applied over it.
    fn file_config(&self) -> Result<FileConfig, String> {
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
        let s = &mut f.scheduler;
        s.policy = self.policy.clone().or(s.policy.take());
        s.interval_ms = self.sched_interval_ms.or(s.interval_ms);
        let g = &mut f.gpu;
        g.vram_mib = self.vram_mib.or(g.vram_mib);
        g.compute_engines = self.compute_engines.or(g.compute_engines);
        g.max_channels = self.gpu_max_channels.or(g.max_channels);
        g.max_contexts = self.gpu_max_contexts.or(g.max_contexts);
        // Per-VM flags apply to every VM, over the file's per-VM values.
        for v in &mut f.vm {
            v.vram_mib = self.vm_vram_mib.or(v.vram_mib);
            v.max_contexts = self.vm_max_contexts.or(v.max_contexts);
            v.max_channels = self.vm_max_channels.or(v.max_channels);
            v.mapped_guest_mib = self.vm_mapped_guest_mib.or(v.mapped_guest_mib);
            v.weight = self.vm_weight.or(v.weight);
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

fn run(cli: Cli) -> Result<(), String> {
    let cfg = cli
        .file_config()?
        .resolve()
        .map_err(|e| format!("configuration: {e}"))?;
    if cfg.vms.is_empty() {
        return Err("no VM to serve: give --vm NAME or [[vm]] in the config file".into());
    }
    let set = block_signals().map_err(|e| format!("blocking signals: {e}"))?;
    let gpu = SimGpu::new(SimConfig {
        vram_bytes: cfg.gpu.vram_bytes,
        compute_engines: cfg.gpu.compute_engines,
        max_channels: cfg.gpu.max_channels,
        max_contexts: cfg.gpu.max_contexts,
        ..SimConfig::default()
    })
    .map_err(|e| format!("sim GPU: {e}"))?;
    let info = gpu.info();
    let gpu: Arc<dyn Gpu> = gpu;
    let backend = VgpuBackend::new(gpu, VmLimits::default());
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
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("{e}");
            ExitCode::FAILURE
        }
    }
}
