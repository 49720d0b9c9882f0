//! The native CUDA baseline program (`bench/cuda-native`): its figures, and the ratios
//! of ours to them.

use super::*;

/// Runs the native CUDA baseline program and turns its `name value unit` lines into figures.
pub(super) fn baseline(path: &PathBuf, opts: &CudaOpts) -> Result<Vec<Figure>, CudaSuiteError> {
    let mut cmd = Command::new(path);
    if opts.small {
        cmd.arg("--quick");
    }
    if opts.large {
        cmd.arg("--large");
    }
    if !opts.only.is_empty() {
        // The baseline has no workers: no granularity section.
        let names: Vec<&str> = opts
            .only
            .iter()
            .filter(|s| **s != Section::Granularity)
            .map(|s| s.arg())
            .collect();
        cmd.arg("--only").arg(names.join(","));
    }
    if !opts.workloads.is_empty() {
        cmd.arg("--workloads").arg(opts.workloads.join(","));
    }
    let out = cmd
        .output()
        .map_err(|e| CudaSuiteError::Baseline(format!("{}: {e}", path.display())))?;
    if !out.status.success() {
        return Err(CudaSuiteError::Baseline(format!(
            "{} exited with {}: {}",
            path.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    let mut figs = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let parts: Vec<&str> = line.split_whitespace().collect();
        if let [name, value, unit] = parts[..] {
            if let Ok(v) = value.parse::<f64>() {
                let better = if unit.contains("/s") {
                    Better::Higher
                } else {
                    Better::Lower
                };
                figs.push(fig(&format!("cuda_native_{name}"), v, unit, better));
            }
        }
    }
    Ok(figs)
}

/// Ratios of our figures to the baseline's where both exist.
pub(super) fn ratios(figs: &[Figure]) -> Vec<Figure> {
    let get = |n: &str| figs.iter().find(|f| f.name == n).map(|f| f.value);
    let mut out = Vec::new();
    for w in Workload::NAMES {
        for place in ["device", "pinned"] {
            if let (Some(vm), Some(nat)) = (
                get(&format!("{w}_vm_ms")),
                get(&format!("cuda_native_{w}_{place}_ms")),
            ) {
                out.push(fig(
                    &format!("{w}_vm_vs_cuda_native_{place}"),
                    vm / nat,
                    "ratio",
                    Better::Lower,
                ));
            }
        }
    }
    if let (Some(vm), Some(nat)) = (
        get("submit_to_kernel_start_p50_vm"),
        get("cuda_native_launch_to_kernel_start_p50_us"),
    ) {
        out.push(
            fig(
                "submit_latency_vm_minus_cuda_native_p50",
                vm - nat,
                "us",
                Better::Lower,
            )
            .target(3.0),
        );
    }
    if let (Some(vm), Some(nat)) = (
        get("vram_evict_gb_per_s"),
        get("cuda_native_swap_plain_dtoh_64mib_gb_per_s"),
    ) {
        out.push(
            fig(
                "vram_evict_vs_plain_dtoh_copy",
                vm / nat,
                "ratio",
                Better::Higher,
            )
            .target(0.8),
        );
    }
    if let (Some(vm), Some(nat)) = (
        get("vram_swap_in_gb_per_s"),
        get("cuda_native_swap_plain_htod_64mib_gb_per_s"),
    ) {
        out.push(fig(
            "vram_swap_in_vs_plain_htod_copy",
            vm / nat,
            "ratio",
            Better::Higher,
        ));
    }
    // The paired rounds' median where they ran (see `b2b`), else one run against the other.
    if let Some(r) = get("b2b_paired_vm_vs_cuda_native") {
        out.push(fig("b2b_vm_vs_cuda_native", r, "ratio", Better::Higher).target(0.8));
    } else if let (Some(vm), Some(nat)) = (
        get("b2b_empty_kernels_vm"),
        get("cuda_native_b2b_empty_kernels_per_s"),
    ) {
        out.push(fig("b2b_vm_vs_cuda_native", vm / nat, "ratio", Better::Higher).target(0.8));
    }
    out
}
