//! The native CUDA baseline program (`bench/cuda-native`): its figures, and the ratios
//! of ours to them.

use super::*;

/// Runs the native CUDA baseline program and turns its `name value unit` lines into figures.
pub(super) fn baseline(path: &PathBuf, opts: &CudaOpts) -> Result<Vec<Figure>, CudaSuiteError> {
    baseline_named(path, opts, "cuda_native_", &[])
}

/// How long the baseline idles before each timed loop in its second workloads run: the
/// VM's timed loops each follow the previous run's untimed CPU reference and its input
/// upload (hundreds of ms without GPU work), and the GPU's clocks ramp down within
/// ~20 ms of idle (H100, 2026-11-27: sgemm 1024³ +40 µs after 20–200 ms idle).
pub const BASELINE_IDLE_MS: u32 = 100;

/// The baseline's workloads again, each timed loop after [`BASELINE_IDLE_MS`] of idle
/// (`--idle-ms`), as the VM's loops run: figures `cuda_native_after_idle_*`.
pub(super) fn baseline_after_idle(
    path: &PathBuf,
    opts: &CudaOpts,
) -> Result<Vec<Figure>, CudaSuiteError> {
    let workloads = CudaOpts {
        only: vec![Section::Workloads],
        ..opts.clone()
    };
    let idle = BASELINE_IDLE_MS.to_string();
    baseline_named(
        path,
        &workloads,
        "cuda_native_after_idle_",
        &["--idle-ms", &idle],
    )
}

/// Runs the baseline with `extra` arguments; its figures are named `prefix` + its name.
fn baseline_named(
    path: &PathBuf,
    opts: &CudaOpts,
    prefix: &str,
    extra: &[&str],
) -> Result<Vec<Figure>, CudaSuiteError> {
    let mut cmd = Command::new(path);
    cmd.args(extra);
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
                figs.push(fig(&format!("{prefix}{name}"), v, unit, better));
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
            // Against the baseline idling before each loop as the VM's loops do.
            if let (Some(vm), Some(nat)) = (
                get(&format!("{w}_vm_ms")),
                get(&format!("cuda_native_after_idle_{w}_{place}_ms")),
            ) {
                out.push(fig(
                    &format!("{w}_vm_vs_cuda_native_after_idle_{place}"),
                    vm / nat,
                    "ratio",
                    Better::Lower,
                ));
            }
        }
    }
    // Issue 34's target: the VM's submit → start within 2 µs of CUDA's launch → start.
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
            .target(2.0),
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// The baseline program's lines become `cuda_native_*` figures, its second workloads
    /// run (with `--idle-ms`) `cuda_native_after_idle_*` ones, and the VM's times get a
    /// ratio to each: a stand-in program that answers by its arguments.
    #[test]
    fn the_baseline_runs_twice_and_each_run_gets_its_ratio() {
        let dir = std::env::temp_dir().join(format!("vgpu-baseline-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let prog = dir.join("native");
        std::fs::write(
            &prog,
            "#!/bin/sh\n\
             case \"$*\" in\n\
             *'--idle-ms 100'*'--only workloads'*) echo 'saxpy_device_ms 4.0 ms' ;;\n\
             *'--only workloads'*) echo 'saxpy_device_ms 3.8 ms'; echo 'junk'; echo 'x y z' ;;\n\
             *) exit 3 ;;\n\
             esac\n",
        )
        .unwrap();
        std::fs::set_permissions(&prog, std::fs::Permissions::from_mode(0o755)).unwrap();
        let opts = CudaOpts {
            only: vec![Section::Workloads],
            ..CudaOpts::quick(0)
        };
        let opts = CudaOpts {
            small: false,
            ..opts
        };
        let mut figs = baseline(&prog, &opts).unwrap();
        figs.extend(baseline_after_idle(&prog, &opts).unwrap());
        figs.push(fig("saxpy_vm_ms", 4.2, "ms", Better::Lower));
        let names: Vec<&str> = figs.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "cuda_native_saxpy_device_ms",
                "cuda_native_after_idle_saxpy_device_ms",
                "saxpy_vm_ms"
            ]
        );
        let r = ratios(&figs);
        let get = |n: &str| r.iter().find(|f| f.name == n).map(|f| f.value);
        let warm = get("saxpy_vm_vs_cuda_native_device").unwrap();
        let idle = get("saxpy_vm_vs_cuda_native_after_idle_device").unwrap();
        assert!((warm - 4.2 / 3.8).abs() < 1e-9, "{warm}");
        assert!((idle - 4.2 / 4.0).abs() < 1e-9, "{idle}");
        // A baseline that fails says so.
        let none = CudaOpts {
            only: vec![Section::Latency],
            ..opts
        };
        assert!(baseline(&prog, &none).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
