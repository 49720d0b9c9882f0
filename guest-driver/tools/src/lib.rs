//! Tools built on the `vgpu-guest` runtime: the `vgpu-bench` suites, the multi-tenant
//! demo, and shared helpers for reporting figures.

pub mod hidden_counters;
pub mod hostile;
pub mod report;
pub mod sched_rig;
pub mod smoke;
pub mod stats;
pub mod suites;
pub mod svg;
pub mod swap_check;
