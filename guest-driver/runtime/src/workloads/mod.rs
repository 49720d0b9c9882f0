//! Workloads shared by tools, tests and benchmarks: written once against the public API,
//! so they run unchanged over every transport.
//!
//! Each workload allocates what it needs in the given context, runs a timed loop of GPU
//! work, then checks the GPU's results against the CPU references in
//! `vgpu_protocol::reference` (the builtin kernels are bit-identical to them).
//! A mismatch is an error, never a silent `verified: false`. `elapsed` covers the timed
//! loop only (first submission to last completion), not setup, upload or verification.
//! A caller that runs one workload repeatedly keeps its [`Expected`] result between runs,
//! so the CPU reference is computed once.

use std::time::Duration;

use crate::context::Context;
use crate::error::{Error, Result};

pub mod copy_heavy;
pub mod hotspot;
pub mod prng;
pub mod reduction;
pub mod saxpy;
pub mod sgemm;
pub mod throttle;

pub use copy_heavy::CopyHeavyConfig;
pub use hotspot::HotspotConfig;
pub use prng::XorShift;
pub use reduction::ReductionConfig;
pub use saxpy::SaxpyConfig;
pub use sgemm::SgemmConfig;
pub use throttle::ThrottleConfig;

/// What a workload run did.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadReport {
    pub name: &'static str,
    /// Loop iterations completed.
    pub iterations: u64,
    /// Time of the timed loop.
    pub elapsed: Duration,
    /// GPU work items submitted: kernel launches plus copy methods.
    pub gpu_items: u64,
    /// Whether results were checked against a CPU reference (and matched).
    pub verified: bool,
}

/// A workload's expected result, computed on the CPU by the first run that needs it and
/// kept by the caller for later runs of the same workload (same configuration, so the
/// same inputs). Every run still checks its own output against it; later runs then start
/// their timed loop after their setup and upload only, as a native program's loops do,
/// not after seconds of CPU reference with the GPU idle (its clocks ramp down within
/// ~20 ms: H100, 2026-11-27).
#[derive(Debug, Default)]
pub struct Expected(Option<Vec<f32>>);

impl Expected {
    /// The kept result, or `compute`'s (then kept).
    pub(crate) fn get_or(&mut self, compute: impl FnOnce() -> Vec<f32>) -> &[f32] {
        self.0.get_or_insert_with(compute)
    }
}

impl WorkloadReport {
    /// GPU work items per second of the timed loop.
    pub fn items_per_sec(&self) -> f64 {
        let s = self.elapsed.as_secs_f64();
        if s > 0.0 {
            self.gpu_items as f64 / s
        } else {
            0.0
        }
    }
}

/// Any workload with its configuration, so tools can pick one by name.
#[derive(Debug, Clone)]
pub enum Workload {
    Throttle(ThrottleConfig),
    Saxpy(SaxpyConfig),
    Sgemm(SgemmConfig),
    Hotspot(HotspotConfig),
    Reduction(ReductionConfig),
    CopyHeavy(CopyHeavyConfig),
}

impl Workload {
    /// Names accepted by [`Workload::by_name`].
    pub const NAMES: [&'static str; 6] = [
        "throttle",
        "saxpy",
        "sgemm",
        "hotspot",
        "reduction",
        "copy_heavy",
    ];

    /// The named workload at its default (benchmark) size, or its small (test) size.
    pub fn by_name(name: &str, small: bool) -> Option<Self> {
        Some(match (name, small) {
            ("throttle", false) => Workload::Throttle(ThrottleConfig::default()),
            ("throttle", true) => Workload::Throttle(ThrottleConfig::small()),
            ("saxpy", false) => Workload::Saxpy(SaxpyConfig::default()),
            ("saxpy", true) => Workload::Saxpy(SaxpyConfig::small()),
            ("sgemm", false) => Workload::Sgemm(SgemmConfig::default()),
            ("sgemm", true) => Workload::Sgemm(SgemmConfig::small()),
            ("hotspot", false) => Workload::Hotspot(HotspotConfig::default()),
            ("hotspot", true) => Workload::Hotspot(HotspotConfig::small()),
            ("reduction", false) => Workload::Reduction(ReductionConfig::default()),
            ("reduction", true) => Workload::Reduction(ReductionConfig::small()),
            ("copy_heavy", false) => Workload::CopyHeavy(CopyHeavyConfig::default()),
            ("copy_heavy", true) => Workload::CopyHeavy(CopyHeavyConfig::small()),
            _ => return None,
        })
    }

    pub fn name(&self) -> &'static str {
        match self {
            Workload::Throttle(_) => "throttle",
            Workload::Saxpy(_) => "saxpy",
            Workload::Sgemm(_) => "sgemm",
            Workload::Hotspot(_) => "hotspot",
            Workload::Reduction(_) => "reduction",
            Workload::CopyHeavy(_) => "copy_heavy",
        }
    }

    pub fn run(&self, ctx: &Context) -> Result<WorkloadReport> {
        self.run_expecting(ctx, &mut Expected::default())
    }

    /// [`Workload::run`], checking against `expected` (computed first if empty). Pass
    /// the same one only to runs of this very workload.
    pub fn run_expecting(&self, ctx: &Context, expected: &mut Expected) -> Result<WorkloadReport> {
        match self {
            Workload::Throttle(c) => throttle::run(ctx, c),
            Workload::Saxpy(c) => saxpy::run_expecting(ctx, c, expected),
            Workload::Sgemm(c) => sgemm::run_expecting(ctx, c, expected),
            Workload::Hotspot(c) => hotspot::run_expecting(ctx, c, expected),
            Workload::Reduction(c) => reduction::run(ctx, c),
            Workload::CopyHeavy(c) => copy_heavy::run(ctx, c),
        }
    }
}

/// Threads per block used for the (informational) launch grid.
const BLOCK: u64 = 256;

/// A 1-D launch grid covering `n` elements (kernels ignore the grid beyond validating it).
pub(crate) fn grid_1d(n: u64) -> [u32; 3] {
    let blocks = n.div_ceil(BLOCK).clamp(1, u32::MAX as u64);
    [blocks as u32, 1, 1]
}

/// Bytes of `n` f32 values.
pub(crate) fn f32_bytes(n: u64) -> Result<u64> {
    n.checked_mul(4)
        .filter(|&b| b > 0)
        .ok_or(Error::InvalidArgument("workload size out of range"))
}

/// Converts a size knob to `usize` for host-side vectors.
pub(crate) fn host_len(n: u64) -> Result<usize> {
    usize::try_from(n).map_err(|_| Error::InvalidArgument("size does not fit the host"))
}

/// Bit-exact comparison of GPU output with its CPU reference.
pub(crate) fn compare_f32(workload: &'static str, got: &[f32], want: &[f32]) -> Result<()> {
    if got.len() != want.len() {
        return Err(Error::Mismatch {
            workload,
            detail: format!("{} values, expected {}", got.len(), want.len()),
        });
    }
    match got
        .iter()
        .zip(want)
        .position(|(g, w)| g.to_bits() != w.to_bits())
    {
        None => Ok(()),
        Some(i) => Err(Error::Mismatch {
            workload,
            detail: format!("element {i}: GPU {} vs CPU {}", got[i], want[i]),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_and_compare() {
        assert_eq!(grid_1d(0), [1, 1, 1]);
        assert_eq!(grid_1d(257), [2, 1, 1]);
        assert!(compare_f32("t", &[1.0, 2.0], &[1.0, 2.0]).is_ok());
        assert!(compare_f32("t", &[1.0, -0.0], &[1.0, 0.0]).is_err());
        assert!(compare_f32("t", &[1.0], &[1.0, 2.0]).is_err());
    }

    #[test]
    fn names_round_trip() {
        for n in Workload::NAMES {
            assert_eq!(Workload::by_name(n, true).map(|w| w.name()), Some(n));
            assert_eq!(Workload::by_name(n, false).map(|w| w.name()), Some(n));
        }
        assert!(Workload::by_name("nope", true).is_none());
    }
}
