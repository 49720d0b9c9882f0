//! A backend serving several loopback VMs, and guest tenants that keep its GPU busy: the
//! rig of the `sched` benchmark suite and of the scheduler's end-to-end tests.
//!
//! Tenants submit `Spin` kernels, which hold the GPU's engine for exactly their length
//! without burning a host core, so GPU time is known from the kernel count and does not
//! depend on how busy the (shared, 2-core) host is.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use thiserror::Error;
use vgpu_backend::{VgpuBackend, VmLimits};
use vgpu_guest::{Device, KernelArgs};
use vgpu_host_shim::{HalError, SimConfig, SimGpu};
use vgpu_loopback::{LoopbackConfig, LoopbackVm};
use vgpu_test_support::{connect_retry, Host, CONNECT_TIMEOUT};

#[derive(Debug, Error)]
pub enum RigError {
    #[error("GPU: {0}")]
    Hal(#[from] HalError),
    #[error("backend: {0}")]
    Backend(String),
    #[error("loopback VM {0}: {1}")]
    Loopback(String, String),
    #[error("no VM {0}")]
    NoVm(String),
    #[error("tenant {0}: {1}")]
    Tenant(String, String),
}

/// A backend on a sim GPU serving named loopback VMs on private sockets (a
/// [`Host`] with a loopback VM connected to each).
pub struct SchedRig {
    pub host: Host,
    vms: BTreeMap<String, Arc<LoopbackVm>>,
}

impl SchedRig {
    /// Serves `vms` and connects a loopback VM to each. With `hide_counters` the backend
    /// sees a GPU without busy counters (the `sampling` policy's case).
    pub fn new(tag: &str, vms: &[&str], hide_counters: bool) -> Result<Self, RigError> {
        let sim = SimGpu::new(SimConfig {
            vram_bytes: 256 << 20,
            hide_busy_counters: hide_counters,
            ..SimConfig::default()
        })?;
        let mut rig = SchedRig {
            host: Host::with_gpu(&format!("sched-{tag}"), sim, VmLimits::default(), &[]),
            vms: BTreeMap::new(),
        };
        for vm in vms {
            let sock = rig.host.socket(vm);
            rig.host
                .backend
                .serve_vm(vm, &sock)
                .map_err(|e| RigError::Backend(e.to_string()))?;
            let cfg = LoopbackConfig::with_mem(32 << 20);
            let lvm = connect_retry(&sock, cfg, CONNECT_TIMEOUT)
                .map_err(|e| RigError::Loopback(vm.to_string(), e.to_string()))?;
            rig.vms.insert(vm.to_string(), lvm);
        }
        Ok(rig)
    }

    /// The sim GPU.
    pub fn sim(&self) -> &Arc<SimGpu> {
        &self.host.gpu
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<VgpuBackend> {
        &self.host.backend
    }

    pub fn vm(&self, name: &str) -> Result<Arc<LoopbackVm>, RigError> {
        self.vms
            .get(name)
            .cloned()
            .ok_or_else(|| RigError::NoVm(name.into()))
    }

    /// GPU busy time of guest process `pid` of VM `vm` so far (the backend's books).
    pub fn proc_busy(&self, vm: &str, pid: u32) -> u64 {
        self.backend()
            .process_busy_ns(vm)
            .iter()
            .filter(|(p, _)| *p == pid)
            .map(|(_, b)| *b)
            .sum()
    }

    /// GPU busy time of VM `vm` so far.
    pub fn vm_busy(&self, vm: &str) -> u64 {
        self.backend()
            .process_busy_ns(vm)
            .iter()
            .map(|(_, b)| b)
            .sum()
    }
}

impl Drop for SchedRig {
    fn drop(&mut self) {
        // The VMs first; the host then shuts the backend down and removes its directory.
        for vm in self.vms.values() {
            vm.disconnect();
        }
    }
}

/// What a tenant thread did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TenantReport {
    /// Kernels completed.
    pub kernels: u64,
    /// From the first submission to the last completion.
    pub elapsed: Duration,
}

/// A guest process submitting spin kernels from its own thread.
pub struct Tenant {
    name: String,
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
    /// Taken by `join`; a tenant dropped without it is stopped and joined, so it never
    /// outlives the VM whose BAR it reads.
    handle: Option<JoinHandle<Result<TenantReport, String>>>,
}

/// GPU time a tenant keeps queued.
pub const QUEUED_NS: u64 = 16_000_000;

/// Submissions in flight to keep [`QUEUED_NS`] queued: 2..=64.
pub fn depth_for(kernel_ns: u64) -> usize {
    QUEUED_NS.div_ceil(kernel_ns.max(1)).clamp(2, 64) as usize
}

/// How a tenant uses channels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// `n` channels of one context, each kept `depth` deep (round robin).
    Channels(usize),
    /// Churn: for every kernel a new context and channel, destroyed once it finished.
    Churn,
}

/// What a tenant runs.
#[derive(Debug, Clone, Copy)]
pub struct TenantSpec {
    pub pid: u32,
    pub kernel_ns: u64,
    /// Submissions kept in flight (per channel).
    pub depth: usize,
    /// Kernels to run; `None` runs until stopped.
    pub kernels: Option<u64>,
    pub shape: Shape,
}

impl TenantSpec {
    /// A saturating `throttle`: kernels of `kernel_ns` until stopped, with enough in
    /// flight to cover [`QUEUED_NS`] of GPU time (like an application's asynchronous
    /// launches), so the GPU stays busy even when the guest thread waits for a core.
    pub fn throttle(pid: u32, kernel_ns: u64) -> Self {
        TenantSpec {
            pid,
            kernel_ns,
            depth: depth_for(kernel_ns),
            kernels: None,
            shape: Shape::Channels(1),
        }
    }

    /// A saturating tenant with `n` channels, each queued like a throttle.
    pub fn channels(pid: u32, kernel_ns: u64, n: usize) -> Self {
        TenantSpec {
            shape: Shape::Channels(n.max(1)),
            ..Self::throttle(pid, kernel_ns)
        }
    }

    /// A churning tenant: context + channel + one kernel + destroy, in a loop.
    pub fn churn(pid: u32, kernel_ns: u64) -> Self {
        TenantSpec {
            depth: 1,
            shape: Shape::Churn,
            ..Self::throttle(pid, kernel_ns)
        }
    }

    /// `kernels` kernels of `kernel_ns`, queued like [`TenantSpec::throttle`].
    pub fn fixed(pid: u32, kernel_ns: u64, kernels: u64) -> Self {
        TenantSpec {
            kernels: Some(kernels),
            ..Self::throttle(pid, kernel_ns)
        }
    }
}

impl Tenant {
    /// Starts a tenant in `vm`; returns once its channel exists.
    pub fn spawn(vm: Arc<LoopbackVm>, spec: TenantSpec) -> Result<Tenant, RigError> {
        let name = format!("pid{}", spec.pid);
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicU64::new(0));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop2, done2) = (stop.clone(), done.clone());
        let handle = std::thread::Builder::new()
            .name(format!("tenant-{}", spec.pid))
            .spawn(move || run_tenant(vm, spec, &stop2, &done2, ready_tx))
            .map_err(|e| RigError::Tenant(name.clone(), e.to_string()))?;
        let tenant = Tenant {
            name,
            stop,
            done,
            handle: Some(handle),
        };
        match ready_rx.recv_timeout(Duration::from_secs(20)) {
            Ok(()) => Ok(tenant),
            Err(_) => {
                let name = tenant.name.clone();
                match tenant.join() {
                    Err(e) => Err(e),
                    Ok(_) => Err(RigError::Tenant(name, "did not start".into())),
                }
            }
        }
    }

    /// Kernels completed so far.
    pub fn completed(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    pub fn is_finished(&self) -> bool {
        self.handle.as_ref().is_none_or(|h| h.is_finished())
    }

    /// Stops the tenant (it drains its in-flight work) and returns its report.
    pub fn stop(self) -> Result<TenantReport, RigError> {
        self.stop.store(true, Ordering::Release);
        self.join()
    }

    /// Waits for the tenant to end by itself.
    pub fn join(mut self) -> Result<TenantReport, RigError> {
        let name = std::mem::take(&mut self.name);
        match self.handle.take().map(|h| h.join()) {
            Some(Ok(r)) => r.map_err(|e| RigError::Tenant(name, e)),
            Some(Err(_)) => Err(RigError::Tenant(name, "panicked".into())),
            None => Err(RigError::Tenant(name, "already joined".into())),
        }
    }
}

impl Drop for Tenant {
    fn drop(&mut self) {
        if let Some(h) = self.handle.take() {
            self.stop.store(true, Ordering::Release);
            let _ = h.join();
        }
    }
}

fn run_tenant(
    vm: Arc<LoopbackVm>,
    spec: TenantSpec,
    stop: &AtomicBool,
    done: &AtomicU64,
    ready: std::sync::mpsc::Sender<()>,
) -> Result<TenantReport, String> {
    let err = |e: vgpu_guest::Error| e.to_string();
    let dev = Device::loopback(vm, spec.pid).map_err(err)?;
    let args = KernelArgs::Spin { ns: spec.kernel_ns };
    let start = Instant::now();
    let more = |submitted: u64| {
        spec.kernels.is_none_or(|n| submitted < n) && !stop.load(Ordering::Acquire)
    };
    let n = match spec.shape {
        Shape::Churn => {
            let _ = ready.send(());
            let mut submitted = 0u64;
            while more(submitted) {
                let ctx = dev.create_context().map_err(err)?;
                let mut ch = ctx.create_channel().map_err(err)?;
                ch.launch(&args, [1, 1, 1]).map_err(err)?;
                let f = ch.submit().map_err(err)?;
                submitted += 1;
                ch.wait(f).map_err(err)?;
                done.fetch_add(1, Ordering::Relaxed);
            }
            return Ok(TenantReport {
                kernels: done.load(Ordering::Relaxed),
                elapsed: start.elapsed(),
            });
        }
        Shape::Channels(n) => n.max(1),
    };
    let ctx = dev.create_context().map_err(err)?;
    let mut chans = Vec::with_capacity(n);
    for _ in 0..n {
        chans.push((
            ctx.create_channel().map_err(err)?,
            std::collections::VecDeque::new(),
        ));
    }
    let _ = ready.send(());
    let depth = spec.depth.max(1);
    let mut submitted = 0u64;
    loop {
        let go = more(submitted);
        let mut progressed = false;
        for (ch, in_flight) in chans.iter_mut() {
            if go && in_flight.len() < depth {
                ch.launch(&args, [1, 1, 1]).map_err(err)?;
                in_flight.push_back(ch.submit().map_err(err)?);
                submitted += 1;
                progressed = true;
            }
        }
        if progressed {
            continue;
        }
        // Every channel is full (or no more kernels): wait for the oldest of each.
        let mut waited = false;
        for (ch, in_flight) in chans.iter_mut() {
            if in_flight.len() >= depth || (!go && !in_flight.is_empty()) {
                if let Some(f) = in_flight.pop_front() {
                    ch.wait(f).map_err(err)?;
                    done.fetch_add(1, Ordering::Relaxed);
                    waited = true;
                }
            }
        }
        if !go && !waited {
            break;
        }
    }
    Ok(TenantReport {
        kernels: done.load(Ordering::Relaxed),
        elapsed: start.elapsed(),
    })
}
