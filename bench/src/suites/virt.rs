//! Suite `virt`: the same workloads natively and through the whole virtualization path —
//! requests over a real vhost-user socket to `vgpu-backend`, control pages and apertures
//! mapped into the loopback VM's BAR window, submissions by plain stores — measured side
//! by side in one run. Also the API-remoting baseline: every launch sent to the host as a
//! control-queue request; and forwarded submission (protocol.md §9.1): a second VM on the
//! same backend whose frontend offers no shared-memory region, so its runtime submits and
//! reads completions with requests, against the direct VM on the same workloads.

use std::path::PathBuf;
use std::sync::Arc;

use thiserror::Error;
use vgpu_backend::{VgpuBackend, VmLimits};
use vgpu_guest::workloads::{Expected, Workload};
use vgpu_guest::Device;
use vgpu_host_shim::{HalError, SimConfig, SimGpu};
use vgpu_loopback::{LoopbackConfig, LoopbackVm};

use crate::report::{Better, Figure};
use crate::suites::measure::{min, submit_latency, submit_throughput, Publish};

const SUITE: &str = "virt";

#[derive(Debug, Error)]
pub enum VirtSuiteError {
    #[error("GPU: {0}")]
    Hal(#[from] HalError),
    #[error("runtime: {0}")]
    Runtime(#[from] vgpu_guest::Error),
    #[error("backend: {0}")]
    Backend(String),
    #[error("loopback VM: {0}")]
    Loopback(String),
}

#[derive(Debug, Clone)]
pub struct VirtOpts {
    /// Runs of each workload per side (alternating native and loopback).
    pub reps: u32,
    /// Small workload sizes.
    pub small: bool,
    pub latency_samples: u32,
    /// Submissions in each throughput stream.
    pub throughput_submits: u32,
}

impl VirtOpts {
    pub fn full() -> Self {
        VirtOpts {
            reps: 9,
            small: false,
            latency_samples: 3000,
            throughput_submits: 20_000,
        }
    }

    pub fn quick() -> Self {
        VirtOpts {
            reps: 1,
            small: true,
            latency_samples: 200,
            throughput_submits: 1000,
        }
    }
}

/// A backend serving one loopback VM on a private socket.
pub struct Rig {
    pub gpu: Arc<SimGpu>,
    pub backend: Arc<VgpuBackend>,
    pub vm: Arc<LoopbackVm>,
    /// Loopback VMs added with [`Rig::add_vm`].
    more: Vec<Arc<LoopbackVm>>,
    dir: PathBuf,
}

impl Rig {
    pub fn new(vm_mem: u64) -> Result<Self, VirtSuiteError> {
        let gpu = SimGpu::new(SimConfig::default())?;
        let backend = VgpuBackend::new(gpu.clone(), VmLimits::default());
        let dir = std::env::temp_dir().join(format!("vgpu-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| VirtSuiteError::Backend(e.to_string()))?;
        let sock = dir.join("bench.sock");
        backend
            .serve_vm("bench", &sock)
            .map_err(|e| VirtSuiteError::Backend(e.to_string()))?;
        let vm = LoopbackVm::connect(&sock, LoopbackConfig::with_mem(vm_mem))
            .map_err(|e| VirtSuiteError::Loopback(e.to_string()))?;
        Ok(Rig {
            gpu,
            backend,
            vm,
            more: Vec::new(),
            dir,
        })
    }

    /// Serves and connects one more VM, `name`, on the same backend.
    pub fn add_vm(
        &mut self,
        name: &str,
        cfg: LoopbackConfig,
    ) -> Result<Arc<LoopbackVm>, VirtSuiteError> {
        let sock = self.dir.join(format!("{name}.sock"));
        self.backend
            .serve_vm(name, &sock)
            .map_err(|e| VirtSuiteError::Backend(e.to_string()))?;
        let vm =
            LoopbackVm::connect(&sock, cfg).map_err(|e| VirtSuiteError::Loopback(e.to_string()))?;
        self.more.push(vm.clone());
        Ok(vm)
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        for vm in &self.more {
            vm.disconnect();
        }
        self.vm.disconnect();
        self.backend.shutdown();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn fig(name: &str, value: f64, unit: &str, better: Better) -> Figure {
    Figure::new(SUITE, name, value, unit, better)
}

pub fn run(opts: &VirtOpts) -> Result<Vec<Figure>, VirtSuiteError> {
    let mut rig = Rig::new(768 << 20)?;
    let fvm = rig.add_vm("bench-fwd", LoopbackConfig::with_mem(768 << 20).forwarded())?;
    let native = Device::native(rig.gpu.clone())?;
    let guest = Device::loopback(rig.vm.clone(), 1000)?;
    let fwd = Device::loopback(fvm, 1000)?;
    let nctx = native.create_context()?;
    let gctx = guest.create_context()?;
    let fctx = fwd.create_context()?;
    let mut figs = Vec::new();
    for name in Workload::NAMES {
        let Some(w) = Workload::by_name(name, opts.small) else {
            continue;
        };
        let (mut n, mut g, mut f) = (Vec::new(), Vec::new(), Vec::new());
        // Warm-up on every side, then alternate so drift hits all equally.
        // The CPU reference once (`Expected`), every run checked against it.
        let mut expected = Expected::default();
        w.run_expecting(&nctx, &mut expected)?;
        w.run_expecting(&gctx, &mut expected)?;
        w.run_expecting(&fctx, &mut expected)?;
        for _ in 0..opts.reps {
            n.push(w.run_expecting(&nctx, &mut expected)?.elapsed.as_secs_f64());
            g.push(w.run_expecting(&gctx, &mut expected)?.elapsed.as_secs_f64());
            f.push(w.run_expecting(&fctx, &mut expected)?.elapsed.as_secs_f64());
        }
        // Best of N on each side: interference on a small shared host only ever adds
        // time, so the minimum is the least noisy estimate of what each path costs.
        let (n, g, f) = (min(&n), min(&g), min(&f));
        figs.push(fig(
            &format!("{name}_forwarded"),
            f * 1e3,
            "ms",
            Better::Lower,
        ));
        figs.push(fig(
            &format!("{name}_forwarded_vs_direct"),
            f / g,
            "ratio",
            Better::Lower,
        ));
        figs.push(fig(&format!("{name}_native"), n * 1e3, "ms", Better::Lower));
        figs.push(fig(
            &format!("{name}_loopback"),
            g * 1e3,
            "ms",
            Better::Lower,
        ));
        figs.push(
            fig(
                &format!("{name}_loopback_vs_native"),
                g / n,
                "ratio",
                Better::Lower,
            )
            .target(1.02),
        );
    }
    let n = submit_latency(&nctx, opts.latency_samples, Publish::Store)?;
    let g = submit_latency(&gctx, opts.latency_samples, Publish::Store)?;
    figs.push(fig("submit_latency_p50_native", n.0, "us", Better::Lower));
    figs.push(fig("submit_latency_p50_loopback", g.0, "us", Better::Lower));
    figs.push(fig("submit_latency_p99_loopback", g.1, "us", Better::Lower));
    figs.push(
        fig(
            "submit_latency_p50_loopback_vs_native",
            g.0 / n.0.max(1e-3),
            "ratio",
            Better::Lower,
        )
        .target(1.2),
    );
    let r = submit_latency(&gctx, opts.latency_samples, Publish::Remote)?;
    figs.push(fig(
        "submit_latency_p50_api_remoting",
        r.0,
        "us",
        Better::Lower,
    ));
    figs.push(fig(
        "submit_latency_p99_api_remoting",
        r.1,
        "us",
        Better::Lower,
    ));
    figs.push(
        fig(
            "api_remoting_vs_direct_p50",
            r.0 / g.0.max(1e-3),
            "ratio",
            Better::Higher,
        )
        .target(10.0),
    );
    // Forwarded submission: the same measurements on the VM without a region.
    let fl = submit_latency(&fctx, opts.latency_samples, Publish::Store)?;
    figs.push(fig(
        "submit_latency_p50_forwarded",
        fl.0,
        "us",
        Better::Lower,
    ));
    figs.push(fig(
        "submit_latency_p99_forwarded",
        fl.1,
        "us",
        Better::Lower,
    ));
    figs.push(fig(
        "forwarded_vs_direct_submit_p50",
        fl.0 / g.0.max(1e-3),
        "ratio",
        Better::Lower,
    ));
    let dt = submit_throughput(&gctx, opts.throughput_submits)?;
    let ft = submit_throughput(&fctx, opts.throughput_submits)?;
    figs.push(fig("submit_rate_direct", dt, "1/s", Better::Higher));
    figs.push(fig("submit_rate_forwarded", ft, "1/s", Better::Higher));
    figs.push(fig(
        "forwarded_vs_direct_submit_rate",
        ft / dt.max(1e-9),
        "ratio",
        Better::Higher,
    ));
    Ok(figs)
}
