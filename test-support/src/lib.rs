//! `vgpu-test-support`: the fixtures the integration tests (and the benchmark rigs) share,
//! so that each test says only what differs.
//!
//! - [`Host`]: a `vgpu-backend` on a `sim` GPU (or any GPU behind the HAL, e.g. the
//!   `cuda` one a test picks with [`gpu_from_env`]) serving VMs on vhost-user sockets in a
//!   private directory, shut down and cleaned up on drop;
//! - [`connect_retry`]: a loopback VM connecting to a socket the backend may not have
//!   bound yet;
//! - [`BackendLauncher`] / [`BackendProcess`]: the `vgpu-backend` binary as a child
//!   process (config, sockets and log in a private directory; restart, SIGSTOP, SIGKILL,
//!   SIGTERM), for tests of the daemon itself;
//! - [`pointer_list`]: a linked list for kernels that follow stored pointers.
//!
//! Fixtures panic on setup failures: a test that cannot set up has failed.

mod backend_process;
mod pointer_list;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vgpu_backend::{VgpuBackend, VmGpuSource, VmLimits};
use vgpu_gpu_worker::{VmWorker, WorkerPool};
use vgpu_host_shim::cuda::{CudaConfig, CudaGpu};
use vgpu_host_shim::{Gpu, GpuChoice, SimConfig, SimGpu};
use vgpu_loopback::{LoopbackConfig, LoopbackError, LoopbackVm};
use vgpu_vmm::reconnect::FaultPolicy;

pub use backend_process::{
    backend_bin, gpu_worker_args, BackendLauncher, BackendProcess, PROCESS_PATIENCE,
    TERMINATE_TIMEOUT,
};
pub use pointer_list::{pointer_list, pointer_list_sum};

/// How long [`Host::connect`] keeps trying.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Guest RAM of a loopback VM unless [`Host::with_vm_mem`] says otherwise.
pub const DEFAULT_VM_MEM: u64 = 128 << 20;

/// Connects a loopback VM to `socket`, retrying every 10 ms for up to `timeout` while
/// the backend is not listening yet; the last error when it never succeeds.
pub fn connect_retry(
    socket: &Path,
    cfg: LoopbackConfig,
    timeout: Duration,
) -> Result<Arc<LoopbackVm>, LoopbackError> {
    connect_retry_with(socket, cfg, FaultPolicy::default(), timeout)
}

/// [`connect_retry`] with a fault policy (request timeout, reconnect).
pub fn connect_retry_with(
    socket: &Path,
    cfg: LoopbackConfig,
    faults: FaultPolicy,
    timeout: Duration,
) -> Result<Arc<LoopbackVm>, LoopbackError> {
    let t0 = Instant::now();
    loop {
        match LoopbackVm::connect_with(socket, cfg.clone(), faults) {
            Ok(vm) => return Ok(vm),
            Err(e) if t0.elapsed() > timeout => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// A private directory under the system's temporary one, unique in this process.
pub fn temp_dir(prefix: &str) -> PathBuf {
    try_temp_dir(prefix).expect("test directory")
}

/// [`temp_dir`] for a program that reports the error (a benchmark run by a user).
pub fn try_temp_dir(prefix: &str) -> std::io::Result<PathBuf> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!(
        "vgpu-{prefix}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// The GPU a test runs on: `VGPU_TEST_GPU=sim|cuda[:INDEX]` (default `sim`), with
/// `vram_bytes` of VRAM. Tests that can run on a real GPU use this so the same test runs
/// on the device machine; a `cuda` choice that cannot open its GPU panics (the caller
/// asked for it explicitly).
pub fn gpu_from_env(vram_bytes: u64) -> Arc<dyn Gpu> {
    let choice: GpuChoice = std::env::var("VGPU_TEST_GPU")
        .ok()
        .map(|s| s.parse().unwrap_or_else(|e| panic!("VGPU_TEST_GPU: {e}")))
        .unwrap_or_default();
    // `VGPU_TEST_DOORBELL_US`: the front end's sleep with the doorbell armed (0: none),
    // to compare a test's behaviour with and without the doorbell.
    let doorbell_sleep_ns = std::env::var("VGPU_TEST_DOORBELL_US")
        .ok()
        .map(|s| {
            s.parse::<u64>()
                .unwrap_or_else(|e| panic!("VGPU_TEST_DOORBELL_US: {e}"))
                .saturating_mul(1000)
        })
        .unwrap_or(vgpu_host_shim::DEFAULT_DOORBELL_SLEEP_NS);
    match choice {
        GpuChoice::Sim => SimGpu::new(SimConfig {
            vram_bytes,
            doorbell_sleep_ns,
            ..Default::default()
        })
        .expect("sim GPU"),
        GpuChoice::Cuda { index } => CudaGpu::open(
            index,
            CudaConfig {
                vram_bytes,
                doorbell_sleep_ns,
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("VGPU_TEST_GPU=cuda:{index}: {e}")),
    }
}

/// The `cuda` GPU's front end on the CPU stand-in for a CUDA device, configured by `cfg`
/// (tests of the front end's behaviour without a GPU).
pub fn fake_cuda_gpu(cfg: CudaConfig) -> Arc<dyn Gpu> {
    vgpu_host_shim::cuda::FakeCudaGpu::with_device(
        Arc::new(vgpu_host_shim::cuda::FakeDevice::default()),
        cfg,
    )
    .expect("fake cuda GPU")
}

/// A backend on a GPU (the sim unless the test says otherwise) serving VMs on
/// `<dir>/<vm>.sock`.
pub struct Host<G: Gpu + ?Sized = SimGpu> {
    pub gpu: Arc<G>,
    pub backend: Arc<VgpuBackend>,
    pub dir: PathBuf,
    vm_mem: u64,
    /// Each VM's GPU worker, on a host with a worker per VM.
    workers: WorkerMap,
}

type WorkerMap = Arc<std::sync::Mutex<std::collections::HashMap<String, Arc<VmWorker>>>>;

impl Host {
    /// A sim GPU with `vram_bytes` of VRAM (the rest default), a backend with `limits`
    /// per VM, serving `vms`; the socket directory is named after `tag`.
    pub fn new(tag: &str, vram_bytes: u64, limits: VmLimits, vms: &[&str]) -> Host {
        let gpu = SimGpu::new(SimConfig {
            vram_bytes,
            ..Default::default()
        })
        .expect("sim GPU");
        Host::with_gpu(tag, gpu, limits, vms)
    }

    /// As [`Host::new`], on a GPU the caller configured.
    pub fn with_gpu(tag: &str, gpu: Arc<SimGpu>, limits: VmLimits, vms: &[&str]) -> Host {
        Host::build(tag, gpu.clone(), gpu, limits, vms)
    }
}

impl Host<dyn Gpu> {
    /// As [`Host::new`], on any GPU behind the HAL (see [`gpu_from_env`]).
    pub fn on_gpu(tag: &str, gpu: Arc<dyn Gpu>, limits: VmLimits, vms: &[&str]) -> Self {
        Host::build(tag, gpu.clone(), gpu, limits, vms)
    }
}

/// A worker process per VM (`vgpu-backend worker --gpu GPU`, the `vgpu-backend` beside
/// the tests or `$VGPU_BACKEND_BIN`), taking the GPU in turn as `--gpu-workers` does: GPU
/// `$VGPU_WORKER_GPU` (`cuda` on a GPU), else `cuda-fake`, with `vram_bytes` in all.
pub fn worker_pool_from_env(vram_bytes: u64) -> Arc<WorkerPool> {
    worker_pool_from_env_as(vram_bytes, vgpu_gpu_worker::Granularity::Vm)
}

/// As [`worker_pool_from_env`], with a worker per VM or per guest process.
pub fn worker_pool_from_env_as(
    vram_bytes: u64,
    granularity: vgpu_gpu_worker::Granularity,
) -> Arc<WorkerPool> {
    let gpu = std::env::var("VGPU_WORKER_GPU").unwrap_or_else(|_| "cuda-fake".into());
    WorkerPool::new(vgpu_gpu_worker::PoolConfig {
        program: vgpu_gpu_worker::WorkerProgram {
            program: backend_bin(None),
            args: vec!["worker".into(), "--gpu".into(), gpu.clone()],
        },
        gpu: vgpu_host_shim::GpuInfo {
            name: gpu,
            vram_bytes,
            compute_engines: 1,
            max_channels: 64,
            max_contexts: 32,
            has_busy_counters: true,
        },
        per_worker: (32, 16),
        granularity,
        max_workers_per_vm: 8,
        opts: vgpu_gpu_worker::WorkerOptions {
            turn: Some(vgpu_gpu_worker::TurnSlots::new(4000).expect("the GPU turn's page")),
            ..vgpu_gpu_worker::WorkerOptions::default()
        },
    })
}

impl Host<WorkerPool> {
    /// As [`Host::new`], with a GPU worker process per VM from `pool` (each VM's
    /// [`VmWorker`] is kept: [`Host::worker`]).
    pub fn on_workers(tag: &str, pool: Arc<WorkerPool>, limits: VmLimits, vms: &[&str]) -> Self {
        let workers: WorkerMap = Arc::default();
        let (p, w) = (pool.clone(), workers.clone());
        let source: VmGpuSource = Arc::new(move |name: &str, l: &VmLimits| -> Arc<dyn Gpu> {
            let g = p.vm_gpu(name, l.vram_bytes);
            w.lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(name.to_string(), g.clone());
            g
        });
        let backend = VgpuBackend::with_vm_gpus(pool.clone(), source, limits);
        let mut host = Host::start(tag, pool, backend, vms);
        host.workers = workers;
        host
    }

    /// VM `vm`'s GPU worker.
    pub fn worker(&self, vm: &str) -> Arc<VmWorker> {
        self.workers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(vm)
            .cloned()
            .unwrap_or_else(|| panic!("no worker for VM {vm}"))
    }
}

impl<G: Gpu + ?Sized> Host<G> {
    fn build(tag: &str, gpu: Arc<G>, hal: Arc<dyn Gpu>, limits: VmLimits, vms: &[&str]) -> Self {
        let backend = VgpuBackend::new(hal, limits);
        Host::start(tag, gpu, backend, vms)
    }

    fn start(tag: &str, gpu: Arc<G>, backend: Arc<VgpuBackend>, vms: &[&str]) -> Self {
        let host = Host {
            gpu,
            backend,
            dir: temp_dir(tag),
            vm_mem: DEFAULT_VM_MEM,
            workers: Arc::default(),
        };
        for vm in vms {
            host.serve(vm);
        }
        host
    }

    /// Guest RAM of the loopback VMs [`Host::connect`] makes.
    pub fn with_vm_mem(mut self, bytes: u64) -> Self {
        self.vm_mem = bytes;
        self
    }

    /// The socket of `vm`.
    pub fn socket(&self, vm: &str) -> PathBuf {
        self.dir.join(format!("{vm}.sock"))
    }

    /// Serves one more VM.
    pub fn serve(&self, vm: &str) {
        self.backend
            .serve_vm(vm, &self.socket(vm))
            .unwrap_or_else(|e| panic!("serve {vm}: {e}"));
    }

    /// A loopback VM connected as `vm`'s VMM.
    pub fn connect(&self, vm: &str) -> Arc<LoopbackVm> {
        let cfg = LoopbackConfig::with_mem(self.vm_mem);
        connect_retry(&self.socket(vm), cfg, CONNECT_TIMEOUT)
            .unwrap_or_else(|e| panic!("connect {vm}: {e}"))
    }

    /// A loopback VM connected as `vm`'s VMM through a frontend without a shared-memory
    /// region (forwarded submission, as under QEMU 10).
    pub fn connect_forwarded(&self, vm: &str) -> Arc<LoopbackVm> {
        let cfg = LoopbackConfig::with_mem(self.vm_mem).forwarded();
        connect_retry(&self.socket(vm), cfg, CONNECT_TIMEOUT)
            .unwrap_or_else(|e| panic!("connect {vm} (forwarded): {e}"))
    }
}

impl<G: Gpu + ?Sized> Drop for Host<G> {
    fn drop(&mut self) {
        self.backend.shutdown();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
