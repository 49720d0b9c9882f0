//! `vgpu-bench`: the host side of the benchmarks and the demo. Its suites run a whole
//! `vgpu-backend` with loopback VMs (or the `sim` GPU natively) in one process; the
//! guest suite, the figures and the statistics come from the guest tools
//! (`vgpu-guest-tools`), so the same code measures in a VM and on the host.

pub mod churn;
pub mod proc_stats;
pub mod sched_rig;
pub mod suites;
pub mod svg;

pub use vgpu_guest_tools::{report, stats};
