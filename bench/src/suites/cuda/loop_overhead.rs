//! Where a short loop's time goes (`vgpu-bench cuda --only loop-overhead`): the standard
//! sgemm loop (1024³ × 2, 0.3 ms of kernels on the H100, where VM ÷ native CUDA is
//! furthest from 1) timed in the VM in three ways, with `TIMESTAMP` kernels before the
//! first and after the last sgemm. From them: publish → first kernel start (the front
//! end's wake and launch), the GPU span, and last kernel end → the guest seeing its
//! fence. The three ways tell apart what a loop pays always (`warm`: the same channel,
//! loops back to back), after the GPU and the front end idled (`idle`: 200 ms asleep
//! before each loop, as the workloads' CPU reference idles them), and for a channel of
//! its own (`fresh`: a new channel per loop, as each workload run makes one). The saxpy
//! loop (2²⁴ × 50) likewise, and with a stamp before every kernel (its steps' GPU times).

use std::time::Duration;

use vgpu_guest::clock::now_ns;
use vgpu_guest::{Context, KernelArgs};

use super::{fig, CudaSuiteError};
use crate::report::{Better, Figure};
use crate::suites::measure::median;

/// The loop's size, loops per way and the idle way's sleep: the standard ones, or
/// small ones (`--quick`, the fake device in tests).
fn sizes(small: bool) -> (u32, usize, Duration) {
    if small {
        (48, 4, Duration::from_millis(20))
    } else {
        (1024, 15, Duration::from_millis(200))
    }
}

/// Reads one part of a loop's [`Parts`].
type PartOf = fn(&Parts) -> f64;

/// One loop's parts, in µs.
struct Parts {
    wall: f64,
    start_lag: f64,
    gpu_span: f64,
    seen_lag: f64,
}

impl Parts {
    /// From the host clock (ns) at the loop's start, its first entry's publish and the
    /// fence seen, and the GPU's stamps of the first and last kernel.
    fn from_times(t0: u64, published: u64, first: u64, last: u64, seen: u64) -> Self {
        let us = |a: u64, b: u64| b.saturating_sub(a) as f64 / 1e3;
        Parts {
            wall: us(t0, seen),
            start_lag: us(published, first),
            gpu_span: us(first, last),
            seen_lag: us(last, seen),
        }
    }

    /// The median of each part over `loops`, as figures `{prefix}_{part}_us`.
    fn medians(loops: &[Parts], prefix: &str) -> Vec<Figure> {
        let parts: [(&str, PartOf); 4] = [
            ("wall", |p| p.wall),
            ("start_lag", |p| p.start_lag),
            ("gpu_span", |p| p.gpu_span),
            ("seen_lag", |p| p.seen_lag),
        ];
        parts
            .into_iter()
            .map(|(part, get)| {
                let mut v: Vec<f64> = loops.iter().map(get).collect();
                fig(
                    &format!("{prefix}_{part}_us"),
                    median(&mut v),
                    "us",
                    Better::Lower,
                )
            })
            .collect()
    }
}

fn one_loop(
    ch: &mut vgpu_guest::Channel,
    args: &KernelArgs,
    side: u32,
    ts: &vgpu_guest::Buffer,
) -> Result<Parts, CudaSuiteError> {
    let grid = [side.div_ceil(16), side.div_ceil(16), 1];
    ch.set_stamp_publish(true);
    let t0 = now_ns();
    ch.launch(&KernelArgs::Timestamp { dst: ts.gpu_va() }, [1, 1, 1])?;
    ch.launch(args, grid)?;
    ch.submit()?;
    let published = ch.last_publish_ns();
    ch.launch(args, grid)?;
    ch.launch(
        &KernelArgs::Timestamp {
            dst: ts.gpu_va() + 8,
        },
        [1, 1, 1],
    )?;
    let f = ch.submit()?;
    ch.wait(f)?;
    let seen = now_ns();
    let (first, last) = (ts.read_u64(0)?, ts.read_u64(8)?);
    Ok(Parts::from_times(t0, published, first, last, seen))
}

/// The figures of the three ways, each the median over its loops.
pub(super) fn loop_overhead(
    ctx: &Context,
    tag: &str,
    small: bool,
) -> Result<Vec<Figure>, CudaSuiteError> {
    let (side, loops, idle) = sizes(small);
    let n = u64::from(side) * u64::from(side);
    let bufs = (0..3)
        .map(|_| ctx.alloc_vram(n * 4))
        .collect::<Result<Vec<_>, _>>()?;
    for b in &bufs {
        b.write_f32(0, &vec![0.5; n as usize])?;
    }
    let ts = ctx.alloc_host(4096)?;
    let args = KernelArgs::Sgemm {
        a: bufs[0].gpu_va(),
        b: bufs[1].gpu_va(),
        c: bufs[2].gpu_va(),
        m: side,
        n: side,
        k: side,
        alpha: 1.0,
        beta: 0.5,
    };
    let mut figs = Vec::new();
    for way in ["warm", "idle", "fresh"] {
        let mut ch = ctx.create_channel()?;
        one_loop(&mut ch, &args, side, &ts)?;
        let mut parts = Vec::new();
        for _ in 0..loops {
            match way {
                "idle" => std::thread::sleep(idle),
                "fresh" => ch = ctx.create_channel()?,
                _ => {}
            }
            parts.push(one_loop(&mut ch, &args, side, &ts)?);
        }
        figs.extend(Parts::medians(&parts, &format!("loop_{tag}_{way}")));
    }
    figs.extend(saxpy_loops(ctx, tag, small)?);
    Ok(figs)
}

/// The standard saxpy loop (2²⁴ × 50; 8 × 4,099 when small) between two `TIMESTAMP`
/// kernels, on a warm channel and on a new channel per loop (as each workload run makes
/// one), and once more with a stamp before every saxpy: how long each step takes on the
/// GPU. The native baseline's `--only loop-overhead` times the same loops
/// (`cuda_native_loop_saxpy_*`), so the two GPU spans and step times compare side by side.
fn saxpy_loops(ctx: &Context, tag: &str, small: bool) -> Result<Vec<Figure>, CudaSuiteError> {
    let (n, iters, loops) = if small {
        (4099u64, 8u64, 3)
    } else {
        (1u64 << 24, 50, 15)
    };
    let x = ctx.alloc_vram(n * 4)?;
    let y = ctx.alloc_vram(n * 4)?;
    x.write_f32(0, &vec![0.5; n as usize])?;
    y.write_f32(0, &vec![0.25; n as usize])?;
    let ts = ctx.alloc_host(8 * (iters + 2))?;
    let args = KernelArgs::Saxpy {
        x: x.gpu_va(),
        y: y.gpu_va(),
        n,
        a: 0.5,
    };
    let grid = [n.div_ceil(256).min(u64::from(u32::MAX)) as u32, 1, 1];
    let stamp = |i: u64| KernelArgs::Timestamp {
        dst: ts.gpu_va() + 8 * i,
    };
    let mut figs = Vec::new();
    for way in ["warm", "fresh"] {
        let mut ch = ctx.create_channel()?;
        let mut parts = Vec::new();
        for l in 0..=loops {
            if way == "fresh" && l > 0 {
                ch = ctx.create_channel()?;
            }
            ch.set_stamp_publish(true);
            let t0 = now_ns();
            ch.launch(&stamp(0), [1, 1, 1])?;
            ch.launch(&args, grid)?;
            ch.submit()?;
            let published = ch.last_publish_ns();
            for _ in 1..iters {
                ch.launch(&args, grid)?;
                ch.submit()?;
            }
            ch.launch(&stamp(1), [1, 1, 1])?;
            let f = ch.submit()?;
            ch.wait(f)?;
            let seen = now_ns();
            let (first, last) = (ts.read_u64(0)?, ts.read_u64(8)?);
            if l > 0 {
                parts.push(Parts::from_times(t0, published, first, last, seen));
            }
        }
        figs.extend(Parts::medians(&parts, &format!("loop_{tag}_saxpy_{way}")));
    }
    // A stamp before every saxpy, each pair one GP entry, on one warm channel.
    let mut ch = ctx.create_channel()?;
    let mut steps = Vec::new();
    for l in 0..=loops {
        for i in 0..iters {
            ch.launch(&stamp(i), [1, 1, 1])?;
            ch.launch(&args, grid)?;
            ch.submit()?;
        }
        ch.launch(&stamp(iters), [1, 1, 1])?;
        let f = ch.submit()?;
        ch.wait(f)?;
        if l > 0 {
            let mut prev = ts.read_u64(0)?;
            for i in 1..=iters {
                let t = ts.read_u64(8 * i)?;
                steps.push(t.saturating_sub(prev) as f64 / 1e3);
                prev = t;
            }
        }
    }
    steps.sort_by(f64::total_cmp);
    let at = |q: usize| steps[(steps.len() * q / 100).min(steps.len() - 1)];
    for (name, v) in [
        ("p10", at(10)),
        ("p50", at(50)),
        ("p90", at(90)),
        ("max", at(100)),
    ] {
        figs.push(fig(
            &format!("loop_{tag}_saxpy_step_{name}_us"),
            v,
            "us",
            Better::Lower,
        ));
    }
    Ok(figs)
}

#[cfg(test)]
mod tests {
    use super::super::{fake_section_figures, Section};

    /// On the fake device: every part of every way is there, and each loop's wall time
    /// holds its GPU span (the timestamps were read back, not left at zero).
    #[test]
    fn splits_the_loop_on_the_fake_device() {
        let get = fake_section_figures(Section::LoopOverhead);
        for tag in ["vgpu_native", "vm"] {
            for way in ["warm", "idle", "fresh"] {
                let p = |part: &str| get(&format!("loop_{tag}_{way}_{part}_us"));
                let (wall, span) = (p("wall"), p("gpu_span"));
                assert!(span > 0.0, "{tag} {way}: no GPU span");
                assert!(wall >= span, "{tag} {way}: wall {wall} < span {span}");
                assert!(p("start_lag").is_finite() && p("seen_lag").is_finite());
            }
            for way in ["warm", "fresh"] {
                let p = |part: &str| get(&format!("loop_{tag}_saxpy_{way}_{part}_us"));
                assert!(p("gpu_span") > 0.0, "{tag} saxpy {way}: no GPU span");
                assert!(p("wall") >= p("gpu_span"), "{tag} saxpy {way}");
            }
            let step = |q: &str| get(&format!("loop_{tag}_saxpy_step_{q}_us"));
            assert!(
                step("p10") > 0.0 && step("p10") <= step("p50"),
                "{tag} steps"
            );
            assert!(
                step("p50") <= step("p90") && step("p90") <= step("max"),
                "{tag}"
            );
        }
    }
}
