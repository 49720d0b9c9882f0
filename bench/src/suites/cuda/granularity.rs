//! A worker per VM against a worker per guest process (`--workers --only granularity`).

use super::fairness::busy_share;
use super::*;

/// A worker per VM against a worker per guest process, for one VM of `opts.processes`
/// guest processes: each process's first `CREATE_CONTEXT` (a worker start with a worker
/// per process; with one per VM the first waits for the VM's worker started at connect),
/// device memory per worker (`nvidia-smi`, on a GPU), and the kernel time one process of
/// 1 ms kernels completes against N processes at once (with a worker per process the GPU
/// turn hands over between them; with one per VM they share one context).
pub(super) fn granularity(gpu: &VmGpus, opts: &CudaOpts) -> Result<Vec<Figure>, CudaSuiteError> {
    use vgpu_gpu_worker::Granularity;
    let n = opts.processes.max(2);
    let be = |e: vgpu_guest::Error| CudaSuiteError::Backend(e.to_string());
    let mut figs = Vec::new();
    for g in [Granularity::Vm, Granularity::Process] {
        let gpus = VmGpus {
            granularity: g,
            ..gpu.clone()
        };
        let used0 = gpu_used_mib(opts.index);
        let rig = Rig::new(&gpus, &["g"], 64 << 20)?;
        let t_connect = Instant::now();
        let mut firsts = Vec::new();
        let mut held = Vec::new();
        for pid in 1..=n {
            let t = Instant::now();
            let dev = Device::loopback(rig.vms[0].clone(), pid).map_err(be)?;
            let ctx = dev.create_context().map_err(be)?;
            firsts.push(t.elapsed().as_secs_f64() * 1e3);
            held.push((ctx, dev));
        }
        let all_ms = t_connect.elapsed().as_secs_f64() * 1e3;
        let workers = rig.backend.worker_stats().map_or(0, |s| s.running);
        let used1 = gpu_used_mib(opts.index);
        drop(held);
        let tag = g.name();
        let mean = firsts.iter().sum::<f64>() / firsts.len() as f64;
        let max = firsts.iter().cloned().fold(0.0, f64::max);
        figs.push(fig(
            &format!("granularity_{tag}_first_context_mean_ms"),
            mean,
            "ms",
            Better::Lower,
        ));
        figs.push(fig(
            &format!("granularity_{tag}_first_context_max_ms"),
            max,
            "ms",
            Better::Lower,
        ));
        figs.push(fig(
            &format!("granularity_{tag}_{n}procs_contexts_from_connect_ms"),
            all_ms,
            "ms",
            Better::Lower,
        ));
        figs.push(fig(
            &format!("granularity_{tag}_{n}procs_workers"),
            workers as f64,
            "count",
            Better::Lower,
        ));
        if let (Some(a), Some(b)) = (used0, used1) {
            figs.push(fig(
                &format!("granularity_{tag}_{n}procs_device_mib"),
                b - a,
                "MiB",
                Better::Lower,
            ));
            let per_worker = (b - a) / workers.max(1) as f64;
            figs.push(fig(
                &format!("granularity_{tag}_device_mib_per_worker"),
                per_worker,
                "MiB",
                Better::Lower,
            ));
            // Each worker allocates the VM's whole VRAM quota when it starts; the rest is
            // its CUDA context.
            let vram_mib = (RIG_VM_VRAM.min(gpu.gpu.info().vram_bytes) >> 20) as f64;
            figs.push(fig(
                &format!("granularity_{tag}_device_mib_per_worker_beyond_vram"),
                per_worker - vram_mib,
                "MiB",
                Better::Lower,
            ));
        }
        let spawn = |pid: u32| {
            Tenant::spawn(rig.vms[0].clone(), TenantSpec::throttle(pid, MS))
                .map_err(|e| CudaSuiteError::Backend(e.to_string()))
        };
        let stop = |t: Tenant| t.stop().map_err(|e| CudaSuiteError::Backend(e.to_string()));
        let one = vec![spawn(100)?];
        let alone = busy_share(&one, opts.fairness_secs);
        for t in one {
            stop(t)?;
        }
        let many = (0..n)
            .map(|i| spawn(200 + i))
            .collect::<Result<Vec<_>, _>>()?;
        let together = busy_share(&many, opts.fairness_secs);
        for t in many {
            stop(t)?;
        }
        figs.push(fig(
            &format!("granularity_{tag}_1proc_kernel_time"),
            alone,
            "%",
            Better::Higher,
        ));
        figs.push(fig(
            &format!("granularity_{tag}_{n}procs_kernel_time"),
            together,
            "%",
            Better::Higher,
        ));
        figs.push(fig(
            &format!("granularity_{tag}_{n}procs_over_1proc"),
            if alone > 0.0 { together / alone } else { 0.0 },
            "ratio",
            Better::Higher,
        ));
    }
    Ok(figs)
}
