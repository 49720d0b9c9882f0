//! Back-to-back empty kernels (`--only b2b`): vgpu native, the VM between two runs of
//! CUDA's own launches in this process and, with a baseline program, CUDA native, in
//! paired rounds; with `--time-frontend`, where the front end's host time per GP entry
//! goes.

use super::*;
use crate::suites::measure::{max, median, min};

/// Back-to-back empty kernels, `per_entry` to a GP entry (each entry with its fence);
/// kernels per second.
pub(super) fn b2b_rate(
    ctx: &vgpu_guest::Context,
    kernels: u32,
    per_entry: u32,
) -> Result<f64, vgpu_guest::Error> {
    let mut ch = ctx.create_channel()?;
    ch.launch(&KernelArgs::Empty, [1, 1, 1])?;
    let f = ch.submit()?;
    ch.wait(f)?;
    let t0 = Instant::now();
    let mut last = None;
    for i in 0..kernels {
        ch.launch(&KernelArgs::Empty, [1, 1, 1])?;
        if (i + 1) % per_entry.max(1) == 0 || i + 1 == kernels {
            last = Some(ch.submit()?);
        }
    }
    if let Some(f) = last {
        ch.wait(f)?;
    }
    Ok(kernels as f64 / t0.elapsed().as_secs_f64())
}

/// Back-to-back empty kernels: vgpu native and the VM and, with a baseline program, CUDA
/// native, in `b2b_rounds` rounds of one after the other. The host's launch rate swings
/// between runs (CUDA's own from 198 k to 334 k per s on the lent H100, 2026-11-26), so
/// the ratio is taken within each round and the median of the rounds reported.
pub(super) fn b2b<D: CudaDeviceTrait>(
    gpu: &CudaGpuOf<D>,
    nctx: &vgpu_guest::Context,
    gctx: &vgpu_guest::Context,
    opts: &CudaOpts,
) -> Result<Vec<Figure>, CudaSuiteError> {
    let rounds = opts.b2b_rounds.max(1);
    let (mut rn, mut rg, mut rc, mut ratios) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut rd, mut direct_ratios) = (Vec::new(), Vec::new());
    let direct = || {
        gpu.direct_b2b_rate(opts.b2b_kernels)
            .map_err(|e| CudaSuiteError::Backend(e.to_string()))
    };
    let (mut entries, mut marks) = (0, 0);
    let mut parts = [0u64; 4];
    for _ in 0..rounds {
        let cuda = match &opts.baseline {
            Some(path) => baseline_b2b(path, opts)?,
            None => None,
        };
        // vgpu native runs on this process's GPU: its front end's batching is counted.
        let c0 = gpu.frontend_counts();
        rn.push(b2b_rate(nctx, opts.b2b_kernels, 1)?);
        let c1 = gpu.frontend_counts();
        entries += c1.entries - c0.entries;
        marks += c1.end_marks - c0.end_marks;
        for (p, (a, b)) in parts.iter_mut().zip([
            (c0.fetch_plan_ns, c1.fetch_plan_ns),
            (c0.issue_ns, c1.issue_ns),
            (c0.mark_ns, c1.mark_ns),
            (c0.retire_ns, c1.retire_ns),
        ]) {
            *p += b - a;
        }
        // CUDA's own launches in this process right before and after the VM's: the
        // host's launch rate swings between runs and within one (215–337 k kernels/s for
        // the native program on one H100, 2026-12-07), and this pairs the VM with it
        // within milliseconds.
        let before = direct()?;
        let vm = b2b_rate(gctx, opts.b2b_kernels, 1)?;
        let after = direct()?;
        let d = (before + after) / 2.0;
        rd.push(d);
        direct_ratios.push(vm / d);
        rg.push(vm);
        if let Some(c) = cuda {
            rc.push(c);
            ratios.push(vm / c);
        }
    }
    // The same kernels 32 to a GP entry: the cost of the per-entry work (one fence each).
    let grouped = b2b_rate(gctx, opts.b2b_kernels, 32)?;
    let mut figs = vec![
        fig(
            "b2b_empty_kernels_vm_32_per_entry",
            grouped,
            "kernels/s",
            Better::Higher,
        ),
        fig(
            "b2b_empty_kernels_vgpu_native",
            median(&mut rn),
            "kernels/s",
            Better::Higher,
        ),
        fig(
            "b2b_empty_kernels_vm",
            median(&mut rg),
            "kernels/s",
            Better::Higher,
        ),
        fig("b2b_rounds", f64::from(rounds), "rounds", Better::Higher),
        fig(
            "b2b_vgpu_native_entries_per_mark",
            entries as f64 / marks.max(1) as f64,
            "entries",
            Better::Higher,
        ),
    ];
    if opts.time_frontend {
        // Where the front end's host time per entry went, vgpu native's runs.
        for (name, ns) in ["fetch_plan", "issue", "mark", "retire"].iter().zip(parts) {
            figs.push(fig(
                &format!("b2b_vgpu_native_frontend_{name}_ns_per_entry"),
                ns as f64 / entries.max(1) as f64,
                "ns",
                Better::Lower,
            ));
        }
    }
    let (lo, hi) = (min(&direct_ratios), max(&direct_ratios));
    figs.extend([
        fig(
            "b2b_cuda_direct_kernels_per_s",
            median(&mut rd),
            "kernels/s",
            Better::Higher,
        ),
        fig(
            "b2b_vm_vs_cuda_direct",
            median(&mut direct_ratios),
            "ratio",
            Better::Higher,
        )
        .target(0.9),
        fig("b2b_vm_vs_cuda_direct_min", lo, "ratio", Better::Higher),
        fig("b2b_vm_vs_cuda_direct_max", hi, "ratio", Better::Higher),
    ]);
    if !ratios.is_empty() {
        figs.push(fig(
            "b2b_paired_cuda_native_kernels_per_s",
            median(&mut rc),
            "kernels/s",
            Better::Higher,
        ));
        let (lo, hi) = (min(&ratios), max(&ratios));
        figs.push(
            fig(
                "b2b_paired_vm_vs_cuda_native",
                median(&mut ratios),
                "ratio",
                Better::Higher,
            )
            .target(0.8),
        );
        figs.push(fig(
            "b2b_paired_vm_vs_cuda_native_min",
            lo,
            "ratio",
            Better::Higher,
        ));
        figs.push(fig(
            "b2b_paired_vm_vs_cuda_native_max",
            hi,
            "ratio",
            Better::Higher,
        ));
    }
    Ok(figs)
}

/// One back-to-back run of the baseline program (`--only b2b`): kernels per second.
pub(super) fn baseline_b2b(path: &PathBuf, opts: &CudaOpts) -> Result<Option<f64>, CudaSuiteError> {
    let one = CudaOpts {
        only: vec![Section::B2b],
        ..opts.clone()
    };
    Ok(baseline(path, &one)?
        .iter()
        .find(|f| f.name == "cuda_native_b2b_empty_kernels_per_s")
        .map(|f| f.value))
}

#[cfg(test)]
mod tests {
    use super::super::{fake_section_figures, Section};

    /// On the fake device: CUDA's own back-to-back rate is measured beside the VM's in
    /// every round, and the VM's ratio to it lies within its rounds' range.
    #[test]
    fn pairs_the_vm_with_cudas_own_launches_on_the_fake_device() {
        let get = fake_section_figures(Section::B2b);
        let direct = get("b2b_cuda_direct_kernels_per_s");
        assert!(direct > 0.0, "direct {direct} kernels/s");
        let (lo, mid, hi) = (
            get("b2b_vm_vs_cuda_direct_min"),
            get("b2b_vm_vs_cuda_direct"),
            get("b2b_vm_vs_cuda_direct_max"),
        );
        assert!(lo > 0.0 && lo <= mid && mid <= hi, "{lo} {mid} {hi}");
    }
}
