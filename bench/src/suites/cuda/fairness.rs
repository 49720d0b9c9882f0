//! Two VMs' shares under `none` and `fair`, and three VMs' under weights 1:2:4
//! (`--only fairness`).

use super::*;

/// Two VMs, one with 10 ms and one with 1 ms kernels, under `policy`: each VM's share of
/// the wall time, from completed kernels × kernel length.
pub(super) fn fairness(
    gpu: &VmGpus,
    policy: Policy,
    secs: f64,
) -> Result<(f64, f64), CudaSuiteError> {
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
pub(super) fn gpu_used_mib(index: u32) -> Option<f64> {
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
pub(super) fn all_running(tenants: &[Tenant]) {
    let t0 = Instant::now();
    while tenants.iter().any(|t| t.completed() == 0) && t0.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Kernel time `tenants` of 1 ms kernels complete between them per wall time over
/// `secs`, %: above 100 where their kernels overlap (one context's streams run one-block
/// kernels side by side; workers taking the GPU turn do not).
pub(super) fn busy_share(tenants: &[Tenant], secs: f64) -> f64 {
    all_running(tenants);
    std::thread::sleep(Duration::from_millis(300));
    let c0: u64 = tenants.iter().map(|t| t.completed()).sum();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(secs));
    let c1: u64 = tenants.iter().map(|t| t.completed()).sum();
    (c1 - c0) as f64 * MS as f64 / t0.elapsed().as_nanos() as f64 * 100.0
}

/// Three VMs with weights 1:2:4, each running 1 ms kernels, under the fair policy: each
/// VM's share of the wall time.
pub(super) fn weighted(gpu: &VmGpus, secs: f64) -> Result<Vec<f64>, CudaSuiteError> {
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
