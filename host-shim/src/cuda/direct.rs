//! CUDA's own launches, measured inside this process: kernels launched straight on a
//! stream of the GPU's context, with no front end in between. Launch → kernel start (a
//! TIMESTAMP kernel), which the benchmarks put the VM's submit → start beside, on the
//! same clock calibration and within the same second; and the back-to-back launch rate
//! of empty kernels, which they interleave with the VM's. A separate native program's
//! figures are measured seconds apart and drift between runs (its launch call alone took
//! 3.1–5.9 µs p50 per run on one H100, 2026-12-07; its back-to-back rate 215–337 k
//! kernels/s between runs of one night).

use std::time::Duration;

use super::device::Device;
use super::error::DeviceError;
use super::plan::Op;
use crate::clock::now_ns;

/// Longest wait for one sample's kernel: a GPU that takes longer is not measured.
const SAMPLE_TIMEOUT: Duration = Duration::from_secs(10);

/// Launches before the samples, not counted (the VM's and the native program's skip as
/// many).
const WARMUP: u32 = 100;

/// Launch → start, ns, of `samples` TIMESTAMP kernels, each launched after the previous
/// one ended (as the VM's samples are submitted). Signed, as the VM's: the GPU clock's
/// mapping onto the host's may put a start before its launch.
pub(crate) fn launch_to_start<D: Device>(dev: &D, samples: u32) -> Result<Vec<i64>, DeviceError> {
    let stream = dev.create_stream()?;
    let ptr = dev.alloc_device(8)?;
    let res = (0..WARMUP + samples)
        .map(|_| one_sample(dev, &stream, ptr))
        .collect::<Result<Vec<i64>, DeviceError>>()
        .map(|mut v| v.split_off(WARMUP as usize));
    dev.free_device(ptr);
    res
}

/// Kernels per second of `kernels` empty kernels launched back to back on a stream of
/// the GPU's context (one launch call each, as CUDA's `<<<>>>` makes), from the first
/// launch to the last kernel's end seen, polled as CUDA's synchronize spins.
pub(crate) fn b2b_rate<D: Device>(dev: &D, kernels: u32) -> Result<f64, DeviceError> {
    let stream = dev.create_stream()?;
    let empty = Op::Launch(vgpu_protocol::KernelArgs::Empty);
    let t0 = now_ns();
    for _ in 0..kernels {
        dev.issue(&stream, &empty, None)?;
    }
    let done = dev.mark_untimed(&stream)?;
    wait_reached(dev, &done, t0)?;
    let secs = now_ns().saturating_sub(t0).max(1) as f64 / 1e9;
    Ok(f64::from(kernels) / secs)
}

/// Spins until `mark` is reached, or fails [`SAMPLE_TIMEOUT`] after `t0`.
fn wait_reached<D: Device>(dev: &D, mark: &D::Mark, t0: u64) -> Result<(), DeviceError> {
    let deadline = t0.saturating_add(SAMPLE_TIMEOUT.as_nanos() as u64);
    while !dev.reached(mark)? {
        if now_ns() > deadline {
            return Err(DeviceError::Driver {
                call: "direct",
                code: format!("the GPU did not finish within {SAMPLE_TIMEOUT:?}"),
            });
        }
        std::hint::spin_loop();
    }
    Ok(())
}

/// One launch, waited for by polling its mark (CUDA's synchronize spins too).
fn one_sample<D: Device>(dev: &D, stream: &D::Stream, ptr: u64) -> Result<i64, DeviceError> {
    let t0 = now_ns();
    dev.issue(stream, &Op::Timestamp { ptr }, None)?;
    let done = dev.mark_untimed(stream)?;
    wait_reached(dev, &done, t0)?;
    let mut stamp = [0u8; 8];
    // SAFETY: `stamp` is 8 writable bytes; `ptr` is this function's own 8-byte device
    // allocation, written by the kernel that has ended.
    unsafe { dev.copy_to_host(stamp.as_mut_ptr(), ptr, 8)? };
    // Two's complement: the wrapped difference read as signed.
    Ok(u64::from_le_bytes(stamp).wrapping_sub(t0) as i64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::fake::FakeDevice;

    /// Every sample's kernel wrote its stamp and it was read back: a stamp left at zero
    /// would give 0, one from an earlier sample would come before its launch.
    #[test]
    fn each_sample_reads_back_its_own_kernels_stamp() {
        let dev = FakeDevice::default();
        let t0 = now_ns();
        let v = launch_to_start(&dev, 50).expect("samples on the fake device");
        let wall = (now_ns() - t0) as i64;
        assert_eq!(v.len(), 50);
        assert!(v.iter().all(|&ns| ns > 0 && ns < wall), "{v:?}");
        assert!(
            dev.device_allocations().is_empty(),
            "the stamp's memory was freed"
        );
    }

    /// The rate is the kernels over a time within the call (at least the call's wall
    /// time gives a lower bound), and a poisoned context's launches fail it rather than
    /// count.
    #[test]
    fn back_to_back_rate_is_timed_within_the_call_and_fails_on_a_lost_context() {
        let dev = FakeDevice::default();
        let t0 = now_ns();
        let rate = b2b_rate(&dev, 200).expect("rate on the fake device");
        let wall = (now_ns() - t0) as f64 / 1e9;
        assert!(
            rate.is_finite() && rate >= 200.0 / wall,
            "{rate} kernels/s over {wall} s"
        );
        dev.poison();
        assert!(b2b_rate(&dev, 10).is_err());
    }
}
