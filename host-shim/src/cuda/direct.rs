//! CUDA's own launch → kernel start, measured inside this process: a TIMESTAMP kernel
//! launched straight on a stream of the GPU's context, with no front end in between.
//! The benchmarks put the VM's submit → start beside it, on the same clock calibration
//! and within the same second. A separate native program's figure is measured seconds
//! apart, with a calibration of its own, and drifts by microseconds between runs (its
//! launch call alone took 3.1–5.9 µs p50 per run on one H100, 2026-12-07).

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

/// One launch, waited for by polling its mark (CUDA's synchronize spins too).
fn one_sample<D: Device>(dev: &D, stream: &D::Stream, ptr: u64) -> Result<i64, DeviceError> {
    let t0 = now_ns();
    dev.issue(stream, &Op::Timestamp { ptr }, None)?;
    let done = dev.mark_untimed(stream)?;
    let deadline = t0.saturating_add(SAMPLE_TIMEOUT.as_nanos() as u64);
    while !dev.reached(&done)? {
        if now_ns() > deadline {
            return Err(DeviceError::Driver {
                call: "launch_to_start",
                code: format!("no kernel start within {SAMPLE_TIMEOUT:?}"),
            });
        }
        std::hint::spin_loop();
    }
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
}
