//! A long wait's cost to the waiter (`vgpu-bench cuda --only long-wait`, issue 34): one
//! kernel spinning for `ms` with a `TIMESTAMP` kernel after it, waited for in two ways
//! on the same channel, alternating: `naps` (the wait naps in slices of at most 100 µs
//! to the end) and `event` (past 10 ms it sleeps until the GPU's fence wake-up, a
//! device event). Per way, medians over the waits: the waiting thread's CPU time and
//! how long after the kernel's end the waiter saw its fence.

use vgpu_guest::clock::now_ns;
use vgpu_guest::{Context, KernelArgs};
use vgpu_host_shim::clock::thread_cpu_ns;

use super::{fig, CudaSuiteError};
use crate::report::{Better, Figure};
use crate::suites::measure::median;

/// The kernel's length and how many waits each way takes: standard, or small
/// (`--quick`, the fake device in tests).
fn sizes(small: bool) -> (u64, usize) {
    if small {
        (25, 3)
    } else {
        (200, 7)
    }
}

/// The figures of both ways on `ctx`, named `long_wait_{tag}_{way}_…`.
pub(super) fn long_wait(
    ctx: &Context,
    tag: &str,
    small: bool,
) -> Result<Vec<Figure>, CudaSuiteError> {
    let (ms, waits) = sizes(small);
    let ts = ctx.alloc_host(4096)?;
    let mut ch = ctx.create_channel()?;
    let (mut cpu, mut lag) = ([Vec::new(), Vec::new()], [Vec::new(), Vec::new()]);
    for i in 0..2 * waits {
        let way = i % 2;
        ch.set_sleep_on_events(way == 1);
        ch.launch(&KernelArgs::Spin { ns: ms * 1_000_000 }, [1, 1, 1])?;
        ch.launch(&KernelArgs::Timestamp { dst: ts.gpu_va() }, [1, 1, 1])?;
        let f = ch.submit()?;
        let c0 = thread_cpu_ns();
        ch.wait(f)?;
        let (seen, c1) = (now_ns(), thread_cpu_ns());
        let end = ts.read_u64(0)?;
        cpu[way].push((c1 - c0) as f64 / 1e3);
        lag[way].push(seen.saturating_sub(end) as f64 / 1e3);
    }
    let mut figs = vec![fig(
        &format!("long_wait_{tag}_kernel_ms"),
        ms as f64,
        "ms",
        Better::Lower,
    )];
    for (way, name) in ["naps", "event"].iter().enumerate() {
        figs.push(fig(
            &format!("long_wait_{tag}_{name}_waiter_cpu_us"),
            median(&mut cpu[way]),
            "us",
            Better::Lower,
        ));
        figs.push(fig(
            &format!("long_wait_{tag}_{name}_seen_lag_us"),
            median(&mut lag[way]),
            "us",
            Better::Lower,
        ));
    }
    let (sleeps, woken) = ch.fence_sleeps();
    figs.push(fig(
        &format!("long_wait_{tag}_event_sleeps"),
        sleeps as f64,
        "sleeps",
        Better::Lower,
    ));
    figs.push(fig(
        &format!("long_wait_{tag}_event_sleeps_woken"),
        woken as f64,
        "sleeps",
        Better::Higher,
    ));
    Ok(figs)
}

#[cfg(test)]
mod tests {
    use super::super::{fake_section_figures, Section};

    /// On the fake device: both ways ran, in the VM and natively, and the event way's
    /// sleeps were ended by the GPU's wake-up, not by running out (a 25 ms kernel: the
    /// wait blocks from 10 ms on, for up to 20 ms; a wait may still see its REF at a
    /// sleep's end just before the event, so 2 of the 3 waits are asked for).
    #[test]
    fn long_waits_are_woken_by_the_gpu_on_the_fake_device() {
        let get = fake_section_figures(Section::LongWait);
        for tag in ["vm", "vgpu_native"] {
            for way in ["naps", "event"] {
                assert!(get(&format!("long_wait_{tag}_{way}_waiter_cpu_us")) > 0.0);
            }
            let woken = get(&format!("long_wait_{tag}_event_sleeps_woken"));
            assert!(woken >= 2.0, "{tag}: {woken} of 3 event waits woken");
        }
    }
}
