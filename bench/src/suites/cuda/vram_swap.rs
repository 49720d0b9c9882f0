//! VRAM swap on vgpu itself (`--only swap`): eviction, kernels on evicted memory,
//! swap-in, each step verified.

use super::*;

/// VRAM swapping on vgpu itself: a VM's buffers are written and computed on, then
/// evicted 64 MiB at a time by the backend (device→host copies into the VM's swap memory,
/// page tables retargeted), computed on while evicted (kernels read host memory), swapped
/// back in, and verified bit-exactly after each step.
pub(super) fn vram_swap(gpu: &VmGpus, small: bool) -> Result<Vec<Figure>, CudaSuiteError> {
    const VM: &str = "swap";
    let step: u64 = if small { 4 << 20 } else { 64 << 20 };
    let rounds = 4u64;
    let rig = Rig::new(gpu, &[VM], 256 << 20)?;
    let be = rig.backend.clone();
    let manual = VramConfig {
        enabled: false,
        batch_bytes: step,
        ..VramConfig::default()
    };
    be.set_vram_config(manual)
        .map_err(|e| CudaSuiteError::Backend(e.to_string()))?;
    let dev = Device::loopback(rig.vms[0].clone(), 1)?;
    let ctx = dev.create_context()?;
    let n = step / 4;
    let data = |seed: u64| -> Vec<f32> {
        (0..n)
            .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 1024) as f32 * 0.25)
            .collect()
    };
    // x: what gets evicted (allocated first: the coldest); y: the result.
    let xs: Vec<_> = (0..rounds)
        .map(|_| ctx.alloc_vram(step))
        .collect::<Result<_, _>>()?;
    let x0 = data(1);
    for x in &xs {
        x.write_f32(0, &x0)?;
    }
    let y = ctx.alloc_vram(step)?;
    let mut ch = ctx.create_channel()?;
    let saxpy_ms = |ch: &mut vgpu_guest::Channel, reps: u32| -> Result<f64, CudaSuiteError> {
        y.write_f32(0, &vec![0.0; n as usize])?;
        let t = Instant::now();
        for _ in 0..reps {
            ch.launch(
                &KernelArgs::Saxpy {
                    x: xs[0].gpu_va(),
                    y: y.gpu_va(),
                    n,
                    a: 1.0,
                },
                [(n as u32).div_ceil(256), 1, 1],
            )?;
        }
        ch.finish()?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let want: Vec<f32> = x0.iter().map(|v| v * reps as f32).collect();
        if y.read_f32_vec(0, n as usize)? != want {
            return Err(CudaSuiteError::Backend(
                "saxpy over swapped VRAM differs".into(),
            ));
        }
        Ok(ms)
    };
    saxpy_ms(&mut ch, 2)?;
    let resident = saxpy_ms(&mut ch, 10)?;
    let (mut pauses, mut copy_ns, mut bytes) = (Vec::new(), 0u64, 0u64);
    for _ in 0..rounds {
        let r = be
            .vram_evict(VM, step)
            .map_err(|e| CudaSuiteError::Backend(e.to_string()))?;
        pauses.push(r.pause_ns as f64 / 1e6);
        copy_ns += r.copy_ns;
        bytes += r.bytes;
    }
    let swapped = be
        .vram_stats(VM)
        .map(|r| r.vm.swapped_bytes)
        .unwrap_or_default();
    let evicted = saxpy_ms(&mut ch, 10)?;
    for x in &xs {
        if x.read_f32_vec(0, n as usize)? != x0 {
            return Err(CudaSuiteError::Backend("evicted VRAM differs".into()));
        }
    }
    be.set_vram_config(VramConfig::default())
        .map_err(|e| CudaSuiteError::Backend(e.to_string()))?;
    let t = Instant::now();
    let mut passes = 0;
    while be.vram_stats(VM).is_some_and(|r| r.vm.swapped_bytes > 0) && passes < 1000 {
        be.vram_rebalance();
        passes += 1;
    }
    let swap_in_s = t.elapsed().as_secs_f64();
    let back = be.vram_stats(VM).map(|r| r.vm).unwrap_or_default();
    let again = saxpy_ms(&mut ch, 10)?;
    pauses.sort_by(f64::total_cmp);
    let gbs = |b: u64, s: f64| b as f64 / s.max(1e-9) / 1e9;
    let tag = step >> 20;
    Ok(vec![
        fig(
            "vram_evicted_bytes",
            swapped as f64 / 1048576.0,
            "MiB",
            Better::Higher,
        ),
        fig(
            "vram_evict_gb_per_s",
            gbs(bytes, copy_ns as f64 / 1e9),
            "GB/s",
            Better::Higher,
        ),
        fig(
            &format!("vram_evict_pause_{tag}mib_p50_ms"),
            pauses.get(pauses.len() / 2).copied().unwrap_or(0.0),
            "ms",
            Better::Lower,
        )
        .target(5.0),
        fig(
            &format!("vram_evict_pause_{tag}mib_max_ms"),
            pauses.last().copied().unwrap_or(0.0),
            "ms",
            Better::Lower,
        ),
        fig(
            "vram_swap_in_gb_per_s",
            gbs(back.bytes_in, swap_in_s),
            "GB/s",
            Better::Higher,
        ),
        fig(
            &format!("saxpy_{tag}mib_resident_ms"),
            resident,
            "ms",
            Better::Lower,
        ),
        fig(
            &format!("saxpy_{tag}mib_evicted_ms"),
            evicted,
            "ms",
            Better::Lower,
        ),
        fig(
            &format!("saxpy_{tag}mib_after_swap_in_ms"),
            again,
            "ms",
            Better::Lower,
        ),
        fig(
            "hot_set_evicted_slowdown",
            evicted / resident.max(1e-9),
            "ratio",
            Better::Lower,
        ),
        fig("vram_swap_verified_bit_exact", 1.0, "bool", Better::Higher),
    ])
}
